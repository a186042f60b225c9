"""Console scripts (pyproject [project.scripts]): `trime-train` is `python -m trime_jax.launch.train`, and so on.

Each imports its launch module (which defines the module's flags) and runs its `main` through `run_main`, so the
installed commands behave exactly like `python -m trime_jax.launch.X`, from any directory:
`--config=configs/demo.py` (or `--config=demo`) is found in the installed package when the working directory has
no such file.
"""

from __future__ import annotations

import importlib
import sys


def _run(module: str) -> None:
  try:
    mod = importlib.import_module(f"trime_jax.launch.{module}")
  except ModuleNotFoundError as e:
    if e.name != f"trime_jax.launch.{module}":
      raise
    print(f"error: trime_jax.launch.{module} is not part of this installation of trime-jax", file=sys.stderr,
          flush=True)
    sys.exit(2)
  from trime_jax.launch.entry import run_main

  run_main(mod.main, checkpoint_is_export=getattr(mod, "CHECKPOINT_IS_EXPORT", True))


def train() -> None:
  _run("train")


def eval() -> None:  # noqa: A001 - the command is trime-eval
  _run("eval")


def eval_ext() -> None:
  _run("eval_ext")


def make_batches() -> None:
  _run("make_batches")


def build_datastore() -> None:
  _run("build_datastore")


def generate() -> None:
  _run("generate")


def prepare_data() -> None:
  _run("prepare_data")


def demo() -> None:
  _run("demo")


def import_fairseq() -> None:
  _run("import_fairseq")


def train_mt() -> None:
  _run("train_mt")


def translate() -> None:
  _run("translate")
