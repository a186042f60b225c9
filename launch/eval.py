"""Evaluate an exported checkpoint: perplexity (and bits per byte for byte-level data).

  python -m trime_jax.launch.eval --config=configs/wikitext_mini.py --checkpoint=runs/mini/export \\
      [--config.eval.split=test] [--config.eval.memory=local|none|cache] [--config.eval.tune=True] \\
      [--config.eval.mem_size=4096 | --mem_sizes=0,1024,2048,4096] [--label=TrimeLM] [--output=rows.json]

The model and vocabulary come from the checkpoint; `--config` supplies the data and the `eval` section.
With eval.tune the parameters are grid-searched on dev (split=dev: every grid point is a row, the best one
marked; otherwise the best point is applied to eval.split). `--mem_sizes` sweeps the long-term memory size in
one run (as eval.mem_size: with the default eval.long_term_layout='original' this is the original's --mem-size;
with 'disjoint' it counts the tokens before the window, the original's --mem-size = this + context_window;
docs/long_memory.md). `--include` adds the rows of earlier `--output` files to the summary table and to the
`--plot` (perplexity vs memory size); without `--checkpoint` it only summarises and plots them.
"""

import json
import os
import sys

from absl import flags
from ml_collections import config_flags

from trime_jax.launch.checks import check_data_split, check_export, validated
from trime_jax.launch.entry import run_main
from trime_jax.launch.outputs import check_output_file, export_fingerprint, scored_split

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (data + eval sections).", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Exported checkpoint directory (<workdir>/export).")
_OUTPUT = flags.DEFINE_string("output", "", "Optional JSON file for the results.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an --output file holding another export's or "
                               "program's results, or a --plot file that is not a plot of ours (a rerun of the "
                               "same evaluation replaces its own without it).")
_MEM_SIZES = flags.DEFINE_list("mem_sizes", [], "Long-term memory sizes to sweep (overrides eval.mem_size): "
                                "the original's --mem-size with eval.long_term_layout='original' (the default); "
                                "with 'disjoint', tokens before the window (--mem-size = this + context_window).")
_LABEL = flags.DEFINE_string("label", "", "Model name in the rows, summary table and plot.")
_INCLUDE = flags.DEFINE_list("include", [], "Earlier --output JSON files to add to the summary and plot.")
_ALLOW_OVERLAP = flags.DEFINE_bool("allow_split_overlap", False, "Evaluate although the data section draws the "
                                   "splits otherwise than the export's training did (its dev / test then hold "
                                   "training text). Refused without this flag.")
_PLOT = flags.DEFINE_string("plot", "", "PNG file: perplexity vs long-term memory size (needs matplotlib).")


def main(argv):
  del argv
  from trime_jax import evaluate, sweep
  from trime_jax.data import atomic_write_json
  from trime_jax.distributed import on_chief
  from trime_jax.errors import ConfigError
  from trime_jax.runtime.workdir import chief

  # Everything the flags name is checked before the evaluation runs (an --output folder found only at the end
  # would lose the whole evaluation).
  fingerprint = export_fingerprint(_CHECKPOINT.value)

  def check_outputs():  # process 0 writes them: its view decides, for every process (distributed.on_chief)
    check_output_file(_OUTPUT.value, "output", json_results=True, program="eval", checkpoint_fingerprint=fingerprint,
                      split=scored_split(_CONFIG.value), overwrite=_OVERWRITE.value)
    check_output_file(_PLOT.value, "plot")
    if _PLOT.value:
      sweep.check_plot_path(_PLOT.value, overwrite=_OVERWRITE.value)

  on_chief(check_outputs)
  included = []
  for path in _INCLUDE.value:
    try:
      with open(path) as f:
        loaded = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError) as e:
      raise ConfigError(f"--include {path}: {e}") from None
    if not isinstance(loaded, list) or not all(isinstance(r, dict) for r in loaded):
      raise ConfigError(f"--include {path}: not the rows of a trime_jax.launch.eval --output file "
                        "(a JSON list of objects)")
    included += loaded
  if included:  # the summary's cells, checked before any work (a cell it cannot choose honestly is refused)
    sweep.sweep_best(included)
  try:
    sizes = [int(m) for m in _MEM_SIZES.value]
  except ValueError:
    raise ConfigError(f"--mem_sizes must be integers, got {','.join(_MEM_SIZES.value)}") from None
  if any(m < 0 for m in sizes):
    raise ConfigError(f"--mem_sizes must be >= 0 (tokens of long-term memory), got {','.join(_MEM_SIZES.value)}")
  rows = []
  if _CHECKPOINT.value:
    if _CONFIG.value is None:
      raise ConfigError("--checkpoint needs --config (the data and eval sections)")
    validated(_CONFIG.value, _CHECKPOINT.value)
    e = _CONFIG.value.eval
    if _MEM_SIZES.value and any(sizes) and e.memory == "none":  # nothing would read the store: one column, 0
      raise ConfigError(f"--mem_sizes={','.join(_MEM_SIZES.value)} sweeps a long-term memory, and "
                        "eval.memory=none scores the model alone: give --config.eval.memory=local (or cache), or "
                        "drop --mem_sizes")
    if e.get("datastore"):  # read by eval_ext only: said, since the rows would otherwise pass for external memory
      print(f"note: eval.datastore={e.datastore} is not read by trime_jax.launch.eval, which scores without "
            "external memory; trime_jax.launch.eval_ext evaluates with it", file=sys.stderr, flush=True)
    check_export(_CONFIG.value, _CHECKPOINT.value)
    check_data_split(_CONFIG.value, _CHECKPOINT.value, allow=_ALLOW_OVERLAP.value)
    rows = evaluate.evaluate_checkpoint(_CONFIG.value, _CHECKPOINT.value, mem_sizes=sizes, label=_LABEL.value,
                                        progress=sys.stderr.isatty() or "log")["rows"]  # log files: lines
    # each row names its export (so another one's rerun is refused, and the summary keeps exports apart)
    rows = [{**r, "checkpoint_fingerprint": fingerprint} for r in rows]
    split = _CONFIG.value.eval.split
    # eval.tune: dev's perplexity at each best point beside the split's, as eval_ext shows them (the split's column
    # named, so a test table is not read as dev's); split=dev with eval.tune_max_tokens: the grid's, tune_ppl
    tuned = any("dev_ppl" in r or "tune_ppl" in r for r in rows)
    print(evaluate.format_table(rows, **({"columns": tuple(dict.fromkeys((
        "variant", "tune_ppl", "dev_ppl", f"{split}_ppl", f"{split}_bpc", "nll", "tokens", "tokens_per_s")))}
        if tuned else {})))
    if _OUTPUT.value and chief():  # one writer in a run of several processes (each holds the whole result)
      os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
      atomic_write_json(_OUTPUT.value, rows)  # whole or absent, even when interrupted
  elif not _INCLUDE.value:
    raise ConfigError("nothing to do: give --config and --checkpoint, or --include files to summarise")
  rows += included
  if len(_MEM_SIZES.value) > 1 or _INCLUDE.value:
    try:
      table = sweep.sweep_table(rows)
    except ConfigError as err:  # this evaluation's rows against the included ones (each alone was checked)
      kept = "" if not _CHECKPOINT.value else f" (this evaluation's rows are in --output={_OUTPUT.value})" if \
          _OUTPUT.value else " (this evaluation's rows are in the table above; --output would keep them as a file)"
      raise ConfigError(f"{err}{kept}") from None
    print(table)
    print(f"memory sizes (columns) = {evaluate.mem_size_axis_label(rows)}")
  if _PLOT.value and chief():
    os.makedirs(os.path.dirname(os.path.abspath(_PLOT.value)), exist_ok=True)
    metric = "bpc" if any("bpc" in r for r in rows) else "ppl"
    title = f"{rows[0].get('split', '') if rows else ''} {metric} vs long-term memory size"
    print(f"wrote {sweep.plot_sweep(rows, _PLOT.value, title=title)}")


if __name__ == "__main__":
  run_main(main)
