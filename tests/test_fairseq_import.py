"""Importing fairseq `transformer_lm` checkpoints (trime_jax/fairseq_import.py, launch/import_fairseq.py).

The tests write their own checkpoints: tiny models with fairseq's state-dict names and shapes (torch.save of
{"args" | "cfg", "model"}), and compare the imported model against float64 NumPy references written from the
release's module definitions (fairseq/models/transformer.py TransformerDecoder, modules/transformer_layer.py,
multihead_attention.py, adaptive_input.py, adaptive_softmax.py, sinusoidal_positional_embedding.py,
learned_positional_embedding.py, utils.make_positions) and of eval_lm's context-window scoring
(data/lm_context_window_dataset.py over TokenBlockDataset --sample-break-mode none). The references read the
spec a test wrote by hand, never the importer's interpretation of the flags.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trime_jax.configs import default
from tests import helpers
from trime_jax import exports
from trime_jax import corpora
from trime_jax import evaluate as E
from trime_jax import fairseq_import as FI
from trime_jax.model import TransformerLM
from trime_jax import specs

WORDS = ["the", ",", ".", "of", "alpha", "and", "in", "beta", "is", "a", "=", "article", "letter", "gamma",
         "first", "second", "about", "text", "some", "more", "section", "appears", "again", "once", "said", "mentions"]
V = len(WORDS) + 4  # 30: <s> <pad> </s> <unk> + dict.txt
SIZE = dict(decoder_layers=2, decoder_embed_dim=16, decoder_ffn_embed_dim=32, decoder_attention_heads=2,
            tokens_per_sample=24, max_target_positions=24)
# name -> (arch, storage, fused q/k/v, flags beyond SIZE, the model those flags mean, written by hand for the
# references: adaptive input/softmax, tied, tie_proj, learned positions, final norm, cutoffs, factor)
VARIANTS = {
    # the 247M's architecture at toy size: the arch's defaults give tied adaptive input/softmax with tied
    # projections, sinusoidal positions, no final norm; q, k, v stored fused (in_proj_weight) as older fairseq
    "wiki103": ("transformer_lm_wiki103", "args", True,
                dict(adaptive_input_cutoff="8,14,24", adaptive_softmax_cutoff="8,14,24", adaptive_input_factor=2,
                     adaptive_softmax_factor=2),
                dict(adaptive=True, softmax=True, tied=True, tie_proj=True, learned=False, final_norm=False,
                     cutoffs=(8, 14, 24), factor=2)),
    "tied_learned_cfg": ("transformer_lm", "cfg", False,
                         dict(adaptive_input=True, adaptive_input_cutoff="8,20", adaptive_softmax_cutoff="8,20",
                              adaptive_input_factor=2, adaptive_softmax_factor=2, tie_adaptive_weights=True,
                              decoder_learned_pos=True),
                         dict(adaptive=True, softmax=True, tied=True, tie_proj=False, learned=True, final_norm=True,
                              cutoffs=(8, 20), factor=2)),
    # untied adaptive input and softmax with different factors (fairseq allows it when nothing is tied)
    "adaptive_untied": ("transformer_lm", "args", False,
                        dict(adaptive_input=True, adaptive_input_cutoff="8,14", adaptive_softmax_cutoff="8,14",
                             adaptive_input_factor=2, adaptive_softmax_factor=4),
                        dict(adaptive=True, softmax=True, tied=False, tie_proj=False, learned=False, final_norm=True,
                             cutoffs=(8, 14), factor=2, sm_factor=4)),
    # enwik8's one band: cutoff = V, so the tied head is the whole softmax and class_proj is Linear(D, 0)
    "one_band": ("transformer_lm_enwik8", "args", False,
                 dict(adaptive_input=True, tie_adaptive_weights=True, adaptive_input_cutoff=str(V),
                      adaptive_softmax_cutoff=str(V), adaptive_input_factor=1, adaptive_softmax_factor=1),
                 dict(adaptive=True, softmax=True, tied=True, tie_proj=False, learned=False, final_norm=True,
                      cutoffs=(), factor=1)),
    "softmax_only": ("transformer_lm", "args", False, dict(adaptive_softmax_cutoff="10", adaptive_softmax_factor=2),
                     dict(adaptive=False, softmax=True, tied=False, tie_proj=False, learned=False, final_norm=True,
                          cutoffs=(10,), factor=2)),
    "plain_shared": ("transformer_lm", "args", False,
                     dict(share_decoder_input_output_embed=True, decoder_learned_pos=True),
                     dict(adaptive=False, softmax=False, tied=True, tie_proj=False, learned=True, final_norm=True,
                          cutoffs=(), factor=1)),
    "plain_untied": ("transformer_lm_wiki103_150M", "args", True, dict(no_decoder_final_norm=True),
                     dict(adaptive=False, softmax=False, tied=False, tie_proj=False, learned=False, final_norm=False,
                          cutoffs=(), factor=1)),
}


def import_torch():
  """torch, which `make test` installs (a pinned CPU wheel, outside the [test] extra: see the Makefile). Without it
  these tests fail with what to install; they are not skipped."""
  try:
    import torch
  except ImportError:
    pytest.fail("torch is not installed: the fairseq tests need it (`make test` installs torch==2.13.0)")
  return torch


@pytest.fixture(scope="module")
def torch():
  return import_torch()


def write_dict(path, words=WORDS):
  with open(path, "w", encoding="utf-8") as f:
    for i, w in enumerate(words):
      f.write(f"{w} {1000 - i}\n")
  return str(path)


# ----------------------------------------------------------------------------------------------------------
# A fairseq state dict: names and shapes of the release's modules, random values
# ----------------------------------------------------------------------------------------------------------
def fairseq_state(spec, seed=0, fused=False):
  """{name: float64 array} as TransformerLanguageModel.state_dict() names it (tied tensors under every name
  that registers them, buffers included)."""
  rng = np.random.default_rng(seed)
  d, ff, n_layers = SIZE["decoder_embed_dim"], SIZE["decoder_ffn_embed_dim"], SIZE["decoder_layers"]
  w = lambda *shape, s=0.4: rng.normal(0.0, s, shape)  # noqa: E731
  sd = {"decoder.version": np.array([3.0])}
  edges = (0,) + spec["cutoffs"] + (V,)
  dims = [int(d // spec["factor"] ** i) for i in range(len(edges) - 1)]
  if spec["adaptive"]:
    for i in range(len(edges) - 1):
      sd[f"decoder.embed_tokens.embeddings.{i}.0.weight"] = w(edges[i + 1] - edges[i], dims[i], s=0.5)  # Embedding
      sd[f"decoder.embed_tokens.embeddings.{i}.1.weight"] = w(d, dims[i], s=0.3)  # Linear(dim, D, bias=False)
    sd["decoder.embed_tokens._float_tensor"] = np.zeros(1)
  else:
    sd["decoder.embed_tokens.weight"] = w(V, d, s=0.3)
  if spec["learned"]:
    sd["decoder.embed_positions.weight"] = w(SIZE["max_target_positions"] + 2, d, s=0.3)
  else:
    sd["decoder.embed_positions._float_tensor"] = np.zeros(1)
  for l in range(n_layers):
    p = f"decoder.layers.{l}."
    qkv = {x: (w(d, d, s=0.35), w(d, s=0.1)) for x in "qkv"}
    if fused:
      sd[p + "self_attn.in_proj_weight"] = np.concatenate([qkv[x][0] for x in "qkv"])
      sd[p + "self_attn.in_proj_bias"] = np.concatenate([qkv[x][1] for x in "qkv"])
    else:
      for x in "qkv":
        sd[p + f"self_attn.{x}_proj.weight"], sd[p + f"self_attn.{x}_proj.bias"] = qkv[x]
    sd[p + "self_attn.out_proj.weight"], sd[p + "self_attn.out_proj.bias"] = w(d, d, s=0.3), w(d, s=0.1)
    for ln in ("self_attn_layer_norm", "final_layer_norm"):
      sd[p + f"{ln}.weight"], sd[p + f"{ln}.bias"] = 1.0 + w(d, s=0.2), w(d, s=0.1)
    sd[p + "fc1.weight"], sd[p + "fc1.bias"] = w(ff, d, s=0.3), w(ff, s=0.1)
    sd[p + "fc2.weight"], sd[p + "fc2.bias"] = w(d, ff, s=0.3), w(d, s=0.1)
  if spec["final_norm"]:
    sd["decoder.layer_norm.weight"], sd["decoder.layer_norm.bias"] = 1.0 + w(d, s=0.2), w(d, s=0.1)
  if spec["softmax"]:
    k = len(spec["cutoffs"])
    sm = "decoder.adaptive_softmax."
    sd[sm + "version"] = np.array([1.0])
    if spec["tied"]:  # TiedHeadModule(word_proj = TiedLinear(E_0), class_proj = Linear(D, k))
      sd[sm + "head.word_proj.weight"] = sd["decoder.embed_tokens.embeddings.0.0.weight"]
      sd[sm + "head.class_proj.weight"] = w(k, d, s=0.4)
      sd[sm + "head._float_tensor"] = np.zeros(1)
    else:
      sd[sm + "head.weight"] = w(edges[1] + k, d, s=0.4)
    for i in range(k):
      dim = int(d // spec.get("sm_factor", spec["factor"]) ** (i + 1))
      if spec["tied"] and spec["tie_proj"]:  # TiedLinear(P_{i+1} [D, dim], transpose=True)
        sd[sm + f"tail.{i}.0.weight"] = sd[f"decoder.embed_tokens.embeddings.{i + 1}.1.weight"]
      else:  # Linear(D, dim)
        sd[sm + f"tail.{i}.0.weight"] = w(dim, d, s=0.4)
      if spec["tied"]:  # TiedLinear(E_{i+1})
        sd[sm + f"tail.{i}.2.weight"] = sd[f"decoder.embed_tokens.embeddings.{i + 1}.0.weight"]
      else:
        sd[sm + f"tail.{i}.2.weight"] = w(edges[i + 2] - edges[i + 1], dim, s=0.5)
  elif not spec["tied"]:
    sd["decoder.embed_out"] = w(V, d, s=0.3)
  return sd


def write_checkpoint(torch, path, name, *, sd=None, extra_flags=None, drop=()):
  arch, storage, fused, flags, spec = VARIANTS[name]
  sd = fairseq_state(spec, fused=fused) if sd is None else sd
  flags = {"arch": arch, **SIZE, **flags, "optimizer": "nag", "lr": [1.0], "knn_keytype": None,
           "knn_sim_func": None, "sample_break_mode": "none", "seed": 1, **(extra_flags or {})}
  model = {k: torch.tensor(v, dtype=torch.float32) for k, v in sd.items() if k not in drop}
  if storage == "args":
    state = {"args": argparse.Namespace(**flags), "model": model}
  else:  # newer fairseq: args None, cfg["model"] (a dict here; OmegaConf in fairseq) with the arch as _name
    mflags = {("_name" if k == "arch" else k): v for k, v in flags.items() if k != "tokens_per_sample"}
    state = {"args": None, "cfg": {"model": mflags, "task": {"tokens_per_sample": flags["tokens_per_sample"]}},
             "model": model}
  state.update(optimizer_history=[{"num_updates": 5}], extra_state={"epoch": 1, "val_loss": 3.2})
  torch.save(state, str(path))
  return str(path)


# ----------------------------------------------------------------------------------------------------------
# Float64 NumPy restatement of fairseq's TransformerDecoder forward (eval mode) from the state dict
# ----------------------------------------------------------------------------------------------------------
def _layer_norm(x, g, b, eps=1e-5):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * g + b


def _logsumexp(x):
  m = x.max(-1)
  return m + np.log(np.exp(x - m[..., None]).sum(-1))


def _log_softmax(x):
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def sinusoidal_table(n, dim, padding_idx=1):
  """SinusoidalPositionalEmbedding.get_embedding: [sin | cos], log(10000)/(half-1), padding row zero."""
  half = dim // 2
  freq = np.exp(np.arange(half) * -(math.log(10000) / (half - 1)))
  ang = np.arange(n)[:, None] * freq[None, :]
  emb = np.concatenate([np.sin(ang), np.cos(ang)], axis=1)
  if dim % 2:
    emb = np.concatenate([emb, np.zeros((n, 1))], axis=1)
  emb[padding_idx] = 0
  return emb


def fairseq_forward(sd, spec, tokens_BxT, pad=1, with_norm=False):
  """(log-probs [B, T, V], last_ffn_input [B, T, D], output logits [B, T, V] (full softmax; else None)), and with
  `with_norm` the scorer's norm_t [B, T]: logsumexp of the output logits (adaptive: of the head's)."""
  sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
  heads = SIZE["decoder_attention_heads"]
  b, t = tokens_BxT.shape
  d = SIZE["decoder_embed_dim"]
  edges = (0,) + spec["cutoffs"] + (V,)
  # embed_tokens (AdaptiveInput.forward: band i -> Linear_i(Embedding_i(w - c_i))) scaled by sqrt(D)
  if spec["adaptive"]:
    x = np.zeros((b, t, d))
    for i in range(len(edges) - 1):
      m = (tokens_BxT >= edges[i]) & (tokens_BxT < edges[i + 1])
      e = sd[f"decoder.embed_tokens.embeddings.{i}.0.weight"][tokens_BxT[m] - edges[i]]
      x[m] = e @ sd[f"decoder.embed_tokens.embeddings.{i}.1.weight"].T
  else:
    x = sd["decoder.embed_tokens.weight"][tokens_BxT]
  x = x * math.sqrt(d)
  # utils.make_positions: non-padding tokens numbered from padding_idx + 1
  nonpad = tokens_BxT != pad
  positions = np.cumsum(nonpad, axis=1) * nonpad + pad
  table = sd["decoder.embed_positions.weight"] if spec["learned"] else sinusoidal_table(pad + 1 + t, d, pad)
  x = x + table[positions]
  causal = np.triu(np.full((t, t), -np.inf), 1)  # buffered_future_mask
  key = None
  for l in range(SIZE["decoder_layers"]):
    p = f"decoder.layers.{l}."
    if p + "self_attn.in_proj_weight" in sd:  # older checkpoints: q, k, v stacked in one tensor
      wq, wk, wv = np.split(sd[p + "self_attn.in_proj_weight"], 3)
      bq, bk, bv = np.split(sd[p + "self_attn.in_proj_bias"], 3)
    else:
      (wq, bq), (wk, bk), (wv, bv) = [(sd[p + f"self_attn.{n}_proj.weight"], sd[p + f"self_attn.{n}_proj.bias"])
                                      for n in "qkv"]
    residual = x
    h = _layer_norm(x, sd[p + "self_attn_layer_norm.weight"], sd[p + "self_attn_layer_norm.bias"])
    hd = d // heads
    q = (h @ wq.T + bq) * hd ** -0.5
    k, v = h @ wk.T + bk, h @ wv.T + bv
    split = lambda a: a.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)  # noqa: E731
    att = split(q) @ split(k).transpose(0, 1, 3, 2) + causal
    att = np.where(nonpad[:, None, None, :] | ~nonpad.any(), att, -np.inf)  # key_padding_mask when pads exist
    att = np.exp(att - att.max(-1, keepdims=True))
    att = att / att.sum(-1, keepdims=True)
    y = (att @ split(v)).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = residual + y @ sd[p + "self_attn.out_proj.weight"].T + sd[p + "self_attn.out_proj.bias"]
    residual = x
    h = _layer_norm(x, sd[p + "final_layer_norm.weight"], sd[p + "final_layer_norm.bias"])
    key = h  # ret_ffn_inp of the last layer
    h = np.maximum(h @ sd[p + "fc1.weight"].T + sd[p + "fc1.bias"], 0.0)
    x = residual + h @ sd[p + "fc2.weight"].T + sd[p + "fc2.bias"]
  if spec["final_norm"]:
    x = _layer_norm(x, sd["decoder.layer_norm.weight"], sd["decoder.layer_norm.bias"])
  f = x.reshape(b * t, d)
  if not spec["softmax"]:
    w = sd["decoder.embed_tokens.weight"] if spec["tied"] else sd["decoder.embed_out"]
    logits = f @ w.T
    out = _log_softmax(logits).reshape(b, t, V), key, logits.reshape(b, t, V)
    return out + (_logsumexp(logits).reshape(b, t),) if with_norm else out
  # AdaptiveSoftmax.get_log_prob, reading the modules' own (possibly tied) weights
  sm = "decoder.adaptive_softmax."
  k = len(spec["cutoffs"])
  if spec["tied"]:
    head = np.concatenate([f @ sd[sm + "head.word_proj.weight"].T, f @ sd[sm + "head.class_proj.weight"].T], 1)
  else:
    head = f @ sd[sm + "head.weight"].T
  out = np.zeros((b * t, V))
  head_lp = _log_softmax(head)
  out[:, :edges[1]] = head_lp[:, :edges[1]]
  for i in range(k):
    proj = sd[sm + f"tail.{i}.0.weight"]
    hid = f @ proj if (spec["tied"] and spec["tie_proj"]) else f @ proj.T  # TiedLinear(transpose=True) vs Linear
    tail = hid @ sd[sm + f"tail.{i}.2.weight"].T
    out[:, edges[i + 1]:edges[i + 2]] = _log_softmax(tail) + head_lp[:, edges[1] + i, None]
  res = out.reshape(b, t, V), key, None
  return res + (_logsumexp(head).reshape(b, t),) if with_norm else res


# ----------------------------------------------------------------------------------------------------------
# The imported model
# ----------------------------------------------------------------------------------------------------------
def imported_model(imp):
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(imp.cfg, rngs=nnx.Rngs(0))), nnx.Param)
  return nnx.merge(graphdef, imp.params)


def sample_tokens(t=20, b=2, seed=3):
  """Tokens of every band (no padding id, as a corpus never holds <pad>)."""
  rng = np.random.default_rng(seed)
  ids = np.array([0, 2, 3] + list(range(4, V)))
  toks = rng.choice(ids, size=(b, t))
  toks[0, :V - 4] = np.arange(4, V)[:t] if t < V - 4 else toks[0, :V - 4]
  return toks.astype(np.int32)


def compare(model, sd, spec, tokens):
  """Max relative errors of (log-probs, keys, logits or None, target log-probs) against the reference."""
  logits, keys = model(jnp.asarray(tokens))
  f, g = model.features(jnp.asarray(tokens))
  targets = np.roll(tokens, -1, axis=1)
  stats = model.vocab_stats(f, jnp.asarray(targets))
  ref_lp, ref_key, ref_logits = fairseq_forward(sd, spec, tokens)
  lp = np.asarray(jax_log_softmax(logits), np.float64)
  rel = lambda a, r: float(np.max(np.abs(a - r)) / np.max(np.abs(r)))  # noqa: E731
  tgt = np.asarray(stats.target_logit - stats.log_normalizer, np.float64)
  ref_tgt = np.take_along_axis(ref_lp, targets[..., None], -1)[..., 0]
  return (rel(lp, ref_lp), rel(np.asarray(keys, np.float64), ref_key),
          None if ref_logits is None else rel(np.asarray(logits, np.float64), ref_logits), rel(tgt, ref_tgt))


def jax_log_softmax(x):
  import jax

  return jax.nn.log_softmax(x, axis=-1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_import_equals_fairseq_forward(torch, tmp_path, name):
  """Log-probabilities, keys (last-FFN input), logits (full softmax) and the target log-probs of the loss
  path equal the float64 restatement of fairseq's forward (float32: ~1e-5 relative)."""
  arch, storage, fused, flags, spec = VARIANTS[name]
  path = write_checkpoint(torch, tmp_path / "checkpoint_best.pt", name)
  imp = FI.import_checkpoint(path, write_dict(tmp_path / "dict.txt"))
  c = imp.cfg
  assert (c.adaptive_input, c.adaptive_softmax, c.tie_embeddings, c.tie_adaptive_proj, c.positions == "learned",
          c.final_norm, c.adaptive_cutoffs) == (spec["adaptive"], spec["softmax"], spec["tied"], spec["tie_proj"],
                                                spec["learned"], spec["final_norm"], spec["cutoffs"])
  assert c.position_offset == 2 and c.vocab_size == V and c.key_type == "last_ffn_input"
  errs = compare(imported_model(imp), fairseq_state(spec, fused=fused), spec, sample_tokens())
  assert max(e for e in errs if e is not None) < 1e-5, errs


@pytest.mark.parametrize("config_name,flags", [
    ("wiki103_247m", dict(arch="transformer_lm_wiki103", tokens_per_sample=3072)),
    ("wiki103_150m", dict(arch="transformer_lm_wiki103_150M", tokens_per_sample=150, adaptive_input=True,
                          tie_adaptive_weights=True, adaptive_input_cutoff="20000,60000",
                          adaptive_softmax_cutoff="20000,60000", adaptive_softmax_factor=1, adaptive_input_factor=1)),
    ("enwik8_38m", dict(arch="transformer_lm_enwik8", tokens_per_sample=512, adaptive_input=True,
                        tie_adaptive_weights=True, adaptive_input_cutoff="208", adaptive_softmax_cutoff="208",
                        adaptive_softmax_factor=1, adaptive_input_factor=1)),
])
def test_release_architectures_read_as_the_paper_configs(config_name, flags):
  """The import's reading of a training script's flags (arch defaults included) is the model that the paper
  configs (configs/*.py, written from the same scripts independently) define; dtype aside (the configs
  train in bfloat16), and enwik8's vocabulary (fairseq's 208-symbol dict vs our 256 bytes)."""
  import importlib

  config = importlib.import_module(f"trime_jax.configs.{config_name}").get_config()
  v = 208 if config_name == "enwik8_38m" else config.model.vocab_size
  got = FI.model_config(FI.complete_flags({**flags, "knn_keytype": "last_ffn_input"}),
                        {"decoder.version": np.array([3.0])}, v)
  want = specs.model_config(config, vocab_size=v)
  assert dataclasses.replace(got, dtype=want.dtype) == want


def test_sinusoidal_positions_are_fairseqs():
  """model.sinusoidal_positions is fairseq's get_embedding (rows from padding_idx + 1 on are all a model
  reads; fairseq's padding row 1 is zero, ours is never looked up)."""
  from trime_jax.model import sinusoidal_positions

  for dim in (16, 15, 410):
    ours = np.asarray(sinusoidal_positions(600, dim), np.float64)
    ref = sinusoidal_table(600, dim)
    np.testing.assert_allclose(ours[2:], ref[2:], atol=1e-4)  # float32 angles up to 600


def test_older_fairseq_names(torch, tmp_path):
  """Older checkpoints' layer_norms.0 / .2 and fused in_proj tensors import as fairseq's upgrade renames them;
  a decoder without `version` >= 3 has no final LayerNorm in fairseq, so one stored anyway is refused."""
  spec = VARIANTS["plain_shared"][4]
  sd = fairseq_state(spec, fused=True)
  old = {k.replace("self_attn_layer_norm", "layer_norms.0").replace("final_layer_norm", "layer_norms.2"): v
         for k, v in sd.items()}
  d = write_dict(tmp_path / "dict.txt")
  imp = FI.import_checkpoint(write_checkpoint(torch, tmp_path / "a.pt", "plain_shared", sd=old), d)
  errs = compare(imported_model(imp), sd, spec, sample_tokens())
  assert max(e for e in errs if e is not None) < 1e-5, errs
  path = write_checkpoint(torch, tmp_path / "b.pt", "plain_shared", sd=sd, drop=("decoder.version",))
  with pytest.raises(FI.ImportError_, match=r"do not explain.*decoder\.layer_norm\.(weight|bias)"):
    FI.import_checkpoint(path, d)


@pytest.mark.parametrize("mistake", ["qkv_order", "position_offset", "no_transpose"])
def test_a_wrong_mapping_fails(torch, tmp_path, monkeypatch, mistake):
  """The comparison can fail: a deliberately wrong mapping is caught by it."""
  name = "wiki103" if mistake != "no_transpose" else "plain_untied"
  arch, storage, fused, flags, spec = VARIANTS[name]
  path = write_checkpoint(torch, tmp_path / "c.pt", name)
  if mistake == "qkv_order":
    monkeypatch.setattr(FI, "QKV_ORDER", ("k", "q", "v"))
  elif mistake == "position_offset":
    monkeypatch.setattr(FI, "PADDING_IDX", 0)
  else:
    real = FI.state_dict_names  # out_proj is square: only the numbers can tell a missing transpose
    monkeypatch.setattr(FI, "state_dict_names", lambda cfg: {k: (n, "" if k.endswith("attn.out.kernel") else how)
                                                             for k, (n, how) in real(cfg).items()})
  imp = FI.import_checkpoint(path, write_dict(tmp_path / "dict.txt"))
  errs = compare(imported_model(imp), fairseq_state(spec, fused=fused), spec, sample_tokens())
  assert errs[0] > 1e-3, errs


# ----------------------------------------------------------------------------------------------------------
# Vocabulary and corpus ids
# ----------------------------------------------------------------------------------------------------------
def fairseq_encode_file(path, words):
  """Dictionary.encode_line(line, append_eos=True) for every line (binarizer over the token file)."""
  index = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + list(words))}
  ids = []
  for line in open(path, encoding="utf-8"):
    ids += [index.get(w, 3) for w in line.split()] + [2]
  return np.array(ids)


def wiki_config(root, **eval_overrides):
  c = default.get_config()
  c.data.corpus = "wikitext"
  c.data.path = str(root)
  for k, v in eval_overrides.items():
    setattr(c.eval, k, v)
  return c


def test_vocabulary_reproduces_fairseq_ids(tmp_path):
  vocab = FI.read_dictionary(write_dict(tmp_path / "dict.txt"))
  assert vocab.tokens[:4] == ["<s>", "<pad>", "</s>", "<unk>"] and vocab.tokens[4:] == WORDS
  assert (vocab.eos, vocab.unk, vocab.bos) == (2, 3, 2)  # fairseq feeds </s> before a stream's first token
  root = helpers.write_wikitext_dir(tmp_path / "wiki")
  splits = corpora.load_splits(wiki_config(root).data, vocab=vocab)
  expected = fairseq_encode_file(os.path.join(root, "wiki.valid.tokens"), WORDS)
  np.testing.assert_array_equal(np.asarray(splits.dev.tokens), expected)
  assert (expected == 3).any() and (expected == 2).any()  # OOV words and line ends occur


# ----------------------------------------------------------------------------------------------------------
# eval_lm's context-window perplexity
# ----------------------------------------------------------------------------------------------------------
def fairseq_blocks(stream, block_size, break_mode, eos=2):
  """TokenBlockDataset's (start, end) slices: none = fixed blocks; complete = whole lines (each ending with
  </s>) packed greedily up to block_size, a longer line alone (token_block_utils_fast.pyx)."""
  if break_mode == "none":
    return [(a, min(a + block_size, len(stream))) for a in range(0, len(stream), block_size)]
  ends = list(np.flatnonzero(np.asarray(stream) == eos) + 1)
  if not ends or ends[-1] != len(stream):
    ends.append(len(stream))
  out, a, cur = [], 0, 0
  for size in np.diff([0] + ends):
    if cur and cur + size > block_size:
      out.append((a, a + cur))
      a, cur = a + cur, 0
    cur += size
  return out + ([(a, a + cur)] if cur else [])


def fairseq_eval_lm_nll(sd, spec, stream, tokens_per_sample, context_window, pad=1, eos=2, local_tau=None,
                        break_mode="none"):
  """Mean nll of eval_lm --context-window C --tokens-per-sample T --sample-break-mode none|complete, batch 1.

  eval_lm cuts blocks of at most T - C targets (`fairseq_blocks`; source = the past target: </s> then the
  stream shifted), and LMContextWindowDataset prepends the previous samples' last non-pad source tokens, at
  most C and at most T - (block length), and pads the tail; only the block's own targets are scored. With `local_tau` the score is eval_lm-trime.py --use-local
  --softmax-temp τ (SequenceScorer.trime_generate, mode gn): every earlier position j of the same input is a
  memory, labelled with its target (context positions: the next source token), logit g_i·g_j/√D/τ, and
  log p = logsumexp(target logit, memories labelled y) - logsumexp(norm_t, all memories)."""
  s = tokens_per_sample - context_window
  source = np.concatenate([[eos], stream[:-1]])
  prev = np.zeros(0, np.int64)
  total, count = 0.0, 0
  for start, end in fairseq_blocks(stream, s, break_mode, eos):
    src, tgt = source[start:end], stream[start:end]
    extra = len(prev) + len(src) - tokens_per_sample
    if extra > 0:
      prev = prev[extra:]
    toks = np.concatenate([prev, src, np.full(tokens_per_sample - len(prev) - len(src), pad)])  # tail pads
    lp, key, _, norm_t = fairseq_forward(sd, spec, toks[None].astype(np.int64), with_norm=True)
    lp, key, norm_t = lp[0], key[0], norm_t[0]
    pos = len(prev) + np.arange(len(tgt))
    if local_tau is None:
      total -= lp[pos, tgt].sum()
    else:
      target = np.full(len(toks), pad)
      target[pos] = tgt
      labels = np.where(target == pad, np.roll(toks, -1), target)  # rep_labels: virtual labels at pads
      sims = key @ key.T / math.sqrt(key.shape[-1]) / local_tau
      edges = tuple(spec.get("cutoffs", ())) + (lp.shape[-1],)
      for i, y in zip(pos, tgt):
        j = np.arange(i)  # local_mask: strictly earlier positions
        lp_y = lp[i, y]
        for lo, hi in zip(edges[:-1], edges[1:]):  # the criterion's ignore_index=pad(1) on tail-relative targets:
          if y - lo == 1:  # the tail word at c_i + 1 keeps only its cluster's head probability
            lp_y = _logsumexp(lp[i, lo:hi])
        num = np.concatenate([[lp_y + norm_t[i]], sims[i, j[labels[j] == y]]])
        den = np.concatenate([[norm_t[i]], sims[i, j]])
        total -= _logsumexp(num) - _logsumexp(den)
    count += len(tgt)
    prev = toks[toks != pad][-context_window:]
  return total / count


@pytest.mark.parametrize("name,break_mode", [("wiki103", "none"), ("plain_shared", "none"),
                                             ("wiki103", "complete")])
def test_eval_of_import_equals_fairseq_eval_lm(torch, tmp_path, name, break_mode):
  """trime_jax.launch.eval's evaluation of the export = eval_lm's context-window perplexity (memory=none) and
  eval_lm-trime.py --use-local --softmax-temp τ (memory=local at τ, row trime_local), with fairseq's
  --sample-break-mode none, and complete (the released 247M evaluation: lines of 9 and 14 tokens exceed
  T - C = 8, so blocks of one long line get less context)."""
  arch, storage, fused, flags, spec = VARIANTS[name]
  export, _ = FI.import_to_export(write_checkpoint(torch, tmp_path / "c.pt", name),
                                  write_dict(tmp_path / "dict.txt"), str(tmp_path / "export"))
  root = helpers.write_wikitext_dir(tmp_path / "wiki")
  t, c, tau = SIZE["tokens_per_sample"], 16, 1.3
  cfg = wiki_config(root, block_len=t, context_window=c, memory="local", tau=tau, batch_size=2,
                    sample_break_mode=break_mode)
  rows = {r["family"]: r for r in E.evaluate_checkpoint(cfg, export)["rows"]}
  stream = fairseq_encode_file(os.path.join(root, "wiki.valid.tokens"), WORDS)
  sd = fairseq_state(spec, fused=fused)
  run = functools.partial(fairseq_eval_lm_nll, sd, spec, stream, t, c, break_mode=break_mode)
  for family, ref in (("none", run()), ("trime_local", run(local_tau=tau))):
    assert rows[family]["tokens"] == len(stream)
    assert abs(rows[family]["nll"] - ref) < 1e-5 * ref, (family, rows[family]["nll"], ref)
  assert abs(rows["trime_local"]["nll"] - rows["none"]["nll"]) > 1e-3  # the local memory changes the score
  if break_mode == "complete":  # and the windows differ from none mode's
    assert abs(run(local_tau=tau) - run(local_tau=tau, break_mode="none")) > 1e-4


def fairseq_dstore_keys(sd, spec, stream, tokens_per_sample, context_window, pad=1, eos=2):
  """eval_lm --save-knnlm-dstore's keys: last_ffn_input at each block's scored positions (same windows)."""
  s = tokens_per_sample - context_window
  source = np.concatenate([[eos], stream[:-1]])
  prev, keys = np.zeros(0, np.int64), []
  for start in range(0, len(stream), s):
    src = source[start:start + s]
    prev = prev[max(0, len(prev) + len(src) - tokens_per_sample):]
    toks = np.concatenate([prev, src, np.full(context_window - len(prev) + s - len(src), pad)])
    _, key, _ = fairseq_forward(sd, spec, toks[None].astype(np.int64))
    keys.append(key[0, len(prev):len(prev) + len(src)])
    prev = toks[toks != pad][-context_window:]
  return np.concatenate(keys)


def test_datastore_of_import_has_fairseqs_keys(torch, tmp_path):
  """trime_jax.launch.build_datastore's datastore of the export: fairseq's keys (float16) and next tokens."""
  from trime_jax.datastore import Datastore, build_datastore

  arch, storage, fused, flags, spec = VARIANTS["wiki103"]
  export, imp = FI.import_to_export(write_checkpoint(torch, tmp_path / "c.pt", "wiki103"),
                                    write_dict(tmp_path / "dict.txt"), str(tmp_path / "export"))
  root = helpers.write_wikitext_dir(tmp_path / "wiki")
  corpus = E.load_eval_data(wiki_config(root), exports.read_export_vocab(export)).train
  t, c = SIZE["tokens_per_sample"], 16
  build_datastore(export, corpus, str(tmp_path / "ds"), block_len=t, context_window=c, batch_size=2,
                  progress=False)
  ds = Datastore(str(tmp_path / "ds"))
  stream = fairseq_encode_file(os.path.join(root, "wiki.train.tokens"), WORDS)
  np.testing.assert_array_equal(np.asarray(ds.values).ravel(), stream)
  ref = fairseq_dstore_keys(fairseq_state(spec, fused=fused), spec, stream, t, c)
  np.testing.assert_allclose(np.asarray(ds.keys, np.float64), ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


# ----------------------------------------------------------------------------------------------------------
# One clear error per bad input
# ----------------------------------------------------------------------------------------------------------
def test_missing_torch_is_one_clear_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
  with pytest.raises(FI.ImportError_, match=r'pip install -e "\.\[fairseq\]"'):
    FI.load_checkpoint(str(tmp_path / "c.pt"))


@pytest.mark.parametrize("flag,value", [("activation_fn", "gelu"), ("decoder_foo_bar", 3), ("no_scale_embedding", True),
                                        ("arch", "transformer_lm_gpt"), ("layernorm_embedding", True),
                                        ("decoder_output_dim", 8), ("scale_fc", True), ("add_bos_token", True)])
def test_unknown_or_unsupported_flag_names_the_flag(torch, tmp_path, flag, value):
  path = write_checkpoint(torch, tmp_path / "c.pt", "plain_shared", extra_flags={flag: value})
  with pytest.raises(FI.ImportError_, match=flag):
    FI.import_checkpoint(path, write_dict(tmp_path / "dict.txt"))


def test_cutoffs(torch, tmp_path):
  """Cutoffs that end at V are fairseq's own; input and softmax cut differently is refused by name."""
  d = write_dict(tmp_path / "dict.txt")
  path = write_checkpoint(torch, tmp_path / "a.pt", "wiki103", extra_flags={"adaptive_input_cutoff": f"8,14,24,{V}"})
  assert FI.import_checkpoint(path, d).cfg.adaptive_cutoffs == (8, 14, 24)
  path = write_checkpoint(torch, tmp_path / "b.pt", "wiki103", extra_flags={"adaptive_softmax_cutoff": "8,20"})
  with pytest.raises(FI.ImportError_, match=r"adaptive_input_cutoff=\(8, 14, 24\) != adaptive_softmax_cutoff"):
    FI.import_checkpoint(path, d)


def test_unknown_flags_that_are_off_are_harmless(torch, tmp_path):
  """An unknown architecture flag left off (None / False / 0), and newer fairseq's memory switches, import."""
  path = write_checkpoint(torch, tmp_path / "c.pt", "plain_shared",
                          extra_flags={"decoder_foo_bar": 0, "adaptive_zzz": None, "checkpoint_activations": True,
                                       "quant_noise_pq": 0.0, "scale_fc": False, "decoder_layerdrop": 0.2})
  assert FI.import_checkpoint(path, write_dict(tmp_path / "dict.txt")).cfg.tie_embeddings


def test_dictionary_size_mismatch(torch, tmp_path):
  path = write_checkpoint(torch, tmp_path / "c.pt", "wiki103")
  with pytest.raises(FI.ImportError_, match="dictionary size mismatch.*29 symbols.*30 rows"):
    FI.import_checkpoint(path, write_dict(tmp_path / "dict.txt", WORDS[:-1]))


def test_bad_dictionary_lines(tmp_path):
  p = tmp_path / "dict.txt"
  p.write_text("the 5\nof\n")
  with pytest.raises(FI.ImportError_, match="dict.txt:2: expected '<token> <count>'"):
    FI.read_dictionary(str(p))
  p.write_text("the 5\n</s> 3\n")
  with pytest.raises(FI.ImportError_, match="dict.txt:2: token '</s>' repeats built-in symbol 2"):
    FI.read_dictionary(str(p))
  p.write_bytes(b"PK\x03\x04\x80\xff\xfe binary")  # a checkpoint given as --dict: one error, not a traceback
  with pytest.raises(FI.ImportError_, match="dict.txt:1: not UTF-8 text: a fairseq dictionary is a text file"):
    FI.read_dictionary(str(p))


def test_missing_and_unexplained_tensors(torch, tmp_path):
  d = write_dict(tmp_path / "dict.txt")
  path = write_checkpoint(torch, tmp_path / "a.pt", "softmax_only", drop=("decoder.layers.1.fc2.bias",))
  with pytest.raises(FI.ImportError_, match=r"missing 1 tensor.*decoder\.layers\.1\.fc2\.bias"):
    FI.import_checkpoint(path, d)
  sd = fairseq_state(VARIANTS["softmax_only"][4])
  sd["decoder.layernorm_embedding.weight"] = np.ones(16)
  path = write_checkpoint(torch, tmp_path / "b.pt", "softmax_only", sd=sd)
  with pytest.raises(FI.ImportError_, match=r"do not explain.*decoder\.layernorm_embedding\.weight"):
    FI.import_checkpoint(path, d)


class NotATensor:
  """A Python object in a checkpoint (as fairseq's meters or OmegaConf configs are)."""


def test_other_python_objects_need_trust_pickle(torch, tmp_path):
  path = write_checkpoint(torch, tmp_path / "c.pt", "plain_shared")
  state = torch.load(path, weights_only=False)
  state["extra_state"]["meter"] = NotATensor()
  torch.save(state, path)
  d = write_dict(tmp_path / "dict.txt")
  with pytest.raises(FI.ImportError_, match="cannot read .*--trust_pickle"):
    FI.import_checkpoint(path, d)
  assert FI.import_checkpoint(path, d, trust_pickle=True).cfg.tie_embeddings


def test_not_a_checkpoint(torch, tmp_path):
  p = tmp_path / "c.pt"
  torch.save({"weights": torch.zeros(2)}, str(p))
  with pytest.raises(FI.ImportError_, match="not a fairseq checkpoint"):
    FI.import_checkpoint(str(p), write_dict(tmp_path / "dict.txt"))
  with pytest.raises(FI.ImportError_, match="checkpoint not found"):
    FI.import_checkpoint(str(tmp_path / "nope.pt"), write_dict(tmp_path / "dict.txt"))


# ----------------------------------------------------------------------------------------------------------
# The command lines: import, then trime_jax.launch.eval on the export
# ----------------------------------------------------------------------------------------------------------
def _run(args, cwd):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": helpers.REPO}
  return subprocess.run([sys.executable, "-m"] + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_cli_import_then_launch_eval(torch, tmp_path):
  arch, storage, fused, flags, spec = VARIANTS["wiki103"]
  ckpt_path = write_checkpoint(torch, tmp_path / "checkpoint_best.pt", "wiki103")
  d = write_dict(tmp_path / "dict.txt")
  r = _run(["trime_jax.launch.import_fairseq", f"--checkpoint={ckpt_path}", f"--dict={d}", f"--out={tmp_path / 'export'}"],
           helpers.REPO)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "adaptive_softmax=True" in r.stdout and "wrote" in r.stdout
  meta = exports.read_export_meta(str(tmp_path / "export"))
  assert meta["fairseq_arch"] == "transformer_lm_wiki103" and meta["vocab_size"] == V
  # a rerun imports into its own --out again (the same checkpoint file); another checkpoint's is refused there
  r = _run(["trime_jax.launch.import_fairseq", f"--checkpoint={ckpt_path}", f"--dict={d}", f"--out={tmp_path / 'export'}"],
           helpers.REPO)
  assert r.returncode == 0 and "(replacing its earlier import of the same checkpoint file)" in r.stdout, r.stderr
  assert exports.read_export_meta(str(tmp_path / "export"))["params_digest"] == meta["params_digest"]
  other = tmp_path / "other.pt"
  shutil.copy(ckpt_path, other)
  r = _run(["trime_jax.launch.import_fairseq", f"--checkpoint={other}", f"--dict={d}", f"--out={tmp_path / 'export'}"],
           helpers.REPO)
  assert r.returncode == 2 and "already holds an export" in r.stderr, r.stderr
  root = helpers.write_wikitext_dir(tmp_path / "wiki")
  t, c = SIZE["tokens_per_sample"], 12
  r = _run(["trime_jax.launch.eval", "--config=configs/default.py", f"--checkpoint={tmp_path / 'export'}",
            "--config.data.corpus=wikitext", f"--config.data.path={root}", "--config.eval.memory=none",
            f"--config.eval.block_len={t}", f"--config.eval.context_window={c}", f"--output={tmp_path / 'rows.json'}"],
           helpers.REPO)
  assert r.returncode == 0, r.stderr[-2000:]
  (row,) = json.load(open(tmp_path / "rows.json"))
  stream = fairseq_encode_file(os.path.join(root, "wiki.valid.tokens"), WORDS)
  ref = fairseq_eval_lm_nll(fairseq_state(spec, fused=fused), spec, stream, t, c)
  assert abs(row["nll"] - ref) < 1e-5 * ref, (row["nll"], ref)
  # a bad input is one line and exit status 2
  r = _run(["trime_jax.launch.import_fairseq", f"--checkpoint={ckpt_path}", f"--dict={tmp_path / 'missing.txt'}",
            f"--out={tmp_path / 'x'}"], helpers.REPO)
  assert r.returncode == 2 and r.stderr.strip().startswith("error: fairseq dictionary not found"), r.stderr


def test_bad_checkpoint_paths_say_what_they_are(torch, tmp_path):
  """Issue 35: a folder is "a folder" (not "not found"); a text file is "not a torch checkpoint", without
  suggesting --trust_pickle (which would not help)."""
  d = write_dict(tmp_path / "dict.txt")
  (tmp_path / "ckpts").mkdir()
  with pytest.raises(FI.ImportError_, match="is a folder, not a file") as e:
    FI.load_checkpoint(str(tmp_path / "ckpts"))
  assert "not found" not in str(e.value)
  (tmp_path / "notes.txt").write_text("these are not weights\n")
  with pytest.raises(FI.ImportError_, match="is not a torch checkpoint") as e:
    FI.load_checkpoint(str(tmp_path / "notes.txt"))
  assert "trust_pickle" not in str(e.value)
  with pytest.raises(FI.ImportError_, match="is a folder, not a file"):
    FI.read_dictionary(str(tmp_path / "ckpts"))
  assert FI.read_dictionary(d)


def test_import_refuses_a_non_empty_out_unless_overwrite(torch, tmp_path):
  """Issue 35.4: an existing export at --out is not replaced silently."""
  d = write_dict(tmp_path / "dict.txt")
  path = write_checkpoint(torch, tmp_path / "c.pt", "plain_shared")
  out = tmp_path / "export"
  FI.import_to_export(path, d, str(out))
  before = (out / "meta.json").read_bytes()
  with pytest.raises(FI.ImportError_, match="already exists and is not empty"):
    FI.import_to_export(path, d, str(out))
  assert (out / "meta.json").read_bytes() == before
  FI.import_to_export(path, d, str(out), overwrite=True)
  assert (out / "meta.json").is_file()


def test_truncated_checkpoints_say_so(torch, tmp_path):
  """A checkpoint cut short (zip, or the pre-1.6 pickle format) is "truncated", wherever it was cut: before, torch's
  first complaint came through as "OSError: [Errno 22] Invalid argument", an empty "EOFError: " or miniz's
  message cut mid-sentence at 200 characters."""
  write_dict(tmp_path / "dict.txt")
  path = write_checkpoint(torch, tmp_path / "c.pt", "plain_shared")
  legacy = str(tmp_path / "legacy.pt")
  torch.save(torch.load(path, weights_only=False), legacy, _use_new_zipfile_serialization=False)
  for src, pattern in ((path, "is truncated or damaged: its zip archive has no end record"),
                       (legacy, "is truncated: the file ends before its last tensor")):
    raw = open(src, "rb").read()
    # every cut within the first 600 bytes (a legacy file's pickles: an IndexError, a struct error or the
    # weights-only refusal pointing at --trust_pickle came through there), then a few further on
    for n in list(range(5, 600, 3)) + [5000, len(raw) // 2, len(raw) - 10]:
      cut = tmp_path / "cut.pt"
      cut.write_bytes(raw[:n])
      with pytest.raises(FI.ImportError_, match=pattern) as e:
        FI.load_checkpoint(str(cut))
      assert "trust_pickle" not in str(e.value) and "copy the checkpoint again" in str(e.value), (n, str(e.value))
    assert FI.load_checkpoint(src)[1]  # the whole file reads


def test_out_that_is_or_holds_an_input_is_refused_even_with_overwrite(torch, tmp_path):
  """--out=the checkpoint file, or a folder holding the checkpoint or dict.txt: --overwrite replaced the
  checkpoint by the export made from it. Now one error line, exit 2, and the inputs stay."""
  folder = tmp_path / "model"
  folder.mkdir()
  d = write_dict(folder / "dict.txt")
  path = write_checkpoint(torch, folder / "c.pt", "plain_shared")
  before = open(path, "rb").read()
  for out, what in ((path, "checkpoint"), (str(folder), "checkpoint"), (d, "dictionary")):
    with pytest.raises(FI.ImportError_, match=f"is or holds the {what}"):
      FI.import_to_export(path, d, out, overwrite=True)
  other = tmp_path / "elsewhere.pt"
  shutil.copy(path, other)
  with pytest.raises(FI.ImportError_, match="is or holds the dictionary"):
    FI.import_to_export(str(other), d, str(folder), overwrite=True)
  for out in (path, folder):
    r = _run(["trime_jax.launch.import_fairseq", f"--checkpoint={path}", f"--dict={d}", f"--out={out}", "--overwrite"],
             str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --out={out} holds this command's own input --checkpoint="), r.stderr
  assert os.path.isfile(path) and open(path, "rb").read() == before and sorted(os.listdir(folder)) == ["c.pt",
                                                                                                         "dict.txt"]
