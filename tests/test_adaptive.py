"""Adaptive input and adaptive softmax against float64 references written from fairseq's definitions
(fairseq/modules/adaptive_input.py, adaptive_softmax.py, criterions/trime_loss.py of the original release).

The references read the model's parameters in fairseq's layout and names (`fairseq_params`): torch Linear
weights are [out, in], a TiedLinear with transpose=True multiplies by the tied weight itself. They never call
model.py's adaptive code.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import reference as ref
from trime_jax import loss as L
from trime_jax.errors import ConfigError
from trime_jax import model as M
from trime_jax import steps
from trime_jax import specs

V = 50
# name -> ModelConfig overrides. Several clusters, tied and untied weights and projections, unequal factors
# when untied, an adaptive softmax over a plain embedding, and the one-band case (enwik8's cutoff = V).
VARIANTS = {
    "tied_proj": dict(adaptive_cutoffs=(10, 30), adaptive_input_factor=2.0, adaptive_softmax_factor=2.0,
                      tie_adaptive_proj=True),
    "tied_3_clusters": dict(adaptive_cutoffs=(5, 12, 30), adaptive_input_factor=2.0, adaptive_softmax_factor=2.0),
    "untied": dict(adaptive_cutoffs=(10, 30), adaptive_input_factor=2.0, adaptive_softmax_factor=4.0,
                   tie_embeddings=False),
    "softmax_only": dict(adaptive_cutoffs=(20,), adaptive_input=False, tie_embeddings=False),
    "one_band": dict(adaptive_cutoffs=(), adaptive_input_factor=1.0, adaptive_softmax_factor=1.0),
}


def _cfg(variant="tied_proj", **kw):
  base = dict(vocab_size=V, num_layers=2, d_model=16, num_heads=2, d_ff=32, max_len=32, dropout=0.0,
              adaptive_input=True, adaptive_softmax=True)
  base.update(VARIANTS[variant])
  base.update(kw)
  return M.ModelConfig(**base)


def _model(variant="tied_proj", seed=0, **kw):
  return M.TransformerLM(_cfg(variant, **kw), rngs=nnx.Rngs(seed))


# ----------------------------------------------------------------------------------------------------------
# fairseq's layout and the references
# ----------------------------------------------------------------------------------------------------------
def fairseq_params(model) -> dict:
  """The adaptive parameters under fairseq's state-dict names (decoder. prefix dropped), torch layouts.
  Tied weights appear once, under the adaptive input's name (fairseq's TiedLinear holds the same tensor)."""
  p = {}
  if model.cfg.adaptive_input:
    for i, (emb, proj) in enumerate(zip(model.adaptive_embed.embeddings, model.adaptive_embed.projections)):
      p[f"embed_tokens.embeddings.{i}.0.weight"] = emb.embedding[...]  # Embedding(V_i, dim_i)
      p[f"embed_tokens.embeddings.{i}.1.weight"] = proj.kernel[...].T  # Linear(dim_i, D): [D, dim_i]
  sm = model.adaptive_softmax
  if sm.head is not None:
    p["adaptive_softmax.head.weight"] = sm.head[...]  # Linear(D, c_1 + k)
  if sm.cluster is not None:
    p["adaptive_softmax.head.class_proj.weight"] = sm.cluster[...]  # TiedHeadModule.class_proj: Linear(D, k)
  for i in range(len(model.cfg.adaptive_cutoffs)):
    if sm.tail_proj is not None:
      p[f"adaptive_softmax.tail.{i}.0.weight"] = sm.tail_proj[i][...].T  # Linear(D, dim): [dim, D]
    if sm.tail_out is not None:
      p[f"adaptive_softmax.tail.{i}.2.weight"] = sm.tail_out[i][...]  # Linear(dim, V_i)
  return p


def _as(xp, p):
  return {k: xp.asarray(v, xp.float64) for k, v in p.items()}


def np_adaptive_input(p, tokens, edges):
  """AdaptiveInput.forward: band i's tokens -> Linear_i(Embedding_i(w - c_i))."""
  p = _as(np, p)
  out = np.zeros(tokens.shape + (p["embed_tokens.embeddings.0.1.weight"].shape[0],))
  for i in range(len(edges) - 1):
    mask = (tokens >= edges[i]) & (tokens < edges[i + 1])
    e = p[f"embed_tokens.embeddings.{i}.0.weight"][tokens[mask] - edges[i]]
    out[mask] = e @ p[f"embed_tokens.embeddings.{i}.1.weight"].T
  return out


def head_logits(xp, p, f_NxD):
  """AdaptiveSoftmax.head: Linear(D, c_1 + k), or TiedHeadModule [f · E_0ᵀ | class_proj(f)]."""
  if "adaptive_softmax.head.weight" in p:
    return f_NxD @ p["adaptive_softmax.head.weight"].T
  parts = [f_NxD @ p["embed_tokens.embeddings.0.0.weight"].T]  # TiedLinear(E_0, transpose=False)
  if "adaptive_softmax.head.class_proj.weight" in p:
    parts.append(f_NxD @ p["adaptive_softmax.head.class_proj.weight"].T)
  return xp.concatenate(parts, axis=1)


def tail_logits(xp, p, f_NxD, i):
  """AdaptiveSoftmax.tail[i] = Sequential(proj, Dropout (off), out)."""
  if f"adaptive_softmax.tail.{i}.0.weight" in p:
    h = f_NxD @ p[f"adaptive_softmax.tail.{i}.0.weight"].T
  else:  # --tie-adaptive-proj: TiedLinear(input band i+1's Linear weight [D, dim], transpose=True)
    h = f_NxD @ p[f"embed_tokens.embeddings.{i + 1}.1.weight"]
  if f"adaptive_softmax.tail.{i}.2.weight" in p:
    return h @ p[f"adaptive_softmax.tail.{i}.2.weight"].T
  return h @ p[f"embed_tokens.embeddings.{i + 1}.0.weight"].T  # TiedLinear(E_{i+1}, transpose=False)


def _log_softmax(xp, x):
  m = x.max(axis=-1, keepdims=True)
  return x - m - xp.log(xp.exp(x - m).sum(axis=-1, keepdims=True))


def log_probs(xp, p, f_NxD, edges):
  """AdaptiveSoftmax.get_log_prob over the whole vocabulary [N, V] (every row computes every tail)."""
  head = _log_softmax(xp, head_logits(xp, p, f_NxD))
  c1 = edges[1]
  parts = [head[:, :c1]]
  for i in range(len(edges) - 2):
    parts.append(_log_softmax(xp, tail_logits(xp, p, f_NxD, i)) + head[:, c1 + i][:, None])
  return xp.concatenate(parts, axis=1)


def np_logsumexp(x):
  m = x.max(-1, keepdims=True)
  return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def np_original_criterion(p, f_NxD, targets_N, edges):
  """trime_loss.py's vocabulary side: AdaptiveSoftmax.forward (adapt_target, index_select per tail), then
    norm_t = logsumexp(head); token_loss = CE(head, new_target) + CE(tail_i[idx], target - c_i);
    the vocabulary term of norm_tpc is -token_loss + norm_t. Returns (norm_t, -token_loss + norm_t)."""
  p, f = _as(np, p), np.asarray(f_NxD, np.float64)
  head = head_logits(np, p, f)
  norm_t = np_logsumexp(head)
  new_target = targets_N.copy()
  token_loss = np.zeros(len(targets_N))
  tails = []
  for i in range(len(edges) - 2):
    mask = (targets_N >= edges[i + 1]) & (targets_N < edges[i + 2])
    new_target[mask] = edges[1] + i
    tails.append(np.nonzero(mask)[0])
  token_loss += norm_t - head[np.arange(len(targets_N)), new_target]
  for i, idx in enumerate(tails):
    if len(idx):
      t = tail_logits(np, p, f[idx], i)
      token_loss[idx] += np_logsumexp(t) - t[np.arange(len(idx)), targets_N[idx] - edges[i + 1]]
  return norm_t, -token_loss + norm_t


def _features(rng, n, d=16, scale=1.0):
  return jnp.asarray(scale * rng.standard_normal((n, d)), jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["tied_proj", "tied_3_clusters", "untied", "one_band"])
def test_adaptive_input_matches_numpy(variant):
  model = _model(variant)
  cfg = model.cfg
  tokens = np.random.default_rng(0).integers(0, V, (3, 11))
  tokens[0, :len(cfg.band_edges) - 1] = cfg.band_edges[:-1]  # every band's first word
  tokens[1, :len(cfg.band_edges) - 1] = np.asarray(cfg.band_edges[1:]) - 1  # and last word
  got = np.asarray(model.adaptive_embed(jnp.asarray(tokens)))
  want = np_adaptive_input(fairseq_params(model), tokens, cfg.band_edges)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Band dims D / factor^i, every band projected to D (fairseq: AdaptiveInput, no shortcut for band 0).
  dims = [e.embedding.shape[1] for e in model.adaptive_embed.embeddings]
  assert dims == [int(16 // cfg.adaptive_input_factor**i) for i in range(len(cfg.band_edges) - 1)]
  # The model input is √D · AdaptiveInput(tokens) + positions (fairseq's embed_scale applies to it too).
  cfg0 = dataclasses.replace(cfg, num_layers=0, final_norm=False)
  bare = M.TransformerLM(cfg0, rngs=nnx.Rngs(0))
  bare.adaptive_embed = model.adaptive_embed
  x, _ = bare.features(jnp.asarray(tokens))
  np.testing.assert_allclose(x, want * 4.0 + np.asarray(M.sinusoidal_positions(11, 16))[None], rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_adaptive_log_probs_match_numpy_and_sum_to_one(variant):
  model = _model(variant, seed=1)
  edges = model.cfg.band_edges
  f = _features(np.random.default_rng(1), 7, scale=2.0)
  want = log_probs(np, _as(np, fairseq_params(model)), np.asarray(f, np.float64), edges)
  np.testing.assert_allclose(np.exp(want).sum(-1), 1.0, rtol=1e-12)  # the reference is a distribution
  logits = np.asarray(model.logits(f[None]))[0]
  norm_t = np_logsumexp(head_logits(np, _as(np, fairseq_params(model)), np.asarray(f, np.float64)))
  # Effective logits = log p + norm_t: their softmax is p, their log-sum-exp is the head's.
  np.testing.assert_allclose(logits, want + norm_t[:, None], rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(np_logsumexp(logits.astype(np.float64)), norm_t, rtol=1e-5, atol=2e-5)
  got = logits - np_logsumexp(logits.astype(np.float64))[:, None]
  np.testing.assert_allclose(np.exp(got.astype(np.float64)).sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
  # The tails matter: a model with one tail weight changed gives other log-probs.
  if len(edges) > 2:
    p = _as(np, fairseq_params(model))
    key = "adaptive_softmax.tail.0.2.weight"
    key = key if key in p else "embed_tokens.embeddings.1.0.weight"  # tied: the input band is the tail
    p[key] = p[key] + 0.5 * np.random.default_rng(0).standard_normal(p[key].shape)  # (a constant would cancel)
    assert np.abs(log_probs(np, p, np.asarray(f, np.float64), edges) - want).max() > 1e-2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("vocab_chunk", [0, 7, 64])
def test_vocab_stats_equal_the_original_criterion(variant, vocab_chunk):
  """norm_t and the target's term of trime_loss.py, chunked or not, padding ignored."""
  model = _model(variant, seed=2)
  edges = model.cfg.band_edges
  rng = np.random.default_rng(2)
  targets = rng.integers(0, V, (2, 9))
  targets[0, :len(edges) - 1] = edges[:-1]
  targets[1, :len(edges) - 1] = np.asarray(edges[1:]) - 1
  targets[1, -2:] = -1  # padding
  f = _features(rng, 18, scale=2.0).reshape(2, 9, 16)
  stats = model.vocab_stats(f, jnp.asarray(targets), vocab_chunk=vocab_chunk)
  assert stats.log_normalizer.shape == targets.shape
  valid = targets >= 0
  norm_t, term = np_original_criterion(fairseq_params(model), np.asarray(f).reshape(-1, 16)[valid.reshape(-1)],
                                       targets[valid], edges)
  np.testing.assert_allclose(np.asarray(stats.log_normalizer)[valid], norm_t, rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(stats.target_logit)[valid], term, rtol=1e-5, atol=2e-5)
  # The same two numbers as scoring.vocab_stats of the effective logits (the evaluation path).
  dense = L.vocab_stats(model.logits(f), jnp.asarray(targets))
  np.testing.assert_allclose(np.asarray(dense.log_normalizer), np.asarray(stats.log_normalizer), rtol=1e-5,
                             atol=2e-5)
  np.testing.assert_allclose(np.asarray(dense.target_logit)[valid], np.asarray(stats.target_logit)[valid],
                             rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("variant", ["tied_proj", "tied_3_clusters", "untied"])
@pytest.mark.parametrize("memory", ["local", "ext"])
def test_trime_loss_with_adaptive_model_matches_reference(variant, memory):
  """steps.nll_sums on the adaptive model = tests/reference.py fed with the effective logits of the float64
  fairseq reference (log p_adaptive + norm_t) and the model's keys."""
  model = _model(variant, seed=3)
  cfg = model.cfg
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, V, (4, 13))
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
           "drop_local": jnp.asarray([False, True, False, False])}
  spec = steps.LossSpec(objective=L.ObjectiveSpec(memory))
  obj, ce, tr, n = steps.nll_sums(model, batch, spec, use_trime=True, report_trime=True, deterministic=True)
  f, g = model.features(batch["inputs"])
  p = _as(np, fairseq_params(model))
  f64 = np.asarray(f, np.float64).reshape(-1, 16)
  eff = (log_probs(np, p, f64, cfg.band_edges) + np_logsumexp(head_logits(np, p, f64))[:, None]).reshape(4, 12, V)
  targets = tokens[:, 1:]
  want = ref.trime_nll(eff, np.asarray(g, np.float64), targets, memory, drop_local=np.asarray(batch["drop_local"]))
  want_ce = ref.trime_nll(eff, np.asarray(g, np.float64), targets, "none")
  np.testing.assert_allclose(float(tr), want.sum(), rtol=2e-5)
  np.testing.assert_allclose(float(ce), want_ce.sum(), rtol=2e-5)
  assert int(n) == targets.size and abs(float(tr) - float(ce)) > 1e-3  # memory changes the loss


def _trime_objective(stats, keys, targets, weights):
  nll = L.trime_nll_from_vocab_stats(stats, keys, targets, memory="local", implementation="dense")
  return (nll * weights).sum()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradients_match_float64_dense_reference(variant):
  """d(weighted TRIME nll) / d(f, every adaptive parameter): the model (float32, chunked and not) against
  float64 autodiff of the fairseq-layout dense path above (same parameters, written without model.py)."""
  model = _model(variant, seed=4)
  edges = model.cfg.band_edges
  rng = np.random.default_rng(4)
  targets = jnp.asarray(rng.integers(0, V, (2, 6))).at[1, -1].set(-1)  # with one padding target
  f = _features(rng, 12, scale=1.5).reshape(2, 6, 16)
  keys = _features(rng, 12).reshape(2, 6, 16)
  weights = jnp.asarray(rng.uniform(0.5, 1.5, (2, 6)), jnp.float32)
  graphdef, params = nnx.split(model, nnx.Param)

  def ours(params, f, chunk):
    m = nnx.merge(graphdef, params)
    return _trime_objective(m.vocab_stats(f, targets, vocab_chunk=chunk), keys, targets, weights)

  with jax.enable_x64(True):
    def theirs(p, f):
      f2 = f.reshape(-1, 16)
      head = head_logits(jnp, p, f2)
      norm_t = jax.nn.logsumexp(head, axis=-1)
      eff = log_probs(jnp, p, f2, edges) + norm_t[:, None]
      stats = L.vocab_stats(eff.reshape(2, 6, V), targets)
      return _trime_objective(stats, keys.astype(jnp.float64), targets, weights.astype(jnp.float64))

    p64 = _as(jnp, fairseq_params(model))
    g_p, g_f = jax.grad(theirs, argnums=(0, 1))(p64, jnp.asarray(f, jnp.float64))
    g_p, g_f = {k: np.asarray(v) for k, v in g_p.items()}, np.asarray(g_f)

  for chunk in (0, 5):
    gp, gf = jax.grad(ours, argnums=(0, 1))(params, f, chunk)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(gp))
    mine = {k: np.asarray(v) for k, v in fairseq_params(nnx.merge(graphdef, gp)).items()}
    assert mine.keys() == g_p.keys()
    np.testing.assert_allclose(np.asarray(gf), g_f, rtol=1e-4, atol=1e-5)
    for k in g_p:
      np.testing.assert_allclose(mine[k], g_p[k], rtol=1e-4, atol=1e-5, err_msg=k)
  # Every softmax weight receives gradient (the input projections only where they are tied to tail projections).
  softmax_keys = [k for k in g_p if k.startswith("adaptive_softmax") or
                  (model.cfg.tie_embeddings and k.endswith(".0.weight")) or
                  (model.cfg.tie_adaptive_proj and k.endswith(".1.weight") and ".0.1." not in k)]
  assert softmax_keys and all(np.abs(g_p[k]).max() > 0 for k in softmax_keys)


def test_bfloat16_compute_still_works():
  """bfloat16 compute (the paper configs): finite stats and gradients, close to float32 at bfloat16 accuracy."""
  m32, m16 = _model("tied_3_clusters", seed=5), _model("tied_3_clusters", seed=5, dtype="bfloat16")
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, V, (2, 10)))
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  for chunk in (0, 8):
    s32, _ = steps.forward(m32, inputs, targets, vocab_chunk=chunk)
    s16, k16 = steps.forward(m16, inputs, targets, vocab_chunk=chunk)
    assert k16.dtype == jnp.bfloat16 and s16.log_normalizer.dtype == jnp.float32
    # bfloat16 keeps 8 bits of mantissa (a rounding of 0.4%, ~0.012 at these |values| <= 3); measured: 0.007 and
    # 0.016 at most
    np.testing.assert_allclose(np.asarray(s16.log_normalizer), np.asarray(s32.log_normalizer), atol=0.04)
    np.testing.assert_allclose(np.asarray(s16.target_logit), np.asarray(s32.target_logit), atol=0.04)
  graphdef, params = nnx.split(m16, nnx.Param)
  batch = {"inputs": inputs, "targets": targets, "drop_local": jnp.zeros(2, bool)}

  def obj(p):
    return steps.nll_sums(nnx.merge(graphdef, p), batch, steps.LossSpec(L.ObjectiveSpec("local"), vocab_chunk=8),
                          use_trime=True, report_trime=True, deterministic=True)[0]

  grads = jax.grad(obj)(params)
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(grads))


def test_adaptive_softmax_dropout_only_in_training():
  model = _model("tied_3_clusters", seed=6, adaptive_softmax_dropout=0.5)
  plain = _model("tied_3_clusters", seed=6)
  rng = np.random.default_rng(6)
  f = _features(rng, 10).reshape(1, 10, 16)
  t = jnp.asarray(rng.integers(0, V, (1, 10)))
  det = model.vocab_stats(f, t)
  np.testing.assert_array_equal(det.target_logit, plain.vocab_stats(f, t).target_logit)
  a = model.vocab_stats(f, t, deterministic=False, rngs=nnx.Rngs(dropout=1))
  b = model.vocab_stats(f, t, deterministic=False, rngs=nnx.Rngs(dropout=2))
  assert not np.allclose(a.log_normalizer, b.log_normalizer)
  assert not np.allclose(a.log_normalizer, det.log_normalizer)


def test_config_checks_and_json_cutoffs():
  with pytest.raises(ValueError, match="increase"):
    _cfg(adaptive_cutoffs=(30, 10))
  with pytest.raises(ValueError, match="increase"):
    _cfg(adaptive_cutoffs=(10, V))
  with pytest.raises(ValueError, match="needs both"):
    _cfg(adaptive_softmax=False)  # tied adaptive input needs the adaptive softmax
  with pytest.raises(ValueError, match="factor"):
    _cfg(adaptive_softmax_factor=4.0)
  with pytest.raises(ValueError, match="tie_adaptive_proj"):
    _cfg("untied", tie_adaptive_proj=True)
  cfg = _cfg(adaptive_cutoffs=[10, 30])  # an exported config.json holds a list
  assert cfg.adaptive_cutoffs == (10, 30) and hash(cfg)
  with pytest.raises(ValueError, match="adaptive softmax"):
    _model().output_embedding()
  # Default off: the full tied softmax, no adaptive modules.
  plain = M.TransformerLM(M.ModelConfig(vocab_size=V, num_layers=1, d_model=16, num_heads=2, d_ff=32),
                          rngs=nnx.Rngs(0))
  assert not hasattr(plain, "adaptive_softmax") and plain.output_embedding().shape == (V, 16)


def test_full_softmax_vocab_stats_unchanged():
  """The full softmax's model.vocab_stats is the old steps.forward computation, chunked and not."""
  model = M.TransformerLM(M.ModelConfig(vocab_size=V, num_layers=1, d_model=16, num_heads=2, d_ff=32),
                          rngs=nnx.Rngs(7))
  rng = np.random.default_rng(7)
  f = _features(rng, 8).reshape(2, 4, 16)
  t = jnp.asarray(rng.integers(0, V, (2, 4)))
  w = np.asarray(model.embed.embedding[...], np.float64)
  logits = np.asarray(f, np.float64) @ w.T
  for chunk in (0, 7):
    s = model.vocab_stats(f, t, vocab_chunk=chunk)
    np.testing.assert_allclose(np.asarray(s.log_normalizer), np_logsumexp(logits), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s.target_logit),
                               np.take_along_axis(logits, np.asarray(t)[..., None], -1)[..., 0], rtol=1e-5,
                               atol=1e-6)
  assert math.isfinite(float(s.log_normalizer.sum()))


# ----------------------------------------------------------------------------------------------------------
# trime_jax.launch.train --dry_run: parameter count and per-device memory plan, nothing trained
# ----------------------------------------------------------------------------------------------------------
_ADAPTIVE_OVERRIDES = {"model.vocab_size": 256, "model.adaptive_input": True, "model.adaptive_softmax": True,
                       "model.adaptive_cutoffs": (40, 120), "model.adaptive_softmax_dropout": 0.2,
                       "model.tie_adaptive_proj": True}


def test_memory_plan_function(tmp_path):
  from tests.helpers import tiny_config, write_text_file
  from trime_jax.train import format_memory_plan, memory_plan

  corpus = tmp_path / "corpus.txt"
  write_text_file(corpus)
  plans = {b: memory_plan(tiny_config(corpus, **_ADAPTIVE_OVERRIDES, **{"train.batch_size": b})) for b in (2, 8)}
  plan = plans[2]
  cfg = tiny_config(corpus, **_ADAPTIVE_OVERRIDES)
  n = M.abstract_param_count(specs.model_config(cfg))
  assert plan["num_params"] == n and plan["param_bytes"] == 4 * n
  assert 2 * plan["param_bytes"] <= plan["opt_state_bytes"] < 2 * plan["param_bytes"] + 1024  # Adam mu, nu
  assert plan["temp_bytes"] > 0 and plans[8]["temp_bytes"] > plan["temp_bytes"]  # activations grow with B
  assert plan["peak_bytes"] >= plan["param_bytes"] + plan["opt_state_bytes"]
  text = format_memory_plan(plan)
  assert f"{n:,} parameters" in text and "optimizer state" in text
  # long memory whose runs would cross devices: one clear error (it was the loss's ValueError traceback)
  long_cfg = tiny_config(corpus, **{"trime.memory": "long", "trime.batching": "consecutive",
                                    "trime.consecutive_segments": 4, "train.batch_size": 8,
                                    "train.num_devices": 8})
  with pytest.raises(ConfigError, match=r"^--dry_run plans one device's step alone, and with 8 devices each holds "
                                        r"1 rows, so runs of trime.consecutive_segments=4 cross devices"):
    memory_plan(long_cfg)
  long_cfg.train.num_devices = 2  # 4 rows a device: whole runs, planned
  assert memory_plan(long_cfg)["rows_per_device"] == 4


def test_dry_run_cli_prints_the_plan_and_trains_nothing(tmp_path):
  from tests.helpers import config_file, run_cli, write_text_file

  corpus = tmp_path / "corpus.txt"
  write_text_file(corpus)
  path = config_file(tmp_path, corpus, **_ADAPTIVE_OVERRIDES)
  workdir = tmp_path / "run"
  out = run_cli("trime_jax.launch.train", f"--config={path}", f"--workdir={workdir}", "--dry_run")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "parameters (vocab 256)" in out.stdout and "per-device memory plan" in out.stdout
  assert "peak" in out.stdout and not workdir.exists()


def test_train_export_and_reload_an_adaptive_model(tmp_path):
  """A few training steps (CE warm-up, then TRIME) with dropout in the adaptive softmax, then the export
  loads back (config.json turns the cutoffs into a list) and scores the same as the trained parameters."""
  from tests.helpers import tiny_config, write_text_file
  from trime_jax import exports
  from trime_jax.train import train_and_evaluate

  corpus = tmp_path / "corpus.txt"
  write_text_file(corpus)
  cfg = tiny_config(corpus, **_ADAPTIVE_OVERRIDES, **{"train.num_steps": 4, "trime.ce_warmup_steps": 2,
                                                      "train.vocab_chunk": 50})
  out = train_and_evaluate(cfg, str(tmp_path / "run"))
  assert math.isfinite(out["train"]["loss"]) and out["num_params"] == M.abstract_param_count(
      specs.model_config(cfg))
  graphdef, params, config, _, _ = exports.load_export(out["export"])
  model = nnx.merge(graphdef, params)
  assert model.cfg.adaptive_cutoffs == (40, 120) and model.cfg.tie_adaptive_proj
  tokens = jnp.asarray(np.random.default_rng(8).integers(0, 256, (2, 17)))
  stats, _ = steps.forward(model, tokens[:, :-1], tokens[:, 1:], vocab_chunk=50)
  dense = L.vocab_stats(model(tokens[:, :-1])[0], tokens[:, 1:])
  np.testing.assert_allclose(np.asarray(stats.target_logit), np.asarray(dense.target_logit), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("variant", ["tied_proj", "tied_3_clusters", "untied", "softmax_only"])
@pytest.mark.parametrize("rows", [0.05, 0.7])
@pytest.mark.parametrize("vocab_chunk", [0, 7])
def test_tail_rows_only_give_the_same_numbers_and_gradients(variant, rows, vocab_chunk):
  """model.adaptive_tail_rows < 1 (the original's way: a tail for the rows whose targets are in it): the same
  norm_t, target terms (the model's and the criterion's) and gradients in every parameter and feature as every
  row's tails, through both branches: 0.05 (capacity 2 of 36 rows, fewer than any tail has: every row) and 0.7
  (capacity 26: the tail rows gathered), padding included."""
  rng = np.random.default_rng(4)
  t = rng.integers(0, V, (2, 18))
  t[1, -3:] = -1
  f = jnp.asarray(_features(rng, 36, scale=2.0).reshape(2, 18, 16))
  cap = int(np.ceil(rows * t.size))
  band = sum((t >= c).astype(int) for c in VARIANTS[variant]["adaptive_cutoffs"])
  counts = [int((band == i + 1).sum()) for i in range(len(VARIANTS[variant]["adaptive_cutoffs"]))]
  assert all(c > cap for c in counts) if rows < 0.1 else all(0 < c <= cap for c in counts), (counts, cap)

  def value_and_grads(tail_rows):
    graphdef, params = nnx.split(_model(variant, seed=5, adaptive_tail_rows=tail_rows), nnx.Param)

    def objective(p, f):
      stats, crit = nnx.merge(graphdef, p).vocab_stats(f, jnp.asarray(t), vocab_chunk=vocab_chunk,
                                                       criterion="both")
      w = jnp.arange(t.size, dtype=jnp.float32).reshape(t.shape) / t.size  # every row weighed differently
      return jnp.sum(w * (stats.target_logit - stats.log_normalizer + 0.5 * crit)), (stats, crit)

    (value, aux), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(params, f)
    return value, aux, grads

  want, (want_stats, want_crit), want_grads = value_and_grads(1.0)
  got, (got_stats, got_crit), got_grads = value_and_grads(rows)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for a, b in [(got_stats.log_normalizer, want_stats.log_normalizer), (got_stats.target_logit,
                                                                       want_stats.target_logit), (got_crit, want_crit)]:
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  leaves = jax.tree_util.tree_leaves_with_path(got_grads)
  assert [p for p, _ in leaves] == [p for p, _ in jax.tree_util.tree_leaves_with_path(want_grads)]
  for (path, g), w in zip(leaves, jax.tree_util.tree_leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_tail_rows_only_with_dropout_draw_the_same_keys():
  """In training the tails' dropout keys are drawn before the branch, from the same stream positions as the
  every-row path draws them (the gathered rows' masks are other draws of the same distribution)."""
  rng = np.random.default_rng(7)
  t = jnp.asarray(rng.integers(0, V, (1, 20)))
  f = _features(rng, 20).reshape(1, 20, 16)
  counts = []
  for rows in (1.0, 0.8):
    stream = nnx.Rngs(dropout=3)
    model = _model("tied_3_clusters", seed=6, adaptive_softmax_dropout=0.5, adaptive_tail_rows=rows)
    out = model.vocab_stats(f, t, deterministic=False, rngs=stream)
    assert np.isfinite(np.asarray(out.target_logit)).all()
    counts.append(int(stream.dropout.count[...]))
  assert counts[0] == counts[1] == 4  # the input's dropout and one per tail


@pytest.mark.parametrize("vocab_chunk", [0, 2400])
def test_tail_rows_only_shrink_the_memory_plan(vocab_chunk):
  """XLA's plan of a gradient with r = 0.25 holds about a quarter of the tails' logits: a static plan must fit
  whichever lax.cond branch runs, so the every-row fallback computes its tails in chunks of r · (vocab_chunk or
  V_i) words. Without that, the fallback's [N, V_i] logits (and its residuals, zero-filled when the gathered
  branch runs) made the plan larger than r = 1's. Targets are an argument, so the branch is not decided at
  compile time."""
  n, v = 1024, 6000

  def temp_bytes(rows):
    model = M.TransformerLM(M.ModelConfig(vocab_size=v, num_layers=1, d_model=32, num_heads=2, d_ff=32, max_len=n,
                                          dropout=0.0, adaptive_input=True, adaptive_softmax=True,
                                          adaptive_cutoffs=(200, 1000), adaptive_input_factor=1.0,
                                          adaptive_softmax_factor=1.0, adaptive_tail_rows=rows), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def objective(p, f, t):
      stats = nnx.merge(graphdef, p).vocab_stats(f, t, vocab_chunk=vocab_chunk)
      return jnp.sum(stats.target_logit - stats.log_normalizer)

    args = (params, jax.ShapeDtypeStruct((1, n, 32), jnp.float32), jax.ShapeDtypeStruct((1, n), jnp.int32))
    compiled = jax.jit(jax.grad(objective, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  every_row, quarter = temp_bytes(1.0), temp_bytes(0.25)
  assert quarter < every_row / 2, (quarter, every_row)


def test_tail_rows_config_checks(monkeypatch):
  from trime_jax.errors import ConfigError
  from trime_jax.train_config import validate_config
  from tests.test_speed_options import tiny

  with pytest.raises(ValueError, match=r"model.adaptive_tail_rows must be in \(0, 1\], got 0.0"):
    _cfg(adaptive_tail_rows=0.0)
  with pytest.raises(ConfigError, match=r"applies to the Transformer's adaptive softmax only"):
    validate_config(tiny(**{"model.adaptive_tail_rows": 0.5}))
  adaptive = {"model.adaptive_input": True, "model.adaptive_softmax": True, "model.adaptive_cutoffs": (16, 32),
              "model.adaptive_tail_rows": 0.5}
  validate_config(tiny(**adaptive))
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  with pytest.raises(ConfigError, match=r"^model.adaptive_tail_rows < 1 runs on one device for now \(8 here"):
    validate_config(tiny(**adaptive))
