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

  # End to end across both hosts: train 2 updates, resume to 3 (orbax checkpoints written by both), export.
  # Process 0 writes metrics.jsonl; tests/test_sharded.py compares it with the 1-device run of sharded_check.
  from tests.helpers import TRAIN_MATCH, TRAIN_MATCH_CORPUS_BYTES
  from trime_jax.train import train_and_evaluate

  text = write_text_file(os.path.join(workdir, f"train_text{jax.process_index()}.bin"), TRAIN_MATCH_CORPUS_BYTES)
  run_dir = os.path.join(workdir, "train")
  for n in (2, 3):
    train_and_evaluate(tiny_config(text, **{**TRAIN_MATCH, "train.num_devices": 8, "train.num_steps": n,
                                            "train.checkpoint_every": 1}), run_dir)
  if jax.process_index() == 0:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      out["train"] = [m for m in map(json.loads, f) if "loss" in m]
    out["export_ok"] = os.path.exists(os.path.join(run_dir, "export", "meta.json"))
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
