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
  # exact scores of the index's candidates from the stored keys, re-sorted (stable): the datastore's `rescore`;
  # "l2" keeps the k nearest of its c candidates and gathers those k keys again (not all c: [N, 16·k, D] floats)
  same = with_keys and c == k  # the keys from the scores' own gather
  score, ids, *keys = rescore(ds, q, ids_all, metric="inner_product" if metric == "ip" else "l2", with_keys=same)
  score, ids = score[:, :k], ids[:, :k]
  keys = keys[0] if same else ds.gather_keys(ids) if with_keys else None
  return Neighbours(ids, _targets(ds, ids), score, keys)


def _targets(ds: Datastore, ids_NxK) -> np.ndarray:
  """[N, K] int32 next tokens of entries `ids` (-1 where ids < 0)."""
  return np.where(ids_NxK >= 0, np.asarray(ds.values[np.maximum(ids_NxK, 0)]), -1).astype(np.int32)
