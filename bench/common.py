"""Timing helpers: interleaved repetitions so that both sides of a ratio see the same machine load."""

import statistics
import time

import jax


def time_interleaved(fns: dict, repeats: int = 10, warmup: int = 2) -> dict:
  """Median seconds per call of each zero-argument function, calls interleaved round-robin."""
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(repeats):
    for k, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t)
  return {k: statistics.median(v) for k, v in times.items()}


def memory_bytes(jitted, *args) -> int:
  """Peak bytes XLA plans for one call: temporaries + arguments + outputs (compiled memory analysis)."""
  m = jitted.lower(*args).compile().memory_analysis()
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
