"""Import a fairseq `transformer_lm` checkpoint of the original TRIME release as a trime-jax export.

  python -m trime_jax.launch.import_fairseq --checkpoint=pretrained_models/wiki103-247M-trime/checkpoint_best.pt \\
      --dict=data-bin/wikitext-103/dict.txt --out=runs/wiki103-247M-trime/export

The export is what `trime_jax.launch.eval`, `trime_jax.launch.eval_ext` and `trime_jax.launch.build_datastore` read; its
vocabulary is fairseq's (`<s>`, `<pad>`, `</s>`, `<unk>`, then dict.txt), so `--config=configs/wiki103_247m.py`
evaluates it on the WikiText-103 token files with fairseq's token ids. Needs PyTorch to read the file: pip install -e
".[fairseq]". docs/paper_models.md, "Importing the original checkpoints".
"""

import os

from absl import flags

from trime_jax.launch.entry import run_main
from trime_jax.launch.outputs import check_output_path, refuse_target

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "fairseq checkpoint (.pt) of a transformer_lm.")
CHECKPOINT_IS_EXPORT = False  # run_main: --checkpoint is a fairseq .pt, not read as an export path
_DICT = flags.DEFINE_string("dict", None, "fairseq dict.txt the checkpoint was trained with.")
_OUT = flags.DEFINE_string("out", None, "Export directory to write.")
_KEY_TYPE = flags.DEFINE_enum("key_type", "last_ffn_input", ["last_ffn_input", "final"],
                              "Memory keys: last_ffn_input (--knn-keytype last_ffn_input, every released model's "
                              "evaluation) or final (model_output).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Compute dtype of the exported model (model.dtype); float32 reproduces fairseq's numbers.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace --out when it already holds something (an import "
                               "of another checkpoint file, a trained export, any files); without it that is "
                               "refused. A rerun replaces its own import (of the same checkpoint file) without it.")
_TRUST = flags.DEFINE_bool("trust_pickle", False, "Unpickle the whole file (arbitrary Python objects). Only for "
                           "checkpoints you trust; by default only tensors, containers and argparse.Namespace load.")


def main(argv):
  del argv
  from trime_jax import fairseq_import
  from trime_jax.errors import ConfigError
  from trime_jax.model import count_params

  for name, flag in (("checkpoint", _CHECKPOINT), ("dict", _DICT), ("out", _OUT)):
    if not flag.value:
      raise ConfigError(f"--{name} is required")
  # --out must not be, or hold, the files the import reads: --overwrite replaced a checkpoint given as --out (or
  # kept in the --out folder) by the export made from it (found by a review).
  check_output_path(_OUT.value, "out", reads=[("--checkpoint", _CHECKPOINT.value), ("--dict", _DICT.value)])
  # Before reading anything: an export (a trained model's, say) at --out is not replaced without --overwrite,
  # unless it is this command's own output (an import of the same checkpoint file): a rerun imports it again.
  own = _imported_from(_OUT.value) == os.path.abspath(_CHECKPOINT.value)
  refuse_target(_OUT.value, "out", "an empty folder for the import", overwrite=_OVERWRITE.value or own)
  out, imp = fairseq_import.import_to_export(_CHECKPOINT.value, _DICT.value, _OUT.value, key_type=_KEY_TYPE.value,
                                             dtype=_DTYPE.value, trust_pickle=_TRUST.value,
                                             overwrite=_OVERWRITE.value or own)
  c = imp.cfg
  print(f"imported {imp.flags.get('arch') or imp.flags.get('_name')}: {count_params(imp.params):,} parameters, "
        f"{c.num_layers} layers, d_model={c.d_model}, vocab={len(imp.vocab):,}, positions={c.positions}, "
        f"final_norm={c.final_norm}, adaptive_input={c.adaptive_input}, adaptive_softmax={c.adaptive_softmax} "
        f"cutoffs={c.adaptive_cutoffs}")
  print(f"wrote {out}" + (" (replacing its earlier import of the same checkpoint file)" if own else ""))


def _imported_from(directory: str) -> str | None:
  """The checkpoint file an import at `directory` was made from (its meta.json's imported_from), else None."""
  from trime_jax import exports

  try:
    return exports.read_export_meta(directory).get("imported_from") if os.path.isdir(directory) else None
  except Exception:  # noqa: BLE001 - not an import (or no export at all): refuse_target says what it is
    return None


if __name__ == "__main__":
  run_main(main, checkpoint_is_export=CHECKPOINT_IS_EXPORT)
