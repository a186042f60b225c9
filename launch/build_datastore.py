"""Build the external-memory datastore (keys g(c) + next tokens) of a corpus split, then its FAISS index.

  python -m trime_jax.launch.build_datastore --config=configs/wikitext_mini.py --checkpoint=runs/mini/export \\
      --out=runs/mini/datastore [--split=train] [--index=auto|flat|ivfpq|none] [--nlist=4096] [--pq_m=64]
      [--index_metric=ip|l2]

The model and vocabulary come from the checkpoint; `--config` supplies the data and the evaluation windows
(eval.block_len, eval.context_window, eval.batch_size). Rerunning the same command resumes an interrupted
datastore build; a complete one is reused, and so is a complete index of it with the same parameters (other
parameters: the index is built again). --index_metric=l2 builds the datastore's L2 index instead
(<out>/index_l2.faiss; the original release's build_dstore.py --dist l2), which eval.knnlm_metric=l2 (the
original's kNN-LM baseline) reads beside the inner-product <out>/index.faiss: rerun the datastore's command with
it, without --overwrite, to add it (the keys are reused).

Translation (a config with task="mt", or an MT export): the teacher-forced decoder keys of every target token of
the training pairs (trime_jax/mt/datastore.py), same files and index; --split=train|dev|test (dev = valid).
"""

import json
import os
import shutil
import sys

from absl import flags
from ml_collections import config_flags

from trime_jax.launch.checks import check_data_split, check_export, validated
from trime_jax.launch.entry import run_main
from trime_jax.launch.flags import config_given
from trime_jax.launch.outputs import check_output_path, refuse_target

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (data + eval sections).", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Exported checkpoint directory (<workdir>/export).")
_OUT = flags.DEFINE_string("out", None, "Datastore directory (keys.npy, values.npy, meta.json, index.faiss).")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "dev", "test"], "Corpus split stored in the datastore.")
_INDEX = flags.DEFINE_enum("index", "auto", ["auto", "flat", "ivfpq", "none"],
                           "FAISS index: auto = the cheaper of exact IndexFlatIP and IVF-PQ for the searches "
                           "trime_jax.launch.eval_ext runs (dev + test tokens, eval.knn_k, eval.nprobe); it says which "
                           "and why.")
_INDEX_METRIC = flags.DEFINE_enum("index_metric", "ip", ["ip", "l2"],
                                  "Metric of the FAISS index: ip = inner product (<out>/index.faiss: every family, "
                                  "TRIME's similarity) | l2 (<out>/index_l2.faiss: the original release's kNN-LM "
                                  "baseline, read by eval.knnlm_metric=l2; rerun the datastore's command with it "
                                  "without --overwrite to add it, the keys are reused).")
_NLIST = flags.DEFINE_integer("nlist", 4096, "IVF-PQ inverted lists (clamped for small stores).", lower_bound=1)
_SUBSET_OF = flags.DEFINE_string("subset_of", "", "A datastore (complete, or a build in progress that has finished "
                                 "--entries tokens): --out gets its first --entries entries "
                                 "(no keys recomputed; datastore-size sweeps), then its own index.")
_ENTRIES = flags.DEFINE_integer("entries", 0, "With --subset_of: how many entries (the first ones, stream order).",
                                lower_bound=0)
_STOP_AT = flags.DEFINE_integer("stop_at_tokens", 0, "Stop the build once its first this many tokens are done "
                                "(whole chunks; it stays incomplete, a rerun without the flag resumes): enough "
                                "for --subset_of without the whole build.", lower_bound=0)
_PQ_M = flags.DEFINE_integer("pq_m", 64, "IVF-PQ sub-quantizers (clamped to a divisor of the key dimension).",
                             lower_bound=1)
_TRAINED_INDEX = flags.DEFINE_string("trained_index", "", "A trained, empty IVF-PQ faiss file (e.g. the original "
                                     "release's knn.index.ip.trained; its knn.index.l2.trained with --index_metric=l2): "
                                     "its centroids and codebooks are used as they are and only the keys are added "
                                     "(implies --index=ivfpq).")
_DEVICES = flags.DEFINE_integer("devices", None, "Devices the key pass splits its forward batches over (0: all "
                                "visible; 1: the default device; default: the config's eval.devices, as "
                                "evaluation).", lower_bound=0)
_ALLOW_OVERLAP = flags.DEFINE_bool("allow_split_overlap", False, "Build although the data section draws the splits "
                                   "otherwise than the export's training did (the stored split then holds the "
                                   "export's dev / test text, which evaluation would retrieve). Refused without this "
                                   "flag.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace what --out holds (another datastore, an export, any "
                               "files) instead of refusing it; without it a build of the same datastore resumes.")
flags.mark_flags_as_required(["config", "checkpoint", "out"])


def _check_flag_combinations(out: str) -> None:
  """Flags that contradict each other or would be ignored: one line before anything is read or written (the
  lock of --out makes its parent folders)."""
  from trime_jax.errors import ConfigError

  if _SUBSET_OF.value and _ENTRIES.value < 1:
    raise ConfigError(f"--subset_of needs --entries >= 1 (the number of entries to keep), got {_ENTRIES.value}")
  if not _SUBSET_OF.value and _ENTRIES.value:
    raise ConfigError("--entries is read with --subset_of (a datastore to take the first entries of)")
  if _SUBSET_OF.value and _STOP_AT.value:
    raise ConfigError("--stop_at_tokens stops a build; --subset_of copies entries and builds nothing")
  if _INDEX_METRIC.value == "l2" and _INDEX.value == "none":
    raise ConfigError("--index_metric=l2 sets the metric of the index to build; --index=none builds none")
  for name in ("nlist", "pq_m"):
    if flags.FLAGS[name].present and _INDEX.value in ("flat", "none"):
      raise ConfigError(f"--{name} sets the IVF-PQ index; --index={_INDEX.value} builds none")
  given = [f"--{name}" for name in ("nlist", "pq_m") if flags.FLAGS[name].present]
  if _TRAINED_INDEX.value and given:  # refused, not ignored
    raise ConfigError(f"{', '.join(given)}: --trained_index fixes the index's lists and sub-quantizers (drop "
                      f"{'them' if len(given) > 1 else 'it'})")
  if _TRAINED_INDEX.value and _INDEX.value in ("flat", "none"):
    raise ConfigError(f"--trained_index is an IVF-PQ index to fill; --index={_INDEX.value} builds "
                      f"{'an exact one' if _INDEX.value == 'flat' else 'none'} (drop --index or give --index=ivfpq)")
  if _SUBSET_OF.value and os.path.abspath(_SUBSET_OF.value) == os.path.abspath(out):
    raise ConfigError(f"--subset_of and --out are the same directory ({out})")
  check_output_path(out, "out", reads=[("--checkpoint", _CHECKPOINT.value), ("--subset_of", _SUBSET_OF.value),
                                       ("--trained_index", _TRAINED_INDEX.value)])


def _check_out(out: str, d_model: int | None = None, *, remove: bool = True) -> None:
  """Under --out's lock: a --trained_index that cannot be used (keys of `d_model`) and an --out that holds
  something else, before any work; --overwrite removes what --out holds only now (`remove`: False checks only,
  before the corpus is read; the removal waits until it has been read)."""
  if _TRAINED_INDEX.value and d_model:  # read now, not after the key pass
    from trime_jax.datastore.index import check_trained_index

    check_trained_index(_TRAINED_INDEX.value, int(d_model), _metric())
  from trime_jax.errors import ConfigError

  what = refuse_target(out, "out", "a datastore", ok=("a datastore",), overwrite=_OVERWRITE.value)
  if what == "a datastore" and _OVERWRITE.value and _INDEX_METRIC.value == "l2":
    # the advice for adding an L2 index is to rerun the datastore's command: with its --overwrite that would
    # delete the datastore and its inner-product index, and compute every key again
    raise ConfigError(f"--index_metric=l2 adds the L2 index to the datastore at --out={out}; --overwrite would "
                      "remove that datastore (its keys and inner-product index) first: drop --overwrite")
  if what and _OVERWRITE.value and remove:  # asked for; the old contents go only now, after every flag was checked
    print(f"--overwrite: removing {out} ({what})", flush=True)
    if os.path.isdir(out) and not os.path.islink(out):
      shutil.rmtree(out)
    else:
      os.remove(out)


def _metric() -> str:
  """--index_metric as the index builder names it."""
  return "l2" if _INDEX_METRIC.value == "l2" else "inner_product"


def _interrupted(out: str, subset: bool = False) -> None:
  """Ctrl-C: say what the datastore build or, once the datastore is complete, the index build left to resume
  from (a subset copy: nothing, it restarts); exit 130."""
  from trime_jax.datastore.index import default_index_path, saved_state

  try:
    with open(os.path.join(out, "meta.json")) as f:
      complete = bool(json.load(f).get("complete"))
  except (OSError, ValueError, AttributeError):
    complete = False
  if complete:
    kept = f"the index build of {out} keeps {saved_state(default_index_path(out, _metric()))}"
  elif subset:
    print(f"interrupted: the subset copy into {out} was removed (a copy keeps nothing to resume from); rerun the "
          "same command to copy it again", file=sys.stderr, flush=True)
    sys.exit(130)
  else:
    kept = f"the datastore in {out} keeps every finished chunk"
  print(f"interrupted: {kept}; rerun the same command to resume", file=sys.stderr, flush=True)
  sys.exit(130)


def main(argv):
  del argv
  import jax

  from trime_jax.errors import ConfigError
  from trime_jax.runtime.lock import beside as lock_beside

  if jax.process_count() > 1:  # every process would write the same files (refused by each, so none waits)
    raise ConfigError(f"build_datastore runs as one process (this is one of {jax.process_count()}): its key pass "
                      "splits over the devices of one host (--devices); run it without trime_jax.distributed")
  _check_flag_combinations(_OUT.value)
  # One writer of --out from the first look at it (--overwrite removes what it holds only under the lock, so
  # never a build another process is running) to the index; the builders' own locks are the same one, reentrant.
  with lock_beside(_OUT.value, f"datastore {_OUT.value}"):
    _build(_OUT.value)


def _build(out: str) -> None:
  from trime_jax import exports, sharding
  from trime_jax import evaluate
  from trime_jax.datastore import Datastore, build_datastore, build_index, subset_datastore
  from trime_jax.mt import datastore as mt_datastore

  from trime_jax.errors import CheckpointError, ConfigError

  if not os.path.isdir(_CHECKPOINT.value):
    raise CheckpointError(f"--checkpoint={_CHECKPOINT.value}: export directory not found")
  if mt_datastore.is_mt(_CONFIG.value, _CHECKPOINT.value):  # translation: its own data and keys
    if config_given() and not exports.is_mt_config(_CONFIG.value):  # mt_config would read the export's instead
      raise ConfigError(f"--checkpoint={_CHECKPOINT.value} is a translation export and --config (or a --config.x "
                        "override) a language-model config: give a translation config (configs/ui_de_en.py's "
                        "schema) or no --config (the export's own)")
    lm_only = [f"--{h.name}" for h in (_SUBSET_OF, _ENTRIES, _STOP_AT, _TRAINED_INDEX, _DEVICES) if h.present]
    lm_only += ["--index_metric=l2"] if _INDEX_METRIC.value == "l2" else []
    if lm_only:  # read by the language model's build only: refused, not ignored
      raise ConfigError(f"{', '.join(lm_only)}: not supported for a translation datastore (the language model's "
                        "builds only); a translation build takes --split, --index, --nlist, --pq_m, --overwrite")
    _check_out(out)
    try:
      mt_datastore.build_main(_CONFIG.value, _CHECKPOINT.value, out, split=_SPLIT.value,
                              index_kind=_INDEX.value, nlist=_NLIST.value, pq_m=_PQ_M.value)
    except KeyboardInterrupt:
      _interrupted(out)
    return
  config, checkpoint = validated(_CONFIG.value), _CHECKPOINT.value
  check_export(config, checkpoint)
  # eval_ext compares the datastore's split with the scored ones by content: a train split drawn otherwise (another
  # data.split_seed) holds the export's test text under another fingerprint, and only this check sees it
  check_data_split(config, checkpoint, allow=_ALLOW_OVERLAP.value,
                   effect=f"the datastore's {_SPLIT.value} split holds text of the export's other splits "
                   "(evaluation would retrieve its dev / test text)")
  d_model = exports.read_export_meta(checkpoint).get("d_model")
  _check_out(out, d_model, remove=False)  # before the corpus is read (WikiText-103's: minutes), removed after
  splits = evaluate.load_eval_data(config, exports.read_export_vocab(checkpoint))
  e = config.eval
  # One setting for both forward passes over a corpus, the key pass's and evaluation's
  devices = _DEVICES.value if _DEVICES.value is not None else e.get("devices", 1)
  sharding.make_mesh(devices, what="--devices" if _DEVICES.value is not None else "eval.devices")
  _check_out(out, d_model)
  corpus = splits.get(_SPLIT.value)
  try:
    if _SUBSET_OF.value:
      # the source may be a build in progress; it must hold this model's keys (checked before writing)
      there = os.path.exists(os.path.join(out, "meta.json"))  # a finished subset: kept as it is
      meta = subset_datastore(_SUBSET_OF.value, out, _ENTRIES.value, checkpoint_dir=checkpoint)
      print(f"datastore {out}: the first {meta['count']:,} entries of {_SUBSET_OF.value} "
            + ("(there already)" if there else f"(copied in {meta['build_seconds']:.1f} s, keys not recomputed)"),
            flush=True)
    else:
      meta = build_datastore(checkpoint, corpus, out, block_len=e.block_len, context_window=e.context_window,
                             batch_size=e.batch_size, stop_at_tokens=_STOP_AT.value or None,
                             key_dtype=e.datastore_key_dtype, entries=e.datastore_entries, devices=devices)
      if not meta["complete"]:  # stopped at --stop_at_tokens: no index for an incomplete datastore
        return
  except KeyboardInterrupt:
    _interrupted(out, subset=bool(_SUBSET_OF.value))
  if _INDEX.value != "none":
    # The searches trime_jax.launch.eval_ext will run: one per scored token of dev (tuning) and test.
    cap = e.max_tokens or None
    queries = sum(min(len(splits.get(s)), cap or len(splits.get(s))) for s in ("dev", "test"))
    try:
      build_index(Datastore(out), kind=_INDEX.value, nlist=_NLIST.value, pq_m=_PQ_M.value, queries=queries,
                  k=e.knn_k, nprobe=e.nprobe, trained_index=_TRAINED_INDEX.value or None, reuse=True,
                  metric=_metric())
    except KeyboardInterrupt:
      _interrupted(out)


if __name__ == "__main__":
  run_main(main)
