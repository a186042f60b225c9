"""The memory-augmented distribution: every path that scores a token against memories calls this module.

    P(w | c) ∝ exp(E_w · f(c)) + Σ_{j visible, x_j = w} exp(g(c) · g(c_j) / √d / τ)

Training (`loss`, `sharded_loss`), evaluation (`evaluate`), generation (`generate`), the exact on-device
datastore (`exact_memory`) and translation (`mt.decode`) differ only in where the memories come from and who
sees whom; the pieces of the equation are here, once:

  pieces        `VocabStats` (the vocabulary side: two numbers per query; `vocab_stats` from full logits,
                `chunked_vocab_stats` a running log-sum-exp over vocabulary chunks with a recomputing VJP, no
                `[N, V]`), `similarities` (q·k·scale, with an optional cut of the memory keys' gradient),
                `masked_logsumexp_with`, `TokenMeta` + `visible` / `positive` (who sees whom: local, long-term
                and external memory differ only here)
  log terms     (log Z, log P) per query: the TRIME nll is log Z - log P. Three implementations of one
                quantity: dense (`log_terms` over explicit masks; `dense_nll`, `topk_dense_nll`), blockwise
                (`memory_log_terms`: a running log-sum-exp over memory chunks under a custom VJP that
                recomputes similarities; its kernels `fold_memory` / `memory_grads` are public so that
                `sharded_loss`'s ring folds each passing block with them) and sharded (`sharded_loss`)
  per target    test time scores one target per query from `MemoryBlock`s (similarities + masks per memory
                source): `trime_log_prob` (TRIME at τ), `log_p_mem` (p_mem at θ: the continuous cache, kNN-LM,
                Appendix A's P′) and `mix` ((1-λ)·p + λ·p_mem, the model where a query has no memory); over a
                memory sharded over devices, the two sums every family reads at its scale:
                `sharded_scaled_log_sums` (the on-device datastore)
  distribution  the full `[N, V]` law: `memory_log_probs` (a segment sum of exp(sim) into vocabulary buckets;
                dense, or with the memory sharded over a mesh axis: `sharded_memory_log_probs`) and
                `trime_log_probs` (+ Appendix A's interpolation, for generation and translation); the parts
                of one token's probability, per memory: `log_contributions` (generation's retrieval trace)

Exact everywhere: masked entries are excluded from sums (no additive -10000), and both log terms always hold a
vocabulary term, so a query with no visible memory gets the plain softmax bit for bit. This module imports
nothing of the package but the name of the mesh axis (`sharding.DATA`).

Shapes in names: N queries, M memories, D key dim, V vocabulary, S streams, Q queries per stream, C chunk.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from trime_jax.sharding import DATA

# Default budget for one similarity block (queries × memory chunk) in the blockwise path: 2^24 float32
# values = 64 MiB. The chunk length along the memory axis is derived from it and the number of queries.
DEFAULT_BLOCK_ELEMS = 1 << 24


# ----------------------------------------------------------------------------------------------------------
# Pieces: the vocabulary side, dtypes, who sees whom, similarities.
# ----------------------------------------------------------------------------------------------------------
class VocabStats(NamedTuple):
  """What the TRIME objective needs from the output layer, per query."""

  log_normalizer: jax.Array  # [...] log Σ_v exp(logit_v)
  target_logit: jax.Array  # [...] logit of the target token (0 where the target is padding)


def accumulation_dtype(*xs):
  """Accumulation dtype: at least float32 (float64 stays float64, bfloat16 is promoted)."""
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def similarity_precision(*xs):
  """Matmul precision of memory similarities (and their gradients): full float32 when an operand is float32,
  since the accelerators' default (TF32 on GPUs, one bfloat16 pass on TPUs) rounds it (similarities that reach
  the tens move by ~1e-3 relative, enough to move the loss; float32 queries against a float16 datastore too:
  the keys are exact in TF32, the queries are not); bfloat16 / float16 operands alone need nothing (their
  products are exact in the float32 accumulator) and keep the fast default."""
  full = any(jnp.dtype(x.dtype).itemsize >= 4 for x in xs)
  return jax.lax.Precision.HIGHEST if full else jax.lax.Precision.DEFAULT


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



def masked_logsumexp_with(first_N, scores_NxM, mask_NxM):
  """log(exp(first) + Σ_j mask·exp(scores)) over the last axis (any leading shape).

  Exact: masked entries contribute nothing and get zero gradient. `first` may be -inf (then the result is
  the masked log-sum-exp alone, -inf where nothing is visible).
  """
  masked = jnp.where(mask_NxM, scores_NxM, -jnp.inf)
  m = jnp.maximum(first_N, masked.max(axis=-1, initial=-jnp.inf))  # initial: M = 0 memories is no memory
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


def similarities(keys_NxD, memory_keys_MxD, scale, key_grad_mask=None):
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


def check_tau(tau):
  """ValueError unless τ > 0 and finite, where τ is concrete (a traced τ is its caller's to keep positive): τ ≤ 0
  gives finite but meaningless similarities, or inf / a division by zero, never an error."""
  if isinstance(tau, jax.core.Tracer):
    return
  if isinstance(tau, (bool, np.bool_, str, bytes)):  # True read as 1.0, "1.0" parsed: neither is a τ
    raise ValueError(f"tau must be a positive finite number, got {tau!r}")
  try:
    t = np.asarray(tau, np.float64)  # a number, a NumPy or JAX scalar; an array of several is refused below
  except (TypeError, ValueError):
    raise ValueError(f"tau must be a positive finite number, got {tau!r}") from None
  if t.ndim:  # [0.] or [-1.] would broadcast into every similarity unchecked (inf / NaN / a negative τ)
    raise ValueError(f"tau must be one number, got an array of shape {t.shape}: {tau!r}")
  if not (t > 0 and math.isfinite(t)):
    raise ValueError(f"tau must be a positive finite number, got {tau!r}")


def check_targets(targets, v: int, what: str = "targets"):
  """ValueError unless every target is < V (negative = padding), where the targets are concrete (a traced
  batch is not checked: the check would sync with the device). An id ≥ V would otherwise be read out of range
  (NaN, or clamped to the last word), silently."""
  if (isinstance(targets, jax.core.Tracer) or np.size(targets) == 0
      or (isinstance(targets, jax.Array) and not targets.is_fully_addressable)):  # other hosts' rows: not here
    return
  top = int(np.max(np.asarray(targets)))  # NumPy: a jnp reduction would be traced under an enclosing jit
  if top >= v:
    raise ValueError(f"{what} must lie in [0, {v}) (negative: padding), got {top}")


def static_scale(d: int, tau):
  """1 / (√d · τ) as a Python float (τ a Python number > 0): the factor on q·k of the dense paths."""
  check_tau(tau)
  return 1.0 / (math.sqrt(d) * tau)


def similarity_scale(d: int, tau, dtype):
  """1 / (√d · τ) in `dtype` (τ may be traced): the factor on q·k of the blockwise paths."""
  check_tau(tau)  # (a traced τ is not checked)
  return jnp.asarray(static_scale(d, 1.0), dtype) / jnp.asarray(tau, dtype)


def log_terms(log_normalizer, target_logit, terms):
  """(log Z, log P) `[...]` with memories: log Z = log(exp(log_normalizer) + Σ_{visible} exp(score)), log P =
  log(exp(target_logit) + Σ_{positive} exp(score)), one `(scores [..., M], visible, positive)` per memory
  source, folded in the order given. The dense implementation (the blockwise one: `memory_log_terms`)."""
  z, p = log_normalizer, target_logit
  for scores, vis, pos in terms:
    z, p = masked_logsumexp_with(z, scores, vis), masked_logsumexp_with(p, scores, pos)
  return z, p


def dense_nll(stats: VocabStats, keys, targets, memory_keys, memory_targets, memory_mask, scale,
              key_grad_mask=None):
  """nll `[N]` of queries against memories under an explicit mask `[N, M]` (padding memories never count;
  padding queries get 0). key_grad_mask `[N, M]` (optional): see `similarities`."""
  mask = memory_mask & (memory_targets[None, :] >= 0)
  sim = similarities(keys, memory_keys, scale, key_grad_mask)
  positive = mask & (memory_targets[None, :] == targets[:, None])
  log_z, log_p = log_terms(stats.log_normalizer, stats.target_logit, [(sim, mask, positive)])
  return jnp.where(targets >= 0, log_z - log_p, 0.0)


def topk_dense_nll(stats: VocabStats, keys, targets, memory_keys, memory_targets, memory_mask, scale, k: int,
                   key_grad_mask=None):
  """`dense_nll` where each query's softmax keeps only its k most similar visible memories (numerator and
  normaliser alike): the original TrimeMT criterion's `--topk-mem` (trime_mt_loss.py, top-k before the label
  match). Gradients reach the selected memories only (and, with key_grad_mask, only where it is True)."""
  mask = memory_mask & (memory_targets[None, :] >= 0)
  sim = jnp.where(mask, similarities(keys, memory_keys, scale, key_grad_mask), -jnp.inf)
  top_sim, idx = jax.lax.top_k(sim, min(k, sim.shape[-1]))
  top_mask = jnp.isfinite(top_sim)  # fewer than k visible: the rest stay out
  positive = top_mask & (memory_targets[idx] == targets[:, None])
  log_z, log_p = log_terms(stats.log_normalizer, stats.target_logit, [(top_sim, top_mask, positive)])
  return jnp.where(targets >= 0, log_z - log_p, 0.0)


# ----------------------------------------------------------------------------------------------------------
# The vocabulary side: two numbers per query (`VocabStats`), from full logits or from chunks of the output layer.
# ----------------------------------------------------------------------------------------------------------
def _safe_targets(targets):
  return jnp.maximum(targets, 0)


def vocab_stats(token_logits, targets) -> VocabStats:
  """From full logits `[..., V]` and integer targets `[...]` in [0, V) (negative = padding; ≥ V: ValueError
  where concrete)."""
  check_targets(targets, token_logits.shape[-1])
  if token_logits.shape[:-1] != jnp.shape(targets):
    raise ValueError(f"logits {token_logits.shape} and targets {jnp.shape(targets)} disagree on the leading axes")
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
  `[N, chunk]`, not `[N, V]`. Targets in [0, V) (negative = padding; ≥ V: ValueError where concrete).
  """
  check_targets(targets, weight_VxD.shape[0])
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
# Blockwise log terms: running log-sum-exp over memory chunks, custom VJP that recomputes similarities. The
# kernels (`fold_memory`, `memory_grads`) are public: the ring of `sharded_loss` folds each passing block.
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
  """(dq `[N, D]`, dk `[M, D]` or None, d scale `[]`) of a memory's part of (log Z, log P) under cotangents
  (g_z, g_p), similarities recomputed chunk by chunk. grad_group_rows > 0: a key's gradient comes only from
  queries whose `row` lies in its group of that many consecutive rows (`same_grad_group`); dq is complete either
  way. d scale: so that a learned (traced) τ gets its gradient on this path as on the dense one."""
  kc, mc = chunk_memory(chunk, k_MxD, kmeta)
  acc = scale.dtype
  q32 = q_NxD.astype(acc)
  prec = similarity_precision(q_NxD, k_MxD)

  def body(carry, blk):
    dq, d_scale = carry
    s, vis, pos = block_terms(q_NxD, blk[0], qmeta, blk[1], causal, scale, cross_rows)
    # d logZ_i / d s_ij = vis·softmax weight; d logP_i / d s_ij = pos·weight within the positives.
    g = g_z[:, None] * jnp.exp(jnp.where(vis, s - log_z[:, None], -jnp.inf))
    g = g + g_p[:, None] * jnp.exp(jnp.where(pos, s - log_p[:, None], -jnp.inf))
    d_scale = d_scale + jnp.sum(g * s)  # s_ij = scale·(q_i·k_j): d/d scale = Σ g_ij s_ij / scale (below)
    g = g * scale
    dq = dq + jnp.einsum("nc,cd->nd", g, blk[0].astype(acc), precision=prec)
    if not with_dk:
      return (dq, d_scale), None
    if grad_group_rows > 0:
      g = jnp.where(same_grad_group(qmeta.row, blk[1].row, grad_group_rows), g, 0.0)
    return (dq, d_scale), jnp.einsum("nc,nd->cd", g, q32, precision=prec)

  (dq, d_scale), dk = jax.lax.scan(body, (jnp.zeros(q_NxD.shape, acc), jnp.zeros((), acc)), (kc, mc))
  return (dq, (dk.reshape(-1, k_MxD.shape[-1])[: k_MxD.shape[0]] if with_dk else None),
          (d_scale / scale).astype(scale.dtype))


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
  dq, dk, d_scale = memory_grads(chunk, q_NxD, qmeta, causal, scale, cross_rows, log_z, log_p, g_z, g_p, True,
                                 k_MxD, kmeta, grad_group_rows)
  d_stats = vocab_stats_grads(stats, log_z, log_p, g_z, g_p)
  return dq.astype(q_NxD.dtype), dk.astype(k_MxD.dtype), None, None, None, d_scale, d_stats


_memory_log_terms.defvjp(_memory_log_terms_fwd, _memory_log_terms_bwd)


def chunk_len(n_queries: int, n_memory: int, block_elems: int = DEFAULT_BLOCK_ELEMS) -> int:
  """Memory-chunk length so that one `[n_queries, chunk]` block holds about `block_elems` floats."""
  c = max(128, block_elems // max(n_queries, 1))
  return int(min(c, n_memory))



# ----------------------------------------------------------------------------------------------------------
# Per target: test time's memory blocks, TRIME at τ, p_mem at θ, and their mixture.
# ----------------------------------------------------------------------------------------------------------
class MemoryBlock(NamedTuple):
  """One source of memories for queries `[..., Q]`; all fields `[..., Q, M]`."""

  sim: jax.Array  # g(c)·g(c_j) / √D, before τ (TRIME) or θ (cache)
  visible: jax.Array  # bool: memory j is in query i's test memory
  positive: jax.Array  # bool: visible and memory j's target equals query i's target


def block_similarities(queries_SxQxD, keys_SxMxD):
  """g(c)·g(c_j) / √D `[S, Q, M]` (float32): the similarity of test time's `MemoryBlock`s."""
  d = queries_SxQxD.shape[-1]
  return jnp.einsum("sqd,smd->sqm", queries_SxQxD, keys_SxMxD, preferred_element_type=jnp.float32,
                    precision=similarity_precision(queries_SxQxD, keys_SxMxD)) / math.sqrt(d)


def trime_log_prob(log_normalizer, target_logit, blocks, tau):
  """log P_trime(target) `[..., Q]` at τ = `tau` over the memories of `blocks` (vocabulary + memories)."""
  check_tau(tau)
  z, p = log_terms(log_normalizer, target_logit, [(blk.sim / tau, blk.visible, blk.positive) for blk in blocks])
  return p - z


def log_p_mem(blocks, scale, targets):
  """(log p_mem(target), has_memory) `[..., Q]`: p_mem(w) ∝ Σ_{visible, x_j = w} exp(scale·sim) over `blocks`
  (memories only: the continuous cache, kNN-LM and Appendix A's P′ at scale θ = 1/τ′); -inf without memory."""
  log_all = log_pos = jnp.full(targets.shape, -jnp.inf)
  for blk in blocks:
    log_all = masked_logsumexp_with(log_all, scale * blk.sim, blk.visible)
    log_pos = masked_logsumexp_with(log_pos, scale * blk.sim, blk.positive)
  has = functools.reduce(jnp.logical_or, [blk.visible.any(-1) for blk in blocks])
  return jnp.where(has, log_pos - jnp.where(has, log_all, 0.0), -jnp.inf), has


def mix(log_p_model, log_p_memory, has_mem, lam):
  """log((1-λ)·p_model + λ·p_mem) where a query has memory, else log p_model (any shapes that broadcast); λ a
  number in [0, 1] (0: the model alone, 1: the memory alone where there is memory)."""
  if not 0 <= lam <= 1:  # (log1p / log of it: a math domain error, or NaN)
    raise ValueError(f"the interpolation weight lambda must lie in [0, 1], got {lam!r}")
  if lam == 0:
    return log_p_model
  if lam == 1:
    return jnp.where(has_mem, log_p_memory, log_p_model)
  mixed = jnp.logaddexp(math.log1p(-lam) + log_p_model, math.log(lam) + log_p_memory)
  return jnp.where(has_mem, mixed, log_p_model)


# ----------------------------------------------------------------------------------------------------------
# The full distribution `[N, V]`: exp(sim) of every visible memory scattered into its target's vocabulary
# bucket (a segment sum), added to exp(logits), normalised. Dense, or with the memory sharded over devices.
# ----------------------------------------------------------------------------------------------------------
def _empty_buckets(v: int, n: int, dtype):
  """Running (max, sum) `[V, N]` per vocabulary bucket before any memory."""
  return jnp.full((v, n), -jnp.inf, dtype), jnp.zeros((v, n), dtype)


def _fold_buckets(state, sim_MxN, targets_M):
  """Add memories (similarities `[M, N]`, -inf where not visible) to the running per-bucket (max, sum of
  exp(sim - max)). The per-bucket max keeps a bucket's mass even far below the row's largest logit."""
  bmax_VxN, bsum_VxN = state
  v = bmax_VxN.shape[0]
  b = jnp.maximum(targets_M, 0)
  new_VxN = lax.stop_gradient(jnp.maximum(bmax_VxN, jax.ops.segment_max(sim_MxN, b, num_segments=v)))
  ref_VxN = jnp.where(jnp.isfinite(new_VxN), new_VxN, 0.0)
  bsum_VxN = (bsum_VxN * jnp.exp(bmax_VxN - ref_VxN)
              + jax.ops.segment_sum(jnp.exp(sim_MxN - ref_VxN[b]), b, num_segments=v))
  return new_VxN, bsum_VxN


def _bucket_log_weights(logits_NxV, ref_VxN, total_VxN):
  """log(exp(logit_w) + the mass exp(ref)·total of bucket w) `[N, V]`: the unnormalised distribution."""
  return jnp.logaddexp(logits_NxV, (ref_VxN + jnp.log(total_VxN)).T)


def _normalise(log_w_NxV):
  return log_w_NxV - jax.nn.logsumexp(log_w_NxV, axis=-1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("normalise",))
def _memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask, scale, *, normalise=True):
  n, v = token_logits.shape
  logits = token_logits.astype(accumulation_dtype(token_logits, keys))
  mask = memory_mask & (memory_targets[None, :] >= 0)
  sim_MxN = jnp.where(mask, similarities(keys, memory_keys, scale), -jnp.inf).T
  bmax_VxN, bsum_VxN = _fold_buckets(_empty_buckets(v, n, logits.dtype), sim_MxN, memory_targets)
  log_w = _bucket_log_weights(logits, jnp.where(jnp.isfinite(bmax_VxN), bmax_VxN, 0.0), bsum_VxN)
  return _normalise(log_w) if normalise else log_w


def memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask, *, tau=1.0):
  """The full memory-augmented distribution `[N, V]` (log-probabilities; rows sum to 1) at τ = `tau`.

  token_logits `[N, V]`, keys `[N, D]`, memory_keys `[M, D]`, memory_targets `[M]` int (negative: ignored),
  memory_mask `[N, M]` bool. exp(sim) of every visible memory is scattered into its target's vocabulary bucket
  with a jit-compiled segment sum and added to exp(logits) before normalising. The same law with the memory
  sharded over devices: `sharded_memory_log_probs`. Memory targets ≥ V: ValueError where concrete.
  """
  return _memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask,
                           _checked_scale(token_logits, keys, memory_keys, memory_targets, memory_mask, tau))


def _checked_scale(token_logits, keys, memory_keys, memory_targets, memory_mask, tau, targets_checked=False):
  """`memory_log_probs`' arguments checked (ValueError: shapes that do not fit, memory targets ≥ V where
  concrete and not `targets_checked`, τ), and its similarity scale."""
  (n, v), m = jnp.shape(token_logits), jnp.shape(memory_targets)[0]
  if (jnp.shape(keys)[0] != n or jnp.shape(memory_keys) != (m, jnp.shape(keys)[-1])
      or jnp.shape(memory_mask) != (n, m)):
    raise ValueError(f"shapes do not fit: token_logits [N, V] {jnp.shape(token_logits)}, keys [N, D] "
                     f"{jnp.shape(keys)}, memory_keys [M, D] {jnp.shape(memory_keys)}, memory_targets [M] "
                     f"{jnp.shape(memory_targets)}, memory_mask [N, M] {jnp.shape(memory_mask)}")
  if not targets_checked:
    check_targets(memory_targets, v, "memory_targets")
  return jnp.asarray(static_scale(keys.shape[-1], tau), accumulation_dtype(keys))


def memory_log_weights(token_logits, keys, memory_keys, memory_targets, memory_mask, *, tau=1.0,
                       targets_checked: bool = False):
  """`memory_log_probs` before normalising: log(exp(logit_w) + Σ_{visible j, x_j = w} exp(sim_j)) `[N, V]`, as
  logits to which further memories can be added (generation adds an on-device datastore's). `targets_checked`:
  the caller knows the memory targets lie below V (tokens the model wrote or read), so a device array of them is
  not read back at every call (eager generation, once per token)."""
  scale = _checked_scale(token_logits, keys, memory_keys, memory_targets, memory_mask, tau, targets_checked)
  return _memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask, scale, normalise=False)


def _every_memory(mem_targets_M):
  """prime_M's default: P′ over every memory (the release takes P′ over its top-K external entries only: the
  evaluator and the decoders pass that mask)."""
  return jnp.ones(mem_targets_M.shape, bool)


def trime_log_probs(logits_NxV, q_NxD, mem_keys_MxD, mem_targets_M, mem_mask_NxM, *, tau: float, prime_M=None,
                    knn_lambda: float = 0.0, tau_prime: float = 1.0):
  """log P `[N, V]`: TRIME's distribution at τ over the memories each row's mask shows (`memory_log_probs`);
  with knn_lambda > 0 Appendix A's (1-λ)·P_trime + λ·P′, P′(w) ∝ Σ_{visible, prime, x_j = w}
  exp(sim/τ′) (τ′ = `tau_prime`) over the visible memories where `prime_M` is True (None: every memory, as
  Appendix A states P′; rows that see none keep P_trime)."""
  log_p = memory_log_probs(logits_NxV, q_NxD, mem_keys_MxD, mem_targets_M, mem_mask_NxM, tau=tau)
  if not knn_lambda:
    return log_p
  prime_M = _every_memory(mem_targets_M) if prime_M is None else prime_M
  prime_NxM = mem_mask_NxM & prime_M[None, :] & (mem_targets_M[None, :] >= 0)
  no_vocab = jnp.full_like(logits_NxV, -jnp.inf)  # P′ is memories only
  log_prime = memory_log_probs(no_vocab, q_NxD, mem_keys_MxD, mem_targets_M, prime_NxM, tau=tau_prime)
  return mix(log_p, log_prime, prime_NxM.any(-1, keepdims=True), knn_lambda)


def log_contributions(logits_NxV, q_NxD, mem_keys_MxD, mem_targets_M, mem_mask_NxM, tokens_N, *, tau: float,
                      prime_M=None, knn_lambda: float = 0.0, tau_prime: float = 1.0):
  """(log of the vocabulary's part `[N]`, log of each memory's part `[N, M]`) of `trime_log_probs`' P(token_n)
  (same arguments): exp(logit_w)/Z and exp(sim_j/τ)/Z of the visible memories j with x_j = w (-inf for the
  others), with Appendix A's λ·exp(sim_j/τ′)/Z′ added to the P′ memories' parts. The parts sum to
  exp(trime_log_probs[n, w]): what a retrieval trace shows of which memories gave a token its mass. Z and Z′
  are `memory_log_weights`' normalisers, the mixture is `mix`, so the parts are the law's own terms."""
  logits = logits_NxV.astype(accumulation_dtype(logits_NxV, q_NxD))
  d = q_NxD.shape[-1]
  mask = mem_mask_NxM & (mem_targets_M[None, :] >= 0)
  positive_NxM = mask & (mem_targets_M[None, :] == tokens_N[:, None])
  acc = accumulation_dtype(q_NxD)

  def parts(token_logits, vis_NxM, t):
    # log Z from the law's own unnormalised weights; each part is its term minus log Z.
    log_z = jax.nn.logsumexp(memory_log_weights(token_logits, q_NxD, mem_keys_MxD, mem_targets_M, vis_NxM, tau=t),
                             axis=-1)
    sim = similarities(q_NxD, mem_keys_MxD, jnp.asarray(static_scale(d, t), acc))
    log_vocab = jnp.take_along_axis(token_logits, tokens_N[:, None], axis=-1)[:, 0] - log_z
    return log_vocab, jnp.where(positive_NxM & vis_NxM, sim - log_z[:, None], -jnp.inf)

  log_vocab, log_mem = parts(logits, mask, tau)
  if not knn_lambda:
    return log_vocab, log_mem
  prime_M = _every_memory(mem_targets_M) if prime_M is None else prime_M
  prime_NxM = mask & prime_M[None, :]
  _, log_prime = parts(jnp.full_like(logits, -jnp.inf), prime_NxM, tau_prime)  # P′ is memories only
  has = prime_NxM.any(-1)
  no_prime = jnp.full_like(log_vocab, -jnp.inf)
  return mix(log_vocab, no_prime, has, knn_lambda), mix(log_mem, log_prime, has[:, None], knn_lambda)


def mesh_axis_size(mesh, axis: str) -> int:
  """Devices on `axis` of `mesh`; ValueError naming the mesh's axes where it has no such axis."""
  if axis not in mesh.shape:
    raise ValueError(f"the mesh has no axis {axis!r} (its axes: {', '.join(map(repr, mesh.shape))}): give axis= one of them")
  return mesh.shape[axis]


def on_mesh(mesh, spec, x):
  """`x` placed as `spec` on `mesh` (eagerly a transfer, under jit a sharding constraint): what a shard_map's
  in_specs need whatever placement the caller's array has, on meshes with explicit axes too."""
  return jax.device_put(x, NamedSharding(mesh, spec))


def fold_memory_chunks(fold, state, m: int, chunk: int):
  """`fold(state, start, size)` over memory rows [0, m) in chunks of `chunk` rows (static sizes; a shorter
  last chunk). The chunks are dynamic slices of the caller's arrays: the memory shard is never copied."""
  chunk = max(1, min(chunk, m))
  full = m // chunk
  if full:
    state = lax.fori_loop(0, full, lambda i, s: fold(s, i * chunk, chunk), state)
  if m % chunk:
    state = fold(state, full * chunk, m % chunk)
  return state


def pad_memory(n: int, memory_keys, memory_targets, memory_mask=None):
  """Pad the memory axis to a multiple of n devices: zero keys, target -1 (never visible), mask False."""
  pad = -memory_keys.shape[0] % n
  if not pad:
    return memory_keys, memory_targets, memory_mask
  memory_keys = jnp.pad(memory_keys, ((0, pad), (0, 0)))
  memory_targets = jnp.pad(memory_targets, (0, pad), constant_values=-1)
  if memory_mask is not None:
    memory_mask = jnp.pad(memory_mask, ((0, 0), (0, pad)))
  return memory_keys, memory_targets, memory_mask


def sharded_memory_log_probs(token_logits, keys, memory_keys, memory_targets, memory_mask=None, *, mesh,
                             tau=1.0, axis: str = DATA, memory_chunk: int = 0, targets_checked: bool = False):
  """`memory_log_probs` with the memory sharded over `axis` of `mesh`: log-probabilities `[N, V]` at τ = `tau`.

  token_logits `[N, V]`, keys `[N, D]` (replicated: every device scores every query), memory_keys `[M, D]`,
  memory_targets `[M]` int (negative: ignored), memory_mask `[N, M]` bool or None (every memory visible).
  Inputs may be placed anyhow (they are placed as the per-device function needs). M need not be a multiple
  of the device count (the memory is padded with invisible entries; a memory already sharded as `P(axis)` with
  M a multiple of n is used in place). Each device scans its shard in chunks of `memory_chunk` rows (0: about
  `DEFAULT_BLOCK_ELEMS` similarities per chunk), keeping per vocabulary bucket a running max and a segment sum
  of exp(similarity - max); the devices' buckets are then combined with one `pmax` and one `psum` of `[V, N]`,
  so no bucket's mass underflows however far it lies below the others, and a device with no visible memory
  contributes exactly nothing. Returns a replicated array. Memory targets ≥ V: ValueError where concrete, unless
  `targets_checked` (checked once by the caller: a datastore on the devices is not read back at every call).
  """
  token_logits, keys = jnp.asarray(token_logits), jnp.asarray(keys)
  memory_keys, memory_targets = jnp.asarray(memory_keys), jnp.asarray(memory_targets, jnp.int32)
  n_q, v = token_logits.shape
  m, d = memory_keys.shape
  if keys.shape != (n_q, d) or memory_targets.shape != (m,):
    raise ValueError(f"shapes do not fit: token_logits {token_logits.shape}, keys {keys.shape}, memory_keys "
                     f"{memory_keys.shape}, memory_targets {memory_targets.shape}")
  if memory_mask is not None:
    memory_mask = jnp.asarray(memory_mask, bool)
    if memory_mask.shape != (n_q, m):
      raise ValueError(f"memory_mask must be [N={n_q}, M={m}], got {memory_mask.shape}")
  if not targets_checked:  # (the segment sum would drop one ≥ V without a word)
    check_targets(memory_targets, v, "memory_targets")
  if isinstance(memory_chunk, bool) or not isinstance(memory_chunk, numbers.Integral) or memory_chunk < 0:
    raise ValueError(f"memory_chunk must be an int >= 0 (0: from the block budget), got {memory_chunk!r}")
  n = mesh_axis_size(mesh, axis)
  memory_keys, memory_targets, memory_mask = pad_memory(n, memory_keys, memory_targets, memory_mask)
  acc = accumulation_dtype(token_logits, keys)
  scale = similarity_scale(d, tau, acc)
  chunk = int(memory_chunk) or chunk_len(n_q, memory_keys.shape[0] // n)
  return _sharded_log_probs(mesh, axis, chunk, token_logits.astype(acc), keys, memory_keys, memory_targets,
                            memory_mask, scale)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _sharded_log_probs(mesh, axis, chunk, logits_NxV, q_NxD, mk_MxD, mt_M, mask_NxM, scale):
  specs = (P(), P(), P(axis), P(axis), P()) + (() if mask_NxM is None else (P(None, axis),))
  args = (logits_NxV, q_NxD, mk_MxD, mt_M, scale) + (() if mask_NxM is None else (mask_NxM,))
  body = functools.partial(_device_log_probs, axis, chunk, mask_NxM is not None)
  per_device = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
  return per_device(*(on_mesh(mesh, s, x) for s, x in zip(specs, args)))


def _device_log_probs(axis, chunk, has_mask, logits_NxV, q_NxD, mk_mxD, mt_m, scale, mask_Nxm=None):
  n_q, v = logits_NxV.shape
  acc = logits_NxV.dtype

  def fold(state, start, size):
    t = lax.dynamic_slice_in_dim(mt_m, start, size)
    vis_cxN = jnp.broadcast_to((t >= 0)[:, None], (size, n_q))
    if has_mask:
      vis_cxN = vis_cxN & lax.dynamic_slice_in_dim(mask_Nxm, start, size, axis=1).T
    k = lax.dynamic_slice_in_dim(mk_mxD, start, size)
    sim_cxN = jnp.where(vis_cxN, similarities(q_NxD, k, scale).T.astype(acc), -jnp.inf)
    return _fold_buckets(state, sim_cxN, t)

  bmax_VxN, bsum_VxN = fold_memory_chunks(fold, _empty_buckets(v, n_q, acc), mt_m.shape[0], chunk)
  # Combine the devices: the global per-bucket max, then every device's sum rescaled to it (exact; a device
  # whose bucket is empty has max -inf and adds 0).
  gmax_VxN = lax.pmax(lax.stop_gradient(bmax_VxN), axis)
  ref_VxN = jnp.where(jnp.isfinite(gmax_VxN), gmax_VxN, 0.0)
  total_VxN = lax.psum(bsum_VxN * jnp.exp(bmax_VxN - ref_VxN), axis)
  return _normalise(_bucket_log_weights(logits_NxV, ref_VxN, total_VxN))


# ----------------------------------------------------------------------------------------------------------
# Per target, over a memory sharded over devices (an on-device datastore): the memory terms at several scales.
# ----------------------------------------------------------------------------------------------------------
def sharded_scaled_log_sums(queries_NxD, targets_N, memory_keys_MxD, memory_targets_M, scales, *, mesh,
                            axis: str = DATA, memory_chunk: int):
  """(lse_neg, lse_pos) `[C, N]` at scales c (a tuple of positive floats), over a memory sharded over `axis`:

    lse_pos[c, i] = log Σ_{j: x_j = y_i} exp(c·sim_ij),   lse_neg[c, i] = log Σ_{j: x_j != y_i} exp(c·sim_ij)

  (-inf where a sum is empty; memories with target < 0 never count), sim = q·k_j / √D. Queries `[N, D]` and
  targets `[N]` are replicated; M a multiple of the device count. Every test-time family reads its memory terms
  from these two sums at its scale (TRIME at 1/τ, p_mem at θ, P′ at 1/τ′: `exact_memory`, `evaluate`); they are
  kept apart (rather than all and positive) so that neither is a difference of nearly equal numbers. Each
  device scans its shard in chunks of `memory_chunk` rows with a running max; the devices combine with one
  `pmax` and one `psum` (the max first, so no device's sums underflow)."""
  scales = tuple(float(c) for c in scales)
  return _sharded_scaled_log_sums(mesh, axis, memory_chunk, scales, queries_NxD, targets_N, memory_keys_MxD,
                                  memory_targets_M)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _sharded_scaled_log_sums(mesh, axis, chunk, scales, q_NxD, t_N, mk_MxD, mt_M):
  specs = (P(), P(), P(axis), P(axis))
  body = functools.partial(_device_log_terms, axis, chunk, scales)
  per_device = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P()), check_vma=False)
  return per_device(*(on_mesh(mesh, sp, x) for sp, x in zip(specs, (q_NxD, t_N, mk_MxD, mt_M))))


def _device_log_terms(axis, chunk, scales, q_NxD, t_N, mk_mxD, mt_m):
  n = q_NxD.shape[0]
  acc = accumulation_dtype(q_NxD, mk_mxD)  # float32 (float64 for float64 keys and queries)
  c_C = jnp.asarray(scales, acc)
  inv_sqrt_d = 1.0 / math.sqrt(q_NxD.shape[-1])

  def fold(state, start, size):
    k = lax.dynamic_slice_in_dim(mk_mxD, start, size)
    mt = lax.dynamic_slice_in_dim(mt_m, start, size)
    sim_Nxc = jnp.einsum("nd,cd->nc", q_NxD, k, preferred_element_type=acc,
                         precision=similarity_precision(q_NxD, k)) * inv_sqrt_d
    vis = (mt >= 0)[None, :]
    is_pos = mt[None, :] == t_N[:, None]
    out = []
    for (mx_N, s_CxN), sel in zip(state, (vis & ~is_pos, vis & is_pos)):
      masked = jnp.where(sel, sim_Nxc, -jnp.inf)
      new_N = jnp.maximum(mx_N, masked.max(-1))
      ref_N = jnp.where(jnp.isfinite(new_N), new_N, 0.0)  # c > 0: max_j c·sim_j = c·max_j sim_j
      s_CxN = (s_CxN * jnp.exp(c_C[:, None] * (mx_N - ref_N)[None])
               + jnp.exp(c_C[:, None, None] * (masked - ref_N[:, None])[None]).sum(-1))
      out.append((new_N, s_CxN))
    return tuple(out)

  empty = (jnp.full((n,), -jnp.inf, acc), jnp.zeros((len(scales), n), acc))
  state = fold_memory_chunks(fold, (empty, empty), mt_m.shape[0], chunk)
  result = []
  for mx_N, s_CxN in state:  # combine the devices: global max, then the rescaled sums
    g_N = lax.pmax(mx_N, axis)
    ref_N = jnp.where(jnp.isfinite(g_N), g_N, 0.0)
    total = lax.psum(s_CxN * jnp.exp(c_C[:, None] * (mx_N - ref_N)[None]), axis)
    result.append(c_C[:, None] * ref_N[None] + jnp.log(total))
  return tuple(result)
