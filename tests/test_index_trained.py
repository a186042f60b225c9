"""build_index(trained_index=...): an IVF-PQ index whose quantizers were trained elsewhere (the original
release's build_dstore.py writes `knn.index.ip.trained`); only the keys are added. tests/test_oracle.py uses it
with the original's own trained file; here the contract on small random keys."""

import json
import os

import faiss
import numpy as np
import pytest

from trime_jax.datastore import Datastore, KnnIndex, build_index
from trime_jax.datastore import build as B
from trime_jax.errors import ConfigError

N, D = 4000, 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  """A datastore directory written with the builder's own writer (random float32 keys, no model needed)."""
  out = str(tmp_path_factory.mktemp("trained") / "ds")
  rng = np.random.default_rng(0)
  keys = rng.standard_normal((N, D)).astype(np.float32)
  values = rng.integers(0, 50, N).astype(np.int32)
  writer = B.DatastoreWriter(out, {"format": B.FORMAT, "count": N, "dimension": D, "key_dtype": "float32",
                                   "value_dtype": "int32", "checkpoint_fingerprint": "none",
                                   "vocab_fingerprint": "none", "corpus_fingerprint": "random", "key_type": "random",
                                   "block_len": 8, "context_window": 4})
  k, v = writer.open()
  k[:], v[:] = keys, values
  writer.commit(0.0, tokens_done=N)
  writer.finish()
  return Datastore(out), keys


def _trained(path, d=D, metric=faiss.METRIC_INNER_PRODUCT, train_keys=None, add=False):
  index = faiss.IndexIVFPQ(faiss.IndexFlatIP(d), d, 16, 4, 6, metric)
  rng = np.random.default_rng(1)
  sample = train_keys if train_keys is not None else rng.standard_normal((2000, d)).astype(np.float32)
  index.train(sample)
  if add:
    index.add(sample[:10])
  faiss.write_index(index, path)
  return index


def test_trained_index_gets_the_keys_and_searches_as_the_same_index_built_in_one_go(store, tmp_path):
  ds, keys = store
  trained = str(tmp_path / "knn.index.ip.trained")
  ref = _trained(trained, train_keys=keys[:2000])
  built = build_index(ds, str(tmp_path / "index.faiss"), trained_index=trained, progress=False)
  info = json.load(open(str(tmp_path / "index.faiss.json")))
  assert info["index_type"] == "ivfpq" and (info["nlist"], info["pq_m"], info["pq_bits"]) == (16, 4, 6)
  assert info["trained_from"] == os.path.abspath(trained) and info["trained_digest"] == B.file_digest(trained)
  ref.add(keys)  # what the original's build_dstore.py does after reading the .trained file
  queries = keys[:64] + 0.01
  ref.nprobe = 8
  want = ref.search(queries, 10)
  got = KnnIndex.load(str(tmp_path / "index.faiss"), datastore=ds).search(queries, 10, nprobe=8)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])
  assert built.kind == "ivfpq"


@pytest.mark.parametrize("case,message", [
    ("dimension", "its dimension is 8, the datastore's 16"),
    ("metric", "its metric is not inner product"),
    ("untrained", "it is not trained"),
    ("filled", "it already holds 10 keys"),
    ("flat", "it is an IndexFlatIP, not an IndexIVFPQ"),
    ("text", "cannot be read by faiss"),
])
def test_an_unusable_trained_index_is_one_clear_error(store, tmp_path, case, message):
  ds, _ = store
  path = str(tmp_path / "t.index")
  if case == "dimension":
    _trained(path, d=8)
  elif case == "metric":
    _trained(path, metric=faiss.METRIC_L2)
  elif case == "untrained":
    faiss.write_index(faiss.IndexIVFPQ(faiss.IndexFlatIP(D), D, 16, 4, 6, faiss.METRIC_INNER_PRODUCT), path)
  elif case == "filled":
    _trained(path, add=True)
  elif case == "flat":
    faiss.write_index(faiss.IndexFlatIP(D), path)
  else:
    with open(path, "w") as f:
      f.write("not an index\n")
  out = str(tmp_path / "index.faiss")
  with pytest.raises(ConfigError, match=message):
    build_index(ds, out, trained_index=path, progress=False)
  assert not os.path.exists(out)


def test_an_l2_trained_index_fills_an_l2_index_and_the_metrics_must_agree(store, tmp_path):
  """build_dstore.py --dist l2 writes `knn.index.l2.trained` (L2 coarse quantizer, METRIC_L2): build_index(...,
  metric="l2") fills it, and refuses a trained index of the other metric (either way round)."""
  ds, keys = store
  l2 = str(tmp_path / "knn.index.l2.trained")
  ref = faiss.IndexIVFPQ(faiss.IndexFlatL2(D), D, 16, 4, 6, faiss.METRIC_L2)
  ref.train(keys[:2000])
  faiss.write_index(ref, l2)
  out = str(tmp_path / "index_l2.faiss")
  built = build_index(ds, out, trained_index=l2, metric="l2", progress=False)
  assert built.metric == "l2" and json.load(open(out + ".json"))["metric"] == "l2"
  ref.add(keys)
  queries = keys[:32] + 0.01
  ref.nprobe = 8
  want_d, want_i = ref.search(queries, 10)
  got_s, got_i = KnnIndex.load(out, datastore=ds, metric="l2").search(queries, 10, nprobe=8)
  np.testing.assert_array_equal(got_i, want_i)
  np.testing.assert_array_equal(got_s, -want_d)  # scores -|q - k|², best first
  with pytest.raises(ConfigError, match="its metric is not inner product"):
    build_index(ds, str(tmp_path / "ip.faiss"), trained_index=l2, progress=False)
  ip = str(tmp_path / "ip.trained")
  _trained(ip)
  with pytest.raises(ConfigError, match="its metric is not L2"):
    build_index(ds, str(tmp_path / "l2b.faiss"), trained_index=ip, metric="l2", progress=False)


_REAL_ADD = faiss.IndexIVFPQ.add


class _Interrupt:
  """faiss.IndexIVFPQ's `add` that raises KeyboardInterrupt (Ctrl-C between two adds) after `after` calls;
  counts the keys every call adds."""

  def __init__(self, monkeypatch, after=None):
    self.calls, self.after, real = [], after, _REAL_ADD

    def add(index, x):
      if self.after is not None and len(self.calls) == self.after:
        raise KeyboardInterrupt
      self.calls.append(len(x))
      return real(index, x)

    monkeypatch.setattr(faiss.IndexIVFPQ, "add", add)


def test_an_interrupted_ivfpq_build_resumes_without_retraining_to_the_uninterrupted_index(store, tmp_path,
                                                                                         monkeypatch, capsys):
  ds, keys = store
  out = str(tmp_path / "index.faiss")
  kw = dict(kind="ivfpq", nlist=16, pq_m=4, pq_bits=6, save_every_s=0.0)  # adds of N / 20 = 200 keys
  hook = _Interrupt(monkeypatch, after=3)
  with pytest.raises(KeyboardInterrupt):
    build_index(ds, out, **kw)
  assert hook.calls == [200] * 3 and not os.path.exists(out) and not os.path.exists(out + ".json")
  state = json.load(open(out + ".partial.json"))
  assert state["ntotal"] == 600 and state["belongs_to"]["datastore_fingerprint"] == ds.fingerprint
  assert state["file"] == "index.faiss.partial.600" and sorted(os.listdir(tmp_path)) == [
      "index.faiss.partial.600", "index.faiss.partial.json", "index.faiss.trained.0", "index.faiss.trained.json"]
  assert state["train_seconds"] > 0 and state["add_seconds"] > 0
  trained = faiss.read_index(out + ".trained.0")
  assert trained.is_trained and trained.ntotal == 0
  # The rerun: no training, only the 3,400 keys not yet added.
  hook = _Interrupt(monkeypatch)
  monkeypatch.setattr(faiss.IndexIVFPQ, "train", lambda *a: pytest.fail("the resumed build trained again"))
  capsys.readouterr()
  built = build_index(ds, out, **kw)
  assert "600 of 4,000 keys already added" in capsys.readouterr().out
  assert hook.calls == [200] * 17 and built.index.ntotal == N
  assert sorted(os.listdir(tmp_path)) == ["index.faiss", "index.faiss.json"]  # the states are gone
  assert built.info["train_seconds"] == state["train_seconds"] and built.info["add_seconds"] > state["add_seconds"]
  trained.add(keys)  # the same quantizers, every key in one go
  queries = keys[:64] + 0.01
  trained.nprobe = 8
  want = trained.search(queries, 10)
  got = KnnIndex.load(out, datastore=ds).search(queries, 10, nprobe=8)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])


def test_a_trained_state_is_reused_and_one_of_other_parameters_is_not(store, tmp_path, monkeypatch, capsys):
  ds, _ = store
  out = str(tmp_path / "index.faiss")
  kw = dict(kind="ivfpq", nlist=16, pq_m=4, pq_bits=6, save_every_s=1e9)
  _Interrupt(monkeypatch, after=0)  # Ctrl-C before the first add: only the trained state
  with pytest.raises(KeyboardInterrupt):
    build_index(ds, out, **kw)
  assert os.path.exists(out + ".trained.json") and not os.path.exists(out + ".partial.json")
  # Other parameters (nlist 8): the state is said to be ignored and the build trains its own.
  trains = []
  real_train = faiss.IndexIVFPQ.train
  monkeypatch.setattr(faiss.IndexIVFPQ, "train", lambda index, x: trains.append(len(x)) or real_train(index, x))
  _Interrupt(monkeypatch, after=0)
  capsys.readouterr()
  with pytest.raises(KeyboardInterrupt):
    build_index(ds, out, **dict(kw, nlist=8))
  assert "ignoring" in capsys.readouterr().out and trains == [N]
  assert json.load(open(out + ".trained.json"))["belongs_to"]["nlist"] == 8
  # The same parameters as the state now on disk: reused, not retrained, and the build finishes.
  _Interrupt(monkeypatch)
  built = build_index(ds, out, **dict(kw, nlist=8))
  assert "trained quantizers, no keys yet" in capsys.readouterr().out and trains == [N]
  assert built.info["nlist"] == 8 and built.index.ntotal == N and not os.path.exists(out + ".trained.json")


def test_a_damaged_partial_state_is_not_used(store, tmp_path, monkeypatch, capsys):
  ds, _ = store
  out = str(tmp_path / "index.faiss")
  kw = dict(kind="ivfpq", nlist=16, pq_m=4, pq_bits=6, save_every_s=0.0)
  _Interrupt(monkeypatch, after=2)
  with pytest.raises(KeyboardInterrupt):
    build_index(ds, out, **kw)
  saved = out + ".partial.400"
  with open(saved, "r+b") as f:  # a byte flipped inside the saved index
    f.seek(os.path.getsize(saved) // 2)
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ 0xFF]))
  hook = _Interrupt(monkeypatch)
  capsys.readouterr()
  built = build_index(ds, out, **kw)
  printed = capsys.readouterr().out
  assert "ignoring" in printed and "damaged" in printed and "trained quantizers" in printed
  assert sum(hook.calls) == N and built.index.ntotal == N


def test_a_flat_index_larger_than_the_machines_memory_is_refused_before_anything_is_read(store, tmp_path,
                                                                                       monkeypatch):
  from trime_jax.datastore import index as I

  ds, _ = store
  monkeypatch.setattr(I, "host_memory_bytes", lambda: N * D * 4 - 1)
  out = str(tmp_path / "index.faiss")
  with pytest.raises(ConfigError, match=r"exact \(flat\) index of 4,000 x 16 keys .* --index=ivfpq"):
    build_index(ds, out, kind="flat", progress=False)
  assert not os.listdir(tmp_path)
  monkeypatch.setattr(I, "host_memory_bytes", lambda: N * D * 4)
  assert build_index(ds, out, kind="flat", progress=False).index.ntotal == N


def test_reuse_keeps_an_intact_index_of_the_same_parameters_and_rebuilds_anything_else(store, tmp_path,
                                                                                      monkeypatch, capsys):
  ds, _ = store
  out = str(tmp_path / "index.faiss")
  kw = dict(kind="ivfpq", nlist=16, pq_m=4, pq_bits=6, reuse=True)
  first = build_index(ds, out, **kw)
  hook = _Interrupt(monkeypatch)
  capsys.readouterr()
  again = build_index(ds, out, **kw)  # the rerun of the same command: nothing trained or added
  assert hook.calls == [] and "kept" in capsys.readouterr().out
  assert again.info == first.info
  other = build_index(ds, out, **dict(kw, nlist=8))  # other parameters: built again
  assert "other nlist" in capsys.readouterr().out and sum(hook.calls) == N and other.info["nlist"] == 8
  with open(out, "r+b") as f:  # damaged: built again
    f.seek(100)
    b = f.read(1)
    f.seek(100)
    f.write(bytes([b[0] ^ 0xFF]))
  hook.calls.clear()
  build_index(ds, out, **dict(kw, nlist=8))
  assert "cannot be kept" in capsys.readouterr().out and sum(hook.calls) == N
  hook.calls.clear()
  build_index(ds, out, **dict(kw, nlist=8, reuse=False))  # the library's default: build what was asked
  assert sum(hook.calls) == N


def test_a_second_ctrl_c_while_saving_keeps_the_previous_state_and_a_failed_save_does_not_stop_the_build(
    store, tmp_path, monkeypatch, capsys):
  import errno

  from trime_jax.datastore import index as I

  ds, _ = store
  out = str(tmp_path / "index.faiss")
  kw = dict(kind="ivfpq", nlist=16, pq_m=4, pq_bits=6, save_every_s=1e9)  # saves only at Ctrl-C
  _Interrupt(monkeypatch, after=3)
  with pytest.raises(KeyboardInterrupt):
    build_index(ds, out, **kw)
  assert I.saved_state(out) == "600 keys added (index.faiss.partial)"
  real_write = faiss.write_index

  def write(index, path, fail=KeyboardInterrupt):
    if ".partial." in path:
      real_write(index, path)  # part of the file is on disk when the second Ctrl-C comes
      raise fail
    return real_write(index, path)

  monkeypatch.setattr(faiss, "write_index", write)
  _Interrupt(monkeypatch, after=2)  # resumed at 600, Ctrl-C at 1,000, and again while that state is written
  with pytest.raises(KeyboardInterrupt):
    build_index(ds, out, **kw)
  assert json.load(open(out + ".partial.json"))["file"] == "index.faiss.partial.600"
  assert not [f for f in os.listdir(tmp_path) if ".tmp." in f or f.endswith(".1000")]
  # A periodic save that fails (full disk): one warning, the build goes on from the state it resumed.
  monkeypatch.setattr(faiss, "write_index", lambda index, path: write(
      index, path, OSError(errno.ENOSPC, "No space left on device")))
  hook = _Interrupt(monkeypatch)
  capsys.readouterr()
  built = build_index(ds, out, **dict(kw, save_every_s=0.0))
  io = capsys.readouterr()
  assert "600 of 4,000 keys already added" in io.out and sum(hook.calls) == N - 600 and built.index.ntotal == N
  assert io.err.count("warning: could not save the partial index") == 16  # after each add but the last
  assert sorted(os.listdir(tmp_path)) == ["index.faiss", "index.faiss.json"]
  assert I.saved_state(out).startswith("nothing of the index")


_FSIZE_BUILD = """
import errno, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of killing us
from trime_jax.datastore import Datastore, build_index
ds, out, limit = Datastore(sys.argv[1]), sys.argv[2], int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
  build_index(ds, out, kind="ivfpq", nlist=16, pq_m=4, pq_bits=6, save_every_s=0.0, progress=False)
  print("built")
except OSError as e:
  print("OSError", errno.errorcode.get(e.errno), e.filename)
"""


def test_a_real_failed_faiss_write_is_an_oserror_periodic_saves_warn_and_the_last_good_state_stays(store, tmp_path):
  """faiss reports a write that does not fit as a RuntimeError (no errno). A file size limit (ulimit -f: EFBIG,
  one of the no-space errnos) makes faiss itself fail: each periodic save of the partial index that does not fit
  is one warning and the build goes on; the final index that does not fit is an OSError naming the file (the
  CLIs' one no-space line); the last state that fitted stays for a resume."""
  import subprocess
  import sys

  ds, _ = store
  out = str(tmp_path / "index.faiss")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}
  p = subprocess.run([sys.executable, "-c", _FSIZE_BUILD, ds.directory, out, "30000"], capture_output=True,
                     text=True, env=env, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.split() == ["OSError", "EFBIG", out], p.stdout + p.stderr[-2000:]
  warnings = [l for l in p.stderr.splitlines() if l.startswith("warning: could not save the partial index")]
  assert warnings and all("File too large" in l for l in warnings), p.stderr[-2000:]
  state = json.load(open(out + ".partial.json"))
  assert 0 < state["ntotal"] < N and os.path.exists(os.path.join(tmp_path, state["file"]))
  assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]
  built = build_index(ds, out, kind="ivfpq", nlist=16, pq_m=4, pq_bits=6, save_every_s=0.0, progress=False)
  assert built.index.ntotal == N  # resumed from that state without the limit


def test_ctrl_c_whose_save_fails_still_stops_the_build_as_an_interrupt(store, tmp_path, monkeypatch, capsys):
  ds, _ = store
  out = str(tmp_path / "index.faiss")
  real_write = faiss.write_index

  def write(index, path):
    if ".partial." in path:  # faiss's own message for a failed fwrite
      raise RuntimeError(f"Error in void faiss::write_InvertedLists(...) at index_write.cpp:342: Error: 'ret == (n)' "
                         f"failed: write error in {path}: 171 != 4096 (No space left on device)")
    return real_write(index, path)

  monkeypatch.setattr(faiss, "write_index", write)
  _Interrupt(monkeypatch, after=3)
  capsys.readouterr()
  with pytest.raises(KeyboardInterrupt):
    build_index(ds, out, kind="ivfpq", nlist=16, pq_m=4, pq_bits=6, save_every_s=1e9)
  err = capsys.readouterr().err
  assert "warning: could not save the partial index" in err and "No space left on device" in err, err
  assert not os.path.exists(out + ".partial.json") and os.path.exists(out + ".trained.json")


def test_a_build_resumes_and_its_index_is_kept_after_the_trained_file_or_the_datastore_moved(store, tmp_path,
                                                                                            monkeypatch, capsys):
  """Where the trained file and the datastore lie is no part of what a build made (their digest and fingerprint
  say which they are): a resume after either moved (WikiText-103's adding takes hours) goes on from the keys
  added, and a finished index is kept; until 2026-12-07 both paths were compared, so a rerun with the
  original's knn.index.ip.trained copied elsewhere threw the added keys away and started again."""
  ds, keys = store
  first = str(tmp_path / "first" / "knn.index.ip.trained")
  os.makedirs(os.path.dirname(first))
  _trained(first, train_keys=keys[:2000])
  out = str(tmp_path / "index.faiss")
  hook = _Interrupt(monkeypatch, after=3)
  with pytest.raises(KeyboardInterrupt):
    build_index(ds, out, trained_index=first, save_every_s=0.0, progress=False)
  assert json.load(open(out + ".partial.json"))["ntotal"] == 600
  moved = str(tmp_path / "moved.trained")
  os.rename(first, moved)
  moved_ds = str(tmp_path / "moved_ds")  # the datastore's directory moved too (e.g. to a larger disk)
  os.rename(ds.directory, moved_ds)
  try:
    ds2 = Datastore(moved_ds)
    hook = _Interrupt(monkeypatch)
    capsys.readouterr()
    built = build_index(ds2, out, trained_index=moved, reuse=True)
    said = capsys.readouterr().out
    assert "600 of 4,000 keys already added" in said and "ignoring" not in said, said
    assert hook.calls == [200] * 17 and built.index.ntotal == N
    hook.calls.clear()
    again = build_index(ds2, out, trained_index=moved, reuse=True)  # the rerun of the same command
    assert hook.calls == [] and "kept" in capsys.readouterr().out and again.index.ntotal == N
  finally:
    os.rename(moved_ds, ds.directory)
