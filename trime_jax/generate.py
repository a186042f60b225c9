"""Autoregressive generation from an export, with TRIME's memory-augmented distribution as the next-token law.

    P(w | c) ∝ exp(logit_w) + Σ_{memories j with x_j = w} exp(g(c) · k_j / √D / τ)

computed by `scoring.memory_log_probs` (the dense segment-sum) for one query per row and step. The memories are
(key, next token) pairs, exactly as evaluation lays them out (`evaluate.memory`):

  none       the model's softmax alone
  local      the keys of the prompt and of every token generated so far, per row (each keyed once, in the
             window that fed it: evaluation's local memory + its unbounded long-term store)
  long       local + a `LongTermMemory` carried across calls (a document, a chat history: `read` fills it,
             every call appends its prompts and outputs unless remember=False), shared by all rows
  external   local (+ the long-term store if given) + the top-K entries a FAISS index retrieves from a
             `trime_jax.launch.build_datastore` datastore, one search per generated token; their similarities are exact
             (re-scored from the stored keys). Optionally Appendix A's interpolation
             (1 - λ)·P_trime(τ) + λ·P′(τ′), P′(w) ∝ Σ_{retrieved, x_j = w} exp(sim / τ′).
             Or every entry of the datastore, exactly, when it is on the devices (`Generator.on_device`,
             `exact_memory.exact_external_log_probs`: no search, no K; no interpolation or trace of its entries)

The model runs over a key/value cache (`TransformerLM.decode`): one prefill of the prompts (right-padded,
rows of different lengths), then one token per step. Sequences start with `vocab.bos`, as every evaluated
stream does. The context is a sliding window: when a row's window would pass max_len tokens, it restarts
from its last `keep` tokens (re-encoded; default max_len // 2), so every token is predicted from between
`keep` and max_len tokens; memory keys already computed stay. A prompt longer than max_len is keyed with
evaluation's windows (block max_len, context `keep`) and generation starts from its last `keep` tokens.

Sampling: temperature (0 = greedy), then top-k (ties at the k-th value kept), then top-p (the smallest set
of most probable tokens whose mass reaches p, ties kept), a key per (seed, row, step): a row's samples do
not depend on its batch's other rows' contents, only on its index.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trime_jax import checkpoint as ckpt
from trime_jax import data
from trime_jax import exact_memory
from trime_jax import knn
from trime_jax import scoring
from trime_jax.errors import CheckpointError, ConfigError

MEMORIES = ("none", "local", "long", "external")
INTERP_MEMORIES = ("external", "all")  # P′ over the retrieved entries only (the original release) or all
STORE_BLOCK = 1024  # the long-term store is padded to a multiple of this many slots
TRACE_CONTEXT = 6  # words (or 3x as many bytes) of context shown per memory in a retrieval trace


# ----------------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 1.0  # 0: greedy (argmax)
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  seed: int = 0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if self.top_k < 0:
      raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class MemorySpec:
  kind: str = "local"  # none | local | long | external
  tau: float | None = None  # τ on memory similarities g·g_j/√D (None: the export's eval.tau)
  knn_lambda: float = 0.0  # external: Appendix A's λ, the weight of P′ (0 = no interpolation)
  tau_prime: float = 1.0  # τ′ of P′
  interp_memory: str = "external"  # memories of P′: "external" (retrieved only) | "all"

  def __post_init__(self):
    if self.kind not in MEMORIES:
      raise ConfigError(f"memory must be one of {MEMORIES}, got {self.kind!r}")
    if (self.tau is not None and not self.tau > 0) or not self.tau_prime > 0:
      raise ConfigError(f"tau and tau_prime must be > 0, got {self.tau}, {self.tau_prime}")
    if not 0 <= self.knn_lambda < 1:
      raise ConfigError(f"knn_lambda must be in [0, 1), got {self.knn_lambda}")
    if self.knn_lambda and self.kind != "external":
      raise ConfigError("the interpolation (knn_lambda > 0) mixes in retrieved entries: it needs memory=external")
    if self.interp_memory not in INTERP_MEMORIES:
      raise ConfigError(f"interp_memory must be one of {INTERP_MEMORIES}, got {self.interp_memory!r}")


# ----------------------------------------------------------------------------------------------------------
# The next-token distribution and sampling (pure functions; tests compare them with NumPy references)
# ----------------------------------------------------------------------------------------------------------
def next_token_log_probs(logits_BxV, q_BxD, mem_keys_MxD, mem_targets_M, mem_mask_BxM, *, tau: float,
                         prime_M=None, knn_lambda: float = 0.0, tau_prime: float = 1.0):
  """log P [B, V] of the next token: `scoring.trime_log_probs`, every row's query against the memories its mask
  shows (memories with target < 0 are empty slots). With knn_lambda > 0: (1-λ)·P_trime + λ·P′, P′ over the
  visible memories where `prime_M` is True (rows that see none keep P_trime)."""
  return scoring.trime_log_probs(logits_BxV, q_BxD, mem_keys_MxD, mem_targets_M, mem_mask_BxM, tau=tau,
                                 prime_M=prime_M, knn_lambda=knn_lambda, tau_prime=tau_prime)


def filter_log_probs(log_p_BxV, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
  """Log-probabilities to sample from: tempered (temperature > 0), renormalised, and -inf outside the top-k
  and then outside the nucleus (the most probable tokens whose mass first reaches top_p). Ties at a cut are
  kept, so the result does not depend on how a sort orders equal values."""
  x = jax.nn.log_softmax(log_p_BxV / temperature if temperature > 0 else log_p_BxV, axis=-1)
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


# ----------------------------------------------------------------------------------------------------------
# Jitted halves of a step (the external search runs on the host between them)
# ----------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(1, 2))
def _all_keys(seed, rows: int, steps: int):
  """[steps, rows] keys: `row_keys` of every step."""
  return jax.vmap(lambda s: row_keys(seed, jnp.arange(rows), s))(jnp.arange(steps))


def _forward(graphdef, params, tokens_BxT, cache, pos_BxT, last_B):
  """(f, g [B, D] at each row's `last` position, g [B, T, D], cache)."""
  model = nnx.merge(graphdef, params)
  f, g, cache = model.decode(tokens_BxT, cache, pos_BxT)
  take = lambda x: jnp.take_along_axis(x, last_B[:, None, None], axis=1)[:, 0]
  return take(f), take(g), g, cache


def _next_token(graphdef, params, f_BxD, g_BxD, local_keys, local_targets, store_keys, store_targets, ext_keys,
                ext_targets, keys_B, slot_B, active_B, *, memory: MemorySpec, sampling: Sampling, trace: bool):
  """(tokens [B], log P [B, V], local memory with (g, token) inserted at `slot` of active rows, and for a trace
  the logits [B, V] and memory similarities g·k/√D [B, M] (-inf: empty))."""
  model = nnx.merge(graphdef, params)
  logits = model.logits(f_BxD[:, None])[:, 0].astype(jnp.float32)
  b, d = g_BxD.shape
  q = g_BxD.astype(jnp.float32)
  # One flat memory for the engine: every row's local and retrieved blocks (visible to their own row only) and
  # the store (visible to all rows); blocks in the trace's slot order (local, store, retrieved).
  own = lambda per_row: jnp.repeat(jnp.eye(b, dtype=bool), per_row, axis=1)  # [B, B·per_row]
  blocks = [(local_keys.reshape(-1, d), local_targets.reshape(-1), own(local_targets.shape[1]), False)]
  if store_keys is not None:
    blocks.append((store_keys, store_targets, jnp.ones((b, store_targets.shape[0]), bool), False))
  if ext_keys is not None:
    blocks.append((ext_keys.reshape(-1, d), ext_targets.reshape(-1), own(ext_targets.shape[1]), True))
  if memory.kind == "none":
    log_p = jax.nn.log_softmax(logits, axis=-1)
  else:
    keys = jnp.concatenate([k.astype(jnp.float32) for k, _, _, _ in blocks])
    targets = jnp.concatenate([t for _, t, _, _ in blocks])
    mask = jnp.concatenate([m for _, _, m, _ in blocks], axis=1)
    prime = jnp.concatenate([jnp.full(t.shape, is_ext or memory.interp_memory == "all") for _, t, _, is_ext in blocks])
    log_p = next_token_log_probs(logits, q, keys, targets, mask, tau=memory.tau, prime_M=prime,
                                 knn_lambda=memory.knn_lambda, tau_prime=memory.tau_prime)
  tokens = sample(log_p, keys_B, sampling)
  extra = None
  if trace:
    sims = None
    if memory.kind != "none":  # row views [B, M_r] of this step's memories: local slots, store, retrieved
      hi = jax.lax.Precision.HIGHEST
      views = [(jnp.einsum("bd,bmd->bm", q, local_keys, precision=hi), local_targets)]
      if store_keys is not None:
        views.append((jnp.einsum("bd,md->bm", q, store_keys.astype(jnp.float32), precision=hi),
                      jnp.broadcast_to(store_targets, (b,) + store_targets.shape)))
      if ext_keys is not None:
        views.append((jnp.einsum("bd,bmd->bm", q, ext_keys.astype(jnp.float32), precision=hi), ext_targets))
      sims = jnp.concatenate([v for v, _ in views], axis=1) / math.sqrt(d)
      sims = jnp.where(jnp.concatenate([t for _, t in views], axis=1) >= 0, sims, -jnp.inf)
    extra = (logits, sims)
  local_keys, local_targets = _remember(local_keys, local_targets, g_BxD, tokens, slot_B, active_B)
  return tokens, log_p, local_keys, local_targets, extra


def _remember(local_keys, local_targets, g_BxD, tokens_B, slot_B, active_B):
  """Local memory with each active row's (key, chosen token) at its slot."""
  rows = jnp.arange(g_BxD.shape[0])
  slot = jnp.where(active_B, slot_B, local_targets.shape[1])  # out of range: dropped
  local_keys = local_keys.at[rows, slot].set(g_BxD.astype(local_keys.dtype), mode="drop")
  return local_keys, local_targets.at[rows, slot].set(tokens_B, mode="drop")


def _exact_next_token(graphdef, params, f_BxD, g_BxD, local_keys, local_targets, store_keys, store_targets,
                      device_store, keys_B, slot_B, active_B, *, memory: MemorySpec, sampling: Sampling):
  """`_next_token` with every entry of an on-device datastore as external memory (exact sums, no top-K)."""
  logits = nnx.merge(graphdef, params).logits(f_BxD[:, None])[:, 0].astype(jnp.float32)
  b, d = g_BxD.shape
  q = g_BxD.astype(jnp.float32)
  own = jnp.repeat(jnp.eye(b, dtype=bool), local_targets.shape[1], axis=1)
  keys, targets, mask = local_keys.reshape(-1, d), local_targets.reshape(-1), own
  if store_keys is not None:
    keys = jnp.concatenate([keys, store_keys.astype(jnp.float32)])
    targets = jnp.concatenate([targets, store_targets])
    mask = jnp.concatenate([mask, jnp.ones((b, store_targets.shape[0]), bool)], axis=1)
  # the unnormalised TRIME weights of the local / long-term memories, to which every datastore entry is added
  base = scoring.memory_log_weights(logits, q, keys.astype(jnp.float32), targets, mask, tau=memory.tau)
  log_p = exact_memory.exact_external_log_probs(base, q, device_store, tau=memory.tau)
  tokens = sample(jnp.asarray(log_p), keys_B, sampling)
  local_keys, local_targets = _remember(local_keys, local_targets, g_BxD, tokens, slot_B, active_B)
  return tokens, log_p, local_keys, local_targets, None


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _window_keys(graphdef, params, inputs_BxL):
  return nnx.merge(graphdef, params).features(inputs_BxL, deterministic=True)[1].astype(jnp.float32)


def _search(external: knn.ExternalMemory, queries_BxD) -> np.ndarray:
  """[B, K] datastore ids of each query's top-K. One thread: a few queries per step gain nothing from
  OpenMP, and its start-up costs 4x on a busy 2-core machine (38 vs 9 ms for K=1024 over 50k keys)."""
  import faiss

  threads = faiss.omp_get_max_threads()
  faiss.omp_set_num_threads(1)
  try:
    return external.index.search(queries_BxD, external.k)[1]
  finally:
    faiss.omp_set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------
# Long-term memory carried across calls
# ----------------------------------------------------------------------------------------------------------
class LongTermMemory:
  """(key, next token) pairs of text the model has read: `Generator.read(store, text)` adds a document,
  `Generator.generate(..., memory="long", store=store)` sees them and appends its own prompts and outputs.
  `tokens[i]` is entry i's next token; entries are in reading order, so tokens[:i] is its context."""

  def __init__(self, dimension: int):
    self.keys = np.zeros((0, dimension), np.float32)
    self.tokens = np.zeros((0,), np.int32)

  def __len__(self):
    return len(self.tokens)

  def add(self, keys_NxD, tokens_N) -> None:
    keys_NxD = np.asarray(keys_NxD, np.float32)
    if keys_NxD.ndim != 2 or keys_NxD.shape[1] != self.keys.shape[1] or len(keys_NxD) != len(tokens_N):
      raise ConfigError(f"long-term memory holds keys of dimension {self.keys.shape[1]}; got keys "
                        f"{keys_NxD.shape} for {len(tokens_N)} tokens")
    self.keys = np.concatenate([self.keys, keys_NxD])
    self.tokens = np.concatenate([self.tokens, np.asarray(tokens_N, np.int32)])


# ----------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------
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


@dataclasses.dataclass
class Generation:
  prompt: str
  text: str  # the generated continuation, detokenised
  tokens: list  # generated token ids
  stopped: str  # "eos" | "budget"
  trace: list  # [TraceStep] when asked for


# ----------------------------------------------------------------------------------------------------------
# The generator
# ----------------------------------------------------------------------------------------------------------
def _stderr(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


class Generator:
  """An export loaded for generation: `generate(prompts, ...)`, `read(store, text)`, `external(...)`."""

  def __init__(self, checkpoint_dir: str, *, log: Callable[[str], None] = _stderr):
    self.checkpoint_dir = checkpoint_dir
    self.graphdef, self.params, self.config, self.vocab, self.meta = ckpt.load_export(checkpoint_dir)
    model = nnx.merge(self.graphdef, self.params)
    if getattr(model, "stateful", False):  # the key/value-cache decoder is the Transformer's
      raise ConfigError(f"generation supports the transformer backbone; {checkpoint_dir} is a "
                        f"{model.cfg.backbone} model")
    self.cfg = model.cfg
    self.default_tau = float(self.config.eval.tau)  # the export's evaluation τ
    self.eos = self.vocab.index.get(data.EOS)  # bytes: none (generation stops at the budget)
    self.log = log
    # The step functions, jitted with the graph bound (hashing a static graphdef costs ~1 ms per call).
    self._forward = jax.jit(functools.partial(_forward, self.graphdef), donate_argnames=("cache",))
    self._next_token = jax.jit(functools.partial(_next_token, self.graphdef),
                               static_argnames=("memory", "sampling", "trace"),
                               donate_argnames=("local_keys", "local_targets"))

  # -- text <-> tokens --------------------------------------------------------------------------------------
  def tokenize(self, text: str, what: str = "prompt") -> list[int]:
    """Token ids of `text`: bytes of its UTF-8, or WikiText-style words with `</s>` at each line end (the
    last line's only if the text ends with a newline). Unknown words map to <unk>, with one warning."""
    if self.vocab.kind == "bytes":
      return list(text.encode("utf-8"))
    lines = text.split("\n")
    words = []
    for i, line in enumerate(lines):
      words += line.split()
      if i < len(lines) - 1:
        words.append(data.EOS)
    ids = self.vocab.encode_words(words)
    unknown = sorted({w for w, i in zip(words, ids) if i == self.vocab.unk and w != data.UNK})
    if unknown:
      shown = ", ".join(unknown[:8]) + (", ..." if len(unknown) > 8 else "")
      self.log(f"warning: {len(unknown)} word(s) of the {what} are not in the model's vocabulary and read as "
               f"{data.UNK}: {shown}")
    return ids

  def detokenize(self, ids) -> str:
    if self.vocab.kind == "bytes":
      return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
    words = ["\n" if self.vocab.tokens[i] == data.EOS else self.vocab.tokens[i] for i in ids]
    return " ".join(words).replace(" \n ", "\n").replace(" \n", "\n").replace("\n ", "\n")

  def _context(self, stream, end: int) -> str:
    """A few tokens of `stream` before position `end`, readable on one line."""
    n = TRACE_CONTEXT * (3 if self.vocab.kind == "bytes" else 1)
    text = self.detokenize(stream[max(0, end - n):end])
    return "..." + text.replace("\n", "⏎") + (" " if self.vocab.kind == "words" else "")

  def _token_str(self, i: int) -> str:
    return self.detokenize([i]).replace("\n", "⏎") if self.vocab.kind == "bytes" else self.vocab.tokens[i]

  # -- keys of text ------------------------------------------------------------------------------------------
  def keep(self) -> int:
    """Tokens a full context window restarts from."""
    return max(1, self.cfg.max_len // 2)

  def keys_of(self, ids, batch: int = 8) -> np.ndarray:
    """float32 [n, D] key of every token of `ids` (the key predicting it), in evaluation's windows (block
    max_len, context `keep()`), the stream starting with bos: what a datastore or the long-term store holds."""
    corpus = data.Corpus(np.asarray(ids, np.int32), np.array([0, len(ids)], np.int64), self.vocab)
    block = self.cfg.max_len
    wins = data.windows(len(ids), block, self.keep())
    out = np.zeros((len(ids), self.cfg.d_model), np.float32)
    for a in range(0, len(wins), batch):
      part = wins[a:a + batch]
      part = part + [part[-1]] * (batch - len(part))
      inputs, _, scored = data.window_batch(corpus, part, block)
      g = np.asarray(_window_keys(self.graphdef, self.params, inputs))
      for w, g_w, s_w in zip(part, g, scored):
        out[w.score_start:w.end] = g_w[s_w]
    return out

  def read(self, store: LongTermMemory, text: str) -> int:
    """Add the keys of `text` to `store` (a document the model should remember); returns its token count."""
    ids = self.tokenize(text, what="memory text")
    if not ids:
      raise ConfigError("the memory text is empty")
    store.add(self.keys_of(ids), ids)
    return len(ids)

  def new_store(self) -> LongTermMemory:
    return LongTermMemory(self.cfg.d_model)

  def external(self, datastore_dir: str, *, index_path: str = "", k: int = 1024, nprobe: int = 32,
               gpu: bool = False) -> knn.ExternalMemory:
    """A datastore + index of this model (built by `trime_jax.launch.build_datastore`; another model's or vocabulary's
    is refused)."""
    try:
      ext = knn.ExternalMemory(datastore_dir, index_path=index_path, checkpoint_dir=self.checkpoint_dir, k=k,
                               nprobe=nprobe, gpu=gpu)
    except CheckpointError as e:
      if "does not match" not in str(e):
        raise
      raise CheckpointError(f"the datastore was built by another model or vocabulary than {self.checkpoint_dir} "
                            f"(build one with trime_jax.launch.build_datastore --checkpoint=that export): {e}") from None
    if ext.dimension != self.cfg.d_model:
      raise CheckpointError(f"datastore keys have dimension {ext.dimension}, the model's keys {self.cfg.d_model}")
    return ext

  def on_device(self, datastore_dir: str, mesh=None) -> exact_memory.DeviceDatastore:
    """A datastore of this model with its keys on the devices (sharded over all of them, or `mesh`'s `data`
    axis): memory=external then sums over every entry exactly instead of a FAISS top-K."""
    ds = exact_memory.Datastore(datastore_dir)
    try:
      ds.check_checkpoint(self.checkpoint_dir)
    except CheckpointError as e:
      raise CheckpointError(f"the datastore was built by another model or vocabulary than {self.checkpoint_dir} "
                            f"(build one with trime_jax.launch.build_datastore --checkpoint=that export): {e}") from None
    if ds.dimension != self.cfg.d_model:
      raise CheckpointError(f"datastore keys have dimension {ds.dimension}, the model's keys {self.cfg.d_model}")
    return exact_memory.load_datastore(ds, mesh)

  # -- generation --------------------------------------------------------------------------------------------
  def generate(self, prompts, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
               memory: MemorySpec | None = None, store: LongTermMemory | None = None,
               external: knn.ExternalMemory | exact_memory.DeviceDatastore | None = None, trace: bool = False,
               remember: bool = True,
               stop_at_eos: bool = True) -> list[Generation]:
    """Continue each prompt (a string, or a list of token ids) by up to `max_new_tokens` tokens, stopping a
    row at `</s>` (word vocabularies, `stop_at_eos`). memory: a MemorySpec (default: local; τ: the export's
    eval.tau unless given). `store` (memory long or external) is read, and extended with every row's
    prompt and output unless remember=False; `external` (memory external) is searched once per generated
    token."""
    memory = memory or MemorySpec("local")
    if memory.tau is None:
      memory = dataclasses.replace(memory, tau=self.default_tau)
    if isinstance(prompts, (str, np.ndarray)) or (prompts and isinstance(prompts[0], int)):
      prompts = [prompts]
    if not prompts:
      raise ConfigError("no prompts given")
    if max_new_tokens < 1:
      raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if memory.kind == "long" and store is None:
      raise ConfigError("memory=long needs a long-term store (a --memory_file, or store=LongTermMemory)")
    if memory.kind == "external" and external is None:
      raise ConfigError("memory=external needs a datastore (--datastore, built by trime_jax.launch.build_datastore)")
    if memory.kind in ("none", "local"):
      store = None
    if memory.kind == "external" and isinstance(external, exact_memory.DeviceDatastore) and (
        memory.knn_lambda or trace):
      raise ConfigError("the on-device datastore gives exact sums over every entry, not retrieved entries: the "
                        "interpolation and the retrieval trace need a FAISS index (Generator.external)")
    ids = [self.tokenize(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for p, row in zip(prompts, ids):
      if not row:
        raise ConfigError("the prompt is empty" + (f": {p!r}" if isinstance(p, str) and p else ""))
      if min(row) < 0 or max(row) >= len(self.vocab):
        raise ConfigError(f"prompt token ids must be in [0, {len(self.vocab)})")
    return self._generate(ids, [p if isinstance(p, str) else self.detokenize(p) for p in prompts], max_new_tokens,
                          sampling, memory, store, external if memory.kind == "external" else None, trace,
                          remember, stop_at_eos)

  def _generate(self, ids, prompts, max_new, sampling, memory, store, external, trace, remember, stop_at_eos):
    cfg, b, keep = self.cfg, len(ids), self.keep()
    max_len = cfg.max_len
    seqs = [[self.vocab.bos] + row for row in ids]  # input stream of each row; seqs[r][j + 1] is key j's target
    starts = [0 if len(s) <= max_len else len(s) - keep for s in seqs]
    if any(starts):
      longest = max(len(r) for r in ids)
      self.log(f"note: a prompt of {longest} tokens is longer than the model's context ({max_len} tokens): "
               f"sliding window, the model sees the last {keep} prompt tokens (the memory keeps all of them)")
    slid = any(starts)
    # Local memory: slot j of a row = input position j (its key predicts seqs[r][j + 1]).
    cap = max(len(s) for s in seqs) - 1 + max_new
    cap = -(-cap // 64) * 64  # fewer recompilations across calls
    local_keys = np.zeros((b, cap, cfg.d_model), np.float32)
    local_targets = np.full((b, cap), -1, np.int32)
    cache_len = min(max_len, -(-(max(len(s) - st for s, st in zip(seqs, starts)) + max_new) // 16) * 16)
    n_mem = np.array([len(s) - 1 for s in seqs])
    store_keys = store_targets = None
    if store is not None and len(store):  # padded (target -1) to whole blocks: a growing store recompiles rarely
      slots = -(-len(store) // STORE_BLOCK) * STORE_BLOCK
      store_keys = jnp.asarray(np.pad(store.keys, ((0, slots - len(store)), (0, 0))))
      store_targets = jnp.asarray(np.pad(store.tokens, (0, slots - len(store)), constant_values=-1))
    ext_keys = ext_targets = None
    ext_ids = None
    active = np.ones(b, bool)
    out_tokens = [[] for _ in range(b)]
    stopped = ["budget"] * b
    traces = [[] for _ in range(b)]
    cache = None
    need_prefill = True
    last_f = last_g = None
    step_keys = _all_keys(sampling.seed, b, max_new)  # one dispatch, not one per step
    for step in range(max_new):
      if need_prefill:  # the prompts, or windows that slid: every row re-encoded from its window start
        width = max(len(s) - st for s, st in zip(seqs, starts))
        width = min(cache_len, -(-width // 16) * 16)
        inputs = np.zeros((b, width), np.int32)
        for r, (s, st) in enumerate(zip(seqs, starts)):
          inputs[r, :len(s) - st] = s[st:]
        cache = nnx.merge(self.graphdef, self.params).init_cache(b, cache_len)
        pos = np.broadcast_to(np.arange(width, dtype=np.int32), (b, width))
        last = np.array([len(s) - st - 1 for s, st in zip(seqs, starts)], np.int32)
        last_f, last_g, g_all, cache = self._forward(self.params, jnp.asarray(inputs), cache, jnp.asarray(pos),
                                                     jnp.asarray(last))
        if step == 0:  # the prompt's keys: from this pass, or from evaluation's windows for long prompts
          g_all = np.asarray(g_all)
          for r, s in enumerate(seqs):
            local_keys[r, :len(s) - 1] = g_all[r, :len(s) - 1] if starts[r] == 0 else self.keys_of(s[1:])
            local_targets[r, :len(s) - 1] = s[1:]
          local_keys, local_targets = jnp.asarray(local_keys), jnp.asarray(local_targets)
        need_prefill = False
      if isinstance(external, exact_memory.DeviceDatastore):
        tokens, log_p, local_keys, local_targets, extra = _exact_next_token(
            self.graphdef, self.params, last_f, last_g, local_keys, local_targets, store_keys, store_targets,
            external, step_keys[step], jnp.asarray(n_mem, jnp.int32), jnp.asarray(active), memory=memory,
            sampling=sampling)
      elif external is not None:
        ext_ids = _search(external, np.asarray(last_g, np.float32))
        ext_keys = jnp.asarray(external.datastore.gather_keys(ext_ids))
        values = np.asarray(external.datastore.values[np.maximum(ext_ids, 0)])
        ext_targets = jnp.asarray(np.where(ext_ids >= 0, values, -1).astype(np.int32))
      if not isinstance(external, exact_memory.DeviceDatastore):
        tokens, log_p, local_keys, local_targets, extra = self._next_token(
            self.params, last_f, last_g, local_keys, local_targets, store_keys, store_targets,
            ext_keys, ext_targets, step_keys[step], jnp.asarray(n_mem, jnp.int32), jnp.asarray(active),
            memory=memory, sampling=sampling, trace=trace)
      tokens = np.asarray(tokens)
      if trace:
        self._trace_step(traces, tokens, active, log_p, extra, memory, seqs, store, external, ext_ids, cap)
      for r in np.flatnonzero(active):
        t = int(tokens[r])
        out_tokens[r].append(t)
        seqs[r].append(t)
        n_mem[r] += 1
        if stop_at_eos and t == self.eos:
          active[r], stopped[r] = False, "eos"
      if not active.any() or step == max_new - 1:
        break
      # Advance: feed every row's newest token (finished rows repeat theirs, ignored); slide full windows.
      for r, s in enumerate(seqs):
        if active[r] and len(s) - starts[r] > cache_len:  # cache_len < max_len only if no row ever gets there
          starts[r] = len(s) - keep
          need_prefill = True
      if need_prefill:
        if not slid:
          self.log(f"note: the context reached the model's max_len={max_len} tokens: sliding window, the model "
                   f"restarts from the last {keep} tokens (the memory keeps every key)")
          slid = True
        continue
      pos = np.array([[len(s) - st - 1] for s, st in zip(seqs, starts)], np.int32)
      toks = np.array([[s[-1]] for s in seqs], np.int32)
      last_f, last_g, _, cache = self._forward(self.params, jnp.asarray(toks), cache, jnp.asarray(pos),
                                               jnp.zeros((b,), jnp.int32))
    if store is not None and remember:
      lk, lt = np.asarray(local_keys), np.asarray(local_targets)
      for r in range(b):
        store.add(lk[r, :n_mem[r]], lt[r, :n_mem[r]])
    results = []
    for r in range(b):
      shown = out_tokens[r][:-1] if stopped[r] == "eos" else out_tokens[r]
      results.append(Generation(prompts[r], self.detokenize(shown), out_tokens[r], stopped[r], traces[r]))
    return results

  def _trace_step(self, traces, tokens, active, log_p, extra, memory, seqs, store, external, ext_ids, cap):
    """Per active row: P(token), the share from memory and the three memories contributing most, in float64
    from the logits and similarities the step used."""
    logits, sims = (None if x is None else np.asarray(x, np.float64) for x in extra)
    log_p = np.asarray(log_p, np.float64)
    n_store = -(-len(store) // STORE_BLOCK) * STORE_BLOCK if store is not None else 0  # store slots
    for r in np.flatnonzero(active):
      w = int(tokens[r])
      p = float(np.exp(log_p[r, w]))
      top = []
      share = 0.0
      if sims is not None:
        s = sims[r]
        targets = self._memory_targets(r, seqs, cap, store, n_store, external, ext_ids)
        z = np.logaddexp.reduce(np.concatenate([logits[r], s[np.isfinite(s)] / memory.tau]))
        pos = np.flatnonzero((targets == w) & np.isfinite(s))
        contrib = np.exp(s[pos] / memory.tau - z) * (1 - memory.knn_lambda)
        if memory.knn_lambda and ext_ids is not None:
          first_ext = cap + n_store if memory.interp_memory == "external" else 0
          in_prime = np.isfinite(s) & (np.arange(len(s)) >= first_ext)
          z_prime = np.logaddexp.reduce(s[in_prime] / memory.tau_prime)
          contrib = contrib + memory.knn_lambda * np.where(
              pos >= first_ext, np.exp(s[pos] / memory.tau_prime - z_prime), 0.0)
        share = float(contrib.sum() / max(p, 1e-300))
        for j in np.argsort(-contrib, kind="stable")[:3]:
          top.append(self._describe(pos[j], float(contrib[j] / max(p, 1e-300)), r, seqs, cap, store, n_store,
                                    external, ext_ids))
      traces[r].append(TraceStep(self._token_str(w), p, min(share, 1.0), top))

  def _memory_targets(self, r, seqs, cap, store, n_store, external, ext_ids):
    """[M] next token of every memory slot of row r at this step (-1: empty), in `_next_token`'s order."""
    local = np.full(cap, -1, np.int64)
    local[:len(seqs[r]) - 1] = seqs[r][1:]  # the sampled token is not in seqs yet
    parts = [local]
    if n_store:
      parts.append(np.pad(store.tokens.astype(np.int64), (0, n_store - len(store)), constant_values=-1))
    if ext_ids is not None:
      values = external.datastore.values
      parts.append(np.where(ext_ids[r] >= 0, np.asarray(values[np.maximum(ext_ids[r], 0)]), -1))
    return np.concatenate(parts)

  def _describe(self, j, share, r, seqs, cap, store, n_store, external, ext_ids) -> TraceMemory:
    """Memory slot j of row r: its source, next token and context."""
    if j < cap:  # local key j predicts seqs[r][j + 1]
      return TraceMemory("local", self._token_str(seqs[r][j + 1]), self._context(seqs[r], j + 1), share)
    j -= cap
    if j < n_store:
      return TraceMemory("long", self._token_str(int(store.tokens[j])), self._context(store.tokens, j), share)
    i = int(ext_ids[r][j - n_store])  # datastore entry i predicts values[i] = corpus token i
    values = external.datastore.values
    return TraceMemory("external", self._token_str(int(values[i])), self._context(values, i), share)
