"""Memories at evaluation: `MemoryBlock` (one source of memories for a set of queries) and the long-term
store, a fixed-size on-device ring buffer of earlier tokens' keys per document stream.

The test memory of a query is a disjoint union of blocks that all enter ONE softmax (see
`evaluate.variant_nlls`): the window's earlier tokens (local), the store's tokens before the window
(long-term) and, later, the top-K retrieved neighbours of the query (external). A block is just
similarities and two masks, so a new source only has to produce `[..., Q, M]` arrays:

    kNN:  MemoryBlock(sim = g·k_retrieved / √D   [S, Q, K],
                      visible = retrieved slot is real,
                      positive = visible & (retrieved target == query target))

Store semantics (shapes: S streams, M slots, Q queries per window, D key dim):
  * every scored token is inserted exactly once, with the key computed in the window that scored it;
  * a query in a window starting at target position `start` sees the store tokens q with
    start - mem_size <= q < start (tokens at >= start are the window's own, seen as local memory: the union
    is disjoint, no token counts twice), and with `reset_at_documents` only those of its own document.
The document rule is a per-query mask rather than a clear of the buffer: a window can straddle a document
boundary, and its queries before the boundary still need the store.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from trime_jax import loss as L


class MemoryBlock(NamedTuple):
  """One source of memories for queries `[..., Q]`; all fields `[..., Q, M]`."""

  sim: jax.Array  # g(c)·g(c_j) / √D, before the temperature (TRIME) or θ (cache)
  visible: jax.Array  # bool: memory j is in query i's test memory
  positive: jax.Array  # bool: visible and memory j's target equals query i's target


def similarities(q_SxQxD, k_SxMxD):
  d = q_SxQxD.shape[-1]
  return jnp.einsum("sqd,smd->sqm", q_SxQxD, k_SxMxD, preferred_element_type=jnp.float32,
                    precision=L.similarity_precision(q_SxQxD, k_SxMxD)) / math.sqrt(d)


class Store(NamedTuple):
  """Ring buffer per stream. Empty slots have target = pos = -1."""

  keys: jax.Array  # [S, M, D]
  targets: jax.Array  # [S, M] int32 next token of the slot's context
  pos: jax.Array  # [S, M] int32 global target position in the corpus
  doc: jax.Array  # [S, M] int32 document of that position
  head: jax.Array  # [S] int32 next slot to write


def capacity(mem_size: int, context_window: int, query_len: int) -> int:
  """Slots per stream. When window w is scored the buffer holds the tokens scored before it, i.e. up to its
  score start; the visible ones end `context_window` tokens earlier, hence mem_size + context_window. At
  least one window's queries, so one insertion never wraps onto itself."""
  return max(mem_size + context_window, query_len)


def empty(streams: int, slots: int, dim: int, dtype) -> Store:
  full = lambda v: jnp.full((streams, slots), v, jnp.int32)
  return Store(jnp.zeros((streams, slots, dim), dtype), full(-1), full(-1), full(-1),
               jnp.zeros((streams,), jnp.int32))


def insert(store: Store, keys_SxQxD, targets_SxQ, pos_SxQ, doc_SxQ, mask_SxQ) -> Store:
  """Append the masked queries of every stream (in order) at its head, overwriting the oldest slots."""
  s, m = store.targets.shape
  offset = jnp.cumsum(mask_SxQ, axis=1, dtype=jnp.int32) - 1
  slot = jnp.where(mask_SxQ, (store.head[:, None] + offset) % m, m)  # slot m is out of range: dropped
  rows = jnp.arange(s)[:, None]

  def put(buf, new):
    return buf.at[rows, slot].set(new.astype(buf.dtype), mode="drop")

  return Store(put(store.keys, keys_SxQxD), put(store.targets, targets_SxQ), put(store.pos, pos_SxQ),
               put(store.doc, doc_SxQ), (store.head + mask_SxQ.sum(axis=1, dtype=jnp.int32)) % m)


def block(store: Store, keys_SxQxD, targets_SxQ, doc_SxQ, window_start_S, *, mem_size: int,
          reset_at_documents: bool) -> MemoryBlock:
  """The long-term memories of a window's queries: store tokens in [start - mem_size, start)."""
  start = window_start_S[:, None]
  vis = (store.targets >= 0) & (store.pos >= start - mem_size) & (store.pos < start)  # [S, M]
  vis = jnp.broadcast_to(vis[:, None, :], targets_SxQ.shape + vis.shape[-1:])
  if reset_at_documents:
    vis = vis & (store.doc[:, None, :] == doc_SxQ[:, :, None])
  positive = vis & (store.targets[:, None, :] == targets_SxQ[:, :, None])
  return MemoryBlock(similarities(keys_SxQxD, store.keys), vis, positive)
