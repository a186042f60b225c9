"""trime_jax's Python API (trime_jax/api.py): train -> load -> score / generate / memory on a tiny byte model
trained here; scores checked against a NumPy restatement of TRIME's local-memory softmax, generation against
`generate.Generator` called directly, external memory with a datastore built here, and loading an original
fairseq checkpoint through the importer."""

import os

import numpy as np
import pytest

import trime_jax
from tests.helpers import tiny_config, write_text_file
from trime_jax import api, generate
from trime_jax.errors import ConfigError

TEXT = "def main(argv):\n    return argv\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("api")
  corpus = write_text_file(root / "corpus.txt", 8_000)
  cfg = tiny_config(corpus, **{"train.num_steps": 3, "train.checkpoint_every": 3, "train.eval_max_tokens": 64,
                               "train.keep_best": False, "model.dropout": 0.0})
  out = trime_jax.train(cfg, str(root / "run"))  # the package's one-call training
  return root, out


@pytest.fixture(scope="module")
def model(run):
  return trime_jax.load(run[1]["export"])


def test_train_and_load(run, model):
  root, out = run
  assert set(out) >= {"train", "dev", "export"}
  assert trime_jax.train.train_and_evaluate is not None  # trime_jax.train is still the module
  from_workdir = trime_jax.load(str(root / "run"))  # a training workdir means its export
  assert from_workdir.directory == model.directory and model.meta["step"] == 3
  assert "16,800 parameters" in repr(model) and isinstance(model, trime_jax.Model)


def _reference_log_probs(model, ids, tau=None):
  """log P(token) of a text fed as one window from </s>: the model's softmax alone (tau None) or TRIME's over
  the vocabulary and the window's earlier (key, next token) pairs, P(w) ∝ exp(logit_w) + Σ_{j<i, x_j=w}
  exp(g_i·g_j / √D / τ), in float64."""
  net = model.nnx_model
  inputs = np.asarray([[model.vocab.bos] + list(ids[:-1])], np.int32)
  logits, keys = (np.asarray(x[0], np.float64) for x in net(inputs))
  out = []
  for i, target in enumerate(ids):
    terms = np.exp(logits[i] - logits[i].max())
    total, numer = terms.sum(), terms[target]
    if tau is not None:
      sim = np.exp(keys[:i] @ keys[i] / np.sqrt(keys.shape[1]) / tau - logits[i].max())
      total += sim.sum()
      numer += sim[np.asarray(ids[:i]) == target].sum()
    out.append(np.log(numer / total))
  return np.asarray(out)


def test_score_none_and_local_equal_the_reference(model):
  ids = model.tokenize(TEXT)
  assert len(ids) <= model.config.eval.block_len  # one window: the reference's setting
  plain = model.score(TEXT, memory="none")
  assert plain.tokens == [model.vocab.tokens[i] for i in ids] and len(plain.log_probs) == len(ids)
  np.testing.assert_allclose(plain.log_probs, _reference_log_probs(model, ids), rtol=2e-5, atol=2e-5)
  assert plain.ppl == pytest.approx(np.exp(-np.mean(plain.log_probs)), rel=1e-6)
  local = model.score([TEXT, "x = 1\n"], memory="local", tau=0.7)
  assert isinstance(local, list) and len(local) == 2
  np.testing.assert_allclose(local[0].log_probs, _reference_log_probs(model, ids, tau=0.7), rtol=2e-5, atol=2e-5)
  assert not np.allclose(local[0].log_probs, plain.log_probs)  # the memory changes the scores
  with pytest.raises(ConfigError):
    model.score(TEXT, memory="cache")
  with pytest.raises(ConfigError):
    model.score(TEXT, memory="external")  # no datastore


def test_long_term_memory_add_and_clear(model):
  text = "import os\nimport sys\n"  # within the first window's scored tokens: no earlier window of its own
  assert len(model.tokenize(text)) <= model.config.eval.block_len - model.config.eval.context_window
  local = model.score(text, memory="local")
  empty = model.score(text, memory="long")  # nothing in memory and no earlier window: local memory only
  np.testing.assert_allclose(empty.log_probs, local.log_probs, rtol=1e-5, atol=1e-5)
  assert model.memory.add([text]) == len(model.tokenize(text)) == len(model.memory)
  remembered = model.score(text, memory="long")
  assert remembered.ppl < 0.9 * local.ppl  # the text's own keys in memory make it likelier
  with pytest.raises(ConfigError):
    model.memory.add("")
  model.memory.clear()
  assert len(model.memory) == 0
  np.testing.assert_allclose(model.score(text, memory="long").log_probs, local.log_probs, rtol=1e-5, atol=1e-5)
  with pytest.raises(ConfigError, match="model.memory.add"):
    model.generate("x", memory="long")


def test_generate_with_simple_keywords_equals_the_generator(model):
  gen = model.generator  # a generate.Generator of the export, called here as before the API (one compile)
  assert isinstance(gen, generate.Generator)
  out = model.generate("def ", max_new_tokens=6, temperature=0.0, memory="local")
  ref = gen.generate(["def "], max_new_tokens=6, sampling=generate.Sampling(temperature=0.0),
                     memory=generate.MemorySpec("local"))[0]
  assert (out.text, out.ids, out.stopped) == (ref.text, list(ref.tokens), "budget") and len(out.ids) == 6
  sampled = model.generate(["def ", "class "], max_new_tokens=5, temperature=0.8, top_p=0.9, seed=3,
                           memory="none")
  ref = gen.generate(["def ", "class "], max_new_tokens=5, memory=generate.MemorySpec("none"),
                     sampling=generate.Sampling(temperature=0.8, top_p=0.9, seed=3))
  assert [o.ids for o in sampled] == [list(r.tokens) for r in ref]
  doc = "def handler(request):\n    return request\n"
  model.memory.add(doc)
  try:
    long = model.generate("def handler(", max_new_tokens=6, temperature=0.0, memory="long", trace=True)
    store = gen.new_store()
    gen.read(store, doc)
    ref = gen.generate(["def handler("], max_new_tokens=6, sampling=generate.Sampling(temperature=0.0),
                       memory=generate.MemorySpec("long"), store=store, remember=False)[0]
    assert long.ids == list(ref.tokens) and len(long.trace) == 6
    assert len(model.memory) == len(model.tokenize(doc))  # generation did not add to the memory
  finally:
    model.memory.clear()


def test_external_memory_with_a_datastore(model, run, tmp_path):
  from trime_jax import corpora
  from trime_jax.datastore import Datastore, build_datastore, build_index

  splits = corpora.load_splits(model.config.data, model.vocab)
  ds_dir = tmp_path / "ds"
  build_datastore(model.directory, splits.train, str(ds_dir), progress=False)
  build_index(Datastore(str(ds_dir)), kind="flat", progress=False)
  local = model.score(TEXT, memory="local")
  ext = model.score(TEXT, memory="external", datastore=str(ds_dir), k=16)
  assert len(ext.log_probs) == len(local.log_probs) and not np.allclose(ext.log_probs, local.log_probs)
  out = model.generate("def ", max_new_tokens=4, temperature=0.0, memory="external", datastore=str(ds_dir), k=16)
  gen = model.generator
  ref = gen.generate(["def "], max_new_tokens=4, sampling=generate.Sampling(temperature=0.0),
                     memory=generate.MemorySpec("external"), external=gen.external(str(ds_dir), k=16))[0]
  assert out.ids == list(ref.tokens)


def test_load_a_fairseq_checkpoint(tmp_path):
  torch = pytest.importorskip("torch", reason="the fairseq import needs the [fairseq] extra")
  from tests.test_fairseq_import import write_checkpoint, write_dict
  from trime_jax import fairseq_import

  ckpt_path = write_checkpoint(torch, tmp_path / "c.pt", "plain_shared")
  dict_path = write_dict(tmp_path / "dict.txt")
  model = trime_jax.load(ckpt_path, dictionary=dict_path, out=str(tmp_path / "imported"))
  assert model.meta["fairseq_arch"] == "transformer_lm"
  ref_dir, _ = fairseq_import.import_to_export(ckpt_path, dict_path, str(tmp_path / "ref"))
  text = "the alpha article is about alpha .\nbeta is the second letter ."
  a, b = model.score(text, memory="local"), trime_jax.load(ref_dir).score(text, memory="local")
  np.testing.assert_array_equal(a.log_probs, b.log_probs)
  assert a.tokens[:3] == ["the", "alpha", "article"] and "</s>" in a.tokens
  with pytest.raises(ConfigError, match="dictionary"):
    trime_jax.load(ckpt_path)


def test_shipped_demo_model_loads_by_name(tmp_path, monkeypatch):
  """`trime_jax.load("demo")` from any directory is the export shipped in trime_jax/pretrained/ (its digests are
  verified on load); it predicts Python source far better than uniform bytes; an unknown bare name is one error."""
  monkeypatch.chdir(tmp_path)
  assert "demo" in api.pretrained_names()
  model = trime_jax.load("demo")
  assert model.directory == os.path.join(api.PRETRAINED_DIR, "demo") and model.vocab.kind == "bytes"
  s = model.score("import os\nimport sys\n\n\ndef main(argv):\n    return 0\n", memory="local")
  assert np.isfinite(s.log_probs).all() and s.ppl < 16, s.ppl  # uniform over 256 bytes: 256
  with pytest.raises(ConfigError, match="neither a path nor a shipped model.*demo"):
    trime_jax.load("no_such_model")
