"""The exported model that evaluation, datastores, generation and the Python API load (`<workdir>/export/`).

Layout:
  params/       orbax StandardCheckpointer tree of the model parameters
  config.json   the full training config
  vocab.json    the vocabulary (tokens + fingerprint)
  meta.json     fingerprints and shapes: what evaluation and datastores check against
The export is written to a temporary directory and renamed into place, so it is complete or absent
(docs/export_format.md describes every file).

Verified on every load: the JSON files parse, vocab.json matches meta.json's vocabulary fingerprint,
config.json's architecture matches meta.json's `arch_digest`, the stored parameter shapes match the
architecture (`checkpoint.restore_checked`), and the restored parameters' bytes match `params_digest` (a
flipped byte is refused, not evaluated). `export` refuses a non-empty target that is not an export of the same
model (architecture, vocabulary, training data) unless `overwrite=True`, and holds `<export>.lock` while it
writes. The translation model's export (`mt.export`) is written and read with the same `write_export` /
`restore_export_params`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil

import jax
import ml_collections
import numpy as np
from flax import nnx

from trime_jax import data
from trime_jax.checkpoint import DIGEST_FILE, leaf_specs, ocp, restore_checked, specs_difference  # ocp: orbax
from trime_jax.distributed import on_chief
from trime_jax.errors import CheckpointError, ConfigError, DamagedCheckpointError, first_line
from trime_jax.model import build_model, count_params
from trime_jax.runtime.lock import beside as lock_beside
from trime_jax.runtime import workdir as workdir_files
from trime_jax.specs import model_config

EXPORT_FILES = ("config.json", "vocab.json", "meta.json", "params")


# What makes an export "the same model" for `export`'s refusal: re-exporting a training run (a rerun, a longer
# run, a new best) keeps these; another model, vocabulary or training corpus changes one of them.
IDENTITY_FIELDS = ("arch_digest", "vocab_fingerprint", "train_fingerprint")


def export_target_problem(directory: str, meta: dict) -> str | None:
  """Why writing an export with `meta` to `directory` would replace something else (None: absent, empty, or an
  export of the same model)."""
  if not os.path.lexists(directory):
    return None
  if not os.path.isdir(directory):
    return "is a file"
  names = sorted(os.listdir(directory))
  if not names:
    return None
  try:
    with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
      there = json.load(f)
  except (OSError, ValueError, UnicodeDecodeError):
    there = None
  if not isinstance(there, dict) or "params_digest" not in there:
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    many = len(names) != 1
    return f"holds {len(names)} file{'s' if many else ''} that {'are' if many else 'is'} not an export ({shown})"
  # (Exports from before arch_digest lack it: compared on the other fields.)
  differ = [k for k in IDENTITY_FIELDS if there.get(k) != meta.get(k) and not (k == "arch_digest" and k not in there)]
  if differ:
    shown = ", ".join(f"{k} {there.get(k)!r} there, {meta.get(k)!r} now" for k in differ)
    return f"holds an export of another model ({shown})"
  return None


def _export_meta(config, vocab: data.Vocab, extra=None) -> dict:
  mcfg = model_config(config, vocab_size=len(vocab))
  return {"arch_digest": arch_digest(mcfg), "vocab_fingerprint": vocab.fingerprint(), "vocab_size": len(vocab),
          "vocab_kind": vocab.kind, "d_model": mcfg.d_model, "key_type": mcfg.key_type, **(extra or {})}


def check_export_target(directory: str, config, vocab: data.Vocab, extra=None, *, meta=None) -> None:
  """`export`'s refusal, before the work that leads to the export (training checks its export/ and best/ up
  front, so a run is not lost to a refused export at its end). `meta`: the identity to compare when the export is
  not the LM's (the translation trainer's: its vocabulary fingerprint); default: the LM export's."""
  directory = os.path.abspath(directory)
  problem = export_target_problem(directory, _export_meta(config, vocab, extra) if meta is None else meta)
  if problem:
    raise CheckpointError(f"export target {directory} {problem}: move it away or choose another --workdir")


def export(directory: str, params, config: ml_collections.ConfigDict, vocab: data.Vocab, extra=None, *,
           overwrite: bool = False) -> str:
  """Write params + config + vocab + meta to `directory` atomically; returns the directory.

  A non-empty `directory` that is not an export of the same model (IDENTITY_FIELDS: architecture, vocabulary,
  training data) is refused (CheckpointError naming what is there) unless `overwrite`; one writer at a time
  (`<directory>.lock`, LockedError naming the holder). Multi-host: every process calls this with the same
  (replicated, host-copied) params; orbax writes them once and synchronises the processes, process 0 checks,
  writes the JSON files and renames the directory."""
  # Parameters of another shape than the config's model would be written, then loaded into the wrong model
  want = leaf_specs(nnx.split(nnx.eval_shape(lambda: build_model(model_config(config, vocab_size=len(vocab)),
                                                                 rngs=nnx.Rngs(0))), nnx.Param)[1])
  diff = specs_difference(leaf_specs(params), want, "given")
  if diff:
    raise CheckpointError(f"export to {directory}: the parameters do not match the config's model and vocabulary "
                          f"({diff})")
  chief = jax.process_index() == 0
  meta = {} if not chief else {  # process 0 writes the files
      "params_digest": params_digest(params), **_export_meta(config, vocab, extra),
      "num_params": count_params(params)}

  def files(tmp):
    data.atomic_write_json(os.path.join(tmp, "config.json"), json.loads(config.to_json_best_effort()))
    data.atomic_write_json(os.path.join(tmp, "vocab.json"), vocab.to_json())

  return write_export(directory, params, meta, files, overwrite=overwrite)


def write_export(directory: str, params, meta: dict, write_files, *, overwrite: bool = False) -> str:
  """The export writer both models use (`export`, `mt.export.export_mt`): under `<directory>.lock`, refuse a
  non-empty target of another kind or model (unless `overwrite`), write the parameters with orbax into
  `<directory>.tmp`, then (process 0) `write_files(tmp)` and meta.json, and rename it into place: the export is
  complete or absent. (Multi-host: a refusal on process 0 stops every process: `distributed.on_chief`.)"""
  directory = os.path.abspath(directory)
  tmp = directory + ".tmp"

  def start(held: contextlib.ExitStack) -> None:
    held.enter_context(lock_beside(directory, f"export directory {directory}"))
    data.recover_replaced(directory)  # a writer killed mid-replacement: the previous export is compared, then replaced
    problem = None if overwrite else export_target_problem(directory, meta)
    if problem:
      raise CheckpointError(f"export target {directory} {problem}: choose another directory, or overwrite it "
                            "explicitly (exports.export(..., overwrite=True); the CLIs' --overwrite)")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

  with contextlib.ExitStack() as held:
    on_chief(lambda: start(held))  # every process stops, or none
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(tmp, "params"), params)
    ckptr.wait_until_finished()

    def finish() -> None:
      write_files(tmp)
      data.atomic_write_json(os.path.join(tmp, "meta.json"),
                             {**meta, "params_files": params_file_sizes(os.path.join(tmp, "params"))})
      data.replace_directory(tmp, directory)

    on_chief(finish)  # the others wait for it: the export is in place (or every process stops) when this returns
  return directory


def stale_export_note(workdir: str) -> str | None:
  """What a reader of a training workdir's export/ should know when it may not be the run's latest (None
  otherwise): an export into it was interrupted (`export.tmp` left; export/ is the earlier one, whole), or the
  run's checkpoints reach past the update export/ holds (training stopped before exporting again)."""
  export_dir = os.path.join(workdir, "export")
  try:
    step = int(read_export_meta(export_dir).get("step", -1))
  except (CheckpointError, ValueError, TypeError):
    return None  # the reader says what is wrong with it
  ckpts = os.path.join(workdir, "checkpoints")
  newest = max((int(n) for n in (os.listdir(ckpts) if os.path.isdir(ckpts) else ()) if n.isdigit()), default=-1)
  said = []
  if os.path.isdir(export_dir + ".tmp"):
    said.append(f"an export into {export_dir} was interrupted ({export_dir}.tmp is left)")
  if step >= 0 and newest > step:
    said.append(f"the run's checkpoints reach update {newest:,}")
  if not said:
    return None
  return (f"{export_dir} holds update {step:,}, but " + " and ".join(said) + ": rerun the training command to "
          "finish and export the run (it resumes from its checkpoints); using the export as it is")


def params_file_sizes(params_dir: str) -> dict:
  """{path under params/: size in bytes} of every file orbax wrote (meta.json's `params_files`)."""
  out = {}
  for root, _, names in os.walk(params_dir):
    for name in names:
      path = os.path.join(root, name)
      out[os.path.relpath(path, params_dir)] = os.path.getsize(path)
  return dict(sorted(out.items()))


def check_params_files(params_dir: str, meta: dict, what: str) -> None:
  """DamagedCheckpointError naming the first parameter file that is missing or whose size differs from
  meta.json's `params_files` (a truncated copy, a half-finished download); exports written before the field
  are not checked here. Checked before orbax reads them: a read that fails midway leaves orbax's background
  readers printing tracebacks after the error."""
  want = meta.get("params_files")
  if not isinstance(want, dict) or "://" in params_dir:
    return
  for rel, size in sorted(want.items()):
    path = os.path.join(params_dir, rel)
    if not os.path.isfile(path):
      raise DamagedCheckpointError(f"{what} is damaged: {path} is missing")
    have = os.path.getsize(path)
    if have != size:
      raise DamagedCheckpointError(f"{what} is damaged: {path} has {have:,} bytes, {size:,} when exported "
                                   f"({'truncated' if have < size else 'grown'}: copy the export again)")


def restore_export_params(params_dir: str, abstract_params, meta: dict, what: str):
  """An export's parameters, restored after the file checks (meta.json's `params_files`, then `restore_checked`)
  and compared with meta.json's `params_digest`: DamagedCheckpointError naming `params_dir` when the bytes
  changed after export. Returned on the default device: orbax restores an unsharded target as host NumPy, and a
  jit argument given as NumPy is copied to the device on every call (a 247M model's 1 GB per evaluation step
  or datastore batch)."""
  check_params_files(params_dir, meta, f"{what} {params_dir}")
  params = restore_checked(params_dir, abstract_params, f"{what} {params_dir}",
                            lambda: ocp.StandardCheckpointer().restore(params_dir, abstract_params))
  digest = params_digest(params)
  if digest != meta["params_digest"]:
    raise DamagedCheckpointError(
        f"{what} {params_dir} are damaged: their digest {digest} != meta.json's params_digest "
        f"{meta['params_digest']} (the files changed after export); re-export by rerunning training in its workdir")
  return jax.device_put(params)


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
# ModelConfig fields that say how the model is computed on a device, not what it computes (issue 37's speed
# options): never part of the digest, changeable when a run resumes, and an export loads with them at these
# defaults (a model trained with cuDNN attention or remat evaluates anywhere, e.g. on a CPU).
EXECUTION_FIELDS = {"attention_impl": "xla", "dropout_mask": "nnx", "remat": "none", "adaptive_tail_rows": 1.0}
# ModelConfig fields that say how a trained model is evaluated (a protocol, as the dropouts say how it trains),
# not what it is: never part of the digest, so an export's config.json may change them (SRU++'s attention span
# at evaluation: the reference's same_length mask or the whole memory).
PROTOCOL_FIELDS = ("eval_same_length",)


def arch_digest(mcfg) -> str:
  """SHA-256 (16 hex digits) of the architecture: every ModelConfig field but the dropouts (which do not change
  what a trained model computes at evaluation), the EXECUTION_FIELDS and the PROTOCOL_FIELDS. Shape-compatible edits (num_heads
  4 -> 8) change it."""
  fields = {k: v for k, v in dataclasses.asdict(mcfg).items() if "dropout" not in k and k not in EXECUTION_FIELDS
            and k not in PROTOCOL_FIELDS and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
  return hashlib.sha256(json.dumps(fields, sort_keys=True, default=list).encode()).hexdigest()[:16]


def check_arch_digest(mcfg, meta: dict, config_path: str) -> None:
  """An edit of config.json's model section that keeps the parameter shapes (num_heads, key_type, normalisation
  order, positions) would load and compute something else: DamagedCheckpointError. Exports written before
  arch_digest lack it and are not checked. Language-model and translation exports alike."""
  if "arch_digest" in meta and arch_digest(mcfg) != meta["arch_digest"]:
    raise DamagedCheckpointError(
        f"{config_path} describes another architecture than the one exported (arch digest {arch_digest(mcfg)} != "
        f"meta.json's {meta['arch_digest']}): was config.json's model section edited? Restore it")


def fingerprint(directory: str) -> str:
  """Identifies an exported checkpoint (datastores and indexes built from it record it): the vocabulary, a
  digest of the parameters and (exports since arch_digest) of the architecture."""
  meta = read_export_meta(directory)
  fp = f"{meta['vocab_fingerprint']}-{meta['params_digest']}"
  return f"{fp}-{meta['arch_digest']}" if "arch_digest" in meta else fp


def read_export_meta(directory: str) -> dict:
  """meta.json of an export (fingerprints, vocabulary size and kind, key dimension and type)."""
  path = os.path.join(directory, "meta.json")
  if not os.path.exists(path):
    raise CheckpointError(what_else_it_is(directory) or f"not an exported checkpoint: {path} is missing")
  meta = data.read_json(path, "export meta", DamagedCheckpointError)
  missing = [k for k in ("params_digest", "vocab_fingerprint", "vocab_size", "d_model", "key_type") if k not in meta]
  if missing:
    raise DamagedCheckpointError(f"export meta {path} lacks {', '.join(missing)}")
  return meta


def read_export_vocab(directory: str) -> data.Vocab:
  """vocab.json of an export, checked against its meta.json (without loading the parameters)."""
  meta = read_export_meta(directory)
  path = os.path.join(directory, "vocab.json")
  if not os.path.exists(path):
    raise CheckpointError(what_else_it_is(directory) or f"not an exported checkpoint: {path} is missing")
  obj = data.read_json(path, "export vocabulary", DamagedCheckpointError)
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


MT_EXPORT_MESSAGE = ("{directory} is a machine-translation export: translate with trime_jax.launch.translate "
                     "--checkpoint (Python: trime_jax.mt.export.load_mt_export)")


def _meta_fields(directory: str) -> tuple:
  """(model_family, format) of `directory`'s meta.json; (None, None) where there is none or it is unreadable."""
  try:
    with open(os.path.join(directory, "meta.json")) as f:
      read = json.load(f)
    return read.get("model_family"), read.get("format", "")
  except (OSError, ValueError, AttributeError):
    return None, None


def is_mt_export(directory: str) -> bool:
  """An export of the translation model (meta.json's model_family "mt")."""
  return _meta_fields(directory)[0] == "mt"


def config_dir_problem(path: str, given: str = "") -> str | None:
  """Why `path` gives no export config to read (None where it does): not found (in load_export's words), a file,
  or a folder without config.json (what else it is, as load_export says it: `what_else_it_is`). `given`: how
  the user named it (e.g. "--checkpoint=runs/x"), for the line about a file."""
  if not os.path.exists(path):
    return f"checkpoint directory not found: {os.path.abspath(path)}"
  if not os.path.isdir(path):
    return f"{given or path} is a file, not an export directory (config.json, meta.json, params/, vocab.json)"
  if not os.path.isfile(os.path.join(path, "config.json")):
    return what_else_it_is(path) or (f"{path} is not an export: it has no config.json (an export holds "
                                     "config.json, meta.json, params/ and vocab.json)")
  return None


def what_else_it_is(directory: str) -> str | None:
  """Why `directory`, not an LM export, is something else a user may pass for one (None: nothing we know of,
  then it is an incomplete export): a machine-translation export, a training workdir that has not exported
  yet, one step of its checkpoints, a folder inside an export, or a datastore. The one line load_export raises."""
  join = lambda *p: os.path.join(directory, *p)
  if os.path.isfile(join("meta.json")):
    family, fmt = _meta_fields(directory)
    if family == "mt":
      return MT_EXPORT_MESSAGE.format(directory=directory)
    if str(fmt).startswith("trime-datastore"):
      return (f"{directory} is a datastore (keys of a model's tokens), not an export: load the model it was "
              "built from and pass this folder as datastore= (score / generate with memory='external')")
    return None
  parent = os.path.dirname(directory)
  if os.path.isfile(os.path.join(parent, "meta.json")) and os.path.basename(directory) == "params":
    return f"{directory} is the parameters folder of the export {parent}: pass {parent}"
  if os.path.isfile(join(DIGEST_FILE)) or os.path.exists(join("_CHECKPOINT_METADATA")) or (
      os.path.basename(parent) == "checkpoints" and os.path.basename(directory).isdigit()):
    return (f"{directory} is a training checkpoint (one step of {parent}), not an export: training exports to "
            f"{os.path.join(os.path.dirname(parent), 'export')} when it finishes (rerun its command to resume)")
  if os.path.basename(os.path.abspath(directory)) == "checkpoints" and any(
      n.isdigit() for n in (os.listdir(directory) if os.path.isdir(directory) else ())):
    run = os.path.dirname(os.path.abspath(directory))  # (the path as given may end in "/" or be "checkpoints")
    return (f"{directory} holds a training run's checkpoints, not an export: pass the run's workdir {run} "
            f"(its export/, written when training finishes) or {os.path.join(run, 'best')} (the best so far)")
  if os.path.isdir(join("checkpoints")) or os.path.isdir(join("best")):
    best = join("best")
    has_best = os.path.isfile(os.path.join(best, "meta.json"))
    return (f"{directory} is a training workdir that has not exported yet (training is still running, or "
            "was stopped: rerun its command to resume; it exports to export/ when it finishes)"
            + (f"; {best} holds the best parameters by dev perplexity so far: pass that" if has_best else ""))
  return None


def is_mt_config(config) -> bool:
  """A translation config (its own schema, read by trime_jax.mt): task="mt", or a data section with languages
  (configs/ui_de_en.py, configs/iwslt_de_en.py). `config`: a ConfigDict, or an export's stored config.json as
  a dict; None is no config."""
  if config is None:
    return False
  section = config.get("data")
  return config.get("task") == "mt" or (hasattr(section, "get") and section.get("src_lang") is not None)


def check_stored_config(export_dir: str, stored: dict | None = None) -> dict:
  """The export's config.json as a dict, with renamed fields under today's names (runtime.workdir.migrate_config),
  refused (CheckpointError naming the file) when it has fields this version does not know: they would be ignored
  without a word. Translation exports are read by their own schema and only parsed here."""
  path = os.path.join(export_dir, "config.json")
  try:  # the one stored-config reader: missing / truncated files named; renamed fields under today's names
    if stored is None:
      stored = workdir_files.read_stored_config(path, "stored config (give --config, or an export directory):",
                                                CheckpointError)
    elif isinstance(stored, dict):
      stored = workdir_files.migrate_config(stored, path)
  except ConfigError as e:  # a field under both its old and new names, with different values
    raise CheckpointError(str(e)) from None
  if not isinstance(stored, dict):
    raise CheckpointError(f"{path} is not a config (a JSON object)")
  if not is_mt_config(stored):
    from trime_jax.configs import default

    workdir_files.check_known_fields(stored, default.get_config(), path, CheckpointError)
  return stored


def _overlay(dst, src: dict, path: str = "", prefix: str = "", error: type[Exception] = CheckpointError,
             fix: str = "correct the file", none_ok: bool = True) -> None:
  """`src`'s fields over the config `dst`, each of its field's type. `none_ok=False`: None refused where the field
  is not None (a ConfigDict takes None for any field, a section too, and the first read of it fails)."""
  for key, value in src.items():
    if key not in dst:
      continue  # a translation export's own fields (check_stored_config refused unknown LM fields)
    if value is None and not none_ok and dst[key] is not None:
      raise error(f"{path or 'the stored config'}: {prefix}{key}=None, where the field is {_field_kind(dst[key])}; "
                  f"{fix}")
    if hasattr(dst[key], "keys") and isinstance(value, dict):
      _overlay(dst[key], value, path, f"{prefix}{key}.", error, fix, none_ok)
    else:
      try:
        dst[key] = tuple(value) if isinstance(dst[key], tuple) and isinstance(value, list) else value
      except (TypeError, ValueError):  # ConfigDict keeps each field's type: "x" for a float, a list for an int
        raise error(f"{path or 'the stored config'}: {prefix}{key}={value!r} is not {_field_kind(dst[key])} (the "
                    f"field's type); {fix}") from None


def _field_kind(value) -> str:
  """What a config field holds, for messages: "a section", "an int", "a float", ..."""
  if hasattr(value, "keys"):
    return "a section"
  name = type(value).__name__
  return f"a{'n' * (name[0] in 'aeiou')} {name}"


def config_from_dict(fields: dict) -> ml_collections.ConfigDict:
  """A language-model config from a plain dict (`trime_jax.train(dict)`, e.g. a config's `to_dict()` or a
  config.json read back): configs/default.py with `fields` over it, as an export's stored config is read
  (`stored_over_defaults`): a field the dict lacks keeps its default, a renamed one is read under today's name,
  a misspelt one is refused, and each field keeps its type. One ConfigError for what is wrong."""
  from trime_jax.configs import default

  fields = workdir_files.migrate_config(fields, "the config")
  workdir_files.check_known_fields(fields, default.get_config())
  return _over_defaults(fields, "the config", error=ConfigError, fix="give a value of that type", none_ok=False)


def _over_defaults(fields: dict, where: str, **overlay) -> ml_collections.ConfigDict:
  """configs/default.py with `fields` over it (`_overlay`'s checks): the one reading of a dict as an LM config,
  for a dict given in Python (`config_from_dict`) and an export's config.json (`stored_over_defaults`)."""
  from trime_jax.configs import default

  c = default.get_config()
  with c.unlocked():
    _overlay(c, fields, where, **overlay)
  return c


def data_path_meta(config) -> dict:
  """{"data_path": the training data's absolute path} for meta.json (nothing for a corpus without a local path):
  the stored config keeps data.path as given, which, when relative, names the data only from the directory the
  training ran in (or the repository's root). Read back by `stored_over_defaults`."""
  from trime_jax import corpora

  path = corpora.resolve_path(str(config.data.get("path", "") or ""))
  return {"data_path": os.path.abspath(path)} if path and os.path.exists(path) else {}  # a local file or folder


def _recorded_data_path(export_dir: str, path: str) -> str:
  """`path` (the stored data.path), or the absolute one meta.json recorded at training (`data_path_meta`) where
  `path` is relative, is not found from here, and the recorded one exists: an export evaluates from any
  directory, on the data the training read (its splits read as from any data.path)."""
  from trime_jax import corpora

  if not path or os.path.isabs(path) or os.path.exists(corpora.resolve_path(path)):
    return path
  try:
    recorded = read_export_meta(export_dir).get("data_path")
  except CheckpointError:  # said by the export's loader, which reads it next
    return path
  return recorded if isinstance(recorded, str) and os.path.isabs(recorded) and os.path.exists(recorded) else path


def stored_over_defaults(export_dir: str, stored: dict | None = None) -> ml_collections.ConfigDict:
  """The config an export runs with when no other is given (every CLI's `--checkpoint` without `--config`, and
  `trime_jax.load`): configs/default.py with the export's stored fields over it (`check_stored_config`), so a
  field added after the export was written keeps its default and a misspelt one is refused. `stored`: the
  export's config.json already read (load_export's config), else it is read here."""
  stored = check_stored_config(export_dir, stored)
  c = _over_defaults(stored, os.path.join(export_dir, "config.json"))
  if export_dir:
    c.data.path = _recorded_data_path(export_dir, c.data.path)
  return c


def load_export(directory: str):
  """(graphdef, params, config, vocab, meta) from an export directory, validated."""
  if not str(directory or "").strip():  # "" would be the working directory, read as a broken export
    raise CheckpointError("the checkpoint is an empty path: give an export directory")
  directory = os.path.abspath(directory)  # orbax wants absolute paths
  if not os.path.isdir(directory):
    raise CheckpointError(f"checkpoint directory not found: {directory}")
  missing = [f for f in EXPORT_FILES if not os.path.exists(os.path.join(directory, f))]
  if missing:  # a translation export, a workdir, a checkpoint step... (each lacks one of the files) or a torn export
    raise CheckpointError(what_else_it_is(directory)
                          or f"incomplete checkpoint export {directory}: missing {', '.join(missing)}")
  config_path = os.path.join(directory, "config.json")
  # An export written before a field was renamed loads under today's names (runtime.workdir.RENAMED_FIELDS).
  config = ml_collections.ConfigDict(workdir_files.read_stored_config(config_path, "export config",
                                                                      DamagedCheckpointError))
  stored_over_defaults(directory, config.to_dict())  # each field of the type it has (a traceback later, else)
  meta = read_export_meta(directory)
  vocab = read_export_vocab(directory)
  try:
    mcfg = model_config(config, vocab_size=len(vocab))
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    raise DamagedCheckpointError(f"export config {config_path} has no valid model section ({first_line(e)})") from None
  check_arch_digest(mcfg, meta, config_path)
  # how it trained on its device is not how it must run here (the backbones that have the fields: SRU++ has none)
  own = {f.name for f in dataclasses.fields(mcfg)}
  mcfg = dataclasses.replace(mcfg, **{k: v for k, v in EXECUTION_FIELDS.items() if k in own})
  target = nnx.eval_shape(lambda: build_model(mcfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(target, nnx.Param)
  params = restore_export_params(os.path.join(directory, "params"), abstract_params, meta, "exported parameters")
  return graphdef, params, config, vocab, meta


# Models shipped inside the package (trime_jax/pretrained/NAME: an export), loaded by name from any directory.
# demo: make demo's TrimeLM (configs/demo.py: byte-level, 3 layers, d 128, 628k parameters, 300 updates on this
# interpreter's standard-library sources; how it was made: trime_jax/pretrained/README.md).
PRETRAINED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrained")


def pretrained_names() -> list[str]:
  """The names `load` accepts besides paths: the exports shipped in trime_jax/pretrained/."""
  if not os.path.isdir(PRETRAINED_DIR):
    return []
  return sorted(n for n in os.listdir(PRETRAINED_DIR) if os.path.isfile(os.path.join(PRETRAINED_DIR, n, "meta.json")))


def export_path(path: str, say=None) -> str:
  """The export directory `path` names, as `load` and every CLI's `--checkpoint` read it: a shipped model's
  name (unless a path of that name exists), a training workdir (its `export/`), or `path` itself (an export, a
  file, or a path that does not exist, left for the reader to refuse). A bare word that is neither a path nor
  a shipped model: one ConfigError listing the shipped ones. "demo/" is "demo". A workdir whose
  export/ may not be the run's latest (`stale_export_note`) is said with `say` (default: a warning of this
  module's logger)."""
  if not os.path.exists(path):
    names = pretrained_names()
    if path.rstrip(os.sep) in names:
      return os.path.join(PRETRAINED_DIR, path.rstrip(os.sep))
    if os.sep not in path and "." not in path:  # a bare word: most likely meant as a shipped model's name
      raise ConfigError(f"{path!r} is neither a path nor a shipped model (shipped: {', '.join(names) or 'none'})")
    return path
  if os.path.isdir(path) and not os.path.exists(os.path.join(path, "meta.json")) and os.path.exists(
      os.path.join(path, "export", "meta.json")):
    note = stale_export_note(path)  # a training workdir: its export/, said when it is not the run's latest
    if note:
      (say or logging.getLogger(__name__).warning)(note)
    return os.path.join(path, "export")
  return path
