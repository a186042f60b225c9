"""The one driver: `evaluate` runs a stream plan (`memory.stream_plan`) with one jitted forward pass
(`forward_queries`), the host-side search of the external memory, and one jitted scoring step (`score_step`:
every point of `points.point_nlls` from the memory blocks) per step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from trime_jax import data
from trime_jax import exact_memory
from trime_jax import knn
from trime_jax import long_memory
from trime_jax import sharding
from trime_jax import steps
from trime_jax.errors import CheckpointError, ConfigError
from trime_jax.evaluate.memory import (QueryStats, StoreSpec, StreamPlan, check_break_mode_of_stateful,
                                       external_block, l2_block, local_block, long_term_block, stream_plan)
from trime_jax.evaluate.points import Point, exact_scales, point_nlls

SEARCH_QUERIES = 4096  # evaluate's search_queries (config eval.search_queries; exports before 2026-12-04 lack it)

# ----------------------------------------------------------------------------------------------------------
# The one step, in two jitted halves around the host-side search.
# ----------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("graphdef", "queries", "vocab_chunk"))
def forward_queries(graphdef, params, inputs_SxL, targets_SxL, qstart_S, carry=None, reset_S=None, *, queries: int,
                    vocab_chunk: int):
  """(keys [S, L, D], query keys [S, Q, D], query VocabStats [S, Q], query targets [S, Q], query window
  positions [S, Q][, new carry]): the Q positions from `qstart` on (they include every scored position of the
  window). A stateful model continues every stream from `carry` (reset where `reset_S`) and returns it too."""
  model = nnx.merge(graphdef, params)
  if carry is not None:
    carry = model.reset_carry(carry, reset_S)
    (stats, crit), keys, carry = steps.forward_carry(model, inputs_SxL, targets_SxL, carry, vocab_chunk=vocab_chunk,
                                                     criterion="both")
  else:
    (stats, crit), keys = steps.forward(model, inputs_SxL, targets_SxL, vocab_chunk=vocab_chunk, criterion="both")
  qpos = qstart_S[:, None] + jnp.arange(queries, dtype=jnp.int32)[None, :]
  take = lambda x: jnp.take_along_axis(x, qpos, axis=1)
  # the model's own target term (plain, cache, kNN-LM) and the TRIME softmax's (`model.vocab_stats` criterion)
  q_stats = QueryStats(take(stats.log_normalizer), take(stats.target_logit), take(crit))
  q_keys = jnp.take_along_axis(keys, qpos[:, :, None], axis=1)
  out = (keys, q_keys, q_stats, take(targets_SxL), qpos)
  return out if carry is None else out + (carry,)


@functools.partial(jax.jit, static_argnames=("points", "long_term", "n_buckets"), donate_argnames=("store",))
def score_step(store: long_memory.Store, keys, targets, q_keys, q_stats, q_targets, qpos, batch, ext_sim,
               ext_targets, bucket_q, ext_exact=None, knn_sim=None, knn_targets=None, *, points: tuple,
               long_term: StoreSpec, n_buckets: int):
  """(nll sums [P], per-bucket nll sums [P, n_buckets], per-bucket token counts [n_buckets], the store with
  this step's queries inserted, every query's nll [P, S, Q] (0 where not scored), its global target position
  [S, Q] (-1 where not scored)). External memory: top-K retrieved (`ext_sim`, `ext_targets` [S, Q, K]) or the
  exact on-device sums (`ext_exact`: (lse_neg, lse_pos) [C, S, Q] at `exact_scales(points)`). The kNN-LM
  families' own entries where they differ (eval.knnlm_metric="l2": `knn_sim` = -|q - k|², `knn_targets` [S, Q, K]
  of the L2 index's top-K, and their local and long-term memories by -|q - k|² too: `memory.l2_block`); None:
  they read the blocks every family reads."""
  pos = batch["start"][:, None] + qpos  # global target positions
  real = batch["own"] & (q_targets >= 0)
  local = [local_block(q_keys, q_targets, qpos, keys, targets)]
  if long_term.mem_size:
    local.append(long_term_block(store, q_keys, q_targets, batch["doc_q"], batch["store_end"], batch["span"],
                                 long_term))
  ext = external_block(ext_sim, ext_targets, q_targets) if ext_sim is not None else None
  if ext_exact is not None:
    ext = exact_memory.summary_blocks(*ext_exact, exact_scales(points))
  knn_memory = None
  if knn_sim is not None:  # eval.knnlm_metric="l2": every memory of the kNN-LM families by -|q - k|²
    knn_local = [l2_block(local[0], q_keys, keys)]
    if long_term.mem_size:
      knn_local.append(l2_block(local[1], q_keys, store.keys))
    knn_memory = (knn_local, external_block(knn_sim, knn_targets, q_targets))
  nll = point_nlls(q_stats, q_targets, local, ext, points, knn_memory=knn_memory)  # [P, S, Q]
  scored = real & batch["score"][:, None]
  nll = jnp.where(scored[None], nll, 0.0)
  onehot = jax.nn.one_hot(bucket_q, n_buckets, dtype=nll.dtype) * scored[..., None]
  store = long_memory.insert(store, q_keys, q_targets, pos, batch["doc_q"], real & batch["insert"][:, None])
  return (nll.sum(axis=(1, 2)), jnp.einsum("psq,sqb->pb", nll, onehot), onehot.sum(axis=(0, 1)), store,
          nll, jnp.where(scored, pos, -1))



class Dispatched(NamedTuple):
  """A step on its way: the host batch (numpy, read by the search), the same on the devices, the forward pass."""
  batch: dict
  placed: dict
  out: tuple


@dataclasses.dataclass(frozen=True)
class _stream_placement:
  """Where evaluate's arrays go over `mesh`: a stream's rows (the leading axis of every batch, store and state
  array) on the device that holds the stream, the parameters on every device. Without a mesh (or with one
  device) nothing is moved: jit places them as before."""
  mesh: object
  num_streams: int

  def __post_init__(self):
    if self.mesh is not None and self.num_streams % self.mesh.size:
      raise ConfigError(f"{self.num_streams} evaluation streams (eval.batch_size) do not split over the mesh's "
                        f"{self.mesh.size} devices (eval.devices): make them a multiple of {self.mesh.size}")

  @property
  def active(self) -> bool:
    return self.mesh is not None and self.mesh.size > 1

  def replicated(self, tree):
    return jax.device_put(tree, sharding.replicated(self.mesh)) if self.active and tree is not None else tree

  def streams(self, tree):
    if not self.active or tree is None:
      return tree
    rows, whole = sharding.batch_sharding(self.mesh), sharding.replicated(self.mesh)
    where = jax.tree_util.tree_map(lambda x: rows if np.ndim(x) and np.shape(x)[0] == self.num_streams else whole,
                                   tree)
    return jax.device_put(tree, where)  # one call for the whole tree


# ----------------------------------------------------------------------------------------------------------
# The one driver.
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Score:
  point: Point
  nll: float  # mean nats per scored token
  tokens: int
  seconds: float
  bytes_level: bool

  @property
  def name(self) -> str:
    return self.point.name

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


@dataclasses.dataclass(frozen=True)
class StreamState:
  """A one-stream evaluation after its first windows: the long-term store (and a stateful model's carry) that
  `windows` left. An evaluation of a stream that begins with the same windows over the same tokens (the
  Python API's memory documents before each text) can start there (`evaluate(..., start=...)`), with the
  same parameters: that one is the caller's to keep (the API drops its states when they change)."""

  windows: tuple  # the windows run (`data.Window`), in order
  queries: int  # the plan's Q (the jitted steps' shapes)
  tokens_digest: str  # of the corpus tokens up to the last window's end (every token those windows read)
  graphdef: object  # the model's structure
  store: long_memory.Store
  carry: object = None

  @staticmethod
  def digest(corpus: data.Corpus, end: int) -> str:
    return hashlib.sha256(np.ascontiguousarray(corpus.tokens[:end], np.int32).tobytes()).hexdigest()

  def fits(self, plan, corpus: data.Corpus, graphdef) -> bool:
    """The plan begins with these windows over the same tokens, at the same shapes, for the same model
    structure, and has windows after them."""
    k = len(self.windows)
    shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(tree)]
    return (plan.queries == self.queries and len(plan.wins) > k and tuple(plan.wins[:k]) == self.windows
            and bool(plan.score[:k].all()) and shapes(plan.store) == shapes(self.store)
            and graphdef == self.graphdef and self.digest(corpus, self.windows[-1].end) == self.tokens_digest)


@dataclasses.dataclass
class EvalResult:
  scores: list  # [Score] per point, in the order given
  bucket_nll: np.ndarray  # [P, n_buckets] mean nll per frequency bucket (nan where a bucket is empty)
  bucket_tokens: np.ndarray  # [n_buckets]
  retrieval_hits: np.ndarray | None  # [len(retrieval_ks)] scored tokens whose target is in the top-k next
  #   tokens (None: exact on-device memory, no ranking)
  seconds: float
  search_seconds: float
  token_nll: np.ndarray | None = None  # [P, tokens] float32 nll of every scored target in stream order
  #   (`evaluate(..., per_token=True)`; complete mode's dropped lines have none), e.g. to compare with another
  #   implementation token by token
  state: StreamState | None = None  # `evaluate(..., keep_state_before=...)`: where a later evaluation can start
  started_at: int = 0  # windows not run because `evaluate(..., start=...)` held their state (0: from the start)
  retrieval_ks: tuple = knn.RETRIEVAL_KS  # the k of each retrieval_hits entry: knn.retrieval_ks(K) of the search

  @property
  def tokens(self) -> int:
    return self.scores[0].tokens

  def retrieval_accuracy(self) -> dict:
    if self.retrieval_hits is None:
      return {}
    return {f"top{k}": float(h) / max(self.tokens, 1) for k, h in zip(self.retrieval_ks, self.retrieval_hits)}


class ProgressLog:
  """Plain progress lines on stderr where no one watches a bar: after the first step (its time includes
  compilation), then every `every_s` seconds with the rate since the first step and the ETA, and at the end."""

  def __init__(self, desc: str, total: int, every_s: float = 60.0):
    self.desc, self.total, self.every_s = desc, total, every_s
    self.t0 = self.last = time.perf_counter()
    self.t1 = None  # after the first step

  def step(self, done: int) -> None:
    now = time.perf_counter()
    if done > 1 and done < self.total and now - self.last < self.every_s:
      return
    line = f"{self.desc}: step {done:,}/{self.total:,} after {now - self.t0:,.0f} s"
    if self.t1 is None:
      self.t1 = now
      line += " (the first step compiles)"
    elif done < self.total:
      rate = (done - 1) / max(now - self.t1, 1e-9)
      line += f", {rate:.3g} steps/s, ETA {(self.total - done) / rate:,.0f} s"
    print(line, file=sys.stderr, flush=True)
    self.last = now


def process_share(streams: int, external=None, split_over_processes: bool = True) -> tuple[int, int] | None:
  """[lo, hi): the streams this process evaluates when `evaluate` splits them over the processes of a run of
  several (`sharding.process_streams`), None where each process computes them all: `split_over_processes` off,
  or an on-device datastore (its keys span every process's devices)."""
  if not split_over_processes or isinstance(external, exact_memory.DeviceDatastore):
    return None
  return sharding.process_streams(streams)


def _gathered(arrays: dict) -> dict:
  """Every process's `arrays` (numpy, the same names, shapes and dtypes on each), stacked [processes, ...]: one
  all-gather of their bytes, so that float64 sums cross exactly (JAX would carry them as float32)."""
  from jax.experimental import multihost_utils  # here: a run of several processes only

  names = sorted(arrays)
  parts = [np.ascontiguousarray(arrays[k]) for k in names]
  every = np.asarray(multihost_utils.process_allgather(
      np.concatenate([p.reshape(-1).view(np.uint8) for p in parts])))  # [processes, bytes]
  out, a = {}, 0
  for k, p in zip(names, parts):
    b = a + p.nbytes
    out[k] = np.stack([np.frombuffer(row[a:b].tobytes(), p.dtype).reshape(p.shape) for row in every])
    a = b
  return out


def evaluate(graphdef, params, corpus: data.Corpus, points, *, block_len: int, context_window: int, streams: int,
             long_term: StoreSpec = StoreSpec(),
             external: knn.ExternalMemory | exact_memory.DeviceDatastore | None = None, vocab_chunk: int = 0,
             max_tokens: int = 0, word_buckets_V=None, progress: bool | str = False,
             break_mode: str = "none", per_token: bool = False, complete_overlong: str = "drop",
             log=None, overlap_search: bool = False, search_queries: int = SEARCH_QUERIES,
             start: StreamState | None = None,
             keep_state_before: int = 0, plan: StreamPlan | None = None, mesh=None,
             split_over_processes: bool = True) -> EvalResult:
  """Score `corpus` under every point in one pass: `streams` parallel streams, each with a long-term store of
  `long_term.mem_size` tokens, plus one top-K search per scored token when `external` is given (a
  `knn.ExternalMemory`), or every datastore entry (an `exact_memory.DeviceDatastore`: exact sums on device,
  no retrieval accuracy). A Transformer's results do not depend on `streams` (up to float rounding): each
  stream's warm-up windows fill its store as one stream would have. A stateful model's (SRU++) do: its carry
  starts afresh where a stream (or its warm-up) starts, so with more streams fewer windows see a state carried
  from the corpus start (docs/srupp.md). `break_mode`: fairseq's
  --sample-break-mode of the windows (`data.eval_windows`); `complete_overlong`: what complete mode does with a
  line longer than block_len: "drop" as fairseq's eval_lm (not scored, one line on stderr says how many),
  "refuse" (a ConfigError naming it). `progress`: True a tqdm bar, "log" plain lines on
  stderr (`ProgressLog`: a log file, or a remote accelerator's output), False nothing. `per_token`: also
  every scored target's nll under every point (`EvalResult.token_nll`). `log(line)`: where the note on dropped
  lines goes (default: stderr; the Python API sends it to `logging`). `overlap_search`: dispatch the next
  group's forward passes (a group: one step, or `search_queries`'s) before this group's datastore search, scoring
  and read-back, so that device and host work at once (config eval.overlap_search; False: one group after the
  other; the same numbers either way).
  `search_queries` (config eval.search_queries): a FAISS index is searched once per group of
  ⌊search_queries / (streams × Q)⌋ consecutive steps (at least one), with every scored query of the group: FAISS
  costs several times more per query in calls of tens of queries than of thousands (docs/performance.md "Queries
  per FAISS call"), and a step's keys depend only on the parameters, so the group's forward passes run first and
  its steps are scored in order after the one search. The neighbours are FAISS's answers to the larger call:
  faiss-cpu 1.15.1's exact IndexFlatIP computes inner products with BLAS sgemm from queries × D = 128,000 on
  (faiss.cvar.distance_compute_blas_threshold) and with its own loop below, which round differently (~1e-5 on
  inner products of ~50), so a near-tie at the top-K boundary can go the other way (bench/eval_search_calls.py).
  A group also ends where `keep_state_before`'s state is kept, so that a stream resumed from it searches the same
  groups as the uncut run after it. 0: one search per step. Not with `exact_memory.DeviceDatastore` (its search
  is device work, step by step).

  One stream only: `keep_state_before=P` keeps the state after the windows that end at or before target
  position P (`EvalResult.state`); `start=` such a state skips those windows where this plan begins with them at
  the same shapes (`StreamState.fits`; otherwise everything runs, `EvalResult.started_at` says which). The
  skipped windows' targets are not scored: the scores and per-token nll (NaN there) cover the windows after.

  `plan`: run this plan of `corpus` instead of `stream_plan`'s (`texts_plan`: many independent texts; block_len
  its `block_len`). The plan's windows, rows and long-term store replace what `break_mode`, `complete_overlong`,
  `max_tokens`, `streams` and `long_term` would give: `long_term`, `start` and `keep_state_before` stay unset.

  `mesh` (config eval.devices, `sharding.eval_mesh`; None: one device): the streams are split over its `data`
  axis, each device holding whole streams (their windows, long-term stores and states) and the parameters
  replicated, so every step's work divides among the devices with no communication but the sums' (the streams
  must be a multiple of the device count). The same numbers as on one device, up to float rounding.

  `split_over_processes`: in a run of several processes (`jax.distributed`) whose streams are a multiple of the
  processes, each process computes its own contiguous share of them (`sharding.process_streams`; `mesh` then of
  its own devices, dividing its share), searches a FAISS datastore for its own queries only, and the sums,
  retrieval counts and per-token nll are gathered: every process returns the whole result. The call is then a
  collective: every process must make it, with the same corpus and settings (training's dev evaluation does).
  False, or an on-device datastore (`exact_memory.DeviceDatastore`, whose keys span every process's devices):
  each process computes every stream, alone (the Python API, whose processes score texts of their own)."""
  points = tuple(points)
  if not points:
    raise ConfigError("nothing to evaluate: no points")
  if any(p.needs_external for p in points) and external is None:
    raise ConfigError("external-memory families (trime, interp, knnlm, knnlm_cache) need a datastore + index "
                      "(eval.datastore)")
  if streams < 1:
    raise ConfigError(f"eval.batch_size (streams) must be >= 1, got {streams}")
  if search_queries < 0:
    raise ConfigError(f"eval.search_queries must be >= 0, got {search_queries}")
  model = nnx.merge(graphdef, params)
  model_cfg, stateful = model.cfg, bool(getattr(model, "stateful", False))
  if stateful and context_window:
    raise ConfigError(f"a stateful model ({model_cfg.backbone}) carries its state from window to window: "
                      f"eval.context_window must be 0, got {context_window}")
  check_break_mode_of_stateful(stateful, break_mode)
  if block_len > model_cfg.max_len:
    raise CheckpointError(f"eval.block_len={block_len} exceeds the model's max_len={model_cfg.max_len}")
  if external is not None and external.dimension != model_cfg.d_model:
    raise ConfigError(f"datastore keys have dimension {external.dimension}, the model's keys {model_cfg.d_model}")
  if plan is None:
    plan = stream_plan(corpus, block_len=block_len, context_window=context_window, streams=streams,
                       long_term=long_term, d_model=model_cfg.d_model, dtype=jnp.dtype(model_cfg.dtype),
                       max_tokens=max_tokens, break_mode=break_mode, overlong=complete_overlong)
  elif (long_term.mem_size or start is not None or keep_state_before or plan.block_len != block_len
        or plan.context_window != context_window or plan.num_targets != len(corpus)):
    raise ConfigError("evaluate(plan=): a plan of this corpus at this block_len and context_window, without "
                      "long_term= (the plan has its own), start= or keep_state_before=")
  else:
    long_term = plan.long_term
  if (start is not None or keep_state_before) and streams != 1:
    raise ConfigError(f"evaluate(start=, keep_state_before=) take one stream, got streams={streams}")
  # A run of several processes: each computes its own share of the streams on its own devices (`mesh` is of
  # this process's devices), and the sums are gathered at the end (`_gathered`). Streams that do not split over
  # the processes: each computes every one, on the parameters as they are.
  share = process_share(plan.schedule.shape[1], external, split_over_processes)
  if share is not None:
    plan, params = plan.only_streams(*share), sharding.local_copy(params)
  n, store = plan.scored_targets, plan.store
  if plan.dropped_lines:
    (log or (lambda line: print(line, file=sys.stderr, flush=True)))(
        f"eval: sample_break_mode=complete dropped {plan.dropped_lines:,} lines longer than eval.block_len="
        f"{plan.cut_block_len or block_len} ({plan.num_targets - plan.separators - n:,} of {plan.num_targets - plan.separators:,} tokens "
        f"not scored), as fairseq's eval_lm "
        f"does (eval.complete_overlong=drop; refuse: an error instead)")
  num_streams = plan.schedule.shape[1]  # (a process's share of them may have no step to run)
  carry = model.init_carry(num_streams, block_len) if stateful else None
  del model
  place = _stream_placement(mesh, num_streams)
  params, store, carry = place.replicated(params), place.streams(store), place.streams(carry)
  first = 0  # the first step run
  if start is not None and start.fits(plan, corpus, graphdef):
    first = len(start.windows)
    store = jax.tree_util.tree_map(jnp.copy, start.store)  # score_step donates its store: the state's stays
    carry = start.carry  # (one stream: on one device)
    n -= sum(w.end - w.score_start for w in plan.wins[:first])
  keep = 0  # the state is kept after this many windows
  if keep_state_before:
    keep = next((i for i, w in enumerate(plan.wins) if w.end > keep_state_before), len(plan.wins))
  state = start if first and keep == first else None
  buckets = np.zeros(model_cfg.vocab_size, np.int32) if word_buckets_V is None else np.asarray(word_buckets_V)
  n_buckets = len(knn.FREQ_BUCKETS)
  totals = np.zeros(len(points))
  bucket_totals = np.zeros((len(points), n_buckets))
  bucket_counts = np.zeros(n_buckets)
  token_nll = np.full((len(points), plan.num_targets), np.nan, np.float32) if per_token else None
  search_s0 = external.search_seconds if external is not None else 0.0
  on_device = isinstance(external, exact_memory.DeviceDatastore)
  ks = knn.retrieval_ks(external.k) if external is not None and not on_device else knn.RETRIEVAL_KS
  hits = np.zeros(len(ks), np.int64)
  # Every key on the devices: the "search" is device work the host waits for, so an early forward pass would
  # only be counted in its time (search_seconds); the steps keep their order there.
  overlap_search = overlap_search and not on_device
  scales = exact_scales(points)
  t0 = time.perf_counter()
  # the corpus's name tells eval.tune's dev pass from the split's (e.g. wikitext_mini:dev, wikitext_mini:test)
  desc = ("eval" + (f" {corpus.name}" if corpus.name else "") + (" (external)" if external else "")
          + (f" mem={long_term.mem_size}" if long_term.mem_size else ""))
  log = ProgressLog(desc, len(plan.schedule)) if progress == "log" else None
  n_steps = len(plan.schedule)

  # Steps per FAISS search (`search_queries`): the forward passes of a group are dispatched together, their
  # queries searched in one call, and the steps scored in order; 1 step where nothing is searched on the host.
  rows_q = num_streams * plan.queries
  group_len = max(1, search_queries // rows_q) if search_queries > 0 and external is not None and not on_device else 1

  def dispatch(step, carry):
    """Step `step`'s host batch, the same on the devices (split by stream over `mesh`), and its forward pass,
    dispatched (jax runs it asynchronously)."""
    batch = plan.batch(corpus, step)
    placed = place.streams(batch)
    return Dispatched(batch, placed, forward_queries(
        graphdef, params, placed["inputs"], placed["targets"], placed["qstart"], carry,
        placed["reset"] if stateful else None, queries=plan.queries, vocab_chunk=vocab_chunk))

  # The groups [start, end): of group_len steps from `first` on, one ending where the state is kept, so that a
  # stream resumed from that state (start=) searches the same groups of queries as this one after it: FAISS's
  # rounding of a query can depend on the call it is in (docs/performance.md "Queries per FAISS call").
  groups, g0 = [], first
  while g0 < n_steps:
    end = min(g0 + group_len, n_steps)
    end = keep if g0 < keep < end else end
    groups.append((g0, end))
    g0 = end

  def dispatch_group(g, carry):
    """Group `g`'s steps dispatched in order, each continuing the previous one's carry."""
    steps_g = []
    for step in range(*groups[g]):
      steps_g.append(dispatch(step, carry))
      carry = steps_g[-1].out[5] if stateful else None
    return steps_g

  # eval.knnlm_metric="l2": the kNN-LM families' entries come from a second search, of the L2 index
  knn_l2 = (external is not None and not on_device and getattr(external, "l2_index", None) is not None
            and any(p.family in ("knnlm", "knnlm_cache") for p in points))

  def search_group(steps_g):
    """Each step's (ext_sim, ext_targets, ext_exact, knn_sim, knn_targets) [S, Q, K]: one search of the group's
    scored queries (and with eval.knnlm_metric="l2" one of the L2 index: knn_sim, knn_targets, else None)."""
    nonlocal hits
    if external is None:
      return [(None, None, None, None, None)] * len(steps_g)
    if on_device:  # every datastore entry, on the devices (retrieval accuracy does not apply)
      return [(None, None, external.log_terms(d.out[1], d.out[3], scales), None, None) for d in steps_g]
    q_targets_np = [np.asarray(d.out[3]) for d in steps_g]
    scored = [d.batch["own"] & (t >= 0) & d.batch["score"][:, None] for d, t in zip(steps_g, q_targets_np)]
    got = got_knn = None
    if any(m.any() for m in scored):  # one search per scored token; warm-up windows only fill the store
      queries = np.concatenate([np.asarray(d.out[1])[m] for d, m in zip(steps_g, scored)])
      got = external.retrieve(queries)
      hits += knn.retrieval_hits(got.targets, np.concatenate([t[m] for t, m in zip(q_targets_np, scored)]), ks)
      got_knn = external.retrieve_knnlm(queries) if knn_l2 else None

    def per_step(m, a, b, found):
      sim = np.zeros(m.shape + (external.k,), np.float32)
      tgt = np.full(m.shape + (external.k,), -1, np.int32)
      if m.any():
        sim[m], tgt[m] = found.sim[a:b], found.targets[a:b]
      return sim, tgt

    res, a = [], 0
    for m in scored:
      b = a + int(m.sum())
      ext_sim, ext_targets = per_step(m, a, b, got)
      knn_sim, knn_targets = per_step(m, a, b, got_knn) if knn_l2 else (None, None)
      res.append((ext_sim, ext_targets, None, knn_sim, knn_targets))
      a = b
    return res

  bar = tqdm(total=n_steps - first, desc=desc, disable=progress is not True, unit="step")
  pending = dispatch_group(0, carry) if groups else None
  for g, (g0, _) in enumerate(groups):
    steps_g, pending = pending, None
    if overlap_search and g + 1 < len(groups):
      # The next group's forward passes do not depend on this group's search or scoring (only on the carry), so
      # the device computes them while the host searches the datastore, reads back the sums and builds the next
      # batches below: none of these leaves the device idle. The same computations either way, in another order
      # (tests/test_ext_eval.py, tests/test_srupp.py).
      pending = dispatch_group(g + 1, steps_g[-1].out[5] if stateful else None)
    searched = search_group(steps_g)
    for step in range(g0, g0 + len(steps_g)):
      # freed once scored
      (_, placed, out), (ext_sim, ext_targets, ext_exact, knn_sim, knn_targets) = steps_g.pop(0), searched.pop(0)
      keys, q_keys, q_stats, q_targets, qpos = out[:5]
      carry = out[5] if stateful else None
      bucket_q = buckets[np.maximum(np.asarray(q_targets), 0)]
      ext_sim, ext_targets, bucket_q, knn_sim, knn_targets = place.streams(
          (ext_sim, ext_targets, bucket_q, knn_sim, knn_targets))
      sums, bucket_sums, bucket_count, store, step_nll, step_pos = score_step(
          store, keys, placed["targets"], q_keys, q_stats, q_targets, qpos, placed, ext_sim, ext_targets, bucket_q,
          ext_exact, knn_sim, knn_targets, points=points, long_term=long_term, n_buckets=n_buckets)
      if token_nll is not None:
        step_pos = np.asarray(step_pos)
        token_nll[:, step_pos[step_pos >= 0]] = np.asarray(step_nll)[:, step_pos >= 0]
      totals += np.asarray(sums, np.float64)
      bucket_totals += np.asarray(bucket_sums, np.float64)
      bucket_counts += np.asarray(bucket_count, np.float64)
      if step + 1 == keep and keep > first:  # a copy: the next score_step donates this store
        state = StreamState(tuple(plan.wins[:keep]), plan.queries,
                            StreamState.digest(corpus, plan.wins[keep - 1].end), graphdef,
                            jax.tree_util.tree_map(jnp.copy, store), carry)
      bar.update(1)
      if log is not None:
        log.step(step + 1)
    # before the next group
    del placed, out, keys, q_keys, q_stats, q_targets, qpos, ext_sim, ext_targets, ext_exact, knn_sim, knn_targets
    if not overlap_search and g + 1 < len(groups):
      pending = dispatch_group(g + 1, carry)
  bar.close()
  seconds = time.perf_counter() - t0
  search = (external.search_seconds - search_s0) if external is not None else 0.0
  if share is not None:  # every process's sums; each scored target's nll from the one process that scored it
    mine = {"totals": totals, "bucket_totals": bucket_totals, "bucket_counts": bucket_counts,
            "seconds": np.array([seconds, search]), "hits": hits, "token_nll": token_nll}
    every = _gathered({k: v for k, v in mine.items() if v is not None})
    totals, bucket_totals, bucket_counts, hits = (every[k].sum(axis=0) for k in ("totals", "bucket_totals",
                                                                                  "bucket_counts", "hits"))
    seconds, search = every["seconds"].max(axis=0)  # the slowest process's time, and the slowest search
    if token_nll is not None:
      scored_here = ~np.isnan(every["token_nll"])
      token_nll = np.where(scored_here.any(axis=0), np.where(scored_here, every["token_nll"], 0).sum(axis=0),
                           np.nan).astype(np.float32)
  if token_nll is not None and plan.scored_targets < plan.num_targets:  # the scored targets (dropped lines: none)
    token_nll = token_nll[:, np.concatenate([np.arange(w.score_start, w.end) for w in plan.wins])]
  is_bytes = corpus.vocab.kind == "bytes"
  scores = [Score(p, float(t / max(n, 1)), n, seconds, is_bytes) for p, t in zip(points, totals)]
  with np.errstate(invalid="ignore", divide="ignore"):
    bucket_nll = np.where(bucket_counts > 0, bucket_totals / bucket_counts, np.nan)
  return EvalResult(scores, bucket_nll, bucket_counts, None if on_device else hits, seconds, search, token_nll,
                    state, first, ks)
