"""Dev-perplexity curves of trainings (issue 38): is a model still improving at the end of its budget?

Every training writes <workdir>/metrics.jsonl (trime_jax/runtime/workdir.py MetricsFile, one JSON object a
line): train lines every train.log_every updates ({"step", "objective", "loss", "ce_nll", ...}) and a dev line
every train.eval_every updates and at the end ({"step", "split": "dev", "none_ppl", "trime_local..._ppl",
"tokens"}: the first train.eval_max_tokens dev tokens, no memory and, for TRIME models, local memory at τ = 1).
This reads the dev lines of several runs and writes

  PREFIX.csv   run, name, seed, step, metric, ppl (one row per dev point and metric)
  PREFIX.png   one panel per metric (no memory; local memory), perplexity (log scale) against updates; one
               colour per model, one line style per seed

and prints, per run and metric, the last and best perplexity and the change over the last quarter of the
updates ("still improving" when the last point is the best and the last quarter gained more than 1%).

  .venv/bin/python experiments/dev_curves.py runs/docs_wt_12k/* runs/docs_wt_12k_s*/* --out=docs/docs_wt_12k_dev
  .venv/bin/python experiments/dev_curves.py vanilla=runs/docs_wt/vanilla ext=path/to/metrics.jsonl --out=/tmp/c

A RUN is a workdir (holding metrics.jsonl) or a metrics.jsonl file, optionally LABEL=RUN; without a label the
name is the workdir's name and the seed comes from its parent (runs/docs_wt_12k_s1/ext: ext, seed 1; a parent
without _sN: seed 0); two runs of one name and seed are told apart by their parent (docs_wt/ext, docs_wt_12k/ext).
Runs without dev lines are skipped with a warning.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys

METRIC_TITLES = {"none": "no memory", "trime_local": "local memory (τ = 1)"}


def metric_key(field: str) -> str:
  """'none_ppl' -> 'none'; 'trime_local(tau=1)_ppl' / 'trime_local_ppl' -> 'trime_local'."""
  return re.sub(r"\(.*\)$", "", field[:-len("_ppl")])


def read_run(spec: str) -> dict:
  label, _, path = spec.rpartition("=") if "=" in spec and not os.path.exists(spec) else ("", "", spec)
  path = path.rstrip("/")
  metrics = path if os.path.isfile(path) else os.path.join(path, "metrics.jsonl")
  workdir = os.path.dirname(metrics) if os.path.isfile(path) else path
  name = label or os.path.basename(workdir) or workdir
  m = re.search(r"_s(\d+)$", os.path.basename(os.path.dirname(os.path.abspath(workdir))))
  seed = int(m.group(1)) if m and not label else 0
  m = re.search(r"^(.*)[ _]s(\d+)$", label) if label else None
  if m:  # a label ending in _sN / " sN" names the seed too
    name, seed = m.group(1), int(m.group(2))
  points: dict[tuple[str, int], float] = {}
  if os.path.exists(metrics):
    with open(metrics) as f:
      for line in f:
        if not line.strip():
          continue
        rec = json.loads(line)
        if rec.get("split") != "dev":
          continue
        for field, value in rec.items():
          if field.endswith("_ppl") and value is not None:
            points[(metric_key(field), int(rec["step"]))] = float(value)  # a repeated step: the last line wins
  return {"run": workdir, "name": name, "seed": seed, "points": points}


def summarise(run: dict, metric: str) -> dict | None:
  pts = sorted((s, p) for (m, s), p in run["points"].items() if m == metric)
  if not pts:
    return None
  last_step, last = pts[-1]
  best_step, best = min(pts, key=lambda sp: sp[1])
  ref = [p for s, p in pts if s <= 0.75 * last_step]  # the point at (or before) three quarters of the run
  gain = (ref[-1] - last) / ref[-1] if ref else float("nan")
  return {"last_step": last_step, "last": last, "best_step": best_step, "best": best, "gain_last_quarter": gain,
          "improving": best_step == last_step and gain > 0.01}


def write_csv(runs: list[dict], path: str) -> None:
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["run", "name", "seed", "step", "metric", "ppl"])
    for r in runs:
      for (metric, step), ppl in sorted(r["points"].items(), key=lambda kv: (kv[0][0], kv[0][1])):
        w.writerow([r["run"], r["name"], r["seed"], step, metric, f"{ppl:.4f}"])


def plot(runs: list[dict], path: str, title: str = "") -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import FuncFormatter

  plain = FuncFormatter(lambda v, _: f"{v:g}")  # 150, not 1.5 × 10²
  metrics = [m for m in METRIC_TITLES if any(k[0] == m for r in runs for k in r["points"])]
  metrics += sorted({k[0] for r in runs for k in r["points"]} - set(metrics))
  names = list(dict.fromkeys(r["name"] for r in runs))
  seeds = sorted({r["seed"] for r in runs})
  styles = ["-", "--", ":", "-."]
  fig, axes = plt.subplots(1, len(metrics), figsize=(5.6 * len(metrics), 4.2), squeeze=False)
  for ax, metric in zip(axes[0], metrics):
    for r in runs:
      pts = sorted((s, p) for (m, s), p in r["points"].items() if m == metric)
      if not pts:
        continue
      color = f"C{names.index(r['name']) % 10}"  # one colour per model, one line style per seed
      ls = styles[seeds.index(r["seed"]) % len(styles)]
      label = r["name"] + (f" s{r['seed']}" if len(seeds) > 1 else "")
      ax.plot([s for s, _ in pts], [p for _, p in pts], ls=ls, color=color, marker="o", ms=2.5, lw=1.2,
              label=label)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("update")
    ax.set_ylabel("dev perplexity")
    ax.set_title(METRIC_TITLES.get(metric, metric))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("runs", nargs="+", help="[LABEL=]workdir or metrics.jsonl")
  ap.add_argument("--out", required=True, help="output prefix: PREFIX.csv and PREFIX.png")
  ap.add_argument("--title", default="", help="figure title")
  ap.add_argument("--no_png", action="store_true", help="the CSV and the summary only")
  args = ap.parse_args(argv)
  runs = []
  for spec in args.runs:
    r = read_run(spec)
    if r["points"]:
      runs.append(r)
    else:
      print(f"warning: no dev lines in {r['run']} (skipped)", file=sys.stderr)
  if not runs:
    print("no run with dev lines", file=sys.stderr)
    return 1
  seen = [(r["name"], r["seed"]) for r in runs]
  for r in runs:  # two runs of one name and seed (other budgets: runs/docs_wt/ext, runs/docs_wt_12k/ext): parent/name
    if seen.count((r["name"], r["seed"])) > 1:
      r["name"] = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(r["run"]))), r["name"])
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  write_csv(runs, args.out + ".csv")
  print(f"wrote {args.out}.csv")
  print(f"{'run':<34} {'metric':<12} {'last (update)':>16} {'best (update)':>16} {'last quarter':>12}")
  for r in runs:
    for metric in sorted({k[0] for k in r["points"]}):
      s = summarise(r, metric)
      print(f"{r['name'] + ' s' + str(r['seed']):<34} {metric:<12} {s['last']:>8.2f} ({s['last_step']:>5})"
            f" {s['best']:>8.2f} ({s['best_step']:>5}) "
            + (f"{100 * s['gain_last_quarter']:>+10.1f}%" if s["gain_last_quarter"] == s["gain_last_quarter"]
               else f"{'n/a':>11}")
            + ("  still improving" if s["improving"] else ""))
  if not args.no_png:
    plot(runs, args.out + ".png", args.title)
    print(f"wrote {args.out}.png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
