"""Stop signals for both trainers, noticed between updates. Preemption: SIGTERM (or JAX's multi-host preemption
notice); the trainer checkpoints the update it is at and raises `Preempted`; the CLIs exit with
PREEMPTED_EXIT_CODE. Ctrl-C (SIGINT): the trainer waits for the save in flight and raises KeyboardInterrupt at the
next update boundary; a second Ctrl-C raises it at once."""

from __future__ import annotations

import os
import signal
import threading

import jax

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a run the signal ended


class Preempted(Exception):
  """Training stopped on a preemption signal after checkpointing update `step`; the same command resumes.
  launch/train.py exits with PREEMPTED_EXIT_CODE."""

  def __init__(self, step: int, directory):
    super().__init__(f"preempted: checkpoint of update {step} saved in {directory}; rerun the same command to "
                     "resume")
    self.step = step


def _jax_owns_sigterm() -> bool:
  """With `jax.distributed` running, JAX's preemption sync manager handles SIGTERM itself and agrees on a
  step all hosts save at (orbax `reached_preemption`); a Python handler would replace its C++ one."""
  try:
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client is not None
  except (ImportError, AttributeError):
    return jax.process_count() > 1


class PreemptionWatch:
  """SIGTERM sets a flag that the loop reads between updates (an update is never cut in half); the previous
  handler is restored on exit. Multi-host: orbax's `reached_preemption(step)` (all hosts agree on the step)."""

  def __init__(self, mgr=None):
    self.mgr, self.requested, self._previous = mgr, False, None

  def _handler(self, signum, frame):
    del signum, frame
    self.requested = True

  def __enter__(self):
    if not _jax_owns_sigterm() and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handler)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def reached(self, step: int) -> bool:
    return self.requested or (self.mgr is not None and self.mgr.reached_preemption(step))


class InterruptWatch:
  """Ctrl-C during training. Python's own handler raises KeyboardInterrupt wherever the main thread is, and where
  that is a finaliser (a `__del__`, a gc callback: JAX's `_xla_gc_callback`) Python prints "Exception ignored" and
  goes on: the run trained on as if nothing had been pressed (CI: no exit 120 s after a SIGINT; 3 of 16 interrupts
  by hand). Here the first SIGINT sets a flag the loop reads between updates and before its evaluations (`check()`
  raises KeyboardInterrupt there); a second raises KeyboardInterrupt at once, as without the watch (a long dev
  evaluation need not be waited for). Installed only from the main thread and where SIGINT is not ignored (a
  background job of a script ignores it); the previous handler is restored on exit."""

  MESSAGE = b"\nCtrl-C: stopping at the end of this update (Ctrl-C again to stop at once)\n"

  def __init__(self):
    self.requested, self._previous, self._installed = False, None, False

  def _handler(self, signum, frame):
    del signum, frame
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    try:  # os.write, not print: a handler that prints can land inside another print (a reentrant-call error)
      os.write(2, self.MESSAGE)
    except OSError:
      pass

  def __enter__(self):
    if (threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN):
      self._previous = signal.signal(signal.SIGINT, self._handler)
      self._installed = True
    return self

  def __exit__(self, *exc):
    if self._installed:  # None: a handler not set from Python; the default then
      signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
      self._installed = False

  def check(self) -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed since the watch began."""
    if self.requested:
      raise KeyboardInterrupt
