"""Sharded memory distribution and exact on-device external memory vs float64 NumPy, on 8 virtual CPU devices.

  python tests/exact_memory_check.py

Run in a subprocess by tests/test_exact_memory.py (the device count must be set before jax initialises).
Prints one JSON object of measured differences; the test asserts on it.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")  # LLVM -O0: compiles ~2x faster on CPU
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from trime_jax import exact_memory, scoring, sharding  # noqa: E402

N_DEV = 8


def ref_log_probs(logits_NxV, q_NxD, k_MxD, t_M, mask_NxM, tau):
  """float64 log P [N, V] in log space (no overflow however large the similarities)."""
  n, v = logits_NxV.shape
  sim = q_NxD @ k_MxD.T / math.sqrt(q_NxD.shape[1]) / tau
  out = np.empty((n, v))
  for i in range(n):
    terms = [[x] for x in logits_NxV[i]]
    for j in range(len(t_M)):
      if t_M[j] >= 0 and mask_NxM[i, j]:
        terms[t_M[j]].append(sim[i, j])
    row = np.array([np.logaddexp.reduce(x) for x in terms])
    out[i] = row - np.logaddexp.reduce(row)
  return out


def ref_log_terms(q_NxD, y_N, k_MxD, t_M, scales):
  """float64 (lse_neg, lse_pos) [C, N] over all valid memories (t >= 0)."""
  sim = q_NxD @ k_MxD.T / math.sqrt(q_NxD.shape[1])
  neg, pos = np.full((len(scales), len(y_N)), -np.inf), np.full((len(scales), len(y_N)), -np.inf)
  for c, s in enumerate(scales):
    for i in range(len(y_N)):
      p, ng = (t_M >= 0) & (t_M == y_N[i]), (t_M >= 0) & (t_M != y_N[i])
      if p.any():
        pos[c, i] = np.logaddexp.reduce(s * sim[i, p])
      if ng.any():
        neg[c, i] = np.logaddexp.reduce(s * sim[i, ng])
  return neg, pos


def err(a, b):
  """Max |a - b| where both are finite; inf where exactly one of them is infinite."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if (np.isfinite(a) != np.isfinite(b)).any() or (a[~np.isfinite(a)] != b[~np.isfinite(b)]).any():
    return float("inf")
  f = np.isfinite(a)
  return float(np.abs(a[f] - b[f]).max()) if f.any() else 0.0


class _RecordedDatastore:
  """A `Datastore` stand-in over arrays that records the rows of every key read."""

  def __init__(self, keys, values):
    self.count, self.dimension, self.key_reads = len(values), keys.shape[1], []
    self.values = values
    outer = self

    class Keys:
      shape, dtype = keys.shape, keys.dtype

      def __getitem__(self, sl):
        outer.key_reads.append(len(range(*sl.indices(len(keys)))))
        return keys[sl]

    self.keys = Keys()


def check():
  jax.config.update("jax_enable_x64", True)
  mesh = sharding.make_mesh(N_DEV)
  rng = np.random.default_rng(0)
  n, d, v, tau = 6, 5, 7, 0.7
  out = {"devices": jax.device_count()}
  # M = 21: padded to 24 (3 rows per device); M = 5: devices 5-7 hold padding only.
  for m in (21, 5, 40):
    logits = rng.normal(size=(n, v))
    q, k = rng.normal(size=(n, d)) * 3, rng.normal(size=(m, d)) * 3
    t = rng.integers(0, v, m)
    t[1] = -1
    mask = rng.random((n, m)) < 0.6
    mask[2] = False  # a query with no visible memory: the plain softmax
    if m == 40:  # whole shards (5 rows per device) with no visible memory: devices 1 and 4 by mask, 6 by target
      mask[:, 5:10] = mask[:, 20:25] = False
      t[30:35] = -1
      q[3] *= 40  # similarities in the hundreds: a per-bucket max keeps the small buckets' mass
    want = ref_log_probs(logits, q, k, t, mask, tau)
    case = {}
    for chunk in (0, 2):
      got = scoring.sharded_memory_log_probs(logits, q, k, t, mask, mesh=mesh, tau=tau, memory_chunk=chunk)
      case[f"chunk{chunk}"] = err(got, want)
    case["vs_memory_log_probs"] = err(
        scoring.sharded_memory_log_probs(logits, q, k, t, mask, mesh=mesh, tau=tau),
        scoring.memory_log_probs(logits, q, k, t, mask, tau=tau))
    case["no_mask"] = err(scoring.sharded_memory_log_probs(logits, q, k, t, None, mesh=mesh, tau=tau),
                          ref_log_probs(logits, q, k, t, np.ones((n, m), bool), tau))
    case["sums_to_one"] = float(np.abs(np.exp(np.asarray(
        scoring.sharded_memory_log_probs(logits, q, k, t, mask, mesh=mesh, tau=tau))).sum(-1) - 1).max())
    case["no_memory_row_is_softmax"] = err(np.asarray(want)[2], logits[2] - np.logaddexp.reduce(logits[2]))
    # Gradients w.r.t. queries and memory keys equal the single-device function's.
    f = lambda qq, kk: (scoring.sharded_memory_log_probs(logits, qq, kk, t, mask, mesh=mesh, tau=tau,
                                                      memory_chunk=2) * np.arange(v)).sum()
    g = lambda qq, kk: (scoring.memory_log_probs(logits, qq, kk, t, mask, tau=tau) * np.arange(v)).sum()
    case["grad"] = max(err(a, b) for a, b in zip(jax.grad(f, (0, 1))(q, k), jax.grad(g, (0, 1))(q, k)))
    # The on-device datastore: full distribution (generation) and the evaluation's log-sum-exp terms.
    store = exact_memory.from_arrays(k, t, mesh)
    case["store_rows"] = int(store.keys.shape[0])
    # The datastore loader: each device's rows streamed from the file in chunks (here of 2 rows), placed as
    # from_arrays places them, and no read larger than a chunk.
    recorded = _RecordedDatastore(k, t)
    loaded = exact_memory.load_datastore(recorded, mesh, chunk_bytes=2 * d * 8)
    case["load_same_placement"] = bool(loaded.keys.sharding.is_equivalent_to(store.keys.sharding, 2)
                                       and loaded.targets.sharding.is_equivalent_to(store.targets.sharding, 1))
    case["load_equal"] = bool(np.array_equal(np.asarray(loaded.keys), np.asarray(store.keys))
                              and np.array_equal(np.asarray(loaded.targets), np.asarray(store.targets))
                              and loaded.count == store.count)
    case["load_largest_key_read"] = max(recorded.key_reads)
    case["exact_external_log_probs"] = err(exact_memory.exact_external_log_probs(logits, q, store, tau=tau),
                                           ref_log_probs(logits, q, k, t, np.ones((n, m), bool), tau))
    y = rng.integers(0, v, n)
    y[0] = t[0] if m != 5 else 6  # m=5: a target no memory has (empty positive sum)
    scales = (0.25, 1.0, 1 / tau, 4.0)
    want_neg, want_pos = ref_log_terms(q, y, k, t, scales)
    for chunk in (0, 3):
      neg, pos = exact_memory.external_log_terms(q, y, store, scales, memory_chunk=chunk)
      case[f"log_terms_chunk{chunk}"] = max(err(neg, want_neg), err(pos, want_pos))
    case["empty_positive"] = bool(np.isinf(want_pos).any())
    out[f"m{m}"] = case
  return out


if __name__ == "__main__":
  print("RESULT " + json.dumps(check()), flush=True)
