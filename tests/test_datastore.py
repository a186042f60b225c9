"""Datastore builder / reader and FAISS indexes on a tiny exported model and a synthetic byte corpus."""

import json
import os
import shutil

import faiss
import jax
import numpy as np
import pytest
from flax import nnx

from trime_jax.configs import default
from trime_jax import exports
from trime_jax import data as D
from trime_jax import steps
from trime_jax.datastore import Datastore, KnnIndex, build, build_datastore, build_index, gpu_available, rescore
from trime_jax.errors import CheckpointError, ConfigError, DamagedCheckpointError
from trime_jax.model import TransformerLM
from trime_jax import specs

BLOCK, CONTEXT, BATCH = 16, 6, 3


def _corpus(n_docs=6, seed=0):
  rng = np.random.default_rng(seed)
  words = [b"alpha", b"beta", b"gamma", b"delta", b"omega", b"sigma", b"tau", b"phi"]
  docs = [b" ".join(words[i] for i in rng.integers(0, len(words), 100)) for _ in range(n_docs)]
  return D.Corpus.from_docs([np.frombuffer(d, np.uint8).astype(np.int32) for d in docs], D.Vocab.bytes(), "tiny")


def _export(directory, d_model=16, seed=0):
  c = default.get_config()
  c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.d_ff, c.model.max_len = 1, d_model, 2, 32, 32
  c.eval.block_len, c.eval.context_window, c.eval.batch_size = BLOCK, CONTEXT, BATCH
  vocab = D.Vocab.bytes()
  model = TransformerLM(specs.model_config(c, vocab_size=len(vocab)), rngs=nnx.Rngs(params=seed))
  _, params = nnx.split(model, nnx.Param)
  return exports.export(str(directory), params, c, vocab, extra={"step": 0})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("ds")
  export_dir = _export(root / "export")
  corpus = _corpus()
  out = str(root / "store")
  meta = build_datastore(export_dir, corpus, out, chunk_tokens=100, progress=False)
  return {"root": root, "export": export_dir, "corpus": corpus, "out": out, "meta": meta, "ds": Datastore(out)}


def _expected_keys(export_dir, corpus):
  """The keys the model computes for every target, with evaluation's windows (steps.forward, float32)."""
  graphdef, params, _, _, _ = exports.load_export(export_dir)
  wins = D.windows(len(corpus), BLOCK, CONTEXT)
  inputs, targets, scored = D.window_batch(corpus, wins, BLOCK)
  keys = jax.jit(lambda p, i, t: steps.forward(nnx.merge(graphdef, p), i, t)[1])(params, inputs, targets)
  return np.asarray(keys)[scored]


def test_contents_equal_model_keys(setup):
  ds, corpus = setup["ds"], setup["corpus"]
  assert ds.count == len(corpus) and ds.dimension == 16 and setup["meta"]["complete"]
  assert ds.keys.dtype == np.float16 and ds.values.dtype == np.int32
  np.testing.assert_array_equal(ds.values, corpus.tokens)
  expected = _expected_keys(setup["export"], corpus)
  assert expected.shape == ds.keys.shape
  np.testing.assert_allclose(np.asarray(ds.keys, np.float32), expected, rtol=2e-3, atol=2e-3)
  m = ds.meta
  assert (m["block_len"], m["context_window"], m["corpus_fingerprint"]) == (BLOCK, CONTEXT, corpus.fingerprint())
  assert m["checkpoint_fingerprint"] == exports.fingerprint(setup["export"])


@pytest.mark.parametrize("context_window,batch_size", [(CONTEXT, 1), (CONTEXT, BATCH), (0, BATCH)])
def test_original_entries_skip_the_first_window_as_eval_lm_does(setup, tmp_path, context_window, batch_size):
  """entries="original" holds what fairseq's eval_lm --save-knnlm-dstore saves: with a context window, its
  LMContextWindowDataset pads every row to S + context_window tokens, so the first (context-less) row's keys are
  longer than S and skipped whatever the batch size (a batch of one kept it); without one, nothing is padded and
  the first window is saved. Entries are the `all` datastore's from that position on."""
  stride = BLOCK - context_window
  meta = build_datastore(setup["export"], setup["corpus"], str(tmp_path / "orig"), context_window=context_window,
                         batch_size=batch_size, chunk_tokens=100, progress=False, entries="original")
  first = stride if context_window else 0
  assert meta.get("first_position", 0) == first
  full = len(setup["corpus"]) // stride * stride  # no partial last window
  ds = Datastore(str(tmp_path / "orig"))
  assert ds.count == full - first
  np.testing.assert_array_equal(ds.values, setup["corpus"].tokens[first:full])
  if context_window == CONTEXT:
    # the `all` store's keys (float16; another batch size may round a key's last bit otherwise)
    np.testing.assert_allclose(np.asarray(ds.keys, np.float32), np.asarray(setup["ds"].keys[first:full], np.float32),
                               rtol=2e-3, atol=1e-4)


def test_context_positions_stay_on_the_device(setup, tmp_path, monkeypatch):
  """Only a window's scored positions come back to the host: from the context window on for every batch after
  the first (whose first window scores from position 0), the same keys as the whole rows gave."""
  real, firsts = build._keys_step, []

  def spy(*args, first=0, **kwargs):
    out = real(*args, first=first, **kwargs)
    firsts.append((first, out.shape[1]))
    return out

  monkeypatch.setattr(build, "_keys_step", spy)
  build_datastore(setup["export"], setup["corpus"], str(tmp_path / "sliced"), chunk_tokens=100, progress=False)
  assert firsts[0] == (0, BLOCK) and set(firsts[1:]) == {(CONTEXT, BLOCK - CONTEXT)}
  monkeypatch.setattr(build, "_first_scored", lambda scored, context_window: 0)  # whole rows, as before
  build_datastore(setup["export"], setup["corpus"], str(tmp_path / "whole"), chunk_tokens=100, progress=False)
  np.testing.assert_array_equal(Datastore(str(tmp_path / "sliced")).keys, Datastore(str(tmp_path / "whole")).keys)


def test_the_next_batch_is_dispatched_before_the_last_one_is_read(setup, tmp_path, monkeypatch):
  """The key pass keeps the device busy: batch i + 1 is dispatched before batch i's keys are read back (a
  read right after each dispatch left the device idle while the host built the next batch and wrote the
  keys); the store is the same file."""
  real, events = build._keys_step, []

  class Pending:  # what np.asarray reads: the batch's keys, logged when read
    def __init__(self, out, i):
      self.out, self.i = out, i

    def __array__(self, dtype=None, copy=None):
      events.append(("read", self.i))
      return np.asarray(self.out)

  def spy(*args, **kwargs):
    i = sum(e[0] == "dispatch" for e in events)
    events.append(("dispatch", i))
    return Pending(real(*args, **kwargs), i)

  monkeypatch.setattr(build, "_keys_step", spy)
  out = str(tmp_path / "pipelined")
  build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
  _same_files(out, setup["out"])
  assert events[:4] == [("dispatch", 0), ("dispatch", 1), ("read", 0), ("dispatch", 2)]
  reads = [i for kind, i in events if kind == "read"]
  assert reads == sorted(reads) == list(range(len(reads))) and len(reads) == len(events) // 2


def _same_files(a, b):
  for name in ("keys.npy", "values.npy"):
    with open(os.path.join(a, name), "rb") as f, open(os.path.join(b, name), "rb") as g:
      assert f.read() == g.read(), name


def test_interrupted_build_resumes_to_the_same_store(setup, tmp_path):
  out = str(tmp_path / "resumed")
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, max_chunks=2, progress=False)
  assert not meta["complete"] and 0 < meta["tokens_done"] < len(setup["corpus"])
  with pytest.raises(CheckpointError, match="incomplete"):
    Datastore(out)
  done = meta["tokens_done"]  # stop_at_tokens: whole chunks until at least that many tokens are done
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, stop_at_tokens=done + 1,
                         progress=False)
  assert done + 1 <= meta["tokens_done"] < len(setup["corpus"]) and not meta["complete"]
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
  assert meta["complete"]
  _same_files(out, setup["out"])
  assert Datastore(out).fingerprint == setup["ds"].fingerprint


def test_crash_mid_chunk_resumes_to_the_same_store(setup, tmp_path, monkeypatch):
  out = str(tmp_path / "crashed")
  real, calls = build._keys_step, []

  def flaky(*args, **kwargs):
    calls.append(1)
    if len(calls) == 9:  # inside the third chunk (4 forward batches per chunk of 100 tokens)
      raise KeyboardInterrupt
    return real(*args, **kwargs)

  monkeypatch.setattr(build, "_keys_step", flaky)
  with pytest.raises(KeyboardInterrupt):
    build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
  with open(os.path.join(out, "meta.json")) as f:
    assert json.load(f)["tokens_done"] == 2 * 4 * BATCH * (BLOCK - CONTEXT)
  monkeypatch.setattr(build, "_keys_step", real)
  build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
  _same_files(out, setup["out"])


def test_a_build_stopped_after_its_last_chunk_but_before_finishing_resumes(setup, tmp_path, monkeypatch):
  """Every chunk saved, then finish() fails (a full disk writing meta.json, a Ctrl-C): the rerun has nothing to
  compute and finishes, although the corpus's end (tokens_done) is not a window boundary."""
  n, stride = len(setup["corpus"]), BLOCK - CONTEXT
  assert n % stride, "the case needs a partial last window"
  out = str(tmp_path / "unfinished")
  real = build.DatastoreWriter.finish

  def full_disk(self):
    raise OSError(28, "No space left on device", os.path.join(self.out_dir, "meta.json"))

  monkeypatch.setattr(build.DatastoreWriter, "finish", full_disk)
  with pytest.raises(CheckpointError, match=f"{n:,} of {n:,} tokens are saved: .* rerun the same command"):
    build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
  with open(os.path.join(out, "meta.json")) as f:
    saved = json.load(f)
  assert saved["tokens_done"] == n and not saved["complete"]
  monkeypatch.setattr(build.DatastoreWriter, "finish", real)
  keys_step = build._keys_step
  monkeypatch.setattr(build, "_keys_step", lambda *a, **k: pytest.fail("the rerun computed keys again"))
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
  monkeypatch.setattr(build, "_keys_step", keys_step)
  assert meta["complete"]
  _same_files(out, setup["out"])
  assert Datastore(out).fingerprint == setup["ds"].fingerprint


def test_a_resume_with_another_batch_size_says_so_and_records_it(setup, tmp_path, capsys):
  """Keys are computed in batches of windows: another batch size may round a float16 key differently, so the
  files would not be byte-identical to an uninterrupted build's. The rerun warns and meta.json records it."""
  out = str(tmp_path / "rebatched")
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, max_chunks=2, progress=False)
  assert meta["batch_size"] == BATCH
  capsys.readouterr()
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, batch_size=1, progress=False)
  printed = capsys.readouterr().out
  assert f"was started with batch size {BATCH} and resumes with 1" in printed, printed
  assert meta["complete"] and meta["batch_size"] == BATCH and meta["resumed_batch_sizes"] == [1]
  np.testing.assert_array_equal(Datastore(out).values, setup["ds"].values)
  np.testing.assert_allclose(np.asarray(Datastore(out).keys, np.float32), np.asarray(setup["ds"].keys, np.float32),
                             atol=1e-3)
  same = build_datastore(setup["export"], setup["corpus"], str(tmp_path / "again"), chunk_tokens=100, progress=False)
  assert "resumed_batch_sizes" not in same  # an undisturbed build records nothing


def test_resuming_says_how_much_it_verifies_first(setup, tmp_path, capsys):
  out = str(tmp_path / "verified")
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, max_chunks=2, progress=False)
  done = meta["tokens_done"]
  capsys.readouterr()
  build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=True)
  mib = done * (16 * 2 + 4) / 2**30
  assert f"checking the {done:,} saved entries ({mib:,.2f} GiB) against their digests" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["keys", "values"])
def test_chunk_damaged_before_resume_is_recomputed(setup, tmp_path, capsys, where):
  """A committed chunk changed between a kill and the rerun (issue 35.2): the rerun finds it by its recorded
  digest and recomputes it, instead of blessing the damage with the finished store's file digests."""
  out = str(tmp_path / f"damaged_{where}")
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, max_chunks=3, progress=False)
  assert len(meta["chunks"]) == 3 and not meta["complete"]
  a, b = meta["chunks"][1]["rows"]  # damage the second chunk: the first stays, the rest is redone
  arr = np.load(os.path.join(out, f"{where}.npy"), mmap_mode="r+")
  arr[(a + b) // 2] = arr[(a + b) // 2] + 1
  arr.flush()
  del arr
  capsys.readouterr()
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=True)
  printed = capsys.readouterr().out
  assert f"warning: datastore build in {out}: entries {a:,}..{b:,} were changed" in printed, printed
  assert f"recomputing from entry {a:,}" in printed
  assert meta["complete"] and "chunks" not in meta  # the whole-file digests supersede the chunk records
  _same_files(out, setup["out"])


def test_subset_of_a_damaged_build_is_refused(setup, tmp_path):
  from trime_jax.datastore import subset_datastore

  src = str(tmp_path / "partial")
  meta = build_datastore(setup["export"], setup["corpus"], src, chunk_tokens=100, max_chunks=2, progress=False)
  keys = np.load(os.path.join(src, "keys.npy"), mmap_mode="r+")
  keys[3] = keys[3] + 1
  keys.flush()
  del keys
  with pytest.raises(DamagedCheckpointError, match="entries 0..") as e:
    subset_datastore(src, str(tmp_path / "sub"), meta["tokens_done"])
  assert not os.path.exists(tmp_path / "sub"), e.value


def test_out_dir_of_another_datastore_is_refused(setup):
  with pytest.raises(CheckpointError, match="context_window"):
    build_datastore(setup["export"], setup["corpus"], setup["out"], context_window=4, progress=False)
  meta = build_datastore(setup["export"], setup["corpus"], setup["out"], progress=False)  # complete: no-op
  assert meta["complete"]


def test_corpus_with_another_vocabulary_is_refused(setup, tmp_path):
  words = D.Corpus.from_docs([np.arange(5)], D.Vocab(["</s>", "<unk>", "a", "b", "c"]), "words")
  with pytest.raises(CheckpointError, match="vocabulary"):
    build_datastore(setup["export"], words, str(tmp_path / "x"), progress=False)


def test_checkpoint_mismatch_is_a_clear_error(setup):
  ds = setup["ds"]
  ds.check_checkpoint(setup["export"])
  other = _export(setup["root"] / "export_d32", d_model=32)
  with pytest.raises(CheckpointError, match="dimension 16"):
    ds.check_checkpoint(other)
  with pytest.raises(CheckpointError, match="vocab_fingerprint"):
    ds.check(vocab_fingerprint="0123")


def test_flat_index_is_exact(setup, tmp_path):
  ds = setup["ds"]
  index = build_index(ds, str(tmp_path / "flat.faiss"), progress=False)
  assert index.kind == "flat"
  rng = np.random.default_rng(0)
  queries = rng.normal(size=(20, ds.dimension)).astype(np.float32)
  scores, ids = index.search(queries, 8)
  brute = queries @ np.asarray(ds.keys, np.float32).T
  expected = np.argsort(-brute, axis=1, kind="stable")[:, :8]
  np.testing.assert_allclose(scores, np.take_along_axis(brute, expected, 1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.take_along_axis(brute, ids, 1), scores, rtol=1e-5, atol=1e-5)
  exact, ids2 = rescore(ds, queries, ids)
  np.testing.assert_allclose(exact, scores, rtol=1e-5, atol=1e-5)
  loaded = KnnIndex.load(str(tmp_path / "flat.faiss"), datastore=ds)
  np.testing.assert_array_equal(loaded.search(queries, 8)[1], ids)


def test_a_flat_index_moves_to_a_gpu_in_float32_and_ivfpq_with_float16_tables(setup, tmp_path, monkeypatch):
  """eval.knn_gpu: faiss's useFloat16 makes IVF-PQ's lookup tables float16 (needed at 64 sub-quantizers), but
  on a flat index it stores the keys and casts the queries in float16: the exact index would not be exact (it
  was set for both). faiss's GPU calls are stood in for here (this faiss is CPU-only): what each index asks."""
  from trime_jax.datastore import index as index_mod

  asked = {}
  monkeypatch.setattr(index_mod, "gpu_available", lambda: True)
  monkeypatch.setattr(index_mod.faiss, "StandardGpuResources", lambda: object(), raising=False)
  monkeypatch.setattr(index_mod.faiss, "GpuClonerOptions", type("Options", (), {}), raising=False)

  def to_gpu(resources, device, index, options):
    asked[kind] = options.useFloat16
    return index

  monkeypatch.setattr(index_mod.faiss, "index_cpu_to_gpu", to_gpu, raising=False)
  for kind in ("flat", "ivfpq"):
    built = build_index(setup["ds"], str(tmp_path / f"{kind}.faiss"), kind=kind, nlist=4, pq_m=4, progress=False)
    assert built.to_gpu().on_gpu
  assert asked == {"flat": False, "ivfpq": True}


def test_ivfpq_builds_and_searches(setup, tmp_path):
  ds = setup["ds"]
  path = str(tmp_path / "ivfpq.faiss")
  # nlist and pq_m are clamped to the small store (pq_bits=4 keeps PQ training fast on 2 cores).
  index = build_index(ds, path, kind="ivfpq", nlist=4096, pq_m=64, pq_bits=4, progress=False)
  info = index.info
  assert info["index_type"] == "ivfpq" and info["pq_m"] == 16 and 1 <= info["nlist"] <= len(ds) // 39
  rng = np.random.default_rng(1)
  rows = rng.choice(len(ds), 50, replace=False)
  queries = np.asarray(ds.keys[rows], np.float32)
  index = KnnIndex.load(path, datastore=ds, nprobe=info["nlist"])
  scores, ids = index.search(queries, 32)
  assert ids.shape == (50, 32) and (ids >= 0).all() and (ids < len(ds)).all()
  exact, reranked = rescore(ds, queries, ids)
  assert (np.diff(exact, axis=1) <= 0).all()
  brute = queries @ np.asarray(ds.keys, np.float32).T
  # Approximate, but the true best inner product should be among the 32 candidates for most queries.
  assert np.mean(np.isclose(exact[:, 0], brute.max(1), rtol=1e-4, atol=1e-4)) >= 0.7
  assert index.search(queries, 4, nprobe=1)[1].shape == (50, 4)


def test_index_mismatches_are_clear_errors(setup, tmp_path):
  ds = setup["ds"]
  path = str(tmp_path / "flat.faiss")
  index = build_index(ds, path, progress=False)
  with pytest.raises(CheckpointError, match="dimension 16"):
    index.search(np.zeros((2, 8), np.float32), 3)
  other_out = str(tmp_path / "other")
  build_datastore(setup["export"], _corpus(n_docs=2, seed=5), other_out, progress=False)
  with pytest.raises(CheckpointError, match="not built over datastore"):
    KnnIndex.load(path, datastore=Datastore(other_out))
  os.remove(path + ".json")
  with pytest.raises(CheckpointError, match="incomplete"):
    KnnIndex.load(path)


def test_a_mistyped_index_path_beside_a_datastore_names_the_indexes_there(setup, tmp_path):
  """eval.index naming a file that is not there, in a datastore folder that has its index: the error names the
  index that is there (it said "the datastore has no index (built with --index=none?)" and told to rebuild it)."""
  out = str(tmp_path / "store")
  build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
  build_index(Datastore(out), progress=False)
  with pytest.raises(CheckpointError) as e:
    KnnIndex.load(os.path.join(out, "idnex.faiss"))
  msg = str(e.value)
  assert f"FAISS index not found: {out}/idnex.faiss" in msg and f"{out}/index.faiss" in msg, msg
  assert "has no index" not in msg and "--index=none" not in msg, msg
  # an interrupted build of the named index is said as such, not taken for a typo of the finished one
  with open(os.path.join(out, "big.faiss.partial"), "wb") as f:
    f.write(b"state")
  with pytest.raises(CheckpointError, match="its index build was stopped before the end"):
    KnnIndex.load(os.path.join(out, "big.faiss"))
  os.remove(os.path.join(out, "big.faiss.partial"))
  os.remove(os.path.join(out, "index.faiss.json"))  # no sidecar: not a finished index, so none is named
  with pytest.raises(CheckpointError, match="has no index"):
    KnnIndex.load(os.path.join(out, "idnex.faiss"))


@pytest.mark.skipif(gpu_available(), reason="a GPU build of faiss is present")
def test_gpu_export_without_gpu_support_says_so(setup, tmp_path):
  build_index(setup["ds"], str(tmp_path / "flat.faiss"), progress=False)
  with pytest.raises(ConfigError, match="GPU"):
    KnnIndex.load(str(tmp_path / "flat.faiss"), gpu=True)


def test_subset_is_the_prefix_and_a_datastore_of_its_own(setup, tmp_path):
  from trime_jax.datastore import subset_datastore

  src, n = setup["ds"], setup["ds"].count // 3
  out = str(tmp_path / "sub")
  meta = subset_datastore(setup["out"], out, n)
  sub = Datastore(out)  # complete, digests and fingerprint valid
  np.testing.assert_array_equal(sub.keys, src.keys[:n])
  np.testing.assert_array_equal(sub.values, src.values[:n])
  assert sub.count == n and meta["subset_of"] == src.fingerprint and sub.fingerprint != src.fingerprint
  sub.check_checkpoint(setup["export"])  # still the same model's keys
  assert subset_datastore(setup["out"], out, n)["fingerprint"] == meta["fingerprint"]  # rerun: no-op
  with pytest.raises(CheckpointError, match="different datastore"):
    subset_datastore(setup["out"], out, n - 1)
  # a plain build onto a subset: the message says how it was made
  with pytest.raises(CheckpointError, match=rf"it is the first {n:,} entries of another datastore \(built with "
                                            r"--subset_of and --entries\): rerun with those flags"):
    build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
  with pytest.raises(ConfigError, match="holds"):
    subset_datastore(setup["out"], str(tmp_path / "big"), src.count + 1)


def test_a_subset_on_a_full_disk_is_one_error_and_leaves_nothing(setup, tmp_path, monkeypatch):
  """The subset's files have their blocks reserved before they are written: a full disk is one error (not a
  SIGBUS halfway through a memmap write) and the half-made files are removed."""
  real, calls = os.posix_fallocate, []

  def full(fd, offset, length):
    calls.append(length)
    if len(calls) == 2:  # the keys fit, the values do not
      raise OSError(28, "No space left on device")
    return real(fd, offset, length)

  monkeypatch.setattr(os, "posix_fallocate", full)
  out = str(tmp_path / "sub_full")
  with pytest.raises(CheckpointError, match=r"no space left for the datastore subset .* need [0-9.]+ MiB; free space"):
    build.subset_datastore(setup["out"], out, 500)
  assert len(calls) == 2 and os.listdir(out) == []
  monkeypatch.setattr(os, "posix_fallocate", real)
  meta = build.subset_datastore(setup["out"], out, 500)
  assert meta["complete"] and Datastore(out).count == 500


def test_an_interrupted_subset_leaves_nothing_and_says_so(setup, tmp_path, monkeypatch, capsys):
  """Ctrl-C during the copy removes its full-size files (a copy has no chunks to resume from: it held the
  disk space and the CLI said it kept finished chunks); the CLI's message says the copy restarts."""
  from trime_jax.launch import build_datastore as cli  # defines its absl flags: no other test imports it

  real, calls = os.posix_fallocate, []

  def interrupted(fd, offset, length):
    calls.append(length)
    if len(calls) == 2:  # Ctrl-C while the values are being reserved, the keys' file written
      raise KeyboardInterrupt
    return real(fd, offset, length)

  monkeypatch.setattr(os, "posix_fallocate", interrupted)
  out = str(tmp_path / "sub_int")
  with pytest.raises(KeyboardInterrupt):
    build.subset_datastore(setup["out"], out, 500)
  assert len(calls) == 2 and os.listdir(out) == []
  with pytest.raises(SystemExit) as e:
    cli._interrupted(out, subset=True)
  assert e.value.code == 130
  err = capsys.readouterr().err
  assert "subset copy" in err and "was removed" in err and "finished chunk" not in err
  monkeypatch.setattr(os, "posix_fallocate", real)
  # after the copy: Ctrl-C while digesting, a full disk while writing meta.json (the copy has just taken the
  # space): the same, nothing left; the full disk is the subset's no-space line
  import errno

  from trime_jax import data as data_lib

  real_digest = build.file_digest

  def interrupt(path, *a, **k):  # the source's digests are checked too when it is opened: those pass
    if path.startswith(out):
      raise KeyboardInterrupt
    return real_digest(path, *a, **k)

  def full(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  for module, name, fail, want in [(build, "file_digest", interrupt, KeyboardInterrupt),
                                   (data_lib, "atomic_write_json", full, CheckpointError)]:
    with monkeypatch.context() as m:
      m.setattr(module, name, fail)
      with pytest.raises(want) as e:
        build.subset_datastore(setup["out"], out, 500)
    assert os.listdir(out) == [], name
  assert str(e.value).startswith(f"no space left for the datastore subset {out} (No space left on device)")
  assert build.subset_datastore(setup["out"], out, 500)["complete"]


def test_subset_of_a_build_in_progress_is_the_complete_ones_prefix(setup, tmp_path):
  """A size sweep need not wait for the full build: the finished chunks of an interrupted build are final."""
  from trime_jax.datastore import subset_datastore

  partial = str(tmp_path / "partial")
  meta = build_datastore(setup["export"], setup["corpus"], partial, chunk_tokens=100, max_chunks=2, progress=False)
  done = meta["tokens_done"]
  assert not meta["complete"] and 0 < done < setup["ds"].count
  with pytest.raises(CheckpointError, match="incomplete"):
    Datastore(partial)
  sub_meta = subset_datastore(partial, str(tmp_path / "sub"), done)
  full_sub = subset_datastore(setup["out"], str(tmp_path / "sub_full"), done)
  sub = Datastore(str(tmp_path / "sub"))
  np.testing.assert_array_equal(sub.keys, setup["ds"].keys[:done])
  np.testing.assert_array_equal(sub.values, setup["ds"].values[:done])
  assert sub_meta["fingerprint"] == full_sub["fingerprint"] and sub_meta["subset_of"] == setup["ds"].fingerprint
  with pytest.raises(ConfigError, match=f"finished {done:,}"):
    subset_datastore(partial, str(tmp_path / "too_many"), done + 1)


def test_subset_for_another_model_or_of_an_edited_build_is_refused_before_writing(setup, tmp_path):
  from trime_jax.datastore import subset_datastore

  other = _export(tmp_path / "other", seed=1)
  out = tmp_path / "sub"
  with pytest.raises(CheckpointError, match="checkpoint_fingerprint"):
    subset_datastore(setup["out"], str(out), 10, checkpoint_dir=other)
  assert not out.exists()  # nothing written
  subset_datastore(setup["out"], str(out), 10, checkpoint_dir=setup["export"])  # the right model: fine

  partial = tmp_path / "partial"
  build_datastore(setup["export"], setup["corpus"], str(partial), chunk_tokens=100, max_chunks=1, progress=False)
  meta_path = partial / "meta.json"
  meta = json.loads(meta_path.read_text())
  meta["context_window"] += 1  # an identity field edited by hand
  meta_path.write_text(json.dumps(meta))
  with pytest.raises(DamagedCheckpointError, match="edited"):
    subset_datastore(str(partial), str(tmp_path / "sub2"), 10)
  assert not (tmp_path / "sub2").exists()


def test_auto_index_counts_its_build_time():
  """Issue 36.5: a tiny model's store (200k × 32 keys, dev + test = 40k searches of K=64) gets the exact index:
  training IVF-PQ's product quantizer (m=32 k-means of 256 centroids on 1-float sub-vectors) outweighs the
  searches it saves."""
  from trime_jax.datastore.index import index_choice, ivfpq_build_seconds

  kind, why = index_choice(200_000, 32, 40_000, 64)
  assert kind == "flat" and "to build it" in why, why
  est = ivfpq_build_seconds(200_000, 32, nlist=4096, pq_m=32)
  assert est["pq"] > est["coarse"] + est["add"] and est["total"] == pytest.approx(est["coarse"] + est["pq"] + est["add"])
  # The estimate against builds measured on this machine (docs-wt's 17.8M keys: 58 s of training, 122 s of adding).
  big = ivfpq_build_seconds(17_809_818, 128, nlist=4096, pq_m=16)
  assert 30 < big["coarse"] + big["pq"] < 120 and 60 < big["add"] < 250
  # A store searched far more often still gets IVF-PQ (wikitext-mini's 375k keys, 87k searches of K=1024).
  assert index_choice(375_000, 128, 87_000, 1024)[0] == "ivfpq"


def test_index_training_heartbeat(capsys):
  """A blocking FAISS call is not silent: elapsed time and the estimate's remainder every few seconds."""
  import time

  from trime_jax.datastore.index import _Heartbeat

  with _Heartbeat("training IVF-PQ", estimate=100.0, every=0.05):
    time.sleep(0.3)
  out = capsys.readouterr().out
  assert out.count("index: training IVF-PQ: 0 s elapsed, ~100 s left (estimated ~100 s in all)") >= 2, out
  with _Heartbeat("training IVF-PQ", estimate=0.01, every=0.05):
    time.sleep(0.15)
  assert "longer than the ~0 s estimated" in capsys.readouterr().out


def test_ivfpq_build_states_its_estimate(setup, tmp_path, capsys):
  out = str(tmp_path / "ivf.faiss")
  build_index(setup["ds"], out, kind="ivfpq", nlist=4, pq_m=4, progress=True)
  printed = capsys.readouterr()
  assert "index: training IVF-PQ (nlist=" in printed.out and "estimated ~" in printed.out, printed.out
  assert "to add the keys" in printed.out


def test_a_second_build_of_the_same_directory_is_refused_while_one_runs(setup, tmp_path):
  """One writer per datastore directory: while another process holds `<out>.lock` (a build in progress), a
  build into the same directory is refused naming that process, and nothing is written."""
  import subprocess
  import sys
  from trime_jax.runtime.lock import LockedError
  out = str(tmp_path / "store")
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time\nfrom trime_jax.runtime.lock import DirLock\n"
       f"with DirLock({out + '.lock'!r}, 'datastore'):\n  print('held', flush=True)\n  time.sleep(60)\n"],
      stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(LockedError, match=f"datastore .*store is in use by .*{holder.pid}"):
      build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)
    assert not os.path.exists(out)
  finally:
    holder.kill()
    holder.wait()
  meta = build_datastore(setup["export"], setup["corpus"], out, chunk_tokens=100, progress=False)  # lock released
  assert meta["complete"] and not os.path.exists(out + ".lock")


@pytest.mark.parametrize("key_dtype,mib", [("float16", "8.0"), ("float32", "12.0")])
def test_disk_full_states_the_size_of_the_keys_dtype(tmp_path, key_dtype, mib):
  """The full-disk error names the space the files need: 2^20 keys x 2 dims of the build's key dtype + int32s."""
  import errno

  with pytest.raises(CheckpointError, match=rf"the files need {mib} MiB"):
    with build._no_space_is_an_error(str(tmp_path), 1 << 20, 2, np.dtype(key_dtype).itemsize):
      raise OSError(errno.ENOSPC, "No space left on device")


def test_build_datastore_refuses_its_out_before_reading_the_corpus(tmp_path):
  """An --out holding something else is refused before the corpus is read (WikiText-103's takes minutes; it was
  read, and cached, first: found by a walk-through); --overwrite still removes it only after the corpus loads."""
  from tests.helpers import run_cli

  out, cache = tmp_path / "out", tmp_path / "cache"
  out.mkdir()
  (out / "notes.txt").write_text("precious")
  r = run_cli("trime_jax.launch.build_datastore", "--checkpoint=trime_jax/pretrained/demo", f"--out={out}",
              f"--config.data.cache_dir={cache}")
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"error: --out={out} already holds"), \
      r.stderr[-2000:]
  assert not cache.exists() and (out / "notes.txt").read_text() == "precious"


def test_an_l2_index_searches_by_squared_distance_and_rescore_recomputes_it(setup, tmp_path):
  """metric="l2" (the original's kNN-LM index, build_dstore.py --dist l2): IndexFlatL2, scores -|q - k|² best
  first; `rescore(metric="l2")` recomputes them from the stored float16 keys (the original's dist_func)."""
  ds = setup["ds"]
  index = build_index(ds, str(tmp_path / "l2.faiss"), kind="flat", metric="l2", progress=False)
  assert index.kind == "flat" and index.metric == "l2" and isinstance(index.index, faiss.IndexFlatL2)
  rng = np.random.default_rng(0)
  queries = rng.normal(size=(20, ds.dimension)).astype(np.float32)
  scores, ids = index.search(queries, 8)
  keys = np.asarray(ds.keys, np.float64)
  brute = -((queries.astype(np.float64)[:, None, :] - keys[None]) ** 2).sum(-1)
  expected = np.argsort(-brute, axis=1, kind="stable")[:, :8]  # (the byte corpus repeats contexts: tied keys)
  np.testing.assert_allclose(scores, np.take_along_axis(brute, expected, 1), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.take_along_axis(brute, ids, 1), scores, rtol=1e-5, atol=1e-4)
  exact, ids2 = rescore(ds, queries, ids[:, ::-1], metric="l2")  # re-sorted best first
  np.testing.assert_allclose(exact, np.take_along_axis(brute, ids2, 1), rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(exact, scores, rtol=1e-5, atol=1e-4)
  with pytest.raises(ConfigError, match="index metric must be one of"):
    rescore(ds, queries, ids, metric="cos")
  # IVF-PQ with the L2 metric and an L2 coarse quantizer, as the original's --dist l2
  ivf = build_index(ds, str(tmp_path / "l2ivf.faiss"), kind="ivfpq", nlist=4, pq_m=4, pq_bits=4, metric="l2",
                    progress=False)
  assert ivf.index.metric_type == faiss.METRIC_L2 and ivf.info["metric"] == "l2"
  assert isinstance(faiss.downcast_index(ivf.index.quantizer), faiss.IndexFlatL2)
  s, i = ivf.search(queries, 8, nprobe=4)
  assert (i >= 0).all() and (np.diff(s, axis=1) <= 1e-4).all() and (s <= 0).all()


def test_the_index_metric_is_recorded_in_its_sidecar_and_checked_on_load(setup, tmp_path):
  """Each metric's index beside the datastore (default paths index.faiss / index_l2.faiss); the sidecar's
  metric is checked on load against the one expected (and against the faiss file's own); a sidecar without the
  field (written before it existed) is an inner-product index."""
  from trime_jax.datastore.index import default_index_path

  src = setup["ds"]
  out = str(tmp_path / "store")
  shutil.copytree(src.directory, out)
  ds = Datastore(out)
  ip, l2 = build_index(ds, progress=False), build_index(ds, metric="l2", progress=False)
  assert (ip.path, l2.path) == (default_index_path(out), default_index_path(out, "l2"))
  assert (ip.path, l2.path) == (os.path.join(out, "index.faiss"), os.path.join(out, "index_l2.faiss"))
  assert json.load(open(ip.path + ".json"))["metric"] == "inner_product"
  assert json.load(open(l2.path + ".json"))["metric"] == "l2"
  assert KnnIndex.load(l2.path, datastore=ds, metric="l2").metric == "l2"
  with pytest.raises(CheckpointError, match=r"index_l2.faiss is an index of metric 'l2' \(its sidecar\), not the "
                                            "'inner_product' index expected here"):
    KnnIndex.load(l2.path, datastore=ds)
  with pytest.raises(CheckpointError, match="metric 'inner_product'.*not the 'l2' index expected here.*"
                                            "--index_metric=l2"):
    KnnIndex.load(ip.path, datastore=ds, metric="l2")
  # a sidecar claiming the other metric is refused by the faiss file's own metric
  info = json.load(open(ip.path + ".json"))
  with open(ip.path + ".json", "w") as f:
    json.dump(dict(info, metric="l2"), f)
  with pytest.raises(CheckpointError, match="not the 'l2' index expected here"):
    KnnIndex.load(ip.path, datastore=ds, metric="l2")
  # written before the field: an inner-product index
  with open(ip.path + ".json", "w") as f:
    json.dump({k: v for k, v in info.items() if k != "metric"}, f)
  assert KnnIndex.load(ip.path, datastore=ds).metric == "inner_product"
  # a rebuild of the other metric at the same path is a rebuild, not a reuse
  again = build_index(ds, l2.path, metric="inner_product", reuse=True, progress=False)
  assert again.metric == "inner_product" and json.load(open(l2.path + ".json"))["metric"] == "inner_product"
  with pytest.raises(ConfigError, match="index metric must be one of"):
    build_index(ds, str(tmp_path / "x.faiss"), metric="cos", progress=False)
