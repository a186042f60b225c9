"""Shared CLI plumbing: `--config` files with `--config.a.b=...` overrides, one-line errors."""

from __future__ import annotations

import os
import sys

from trime_jax.errors import TrimeError


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


def _config_argv(argv: list[str]) -> list[str]:
  """argv with `--config` paths resolved (`resolve_config_path`, the flag's default too); a program given
  `--checkpoint=<export dir>` and no `--config` reads the export's stored config (launch/export_config.py), so
  evaluation takes its data and eval settings from the export unless `--config` (or `--config.x.y=...`) overrides
  them."""
  from absl import flags

  if "config" not in flags.FLAGS:
    return argv
  out, config_at, checkpoint = list(argv), -1, None
  for i, arg in enumerate(out[1:], 1):
    if arg == "--":
      break
    name, eq, value = arg.lstrip("-").partition("=")
    if name in ("config", "checkpoint") and not eq and i + 1 < len(out):
      value = out[i + 1]
    if name == "config":
      config_at = i if eq else i + 1
      out[config_at] = (arg[:arg.index("=") + 1] if eq else "") + resolve_config_path(value)
    elif name == "checkpoint":
      checkpoint = value
  if config_at < 0:
    default = (flags.FLAGS["config"].default_as_str or "").strip("'")
    default = "" if default == "None" else default
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "config.json")):
      out.insert(1, f"--config={EXPORT_CONFIG}:{os.path.abspath(checkpoint)}")
    elif default and resolve_config_path(default) != default:
      out.insert(1, f"--config={resolve_config_path(default)}")
  return out


def _parse_flags(argv):
  """absl flag parsing, but a bad flag or config override (typo in --config.x.y) is one line, not a traceback."""
  from absl import flags

  try:
    argv = _config_argv(argv)
    sys.argv[:] = argv  # ml_collections reads the --config.x.y overrides from sys.argv
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - every parse failure is a usage error
    print(f"error: bad command-line flag: {_one_line(e)}", file=sys.stderr, flush=True)
    sys.exit(2)


def quiet_libraries(record) -> bool:
  """Log filter: orbax logs some 40 INFO lines per checkpoint save and faiss 8 about CPU features it lacks at
  import; keep their warnings and errors, and every other INFO line (ours). An exception raised in orbax's
  code is handed to its caller, which reports it (a damaged checkpoint: one line); the copies that orbax's
  worker threads and asyncio ("Task exception was never retrieved", for the sibling reads) log with a
  traceback are dropped."""
  if _raised_in_orbax(record):
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


def _quiet_closed_loop(default_hook):
  """An exception hook that drops "Event loop is closed" from orbax's asyncio loops: after a failed read
  (a damaged checkpoint, reported and handled), TensorStore completes the remaining reads on its own threads
  and calls back into the loop orbax already closed, and orbax's unawaited read coroutines are finalised with
  the read's exception. Every other exception goes to `default_hook`."""

  def hook(*args):
    exc = args[0].exc_value if len(args) == 1 else args[1]
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
      return None
    code = getattr(getattr(args[0], "object", None), "cr_code", None) if len(args) == 1 else None
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
      return None  # the same failed read, finalised later as one of orbax's abandoned read coroutines
    return default_hook(*args)

  return hook


def run_main(main):
  """Run an absl `main`; input errors (TrimeError) print one `error: ...` line and exit with status 2."""
  import threading

  from absl import app, logging

  logging.set_verbosity(logging.INFO)  # train.py lowers it on processes other than 0
  logging.get_absl_handler().python_handler.addFilter(quiet_libraries)
  sys.excepthook = _quiet_closed_loop(sys.excepthook)
  sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)
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
    if given:
      path = given.split(":")[0]  # config_flags accepts file.py:arg
      if not os.path.isfile(path):
        print(f"error: --config file not found: {path} (working directory {os.getcwd()})", file=sys.stderr,
              flush=True)
        sys.exit(2)
    try:
      return main(argv)
    except TrimeError as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
    except OSError as e:  # e.g. a --config file that does not exist (config_flags loads it lazily)
      if "config" not in str(e).lower():
        raise
      print(f"error: {_one_line(e)}", file=sys.stderr, flush=True)
      sys.exit(2)
    except KeyboardInterrupt:
      print("interrupted: the last orbax checkpoint is intact; rerun the same command to resume",
            file=sys.stderr, flush=True)
      sys.exit(130)

  app.run(wrapped, flags_parser=_parse_flags)


def validated(config):
  """`config` after train.validate_config (enums and ranges, eval's included): the evaluation CLIs check a config
  up front like training does, before loading a checkpoint or compiling anything."""
  from trime_jax.train import validate_config

  if config is not None:
    validate_config(config)
  return config


def default_workdir(config_path: str) -> str:
  name = os.path.splitext(os.path.basename(config_path or "run"))[0]
  return os.path.join("runs", name)
