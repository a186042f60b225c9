"""Orbax checkpoints for training (save / restore / resume) and the exported model that evaluation loads.

Export layout (`<workdir>/export/`):
  params/       orbax StandardCheckpointer tree of the model parameters
  config.json   the full training config
  vocab.json    the vocabulary (tokens + fingerprint)
  meta.json     fingerprints and shapes: what evaluation and datastores check against
The export is written to a temporary directory and renamed into place, so it is complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trime_jax import data
from trime_jax.errors import CheckpointError
from trime_jax.model import ModelConfig, TransformerLM, count_params

EXPORT_FILES = ("config.json", "vocab.json", "meta.json", "params")


def manager(directory: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  path = directory if "://" in directory else os.path.abspath(directory)  # gs://... passes through to orbax
  return ocp.CheckpointManager(path, options=options)


def save(mgr: ocp.CheckpointManager, step: int, state) -> None:
  mgr.save(step, args=ocp.args.StandardSave(state))


def restore_latest(mgr: ocp.CheckpointManager, abstract_state):
  """(step, state) of the newest complete checkpoint, or (None, None) if there is none."""
  step = mgr.latest_step()
  if step is None:
    return None, None
  try:
    state = mgr.restore(step, args=ocp.args.StandardRestore(abstract_state))
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
        f"checkpoint at step {step} in {mgr.directory} does not match this config's model/optimizer "
        f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); use a fresh workdir") from None
  return step, state


def abstract(tree):
  return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def export(directory: str, params, config: ml_collections.ConfigDict, vocab: data.Vocab, extra=None) -> str:
  """Write params + config + vocab + meta to `directory` atomically; returns the directory.

  Multi-host: every process calls this with the same (replicated, host-copied) params; orbax writes them
  once and synchronises the processes, process 0 writes the JSON files and renames the directory."""
  directory = os.path.abspath(directory)
  tmp = directory + ".tmp"
  chief = jax.process_index() == 0
  if chief:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
  _sync("export:start")
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(tmp, "params"), params)
  ckptr.wait_until_finished()
  if chief:
    mcfg = ModelConfig.from_config(config.model, vocab_size=len(vocab))
    meta = {
        "params_digest": params_digest(params),
        "vocab_fingerprint": vocab.fingerprint(),
        "vocab_size": len(vocab),
        "vocab_kind": vocab.kind,
        "d_model": mcfg.d_model,
        "key_type": mcfg.key_type,
        "num_params": count_params(params),
        **(extra or {}),
    }
    data.atomic_write_json(os.path.join(tmp, "config.json"), json.loads(config.to_json_best_effort()))
    data.atomic_write_json(os.path.join(tmp, "vocab.json"), vocab.to_json())
    data.atomic_write_json(os.path.join(tmp, "meta.json"), meta)
    if os.path.exists(directory):
      old = directory + ".old"
      shutil.rmtree(old, ignore_errors=True)
      os.replace(directory, old)
      os.replace(tmp, directory)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, directory)
  _sync("export:done")
  return directory


def params_digest(params) -> str:
  """SHA-256 (16 hex digits) of every parameter's path, shape, dtype and bytes."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    arr = np.asarray(jax.device_get(leaf))
    h.update(f"{jax.tree_util.keystr(path)}:{arr.shape}:{arr.dtype}".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()[:16]


def fingerprint(directory: str) -> str:
  """Identifies an exported checkpoint (datastores and indexes built from it record it): the vocabulary and
  a digest of the parameters, so two runs of the same size and length never collide."""
  meta = read_export_meta(directory)
  return f"{meta['vocab_fingerprint']}-{meta['params_digest']}"


def read_export_meta(directory: str) -> dict:
  """meta.json of an export (fingerprints, vocabulary size and kind, key dimension and type)."""
  path = os.path.join(directory, "meta.json")
  if not os.path.exists(path):
    raise CheckpointError(f"not an exported checkpoint: {path} is missing")
  with open(path) as f:
    return json.load(f)


def read_export_vocab(directory: str) -> data.Vocab:
  """vocab.json of an export, checked against its meta.json (without loading the parameters)."""
  meta = read_export_meta(directory)
  path = os.path.join(directory, "vocab.json")
  if not os.path.exists(path):
    raise CheckpointError(f"not an exported checkpoint: {path} is missing")
  with open(path) as f:
    try:
      vocab = data.Vocab.from_json(json.load(f))
    except data.DataError as e:
      raise CheckpointError(f"{path}: {e}") from None
  if vocab.fingerprint() != meta["vocab_fingerprint"] or len(vocab) != meta["vocab_size"]:
    raise CheckpointError(
        f"vocabulary mismatch in {directory}: vocab.json has {len(vocab)} tokens (fingerprint "
        f"{vocab.fingerprint()}), the checkpoint was trained with {meta['vocab_size']} "
        f"(fingerprint {meta['vocab_fingerprint']})")
  return vocab


def load_export(directory: str):
  """(graphdef, params, config, vocab, meta) from an export directory, validated."""
  directory = os.path.abspath(directory)  # orbax wants absolute paths
  if not os.path.isdir(directory):
    raise CheckpointError(f"checkpoint directory not found: {directory}")
  missing = [f for f in EXPORT_FILES if not os.path.exists(os.path.join(directory, f))]
  if missing:
    raise CheckpointError(f"incomplete checkpoint export {directory}: missing {', '.join(missing)}")
  with open(os.path.join(directory, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  meta = read_export_meta(directory)
  vocab = read_export_vocab(directory)
  mcfg = ModelConfig.from_config(config.model, vocab_size=len(vocab))
  target = nnx.eval_shape(lambda: TransformerLM(mcfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(target, nnx.Param)
  try:
    params = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), abstract_params)
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"parameters in {directory} do not match its config.json "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
  return graphdef, params, config, vocab, meta
