"""User-facing errors: the CLIs print these as one line (`error: ...`) instead of a traceback, as they do the
OSErrors of the machine (ENVIRONMENT_ERRNOS, `os_error_line`)."""

import errno
import os

# The errnos of a write that did not fit: a full disk, a quota, a file size limit (ulimit -f). Every writer that
# turns these into DiskFullError / CheckpointError, and the CLIs' one-line hint, read this one tuple.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_no_space(e: BaseException) -> bool:
  """An OSError whose errno says the write did not fit (NO_SPACE_ERRNOS)."""
  return isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS


# OSErrors that come from the machine, not from a bug: a folder where a file belongs (or the reverse), no
# permission, a full disk or quota, a read-only file system, a file too large for the limit.
ENVIRONMENT_ERRNOS = NO_SPACE_ERRNOS + (errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                                      errno.ENOENT, errno.EEXIST, errno.ENAMETOOLONG)


def os_error_line(e: OSError) -> str:
  """One line for an OSError of the machine (ENVIRONMENT_ERRNOS): what failed, on which path, what to do."""
  what = os.strerror(e.errno) if e.errno else str(e)
  path = e.filename if e.filename is not None else ""
  hint = {errno.ENOSPC: "free space and rerun the same command", errno.EDQUOT: "free space (quota) and rerun",
          errno.EACCES: "check the path's permissions", errno.EPERM: "check the path's permissions",
          errno.EROFS: "write to another location", errno.EISDIR: "give a file, not a folder",
          errno.ENOTDIR: "a part of the path is a file, not a folder",
          errno.EFBIG: "a file size limit (ulimit -f) was reached: raise it and rerun the same command"}.get(
              e.errno, "")
  return f"{what}: {path}" + (f" ({hint})" if hint else "")


class TrimeError(Exception):
  """Base class for errors caused by input (data, configs, checkpoints), not by bugs."""


class DataError(TrimeError):
  """Missing, empty or malformed data."""


class ConfigError(TrimeError):
  """An invalid or inconsistent configuration."""


class CheckpointError(TrimeError):
  """A missing, incomplete or mismatched checkpoint, datastore or index."""


class TrainingError(TrimeError):
  """Training cannot continue (e.g. a non-finite loss)."""


class DiskFullError(TrimeError):
  """Writing a checkpoint, export, batch plan or other output failed for lack of space (or a file size / quota
  limit)."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint, export, datastore or index whose files are missing, truncated or changed after writing."""


def first_line(e: BaseException) -> str:
  """`Type: first line` of an exception from a library (orbax, TensorStore), for an error that fits on one line."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = text.split(" See full TensorStore details")[0]  # the rest is a bound-method repr
  return f"{type(e).__name__}: {text[:200]}"
