"""The table of `experiments/docs_wt.sh ext3 NAME`: external memory searched three ways on the same test tokens.

  python experiments/ext3_table.py runs/docs_wt/ext        # reads ext3_{ivfpq_cpu,ivfpq_gpu,exact}.json there
                                                           # (and ext3_overlap.json, if OVERLAP_TOKENS made one)

Speed: tokens/s of the evaluation with the datastore and without it (the same model, local + long-term memory,
the same tokens), their ratio (issue 37's goal: >= 0.5) and the share of the time spent searching. Agreement:
the test perplexity of every evaluated variant under each search; IVF-PQ on the GPU should match IVF-PQ on the
CPU up to float16 lookup tables, and exact scoring (every key, no top-K, no quantisation) differs from both by
what the approximation costs.
"""

import json
import os
import sys

MODES = (("ivfpq_cpu", "FAISS IVF-PQ, host CPUs"), ("ivfpq_gpu", "FAISS IVF-PQ, GPU (eval.knn_gpu)"),
         ("exact", "every key on the device (eval.datastore_on_device)"))


def main(directory):
  results = {}
  for mode, _ in MODES:
    path = os.path.join(directory, f"ext3_{mode}.json")
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        results[mode] = json.load(f)
  if not results:
    print(f"no ext3_*.json in {directory} (see ext3_runs.txt and ext3_<mode>.log there)")
    overlap_line(directory)
    return
  print("| search | index | tokens | tokens/s with datastore | without | ratio | search share |")
  print("|---|---|---:|---:|---:|---:|---:|")
  for mode, label in MODES:
    r = results.get(mode)
    if r is None:
      print(f"| {label} | not run or failed (ext3_{mode}.log) | | | | | |")
      continue
    t = r["throughput"]
    print(f"| {label} | {r['index']}, K={r['k']}, nprobe={r['nprobe']} | {t['tokens']:,} | "
          f"{t['with_external_tok_s']:,.0f} | {t['without_tok_s']:,.0f} | {t['ratio']:.3f} | "
          f"{t['search_share']:.0%} |")
  split = next(iter(results.values()))["split"]
  variants = list(dict.fromkeys(row["variant"] for r in results.values() for row in r["rows"]))
  ppl = {mode: {row["variant"]: row.get(f"{split}_ppl", row.get("ppl")) for row in r["rows"]}
         for mode, r in results.items()}
  shown = [m for m, _ in MODES if m in results]
  print(f"\n{split} perplexity, the same {next(iter(results.values()))['rows'][0]['tokens']:,} tokens for each search:\n")
  print("| variant | " + " | ".join(shown) + " | largest relative difference |")
  print("|---|" + "---:|" * len(shown) + "---:|")
  for v in variants:
    vals = [ppl[m].get(v) for m in shown]
    got = [x for x in vals if x is not None]
    spread = (max(got) - min(got)) / min(got) if len(got) > 1 else float("nan")
    print(f"| {v} | " + " | ".join("" if x is None else f"{x:.2f}" for x in vals) + f" | {spread:.2%} |")
  overlap_line(directory)


def overlap_line(directory):
  """eval.overlap_search's bench (OVERLAP_TOKENS), when it ran: one paragraph."""
  overlap = os.path.join(directory, "ext3_overlap.json")
  if os.path.exists(overlap):
    with open(overlap, encoding="utf-8") as f:
      o = json.load(f)
    t = o["tokens_per_s"]
    print(f"\neval.overlap_search (bench/eval_overlap.py, {o['index']} on the host, {o['tokens']:,} tokens, "
          f"{o['device']}): tokens/s with the datastore {t['sequential']:,.0f} sequential, {t['overlap']:,.0f} "
          f"overlapped (x{o['overlap_speedup']:.3f}); without it {t['no_datastore_sequential']:,.0f} / "
          f"{t['no_datastore_overlap']:,.0f} (x{o['overlap_speedup_no_datastore']:.3f}); ratio with ÷ without "
          f"{o['ratio_to_no_datastore']['sequential']:.3f} sequential, {o['ratio_to_no_datastore']['overlap']:.3f} "
          f"overlapped; max |nll difference| {o['max_abs_nll_diff_overlap_vs_sequential']:.1e}")


if __name__ == "__main__":
  if len(sys.argv) != 2:
    print("usage: python experiments/ext3_table.py RUN_DIR", file=sys.stderr)
    sys.exit(2)
  main(sys.argv[1])
