"""Corpora, vocabularies and fixed-length segments (host side, NumPy).

A `Corpus` is one flat int32 token stream (memory-mappable) plus document boundaries. Segments are
`[start, start + length)` ranges of *target* positions in that stream; the input at target position p is the
token at p - 1 (the first position of the stream is fed `vocab.bos`), exactly like fairseq's
`TokenBlockDataset` with shifted "past target" sources, so every token is a target exactly once.

Readers:
  * WikiText-style token files: whitespace tokens, `</s>` at every line end (empty lines included, as fairseq
    does), articles start at ` = Title = ` lines; vocabulary from the training split.
  * raw bytes (enwik8 / tinyshakespeare style): vocabulary 256, split by byte fractions.
  * the demo corpus: source files of the running interpreter's standard library, one document per file.

Evaluation windows (fairseq `eval_lm --context-window`) live here too, beside segments: the evaluator and the
datastore builder both read a split through them (`windows`, `window_batch`, `stream_schedule`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import sysconfig
from typing import Iterable, Iterator, Sequence

import numpy as np

from trime_jax.errors import ConfigError, DataError, first_line

EOS = "</s>"
UNK = "<unk>"
TITLE = re.compile(r"^ = [^=].* =\s*$")


# ----------------------------------------------------------------------------------------------------------
# Vocabulary
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Vocab:
  """Token strings by id. Byte vocabularies have `kind="bytes"` and 256 entries."""

  tokens: list[str]
  kind: str = "words"  # "words" | "bytes"

  def __post_init__(self):
    self.index = {t: i for i, t in enumerate(self.tokens)}
    if len(self.index) != len(self.tokens):
      raise DataError("vocabulary has duplicate tokens")

  def __len__(self):
    return len(self.tokens)

  @property
  def eos(self) -> int:
    return self.index.get(EOS, ord("\n") if self.kind == "bytes" else 0)

  @property
  def unk(self) -> int:
    return self.index.get(UNK, 0)

  @property
  def bos(self) -> int:
    """Input fed before the first token of a stream (fairseq feeds `</s>`)."""
    return self.eos

  def fingerprint(self) -> str:
    h = hashlib.sha256(self.kind.encode())
    for t in self.tokens:
      h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]

  def encode_words(self, words: Iterable[str]) -> list[int]:
    unk = self.unk
    return [self.index.get(w, unk) for w in words]

  def to_json(self) -> dict:
    return {"kind": self.kind, "fingerprint": self.fingerprint(), "tokens": self.tokens}

  @classmethod
  def from_json(cls, obj: dict) -> "Vocab":
    v = cls(list(obj["tokens"]), obj.get("kind", "words"))
    if "fingerprint" in obj and obj["fingerprint"] != v.fingerprint():
      raise DataError(f"vocabulary file is corrupt: fingerprint {obj['fingerprint']} != {v.fingerprint()}")
    return v

  @classmethod
  def bytes(cls) -> "Vocab":
    return cls([f"<0x{i:02X}>" for i in range(256)], kind="bytes")

  @classmethod
  def build(cls, docs_words: Iterable[Sequence[str]], min_count: int = 1) -> "Vocab":
    """`</s>`, `<unk>`, then words by decreasing count (ties alphabetical); rarer than min_count -> `<unk>`."""
    counts = collections.Counter()
    for words in docs_words:
      counts.update(words)
    counts.pop(EOS, None)
    counts.pop(UNK, None)
    kept = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    return cls([EOS, UNK] + kept)


# ----------------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Corpus:
  """A token stream with document boundaries: document d is tokens[doc_starts[d]:doc_starts[d+1]]."""

  tokens: np.ndarray  # [T] int32 (may be a read-only memmap)
  doc_starts: np.ndarray  # [n_docs + 1] int64, doc_starts[0] = 0, doc_starts[-1] = T
  vocab: Vocab
  name: str = ""

  def __post_init__(self):
    if len(self.tokens) == 0:
      raise DataError(f"corpus {self.name or '(unnamed)'} is empty: no tokens")

  @property
  def num_docs(self) -> int:
    return len(self.doc_starts) - 1

  def __len__(self):
    return len(self.tokens)

  def doc_ids(self) -> np.ndarray:
    """[T] document index of every token."""
    return np.repeat(np.arange(self.num_docs, dtype=np.int32), np.diff(self.doc_starts))

  def fingerprint(self) -> str:
    h = hashlib.sha256(self.vocab.fingerprint().encode())
    h.update(np.asarray(self.doc_starts, np.int64).tobytes())
    h.update(np.ascontiguousarray(self.tokens))  # hashed in place (a memmap: no 413-MB copy at WikiText-103)
    return h.hexdigest()[:16]

  @classmethod
  def from_docs(cls, docs: Sequence[np.ndarray], vocab: Vocab, name: str = "") -> "Corpus":
    docs = [np.asarray(d, np.int32) for d in docs if len(d)]
    if not docs:
      raise DataError(f"corpus {name or '(unnamed)'} is empty: no documents with tokens")
    starts = np.zeros(len(docs) + 1, np.int64)
    starts[1:] = np.cumsum([len(d) for d in docs])
    return cls(np.concatenate(docs), starts, vocab, name)

  def save(self, directory: str) -> None:
    """Write tokens.npy, doc_starts.npy and vocab.json atomically (memmap-able on load)."""
    os.makedirs(directory, exist_ok=True)
    _atomic_npy(os.path.join(directory, "tokens.npy"), np.asarray(self.tokens, np.int32))
    _atomic_npy(os.path.join(directory, "doc_starts.npy"), np.asarray(self.doc_starts, np.int64))
    atomic_write_json(os.path.join(directory, "vocab.json"), self.vocab.to_json())

  @classmethod
  def load(cls, directory: str, name: str = "") -> "Corpus":
    try:
      tokens = np.load(os.path.join(directory, "tokens.npy"), mmap_mode="r")
      starts = np.load(os.path.join(directory, "doc_starts.npy"))
      with open(os.path.join(directory, "vocab.json")) as f:
        vocab = Vocab.from_json(json.load(f))
    except FileNotFoundError as e:
      raise DataError(f"incomplete corpus cache in {directory}: {e.filename} is missing") from None
    except (ValueError, OSError, EOFError, KeyError, TypeError, DataError) as e:  # truncated or damaged files
      if isinstance(e, OSError) and e.errno not in (None, errno.EIO, errno.EINVAL):
        raise  # a permission, too many open files, ...: not the cache's damage (deleting it would not help)
      raise DataError(f"damaged corpus cache in {directory} ({first_line(e)})") from None
    return cls(tokens, starts, vocab, name)


@contextlib.contextmanager
def _written_whole_or_not_at_all(tmp: str, path: str):
  """Around writing `tmp` and renaming it to `path`: on any failure (an interrupt too) the temporary file is
  removed, and an OSError of the disk names `path` (a failed write() names no file; NumPy's short write has no
  errno either: "N requested and M written", which a full disk or a file size limit causes)."""
  try:
    yield
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    if isinstance(e, OSError) and e.filename in (None, tmp):
      if not e.errno:
        raise OSError(errno.ENOSPC, f"the disk took only part of the file ({e})", path) from e
      raise OSError(e.errno, os.strerror(e.errno), path) from e
    raise


def atomic_write_json(path: str, obj) -> None:
  """Write `obj` to `path` through a temporary file and a rename: complete or absent (both trainers' workdir and
  export files, datastores' headers)."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with _written_whole_or_not_at_all(tmp, path):
    with open(tmp, "w") as f:
      json.dump(obj, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str, what: str, error: type[Exception], fix: str = "") -> dict:
  """A JSON object (atomic_write_json's), or `error` naming `what` and the file when it is missing, unreadable,
  truncated, or valid JSON of another kind (a list, a number: not a file this project wrote); `fix` (what to do
  about it) ends the message of a damaged file."""
  if not os.path.exists(path):
    raise error(f"{what} {path} is missing")
  fix = f"; {fix}" if fix else ""
  try:
    with open(path, encoding="utf-8") as f:
      obj = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise error(f"{what} {path} is corrupt or truncated ({first_line(e)}){fix}") from None
  if not isinstance(obj, dict):
    raise error(f"{what} {path} holds a JSON {type(obj).__name__}, not an object: not a file this project "
                f"wrote{fix}")
  return obj


def atomic_write_text(path: str, text: str) -> None:
  """`text` to `path` (UTF-8) through a temporary file and a rename, as atomic_write_json (translations)."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with _written_whole_or_not_at_all(tmp, path):
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)


def within(path: str, folder: str) -> bool:
  """Whether `path` is `folder` or lies under it, links resolved (replacing or deleting `folder` would take it)."""
  path, folder = os.path.realpath(path), os.path.realpath(folder)
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def replace_directory(tmp: str, directory: str) -> None:
  """Move the finished `tmp` to `directory`, replacing what is there (an older directory, or a symlink, which is
  replaced by the new directory; its target is left as it is). Two renames: the old entry to `<directory>.old`,
  then `tmp` to `directory`. A reader sees the old or the new one, except after a kill between the two: then the
  old one is at `<directory>.old` and `recover_replaced` (which every writer and best-keeper calls first) puts it
  back, so an interrupted replacement never loses the previous one (for a best/ export, the only copy of the best)."""
  if not str(directory).strip() or within(os.getcwd(), directory):
    # "" is the working directory once made absolute: an unset path would replace it and everything under it
    raise ConfigError(f"refusing to replace {directory!r}: it is the working directory or a folder holding it")
  recover_replaced(directory)
  old = directory + ".old"
  if os.path.lexists(directory):
    _remove_entry(old)  # left by a kill after the second rename: `directory` is the newer
    os.replace(directory, old)  # a symlink is renamed itself, not its target
    os.replace(tmp, directory)
    _remove_entry(old)
  else:
    os.replace(tmp, directory)


def recover_replaced(directory: str) -> bool:
  """Put back the entry `replace_directory` moved to `<directory>.old` when a kill stopped it before the new one
  was renamed into place (`directory` absent); True when it did. A `.old` beside a `directory` was left by a kill
  after the new one was in place (or while the old one was being removed): it is removed, so it is never put
  back later over a newer one. Call under the directory's lock."""
  old = directory + ".old"
  if os.path.lexists(directory):
    _remove_entry(old)
    return False
  if not os.path.lexists(old):
    return False
  os.replace(old, directory)
  print(f"warning: {directory} was being replaced when its writer stopped: the previous one ({old}) is put back",
        flush=True)
  return True


def _remove_entry(path: str) -> None:
  """Remove a directory tree, a file or a symlink (never its target); absent is fine."""
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.remove(path)


def _atomic_npy(path: str, arr: np.ndarray) -> None:
  tmp = f"{path}.tmp.{os.getpid()}.npy"
  with _written_whole_or_not_at_all(tmp, path):
    with open(tmp, "wb") as f:
      np.save(f, arr)
      f.flush()
      os.fsync(f.fileno())  # on disk before the rename (and the caller's COMPLETE marker) says it is whole
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------------------
def require_file(path: str, what: str, *, example: str = "", error: type[Exception] = DataError) -> str:
  """`path` is a readable, non-empty file (returned): else one `error` that says what it is instead (no path,
  missing, a folder, unreadable, empty). For a folder, `example` (a file name, e.g. "dict.txt") adds which file to
  give: one of the folder's own with that suffix when there is one."""
  if not path:
    raise error(f"no path given for {what}")
  if not os.path.exists(path):
    raise error(f"{what} not found: {path}")
  if os.path.isdir(path):
    hint = ""
    if example:
      suffix = os.path.splitext(example)[1]
      inside = sorted(n for n in os.listdir(path) if n.endswith(suffix)) if os.access(path, os.R_OK) else []
      hint = f": give the file itself (e.g. {os.path.join(path, inside[0] if inside else example)})"
    raise error(f"{what} {path} is a folder, not a file{hint}")
  if not os.access(path, os.R_OK):
    raise error(f"{what} {path}: no permission to read it")
  if os.path.isfile(path) and os.path.getsize(path) == 0:
    raise error(f"{what} is empty: {path}")
  return path


def read_wikitext_articles(path: str) -> list[list[str]]:
  """Articles of a WikiText token file as word lists, `</s>` appended at every line end.

  A new article starts at each ` = Title = ` line (section headings ` = = ... = = ` do not split); lines
  before the first title belong to the first article. All of them at once: `iter_wikitext_articles` reads one
  at a time (WikiText-103's training split as word lists is ~5.5 GB).
  """
  return list(iter_wikitext_articles(path))


def iter_wikitext_articles(path: str) -> Iterator[list[str]]:
  """`read_wikitext_articles(path)`, one article at a time (the file is read as it is consumed)."""
  require_file(path, "WikiText token file")
  current: list[str] = []
  text = False  # any word besides </s> so far
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.rstrip("\n")
      if TITLE.match(line) and any(w != EOS for w in current):
        yield current
        current = []
      words = line.split()
      text = text or any(w != EOS for w in words)
      current.extend(words)
      current.append(EOS)
  if not text:
    raise DataError(f"WikiText token file has no text: {path}")
  if current:
    yield current


def split_articles(n: int, fractions: Sequence[float], seed: int = 0) -> list[np.ndarray]:
  """Deterministic split of n articles into consecutive groups after a seeded shuffle."""
  if n < len(fractions):
    raise DataError(f"cannot split {n} documents into {len(fractions)} non-empty parts")
  order = np.random.default_rng(seed).permutation(n)
  cuts = np.round(np.cumsum(fractions)[:-1] / np.sum(fractions) * n).astype(int)
  cuts = np.clip(cuts, 1, n - 1)
  return [np.sort(p) for p in np.split(order, cuts)]


def stdlib_documents(max_files: int, max_bytes_per_file: int = 1 << 20) -> list[tuple[str, bytes]]:
  """A fixed sorted sample of the running interpreter's stdlib `.py` sources (tests and site-packages
  excluded), as (relative path, bytes). Deterministic for a given interpreter."""
  root = sysconfig.get_paths()["stdlib"]
  if not os.path.isdir(root):
    raise DataError(f"standard library sources not found at {root}")
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel = os.path.relpath(dirpath, root)
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib",
                                                           "__pycache__", "lib2to3", "turtledemo"))
    for fn in filenames:
      if fn.endswith(".py"):
        paths.append(os.path.normpath(os.path.join(rel, fn)))
  paths.sort()
  if not paths:
    raise DataError(f"no .py files under {root}")
  step = max(1, len(paths) // max_files)
  chosen = paths[::step][:max_files]
  docs = []
  for rel in chosen:
    with open(os.path.join(root, rel), "rb") as f:
      data = f.read(max_bytes_per_file)
    if data:
      docs.append((rel, data))
  return docs


# ----------------------------------------------------------------------------------------------------------
# Segments and batches
# ----------------------------------------------------------------------------------------------------------
SEGMENTATIONS = ("stream", "document")


@dataclasses.dataclass
class Segments:
  """Fixed-length training examples: targets corpus.tokens[start : start + length], padded to L."""

  start: np.ndarray  # [S] int64 first target position
  length: np.ndarray  # [S] int32 number of real targets (<= L)
  doc: np.ndarray  # [S] int32 document of the first target
  index_in_doc: np.ndarray  # [S] int32 segment index within its document (document segmentation)
  seg_len: int

  def __len__(self):
    return len(self.start)


def make_segments(corpus: Corpus, seg_len: int, mode: str = "stream") -> Segments:
  """Cut the corpus into segments of `seg_len` targets.

  stream:   consecutive chunks of the whole stream, crossing document boundaries (fairseq
            `--sample-break-mode none`); only the last segment is short.
  document: chunks within each document, the last chunk of every document padded (target -1), so each
            segment belongs to one document and `index_in_doc` orders a document's segments.
  """
  if seg_len < 1:
    raise DataError(f"segment length must be positive, got {seg_len}")
  if mode == "stream":
    starts = np.arange(0, len(corpus), seg_len, dtype=np.int64)
    lengths = np.minimum(seg_len, len(corpus) - starts).astype(np.int32)
    docs = (np.searchsorted(corpus.doc_starts, starts, side="right") - 1).astype(np.int32)
    first_in_doc = np.searchsorted(starts, corpus.doc_starts[:-1])
    index = (np.arange(len(starts)) - first_in_doc[docs]).astype(np.int32)
    return Segments(starts, lengths, docs, index, seg_len)
  if mode == "document":
    doc_len = np.diff(corpus.doc_starts)
    n_seg = -(-doc_len // seg_len)
    docs = np.repeat(np.arange(corpus.num_docs, dtype=np.int32), n_seg)
    first = np.repeat(np.cumsum(n_seg) - n_seg, n_seg)
    index = (np.arange(len(docs)) - first).astype(np.int32)
    starts = corpus.doc_starts[docs] + index.astype(np.int64) * seg_len
    ends = corpus.doc_starts[docs + 1]
    lengths = np.minimum(seg_len, ends - starts).astype(np.int32)
    return Segments(starts, lengths, docs, index, seg_len)
  raise DataError(f"segmentation must be one of {SEGMENTATIONS}, got {mode!r}")


def _target_positions(segments: Segments, idx: np.ndarray):
  """(positions [n, L], valid [n, L]): the corpus position of every target slot of segments `idx`, and which
  slots hold a real target (-1 rows and the short tail of the stream's last segment do not)."""
  idx = np.asarray(idx)
  offs = np.arange(segments.seg_len)
  real = idx >= 0
  safe = np.where(real, idx, 0)
  pos = segments.start[safe][:, None] + offs[None, :]
  valid = real[:, None] & (offs[None, :] < segments.length[safe][:, None])
  return pos, valid


def gather_segments(corpus: Corpus, segments: Segments, idx: np.ndarray):
  """(inputs [n, L], targets [n, L]) for segment indices `idx` (-1: an all-padding row)."""
  pos, valid = _target_positions(segments, idx)
  tokens = corpus.tokens
  targets = np.where(valid, tokens[np.where(valid, pos, 0)], -1).astype(np.int32)
  prev = pos - 1
  inputs = np.where(prev >= 0, tokens[np.clip(prev, 0, len(tokens) - 1)], corpus.vocab.bos)
  inputs = np.where(valid, inputs, 0).astype(np.int32)
  return inputs, targets


def segment_documents(corpus: Corpus, segments: Segments, idx: np.ndarray) -> np.ndarray:
  """[n, L] int32 document index of every target position of segments `idx` (-1 for padding), for packed
  runs whose memory must stay within a document."""
  pos, valid = _target_positions(segments, idx)
  docs = np.searchsorted(corpus.doc_starts, pos, side="right") - 1
  return np.where(valid, docs, -1).astype(np.int32)


def random_batch_indices(num_segments: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """Segment indices [batch_size] of batch `step` (-1: an all-padding row) in an endless sequence of epochs.

  Epochs are whole batches: epoch e is batches e·K … e·K + K − 1, K = ⌈N / batch_size⌉, that visit a seeded
  permutation of the N segments in order; its last batch holds the permutation's remainder and all-padding rows
  after it. So an epoch has fairseq's number of updates and the next one starts on a fresh update, as the
  original's iterator does (its last group of batches is shorter; the loss is normalised by the update's tokens,
  so a padded and a smaller update weigh the same). fairseq composes its GPU batches once and reshuffles their
  order each epoch; this permutes the segments each epoch. The two are the same draw where an original GPU batch
  is one segment (the 247M scripts: one 3,072-token block per GPU, the update's segments gathered across GPUs
  drawn afresh each epoch), and the loss cannot tell them apart where the memory stays inside a segment (local
  memory: the other paper scripts' random batches); they differ for in-batch memory over GPU batches of several
  segments (none of the paper's configs; e.g. docs-wt's random-batch TrimeLM_ext ablation after its first
  epoch, if its 8-segment batch is read as one original GPU's). Every segment
  appears once per epoch and no batch holds a segment twice (`random_batch_indices_straddling`, the layout
  before 2026-12-06, could: a batch took the tail of one permutation and the head of the next, and TRIME's
  in-batch memory then held the segment's own copy). Batch `step` depends only on (seed, step), so training
  resumes exactly.
  """
  if num_segments < 1:
    raise DataError("no training segments")
  per_epoch = -(-num_segments // batch_size)
  epoch, j = divmod(int(step), per_epoch)
  part = np.random.default_rng([seed, epoch]).permutation(num_segments)[j * batch_size:(j + 1) * batch_size]
  out = np.full(batch_size, -1, np.int64)
  out[:len(part)] = part
  return out


def random_batch_indices_straddling(num_segments: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """The batches of `random_batch_indices` before 2026-12-06, kept for runs that started with them (a resume
  goes on in the order it began): one endless sequence of the same seeded epoch permutations, a batch that
  reaches an epoch's end taking the next permutation's head."""
  if num_segments < 1:
    raise DataError("no training segments")
  first, out, filled = step * batch_size, np.empty(batch_size, np.int64), 0
  while filled < batch_size:
    epoch, offset = divmod(first + filled, num_segments)
    take = min(batch_size - filled, num_segments - offset)
    out[filled:filled + take] = np.random.default_rng([seed, epoch]).permutation(num_segments)[offset:offset + take]
    filled += take
  return out


# ----------------------------------------------------------------------------------------------------------
# Evaluation windows: every target scored once, each chunk fed with up to `context_window` tokens before it.
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Window:
  start: int  # first target position fed to the model
  score_start: int  # first scored target position
  end: int  # one past the last target position (scored and fed)
  context: tuple = ()  # complete mode after a dropped line (`complete_windows(overlong="drop")`): the target
  #   ranges (a, b) fed as context, in order, where they are not [start, score_start); `start` is then
  #   score_start minus their length (the row offset of the first scored token), not a position fed


def windows(num_targets: int, block_len: int, context_window: int) -> list[Window]:
  """Chunks of S = block_len - context_window scored targets, each fed with up to `context_window` earlier
  targets as context only (fairseq `--context-window`)."""
  if not 0 <= context_window < block_len:
    raise ConfigError(f"eval.context_window={context_window} must be in [0, block_len={block_len})")
  stride = block_len - context_window
  out = []
  for s in range(0, num_targets, stride):
    e = min(s + stride, num_targets)
    out.append(Window(max(0, s - context_window), s, e))
  return out


BREAK_MODES = ("none", "complete")
# complete mode, a line longer than block_len (eval.complete_overlong): drop = fairseq eval_lm's
# ignore_invalid_inputs (the original's numbers) | refuse = a ConfigError naming the line
COMPLETE_OVERLONG = ("drop", "refuse")


def line_lengths(tokens: np.ndarray, eos: int) -> np.ndarray:
  """Lengths of the lines of a token stream: each line ends with (and includes) an `eos`; a last line without
  one is a line too (fairseq's sentence sizes, `</s>` appended to every line)."""
  ends = np.flatnonzero(np.asarray(tokens) == eos) + 1
  if not len(ends) or ends[-1] != len(tokens):
    ends = np.append(ends, len(tokens))
  return np.diff(ends, prepend=0)


def complete_windows(sizes, block_len: int, context_window: int, overlong: str = "drop") -> list[Window]:
  """fairseq `--sample-break-mode complete` with `--context-window` (eval_lm): blocks of whole lines, each at
  most S = block_len - context_window tokens (a longer line is a block of its own), packed greedily in order
  (`TokenBlockDataset`); each block is fed after as many earlier tokens as fit in block_len, at most
  context_window (`LMContextWindowDataset`: its previous tokens, trimmed so the sample stays within block_len).

  A line longer than block_len cannot be fed whole. overlong="drop" does what eval_lm does: the batch iterator
  skips its block (`ignore_invalid_inputs`), so its tokens are not scored, and the collater's context, which
  only fed blocks update, is the last tokens of the blocks fed before (`Window.context`), not the text right
  before the next block (the long-term store is cleared there too: `evaluate.stream_plan`). "refuse": a
  ConfigError naming the line, never a silent split."""
  if not 0 <= context_window < block_len:
    raise ConfigError(f"eval.context_window={context_window} must be in [0, block_len={block_len})")
  if overlong not in COMPLETE_OVERLONG:
    raise ConfigError(f"eval.complete_overlong must be one of {COMPLETE_OVERLONG}, got {overlong!r}")
  sizes = np.asarray(sizes, np.int64)
  if overlong == "refuse" and len(sizes) and sizes.max() > block_len:
    longer = np.flatnonzero(sizes > block_len)
    line = int(longer[0])
    raise ConfigError(f"eval.sample_break_mode=complete: line {line} has {int(sizes[line])} tokens, more than "
                      f"eval.block_len={block_len} ({len(longer):,} such lines); use sample_break_mode=none, a "
                      f"longer block, or eval.complete_overlong=drop (fairseq's eval_lm skips such lines)")
  stride = block_len - context_window
  blocks, start, size = [], 0, 0
  for n in sizes.tolist():
    if size and size + n > stride:
      blocks.append((start, start + size))
      start, size = start + size, 0
    size += n
  if size:
    blocks.append((start, start + size))
  out, fed = [], []  # fed: the target ranges of the blocks fed so far (the collater's prev_tokens come from them)
  for s, e in blocks:
    if e - s > block_len:  # only a single line is longer than S, so this drops exactly one line
      continue
    ctx = min(context_window, sum(b - a for a, b in fed), block_len - (e - s))
    ranges, need = [], ctx  # the last ctx fed positions, as target ranges (most recent first)
    for a, b in reversed(fed):
      if not need:
        break
      take = min(need, b - a)
      if ranges and ranges[-1][0] == b:  # contiguous with the later range: merge
        ranges[-1] = (b - take, ranges[-1][1])
      else:
        ranges.append((b - take, b))
      need -= take
    if not ranges or ranges == [(s - ctx, s)]:  # the tokens right before s (always so without drops)
      out.append(Window(s - ctx, s, e))
    else:
      # a context that jumps over dropped lines. Its labels as local memory: the original rolls the fed inputs
      # (the next slot's input), we take each position's own next token; both are the `</s>` ending a block's
      # last line wherever the row jumps, since blocks are whole lines
      out.append(Window(s - ctx, s, e, tuple(ranges[::-1])))
    fed.append((s, e))
    while len(fed) > 1 and sum(b - a for a, b in fed[1:]) >= context_window:
      fed.pop(0)  # keeps `fed` short; its total only matters up to context_window
  return out


def eval_windows(corpus: Corpus, num_targets: int, block_len: int, context_window: int,
                 break_mode: str = "none", overlong: str = "drop") -> list[Window]:
  """The evaluation windows of the first `num_targets` targets of `corpus` in fairseq's `--sample-break-mode`
  (none: fixed chunks, `windows`; complete: whole lines, `complete_windows`, where a line longer than block_len
  is dropped or refused by `overlong`)."""
  if break_mode == "none":
    return windows(num_targets, block_len, context_window)
  if break_mode != "complete":
    raise ConfigError(f"eval.sample_break_mode={break_mode!r}: choose one of {BREAK_MODES}")
  tokens = np.asarray(corpus.tokens[:num_targets])
  if not (tokens == corpus.vocab.eos).any():
    raise ConfigError(f"eval.sample_break_mode=complete needs `</s>` line ends; corpus {corpus.name or ''} has "
                      f"none in its first {num_targets} tokens (use sample_break_mode=none)")
  wins = complete_windows(line_lengths(tokens, corpus.vocab.eos), block_len, context_window, overlong)
  if not wins:
    raise ConfigError(f"eval.sample_break_mode=complete: every line of {corpus.name or 'the split'} is longer "
                      f"than eval.block_len={block_len}, nothing to score")
  return wins


def window_targets(w: Window) -> np.ndarray:
  """The target positions window `w` feeds, in order: its context, then its scored block."""
  if not w.context:
    return np.arange(w.start, w.end)
  return np.concatenate([np.arange(a, b) for a, b in w.context] + [np.arange(w.score_start, w.end)])


def window_batch(corpus: Corpus, wins: list[Window], block_len: int):
  """inputs / targets [b, L] (-1 padded) and the scored mask [b, L]."""
  b = len(wins)
  inputs = np.zeros((b, block_len), np.int32)
  targets = np.full((b, block_len), -1, np.int32)
  scored = np.zeros((b, block_len), bool)
  toks = corpus.tokens
  for i, w in enumerate(wins):
    n = w.end - w.start
    if w.context:  # a context that jumps over dropped lines: gather position by position
      pos = window_targets(w)
      targets[i, :n] = toks[pos]
      inputs[i, :n] = np.where(pos > 0, toks[np.maximum(pos - 1, 0)], corpus.vocab.bos)
    else:
      targets[i, :n] = toks[w.start:w.end]
      if w.start == 0:
        inputs[i, 0] = corpus.vocab.bos
        inputs[i, 1:n] = toks[0:n - 1]
      else:
        inputs[i, :n] = toks[w.start - 1:w.end - 1]
    scored[i, w.score_start - w.start:n] = True
  return inputs, targets, scored


def stream_schedule(wins: list[Window], doc_starts, streams: int, mem_size: int, reset_at_documents: bool, *,
                    context_window: int, store_starts=None):
  """Which window each stream runs at each step: (window [T, streams] int64, -1 = idle; score [T, streams]).

  The windows are cut into `streams` contiguous runs of about equal length; a run starting at window k is
  preceded by warm-up windows (run, inserted into the long-term store, not scored): those whose scored tokens
  lie in [lo, score_start_k), lo = score_start_k - context_window - mem_size (the store's reach, see
  `evaluate.long_term_block`; raised to the start of score_start_k's document with `reset_at_documents`, and
  to the last of the sorted positions `store_starts` at or before it: where the store is cleared, e.g. after
  a dropped line); every later window of the run needs nothing older. Each cut is placed, within a
  quarter run of its even position, where the warm-up is shortest (e.g. at a document start).
  """
  n_w = len(wins)
  score_start = np.array([w.score_start for w in wins], np.int64)
  end = np.array([w.end for w in wins], np.int64)
  lo = score_start - context_window - mem_size
  if reset_at_documents:
    doc_starts = np.asarray(doc_starts, np.int64)
    lo = np.maximum(lo, doc_starts[np.searchsorted(doc_starts, score_start, side="right") - 1])
  if store_starts is not None and len(store_starts):
    store_starts = np.asarray(store_starts, np.int64)
    lo = np.maximum(lo, store_starts[np.maximum(np.searchsorted(store_starts, score_start, side="right") - 1, 0)])
  first = np.searchsorted(end, lo, side="right") if mem_size else np.arange(n_w)
  warm = np.arange(n_w) - np.minimum(first, np.arange(n_w))
  s = max(1, min(streams, n_w))
  radius = max(1, n_w // (4 * s))
  cuts = [0]
  for i in range(1, s):
    target = round(i * n_w / s)
    cand = np.arange(max(cuts[-1] + 1, target - radius), min(n_w - (s - i), target + radius) + 1)
    cuts.append(int(cand[np.lexsort((np.abs(cand - target), warm[cand]))[0]]))
  cuts.append(n_w)
  runs = [(np.arange(a - warm[a], b), np.arange(a - warm[a], b) >= a) for a, b in zip(cuts[:-1], cuts[1:])]
  t = max(len(w) for w, _ in runs)
  win = np.full((t, streams), -1, np.int64)
  score = np.zeros((t, streams), bool)
  for j, (w, sc) in enumerate(runs):
    win[:len(w), j], score[:len(w), j] = w, sc
  return win, score
