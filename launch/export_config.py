"""The config stored in an export (`<workdir>/export/config.json`), over configs/default.py (a config file for
`--config`; it lives here, not in configs/, because it needs an argument).

  python -m trime_jax.launch.eval --checkpoint=runs/mini/export                       # uses this config implicitly
  python -m trime_jax.launch.eval --config=launch/export_config.py:runs/mini/export --checkpoint=runs/mini/export \\
      --config.eval.split=test
  python -m trime_jax.launch.export_config runs/mini/export     # prints that config (stored fields over the defaults)

Fields the export does not have (added after it was written) keep their defaults; a field this version does not
know (a misspelling such as `eval.knn_kk` in a hand-edited config.json) is refused with the file named
(`exports.check_stored_config`, which the launch programs and `trime_jax.load` also apply).
"""

import os

from trime_jax import exports
from trime_jax.errors import CheckpointError


def get_config(export_dir: str = ""):
  if not export_dir:  # `--config=launch/export_config.py` alone would read ./config.json
    from trime_jax.errors import ConfigError

    raise ConfigError("--config=launch/export_config.py needs the export after a colon: "
                      "--config=launch/export_config.py:EXPORT_DIR (or leave --config out: --checkpoint=EXPORT_DIR "
                      "evaluates with the export's config)")
  # read as --checkpoint and trime_jax.load read it: a shipped model's name ("demo"), a workdir (its export/)
  export_dir = exports.export_path(export_dir)
  # A translation export's config is of another schema (configs/ui_de_en.py): returned as stored, not over the
  # language model's defaults; build_datastore reads it, the language model's programs refuse it with the
  # export named (launch.checks.validated), not with the first LM field it lacks
  if export_dir and exports.is_mt_export(export_dir):
    import ml_collections

    from trime_jax.runtime.workdir import read_stored_config

    return ml_collections.ConfigDict(read_stored_config(
        os.path.join(export_dir, "config.json"), "export config", CheckpointError))
  # the checks and the overlay live with the export they read: trime_jax.load applies them too
  return exports.stored_over_defaults(export_dir)


def main(argv: list[str]) -> int:
  """`python -m trime_jax.launch.export_config EXPORT_DIR`: print the config an evaluation of the export would use."""
  import sys

  args = argv[1:]
  if not args:  # a missing argument is bad input, as for every program (only a help flag exits 0)
    print("error: usage: python -m trime_jax.launch.export_config EXPORT_DIR (the export whose config to print)",
          file=sys.stderr)
    return 2
  if args[0] in ("-h", "--help", "-help", "--helpshort", "--helpfull"):
    try:
      print(f"trime_jax.launch.export_config\n\n{__doc__.strip()}\n\nusage: python -m trime_jax.launch.export_config EXPORT_DIR")
    except BrokenPipeError:  # `--help | head`
      pass
    return 0
  if len(args) != 1 or args[0].startswith("-"):
    print("error: usage: python -m trime_jax.launch.export_config EXPORT_DIR (one export directory, no flags)",
          file=sys.stderr)
    return 2
  from trime_jax.api import export_path
  from trime_jax.errors import ConfigError

  try:  # read as trime_jax.load and every --checkpoint read it: a shipped model's name, a workdir's export/
    path = export_path(args[0], say=lambda note: print(f"warning: {note}", file=sys.stderr))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  problem = exports.config_dir_problem(path)
  if problem:  # said as trime_jax.load says it (the reader's own words name a --config this program has not)
    print(f"error: {problem}", file=sys.stderr)
    return 2
  try:
    print(get_config(path).to_json_best_effort(indent=1))
  except CheckpointError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  import sys

  sys.exit(main(sys.argv))
