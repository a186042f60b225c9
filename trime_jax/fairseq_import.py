"""Import a fairseq `transformer_lm` checkpoint of the original TRIME release into a trime-jax export.

    python -m trime_jax.launch.import_fairseq --checkpoint=PATH/checkpoint_best.pt --dict=PATH/dict.txt --out=DIR

The export is the one `trime_jax.launch.eval`, `trime_jax.launch.eval_ext` and `trime_jax.launch.build_datastore` read
(`exports.export`).
What the import reads (docs/paper_models.md, "Importing the original checkpoints"):

  * the model's flags: `args` (an argparse.Namespace, the release's fairseq) or `cfg["model"]` (newer fairseq),
    completed with the defaults of the named architecture as the release's `transformer_lm.py` registers them
    (the arch function, then `transformer_lm_big`, then `base_lm_architecture`);
  * the state dict (`state["model"]`), under fairseq's names (`state_dict_names` maps each of our parameters);
  * dict.txt: fairseq's `Dictionary` numbers `<s>`, `<pad>`, `</s>`, `<unk>` 0..3, then the file's words in
    order. The exported vocabulary is exactly that list, so the WikiText reader (`</s>` at every line end,
    `<unk>` for words not in it) produces fairseq's ids.

Every flag that changes the forward pass is either mapped or refused with an error naming it (`ImportError_`
is a `CheckpointError`: the CLI prints one line). PyTorch is needed only to unpickle the file
(`pip install -e ".[fairseq]"`, a CPU wheel is enough); the file is read with `torch.load(weights_only=True)`
(argparse.Namespace allowed), so a checkpoint holding other Python objects is refused unless
`trust_pickle=True`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import struct
import zipfile

import numpy as np

from trime_jax import data
from trime_jax.errors import CheckpointError, first_line
from trime_jax.model import ModelConfig

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq Dictionary(): bos, pad, eos, unk = 0, 1, 2, 3
PADDING_IDX = 1
PREFIX = "decoder."
QKV_ORDER = ("q", "k", "v")  # our qkv kernel's column blocks (model.CausalSelfAttention splits [q | k | v])

# The release's architectures (fairseq/models/transformer_lm.py): each arch's own defaults, applied before
# transformer_lm_big's and base_lm_architecture's (getattr defaults: the first to set a flag wins).
_BASE = dict(dropout=0.1, attention_dropout=0.0, decoder_embed_dim=512, decoder_ffn_embed_dim=2048, decoder_layers=6,
             decoder_attention_heads=8, adaptive_softmax_cutoff=None, adaptive_softmax_dropout=0,
             adaptive_softmax_factor=4, decoder_learned_pos=False, activation_fn="relu", add_bos_token=False,
             no_token_positional_embeddings=False, share_decoder_input_output_embed=False, character_embeddings=False,
             no_decoder_final_norm=False, adaptive_input=False, adaptive_input_factor=4, adaptive_input_cutoff=None,
             tie_adaptive_weights=False, tie_adaptive_proj=False, no_scale_embedding=False, layernorm_embedding=False)
_BIG = dict(decoder_layers=12, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_attention_heads=16)
_WIKI103 = dict(decoder_layers=16, decoder_attention_heads=8, dropout=0.3, adaptive_input=True,
                tie_adaptive_weights=True, adaptive_input_cutoff="20000,60000", adaptive_softmax_cutoff="20000,60000",
                adaptive_softmax_dropout=0.2, attention_dropout=0.1, activation_dropout=0.1, no_decoder_final_norm=True,
                tie_adaptive_proj=True)
_SMALL = dict(dropout=0.3, attention_dropout=0.1, activation_dropout=0.1, no_decoder_final_norm=False)
ARCHS = {  # name -> [own defaults, parent chain]
    "transformer_lm": [],
    "transformer_lm_big": [_BIG],
    "transformer_lm_wiki103": [_WIKI103, _BIG],
    "transformer_lm_baevski_wiki103": [_WIKI103, _BIG],
    "transformer_lm_wiki103_small": [{**_WIKI103, "decoder_layers": 8, "decoder_embed_dim": 512,
                                      "decoder_ffn_embed_dim": 2048}, _BIG],
    "transformer_lm_wiki103_small_sm": [dict(_SMALL, decoder_layers=8, decoder_embed_dim=128, decoder_ffn_embed_dim=512,
                                             decoder_attention_heads=4), _BIG],
    "transformer_lm_wiki103_150M": [dict(_SMALL, decoder_layers=16, decoder_embed_dim=410, decoder_ffn_embed_dim=2100,
                                         decoder_attention_heads=10), _BIG],
    "transformer_lm_enwik8": [dict(_SMALL, decoder_layers=12, decoder_embed_dim=512, decoder_ffn_embed_dim=2048,
                                   decoder_attention_heads=8), _BIG],
    "transformer_lm_gbw": [dict(decoder_embed_dim=512, dropout=0.1, attention_dropout=0.1, no_decoder_final_norm=True),
                           _BIG],
    "transformer_lm_baevski_gbw": [dict(decoder_embed_dim=512, dropout=0.1, attention_dropout=0.1,
                                        no_decoder_final_norm=True), _BIG],
}

# Flags the import maps (or checks for fairseq's neutral value). Any other flag under an architecture prefix that
# is set (not None / False / 0 / "") is refused by name: it might change the model.
_MAPPED = {
    "arch", "_name", "dropout", "attention_dropout", "activation_dropout", "relu_dropout", "decoder_embed_dim",
    "decoder_input_dim", "decoder_output_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads",
    "decoder_normalize_before", "no_decoder_final_norm", "decoder_final_norm", "decoder_learned_pos",
    "adaptive_softmax_cutoff", "adaptive_softmax_dropout", "adaptive_softmax_factor", "adaptive_input",
    "adaptive_input_factor", "adaptive_input_cutoff", "tie_adaptive_weights", "tie_adaptive_proj",
    "no_tie_adaptive_proj",
    "share_decoder_input_output_embed", "max_target_positions", "tokens_per_sample", "activation_fn",
    "no_token_positional_embeddings", "character_embeddings", "no_scale_embedding", "layernorm_embedding",
    "add_bos_token", "decoder_layerdrop", "decoder_layers_to_keep", "cross_self_attention", "layer_wise_attention",
    "knn_keytype", "knn_type", "learn_mem_weight", "character_filters", "character_embedding_dim",
    "char_embedder_highway_layers", "output_dictionary_size",
    # newer fairseq's TransformerLanguageModelConfig: memory/speed switches, or features checked in _NEUTRAL
    "checkpoint_activations", "offload_activations", "min_params_to_wrap", "tpu", "quant_noise_pq",
    "quant_noise_pq_block_size", "quant_noise_scalar", "base_layers", "base_sublayers", "base_shuffle", "scale_fc",
    "scale_attn", "scale_heads", "scale_resids", "decoder_xformers_att_config",
}
# fairseq's value of each flag for which trime-jax has no alternative (None or False/0 = off).
_NEUTRAL = {"activation_fn": "relu", "no_token_positional_embeddings": False, "character_embeddings": False,
            "no_scale_embedding": False, "layernorm_embedding": False, "add_bos_token": False,
            "decoder_layers_to_keep": None, "cross_self_attention": False, "layer_wise_attention": False,
            "output_dictionary_size": -1, "quant_noise_pq": 0, "quant_noise_scalar": 0, "base_layers": 0,
            "scale_fc": False, "scale_attn": False, "scale_heads": False, "scale_resids": False,
            "decoder_xformers_att_config": None}
_ARCH_PREFIXES = ("decoder_", "encoder_", "adaptive_", "tie_", "share_", "no_decoder", "no_scale", "no_token",
                  "layernorm", "character", "char_", "cross_self", "layer_wise", "quant_noise", "activation_fn",
                  "checkpoint_activations", "offload_activations", "base_layers", "alibi", "rel_pos")
# Buffers and duplicates that hold no parameters of their own.
_IGNORED_SUFFIXES = ("version", "_float_tensor", "embed_positions.weights")


class ImportError_(CheckpointError):
  """A fairseq checkpoint or dictionary this import cannot reproduce exactly."""


# ----------------------------------------------------------------------------------------------------------
# Reading the files
# ----------------------------------------------------------------------------------------------------------
def _torch():
  try:
    import torch
  except ImportError:
    raise ImportError_("reading a fairseq checkpoint needs PyTorch (only to unpickle the file): "
                       "pip install -e \".[fairseq]\" (a CPU wheel is enough)") from None
  return torch


def read_dictionary(path: str) -> data.Vocab:
  """fairseq's Dictionary ids: `<s>` `<pad>` `</s>` `<unk>`, then one `<token> <count>` line each, in order."""
  data.require_file(path, "fairseq dictionary", example="dict.txt", error=ImportError_)
  tokens = list(SPECIALS)
  seen = {t: f"built-in symbol {i}" for i, t in enumerate(SPECIALS)}
  n = 0
  try:
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        line = line.rstrip("\n")
        idx = line.rfind(" ")
        if idx <= 0 or not line[idx + 1:].lstrip("-").isdigit():
          raise ImportError_(f"{path}:{n}: expected '<token> <count>', got {line[:80]!r}")
        word = line[:idx]
        if word in seen:  # fairseq would give it a second id and read it as the later one only
          raise ImportError_(f"{path}:{n}: token {word!r} repeats {seen[word]}")
        seen[word] = f"line {n}"
        tokens.append(word)
  except UnicodeDecodeError:  # a binary file (the checkpoint itself, a .bin) given for the text dictionary
    raise ImportError_(f"{path}:{n + 1}: not UTF-8 text: a fairseq dictionary is a text file of "
                       "'<token> <count>' lines (dict.txt), not a checkpoint or binary file") from None
  return data.Vocab(tokens)


def _plain(obj):
  """Flags as a plain dict: argparse.Namespace, dict, or an OmegaConf DictConfig."""
  if obj is None:
    return None
  if isinstance(obj, argparse.Namespace):
    return dict(vars(obj))
  if isinstance(obj, dict):
    return dict(obj)
  try:  # omegaconf, when installed (newer fairseq's cfg)
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(obj, resolve=True))
  except Exception:  # noqa: BLE001 - anything else is not a flag container
    raise ImportError_(f"cannot read the model flags: a {type(obj).__name__}, expected a Namespace or dict") from None


def load_checkpoint(path: str, *, trust_pickle: bool = False):
  """(flags dict, {name: float32 ndarray}) of a fairseq checkpoint, the `decoder.` prefix kept."""
  torch = _torch()
  data.require_file(path, "fairseq checkpoint", example="checkpoint_best.pt", error=ImportError_)
  with open(path, "rb") as f:
    magic = f.read(4)
  # torch.save writes a zip archive (PK..) or, before torch 1.6, a pickle (protocol 2+: 0x80). Anything else is
  # not a checkpoint at all, and torch's unpickling error would wrongly suggest --trust_pickle.
  if not (magic.startswith(b"PK\x03\x04") or magic[:1] == b"\x80"):
    raise ImportError_(f"{path} is not a torch checkpoint: it is neither a zip archive nor a pickle (it starts "
                       f"with {magic!r}); give the .pt file fairseq saved")
  # A file cut short (an interrupted download or copy) otherwise reads as whatever torch trips over first:
  # "OSError: [Errno 22] Invalid argument", an empty "EOFError: ", or miniz's message cut mid-sentence.
  if magic.startswith(b"PK\x03\x04") and not zipfile.is_zipfile(path):  # its end record (written last) is missing
    raise ImportError_(f"{path} is truncated or damaged: its zip archive has no end record ({os.path.getsize(path):,} "
                       "bytes; an interrupted download or copy?): copy the checkpoint again")
  try:
    if trust_pickle:
      state = torch.load(path, map_location="cpu", weights_only=False)
    else:
      torch.serialization.add_safe_globals([argparse.Namespace])
      state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # noqa: BLE001 - torch raises many types; one line says which file and why
    # Only a refused global (weights_only) is what --trust_pickle changes; a damaged file stays damaged.
    legacy_cut = magic[:1] == b"\x80" and (not _pickles_complete(path, LEGACY_PICKLES) or "truncated" in str(e)
                                           or isinstance(e, (struct.error, IndexError)))
    if isinstance(e, EOFError) or "unexpected EOF" in str(e) or legacy_cut:  # a pre-1.6 (pickle) checkpoint cut short
      raise ImportError_(f"{path} is truncated: the file ends before its last tensor ({os.path.getsize(path):,} "
                         "bytes; an interrupted download or copy?): copy the checkpoint again") from None
    refused = "weights_only" in str(e) or "Unsupported global" in str(e) or "GLOBAL" in str(e)
    hint = (" (if it holds other Python objects and you trust the file: --trust_pickle, or trust_pickle=True)"
            if refused and not trust_pickle else "")
    raise ImportError_(f"cannot read {path} as a torch checkpoint: {first_line(e)}{hint}") from None
  if not isinstance(state, dict) or "model" not in state:
    raise ImportError_(f"{path} is not a fairseq checkpoint: no 'model' state dict")
  flags = _plain(state.get("args"))
  if flags is None:
    cfg = state.get("cfg")
    if cfg is None:
      raise ImportError_(f"{path} stores neither 'args' nor 'cfg': the architecture is unknown")
    cfg = _plain(cfg)
    flags = _plain(cfg.get("model"))
    if flags is None:
      raise ImportError_(f"{path}: cfg has no 'model' section")
    flags.setdefault("tokens_per_sample", _plain(cfg.get("task") or {}).get("tokens_per_sample"))
  params = {}
  for k, v in state["model"].items():
    if hasattr(v, "detach"):
      v = v.detach().float().numpy() if v.is_floating_point() else v.detach().numpy()
    params[k] = np.asarray(v)
  return flags, params


LEGACY_PICKLES = 5  # a pre-1.6 torch.save: magic number, protocol, system info, the object, its storage keys


def _pickles_complete(path: str, count: int) -> bool:
  """Whether `path` begins with `count` whole pickles (each to its STOP), read by pickletools, which executes
  nothing: a cut in a legacy checkpoint's pickles otherwise reads as torch's first complaint (an IndexError, a
  struct error, or the weights-only unpickler's refusal, which would point at --trust_pickle)."""
  import pickletools

  with open(path, "rb") as f:
    try:
      for _ in range(count):
        for _op in pickletools.genops(f):
          pass
    except Exception:  # noqa: BLE001 - any malformed or cut stream is "not complete"
      return False
  return True


# ----------------------------------------------------------------------------------------------------------
# Flags -> ModelConfig
# ----------------------------------------------------------------------------------------------------------
def _cutoffs(value, flag):
  if value is None:
    return None
  if isinstance(value, str):
    try:
      return tuple(int(c) for c in value.replace("[", "").replace("]", "").split(",") if c.strip())
    except ValueError:
      raise ImportError_(f"unsupported architecture flag {flag}={value!r}: not a list of integers") from None
  return tuple(int(c) for c in value)


def complete_flags(flags: dict) -> dict:
  """The checkpoint's flags with the architecture's defaults filled in, as fairseq's build_model sees them."""
  arch = flags.get("arch") or flags.get("_name")
  if arch not in ARCHS:
    raise ImportError_(f"unsupported architecture flag arch={arch!r}: the import knows {sorted(ARCHS)}")
  out = dict(_BASE)
  for defaults in reversed(ARCHS[arch]):
    out.update(defaults)
  out.update(flags)  # a flag stored as None was set to None by the arch (fairseq's getattr keeps it)
  # base_lm_architecture's compatibility rules and derived defaults
  if "no_tie_adaptive_proj" in flags:
    out["no_decoder_final_norm"] = True
    if flags["no_tie_adaptive_proj"] is False:
      out["tie_adaptive_proj"] = True
  if "decoder_final_norm" in flags:
    out["no_decoder_final_norm"] = not flags["decoder_final_norm"]
  for k in ("decoder_input_dim", "decoder_output_dim"):
    if out.get(k) is None:
      out[k] = out["decoder_embed_dim"]
  if out.get("max_target_positions") is None:
    out["max_target_positions"] = out.get("tokens_per_sample") or 1024
  if not out.get("activation_dropout"):
    out["activation_dropout"] = out.get("relu_dropout") or 0.0
  return out


def model_config(flags: dict, params: dict, vocab_size: int, *, key_type: str = "last_ffn_input") -> ModelConfig:
  """The ModelConfig of a completed flag set; refuses, by name, every flag trime-jax cannot reproduce."""
  for k in sorted(flags):
    if k not in _MAPPED and k.startswith(_ARCH_PREFIXES) and flags[k] not in (None, False, 0, ""):
      raise ImportError_(f"unsupported architecture flag {k}={flags[k]!r}: the import does not know what it "
                         "changes, so it would not reproduce the model")
  for k, neutral in _NEUTRAL.items():
    v = flags.get(k)
    if not (v is None or v == neutral or (not v and not neutral)):
      raise ImportError_(f"unsupported architecture flag {k}={v!r}: trime-jax implements only {k}={neutral!r}")
  if flags.get("knn_keytype") == "separated_head":
    raise ImportError_("unsupported architecture flag knn_keytype='separated_head' (an extra key head)")
  d = int(flags["decoder_embed_dim"])
  for k in ("decoder_input_dim", "decoder_output_dim"):
    if int(flags[k]) != d:
      raise ImportError_(f"unsupported architecture flag {k}={flags[k]} != decoder_embed_dim={d} "
                         "(project_in_dim / project_out_dim)")
  # fairseq appends V to a module's cutoffs unless the last one already is V
  in_cut, sm_cut = [None if c is None else tuple(x for x in c if x != vocab_size) for c in (
      _cutoffs(flags.get("adaptive_input_cutoff"), "adaptive_input_cutoff"),
      _cutoffs(flags.get("adaptive_softmax_cutoff"), "adaptive_softmax_cutoff"))]
  adaptive_input, adaptive_softmax = bool(flags["adaptive_input"]), sm_cut is not None
  if adaptive_input and in_cut is None:
    raise ImportError_("architecture flag adaptive_input=True needs adaptive_input_cutoff")
  if adaptive_input and adaptive_softmax and in_cut != sm_cut:
    raise ImportError_(f"unsupported architecture flags adaptive_input_cutoff={in_cut} != adaptive_softmax_cutoff="
                       f"{sm_cut}: trime-jax cuts both at the same places")
  cuts = in_cut if adaptive_input else (sm_cut or ())
  tie_adaptive = bool(flags["tie_adaptive_weights"])
  if tie_adaptive and not adaptive_input:
    raise ImportError_("architecture flag tie_adaptive_weights=True needs adaptive_input=True (fairseq asserts it)")
  if adaptive_softmax:
    tied = tie_adaptive
  else:
    tied = bool(flags["share_decoder_input_output_embed"])
    if tied and adaptive_input:
      raise ImportError_("unsupported architecture flags share_decoder_input_output_embed=True with adaptive_input "
                         "and no adaptive softmax (fairseq cannot run it either)")
  if tie_adaptive and adaptive_softmax and float(flags["adaptive_input_factor"]) != float(
      flags["adaptive_softmax_factor"]):
    raise ImportError_("architecture flags tie_adaptive_weights=True with adaptive_input_factor != "
                       "adaptive_softmax_factor (fairseq asserts they are equal)")
  final_norm = not flags["no_decoder_final_norm"]
  version = params.get(PREFIX + "version")
  if version is None or float(np.ravel(version)[0]) <= 2:  # fairseq: older decoders had no final LayerNorm
    final_norm = False
  if flags["decoder_learned_pos"]:
    name = PREFIX + "embed_positions.weight"
    if name not in params:
      raise ImportError_(f"decoder_learned_pos=True but the state dict has no {name}")
    max_len = params[name].shape[0] - (PADDING_IDX + 1)
  else:
    max_len = int(flags["max_target_positions"])
  heads = int(flags["decoder_attention_heads"])
  if d % heads:
    raise ImportError_(f"decoder_embed_dim={d} is not divisible by decoder_attention_heads={heads}")
  try:
    return ModelConfig(
        vocab_size=vocab_size, num_layers=int(flags["decoder_layers"]), d_model=d, num_heads=heads,
        d_ff=int(flags["decoder_ffn_embed_dim"]), max_len=max_len,
        positions="learned" if flags["decoder_learned_pos"] else "sinusoidal", position_offset=PADDING_IDX + 1,
        tie_embeddings=tied, final_norm=final_norm, dropout=float(flags["dropout"]),
        attention_dropout=float(flags["attention_dropout"]), activation_dropout=float(flags["activation_dropout"]),
        key_type=key_type, dtype="float32", adaptive_input=adaptive_input, adaptive_softmax=adaptive_softmax,
        adaptive_cutoffs=cuts if (adaptive_input or adaptive_softmax) else (),
        adaptive_input_factor=float(flags["adaptive_input_factor"]),
        adaptive_softmax_factor=float(flags["adaptive_softmax_factor"]),
        tie_adaptive_proj=bool(flags["tie_adaptive_proj"]) and tied and adaptive_softmax,
        adaptive_softmax_dropout=float(flags["adaptive_softmax_dropout"] or 0.0),
        adaptive_tail_ignores_pad=adaptive_softmax)  # as the release's criteria and TRIME scorer
  except ValueError as e:
    raise ImportError_(f"the checkpoint's architecture has no trime-jax equivalent: {e}") from None


# ----------------------------------------------------------------------------------------------------------
# State dict -> parameters
# ----------------------------------------------------------------------------------------------------------
def _upgrade(params: dict) -> dict:
  """fairseq's upgrade_state_dict_named renamings: fused in_proj -> q/k/v_proj, layer_norms.{0,2} -> names."""
  out = {}
  for k, v in params.items():
    if k.endswith("self_attn.in_proj_weight") or k.endswith("self_attn.in_proj_bias"):
      base, kind = k.rsplit(".in_proj_", 1)
      if v.shape[0] % 3:
        raise ImportError_(f"{k} has {v.shape[0]} rows, not 3 equal parts (q, k, v)")
      n = v.shape[0] // 3
      for j, part in enumerate(("q_proj", "k_proj", "v_proj")):
        out[f"{base}.{part}.{kind}"] = v[j * n:(j + 1) * n]
      continue
    for old, new in ((".layer_norms.0.", ".self_attn_layer_norm."), (".layer_norms.2.", ".final_layer_norm.")):
      if ".layers." in k and old in k:
        k = k.replace(old, new)
    out[k] = v
  return out


def state_dict_names(cfg: ModelConfig) -> dict:
  """{our parameter path: (fairseq name, transform)}: transform "T" = transpose (torch Linear [out, in]),
  "qkv" = [q; k; v] rows transposed into one [D, 3D] kernel (bias: concatenated), "" = as is."""
  n = {}
  if cfg.adaptive_input:
    for i in range(len(cfg.band_edges) - 1):
      n[f"adaptive_embed.embeddings.{i}.embedding"] = (f"embed_tokens.embeddings.{i}.0.weight", "")
      n[f"adaptive_embed.projections.{i}.kernel"] = (f"embed_tokens.embeddings.{i}.1.weight", "T")
  else:
    n["embed.embedding"] = ("embed_tokens.weight", "")
  if cfg.positions == "learned":
    n["pos_embed.embedding"] = ("embed_positions.weight", "")
  for l in range(cfg.num_layers):
    f, o = f"layers.{l}.", f"blocks.{l}."
    n[o + "attn.qkv.kernel"] = (f + "self_attn.{q,k,v}_proj.weight", "qkv")
    n[o + "attn.qkv.bias"] = (f + "self_attn.{q,k,v}_proj.bias", "qkv")
    n[o + "attn.out.kernel"] = (f + "self_attn.out_proj.weight", "T")
    n[o + "attn.out.bias"] = (f + "self_attn.out_proj.bias", "")
    n[o + "attn_norm.scale"] = (f + "self_attn_layer_norm.weight", "")
    n[o + "attn_norm.bias"] = (f + "self_attn_layer_norm.bias", "")
    n[o + "ffn_norm.scale"] = (f + "final_layer_norm.weight", "")
    n[o + "ffn_norm.bias"] = (f + "final_layer_norm.bias", "")
    for fc in ("fc1", "fc2"):
      n[o + f"{fc}.kernel"] = (f + f"{fc}.weight", "T")
      n[o + f"{fc}.bias"] = (f + f"{fc}.bias", "")
  if cfg.final_norm:
    n["final_norm.scale"] = ("layer_norm.weight", "")
    n["final_norm.bias"] = ("layer_norm.bias", "")
  if cfg.adaptive_softmax:
    k = len(cfg.adaptive_cutoffs)
    if cfg.tie_embeddings:
      if k:
        n["adaptive_softmax.cluster"] = ("adaptive_softmax.head.class_proj.weight", "")
    else:
      n["adaptive_softmax.head"] = ("adaptive_softmax.head.weight", "")
    for i in range(k):
      if not cfg.tie_adaptive_proj:
        n[f"adaptive_softmax.tail_proj.{i}"] = (f"adaptive_softmax.tail.{i}.0.weight", "T")
      if not cfg.tie_embeddings:
        n[f"adaptive_softmax.tail_out.{i}"] = (f"adaptive_softmax.tail.{i}.2.weight", "")
  elif not cfg.tie_embeddings:
    n["output"] = ("embed_out", "")
  return n


def _tied_copies(cfg: ModelConfig) -> dict:
  """fairseq names that hold a second reference to a tied tensor (TiedLinear registers it again) -> the owner."""
  if not (cfg.adaptive_softmax and cfg.tie_embeddings):
    return {}
  t = {"adaptive_softmax.head.word_proj.weight": "embed_tokens.embeddings.0.0.weight"}
  for i in range(len(cfg.adaptive_cutoffs)):
    t[f"adaptive_softmax.tail.{i}.2.weight"] = f"embed_tokens.embeddings.{i + 1}.0.weight"
    if cfg.tie_adaptive_proj:
      t[f"adaptive_softmax.tail.{i}.0.weight"] = f"embed_tokens.embeddings.{i + 1}.1.weight"
  return t


def convert(params: dict, cfg: ModelConfig) -> dict:
  """{our parameter path: float32 array} from a fairseq state dict; every fairseq tensor used or accounted for."""
  sd = {k[len(PREFIX):]: v for k, v in _upgrade(params).items() if k.startswith(PREFIX)}
  other = sorted(k for k in params if not k.startswith(PREFIX))
  if other:
    raise ImportError_(f"state dict entries outside the decoder: {', '.join(other[:5])}")
  used, out, missing = set(), {}, []

  def take(name):
    if name not in sd:
      missing.append(PREFIX + name)
      return None
    used.add(name)
    return np.asarray(sd[name], np.float32)

  for ours, (name, how) in state_dict_names(cfg).items():
    if how == "qkv":
      parts = [take(name.replace("{q,k,v}", p)) for p in QKV_ORDER]
      if any(p is None for p in parts):
        continue
      out[ours] = np.concatenate([p.T for p in parts], axis=1) if parts[0].ndim == 2 else np.concatenate(parts)
    else:
      w = take(name)
      if w is not None:
        out[ours] = w.T if how == "T" else w
  if missing:
    raise ImportError_(f"state dict is missing {len(missing)} tensor(s) this architecture needs: "
                       f"{', '.join(missing[:6])}")
  empty = "adaptive_softmax.head.class_proj.weight"  # one band (enwik8: cutoff = V): a Linear(D, 0)
  if cfg.adaptive_softmax and not cfg.adaptive_cutoffs and empty in sd and np.size(sd[empty]) == 0:
    used.add(empty)
  for copy, owner in _tied_copies(cfg).items():
    if copy in sd:
      if owner in sd and (sd[copy].shape != sd[owner].shape or not np.array_equal(sd[copy], sd[owner])):
        raise ImportError_(f"{PREFIX}{copy} should be tied to {PREFIX}{owner} but differs")
      used.add(copy)
  unused = sorted(k for k in sd if k not in used and not k.endswith(_IGNORED_SUFFIXES))
  if unused:
    raise ImportError_(f"state dict has {len(unused)} tensor(s) the flags do not explain (a different "
                       f"architecture?): {', '.join(PREFIX + k for k in unused[:6])}")
  return out


def params_tree(cfg: ModelConfig, flat: dict):
  """The nnx parameter State of TransformerLM(cfg) filled from `flat` (shapes checked)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from trime_jax.model import TransformerLM

  abstract = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
  _, state = nnx.split(abstract, nnx.Param)
  seen = set()

  def fill(path, leaf):
    keys = [getattr(p, "key", getattr(p, "idx", getattr(p, "name", None))) for p in path]
    name = ".".join(str(k) for k in keys if k != "value")
    if name not in flat:
      raise ImportError_(f"no fairseq tensor maps to parameter {name} (an import bug for this architecture)")
    arr = flat[name]
    if tuple(arr.shape) != tuple(leaf.shape):
      src = state_dict_names(cfg)[name][0]
      raise ImportError_(f"{PREFIX}{src} has shape {tuple(arr.shape)}, the model needs {tuple(leaf.shape)} "
                         f"for {name} (dict.txt or flags do not match the checkpoint?)")
    seen.add(name)
    return jnp.asarray(arr, leaf.dtype)

  tree = jax.tree_util.tree_map_with_path(fill, state)
  assert seen == set(flat), set(flat) - seen
  return tree


def _vocab_rows(sd: dict) -> int | None:
  """The vocabulary size the state dict was trained with (rows of the input embedding or output layer)."""
  if PREFIX + "embed_tokens.weight" in sd:
    return sd[PREFIX + "embed_tokens.weight"].shape[0]
  bands = [k for k in sd if k.startswith(PREFIX + "embed_tokens.embeddings.") and k.endswith(".0.weight")]
  if bands:
    return sum(sd[k].shape[0] for k in bands)
  if PREFIX + "embed_out" in sd:
    return sd[PREFIX + "embed_out"].shape[0]
  return None


@dataclasses.dataclass
class Imported:
  cfg: ModelConfig
  params: object  # nnx State
  vocab: data.Vocab
  flags: dict


def import_checkpoint(checkpoint: str, dict_path: str, *, key_type: str = "last_ffn_input",
                      trust_pickle: bool = False) -> Imported:
  """Read a fairseq checkpoint + dict.txt into (ModelConfig, parameters, fairseq-ordered vocabulary)."""
  vocab = read_dictionary(dict_path)
  raw_flags, params = load_checkpoint(checkpoint, trust_pickle=trust_pickle)
  flags = complete_flags(raw_flags)
  rows = _vocab_rows(params)
  if rows is not None and rows != len(vocab):
    raise ImportError_(f"dictionary size mismatch: {dict_path} gives {len(vocab)} symbols (4 special + "
                       f"{len(vocab) - 4} lines), the checkpoint's embeddings have {rows} rows")
  cfg = model_config(flags, params, len(vocab), key_type=key_type)
  flat = convert(params, cfg)
  return Imported(cfg, params_tree(cfg, flat), vocab, flags)


def export_config(cfg: ModelConfig, flags: dict, *, dtype: str = "float32"):
  """A full trime-jax config (configs/default.py) around the imported model: trime_jax.launch.eval reads the model and
  train.vocab_chunk from it, and the data and eval sections from its own --config."""
  from trime_jax.configs import default

  c = default.get_config()
  for f in dataclasses.fields(cfg):
    setattr(c.model, f.name, getattr(cfg, f.name))
  c.model.dtype = dtype  # compute dtype only: parameters stay float32 (float32 reproduces fairseq's numbers)
  c.data.corpus = "wikitext"
  c.data.segment_len = min(cfg.max_len, int(flags.get("tokens_per_sample") or cfg.max_len))
  c.eval.block_len = c.data.segment_len
  c.eval.context_window = 0
  c.train.vocab_chunk = 16_384 if cfg.vocab_size > 32_768 else 0  # as configs/wiki103_247m.py: no [N, V] logits
  return c


def import_to_export(checkpoint: str, dict_path: str, out: str, *, key_type: str = "last_ffn_input",
                     dtype: str = "float32", trust_pickle: bool = False,
                     overwrite: bool = False) -> tuple[str, Imported]:
  """Write the trime-jax export of a fairseq checkpoint to `out`; returns (directory, what was imported).

  A non-empty `out` (an earlier export, a trained model's, anything) is refused unless `overwrite`: the import
  replaces the whole directory."""
  import inspect

  from trime_jax import exports

  for what, path in (("checkpoint", checkpoint), ("dictionary", dict_path)):
    if data.within(path, out):  # replacing `out` would delete what is read
      raise ImportError_(f"{out} is or holds the {what} {path} this import reads: choose another output directory")
  if os.path.lexists(out) and (not os.path.isdir(out) or os.listdir(out)) and not overwrite:
    raise ImportError_(f"{out} already exists and is not empty: the import would replace it; choose another "
                       "output directory (or pass overwrite=True / --overwrite)")

  imp = import_checkpoint(checkpoint, dict_path, key_type=key_type, trust_pickle=trust_pickle)
  config = export_config(imp.cfg, imp.flags, dtype=dtype)
  extra = {"step": 0, "imported_from": os.path.abspath(checkpoint), "fairseq_arch": imp.flags.get("arch") or
           imp.flags.get("_name"), "fairseq_dict": os.path.abspath(dict_path)}
  kwargs = {"overwrite": overwrite} if "overwrite" in inspect.signature(exports.export).parameters else {}
  return exports.export(out, imp.params, config, imp.vocab, extra=extra, **kwargs), imp
