"""Pure, module-level training step and forward pass (`train.py` jits the step with shardings; `evaluate`
jits the forward pass of evaluation).

The forward pass yields f (final output), g (memory keys) and the vocabulary side as `VocabStats`; the CE
loss and the TRIME loss share them, so reporting both costs one extra memory pass at most.

Stateful backbones (SRU++, `model.stateful`): the training state holds a `carry` (the model's state after
each batch row's last segment, and that segment's keys and targets), threaded through the micro-batches in
stream order; `batch["reset"]` [A, B] marks rows that do not continue the previous micro-batch's row. With
`trime.memory="long"` such a model's TRIME memory is its current segment (causal) plus every token of the
row's previous segment, whose keys are stale (computed by the previous update) and get no gradient
(`previous_segment_nll`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trime_jax import loss
from trime_jax import sharded_loss
from trime_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """Static description of the training loss (hashable: part of the jit cache key): the objective, how the
  vocabulary side is computed and, on a >1-device mesh, how the in-batch memory travels."""

  objective: loss.ObjectiveSpec = loss.ObjectiveSpec("local")
  vocab_chunk: int = 0  # output softmax in vocabulary chunks of this size (0 = full logits)
  sharded_variant: str = "gather"  # gather | ring (see trime_jax/sharded_loss.py)
  memory_grad: str = "all"  # all | local_only

  def __post_init__(self):
    if self.sharded_variant not in sharded_loss.VARIANTS:
      raise ConfigError(f"trime.sharded_variant must be one of {sharded_loss.VARIANTS}, got {self.sharded_variant!r}")
    if self.memory_grad not in sharded_loss.MEMORY_GRADS:
      raise ConfigError(f"trime.memory_grad must be one of {sharded_loss.MEMORY_GRADS}, got {self.memory_grad!r}")


def forward(model, inputs_BxL, targets_BxL, *, vocab_chunk=0, deterministic=True, rngs=None, criterion=False):
  """(VocabStats [B, L], keys [B, L, D]) without materialising [B, L, V] when vocab_chunk > 0. `criterion`:
  the TRIME criterion's target term (`model.vocab_stats`; "both": (VocabStats, criterion target) first)."""
  f, g = model.features(inputs_BxL, deterministic=deterministic, rngs=rngs)
  stats = model.vocab_stats(f, targets_BxL, vocab_chunk=vocab_chunk, deterministic=deterministic, rngs=rngs,
                            criterion=criterion)
  return stats, g


def forward_carry(model, inputs_BxL, targets_BxL, carry, *, vocab_chunk=0, deterministic=True, rngs=None,
                  criterion=False):
  """`forward` of a stateful model continuing from `carry`: (VocabStats, keys, new model carry)."""
  f, g, carry = model.features_carry(inputs_BxL, carry, deterministic=deterministic, rngs=rngs)
  stats = model.vocab_stats(f, targets_BxL, vocab_chunk=vocab_chunk, deterministic=deterministic, rngs=rngs,
                            criterion=criterion)
  return stats, g, carry


def init_train_carry(model, batch: int, seg_len: int) -> dict:
  """The empty training carry of a stateful model: its state, and the previous segment's keys and targets
  (-1: no previous segment)."""
  dtype = jnp.dtype(model.cfg.dtype)
  return {"model": model.init_carry(batch, seg_len),
          "keys": jnp.zeros((batch, seg_len, model.cfg.d_model), dtype),
          "targets": jnp.full((batch, seg_len), -1, jnp.int32)}


def reset_train_carry(carry: dict, reset_B) -> dict:
  """Rows with `reset_B` start over: zero state, no valid attention memory, no previous-segment memory."""
  keep = jnp.logical_not(reset_B)
  rows = lambda x: jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))
  return {"model": jax.tree_util.tree_map(rows, carry["model"]), "keys": rows(carry["keys"]),
          "targets": jnp.where(keep[:, None], carry["targets"], -1)}


def previous_segment_nll(stats: loss.VocabStats, keys_BxLxD, targets_BxL, prev_keys_BxMxD, prev_targets_BxM,
                         spec: loss.ObjectiveSpec):
  """TRIME nll [B, L] whose memory is, for token t of row b: tokens j < t of row b (local, causal) and every
  token of row b's previous segment (`prev_*`; target -1 = none). The previous segment's keys are stale and get
  no gradient (stop-gradient, the paper's choice for SRU++); the current ones do unless
  spec.stop_gradient_memory. Dense per row: [L, M + L] similarities per row."""
  if spec.memory != "long" or spec.memory_topk:  # what this memory implements; another spec's would be ignored
    raise ValueError(f"previous_segment_nll is a stateful model's memory='long' (no memory_topk); got "
                     f"memory={spec.memory!r}, memory_topk={spec.memory_topk}")
  b, l, _ = keys_BxLxD.shape
  m = prev_keys_BxMxD.shape[1]
  cur = jax.lax.stop_gradient(keys_BxLxD) if spec.stop_gradient_memory else keys_BxLxD
  mem_keys = jnp.concatenate([jax.lax.stop_gradient(prev_keys_BxMxD).astype(keys_BxLxD.dtype), cur], axis=1)
  mem_targets = jnp.concatenate([prev_targets_BxM, targets_BxL], axis=1).astype(jnp.int32)
  mask = jnp.concatenate([jnp.ones((l, m), bool), jnp.tril(jnp.ones((l, l), bool), -1)], axis=1)

  def row(z, p, k, t, mk, mt):
    return loss.memory_nll_from_vocab_stats(loss.VocabStats(z, p), k, t, mk, mt, mask, tau=spec.tau)

  return jax.vmap(row)(stats.log_normalizer, stats.target_logit, keys_BxLxD, targets_BxL, mem_keys, mem_targets)


def nll_sums(model, batch, spec: LossSpec, *, use_trime: bool, report_trime: bool, rngs=None,
             deterministic=False, mesh=None):
  """Sums over the batch's valid tokens: (objective, ce, trime, n_tokens).

  With a `mesh` of more than one device the batch rows are sharded over its `data` axis and the TRIME loss
  is `sharded_loss.sharded_trime_nll_from_vocab_stats` (every query sees the whole global batch).
  """
  inputs, targets = batch["inputs"], batch["targets"]
  # Training takes the criterion's token term throughout (CE warm-up included), as the original's criteria do.
  stats, keys = forward(model, inputs, targets, vocab_chunk=spec.vocab_chunk, deterministic=deterministic,
                        rngs=rngs, criterion=True)
  return _sums(stats, keys, batch, spec, use_trime=use_trime, report_trime=report_trime, mesh=mesh)


def nll_sums_carry(model, batch, carry: dict, spec: LossSpec, *, use_trime: bool, report_trime: bool, rngs=None,
                   deterministic=False, mesh=None):
  """`nll_sums` of a stateful model continuing each row from `carry` (already reset where rows start over):
  ((objective, ce, trime, n_tokens), new carry). memory="long": `previous_segment_nll` with the carried keys."""
  inputs, targets = batch["inputs"], batch["targets"]
  stats, keys, model_carry = forward_carry(model, inputs, targets, carry["model"], vocab_chunk=spec.vocab_chunk,
                                           deterministic=deterministic, rngs=rngs, criterion=True)
  prev = (carry["keys"], carry["targets"]) if spec.objective.memory == "long" else None
  sums = _sums(stats, keys, batch, spec, use_trime=use_trime, report_trime=report_trime, mesh=mesh, previous=prev)
  new = {"model": model_carry, "keys": jax.lax.stop_gradient(keys).astype(carry["keys"].dtype),
         "targets": targets.astype(jnp.int32)}
  return sums, new


def _sums(stats, keys, batch, spec: LossSpec, *, use_trime, report_trime, mesh, previous=None):
  targets = batch["targets"]
  valid = targets >= 0
  ce = jnp.where(valid, stats.log_normalizer - stats.target_logit, 0.0).sum()
  ntok = valid.sum()
  if spec.objective.memory == "none" or not (use_trime or report_trime):
    return ce, ce, ce, ntok

  def trime(k):
    if previous is not None:  # stateful model, memory="long": current segment + the previous one's stale keys
      return previous_segment_nll(stats, k, targets, *previous, spec.objective).sum()
    # a batch carries drop_local whatever the memory; only ext memory has a drop (the loss refuses one elsewhere)
    rows = dict(drop_local=batch["drop_local"] if spec.objective.memory == "ext" else False,
                documents=batch.get("documents"))
    if mesh is not None and mesh.size > 1:
      return sharded_loss.sharded_trime_nll_from_vocab_stats(stats, k, targets, spec.objective, mesh=mesh,
                                                             variant=spec.sharded_variant,
                                                             memory_grad=spec.memory_grad, **rows).sum()
    return loss.trime_nll_from_vocab_stats(stats, k, targets, spec.objective, **rows).sum()

  if use_trime:
    tr = trime(keys)
    return tr, ce, tr, ntok
  tr = jax.lax.stop_gradient(trime(jax.lax.stop_gradient(keys)))  # reported only (CE warm-up)
  return ce, ce, tr, ntok


def train_step(graphdef, tx, spec: LossSpec, use_trime: bool, report_trime: bool, state, batch, dropout_key,
               *, mesh=None):
  """One optimizer update over `grad_accum` micro-batches (`mesh`: see `nll_sums`).

  state: {"step": [], "params": nnx.State, "opt_state": ..., "carry": (stateful models) see
  `init_train_carry`}; batch: inputs/targets [A, B, L], drop_local [A, B] (per segment), documents [A, B, L]
  (packed long-term runs only), reset [A, B] (stateful models: the row does not continue the last one). Gradients are of the
  summed nll divided by the update's token count (fairseq's
  per-token loss). A non-finite loss or gradient skips the update (state unchanged; `skipped` = 1).
  """
  params = state["params"]
  stateful = "carry" in state  # a stateful backbone: micro-batches continue each row's stream in order

  def micro(carry, xs):
    grads, sums, rows = carry
    mb, key = xs

    def objective(p):
      model = nnx.merge(graphdef, p)
      kw = dict(use_trime=use_trime, report_trime=report_trime, rngs=nnx.Rngs(dropout=key), mesh=mesh)
      if stateful:
        (obj, ce, tr, n), new_rows = nll_sums_carry(model, mb, reset_train_carry(rows, mb["reset"]), spec, **kw)
        return obj, (ce, tr, n, new_rows)
      obj, ce, tr, n = nll_sums(model, mb, spec, **kw)
      return obj, (ce, tr, n, rows)

    (obj, (ce, tr, n, rows)), g = jax.value_and_grad(objective, has_aux=True)(params)
    grads = jax.tree_util.tree_map(jnp.add, grads, g)
    sums = {"objective": sums["objective"] + obj, "ce": sums["ce"] + ce, "trime": sums["trime"] + tr,
            "tokens": sums["tokens"] + n}
    return (grads, sums, rows), None

  accum = batch["inputs"].shape[0]
  keys = jax.random.split(dropout_key, accum)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  zero_sums = {"objective": 0.0, "ce": 0.0, "trime": 0.0, "tokens": jnp.int32(0)}
  (grads, sums, rows), _ = jax.lax.scan(micro, (zeros, zero_sums, state.get("carry")), (batch, keys))
  ntok = jnp.maximum(sums["tokens"], 1).astype(jnp.float32)
  grads = jax.tree_util.tree_map(lambda g: g / ntok, grads)
  grad_norm = optax.tree.norm(grads)
  updates, new_opt = tx.update(grads, state["opt_state"], params)
  new_params = optax.apply_updates(params, updates)
  mean_loss = sums["objective"] / ntok
  ok = jnp.isfinite(mean_loss) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)
  new_state = {"step": state["step"] + 1, "params": keep(new_params, params),
               "opt_state": keep(new_opt, state["opt_state"])}
  if stateful:  # the streams move on even when the update is skipped (the next batch continues them)
    new_state["carry"] = rows
  metrics = {"loss": mean_loss, "ce_nll": sums["ce"] / ntok, "trime_nll": sums["trime"] / ntok,
             "tokens": sums["tokens"], "grad_norm": grad_norm, "skipped": 1 - ok.astype(jnp.int32)}
  return new_state, metrics
