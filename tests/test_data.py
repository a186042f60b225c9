"""Corpus readers, vocabularies, segments and batch order."""

import os
import re

import ml_collections
import numpy as np
import pytest

from tests.helpers import WIKI_SAMPLE, write_text_file, write_wikitext_dir
from trime_jax import corpora
from trime_jax import data as D
from trime_jax.errors import ConfigError, DataError


def _wiki_cfg(path, **kw):
  c = ml_collections.ConfigDict(dict(corpus="wikitext", path=str(path), cache_dir="", split_fractions=(0.8, 0.1, 0.1),
                                     split_seed=0, vocab_min_count=1, max_files=10, max_bytes_per_file=10_000))
  c.update(kw)
  return c


def test_wikitext_reader_articles_eos_and_vocab(tmp_path):
  path = tmp_path / "wiki.train.tokens"
  path.write_text(WIKI_SAMPLE)
  arts = D.read_wikitext_articles(str(path))
  assert len(arts) == 3  # section headings do not split articles
  assert arts[0][:5] == ["</s>", "=", "Alpha", "Article", "="]  # the leading empty line is an </s>
  lines = WIKI_SAMPLE.split("\n")[:-1]  # the file ends with a newline
  assert sum(a.count("</s>") for a in arts) == len(lines)  # one </s> per line, empty lines included
  assert sum(len(a) for a in arts) == sum(len(l.split()) + 1 for l in lines)
  vocab = D.Vocab.build(arts, min_count=2)
  assert vocab.tokens[:2] == ["</s>", "<unk>"]
  counts = {w: sum(a.count(w) for a in arts) for w in vocab.tokens[2:]}
  assert all(c >= 2 for c in counts.values())
  assert list(counts.values()) == sorted(counts.values(), reverse=True)
  ids = vocab.encode_words(["second", "Alpha", "zzz-never-seen"])  # "second" occurs once: below min_count
  assert ids[0] == vocab.unk and ids[1] == vocab.index["Alpha"] and ids[2] == vocab.unk


def test_wikitext_splits_and_cache_are_memory_mapped(tmp_path):
  root = write_wikitext_dir(tmp_path / "wt")
  cfg = _wiki_cfg(root, cache_dir=str(tmp_path / "cache"))
  a = corpora.load_splits(cfg)
  b = corpora.load_splits(cfg)  # from the cache
  assert isinstance(b.train.tokens, np.memmap)
  assert a.train.fingerprint() == b.train.fingerprint() and a.vocab.fingerprint() == b.vocab.fingerprint()
  assert a.train.num_docs == 3 and len(a.dev) == len(a.train)
  # Encoding with a given vocabulary (e.g. a checkpoint's): unknown words become <unk>.
  small = D.Vocab(["</s>", "<unk>", "Alpha"])
  c = corpora.load_splits(_wiki_cfg(root), vocab=small)
  assert set(np.unique(c.test.tokens)) <= {0, 1, 2}


def test_a_cache_and_plans_inside_the_data_folder_are_reused(tmp_path, monkeypatch):
  """The paper configs keep data.cache_dir and their batch plans inside data.path (data/wikitext-103/...): the
  second run reads the first one's cache, whatever else was written beside the token files; a token file
  changed is a new key (found by a review: every file of the folder was hashed, so each run encoded again)."""
  root = write_wikitext_dir(tmp_path / "wt")
  cfg = _wiki_cfg(root, cache_dir=os.path.join(root, "trime_cache"))
  first = corpora.load_splits(cfg)
  os.makedirs(os.path.join(root, "plans"))
  with open(os.path.join(root, "plans", "bm25_3072x8.npz"), "wb") as f:
    f.write(b"a plan")
  monkeypatch.setitem(corpora._READERS, "wikitext", lambda *a: pytest.fail("encoded again"))
  again = corpora.load_splits(cfg)
  assert isinstance(again.train.tokens, np.memmap) and len(os.listdir(os.path.join(root, "trime_cache"))) == 1
  assert again.train.fingerprint() == first.train.fingerprint()
  monkeypatch.undo()
  key = corpora._cache_key(cfg, None)
  with open(os.path.join(root, "wiki.test.tokens"), "a") as f:
    f.write(" = Another = \n")
  assert corpora._cache_key(cfg, None) != key
  key = corpora._cache_key(cfg, None)
  monkeypatch.setattr(corpora, "CACHE_VERSION", corpora.CACHE_VERSION + 1)  # the readers changed: not reused
  assert corpora._cache_key(cfg, None) != key


def test_a_damaged_corpus_cache_is_one_error_saying_what_to_delete(tmp_path, monkeypatch):
  # A cache whose token file was cut short (a crash or a copy that did not finish) was a NumPy traceback.
  root = write_wikitext_dir(tmp_path / "wt")
  cfg = _wiki_cfg(root, cache_dir=str(tmp_path / "cache"))
  corpora.load_splits(cfg)
  cache = os.path.join(tmp_path, "cache", corpora._cache_key(cfg, None))
  tokens = os.path.join(cache, "train", "tokens.npy")
  with open(tokens, "r+b") as f:
    f.truncate(os.path.getsize(tokens) // 2)
  with pytest.raises(D.DataError, match=rf"^damaged corpus cache in {re.escape(cache)}/train \(ValueError: .*\): "
                                        rf"delete {re.escape(cache)} \(the next run encodes the corpus again\)$"):
    corpora.load_splits(cfg)
  # An error of the machine, not of the files (a permission, too many open files) is not called damage: deleting
  # the cache would not help
  import errno

  def denied(*a, **k):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), tokens)

  monkeypatch.setattr(np, "load", denied)
  with pytest.raises(PermissionError):
    corpora.load_splits(cfg)


def test_a_checkpoints_vocabulary_reuses_the_training_cache_when_it_is_the_built_one(tmp_path, monkeypatch):
  """Training caches the corpus under a key without a vocabulary; evaluation and datastore builds pass the
  checkpoint's. When that is the vocabulary the data built, the training cache is read (nothing encoded again,
  no second copy); another vocabulary gets its own encoding and cache."""
  root = write_wikitext_dir(tmp_path / "wt")
  cfg = _wiki_cfg(root, cache_dir=str(tmp_path / "cache"))
  trained = corpora.load_splits(cfg)
  monkeypatch.setitem(corpora._READERS, "wikitext", lambda *a: pytest.fail("encoded again"))
  again = corpora.load_splits(cfg, vocab=D.Vocab(list(trained.vocab.tokens)))
  assert isinstance(again.test.tokens, np.memmap) and os.listdir(tmp_path / "cache") == [
      corpora._cache_key(cfg, None)]
  for s in ("train", "dev", "test"):
    assert getattr(again, s).fingerprint() == getattr(trained, s).fingerprint()
  monkeypatch.undo()
  small = D.Vocab(["</s>", "<unk>", "Alpha"])
  other = corpora.load_splits(cfg, vocab=small)
  assert other.vocab.fingerprint() == small.fingerprint() and len(os.listdir(tmp_path / "cache")) == 2
  assert set(np.unique(other.test.tokens)) <= {0, 1, 2}


def test_wikitext_is_read_one_article_at_a_time_with_the_same_errors(tmp_path):
  """The streaming reader gives read_wikitext_articles' articles, and a bad file is still one DataError naming
  the file (and the line of a non-UTF-8 byte), whichever split it is."""
  path = tmp_path / "wiki.train.tokens"
  path.write_text(WIKI_SAMPLE)
  stream = D.iter_wikitext_articles(str(path))
  assert next(stream)[:3] == ["</s>", "=", "Alpha"] and [next(stream), *stream] == D.read_wikitext_articles(
      str(path))[1:]
  root = write_wikitext_dir(tmp_path / "wt")
  raw = (root / "wiki.test.tokens").read_bytes().split(b"\n")
  raw[3] += b" caf\xe9"
  (root / "wiki.test.tokens").write_bytes(b"\n".join(raw))
  with pytest.raises(DataError, match=r"wiki.test.tokens, line 4: not UTF-8"):
    corpora.load_splits(_wiki_cfg(root))
  (root / "wiki.test.tokens").write_text("\n </s> \n\n")  # no word but the line-end marker itself
  with pytest.raises(DataError, match=r"has no text: .*wiki.test.tokens"):
    corpora.load_splits(_wiki_cfg(root))
  os.remove(root / "wiki.test.tokens")
  with pytest.raises(DataError, match=r"WikiText token file not found: .*wiki.test.tokens"):
    corpora.load_splits(_wiki_cfg(root))


def test_wikitext_mini_falls_back_to_tfds_only_from_its_own_default_path(tmp_path, monkeypatch):
  """A mistyped data.path is an error naming it, not a silent download of TFDS's copy; the config's own
  ../shared path (a clone without shared/) still falls back."""
  from trime_jax.configs import wikitext_mini

  calls = []
  monkeypatch.setattr(corpora, "_wikitext2_from_tfds", lambda cfg: pytest.fail("TFDS fallback for a path of its own"))
  cfg = wikitext_mini.get_config().data
  cfg.path = str(tmp_path / "no_such_wt2")
  with pytest.raises(DataError, match=r"WikiText-2 directory \(wikitext_mini\) not found: data.path=.*no_such_wt2"):
    corpora.load_splits(cfg)
  cfg.path = corpora.WIKITEXT_MINI_PATH
  monkeypatch.setattr(corpora, "resolve_path", lambda p: str(tmp_path / "elsewhere") if p else p)
  monkeypatch.setattr(corpora, "_wikitext2_from_tfds", lambda cfg: calls.append(cfg.path) or [["a", "</s>"]] * 30)
  assert len(corpora.load_splits(cfg).train) > 0 and calls == [corpora.WIKITEXT_MINI_PATH]


def test_byte_corpus_and_stdlib_demo_corpus(tmp_path):
  path = write_text_file(tmp_path / "text.bin", 10_000)
  cfg = _wiki_cfg(path, corpus="bytes", split_fractions=(0.9, 0.05, 0.05))
  s = corpora.load_splits(cfg)
  assert len(s.vocab) == 256 and s.vocab.kind == "bytes"
  assert (len(s.train), len(s.dev), len(s.test)) == (9000, 500, 500)
  assert bytes(np.asarray(s.train.tokens[:20], np.uint8)) == open(path, "rb").read(20)
  st = corpora.load_splits(_wiki_cfg("", corpus="stdlib", max_files=30, split_fractions=(0.8, 0.1, 0.1)))
  st2 = corpora.load_splits(_wiki_cfg("", corpus="stdlib", max_files=30, split_fractions=(0.8, 0.1, 0.1)))
  assert st.train.num_docs + st.dev.num_docs + st.test.num_docs == 30
  assert st.test.fingerprint() == st2.test.fingerprint()  # deterministic sample and split
  with pytest.raises(DataError, match=r"^data.max_files=5: 5 standard-library files leave the dev split empty .*"
                                      r"raise data.max_files$"):  # was "corpus stdlib:dev is empty"
    corpora.load_splits(_wiki_cfg("", corpus="stdlib", max_files=5, split_fractions=(0.9, 0.05, 0.05)))
  with pytest.raises(DataError, match=r"leave the dev split empty under data.split_fractions=\(0.9, 0.0, 0.1\): "
                                      r"give it a share$"):  # more files cannot help a split without a share
    corpora.load_splits(_wiki_cfg("", corpus="stdlib", max_files=30, split_fractions=(0.9, 0.0, 0.1)))


@pytest.mark.parametrize("mode", ["stream", "document"])
def test_segments_cover_every_token_once_and_inputs_are_shifted(mode):
  vocab = D.Vocab.bytes()
  docs = [np.arange(1, 11), np.arange(20, 23), np.arange(30, 47)]  # lengths 10, 3, 17
  corpus = D.Corpus.from_docs(docs, vocab)
  seg = D.make_segments(corpus, 4, mode)
  inputs, targets = D.gather_segments(corpus, seg, np.arange(len(seg)))
  real = targets >= 0
  assert np.array_equal(np.sort(targets[real]), np.sort(corpus.tokens))  # every token a target exactly once
  stream = np.asarray(corpus.tokens)
  flat_pos = seg.start[:, None] + np.arange(4)[None]
  assert np.all(inputs[real] == np.where(flat_pos[real] > 0, stream[np.maximum(flat_pos[real] - 1, 0)], vocab.bos))
  if mode == "document":
    assert np.all(corpus.doc_ids()[seg.start] == seg.doc)
    # each segment stays inside its document; index_in_doc counts up from 0 within each document
    assert np.all(seg.start + seg.length <= corpus.doc_starts[seg.doc + 1])
    assert list(seg.index_in_doc) == [0, 1, 2, 0, 0, 1, 2, 3, 4]
  else:
    assert len(seg) == 8 and seg.length[-1] == 2
  padded_in, padded_t = D.gather_segments(corpus, seg, np.array([-1]))
  assert np.all(padded_t == -1)


def test_random_batches_cover_each_epoch_and_are_deterministic():
  n, b = 10, 4  # ⌈10 / 4⌉ = 3 batches an epoch, the last with 2 segments and 2 padding rows
  batches = np.stack([D.random_batch_indices(n, b, s, seed=3) for s in range(6)])  # 2 epochs
  for epoch in (batches[:3], batches[3:]):
    assert sorted(epoch[epoch >= 0]) == list(range(10))
    assert list(epoch[-1]) == list(epoch[-1][:2]) + [-1, -1] and np.all(epoch[:-1] >= 0)
  assert not np.array_equal(batches[:3], batches[3:])  # each epoch its own permutation
  assert np.array_equal(D.random_batch_indices(n, b, 4, seed=3), batches[4])
  assert not np.array_equal(D.random_batch_indices(n, b, 0, seed=4), batches[0])
  # No batch holds a segment twice, however the epoch's end falls (the old layout straddled epochs).
  for size in (3, 7, 9, 10, 16):
    for s in range(8):
      rows = D.random_batch_indices(n, size, s, seed=1)
      assert len(set(rows[rows >= 0])) == (rows >= 0).sum()


def test_bad_data_gives_clear_errors(tmp_path):
  with pytest.raises(DataError, match="not found"):
    corpora.load_splits(_wiki_cfg(tmp_path / "missing"))
  empty = tmp_path / "empty.bin"
  empty.write_bytes(b"")
  with pytest.raises(DataError, match="empty"):
    corpora.load_splits(_wiki_cfg(empty, corpus="bytes"))
  os.makedirs(tmp_path / "blank")
  for name in ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"):
    (tmp_path / "blank" / name).write_text("\n\n")
  with pytest.raises(DataError, match="no text"):
    corpora.load_splits(_wiki_cfg(tmp_path / "blank"))
  with pytest.raises(ConfigError, match="data.corpus"):
    corpora.load_splits(_wiki_cfg(tmp_path, corpus="books"))
  with pytest.raises(DataError, match="segmentation"):
    D.make_segments(D.Corpus.from_docs([np.arange(5)], D.Vocab.bytes()), 2, "sentences")
