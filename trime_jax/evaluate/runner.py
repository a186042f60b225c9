"""A whole evaluation of an exported checkpoint: `evaluate_checkpoint` (what trime_jax.launch.eval, trime_jax.launch.eval_ext and
trime_jax.launch.demo run): the export, the data, the external memory, the points (configured or a tuning grid on dev),
one `driver.evaluate` per long-term memory size, and the result rows (`format_table`).
"""

from __future__ import annotations

import collections
import functools
import os
import sys

import jax
import numpy as np
from absl import logging

from trime_jax import corpora
from trime_jax import exact_memory
from trime_jax import exports
from trime_jax import knn
from trime_jax import sharding
from trime_jax.errors import CheckpointError, ConfigError
from trime_jax.evaluate.driver import SEARCH_QUERIES, EvalResult, evaluate, process_share
from trime_jax.evaluate.memory import StoreSpec
from trime_jax.evaluate.points import (INTERP_MEMORIES, NONE, Point, families_of, grid, grid_edges, configured_points,
                                       tune)

# ----------------------------------------------------------------------------------------------------------
# A whole evaluation of an exported checkpoint (trime_jax.launch.eval, trime_jax.launch.eval_ext and trime_jax.launch.demo wrap this).
# ----------------------------------------------------------------------------------------------------------
def load_eval_data(config, vocab):
  """The config's corpora encoded with the checkpoint's vocabulary (kinds must agree)."""
  splits = corpora.load_splits(config.data, vocab=vocab if vocab.kind == "words" else None)
  if splits.vocab.kind != vocab.kind or len(splits.vocab) != len(vocab):
    raise CheckpointError(
        f"checkpoint vocabulary ({vocab.kind}, {len(vocab)} tokens) does not match data.corpus="
        f"{config.data.corpus!r} ({splits.vocab.kind}, {len(splits.vocab)} tokens)")
  return splits



def search_queries_of(e) -> int:
  """An eval section's eval.search_queries (an export's stored config from before it existed: the default)."""
  return int(e.get("search_queries", SEARCH_QUERIES))


def knnlm_metric_of(e) -> str:
  """eval.knnlm_metric, checked ("ip" for configs stored before the field existed: the only metric then), also
  against eval.datastore_on_device (validate_config and evaluate_checkpoint both ask)."""
  metric = knn.check_knnlm_metric(e.get("knnlm_metric", "ip"))
  if metric == "l2" and e.get("datastore_on_device", False):
    raise ConfigError("eval.knnlm_metric=l2 (kNN-LM over an L2 index's top-K) is not supported with "
                      "eval.datastore_on_device (exact inner-product sums over every key): use one of them")
  return metric


def evaluator_settings(e, vocab_chunk: int) -> dict:
  """`driver.evaluate`'s keyword arguments that come from a config's eval section (and the model's
  train.vocab_chunk): the windows, the streams, the devices they are split over and how the steps run."""
  return dict(block_len=e.block_len, context_window=e.context_window, streams=e.batch_size, vocab_chunk=vocab_chunk,
              break_mode=e.get("sample_break_mode", "none"), complete_overlong=e.get("complete_overlong", "drop"),
              overlap_search=bool(e.get("overlap_search", False)), search_queries=search_queries_of(e),
              mesh=sharding.eval_mesh(e.get("devices", 1), int(e.batch_size)))


def devices_note(mesh, streams: int) -> str | None:
  """The line that tells a user evaluating on one of several devices how to use them all (None otherwise)."""
  n = len(jax.local_devices())
  if mesh is not None or n == 1:
    return None
  per = n * (streams // sharding.streams_here(streams))  # (every process's devices where the processes split them)
  return (f"evaluating on 1 of this process's {n} devices: --config.eval.devices=0 splits the streams over all of "
          f"them (eval.batch_size={streams} then a multiple of {per}; the same scores)")


def frequency_split(e) -> str:
  """The split whose word counts make the frequency buckets: eval.frequency_split (dev, the paper's; train: the
  training split, as before 2026-12-06)."""
  split = str(e.get("frequency_split", "dev"))
  if split not in ("dev", "train"):
    raise ConfigError(f"eval.frequency_split must be dev or train, got {split!r}")
  return split


def store_spec(e, mem_size: int) -> StoreSpec:
  """The long-term store of `mem_size` tokens in the eval section's layout and document setting."""
  return StoreSpec(mem_size, bool(e.reset_at_documents), str(e.long_term_layout))


def window_settings(e) -> dict:
  """What a result row records of the windows that scored it (besides its store): rows of other windows are other
  measurements (`sweep` keeps them apart)."""
  return {"block_len": int(e.block_len), "context_window": int(e.context_window),
          "sample_break_mode": str(e.get("sample_break_mode", "none"))}


def _rows(result: EvalResult, *, split: str, long_term: StoreSpec, best: dict | None, dev_best: dict | None,
          label: str, windows: dict | None = None) -> list[dict]:
  rows = []
  for s in result.scores:
    row = {**s.as_dict(), "family": s.point.family, "params": s.point.params, "mem_size": long_term.mem_size,
           "long_term_layout": long_term.layout, "reset_at_documents": long_term.reset_at_documents, "split": split,
           **(windows or {}), f"{split}_ppl": s.ppl}
    if s.point.family == "interp":
      row["interp_memory"] = s.point.interp_memory  # "external" (the original's P′) or "all" (the paper's text)
    if s.bytes_level:
      row[f"{split}_bpc"] = s.bits_per_token
    if dev_best is not None:
      # the grid's perplexity at the chosen point; on split=dev (a grid of eval.tune_max_tokens targets) under a
      # name of its own: it replaced the row's dev_ppl (its split's perplexity), so tables showed the grid's
      row["tune_ppl" if split == "dev" else "dev_ppl"] = dev_best[s.point.group].ppl
    if best is not None and s.point.family != "none" and best[s.point.group] is s:
      row["best"] = True  # format_table marks it where its group had a choice (a grid)
    if label:
      row["model"] = label
    rows.append(row)
  return rows


def on_device_datastore(e, checkpoint_dir: str) -> exact_memory.DeviceDatastore:
  """eval.datastore on all devices (eval.datastore_on_device=True), checked against the model; the FAISS index
  is not read."""
  if not isinstance(e.datastore_on_device, bool):
    raise ConfigError(f"eval.datastore_on_device must be True or False, got {e.datastore_on_device!r}")
  if e.knn_gpu:
    raise ConfigError("eval.datastore_on_device=True scores every key on the devices without FAISS: "
                      "eval.knn_gpu=True does not apply (set one of them)")
  ds = exact_memory.Datastore(e.datastore)
  ds.check_checkpoint(checkpoint_dir)
  return exact_memory.load_datastore(ds)


def evaluate_checkpoint(config, checkpoint_dir: str, *, external_memory: bool = False, mem_sizes=None,
                        label: str = "", progress: bool | str = False, throughput_tokens: int = 0) -> dict:
  """Evaluate an export on `config.eval.split`, for each long-term memory size of `mem_sizes` (default:
  eval.mem_size). Families: `families_of(config.eval, external_memory)`; external memory needs
  eval.datastore.

  With eval.tune every family's parameters are grid-searched on dev (the interpolation for both P′ memories):
  when the split is dev and the grid covered eval.max_tokens of it the grid's rows are the result (the best of
  each group marked), otherwise the best points are applied to the split (rows carry dev_ppl; dev with
  eval.tune_max_tokens: the grid on that many dev targets, its perplexity the rows' tune_ppl, the rows on
  eval.max_tokens). Returns {"rows": [...], ...}: rows with family, params, variant, nll, ppl, <split>_ppl,
  tokens, mem_size, long_term_layout, reset_at_documents, block_len, context_window, sample_break_mode, split
  (+ model, dev_ppl or tune_ppl, best); with external memory also
  retrieval accuracy, frequency-bucket perplexities and (if `throughput_tokens`) throughput with vs without
  external memory."""
  checkpoint_dir = os.path.abspath(checkpoint_dir)
  graphdef, params, train_config, vocab, _ = exports.load_export(checkpoint_dir)
  splits = load_eval_data(config, vocab)
  e = config.eval
  families = families_of(e, external_memory)
  if e.interp_memory not in INTERP_MEMORIES:
    raise ConfigError(f"eval.interp_memory must be one of {INTERP_MEMORIES}, got {e.interp_memory!r}")
  knn_memory = buckets = None
  knnlm_metric = knnlm_metric_of(e)
  if external_memory:
    if not e.datastore:
      raise ConfigError("eval.datastore is not set: build one with `python -m trime_jax.launch.build_datastore`")
    if e.datastore_on_device:
      knn_memory = on_device_datastore(e, checkpoint_dir)
    else:
      knn_memory = knn.ExternalMemory(e.datastore, index_path=e.index, checkpoint_dir=checkpoint_dir, k=e.knn_k,
                                      nprobe=e.nprobe, exact=e.knn_exact, gpu=e.knn_gpu, knnlm_metric=knnlm_metric)
    # words by their frequency on the development set, as the paper groups them (eval.frequency_split)
    buckets = (knn.frequency_buckets(splits.get(frequency_split(e)).tokens, len(vocab)) if vocab.kind == "words"
               else None)
  tuned = bool(e.tune) and families != ("none",)
  tune_max_tokens = int(e.get("tune_max_tokens", 0))
  if tune_max_tokens < 0:  # (a negative cap reached the windows as an empty split: an IndexError traceback)
    raise ConfigError(f"eval.tune_max_tokens must be >= 0 (0: as eval.max_tokens), got {tune_max_tokens}")
  if e.tune and not tuned and progress:  # (the Python API and training's evaluations pass progress=False)
    print("warning: eval.tune: nothing to tune: eval.memory=none scores the model alone (no tau, lambda or theta); "
          "evaluated without the dev grid", file=sys.stderr)
  points = grid(families) if tuned else configured_points(e, families)
  sizes = [int(m) for m in mem_sizes] if mem_sizes else [int(e.mem_size)]
  if families == ("none",):
    sizes = [0]  # nothing reads the store
  settings = evaluator_settings(e, train_config.train.vocab_chunk)
  note = devices_note(settings["mesh"], int(e.batch_size))
  if note and progress:  # a command's run (the Python API and training's evaluations pass progress=False)
    logging.info(note)
  run = functools.partial(evaluate, graphdef, params, external=knn_memory, max_tokens=e.max_tokens,
                          word_buckets_V=buckets, progress=progress, **settings)
  out = {"checkpoint": checkpoint_dir, "split": e.split, "rows": [],
         "devices": 1 if settings["mesh"] is None else settings["mesh"].size,  # the streams' (eval.devices)
         # each process of a run of several evaluating its share of the streams (`evaluate`)
         **({"processes": jax.process_count()} if process_share(int(e.batch_size), knn_memory) is not None else {})}
  if external_memory:
    on_device = isinstance(knn_memory, exact_memory.DeviceDatastore)
    out.update(datastore=e.datastore, index="on_device_exact" if on_device else knn_memory.index.kind,
               k=knn_memory.k, nprobe=e.nprobe, exact=bool(e.knn_exact or on_device), knnlm_metric=knnlm_metric,
               mem_size=sizes[0],
               search_queries=0 if on_device else search_queries_of(e))  # 0: no FAISS call to group
  for mem_size in sizes:
    long_term = store_spec(e, mem_size)
    best = dev_best = None
    if tuned:  # on the first eval.tune_max_tokens dev targets (0: eval.max_tokens)
      tune_cap = tune_max_tokens or int(e.max_tokens)
      dev = run(splits.dev, points, long_term=long_term, max_tokens=tune_cap)
      out["dev_tokens"] = dev.tokens
      best = tune(dev)
      if progress:  # a command's run: a dev optimum at an end of its grid is said (it may lie beyond)
        for b in best.values():
          if grid_edges(b.point):
            print(f"note: eval.tune: {b.name} is the dev optimum at memory size {mem_size:,}, with "
                  f"{' and '.join(grid_edges(b.point))} at an end of its grid (evaluate.GRIDS): the optimum may "
                  "lie beyond it", file=sys.stderr, flush=True)
      if e.split == "dev" and tune_cap == int(e.max_tokens):  # the grid covered what dev's rows report
        result = dev
      else:
        dev_best = best
        out.setdefault("dev_grid", []).extend({"variant": s.name, "mem_size": mem_size, "dev_ppl": s.ppl}
                                              for s in dev.scores)
        result = run(splits.get(e.split), (NONE,) + tuple(b.point for g, b in best.items() if g != "none"),
                     long_term=long_term)
        best = {s.point.group: s for s in result.scores}
    else:
      result = run(splits.get(e.split), points, long_term=long_term)
    out["rows"] += _rows(result, split=e.split, long_term=long_term, best=best, dev_best=dev_best, label=label,
                         windows=window_settings(e))
  if external_memory:  # of the last memory size
    out["retrieval_accuracy"] = result.retrieval_accuracy()
    out["search_seconds"], out["seconds"] = result.search_seconds, result.seconds
    if buckets is not None:
      out["buckets"] = {"names": [b[2] for b in knn.FREQ_BUCKETS], "frequency_split": frequency_split(e),
                        "tokens": result.bucket_tokens.tolist(),
                        "ppl": {s.name: np.exp(result.bucket_nll[i]).tolist() for i, s in enumerate(result.scores)}}
    if throughput_tokens:
      tau = next((s.point.tau for s in result.scores if s.point.family == "trime"), 1.0)
      timed = []
      for ext, pt in ((knn_memory, Point("trime", tau=tau)), (None, Point("trime_local", tau=tau))):
        corpus = splits.get(e.split)
        timing = functools.partial(run, corpus, (pt,), long_term=long_term, external=ext, word_buckets_V=None,
                                   progress=False)
        timing(max_tokens=min(throughput_tokens, 1024))  # untimed: neither side's timing includes compilation
        timed.append(timing(max_tokens=throughput_tokens))
      with_ext, without = timed
      a, b = with_ext.tokens / with_ext.seconds, without.tokens / without.seconds
      out["throughput"] = {"tokens": with_ext.tokens, "with_external_tok_s": a, "without_tok_s": b, "ratio": a / b,
                           "search_share": with_ext.search_seconds / with_ext.seconds}
  return out


def format_table(rows: list[dict], columns=("variant", "ppl", "bpc", "nll", "tokens", "tokens_per_s")) -> str:
  """A Markdown table of result rows; rows with a long-term memory (eval.mem_size, `--mem_sizes`) get a mem_size
  column first (a trime_local row of 8,192 tokens of long-term memory is not the one without)."""
  if "mem_size" not in columns and (len({r.get("mem_size") for r in rows}) > 1 or any(r.get("mem_size") for r in rows)):
    columns = ("mem_size", *columns)
  cols = [c for c in columns if any(c in r for r in rows)]

  def fmt(v):
    if isinstance(v, float):
      return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}" if abs(v) < 10 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)

  # A tuned grid's best point per (family, memory size), as the rows' "best" says, where its group also holds
  # points that were not chosen (a group of one, e.g. the test pass of the best points, is not marked).
  group = lambda r: (r.get("model"), r.get("split"), r.get("family"), r.get("interp_memory"), r.get("mem_size"))
  unchosen = collections.Counter(group(r) for r in rows if not r.get("best"))
  shown = [dict(r, variant=f"{r['variant']}  <- best") if r.get("best") and unchosen[group(r)]
           and not str(r.get("variant", "")).endswith("<- best") else r for r in rows]
  cells = [[fmt(r.get(c, "")) for c in cols] for r in shown]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
  return "\n".join(lines)
