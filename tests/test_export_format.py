"""docs/export_format.md against the code: the parameter tables (every path and shape of every backbone variant),
the files and meta fields of a trained export, the digests as the page describes them, and its plain orbax +
Flax loading example run on a tiny export."""

import hashlib
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from tests.helpers import REPO, tiny_config, write_text_file
from trime_jax import data, exports
from trime_jax.model import ModelConfig, build_model
from trime_jax.mt.model import MTConfig, TransformerMT
from trime_jax.srupp import SRUppConfig
from trime_jax import specs

DOC = os.path.join(REPO, "docs", "export_format.md")


def _doc() -> str:
  with open(DOC, encoding="utf-8") as f:
    return f.read()


def _tables() -> dict:
  """{section title: [(path pattern, shape expression)]} of the parameter tables, by `### ` section."""
  out, section = {}, None
  for line in _doc().splitlines():
    if line.startswith("### "):
      section = line[4:]
      out[section] = []
    m = re.match(r"\| `([^`]+)` \| `\[([^`]*)\]` \|", line)
    if m and section:
      out[section].append((m.group(1), m.group(2)))
  return out


def _leaves(model) -> dict:
  """{'a/0/b': shape} of a model's parameters (nnx.State paths, '/'-joined)."""
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(pure)}


def _match(rows, path):
  """(shape expression, {"i": index}) of the documented row matching `path`, or None."""
  for pattern, shape in rows:
    m = re.fullmatch(re.escape(pattern).replace(r"\{i\}", r"(\d+)"), path)
    if m:
      return pattern, shape, ({"i": int(m.group(1))} if m.groups() else {})
  return None


def _check(rows, model, symbols, used: set):
  for path, shape in _leaves(model).items():
    found = _match(rows, path)
    assert found, f"{path} {shape} is not in docs/export_format.md"
    pattern, expr, index = found
    ns = symbols(path)
    assert tuple(eval(f"({expr},)", {}, {**ns, **index})) == shape, (path, expr, shape)  # noqa: S307 - our doc
    used.add(pattern)


def _lm_symbols(cfg):
  def symbols(path):
    factor = cfg.adaptive_softmax_factor if path.startswith("adaptive_softmax") else cfg.adaptive_input_factor
    edges = cfg.band_edges
    return {"V": cfg.vocab_size, "D": cfg.d_model, "F": cfg.d_ff, "P": cfg.max_len + cfg.position_offset,
            "k": len(edges) - 2, "c1": edges[1], "n": lambda i: edges[i + 1] - edges[i],
            "d": lambda i: int(cfg.d_model // factor ** i)}
  return symbols


def _abstract(make):
  return nnx.eval_shape(lambda: make(nnx.Rngs(0)))


def test_transformer_table_lists_every_parameter_with_its_shape():
  rows = _tables()["Transformer LM (`model.backbone = \"transformer\"`, `trime_jax/model.py`)"]
  used = set()
  variants = [
      dict(num_layers=2),
      dict(num_layers=1, tie_embeddings=False, positions="learned", position_offset=2, final_norm=False),
      dict(num_layers=1, adaptive_input=True, adaptive_softmax=True, adaptive_cutoffs=(100, 500)),
      dict(num_layers=1, adaptive_input=True, adaptive_softmax=True, adaptive_cutoffs=(100, 500),
           tie_adaptive_proj=True),
      dict(num_layers=1, tie_embeddings=False, adaptive_input=True, adaptive_softmax=True,
           adaptive_cutoffs=(100, 500), adaptive_input_factor=2.0, adaptive_softmax_factor=4.0),
  ]
  for kw in variants:
    cfg = ModelConfig(vocab_size=1000, d_model=64, num_heads=4, d_ff=96, **kw)
    _check(rows, _abstract(lambda r: build_model(cfg, rngs=r)), _lm_symbols(cfg), used)
  assert used == {p for p, _ in rows}, f"documented but never built: {sorted({p for p, _ in rows} - used)}"


def test_srupp_table_lists_every_parameter_with_its_shape():
  rows = next(v for k, v in _tables().items() if k.startswith("SRU++"))
  used = set()
  for kw in (dict(num_layers=2, attention_every=2), dict(num_layers=1, layer_norm=True, attn_dim=24)):
    cfg = SRUppConfig(vocab_size=300, d_model=64, **kw)
    symbols = lambda path, cfg=cfg: {"V": cfg.vocab_size, "D": cfg.d_model, "A": cfg.attn_dim}
    _check(rows, _abstract(lambda r: build_model(cfg, rngs=r)), symbols, used)
  assert used == {p for p, _ in rows}, sorted({p for p, _ in rows} - used)


def test_mt_table_lists_every_parameter_with_its_shape():
  rows = next(v for k, v in _tables().items() if k.startswith("Translation model"))
  used = set()
  for kw in (dict(share_decoder_embeddings=False), dict(share_decoder_embeddings=False, tgt_vocab_size=200),
             dict(share_all_embeddings=True, encoder_normalize_before=True, decoder_normalize_before=True)):
    cfg = MTConfig(vocab_size=300, d_model=64, d_ff=96, encoder_layers=2, decoder_layers=1, **kw)
    symbols = lambda path, cfg=cfg: {"V": cfg.vocab_size, "V_tgt": cfg.target_vocab_size, "D": cfg.d_model,
                                     "F": cfg.d_ff}
    _check(rows, _abstract(lambda r: TransformerMT(cfg, rngs=r)), symbols, used)
  assert used == {p for p, _ in rows}, sorted({p for p, _ in rows} - used)


@pytest.fixture(scope="module")
def trained_export(tmp_path_factory):
  """The export of a 2-update byte-level training run (what `trime_jax.launch.train` writes)."""
  from trime_jax.train import train_and_evaluate

  root = tmp_path_factory.mktemp("export_format")
  corpus = write_text_file(root / "corpus.txt", 8_000)
  cfg = tiny_config(corpus, **{"train.num_steps": 2, "train.checkpoint_every": 2, "train.eval_max_tokens": 64,
                               "train.keep_best": False})
  return train_and_evaluate(cfg, str(root / "run"))["export"]


def _loading_example() -> str:
  section = _doc().split("## Loading it with plain orbax and Flax", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_example(export_dir: str) -> dict:
  code = _loading_example()
  assert 'export = os.path.abspath("runs/mini/export")' in code
  ns = {}
  exec(code.replace('"runs/mini/export"', repr(export_dir)), ns)  # noqa: S102 - the documented snippet
  return ns


def test_files_and_meta_fields_of_a_trained_export(trained_export):
  doc = _doc()
  names = sorted(os.listdir(trained_export))
  assert names == ["config.json", "meta.json", "params", "vocab.json"]
  for name in names:
    assert f"| `{name}" in doc
  meta = json.load(open(os.path.join(trained_export, "meta.json")))
  rows = 0
  for line in doc.split("## meta.json", 1)[1].split("## Digests", 1)[0].splitlines():
    m = re.match(r"\| `([^|]+)` \| (every export|LM exports|`<workdir>/export`) \|", line)
    if m:
      rows += 1
      for field in re.findall(r"`([^`]+)`", m.group(1)):
        assert field in meta, field
  assert rows >= 5, rows  # the table's rows were read (a changed layout would check nothing)
  documented = set(re.findall(r"^\| `([a-z_]+)`", doc.split("## meta.json", 1)[1], re.M))
  documented |= {"best_metric", "dev_ppl", "imported_from", "fairseq_arch", "fairseq_dict", "valid", "plan"}
  assert set(meta) <= documented, set(meta) - documented
  vocab = json.load(open(os.path.join(trained_export, "vocab.json")))
  assert set(vocab) == {"kind", "fingerprint", "tokens"} and vocab["fingerprint"] == meta["vocab_fingerprint"]


def test_stored_config_finds_the_data_from_another_directory(trained_export, tmp_path, monkeypatch):
  """meta.json's data_path (absolute) serves when the stored data.path is relative and not found from the working
  directory: `--checkpoint=EXPORT` without `--config` evaluates from anywhere (it looked in the working directory
  and the repository's root only). A relative path found from here, or a recorded path that is gone, is kept."""
  meta = json.load(open(os.path.join(trained_export, "meta.json")))
  data_file = meta["data_path"]
  assert os.path.isabs(data_file) and os.path.isfile(data_file)
  export = tmp_path / "export"
  shutil.copytree(trained_export, export)
  config = json.load(open(export / "config.json"))
  config["data"]["path"] = "corpus.txt"  # relative, as given in the directory the training ran in
  (export / "config.json").write_text(json.dumps(config))
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  assert exports.stored_over_defaults(str(export)).data.path == data_file
  (elsewhere / "corpus.txt").write_text("here")  # found from the working directory: that one is read
  assert exports.stored_over_defaults(str(export)).data.path == "corpus.txt"
  os.remove(elsewhere / "corpus.txt")
  (export / "meta.json").write_text(json.dumps({**meta, "data_path": str(tmp_path / "gone.txt")}))
  assert exports.stored_over_defaults(str(export)).data.path == "corpus.txt"  # the not-found error names it


def test_loading_example_restores_the_trained_parameters(trained_export):
  ns = _run_example(trained_export)
  model, meta = ns["model"], ns["meta"]
  graphdef, params, config, vocab, _ = exports.load_export(trained_export)
  ref = nnx.merge(graphdef, params)
  for (pa, a), (pb, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)),
                              jax.tree_util.tree_leaves_with_path(params)):
    assert pa == pb
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens = jax.numpy.array([[1, 2, 3]])
  np.testing.assert_array_equal(np.asarray(ns["logits"]), np.asarray(ref(tokens)[0]))
  assert ns["logits"].shape == (1, 3, meta["vocab_size"]) and ns["keys"].shape == (1, 3, meta["d_model"])


def test_loading_example_works_for_srupp(tmp_path):
  """The same snippet builds the other backbone from config.json (model.backbone)."""
  cfg = tiny_config(tmp_path / "unused.txt", **{"model.backbone": "srupp", "model.key_type": "final"})
  vocab = data.Vocab.bytes()
  src = build_model(specs.model_config(cfg, vocab_size=len(vocab)), rngs=nnx.Rngs(3))
  directory = exports.export(str(tmp_path / "export"), nnx.state(src, nnx.Param), cfg, vocab, extra={"step": 0})
  ns = _run_example(directory)
  assert type(ns["model"]).__name__ == "SRUppLM"
  np.testing.assert_array_equal(np.asarray(ns["logits"]), np.asarray(src(jax.numpy.array([[1, 2, 3]]))[0]))


def test_digests_as_documented(trained_export):
  """params_digest, arch_digest and the vocabulary fingerprint recomputed from the page's description."""
  meta = json.load(open(os.path.join(trained_export, "meta.json")))
  model = _run_example(trained_export)["model"]
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
    arr = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)}:{arr.shape}:{arr.dtype}".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  assert h.hexdigest()[:16] == meta["params_digest"]
  assert "['blocks'][0]['attn']['out']['bias'].value" in [jax.tree_util.keystr(p) for p, _ in
                                                          jax.tree_util.tree_leaves_with_path(
                                                              nnx.state(model, nnx.Param))]

  config = json.load(open(os.path.join(trained_export, "config.json")))
  import dataclasses

  fields = {k: v for k, v in dataclasses.asdict(specs.model_config(config, meta["vocab_size"])).items()
            if "dropout" not in k and k not in exports.EXECUTION_FIELDS and k not in exports.PROTOCOL_FIELDS
            and not (k in exports.LATER_FIELDS and v == exports.LATER_FIELDS[k])}
  assert hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16] == meta["arch_digest"]

  tokens = json.load(open(os.path.join(trained_export, "vocab.json")))["tokens"]
  h = hashlib.sha256(meta["vocab_kind"].encode())
  for t in tokens:
    h.update(t.encode("utf-8", "surrogatepass") + b"\0")
  assert h.hexdigest()[:16] == meta["vocab_fingerprint"]
  assert exports.fingerprint(trained_export) == \
      f"{meta['vocab_fingerprint']}-{meta['params_digest']}-{meta['arch_digest']}"


def test_restore_without_a_target_gives_what_the_page_says(trained_export):
  """Without an abstract target orbax returns dicts with string indices and `value` leaves (why the page
  passes one)."""
  import orbax.checkpoint as ocp

  raw = ocp.StandardCheckpointer().restore(os.path.join(trained_export, "params"))
  assert set(raw["blocks"]) == {"0"} and set(raw["embed"]["embedding"]) == {"value"}


def test_parameters_of_another_shape_are_refused_on_export_and_on_load(trained_export, tmp_path):
  """orbax restores whatever shapes are stored: an export whose parameters do not fit its config's model must
  fail when written (exports.export) and, if written by other means, when loaded (load_export), with one
  CheckpointError naming the first differing array, not later inside the model's first matmul."""
  from trime_jax.errors import CheckpointError

  _, params, config, vocab, meta = exports.load_export(trained_export)
  wider = config.copy_and_resolve_references()
  wider.model.d_model = 2 * int(config.model.d_model)
  with pytest.raises(CheckpointError, match="do not match the config's model"):
    exports.export(str(tmp_path / "refused"), params, wider, vocab)
  assert not os.path.exists(tmp_path / "refused")
  # The same mismatch written around export's check (write_export is the raw writer): load_export refuses it.
  forged = str(tmp_path / "forged")

  def files(tmp):
    data.atomic_write_json(os.path.join(tmp, "config.json"), json.loads(wider.to_json_best_effort()))
    data.atomic_write_json(os.path.join(tmp, "vocab.json"), vocab.to_json())

  exports.write_export(forged, params, {k: v for k, v in meta.items() if k != "arch_digest"}, files)
  with pytest.raises(CheckpointError, match="does not match this config's model"):
    exports.load_export(forged)


def test_a_truncated_or_missing_parameter_file_is_named_before_orbax_reads(trained_export, tmp_path, monkeypatch):
  """meta.json's params_files (bytes per file under params/): a truncated copy is one DamagedCheckpointError
  naming the file, raised before orbax's restore starts (a restore that fails midway leaves its background
  readers printing "Event loop is closed" tracebacks after the error); an export without the field (written
  before it) still loads."""
  import shutil

  from trime_jax.errors import DamagedCheckpointError

  meta = json.load(open(os.path.join(trained_export, "meta.json")))
  params_dir = os.path.join(trained_export, "params")
  assert meta["params_files"] == exports.params_file_sizes(params_dir) and len(meta["params_files"]) >= 3
  copy = tmp_path / "copy"
  shutil.copytree(trained_export, copy)
  biggest = max(meta["params_files"], key=meta["params_files"].get)
  with open(copy / "params" / biggest, "r+b") as f:
    f.truncate(meta["params_files"][biggest] // 2)

  def no_restore(*a, **k):
    raise AssertionError("orbax restore reached")

  with monkeypatch.context() as m:
    m.setattr(exports.ocp.StandardCheckpointer, "restore", no_restore)
    with pytest.raises(DamagedCheckpointError, match=rf"{re.escape(str(copy / 'params' / biggest))} has [\d,]+ "
                                                     r"bytes, [\d,]+ when exported \(truncated"):
      exports.load_export(str(copy))
    os.remove(copy / "params" / biggest)
    with pytest.raises(DamagedCheckpointError, match=rf"{re.escape(str(copy / 'params' / biggest))} is missing"):
      exports.load_export(str(copy))
  shutil.copy(os.path.join(params_dir, biggest), copy / "params" / biggest)
  old = {k: v for k, v in meta.items() if k != "params_files"}
  (copy / "meta.json").write_text(json.dumps(old))
  assert exports.params_digest(exports.load_export(str(copy))[1]) == meta["params_digest"]


def test_loaded_parameters_live_on_the_device():
  """load_export's parameters are device arrays, so the evaluator's and the datastore builder's jitted steps
  do not copy the model from the host at every call (orbax restores an unsharded target as NumPy)."""
  _, params, _, _, _ = exports.load_export(os.path.join(REPO, "trime_jax", "pretrained", "demo"))
  leaves = jax.tree_util.tree_leaves(params)
  assert leaves and all(isinstance(x, jax.Array) for x in leaves)
  with jax.transfer_guard_host_to_device("disallow"):
    jax.jit(lambda p: sum(x.sum() for x in jax.tree_util.tree_leaves(p)))(params).block_until_ready()


def test_export_config_reads_a_shipped_models_name():
  """`--config=launch/export_config.py:demo` reads the shipped model as `--checkpoint=demo` does (it looked for
  ./demo/config.json; found by a walk-through)."""
  from trime_jax.launch import export_config
  from trime_jax import exports as E

  shipped = E.stored_over_defaults(E.export_path("demo"))
  assert export_config.get_config("demo").to_dict() == shipped.to_dict()
