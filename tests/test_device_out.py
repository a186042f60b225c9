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
