"""One of two processes (4 CPU devices each) of a multi-host run, started by tests/test_sharded.py.

  JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i JAX_COORDINATOR_ADDRESS=localhost:PORT python tests/multiprocess_check.py DIR

Joins the cluster with `distributed.initialize_from_env` (gloo collectives on CPU), then on the 8-device
global mesh: loads only this host's rows of a training batch, computes the sharded TRIME loss and its key
gradients across the two processes, saves + restores an orbax checkpoint from both, and finally runs
`train_and_evaluate` end to end across both processes (2 updates, then resumed to 3). Prints one JSON object of
measured differences against the single-process computation (and process 0's training metrics).
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import json  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU

from trime_jax import distributed  # noqa: E402

assert distributed.initialize_from_env()

import numpy as np  # noqa: E402

from trime_jax import checkpoint as ckpt  # noqa: E402
from trime_jax import corpora, sharding  # noqa: E402
from trime_jax import loss as L  # noqa: E402
from trime_jax import sharded_loss  # noqa: E402
from trime_jax.train import BatchSource  # noqa: E402


def _shard_err(global_arr, full):
  """Max |difference| between this process's shards of `global_arr` and the same slices of `full`."""
  return max(float(np.abs(np.asarray(s.data) - full[s.index]).max()) for s in global_arr.addressable_shards)


def main(workdir):
  from tests.helpers import tiny_config, write_text_file

  mesh = sharding.make_mesh(0)
  out = {"process": jax.process_index(), "devices": jax.device_count(), "local_devices": jax.local_device_count()}

  # Per-host batch slices: this host loads its rows only; together they are the global batch.
  corpus = write_text_file(os.path.join(workdir, f"text{jax.process_index()}.bin"), 20_000)
  cfg = tiny_config(corpus, **{"train.batch_size": 8, "train.grad_accum": 2, "data.segment_len": 8})
  source = BatchSource(corpora.load_splits(cfg.data).train, cfg)
  data_sh = sharding.batch_sharding(mesh, batch_axis=1)
  shape = (2, 8, 8)
  rows = distributed.process_rows(data_sh, shape, axis=1)
  full = source(5)
  local = source(5, rows)
  batch = distributed.global_array(data_sh, local["targets"], shape)
  out["rows"] = rows.tolist()
  out["batch_err"] = _shard_err(batch, full["targets"])

  # The sharded loss across processes (ring and gather, a long run spanning devices) vs one process.
  rng = np.random.default_rng(0)
  b, l, d, v = 24, 5, 4, 5
  logits = rng.normal(size=(b, l, v))
  keys = rng.normal(size=(b, l, d)).astype(np.float32)
  targets = rng.integers(-1, v, size=(b, l)).astype(np.int32)
  stats = L.vocab_stats(logits.astype(np.float32), targets)
  rows_sh = sharding.batch_sharding(mesh, batch_axis=0)
  my_rows = distributed.process_rows(rows_sh, (b, l), axis=0)
  put = lambda x: distributed.global_array(rows_sh, np.asarray(x)[my_rows], x.shape)
  for name, variant, kw in [("ext_ring", "ring", dict(memory="ext")), ("ext_gather", "gather", dict(memory="ext")),
                            ("long4_gather", "gather", dict(memory="long", consecutive_segments=4))]:
    def sharded(k, lse, tgt, t):
      return sharded_loss.sharded_trime_nll_from_vocab_stats(L.VocabStats(lse, tgt), k, t, mesh=mesh, variant=variant,
                                                             **kw).sum()

    def single(k):
      return L.trime_nll_from_vocab_stats(stats, k, targets, **kw).sum()

    val, grad = jax.jit(jax.value_and_grad(sharded))(put(keys), put(stats.log_normalizer), put(stats.target_logit),
                                                     put(targets))
    ref_val, ref_grad = jax.jit(jax.value_and_grad(single))(keys)
    out[name] = {"value_err": abs(float(val) - float(ref_val)), "value": float(ref_val),
                 "grad_err": _shard_err(grad, np.asarray(ref_grad)), "grad_scale": float(np.abs(ref_grad).max())}

  # Orbax across hosts: both processes save a replicated state and restore it onto the mesh.
  state = jax.device_put({"step": np.int32(7), "w": np.arange(12, dtype=np.float32).reshape(3, 4)},
                         sharding.replicated(mesh))
  mgr = ckpt.manager(os.path.join(workdir, "checkpoints"), 2)
  ckpt.save(mgr, 7, state)
  mgr.wait_until_finished()
  step, restored = ckpt.restore_latest(mgr, ckpt.abstract(state))
  out["restored_step"] = step
  out["restore_err"] = _shard_err(restored["w"], np.arange(12, dtype=np.float32).reshape(3, 4))
  out["restored_sharding_ok"] = restored["w"].sharding == state["w"].sharding

  out["eval"] = check_eval(workdir)

  # End to end across both hosts: train 2 updates, resume to 3 (orbax checkpoints written by both), export.
  # Process 0 writes metrics.jsonl; tests/test_sharded.py compares it with the 1-device run of sharded_check,
  # the dev evaluation included (each process evaluating its share of the streams).
  from tests.helpers import TRAIN_MATCH, TRAIN_MATCH_CORPUS_BYTES
  from trime_jax import evaluate as evaluate_pkg
  from trime_jax.train import train_and_evaluate

  text = write_text_file(os.path.join(workdir, f"train_text{jax.process_index()}.bin"), TRAIN_MATCH_CORPUS_BYTES)
  run_dir = os.path.join(workdir, "train")
  original_evaluate, out["dev_calls"] = evaluate_pkg.evaluate, []

  def recording_evaluate(*args, **kwargs):  # the streams and devices training's dev evaluation asks for
    out["dev_calls"].append([kwargs["streams"], 1 if kwargs["mesh"] is None else kwargs["mesh"].size])
    return original_evaluate(*args, **kwargs)

  evaluate_pkg.evaluate = recording_evaluate
  for n in (2, 3, 3):  # the last: the finished run rerun, which reuses its final dev line on every process
    train_and_evaluate(tiny_config(text, **{**TRAIN_MATCH, "train.num_devices": 8, "train.num_steps": n,
                                            "train.checkpoint_every": 1}), run_dir)
  evaluate_pkg.evaluate = original_evaluate
  # process 0's decision, whatever the others hold (a longer or a shorter value)
  out["from_chief"] = distributed.from_chief({"process": jax.process_index(), "text": "ab" * (1 + 9 * jax.process_index()),
                                              "x": [0.1, float("inf"), None]})
  if jax.process_index() == 0:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      lines = [json.loads(line) for line in f if line.strip()]
    out["train"] = [m for m in lines if "loss" in m]
    out["dev"] = [m for m in lines if "none_ppl" in m]
    out["export_ok"] = os.path.exists(os.path.join(run_dir, "export", "meta.json"))
  # on_chief: process 0's value there, None on the others; its error raised on every process
  from trime_jax.errors import ConfigError, TrimeError

  out["on_chief"] = distributed.on_chief(lambda: jax.process_index() + 10)

  def refuse():
    raise ConfigError("refused by process 0")

  try:
    distributed.on_chief(refuse)
  except TrimeError as e:
    out["on_chief_error"] = [type(e).__name__, str(e)]
  print("RESULT " + json.dumps(out), flush=True)


class BruteForceMemory:
  """A datastore's exact top-K search in NumPy, standing in for a FAISS index (what `evaluate` reads of a
  `knn.ExternalMemory`): each process searches for its own queries."""

  def __init__(self, keys, values, k):
    self.keys, self.values, self.k, self.search_seconds = keys, values, k, 0.0
    self.dimension = keys.shape[1]

  def retrieve(self, queries):
    from trime_jax import knn, scoring

    sim = np.asarray(queries, np.float32) @ self.keys.T
    top = np.argsort(-sim, axis=1, kind="stable")[:, :self.k]
    return knn.Retrieved((np.take_along_axis(sim, top, 1) * scoring.static_scale(self.dimension, 1.0)).astype(
        np.float32), self.values[top].astype(np.int32))


def check_eval(workdir):
  """`evaluate` across the two processes (each its share of the streams, on 2 of its devices) against the same
  evaluation computed whole on every process (3 streams: not a multiple of the processes): local, long-term
  and external memory, the cache, per-token nll, frequency buckets and retrieval counts."""
  from flax import nnx

  from tests.helpers import tiny_config, write_text_file
  from trime_jax import evaluate, specs
  from trime_jax.evaluate import driver
  from trime_jax.model import TransformerLM

  text = write_text_file(os.path.join(workdir, f"eval_text{jax.process_index()}.bin"), 20_000)
  cfg = tiny_config(text, **{"model.max_len": 32})
  dev = corpora.load_splits(cfg.data).dev
  model = TransformerLM(specs.model_config(cfg, vocab_size=len(dev.vocab)), rngs=nnx.Rngs(3))
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(1)
  ext = BruteForceMemory(rng.normal(size=(300, cfg.model.d_model)).astype(np.float32),
                         rng.integers(0, len(dev.vocab), 300), k=16)
  points = (evaluate.NONE, evaluate.Point("trime_local", tau=1.0), evaluate.Point("trime", tau=1.5),
            evaluate.Point("cache", cache_lambda=0.2, cache_theta=0.5),
            evaluate.Point("knnlm", knn_lambda=0.25, knn_theta=1.0))
  buckets = rng.integers(0, 4, len(dev.vocab))
  rows = []
  original_forward = driver.forward_queries

  def counting_forward(graphdef, params, inputs, *args, **kwargs):  # the rows this process computes per step
    rows.append(int(inputs.shape[0]))
    return original_forward(graphdef, params, inputs, *args, **kwargs)

  driver.forward_queries = counting_forward
  res = {}
  # (streams, devices, tokens): 4 streams split 2 + 2; 8 streams over 3 windows leave process 1's 4 idle (its
  # share has no step to run); 3 streams, not a multiple of the processes, are computed whole on each process
  for streams, devices, tokens in ((4, 2, 2_000), (3, 1, 2_000), (8, 1, 48), (3, 1, 48)):
    rows.clear()
    r = evaluate.evaluate(graphdef, params, dev, points, block_len=32, context_window=16, streams=streams,
                          long_term=evaluate.StoreSpec(mem_size=64), external=ext, max_tokens=tokens,
                          word_buckets_V=buckets, per_token=True, search_queries=0,
                          mesh=sharding.eval_mesh(devices, streams))
    res[streams, tokens] = (r, sorted(set(rows)))
  driver.forward_queries = original_forward
  (split, split_rows), (whole, whole_rows) = res[4, 2_000], res[3, 2_000]
  (idle, idle_rows), (few, _) = res[8, 48], res[3, 48]
  return {"idle": {"rows_per_step": idle_rows, "tokens": [idle.tokens, few.tokens],
                   "nll": [[s.nll for s in idle.scores], [s.nll for s in few.scores]],
                   "token_nll_err": float(np.abs(idle.token_nll - few.token_nll).max())},
          "share": list(sharding.process_streams(4)), "rows_per_step": split_rows, "whole_rows": whole_rows,
          "tokens": [split.tokens, whole.tokens],
          "nll": [[s.nll for s in split.scores], [s.nll for s in whole.scores]],
          "token_nll_err": float(np.abs(split.token_nll - whole.token_nll).max()),
          "token_nll_nan": int(np.isnan(split.token_nll).sum()),
          "bucket_tokens": [split.bucket_tokens.tolist(), whole.bucket_tokens.tolist()],
          "bucket_nll_err": float(np.nanmax(np.abs(split.bucket_nll - whole.bucket_nll))),
          "hits": [split.retrieval_hits.tolist(), whole.retrieval_hits.tolist()]}


if __name__ == "__main__":
  main(sys.argv[1])
