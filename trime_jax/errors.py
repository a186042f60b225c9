"""User-facing errors: the CLIs print these as one line (`error: ...`) instead of a traceback."""

import errno

# The errnos of a write that did not fit: a full disk, a quota, a file size limit (ulimit -f). Every writer that
# turns these into DiskFullError / CheckpointError, and the CLIs' one-line hint, read this one tuple.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_no_space(e: BaseException) -> bool:
  """An OSError whose errno says the write did not fit (NO_SPACE_ERRNOS)."""
  return isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS


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
