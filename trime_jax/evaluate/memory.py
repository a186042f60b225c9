"""A scored token's test memory as data layout, as in training: three sources of (key, next token) pairs, each
with `scoring.TokenMeta` for its queries and memories, and `scoring.visible` deciding who sees whom (see the
package docstring: local, long-term, external); and the stream plan that feeds them (`stream_plan`: windows,
streams, the empty long-term store).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from trime_jax import data
from trime_jax import long_memory
from trime_jax import scoring
from trime_jax.errors import ConfigError
from trime_jax.scoring import MemoryBlock

# Layouts of the long-term store (StoreSpec.layout): the release's (its context tokens twice) | ours (once each).
LONG_TERM_LAYOUTS = ("original", "disjoint")
# x-axis of memory-size sweeps, per layout: what mem_size counts.
MEM_SIZE_AXIS_LABELS = {
    "original": "long-term memory: last scored tokens kept (the original's --mem-size; 0 = local only)",
    "disjoint": "long-term memory: tokens before the window (0 = local only; original --mem-size ≈ this + context)"}


def mem_size_axis_label(rows) -> str:
  """What the mem_size of `rows` counts (rows written before the layouts existed are disjoint)."""
  layouts = {r.get("long_term_layout", "disjoint") for r in rows} or {"original"}
  return "; ".join(MEM_SIZE_AXIS_LABELS[lay] for lay in sorted(layouts))



@dataclasses.dataclass(frozen=True)
class StoreSpec:
  """The long-term store every point sees (static: part of the jit cache key). 0: local memory only.
  layout "original": the last mem_size scored tokens before the window's first scored token (the release's
  --mem-size; the window's context tokens are there too); "disjoint": the mem_size tokens before the window."""

  mem_size: int = 0
  reset_at_documents: bool = False  # the store holds only the query's own document (the original: False)
  layout: str = "original"  # LONG_TERM_LAYOUTS

  def __post_init__(self):
    if self.mem_size < 0:
      raise ConfigError(f"eval.mem_size must be >= 0, got {self.mem_size}")
    if self.layout not in LONG_TERM_LAYOUTS:
      raise ConfigError(f"eval.long_term_layout must be one of {LONG_TERM_LAYOUTS}, got {self.layout!r}")

  def reach(self, context_window: int) -> int:
    """How far before a window's first scored token the store can be seen."""
    return self.mem_size + (context_window if self.layout == "disjoint" else 0)



# ----------------------------------------------------------------------------------------------------------
# Memory blocks: each source lays out TokenMeta for its queries and memories; `scoring.visible` decides.
# ----------------------------------------------------------------------------------------------------------
class QueryStats(NamedTuple):
  """The vocabulary side of every scored query: `scoring.VocabStats`, plus the target logit inside the TRIME
  softmax (the original's adaptive-softmax scorer drops one tail word's term: `ModelConfig.adaptive_tail_ignores_pad`)."""

  log_normalizer: jax.Array
  target_logit: jax.Array
  trime_target_logit: jax.Array


def _meta(target, *, row=0, group=0, order=0, doc=0) -> scoring.TokenMeta:
  full = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), target.shape)
  return scoring.TokenMeta(full(row), full(group), full(order), full(target), full(doc))


def _block(sim, query: scoring.TokenMeta, memory: scoring.TokenMeta, **rule) -> MemoryBlock:
  vis = scoring.visible(query, memory, **rule)
  return MemoryBlock(sim, vis, scoring.positive(query, memory, vis))


def local_block(queries_SxQxD, targets_SxQ, qpos_SxQ, keys_SxLxD, targets_SxL) -> MemoryBlock:
  """The window's tokens before each query (`qpos`: the query's position in the window); documents do not
  matter inside a window (as in fairseq's scoring of a block)."""
  window_pos = jnp.broadcast_to(jnp.arange(targets_SxL.shape[-1], dtype=jnp.int32), targets_SxL.shape)
  return _block(scoring.block_similarities(queries_SxQxD, keys_SxLxD), _meta(targets_SxQ, order=qpos_SxQ),
                _meta(targets_SxL, order=window_pos), causal=True, cross_rows=False)


def long_term_block(store: long_memory.Store, queries_SxQxD, targets_SxQ, doc_SxQ, store_end_S, span_S,
                    long_term: StoreSpec) -> MemoryBlock:
  """The store's tokens in [end - span, end): for the store, a query stands at `end` (`StreamPlan.batch`).
  original layout: end = the window's first scored token, span = mem_size (the last mem_size scored tokens;
  the window's context tokens are among them). disjoint: end = the window's start (tokens from there on are
  the window's own, seen as local memory), span = mem_size + context_window - the window's context length
  (= mem_size whenever the window has its full context). Either span stops at the window's store start
  (`StreamPlan.store_start`: after a line complete mode dropped, the store starts afresh, as the original's)."""
  doc_q, doc_m = (doc_SxQ, store.doc) if long_term.reset_at_documents else (0, 0)
  query = _meta(targets_SxQ, order=store_end_S[:, None], doc=doc_q)
  mem = _meta(store.targets, order=store.pos, doc=doc_m)
  return _block(scoring.block_similarities(queries_SxQxD, store.keys), query, mem, causal=True, cross_rows=False,
                span=jnp.broadcast_to(span_S[:, None], targets_SxQ.shape))


def l2_block(block: MemoryBlock, queries_SxQxD, keys_SxMxD) -> MemoryBlock:
  """`block` (local or long-term: sim = g·k/√D of `queries` with `keys`) with sim = -|g - k|² instead, the
  kNN-LM families' similarity under eval.knnlm_metric="l2" (so that knnlm_cache's one p_mem has one similarity
  over local, long-term and L2-retrieved memories): 2·√D·sim - |g|² - |k|²."""
  d = queries_SxQxD.shape[-1]
  qq = jnp.sum(jnp.square(queries_SxQxD.astype(jnp.float32)), -1)[..., :, None]
  kk = jnp.sum(jnp.square(keys_SxMxD.astype(jnp.float32)), -1)[..., None, :]
  return block._replace(sim=2.0 * math.sqrt(d) * block.sim - qq - kk)  # (a Python float: weakly typed)


def external_block(sim_SxQxK, retrieved_targets_SxQxK, targets_SxQ) -> MemoryBlock:
  """The retrieved entries: rows of their own (row -1), visible to every query unless padding (target -1)."""
  query = _meta(targets_SxQ[..., None], row=0)  # [S, Q, 1]: each query against its own K entries
  mem = _meta(retrieved_targets_SxQxK, row=-1, group=-1)
  blk = _block(sim_SxQxK, query, mem, causal=False, cross_rows=True)
  return MemoryBlock(sim_SxQxK, blk.visible[..., 0, :], blk.positive[..., 0, :])



@dataclasses.dataclass
class StreamPlan:
  """What the driver runs: the windows, which window each stream runs at each step (`data.stream_schedule`),
  and the empty long-term store."""

  num_targets: int
  wins: list
  schedule: np.ndarray  # [T, streams] window index, -1 = idle
  score: np.ndarray  # [T, streams] bool: scored (False: warm-up, insert only)
  queries: int  # Q: query positions per window (block_len - context_window; complete mode: its longest block,
  #   rounded up)
  store: long_memory.Store
  doc_starts: np.ndarray
  block_len: int  # L: model input length
  long_term: StoreSpec
  context_window: int
  store_start: np.ndarray  # [windows] where each window's long-term store begins: the score start of the first
  #   window after the last dropped line (complete mode, `data.complete_windows`; the original clears its store
  #   there: "Memory doesn't match. Clear!"), else 0
  scored_targets: int  # targets the windows score: num_targets minus those of dropped lines
  dropped_lines: int  # lines longer than block_len that complete mode dropped
  fresh: np.ndarray | None = None  # [windows] bool: a stateful model's carry starts afresh at this window even
  #   where its stream ran the window before (`texts_plan`: the first window of each text); None: nowhere
  separators: int = 0  # target positions no window scores by design (`texts_plan`: the `</s>` before each text)
  cut_block_len: int = 0  # the block length the windows were cut for (`texts_plan`: its block_len, which rows
  #   shorter than it, `block_len` here, stand in for; 0: block_len)

  def batch(self, corpus: data.Corpus, step: int) -> dict:
    """Host arrays of step `step`: inputs / targets [S, L]; start, offset (score_start - start), qstart (the
    first of the Q query positions: the offset, or earlier where Q positions from it would pass L; those
    before the offset are not scored), store_end, span (the store's tokens a query sees: [store_end - span,
    store_end), `long_term_block`), reset (a stateful model's
    stream does not continue its previous step's window) [S]; doc_q [S, Q]
    document of each query; own [S, Q] bool: the query is one of its window's scored targets; score, insert
    [S] bool."""
    idx = self.schedule[step]
    ws = [self.wins[max(i, 0)] for i in idx]
    inputs, targets, _ = data.window_batch(corpus, ws, self.block_len)
    start = np.array([w.start for w in ws], np.int32)
    offset = np.array([w.score_start - w.start for w in ws], np.int32)
    qstart = np.minimum(offset, self.block_len - self.queries)
    qpos = start[:, None] + qstart[:, None] + np.arange(self.queries)[None, :]
    ends = np.array([w.end for w in ws], np.int32)
    # A stateful model's stream continues only from the window right before (the stream's previous step).
    prev = self.schedule[step - 1] if step else np.full_like(idx, -1)
    reset = (prev < 0) | (idx != prev + 1)
    if self.fresh is not None:
      reset = reset | self.fresh[np.maximum(idx, 0)]
    return {"inputs": inputs, "targets": targets, "start": start, "offset": offset, "qstart": qstart, "reset": reset,
            **self._store_view(start, offset, self.store_start[np.maximum(idx, 0)]),
            "own": (qpos >= (start + offset)[:, None]) & (qpos < ends[:, None]),
            "doc_q": (np.searchsorted(self.doc_starts, qpos, side="right") - 1).astype(np.int32),
            "score": self.score[step], "insert": idx >= 0}

  def only_streams(self, lo: int, hi: int) -> "StreamPlan":
    """The plan of streams [lo, hi) alone (one process's share, `sharding.process_streams`): their columns of
    the schedule and their stores, up to the last step any of them runs. Every stream runs as in the whole
    plan; `scored_targets` stays the whole plan's."""
    busy = np.flatnonzero((self.schedule[:, lo:hi] >= 0).any(axis=1))
    steps = int(busy[-1]) + 1 if len(busy) else 0
    return dataclasses.replace(self, schedule=self.schedule[:steps, lo:hi], score=self.score[:steps, lo:hi],
                               store=jax.tree_util.tree_map(lambda x: x[lo:hi], self.store))

  def _store_view(self, start, offset, store_start) -> dict:
    # the span never reaches before the window's store start (a no-op without dropped lines: positions >= 0)
    if self.long_term.layout == "original":
      end = start + offset
      return {"store_end": end, "span": np.minimum(self.long_term.mem_size, end - store_start).astype(np.int32)}
    span = np.minimum(self.long_term.reach(self.context_window) - offset, np.maximum(start - store_start, 0))
    return {"store_end": start, "span": span.astype(np.int32)}


def _store_starts(wins, first: int) -> np.ndarray:
  """[windows] where each window's long-term store begins (`StreamPlan.store_start`): `first` (the stream's
  first target), or the score start of the first window after the last dropped line before it (complete mode:
  the original clears its store there)."""
  score_start = np.array([w.score_start for w in wins], np.int64)
  end = np.array([w.end for w in wins], np.int64)
  gap = np.concatenate([[True], score_start[1:] != end[:-1]])  # a window right after dropped lines
  store_start = np.where(gap, score_start, first)
  store_start[0] = first
  return np.maximum.accumulate(store_start)


QUERY_ROUND = 128  # complete mode's query count Q above the stride is rounded up to this (`stream_plan`)


def _queries(wins, block_len: int, context_window: int, break_mode: str) -> int:
  """Q, the query positions per window: the stride S = block_len - context_window. Complete mode's blocks of
  whole lines hold up to block_len scored tokens (a long line): there Q is the longest block, rounded up to S
  (blocks pack lines up to S tokens), above it to a multiple of QUERY_ROUND, at most block_len. The jitted
  steps' shapes follow Q, and the Python API scores texts on their own: texts whose lines all fit in S share
  one compile, longer ones a few (before: one compile per distinct longest block). Queries past a block's end
  are neither scored nor stored (`StreamPlan.batch`'s `own`)."""
  q = block_len - context_window
  if break_mode == "complete":
    longest = max(w.end - w.score_start for w in wins)
    if longest > q:
      q = min(block_len, -(-longest // QUERY_ROUND) * QUERY_ROUND)
  return q


def stream_plan(corpus: data.Corpus, *, block_len: int, context_window: int, streams: int,
                long_term: StoreSpec, d_model: int, dtype, max_tokens: int = 0,
                break_mode: str = "none", overlong: str = "drop") -> StreamPlan:
  """`overlong`: complete mode's lines longer than block_len, dropped as fairseq's eval_lm or refused
  (`data.complete_windows`)."""
  n = len(corpus) if not max_tokens else min(max_tokens, len(corpus))
  wins = data.eval_windows(corpus, n, block_len, context_window, break_mode, overlong)
  score_start = np.array([w.score_start for w in wins], np.int64)
  end = np.array([w.end for w in wins], np.int64)
  store_start = _store_starts(wins, 0)
  dropped = 0
  if break_mode == "complete" and end.sum() - score_start.sum() < n:
    dropped = int((data.line_lengths(np.asarray(corpus.tokens[:n]), corpus.vocab.eos) > block_len).sum())
  reach = long_term.reach(context_window)  # warm-up windows and store slots: what the store must still hold
  schedule, score = data.stream_schedule(wins, corpus.doc_starts, streams, long_term.mem_size,
                                         long_term.reset_at_documents, context_window=reach - long_term.mem_size,
                                         store_starts=np.unique(store_start))
  q = _queries(wins, block_len, context_window, break_mode)
  store = long_memory.empty(streams, long_memory.capacity(reach, 0, q), d_model, dtype)
  return StreamPlan(n, wins, schedule, score, q, store, np.asarray(corpus.doc_starts, np.int64), block_len,
                    long_term, context_window, store_start, int((end - score_start).sum()), dropped)


def _bucket(n: int) -> int:
  """A length rounded up for `texts_plan`'s shapes: to a power of two (at least 8) up to QUERY_ROUND, above it to
  a multiple of QUERY_ROUND: at most twice the length, and few distinct shapes (compiles) over many calls."""
  if n <= QUERY_ROUND:
    return min(QUERY_ROUND, max(8, 1 << (n - 1).bit_length()))
  return -(-n // QUERY_ROUND) * QUERY_ROUND


def text_windows(ids, vocab: data.Vocab, block_len: int, context_window: int, break_mode: str = "none",
                 overlong: str = "drop") -> list[data.Window]:
  """The windows of one text scored as a corpus of its own (`texts_plan` shifts them into its layout)."""
  return data.eval_windows(data.Corpus.from_docs([ids], vocab, name="the text"), len(ids), block_len, context_window,
                           break_mode, overlong)


def check_break_mode_of_stateful(stateful: bool, break_mode: str) -> None:
  """A stateful model (SRU++) carries its state from block to block, and complete mode pads each block of whole
  lines: its recurrence and attention memory would run through the padding. Refused (ConfigError)."""
  if stateful and break_mode == "complete":
    raise ConfigError("a stateful model (SRU++) carries its state from block to block, and complete mode pads each "
                      "block of whole lines: the state would run through the padding. Use "
                      "eval.sample_break_mode=none")


def row_length(wins, block_len: int, stateful: bool = False) -> int:
  """The model input length `texts_plan` gives one text's windows `wins`: the longest, rounded up (`_bucket`),
  at most block_len. Texts grouped by it run without rows longer than they need. A stateful model carries its
  state out of the row's last position, so a text of several windows keeps rows of block_len, as alone."""
  if stateful and len(wins) > 1:
    return block_len
  return min(block_len, _bucket(max(w.end - w.start for w in wins)))


def texts_plan(texts, vocab: data.Vocab, *, block_len: int, context_window: int, rows: int, d_model: int, dtype,
               break_mode: str = "none", overlong: str = "drop", mem_size: int = 0, layout: str = "original",
               stateful: bool = False, windows=None) -> tuple[data.Corpus, StreamPlan, list[int]]:
  """Independent texts (token arrays) scored `rows` at a time, each exactly as a corpus of its own: its own
  windows (`data.eval_windows`, starting at `</s>`, at most `block_len` long: `plan.block_len` is the longest
  of them, rounded up, the model's input length), local memory, and with `mem_size` a long-term store of
  the text's own earlier tokens in `layout` (`StoreSpec.layout`, as `stream_plan` with that mem_size: at least
  the longest text, so that a store holds every earlier token of its text; cleared after a line complete mode
  drops, as alone). `stateful`: the model carries a state from window to window (`row_length`). `windows`:
  each text's `text_windows` at these settings, where the caller has them already. (corpus, plan,
  the targets each text's windows score, in text order; the evaluator's per-token nll lists them so.)

  The texts are laid out one after another in `corpus`, each after a `</s>` of its own that no window scores
  (so a text's first window reads `</s>` first, as alone; no window reaches into another text). Each row runs
  whole texts, longest first onto the row with the fewest windows; a stateful model's carry starts afresh at
  each text (`StreamPlan.fresh`), and the store shows a query its own text's tokens only
  (`StoreSpec.reset_at_documents`: each text is a document of `corpus`), not the texts run before it."""
  if rows < 1:
    raise ConfigError(f"rows must be >= 1, got {rows}")
  check_break_mode_of_stateful(stateful, break_mode)
  texts = [np.asarray(t, np.int32) for t in texts]
  if not texts or any(not len(t) for t in texts):
    raise ConfigError("texts_plan needs texts with tokens")
  bos = np.array([vocab.bos], np.int32)
  corpus = data.Corpus.from_docs([np.concatenate([bos, t]) for t in texts], vocab)
  wins, first_of, scored, dropped, store_start, length = [], [], [], 0, [], 0
  for i, (t, off) in enumerate(zip(texts, corpus.doc_starts[:-1] + 1)):  # its targets start after its `</s>`
    own = windows[i] if windows is not None else text_windows(t, vocab, block_len, context_window, break_mode,
                                                               overlong)
    if break_mode == "complete" and sum(w.end - w.score_start for w in own) < len(t):
      dropped += int((data.line_lengths(t, vocab.eos) > block_len).sum())
    length = max(length, row_length(own, block_len, stateful))
    shift = lambda a: int(a) + int(off)
    first_of.append(len(wins))
    own = [data.Window(shift(w.start), shift(w.score_start), shift(w.end),
                       tuple((shift(a), shift(b)) for a, b in w.context)) for w in own]
    wins += own
    store_start.append(_store_starts(own, int(off)))
    scored.append(sum(w.end - w.score_start for w in own))
  bounds = first_of + [len(wins)]
  load, lanes = np.zeros(rows, np.int64), [[] for _ in range(rows)]
  for i in sorted(range(len(texts)), key=lambda i: bounds[i] - bounds[i + 1]):  # most windows first
    r = int(np.argmin(load))
    lanes[r] += range(bounds[i], bounds[i + 1])
    load[r] += bounds[i + 1] - bounds[i]
  schedule = np.full((int(load.max()), rows), -1, np.int64)
  for r, lane in enumerate(lanes):
    schedule[:len(lane), r] = lane
  fresh = np.zeros(len(wins), bool)
  fresh[first_of] = True
  if mem_size and mem_size < max(map(len, texts)):
    raise ConfigError(f"texts_plan: mem_size={mem_size} is shorter than the longest text ({max(map(len, texts))} "
                      f"tokens): a text's store would not hold every earlier token")
  long_term = StoreSpec(mem_size=mem_size, reset_at_documents=bool(mem_size), layout=layout)
  # Rows as long as the longest window (short texts: shorter than block_len) and Q as the longest block of
  # scored tokens, each rounded up (`_bucket`; Q to the stride where that is less): a causal model's scores at
  # a position do not depend on the padding after it, so the numbers stay (up to float rounding), and the cost
  # follows the texts' lengths (a stateful model's: `row_length`).
  longest, stride = max(w.end - w.score_start for w in wins), block_len - context_window
  q = min(length, min(stride, _bucket(longest)) if longest <= stride else _bucket(longest))
  store = long_memory.empty(rows, long_memory.capacity(long_term.reach(context_window), 0, q), d_model, dtype)
  plan = StreamPlan(len(corpus), wins, schedule, schedule >= 0, q, store, np.asarray(corpus.doc_starts, np.int64),
                    length, long_term, context_window, np.concatenate(store_start), int(sum(scored)),
                    dropped, fresh, len(texts), block_len)
  return corpus, plan, scored
