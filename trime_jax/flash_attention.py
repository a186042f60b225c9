"""Causal flash attention with attention-probability dropout, as Pallas (Triton) kernels: `model.attention_impl =
"pallas"` (issue 37).

Why it exists: every paper config trains with attention dropout 0.1, and neither jax's fused attention nor cuDNN's
(through jax) can take it (cuDNN draws its mask from a seed fixed at compile time), so training materialises the
[B, H, L, L] logits and probabilities: at the 247M model's L = 3,072 that is 8 × 3,072² × 4 B = 302 MB per
sequence and layer, written and read several times forward and backward. These kernels never hold more than a
[block_q, block_k] tile (FlashAttention-2's online softmax: Dao, 2023) and draw the dropout mask inside the tile.

The dropout mask is a function of (seed of the batch row and head, query position, key position): a counter-based
hash (one round of the lowbias32 integer finaliser over the position's counter, keyed by the seed), so the
backward pass recomputes exactly the mask of the forward pass, and `hash_keep_mask` (plain jax) reproduces it:
for the tests, and for every dropout of a model with `model.dropout_mask="hash"` (layers.Dropout), whose XLA
attention thereby draws the same masks as these kernels (the two implementations are interchangeable in a run).
It keeps a probability with chance 1 - rate (to 2⁻²⁴) and scales it by 1 / (1 - rate), as nnx.Dropout does, but
from another random stream than nnx.Dropout's (same distribution, other draws).

Off GPUs the kernels run in Pallas's interpreter (`interpret=True`): exact and slow, for the tests only; the model
refuses "pallas" on other backends (model.check_attention_backend).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

def _pallas():
  """jax's Pallas and its Triton dialect (Triton's dot: float32 accumulation), imported on first use: the
  experimental modules stay out of every model import, so a jax whose Pallas moved breaks this option only."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  return pl, plgpu


# Tile sizes (query rows x key columns) and Triton warps per tile. Powers of two, at least 16. Not yet tuned on a
# GPU: FlashAttention-2's Triton settings for head dimension 128 (forward 128 x 64, backward 64 x 64, 8 warps;
# 4 warps at head dimension 64 or less, or for tiles under 64 rows). TRIME_FLASH_TILES="q=128,k=64,bwd=64,warps=8"
# overrides them (for tuning on a GPU; read when the kernels are traced; warps=0 keeps the rule).
BLOCK_Q, BLOCK_K = 128, 64
BLOCK_BWD = 64  # the backward kernels' tiles (query rows = key columns)
WARPS = 0  # 0: 8 warps at head dimension > 64 with tiles of >= 64 rows, else 4


def tiles() -> dict:
  """{"q", "k", "bwd", "warps"}: the module's tiles, with TRIME_FLASH_TILES's overrides (checked: a ValueError
  naming the variable; train_config checks it before anything is compiled)."""
  out = {"q": BLOCK_Q, "k": BLOCK_K, "bwd": BLOCK_BWD, "warps": WARPS}
  spec = os.environ.get("TRIME_FLASH_TILES", "").strip()
  for item in filter(None, (x.strip() for x in spec.split(","))):
    name, _, value = item.partition("=")
    n = int(value) if value.isdigit() else -1
    ok = n >= 0 and not n & (n - 1) and (n <= 32 if name == "warps" else 16 <= n <= 256)
    if name not in out or not ok:
      raise ValueError(f"TRIME_FLASH_TILES={spec!r}: expected q=, k=, bwd= (powers of two from 16 to 256) and "
                       f"warps= (0, or a power of two up to 32), got {item!r}")
    out[name] = n
  return out


def unavailable() -> str | None:
  """Why this jax cannot build the kernels (None: it can): Pallas's Triton backend, deprecated in jax 0.11 in
  favour of Mosaic GPU, may be gone from a later jax."""
  try:
    _pallas()
  except ImportError as e:
    return f"this jax ({jax.__version__}) has no Pallas Triton backend ({e})"
  return None
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: a fully masked tile gives 0, not NaN
_LOG2E = math.log2(math.e)
_KEEP_BITS = 24  # the hash's top 24 bits against the rate: keep probability exact to 2^-24


def _int32(c: int):
  """A uint32 constant as the int32 with the same bits (the hash runs in int32: wrap-around multiply, logical
  shifts; the same function as on uint32)."""
  return np.array(c, np.uint32).view(np.int32)


def _mix32(x):
  """lowbias32 (C. Wellons): a bijection of 32-bit words with good avalanche, on int32 bits."""
  x = x ^ lax.shift_right_logical(x, jnp.int32(16))
  x = x * _int32(0x21F0AAAD)
  x = x ^ lax.shift_right_logical(x, jnp.int32(15))
  x = x * _int32(0x735A2D97)
  return x ^ lax.shift_right_logical(x, jnp.int32(15))


def _keep(seed, rows, cols, seq_len: int, rate: float):
  """[len(rows), len(cols)] bool: which attention probabilities survive dropout, for one (batch row, head);
  `seq_len` is the row stride of the counter (the number of keys)."""
  counter = rows[:, None] * jnp.int32(seq_len) + cols[None, :]  # distinct for seq_len < 65,536
  bits = _mix32((counter * _int32(0x9E3779B1)) ^ seed)  # the odd multiply spreads neighbours before the seed
  threshold = int(round(rate * (1 << _KEEP_BITS)))
  return lax.shift_right_logical(bits, jnp.int32(32 - _KEEP_BITS)) >= jnp.int32(threshold)


def dropout_keep_mask(seeds_BxH, seq_len: int, rate: float, num_keys: int | None = None):
  """[B, H, T, S] bool: the kernels' dropout mask in plain jax, T = seq_len queries by S = num_keys keys (default
  T), for the tests' references. T · S must stay below 2³² (distinct counters)."""
  num_keys = seq_len if num_keys is None else num_keys
  if seq_len * num_keys > 2**32:
    raise ValueError(f"the hash dropout mask needs at most 2^32 elements in its last two dimensions, got "
                     f"{seq_len} x {num_keys}")
  rows, cols = jnp.arange(seq_len, dtype=jnp.int32), jnp.arange(num_keys, dtype=jnp.int32)
  return _keep(jnp.asarray(seeds_BxH)[..., None, None], rows, cols, num_keys, rate)


def hash_keep_mask(key, shape, rate: float):
  """bool `shape`: the hash dropout mask of any array (`model.dropout_mask="hash"`, layers.Dropout): a seed per
  index of the leading dimensions (drawn from `key`), a counter over the last two. For attention probabilities
  [B, H, T, S] that is exactly the kernels' mask (a seed per batch row and head, the counter query · S + key), so
  XLA's path and "pallas" drop the same probabilities; a 1-D array counts as one row."""
  shape = tuple(shape)
  if len(shape) < 2:
    return hash_keep_mask(key, (1,) + shape, rate).reshape(shape)
  return dropout_keep_mask(head_seeds(key, *shape[:-2]), shape[-2], rate, num_keys=shape[-1])


def head_seeds(key, *lead: int):
  """int32 `lead` ([B, H] for the kernels): an independent seed per index, from a jax random key."""
  return lax.bitcast_convert_type(jax.random.bits(key, lead, jnp.uint32), jnp.int32)


def shape_problem(seq_len: int, head_dim: int) -> str | None:
  """Why the kernels cannot take this shape (None: they can): Triton tiles are powers of two of at least 16."""
  if head_dim < 16 or head_dim & (head_dim - 1):
    return f"a head dimension that is a power of two of at least 16 (d_model / num_heads = {head_dim})"
  if seq_len % 16 or seq_len >= 65536:
    return f"a sequence length that is a multiple of 16 and below 65,536 (got {seq_len})"
  return None


def _block(seq_len: int, want: int) -> int:
  """The largest power of two <= `want` dividing `seq_len` (a multiple of 16): Triton's tiles are powers of two."""
  b = 1 << (min(want, seq_len).bit_length() - 1)
  while seq_len % b:
    b //= 2
  return b


def _scores(q, k, q0, k0, scale: float):
  """Base-2 logits of a [bq, K] x [bk, K] tile, causally masked, and the tile's row / column positions."""
  _, plgpu = _pallas()
  s = plgpu.dot(q, k, trans_b=True) * (scale * _LOG2E)
  rows = q0 + jnp.arange(q.shape[0], dtype=jnp.int32)
  cols = k0 + jnp.arange(k.shape[0], dtype=jnp.int32)
  return jnp.where(rows[:, None] >= cols[None, :], s, _MASK_VALUE), rows, cols


def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, rate, block_k, seq_len):
  pl, plgpu = _pallas()
  bq, head_dim = q_ref.shape
  i = pl.program_id(0)
  q = q_ref[...]
  seed = seed_ref[...]

  def body(j, carry):
    acc, m, l = carry
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s, rows, cols = _scores(q, k, i * bq, j * block_k, scale)
    m_next = jnp.maximum(m, s.max(axis=-1))
    correction = jnp.exp2(m - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l = correction * l + p.sum(axis=-1)  # the softmax's normaliser: every probability, dropped or not
    if rate > 0.0:
      p = jnp.where(_keep(seed, rows, cols, seq_len, rate), p * (1.0 / (1.0 - rate)), 0.0)
    acc = correction[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_next, l

  init = (jnp.zeros((bq, head_dim), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  blocks = lax.div((i + 1) * bq + block_k - 1, block_k)  # causal: key tiles up to the diagonal
  acc, m, l = lax.fori_loop(0, blocks, body, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def _dkdv_kernel(seed_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, rate,
                 block_q, seq_len):
  pl, plgpu = _pallas()
  bk, head_dim = k_ref.shape
  j = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  seed = seed_ref[...]

  def body(i, carry):
    dk, dv = carry
    rows = pl.ds(i * block_q, block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    s, r, c = _scores(q, k, i * block_q, j * bk, scale)
    p = jnp.exp2(s - lse_ref[rows][:, None])  # the softmax probabilities
    dp = plgpu.dot(do, v, trans_b=True)  # d(dropped probabilities)
    if rate > 0.0:
      z = jnp.where(_keep(seed, r, c, seq_len, rate), 1.0 / (1.0 - rate), 0.0)
      pd, dp = p * z, dp * z
    else:
      pd = p
    dv = dv + plgpu.dot(pd.astype(do.dtype), do, trans_a=True)
    ds = p * (dp - delta_ref[rows][:, None]) * scale
    dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  zeros = jnp.zeros((bk, head_dim), jnp.float32)
  first = lax.div(j * bk, block_q)  # causal: query tiles from the diagonal on
  dk, dv = lax.fori_loop(first, seq_len // block_q, body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(seed_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, rate, block_k, seq_len):
  pl, plgpu = _pallas()
  bq, head_dim = q_ref.shape
  i = pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  seed = seed_ref[...]

  def body(j, dq):
    cols = pl.ds(j * block_k, block_k)
    k, v = k_ref[cols, :], v_ref[cols, :]
    s, r, c = _scores(q, k, i * bq, j * block_k, scale)
    p = jnp.exp2(s - lse[:, None])
    dp = plgpu.dot(do, v, trans_b=True)
    if rate > 0.0:
      dp = jnp.where(_keep(seed, r, c, seq_len, rate), dp * (1.0 / (1.0 - rate)), 0.0)
    ds = p * (dp - delta[:, None]) * scale
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  blocks = lax.div((i + 1) * bq + block_k - 1, block_k)
  dq = lax.fori_loop(0, blocks, body, jnp.zeros((bq, head_dim), jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _compiler_params(interpret: bool, head_dim: int, tile: int, warps: int):
  """Triton's settings: `warps` if set, else 8 for tiles of at least 64 rows at head dimension > 64, else 4
  (16-row tiles of a 48-token sequence do not need 8)."""
  _, plgpu = _pallas()
  if interpret:
    return None
  return plgpu.CompilerParams(num_warps=warps or (8 if head_dim > 64 and tile >= 64 else 4), num_stages=2)


def _specs(seq_len, head_dim, block, grid_order):
  """BlockSpecs over [B, T, H, K] arrays: a tile of `block` rows of one (batch row, head), or the whole sequence
  (block None), for the grid order "qbh" (tile, batch, head) or "bht" (batch, head, tile)."""
  pl, _ = _pallas()
  if grid_order == "qbh":
    tile = lambda t, b, h: (b, t, h, 0)
    whole = lambda t, b, h: (b, 0, h, 0)
    seed = pl.BlockSpec((None, None), lambda t, b, h: (b, h))
  else:
    tile = lambda b, h, t: (b, t, h, 0)
    whole = lambda b, h, t: (b, 0, h, 0)
    seed = pl.BlockSpec((None, None), lambda b, h, t: (b, h))
  return (pl.BlockSpec((None, block, None, head_dim), tile), pl.BlockSpec((None, seq_len, None, head_dim), whole),
          seed)


def _forward(q, k, v, seeds, rate, interpret):
  pl, _ = _pallas()
  batch, seq_len, heads, head_dim = q.shape
  tile_sizes = tiles()
  bq, bk = _block(seq_len, tile_sizes["q"]), _block(seq_len, tile_sizes["k"])
  tile, whole, seed = _specs(seq_len, head_dim, bq, "qbh")
  kernel = functools.partial(_forward_kernel, scale=1.0 / math.sqrt(head_dim), rate=rate, block_k=bk,
                             seq_len=seq_len)
  return pl.pallas_call(
      kernel, grid=(seq_len // bq, batch, heads),
      in_specs=[seed, tile, whole, whole],
      out_specs=[tile, pl.BlockSpec((None, None, bq), lambda t, b, h: (b, h, t))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, seq_len), jnp.float32)],
      compiler_params=_compiler_params(interpret, head_dim, max(bq, bk), tile_sizes["warps"]), interpret=interpret,
      name="trime_flash_forward",
  )(seeds, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, seeds, rate, interpret):
  return _forward(q, k, v, seeds, rate, interpret)[0]


def _flash_fwd(q, k, v, seeds, rate, interpret):
  o, lse = _forward(q, k, v, seeds, rate, interpret)
  return o, (q, k, v, seeds, o, lse)


def _flash_bwd(rate, interpret, residuals, do):
  pl, _ = _pallas()
  q, k, v, seeds, o, lse = residuals
  batch, seq_len, heads, head_dim = q.shape
  scale = 1.0 / math.sqrt(head_dim)
  # rowsum(dO ∘ O) = rowsum(dP ∘ P) of the softmax's backward, dropout included (O = (P ∘ Z) V).
  delta = jnp.einsum("bthk,bthk->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  tile_sizes = tiles()
  b = _block(seq_len, tile_sizes["bwd"])
  tile, whole, seed = _specs(seq_len, head_dim, b, "bht")
  row = pl.BlockSpec((None, None, seq_len), lambda bi, h, t: (bi, h, 0))
  args = (seeds, q, k, v, do, lse, delta)
  params = _compiler_params(interpret, head_dim, b, tile_sizes["warps"])
  common = dict(grid=(batch, heads, seq_len // b), compiler_params=params, interpret=interpret)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, scale=scale, rate=rate, block_q=b, seq_len=seq_len),
      in_specs=[seed, whole, tile, tile, whole, row, row], out_specs=[tile, tile],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      name="trime_flash_dkdv", **common)(*args)
  tile_row = pl.BlockSpec((None, None, b), lambda bi, h, t: (bi, h, t))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, rate=rate, block_k=b, seq_len=seq_len),
      in_specs=[seed, tile, whole, whole, tile, tile_row, tile_row], out_specs=tile,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), name="trime_flash_dq", **common)(*args)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def causal_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, *, rate: float, key=None, interpret: bool = False):
  """softmax(q·kᵀ/√K, causal) with dropout of rate `rate` on the probabilities (key: a jax random key, needed
  when rate > 0), then ·v: [B, T, H, K], differentiable in q, k, v."""
  batch, seq_len, heads, head_dim = q_BxTxHxK.shape
  problem = shape_problem(seq_len, head_dim)
  if problem:
    raise ValueError(f"the Pallas flash attention needs {problem}")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"attention dropout rate must be in [0, 1), got {rate}")
  if rate > 0.0 and key is None:
    raise ValueError("attention dropout needs a random key")
  seeds = head_seeds(key, batch, heads) if rate > 0.0 else jnp.zeros((batch, heads), jnp.int32)
  return _flash(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, seeds, float(rate), bool(interpret))


def reference_attention(q, k, v, keep_BxHxTxT, rate: float):
  """The same function materialised (logits, softmax, mask, matmul) in float32: what the kernels must equal."""
  f = lambda x: x.astype(jnp.float32)
  logits = jnp.einsum("bthd,bshd->bhts", f(q), f(k)) / math.sqrt(q.shape[-1])
  t = q.shape[1]
  logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if rate > 0.0:
    probs = jnp.where(keep_BxHxTxT, probs / (1.0 - rate), 0.0)
  return jnp.einsum("bhts,bshd->bthd", probs, f(v))
