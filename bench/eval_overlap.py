"""Evaluation with a datastore, the search overlapped with the device's forward pass or not (issue 37).

  python -m bench.eval_overlap --config=docs_wt_ext --checkpoint=runs/docs_wt/ext/export \\
      --datastore=runs/docs_wt/ext/ds --tokens=32768 --out=/tmp/eval_overlap.json

`evaluate.evaluate(..., overlap_search=True)` (config eval.overlap_search; off by default) dispatches each
window's forward pass before the previous window's FAISS search and scoring, so the device computes while the host
searches; False runs the three one after the other (the default). Without a datastore the same order hides the
host's per-step work (the next batch, the sums it reads back) behind the device's. Both orders run the same jitted
computations on the same inputs, so the per-token log-probabilities must be equal: this bench checks that (max |Δ
nll|) and times four variants interleaved (`--repeats` rounds of: with the datastore sequential, overlapped;
without it sequential, overlapped), each on the same first `--tokens` test tokens, and reports each variant's
fastest round, the speed-ups and issue 37's ratio (tokens/s with the datastore ÷ without, goal ≥ 0.5) for each
order. Compilation is excluded (a short untimed pass of each variant first). Point: TrimeLM's family `trime`
(local + long-term + external memory) at the config's τ and long-term size."""

from __future__ import annotations

import argparse
import importlib
import json
import time

import jax
import numpy as np

from trime_jax import exports, knn
from trime_jax.evaluate import driver
from trime_jax.evaluate.points import Point
from trime_jax.evaluate.runner import evaluator_settings, load_eval_data, store_spec
from bench.mfu import apply_set, parse_set


def run(config, checkpoint: str, datastore: str, index: str, tokens: int, repeats: int, corpus,
        split: str = "") -> dict:
  """The four timings on the first `tokens` targets of `corpus` (the config's eval section: windows, streams,
  τ, K, nprobe, long-term store)."""
  graphdef, params, train_config, _, _ = exports.load_export(checkpoint)
  e = config.eval
  ext = knn.ExternalMemory(datastore, index_path=index, checkpoint_dir=checkpoint, k=e.knn_k, nprobe=e.nprobe,
                           exact=e.knn_exact, gpu=e.knn_gpu)
  long_term = store_spec(e, int(e.mem_size))
  common = evaluator_settings(e, train_config.train.vocab_chunk)  # its overlap_search is each variant's below
  common.pop("overlap_search")

  def timed(overlap: bool, with_ext: bool, n: int):
    pt = Point("trime", tau=float(e.tau)) if with_ext else Point("trime_local", tau=float(e.tau))
    t0 = time.perf_counter()
    s0 = ext.search_seconds
    r = driver.evaluate(graphdef, params, corpus, (pt,), external=ext if with_ext else None, max_tokens=n,
                        per_token=True, long_term=long_term, overlap_search=overlap, **common)
    return r, time.perf_counter() - t0, ext.search_seconds - s0

  warm = min(tokens, 2 * e.block_len)
  variants = {"sequential": (False, True), "overlap": (True, True),  # name: (overlap_search, with the datastore)
              "no_datastore_sequential": (False, False), "no_datastore_overlap": (True, False)}
  for overlap, with_ext in variants.values():  # compile every variant untimed
    timed(overlap, with_ext, warm)
  rows = {name: [] for name in variants}
  nll = {}
  for _ in range(repeats):
    for name, (overlap, with_ext) in variants.items():
      r, wall, search = timed(overlap, with_ext, tokens)
      rows[name].append({"seconds": wall, "search_seconds": search, "tokens": r.tokens, "ppl": r.scores[0].ppl})
      nll[name] = r.token_nll[0]
  best = {k: min(v, key=lambda x: x["seconds"]) for k, v in rows.items()}  # each variant's fastest round
  tok_s = {k: v["tokens"] / v["seconds"] for k, v in best.items()}
  diff = lambda a, b: float(np.nanmax(np.abs(nll[a] - nll[b])))
  return {
      "device": jax.devices()[0].device_kind, "checkpoint": checkpoint, "datastore": datastore,
      "index": ext.index.kind, "k": ext.k, "nprobe": int(e.nprobe), "mem_size": long_term.mem_size,
      "split": split, "tokens": best["overlap"]["tokens"], "repeats": repeats, "runs": rows,
      "tokens_per_s": tok_s, "overlap_speedup": tok_s["overlap"] / tok_s["sequential"],
      "overlap_speedup_no_datastore": tok_s["no_datastore_overlap"] / tok_s["no_datastore_sequential"],
      # issue 37's ratio (goal >= 0.5), each order against itself without the datastore
      "ratio_to_no_datastore": {k: tok_s[k] / tok_s[f"no_datastore_{k}"] for k in ("sequential", "overlap")},
      "max_abs_nll_diff_overlap_vs_sequential": max(diff("overlap", "sequential"),
                                                    diff("no_datastore_overlap", "no_datastore_sequential")),
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True, help="a config name under configs/ (docs_wt_ext, wiki103_247m, ...)")
  ap.add_argument("--checkpoint", required=True, help="an export directory")
  ap.add_argument("--datastore", required=True)
  ap.add_argument("--index", default="", help="default: <datastore>/index.faiss")
  ap.add_argument("--tokens", type=int, default=32_768, help="scored test tokens per timed run")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--split", default="test")
  ap.add_argument("--set", action="append", default=[], help="SECTION.FIELD=VALUE (repeatable), e.g. eval.nprobe=8")
  ap.add_argument("--out", default="")
  a = ap.parse_args(argv)
  config = apply_set(importlib.import_module(f"trime_jax.configs.{a.config}").get_config(), parse_set(a.set))
  corpus = load_eval_data(config, exports.read_export_vocab(a.checkpoint)).get(a.split)
  out = run(config, a.checkpoint, a.datastore, a.index, a.tokens, a.repeats, corpus, a.split)
  print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
