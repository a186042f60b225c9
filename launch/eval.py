"""Evaluate an exported checkpoint: perplexity (and bits per byte for byte-level data).

  python -m launch.eval --config=configs/wikitext_mini.py --checkpoint=runs/mini/export \
      [--config.eval.split=test] [--config.eval.memory=local|none|cache] [--config.eval.tune=True]

The model and vocabulary come from the checkpoint; `--config` supplies the data and the `eval` section.
"""

import json
import os

from absl import flags
from ml_collections import config_flags

from launch.common import run_main

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (data + eval sections).", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Exported checkpoint directory (<workdir>/export).")
_OUTPUT = flags.DEFINE_string("output", "", "Optional JSON file for the results.")
flags.mark_flags_as_required(["config", "checkpoint"])


def main(argv):
  del argv
  from trime_jax import evaluate as E
  from trime_jax.runs import evaluate_checkpoint

  rows = evaluate_checkpoint(_CONFIG.value, _CHECKPOINT.value, progress=True)
  print(E.format_table(rows))
  if _OUTPUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  run_main(main)
