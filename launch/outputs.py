"""What a program may write: output folders and files checked before the work starts, so that nothing is
replaced that was not the program's own (`describe_target` says what a path holds)."""

from __future__ import annotations

import os


DATASTORE_FILES = ("keys.npy", "values.npy", "meta.json", "index.faiss", "index.faiss.json", "index_l2.faiss",
                   "index_l2.faiss.json")


def describe_target(path: str) -> str:
  """What an output path holds, for refusing it: "" (absent, or an empty folder), else "an export", "a training
  workdir", "a datastore", "a batch plan", "a file", or "a folder with N files (a, b, ...)"."""
  import json

  if not os.path.lexists(path):
    return ""
  if not os.path.isdir(path):
    return "a file"
  try:
    names = sorted(os.listdir(path))
  except OSError as e:
    return f"a folder that cannot be read ({os.strerror(e.errno)})"
  if not names:
    return ""
  meta = {}
  if "meta.json" in names:
    try:
      with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
      meta = {}
  if not isinstance(meta, dict):
    meta = {}
  if str(meta.get("format", "")).startswith("trime-datastore"):
    return "a datastore"
  # A datastore build stopped (a kill, a full disk) before its first meta.json: only its own files are there.
  if "meta.json" not in names and all(n in DATASTORE_FILES or ".tmp" in n for n in names):
    return "a datastore"
  if "params_digest" in meta or ("params" in names and "config.json" in names):
    return "an export"
  if "checkpoints" in names or "metrics.jsonl" in names:
    return "a training workdir"
  if "plan.json" in names and "batches.npy" in names:
    return "a batch plan"
  shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
  return f"a folder with {len(names)} file{'s' if len(names) != 1 else ''} ({shown})"


def check_output_path(path: str, flag: str, *, reads=()) -> None:
  """An output folder a command will write (and with --overwrite replace): refused when it is empty (an unset
  shell variable: "" is the working directory once made absolute, which a replacement would delete), when it is
  the working directory or a folder holding it, and when it is, or holds, one of the command's own inputs
  (`reads`: paths it reads, e.g. --checkpoint, the corpus, --config), whatever --overwrite says."""
  from trime_jax.data import within
  from trime_jax.errors import ConfigError

  if not str(path or "").strip():
    raise ConfigError(f"--{flag} is empty: give the folder to write")
  if within(os.getcwd(), path):
    raise ConfigError(f"--{flag}={path} is the working directory or a folder holding it: give a folder of its own")
  for name, given in reads:
    if given and within(given, path):
      raise ConfigError(f"--{flag}={path} holds this command's own input {name}={given}: writing there would "
                        f"replace what it reads; choose another --{flag}")


def refuse_target(path: str, flag: str, wanted: str, ok=(), overwrite: bool = False) -> str:
  """Refuse writing `wanted` (e.g. "an export") to `path` when it holds anything else than one of `ok`
  (describe_target's words), unless `overwrite`; returns describe_target(path). Raises ConfigError naming what
  is there, so nothing is replaced silently, and LockedError for a running training's workdir (`refuse_in_use`)."""
  from trime_jax.errors import ConfigError

  what = describe_target(path)
  if what and what not in ok and not overwrite:
    raise ConfigError(f"--{flag}={path} already holds {what}, not {wanted}: choose another --{flag} "
                      f"(or add --overwrite to replace it)")
  if what and overwrite:
    refuse_in_use(path, flag)
  return what


def refuse_in_use(path: str, flag: str) -> None:
  """LockedError naming the process when `path` is the workdir of a training that is running (its lock,
  runtime.workdir.LOCK_FILE, held), --overwrite or not: the run would go on writing into whatever replaced it.
  (An export, datastore or plan being written is `<path>.lock`'s, which the writing command holds itself.)"""
  from trime_jax.runtime.lock import DirLock
  from trime_jax.runtime.workdir import LOCK_FILE

  lock_file = os.path.join(path, LOCK_FILE)
  if os.path.isdir(path) and os.path.isfile(lock_file):
    with DirLock(lock_file, f"--{flag}={path} (a training workdir)"):
      pass  # free: a run that stopped left it (removed again now, with the folder it is in)


def export_fingerprint(checkpoint) -> str:
  """An export's fingerprint (exports.fingerprint) for the results it is evaluated into; "" when it cannot be
  read (a missing or damaged export is refused with its own message by the checks after)."""
  from trime_jax import exports

  try:
    return exports.fingerprint(checkpoint) if checkpoint else ""
  except Exception:  # noqa: BLE001 - said by check_export
    return ""


def _results_field(held, name: str):
  """The one value of `name` an evaluation's results file records (eval: on every row; eval_ext: at the top), or
  None where it does not say or says several."""
  rows = held if isinstance(held, list) else [held] if isinstance(held, dict) else []
  found = {r.get(name) for r in rows if isinstance(r, dict)} - {None}
  return next(iter(found)) if len(found) == 1 else None


def results_checkpoint(held) -> str | None:
  """The export fingerprint an evaluation's results file records, or None (results written before 2026-12-06)."""
  return _results_field(held, "checkpoint_fingerprint")


def results_split(held) -> str | None:
  """The split an evaluation's results file scored, or None where it does not say (or says several)."""
  return _results_field(held, "split")


def scored_split(config) -> str:
  """The split an evaluation config scores (eval.split), or "" where the config has none or names no split (a
  translation config, a misspelt split: its own check says so later, not the output file's)."""
  from trime_jax.corpora import SPLITS

  split = (config.get("eval") or {}).get("split", "") if config is not None else ""
  return split if split in SPLITS else ""


def check_output_file(path: str, flag: str, *, json_results: bool = False, program: str = "",
                      checkpoint_fingerprint: str = "", split: str = "", overwrite: bool = False) -> None:
  """An output file the program writes at the end: refused up front (before the work) when it is a folder, when
  a folder on its way is a file, or when it cannot be created for lack of permission. `json_results`: an
  existing file is replaced only when it holds an earlier evaluation's results (eval's list of rows, eval_ext's
  object with "rows"), never a config, script, text or another program's JSON (a datastore's or an export's
  meta.json, a config.json) a mistyped name points at; and unless `overwrite` (--overwrite), only results of the
  same `program` ("eval": a list, "eval_ext": an object) and, where the file records it, the same export
  (`checkpoint_fingerprint`) and split (`split`): a rerun replaces its own results, not another model's or
  program's, nor a dev sweep by a test evaluation."""
  import json

  from trime_jax.errors import ConfigError

  if not path:
    return
  if os.path.isdir(path):
    raise ConfigError(f"--{flag}={path} is a folder: give a file name (e.g. {os.path.join(path, 'results.json')})")
  if json_results and os.path.isfile(path) and os.path.getsize(path):
    try:
      with open(path) as f:
        held = json.load(f)
    except (ValueError, UnicodeDecodeError):
      raise ConfigError(f"--{flag}={path} exists and is not JSON (results of an earlier run, which would be "
                        "replaced): it is left as it is; move it away or choose another file name") from None
    except OSError:
      held = []  # unreadable: the permission checks below say so
    results = (isinstance(held, list) and all(isinstance(r, dict) and "variant" in r for r in held)) or (
        isinstance(held, dict) and isinstance(held.get("rows"), list))
    if not results:
      raise ConfigError(f"--{flag}={path} exists and is not an evaluation's results (JSON of another kind, e.g. "
                        "a datastore's or an export's own file, which would be replaced): it is left as it is; "
                        "move it away or choose another file name")
    held_program = "eval" if isinstance(held, list) else "eval_ext"
    if program and held_program != program and not overwrite:
      raise ConfigError(f"--{flag}={path} holds results of trime_jax.launch.{held_program}, which this "
                        f"{program} would replace: choose another file name (or add --overwrite)")
    there = results_checkpoint(held)
    if checkpoint_fingerprint and there and there != checkpoint_fingerprint and not overwrite:
      raise ConfigError(f"--{flag}={path} holds results of another export (fingerprint {there}; this one's "
                        f"{checkpoint_fingerprint}), which would be replaced: choose another file name (or add "
                        "--overwrite)")
    held_split = results_split(held)
    if split and held_split and held_split != split and not overwrite:
      raise ConfigError(f"--{flag}={path} holds this export's results on split {held_split}, which this evaluation "
                        f"of {split} would replace: choose another file name (or add --overwrite)")
  parent = os.path.dirname(os.path.abspath(path))
  probe = parent
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise ConfigError(f"--{flag}={path}: {probe} is a file, not a folder")
  if os.path.exists(path) and not os.access(path, os.W_OK):
    raise ConfigError(f"--{flag}={path}: no permission to write it")
  if not os.access(probe, os.W_OK | os.X_OK) and not os.path.exists(path):
    raise ConfigError(f"--{flag}={path}: no permission to write in {probe}")
