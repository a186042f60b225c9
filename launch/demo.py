"""`make demo`: vanilla LM vs TrimeLM on Python standard-library sources (no download, CPU, minutes).

Trains both models with the same budget (configs/demo.py), tunes the evaluation temperature τ (TrimeLM) and
the continuous cache's λ, θ (vanilla) on held-out dev files, and prints one table of test bits per byte.

  python -m launch.demo --workdir=runs/demo [--config.train.num_steps=200]
"""

import json
import os

from absl import flags
from ml_collections import config_flags

from launch.common import run_main

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Demo config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "Where both runs and the results table go.")


def run_demo(config, workdir: str) -> list[dict]:
  """Train vanilla + TrimeLM in `workdir`, evaluate (`evaluate.evaluate_checkpoint`: tuned on dev, scored on
  test), print and return the table rows."""
  import math

  from trime_jax import corpora
  from trime_jax import evaluate
  from trime_jax.train import train_and_evaluate

  splits = corpora.load_splits(config.data)
  rows = []
  for name, memory, eval_memory, what in [("vanilla LM", "none", "cache", "continuous cache"),
                                          ("TrimeLM", "local", "local", "local memory")]:
    cfg = config.copy_and_resolve_references()
    cfg.trime.memory = memory
    print(f"\n=== training {name} (trime.memory={memory}) ===", flush=True)
    out = train_and_evaluate(cfg, os.path.join(workdir, memory), splits=splits)
    cfg.eval.memory, cfg.eval.tune, cfg.eval.split = eval_memory, True, "test"
    plain, best = evaluate.evaluate_checkpoint(cfg, out["export"])["rows"]
    rows.append({"model": name, "test memory": "none", "test bpb": plain["test_bpc"], "tokens": plain["tokens"],
                 "tokens/s": plain["tokens_per_s"]})
    rows.append({"model": name, "test memory": f"{what}: {best['variant']}", "test bpb": best["test_bpc"],
                 "dev bpb": math.log2(best["dev_ppl"]), "tokens": best["tokens"], "tokens/s": best["tokens_per_s"]})
  print("\nTest split: held-out stdlib files (bits per byte, lower is better; τ, λ, θ tuned on dev)")
  print(evaluate.format_table(rows, columns=("model", "test memory", "test bpb", "dev bpb", "tokens", "tokens/s")))
  vanilla = rows[0]["test bpb"]
  trime = rows[3]["test bpb"]
  verdict = "beats" if trime < vanilla else "does NOT beat"
  print(f"\nTrimeLM (local memory) {verdict} the vanilla LM: {trime:.4f} vs {vanilla:.4f} bits per byte")
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(rows, f, indent=1)
  return rows


def main(argv):
  del argv
  run_demo(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  run_main(main)
