"""Perplexity the fairseq way, with TRIME local and long-term memory and the continuous-cache baseline.

The split is one token stream (documents concatenated, as fairseq's `eval_lm`). It is scored in chunks of
S = block_len - context_window targets; each chunk is fed with up to `context_window` preceding tokens that
are context only (fairseq `--context-window`). Every target is scored exactly once.

Memory at evaluation, for a scored token at window position t (all variants from ONE forward pass, so a grid
over τ, λ and θ costs one pass over the data):
  none   plain softmax (vanilla LM)
  local  TRIME with memory = every earlier token of the window (context included), temperature τ
  cache  continuous cache (Grave et al. 2017): (1-λ)·p_LM + λ·p_cache,
         p_cache(w) ∝ Σ_{j<t, x_j = w} exp(θ · g_t·g_j / √D), the same earlier tokens, the model's own keys
With `Variants.mem_size > 0` both TRIME and the cache also see a long-term store (`long_memory.py`): the
`mem_size` tokens before the window (of the same document unless `reset_at_documents=False`), each with the
key computed when it was scored. The windows stay the same, so mem_size=0 is exactly the local evaluation.
The original's --mem-size counts something else: its store keeps the last M *scored* tokens, so the window's
context tokens are in it (and again in the local memory). Both cover the same tokens when our mem_size =
original M - context_window (M >= context_window, `reset_at_documents=False`: the original's store never
resets); the original counts the context tokens twice, we count every token once (docs/long_memory.md).
Long-term evaluation runs `batch_size` streams in parallel: the windows are split into contiguous runs, one
per stream, and each stream first re-runs (without scoring) the windows whose tokens its store needs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from trime_jax import data as D
from trime_jax import long_memory as LM
from trime_jax import loss as L
from trime_jax import steps
from trime_jax.errors import ConfigError

EVAL_MEMORIES = ("none", "local", "cache")
# x-axis of memory-size sweeps: our mem_size convention, and how to read it as the original's --mem-size.
MEM_SIZE_AXIS_LABEL = ("long-term memory: tokens before the window (0 = local only; "
                       "original --mem-size = this + context window)")
# Default tuning grids (dev split): τ for TRIME memory; (λ, θ) for the continuous cache.
TAU_GRID = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
# With a long-term store the cache optimum moves to λ ≈ 0.45, θ ≈ 4 (docs/long_memory.md); the grid reaches past it.
CACHE_LAMBDA_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6)
CACHE_THETA_GRID = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


@dataclasses.dataclass(frozen=True)
class Window:
  start: int  # first target position fed to the model
  score_start: int  # first scored target position
  end: int  # one past the last target position (scored and fed)


def windows(num_targets: int, block_len: int, context_window: int) -> list[Window]:
  if not 0 <= context_window < block_len:
    raise ConfigError(f"eval.context_window={context_window} must be in [0, block_len={block_len})")
  stride = block_len - context_window
  out = []
  for s in range(0, num_targets, stride):
    e = min(s + stride, num_targets)
    out.append(Window(max(0, s - context_window), s, e))
  return out


def window_batch(corpus: D.Corpus, wins: list[Window], block_len: int):
  """inputs / targets [b, L] (-1 padded) and the scored mask [b, L]."""
  b = len(wins)
  inputs = np.zeros((b, block_len), np.int32)
  targets = np.full((b, block_len), -1, np.int32)
  scored = np.zeros((b, block_len), bool)
  toks = corpus.tokens
  for i, w in enumerate(wins):
    n = w.end - w.start
    targets[i, :n] = toks[w.start:w.end]
    if w.start == 0:
      inputs[i, 0] = corpus.vocab.bos
      inputs[i, 1:n] = toks[0:n - 1]
    else:
      inputs[i, :n] = toks[w.start - 1:w.end - 1]
    scored[i, w.score_start - w.start:n] = True
  return inputs, targets, scored


@dataclasses.dataclass(frozen=True)
class Variants:
  """What one pass computes: τ values for TRIME memory, (λ, θ) pairs for the cache, and the long-term store
  both see (`mem_size` tokens before the window; 0 = local memory only; the original's --mem-size
  = mem_size + context_window, see the module docstring)."""

  taus: tuple = ()
  cache: tuple = ()  # ((lambda, theta), ...)
  mem_size: int = 0
  reset_at_documents: bool = True  # the store holds only the query's own document

  def names(self):
    long = f",mem={self.mem_size}" if self.mem_size else ""
    trime = "local+long" if self.mem_size else "local"
    return (["none"] + [f"{trime}(tau={t:g}{long})" for t in self.taus]
            + [f"cache(lambda={l:g},theta={th:g}{long})" for l, th in self.cache])

  def families(self):
    """Per name: none | trime | cache (what a tuning pass minimises over)."""
    return ["none"] + ["trime"] * len(self.taus) + ["cache"] * len(self.cache)


# ----------------------------------------------------------------------------------------------------------
# The one softmax over the vocabulary and every memory block.
# ----------------------------------------------------------------------------------------------------------
def variant_nlls(stats: L.VocabStats, targets, blocks: list[LM.MemoryBlock], variants: Variants):
  """[n_variants, ..., Q] nll of every query under every variant; the test memory is the (disjoint) union
  of `blocks`. TRIME: one softmax over the vocabulary and all memories at temperature τ. Cache: the LM
  mixed with p_cache over the same memories at θ (the LM alone where no memory is visible)."""
  lse = L.masked_logsumexp_with
  out = [stats.log_normalizer - stats.target_logit]
  for tau in variants.taus:
    log_z, log_p = stats.log_normalizer, stats.target_logit
    for blk in blocks:
      log_z = lse(log_z, blk.sim / tau, blk.visible)
      log_p = lse(log_p, blk.sim / tau, blk.positive)
    out.append(log_z - log_p)
  if variants.cache:
    has_mem = functools.reduce(jnp.logical_or, [blk.visible.any(-1) for blk in blocks])
    log_pv = stats.target_logit - stats.log_normalizer
    log_pc = {}
    for theta in dict.fromkeys(th for _, th in variants.cache):  # p_cache depends on θ only
      log_all = log_pos = jnp.full(targets.shape, -jnp.inf)
      for blk in blocks:
        log_all = lse(log_all, theta * blk.sim, blk.visible)
        log_pos = lse(log_pos, theta * blk.sim, blk.positive)
      log_pc[theta] = jnp.where(has_mem, log_pos - jnp.where(has_mem, log_all, 0.0), -jnp.inf)
    for lam, theta in variants.cache:
      mixed = jnp.logaddexp(math.log1p(-lam) + log_pv, math.log(lam) + log_pc[theta])
      out.append(-jnp.where(has_mem, mixed, log_pv))
  return jnp.where(targets >= 0, jnp.stack(out), 0.0)


def local_block(keys_SxQxD, targets_SxQ, qpos_SxQ, keys_SxLxD, targets_SxL) -> LM.MemoryBlock:
  """Local memory: the window's tokens before each query (`qpos`: the query's position in the window)."""
  l = targets_SxL.shape[-1]
  vis = (jnp.arange(l)[None, None, :] < qpos_SxQ[:, :, None]) & (targets_SxL[:, None, :] >= 0)
  positive = vis & (targets_SxL[:, None, :] == targets_SxQ[:, :, None])
  return LM.MemoryBlock(LM.similarities(keys_SxQxD, keys_SxLxD), vis, positive)


def _window_nlls(stats: L.VocabStats, keys, targets, variants: Variants):
  """[n_variants, b, L] nll of every target under every variant (local memory: dense [L, L] per window)."""
  if not variants.taus and not variants.cache:
    return variant_nlls(stats, targets, [], variants)
  b, l = targets.shape
  qpos = jnp.broadcast_to(jnp.arange(l)[None, :], (b, l))
  return variant_nlls(stats, targets, [local_block(keys, targets, qpos, keys, targets)], variants)


@functools.partial(jax.jit, static_argnames=("graphdef", "variants", "vocab_chunk"))
def eval_step(graphdef, params, inputs, targets, scored, *, variants: Variants, vocab_chunk: int = 0):
  """Sums of nll over the scored targets, one per variant [n_variants] (local memory only)."""
  model = nnx.merge(graphdef, params)
  stats, keys = steps.forward(model, inputs, targets, vocab_chunk=vocab_chunk)
  nll = _window_nlls(stats, keys, targets, variants)
  return jnp.where(scored[None], nll, 0.0).sum(axis=(1, 2))


@functools.partial(jax.jit, static_argnames=("graphdef", "variants", "vocab_chunk"), donate_argnames=("store",))
def long_eval_step(graphdef, params, store: LM.Store, batch, *, variants: Variants, vocab_chunk: int = 0):
  """One window per stream: (nll sums over scored queries [n_variants], the store with them inserted).

  batch: inputs / targets [S, L]; start, offset (score_start - start), end [S] int32; doc_q [S, Q] document
  of each query; score, insert [S] bool (warm-up windows insert without scoring; idle rows do neither).
  Queries are the Q = L - context_window window positions from `offset` on.
  """
  model = nnx.merge(graphdef, params)
  targets = batch["targets"]
  stats, keys = steps.forward(model, batch["inputs"], targets, vocab_chunk=vocab_chunk)
  q = batch["doc_q"].shape[1]
  qpos = batch["offset"][:, None] + jnp.arange(q, dtype=jnp.int32)[None, :]  # [S, Q] window positions
  take = lambda x: jnp.take_along_axis(x, qpos, axis=1)
  q_stats = L.VocabStats(take(stats.log_normalizer), take(stats.target_logit))
  q_targets, q_keys = take(targets), jnp.take_along_axis(keys, qpos[:, :, None], axis=1)
  pos = batch["start"][:, None] + qpos  # global target positions
  real = (pos < batch["end"][:, None]) & (q_targets >= 0)
  blocks = [local_block(q_keys, q_targets, qpos, keys, targets)]
  if variants.mem_size:
    blocks.append(LM.block(store, q_keys, q_targets, batch["doc_q"], batch["start"], mem_size=variants.mem_size,
                           reset_at_documents=variants.reset_at_documents))
  nll = variant_nlls(q_stats, q_targets, blocks, variants)
  sums = jnp.where((real & batch["score"][:, None])[None], nll, 0.0).sum(axis=(1, 2))
  store = LM.insert(store, q_keys, q_targets, pos, batch["doc_q"], real & batch["insert"][:, None])
  return sums, store


# ----------------------------------------------------------------------------------------------------------
# Drivers
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class EvalResult:
  name: str
  nll: float  # mean nats per scored token
  tokens: int
  seconds: float
  bytes_level: bool

  @property
  def ppl(self) -> float:
    return math.exp(min(self.nll, 700.0))

  @property
  def bits_per_token(self) -> float:
    return self.nll / math.log(2)

  def as_dict(self) -> dict:
    d = {"variant": self.name, "nll": self.nll, "ppl": self.ppl, "tokens": self.tokens,
         "tokens_per_s": self.tokens / max(self.seconds, 1e-9)}
    if self.bytes_level:
      d["bpc"] = self.bits_per_token
    return d


def _results(variants, totals, scored_tokens, seconds, corpus) -> list[EvalResult]:
  is_bytes = corpus.vocab.kind == "bytes"
  return [EvalResult(name, float(tot / max(scored_tokens, 1)), scored_tokens, seconds, is_bytes)
          for name, tot in zip(variants.names(), totals)]


def evaluate(graphdef, params, corpus: D.Corpus, *, block_len: int, context_window: int, batch_size: int,
             variants: Variants = Variants(), vocab_chunk: int = 0, max_tokens: int = 0,
             progress: bool = False) -> list[EvalResult]:
  """Score `corpus` (one stream) under every variant in one pass; returns one `EvalResult` per variant.

  With `variants.mem_size > 0` this is `evaluate_streams` (long-term store, `batch_size` parallel streams).
  """
  if variants.mem_size:
    return evaluate_streams(graphdef, params, corpus, block_len=block_len, context_window=context_window,
                            streams=batch_size, variants=variants, vocab_chunk=vocab_chunk,
                            max_tokens=max_tokens, progress=progress)
  n = len(corpus) if not max_tokens else min(max_tokens, len(corpus))
  wins = windows(n, block_len, context_window)
  totals = np.zeros(len(variants.names()))
  scored_tokens = 0
  t0 = time.perf_counter()
  batches = range(0, len(wins), batch_size)
  for i in tqdm(batches, desc="eval", disable=not progress, unit="batch"):
    chunk = wins[i:i + batch_size]
    chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed shapes: repeat, then mask out
    inputs, targets, scored = window_batch(corpus, chunk, block_len)
    real = len(wins[i:i + batch_size])
    scored[real:] = False
    totals += np.asarray(eval_step(graphdef, params, inputs, targets, scored, variants=variants,
                                   vocab_chunk=vocab_chunk), np.float64)
    scored_tokens += int(scored.sum())
  return _results(variants, totals, scored_tokens, time.perf_counter() - t0, corpus)


def stream_schedule(wins: list[Window], doc_starts, streams: int, mem_size: int, reset_at_documents: bool):
  """Which window each stream runs at each step: (window [T, streams] int64, -1 = idle; score [T, streams]).

  The windows are cut into `streams` contiguous runs of about equal length; a run starting at window k is
  preceded by warm-up windows (run, inserted into the store, not scored): those whose scored tokens lie in
  [lo, score_start_k), lo = start_k - mem_size (raised to the start of score_start_k's document with
  `reset_at_documents`); every later window of the run needs nothing older. Each cut is placed, within a
  quarter run of its even position, where the warm-up is shortest (e.g. at a document start).
  """
  n_w = len(wins)
  start = np.array([w.start for w in wins], np.int64)
  score_start = np.array([w.score_start for w in wins], np.int64)
  end = np.array([w.end for w in wins], np.int64)
  lo = start - mem_size
  if reset_at_documents:
    doc_starts = np.asarray(doc_starts, np.int64)
    lo = np.maximum(lo, doc_starts[np.searchsorted(doc_starts, score_start, side="right") - 1])
  first = np.searchsorted(end, lo, side="right") if mem_size else np.arange(n_w)
  warm = np.arange(n_w) - np.minimum(first, np.arange(n_w))
  s = max(1, min(streams, n_w))
  radius = max(1, n_w // (4 * s))
  cuts = [0]
  for i in range(1, s):
    target = round(i * n_w / s)
    cand = np.arange(max(cuts[-1] + 1, target - radius), min(n_w - (s - i), target + radius) + 1)
    cuts.append(int(cand[np.lexsort((np.abs(cand - target), warm[cand]))[0]]))
  cuts.append(n_w)
  runs = [(np.arange(a - warm[a], b), np.arange(a - warm[a], b) >= a) for a, b in zip(cuts[:-1], cuts[1:])]
  t = max(len(w) for w, _ in runs)
  win = np.full((t, streams), -1, np.int64)
  score = np.zeros((t, streams), bool)
  for j, (w, sc) in enumerate(runs):
    win[:len(w), j], score[:len(w), j] = w, sc
  return win, score


@dataclasses.dataclass
class StreamPlan:
  """What a streamed evaluation runs: the windows, which window each stream runs at each step, and the
  empty long-term store (see `stream_schedule`)."""

  num_targets: int
  wins: list
  sched: np.ndarray  # [T, streams] window index, -1 = idle
  score: np.ndarray  # [T, streams] bool: scored (False: warm-up, insert only)
  queries: int  # Q = block_len - context_window scored positions per window
  store: LM.Store
  doc_starts: np.ndarray

  def batch(self, corpus: D.Corpus, step: int, block_len: int) -> dict:
    """Host arrays of step `step`: inputs / targets [S, L]; start, offset (score_start - start), end [S];
    doc_q [S, Q] document of each query; score, insert [S] bool."""
    idx = self.sched[step]
    ws = [self.wins[max(i, 0)] for i in idx]
    inputs, targets, _ = window_batch(corpus, ws, block_len)
    start = np.array([w.start for w in ws], np.int32)
    offset = np.array([w.score_start - w.start for w in ws], np.int32)
    qpos = start[:, None] + offset[:, None] + np.arange(self.queries)[None, :]
    return {"inputs": inputs, "targets": targets, "start": start, "offset": offset,
            "end": np.array([w.end for w in ws], np.int32),
            "doc_q": (np.searchsorted(self.doc_starts, qpos, side="right") - 1).astype(np.int32),
            "score": self.score[step], "insert": idx >= 0}


def stream_plan(graphdef, params, corpus: D.Corpus, *, block_len: int, context_window: int, streams: int,
                mem_size: int, reset_at_documents: bool, max_tokens: int = 0) -> StreamPlan:
  n = len(corpus) if not max_tokens else min(max_tokens, len(corpus))
  wins = windows(n, block_len, context_window)
  sched, score = stream_schedule(wins, corpus.doc_starts, streams, mem_size, reset_at_documents)
  q = block_len - context_window
  cfg = nnx.merge(graphdef, params).cfg
  store = LM.empty(streams, LM.capacity(mem_size, context_window, q), cfg.d_model, jnp.dtype(cfg.dtype))
  return StreamPlan(n, wins, sched, score, q, store, np.asarray(corpus.doc_starts, np.int64))


def evaluate_streams(graphdef, params, corpus: D.Corpus, *, block_len: int, context_window: int, streams: int,
                     variants: Variants, vocab_chunk: int = 0, max_tokens: int = 0,
                     progress: bool = False) -> list[EvalResult]:
  """`evaluate` with a long-term store: `streams` parallel streams, each a run of consecutive windows with its
  own on-device ring buffer of `long_memory.capacity(mem_size, ...)` slots. Results do not depend on
  `streams` (up to float rounding)."""
  plan = stream_plan(graphdef, params, corpus, block_len=block_len, context_window=context_window,
                     streams=streams, mem_size=variants.mem_size, reset_at_documents=variants.reset_at_documents,
                     max_tokens=max_tokens)
  store = plan.store
  totals = np.zeros(len(variants.names()))
  t0 = time.perf_counter()
  for step in tqdm(range(len(plan.sched)), desc=f"eval mem={variants.mem_size}", disable=not progress,
                   unit="step"):
    batch = plan.batch(corpus, step, block_len)
    sums, store = long_eval_step(graphdef, params, store, batch, variants=variants, vocab_chunk=vocab_chunk)
    totals += np.asarray(sums, np.float64)
  return _results(variants, totals, plan.num_targets, time.perf_counter() - t0, corpus)


def variants_from_config(ecfg, mem_size: int | None = None) -> Variants:
  """`Variants` of the `eval` config section (`mem_size` overrides `eval.mem_size`, e.g. in a sweep)."""
  if ecfg.memory not in EVAL_MEMORIES:
    raise ConfigError(f"eval.memory must be one of {EVAL_MEMORIES}, got {ecfg.memory!r}")
  mem = int(ecfg.mem_size if mem_size is None else mem_size)
  if mem < 0:
    raise ConfigError(f"eval.mem_size must be >= 0, got {mem}")
  long = dict(mem_size=mem, reset_at_documents=bool(ecfg.reset_at_documents))
  if ecfg.memory == "local":
    return Variants(taus=TAU_GRID if ecfg.tune else (float(ecfg.temperature),), **long)
  if ecfg.memory == "cache":
    if ecfg.tune:
      return Variants(cache=tuple(itertools.product(CACHE_LAMBDA_GRID, CACHE_THETA_GRID)), **long)
    if not 0.0 < ecfg.cache_lambda < 1.0:
      raise ConfigError(f"eval.cache_lambda must be in (0, 1), got {ecfg.cache_lambda}")
    return Variants(cache=((float(ecfg.cache_lambda), float(ecfg.cache_theta)),), **long)
  return Variants()


def format_table(rows: list[dict], columns=("variant", "ppl", "bpc", "nll", "tokens", "tokens_per_s")) -> str:
  cols = [c for c in columns if any(c in r for r in rows)]
  def fmt(v):
    if isinstance(v, float):
      return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}" if abs(v) < 10 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)
  cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
  return "\n".join(lines)
