"""The language-model trainer's config checks (`validate_config`): every enum, range and consistency rule a
locked ConfigDict cannot express, raised as one ConfigError before anything is compiled. The evaluation CLIs
apply the same checks (launch/checks.validated)."""

from __future__ import annotations

import math

import jax

from trime_jax import corpora
from trime_jax.batching import consecutive
from trime_jax import data
from trime_jax import evaluate
from trime_jax import flash_attention
from trime_jax import model as model_lib
from trime_jax import sharded_loss
from trime_jax import specs
from trime_jax.errors import ConfigError
from trime_jax.loss import MEMORY_MODES
from trime_jax.runtime import workdir
from trime_jax.runtime.config import check_train_section, choice as _choice

BATCHINGS = ("random", "consecutive", "bm25")
CONSECUTIVE_LAYOUTS = ("stream", "packed")


# ----------------------------------------------------------------------------------------------------------
# Config checks
# ----------------------------------------------------------------------------------------------------------
def validate_config(config, *, training: bool = True) -> None:
  """Clear errors for values a locked ConfigDict cannot catch (enums, ranges, consistency; a field set under a
  name retired by a rename, which an unlocked config would add unread). `training=False` (the evaluation
  programs, an export's stored config): not the checks of how a model is to be trained, which an export made
  before them must still pass to be evaluated."""
  workdir.check_no_renamed_fields(config)
  from trime_jax.configs import default

  workdir.check_known_fields(config.to_dict(), default.get_config())  # a misspelt field of an unlocked config
  t, train_cfg, d = config.trime, config.train, config.data
  _choice(t.memory, MEMORY_MODES, "trime.memory")
  _choice(t.batching, BATCHINGS, "trime.batching")
  if t.batching == "bm25":  # (bm25s is imported by BM25 runs only)
    from trime_jax.batching import bm25

    bm25.check_scoring(t.bm25_k1, t.bm25_b)
    bm25.check_analyzer(t.bm25_analyzer)
  check_train_section(train_cfg)  # the section both trainers share (runtime.config)
  _choice(d.segmentation, data.SEGMENTATIONS, "data.segmentation")
  _choice(config.eval.memory, tuple(evaluate.EVAL_MEMORIES), "eval.memory")
  _choice(config.eval.get("sample_break_mode", "none"), data.BREAK_MODES, "eval.sample_break_mode")
  _choice(config.eval.get("complete_overlong", "drop"), data.COMPLETE_OVERLONG, "eval.complete_overlong")
  for name, v in [("train.batch_size", train_cfg.batch_size), ("train.grad_accum", train_cfg.grad_accum),
                  ("data.segment_len", d.segment_len),
                  ("trime.consecutive_segments", t.consecutive_segments)]:
    if v < 1:
      raise ConfigError(f"{name} must be >= 1, got {v}")
  if not 0.0 <= t.drop_local_prob <= 1.0:
    raise ConfigError(f"trime.drop_local_prob must be in [0, 1], got {t.drop_local_prob}")
  _choice(t.consecutive_layout, CONSECUTIVE_LAYOUTS, "trime.consecutive_layout")
  if t.batching == "consecutive" and d.segmentation != "stream":
    raise ConfigError("trime.batching='consecutive' reads runs of the concatenated stream: it needs "
                      f"data.segmentation='stream', got {d.segmentation!r}")
  if t.memory == "long" and t.consecutive_segments > 1 and t.batching != "consecutive":
    # the loss reads each group of m rows as one run of consecutive segments: random or BM25 rows are not
    raise ConfigError(f"trime.memory='long' with trime.consecutive_segments={t.consecutive_segments} reads each "
                      f"group of {t.consecutive_segments} batch rows as consecutive segments: it needs "
                      f"trime.batching='consecutive' (a plan from launch/make_batches.py --kind=consecutive), "
                      f"got {t.batching!r}")
  if training and t.memory == "long" and t.consecutive_segments == 1 and not specs.stateful_backbone(config):
    # a Transformer's long memory is the earlier tokens of its run of m segments: m = 1 is the segment itself
    raise ConfigError("trime.memory='long' with trime.consecutive_segments=1 is local memory (a token's memory is "
                      "the earlier tokens of its run of m consecutive segments, here its own segment): set "
                      "trime.consecutive_segments to m >= 2 with trime.batching='consecutive' (TrimeLM_long), "
                      "or trime.memory='local' (TrimeLM)")
  gpus = int(t.get("consecutive_gpus", 1))
  consecutive.check_gpus(gpus, int(train_cfg.grad_accum), t.consecutive_layout)
  if gpus > 1 and t.batching != "consecutive":
    raise ConfigError(f"trime.consecutive_gpus={gpus} shards the stream as the original's GPUs read it: it needs "
                      f"trime.batching='consecutive', got {t.batching!r}")
  if gpus > 1 and specs.stateful_backbone(config):
    raise ConfigError(f"trime.consecutive_gpus={gpus}: a stateful backbone (SRU++) carries its state from one "
                      "micro-batch to the next, which this order would cut at every GPU; keep it at 1")
  if t.memory == "long" and train_cfg.batch_size % t.consecutive_segments:
    raise ConfigError(f"train.batch_size={train_cfg.batch_size} must be a multiple of "
                      f"trime.consecutive_segments={t.consecutive_segments} for memory='long'")
  longer = [f"{n}={v}" for n, v in (("data.segment_len", d.segment_len), ("eval.block_len", config.eval.block_len))
            if v > config.model.max_len]
  if longer:
    raise ConfigError(f"model.max_len={config.model.max_len} is shorter than {' and '.join(longer)}")
  for name, value in (("trime.tau", t.tau), ("eval.tau", config.eval.tau)):
    if not value > 0:
      raise ConfigError(f"{name} must be > 0, got {value}")
  _choice(t.sharded_variant, sharded_loss.VARIANTS, "trime.sharded_variant")
  _choice(t.memory_grad, sharded_loss.MEMORY_GRADS, "trime.memory_grad")
  if t.get("memory_grad_group_rows", 0) < 0:
    raise ConfigError(f"trime.memory_grad_group_rows must be >= 0, got {t.memory_grad_group_rows}")
  _check_ranges(config)  # first: the speed options divide by model.num_heads
  _check_backbone(config)
  check_speed_options(config)


def _check_backbone(config) -> None:
  """A stateful backbone (SRU++) reads each batch row as one stream: its long memory is the previous segment of
  the same row (trime.memory="long" needs the consecutive 'stream' plan, one segment per run), and evaluation
  threads its state through contiguous windows (no overlapping context)."""
  m, t = config.model, config.trime
  backbone = m.get("backbone", "transformer")
  _choice(backbone, model_lib.BACKBONES, "model.backbone")
  if backbone != "srupp":
    return
  if t.memory == "long" and (t.batching != "consecutive" or t.consecutive_layout != "stream"
                             or t.consecutive_segments != 1):
    raise ConfigError("model.backbone='srupp' with trime.memory='long' takes the previous segment of each stream "
                      "as long memory: it needs trime.batching='consecutive', trime.consecutive_layout='stream' "
                      f"and trime.consecutive_segments=1 (got {t.batching!r}, {t.consecutive_layout!r}, "
                      f"{t.consecutive_segments})")
  if config.eval.context_window != 0:
    raise ConfigError("model.backbone='srupp' carries its state from window to window: eval.context_window must "
                      f"be 0 (got {config.eval.context_window})")
  if m.get("key_type", "final") != "final":
    raise ConfigError("model.backbone='srupp' keys are the final projection's input: set model.key_type='final'")
  try:
    specs.model_config(config, vocab_size=1)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def check_speed_options(config) -> None:
  """model.attention_impl / dropout_mask / remat (issue 37): known values, a backbone and dtype they
  apply to, and (cudnn, pallas) a backend that has the kernel, so that a wrong choice is one line here, not an XLA
  traceback at compile time."""
  m = config.model
  impl, remat = m.get("attention_impl", "xla"), m.get("remat", "none")
  mask = m.get("dropout_mask", "nnx")
  _choice(impl, model_lib.ATTENTION_IMPLS, "model.attention_impl")
  _choice(mask, model_lib.DROPOUT_MASKS, "model.dropout_mask")
  _choice(remat, model_lib.REMAT_POLICIES, "model.remat")
  if m.get("backbone", "transformer") != "transformer" and (impl, mask, remat) != ("xla", "nnx", "none"):
    raise ConfigError(f"model.attention_impl={impl!r} / model.dropout_mask={mask!r} / model.remat="
                      f"{remat!r} apply to the Transformer backbone only: model.backbone={m.backbone!r} needs "
                      "'xla' / 'nnx' / 'none'")
  problem = model_lib.attention_impl_problem(impl, m.dtype, m.d_model, m.num_heads)
  if problem:
    raise ConfigError(problem)
  if impl == "pallas":
    problem = flash_attention.shape_problem(config.data.segment_len, m.d_model // max(m.num_heads, 1))
    if problem:
      raise ConfigError(f"model.attention_impl='pallas' (our flash attention with dropout) needs {problem}: "
                        "change data.segment_len or use model.attention_impl='xla'")
    try:
      flash_attention.tiles()
    except ValueError as e:
      raise ConfigError(str(e)) from None
  model_lib.check_attention_backend(impl)
  if impl == "pallas" and flash_attention.unavailable():
    raise ConfigError(f"model.attention_impl='pallas': {flash_attention.unavailable()}: use model.attention_impl="
                      "'xla' (or a jax that has it)")
  tail_rows = m.get("adaptive_tail_rows", 1.0)
  if not 0.0 < tail_rows <= 1.0:
    raise ConfigError(f"model.adaptive_tail_rows must be in (0, 1], got {tail_rows}")
  if tail_rows < 1.0 and not (m.get("backbone", "transformer") == "transformer" and m.get("adaptive_softmax")):
    raise ConfigError(f"model.adaptive_tail_rows={tail_rows} applies to the Transformer's adaptive softmax only "
                      "(model.adaptive_softmax is off): leave it at 1.0")
  if tail_rows < 1.0 and jax.device_count() > 1:
    # jnp.nonzero over rows sharded across a mesh is a global operation: the gather would cross devices.
    raise ConfigError(f"model.adaptive_tail_rows < 1 runs on one device for now ({jax.device_count()} here): "
                      "leave it at 1.0")
  if impl == "pallas" and jax.device_count() > 1:
    # A Pallas call has no partitioning rule: XLA would gather every row's q, k, v onto each device.
    raise ConfigError(f"model.attention_impl='pallas' runs on one device for now ({jax.device_count()} here: its "
                      "kernels are not partitioned over a mesh): use model.attention_impl='xla'")


def _check_ranges(config) -> None:
  """The LM's numeric fields (the shared train ones: runtime.config.check_train_section) whose bad values would
  otherwise fail after compilation or silently train nonsense."""
  m, train_cfg, e = config.model, config.train, config.eval
  at_least = [("train.eval_max_tokens", train_cfg.eval_max_tokens, 0), ("model.num_layers", m.num_layers, 1),
              ("model.num_heads", m.num_heads, 1), ("model.d_model", m.d_model, 1),
              ("model.d_ff", m.get("d_ff", 1), 1), ("model.max_len", m.get("max_len", 1), 1),
              ("eval.batch_size", e.batch_size, 1), ("eval.max_tokens", e.max_tokens, 0),
              ("eval.context_window", e.context_window, 0), ("eval.mem_size", e.mem_size, 0),
              ("eval.block_len", e.block_len, 1), ("eval.knn_k", e.knn_k, 1), ("eval.nprobe", e.nprobe, 1),
              ("eval.search_queries", e.get("search_queries", 4096), 0),
              ("eval.tune_max_tokens", e.get("tune_max_tokens", 0), 0)]
  for name, value, low in at_least:
    if value < low:
      raise ConfigError(f"{name} must be >= {low}, got {value}")
  fractions = config.data.get("split_fractions")
  if fractions is not None:  # train/dev/test shares: three numbers >= 0 summing to 1 (a sum of 1.2 was normalised)
    fr = [float(x) for x in fractions]
    if len(fr) != 3 or not all(0 <= x <= 1 for x in fr) or abs(sum(fr) - 1.0) > 1e-6:
      raise ConfigError(f"data.split_fractions must be three shares in [0, 1] (train, dev, test) summing to 1, got "
                        f"{tuple(fractions)}")
  for name in ("knn_lambda", "cache_lambda"):  # interpolation weights
    if not 0.0 <= e[name] <= 1.0:
      raise ConfigError(f"eval.{name} must be in [0, 1], got {e[name]}")
  for name in ("tau_prime", "cache_theta", "knn_theta"):  # temperatures / inverse temperatures
    if name in e and not e[name] > 0:
      raise ConfigError(f"eval.{name} must be > 0, got {e[name]}")
  _choice(e.split, corpora.SPLITS, "eval.split")
  _choice(e.interp_memory, tuple(evaluate.INTERP_MEMORIES), "eval.interp_memory")
  evaluate.knnlm_metric_of(e)  # one of knn.KNNLM_METRICS; l2 not with eval.datastore_on_device
  for name in ("dropout", "attention_dropout", "activation_dropout"):
    if not 0.0 <= m[name] < 1.0:
      raise ConfigError(f"model.{name} must be in [0, 1), got {m[name]}")
  if m.d_model % m.num_heads:
    raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}")
  if e.context_window >= e.block_len:
    raise ConfigError(f"eval.context_window={e.context_window} must be shorter than eval.block_len={e.block_len} "
                      "(the rest of each block is scored)")


def ce_warmup_steps(config) -> int:
  w = config.trime.ce_warmup_steps
  return int(math.ceil(0.05 * config.train.num_steps)) if w < 0 else int(w)
