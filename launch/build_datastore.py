"""Build the external-memory datastore (keys g(c) + next tokens) of a corpus split, then its FAISS index.

  python -m launch.build_datastore --config=configs/wikitext_mini.py --checkpoint=runs/mini/export \
      --out=runs/mini/datastore [--split=train] [--index=auto|flat|ivfpq|none] [--nlist=4096] [--pq_m=64]

The model and vocabulary come from the checkpoint; `--config` supplies the data and the evaluation windows
(eval.block_len, eval.context_window, eval.batch_size). Rerunning the same command resumes an interrupted
datastore build; a complete one is reused and only the index is rebuilt.

Translation (a config with task="mt", or an MT export): the teacher-forced decoder keys of every target token of
the training pairs (trime_jax/mt/datastore.py), same files and index; --split=train|dev|test (dev = valid).
"""

import sys

from absl import flags
from ml_collections import config_flags

from launch.common import run_main, validated

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (data + eval sections).", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Exported checkpoint directory (<workdir>/export).")
_OUT = flags.DEFINE_string("out", None, "Datastore directory (keys.npy, values.npy, meta.json, index.faiss).")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "dev", "test"], "Corpus split stored in the datastore.")
_INDEX = flags.DEFINE_enum("index", "auto", ["auto", "flat", "ivfpq", "none"],
                           "FAISS index: auto = the cheaper of exact IndexFlatIP and IVF-PQ for the searches "
                           "launch.eval_ext runs (dev + test tokens, eval.knn_k, eval.nprobe); it says which and why.")
_NLIST = flags.DEFINE_integer("nlist", 4096, "IVF-PQ inverted lists (clamped for small stores).")
_SUBSET_OF = flags.DEFINE_string("subset_of", "", "A datastore (complete, or a build in progress that has finished "
                                 "--entries tokens): --out gets its first --entries entries "
                                 "(no keys recomputed; datastore-size sweeps), then its own index.")
_ENTRIES = flags.DEFINE_integer("entries", 0, "With --subset_of: how many entries (the first ones, stream order).")
_STOP_AT = flags.DEFINE_integer("stop_at_tokens", 0, "Stop the build once its first this many tokens are done "
                                "(whole chunks; it stays incomplete, a rerun without the flag resumes): enough "
                                "for --subset_of without the whole build.")
_PQ_M = flags.DEFINE_integer("pq_m", 64, "IVF-PQ sub-quantizers (clamped to a divisor of the key dimension).")
_TRAINED_INDEX = flags.DEFINE_string("trained_index", "", "A trained, empty IVF-PQ faiss file (e.g. the original "
                                     "release's knn.index.ip.trained): its centroids and codebooks are used as "
                                     "they are and only the keys are added (implies --index=ivfpq).")
flags.mark_flags_as_required(["config", "checkpoint", "out"])


def main(argv):
  del argv
  from trime_jax import checkpoint as ckpt
  from trime_jax import evaluate
  from trime_jax.datastore import Datastore, build_datastore, build_index, subset_datastore
  from trime_jax.mt import datastore as mt_datastore

  if mt_datastore.is_mt(_CONFIG.value, _CHECKPOINT.value):  # translation: its own data and keys
    mt_datastore.build_main(_CONFIG.value, _CHECKPOINT.value, _OUT.value, split=_SPLIT.value,
                            index_kind=_INDEX.value, nlist=_NLIST.value, pq_m=_PQ_M.value)
    return
  config, checkpoint, out = validated(_CONFIG.value), _CHECKPOINT.value, _OUT.value
  splits = evaluate.load_eval_data(config, ckpt.read_export_vocab(checkpoint))
  corpus = splits.get(_SPLIT.value)
  e = config.eval
  try:
    if _SUBSET_OF.value:
      # the source may be a build in progress; it must hold this model's keys (checked before writing)
      subset_datastore(_SUBSET_OF.value, out, _ENTRIES.value, checkpoint_dir=checkpoint)
    else:
      meta = build_datastore(checkpoint, corpus, out, block_len=e.block_len, context_window=e.context_window,
                             batch_size=e.batch_size, stop_at_tokens=_STOP_AT.value or None,
                             key_dtype=e.datastore_key_dtype, entries=e.datastore_entries)
      if not meta["complete"]:  # stopped at --stop_at_tokens: no index for an incomplete datastore
        return
  except KeyboardInterrupt:
    print(f"interrupted: the datastore in {out} keeps every finished chunk; rerun the same command to resume",
          file=sys.stderr, flush=True)
    sys.exit(130)
  if _INDEX.value != "none":
    # The searches launch.eval_ext will run: one per scored token of dev (tuning) and test.
    cap = e.max_tokens or None
    queries = sum(min(len(splits.get(s)), cap or len(splits.get(s))) for s in ("dev", "test"))
    build_index(Datastore(out), kind=_INDEX.value, nlist=_NLIST.value, pq_m=_PQ_M.value, queries=queries,
                k=e.knn_k, nprobe=e.nprobe, trained_index=_TRAINED_INDEX.value or None)


if __name__ == "__main__":
  run_main(main)
