"""`Model.score(memory="long")` with a long-term memory of documents: seconds and forward passes per text.

  python -m bench.score_memory                       # the shipped demo model, 10,900 memory tokens, four texts

The first text runs the memory documents' windows and keeps the evaluator's state after them
(`evaluate.StreamState`); each later text of a similar length starts there and runs its own windows only. The
first text's time includes compiling the jitted steps.
"""

from __future__ import annotations

import argparse
import time

import jax

import trime_jax
from trime_jax.evaluate import driver

DOCS = ["import os\nimport sys\n" * 300, "def f(x):\n    return x\n" * 200]
TEXTS = ["x = os.path\n", "def g(y):\n    return f(y)\n", "import sys\n", "a = 1\nb = 2\n"]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="demo", help="a shipped model's name or an export directory")
  a = p.parse_args(argv)
  model = trime_jax.load(a.model)
  calls = []
  forward = driver.forward_queries
  driver.forward_queries = lambda *args, **kw: calls.append(1) or forward(*args, **kw)  # counts forward passes
  try:
    model.memory.add(DOCS)
    print(f"{model!r}, {jax.devices()[0].device_kind}, {len(model.memory):,} memory tokens")
    print("| text | tokens | windows run | seconds | ppl |")
    print("|---|---:|---:|---:|---:|")
    for i, text in enumerate(TEXTS):
      calls.clear()
      t0 = time.perf_counter()
      s = model.score(text, memory="long")
      print(f"| {i} | {len(s.ids)} | {len(calls)} | {time.perf_counter() - t0:.3f} | {s.ppl:.3f} |", flush=True)
  finally:
    driver.forward_queries = forward
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
