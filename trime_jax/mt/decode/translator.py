"""Translation with an MT export (+ a datastore): `Translator` runs beam search / greedy (`search`) over the
decoder's key/value cache, with the next-token law of a `Distribution` (retrieving per step where it needs
entries)."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trime_jax.errors import CheckpointError, ConfigError
from trime_jax.mt.decode.distributions import (Distribution, knn_mt_log_probs, release_trime_log_probs,
                                               trime_log_probs)
from trime_jax.mt.decode.retrieval import Neighbours, retrieve
from trime_jax.mt.decode.beam import Hypothesis, SearchOptions, search


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
      if d.mode == "trime_release":
        return np.asarray(release_trime_log_probs(logits, g, nb.keys, nb.targets, tau=d.tau))
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
                    eos_id=self.eos_id, vocab_size=self.cfg.target_vocab_size)
      for r, i in enumerate(idx):
        out[i] = hyps[r]
      if progress:
        progress(len(idx))
    return out
