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
