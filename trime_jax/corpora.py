"""The corpora a config can name (`config.data.corpus`), each split into train / dev / test `Corpus`es.

  wikitext       a WikiText directory with wiki.{train,valid,test}.tokens (WikiText-103 / -2 layout)
  wikitext_mini  the 124 articles of ../shared/data/wikitext-2 (valid + test files), split by article
  bytes          one raw file (enwik8, tinyshakespeare), split by byte fractions, vocabulary 256
  stdlib         the demo corpus: the running interpreter's stdlib sources, one document per file, bytes

The vocabulary of word corpora is built from the training split (or given, e.g. a checkpoint's), so dev and
test words unseen in training become `<unk>`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from trime_jax import data
from trime_jax.errors import ConfigError, DataError

CORPORA = ("wikitext", "wikitext_mini", "bytes", "stdlib")
SPLITS = ("train", "dev", "test")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Splits:
  train: data.Corpus
  dev: data.Corpus
  test: data.Corpus

  @property
  def vocab(self) -> data.Vocab:
    return self.train.vocab

  def get(self, split: str) -> data.Corpus:
    if split not in SPLITS:
      raise ConfigError(f"unknown split {split!r}; choose one of {SPLITS}")
    return getattr(self, split)


def resolve_path(path: str) -> str:
  """A relative path is tried against the working directory, then against the repository root."""
  if not path or os.path.isabs(path) or os.path.exists(path):
    return path
  alt = os.path.join(REPO_ROOT, path)
  return alt if os.path.exists(alt) else path


def _not_found(cfg, what: str, needs: str) -> DataError:
  """Where a relative data.path was looked for, and how to point it elsewhere."""
  places = [os.path.abspath(cfg.path)] + ([os.path.join(REPO_ROOT, cfg.path)] if not os.path.isabs(cfg.path) else [])
  return DataError(f"{what} not found: data.path={cfg.path!r} (looked in {' and '.join(dict.fromkeys(places))}); "
                   f"{needs}, or set --config.data.path=/path/to/it (the README says where each corpus comes from)")


def _read_articles(path: str):
  """data.read_wikitext_articles, with the file and line of non-UTF-8 bytes in the error."""
  try:
    return data.read_wikitext_articles(path)
  except UnicodeDecodeError as e:
    with open(path, "rb") as f:
      for lineno, line in enumerate(f, 1):
        try:
          line.decode("utf-8")
        except UnicodeDecodeError as bad:
          raise DataError(f"{path}, line {lineno}: not UTF-8 text (byte {line[bad.start]:#04x} at column "
                          f"{bad.start + 1}); word corpora must be UTF-8") from None
    raise DataError(f"{path}: not UTF-8 text ({e})") from None


def _encode_word_docs(docs_words, vocab, name):
  return data.Corpus.from_docs([np.asarray(vocab.encode_words(w), np.int32) for w in docs_words], vocab, name)


def _byte_docs(chunks, name):
  return data.Corpus.from_docs([np.frombuffer(c, np.uint8).astype(np.int32) for c in chunks], data.Vocab.bytes(),
                            name)


def _wikitext(cfg, vocab):
  root = resolve_path(cfg.path)
  if not os.path.isdir(root):
    raise _not_found(cfg, "WikiText directory", "it needs wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens")
  files = {"train": "wiki.train.tokens", "dev": "wiki.valid.tokens", "test": "wiki.test.tokens"}
  articles = {s: _read_articles(os.path.join(root, f)) for s, f in files.items()}
  vocab = vocab or data.Vocab.build(articles["train"], cfg.vocab_min_count)
  return {s: _encode_word_docs(a, vocab, f"{cfg.corpus}:{s}") for s, a in articles.items()}


def _wikitext_mini(cfg, vocab):
  root = resolve_path(cfg.path)
  if not os.path.isdir(root):
    raise _not_found(cfg, "WikiText-2 directory (wikitext_mini)",
                     "it needs wiki.valid.tokens and wiki.test.tokens (../shared/data/wikitext-2 in the layout "
                     "the README describes)")
  articles = []
  for fn in ("wiki.valid.tokens", "wiki.test.tokens"):
    articles += _read_articles(os.path.join(root, fn))
  parts = data.split_articles(len(articles), cfg.split_fractions, cfg.split_seed)
  by_split = {s: [articles[i] for i in p] for s, p in zip(SPLITS, parts)}
  vocab = vocab or data.Vocab.build(by_split["train"], cfg.vocab_min_count)
  return {s: _encode_word_docs(a, vocab, f"{cfg.corpus}:{s}") for s, a in by_split.items()}


def _bytes(cfg, vocab):
  if not os.path.exists(resolve_path(cfg.path)):
    raise _not_found(cfg, "byte corpus", "it is one raw file (enwik8, tinyshakespeare, ...)")
  path = data._require_file(resolve_path(cfg.path), "byte corpus")
  with open(path, "rb") as f:
    raw = f.read()
  fr = np.asarray(cfg.split_fractions, float)
  cuts = np.round(np.cumsum(fr)[:-1] / fr.sum() * len(raw)).astype(int)
  chunks = np.split(np.frombuffer(raw, np.uint8), cuts)
  return {s: _byte_docs([c.tobytes()], f"{cfg.corpus}:{s}") for s, c in zip(SPLITS, chunks)}


def _stdlib(cfg, vocab):
  docs = data.stdlib_documents(cfg.max_files, cfg.max_bytes_per_file)
  parts = data.split_articles(len(docs), cfg.split_fractions, cfg.split_seed)
  return {s: _byte_docs([docs[i][1] for i in p], f"{cfg.corpus}:{s}") for s, p in zip(SPLITS, parts)}


_READERS = {"wikitext": _wikitext, "wikitext_mini": _wikitext_mini, "bytes": _bytes, "stdlib": _stdlib}


def _cache_key(cfg, vocab) -> str:
  h = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
  p = resolve_path(cfg.path)
  if p and os.path.exists(p):
    for root, _, files in os.walk(p) if os.path.isdir(p) else [(os.path.dirname(p), [], [os.path.basename(p)])]:
      for fn in sorted(files):
        st = os.stat(os.path.join(root, fn))
        h.update(f"{fn}:{st.st_size}:{st.st_mtime_ns}".encode())
  if vocab is not None:
    h.update(vocab.fingerprint().encode())
  return h.hexdigest()[:16]


def load_splits(cfg, vocab: data.Vocab | None = None) -> Splits:
  """Read `config.data` into train/dev/test corpora (encoded with `vocab` if given).

  With `cfg.cache_dir` set, the encoded corpora are written there once (atomically) and memory-mapped on
  later runs, so a 103M-token corpus is tokenized once and never loaded whole.
  """
  if cfg.corpus not in _READERS:
    raise ConfigError(f"data.corpus must be one of {CORPORA}, got {cfg.corpus!r}")
  if cfg.corpus != "stdlib" and not cfg.path:
    raise ConfigError(f"data.path is required for corpus {cfg.corpus!r}")
  cache = os.path.join(resolve_path(cfg.cache_dir), _cache_key(cfg, vocab)) if cfg.cache_dir else ""
  if cache and os.path.exists(os.path.join(cache, "COMPLETE")):
    out = {s: data.Corpus.load(os.path.join(cache, s), f"{cfg.corpus}:{s}") for s in SPLITS}
  else:
    out = _READERS[cfg.corpus](cfg, vocab)
    if cache:
      for s, c in out.items():
        c.save(os.path.join(cache, s))
      open(os.path.join(cache, "COMPLETE"), "w").close()  # marks a finished cache; partial ones are redone
  got = out["train"].vocab
  if vocab is not None and got.fingerprint() != vocab.fingerprint():
    if got.kind != vocab.kind:
      raise DataError(f"data.corpus={cfg.corpus!r} is {got.kind}-level ({len(got)} tokens) but the given vocabulary "
                      f"(the checkpoint's) is {vocab.kind}-level ({len(vocab)} tokens): use the data config the "
                      "model was trained with")
    where = f"the cached corpus in {cache}" if cache else f"data.corpus={cfg.corpus!r}"
    raise DataError(f"{where} is encoded with vocabulary {got.fingerprint()}, not the given {vocab.fingerprint()}"
                    + ("; delete the cache directory" if cache else ""))
  return Splits(**out)
