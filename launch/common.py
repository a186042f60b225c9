"""Shared CLI plumbing: `--config` files with `--config.a.b=...` overrides, one-line errors."""

from __future__ import annotations

import os
import sys

from trime_jax.errors import NO_SPACE_ERRNOS, CheckpointError, ConfigError, TrimeError, is_no_space


def _one_line(e: BaseException) -> str:
  """The innermost message of `e` on one line: absl wraps a config typo's KeyError in an AttributeError, whose
  str() quotes it twice (a stray quote in the hint otherwise)."""
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
  text = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
  for escaped, plain in (("\\n", " "), ("\\'", "'"), ('\\"', '"')):
    text = text.replace(escaped, plain)
  return " ".join(text.split())


PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds configs/ and launch/
EXPORT_CONFIG = os.path.join(PACKAGE_ROOT, "launch", "export_config.py")  # get_config(<export dir>)


def resolve_config_path(value: str) -> str:
  """A `--config` value as given when it exists from the working directory; otherwise found in the installed
  package (`configs/demo.py`, or the bare name `demo`), so the commands run from any directory."""
  path, sep, arg = value.partition(":")
  if not path or os.path.exists(path):
    return value
  name = path if path.endswith(".py") else f"{path}.py"
  for candidate in (os.path.join(PACKAGE_ROOT, path), os.path.join(PACKAGE_ROOT, "configs", name)):
    if os.path.isfile(candidate):
      return candidate + sep + arg
  return value


def _flag_values(argv: list[str], name: str) -> list[tuple[int, str]]:
  """Where `--name`'s values are in argv (before a `--`): (index of the item holding the value, the text before
  the value in it: "--name=" or "" for `--name VALUE`), in order."""
  found = []
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    flag, eq, _ = arg.lstrip("-").partition("=")
    if flag == name:
      if eq:
        found.append((i, arg[:arg.index("=") + 1]))
      elif i + 1 < len(argv):
        found.append((i + 1, ""))
  return found


def _checkpoint_argv(argv: list[str]) -> list[str]:
  """argv with a `--checkpoint` value read as `trime_jax.load` reads a path (`api.export_path`): a shipped
  model's name, a training workdir (its export/), or the path as given. A `--checkpoint` that does not exist
  is one error here when no `--config` is given (the export's stored config would be the config): otherwise the
  program's reader refuses it."""
  from absl import flags

  found = _flag_values(argv, "checkpoint") if "checkpoint" in flags.FLAGS else []
  if not found:
    return argv
  from trime_jax.api import export_path

  out = list(argv)
  at, prefix = found[-1]
  value = out[at][len(prefix):]
  if not value:
    return out
  try:
    resolved = export_path(value, say=lambda note: print(f"warning: {note}", file=sys.stderr))
  except ConfigError:  # a bare word that is no shipped model: said here where an export's config is expected
    if "config" not in flags.FLAGS:  # generate, import_fairseq (a .pt): their own readers say what is missing
      return out
    raise
  if not _flag_values(out, "config") and "config" in flags.FLAGS:  # the export's stored config is the config
    # A file, a training checkpoint's step, a workdir that has not exported, a datastore: said as trime_jax.load
    # says it (without this, the missing config was the error: "--checkpoint needs --config", or absl's own).
    from trime_jax import exports

    problem = exports.config_dir_problem(resolved, given=f"--checkpoint={value}")
    if problem:
      raise CheckpointError(problem)
  out[at] = prefix + resolved
  return out


def _config_argv(argv: list[str]) -> list[str]:
  """argv with `--config` paths resolved (`resolve_config_path`, the flag's default too); a program given
  `--checkpoint=<export dir>` and no `--config` reads the export's stored config (launch/export_config.py), so
  evaluation takes its data and eval settings from the export unless `--config` (or `--config.x.y=...`) overrides
  them."""
  from absl import flags

  if "config" not in flags.FLAGS:
    return argv
  out = list(argv)
  configs = _flag_values(out, "config")
  for at, prefix in configs:
    out[at] = prefix + resolve_config_path(out[at][len(prefix):])
  if not configs:
    checkpoints = _flag_values(out, "checkpoint")
    checkpoint = out[checkpoints[-1][0]][len(checkpoints[-1][1]):] if checkpoints else None
    default = (flags.FLAGS["config"].default_as_str or "").strip("'")
    default = "" if default == "None" else default
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "config.json")):
      out.insert(1, f"--config={EXPORT_CONFIG}:{os.path.abspath(checkpoint)}")
    elif default and resolve_config_path(default) != default:
      out.insert(1, f"--config={resolve_config_path(default)}")
  return out


MT_COMMANDS = ("train_mt", "translate")  # their configs are the translation schema (configs/ui_de_en.py)
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")
HELPFULL_FLAGS = ("--helpfull", "-helpfull")


def _help_requested(argv) -> str:
  """'short' / 'full' when argv asks for help (before a `--`), else ''."""
  for arg in argv[1:]:
    if arg == "--":
      break
    if arg in HELP_FLAGS:
      return "short"
    if arg in HELPFULL_FLAGS:
      return "full"
  return ""


def print_help(module: str, full: bool = False) -> None:
  """The launch module's docstring and its own flags on stdout (absl's --help shows only "USAGE ... Try
  --helpfull" for an installed command, whose __main__ is the console-script wrapper, and exits 1)."""
  from absl import flags

  mod = sys.modules.get(module)
  doc = (getattr(mod, "__doc__", None) or "").strip("\n")
  prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else module
  if module == "__main__" or not doc:
    key = sys.argv[0]  # `python -m trime_jax.launch.X`: absl files __main__'s flags under the script's path
  else:
    key = module
  if module == "__main__":
    name = getattr(getattr(mod, "__spec__", None), "name", None) or prog
  else:
    name = module
  text = flags.FLAGS.get_help() if full else flags.FLAGS.module_help(key)
  if not full and "config" in flags.FLAGS and "--config" not in text:
    text += "\n" + flags.FLAGS.module_help(flags.FLAGS.find_module_defining_flag("config") or key)
  head = name if prog.endswith(".py") or prog == name else f"{prog} ({name})"
  schema = "configs/ui_de_en.py" if name.rsplit(".", 1)[-1] in MT_COMMANDS else "configs/default.py"
  tail = ("--config.SECTION.FIELD=VALUE overrides a field of the config (every field, with a comment: "
          f"{schema}); " if "config" in flags.FLAGS else "") + "--helpfull also lists absl's and JAX's flags."
  try:
    print(f"{head}\n\n{doc}\n\nflags:\n{text}\n\n{tail}", flush=True)
  except BrokenPipeError:  # `--help | head`
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# Command-line flags renamed for one name per quantity (issue 34): old -> new. The one table of renamed flags
# (config fields: runtime.workdir.RENAMED_FIELDS). A program that defines the new flag and not the old one
# refuses the old with one line naming the new (translate's --temperature was kNN-MT's T; generate's
# --temperature is the sampling temperature, still defined there).
RENAMED_FLAGS = {"interp_tau": "tau_prime", "interp_lambda": "knn_lambda", "lambda": "knn_lambda",
                 "temperature": "knn_mt_temperature"}


def renamed_argument(argv) -> str:
  """The one-line error for the first argument of `argv` that uses a retired name (a flag of RENAMED_FLAGS this
  program no longer defines, or a `--config.x.y` override of a field in RENAMED_FIELDS), else ""."""
  from absl import flags

  from trime_jax.runtime.workdir import RENAMED_FIELDS, renamed_field_message

  for arg in argv[1:]:
    if arg == "--":
      break
    if not arg.startswith("-"):
      continue
    name = arg.lstrip("-").partition("=")[0]
    new = RENAMED_FLAGS.get(name)
    if new and name not in flags.FLAGS and new in flags.FLAGS:
      return f"--{name} is now --{new}"
    if name.startswith("config.") and "config" in flags.FLAGS and name[len("config."):] in RENAMED_FIELDS:
      return renamed_field_message(name[len("config."):])
  return ""


def renamed_field_refused(e: BaseException) -> str:
  """The rename's one line when `e` is a locked config refusing a field of RENAMED_FIELDS (a --config file that
  still sets `c.eval.temperature = ...`), else "". The refusing section is found in the traceback (its keys say
  whether it is `trime` or `eval`: both had a `temperature`)."""
  from ml_collections import ConfigDict

  from trime_jax.configs import default
  from trime_jax.runtime.workdir import RENAMED_FIELDS, renamed_field_message

  seen, todo = set(), [e]
  while todo:
    x = todo.pop()
    if x is None or id(x) in seen:
      continue
    seen.add(id(x))
    todo += [x.__cause__, x.__context__] + [a for a in x.args if isinstance(a, BaseException)]
    tb = x.__traceback__
    while tb is not None:
      frame_locals = tb.tb_frame.f_locals if tb.tb_frame.f_code.co_name == "__setitem__" else {}
      fields, key = frame_locals.get("self"), frame_locals.get("key")
      tb = tb.tb_next
      if not isinstance(fields, ConfigDict) or not isinstance(key, str):
        continue
      olds = [old for old in RENAMED_FIELDS if old.split(".")[1] == key]
      if olds:  # the section whose fields overlap the refusing one's most
        sections = default.get_config()
        overlap = lambda old: len(set(fields.keys()) & set(sections[old.split(".")[0]].keys()))
        return renamed_field_message(max(olds, key=overlap))
  return ""


def _parse_flags(argv, module: str = "__main__", checkpoint_is_export: bool = True):
  """absl flag parsing, but a bad flag or config override (typo in --config.x.y) is one line, not a traceback;
  a flag or config field under a retired name is one line naming the new one; --help prints the module's
  docstring and flags and exits 0."""
  from absl import flags

  wanted = _help_requested(argv)
  if wanted:
    print_help(module, full=wanted == "full")
    sys.exit(0)
  renamed = renamed_argument(argv)
  if renamed:
    print(f"error: {renamed}", file=sys.stderr, flush=True)
    sys.exit(2)
  given = list(argv)
  try:
    argv = _config_argv(_checkpoint_argv(argv) if checkpoint_is_export else argv)
    sys.argv[:] = argv  # ml_collections reads the --config.x.y overrides from sys.argv
    out = flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - every parse failure is a usage error
    renamed = renamed_field_refused(e)
    if renamed:
      print(f"error: {renamed}", file=sys.stderr, flush=True)
      sys.exit(2)
    inner = e
    while inner.args and isinstance(inner.args[0], BaseException):
      inner = inner.args[0]
    chain = [inner, e, e.__cause__, e.__context__]
    # An export's stored config refused while --config loads it is about the file, not a flag.
    kind = "" if any(isinstance(x, TrimeError) for x in chain) else "bad command-line flag: "
    # A --config file that is not there (whatever else failed because of it); the config file's own error: about
    # the file, not a flag; an override of a field the config lacks: which; a field the file sets that the
    # config lacks: where in the file
    config_file = _given_config_file(argv)
    raised = (_missing_config_file(config_file) or _config_file_error(str(e)) or _unknown_override(given, inner)
              or _field_missing_in_file(config_file, chain))
    if not raised and "has no attribute 'get_config'" in str(e):
      raised = (f"--config={config_file}: the file has no get_config() (a config file defines "
                "get_config() returning an ml_collections.ConfigDict, as configs/*.py)")
    print(f"error: {raised}" if raised else f"error: {kind}{_one_line(e)}", file=sys.stderr, flush=True)
    sys.exit(2)
  renamed = _renamed_in_config_file()
  if renamed:
    print(f"error: {renamed}", file=sys.stderr, flush=True)
    sys.exit(2)
  held = flags.FLAGS["config"].value if "config" in flags.FLAGS else None
  if isinstance(held, (dict, list, tuple, str, int, float)):  # get_config() returned something else (a traceback
    # at the first field read, before)
    print(f"error: --config={_given_config_file(argv)}: get_config() returned a {type(held).__name__}, not an "
          "ml_collections.ConfigDict", file=sys.stderr, flush=True)
    sys.exit(2)
  return out


def _unknown_override(argv, error) -> str:
  """The one line for a `--config.a.b=v` override naming a field the config lacks (ml_collections' KeyError
  said only "bad command-line flag: 'b'"): the override, the missing field, its suggestion; and when the config is
  a translation export's (--checkpoint without --config), that the export is one. "" for any other error."""
  if not isinstance(error, KeyError) or not error.args or not isinstance(error.args[0], str):
    return ""
  key, _, hint = error.args[0].partition("\n")
  key = key.strip("'\"")
  for arg in argv[1:]:
    path = arg.lstrip("-").partition("=")[0]
    parts = path.split(".")
    if arg.startswith("--config.") and key in parts[1:]:
      missing = ".".join(parts[1:parts.index(key, 1) + 1])
      line = f"bad command-line flag: --{path}: the config has no field {missing}" + (f" ({hint})" if hint else "")
      found = _flag_values(list(argv), "checkpoint")
      if found and not _flag_values(list(argv), "config"):
        from trime_jax import exports

        from trime_jax.api import export_path

        at, prefix = found[-1]
        try:  # as --checkpoint is read: a workdir's export/, a shipped model's name
          checkpoint = export_path(argv[at][len(prefix):], say=lambda note: None) if argv[at][len(prefix):] else ""
        except ConfigError:
          checkpoint = ""
        if checkpoint and exports.is_mt_export(checkpoint):
          line += f"; {exports.MT_EXPORT_MESSAGE.format(directory=checkpoint)}"
      return line
  return ""


def _missing_config_file(path: str) -> str:
  """The one line for a --config path that is not a file ("" when it is one, or when none was given)."""
  path = path.split(":")[0]  # config_flags accepts file.py:arg
  if path in ("", "?") or os.path.isfile(path):
    return ""
  if os.path.isdir(path):
    return f"--config={path} is a folder, not a config file (configs/*.py)"
  import difflib

  shipped_dir = os.path.join(PACKAGE_ROOT, "configs")
  shipped = sorted(n[:-3] for n in os.listdir(shipped_dir) if n.endswith(".py") and not n.startswith("_")) \
      if os.path.isdir(shipped_dir) else []
  close = difflib.get_close_matches(os.path.basename(path).removesuffix(".py"), shipped, n=1, cutoff=0.75)
  return (f"--config file not found: {path} (working directory {os.getcwd()})"
          + (f"; did you mean configs/{close[0]}.py?" if close else ""))


def _field_missing_in_file(path: str, chain) -> str:
  """The one line for a config file whose get_config() sets a field the (locked) config lacks: the file, its
  line, the field and ml_collections' suggestion; ml_collections' own message dumped every field of the
  section on one line. "" for any other error."""
  import linecache
  import re

  errors = [x for x in chain if x is not None]
  texts = [str(x) for x in errors]  # a KeyError's repr (quoted, \n escaped) or the message itself
  found = next((m for m in (re.search(r'Key "([^"]+)" does not exist and cannot be added since the config is '
                                      r'locked', t) for t in texts) if m), None)
  if not found:
    return ""
  hint = next((m.group(0) for m in (re.search(r'Did you mean "[^"]+" instead of "[^"]+"\?', t) for t in texts)
               if m), "")
  where, target = "", os.path.abspath(path.split(":")[0])
  for error in errors:  # the config file's line in a traceback that passed through it (the AttributeError's)
    tb = error.__traceback__
    while tb is not None:
      if os.path.abspath(tb.tb_frame.f_code.co_filename) == target:
        where = f" line {tb.tb_lineno} ({linecache.getline(target, tb.tb_lineno).strip()})"
      tb = tb.tb_next
  return f"--config={path}{where}: the config has no field {found.group(1)!r}" + (f" ({hint})" if hint else "")


def _given_config_file(argv) -> str:
  """The --config file as argv gives it (its last value), or "?"."""
  found = _flag_values(list(argv), "config")
  if not found:
    return "?"
  at, prefix = found[-1]
  return argv[at][len(prefix):] or "?"


def _config_file_error(text: str) -> str:
  """ml_collections' "Error whilst parsing config file: Traceback (...)" (a config file whose import or
  get_config raised) as one line: the file and the exception it raised, without the traceback; "" otherwise."""
  head, sep, tail = text.partition("Error whilst parsing config file:")
  if not sep or "Traceback" not in tail:
    return ""
  lines = [line.strip() for line in tail.strip().splitlines() if line.strip()]
  raised = lines[-1] if lines else "an error"
  flag = head.strip().rstrip(":").strip()  # "flag --config=path"
  return f"{flag.removeprefix('flag ')}: the config file raised {raised}"


def _renamed_in_config_file() -> str:
  """The rename's one line when the loaded `--config` holds a field under a name RENAMED_FIELDS retired (an
  unlocked config file added it; nothing would read it), else "". A locked config refuses such a field while
  the flags are parsed (`renamed_field_refused`); a file that could not be read is left to run_main."""
  from absl import flags
  from ml_collections import ConfigDict

  from trime_jax.runtime.workdir import renamed_field_message, renamed_fields_in

  config = flags.FLAGS["config"].value if "config" in flags.FLAGS else None
  if not isinstance(config, ConfigDict):  # none, or config_flags' stand-in for a file it could not read
    return ""
  old = renamed_fields_in(config)
  return renamed_field_message(old[0]) if old else ""


def quiet_libraries(record) -> bool:
  """Log filter: orbax logs some 40 INFO lines per checkpoint save, faiss 8 about CPU features it lacks at
  import, jax one per backend it cannot start (libtpu.so on a CPU machine); keep their warnings and errors, and
  every other INFO line (ours). An exception raised in orbax's
  code is handed to its caller, which reports it (a damaged checkpoint: one line); the copies that orbax's
  worker threads and asyncio ("Task exception was never retrieved", for the sibling reads) log with a
  traceback are dropped."""
  if _raised_in_orbax(record):
    return False
  if record.levelno < 30 and record.pathname.endswith("xla_bridge.py") and str(record.getMessage()).startswith(
      "Unable to initialize backend 'tpu'"):  # jax trying a TPU on every CPU run: "Failed to open libtpu.so"
    return False
  noisy = any(f"{os.sep}{lib}{os.sep}" in record.pathname for lib in ("orbax", "faiss"))
  return record.levelno >= 30 or not noisy  # 30: WARNING


def _raised_in_orbax(record) -> bool:
  exc = record.exc_info[1] if record.exc_info else None
  tb = exc.__traceback__ if exc is not None else None
  while tb is not None:
    if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


def _event_file_write_failed(exc) -> bool:
  """A full disk or file size limit met by tensorboardX's own writer thread, or by the close it registers with
  atexit: the training's next flush of the event file (event_writer, every logged update) raises the same error
  in the main thread, which the CLI reports as its one line with the folder's path."""
  if not is_no_space(exc):
    return False
  tb = exc.__traceback__
  while tb is not None:
    if f"{os.sep}tensorboardX{os.sep}" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


def _quiet_closed_loop(default_hook):
  """An exception hook that drops "Event loop is closed" from orbax's asyncio loops: after a failed read
  (a damaged checkpoint, reported and handled), TensorStore completes the remaining reads on its own threads
  and calls back into the loop orbax already closed, and orbax's unawaited read coroutines are finalised with
  the read's exception. It also drops tensorboardX's copies of a failed event-file write
  (_event_file_write_failed). Every other exception goes to `default_hook`."""

  def hook(*args):
    exc = args[0].exc_value if len(args) == 1 else args[1]
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
      return None
    code = getattr(getattr(args[0], "object", None), "cr_code", None) if len(args) == 1 else None
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
      return None  # the same failed read, finalised later as one of orbax's abandoned read coroutines
    if _event_file_write_failed(exc):
      return None
    return default_hook(*args)

  return hook


def redeliver_interrupts(default_hook):
  """An unraisable-exception hook that delivers a dropped Ctrl-C again. Python raises SIGINT's KeyboardInterrupt
  wherever the main thread is; inside a finaliser or a gc callback (JAX's `_xla_gc_callback` runs after every
  collection) it cannot propagate and went to this hook, printed as "Exception ignored", and the command ran on
  (training has its own watch, `runtime.preemption.InterruptWatch`). Here it is signalled to the main thread
  again (`_thread.interrupt_main`) from another thread a moment later, so that it is raised once the main thread
  is back in its own code (signalled from the hook itself, it was raised in the hook, and dropped again). Every
  other exception goes to `default_hook`."""
  import _thread
  import threading

  def hook(unraisable):
    if isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, KeyboardInterrupt):
      again = threading.Timer(0.05, _thread.interrupt_main)
      again.daemon = True
      again.start()
      return None
    return default_hook(unraisable)

  return hook


# OSErrors that come from the machine, not from a bug: a folder where a file belongs (or the reverse), no
# permission, a full disk or quota, a read-only file system, a file too large for the limit.
import errno as _errno

ENVIRONMENT_ERRNOS = NO_SPACE_ERRNOS + (_errno.EISDIR, _errno.ENOTDIR, _errno.EACCES, _errno.EPERM, _errno.EROFS,
                                      _errno.ENOENT, _errno.EEXIST, _errno.ENAMETOOLONG)


def os_error_line(e: OSError) -> str:
  """One line for an OSError of the machine (ENVIRONMENT_ERRNOS): what failed, on which path, what to do."""
  what = os.strerror(e.errno) if e.errno else str(e)
  path = e.filename if e.filename is not None else ""
  hint = {_errno.ENOSPC: "free space and rerun the same command", _errno.EDQUOT: "free space (quota) and rerun",
          _errno.EACCES: "check the path's permissions", _errno.EPERM: "check the path's permissions",
          _errno.EROFS: "write to another location", _errno.EISDIR: "give a file, not a folder",
          _errno.ENOTDIR: "a part of the path is a file, not a folder",
          _errno.EFBIG: "a file size limit (ulimit -f) was reached: raise it and rerun the same command"}.get(
              e.errno, "")
  return f"{what}: {path}" + (f" ({hint})" if hint else "")


def _end_progress_lines() -> None:
  """Close the progress bars an error left open (tqdm's, TFDS's among them): each ends its line, so the `error:`
  line that follows starts a line of its own (after a bar's carriage return it was glued to the bar's text)."""
  tqdm = sys.modules.get("tqdm")
  for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
    try:
      bar.close()
    except Exception:  # noqa: BLE001 - a bar that cannot close must not hide the error line
      pass


def run_main(main, *, checkpoint_is_export: bool = True):
  """Run an absl `main`; input errors (TrimeError) print one `error: ...` line and exit with status 2, as do
  errors of the machine (a folder for a file, no permission, a full disk: ENVIRONMENT_ERRNOS).
  checkpoint_is_export: a `--checkpoint` flag names an export, read as `trime_jax.load` reads a path
  (`_checkpoint_argv`); False where it names something else (import_fairseq: a fairseq .pt)."""
  import functools
  import threading

  from absl import app, logging

  logging.set_verbosity(logging.INFO)  # train.py lowers it on processes other than 0
  logging.get_absl_handler().python_handler.addFilter(quiet_libraries)
  sys.excepthook = _quiet_closed_loop(sys.excepthook)
  sys.unraisablehook = redeliver_interrupts(_quiet_closed_loop(sys.unraisablehook))
  threading.excepthook = _quiet_closed_loop(threading.excepthook)

  def wrapped(argv):
    from absl import flags

    if int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
      # When a peer dies JAX aborts the survivors with one clear line ("... another task died"); absl's
      # faulthandler would bury it under every thread's Python stack.
      import faulthandler

      faulthandler.disable()

    try:  # config_flags raises UnparsedFlagError for a --config that was not given
      given = "config" in flags.FLAGS and flags.FLAGS["config"].config_filename
    except Exception:  # noqa: BLE001
      given = None
    said = _missing_config_file(given) if given else ""
    if said:
      print(f"error: {said}", file=sys.stderr, flush=True)
      sys.exit(2)
    try:
      return main(argv)
    except TrimeError as e:
      _end_progress_lines()
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
    except OSError as e:  # e.g. a --config file that does not exist (config_flags loads it lazily)
      _end_progress_lines()
      if e.errno in ENVIRONMENT_ERRNOS:
        print(f"error: {os_error_line(e)}", file=sys.stderr, flush=True)
        sys.exit(2)
      if "config" not in str(e).lower():
        raise
      print(f"error: {_one_line(e)}", file=sys.stderr, flush=True)
      sys.exit(2)
    except KeyboardInterrupt:  # training and datastore builds say what is on disk themselves
      _end_progress_lines()
      print("interrupted (Ctrl-C): output files are written whole or not at all; rerun the same command",
            file=sys.stderr, flush=True)
      sys.exit(130)

  app.run(wrapped, flags_parser=functools.partial(_parse_flags, module=main.__module__,
                                                  checkpoint_is_export=checkpoint_is_export))


def exit_now(code: int) -> None:
  """Exit with `code` without the interpreter's teardown: after a Ctrl-C that stopped JAX mid-work (a dispatch, a
  compilation), tearing down its native threads crashed the process about one time in two (segmentation fault,
  rc 139 instead of 130). Everything the run keeps is on disk by then (the loop waits for the save in flight;
  metrics lines and outputs are written whole); the standard streams and logging are flushed first."""
  import logging as std_logging

  std_logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def train_in_workdir(train_and_evaluate, config, workdir: str | None, example: str) -> None:
  """The training CLIs' common end (train, train_mt): `train_and_evaluate(config, workdir)` with the exit codes
  their docstrings promise: a missing --workdir is one `error:` line (exit 2; `example` is shown as the fix),
  a preemption exits with PREEMPTED_EXIT_CODE (143) after its checkpoint, Ctrl-C with 130 naming what is on disk
  to resume from."""
  from trime_jax.errors import ConfigError
  from trime_jax.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted
  from trime_jax.runtime.workdir import on_disk

  if not workdir:
    raise ConfigError("--workdir is required: the run directory for checkpoints, metrics.jsonl and export/ "
                      f"(e.g. --workdir={example}); rerunning with the same --workdir resumes")
  try:
    train_and_evaluate(config, workdir)  # lines on stdout from process 0, above a progress bar
  except Preempted as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(PREEMPTED_EXIT_CODE)
  except KeyboardInterrupt:
    print(f"interrupted: {on_disk(workdir)}", file=sys.stderr, flush=True)
    exit_now(130)


def validated(config, checkpoint: str | None = None, *, training: bool = False):
  """`config` after train.validate_config (enums and ranges, eval's included): the evaluation CLIs check a config
  up front like training does, before loading a checkpoint or compiling anything. checkpoint: the export they
  read, refused when it is a translation export. training: a config to train with (launch.train, make_batches),
  checked as training checks it."""
  from trime_jax import exports
  from trime_jax.errors import ConfigError
  from trime_jax.train import validate_config

  # A translation export (and its stored config, of configs/ui_de_en.py's schema): said as such, not as the first
  # language-model field it lacks
  if checkpoint and exports.is_mt_export(checkpoint):
    raise ConfigError(exports.MT_EXPORT_MESSAGE.format(directory=checkpoint))
  if exports.is_mt_config(config):
    raise ConfigError("--config is a translation config (configs/ui_de_en.py's schema): train it with "
                      "trime_jax.launch.train_mt, translate with trime_jax.launch.translate")
  if config is not None:
    validate_config(config, training=training)
  return config


def default_workdir(config_path: str) -> str:
  name = os.path.splitext(os.path.basename(config_path or "run"))[0]
  return os.path.join("runs", name)


DATASTORE_FILES = ("keys.npy", "values.npy", "meta.json", "index.faiss", "index.faiss.json")


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
  from trime_jax.errors import ConfigError

  if not str(path or "").strip():
    raise ConfigError(f"--{flag} is empty: give the folder to write")
  out = os.path.realpath(path)
  inside = lambda child, parent: child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)
  if inside(os.path.realpath(os.getcwd()), out):
    raise ConfigError(f"--{flag}={path} is the working directory or a folder holding it: give a folder of its own")
  for name, given in reads:
    if given and inside(os.path.realpath(given), out):
      raise ConfigError(f"--{flag}={path} holds this command's own input {name}={given}: writing there would "
                        f"replace what it reads; choose another --{flag}")


def refuse_target(path: str, flag: str, wanted: str, ok=(), overwrite: bool = False) -> str:
  """Refuse writing `wanted` (e.g. "an export") to `path` when it holds anything else than one of `ok`
  (describe_target's words), unless `overwrite`; returns describe_target(path). Raises ConfigError naming what
  is there, so nothing is replaced silently."""
  from trime_jax.errors import ConfigError

  what = describe_target(path)
  if what and what not in ok and not overwrite:
    raise ConfigError(f"--{flag}={path} already holds {what}, not {wanted}: choose another --{flag} "
                      f"(or add --overwrite to replace it)")
  return what


def export_fingerprint(checkpoint) -> str:
  """An export's fingerprint (exports.fingerprint) for the results it is evaluated into; "" when it cannot be
  read (a missing or damaged export is refused with its own message by the checks after)."""
  from trime_jax import exports

  try:
    return exports.fingerprint(checkpoint) if checkpoint else ""
  except Exception:  # noqa: BLE001 - said by check_export
    return ""


def results_checkpoint(held) -> str | None:
  """The export fingerprint an evaluation's results file records (eval: on every row; eval_ext: at the top), or
  None for results written before 2026-12-06."""
  rows = held if isinstance(held, list) else [held] if isinstance(held, dict) else []
  found = {r.get("checkpoint_fingerprint") for r in rows if isinstance(r, dict)} - {None}
  return next(iter(found)) if len(found) == 1 else None


def check_output_file(path: str, flag: str, *, json_results: bool = False, program: str = "",
                      checkpoint_fingerprint: str = "", overwrite: bool = False) -> None:
  """An output file the program writes at the end: refused up front (before the work) when it is a folder, when
  a folder on its way is a file, or when it cannot be created for lack of permission. `json_results`: an
  existing file is replaced only when it holds an earlier evaluation's results (eval's list of rows, eval_ext's
  object with "rows"), never a config, script, text or another program's JSON (a datastore's or an export's
  meta.json, a config.json) a mistyped name points at; and unless `overwrite` (--overwrite), only results of the
  same `program` ("eval": a list, "eval_ext": an object) and, where the file records it, the same export
  (`checkpoint_fingerprint`): a rerun replaces its own results, not another model's or program's."""
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


def check_flag(holder, ok, what: str) -> None:
  """Range-check a flag when it is parsed (a bad value is one `error:` line before any work); None passes."""
  from absl import flags

  flags.register_validator(holder.name, lambda v: v is None or ok(v), message=f"--{holder.name} must be {what}")


def config_given() -> bool:
  """Whether the command line gives a config of its own: a `--config` other than the export's stored one (which
  a `--checkpoint` without `--config` reads, `_config_argv`), or a `--config.x.y=...` override."""
  argv = sys.argv
  for at, prefix in _flag_values(argv, "config"):
    if not argv[at][len(prefix):].startswith(EXPORT_CONFIG + ":"):
      return True
  return any(a.startswith("-") and a.lstrip("-").startswith("config.") for a in argv[1:])


def given_overrides(section: str) -> dict:
  """{field: raw value} of the `--config.<section>.<field>=...` overrides on the command line."""
  out = {}
  args = sys.argv[1:]
  for i, arg in enumerate(args):
    if arg == "--":
      break
    name, eq, value = arg.lstrip("-").partition("=")
    prefix = f"config.{section}."
    if arg.startswith("-") and name.startswith(prefix):
      out[name[len(prefix):]] = value if eq else (args[i + 1] if i + 1 < len(args) else "")
  return out


def check_export(config, checkpoint: str) -> None:
  """The export's stored config.json has no field this version does not know (exports.check_stored_config), and no
  `--config.model.X=...` differs from it: an export's architecture is fixed (evaluation, datastores and
  generation use the export's `model` section), so such an override would be ignored; nor is
  `--config.data.vocab_min_count` given (the vocabulary is the export's). Each is one error naming the file or
  the field with both values."""
  from trime_jax.exports import check_stored_config
  from trime_jax.errors import ConfigError

  if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "config.json")):
    return  # the export's own checks report a missing export or config.json
  path = os.path.join(checkpoint, "config.json")
  stored_all = check_stored_config(checkpoint)
  stored = stored_all.get("model", {})
  data_given = given_overrides("data")
  there = stored_all.get("data", {}).get("vocab_min_count")
  if "vocab_min_count" in data_given and config is not None and config.data.get("vocab_min_count") != there:
    # the vocabulary is the export's vocab.json: another value would be unread (the export's own is harmless)
    raise ConfigError(f"--config.data.vocab_min_count={data_given['vocab_min_count']}: an export's vocabulary is "
                      f"fixed (its vocab.json; {path} has data.vocab_min_count={there!r}); drop the override")
  given = given_overrides("model")
  if not given or config is None or "model" not in config:
    return
  for field in sorted(given):
    now = config.model.get(field) if field in config.model else None
    there = stored.get(field)
    now, there = (tuple(v) if isinstance(v, list) else v for v in (now, there))
    if field not in stored or now != there:
      raise ConfigError(f"--config.model.{field}={given[field]}: an export's architecture is fixed and is used as "
                        f"stored ({path} has model.{field}={there!r}{'' if field in stored else ' (absent)'}); "
                        "drop the override")


def _datastore_meta(directory: str) -> dict:
  import json

  try:
    with open(os.path.join(directory, "meta.json")) as f:
      meta = json.load(f)
  except (OSError, ValueError, UnicodeDecodeError):
    return {}  # the datastore's own checks report a missing or damaged meta.json
  return meta if isinstance(meta, dict) else {}


def overlap_error(datastore: str, ds_split: str, split: str, role: str, fix: str):
  from trime_jax.errors import ConfigError

  return ConfigError(f"split leakage: the datastore {datastore} was built from {ds_split}, the very split this "
                     f"run {role}: each scored token would retrieve itself. {fix}, or pass "
                     "--allow_split_overlap to study the leakage on purpose")


def check_split_overlap(config, checkpoint: str, allow: bool = False) -> None:
  """External memory must not hold the text it is evaluated on: the datastore's meta.json records the corpus
  it was built from (corpus_fingerprint over its tokens, corpus_name with its split); the splits this
  evaluation scores (eval.split, and dev when eval.tune tunes on it) are compared by content. An error names
  both, unless `allow` (--allow_split_overlap)."""
  e = config.eval
  if allow or not e.get("datastore"):
    return
  meta = _datastore_meta(e.datastore)
  if not meta.get("corpus_fingerprint"):
    return
  from trime_jax import exports
  from trime_jax import evaluate

  splits = evaluate.load_eval_data(config, exports.read_export_vocab(checkpoint))
  scored = [(e.split, f"scores (eval.split={e.split})")]
  if e.tune and e.split != "dev":
    scored.append(("dev", "tunes on (eval.tune=True tunes on dev)"))
  for split, role in scored:
    if splits.get(split).fingerprint() == meta["corpus_fingerprint"]:
      fix = ("Evaluate another split (--config.eval.split=dev or test)" if split == "train" else
             "Build the datastore from the training split (trime_jax.launch.build_datastore --split=train)")
      raise overlap_error(e.datastore, meta.get("corpus_name") or f"the {split} split", split, role, fix)


# Fields that decide which documents (or bytes) land in which split, per corpus whose splits are drawn here
# (wikitext, tfds: and docs-wt package selections keep each document in its released split).
SPLIT_FIELDS = {"wikitext_mini": ("split_fractions", "split_seed"), "bytes": ("split_fractions",),
                "stdlib": ("split_fractions", "split_seed", "max_files", "max_bytes_per_file")}


def check_data_split(config, checkpoint: str, allow: bool = False) -> None:
  """Evaluating an export on the corpus it was trained on, with the splits drawn differently (another
  data.split_seed or split_fractions), puts training text into dev / test: refused, naming the fields and both
  values, unless `allow` (--allow_split_overlap). The export's config.json records the data section it was
  trained with."""
  import json

  from trime_jax.errors import ConfigError

  if allow or config is None or not checkpoint:
    return
  try:
    with open(os.path.join(checkpoint, "config.json")) as f:
      stored = json.load(f).get("data", {})
  except (OSError, ValueError, AttributeError):
    return  # the export's own checks report a missing or damaged config.json
  d = config.data
  fields = SPLIT_FIELDS.get(d.corpus, ())
  if not fields or stored.get("corpus") != d.corpus:
    return
  if d.corpus != "stdlib" and os.path.abspath(str(stored.get("path", ""))) != os.path.abspath(str(d.path)):
    if os.path.basename(str(stored.get("path", "")).rstrip("/")) != os.path.basename(str(d.path).rstrip("/")):
      return  # other text: nothing of the training split is in it
  norm = lambda v: [float(x) for x in v] if isinstance(v, (list, tuple)) else v
  diff = [f"data.{f}={norm(d.get(f))!r} now, {norm(stored.get(f))!r} in training" for f in fields
          if f in stored and norm(d.get(f)) != norm(stored.get(f))]
  if diff:
    raise ConfigError(f"split leakage: {checkpoint} was trained on data.corpus={d.corpus!r} with its splits drawn "
                      f"otherwise ({'; '.join(diff)}), so this run's dev / test hold training text. Use the export's "
                      "data settings (omit --config, or match them), or pass --allow_split_overlap on purpose")
