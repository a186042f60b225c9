"""trime_jax.flash_attention (model.attention_impl="pallas"): the Pallas kernels, run here by Pallas's interpreter,
against the materialised attention with the same dropout mask (float32, forward and every gradient), the mask's
statistics, and the model's wiring. The kernels' speed is a GPU measurement (bench.mfu, docs/performance.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trime_jax import flash_attention as fa
from trime_jax import layers
from trime_jax import model as M
from trime_jax.errors import ConfigError
from trime_jax.train_config import validate_config
from tests.test_speed_options import step_result, tiny


@pytest.fixture(params=["q=16,k=32,bwd=16", "q=32,k=16,bwd=16"])
def small_tiles(monkeypatch, request):
  """Small tiles so that a 64-token sequence has several: the online softmax crosses tiles, the causal bounds
  skip some, the backward loops start at the diagonal; the forward's key tiles larger, then smaller, than its
  query tiles."""
  monkeypatch.setenv("TRIME_FLASH_TILES", request.param)


def _qkv(shape, seed=0):
  return [jax.random.normal(jax.random.PRNGKey(seed + i), shape, jnp.float32) for i in range(3)]


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("shape", [(2, 64, 2, 16), (1, 32, 3, 32), (1, 48, 1, 16)])  # 48: tiles of 16
def test_kernels_equal_the_materialised_attention(small_tiles, rate, shape):
  q, k, v = _qkv(shape)
  key = jax.random.PRNGKey(7)
  keep = fa.dropout_keep_mask(fa.head_seeds(key, shape[0], shape[2]), shape[1], rate)
  w = jax.random.normal(jax.random.PRNGKey(9), shape)  # a loss that weighs every output differently

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

  kernel = lambda q, k, v: fa.causal_attention(q, k, v, rate=rate, key=key, interpret=True)
  reference = lambda q, k, v: fa.reference_attention(q, k, v, keep, rate)
  np.testing.assert_allclose(kernel(q, k, v), reference(q, k, v), atol=2e-6, rtol=1e-5)
  got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for g, r, name in zip(got, want, "qkv"):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4, err_msg=f"d{name}")
  if rate == 0.0:  # no dropout: jax's own attention
    np.testing.assert_allclose(kernel(q, k, v), jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=2e-6)


def test_bad_tiles_are_one_error(monkeypatch):
  q, k, v = _qkv((1, 32, 2, 16))
  for bad in ("q=24", "q=8", "q=512", "x=16", "k=", "warps=3", "warps=64"):
    monkeypatch.setenv("TRIME_FLASH_TILES", bad)
    with pytest.raises(ValueError, match=r"^TRIME_FLASH_TILES="):
      fa.causal_attention(q, k, v, rate=0.1, key=jax.random.PRNGKey(0), interpret=True)


def test_the_dropout_key_is_the_one_nnx_dropout_draws():
  """layers.dropout_key takes what nnx.Dropout would take from the same stream (so the other dropout layers see
  the same keys whichever attention runs): the same key gives nnx.Dropout's mask, and one draw each."""
  x = jnp.ones((4, 64))
  drop = nnx.Dropout(0.5)
  want = drop(x, deterministic=False, rngs=nnx.Rngs(dropout=5))
  rngs = nnx.Rngs(dropout=5)
  key = layers.dropout_key(drop, rngs)
  np.testing.assert_array_equal(jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x / 0.5, 0.0), want)
  used = nnx.Rngs(dropout=5)
  drop(x, deterministic=False, rngs=used)
  assert int(rngs.dropout.count[...]) == int(used.dropout.count[...]) == 1
  # the module's own stream when the call passes none
  own_want = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=5))(x, deterministic=False)
  own_key = layers.dropout_key(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=5)), None)
  np.testing.assert_array_equal(jnp.where(jax.random.bernoulli(own_key, 0.5, x.shape), x / 0.5, 0.0), own_want)


def test_the_mask_is_a_fair_dropout_mask():
  rate, t = 0.1, 512
  seeds = fa.head_seeds(jax.random.PRNGKey(0), 2, 4)
  keep = np.asarray(fa.dropout_keep_mask(seeds, t, rate))  # [2, 4, 512, 512]: 2.1M draws
  n = keep.size
  assert abs(keep.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n), keep.mean()
  # per row and per column about as often (no position is favoured), and heads / rows unrelated
  assert abs(keep.mean(axis=(0, 1, 2)) - (1 - rate)).max() < 0.05
  assert abs(keep.mean(axis=(0, 1, 3)) - (1 - rate)).max() < 0.05
  flat = keep.reshape(8, -1).astype(np.float64)
  corr = np.corrcoef(flat)[~np.eye(8, dtype=bool)]
  assert abs(corr).max() < 0.01, corr  # 262k draws each: chance correlations are ~0.002
  neighbours = np.corrcoef(flat[0, :-1], flat[0, 1:])[0, 1]
  assert abs(neighbours) < 0.01, neighbours
  # the same seeds give the same mask (the backward pass relies on it), other seeds another one
  np.testing.assert_array_equal(keep, fa.dropout_keep_mask(seeds, t, rate))
  other = np.asarray(fa.dropout_keep_mask(fa.head_seeds(jax.random.PRNGKey(1), 2, 4), t, rate))
  assert (other != keep).mean() > 0.15  # two independent masks differ in 2·p·(1-p) = 18% of places


def test_shapes_the_kernels_refuse():
  q, k, v = _qkv((1, 24, 2, 16))
  with pytest.raises(ValueError, match="multiple of 16"):
    fa.causal_attention(q, k, v, rate=0.1, key=jax.random.PRNGKey(0), interpret=True)
  q, k, v = _qkv((1, 32, 2, 24))
  with pytest.raises(ValueError, match="power of two"):
    fa.causal_attention(q, k, v, rate=0.1, key=jax.random.PRNGKey(0), interpret=True)
  q, k, v = _qkv((1, 32, 2, 16))
  with pytest.raises(ValueError, match="random key"):
    fa.causal_attention(q, k, v, rate=0.1, interpret=True)


def test_the_model_calls_the_kernel_in_training_with_dropout_only(monkeypatch, small_tiles):
  """"pallas": the kernel for the training calls with attention dropout (at the config's rate, with a key of the
  dropout stream), XLA's path for evaluation; and a training forward and backward through the kernels equal the
  materialised attention with the kernels' own mask."""
  calls = []
  real = fa.causal_attention

  def spy(q, k, v, *, rate, key, interpret):
    calls.append((rate, jnp.shape(key), interpret))
    return real(q, k, v, rate=rate, key=key, interpret=interpret)

  monkeypatch.setattr(fa, "causal_attention", spy)
  monkeypatch.setattr(M, "_cudnn_backend", lambda: True)  # the backend check; the kernels run interpreted here
  cfg = dict(vocab_size=20, num_layers=2, d_model=32, num_heads=2, d_ff=32, max_len=32, attention_dropout=0.1,
             dropout=0.0, activation_dropout=0.0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 20, (2, 32)), jnp.int32)
  pallas = M.build_model(M.ModelConfig(**cfg, attention_impl="pallas"), rngs=nnx.Rngs(params=0))
  xla = M.build_model(M.ModelConfig(**cfg), rngs=nnx.Rngs(params=0))
  f_eval, _ = pallas.features(tokens)
  assert calls == []  # evaluation: XLA's path, the same numbers as "xla"
  np.testing.assert_array_equal(f_eval, xla.features(tokens)[0])
  stream = nnx.Rngs(dropout=3)
  f_train, _ = pallas.features(tokens, deterministic=False, rngs=stream)
  assert [c[0] for c in calls] == [0.1, 0.1] and all(c[2] for c in calls)  # one per layer, interpreted on CPU
  xla_stream = nnx.Rngs(dropout=3)
  xla.features(tokens, deterministic=False, rngs=xla_stream)
  assert int(stream.dropout.count[...]) == int(xla_stream.dropout.count[...]) == 2  # a key per layer, as XLA's
  assert np.isfinite(np.asarray(f_train)).all()
  assert not np.allclose(f_train, f_eval)  # dropout acted
  again, _ = pallas.features(tokens, deterministic=False, rngs=nnx.Rngs(dropout=3))
  np.testing.assert_array_equal(again, f_train)  # the same dropout stream, the same masks

  # The kernel inside the model equals XLA's materialised attention with the kernel's masks (same key per layer).
  hashed = M.build_model(M.ModelConfig(**cfg, dropout_mask="hash"), rngs=nnx.Rngs(params=0))
  want, _ = hashed.features(tokens, deterministic=False, rngs=nnx.Rngs(dropout=3))
  np.testing.assert_allclose(f_train, want, atol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_xla_with_the_hash_mask_draws_the_kernels_masks(causal):
  """model.dropout_mask="hash": XLA's attention drops exactly the probabilities the kernels drop (the same key
  from the dropout stream, the same seeds and counters), in the causal path and with a boolean mask of T queries
  by S keys (T != S: the counter's stride is S); a key per call, as nnx.Dropout draws; "nnx" unchanged."""
  b, t, h, d, rate = 2, 16, 2, 16, 0.25
  s = t if causal else 24
  q = jax.random.normal(jax.random.PRNGKey(0), (b, t, h, d))
  k, v = (jax.random.normal(jax.random.PRNGKey(i), (b, s, h, d)) for i in (1, 2))
  mask = None if causal else jax.random.bernoulli(jax.random.PRNGKey(3), 0.7, (b, t, s)).at[:, :, 0].set(True)
  call = lambda dropout, rngs: layers.attention(q, k, v, dropout, causal=causal, mask_BxTxS=mask,
                                                deterministic=False, rngs=rngs)
  stream = nnx.Rngs(dropout=5)
  got = call(layers.Dropout(rate, mask="hash"), stream)
  assert int(stream.dropout.count[...]) == 1
  keep = fa.dropout_keep_mask(fa.head_seeds(nnx.Rngs(dropout=5).dropout(), b, h), t, rate, num_keys=s)
  assert keep.shape == (b, h, t, s)
  logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
  visible = jnp.tril(jnp.ones((t, s), bool)) if causal else mask[:, None]
  probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
  want = jnp.einsum("bhts,bshd->bthd", jnp.where(keep, probs / (1 - rate), 0.0), v)
  np.testing.assert_allclose(got, want, atol=1e-5)
  if causal:
    np.testing.assert_allclose(got, fa.causal_attention(q, k, v, rate=rate, key=nnx.Rngs(dropout=5).dropout(),
                                                        interpret=True), atol=1e-5)
  nnx_out = call(layers.Dropout(rate), nnx.Rngs(dropout=5))
  assert not np.allclose(nnx_out, got)  # another random stream
  np.testing.assert_array_equal(nnx_out, call(nnx.Dropout(rate), nnx.Rngs(dropout=5)))  # "nnx" is nnx.Dropout


@pytest.mark.parametrize("shape", [(3, 40, 50), (64, 96), (1000,), (2, 3, 8, 8)])
def test_hash_dropout_of_any_array(shape):
  """layers.Dropout(mask="hash") on any shape: keeps with chance 1 - rate, scales by 1 / (1 - rate) as
  nnx.Dropout does, draws one key of the same stream per call, is the identity when deterministic, and the same
  masks again from the same stream; on [B, H, T, S] its masks are the kernels' (hash_keep_mask)."""
  rate = 0.3
  x = jnp.ones(shape, jnp.float32) * 2.0
  drop = layers.Dropout(rate, mask="hash")
  stream, nnx_stream = nnx.Rngs(dropout=1), nnx.Rngs(dropout=1)
  y = np.asarray(drop(x, deterministic=False, rngs=stream))
  nnx.Dropout(rate)(x, deterministic=False, rngs=nnx_stream)
  assert int(stream.dropout.count[...]) == int(nnx_stream.dropout.count[...]) == 1
  assert set(np.unique(y)) <= {0.0, np.float32(2.0 / (1 - rate))}
  kept = (y != 0).mean()
  assert abs(kept - (1 - rate)) < 4 * np.sqrt(rate * (1 - rate) / y.size), kept
  np.testing.assert_array_equal(y, drop(x, deterministic=False, rngs=nnx.Rngs(dropout=1)))
  np.testing.assert_array_equal(drop(x, deterministic=True, rngs=nnx.Rngs(dropout=1)), x)
  key = nnx.Rngs(dropout=1).dropout()
  np.testing.assert_array_equal(y != 0, fa.hash_keep_mask(key, shape, rate))
  if len(shape) == 4:
    np.testing.assert_array_equal(fa.hash_keep_mask(key, shape, rate),
                                  fa.dropout_keep_mask(fa.head_seeds(key, *shape[:2]), shape[2], rate))
  with pytest.raises(ValueError, match=r"dropout mask must be one of \('nnx', 'hash'\)"):
    layers.Dropout(rate, mask="philox")


@pytest.mark.parametrize("remat", ["none", "block"])
def test_a_train_step_through_the_kernels_equals_xla_with_their_masks(monkeypatch, remat):
  """The real steps.train_step (TRIME local loss, two micro-batches in its scan, every dropout on; with and
  without remat) through the kernels: the same loss and gradients as XLA's materialised attention with the
  kernels' hash masks (model.dropout_mask="hash", every other dropout hashed on both sides). The custom VJP, the
  key drawn from the dropout stream and the recomputation all agree, and a run may switch between the two."""
  monkeypatch.setattr(M, "_cudnn_backend", lambda: True)
  got_metrics, got_grads = step_result(tiny(**{"model.attention_impl": "pallas", "model.num_heads": 2,
                                               "model.remat": remat, "model.dropout_mask": "hash"}))
  want_metrics, want_grads = step_result(tiny(**{"model.num_heads": 2, "model.remat": remat,
                                                 "model.dropout_mask": "hash"}))
  assert float(want_metrics["loss"]) > 0 and int(got_metrics["skipped"]) == 0
  for k in ("loss", "ce_nll", "trime_nll"):
    np.testing.assert_allclose(got_metrics[k], want_metrics[k], rtol=1e-5, err_msg=k)
  got, want = jax.tree_util.tree_leaves_with_path(got_grads), jax.tree_util.tree_leaves_with_path(want_grads)
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, g), (_, w) in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_pallas_is_refused_where_it_cannot_run(monkeypatch):
  with pytest.raises(ConfigError, match=r"^model.attention_impl='pallas' needs an NVIDIA GPU .* 'cpu'"):
    validate_config(tiny(**{"model.attention_impl": "pallas", "model.num_heads": 2}))
  with pytest.raises(ConfigError, match=r"^model.attention_impl='pallas' needs an NVIDIA GPU"):
    M.build_model(M.ModelConfig(vocab_size=20, attention_impl="pallas"))
  # wiki103_150m's heads: 410 / 10 = 41 dimensions
  with pytest.raises(ConfigError, match=r"power of two of at least 16 \(d_model / num_heads = 41\)"):
    validate_config(tiny(**{"model.attention_impl": "pallas", "model.d_model": 410, "model.num_heads": 10}))
  with pytest.raises(ConfigError, match=r"multiple of 16 .*got 24.*data.segment_len"):
    validate_config(tiny(**{"model.attention_impl": "pallas", "model.num_heads": 2, "data.segment_len": 24,
                            "model.max_len": 24}))
  with pytest.raises(ConfigError, match=r"^model.num_heads must be >= 1, got 0$"):  # not a division by zero
    validate_config(tiny(**{"model.attention_impl": "pallas", "model.num_heads": 0}))
  monkeypatch.setenv("TRIME_FLASH_TILES", "q=48")
  with pytest.raises(ConfigError, match=r"^TRIME_FLASH_TILES='q=48'"):
    validate_config(tiny(**{"model.attention_impl": "pallas", "model.num_heads": 2}))
  monkeypatch.delenv("TRIME_FLASH_TILES")
  # a GPU, but more than one device: the kernels are not partitioned over a mesh
  monkeypatch.setattr(M, "_cudnn_backend", lambda: True)
  monkeypatch.setattr(jax, "device_count", lambda: 2)
  with pytest.raises(ConfigError, match=r"^model.attention_impl='pallas' runs on one device for now \(2 here"):
    validate_config(tiny(**{"model.attention_impl": "pallas", "model.num_heads": 2}))


@pytest.mark.parametrize("seq_len", [3072, 48])
def test_the_kernels_lower_to_triton_for_a_gpu(seq_len):
  """Without a GPU the kernels' Triton lowering still runs: jax.export for the CUDA platform turns each kernel
  into Triton IR (the step that fails on an operation Pallas's Triton backend lacks, or on a tile that is not a
  power of two: 48 tokens once made 48-row tiles). Triton's own compilation to GPU code happens on a GPU only
  (bench.mfu's pallas_attn lever)."""
  from jax import export

  shape = jax.ShapeDtypeStruct((1, seq_len, 8, 128), jnp.bfloat16)  # the 247M model's heads, bfloat16
  key = jax.random.PRNGKey(0)

  def loss(q, k, v):
    return jnp.sum(fa.causal_attention(q, k, v, rate=0.1, key=key).astype(jnp.float32))

  triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  exported = export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                           disabled_checks=[triton])(shape, shape, shape)
  text = exported.mlir_module()
  for name in ("trime_flash_forward", "trime_flash_dkdv", "trime_flash_dq"):
    assert f'name = "{name}"' in text, name
  assert text.count("__gpu$xla.gpu.triton") == 3
