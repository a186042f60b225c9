"""The Transformer LM: shapes, the keys it returns, dropout, and the paper configs' parameter counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trime_jax import model as M


def _tiny(**kw):
  base = dict(vocab_size=50, num_layers=3, d_model=16, num_heads=2, d_ff=32, max_len=32, dropout=0.1)
  base.update(kw)
  return M.TransformerLM(M.ModelConfig(**base), rngs=nnx.Rngs(0))


def test_call_returns_logits_and_last_ffn_input_keys():
  model = _tiny()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 9)))
  logits, keys = model(tokens)
  assert logits.shape == (2, 9, 50) and keys.shape == (2, 9, 16)

  # Recompute by hand: the keys are LN_ffn(x) of the LAST block, x = that block's input + its attention.
  cfg = model.cfg
  x = model.embed(tokens) * math.sqrt(cfg.d_model) + M.sinusoidal_positions(9, cfg.d_model)[None]
  for block in model.blocks[:-1]:
    x, _ = block(x, deterministic=True, rngs=None)
  last = model.blocks[-1]
  x = x + last.attn(last.attn_norm(x), deterministic=True, rngs=None)
  ffn_input = last.ffn_norm(x)
  np.testing.assert_allclose(keys, ffn_input, rtol=1e-5, atol=1e-5)
  # The keys are normalised: zero mean, unit variance before the LayerNorm's affine (scale 1, bias 0 at init).
  np.testing.assert_allclose(np.asarray(keys).mean(-1), 0.0, atol=1e-4)
  # Logits are f · Eᵀ with f the final-normalised output, and the keys are not f.
  out = x + last.fc2(jax.nn.relu(last.fc1(ffn_input)))
  f = model.final_norm(out)
  np.testing.assert_allclose(logits, f @ model.embed.embedding[...].T, rtol=1e-4, atol=1e-4)
  assert not np.allclose(keys, f, atol=1e-3)


def test_key_type_final_returns_f_and_causality():
  model = _tiny(key_type="final")
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 50, (1, 12)))
  f, g = model.features(tokens)
  np.testing.assert_array_equal(f, g)
  # Causal: changing token 8 leaves positions < 8 unchanged.
  tokens2 = tokens.at[0, 8].set((tokens[0, 8] + 1) % 50)
  logits1, _ = model(tokens)
  logits2, _ = model(tokens2)
  np.testing.assert_allclose(logits1[0, :8], logits2[0, :8], atol=1e-6)
  assert not np.allclose(logits1[0, 8:], logits2[0, 8:])


def test_dropout_only_in_training_and_learned_untied_variant():
  model = _tiny(positions="learned", tie_embeddings=False, attention_dropout=0.2, activation_dropout=0.1)
  tokens = jnp.zeros((2, 6), jnp.int32)
  a, _ = model(tokens)
  b, _ = model(tokens)
  np.testing.assert_array_equal(a, b)
  c, _ = model(tokens, deterministic=False, rngs=nnx.Rngs(dropout=1))
  d, _ = model(tokens, deterministic=False, rngs=nnx.Rngs(dropout=2))
  assert not np.allclose(c, d)
  assert model.output_embedding().shape == (50, 16)
  with pytest.raises(ValueError, match="max_len"):
    model(jnp.zeros((1, 40), jnp.int32))


def _adaptive_embedding_params(vocab, d, cutoffs=(20_000, 60_000), factor=4):
  """Baevski & Auli adaptive input (tied with the adaptive softmax): band i has dim d / factor^i and a
  projection to d (none for the head band), plus the softmax head's two cluster vectors."""
  edges = (0,) + tuple(cutoffs) + (vocab,)
  total = 0
  for i in range(len(edges) - 1):
    dim = d // factor**i
    total += (edges[i + 1] - edges[i]) * dim + (dim * d if i else 0)
  return total + len(cutoffs) * d


@pytest.mark.parametrize("name,paper,adaptive_factor", [
    ("wiki103_247m", 247e6, 4), ("wiki103_150m", 150e6, 1), ("wiki103_7m", 7e6, 4), ("enwik8_38m", 38e6, None)])
def test_paper_configs_parameter_counts(name, paper, adaptive_factor):
  """Real shapes via jax.eval_shape (nothing allocated). With a full tied softmax the WT103 247M and 7M models
  are larger than the paper's, whose adaptive input/softmax (factor 4) shrinks the embedding; swapping our
  full embedding for the adaptive one's size must land within 10% of the paper's count."""
  import importlib

  cfg = importlib.import_module(f"configs.{name}").get_config()
  mcfg = M.ModelConfig.from_config(cfg.model)
  full = M.abstract_param_count(mcfg)
  embedding = mcfg.vocab_size * mcfg.d_model
  if adaptive_factor in (None, 1):  # no adaptive softmax, or factor 1 (a full-size embedding)
    assert abs(full - paper) / paper < 0.10, full
  else:
    adaptive = full - embedding + _adaptive_embedding_params(mcfg.vocab_size, mcfg.d_model, factor=adaptive_factor)
    assert abs(adaptive - paper) / paper < 0.10, adaptive
    assert full > 1.5 * paper  # the documented gap of the full softmax
