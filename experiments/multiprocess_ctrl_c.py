"""Ctrl-C on one process of a two-process training (2 CPU processes, gloo): how soon the other one ends.

  .venv/bin/python experiments/multiprocess_ctrl_c.py [WORKDIR]

For process 0, then process 1: start a tiny two-process training (tests.helpers' config), send SIGINT to that
process once the first metric line is written, and print each process's exit status and seconds after the
signal (the README's reliability table and launch/multi_gpu.sh quote them).
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import config_file, two_process_env, write_text_file  # noqa: E402


def interrupt(victim: int, tmp: Path) -> None:
  corpus = write_text_file(tmp / "text.bin", 40_000)
  cfg = config_file(tmp, corpus, **{"train.num_steps": 10_000, "train.log_every": 2, "train.checkpoint_every": 1_000,
                                    "train.batch_size": 8})
  env, work = two_process_env(2), tmp / "run"
  procs = [subprocess.Popen([sys.executable, "-m", "trime_jax.distributed", "trime_jax.launch.train", f"--config={cfg}",
                             f"--workdir={work}"], cwd=REPO, env=dict(env, JAX_PROCESS_ID=str(i)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    while not (work / "metrics.jsonl").exists() or not (work / "metrics.jsonl").read_text().strip():
      if any(p.poll() is not None for p in procs):
        raise SystemExit("training ended before its first metric line")
      time.sleep(0.5)
    procs[victim].send_signal(signal.SIGINT)
    t0 = time.time()
    for i, p in enumerate(procs):
      _, err = p.communicate(timeout=400)
      last = (err.strip().splitlines() or [""])[-1][:120]
      print(f"Ctrl-C to process {victim}: process {i} exit {p.returncode} after {time.time() - t0:.1f} s ({last})",
            flush=True)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


if __name__ == "__main__":
  root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ctrl_c_"))
  for victim in (0, 1):
    os.makedirs(root / str(victim), exist_ok=True)
    interrupt(victim, root / str(victim))
