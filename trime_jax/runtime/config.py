"""The checks of the `train` section both trainers share (`check_train_section`): the optimizer and schedule by
name, the cadences and ranges whose bad values would divide by zero mid-run or silently train something else, and
the fields of the shared loop (runtime/loop.py: progress, profile_steps, stop_after). Each trainer's validator
(train_config.py, mt/train_config.py) calls it and adds its own fields."""

from __future__ import annotations

from trime_jax.errors import ConfigError
from trime_jax.runtime.optim import OPTIMIZERS, SCHEDULES

PROGRESS = ("auto", "bar", "log")  # train.progress: a tqdm bar where someone watches | always | ETA in log lines


def choice(value, allowed, name: str) -> None:
  """ConfigError naming the field unless `value` is one of `allowed`."""
  if value not in allowed:
    raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")


def check_train_section(train_cfg) -> None:
  """ConfigError naming the first field of the shared `train` section that is out of range or unknown."""
  choice(train_cfg.optimizer, OPTIMIZERS, "train.optimizer")
  choice(train_cfg.schedule, SCHEDULES, "train.schedule")
  at_least = [("train.num_steps", train_cfg.num_steps, 1), ("train.log_every", train_cfg.log_every, 1),
              ("train.checkpoint_every", train_cfg.checkpoint_every, 1),
              ("train.keep_checkpoints", train_cfg.keep_checkpoints, 1),
              ("train.warmup_steps", train_cfg.warmup_steps, 0), ("train.eval_every", train_cfg.eval_every, 0),
              ("train.vocab_chunk", train_cfg.vocab_chunk, 0), ("train.num_devices", train_cfg.num_devices, 0),
              ("train.stop_after", train_cfg.stop_after, 0), ("train.seed", train_cfg.seed, 0)]
  for name, value, low in at_least:
    if value < low:
      raise ConfigError(f"{name} must be >= {low}, got {value}")
  for name, value in [("train.learning_rate", train_cfg.learning_rate), ("train.adam_eps", train_cfg.adam_eps)]:
    if not value > 0:
      raise ConfigError(f"{name} must be > 0, got {value}")
  for name, value in [("train.weight_decay", train_cfg.weight_decay), ("train.clip_norm", train_cfg.clip_norm),
                      ("train.warmup_init_lr", train_cfg.warmup_init_lr), ("train.min_lr", train_cfg.min_lr)]:
    if not 0 <= value < float("inf"):  # NaN too: clip_norm=nan turned clipping off silently (nan > 0 is False)
      raise ConfigError(f"{name} must be >= 0, got {value}")
  choice(train_cfg.progress, PROGRESS, "train.progress")
  profile_steps(train_cfg)


def profile_steps(train_cfg) -> tuple[int, int] | None:
  """`train.profile_steps` as (first, last) updates to trace, 1-based and inclusive like the log lines'
  numbers ("10,12": updates 10, 11 and 12; "10": update 10 only), or None when it is empty."""
  text = str(train_cfg.profile_steps).strip()
  if not text:
    return None
  try:
    parts = [int(x) for x in text.split(",")]
  except ValueError:
    parts = []
  if len(parts) not in (1, 2):
    raise ConfigError(f"train.profile_steps must be 'FIRST,LAST' or 'STEP' (update numbers), got {text!r}")
  first, last = parts[0], parts[-1]
  if not 1 <= first <= last <= train_cfg.num_steps:
    raise ConfigError(f"train.profile_steps={text!r} must satisfy 1 <= first <= last <= train.num_steps="
                      f"{train_cfg.num_steps}")
  return first, last
