"""Sharded TRIME loss, gather vs ring (memory="ext"), on 8 virtual CPU devices: time and compiled memory.

  .venv/bin/python -m bench.sharded_memory [--sizes=4096,16384,32768] [--dim=128] [--seg=512]
                                           [--memory_chunk=1024] [--repeats=2]   (--repeats=0: memory only)

One step = forward + backward (value and gradients w.r.t. the keys and the vocabulary stats) of
`sharded_trime_nll_from_vocab_stats` on a global batch of `size` memory tokens (`size/seg` rows of `seg`
tokens, sharded over 8 devices). Memory is XLA's compiled memory analysis of the SPMD program, per device:
"temp" is everything the step allocates beyond its inputs and outputs (gathered keys, residuals, similarity
blocks, key-gradient buffers); "total" adds the inputs and outputs (XLA's CPU backend leaves
`peak_memory_in_bytes` without the temporaries, so it is not reported). Time is the median wall-clock of
`repeats` calls after compilation. The 8 virtual devices share this host's cores and there is no
interconnect, so the times compare the compute of the two schedules, not accelerator speed or
communication cost (see docs/sharded_memory.md for that).
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from trime_jax import sharded_loss  # noqa: E402
from trime_jax.loss import VocabStats  # noqa: E402
from trime_jax.sharding import make_mesh  # noqa: E402

MIB = 1 << 20


def step_fn(mesh, variant, memory_chunk):
  def objective(keys, lse, tgt, targets):
    nll = sharded_loss.sharded_trime_nll_from_vocab_stats(VocabStats(lse, tgt), keys, targets, mesh=mesh, memory="ext",
                                                variant=variant, memory_chunk=memory_chunk)
    return nll.sum()

  return jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2)))


def measure(mesh, size, dim, seg, variant, memory_chunk, repeats):
  rows = size // seg
  rng = np.random.default_rng(0)
  sh = NamedSharding(mesh, P("data"))
  keys = jax.device_put(rng.normal(size=(rows, seg, dim)).astype(np.float32), sh)
  lse = jax.device_put((rng.normal(size=(rows, seg)) + 8.0).astype(np.float32), sh)
  tgt = jax.device_put(rng.normal(size=(rows, seg)).astype(np.float32), sh)
  targets = jax.device_put(rng.integers(0, 1000, size=(rows, seg)).astype(np.int32), sh)
  args = (keys, lse, tgt, targets)
  compiled = step_fn(mesh, variant, memory_chunk).lower(*args).compile()
  mem = compiled.memory_analysis()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  io = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
  return {"time": statistics.median(times) if times else None, "temp": mem.temp_size_in_bytes / MIB, "io": io / MIB,
          "total": (io + mem.temp_size_in_bytes) / MIB}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="4096,16384,32768", help="global memory sizes (tokens), comma-separated")
  parser.add_argument("--dim", type=int, default=128, help="key dimension D")
  parser.add_argument("--seg", type=int, default=512, help="tokens per row (segment length L)")
  parser.add_argument("--memory_chunk", type=int, default=1024, help="memory tokens per similarity block")
  parser.add_argument("--repeats", type=int, default=2,
                      help="timed calls per setting (median reported); 0: compile only (memory analysis)")
  a = parser.parse_args()
  mesh = make_mesh(8)
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores "
        f"(load average {os.getloadavg()[0]:.1f}), D={a.dim}, L={a.seg}, memory_chunk={a.memory_chunk}, float32, "
        f"memory=ext, " + (f"time: median of {a.repeats} calls\n" if a.repeats else "memory analysis only\n"))
  print("| memory tokens | rows (per device) | variant | fwd+bwd time (s) | temp / device (MiB) "
        "| args+outputs / device (MiB) | total / device (MiB) |")
  print("|---:|---:|---|---:|---:|---:|---:|")
  for size in map(int, a.sizes.split(",")):
    for variant in sharded_loss.VARIANTS:
      r = measure(mesh, size, a.dim, a.seg, variant, a.memory_chunk, a.repeats)
      rows = size // a.seg
      t = "n/a" if r["time"] is None else f"{r['time']:.2f}"
      print(f"| {size:,} | {rows} ({rows // 8}) | {variant} | {t} | {r['temp']:.1f} | {r['io']:.1f} "
            f"| {r['total']:.1f} |", flush=True)


if __name__ == "__main__":
  main()
