"""Timing helpers: interleaved repetitions so that both sides of a ratio see the same machine load."""

import json
import os
import statistics
import sys
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


# ----------------------------------------------------------------------------------------------------------
# Command lines: a bad flag is one `error:` line and exit status 2 before any work (the CLIs' rule), and --out
# is checked before the measurements it would hold (a file that is not this benchmark's result is replaced only
# with --overwrite).
# ----------------------------------------------------------------------------------------------------------
def fail(message: str):
  """One `error:` line on stderr, exit status 2."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  raise SystemExit(2)


def check_flags(*conditions) -> None:
  """`fail` on the first (ok, message) whose ok is False."""
  for ok, message in conditions:
    if not ok:
      fail(message)


def check_out(path: str, bench: str, overwrite: bool) -> None:
  """--out of `bench.<bench>` (a JSON file; "" writes none): its folder must exist, and a file there must be an
  earlier result of the same benchmark (its "bench" field) unless --overwrite."""
  if not path:
    return
  if os.path.isdir(path):
    fail(f"--out={path} is a folder: give the JSON file to write")
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    fail(f"--out={path}: its folder {folder} does not exist")
  if os.path.exists(path) and not overwrite:
    try:
      with open(path, encoding="utf-8") as f:
        ours = json.load(f).get("bench") == bench
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
      ours = False
    if not ours:
      fail(f"--out={path} exists and is not a result of bench.{bench}: pass --overwrite to replace it")


def run(main) -> int:
  """`main()` as a command: a TrimeError (a config, a checkpoint, data) is one `error:` line and exit status 2."""
  from trime_jax.errors import TrimeError

  try:
    return main() or 0
  except TrimeError as e:
    fail(str(e))
