"""Generation throughput (tokens/s) with each memory: none, local, long (a store of --store_tokens) and external
(top --knn_k of a flat FAISS index over --datastore_tokens), on a demo-size byte model.

  python -m bench.generate [--checkpoint=runs/demo/local/export] [--batch=1,8] [--new_tokens=128]

Without --checkpoint a randomly initialised model of configs/demo.py's shape is exported to a temporary
directory (throughput does not depend on the weights). The store and the datastore hold Python standard-library
sources read by that model. Each setting is run once untimed (compilation), then timed; tokens/s counts
generated tokens of the whole batch, the prompt's prefill included in the time.
"""

import argparse
import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from bench.common import check_flags, fail, run


def _export(tmp):
  from trime_jax.configs import demo
  from trime_jax import exports
  from trime_jax import data
  from trime_jax import specs
  from trime_jax.model import TransformerLM

  cfg = demo.get_config()
  vocab = data.Vocab.bytes()
  net = TransformerLM(specs.model_config(cfg, vocab_size=len(vocab)), rngs=nnx.Rngs(0))
  return exports.export(os.path.join(tmp, "export"), nnx.state(net, nnx.Param), cfg, vocab)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", default="")
  ap.add_argument("--batch", default="1,8")
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--store_tokens", type=int, default=16_384)
  ap.add_argument("--datastore_tokens", type=int, default=200_000)
  ap.add_argument("--knn_k", type=int, default=1024)
  args = ap.parse_args(argv)
  try:
    batches = [int(b) for b in args.batch.split(",")]
  except ValueError:
    fail(f"--batch takes batch sizes separated by commas (e.g. 1,8), got {args.batch!r}")
  check_flags((min(batches) >= 1, f"--batch sizes must be >= 1, got {args.batch}"),
              (args.new_tokens >= 1, f"--new_tokens must be >= 1, got {args.new_tokens}"),
              (args.store_tokens >= 1, f"--store_tokens must be >= 1, got {args.store_tokens}"),
              (args.datastore_tokens >= 1, f"--datastore_tokens must be >= 1, got {args.datastore_tokens}"),
              (args.knn_k >= 1, f"--knn_k must be >= 1, got {args.knn_k}"))

  from trime_jax import exports

  checkpoint = exports.export_path(args.checkpoint) if args.checkpoint else ""  # a shipped model's name too
  with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:  # the datastore: removed at the end
    _measure(args, batches, checkpoint or _export(tmp), tmp)


def _measure(args, batches, checkpoint, tmp):
  from trime_jax import data
  from trime_jax import generate as G
  from trime_jax.datastore import Datastore, build_datastore, build_index

  gen = G.Generator(checkpoint, log=lambda m: None)
  docs = data.stdlib_documents(400)
  text = b"".join(d for _, d in docs)
  store = gen.new_store()
  store.add(gen.keys_of(list(text[:args.store_tokens])), list(text[:args.store_tokens]))
  corpus = data.Corpus(np.frombuffer(text[-args.datastore_tokens:], np.uint8).astype(np.int32),
                       np.array([0, args.datastore_tokens]), gen.vocab)
  t0 = time.perf_counter()
  build_datastore(checkpoint, corpus, os.path.join(tmp, "ds"), progress=False)
  build_index(Datastore(os.path.join(tmp, "ds")), kind="flat", progress=False)
  print(f"datastore of {args.datastore_tokens:,} tokens built in {time.perf_counter() - t0:.1f} s", flush=True)
  external = gen.external(os.path.join(tmp, "ds"), k=args.knn_k)
  prompt = text[args.store_tokens:args.store_tokens + 96].decode("utf-8", errors="replace")

  print(f"backend: {jax.default_backend()}, model: {gen.cfg.num_layers} layers, D={gen.cfg.d_model}, "
        f"V={gen.cfg.vocab_size}, max_len={gen.cfg.max_len}; {args.new_tokens} new tokens, 96-byte prompts, "
        f"sampling T=1\n")
  print("| batch | memory | memories per token | tokens/s |")
  print("|---|---|---|---|")
  settings = [("none", {}, "0"), ("local", {}, "prompt + generated"),
              ("long", {"store": store}, f"local + {len(store):,} stored"),
              ("external", {"external": external}, f"local + top-{external.k} of {external.datastore.count:,}")]
  for b in batches:
    for kind, extra, what in settings:
      run = lambda: gen.generate([prompt] * b, max_new_tokens=args.new_tokens, memory=G.MemorySpec(kind),
                                 sampling=G.Sampling(1.0, seed=0), stop_at_eos=False, remember=False, **extra)
      run()  # compilation
      t = time.perf_counter()
      outs = run()
      dt = time.perf_counter() - t
      n = sum(len(o.tokens) for o in outs)
      print(f"| {b} | {kind} | {what} | {n / dt:,.0f} |", flush=True)


if __name__ == "__main__":
  run(main)
