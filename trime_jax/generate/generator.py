"""`Generator`: an export loaded for generation, wiring the pieces (`Text`, `CachedDecoder`, `Memories`, sampling,
the trace) into the decoding loop; `Generation`, one row's result."""

from __future__ import annotations

import dataclasses
import numbers
import os
import sys
from typing import Callable

import numpy as np
from flax import nnx

from trime_jax import data, exports
from trime_jax import exact_memory
from trime_jax import knn
from trime_jax.errors import CheckpointError, ConfigError
from trime_jax.generate.decoder import CachedDecoder
from trime_jax.generate.memory import MEMORIES, LongTermMemory, Memories, MemorySpec
from trime_jax.generate.sampling import Sampling, step_keys
from trime_jax.generate.text import Text
from trime_jax.generate.trace import trace_step


@dataclasses.dataclass
class Generation:
  prompt: str
  text: str  # the generated continuation, detokenised: prompt + text reads as one text (a word model's
  #   continuation starts with a space where the prompt does not end in one)
  tokens: list  # generated token ids
  stopped: str  # "eos" | "budget"
  trace: list  # [TraceStep] when asked for


def default_memory(config) -> str:
  """The memory an export is used with when none is asked for: "none" for a model trained without memory
  (trime.memory=none, the vanilla model; scored alone as launch.eval's first row scores it), else "local"."""
  return "none" if str(config.trime.get("memory", "local")) == "none" else "local"


def retrieval_settings(config, *, k=None, nprobe=None, exact=None, gpu=None) -> dict:
  """How an export's datastore is searched when a caller does not say: the export's eval.knn_k, eval.nprobe,
  eval.knn_exact and eval.knn_gpu, as trime_jax.launch.eval_ext uses them (each argument given overrides its
  field). The one place the CLI (`launch/generate.py`), `Generator.external` and the API's `Model.external` read
  them, so a caller of any of the three retrieves what evaluation retrieved."""
  e = config.eval
  return {"k": int(e.get("knn_k", 1024)) if k is None else int(k),
          "nprobe": int(e.get("nprobe", 32)) if nprobe is None else int(nprobe),
          "exact": bool(e.get("knn_exact", False)) if exact is None else bool(exact),
          "gpu": bool(e.get("knn_gpu", False)) if gpu is None else bool(gpu)}


def _stderr(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _is_ids(p) -> bool:
  """A prompt given as token ids: a 1-d integer array, or a non-empty sequence of integers."""
  if isinstance(p, np.ndarray):
    return p.ndim == 1 and (p.dtype.kind in "iu" or not len(p))
  return isinstance(p, (list, tuple)) and bool(p) and all(
      isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p)


def _prompt_list(prompts) -> list:
  """`prompts` as a list of prompts (each a string or token ids); anything else is one ConfigError. Bytes are
  refused rather than read as token ids: b"abc" is far more likely undecoded text than byte ids."""
  if isinstance(prompts, str) or _is_ids(prompts):
    return [prompts]
  if isinstance(prompts, (bytes, bytearray)):
    raise ConfigError("prompts are text: decode bytes first (prompt.decode('utf-8')); token ids: a list of ints")
  if not isinstance(prompts, (list, tuple)):
    raise ConfigError(f"prompts must be a string, a list of token ids, or a list of those; got "
                      f"{type(prompts).__name__}")
  for i, p in enumerate(prompts):
    if isinstance(p, (bytes, bytearray)):
      raise ConfigError(f"prompt {i} is bytes: decode it first (prompt.decode('utf-8')); token ids: a list of ints")
    if not (isinstance(p, str) or _is_ids(p) or (isinstance(p, (list, tuple)) and not p)):
      raise ConfigError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
  return list(prompts)


class Generator:
  """An export loaded for generation: `generate(prompts, ...)`, `read(store, text)`, `external(...)`.

  `loaded`: the (graphdef, params, config, vocab, meta) that `exports.load_export(checkpoint_dir)` returned to
  a caller that holds them already (the API's `Model`): used as they are, not read again, so both share one
  copy of the parameters. `params` can be assigned (the decoder then runs the new ones, with the same graph)."""

  def __init__(self, checkpoint_dir: str, *, log: Callable[[str], None] = _stderr, loaded=None):
    self.checkpoint_dir = checkpoint_dir
    graphdef, params, self.config, self.vocab, self.meta = loaded or exports.load_export(checkpoint_dir)
    self.graphdef = graphdef
    model = nnx.merge(graphdef, params)
    if getattr(model, "stateful", False):  # the key/value-cache decoder is the Transformer's
      raise ConfigError(f"generation supports the transformer backbone; {checkpoint_dir} is a "
                        f"{model.cfg.backbone} model")
    self.cfg = model.cfg
    self.decoder = CachedDecoder(graphdef, params, self.cfg)
    self.default_tau = float(self.config.eval.tau)  # the export's evaluation τ
    self.default_memory = default_memory(self.config)  # none for a vanilla model, else local
    self.eos = self.vocab.index.get(data.EOS)  # bytes: none (generation stops at the budget)
    self.log = log
    self.text = Text(self.vocab, lambda msg: self.log(msg))  # through self.log: a caller may replace it

  @property
  def params(self):
    """The parameters generation runs (the decoder's: one copy)."""
    return self.decoder.params

  @params.setter
  def params(self, value) -> None:
    self.decoder.params = value  # its jitted functions take the parameters as an argument: no recompilation

  # -- text <-> tokens, keys of text -------------------------------------------------------------------------
  def tokenize(self, text: str, what: str = "prompt") -> list[int]:
    return self.text.tokenize(text, what)

  def detokenize(self, ids) -> str:
    return self.text.detokenize(ids)

  def keep(self) -> int:
    """Tokens a full context window restarts from."""
    return max(1, self.cfg.max_len // 2)

  def keys_of(self, ids, batch: int = 8) -> np.ndarray:
    """float32 [n, D] key of every token of `ids` (`CachedDecoder.keys_of`, context `keep()`)."""
    return self.decoder.keys_of(ids, self.vocab, self.keep(), batch)

  # -- memories ----------------------------------------------------------------------------------------------
  def read(self, store: LongTermMemory, text: str) -> int:
    """Add the keys of `text` to `store` (a document the model should remember); returns its token count."""
    ids = self.tokenize(text, what="memory text")
    if not ids:
      raise ConfigError("the memory text is empty")
    store.add(self.keys_of(ids), ids)
    return len(ids)

  def new_store(self) -> LongTermMemory:
    return LongTermMemory(self.cfg.d_model)

  def external(self, datastore_dir: str, *, index_path: str = "", k: int | None = None, nprobe: int | None = None,
               exact: bool | None = None, gpu: bool | None = None,
               log: Callable[[str], None] = knn.print_line) -> knn.ExternalMemory:
    """A datastore + index of this model (built by `trime_jax.launch.build_datastore`; another model's or vocabulary's
    is refused). `k` (entries per token), `nprobe`, `exact`, `gpu`: None takes the export's evaluation setting
    (`retrieval_settings`). Its entries are scored as evaluation scores them (`eval.knn_exact`): by the index's own
    inner products, or with `exact` from the stored keys. `log` hears which index it searches
    (`knn.ExternalMemory`'s line; default: stdout)."""
    settings = retrieval_settings(self.config, k=k, nprobe=nprobe, exact=exact, gpu=gpu)
    ext = knn.ExternalMemory(datastore_dir, index_path=index_path, checkpoint_dir=self.checkpoint_dir, log=log,
                             **settings)  # another model's datastore: one error saying so
    if ext.dimension != self.cfg.d_model:
      raise CheckpointError(f"datastore keys have dimension {ext.dimension}, the model's keys {self.cfg.d_model}")
    return ext

  def on_device(self, datastore_dir: str, mesh=None) -> exact_memory.DeviceDatastore:
    """A datastore of this model with its keys on the devices (sharded over all of them, or `mesh`'s `data`
    axis): memory=external then sums over every entry exactly instead of a FAISS top-K."""
    ds = exact_memory.Datastore(os.fspath(datastore_dir))
    ds.check_checkpoint(self.checkpoint_dir)
    if ds.dimension != self.cfg.d_model:
      raise CheckpointError(f"datastore keys have dimension {ds.dimension}, the model's keys {self.cfg.d_model}")
    return exact_memory.load_datastore(ds, mesh)

  # -- generation --------------------------------------------------------------------------------------------
  def generate(self, prompts, *, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
               memory: MemorySpec | None = None, store: LongTermMemory | None = None,
               external: knn.ExternalMemory | exact_memory.DeviceDatastore | None = None, trace: bool = False,
               remember: bool = True,
               stop_at_eos: bool = True) -> list[Generation]:
    """Continue each prompt (a string, or a list of token ids; or a list of such prompts) by up to
    `max_new_tokens` tokens, stopping a row at `</s>` (word vocabularies, `stop_at_eos`). memory: a MemorySpec
    or its kind as a string (none | local | long | external; default: `default_memory`, none for a model trained
    without memory, else local; τ: the export's eval.tau unless given). `store` (memory long or external) is read, and extended with every row's prompt and output unless
    remember=False; `external` (memory external) is searched once per generated token."""
    if memory is None or isinstance(memory, str):
      memory = MemorySpec(memory or self.default_memory)  # MemorySpec names the kinds it accepts
    elif not isinstance(memory, MemorySpec):
      raise ConfigError(f"memory must be a MemorySpec or one of {MEMORIES}, got {type(memory).__name__}")
    if not isinstance(sampling, Sampling):
      raise ConfigError(f"sampling must be a generate.Sampling, got {type(sampling).__name__}")
    if memory.tau is None:
      memory = dataclasses.replace(memory, tau=self.default_tau)
    prompts = _prompt_list(prompts)
    if not prompts:
      raise ConfigError("no prompts given")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
      raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if memory.kind == "long" and store is None:
      raise ConfigError("memory=long needs a long-term store (a --memory_file, or store=LongTermMemory)")
    if memory.kind == "external" and external is None:
      raise ConfigError("memory=external needs a datastore (--datastore, built by trime_jax.launch.build_datastore)")
    if memory.kind in ("none", "local"):
      store = None
    if memory.kind == "external" and isinstance(external, exact_memory.DeviceDatastore) and (
        memory.knn_lambda or trace):
      raise ConfigError("the on-device datastore gives exact sums over every entry, not retrieved entries: the "
                        "interpolation and the retrieval trace need a FAISS index (Generator.external)")
    ids = self.prompt_ids(prompts)
    return self._generate(ids, [p if isinstance(p, str) else self.detokenize(p) for p in prompts], max_new_tokens,
                          sampling, memory, store, external if memory.kind == "external" else None, trace,
                          remember, stop_at_eos)

  def prompt_ids(self, prompts) -> list[list[int]]:
    """Each prompt's token ids (a string is tokenized; a list of ids is checked against the vocabulary); an empty
    prompt is a ConfigError. `generate` calls it; a caller that loads memories first can call it before them."""
    prompts = _prompt_list(prompts)
    ids = [self.tokenize(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for p, row in zip(prompts, ids):
      if not row:
        raise ConfigError("the prompt is empty" + (f": {p!r}" if isinstance(p, str) and p else ""))
      if min(row) < 0 or max(row) >= len(self.vocab):
        raise ConfigError(f"prompt token ids must be in [0, {len(self.vocab)})")
    return ids

  def _generate(self, ids, prompts, max_new, sampling, memory, store, external, trace, remember, stop_at_eos):
    b, keep, max_len = len(ids), self.keep(), self.cfg.max_len
    seqs = [[self.vocab.bos] + row for row in ids]  # input stream of each row; seqs[r][j + 1] is key j's target
    starts = [0 if len(s) <= max_len else len(s) - keep for s in seqs]  # each row's window start
    if any(starts):
      longest = max(len(r) for r in ids)
      self.log(f"note: a prompt of {longest} tokens is longer than the model's context ({max_len} tokens): "
               f"sliding window, the model sees the last {keep} prompt tokens (the memory keeps all of them)")
    slid = any(starts)
    mems = Memories(seqs, max_new, self.cfg.d_model, store, external)
    cache_len = min(max_len, -(-(max(len(s) - st for s, st in zip(seqs, starts)) + max_new) // 16) * 16)
    active = np.ones(b, bool)
    out_tokens = [[] for _ in range(b)]
    stopped = ["budget"] * b
    traces = [[] for _ in range(b)]
    cache = None
    need_prefill = True
    last_f = last_g = None
    keys = step_keys(sampling.seed, b, max_new)  # one dispatch, not one per step
    for step in range(max_new):
      if need_prefill:  # the prompts, or windows that slid: every row re-encoded from its window start
        last_f, last_g, g_all, cache = self._prefill(seqs, starts, cache_len)
        if step == 0:  # the prompt's keys: from this pass, or from evaluation's windows for long prompts
          g_all = np.asarray(g_all)
          prompt_keys = lambda r: g_all[r, :len(seqs[r]) - 1] if starts[r] == 0 else self.keys_of(seqs[r][1:])
          mems.set_prompts(seqs, prompt_keys)
        need_prefill = False
      mems.retrieve(last_g)
      tokens, log_p, extra = self.decoder.next_token(last_f, last_g, mems, keys[step], active, memory=memory,
                                                     sampling=sampling, trace=trace)
      tokens = np.asarray(tokens)
      if trace:
        trace_step(traces, tokens, active, log_p, extra, seqs, mems, self.text)
      for r in np.flatnonzero(active):
        t = int(tokens[r])
        out_tokens[r].append(t)
        seqs[r].append(t)
        mems.n_mem[r] += 1
        if stop_at_eos and t == self.eos:
          active[r], stopped[r] = False, "eos"
      if not active.any() or step == max_new - 1:
        break
      # Advance: feed every row's newest token (finished rows repeat theirs, ignored); slide full windows. A row
      # that finished on the token that filled its window slides too (its outputs are ignored, but its window
      # must fit the cache when the others' slide re-encodes every row), without a re-encoding of its own.
      for r, s in enumerate(seqs):
        if len(s) - starts[r] > cache_len:  # cache_len < max_len only if no row ever gets there
          starts[r] = len(s) - keep
          need_prefill = need_prefill or bool(active[r])
      if need_prefill:
        if not slid:
          self.log(f"note: the context reached the model's max_len={max_len} tokens: sliding window, the model "
                   f"restarts from the last {keep} tokens (the memory keeps every key)")
          slid = True
        continue
      pos = np.array([[len(s) - st - 1] for s, st in zip(seqs, starts)], np.int32)
      toks = np.array([[s[-1]] for s in seqs], np.int32)
      last_f, last_g, _, cache = self.decoder.forward(toks, cache, pos, np.zeros((b,), np.int32))
    if store is not None and remember:
      mems.save_to_store()
    results = []
    for r in range(b):
      shown = out_tokens[r][:-1] if stopped[r] == "eos" else out_tokens[r]
      results.append(Generation(prompts[r], self.text.continuation(prompts[r], shown), out_tokens[r], stopped[r],
                                traces[r]))
    return results

  def _prefill(self, seqs, starts, cache_len: int):
    """`CachedDecoder.forward` over every row's window from its start (right-padded), into a new cache."""
    b = len(seqs)
    width = max(len(s) - st for s, st in zip(seqs, starts))
    width = min(cache_len, -(-width // 16) * 16)
    inputs = np.zeros((b, width), np.int32)
    for r, (s, st) in enumerate(zip(seqs, starts)):
      inputs[r, :len(s) - st] = s[st:]
    cache = self.decoder.init_cache(b, cache_len)
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), (b, width))
    last = np.array([len(s) - st - 1 for s, st in zip(seqs, starts)], np.int32)
    return self.decoder.forward(inputs, cache, pos, last)
