"""The TRIME objective: a batch whose memory is the batch itself.

    nll_i = log(Z_vocab_i + Σ_{j vis} e^{s_ij}) - log(e^{logit_i,y_i} + Σ_{j vis, x_j = y_i} e^{s_ij})

The distribution and its pieces are `scoring`'s (the vocabulary side `VocabStats` / `vocab_stats` /
`chunked_vocab_stats`, similarities, `TokenMeta` + `visible`, the dense and blockwise log terms); this module lays
a training batch out for them and owns what only training needs:

* `batch_meta` / `per_query_causal`: local, long-term and external memory as `TokenMeta` of the batch;
* the objective's options, once (`ObjectiveSpec`; made from a config by `specs.objective_spec`);
* `trime_nll` / `trime_nll_from_vocab_stats`, which exploit structure: local memory is block-diagonal (one
  `[L, L]` block per segment), long-term memory block-diagonal per document run, only external memory spans
  the batch. `implementation="auto"` keeps the per-group blocks for autodiff when they fit a 64 MiB budget
  (no recomputation) and switches to `scoring.memory_log_terms` (blockwise) when they do not; "dense" is one
  `[BL, BL]` mask (tests);
* `memory_nll` (dense, explicit `[N, M]` masks, for tests and small memories).

The same global batch sharded over devices: `sharded_loss` (above this module). This module imports only
`scoring`.

Shapes in names: N queries, M memories, D key dim, V vocabulary, B segments, L tokens per segment.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from trime_jax import scoring
# The scorer's names the objective's callers use with it (the vocabulary side a model head gives; TokenMeta +
# visible are the objective's memory rule): defined in `scoring`, importable from here as well.
from trime_jax.scoring import DEFAULT_BLOCK_ELEMS, TokenMeta, VocabStats, accumulation_dtype, visible, vocab_stats

MEMORY_MODES = ("none", "local", "long", "ext")
# auto: per-group dense blocks with plain autodiff when they fit `block_elems`, else blockwise;
# blockwise: always the chunked custom-VJP kernel; dense: one [BL, BL] mask for the whole batch (tests).
IMPLEMENTATIONS = ("auto", "blockwise", "dense")


# ----------------------------------------------------------------------------------------------------------
# Memory side: who may see whom.
# ----------------------------------------------------------------------------------------------------------
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
    readable = not isinstance(drop_local, jax.Array) or (  # not traced, and on this host (multi-process)
        not isinstance(drop_local, jax.core.Tracer) and drop_local.is_fully_addressable)
    if readable and np.any(np.asarray(drop_local)):
      # (training passes an all-False drop_local whatever the memory: only a drop asked for is refused)
      raise ValueError(f"drop_local drops ext memory's local part; memory={memory!r} has no drop")
    return jnp.ones((b, l), bool)
  if jnp.issubdtype(jnp.asarray(drop_local).dtype, jnp.inexact):  # 0.9 (a probability) read as True: every row
    raise ValueError(f"drop_local must be a bool or a [B={b}] bool array (the drop decisions, not their "
                     f"probability), got {drop_local!r}")
  drop = jnp.asarray(drop_local, bool)
  if drop.ndim not in (0, 1) or (drop.ndim == 1 and drop.shape[0] != b):
    raise ValueError(f"drop_local must be a bool or a [B={b}] bool array, got shape {drop.shape}")
  return jnp.broadcast_to(jnp.logical_not(drop).reshape(-1, 1) if drop.ndim else jnp.logical_not(drop), (b, l))


# ----------------------------------------------------------------------------------------------------------
# Dense path (explicit masks).
# ----------------------------------------------------------------------------------------------------------
def memory_nll_from_vocab_stats(
    stats: VocabStats, keys, targets, memory_keys, memory_targets, memory_mask, *, tau=1.0
):
  """`memory_nll` with the vocabulary side given as `VocabStats` `[N]` (dense mask `[N, M]`)."""
  n, m = jnp.shape(targets)[0], jnp.shape(memory_targets)[0]
  if jnp.shape(memory_mask) != (n, m) or jnp.asarray(memory_mask).dtype != jnp.bool_:
    raise ValueError(f"memory_mask must be bool [N, M] = [{n}, {m}] (queries x memories), got "
                     f"{jnp.asarray(memory_mask).dtype}{list(jnp.shape(memory_mask))}")
  if jnp.shape(keys)[0] != n or jnp.shape(memory_keys)[0] != m:
    raise ValueError(f"keys {jnp.shape(keys)} / memory_keys {jnp.shape(memory_keys)} do not match targets [{n}] / "
                     f"memory_targets [{m}]")
  scale = scoring.static_scale(keys.shape[-1], tau)
  return scoring.dense_nll(stats, keys, targets, memory_keys, memory_targets, memory_mask, scale)


def memory_nll(token_logits, keys, targets, memory_keys, memory_targets, memory_mask, *, tau=1.0):
  """Negative log-likelihood `[N]` of `targets` under the memory-augmented softmax at τ = `tau` (dense mask).

  token_logits `[N, V]`, keys `[N, D]`, targets `[N]` int, memory_keys `[M, D]`, memory_targets `[M]` int,
  memory_mask `[N, M]` bool (True: memory j is visible to query i). Memories with a negative target are
  ignored; queries with a negative target get nll 0.
  """
  stats = vocab_stats(token_logits, targets)
  # a memory target ≥ V would add to the normaliser and never match (memory_nll_from_vocab_stats knows no V)
  scoring.check_targets(memory_targets, jnp.shape(token_logits)[-1], "memory_targets")
  return memory_nll_from_vocab_stats(
      stats, keys, targets, memory_keys, memory_targets, memory_mask, tau=tau
  )



# ----------------------------------------------------------------------------------------------------------
# The batch as its own memory.
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
  """The objective's options, stated once (hashable: part of a jit cache key). `trime_nll`,
  `trime_nll_from_vocab_stats` and `sharded_loss` take one, or its fields as keywords."""

  memory: str  # none | local | long | ext (see `trime_nll`)
  consecutive_segments: int = 1  # memory="long": rows per document run
  tau: float = 1.0  # τ on memory similarities g·g_j/√D (may be a traced scalar where the spec is not static)
  stop_gradient_memory: bool = False  # no gradient into memory keys
  implementation: str = "auto"  # auto | blockwise | dense (see IMPLEMENTATIONS)
  block_elems: int = DEFAULT_BLOCK_ELEMS  # budget of one similarity block (blockwise path)
  memory_chunk: int | None = None  # memory chunk length of the blockwise path (None: from block_elems)
  memory_topk: int = 0  # > 0: only the k most similar visible memories per query (the original MT's --topk-mem;
  # one dense [N, N] block, so for batches of sentence pairs)
  memory_grad_group_rows: int = 0  # > 0: a memory key gets gradient only from queries whose batch row lies in
  # its group of this many consecutive rows of the global batch (one original GPU's segments: its all_gather
  # detaches other GPUs' keys); values unchanged. 0: no cut. No effect on local memory (within a row). With
  # packed segments (rows=), groups of this many consecutive segment ids (`mt.batching.collate_update`)

  def __post_init__(self):
    if self.memory not in MEMORY_MODES:
      hint = " (the in-batch memory of other segments is 'ext' here; 'external' is the API's datastore)" \
          if self.memory == "external" else ""
      raise ValueError(f"memory must be one of {MEMORY_MODES}, got {self.memory!r}{hint}")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}")
    if self.consecutive_segments < 1:  # (read by memory="long"; 0 is no layout for any memory)
      raise ValueError(f"consecutive_segments must be >= 1, got {self.consecutive_segments}")
    if self.memory_chunk is not None and self.memory_chunk < 1:
      raise ValueError(f"memory_chunk must be >= 1 (None: from block_elems), got {self.memory_chunk}")
    if self.block_elems < 1:
      raise ValueError(f"block_elems must be >= 1, got {self.block_elems}")
    if self.memory_topk < 0:
      raise ValueError(f"memory_topk must be >= 0, got {self.memory_topk}")
    if self.memory_grad_group_rows < 0:
      raise ValueError(f"memory_grad_group_rows must be >= 0, got {self.memory_grad_group_rows}")
    scoring.check_tau(self.tau)

  @property
  def key_grad_group_rows(self) -> int:
    """The row-group cut that acts: 0 where it cannot matter (no memory across rows, or no key gradient)."""
    if self.memory not in ("long", "ext") or self.stop_gradient_memory:
      return 0
    return self.memory_grad_group_rows


def resolve_spec(spec: ObjectiveSpec | None, options: dict) -> ObjectiveSpec:
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
  if keys.ndim != 3:
    raise ValueError(f"keys must be [B, L, D], got {keys.shape}")


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
  spec = resolve_spec(spec, options)
  keys, targets = jnp.asarray(keys), jnp.asarray(targets)
  stats = VocabStats(*map(jnp.asarray, stats))
  check_batch_memory(spec, keys, targets)
  if stats.log_normalizer.shape != targets.shape:
    raise ValueError(f"vocabulary stats {stats.log_normalizer.shape} and targets {targets.shape} disagree on [B, L]")
  memory, consecutive_segments = spec.memory, spec.consecutive_segments
  valid = targets >= 0
  if memory == "none":
    return jnp.where(valid, stats.log_normalizer - stats.target_logit, 0.0)

  b, l, d = keys.shape
  if documents is not None and memory != "long":
    raise ValueError(f"documents restrict long-term memory (packed runs); memory={memory!r} takes none")
  for name, ids in (("documents", documents), ("rows", rows)):
    if ids is not None and jnp.shape(ids) != (b, l):
      raise ValueError(f"{name} must be [B, L] = {[b, l]} like the targets, got {list(jnp.shape(ids))}")
  if rows is not None and jnp.ndim(drop_local):
    raise ValueError("packed rows take a scalar drop_local (per-row draws would split packed segments alike)")
  cut = spec.key_grad_group_rows  # with rows= (packed segments): groups of that many consecutive segment ids
  meta = batch_meta(targets, memory, consecutive_segments, row_offset=row_offset, documents_BxL=documents,
                    rows_BxL=rows)
  causal = per_query_causal(memory, drop_local, b, l)
  cross_rows = memory == "ext"
  acc = accumulation_dtype(keys, stats.log_normalizer)
  scale = scoring.similarity_scale(d, spec.tau, acc)
  mem_keys = jax.lax.stop_gradient(keys) if spec.stop_gradient_memory else keys

  if spec.implementation == "dense" or spec.memory_topk:
    flat = TokenMeta(*(x.reshape(-1) for x in meta))
    mask = visible(flat, flat, causal.reshape(-1), cross_rows)
    flat_stats = VocabStats(*(x.reshape(-1) for x in stats))
    args = (flat_stats, keys.reshape(b * l, d), flat.target, mem_keys.reshape(b * l, d), flat.target, mask, scale)
    kg = scoring.same_grad_group(flat.row, flat.row, cut) if cut else None
    nll = (scoring.topk_dense_nll(*args, spec.memory_topk, kg) if spec.memory_topk
           else scoring.dense_nll(*args, kg))
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
    kg = jax.vmap(lambda r: scoring.same_grad_group(r, r, cut))(gmeta.row) if cut else None
    nll = jax.vmap(scoring.dense_nll, in_axes=(0, 0, 0, 0, 0, 0, None, 0 if cut else None))(
        gstats, grouped(keys), gmeta.target, grouped(mem_keys), gmeta.target, mask, scale, kg)
    return nll.reshape(b, l)
  chunk = spec.memory_chunk or scoring.chunk_len(g * n, n, spec.block_elems)
  terms = jax.vmap(
      functools.partial(scoring.memory_log_terms, cross_rows, chunk, grad_group_rows=cut), in_axes=(0, 0, 0, 0, 0, None, 0)
  )
  log_z, log_p = terms(grouped(keys), grouped(mem_keys), gmeta, gmeta, grouped(causal), scale, gstats)
  return jnp.where(valid, (log_z - log_p).reshape(b, l), 0.0)


def trime_nll(token_logits, keys, targets, spec: ObjectiveSpec | None = None, *, drop_local=False, documents=None,
              rows=None, row_offset=0, **options):
  """TRIME negative log-likelihood `[B, L]`; the memory is the batch itself.

  token_logits `[B, L, V]`, keys `[B, L, D]`, targets `[B, L]` (negative = padding: never memory, nll 0).
  `spec` (or its fields as keywords: `trime_nll(..., memory="local", tau=0.5)`):
    memory="none":  plain cross-entropy
    memory="local": token t of segment b sees tokens j < t of segment b
    memory="long":  rows come in runs of `consecutive_segments` consecutive segments of the stream; a token
                    sees every earlier token of its run (`documents` [B, L]: only those of its own document)
    memory="ext":   a token sees every token of every other row, plus j < t of its own row unless its row
                    drops local memory (`drop_local`: a bool for every row, or [B] per row)
  Gradients reach every memory key unless `stop_gradient_memory`; with `memory_grad_group_rows` = G > 0 a key
  gets gradient only from queries of rows in its group of G consecutive rows (values unchanged). `implementation`: "auto" (per-group dense
  blocks when they fit `block_elems`, else blockwise), "blockwise" (always the chunked custom-VJP kernel),
  "dense" (one full `[BL, BL]` mask; tests, small batches). `rows`, `row_offset`: see
  `trime_nll_from_vocab_stats`.

  Values are checked where they are concrete (ValueError: a target ≥ V, τ ≤ 0). Inside `jax.jit` they are
  traced and not checked (the check would wait for the device at every step): a target ≥ V there gives NaN.
  Check a data pipeline's batches once outside jit (`scoring.check_targets(targets, V)`). The mean over real
  tokens is `nll.sum() / max((targets >= 0).sum(), 1)` (padding's nll is 0).
  """
  return trime_nll_from_vocab_stats(vocab_stats(token_logits, targets), keys, targets,
                                    resolve_spec(spec, options), drop_local=drop_local, documents=documents,
                                    rows=rows, row_offset=row_offset)

