"""TrimeMT_ext train step on packed rows (data.pack_len) vs padded rows, the same plan batches, one run.

BM25 (and random) batches mix sentence lengths, so a batch padded to its longest pair holds mostly padding;
packing puts several pairs in a row and computes the same objective (tests/test_mt_model.py). Reported: target
tokens per second of each layout over the same batches (interleaved), and the padded tokens per real token.

  python -m bench.mt_packing [--batches=6 --repeats=3 --order=bm25]
"""

import argparse
import functools
import json

import jax
import numpy as np
from flax import nnx

from bench.common import time_interleaved
from trime_jax.configs import ui_de_en
from trime_jax.runtime.optim import make_optimizer
from trime_jax.mt import batching
from trime_jax.mt import data as mt_data
from trime_jax.mt import model as mt_model
from trime_jax.mt import train as mt_train
from trime_jax import specs


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", type=int, default=6, help="plan batches timed (spread over the plan)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--order", default="bm25", choices=batching.ORDERS)
  ap.add_argument("--pack_len", type=int, default=128)
  args = ap.parse_args()
  c = ui_de_en.get_config()
  c.trime.update(memory="ext", batching=args.order)
  mt_data.resolve_data_path(c)
  vocab = mt_data.load_vocab(c)
  pairs = mt_data.load_parallel(c, "train", vocab)
  plan = batching.make_plan(pairs, order=args.order, max_tokens=int(c.data.max_tokens), seed=0,
                            bm25_k=int(c.trime.bm25_k), bm25_backend="numba")
  model = mt_model.build_mt_model(specs.mt_model_config(c, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size), 0)
  graphdef, params = nnx.split(model, nnx.Param)
  tx, _ = make_optimizer(c.train)
  state = {"step": np.int32(0), "params": params, "opt_state": tx.init(params)}
  spec = specs.objective_spec(c)
  step = jax.jit(functools.partial(mt_train.train_step, graphdef, tx, spec, True, 0, 0.0, None))
  key = jax.random.PRNGKey(0)
  picks = np.linspace(0, plan.num_batches - 1, args.batches).astype(int)
  fns, real, padded = {}, 0, {"padded": 0, "packed": 0}
  for i in picks:
    for name, pack_len in (("padded", 0), ("packed", args.pack_len)):
      b = jax.device_put(batching.collate_batch(pairs, plan, int(i), pack_len=pack_len))
      fns[f"{name}/{i}"] = functools.partial(step, state, b, key)
      padded[name] += int(b["targets"].size)
    real += int((np.asarray(b["targets"]) >= 0).sum())
  t = time_interleaved(fns, repeats=args.repeats, warmup=1)
  secs = {name: sum(v for k, v in t.items() if k.startswith(name + "/")) for name in ("padded", "packed")}
  out = {"order": args.order, "batches": len(picks), "target_tokens": real,
         "padded_target_positions": padded["padded"], "packed_target_positions": padded["packed"],
         "padded_s": round(secs["padded"], 3), "packed_s": round(secs["packed"], 3),
         "padded_tok_s": round(real / secs["padded"], 1), "packed_tok_s": round(real / secs["packed"], 1),
         "speedup": round(secs["padded"] / secs["packed"], 2)}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
