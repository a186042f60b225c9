"""Preemption for both trainers: SIGTERM (or JAX's multi-host preemption notice) is noticed between updates;
the trainer checkpoints the update it is at and raises `Preempted`; the CLIs exit with PREEMPTED_EXIT_CODE."""

from __future__ import annotations

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


