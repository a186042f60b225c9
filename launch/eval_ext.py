"""Evaluate with external memory: TrimeLM_ext (one softmax over vocabulary + local + long-term + top-K
retrieved memories, plus the Appendix-A interpolation) and the kNN-LM baselines, from one datastore.

  python -m trime_jax.launch.build_datastore --config=configs/wikitext_mini.py --checkpoint=runs/ext/export \\
      --out=runs/ext/ds
  python -m trime_jax.launch.eval_ext --config=configs/wikitext_mini.py --checkpoint=runs/ext/export \\
      --config.eval.datastore=runs/ext/ds --config.eval.split=test --config.eval.tune=True [--throughput_tokens=8192]

With eval.tune the parameters of every family (τ, τ′, λ, θ) are grid-searched on dev, then applied to
eval.split; the interpolation is tuned and reported for both P′ memories (column interp_memory), otherwise
P′ covers eval.interp_memory ("external": the original release, default; "all": the paper's text). Prints
the perplexity table, top-K retrieval accuracy and perplexity per frequency bucket. Every family is scored
(the model alone, the continuous cache, TRIME with local / long-term memory, TrimeLM_ext, its interpolation,
kNN-LM, kNN-LM + cache): eval.memory, launch.eval's choice of one family, is not read here.
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from trime_jax.launch.checks import check_data_split, check_export, check_split_overlap, validated
from trime_jax.launch.entry import run_main
from trime_jax.launch.outputs import check_output_file, export_fingerprint, scored_split

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (data + eval sections).", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Exported checkpoint directory (<workdir>/export).")
_OUTPUT = flags.DEFINE_string("output", "", "Optional JSON file for the results.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an --output file holding another export's or "
                               "program's results (a rerun of the same evaluation replaces its own without it).")
_THROUGHPUT = flags.DEFINE_integer("throughput_tokens", 0, "Also time this many tokens with vs without external "
                                   "memory (0: skip).", lower_bound=0)
_ALLOW_OVERLAP = flags.DEFINE_bool("allow_split_overlap", False, "Evaluate (or tune on) the very split the datastore "
                                   "was built from. Refused without this flag: the retrieved entries would include "
                                   "each scored token itself (leakage); use it only to study that on purpose.")
flags.mark_flags_as_required(["config", "checkpoint"])


def main(argv):
  del argv
  from trime_jax import evaluate
  from trime_jax.data import atomic_write_json
  from trime_jax.distributed import on_chief
  from trime_jax.runtime.workdir import chief

  fingerprint = export_fingerprint(_CHECKPOINT.value)
  # Before the evaluation. Process 0 writes it: its view decides, for every process (distributed.on_chief).
  on_chief(lambda: check_output_file(_OUTPUT.value, "output", json_results=True, program="eval_ext",
                                     checkpoint_fingerprint=fingerprint, overwrite=_OVERWRITE.value,
                                     split=scored_split(_CONFIG.value)))
  config = validated(_CONFIG.value, _CHECKPOINT.value)
  check_export(config, _CHECKPOINT.value)
  check_data_split(config, _CHECKPOINT.value, allow=_ALLOW_OVERLAP.value)
  check_split_overlap(config, _CHECKPOINT.value, allow=_ALLOW_OVERLAP.value)
  out = evaluate.evaluate_checkpoint(config, _CHECKPOINT.value, external_memory=True,
                                     progress=sys.stderr.isatty() or "log",  # log files: plain lines
                                     throughput_tokens=_THROUGHPUT.value)
  split = out["split"]
  cols = dict.fromkeys(("family", "interp_memory", "variant", "tune_ppl", "dev_ppl", f"{split}_ppl", f"{split}_bpc",
                        "tokens", "tokens_per_s"))  # one dev_ppl column when split=dev (tune_ppl: the grid's there)
  tuned = any(r.get("best") for r in out["rows"])  # a grid on dev: show the best point of each group
  shown = [r for r in out["rows"] if not tuned or r.get("best") or r["family"] == "none"]
  print(evaluate.format_table(shown, columns=cols))
  print("interp_memory: the memories P′ covers (external: top-K retrieved only, the original release; "
        "all: local + long-term + retrieved, the paper's text)")
  if out["retrieval_accuracy"]:  # empty with eval.datastore_on_device (no top-K ranking)
    print("\ntop-K retrieval accuracy: " + ", ".join(f"{k} {v:.1%}" for k, v in out["retrieval_accuracy"].items()))
  if "buckets" in out:
    b = out["buckets"]
    # "–": no scored token's word has that count there (its perplexity would be nan)
    rows = [{"variant": name, **{f"{n} ({int(t):,})": p if t else "–"
                                 for n, t, p in zip(b["names"], b["tokens"], ppl)}} for name, ppl in b["ppl"].items()]
    where = {"dev": "the dev split", "train": "the training split"}.get(b.get("frequency_split"), "the training split")
    print(f"\nperplexity per frequency bucket (the target word's count in {where}, eval.frequency_split; scored "
          "tokens in parentheses):")
    columns = ["variant"] + [f"{n} ({int(t):,})" for n, t in zip(b["names"], b["tokens"])]
    print(evaluate.format_table(rows, columns=columns))
  if "throughput" in out:
    t = out["throughput"]
    print(f"\nthroughput on {t['tokens']:,} tokens: {t['with_external_tok_s']:,.0f} tok/s with external memory "
          f"(K={out['k']}, {out['index']}, nprobe={out['nprobe']}) vs {t['without_tok_s']:,.0f} without: "
          f"ratio {t['ratio']:.3f} (search {t['search_share']:.0%} of the time)")
  if _OUTPUT.value and chief():  # one writer in a run of several processes (each holds the whole result)
    os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
    # whole or absent, even when interrupted; it names its export, so another one's rerun is refused
    atomic_write_json(_OUTPUT.value, {**out, "checkpoint_fingerprint": fingerprint})


if __name__ == "__main__":
  run_main(main)
