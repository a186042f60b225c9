"""How every program starts and ends (`run_main`): absl's flags parsed by `flags.parse_flags`, input errors and
errors of the machine as one `error:` line with exit status 2, Ctrl-C as 130, a preemption as 143, and the
libraries' noise (orbax, faiss, tensorboardX) kept off the terminal."""

from __future__ import annotations

import os
import sys

from trime_jax.errors import ENVIRONMENT_ERRNOS, TrimeError, is_no_space, os_error_line
from trime_jax.launch.flags import missing_config_file, one_line, parse_flags


def quiet_libraries(record) -> bool:
  """Log filter: orbax logs some 40 INFO lines per checkpoint save, faiss 8 about CPU features it lacks at
  import, bm25s one per index it builds (its progress bars say it), jax one per backend it cannot start (libtpu.so
  on a CPU machine); keep their warnings and errors, and
  every other INFO line (ours). An exception raised in orbax's
  code is handed to its caller, which reports it (a damaged checkpoint: one line); the copies that orbax's
  worker threads and asyncio ("Task exception was never retrieved", for the sibling reads) log with a
  traceback are dropped."""
  if _raised_in_orbax(record):
    return False
  if record.levelno < 30 and record.pathname.endswith("xla_bridge.py") and str(record.getMessage()).startswith(
      "Unable to initialize backend 'tpu'"):  # jax trying a TPU on every CPU run: "Failed to open libtpu.so"
    return False
  noisy = any(f"{os.sep}{lib}{os.sep}" in record.pathname for lib in ("orbax", "faiss", "bm25s"))
  return record.levelno >= 30 or not noisy  # 30: WARNING


def _raised_in(exc, library: str) -> bool:
  """Whether `exc` (None: no) passed through the code of `library` (a folder name in its frames' files)."""
  tb = exc.__traceback__ if exc is not None else None
  while tb is not None:
    if f"{os.sep}{library}{os.sep}" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


def _raised_in_orbax(record) -> bool:
  return _raised_in(record.exc_info[1] if record.exc_info else None, "orbax")


def _event_file_write_failed(exc) -> bool:
  """A full disk or file size limit met by tensorboardX's own writer thread, or by the close it registers with
  atexit: the training's next flush of the event file (event_writer, every logged update) raises the same error
  in the main thread, which the CLI reports as its one line with the folder's path."""
  return is_no_space(exc) and _raised_in(exc, "tensorboardX")


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


def _end_progress_lines() -> None:
  """Close the progress bars an error left open (tqdm's, TFDS's among them): each ends its line, so the `error:`
  line that follows starts a line of its own (after a bar's carriage return it was glued to the bar's text)."""
  tqdm = sys.modules.get("tqdm")
  for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
    try:
      bar.close()
    except Exception:  # noqa: BLE001 - a bar that cannot close must not hide the error line
      pass


INTERRUPTED = "output files are written whole or not at all; rerun the same command"


def run_main(main, *, checkpoint_is_export: bool = True, interrupted: str = INTERRUPTED):
  """Run an absl `main`; input errors (TrimeError) print one `error: ...` line and exit with status 2, as do
  errors of the machine (a folder for a file, no permission, a full disk: ENVIRONMENT_ERRNOS).
  checkpoint_is_export: a `--checkpoint` flag names an export, read as `trime_jax.load` reads a path
  (`launch.flags.parse_flags`); False where it names something else (import_fairseq: a fairseq .pt).
  interrupted: what a Ctrl-C leaves, said after "interrupted (Ctrl-C): " (exit status 130)."""
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
    jax = sys.modules.get("jax")  # a run of several processes (trime_jax.distributed) imported it and started them
    if jax is not None and jax.distributed.is_initialized() and jax.process_index() != 0:
      # Several processes compute one result (a training, an evaluation split over them): process 0 prints it,
      # once (every process still says its own errors, on stderr).
      sys.stdout = open(os.devnull, "w")

    if len(argv) > 1:  # every input is a flag: a bare `eval runs/x/export` went unread
      extra = argv[1]
      hint = (f" (--checkpoint={extra}?)" if "checkpoint" in flags.FLAGS and os.path.exists(extra) else
              f" (--config={extra}?)" if "config" in flags.FLAGS and extra.endswith(".py") else "")
      print(f"error: unexpected argument {extra!r}{f' and {len(argv) - 2} more' if len(argv) > 2 else ''}: this "
            f"command takes flags only{hint}; --help lists them", file=sys.stderr, flush=True)
      sys.exit(2)
    try:  # config_flags raises UnparsedFlagError for a --config that was not given
      given = "config" in flags.FLAGS and flags.FLAGS["config"].config_filename
    except Exception:  # noqa: BLE001
      given = None
    said = missing_config_file(given) if given else ""
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
      print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
      sys.exit(2)
    except KeyboardInterrupt:  # training and datastore builds say what is on disk themselves
      _end_progress_lines()
      print(f"interrupted (Ctrl-C): {interrupted}", file=sys.stderr, flush=True)
      sys.exit(130)

  app.run(wrapped, flags_parser=functools.partial(parse_flags, module=main.__module__,
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
