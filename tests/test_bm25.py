"""BM25 batching (Algorithm 1) on a synthetic corpus whose documents each draw from one of a few topics, and the
epoch order in which training reads batch plans."""

import glob
import importlib
import os

import numpy as np
import pytest

from trime_jax.configs import default
from trime_jax import data as D
from trime_jax.batching import bm25, lucene
from trime_jax.batching import plan as batch_plan
from trime_jax.errors import ConfigError, DataError

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


def _config(seed=0, segmentation="stream", exclude_same_document=None):
  """The default config (Algorithm 1 as published) at test sizes; exclude_same_document overrides the option."""
  c = default.get_config()
  if exclude_same_document is not None:
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


@pytest.mark.parametrize("exclude_same_document", [False, True])
def test_deterministic_from_seed(corpus, exclude_same_document):
  h0, b0 = _plan(corpus, seed=0, exclude_same_document=exclude_same_document)
  h1, b1 = _plan(corpus, seed=0, exclude_same_document=exclude_same_document)
  _, b2 = _plan(corpus, seed=1, exclude_same_document=exclude_same_document)
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
  header, batches = _plan(corpus)
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
  numpy_header, numpy_batches = _plan(corpus)
  assert header["neighbour_in_batch"] == pytest.approx(numpy_header["neighbour_in_batch"], abs=0.05)
  assert numpy_batches.shape == batches.shape
  # The two backends' neighbours themselves: the same BM25 scores, and the same ids wherever the scores are not
  # tied (a tie may be broken either way, which is why the plans above may differ).
  docs = bm25.segment_token_ids(corpus, D.make_segments(corpus, SEG))
  groups = D.make_segments(corpus, SEG).doc
  k = bm25.DEFAULT_K
  for g in (None, groups):
    ids_nb, sc_nb = bm25.neighbours(docs, k, backend="numba", groups=g)
    ids_np, sc_np = bm25.neighbours(docs, k + 1, backend="numpy", groups=g)  # the (k+1)-th: a tie at the k-th
    np.testing.assert_allclose(sc_nb, sc_np[:, :k], rtol=1e-5)
    assert np.isfinite(sc_np[:, :k]).mean() > 0.9  # most rows have a full top-k to compare
    gap = np.minimum(np.abs(np.diff(sc_np, axis=1, prepend=np.inf)),
                     np.abs(np.diff(sc_np, axis=1, append=-np.inf)))[:, :k]
    untied = gap > 1e-4 * np.abs(sc_np[:, :k])
    assert untied.mean() > 0.5, untied.mean()
    np.testing.assert_array_equal(ids_nb[untied], ids_np[:, :k][untied])
  loaded = batch_plan.load(batch_plan.save(str(tmp_path / "plan"), header, batches))
  loaded.check(corpus_fingerprint=corpus.fingerprint(), segment_len=SEG, segmentation="stream", batch_size=B,
               kind="bm25")
  assert header["shuffle"] is True and loaded.header["shuffle"] is True
  epoch0 = np.stack([loaded.rows(i) for i in range(len(batches))])
  np.testing.assert_array_equal(epoch0, batches[loaded.epoch_order(0)])


def _pack_reference(nbrs, seed, groups, batch_size):
  """Algorithm 1 with the same-document rule as bm25.pack's docstring states it, written the slow, obvious way:
  the next segment is the first unused neighbour of the previous one whose document has no segment in the batch
  being filled (a new batch: none), else the first such entry of the seeded permutation, else its first unused."""
  perm = np.random.default_rng([seed, 23]).permutation(len(nbrs)).tolist()
  order, used = [], set()
  for i in range(len(nbrs)):
    mates = {int(groups[x]) for x in order[i - i % batch_size:]}

    def ok(y):
      return y >= 0 and y not in used and int(groups[y]) not in mates

    options = ([y for y in nbrs[order[-1]].tolist() if ok(y)] if order else []) + [y for y in perm if ok(y)]
    c = options[0] if options else next(y for y in perm if y not in used)
    order.append(c)
    used.add(c)
  return np.asarray(order)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_with_documents_follows_its_rule_at_batch_boundaries(seed):
  # A neighbour whose document is in the batch just finished is allowed as the next batch's first segment (it was
  # rejected: the finished batch's documents were still counted when that neighbour was chosen).
  rng = np.random.default_rng(seed)
  s, k, b = 400, 5, 8
  groups = rng.integers(0, 40, s)
  nbrs = np.stack([rng.choice(np.flatnonzero(groups != groups[i]), k, replace=False) for i in range(s)])
  nbrs[rng.random(nbrs.shape) < 0.1] = -1  # missing neighbours, as neighbours() pads them
  order = bm25.pack(nbrs, seed, groups=groups, batch_size=b)
  np.testing.assert_array_equal(order, _pack_reference(nbrs, seed, groups, b))
  assert sorted(order.tolist()) == list(range(s))


def test_same_document_neighbours_can_be_excluded():
  corpus, topic_of_doc = _corpus(words_per_doc=170)  # 171 tokens a document: stream segments cross documents
  segs = D.make_segments(corpus, SEG)
  docs = bm25.segment_token_ids(corpus, segs)
  ids, scores = bm25.neighbours(docs, 5, backend="numpy", groups=segs.doc)
  assert (ids >= 0).all() and not (segs.doc[ids] == segs.doc[:, None]).any()
  assert (np.diff(scores, axis=1) <= 0).all()
  every, _ = bm25.neighbours(docs, 5, backend="numpy")
  assert (segs.doc[every] == segs.doc[:, None]).any()  # without exclusion, own-document hits happen
  # A stream segment crossing a document boundary holds two documents' tokens: it shares both (it counted as its
  # first target's document only, so it could neighbour and join a batch of the next document's segments)
  def touched(i):  # the documents segment i's targets lie in, from the token positions
    return set(np.searchsorted(corpus.doc_starts, np.arange(segs.start[i], segs.start[i] + segs.length[i]),
                               side="right") - 1)

  ranges = bm25.document_ranges(corpus, segs)
  assert [set(range(a, b + 1)) for a, b in ranges] == [touched(i) for i in range(len(segs))]
  assert (ranges[:, 1] > ranges[:, 0]).sum() > 10  # segments that cross a boundary
  ids, _ = bm25.neighbours(docs, 5, backend="numpy", groups=ranges)
  assert (ids >= 0).all() and not any(touched(i) & touched(j) for i in range(len(segs)) for j in ids[i])
  # Packing: far fewer same-document batch-mates, still topically pure (other documents of the topic).
  h_ex, b_ex = _plan(corpus, exclude_same_document=True)
  h_all, _ = _plan(corpus)  # the default: Algorithm 1 as published
  assert h_ex["exclude_same_document"] and not h_all["exclude_same_document"]
  # 36 documents for batches of 8: a packing without same-document pairs exists, and the greedy rule finds one
  # for every batch but the last, whose 8 segments are whatever is left (here 2 pairs of 56 share a document)
  assert h_ex["same_document_pairs"] < 0.01 < h_all["same_document_pairs"]
  assert not any(touched(i) & touched(j) for row in b_ex[:-1] for i in row[row >= 0] for j in row[row >= 0] if i != j)
  _, topic_of_doc = _corpus()
  topic = topic_of_doc[segs.doc]
  same = [np.mean(topic[r[r >= 0]] == np.bincount(topic[r[r >= 0]]).argmax()) for r in b_ex]
  assert np.mean(same) > 0.6  # at most 6 documents per topic, so ≤ 6/8 of a batch; random: ~0.35


# ---- Algorithm 1 as published (issue 9): default configs, a literal reference, score-0 neighbours ----------------


def _simseg(scores_SxS, k):
  """SimSeg(I, c, k) by brute force, c's own hit among them as it is in I (the original: top-20 hits, then
  `hits[1:]`): the k segments with the highest positive BM25 score (equal scores: the lower id as a string
  first, as Anserini's search sorts them), best first, from the second on, less c."""
  out = []
  for c, row in enumerate(scores_SxS.astype(np.float64)):
    hits = sorted((j for j in range(len(row)) if row[j] > 0), key=lambda j: (-row[j], str(j)))[:k]
    out.append([j for j in hits[1:] if j != c])  # (c is its own first hit but where another ties or beats it)
  return out


def _algorithm_1(simseg, perm, batch_size):
  """Appendix B, Algorithm 1 line by line; random_sample(S) is the first entry of the seeded permutation in S."""
  S = set(range(len(simseg)))
  l, c = [], None
  while len(S) != 0:
    if c is None:
      c = next(x for x in perm.tolist() if x in S)
    l.append(c)
    S.remove(c)
    n = None
    for c2 in simseg[c]:
      if c2 in S:
        n = c2
        break
    c = n
  l = l + [-1] * (-len(l) % batch_size)
  return np.asarray(l, np.int64).reshape(-1, batch_size)


def _dense_scores(corpus, segmentation="stream"):
  """[S, S] BM25 scores of every segment (query) for every segment, as the planner's default documents them
  (Lucene's terms of each segment's input words: `bm25.segment_terms`) and Lucene scores them."""
  docs = bm25.segment_terms(corpus, D.make_segments(corpus, SEG, segmentation))
  retriever, lut = bm25.bm25_index(docs, backend="numpy", lucene=True)
  every = np.arange(len(docs))
  return np.stack([lucene.lucene_scores(retriever, lut[d], every) for d in docs])


def _paper_configs():
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
  names = sorted(os.path.basename(f)[:-3] for pat in ("wiki103_*.py", "enwik8_*.py")
                 for f in glob.glob(os.path.join(root, pat)))
  return {n: importlib.import_module(f"trime_jax.configs.{n}").get_config() for n in names}


def test_default_and_paper_configs_run_algorithm_1_unchanged(corpus):
  assert default.get_config().trime.bm25_exclude_same_document is False
  configs = _paper_configs()
  assert {"wiki103_7m", "wiki103_150m", "wiki103_247m", "enwik8_38m"} <= set(configs)
  assert configs["wiki103_7m"].trime.batching == "bm25"  # the ablation model (TrimeLM_ext)
  for name, c in configs.items():  # bm25 or not: `--config.trime.batching=bm25` must give Algorithm 1 too
    assert c.trime.bm25_exclude_same_document is False, name
  # The planner with default settings is Algorithm 1 as written: SimSeg by brute force over all BM25 scores.
  config = _config(seed=4)
  k = int(config.trime.bm25_k)
  header, batches = bm25.make_plan(corpus, config, progress=False, backend="numpy")
  scores = _dense_scores(corpus)
  simseg = _simseg(scores, k)
  # Ties would make "best first" ambiguous between bm25s's top-k and the brute force: this corpus has none
  for c, row in enumerate(scores):
    top = np.sort(row)[::-1][:k + 1]  # the segment's own score included: it takes one of the k places
    assert len(np.unique(top[top > 0])) == (top > 0).sum()
    assert row[c] == row.max()  # its own hit is its best here, so SimSeg leaves k - 1 others
  assert all(len(n) == k - 1 for n in simseg)  # shared function words: every segment has k positive hits
  assert header["hits_include_query"] is True
  want = _algorithm_1(simseg, np.random.default_rng([4, 23]).permutation(len(scores)), B)
  np.testing.assert_array_equal(batches, want)
  assert header["exclude_same_document"] is False and header["shuffle"] is True
  # BM25 brings an article's segments together (why §4.3 sets m = 1).
  assert header["same_document_pairs"] > 3 * header["same_document_pairs_random"], header


def _corpus_with_isolated(isolated=(3, 17, 30)):
  """The topic corpus with extra one-segment documents whose words occur nowhere else (no shared token)."""
  base, _ = _corpus()
  # every document ends with </s> (as WikiText's lines do): a segment's first input, the previous document's
  # last token, is then no shared word (the original's documents are a segment's input words, </s> dropped)
  docs = [np.append(base.tokens[a:b], 0) for a, b in zip(base.doc_starts[:-1], base.doc_starts[1:])]
  extra = len(base.vocab)
  words = [f"w{i}" for i in range(len(base.vocab) - 2)]
  for n, at in enumerate(isolated):
    docs.insert(at, np.append(np.arange(extra + 12 * n, extra + 12 * n + 12), 0))
  vocab = D.Vocab(["</s>", "<unk>"] + words + [f"u{i}" for i in range(12 * len(isolated))])
  corpus = D.Corpus.from_docs(docs, vocab, "topics+isolated")
  segs = D.make_segments(corpus, SEG, "document")
  lone = np.flatnonzero(np.diff(corpus.doc_starts)[segs.doc] == 13)
  assert len(lone) == len(isolated)
  return corpus, lone


def test_score_zero_hits_are_no_neighbours_and_algorithm_1_jumps():
  # bm25s fills a top-k with score-0 documents; they must not come back as neighbours.
  docs = [np.array([0, 1, 2]), np.array([0, 1, 3]), np.array([4, 5, 6]), np.array([0, 2, 2]), np.array([7, 8])]
  ids, scores = bm25.neighbours(docs, 4, backend="numpy")
  assert (ids[2] == -1).all() and (ids[4] == -1).all() and np.isinf(scores[2]).all()
  assert sorted(ids[0][ids[0] >= 0].tolist()) == [1, 3] and (ids[:, 2:] == -1).all()
  assert not np.isin(ids, [2, 4]).any()
  # In a plan: isolated segments get no neighbour, and after one the chain takes a random unused segment
  # (the next unused entry of the seeded permutation), exactly as Algorithm 1 with an empty SimSeg.
  corpus, lone = _corpus_with_isolated()
  config = _config(seed=2, segmentation="document")
  segs = D.make_segments(corpus, SEG, "document")
  nbrs, _ = bm25.neighbours(bm25.segment_terms(corpus, segs), int(config.trime.bm25_k), backend="numpy",
                            lucene=True)
  assert (nbrs[lone] == -1).all() and not np.isin(nbrs, lone).any()
  scores = _dense_scores(corpus, "document")
  positive_others = (scores > 0).sum(1) - (np.diag(scores) > 0)  # (a document's last, one-word segment has few)
  assert ((nbrs >= 0).sum(1) == np.where(np.isin(np.arange(len(segs)), lone), 0,
                                         np.minimum(positive_others, nbrs.shape[1]))).all()
  _, batches = bm25.make_plan(corpus, config, progress=False, backend="numpy")
  order = batches.reshape(-1)[:len(segs)]
  perm = np.random.default_rng([2, 23]).permutation(len(segs))
  jumps_after_lone = 0
  for i in range(len(order) - 1):
    if order[i] in lone:
      used = set(order[:i + 1].tolist())
      assert order[i + 1] == next(x for x in perm.tolist() if x not in used)
      jumps_after_lone += 1
  assert jumps_after_lone >= len(lone) - 1  # (one may be the last segment of the chain)
  want = _algorithm_1(_simseg(scores, int(config.trime.bm25_k)), perm, B)
  np.testing.assert_array_equal(batches, want)


# ---- epoch order of batch plans ----------------------------------------------------------------------------


def _toy_plan(n=12, seed=7, **extra):
  return batch_plan.BatchPlan({"seed": seed, **extra}, np.arange(n * 2, dtype=np.int64).reshape(n, 2))


def _epoch_ids(plan, epoch):
  n = plan.num_batches
  return np.array([plan.rows(epoch * n + j)[0] // 2 for j in range(n)])


def test_every_epoch_is_shuffled_the_first_included():
  plan = _toy_plan()
  n = plan.num_batches
  first = _epoch_ids(plan, 0)
  assert not np.array_equal(first, np.arange(n))  # not the planner's (chain) order
  for e in range(4):  # every batch exactly once per epoch, in the seeded permutation
    got = _epoch_ids(plan, e)
    np.testing.assert_array_equal(np.sort(got), np.arange(n))
    np.testing.assert_array_equal(got, np.random.default_rng([7, e, 11]).permutation(n))
  assert not np.array_equal(first, _epoch_ids(plan, 1))
  np.testing.assert_array_equal(first, _epoch_ids(_toy_plan(), 0))  # deterministic
  np.testing.assert_array_equal(first, _epoch_ids(_toy_plan(shuffle=True), 0))  # absent key = shuffle
  assert not np.array_equal(first, _epoch_ids(_toy_plan(seed=8), 0))
  # Reading out of order (resumed training) gives the same rows.
  np.testing.assert_array_equal(plan.rows(2 * n + 5), _toy_plan().rows(2 * n + 5))
  np.testing.assert_array_equal(plan.rows(3), plan.batches[first[3]])
  # "shuffle": false (consecutive stream layout, the original's --keep-order): stored order every epoch.
  kept = _toy_plan(shuffle=False)
  for e in range(3):
    np.testing.assert_array_equal(_epoch_ids(kept, e), np.arange(n))


def test_epochs_are_whole_updates():
  """12 batches, 5 an update: 3 updates an epoch, the last with 2 batches and 3 all-padding micro-batches (the
  original's GroupedIterator: a smaller last update); every epoch still visits its own permutation."""
  plan = _toy_plan()
  n, accum = plan.num_batches, 5
  for e in range(3):
    got = np.concatenate([plan.update_rows(e * 3 + u, accum) for u in range(3)])  # [15, 2]
    assert np.all(got[n:] == -1) and np.all(got[:n] >= 0)
    np.testing.assert_array_equal(got[:n, 0] // 2, np.random.default_rng([7, e, 11]).permutation(n))
  # Where accum divides the batches, updates read the `rows` sequence, as before.
  for step in (0, 5, 7):
    np.testing.assert_array_equal(plan.update_rows(step, 4), np.stack([plan.rows(step * 4 + a) for a in range(4)]))
  kept = _toy_plan(shuffle=False)
  np.testing.assert_array_equal(kept.update_rows(3, 5), kept.batches[:5])  # epoch 1 starts in stored order


def test_bm25_plan_first_epoch_does_not_follow_the_chain(corpus, tmp_path):
  header, batches = _plan(corpus)
  loaded = batch_plan.load(batch_plan.save(str(tmp_path / "plan"), header, batches))
  n = loaded.num_batches
  epoch0 = np.stack([loaded.rows(j) for j in range(n)])
  assert not np.array_equal(epoch0, batches)
  np.testing.assert_array_equal(np.sort(epoch0, axis=None), np.sort(batches, axis=None))
  np.testing.assert_array_equal(epoch0, batches[np.random.default_rng([0, 0, 11]).permutation(n)])


def test_plan_check_compares_layout(corpus, tmp_path):
  header, batches = _plan(corpus)
  plan = batch_plan.load(batch_plan.save(str(tmp_path / "plan"), {**header, "layout": "stream"}, batches))
  args = dict(corpus_fingerprint=corpus.fingerprint(), segment_len=SEG, segmentation="stream", batch_size=B)
  plan.check(**args, layout="stream")
  plan.check(**args)  # not asked: not compared
  with pytest.raises(DataError, match="layout 'stream' != 'packed'"):
    plan.check(**args, layout="packed")


def test_training_refuses_a_plan_of_other_neighbours(corpus, tmp_path, caplog):
  # A BM25 plan made with another k or the other same-document setting is refused by the training's batch source
  # (it trained on what its config did not say); another seed is allowed with a warning (the plan's order).
  from trime_jax.train import BatchSource

  header, batches = _plan(corpus)  # k 20, Algorithm 1 as published, seed 0
  path = batch_plan.save(str(tmp_path / "plan"), header, batches)
  config = _config()
  config.trime.batching, config.trime.batch_plan = "bm25", path
  BatchSource(corpus, config)
  for field, value, message in [("bm25_k", 3, "k 20 != 3"),
                                ("bm25_exclude_same_document", True, "exclude_same_document False != True")]:
    other = _config()
    other.trime.batching, other.trime.batch_plan = "bm25", path
    other.trime[field] = value
    with pytest.raises(DataError, match=message):
      BatchSource(corpus, other)
  reseeded = _config(seed=5)
  reseeded.trime.batching, reseeded.trime.batch_plan = "bm25", path
  with caplog.at_level("WARNING"):
    BatchSource(corpus, reseeded)
  assert "made with seed 0" in caplog.text and "train.seed=5" in caplog.text
  # an exclusion plan of before 2026-12-06 (a segment keyed on its first target's document only): refused
  ex_header, ex_batches = _plan(corpus, exclude_same_document=True)
  assert ex_header["exclude_by"] == "documents_touched"
  old = batch_plan.save(str(tmp_path / "old_plan"), {k: v for k, v in ex_header.items() if k != "exclude_by"},
                        ex_batches)
  excluding = _config()
  excluding.trime.batching, excluding.trime.batch_plan, excluding.trime.bm25_exclude_same_document = "bm25", old, True
  caplog.clear()
  with caplog.at_level("WARNING"):  # a run that trained on it resumes on its batches; a new one is told
    BatchSource(corpus, excluding)
  assert "by each segment's first document only" in caplog.text and "make_batches --overwrite" in caplog.text
  caplog.clear()
  with caplog.at_level("WARNING"):
    excluding.trime.batch_plan = batch_plan.save(str(tmp_path / "new_plan"), ex_header, ex_batches)
    BatchSource(corpus, excluding)
  assert "first document only" not in caplog.text



def test_k_hits_count_the_query_itself():
  # SimSeg(I, c, k) ranks every segment of I, c included (the original searched 20 hits and followed hits[1:]):
  # a plan's k = 20 are 19 other segments at most, not 20. Until 2026-12-07 the planner followed 20 others.
  corpus, _ = _corpus(seed=2)
  docs = bm25.segment_terms(corpus, D.make_segments(corpus, SEG))
  scores = _dense_scores(corpus)
  k = 6
  ids, sc = bm25.neighbours(docs, k, backend="numpy", hits_include_query=True, lucene=True)
  for c, row in enumerate(scores.astype(np.float64)):
    hits = [j for j in np.argsort(-row, kind="stable").tolist() if row[j] > 0][:k]
    got = ids[c][ids[c] >= 0].tolist()
    assert got == [j for j in hits[1:] if j != c], c
  assert (ids[:, k - 1] == -1).all() and np.isinf(sc[:, k - 1]).all()  # each segment is its own best hit here
  others, _ = bm25.neighbours(docs, k, backend="numpy", lucene=True)  # the earlier reading: k besides the query
  assert (others >= 0).all()
  np.testing.assert_array_equal(others[:, :k - 1], ids[:, :k - 1])
  # Where another document outscores the query (a longer one holding its rare word more often), the original's
  # hits[1:] drops that best other hit, and skips the query itself further down.
  few = [np.array([5, 0]), np.array([5, 5, 5, 5, 0, 0, 1]), np.array([1, 2, 3]), np.array([1, 4])]
  retriever, lut = bm25.bm25_index(few, backend="numpy")
  dense = np.stack([retriever.get_scores(lut[d].tolist()) for d in few])
  assert dense[0, 1] > dense[0, 0] > dense[0, 2]  # the premise: segment 1 ranks above 0's own hit
  top1, _ = bm25.neighbours(few, 1, backend="numpy", hits_include_query=True)
  assert (top1 == -1).all()  # k = 1: hits[1:] of one hit is nothing
  top3, _ = bm25.neighbours(few, 3, backend="numpy", hits_include_query=True)
  assert top3[0].tolist() == [-1, -1, -1]  # 0's hits: 1, then itself (no other shares a token): none follows
  assert top3[2].tolist() == [3, 1, -1]  # 2's hits: itself, 3, 1


def test_older_rules_name_what_a_plan_of_before_the_fidelity_change_did():
  new = {"k": 20, "hits_include_query": True, "bm25_k1": 0.9, "bm25_b": 0.4, "bm25_analyzer": "english"}
  assert bm25.older_rules(new) == []
  every = bm25.older_rules({"k": 20})
  assert len(every) == 3 and "k = 20 BM25 neighbours were k hits besides each query" in every[0]
  assert "k1 = 1.5, b = 0.75 (the original's: 0.9, 0.4)" in every[1]
  assert "target token ids" in every[2] and "Lucene search" in every[2]  # (LM and MT plans alike)
  assert bm25.older_rules({"k": 20, "hits_include_query": True}) == every[1:]  # made between the first two changes
  assert bm25.older_rules({k: v for k, v in new.items() if k != "bm25_analyzer"}) == every[2:]  # 2026-12-07


def test_make_batches_treats_a_plan_of_k_others_as_another_plan(tmp_path, caplog):
  # A plan made before 2026-12-07 (header without hits_include_query: its k were k others) at --out is another
  # plan: a rerun says so before planning instead of keeping it or replacing it; a training reading it is told.
  import subprocess
  import sys

  from tests.helpers import wikitext_config_file, wikitext_dir
  from trime_jax.train import BatchSource

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  data = wikitext_dir(tmp_path, line=lambda i: f" alpha beta w{i} gamma delta .\n", lines=lambda i: i + 3)
  cfg = wikitext_config_file(tmp_path, data)
  out = tmp_path / "plan"
  env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu")

  def make(*extra):
    return subprocess.run([sys.executable, "-m", "trime_jax.launch.make_batches", f"--config={cfg}", "--kind=bm25",
                           f"--out={out}", *extra], cwd=repo, env=env, capture_output=True, text=True, timeout=300)

  first = make()
  assert first.returncode == 0, first.stderr
  plan = batch_plan.load(str(out))
  assert plan.header["hits_include_query"] is True
  old_header = {k: v for k, v in plan.header.items() if k not in ("hits_include_query", "format", "num_batches",
                                                                  "batch_size", "batches_sha256", "header_sha256")}
  batch_plan.save(str(out), {**old_header, "batch_size": 4}, np.asarray(plan.batches))
  digest = batch_plan.load(str(out)).digest()
  again = make()
  assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].startswith("error: "), again.stderr
  assert "hits_include_query None != True" in again.stderr and "--overwrite" in again.stderr
  assert "bm25:" not in again.stdout  # refused before the planning
  assert batch_plan.load(str(out)).digest() == digest  # untouched
  spec = importlib.util.spec_from_file_location("cfg_k_others", str(cfg))  # the config file make_batches read
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.trime.batching, config.trime.batch_plan = "bm25", str(out)
  from trime_jax import corpora

  train = corpora.load_splits(config.data).train
  with caplog.at_level("WARNING"):  # a run that trained on it resumes on its batches; a new one is told
    BatchSource(train, config)
  assert "one more candidate per step" in caplog.text and "make_batches --overwrite" in caplog.text
  assert "scored at bm25s's k1 = 1.5" not in caplog.text  # this plan records its k1 / b
  replaced = make("--overwrite")
  assert replaced.returncode == 0, replaced.stderr
  caplog.clear()
  with caplog.at_level("WARNING"):
    BatchSource(train, config)
  assert "made by an older rule" not in caplog.text
  # a plan with the hits rule but no k1 / b (made between the two changes): told of its scoring alone
  new = batch_plan.load(str(out))
  unscored = {k: v for k, v in new.header.items() if k not in ("bm25_k1", "bm25_b", "format", "num_batches",
                                                               "batch_size", "batches_sha256", "header_sha256")}
  batch_plan.save(str(out), {**unscored, "batch_size": 4}, np.asarray(new.batches))
  caplog.clear()
  with caplog.at_level("WARNING"):
    BatchSource(train, config)
  assert "scored at bm25s's k1 = 1.5" in caplog.text and "one more candidate" not in caplog.text


def test_scores_are_lucene_bm25_at_the_originals_k1_and_b():
  """The planner scores with Lucene's BM25 at Pyserini's LuceneSearcher defaults k1 = 0.9, b = 0.4 (the original
  searched with them; until 2026-12-07 bm25s's 1.5 / 0.75): a float64 NumPy reference of the formula,
  idf = log(1 + (N - df + 0.5) / (df + 0.5)) times tf / (tf + k1·(1 - b + b·|d| / avgdl)), per query token
  (Lucene since 8 drops the classic formula's constant factor k1 + 1: the same ranking)."""
  rng = np.random.default_rng(4)
  docs = [rng.integers(0, 30, int(n)).astype(np.int32) for n in rng.integers(5, 40, 25)]

  def reference(k1, b):
    n, avgdl = len(docs), np.mean([len(d) for d in docs])
    df = {t: sum(t in set(d.tolist()) for d in docs) for t in range(30)}
    out = np.zeros((n, n))
    for q, query in enumerate(docs):
      for j, d in enumerate(docs):
        for t in query.tolist():  # a repeated query token counts once per occurrence
          tf = int((d == t).sum())
          idf = np.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
          out[q, j] += idf * tf / (tf + k1 * (1 - b + b * len(d) / avgdl)) if tf else 0.0
    return out

  assert (bm25.DEFAULT_K1, bm25.DEFAULT_B) == (0.9, 0.4)
  for kw, (k1, b) in (({}, (0.9, 0.4)), ({"k1": 1.5, "b": 0.75}, (1.5, 0.75))):
    retriever, lut = bm25.bm25_index(docs, backend="numpy", **kw)
    got = np.stack([retriever.get_scores(lut[d].tolist()) for d in docs])
    np.testing.assert_allclose(got, reference(k1, b), rtol=1e-5, atol=1e-5)
  # The two settings rank some neighbours differently here (else the option would be untested)
  a, _ = bm25.neighbours(docs, 6, backend="numpy", hits_include_query=True)
  o, _ = bm25.neighbours(docs, 6, backend="numpy", hits_include_query=True, k1=1.5, b=0.75)
  assert (a != o).any()
  c = default.get_config()
  assert (c.trime.bm25_k1, c.trime.bm25_b) == (0.9, 0.4)
  settings = bm25.neighbour_settings(c)
  assert (settings["bm25_k1"], settings["bm25_b"]) == (0.9, 0.4)
  for k1, b, said in ((-1.0, 0.4, "bm25_k1 must be a number >= 0"), (0.9, 1.5, r"bm25_b must be in \[0, 1\]"),
                      (True, 0.4, "bm25_k1"), (0.9, "0.4", "bm25_b")):
    with pytest.raises(ConfigError, match=said):
      bm25.check_scoring(k1, b)
