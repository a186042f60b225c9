"""The command-line programs: `python -m trime_jax.launch.NAME --help`, or the installed `trime-*` commands."""

if __name__ != "trime_jax.launch":  # `python -m launch.NAME` from a checkout's root: the name before 0.2
  import sys

  print(f"error: the programs are the package trime_jax.launch (python -m trime_jax.launch.NAME), not {__name__}",
        file=sys.stderr)
  raise SystemExit(2)
