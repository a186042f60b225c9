"""Train a translation model: vanilla Transformer (trime.memory=none) or TrimeMT_ext (trime.memory=ext).

  python -m trime_jax.launch.train_mt --config=configs/ui_de_en.py --workdir=runs/ui_vanilla
  python -m trime_jax.launch.train_mt --config=configs/ui_de_en.py --config.trime.memory=ext \\
      --config.trime.batching=bm25 --workdir=runs/ui_trime_bm25

Rerunning the same command resumes from the newest checkpoint in the workdir (`--config.train.stop_after=N`
trains at most N updates per invocation). SIGTERM checkpoints the current update and exits with status 143.
Exit status 0: trained, evaluated on valid and exported to <workdir>/export (trime_jax.mt.export.load_mt_export);
with train.keep_best, the best valid parameters to <workdir>/best (train.best_metric: the lowest perplexity,
or the highest BLEU). TensorBoard: <workdir>/tb.
`--workdir` is required; one run per workdir (a second exits with status 2 naming the process that holds it);
Ctrl-C stops at the end of the update in progress (a second one at once) and exits with status 130 saying
which checkpoint (if any) is on disk to resume from.
"""

from absl import flags
from ml_collections import config_flags

from trime_jax.launch.entry import run_main, train_in_workdir

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/ui_de_en.py, configs/iwslt_de_en.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics.jsonl, export/); required.")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  from trime_jax.mt.train import train_and_evaluate

  train_in_workdir(train_and_evaluate, _CONFIG.value, _WORKDIR.value, example="runs/ui_vanilla")


if __name__ == "__main__":
  run_main(main)
