"""SRU++ backbone (trime_jax/srupp.py) and its TrimeLM_long: float64 NumPy references, state carried across
segments, the backbone switch through training and evaluation."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trime_jax.configs import bytes_srupp, enwik8_srupp
from tests import reference as ref
from tests.helpers import tiny_config, write_text_file
from trime_jax import loss as L
from trime_jax import model as M
from trime_jax import steps
from trime_jax.batching import consecutive
from trime_jax.batching import plan as batch_plan
from trime_jax.errors import ConfigError
from trime_jax.srupp import SRUppConfig, SRUppLM, sru_recurrence
from trime_jax import specs


# ----------------------------------------------------------------------------------------------------------
# The recurrence
# ----------------------------------------------------------------------------------------------------------
def np_sru(u, x, wc, b, c0, mask=None):
  """Step-by-step float64 SRU (the reference's elementwise_recurrence_naive, k = 3, no rescale)."""
  sig = lambda z: 1.0 / (1.0 + np.exp(-z))
  bsz, length, d = x.shape
  m = np.ones((bsz, d)) if mask is None else mask
  c, hs = c0.copy(), []
  for t in range(length):
    f = sig(u[:, t, :, 1] + wc[0] * c + b[0])
    r = sig(u[:, t, :, 2] + wc[1] * c + b[1])
    c = f * c + (1 - f) * u[:, t, :, 0]
    hs.append(x[:, t] + (c - x[:, t]) * m * r)  # h_t = x + (g(c) - x)·mask·r (sru/ops.py, the CUDA kernel)
  return np.stack(hs, 1), c


def test_scan_recurrence_equals_step_by_step_numpy_values_and_gradients():
  """Values: jax.lax.scan in float64 == the NumPy loop. Gradients: jax.grad (float64) == central finite
  differences of the NumPy loop, for every input (u, x, v_f/v_r, biases, c0)."""
  rng = np.random.default_rng(0)
  bsz, length, d = 2, 7, 3
  args = [rng.normal(size=(bsz, length, d, 3)), rng.normal(size=(bsz, length, d)), rng.uniform(-1, 1, (2, d)),
          rng.normal(size=(2, d)), rng.normal(size=(bsz, d))]
  mask = rng.integers(0, 2, (bsz, d)) * 2.0  # a dropout mask (keep prob 1/2)
  w_h, w_c = rng.normal(size=(bsz, length, d)), rng.normal(size=(bsz, d))
  objective_np = lambda *a: float((np_sru(*a, mask)[0] * w_h).sum() + (np_sru(*a, mask)[1] * w_c).sum())
  with jax.enable_x64(True):
    h, c = sru_recurrence(*map(jnp.asarray, args), jnp.asarray(mask))
    assert h.dtype == jnp.float64
    want_h, want_c = np_sru(*args, mask)
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(c), want_c, rtol=1e-12, atol=1e-12)
    # a dropped unit passes its input through (the reference's highway with the mask on c - x; the mask on c
    # alone gave (1 - r)·x)
    dropped = np.broadcast_to((mask == 0)[:, None, :], h.shape)
    np.testing.assert_array_equal(np.asarray(h)[dropped], args[1][dropped])

    def objective(*a):
      h, c = sru_recurrence(*a, jnp.asarray(mask))
      return (h * w_h).sum() + (c * w_c).sum()

    grads = jax.grad(objective, argnums=tuple(range(5)))(*map(jnp.asarray, args))
  eps = 1e-6
  for i, (a, g) in enumerate(zip(args, grads)):
    fd = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
      plus, minus = [x.copy() for x in args], [x.copy() for x in args]
      plus[i][idx] += eps
      minus[i][idx] -= eps
      fd[idx] = (objective_np(*plus) - objective_np(*minus)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-6, atol=1e-7, err_msg=f"input {i}")


# ----------------------------------------------------------------------------------------------------------
# State across segments
# ----------------------------------------------------------------------------------------------------------
def _model(**kw):
  cfg = SRUppConfig(**{**dict(vocab_size=13, num_layers=2, d_model=16, attn_dim=8, num_heads=2, attention_every=2,
                              dropout=0.0), **kw})
  model = SRUppLM(cfg, rngs=nnx.Rngs(1))
  for layer in model.layers:  # α starts at 0 (attention off); switch it on so the test sees the memory
    if layer.attention:
      layer.transform.alpha[...] = jnp.full((1,), 0.8)
  return model


def test_evaluation_attends_to_the_references_same_length_window():
  """Evaluation (deterministic) masks attention as the reference's eval_model (`set_mask(mem_length,
  same_length=True)`: -10000 on triu(1) + tril(-1 - mem_length) of a [2M, 2M] matrix, rows mem_len.., columns
  ..mem_len + input_len): a query sees itself and the M positions before it; training sees the whole memory.
  With eval_same_length=False, evaluation attends as training does (exports of before 2026-12-06)."""
  from trime_jax.srupp import attention_mask

  for mem, length in [(6, 6), (6, 4), (0, 6)]:  # a full segment, the short last one, the first (no memory)
    unroll = 6
    ones = np.ones((2 * unroll, 2 * unroll))
    blocked = np.triu(ones, 1) + np.tril(ones, -1 - unroll)
    want = blocked[mem:mem + length, :mem + length] == 0
    np.testing.assert_array_equal(np.asarray(attention_mask(length, mem, same_length=True)), want)
    np.testing.assert_array_equal(np.asarray(attention_mask(length, mem)), np.triu(ones, 1)[mem:mem + length,
                                                                                           :mem + length] == 0)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 13, (3, 12)))
  same, whole = _model(), _model(eval_same_length=False)
  _, _, c = same.features_carry(tokens[:, :6], same.init_carry(3, 6))
  _, g_same, _ = same.features_carry(tokens[:, 6:], c)
  _, _, c = whole.features_carry(tokens[:, :6], whole.init_carry(3, 6))
  _, g_whole, _ = whole.features_carry(tokens[:, 6:], c)
  assert np.abs(np.asarray(g_same - g_whole)).max() > 1e-3  # the window matters
  np.testing.assert_allclose(np.asarray(g_same[:, 0]), np.asarray(g_whole[:, 0]), rtol=1e-6, atol=1e-6)  # the
  # first query sees the whole memory either way


@pytest.mark.parametrize("layer_norm", [False, True])
def test_carrying_state_across_two_segments_equals_one_pass(layer_norm):
  # With the per-layer LN the equality needs the memory normalised like the current input (normalize_memory);
  # the reference's un-normalised memory makes the second segment differ from one pass (checked below). One pass
  # attends as training does: the whole memory (eval_same_length=False).
  model = _model(layer_norm=layer_norm, normalize_memory=layer_norm, eval_same_length=False)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 13, (3, 12)))
  f, g = model.features(tokens)
  c = model.init_carry(3, 6)
  f1, g1, c = model.features_carry(tokens[:, :6], c)
  f2, g2, c = model.features_carry(tokens[:, 6:], c)
  np.testing.assert_allclose(np.concatenate([f1, f2], 1), f, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.concatenate([g1, g2], 1), g, rtol=1e-5, atol=1e-5)
  # The memory matters (without it the second half differs), and a reset row starts over.
  _, g2_fresh = model.features(tokens[:, 6:])
  assert np.abs(np.asarray(g2_fresh - g2)).max() > 1e-3
  reset = jnp.asarray([True, False, False])
  _, g2_reset, _ = model.features_carry(tokens[:, 6:], model.reset_carry(model.features_carry(
      tokens[:, :6], model.init_carry(3, 6))[2], reset))
  np.testing.assert_allclose(g2_reset[0], g2_fresh[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g2_reset[1:], g2[1:], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# TrimeLM_long for SRU++: current segment (causal) + the previous segment's stale keys
# ----------------------------------------------------------------------------------------------------------
def np_prev_nll(lz, tp, k, t, pk, pt, tau):
  """float64 reference: memory of token i of row b = tokens j < i of row b and every token of its previous
  segment (padding targets < 0 are never memory; padded queries score 0)."""
  b, l, d = k.shape
  out = np.zeros((b, l))
  lse = lambda v: np.log(np.exp(np.asarray(v) - max(v)).sum()) + max(v)
  for r in range(b):
    for i in range(l):
      if t[r, i] < 0:
        continue
      z, p = [lz[r, i]], [tp[r, i]]
      mems = [(pk[r, j], pt[r, j]) for j in range(pk.shape[1])] + [(k[r, j], t[r, j]) for j in range(i)]
      for key, tgt in mems:
        if tgt < 0:
          continue
        s = k[r, i] @ key / math.sqrt(d) / tau
        z.append(s)
        if tgt == t[r, i]:
          p.append(s)
      out[r, i] = lse(z) - lse(p)
  return out


def test_srupp_long_loss_equals_float64_reference_with_stop_gradient_on_stale_keys():
  rng = np.random.default_rng(3)
  b, l, m, d, tau = 2, 5, 4, 4, 0.7
  lz, tp = rng.normal(size=(b, l)) + 2.0, rng.normal(size=(b, l))
  k, pk = rng.normal(size=(b, l, d)), rng.normal(size=(b, m, d))
  t, pt = rng.integers(0, 3, (b, l)), rng.integers(0, 3, (b, m))
  t[1, 4], pt[0, 1], pt[1, :] = -1, -1, -1  # padding, and a row with no previous segment (a reset)
  spec = L.ObjectiveSpec("long", tau=tau)
  w = rng.normal(size=(b, l))
  with jax.enable_x64(True):
    def f(keys, prev):
      stats = L.VocabStats(jnp.asarray(lz), jnp.asarray(tp))
      return steps.previous_segment_nll(stats, keys, jnp.asarray(t), prev, jnp.asarray(pt), spec)

    got = f(jnp.asarray(k), jnp.asarray(pk))
    np.testing.assert_allclose(np.asarray(got), np_prev_nll(lz, tp, k, t, pk, pt, tau), rtol=1e-12, atol=1e-12)
    gk, gpk = jax.grad(lambda a, c: (f(a, c) * w).sum(), argnums=(0, 1))(jnp.asarray(k), jnp.asarray(pk))
  assert np.all(np.asarray(gpk) == 0.0)  # stale keys: no gradient
  # options this memory does not implement are refused, not ignored
  for other in (L.ObjectiveSpec("local", tau=tau), L.ObjectiveSpec("long", tau=tau, memory_topk=1)):
    with pytest.raises(ValueError, match=r"previous_segment_nll is a stateful model's memory='long'"):
      steps.previous_segment_nll(L.VocabStats(jnp.asarray(lz), jnp.asarray(tp)), jnp.asarray(k), jnp.asarray(t),
                                 jnp.asarray(pk), jnp.asarray(pt), other)
  eps, fd = 1e-6, np.zeros_like(k)
  for idx in np.ndindex(k.shape):
    kp, km = k.copy(), k.copy()
    kp[idx] += eps
    km[idx] -= eps
    fd[idx] = ((np_prev_nll(lz, tp, kp, t, pk, pt, tau) - np_prev_nll(lz, tp, km, t, pk, pt, tau)) * w).sum() / (2 * eps)
  np.testing.assert_allclose(np.asarray(gk), fd, rtol=1e-6, atol=1e-8)


def test_train_step_carries_previous_segment_keys_and_targets():
  """Through nll_sums_carry: the carried keys are this segment's g, the carried targets its targets, and the
  loss with them equals previous_segment_nll fed with the previous forward's keys."""
  model = _model()
  rng = np.random.default_rng(4)
  tok = jnp.asarray(rng.integers(0, 13, (2, 13)))
  spec = steps.LossSpec(L.ObjectiveSpec("long"))
  carry = steps.init_train_carry(model, 2, 6)
  batches = [{"inputs": tok[:, s:s + 6], "targets": tok[:, s + 1:s + 7], "drop_local": jnp.zeros(2, bool)}
             for s in (0, 6)]
  sums1, carry1 = steps.nll_sums_carry(model, batches[0], carry, spec, use_trime=True, report_trime=True,
                                       deterministic=True)
  _, g1, _ = model.features_carry(batches[0]["inputs"], carry["model"])
  np.testing.assert_allclose(carry1["keys"], g1, rtol=1e-6)
  assert np.array_equal(carry1["targets"], batches[0]["targets"])
  sums2, _ = steps.nll_sums_carry(model, batches[1], carry1, spec, use_trime=True, report_trime=True,
                                  deterministic=True)
  stats, g2, _ = steps.forward_carry(model, batches[1]["inputs"], batches[1]["targets"], carry1["model"])
  want = steps.previous_segment_nll(stats, g2, batches[1]["targets"], g1, batches[0]["targets"], spec.objective)
  np.testing.assert_allclose(float(sums2[0]), float(want.sum()), rtol=1e-5)
  # Without the previous segment (a reset row) the loss is the local one.
  reset = steps.reset_train_carry(carry1, jnp.asarray([True, True]))
  sums_local, _ = steps.nll_sums_carry(model, batches[1], reset, spec, use_trime=True, report_trime=True,
                                       deterministic=True)
  assert float(sums_local[0]) != pytest.approx(float(sums2[0]))


# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------
def test_enwik8_srupp_config_is_about_42m_parameters():
  """Counted from shapes (nnx.eval_shape): nothing is allocated. Tolerance 5% (see configs/enwik8_srupp.py)."""
  for arg in ("512", "2048"):
    c = enwik8_srupp.get_config(arg)
    assert c.data.segment_len == int(arg) and c.train.batch_size == 16 and c.train.num_steps == 400_000
    assert c.eval.mem_size == (6_144 if arg == "512" else 12_228)
    # the reference's SRUpp has no per-layer pre-LN in any branch (its layer_norm argument is stored, unused; the
    # script's --layer_norm picks the init only): only the post-LN inside attention / projection
    assert c.model.srupp_layer_norm is False and specs.model_config(c).layer_norm is False
    assert specs.model_config(c).attn_layer_norm is True
    n = M.abstract_param_count(specs.model_config(c))
    assert abs(n - 42e6) / 42e6 < 0.05, n
  tiny_s, tiny_t = (M.abstract_param_count(specs.model_config(bytes_srupp.get_config(b)))
                    for b in ("srupp", "transformer"))
  assert abs(tiny_s - tiny_t) / tiny_t < 0.1


# ----------------------------------------------------------------------------------------------------------
# The backbone switch: train a few steps on stream batches and evaluate, with the state carried along
# ----------------------------------------------------------------------------------------------------------
def test_backbone_switch_trains_and_evaluates_srupp_long(tmp_path):
  from trime_jax import evaluate, train

  corpus_path = write_text_file(str(tmp_path / "text.txt"), 12_000)
  plan_dir = str(tmp_path / "plan")
  config = tiny_config(corpus_path, **{
      "model.backbone": "srupp", "model.key_type": "final", "model.srupp_attn_dim": 8,
      "model.srupp_attention_every": 1, "model.d_model": 16, "train.num_steps": 3,
      "train.grad_accum": 2, "trime.memory": "long", "trime.batching": "consecutive",
      "trime.consecutive_layout": "stream", "trime.batch_plan": plan_dir, "trime.ce_warmup_steps": 0,
      "eval.context_window": 0, "eval.block_len": 32, "eval.mem_size": 64, "eval.max_tokens": 200,
      "train.eval_max_tokens": 128, "train.checkpoint_every": 10, "model.num_layers": 1})
  from trime_jax import corpora

  splits = corpora.load_splits(config.data)
  header, batches = consecutive.make_plan(splits.train, config, progress=False)
  batch_plan.save(plan_dir, header, batches)
  # Rows continue their streams: after the first micro-batch a row restarts only where its stream ended.
  source = train.BatchSource(splits.train, config)
  idx = np.concatenate([source.indices(s) for s in range(2)])
  resets = np.concatenate([source(s)["reset"] for s in range(2)])
  assert resets[0].all() and np.array_equal(resets[1:], (idx[1:] != idx[:-1] + 1) | (idx[1:] < 0))
  assert not resets[1:].all()
  out = train.train_and_evaluate(config, str(tmp_path / "work"), splits=splits)
  assert out["num_params"] == M.abstract_param_count(specs.model_config(config, vocab_size=256))
  assert math.isfinite(out["train"]["loss"]) and out["dev"]["trime_local(tau=1)_ppl"] < 256
  res = evaluate.evaluate_checkpoint(config, out["export"])
  rows = {r["family"]: r for r in res["rows"]}
  assert set(rows) == {"none", "trime_local"} and rows["none"]["tokens"] == 200
  assert all(math.isfinite(r["nll"]) for r in rows.values())
  # The evaluator threads the carry along a stream: 6 windows of 32 in one stream score exactly what one pass
  # over the 192 tokens at once scores.
  from trime_jax import exports
  from trime_jax import data as D

  graphdef, params, _, _, _ = exports.load_export(out["export"])
  windowed = evaluate.evaluate(graphdef, params, splits.dev, (evaluate.NONE,), block_len=32, context_window=0,
                               streams=1, max_tokens=192).scores[0]
  inputs, targets, _ = D.window_batch(splits.dev, D.eval_windows(splits.dev, 192, 192, 0, "none"), 192)
  stats, _ = steps.forward(nnx.merge(graphdef, params), jnp.asarray(inputs), jnp.asarray(targets))
  one_pass = float(jnp.where(targets >= 0, stats.log_normalizer - stats.target_logit, 0).sum()) / 192
  assert windowed.tokens == 192 and windowed.nll == pytest.approx(one_pass, rel=1e-5)
  # The next window's forward pass dispatched early (eval.overlap_search) still continues the carry in order.
  overlapped = evaluate.evaluate(graphdef, params, splits.dev, (evaluate.NONE,), block_len=32, context_window=0,
                                 streams=1, max_tokens=192, overlap_search=True).scores[0]
  assert overlapped.nll == windowed.nll
  # One search for several windows (eval.search_queries): their forward passes run first, each continuing the
  # carry of the one before, then the windows are scored in order: what one search per window scores.
  cfg_m = nnx.merge(graphdef, params).cfg
  rng = np.random.default_rng(1)
  mem = ref.RowByRowSearch(rng.standard_normal((40, cfg_m.d_model)), rng.integers(0, cfg_m.vocab_size, 40), 8)
  with_ext = lambda queries, overlap: evaluate.evaluate(
      graphdef, params, splits.dev, (evaluate.Point("trime", tau=1.0),), block_len=32, context_window=0, streams=1,
      max_tokens=192, external=mem, per_token=True, search_queries=queries, overlap_search=overlap).token_nll
  per_window = with_ext(0, False)
  assert len(mem.calls) == 6
  for overlap in (False, True):
    np.testing.assert_array_equal(with_ext(64, overlap), per_window)
  assert mem.calls[6:] == [64, 64, 64] * 2
  # Two streams: the second starts afresh at its first window (no long-term store, no warm-up), so its windows
  # score otherwise than in one stream, where they continue the carry (evaluate's docstring; a Transformer's
  # numbers would not move, tests/test_eval.py)
  one, two = (evaluate.evaluate(graphdef, params, splits.dev, (evaluate.NONE,), block_len=32, context_window=0,
                                streams=n, max_tokens=192, per_token=True).token_nll[0] for n in (1, 2))
  np.testing.assert_allclose(two[:96], one[:96], rtol=1e-6)  # the first stream: windows 0-2 as in one stream
  assert np.abs(two[96:128] - one[96:128]).max() > 1e-3  # window 3: a fresh carry instead of windows 0-2's
  # ... and a stream started from the state (store and carry) after its first two windows scores the rest alike
  run = lambda **kw: evaluate.evaluate(graphdef, params, splits.dev, (evaluate.NONE,), block_len=32, context_window=0,
                                       streams=1, max_tokens=192, per_token=True, **kw)
  kept = run(keep_state_before=64)
  assert len(kept.state.windows) == 2 and kept.state.carry is not None
  resumed = run(start=kept.state)
  assert resumed.started_at == 2 and resumed.tokens == 128
  np.testing.assert_array_equal(resumed.token_nll[:, 64:], kept.token_nll[:, 64:])
  # The Python API scores many texts in one pass, one row running several texts one after another: the carry
  # starts afresh at each text (`StreamPlan.fresh`), so each scores what it scores alone; carried over, not.
  import trime_jax

  api_model = trime_jax.load(out["export"])
  api_model.config.eval.batch_size = 1  # one row: every text after another
  # longest first, as the row runs them: each text's windows right after the text before (window i + 1 after i)
  texts = ["the first text, a few windows of 32 bytes long; " * 2, "and a second text " * 3, "a third one."]
  alone = [api_model.score(t, memory="local") for t in texts]
  together = api_model.score(texts, memory="local")
  for a, b in zip(alone, together):
    np.testing.assert_allclose(b.log_probs, a.log_probs, rtol=1e-6, atol=1e-6)
  ids_of = [np.asarray(api_model.tokenize(t), np.int32) for t in texts]
  corpus, text_plan, _ = evaluate.texts_plan(ids_of, api_model.vocab, block_len=32, context_window=0, rows=1,
                                             d_model=16, dtype=jnp.float32)
  carried = evaluate.evaluate(graphdef, params, corpus, [evaluate.Point("trime_local", tau=api_model.default_tau)],
                              block_len=32, context_window=0, streams=1, per_token=True,
                              plan=dataclasses.replace(text_plan, fresh=None)).token_nll[0]
  assert (text_plan.schedule[:, 0] == np.arange(len(text_plan.wins))).all()
  # Complete mode pads each block of whole lines: the carried state would run through the padding (it did), so a
  # stateful model refuses it; a one-line text is one block from its first token (mode none) and still scores
  api_model.config.eval.sample_break_mode = "complete"
  api_model.config.eval.block_len = 48
  lined = "a line of twenty-six bytes\nanother line, twenty-five\nthe third, twenty bytes\n"
  with pytest.raises(ConfigError, match="stateful model .*complete mode pads each block.*sample_break_mode=none"):
    api_model.score(lined, memory="local")
  ids = np.asarray(api_model.tokenize(lined), np.int32)
  with pytest.raises(ConfigError, match="sample_break_mode=none"):
    evaluate.evaluate(graphdef, params, D.Corpus.from_docs([ids], api_model.vocab),
                      [evaluate.Point("trime_local", tau=api_model.default_tau)], block_len=48, context_window=0,
                      streams=1, break_mode="complete")
  one = api_model.score("one line only", memory="local")
  assert np.isfinite(one.log_probs).all()
  assert not np.allclose(-carried[len(ids_of[0]):], np.concatenate([s.log_probs for s in together[1:]]), atol=1e-4)
  with pytest.raises(ConfigError, match="context_window"):
    train.validate_config(tiny_config(corpus_path, **{"model.backbone": "srupp", "model.key_type": "final"}))
  with pytest.raises(ConfigError, match="consecutive"):
    train.validate_config(tiny_config(corpus_path, **{"model.backbone": "srupp", "model.key_type": "final",
                                                      "eval.context_window": 0, "trime.memory": "long"}))


def test_reference_layer_norm_attends_to_unnormalised_memory():
  """layer_norm without normalize_memory (the reference SRUpp): the first segment is as one pass, the second
  attends to the previous inputs before the LN, so it differs from one pass (and from normalize_memory=True)."""
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 13, (3, 12)))
  ref = _model(layer_norm=True, eval_same_length=False)  # one pass attends as training: the whole memory
  ours = _model(layer_norm=True, normalize_memory=True, eval_same_length=False)
  f, _ = ref.features(tokens)
  f1, _, c = ref.features_carry(tokens[:, :6], ref.init_carry(3, 6))
  f2, _, _ = ref.features_carry(tokens[:, 6:], c)
  np.testing.assert_allclose(f1, f[:, :6], rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(f2 - f[:, 6:])).max() > 1e-3
  _, _, c_ours = ours.features_carry(tokens[:, :6], ours.init_carry(3, 6))
  f2_ours, _, _ = ours.features_carry(tokens[:, 6:], c_ours)
  np.testing.assert_allclose(f2_ours, f[:, 6:], rtol=1e-5, atol=1e-5)
