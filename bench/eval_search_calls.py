"""One FAISS search per window, or one per group of windows (eval.search_queries), on the oracle's setting.

  python -m bench.eval_search_calls --workdir=/tmp/search_calls --tokens=16384 --out=/tmp/search_calls.json

The setting of tests/test_oracle.py's external-memory passes: the original release's checkpoint
(../shared/oracle/trime.pt, imported), a datastore of WikiText-2 valid (217,536 float32 keys of dimension 64, the
release's --save-knnlm-dstore entries) with an exact flat index (`--index=ivfpq`: IVF-PQ, 256 lists, 16 × 8-bit
codes, trained here), one stream of 128-token windows that score 64 each (64 queries a window), local +
long-term (--mem-size 512, the original layout) + the top 1,024 retrieved, interpolated (λ 0.3, τ′ 10.5/√64).
The first `--tokens` targets of WikiText-2 test are scored with eval.search_queries = each of `--queries` (0: one
search per window, the driver before 2026-12-04), interleaved over `--repeats` rounds; each variant's fastest
round is reported: wall seconds, tokens/s, the FAISS search's seconds, the speed-up over 0, and the largest
|Δ nll| of any token against 0 (faiss-cpu 1.15.1's exact index computes with BLAS sgemm from queries × D =
128,000 on and with its own loop below; the two round differently, which can flip a top-K near-tie). Compilation is
excluded (a short untimed pass first). The import and the datastore are kept in `--workdir` for the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from trime_jax import exports, fairseq_import, knn
from trime_jax.configs import default
from trime_jax.datastore import Datastore, build_datastore, build_index
from trime_jax.evaluate import driver
from trime_jax.evaluate.memory import StoreSpec
from trime_jax.evaluate.points import Point
from trime_jax.evaluate.runner import load_eval_data

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared")
BLOCK, CONTEXT, MEM_SIZE, K = 128, 64, 512, 1024
POINT = Point("interp", tau=1.0, tau_prime=10.5 / 8.0, knn_lambda=0.3, interp_memory="external")  # 10.5 = √64 · τ′


def prepare(workdir: str, index: str) -> tuple:
  """(export, datastore, test split, index file) in `workdir`: built on the first run, reused after."""
  os.makedirs(workdir, exist_ok=True)
  corpus = os.path.join(workdir, "wikitext")
  if not os.path.isdir(corpus):
    os.makedirs(corpus + ".partial", exist_ok=True)
    wt2 = os.path.join(SHARED, "data", "wikitext-2")
    for ours, theirs in (("train", "valid"), ("valid", "valid"), ("test", "test")):  # the datastore: valid
      with open(os.path.join(wt2, f"wiki.{theirs}.tokens"), "rb") as f, \
          open(os.path.join(corpus + ".partial", f"wiki.{ours}.tokens"), "wb") as g:
        g.write(f.read())
    os.rename(corpus + ".partial", corpus)
  export = os.path.join(workdir, "export")
  if not os.path.isdir(export):  # imported beside it, then renamed: an interrupted import is not taken for one
    fairseq_import.import_to_export(os.path.join(SHARED, "oracle", "trime.pt"),
                                    os.path.join(SHARED, "oracle", "dict.txt"), export + ".partial", overwrite=True)
    os.rename(export + ".partial", export)
  c = default.get_config()
  c.data.corpus, c.data.path = "wikitext", corpus
  splits = load_eval_data(c, exports.read_export_vocab(export))
  ds = os.path.join(workdir, "ds")
  build_datastore(export, splits.train, ds, block_len=BLOCK, context_window=CONTEXT, batch_size=8, progress=False,
                  key_dtype="float32", entries="original")  # a complete one is reused
  path = os.path.join(ds, f"{index}.faiss")
  if not os.path.exists(path):
    build_index(Datastore(ds), path, kind=index, nlist=256, pq_m=16, progress=False)
  return export, ds, splits.test, path


def run(workdir: str, index: str, tokens: int, queries: list[int], repeats: int) -> dict:
  export, ds, test, path = prepare(workdir, index)
  graphdef, params = exports.load_export(export)[:2]
  ext = knn.ExternalMemory(ds, index_path=path, checkpoint_dir=export, k=K, nprobe=32)

  def timed(q: int, n: int):
    s0 = ext.search_seconds
    t0 = time.perf_counter()
    r = driver.evaluate(graphdef, params, test, (POINT,), block_len=BLOCK, context_window=CONTEXT, streams=1,
                        long_term=StoreSpec(MEM_SIZE, layout="original"), external=ext, max_tokens=n,
                        per_token=True, search_queries=q)
    return r, time.perf_counter() - t0, ext.search_seconds - s0

  for q in queries:  # compiles (untimed)
    timed(q, 4 * BLOCK)
  rows = {q: [] for q in queries}
  nll = {}
  for _ in range(repeats):
    for q in queries:
      r, wall, search = timed(q, tokens)
      rows[q].append({"seconds": wall, "search_seconds": search, "tokens": r.tokens, "ppl": r.scores[0].ppl})
      nll[q] = r.token_nll[0]
  best = {q: min(v, key=lambda x: x["seconds"]) for q, v in rows.items()}
  base = queries[0]
  return {
      "device": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "index": ext.index.kind, "keys": ext.datastore.count,
      "k": ext.k, "tokens": best[base]["tokens"], "repeats": repeats, "runs": {str(q): v for q, v in rows.items()},
      "variants": {str(q): {**best[q], "tokens_per_s": best[q]["tokens"] / best[q]["seconds"],
                            "speedup": best[base]["seconds"] / best[q]["seconds"],
                            "max_abs_nll_diff": float(np.nanmax(np.abs(nll[q] - nll[base])))}
                   for q in queries},
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workdir", required=True, help="the import, corpus and datastore (built once, then reused)")
  ap.add_argument("--index", choices=("flat", "ivfpq"), default="flat")
  ap.add_argument("--tokens", type=int, default=16_384, help="scored test tokens per timed run")
  ap.add_argument("--queries", default="0,256,1024,4096,16384", help="eval.search_queries values; the first is "
                  "the baseline")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--out", default="")
  a = ap.parse_args(argv)
  out = run(a.workdir, a.index, a.tokens, [int(q) for q in a.queries.split(",")], a.repeats)
  print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
