"""Peak memory and time of trime_nll(memory="ext") forward+backward, blockwise vs dense, D = 128.

  python -m bench.loss_memory [--sizes=4096,16384,32768] [--run-dense-up-to=16384]

Peak memory is what XLA plans for the compiled call (temporaries + arguments + outputs). The dense path
materialises [N, N] similarity/mask arrays; at 32k tokens that is 4 GiB per float32 array, so it is only
compiled (its plan measured), not run, above --run-dense-up-to.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import memory_bytes, time_interleaved
from trime_jax import loss

SEG_LEN = 512
DIM = 128


def make(n_tokens, seed=0):
  rng = np.random.default_rng(seed)
  b = n_tokens // SEG_LEN
  keys = jnp.asarray(rng.normal(size=(b, SEG_LEN, DIM)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 2000, (b, SEG_LEN)), jnp.int32)
  stats = loss.VocabStats(jnp.asarray(rng.normal(size=(b, SEG_LEN)) + 8, jnp.float32),
                       jnp.asarray(rng.normal(size=(b, SEG_LEN)), jnp.float32))
  return stats, keys, targets


def fwd_bwd(implementation):
  def f(stats, keys, targets):
    def total(s, k):
      return loss.trime_nll_from_vocab_stats(s, k, targets, memory="ext", implementation=implementation).sum()
    return jax.value_and_grad(total, argnums=(0, 1))(stats, keys)
  return jax.jit(f)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sizes", default="4096,16384,32768")
  ap.add_argument("--run-dense-up-to", type=int, default=16384)
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()
  print(f"backend: {jax.default_backend()}, D={DIM}, segments of {SEG_LEN}, memory='ext' (whole batch)\n")
  print("| tokens (B·L) | blockwise peak | blockwise time (s) | dense peak | dense time (s) | dense ÷ blockwise memory |")
  print("|---|---|---|---|---|---|")
  for n in map(int, args.sizes.split(",")):
    data = make(n)
    blk, den = fwd_bwd("blockwise"), fwd_bwd("dense")
    mb, md = memory_bytes(blk, *data), memory_bytes(den, *data)
    fns = {"blockwise": functools.partial(blk, *data)}
    if n <= args.run_dense_up_to:
      fns["dense"] = functools.partial(den, *data)
    t = time_interleaved(fns, repeats=args.repeats, warmup=1)
    if "dense" in t:  # same numbers from both paths
      (vb, _), (vd, _) = blk(*data), den(*data)
      np.testing.assert_allclose(vb, vd, rtol=1e-4)
    td = f"{t['dense']:.4f}" if "dense" in t else "not run"
    print(f"| {n:,} | {mb / 2**30:.3f} GiB | {t['blockwise']:.4f} | {md / 2**30:.2f} GiB | {td} | {md / mb:.1f}× |",
          flush=True)


if __name__ == "__main__":
  main()
