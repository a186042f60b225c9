"""BM25 batching (Algorithm 1) on a synthetic corpus whose documents each draw from one of a few topics."""

import numpy as np
import pytest

from configs import default
from trime_jax import data as D
from trime_jax.batching import bm25
from trime_jax.batching import plan as batch_plan

SEG, B, TOPICS = 32, 8, 6


def _corpus(seed=0, docs_per_topic=6, words_per_doc=160):
  """Topic t uses its own 40 words plus 10 shared function words; documents are shuffled."""
  rng = np.random.default_rng(seed)
  vocab = D.Vocab(["</s>", "<unk>"] + [f"w{i}" for i in range(10 + 40 * TOPICS)])
  docs, topic_of_doc = [], []
  for t in rng.permutation(np.repeat(np.arange(TOPICS), docs_per_topic)):
    own = rng.choice(40, words_per_doc) + 12 + 40 * t
    shared = rng.integers(2, 12, words_per_doc)
    docs.append(np.where(rng.random(words_per_doc) < 0.3, shared, own))
    topic_of_doc.append(t)
  return D.Corpus.from_docs(docs, vocab, "topics"), np.asarray(topic_of_doc)


def _config(seed=0, segmentation="stream", exclude_same_document=True):
  c = default.get_config()
  c.trime.bm25_exclude_same_document = exclude_same_document
  c.data.segment_len, c.data.segmentation = SEG, segmentation
  c.train.batch_size, c.train.seed = B, seed
  return c


@pytest.fixture(scope="module")
def corpus():
  return _corpus()[0]


def _plan(corpus, seed=0, **kw):
  return bm25.make_plan(corpus, _config(seed, **kw), progress=False, backend="numpy")


@pytest.mark.parametrize("segmentation", ["stream", "document"])
def test_every_segment_exactly_once_in_batches_of_b(corpus, segmentation):
  header, batches = _plan(corpus, segmentation=segmentation)
  s = len(D.make_segments(corpus, SEG, segmentation))
  assert batches.shape == (-(-s // B), B) and header["num_segments"] == s
  flat = batches.reshape(-1)
  np.testing.assert_array_equal(np.sort(flat[flat >= 0]), np.arange(s))
  assert (batches[:-1] >= 0).all()  # padding (-1 rows) only in the last batch
  assert (flat < 0).sum() == header["padding_rows"] == len(flat) - s


def test_deterministic_from_seed(corpus):
  h0, b0 = _plan(corpus, seed=0)
  h1, b1 = _plan(corpus, seed=0)
  _, b2 = _plan(corpus, seed=1)
  np.testing.assert_array_equal(b0, b1)
  assert not np.array_equal(b0, b2)
  assert {k: v for k, v in h0.items() if k != "timing"} == {k: v for k, v in h1.items() if k != "timing"}


def test_neighbours_exclude_self_and_are_sorted(corpus):
  segs = D.make_segments(corpus, SEG)
  docs = bm25.segment_token_ids(corpus, segs)
  ids, scores = bm25.neighbours(docs, 5, backend="numpy")
  assert ids.shape == (len(segs), 5) and (ids >= 0).all()
  assert not (ids == np.arange(len(segs))[:, None]).any()
  assert all(len(set(row)) == 5 for row in ids.tolist())
  assert (np.diff(scores, axis=1) <= 0).all()
  few, few_scores = bm25.neighbours(docs[:3], 5, backend="numpy")  # fewer segments than k + 1
  assert (few[:, :2] >= 0).all() and (few[:, 2:] == -1).all() and np.isinf(few_scores[:, 2:]).all()


def test_pack_follows_algorithm_1():
  rng = np.random.default_rng(0)
  s, k = 200, 4
  nbrs = np.stack([rng.choice(np.delete(np.arange(s), i), k, replace=False) for i in range(s)])
  order = bm25.pack(nbrs, seed=3)
  np.testing.assert_array_equal(np.sort(order), np.arange(s))
  used, jumps = {int(order[0])}, 0
  for prev, cur in zip(order[:-1].tolist(), order[1:].tolist()):
    unused = [y for y in nbrs[prev].tolist() if y not in used]
    if unused:
      assert cur == unused[0]  # the best-scoring unused neighbour
    else:
      jumps += 1  # a random unused segment
    used.add(cur)
  assert jumps < s // 2


def _pairwise_bm25(corpus):
  """Full [S, S] BM25 score matrix (each segment's tokens as the query)."""
  docs = bm25.segment_token_ids(corpus, D.make_segments(corpus, SEG))
  retriever, lut = bm25.bm25_index(docs, backend="numpy")
  return np.stack([retriever.get_scores(lut[d].tolist()) for d in docs])


def _mean_within_batch(scores, batches):
  vals = []
  for row in batches:
    row = row[row >= 0]
    sub = scores[np.ix_(row, row)]
    vals.append((sub.sum() - np.trace(sub)) / max(len(row) * (len(row) - 1), 1))
  return float(np.mean(vals))


def test_batches_are_far_more_similar_than_random(corpus):
  header, batches = _plan(corpus, exclude_same_document=False)
  random_batches = bm25.to_batches(np.random.default_rng(5).permutation(header["num_segments"]), B)
  scores = _pairwise_bm25(corpus)
  packed, rand = _mean_within_batch(scores, batches), _mean_within_batch(scores, random_batches)
  assert packed > 2.5 * rand, (packed, rand)
  assert header["neighbour_in_batch"] > 3 * header["neighbour_in_batch_random"]
  # Topic purity: a segment's batch-mates mostly come from documents of its own topic.
  _, topic_of_doc = _corpus()
  topic = topic_of_doc[D.make_segments(corpus, SEG).doc]
  same = [np.mean(topic[r[r >= 0]] == np.bincount(topic[r[r >= 0]]).argmax()) for r in batches]
  assert np.mean(same) > 0.7


def test_numba_backend_plan_round_trips_through_the_plan_file(corpus, tmp_path):
  config = _config()
  header, batches = bm25.make_plan(corpus, config, progress=False)  # numba: the production path
  assert header["kind"] == "bm25" and header["k"] == bm25.DEFAULT_K and header["seed"] == 0
  assert header["timing"]["segments_per_s"] > 0
  _, numpy_batches = _plan(corpus)
  assert header["neighbour_in_batch"] == pytest.approx(_plan(corpus)[0]["neighbour_in_batch"], abs=0.05)
  assert numpy_batches.shape == batches.shape
  loaded = batch_plan.load(batch_plan.save(str(tmp_path / "plan"), header, batches))
  loaded.check(corpus_fingerprint=corpus.fingerprint(), segment_len=SEG, segmentation="stream", batch_size=B,
               kind="bm25")
  np.testing.assert_array_equal(loaded.rows(0), batches[0])


def test_same_document_neighbours_can_be_excluded(corpus):
  segs = D.make_segments(corpus, SEG)
  docs = bm25.segment_token_ids(corpus, segs)
  ids, scores = bm25.neighbours(docs, 5, backend="numpy", groups=segs.doc)
  assert (ids >= 0).all() and not (segs.doc[ids] == segs.doc[:, None]).any()
  assert (np.diff(scores, axis=1) <= 0).all()
  every, _ = bm25.neighbours(docs, 5, backend="numpy")
  assert (segs.doc[every] == segs.doc[:, None]).any()  # without exclusion, own-document hits happen
  # Packing: far fewer same-document batch-mates, still topically pure (other documents of the topic).
  h_ex, b_ex = _plan(corpus)
  h_all, _ = _plan(corpus, exclude_same_document=False)
  assert h_ex["exclude_same_document"] and not h_all["exclude_same_document"]
  assert h_ex["same_document_pairs"] == 0.0 < h_all["same_document_pairs"]  # 36 documents: always possible
  _, topic_of_doc = _corpus()
  topic = topic_of_doc[segs.doc]
  same = [np.mean(topic[r[r >= 0]] == np.bincount(topic[r[r >= 0]]).argmax()) for r in b_ex]
  assert np.mean(same) > 0.6  # at most 6 documents per topic, so ≤ 6/8 of a batch; random: ~0.35
