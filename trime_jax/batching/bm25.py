"""BM25 batching for TrimeLM_ext (paper §4.3, Appendix B, Algorithm 1).

Segments that share many words are packed into the same batch, so the in-batch memory at training time
looks like the kNN neighbours the external datastore returns at test time.

  1. Index every training segment (`make_segments(corpus, data.segment_len, data.segmentation)`) with bm25s.
     Each segment's BM25 "document" is what the original indexed (`trime.bm25_analyzer="english"`): Lucene's
     English analysis of its input words (`segment_terms`, `batching/lucene.py`), with Lucene's one-byte
     document lengths; "none": its target token ids (no string round trip).
  2. Query every segment with its own document (batched, numba backend), take the top-k hits as the original's
     Pyserini search returned them (Lucene's scores, best first, equal scores by id as a string) and keep them but
     the first,
     as the original (it searched 20 hits and followed `hits[1:]`: Algorithm 1's SimSeg(I, c, k) ranks c, which
     is in I, and c is its own best hit but where another segment outscores it; the query is skipped wherever
     it ranks): `neighbours [S, k]` int64, k - 1 others at most (-1 where fewer exist; header
     `hits_include_query`). Only hits with a positive score count: bm25s fills
     a top-k with score-0 documents (no shared token), which Lucene never returns, so those are dropped and
     Algorithm 1 falls back to a random segment instead of following them.
  3. Algorithm 1 as published: start at a random segment; repeatedly move to its best-scoring neighbour not
     used yet; when all its neighbours are used, jump to a random unused segment. The chain visits every
     segment exactly once. Same-document neighbours are allowed (the paper relies on BM25 bringing segments
     of one article together, which is why TrimeLM_ext uses m = 1).
  4. Cut the chain into batches of B = train.batch_size rows. The last partial batch is padded with -1 rows
     (all-padding segments, see `data.gather_segments`), so no segment is ever dropped. The plan header says
     `"shuffle": true`: training visits the batches in a seeded permutation every epoch, the first included
     (`batching/plan.py`), as the original's iterator did, so consecutive updates do not follow one chain.

Option `trime.bm25_exclude_same_document=True` (default False) departs from the paper: neighbours and
batch-mates share no document, like the test-time datastore. A stream segment can hold the end of one
document and the start of the next: it shares both (`document_ranges`). On wikitext-mini (124 articles)
plain Algorithm 1 put 65% of batch-mate pairs in the same article, and the exclusion brought that to 0%
(docs/external_memory.md; measured when a segment counted as its first target's document only).

Everything is deterministic from `train.seed`. The original release compared Lucene's string document ids
with integer ids, so no neighbour ever matched an unused segment and every step fell back to a random one:
its batches were silently random. The plan header records `neighbour_in_batch` (the mean fraction of a
segment's top-k that share its batch) next to the same number for a seeded random packing, so such a failure
is visible at a glance.

Memory: bm25s indexes Python lists of ints; the score matrix itself is sparse (one float per distinct token
per segment). Measured (2026-12-01, `/usr/bin/time -v` of `make_batches --config=configs/docs_wt_ext.py
--kind=bm25`): a peak of 1.08 GiB for docs-wt's 17.8M training tokens in 34,785 segments of 512, the whole
process included (~64 bytes per token; 7.5 min on 2 loaded cores), so expect ~6-7 GB for WikiText-103. With the
Lucene rule (2026-12-08, `/usr/bin/time -v` of the corpus load, `segment_terms` and `neighbours(..., lucene=True)`
over the same segments): 1.22 GiB peak, 4.7 s of analysis and 78.5 s of search (8.2 s of it numba's compile) on
2 cores.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from trime_jax import data
from trime_jax.errors import ConfigError

if TYPE_CHECKING:
  import bm25s

# bm25s and batching/lucene.py (regex, nltk) are imported where a plan is made, not where one is read: a training
# checks its plan's settings with this module on machines without them (the GPU machine: experiments/)

DEFAULT_K = 20  # BM25 hits per segment, its own among them (the paper's k)
# BM25's k1 and b: the original searched with Pyserini's LuceneSearcher at its defaults (Anserini's BM25Similarity
# 0.9 / 0.4), not bm25s's 1.5 / 0.75 (which plans of before 2026-12-07 used)
DEFAULT_K1, DEFAULT_B = 0.9, 0.4
QUERY_BATCH = 4096  # segments per bm25s.retrieve call (one progress-bar step)
MAX_GROUP_EXTRA = 256  # extra hits retrieved to replace excluded same-document neighbours
LUCENE_MARGIN = 8  # extra hits retrieved, rescored exactly: where a tie crosses them all, every match is rescored
ANALYZERS = ("english", "none")  # trime.bm25_analyzer: Lucene's English analysis of the words (the original's) | ids


def _threads() -> int:
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # not Linux
    return max(1, os.cpu_count() or 1)


def segment_token_ids(corpus: data.Corpus, segments: data.Segments) -> list[np.ndarray]:
  """Each segment's target tokens (int32 views of the corpus stream, padding excluded)."""
  tokens = corpus.tokens
  return [tokens[s:s + n] for s, n in zip(segments.start.tolist(), segments.length.tolist())]


def segment_terms(corpus: data.Corpus, segments: data.Segments) -> list[np.ndarray]:
  """Each segment's document as the original indexed it: the words of its inputs (its targets shifted right by
  one: fairseq's src_tokens), end-of-sentence symbols dropped (Dictionary.string), through Lucene's English
  analysis (`lucene.english_terms`), as int32 term ids."""
  from trime_jax.batching.lucene import document_terms, vocabulary_terms

  vocab = corpus.vocab
  if vocab.kind != "words":
    raise ConfigError(f"trime.bm25_analyzer='english' analyses words; this corpus has a {vocab.kind} vocabulary "
                      "(use trime.bm25_analyzer='none': BM25 over its token ids)")
  offsets, term_ids, _ = vocabulary_terms(vocab.tokens, skip=(vocab.eos,))
  tokens = corpus.tokens
  return [document_terms(tokens[max(s - 1, 0):s + n - 1], offsets, term_ids)
          for s, n in zip(segments.start.tolist(), segments.length.tolist())]


def bm25_index(docs: list[np.ndarray], *, backend: str = "numba", progress: bool = False,
               k1: float = DEFAULT_K1, b: float = DEFAULT_B, lucene: bool = False) -> tuple["bm25s.BM25", np.ndarray]:
  """(retriever, lut): a bm25s index (Lucene's BM25 formula at `k1`, `b`: by default Pyserini's LuceneSearcher's,
  which the original searched with) of documents of integer ids (token or term ids). lucene: with Lucene's
  one-byte document lengths and float32 term scores (`lucene.LuceneBM25`), as the original's index had them;
  else bm25s's exact lengths.

  bm25s uses the ids it is given as score-matrix columns, so they are first relabelled to 0..n_distinct-1
  (BM25 only compares ids: no score changes). Queries must be relabelled the same way: `lut[token_ids]`
  (-1 for an id no document contains).
  """
  import bm25s

  from trime_jax.batching.lucene import LuceneBM25

  # marked document by document: a concatenation (and bincount's int64 cast of it) would be a transient
  # 12 bytes per token, 1.2 GB over WikiText-103's training split
  present = np.zeros(max((int(d.max()) + 1 for d in docs if len(d)), default=1), bool)
  for d in docs:
    present[d] = True
  lut = np.where(present, np.cumsum(present) - 1, -1).astype(np.int32)
  retriever = (LuceneBM25(float(k1), float(b), backend=backend) if lucene
               else bm25s.BM25(k1=float(k1), b=float(b), backend=backend))
  # ids with their vocabulary given (bm25s would otherwise infer the corpus's kind from its first document,
  # and take ids for strings where that document is empty); no empty-token entry: every query is a document
  n_ids = int(present.sum())
  retriever.index(([lut[d].tolist() for d in docs], {i: i for i in range(n_ids)}), create_empty_token=False,
                  show_progress=progress)
  # bm25s keys document frequencies by its own labels but reads columns by the given ids: they must agree.
  if any(key != label for key, label in retriever.vocab_dict.items()):
    raise RuntimeError("bm25s relabelled contiguous token ids; its BM25 scores would be wrong")
  return retriever, lut


def document_ranges(corpus: data.Corpus, segments: data.Segments) -> np.ndarray:
  """[S, 2] int64: the first and last document each segment's targets lie in. Stream segments cross document
  boundaries, so a segment can hold the end of one document and the start of the next (or more): it shares a
  document with every segment whose range overlaps its own. Document segments: first = last."""
  last = np.searchsorted(corpus.doc_starts, segments.start + np.maximum(segments.length, 1) - 1, side="right") - 1
  return np.stack([segments.doc.astype(np.int64), np.maximum(last, segments.doc).astype(np.int64)], axis=1)


def _ranges(groups: np.ndarray) -> np.ndarray:
  """groups as [S, 2] document ranges: [S] (one group per segment) is the range [g, g]."""
  groups = np.asarray(groups, np.int64)
  return np.stack([groups, groups], axis=1) if groups.ndim == 1 else groups


def _share(ranges_a: np.ndarray, ranges_b: np.ndarray) -> np.ndarray:
  """Whether document ranges overlap (broadcast over the leading dimensions): the segments share a document."""
  return (ranges_a[..., 0] <= ranges_b[..., 1]) & (ranges_b[..., 0] <= ranges_a[..., 1])


def neighbours(docs: list[np.ndarray], k: int, *, backend: str = "numba", query_batch: int = QUERY_BATCH,
               n_threads: int = 0, progress: bool = False, timing: dict | None = None,
               groups: np.ndarray | None = None, hits_include_query: bool = False, k1: float = DEFAULT_K1,
               b: float = DEFAULT_B, lucene: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Top-k most BM25-similar other documents of every document: (ids [S, k] int64, scores [S, k] float32),
  best first; -1 / -inf where fewer than k other documents share a token with it. Each document queries with
  its own tokens (repeated tokens count once per occurrence, as in a Lucene query).

  hits_include_query: the original's rule: the query's top-k hits, the document itself among them, are
  followed from the second on (`hits[1:]`: the first is the query itself but where another document outscores
  it, and the original drops the first whatever it is), the query skipped wherever it ranks: k - 1 others at
  most (k - 2 where another outranks the query). False: k hits besides the query (wherever it ranks). With
  `groups` the query is one of its group's excluded members either way.

  A Lucene BM25 term score is positive (idf = log(1 + (N - df + 0.5) / (df + 0.5)) > 0), so a score of 0 means
  no shared token: bm25s still returns such documents to fill its top-k, Lucene does not; they are dropped.

  groups [S] (e.g. the corpus document of each segment) or [S, 2] document ranges (`document_ranges`):
  neighbours that share a group (a document) with the query are excluded too (up to `MAX_GROUP_EXTRA` extra
  hits are retrieved to make up for them).

  lucene: rank as the original's Pyserini search did: Lucene's one-byte lengths and float32 scores, the hits by
  score then id as a string (Anserini's sort: "10" before "9"). False: bm25s's exact lengths
  and order.

  backend: "numba" (fast, but its first call in a process JIT-compiles for 15-30 s) or "numpy".
  n_threads: 0 = every core this process may use. timing: filled with index_s, compile_s, retrieve_s.
  """
  timing = {} if timing is None else timing
  t0 = time.perf_counter()
  s = len(docs)
  # the query's own hit takes one of the k places (without groups: with them it is one of the excluded, below)
  k_eff = min(k - 1 if hits_include_query else k, s - 1)
  if groups is not None:
    groups = _ranges(groups)
    touching = np.zeros(int(groups[:, 1].max()) + 2, np.int64)  # segments touching each document
    np.add.at(touching, groups[:, 0], 1)
    np.add.at(touching, groups[:, 1] + 1, -1)
    # a segment excludes every segment touching one of its documents: at most the sum over its documents
    upto = np.concatenate([[0], np.cumsum(np.cumsum(touching))])
    most = int((upto[groups[:, 1] + 1] - upto[groups[:, 0]]).max())
  extra = 1 if groups is None else 1 + min(most, MAX_GROUP_EXTRA)
  k_ret = min(k_eff + extra, s)
  keep = k_eff
  first_dropped = hits_include_query and groups is None  # the original's hits[1:] of its top-k hits
  ids = np.full((s, k), -1, np.int64)
  scores = np.full((s, k), -np.inf, np.float32)
  if keep <= 0 or not any(len(d) for d in docs):  # (no document has a term: no neighbours)
    return ids, scores
  retriever, lut = bm25_index(docs, backend=backend, progress=progress, k1=k1, b=b, lucene=lucene)
  if lucene:  # each document's place among the ids as strings (the original's ids: "10" before "9")
    name_rank = np.empty(s, np.int64)
    name_rank[sorted(range(s), key=str)] = np.arange(s)
  # bm25s's numpy backend would pick JAX for its per-query top-k when JAX is importable: keep it on numpy.
  selection = "numba" if backend == "numba" else "numpy"
  n_threads = n_threads or _threads()
  t1 = time.perf_counter()
  some = lut[next(d for d in docs if len(d))].tolist()  # a query bm25s accepts (a document's terms)
  retriever.retrieve([some], k=1, show_progress=False, n_threads=n_threads,
                     backend_selection=selection)  # compiles the numba kernels (once per process)
  t2 = time.perf_counter()
  for a in tqdm(range(0, s, query_batch), desc="bm25 retrieve", unit="batch", disable=not progress):
    b = min(a + query_batch, s)
    # (a document without a term, e.g. a sentence of stop words, has no hit; bm25s refuses an empty query)
    empty = np.asarray([len(d) == 0 for d in docs[a:b]])
    queries = [lut[d].tolist() if len(d) else some for d in docs[a:b]]
    res = retriever.retrieve(queries, k=min(k_ret + LUCENE_MARGIN, s) if lucene else k_ret, show_progress=False,
                             n_threads=n_threads, backend_selection=selection)
    got, sc = np.asarray(res.documents, np.int64), np.asarray(res.scores, np.float32)
    sc[empty] = 0
    if lucene:
      got, sc = _lucene_hits(*_lucene_candidates(retriever, lut, docs[a:b], got, sc, k_ret), k_ret, name_rank)
    # Drop the query itself wherever it ranks (another segment may outscore it), score-0 hits (no shared token)
    # and its group's members (or, by the original's rule, the first hit too); keep the best of the rest in order.
    excluded = (got == np.arange(a, b)[:, None]) | ~(sc > 0)
    if first_dropped:
      excluded[:, 0] = True
    if groups is not None:
      excluded |= _share(groups[got], groups[a:b, None])
    order = np.argsort(excluded, axis=1, kind="stable")[:, :keep]
    gone = np.take_along_axis(excluded, order, axis=1)
    ids[a:b, :keep] = np.where(gone, -1, np.take_along_axis(got, order, axis=1))
    scores[a:b, :keep] = np.where(gone, -np.inf, np.take_along_axis(sc, order, axis=1))
  timing.update(index_s=round(t1 - t0, 3), compile_s=round(t2 - t1, 3),
                retrieve_s=round(time.perf_counter() - t2, 3))
  return ids, scores


def _lucene_candidates(retriever, lut: np.ndarray, queries: list[np.ndarray], got: np.ndarray, sc: np.ndarray,
                       k: int) -> tuple[np.ndarray, np.ndarray]:
  """bm25s's hits `got` [n, m > k] rescored as Lucene scores them (`lucene.lucene_scores`), with every document
  where bm25s's m hits may have left out one that Lucene ranks among the top k: where the m-th hit scores
  within float32 error of the k-th (a tie across the cut goes to the lower id as a string in Anserini's
  search, to any in bm25s),
  the query's scores for every document that holds one of its terms, ([n, m'] ids, [n, m'] scores; -1 / -inf
  pad)."""
  from trime_jax.batching.lucene import lucene_scores, matching_documents

  exact = [lucene_scores(retriever, lut[q], g) for q, g in zip(queries, got)]
  n_docs = retriever.scores["num_docs"]
  rows = []
  for q, g, e, approx in zip(queries, got, exact, sc):
    kth = np.sort(e)[::-1][k - 1] if len(e) >= k else -np.inf
    if len(q) and len(g) < n_docs and approx[-1] >= kth - 1e-4 * max(abs(kth), 1.0):  # the cut may split a tie
      g = matching_documents(retriever, lut[q])
      e = lucene_scores(retriever, lut[q], g)
    rows.append((g, e))
  width = max(len(g) for g, _ in rows)
  ids = np.full((len(rows), width), -1, np.int64)
  scores = np.full((len(rows), width), -np.inf, np.float32)
  for r, (g, e) in enumerate(rows):
    ids[r, :len(g)], scores[r, :len(g)] = g, e
  return ids, scores


def _lucene_hits(got: np.ndarray, sc: np.ndarray, k: int, name_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The top k of the candidate hits (`got`, `sc` [n, >= k]) as the original's Pyserini search returned them:
  Anserini asks Lucene for the k best by score, equal scores sorted by the id field as a string (`name_rank`: each
  document's place in that order; "10" before "9"), and returns them in that order (its ScoreTiesAdjusterReranker
  rounds and perturbs the scores it reports, not the order). Hits of score 0 (none in Lucene) are kept here."""
  tie = np.where(got < 0, np.iinfo(np.int64).max, name_rank[np.maximum(got, 0)])
  top = np.lexsort((tie, -sc.astype(np.float64)), axis=-1)[:, :k]
  return np.take_along_axis(got, top, 1), np.take_along_axis(sc, top, 1)


def pack(neighbours_Sxk: np.ndarray, seed: int, *, groups: np.ndarray | None = None,
         batch_size: int = 0) -> np.ndarray:
  """Algorithm 1: an order [S] over all segments, each exactly once.

  From the current segment, go to its best neighbour not used yet; if there is none, to a random unused
  segment (the next unused entry of a seeded permutation, i.e. uniform over the unused ones).

  With `groups` ([S], or [S, 2] document ranges: `document_ranges`) and `batch_size`, a segment is also skipped
  while one of its documents already has a segment in the batch being filled (positions cut every
  `batch_size`), so batch-mates come from other documents wherever the corpus allows it.
  """
  s = len(neighbours_Sxk)
  ranges = None if groups is None else _ranges(groups)
  docs_of = (lambda y: range(int(ranges[y, 0]), int(ranges[y, 1]) + 1)) if groups is not None else None
  perm = np.random.default_rng([seed, 23]).permutation(s)
  nbrs = np.asarray(neighbours_Sxk)
  used = np.zeros(s, bool)
  in_batch: set = set()
  order = np.empty(s, np.int64)
  p = 0  # perm[:p] are all used
  c = None

  def free(y):
    return not used[y] and (groups is None or not any(d in in_batch for d in docs_of(y)))

  for i in range(s):
    if c is None:
      while used[perm[p]]:
        p += 1
      # The first unused entry of the permutation whose group is not in the batch yet (else the first unused);
      # entries skipped over stay available.
      j = p
      while j < s and not free(perm[j]):
        j += 1
      c = int(perm[j] if j < s else perm[p])
    used[c] = True
    order[i] = c
    if groups is not None:
      if batch_size and (i + 1) % batch_size == 0:
        in_batch.clear()  # the next segment opens a new batch: cleared before its neighbour is chosen
      else:
        in_batch.update(docs_of(c))
    c = next((y for y in nbrs[c].tolist() if y >= 0 and free(y)), None)
  return order


def to_batches(order: np.ndarray, batch_size: int) -> np.ndarray:
  """Cut an order into rows of `batch_size` [ceil(S / B), B]; the last row is padded with -1."""
  nb = -(-len(order) // batch_size)
  out = np.full(nb * batch_size, -1, np.int64)
  out[:len(order)] = order
  return out.reshape(nb, batch_size)


def neighbour_in_batch(batches_NxB: np.ndarray, neighbours_Sxk: np.ndarray) -> float:
  """Mean over segments of the fraction of their (existing) top-k neighbours that sit in the same batch."""
  s = len(neighbours_Sxk)
  batch_of = np.full(s, -1, np.int64)
  rows = np.repeat(np.arange(batches_NxB.shape[0]), batches_NxB.shape[1])
  flat = batches_NxB.reshape(-1)
  batch_of[flat[flat >= 0]] = rows[flat >= 0]
  valid = neighbours_Sxk >= 0
  same = valid & (batch_of[np.where(valid, neighbours_Sxk, 0)] == batch_of[:, None])
  return float(np.mean(same.sum(1) / np.maximum(valid.sum(1), 1)))


def same_document_pairs(batches_NxB: np.ndarray, doc_S: np.ndarray) -> float:
  """Fraction of ordered pairs of real rows in a batch that share a document: `doc_S` [S] (one document per
  segment) or [S, 2] document ranges (`document_ranges`: a stream segment holding the end of one document and
  the start of the next shares both)."""
  ranges = _ranges(doc_S)
  same = pairs = 0
  for row in batches_NxB:
    r = ranges[row[row >= 0]]
    same += int(_share(r[:, None], r[None, :]).sum()) - len(r)
    pairs += len(r) * (len(r) - 1)
  return same / max(pairs, 1)


def neighbour_settings(config) -> dict:
  """What a BM25 plan's neighbours depend on in the config, as its header records them: `k`
  (trime.bm25_k, else the paper's 20), `exclude_same_document` (trime.bm25_exclude_same_document, else
  False), BM25's `bm25_k1`, `bm25_b` (trime.bm25_k1 / bm25_b, else the original's 0.9 / 0.4) and `bm25_analyzer`
  (trime.bm25_analyzer, else the original's "english"). make_plan writes them, make_batches compares them before
  planning, training refuses a plan of others (k1 / b / analyzer where the plan records them: plans of before
  2026-12-07 / 2026-12-08 do not, and are warned about)."""
  t = config.trime
  return {"k": int(t.get("bm25_k", DEFAULT_K)),
          "exclude_same_document": bool(t.get("bm25_exclude_same_document", False)),
          "bm25_k1": float(t.get("bm25_k1", DEFAULT_K1)), "bm25_b": float(t.get("bm25_b", DEFAULT_B)),
          "bm25_analyzer": str(t.get("bm25_analyzer", ANALYZERS[0]))}


def check_analyzer(analyzer, where: str = "trime") -> None:
  """ConfigError unless `analyzer` is one of ANALYZERS."""
  if analyzer not in ANALYZERS:
    raise ConfigError(f"{where}.bm25_analyzer must be one of {ANALYZERS} ('english': Lucene's English analysis "
                      f"of the segments' words, as the original; 'none': their token ids), got {analyzer!r}")


def check_scoring(k1, b, where: str = "trime") -> None:
  """ConfigError unless BM25's k1 >= 0 and b in [0, 1] (bm25s would score anything)."""
  if isinstance(k1, bool) or not isinstance(k1, (int, float)) or not k1 >= 0:
    raise ConfigError(f"{where}.bm25_k1 must be a number >= 0 (the original's: {DEFAULT_K1}), got {k1!r}")
  if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1:
    raise ConfigError(f"{where}.bm25_b must be in [0, 1] (the original's: {DEFAULT_B}), got {b!r}")


# A plan's k counts the query's own hit (see `neighbours`), as the paper's SimSeg and the original's top-20 did.
# Plans made before 2026-12-07 have no such field: their k = 20 were 20 hits besides the segment itself (one
# more candidate per step than the paper). make_batches treats such a plan as another plan (--overwrite makes
# it again); a training reading one is told so and goes on (a run that trained on it resumes on its batches).
HITS_INCLUDE_QUERY = True


def older_rules(header: dict) -> list[str]:
  """How a BM25 plan made before 2026-12-08 differs from the rules above (its header lacks
  `hits_include_query`, `bm25_k1` (2026-12-07) and / or `bm25_analyzer` (2026-12-08)): one phrase per
  difference, [] for a plan made since. The LM plan's
  check and an MT run's reused plan.npz say these to a run that goes on with such a plan."""
  old = []
  if "hits_include_query" not in header:
    old.append(f"its k = {header.get('k')} BM25 neighbours were k hits besides each query (segment or sentence), one more candidate "
               "per step than the paper's SimSeg(I, c, k), which counts the segment's own hit")
  if "bm25_k1" not in header:
    old.append(f"it was scored at bm25s's k1 = 1.5, b = 0.75 (the original's: {DEFAULT_K1}, {DEFAULT_B})")
  if "bm25_analyzer" not in header:
    old.append("it searched target token ids with bm25s's exact lengths and order, not as the original's Lucene "
               "search (Lucene's English analysis of the words, one-byte lengths, Anserini's order)")
  return old


# With the exclusion, what "the same document" means, recorded in a plan's header: every document a segment's
# targets touch. Plans made before 2026-12-06 have no such field: they keyed a segment on its first target's
# document only, so a stream segment holding the start of a document could be batched with that document's
# segments. make_batches treats such a plan as another plan (--overwrite makes it again); a training reading one
# is told so and goes on (a run that trained on it resumes on its batches).
EXCLUDE_BY = "documents_touched"


def old_exclusion_rule(header: dict) -> bool:
  """A same-document-exclusion plan made with the rule of before 2026-12-06 (see EXCLUDE_BY)."""
  return bool(header.get("exclude_same_document")) and header.get("exclude_by") != EXCLUDE_BY


def make_plan(corpus: data.Corpus, config, *, progress: bool = True, k: int | None = None,
              backend: str = "numba"):
  """(header, batches [ceil(S / B), B] int64) for `trime.batching="bm25"` (see `batching/plan.py`).

  k defaults to `config.trime.bm25_k` when the config has that field, else 20 (the paper's value).
  """
  seg_len, mode = int(config.data.segment_len), config.data.segmentation
  batch_size, seed = int(config.train.batch_size), int(config.train.seed)
  settings = neighbour_settings(config)
  k = int(k if k is not None else settings["k"])
  check_scoring(settings["bm25_k1"], settings["bm25_b"])
  check_analyzer(settings["bm25_analyzer"])
  if k < 1:
    raise ConfigError(f"BM25 batching needs k >= 1 neighbours, got {k}")
  if batch_size < 1:
    raise ConfigError(f"train.batch_size must be >= 1, got {batch_size}")
  segments = data.make_segments(corpus, seg_len, mode)
  analyzer = settings["bm25_analyzer"]
  t0 = time.perf_counter()
  docs = segment_terms(corpus, segments) if analyzer == "english" else segment_token_ids(corpus, segments)
  timing = {"analysis_s": round(time.perf_counter() - t0, 3)}
  # Default: Algorithm 1 as published. Optionally neighbours come from other documents only, like the test
  # datastore (on short documents most BM25 neighbours are the same article: see the module docstring).
  exclude_same = settings["exclude_same_document"]
  ranges = document_ranges(corpus, segments)  # every document a segment's targets touch (stream segments cross)
  nbrs, _ = neighbours(docs, k, backend=backend, progress=progress, timing=timing,
                       groups=ranges if exclude_same else None, hits_include_query=HITS_INCLUDE_QUERY,
                       k1=settings["bm25_k1"], b=settings["bm25_b"], lucene=True)
  t0 = time.perf_counter()
  order = pack(nbrs, seed, groups=ranges if exclude_same else None, batch_size=batch_size)
  batches = to_batches(order, batch_size)
  timing["pack_s"] = round(time.perf_counter() - t0, 3)
  # Throughput of indexing + retrieval + packing; the one-off numba compile is reported apart.
  work = timing["analysis_s"] + timing.get("index_s", 0) + timing.get("retrieve_s", 0) + timing["pack_s"]
  timing["segments_per_s"] = round(len(segments) / max(work, 1e-9), 1)
  random_batches = to_batches(np.random.default_rng([seed, 29]).permutation(len(segments)), batch_size)
  header = {
      "kind": "bm25",
      "corpus_fingerprint": corpus.fingerprint(),
      "corpus_name": corpus.name,  # e.g. "wikitext_mini:train": what the fingerprint is of
      "segment_len": seg_len,
      "segmentation": mode,
      "batch_size": batch_size,
      "consecutive_segments": 1,
      "seed": seed,
      "shuffle": True,  # every epoch (the first included) visits the batches in a seeded permutation
      "k": k,
      "hits_include_query": HITS_INCLUDE_QUERY,  # k counts the segment's own hit (SimSeg(I, c, k) ranks c)
      "bm25_k1": settings["bm25_k1"], "bm25_b": settings["bm25_b"],
      # what each segment's BM25 document is ("english": Lucene's terms of its input words; "none": its target
      # ids), searched as the original's Pyserini search (Lucene's one-byte lengths, Anserini's order)
      "bm25_analyzer": analyzer, "bm25_search": "lucene",
      "exclude_same_document": exclude_same,
      **({"exclude_by": EXCLUDE_BY} if exclude_same else {}),
      "same_document_pairs": same_document_pairs(batches, ranges),
      "same_document_pairs_random": same_document_pairs(random_batches, ranges),
      "num_segments": len(segments),
      "padding_rows": int((batches < 0).sum()),
      "last_batch": "padded with -1 rows",
      "neighbour_in_batch": neighbour_in_batch(batches, nbrs),
      "neighbour_in_batch_random": neighbour_in_batch(random_batches, nbrs),
      "timing": timing,
  }
  if progress:
    print(f"bm25: {len(segments):,} segments, {len(batches):,} batches of {batch_size}, "
          f"{timing['segments_per_s']:,.0f} segments/s (+{timing.get('compile_s', 0):.1f} s numba compile); "
          f"neighbours (of the top-{k} hits) in the same batch: "
          f"{header['neighbour_in_batch']:.1%} (random batches: {header['neighbour_in_batch_random']:.1%}); "
          f"same-document pairs {header['same_document_pairs']:.1%} (random {header['same_document_pairs_random']:.1%})",
          flush=True)
  return header, batches
