"""Dropout masks: nnx.Dropout's random bits ÷ the counter hash (model.dropout_mask), same run, two measurements:
one causal attention forward and backward, and (--step_layers > 0) a whole TRIME train step of the 247M model's
widths with the paper config's dropouts.

  python -m bench.dropout_mask [--heads=8 --head_dim=128 --seq=512 --batch=1 --rate=0.1 --repeats=5]
  python -m bench.dropout_mask --seq=1024 --step_layers=2

The 247M model's attention (8 heads of 128 dimensions; its segments are 3,072 tokens, shortened here to fit a
2-core CPU) through `layers.attention` as the model calls it in training: logits, causal softmax, the dropout mask,
the weighted sum, and the gradients of q, k and v. Three variants: no dropout (the floor: jax's
dot_product_attention, XLA's path, which `layers.attention` takes without dropout; what a mask adds is roughly the
difference), nnx (jax's default PRNG, threefry), hash. On a CPU this measures the mask's arithmetic against the
rest of a materialised attention; on a GPU the balance of arithmetic and memory traffic differs, which is what
the `dropout_hash` lever of experiments/gpu_speed.sh measures on the whole train step.

The train step (--step_layers): D = 1,024, FFN 4,096, 8 heads, the 247M config's dropouts (0.3 residual and
embedding, 0.1 attention, 0.1 activation), `steps.train_step` with TRIME's local memory and Adam, float32, a
2,000-word vocabulary (the output layer's cost does not depend on the masks), one segment of --seq tokens.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bench.common import memory_bytes, time_interleaved
from trime_jax import layers, loss, steps
from trime_jax.model import ModelConfig, TransformerLM

STEP_SHAPE = dict(vocab_size=2_000, d_model=1024, num_heads=8, d_ff=4096, dropout=0.3, attention_dropout=0.1,
                  activation_dropout=0.1, dtype="float32")


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


def _train_step(mask: str, num_layers: int, seq: int):
  """A zero-argument TRIME train step of STEP_SHAPE with `num_layers` blocks and dropout_mask=`mask`, its XLA plan."""
  cfg = ModelConfig(**STEP_SHAPE, num_layers=num_layers, max_len=seq, dropout_mask=mask)
  graphdef, params = nnx.split(TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adam(1e-3)
  state = {"step": np.int32(0), "params": params, "opt_state": tx.init(params)}
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 1, seq + 1))
  batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "drop_local": np.zeros((1, 1), bool)}
  state, batch = jax.device_put((state, batch))
  spec = steps.LossSpec(loss.ObjectiveSpec("local"), vocab_chunk=0)
  step = jax.jit(functools.partial(steps.train_step, graphdef, tx, spec, True, True))
  key = jax.random.PRNGKey(0)
  return functools.partial(step, state, batch, key), memory_bytes(step, state, batch, key)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--head_dim", type=int, default=128)
  ap.add_argument("--rate", type=float, default=0.1)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--step_layers", type=int, default=0, help="> 0: also a whole train step with this many blocks")
  args = ap.parse_args(argv)
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
  if args.step_layers > 0:
    steps_fns, steps_mem = {}, {}
    for mask in layers.DROPOUT_MASKS:
      steps_fns[mask], steps_mem[mask] = _train_step(mask, args.step_layers, args.seq)
    t = time_interleaved(steps_fns, repeats=args.repeats)
    print(f"\nTRIME train step, {args.step_layers} blocks of D 1,024 / FFN 4,096 / 8 heads, 1 x {args.seq} tokens, "
          f"dropouts 0.3 / 0.1 / 0.1, median of {args.repeats}")
    for mask in layers.DROPOUT_MASKS:
      print(f"dropout_mask={mask:<5} {t[mask]:8.3f} s   XLA plan {steps_mem[mask] / 2**20:8.1f} MiB")
    print(f"nnx ÷ hash: {t['nnx'] / t['hash']:.3f}")


if __name__ == "__main__":
  main()
