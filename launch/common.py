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


def _parse_flags(argv):
  """absl flag parsing, but a bad flag or config override (typo in --config.x.y) is one line, not a traceback."""
  from absl import flags

  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - every parse failure is a usage error
    print(f"error: bad command-line flag: {_one_line(e)}", file=sys.stderr, flush=True)
    sys.exit(2)


def quiet_libraries(record) -> bool:
  """Log filter: orbax logs some 40 INFO lines per checkpoint save and faiss 8 about CPU features it lacks at
  import; keep their warnings and errors, and every other INFO line (ours)."""
  noisy = any(f"{os.sep}{lib}{os.sep}" in record.pathname for lib in ("orbax", "faiss"))
  return record.levelno >= 30 or not noisy  # 30: WARNING


def run_main(main):
  """Run an absl `main`; input errors (TrimeError) print one `error: ...` line and exit with status 2."""
  from absl import app, logging

  logging.set_verbosity(logging.INFO)  # train.py lowers it on processes other than 0
  logging.get_absl_handler().python_handler.addFilter(quiet_libraries)

  def wrapped(argv):
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


def default_workdir(config_path: str) -> str:
  name = os.path.splitext(os.path.basename(config_path or "run"))[0]
  return os.path.join("runs", name)
