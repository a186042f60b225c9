"""Adaptive softmax ÷ full (chunked) softmax: one TRIME train step (time and XLA's compiled memory), same run.

  python -m bench.adaptive_softmax [--layers=1 --batch=2 --segment=128 --repeats=3]

The WikiText-103 247M shape (D = 1024, FFN 4096, 8 heads, vocabulary 267,735, cutoffs 20k/60k, factor 4,
tied weights and projections, the paper config's dropouts) reduced to fit a 2-core CPU: few layers, short
segments, float32 compute (CPUs emulate bfloat16 matmuls). Tokens follow Zipf's law over the ids (bench.common:
20% of the targets in the tails), which decides what computing the tails for their own rows only saves. The output layer's cost does not depend on the
layer count, so fewer layers make the ratio larger than the full model's; the table prints both steps.
"""

import argparse
import functools

import jax
import numpy as np
import optax
from flax import nnx

from bench.common import time_interleaved, zipf_tokens
from trime_jax import loss, steps
from trime_jax.model import ModelConfig, TransformerLM, count_params

SHAPE = dict(vocab_size=267_735, d_model=1024, num_heads=8, d_ff=4096, positions="sinusoidal", position_offset=2,
             final_norm=False, dropout=0.3, attention_dropout=0.1, activation_dropout=0.1, dtype="float32")
ADAPTIVE = dict(adaptive_input=True, adaptive_softmax=True, adaptive_cutoffs=(20_000, 60_000),
                adaptive_input_factor=4.0, adaptive_softmax_factor=4.0, tie_adaptive_proj=True,
                adaptive_softmax_dropout=0.2)
VARIANTS = {  # name -> (model overrides, vocab_chunk)
    "full softmax, chunks of 16,384": ({}, 16_384),
    "adaptive, chunks of ≤ 16,384": (ADAPTIVE, 16_384),
    "adaptive, dense head and tails": (ADAPTIVE, 0),
    "adaptive, dense, tails for their rows only (r = 0.25)": (dict(ADAPTIVE, adaptive_tail_rows=0.25), 0),
    "adaptive, chunks of ≤ 16,384, tails for their rows only (r = 0.25)": (dict(ADAPTIVE, adaptive_tail_rows=0.25),
                                                                           16_384),
}


def _step(kw, vocab_chunk, layers, b, l):
  cfg = ModelConfig(num_layers=layers, max_len=l, **SHAPE, **kw)
  graphdef, params = nnx.split(TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adam(1e-3)
  state = {"step": np.int32(0), "params": params, "opt_state": tx.init(params)}
  tokens = zipf_tokens(np.random.default_rng(0), cfg.vocab_size, (1, b, l + 1))  # text-like band shares
  batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "drop_local": np.zeros((1, b), bool)}
  state, batch = jax.device_put((state, batch))
  spec = steps.LossSpec(loss.ObjectiveSpec("local"), vocab_chunk=vocab_chunk)
  step = jax.jit(functools.partial(steps.train_step, graphdef, tx, spec, True, True))
  key = jax.random.PRNGKey(0)
  mem = step.lower(state, batch, key).compile().memory_analysis()
  peak = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
  return functools.partial(step, state, batch, key), count_params(params), mem.temp_size_in_bytes, peak


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=1)
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--segment", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()
  fns, info = {}, {}
  for name, (kw, chunk) in VARIANTS.items():
    fn, n, temp, peak = _step(kw, chunk, args.layers, args.batch, args.segment)
    fns[name], info[name] = fn, (n, temp, peak)
  times = time_interleaved(fns, repeats=args.repeats, warmup=1)
  base = next(iter(VARIANTS))
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}); WT103-247M shape with "
        f"{args.layers} layer(s), B × L = {args.batch} × {args.segment}, float32; TRIME (local) train step, "
        f"Adam; median of {args.repeats} interleaved steps\n")
  print("| output layer | parameters | step (s) | ÷ full | XLA temporaries (GiB) | peak (GiB) | peak ÷ full |")
  print("|---|---|---|---|---|---|---|")
  for name in VARIANTS:
    n, temp, peak = info[name]
    print(f"| {name} | {n:,} | {times[name]:.3f} | {times[name] / times[base]:.3f} | {temp / 2**30:.3f} | "
          f"{peak / 2**30:.3f} | {peak / info[base][2]:.3f} |", flush=True)


if __name__ == "__main__":
  main()
