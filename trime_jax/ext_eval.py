"""Evaluation with external memory (TrimeLM_ext, kNN-LM) on top of local and long-term memory.

For each scored token: ONE FAISS search (top-K, `knn.ExternalMemory`), whose entries join the window's
earlier tokens (local) and the long-term store in the one TRIME softmax at temperature τ; the same search
feeds the interpolation of the paper's Appendix A and the kNN-LM baselines. Every family below comes out of
one pass over the data (a grid over τ, τ′, λ, θ costs one pass, not one per point):

  none          the model's softmax alone
  cache         continuous cache: (1-λ)·p_LM + λ·p_mem(θ), memory = local + long-term
  trime_local   TRIME softmax over vocabulary + local + long-term (TrimeLM / TrimeLM_long)
  trime         TRIME softmax over vocabulary + local + long-term + retrieved, at τ (TrimeLM_ext)
  interp        (1-λ)·P_trime(τ) + λ·P′(τ′), P′(w) ∝ Σ_{memories with x_j = w} exp(sim/τ′), over the memories
                of `interp_memory`: "external" = the top-K retrieved only (the original release), "all" = local +
                long-term + retrieved (the paper's Appendix A text); both from the same search
  knnlm         kNN-LM: (1-λ)·p_LM + λ·p_mem(θ), memory = retrieved only
  knnlm_cache   kNN-LM + continuous cache: (1-λ)·p_LM + λ·p_mem(θ), memory = local + long-term + retrieved

sim = g(c)·g(c_j)/√D throughout; p_mem(θ)(w) ∝ Σ_{x_j = w} exp(θ·sim). Where a query has no memory at all the
mixtures fall back to the model (P_trime or p_LM). The original's --interp-temp has no √D (its P′ is
softmax(g·k_j / τ′_orig) over the top-K): τ′_orig = √D·τ′ (D = 1,024: its 10.5 is our τ′ = 0.328).
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
from trime_jax import evaluate as E
from trime_jax import knn
from trime_jax import long_memory as LM
from trime_jax import loss as L
from trime_jax import steps
from trime_jax.errors import ConfigError

FAMILIES = ("none", "cache", "trime_local", "trime", "interp", "knnlm", "knnlm_cache")
EXTERNAL_FAMILIES = ("trime", "interp", "knnlm", "knnlm_cache")
# Memory of the interpolation's P′: the original release's (top-K retrieved only) | the paper's text (all memories).
INTERP_MEMORIES = ("external", "all")
# Tuning grids (dev split). τ′ and θ act on sim = g·g_j/√D. With hundreds of retrieved neighbours in the
# softmax the best τ is larger than with local memory alone, hence the long upper tail.
TAU_GRID = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0)
TAU_PRIME_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)
LAMBDA_GRID = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75)
THETA_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)


@dataclasses.dataclass(frozen=True)
class ExtVariants:
  """Points of each family computed in one pass (see the module docstring)."""

  cache: tuple = ()  # ((λ, θ), ...)
  trime_local: tuple = ()  # (τ, ...)
  trime: tuple = ()  # (τ, ...)
  interp: tuple = ()  # ((τ, τ′, λ, P′ memory: "external" | "all"), ...)
  knnlm: tuple = ()  # ((λ, θ), ...)
  knnlm_cache: tuple = ()  # ((λ, θ), ...)
  mem_size: int = 0  # long-term memory: tokens before the window (0: none)
  reset_at_documents: bool = True

  def __post_init__(self):
    for p in self.interp:
      if len(p) != 4 or p[3] not in INTERP_MEMORIES:
        raise ConfigError(f"interp points are (tau, tau_prime, lambda, memory) with memory one of "
                          f"{INTERP_MEMORIES} (eval.interp_memory), got {p}")

  def points(self):
    """[(family, params tuple)] in output order; 'none' first."""
    out = [("none", ())]
    for fam in FAMILIES[1:]:
      out += [(fam, p if isinstance(p, tuple) else (p,)) for p in getattr(self, fam)]
    return out

  def names(self):
    keys = {"cache": ("lambda", "theta"), "trime_local": ("tau",), "trime": ("tau",),
            "interp": ("tau", "tau_prime", "lambda", "interp_memory"), "knnlm": ("lambda", "theta"),
            "knnlm_cache": ("lambda", "theta")}
    fmt = lambda v: v if isinstance(v, str) else f"{v:g}"
    return [fam if fam == "none" else f"{fam}(" + ",".join(f"{k}={fmt(v)}" for k, v in zip(keys[fam], p)) + ")"
            for fam, p in self.points()]

  @property
  def needs_external(self) -> bool:
    return any(getattr(self, f) for f in EXTERNAL_FAMILIES)

  @classmethod
  def grid(cls, *, external: bool, mem_size: int = 0, reset_at_documents: bool = True) -> "ExtVariants":
    lt = tuple(itertools.product(LAMBDA_GRID, THETA_GRID))
    interp = tuple(itertools.product(TAU_GRID, TAU_PRIME_GRID, LAMBDA_GRID, INTERP_MEMORIES))  # both P′ memories
    ext = dict(trime=TAU_GRID, interp=interp,
               knnlm=lt, knnlm_cache=lt) if external else {}
    return cls(cache=lt, trime_local=TAU_GRID, mem_size=mem_size, reset_at_documents=reset_at_documents, **ext)


def _log_p_mem(blocks, scale, targets):
  """(log p_mem(target), has_memory): p_mem(w) ∝ Σ_{visible, x_j = w} exp(scale·sim) over `blocks`."""
  lse = L.masked_logsumexp_with
  log_all = log_pos = jnp.full(targets.shape, -jnp.inf)
  for blk in blocks:
    log_all = lse(log_all, scale * blk.sim, blk.visible)
    log_pos = lse(log_pos, scale * blk.sim, blk.positive)
  has = functools.reduce(jnp.logical_or, [blk.visible.any(-1) for blk in blocks])
  return jnp.where(has, log_pos - jnp.where(has, log_all, 0.0), -jnp.inf), has


def _mix(log_p_model, log_p_mem, has_mem, lam):
  mixed = jnp.logaddexp(math.log1p(-lam) + log_p_model, math.log(lam) + log_p_mem)
  return jnp.where(has_mem, mixed, log_p_model)


def family_nlls(stats: L.VocabStats, targets, local_blocks, ext_block, v: ExtVariants):
  """[n_points, ..., Q] nll of every query under every point of `v` (`ext_block` may be None)."""
  lse = L.masked_logsumexp_with
  all_blocks = local_blocks + ([ext_block] if ext_block is not None else [])
  blocks_of = {"local": local_blocks, "ext": [ext_block], "all": all_blocks}
  log_pv = stats.target_logit - stats.log_normalizer

  def log_p_trime(blocks, tau):
    z, p = stats.log_normalizer, stats.target_logit
    for blk in blocks:
      z, p = lse(z, blk.sim / tau, blk.visible), lse(p, blk.sim / tau, blk.positive)
    return p - z

  memo = {}

  def cached(key, fn):
    if key not in memo:
      memo[key] = fn()
    return memo[key]

  out = []
  for fam, p in v.points():
    if fam == "none":
      lp = log_pv
    elif fam == "trime_local":
      lp = cached(("t", False, p[0]), lambda: log_p_trime(local_blocks, p[0]))
    elif fam == "trime":
      lp = cached(("t", True, p[0]), lambda: log_p_trime(all_blocks, p[0]))
    elif fam == "interp":
      tau, tau_prime, lam, memory = p
      lt = cached(("t", True, tau), lambda: log_p_trime(all_blocks, tau))
      which = {"external": "ext", "all": "all"}[memory]  # P′ at θ = 1/τ′: shared with knnlm(_cache) at that θ
      lm, has = cached(("m", which, 1.0 / tau_prime),
                       lambda: _log_p_mem(blocks_of[which], 1.0 / tau_prime, targets))
      lp = _mix(lt, lm, has, lam)
    else:  # cache | knnlm | knnlm_cache: the model mixed with a memory-only distribution at θ
      lam, theta = p
      which = {"cache": "local", "knnlm": "ext", "knnlm_cache": "all"}[fam]
      lm, has = cached(("m", which, theta), lambda: _log_p_mem(blocks_of[which], theta, targets))
      lp = _mix(log_pv, lm, has, lam)
    out.append(-lp)
  return jnp.where(targets >= 0, jnp.stack(out), 0.0)


# ----------------------------------------------------------------------------------------------------------
# Jitted halves of one step: the forward pass, then (after the host-side search) the memory softmaxes.
# ----------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("graphdef", "q", "vocab_chunk"))
def _forward_queries(graphdef, params, inputs, targets, offset, *, q: int, vocab_chunk: int):
  model = nnx.merge(graphdef, params)
  stats, keys = steps.forward(model, inputs, targets, vocab_chunk=vocab_chunk)
  qpos = offset[:, None] + jnp.arange(q, dtype=jnp.int32)[None, :]  # [S, Q] window positions of the queries
  take = lambda x: jnp.take_along_axis(x, qpos, axis=1)
  q_stats = L.VocabStats(take(stats.log_normalizer), take(stats.target_logit))
  q_keys = jnp.take_along_axis(keys, qpos[:, :, None], axis=1)
  return keys, q_keys, q_stats, take(targets), qpos


@functools.partial(jax.jit, static_argnames=("variants", "n_buckets"), donate_argnames=("store",))
def _memory_sums(store: LM.Store, keys, targets, q_keys, q_stats, q_targets, qpos, batch, ext_sim, ext_targets,
                 bucket_q, *, variants: ExtVariants, n_buckets: int):
  """(nll sums [P], per-bucket nll sums [P, n_buckets], per-bucket token counts [n_buckets], new store)."""
  pos = batch["start"][:, None] + qpos
  real = (pos < batch["end"][:, None]) & (q_targets >= 0)
  local = [E.local_block(q_keys, q_targets, qpos, keys, targets)]
  if variants.mem_size:
    local.append(LM.block(store, q_keys, q_targets, batch["doc_q"], batch["start"], mem_size=variants.mem_size,
                          reset_at_documents=variants.reset_at_documents))
  ext = None
  if ext_sim is not None:
    vis = ext_targets >= 0
    ext = LM.MemoryBlock(ext_sim, vis, vis & (ext_targets == q_targets[..., None]))
  nll = family_nlls(q_stats, q_targets, local, ext, variants)  # [P, S, Q]
  scored = real & batch["score"][:, None]
  nll = jnp.where(scored[None], nll, 0.0)
  onehot = jax.nn.one_hot(bucket_q, n_buckets, dtype=nll.dtype) * scored[..., None]
  store = LM.insert(store, q_keys, q_targets, pos, batch["doc_q"], real & batch["insert"][:, None])
  return nll.sum(axis=(1, 2)), jnp.einsum("psq,sqb->pb", nll, onehot), onehot.sum(axis=(0, 1)), store


@dataclasses.dataclass
class ExtResult:
  results: list  # [evaluate.EvalResult] per point of the variants
  points: list  # [(family, params)]
  bucket_nll: np.ndarray  # [P, n_buckets] mean nll per frequency bucket (nan where a bucket is empty)
  bucket_tokens: np.ndarray  # [n_buckets]
  retrieval_hits: np.ndarray  # [len(knn.RETRIEVAL_KS)] scored tokens whose target is in the top-k next tokens
  seconds: float
  search_seconds: float

  @property
  def tokens(self) -> int:
    return self.results[0].tokens

  def retrieval_accuracy(self) -> dict:
    return {f"top{k}": float(h) / max(self.tokens, 1) for k, h in zip(knn.RETRIEVAL_KS, self.retrieval_hits)}


def evaluate_external(graphdef, params, corpus: D.Corpus, *, block_len: int, context_window: int, streams: int,
                      variants: ExtVariants, external: knn.ExternalMemory | None = None, vocab_chunk: int = 0,
                      max_tokens: int = 0, word_buckets_V=None, progress: bool = False) -> ExtResult:
  """Score `corpus` under every point of `variants`: windows as `evaluate.windows`, `streams` parallel streams
  with a long-term store each (as `evaluate.evaluate_streams`), plus one top-K search per scored token."""
  if variants.needs_external and external is None:
    raise ConfigError("external-memory variants (trime, interp, knnlm, knnlm_cache) need a datastore + index")
  model_cfg = nnx.merge(graphdef, params).cfg
  if external is not None and external.dimension != model_cfg.d_model:
    raise ConfigError(f"datastore keys have dimension {external.dimension}, the model's keys {model_cfg.d_model}")
  plan = E.stream_plan(graphdef, params, corpus, block_len=block_len, context_window=context_window,
                       streams=streams, mem_size=variants.mem_size,
                       reset_at_documents=variants.reset_at_documents, max_tokens=max_tokens)
  n, q, store = plan.num_targets, plan.queries, plan.store
  buckets = np.zeros(model_cfg.vocab_size, np.int32) if word_buckets_V is None else np.asarray(word_buckets_V)
  n_buckets = len(knn.FREQ_BUCKETS)
  points = variants.points()
  totals = np.zeros(len(points))
  bucket_tot = np.zeros((len(points), n_buckets))
  bucket_cnt = np.zeros(n_buckets)
  hits = np.zeros(len(knn.RETRIEVAL_KS), np.int64)
  search_s0 = external.search_seconds if external is not None else 0.0
  t0 = time.perf_counter()
  for step in tqdm(range(len(plan.sched)), desc="eval (external)" if external else "eval", disable=not progress,
                   unit="step"):
    batch = plan.batch(corpus, step, block_len)
    keys, q_keys, q_stats, q_targets, qpos = _forward_queries(graphdef, params, batch["inputs"], batch["targets"],
                                                              batch["offset"], q=q, vocab_chunk=vocab_chunk)
    q_targets_np = np.asarray(q_targets)
    qpos_np = batch["start"][:, None] + np.asarray(qpos)
    scored = (qpos_np < batch["end"][:, None]) & (q_targets_np >= 0) & batch["score"][:, None]
    ext_sim = ext_targets = None
    if external is not None:
      ext_sim = np.zeros(scored.shape + (external.k,), np.float32)
      ext_targets = np.full(scored.shape + (external.k,), -1, np.int32)
      if scored.any():  # one search per scored token; warm-up windows only fill the store
        got = external.retrieve(np.asarray(q_keys)[scored])
        ext_sim[scored], ext_targets[scored] = got.sim, got.targets
        hits += knn.retrieval_hits(got.targets, q_targets_np[scored])
    bucket_q = buckets[np.maximum(q_targets_np, 0)]
    sums, bsums, bcnt, store = _memory_sums(store, keys, batch["targets"], q_keys, q_stats, q_targets, qpos, batch,
                                            ext_sim, ext_targets, bucket_q, variants=variants, n_buckets=n_buckets)
    totals += np.asarray(sums, np.float64)
    bucket_tot += np.asarray(bsums, np.float64)
    bucket_cnt += np.asarray(bcnt, np.float64)
  seconds = time.perf_counter() - t0
  is_bytes = corpus.vocab.kind == "bytes"
  results = [E.EvalResult(name, float(t / max(n, 1)), n, seconds, is_bytes)
             for name, t in zip(variants.names(), totals)]
  with np.errstate(invalid="ignore", divide="ignore"):
    bucket_nll = np.where(bucket_cnt > 0, bucket_tot / bucket_cnt, np.nan)
  search = (external.search_seconds - search_s0) if external is not None else 0.0
  return ExtResult(results, points, bucket_nll, bucket_cnt, hits, seconds, search)


def group(fam: str, params: tuple) -> str:
  """What tuning picks one point of: the family, or for `interp` the family and its P′ memory."""
  return f"interp[{params[3]}]" if fam == "interp" else fam


def best_per_family(result: ExtResult) -> dict:
  """{group: (index, params)} of the lowest-nll point of each family (`interp`: of each P′ memory)."""
  best = {}
  for i, ((fam, p), r) in enumerate(zip(result.points, result.results)):
    g = group(fam, p)
    if g not in best or r.nll < result.results[best[g][0]].nll:
      best[g] = (i, p)
  return best


def chosen(best: dict, mem_size: int, reset_at_documents: bool) -> ExtVariants:
  """ExtVariants holding exactly one (the tuned) point per group in `best`."""
  fields = {}
  for g, (_, p) in best.items():
    fam = g.split("[")[0]
    if fam != "none":
      fields[fam] = fields.get(fam, ()) + ((p if fam not in ("trime_local", "trime") else p[0]),)
  return ExtVariants(mem_size=mem_size, reset_at_documents=reset_at_documents, **fields)


# ----------------------------------------------------------------------------------------------------------
# A whole evaluation of a checkpoint with external memory (what launch/eval_ext.py runs).
# ----------------------------------------------------------------------------------------------------------
def configured(e) -> ExtVariants:
  """One point per family from the `eval` config section (no tuning)."""
  tau, lam, theta = float(e.temperature), float(e.knn_lambda), float(e.cache_theta)
  return ExtVariants(cache=((float(e.cache_lambda), theta),), trime_local=(tau,), trime=(tau,),
                     interp=((tau, float(e.knn_temperature), lam, str(e.interp_memory)),), knnlm=((lam, theta),),
                     knnlm_cache=((lam, theta),), mem_size=int(e.mem_size),
                     reset_at_documents=bool(e.reset_at_documents))


def _rows(result: ExtResult, split: str, dev: ExtResult | None = None, dev_index=None) -> list[dict]:
  rows = []
  for i, ((fam, p), r) in enumerate(zip(result.points, result.results)):
    row = {"family": fam, "variant": r.name, f"{split}_ppl": r.ppl, "tokens": r.tokens,
           "tokens_per_s": r.tokens / max(r.seconds, 1e-9)}
    if fam == "interp":
      row["interp_memory"] = p[3]  # which memories P′ covered: "external" (the original's) or "all"
    if r.bytes_level:
      row[f"{split}_bpc"] = r.bits_per_token
    if dev is not None:
      row["dev_ppl"] = dev.results[dev_index[group(fam, p)]].ppl
    rows.append(row)
  return rows


def evaluate_checkpoint_external(config, checkpoint_dir: str, *, progress: bool = False,
                                 throughput_tokens: int = 0) -> dict:
  """Evaluate an export with external memory on `config.eval.split`; with `eval.tune`, every family's
  parameters are grid-searched on dev first (the interpolation for both P′ memories, one row each; without
  tuning, P′ covers `eval.interp_memory`). Returns rows, retrieval accuracy, frequency-bucket perplexities
  and (if `throughput_tokens`) eval throughput with vs without external memory."""
  import os

  from trime_jax import checkpoint as ckpt
  from trime_jax.runs import load_eval_data

  checkpoint_dir = os.path.abspath(checkpoint_dir)
  graphdef, params, train_config, vocab, _ = ckpt.load_export(checkpoint_dir)
  splits = load_eval_data(config, vocab)
  e = config.eval
  if e.interp_memory not in INTERP_MEMORIES:
    raise ConfigError(f"eval.interp_memory must be one of {INTERP_MEMORIES}, got {e.interp_memory!r}")
  if not e.datastore:
    raise ConfigError("eval.datastore is not set: build one with `python -m launch.build_datastore`")
  external = knn.ExternalMemory(e.datastore, index_path=e.index, checkpoint_dir=checkpoint_dir, k=e.knn_k,
                                nprobe=e.nprobe, exact=e.knn_exact, gpu=e.knn_gpu)
  buckets = knn.frequency_buckets(splits.train.tokens, len(vocab)) if vocab.kind == "words" else None
  kw = dict(block_len=e.block_len, context_window=e.context_window, streams=e.batch_size, external=external,
            vocab_chunk=train_config.train.vocab_chunk, max_tokens=e.max_tokens, word_buckets_V=buckets,
            progress=progress)
  out = {"checkpoint": checkpoint_dir, "datastore": e.datastore, "index": external.index.kind, "k": external.k,
         "nprobe": e.nprobe, "exact": bool(e.knn_exact), "mem_size": int(e.mem_size), "split": e.split}
  dev = best = None
  if e.tune:
    grid = ExtVariants.grid(external=True, mem_size=int(e.mem_size), reset_at_documents=bool(e.reset_at_documents))
    dev = evaluate_external(graphdef, params, splits.dev, variants=grid, **kw)
    best = best_per_family(dev)
    variants = chosen(best, int(e.mem_size), bool(e.reset_at_documents))
    out["dev_grid"] = [{"variant": r.name, "dev_ppl": r.ppl} for r in dev.results]
  else:
    variants = configured(e)
  res = evaluate_external(graphdef, params, splits.get(e.split), variants=variants, **kw)
  out["rows"] = _rows(res, e.split, dev, {f: i for f, (i, _) in best.items()} if best else None)
  out["retrieval_accuracy"] = res.retrieval_accuracy()
  out["search_seconds"], out["seconds"] = res.search_seconds, res.seconds
  if buckets is not None:
    out["buckets"] = {"names": [b[2] for b in knn.FREQ_BUCKETS], "tokens": res.bucket_tokens.tolist(),
                      "ppl": {r.name: np.exp(res.bucket_nll[i]).tolist() for i, r in enumerate(res.results)}}
  if throughput_tokens:
    tau = (variants.trime or (1.0,))[0]
    common = dict(mem_size=int(e.mem_size), reset_at_documents=bool(e.reset_at_documents))
    timed = []
    for ext, variant in ((external, ExtVariants(trime=(tau,), **common)),
                         (None, ExtVariants(trime_local=(tau,), **common))):
      tkw = {**kw, "external": ext, "variants": variant, "progress": False}
      # A short untimed pass first, so that neither side's timing includes XLA compilation.
      evaluate_external(graphdef, params, splits.get(e.split), **{**tkw, "max_tokens": min(throughput_tokens, 1024)})
      timed.append(evaluate_external(graphdef, params, splits.get(e.split), **{**tkw, "max_tokens": throughput_tokens}))
    with_ext, without = timed
    a, b = with_ext.tokens / with_ext.seconds, without.tokens / without.seconds
    out["throughput"] = {"tokens": with_ext.tokens, "with_external_tok_s": a, "without_tok_s": b, "ratio": a / b,
                         "search_share": with_ext.search_seconds / with_ext.seconds}
  return out
