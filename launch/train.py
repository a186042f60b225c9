"""Train a TrimeLM (or a vanilla LM with --config.trime.memory=none).

  python -m trime_jax.launch.train --config=configs/wikitext_mini.py --workdir=runs/mini [--config.train.num_steps=500]

Rerunning the same command resumes from the newest checkpoint in the workdir. On SIGTERM (a preempted VM or
job; on multi-host / TPU runs JAX's preemption notice) the run finishes the update it is in, checkpoints it,
and exits with status 143 (128 + SIGTERM, so schedulers see a terminated, not a finished, job); the same
command then resumes exactly where it stopped. Exit status 0: trained, evaluated and exported.

`--workdir` is required for training (there is no default run directory); one run per workdir: a second one
exits with status 2 naming the process that holds it. Ctrl-C stops at the end of the update in
progress (a second one at once) and exits with status 130 saying which checkpoint (if any) is on disk to resume
from.

`--dry_run` prints the parameter count and the per-device memory plan (parameters, optimizer state, XLA's
compiled plan of one train step at the configured batch) and exits without training.
"""

from absl import flags
from ml_collections import config_flags

from trime_jax.launch.checks import validated
from trime_jax.launch.entry import run_main, train_in_workdir

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics.jsonl, export/); required "
                               "unless --dry_run.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print parameters and the per-device memory plan; do not train.")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  from trime_jax.train import format_memory_plan, memory_plan, train_and_evaluate

  config = validated(_CONFIG.value, training=True)  # a translation config: said as such (it was an AttributeError traceback)
  if _DRY_RUN.value:
    print(format_memory_plan(memory_plan(config)), flush=True)
    return
  train_in_workdir(train_and_evaluate, config, _WORKDIR.value, example="runs/mini")


if __name__ == "__main__":
  run_main(main)
