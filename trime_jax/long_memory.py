"""The long-term store at evaluation: a fixed-size on-device ring buffer, per stream, of earlier tokens'
keys, next tokens, positions and documents (shapes: S streams, M slots, Q queries per window, D key dim).

  * every scored token is inserted exactly once, with the key computed in the window that scored it;
  * who sees what is `evaluate.long_term_block`'s TokenMeta + `scoring.visible`: a query in a window fed from
    target position `start`, scored from `score_start`, sees the store tokens q with
    score_start - mem_size <= q < score_start (layout "original", the release's: the window's context tokens
    are also local memory, so they count twice), or score_start - context_window - mem_size <= q < start
    (layout "disjoint": no token counts twice), and with `reset_at_documents` only those of its own document.
The document rule is visibility rather than a clear of the buffer: a window can straddle a document boundary,
and its queries before the boundary still need the store.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


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
  m = store.targets.shape[1]
  offset = jnp.cumsum(mask_SxQ, axis=1, dtype=jnp.int32) - 1
  slot = jnp.where(mask_SxQ, (store.head[:, None] + offset) % m, m)  # slot m is out of range: dropped

  def put(buf, new):  # per stream (vmap: a scatter batched over streams, which stays on the device that holds the
    # stream when they are split over a mesh; indices [stream, slot] made XLA gather every stream's queries)
    return jax.vmap(lambda b, at, x: b.at[at].set(x.astype(b.dtype), mode="drop"))(buf, slot, new)

  return Store(put(store.keys, keys_SxQxD), put(store.targets, targets_SxQ), put(store.pos, pos_SxQ),
               put(store.doc, doc_SxQ), (store.head + mask_SxQ.sum(axis=1, dtype=jnp.int32)) % m)
