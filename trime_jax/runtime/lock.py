"""One writer per directory: an advisory lock (`fcntl.flock`) that a second run finds taken.

A training workdir (`<workdir>/.lock`), an MT training workdir, and an export directory, datastore or batch plan
(`<directory>.lock`, beside it (`beside`), because each is written elsewhere and renamed into place) each admit
one writer. Paths are resolved first: a symlink and its target are one directory with one lock. The lock file holds
the owner's pid, host and start time, so the refusal names the process that holds it. flock is released by the
kernel when the holder dies (kill -9 included), so a stale file never blocks a rerun; the file is removed on a
clean release. Multi-process runs lock on process 0 only (every process shares the workdir).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from trime_jax.errors import TrimeError


class LockedError(TrimeError):
  """The directory is being written by another process."""


class UnwritableError(TrimeError):
  """The lock file cannot be created (a read-only or foreign location): nothing can be written there."""


class DirLock:
  """`with DirLock(path, what):` holds `path` (a lock file) for the block; LockedError if another process has it.

  `what` names the directory in the message ("workdir runs/mini"). Reentrant in one process: a nested lock on
  the same file (an export inside a locked workdir's run, twice) is a no-op, not a self-deadlock."""

  _held: dict = {}  # lock path -> depth, this process

  def __init__(self, path: str, what: str):
    # The folder resolved (symlinks followed), so one file has one lock whatever the path it was named by.
    path = os.path.abspath(path)
    self.path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    self.what, self.fd = what, None
    self.created = []  # the folders __enter__ made for the lock file, outermost first (removed again if empty)

  def __enter__(self):
    if DirLock._held.get(self.path):
      DirLock._held[self.path] += 1
      return self
    tries = 0
    while True:
      writable, tries = True, tries + 1
      try:
        self._make_parents()  # --out=a/new/folder: its parents, as any output
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      except FileNotFoundError:  # a folder made here was removed by another lock's release (empty then): again
        if tries < 10:
          continue
        raise
      except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
          raise
        if not os.path.isfile(self.path):
          raise UnwritableError(f"{self.what} cannot be written: its lock file {self.path} cannot be created "
                                f"({os.strerror(e.errno)}); choose a writable location") from None
        # Another user's lock file (or one on a read-only mount): flock works on a read-only descriptor, so a
        # running holder is still found and named; a free lock is held without our name in it.
        fd, writable = os.open(self.path, os.O_RDONLY), False
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise LockedError(f"{self.what} is in use by {holder} (lock file {self.path}): wait for it to finish or "
                          "stop it, then rerun") from None
      # The previous holder may have removed the file between our open and our flock: then we hold a lock on
      # an unlinked inode that a third process would not see. Retry on the file now at the path.
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    if writable:
      os.ftruncate(fd, 0)
      os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
      os.fsync(fd)
    self.fd = fd
    DirLock._held[self.path] = 1
    return self

  def __exit__(self, *exc):
    depth = DirLock._held.get(self.path, 0)
    if depth > 1:
      DirLock._held[self.path] = depth - 1
      return
    DirLock._held.pop(self.path, None)
    if self.fd is not None:
      try:
        os.unlink(self.path)  # while still holding it: a waiting opener retries on a new file (see __enter__)
      except OSError:
        pass
      os.close(self.fd)
      self.fd = None
    # A command refused under the lock wrote nothing: the folders made for the lock file go too (one that holds
    # the output, or anything else, is not empty and stays)
    for folder in reversed(self.created):
      try:
        os.rmdir(folder)
      except OSError:
        break
    self.created = []

  def _make_parents(self) -> None:
    missing, folder = [], os.path.dirname(self.path)
    while not os.path.isdir(folder):
      missing.append(folder)
      folder = os.path.dirname(folder)
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    self.created += [f for f in reversed(missing) if f not in self.created]


def beside(directory: str, what: str) -> DirLock:
  """The lock of an output directory that is written elsewhere and renamed into place (an export, a datastore,
  a batch plan): `<directory>.lock` beside it. The directory's path is resolved first, so `--out=link` and
  `--out=<link's target>` (or `dir/` and `dir`) take the same lock and cannot both write."""
  resolved = os.path.realpath(os.path.abspath(directory).rstrip(os.sep) or os.sep)
  return DirLock(resolved + ".lock", what)


def _read_holder(fd: int) -> str:
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    info = json.loads(os.read(fd, 4096).decode() or "{}")
  except (OSError, ValueError, UnicodeDecodeError):
    info = {}
  if not info.get("pid"):
    return "another process"
  host = "" if info.get("host") == socket.gethostname() else f" on host {info.get('host')}"
  return f"process {info['pid']}{host} (since {info.get('since', '?')})"

