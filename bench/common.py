"""Timing helpers: interleaved repetitions so that both sides of a ratio see the same machine load."""

import statistics
import time

import jax
import numpy as np


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


def zipf_tokens(rng: np.random.Generator, vocab_size: int, shape) -> np.ndarray:
  """int32 token ids drawn by Zipf's law over the ids, p(id) ∝ 1 / (id + 1): a dictionary sorted by frequency
  (fairseq's, ours), so an adaptive softmax's bands get text-like shares of the targets (vocabulary 267,735 with
  cutoffs 20k / 60k: 80% head, 9% the first tail, 11% the second), which matters where a tail is computed for
  its own rows only (model.adaptive_tail_rows). Uniform ids would put 93% of them in the last tail."""
  p = 1.0 / np.arange(1, vocab_size + 1)
  return rng.choice(vocab_size, size=shape, p=p / p.sum()).astype(np.int32)
