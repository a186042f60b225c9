"""Sampling the next token: `Sampling` (its options) and pure functions of log-probabilities (tests compare them
with NumPy references). A key per (seed, row, step): a row's samples do not depend on its batch's other rows'
contents, only on its index."""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from trime_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 1.0  # 0: greedy (argmax)
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  seed: int = 0  # a 32-bit signed integer: the jitted key derivation takes it as int32

  def __post_init__(self):
    # Checked here, where every caller (the API, the CLI, a script) builds one: a wrong type would otherwise
    # fail deep inside a jitted function, without naming the argument.
    if not _real(self.temperature) or not 0 <= self.temperature < float("inf"):  # inf: uniform noise
      raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
    if not _integer(self.top_k) or self.top_k < 0:
      raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
    if not _real(self.top_p) or not 0 < self.top_p <= 1:
      raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if not _integer(self.seed) or not -2**31 <= self.seed < 2**31:
      raise ConfigError(f"seed must be an integer in [-2**31, 2**31) (a 32-bit PRNG seed), got {self.seed!r}")
    # plain Python numbers: the spec is a static jit argument, hashed and compared by value
    for name, cast in (("temperature", float), ("top_k", int), ("top_p", float), ("seed", int)):
      object.__setattr__(self, name, cast(getattr(self, name)))

  def traced_part(self) -> "Sampling":
    """What the jitted next-token step depends on (its static argument): the seed only derives the keys, which
    are computed outside it (`step_keys`), and greedy decoding reads no filter. Every seed, and every greedy
    call, shares one compile (found by a review: each new seed compiled the step again, ~1-2 s)."""
    if self.temperature == 0:
      return Sampling(temperature=0.0)
    return dataclasses.replace(self, seed=0)


def _integer(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def filter_log_probs(log_p_BxV, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
  """Log-probabilities to sample from: tempered (temperature > 0), renormalised, and -inf outside the top-k
  and then outside the nucleus (the most probable tokens whose mass first reaches top_p). Ties at a cut are
  kept, so the result does not depend on how a sort orders equal values."""
  # Tempered from the row's maximum (0), by at least 1e-30 (a float32 normal): the most probable token stays
  # finite at any temperature (a subnormal one, flushed to 0 on devices, gave NaN or -inf everywhere, and the
  # draw was token 0)
  top = jnp.max(log_p_BxV, axis=-1, keepdims=True)
  x = jax.nn.log_softmax((log_p_BxV - top) / max(temperature, 1e-30) if temperature > 0 else log_p_BxV, axis=-1)
  if top_k and top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, top_k)[0][:, -1:]
    x = jax.nn.log_softmax(jnp.where(x >= kth, x, -jnp.inf), axis=-1)
  if top_p < 1.0:
    p_sorted = -jnp.sort(-jnp.exp(x), axis=-1)
    before = jnp.cumsum(p_sorted, axis=-1) - p_sorted  # mass of the tokens ranked above
    cut = jnp.min(jnp.where(before < top_p, p_sorted, jnp.inf), axis=-1, keepdims=True)
    x = jax.nn.log_softmax(jnp.where(jnp.exp(x) >= cut, x, -jnp.inf), axis=-1)
  return x


def sample(log_p_BxV, key_B, sampling: Sampling):
  """[B] int32 next tokens: argmax at temperature 0, else a draw per row with its own key."""
  if sampling.temperature == 0:
    return jnp.argmax(log_p_BxV, axis=-1).astype(jnp.int32)
  x = filter_log_probs(log_p_BxV, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
  return jax.vmap(jax.random.categorical)(key_B, x).astype(jnp.int32)


def row_keys(seed: int, rows, step: int):
  """[B] PRNG keys of (seed, row index, step)."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(jnp.asarray(rows, jnp.uint32))


@functools.partial(jax.jit, static_argnums=(1, 2))
def step_keys(seed, rows: int, steps: int):
  """[steps, rows] keys: `row_keys` of every step (one dispatch for a whole call, not one per step)."""
  return jax.vmap(lambda s: row_keys(seed, jnp.arange(rows), s))(jnp.arange(steps))
