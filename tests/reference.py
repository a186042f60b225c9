"""Float64 NumPy reference for the TRIME objective, written from the paper's equations (no JAX).

P(w|c) ∝ exp(E_w·f(c)) + Σ_{(c_j,x_j) ∈ M, x_j = w} exp(g(c)·g(c_j)/√d/τ)
"""

import numpy as np


def logsumexp(x):
  x = np.asarray(x, np.float64)
  m = x.max()
  return m + np.log(np.exp(x - m).sum())


def distribution(logits_V, key_D, memory_keys_MxD, memory_targets_M, visible_M, tau=1.0):
  """The memory-augmented next-token distribution P(·|c) [V] for one query, in float64."""
  logits = np.asarray(logits_V, np.float64)
  d = key_D.shape[-1]
  p = np.exp(logits - logits.max())
  scale = np.exp(-logits.max())
  for j in range(len(memory_targets_M)):
    if visible_M[j] and memory_targets_M[j] >= 0:
      sim = float(np.dot(np.float64(key_D), np.float64(memory_keys_MxD[j]))) / np.sqrt(d) / tau
      p[memory_targets_M[j]] += np.exp(sim) * scale
  return p / p.sum()


def memory_nll(logits_NxV, keys_NxD, targets_N, mkeys_MxD, mtargets_M, mask_NxM, tau=1.0):
  """nll_i = log(Σ_v e^{logit} + Σ_vis e^{sim}) - log(e^{logit_y} + Σ_{vis, x_j = y} e^{sim}); 0 for padding."""
  n = len(targets_N)
  out = np.zeros(n)
  d = keys_NxD.shape[-1]
  for i in range(n):
    y = targets_N[i]
    if y < 0:
      continue
    sims = np.float64(mkeys_MxD) @ np.float64(keys_NxD[i]) / np.sqrt(d) / tau
    vis = mask_NxM[i] & (mtargets_M >= 0)
    log_z = logsumexp(np.concatenate([logits_NxV[i], sims[vis]]))
    log_p = logsumexp(np.concatenate([[logits_NxV[i][y]], sims[vis & (mtargets_M == y)]]))
    out[i] = log_z - log_p
  return out


def batch_mask(memory, targets_BxL, consecutive_segments=1, drop_local=False, documents_BxL=None):
  """[BL, BL] visibility for a batch that is its own memory, by explicit loops over the definitions.

  drop_local: a bool for every row or one per row (the query's row decides). documents_BxL: a long-term
  memory token sees only earlier tokens of its own document within its run.
  """
  b, l = targets_BxL.shape
  drop = np.broadcast_to(np.asarray(drop_local, bool), (b,))
  docs = np.zeros((b, l), int) if documents_BxL is None else np.asarray(documents_BxL)
  mask = np.zeros((b * l, b * l), bool)
  for bi in range(b):
    for t in range(l):
      for bj in range(b):
        for s in range(l):
          if targets_BxL[bj, s] < 0:
            continue
          if memory == "local":
            ok = bi == bj and s < t
          elif memory == "long":
            m = consecutive_segments
            same_run = bi // m == bj // m
            ok = same_run and docs[bi, t] == docs[bj, s] and (bj < bi or (bj == bi and s < t))
          elif memory == "ext":
            ok = bj != bi or (not drop[bi] and s < t)
          elif memory == "none":
            ok = False
          else:
            raise ValueError(memory)
          mask[bi * l + t, bj * l + s] = ok
  return mask


def trime_nll(logits_BxLxV, keys_BxLxD, targets_BxL, memory, consecutive_segments=1, drop_local=False,
              tau=1.0, documents_BxL=None):
  b, l, v = logits_BxLxV.shape
  mask = batch_mask(memory, targets_BxL, consecutive_segments, drop_local, documents_BxL)
  flat_t = targets_BxL.reshape(-1)
  flat_k = keys_BxLxD.reshape(b * l, -1)
  return memory_nll(logits_BxLxV.reshape(b * l, v), flat_k, flat_t, flat_k, flat_t, mask,
                    tau).reshape(b, l)


def trime_key_grad(logits_BxLxV, keys_BxLxD, targets_BxL, memory, consecutive_segments=1, drop_local=False,
                   tau=1.0, key_grad_rows_BxB=None, weights_BxL=None):
  """d Σ_i w_i·nll_i / d keys `[B, L, D]` in float64, from the analytic derivative of `trime_nll`.

  d nll_i / d s_ij = vis_ij·e^{s_ij}/Z_i − pos_ij·e^{s_ij}/P_i, s_ij = q_i·q_j·scale. Token t's key is query
  and memory at once: dq_t = Σ_j G_tj q_j·scale, dk_t = Σ_i G_it·q_i·scale. key_grad_rows_BxB (optional bool):
  the memory part dk_t takes query i only where key_grad_rows[row(i), row(t)] (the original's cut of memory-key
  gradients at GPU boundaries); None: every query.
  """
  b, l, v = logits_BxLxV.shape
  n = b * l
  mask = batch_mask(memory, targets_BxL, consecutive_segments, drop_local)
  t = targets_BxL.reshape(-1)
  q = np.float64(keys_BxLxD).reshape(n, -1)
  lg = np.float64(logits_BxLxV).reshape(n, v)
  w = np.ones(n) if weights_BxL is None else np.float64(weights_BxL).reshape(-1)
  scale = 1.0 / np.sqrt(q.shape[1]) / tau
  s = q @ q.T * scale
  g = np.zeros((n, n))
  for i in range(n):
    if t[i] < 0:
      continue
    vis = mask[i] & (t >= 0)
    pos = vis & (t == t[i])
    log_z = logsumexp(np.concatenate([lg[i], s[i][vis]]))
    log_p = logsumexp(np.concatenate([[lg[i][t[i]]], s[i][pos]]))
    g[i, vis] += w[i] * np.exp(s[i, vis] - log_z)
    g[i, pos] -= w[i] * np.exp(s[i, pos] - log_p)
  rows = np.repeat(np.arange(b), l)
  cut = np.ones((n, n), bool) if key_grad_rows_BxB is None else np.asarray(key_grad_rows_BxB)[rows][:, rows]
  return ((g @ q + (g * cut).T @ q) * scale).reshape(keys_BxLxD.shape)


def same_group_rows(b, group_rows):
  """`[B, B]` bool: rows in the same group of `group_rows` consecutive rows (memory_grad_group_rows)."""
  r = np.arange(b) // group_rows
  return r[:, None] == r[None, :]


class RowByRowSearch:
  """A stand-in for `knn.ExternalMemory`: the exact top-k of (keys, values) computed query by query in float64, so
  that its answer to a query does not depend on which other queries share the call (FAISS's can: its exact index
  rounds large calls, computed with BLAS, otherwise, and by the query's row in the call); `calls` records each
  call's number of queries. `row_noise=e` adds e × (the query's row in its call) to its inner products: a search
  whose answer depends on the call, as such rounding does."""

  def __init__(self, keys_NxD, values_N, k: int, row_noise: float = 0.0):
    self.keys, self.values = np.asarray(keys_NxD, np.float64), np.asarray(values_N)
    self.k, self.dimension, self.search_seconds, self.calls = k, self.keys.shape[1], 0.0, []
    self.row_noise = row_noise

  def retrieve(self, queries_QxD):
    from trime_jax import knn
    self.calls.append(len(queries_QxD))
    sim = np.stack([self.keys @ q + self.row_noise * i for i, q in enumerate(np.asarray(queries_QxD, np.float64))])
    order = np.argsort(-sim, axis=1, kind="stable")[:, :self.k]
    return knn.Retrieved((np.take_along_axis(sim, order, 1) / np.sqrt(self.dimension)).astype(np.float32),
                         self.values[order].astype(np.int32))
