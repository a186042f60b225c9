"""External memory at evaluation: top-K retrieval from a FAISS index over a datastore, for each scored token.

One search per scored token (the original searched every position of each block, context included, and
twice). The retrieved entries are scored by the index's approximate inner product or, with `exact=True`,
re-scored exactly from the stored float16 keys. Similarities follow the training objective:
sim = g(c)·k_j / √D (τ, τ′ and θ are applied by the evaluator).

kNN-LM as the original release computes it (`knnlm_metric="l2"`, config eval.knnlm_metric): the kNN-LM
families' K entries come from a second search, of the datastore's L2 index (`<datastore>/index_l2.faiss`), and
are scored sim = -|g(c) - k_j|² recomputed from the stored float16 keys (no √D; fairseq/knnlm.py `dist_func`),
always exactly (`rescore(..., metric="l2")`, the path `exact=True` takes for the inner product);
`retrieve_knnlm`. The TRIME families keep the inner-product search.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from typing import Callable

import numpy as np

from trime_jax import scoring
from trime_jax.datastore import Datastore, KnnIndex, rescore
from trime_jax.datastore.index import default_index_path
from trime_jax.errors import CheckpointError, ConfigError

# The Python API (trime_jax.api) sends ExternalMemory's line here instead of stdout (`log=logger.info`): a library
# call should not print; the CLIs keep the default, `print_line`.
logger = logging.getLogger(__name__)

RETRIEVAL_KS = (1, 8, 64, 1024)
# eval.knnlm_metric: the kNN-LM families' similarity: "ip" (g·k_j/√D from the one inner-product search, ours) |
# "l2" (-|g - k_j|² over the top-K of an L2 index, the original release's kNN-LM)
KNNLM_METRICS = ("ip", "l2")
BUILD_L2_INDEX = ("rerun the datastore's `python -m trime_jax.launch.build_datastore` command (the same --config, "
                  "--checkpoint and --out: its keys are reused) with --index_metric=l2 and without --overwrite")


def check_knnlm_metric(metric) -> str:
  """`metric` if one of KNNLM_METRICS (eval.knnlm_metric), else one ConfigError."""
  if metric not in KNNLM_METRICS:
    raise ConfigError(f"eval.knnlm_metric must be one of {KNNLM_METRICS}, got {metric!r}")
  return str(metric)


def retrieval_ks(k: int) -> tuple:
  """The ranks of RETRIEVAL_KS that a top-`k` search can tell apart: those below `k`, then `k` itself. With
  k = 100 a "top1024" would count the top 100 under another name, so it becomes "top100"."""
  return tuple(sorted({min(r, int(k)) for r in RETRIEVAL_KS}))
# Frequency buckets of the paper's Table "bucket_ppl": occurrences of the target word in the development set
# (the paper: "according to their frequency on the development set"; eval.frequency_split picks the split).
FREQ_BUCKETS = ((10_000, None, ">10k"), (1_000, 10_000, "1k-10k"), (100, 1_000, "100-1k"), (10, 100, "10-100"),
                (None, 10, "<=10"))


@dataclasses.dataclass
class Retrieved:
  """Top-K external memories of a set of queries (rows), best first."""

  sim: np.ndarray  # [N, K] float32 g·k / √D (`retrieve_knnlm` with knnlm_metric="l2": -|g - k|²)
  targets: np.ndarray  # [N, K] int32 next token of each memory (-1 where fewer than K exist)


def print_line(msg: str) -> None:
  """The command lines' `log`: one line on stdout, flushed (a log file shows it before a long search)."""
  print(msg, flush=True)


class ExternalMemory:
  """A datastore + its FAISS index, checked against the model that queries it. `log` hears one line naming the
  index and its size (default: stdout, as the command lines show it; the Python API passes `logger.info`).
  Paths may be strings or path-like objects. knnlm_metric="l2" also opens the datastore's L2 index
  (`<datastore>/index_l2.faiss`, or `knnlm_index_path`) for `retrieve_knnlm`: a ConfigError naming the command
  that builds it where it is missing."""

  def __init__(self, datastore_dir: str, *, index_path: str = "", checkpoint_dir: str = "", k: int = 1024,
               nprobe: int = 32, exact: bool = False, gpu: bool = False,
               log: Callable[[str], None] = print_line, knnlm_metric: str = "ip", knnlm_index_path: str = ""):
    datastore_dir, index_path = os.fspath(datastore_dir), os.fspath(index_path)
    checkpoint_dir = os.fspath(checkpoint_dir)
    self.datastore = Datastore(datastore_dir)
    if checkpoint_dir:
      self.datastore.check_checkpoint(checkpoint_dir)
    path = index_path or default_index_path(datastore_dir)
    self.index = KnnIndex.load(path, datastore=self.datastore, nprobe=nprobe, gpu=gpu)
    if k < 1:
      raise ConfigError(f"eval.knn_k must be >= 1, got {k}")
    self.knnlm_metric, self.l2_index = check_knnlm_metric(knnlm_metric), None
    if knnlm_metric == "l2":
      l2_path = os.fspath(knnlm_index_path) or default_index_path(datastore_dir, "l2")
      if not os.path.exists(l2_path):
        raise ConfigError(f"eval.knnlm_metric=l2: the datastore {datastore_dir} has no L2 index ({l2_path} not "
                          f"found): {BUILD_L2_INDEX}")
      self.l2_index = KnnIndex.load(l2_path, datastore=self.datastore, nprobe=nprobe, gpu=gpu, metric="l2")
    self.k, self.k_asked, self.log = int(min(k, self.datastore.count)), int(k), log
    ds = self.datastore
    kind = "exact IndexFlatIP" if self.index.kind == "flat" else f"IVF-PQ (nprobe={nprobe})"
    log(f"external memory: {kind} index {path} over {ds.count:,} × {ds.dimension} keys, K={self.k}"
        + (f" (K={k} asked for, more than the datastore holds)" if k > self.k else "")
        + (f" (every search scans all {ds.count:,} keys; trime_jax.launch.build_datastore --index=ivfpq is faster)"
           if self.index.kind == "flat" and ds.count * ds.dimension > 1 << 24 else ""))
    if self.l2_index is not None:
      log(f"external memory: kNN-LM by L2 (eval.knnlm_metric=l2): "
          f"{'exact IndexFlatL2' if self.l2_index.kind == 'flat' else f'IVF-PQ (nprobe={nprobe})'} index "
          f"{self.l2_index.path}, -|q - k|² recomputed from the stored keys")
    self.exact = exact
    self.search_seconds = 0.0
    self.queries = 0

  @property
  def dimension(self) -> int:
    return self.datastore.dimension

  def with_k(self, k: int) -> "ExternalMemory":
    """This datastore and index (shared, not opened again) retrieving `k` entries per query (at most the
    datastore's count, said in a line as the first opening says it), with search counters of its own; `self` when
    that is its K already."""
    if k < 1:
      raise ConfigError(f"eval.knn_k must be >= 1, got {k}")
    asked, k = int(k), int(min(k, self.datastore.count))
    if asked > k and asked != self.k_asked:
      self.log(f"external memory: K={k} (K={asked} asked for, more than the datastore holds)")
    if k == self.k:
      return self
    other = copy.copy(self)
    other.k, other.k_asked, other.search_seconds, other.queries = k, asked, 0.0, 0
    return other

  def retrieve(self, queries_NxD) -> Retrieved:
    q = np.ascontiguousarray(np.asarray(queries_NxD, np.float32))
    if q.ndim != 2 or q.shape[1] != self.dimension:
      raise CheckpointError(f"queries of dimension {q.shape[-1]} cannot search a datastore of dimension "
                            f"{self.dimension}")
    t0 = time.perf_counter()
    scores, ids = self.index.search(q, self.k)
    if self.exact:
      scores, ids = rescore(self.datastore, q, ids)
    self.search_seconds += time.perf_counter() - t0
    self.queries += len(q)
    return self._retrieved(scores * scoring.static_scale(self.dimension, 1.0), ids)  # q·k/√D

  def retrieve_knnlm(self, queries_NxD) -> Retrieved | None:
    """The kNN-LM families' own entries (knnlm_metric="l2"): the top-K of the L2 index, sim = -|q - k|²
    recomputed from the stored keys (the original's kNN-LM: its faiss_metric_type l2 with no knn_sim_func);
    None with knnlm_metric="ip" (the kNN-LM families read `retrieve`'s entries)."""
    if self.l2_index is None:
      return None
    q = np.ascontiguousarray(np.asarray(queries_NxD, np.float32))
    t0 = time.perf_counter()
    _, ids = self.l2_index.search(q, self.k)
    scores, ids = rescore(self.datastore, q, ids, metric="l2")  # eval.knn_exact's path, on -|q - k|²
    self.search_seconds += time.perf_counter() - t0
    return self._retrieved(scores, ids)

  def _retrieved(self, scores, ids) -> Retrieved:
    valid = ids >= 0
    targets = np.where(valid, np.asarray(self.datastore.values[np.where(valid, ids, 0)]), -1).astype(np.int32)
    sim = np.where(valid, scores, 0.0).astype(np.float32)
    return Retrieved(sim, targets)


def retrieval_hits(retrieved_targets_NxK, targets_N, ks=RETRIEVAL_KS) -> np.ndarray:
  """[len(ks)] number of queries whose target is among the next tokens of their top-k memories."""
  match = retrieved_targets_NxK == np.asarray(targets_N)[:, None]
  first = np.where(match.any(1), match.argmax(1), np.iinfo(np.int64).max)
  return np.array([(first < k).sum() for k in ks], np.int64)


def frequency_buckets(tokens, vocab_size: int) -> np.ndarray:
  """[V] bucket index (into FREQ_BUCKETS) of every word, by its count in `tokens` (a split's)."""
  counts = np.zeros(vocab_size, np.int64)
  step = 1 << 24  # np.bincount casts to intp: by chunks, not a 64-bit copy of a whole training split
  for a in range(0, len(tokens), step):
    counts += np.bincount(np.asarray(tokens[a:a + step]), minlength=vocab_size)
  bucket = np.zeros(vocab_size, np.int32)
  for i, (lo, hi, _) in enumerate(FREQ_BUCKETS):
    sel = np.ones(vocab_size, bool)
    if lo is not None:
      sel &= counts > lo
    if hi is not None:
      sel &= counts <= hi
    bucket[sel] = i
  return bucket
