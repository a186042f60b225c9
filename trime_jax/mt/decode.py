"""Greedy and beam search for the encoder–decoder (fairseq's SequenceGenerator semantics), over a callback.

    next_log_probs(prev_NxT, step, live_N, parents_N) -> log P [N, V] of the token at position `step`

`prev_NxT` holds the decoder inputs of every row, [eos] + the hypothesis so far, at least step + 1 columns
(columns after `step` are padding and must not matter: the decoder is causal). Row r belongs to sentence
r // beam (greedy: beam = 1), rows of a sentence stay together for the whole search, and rows of finished
sentences are still passed (fixed shapes, one compilation); their outputs are ignored. `live_N` (bool) marks
the rows whose output matters (beams of unfinished sentences with a finite score): a callback may skip work
(a datastore search) for the others. `parents_N`: the row of the previous call whose prefix row r extends
(prev[r, :step] == previous prev[parents[r], :step]; the identity at step 0 and for greedy), so that a callback
can reorder cached decoder states as fairseq's `reorder_incremental_state`.

Beam search as fairseq's (`fairseq/sequence_generator.py`, beam search without constraints):
  * step 0 expands only the first beam; pad is never produced; eos is banned before `min_len` (1) tokens;
  * at each step the 2·beam best (cumulative log-prob) continuations of the sentence's beams are taken; those
    among the first `beam` that end in eos are finished, the first `beam` that do not are kept;
  * a finished hypothesis scores Σ log p / len^lenpen (len counts the eos; lenpen 0 = raw sum);
  * a sentence is done when `beam` hypotheses are finished; at step max_len every beam is forced to eos, with
    max_len = max_len_a · src_len + max_len_b (per sentence, here; fairseq uses the batch's longest source),
    capped by the model's `max_positions` - 1.
The output is the best finished hypothesis per sentence (tokens without the final eos) and its score.

The bookkeeping runs on the host in float64 NumPy; the callback does the model work (jitted). `greedy` is the
beam = 1 special case, written as an argmax loop (the tests check it equals `beam_search(beam=1)`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trime_jax import evaluate
from trime_jax import scoring
from trime_jax.datastore import Datastore, KnnIndex, rescore
from trime_jax.errors import CheckpointError, ConfigError

NextLogProbs = Callable[[np.ndarray, int, np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class SearchOptions:
  beam: int = 4
  lenpen: float = 1.0  # length penalty exponent: score / len^lenpen (fairseq --lenpen; 0 = unnormalised)
  max_len_a: float = 0.0  # max output tokens = a · src_len + b (fairseq's defaults: a = 0, b = 200)
  max_len_b: int = 200
  min_len: int = 1
  max_positions: int = 1024  # the model's decoder positions: outputs never need more than this - 1 tokens

  def __post_init__(self):
    if self.beam < 1:
      raise ConfigError(f"beam must be >= 1, got {self.beam}")
    if self.max_len_a < 0 or self.max_len_b < 0 or (self.max_len_a == 0 and self.max_len_b < 1):
      raise ConfigError(f"max_len_a, max_len_b must be >= 0 and allow one token, got {self.max_len_a}, "
                        f"{self.max_len_b}")
    if self.min_len < 0:
      raise ConfigError(f"min_len must be >= 0, got {self.min_len}")

  def max_lens(self, src_lens) -> np.ndarray:
    """[B] the step at which each sentence's beams are forced to end (output tokens before the eos)."""
    raw = np.floor(self.max_len_a * np.asarray(src_lens, np.float64) + self.max_len_b).astype(np.int64)
    return np.clip(raw, 1, self.max_positions - 1)


# The original TrimeMT / kNN-MT evaluations' search (beam 4, lenpen 0.6, max length 1.2·|x| + 10): the default of
# trime_jax.launch.translate and bench/mt_decode. SearchOptions() alone keeps fairseq's generate defaults.
EVAL_SEARCH = SearchOptions(beam=4, lenpen=0.6, max_len_a=1.2, max_len_b=10)


@dataclasses.dataclass
class Hypothesis:
  tokens: list  # output tokens, without the final eos
  score: float  # Σ log p (eos included) / (len(tokens) + 1)^lenpen
  log_prob: float  # Σ log p, eos included


def _prepare(log_p_NxV, step: int, max_len_N, *, pad_id: int, eos_id: int, min_len: int) -> np.ndarray:
  """fairseq's per-step edits: NaN -> -inf, pad banned, eos banned before min_len, eos forced at max_len."""
  lp = np.array(log_p_NxV, np.float64)
  lp[np.isnan(lp)] = -np.inf
  lp[:, pad_id] = -np.inf
  if step < min_len:
    lp[:, eos_id] = -np.inf
  force = step >= max_len_N
  if force.any():
    eos_col = lp[force, eos_id]
    lp[force] = -np.inf
    lp[force, eos_id] = eos_col
  return lp


def beam_search(next_log_probs: NextLogProbs, src_lens, options: SearchOptions = SearchOptions(), *,
                pad_id: int = 0, eos_id: int, vocab_size: int) -> list[Hypothesis]:
  """The best hypothesis of each of the B = len(src_lens) sentences. The callback sees N = B · beam rows."""
  k, b = options.beam, len(src_lens)
  max_len_B = options.max_lens(src_lens)
  max_len_N = np.repeat(max_len_B, k)
  t_max = int(max_len_B.max()) + 1  # inputs: eos + up to max_len tokens; step max_len predicts the last eos
  tokens = np.full((b * k, t_max + 1), pad_id, np.int64)
  tokens[:, 0] = eos_id
  scores_N = np.zeros(b * k)  # cumulative log-prob of each row's hypothesis
  finished = [[] for _ in range(b)]
  done = np.zeros(b, bool)
  v = vocab_size
  parents = np.arange(b * k)
  for step in range(t_max):
    live_N = np.repeat(~done, k) & np.isfinite(scores_N)
    lp = _prepare(next_log_probs(tokens[:, :t_max], step, live_N, parents), step, max_len_N, pad_id=pad_id,
                  eos_id=eos_id, min_len=options.min_len)
    if lp.shape != (b * k, v):
      raise ValueError(f"next_log_probs returned shape {lp.shape}, expected {(b * k, v)}")
    cand = (scores_N[:, None] + lp).reshape(b, k, v)
    if step == 0:
      cand[:, 1:] = -np.inf  # every beam holds the same empty prefix: expand one
    cand = cand.reshape(b, k * v)
    n_cand = min(2 * k, k * v - 1)
    # Top 2k per sentence, best first; ties broken by the lower flat index (stable), as torch.topk does in
    # practice for these sizes.
    idx = np.argsort(-cand, axis=1, kind="stable")[:, :n_cand]
    cand_scores = np.take_along_axis(cand, idx, 1)
    cand_beam, cand_tok = idx // v, idx % v
    is_eos = (cand_tok == eos_id) & np.isfinite(cand_scores)
    new_tokens = tokens.copy()  # rows not refilled below (finished sentences) keep their prefix
    new_scores = np.full(b * k, -np.inf)
    parents = np.arange(b * k)
    for s in np.flatnonzero(~done):
      for j in np.flatnonzero(is_eos[s, :k]):  # eos among the first k candidates: a finished hypothesis
        if len(finished[s]) < k:
          row = s * k + cand_beam[s, j]
          lp_sum = float(cand_scores[s, j])
          finished[s].append(Hypothesis([int(t) for t in tokens[row, 1:step + 1]],
                                        lp_sum / (step + 1) ** options.lenpen, lp_sum))
      if len(finished[s]) >= k:
        done[s] = True
        continue
      keep = np.flatnonzero(~is_eos[s])[:k]  # the first k candidates that do not end the hypothesis
      for i, j in enumerate(keep):
        src_row, dst_row = s * k + cand_beam[s, j], s * k + i
        new_tokens[dst_row] = tokens[src_row]
        new_tokens[dst_row, step + 1] = cand_tok[s, j]
        new_scores[dst_row] = cand_scores[s, j]
        parents[dst_row] = src_row
    if done.all():
      break
    tokens, scores_N = new_tokens, new_scores
  return [max(f, key=lambda h: h.score) for f in finished]


def greedy(next_log_probs: NextLogProbs, src_lens, options: SearchOptions = SearchOptions(beam=1), *,
           pad_id: int = 0, eos_id: int, vocab_size: int) -> list[Hypothesis]:
  """Argmax decoding (beam search with beam = 1, as a plain loop); `options.beam` is ignored."""
  b = len(src_lens)
  max_len_B = options.max_lens(src_lens)
  t_max = int(max_len_B.max()) + 1
  tokens = np.full((b, t_max + 1), pad_id, np.int64)
  tokens[:, 0] = eos_id
  log_prob = np.zeros(b)
  length = np.zeros(b, np.int64)  # tokens produced, eos included
  active = np.ones(b, bool)
  for step in range(t_max):
    lp = _prepare(next_log_probs(tokens[:, :t_max], step, active.copy(), np.arange(b)), step, max_len_B,
                  pad_id=pad_id, eos_id=eos_id, min_len=options.min_len)
    if lp.shape != (b, vocab_size):
      raise ValueError(f"next_log_probs returned shape {lp.shape}, expected {(b, vocab_size)}")
    best = np.argmax(lp, axis=1)
    rows = np.flatnonzero(active)
    tokens[rows, step + 1] = best[rows]
    log_prob[rows] += lp[rows, best[rows]]
    length[rows] += 1
    active &= best != eos_id
    if not active.any():
      break
  return [Hypothesis([int(t) for t in tokens[r, 1:length[r]]], float(log_prob[r] / length[r] ** options.lenpen),
                     float(log_prob[r])) for r in range(b)]


def search(next_log_probs: NextLogProbs, src_lens, options: SearchOptions, **kw) -> list[Hypothesis]:
  """`greedy` when options.beam == 1, else `beam_search`."""
  return (greedy if options.beam == 1 else beam_search)(next_log_probs, src_lens, options, **kw)


# ----------------------------------------------------------------------------------------------------------
# Next-token distributions over retrieved datastore entries (one row = one query; K entries per row)
# ----------------------------------------------------------------------------------------------------------
# Both are the LM's scorer (`scoring.trime_log_probs`, `scoring.memory_log_probs`, `scoring.mix`), vmapped over
# rows: each row sees only its own K retrieved entries.
MODES = ("model", "knn_mt", "trime")


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


@dataclasses.dataclass
class Neighbours:
  """The top-K entries of N queries, best first."""

  ids: np.ndarray  # [N, K] int64 datastore rows (-1: fewer found)
  targets: np.ndarray  # [N, K] int32 next tokens (-1 where ids < 0)
  score: np.ndarray  # [N, K] float32: q·k (metric "ip") or -|q - k|² (metric "l2"); -inf where ids < 0
  keys: np.ndarray | None = None  # [N, K, D] float32 (zeros where ids < 0), when asked for


GATHER_FLOATS = 1 << 24  # float32 keys gathered at a time by `retrieve`'s L2 candidates (64 MiB)


def retrieve(ds: Datastore, index: KnnIndex, q_NxD, k: int, *, metric: str, candidates: int = 0,
             with_keys: bool = True) -> Neighbours:
  """Top-k entries by exact inner product (TRIME's similarity) or exact squared L2 distance (kNN-MT's).

  The index is an inner-product index (`datastore.index`): "ip" takes its top-k and re-scores them exactly
  from the stored keys; "l2" takes its top-`candidates` (default 16·k) by inner product and keeps the k
  nearest in L2 among them — the exact L2 neighbours whenever they are among those candidates (always when
  candidates >= the datastore size)."""
  if metric not in ("ip", "l2"):
    raise ConfigError(f"metric must be ip or l2, got {metric!r}")
  q = np.ascontiguousarray(np.asarray(q_NxD, np.float32))
  k = int(min(k, ds.count))
  c = k if metric == "ip" else int(min(max(candidates or 16 * k, k), ds.count))
  import faiss

  threads = faiss.omp_get_max_threads()
  faiss.omp_set_num_threads(1)  # as generation's search: a few hundred queries gain nothing from OpenMP's start-up
  try:
    _, ids_all = index.search(q, c)
  finally:
    faiss.omp_set_num_threads(threads)
  if metric == "ip":  # the index's top-k, re-scored exactly and re-sorted: the datastore's `rescore`
    out = rescore(ds, q, ids_all, with_keys=with_keys)
    out_score, out_ids, out_keys = out if with_keys else (*out, None)
    return Neighbours(out_ids, _targets(ds, out_ids), out_score, out_keys)
  n = len(q)
  out_ids, out_score = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
  out_keys = np.empty((n, k, ds.dimension), np.float32) if with_keys else None
  rows = max(1, GATHER_FLOATS // (c * ds.dimension))
  for a in range(0, n, rows):
    ids = ids_all[a:a + rows]
    keys = ds.gather_keys(ids)
    score = -np.sum((q[a:a + rows][:, None, :] - keys) ** 2, -1)
    score[ids < 0] = -np.inf
    order = np.argsort(-score, axis=1, kind="stable")[:, :k]
    out_ids[a:a + rows] = np.take_along_axis(ids, order, 1)
    out_score[a:a + rows] = np.take_along_axis(score, order, 1)
    if with_keys:
      out_keys[a:a + rows] = np.take_along_axis(keys, order[..., None], 1)
  return Neighbours(out_ids, _targets(ds, out_ids), out_score, out_keys)


def _targets(ds: Datastore, ids_NxK) -> np.ndarray:
  """[N, K] int32 next tokens of entries `ids` (-1 where ids < 0)."""
  return np.where(ids_NxK >= 0, np.asarray(ds.values[np.maximum(ids_NxK, 0)]), -1).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------
# Translation with a model export (+ a datastore)
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Distribution:
  """The next-token law: model | knn_mt (k, knn_mt_temperature T, knn_lambda λ: the weight of p_kNN) | trime
  (k, tau τ, + Appendix A's interpolation: knn_lambda λ, the weight of P′, and tau_prime τ′; λ 0 = none)."""

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


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _encode(graphdef, params, src_BxS):
  return nnx.merge(graphdef, params).encode(src_BxS, deterministic=True)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_steps"))
def _init_cache(graphdef, params, enc_NxSxD, max_steps: int):
  return nnx.merge(graphdef, params).init_decode_cache(enc_NxSxD, max_steps)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _cached_step(graphdef, params, cache, src_NxS, token_N, step, parents_N):
  """(logits [N, V] float32, g [N, D] float32, cache) of position `step`: the self-attention caches are first
  reordered to the rows' parents (beams of a sentence only ever take their parents among the sentence's rows,
  so the cross-attention cache needs no reordering)."""
  model = nnx.merge(graphdef, params)
  reorder = lambda x: jnp.take(x, parents_N, axis=0)
  cache = {"self": [(reorder(k), reorder(v)) for k, v in cache["self"]], "cross": cache["cross"]}
  f, g, cache = model.decode_step(cache, src_NxS, token_N, step)
  return model.logits(f).astype(jnp.float32), g.astype(jnp.float32), cache


class Translator:
  """Beam search / greedy over an MT export's decoder, with the next-token law of `dist`."""

  def __init__(self, graphdef, params, cfg, *, dist: Distribution = Distribution(), datastore=None, index=None,
               options: SearchOptions = SearchOptions(), eos_id: int = 3):
    if dist.mode != "model" and (datastore is None or index is None):
      raise ConfigError(f"mode {dist.mode} needs a datastore (--datastore, built by trime_jax.launch.build_datastore)")
    if datastore is not None and datastore.dimension != cfg.d_model:
      raise CheckpointError(f"datastore keys have dimension {datastore.dimension}, the model's {cfg.d_model}")
    self.graphdef, self.params, self.cfg = graphdef, params, cfg
    self.dist, self.ds, self.index = dist, datastore, index
    self.options = dataclasses.replace(options, max_positions=min(options.max_positions, cfg.max_len))
    self.eos_id = eos_id
    self.search_seconds = 0.0
    self.decode_steps = 0  # decoder steps run (one per position of every batch's search)

  def _callback(self, enc, src):
    beam = self.options.beam
    enc_N, src_N = jnp.repeat(enc, beam, axis=0), jnp.repeat(src, beam, axis=0)
    d = self.dist

    state = {}

    def next_log_probs(prev_NxT, step, live_N, parents_N):
      self.decode_steps += 1
      if step == 0:  # cache widths rounded up to 16: a few compilations
        state["cache"] = _init_cache(self.graphdef, self.params, enc_N, -(-prev_NxT.shape[1] // 16) * 16)
      logits, g, state["cache"] = _cached_step(
          self.graphdef, self.params, state["cache"], src_N, jnp.asarray(prev_NxT[:, step], jnp.int32),
          jnp.asarray(step, jnp.int32), jnp.asarray(parents_N, jnp.int32))
      if d.mode == "model":
        return np.asarray(jax.nn.log_softmax(logits, -1))
      g_np = np.asarray(g)  # waits for the step: search_seconds below counts the retrieval alone
      t0 = time.perf_counter()
      live = np.flatnonzero(live_N)  # no search for finished sentences' rows: they get no entries (model alone)
      k = int(min(d.k, self.ds.count))
      nb = Neighbours(np.full((len(g_np), k), -1, np.int64), np.full((len(g_np), k), -1, np.int32),
                      np.full((len(g_np), k), -np.inf, np.float32), np.zeros((len(g_np), k, g_np.shape[1]), np.float32))
      if len(live):
        found = retrieve(self.ds, self.index, g_np[live], k, metric=d.metric, candidates=d.candidates)
        for name in ("ids", "targets", "score", "keys"):
          getattr(nb, name)[live] = getattr(found, name)
      self.search_seconds += time.perf_counter() - t0
      if d.mode == "knn_mt":
        return np.asarray(knn_mt_log_probs(logits, g, nb.keys, nb.targets, knn_mt_temperature=d.knn_mt_temperature,
                                           knn_lambda=d.knn_lambda))
      return np.asarray(trime_log_probs(logits, g, nb.keys, nb.targets, tau=d.tau, knn_lambda=d.knn_lambda,
                                        tau_prime=d.tau_prime))

    return next_log_probs

  def translate(self, src_list, *, batch_sentences: int = 32, progress=None) -> list[Hypothesis]:
    """The best hypothesis of each source sentence (ids without eos), in input order; batches of sentences
    of similar source lengths."""
    from trime_jax.mt.datastore import length_bucket

    order = sorted(range(len(src_list)), key=lambda i: (len(src_list[i]), i))
    out = [None] * len(src_list)
    for a in range(0, len(order), batch_sentences):
      idx = order[a:a + batch_sentences]
      rows = batch_sentences if len(order) > batch_sentences else len(idx)  # fixed shapes across batches
      s_len = length_bucket(max(len(src_list[i]) for i in idx) + 1)  # few shapes: few compilations
      src = np.zeros((rows, s_len), np.int32)
      src[:, 0] = self.eos_id  # filler rows: a source of eos alone (an all-padding row has nothing to attend to)
      for r, i in enumerate(idx):
        src[r, :len(src_list[i])] = src_list[i]
        src[r, len(src_list[i])] = self.eos_id
      src_lens = [len(src_list[i]) + 1 for i in idx] + [1] * (rows - len(idx))  # fairseq's src_len counts eos
      enc = _encode(self.graphdef, self.params, jnp.asarray(src))
      hyps = search(self._callback(enc, jnp.asarray(src)), src_lens, self.options, pad_id=self.cfg.pad_id,
                    eos_id=self.eos_id, vocab_size=self.cfg.vocab_size)
      for r, i in enumerate(idx):
        out[i] = hyps[r]
      if progress:
        progress(len(idx))
    return out


# ----------------------------------------------------------------------------------------------------------
# Tuning on teacher-forced valid targets: one retrieval of the top max(K) per target token, every K ≤ it
# and every (τ, λ, T) read from that one pass (`evaluate.point_nlls`, the LM evaluator's scorer)
# ----------------------------------------------------------------------------------------------------------
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


def tune_pass(graphdef, params, pairs, ds, index, *, k_max: int = 64, batch_tokens: int = 4096,
              candidates: int = 0, modes=("knn_mt", "trime")) -> TunePass:
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
    ip.append(retrieve(ds, index, g, k_max, metric="ip", with_keys=False) if "trime" in modes else none)
    l2.append(retrieve(ds, index, g, k_max, metric="l2", candidates=candidates, with_keys=False)
              if "knn_mt" in modes else none)
  cat = lambda xs, f: np.concatenate([getattr(x, f) for x in xs])
  nb = lambda xs: Neighbours(cat(xs, "ids"), cat(xs, "targets"), cat(xs, "score"))
  return TunePass(scoring.VocabStats(jnp.asarray(np.concatenate([s[0] for s in stats])),
                                  jnp.asarray(np.concatenate([s[1] for s in stats]))),
                  np.concatenate(targets), nb(ip), nb(l2), ds.dimension)


def _setting(point: evaluate.Point, k: int) -> Distribution:
  if point.family == "none":
    return Distribution("model")
  if point.family == "knnlm":
    return Distribution("knn_mt", k=k, knn_mt_temperature=1.0 / point.knn_theta, knn_lambda=point.knn_lambda)
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


def tune(tp: TunePass, *, modes=("knn_mt", "trime"), ks=KS, train_tau: float = 1.0) -> list[dict]:
  """Rows {mode, k, params, nll} for every K and grid point (kNN-MT: T × λ; TRIME: τ, then Appendix A's
  λ × τ′ at each K's best τ), plus the model alone; sorted by nll within each mode. The τ grid is the LM
  evaluator's together with it scaled by the training τ `train_tau` (the original MT model trains at
  τ = 10)."""
  metric = "ip" if tp.ip.score.shape[1] else "l2"  # the model alone ignores the entries of either
  rows = [{"mode": "model", "k": 0, "setting": Distribution("model"),
           "nll": float(_nlls(tp, [evaluate.NONE], 1, metric)[0])}]
  for k in ks:
    if k > tp.ip.score.shape[1] and k > tp.l2.score.shape[1]:
      continue
    if "knn_mt" in modes:
      pts = [evaluate.Point("knnlm", knn_lambda=lam, knn_theta=1.0 / t)
             for t in KNN_T_GRID for lam in evaluate.LAMBDA_GRID]
      rows += [{"mode": "knn_mt", "k": k, "setting": _setting(p, k), "nll": float(v)}
               for p, v in zip(pts, _nlls(tp, pts, k, "l2"))]
    if "trime" in modes:
      taus = sorted(set(evaluate.TAU_GRID) | {t * train_tau for t in evaluate.TAU_GRID})
      pts = [evaluate.Point("trime", tau=t) for t in taus]
      nll = _nlls(tp, pts, k, "ip")
      rows += [{"mode": "trime", "k": k, "setting": _setting(p, k), "nll": float(v)} for p, v in zip(pts, nll)]
      tau = pts[int(np.argmin(nll))].tau
      pts = [evaluate.Point("interp", tau=tau, tau_prime=tp_, knn_lambda=lam, interp_memory="external")
             for tp_ in evaluate.TAU_PRIME_GRID for lam in evaluate.LAMBDA_GRID]
      rows += [{"mode": "trime_interp", "k": k, "setting": _setting(p, k), "nll": float(v)}
               for p, v in zip(pts, _nlls(tp, pts, k, "ip"))]
  return sorted(rows, key=lambda r: (r["mode"], r["nll"]))
