"""Perplexity the fairseq way, with TRIME local memory and the continuous-cache baseline.

The split is one token stream (documents concatenated, as fairseq's `eval_lm`). It is scored in chunks of
S = block_len - context_window targets; each chunk is fed with up to `context_window` preceding tokens that
are context only (fairseq `--context-window`). Every target is scored exactly once.

Memory at evaluation, for a scored token at window position t (all variants from ONE forward pass, so a grid
over τ, λ and θ costs one pass over the data):
  none   plain softmax (vanilla LM)
  local  TRIME with memory = every earlier token of the window (context included), temperature τ
  cache  continuous cache (Grave et al. 2017): (1-λ)·p_LM + λ·p_cache,
         p_cache(w) ∝ Σ_{j<t, x_j = w} exp(θ · g_t·g_j / √D), the same earlier tokens, the model's own keys
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from trime_jax import data as D
from trime_jax import loss as L
from trime_jax import steps
from trime_jax.errors import ConfigError

EVAL_MEMORIES = ("none", "local", "cache")
# Default tuning grids (dev split): τ for TRIME local memory; (λ, θ) for the continuous cache.
TAU_GRID = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
CACHE_LAMBDA_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45)
CACHE_THETA_GRID = (0.1, 0.25, 0.5, 1.0, 2.0)


@dataclasses.dataclass(frozen=True)
class Window:
  start: int  # first target position fed to the model
  score_start: int  # first scored target position
  end: int  # one past the last target position (scored and fed)


def windows(num_targets: int, block_len: int, context_window: int) -> list[Window]:
  if not 0 <= context_window < block_len:
    raise ConfigError(f"eval.context_window={context_window} must be in [0, block_len={block_len})")
  stride = block_len - context_window
  out = []
  for s in range(0, num_targets, stride):
    e = min(s + stride, num_targets)
    out.append(Window(max(0, s - context_window), s, e))
  return out


def window_batch(corpus: D.Corpus, wins: list[Window], block_len: int):
  """inputs / targets [b, L] (-1 padded) and the scored mask [b, L]."""
  b = len(wins)
  inputs = np.zeros((b, block_len), np.int32)
  targets = np.full((b, block_len), -1, np.int32)
  scored = np.zeros((b, block_len), bool)
  toks = corpus.tokens
  for i, w in enumerate(wins):
    n = w.end - w.start
    targets[i, :n] = toks[w.start:w.end]
    if w.start == 0:
      inputs[i, 0] = corpus.vocab.bos
      inputs[i, 1:n] = toks[0:n - 1]
    else:
      inputs[i, :n] = toks[w.start - 1:w.end - 1]
    scored[i, w.score_start - w.start:n] = True
  return inputs, targets, scored


@dataclasses.dataclass(frozen=True)
class Variants:
  """What one pass computes: τ values for TRIME local memory, (λ, θ) pairs for the cache."""

  taus: tuple = ()
  cache: tuple = ()  # ((lambda, theta), ...)

  def names(self):
    return (["none"] + [f"local(tau={t:g})" for t in self.taus]
            + [f"cache(lambda={l:g},theta={th:g})" for l, th in self.cache])


def _window_nlls(stats: L.VocabStats, keys, targets, variants: Variants):
  """[n_variants, b, L] nll of every target under every variant (dense [L, L] per window)."""
  b, l, d = keys.shape
  base = jnp.where(targets >= 0, stats.log_normalizer - stats.target_logit, 0.0)
  out = [base]
  if not variants.taus and not variants.cache:
    return jnp.stack(out)
  sim = jnp.einsum("bld,bmd->blm", keys, keys, preferred_element_type=jnp.float32) / math.sqrt(d)
  pos_idx = jnp.arange(l)
  mem = (pos_idx[None, :] < pos_idx[:, None])[None] & (targets[:, None, :] >= 0)  # [b, L(query), L(mem)]
  positive = mem & (targets[:, None, :] == targets[:, :, None])
  lse = L.masked_logsumexp_with
  for tau in variants.taus:
    log_z = lse(stats.log_normalizer, sim / tau, mem)
    log_p = lse(stats.target_logit, sim / tau, positive)
    out.append(jnp.where(targets >= 0, log_z - log_p, 0.0))
  has_mem = mem.any(-1)
  for lam, theta in variants.cache:
    neg_inf = jnp.full(targets.shape, -jnp.inf)
    log_all = lse(neg_inf, theta * sim, mem)
    log_pos = lse(neg_inf, theta * sim, positive)
    log_pc = jnp.where(has_mem, log_pos - jnp.where(has_mem, log_all, 0.0), -jnp.inf)
    log_pv = stats.target_logit - stats.log_normalizer
    mixed = jnp.logaddexp(math.log1p(-lam) + log_pv, math.log(lam) + log_pc)
    nll = -jnp.where(has_mem, mixed, log_pv)
    out.append(jnp.where(targets >= 0, nll, 0.0))
  return jnp.stack(out)


@functools.partial(jax.jit, static_argnames=("graphdef", "variants", "vocab_chunk"))
def eval_step(graphdef, params, inputs, targets, scored, *, variants: Variants, vocab_chunk: int = 0):
  """Sums of nll over the scored targets, one per variant [n_variants]."""
  model = nnx.merge(graphdef, params)
  stats, keys = steps.forward(model, inputs, targets, vocab_chunk=vocab_chunk)
  nll = _window_nlls(stats, keys, targets, variants)
  return jnp.where(scored[None], nll, 0.0).sum(axis=(1, 2))


@dataclasses.dataclass
class EvalResult:
  name: str
  nll: float  # mean nats per scored token
  tokens: int
  seconds: float
  bytes_level: bool

  @property
  def ppl(self) -> float:
    return math.exp(min(self.nll, 700.0))

  @property
  def bits_per_token(self) -> float:
    return self.nll / math.log(2)

  def as_dict(self) -> dict:
    d = {"variant": self.name, "nll": self.nll, "ppl": self.ppl, "tokens": self.tokens,
         "tokens_per_s": self.tokens / max(self.seconds, 1e-9)}
    if self.bytes_level:
      d["bpc"] = self.bits_per_token
    return d


def evaluate(graphdef, params, corpus: D.Corpus, *, block_len: int, context_window: int, batch_size: int,
             variants: Variants = Variants(), vocab_chunk: int = 0, max_tokens: int = 0,
             progress: bool = False) -> list[EvalResult]:
  """Score `corpus` (one stream) under every variant in one pass; returns one `EvalResult` per variant."""
  n = len(corpus) if not max_tokens else min(max_tokens, len(corpus))
  wins = windows(n, block_len, context_window)
  totals = np.zeros(len(variants.names()))
  scored_tokens = 0
  t0 = time.perf_counter()
  batches = range(0, len(wins), batch_size)
  for i in tqdm(batches, desc="eval", disable=not progress, unit="batch"):
    chunk = wins[i:i + batch_size]
    chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed shapes: repeat, then mask out
    inputs, targets, scored = window_batch(corpus, chunk, block_len)
    real = len(wins[i:i + batch_size])
    scored[real:] = False
    totals += np.asarray(eval_step(graphdef, params, inputs, targets, scored, variants=variants,
                                   vocab_chunk=vocab_chunk), np.float64)
    scored_tokens += int(scored.sum())
  seconds = time.perf_counter() - t0
  is_bytes = corpus.vocab.kind == "bytes"
  return [EvalResult(name, float(tot / max(scored_tokens, 1)), scored_tokens, seconds, is_bytes)
          for name, tot in zip(variants.names(), totals)]


def variants_from_config(ecfg) -> Variants:
  if ecfg.memory not in EVAL_MEMORIES:
    raise ConfigError(f"eval.memory must be one of {EVAL_MEMORIES}, got {ecfg.memory!r}")
  if ecfg.memory == "local":
    return Variants(taus=TAU_GRID if ecfg.tune else (float(ecfg.temperature),))
  if ecfg.memory == "cache":
    if ecfg.tune:
      return Variants(cache=tuple(itertools.product(CACHE_LAMBDA_GRID, CACHE_THETA_GRID)))
    if not 0.0 < ecfg.cache_lambda < 1.0:
      raise ConfigError(f"eval.cache_lambda must be in (0, 1), got {ecfg.cache_lambda}")
    return Variants(cache=((float(ecfg.cache_lambda), float(ecfg.cache_theta)),))
  return Variants()


def format_table(rows: list[dict], columns=("variant", "ppl", "bpc", "nll", "tokens", "tokens_per_s")) -> str:
  cols = [c for c in columns if any(c in r for r in rows)]
  def fmt(v):
    if isinstance(v, float):
      return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}" if abs(v) < 10 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)
  cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
  return "\n".join(lines)
