"""trime_jax's Python API (trime_jax/api.py): train -> load -> score / generate / memory on a tiny byte model
trained here; scores checked against a NumPy restatement of TRIME's local-memory softmax, generation against
`generate.Generator` called directly, external memory with a datastore built here, and loading an original
fairseq checkpoint through the importer."""

import gc
import json
import logging
import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx

import trime_jax
from tests.helpers import tiny_config, write_text_file
from trime_jax import api, data, evaluate, exports, generate, knn, specs
from trime_jax import model as M
from trime_jax.errors import CheckpointError, ConfigError

TEXT = "def main(argv):\n    return argv\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("api")
  corpus = write_text_file(root / "corpus.txt", 8_000)
  cfg = tiny_config(corpus, **{"train.num_steps": 3, "train.checkpoint_every": 3, "train.eval_max_tokens": 64,
                               "train.keep_best": False, "model.dropout": 0.0})
  out = trime_jax.train(cfg, str(root / "run"))  # the package's one-call training
  return root, out


def _unlocked_with(config, name: str, value):
  """A copy of `config`, unlocked (as a config a user builds is), with `name` set: a new field if it has none."""
  import ml_collections

  copy = ml_collections.ConfigDict(config.to_dict())
  section, leaf = name.split(".")
  copy[section][leaf] = value
  return copy


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
  # A plain dict of the config (fields it lacks: their defaults), rerun on the finished run: the same export and
  # dev line, and the last train line it recorded (an empty one before)
  given = model.config.to_dict()
  del given["eval"]["tau"]
  again = trime_jax.train(given, str(root / "run"))
  assert again["export"] == out["export"] and again["dev"] == out["dev"]
  assert again["train"]["step"] == 3 and again["train"]["loss"] == out["train"]["loss"]


def test_api_paths_expand_the_home_directory(run, monkeypatch):
  """`~/...` is what a user types in Python as in a shell: load and Model expand it (they said "not found")."""
  root, _ = run
  monkeypatch.setenv("HOME", str(root))
  assert trime_jax.load("~/run").directory == str(root / "run" / "export")
  assert trime_jax.Model("~/run/export").directory == str(root / "run" / "export")


def test_load_says_what_a_path_is_when_it_is_not_an_export(run, tmp_path):
  """A step of the checkpoints, an export's params folder or file, a workdir that has not exported yet, an MT
  export: each one line saying what it is and what to pass (found by a review: all read "incomplete export")."""
  import shutil

  root, out = run
  work, export = root / "run", out["export"]
  step = next(p for p in (work / "checkpoints").iterdir() if p.name.isdigit())
  with pytest.raises(CheckpointError, match=r"is a training checkpoint \(one step of .*checkpoints\), not an export"):
    trime_jax.load(str(step))
  with pytest.raises(CheckpointError, match=r"checkpoints holds a training run's checkpoints, not an export: pass "
                                            r"the run's workdir .*run \(its export/"):
    trime_jax.load(str(work / "checkpoints"))
  assert exports.what_else_it_is(f"{work}/checkpoints/").startswith(  # the run named, not checkpoints itself
      f"{work}/checkpoints/ holds a training run's checkpoints, not an export: pass the run's workdir {work} (its")
  with pytest.raises(CheckpointError, match=r"is the parameters folder of the export .*: pass "):
    trime_jax.load(os.path.join(export, "params"))
  with pytest.raises(ConfigError, match=r"meta.json is a file of the export .*: load the folder"):
    trime_jax.load(os.path.join(export, "meta.json"))
  partial = tmp_path / "partial"  # training stopped before its export, a best/ kept
  shutil.copytree(work, partial, ignore=shutil.ignore_patterns("export"))
  shutil.copytree(export, partial / "best")
  with pytest.raises(CheckpointError, match=r"training workdir that has not exported yet .*best holds the best "
                                            r"parameters by dev perplexity so far: pass that$"):
    trime_jax.load(str(partial))
  shutil.rmtree(partial / "best")
  with pytest.raises(CheckpointError, match=r"has not exported yet \(.*finishes\)$"):
    trime_jax.load(str(partial))
  # a workdir whose export/ is not the run's latest: said (a kill mid-export, checkpoints past it), then loaded
  stale = tmp_path / "stale"
  shutil.copytree(work, stale)
  step = json.loads((stale / "export" / "meta.json").read_text())["step"]
  (stale / "checkpoints" / str(step + 5)).mkdir()
  (stale / "export.tmp").mkdir()
  said = []
  assert trime_jax.api.export_path(str(stale), say=said.append) == str(stale / "export")
  assert said == [f"{stale}/export holds update {step:,}, but an export into {stale}/export was interrupted "
                  f"({stale}/export.tmp is left) and the run's checkpoints reach update {step + 5:,}: rerun the "
                  "training command to finish and export the run (it resumes from its checkpoints); using the "
                  "export as it is"]
  said.clear()
  assert trime_jax.api.export_path(str(work), say=said.append) == str(work / "export") and not said
  mt = tmp_path / "mt"
  shutil.copytree(export, mt)
  meta = json.loads((mt / "meta.json").read_text())
  (mt / "meta.json").write_text(json.dumps({**meta, "model_family": "mt"}))
  (mt / "vocab.json").unlink()  # a translation export's vocabulary is its subword model's files
  with pytest.raises(CheckpointError, match=r"is a machine-translation export: translate with"):
    trime_jax.load(str(mt))
  # the importer's options for an export would be ignored
  with pytest.raises(ConfigError, match=r"^out, key_type: options of a fairseq checkpoint's import"):
    trime_jax.load(export, out=str(tmp_path / "x"), key_type="final")
  assert not (tmp_path / "x").exists()


def test_load_reads_the_stored_config_as_the_clis_do(run, tmp_path):
  """The export's config.json as every CLI's --checkpoint reads it: a misspelt field refused (it was ignored),
  an absent one at its default (it failed later: AttributeError)."""
  import shutil

  from trime_jax.configs import default

  export = tmp_path / "export"
  shutil.copytree(run[1]["export"], export)
  stored = json.loads((export / "config.json").read_text())
  (export / "config.json").write_text(json.dumps({**stored, "eval": {**stored["eval"], "tempreture": 2.0}}))
  with pytest.raises(CheckpointError, match=r"config.json has field this version does not know: eval.tempreture"):
    trime_jax.load(str(export))
  del stored["eval"]["block_len"]
  (export / "config.json").write_text(json.dumps(stored))
  m = trime_jax.load(str(export))
  assert m.config.eval.block_len == default.get_config().eval.block_len and m.score(TEXT).tokens
  # an export's eval.devices beyond this machine's (an 8-GPU run's) is clipped to them: it loads (it was refused)
  (export / "config.json").write_text(json.dumps({**stored, "eval": {**stored["eval"],
                                                                    "devices": len(jax.local_devices()) + 3}}))
  assert trime_jax.load(str(export)).devices == len(jax.local_devices())


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
  with pytest.raises(ConfigError, match=r"^memory must be one of .* got 'cache'$"):
    model.score(TEXT, memory="cache")
  with pytest.raises(ConfigError, match=r"^memory='external' needs datastore=DIR"):
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
  with pytest.raises(ConfigError, match=r"^a memory document is empty"):
    model.memory.add("")
  model.memory.clear()
  assert len(model.memory) == 0
  np.testing.assert_allclose(model.score(text, memory="long").log_probs, local.log_probs, rtol=1e-5, atol=1e-5)
  # An empty memory is local memory alone when generating too, as when scoring (it was refused before)
  kw = dict(max_new_tokens=5, temperature=0.0)
  assert model.generate("x = ", memory="long", **kw).ids == model.generate("x = ", memory="local", **kw).ids


def test_long_term_memory_documents_run_once_per_store_size(model, monkeypatch):
  """score(memory="long") keeps the evaluator's state after the documents' windows: a later text runs its own
  windows only and scores what one pass over documents + text scores; a new document or new parameters start
  over."""
  from trime_jax.evaluate import driver

  e = model.config.eval
  docs = ["import os\nimport sys\n" * 12, "def f(x):\n    return x\n" * 10]
  texts = ["x = os.path\n", "def g(y):\n    return f(y)\n", "import sys\n"]
  calls = []
  forward = driver.forward_queries
  monkeypatch.setattr(driver, "forward_queries", lambda *a, **k: calls.append(1) or forward(*a, **k))
  model.memory.clear()
  model.memory.add(docs)
  prefix = model.memory.tokens()

  def one_pass(text):  # the whole stream, nothing kept or reused
    ids = np.asarray(model.tokenize(text), np.int32)
    corpus = data.Corpus.from_docs([prefix, ids], model.vocab)
    mem = -(-len(corpus) // api.STORE_ROUND) * api.STORE_ROUND
    r = evaluate.evaluate(model.graphdef, model.params, corpus, [evaluate.Point("trime_local", tau=model.default_tau)],
                          block_len=e.block_len, context_window=e.context_window, streams=1, per_token=True,
                          long_term=evaluate.StoreSpec(mem_size=mem))
    return -r.token_nll[0][len(prefix):], len(data.eval_windows(corpus, len(corpus), e.block_len, e.context_window))

  windows_run = []
  for i, text in enumerate(texts):
    calls.clear()
    got = model.score(text, memory="long")
    windows_run.append(len(calls))
    want, windows = one_pass(text)
    np.testing.assert_array_equal(got.log_probs, want)
    if i == 0:
      assert windows_run[0] == windows  # the first text runs the documents' windows too
  assert len(prefix) > 4 * e.block_len and max(windows_run[1:]) <= 2 < windows_run[0]
  assert len(model.memory._states) == 1
  # new content or new parameters: the documents' windows run again
  model.memory.add("z = 0\n")
  assert not model.memory._states
  model.params = model.params
  assert not model.memory._states
  model.memory.clear()


def test_bench_score_memory_runs_the_documents_once(capsys):
  from bench import score_memory
  from trime_jax.evaluate import driver

  forward = driver.forward_queries
  assert score_memory.main([]) == 0
  assert driver.forward_queries is forward  # the counting wrapper is taken back
  rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and
          line.split("|")[1].strip().isdigit()]
  windows = [int(r[3]) for r in rows]
  assert len(windows) == len(score_memory.TEXTS) and windows[0] > 10 and windows[1:] == [1] * (len(windows) - 1)


def test_memory_add_is_all_or_nothing(model):
  with pytest.raises(ConfigError, match=r"empty \(texts\[1\]; nothing was added\)"):
    model.memory.add(["abc", ""])
  assert len(model.memory) == 0 and model.memory.documents == []
  model.memory.add("def f():\n")
  try:
    store = model.memory.store()  # the generator's store exists: a refused add leaves it as it was too
    before = len(store)
    with pytest.raises(ConfigError, match="texts"):
      model.memory.add(["x = 1\n", 3])
    assert len(store) == before == len(model.memory)
  finally:
    model.memory.clear()


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


def test_external_memory_with_a_datastore(model, run, tmp_path, capsys, caplog):
  from trime_jax import corpora
  from trime_jax.datastore import Datastore, build_datastore, build_index

  splits = corpora.load_splits(model.config.data, model.vocab)
  ds_dir = tmp_path / "ds"
  build_datastore(model.directory, splits.train, str(ds_dir), progress=False)
  build_index(Datastore(str(ds_dir)), kind="flat", progress=False)
  local = model.score(TEXT, memory="local")
  capsys.readouterr()
  with caplog.at_level(logging.INFO, logger="trime_jax.knn"):
    ext = model.score(TEXT, memory="external", datastore=ds_dir, k=16)  # a pathlib.Path is a path too
  # The index line is a logging record of trime_jax.knn, not a print (the command lines still print it)
  assert capsys.readouterr().out == "" and any(
      r.name == "trime_jax.knn" and r.getMessage().startswith("external memory: exact IndexFlatIP")
      for r in caplog.records)
  knn.ExternalMemory(ds_dir, checkpoint_dir=model.directory, k=16)
  assert capsys.readouterr().out.startswith("external memory: exact IndexFlatIP")
  assert len(ext.log_probs) == len(local.log_probs) and not np.allclose(ext.log_probs, local.log_probs)
  assert model.external(ds_dir, k=16) is model.external(str(ds_dir), k=16)
  opened = model.external(ds_dir, k=16)  # a datastore rebuilt in place (its meta.json rewritten) is opened again
  meta_path = ds_dir / "meta.json"
  os.utime(meta_path, ns=(meta_path.stat().st_atime_ns, meta_path.stat().st_mtime_ns + 10**9))
  assert model.external(ds_dir, k=16) is not opened and len(model._external) == 1
  opened = model.external(ds_dir, k=16)  # so is one whose default index.faiss was rebuilt (it was not)
  index_path = ds_dir / "index.faiss"
  os.utime(index_path, ns=(index_path.stat().st_atime_ns, index_path.stat().st_mtime_ns + 10**9))
  assert model.external(ds_dir, k=16) is not opened and len(model._external) == 1
  out = model.generate("def ", max_new_tokens=4, temperature=0.0, memory="external", datastore=ds_dir, k=16)
  gen = model.generator
  ref = gen.generate(["def "], max_new_tokens=4, sampling=generate.Sampling(temperature=0.0),
                     memory=generate.MemorySpec("external"), external=gen.external(str(ds_dir), k=16))[0]
  assert out.ids == list(ref.tokens)
  # one passed for the other: each says what it is
  with pytest.raises(CheckpointError, match=r"is a datastore \(keys of a model's tokens\), not an export"):
    trime_jax.load(ds_dir)
  with pytest.raises(CheckpointError, match=r"is an export \(a model\), not a datastore: build its datastore"):
    model.score(TEXT, memory="external", datastore=model.directory)
  no_index = tmp_path / "no_index"  # a datastore built with --index=none: how to add its index
  shutil.copytree(ds_dir, no_index, ignore=shutil.ignore_patterns("index.faiss*"))
  with pytest.raises(CheckpointError, match=r"has no index \(built with --index=none\?\): rerun its build_datastore"):
    model.score(TEXT, memory="external", datastore=no_index)
  (no_index / "index.faiss.trained.json").write_text("{}")  # an index build stopped midway: said as such
  with pytest.raises(CheckpointError, match=r"has no index \(its index build was stopped before the end "):
    model.score(TEXT, memory="external", datastore=no_index)
  # index=: another index file of the same datastore (here a copy) is the one searched
  shutil.copy(ds_dir / "index.faiss", tmp_path / "copy.faiss")
  shutil.copy(ds_dir / "index.faiss.json", tmp_path / "copy.faiss.json")  # its sidecar (what it indexes)
  with_index = model.score(TEXT, memory="external", datastore=ds_dir, k=16, index=tmp_path / "copy.faiss")
  np.testing.assert_array_equal(with_index.log_probs, model.score(TEXT, memory="external", datastore=ds_dir,
                                                                  k=16).log_probs)
  assert any(c[1] == str(tmp_path / "copy.faiss") for c in model._external)
  # a k sweep opens the datastore and its index once: each k shares them
  k4, k8 = model.external(ds_dir, k=4), model.external(ds_dir, k=8)
  assert (k4.k, k8.k) == (4, 8) and k4.index is k8.index and k4.datastore is k8.datastore
  assert sum(c[:2] == (str(ds_dir), "") for c in model._external) == 1
  # index= a folder: said, with the file it may have meant
  with pytest.raises(CheckpointError, match=rf"^FAISS index {ds_dir} is a folder: give the index file \({ds_dir}/index.faiss\)"):
    model.score(TEXT, memory="external", datastore=ds_dir, index=ds_dir)
  # parameters assigned after loading: the export's datastore no longer holds this model's keys, which is said
  changed = trime_jax.load(model.directory)
  changed.params = jax.tree_util.tree_map(lambda x: x * 1.01, changed.params)
  with caplog.at_level(logging.WARNING, logger="trime_jax.api"):
    changed.score(TEXT, memory="external", datastore=ds_dir, k=16)
    changed.score(TEXT, memory="external", datastore=ds_dir, k=8)
  assert sum("model.params was assigned" in r.getMessage() for r in caplog.records) == 1  # once per datastore
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="trime_jax.api"):
    model.score(TEXT, memory="external", datastore=ds_dir, k=16)  # its params reassigned as they were: no warning
  assert not any("model.params was assigned" in r.getMessage() for r in caplog.records)
  for bad in (0, -1, 2.5):  # k is named, whatever the memory; 0 does not silently mean eval.knn_k
    with pytest.raises(ConfigError, match=rf"^k \(datastore entries retrieved per token\).*got {bad}"):
      model.score(TEXT, memory="external", datastore=ds_dir, k=bad)
  # eval.knn_exact reaches the scorer as in trime_jax.launch.eval (exact re-scoring of the retrieved entries)
  exact = trime_jax.load(model.directory)
  exact.config.eval.knn_exact = True
  assert exact.external(ds_dir, k=16).exact and not model.external(ds_dir, k=16).exact
  want = evaluate.evaluate(exact.graphdef, exact.params, data.Corpus.from_docs([exact.tokenize(TEXT)], exact.vocab),
                           [evaluate.Point("trime", tau=exact.default_tau)], block_len=exact.config.eval.block_len,
                           context_window=exact.config.eval.context_window, streams=1,
                           long_term=evaluate.StoreSpec(mem_size=api.STORE_ROUND),
                           external=knn.ExternalMemory(ds_dir, k=16, exact=True), per_token=True)
  np.testing.assert_allclose(exact.score(TEXT, memory="external", datastore=ds_dir, k=16).log_probs,
                             -want.token_nll[0], rtol=1e-6, atol=1e-6)  # the API's rows: as long as the text
  # Several texts without memory documents run together (`evaluate.texts_plan`), long and external memory
  # too: each text's store holds its own earlier tokens only, as when it is scored alone in a stream of its own.
  texts = [TEXT * 6, "x = 1\n", "import os\nimport sys\n" * 5, TEXT, "def f(a, b):\n    return a + b\n" * 3]
  e = model.config.eval
  assert len(texts) > e.batch_size and max(len(model.tokenize(t)) for t in texts) > 2 * e.block_len
  for memory, point, ext in (("long", evaluate.Point("trime_local", tau=model.default_tau), None),
                             ("external", evaluate.Point("trime", tau=model.default_tau),
                              model.external(ds_dir, k=16))):
    together = model.score(texts, memory=memory, datastore=ds_dir if ext else None, k=16 if ext else None)
    for text, got in zip(texts, together):
      ids = model.tokenize(text)
      alone = evaluate.evaluate(model.graphdef, model.params, data.Corpus.from_docs([ids], model.vocab), [point],
                                block_len=e.block_len, context_window=e.context_window, streams=1,
                                long_term=evaluate.StoreSpec(mem_size=api.STORE_ROUND), external=ext, per_token=True)
      np.testing.assert_allclose(got.log_probs, -alone.token_nll[0], rtol=1e-5, atol=1e-5)  # summed in another order
    long_texts = [s for t, s in zip(texts, together) if len(s.ids) > 2 * e.block_len]
    assert long_texts and not np.allclose(long_texts[0].log_probs,
                                          model.score(texts[0], memory="local").log_probs, atol=1e-3)


def test_generator_shares_the_models_parameters(run, monkeypatch):
  """One copy of the parameters: the generator is built from the Model's (the export is not read again), and
  parameters assigned to the Model are the ones generation runs, its long-term memory keyed again with them."""
  m = trime_jax.load(run[1]["export"])

  def no_second_load(directory):
    raise AssertionError(f"the export was read again: {directory}")

  monkeypatch.setattr(exports, "load_export", no_second_load)
  gen = m.generator
  assert gen.params is m.params and gen.graphdef is m.graphdef
  doc = "def handler(request):\n    return request\n"
  m.memory.add(doc)
  kw = dict(max_new_tokens=5, temperature=0.0, memory="long", trace=True)
  before = m.generate("def handler(", **kw)
  m.params = jax.tree.map(lambda x: x * 0.5, m.params)
  assert m.generator is gen and gen.params is m.params
  after = m.generate("def handler(", **kw)
  fresh = generate.Generator(m.directory, log=lambda msg: None,
                             loaded=(m.graphdef, m.params, m.config, m.vocab, m.meta))
  store = fresh.new_store()
  fresh.read(store, doc)
  ref = fresh.generate(["def handler("], max_new_tokens=5, sampling=generate.Sampling(temperature=0.0),
                       memory=generate.MemorySpec("long"), store=store, remember=False, trace=True)[0]
  assert after.ids == list(ref.tokens)
  np.testing.assert_allclose([t.prob for t in after.trace], [t.prob for t in ref.trace], rtol=1e-6)
  assert not np.allclose([t.prob for t in after.trace], [t.prob for t in before.trace], rtol=1e-3)


def test_bad_arguments_are_one_clear_error_naming_them(model):
  cases = [
      (lambda: model.score(123), r"^texts must be a string or a list of strings, got int"),
      (lambda: model.score(b"abc"), r"^texts must be text \(str\), got bytes: decode it first"),
      (lambda: model.score(["a", b"b"]), r"^texts\[1\] must be text \(str\), got bytes"),
      (lambda: model.memory.add(b"abc"), r"^texts must be text \(str\), got bytes"),
      (lambda: model.generate(b"abc"), r"^prompts must be text \(str\), got bytes"),
      (lambda: model.generate([5, 6]), r"^prompts\[0\] is an integer: prompts are text; to continue token ids"),
      (lambda: model.tokenize(b"abc"), r"^text must be text \(str\)"),
      (lambda: model.score(TEXT, k=0), r"^k \(datastore entries retrieved per token\) must be an integer >= 1"),
      (lambda: model.score(TEXT, tau="1"), r"^tau must be a finite number > 0"),
      (lambda: model.score(TEXT, tau=float("inf")), r"^tau must be a finite number > 0, got inf"),
      (lambda: model.generate("x", tau=float("inf")), r"^tau must be a finite number > 0, got inf"),
      (lambda: model.generate("x", temperature=float("inf")), r"^temperature must be a finite number >= 0"),
      (lambda: model.generate("x", trace="no"), r"^trace must be True or False, got 'no'"),
      (lambda: model.score({"ab": 1}), r"^texts must be a string or a list of strings, got dict"),
      (lambda: model.memory.add({"a"}), r"^texts must be a string or a list of strings, got set"),
      (lambda: model.detokenize([-1]), rf"^ids must be integers in \[0, {len(model.vocab)}\) .*got -1"),
      (lambda: model.detokenize([1.5]), r"^ids must be a sequence of token ids \(integers\), got float64 values"),
      (lambda: model.detokenize([True]), r"^ids must be a sequence of token ids \(integers\), got bool values"),
      (lambda: model.detokenize([[1, 2]]), r"^ids must be a sequence .* of shape \(1, 2\)"),
      (lambda: model.detokenize([len(model.vocab)]), rf"^ids must be integers .*got {len(model.vocab)}"),
      (lambda: model.detokenize("the"), r"^ids must be a sequence of token ids \(integers\), got str"),
      (lambda: model.detokenize(5), r"^ids must be a sequence of token ids \(integers\), got int"),
      (lambda: model.detokenize(np.int32(5)), r"^ids must be a sequence of token ids \(integers\), got int32"),
      (lambda: model.generate("x", seed=2**31), r"^seed must be an integer in \[-2\*\*31, 2\*\*31\)"),
      (lambda: model.generate("x", top_k=2.5), r"^top_k must be an integer >= 0"),
      (lambda: model.generate("x", temperature="0"), r"^temperature must be a finite number >= 0"),
      (lambda: model.generate("x", max_new_tokens=2.5), r"^max_new_tokens must be an integer >= 1"),
      (lambda: model.generate("x", k=-1), r"^k \(datastore entries retrieved per token\).*got -1"),
      (lambda: model.generate("x", memory=["long"]), r"^memory must be one of"),
      (lambda: model.score(TEXT, memory="external", datastore=3), r"^datastore must be a path"),
      (lambda: model.score("ok\udc80"), r"^the text has no UTF-8 form: character 2 \('\\udc80'\) surrogates"),
      # an argument the memory would not use is refused, not ignored
      (lambda: model.score(TEXT, memory="local", k=5), r"^k= \(datastore entries.*needs memory='external'"),
      (lambda: model.generate("x", memory="long", k=5), r"^k= .*memory='long' retrieves nothing"),
      (lambda: model.score(TEXT, memory="none", tau=0.5), r"^tau= .*memory='none' has none"),
      (lambda: model.score(TEXT, index="x.faiss"), r"^index= .*needs memory='external'"),
      (lambda: setattr(model, "devices", len(jax.local_devices()) + 1),
       rf"^devices={len(jax.local_devices()) + 1} but this process sees {len(jax.local_devices())} device"),
      (lambda: setattr(model, "devices", "all"), r"^devices must be a device count >= 0 \(0: all of this"),
      (lambda: trime_jax.load(model.directory, devices=-1), r"^devices must be a device count >= 0"),
      (lambda: model.score(["x", ""]), r"^cannot score an empty text \(texts\[1\]\)$"),
      (lambda: trime_jax.train(5, "x"), r"^config must be an ml_collections ConfigDict .* got int$"),
      # a dict is read over configs/default.py: a misspelt field is refused (it trained without it before, and the
      # export it wrote could not be loaded), a value of another type too; and a config set by hand alike
      (lambda: trime_jax.train({"train": {"num_stpes": 3}}, "x"),
       r"^the config has field this version does not know: train.num_stpes \(train.num_steps\?\); correct or remove it$"),
      (lambda: trime_jax.train({"train": {"num_steps": "3"}}, "x"),
       r"^the config: train.num_steps='3' is not an int \(the field's type\)"),
      (lambda: trime_jax.train({"train": {"num_steps": None}}, "x"),
       r"^the config: train.num_steps=None, where the field is an int"),
      (lambda: trime_jax.train({"train": None}, "x"), r"^the config: train=None, where the field is a section"),
      (lambda: trime_jax.train(_unlocked_with(model.config, "eval.knn_kk", 8), "x"),
       r"^the config has field this version does not know: eval.knn_kk \(eval.knn_k\?\)"),
      (lambda: trime_jax.load("demo", dictionary="dict.txt"), r"^dictionary= is for a fairseq checkpoint .*'demo' is a "
                                                              r"shipped model: load\('demo'\) without it"),
      (lambda: trime_jax.train(model.config, None), r"^workdir must be a path \(str or os.PathLike\), got NoneType"),
  ]
  for call, message in cases:
    with pytest.raises(ConfigError, match=message):
      call()
  assert not os.path.exists("x")
  assert len(model.memory) == 0
  assert issubclass(trime_jax.ConfigError, trime_jax.TrimeError) and trime_jax.CheckpointError is CheckpointError
  with pytest.raises(trime_jax.CheckpointError, match=r"^checkpoint_best.pt not found \(a fairseq checkpoint: "
                                                      r"load\(path, dictionary=its dict.txt\)\)$"):
    trime_jax.load("checkpoint_best.pt")
  # the devices score splits texts over: the export's eval.devices (1), all of them (0: the one here) alike
  assert model.devices == 1 and trime_jax.load(model.directory, devices=0).devices == 0
  # detokenize takes ids as a list, a NumPy or a JAX array
  ids = model.tokenize("def f")
  assert model.detokenize(ids) == model.detokenize(np.asarray(ids)) == model.detokenize(jax.numpy.asarray(ids)) == (
      "def f") and model.detokenize([]) == ""
  # the accepted inputs: a string, a list (or tuple) of strings; the generator itself takes strings as memory
  assert len(model.score(("x = 1\n", "y = 2\n"), memory="none")) == 2
  out = model.generator.generate(["def "], max_new_tokens=3, memory="none", sampling=generate.Sampling(0))[0]
  assert out.tokens == model.generate("def ", max_new_tokens=3, temperature=0.0, memory="none").ids


def test_the_default_memory_is_the_exports_own(run):
  """memory=None: local memory for a TRIME model, the model alone for one trained without memory (a vanilla
  export), as launch.eval scores each first."""
  model = trime_jax.load(run[1]["export"])
  a = model.score(TEXT)
  np.testing.assert_array_equal(a.log_probs, model.score(TEXT, memory="local").log_probs)
  model.config.trime.memory = "none"  # as a vanilla export's config reads
  b = model.score(TEXT)
  np.testing.assert_array_equal(b.log_probs, model.score(TEXT, memory="none").log_probs)
  assert not np.allclose(a.log_probs, b.log_probs)
  assert model.generate("def ", max_new_tokens=3, temperature=0.0).ids == model.generate(
      "def ", max_new_tokens=3, temperature=0.0, memory="none").ids


WORDS = ["</s>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "door", ".", ","]
LINES = ["the cat sat on the mat .", "a dog ran", "the dog ran to the door , the cat sat .", "a cat .",
         "the mat", "on the mat the dog sat , a cat ran to a door ."]


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
  """A random word-level export evaluated as the 247M config is: eval.sample_break_mode=complete."""
  vocab = data.Vocab(WORDS)
  cfg = tiny_config("unused.bin", **{"model.num_layers": 1, "model.d_model": 16, "model.num_heads": 2,
                                     "model.d_ff": 32, "model.max_len": 32, "model.dropout": 0.0,
                                     "eval.block_len": 16, "eval.context_window": 8,
                                     "eval.sample_break_mode": "complete", "eval.tau": 0.5})
  net = M.TransformerLM(specs.model_config(cfg, vocab_size=len(vocab)), rngs=nnx.Rngs(0))
  return trime_jax.load(exports.export(str(tmp_path_factory.mktemp("words") / "export"),
                                       nnx.state(net, nnx.Param), cfg, vocab))


def _evaluated(m, ids, break_mode):
  """Per-token log P of `ids` as trime_jax.launch.eval scores a split (local memory, one stream)."""
  e = m.config.eval
  result = evaluate.evaluate(m.graphdef, m.params, data.Corpus.from_docs([np.asarray(ids)], m.vocab),
                             [evaluate.Point("trime_local", tau=m.default_tau)], block_len=e.block_len,
                             context_window=e.context_window, streams=1, per_token=True, break_mode=break_mode)
  return -result.token_nll[0]


@pytest.mark.parametrize("layout", ["disjoint", "original"])
def test_score_long_uses_the_exports_long_term_layout(tmp_path, layout):
  """score(memory="long") lays out its store as the export's eval.long_term_layout says, as launch.eval does
  (`runner.store_spec`): with "disjoint" a window's context tokens are not in the store too (the API used the
  original layout for every export, so a docs_wt export's long-term scores were not launch.eval's); both paths,
  texts alone (`texts_plan`) and after model.memory's documents (one stream)."""
  from trime_jax.evaluate.runner import store_spec

  vocab = data.Vocab(WORDS)
  cfg = tiny_config("unused.bin", **{"model.num_layers": 1, "model.d_model": 16, "model.num_heads": 2,
                                     "model.d_ff": 32, "model.max_len": 32, "model.dropout": 0.0,
                                     "eval.block_len": 16, "eval.context_window": 8, "eval.batch_size": 1,
                                     "eval.tau": 0.5, "eval.long_term_layout": layout})
  net = M.TransformerLM(specs.model_config(cfg, vocab_size=len(vocab)), rngs=nnx.Rngs(0))
  m = trime_jax.load(exports.export(str(tmp_path / "export"), nnx.state(net, nnx.Param), cfg, vocab))
  assert m.long_term_layout == layout
  e, point = m.config.eval, evaluate.Point("trime_local", tau=m.default_tau)

  def evaluated(docs, spec_layout):
    corpus = data.Corpus.from_docs([np.asarray(d, np.int32) for d in docs], m.vocab)
    spec = store_spec(e, api.STORE_ROUND) if spec_layout == layout else evaluate.StoreSpec(api.STORE_ROUND,
                                                                                           False, spec_layout)
    r = evaluate.evaluate(m.graphdef, m.params, corpus, [point], block_len=e.block_len,
                          context_window=e.context_window, streams=1, per_token=True, long_term=spec)
    return -r.token_nll[0][-len(docs[-1]):]

  other = {"disjoint": "original", "original": "disjoint"}[layout]
  text = " ".join(LINES * 2)  # several windows: the store is seen
  alone = m.score(text, memory="long")
  np.testing.assert_allclose(alone.log_probs, evaluated([alone.ids], layout), rtol=1e-6, atol=1e-6)
  assert np.abs(alone.log_probs - evaluated([alone.ids], other)).max() > 1e-3  # the layouts differ here
  m.memory.add(" ".join(LINES[::-1]))
  after = m.score(text, memory="long")
  docs = [m.memory.tokens(), after.ids]
  np.testing.assert_array_equal(after.log_probs, evaluated(docs, layout))
  assert np.abs(after.log_probs - evaluated(docs, other)).max() > 1e-3


def test_score_uses_the_exports_sample_break_mode(word_model, capsys, caplog):
  m = word_model
  text = "\n".join(LINES) + "\n"
  got = m.score(text, memory="local")
  np.testing.assert_array_equal(got.log_probs, _evaluated(m, got.ids, "complete"))
  assert not np.allclose(got.log_probs, _evaluated(m, got.ids, "none"))  # the modes' windows differ here
  # One line without a line end: complete mode's one block, as the line with its `</s>` is scored
  line = m.score(LINES[0], memory="local")
  np.testing.assert_allclose(line.log_probs, _evaluated(m, m.tokenize(LINES[0] + "\n"), "complete")[:-1],
                             rtol=1e-6, atol=1e-6)
  # A line longer than eval.block_len is not scored, as launch eval drops it (eval.complete_overlong=drop)
  long_line = f"{LINES[2]} {LINES[5]}"  # 25 tokens and its </s>
  capsys.readouterr()
  with caplog.at_level(logging.INFO, logger="trime_jax.api"):
    dropped = m.score(f"{LINES[1]}\n{long_line}\n{LINES[3]}\n", memory="local")
  assert "dropped" not in capsys.readouterr().err  # the API's note goes to logging, not to stderr
  assert any("dropped 1 lines" in r.getMessage() for r in caplog.records)
  n1, n2 = len(m.tokenize(LINES[1])) + 1, len(m.tokenize(long_line)) + 1
  # a perplexity over part of the text is said at warning level (shown by default), with how much is left out
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warned) == 1 and warned[0].startswith(f"not scored (NaN in log_probs, left out of ppl): {n2} of "
                                                   f"{len(dropped.ids)} tokens, in lines longer than eval.block_len="), warned
  assert n2 > m.config.eval.block_len
  assert np.isnan(dropped.log_probs[n1:n1 + n2]).all() and np.isfinite(np.delete(dropped.log_probs,
                                                                                 np.s_[n1:n1 + n2])).all()
  assert dropped.nll == pytest.approx(-np.nanmean(dropped.log_probs.astype(np.float64)))
  with pytest.raises(ConfigError, match="one line of 26 tokens"):
    m.score(long_line + " the", memory="local")
  # words outside the vocabulary: one warning for all the texts of a call (it was one per text)
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="trime_jax.api"):
    m.score(["the zebra sat", "a yak ran", "the cat sat"], memory="none")
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warned == ["2 word(s) of the 3 texts are not in the model's vocabulary and read as <unk>: yak, zebra"], warned


def test_complete_mode_texts_of_short_lines_share_one_compile(word_model):
  """Each text is its own evaluation; complete mode's query count follows the text's longest block, rounded up
  to the stride (`evaluate.memory.QUERY_ROUND`): texts whose lines fit in the stride reuse one compile."""
  from trime_jax.evaluate import driver

  m = word_model
  texts = [LINES[0] + "\n", f"{LINES[1]}\n{LINES[3]}\n", LINES[4] + "\n"]  # longest blocks 8, 8, 3 tokens
  stride = m.config.eval.block_len - m.config.eval.context_window
  assert max(len(m.tokenize(t)) for t in texts[::2]) <= stride and len(m.tokenize(texts[2])) < stride
  for text in texts:  # each text's blocks fit in the stride: Q = S
    plan = evaluate.stream_plan(data.Corpus.from_docs([np.asarray(m.tokenize(text))], m.vocab), block_len=16,
                                context_window=8, streams=1, long_term=evaluate.StoreSpec(), d_model=16,
                                dtype=np.float32, break_mode="complete")
    assert plan.queries == stride
  m.score(texts[0], memory="local")
  compiled = driver.forward_queries._cache_size(), driver.score_step._cache_size()
  scored = [m.score(text, memory="local") for text in texts[1:]]
  assert (driver.forward_queries._cache_size(), driver.score_step._cache_size()) == compiled
  for got in scored:  # (after the count: launch.eval's rows of block_len are another shape, another compile)
    # the same windows in rows of 8 tokens, not launch.eval's 16 (evaluate.row_length): equal up to float32
    # rounding (one ulp on some CPUs)
    np.testing.assert_allclose(got.log_probs, _evaluated(m, got.ids, "complete"), rtol=1e-6, atol=1e-6)


def test_texts_plan_lays_out_each_text_as_a_corpus_of_its_own(word_model):
  """`evaluate.texts_plan`: every text after a `</s>` of its own, its windows those of the text alone (shifted),
  whole texts per row, the rows balanced, the first window of each text marked fresh (a carry restarts)."""
  m = word_model
  ids_of = [np.asarray(m.tokenize(t), np.int32) for t in (LINES[0], "\n".join(LINES) + "\n", LINES[3] + "\n",
                                                           f"{LINES[1]}\n{LINES[4]}\n")]
  corpus, plan, counts = evaluate.texts_plan(ids_of, m.vocab, block_len=16, context_window=8, rows=2, d_model=16,
                                             dtype=np.float32)
  assert plan.separators == 4 and plan.num_targets == len(corpus) == sum(map(len, ids_of)) + 4
  assert counts == [len(ids) for ids in ids_of] and plan.scored_targets == sum(counts)
  inputs, targets, _ = data.window_batch(corpus, plan.wins, 16)
  k = 0
  for ids, off in zip(ids_of, corpus.doc_starts[:-1] + 1):
    alone = data.Corpus.from_docs([ids], m.vocab)
    own = data.eval_windows(alone, len(ids), 16, 8)
    a_in, a_t, _ = data.window_batch(alone, own, 16)
    np.testing.assert_array_equal(inputs[k:k + len(own)], a_in)  # the same rows as alone: `</s>` first
    np.testing.assert_array_equal(targets[k:k + len(own)], a_t)
    assert [w.score_start - off for w in plan.wins[k:k + len(own)]] == [w.score_start for w in own]
    assert plan.fresh[k] and not plan.fresh[k + 1:k + len(own)].any()
    k += len(own)
  assert k == len(plan.wins)
  lanes = [[int(i) for i in plan.schedule[:, r] if i >= 0] for r in range(2)]
  assert sorted(sum(lanes, [])) == list(range(k))
  assert sorted(map(len, lanes)) == [3, 6]  # the 6-window text in one row, the three 1-window texts in the other
  for lane in lanes:  # a row runs whole texts, each in order
    for prev, cur in zip(lane, lane[1:]):
      assert cur == prev + 1 or plan.fresh[cur]
  assert (plan.score == (plan.schedule >= 0)).all()
  with pytest.raises(ConfigError, match="without long_term="):
    evaluate.evaluate(m.graphdef, m.params, corpus, [evaluate.NONE], block_len=16, context_window=8, streams=2,
                      long_term=evaluate.StoreSpec(mem_size=64), plan=plan)


def _scored_alone(m, text, memory):
  """log P of each token of `text` as evaluate.evaluate scores the text as a corpus of its own (`stream_plan`,
  rows of the full block_len), with the windows score() gives it; NaN where a dropped line is not scored."""
  e = m.config.eval
  ids = np.asarray(m.tokenize(text), np.int32)
  mode, ctx = m._text_windows(ids, np.zeros(0, np.int32), e.sample_break_mode, e.context_window, e.block_len)
  corpus = data.Corpus.from_docs([ids], m.vocab)
  point = evaluate.NONE if memory == "none" else evaluate.Point("trime_local", tau=m.default_tau)
  store = evaluate.StoreSpec(mem_size=api.STORE_ROUND if memory == "long" else 0)  # long: every earlier token
  got = evaluate.evaluate(m.graphdef, m.params, corpus, [point], block_len=e.block_len, context_window=ctx,
                          streams=1, long_term=store, per_token=True, break_mode=mode).token_nll[0]
  out = np.full(len(ids), np.nan, np.float32)
  out[np.concatenate([np.arange(w.score_start, w.end)
                      for w in data.eval_windows(corpus, len(ids), e.block_len, ctx, mode)])] = -got
  return out


@pytest.mark.parametrize("query_round", [128, 4])
def test_score_runs_many_texts_together_each_as_alone(word_model, caplog, monkeypatch, query_round):
  """score([...], memory none / local) runs the texts eval.batch_size at a time (one pass, a window of a
  different text in each row) and gives each what evaluate gives the text alone: complete mode's blocks, a
  one-line text's block without context, a dropped long line (NaN), all in one call. Rows as long as the longest
  window, rounded up (`evaluate.memory._bucket`: a power of two up to QUERY_ROUND, then its multiples; 128 and 4
  here), shorter than eval.block_len where every text is short."""
  from trime_jax.evaluate import memory as evaluate_memory

  monkeypatch.setattr(evaluate_memory, "QUERY_ROUND", query_round)
  m = word_model
  long_line = f"{LINES[2]} {LINES[5]}"
  texts = ["\n".join(LINES) + "\n", LINES[0], f"{LINES[1]}\n{long_line}\n{LINES[3]}\n", LINES[4] + "\n",
           LINES[5], "\n".join(LINES[::-1]), LINES[1] + "\n" + LINES[2], "a cat ."]
  short = [LINES[0], LINES[4] + "\n", "a cat .", LINES[1]]
  assert len(texts) > int(m.config.eval.batch_size)  # rows run several texts one after another
  ids_of = [np.asarray(m.tokenize(t), np.int32) for t in short]
  _, plan, _ = evaluate.texts_plan(ids_of, m.vocab, block_len=16, context_window=0, rows=4, d_model=16,
                                   dtype=np.float32)
  assert plan.block_len == 8 and plan.queries <= plan.block_len  # 7 tokens: a power of two / a multiple of 4
  by_memory = {}
  for memory in ("none", "local", "long"):  # long with model.memory empty: each text's own earlier tokens
    with caplog.at_level(logging.INFO, logger="trime_jax.api"):
      caplog.clear()
      together = by_memory[memory] = m.score(texts, memory=memory)
    # the separators are not counted as tokens, and the block length is eval.block_len, not the rows' length
    assert any(f"dropped 1 lines longer than eval.block_len={m.config.eval.block_len} "
               f"({len(m.tokenize(long_line)) + 1} of" in r.getMessage() for r in caplog.records)
    for text, got in zip(texts + short, together + m.score(short, memory=memory)):
      np.testing.assert_array_equal(got.ids, m.tokenize(text))
      # up to the float rounding of other shapes (rows, their length, the query count); NaN where alone is
      np.testing.assert_allclose(got.log_probs, _scored_alone(m, text, memory), rtol=1e-6, atol=1e-6)
  assert np.isnan(together[2].log_probs).sum() == len(m.tokenize(long_line)) + 1
  local = by_memory["local"]
  np.testing.assert_allclose(local[0].log_probs, _evaluated(m, local[0].ids, "complete"), rtol=1e-6, atol=1e-6)
  assert not np.allclose(by_memory["long"][0].log_probs, local[0].log_probs, atol=1e-4)  # the store is seen
  # after the dropped line the store starts afresh, as alone (the original clears it there): the last line's
  # scores are local memory's, not what LINES[1]'s tokens in the store would make of them
  n3 = len(m.tokenize(LINES[3])) + 1
  np.testing.assert_allclose(by_memory["long"][2].log_probs[-n3:], local[2].log_probs[-n3:], rtol=1e-6, atol=1e-6)


def test_score_sizes_each_length_groups_store_and_names_eval_block_len(word_model, monkeypatch, caplog):
  """score(memory="long") with model.memory empty: one pass per row length, each with a store as long as its
  own longest text (not the call's); a dropped line's note names eval.block_len even in rows shorter than it."""
  m = word_model
  calls = []
  plan_of = evaluate.texts_plan
  monkeypatch.setattr(evaluate, "texts_plan", lambda *a, **kw: calls.append(kw) or plan_of(*a, **kw))
  long_text = "\n".join(LINES * 60) + "\n"  # more than STORE_ROUND tokens
  short_dropped = f"{LINES[2]} {LINES[5]}\n{LINES[4]}\n"  # a dropped line, then a block of 3 tokens
  with caplog.at_level(logging.INFO, logger="trime_jax.api"):
    got = m.score([long_text, short_dropped, "a cat ."], memory="long")
  assert len(m.tokenize(long_text)) > api.STORE_ROUND
  mem_sizes = sorted(kw["mem_size"] for kw in calls)
  assert len(calls) >= 2 and mem_sizes[0] == api.STORE_ROUND and mem_sizes[-1] > api.STORE_ROUND
  assert any("longer than eval.block_len=16 " in r.getMessage() for r in caplog.records)
  assert not any("eval.block_len=8 " in r.getMessage() for r in caplog.records)
  n = len(m.tokenize(LINES[4])) + 1
  assert np.isfinite(got[1].log_probs[-n:]).all() and np.isnan(got[1].log_probs[:-n]).all()


def test_bench_score_texts_compares_one_call_per_text_with_one_for_all(capsys):
  from bench import score_texts

  assert score_texts.main(["--texts", "12", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| one call")}
  assert set(rows) == {"one call per text", "one call for all"} and "12 texts" in out
  diff = float(out.split("largest |log P| difference ")[1].split()[0])
  assert diff <= 1e-5


def test_word_model_detokenize_is_the_generators(word_model):
  m = word_model
  ids = m.tokenize("the cat\nzebra .")
  assert ids == [2, 3, 0, 1, 12]
  for seq in ([m.vocab.eos] + ids, ids + [m.vocab.eos], [m.vocab.eos, m.vocab.eos] + ids):
    assert m.detokenize(seq) == m.generator.detokenize(seq)
  assert m.detokenize([m.vocab.eos] + ids) == "\nthe cat\n<unk> ."
  # A continuation reads on from its prompt: `prompt + text` is the whole text's detokenisation
  text = m.generator.text
  assert text.continuation("the cat", [4, 5]) == " sat on" and text.continuation("the cat ", [4]) == "sat"
  assert text.continuation("the cat", [0, 4]) == "\nsat" and text.continuation("the cat\n", [4]) == "sat"
  out = m.generate("the cat", max_new_tokens=4, temperature=0.0, memory="none")
  shown = out.ids[:-1] if out.stopped == "eos" else out.ids
  assert "the cat" + out.text == m.detokenize(m.tokenize("the cat") + shown)


def test_load_a_fairseq_checkpoint(tmp_path, monkeypatch):
  from tests.test_fairseq_import import import_torch, write_checkpoint, write_dict
  torch = import_torch()
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
  # the import's options: checked as given, before the checkpoint is read
  for kwargs, said in [(dict(trust_pickle="no"), r"^trust_pickle must be True or False, got 'no'"),
                       (dict(out=""), r"^out= is empty"), (dict(key_type="bogus"), r"^key_type must be one of")]:
    with pytest.raises(ConfigError, match=said):
      trime_jax.load(ckpt_path, dictionary=dict_path, **kwargs)
  with pytest.raises(ConfigError, match=r"^dictionary= is for a fairseq checkpoint \(a .pt file\); .* is a folder"):
    trime_jax.load(ref_dir, dictionary=dict_path)
  with pytest.raises(ConfigError, match=r"^overwrite: options of a fairseq checkpoint's import"):
    trime_jax.load(ref_dir, overwrite=True)
  with pytest.raises(CheckpointError, match=r"overwrite=True"):  # the same out= again: refused, then replaced
    trime_jax.load(ckpt_path, dictionary=dict_path, out=str(tmp_path / "imported"))
  again = trime_jax.load(ckpt_path, dictionary=dict_path, out=str(tmp_path / "imported"), overwrite=True)
  np.testing.assert_array_equal(again.score(text, memory="local").log_probs, a.log_probs)
  # Without out=: a temporary export that lives as long as the Model
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp))
  temporary = trime_jax.load(ckpt_path, dictionary=dict_path)
  directory = temporary.directory
  assert os.path.dirname(directory) == str(tmp) and os.path.isfile(os.path.join(directory, "meta.json"))
  np.testing.assert_array_equal(temporary.score(text, memory="local").log_probs, a.log_probs)
  del temporary
  gc.collect()
  assert not os.path.exists(directory)


def test_a_failed_fairseq_import_leaves_no_temporary_directory(tmp_path, monkeypatch):
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp))
  (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
  (tmp_path / "dict.txt").write_text("the 5\n")
  with pytest.raises(CheckpointError, match="not a torch checkpoint"):
    trime_jax.load(tmp_path / "bad.pt", dictionary=tmp_path / "dict.txt")
  assert os.listdir(tmp) == []


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
  assert trime_jax.load("demo/").directory == model.directory  # a trailing slash, as a shell completes it
