"""An encoder–decoder Transformer for translation in Flax NNX (fairseq's `transformer`, `transformer_iwslt_de_en`).

    encoder: x = √D · E_src[src] + P[2 + i];  6 layers of self-attention (source padding keys masked) + FFN
    decoder: y = √D · E_tgt[prev] + P[2 + t];  6 layers of causal self-attention, cross-attention over the
             encoder output (source padding keys masked), FFN
    f = decoder output (after the final LayerNorm of a pre-norm decoder);  logits = f · E_tgtᵀ (shared)
    g = the input of the last decoder layer's FFN (`key_type="last_ffn_input"`, as `TransformerLM`'s g), or f
        (`key_type="final"`: the original TrimeMT code's `knn_embed`, the decoder output)

fairseq conventions kept: sinusoidal positions numbered from padding_idx + 1 = 2 (`position_offset`), embeddings
N(0, D^-1/2) scaled by √D, Xavier-uniform linear layers, no final LayerNorm on a post-norm side (fairseq adds it
only with `--encoder/decoder-normalize-before`). `transformer_iwslt_de_en` is post-norm on both sides by default;
the original TrimeMT run adds `--decoder-normalize-before` (configs/iwslt_de_en.py). Padding (`pad_id`) is
masked as attention keys everywhere; outputs at padded positions are computed but meaningless (targets there are
-1, so they are never scored and never memory).

Shapes in names: B batch, S source length, T target length, D model dim, V vocabulary, H heads.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from trime_jax import scoring
from trime_jax import layers
from trime_jax.layers import sinusoidal_positions

KEY_TYPES = layers.KEY_TYPES


@dataclasses.dataclass(frozen=True)
class MTConfig:
  """Shapes and regularisation of `TransformerMT` (mirrors `config.model`)."""

  vocab_size: int
  d_model: int = 512
  num_heads: int = 4
  d_ff: int = 1024
  encoder_layers: int = 6
  decoder_layers: int = 6
  dropout: float = 0.3
  max_len: int = 1024
  pad_id: int = 0
  share_decoder_embeddings: bool = True  # fairseq --share-decoder-input-output-embed
  share_all_embeddings: bool = False  # fairseq --share-all-embeddings (one joint vocabulary for both sides)
  attention_dropout: float = 0.0
  activation_dropout: float = 0.0
  encoder_normalize_before: bool = False  # pre-norm encoder (+ final LayerNorm)
  decoder_normalize_before: bool = False  # pre-norm decoder (+ final LayerNorm); the original TrimeMT: True
  position_offset: int = 2  # fairseq numbers tokens from padding_idx + 1 = 2
  # The decoder's vocabulary (its input embedding and its softmax): ids [0, tgt_vocab_size) of the vocabulary,
  # the target side's tokens first (data.dictionaries="separate": fairseq's dictionary per side); 0: all of it
  tgt_vocab_size: int = 0
  key_type: str = "last_ffn_input"
  dtype: str = "float32"  # compute dtype; parameters stay float32

  def __post_init__(self):
    if self.key_type not in KEY_TYPES:
      raise ValueError(f"model.key_type must be one of {KEY_TYPES}, got {self.key_type!r}")
    if self.d_model % self.num_heads:
      raise ValueError(f"model.d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
    if self.vocab_size < 4:
      raise ValueError(f"model.vocab_size must be at least 4 (pad, unk, bos, eos), got {self.vocab_size}")
    if self.encoder_layers < 1 or self.decoder_layers < 1:
      raise ValueError("model.encoder_layers and model.decoder_layers must be >= 1")
    if not 0 <= self.pad_id < self.vocab_size:
      raise ValueError(f"model.pad_id={self.pad_id} outside the vocabulary")
    if not (self.tgt_vocab_size == 0 or 4 <= self.tgt_vocab_size <= self.vocab_size):
      raise ValueError(f"model.tgt_vocab_size={self.tgt_vocab_size} must be 0 or in [4, {self.vocab_size}]")
    if self.tgt_vocab_size and self.tgt_vocab_size != self.vocab_size and self.share_all_embeddings:
      raise ValueError("share_all_embeddings needs one vocabulary for both sides (tgt_vocab_size 0)")

  @property
  def target_vocab_size(self) -> int:
    """The decoder's vocabulary size: its softmax's width."""
    return self.tgt_vocab_size or self.vocab_size


def _embedding(cfg: MTConfig, rngs, size: int | None = None):
  """fairseq Embedding: N(0, D^-1/2) with the padding row zeroed."""
  d = cfg.d_model
  e = nnx.Embed(size or cfg.vocab_size, d, embedding_init=layers.embedding_init(d), rngs=rngs)
  e.embedding[...] = e.embedding[...].at[cfg.pad_id].set(0.0)
  return e


class Attention(nnx.Module):
  """Multi-head attention of queries `x` over keys/values `kv` under a boolean mask `[B, T, S]`."""

  def __init__(self, cfg: MTConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.num_heads = cfg.num_heads
    dtype = jnp.dtype(cfg.dtype)
    self.q = layers.linear(d, d, dtype, rngs)
    self.kv = layers.linear(d, 2 * d, dtype, rngs)  # keys and values of one side (cached by decoding)
    self.out = layers.linear(d, d, dtype, rngs)
    self.attn_dropout = nnx.Dropout(cfg.attention_dropout)

  def project_kv(self, kv_BxSxD):
    """(k, v) `[B, S, H, D/H]` of the keys/values side (cached by incremental decoding)."""
    b, s, d = kv_BxSxD.shape
    kv = self.kv(kv_BxSxD).reshape(b, s, 2, self.num_heads, d // self.num_heads)
    return kv[:, :, 0], kv[:, :, 1]

  def __call__(self, x_BxTxD, kv_BxSxD, mask_BxTxS, *, deterministic: bool, rngs):
    k, v = self.project_kv(kv_BxSxD)
    return self.attend(x_BxTxD, k, v, mask_BxTxS, deterministic=deterministic, rngs=rngs)

  def attend(self, x_BxTxD, k_BxSxHxK, v_BxSxHxK, mask_BxTxS, *, deterministic: bool = True, rngs=None):
    b, t, d = x_BxTxD.shape
    h = self.num_heads
    q = self.q(x_BxTxD).reshape(b, t, h, d // h)
    # A query whose keys are all masked (a batch-padding row) gets a uniform average, not NaN.
    y = layers.attention(q, k_BxSxHxK, v_BxSxHxK, self.attn_dropout, mask_BxTxS=mask_BxTxS, deterministic=deterministic,
                         rngs=rngs)
    return self.out(y.reshape(b, t, d))


class FeedForward(nnx.Module):
  def __init__(self, cfg: MTConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.fc1 = layers.linear(cfg.d_model, cfg.d_ff, dtype, rngs)
    self.fc2 = layers.linear(cfg.d_ff, cfg.d_model, dtype, rngs)
    self.act_dropout = nnx.Dropout(cfg.activation_dropout)

  def __call__(self, x, *, deterministic: bool, rngs):
    return layers.feed_forward(x, self.fc1, self.fc2, self.act_dropout, deterministic=deterministic, rngs=rngs)


def _sublayer(x, fn, norm, dropout, pre_norm: bool, drop):
  """fairseq's residual sublayer: pre-norm x + Drop(fn(LN(x))); post-norm LN(x + Drop(fn(x)))."""
  if pre_norm:
    return x + dropout(fn(norm(x)), **drop)
  return norm(x + dropout(fn(x), **drop))


class EncoderLayer(nnx.Module):
  def __init__(self, cfg: MTConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.pre_norm = cfg.encoder_normalize_before
    self.self_attn = Attention(cfg, rngs=rngs)
    self.self_attn_norm = layers.layer_norm(d, rngs)
    self.ffn = FeedForward(cfg, rngs=rngs)
    self.ffn_norm = layers.layer_norm(d, rngs)
    self.dropout = nnx.Dropout(cfg.dropout)

  def __call__(self, x, mask_BxSxS, *, deterministic: bool, rngs):
    drop = dict(deterministic=deterministic, rngs=rngs)
    attn = lambda h: self.self_attn(h, h, mask_BxSxS, **drop)
    x = _sublayer(x, attn, self.self_attn_norm, self.dropout, self.pre_norm, drop)
    return _sublayer(x, lambda h: self.ffn(h, **drop), self.ffn_norm, self.dropout, self.pre_norm, drop)


class DecoderLayer(nnx.Module):
  """Returns (output, FFN input): the FFN input of the last layer is the TRIME key g."""

  def __init__(self, cfg: MTConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.pre_norm = cfg.decoder_normalize_before
    self.self_attn = Attention(cfg, rngs=rngs)
    self.self_attn_norm = layers.layer_norm(d, rngs)
    self.cross_attn = Attention(cfg, rngs=rngs)
    self.cross_attn_norm = layers.layer_norm(d, rngs)
    self.ffn = FeedForward(cfg, rngs=rngs)
    self.ffn_norm = layers.layer_norm(d, rngs)
    self.dropout = nnx.Dropout(cfg.dropout)

  def __call__(self, y, enc_BxSxD, self_mask_BxTxT, cross_mask_BxTxS, *, deterministic: bool, rngs):
    drop = dict(deterministic=deterministic, rngs=rngs)
    return self._forward(y, lambda h: self.self_attn(h, h, self_mask_BxTxT, **drop),
                         lambda h: self.cross_attn(h, enc_BxSxD, cross_mask_BxTxS, **drop), drop)

  def step(self, y_Nx1xD, self_kv, cross_kv, step, cross_mask_Nx1xS):
    """One decoding position, deterministic: (output, FFN input, self_kv with this position's key/value
    written at `step`). self_kv: (k, v) `[N, T, H, D/H]` of positions < step (later ones are ignored);
    cross_kv: `cross_attn.project_kv(enc)`."""
    cache = {}

    def self_attn(h):
      k1, v1 = self.self_attn.project_kv(h)
      at = (0, step, 0, 0)
      k = jax.lax.dynamic_update_slice(self_kv[0], k1.astype(self_kv[0].dtype), at)
      v = jax.lax.dynamic_update_slice(self_kv[1], v1.astype(self_kv[1].dtype), at)
      cache["kv"] = (k, v)
      n, t = k.shape[:2]
      mask = jnp.broadcast_to((jnp.arange(t) <= step)[None, None, :], (n, 1, t))
      return self.self_attn.attend(h, k, v, mask)

    cross_attn = lambda h: self.cross_attn.attend(h, cross_kv[0], cross_kv[1], cross_mask_Nx1xS)
    out, ffn_in = self._forward(y_Nx1xD, self_attn, cross_attn, dict(deterministic=True, rngs=None))
    return out, ffn_in, cache["kv"]

  def _forward(self, y, self_attn, cross_attn, drop):
    pre = self.pre_norm
    y = _sublayer(y, self_attn, self.self_attn_norm, self.dropout, pre, drop)
    y = _sublayer(y, cross_attn, self.cross_attn_norm, self.dropout, pre, drop)
    ffn_in = self.ffn_norm(y) if pre else y  # what fc1 reads (post-norm: the cross-attention LayerNorm's output)
    out = y + self.dropout(self.ffn(ffn_in, **drop), **drop)
    return (out if pre else self.ffn_norm(out)), ffn_in


class TransformerMT(nnx.Module):
  """`encode(src) -> enc`; `decode(enc, src, prev) -> (f, g)`; `logits(f)`; `vocab_stats(f, targets)`."""

  def __init__(self, cfg: MTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.d_model
    self.tgt_embed = _embedding(cfg, rngs, cfg.target_vocab_size)
    self.src_embed = None if cfg.share_all_embeddings else _embedding(cfg, rngs)
    self.embed_dropout = nnx.Dropout(cfg.dropout)
    self.encoder = nnx.List([EncoderLayer(cfg, rngs=rngs) for _ in range(cfg.encoder_layers)])
    self.decoder = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.decoder_layers)])
    ln = lambda on: layers.layer_norm(d, rngs) if on else None
    self.encoder_norm = ln(cfg.encoder_normalize_before)
    self.decoder_norm = ln(cfg.decoder_normalize_before)
    if not cfg.share_decoder_embeddings and not cfg.share_all_embeddings:
      self.output = nnx.Param(layers.embedding_init(d)(rngs.params(), (cfg.target_vocab_size, d)))

  def output_embedding(self):
    """The `[V, D]` output matrix (the decoder input embedding when shared)."""
    cfg = self.cfg
    if cfg.share_decoder_embeddings or cfg.share_all_embeddings:
      return self.tgt_embed.embedding[...]
    return self.output[...]

  def _embed(self, embed, tokens_BxL, deterministic, rngs, positions_BxL=None):
    cfg = self.cfg
    l = tokens_BxL.shape[1]
    if l > cfg.max_len:
      raise ValueError(f"sequence length {l} exceeds model.max_len={cfg.max_len}")
    off = cfg.position_offset
    table = sinusoidal_positions(l + off, cfg.d_model)
    pos = table[None, off:] if positions_BxL is None else table[positions_BxL + off]
    x = embed(tokens_BxL) * math.sqrt(cfg.d_model) + pos
    return self.embed_dropout(x.astype(jnp.dtype(cfg.dtype)), deterministic=deterministic, rngs=rngs)

  def encode(self, src_BxS, *, deterministic: bool = True, rngs=None, segments_BxS=None, positions_BxS=None):
    """Encoder output `[B, S, D]`; source padding (pad_id) is never attended to. Packed rows
    (`mt.data.pack`): `segments` (pair numbers, 0 = padding) keep attention within a pair, `positions` restart
    at each pair."""
    cfg = self.cfg
    keys_BxS = src_BxS != cfg.pad_id
    mask = jnp.broadcast_to(keys_BxS[:, None, :], src_BxS.shape + src_BxS.shape[1:])
    if segments_BxS is not None:
      mask = mask & (segments_BxS[:, :, None] == segments_BxS[:, None, :])
    embed = self.tgt_embed if self.src_embed is None else self.src_embed
    x = self._embed(embed, src_BxS, deterministic, rngs, positions_BxS)
    for layer in self.encoder:
      x = layer(x, mask, deterministic=deterministic, rngs=rngs)
    x = self.encoder_norm(x) if self.encoder_norm is not None else x
    return x.astype(jnp.dtype(cfg.dtype))

  def decode(self, enc_BxSxD, src_BxS, prev_BxT, *, deterministic: bool = True, rngs=None, src_segments_BxS=None,
             segments_BxT=None, positions_BxT=None):
    """(f `[B, T, D]`, g `[B, T, D]`) over the previous-output tokens `prev` ([eos] + y, right-padded).

    Causal: position t sees prev[:t + 1] only; padded prev positions are masked as keys, padded source
    positions as cross-attention keys. Packed rows: target `segments` see only their own pair's earlier target
    positions and its source positions (`src_segments`); `positions` restart at each pair."""
    cfg = self.cfg
    b, t = prev_BxT.shape
    causal = jnp.tril(jnp.ones((t, t), bool))[None] & (prev_BxT != cfg.pad_id)[:, None, :]
    cross_mask = jnp.broadcast_to((src_BxS != cfg.pad_id)[:, None, :], (b, t, src_BxS.shape[1]))
    if segments_BxT is not None:
      causal = causal & (segments_BxT[:, :, None] == segments_BxT[:, None, :])
      cross_mask = cross_mask & (segments_BxT[:, :, None] == src_segments_BxS[:, None, :])
    # A padded query row would see nothing (its own key is padding): let it see itself so nothing is NaN.
    self_mask = causal | jnp.eye(t, dtype=bool)[None]
    y = self._embed(self.tgt_embed, prev_BxT, deterministic, rngs, positions_BxT)
    ffn_in = y
    for layer in self.decoder:
      y, ffn_in = layer(y, enc_BxSxD, self_mask, cross_mask, deterministic=deterministic, rngs=rngs)
    return self._outputs(y, ffn_in)

  def _outputs(self, y, ffn_in):
    dtype = jnp.dtype(self.cfg.dtype)
    f = (self.decoder_norm(y) if self.decoder_norm is not None else y).astype(dtype)
    g = ffn_in.astype(dtype) if self.cfg.key_type == "last_ffn_input" else f
    return f, g

  # Incremental decoding (fairseq's incremental_state): each decoder layer caches its self-attention keys /
  # values of the positions decoded so far and its cross-attention keys / values of the encoder output; a step
  # runs the decoder over one position. Same values as `decode` over the whole prefix (tested).
  def init_decode_cache(self, enc_NxSxD, max_steps: int):
    """{"self": per layer (k, v) zeros `[N, max_steps, H, D/H]`, "cross": per layer (k, v) of the encoder
    output}."""
    n, h = enc_NxSxD.shape[0], self.cfg.num_heads
    zeros = jnp.zeros((n, max_steps, h, self.cfg.d_model // h), enc_NxSxD.dtype)
    return {"self": [(zeros, zeros) for _ in self.decoder],
            "cross": [layer.cross_attn.project_kv(enc_NxSxD) for layer in self.decoder]}

  def decode_step(self, cache, src_NxS, token_N, step):
    """(f `[N, D]`, g `[N, D]`, cache) of position `step` whose input token is `token_N` (deterministic);
    the cache holds positions < step. Positions are never padding during a search."""
    cfg = self.cfg
    off = cfg.position_offset
    t_max = cache["self"][0][0].shape[1]
    pos = jax.lax.dynamic_slice_in_dim(sinusoidal_positions(t_max + off, cfg.d_model), step + off, 1)
    y = (self.tgt_embed(token_N[:, None]) * math.sqrt(cfg.d_model) + pos[None]).astype(jnp.dtype(cfg.dtype))
    cross_mask = (src_NxS != cfg.pad_id)[:, None, :]
    ffn_in, new_self = y, []
    for layer, self_kv, cross_kv in zip(self.decoder, cache["self"], cache["cross"]):
      y, ffn_in, kv = layer.step(y, self_kv, cross_kv, step, cross_mask)
      new_self.append(kv)
    f, g = self._outputs(y, ffn_in)
    return f[:, 0], g[:, 0], {"self": new_self, "cross": cache["cross"]}

  def logits(self, f_xD):
    """Vocabulary logits `[..., V]` = f · Wᵀ (float32 accumulation)."""
    w = self.output_embedding().astype(f_xD.dtype)
    return jnp.einsum("...d,vd->...v", f_xD, w, preferred_element_type=jnp.float32)

  def vocab_stats(self, f, targets, *, vocab_chunk=0, deterministic=True, rngs=None) -> scoring.VocabStats:
    """log Σ_v exp(f·W_v) and f·W_target (chunked over the vocabulary when vocab_chunk > 0)."""
    del deterministic, rngs  # no dropout on the output layer
    if vocab_chunk:
      return scoring.chunked_vocab_stats(f, self.output_embedding().astype(f.dtype), targets, chunk=vocab_chunk)
    return scoring.vocab_stats(self.logits(f), targets)

  def __call__(self, src_BxS, prev_BxT, *, deterministic: bool = True, rngs=None):
    """(logits `[B, T, V]`, g `[B, T, D]`)."""
    enc = self.encode(src_BxS, deterministic=deterministic, rngs=rngs)
    f, g = self.decode(enc, src_BxS, prev_BxT, deterministic=deterministic, rngs=rngs)
    return self.logits(f), g


count_params = layers.count_params


def build_mt_model(cfg: MTConfig, seed: int) -> TransformerMT:
  """A fresh model of `cfg` (from a config: `specs.mt_model_config(config, vocab_size)`)."""
  return TransformerMT(cfg, rngs=nnx.Rngs(params=seed, dropout=seed + 1))

