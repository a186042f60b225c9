"""The optimizer and learning-rate schedule of `config.train`, for both trainers (fairseq's adam / nag and
SRU++'s radam; inverse-sqrt, cosine or constant after a linear warm-up)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from trime_jax.errors import ConfigError

OPTIMIZERS = ("adam", "nag", "radam")
SCHEDULES = ("inverse_sqrt", "cosine", "constant", "torch_cosine")
# Schedules whose shape depends on train.num_steps (a longer run is not the same run made longer)
NUM_STEPS_SCHEDULES = ("cosine", "torch_cosine")


def make_schedule(train_cfg) -> optax.Schedule:
  """Linear warm-up from `warmup_init_lr` to `learning_rate`, then inverse-sqrt, cosine or constant; or
  "torch_cosine", the SRU++ enwik8 script's: torch's CosineAnnealingLR over all train.num_steps updates, stepped
  from update 0, its rate overwritten during the warm-up by lr·(n+1)/W. Stepped from the rate the warm-up left,
  the chained cosine gives update n >= W the rate lr·(1 + cos(πn/T)) / (1 + cos(π(W-1)/T)): the cosine timed
  from update 0, scaled to meet the warm-up's end (not squeezed into the T - W updates after it)."""
  peak, warm = float(train_cfg.learning_rate), int(train_cfg.warmup_steps)
  if train_cfg.schedule == "torch_cosine":
    total = max(int(train_cfg.num_steps), 1)
    meet = 1.0 + math.cos(math.pi * (warm - 1) / total) if warm else 2.0

    def torch_cosine(step):
      n = jnp.asarray(step, jnp.float32)
      after = peak * (1.0 + jnp.cos(jnp.pi * n / total)) / meet
      return jnp.where(n < warm, peak * (n + 1.0) / max(warm, 1), after) if warm else after

    return torch_cosine
  init = float(train_cfg.warmup_init_lr) if warm else peak
  rise = (peak - init) / max(warm, 1)
  # fairseq's warm-up, init + n·(peak - init)/W: exact at update 0 (optax.linear_schedule computes
  # (init - peak) + peak there, 1.19e-7 in float32 for the 247M's 1e-7 → 1.0)
  warmup = lambda s: init + rise * jnp.minimum(jnp.asarray(s, jnp.float32), max(warm, 1))
  if train_cfg.schedule == "inverse_sqrt":  # fairseq: lr · sqrt(warmup / step) after the warm-up
    decay = lambda s: peak * jnp.sqrt(max(warm, 1) / jnp.maximum(s + max(warm, 1), 1))
  elif train_cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(peak, max(int(train_cfg.num_steps) - warm, 1),
                                        alpha=float(train_cfg.min_lr) / peak)
  elif train_cfg.schedule == "constant":
    decay = optax.constant_schedule(peak)
  else:  # a misspelt name must not train with another schedule
    raise ConfigError(f"train.schedule must be one of {SCHEDULES}, got {train_cfg.schedule!r}")
  return optax.join_schedules([warmup, decay], [warm]) if warm else decay


def make_optimizer(train_cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = make_schedule(train_cfg)
  if train_cfg.optimizer == "adam":
    opt = optax.adamw(schedule, b1=train_cfg.adam_b1, b2=train_cfg.adam_b2, eps=train_cfg.adam_eps,
                      weight_decay=train_cfg.weight_decay)
  elif train_cfg.optimizer == "radam":  # SRU++'s enwik8 script: RAdam, its weight decay decoupled (p -= lr·wd·p)
    opt = optax.chain(optax.scale_by_radam(b1=train_cfg.adam_b1, b2=train_cfg.adam_b2, eps=train_cfg.adam_eps),
                      optax.add_decayed_weights(train_cfg.weight_decay), optax.scale_by_learning_rate(schedule))
  elif train_cfg.optimizer == "nag":  # fairseq `nag`: SGD with Nesterov momentum; its weight decay is decoupled
    # (p *= 1 - lr·wd), outside the momentum, like Adam's
    opt = optax.chain(optax.trace(decay=train_cfg.nag_momentum, nesterov=True),
                      optax.add_decayed_weights(train_cfg.weight_decay), optax.scale_by_learning_rate(schedule))
  else:  # a misspelt name must not train with another optimizer
    raise ConfigError(f"train.optimizer must be one of {OPTIMIZERS}, got {train_cfg.optimizer!r}")
  if train_cfg.clip_norm > 0:
    opt = optax.chain(optax.clip_by_global_norm(train_cfg.clip_norm), opt)
  return opt, schedule


def at_update(opt_state, n: int):
  """`opt_state` whose schedule counts say `n` updates were applied (the learning rate continues at update n)
  while every other part (Adam's moments and their bias-correction count, momentum) stays as given: a warm
  restart's fresh optimizer state (train.init_from)."""
  def fix(s):
    return s._replace(count=jnp.full_like(s.count, n)) if isinstance(s, optax.ScaleByScheduleState) else s

  return jax.tree_util.tree_map(fix, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
