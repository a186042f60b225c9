"""TRIME train step ÷ CE train step, same model, same batch, one run (the paper: "no measurable
overhead"; goal ≤ 1.05).

  python -m bench.train_step_overhead [--repeats=10]              # CPU-sized settings
  python -m bench.train_step_overhead --settings=paper --repeats=5  # the paper's WT103 shapes (accelerator)
  python -m bench.train_step_overhead --settings=docs_wt --repeats=6  # issue 17's docs-wt models, per objective
"""

import argparse
import functools

import jax
import numpy as np
import optax
from flax import nnx

from bench.common import time_interleaved
from trime_jax import loss, steps
from trime_jax.model import ModelConfig, TransformerLM

SETTINGS = {  # name -> [(label, model kwargs, B, L, memory, consecutive segments, vocab chunk)]
    "cpu": [
        ("wikitext_mini model (4L, D=128, V=9.5k), local", dict(vocab_size=9526, num_layers=4, d_model=128,
                                                               num_heads=4, d_ff=512), 8, 256, "local", 1, 0),
        ("longer segments (4L, D=256, V=9.5k), local", dict(vocab_size=9526, num_layers=4, d_model=256,
                                                           num_heads=4, d_ff=1024), 4, 1024, "local", 1, 0),
    ],
    # Issue 17's docs-wt models (configs/docs_wt*.py: the paper's 7M shape, adaptive input / softmax over the
    # 82,548-word vocabulary, 8 × 512 tokens per update), one row per training objective of its tables.
    "docs_wt": [
        (f"docs-wt 7M shape, {label}", dict(vocab_size=82_548, num_layers=8, d_model=128, num_heads=4, d_ff=512,
                                            adaptive_input=True, adaptive_softmax=True,
                                            adaptive_cutoffs=(20_000, 60_000), tie_embeddings=True,
                                            tie_adaptive_proj=False), 8, 512, memory, m, 0)
        for label, memory, m in (("TrimeLM (local)", "local", 1), ("TrimeLM_long (4 consecutive)", "long", 4),
                                 ("TrimeLM_ext (4,096 in-batch memories)", "ext", 1))
    ],
    # The paper's WikiText-103 shapes (configs/wiki103_*.py, full tied softmax over 267,735 words computed in
    # chunks, bfloat16 compute); batches cut to one accelerator's memory where the paper spreads them.
    "paper": [
        ("WT103-247M shape (16L, D=1024, V=268k, bf16), local", dict(
            vocab_size=267_735, num_layers=16, d_model=1024, num_heads=8, d_ff=4096, dtype="bfloat16"),
         1, 3072, "local", 1, 32768),
        ("WT103-247M shape, ext: 4 × 3072 = 12,288 in-batch memories", dict(
            vocab_size=267_735, num_layers=16, d_model=1024, num_heads=8, d_ff=4096, dtype="bfloat16"),
         4, 3072, "ext", 1, 32768),
        ("WT103-150M shape (16L, D=410, bf16), long: 60 × 150 consecutive", dict(
            vocab_size=267_735, num_layers=16, d_model=410, num_heads=10, d_ff=2100, dtype="bfloat16"),
         60, 150, "long", 60, 32768),
    ],
}


def bench(model_kw, b, l, repeats, memory="local", m=1, vocab_chunk=0):
  cfg = ModelConfig(max_len=l, dropout=0.1, **model_kw)
  graphdef, params = nnx.split(TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adam(1e-3)
  state = {"step": np.int32(0), "params": params, "opt_state": tx.init(params)}
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (1, b, l + 1))
  batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "drop_local": np.zeros(1, bool)}
  state, batch = jax.device_put((state, batch))  # on the accelerator once, not per call
  key = jax.random.PRNGKey(0)
  fns = {}
  for name, use_trime in [("ce", False), ("trime", True)]:
    spec = steps.LossSpec(loss.ObjectiveSpec(memory, consecutive_segments=m), vocab_chunk=vocab_chunk)
    step = jax.jit(functools.partial(steps.train_step, graphdef, tx, spec, use_trime, False))
    fns[name] = functools.partial(step, state, batch, key)  # same state every call: pure timing
  return time_interleaved(fns, repeats=repeats)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--settings", choices=sorted(SETTINGS), default="cpu")
  args = ap.parse_args()
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), median of {args.repeats} interleaved steps\n")
  print("| setting | B × L | CE step (s) | TRIME step (s) | TRIME ÷ CE |")
  print("|---|---|---|---|---|")
  for name, kw, b, l, memory, m, vocab_chunk in SETTINGS[args.settings]:
    t = bench(kw, b, l, args.repeats, memory, m, vocab_chunk)
    print(f"| {name} | {b} × {l} | {t['ce']:.4f} | {t['trime']:.4f} | {t['trime'] / t['ce']:.3f} |", flush=True)


if __name__ == "__main__":
  main()
