"""The command line of every program: `--config` files with `--config.a.b=...` overrides, a `--checkpoint` read
as `trime_jax.load` reads a path, `--help`, renamed flags and config fields, and the one line said for each
mistake in them (`parse_flags`, which `entry.run_main` hands to absl)."""

from __future__ import annotations

import os
import sys

from trime_jax.errors import CheckpointError, ConfigError, TrimeError


def one_line(e: BaseException) -> str:
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


def parse_flags(argv, module: str = "__main__", checkpoint_is_export: bool = True):
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
    raised = (missing_config_file(config_file) or _config_file_error(str(e)) or _unknown_override(given, inner)
              or _field_missing_in_file(config_file, chain))
    if not raised:
      raised = _required_flag_missing(str(e))
    if not raised and "has no attribute 'get_config'" in str(e):
      raised = (f"--config={config_file}: the file has no get_config() (a config file defines "
                "get_config() returning an ml_collections.ConfigDict, as configs/*.py)")
    print(f"error: {raised}" if raised else f"error: {kind}{one_line(e)}", file=sys.stderr, flush=True)
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


def _required_flag_missing(message: str) -> str:
  """absl's "flag --out=None: Flag --out must have a value other than None." as "--out is required: <its help>"
  ("" for any other message)."""
  import re

  from absl import flags

  m = re.search(r"Flag --(\w+) must have a value other than None", message)
  if not m:
    return ""
  name = m.group(1)
  about = (flags.FLAGS[name].help or "").strip() if name in flags.FLAGS else ""
  return f"--{name} is required" + (f" ({about.rstrip('.')})" if about else "") + "; --help lists the flags"


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


def missing_config_file(path: str) -> str:
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
