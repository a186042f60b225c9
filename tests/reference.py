"""Float64 NumPy reference for the TRIME objective, written from the paper's equations (no JAX).

P(w|c) ∝ exp(E_w·f(c)) + Σ_{(c_j,x_j) ∈ M, x_j = w} exp(g(c)·g(c_j)/√d/τ)
"""

import numpy as np


def logsumexp(x):
  x = np.asarray(x, np.float64)
  m = x.max()
  return m + np.log(np.exp(x - m).sum())


def distribution(logits_V, key_D, memory_keys_MxD, memory_targets_M, visible_M, temperature=1.0):
  """The memory-augmented next-token distribution P(·|c) [V] for one query, in float64."""
  logits = np.asarray(logits_V, np.float64)
  d = key_D.shape[-1]
  p = np.exp(logits - logits.max())
  scale = np.exp(-logits.max())
  for j in range(len(memory_targets_M)):
    if visible_M[j] and memory_targets_M[j] >= 0:
      sim = float(np.dot(np.float64(key_D), np.float64(memory_keys_MxD[j]))) / np.sqrt(d) / temperature
      p[memory_targets_M[j]] += np.exp(sim) * scale
  return p / p.sum()


def memory_nll(logits_NxV, keys_NxD, targets_N, mkeys_MxD, mtargets_M, mask_NxM, temperature=1.0):
  """nll_i = log(Σ_v e^{logit} + Σ_vis e^{sim}) - log(e^{logit_y} + Σ_{vis, x_j = y} e^{sim}); 0 for padding."""
  n = len(targets_N)
  out = np.zeros(n)
  d = keys_NxD.shape[-1]
  for i in range(n):
    y = targets_N[i]
    if y < 0:
      continue
    sims = np.float64(mkeys_MxD) @ np.float64(keys_NxD[i]) / np.sqrt(d) / temperature
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
              temperature=1.0, documents_BxL=None):
  b, l, v = logits_BxLxV.shape
  mask = batch_mask(memory, targets_BxL, consecutive_segments, drop_local, documents_BxL)
  flat_t = targets_BxL.reshape(-1)
  flat_k = keys_BxLxD.reshape(b * l, -1)
  return memory_nll(logits_BxLxV.reshape(b * l, v), flat_k, flat_t, flat_k, flat_t, mask,
                    temperature).reshape(b, l)
