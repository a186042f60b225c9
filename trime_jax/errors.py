"""User-facing errors: the CLIs print these as one line (`error: ...`) instead of a traceback."""


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


class DamagedCheckpointError(CheckpointError):
  """A checkpoint, export, datastore or index whose files are missing, truncated or changed after writing."""
