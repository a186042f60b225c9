"""Evaluation and datastore key-pass throughput of the paper configs at their evaluation shapes (issue 37).

  python -m bench.eval_speed --tiny --out=/tmp/eval_speed.json          # CPU, every config shrunk (a smoke run)
  python -m bench.eval_speed --configs=wiki103_247m --tokens=65536      # an accelerator, the paper's shapes

Per config, a randomly initialised model of the config's shape, exported to a temporary directory as a trained
one is, and a synthetic corpus of the config's vocabulary (random token ids; lines of 1-`--line_len`·2 tokens
ending in </s>, documents of ~3,600 tokens, WikiText-103's mean), through the real code paths:
  eval_local  `evaluate.evaluate` with the config's eval section (block_len, context_window, streams, break
              mode), points `none` + `trime_local` at the config's τ: the model with its own test-time memory
  eval_long   the same with the long-term store at the paper's size (eval.mem_size, or PAPER_MEM_SIZES where the
              config's is 0; --mem_size overrides; skipped when 0), the config's layout and reset_at_documents
  key_pass    `datastore.build.build_datastore` over the same corpus (the config's entries and key dtype): the
              forward pass of every window and the keys written to the memmaps
Tokens/s = scored tokens (stored entries for key_pass) / wall seconds. Compilation is excluded: each evaluation
first runs untimed over the same tokens (its step shapes follow the windows evaluated: complete mode's query
count is the longest block's, so a shorter untimed run can leave the timed one a compile; it did, 13x at
wiki103_7m --tiny), the key pass is timed from a resumed build whose first chunk compiled. Random tokens: the cost depends on the shapes only.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from bench.common import check_flags, check_out, run
from bench.mfu import CONFIGS, apply_set, load_config, parse_set
from trime_jax import data, exports, specs
from trime_jax.datastore import build as ds_build
from trime_jax.errors import first_line
from trime_jax.evaluate import driver
from trime_jax.evaluate.memory import StoreSpec
from trime_jax.evaluate.runner import evaluator_settings, store_spec
from trime_jax.evaluate.points import NONE, Point
from trime_jax.model import build_model

DOC_TOKENS = 3_600  # WikiText-103 train: 103M tokens / 28,475 articles
# Long-term store sizes where the config's eval.mem_size is 0 (its default evaluation is TrimeLM, local memory):
# the released TrimeLM_long / TrimeLM_ext evaluation of the 247M model, --mem-size 12288 (run_pretrained_models.md;
# configs/wiki103_247m.py), and docs-wt's largest (docs/docs_wt.md, configs/docs_wt_ext.py). wiki103_7m has no
# released long-term evaluation: none is timed (--mem_size sets one).
PAPER_MEM_SIZES = {"wiki103_247m": 12_288, "docs_wt": 8_192}


def synthetic_corpus(vocab: data.Vocab, tokens: int, line_len: int, seed: int = 0) -> data.Corpus:
  """Random ids (never </s> inside a line), each line ended by </s>, documents of ~DOC_TOKENS tokens."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, len(vocab), tokens, dtype=np.int32)
  ids[ids == vocab.eos] = (vocab.eos + 1) % len(vocab)
  ends = np.cumsum(rng.integers(1, 2 * line_len, tokens // line_len + 2))
  ids[ends[ends < tokens]] = vocab.eos
  starts = np.arange(0, tokens, DOC_TOKENS, dtype=np.int64)
  return data.Corpus(ids, np.append(starts, tokens), vocab, name=f"synthetic-{tokens}")


def synthetic_vocab(size: int, kind: str) -> data.Vocab:
  if kind == "bytes":
    return data.Vocab.bytes()
  return data.Vocab([data.EOS, data.UNK] + [f"w{i}" for i in range(size - 2)])


def _timed_eval(graphdef, params, corpus, points, e, long_term, tokens, warm_tokens, vocab_chunk):
  run = lambda n: driver.evaluate(graphdef, params, corpus, points, long_term=long_term, max_tokens=n,
                                  **evaluator_settings(e, vocab_chunk))
  run(warm_tokens)  # compiles every jitted step (untimed)
  t0 = time.perf_counter()
  res = run(tokens)
  sec = time.perf_counter() - t0
  return {"tokens": int(res.tokens), "seconds": sec, "tokens_per_s": res.tokens / sec,
          "ppl": {s.point.family: float(s.ppl) for s in res.scores}}


def measure(name: str, a, on_row=lambda out, row: None) -> dict:
  """The config's rows; `on_row(out, row)` after each one (a run cut at its budget keeps the rows it measured)."""
  c = load_config(name, a.tiny)
  e = c.eval
  with c.unlocked():
    e.mem_size = int(e.mem_size) or PAPER_MEM_SIZES.get(name, 0)
  if a.tiny:  # the evaluation shapes shrunk with the model (max_len 64): same context share, a small store
    with c.unlocked():
      share = int(e.context_window) / int(e.block_len)
      e.block_len = min(int(e.block_len), c.model.max_len)
      e.context_window = int(share * e.block_len)
      e.mem_size = min(int(e.mem_size), 256)
  apply_set(c, parse_set(a.set))
  kind = "bytes" if c.model.vocab_size == 256 else "words"
  vocab = synthetic_vocab(c.model.vocab_size, kind)
  mcfg = specs.model_config(c, vocab_size=len(vocab))
  out = {"config": name, "d_model": mcfg.d_model, "num_layers": mcfg.num_layers, "vocab": len(vocab),
         "dtype": str(mcfg.dtype), "block_len": int(e.block_len), "context_window": int(e.context_window),
         "streams": int(e.batch_size), "break_mode": e.get("sample_break_mode", "none")}
  model = build_model(mcfg, nnx.Rngs(params=0))
  graphdef, params = nnx.split(model, nnx.Param)
  del model
  stride, streams = int(e.block_len) - int(e.context_window), int(e.batch_size)
  warm = a.warm_tokens or a.tokens
  line_len = min(a.line_len, max(2, int(e.block_len) // 8))  # complete mode drops lines longer than a block
  corpus = synthetic_corpus(vocab, max(a.tokens, a.key_pass_tokens) + warm + int(e.block_len), line_len)
  tau = float(e.tau)
  points = (NONE, Point("trime_local", tau=tau))
  vocab_chunk = int(c.train.get("vocab_chunk", 0))
  rows = out["rows"] = {}
  rows["eval_local"] = _timed_eval(graphdef, params, corpus, points, e, StoreSpec(), a.tokens, warm, vocab_chunk)
  on_row(out, "eval_local")
  mem = int(a.mem_size if a.mem_size >= 0 else e.mem_size)
  if mem:
    spec = store_spec(e, mem)
    rows["eval_long"] = _timed_eval(graphdef, params, corpus, points, e, spec, a.tokens, warm, vocab_chunk)
    rows["eval_long"]["mem_size"] = mem
    on_row(out, "eval_long")
  if a.key_pass_tokens:
    with tempfile.TemporaryDirectory() as tmp:
      export_dir = exports.export(os.path.join(tmp, "export"), params, c, vocab)
      store, kw = os.path.join(tmp, "ds"), dict(progress=False, key_dtype=str(e.get("datastore_key_dtype", "float16")),
                                                entries=str(e.get("datastore_entries", "all")))
      first = ds_build.build_datastore(export_dir, corpus, store, stop_at_tokens=stride * streams,
                                       chunk_tokens=stride * streams, **kw)  # one batch of windows: compiles
      t0 = time.perf_counter()
      meta = ds_build.build_datastore(export_dir, corpus, store,
                                      stop_at_tokens=int(first["tokens_done"]) + a.key_pass_tokens,
                                      chunk_tokens=min(ds_build.CHUNK_TOKENS, a.key_pass_tokens), **kw)
      sec = time.perf_counter() - t0
      n = int(meta["tokens_done"]) - int(first["tokens_done"])
      rows["key_pass"] = {"tokens": n, "seconds": sec, "tokens_per_s": n / sec, "key_dtype": kw["key_dtype"],
                          "bytes_per_key": int(mcfg.d_model) * np.dtype(kw["key_dtype"]).itemsize}
      on_row(out, "key_pass")
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--configs", default=",".join(CONFIGS))
  p.add_argument("--tiny", action="store_true", help="every config shrunk (bench.mfu's --tiny): a CPU smoke run")
  p.add_argument("--tokens", type=int, default=0, help="scored tokens per timed evaluation (default 65,536; "
                 "--tiny 2,048)")
  p.add_argument("--warm_tokens", type=int, default=0, help="tokens of the untimed compiling run (default: "
                 "--tokens, the timed run's own shapes; fewer may leave the timed run a compile)")
  p.add_argument("--mem_size", type=int, default=-1, help="long-term store size (-1: the config's eval.mem_size)")
  p.add_argument("--key_pass_tokens", type=int, default=-1, help="entries the timed key pass stores (default "
                 "--tokens; 0: no key pass)")
  p.add_argument("--line_len", type=int, default=100, help="mean line length of the synthetic corpus")
  p.add_argument("--set", action="append", default=[], help="SECTION.FIELD=VALUE (bench.mfu's --set)")
  p.add_argument("--out", default="")
  p.add_argument("--overwrite", action="store_true", help="replace an --out that is not this benchmark's result")
  a = p.parse_args(argv)
  check_flags((a.tokens >= 0, f"--tokens must be >= 0 (0: the default), got {a.tokens}"),
              (a.warm_tokens >= 0, f"--warm_tokens must be >= 0 (0: --tokens), got {a.warm_tokens}"),
              (a.line_len >= 1, f"--line_len must be >= 1, got {a.line_len}"),
              (a.mem_size >= -1, f"--mem_size must be >= 0 (-1: the config's), got {a.mem_size}"))
  check_out(a.out, "eval_speed", a.overwrite)
  for name in a.configs.split(","):  # every name and --set field checked before the first measurement
    apply_set(load_config(name, a.tiny), parse_set(a.set))
  a.tokens = a.tokens or (2_048 if a.tiny else 65_536)
  if a.key_pass_tokens < 0:
    a.key_pass_tokens = a.tokens
  print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{a.tokens:,} timed tokens per row", flush=True)
  results = []
  print("| config | row | store | tokens | seconds | tokens / s |")
  print("|---|---|---:|---:|---:|---:|")

  def write():  # after every row: a config cut at its budget (gpu_speed.sh's timeout) keeps what it measured
    if a.out:
      with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"bench": "eval_speed", "device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                   "args": vars(a), "results": results}, f, indent=1)

  def on_row(out, row):
    v = out["rows"][row]
    store = v.get("mem_size", "") if row != "key_pass" else v["key_dtype"]
    print(f"| {out['config']} | {row} | {store} | {v['tokens']:,} | {v['seconds']:.2f} | {v['tokens_per_s']:,.0f} |",
          flush=True)
    if not results or results[-1] is not out:
      results.append(out)
    write()

  for name in a.configs.split(","):
    try:
      measure(name, a, on_row)
    except Exception as err:  # one config's failure (out of memory, say) is reported, the others still run
      print(f"| {name} | failed: {first_line(err)} | | | | |", flush=True)
      if results and results[-1].get("config") == name:  # rows measured before the failure stay
        results[-1]["error"] = f"{type(err).__name__}: {err}"
      else:
        results.append({"config": name, "error": f"{type(err).__name__}: {err}"})
      write()


if __name__ == "__main__":
  run(main)
