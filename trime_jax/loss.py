"""The TRIME objective: one softmax over the vocabulary and an in-batch memory.

    P(w | c) ∝ exp(E_w · f(c)) + Σ_{j visible, x_j = w} exp(g(c) · g(c_j) / √d / τ)

The vocabulary side enters only through two numbers per query (see `vocab_stats`): its log-normaliser
log Σ_v exp(E_v · f) and the target's logit. The memory side is a set of keys with next-token targets and a
*visibility rule*: local, long-term and external memory differ only in who may see whom (`TokenMeta` +
`visible`), never in the loss code.

    nll_i = log(Z_vocab_i + Σ_{j vis} e^{s_ij}) - log(e^{logit_i,y_i} + Σ_{j vis, x_j = y_i} e^{s_ij})

Both log-terms always contain a vocabulary term, so a query with no visible memory falls back to the plain
softmax exactly (no additive -10000 masks anywhere). Implementations:

* dense (`memory_nll`, `memory_log_probs`): explicit `[N, M]` masks, for tests and small memories;
  `sharded_memory_log_probs` is the same distribution with the memory sharded over devices (`sharded_loss`);
* blockwise (`memory_log_terms`): scans memory chunks with a running log-sum-exp under a custom VJP that
  recomputes similarities in the backward pass, so no `[N, M]` float array is ever held for the batch. Its
  kernels (`fold_memory`, `memory_grads`) are public: `sharded_loss`'s ring folds each passing block with them.
* `trime_nll` exploits structure: local memory is block-diagonal (one `[L, L]` block per segment) and
  long-term memory is block-diagonal per document run; only external memory spans the whole batch. Its
  default `implementation="auto"` keeps the per-group blocks for autodiff when they fit a 64 MiB budget
  (no recomputation) and switches to the blockwise kernel when they do not.

The objective's options (memory kind, run length, temperature, stop-gradient, implementation, chunking) are one
frozen `ObjectiveSpec`, built from the config once (`ObjectiveSpec.from_config`) and handed to the loss. At test
time the same `TokenMeta` + `visible` decide what a query sees (`evaluate.py`: the window, the long-term store
via `span`, retrieved entries as rows of their own).

Shapes in names: N queries, M memories, D key dim, V vocabulary, B segments, L tokens per segment.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

MEMORY_MODES = ("none", "local", "long", "ext")
# auto: per-group dense blocks with plain autodiff when they fit `block_elems`, else blockwise;
# blockwise: always the chunked custom-VJP kernel; dense: one [BL, BL] mask for the whole batch (tests).
IMPLEMENTATIONS = ("auto", "blockwise", "dense")

# Default budget for one similarity block (queries × memory chunk) in the blockwise path: 2^24 float32
# values = 64 MiB. The chunk length along the memory axis is derived from it and the number of queries.
DEFAULT_BLOCK_ELEMS = 1 << 24


# ----------------------------------------------------------------------------------------------------------
# Vocabulary side: two numbers per query.
# ----------------------------------------------------------------------------------------------------------
class VocabStats(NamedTuple):
  """What the TRIME objective needs from the output layer, per query."""

  log_normalizer: jax.Array  # [...] log Σ_v exp(logit_v)
  target_logit: jax.Array  # [...] logit of the target token (0 where the target is padding)


def accumulation_dtype(*xs):
  """Accumulation dtype: at least float32 (float64 stays float64, bfloat16 is promoted)."""
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def similarity_precision(*xs):
  """Matmul precision of memory similarities (and their gradients): full float32 for float32 keys, since
  the accelerators' default (TF32 on GPUs, one bfloat16 pass on TPUs) rounds similarities that reach the
  tens by ~1e-3 relative, enough to move the loss; bfloat16 keys need nothing (their products are exact in
  the float32 accumulator) and keep the fast default."""
  full = all(jnp.dtype(x.dtype).itemsize >= 4 for x in xs)
  return jax.lax.Precision.HIGHEST if full else jax.lax.Precision.DEFAULT


def _safe_targets(targets):
  return jnp.maximum(targets, 0)


def vocab_stats(token_logits, targets) -> VocabStats:
  """From full logits `[..., V]` and integer targets `[...]` (negative = padding)."""
  logits = token_logits.astype(accumulation_dtype(token_logits))
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, _safe_targets(targets)[..., None], axis=-1)[..., 0]
  return VocabStats(lse, tgt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_logsumexp(chunk, hidden_NxD, weight_VxD, bias_V):
  return _chunked_logsumexp_fwd(chunk, hidden_NxD, weight_VxD, bias_V)[0]


def _vocab_chunks(chunk, weight_VxD, bias_V):
  v = weight_VxD.shape[0]
  n_chunks = -(-v // chunk)
  pad = n_chunks * chunk - v
  w = jnp.pad(weight_VxD, ((0, pad), (0, 0))).reshape(n_chunks, chunk, -1)
  b = jnp.pad(bias_V.astype(accumulation_dtype(weight_VxD, bias_V)), (0, pad)).reshape(n_chunks, chunk)
  real = (jnp.arange(n_chunks * chunk) < v).reshape(n_chunks, chunk)
  return w, b, real


def _chunk_logits(hidden_NxD, w_CxD, b_C, real_C):
  logits = jnp.einsum("nd,cd->nc", hidden_NxD, w_CxD, preferred_element_type=b_C.dtype) + b_C
  return jnp.where(real_C[None, :], logits, -jnp.inf)


def _chunked_logsumexp_fwd(chunk, hidden_NxD, weight_VxD, bias_V):
  w, b, real = _vocab_chunks(chunk, weight_VxD, bias_V)
  n = hidden_NxD.shape[0]

  def body(carry, blk):
    m, s = carry
    logits = _chunk_logits(hidden_NxD, *blk)
    new_m = jnp.maximum(m, logits.max(axis=-1))
    s = s * jnp.exp(m - new_m) + jnp.exp(logits - new_m[:, None]).sum(axis=-1)
    return (new_m, s), None

  acc = b.dtype
  init = (jnp.full((n,), -jnp.inf, acc), jnp.zeros((n,), acc))
  (m, s), _ = jax.lax.scan(body, init, (w, b, real))
  lse = m + jnp.log(s)
  return lse, (hidden_NxD, weight_VxD, bias_V, lse)


def _chunked_logsumexp_bwd(chunk, res, g_N):
  hidden_NxD, weight_VxD, bias_V, lse = res
  w, b, real = _vocab_chunks(chunk, weight_VxD, bias_V)

  def body(dh, blk):
    logits = _chunk_logits(hidden_NxD, *blk)
    p = jnp.exp(logits - lse[:, None]) * g_N[:, None]  # d lse / d logits, scaled by the cotangent
    dh = dh + jnp.einsum("nc,cd->nd", p, blk[0].astype(p.dtype))
    dw = jnp.einsum("nc,nd->cd", p, hidden_NxD.astype(p.dtype))
    return dh, (dw, p.sum(axis=0))

  dh, (dw, db) = jax.lax.scan(body, jnp.zeros(hidden_NxD.shape, b.dtype), (w, b, real))
  v = weight_VxD.shape[0]
  dw = dw.reshape(-1, weight_VxD.shape[1])[:v].astype(weight_VxD.dtype)
  db = db.reshape(-1)[:v].astype(bias_V.dtype)
  return dh.astype(hidden_NxD.dtype), dw, db


_chunked_logsumexp.defvjp(_chunked_logsumexp_fwd, _chunked_logsumexp_bwd)


def chunked_vocab_stats(hidden, weight_VxD, targets, *, bias_V=None, chunk=8192) -> VocabStats:
  """`VocabStats` of logits = hidden · weightᵀ + bias without materialising `[N, V]`.

  hidden `[..., D]`, weight `[V, D]` (the output embedding), targets `[...]`. The log-normaliser is a
  running log-sum-exp over vocabulary chunks; its backward recomputes each chunk's logits, so peak memory is
  `[N, chunk]`, not `[N, V]`.
  """
  lead = hidden.shape[:-1]
  h = hidden.reshape(-1, hidden.shape[-1])
  t = targets.reshape(-1)
  bias = jnp.zeros((weight_VxD.shape[0],), accumulation_dtype(hidden, weight_VxD)) if bias_V is None else bias_V
  chunk = int(min(chunk, weight_VxD.shape[0]))
  lse = _chunked_logsumexp(chunk, h, weight_VxD, bias)
  safe = _safe_targets(t)
  acc = accumulation_dtype(hidden, weight_VxD, bias)
  tgt = jnp.einsum("nd,nd->n", h, weight_VxD[safe], preferred_element_type=acc) + bias[safe].astype(acc)
  return VocabStats(lse.reshape(lead), tgt.reshape(lead))


# ----------------------------------------------------------------------------------------------------------
# Memory side: who may see whom.
# ----------------------------------------------------------------------------------------------------------
class TokenMeta(NamedTuple):
  """Per-token metadata from which visibility is derived (all int32, same shape)."""

  row: jax.Array  # segment (row) index in the global batch
  group: jax.Array  # causal group: the segment (local/ext) or the run of consecutive segments (long)
  order: jax.Array  # order within the group: earlier tokens have smaller values
  target: jax.Array  # next token; < 0 marks padding (never memory, nll 0)
  doc: jax.Array  # document id: causal memory only within the same document (constant unless packed runs)


def visible(query: TokenMeta, memory: TokenMeta, causal, cross_rows: bool, span=None):
  """`[..., N, M]` bool: memory j is visible to query i (queries `[..., N]`, memories `[..., M]`).

  causal (bool scalar or `[..., N]` per query, may be traced): earlier tokens of the same group and document
  are visible (local / long-term memory); a query whose `causal` is False has no such memory (ext memory's
  dropped local memory, drawn per segment). span (optional, test-time long-term store; scalar or `[..., N]`
  per query): only earlier tokens at most `span` before the query's order. cross_rows (static): every token
  of every *other* row is visible (external in-batch memory; at test time, retrieved entries carry row -1).
  Padding memories (target < 0) are never visible.
  """
  causal = jnp.asarray(causal, bool)
  causal = causal[..., None] if causal.ndim else causal
  q = lambda x: x[..., :, None]
  m = lambda x: x[..., None, :]
  same_group = (q(query.group) == m(memory.group)) & (q(query.doc) == m(memory.doc))
  earlier = same_group & (m(memory.order) < q(query.order))
  if span is not None:
    span = jnp.asarray(span)
    earlier = earlier & (m(memory.order) >= q(query.order) - (q(span) if span.ndim else span))
  vis = earlier & causal
  if cross_rows:
    vis = vis | (q(query.row) != m(memory.row))
  return vis & (m(memory.target) >= 0)


def positive(query: TokenMeta, memory: TokenMeta, vis):
  """`[..., N, M]` bool: visible memories whose next token is the query's target (the numerator's terms)."""
  return vis & (memory.target[..., None, :] == query.target[..., :, None])


def batch_meta(targets_BxL, memory: str, consecutive_segments: int = 1, row_offset=0,
               documents_BxL=None, rows_BxL=None) -> TokenMeta:
  """`TokenMeta` `[B, L]` for a batch whose memory is the batch itself (see `trime_nll`).

  `row_offset` is the global row index of row 0 (for shards of a global batch). `documents_BxL` (optional
  int ids): a token's causal memory is restricted to tokens with its own id (packed runs of several
  documents); default: one document. `rows_BxL` (optional int ids, memory local / ext): the segment each token
  belongs to, replacing the layout's row index — several segments packed in one row (`mt.data.pack`), each
  contiguous and in order: "another row" of ext memory is another segment, local memory stays in its own.
  """
  b, l = targets_BxL.shape
  row = jnp.arange(b, dtype=jnp.int32)[:, None] + row_offset
  pos = jnp.arange(l, dtype=jnp.int32)[None, :]
  row = jnp.broadcast_to(row, (b, l))
  if rows_BxL is not None:
    if memory == "long":
      raise ValueError("rows_BxL (packed segments) applies to local / ext memory, not to long-term runs")
    row = jnp.asarray(rows_BxL, jnp.int32)
  pos = jnp.broadcast_to(pos, (b, l))
  if memory == "long":
    if consecutive_segments < 1:
      raise ValueError(f"consecutive_segments must be >= 1, got {consecutive_segments}")
    group = row // consecutive_segments
    order = row * l + pos  # rows of a run are in stream order
  else:
    group, order = row, pos
  doc = jnp.zeros((b, l), jnp.int32) if documents_BxL is None else jnp.asarray(documents_BxL, jnp.int32)
  return TokenMeta(row, group, order, targets_BxL.astype(jnp.int32), doc)


def per_query_causal(memory: str, drop_local, b: int, l: int):
  """`[B, L]` bool: which queries see their causal (local) memory. Only ext memory drops it, per row:
  `drop_local` is a bool scalar (every row) or `[B]` (one draw per segment, as the original draws once per
  forward of one segment per GPU)."""
  if memory != "ext":
    return jnp.ones((b, l), bool)
  drop = jnp.asarray(drop_local, bool)
  if drop.ndim not in (0, 1) or (drop.ndim == 1 and drop.shape[0] != b):
    raise ValueError(f"drop_local must be a bool or a [B={b}] bool array, got shape {drop.shape}")
  return jnp.broadcast_to(jnp.logical_not(drop).reshape(-1, 1) if drop.ndim else jnp.logical_not(drop), (b, l))


# ----------------------------------------------------------------------------------------------------------
# Dense path (explicit masks).
# ----------------------------------------------------------------------------------------------------------
def masked_logsumexp_with(first_N, scores_NxM, mask_NxM):
  """log(exp(first) + Σ_j mask·exp(scores)) over the last axis (any leading shape).

  Exact: masked entries contribute nothing and get zero gradient. `first` may be -inf (then the result is
  the masked log-sum-exp alone, -inf where nothing is visible).
  """
  masked = jnp.where(mask_NxM, scores_NxM, -jnp.inf)
  m = jnp.maximum(first_N, masked.max(axis=-1))
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  total = jnp.exp(first_N - m) + jnp.exp(masked - m[..., None]).sum(axis=-1)
  return m + jnp.log(total)


def _dot(keys_NxD, memory_keys_MxD):
  acc = accumulation_dtype(keys_NxD, memory_keys_MxD)
  return jnp.einsum("nd,md->nm", keys_NxD, memory_keys_MxD, preferred_element_type=acc,
                    precision=similarity_precision(keys_NxD, memory_keys_MxD))


@jax.custom_vjp
def _key_grad_masked_dot(keys_NxD, memory_keys_MxD, key_grad_mask_NxM):
  """q · k `[N, M]` whose gradient reaches memory key j from query i only where key_grad_mask[i, j] (the
  queries' gradient is complete): `memory_grad_group_rows`."""
  return _dot(keys_NxD, memory_keys_MxD)


def _key_grad_masked_dot_fwd(keys_NxD, memory_keys_MxD, key_grad_mask_NxM):
  return _dot(keys_NxD, memory_keys_MxD), (keys_NxD, memory_keys_MxD, key_grad_mask_NxM)


def _key_grad_masked_dot_bwd(res, g_NxM):
  q, k, mask = res
  prec = similarity_precision(q, k)
  dq = jnp.einsum("nm,md->nd", g_NxM, k.astype(g_NxM.dtype), precision=prec)
  dk = jnp.einsum("nm,nd->md", jnp.where(mask, g_NxM, 0.0), q.astype(g_NxM.dtype), precision=prec)
  return dq.astype(q.dtype), dk.astype(k.dtype), None


_key_grad_masked_dot.defvjp(_key_grad_masked_dot_fwd, _key_grad_masked_dot_bwd)


def _similarities(keys_NxD, memory_keys_MxD, scale, key_grad_mask=None):
  """q · k · scale `[N, M]`; key_grad_mask `[N, M]` (optional): memory key j gets gradient from query i only
  where it is True (the value is unchanged)."""
  if key_grad_mask is None:
    return _dot(keys_NxD, memory_keys_MxD) * scale
  return _key_grad_masked_dot(keys_NxD, memory_keys_MxD, key_grad_mask) * scale


def same_grad_group(query_row, memory_row, group_rows: int):
  """`[..., N, M]` bool: query and memory rows lie in the same group of `group_rows` consecutive rows of the
  global batch (one original GPU's segments: `ObjectiveSpec.memory_grad_group_rows`). Padding memories (row
  -1) are in no query's group."""
  q = query_row[..., :, None] // group_rows
  m = memory_row[..., None, :]
  return (m >= 0) & (q == m // group_rows)


def _scale(d: int, temperature):
  return 1.0 / (math.sqrt(d) * temperature)


def similarity_scale(d: int, temperature, dtype):
  """1 / (√d · τ) in `dtype` (τ may be traced): the factor on q·k of the blockwise paths."""
  return jnp.asarray(_scale(d, 1.0), dtype) / jnp.asarray(temperature, dtype)


def _dense_nll(stats: VocabStats, keys, targets, memory_keys, memory_targets, memory_mask, scale,
               key_grad_mask=None):
  mask = memory_mask & (memory_targets[None, :] >= 0)
  sim = _similarities(keys, memory_keys, scale, key_grad_mask)
  positive = mask & (memory_targets[None, :] == targets[:, None])
  log_z = masked_logsumexp_with(stats.log_normalizer, sim, mask)
  log_p = masked_logsumexp_with(stats.target_logit, sim, positive)
  return jnp.where(targets >= 0, log_z - log_p, 0.0)


def topk_dense_nll(stats: VocabStats, keys, targets, memory_keys, memory_targets, memory_mask, scale, k: int,
                   key_grad_mask=None):
  """`_dense_nll` where each query's softmax keeps only its k most similar visible memories (numerator and
  normaliser alike): the original TrimeMT criterion's `--topk-mem` (trime_mt_loss.py, top-k before the label
  match). Gradients reach the selected memories only (and, with key_grad_mask, only where it is True)."""
  mask = memory_mask & (memory_targets[None, :] >= 0)
  sim = jnp.where(mask, _similarities(keys, memory_keys, scale, key_grad_mask), -jnp.inf)
  top_sim, idx = jax.lax.top_k(sim, min(k, sim.shape[-1]))
  top_mask = jnp.isfinite(top_sim)  # fewer than k visible: the rest stay out
  positive = top_mask & (memory_targets[idx] == targets[:, None])
  log_z = masked_logsumexp_with(stats.log_normalizer, top_sim, top_mask)
  log_p = masked_logsumexp_with(stats.target_logit, top_sim, positive)
  return jnp.where(targets >= 0, log_z - log_p, 0.0)


def memory_nll_from_vocab_stats(
    stats: VocabStats, keys, targets, memory_keys, memory_targets, memory_mask, *, temperature=1.0
):
  """`memory_nll` with the vocabulary side given as `VocabStats` `[N]` (dense mask `[N, M]`)."""
  scale = _scale(keys.shape[-1], temperature)
  return _dense_nll(stats, keys, targets, memory_keys, memory_targets, memory_mask, scale)


def memory_nll(token_logits, keys, targets, memory_keys, memory_targets, memory_mask, *, temperature=1.0):
  """Negative log-likelihood `[N]` of `targets` under the memory-augmented softmax (dense mask).

  token_logits `[N, V]`, keys `[N, D]`, targets `[N]` int, memory_keys `[M, D]`, memory_targets `[M]` int,
  memory_mask `[N, M]` bool (True: memory j is visible to query i). Memories with a negative target are
  ignored; queries with a negative target get nll 0.
  """
  stats = vocab_stats(token_logits, targets)
  return memory_nll_from_vocab_stats(
      stats, keys, targets, memory_keys, memory_targets, memory_mask, temperature=temperature
  )


@jax.jit
def _memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask, scale):
  n, v = token_logits.shape
  logits = token_logits.astype(accumulation_dtype(token_logits, keys))
  mask = memory_mask & (memory_targets[None, :] >= 0)
  sim_MxN = jnp.where(mask, _similarities(keys, memory_keys, scale), -jnp.inf).T
  buckets = jnp.maximum(memory_targets, 0)
  # Segment-sum scatter of exp(sim) into vocabulary buckets, in log space: a per-bucket max first, so a
  # bucket's mass survives even when it is far below the row's largest logit.
  bmax_VxN = jax.ops.segment_max(sim_MxN, buckets, num_segments=v)
  bmax_VxN = jax.lax.stop_gradient(jnp.where(jnp.isfinite(bmax_VxN), bmax_VxN, 0.0))
  bsum_VxN = jax.ops.segment_sum(jnp.exp(sim_MxN - bmax_VxN[buckets]), buckets, num_segments=v)
  log_total_NxV = jnp.logaddexp(logits, (bmax_VxN + jnp.log(bsum_VxN)).T)
  return log_total_NxV - jax.nn.logsumexp(log_total_NxV, axis=-1, keepdims=True)


def memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask, *, temperature=1.0):
  """The full memory-augmented distribution `[N, V]` (log-probabilities; rows sum to 1).

  exp(sim) of every visible memory is scattered into its target's vocabulary bucket with a jit-compiled
  segment sum and added to exp(logits) before normalising.
  """
  scale = jnp.asarray(_scale(keys.shape[-1], temperature), accumulation_dtype(keys))
  return _memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask, scale)


def sharded_memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask=None, *, mesh,
                             temperature=1.0, **options):
  """`memory_log_probs` with the memory sharded over the `data` axis of `mesh` (memory_mask may be None: all
  visible). Implemented in `sharded_loss.sharded_memory_log_probs` (see there for `axis`, `memory_chunk`)."""
  from trime_jax import sharded_loss  # imported here: sharded_loss imports this module

  return sharded_loss.sharded_memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask,
                                               mesh=mesh, temperature=temperature, **options)


# ----------------------------------------------------------------------------------------------------------
# Blockwise path: running log-sum-exp over memory chunks, custom VJP that recomputes similarities. The kernels
# (`fold_memory`, `memory_grads`) are public: the ring of `sharded_loss` folds each passing block with them.
# ----------------------------------------------------------------------------------------------------------
def chunk_memory(chunk, keys_MxD, meta: TokenMeta):
  """Keys `[n_chunks, chunk, D]` and metadata `[n_chunks, chunk]` (padding: target -1, never visible)."""
  m = keys_MxD.shape[0]
  n_chunks = -(-m // chunk)
  pad = n_chunks * chunk - m
  keys = jnp.pad(keys_MxD, ((0, pad), (0, 0))).reshape(n_chunks, chunk, -1)
  padded = TokenMeta(*(jnp.pad(x, (0, pad), constant_values=-1).reshape(n_chunks, chunk) for x in meta))
  return keys, padded


def block_terms(q_NxD, k_CxD, qmeta, kmeta, causal, scale, cross_rows):
  """(similarities `[N, C]` at `scale`, visible, positive) of queries against one memory chunk."""
  s = jnp.einsum("nd,cd->nc", q_NxD, k_CxD, preferred_element_type=scale.dtype,
                 precision=similarity_precision(q_NxD, k_CxD)) * scale
  vis = visible(qmeta, kmeta, causal, cross_rows)
  return s, vis, positive(qmeta, kmeta, vis)


def start_log_terms(stats: VocabStats, dtype):
  """Running (max, sum) of log Z and log P before any memory: the vocabulary terms alone."""
  lse, tgt = stats.log_normalizer.astype(dtype), stats.target_logit.astype(dtype)
  one = jnp.ones_like(lse)
  return lse, one, tgt, one


def finish_log_terms(state):
  """(log Z, log P) `[N]` from the running (max, sum) pairs."""
  mz, sz, mp, sp = state
  return mz + jnp.log(sz), mp + jnp.log(sp)


def fold_memory(chunk, q_NxD, qmeta, causal, scale, cross_rows, state, k_MxD, kmeta):
  """Add a memory `[M, D]` to the running (max, sum) of log Z and log P, chunk by chunk."""
  kc, mc = chunk_memory(chunk, k_MxD, kmeta)

  def body(carry, blk):
    mz, sz, mp, sp = carry
    s, vis, pos = block_terms(q_NxD, blk[0], qmeta, blk[1], causal, scale, cross_rows)
    sz_masked = jnp.where(vis, s, -jnp.inf)
    sp_masked = jnp.where(pos, s, -jnp.inf)
    new_mz = jnp.maximum(mz, sz_masked.max(axis=-1))
    new_mp = jnp.maximum(mp, sp_masked.max(axis=-1))
    sz = sz * jnp.exp(mz - new_mz) + jnp.exp(sz_masked - new_mz[:, None]).sum(axis=-1)
    sp = sp * jnp.exp(mp - new_mp) + jnp.exp(sp_masked - new_mp[:, None]).sum(axis=-1)
    return (new_mz, sz, new_mp, sp), None

  return jax.lax.scan(body, state, (kc, mc))[0]


def memory_grads(chunk, q_NxD, qmeta, causal, scale, cross_rows, log_z, log_p, g_z, g_p, with_dk, k_MxD, kmeta,
                 grad_group_rows: int = 0):
  """(dq `[N, D]`, dk `[M, D]` or None) of a memory's part of (log Z, log P) under cotangents (g_z, g_p),
  similarities recomputed chunk by chunk. grad_group_rows > 0: a key's gradient comes only from queries whose
  `row` lies in its group of that many consecutive rows (`same_grad_group`); dq is complete either way."""
  kc, mc = chunk_memory(chunk, k_MxD, kmeta)
  acc = scale.dtype
  q32 = q_NxD.astype(acc)
  prec = similarity_precision(q_NxD, k_MxD)

  def body(dq, blk):
    s, vis, pos = block_terms(q_NxD, blk[0], qmeta, blk[1], causal, scale, cross_rows)
    # d logZ_i / d s_ij = vis·softmax weight; d logP_i / d s_ij = pos·weight within the positives.
    g = g_z[:, None] * jnp.exp(jnp.where(vis, s - log_z[:, None], -jnp.inf))
    g = g + g_p[:, None] * jnp.exp(jnp.where(pos, s - log_p[:, None], -jnp.inf))
    g = g * scale
    dq = dq + jnp.einsum("nc,cd->nd", g, blk[0].astype(acc), precision=prec)
    if not with_dk:
      return dq, None
    if grad_group_rows > 0:
      g = jnp.where(same_grad_group(qmeta.row, blk[1].row, grad_group_rows), g, 0.0)
    return dq, jnp.einsum("nc,nd->cd", g, q32, precision=prec)

  dq, dk = jax.lax.scan(body, jnp.zeros(q_NxD.shape, acc), (kc, mc))
  return dq, (dk.reshape(-1, k_MxD.shape[-1])[: k_MxD.shape[0]] if with_dk else None)


def vocab_stats_grads(stats: VocabStats, log_z, log_p, g_z, g_p) -> VocabStats:
  """Cotangents of the vocabulary terms: each is one term of log Z (log P)."""
  return VocabStats(
      (g_z * jnp.exp(stats.log_normalizer - log_z)).astype(stats.log_normalizer.dtype),
      (g_p * jnp.exp(stats.target_logit - log_p)).astype(stats.target_logit.dtype),
  )


def memory_log_terms(cross_rows, chunk, q_NxD, k_MxD, qmeta, kmeta, causal, scale, stats: VocabStats,
                     grad_group_rows: int = 0):
  """(log Z, log P) `[N]` for queries against a memory, blockwise.

  log Z = log(exp(log_normalizer) + Σ_{j vis} e^{s_ij}), log P = log(exp(target_logit) + Σ_{j vis, pos} e^{s_ij}),
  s_ij = q_i · k_j · scale. Differentiable in q, k and `stats`; never holds more than `[N, chunk]` floats.
  grad_group_rows > 0 (static): key j gets gradient only from queries of its row group (`memory_grads`).
  """
  return _memory_log_terms(cross_rows, chunk, int(grad_group_rows), q_NxD, k_MxD, qmeta, kmeta, causal, scale,
                           stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _memory_log_terms(cross_rows, chunk, grad_group_rows, q_NxD, k_MxD, qmeta, kmeta, causal, scale, stats):
  return _memory_log_terms_fwd(cross_rows, chunk, grad_group_rows, q_NxD, k_MxD, qmeta, kmeta, causal, scale,
                               stats)[0]


def _memory_log_terms_fwd(cross_rows, chunk, grad_group_rows, q_NxD, k_MxD, qmeta, kmeta, causal, scale, stats):
  state = fold_memory(chunk, q_NxD, qmeta, causal, scale, cross_rows, start_log_terms(stats, scale.dtype), k_MxD,
                      kmeta)
  log_z, log_p = finish_log_terms(state)
  return (log_z, log_p), (q_NxD, k_MxD, qmeta, kmeta, causal, scale, stats, log_z, log_p)


def _memory_log_terms_bwd(cross_rows, chunk, grad_group_rows, res, cotangents):
  q_NxD, k_MxD, qmeta, kmeta, causal, scale, stats, log_z, log_p = res
  g_z, g_p = cotangents
  dq, dk = memory_grads(chunk, q_NxD, qmeta, causal, scale, cross_rows, log_z, log_p, g_z, g_p, True, k_MxD, kmeta,
                        grad_group_rows)
  d_stats = vocab_stats_grads(stats, log_z, log_p, g_z, g_p)
  return dq.astype(q_NxD.dtype), dk.astype(k_MxD.dtype), None, None, None, None, d_stats


_memory_log_terms.defvjp(_memory_log_terms_fwd, _memory_log_terms_bwd)


def chunk_len(n_queries: int, n_memory: int, block_elems: int = DEFAULT_BLOCK_ELEMS) -> int:
  """Memory-chunk length so that one `[n_queries, chunk]` block holds about `block_elems` floats."""
  c = max(128, block_elems // max(n_queries, 1))
  return int(min(c, n_memory))


# ----------------------------------------------------------------------------------------------------------
# The batch as its own memory.
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
  """The objective's options, stated once (hashable: part of a jit cache key). `trime_nll`,
  `trime_nll_from_vocab_stats` and `sharded_loss` take one, or its fields as keywords."""

  memory: str  # none | local | long | ext (see `trime_nll`)
  consecutive_segments: int = 1  # memory="long": rows per document run
  temperature: float = 1.0  # τ on memory logits (may be a traced scalar where the spec is not static)
  stop_gradient_memory: bool = False  # no gradient into memory keys
  implementation: str = "auto"  # auto | blockwise | dense (see IMPLEMENTATIONS)
  block_elems: int = DEFAULT_BLOCK_ELEMS  # budget of one similarity block (blockwise path)
  memory_chunk: int | None = None  # memory chunk length of the blockwise path (None: from block_elems)
  memory_topk: int = 0  # > 0: only the k most similar visible memories per query (the original MT's --topk-mem;
  # one dense [N, N] block, so for batches of sentence pairs)
  memory_grad_group_rows: int = 0  # > 0: a memory key gets gradient only from queries whose batch row lies in
  # its group of this many consecutive rows of the global batch (one original GPU's segments: its all_gather
  # detaches other GPUs' keys); values unchanged. 0: no cut. No effect on local memory (within a row)

  def __post_init__(self):
    if self.memory not in MEMORY_MODES:
      raise ValueError(f"memory must be one of {MEMORY_MODES}, got {self.memory!r}")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}")
    if self.memory == "long" and self.consecutive_segments < 1:
      raise ValueError(f"consecutive_segments must be >= 1, got {self.consecutive_segments}")
    if self.memory_topk < 0:
      raise ValueError(f"memory_topk must be >= 0, got {self.memory_topk}")
    if self.memory_grad_group_rows < 0:
      raise ValueError(f"memory_grad_group_rows must be >= 0, got {self.memory_grad_group_rows}")

  @property
  def key_grad_group_rows(self) -> int:
    """The row-group cut that acts: 0 where it cannot matter (no memory across rows, or no key gradient)."""
    if self.memory not in ("long", "ext") or self.stop_gradient_memory:
      return 0
    return self.memory_grad_group_rows

  @classmethod
  def from_config(cls, config) -> "ObjectiveSpec":
    """From the `trime` section (memory_chunk 0 = derived from the block budget)."""
    t = config.trime
    return cls(memory=t.memory, consecutive_segments=int(t.consecutive_segments), temperature=float(t.temperature),
               stop_gradient_memory=bool(t.stop_gradient_memory), memory_chunk=int(t.memory_chunk) or None,
               memory_topk=int(t.get("memory_topk", 0)),
               memory_grad_group_rows=int(t.get("memory_grad_group_rows", 0)))


def objective_spec(spec: ObjectiveSpec | None, options: dict) -> ObjectiveSpec:
  """`spec`, or one made of keyword `options` (ObjectiveSpec fields); not both."""
  if spec is None:
    return ObjectiveSpec(**options)
  if options:
    raise ValueError(f"give an ObjectiveSpec or its fields as keywords, not both (got {sorted(options)})")
  return spec


def check_batch_memory(spec: ObjectiveSpec, keys, targets):
  if spec.memory == "long" and keys.shape[0] % spec.consecutive_segments:
    raise ValueError(
        f"memory='long': batch of {keys.shape[0]} rows is not a whole number of document runs of "
        f"consecutive_segments={spec.consecutive_segments}"
    )
  if keys.shape[:2] != targets.shape:
    raise ValueError(f"keys {keys.shape} and targets {targets.shape} disagree on [B, L]")


def _groups(memory: str, b: int, consecutive_segments: int) -> int:
  """How many independent visibility groups the batch splits into (the structure the fast path exploits)."""
  return {"local": b, "long": b // consecutive_segments, "ext": 1}[memory]


def trime_nll_from_vocab_stats(stats: VocabStats, keys, targets, spec: ObjectiveSpec | None = None, *,
                               drop_local=False, documents=None, rows=None, row_offset=0, **options):
  """`trime_nll` with the vocabulary side given as `VocabStats` `[B, L]` (the training path).

  `drop_local` may be traced (the drop decisions need no recompilation). The blockwise path scans memory
  chunks of `spec.memory_chunk` tokens (default: derived from `spec.block_elems`). `rows` `[B, L]`: packed
  segments' ids (`batch_meta`'s rows_BxL); drop_local must then be a scalar (it is drawn per layout row).
  `row_offset` (may be traced): global row index of row 0, for a shard of a global batch (it places the rows
  in `spec.memory_grad_group_rows`'s groups).
  """
  spec = objective_spec(spec, options)
  keys, targets = jnp.asarray(keys), jnp.asarray(targets)
  stats = VocabStats(*map(jnp.asarray, stats))
  check_batch_memory(spec, keys, targets)
  memory, consecutive_segments = spec.memory, spec.consecutive_segments
  valid = targets >= 0
  if memory == "none":
    return jnp.where(valid, stats.log_normalizer - stats.target_logit, 0.0)

  b, l, d = keys.shape
  if documents is not None and memory != "long":
    raise ValueError(f"documents restrict long-term memory (packed runs); memory={memory!r} takes none")
  if rows is not None and jnp.ndim(drop_local):
    raise ValueError("packed rows take a scalar drop_local (per-row draws would split packed segments alike)")
  cut = spec.key_grad_group_rows
  if cut and rows is not None:
    raise ValueError("memory_grad_group_rows groups layout rows; packed segments (rows=) are not supported")
  meta = batch_meta(targets, memory, consecutive_segments, row_offset=row_offset, documents_BxL=documents,
                    rows_BxL=rows)
  causal = per_query_causal(memory, drop_local, b, l)
  cross_rows = memory == "ext"
  acc = accumulation_dtype(keys, stats.log_normalizer)
  scale = similarity_scale(d, spec.temperature, acc)
  mem_keys = jax.lax.stop_gradient(keys) if spec.stop_gradient_memory else keys

  if spec.implementation == "dense" or spec.memory_topk:
    flat = TokenMeta(*(x.reshape(-1) for x in meta))
    mask = visible(flat, flat, causal.reshape(-1), cross_rows)
    flat_stats = VocabStats(*(x.reshape(-1) for x in stats))
    args = (flat_stats, keys.reshape(b * l, d), flat.target, mem_keys.reshape(b * l, d), flat.target, mask, scale)
    kg = same_grad_group(flat.row, flat.row, cut) if cut else None
    nll = topk_dense_nll(*args, spec.memory_topk, kg) if spec.memory_topk else _dense_nll(*args, kg)
    return nll.reshape(b, l)

  g = _groups(memory, b, consecutive_segments)
  n = b * l // g  # tokens per group: queries and memories of one group are the same tokens

  def grouped(x):
    return x.reshape((g, n) + x.shape[2:])

  gmeta = TokenMeta(*(grouped(x) for x in meta))
  gstats = VocabStats(grouped(stats.log_normalizer), grouped(stats.target_logit))
  if spec.implementation == "auto" and spec.memory_chunk is None and g * n * n <= spec.block_elems:
    # The per-group [n, n] blocks fit the budget: plain autodiff keeps them for the backward instead of
    # recomputing them (cheaper when memory is no concern, e.g. local memory of short segments).
    mask = jax.vmap(visible, in_axes=(0, 0, 0, None))(gmeta, gmeta, grouped(causal), cross_rows)
    kg = jax.vmap(lambda r: same_grad_group(r, r, cut))(gmeta.row) if cut else None
    nll = jax.vmap(_dense_nll, in_axes=(0, 0, 0, 0, 0, 0, None, 0 if cut else None))(
        gstats, grouped(keys), gmeta.target, grouped(mem_keys), gmeta.target, mask, scale, kg)
    return nll.reshape(b, l)
  chunk = spec.memory_chunk or chunk_len(g * n, n, spec.block_elems)
  terms = jax.vmap(
      functools.partial(memory_log_terms, cross_rows, chunk, grad_group_rows=cut), in_axes=(0, 0, 0, 0, 0, None, 0)
  )
  log_z, log_p = terms(grouped(keys), grouped(mem_keys), gmeta, gmeta, grouped(causal), scale, gstats)
  return jnp.where(valid, (log_z - log_p).reshape(b, l), 0.0)


def trime_nll(token_logits, keys, targets, spec: ObjectiveSpec | None = None, *, drop_local=False, documents=None,
              **options):
  """TRIME negative log-likelihood `[B, L]`; the memory is the batch itself.

  token_logits `[B, L, V]`, keys `[B, L, D]`, targets `[B, L]` (negative = padding: never memory, nll 0).
  `spec` (or its fields as keywords: `trime_nll(..., memory="local", temperature=0.5)`):
    memory="none":  plain cross-entropy
    memory="local": token t of segment b sees tokens j < t of segment b
    memory="long":  rows come in runs of `consecutive_segments` consecutive segments of the stream; a token
                    sees every earlier token of its run (`documents` [B, L]: only those of its own document)
    memory="ext":   a token sees every token of every other row, plus j < t of its own row unless its row
                    drops local memory (`drop_local`: a bool for every row, or [B] per row)
  Gradients reach every memory key unless `stop_gradient_memory`; with `memory_grad_group_rows` = G > 0 a key
  gets gradient only from queries of rows in its group of G consecutive rows (values unchanged). `implementation`: "auto" (per-group dense
  blocks when they fit `block_elems`, else blockwise), "blockwise" (always the chunked custom-VJP kernel),
  "dense" (one full `[BL, BL]` mask; tests, small batches).
  """
  return trime_nll_from_vocab_stats(vocab_stats(token_logits, targets), keys, targets,
                                    objective_spec(spec, options), drop_local=drop_local, documents=documents)
