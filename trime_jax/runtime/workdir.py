"""A training workdir's own files, for both trainers: the directory itself (checked, locked), the stored
config.json (read under today's field names, unknown fields refused), metrics.jsonl (lines past the resumed step
dropped), and what an interrupted run leaves on disk (said truthfully in the exit message; the complete checkpoint
steps, which checkpoint.py builds on). JSON is written with data.atomic_write_json."""

from __future__ import annotations

import contextlib
import errno
import difflib
import json
import os

import jax

from trime_jax import data
from trime_jax.distributed import on_chief
from trime_jax.errors import ConfigError
from trime_jax.runtime.lock import DirLock

LOCK_FILE = ".lock"
# What a run writes before its first update (checkpoint.check_resume_config / check_resume_data): a refused run
# that created its workdir removes them with it (`run_in`)
STARTING_FILES = ("config.json", "data.json")
CHECKPOINTS = "checkpoints"  # <workdir>/checkpoints: the orbax step directories


def chief() -> bool:
  """Process 0 writes the workdir's files and logs (every process computes; one writes)."""
  return jax.process_index() == 0


def not_a_workdir(workdir: str) -> str:
  """What else a folder given as a workdir is ("an export", "a datastore", "a batch plan"), or "": training there
  would write its config.json over an export's, or mix its files into a datastore or plan."""
  import json

  try:
    names = set(os.listdir(workdir))
  except OSError:
    return ""
  if {"plan.json", "batches.npy"} <= names:
    return "a batch plan"
  if "meta.json" in names:
    try:
      with open(os.path.join(workdir, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
      meta = {}
    if isinstance(meta, dict) and str(meta.get("format", "")).startswith("trime-datastore"):
      return "a datastore"
    if isinstance(meta, dict) and "params_digest" in meta:
      return "an export"
  return ""


def prepare(workdir: str) -> None:
  """Create `workdir`; a path that is a file (or lies under one), an empty path, or a folder that is an export,
  a datastore or a batch plan is a ConfigError, not a traceback or a run written over it."""
  if not str(workdir or "").strip():
    raise ConfigError("--workdir is empty: give a run directory")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir={workdir} is a file, not a folder: give a run directory")
  other = not_a_workdir(workdir) if os.path.isdir(workdir) else ""
  if other:
    raise ConfigError(f"--workdir={workdir} already holds {other}, not a training run: give a run directory of "
                      "its own (training would write its files, config.json first, into it)")
  probe = os.path.dirname(os.path.abspath(workdir))
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise ConfigError(f"--workdir={workdir}: {probe} is a file, not a folder")
  os.makedirs(workdir, exist_ok=True)


@contextlib.contextmanager
def run_in(workdir: str):
  """`prepare(workdir)`, then the run under its `lock`; a workdir this run created, when the run fails before it
  trained (bad data, a missing batch plan, a refused config: nothing in it but the config and data records
  written at its start), is removed again with the parent folders made for it, so a mistyped --workdir or a
  refused run leaves nothing behind."""
  made = []  # the folders prepare makes, the workdir first, then its missing parents
  folder = os.path.abspath(workdir)
  while not os.path.lexists(folder):
    made.append(folder)
    folder = os.path.dirname(folder)
  created = bool(made)
  prepare(workdir)
  try:
    with lock(workdir):
      yield
  except BaseException:
    if created and chief():
      try:
        left = os.listdir(workdir)  # the lock file is gone with the lock
        if set(left) <= set(STARTING_FILES):
          for name in left:
            os.remove(os.path.join(workdir, name))
          for folder in made:  # the workdir, then the parents made for it while nothing else is in them
            os.rmdir(folder)
      except OSError:
        pass
    raise


@contextlib.contextmanager
def lock(workdir: str):
  """One run per workdir (process 0 holds `<workdir>/.lock`; the other processes of a run share it, and stop
  with it when another run holds it)."""
  with contextlib.ExitStack() as held:
    on_chief(lambda: held.enter_context(DirLock(os.path.join(workdir, LOCK_FILE), f"workdir {workdir}")))
    yield


def unknown_fields(stored: dict, known, prefix: str = "") -> list[str]:
  """Dotted names of the fields of `stored` that `known` (a config) lacks, each with the closest known name
  ("train.lerning_rate (train.learning_rate?)")."""
  out = []
  for key, value in stored.items():
    if key not in known:
      close = difflib.get_close_matches(key, list(known.keys()), n=1)
      out.append(f"{prefix}{key}" + (f" ({prefix}{close[0]}?)" if close else ""))
    elif hasattr(known[key], "keys") and isinstance(value, dict):
      out += unknown_fields(value, known[key], f"{prefix}{key}.")
  return out


# Config fields added after runs stored their configs, with the value that gives what a run stored without them
# did: a stored config lacking one (in a section it has) is compared as holding it, so resuming under another
# value is a named config change rather than a refusal about data or vocabularies.
ADDED_FIELDS = {
    "data.dictionaries": "joint",  # translation, fairseq format: one dictionary of both sides
    "data.batches_per_update": 0,  # translation: one bucketed batch an update
}


# Config fields renamed for one name per quantity (issue 34): old dotted name -> (new dotted name, what it is).
# The one table of renamed fields: a stored config (a workdir's or an export's config.json, written before the
# rename) reads under the new names (`migrate_config`, wherever a stored config is read); a config given now (a
# --config file, a --config.x.y override, a ConfigDict built in code) that sets an old name is refused with one
# line naming the new one (`renamed_field_message`; launch/flags.py, `check_no_renamed_fields`). The language
# model's and the translation trainer's configs share these sections.
RENAMED_FIELDS = {
    "trime.temperature": ("trime.tau", "τ on memory similarities during training"),
    "eval.temperature": ("eval.tau", "τ on memory similarities"),
    "eval.knn_temperature": ("eval.tau_prime", "τ′ of Appendix A's P′"),
}


def renamed_field_message(old: str) -> str:
  """"eval.temperature is now eval.tau (τ on memory similarities)" for a field of RENAMED_FIELDS."""
  new, what = RENAMED_FIELDS[old]
  return f"{old} is now {new} ({what})"


def migrate_config(stored, where: str = "the stored config"):
  """A stored config (the dict of a config.json) with every field of RENAMED_FIELDS under its new name, in its
  place: a copy when something was renamed, else `stored` itself (anything but a dict too). A config that holds
  both names with different values is a ConfigError naming `where` (which one ran cannot be told)."""
  if not isinstance(stored, dict):
    return stored
  out = stored
  for old, (new, _) in RENAMED_FIELDS.items():
    section, leaf = old.split(".")
    new_section, new_leaf = new.split(".")
    fields = out.get(section)
    if section != new_section or not isinstance(fields, dict) or leaf not in fields:
      continue
    if new_leaf in fields and fields[new_leaf] != fields[leaf]:
      raise ConfigError(f"{where} has both {old}={fields[leaf]!r} and {new}={fields[new_leaf]!r} ({old} is the "
                        f"name {new} had before): remove {old}")
    out = dict(out) if out is stored else out
    if new_leaf in fields:  # both, with one value: the new name stays
      out[section] = {k: v for k, v in fields.items() if k != leaf}
    else:
      out[section] = {(new_leaf if k == leaf else k): v for k, v in fields.items()}
  return out


def renamed_fields_in(config) -> list[str]:
  """The fields of RENAMED_FIELDS that `config` (a ConfigDict or a dict) sets under their old names: an unlocked
  config file that still assigns one adds it as a new field, which nothing would read."""
  found = []
  for old in RENAMED_FIELDS:
    section, leaf = old.split(".")
    fields = config.get(section) if hasattr(config, "get") else None
    if fields is not None and hasattr(fields, "keys") and leaf in fields.keys():
      found.append(old)
  return found


def check_no_renamed_fields(config) -> None:
  """ConfigError (the rename's one line) when `config` sets a field under a name RENAMED_FIELDS retired."""
  found = renamed_fields_in(config)
  if found:
    raise ConfigError(renamed_field_message(found[0]))


def read_stored_config(path: str, what: str, error: type[Exception]) -> dict:
  """A stored config.json (a workdir's or an export's) as a dict under today's field names (`migrate_config`):
  `error` naming `what` and the file when it is missing or truncated; ConfigError when it holds a field under both
  its old and new names with different values."""
  return migrate_config(data.read_json(path, what, error), path)


def check_known_fields(fields: dict, known, where: str = "the config", error: type[Exception] = ConfigError,
                       advice: str = "") -> None:
  """`error` naming the fields of a config (as a dict) that `known` (the default config it is read over) lacks,
  each with the closest known name: an unlocked ConfigDict (a config file's `c.train.num_stpes = 3`, a dict given
  to `trime_jax.train`) takes any name set on it, and a stored config.json any edit; nothing would read them.
  `where` names the config in the message, `advice` ends it."""
  bad = unknown_fields(fields, known)
  if bad:
    many = len(bad) > 1
    raise error(f"{where} has field{'s' if many else ''} this version does not know: {', '.join(bad)}; "
                f"correct or remove {'them' if many else 'it'}{advice}")


def check_stored_config(path: str, stored: dict, config) -> None:
  """A workdir's config.json must not hold a field this config does not have: a misspelling there (an edit) would
  be ignored without a word. ConfigError naming the file and the fields."""
  if not isinstance(stored, dict):
    raise ConfigError(f"workdir config {path} is not a config (a JSON object): restore it or use another --workdir")
  check_known_fields(stored, config, f"workdir config {path}",
                     advice=" (the run's settings come from --config; config.json records them)")


def read_metric_lines(path: str) -> list[tuple[str, dict]]:
  """(line, record) of every line of a metrics.jsonl. A last line that is not a complete JSON object is a
  write cut short (a kill, a crash, a copy that stopped) and is left out; one before it is damage, one error
  naming the file and line."""
  from trime_jax.errors import DamagedCheckpointError

  try:
    with open(path, encoding="utf-8") as f:
      lines = [ln for ln in f if ln.strip()]
  except (OSError, UnicodeDecodeError) as e:
    raise DamagedCheckpointError(f"{path} cannot be read ({e}): restore it, or remove it (the run's earlier "
                                 "metric lines are then lost)") from None
  out = []
  for i, ln in enumerate(lines):
    try:
      record = json.loads(ln)
      if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    except ValueError as e:
      if i == len(lines) - 1 and not ln.endswith("\n"):
        break  # the line being written when the run was stopped: the rerun writes it again
      raise DamagedCheckpointError(f"{path} line {i + 1} is not a metrics record ({e}): restore the file, or "
                                   "remove that line") from None
    out.append((ln if ln.endswith("\n") else ln + "\n", record))
  return out


def truncate_metrics(path: str, last_step: int) -> bool:
  """On resume, drop metric lines past `last_step` (the restored checkpoint, 0 when there is none): the rerun
  produces them again. Returns whether any line was dropped (a torn last line included)."""
  if not os.path.exists(path):
    return False
  size = os.path.getsize(path)
  rows = read_metric_lines(path)
  keep = [ln for ln, record in rows if record.get("step", 0) <= last_step]
  if len(keep) == len(rows) and sum(len(ln.encode()) for ln in keep) == size:
    return False
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(keep)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return True


def step_dirs(directory: str) -> list[int]:
  """The complete step directories of a checkpoint directory (orbax writes `<step>.orbax-checkpoint-tmp-*` and
  renames when done); none for a remote path. (Here, below checkpoint.py, so that `on_disk` needs nothing above.)"""
  if "://" in directory or not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def newest_step(directory: str):
  """The newest complete step on disk (what a rerun resumes from when it verifies), or None."""
  return (step_dirs(directory) or [None])[-1]


def on_disk(workdir: str) -> str:
  """What an interrupted run left to resume from, for its exit message (never claims a checkpoint that is not
  there)."""
  directory = os.path.join(workdir, CHECKPOINTS)
  step = newest_step(directory)
  if step is None:
    return ("no checkpoint had been written yet: rerun the same command to start again from step 0 (this run's "
            "metrics lines are dropped then)")
  return (f"the newest checkpoint on disk is step {step} in {directory}: rerun the same command to resume from it "
          "(metrics lines past it are dropped then)")


class MetricsFile:
  """`<workdir>/metrics.jsonl`, both trainers' record: one JSON object per line (train lines, dev/valid lines),
  appended and flushed line by line so a kill loses at most the line being written; only process 0 writes."""

  def __init__(self, path: str, enabled: bool = True):
    self.path, self.enabled = path, enabled

  def write(self, record: dict) -> None:
    """Append one line. A write the disk refuses (full, a file size limit) takes the part it wrote back out, so
    no half line trips the resume's reader, and raises an OSError naming the file (write() names none)."""
    if not self.enabled:
      return
    data = (json.dumps(record) + "\n").encode()
    with open(self.path, "ab", buffering=0) as f:  # unbuffered: nothing left to flush when the file closes
      start = f.seek(0, os.SEEK_END)
      try:
        view = memoryview(data)
        while view:
          n = f.write(view)  # a regular file may take part of it, then refuse the rest
          if not n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
          view = view[n:]
      except OSError as e:
        with contextlib.suppress(OSError):
          f.truncate(start)
        raise OSError(e.errno, os.strerror(e.errno) if e.errno else str(e), self.path) from e

  def rows(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    return [record for _, record in read_metric_lines(self.path)]

  def find(self, step: int, split: str) -> dict | None:
    """The last `split` line of `step` (a finished run's rerun reuses it instead of writing a duplicate)."""
    return next((r for r in reversed(self.rows()) if r.get("split") == split and r.get("step") == step), None)

  def truncate(self, last_step: int) -> bool:
    return self.enabled and truncate_metrics(self.path, last_step)
