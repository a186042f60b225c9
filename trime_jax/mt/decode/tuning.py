"""Tuning on teacher-forced valid targets: one retrieval of the top max(K) per target token, every K <= it and
every (τ, λ, T) read from that one pass (`evaluate.point_nlls`, the LM evaluator's scorer)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from trime_jax import evaluate
from trime_jax import scoring
from trime_jax.mt.decode.distributions import Distribution
from trime_jax.mt.decode.retrieval import Neighbours, retrieve

KS = (1, 2, 4, 8, 16, 32, 64)
KNN_T_GRID = (1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)  # knn_mt_temperature: kNN-MT's T of exp(-|q - k|² / T)


@dataclasses.dataclass
class TunePass:
  """What one teacher-forced pass over the valid targets keeps (M target tokens)."""

  stats: scoring.VocabStats  # [M]
  targets: np.ndarray  # [M]
  ip: Neighbours  # top-max(K) by inner product (no keys)
  l2: Neighbours  # top-max(K) by L2 (no keys)
  dimension: int
  candidates: int = 0  # the inner-product candidates l2 was re-ranked from (each K's top K by L2 among them)


def tune_pass(graphdef, params, pairs, ds, index, *, k_max: int = 64, batch_tokens: int = 4096,
              candidates: int = 0, modes=("knn_mt", "trime", "trime_release")) -> TunePass:
  """The teacher-forced pass over `pairs` (the valid split): every target token's vocabulary statistics and its
  top-`k_max` entries by inner product (TRIME) and by L2 (kNN-MT), retrieved once."""
  from trime_jax.mt import datastore as mt_datastore

  stats, targets, ip, l2 = [], [], [], []
  for _, batch in mt_datastore.pair_batches(pairs.src, pairs.tgt, batch_tokens=batch_tokens):
    logits, g = mt_datastore.forced_forward(graphdef, params, jnp.asarray(batch["src"]), jnp.asarray(batch["prev"]))
    t = batch["targets"]
    sel = t >= 0
    logits, g, t = np.asarray(logits)[sel], np.asarray(g)[sel], t[sel]
    st = scoring.vocab_stats(jnp.asarray(logits), jnp.asarray(t))
    stats.append((np.asarray(st.log_normalizer), np.asarray(st.target_logit)))
    targets.append(t)
    empty = lambda dtype: np.zeros((len(t), 0), dtype)
    none = Neighbours(empty(np.int64), empty(np.int32), empty(np.float32))
    ip.append(retrieve(ds, index, g, k_max, metric="ip", with_keys=False)
              if {"trime", "trime_release"} & set(modes) else none)
    l2.append(retrieve(ds, index, g, k_max, metric="l2", candidates=candidates, with_keys=False)
              if "knn_mt" in modes else none)
  cat = lambda xs, f: np.concatenate([getattr(x, f) for x in xs])
  nb = lambda xs: Neighbours(cat(xs, "ids"), cat(xs, "targets"), cat(xs, "score"))
  return TunePass(scoring.VocabStats(jnp.asarray(np.concatenate([s[0] for s in stats])),
                                  jnp.asarray(np.concatenate([s[1] for s in stats]))),
                  np.concatenate(targets), nb(ip), nb(l2), ds.dimension, candidates or 16 * k_max)


def _setting(point: evaluate.Point, k: int, candidates: int = 0) -> Distribution:
  if point.family == "none":
    return Distribution("model")
  if point.family == "knnlm":  # decoded from the candidates it was tuned with (else 16·k: other neighbours)
    return Distribution("knn_mt", k=k, knn_mt_temperature=1.0 / point.knn_theta, knn_lambda=point.knn_lambda,
                        candidates=candidates)
  if point.family == "trime":
    return Distribution("trime", k=k, tau=point.tau)
  return Distribution("trime", k=k, tau=point.tau, knn_lambda=point.knn_lambda, tau_prime=point.tau_prime)


def _nlls(tp: TunePass, points, k: int, metric: str):
  """[P] mean nll per target token of each point, with the top-k retrieved entries."""
  nb = tp.ip if metric == "ip" else tp.l2
  # TRIME: q·k/√D (the scorer's scale); kNN-MT: -|q - k|² as retrieved
  sim = nb.score[:, :k] * (scoring.static_scale(tp.dimension, 1.0) if metric == "ip" else 1.0)
  sim = np.where(np.isfinite(sim), sim, 0.0)
  tgt = jnp.asarray(tp.targets)[None]
  blk = evaluate.external_block(jnp.asarray(sim)[None], jnp.asarray(nb.targets[:, :k])[None], tgt)
  stats = scoring.VocabStats(tp.stats.log_normalizer[None], tp.stats.target_logit[None])
  return np.asarray(evaluate.point_nlls(stats, tgt, [], blk, points)).reshape(len(points), -1).mean(-1)


def _release_nlls(tp: TunePass, taus, k: int) -> np.ndarray:
  """[len(taus)] mean nll per target token under the release's decoder law (`release_trime_log_probs`), each
  token's P divided by its total mass 2 - λ so that settings compare as distributions (the decoder itself uses
  the unnormalised P; the BLEU of the valid decodes chooses among the best of these). float64."""
  sim = np.asarray(tp.ip.score[:, :k], np.float64) * scoring.static_scale(tp.dimension, 1.0)  # q·k/√D
  tgt = np.asarray(tp.ip.targets[:, :k])
  valid = (tgt >= 0) & np.isfinite(sim)
  has = valid.any(-1)
  log_zt = np.asarray(tp.stats.log_normalizer, np.float64)
  logit = np.asarray(tp.stats.target_logit, np.float64)
  own = valid & (tgt == np.asarray(tp.targets)[:, None])
  out = []
  for tau in taus:
    s = np.where(valid, sim / tau, -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
      log_zc = np.logaddexp.reduce(s, axis=-1)
      log_own = np.logaddexp.reduce(np.where(own, s, -np.inf), axis=-1)
      log_all = np.logaddexp(log_zt, log_zc)
      lam = np.exp(log_zc - log_all)
      log_p = np.logaddexp(logit - log_all, log_own - log_zc) - np.log(2.0 - lam)
    out.append(np.where(has, log_p, logit - log_zt))
  return -np.stack(out).mean(-1)


def tune(tp: TunePass, *, modes=("knn_mt", "trime", "trime_release"), ks=KS, train_tau: float = 1.0) -> list[dict]:
  """Rows {mode, k, params, nll} for every K and grid point (kNN-MT: T × λ; TRIME: τ, then Appendix A's
  λ × τ′ at each K's best τ; the release's TRIME decoder: τ), plus the model alone; sorted by nll within each
  mode. The τ grid is the LM
  evaluator's together with it scaled by the training τ `train_tau` (the original MT model trains at
  τ = 10)."""
  metric = "ip" if tp.ip.score.shape[1] else "l2"  # the model alone ignores the entries of either
  taus = sorted(set(evaluate.TAU_GRID) | {t * train_tau for t in evaluate.TAU_GRID})  # trime and trime_release
  rows = [{"mode": "model", "k": 0, "setting": Distribution("model"),
           "nll": float(_nlls(tp, [evaluate.NONE], 1, metric)[0])}]
  for k in ks:
    if k > tp.ip.score.shape[1] and k > tp.l2.score.shape[1]:
      continue
    if "knn_mt" in modes:
      pts = [evaluate.Point("knnlm", knn_lambda=lam, knn_theta=1.0 / t)
             for t in KNN_T_GRID for lam in evaluate.LAMBDA_GRID]
      rows += [{"mode": "knn_mt", "k": k, "setting": _setting(p, k, tp.candidates), "nll": float(v)}
               for p, v in zip(pts, _nlls(tp, pts, k, "l2"))]
    if "trime" in modes:
      pts = [evaluate.Point("trime", tau=t) for t in taus]
      nll = _nlls(tp, pts, k, "ip")
      rows += [{"mode": "trime", "k": k, "setting": _setting(p, k), "nll": float(v)} for p, v in zip(pts, nll)]
      tau = pts[int(np.argmin(nll))].tau
      pts = [evaluate.Point("interp", tau=tau, tau_prime=tp_, knn_lambda=lam, interp_memory="external")
             for tp_ in evaluate.TAU_PRIME_GRID for lam in evaluate.LAMBDA_GRID]
      rows += [{"mode": "trime_interp", "k": k, "setting": _setting(p, k), "nll": float(v)}
               for p, v in zip(pts, _nlls(tp, pts, k, "ip"))]
    if "trime_release" in modes:
      rows += [{"mode": "trime_release", "k": k, "setting": Distribution("trime_release", k=k, tau=t), "nll": float(v)}
               for t, v in zip(taus, _release_nlls(tp, taus, k))]
  return sorted(rows, key=lambda r: (r["mode"], r["nll"]))
