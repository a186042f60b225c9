"""What one evaluation pass scores: the families as typed `Point`s, their tuning grids (one per parameter), the
one scorer that reads every point from the vocabulary statistics and the memory blocks (`point_nlls`, built on
`scoring`), and the one tuner (`tune`).

Families (P′, p_mem and the mixtures are `scoring`'s; sim = g(c)·g(c_j)/√D):

  none          the model's softmax alone
  cache         continuous cache (Grave et al. 2017): (1-λ)·p_LM + λ·p_mem(θ), memory = local + long-term
  trime_local   TRIME softmax over vocabulary + local + long-term, at τ (TrimeLM / TrimeLM_long)
  trime         TRIME softmax over vocabulary + local + long-term + retrieved, at τ (TrimeLM_ext)
  interp        (1-λ)·P_trime(τ) + λ·P′(τ′), P′(w) ∝ Σ_{memories with x_j = w} exp(sim/τ′), over the memories
                of `interp_memory`: "external" = the top-K retrieved only (the original release), "all" = local +
                long-term + retrieved (the paper's Appendix A text)
  knnlm         kNN-LM: (1-λ)·p_LM + λ·p_mem(θ), memory = retrieved only
  knnlm_cache   kNN-LM + continuous cache: (1-λ)·p_LM + λ·p_mem(θ), memory = local + long-term + retrieved

eval.knnlm_metric="l2" (the original release's kNN-LM): knnlm and knnlm_cache read their retrieved memories from
an L2 index instead, with sim = -|g(c) - g(c_j)|² (no √D), and knnlm_cache its local (+ long-term) memories with
that similarity too (`point_nlls`' knn_memory); θ stays the scale of sim.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax.numpy as jnp

from trime_jax import scoring
from trime_jax.errors import ConfigError

FAMILIES = ("none", "cache", "trime_local", "trime", "interp", "knnlm", "knnlm_cache")
EXTERNAL_FAMILIES = ("trime", "interp", "knnlm", "knnlm_cache")
# The parameters of each family, in display order (Point fields, named as the eval config's fields).
FAMILY_PARAMS = {"none": (), "cache": ("cache_lambda", "cache_theta"), "trime_local": ("tau",), "trime": ("tau",),
                 "interp": ("tau", "tau_prime", "knn_lambda", "interp_memory"), "knnlm": ("knn_lambda", "knn_theta"),
                 "knnlm_cache": ("knn_lambda", "knn_theta")}
PARAMS = ("tau", "tau_prime", "cache_lambda", "cache_theta", "knn_lambda", "knn_theta", "interp_memory")
# Memory of the interpolation's P′: the original release's (top-K retrieved only) | the paper's text (all memories).
INTERP_MEMORIES = ("external", "all")
# trime_jax.launch.eval's eval.memory: which family (besides `none`) it scores.
EVAL_MEMORIES = {"none": None, "local": "trime_local", "cache": "cache"}

# Tuning grids (dev split), one per parameter. τ′ and θ act on sim = g·g_j/√D. With hundreds of retrieved
# neighbours in the softmax the best τ is larger than with local memory alone, hence the long upper tail; with a
# long-term store the cache optimum moves to λ ≈ 0.45, θ ≈ 4 (docs/long_memory.md), the grids reach past it.
TAU_GRID = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0)
TAU_PRIME_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)
LAMBDA_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75)
THETA_GRID = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
GRIDS = {"tau": TAU_GRID, "tau_prime": TAU_PRIME_GRID, "cache_lambda": LAMBDA_GRID, "cache_theta": THETA_GRID,
         "knn_lambda": LAMBDA_GRID, "knn_theta": THETA_GRID, "interp_memory": INTERP_MEMORIES}
# A parameter's name in a point's `name` (the result rows' "variant", printed tables, the docs' tables), e.g.
# cache(lambda=0.3,theta=1), knnlm(lambda=0.3,theta=1): the family says which λ / θ, as in every result written
# so far (kept so that old and new results compare by variant).
DISPLAY_NAMES = {"tau": "tau", "tau_prime": "tau_prime", "cache_lambda": "lambda", "cache_theta": "theta",
                 "knn_lambda": "lambda", "knn_theta": "theta", "interp_memory": "interp_memory"}



# ----------------------------------------------------------------------------------------------------------
# What one pass scores: points of the families.
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Point:
  """One family at one setting of its parameters (the others stay None).

  Each field is the `eval` config field of the same name: cache points hold eval.cache_lambda and
  eval.cache_theta; interp, knnlm and knnlm_cache points hold eval.knn_lambda (the weight of the retrieved
  distribution), knnlm and knnlm_cache also eval.knn_theta (kNN-MT's tuning reads it as 1 / knn_mt_temperature)."""

  family: str
  tau: float | None = None  # τ on memory similarities (trime_local, trime, interp): eval.tau
  tau_prime: float | None = None  # τ′ of P′ (interp): P′ = p_mem at θ = 1/τ′; eval.tau_prime
  cache_lambda: float | None = None  # the cache's mixture weight λ (cache): eval.cache_lambda
  cache_theta: float | None = None  # the cache's p_mem(θ) ∝ Σ exp(θ·sim) (cache): eval.cache_theta
  knn_lambda: float | None = None  # weight λ of the retrieved distribution (interp, knnlm, knnlm_cache): eval.knn_lambda
  knn_theta: float | None = None  # kNN-LM's p_mem(θ) ∝ Σ exp(θ·sim) (knnlm, knnlm_cache): eval.knn_theta
  interp_memory: str | None = None  # memories of P′ (interp): "external" | "all"

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ConfigError(f"unknown evaluation family {self.family!r}: one of {FAMILIES}")
    needed = FAMILY_PARAMS[self.family]
    for name in PARAMS:
      value = getattr(self, name)
      if (value is None) == (name in needed):
        raise ConfigError(f"{self.family} points take {needed or 'no parameters'}; {name}={value!r}")
    if self.interp_memory is not None and self.interp_memory not in INTERP_MEMORIES:
      raise ConfigError(f"interp_memory (eval.interp_memory) must be one of {INTERP_MEMORIES}, "
                        f"got {self.interp_memory!r}")
    for name in ("cache_lambda", "knn_lambda"):
      if getattr(self, name) is not None and not 0.0 < getattr(self, name) < 1.0:
        raise ConfigError(f"λ ({name}) of {self.family} must be in (0, 1), got {getattr(self, name)}")
    for name in ("tau", "tau_prime", "cache_theta", "knn_theta"):
      if getattr(self, name) is not None and not getattr(self, name) > 0:
        raise ConfigError(f"{name} of {self.family} must be > 0, got {getattr(self, name)}")

  @property
  def params(self) -> dict:
    """{parameter: value} of this family's parameters, in display order."""
    return {name: getattr(self, name) for name in FAMILY_PARAMS[self.family]}

  @property
  def group(self) -> str:
    """What tuning picks one point of: the family, or for `interp` the family and its P′ memory."""
    return f"interp[{self.interp_memory}]" if self.family == "interp" else self.family

  @property
  def name(self) -> str:
    if self.family == "none":
      return "none"
    fmt = lambda v: v if isinstance(v, str) else f"{v:g}"
    return f"{self.family}(" + ",".join(f"{DISPLAY_NAMES[k]}={fmt(v)}" for k, v in self.params.items()) + ")"

  @property
  def needs_external(self) -> bool:
    return self.family in EXTERNAL_FAMILIES


NONE = Point("none")


def grid(families) -> tuple[Point, ...]:
  """Every point of each family over the tuning grids (`interp`: both P′ memories)."""
  out = []
  for family in families:
    names = FAMILY_PARAMS[family]
    out += [Point(family, **dict(zip(names, values))) for values in itertools.product(*(GRIDS[n] for n in names))]
  return tuple(out)


def configured_points(e, families) -> tuple[Point, ...]:
  """One point per family from the `eval` config section (no tuning)."""
  tau, knn_lambda = float(e.tau), float(e.knn_lambda)
  knn_theta = float(e.get("knn_theta", 1.0))  # configs stored before the field: kNN-LM's θ was eval.cache_theta's 1
  knn = dict(knn_lambda=knn_lambda, knn_theta=knn_theta)
  settings = {"none": {}, "cache": dict(cache_lambda=float(e.cache_lambda), cache_theta=float(e.cache_theta)),
              "trime_local": dict(tau=tau), "trime": dict(tau=tau), "knnlm": knn, "knnlm_cache": knn,
              "interp": dict(tau=tau, tau_prime=float(e.tau_prime), knn_lambda=knn_lambda,
                             interp_memory=str(e.interp_memory))}
  return tuple(Point(f, **settings[f]) for f in families)



def families_of(e, external_memory: bool) -> tuple:
  """Families an evaluation scores: every family with external memory; else `none` and eval.memory's."""
  if external_memory:
    return FAMILIES
  if e.memory not in EVAL_MEMORIES:
    raise ConfigError(f"eval.memory must be one of {tuple(EVAL_MEMORIES)}, got {e.memory!r}")
  return ("none",) + ((EVAL_MEMORIES[e.memory],) if EVAL_MEMORIES[e.memory] else ())



# ----------------------------------------------------------------------------------------------------------
# The one scorer: every point from the vocabulary statistics and the memory blocks.
# ----------------------------------------------------------------------------------------------------------
def exact_scales(points) -> tuple:
  """The scales c at which `point_nlls` reads the external memory (c·sim: 1/τ, 1/τ′, θ): what the exact
  on-device memory sums over (`exact_memory.external_log_terms`)."""
  out = set()
  for pt in points:
    if pt.family in ("trime", "interp"):
      out.add(1.0 / pt.tau)
    if pt.family == "interp":
      out.add(1.0 / pt.tau_prime)
    if pt.family in ("knnlm", "knnlm_cache"):
      out.add(pt.knn_theta)
  return tuple(sorted(out))


def point_nlls(stats, targets, local_blocks, ext_block, points, knn_memory=None):
  """[P, ..., Q] nll of every query under every point. `stats`: the queries' `memory.QueryStats` (or a plain
  `scoring.VocabStats`: one target term); `local_blocks`: local (+ long-term) memory;
  `ext_block`: the retrieved entries, or None, or (exact on-device memory, `exact_memory.summary_blocks`) one
  block per scale at which the points read it. `knn_memory`: the kNN-LM families' own memories, (local blocks,
  retrieved block), which they read instead (eval.knnlm_metric="l2": the L2 index's top-K, and the local /
  long-term memories, all with sim = -|q - k|²); None: they read `local_blocks` and `ext_block`. Shared terms
  (a TRIME softmax at τ, a p_mem at θ) are computed once per pass."""

  def blocks_of(which, scale):
    if which == "local":  # (exact memory holds sums only at the scales the external readers use)
      return local_blocks
    if which in ("knn_external", "knn_all"):  # the kNN-LM families' own memories (eval.knnlm_metric="l2")
      knn_local, knn_ext = knn_memory
      return ([] if which == "knn_external" else list(knn_local)) + [knn_ext]
    ext = [] if ext_block is None else [ext_block[scale] if isinstance(ext_block, dict) else ext_block]
    return ext if which == "external" else local_blocks + ext

  log_p_vocab = stats.target_logit - stats.log_normalizer

  def log_p_trime(blocks, tau):
    # ModelConfig.adaptive_tail_ignores_pad (QueryStats); a plain VocabStats (mt.decode) has one target term
    return scoring.trime_log_prob(stats.log_normalizer, getattr(stats, "trime_target_logit", stats.target_logit),
                                  blocks, tau)

  memo = {}

  def once(key, fn):
    if key not in memo:
      memo[key] = fn()
    return memo[key]

  out = []
  for pt in points:
    if pt.family == "none":
      lp = log_p_vocab
    elif pt.family in ("trime_local", "trime"):
      which = "local" if pt.family == "trime_local" else "all"
      lp = once(("trime", which, pt.tau), lambda: log_p_trime(blocks_of(which, 1.0 / pt.tau), pt.tau))
    elif pt.family == "interp":  # P′ at θ = 1/τ′: shared with knnlm(_cache) at that θ
      lt = once(("trime", "all", pt.tau), lambda: log_p_trime(blocks_of("all", 1.0 / pt.tau), pt.tau))
      lm, has = once(("mem", pt.interp_memory, 1.0 / pt.tau_prime),
                     lambda: scoring.log_p_mem(blocks_of(pt.interp_memory, 1.0 / pt.tau_prime), 1.0 / pt.tau_prime, targets))
      lp = scoring.mix(lt, lm, has, pt.knn_lambda)
    else:  # cache | knnlm | knnlm_cache: the model mixed with a memory-only distribution at θ
      which = {"cache": "local", "knnlm": "external", "knnlm_cache": "all"}[pt.family]
      if knn_memory is not None and pt.family != "cache":
        which = "knn_" + which
      lam, theta = (pt.cache_lambda, pt.cache_theta) if pt.family == "cache" else (pt.knn_lambda, pt.knn_theta)
      lm, has = once(("mem", which, theta), lambda: scoring.log_p_mem(blocks_of(which, theta), theta, targets))
      lp = scoring.mix(log_p_vocab, lm, has, lam)
    out.append(-lp)
  return jnp.where(targets >= 0, jnp.stack(out), 0.0)


# ----------------------------------------------------------------------------------------------------------
# The one tuner.
# ----------------------------------------------------------------------------------------------------------
def nll_improves(nll: float, best: float) -> bool:
  """nll < best, where NaN counts as +inf: a NaN first point is replaced by any finite one."""
  return not math.isnan(nll) and (math.isnan(best) or nll < best)


def grid_edges(point: Point) -> list[str]:
  """The numeric parameters of a tuned `point` that lie at an end of their grid, e.g. ['lambda=0.75 (grid 0.02 …
  0.75)']: the dev optimum may lie beyond it (a baseline tuned there is under-tuned)."""
  out = []
  for name, v in point.params.items():
    g = GRIDS[name]
    if not isinstance(v, str) and len(g) > 1 and v in (min(g), max(g)):
      out.append(f"{DISPLAY_NAMES[name]}={v:g} (grid {min(g):g} … {max(g):g})")
  return out


def tune(result) -> dict:
  """{group: Score} of the lowest-nll point of each group (family; `interp`: each P′ memory) of an `EvalResult`;
  the first of equal ones. A non-finite nll (a diverged point) never wins over a finite one."""
  best = {}
  for s in result.scores:
    if s.point.group not in best or nll_improves(s.nll, best[s.point.group].nll):
      best[s.point.group] = s
  return best
