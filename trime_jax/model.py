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

Adaptive input and adaptive softmax (Baevski & Auli 2019; Grave et al. 2017), as fairseq's adaptive_input.py
and adaptive_softmax.py define them (docs/paper_models.md). The vocabulary is cut into bands
[0, c_1), [c_1, c_2), ..., [c_k, V); band i has dimension D / factor^i.

    adaptive input:   E[w] = E_i[w - c_i] · P_i          (E_i [V_i, D/factor^i], P_i [D/factor^i, D], every band)
    adaptive softmax: head logits h = f · [E_0; C]ᵀ over the c_1 shortlist words and k cluster tokens (C [k, D]);
                      tail i: t_i = (f · Q_i) · E_iᵀ (Q_i [D, D/factor^i]; with tie_adaptive_proj Q_i = P_iᵀ)
                      log p(w in band 0) = log_softmax(h)_w;  log p(w in band i) = log_softmax(h)_{c_1+i-1}
                      + log_softmax(t_i)_{w - c_i}

With `tie_embeddings` the adaptive softmax reuses the adaptive input's E_i (fairseq --tie-adaptive-weights).
The TRIME objective takes the vocabulary side the way the original criterion (trime_loss.py) does: the
log-normaliser is the head's log-sum-exp and the target's term is log p(target) + that normaliser, so
`vocab_stats` returns those two numbers, and `logits` returns the *effective* logits log p(w) + lse(h)
whose softmax is the adaptive distribution.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from trime_jax import flash_attention
from trime_jax import layers
from trime_jax import scoring
from trime_jax.errors import ConfigError

KEY_TYPES = layers.KEY_TYPES
POSITION_TYPES = ("sinusoidal", "learned")
ATTENTION_IMPLS = layers.ATTENTION_IMPLS
DROPOUT_MASKS = layers.DROPOUT_MASKS
# model.remat: what each Transformer block's backward pass keeps from its forward pass, as a jax.checkpoint
# policy. "none": no checkpoint (XLA keeps what it likes); "block": only the block's input, everything inside
# recomputed; "dots_saveable": every matmul output kept (attention's q·kᵀ too), elementwise work recomputed;
# "dots_with_no_batch_dims_saveable": the projections' and the FFN's outputs kept, attention recomputed.
# Gradients are the same numbers either way (tests/test_speed_options.py); only memory and time change.
REMAT_POLICIES = ("none", "block", "dots_saveable", "dots_with_no_batch_dims_saveable")
CUDNN_DTYPES = ("bfloat16", "float16")  # the dtypes cuDNN's fused attention kernel takes


FAIRSEQ_PADDING_IDX = 1  # fairseq Dictionary's <pad>: the original's criteria ignore targets equal to it


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
  adaptive_input: bool = False  # banded input embedding (fairseq --adaptive-input)
  adaptive_softmax: bool = False  # head + tail-cluster output layer (fairseq --adaptive-softmax-cutoff)
  adaptive_cutoffs: tuple = ()  # band starts c_1 < c_2 < ... < V for both (V is appended, as fairseq does)
  adaptive_input_factor: float = 4.0  # band i of the input has D / factor^i dimensions
  adaptive_softmax_factor: float = 4.0  # tail i of the softmax has D / factor^i dimensions
  tie_adaptive_proj: bool = False  # tail projections Q_i = P_iᵀ of the adaptive input (needs tie_embeddings)
  adaptive_softmax_dropout: float = 0.0  # dropout on the softmax input and inside each tail (fairseq's p)
  # The original's TRIME criterion and TRIME scorer take a tail's term with F.cross_entropy(ignore_index=pad=1)
  # on the tail-relative target, so the word at band start c_i + 1 of every tail gets no tail term: its
  # probability inside the TRIME softmax is its cluster's (plain evaluation, get_log_prob, is exact). True
  # reproduces that (`vocab_stats(..., criterion=True | "both")`); False: every word its exact term.
  adaptive_tail_ignores_pad: bool = False
  # causal attention: xla | cudnn (flash kernel without dropout; GPU, bf16/fp16) | pallas (ours, with dropout; GPU)
  attention_impl: str = "xla"
  # how every dropout draws its mask: nnx (nnx.Dropout's random bits) | hash (the pallas kernels' counter hash)
  dropout_mask: str = "nnx"
  remat: str = "none"  # per-block rematerialisation (REMAT_POLICIES): memory for recomputation, same numbers
  # Adaptive softmax, the target terms of tail i: 1.0 computes the tail for every row (static shapes); r < 1 for
  # the rows whose targets are in tail i only, up to ceil(r · rows) of them (more in a batch: every row). Exact.
  adaptive_tail_rows: float = 1.0

  def __post_init__(self):
    # JSON round trips (exported config.json) turn tuples into lists; the config must stay hashable.
    object.__setattr__(self, "adaptive_cutoffs", tuple(int(c) for c in self.adaptive_cutoffs))
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
    cuts = (0,) + self.adaptive_cutoffs + (self.vocab_size,)
    if any(a >= b for a, b in zip(cuts, cuts[1:])):
      raise ValueError(f"model.adaptive_cutoffs={self.adaptive_cutoffs} must increase strictly inside "
                       f"(0, vocab_size={self.vocab_size})")
    if self.tie_embeddings and self.adaptive_input != self.adaptive_softmax:
      raise ValueError("model.tie_embeddings ties the input and output layers: with adaptive_input or "
                       "adaptive_softmax it needs both (fairseq --tie-adaptive-weights asserts the same)")
    if self.tie_embeddings and self.adaptive_softmax and self.adaptive_input_factor != self.adaptive_softmax_factor:
      raise ValueError("tied adaptive input and softmax need adaptive_input_factor == adaptive_softmax_factor")
    if self.tie_adaptive_proj and not (self.tie_embeddings and self.adaptive_softmax):
      raise ValueError("model.tie_adaptive_proj needs a tied adaptive softmax (tie_embeddings, adaptive_softmax, "
                       "adaptive_input)")
    if not 0.0 <= self.adaptive_softmax_dropout < 1.0:
      raise ValueError(f"model.adaptive_softmax_dropout must be in [0, 1), got {self.adaptive_softmax_dropout}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"model.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
    if self.dropout_mask not in DROPOUT_MASKS:
      raise ValueError(f"model.dropout_mask must be one of {DROPOUT_MASKS}, got {self.dropout_mask!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
    if not 0.0 < self.adaptive_tail_rows <= 1.0:
      raise ValueError(f"model.adaptive_tail_rows must be in (0, 1], got {self.adaptive_tail_rows}")
    problem = attention_impl_problem(self.attention_impl, self.dtype, self.d_model, self.num_heads)
    if problem:
      raise ValueError(problem)

  @property
  def band_edges(self) -> tuple:
    """(0, c_1, ..., c_k, V): band i holds words [edges[i], edges[i + 1])."""
    return (0,) + self.adaptive_cutoffs + (self.vocab_size,)


def attention_impl_problem(attention_impl: str, dtype: str, d_model: int, num_heads: int) -> str | None:
  """Why the chosen fused attention kernel cannot take this model (None: it can, or attention_impl is "xla"):
  cuDNN's computes in bfloat16 / float16 only, with a head dimension that is a multiple of 8, at most 256; ours
  ("pallas", Triton tiles) needs a head dimension that is a power of two of at least 16."""
  head = d_model // max(num_heads, 1)
  if attention_impl == "pallas":
    problem = flash_attention.shape_problem(16, head)
    return (f"model.attention_impl='pallas' (our flash attention with dropout) needs {problem}: use "
            "model.attention_impl='xla'") if problem else None
  if attention_impl != "cudnn":
    return None
  if dtype not in CUDNN_DTYPES:
    return (f"model.attention_impl='cudnn' (cuDNN's flash attention) computes in {CUDNN_DTYPES} only, model.dtype "
            f"is {dtype!r}: set model.dtype='bfloat16' or model.attention_impl='xla'")
  if head % 8 or head > 256:
    return (f"model.attention_impl='cudnn' (cuDNN's flash attention) needs a head dimension d_model / num_heads "
            f"that is a multiple of 8 and at most 256, got {d_model} / {num_heads} = {head}: use "
            "model.attention_impl='xla'")
  return None


def _cudnn_backend() -> bool:
  """Whether jax's default backend is a GPU (cuDNN ships with jax's CUDA plugin; Triton, for Pallas, too)."""
  return jax.default_backend() == "gpu"


def check_attention_backend(attention_impl: str) -> None:
  """A ConfigError naming the field when `attention_impl` cannot run on this backend: without it, "cudnn" on a
  CPU or TPU fails at compile time deep inside XLA, and "pallas" would run Pallas's interpreter (tests only)."""
  what = {"cudnn": "cuDNN's flash attention", "pallas": "our flash attention with dropout, Pallas on Triton"}
  if attention_impl in what and not _cudnn_backend():
    raise ConfigError(f"model.attention_impl={attention_impl!r} needs an NVIDIA GPU ({what[attention_impl]}); "
                      f"jax's default backend is {jax.default_backend()!r}: use model.attention_impl='xla'")


def _remat(fn, policy: str):
  """`fn(block, x, rngs)` under nnx.remat with the named policy (REMAT_POLICIES); "none": `fn` itself."""
  if policy == "none":
    return fn
  jax_policy = None if policy == "block" else getattr(jax.checkpoint_policies, policy)
  return nnx.remat(fn, policy=jax_policy)


# Shared with the translation model (trime_jax/layers.py); the names stay importable from here.
sinusoidal_positions = layers.sinusoidal_positions
_xavier = layers.xavier


class CausalSelfAttention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.num_heads = cfg.num_heads
    self.dtype = jnp.dtype(cfg.dtype)
    self.qkv = layers.linear(d, 3 * d, self.dtype, rngs)  # fused q, k, v (fairseq imports split its rows)
    self.out = layers.linear(d, d, self.dtype, rngs)
    self.attn_dropout = layers.Dropout(cfg.attention_dropout, mask=cfg.dropout_mask)
    self.attention_impl = cfg.attention_impl  # a static attribute: not a parameter, the tree is unchanged

  def __call__(self, x_BxLxD, *, deterministic: bool, rngs):
    b, l, d = x_BxLxD.shape
    h = self.num_heads
    qkv = self.qkv(x_BxLxD).reshape(b, l, 3, h, d // h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, L, H, Dh]
    y = layers.attention(q, k, v, self.attn_dropout, causal=True, deterministic=deterministic, rngs=rngs,
                         implementation=self.attention_impl)
    return self.out(y.reshape(b, l, d))

  def decode(self, x_BxTxD, k_cache_BxCxHxDh, v_cache_BxCxHxDh, pos_BxT):
    """Attention of T new tokens at cache positions `pos` (per row) over the cache, after writing their
    keys and values into it: (y [B, T, D], k_cache, v_cache). A query at position p sees positions <= p;
    positions past a row's last write are never read. Deterministic (generation has no dropout)."""
    b, t, d = x_BxTxD.shape
    h = self.num_heads
    qkv = self.qkv(x_BxTxD).reshape(b, t, 3, h, d // h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    rows = jnp.arange(b)[:, None]
    k_cache = k_cache_BxCxHxDh.at[rows, pos_BxT].set(k.astype(k_cache_BxCxHxDh.dtype), mode="drop")
    v_cache = v_cache_BxCxHxDh.at[rows, pos_BxT].set(v.astype(v_cache_BxCxHxDh.dtype), mode="drop")
    seen_BxTxC = jnp.arange(k_cache.shape[1])[None, None, :] <= pos_BxT[:, :, None]
    # Always XLA's path, whatever attention_impl: the visible keys are a per-row mask over the cache (not the
    # T = S causal triangle cuDNN's causal mode assumes), and a step is one query per row, memory-bound anyway.
    y = jax.nn.dot_product_attention(q, k_cache, v_cache, mask=seen_BxTxC[:, None])
    return self.out(y.reshape(b, t, d)), k_cache, v_cache


class Block(nnx.Module):
  """Pre-LN Transformer block; returns the block output and the normalised FFN input (a key candidate)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.attn_norm = layers.layer_norm(d, rngs)
    self.attn = CausalSelfAttention(cfg, rngs=rngs)
    self.ffn_norm = layers.layer_norm(d, rngs)
    dtype = jnp.dtype(cfg.dtype)
    self.fc1 = layers.linear(d, cfg.d_ff, dtype, rngs)  # the block's own fc1 / fc2 (fairseq's names), no sub-module
    self.fc2 = layers.linear(cfg.d_ff, d, dtype, rngs)
    self.dropout = layers.Dropout(cfg.dropout, mask=cfg.dropout_mask)
    self.act_dropout = layers.Dropout(cfg.activation_dropout, mask=cfg.dropout_mask)

  def __call__(self, x, *, deterministic: bool, rngs):
    drop = dict(deterministic=deterministic, rngs=rngs)
    x = x + self.dropout(self.attn(self.attn_norm(x), deterministic=deterministic, rngs=rngs), **drop)
    ffn_in = self.ffn_norm(x)
    x = x + self.dropout(layers.feed_forward(ffn_in, self.fc1, self.fc2, self.act_dropout, **drop), **drop)
    return x, ffn_in

  def decode(self, x, k_cache, v_cache, pos_BxT):
    """`__call__` without dropout for tokens at cache positions `pos` (see `CausalSelfAttention.decode`)."""
    a, k_cache, v_cache = self.attn.decode(self.attn_norm(x), k_cache, v_cache, pos_BxT)
    x = x + a
    ffn_in = self.ffn_norm(x)
    x = x + layers.feed_forward(ffn_in, self.fc1, self.fc2, self.act_dropout, deterministic=True, rngs=None)
    return x, ffn_in, k_cache, v_cache


def band_dim(d_model: int, factor: float, band: int) -> int:
  """fairseq's int(D // factor^band)."""
  return int(d_model // (factor ** band))


class AdaptiveInput(nnx.Module):
  """Banded embedding: E[w] = E_i[w - c_i] · P_i for w in band i (fairseq AdaptiveInput, every band projected)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, edges = cfg.d_model, cfg.band_edges
    self.edges = edges
    self.dtype = jnp.dtype(cfg.dtype)
    dims = [band_dim(d, cfg.adaptive_input_factor, i) for i in range(len(edges) - 1)]
    # fairseq: embeddings N(0, dim^-1/2), projections Xavier-uniform (no bias).
    self.embeddings = nnx.List([
        nnx.Embed(edges[i + 1] - edges[i], dim, embedding_init=layers.embedding_init(dim), rngs=rngs)
        for i, dim in enumerate(dims)])
    self.projections = nnx.List([nnx.Linear(dim, d, use_bias=False, kernel_init=_xavier(), dtype=self.dtype,
                                            rngs=rngs) for dim in dims])

  def __call__(self, tokens_BxL):
    # Every band embeds every token (indices clipped into the band) and a select keeps the right one: static
    # shapes, and the cost of the small bands' lookups and projections is a fraction of one layer.
    out = None
    for i, (emb, proj) in enumerate(zip(self.embeddings, self.projections)):
      lo, hi = self.edges[i], self.edges[i + 1]
      x = proj(emb(jnp.clip(tokens_BxL - lo, 0, hi - lo - 1)))
      out = x if out is None else jnp.where(((tokens_BxL >= lo) & (tokens_BxL < hi))[..., None], x, out)
    return out


class AdaptiveSoftmax(nnx.Module):
  """The adaptive softmax's own parameters (fairseq AdaptiveSoftmax); tied ones are passed in by the LM.

  Untied: head [c_1 + k, D], tail projections Q_i [D, dim_i], tail outputs [V_i, dim_i]. Tied
  (tie_embeddings): only the cluster rows C [k, D] of the head, and Q_i unless tie_adaptive_proj.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, edges = cfg.d_model, cfg.band_edges
    k = len(edges) - 2
    tied = cfg.tie_embeddings
    xavier = _xavier()
    dims = [band_dim(d, cfg.adaptive_softmax_factor, i + 1) for i in range(k)]
    # fairseq initialises every untied output weight Xavier-uniform; shapes [out, in] like torch's Linear.
    if tied:
      self.cluster = nnx.Param(xavier(rngs.params(), (k, d))) if k else None  # TiedHeadModule.class_proj
      self.head = None
    else:
      self.cluster = None
      self.head = nnx.Param(xavier(rngs.params(), (edges[1] + k, d)))
    self.tail_proj = None if cfg.tie_adaptive_proj else nnx.List(
        [nnx.Param(xavier(rngs.params(), (dim, d)).T) for dim in dims])  # [D, dim_i], Linear(D, dim_i)ᵀ
    self.tail_out = None if tied else nnx.List(
        [nnx.Param(xavier(rngs.params(), (edges[i + 2] - edges[i + 1], dim))) for i, dim in enumerate(dims)])
    self.dropout = layers.Dropout(cfg.adaptive_softmax_dropout, mask=cfg.dropout_mask)


class KVCache(NamedTuple):
  """Attention keys and values of every cached position, one `[B, C, H, D/H]` array per layer (C <= max_len)."""

  k: tuple
  v: tuple


class TransformerLM(nnx.Module):
  """Decoder-only LM: `model(tokens) -> (logits [B, L, V], keys [B, L, D])`."""

  stateful = False  # no state across segments (see `build_model`, trime_jax/srupp.py)

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    check_attention_backend(cfg.attention_impl)  # here, not at compile time inside XLA
    self.cfg = cfg
    d = cfg.d_model
    if cfg.adaptive_input:
      self.adaptive_embed = AdaptiveInput(cfg, rngs=rngs)
    else:
      self.embed = nnx.Embed(cfg.vocab_size, d, embedding_init=layers.embedding_init(d), rngs=rngs)
    if cfg.positions == "learned":  # rows below the offset are never read (fairseq's padding rows)
      self.pos_embed = nnx.Embed(cfg.max_len + cfg.position_offset, d,
                                 embedding_init=layers.embedding_init(d), rngs=rngs)
    self.embed_dropout = layers.Dropout(cfg.dropout, mask=cfg.dropout_mask)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    # No final LayerNorm at all (no parameters) when off, like fairseq's `layer_norm = None`.
    self.final_norm = layers.layer_norm(d, rngs) if cfg.final_norm else None
    if cfg.adaptive_softmax:
      self.adaptive_softmax = AdaptiveSoftmax(cfg, rngs=rngs)
    elif not cfg.tie_embeddings:
      self.output = nnx.Param(layers.embedding_init(d)(rngs.params(), (cfg.vocab_size, d)))

  def output_embedding(self):
    """The `[V, D]` output matrix W of logits = f · Wᵀ (the input embedding when tied); full softmax only."""
    if self.cfg.adaptive_softmax:
      raise ValueError("an adaptive softmax has no [V, D] output matrix: use model.logits or model.vocab_stats")
    return self.embed.embedding[...] if self.cfg.tie_embeddings else self.output[...]

  def features(self, tokens_BxL, *, deterministic: bool = True, rngs=None):
    """(f [B, L, D], g [B, L, D]): the final output and the memory keys."""
    cfg = self.cfg
    b, l = tokens_BxL.shape
    if l > cfg.max_len:
      raise ValueError(f"sequence length {l} exceeds model.max_len={cfg.max_len}")
    dtype = jnp.dtype(cfg.dtype)
    embed = self.adaptive_embed if cfg.adaptive_input else self.embed
    x = embed(tokens_BxL) * math.sqrt(cfg.d_model)  # fairseq scales adaptive inputs by √D too
    offset = cfg.position_offset
    if cfg.positions == "learned":
      x = x + self.pos_embed(jnp.arange(l) + offset)[None]
    else:
      x = x + sinusoidal_positions(l + offset, cfg.d_model)[None, offset:]
    x = self.embed_dropout(x.astype(dtype), deterministic=deterministic, rngs=rngs)
    ffn_in = x
    # model.remat: each block under jax.checkpoint (its backward pass recomputes what the policy does not keep);
    # the block's dropout keys come from `rngs` in the same order, so the numbers are those without it.
    run = _remat(lambda block, x, rngs: block(x, deterministic=deterministic, rngs=rngs), cfg.remat)
    for block in self.blocks:
      x, ffn_in = run(block, x, rngs)
    # Both leave in the compute dtype (LayerNorm promotes to float32): under bfloat16 the output projection
    # and the memory similarities then run as bfloat16 products with float32 accumulation, like attention.
    f = (self.final_norm(x) if self.final_norm is not None else x).astype(dtype)
    g = ffn_in.astype(dtype) if cfg.key_type == "last_ffn_input" else f
    return f, g

  # -------------------------------------------------------------------------------------------------------
  # Incremental decoding (generation): the same network over a key/value cache, one token per step.
  # -------------------------------------------------------------------------------------------------------
  def init_cache(self, batch: int, length: int | None = None) -> KVCache:
    """An empty cache of `length` (default max_len) positions per row."""
    cfg = self.cfg
    length = cfg.max_len if length is None else length
    if not 0 < length <= cfg.max_len:
      raise ValueError(f"cache length {length} must be in (0, model.max_len={cfg.max_len}]")
    shape = (batch, length, cfg.num_heads, cfg.d_model // cfg.num_heads)
    zeros = lambda: tuple(jnp.zeros(shape, jnp.dtype(cfg.dtype)) for _ in range(cfg.num_layers))
    return KVCache(zeros(), zeros())

  def decode(self, tokens_BxT, cache: KVCache, pos_BxT):
    """(f [B, T, D], g [B, T, D], cache) of tokens at cache positions `pos_BxT` (position i of a row is its
    i-th token, as in `features`; rows may stand at different positions). Writes the tokens into the cache;
    a prompt is one call with pos = arange(T) (right-padded rows: padding is written but never seen), then
    one token per call. Equals `features` of the whole sequence up to float rounding (tested)."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    embed = self.adaptive_embed if cfg.adaptive_input else self.embed
    x = embed(tokens_BxT) * math.sqrt(cfg.d_model)
    p = pos_BxT + cfg.position_offset
    if cfg.positions == "learned":
      x = x + self.pos_embed(p)
    else:  # the same table rows `features` slices
      x = x + sinusoidal_positions(cfg.max_len + cfg.position_offset, cfg.d_model)[p]
    x = x.astype(dtype)
    ffn_in, ks, vs = x, [], []
    for block, k_cache, v_cache in zip(self.blocks, cache.k, cache.v):
      x, ffn_in, k_cache, v_cache = block.decode(x, k_cache, v_cache, pos_BxT)
      ks.append(k_cache)
      vs.append(v_cache)
    f = (self.final_norm(x) if self.final_norm is not None else x).astype(dtype)
    g = ffn_in.astype(dtype) if cfg.key_type == "last_ffn_input" else f
    return f, g, KVCache(tuple(ks), tuple(vs))

  # -------------------------------------------------------------------------------------------------------
  # Adaptive softmax pieces (weights cast to the compute dtype of f, products accumulated in float32)
  # -------------------------------------------------------------------------------------------------------
  def _head_weight(self, dtype):
    """[c_1 + k, D]: shortlist rows, then one row per tail cluster."""
    sm = self.adaptive_softmax
    if sm.head is not None:
      return sm.head[...].astype(dtype)
    rows = [self.adaptive_embed.embeddings[0].embedding[...]]
    if sm.cluster is not None:
      rows.append(sm.cluster[...])
    return jnp.concatenate(rows, axis=0).astype(dtype)

  def _tail(self, i, dtype):
    """(Q_i [D, dim], E_i [V_i, dim]) of tail cluster i (band i + 1)."""
    sm, ai = self.adaptive_softmax, getattr(self, "adaptive_embed", None)
    proj = ai.projections[i + 1].kernel[...].T if sm.tail_proj is None else sm.tail_proj[i][...]
    out = ai.embeddings[i + 1].embedding[...] if sm.tail_out is None else sm.tail_out[i][...]
    return proj.astype(dtype), out.astype(dtype)

  def _tail_hidden(self, f_NxD, i, drop):
    proj, out = self._tail(i, f_NxD.dtype)
    h = jnp.einsum("nd,de->ne", f_NxD, proj, preferred_element_type=jnp.float32).astype(f_NxD.dtype)
    return self.adaptive_softmax.dropout(h, **drop), out

  def _tail_term(self, f_NxD, t_N, in_tail_N, i, stats, vocab_chunk, deterministic, rngs):
    """[N] log p(target | tail i) for the rows whose targets are in tail i (in_tail), 0 elsewhere.

    model.adaptive_tail_rows = 1: tail i for every row (static shapes; tails are D/factor^i wide). r < 1: as the
    original computes it, for the tail's rows only: the first C = ceil(r · N) of them gathered (jnp.nonzero with a
    static size), their terms scattered back; a batch with more than C tail rows takes the every-row branch
    (lax.cond), so the value is the same either way. The tail's dropout key is drawn before the branch (the same
    key, the same stream position as the every-row path draws it); the gathered rows' masks differ from the
    every-row path's (other positions), with the same distribution.

    `stats(h, out, t_N, chunk)`: the tail's VocabStats over vocabulary chunks of `chunk` words (0: one matmul).
    A static memory plan must hold whichever branch may run, so the every-row branch takes chunks of
    ~r · (vocab_chunk or V_i) words: [N, r · chunk] blocks, the size of the gathered branch's [C, chunk], instead of
    [N, V_i] logits that would cancel the option's memory saving (tests/test_adaptive.py measures the plan)."""
    n = t_N.shape[0]
    rate = self.adaptive_softmax.dropout.rate
    key = None if deterministic or rate == 0.0 else layers.dropout_key(self.adaptive_softmax.dropout, rngs)
    drop = dict(deterministic=key is None, rngs=key)

    def every_row(chunk):
      h, out = self._tail_hidden(f_NxD, i, drop)
      tail = stats(h, out, t_N, chunk)
      return jnp.where(in_tail_N, tail.target_logit - tail.log_normalizer, 0.0)

    cap = math.ceil(self.cfg.adaptive_tail_rows * n)
    if cap >= n:
      return every_row(vocab_chunk)

    def tail_rows_only(_):
      rows = jnp.nonzero(in_tail_N, size=cap, fill_value=0)[0]  # [C]: the tail's rows, then row 0 as filler
      real = jnp.arange(cap) < jnp.sum(in_tail_N)
      h, out = self._tail_hidden(f_NxD[rows], i, drop)
      tail = stats(h, out, t_N[rows], vocab_chunk)
      term = jnp.where(real, tail.target_logit - tail.log_normalizer, 0.0)
      return jnp.zeros((n,), term.dtype).at[rows].add(term)  # a filler adds 0 to row 0

    v_i = self.cfg.band_edges[i + 2] - self.cfg.band_edges[i + 1]
    bounded_chunk = max(1, (vocab_chunk or v_i) * cap // n)
    return lax.cond(jnp.sum(in_tail_N) <= cap, tail_rows_only, lambda _: every_row(bounded_chunk), None)

  def _band(self, targets):
    """Band index of each target (0: shortlist, i: tail cluster i - 1); padding (< 0) counts as band 0."""
    return sum((targets >= c).astype(jnp.int32) for c in self.cfg.adaptive_cutoffs)

  def logits(self, f_BxLxD):
    """Effective logits [B, L, V]: f · Wᵀ (full softmax); adaptive: log p(w) + lse(head), so softmax(logits)
    is the adaptive distribution and logsumexp(logits) = lse(head), the original criterion's norm_t."""
    if not self.cfg.adaptive_softmax:
      w = self.output_embedding().astype(f_BxLxD.dtype)
      return jnp.einsum("bld,vd->blv", f_BxLxD, w, preferred_element_type=jnp.float32)
    lead, dtype = f_BxLxD.shape[:-1], f_BxLxD.dtype
    f = f_BxLxD.reshape(-1, f_BxLxD.shape[-1])
    head = jnp.einsum("nd,vd->nv", f, self._head_weight(dtype), preferred_element_type=jnp.float32)
    c1 = self.cfg.band_edges[1]
    parts = [head[:, :c1]]
    for i in range(len(self.cfg.adaptive_cutoffs)):
      h, out = self._tail_hidden(f, i, dict(deterministic=True))
      tail = jnp.einsum("ne,ve->nv", h, out, preferred_element_type=jnp.float32)
      parts.append(jax.nn.log_softmax(tail, axis=-1) + head[:, c1 + i, None])
    return jnp.concatenate(parts, axis=-1).reshape(lead + (self.cfg.vocab_size,))

  def vocab_stats(self, f_BxLxD, targets_BxL, *, vocab_chunk=0, deterministic=True, rngs=None, criterion=False):
    """The vocabulary side of the TRIME loss without [B, L, V] when vocab_chunk > 0 (adaptive: never).

    Full softmax: log Σ_v exp(f·W_v) and f·W_target. Adaptive softmax, as the original criterion: the head's
    log-sum-exp (norm_t) and log p(target) + norm_t, where a tail target adds its cluster's log-softmax
    (computed for every row: static shapes; tails are D/factor^i wide, so that costs little).

    criterion=False: the model's own target term. True: the TRIME criterion's (= the model's unless
    `cfg.adaptive_tail_ignores_pad`). "both": (VocabStats, the criterion's target logit [B, L]).
    """
    stats, crit = self._vocab_stats(f_BxLxD, targets_BxL, vocab_chunk, deterministic, rngs)
    if criterion == "both":
      return stats, crit
    return scoring.VocabStats(stats.log_normalizer, crit) if criterion else stats

  def _vocab_stats(self, f_BxLxD, targets_BxL, vocab_chunk, deterministic, rngs):
    """(VocabStats, the TRIME criterion's target logit)."""
    if not self.cfg.adaptive_softmax:
      if vocab_chunk:
        w = self.output_embedding().astype(f_BxLxD.dtype)
        st = scoring.chunked_vocab_stats(f_BxLxD, w, targets_BxL, chunk=vocab_chunk)
      else:
        st = scoring.vocab_stats(self.logits(f_BxLxD), targets_BxL)
      return st, st.target_logit

    def stats(hidden, weight, t, chunk=vocab_chunk):
      if chunk:  # equal chunks of at most `chunk`: a 20,002-row head is not padded to 32,768
        v = weight.shape[0]
        return scoring.chunked_vocab_stats(hidden, weight, t, chunk=-(-v // -(-v // chunk)))
      return scoring.vocab_stats(jnp.einsum("nd,vd->nv", hidden, weight, preferred_element_type=jnp.float32), t)

    cfg, lead = self.cfg, targets_BxL.shape
    drop = dict(deterministic=deterministic, rngs=rngs)
    f = self.adaptive_softmax.dropout(f_BxLxD.reshape(-1, f_BxLxD.shape[-1]), **drop)  # fairseq: on the input
    t = targets_BxL.reshape(-1)
    band, c1 = self._band(t), cfg.band_edges[1]
    head_t = jnp.where(band == 0, t, c1 + band - 1)  # fairseq adapt_target: tail words -> their cluster token
    head = stats(f, self._head_weight(f.dtype), head_t)
    target = trime_target = head.target_logit
    for i in range(len(cfg.adaptive_cutoffs)):
      lo, hi = cfg.band_edges[i + 1], cfg.band_edges[i + 2]
      term = self._tail_term(f, t, band == i + 1, i, lambda h, out, t_tail, chunk, lo=lo, hi=hi: stats(
          h, out, jnp.clip(t_tail - lo, 0, hi - lo - 1), chunk), vocab_chunk, deterministic, rngs)
      target = target + term
      # fairseq's padding_idx is 1: F.cross_entropy(..., ignore_index=1) drops the tail word at relative index 1
      trime_target = trime_target + jnp.where(t - lo == FAIRSEQ_PADDING_IDX, 0.0, term)
    crit = trime_target if cfg.adaptive_tail_ignores_pad else target
    return scoring.VocabStats(head.log_normalizer.reshape(lead), target.reshape(lead)), crit.reshape(lead)

  def __call__(self, tokens_BxL, *, deterministic: bool = True, rngs=None):
    f, g = self.features(tokens_BxL, deterministic=deterministic, rngs=rngs)
    return self.logits(f), g


count_params = layers.count_params


def abstract_param_count(cfg) -> int:
  """Parameter count from shapes only (`nnx.eval_shape`: nothing is allocated); any backbone's config."""
  abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
  return count_params(nnx.state(abstract, nnx.Param))


# ----------------------------------------------------------------------------------------------------------
# The backbone interface. Training, evaluation and the datastore ask a model only for
#   features(tokens) -> (f [B, L, D], g [B, L, D])       f: input of the output layer, g: TRIME memory keys
#   logits(f), vocab_stats(f, targets, ...), output_embedding() (full softmax), cfg (.d_model, .max_len, .dtype,
#   .vocab_size, .key_type) and `stateful`.
# A stateful backbone (SRU++) also has init_carry(batch, mem_len), reset_carry(carry, reset_B) and
#   features_carry(tokens, carry) -> (f, g, new_carry): the state one segment hands to the next of its stream.
# ----------------------------------------------------------------------------------------------------------
BACKBONES = ("transformer", "srupp")


def build_model(cfg, rngs: nnx.Rngs | None = None):
  """The model of `cfg`, a backbone config dataclass (ModelConfig, SRUppConfig; from a config:
  `specs.model_config`)."""
  if not dataclasses.is_dataclass(cfg):
    raise TypeError(f"build_model takes a backbone config (specs.model_config(config, vocab_size)), got "
                    f"{type(cfg).__name__}")
  rngs = rngs if rngs is not None else nnx.Rngs(0)
  if isinstance(cfg, ModelConfig):
    return TransformerLM(cfg, rngs=rngs)
  from trime_jax.srupp import SRUppConfig, SRUppLM

  if isinstance(cfg, SRUppConfig):
    return SRUppLM(cfg, rngs=rngs)
  raise TypeError(f"no backbone for {type(cfg).__name__}")
