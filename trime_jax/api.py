"""The Python API: load a model, score text, generate with memory, give it documents to remember, train.

    import trime_jax

    model = trime_jax.load("runs/mini/export")    # an export; load("demo"): the byte-level model shipped in the
                                                   # package; load("checkpoint_best.pt", dictionary="dict.txt")
    s = model.score("The album was released in the United States .", memory="local")
    s.ppl, s.tokens, s.log_probs                         # perplexity, token strings, log P(token) of each
    model.memory.add(["= Robert Boulter = Robert Boulter is an English actor ..."])  # a long-term memory
    out = model.generate("Robert Boulter is", max_new_tokens=20, temperature=0.0, memory="long")
    out.text
    trime_jax.train(config, "runs/x")                    # = trime_jax.train.train_and_evaluate(config, "runs/x")

Everything here wraps the library's own functions: `exports.load_export`, `fairseq_import.import_to_export`,
`evaluate.evaluate` (scoring: the evaluator's windows and memories, per token) and `generate.Generator`
(generation: its key/value-cache decoder and sampling). The memories are the evaluator's and the generator's:

  none      the model alone
  local     plus the earlier tokens of the text (the window it is scored or generated in)
  long      plus a long-term store: the documents in `model.memory` (and, when scoring, the text's own earlier
            windows)
  external  plus the top-K entries of a datastore (`datastore=`, built by `trime_jax.launch.build_datastore` from this
            export) and, when `model.memory` holds documents, those too
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np

from trime_jax import data, evaluate, exports
from trime_jax.errors import ConfigError

MEMORIES = ("none", "local", "long", "external")
STORE_ROUND = 1024  # long-term store sizes are rounded up to this, so texts of similar length share one compile


@dataclasses.dataclass
class TextScore:
  """One text's score: every token's log-probability under the chosen memory, and their mean as perplexity."""

  text: str
  tokens: list  # the token strings (bytes models: one byte each, as `<0x41>`)
  ids: np.ndarray  # int32 [n]
  log_probs: np.ndarray  # float32 [n]: log P(token i | tokens before it, memory), natural log

  @property
  def nll(self) -> float:
    """Mean negative log-likelihood per token, in nats."""
    return float(-np.mean(self.log_probs, dtype=np.float64)) if len(self.log_probs) else float("nan")

  @property
  def ppl(self) -> float:
    return float(np.exp(min(self.nll, 700.0)))


@dataclasses.dataclass
class Output:
  """One prompt's continuation."""

  prompt: str
  text: str  # the generated text (without the prompt)
  ids: list  # its token ids
  stopped: str  # "eos" (a word model wrote </s>) | "budget" (max_new_tokens)
  trace: list  # generate.TraceStep per token when trace=True: its probability and the memories that gave most


class Memory:
  """A long-term memory the user fills with documents: `add(texts)`, `clear()`, `len()` (tokens held).

  Scoring with memory="long" (or "external") reads the documents before the text in one stream, as the
  evaluator's long-term memory reads the earlier part of a document: the text's queries see every document
  token's key, and its first window also reads the documents' last `eval.context_window` tokens as context.
  Generation reads their keys into the generator's long-term store (`Generator.read`)."""

  def __init__(self, model: "Model"):
    self._model = model
    self.documents: list[np.ndarray] = []  # token ids of each document, in the order added
    self._store = None  # generate.LongTermMemory, filled on the first generation that needs it

  def add(self, texts) -> int:
    """Remember `texts` (a string or a list of strings), in order; returns the number of tokens added."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    added = 0
    for text in texts:
      ids = np.asarray(self._model.tokenize(text), np.int32)
      if not len(ids):
        raise ConfigError("a memory document is empty")
      self.documents.append(ids)
      if self._store is not None:
        self._model.generator.read(self._store, text)
      added += len(ids)
    return added

  def clear(self) -> None:
    self.documents.clear()
    self._store = None

  def __len__(self) -> int:
    return int(sum(len(d) for d in self.documents))

  def tokens(self) -> np.ndarray:
    return np.concatenate(self.documents) if self.documents else np.zeros((0,), np.int32)

  def store(self):
    """The generator's long-term store holding every document's keys (`generate.LongTermMemory`)."""
    if self._store is None:
      gen = self._model.generator
      store = gen.new_store()
      for ids in self.documents:
        store.add(gen.keys_of(ids.tolist()), ids)
      self._store = store
    return self._store


class Model:
  """An exported model with the API's methods; `trime_jax.load` makes one."""

  def __init__(self, directory: str):
    self.directory = os.path.abspath(directory)
    self.graphdef, self.params, self.config, self.vocab, self.meta = exports.load_export(self.directory)
    self.memory = Memory(self)
    self.stateful = bool(getattr(self.nnx_model, "stateful", False))  # SRU++: state carried across windows
    self._generator = None
    self._external = {}

  def __repr__(self) -> str:
    return (f"trime_jax.Model({self.directory!r}: {self.meta['num_params']:,} parameters, "
            f"{self.config.model.get('backbone', 'transformer')}, vocabulary {len(self.vocab)} ({self.vocab.kind}))")

  # -- the pieces -------------------------------------------------------------------------------------------
  @property
  def nnx_model(self):
    """The Flax NNX module with the exported parameters."""
    from flax import nnx

    return nnx.merge(self.graphdef, self.params)

  @property
  def generator(self):
    """The `generate.Generator` of this export (built on first use; the transformer backbone only)."""
    if self._generator is None:
      from trime_jax import generate

      self._generator = generate.Generator(self.directory, log=lambda msg: None)
    return self._generator

  @property
  def default_tau(self) -> float:
    """τ the export was evaluated with (config eval.tau): the default of score and generate."""
    return float(self.config.eval.tau)

  def tokenize(self, text: str) -> list[int]:
    """Token ids of `text` as the model reads it: its UTF-8 bytes (byte models), or its words with `</s>` at each
    line end (word models; words outside the vocabulary read as <unk>)."""
    if self.vocab.kind == "bytes":
      return list(text.encode("utf-8"))
    ids = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
      ids += self.vocab.encode_words(line.split())
      if i < len(lines) - 1:
        ids.append(self.vocab.eos)
    return ids

  def detokenize(self, ids) -> str:
    if self.vocab.kind == "bytes":
      return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
    return " ".join(self.vocab.tokens[int(i)] for i in ids).replace(f" {data.EOS} ", "\n").replace(
        f" {data.EOS}", "\n")

  def external(self, datastore: str, *, k: int | None = None, index: str = ""):
    """The datastore + FAISS index at `datastore` (`knn.ExternalMemory`, checked against this export); cached."""
    from trime_jax import knn

    e = self.config.eval
    key = (os.path.abspath(datastore), k, index)
    if key not in self._external:
      self._external[key] = knn.ExternalMemory(datastore, index_path=index, checkpoint_dir=self.directory,
                                               k=int(k or e.knn_k), nprobe=int(e.nprobe))
    return self._external[key]

  # -- scoring ----------------------------------------------------------------------------------------------
  def score(self, texts, memory: str = "local", *, tau: float | None = None, datastore: str | None = None,
            k: int | None = None):
    """Per-token log-probabilities and perplexity of each text (a string gives one TextScore, a list a list).

    Each text is scored on its own (one stream starting at `</s>`), in the export's evaluation windows
    (eval.block_len, eval.context_window), with `memory` (none | local | long | external, see the module
    docstring) at τ = `tau` on memory similarities (default: the export's eval.tau). `datastore`, `k`: external
    memory's datastore directory and entries retrieved per token (default eval.knn_k)."""
    if memory not in MEMORIES:
      raise ConfigError(f"memory must be one of {MEMORIES}, got {memory!r}")
    if (memory == "external") != (datastore is not None):
      raise ConfigError("memory='external' needs datastore=DIR (and datastore= needs memory='external')")
    single = isinstance(texts, str)
    texts = [texts] if single else list(texts)
    tau = self.default_tau if tau is None else float(tau)
    point = {"none": evaluate.NONE, "local": evaluate.Point("trime_local", tau=tau),
             "long": evaluate.Point("trime_local", tau=tau), "external": evaluate.Point("trime", tau=tau)}[memory]
    external = self.external(datastore, k=k) if memory == "external" else None
    e = self.config.eval
    block_len = min(int(e.block_len), int(self.config.model.max_len))
    context = 0 if self.stateful else min(int(e.context_window), block_len - 1)
    prefix = self.memory.tokens() if memory in ("long", "external") else np.zeros((0,), np.int32)
    out = []
    for text in texts:
      ids = np.asarray(self.tokenize(text), np.int32)
      if not len(ids):
        raise ConfigError("cannot score an empty text")
      corpus = data.Corpus.from_docs([d for d in (prefix, ids) if len(d)], self.vocab)
      mem_size = 0
      if memory in ("long", "external"):  # every earlier token of the stream fits in the store
        mem_size = -(-len(corpus) // STORE_ROUND) * STORE_ROUND
      result = evaluate.evaluate(self.graphdef, self.params, corpus, [point], block_len=block_len,
                                 context_window=context, streams=1, long_term=evaluate.StoreSpec(mem_size=mem_size),
                                 external=external, per_token=True)
      log_probs = -np.asarray(result.token_nll[0][len(prefix):], np.float32)
      out.append(TextScore(text, [self.vocab.tokens[i] for i in ids], ids, log_probs))
    return out[0] if single else out

  # -- generation -------------------------------------------------------------------------------------------
  def generate(self, prompts, *, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, memory: str = "local", datastore: str | None = None,
               tau: float | None = None, k: int | None = None, trace: bool = False):
    """Continue each prompt (a string gives one Output, a list a list): `temperature` (of sampling; 0 is greedy),
    `tau` (τ on memory similarities, default the export's eval.tau), `top_p` /
    `top_k` filter the distribution (1.0 / 0: off), `seed` fixes the draws. `memory`: none | local | long (the
    documents in `model.memory`) | external (`datastore=DIR`, plus `model.memory` when it holds documents).
    `trace`: each Output.trace lists every token's probability and the memories that contributed most.
    Generation does not add the prompts or outputs to `model.memory` (`model.memory.add` does)."""
    from trime_jax import generate

    if memory not in MEMORIES:
      raise ConfigError(f"memory must be one of {MEMORIES}, got {memory!r}")
    if (memory == "external") != (datastore is not None):
      raise ConfigError("memory='external' needs datastore=DIR (and datastore= needs memory='external')")
    if memory == "long" and not self.memory.documents:
      raise ConfigError("memory='long' reads model.memory, which is empty: model.memory.add(texts) first")
    single = isinstance(prompts, str)
    gen = self.generator
    store = self.memory.store() if memory in ("long", "external") and self.memory.documents else None
    results = gen.generate([prompts] if single else list(prompts), max_new_tokens=max_new_tokens,
                           sampling=generate.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                           memory=generate.MemorySpec(memory, tau=tau),
                           store=store, external=self.external(datastore, k=k) if datastore else None,
                           trace=trace, remember=False)
    out = [Output(r.prompt, r.text, list(r.tokens), r.stopped, r.trace) for r in results]
    return out[0] if single else out


# Models shipped inside the package (trime_jax/pretrained/NAME: an export), loaded by name from any directory.
# demo: make demo's TrimeLM (configs/demo.py: byte-level, 3 layers, d 128, 628k parameters, 300 updates on this
# interpreter's standard-library sources; how it was made: trime_jax/pretrained/README.md).
PRETRAINED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrained")


def pretrained_names() -> list[str]:
  """The names `load` accepts besides paths: the exports shipped in trime_jax/pretrained/."""
  if not os.path.isdir(PRETRAINED_DIR):
    return []
  return sorted(n for n in os.listdir(PRETRAINED_DIR) if os.path.isfile(os.path.join(PRETRAINED_DIR, n, "meta.json")))


def load(path: str, *, dictionary: str | None = None, out: str | None = None, trust_pickle: bool = False,
         key_type: str = "last_ffn_input") -> Model:
  """A Model from a shipped model's name (`load("demo")`, see `pretrained_names()`; a path of that name in the
  working directory wins), an export directory (`<workdir>/export`, `<workdir>/best`, a training workdir itself),
  or an original fairseq checkpoint (`.pt`) with its `dictionary` (dict.txt): imported with
  `fairseq_import.import_to_export` into `out` (default: a new temporary directory) first. `trust_pickle`,
  `key_type`: the importer's options (trime_jax.launch.import_fairseq's flags)."""
  path = os.fspath(path)
  if dictionary is not None or os.path.isfile(path):
    if dictionary is None:
      raise ConfigError(f"{path} is a file: a fairseq checkpoint needs its dictionary (load(path, dictionary=...))")
    from trime_jax import fairseq_import

    out = out or tempfile.mkdtemp(prefix="trime_jax_import_")
    path, _ = fairseq_import.import_to_export(path, dictionary, out, key_type=key_type, trust_pickle=trust_pickle)
  return Model(export_path(path))


def export_path(path: str) -> str:
  """The export directory `path` names, as `load` and every CLI's `--checkpoint` read it: a shipped model's
  name (unless a path of that name exists), a training workdir (its `export/`), or `path` itself (an export, a
  file, or a path that does not exist, left for the reader to refuse). A bare word that is neither a path nor
  a shipped model: one ConfigError listing the shipped ones."""
  path = os.fspath(path)
  if not os.path.exists(path):
    names = pretrained_names()
    if path in names:
      return os.path.join(PRETRAINED_DIR, path)
    if os.sep not in path and "." not in path:  # a bare word: most likely meant as a shipped model's name
      raise ConfigError(f"{path!r} is neither a path nor a shipped model (shipped: {', '.join(names) or 'none'})")
    return path
  if os.path.isdir(path) and not os.path.exists(os.path.join(path, "meta.json")) and os.path.exists(
      os.path.join(path, "export", "meta.json")):
    return os.path.join(path, "export")  # a training workdir
  return path


def train(config, workdir: str, **kwargs) -> dict:
  """Train (or resume) in `workdir` and export: `trime_jax.train.train_and_evaluate(config, workdir, **kwargs)`.
  Returns its metrics; the export is at result["export"] (`load` it)."""
  from trime_jax.train import train_and_evaluate

  return train_and_evaluate(config, workdir, **kwargs)
