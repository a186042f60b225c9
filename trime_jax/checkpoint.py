"""Orbax checkpoints for training (save / restore / resume) and the exported model that evaluation loads.

Export layout (`<workdir>/export/`):
  params/       orbax StandardCheckpointer tree of the model parameters
  config.json   the full training config
  vocab.json    the vocabulary (tokens + fingerprint)
  meta.json     fingerprints and shapes: what evaluation and datastores check against
The export is written to a temporary directory and renamed into place, so it is complete or absent.

Verified on every load: the JSON files parse, vocab.json matches meta.json's vocabulary fingerprint,
config.json's architecture matches meta.json's `arch_digest`, the stored parameter shapes match the
architecture, and the restored parameters' bytes match `params_digest` (a flipped byte is refused, not
evaluated). Training checkpoints are checked the same way (files present, shapes, readable); a damaged newest
checkpoint is moved aside to `<workdir>/checkpoints_damaged/` and training resumes from the previous one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time

import jax
import ml_collections
from absl import logging as absl_logging
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trime_jax import data
from trime_jax.errors import CheckpointError, DamagedCheckpointError
from trime_jax.model import build_model, count_params, model_config

EXPORT_FILES = ("config.json", "vocab.json", "meta.json", "params")


def manager(directory: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  path = directory if "://" in directory else os.path.abspath(directory)  # gs://... passes through to orbax
  return ocp.CheckpointManager(path, options=options)


def save(mgr: ocp.CheckpointManager, step: int, state) -> None:
  mgr.save(step, args=ocp.args.StandardSave(state))


def restore_latest(mgr: ocp.CheckpointManager, abstract_state, log=print):
  """(step, state) of the newest intact checkpoint, or (None, None) if there is none.

  A damaged checkpoint (a file missing, truncated or unreadable) is moved aside to
  `<checkpoints>_damaged/<step>` (kept for inspection, out of the manager's way) and the previous one is
  tried, saying so; one whose shapes do not match this config's model/optimizer is an error."""
  steps = sorted(mgr.all_steps(), reverse=True)
  for i, step in enumerate(steps):
    path = os.path.join(str(mgr.directory), str(step), "default")
    try:
      state = _restore_checked(path, abstract_state, f"checkpoint at step {step} in {mgr.directory}",
                               lambda: mgr.restore(step, args=ocp.args.StandardRestore(abstract_state)))
    except DamagedCheckpointError as e:
      prev = steps[i + 1] if i + 1 < len(steps) else None
      aside = _move_aside(str(mgr.directory), step)
      if prev is None:
        raise DamagedCheckpointError(f"{e}; no earlier checkpoint is left (moved the damaged one to {aside}): "
                                     "rerun to start from step 0, or restore the files") from None
      log(f"warning: {e}; moved it to {aside} and falling back to the checkpoint at step {prev}")
      mgr.reload()
      continue
    return step, state
  return None, None


def _move_aside(directory: str, step: int) -> str:
  """Move a damaged step directory out of the manager's directory (orbax would otherwise list it)."""
  if "://" in directory:  # remote storage (gs://...): no atomic rename; the user decides
    raise DamagedCheckpointError(f"checkpoint {directory}/{step} is damaged; delete that step directory to resume "
                                 "from the previous one")
  dest_root = directory.rstrip("/") + "_damaged"
  dest = os.path.join(dest_root, str(step))
  if jax.process_index() == 0:
    os.makedirs(dest_root, exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(os.path.join(directory, str(step)), dest)
  _sync(f"move_aside:{step}")
  return dest


_REQUIRED = ("_METADATA", "manifest.ocdbt")  # written by orbax's StandardCheckpointer (OCDBT format)


def _leaf_specs(tree) -> list:
  """Sorted (shape, dtype) of every array leaf: a structure-independent summary to compare with orbax's
  metadata (whose containers are plain dicts where the live tree has nnx.State / optax tuples)."""
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  return sorted((tuple(int(d) for d in x.shape), str(np.dtype(x.dtype))) for x in leaves if hasattr(x, "shape"))


def _restore_checked(path: str, abstract_tree, what: str, restore):
  """`restore()` after checking the files at `path`: DamagedCheckpointError for missing or unreadable files;
  a failed restore is CheckpointError when the stored shapes differ from `abstract_tree`'s (another model or
  optimizer), else damaged data files."""
  if "://" not in path:
    missing = [f for f in _REQUIRED if not os.path.exists(os.path.join(path, f))]
    if missing:
      raise DamagedCheckpointError(f"{what} is damaged: {', '.join(os.path.join(path, f) for f in missing)} "
                                   "is missing")
  try:
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # a manager's item dir has no _CHECKPOINT_METADATA: orbax warns
    try:
      meta = ocp.StandardCheckpointer().metadata(path)
    finally:
      absl_logging.set_verbosity(verbosity)
    stored = getattr(meta, "item_metadata", meta)
    stored = getattr(stored, "tree", stored)
  except Exception as e:  # noqa: BLE001 - any unreadable metadata means damaged files
    raise DamagedCheckpointError(f"{what} is damaged: its metadata cannot be read ({_first_line(e)})") from None
  if stored is None:
    raise DamagedCheckpointError(f"{what} is damaged: its metadata ({path}/_METADATA) cannot be read")
  have, want = _leaf_specs(stored), _leaf_specs(abstract_tree)
  try:
    return restore()
  except Exception as e:  # noqa: BLE001 - classified below: another model, or damaged data files
    if have != want:
      diff = next((f"{a[1]}{list(a[0])} stored vs {b[1]}{list(b[0])} expected" for a, b in zip(have, want) if a != b),
                  f"{len(have)} arrays stored vs {len(want)} expected")
      raise CheckpointError(f"{what} does not match this config's model/optimizer ({diff}); use a fresh "
                            "workdir") from None
    raise DamagedCheckpointError(f"{what} is damaged: a data file cannot be read ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = text.split(" See full TensorStore details")[0]  # the rest is a bound-method repr
  return f"{type(e).__name__}: {text[:200]}"


# Fields a resumed run may change without --config.train.allow_config_change: they do not change the trained
# parameters (logging, checkpoint cadence, evaluation, caching) or only extend the run (num_steps).
RESUMABLE_CHANGES = ("train.num_steps", "train.log_every", "train.eval_every", "train.eval_max_tokens",
                     "train.checkpoint_every", "train.keep_checkpoints", "train.allow_config_change",
                     "train.keep_best", "train.tensorboard", "train.progress", "train.profile_steps",
                     "data.cache_dir", "eval.")


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
  return out


def check_resume_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Before resuming `workdir`, compare its config.json with `config`; then write `config` there.

  Differences outside RESUMABLE_CHANGES are refused (naming the fields) unless train.allow_config_change;
  every difference is appended to config_changes.jsonl. A field absent on one side (a code version that adds
  or drops a field) is not a difference. Nothing to resume (no checkpoint yet): config.json is just written."""
  path = os.path.join(workdir, "config.json")
  new = json.loads(config.to_json_best_effort())
  # Multi-process: process 0 decides (hosts may differ in host-local fields such as data.path) and tells the
  # others, so that every process stops or none does.
  problem = _resume_problem(workdir, path, config, new) if jax.process_index() == 0 else None
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    if int(multihost_utils.broadcast_one_to_all(np.int32(problem is not None))) and problem is None:
      problem = f"process 0 refused to resume workdir {workdir} (see its error line)"
  if problem:
    raise CheckpointError(problem)
  if jax.process_index() == 0:
    data.atomic_write_json(path, new)


def _resume_problem(workdir: str, path: str, config, new: dict) -> str | None:
  """check_resume_config's comparison on process 0: the error message, or None (changes recorded)."""
  ckpts = os.path.join(workdir, "checkpoints")
  resuming = os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts))
  if resuming and os.path.exists(path):
    old = _flat(read_json(path, "workdir config", CheckpointError))
    flat_new = _flat(new)
    diff = {k: [old[k], flat_new[k]] for k in sorted(old.keys() & flat_new.keys()) if old[k] != flat_new[k]}
    blocking = [k for k in diff if not k.startswith(RESUMABLE_CHANGES)]
    if blocking and not config.train.get("allow_config_change", False):
      shown = "; ".join(f"{k}: {diff[k][0]!r} there, {diff[k][1]!r} now" for k in blocking[:8])
      more = f" (+{len(blocking) - 8} more)" if len(blocking) > 8 else ""
      return (f"workdir {workdir} holds a run with other settings ({shown}{more}): use another --workdir, or pass "
              "--config.train.allow_config_change=True to resume it with these settings (recorded in "
              "config_changes.jsonl)")
    if diff:
      with open(os.path.join(workdir, "config_changes.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changes": diff,
                            "allowed": bool(blocking)}) + "\n")
      print(f"config changes recorded in {os.path.join(workdir, 'config_changes.jsonl')}: "
            + ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in diff.items()), flush=True)
  return None


def abstract(tree):
  return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def replace_directory(tmp: str, directory: str) -> None:
  """Move the finished `tmp` to `directory`, replacing an older one: a reader sees the old or the new one."""
  if os.path.exists(directory):
    old = directory + ".old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.replace(tmp, directory)


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
    mcfg = model_config(config.model, vocab_size=len(vocab))
    meta = {
        "params_digest": params_digest(params),
        "arch_digest": arch_digest(mcfg),
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
    replace_directory(tmp, directory)
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


# ModelConfig fields added after exports existed, with the value that reproduces the behaviour from before
# them: left out of the digest at that value, so earlier exports keep their digest (and fingerprint).
LATER_FIELDS = {"adaptive_tail_ignores_pad": False}


def arch_digest(mcfg) -> str:
  """SHA-256 (16 hex digits) of the architecture: every ModelConfig field but the dropouts (which do not change
  what a trained model computes at evaluation). Shape-compatible edits (num_heads 4 -> 8) change it."""
  fields = {k: v for k, v in dataclasses.asdict(mcfg).items() if "dropout" not in k
            and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
  return hashlib.sha256(json.dumps(fields, sort_keys=True, default=list).encode()).hexdigest()[:16]


def fingerprint(directory: str) -> str:
  """Identifies an exported checkpoint (datastores and indexes built from it record it): the vocabulary, a
  digest of the parameters and (exports since arch_digest) of the architecture."""
  meta = read_export_meta(directory)
  fp = f"{meta['vocab_fingerprint']}-{meta['params_digest']}"
  return f"{fp}-{meta['arch_digest']}" if "arch_digest" in meta else fp


def read_json(path: str, what: str, error=CheckpointError):
  """A JSON file, or `error` naming the file when it is missing, unreadable or truncated."""
  if not os.path.exists(path):
    raise error(f"{what} {path} is missing")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise error(f"{what} {path} is corrupt or truncated ({_first_line(e)})") from None


def read_export_meta(directory: str) -> dict:
  """meta.json of an export (fingerprints, vocabulary size and kind, key dimension and type)."""
  path = os.path.join(directory, "meta.json")
  if not os.path.exists(path):
    raise CheckpointError(f"not an exported checkpoint: {path} is missing")
  meta = read_json(path, "export meta", DamagedCheckpointError)
  missing = [k for k in ("params_digest", "vocab_fingerprint", "vocab_size", "d_model", "key_type") if k not in meta]
  if missing:
    raise DamagedCheckpointError(f"export meta {path} lacks {', '.join(missing)}")
  return meta


def read_export_vocab(directory: str) -> data.Vocab:
  """vocab.json of an export, checked against its meta.json (without loading the parameters)."""
  meta = read_export_meta(directory)
  path = os.path.join(directory, "vocab.json")
  if not os.path.exists(path):
    raise CheckpointError(f"not an exported checkpoint: {path} is missing")
  obj = read_json(path, "export vocabulary", DamagedCheckpointError)
  try:
    vocab = data.Vocab.from_json(obj)
  except (data.DataError, KeyError, TypeError) as e:
    raise DamagedCheckpointError(f"export vocabulary {path} is damaged: {e}") from None
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
  config_path = os.path.join(directory, "config.json")
  config = ml_collections.ConfigDict(read_json(config_path, "export config", DamagedCheckpointError))
  meta = read_export_meta(directory)
  vocab = read_export_vocab(directory)
  try:
    mcfg = model_config(config.model, vocab_size=len(vocab))
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    raise DamagedCheckpointError(f"export config {config_path} has no valid model section ({_first_line(e)})") from None
  if "arch_digest" in meta and arch_digest(mcfg) != meta["arch_digest"]:
    raise DamagedCheckpointError(
        f"{config_path} describes another architecture than the one exported (arch digest {arch_digest(mcfg)} != "
        f"meta.json's {meta['arch_digest']}): was config.json's model section edited? Restore it")
  target = nnx.eval_shape(lambda: build_model(mcfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(target, nnx.Param)
  params_dir = os.path.join(directory, "params")
  params = _restore_checked(params_dir, abstract_params, f"exported parameters {params_dir}",
                            lambda: ocp.StandardCheckpointer().restore(params_dir, abstract_params))
  digest = params_digest(params)
  if digest != meta["params_digest"]:
    raise DamagedCheckpointError(
        f"exported parameters {params_dir} are damaged: their digest {digest} != meta.json's params_digest "
        f"{meta['params_digest']} (the files changed after export); re-export by rerunning training in its workdir")
  return graphdef, params, config, vocab, meta
