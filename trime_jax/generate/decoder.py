"""The model over its key/value cache (`TransformerLM.decode`) and the next-token step.

`CachedDecoder` binds an export's graph and parameters to jitted functions (hashing a static graphdef costs ~1 ms
per call): `forward` (a prefill of right-padded windows, or one token per row) returns f and g at each row's last
position; `next_token` scores the next token against a call's `Memories` (`next_token_log_probs`:
`scoring.trime_log_probs`, one flat memory), samples it and writes the row's new (key, token) into its local
slots. The external search runs on the host between the two. `keys_of` keys a whole text in evaluation's windows
(what a datastore or the long-term store holds)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trime_jax import data
from trime_jax import exact_memory
from trime_jax import scoring
from trime_jax.generate.memory import Memories, MemorySpec
from trime_jax.generate.sampling import Sampling, sample


def next_token_log_probs(logits_BxV, q_BxD, mem_keys_MxD, mem_targets_M, mem_mask_BxM, *, tau: float,
                         prime_M=None, knn_lambda: float = 0.0, tau_prime: float = 1.0):
  """log P [B, V] of the next token: `scoring.trime_log_probs`, every row's query against the memories its mask
  shows (memories with target < 0 are empty slots). With knn_lambda > 0: (1-λ)·P_trime + λ·P′, P′ over the
  visible memories where `prime_M` is True (rows that see none keep P_trime)."""
  return scoring.trime_log_probs(logits_BxV, q_BxD, mem_keys_MxD, mem_targets_M, mem_mask_BxM, tau=tau,
                                 prime_M=prime_M, knn_lambda=knn_lambda, tau_prime=tau_prime)


def _forward(graphdef, params, tokens_BxT, cache, pos_BxT, last_B):
  """(f, g [B, D] at each row's `last` position, g [B, T, D], cache)."""
  model = nnx.merge(graphdef, params)
  f, g, cache = model.decode(tokens_BxT, cache, pos_BxT)
  take = lambda x: jnp.take_along_axis(x, last_B[:, None, None], axis=1)[:, 0]
  return take(f), take(g), g, cache


def _next_token(graphdef, params, f_BxD, g_BxD, local_keys, local_targets, store_keys, store_targets, ext_keys,
                ext_targets, keys_B, slot_B, active_B, *, memory: MemorySpec, sampling: Sampling, trace: bool):
  """(tokens [B], log P [B, V], local memory with (g, token) inserted at `slot` of active rows, and for a trace
  with memory the log of each memory's part of P(token) [B, M_r] in the row's slot order (-inf: no part))."""
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
  if trace and memory.kind != "none":
    # Each memory's part of P(token), from the law's own terms (`scoring.log_contributions`), as row views
    # [B, M_r] in the trace's slot order: the row's own local slots, the store, the row's own retrieved entries.
    _, log_mem = scoring.log_contributions(logits, q, keys, targets, mask, tokens, tau=memory.tau, prime_M=prime,
                                           knn_lambda=memory.knn_lambda, tau_prime=memory.tau_prime)
    rows = jnp.arange(b)
    own_view = lambda x_BxBR: x_BxBR.reshape(b, b, -1)[rows, rows]  # row r's columns of its own block
    n_local, n_store = local_targets.size, 0 if store_targets is None else store_targets.shape[0]
    views = [own_view(log_mem[:, :n_local]), log_mem[:, n_local:n_local + n_store]]
    if ext_keys is not None:
      views.append(own_view(log_mem[:, n_local + n_store:]))
    extra = jnp.concatenate(views, axis=1)
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
  base = scoring.memory_log_weights(logits, q, keys.astype(jnp.float32), targets, mask, tau=memory.tau,
                                   targets_checked=True)  # tokens the model read or wrote: below V
  log_p = exact_memory.exact_external_log_probs(base, q, device_store, tau=memory.tau)
  tokens = sample(jnp.asarray(log_p), keys_B, sampling)
  local_keys, local_targets = _remember(local_keys, local_targets, g_BxD, tokens, slot_B, active_B)
  return tokens, log_p, local_keys, local_targets, None


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _window_keys(graphdef, params, inputs_BxL):
  return nnx.merge(graphdef, params).features(inputs_BxL, deterministic=True)[1].astype(jnp.float32)


class CachedDecoder:
  """An export's model for generation: the cached forward pass, the next-token step, the keys of a text."""

  def __init__(self, graphdef, params, cfg):
    self.graphdef, self.params, self.cfg = graphdef, params, cfg  # cfg: the model's (max_len, d_model)
    self._forward = jax.jit(functools.partial(_forward, graphdef), donate_argnames=("cache",))
    self._next_token = jax.jit(functools.partial(_next_token, graphdef),
                               static_argnames=("memory", "sampling", "trace"),
                               donate_argnames=("local_keys", "local_targets"))

  def init_cache(self, batch: int, cache_len: int):
    return nnx.merge(self.graphdef, self.params).init_cache(batch, cache_len)

  def forward(self, tokens_BxT, cache, pos_BxT, last_B):
    """(f, g [B, D] at each row's `last_B` position, g [B, T, D], the cache with these tokens added)."""
    return self._forward(self.params, jnp.asarray(tokens_BxT), cache, jnp.asarray(pos_BxT), jnp.asarray(last_B))

  def next_token(self, f_BxD, g_BxD, mems: Memories, keys_B, active_B, *, memory: MemorySpec,
                 sampling: Sampling, trace: bool):
    """(tokens [B], log P [B, V], for a trace with memory each slot's log part of P(token), else None) of every
    row from f, g at its last position; each active row's (g, token) goes into its next local slot of `mems`."""
    slot, active = jnp.asarray(mems.n_mem, jnp.int32), jnp.asarray(active_B)
    sampling = sampling.traced_part()  # static below: one compile for every seed
    if mems.on_device:
      tokens, log_p, mems.local_keys, mems.local_targets, extra = _exact_next_token(
          self.graphdef, self.params, f_BxD, g_BxD, mems.local_keys, mems.local_targets, mems.store_keys,
          mems.store_targets, mems.external, keys_B, slot, active, memory=memory, sampling=sampling)
    else:
      tokens, log_p, mems.local_keys, mems.local_targets, extra = self._next_token(
          self.params, f_BxD, g_BxD, mems.local_keys, mems.local_targets, mems.store_keys, mems.store_targets,
          mems.ext_keys, mems.ext_targets, keys_B, slot, active, memory=memory, sampling=sampling, trace=trace)
    return tokens, log_p, extra

  def keys_of(self, ids, vocab, keep: int, batch: int = 8) -> np.ndarray:
    """float32 [n, D] key of every token of `ids` (the key predicting it), in evaluation's windows (block
    max_len, context `keep`), the stream starting with bos: what a datastore or the long-term store holds."""
    corpus = data.Corpus(np.asarray(ids, np.int32), np.array([0, len(ids)], np.int64), vocab)
    block = self.cfg.max_len
    wins = data.windows(len(ids), block, keep)
    out = np.zeros((len(ids), self.cfg.d_model), np.float32)
    for a in range(0, len(wins), batch):
      part = wins[a:a + batch]
      part = part + [part[-1]] * (batch - len(part))
      inputs, _, scored = data.window_batch(corpus, part, block)
      g = np.asarray(_window_keys(self.graphdef, self.params, inputs))
      for w, g_w, s_w in zip(part, g, scored):
        out[w.score_start:w.end] = g_w[s_w]
    return out
