"""Training: `train_and_evaluate(config, workdir)` (a Colab cell can call it; `launch/train.py` is a thin CLI).

Plain CE for the first `trime.ce_warmup_steps` updates, then the TRIME loss; both are reported every
`log_every` updates to stdout, `<workdir>/metrics.jsonl` and TensorBoard event files in `<workdir>/tb`
(process 0; a tqdm bar with rate and ETA on a terminal). Data order, dropout and drop-local decisions
depend only on (seed, step), so a run resumed from an orbax checkpoint continues exactly as if uninterrupted.
On SIGTERM (or JAX's preemption notice on multi-host / TPU runs) the run checkpoints the update it is at and
raises `Preempted`; rerunning resumes there. The final parameters are exported (params + config + vocab) to
`<workdir>/export` for evaluation; with `train.keep_best` the lowest-dev-perplexity ones go to `<workdir>/best`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from trime_jax import checkpoint as ckpt
from trime_jax import corpora
from trime_jax import data
from trime_jax import distributed
from trime_jax import evaluate
from trime_jax import event_writer
from trime_jax import sharded_loss
from trime_jax import sharding
from trime_jax import steps
from trime_jax.batching import plan as batch_plan
from trime_jax.errors import ConfigError, TrainingError
from trime_jax.loss import MEMORY_MODES
from trime_jax import model as model_lib
from trime_jax.model import count_params

OPTIMIZERS = ("adam", "nag", "radam")
SCHEDULES = ("inverse_sqrt", "cosine", "constant")
BATCHINGS = ("random", "consecutive", "bm25")
CONSECUTIVE_LAYOUTS = ("stream", "packed")
PROGRESS = ("auto", "bar", "log")
TB_TRAIN_SCALARS = ("loss", "ce_nll", "trime_nll", "ppl", "lr", "grad_norm", "tokens_per_s")
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a run the signal ended (launch/train.py)


# ----------------------------------------------------------------------------------------------------------
# Config checks, optimizer, schedule
# ----------------------------------------------------------------------------------------------------------
def _choice(value, allowed, name):
  if value not in allowed:
    raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")


def validate_config(config) -> None:
  """Clear errors for values a locked ConfigDict cannot catch (enums, ranges, consistency)."""
  t, train_cfg, d = config.trime, config.train, config.data
  _choice(t.memory, MEMORY_MODES, "trime.memory")
  _choice(t.batching, BATCHINGS, "trime.batching")
  _choice(train_cfg.optimizer, OPTIMIZERS, "train.optimizer")
  _choice(train_cfg.schedule, SCHEDULES, "train.schedule")
  _choice(d.segmentation, data.SEGMENTATIONS, "data.segmentation")
  _choice(config.eval.memory, tuple(evaluate.EVAL_MEMORIES), "eval.memory")
  _choice(config.eval.get("sample_break_mode", "none"), data.BREAK_MODES, "eval.sample_break_mode")
  for name, v in [("train.batch_size", train_cfg.batch_size), ("train.grad_accum", train_cfg.grad_accum),
                  ("train.num_steps", train_cfg.num_steps), ("data.segment_len", d.segment_len),
                  ("trime.consecutive_segments", t.consecutive_segments)]:
    if v < 1:
      raise ConfigError(f"{name} must be >= 1, got {v}")
  if not 0.0 <= t.drop_local_prob <= 1.0:
    raise ConfigError(f"trime.drop_local_prob must be in [0, 1], got {t.drop_local_prob}")
  _choice(t.consecutive_layout, CONSECUTIVE_LAYOUTS, "trime.consecutive_layout")
  if t.batching == "consecutive" and d.segmentation != "stream":
    raise ConfigError("trime.batching='consecutive' reads runs of the concatenated stream: it needs "
                      f"data.segmentation='stream', got {d.segmentation!r}")
  if t.memory == "long" and train_cfg.batch_size % t.consecutive_segments:
    raise ConfigError(f"train.batch_size={train_cfg.batch_size} must be a multiple of "
                      f"trime.consecutive_segments={t.consecutive_segments} for memory='long'")
  if d.segment_len > config.model.max_len or config.eval.block_len > config.model.max_len:
    raise ConfigError(f"model.max_len={config.model.max_len} is shorter than data.segment_len="
                      f"{d.segment_len} or eval.block_len={config.eval.block_len}")
  if t.temperature <= 0 or config.eval.temperature <= 0:
    raise ConfigError("temperatures must be positive")
  _choice(t.sharded_variant, sharded_loss.VARIANTS, "trime.sharded_variant")
  _choice(t.memory_grad, sharded_loss.MEMORY_GRADS, "trime.memory_grad")
  if t.get("memory_grad_group_rows", 0) < 0:
    raise ConfigError(f"trime.memory_grad_group_rows must be >= 0, got {t.memory_grad_group_rows}")
  _choice(train_cfg.progress, PROGRESS, "train.progress")
  _check_backbone(config)
  profile_steps(train_cfg)
  _check_ranges(config)


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
    model_lib.model_config(m, vocab_size=1)
  except ValueError as e:
    raise ConfigError(str(e)) from None


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


def _check_ranges(config) -> None:
  """Numeric fields whose bad values would otherwise fail after compilation or silently train nonsense."""
  m, train_cfg, e = config.model, config.train, config.eval
  at_least = [("train.log_every", train_cfg.log_every, 1), ("train.checkpoint_every", train_cfg.checkpoint_every, 1),
              ("train.keep_checkpoints", train_cfg.keep_checkpoints, 1), ("train.warmup_steps", train_cfg.warmup_steps, 0),
              ("train.eval_every", train_cfg.eval_every, 0), ("train.eval_max_tokens", train_cfg.eval_max_tokens, 0),
              ("train.vocab_chunk", train_cfg.vocab_chunk, 0), ("train.num_devices", train_cfg.num_devices, 0),
              ("model.num_layers", m.num_layers, 1), ("model.num_heads", m.num_heads, 1),
              ("eval.batch_size", e.batch_size, 1), ("eval.max_tokens", e.max_tokens, 0),
              ("eval.context_window", e.context_window, 0), ("eval.mem_size", e.mem_size, 0),
              ("eval.block_len", e.block_len, 1), ("eval.knn_k", e.knn_k, 1), ("eval.nprobe", e.nprobe, 1)]
  for name, value, low in at_least:
    if value < low:
      raise ConfigError(f"{name} must be >= {low}, got {value}")
  for name, value in [("train.learning_rate", train_cfg.learning_rate), ("train.adam_eps", train_cfg.adam_eps)]:
    if not value > 0:
      raise ConfigError(f"{name} must be > 0, got {value}")
  for name, value in [("train.weight_decay", train_cfg.weight_decay), ("train.clip_norm", train_cfg.clip_norm),
                      ("train.warmup_init_lr", train_cfg.warmup_init_lr), ("train.min_lr", train_cfg.min_lr)]:
    if value < 0:
      raise ConfigError(f"{name} must be >= 0, got {value}")
  for name in ("knn_lambda", "cache_lambda"):  # interpolation weights
    if not 0.0 <= e[name] <= 1.0:
      raise ConfigError(f"eval.{name} must be in [0, 1], got {e[name]}")
  if not e.knn_temperature > 0:
    raise ConfigError(f"eval.knn_temperature must be > 0, got {e.knn_temperature}")
  _choice(e.split, corpora.SPLITS, "eval.split")
  _choice(e.interp_memory, tuple(evaluate.INTERP_MEMORIES), "eval.interp_memory")
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


def make_schedule(train_cfg) -> optax.Schedule:
  """Linear warm-up from `warmup_init_lr` to `learning_rate`, then inverse-sqrt, cosine or constant."""
  peak, warm = float(train_cfg.learning_rate), int(train_cfg.warmup_steps)
  init = float(train_cfg.warmup_init_lr) if warm else peak
  warmup = optax.linear_schedule(init, peak, max(warm, 1))
  if train_cfg.schedule == "inverse_sqrt":  # fairseq: lr · sqrt(warmup / step) after the warm-up
    decay = lambda s: peak * jnp.sqrt(max(warm, 1) / jnp.maximum(s + max(warm, 1), 1))
  elif train_cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(peak, max(int(train_cfg.num_steps) - warm, 1),
                                        alpha=float(train_cfg.min_lr) / peak)
  else:
    decay = optax.constant_schedule(peak)
  return optax.join_schedules([warmup, decay], [warm]) if warm else decay


def make_optimizer(train_cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = make_schedule(train_cfg)
  if train_cfg.optimizer == "adam":
    opt = optax.adamw(schedule, b1=train_cfg.adam_b1, b2=train_cfg.adam_b2, eps=train_cfg.adam_eps,
                      weight_decay=train_cfg.weight_decay)
  elif train_cfg.optimizer == "radam":  # SRU++'s enwik8 script: RAdam, its weight decay decoupled (p -= lr·wd·p)
    opt = optax.chain(optax.scale_by_radam(b1=train_cfg.adam_b1, b2=train_cfg.adam_b2, eps=train_cfg.adam_eps),
                      optax.add_decayed_weights(train_cfg.weight_decay), optax.scale_by_learning_rate(schedule))
  else:  # fairseq `nag`: SGD with Nesterov momentum; its weight decay is decoupled (p *= 1 - lr·wd), outside
    # the momentum, like Adam's
    opt = optax.chain(optax.trace(decay=train_cfg.nag_momentum, nesterov=True),
                      optax.add_decayed_weights(train_cfg.weight_decay), optax.scale_by_learning_rate(schedule))
  if train_cfg.clip_norm > 0:
    opt = optax.chain(optax.clip_by_global_norm(train_cfg.clip_norm), opt)
  return opt, schedule


# ----------------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------------
class BatchSource:
  """Training batch of update `step`: inputs/targets [grad_accum, B, L], drop_local [grad_accum, B] (one draw
  per segment, memory=ext), and documents [grad_accum, B, L] for packed long-term runs."""

  def __init__(self, corpus: data.Corpus, config):
    self.corpus = corpus
    self.config = config
    self.segments = data.make_segments(corpus, config.data.segment_len, config.data.segmentation)
    self.plan = None
    self._rows = None  # the host's rows of the last batch read (resets compare against the same rows)
    t = config.trime
    if t.batching != "random":
      self.plan = batch_plan.load(t.batch_plan)
      consecutive = t.batching == "consecutive"
      self.plan.check(corpus_fingerprint=corpus.fingerprint(), segment_len=config.data.segment_len,
                      segmentation=config.data.segmentation, batch_size=config.train.batch_size,
                      consecutive_segments=t.consecutive_segments if consecutive else None,
                      kind=t.batching, layout=t.consecutive_layout if consecutive else None)
    # Packed runs hold several documents; their tokens carry document ids so memory stays in the document.
    self.with_documents = t.memory == "long" and t.consecutive_layout == "packed"
    # A stateful backbone learns where a row does not continue the previous micro-batch's row.
    self.with_reset = config.model.get("backbone", "transformer") == "srupp"

  def indices(self, step: int) -> np.ndarray:
    """Segment indices [grad_accum, B] of update `step` (-1: all-padding row)."""
    train_cfg = self.config.train
    micro = train_cfg.grad_accum
    if self.plan is not None:
      return np.stack([self.plan.rows(step * micro + a) for a in range(micro)])
    flat = data.random_batch_indices(len(self.segments), micro * train_cfg.batch_size, step, train_cfg.seed)
    return flat.reshape(micro, train_cfg.batch_size)

  def __call__(self, step: int, rows=None) -> dict:
    """The batch of update `step`; `rows` (global row indices, sorted): only those rows of each micro-batch
    (a host's slice of the global batch, see `distributed.process_rows`)."""
    idx = self.indices(step)
    self._rows = rows
    t = self.config.trime
    # One drop-local draw per segment (the original draws once per forward of one segment per GPU), drawn for
    # the whole global batch so every host agrees, then sliced like the rows.
    rng = np.random.default_rng([self.config.train.seed, step, 7])
    drop = rng.random(idx.shape) < t.drop_local_prob if t.memory == "ext" else np.zeros(idx.shape, bool)
    if rows is not None:
      idx, drop = idx[:, rows], drop[:, rows]
    inputs, targets = data.gather_segments(self.corpus, self.segments, idx.reshape(-1))
    shape = idx.shape + (self.segments.seg_len,)
    batch = {"inputs": inputs.reshape(shape), "targets": targets.reshape(shape), "drop_local": drop}
    if self.with_documents:
      batch["documents"] = data.segment_documents(self.corpus, self.segments, idx.reshape(-1)).reshape(shape)
    if self.with_reset:
      batch["reset"] = self.resets(step, idx)
    return batch

  def resets(self, step: int, idx) -> np.ndarray:
    """[grad_accum, B] bool: row b of micro-batch a does not hold the segment after row b of the micro-batch
    before it (a stream starts over; every row with random batching). `idx` may be a host's rows only."""
    micro = self.config.train.grad_accum
    if self.plan is None or step * micro == 0:
      prev0 = np.full(idx.shape[1:], -2)
    else:
      prev0 = self.plan.rows(step * micro - 1)
      prev0 = prev0[self._rows] if self._rows is not None else prev0
    prev = np.concatenate([prev0[None], idx[:-1]], axis=0)
    return (self.plan is None) | (idx < 0) | (prev < 0) | (idx != prev + 1)


# ----------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------
def _chief() -> bool:
  """Process 0 writes the workdir's files and logs (every process computes; one writes)."""
  return jax.process_index() == 0


def _log(line: str) -> None:
  if _chief():
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)  # above a progress bar, if one is drawn
    sys.stdout.flush()


def _hms(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _AboveBar:
  """A stream whose lines tqdm prints above its bar (tqdm's recipe for redirected writes)."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text: str) -> None:
    if text.rstrip():
      from tqdm import tqdm

      tqdm.write(text.rstrip("\n"), file=self.stream)

  def flush(self) -> None:
    self.stream.flush()


def _in_notebook() -> bool:
  """A Jupyter/Colab kernel runs this process (not merely: ipykernel was imported, e.g. by nbclient)."""
  ipython = sys.modules.get("IPython")
  shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
  return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell")  # Shell: Colab's


class _Progress:
  """Rate and ETA on process 0: a tqdm bar where someone watches (a terminal or a notebook; `train.progress`
  'auto'), otherwise no bar (no carriage-return spam in log files) and the ETA goes into the log lines.
  While the bar is drawn, absl's log lines on stderr are printed above it instead of through it."""

  def __init__(self, total: int, start: int, mode: str):
    self.total, self.bar, self.t0, self.n0 = total, None, None, start
    self._log_handler = None
    interactive = sys.stderr.isatty() or _in_notebook()
    if _chief() and (mode == "bar" or (mode == "auto" and interactive)):
      from tqdm.auto import tqdm

      self.bar = tqdm(total=total, initial=start, unit="update", dynamic_ncols=True, smoothing=0.05)
      handler = getattr(logging.get_absl_handler(), "python_handler", None)
      if handler is not None and handler.stream is sys.stderr:
        self._log_handler, handler.stream = handler, _AboveBar(sys.stderr)

  def update(self, done: int, **postfix) -> None:
    if self.t0 is None:  # the clock starts after the first update, which compiles
      self.t0, self.n0 = time.perf_counter(), done
    if self.bar is not None:
      self.bar.update(done - self.bar.n)
      if postfix:
        self.bar.set_postfix(postfix, refresh=False)

  def eta(self, done: int) -> str:
    if self.t0 is None or done <= self.n0:
      return "ETA ?"
    rate = (done - self.n0) / max(time.perf_counter() - self.t0, 1e-9)
    return f"{rate:.2f} updates/s | ETA {_hms((self.total - done) / rate)}"

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    if self._log_handler is not None:
      self._log_handler.stream, self._log_handler = self._log_handler.stream.stream, None


class Preempted(Exception):
  """Training stopped on a preemption signal after checkpointing update `step`; the same command resumes.
  launch/train.py exits with PREEMPTED_EXIT_CODE."""

  def __init__(self, step: int, directory):
    super().__init__(f"preempted: checkpoint of update {step} saved in {directory}; rerun the same command to "
                     "resume")
    self.step = step


def _jax_owns_sigterm() -> bool:
  """With `jax.distributed` running, JAX's preemption sync manager handles SIGTERM itself and agrees on a
  step all hosts save at (orbax `reached_preemption`); a Python handler would replace its C++ one."""
  try:
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client is not None
  except (ImportError, AttributeError):
    return jax.process_count() > 1


class _PreemptionWatch:
  """SIGTERM sets a flag that the loop reads between updates (an update is never cut in half); the previous
  handler is restored on exit. Multi-host: orbax's `reached_preemption(step)` (all hosts agree on the step)."""

  def __init__(self, mgr):
    self.mgr, self.requested, self._previous = mgr, False, None

  def _handler(self, signum, frame):
    del signum, frame
    self.requested = True

  def __enter__(self):
    if not _jax_owns_sigterm() and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handler)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def reached(self, step: int) -> bool:
    return self.requested or self.mgr.reached_preemption(step)


def best_metric(config) -> str:
  """The dev perplexity `train.keep_best` ranks by: with local memory for TRIME models (how they are used),
  without memory for vanilla LMs."""
  return "trime_local(tau=1)_ppl" if config.trime.memory != "none" else "none_ppl"


class _BestKeeper:
  """Exports the parameters with the lowest dev perplexity so far to `directory` (same layout as
  `<workdir>/export`, meta.json adds step, best_metric and dev_ppl). The best so far is read back from
  meta.json, so a resumed run keeps comparing against it; runs are deterministic, so a best written past
  the resumed checkpoint is the state the resumed run reaches again."""

  def __init__(self, directory: str, enabled: bool, metric: str, config, vocab, extra: dict):
    self.directory, self.enabled, self.metric = directory, enabled, metric
    self.config, self.vocab, self.extra = config, vocab, extra
    self.ppl = math.inf
    meta = os.path.join(directory, "meta.json")
    if enabled and os.path.exists(meta):
      with open(meta) as f:
        self.ppl = float(json.load(f).get("dev_ppl", math.inf))

  def update(self, step: int, params, dev: dict) -> None:
    ppl = dev.get(self.metric, math.nan)
    if not (self.enabled and ppl < self.ppl):  # NaN never wins
      return
    ckpt.export(self.directory, _host_copy(params), self.config, self.vocab,
                extra={**self.extra, "step": step, "best_metric": self.metric, "dev_ppl": ppl})
    self.ppl = ppl
    logging.info("best dev %s %.4f at update %d: exported to %s", self.metric, ppl, step, self.directory)


def _host_copy(tree):
  """NumPy copy of replicated arrays on this host (works when they span several processes)."""
  return jax.tree_util.tree_map(
      lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x), tree)


def truncate_metrics(path: str, last_step: int) -> None:
  """On resume, drop metric lines past the restored checkpoint (they will be produced again)."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(lines)
  os.replace(tmp, path)


def build_model(config, vocab_size: int, seed: int):
  """The model of config.model (model.backbone picks it: `model.build_model`)."""
  return model_lib.build_model(config.model, vocab_size, nnx.Rngs(params=seed))


def graphdef_stateful(graphdef, params) -> bool:
  return bool(getattr(nnx.merge(graphdef, params), "stateful", False))


def _tree_bytes(tree) -> int:
  return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def memory_plan(config, vocab_size: int = 0) -> dict:
  """Parameter count and per-device memory of training `config`, from shapes only (nothing is allocated;
  the corpus is read only when neither `vocab_size` nor model.vocab_size gives the vocabulary).

  Parameters and optimizer state are exact byte counts. The step's temporaries (activations kept for the
  backward pass, gradients, logits chunks) are XLA's compiled plan for one TRIME train step on the default
  backend at the per-device batch (train.batch_size / devices rows); data parallelism replicates parameters
  and optimizer state. On a >1-device mesh the sharded loss also gathers other devices' keys (not included).
  """
  validate_config(config)
  train_cfg = config.train
  vocab_size = vocab_size or config.model.vocab_size or len(corpora.load_splits(config.data).vocab)
  mcfg = model_lib.model_config(config.model, vocab_size=vocab_size)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model_lib.build_model(mcfg, rngs=nnx.Rngs(params=0))),
                               nnx.Param)
  tx, _ = make_optimizer(train_cfg)
  opt_state = jax.eval_shape(tx.init, params)
  devices = train_cfg.num_devices or jax.device_count()
  if train_cfg.batch_size % devices:
    raise ConfigError(f"train.batch_size={train_cfg.batch_size} is not divisible by the {devices} devices")
  rows = train_cfg.batch_size // devices
  tokens = jax.ShapeDtypeStruct((train_cfg.grad_accum, rows, config.data.segment_len), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens, "drop_local": jax.ShapeDtypeStruct(tokens.shape[:2], jnp.bool_)}
  if config.trime.memory == "long" and config.trime.consecutive_layout == "packed":
    batch["documents"] = tokens
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": opt_state}
  if graphdef_stateful(graphdef, params):
    batch["reset"] = batch["drop_local"]
    state["carry"] = jax.eval_shape(lambda: steps.init_train_carry(nnx.merge(graphdef, params), rows,
                                                                   config.data.segment_len))
  spec = steps.LossSpec.from_config(config)
  use_trime = spec.objective.memory != "none"
  fn = functools.partial(steps.train_step, graphdef, tx, spec, use_trime, use_trime)
  compiled = jax.jit(fn, donate_argnums=(0,)).lower(state, batch, jax.random.PRNGKey(0)).compile()
  m = compiled.memory_analysis()
  plan = {"num_params": count_params(params), "vocab_size": vocab_size, "devices": devices,
          "rows_per_device": rows, "segment_len": config.data.segment_len, "grad_accum": train_cfg.grad_accum,
          "backend": jax.default_backend(), "param_bytes": _tree_bytes(params),
          "opt_state_bytes": _tree_bytes(opt_state)}
  if m is not None:  # some backends report no plan
    plan.update(temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes),
                output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes))
    plan["peak_bytes"] = plan["argument_bytes"] + plan["output_bytes"] - plan["alias_bytes"] + plan["temp_bytes"]
  return plan


def format_memory_plan(plan: dict) -> str:
  row = lambda label, b: f"  {label:<62}{b / 2**30:9.3f} GiB"
  lines = [f"model: {plan['num_params']:,} parameters (vocab {plan['vocab_size']:,})",
           f"per-device memory plan: {plan['devices']} device(s), {plan['rows_per_device']} segments × "
           f"{plan['segment_len']} tokens per forward, {plan['grad_accum']} forwards per update "
           f"(one TRIME train step compiled for {plan['backend']})",
           row("parameters (float32)", plan["param_bytes"]),
           row("optimizer state", plan["opt_state_bytes"])]
  if "temp_bytes" in plan:
    lines += [row("step temporaries (activations, gradients, logits; XLA plan)", plan["temp_bytes"]),
              row("peak: arguments + outputs - donated + temporaries", plan["peak_bytes"])]
  else:
    lines.append(f"  step temporaries: the {plan['backend']} backend reports no compiled memory plan")
  return "\n".join(lines)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, splits=None) -> dict:
  """Train (or resume) in `workdir`, evaluate on dev, export. Returns the final metrics.

  Raises `Preempted` after checkpointing, when SIGTERM (or a multi-host preemption notice) arrives."""
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  if not _chief():
    logging.set_verbosity(logging.WARNING)  # INFO lines from process 0 only
  ckpt.check_resume_config(workdir, config)  # before any work: refuses another run's workdir, naming fields
  splits = splits or corpora.load_splits(config.data)
  vocab = splits.vocab
  if config.model.vocab_size and config.model.vocab_size != len(vocab):
    raise ConfigError(f"model.vocab_size={config.model.vocab_size} but the data's vocabulary has "
                      f"{len(vocab)} tokens (set model.vocab_size=0 to take it from the data)")
  train_cfg = config.train
  mesh = sharding.make_mesh(train_cfg.num_devices)
  if train_cfg.batch_size % mesh.size:
    raise ConfigError(f"train.batch_size={train_cfg.batch_size} is not divisible by the {mesh.size} devices")

  model = build_model(config, len(vocab), train_cfg.seed)
  graphdef, params = nnx.split(model, nnx.Param)
  tx, schedule = make_optimizer(train_cfg)
  repl, data_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh, batch_axis=1)
  # Placed before restoring: the abstract state then carries the mesh shardings, so orbax restores onto
  # every host's devices (multi-host) instead of one default device.
  state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
  if model.stateful:  # per-row state across segments: saved with the checkpoints, so a resume continues it
    state["carry"] = steps.init_train_carry(model, train_cfg.batch_size, config.data.segment_len)
  state = jax.device_put(state, repl)
  mgr = ckpt.manager(os.path.join(workdir, "checkpoints"), train_cfg.keep_checkpoints)
  restored_step, restored = ckpt.restore_latest(mgr, ckpt.abstract(state), log=_log)
  tb = event_writer.EventWriter(os.path.join(workdir, "tb"), enabled=_chief(), config=config)  # reads train.tensorboard
  if restored is not None:
    tb.restart(restored_step + 1)  # TensorBoard drops the interrupted run's events past the checkpoint
    state = restored
    _log(f"resumed from step {restored_step} ({mgr.directory})")
    if _chief():
      truncate_metrics(os.path.join(workdir, "metrics.jsonl"), restored_step)

  state = jax.device_put(state, repl)
  spec = steps.LossSpec.from_config(config)
  warm = ce_warmup_steps(config)
  report_trime = spec.objective.memory != "none"

  batch_sh = {"inputs": data_sh, "targets": data_sh, "drop_local": data_sh, "documents": data_sh, "reset": data_sh}

  @functools.lru_cache(maxsize=None)
  def step_fn(use_trime: bool):
    # On a >1-device mesh the TRIME loss inside is the sharded one (explicit collectives over `data`).
    fn = functools.partial(steps.train_step, graphdef, tx, spec, use_trime, report_trime, mesh=mesh)
    in_batch = {k: batch_sh[k] for k in batch_keys}
    return jax.jit(fn, in_shardings=(repl, in_batch, repl), out_shardings=(repl, repl), donate_argnums=(0,))

  source = BatchSource(splits.train, config)
  # Each process loads only the rows its own devices hold (all of them when there is one process).
  tokens_shape = (train_cfg.grad_accum, train_cfg.batch_size, config.data.segment_len)
  global_shapes = {"inputs": tokens_shape, "targets": tokens_shape, "drop_local": tokens_shape[:2],
                   "documents": tokens_shape, "reset": tokens_shape[:2]}
  batch_keys = ("inputs", "targets", "drop_local") + (("documents",) if source.with_documents else ()) + \
      (("reset",) if source.with_reset else ())
  rows = distributed.process_rows(data_sh, tokens_shape, axis=1)
  n_params = count_params(params)
  start = int(state["step"])
  _log(f"model: {n_params:,} parameters | vocab {len(vocab):,} | train tokens {len(splits.train):,} | "
       f"{len(source.segments):,} segments of {config.data.segment_len} | memory={spec.objective.memory} | "
       f"CE warm-up {warm} updates | devices {mesh.size}")
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  base_key = jax.random.PRNGKey(train_cfg.seed)
  t_last, tok_last = time.perf_counter(), 0
  last = {}
  best = _BestKeeper(os.path.abspath(os.path.join(workdir, "best")), train_cfg.keep_best, best_metric(config),
                     config, vocab, {"train_fingerprint": splits.train.fingerprint()})
  trace = profile_steps(train_cfg)
  tracing = False
  progress = _Progress(train_cfg.num_steps, start, train_cfg.progress)
  try:
    with open(metrics_path if _chief() else os.devnull, "a") as mfile, _PreemptionWatch(mgr) as preemption:
      for step in range(start, train_cfg.num_steps):
        done = step + 1
        if trace and done == trace[0]:
          jax.profiler.start_trace(os.path.join(workdir, "profile"))
          tracing = True
        use_trime = spec.objective.memory != "none" and step >= warm
        local = source(step, rows)
        batch = {k: distributed.global_array(batch_sh[k], v, global_shapes[k]) for k, v in local.items()}
        state, m = step_fn(use_trime)(state, batch, jax.random.fold_in(base_key, step))
        tok_last += int(m["tokens"])
        if tracing and done == trace[1]:
          jax.block_until_ready(state)
          jax.profiler.stop_trace()
          tracing = False
          logging.info("profile of updates %d-%d written to %s", *trace, os.path.join(workdir, "profile"))
        progress.update(done)
        if done % train_cfg.log_every == 0 or done == train_cfg.num_steps:
          m = jax.device_get(m)
          now = time.perf_counter()
          rec = {"step": done, "objective": "trime" if use_trime else "ce", "loss": float(m["loss"]),
                 "ce_nll": float(m["ce_nll"]), "trime_nll": float(m["trime_nll"]),
                 "ppl": math.exp(min(float(m["ce_nll"]), 50.0)), "grad_norm": float(m["grad_norm"]),
                 "lr": float(schedule(step)), "tokens_per_s": tok_last / (now - t_last),
                 "skipped": int(m["skipped"])}
          t_last, tok_last = now, 0
          if not math.isfinite(rec["loss"]):
            mgr.wait_until_finished()
            kept = mgr.latest_step()
            where = f"the last checkpoint (step {kept}) is intact in {mgr.directory}" if kept is not None else \
                "no checkpoint had been written yet"
            raise TrainingError(f"non-finite loss at step {done} (updates with a non-finite loss or gradient "
                                f"are skipped, not applied); {where}. Lower train.learning_rate or enable "
                                "clipping.")
          mfile.write(json.dumps(rec) + "\n")
          mfile.flush()
          _log(f"step {done:>6}/{train_cfg.num_steps} [{rec['objective']:>5}] loss {rec['loss']:.4f}"
               f" | ce {rec['ce_nll']:.4f} | trime {rec['trime_nll']:.4f} | lr {rec['lr']:.2e}"
               f" | |g| {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | {progress.eta(done)}")
          tb.scalars(done, {f"train/{k}": rec[k] for k in TB_TRAIN_SCALARS})
          progress.update(done, loss=f"{rec['loss']:.4f}")
          last = rec
        if train_cfg.eval_every and done % train_cfg.eval_every == 0 and done != train_cfg.num_steps:
          dev = _log_eval(graphdef, state["params"], splits.dev, config, done, metrics_path)
          tb.scalars(done, {f"dev/{k}": v for k, v in dev.items() if k.endswith("_ppl")})
          best.update(done, state["params"], dev)
        saved = done % train_cfg.checkpoint_every == 0 or done == train_cfg.num_steps
        if saved:
          ckpt.save(mgr, done, state)
          logging.info("checkpoint of update %d: saving to %s", done, mgr.directory)
        if preemption.reached(done) and done < train_cfg.num_steps:
          if not saved:
            ckpt.save(mgr, done, state)
          mgr.wait_until_finished()
          logging.info("preemption signal: checkpoint of update %d saved, stopping", done)
          raise Preempted(done, mgr.directory)
  except BaseException:
    tb.close()
    raise
  finally:
    progress.close()
    if tracing:
      jax.profiler.stop_trace()
  mgr.wait_until_finished()

  params = _host_copy(state["params"])
  # A rerun of a finished training reuses its final dev line instead of appending a duplicate.
  final = (start == train_cfg.num_steps and _logged_eval(metrics_path, start)) or \
      _log_eval(graphdef, params, splits.dev, config, int(state["step"]), metrics_path)
  export_dir = os.path.abspath(os.path.join(workdir, "export"))
  ckpt.export(export_dir, params, config, vocab,  # every process: orbax synchronises them
              extra={"step": int(state["step"]), "train_fingerprint": splits.train.fingerprint()})
  _log(f"exported {export_dir}")
  best.update(int(state["step"]), params, final)
  tb.scalars(int(state["step"]), {f"dev/{k}": v for k, v in final.items() if k.endswith("_ppl")})
  tb.close()
  return {"train": last, "dev": final, "export": export_dir, "num_params": n_params}


def _logged_eval(metrics_path: str, step: int) -> dict | None:
  """The dev-evaluation line of `step` in metrics.jsonl, if there is one."""
  if not os.path.exists(metrics_path):
    return None
  with open(metrics_path) as f:
    rows = [json.loads(ln) for ln in f if ln.strip()]
  return next((r for r in reversed(rows) if r.get("split") == "dev" and r.get("step") == step), None)


def _log_eval(graphdef, params, corpus, config, step, metrics_path) -> dict:
  """Dev perplexity during training: vanilla scoring and, for TRIME models, local memory at τ=1."""
  e = config.eval
  points = (evaluate.NONE,) + ((evaluate.Point("trime_local", tau=1.0),) if config.trime.memory != "none" else ())
  res = evaluate.evaluate(graphdef, params, corpus, points, block_len=e.block_len, context_window=e.context_window,
                          streams=e.batch_size, vocab_chunk=config.train.vocab_chunk,
                          max_tokens=config.train.eval_max_tokens).scores
  out = {"step": step, "split": "dev", **{f"{x.name}_ppl": x.ppl for x in res}, "tokens": res[0].tokens}
  if _chief():
    with open(metrics_path, "a") as f:
      f.write(json.dumps(out) + "\n")
  _log(f"eval step {step}: " + " | ".join(f"{x.name} ppl {x.ppl:.3f}" for x in res) + f" ({res[0].tokens:,} tokens)")
  return out
