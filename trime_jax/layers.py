"""Layers shared by the language model (`model.TransformerLM`) and the translation model (`mt.model.TransformerMT`),
as MaxText keeps layers apart from models: initialisers, the Xavier linear layer, fairseq's sinusoidal positions,
multi-head attention's core (scaled dot product, a causal or boolean mask, attention-probability dropout), the
ReLU feed-forward, and the parameter count.

The models keep their own parameter names and tree layout (exports and fairseq imports depend on them: the LM's
fused `qkv`, the MT model's `q` / `kv`, the LM block's `fc1` / `fc2` vs the MT layer's `ffn.fc1`); they build
their modules through these helpers in the same order as before, so initial parameters (the RNG draws) and every
number they compute are unchanged.

Shapes in names: B batch, T queries, S keys, H heads, K head dim, D model dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from trime_jax import flash_attention


def xavier():
  """fairseq's Linear initialiser (Xavier uniform)."""
  return nnx.initializers.xavier_uniform()


def linear(d_in: int, d_out: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
  """A Xavier-initialised linear layer computing in `dtype` (its parameters stay float32)."""
  return nnx.Linear(d_in, d_out, kernel_init=xavier(), dtype=dtype, rngs=rngs)


def layer_norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)


# Where a model's keys are read: the input of the last layer's feed-forward (the paper's and kNN-LM's) or the
# final layer's output.
KEY_TYPES = ("last_ffn_input", "final")


def embedding_init(dim: int):
  """fairseq's embedding initialiser (normal, std dim^-1/2), for embeddings and untied output matrices."""
  return nnx.initializers.normal(dim**-0.5)


def sinusoidal_positions(length: int, dim: int):
  """fairseq's sinusoidal embedding: [sin | cos] halves, frequencies 10000^(-i/(half-1))."""
  half = dim // 2
  freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000.0) / max(half - 1, 1)))
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * freq[None, :]
  emb = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=1)
  if dim % 2:
    emb = jnp.pad(emb, ((0, 0), (0, 1)))
  return emb


# How causal self-attention runs (`model.attention_impl`): "xla" is jax's XLA path (the default, every backend);
# "cudnn" is cuDNN's fused flash-attention kernel for the calls without dropout (NVIDIA GPUs, bfloat16 / float16
# only); "pallas" is our flash kernel with attention dropout inside it (flash_attention.py: NVIDIA GPUs), for the
# training calls that have dropout, XLA's path for the others.
ATTENTION_IMPLS = ("xla", "cudnn", "pallas")
# How dropout draws its masks (`model.dropout_mask`, layers.Dropout): "nnx" is nnx.Dropout's (jax's random bits
# from the key: threefry by default), "hash" the flash kernels' counter hash (flash_attention.hash_keep_mask): a
# few integer operations per element that XLA fuses into the neighbouring elementwise work, no random-bit
# generator, and for attention probabilities the same masks as "pallas" draws. Both keep with chance 1 - rate and
# scale by 1 / (1 - rate); they differ in which draws, not in distribution.
DROPOUT_MASKS = ("nnx", "hash")


class Dropout(nnx.Dropout):
  """nnx.Dropout whose mask is drawn as `mask` says (DROPOUT_MASKS). The key comes from the same stream in the
  same order either way (`dropout_key`), so the two differ in the masks only; no parameters, the tree is
  nnx.Dropout's."""

  def __init__(self, rate: float, *, mask: str = "nnx", rngs=None):
    if mask not in DROPOUT_MASKS:
      raise ValueError(f"dropout mask must be one of {DROPOUT_MASKS}, got {mask!r}")
    super().__init__(rate, rngs=rngs)
    self.mask = mask  # static

  def __call__(self, inputs, *, deterministic: bool | None = None, rngs=None):
    deterministic = self.deterministic if deterministic is None else deterministic
    if self.mask == "nnx" or deterministic or not 0.0 < self.rate < 1.0:
      return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
    key = dropout_key(self, rngs)
    if key is None:
      raise ValueError("layers.Dropout needs a random key: pass `rngs` or give the module `rngs`")
    keep = flash_attention.hash_keep_mask(key, jnp.shape(inputs), self.rate)
    return lax.select(keep, inputs / (1.0 - self.rate), jnp.zeros_like(inputs))  # as nnx.Dropout scales


def dropout_key(dropout: nnx.Dropout, rngs):
  """The random key nnx.Dropout would draw for this call (the same stream: `rngs` or the module's own)."""
  stream = rngs if rngs is not None else dropout.rngs
  if isinstance(stream, nnx.Rngs):
    return stream[dropout.rng_collection]()
  if isinstance(stream, nnx.RngStream):
    return stream()
  return stream


def attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, dropout: nnx.Dropout, *, causal: bool = False, mask_BxTxS=None,
              deterministic: bool, rngs, implementation: str = "xla"):
  """softmax(q·kᵀ/√K + mask)·v per head: [B, T, H, K]. `causal` (T = S; a query sees keys up to its own
  position) or `mask_BxTxS` (True: visible; a query whose keys are all masked averages them uniformly instead of
  NaN). Without dropout it is jax's fused `dot_product_attention`; attention-probability dropout needs the
  explicit weights (masked logits -inf for causal, the float32 minimum for a mask, as each model had).

  `implementation` (ATTENTION_IMPLS) picks the kernel of the causal path: "cudnn" without dropout only (cuDNN's
  kernel draws its dropout mask from its own generator with a compile-time seed, not our key), "pallas" with
  dropout only (its mask is a hash of a seed drawn from `rngs`, so another random stream than nnx.Dropout's); a
  boolean mask stays on XLA's path. XLA's path draws `dropout`'s own masks (layers.Dropout with mask "hash": the
  ones "pallas" draws); "pallas" always draws the hash masks."""
  if implementation not in ATTENTION_IMPLS:
    raise ValueError(f"attention implementation must be one of {ATTENTION_IMPLS}, got {implementation!r}")
  dropping = not deterministic and dropout.rate > 0.0
  if implementation == "pallas" and causal and dropping:
    return flash_attention.causal_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, rate=dropout.rate,
                                            key=dropout_key(dropout, rngs),
                                            interpret=jax.default_backend() != "gpu")  # CPU: the tests only
  if not dropping:
    if causal:
      # "xla" (and "pallas", without dropout) pass None, jax's default (its XLA path): the same program as before.
      impl = "cudnn" if implementation == "cudnn" else None
      return jax.nn.dot_product_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, is_causal=True, implementation=impl)
    return jax.nn.dot_product_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, mask=mask_BxTxS[:, None])
  head = q_BxTxHxK.shape[-1]
  logits = jnp.einsum("bthd,bshd->bhts", q_BxTxHxK, k_BxSxHxK, preferred_element_type=jnp.float32) / math.sqrt(head)
  if causal:
    t, s = logits.shape[-2:]
    logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -jnp.inf)
  else:
    logits = jnp.where(mask_BxTxS[:, None], logits, jnp.finfo(jnp.float32).min)
  probs = dropout(jax.nn.softmax(logits, axis=-1).astype(v_BxSxHxK.dtype), deterministic=False, rngs=rngs)
  return jnp.einsum("bhts,bshd->bthd", probs, v_BxSxHxK)


def feed_forward(x, fc1: nnx.Linear, fc2: nnx.Linear, act_dropout: nnx.Dropout, *, deterministic: bool, rngs):
  """fc2(Drop(ReLU(fc1(x)))): the Transformer's position-wise feed-forward."""
  return fc2(act_dropout(jax.nn.relu(fc1(x)), deterministic=deterministic, rngs=rngs))


def count_params(tree) -> int:
  """Number of scalars in a parameter tree."""
  return int(sum(x.size for x in jax.tree_util.tree_leaves(tree)))
