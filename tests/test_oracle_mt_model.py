"""TrimeMT against the original's code: one training step of the TRIME release's machine-translation fork
(`transformer_iwslt_de_en` with --share-decoder-input-output-embed --decoder-normalize-before, criterion
trime_mt_loss --dist-func ip --temp 10 --topk-mem 8), run in float64 on a tiny model by
tests/oracle/dump_mt_model.py: its parameters loaded into `TransformerMT` (configs/iwslt_de_en.py's layout:
separate dictionaries, post-norm encoder, pre-norm decoder, key = the decoder output), the same four sentence
pairs through `mt.train.mt_nll`: every target token's log-probability, the summed loss and every parameter's
gradient equal the original's, to float32 rounding (ATOL)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trime_jax import loss
from trime_jax.mt import train as mt_train
from trime_jax.mt.model import MTConfig, TransformerMT

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "mt_model_step.npz")
# Both sides run in float64, but for two float32 steps: the sinusoidal position tables (fairseq computes its table
# in float32, then casts it; ours is float32, from XLA's sin / cos rather than torch's: ~1 ulp apart) and our
# logits' float32 accumulation (TransformerMT.logits). Measured: 4.6e-7 nats per token at most, gradients within
# 1.3e-7 of their largest entry. A modelling difference (a LayerNorm's place, the key, a scale) is 1e-2 or more.
ATOL = 2e-6


def _joint_ids(fx):
  """fairseq source ids -> ours: the joint vocabulary holds the target dictionary first (ids unchanged), then the
  source-only words (data.dictionaries="separate"); the four specials are shared."""
  tv, sv = int(fx["tgt_vocab"]), int(fx["src_vocab"])
  return np.concatenate([np.arange(4), tv + np.arange(sv - 4)])  # [src_vocab]


def _attention(fx, pre, grad=False):
  """fairseq MultiheadAttention (q_proj, k_proj, v_proj, out_proj; torch [out, in]) as ours (q, kv = [k | v],
  out; kernels [in, out])."""
  w = lambda n: fx[("grad/" if grad else "param/") + pre + n]
  return {"q.kernel": w("q_proj.weight").T, "q.bias": w("q_proj.bias"),
          "kv.kernel": np.concatenate([w("k_proj.weight").T, w("v_proj.weight").T], axis=1),
          "kv.bias": np.concatenate([w("k_proj.bias"), w("v_proj.bias")]),
          "out.kernel": w("out_proj.weight").T, "out.bias": w("out_proj.bias")}


def _ours_from_original(fx, grad=False):
  """{our parameter path: array} from the original's state_dict (or its gradients)."""
  w = lambda n: fx[("grad/" if grad else "param/") + n]
  out = {}
  src = np.zeros((int(fx["tgt_vocab"]) + int(fx["src_vocab"]) - 4, w("encoder.embed_tokens.weight").shape[1]))
  src[_joint_ids(fx)] = w("encoder.embed_tokens.weight")
  out["src_embed.embedding"] = src
  out["tgt_embed.embedding"] = w("decoder.embed_tokens.weight")  # = decoder.output_projection.weight (shared)
  ln = lambda ours, theirs: {f"{ours}.scale": w(theirs + ".weight"), f"{ours}.bias": w(theirs + ".bias")}
  lin = lambda ours, theirs: {f"{ours}.kernel": w(theirs + ".weight").T, f"{ours}.bias": w(theirs + ".bias")}
  for i in range(2):
    e, d = f"encoder.layers.{i}.", f"decoder.layers.{i}."
    out.update({f"encoder.{i}.self_attn.{k}": v for k, v in _attention(fx, e + "self_attn.", grad).items()})
    out.update(ln(f"encoder.{i}.self_attn_norm", e + "self_attn_layer_norm"))
    out.update(ln(f"encoder.{i}.ffn_norm", e + "final_layer_norm"))
    out.update(lin(f"encoder.{i}.ffn.fc1", e + "fc1"))
    out.update(lin(f"encoder.{i}.ffn.fc2", e + "fc2"))
    out.update({f"decoder.{i}.self_attn.{k}": v for k, v in _attention(fx, d + "self_attn.", grad).items()})
    out.update({f"decoder.{i}.cross_attn.{k}": v for k, v in _attention(fx, d + "encoder_attn.", grad).items()})
    out.update(ln(f"decoder.{i}.self_attn_norm", d + "self_attn_layer_norm"))
    out.update(ln(f"decoder.{i}.cross_attn_norm", d + "encoder_attn_layer_norm"))
    out.update(ln(f"decoder.{i}.ffn_norm", d + "final_layer_norm"))
    out.update(lin(f"decoder.{i}.ffn.fc1", d + "fc1"))
    out.update(lin(f"decoder.{i}.ffn.fc2", d + "fc2"))
  out.update(ln("decoder_norm", "decoder.layer_norm"))
  return out


def _path(keys) -> str:
  """A parameter's dotted name from its tree path (the Variable's own `.value` leaf left out)."""
  parts = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)
  return ".".join(p for p in parts if p not in ("", "value"))


def test_one_training_step_equals_the_originals_per_token_loss_and_every_gradient():
  """Source rows right-padded here, left-padded in the original (fairseq's default; positions count real tokens
  either way). The source embedding rows of target-only words get no gradient in either."""
  fx = np.load(FIXTURE)
  pad = int(fx["pad"])
  cfg = MTConfig(vocab_size=int(fx["tgt_vocab"]) + int(fx["src_vocab"]) - 4, tgt_vocab_size=int(fx["tgt_vocab"]),
                 d_model=16, num_heads=4, d_ff=32, encoder_layers=2, decoder_layers=2, dropout=0.0, pad_id=pad,
                 share_decoder_embeddings=True, share_all_embeddings=False, encoder_normalize_before=False,
                 decoder_normalize_before=True, key_type="final", dtype="float64")
  src = np.full(fx["src"].shape, pad, np.int64)
  joint = _joint_ids(fx)
  for b, n in enumerate(fx["src_lens"]):  # left-padded -> right-padded, ids into the joint vocabulary
    src[b, :n] = joint[fx["src"][b, fx["src"].shape[1] - n:]]
  targets = np.where(fx["tgt"] == pad, -1, fx["tgt"])
  spec = loss.ObjectiveSpec(memory="ext", tau=10.0, memory_topk=8)
  with jax.enable_x64(True):
    model = TransformerMT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    theirs = _ours_from_original(fx)
    flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    assert {_path(k) for k in flat} == set(theirs), sorted({_path(k) for k in flat} ^ set(theirs))
    params = jax.tree_util.tree_map_with_path(lambda k, v: jnp.asarray(theirs[_path(k)], jnp.float64), params)
    batch = {"src": jnp.asarray(src), "prev": jnp.asarray(fx["prev"]), "targets": jnp.asarray(targets)}

    def objective(p):
      return mt_train.mt_nll(nnx.merge(graphdef, p), batch, spec, use_trime=True)[0]

    value, grads = jax.value_and_grad(objective)(params)
    m = nnx.merge(graphdef, params)
    enc = m.encode(batch["src"])
    f, g = m.decode(enc, batch["src"], batch["prev"])
    stats = m.vocab_stats(f, batch["targets"])
    per_token = np.asarray(loss.trime_nll_from_vocab_stats(stats, g, batch["targets"], spec, drop_local=True))
  real = targets >= 0
  np.testing.assert_allclose(-per_token[real], fx["lprobs"][real], rtol=0, atol=ATOL)
  assert abs(float(value) - float(fx["loss"])) < ATOL
  want = _ours_from_original(fx, grad=True)
  got = {_path(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
  for name, g_want in want.items():  # relative to each gradient's largest entry
    np.testing.assert_allclose(got[name], g_want, rtol=0, atol=ATOL * max(1.0, np.abs(g_want).max()), err_msg=name)
