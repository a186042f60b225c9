"""Pure, module-level training step and forward pass (`train.py` jits the step with shardings; `evaluate.py`
jits the forward pass of evaluation).

The forward pass yields f (final output), g (memory keys) and the vocabulary side as `VocabStats`; the CE
loss and the TRIME loss share them, so reporting both costs one extra memory pass at most.
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
from trime_jax.model import TransformerLM


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

  @classmethod
  def from_config(cls, config) -> "LossSpec":
    return cls(objective=loss.ObjectiveSpec.from_config(config), vocab_chunk=int(config.train.vocab_chunk),
               sharded_variant=config.trime.get("sharded_variant", "gather"),
               memory_grad=config.trime.get("memory_grad", "all"))


def forward(model: TransformerLM, inputs_BxL, targets_BxL, *, vocab_chunk=0, deterministic=True, rngs=None):
  """(VocabStats [B, L], keys [B, L, D]) without materialising [B, L, V] when vocab_chunk > 0."""
  f, g = model.features(inputs_BxL, deterministic=deterministic, rngs=rngs)
  stats = model.vocab_stats(f, targets_BxL, vocab_chunk=vocab_chunk, deterministic=deterministic, rngs=rngs)
  return stats, g


def nll_sums(model, batch, spec: LossSpec, *, use_trime: bool, report_trime: bool, rngs=None,
             deterministic=False, mesh=None):
  """Sums over the batch's valid tokens: (objective, ce, trime, n_tokens).

  With a `mesh` of more than one device the batch rows are sharded over its `data` axis and the TRIME loss
  is `sharded_loss.sharded_trime_nll_from_vocab_stats` (every query sees the whole global batch).
  """
  inputs, targets = batch["inputs"], batch["targets"]
  stats, keys = forward(model, inputs, targets, vocab_chunk=spec.vocab_chunk, deterministic=deterministic,
                        rngs=rngs)
  valid = targets >= 0
  ce = jnp.where(valid, stats.log_normalizer - stats.target_logit, 0.0).sum()
  ntok = valid.sum()
  if spec.objective.memory == "none" or not (use_trime or report_trime):
    return ce, ce, ce, ntok

  def trime(k):
    rows = dict(drop_local=batch["drop_local"], documents=batch.get("documents"))
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

  state: {"step": [], "params": nnx.State, "opt_state": ...}; batch: inputs/targets [A, B, L],
  drop_local [A, B] (per segment), documents [A, B, L] (packed long-term runs only). Gradients are of the
  summed nll divided by the update's token count (fairseq's
  per-token loss). A non-finite loss or gradient skips the update (state unchanged; `skipped` = 1).
  """
  params = state["params"]

  def micro(carry, xs):
    grads, sums = carry
    mb, key = xs

    def objective(p):
      model = nnx.merge(graphdef, p)
      obj, ce, tr, n = nll_sums(model, mb, spec, use_trime=use_trime, report_trime=report_trime,
                                rngs=nnx.Rngs(dropout=key), mesh=mesh)
      return obj, (ce, tr, n)

    (obj, (ce, tr, n)), g = jax.value_and_grad(objective, has_aux=True)(params)
    grads = jax.tree_util.tree_map(jnp.add, grads, g)
    sums = {"objective": sums["objective"] + obj, "ce": sums["ce"] + ce, "trime": sums["trime"] + tr,
            "tokens": sums["tokens"] + n}
    return (grads, sums), None

  accum = batch["inputs"].shape[0]
  keys = jax.random.split(dropout_key, accum)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  zero_sums = {"objective": 0.0, "ce": 0.0, "trime": 0.0, "tokens": jnp.int32(0)}
  (grads, sums), _ = jax.lax.scan(micro, (zeros, zero_sums), (batch, keys))
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
  metrics = {"loss": mean_loss, "ce_nll": sums["ce"] / ntok, "trime_nll": sums["trime"] / ntok,
             "tokens": sums["tokens"], "grad_norm": grad_norm, "skipped": 1 - ok.astype(jnp.int32)}
  return new_state, metrics
