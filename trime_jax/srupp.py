"""SRU++ (Lei 2021, "When Attention Meets Fast Recurrence") in Flax NNX, as the reference `sru` package's
`SRUpp` / `SRUppCell` / `SRUppAttention` / `SRUppProjectedLinear` (sru 3.x, sru/modules.py) and its
elementwise recurrence (sru/ops.py `elementwise_recurrence_naive`).

One layer (input x [B, L, d], hidden size d, attention size d' < d):

    z = W1 · x                                       (d -> d', "linear1", no bias)
    attention layers:  k, v = split(W2 · [z_mem; z]) (d' -> 2d'; z_mem = W1 · the previous segment's x)
                       a = softmax(z kᵀ / √(d'/heads)) v   (causal over the current segment, all of the memory)
                       u = W3 · Drop(LN(α·a + z))    (d' -> 3d; α a learned scalar initialised to 0, post-LN)
    other layers:      u = W3 · Drop(LN(z))          (the reference's SRUppProjectedLinear)
    recurrence (per dimension, t = 1..L; u = [x̃, u_f, u_r]):
        f_t = σ(u_f,t + v_f ⊙ c_{t-1} + b_f)
        r_t = σ(u_r,t + v_r ⊙ c_{t-1} + b_r)
        c_t = f_t ⊙ c_{t-1} + (1 - f_t) ⊙ x̃_t
        h_t = x_t + m ⊙ r_t ⊙ (c_t - x_t)               (highway; m = variational dropout mask, all but the last
                                                         layer: a dropped unit passes x_t through, as the
                                                         reference's kernel and elementwise_recurrence_naive)

The gates read c_{t-1} through vectors (v_f, v_r), so the scan carries only c [B, d]; the recurrence is not
linear in c (c_{t-1} sits inside σ), so there is no exact associative scan: `jax.lax.scan` over time.
Attention is in layer i (0-based) when (i + 1) % attention_every == 0, the reference's
`attention_every_n_layers` rule. Initialisation as the reference: W1, W2, W3 Xavier-uniform, W3 scaled by
√(1 - dropout); v_f, v_r ~ U(-weight_c_init, weight_c_init) (SRUpp's weight_c_init = 1.0); b_f = 0,
b_r = highway_bias (-2.0, SRUpp's default); α = 0. The reference's SRUpp defaults are kept: `layer_norm=False`
(no per-layer pre-LN), `attn_layer_norm=True` (the post-LN inside the attention / projection above),
`rescale=False` (the highway term is x itself), one head. `layer_norm=True` adds a pre-LN of each layer's
input; the previous-segment inputs reach attention un-normalised, as in the reference (`normalize_memory=True`
passes them through the same LN: ours, off by default).

The LM around it (the reference enwik8 script's model, asappresearch/sru experiments/srupp_experiments/
train_enwik8.py): embedding E ~ U(±√(3/d)) -> dropout -> SRU++ layers -> output h. Logits = Drop(h) · Wᵀ + b
with W an output layer of its own (the script's nn.Linear, not tied to E). Gradients do not flow into the carry (truncated back-propagation through time, like the
reference's detached hidden state and memory).

TRIME key g: the last layer's output h, i.e. the input of the final projection without the output dropout
(the Transformer's `key_type="final"`; the reference's analogue: `output` of `self.rnn(...)` in the enwik8 LM
before `self.drop` and `output_layer`). f = Drop(h) at training, h at evaluation.

State across segments is explicit: `Carry` = the recurrent cell c of each layer + the previous segment's
inputs of each attention layer (the reference's `memory_bank['saved_inputs']`) + which rows' memory is valid.
`features_carry(tokens, carry)` returns it updated; `features(tokens)` starts from an empty carry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from trime_jax import layers, scoring


@dataclasses.dataclass(frozen=True)
class SRUppConfig:
  """Shapes and regularisation of `SRUppLM` (from a config: `specs.model_config` reads `config.model`'s shared fields and the srupp_* ones)."""

  vocab_size: int
  num_layers: int = 4
  d_model: int = 128  # d: hidden size = key dimension
  attn_dim: int = 32  # d': attention (projection) size
  num_heads: int = 1
  attention_every: int = 1  # attention in layer i when (i + 1) % k == 0
  highway_bias: float = -2.0  # initial b_r
  weight_c_init: float = 1.0  # v_f, v_r ~ U(-w, w)
  layer_norm: bool = False  # pre-LN of each layer's input (reference default: off). The reference enwik8 script's
  # --layer_norm is not this on sru's 3.0.0-dev-tao branch: its SRUpp stores layer_norm unused (the LNs come from
  # normalization_type, default 1 = attn_layer_norm only), so there the flag picks the U(±√(3/d)) init alone
  normalize_memory: bool = False  # with layer_norm: the previous segment's inputs go through the LN too (ours;
  # the reference attends to them un-normalised)
  attn_layer_norm: bool = True  # post-LN inside attention / projection (reference default: on)
  # Evaluation (deterministic calls): each query sees itself and the M positions before it (M = the memory's
  # length, the previous segment), as the reference's eval_model (`set_mask(unroll, same_length=True)`);
  # False: the whole memory and the segment's earlier positions, as in training. Exports of before 2026-12-06
  # (no such field) read as False, how they were evaluated.
  eval_same_length: bool = True
  dropout: float = 0.1
  attention_dropout: float = 0.0
  max_len: int = 1 << 20  # no positional limit; the evaluator checks block_len against it
  dtype: str = "float32"
  key_type: str = "final"  # g = h (input of the final projection)
  backbone: str = "srupp"

  def __post_init__(self):
    if self.vocab_size < 1 or self.num_layers < 1 or self.d_model < 1 or self.attn_dim < 1:
      raise ValueError(f"SRU++ sizes must be positive: vocab {self.vocab_size}, layers {self.num_layers}, "
                       f"d {self.d_model}, d' {self.attn_dim}")
    if self.attn_dim % self.num_heads:
      raise ValueError(f"model.srupp_attn_dim={self.attn_dim} is not divisible by num_heads={self.num_heads}")
    if self.attention_every < 1:
      raise ValueError(f"model.srupp_attention_every must be >= 1, got {self.attention_every}")
    if self.key_type != "final":
      raise ValueError("SRU++ keys are the input of the final projection: model.key_type must be 'final'")

  def has_attention(self, layer: int) -> bool:
    return (layer + 1) % self.attention_every == 0


class Carry(NamedTuple):
  """State handed from one segment to the next of the same stream (B rows)."""

  c: tuple  # per layer [B, d]: the last cell state
  memory: tuple  # per attention layer [B, M, d]: the previous segment's inputs of that layer
  valid: jax.Array  # [B] bool: the memory holds a previous segment (False after a reset)


def sru_recurrence(u_BxLxDx3, x_BxLxD, weight_c_2xD, bias_2xD, c0_BxD, mask_BxD=None):
  """(h [B, L, d], c_L [B, d]): the SRU elementwise recurrence (see the module docstring), a scan over time.
  Computed in float32 at least (bfloat16 inputs are promoted; float64 stays float64)."""
  f32 = jnp.promote_types(u_BxLxDx3.dtype, jnp.float32)
  u = jnp.moveaxis(u_BxLxDx3.astype(f32), 1, 0)  # [L, B, d, 3]
  x = jnp.moveaxis(x_BxLxD.astype(f32), 1, 0)
  vf, vr = weight_c_2xD[0].astype(f32), weight_c_2xD[1].astype(f32)
  bf, br = bias_2xD[0].astype(f32), bias_2xD[1].astype(f32)
  m = 1.0 if mask_BxD is None else mask_BxD.astype(f32)

  def step(c_prev, ux):
    u_t, x_t = ux
    f = jax.nn.sigmoid(u_t[..., 1] + vf * c_prev + bf)
    r = jax.nn.sigmoid(u_t[..., 2] + vr * c_prev + br)
    c = u_t[..., 0] + (c_prev - u_t[..., 0]) * f
    h = (c - x_t) * (m * r) + x_t  # the reference's (cur - x) * mask * g2 + x
    return c, h

  c_last, h = jax.lax.scan(step, c0_BxD.astype(f32), (u, x))
  return jnp.moveaxis(h, 0, 1), c_last


def _scaled_xavier(scale):
  base = layers.xavier()
  return lambda key, shape, dtype=jnp.float32: base(key, shape, dtype) * scale


class Transform(nnx.Module):
  """u = W3 · Drop(LN(α·Attn + z)) (attention) or W3 · Drop(LN(z)) (projected linear): [B, L, 3d]."""

  def __init__(self, cfg: SRUppConfig, attention: bool, *, rngs: nnx.Rngs):
    d, p = cfg.d_model, cfg.attn_dim
    dtype = jnp.dtype(cfg.dtype)
    self.num_heads = cfg.num_heads
    self.eval_same_length = cfg.eval_same_length
    self.linear1 = nnx.Linear(d, p, use_bias=False, kernel_init=layers.xavier(), dtype=dtype, rngs=rngs)
    self.linear2 = nnx.Linear(p, 2 * p, use_bias=False, kernel_init=layers.xavier(), dtype=dtype, rngs=rngs) \
        if attention else None
    # The reference scales W3 by √(1 - dropout) (dropout sits right before it).
    self.linear3 = nnx.Linear(p, 3 * d, use_bias=False, kernel_init=_scaled_xavier((1 - cfg.dropout) ** 0.5),
                              dtype=dtype, rngs=rngs)
    self.alpha = nnx.Param(jnp.zeros((1,), jnp.float32)) if attention else None
    self.norm = layers.layer_norm(p, rngs) if cfg.attn_layer_norm else None
    self.dropout = nnx.Dropout(cfg.dropout)
    self.attn_dropout = nnx.Dropout(cfg.attention_dropout)

  def __call__(self, x_BxLxD, memory_BxMxD=None, valid_B=None, *, deterministic, rngs):
    z = self.linear1(x_BxLxD)
    if self.linear2 is not None:
      b, l, p = z.shape
      zm = z if memory_BxMxD is None else jnp.concatenate([self.linear1(memory_BxMxD), z], axis=1)
      mlen = zm.shape[1] - l
      k, v = jnp.split(self.linear2(zm), 2, axis=-1)
      h = self.num_heads
      q = z.reshape(b, l, h, p // h)
      k = k.reshape(b, mlen + l, h, p // h)
      v = v.reshape(b, mlen + l, h, p // h)
      see = attention_mask(l, mlen, same_length=deterministic and self.eval_same_length)
      see = jnp.broadcast_to(see, (b, l, mlen + l))
      if mlen:  # a reset row has no memory
        see = see & ((jnp.arange(mlen + l) >= mlen)[None, None] | valid_B[:, None, None])
      # every query sees at least itself, so the mask never empties a row
      a = layers.attention(q, k, v, self.attn_dropout, mask_BxTxS=see, deterministic=deterministic,
                           rngs=rngs).reshape(b, l, p)
      z = a * self.alpha[...].astype(a.dtype) + z
    if self.norm is not None:
      z = self.norm(z).astype(x_BxLxD.dtype)
    return self.linear3(self.dropout(z, deterministic=deterministic, rngs=rngs))


def attention_mask(length: int, mem_len: int, *, same_length: bool = False) -> jax.Array:
  """[length, mem_len + length] bool: what each query of a segment sees of [memory; segment]. Training: causal in
  the segment and the whole memory. same_length (the reference's evaluation, `set_mask(unroll, same_length=True)`
  with unroll = mem_len, the previous segment's length): itself and the mem_len positions before it only."""
  i, j = jnp.arange(length)[:, None], jnp.arange(mem_len + length)[None, :]
  see = j <= i + mem_len
  return see & (j >= i) if same_length and mem_len else see


class SRUppLayer(nnx.Module):
  """One SRU++ layer (the reference's SRUppCell): transform, then the elementwise recurrence."""

  def __init__(self, cfg: SRUppConfig, attention: bool, last: bool, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.attention = attention
    self.transform = Transform(cfg, attention, rngs=rngs)
    self.weight_c = nnx.Param(jax.random.uniform(rngs.params(), (2, d), jnp.float32, -cfg.weight_c_init,
                                                 cfg.weight_c_init))  # [v_f; v_r]
    self.bias = nnx.Param(jnp.stack([jnp.zeros((d,)), jnp.full((d,), cfg.highway_bias)]).astype(jnp.float32))
    self.norm = layers.layer_norm(d, rngs) if cfg.layer_norm else None
    self.normalize_memory = cfg.normalize_memory
    self.rate = 0.0 if last else cfg.dropout  # the reference: no dropout on the last layer's c

  def __call__(self, x_BxLxD, c0_BxD, memory=None, valid=None, *, deterministic, rngs):
    xin = x_BxLxD if self.norm is None else self.norm(x_BxLxD).astype(x_BxLxD.dtype)
    if memory is not None and self.norm is not None and self.normalize_memory:
      memory = self.norm(memory).astype(memory.dtype)
    u = self.transform(xin, memory, valid, deterministic=deterministic, rngs=rngs)
    b, l, _ = x_BxLxD.shape
    mask = None
    if not deterministic and self.rate > 0:  # variational: one mask per row, shared over time
      keep = jax.random.bernoulli(rngs.dropout(), 1.0 - self.rate, (b, x_BxLxD.shape[-1]))
      mask = keep / (1.0 - self.rate)
    h, c = sru_recurrence(u.reshape(b, l, -1, 3), x_BxLxD, self.weight_c[...], self.bias[...], c0_BxD, mask)
    return h.astype(x_BxLxD.dtype), c


class SRUppLM(nnx.Module):
  """SRU++ language model with the trime-jax model interface: `features` / `features_carry` -> (f, g[, carry]),
  `logits`, `vocab_stats`, `output_embedding`."""

  stateful = True

  def __init__(self, cfg: SRUppConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.d_model
    # The reference enwik8 script's init_weights (its --layer_norm version): matrices U(±√(3/d)), biases 0;
    # its output layer is an nn.Linear of its own (not tied to the embedding).
    bound = math.sqrt(3.0 / d)
    uniform = lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)
    self.embed = nnx.Embed(cfg.vocab_size, d, embedding_init=uniform, rngs=rngs)
    self.out_weight = nnx.Param(uniform(rngs.params(), (cfg.vocab_size, d)))
    self.out_bias = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32))
    self.drop = nnx.Dropout(cfg.dropout)
    self.layers = nnx.List([SRUppLayer(cfg, cfg.has_attention(i), i + 1 == cfg.num_layers, rngs=rngs)
                            for i in range(cfg.num_layers)])

  # ------------------------------------------------------------------------------------------------------
  def init_carry(self, batch: int, mem_len: int) -> Carry:
    """The empty state: zero cells, an all-invalid attention memory of `mem_len` positions."""
    d, dtype = self.cfg.d_model, jnp.dtype(self.cfg.dtype)
    c = tuple(jnp.zeros((batch, d), jnp.float32) for _ in self.layers)
    mem = tuple(jnp.zeros((batch, mem_len, d), dtype) for layer in self.layers if layer.attention)
    return Carry(c, mem, jnp.zeros((batch,), bool))

  @staticmethod
  def reset_carry(carry: Carry, reset_B) -> Carry:
    """Rows where `reset_B` is True start over (a new stream, or not the continuation of the last segment)."""
    keep = jnp.logical_not(reset_B)
    c = tuple(jnp.where(keep[:, None], x, 0) for x in carry.c)
    mem = tuple(jnp.where(keep[:, None, None], x, 0) for x in carry.memory)
    return Carry(c, mem, carry.valid & keep)

  def features_carry(self, tokens_BxL, carry: Carry, *, deterministic: bool = True, rngs=None):
    """(f [B, L, d], g [B, L, d], new carry) continuing each row from `carry` (no gradient into it)."""
    carry = jax.lax.stop_gradient(carry)
    dtype = jnp.dtype(self.cfg.dtype)
    x = self.drop(self.embed(tokens_BxL).astype(dtype), deterministic=deterministic, rngs=rngs)
    cs, mems, a = [], [], 0
    for layer, c0 in zip(self.layers, carry.c):
      mem = None
      if layer.attention:
        mem = carry.memory[a]
        a += 1
        mems.append(x)  # this segment's input of the layer: the next segment's memory
      x, c = layer(x, c0, mem, carry.valid, deterministic=deterministic, rngs=rngs)
      cs.append(c)
    g = x.astype(dtype)
    f = self.drop(g, deterministic=deterministic, rngs=rngs)
    new = Carry(tuple(cs), tuple(m.astype(dtype) for m in mems), jnp.ones(carry.valid.shape, bool))
    return f, g, new

  def features(self, tokens_BxL, *, deterministic: bool = True, rngs=None):
    """(f, g) from an empty state (no previous segment)."""
    f, g, _ = self.features_carry(tokens_BxL, self.init_carry(tokens_BxL.shape[0], tokens_BxL.shape[1]),
                                  deterministic=deterministic, rngs=rngs)
    return f, g

  # ------------------------------------------------------------------------------------------------------
  def output_embedding(self):
    return self.out_weight[...]

  def logits(self, f_BxLxD):
    w = self.output_embedding().astype(f_BxLxD.dtype)
    return jnp.einsum("bld,vd->blv", f_BxLxD, w, preferred_element_type=jnp.float32) + self.out_bias[...]

  def vocab_stats(self, f_BxLxD, targets_BxL, *, vocab_chunk=0, deterministic=True, rngs=None, criterion=False):
    """As `TransformerLM.vocab_stats` (a full softmax: the criterion's target term is the model's own)."""
    del deterministic, rngs
    if vocab_chunk:
      st = scoring.chunked_vocab_stats(f_BxLxD, self.output_embedding().astype(f_BxLxD.dtype), targets_BxL,
                                    bias_V=self.out_bias[...], chunk=vocab_chunk)
    else:
      st = scoring.vocab_stats(self.logits(f_BxLxD), targets_BxL)
    return (st, st.target_logit) if criterion == "both" else st

  def __call__(self, tokens_BxL, *, deterministic: bool = True, rngs=None):
    f, g = self.features(tokens_BxL, deterministic=deterministic, rngs=rngs)
    return self.logits(f), g
