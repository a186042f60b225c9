"""What the original's BM25 search did inside Lucene, restated for `batching/bm25.py`.

The original release wrote every training segment's words to a JSON collection, indexed it with Pyserini
(`python -m pyserini.index.lucene --collection JsonCollection ... --generator DefaultLuceneDocumentGenerator`) and
searched each segment's words with `LuceneSearcher.search(contents, 20)` (bm25_search.py). Three things happen
there that a BM25 over token ids does not do:

  1. **Analysis** (Anserini's DefaultEnglishAnalyzer, as Lucene's EnglishAnalyzer): Lucene's StandardTokenizer
     (Unicode word boundaries, UAX #29; punctuation-only pieces such as WikiText's `@-@` are dropped), the
     English possessive filter (a trailing 's), lower case, Lucene's 33 English stop words, and Lucene's Porter
     stemmer (Martin Porter's reference version: `logi` -> `log`, `bli` -> `ble`; words of one or two letters
     are not stemmed). `english_terms(word)`.
  2. **Lengths**: Lucene stores a document's length (its number of terms) in one byte (SmallFloat.intToByte4:
     exact below 24, then four significant bits) and BM25 normalises by the decoded length, not the true one.
     `LuceneBM25` builds bm25s's score matrix that way.
  3. **Order**: Anserini sorts Lucene's hits by score and equal scores by their document ids as strings ("10"
     before "9"; its reranker then rounds the scores it reports, not the order): `bm25._lucene_hits`, with the
     scores recomputed as Lucene sums them (`lucene_scores`).

Analysis works word by word: the original's documents are the segments' words joined by single spaces
(fairseq's `Dictionary.string`, end-of-sentence symbols dropped), and the tokenizer never joins across a space,
so a vocabulary word's terms are the same wherever it occurs (`vocabulary_terms`). Measured against
Pyserini 0.22.1 (Anserini 0.22.1, Lucene 9.5), all 102,649 distinct words of docs-wt and WikiText-2 are
analysed identically. tests/test_bm25_lucene.py checks this and the original's whole search on a real corpus.
"""

from __future__ import annotations

import bm25s
import numpy as np
import regex
import scipy.sparse as sp
from nltk.stem.porter import PorterStemmer

from trime_jax.batching import lucene_chars

# Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET, Anserini's default stop words
STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these they "
    "this to was will with".split())

# Pieces between Unicode word boundaries that StandardTokenizer emits: those holding a code point it makes tokens
# of (letters, digits, ideographs, emoji, ... by Lucene's own, older, Unicode tables: lucene_chars.py)
_EMITTED = regex.compile("[" + "".join(f"\\U{int(a, 16):08x}-\\U{int(b, 16):08x}" for a, b in
                                       (r.split("-") for r in lucene_chars.RANGES.split())) + "]")
_BOUNDARY = regex.compile(r"(?V1w)\b")  # the `w` flag: Unicode default word boundaries (UAX #29)
_APOSTROPHES = ("'", "\u2019", "\uff07")  # EnglishPossessiveFilter's
_MAX_TOKEN = 255  # StandardTokenizer's default maximum token length (longer tokens are split)
# Lucene's PorterStemmer follows Porter's own reference implementation, with its departures from the 1980 paper:
# NLTK's MARTIN_EXTENSIONS mode
_PORTER = PorterStemmer(PorterStemmer.MARTIN_EXTENSIONS)


def _lower(term: str) -> str:
  """Java's Character.toLowerCase code point by code point (LowerCaseFilter): no final sigma, İ -> i."""
  return "".join("i" if ch == "\u0130" else ch.lower() for ch in term)


def english_terms(word: str) -> list[str]:
  """The terms Lucene's English analysis (Anserini's default) makes of `word` (one whitespace-free token)."""
  terms = []
  for piece in _BOUNDARY.split(word):
    if not piece or not _EMITTED.search(piece):
      continue
    for t in (piece[i:i + _MAX_TOKEN] for i in range(0, len(piece), _MAX_TOKEN)):
      if len(t) >= 2 and t[-1] in "sS" and t[-2] in _APOSTROPHES:
        t = t[:-2]
      t = _lower(t)
      if not t or t in STOP_WORDS:
        continue
      terms.append(t if len(t) <= 2 else _PORTER.stem(t, to_lowercase=False))
  return terms


def vocabulary_terms(words: list[str], skip: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray, list[str]]:
  """(offsets [V + 1] int64, term_ids [n] int32, terms): vocabulary word v's terms are
  term_ids[offsets[v]:offsets[v + 1]], ids into `terms`. Ids in `skip` (end of sentence, padding) get none,
  as fairseq's Dictionary.string drops them."""
  term_index: dict[str, int] = {}
  counts = np.zeros(len(words), np.int64)
  flat: list[int] = []
  skipped = set(skip)
  for v, w in enumerate(words):
    if v in skipped:
      continue
    ts = english_terms(w)
    counts[v] = len(ts)
    flat.extend(term_index.setdefault(t, len(term_index)) for t in ts)
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
  return offsets, np.asarray(flat, np.int32), list(term_index)


def text_terms(texts: list[str]) -> list[np.ndarray]:
  """Each text's terms as int32 ids (shared across the texts): its whitespace-separated words through
  `english_terms` (each distinct word analysed once). What the original's MT indexed: its target sentences."""
  term_index: dict[str, int] = {}
  word_terms: dict[str, list[int]] = {}
  out = []
  for text in texts:
    ids = []
    for w in text.split():
      if (got := word_terms.get(w)) is None:
        got = word_terms[w] = [term_index.setdefault(t, len(term_index)) for t in english_terms(w)]
      ids.extend(got)
    out.append(np.asarray(ids, np.int32))
  return out


def document_terms(token_ids: np.ndarray, offsets: np.ndarray, term_ids: np.ndarray) -> np.ndarray:
  """[n] int32: the terms of a run of vocabulary ids, in order (`vocabulary_terms`'s map)."""
  token_ids = np.asarray(token_ids, np.int64)
  starts, counts = offsets[token_ids], offsets[token_ids + 1] - offsets[token_ids]
  total = int(counts.sum())
  if total == 0:
    return np.zeros(0, np.int32)
  # position j of the output reads term_ids[starts[i] + (j - first output position of token i)]
  first = np.cumsum(counts) - counts
  return term_ids[np.repeat(starts - first, counts) + np.arange(total)]


def _long_to_int4(i: int) -> int:
  bits = i.bit_length()
  if bits < 4:
    return i
  shift = bits - 4
  return ((i >> shift) & 0x07) | ((shift + 1) << 3)


def _int4_to_long(i: int) -> int:
  bits, shift = i & 0x07, (i >> 3) - 1
  return bits if shift == -1 else (bits | 0x08) << shift


_FREE = 255 - _long_to_int4(2**31 - 1)  # 24: lengths below are stored exactly
# Lucene's BM25Similarity.LENGTH_TABLE: the length each of the 256 norm bytes stands for
LENGTH_TABLE = np.asarray([b if b < _FREE else _FREE + _int4_to_long(b - _FREE) for b in range(256)], np.float32)


def length_norm(lengths: np.ndarray) -> np.ndarray:
  """Lucene's SmallFloat.intToByte4 of document lengths (numbers of terms), as unsigned bytes [n] uint8."""
  lengths = np.asarray(lengths, np.int64)
  coded = [int(n) if n < _FREE else _FREE + _long_to_int4(int(n) - _FREE) for n in lengths.tolist()]
  return np.asarray(coded, np.uint8)


class LuceneBM25(bm25s.BM25):
  """bm25s's BM25 with Lucene's document lengths: every document's length is the one its norm byte decodes to
  (`length_norm`, `LENGTH_TABLE`), the average is the true one (sum of lengths / documents with a term), and
  each term score is computed in float32 as Lucene 9's BM25Scorer does (weight - weight / (1 + tf / norm)).
  The override is bm25s's own extension point, `build_index_from_ids`; retrieval stays bm25s's."""

  def __init__(self, k1: float, b: float, **kw):
    super().__init__(k1=k1, b=b, method="lucene", idf_method="lucene", **kw)

  def build_index_from_ids(self, unique_token_ids, corpus_token_ids, show_progress=True, leave_progress=False):
    n_docs, n_vocab = len(corpus_token_ids), len(unique_token_ids)
    lengths = np.fromiter((len(d) for d in corpus_token_ids), np.int64, n_docs)
    doc_of = np.repeat(np.arange(n_docs, dtype=np.int64), lengths)
    flat = np.fromiter((t for d in corpus_token_ids for t in d), np.int64, int(lengths.sum()))
    # (document, term) pairs with their frequencies
    pair = np.unique(doc_of * n_vocab + flat, return_counts=True)
    doc, term, tf = pair[0] // n_vocab, pair[0] % n_vocab, pair[1].astype(np.float32)
    df = np.bincount(term, minlength=n_vocab)
    doc_count = int((lengths > 0).sum())  # Lucene counts documents that have the field (at least one term)
    f32 = np.float32
    avgdl = f32(lengths.sum() / max(doc_count, 1))
    idf = np.log(1 + (doc_count - df + 0.5) / (df + 0.5)).astype(f32)
    k1, b = f32(self.k1), f32(self.b)
    # BM25Similarity's cache: 1 / (k1 * ((1 - b) + b * length / avgdl)) per norm byte, in float32
    norm_inverse = (f32(1) / (k1 * ((f32(1) - b) + b * LENGTH_TABLE / avgdl))).astype(f32)
    weight = idf[term]
    scores = (weight - weight / (f32(1) + tf * norm_inverse[length_norm(lengths)][doc])).astype(f32)
    self.nonoccurrence_array = None  # (read by bm25s's scoring: BM25L / BM25+ only)
    # what `lucene_scores` needs: term frequencies by document, each document's 1 / norm, each term's idf
    tf_by_doc = sp.csr_matrix((tf, (doc, term)), shape=(n_docs, n_vocab), dtype=np.float32)
    self.lucene_stats = (tf_by_doc, norm_inverse[length_norm(lengths)], idf)
    self.docs_by_term = tf_by_doc.tocsc()  # `matching_documents`
    matrix = sp.csc_matrix((scores, (doc, term)), shape=(n_docs, n_vocab), dtype=np.float32)
    return {"data": matrix.data, "indices": matrix.indices, "indptr": matrix.indptr, "num_docs": n_docs}


def lucene_scores(retriever: LuceneBM25, query: np.ndarray, docs: np.ndarray) -> np.ndarray:
  """[n] float32: the scores Lucene gives `docs` for a query of term ids `query` (repeats allowed), computed as
  Lucene 9 does: a term's clause weight is its count (Anserini's bag-of-words boost) times its idf, each clause
  score weight - weight / (1 + tf / norm) in float32, their sum in float64, then float32. bm25s's float32 sums
  of the same terms are ~1e-6 relative apart, enough to reorder near-equal hits."""
  f32 = np.float32
  tf_by_doc, norm_inverse, idf = retriever.lucene_stats
  terms, counts = np.unique(np.asarray(query, np.int64), return_counts=True)
  weight = (counts.astype(f32) * idf[terms]).astype(f32)
  tf = tf_by_doc[np.asarray(docs, np.int64)][:, terms].toarray()  # [n, terms]
  clause = (weight - weight / (f32(1) + tf * norm_inverse[np.asarray(docs, np.int64)][:, None])).astype(f32)
  return np.where(tf > 0, clause, 0).astype(np.float64).sum(1).astype(f32)


def matching_documents(retriever: LuceneBM25, query: np.ndarray) -> np.ndarray:
  """The documents that hold at least one of the query's terms (those Lucene scores), ascending."""
  terms = np.unique(np.asarray(query, np.int64))
  return np.unique(retriever.docs_by_term[:, terms].indices).astype(np.int64)
