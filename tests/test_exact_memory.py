"""The sharded segment-sum distribution and exact on-device external memory (eval.datastore_on_device).

The 8-device checks run in a subprocess (tests/exact_memory_check.py): this pytest process has one device.
In this process: on-device evaluation equals FAISS flat top-K with K = the datastore size and the float64
brute force of tests/test_ext_eval.py.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.test_ext_eval import BLOCK, CTX, _brute_force, _key, setup  # noqa: F401 - `setup` is a fixture
from trime_jax import evaluate, exact_memory, knn, sharding
from trime_jax.errors import CheckpointError, ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
  """Started before this module's first test, so it runs while the in-process tests run; `eight_devices()`
  waits for its JSON result."""
  proc = subprocess.Popen([sys.executable, os.path.join(HERE, "exact_memory_check.py")], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))

  def result():
    out, err = proc.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exact_memory_check.py failed:\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])

  yield result
  if proc.poll() is None:
    proc.kill()
    proc.wait()


def _points(tau=0.8, tau_prime=2.0, lam_i=0.3, lam_k=0.25, theta=1.5):
  P = evaluate.Point
  return [evaluate.NONE, P("cache", cache_lambda=lam_k, cache_theta=theta), P("trime_local", tau=tau),
          P("trime", tau=tau),
          P("interp", tau=tau, tau_prime=tau_prime, knn_lambda=lam_i, interp_memory="all"),
          P("interp", tau=tau, tau_prime=tau_prime, knn_lambda=lam_i, interp_memory="external"),
          P("knnlm", knn_lambda=lam_k, knn_theta=theta), P("knnlm_cache", knn_lambda=lam_k, knn_theta=theta)]


def test_on_device_exact_equals_faiss_flat_with_k_the_datastore_and_brute_force(setup):  # noqa: F811
  s = setup
  store = exact_memory.load_datastore(s["ds"], sharding.make_mesh(1))
  assert store.count == len(s["train"]) and store.k == store.count
  np.testing.assert_array_equal(np.asarray(store.keys), np.asarray(s["ds"].keys))
  # Several settings per family: the exact path sums at every scale the points read (1/τ, 1/τ′, θ).
  points = _points() + [evaluate.Point("trime", tau=2.5), evaluate.Point("knnlm", knn_lambda=0.4, knn_theta=0.3),
                        evaluate.Point("interp", tau=1.3, tau_prime=0.5, knn_lambda=0.2, interp_memory="external")]
  run = lambda ext, streams: evaluate.evaluate(s["graphdef"], s["params"], s["dev"], points, block_len=BLOCK,
                                               context_window=CTX, streams=streams, external=ext)
  exact = run(store, 2)
  flat = run(knn.ExternalMemory(str(s["tmp"] / "ds"), checkpoint_dir=s["export"], k=10_000), 2)
  assert exact.tokens == flat.tokens == len(s["dev"])
  np.testing.assert_allclose([r.nll for r in exact.scores], [r.nll for r in flat.scores], rtol=1e-5)
  assert exact.retrieval_hits is None and exact.retrieval_accuracy() == {}
  assert store.search_seconds > 0 and store.queries > 0
  want, _ = _brute_force(s, 0.8, 2.0, 0.3, 0.25, 1.5)  # float64 over the whole datastore
  got = {_key(r.point): r.nll for r in exact.scores[:8]}
  for fam in want:
    assert got[fam] == pytest.approx(want[fam], rel=2e-5), fam
  # Streams do not matter.
  np.testing.assert_allclose([r.nll for r in run(store, 1).scores], [r.nll for r in exact.scores], rtol=1e-5)
  # With a long-term store (streams re-run warm-up windows to fill it): the same numbers as FAISS.
  long_run = lambda ext: evaluate.evaluate(s["graphdef"], s["params"], s["dev"], points, block_len=BLOCK,
                                           context_window=CTX, streams=2, external=ext,
                                           long_term=evaluate.StoreSpec(12, reset_at_documents=False, layout="disjoint"))
  calls = store.queries
  got, want = long_run(store), long_run(knn.ExternalMemory(str(s["tmp"] / "ds"), k=10_000))
  assert store.queries > calls
  np.testing.assert_allclose([r.nll for r in got.scores], [r.nll for r in want.scores], rtol=1e-5)
  assert got.scores[3].nll != pytest.approx(exact.scores[3].nll, rel=1e-4)  # the store changed trime's nll


def test_exact_external_log_probs_is_the_trime_distribution(setup):  # noqa: F811
  """The generation entry point: logits + every datastore entry at τ, against the float64 reference."""
  from tests import reference as ref

  s = setup
  store = exact_memory.load_datastore(s["ds"], sharding.make_mesh(1))
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(3, len(s["vocab"]))).astype(np.float32)
  q = rng.normal(size=(3, store.dimension)).astype(np.float32)
  lp = np.asarray(exact_memory.exact_external_log_probs(logits, q, store, tau=0.6))
  keys, values = np.asarray(s["ds"].keys, np.float64), np.asarray(s["ds"].values)
  for i in range(3):
    want = ref.distribution(logits[i], q[i], keys, values, np.ones(len(values), bool), 0.6)
    np.testing.assert_allclose(np.exp(lp[i]), want, rtol=2e-5, atol=1e-7)
  with pytest.raises(CheckpointError, match="dimension"):
    exact_memory.exact_external_log_probs(logits, q[:, :3], store)
  # the stored targets are checked against V once, at load (max_target), not read back at every call
  assert store.max_target == int(np.max(values))
  with pytest.raises(CheckpointError, match=rf"holds target id {store.max_target}, outside the model's vocabulary"):
    exact_memory.exact_external_log_probs(logits[:, :store.max_target], q, store)


def test_on_device_config_is_checked(setup, monkeypatch):  # noqa: F811
  s = setup
  e = s["cfg"].eval
  e.datastore = str(s["tmp"] / "ds")
  e.knn_gpu = True
  with pytest.raises(ConfigError, match="knn_gpu"):
    evaluate.on_device_datastore(e, s["export"])
  e.knn_gpu = False
  store = evaluate.on_device_datastore(e, s["export"])
  assert store.count == s["ds"].count
  # A device that reports its memory: a datastore that would not fit is refused up front.
  monkeypatch.setattr(exact_memory, "device_memory_limit", lambda device: 1000)
  with pytest.raises(ConfigError, match="GiB per device"):
    exact_memory.load_datastore(s["ds"], sharding.make_mesh(1))
  assert exact_memory.device_bytes(103_000_000, 1024, 8) == 12_875_000 * (2048 + 4)


def test_sharded_distribution_equals_float64_reference_on_8_devices(eight_devices):
  """float64, 8 devices: memory of 21 (padded to 24), 5 (three devices hold padding only) and 40 entries with
  whole shards invisible (by mask, by padding targets) and similarities in the hundreds; chunked and not; with
  and without a mask; a query with no visible memory; gradients; the on-device datastore's full distribution
  and the evaluation's log-sum-exp terms (an empty positive sum included); the datastore loader's placement."""
  r = eight_devices()
  assert r["devices"] == 8
  assert (r["m21"]["store_rows"], r["m5"]["store_rows"], r["m40"]["store_rows"]) == (24, 8, 40)
  assert r["m5"]["empty_positive"]
  for m in ("m21", "m5", "m40"):
    c = r[m]
    for name in ("chunk0", "chunk2", "vs_memory_log_probs", "no_mask", "exact_external_log_probs", "grad",
                 "no_memory_row_is_softmax", "sums_to_one"):
      assert c[name] <= 1e-12, (m, name, c)
    # The loader streams: a device's rows (3, 1, 5) come in reads of at most the 2-row chunk.
    assert c["load_same_placement"] and c["load_equal"], (m, c)
    assert c["load_largest_key_read"] == (1 if m == "m5" else 2), (m, c)
    for name in ("log_terms_chunk0", "log_terms_chunk3"):  # values up to ~|4 · sim| of several hundred
      assert c[name] <= 1e-11, (m, name, c)


def test_on_device_exact_with_local_families_at_scales_no_external_family_reads(setup):  # noqa: F811
  """The test pass after tuning scores only each group's best point: a local-only family (trime_local at its τ,
  the cache at its θ) reads no external sum, so the exact path must not look one up at its scale."""
  s = setup
  store = exact_memory.load_datastore(s["ds"], sharding.make_mesh(1))
  P = evaluate.Point
  points = [evaluate.NONE, P("trime_local", tau=0.7), P("cache", cache_lambda=0.3, cache_theta=1.1), P("trime", tau=2.5),
            P("interp", tau=2.5, tau_prime=0.5, knn_lambda=0.2, interp_memory="all"),
            P("knnlm", knn_lambda=0.4, knn_theta=0.3)]
  assert 1 / 0.7 not in evaluate.exact_scales(points) and 1.1 not in evaluate.exact_scales(points)
  run = lambda ext: evaluate.evaluate(s["graphdef"], s["params"], s["dev"], points, block_len=BLOCK,
                                      context_window=CTX, streams=2, external=ext)
  exact = run(store)
  flat = run(knn.ExternalMemory(str(s["tmp"] / "ds"), checkpoint_dir=s["export"], k=10_000))
  np.testing.assert_allclose([r.nll for r in exact.scores], [r.nll for r in flat.scores], rtol=1e-5)


def test_evaluate_checkpoint_with_datastore_on_device(setup, monkeypatch):  # noqa: F811
  """The config switch: eval.datastore_on_device=True gives the FAISS flat (K = datastore) numbers, without
  retrieval accuracy; the FAISS path stays the default."""
  import types

  s = setup
  splits = types.SimpleNamespace(train=s["train"], dev=s["dev"], get=lambda split: s["dev"])
  monkeypatch.setattr(evaluate.runner, "load_eval_data", lambda config, vocab: splits)  # what evaluate_checkpoint reads
  cfg = s["cfg"]
  assert cfg.eval.datastore_on_device is False  # the default
  cfg.eval.datastore, cfg.eval.knn_k, cfg.eval.knn_gpu = str(s["tmp"] / "ds"), 10_000, False
  faiss_out = evaluate.evaluate_checkpoint(cfg, s["export"], external_memory=True)
  cfg.eval.datastore_on_device = True
  exact_out = evaluate.evaluate_checkpoint(cfg, s["export"], external_memory=True)
  cfg.eval.datastore_on_device = False
  assert (faiss_out["index"], exact_out["index"]) == ("flat", "on_device_exact")
  assert exact_out["k"] == faiss_out["k"] == len(s["train"]) and exact_out["exact"]
  assert (faiss_out["search_queries"], exact_out["search_queries"]) == (4096, 0)  # the on-device search: no FAISS
  assert exact_out["retrieval_accuracy"] == {} and faiss_out["retrieval_accuracy"][f"top{min(faiss_out['k'], 1024)}"] > 0
  assert [r["variant"] for r in exact_out["rows"]] == [r["variant"] for r in faiss_out["rows"]]
  np.testing.assert_allclose([r["nll"] for r in exact_out["rows"]], [r["nll"] for r in faiss_out["rows"]],
                             rtol=1e-5)
  # Tuned on dev, then the best point per group on the split (the docs-wt run's path): the same choices.
  cfg.eval.tune, cfg.eval.split = True, "test"
  faiss_out = evaluate.evaluate_checkpoint(cfg, s["export"], external_memory=True)
  cfg.eval.datastore_on_device = True
  exact_out = evaluate.evaluate_checkpoint(cfg, s["export"], external_memory=True)
  cfg.eval.datastore_on_device, cfg.eval.tune, cfg.eval.split = False, False, "dev"
  assert [r["variant"] for r in exact_out["rows"]] == [r["variant"] for r in faiss_out["rows"]]
  np.testing.assert_allclose([r["nll"] for r in exact_out["rows"]], [r["nll"] for r in faiss_out["rows"]],
                             rtol=1e-5)
