"""TRIME (Zhong, Lei & Chen, EMNLP 2022) in JAX and Flax NNX.

    import trime_jax
    model = trime_jax.load("runs/mini/export")     # trime_jax.api: score, generate, memory
    trime_jax.train(config, "runs/x")              # train_and_evaluate
    except trime_jax.TrimeError: ...                 # what a call refuses (ConfigError, CheckpointError, ...)

The API's names load on first use, so `import trime_jax.data` (or any light module) does not pull in orbax,
optax and the evaluator.
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types

from trime_jax.errors import CheckpointError, ConfigError, DataError, TrimeError  # light: errno and os only

_API = ("load", "Model", "Memory", "TextScore", "Output")
# What a call refuses is one of the errors, all TrimeErrors: ConfigError (an argument, a config field),
# CheckpointError (an export, a datastore, an index), DataError (a corpus)
__all__ = ["api", "train", *_API, "TrimeError", "ConfigError", "CheckpointError", "DataError"]


class _CallableTrainModule(types.ModuleType):
  """`trime_jax.train` stays the module (`trime_jax.train.train_and_evaluate`, `from trime_jax import train as T`)
  and is also the one-call entry point: `trime_jax.train(config, workdir)` = `api.train`."""

  def __call__(self, config, workdir, **kwargs):
    from trime_jax import api

    return api.train(config, workdir, **kwargs)


class _Package(types.ModuleType):
  # Python's import system sets `trime_jax.train` to the submodule whenever it is first imported (by anyone);
  # making the module callable at that moment keeps `trime_jax.train(...)` working whatever imported it first.
  def __setattr__(self, name, value):
    if name == "train" and isinstance(value, types.ModuleType):
      value.__class__ = _CallableTrainModule
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


# configs/ and launch/ sit at the top of the repository and install inside this package (pyproject's
# package-dir: trime_jax.configs, trime_jax.launch). A wheel has them inside the package. A checkout (this package
# beside its pyproject.toml, configs/ and launch/) takes them from beside itself through this finder, which knows
# only those two names and is consulted first: used without installing (PYTHONPATH=<checkout>, as
# experiments/*_device.sh do), and also where an editable install of *another* checkout is on the path, whose
# finder would otherwise give that checkout's launch/ and configs/ with this one's trime_jax.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOP_LEVEL = ("configs", "launch")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path=None, target=None):
    head, _, name = fullname.partition(".")
    if head != __name__ or name not in _TOP_LEVEL:
      return None
    folder = os.path.join(_CHECKOUT, name)
    return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
if (os.path.isfile(os.path.join(_CHECKOUT, "pyproject.toml"))
    and all(os.path.isfile(os.path.join(_CHECKOUT, d, "__init__.py")) for d in _TOP_LEVEL)
    and not any(os.path.isdir(os.path.join(_PACKAGE_DIR, d)) for d in _TOP_LEVEL)
    and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path)):
  sys.meta_path.insert(0, _CheckoutFinder())


def __getattr__(name):  # PEP 562: reached only for names not set yet
  if name in _API:
    return getattr(importlib.import_module("trime_jax.api"), name)
  if name in ("api", "train"):
    return importlib.import_module(f"trime_jax.{name}")
  raise AttributeError(f"module 'trime_jax' has no attribute {name!r}")


def __dir__():  # the lazily loaded names too (tab completion in a notebook offers trime_jax.load)
  return sorted(set(globals()) | set(__all__))
