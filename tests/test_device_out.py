"""experiments/device_out.sh: what a GPU-machine script leaves in $OUT fits the device tool's 8 returned files,
and every run's file is in raw.tgz, complete after each sync."""

import os
import re
import subprocess
import sys
import tarfile
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_summaries_and_one_archive_whatever_the_runs_wrote(tmp_path):
  dest = tmp_path / "out"
  script = f"""
set -euo pipefail
cd {REPO}
source experiments/device_out.sh
DEVICE_OUT_FILES="env.txt summary.txt absent.md"
OUT={dest}
device_out_begin /nowhere
[ "$DEVICE_OUT_DEST" = {dest} ]
echo env > "$OUT/env.txt"
for i in $(seq 1 12); do
  echo "run $i" > "$OUT/run_$i.json"; echo "log $i" > "$OUT/run_$i.log"; echo "row $i" >> "$OUT/summary.txt"
  device_out_sync
done
"""
  subprocess.run(["bash", "-c", script], check=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
  assert sorted(os.listdir(dest)) == ["env.txt", "raw.tgz", "summary.txt"]  # at most 8 come back
  assert (dest / "summary.txt").read_text().splitlines()[-1] == "row 12"
  with tarfile.open(dest / "raw.tgz") as tar:
    names = {os.path.normpath(n) for n in tar.getnames()} - {"."}
    assert names == {"env.txt", "summary.txt"} | {f"run_{i}.{e}" for i in range(1, 13) for e in ("json", "log")}
    assert tar.extractfile("./run_12.log").read() == b"log 12\n"


def _device_wheels():
  carried, lists = [], {}
  for line in open(os.path.join(REPO, "experiments", "device_wheels.txt")):
    line = line.strip()
    if line.startswith("# on-image:") or line.startswith("# not-there:"):
      key, names = line[2:].split(":", 1)
      lists[key] = names.split()
    elif line and not line.startswith("#"):
      carried.append(line.split("==")[0])
  return carried, lists["on-image"], lists["not-there"]


def _norm(name):
  return re.sub(r"[-_.]+", "-", name).lower()


def test_every_dependency_reaches_the_gpu_machine_or_is_not_needed_there():
  """A dependency added to pyproject.toml must be carried to the GPU machine or be on its image; tensorboardX,
  added after the last device run, would have stopped every training there at its first step."""
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
  carried, on_image, not_there = _device_wheels()
  names = {_norm(re.split(r"[<>=!~\[ ;]", d, 1)[0]) for d in deps}
  known = {_norm(n) for n in carried + on_image + not_there}
  assert names <= known, f"classify in experiments/device_wheels.txt: {sorted(names - known)}"
  assert {_norm(n) for n in carried} <= names  # nothing carried that the package does not declare


def test_the_device_entry_points_start_without_what_is_not_there():
  """bm25s, nltk and regex (BM25 planning) are not on the GPU machine (faiss gets a stand-in there): the entry
  points the device scripts run, and the BM25 module a training checks its plan with, must import without them."""
  for module in ("trime_jax.launch.train", "trime_jax.launch.eval", "trime_jax.launch.eval_ext",
                 "trime_jax.launch.build_datastore", "bench.mfu", "bench.eval_speed",
                 "trime_jax.batching.bm25"):  # one process each: absl flags; bm25: a training reads BM25 plans there
    code = f"import sys; sys.modules.update(bm25s=None, nltk=None, regex=None); import {module}"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_a_training_reads_a_bm25_plan_without_what_planning_needs(tmp_path):
  """The GPU machine trains TrimeLM_ext on BM25 plans made here: reading and checking one (BatchSource: the plan's
  settings against the config, its older rules) must not import bm25s / nltk / regex."""
  from tests.helpers import wikitext_config_file, wikitext_dir

  data = wikitext_dir(tmp_path, line=lambda i: f" alpha beta w{i} gamma delta .\n", lines=lambda i: i + 3)
  cfg = wikitext_config_file(tmp_path, data, "c.trime.batching = 'bm25'\nc.trime.memory = 'ext'")
  out = tmp_path / "plan"
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-m", "trime_jax.launch.make_batches", f"--config={cfg}", "--kind=bm25",
                  f"--out={out}"], cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
  code = ("import sys, importlib.util; sys.modules.update(bm25s=None, nltk=None, regex=None)\n"
          f"spec = importlib.util.spec_from_file_location('cfg', {str(cfg)!r}); m = importlib.util.module_from_spec(spec)\n"
          "spec.loader.exec_module(m); config = m.get_config()\n"
          f"config.trime.batch_plan = {str(out)!r}\n"
          "from trime_jax import corpora\nfrom trime_jax.train import BatchSource\n"
          "source = BatchSource(corpora.load_splits(config.data).train, config)\n"
          "assert source.plan.header['bm25_analyzer'] == 'english'\n"
          "assert all(sys.modules.get(n) is None for n in ('bm25s', 'nltk', 'regex')); print('read')\n")
  got = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert got.returncode == 0 and got.stdout.strip().endswith("read"), got.stderr[-2000:]
