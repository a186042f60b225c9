"""Progress on process 0: a tqdm bar with rate and ETA where someone watches, ETA in the log lines elsewhere."""

from __future__ import annotations

import sys
import time

from absl import logging

from trime_jax.runtime.workdir import chief


def say(line: str) -> None:
  """A log line on stdout from process 0, printed above the progress bar when one is drawn."""
  if chief():
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def _hms(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _AboveBar:
  """A stream whose lines tqdm prints above its bar (tqdm's recipe for redirected writes)."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text: str) -> None:
    if text.rstrip():
      from tqdm import tqdm

      tqdm.write(text.rstrip("\n"), file=self.stream)

  def flush(self) -> None:
    self.stream.flush()


def _in_notebook() -> bool:
  """A Jupyter/Colab kernel runs this process (not merely: ipykernel was imported, e.g. by nbclient)."""
  ipython = sys.modules.get("IPython")
  shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
  return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell")  # Shell: Colab's


class Progress:
  """Rate and ETA on process 0: a tqdm bar where someone watches (a terminal or a notebook; `train.progress`
  'auto'), otherwise no bar (no carriage-return spam in log files) and the ETA goes into the log lines.
  While the bar is drawn, absl's log lines on stderr are printed above it instead of through it."""

  def __init__(self, total: int, start: int, mode: str):
    self.total, self.bar, self.t0, self.n0 = total, None, None, start
    self._log_handler = None
    interactive = sys.stderr.isatty() or _in_notebook()
    if chief() and (mode == "bar" or (mode == "auto" and interactive)):
      from tqdm.auto import tqdm

      self.bar = tqdm(total=total, initial=start, unit="update", dynamic_ncols=True, smoothing=0.05)
      handler = getattr(logging.get_absl_handler(), "python_handler", None)
      if handler is not None and handler.stream is sys.stderr:
        self._log_handler, handler.stream = handler, _AboveBar(sys.stderr)

  def update(self, done: int, **postfix) -> None:
    if self.t0 is None:  # the clock starts after the first update, which compiles
      self.t0, self.n0 = time.perf_counter(), done
    if self.bar is not None:
      self.bar.update(done - self.bar.n)
      if postfix:
        self.bar.set_postfix(postfix, refresh=False)

  def eta(self, done: int) -> str:
    if self.t0 is None or done <= self.n0:
      return "ETA ?"
    rate = (done - self.n0) / max(time.perf_counter() - self.t0, 1e-9)
    # overall: wall clock since the first update, evaluations and checkpoints included (the line's tok/s is
    # the updates' own, since the last line)
    return f"ETA {_hms((self.total - done) / rate)} ({rate:.2f} updates/s overall)"

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    if self._log_handler is not None:
      self._log_handler.stream, self._log_handler = self._log_handler.stream.stream, None


