"""Typed specs from a config: the one place that knows the ConfigDict's layout for the objective and the models.

The application floor (the trainers, the evaluator's runner, the CLIs, the API, the export readers) makes these
once from the config it was given and passes them down; the floors below (scoring, loss, sharded_loss, steps,
model, srupp, layers, mt.model) take only the typed specs and never read a config section.

* `objective_spec(config)`: `loss.ObjectiveSpec` from the `trime` section (the LM's and translation's: fields a
  translation config lacks take the spec's defaults);
* `loss_spec(config)`: `steps.LossSpec` (the objective + `train.vocab_chunk` + the sharded loss's options);
* `model_config(config, vocab_size)`: the LM backbone's config dataclass from the `model` section
  (`model.backbone` picks `model.ModelConfig` or `srupp.SRUppConfig`);
* `mt_model_config(config, vocab_size, tgt_vocab_size)`: `mt.model.MTConfig` from a translation config's `model`
  section.

`config` is a whole config (a ConfigDict, or the dict of a stored config.json), never a section of it.
"""

from __future__ import annotations

import dataclasses

from trime_jax import loss
from trime_jax import steps
from trime_jax.model import BACKBONES, ModelConfig


def objective_spec(config) -> loss.ObjectiveSpec:
  """From the `trime` section (memory_chunk 0 = derived from the block budget). A translation config has no
  memory_grad_group_rows (and need not set consecutive_segments, which its memories ignore): the defaults."""
  t = config.trime
  return loss.ObjectiveSpec(memory=t.memory, consecutive_segments=int(t.get("consecutive_segments", 1)),
                            tau=float(t.tau), stop_gradient_memory=bool(t.stop_gradient_memory),
                            memory_chunk=int(t.memory_chunk) or None, memory_topk=int(t.get("memory_topk", 0)),
                            memory_grad_group_rows=int(t.get("memory_grad_group_rows", 0)))


def loss_spec(config) -> steps.LossSpec:
  return steps.LossSpec(objective=objective_spec(config), vocab_chunk=int(config.train.vocab_chunk),
                        sharded_variant=config.trime.get("sharded_variant", "gather"),
                        memory_grad=config.trime.get("memory_grad", "all"))


def _dataclass_of(cls, section, vocab_size):
  """`cls` from the section's fields of the same names (others ignored); `vocab_size` wins when given."""
  fields = {f.name for f in dataclasses.fields(cls)}
  kwargs = {k: v for k, v in dict(section).items() if k in fields}
  if vocab_size is not None:
    kwargs["vocab_size"] = vocab_size
  return cls(**kwargs)


def _srupp_config(m: dict, vocab_size):
  from trime_jax.srupp import SRUppConfig  # srupp imports model: late, as model.build_model does

  kw = dict(vocab_size=vocab_size if vocab_size is not None else m["vocab_size"], num_layers=m["num_layers"],
            d_model=m["d_model"], attn_dim=m.get("srupp_attn_dim") or max(m["d_model"] // 4, 1),
            num_heads=m.get("srupp_num_heads", 1), attention_every=m.get("srupp_attention_every", 1),
            highway_bias=m.get("srupp_highway_bias", -2.0), layer_norm=m.get("srupp_layer_norm", False),
            normalize_memory=m.get("srupp_normalize_memory", False),
            # absent from configs of before 2026-12-06: their exports were evaluated with the whole memory
            eval_same_length=m.get("srupp_eval_same_length", False),
            dropout=m.get("dropout", 0.1), attention_dropout=m.get("attention_dropout", 0.0),
            dtype=m.get("dtype", "float32"), key_type=m.get("key_type", "final"))
  if m.get("max_len"):
    kw["max_len"] = m["max_len"]
  return SRUppConfig(**kw)


def stateful_backbone(config) -> bool:
  """Whether `config`'s backbone carries a state across segments and windows (SRU++): its batches mark where a
  row does not continue, its dev scores depend on the number of evaluation streams."""
  return config.model.get("backbone", "transformer") == "srupp"


def model_config(config, vocab_size: int | None = None):
  """The LM backbone's config dataclass from `config`'s `model` section (model.backbone picks the backbone;
  `vocab_size` overrides model.vocab_size)."""
  m = dict(config["model"])
  backbone = m.get("backbone", "transformer")
  if backbone == "transformer":
    return _dataclass_of(ModelConfig, m, vocab_size)
  if backbone == "srupp":
    return _srupp_config(m, vocab_size)
  raise ValueError(f"model.backbone must be one of {BACKBONES}, got {backbone!r}")


def mt_model_config(config, vocab_size: int | None = None, tgt_vocab_size: int = 0):
  """`mt.model.MTConfig` from a translation config's `model` section; tgt_vocab_size: the vocabulary's
  `target_size` when it is smaller than the vocabulary (data.dictionaries="separate")."""
  from trime_jax.mt.model import MTConfig  # the LM's callers need not import the translation model

  cfg = _dataclass_of(MTConfig, config["model"], vocab_size)
  if tgt_vocab_size and tgt_vocab_size != cfg.vocab_size:
    cfg = dataclasses.replace(cfg, tgt_vocab_size=int(tgt_vocab_size))
  return cfg
