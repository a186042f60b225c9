"""The table of experiments/orig_gpu_speed.sh: the original's words per second (its own `wps` meter at the run's
last update: updates 11..N) next to bench.mfu's tokens/s at the same shape.

  python experiments/orig_gpu_speed_table.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import re
import sys

MODELS = {"247m": "wiki103_247m", "150m": "wiki103_150m", "7m": "wiki103_7m"}
CRITERIA = {"adaptive_loss": "ce", "trime_loss": "trime"}


def orig_wps(path: str):
  """(wps, updates it averages, the run's last line if it failed): fairseq's `wps` meter at the run's last
  logged update. The meter skips the first 10 updates (ignore_first=10) and averages the rest (a TimeMeter:
  tokens / seconds since update 10), so its last value is the mean speed of updates 11..N."""
  if not os.path.exists(path):
    return None, 0, "not run"
  best, last = None, ""
  with open(path, errors="replace") as f:
    for line in f:
      if line.strip():
        last = line.strip()
      m = re.search(r"\| train \| (\{.*\})", line)  # the fork logs mid-epoch and end-of-epoch stats as "train"
      if not m:
        continue
      try:
        rec = json.loads(m.group(1))
        # mid-epoch lines name the fields plainly, the end-of-epoch line prefixes them with "train_"
        n = int(float(rec.get("num_updates", rec.get("train_num_updates"))))
        wps = float(rec.get("wps", rec.get("train_wps")))
      except (ValueError, KeyError, TypeError):
        continue
      if wps > 0 and (best is None or n >= best[1]):
        best = (wps, n)
  if best is None:
    return None, 0, last[:200]
  return best[0], best[1] - 10, ""


def run_codes(out: str) -> dict:
  """{(model, criterion): rc} from orig_runs.txt's "orig M C rc=N wall_s=S" lines (124/137: cut at its share)."""
  codes = {}
  path = os.path.join(out, "orig_runs.txt")
  if os.path.exists(path):
    for line in open(path, errors="replace"):
      m = re.match(r"orig (\S+) (\S+) rc=(\d+)", line)
      if m:
        codes[(m.group(1), m.group(2))] = int(m.group(3))
  return codes


def ours_row(out: str, model: str, objective: str):
  path = os.path.join(out, f"ours_{model}.json")
  if not os.path.exists(path):
    return None
  entry = json.load(open(path))["configs"].get(MODELS[model], {})
  return entry.get("rows", {}).get(objective)


def main(out: str) -> None:
  print("| model | criterion | original wps (updates averaged) | ours tokens/s | ours ÷ original | our shape B×L×A | "
        "our MFU | note |")
  print("|" + "---|" * 8)
  codes = run_codes(out)
  for model in MODELS:
    for crit, objective in CRITERIA.items():
      wps, n, why = orig_wps(os.path.join(out, f"orig_{model}_{crit}.log"))
      rc = codes.get((model, crit))
      if rc in (124, 137):  # its wps is the mean of the updates it reached before the cut
        why = f"cut at its time share (rc={rc}): wps over {n} updates" + (f"; {why}" if why else "")
      elif rc:
        why = f"rc={rc}" + (f"; {why}" if why else "")
      ours = ours_row(out, model, objective)
      if wps is None and ours is None:
        continue
      tps = ours["tokens_per_s"] if ours else None
      ratio = f"{tps / wps:.2f}×" if wps and tps else "n/a"
      shape = f"{ours['rows_per_device']}×{ours['segment_len']}×{ours['grad_accum']}" if ours else ""
      mfu = f"{100 * ours['mfu']:.1f}%" if ours and ours.get("mfu") is not None else "n/a"
      print(f"| {model} | {crit} | {f'{wps:,.0f} ({n})' if wps else 'n/a'} | {f'{tps:,.0f}' if tps else 'n/a'} | "
            f"{ratio} | {shape} | {mfu} | {why} |")
  if any(json.load(open(os.path.join(out, f))).get("tiny") for f in os.listdir(out)
         if f.startswith("ours_") and f.endswith(".json")):
    print("\nTINY run: both sides shrunk differently (a check of the script, not a comparison)")
  unavailable = os.path.join(out, "orig_unavailable.txt")
  if os.path.exists(unavailable):
    print("\n" + open(unavailable).read().strip())


if __name__ == "__main__":
  main(sys.argv[1])
