"""Orbax checkpoints for training: save (asynchronous, a full disk as one line), per-step digests, restore
(verified; a damaged newest step is moved aside and the previous one used), and the resume-config check.

Training checkpoints are checked (files present, shapes, readable) and against the digest written beside each
step once it is complete (`<step>/trime_digest.json`: SHA-256 of every file); a damaged newest checkpoint is
moved aside to `<workdir>/checkpoints_damaged/` and training resumes from the previous one.
The exported model that evaluation loads (`<workdir>/export/`) is `trime_jax.exports`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time

import jax
import ml_collections
from absl import logging as absl_logging
import numpy as np

from trime_jax import data
from trime_jax.distributed import every_process, from_chief, on_chief, sync_processes
from trime_jax.errors import CheckpointError, DamagedCheckpointError, DiskFullError, first_line, is_no_space
from trime_jax.runtime import workdir as workdir_files
from trime_jax.runtime.workdir import newest_step, step_dirs  # noqa: F401 - also checkpoint.newest_step


def _import_orbax():
  """orbax.checkpoint, imported without its side effect on the user's logging: it logs at import time, and a
  module-level logging call on a root logger without handlers runs `logging.basicConfig()`, after which the
  user's own `logging.basicConfig(level=..., format=...)` does nothing. The handler it adds is taken back."""
  root = logging.getLogger()
  before = list(root.handlers)
  import orbax.checkpoint  # noqa: PLC0415 - the guarded import itself

  if not before:
    for handler in root.handlers[:]:
      root.removeHandler(handler)
  return orbax.checkpoint


ocp = _import_orbax()  # the package's one import of orbax (exports and mt.export take it from here)


def manager(directory: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  path = directory if "://" in directory else os.path.abspath(directory)  # gs://... passes through to orbax
  if os.path.lexists(path) and not os.path.isdir(path):  # found now, not at the first save an interval later
    raise CheckpointError(f"{path} is a file, not the run's checkpoint folder: move it away and rerun")
  return ocp.CheckpointManager(path, options=options)


# How orbax / TensorStore report a full disk: an OSError's errno, or a TensorStore status in the message.
_NO_SPACE = ("RESOURCE_EXHAUSTED", "No space left", "Disk quota exceeded", "File too large")


def _is_no_space(e: BaseException) -> bool:
  while e is not None:
    if is_no_space(e):
      return True
    if any(t in str(e) for t in _NO_SPACE):
      return True
    e = e.__cause__ or e.__context__
  return False


def _no_space(mgr, step, e) -> DiskFullError:
  kept = newest_step(str(mgr.directory))
  where = (f"the newest complete checkpoint is step {kept}" if kept is not None else
           "no complete checkpoint is on disk yet (the rerun starts from step 0)")
  return DiskFullError(f"no space left writing the checkpoint of update {step} to {mgr.directory} "
                       f"({first_line(e)}); {where}: free space and rerun the same command to resume")


def save(mgr: ocp.CheckpointManager, step: int, state) -> None:
  """Save `step` (asynchronously); first the previous save is finished and its digest written (`seal`).
  A full disk is DiskFullError (one line), not orbax's traceback."""
  finish(mgr)
  try:
    mgr._trime_pending = step  # the step an asynchronous failure (reported by `finish`) belongs to
    mgr.save(step, args=ocp.args.StandardSave(state))
  except Exception as e:  # noqa: BLE001 - only a full disk is translated; anything else propagates
    if _is_no_space(e):
      raise _no_space(mgr, step, e) from None
    raise


def finish(mgr: ocp.CheckpointManager) -> None:
  """Wait for the save in flight, then write the digest of every complete step that lacks one."""
  try:
    mgr.wait_until_finished()
  except Exception as e:  # noqa: BLE001 - only a full disk is translated; anything else propagates
    if _is_no_space(e):
      raise _no_space(mgr, getattr(mgr, "_trime_pending", None), e) from None
    raise
  seal(str(mgr.directory))


# ----------------------------------------------------------------------------------------------------------
# Step digests: written after a step is complete (orbax has renamed it into place and the save is finished),
# verified before it is restored. A step without one (killed between orbax's rename and the digest, or saved
# by an older version) is restored on shapes and orbax's own checks only.
# ----------------------------------------------------------------------------------------------------------
DIGEST_FILE = "trime_digest.json"


def _file_digests(step_dir: str) -> dict:
  out = {}
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if rel == DIGEST_FILE:
        continue
      h = hashlib.sha256()
      with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
          h.update(block)
      out[rel] = h.hexdigest()
  return dict(sorted(out.items()))


def seal(directory: str) -> None:
  """Write `<step>/trime_digest.json` for every complete step without one (process 0; local paths only). The
  other processes wait for it (`on_chief`): the next save's barrier would otherwise time out while it hashes a
  large state, and a write of it that fails stops them too."""

  def write_digests():
    for step in step_dirs(directory):
      step_dir = os.path.join(directory, str(step))
      if not os.path.exists(os.path.join(step_dir, DIGEST_FILE)):
        try:
          data.atomic_write_json(os.path.join(step_dir, DIGEST_FILE),
                                 {"step": step, "files": _file_digests(step_dir)})
        except FileNotFoundError:  # orbax deleted the step meanwhile (train.keep_checkpoints): nothing to seal
          continue

  on_chief(write_digests)


def verify_step(directory: str, step: int, what: str) -> None:
  """DamagedCheckpointError naming the first file whose bytes differ from the step's digest (or that is missing
  or added); nothing when the step has no digest."""
  step_dir = os.path.join(directory, str(step))
  path = os.path.join(step_dir, DIGEST_FILE)
  if "://" in directory or not os.path.exists(path):
    return
  want = data.read_json(path, "checkpoint digest", DamagedCheckpointError).get("files", {})
  have = _file_digests(step_dir)
  for rel in sorted(want.keys() | have.keys()):
    if rel not in have:
      raise DamagedCheckpointError(f"{what} is damaged: {os.path.join(step_dir, rel)} is missing")
    if rel not in want:
      raise DamagedCheckpointError(f"{what} is damaged: {os.path.join(step_dir, rel)} was added after it was saved")
    if want[rel] != have[rel]:
      raise DamagedCheckpointError(f"{what} is damaged: {os.path.join(step_dir, rel)} changed after it was saved "
                                   f"(SHA-256 {have[rel][:16]} != {DIGEST_FILE}'s {want[rel][:16]})")


def restore_latest(mgr: ocp.CheckpointManager, abstract_state, log=print):
  """(step, state) of the newest intact checkpoint, or (None, None) if there is none.

  A damaged checkpoint (a file missing, truncated or unreadable) is moved aside to
  `<checkpoints>_damaged/<step>` (kept for inspection, out of the manager's way) and the previous one is
  tried, saying so; one whose shapes do not match this config's model/optimizer is an error."""
  # Multi-host: process 0's listing (another host's view of shared storage may lag), and a step one process
  # finds damaged is damaged for all (each reads its files; apart, one would restore while another moved on)
  steps = from_chief(sorted(mgr.all_steps(), reverse=True))
  for i, step in enumerate(steps):
    path = os.path.join(str(mgr.directory), str(step), "default")
    what = f"checkpoint at step {step} in {mgr.directory}"
    try:
      _damaged_for_all(lambda: verify_step(str(mgr.directory), step, what))
      state = _damaged_for_all(lambda: restore_checked(
          path, abstract_state, what, lambda: mgr.restore(step, args=ocp.args.StandardRestore(abstract_state))))
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


def _damaged_for_all(fn):
  """`fn()`, where a DamagedCheckpointError on any process is raised on every process (the first one's)."""
  try:
    value, problem = fn(), None
  except DamagedCheckpointError as e:
    value, problem = None, str(e)
  problem = next((p for p in every_process(problem) if p is not None), None)
  if problem is not None:
    raise DamagedCheckpointError(problem)
  return value


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
  sync_processes(f"move_aside:{step}")
  return dest


_REQUIRED = ("_METADATA", "manifest.ocdbt")  # written by orbax's StandardCheckpointer (OCDBT format)


def leaf_specs(tree) -> list:
  """Sorted (shape, dtype) of every array leaf: a structure-independent summary to compare with orbax's
  metadata (whose containers are plain dicts where the live tree has nnx.State / optax tuples)."""
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  return sorted((tuple(int(d) for d in x.shape), str(np.dtype(x.dtype))) for x in leaves if hasattr(x, "shape"))


def _key_name(key) -> str:
  for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def leaf_paths(tree) -> list:
  """Sorted (path, shape, dtype) of every array leaf, the path in a form both trees share: "opt_state/0/mu/embed/
  embedding" for the live tree's `['opt_state'][0].mu['embed']['embedding']` and for orbax's metadata, whose
  tuples are lists, whose attributes are dict keys and whose nnx variables hold their array under 'value'
  (dropped on both sides)."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
  return sorted(("/".join(n for n in map(_key_name, path) if n != "value"), tuple(int(d) for d in x.shape),
                 str(np.dtype(x.dtype))) for path, x in flat if hasattr(x, "shape"))


def layout_difference(have: list, want: list) -> str | None:
  """None when two `leaf_paths` agree, else where they part, in words (the arrays may all have the same shapes
  and still lie elsewhere: an optimizer wrapped in one more transformation, such as gradient clipping)."""
  if have == want:
    return None
  extra = sorted(set(have) - set(want))
  missing = sorted(set(want) - set(have))
  said = []
  if missing:
    said.append(f"{len(missing)} arrays expected but not stored, e.g. {missing[0][0]}")
  if extra:
    said.append(f"{len(extra)} stored but not expected, e.g. {extra[0][0]}")
  return "; ".join(said) or "the arrays are stored in another order"


def specs_difference(have: list, want: list, have_word: str) -> str | None:
  """None when two `leaf_specs` agree, else the first difference in words ("float32[8, 4] stored vs float32[8, 5]
  expected", or the counts when one has arrays the other lacks); `have_word` names where `have` came from."""
  if have == want:
    return None
  return next((f"{a[1]}{list(a[0])} {have_word} vs {b[1]}{list(b[0])} expected" for a, b in zip(have, want) if a != b),
              f"{len(have)} arrays {have_word} vs {len(want)} expected")


def restore_checked(path: str, abstract_tree, what: str, restore):
  """`restore()` after checking the files at `path`: DamagedCheckpointError for missing or unreadable files,
  CheckpointError when the stored shapes differ from `abstract_tree`'s (another model or optimizer; checked
  before restoring: orbax restores stored shapes without complaint), and a failed restore is damaged data
  files."""
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
    raise DamagedCheckpointError(f"{what} is damaged: its metadata cannot be read ({first_line(e)})") from None
  if stored is None:
    raise DamagedCheckpointError(f"{what} is damaged: its metadata ({path}/_METADATA) cannot be read")
  diff = specs_difference(leaf_specs(stored), leaf_specs(abstract_tree), "stored")
  if diff:
    raise CheckpointError(f"{what} does not match this config's model/optimizer ({diff}); use a fresh "
                          "workdir") from None
  # The same shapes laid out otherwise (train.clip_norm 0 <-> > 0 adds or removes a transformation of the
  # optimizer): another optimizer's state, which orbax cannot restore into this one. Not damage.
  diff = layout_difference(leaf_paths(stored), leaf_paths(abstract_tree))
  if diff:
    raise CheckpointError(f"{what} holds another optimizer's or model's state ({diff}): the change of config "
                          "(an optimizer setting such as train.clip_norm, or the model's structure) cannot resume "
                          "it; undo that change, or use a fresh workdir") from None
  try:
    return restore()
  except Exception as e:  # noqa: BLE001 - the shapes matched: damaged data files
    raise DamagedCheckpointError(f"{what} is damaged: a data file cannot be read ({first_line(e)})") from None


# Fields a resumed run may change without --config.train.allow_config_change: they do not change the trained
# parameters (logging, checkpoint cadence, evaluation, caching) or only extend the run (num_steps, unless the
# schedule or the CE warm-up is derived from it: _num_steps_shapes_training).
# The translation trainer's own: eval_max_pairs (dev cadence's size), stop_after (this invocation's length),
# target_token_budget and num_epochs (the run's length, like num_steps).
RESUMABLE_CHANGES = ("train.num_steps", "train.log_every", "train.eval_every", "train.eval_max_tokens",
                     "train.checkpoint_every", "train.keep_checkpoints", "train.allow_config_change",
                     "train.keep_best", "train.tensorboard", "train.wandb_project", "train.progress",
                     "train.profile_steps", "data.cache_dir", "eval.", "model.attention_impl",
                     "model.dropout_mask", "model.remat", "model.adaptive_tail_rows",
                     "train.eval_max_pairs", "train.stop_after", "train.target_token_budget", "train.num_epochs",
                     "train.export_on_stop",
                     "model.srupp_eval_same_length")


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
  return out


def check_resume_config(workdir: str, config: ml_collections.ConfigDict, *, write: bool = True) -> None:
  """Before resuming `workdir`, compare its config.json with `config`; then (`write`) write `config` there.

  Differences outside RESUMABLE_CHANGES are refused (naming the fields) unless train.allow_config_change;
  every difference is appended to config_changes.jsonl when written. A field absent from `config` (a typo in an
  edited config.json) is refused with the file named. Nothing to resume (no checkpoint yet): config.json is just
  written. `write=False` checks only (nothing on disk changes); call again with write=True when the run starts."""
  path = os.path.join(workdir, "config.json")
  new = json.loads(config.to_json_best_effort())

  def check_and_write():  # process 0 (hosts may differ in host-local fields such as data.path)
    problem, diff, blocking = _resume_problem(workdir, path, config, new)
    if problem:
      raise CheckpointError(problem)
    if write:
      if diff:
        _record_changes(workdir, diff, allowed=bool(blocking))
        print(f"config changes recorded in {os.path.join(workdir, 'config_changes.jsonl')}: "
              + ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in diff.items()), flush=True)
      data.atomic_write_json(path, new)

  on_chief(check_and_write)  # every process stops, or none


def _resume_problem(workdir: str, path: str, config, new: dict):
  """check_resume_config's comparison on process 0: (the error message or None, the differences, the blocking
  ones)."""
  resuming = _has_checkpoints(workdir)
  # A run that stopped after a dev evaluation but before its first checkpoint leaves best/ (train.keep_best),
  # and the next run in the workdir compares its dev perplexities with that best: it continues that run's
  # record, so it must be the same run (a rerun of the same command is; runs are deterministic).
  continues = resuming or any(os.path.exists(os.path.join(workdir, d, "meta.json")) for d in ("best", "export"))
  if os.path.exists(path):  # an edited field must not be ignored silently: unknown ones are refused
    from trime_jax.errors import ConfigError

    try:
      # A config.json written before a field was renamed reads under today's names (workdir.RENAMED_FIELDS):
      # resuming it is no config change.
      stored = workdir_files.read_stored_config(path, "workdir config", CheckpointError)
      workdir_files.check_stored_config(path, stored, config)
    except ConfigError as e:
      return str(e), {}, []
  if not continues:
    return None, {}, []
  if not os.path.exists(path):  # nothing says what made these files: they are not taken for this run's
    if config.train.get("allow_config_change", False):
      return None, {}, []
    return (f"workdir {workdir} holds a run's files (checkpoints/, best/ or export/) but no config.json, so "
            "its settings cannot be compared with these: use another --workdir, or pass "
            "--config.train.allow_config_change=True to continue it with these settings"), {}, ["config.json"]
  old = _flat(stored)
  flat_new = _flat(new)
  for key, value in workdir_files.ADDED_FIELDS.items():  # what a config stored before the field ran with
    if key not in old and key.rpartition(".")[0] in stored and key in flat_new:
      old[key] = value
  diff = {k: [old[k], flat_new[k]] for k in sorted(old.keys() & flat_new.keys()) if old[k] != flat_new[k]}
  blocking = [k for k in diff if not k.startswith(RESUMABLE_CHANGES)]
  if "train.num_steps" in diff and (why := _num_steps_shapes_training(old, config)):
    blocking.append("train.num_steps")  # not merely a longer run: the updates already made would differ
    diff["train.num_steps"] = diff["train.num_steps"] + [why]
  if blocking and not config.train.get("allow_config_change", False):
    shown = "; ".join(f"{k}: {diff[k][0]!r} there, {diff[k][1]!r} now" + (f" ({diff[k][2]})" if len(diff[k]) > 2
                                                                          else "") for k in blocking[:8])
    more = f" (+{len(blocking) - 8} more)" if len(blocking) > 8 else ""
    held = "a run" if resuming else "the best/ or export/ of a run without checkpoints"
    return (f"workdir {workdir} holds {held} with other settings ({shown}{more}): use another --workdir, or pass "
            "--config.train.allow_config_change=True to resume it with these settings (recorded in "
            "config_changes.jsonl)"), diff, blocking
  return None, diff, blocking


DATA_FILE = "data.json"  # <workdir>/data.json: what the run's batches are made of (check_resume_data)


def check_resume_data(workdir: str, config, identity: dict, *, write: bool = True) -> None:
  """Compare `identity` (the training split's fingerprint, the batch plan's digest) with the run's
  `<workdir>/data.json` when resuming, then write it. A difference is refused unless
  train.allow_config_change (then appended to config_changes.jsonl): the config names the corpus and the plan by
  path, and a file rewritten between two invocations would change the rest of the run without a word. A workdir
  without data.json (an older version's) gets one now, unchecked. Process 0 decides; every process stops or none
  does. `write=False` checks only (nothing on disk changes); call again with write=True when the run starts."""
  path = os.path.join(workdir, DATA_FILE)

  def check_and_write():  # process 0
    old = None
    if _has_checkpoints(workdir) and os.path.exists(path):
      try:
        with open(path, encoding="utf-8") as f:
          old = json.load(f)
      except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read ({first_line(e)}): restore it or delete it to resume "
                              "unchecked") from None
    diff = {k: [old.get(k), v] for k, v in identity.items() if k in old and old[k] != v} \
        if isinstance(old, dict) else {}
    if diff and not config.train.get("allow_config_change", False):
      shown = "; ".join(f"{k}: {a} there, {b} now" for k, (a, b) in diff.items())
      raise CheckpointError(
          f"workdir {workdir} was trained on other data ({shown}): the training split or the batch plan "
          "(trime.batch_plan) changed since the run started. Restore them, use another --workdir, or pass "
          "--config.train.allow_config_change=True to go on with these (recorded in config_changes.jsonl)")
    if write:
      if diff:
        _record_changes(workdir, diff, allowed=True)
      data.atomic_write_json(path, identity)

  on_chief(check_and_write)  # every process stops, or none


def recorded_data_identity(workdir: str) -> dict:
  """The `<workdir>/data.json` a run wrote when it started (`check_resume_data`), or {} where there is none or it
  cannot be read (check_resume_data says so when it compares)."""
  try:
    with open(os.path.join(workdir, DATA_FILE), encoding="utf-8") as f:
      old = json.load(f)
  except (OSError, ValueError, UnicodeDecodeError):
    return {}
  return old if isinstance(old, dict) else {}


def _has_checkpoints(workdir: str) -> bool:
  """A complete checkpoint step exists: the run resumes rather than starts."""
  return bool(workdir_files.step_dirs(os.path.join(workdir, workdir_files.CHECKPOINTS)))


def _record_changes(workdir: str, diff: dict, allowed: bool) -> None:
  with open(os.path.join(workdir, "config_changes.jsonl"), "a") as f:
    f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changes": diff, "allowed": allowed}) + "\n")


def _num_steps_shapes_training(old: dict, config) -> str:
  """Why a new train.num_steps changes the updates a run makes, not only how many (the flat stored config `old`
  against `config`), or "" when it only extends or shortens the run: a cosine schedule's period is
  num_steps − warm-up, and TRIME's CE warm-up defaults to 5% of num_steps (trime.ce_warmup_steps = -1)."""
  import math

  t = config.train
  from trime_jax.runtime.optim import NUM_STEPS_SCHEDULES

  if {old.get("train.schedule"), t.schedule} & set(NUM_STEPS_SCHEDULES):
    return "the cosine schedule decays over train.num_steps"
  trime = config.get("trime")
  if trime is not None and trime.get("memory", "none") != "none" and int(trime.get("ce_warmup_steps", 0)) < 0:
    before = math.ceil(0.05 * int(old["train.num_steps"]))
    after = math.ceil(0.05 * int(t.num_steps))
    if before != after:
      return f"the CE warm-up is 5% of train.num_steps: {before} update{'s' * (before != 1)} there, {after} now"
  return ""


def abstract(tree):
  return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
