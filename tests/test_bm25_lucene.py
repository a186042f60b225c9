"""BM25 batching searches as the original's Pyserini search did (batching/lucene.py), checked against Lucene itself.

The fixture (tests/oracle/dump_bm25_lucene.py, Pyserini 0.22.1 = Anserini 0.22.1 / Lucene 9.5 on Java 17) holds
  - hits [1467, 20]: the original's bm25_search.py, run as it is, over the original's index of wikitext-mini's
    training segments (configs/wikitext_mini_ext.py: 256 tokens, each segment's input words, </s> dropped);
  - words / terms: Lucene's English analysis (Anserini's default analyzer) of wikitext-mini's 9,526 words and of
    docs-wt's 32,256 other words with a character outside A-Z / a-z;
  - norms, large_norms, length_table: Lucene's SmallFloat.intToByte4 of the lengths 0 .. 2^20 - 1 (and three
    larger) and byte4ToInt of every byte.
and bm25_lucene_ui_de_en.npz the hits of the release's machine_translation/bm25_search.py over the first 4,000
target sentences of ui-de-en (short interface strings: many equal scores).
"""

import os

import numpy as np
import pytest

from trime_jax import corpora
from trime_jax import data as D
from trime_jax.batching import bm25, lucene
from trime_jax.batching import plan as batch_plan
from trime_jax.configs import wikitext_mini_ext
from trime_jax.errors import ConfigError, DataError

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "bm25_lucene_wikitext_mini.npz")
# the original MT's bm25_search.py over its index of ui-de-en's first 4,000 target sentences
MT_FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "bm25_lucene_ui_de_en.npz")


@pytest.fixture(scope="module")
def oracle():
  fx = np.load(FIXTURE)
  text = lambda name: bytes(fx[name]).decode("utf-8").split("\n")  # noqa: E731
  return {"hits": fx["hits"], "words": text("words"), "terms": text("terms"), "norms": fx["norms"],
          "large_lengths": fx["large_lengths"], "large_norms": fx["large_norms"], "length_table": fx["length_table"]}


@pytest.fixture(scope="module")
def train():
  return corpora.load_splits(wikitext_mini_ext.get_config().data).train


def test_english_analysis_equals_lucenes_on_every_word(oracle):
  assert len(oracle["words"]) == len(oracle["terms"]) == 41_782
  differ = [(w, t, lucene.english_terms(w)) for w, t in zip(oracle["words"], oracle["terms"])
            if lucene.english_terms(w) != t.split()]
  assert differ == []
  # what the fixture exercises: stop words, possessives, Porter's reference-version rules, WikiText's @-@, emoji
  said = dict(zip(oracle["words"], oracle["terms"]))
  assert said["the"] == "" and said["'s"] == "s" and said["@-@"] == "" and said["<unk>"] == "unk"
  assert said["possibly"] == "possibl" and said["technology"] == "technolog" and said["us"] == "us"


def test_lengths_are_lucenes_one_byte_norms(oracle):
  np.testing.assert_array_equal(lucene.length_norm(np.arange(1 << 20)), oracle["norms"])
  np.testing.assert_array_equal(lucene.length_norm(oracle["large_lengths"]), oracle["large_norms"])
  # (a float array in Lucene too: BM25Similarity.LENGTH_TABLE)
  np.testing.assert_array_equal(lucene.LENGTH_TABLE, oracle["length_table"].astype(np.float32))
  assert lucene.LENGTH_TABLE[lucene.length_norm([23, 24, 40, 513])].tolist() == [23, 24, 40, 504]


def test_search_equals_the_originals_pyserini_search_on_every_segment(oracle, train):
  """Every segment's 20 hits, in order, as the original's bm25_search.py got them from Lucene; the neighbours
  Algorithm 1 follows are hits[1:] less the segment itself."""
  config = wikitext_mini_ext.get_config()
  segs = D.make_segments(train, int(config.data.segment_len), config.data.segmentation)
  docs = bm25.segment_terms(train, segs)
  want = [[h for h in row[1:].tolist() if h >= 0 and h != c] for c, row in enumerate(oracle["hits"])]
  assert len(docs) == len(want) == 1467
  for backend in ("numpy", "numba"):
    ids, scores = bm25.neighbours(docs, 20, backend=backend, hits_include_query=True, lucene=True)
    got = [row[row >= 0].tolist() for row in ids]
    assert sum(g == w for g, w in zip(got, want)) == len(want), backend
    assert (np.diff(np.where(ids >= 0, scores, -1e9), axis=1) <= 0).all()  # best first
  # Without the analysis (token ids) or with bm25s's own lengths and order, the hits differ from the original's
  ids_plain, _ = bm25.neighbours(bm25.segment_token_ids(train, segs), 20, backend="numpy", hits_include_query=True)
  assert sum(row[row >= 0].tolist() == w for row, w in zip(ids_plain, want)) < 0.5 * len(want)
  ids_bm25s, _ = bm25.neighbours(docs, 20, backend="numpy", hits_include_query=True)
  assert sum(row[row >= 0].tolist() == w for row, w in zip(ids_bm25s, want)) < len(want)


def test_equal_scores_go_by_id_as_a_string():
  # Anserini, measured: five documents of equal contents, ids 9, 10, 2, 100, 3 -> 10, 100, 2, 3, 9 (its search
  # sorts by score, then by the id field as a string). A query that ties with others is then not its own first
  # hit, and the original's hits[1:] drops another segment: here 10, and 2 itself is skipped.
  docs = [np.array([7, 8], np.int32) for _ in range(101)]
  for i in (9, 10, 2, 100, 3):
    docs[i] = np.array([1, 2], np.int32)
  ids, scores = bm25.neighbours(docs, 5, backend="numpy", hits_include_query=True, lucene=True)
  assert ids[2][ids[2] >= 0].tolist() == [100, 3, 9]
  assert ids[10][ids[10] >= 0].tolist() == [100, 2, 3, 9]  # 10 is its own first hit: the 4 others follow
  ids, _ = bm25.neighbours(docs, 6, backend="numpy", lucene=True)  # 6 hits besides the query
  assert ids[2][ids[2] >= 0].tolist() == [10, 100, 3, 9]


def test_lucene_scores_are_the_formula_with_one_byte_lengths():
  """lucene_scores: a float64 reference of Lucene's BM25 (k1 = 0.9, b = 0.4, idf = log(1 + (N - df + 0.5) /
  (df + 0.5)), lengths decoded from their norm byte, a query term's weight its count times its idf)."""
  rng = np.random.default_rng(3)
  docs = [rng.integers(0, 40, int(n)).astype(np.int32) for n in rng.integers(1, 300, 30)]
  retriever, lut = bm25.bm25_index(docs, backend="numpy", lucene=True)
  n, avgdl = len(docs), np.mean([len(d) for d in docs])
  length = lucene.LENGTH_TABLE[lucene.length_norm([len(d) for d in docs])].astype(np.float64)
  assert (length != [len(d) for d in docs]).any()  # some lengths are stored inexactly
  for q in docs[:6]:
    want = np.zeros(n)
    for t, c in zip(*np.unique(q, return_counts=True)):
      df = sum(t in d for d in docs)
      idf = np.log(1 + (n - df + 0.5) / (df + 0.5))
      for j, d in enumerate(docs):
        tf = int((d == t).sum())
        want[j] += c * idf * tf / (tf + 0.9 * (1 - 0.4 + 0.4 * length[j] / avgdl))
    got = lucene.lucene_scores(retriever, lut[q], np.arange(n))
    np.testing.assert_allclose(got, want, rtol=2e-6)
    np.testing.assert_allclose(retriever.get_scores(lut[q].tolist()), want, rtol=1e-4)  # bm25s: float32 sums


def test_plans_record_the_analyzer_and_refuse_another(train, tmp_path):
  config = wikitext_mini_ext.get_config()
  assert config.trime.bm25_analyzer == "english"  # the original's
  header, batches = bm25.make_plan(train, config, progress=False, backend="numpy")
  assert header["bm25_analyzer"] == "english" and header["bm25_search"] == "lucene"
  assert bm25.older_rules(header) == []
  batch_plan.save(str(tmp_path / "p"), header, batches)
  plan = batch_plan.load(str(tmp_path / "p"))
  args = dict(corpus_fingerprint=train.fingerprint(), segment_len=256, segmentation="stream",
              batch_size=int(config.train.batch_size))
  plan.check(**args, **bm25.neighbour_settings(config))
  config.trime.bm25_analyzer = "none"
  with pytest.raises(DataError, match="bm25_analyzer 'english' != 'none'"):
    plan.check(**args, **bm25.neighbour_settings(config))
  with pytest.raises(ConfigError, match="bm25_analyzer must be one of"):
    bm25.check_analyzer("lucene")
  byte_corpus = D.Corpus.from_docs([np.arange(60) % 256], D.Vocab([chr(i) for i in range(256)], kind="bytes"))
  with pytest.raises(ConfigError, match="bytes vocabulary"):
    bm25.segment_terms(byte_corpus, D.make_segments(byte_corpus, 16))


def test_documents_without_terms_have_no_neighbours_and_are_none():
  # A sentence of stop words ("It is.") analyses to nothing: Lucene returns no hit for it, and it matches nothing
  docs = [np.array([], np.int32), np.array([1, 2]), np.array([2, 3]), np.array([], np.int32), np.array([3, 1])]
  for lucene_search in (True, False):
    ids, scores = bm25.neighbours(docs, 3, backend="numpy", hits_include_query=True, lucene=lucene_search)
    assert (ids[[0, 3]] == -1).all() and not np.isin(ids, [0, 3]).any()
    assert (ids[[1, 2, 4]] >= 0).any(axis=1).all()
  assert lucene.text_terms(["It is.", "Is it the cats' cat?"])[0].tolist() == []


def test_mt_search_equals_the_originals_on_every_sentence():
  """MT: each target sentence's text through the analysis (what mt.batching.make_plan indexes), the original MT
  scripts' 20 hits: short sentences, so equal scores are common and their order (ids as strings) decides."""
  from trime_jax.mt import batching as mt_batching
  from trime_jax.mt import data as mt_data

  from trime_jax.configs import ui_de_en

  hits = np.load(MT_FIXTURE)["hits"]
  config = ui_de_en.get_config()
  mt_data.resolve_data_path(config)  # ../shared/data/ui-de-en
  _, lines = mt_data.read_aligned(*mt_data._paths(config, "train"))
  lines = lines[:len(hits)]
  docs = lucene.text_terms(lines)
  want = [[h for h in row[1:].tolist() if h >= 0 and h != c] for c, row in enumerate(hits)]
  ids, scores = bm25.neighbours(docs, 20, backend="numpy", hits_include_query=True, lucene=True)
  assert sum(row[row >= 0].tolist() == w for row, w in zip(ids, want)) == len(want) == 4000
  ties = sum(len(set(r[r > -np.inf].tolist())) < (r > -np.inf).sum() for r in scores)
  assert ties > 1000  # (equal scores in most sentences' hits)
  # make_plan packs the neighbours of the target texts
  vocab = mt_data.SubwordVocab(tokens=list(mt_data.SPECIALS) + ["x"])
  pairs = mt_data.ParallelData([np.array([4], np.int32)] * 400, [np.array([4], np.int32)] * 400, [""] * 400,
                               lines[:400], vocab)
  plan = mt_batching.make_plan(pairs, order="bm25", max_tokens=64, seed=3)
  nbrs, _ = bm25.neighbours(docs[:400], 20, backend="numpy", hits_include_query=True, lucene=True)
  np.testing.assert_array_equal(plan.indices, bm25.pack(nbrs, 3))
  assert plan.header["bm25_analyzer"] == "english" and plan.header["bm25_search"] == "lucene"
