"""The sharded TRIME loss on 8 virtual CPU devices equals the single-device loss (values, gradients, training).

The 8-device checks run in subprocesses (tests/sharded_check.py): this pytest process has already
initialised jax with one device. The three groups start together and run concurrently.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import two_process_env
from trime_jax import distributed, loss, sharding
from trime_jax import sharded_loss as SL
from trime_jax.errors import ConfigError
from trime_jax.steps import LossSpec

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
  """Start the loss, model, train and placed groups and the two processes of the multi-host check as subprocesses;
  `checks(name)` waits for one's JSON result."""
  workdir = str(tmp_path_factory.mktemp("sharded_train"))
  env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
  procs = {name: subprocess.Popen([sys.executable, os.path.join(HERE, "sharded_check.py"), name, workdir],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for name in ("loss", "model", "train", "placed", "datastore", "eval")}
  cluster = two_process_env(4)
  multihost = str(tmp_path_factory.mktemp("multihost"))
  for i in range(2):
    procs[f"process{i}"] = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "multiprocess_check.py"), multihost], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=dict(cluster, JAX_PROCESS_ID=str(i)))
  results = {}

  def get(name):
    if name not in results:
      out, err = procs[name].communicate(timeout=900)
      lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
      assert procs[name].returncode == 0 and lines, f"sharded_check.py {name} failed:\n{err[-4000:]}"
      results[name] = json.loads(lines[-1][len("RESULT "):])
    return results[name]

  yield get
  for p in procs.values():
    if p.poll() is None:
      p.kill()
      p.wait()


def test_every_memory_mode_and_variant_equals_trime_nll(checks):
  """float64, 8 devices × 3 rows: nll and d/d(logits, keys) equal `trime_nll` on the global batch, including
  drop_local per row and packed long-term runs (per-token document ids, halos across devices)."""
  cases = [c for c in checks("loss")["cases"] if c["memory_grad"] == "all"]
  covered = {(c["memory"], c["m"], c["drop_local"], c["variant"], c["stop_gradient_memory"]) for c in cases}
  for var in ("gather", "ring"):
    for mode in [("local", 1, False), ("long", 3, False), ("long", 2, False), ("long", 4, False),
                 ("long", 8, False), ("long", 24, False), ("ext", 1, False), ("ext", 1, True)]:
      assert (*mode, var, False) in covered
    assert ("ext", 1, False, var, True) in covered and ("ext", 1, True, var, True) in covered
    assert ("ext", 1, "rows", var, False) in covered  # drop_local per row, mixed on every device
    for m in (2, 3, 4, 8, 24):  # packed runs with document boundaries, aligned and across devices
      assert ("long", m, "documents", var, False) in covered
  for c in cases:
    assert c["value_err"] <= 1e-10 * max(1.0, abs(c["value"])), c
    assert c["grad_err"] <= 1e-10 * max(1.0, c["grad_scale"]), c
    assert c["grad_scale"] > 0.1, c  # the gradients compared are not trivially zero



def test_inputs_placed_on_the_mesh_are_accepted(checks):
  """Arrays a user of a mesh has — `jax.device_put(x, NamedSharding(mesh, P("data")))`, on a mesh with explicit
  axes (`jax.make_mesh`'s default) — eager and under jit: every memory kind and variant of sharded_trime_nll,
  the vocab-stats entry and sharded_memory_log_probs run (arrays built inside, like the per-query causal mask,
  are placed as the rows) and equal the single-device results."""
  cases = checks("placed")["cases"]
  got = {(c["mesh"], c["memory"], c["variant"], c["api"], c["how"]) for c in cases}
  for mem in ("none", "local", "long", "ext"):
    for var in ("gather", "ring"):
      for how in ("eager", "jit"):
        assert ("explicit", mem, var, "logits", how) in got
        assert ("explicit", "ext", var, "vocab_stats", how) in got
      assert ("auto", "ext", var, "logits", "jit") in got
  assert {("explicit", "log_probs", "-", "memory_log_probs", how) for how in ("eager", "jit")} <= got
  for c in cases:
    assert c["err"] <= 1e-5, c

def test_memory_topk_on_8_devices_equals_trime_nll(checks):
  """memory_topk (the original MT's --topk-mem) with the gather variant: each query's k most similar memories of
  the global batch, values and gradients as `trime_nll` with memory_topk; local_only changes key gradients only."""
  cases = checks("loss")["topk"]
  assert {(str(c["drop_local"]), c["memory_grad"]) for c in cases} == {
      (d, g) for d in ("False", "True", "rows") for g in ("all", "local_only")}
  for c in cases:
    assert c["value_err"] <= 1e-10 * max(1.0, abs(c["value"])), c
    assert c["logits_grad_err"] <= 1e-10 * max(1.0, c["grad_scale"]), c
    if c["memory_grad"] == "all":
      assert c["keys_grad_err"] <= 1e-10 * max(1.0, c["grad_scale"]), c
    else:
      assert c["keys_grad_err"] > 1e-3, c  # memories on other devices get no gradient
  assert min(c["grad_scale"] for c in cases) > 0.1
  assert "variant='gather'" in checks("loss")["ring_topk_error"]  # the ring cannot take a global top k
  long_topk = checks("loss")["long_topk"]
  assert long_topk["aligned_err"] <= 1e-10, long_topk  # runs inside each device's rows: the top k as trime_nll
  assert "runs that cross devices" in long_topk["crossing_error"], long_topk  # refused, not silently all memory


def test_a_learned_tau_gets_its_gradient_on_8_devices(checks):
  rows = checks("loss")["tau_grad"]
  assert {(r["memory"], r["variant"]) for r in rows} == {("long", "gather"), ("long", "ring"), ("ext", "gather"),
                                                         ("ext", "ring")}
  for r in rows:
    assert abs(r["reference"]) > 1e-3 and r["grad"] == pytest.approx(r["reference"], rel=1e-9), r


def test_local_only_cuts_exactly_the_cross_device_memory_gradients(checks):
  """memory_grad="local_only" equals a reference that stop-gradients every memory on another device than the
  query; it changes only key gradients, and only where memories cross devices."""
  cases = [c for c in checks("loss")["cases"] if c["memory_grad"] == "local_only"]
  assert {(c["memory"], c["m"], c["variant"]) for c in cases} >= {
      ("local", 1, "gather"), ("long", 3, "gather"), ("long", 2, "gather"), ("long", 8, "ring"),
      ("long", 24, "gather"), ("ext", 1, "gather"), ("ext", 1, "ring")}
  for c in cases:
    assert c["value_err"] <= 1e-10 * max(1.0, abs(c["value"])), c
    assert c["grad_err"] <= 1e-10 * max(1.0, c["grad_scale"]), c  # == the stop-gradient reference
    assert c["logits_grad_diff_vs_all"] <= 1e-10, c  # the vocabulary side is untouched
    if c["aligned"]:  # local, or runs that never leave a device: nothing to cut
      assert c["keys_grad_diff_vs_all"] <= 1e-10, c
    else:
      assert c["keys_grad_diff_vs_all"] > 0.1, c


def test_memory_grad_group_rows_on_8_devices_matches_reference(checks):
  """memory_grad_group_rows (the original's cut of key gradients at its GPUs' row groups) on 8 devices × 3 rows,
  gather and ring, with memory_grad all / local_only, ext and long runs (aligned and spanning devices): value
  and key gradients equal the float64 NumPy reference, which differs from the uncut gradient."""
  cases = checks("loss")["group_cut"]
  assert {(c["memory"], c["variant"], c["memory_grad"]) for c in cases} >= {
      ("ext", "gather", "all"), ("ext", "ring", "all"), ("ext", "gather", "local_only"),
      ("ext", "ring", "local_only"), ("long", "gather", "all"), ("long", "ring", "all")}
  for c in cases:
    assert c["value_err"] <= 1e-10 * max(1.0, abs(c["value"])), c
    assert c["keys_grad_err"] <= 1e-9 * max(1.0, c["grad_scale"]), c
    assert c["grad_scale"] > 0.1 and c["cut_vs_uncut"] > 1e-2 * c["grad_scale"], c  # the check can fail


def test_communication_only_where_memories_cross_devices(checks):
  """Collectives in forward + backward: none for local memory or runs that stay on a device; neighbour
  ppermutes for runs that span devices and for the ring; all-gather + reduce-scatter for the gather (no
  reduce-scatter when other devices' memories get no gradient)."""
  assert checks("loss")["collectives"] == {
      "local/1/gather/all": [],
      "long/3/ring/all": [],
      "long/2/gather/all": ["collective_permute"],
      "long/8/ring/all": ["collective_permute"],
      "ext/1/gather/all": ["all_gather", "reduce_scatter"],
      "ext/1/gather/local_only": ["all_gather"],
      "ext/1/ring/all": ["collective_permute"],
      "ext/1/ring/local_only": ["collective_permute"],
  }


def test_parameter_gradients_through_the_model_match(checks):
  """float32 TransformerLM, batch sharded over 8 devices, params replicated: d nll / d params (every leaf)
  equal the single-device computation for local, long (runs across devices), ext ± drop_local."""
  cases = checks("model")["cases"]
  covered = {(c["memory"], c["m"], c["drop_local"], c["variant"]) for c in cases}
  for var in ("gather", "ring"):
    for mode in [("local", 1, False), ("long", 2, False), ("long", 8, False), ("ext", 1, False),
                 ("ext", 1, True)]:
      assert (*mode, var) in covered
  for c in cases:
    assert c["n_leaves"] > 10, c
    assert c["value_err"] <= 2e-6 * abs(c["value"]), c
    assert c["grad_err"] <= 1e-5 * c["grad_scale"], c


def test_device_cut_rows_is_where_local_only_changes_the_gradient():
  """`sharded_loss.device_cut_rows`: rows per device where memory_grad='local_only' cuts a key gradient that would
  otherwise flow (what a resume on another device count must keep), 0 where the cut does not act."""
  from trime_jax.loss import ObjectiveSpec
  from trime_jax.sharded_loss import device_cut_rows

  ext, long = ObjectiveSpec(memory="ext"), ObjectiveSpec(memory="long", consecutive_segments=4)
  assert device_cut_rows(ext, "local_only", 16, 8) == 2 and device_cut_rows(ext, "local_only", 16, 4) == 4
  assert device_cut_rows(ext, "all", 16, 8) == device_cut_rows(ext, "local_only", 16, 1) == 0
  assert device_cut_rows(ObjectiveSpec(memory="ext", stop_gradient_memory=True), "local_only", 16, 8) == 0
  assert device_cut_rows(ObjectiveSpec(memory="local"), "local_only", 16, 8) == 0  # within a row
  assert device_cut_rows(long, "local_only", 16, 8) == 2  # runs of 4 rows span 2 devices
  assert device_cut_rows(long, "local_only", 16, 2) == 0  # whole runs on each device: nothing crosses
  # memory_grad_group_rows cuts by rows already: the device cut adds nothing where groups lie on one device
  assert device_cut_rows(ObjectiveSpec(memory="ext", memory_grad_group_rows=1), "local_only", 16, 8) == 0
  assert device_cut_rows(ObjectiveSpec(memory="ext", memory_grad_group_rows=4), "local_only", 16, 8) == 2


def test_training_on_8_devices_matches_1_device_step_for_step(checks):
  """`train_and_evaluate` (ext memory, drop-local draws, 2 micro-batches) on 8 devices: the metrics of every
  step match the 1-device run for gather and ring, and with every dropout on through hash masks; local_only (the
  original's gradients) does not."""
  result = checks("train")
  assert result["devices"] == 8
  runs = result["runs"]
  base = runs["1dev"]
  assert [m["step"] for m in base] == [1, 2, 3] and all(m["objective"] == "trime" for m in base)
  for name in ("8dev_gather", "8dev_ring"):
    assert [m["step"] for m in runs[name]] == [1, 2, 3]
    for a, b in zip(base, runs[name]):
      for key in ("loss", "ce_nll", "trime_nll", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=2e-5), (name, key, a, b)
  # Every dropout on with hash masks: 8 devices draw the 1-device run's masks (the same losses step for step),
  # and the masks acted (not the dropout-free losses).
  hashed, hashed8 = runs["1dev_dropout_hash"], runs["8dev_dropout_hash"]
  assert [m["step"] for m in hashed8] == [1, 2, 3]
  for a, b in zip(hashed, hashed8):
    for key in ("loss", "ce_nll", "trime_nll", "grad_norm"):
      assert b[key] == pytest.approx(a[key], rel=2e-5), ("8dev_dropout_hash", key, a, b)
  assert abs(hashed[0]["loss"] - base[0]["loss"]) > 1e-4 * base[0]["loss"]
  # Same first loss (same parameters), different gradients: proof the sharded loss is what is trained.
  lo = runs["8dev_local_only"]
  assert lo[0]["loss"] == pytest.approx(base[0]["loss"], rel=2e-5)
  assert abs(lo[0]["grad_norm"] - base[0]["grad_norm"]) > 0.05 * base[0]["grad_norm"]
  assert abs(lo[-1]["loss"] - base[-1]["loss"]) > 1e-5 * base[-1]["loss"]
  # ... so a resume on 4 devices of such a run on all 8 (train.num_devices=0), which would cut them every 4 rows
  # instead of 2, is refused (it ran on with another objective, nothing said)
  said = result["local_only_resumed_on_4"]
  assert len(said) == 2 and said[0].startswith("ConfigError: ") and (
      "'local_only' cut key gradients between devices every 2 rows when the run began, and would cut key gradients "
      "between devices every 4 rows on the 4 devices here: resuming would change the objective halfway. Resume on "
      "the device count it began with (train.num_devices=8)") in said[0], said
  assert said[1] == "ran", said  # the finished run's rerun on 4 devices trains nothing: not refused
  # The dev evaluations (eval.batch_size=4 streams on 1 device; on 8 devices 8 streams, one each: LMTask.dev_streams)
  dev = result["dev"]
  assert [d["step"] for d in dev["1dev"]] == [3] and [d["step"] for d in dev["8dev_ring"]] == [3]
  a, b = dev["1dev"][0], dev["8dev_ring"][0]
  assert sorted(k for k in a if k.endswith("_ppl")) == ["none_ppl", "trime_local(tau=1)_ppl"]
  assert a["tokens"] == b["tokens"] > 0
  assert set(map(tuple, result["dev_calls"]["1dev"])) == {(4, 1)}  # [streams, devices] of each dev evaluation
  assert set(map(tuple, result["dev_calls"]["8dev_ring"])) == {(8, 8)}
  for key in ("none_ppl", "trime_local(tau=1)_ppl"):
    assert b[key] == pytest.approx(a[key], rel=1e-4), (key, a, b)


def test_two_processes_slice_batches_share_the_loss_and_checkpoint(checks):
  """2 processes × 4 devices (jax.distributed, gloo): each loads only its half of the global batch; the
  sharded loss and key gradients across processes equal one process's `trime_nll`; orbax saves and restores
  a replicated state from both; `train_and_evaluate` across both (with a resume) matches 1 device."""
  results = [checks("process0"), checks("process1")]
  assert [r["rows"] for r in results] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  for r in results:
    assert r["devices"] == 8 and r["local_devices"] == 4
    assert r["batch_err"] == 0.0
    for name in ("ext_ring", "ext_gather", "long4_gather"):
      c = r[name]
      assert c["value_err"] <= 2e-6 * abs(c["value"]), (name, c)
      assert c["grad_err"] <= 1e-5 * c["grad_scale"], (name, c)
    assert r["restored_step"] == 7 and r["restore_err"] == 0.0 and r["restored_sharding_ok"]
  # train_and_evaluate across both processes (2 updates, resumed to 3) matches the 1-device run step for step.
  train, base = results[0]["train"], checks("train")["runs"]["1dev"]
  assert [m["step"] for m in train] == [1, 2, 3] and results[0]["export_ok"]
  for a, b in zip(base, train):
    for key in ("loss", "ce_nll", "trime_nll", "grad_norm"):
      assert b[key] == pytest.approx(a[key], rel=2e-5), (key, a, b)
  # Its dev evaluation: 8 streams (a multiple of the 8 devices), each process its 4 on its own 4 devices, the
  # 1-device run's perplexities; once per invocation that trained (the finished run's rerun reuses its line).
  for r in results:
    assert r["dev_calls"] == [[8, 4]] * 2, r["dev_calls"]
    assert r["from_chief"] == {"process": 0, "text": "ab", "x": [0.1, float("inf"), None]}
  assert [r["on_chief"] for r in results] == [10, None]
  assert results[0]["on_chief_error"] == ["ConfigError", "refused by process 0"]
  assert results[1]["on_chief_error"] == ["ChiefStopped", "process 0 stopped (ConfigError: refused by process 0)"]
  (a,), b = checks("train")["dev"]["1dev"], results[0]["dev"][-1]  # (the first invocation's end: update 2)
  assert [d["step"] for d in results[0]["dev"]] == [2, 3] and a["step"] == 3
  assert a["tokens"] == b["tokens"] > 0
  for key in ("none_ppl", "trime_local(tau=1)_ppl"):
    assert b[key] == pytest.approx(a[key], rel=1e-4), (key, a, b)


def test_two_processes_split_the_evaluation_streams(checks):
  """2 processes × 4 devices: `evaluate` with 4 streams runs 2 on each process (on 2 of its devices) and gathers
  what equals the evaluation computed whole on each process (3 streams): every point's nll (local, long-term
  and external memory, the cache, kNN-LM), every scored token's nll, the frequency buckets, the retrieval counts."""
  results = [checks("process0")["eval"], checks("process1")["eval"]]
  assert [r["share"] for r in results] == [[0, 2], [2, 4]]
  for r in results:
    assert r["rows_per_step"] == [2] and r["whole_rows"] == [3]  # each process computed its own 2 streams
    assert r["tokens"][0] == r["tokens"][1] > 1_000 and r["token_nll_nan"] == 0
    np.testing.assert_allclose(r["nll"][0], r["nll"][1], rtol=1e-5)
    assert r["token_nll_err"] <= 1e-4, r["token_nll_err"]
    assert r["bucket_tokens"][0] == r["bucket_tokens"][1] and r["bucket_nll_err"] <= 1e-5
    # retrieval counts: a near-tie may round the other way on another mesh
    assert np.abs(np.subtract(*r["hits"])).max() <= 1 and r["hits"][0][-1] > 0
  assert results[0]["nll"][0] == results[1]["nll"][0]  # every process returns the same gathered result
  # 8 streams over 3 windows: process 1's 4 streams have nothing to run; it still joins the gather
  assert results[0]["idle"]["rows_per_step"] == [4] and results[1]["idle"]["rows_per_step"] == []
  for r in results:
    idle = r["idle"]
    assert idle["tokens"][0] == idle["tokens"][1] == 48
    np.testing.assert_allclose(idle["nll"][0], idle["nll"][1], rtol=1e-5)
    assert idle["token_nll_err"] <= 1e-4, idle["token_nll_err"]


# ----------------------------------------------------------------------------------------------------------
# In this process (one device).
# ----------------------------------------------------------------------------------------------------------
def test_one_device_mesh_is_trime_nll_and_bad_options_raise():
  rng = np.random.default_rng(0)
  logits, keys = rng.normal(size=(4, 5, 6)), rng.normal(size=(4, 5, 3))
  targets = rng.integers(-1, 6, size=(4, 5))
  mesh = sharding.make_mesh(1)
  for variant in SL.VARIANTS:
    got = SL.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory="ext", variant=variant)
    np.testing.assert_array_equal(got, loss.trime_nll(logits, keys, targets, memory="ext"))
  with pytest.raises(ValueError, match="variant must be one of"):
    SL.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory="ext", variant="tree")
  with pytest.raises(ValueError, match="memory_grad must be one of"):
    SL.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory="ext", memory_grad="some")
  with pytest.raises(ValueError, match="consecutive_segments"):
    SL.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory="long", consecutive_segments=3)
  np.testing.assert_array_equal(  # memory_topk on one device: the dense top-k loss
      SL.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory="ext", memory_topk=2),
      loss.trime_nll(logits, keys, targets, memory="ext", memory_topk=2))
  with pytest.raises(ConfigError, match="sharded_variant"):
    LossSpec(loss.ObjectiveSpec("ext"), sharded_variant="tree")
  with pytest.raises(ConfigError, match="memory_grad"):
    LossSpec(loss.ObjectiveSpec("ext"), memory_grad="none")


def test_process_rows_and_global_array_on_one_process():
  """A single process holds every row; the global array equals the host batch."""
  mesh = sharding.make_mesh(1)
  sh = sharding.batch_sharding(mesh, batch_axis=1)
  np.testing.assert_array_equal(distributed.process_rows(sh, (2, 6, 3), axis=1), np.arange(6))
  x = np.arange(36, dtype=np.int32).reshape(2, 6, 3)
  arr = distributed.global_array(sh, x, x.shape)
  assert arr.shape == x.shape and arr.sharding == sh
  np.testing.assert_array_equal(np.asarray(arr), x)


def test_srupp_long_training_on_8_devices_matches_1_device(checks):
  """SRU++ with TrimeLM_long: rows (streams) sharded over 8 devices, each carrying its state and previous
  segment's keys; the per-update losses equal the 1-device run's."""
  losses = checks("train")["srupp"]
  assert len(losses["1"]) == 3
  np.testing.assert_allclose(losses["8"], losses["1"], rtol=1e-5)
  # each device holds its own rows' carry, in and out of every step (it was replicated: gathered every step)
  assert losses["carry_specs_8"] == [["in", ["data"]], ["out", ["data"]]]


def test_mt_training_on_8_devices_matches_1_device(checks):
  """TrimeMT_ext (external in-batch memory over target tokens, top-8 memories) with rows sharded over 8
  devices, padded and packed: the per-update losses (plain-CE warm-up, then TRIME) equal the 1-device run's."""
  losses = checks("train")["mt"]
  assert [o for o, _ in losses["1"]] == ["ce", "trime", "trime", "trime"]
  assert [o for o, _ in losses["8"]] == [o for o, _ in losses["1"]]
  np.testing.assert_allclose([v for _, v in losses["8"]], [v for _, v in losses["1"]], rtol=1e-5)
  # packed rows on 8 devices (pair ids gathered with the keys) = padded rows on 1 device
  np.testing.assert_allclose([v for _, v in losses["8packed"]], [v for _, v in losses["1"]], rtol=1e-5)


def test_the_originals_gpu_batches_are_the_devices_shards(checks):
  """data.batches_per_update=4 (configs/iwslt_de_en.py): on 4 devices with memory_grad="local_only" each device
  holds one of the update's GPU batches, padded or packed, and trains as 1 device with memory_grad_groups=4;
  without the cut the key gradients, and so the later losses, differ; 2 devices with local_only are refused."""
  losses = checks("train")["mt"]
  one = [v for _, v in losses["G4_1"]]
  assert len(one) == 4
  np.testing.assert_allclose([v for _, v in losses["G4_4"]], one, rtol=1e-5)
  np.testing.assert_allclose([v for _, v in losses["G4_4packed"]], one, rtol=1e-5)
  assert max(abs(a - b) for (_, a), b in zip(losses["G4_1_nocut"], one)) > 1e-4
  assert losses["G4_2"].startswith("ConfigError: trime.memory_grad='local_only' cuts key gradients between devices")


def test_the_datastore_key_pass_splits_over_the_devices(checks):
  """build_datastore(devices=8 / 0 = all): the forward batches split over the mesh (6 windows padded to 8 rows),
  the same keys as on one device (rows are independent) and the same values; meta.json records the count."""
  r = checks("datastore")
  assert r["count"] == 3_000 and r["values_equal"]
  assert r["devices"] == {"1": 1, "8": 8, "0": 8}
  assert all(r["keys_close"].values()), r  # float16 keys of float32 values equal up to their last bits
  assert all(f < 0.01 for f in r["keys_differing"].values()), r


def test_evaluation_splits_its_streams_over_the_devices(checks):
  """evaluate(mesh=) (eval.devices) with 8 streams on 8, 4 and all devices: every scored token's nll as on one
  device (local, cache, long-term, external memory from FAISS, also with eval.overlap_search, and on the devices,
  SRU++'s carried state) to 1e-5;
  each step's keys and store split by stream over the mesh (P('data')); neither jitted half gathers, permutes or
  exchanges anything but the step's sums (one all-reduce); counts that do not divide the streams are refused."""
  r = checks("eval")
  for case, errs in r["nll_err"].items():
    assert max(errs.values()) < 1e-5, (case, errs)
  for case, ppls in r["ppl"].items():
    for name, row in ppls.items():
      np.testing.assert_allclose(row, ppls["1"], rtol=1e-5, err_msg=f"{case} {name}")
    assert len(set(r["tokens"][case].values())) == 1 and r["tokens"][case]["1"] > 1000
  # trime_jax.load(devices=N).score: the texts' rows split over N devices, the same log-probabilities
  for memory, errs in r["api_err"].items():
    assert set(errs) == {"1", "4", "all"} and max(errs.values()) < 1e-5, (memory, errs)
  assert r["api_refusals"] == ["devices must be a device count >= 0 (0: all of this process's), got -1",
                               "devices=9 but this process sees 8 devices",
                               "devices must be a device count >= 0 (0: all of this process's), got 2.0"]
  for run, where in r["placed"].items():
    n = {"1": 1, "4": 4, "8": 8, "all": 8, "overlap": 8}[run.rsplit("_", 1)[1]]
    assert where == [[n, n, "P('data',)" if n > 1 else ""]], (run, where)
  for key, count in r["collectives"].items():
    single = key.split("/")[0].endswith("_1")
    assert count == (0 if single or key.endswith("forward_queries") else 1), (key, count)
  assert r["submesh"] == {"1": 1, "3": 3, "4": 4, "6": 6, "8": 8, "12": 6, "16": 8}
  # training's dev evaluation on 8 devices: a Transformer's streams rounded up to a multiple of 8 (its scores do
  # not depend on them), an SRU++ model's kept (part of its dev protocol) on as many devices as divide them
  assert r["dev_streams"] == {"transformer_1": [8, 8], "transformer_3": [8, 8], "transformer_4": [8, 8],
                              "transformer_8": [8, 8], "transformer_12": [16, 8], "srupp_1": [1, 1],
                              "srupp_3": [3, 3], "srupp_4": [4, 4], "srupp_8": [8, 8], "srupp_12": [12, 6]}
  # what launch.eval / eval_ext say when they evaluate on 1 of several devices (and not otherwise)
  assert r["devices_note"] == ["evaluating on 1 of this process's 8 devices: --config.eval.devices=0 splits the "
                               "streams over all of them (eval.batch_size=4 then a multiple of 8; the same scores)",
                               None]
  assert r["refusals"] == [
      "eval.batch_size=6 streams do not split over eval.devices=8 devices: make it a multiple of 8 (a "
      "Transformer's scores do not depend on the number of streams)",
      "eval.devices=9 but this process sees 8 devices",
      "eval.devices must be a device count >= 0 (0: all of this process's), got -1",
      "8 evaluation streams (eval.batch_size) do not split over the mesh's 3 devices (eval.devices): make them a "
      "multiple of 3"]
