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
from typing import Callable

import numpy as np

from trime_jax.errors import ConfigError

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
