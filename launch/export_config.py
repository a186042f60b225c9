"""The config stored in an export (`<workdir>/export/config.json`), over configs/default.py (a config file for
`--config`; it lives here, not in configs/, because it needs an argument).

  python -m trime_jax.launch.eval --checkpoint=runs/mini/export                       # uses this config implicitly
  python -m trime_jax.launch.eval --config=launch/export_config.py:runs/mini/export --config.eval.split=test
  python -m trime_jax.launch.export_config runs/mini/export     # prints that config (stored fields over the defaults)

Fields the export does not have (added after it was written) keep their defaults; a field this version does not
know (a misspelling such as `eval.knn_kk` in a hand-edited config.json) is refused with the file named
(`unknown_fields`, which the launch programs also apply when `--config` is given).
"""

import os

from trime_jax.configs import default
from trime_jax.errors import CheckpointError, ConfigError
from trime_jax.runtime import workdir


def is_mt(stored: dict) -> bool:
  """A translation export's config (its own schema, read by trime_jax.mt)."""
  data = stored.get("data") if isinstance(stored.get("data"), dict) else {}
  return stored.get("task") == "mt" or data.get("src_lang") is not None


def unknown_fields(stored: dict) -> list[str]:
  """Dotted names of the fields of `stored` that configs/default.py does not have, each with the closest known
  name when there is one ("eval.knn_kk (eval.knn_k?)"): the training workdir's check, against the
  default config."""
  return workdir.unknown_fields(stored, default.get_config())


def check_stored_config(export_dir: str, stored: dict | None = None) -> dict:
  """The export's config.json as a dict, with renamed fields under today's names (runtime.workdir.migrate_config),
  refused (CheckpointError naming the file) when it has fields this version does not know: they would be ignored
  without a word. Translation exports are read by their own
  schema and only parsed here."""
  path = os.path.join(export_dir, "config.json")
  try:  # the one stored-config reader: missing / truncated files named; renamed fields under today's names
    if stored is None:
      stored = workdir.read_stored_config(path, "stored config (give --config, or an export directory):",
                                          CheckpointError)
    elif isinstance(stored, dict):
      stored = workdir.migrate_config(stored, path)
  except ConfigError as e:  # a field under both its old and new names, with different values
    raise CheckpointError(str(e)) from None
  if not isinstance(stored, dict):
    raise CheckpointError(f"{path} is not a config (a JSON object)")
  if not is_mt(stored):
    bad = unknown_fields(stored)
    if bad:
      raise CheckpointError(f"{path} has field{'s' if len(bad) > 1 else ''} this version does not know: "
                            f"{', '.join(bad)}; correct or remove {'them' if len(bad) > 1 else 'it'}")
  return stored


def _update(dst, src: dict) -> None:
  for key, value in src.items():
    if key not in dst:
      continue  # a translation export's own fields (check_stored_config refused unknown LM fields)
    if hasattr(dst[key], "keys") and isinstance(value, dict):
      _update(dst[key], value)
    else:
      dst[key] = tuple(value) if isinstance(dst[key], tuple) and isinstance(value, list) else value


def get_config(export_dir: str = ""):
  stored = check_stored_config(export_dir)
  c = default.get_config()
  with c.unlocked():
    _update(c, stored)
  return c


def main(argv: list[str]) -> int:
  """`python -m trime_jax.launch.export_config EXPORT_DIR`: print the config an evaluation of the export would use."""
  import sys

  args = argv[1:]
  if not args or args[0] in ("-h", "--help", "-help", "--helpshort", "--helpfull"):
    try:
      print(f"trime_jax.launch.export_config\n\n{__doc__.strip()}\n\nusage: python -m trime_jax.launch.export_config EXPORT_DIR")
    except BrokenPipeError:  # `--help | head`
      pass
    return 0
  if len(args) != 1 or args[0].startswith("-"):
    print("error: usage: python -m trime_jax.launch.export_config EXPORT_DIR (one export directory, no flags)",
          file=sys.stderr)
    return 2
  try:
    print(get_config(args[0]).to_json_best_effort(indent=1))
  except CheckpointError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  import sys

  sys.exit(main(sys.argv))
