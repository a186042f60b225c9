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


def _eval(graphdef, params, corpus, config, variants):
  from trime_jax import evaluate as E

  e = config.eval
  return E.evaluate(graphdef, params, corpus, block_len=e.block_len, context_window=e.context_window,
                    batch_size=e.batch_size, variants=variants, max_tokens=e.max_tokens)


def _tuned(graphdef, params, splits, config, variants):
  """Pick the best non-'none' variant on dev; return (none on test, best on test, best's name)."""
  from trime_jax import evaluate as E

  dev = _eval(graphdef, params, splits.dev, config, variants)
  best = min(range(1, len(dev)), key=lambda i: dev[i].nll)
  name = dev[best].name
  if name.startswith("local"):
    chosen = E.Variants(taus=(variants.taus[best - 1],))
  else:
    chosen = E.Variants(cache=(variants.cache[best - 1],))
  test = _eval(graphdef, params, splits.test, config, chosen)
  return test[0], test[1], dev[best]


def run_demo(config, workdir: str) -> list[dict]:
  """Train vanilla + TrimeLM in `workdir`, evaluate, print and return the table rows."""
  import itertools

  from trime_jax import checkpoint as ckpt
  from trime_jax import corpora
  from trime_jax import evaluate as E
  from trime_jax.train import train_and_evaluate

  splits = corpora.load_splits(config.data)
  rows = []
  for name, memory in [("vanilla LM", "none"), ("TrimeLM", "local")]:
    cfg = config.copy_and_resolve_references()
    cfg.trime.memory = memory
    print(f"\n=== training {name} (trime.memory={memory}) ===", flush=True)
    out = train_and_evaluate(cfg, os.path.join(workdir, memory), splits=splits)
    graphdef, params, *_ = ckpt.load_export(out["export"])
    if memory == "none":
      variants = E.Variants(cache=tuple(itertools.product(E.CACHE_LAMBDA_GRID, E.CACHE_THETA_GRID)))
      extra = "continuous cache"
    else:
      variants = E.Variants(taus=E.TAU_GRID)
      extra = "local memory"
    plain, best, best_dev = _tuned(graphdef, params, splits, cfg, variants)
    rows.append({"model": name, "test memory": "none", "test bpb": plain.bits_per_token,
                 "tokens": plain.tokens, "tokens/s": plain.tokens / plain.seconds})
    rows.append({"model": name, "test memory": f"{extra}: {best.name}", "test bpb": best.bits_per_token,
                 "dev bpb": best_dev.bits_per_token, "tokens": best.tokens,
                 "tokens/s": best.tokens / best.seconds})
  print("\nTest split: held-out stdlib files (bits per byte, lower is better; τ, λ, θ tuned on dev)")
  print(E.format_table(rows, columns=("model", "test memory", "test bpb", "dev bpb", "tokens", "tokens/s")))
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
