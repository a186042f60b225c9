"""experiments/device_out.sh: what a GPU-machine script leaves in $OUT fits the device tool's 8 returned files,
and every run's file is in raw.tgz, complete after each sync."""

import os
import subprocess
import tarfile

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
