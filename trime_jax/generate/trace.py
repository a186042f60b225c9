"""The retrieval trace: for each generated token, its probability, the share of it that came from memory and the
three memories contributing most (their source, next token and context), read from the parts of P(token) that
the step computed with the law itself (`scoring.log_contributions`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from trime_jax.generate.memory import Memories
from trime_jax.generate.text import Text

TRACE_CONTEXT = 6  # words (or 3x as many bytes) of context shown per memory in a retrieval trace


@dataclasses.dataclass
class TraceMemory:
  source: str  # local | long | external
  token: str
  context: str  # a few tokens before it
  share: float  # its part of P(token)


@dataclasses.dataclass
class TraceStep:
  token: str
  prob: float  # P(token) under the distribution it was sampled from (before temperature / top-k / top-p)
  memory_share: float  # the part of P(token) that came from memories
  top: list  # [TraceMemory] the memories contributing most, largest first

  def format(self) -> str:
    mems = " | ".join(f"{m.source} {m.share:.1%} {m.context}[{m.token}]" for m in self.top)
    return f"{self.token!r:>14} p={self.prob:.3f} memory {self.memory_share:5.1%}" + (f"  <- {mems}" if mems else "")


def trace_step(traces, tokens, active, log_p, log_parts, seqs, mems: Memories, text: Text) -> None:
  """Appends a `TraceStep` to `traces[r]` of every active row r: P(token), the share from memory and the three
  memories contributing most. `log_parts` [B, M_r] (None without memory): the log of each memory slot's part of
  P(token) in the row's slot order, the law's own terms (`scoring.log_contributions`, computed by the step);
  -inf for slots that gave nothing."""
  log_p = np.asarray(log_p, np.float64)
  log_parts = None if log_parts is None else np.asarray(log_parts, np.float64)
  for r in np.flatnonzero(active):
    w = int(tokens[r])
    p = float(np.exp(log_p[r, w]))
    top = []
    share = 0.0
    if log_parts is not None:
      pos = np.flatnonzero(np.isfinite(log_parts[r]))  # visible memories whose next token is w
      contrib = np.exp(log_parts[r, pos])
      share = float(contrib.sum() / max(p, 1e-300))
      for j in np.argsort(-contrib, kind="stable")[:3]:
        top.append(_describe(pos[j], float(contrib[j] / max(p, 1e-300)), r, seqs, mems, text))
    traces[r].append(TraceStep(text.token_str(w), p, min(share, 1.0), top))


def _describe(j, share, r, seqs, mems: Memories, text: Text) -> TraceMemory:
  """Memory slot j of row r: its source, next token and context."""
  context = lambda stream, end: text.context(stream, end, TRACE_CONTEXT)
  if j < mems.cap:  # local key j predicts seqs[r][j + 1]
    return TraceMemory("local", text.token_str(seqs[r][j + 1]), context(seqs[r], j + 1), share)
  j -= mems.cap
  if j < mems.n_store:
    store = mems.store
    return TraceMemory("long", text.token_str(int(store.tokens[j])), context(store.tokens, j), share)
  i = int(mems.ext_ids[r][j - mems.n_store])  # datastore entry i predicts values[i] = corpus token i
  values = mems.external.datastore.values
  return TraceMemory("external", text.token_str(int(values[i])), context(values, i), share)
