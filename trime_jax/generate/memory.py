"""The memories of generation: what a row's query sees besides the vocabulary.

* `MemorySpec`: which memories (none | local | long | external) and the law's τ, λ, τ′;
* `LongTermMemory`: (key, next token) pairs carried across calls (a document, a chat history);
* `Memories`: one call's memories, laid out for the next-token step: every row's local slots (slot j = input
  position j, its key predicting the row's token j + 1), the long-term store padded to whole blocks (visible to
  every row), and the entries retrieved from a datastore for the current step (a FAISS top-K per row).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import numpy as np

from trime_jax import exact_memory
from trime_jax import knn
from trime_jax.datastore.index import host_memory_bytes
from trime_jax.errors import ConfigError

MEMORIES = ("none", "local", "long", "external")
INTERP_MEMORIES = ("external", "all")  # P′ over the retrieved entries only (the original release) or all
STORE_BLOCK = 1024  # the long-term store is padded to a multiple of this many slots


@dataclasses.dataclass(frozen=True)
class MemorySpec:
  kind: str = "local"  # none | local | long | external
  tau: float | None = None  # τ on memory similarities g·g_j/√D (None: the export's eval.tau)
  knn_lambda: float = 0.0  # external: Appendix A's λ, the weight of P′ (0 = no interpolation)
  tau_prime: float = 1.0  # τ′ of P′
  interp_memory: str = "external"  # memories of P′: "external" (retrieved only) | "all"

  def __post_init__(self):
    if not isinstance(self.kind, str) or self.kind not in MEMORIES:
      raise ConfigError(f"memory must be one of {MEMORIES}, got {self.kind!r}")
    for name in ("tau", "knn_lambda", "tau_prime"):  # a string would fail in a comparison below, unnamed
      value = getattr(self, name)
      if not (value is None and name == "tau") and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if (self.tau is not None and not self.tau > 0) or not self.tau_prime > 0:
      raise ConfigError(f"tau and tau_prime must be > 0, got {self.tau}, {self.tau_prime}")
    if not 0 <= self.knn_lambda < 1:
      raise ConfigError(f"knn_lambda must be in [0, 1), got {self.knn_lambda}")
    if self.knn_lambda and self.kind != "external":
      raise ConfigError("the interpolation (knn_lambda > 0) mixes in retrieved entries: it needs memory=external")
    if self.interp_memory not in INTERP_MEMORIES:
      raise ConfigError(f"interp_memory must be one of {INTERP_MEMORIES}, got {self.interp_memory!r}")


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


def search(external: knn.ExternalMemory, queries_BxD) -> tuple[np.ndarray, np.ndarray]:
  """([B, K] the index's inner products, [B, K] datastore ids) of each query's top-K. One thread: a few queries
  per step gain nothing from OpenMP, and its start-up costs 4x on a busy 2-core machine (38 vs 9 ms for K=1024
  over 50k keys)."""
  import faiss

  threads = faiss.omp_get_max_threads()
  faiss.omp_set_num_threads(1)
  try:
    return external.index.search(queries_BxD, external.k)
  finally:
    faiss.omp_set_num_threads(threads)


def keys_scoring_as(keys_BxKxD, queries_BxD, scores_BxK) -> np.ndarray:
  """Keys k′ = k + (s - q·k)·q/|q|² with q·k′ = s: each row's retrieved keys moved along its own query so that
  the engine's exact q·k′ is the index's score s. A row sees only its own retrieved block, so this gives the
  law of scoring with `eval.knn_exact=False` (`knn.ExternalMemory.retrieve`: the index's approximate IVF-PQ
  scores); rows with a zero query keep their keys."""
  q = queries_BxD.astype(np.float64)
  k = keys_BxKxD.astype(np.float64)
  qq = (q * q).sum(-1)[:, None]  # [B, 1]
  gap = np.where(qq > 0, (scores_BxK - np.einsum("bkd,bd->bk", k, q)) / np.where(qq > 0, qq, 1.0), 0.0)
  return (k + gap[..., None] * q[:, None, :]).astype(np.float32)


class Memories:
  """One `generate` call's memories. `local_keys` [B, cap, D] / `local_targets` [B, cap] (-1: empty; host arrays
  until `set_prompts`, device arrays after, updated by each step), `n_mem` [B] filled local slots per row;
  `store_keys` / `store_targets` the long-term store padded with empty slots to `n_store` (None when empty);
  `ext_keys` [B, K, D] / `ext_targets` [B, K] / `ext_ids` [B, K] the entries retrieved for the current step
  (None without a FAISS datastore)."""

  def __init__(self, seqs, max_new: int, d_model: int, store: LongTermMemory | None,
               external: knn.ExternalMemory | exact_memory.DeviceDatastore | None):
    b = len(seqs)
    self.store, self.external = store, external
    cap = max(len(s) for s in seqs) - 1 + max_new
    self.cap = -(-cap // 64) * 64  # fewer recompilations across calls
    need, have = b * self.cap * d_model * 4, host_memory_bytes()
    if need > have // 2:  # (and as much again on the device): refused before NumPy's MemoryError traceback
      raise ConfigError(f"max_new_tokens={max_new:,}: the local memory of {b} row(s) x {self.cap:,} tokens x "
                        f"{d_model} float32 would take {need / 2**30:,.1f} GiB, more than half of this machine's "
                        f"{have / 2**30:,.1f} GiB; generate fewer tokens per call (continue from the output)")
    self.local_keys = np.zeros((b, self.cap, d_model), np.float32)
    self.local_targets = np.full((b, self.cap), -1, np.int32)
    self.n_mem = np.array([len(s) - 1 for s in seqs])
    self.store_keys = self.store_targets = None
    self.n_store = -(-len(store) // STORE_BLOCK) * STORE_BLOCK if store is not None else 0  # store slots
    if store is not None and len(store):  # padded (target -1) to whole blocks: a growing store recompiles rarely
      self.store_keys = jnp.asarray(np.pad(store.keys, ((0, self.n_store - len(store)), (0, 0))))
      self.store_targets = jnp.asarray(np.pad(store.tokens, (0, self.n_store - len(store)), constant_values=-1))
    self.ext_keys = self.ext_targets = self.ext_ids = None

  @property
  def on_device(self) -> bool:
    """Every entry of a datastore on the devices is external memory (exact sums; nothing retrieved)."""
    return isinstance(self.external, exact_memory.DeviceDatastore)

  def set_prompts(self, seqs, prompt_keys) -> None:
    """Each row's prompt keys (`prompt_keys(r)` [len(seqs[r]) - 1, D]) and their next tokens in its first slots;
    the local memory then lives on the device."""
    for r, s in enumerate(seqs):
      self.local_keys[r, :len(s) - 1] = prompt_keys(r)
      self.local_targets[r, :len(s) - 1] = s[1:]
    self.local_keys, self.local_targets = jnp.asarray(self.local_keys), jnp.asarray(self.local_targets)

  def retrieve(self, queries_BxD) -> None:
    """This step's external entries: each row's top-K of a FAISS datastore (nothing for the other memories),
    scored as evaluation scores them: exactly from the stored keys with `exact`, else by the index's own
    (IVF-PQ: approximate) inner products (`keys_scoring_as`)."""
    if self.external is None or self.on_device:
      return
    queries = np.asarray(queries_BxD, np.float32)
    scores, self.ext_ids = search(self.external, queries)
    keys = self.external.datastore.gather_keys(self.ext_ids)
    if not self.external.exact:
      keys = keys_scoring_as(keys, queries, np.where(self.ext_ids >= 0, scores, 0.0))
    self.ext_keys = jnp.asarray(keys)
    values = np.asarray(self.external.datastore.values[np.maximum(self.ext_ids, 0)])
    self.ext_targets = jnp.asarray(np.where(self.ext_ids >= 0, values, -1).astype(np.int32))

  def save_to_store(self) -> None:
    """Append every row's local memory (its prompt and output) to the long-term store."""
    lk, lt = np.asarray(self.local_keys), np.asarray(self.local_targets)
    for r in range(len(self.n_mem)):
      self.store.add(lk[r, :self.n_mem[r]], lt[r, :self.n_mem[r]])
