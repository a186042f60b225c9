"""MT decoding throughput (sentences/s) with and without the datastore, one export, one run.

Decodes the same test sentences (evenly spaced over the split) with the model alone, kNN-MT and TrimeMT_ext (each at its
valid-tuned setting from tuned.json, or all at --k) with trime_jax.launch.translate's search (decode.EVAL_SEARCH), after
one untimed pass that compiles every shape. The modes are timed in turn, --repeats times, and the median pass is
reported with its decoder steps (a batch searches until its last sentence ends: a weaker distribution that loops takes
more), time per step, retrieval share (FAISS search + gathering the retrieved keys) and the ratio of sentences/s to the
model alone's. Run it on an idle machine: the numbers are seconds.

  python -m bench.mt_decode --checkpoint=runs/ui_de_en/ce_random/export --datastore=runs/ui_de_en/ce_random/ds \\
      --settings=runs/ui_de_en/ce_random/translate/tuned.json [--sentences=512 --repeats=2 --nprobe=8]
"""

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np

from trime_jax.mt import data as mt_data
from trime_jax.mt import datastore as mt_datastore
from trime_jax.mt import decode
from trime_jax.mt import export as mt_export
from trime_jax import specs


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", required=True, help="MT export directory")
  ap.add_argument("--datastore", required=True)
  ap.add_argument("--settings", required=True, help="tuned.json of trime_jax.launch.translate --tune")
  ap.add_argument("--modes", default="model,knn_mt,trime", help="comma-separated; each needs a tuned setting")
  ap.add_argument("--k", type=int, default=0, help="override every retrieval mode's K (0: the tuned K)")
  ap.add_argument("--sentences", type=int, default=512, help="N test sentences, evenly spaced over the split")
  ap.add_argument("--batch_sentences", type=int, default=32)
  ap.add_argument("--nprobe", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=2)
  search = decode.EVAL_SEARCH  # trime_jax.launch.translate's defaults (SearchOptions() alone is fairseq's 0·|x| + 200)
  ap.add_argument("--beam", type=int, default=search.beam)
  ap.add_argument("--lenpen", type=float, default=search.lenpen)
  ap.add_argument("--max_len_a", type=float, default=search.max_len_a)
  ap.add_argument("--max_len_b", type=int, default=search.max_len_b)
  args = ap.parse_args()

  graphdef, params, config, vocab = mt_export.load_mt_export(args.checkpoint)
  cfg = specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size)
  ds, index = mt_datastore.open_mt_datastore(args.datastore, args.checkpoint, nprobe=args.nprobe)
  pairs = mt_data.load_parallel(mt_datastore.mt_config(None, args.checkpoint), "test", vocab)
  # evenly spaced over the test split: its length mix (a batch's search runs as long as its longest sentence)
  src = [pairs.src[i] for i in np.linspace(0, len(pairs.src) - 1, min(args.sentences, len(pairs.src))).astype(int)]
  options = decode.SearchOptions(beam=args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a,
                                 max_len_b=args.max_len_b)
  translators = {}
  for mode in args.modes.split(","):
    dist = decode.Distribution() if mode == "model" else decode.Distribution.from_tuned(args.settings, mode)
    if args.k and mode != "model":
      dist = dataclasses.replace(dist, k=args.k)
    translators[mode] = decode.Translator(graphdef, params, cfg, dist=dist, datastore=ds, index=index,
                                          options=options, eos_id=vocab.eos_id)
  for t in translators.values():  # compile every shape (untimed)
    t.translate(src, batch_sentences=args.batch_sentences)
  runs = {m: [] for m in translators}
  for _ in range(args.repeats):
    for mode, t in translators.items():
      t.search_seconds, t.decode_steps = 0.0, 0
      t0 = time.perf_counter()
      t.translate(src, batch_sentences=args.batch_sentences)
      runs[mode].append((time.perf_counter() - t0, t.search_seconds, t.decode_steps))
  base = statistics.median(r[0] for r in runs["model"]) if "model" in runs else None
  print(f"{len(src)} test sentences, beam {args.beam}, max length {args.max_len_a:g}·|x| + {args.max_len_b}, "
        f"batches of {args.batch_sentences}, nprobe {args.nprobe}, "
        f"datastore {ds.count:,} keys, median of {args.repeats}")
  results = {}
  for mode, rs in runs.items():
    sec = statistics.median(r[0] for r in rs)
    search = statistics.median(r[1] for r in rs)
    steps = rs[0][2]  # the same every pass
    d = translators[mode].dist
    how = "" if mode == "model" else f" K {d.k}"
    results[mode] = {"sentences_per_s": len(src) / sec, "retrieval_share": search / sec,
                     "vs_model": base / sec if base else None, "decode_steps": steps, "ms_per_step": 1e3 * sec / steps}
    print(f"{mode:12s}{how:6s} {len(src) / sec:6.1f} sentences/s  {steps:5d} steps  {1e3 * sec / steps:6.1f} ms/step"
          f"  retrieval {100 * search / sec:4.1f}%"
          + (f"  {base / sec:.2f}x the model alone's speed" if base else ""))
  print(json.dumps(results))


if __name__ == "__main__":
  main()
