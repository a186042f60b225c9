"""The corpora a config can name (`config.data.corpus`), each split into train / dev / test `Corpus`es.

  wikitext       a WikiText directory with wiki.{train,valid,test}.tokens (WikiText-103 / -2 layout)
  wikitext_mini  the 124 articles of ../shared/data/wikitext-2 (valid + test files), split by article
  bytes          one raw file (enwik8, tinyshakespeare), split by byte fractions, vocabulary 256
  stdlib         the demo corpus: the running interpreter's stdlib sources, one document per file, bytes
  tfds:NAME      a tensorflow-datasets build (trime_jax/tfds_builders: wikitext103, wikitext2, enwik8), downloaded
                 when online or built from the released files in `data.path` (a manual dir); same Corpus as the
                 wikitext / bytes readers of the same files

The vocabulary of word corpora is built from the training split (or given, e.g. a checkpoint's), so dev and
test words unseen in training become `<unk>`.
"""

from __future__ import annotations

import dataclasses
import difflib
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
  return list(_iter_articles(path))


def _iter_articles(path: str, keep=None):
  """data.iter_wikitext_articles (only the articles whose index is in `keep`, if given), with the file and line
  of non-UTF-8 bytes in the error."""
  try:
    for i, article in enumerate(data.iter_wikitext_articles(path)):
      if keep is None or i in keep:
        yield article
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
  paths = {s: data.require_file(os.path.join(root, f), "WikiText token file") for s, f in files.items()}
  keep = {s: None for s in paths}
  if cfg.get("only_packages") or cfg.get("exclude_packages"):
    only, exclude, tsv = tuple(cfg.get("only_packages", ())), tuple(cfg.get("exclude_packages", ())), \
        os.path.join(root, "docs.tsv")
    rows = package_table(tsv, only, exclude)  # a misspelt package fails here, not after reading every split
    counts = {s: sum(1 for _ in _iter_articles(p)) for s, p in paths.items()}
    keep = {s: set(k) for s, k in package_selection(counts, tsv, only, exclude, rows=rows).items()}
  # Articles are read one at a time, twice for train (count, then encode): never all as word lists (WikiText-103's
  # training split would be ~5.5 GB of them; its int32 ids are 413 MB).
  vocab = vocab or data.Vocab.build(_iter_articles(paths["train"], keep["train"]), cfg.vocab_min_count)
  return {s: _encode_word_docs(_iter_articles(p, keep[s]), vocab, f"{cfg.corpus}:{s}") for s, p in paths.items()}


TSV_SPLITS = {"train": "train", "dev": "valid", "test": "test"}


def select_packages(articles: dict, tsv_path: str, only: tuple = (), exclude: tuple = ()) -> dict:
  """The documents of each split whose source package (docs.tsv: split, doc_index, package, title — the
  docs-wt layout) is in `only` (if given) and not in `exclude`. The vocabulary is built afterwards, from the
  kept training documents only (a held-out domain's words are not in it)."""
  keep = package_selection({s: len(docs) for s, docs in articles.items()}, tsv_path, only, exclude)
  return {s: [articles[s][i] for i in k] for s, k in keep.items()}


def package_table(tsv_path: str, only: tuple = (), exclude: tuple = ()) -> list[dict]:
  """The rows of docs.tsv, once `only` and `exclude` are checked against its packages: each name must be one
  of them (a misspelt held-out domain would otherwise hold out nothing), and no name may be in both."""
  if not os.path.isfile(tsv_path):
    raise DataError(f"data.only_packages / exclude_packages need a docs.tsv beside the token files: {tsv_path} "
                    f"not found")
  import csv

  with open(tsv_path, newline="", encoding="utf-8") as f:
    rows = list(csv.DictReader(f, delimiter="\t"))
  if not rows or not {"split", "doc_index", "package"} <= set(rows[0]):
    raise DataError(f"{tsv_path}: expected a header with split, doc_index, package columns")
  known = sorted({r["package"] for r in rows})
  for name, pkgs in (("only_packages", only), ("exclude_packages", exclude)):
    unknown = sorted(set(pkgs) - set(known))
    if unknown:
      close = [m for u in unknown for m in difflib.get_close_matches(u, known, n=1)]
      hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
      listed = ", ".join(known[:6]) + (", ..." if len(known) > 6 else "")
      raise ConfigError(f"data.{name}: unknown package(s) {unknown}{hint}; {tsv_path} lists {len(known)}: {listed}")
  both = sorted(set(only) & set(exclude))
  if both:  # "keep only X" and "drop X" at once: a held-out domain in both the training and the evaluation config
    raise ConfigError(f"data.only_packages and data.exclude_packages both name {both}: a package is either kept or "
                      "held out")
  return rows


def package_selection(num_docs: dict, tsv_path: str, only: tuple = (), exclude: tuple = (), *, rows=None) -> dict:
  """{split: the indices of the documents `select_packages` keeps}, for splits of `num_docs[split]` documents
  (`rows`: `package_table`'s, when already read)."""
  rows = package_table(tsv_path, only, exclude) if rows is None else rows
  out = {}
  for split, n in num_docs.items():
    pkg = {int(r["doc_index"]): r["package"] for r in rows if r["split"] == TSV_SPLITS[split]}
    if sorted(pkg) != list(range(n)):
      raise DataError(f"{tsv_path} lists {len(pkg)} {TSV_SPLITS[split]} documents, the token file has "
                      f"{n}: the table is not this corpus's")
    keep = [i for i in range(n) if (not only or pkg[i] in only) and pkg[i] not in exclude]
    if not keep:
      raise DataError(f"no {split} documents left after data.only_packages={list(only)} / "
                      f"exclude_packages={list(exclude)}")
    out[split] = keep
  return out


# configs/wikitext_mini.py's data.path: where it is missing (a clone without ../shared), TFDS's WikiText-2 stands in.
WIKITEXT_MINI_PATH = "../shared/data/wikitext-2"


def _wikitext_mini(cfg, vocab):
  root = resolve_path(cfg.path)
  if os.path.isdir(root):
    articles = []
    for fn in ("wiki.valid.tokens", "wiki.test.tokens"):
      articles += _read_articles(os.path.join(root, fn))
  elif cfg.path and cfg.path != WIKITEXT_MINI_PATH:  # a path someone gave: not silently another copy of the data
    raise _not_found(cfg, "WikiText-2 directory (wikitext_mini)", "it needs wiki.valid.tokens and wiki.test.tokens")
  else:  # a fresh clone without ../shared: the same articles from TFDS's WikiText-2 (downloaded once)
    articles = _wikitext2_from_tfds(cfg)
  parts = data.split_articles(len(articles), cfg.split_fractions, cfg.split_seed)
  by_split = {s: [articles[i] for i in p] for s, p in zip(SPLITS, parts)}
  vocab = vocab or data.Vocab.build(by_split["train"], cfg.vocab_min_count)
  return {s: _encode_word_docs(a, vocab, f"{cfg.corpus}:{s}") for s, a in by_split.items()}


def _wikitext2_from_tfds(cfg):
  missing = str(_not_found(cfg, "WikiText-2 directory (wikitext_mini)",
                            "it needs wiki.valid.tokens and wiki.test.tokens (../shared/data/wikitext-2 in the "
                            "layout the README describes)"))
  try:
    from trime_jax import tfds_builders
    tfds_builders.import_tfds()
  except DataError:  # tensorflow-datasets not installed
    raise DataError(f"{missing}; or pip install 'trime-jax[tfds]' to download it") from None
  try:
    return [a for s in ("validation", "test") for a in tfds_builders.documents("wikitext2", s, _tfds_data_dir(cfg))]
  except DataError as e:
    raise DataError(f"{missing}, and TFDS could not provide it: {e}") from None


def _tfds_data_dir(cfg) -> str:
  return resolve_path(cfg.get("tfds_data_dir", "") or "")  # configs exported before the field existed lack it


def would_download(cfg) -> bool:
  """Reading `cfg` (a config's data section) would download its corpus: a `tfds:` corpus without a manual
  directory (data.path) whose build is not prepared in data.tfds_data_dir."""
  from trime_jax import tfds_builders

  name = cfg.corpus.split(":", 1)[1] if cfg.corpus.startswith("tfds:") else ""
  if not name or cfg.path or name not in tfds_builders.NAMES:
    return False
  return not tfds_builders.is_prepared(tfds_builders.builder(name, _tfds_data_dir(cfg)))


def _tfds(cfg, vocab):
  from trime_jax import tfds_builders

  name = cfg.corpus.split(":", 1)[1]
  manual = resolve_path(cfg.path) if cfg.path else ""
  docs = lambda s: tfds_builders.iter_documents(name, tfds_builders.SPLIT_NAMES[s], _tfds_data_dir(cfg), manual)
  if name == "enwik8":
    return {s: _byte_docs(list(docs(s)), f"{cfg.corpus}:{s}") for s in SPLITS}
  # Two passes over train (count, then encode): articles are read one at a time, never all as word lists.
  vocab = vocab or data.Vocab.build(docs("train"), cfg.vocab_min_count)
  return {s: _encode_word_docs(docs(s), vocab, f"{cfg.corpus}:{s}") for s in SPLITS}


def _reader(corpus: str):
  """The reader of `data.corpus`: a plain reader, or `tfds:NAME` for a tensorflow-datasets build."""
  from trime_jax import tfds_builders

  if corpus.startswith("tfds:") and corpus[5:] in tfds_builders.NAMES:
    return _tfds
  if corpus not in _READERS:
    names = CORPORA + tuple(f"tfds:{n}" for n in tfds_builders.NAMES)
    raise ConfigError(f"data.corpus must be one of {names}, got {corpus!r}")
  return _READERS[corpus]


def _bytes(cfg, vocab):
  if not os.path.exists(resolve_path(cfg.path)):
    raise _not_found(cfg, "byte corpus", "it is one raw file (enwik8, tinyshakespeare, ...)")
  path = data.require_file(resolve_path(cfg.path), "byte corpus")
  with open(path, "rb") as f:
    raw = f.read()
  fr = np.asarray(cfg.split_fractions, float)
  cuts = np.round(np.cumsum(fr)[:-1] / fr.sum() * len(raw)).astype(int)
  chunks = np.split(np.frombuffer(raw, np.uint8), cuts)
  return {s: _byte_docs([c.tobytes()], f"{cfg.corpus}:{s}") for s, c in zip(SPLITS, chunks)}


def _stdlib(cfg, vocab):
  docs = data.stdlib_documents(cfg.max_files, cfg.max_bytes_per_file)
  parts = data.split_articles(len(docs), cfg.split_fractions, cfg.split_seed)
  empty = [s for s, p in zip(SPLITS, parts) if not len(p)]
  if empty:  # too few files for data.split_fractions to give every split one
    fractions = tuple(cfg.split_fractions)
    fix = ("give it a share" if not fractions[SPLITS.index(empty[0])] else "raise data.max_files"
           if len(docs) >= cfg.max_files else f"this standard library has only {len(docs)} files: give it a larger share")
    raise DataError(f"data.max_files={cfg.max_files}: {len(docs)} standard-library files leave the {empty[0]} split "
                    f"empty under data.split_fractions={fractions}: {fix}")
  return {s: _byte_docs([docs[i][1] for i in p], f"{cfg.corpus}:{s}") for s, p in zip(SPLITS, parts)}


_READERS = {"wikitext": _wikitext, "wikitext_mini": _wikitext_mini, "bytes": _bytes, "stdlib": _stdlib}


# The files a reader opens in its data.path directory: the cache key hashes these (size, mtime), not whatever
# else the folder holds. The paper configs keep their cache and batch plans inside data.path
# (data/wikitext-103/trime_cache, .../plans): hashing the whole folder made each cache or plan written there a
# new key, so WikiText-103 was tokenized again on every run (found by a review).
_READ_FILES = {"wikitext": ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens", "docs.tsv"),
               "wikitext_mini": ("wiki.valid.tokens", "wiki.test.tokens")}


def _input_files(cfg, p: str) -> list[str]:
  """The files under `p` (data.path) the corpus is read from: a file itself, a reader's named files, or (other
  readers) every file of the folder outside the cache directory."""
  if not os.path.isdir(p):
    return [p]
  if cfg.corpus in _READ_FILES:
    return [os.path.join(p, fn) for fn in _READ_FILES[cfg.corpus] if os.path.isfile(os.path.join(p, fn))]
  cache = os.path.realpath(resolve_path(cfg.cache_dir)) if cfg.cache_dir else None
  out = []
  for root, dirs, files in os.walk(p):
    dirs[:] = sorted(d for d in dirs if os.path.realpath(os.path.join(root, d)) != cache)
    out += [os.path.join(root, fn) for fn in sorted(files)]
  return out


# What the readers make of the same files: bump it when a reader's or the tokenizer's output changes (a cache
# written by the older code is then not reused; it stays on disk under its old key until removed).
# 2: iter_wikitext_articles counts a literal </s> line as no text (2026-12-01); the key had no version before.
CACHE_VERSION = 2


def _cache_key(cfg, vocab) -> str:
  h = hashlib.sha256(f"trime-corpus-cache/{CACHE_VERSION}".encode())
  h.update(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
  p = resolve_path(cfg.path)
  if p and os.path.exists(p):
    for path in _input_files(cfg, p):
      st = os.stat(path)
      h.update(f"{os.path.relpath(path, p) if path != p else os.path.basename(p)}:{st.st_size}:{st.st_mtime_ns}".encode())
  if vocab is not None:
    h.update(vocab.fingerprint().encode())
  return h.hexdigest()[:16]


def _load_cached(cache: str, split: str, corpus: str) -> data.Corpus:
  """One split of a finished corpus cache (memory-mapped); a damaged one says which folder to delete."""
  try:
    return data.Corpus.load(os.path.join(cache, split), f"{corpus}:{split}")
  except DataError as e:
    raise DataError(f"{e}: delete {cache} (the next run encodes the corpus again)") from None


def load_splits(cfg, vocab: data.Vocab | None = None) -> Splits:
  """Read `config.data` into train/dev/test corpora (encoded with `vocab` if given).

  With `cfg.cache_dir` set, the encoded corpora are written there once (atomically) and memory-mapped on
  later runs, so a 103M-token corpus is tokenized once and never loaded whole.
  """
  reader = _reader(cfg.corpus)
  picked = [f for f in ("only_packages", "exclude_packages") if cfg.get(f)]
  if picked and reader is not _wikitext:  # the other readers have no docs.tsv: the selection was ignored
    raise ConfigError(f"data.{picked[0]} selects documents by source package (a docs.tsv beside wiki.*.tokens, "
                      f"docs-wt's layout): it needs data.corpus='wikitext', got {cfg.corpus!r}")
  if reader is not _tfds and cfg.corpus != "stdlib" and not cfg.path:  # a tfds: corpus downloads without a path
    raise ConfigError(f"data.path is required for corpus {cfg.corpus!r}: give --config.data.path=PATH (where "
                      "its text is)")
  cache = os.path.join(resolve_path(cfg.cache_dir), _cache_key(cfg, vocab)) if cfg.cache_dir else ""
  out = None
  if cache and os.path.exists(os.path.join(cache, "COMPLETE")):
    out = {s: _load_cached(cache, s, cfg.corpus) for s in SPLITS}
  elif cache and vocab is not None:
    # Evaluation and datastore builds pass the checkpoint's vocabulary; training passed none and cached the
    # corpus encoded with the vocabulary built from it. When that is the given one, the ids are the same: use
    # that cache (memory-mapped) instead of encoding 103M tokens again into a second copy.
    built = os.path.join(resolve_path(cfg.cache_dir), _cache_key(cfg, None))
    if os.path.exists(os.path.join(built, "COMPLETE")):
      train = _load_cached(built, "train", cfg.corpus)
      if train.vocab.fingerprint() == vocab.fingerprint():
        cache = built
        out = {s: train if s == "train" else _load_cached(built, s, cfg.corpus) for s in SPLITS}
  if out is None:
    out = reader(cfg, vocab)
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
