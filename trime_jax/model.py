"""A decoder-only Transformer LM in Flax NNX, in the style of fairseq's `transformer_lm` (pre-LayerNorm).

The call returns token logits `[B, L, V]` and memory keys `[B, L, D]`. The keys are g(c), by default the
normalised input of the last layer's feed-forward block (the paper's "last_ffn_input"); `key_type="final"`
selects f(c), the final output that multiplies the output embedding.

    x = √D · E[tokens] + P[offset + i]                             (fairseq scales the embeddings)
    for each layer:  x = x + Drop(Attn(LN(x)));  h = LN(x);  x = x + Drop(FFN(h))   (h of the last layer = g)
    f = LN_final(x) (or f = x with final_norm=False);  logits = f · Wᵀ   (W = E when embeddings are tied)

fairseq's `transformer_lm` is always pre-LN and always scales embeddings by √D; what its architectures vary
and this model mirrors: the final LayerNorm (`--no-decoder-final-norm`, set by `transformer_lm_wiki103`), the
three dropouts, sinusoidal vs learned positions, and where positions start (fairseq numbers a sequence's
tokens from padding_idx + 1 = 2: `position_offset=2`). Paper configs and their original flags:
docs/paper_configs.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

KEY_TYPES = ("last_ffn_input", "final")
POSITION_TYPES = ("sinusoidal", "learned")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and regularisation of `TransformerLM` (mirrors `config.model`)."""

  vocab_size: int
  num_layers: int = 4
  d_model: int = 128
  num_heads: int = 4
  d_ff: int = 512
  max_len: int = 512
  positions: str = "sinusoidal"
  position_offset: int = 0  # position of the first token (fairseq: padding_idx + 1 = 2)
  tie_embeddings: bool = True
  final_norm: bool = True  # LayerNorm on the last block's output (fairseq: not --no-decoder-final-norm)
  dropout: float = 0.1
  attention_dropout: float = 0.0
  activation_dropout: float = 0.0
  key_type: str = "last_ffn_input"
  dtype: str = "float32"  # compute dtype (bfloat16 on TPU); parameters stay float32

  def __post_init__(self):
    if self.key_type not in KEY_TYPES:
      raise ValueError(f"model.key_type must be one of {KEY_TYPES}, got {self.key_type!r}")
    if self.positions not in POSITION_TYPES:
      raise ValueError(f"model.positions must be one of {POSITION_TYPES}, got {self.positions!r}")
    if self.d_model % self.num_heads:
      raise ValueError(f"model.d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
    if self.vocab_size < 1:
      raise ValueError(f"model.vocab_size must be positive, got {self.vocab_size}")
    if self.position_offset < 0:
      raise ValueError(f"model.position_offset must be >= 0, got {self.position_offset}")

  @classmethod
  def from_config(cls, model_cfg, vocab_size: int | None = None) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in dict(model_cfg).items() if k in fields}
    if vocab_size is not None:
      kwargs["vocab_size"] = vocab_size
    return cls(**kwargs)


def sinusoidal_positions(length: int, dim: int):
  """fairseq's sinusoidal embedding: [sin | cos] halves, frequencies 10000^(-i/(half-1))."""
  half = dim // 2
  freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000.0) / max(half - 1, 1)))
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * freq[None, :]
  emb = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=1)
  if dim % 2:
    emb = jnp.pad(emb, ((0, 0), (0, 1)))
  return emb


def _xavier():
  return nnx.initializers.xavier_uniform()


class CausalSelfAttention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.num_heads = cfg.num_heads
    self.dtype = jnp.dtype(cfg.dtype)
    self.qkv = nnx.Linear(d, 3 * d, kernel_init=_xavier(), dtype=self.dtype, rngs=rngs)
    self.out = nnx.Linear(d, d, kernel_init=_xavier(), dtype=self.dtype, rngs=rngs)
    self.attn_dropout = nnx.Dropout(cfg.attention_dropout)

  def __call__(self, x_BxLxD, *, deterministic: bool, rngs):
    b, l, d = x_BxLxD.shape
    h = self.num_heads
    qkv = self.qkv(x_BxLxD).reshape(b, l, 3, h, d // h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, L, H, Dh]
    if deterministic or self.attn_dropout.rate == 0.0:
      y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    else:  # attention-probability dropout needs the explicit weights
      logits = jnp.einsum("blhd,bmhd->bhlm", q, k, preferred_element_type=jnp.float32) / math.sqrt(d // h)
      causal = jnp.tril(jnp.ones((l, l), bool))
      probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1).astype(v.dtype)
      probs = self.attn_dropout(probs, deterministic=False, rngs=rngs)
      y = jnp.einsum("bhlm,bmhd->blhd", probs, v)
    return self.out(y.reshape(b, l, d))


class Block(nnx.Module):
  """Pre-LN Transformer block; returns the block output and the normalised FFN input (a key candidate)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.attn_norm = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
    self.attn = CausalSelfAttention(cfg, rngs=rngs)
    self.ffn_norm = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
    dtype = jnp.dtype(cfg.dtype)
    self.fc1 = nnx.Linear(d, cfg.d_ff, kernel_init=_xavier(), dtype=dtype, rngs=rngs)
    self.fc2 = nnx.Linear(cfg.d_ff, d, kernel_init=_xavier(), dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout)
    self.act_dropout = nnx.Dropout(cfg.activation_dropout)

  def __call__(self, x, *, deterministic: bool, rngs):
    drop = dict(deterministic=deterministic, rngs=rngs)
    x = x + self.dropout(self.attn(self.attn_norm(x), deterministic=deterministic, rngs=rngs), **drop)
    ffn_in = self.ffn_norm(x)
    h = self.act_dropout(jax.nn.relu(self.fc1(ffn_in)), **drop)
    x = x + self.dropout(self.fc2(h), **drop)
    return x, ffn_in


class TransformerLM(nnx.Module):
  """Decoder-only LM: `model(tokens) -> (logits [B, L, V], keys [B, L, D])`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.d_model
    self.embed = nnx.Embed(cfg.vocab_size, d, embedding_init=nnx.initializers.normal(d**-0.5), rngs=rngs)
    if cfg.positions == "learned":  # rows below the offset are never read (fairseq's padding rows)
      self.pos_embed = nnx.Embed(cfg.max_len + cfg.position_offset, d,
                                 embedding_init=nnx.initializers.normal(d**-0.5), rngs=rngs)
    self.embed_dropout = nnx.Dropout(cfg.dropout)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    # No final LayerNorm at all (no parameters) when off, like fairseq's `layer_norm = None`.
    self.final_norm = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs) if cfg.final_norm else None
    if not cfg.tie_embeddings:
      self.output = nnx.Param(nnx.initializers.normal(d**-0.5)(rngs.params(), (cfg.vocab_size, d)))

  def output_embedding(self):
    """The `[V, D]` output matrix W of logits = f · Wᵀ (the input embedding when tied)."""
    return self.embed.embedding[...] if self.cfg.tie_embeddings else self.output[...]

  def features(self, tokens_BxL, *, deterministic: bool = True, rngs=None):
    """(f [B, L, D], g [B, L, D]): the final output and the memory keys."""
    cfg = self.cfg
    b, l = tokens_BxL.shape
    if l > cfg.max_len:
      raise ValueError(f"sequence length {l} exceeds model.max_len={cfg.max_len}")
    dtype = jnp.dtype(cfg.dtype)
    x = self.embed(tokens_BxL) * math.sqrt(cfg.d_model)
    offset = cfg.position_offset
    if cfg.positions == "learned":
      x = x + self.pos_embed(jnp.arange(l) + offset)[None]
    else:
      x = x + sinusoidal_positions(l + offset, cfg.d_model)[None, offset:]
    x = self.embed_dropout(x.astype(dtype), deterministic=deterministic, rngs=rngs)
    ffn_in = x
    for block in self.blocks:
      x, ffn_in = block(x, deterministic=deterministic, rngs=rngs)
    # Both leave in the compute dtype (LayerNorm promotes to float32): under bfloat16 the output projection
    # and the memory similarities then run as bfloat16 products with float32 accumulation, like attention.
    f = (self.final_norm(x) if self.final_norm is not None else x).astype(dtype)
    g = ffn_in.astype(dtype) if cfg.key_type == "last_ffn_input" else f
    return f, g

  def logits(self, f_BxLxD):
    w = self.output_embedding().astype(f_BxLxD.dtype)
    return jnp.einsum("bld,vd->blv", f_BxLxD, w, preferred_element_type=jnp.float32)

  def __call__(self, tokens_BxL, *, deterministic: bool = True, rngs=None):
    f, g = self.features(tokens_BxL, deterministic=deterministic, rngs=rngs)
    return self.logits(f), g


def count_params(tree) -> int:
  return int(sum(x.size for x in jax.tree_util.tree_leaves(tree)))


def abstract_param_count(cfg: ModelConfig) -> int:
  """Parameter count from shapes only (`nnx.eval_shape`: nothing is allocated)."""
  abstract = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
  return count_params(nnx.state(abstract, nnx.Param))
