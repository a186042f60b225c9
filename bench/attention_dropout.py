"""Attention-dropout masks on XLA's path: nnx.Dropout's random bits ÷ the counter hash (model.dropout_mask), one
causal attention forward and backward, same run.

  python -m bench.attention_dropout [--heads=8 --head_dim=128 --seq=512 --batch=1 --rate=0.1 --repeats=5]

The 247M model's attention (8 heads of 128 dimensions; its segments are 3,072 tokens, shortened here to fit a
2-core CPU) through `layers.attention` as the model calls it in training: logits, causal softmax, the dropout mask,
the weighted sum, and the gradients of q, k and v. Three variants: no dropout (the floor: jax's
dot_product_attention, XLA's path, which `layers.attention` takes without dropout; what a mask adds is roughly the
difference), nnx (jax's default PRNG, threefry), hash. On a CPU this measures the mask's arithmetic against the
rest of a materialised attention; on a GPU the balance of arithmetic and memory traffic differs, which is what
the `dropout_hash` lever of experiments/gpu_speed.sh measures on the whole train step.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import memory_bytes, time_interleaved
from trime_jax import layers


def _step(how: str, rate: float, shape):
  """jit(grad of sum(attention · w) in q, k, v), its arguments."""
  b, t, h, d = shape
  q, k, v, w = (jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32) for i in range(4))

  def loss(q, k, v, key):
    out = layers.attention(q, k, v, layers.Dropout(rate, mask=how), causal=True, deterministic=rate == 0.0,
                           rngs=nnx.Rngs(dropout=key))
    return jnp.sum(out * w)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  args = (q, k, v, jax.random.key(0))
  return fn, args


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--head_dim", type=int, default=128)
  ap.add_argument("--rate", type=float, default=0.1)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args()
  shape = (args.batch, args.seq, args.heads, args.head_dim)
  variants = {"no dropout": ("nnx", 0.0), "nnx (threefry)": ("nnx", args.rate), "hash": ("hash", args.rate)}
  fns, mem = {}, {}
  for name, (how, rate) in variants.items():
    fn, fargs = _step(how, rate, shape)
    fns[name] = functools.partial(fn, *fargs)
    mem[name] = memory_bytes(fn, *fargs)
  times = time_interleaved(fns, repeats=args.repeats)
  floor = times["no dropout"]
  print(f"causal attention forward + backward, B x T x H x K = {' x '.join(map(str, shape))}, float32, "
        f"dropout {args.rate}, {jax.default_backend()} ({jax.devices()[0].device_kind}), median of {args.repeats}")
  print(f"{'variant':<16} {'ms':>9} {'÷ no dropout':>13} {'mask ms':>9} {'XLA plan MiB':>13}")
  for name, t in times.items():
    print(f"{name:<16} {t * 1e3:9.2f} {t / floor:13.3f} {(t - floor) * 1e3:9.2f} {mem[name] / 2**20:13.1f}")
  print(f"nnx ÷ hash: {times['nnx (threefry)'] / times['hash']:.3f}")


if __name__ == "__main__":
  main()
