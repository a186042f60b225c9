"""`Model.score` of many texts: one call per text against one call for them all (eval.batch_size texts a step).

  python -m bench.score_texts                        # the shipped demo model, 60 lines of WikiText-2 test
  python -m bench.score_texts --texts 200 --repeats 3 --memory none
  python -m bench.score_texts --model runs/docs_wt/ext/export --text_file ../shared/data/docs-wt/wiki.test.tokens \\
      --memory external --datastore runs/docs_wt/ext/ds_1000000 --k 1024

A list of texts runs in one pass (`evaluate.texts_plan`): each step feeds a window of a different text to each
of the rows (eval.batch_size; fewer where there are fewer texts), each text scored as if alone; with external
memory every step searches the datastore once for all its rows' tokens. One text per
call runs one row per step, as every call did before. Both are timed after a warm-up call each (compilation not
included), interleaved `--repeats` times; the table gives the median, and the largest difference of any
token's log-probability between the two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import numpy as np

import trime_jax
from bench.common import check_flags, fail, run

DEFAULT_TEXTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                             "wikitext-2", "wiki.test.tokens")  # ../shared beside the repository


def read_lines(path: str, n: int) -> list[str]:
  """The first `n` non-empty lines of a WikiText file that are not headings."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if line and not line.startswith("="):
        out.append(line)
        if len(out) == n:
          break
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="demo", help="a shipped model's name or an export directory")
  p.add_argument("--text_file", default=DEFAULT_TEXTS, help="WikiText-format lines to score, one text each")
  p.add_argument("--texts", type=int, default=60, help="how many lines")
  p.add_argument("--memory", default="local", choices=("none", "local", "long", "external"),
                 help="long / external: with model.memory empty, each text's store holds its own earlier tokens")
  p.add_argument("--datastore", default=None, help="memory=external: a trime_jax.launch.build_datastore directory")
  p.add_argument("--k", type=int, default=None, help="memory=external: entries retrieved per token (eval.knn_k)")
  p.add_argument("--repeats", type=int, default=3)
  a = p.parse_args(argv)
  check_flags((a.texts >= 1, f"--texts must be >= 1, got {a.texts}"),
              (a.repeats >= 1, f"--repeats must be >= 1, got {a.repeats}"),
              (os.path.isfile(a.text_file), f"--text_file={a.text_file} is not a file"),
              (a.memory == "external" or (a.datastore is None and a.k is None),
               f"--datastore and --k are read with --memory=external only (--memory={a.memory})"))
  model = trime_jax.load(a.model)
  texts = read_lines(a.text_file, a.texts)
  if not texts:
    fail(f"no lines to score in {a.text_file}")
  # (the API refuses k= and datastore= without external memory, and external memory without a datastore)
  kw = dict(memory=a.memory, datastore=a.datastore, k=a.k) if a.memory == "external" else dict(memory=a.memory)
  one_by_one = lambda: [model.score(t, **kw) for t in texts]
  together = lambda: model.score(texts, **kw)
  warm = {"one call per text": one_by_one(), "one call for all": together()}  # compiles both
  seconds = {name: [] for name in warm}
  for _ in range(a.repeats):
    for name, fn in (("one call per text", one_by_one), ("one call for all", together)):
      t0 = time.perf_counter()
      fn()
      seconds[name].append(time.perf_counter() - t0)
  tokens = sum(len(s.ids) for s in warm["one call for all"])
  # NaN (a dropped line's tokens) must be NaN in both: anywhere else the difference is infinite
  diff = max(float(np.nanmax(np.where(np.isnan(x.log_probs) == np.isnan(y.log_probs),
                                      np.abs(x.log_probs - y.log_probs), np.inf)))
             for x, y in zip(warm["one call per text"], warm["one call for all"]))
  rows = int(model.config.eval.batch_size)
  print(f"{model!r}, {jax.devices()[0].device_kind}, memory={a.memory}, {len(texts)} texts, {tokens:,} tokens, "
        f"eval.batch_size={rows}, median of {a.repeats}")
  print("| scoring | seconds | texts/s | tokens/s |")
  print("|---|---:|---:|---:|")
  med = {name: statistics.median(s) for name, s in seconds.items()}
  for name, s in med.items():
    print(f"| {name} | {s:.3f} | {len(texts) / s:,.1f} | {tokens / s:,.0f} |")
  print(f"speed-up: x{med['one call per text'] / med['one call for all']:.2f}; largest |log P| difference "
        f"{diff:.2e}")
  return 0


if __name__ == "__main__":
  raise SystemExit(run(main))
