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

Texts and prompts are strings (or lists of strings); bytes are refused, not read as token ids (decode them
first; `model.generator.generate` takes token ids). Messages (words outside the vocabulary, which index a
datastore is searched with, a prompt longer than the model's context) go to Python `logging`, loggers
`trime_jax.api` and `trime_jax.knn`, not to stdout: `logging.basicConfig(level=logging.INFO)` shows them all
(warnings show by default).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import shutil
import tempfile
import weakref

import numpy as np

from trime_jax import data, evaluate, exports, sharding
from trime_jax.errors import CheckpointError, ConfigError

MEMORIES = ("none", "local", "long", "external")
STORE_ROUND = 1024  # long-term store sizes are rounded up to this, so texts of similar length share one compile
STATES_KEPT = 4  # score(memory="long"/"external"): the memory documents' evaluated states kept (store sizes)

logger = logging.getLogger(__name__)


def _log(msg: str) -> None:
  """The `log` the API gives the generator and the tokenizer: their warnings (words outside the vocabulary) as
  logging warnings, their notes (sliding windows) as info."""
  if msg.startswith("warning: "):  # the CLIs' prefix; logging names the level itself
    logger.warning(msg[len("warning: "):])
  else:
    (logger.warning if msg.startswith("warning") else logger.info)(msg)


def _text(value, what: str) -> str:
  """`value` if it is a string, else one ConfigError naming the argument (bytes: decode them first)."""
  if isinstance(value, str):
    return value
  if isinstance(value, (bytes, bytearray, memoryview)):
    raise ConfigError(f"{what} must be text (str), got {type(value).__name__}: decode it first "
                      "(e.g. value.decode('utf-8'))")
  raise ConfigError(f"{what} must be a string, got {type(value).__name__}")


def _texts(value, what: str) -> tuple[list[str], bool]:
  """(the strings, whether one string was given) of a string or an iterable of strings (a list, a tuple, ...);
  anything else (a number, bytes, token ids) is one ConfigError naming the argument."""
  if isinstance(value, str):
    return [value], True
  if isinstance(value, (bytes, bytearray, memoryview)):
    _text(value, what)  # raises
  if isinstance(value, (dict, set, frozenset)):  # a dict's keys, a set's order: not what was meant as texts
    raise ConfigError(f"{what} must be a string or a list of strings, got {type(value).__name__}")
  try:
    items = list(value)
  except TypeError:
    raise ConfigError(f"{what} must be a string or a list of strings, got {type(value).__name__}") from None
  for i, v in enumerate(items):
    if what == "prompts" and isinstance(v, numbers.Integral) and not isinstance(v, bool):
      raise ConfigError(f"prompts[{i}] is an integer: prompts are text; to continue token ids use "
                        "model.generator.generate([ids], ...)")
    _text(v, f"{what}[{i}]")
  return items, False


def _positive(value, what: str):
  """`value` as a finite float > 0 (None stays None), else one ConfigError naming the argument (τ = inf would
  weigh every memory entry exp(0) alike: no temperature means that)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 and math.isfinite(value)):
    raise ConfigError(f"{what} must be a finite number > 0, got {value!r}")
  return float(value)


def _flag(value, what: str) -> bool:
  """`value` if it is True or False, else one ConfigError: a string such as "no" is true in Python, and some of
  these switches (trust_pickle: unpickling runs the file's code) must not be turned on by accident."""
  if not isinstance(value, (bool, np.bool_)):
    raise ConfigError(f"{what} must be True or False, got {value!r}")
  return bool(value)


def _path(value, what: str) -> str:
  """`value` (str or path-like) as a str path, a leading `~` expanded as a shell does for the CLIs' flags."""
  try:
    return os.path.expanduser(os.fspath(value))
  except TypeError:
    raise ConfigError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__}") from None


def _check_memory(memory, datastore, k, tau, index=None) -> None:
  """One ConfigError for a memory that is not one of MEMORIES, or an argument it would not use (a value given
  and ignored would read as if it had been applied)."""
  if not isinstance(memory, str) or memory not in MEMORIES:
    raise ConfigError(f"memory must be one of {MEMORIES} (or None: the export's own), got {memory!r}")
  if (memory == "external") != (datastore is not None):
    raise ConfigError("memory='external' needs datastore=DIR (and datastore= needs memory='external')")
  if k is not None and memory != "external":
    raise ConfigError(f"k= (datastore entries retrieved per token) needs memory='external'; memory={memory!r} "
                      "retrieves nothing")
  if index is not None and memory != "external":
    raise ConfigError(f"index= (a datastore's FAISS index) needs memory='external' and datastore=; memory={memory!r}")
  if tau is not None and memory == "none":
    raise ConfigError("tau= (the temperature on memory similarities) needs a memory; memory='none' has none")


@dataclasses.dataclass
class TextScore:
  """One text's score: every token's log-probability under the chosen memory, and their mean as perplexity."""

  text: str
  tokens: list  # the token strings (bytes models: one byte each, as `<0x41>`)
  ids: np.ndarray  # int32 [n]
  log_probs: np.ndarray  # float32 [n]: log P(token i | tokens before it, memory), natural log; NaN where the
  #   export's evaluation does not score a token (eval.sample_break_mode=complete drops a line longer than
  #   eval.block_len, as fairseq's eval_lm and trime_jax.launch.eval do)

  @property
  def nll(self) -> float:
    """Mean negative log-likelihood per scored token, in nats (tokens not scored, NaN, are left out as the
    evaluation leaves them out)."""
    scored = self.log_probs[~np.isnan(self.log_probs)]
    return float(-np.mean(scored, dtype=np.float64)) if len(scored) else float("nan")

  @property
  def ppl(self) -> float:
    return float(np.exp(min(self.nll, 700.0)))


@dataclasses.dataclass
class Output:
  """One prompt's continuation."""

  prompt: str
  text: str  # the generated text (without the prompt): `prompt + text` reads as one text (a word model's
  #   continuation starts with a space where the prompt does not end in whitespace; a byte model's is decoded as
  #   UTF-8 with errors replaced, so a character cut by max_new_tokens shows as U+FFFD: `ids` are exact)
  ids: list  # its token ids
  stopped: str  # "eos" (a word model wrote </s>) | "budget" (max_new_tokens)
  trace: list  # generate.TraceStep per token when trace=True: its probability and the memories that gave most


class Memory:
  """A long-term memory the user fills with documents: `add(texts)`, `clear()`, `len()` (tokens held).

  Scoring with memory="long" (or "external") reads the documents before the text in one stream, as the
  evaluator's long-term memory reads the earlier part of a document: the text's queries see every document
  token's key, and its first window also reads the documents' last `eval.context_window` tokens as context.
  Generation reads each document's keys into the generator's long-term store on its own (`Generator.read`,
  from `</s>`), and the prompt starts afresh: so with long memory, generate's law for a prompt's next token is
  not score's at the same position (the keys and the prompt's context differ). With no, local or external
  memory they agree over the evaluator's first window (prompt + output within its first eval.block_len -
  eval.context_window tokens at least; the demo's first 256); past it the contexts differ: evaluation moves its
  window by block_len - context_window tokens (context_window of context), generation slides its cache window
  by max_len // 2 (`generate`'s docstring), and generation's local memory keeps every earlier key."""

  def __init__(self, model: "Model"):
    self._model = model
    self.documents: list[np.ndarray] = []  # token ids of each document, in the order added
    self._store = None  # generate.LongTermMemory, filled on the first generation that needs it
    # score(memory="long"/"external"): the evaluator's state after the documents' windows, per store shape
    # (evaluate.StreamState), so that each text runs its own windows only; emptied whenever the memory or the
    # parameters change
    self._states: dict = {}

  def add(self, texts) -> int:
    """Remember `texts` (a string or a list of strings), in order; returns the number of tokens added. All or
    nothing: every text is tokenized (and keyed, once the generator's store exists) before any is stored, so
    a refused one (empty, not a string) leaves the memory as it was."""
    texts, _ = _texts(texts, "texts")
    docs = []
    for i, text in enumerate(texts):
      ids = np.asarray(self._model._text.tokenize(text, "memory document"), np.int32)
      if not len(ids):
        raise ConfigError("a memory document is empty" + (f" (texts[{i}]; nothing was added)" if len(texts) > 1
                                                          else ""))
      docs.append(ids)
    keys = [self._model.generator.keys_of(ids.tolist()) for ids in docs] if self._store is not None else []
    self.documents.extend(docs)
    self._states.clear()
    for k, ids in zip(keys, docs):
      self._store.add(k, ids)
    return int(sum(len(d) for d in docs))

  def clear(self) -> None:
    self.documents.clear()
    self._store = None
    self._states.clear()

  def __len__(self) -> int:
    return int(sum(len(d) for d in self.documents))

  def tokens(self) -> np.ndarray:
    return np.concatenate(self.documents) if self.documents else np.zeros((0,), np.int32)

  def store(self):
    """The generator's long-term store holding every document's keys (`generate.LongTermMemory`; empty when
    no document was added)."""
    if self._store is None:
      gen = self._model.generator
      store = gen.new_store()
      for ids in self.documents:
        store.add(gen.keys_of(ids.tolist()), ids)
      self._store = store
    return self._store

  def _forget_keys(self) -> None:
    """The model's parameters changed: the keys are recomputed where next needed (generation's store, scoring's
    states)."""
    self._store = None
    self._states.clear()

  def _keep_state(self, key, state) -> None:
    """At most STATES_KEPT states (one per store size in use), the oldest dropped first."""
    self._states.pop(key, None)
    self._states[key] = state
    while len(self._states) > STATES_KEPT:
      self._states.pop(next(iter(self._states)))


class Model:
  """An exported model with the API's methods; `trime_jax.load` makes one.

  `model.params` is the one copy of the parameters that scoring and generation both run (`model.generator`
  is built from this model's objects, not read from disk again). Assign it to change both (the long-term
  memory's generation keys are then recomputed); arrays changed in place reach scoring and generation too,
  but not keys the memory already computed."""

  def __init__(self, directory: str, devices: int | None = None):
    from trime_jax.generate.text import Text

    self.directory = os.path.abspath(_path(directory, "directory"))
    self.graphdef, self._params, stored, self.vocab, self.meta = exports.load_export(self.directory)
    # the config every CLI runs an export with: the defaults under the stored fields, a misspelt field refused
    self.config = exports.stored_over_defaults(self.directory, stored.to_dict())
    if devices is None:  # the export's eval.devices, at most this machine's (an export of an 8-GPU run loads here)
      import jax

      asked = int(self.config.eval.get("devices", 1))
      devices = min(asked, len(jax.local_devices())) if asked else 0
    self.devices = devices
    self._text = Text(self.vocab, _log)  # the generator's tokenizer: one text <-> token ids for every method
    self.memory = Memory(self)
    self.stateful = bool(getattr(self.nnx_model, "stateful", False))  # SRU++: state carried across windows
    self._generator = None
    self._external = {}
    self._exported_params, self._warned_params = self._params, set()  # (model.params = model.params: the same)

  def __repr__(self) -> str:
    return (f"trime_jax.Model({self.directory!r}: {self.meta['num_params']:,} parameters, "
            f"{self.config.model.get('backbone', 'transformer')}, vocabulary {len(self.vocab)} ({self.vocab.kind}))")

  # -- the pieces -------------------------------------------------------------------------------------------
  @property
  def params(self):
    """The exported parameters (an `nnx.State`), shared with `generator`."""
    return self._params

  @params.setter
  def params(self, value) -> None:
    self._params = value
    self._warned_params = set()  # another object than the export's: a datastore of its keys is said to differ
    if self._generator is not None:
      self._generator.params = value
    self.memory._forget_keys()

  @property
  def nnx_model(self):
    """The Flax NNX module with the exported parameters."""
    from flax import nnx

    return nnx.merge(self.graphdef, self.params)

  @property
  def generator(self):
    """The `generate.Generator` of this model (built on first use from this model's graph and parameters,
    which it shares; the transformer backbone only)."""
    if self._generator is None:
      from trime_jax import generate

      self._generator = generate.Generator(
          self.directory, log=_log, loaded=(self.graphdef, self.params, self.config, self.vocab, self.meta))
    return self._generator

  @property
  def devices(self) -> int:
    """How many of this process's devices `score` splits a list of texts over (0: all of them): the export's
    eval.devices (at most this process's devices) unless `load(..., devices=N)` or an assignment says otherwise.
    Each device scores whole texts (rows of `evaluate.texts_plan`, their count rounded up to a multiple of the
    devices), the parameters on every device, as trime_jax.launch.eval splits its streams (the same numbers up to float32 rounding). One
    text after `model.memory`'s documents is one stream: one device. Generation runs on one device."""
    return self._devices

  @devices.setter
  def devices(self, value) -> None:
    self._devices = sharding.device_count(value, "devices")

  def _device_count(self) -> int:
    import jax

    return self._devices or len(jax.local_devices())

  @property
  def default_tau(self) -> float:
    """τ the export was evaluated with (config eval.tau): the default of score and generate."""
    return float(self.config.eval.tau)

  @property
  def long_term_layout(self) -> str:
    """How score's long-term store lays out the tokens before a window (config eval.long_term_layout, as
    trime_jax.launch.eval reads it: "original" also holds the window's context tokens, "disjoint" does not)."""
    return str(self.config.eval.get("long_term_layout", "original"))

  def tokenize(self, text: str) -> list[int]:
    """Token ids of `text` as the model reads it: its UTF-8 bytes (byte models), or its words with `</s>` at each
    line end (word models; words outside the vocabulary read as <unk>, with a logging warning)."""
    return self._text.tokenize(_text(text, "text"), "text")

  def detokenize(self, ids) -> str:
    """The text of token ids (the generator's: `</s>` reads as a line end, wherever it is): integers in
    [0, vocabulary size), else one ConfigError (a negative id would read the vocabulary from its end)."""
    if isinstance(ids, (str, bytes)):
      raise ConfigError(f"ids must be a sequence of token ids (integers), got {type(ids).__name__}")
    try:
      arr = np.asarray(ids)  # a list, a tuple, a NumPy or JAX array
    except (TypeError, ValueError):
      arr = None
    if arr is None or arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
      what = type(ids).__name__ if arr is None or arr.ndim != 1 else f"{arr.dtype} values"
      raise ConfigError(f"ids must be a sequence of token ids (integers), got {what}"
                        + (f" of shape {arr.shape}" if arr is not None and arr.ndim != 1 else ""))
    bad = arr[(arr < 0) | (arr >= len(self.vocab))]
    if bad.size:
      raise ConfigError(f"ids must be integers in [0, {len(self.vocab)}) (the vocabulary), got {int(bad[0])}")
    return self._text.detokenize(arr.tolist())

  def _k(self, k) -> int:
    """Entries retrieved per token: `k`, or the export's eval.knn_k when None."""
    if k is None:
      return int(self.config.eval.knn_k)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
      raise ConfigError(f"k (datastore entries retrieved per token) must be an integer >= 1, got {k!r} "
                        f"(None: the export's eval.knn_k, {self.config.eval.knn_k})")
    return int(k)

  def external(self, datastore: str, *, k: int | None = None, index: str = ""):
    """The datastore + FAISS index at `datastore` (`knn.ExternalMemory`, checked against this export), with the
    export's eval.nprobe, eval.knn_exact and eval.knn_gpu as trime_jax.launch.eval uses them; cached. `k`:
    entries retrieved per token (default eval.knn_k). Paths: strings or path-like. Always a FAISS search: the
    stored eval.index (a path of the machine that evaluated) is not read, `index` names the file; the exact
    on-device memory (eval.datastore_on_device) is trime_jax.launch.eval_ext's, not the API's."""
    from trime_jax import knn
    from trime_jax.datastore import default_index_path

    e = self.config.eval
    datastore, index, k = _path(datastore, "datastore"), _path(index, "index"), self._k(k)
    def stamp(path):  # a datastore or index rebuilt in place since it was opened is opened again
      try:
        return os.stat(path).st_mtime_ns
      except OSError:
        return None

    # One open datastore + index per path, whatever k (a k sweep must not hold a copy of the index per k)
    key = (os.path.abspath(datastore), os.path.abspath(index) if index else "",
           stamp(os.path.join(datastore, "meta.json")), stamp(index or default_index_path(datastore)))
    if key not in self._external:
      self._external = {c: v for c, v in self._external.items() if c[:2] != key[:2]}  # not the stale one
      if e.get("datastore_on_device", False):
        logger.info("the export's eval.datastore_on_device is trime_jax.launch.eval_ext's: the API searches the "
                    "FAISS index (top-K)")
      from trime_jax.generate.generator import retrieval_settings
      self._external[key] = knn.ExternalMemory(datastore, index_path=index, checkpoint_dir=self.directory,
                                               log=knn.logger.info, **retrieval_settings(self.config, k=k))
    if self._params is not self._exported_params and key not in self._warned_params:  # once per datastore
      self._warned_params.add(key)
      logger.warning("warning: model.params was assigned: the datastore %s holds keys of the exported parameters, "
                     "which the model's queries no longer are (build a datastore of the new parameters: export "
                     "them, then trime_jax.launch.build_datastore)", datastore)
    return self._external[key].with_k(k)

  # -- scoring ----------------------------------------------------------------------------------------------
  def _memory(self, memory):
    """`memory`, or when None the export's own: "none" for a model trained without memory (trime.memory=none,
    the vanilla model, scored alone as launch.eval's first row scores it), else "local"."""
    from trime_jax.generate.generator import default_memory
    return default_memory(self.config) if memory is None else memory

  def score(self, texts, memory: str | None = None, *, tau: float | None = None, datastore: str | None = None,
            k: int | None = None, index: str | None = None):
    """Per-token log-probabilities and perplexity of each text (a string gives one TextScore, a list a list).

    Each text is scored on its own (one stream starting at `</s>`) as trime_jax.launch.eval scores a split,
    with the export's evaluation settings: its windows (eval.block_len, eval.context_window,
    eval.sample_break_mode: "complete" packs whole lines into blocks, and a line longer than eval.block_len
    is not scored, NaN in log_probs, under eval.complete_overlong="drop", or refused under "refuse"; a text
    without a line end is one line, and a text none of whose lines fits is one ConfigError, nothing of it
    being scored), eval.knn_exact / eval.nprobe for a datastore and train.vocab_chunk.
    `memory`: none | local | long | external, see the module docstring (default None: "none" for a model
    trained without memory, "local" for a TRIME model), at τ = `tau` on memory similarities (default: the
    export's eval.tau). `datastore`, `k`: external memory's datastore directory (a string or a path) and entries
    retrieved per token (an integer >= 1, default eval.knn_k); `index`: its FAISS index file (default
    `<datastore>/index.faiss`, as `Model.external`). An argument the memory would not use (k or index without
    memory="external", tau with memory="none") is refused, not ignored.

    A list of texts runs in one pass per row length (each step feeds a window of a different text to each
    row, `evaluate.texts_plan`; rows as long as the texts' longest window, `evaluate.row_length`, not
    eval.block_len), each scored as if alone: the same numbers up to the float rounding of other shapes
    (`tests/test_api.py`; `python -m bench.score_texts`). So are "long" and "external" while `model.memory` is
    empty (each text's store then holds its own earlier tokens only); with documents in it, one text after
    another, as follows.

    memory="long" and "external" read `model.memory`'s documents before the text (an empty memory: local
    memory alone, plus the text's own earlier windows), as if they were part of it. A text is one document: its
    store is not emptied at document boundaries inside it, whatever the export's eval.reset_at_documents (the
    evaluator empties it at each WikiText heading where that is True): score each document as its own text.
    The documents' windows run once per store size (the store holds every token: its size is the documents'
    and the text's length rounded up to STORE_ROUND) and memory content: the evaluator's state after them
    (`evaluate.StreamState`) is kept, and each later text of a similar length runs its own windows only, the
    same numbers as a whole pass (`tests/test_api.py`). Every window still searches a store as long as the
    documents."""
    texts, single = _texts(texts, "texts")
    memory = self._memory(memory)
    tau = _positive(tau, "tau")
    if k is not None:
      self._k(k)  # a wrong k is refused as such, whatever the memory
    _check_memory(memory, datastore, k, tau, index)
    tau = self.default_tau if tau is None else tau
    point = {"none": evaluate.NONE, "local": evaluate.Point("trime_local", tau=tau),
             "long": evaluate.Point("trime_local", tau=tau), "external": evaluate.Point("trime", tau=tau)}[memory]
    external = self.external(datastore, k=k, index=index or "") if memory == "external" else None
    e = self.config.eval
    block_len = min(int(e.block_len), int(self.config.model.max_len))
    context = 0 if self.stateful else min(int(e.context_window), block_len - 1)
    # what trime_jax.evaluate.runner passes the evaluator besides the split and the points
    break_mode = str(e.get("sample_break_mode", "none"))
    overlong = str(e.get("complete_overlong", "drop"))
    vocab_chunk = int(self.config.get("train", {}).get("vocab_chunk", 0))
    prefix = self.memory.tokens() if memory in ("long", "external") else np.zeros((0,), np.int32)
    unknown = set()  # one warning for all the texts (it was one per text)
    ids_of = [np.asarray(self._text.tokenize(text, "text", unknown), np.int32) for text in texts]  # all, first
    self._text.warn_unknown(unknown, "the text" if single else f"the {len(texts)} texts")
    empty = [i for i, ids in enumerate(ids_of) if not len(ids)]
    if empty:
      raise ConfigError("cannot score an empty text" + ("" if single else f" (texts[{empty[0]}])"))
    # Each text's windows: complete mode, one line fitting in a block, is that block without context.
    modes = [self._text_windows(ids, prefix, break_mode, context, block_len) for ids in ids_of]
    if not len(prefix):  # texts share nothing: `rows` at a time, grouped by their windows' kind
      wins_of = [evaluate.text_windows(ids, self.vocab, block_len, ctx, mode, overlong)
                 for ids, (mode, ctx) in zip(ids_of, modes)]
      # one pass per kind of windows and row length (`evaluate.row_length`): short texts in short rows
      kinds = [(mode, ctx, evaluate.row_length(wins, block_len, self.stateful)) for wins, (mode, ctx) in
               zip(wins_of, modes)]
      nll_of = [None] * len(texts)
      for kind in dict.fromkeys(kinds):
        group = [i for i, k in enumerate(kinds) if k == kind]
        # long / external without documents: a store of each text's own earlier tokens, as long as the group's
        # longest text (rounded: similar calls share a compile)
        mem_size = 0
        if memory in ("long", "external"):
          mem_size = -(-max(len(ids_of[i]) for i in group) // STORE_ROUND) * STORE_ROUND
        got = self._score_texts([ids_of[i] for i in group], [wins_of[i] for i in group], point, *kind, block_len,
                                vocab_chunk, mem_size, external)
        for i, nll in zip(group, got):
          nll_of[i] = nll
    else:
      nll_of = [self._score_with_memory(ids, prefix, point, *mode_ctx, block_len, overlong, vocab_chunk, external)
                for ids, mode_ctx in zip(ids_of, modes)]
    out, unscored = [], []
    for i, (text, ids, (mode, ctx), nll) in enumerate(zip(texts, ids_of, modes, nll_of)):
      corpus_len = len(prefix) + len(ids)
      if len(nll) < corpus_len:  # lines were dropped: the evaluator lists the scored targets only, in order
        if len(prefix):
          corpus = data.Corpus.from_docs([prefix, ids], self.vocab)
          scored = data.eval_windows(corpus, corpus_len, block_len, ctx, mode, overlong)
        else:
          scored = wins_of[i]
        full = np.full(corpus_len, np.nan, np.float32)
        full[np.concatenate([np.arange(w.score_start, w.end) for w in scored])] = nll
        nll = full
        missing = int(np.isnan(nll[len(prefix):]).sum())
        if missing:
          unscored.append(f"{missing:,} of {len(ids):,} tokens" + ("" if single else f" of texts[{i}]"))
      out.append(TextScore(text, [self.vocab.tokens[i] for i in ids], ids, -nll[len(prefix):]))
    if unscored:  # a perplexity over part of a text must not pass unnoticed
      logger.warning("not scored (NaN in log_probs, left out of ppl): %s%s, in lines longer than eval.block_len=%d, "
                     "which eval.sample_break_mode=complete drops as fairseq's eval_lm does", ", ".join(unscored[:5]),
                     f" and {len(unscored) - 5} more texts" if len(unscored) > 5 else "", block_len)
    return out[0] if single else out

  def _text_windows(self, ids, prefix, break_mode: str, context: int, block_len: int) -> tuple[str, int]:
    """(break mode, context window) of one text's windows, as trime_jax.launch.eval would cut them."""
    if break_mode == "complete" and not (ids == self.vocab.eos).any() and not (prefix == self.vocab.eos).any():
      # One line. Complete mode feeds a line that fits in a block as one block from its first token
      # (`data.complete_windows`): the window none mode gives it without context. `data.eval_windows`
      # refuses a stream without `</s>` (a corpus without line ends), so that window is asked for directly.
      stream_len = len(prefix) + len(ids)
      if stream_len > block_len:
        raise ConfigError(f"eval.sample_break_mode=complete: the text is one line of {stream_len} tokens (with "
                          f"model.memory's documents), longer than eval.block_len={block_len}: trime_jax.launch.eval "
                          f"would not score it (fairseq's eval_lm drops such lines); break it into lines")
      return "none", 0
    return break_mode, context

  def _score_texts(self, ids_of, wins_of, point, mode: str, ctx: int, length: int, block_len: int,
                   vocab_chunk: int, mem_size: int = 0, external=None):
    """Each text's scored targets' nll (in order): the texts (with their windows, `evaluate.text_windows`) in
    one pass, `rows` windows of different texts per step in rows of `length` tokens (`evaluate.texts_plan`),
    each as if scored alone: local memory, with
    `mem_size` a store of the text's own earlier tokens, with `external` a datastore. Rows: as many as hold
    the tokens of a step of trime_jax.launch.eval (eval.batch_size × block_len), or the power of two at or above
    the number of texts where that is fewer (few distinct shapes: a few calls share a compile)."""
    cap = max(1, int(self.config.eval.batch_size)) * block_len // length
    rows = min(cap, 1 << (len(ids_of) - 1).bit_length())
    n = self._device_count()
    rows = -(-rows // n) * n  # whole rows per device (model.devices); a row without a text scores nothing
    cfg = self.nnx_model.cfg
    corpus, plan, counts = evaluate.texts_plan(ids_of, self.vocab, block_len=block_len, context_window=ctx,
                                               rows=rows, d_model=cfg.d_model, dtype=cfg.dtype, break_mode=mode,
                                               mem_size=mem_size, layout=self.long_term_layout,
                                               stateful=self.stateful, windows=wins_of)
    assert plan.block_len == length, (plan.block_len, length)
    result = evaluate.evaluate(self.graphdef, self.params, corpus, [point], block_len=plan.block_len,
                               context_window=ctx, streams=rows, external=external, vocab_chunk=vocab_chunk,
                               per_token=True, log=logger.info, plan=plan,
                               search_queries=evaluate.search_queries_of(self.config.eval),
                               mesh=sharding.eval_mesh(n, rows, what="devices", split_over_processes=False),
                               split_over_processes=False)  # each process scores its own texts
    return np.split(np.asarray(result.token_nll[0], np.float32), np.cumsum(counts)[:-1])

  def _score_with_memory(self, ids, prefix, point, mode: str, ctx: int, block_len: int, overlong: str,
                         vocab_chunk: int, external):
    """One text's scored targets' nll after model.memory's documents (`prefix`), with a long-term store of
    every earlier token (and `external`'s datastore): one stream, from the documents' kept state if any."""
    corpus = data.Corpus.from_docs([prefix, ids], self.vocab)
    mem_size = -(-len(corpus) // STORE_ROUND) * STORE_ROUND  # every earlier token of the stream fits in the store
    key = (mem_size, mode, ctx)  # what the documents' windows and the store's shape depend on
    result = evaluate.evaluate(self.graphdef, self.params, corpus, [point], block_len=block_len, context_window=ctx,
                               streams=1, long_term=evaluate.StoreSpec(mem_size=mem_size,
                                                                       layout=self.long_term_layout),
                               external=external,
                               vocab_chunk=vocab_chunk, per_token=True, break_mode=mode, complete_overlong=overlong,
                               log=logger.info, start=self.memory._states.get(key), keep_state_before=len(prefix),
                               search_queries=evaluate.search_queries_of(self.config.eval),
                               split_over_processes=False)
    if result.state is not None:
      self.memory._keep_state(key, result.state)
    return np.asarray(result.token_nll[0], np.float32)

  # -- generation -------------------------------------------------------------------------------------------
  def generate(self, prompts, *, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, memory: str | None = None, datastore: str | None = None,
               tau: float | None = None, k: int | None = None, index: str | None = None, trace: bool = False):
    """Continue each prompt (a string gives one Output, a list of strings a list; token ids:
    `model.generator.generate`): `temperature` (of sampling; 0 is greedy), `tau` (τ on memory similarities,
    default the export's eval.tau), `top_p` / `top_k` filter the distribution (1.0 / 0: off), `seed` (an
    integer in [-2**31, 2**31)) fixes the draws (per row: a prompt sampled at another position of the list, or
    alone, draws other numbers; greedy decoding does not depend on it). `memory`: none | local | long (the documents in
    `model.memory`) | external (`datastore=DIR`, plus `model.memory` when it holds documents); None (the
    default) is the export's own, as in `score`; `index` as in `score`, and the same arguments are refused. An
    empty `model.memory` is local memory alone, as when scoring: long-term memory adds the documents to local
    memory, and there are none. `trace`: each Output.trace lists every token's probability and the memories
    that contributed most. Generation does not add the prompts or outputs to `model.memory` (`model.memory.add`
    does)."""
    from trime_jax import generate

    prompts, single = _texts(prompts, "prompts")
    memory = self._memory(memory)
    tau = _positive(tau, "tau")
    trace = _flag(trace, "trace")
    if k is not None:
      self._k(k)
    _check_memory(memory, datastore, k, tau, index)
    # built before the generator, so that a wrong value is refused before anything is loaded or compiled
    sampling = generate.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    spec = generate.MemorySpec(memory, tau=tau)
    external = self.external(datastore, k=k, index=index or "") if memory == "external" else None
    gen = self.generator
    store = self.memory.store() if memory in ("long", "external") else None
    results = gen.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, memory=spec, store=store,
                           external=external, trace=trace, remember=False)
    out = [Output(r.prompt, r.text, list(r.tokens), r.stopped, r.trace) for r in results]
    return out[0] if single else out


# Models shipped inside the package, loaded by name from any directory (`exports.pretrained_names`)
PRETRAINED_DIR = exports.PRETRAINED_DIR
pretrained_names = exports.pretrained_names


def load(path: str, *, dictionary: str | None = None, out: str | None = None, trust_pickle: bool = False,
         key_type: str = "last_ffn_input", overwrite: bool = False, devices: int | None = None) -> Model:
  """A Model from a shipped model's name (`load("demo")`, see `pretrained_names()`; a path of that name in the
  working directory wins), an export directory (`<workdir>/export`, `<workdir>/best`, a training workdir itself),
  or an original fairseq checkpoint (`.pt`) with its `dictionary` (dict.txt), imported with
  `fairseq_import.import_to_export` first. Paths: strings or path-like, `~` expanded.

  The import is written to `out` when given (kept: an export like any other, e.g. to build a datastore from it
  with `trime_jax.launch.build_datastore --checkpoint=OUT`, or to load it again without importing). Without
  `out` it goes to a new temporary directory (`model.directory`) that lives as long as the Model: it is
  removed when the Model is garbage-collected or Python exits, and at once if the import fails, so repeated
  loads leave nothing behind (keep the Model, not only its `generator`, while it is in use); a non-empty `out`
  is refused unless `overwrite=True`. `trust_pickle` (True or False: unpickling runs the file's code),
  `key_type`: the importer's options (trime_jax.launch.import_fairseq's flags); `out`, `overwrite`,
  `trust_pickle` and `key_type` given for an export are one ConfigError (they would be ignored). The export's config is read as every CLI reads it
  (`exports.stored_over_defaults`: a field it lacks keeps its default, a field this version does not know is
  refused). `devices`: how many of this process's devices `Model.score` splits texts over (0: all; None: the
  export's eval.devices, 1 unless it was trained with another; `Model.devices`)."""
  path = _path(path, "path")
  trust_pickle, overwrite = _flag(trust_pickle, "trust_pickle"), _flag(overwrite, "overwrite")
  if devices is not None:  # before an import is written: the caller's argument
    sharding.device_count(devices, "devices")
  if dictionary is not None and not os.path.exists(path) and path.rstrip(os.sep) in pretrained_names():
    raise ConfigError(f"dictionary= is for a fairseq checkpoint (a .pt file); {path!r} is a shipped model: "
                      f"load({path!r}) without it")
  if dictionary is None and path.endswith(".pt") and not os.path.exists(path):
    raise CheckpointError(f"{path} not found (a fairseq checkpoint: load(path, dictionary=its dict.txt))")
  if dictionary is not None or os.path.isfile(path):
    if os.path.isdir(path):  # an export (or a shipped model's folder) given a dictionary
      raise ConfigError(f"dictionary= is for a fairseq checkpoint (a .pt file); {path} is a folder: "
                        f"load({path!r}) without it")
    if dictionary is None:
      folder = os.path.dirname(os.path.abspath(path))
      if os.path.isfile(os.path.join(folder, "meta.json")):
        raise ConfigError(f"{path} is a file of the export {folder}: load the folder (load({folder!r}))")
      raise ConfigError(f"{path} is a file: a fairseq checkpoint needs its dictionary (load(path, dictionary=...))")
    from trime_jax import fairseq_import

    dictionary = _path(dictionary, "dictionary")
    if not dictionary:
      raise ConfigError("dictionary= is empty: give the checkpoint's dict.txt")
    from trime_jax.model import KEY_TYPES

    if key_type not in KEY_TYPES:  # before the checkpoint is read: the user's argument, not the file's
      raise ConfigError(f"key_type must be one of {KEY_TYPES}, got {key_type!r}")
    temporary = out is None
    out = tempfile.mkdtemp(prefix="trime_jax_import_") if temporary else _path(out, "out")
    if not out:  # "" would write the import into (over) the working directory
      raise ConfigError("out= is empty: give the directory to write the imported export to (or None: a temporary one)")
    try:
      path, _ = fairseq_import.import_to_export(path, dictionary, out, key_type=key_type, trust_pickle=trust_pickle,
                                                overwrite=overwrite)
      model = Model(export_path(path), devices=devices)
    except BaseException:
      if temporary:  # half an import is no use to anyone; a chosen `out` is left for its owner to look at
        shutil.rmtree(out, ignore_errors=True)
      raise
    if temporary:
      weakref.finalize(model, shutil.rmtree, out, ignore_errors=True)
    return model
  given = [name for name, v, default in (("out", out, None), ("overwrite", overwrite, False),
                                         ("trust_pickle", trust_pickle, False),
                                         ("key_type", key_type, "last_ffn_input")) if v != default]
  if given:  # they would be ignored without a word
    raise ConfigError(f"{', '.join(given)}: options of a fairseq checkpoint's import (load(path.pt, dictionary=...)); "
                      f"{path} is an export, loaded as it is")
  return Model(export_path(path), devices=devices)


def export_path(path: str, say=None) -> str:
  """`exports.export_path` of a path given as a string or path-like (`~` expanded): the export directory it names
  (a shipped model's name, a training workdir's export/, or the path itself)."""
  return exports.export_path(_path(path, "path"), say or logger.warning)


def train(config, workdir: str, **kwargs) -> dict:
  """Train (or resume) in `workdir` and export: `trime_jax.train.train_and_evaluate(config, workdir, **kwargs)`.
  Returns its metrics; the export is at result["export"] (`load` it). `config`: an ml_collections ConfigDict (a
  shipped config's `get_config()`, changed as you like) or a plain dict of one (`config.to_dict()`, a
  config.json: a field it lacks keeps configs/default.py's value, `exports.config_from_dict`). A field that
  configs/default.py does not have (a misspelling) is one ConfigError, in either."""
  import collections.abc

  import ml_collections

  from trime_jax.train import train_and_evaluate

  if not isinstance(config, (collections.abc.Mapping, ml_collections.ConfigDict)):
    raise ConfigError(f"config must be an ml_collections ConfigDict (e.g. trime_jax.configs.demo.get_config()) or "
                      f"a dict of one, got {type(config).__name__}")
  if exports.is_mt_config(config):
    raise ConfigError("config is a translation config (configs/ui_de_en.py's schema): train it with "
                      "trime_jax.mt.train.train_and_evaluate or python -m trime_jax.launch.train_mt")
  if not isinstance(config, ml_collections.ConfigDict):  # fields it lacks: their defaults; misspelt ones refused
    config = exports.config_from_dict(dict(config))
  return train_and_evaluate(config, _path(workdir, "workdir"), **kwargs)
