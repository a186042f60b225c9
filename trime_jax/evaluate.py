"""Test time: every memory through one scorer, one driver and one tuner.

The split is one token stream (documents concatenated, as fairseq's `eval_lm`), cut into windows
(`data.windows`): chunks of S = block_len - context_window scored targets, each fed with up to
`context_window` earlier tokens as context only. Every target is scored exactly once.

A scored token's test memory is data layout, as in training: three sources of (key, next token) pairs, each
with `loss.TokenMeta` for its queries and memories, and `loss.visible` deciding who sees whom:
  local       the window's earlier tokens (context included): causal within the window
  long-term   earlier scored tokens (`long_memory.Store`), each keyed in the window that scored it, in one of
              two layouts (`StoreSpec.layout`, config eval.long_term_layout):
                original  the release's: the last `mem_size` scored tokens before the window's first scored
                          token, so the window's context tokens are in the store AND in the local memory (with
                          different keys); the original's --mem-size M is mem_size = M
                disjoint  ours: the `mem_size` tokens before the window's start, so every token counts once
                          (= the original's M when mem_size = M - context_window, apart from the duplicates)
              and of the query's document only with `reset_at_documents=True` (the original never resets)
  external    the top-K entries retrieved from a datastore (`knn.ExternalMemory`, one search per scored
              token): rows of their own (row -1), visible like training's other rows
A family's memory is a union of these blocks, and every family comes out of one pass (a grid over τ, τ′, λ, θ costs one pass, not one per point):

  none          the model's softmax alone
  cache         continuous cache (Grave et al. 2017): (1-λ)·p_LM + λ·p_mem(θ), memory = local + long-term
  trime_local   TRIME softmax over vocabulary + local + long-term, at τ (TrimeLM / TrimeLM_long)
  trime         TRIME softmax over vocabulary + local + long-term + retrieved, at τ (TrimeLM_ext)
  interp        (1-λ)·P_trime(τ) + λ·P′(τ′), P′(w) ∝ Σ_{memories with x_j = w} exp(sim/τ′), over the memories
                of `interp_memory`: "external" = the top-K retrieved only (the original release), "all" = local +
                long-term + retrieved (the paper's Appendix A text)
  knnlm         kNN-LM: (1-λ)·p_LM + λ·p_mem(θ), memory = retrieved only
  knnlm_cache   kNN-LM + continuous cache: (1-λ)·p_LM + λ·p_mem(θ), memory = local + long-term + retrieved

sim = g(c)·g(c_j)/√D throughout; p_mem(θ)(w) ∝ Σ_{x_j = w} exp(θ·sim). Where a query has no memory at all the
mixtures fall back to the model (P_trime or p_LM). The original's --interp-temp has no √D (its P′ is
softmax(g·k_j / τ′_orig) over the top-K): τ′_orig = √D·τ′ (D = 1,024: its 10.5 is our τ′ = 0.328).

The original layout reproduces the release's scores token by token (tests/test_oracle.py); the disjoint
layout differs from it only by the duplicated context tokens (docs/long_memory.md, "Two store layouts").

The driver runs `streams` parallel streams over a stream plan (`data.stream_schedule`): the windows split into
contiguous runs, one per stream, each with its own long-term store; a stream first re-runs (without scoring)
the windows whose tokens its store needs. One step = the forward pass (jitted), the search (host), the
scoring of every point (jitted). No memory, local, long-term and external memory all take this path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from trime_jax import checkpoint as ckpt
from trime_jax import corpora
from trime_jax import data
from trime_jax import exact_memory
from trime_jax import knn
from trime_jax import long_memory
from trime_jax import loss
from trime_jax import steps
from trime_jax.errors import CheckpointError, ConfigError

FAMILIES = ("none", "cache", "trime_local", "trime", "interp", "knnlm", "knnlm_cache")
EXTERNAL_FAMILIES = ("trime", "interp", "knnlm", "knnlm_cache")
# The parameters of each family, in display order (Point fields).
FAMILY_PARAMS = {"none": (), "cache": ("lam", "theta"), "trime_local": ("tau",), "trime": ("tau",),
                 "interp": ("tau", "tau_prime", "lam", "interp_memory"), "knnlm": ("lam", "theta"),
                 "knnlm_cache": ("lam", "theta")}
# Memory of the interpolation's P′: the original release's (top-K retrieved only) | the paper's text (all memories).
INTERP_MEMORIES = ("external", "all")
# launch.eval's eval.memory: which family (besides `none`) it scores.
EVAL_MEMORIES = {"none": None, "local": "trime_local", "cache": "cache"}
# Layouts of the long-term store (StoreSpec.layout): the release's (its context tokens twice) | ours (once each).
LONG_TERM_LAYOUTS = ("original", "disjoint")
# x-axis of memory-size sweeps, per layout: what mem_size counts.
MEM_SIZE_AXIS_LABELS = {
    "original": "long-term memory: last scored tokens kept (the original's --mem-size; 0 = local only)",
    "disjoint": "long-term memory: tokens before the window (0 = local only; original --mem-size ≈ this + context)"}


def mem_size_axis_label(rows) -> str:
  """What the mem_size of `rows` counts (rows written before the layouts existed are disjoint)."""
  layouts = {r.get("long_term_layout", "disjoint") for r in rows} or {"original"}
  return "; ".join(MEM_SIZE_AXIS_LABELS[lay] for lay in sorted(layouts))

# Tuning grids (dev split), one per parameter. τ′ and θ act on sim = g·g_j/√D. With hundreds of retrieved
# neighbours in the softmax the best τ is larger than with local memory alone, hence the long upper tail; with a
# long-term store the cache optimum moves to λ ≈ 0.45, θ ≈ 4 (docs/long_memory.md), the grids reach past it.
TAU_GRID = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0)
TAU_PRIME_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)
LAMBDA_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75)
THETA_GRID = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
GRIDS = {"tau": TAU_GRID, "tau_prime": TAU_PRIME_GRID, "lam": LAMBDA_GRID, "theta": THETA_GRID,
         "interp_memory": INTERP_MEMORIES}
DISPLAY_NAMES = {"tau": "tau", "tau_prime": "tau_prime", "lam": "lambda", "theta": "theta",
                 "interp_memory": "interp_memory"}


# ----------------------------------------------------------------------------------------------------------
# What one pass scores: points of the families.
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Point:
  """One family at one setting of its parameters (the others stay None)."""

  family: str
  tau: float | None = None  # TRIME temperature (trime_local, trime, interp)
  tau_prime: float | None = None  # P′ temperature (interp): P′ = p_mem at θ = 1/τ′
  lam: float | None = None  # mixture weight λ (cache, interp, knnlm, knnlm_cache)
  theta: float | None = None  # p_mem(θ) ∝ Σ exp(θ·sim) (cache, knnlm, knnlm_cache)
  interp_memory: str | None = None  # memories of P′ (interp): "external" | "all"

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ConfigError(f"unknown evaluation family {self.family!r}: one of {FAMILIES}")
    needed = FAMILY_PARAMS[self.family]
    for name in ("tau", "tau_prime", "lam", "theta", "interp_memory"):
      value = getattr(self, name)
      if (value is None) == (name in needed):
        raise ConfigError(f"{self.family} points take {needed or 'no parameters'}; {name}={value!r}")
    if self.interp_memory is not None and self.interp_memory not in INTERP_MEMORIES:
      raise ConfigError(f"interp_memory (eval.interp_memory) must be one of {INTERP_MEMORIES}, "
                        f"got {self.interp_memory!r}")
    if self.lam is not None and not 0.0 < self.lam < 1.0:
      raise ConfigError(f"λ of {self.family} must be in (0, 1), got {self.lam}")
    for name in ("tau", "tau_prime", "theta"):
      if getattr(self, name) is not None and not getattr(self, name) > 0:
        raise ConfigError(f"{name} of {self.family} must be > 0, got {getattr(self, name)}")

  @property
  def params(self) -> dict:
    """{parameter: value} of this family's parameters, in display order."""
    return {name: getattr(self, name) for name in FAMILY_PARAMS[self.family]}

  @property
  def group(self) -> str:
    """What tuning picks one point of: the family, or for `interp` the family and its P′ memory."""
    return f"interp[{self.interp_memory}]" if self.family == "interp" else self.family

  @property
  def name(self) -> str:
    if self.family == "none":
      return "none"
    fmt = lambda v: v if isinstance(v, str) else f"{v:g}"
    return f"{self.family}(" + ",".join(f"{DISPLAY_NAMES[k]}={fmt(v)}" for k, v in self.params.items()) + ")"

  @property
  def needs_external(self) -> bool:
    return self.family in EXTERNAL_FAMILIES


NONE = Point("none")


def grid(families) -> tuple[Point, ...]:
  """Every point of each family over the tuning grids (`interp`: both P′ memories)."""
  out = []
  for family in families:
    names = FAMILY_PARAMS[family]
    out += [Point(family, **dict(zip(names, values))) for values in itertools.product(*(GRIDS[n] for n in names))]
  return tuple(out)


def configured_points(e, families) -> tuple[Point, ...]:
  """One point per family from the `eval` config section (no tuning)."""
  tau, lam, theta = float(e.temperature), float(e.knn_lambda), float(e.cache_theta)
  settings = {"none": {}, "cache": dict(lam=float(e.cache_lambda), theta=theta), "trime_local": dict(tau=tau),
              "trime": dict(tau=tau), "knnlm": dict(lam=lam, theta=theta), "knnlm_cache": dict(lam=lam, theta=theta),
              "interp": dict(tau=tau, tau_prime=float(e.knn_temperature), lam=lam, interp_memory=str(e.interp_memory))}
  return tuple(Point(f, **settings[f]) for f in families)


@dataclasses.dataclass(frozen=True)
class StoreSpec:
  """The long-term store every point sees (static: part of the jit cache key). 0: local memory only.
  layout "original": the last mem_size scored tokens before the window's first scored token (the release's
  --mem-size; the window's context tokens are there too); "disjoint": the mem_size tokens before the window."""

  mem_size: int = 0
  reset_at_documents: bool = False  # the store holds only the query's own document (the original: False)
  layout: str = "original"  # LONG_TERM_LAYOUTS

  def __post_init__(self):
    if self.mem_size < 0:
      raise ConfigError(f"eval.mem_size must be >= 0, got {self.mem_size}")
    if self.layout not in LONG_TERM_LAYOUTS:
      raise ConfigError(f"eval.long_term_layout must be one of {LONG_TERM_LAYOUTS}, got {self.layout!r}")

  def reach(self, context_window: int) -> int:
    """How far before a window's first scored token the store can be seen."""
    return self.mem_size + (context_window if self.layout == "disjoint" else 0)


# ----------------------------------------------------------------------------------------------------------
# Memory blocks: each source lays out TokenMeta for its queries and memories; `loss.visible` decides.
# ----------------------------------------------------------------------------------------------------------
class MemoryBlock(NamedTuple):
  """One source of memories for queries `[S, Q]`; all fields `[S, Q, M]`."""

  sim: jax.Array  # g(c)·g(c_j) / √D, before the temperature (TRIME) or θ (cache)
  visible: jax.Array  # bool: memory j is in query i's test memory
  positive: jax.Array  # bool: visible and memory j's target equals query i's target


class QueryStats(NamedTuple):
  """The vocabulary side of every scored query: `loss.VocabStats`, plus the target logit inside the TRIME
  softmax (the original's adaptive-softmax scorer drops one tail word's term: `ModelConfig.adaptive_tail_ignores_pad`)."""

  log_normalizer: jax.Array
  target_logit: jax.Array
  trime_target_logit: jax.Array


def similarities(queries_SxQxD, keys_SxMxD):
  d = queries_SxQxD.shape[-1]
  return jnp.einsum("sqd,smd->sqm", queries_SxQxD, keys_SxMxD, preferred_element_type=jnp.float32,
                    precision=loss.similarity_precision(queries_SxQxD, keys_SxMxD)) / math.sqrt(d)


def _meta(target, *, row=0, group=0, order=0, doc=0) -> loss.TokenMeta:
  full = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), target.shape)
  return loss.TokenMeta(full(row), full(group), full(order), full(target), full(doc))


def _block(sim, query: loss.TokenMeta, memory: loss.TokenMeta, **rule) -> MemoryBlock:
  vis = loss.visible(query, memory, **rule)
  return MemoryBlock(sim, vis, loss.positive(query, memory, vis))


def local_block(queries_SxQxD, targets_SxQ, qpos_SxQ, keys_SxLxD, targets_SxL) -> MemoryBlock:
  """The window's tokens before each query (`qpos`: the query's position in the window); documents do not
  matter inside a window (as in fairseq's scoring of a block)."""
  window_pos = jnp.broadcast_to(jnp.arange(targets_SxL.shape[-1], dtype=jnp.int32), targets_SxL.shape)
  return _block(similarities(queries_SxQxD, keys_SxLxD), _meta(targets_SxQ, order=qpos_SxQ),
                _meta(targets_SxL, order=window_pos), causal=True, cross_rows=False)


def long_term_block(store: long_memory.Store, queries_SxQxD, targets_SxQ, doc_SxQ, store_end_S, span_S,
                    long_term: StoreSpec) -> MemoryBlock:
  """The store's tokens in [end - span, end): for the store, a query stands at `end` (`StreamPlan.batch`).
  original layout: end = the window's first scored token, span = mem_size (the last mem_size scored tokens;
  the window's context tokens are among them). disjoint: end = the window's start (tokens from there on are
  the window's own, seen as local memory), span = mem_size + context_window - the window's context length
  (= mem_size whenever the window has its full context)."""
  doc_q, doc_m = (doc_SxQ, store.doc) if long_term.reset_at_documents else (0, 0)
  query = _meta(targets_SxQ, order=store_end_S[:, None], doc=doc_q)
  mem = _meta(store.targets, order=store.pos, doc=doc_m)
  return _block(similarities(queries_SxQxD, store.keys), query, mem, causal=True, cross_rows=False,
                span=jnp.broadcast_to(span_S[:, None], targets_SxQ.shape))


def external_block(sim_SxQxK, retrieved_targets_SxQxK, targets_SxQ) -> MemoryBlock:
  """The retrieved entries: rows of their own (row -1), visible to every query unless padding (target -1)."""
  query = _meta(targets_SxQ[..., None], row=0)  # [S, Q, 1]: each query against its own K entries
  mem = _meta(retrieved_targets_SxQxK, row=-1, group=-1)
  blk = _block(sim_SxQxK, query, mem, causal=False, cross_rows=True)
  return MemoryBlock(sim_SxQxK, blk.visible[..., 0, :], blk.positive[..., 0, :])


# ----------------------------------------------------------------------------------------------------------
# The one scorer: every point from the vocabulary statistics and the memory blocks.
# ----------------------------------------------------------------------------------------------------------
def _log_p_mem(blocks, scale, targets):
  """(log p_mem(target), has_memory): p_mem(w) ∝ Σ_{visible, x_j = w} exp(scale·sim) over `blocks`."""
  lse = loss.masked_logsumexp_with
  log_all = log_pos = jnp.full(targets.shape, -jnp.inf)
  for blk in blocks:
    log_all = lse(log_all, scale * blk.sim, blk.visible)
    log_pos = lse(log_pos, scale * blk.sim, blk.positive)
  has = functools.reduce(jnp.logical_or, [blk.visible.any(-1) for blk in blocks])
  return jnp.where(has, log_pos - jnp.where(has, log_all, 0.0), -jnp.inf), has


def exact_scales(points) -> tuple:
  """The scales c at which `point_nlls` reads the external memory (c·sim: 1/τ, 1/τ′, θ): what the exact
  on-device memory sums over (`exact_memory.external_log_terms`)."""
  out = set()
  for pt in points:
    if pt.family in ("trime", "interp"):
      out.add(1.0 / pt.tau)
    if pt.family == "interp":
      out.add(1.0 / pt.tau_prime)
    if pt.family in ("knnlm", "knnlm_cache"):
      out.add(pt.theta)
  return tuple(sorted(out))


def _mix(log_p_model, log_p_mem, has_mem, lam):
  mixed = jnp.logaddexp(math.log1p(-lam) + log_p_model, math.log(lam) + log_p_mem)
  return jnp.where(has_mem, mixed, log_p_model)


def point_nlls(stats: QueryStats, targets, local_blocks, ext_block, points):
  """[P, ..., Q] nll of every query under every point. `local_blocks`: local (+ long-term) memory;
  `ext_block`: the retrieved entries, or None, or (exact on-device memory, `exact_memory.summary_blocks`) one
  block per scale at which the points read it. Shared terms (a TRIME softmax at τ, a p_mem at θ) are computed
  once per pass."""
  lse = loss.masked_logsumexp_with

  def blocks_of(which, scale):
    if which == "local":  # (exact memory holds sums only at the scales the external readers use)
      return local_blocks
    ext = [] if ext_block is None else [MemoryBlock(*ext_block[scale]) if isinstance(ext_block, dict) else ext_block]
    return ext if which == "external" else local_blocks + ext

  log_p_vocab = stats.target_logit - stats.log_normalizer

  def log_p_trime(blocks, tau):
    # ModelConfig.adaptive_tail_ignores_pad (QueryStats); a plain loss.VocabStats (mt.decode) has one target term
    z, p = stats.log_normalizer, getattr(stats, "trime_target_logit", stats.target_logit)
    for blk in blocks:
      z, p = lse(z, blk.sim / tau, blk.visible), lse(p, blk.sim / tau, blk.positive)
    return p - z

  memo = {}

  def once(key, fn):
    if key not in memo:
      memo[key] = fn()
    return memo[key]

  out = []
  for pt in points:
    if pt.family == "none":
      lp = log_p_vocab
    elif pt.family in ("trime_local", "trime"):
      which = "local" if pt.family == "trime_local" else "all"
      lp = once(("trime", which, pt.tau), lambda: log_p_trime(blocks_of(which, 1.0 / pt.tau), pt.tau))
    elif pt.family == "interp":  # P′ at θ = 1/τ′: shared with knnlm(_cache) at that θ
      lt = once(("trime", "all", pt.tau), lambda: log_p_trime(blocks_of("all", 1.0 / pt.tau), pt.tau))
      lm, has = once(("mem", pt.interp_memory, 1.0 / pt.tau_prime),
                     lambda: _log_p_mem(blocks_of(pt.interp_memory, 1.0 / pt.tau_prime), 1.0 / pt.tau_prime, targets))
      lp = _mix(lt, lm, has, pt.lam)
    else:  # cache | knnlm | knnlm_cache: the model mixed with a memory-only distribution at θ
      which = {"cache": "local", "knnlm": "external", "knnlm_cache": "all"}[pt.family]
      lm, has = once(("mem", which, pt.theta), lambda: _log_p_mem(blocks_of(which, pt.theta), pt.theta, targets))
      lp = _mix(log_p_vocab, lm, has, pt.lam)
    out.append(-lp)
  return jnp.where(targets >= 0, jnp.stack(out), 0.0)


# ----------------------------------------------------------------------------------------------------------
# The one step, in two jitted halves around the host-side search.
# ----------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("graphdef", "queries", "vocab_chunk"))
def forward_queries(graphdef, params, inputs_SxL, targets_SxL, qstart_S, carry=None, reset_S=None, *, queries: int,
                    vocab_chunk: int):
  """(keys [S, L, D], query keys [S, Q, D], query VocabStats [S, Q], query targets [S, Q], query window
  positions [S, Q][, new carry]): the Q positions from `qstart` on (they include every scored position of the
  window). A stateful model continues every stream from `carry` (reset where `reset_S`) and returns it too."""
  model = nnx.merge(graphdef, params)
  if carry is not None:
    carry = model.reset_carry(carry, reset_S)
    (stats, crit), keys, carry = steps.forward_carry(model, inputs_SxL, targets_SxL, carry, vocab_chunk=vocab_chunk,
                                                     criterion="both")
  else:
    (stats, crit), keys = steps.forward(model, inputs_SxL, targets_SxL, vocab_chunk=vocab_chunk, criterion="both")
  qpos = qstart_S[:, None] + jnp.arange(queries, dtype=jnp.int32)[None, :]
  take = lambda x: jnp.take_along_axis(x, qpos, axis=1)
  # the model's own target term (plain, cache, kNN-LM) and the TRIME softmax's (`model.vocab_stats` criterion)
  q_stats = QueryStats(take(stats.log_normalizer), take(stats.target_logit), take(crit))
  q_keys = jnp.take_along_axis(keys, qpos[:, :, None], axis=1)
  out = (keys, q_keys, q_stats, take(targets_SxL), qpos)
  return out if carry is None else out + (carry,)


@functools.partial(jax.jit, static_argnames=("points", "long_term", "n_buckets"), donate_argnames=("store",))
def score_step(store: long_memory.Store, keys, targets, q_keys, q_stats, q_targets, qpos, batch, ext_sim,
               ext_targets, bucket_q, ext_exact=None, *, points: tuple, long_term: StoreSpec, n_buckets: int):
  """(nll sums [P], per-bucket nll sums [P, n_buckets], per-bucket token counts [n_buckets], the store with
  this step's queries inserted, every query's nll [P, S, Q] (0 where not scored), its global target position
  [S, Q] (-1 where not scored)). External memory: top-K retrieved (`ext_sim`, `ext_targets` [S, Q, K]) or the
  exact on-device sums (`ext_exact`: (lse_neg, lse_pos) [C, S, Q] at `exact_scales(points)`)."""
  pos = batch["start"][:, None] + qpos  # global target positions
  real = batch["own"] & (q_targets >= 0)
  local = [local_block(q_keys, q_targets, qpos, keys, targets)]
  if long_term.mem_size:
    local.append(long_term_block(store, q_keys, q_targets, batch["doc_q"], batch["store_end"], batch["span"],
                                 long_term))
  ext = external_block(ext_sim, ext_targets, q_targets) if ext_sim is not None else None
  if ext_exact is not None:
    ext = exact_memory.summary_blocks(*ext_exact, exact_scales(points))
  nll = point_nlls(q_stats, q_targets, local, ext, points)  # [P, S, Q]
  scored = real & batch["score"][:, None]
  nll = jnp.where(scored[None], nll, 0.0)
  onehot = jax.nn.one_hot(bucket_q, n_buckets, dtype=nll.dtype) * scored[..., None]
  store = long_memory.insert(store, q_keys, q_targets, pos, batch["doc_q"], real & batch["insert"][:, None])
  return (nll.sum(axis=(1, 2)), jnp.einsum("psq,sqb->pb", nll, onehot), onehot.sum(axis=(0, 1)), store,
          nll, jnp.where(scored, pos, -1))


@dataclasses.dataclass
class StreamPlan:
  """What the driver runs: the windows, which window each stream runs at each step (`data.stream_schedule`),
  and the empty long-term store."""

  num_targets: int
  wins: list
  schedule: np.ndarray  # [T, streams] window index, -1 = idle
  score: np.ndarray  # [T, streams] bool: scored (False: warm-up, insert only)
  queries: int  # Q: scored positions per window (block_len - context_window; complete mode: its longest block)
  store: long_memory.Store
  doc_starts: np.ndarray
  block_len: int  # L: model input length
  long_term: StoreSpec
  context_window: int

  def batch(self, corpus: data.Corpus, step: int) -> dict:
    """Host arrays of step `step`: inputs / targets [S, L]; start, offset (score_start - start), qstart (the
    first of the Q query positions: the offset, or earlier where Q positions from it would pass L; those
    before the offset are not scored), store_end, span (the store's tokens a query sees: [store_end - span,
    store_end), `long_term_block`), reset (a stateful model's
    stream does not continue its previous step's window) [S]; doc_q [S, Q]
    document of each query; own [S, Q] bool: the query is one of its window's scored targets; score, insert
    [S] bool."""
    idx = self.schedule[step]
    ws = [self.wins[max(i, 0)] for i in idx]
    inputs, targets, _ = data.window_batch(corpus, ws, self.block_len)
    start = np.array([w.start for w in ws], np.int32)
    offset = np.array([w.score_start - w.start for w in ws], np.int32)
    qstart = np.minimum(offset, self.block_len - self.queries)
    qpos = start[:, None] + qstart[:, None] + np.arange(self.queries)[None, :]
    ends = np.array([w.end for w in ws], np.int32)
    # A stateful model's stream continues only from the window right before (the stream's previous step).
    prev = self.schedule[step - 1] if step else np.full_like(idx, -1)
    reset = (prev < 0) | (idx != prev + 1)
    return {"inputs": inputs, "targets": targets, "start": start, "offset": offset, "qstart": qstart, "reset": reset,
            **self._store_view(start, offset),
            "own": (qpos >= (start + offset)[:, None]) & (qpos < ends[:, None]),
            "doc_q": (np.searchsorted(self.doc_starts, qpos, side="right") - 1).astype(np.int32),
            "score": self.score[step], "insert": idx >= 0}

  def _store_view(self, start, offset) -> dict:
    if self.long_term.layout == "original":
      return {"store_end": start + offset, "span": np.full_like(start, self.long_term.mem_size)}
    return {"store_end": start, "span": self.long_term.reach(self.context_window) - offset}


def stream_plan(corpus: data.Corpus, *, block_len: int, context_window: int, streams: int,
                long_term: StoreSpec, d_model: int, dtype, max_tokens: int = 0,
                break_mode: str = "none") -> StreamPlan:
  n = len(corpus) if not max_tokens else min(max_tokens, len(corpus))
  wins = data.eval_windows(corpus, n, block_len, context_window, break_mode)
  reach = long_term.reach(context_window)  # warm-up windows and store slots: what the store must still hold
  schedule, score = data.stream_schedule(wins, corpus.doc_starts, streams, long_term.mem_size,
                                         long_term.reset_at_documents, context_window=reach - long_term.mem_size)
  q = block_len - context_window
  if break_mode == "complete":  # blocks of whole lines: up to block_len scored tokens (a long line)
    q = max(w.end - w.score_start for w in wins)
  store = long_memory.empty(streams, long_memory.capacity(reach, 0, q), d_model, dtype)
  return StreamPlan(n, wins, schedule, score, q, store, np.asarray(corpus.doc_starts, np.int64), block_len,
                    long_term, context_window)


# ----------------------------------------------------------------------------------------------------------
# The one driver.
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Score:
  point: Point
  nll: float  # mean nats per scored token
  tokens: int
  seconds: float
  bytes_level: bool

  @property
  def name(self) -> str:
    return self.point.name

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


@dataclasses.dataclass
class EvalResult:
  scores: list  # [Score] per point, in the order given
  bucket_nll: np.ndarray  # [P, n_buckets] mean nll per frequency bucket (nan where a bucket is empty)
  bucket_tokens: np.ndarray  # [n_buckets]
  retrieval_hits: np.ndarray | None  # [len(knn.RETRIEVAL_KS)] scored tokens whose target is in the top-k next
  #   tokens (None: exact on-device memory, no ranking)
  seconds: float
  search_seconds: float
  token_nll: np.ndarray | None = None  # [P, tokens] float32 nll of every scored target in stream order
  #   (`evaluate(..., per_token=True)`), e.g. to compare with another implementation token by token

  @property
  def tokens(self) -> int:
    return self.scores[0].tokens

  def retrieval_accuracy(self) -> dict:
    if self.retrieval_hits is None:
      return {}
    return {f"top{k}": float(h) / max(self.tokens, 1) for k, h in zip(knn.RETRIEVAL_KS, self.retrieval_hits)}


class ProgressLog:
  """Plain progress lines on stderr where no one watches a bar: after the first step (its time includes
  compilation), then every `every_s` seconds with the rate since the first step and the ETA, and at the end."""

  def __init__(self, desc: str, total: int, every_s: float = 60.0):
    self.desc, self.total, self.every_s = desc, total, every_s
    self.t0 = self.last = time.perf_counter()
    self.t1 = None  # after the first step

  def step(self, done: int) -> None:
    now = time.perf_counter()
    if done > 1 and done < self.total and now - self.last < self.every_s:
      return
    line = f"{self.desc}: step {done:,}/{self.total:,} after {now - self.t0:,.0f} s"
    if self.t1 is None:
      self.t1 = now
      line += " (the first step compiles)"
    elif done < self.total:
      rate = (done - 1) / max(now - self.t1, 1e-9)
      line += f", {rate:.3g} steps/s, ETA {(self.total - done) / rate:,.0f} s"
    print(line, file=sys.stderr, flush=True)
    self.last = now


def evaluate(graphdef, params, corpus: data.Corpus, points, *, block_len: int, context_window: int, streams: int,
             long_term: StoreSpec = StoreSpec(),
             external: knn.ExternalMemory | exact_memory.DeviceDatastore | None = None, vocab_chunk: int = 0,
             max_tokens: int = 0, word_buckets_V=None, progress: bool | str = False,
             break_mode: str = "none", per_token: bool = False) -> EvalResult:
  """Score `corpus` under every point in one pass: `streams` parallel streams, each with a long-term store of
  `long_term.mem_size` tokens, plus one top-K search per scored token when `external` is given (a
  `knn.ExternalMemory`), or every datastore entry (an `exact_memory.DeviceDatastore`: exact sums on device,
  no retrieval accuracy). Results do not depend on `streams` (up to float rounding). `break_mode`: fairseq's
  --sample-break-mode of the windows (`data.eval_windows`). `progress`: True a tqdm bar, "log" plain lines on
  stderr (`ProgressLog`: a log file, or a remote accelerator's output), False nothing. `per_token`: also
  every scored target's nll under every point (`EvalResult.token_nll`)."""
  points = tuple(points)
  if not points:
    raise ConfigError("nothing to evaluate: no points")
  if any(p.needs_external for p in points) and external is None:
    raise ConfigError("external-memory families (trime, interp, knnlm, knnlm_cache) need a datastore + index "
                      "(eval.datastore)")
  if streams < 1:
    raise ConfigError(f"eval.batch_size (streams) must be >= 1, got {streams}")
  model = nnx.merge(graphdef, params)
  model_cfg, stateful = model.cfg, bool(getattr(model, "stateful", False))
  if stateful and context_window:
    raise ConfigError(f"a stateful model ({model_cfg.backbone}) carries its state from window to window: "
                      f"eval.context_window must be 0, got {context_window}")
  if block_len > model_cfg.max_len:
    raise CheckpointError(f"eval.block_len={block_len} exceeds the model's max_len={model_cfg.max_len}")
  if external is not None and external.dimension != model_cfg.d_model:
    raise ConfigError(f"datastore keys have dimension {external.dimension}, the model's keys {model_cfg.d_model}")
  plan = stream_plan(corpus, block_len=block_len, context_window=context_window, streams=streams,
                     long_term=long_term, d_model=model_cfg.d_model, dtype=jnp.dtype(model_cfg.dtype),
                     max_tokens=max_tokens, break_mode=break_mode)
  n, store = plan.num_targets, plan.store
  carry = model.init_carry(len(plan.schedule[0]), block_len) if stateful else None
  del model
  buckets = np.zeros(model_cfg.vocab_size, np.int32) if word_buckets_V is None else np.asarray(word_buckets_V)
  n_buckets = len(knn.FREQ_BUCKETS)
  totals = np.zeros(len(points))
  bucket_totals = np.zeros((len(points), n_buckets))
  bucket_counts = np.zeros(n_buckets)
  hits = np.zeros(len(knn.RETRIEVAL_KS), np.int64)
  token_nll = np.full((len(points), n), np.nan, np.float32) if per_token else None
  search_s0 = external.search_seconds if external is not None else 0.0
  on_device = isinstance(external, exact_memory.DeviceDatastore)
  scales = exact_scales(points)
  t0 = time.perf_counter()
  desc = "eval" + (" (external)" if external else "") + (f" mem={long_term.mem_size}" if long_term.mem_size else "")
  log = ProgressLog(desc, len(plan.schedule)) if progress == "log" else None
  for step in tqdm(range(len(plan.schedule)), desc=desc, disable=progress is not True, unit="step"):
    batch = plan.batch(corpus, step)
    out = forward_queries(graphdef, params, batch["inputs"], batch["targets"], batch["qstart"], carry,
                          batch["reset"] if stateful else None, queries=plan.queries, vocab_chunk=vocab_chunk)
    keys, q_keys, q_stats, q_targets, qpos = out[:5]
    carry = out[5] if stateful else None
    q_targets_np = np.asarray(q_targets)
    ext_sim = ext_targets = ext_exact = None
    if on_device:  # every datastore entry, on the devices (retrieval accuracy does not apply)
      ext_exact = external.log_terms(q_keys, q_targets, scales)
    elif external is not None:
      scored = batch["own"] & (q_targets_np >= 0) & batch["score"][:, None]
      ext_sim = np.zeros(scored.shape + (external.k,), np.float32)
      ext_targets = np.full(scored.shape + (external.k,), -1, np.int32)
      if scored.any():  # one search per scored token; warm-up windows only fill the store
        got = external.retrieve(np.asarray(q_keys)[scored])
        ext_sim[scored], ext_targets[scored] = got.sim, got.targets
        hits += knn.retrieval_hits(got.targets, q_targets_np[scored])
    bucket_q = buckets[np.maximum(q_targets_np, 0)]
    sums, bucket_sums, bucket_count, store, step_nll, step_pos = score_step(
        store, keys, batch["targets"], q_keys, q_stats, q_targets, qpos, batch, ext_sim, ext_targets, bucket_q,
        ext_exact, points=points, long_term=long_term, n_buckets=n_buckets)
    if token_nll is not None:
      step_pos = np.asarray(step_pos)
      token_nll[:, step_pos[step_pos >= 0]] = np.asarray(step_nll)[:, step_pos >= 0]
    totals += np.asarray(sums, np.float64)
    bucket_totals += np.asarray(bucket_sums, np.float64)
    bucket_counts += np.asarray(bucket_count, np.float64)
    if log is not None:
      log.step(step + 1)
  seconds = time.perf_counter() - t0
  is_bytes = corpus.vocab.kind == "bytes"
  scores = [Score(p, float(t / max(n, 1)), n, seconds, is_bytes) for p, t in zip(points, totals)]
  with np.errstate(invalid="ignore", divide="ignore"):
    bucket_nll = np.where(bucket_counts > 0, bucket_totals / bucket_counts, np.nan)
  search = (external.search_seconds - search_s0) if external is not None else 0.0
  return EvalResult(scores, bucket_nll, bucket_counts, None if on_device else hits, seconds, search, token_nll)


# ----------------------------------------------------------------------------------------------------------
# The one tuner.
# ----------------------------------------------------------------------------------------------------------
def tune(result: EvalResult) -> dict:
  """{group: Score} of the lowest-nll point of each group (family; `interp`: each P′ memory); the first of
  equal ones."""
  best = {}
  for s in result.scores:
    if s.point.group not in best or s.nll < best[s.point.group].nll:
      best[s.point.group] = s
  return best


# ----------------------------------------------------------------------------------------------------------
# A whole evaluation of an exported checkpoint (launch.eval, launch.eval_ext and launch.demo wrap this).
# ----------------------------------------------------------------------------------------------------------
def load_eval_data(config, vocab):
  """The config's corpora encoded with the checkpoint's vocabulary (kinds must agree)."""
  splits = corpora.load_splits(config.data, vocab=vocab if vocab.kind == "words" else None)
  if splits.vocab.kind != vocab.kind or len(splits.vocab) != len(vocab):
    raise CheckpointError(
        f"checkpoint vocabulary ({vocab.kind}, {len(vocab)} tokens) does not match data.corpus="
        f"{config.data.corpus!r} ({splits.vocab.kind}, {len(splits.vocab)} tokens)")
  return splits


def families_of(e, external_memory: bool) -> tuple:
  """Families an evaluation scores: every family with external memory; else `none` and eval.memory's."""
  if external_memory:
    return FAMILIES
  if e.memory not in EVAL_MEMORIES:
    raise ConfigError(f"eval.memory must be one of {tuple(EVAL_MEMORIES)}, got {e.memory!r}")
  return ("none",) + ((EVAL_MEMORIES[e.memory],) if EVAL_MEMORIES[e.memory] else ())


def _rows(result: EvalResult, *, split: str, mem_size: int, layout: str, best: dict | None, dev_best: dict | None,
          label: str) -> list[dict]:
  rows = []
  for s in result.scores:
    row = {**s.as_dict(), "family": s.point.family, "params": s.point.params, "mem_size": mem_size,
           "long_term_layout": layout, "split": split,
           f"{split}_ppl": s.ppl}
    if s.point.family == "interp":
      row["interp_memory"] = s.point.interp_memory  # "external" (the original's P′) or "all" (the paper's text)
    if s.bytes_level:
      row[f"{split}_bpc"] = s.bits_per_token
    if dev_best is not None:
      row["dev_ppl"] = dev_best[s.point.group].ppl
    if best is not None and s.point.family != "none" and best[s.point.group] is s:
      row["best"] = True
      if len(result.scores) > len(best):  # a grid: mark its best points
        row["variant"] += "  <- best"
    if label:
      row["model"] = label
    rows.append(row)
  return rows


def on_device_datastore(e, checkpoint_dir: str) -> exact_memory.DeviceDatastore:
  """eval.datastore on all devices (eval.datastore_on_device=True), checked against the model; the FAISS index
  is not read."""
  if not isinstance(e.datastore_on_device, bool):
    raise ConfigError(f"eval.datastore_on_device must be True or False, got {e.datastore_on_device!r}")
  if e.knn_gpu:
    raise ConfigError("eval.datastore_on_device=True scores every key on the devices without FAISS: "
                      "eval.knn_gpu=True does not apply (set one of them)")
  ds = exact_memory.Datastore(e.datastore)
  ds.check_checkpoint(checkpoint_dir)
  return exact_memory.load_datastore(ds)


def evaluate_checkpoint(config, checkpoint_dir: str, *, external_memory: bool = False, mem_sizes=None,
                        label: str = "", progress: bool | str = False, throughput_tokens: int = 0) -> dict:
  """Evaluate an export on `config.eval.split`, for each long-term memory size of `mem_sizes` (default:
  eval.mem_size). Families: `families_of(config.eval, external_memory)`; external memory needs
  eval.datastore.

  With eval.tune every family's parameters are grid-searched on dev (the interpolation for both P′ memories):
  when the split is dev the grid's rows are the result (the best of each group marked), otherwise the best
  points are applied to the split (rows carry dev_ppl). Returns {"rows": [...], ...}: rows with family, params,
  variant, nll, ppl, <split>_ppl, tokens, mem_size, split (+ model, dev_ppl, best); with external memory also
  retrieval accuracy, frequency-bucket perplexities and (if `throughput_tokens`) throughput with vs without
  external memory."""
  checkpoint_dir = os.path.abspath(checkpoint_dir)
  graphdef, params, train_config, vocab, _ = ckpt.load_export(checkpoint_dir)
  splits = load_eval_data(config, vocab)
  e = config.eval
  families = families_of(e, external_memory)
  if e.interp_memory not in INTERP_MEMORIES:
    raise ConfigError(f"eval.interp_memory must be one of {INTERP_MEMORIES}, got {e.interp_memory!r}")
  knn_memory = buckets = None
  if external_memory:
    if not e.datastore:
      raise ConfigError("eval.datastore is not set: build one with `python -m launch.build_datastore`")
    if e.datastore_on_device:
      knn_memory = on_device_datastore(e, checkpoint_dir)
    else:
      knn_memory = knn.ExternalMemory(e.datastore, index_path=e.index, checkpoint_dir=checkpoint_dir, k=e.knn_k,
                                      nprobe=e.nprobe, exact=e.knn_exact, gpu=e.knn_gpu)
    buckets = knn.frequency_buckets(splits.train.tokens, len(vocab)) if vocab.kind == "words" else None
  points = grid(families) if e.tune else configured_points(e, families)
  sizes = [int(m) for m in mem_sizes] if mem_sizes else [int(e.mem_size)]
  if families == ("none",):
    sizes = [0]  # nothing reads the store
  run = functools.partial(evaluate, graphdef, params, block_len=e.block_len, context_window=e.context_window,
                          streams=e.batch_size, external=knn_memory, vocab_chunk=train_config.train.vocab_chunk,
                          max_tokens=e.max_tokens, word_buckets_V=buckets, progress=progress,
                          break_mode=e.get("sample_break_mode", "none"))
  out = {"checkpoint": checkpoint_dir, "split": e.split, "rows": []}
  if external_memory:
    on_device = isinstance(knn_memory, exact_memory.DeviceDatastore)
    out.update(datastore=e.datastore, index="on_device_exact" if on_device else knn_memory.index.kind,
               k=knn_memory.k, nprobe=e.nprobe, exact=bool(e.knn_exact or on_device), mem_size=sizes[0])
  for mem_size in sizes:
    long_term = StoreSpec(mem_size, bool(e.reset_at_documents), str(e.long_term_layout))
    best = dev_best = None
    if e.tune:  # on the first eval.tune_max_tokens dev targets (0: eval.max_tokens)
      dev = run(splits.dev, points, long_term=long_term, max_tokens=int(e.get("tune_max_tokens", 0)) or e.max_tokens)
      out["dev_tokens"] = dev.tokens
      best = tune(dev)
      if e.split == "dev":
        result = dev
      else:
        dev_best = best
        out.setdefault("dev_grid", []).extend({"variant": s.name, "mem_size": mem_size, "dev_ppl": s.ppl}
                                              for s in dev.scores)
        result = run(splits.get(e.split), (NONE,) + tuple(b.point for g, b in best.items() if g != "none"),
                     long_term=long_term)
        best = {s.point.group: s for s in result.scores}
    else:
      result = run(splits.get(e.split), points, long_term=long_term)
    out["rows"] += _rows(result, split=e.split, mem_size=mem_size, layout=long_term.layout, best=best, dev_best=dev_best, label=label)
  if external_memory:  # of the last memory size
    out["retrieval_accuracy"] = result.retrieval_accuracy()
    out["search_seconds"], out["seconds"] = result.search_seconds, result.seconds
    if buckets is not None:
      out["buckets"] = {"names": [b[2] for b in knn.FREQ_BUCKETS], "tokens": result.bucket_tokens.tolist(),
                        "ppl": {s.name: np.exp(result.bucket_nll[i]).tolist() for i, s in enumerate(result.scores)}}
    if throughput_tokens:
      tau = next((s.point.tau for s in result.scores if s.point.family == "trime"), 1.0)
      timed = []
      for ext, pt in ((knn_memory, Point("trime", tau=tau)), (None, Point("trime_local", tau=tau))):
        corpus = splits.get(e.split)
        timing = functools.partial(run, corpus, (pt,), long_term=long_term, external=ext, word_buckets_V=None,
                                   progress=False)
        timing(max_tokens=min(throughput_tokens, 1024))  # untimed: neither side's timing includes compilation
        timed.append(timing(max_tokens=throughput_tokens))
      with_ext, without = timed
      a, b = with_ext.tokens / with_ext.seconds, without.tokens / without.seconds
      out["throughput"] = {"tokens": with_ext.tokens, "with_external_tok_s": a, "without_tok_s": b, "ratio": a / b,
                           "search_share": with_ext.search_seconds / with_ext.seconds}
  return out


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
