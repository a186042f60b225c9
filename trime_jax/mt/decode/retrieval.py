"""Retrieval for translation: the top-K datastore entries of decoder queries by exact inner product (TRIME's
similarity) or exact squared L2 distance (kNN-MT's), from the inner-product FAISS index."""

from __future__ import annotations

import dataclasses

import numpy as np

from trime_jax.datastore import Datastore, KnnIndex, rescore
from trime_jax.errors import ConfigError


@dataclasses.dataclass
class Neighbours:
  """The top-K entries of N queries, best first."""

  ids: np.ndarray  # [N, K] int64 datastore rows (-1: fewer found)
  targets: np.ndarray  # [N, K] int32 next tokens (-1 where ids < 0)
  score: np.ndarray  # [N, K] float32: q·k (metric "ip") or -|q - k|² (metric "l2"); -inf where ids < 0
  keys: np.ndarray | None = None  # [N, K, D] float32 (zeros where ids < 0), when asked for


GATHER_FLOATS = 1 << 24  # float32 keys gathered at a time by `retrieve`'s L2 candidates (64 MiB)


def retrieve(ds: Datastore, index: KnnIndex, q_NxD, k: int, *, metric: str, candidates: int = 0,
             with_keys: bool = True) -> Neighbours:
  """Top-k entries by exact inner product (TRIME's similarity) or exact squared L2 distance (kNN-MT's).

  The index is an inner-product index (`datastore.index`): "ip" takes its top-k and re-scores them exactly
  from the stored keys; "l2" takes its top-`candidates` (default 16·k) by inner product and keeps the k
  nearest in L2 among them — the exact L2 neighbours whenever they are among those candidates (always when
  candidates >= the datastore size)."""
  if metric not in ("ip", "l2"):
    raise ConfigError(f"metric must be ip or l2, got {metric!r}")
  q = np.ascontiguousarray(np.asarray(q_NxD, np.float32))
  k = int(min(k, ds.count))
  c = k if metric == "ip" else int(min(max(candidates or 16 * k, k), ds.count))
  import faiss

  threads = faiss.omp_get_max_threads()
  faiss.omp_set_num_threads(1)  # as generation's search: a few hundred queries gain nothing from OpenMP's start-up
  try:
    _, ids_all = index.search(q, c)
  finally:
    faiss.omp_set_num_threads(threads)
  if metric == "ip":  # the index's top-k, re-scored exactly and re-sorted: the datastore's `rescore`
    out = rescore(ds, q, ids_all, with_keys=with_keys)
    out_score, out_ids, out_keys = out if with_keys else (*out, None)
    return Neighbours(out_ids, _targets(ds, out_ids), out_score, out_keys)
  n = len(q)
  out_ids, out_score = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
  out_keys = np.empty((n, k, ds.dimension), np.float32) if with_keys else None
  rows = max(1, GATHER_FLOATS // (c * ds.dimension))
  for a in range(0, n, rows):
    ids = ids_all[a:a + rows]
    keys = ds.gather_keys(ids)
    score = -np.sum((q[a:a + rows][:, None, :] - keys) ** 2, -1)
    score[ids < 0] = -np.inf
    order = np.argsort(-score, axis=1, kind="stable")[:, :k]
    out_ids[a:a + rows] = np.take_along_axis(ids, order, 1)
    out_score[a:a + rows] = np.take_along_axis(score, order, 1)
    if with_keys:
      out_keys[a:a + rows] = np.take_along_axis(keys, order[..., None], 1)
  return Neighbours(out_ids, _targets(ds, out_ids), out_score, out_keys)


def _targets(ds: Datastore, ids_NxK) -> np.ndarray:
  """[N, K] int32 next tokens of entries `ids` (-1 where ids < 0)."""
  return np.where(ids_NxK >= 0, np.asarray(ds.values[np.maximum(ids_NxK, 0)]), -1).astype(np.int32)
