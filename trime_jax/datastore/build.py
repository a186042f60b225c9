"""External-memory datastore: the key g(c) and next token of every token of a corpus, under a trained model.

Layout of a datastore directory:
  keys.npy     float16 [N, D]  g(c_i): the memory key of target position i (`model.features(...)[1]`)
                               (float32 with key_dtype="float32", the original without --dstore-fp16)
  values.npy   int32   [N]     x_i: the target token at position i (= corpus.tokens[i])
  meta.json    format, count N, dimension D, dtypes, fingerprints (checkpoint, vocabulary, corpus, datastore),
               block_len / context_window, key_type, tokens_done, complete, build timing

Entry i is target position i of the corpus stream, so N = len(corpus) and `values` equals the corpus tokens
(entries="original": the original's --save-knnlm-dstore windows only, entry i = position first_position + i).
Keys are computed with evaluation's windows (`data.windows(N, block_len, context_window)`): every target
is scored once, with up to `context_window` tokens of context before its chunk, exactly the context it gets
when the same model evaluates that text. Documents are concatenated, as in evaluation.

Building (`build_datastore`) runs the model window batch by window batch; every chunk of batches is written
through the memmaps, flushed, and only then is `tokens_done` advanced in meta.json (atomically). An interrupted
build therefore resumes at the first unsaved chunk when rerun with the same arguments, and a datastore whose
`complete` flag is false is refused by the reader: it is never silently truncated.

Verified on every load: meta.json parses and its `fingerprint` is the hash of its identity fields; keys.npy and
values.npy match the digests recorded when the build completed (`file_digests`: the whole file up to
FULL_DIGEST_BYTES, else its size and 1024 evenly spaced 4 KiB blocks); shapes and dtypes match meta.json.

Reading (`Datastore(directory)`): memory-mapped `keys` / `values`, `fingerprint` (what indexes record),
`check_checkpoint(dir)` / `check(...)` for clear errors when a model, vocabulary or key dimension does not
match, `gather_keys(ids)` for exact re-scoring. `trime_jax.datastore.index` builds and searches FAISS indexes.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from trime_jax import data, exports, sharding
from trime_jax.errors import CheckpointError, ConfigError, DamagedCheckpointError, is_no_space
from trime_jax.runtime.lock import beside as lock_beside

FORMAT = "trime-datastore/1"
KEY_DTYPE = np.float16  # the default (the release's --dstore-fp16); float32 on request (`build_datastore`)
KEY_DTYPES = ("float16", "float32")
VALUE_DTYPE = np.int32
FULL_DIGEST_BYTES = 1 << 30  # files up to 1 GiB are hashed whole on every load; larger ones by sampled blocks
CHUNK_TOKENS = 1 << 16  # scored tokens per persisted chunk (rounded to whole window batches)
# meta.json fields that identify what a datastore holds: a resumed build must agree on all of them.
# Which windows' targets a datastore holds (`build_datastore(entries=...)`): every target | the original's
# `eval_lm.py --save-knnlm-dstore` (windows of exactly S = block_len - context_window scored tokens, without the
# context-less first window when there is a context window: fairseq's LMContextWindowDataset pads every row to
# S + context_window tokens and the first has no context, so its keys are S + context_window long, not S, and
# eval_lm skips it ("Skipping this one") whatever the batch size; without a context window it is kept).
ENTRIES = ("all", "original")
# Identity fields a datastore has only when they are not the default (older datastores lack them).
OPTIONAL_IDENTITY = ("first_position",)  # the corpus position of entry 0 (entries="original": S or 0)
IDENTITY = ("format", "count", "dimension", "key_dtype", "value_dtype", "checkpoint_fingerprint",
            "vocab_fingerprint", "corpus_fingerprint", "key_type", "block_len", "context_window")


def file_digest(path: str, full_bytes: int = FULL_DIGEST_BYTES, blocks: int = 1024, block: int = 4096) -> str:
  """SHA-256 (16 hex digits) of a file: its whole contents up to `full_bytes`, else its size and `blocks`
  evenly spaced blocks of `block` bytes (first and last included): O(1) for a 100 GB datastore, and still
  catches truncation and damage in the sampled blocks."""
  size = os.path.getsize(path)
  h = hashlib.sha256(f"{size}:".encode())
  with open(path, "rb") as f:
    if size <= full_bytes:
      for chunk in iter(lambda: f.read(1 << 22), b""):
        h.update(chunk)
    else:
      for off in np.linspace(0, size - block, blocks).astype(np.int64):
        f.seek(int(off))
        h.update(f.read(block))
  return h.hexdigest()[:16]


def _reserve(path: str) -> None:
  """Allocate a file's blocks (posix_fallocate), so running out of space is an OSError here, not a SIGBUS later."""
  if hasattr(os, "posix_fallocate"):
    with open(path, "r+b") as f:
      os.posix_fallocate(f.fileno(), 0, os.path.getsize(path))


@contextlib.contextmanager
def _no_space_is_an_error(out_dir: str, count: int, dimension: int, key_bytes: int = 2):
  try:
    yield
  except OSError as e:
    if not is_no_space(e):
      raise
    meta = _read_meta(out_dir) or {}
    raise CheckpointError(
        f"{'file size limit reached' if e.errno == errno.EFBIG else 'no space left'} for datastore {out_dir} "
        f"({os.strerror(e.errno)}{': ' + str(e.filename) if e.filename else ''}); "
        f"{meta.get('tokens_done', 0):,} of {count:,} tokens are saved: free space (the files need "
        f"{count * (dimension * key_bytes + 4) / 2**20:,.1f} MiB) and rerun the same command to resume") from None


def _chunk_digest(keys, values, a: int, b: int) -> str:
  """SHA-256 (16 hex digits) of entries a..b of a datastore's keys and values (a committed chunk)."""
  h = hashlib.sha256(f"{a}:{b}:".encode())
  h.update(np.ascontiguousarray(keys[a:b]))  # hashed in place: no copy of a 128-MiB chunk
  h.update(np.ascontiguousarray(values[a:b]))
  return h.hexdigest()[:16]


def _identity_fingerprint(identity: dict) -> str:
  return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _identity_of(fields: dict) -> dict:
  return {k: fields[k] for k in IDENTITY + tuple(k for k in OPTIONAL_IDENTITY if k in fields)}


def _paths(directory: str):
  return (os.path.join(directory, "meta.json"), os.path.join(directory, "keys.npy"),
          os.path.join(directory, "values.npy"))


def _read_meta(directory: str) -> dict | None:
  path = _paths(directory)[0]
  if not os.path.exists(path):
    return None
  return data.read_json(path, "datastore meta", DamagedCheckpointError,
                        fix="rebuild the datastore (trime_jax.launch.build_datastore), or use another directory")


def _refuse_non_datastore(out_dir: str, meta) -> None:
  """An output directory whose meta.json is not a datastore's (an export's, say) is not overwritten."""
  if meta is not None and meta.get("format") != FORMAT:  # (read_json refused JSON that is not an object)
    what = "an export" if "params_digest" in meta else "something else"
    raise CheckpointError(f"{out_dir} is not a datastore: its meta.json belongs to {what}; choose another output "
                          "directory")


def _checked_meta(directory: str) -> dict:
  """meta.json of the datastore (complete or being built) in `directory`, with its format and identity
  fingerprint verified."""
  meta = _read_meta(directory)
  if meta is None:
    raise CheckpointError(f"no datastore in {directory}: meta.json is missing "
                          "(build one with `python -m trime_jax.launch.build_datastore`)")
  if meta.get("format") != FORMAT:
    if "params_digest" in meta:  # an export passed where its datastore belongs
      raise CheckpointError(f"{directory} is an export (a model), not a datastore: build its datastore with "
                            f"`python -m trime_jax.launch.build_datastore --checkpoint={directory} --out=DIR` and "
                            "pass DIR")
    raise CheckpointError(f"{directory}: unknown datastore format {meta.get('format')!r}")
  missing = [k for k in IDENTITY + ("fingerprint",) if k not in meta]
  if missing:
    raise DamagedCheckpointError(f"datastore meta {_paths(directory)[0]} lacks {', '.join(missing)}")
  if _identity_fingerprint(_identity_of(meta)) != meta["fingerprint"]:
    raise DamagedCheckpointError(f"datastore meta {_paths(directory)[0]} was edited: its fingerprint "
                                 f"{meta['fingerprint']} does not match its fields; rebuild the datastore")
  return meta


def _check_meta(directory: str, meta: dict, **want) -> None:
  """Raise CheckpointError naming every given field (not None) that differs from the datastore's meta."""
  problems = [f"{name} {meta.get(name)!r} (datastore) != {value!r}" for name, value in want.items()
              if value is not None and meta.get(name) != value]
  if problems:
    raise CheckpointError(f"datastore {directory} does not match: " + "; ".join(problems))


def _check_meta_checkpoint(directory: str, meta: dict, checkpoint_dir: str) -> None:
  """The datastore must have been built by this exported model (same weights, vocabulary, key space): else one
  error saying so, how to build this model's, and the fields that differ."""
  cmeta = exports.read_export_meta(checkpoint_dir)
  try:
    _check_meta(directory, meta, checkpoint_fingerprint=exports.fingerprint(checkpoint_dir),
                vocab_fingerprint=cmeta["vocab_fingerprint"], dimension=int(cmeta["d_model"]),
                key_type=cmeta["key_type"])
  except CheckpointError as e:
    raise CheckpointError(f"the datastore was built by another model or vocabulary than {checkpoint_dir} (build "
                          f"this model's with trime_jax.launch.build_datastore --checkpoint={checkpoint_dir}): "
                          f"{e}") from None


class DatastoreWriter:
  """The files of a datastore being built, shared by every builder (LM windows here, translation targets in
  `trime_jax.mt.datastore`).

  `DatastoreWriter(out_dir, identity)` refuses a directory holding a different datastore (any IDENTITY field
  differs); `.complete` says a finished one is there, `.meta` is its meta.json (None when fresh). `open(**fields)`
  creates full-size key / value files with their blocks reserved (or reopens an incomplete build's) and returns
  the (keys, values) memmaps; `commit(seconds, **progress)` flushes them and only then records the progress in
  meta.json (atomically); `finish()` records the file digests and `complete`. Use inside `no_space_is_an_error`
  so that a full disk is one clear error with the saved progress kept."""

  def __init__(self, out_dir: str, identity: dict):
    missing = [k for k in IDENTITY if k not in identity]
    if missing:
      raise ValueError(f"datastore identity lacks {missing}")
    self.out_dir, self.identity = out_dir, _identity_of(identity)
    self.meta_path, self.keys_path, self.values_path = _paths(out_dir)
    self.meta = _read_meta(out_dir)
    _refuse_non_datastore(out_dir, self.meta)
    if self.meta is not None:
      diff = [f"{k}: {self.meta.get(k)!r} there, {v!r} now" for k, v in self.identity.items() if self.meta.get(k) != v]
      if diff:
        sub = self.meta.get("subset_of")
        hint = (f"; it is the first {self.meta.get('count'):,} entries of another datastore (built with "
                "--subset_of and --entries): rerun with those flags to reuse it") if sub else ""
        raise CheckpointError(f"{out_dir} holds a different datastore ({'; '.join(diff)}){hint}: choose another "
                              "output directory, or replace it (trime_jax.launch.build_datastore --overwrite)")
    self.keys = self.values = None

  @property
  def complete(self) -> bool:
    return bool(self.meta and self.meta.get("complete"))

  def no_space_is_an_error(self):
    return _no_space_is_an_error(self.out_dir, self.identity["count"], self.identity["dimension"],
                                 np.dtype(self.identity["key_dtype"]).itemsize)

  def open(self, *, verify_chunks: bool = False, progress: bool = False, **fields):
    """(keys [N, D], values [N]) memmaps; a fresh build's meta.json gets `fields` and tokens_done = 0.

    verify_chunks (builders that commit contiguous `rows`): on resume every committed chunk is checked against
    the digest recorded when it was committed, and the build rolls back to the first damaged one (one
    `warning:` line), so that chunk and those after it are recomputed; a build whose chunks have no digests
    (an older version's) restarts from the beginning. Damage between a kill and the rerun is never blessed
    with `finish()`'s whole-file digests. This reads every saved entry once (WikiText-103's 100M float16 keys of
    1,024 dimensions: 205 GB, minutes of disk); `progress` says so first."""
    n, dim = self.identity["count"], self.identity["dimension"]
    os.makedirs(self.out_dir, exist_ok=True)
    if verify_chunks and self.meta is not None and self.meta.get("tokens_done"):
      self._verify_chunks(progress)
    if self.meta is None or not self.meta.get("tokens_done"):  # fresh: full-size files, their blocks reserved
      self.keys = np.lib.format.open_memmap(self.keys_path, mode="w+", dtype=np.dtype(self.identity["key_dtype"]),
                                            shape=(n, dim))
      self.values = np.lib.format.open_memmap(self.values_path, mode="w+", dtype=VALUE_DTYPE, shape=(n,))
      for path in (self.keys_path, self.values_path):  # a memmap write to a full disk would be a SIGBUS
        _reserve(path)
      self.meta = {**self.identity, "fingerprint": _identity_fingerprint(self.identity), **fields,
                   "tokens_done": 0, "complete": False, "build_seconds": 0.0}
      data.atomic_write_json(self.meta_path, self.meta)
    else:
      try:
        self.keys = np.load(self.keys_path, mmap_mode="r+")
        self.values = np.load(self.values_path, mmap_mode="r+")
      except (OSError, ValueError, EOFError) as e:
        raise CheckpointError(f"cannot resume datastore {self.out_dir} ({e}): delete it and rebuild") from None
      if self.keys.shape != (n, dim) or self.values.shape != (n,):
        raise CheckpointError(f"cannot resume datastore {self.out_dir}: files have shapes {self.keys.shape} / "
                              f"{self.values.shape}, expected {(n, dim)} / {(n,)}; delete it and rebuild")
    return self.keys, self.values

  def commit(self, seconds: float, rows: tuple[int, int] | None = None, **progress) -> None:
    """Flush the data written so far, then record `progress` (e.g. tokens_done) and the build time.

    rows=(a, b): the entries this chunk wrote; their digest and the progress before the chunk are recorded
    (meta "chunks"), so a resumed build can find a chunk damaged after it was committed and redo it."""
    self.keys.flush()
    self.values.flush()
    if rows is not None:
      a, b = int(rows[0]), int(rows[1])
      self.meta.setdefault("chunks", []).append(
          {"rows": [a, b], "digest": _chunk_digest(self.keys, self.values, a, b),
           "before": {k: self.meta.get(k) for k in progress}})
    self.meta.update(progress)
    self.meta["build_seconds"] = round(self.meta["build_seconds"] + seconds, 3)
    data.atomic_write_json(self.meta_path, self.meta)

  def _verify_chunks(self, progress: bool = False) -> None:
    """Check every committed chunk's digest (see `open`); roll meta.json back to the first damaged one."""
    meta, done = self.meta, int(self.meta.get("tokens_done", 0))
    chunks = meta.get("chunks")
    covered = 0
    for c in chunks or ():
      if c["rows"][0] != covered:
        break
      covered = c["rows"][1]
    if not chunks or covered != done:
      print(f"warning: datastore build in {self.out_dir}: its {done:,} saved tokens have no per-chunk digests "
            "(written by an older version, or meta.json was edited); restarting the build from the beginning",
            flush=True)
      self.meta = None  # open() starts afresh: new files, tokens_done = 0
      return
    try:
      keys = np.load(self.keys_path, mmap_mode="r")
      values = np.load(self.values_path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
      raise CheckpointError(f"cannot resume datastore {self.out_dir} ({e}): delete it and rebuild") from None
    if keys.shape[0] < done or values.shape[0] < done:
      raise CheckpointError(f"cannot resume datastore {self.out_dir}: its files hold {keys.shape[0]:,} entries, "
                            f"meta.json says {done:,} are done; delete it and rebuild")
    if progress:
      size = done * (keys.shape[1] * keys.dtype.itemsize + values.dtype.itemsize)
      print(f"datastore build in {self.out_dir}: checking the {done:,} saved entries ({size / 2**30:,.2f} GiB) "
            "against their digests before resuming", flush=True)
    for i, c in enumerate(chunks):
      a, b = c["rows"]
      got = _chunk_digest(keys, values, a, b)
      if got != c["digest"]:
        print(f"warning: datastore build in {self.out_dir}: entries {a:,}..{b:,} were changed after they were "
              f"saved (digest {got}, recorded {c['digest']}); recomputing from entry {a:,}", flush=True)
        meta.update(c["before"])
        meta["chunks"] = chunks[:i]
        data.atomic_write_json(self.meta_path, meta)
        return

  def finish(self) -> dict:
    """Close the files, record their digests and mark the datastore complete; returns meta.json's dict."""
    self.keys = self.values = None
    n = self.identity["count"]
    self.meta.pop("chunks", None)  # superseded by the whole-file digests
    self.meta["tokens_done"] = n
    self.meta["file_digests"] = {os.path.basename(p): file_digest(p) for p in (self.keys_path, self.values_path)}
    self.meta["complete"] = True
    self.meta["tokens_per_s"] = round(n / max(self.meta["build_seconds"], 1e-9), 1)
    data.atomic_write_json(self.meta_path, self.meta)
    return self.meta


class Datastore:
  """A complete datastore, memory-mapped read-only.

  keys    np.memmap float16 [count, dimension]   values  np.memmap int32 [count]
  meta    the meta.json dict                      fingerprint  identifies the contents (indexes record it)
  """

  def __init__(self, directory: str):
    self.directory = os.path.abspath(directory)
    meta = _checked_meta(directory)
    if not meta.get("complete"):
      raise CheckpointError(f"datastore {directory} is incomplete ({meta.get('tokens_done', 0):,} of "
                            f"{meta['count']:,} tokens): rerun the same build command to resume it")
    _, keys_path, values_path = _paths(directory)
    for path in (keys_path, values_path):
      want = meta.get("file_digests", {}).get(os.path.basename(path))
      if want is None:  # datastores built before file digests: shapes are still checked below
        continue
      if not os.path.exists(path):
        raise DamagedCheckpointError(f"datastore {directory} is damaged: {path} is missing; rebuild it")
      got = file_digest(path)
      if got != want:
        raise DamagedCheckpointError(f"datastore {directory} is damaged: {path} has digest {got}, meta.json "
                                     f"recorded {want} when the build completed; rebuild it (delete the directory "
                                     "and rerun trime_jax.launch.build_datastore)")
    try:
      self.keys = np.load(keys_path, mmap_mode="r")
      self.values = np.load(values_path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
      raise DamagedCheckpointError(f"datastore {directory} is damaged: {e}") from None
    n, d = meta["count"], meta["dimension"]
    if self.keys.shape != (n, d) or self.keys.dtype != np.dtype(meta["key_dtype"]):
      raise CheckpointError(f"datastore {directory}: keys.npy is {self.keys.dtype}{list(self.keys.shape)}, "
                            f"meta.json says {meta['key_dtype']}[{n}, {d}]")
    if self.values.shape != (n,) or self.values.dtype != VALUE_DTYPE:
      raise CheckpointError(f"datastore {directory}: values.npy is {self.values.dtype}{list(self.values.shape)},"
                            f" meta.json says int32[{n}]")
    self.meta = meta

  @property
  def count(self) -> int:
    return int(self.meta["count"])

  @property
  def dimension(self) -> int:
    return int(self.meta["dimension"])

  @property
  def fingerprint(self) -> str:
    return self.meta["fingerprint"]

  def __len__(self):
    return self.count

  def check(self, *, checkpoint_fingerprint: str | None = None, vocab_fingerprint: str | None = None,
            dimension: int | None = None, key_type: str | None = None) -> None:
    """Raise CheckpointError naming every given field that differs from what the datastore was built with."""
    _check_meta(self.directory, self.meta, checkpoint_fingerprint=checkpoint_fingerprint,
                vocab_fingerprint=vocab_fingerprint, dimension=dimension, key_type=key_type)

  def check_checkpoint(self, checkpoint_dir: str) -> None:
    """The datastore must have been built by this exported model (same weights, vocabulary, key space)."""
    _check_meta_checkpoint(self.directory, self.meta, checkpoint_dir)

  def gather_keys(self, ids) -> np.ndarray:
    """float32 keys [*ids.shape, D] of entries `ids` (-1 gives zeros); the memmap is read in ascending order."""
    ids = np.asarray(ids, np.int64)
    flat = ids.reshape(-1)
    safe = np.where(flat >= 0, flat, 0)
    order = np.argsort(safe, kind="stable")
    out = np.empty((flat.size, self.dimension), self.keys.dtype)
    out[order] = self.keys[safe[order]]
    out = out.astype(np.float32)
    out[flat < 0] = 0.0
    return out.reshape(ids.shape + (self.dimension,))


@functools.partial(jax.jit, static_argnames=("graphdef", "key_dtype", "first"))
def _keys_step(graphdef, params, inputs_BxL, key_dtype="float16", first: int = 0):
  """Memory keys g [B, L - first, D] as `key_dtype` (the dropout-free forward of evaluation), positions from
  `first` on: a window's context positions give no entry, so they need not leave the device (the 247M shape:
  512 of 3,072 rows, 1 MB a window instead of 6.3 MB)."""
  model = nnx.merge(graphdef, params)
  _, g = model.features(inputs_BxL, deterministic=True)
  return g[:, first:].astype(key_dtype)


def _write_keys(keys, base: int, key_dtype: str, g, real: int, scored_BxL, first: int, lo: int) -> None:
  """A key batch's scored positions (in order: consecutive target positions from corpus position `lo`) into the
  datastore's keys, after checking they are finite."""
  rows = np.asarray(g)[:real][scored_BxL[:real, first:]]
  if not np.isfinite(rows).all():
    raise CheckpointError(f"non-finite {key_dtype} keys at tokens {lo}..{lo + len(rows)}: the model's "
                          f"keys overflow {key_dtype} or the checkpoint is broken")
  keys[lo - base:lo - base + len(rows)] = rows


def _first_scored(scored_BxL, context_window: int) -> int:
  """`_keys_step`'s `first`: the context window where every row scores nothing before it (a window after the
  first, in none mode), else 0. Two values: two compiles at most."""
  return context_window if context_window and not scored_BxL[:, :context_window].any() else 0


def locked_out_dir(build):
  """Decorate a builder `build(..., out_dir, ...)`: one writer per datastore directory (`<out_dir>.lock` beside
  it, as exports, so the directory itself holds only the datastore); a second build of the same directory
  while one runs is refused naming the process that holds it (runtime.lock.LockedError)."""

  @functools.wraps(build)
  def locked(*args, **kwargs):
    import inspect
    out_dir = inspect.signature(build).bind(*args, **kwargs).arguments["out_dir"]
    with lock_beside(out_dir, f"datastore {out_dir}"):
      return build(*args, **kwargs)

  return locked


@locked_out_dir
def build_datastore(checkpoint_dir: str, corpus: data.Corpus, out_dir: str, *, block_len: int | None = None,
                    context_window: int | None = None, batch_size: int | None = None,
                    chunk_tokens: int = CHUNK_TOKENS, max_chunks: int | None = None,
                    stop_at_tokens: int | None = None, progress: bool = True, key_dtype: str = "float16",
                    entries: str = "all", devices: int = 1) -> dict:
  """Build (or resume) the datastore of `corpus` under the exported model in `checkpoint_dir`.

  block_len / context_window / batch_size default to the checkpoint config's `eval` values. Progress is saved
  every `chunk_tokens` scored tokens (rounded up to whole batches of windows). `max_chunks` stops after that
  many chunks in this call, `stop_at_tokens` once the first that many tokens are done (either way the datastore
  stays incomplete and a later call resumes; a partial build serves `subset_datastore`). Returns meta.json's dict;
  open the result with `Datastore(out_dir)` once `complete` is true. `key_dtype`: float16 (the release's
  --dstore-fp16) or float32 (its default). `entries` (ENTRIES): "all" targets, entry i = position i; "original":
  the original's --save-knnlm-dstore with this batch size, entry i = position first_position + i.
  `devices`: the key pass's forward batches split over this many devices (0: all; their windows padded to a
  multiple of it), the parameters replicated; 1 (default) runs on the default device. Rows are independent, so
  the keys are the same whatever the count up to float32 rounding, which moves a few float16 keys by a spacing
  (0.03% of them on 8 CPU devices, tests/test_sharded.py); a resume with another count says so.
  """
  if key_dtype not in KEY_DTYPES:
    raise ConfigError(f"datastore key dtype must be one of {KEY_DTYPES}, got {key_dtype!r}")
  if entries not in ENTRIES:
    raise ConfigError(f"datastore entries must be one of {ENTRIES}, got {entries!r}")
  graphdef, params, config, vocab, cmeta = exports.load_export(checkpoint_dir)
  if config.model.get("backbone", "transformer") != "transformer":  # keys here come from independent windows
    raise ConfigError(f"datastores are built with the transformer backbone; {checkpoint_dir} is a "
                      f"{config.model.backbone} model, whose keys depend on the state carried along the stream")
  e = config.eval
  block_len = int(block_len or e.block_len)
  context_window = int(e.context_window if context_window is None else context_window)
  batch_size = int(batch_size or e.batch_size)
  mesh = sharding.make_mesh(devices, what="--devices") if devices != 1 else None
  rows_per_forward = batch_size if mesh is None else -(-batch_size // mesh.size) * mesh.size
  if mesh is not None:  # once: a jit argument placed otherwise would be moved at every batch
    params = jax.device_put(params, sharding.replicated(mesh))
  n_devices = 1 if mesh is None else mesh.size
  if block_len > config.model.max_len:
    raise ConfigError(f"block_len={block_len} exceeds the model's max_len={config.model.max_len}")
  if corpus.vocab.fingerprint() != vocab.fingerprint():
    raise CheckpointError(f"corpus {corpus.name or '(unnamed)'} is encoded with vocabulary "
                          f"{corpus.vocab.fingerprint()}, the checkpoint uses {vocab.fingerprint()}: "
                          "encode the corpus with the checkpoint's vocabulary")
  dim = int(cmeta["d_model"])
  wins = data.windows(len(corpus), block_len, context_window)  # ConfigError for a bad context window
  stride = block_len - context_window
  base = 0  # corpus position of entry 0
  if entries == "original":
    wins = [w for w in wins if w.end - w.score_start == stride]  # no partial last window
    if context_window > 0 and wins and wins[0].score_start == wins[0].start:  # the context-less first window:
      wins = wins[1:]  # padded to S + context_window, the original's "Skipping this one" (any batch size)
    if not wins:
      raise ConfigError(f"entries=original: no window of {stride} scored tokens in {len(corpus):,} tokens")
    base = wins[0].score_start
  n = wins[-1].end - base if wins else 0
  per_chunk = batch_size * max(1, -(-chunk_tokens // (batch_size * stride)))  # windows per chunk

  identity = {"format": FORMAT, "count": n, "dimension": dim, "key_dtype": key_dtype, "value_dtype": "int32",
              "checkpoint_fingerprint": exports.fingerprint(checkpoint_dir), "vocab_fingerprint": vocab.fingerprint(),
              "corpus_fingerprint": corpus.fingerprint(), "key_type": cmeta["key_type"],
              "block_len": block_len, "context_window": context_window,
              **({"first_position": base} if entries == "original" else {})}
  writer = DatastoreWriter(out_dir, identity)
  if writer.complete:
    if progress:
      print(f"datastore {out_dir} is already complete ({n:,} tokens)", flush=True)
    return writer.meta
  with writer.no_space_is_an_error():  # a full disk: one line, and the finished chunks stay resumable
    keys, values = writer.open(verify_chunks=True, progress=progress, corpus_name=corpus.name,
                               batch_size=batch_size)
    meta = writer.meta
    done = int(meta["tokens_done"])
    # Every chunk ends at a window boundary except the last, whose end is n (the corpus's end, where a partial
    # last window stops): a build stopped after its last chunk was saved but before finish() (an interrupt, a
    # full disk writing meta.json) has nothing left to compute, and finishes below.
    if done != n and done % stride:
      raise CheckpointError(f"datastore {out_dir}: tokens_done={done} is not a window boundary; delete it")
    if meta.get("batch_size") not in (None, batch_size):
      # Keys are computed in batches of windows: another batch size rounds some float16 keys differently (a
      # last-bit difference), so the files are no longer byte-identical to an uninterrupted build's.
      print(f"warning: datastore build in {out_dir} was started with batch size {meta['batch_size']} and resumes "
            f"with {batch_size}: keys from here on may differ in their last bit from an uninterrupted build's "
            "(meta.json records both)", flush=True)
      meta["resumed_batch_sizes"] = sorted({*meta.get("resumed_batch_sizes", []), batch_size})
    if meta.get("devices", 1) != n_devices and int(meta.get("tokens_done", 0)):
      print(f"warning: datastore build in {out_dir} was started on {meta.get('devices', 1)} device(s) and resumes "
            f"on {n_devices}: keys from here on may differ in their last bit from an uninterrupted build's "
            "(meta.json records both)", flush=True)
      meta["resumed_devices"] = sorted({*meta.get("resumed_devices", []), n_devices})
    meta.setdefault("devices", n_devices)

    first_win = done // stride if done != n else len(wins)
    todo = range(first_win, len(wins), per_chunk)
    t0 = time.perf_counter()
    built, session_s = 0, 0.0
    bar = tqdm(total=n, initial=done, desc="datastore", unit="tok", unit_scale=True, disable=not progress)
    try:  # the bar ends its line before any error message
      for chunk_i, c0 in enumerate(todo):
        if max_chunks is not None and chunk_i >= max_chunks:
          break
        if stop_at_tokens is not None and wins[c0].score_start - base >= stop_at_tokens:
          break
        chunk = wins[c0:c0 + per_chunk]
        a, b = chunk[0].score_start, chunk[-1].end
        pending = None  # the batch on the device: read back after the next one is dispatched (the host builds
        # and dispatches batch i + 1 while the device computes batch i; the same keys, in the same order)
        for i in range(0, len(chunk), batch_size):
          part = chunk[i:i + batch_size]
          real = len(part)
          part = part + [part[-1]] * (rows_per_forward - real)  # fixed shapes: repeat, then ignore
          inputs, _, scored = data.window_batch(corpus, part, block_len)
          first = _first_scored(scored[:real], context_window)
          if mesh is not None:
            inputs = jax.device_put(inputs, sharding.batch_sharding(mesh))
          g = _keys_step(graphdef, params, inputs, key_dtype, first=first)  # dispatched, not waited for
          if pending is not None:
            _write_keys(keys, base, key_dtype, *pending)
          pending = (g, real, scored, first, part[0].score_start)
        _write_keys(keys, base, key_dtype, *pending)
        values[a - base:b - base] = np.asarray(corpus.tokens[a:b], VALUE_DTYPE)
        built += b - a
        dt, t0 = time.perf_counter() - t0, time.perf_counter()
        session_s += dt
        writer.commit(dt, rows=(a - base, b - base), tokens_done=b - base)  # only after the chunk is on disk
        bar.update(b - a)
    finally:
      bar.close()
    del keys, values
    if meta["tokens_done"] == n:
      meta = writer.finish()
  if progress:
    state = "complete" if meta["complete"] else f"incomplete ({meta['tokens_done']:,} of {n:,} tokens)"
    print(f"datastore {out_dir}: {state}; this call wrote {built:,} tokens in {session_s:.1f} s "
          f"({built / max(session_s, 1e-9):,.0f} tokens/s)", flush=True)
  return meta


def _prefix_source(source_dir: str, count: int):
  """(meta, keys, values) of the datastore in `source_dir` whose first `count` entries are final: a complete
  datastore (verified), or a build in progress that has finished at least `count` tokens (each chunk is flushed
  before meta.json records it, so its prefix is what the complete datastore will hold)."""
  meta = _checked_meta(source_dir)
  if not meta.get("complete"):
    done = int(meta.get("tokens_done", 0))
    if not 0 < count <= done:
      raise ConfigError(f"a subset of {count:,} entries: the build in {source_dir} has finished {done:,} of "
                        f"{meta['count']:,} tokens so far (rerun its build command to go on)")
    _, keys_path, values_path = _paths(source_dir)
    keys, values = np.load(keys_path, mmap_mode="r"), np.load(values_path, mmap_mode="r")
    # The prefix must be what was committed: every chunk it overlaps matches its recorded digest.
    covered = 0
    for c in meta.get("chunks") or ():
      if covered >= count:
        break
      a, b = c["rows"]
      if a != covered or _chunk_digest(keys, values, a, b) != c["digest"]:
        raise DamagedCheckpointError(f"the build in {source_dir} is damaged: entries {a:,}..{b:,} changed after "
                                     "they were saved; rerun its build command (it recomputes them) first")
      covered = b
    if covered < count:
      raise DamagedCheckpointError(f"the build in {source_dir} has no digests for its first {count:,} entries "
                                   "(an older version's build): rerun its build command first")
    return meta, keys, values
  src = Datastore(source_dir)
  if not 0 < count <= src.count:
    raise ConfigError(f"a subset of {count:,} entries: the datastore {source_dir} holds {src.count:,}")
  return src.meta, src.keys, src.values


@locked_out_dir
def subset_datastore(source_dir: str, out_dir: str, count: int, *, checkpoint_dir: str | None = None) -> dict:
  """A datastore of the first `count` entries of the datastore in `source_dir` (the first `count` training
  tokens, whole stream order), written without recomputing keys: the size sweep of the paper's analysis. The
  source may be a build still in progress that has finished `count` tokens. Its identity is the source's with
  `count` replaced (so an index records which size it was built for) and meta `subset_of` = the source's
  fingerprint. Rerunning on a finished subset is a no-op. With `checkpoint_dir`, the source must have been built
  by that exported model (checked before anything is written)."""
  src_meta, src_keys, src_values = _prefix_source(source_dir, count)
  if checkpoint_dir is not None:
    _check_meta_checkpoint(source_dir, src_meta, checkpoint_dir)
  identity = {**_identity_of(src_meta), "count": int(count)}
  fp = _identity_fingerprint(identity)
  meta = _read_meta(out_dir)
  _refuse_non_datastore(out_dir, meta)
  if meta is not None:
    if meta.get("fingerprint") == fp and meta.get("subset_of") == src_meta["fingerprint"] and meta.get("complete"):
      return meta
    raise CheckpointError(f"{out_dir} holds a different datastore: choose another output directory or delete it")
  os.makedirs(out_dir, exist_ok=True)
  meta_path, keys_path, values_path = _paths(out_dir)
  t0 = time.perf_counter()
  try:
    for path, arr in ((keys_path, src_keys), (values_path, src_values)):
      out = np.lib.format.open_memmap(path, mode="w+", dtype=arr.dtype, shape=(count,) + arr.shape[1:])
      _reserve(path)  # a memmap write to a full disk would be a SIGBUS
      for a in range(0, count, CHUNK_TOKENS):
        out[a:a + CHUNK_TOKENS] = arr[a:min(a + CHUNK_TOKENS, count)]
      out.flush()
      del out
    meta = {**identity, "fingerprint": fp, "subset_of": src_meta["fingerprint"],
            "corpus_name": src_meta.get("corpus_name"),
            "tokens_done": int(count), "complete": True, "build_seconds": round(time.perf_counter() - t0, 3),
            "file_digests": {os.path.basename(p): file_digest(p) for p in (keys_path, values_path)}}
    data.atomic_write_json(meta_path, meta)  # last: a subset without meta.json is not a datastore
  except BaseException as e:  # a full disk, Ctrl-C, anything (the digests, meta.json included): the copy
    # restarts from 0, so nothing is kept; meta.json first (a subset without it is no datastore), then the space
    for path in (meta_path, keys_path, values_path):
      with contextlib.suppress(OSError):
        os.remove(path)
    if not (isinstance(e, OSError) and is_no_space(e)):
      raise
    need = count * (identity["dimension"] * src_keys.dtype.itemsize + src_values.dtype.itemsize)
    raise CheckpointError(f"no space left for the datastore subset {out_dir} ({os.strerror(e.errno)}): its files "
                          f"need {need / 2**20:,.1f} MiB; free space and rerun the same command") from None
  return meta

