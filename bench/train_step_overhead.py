"""TRIME (local memory) train step ÷ CE train step, same model, same batch, one run (the paper: "no
measurable overhead"; goal ≤ 1.05).

  python -m bench.train_step_overhead [--repeats=10]
"""

import argparse
import functools

import jax
import numpy as np
import optax
from flax import nnx

from bench.common import time_interleaved
from trime_jax import steps
from trime_jax.model import ModelConfig, TransformerLM

SETTINGS = [  # (name, model kwargs, B, L)
    ("wikitext_mini model (4L, D=128, V=9.5k)", dict(vocab_size=9526, num_layers=4, d_model=128, num_heads=4,
                                                     d_ff=512), 8, 256),
    ("longer segments (4L, D=256, V=9.5k)", dict(vocab_size=9526, num_layers=4, d_model=256, num_heads=4,
                                                 d_ff=1024), 4, 1024),
]


def bench(model_kw, b, l, repeats):
  cfg = ModelConfig(max_len=l, dropout=0.1, **model_kw)
  graphdef, params = nnx.split(TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adam(1e-3)
  state = {"step": np.int32(0), "params": params, "opt_state": tx.init(params)}
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (1, b, l + 1))
  batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "drop_local": np.zeros(1, bool)}
  key = jax.random.PRNGKey(0)
  fns = {}
  for name, use_trime in [("ce", False), ("trime", True)]:
    spec = steps.LossSpec(memory="local")
    step = jax.jit(functools.partial(steps.train_step, graphdef, tx, spec, use_trime, False))
    fns[name] = functools.partial(step, state, batch, key)  # same state every call: pure timing
  return time_interleaved(fns, repeats=repeats)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--repeats", type=int, default=10)
  args = ap.parse_args()
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), median of {args.repeats} interleaved steps\n")
  print("| setting | B × L | CE step (s) | TRIME step (s) | TRIME ÷ CE |")
  print("|---|---|---|---|---|")
  for name, kw, b, l in SETTINGS:
    t = bench(kw, b, l, args.repeats)
    print(f"| {name} | {b} × {l} | {t['ce']:.4f} | {t['trime']:.4f} | {t['trime'] / t['ce']:.3f} |", flush=True)


if __name__ == "__main__":
  main()
