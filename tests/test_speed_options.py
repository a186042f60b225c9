"""The speed options of issue 37 (model.attention_impl, model.remat): off by default, the same numbers when on,
the same parameter tree and export digests, and a clear ConfigError where an option cannot run (CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trime_jax import checkpoint, exports, layers, specs, steps
from trime_jax import model as M
from trime_jax.configs import default
from trime_jax.errors import ConfigError
from trime_jax.train_config import validate_config
from tests.helpers import grad_capture

B, L, A = 4, 16, 2  # rows, segment length, micro-batches (the step's lax.scan)
# XLA's CPU backend spends ~15 s optimising one tiny step with dropout (its random bits); unoptimised it compiles
# in ~3 s. Every step here is compiled alike, and what is compared is what jax hands XLA.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tiny(**overrides):
  """A 2-layer float32 model with every dropout on, so the remat check covers the blocks' dropout keys."""
  c = default.get_config()
  c.model.vocab_size, c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.d_ff = 64, 2, 32, 4, 64
  c.model.max_len = c.data.segment_len = c.eval.block_len = L
  c.eval.context_window = 8
  c.model.dropout = c.model.attention_dropout = c.model.activation_dropout = 0.1
  c.train.batch_size, c.train.grad_accum = B, A
  c.trime.memory = "local"
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  return c


def step_result(config):
  """(metrics, gradients) of one TRIME `steps.train_step` of `config` on fixed tokens and dropout key."""
  mcfg = specs.model_config(config)
  graphdef, params = nnx.split(M.build_model(mcfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  tx = grad_capture()
  tokens = np.random.default_rng(0).integers(0, mcfg.vocab_size, (A, B, L + 1), dtype=np.int32)
  batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "drop_local": np.zeros((A, B), bool)}
  state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
  fn = functools.partial(steps.train_step, graphdef, tx, specs.loss_spec(config), True, True)
  lowered = jax.jit(fn).lower(state, batch, jax.random.PRNGKey(3))
  # remat on: the step's recomputation sits behind optimization barriers (jax.checkpoint's prevent_cse), so the
  # option reached the blocks; off: there are none.
  assert ("optimization_barrier" in lowered.as_text()) == (mcfg.remat != "none")
  new_state, metrics = lowered.compile(compiler_options=FAST_COMPILE)(state, batch, jax.random.PRNGKey(3))
  return jax.device_get(metrics), jax.device_get(new_state["opt_state"]["g"])


@pytest.fixture(scope="module")
def baseline():
  return step_result(tiny())


@pytest.mark.parametrize("policy", [p for p in M.REMAT_POLICIES if p != "none"])
def test_remat_same_loss_and_gradients(baseline, policy):
  metrics, grads = step_result(tiny(**{"model.remat": policy}))
  want_metrics, want_grads = baseline
  assert float(want_metrics["loss"]) > 0 and int(metrics["skipped"]) == 0
  for k in ("loss", "ce_nll", "trime_nll"):
    np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-6, err_msg=k)
  flat, want = jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves_with_path(want_grads)
  assert [p for p, _ in flat] == [p for p, _ in want]
  for (path, g), (_, w) in zip(flat, want):
    assert np.abs(w).max() > 0, jax.tree_util.keystr(path)  # dropout keys differ -> some gradient would differ
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_remat_with_the_fused_attention_path():
  """Without dropout the blocks' attention is jax's fused dot_product_attention: the same gradients under remat
  (a scalar of the features f and keys g; the train step above covers the dropout path)."""
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (B, L), dtype=np.int32))
  results = []
  for policy in ("none", "block"):
    mcfg = specs.model_config(tiny(**{"model.remat": policy}))
    graphdef, params = nnx.split(M.build_model(mcfg, rngs=nnx.Rngs(params=0)), nnx.Param)

    def scalar(p):
      f, g = nnx.merge(graphdef, p).features(tokens)  # deterministic: no dropout
      return jnp.sum(jnp.sin(f) * g)

    fn = jax.jit(jax.value_and_grad(scalar)).lower(params).compile(compiler_options=FAST_COMPILE)
    results.append(jax.device_get(fn(params)))
  (v0, g0), (v1, g1) = results
  np.testing.assert_allclose(v1, v0, rtol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_defaults_leave_parameters_and_digests_unchanged():
  """Exports depend on the parameter tree and on arch_digest: both as before the options existed."""
  mcfg = specs.model_config(default.get_config(), vocab_size=100)
  assert (mcfg.attention_impl, mcfg.dropout_mask, mcfg.remat) == ("xla", "nnx", "none")
  # Digests pinned before the fields were added (an export's fingerprint includes them).
  assert exports.arch_digest(M.ModelConfig(vocab_size=100)) == "fd658817eae06a32"
  assert exports.arch_digest(specs.model_config(default.get_config(), vocab_size=1000)) == "f6c81c19f239f5e2"
  plain = nnx.state(M.build_model(mcfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  for policy in M.REMAT_POLICIES:
    other = nnx.state(M.build_model(M.ModelConfig(vocab_size=100, remat=policy), rngs=nnx.Rngs(params=0)), nnx.Param)
    assert exports.params_digest(other) == exports.params_digest(plain), policy  # paths, shapes and values
    # how the model is computed is not what it computes: no other digest, no other fingerprint
    assert exports.arch_digest(M.ModelConfig(vocab_size=100, remat=policy)) == "fd658817eae06a32"
    assert (exports.arch_digest(M.ModelConfig(vocab_size=100, remat=policy, attention_impl="cudnn", dtype="bfloat16"))
            == exports.arch_digest(M.ModelConfig(vocab_size=100, dtype="bfloat16")))
  assert exports.arch_digest(M.ModelConfig(vocab_size=100, dropout_mask="hash")) == "fd658817eae06a32"
  hashed = nnx.state(M.build_model(M.ModelConfig(vocab_size=100, dropout_mask="hash"), rngs=nnx.Rngs(params=0)),
                     nnx.Param)
  assert exports.params_digest(hashed) == exports.params_digest(plain)
  assert all(f"model.{k}".startswith(checkpoint.RESUMABLE_CHANGES) for k in exports.EXECUTION_FIELDS)


def test_xla_is_the_previous_call():
  """attention_impl="xla" hands jax its default (None): the same program as before the option."""
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 5, 2, 4)) for i in range(3))
  got = layers.attention(q, k, v, nnx.Dropout(0.0), causal=True, deterministic=True, rngs=None, implementation="xla")
  np.testing.assert_array_equal(got, jax.nn.dot_product_attention(q, k, v, is_causal=True))


def test_cudnn_reaches_the_kernel_call(monkeypatch):
  """On a GPU "cudnn" is jax's implementation="cudnn" in the causal path without dropout, and only there."""
  calls = []
  real = jax.nn.dot_product_attention

  def spy(*args, implementation=None, **kw):
    calls.append(implementation)
    return real(*args, **kw)  # CPU: XLA's path computes the numbers

  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  monkeypatch.setattr(M, "_cudnn_backend", lambda: True)
  model = M.build_model(M.ModelConfig(vocab_size=20, num_layers=2, d_model=16, num_heads=2, d_ff=32, max_len=8,
                                      dtype="bfloat16", attention_dropout=0.1, attention_impl="cudnn"))
  tokens = jnp.ones((1, 8), jnp.int32)
  # Traced only (eval_shape): which kernel each call asks for is decided at trace time.
  jax.eval_shape(lambda: model.features(tokens))
  assert calls == ["cudnn", "cudnn"]  # evaluation: one per layer
  calls.clear()
  jax.eval_shape(lambda: model.features(tokens, deterministic=False, rngs=nnx.Rngs(dropout=0)))
  assert calls == []  # attention dropout in training: the explicit weights, whatever the option
  jax.eval_shape(lambda: model.decode(tokens[:, :1], model.init_cache(1, 8), jnp.zeros((1, 1), jnp.int32)))
  assert calls == [None, None]  # the cached decoder: XLA's masked path


def test_cudnn_on_cpu_is_one_config_error():
  c = tiny(**{"model.attention_impl": "cudnn", "model.dtype": "bfloat16"})
  with pytest.raises(ConfigError, match=r"^model.attention_impl='cudnn' needs an NVIDIA GPU .* 'cpu'"):
    validate_config(c)
  with pytest.raises(ConfigError, match=r"^model.attention_impl='cudnn' needs an NVIDIA GPU"):
    M.build_model(specs.model_config(c))
  with pytest.raises(ConfigError, match=r"^model.attention_impl='cudnn' .* model.dtype is 'float32'"):
    validate_config(tiny(**{"model.attention_impl": "cudnn"}))
  # wiki103_150m's heads: 410 / 10 = 41 dimensions, which cuDNN's kernel does not take
  with pytest.raises(ConfigError, match=r"multiple of 8 and at most 256, got 410 / 10 = 41"):
    validate_config(tiny(**{"model.attention_impl": "cudnn", "model.dtype": "bfloat16", "model.d_model": 410,
                            "model.num_heads": 10}))


@pytest.mark.parametrize("field,value,match", [
    ("model.attention_impl", "flash", r"^model.attention_impl must be one of \('xla', 'cudnn', 'pallas'\)"),
    ("model.remat", "full", r"^model.remat must be one of \('none', 'block'"),
    ("model.dropout_mask", "philox", r"^model.dropout_mask must be one of \('nnx', 'hash'\)"),
])
def test_unknown_values_are_refused(field, value, match):
  with pytest.raises(ConfigError, match=match):
    validate_config(tiny(**{field: value}))


@pytest.mark.parametrize("field,value", [("model.remat", "block"), ("model.dropout_mask", "hash")])
def test_srupp_refuses_the_options(field, value):
  c = tiny(**{"model.backbone": "srupp", "model.key_type": "final", field: value, "eval.context_window": 0})
  with pytest.raises(ConfigError, match=r"Transformer backbone only"):
    validate_config(c)


def test_an_export_trained_with_speed_options_loads_without_them(tmp_path):
  """The options say how a model ran where it trained: its export loads anywhere with them at their defaults
  (a config.json that says cudnn / remat keeps its digest and evaluates on this CPU)."""
  import json
  import shutil

  from trime_jax import api

  directory = tmp_path / "demo"
  shutil.copytree(f"{api.PRETRAINED_DIR}/demo", directory)
  config = json.loads((directory / "config.json").read_text())
  config["model"]["remat"] = "block"  # (attention_impl=cudnn needs a bfloat16 model; the demo is float32)
  (directory / "config.json").write_text(json.dumps(config))
  graphdef, params, *_ = exports.load_export(str(directory))  # the arch digest check passes: not part of it
  model = nnx.merge(graphdef, params)
  assert (model.cfg.remat, model.cfg.attention_impl) == ("none", "xla")
  assert exports.fingerprint(str(directory)) == exports.fingerprint(f"{api.PRETRAINED_DIR}/demo")
