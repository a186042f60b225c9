"""The next-token laws of translation over retrieved datastore entries (one row = one query; K entries per row):
TrimeMT_ext's (`trime_log_probs`, with Appendix A's interpolation) and kNN-MT's (`knn_mt_log_probs`), both the
LM's scorer (`scoring`), and `Distribution`: which law a translation uses, with its settings."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from trime_jax import scoring
from trime_jax.errors import ConfigError

# Both are the LM's scorer (`scoring.trime_log_probs`, `scoring.memory_log_probs`, `scoring.mix`), vmapped over
# rows: each row sees only its own K retrieved entries.
MODES = ("model", "knn_mt", "trime", "trime_release")


def _per_row(fn, logits_NxV, q_NxD, keys_NxKxD, targets_NxK):
  """fn(logits [1, V], q [1, D], keys [K, D], targets [K], mask [1, K]) -> [1, V], over the N rows."""
  one = lambda lg, q, k, t: fn(lg[None], q[None], k, t, jnp.ones((1, t.shape[0]), bool))[0]
  return jax.vmap(one)(logits_NxV, q_NxD, keys_NxKxD, targets_NxK)


@functools.partial(jax.jit, static_argnames=("tau", "knn_lambda", "tau_prime"))
def trime_log_probs(logits_NxV, q_NxD, keys_NxKxD, targets_NxK, *, tau: float, knn_lambda: float = 0.0,
                    tau_prime: float = 1.0):
  """TrimeMT_ext: log P [N, V], P(w) ∝ exp(logit_w) + Σ_{retrieved j, x_j = w} exp(q·k_j / √D / τ); with
  knn_lambda > 0 Appendix A's (1 - λ)·P(τ) + λ·P′(τ′), P′(w) ∝ Σ_{retrieved, x_j = w} exp(q·k_j / √D / τ′)
  (τ′ = `tau_prime`). Entries with target < 0 (fewer than K found) are empty."""
  fn = lambda lg, q, k, t, m: scoring.trime_log_probs(
      lg, q, k, t, m, tau=tau, prime_M=jnp.ones(t.shape, bool), knn_lambda=knn_lambda, tau_prime=tau_prime)
  return _per_row(fn, logits_NxV.astype(jnp.float32), q_NxD.astype(jnp.float32), keys_NxKxD.astype(jnp.float32),
                  targets_NxK)


@functools.partial(jax.jit, static_argnames=("tau",))
def release_trime_log_probs(logits_NxV, q_NxD, keys_NxKxD, targets_NxK, *, tau: float):
  """TrimeMT_ext as the release's decoder combines the model with the datastore (`knn_lambda_type='trime'`:
  machine_translation/fairseq/models/transformer.py, `get_normalized_probs` and the λ before it), not the
  paper's normalised law (`trime_log_probs`): λ = Z_c / (Z_t + Z_c) and
  P(w) = (1 - λ)·p_model(w) + p_kNN(w) = exp(logit_w) / (Z_t + Z_c) + Σ_{retrieved j, x_j = w} exp(s_j) / Z_c,
  s_j = q·k_j / √D / τ (the release's scores over t·√d), Z_t = Σ_w exp(logit_w), Z_c = Σ_j exp(s_j), p_kNN the
  softmax over the K entries. The memory term is not multiplied by λ, so P sums to 2 - λ (the release returns
  its log to beam search as it is; so does this); the paper's law is the same vocabulary term plus λ·p_kNN.
  Rows with no entry keep p_model."""
  logits = logits_NxV.astype(jnp.float32)
  no_vocab = jnp.full_like(logits, -jnp.inf)
  fn = lambda lg, q, k, t, m: scoring.memory_log_weights(lg, q, k, t, m, tau=tau)
  log_mem = _per_row(fn, no_vocab, q_NxD.astype(jnp.float32), keys_NxKxD.astype(jnp.float32), targets_NxK)
  log_zc = jax.nn.logsumexp(log_mem, -1, keepdims=True)  # [N, 1]: Σ_j exp(s_j)
  log_zt = jax.nn.logsumexp(logits, -1, keepdims=True)
  has = (targets_NxK >= 0).any(-1, keepdims=True)
  safe_zc = jnp.where(has, log_zc, 0.0)
  mixed = jnp.logaddexp(logits - jnp.logaddexp(log_zt, safe_zc), log_mem - safe_zc)
  return jnp.where(has, mixed, logits - log_zt)


def l2_as_inner_product(q_NxD, keys_NxKxD):
  """(q′ [N, D+1], k′ [N, K, D+1]) with q′·k′ = q·k - |k|²/2 = (|q|² - |q - k|²) / 2: a softmax over 2·q′·k′/T
  is the softmax over -|q - k|²/T (|q|² is constant per row), which `scoring.memory_log_probs` computes as its
  q′·k′ / (√(D+1)·τ) with τ = T / (2·√(D+1))."""
  q = jnp.concatenate([q_NxD, jnp.ones(q_NxD.shape[:-1] + (1,), q_NxD.dtype)], -1)
  k = jnp.concatenate([keys_NxKxD, -0.5 * jnp.sum(keys_NxKxD ** 2, -1, keepdims=True)], -1)
  return q, k


@functools.partial(jax.jit, static_argnames=("knn_mt_temperature", "knn_lambda"))
def knn_mt_log_probs(logits_NxV, q_NxD, keys_NxKxD, targets_NxK, *, knn_mt_temperature: float, knn_lambda: float):
  """kNN-MT (Khandelwal et al. 2021): log[(1 - λ)·p_model + λ·p_kNN] (λ = `knn_lambda`), p_kNN(w) ∝
  Σ_{retrieved j, x_j = w} exp(-|q - k_j|² / T) (T = `knn_mt_temperature`) over the K retrieved entries; rows
  with no entry keep p_model."""
  logits = logits_NxV.astype(jnp.float32)
  q, k = l2_as_inner_product(q_NxD.astype(jnp.float32), keys_NxKxD.astype(jnp.float32))
  tau = knn_mt_temperature / (2 * math.sqrt(q.shape[-1]))
  no_vocab = jnp.full_like(logits, -jnp.inf)  # p_kNN is memories only
  fn = lambda lg, qq, kk, t, m: scoring.memory_log_probs(lg, qq, kk, t, m, tau=tau)
  log_knn = _per_row(fn, no_vocab, q, k, targets_NxK)
  has = (targets_NxK >= 0).any(-1, keepdims=True)
  return scoring.mix(jax.nn.log_softmax(logits, -1), log_knn, has, knn_lambda)


@dataclasses.dataclass(frozen=True)
class Distribution:
  """The next-token law: model | knn_mt (k, knn_mt_temperature T, knn_lambda λ: the weight of p_kNN) | trime
  (k, tau τ, + Appendix A's interpolation: knn_lambda λ, the weight of P′, and tau_prime τ′; λ 0 = none) |
  trime_release (k, tau τ: the release's decoder, `release_trime_log_probs`; its README's TrimeMT_ext command is
  k = 16, τ = 15; no interpolation)."""

  mode: str = "model"
  k: int = 64
  knn_mt_temperature: float = 10.0  # kNN-MT's T of exp(-|q - k|² / T)
  knn_lambda: float | None = None  # weight of the retrieved distribution; None: 0.5 for knn_mt, 0 (none) for trime
  tau: float = 1.0
  tau_prime: float = 1.0
  candidates: int = 0  # knn_mt: inner-product candidates re-ranked by L2 (0: 16·k)

  def __post_init__(self):
    if self.mode not in MODES:
      raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
    if self.k < 1:
      raise ConfigError(f"k must be >= 1, got {self.k}")
    if self.knn_lambda is None:
      object.__setattr__(self, "knn_lambda", 0.5 if self.mode == "knn_mt" else 0.0)
    if not (self.knn_mt_temperature > 0 and self.tau > 0 and self.tau_prime > 0):
      raise ConfigError("knn_mt_temperature, tau and tau_prime must be > 0")
    if not 0 <= self.knn_lambda <= 1 or (self.mode == "trime" and self.knn_lambda == 1):
      raise ConfigError(f"knn_lambda must be in [0, 1] ([0, 1) for trime), got {self.knn_lambda}")
    if self.mode == "trime_release" and self.knn_lambda:
      raise ConfigError("trime_release is the release's decoder, which has no interpolation: knn_lambda must be 0 "
                        "(Appendix A's interpolation: mode trime)")

  @property
  def metric(self) -> str:
    return "l2" if self.mode == "knn_mt" else "ip"

  @classmethod
  def from_tuned(cls, path: str, mode: str) -> "Distribution":
    """The setting `trime_jax.launch.translate --tune` chose for `mode` (tuned.json): model | knn_mt | trime (TRIME with
    the datastore, no interpolation) | trime_interp (+ Appendix A's interpolation) | trime_best (the better of
    the two on valid BLEU)."""
    import json

    try:
      with open(path) as f:
        chosen = json.load(f)["chosen"]
    except (OSError, ValueError, KeyError) as e:
      raise ConfigError(f"cannot read tuned settings {path}: {e}") from None
    options = [m for m in (("trime", "trime_interp") if mode == "trime_best" else (mode,)) if m in chosen]
    if not options:
      raise ConfigError(f"{path} has no tuned setting for mode {mode}")
    best = max(options, key=lambda m: chosen[m]["bleu"])  # ties: TRIME alone (listed first)
    return cls.from_setting(chosen[best]["setting"])

  @classmethod
  def from_setting(cls, setting: dict) -> "Distribution":
    """A Distribution from its stored fields (`dataclasses.asdict`: tuned.json, <split>.<mode>.json's
    "setting"). Settings written before issue 34's renames (temperature, lam, interp_lambda, interp_tau) read
    under the new names: the λ that acted (lam for knn_mt, interp_lambda for trime) becomes knn_lambda."""
    s = dict(setting)
    old_lambdas = {name: s.pop(name) for name in ("lam", "interp_lambda") if name in s}
    for old, new in (("temperature", "knn_mt_temperature"), ("interp_tau", "tau_prime")):
      if old in s:
        s.setdefault(new, s.pop(old))
    if old_lambdas and "knn_lambda" not in s:
      s["knn_lambda"] = old_lambdas.get("lam" if s.get("mode") == "knn_mt" else "interp_lambda")
    try:
      return cls(**s)
    except TypeError as e:  # a field this version does not know
      raise ConfigError(f"not a translation setting: {setting} ({e})") from None
