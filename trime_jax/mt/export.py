"""The translation model's export: `<dir>/{params/, config.json, meta.json, the subword model}`, written with the
LM's writer (`exports.write_export`: to `<dir>.tmp`, renamed into place, one writer at a time) and read back
checked (`load_mt_export`). Above the model (`mt.model` knows neither checkpoints nor configs): a ConfigDict is
turned into the model's typed spec here (`specs.mt_model_config`)."""

from __future__ import annotations

import json
import os

import jax
import ml_collections
from flax import nnx

from trime_jax import data as lm_data
from trime_jax import exports
from trime_jax.checkpoint import ocp  # orbax, imported there
from trime_jax import specs
from trime_jax.errors import CheckpointError, DamagedCheckpointError
from trime_jax.mt.data import SubwordVocab
from trime_jax.mt.model import TransformerMT, count_params
from trime_jax.runtime.workdir import read_stored_config

EXPORT_FILES = ("config.json", "meta.json", "params")  # + the vocabulary file (SubwordVocab.FILES)


def identity(config, vocab) -> dict:
  """The fields of a translation export's meta.json that say which model it is (exports.IDENTITY_FIELDS: its
  architecture and vocabulary), for the trainer's check of export/ and best/ before training."""
  mcfg = specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size)
  return {"arch_digest": exports.arch_digest(mcfg), "vocab_fingerprint": vocab.fingerprint()}


def export_mt(directory: str, params, config, vocab, extra=None, *, overwrite: bool = False) -> str:
  """Write params + config + the subword model + meta to `directory` atomically; returns the directory. The LM's
  writer (`exports.write_export`): one writer at a time, a target of another kind or model refused unless
  `overwrite`."""
  mcfg = specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size)
  meta = {"params_digest": exports.params_digest(params), **identity(config, vocab), "vocab_size": vocab.size,
          "target_vocab_size": vocab.target_size, "vocab_kind": vocab.kind, "d_model": mcfg.d_model,
          "key_type": mcfg.key_type, "num_params": count_params(params), "model_family": "mt", **(extra or {})}

  def files(tmp):
    vocab.save(tmp)
    lm_data.atomic_write_json(os.path.join(tmp, "config.json"), json.loads(config.to_json_best_effort()))

  return exports.write_export(directory, params, meta, files, overwrite=overwrite)


def load_mt_export(directory: str):
  """(graphdef, params, config, vocab) of an MT export, validated (files present, vocabulary fingerprint, the
  parameters' files and shapes and their digest as recorded in meta.json: `exports.restore_export_params`)."""
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise CheckpointError(f"MT export directory not found: {directory}")
  missing = [f for f in EXPORT_FILES if not os.path.exists(os.path.join(directory, f))]
  if missing:
    raise CheckpointError(f"incomplete MT export {directory}: missing {', '.join(missing)}")
  path = os.path.join(directory, "config.json")  # written before a field was renamed: read under today's names
  config = ml_collections.ConfigDict(read_stored_config(path, "MT export config", DamagedCheckpointError))
  meta = lm_data.read_json(os.path.join(directory, "meta.json"), "MT export meta", DamagedCheckpointError)
  if meta.get("model_family") != "mt":
    raise CheckpointError(f"{directory} is not an MT export (meta.json model_family={meta.get('model_family')!r})")
  vocab = SubwordVocab.load(directory)
  if vocab.fingerprint() != meta["vocab_fingerprint"] or vocab.size != meta["vocab_size"]:
    raise DamagedCheckpointError(f"the vocabulary file in {directory} does not match meta.json's vocabulary "
                                 "fingerprint")
  mcfg = specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size)
  exports.check_arch_digest(mcfg, meta, path)  # (MT exports from before 2026-12-06 lack the digest)
  target = nnx.eval_shape(lambda: TransformerMT(mcfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(target, nnx.Param)
  abstract_params = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract_params)
  params = exports.restore_export_params(os.path.join(directory, "params"), abstract_params, meta,
                                            "MT export parameters")
  return graphdef, params, config, vocab
