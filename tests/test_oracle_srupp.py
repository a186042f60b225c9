"""SRU++ against the original: the enwik8 SRU++ LM of asappresearch/sru (branch 3.0.0-dev-tao, the branch whose
README commands the config follows: experiments/srupp_experiments/train_enwik8.py `Model`, sru/modules.py
`SRUpp`), tiny, run on CPU by tests/oracle/dump_srupp.py exactly as its `eval_model` evaluates (its hidden state
and attention memory carried from segment to segment, `set_mask(unroll, same_length=True)`). Its weights are
loaded into trime-jax's `SRUppLM`, and every token's loss over three consecutive segments must equal the
original's."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trime_jax.srupp import SRUppConfig, SRUppLM

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "srupp_tao_enwik8_tiny.npz")
UNROLL = 16  # the dump's --unroll_size (= its eval_unroll_size)


def _load_original(model: SRUppLM, fx) -> None:
  """The original's state_dict into `model` (torch Linear weights are [out, in]: transposed)."""
  p = lambda name: jnp.asarray(fx["param/" + name])
  model.embed.embedding[...] = p("embedding_layer.weight")
  model.out_weight[...] = p("output_layer.weight")
  model.out_bias[...] = p("output_layer.bias")
  for i, layer in enumerate(model.layers):
    pre = f"rnn.rnn_lst.{i}."
    t = layer.transform
    t.linear1.kernel[...] = p(pre + "transform_module.linear1.weight").T
    if layer.attention:  # SRUppAttention: linear1, linear2 (k, v), linear3, alpha
      t.linear2.kernel[...] = p(pre + "transform_module.linear2.weight").T
      t.linear3.kernel[...] = p(pre + "transform_module.linear3.weight").T
      t.alpha[...] = p(pre + "transform_module.alpha")
    else:  # SRUppProjectedLinear: its linear2 is our linear3 (d' -> 3d)
      t.linear3.kernel[...] = p(pre + "transform_module.linear2.weight").T
    t.norm.scale[...] = p(pre + "transform_module.layer_norm.weight")
    t.norm.bias[...] = p(pre + "transform_module.layer_norm.bias")
    layer.weight_c[...] = p(pre + "weight_c").reshape(2, -1)  # ops.py: weight_c.view(2, d) = [v_f; v_r]
    layer.bias[...] = p(pre + "bias").reshape(2, -1)


def test_every_token_equals_the_original_srupp_over_carried_segments():
  """3 layers (attention in the second: attention_every_n_layers=2, the others SRUppProjectedLinear), d = 32,
  d' = 8, α set to 0.7 so the attention term counts, 2 rows × 3 segments of 16 tokens: every token's loss
  within 1e-5 nats of the original's (4.8e-7 on 2026-12-07), and the last cell states equal. The original ran
  with `--layer_norm` (the tao README's commands), which there only picks the embedding's initialisation: the
  model has no per-layer pre-LN (model.srupp_layer_norm=False); with one, tokens differ by up to 0.047 nats.
  Evaluation attends to the same-length window (model.srupp_eval_same_length, the original's eval_model): with
  training's mask instead, the carried segments differ by up to 0.016 nats."""
  fx = np.load(FIXTURE)
  cfg = SRUppConfig(vocab_size=20, num_layers=3, d_model=32, attn_dim=8, num_heads=1, attention_every=2,
                    highway_bias=-2.0, layer_norm=False, attn_layer_norm=True, eval_same_length=True, dropout=0.1)
  model = SRUppLM(cfg, rngs=nnx.Rngs(0))
  assert [layer.attention for layer in model.layers] == [False, True, False]
  _load_original(model, fx)
  x, y = fx["x"].T, fx["y"].T  # the original's [T, B] streams as rows [B, T]
  carry = model.init_carry(x.shape[0], UNROLL)
  losses = []
  for a in range(0, x.shape[1], UNROLL):
    f, _, carry = model.features_carry(jnp.asarray(x[:, a:a + UNROLL]), carry, deterministic=True)
    logp = jax.nn.log_softmax(model.logits(f), axis=-1)
    losses.append(-np.take_along_axis(np.asarray(logp), y[:, a:a + UNROLL, None], axis=-1)[..., 0])
  ours = np.concatenate(losses, axis=1).T  # [T, B] as the original's
  np.testing.assert_allclose(ours, fx["loss"], rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.stack([np.asarray(c) for c in carry.c]), fx["final_c"], rtol=0, atol=1e-5)
