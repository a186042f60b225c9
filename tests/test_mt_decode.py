"""Decoding for translation: beam search vs exhaustive search, the kNN-MT and TrimeMT_ext distributions vs
float64 NumPy, BLEU, and an end-to-end tiny run (datastore, translate with every mode)."""

import itertools
import math
import zlib

import os

import jax.numpy as jnp
import numpy as np
import pytest

from trime_jax.mt import decode
from trime_jax import specs
from trime_jax.errors import ConfigError

PAD, EOS, V = 0, 1, 5  # toy vocabulary: pad, eos and three words


def toy_log_probs(sentence: int, prefix: tuple) -> np.ndarray:
  """A deterministic next-token law of (sentence, prefix): a fixed random softmax per context."""
  rng = np.random.default_rng(zlib.crc32(repr((sentence, prefix)).encode()))
  x = rng.normal(0, 2.0, V)
  return x - np.logaddexp.reduce(x)


def toy_callback(beam: int, calls=None):
  last = {}

  def next_log_probs(prev_NxT, step, live_N, parents_N):
    assert prev_NxT.shape[1] >= step + 1 and (prev_NxT[:, 0] == EOS).all() and live_N.shape == (len(prev_NxT),)
    assert live_N.any()  # called only while some sentence is unfinished
    # parents: each row extends its parent's prefix of the previous call, within its own sentence
    rows = np.arange(len(prev_NxT))
    assert (parents_N // beam == rows // beam).all()
    if step == 0:
      np.testing.assert_array_equal(parents_N, rows)
    else:
      np.testing.assert_array_equal(prev_NxT[:, :step], last["prev"][parents_N, :step])
    last["prev"] = prev_NxT.copy()
    if calls is not None:
      calls.append(live_N.copy())
    return np.stack([toy_log_probs(r // beam, tuple(int(t) for t in row[1:step + 1]))
                     for r, row in enumerate(prev_NxT)]).astype(np.float32)
  return next_log_probs


def exhaustive(sentence: int, max_len: int, lenpen: float):
  """(tokens, score) of the best sequence of 1..max_len words + eos (pad never, eos only at the end)."""
  best = (None, -np.inf)
  words = [w for w in range(V) if w not in (PAD, EOS)]
  for n in range(1, max_len + 1):
    for seq in itertools.product(words, repeat=n):
      lp = sum(float(np.float32(toy_log_probs(sentence, seq[:i])[seq[i]])) for i in range(n))
      lp += float(np.float32(toy_log_probs(sentence, seq)[EOS]))
      score = lp / (n + 1) ** lenpen
      if score > best[1]:
        best = (list(seq), score)
  return best


@pytest.mark.parametrize("lenpen", [0.0, 1.0, 2.0])
def test_beam_search_equals_exhaustive_search(lenpen):
  # 3 words, up to 3 of them: 39 sequences, 27 prefixes of length 3: a beam of 64 keeps every prefix and
  # finishes every sequence, so beam search must return the exhaustive optimum (scores, lengths, eos forcing).
  src_lens = [3, 2, 4, 1]
  opts = decode.SearchOptions(beam=64, lenpen=lenpen, max_len_a=0.0, max_len_b=3)
  hyps = decode.beam_search(toy_callback(64), src_lens, opts, pad_id=PAD, eos_id=EOS, vocab_size=V)
  for s, h in enumerate(hyps):
    tokens, score = exhaustive(s, 3, lenpen)
    assert h.tokens == tokens
    assert h.score == pytest.approx(score, abs=1e-9)


def test_max_len_a_b_per_sentence():
  opts = decode.SearchOptions(beam=64, lenpen=1.0, max_len_a=1.0, max_len_b=1)
  src_lens = [1, 2]  # max_len 2 and 3
  hyps = decode.beam_search(toy_callback(64), src_lens, opts, pad_id=PAD, eos_id=EOS, vocab_size=V)
  for s, (h, n) in enumerate(zip(hyps, [2, 3])):
    assert h.tokens == exhaustive(s, n, 1.0)[0] and len(h.tokens) <= n


def test_greedy_equals_beam_one_and_small_beam_prunes():
  src_lens = list(range(1, 9))
  opts = decode.SearchOptions(beam=1, max_len_b=4)
  g = decode.greedy(toy_callback(1), src_lens, opts, pad_id=PAD, eos_id=EOS, vocab_size=V)
  b1 = decode.beam_search(toy_callback(1), src_lens, opts, pad_id=PAD, eos_id=EOS, vocab_size=V)
  assert [h.tokens for h in g] == [h.tokens for h in b1]
  np.testing.assert_allclose([h.score for h in g], [h.score for h in b1], atol=1e-9)
  assert all(h.tokens and PAD not in h.tokens and EOS not in h.tokens for h in g)  # min_len 1, no pad
  # beam 4 never beats the exhaustive optimum, and finds a better hypothesis than greedy for some sentence
  calls = []
  b4 = decode.beam_search(toy_callback(4, calls), src_lens, decode.SearchOptions(beam=4, max_len_b=4), pad_id=PAD,
                          eos_id=EOS, vocab_size=V)
  # rows stop being live once their sentence is finished (sentences finish at different steps), never revive
  live = np.stack(calls).reshape(len(calls), len(src_lens), 4).any(-1)
  assert live[0].all() and not live[-1].all() and (live[1:] <= live[:-1]).all()
  best = [exhaustive(s, 4, 1.0)[1] for s in range(len(src_lens))]
  assert all(h4.score <= sb + 1e-9 for h4, sb in zip(b4, best))
  assert any(h4.score > h1.score + 1e-6 for h4, h1 in zip(b4, g))


# ----------------------------------------------------------------------------------------------------------
# Distributions vs float64 NumPy over a small datastore
# ----------------------------------------------------------------------------------------------------------
def _small_case(seed=0, n=3, k=6, d=8, v=7, store=20):
  rng = np.random.default_rng(seed)
  store_keys = rng.normal(0, 1.0, (store, d))
  store_values = rng.integers(0, v, store)
  q = rng.normal(0, 1.0, (n, d))
  logits = rng.normal(0, 2.0, (n, v))
  ids = np.stack([rng.choice(store, k, replace=False) for _ in range(n)])
  ids[0, -2:] = -1  # row 0 found only k - 2 entries
  ids[2, :] = -1  # row 2 found none
  keys = np.where(ids[..., None] >= 0, store_keys[np.maximum(ids, 0)], 0.0)
  targets = np.where(ids >= 0, store_values[np.maximum(ids, 0)], -1)
  return logits, q, keys, targets, ids


def _np_log_softmax(x):
  return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def _np_mem(scores_K, targets_K, v):
  """log p(w) ∝ Σ_{x_j = w} exp(score_j) over the valid entries (float64; -inf rows if none)."""
  out = np.full(v, -np.inf)
  for s, t in zip(scores_K, targets_K):
    if t >= 0:
      out[t] = np.logaddexp(out[t], s)
  return out - np.logaddexp.reduce(out)


@pytest.mark.parametrize("lam,temp", [(0.3, 2.0), (0.8, 10.0), (0.0, 2.0), (1.0, 2.0)])  # λ 0 / 1: the ends
def test_knn_mt_distribution_matches_float64(lam, temp):
  logits, q, keys, targets, _ = _small_case()
  got = np.asarray(decode.knn_mt_log_probs(logits, q, keys, targets, knn_mt_temperature=temp, knn_lambda=lam), np.float64)
  for r in range(len(q)):
    p_model = np.exp(_np_log_softmax(logits[r]))
    if (targets[r] >= 0).any():
      dist = ((q[r][None] - keys[r]) ** 2).sum(-1)
      p = (1 - lam) * p_model + lam * np.exp(_np_mem(-dist / temp, targets[r], logits.shape[1]))
    else:
      p = p_model  # no neighbours: the model alone
    with np.errstate(divide="ignore"):  # λ = 1: p_kNN alone, 0 off the retrieved tokens
      np.testing.assert_allclose(got[r], np.log(p), rtol=2e-5, atol=1e-6)
    assert np.exp(got[r]).sum() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("tau,lam,tau_prime", [(1.0, 0.0, 1.0), (0.5, 0.25, 2.0)])
def test_trime_mt_distribution_matches_float64(tau, lam, tau_prime):
  logits, q, keys, targets, _ = _small_case(seed=1)
  d, v = q.shape[1], logits.shape[1]
  got = np.asarray(decode.trime_log_probs(logits, q, keys, targets, tau=tau, knn_lambda=lam,
                                          tau_prime=tau_prime), np.float64)
  for r in range(len(q)):
    sim = (keys[r] @ q[r]) / math.sqrt(d)
    weights = np.exp(logits[r]).copy()
    for s, t in zip(sim, targets[r]):
      if t >= 0:
        weights[t] += np.exp(s / tau)
    p = weights / weights.sum()
    if lam and (targets[r] >= 0).any():
      p = (1 - lam) * p + lam * np.exp(_np_mem(sim / tau_prime, targets[r], v))
    np.testing.assert_allclose(np.exp(got[r]), p, rtol=2e-5, atol=1e-7)
  # the memories matter where there are some, and row 2 (none retrieved) is the model alone
  assert np.abs(got[0] - _np_log_softmax(logits[0])).max() > 1e-2
  np.testing.assert_allclose(got[2], _np_log_softmax(logits[2]), atol=1e-5)


@pytest.mark.parametrize("tau", [1.0, 15.0])
def test_release_trime_distribution_is_the_release_decoders(tau):
  """mode trime_release = the release's decoder, restated in float64 from its code (machine_translation/fairseq/
  models/transformer.py, knn_lambda_type='trime': λ = exp(lse(dists / (t·√d)) - lse(lse(logits), lse(dists /
  (t·√d)))); get_normalized_probs: p_net·(1 - λ) + knn_probs, knn_probs the softmax of the K scores scattered
  onto their tokens): its mass is 2 - λ, not 1 (found by a review; the paper's law is `trime_log_probs`)."""
  logits, q, keys, targets, _ = _small_case(seed=2)
  d, v = q.shape[1], logits.shape[1]
  got = np.asarray(decode.release_trime_log_probs(logits, q, keys, targets, tau=tau), np.float64)
  paper = np.asarray(decode.trime_log_probs(logits, q, keys, targets, tau=tau), np.float64)
  for r in range(len(q)):
    p_net = np.exp(_np_log_softmax(logits[r]))
    ok = targets[r] >= 0
    if not ok.any():
      np.testing.assert_allclose(got[r], np.log(p_net), atol=1e-5)  # nothing retrieved: the model alone
      continue
    dists = (keys[r][ok] @ q[r]) / (tau * math.sqrt(d))
    norm_t, norm_c = np.logaddexp.reduce(logits[r]), np.logaddexp.reduce(dists)
    lam = math.exp(norm_c - np.logaddexp(norm_t, norm_c))
    knn_probs = np.zeros(v)
    np.add.at(knn_probs, targets[r][ok], np.exp(dists - norm_c))
    want = p_net * (1 - lam) + knn_probs
    np.testing.assert_allclose(np.exp(got[r]), want, rtol=2e-5, atol=1e-7)
    assert np.exp(got[r]).sum() == pytest.approx(2 - lam, rel=1e-5)
    # the paper's law is the same vocabulary term with λ·knn_probs
    np.testing.assert_allclose(np.exp(paper[r]), p_net * (1 - lam) + lam * knn_probs, rtol=2e-5, atol=1e-7)
  with pytest.raises(ConfigError, match="no interpolation"):
    decode.Distribution("trime_release", knn_lambda=0.3)


def test_release_law_tuning_nll_is_its_normalised_distribution():
  """The tuner's nll for trime_release (one K, each τ) = the mean over tokens of -log(P(target) / (2 - λ)),
  P = `release_trime_log_probs` from the same scores."""
  from trime_jax import scoring
  from trime_jax.mt.decode import tuning

  logits, q, keys, targets, ids = _small_case(seed=3, n=5)
  d = q.shape[1]
  gold = np.asarray([int(t[0]) if t[0] >= 0 else 1 for t in targets])  # a retrieved token where there is one
  score = np.where(ids >= 0, np.einsum("nkd,nd->nk", keys, q), -np.inf).astype(np.float32)
  stats = scoring.vocab_stats(jnp.asarray(logits, jnp.float32), jnp.asarray(gold))
  empty = decode.Neighbours(np.zeros((5, 0), np.int64), np.zeros((5, 0), np.int32), np.zeros((5, 0), np.float32))
  tp = tuning.TunePass(stats, gold, decode.Neighbours(ids, targets.astype(np.int32), score), empty, d)
  taus = [0.5, 2.0]
  got = tuning._release_nlls(tp, taus, k=ids.shape[1])
  for tau, g in zip(taus, got):
    lp = np.asarray(decode.release_trime_log_probs(logits, q, keys, targets, tau=tau), np.float64)
    mass = np.exp(lp).sum(-1)
    want = -(lp[np.arange(5), gold] - np.log(mass)).mean()
    assert g == pytest.approx(want, rel=1e-4)


def test_bleu_copy_is_100_and_a_known_case():
  from trime_jax.mt import bleu

  refs = ["Cannot open file %s", "the cat is on the mat", "hello there world"]
  assert bleu.corpus_bleu(refs, refs)["bleu"] == pytest.approx(100.0)
  # 1-4-gram precisions 7/8, 3/6, 1/4, and 0/3 smoothed ('exp': 1/(2·3)); brevity penalty exp(1 - 9/8)
  got = bleu.corpus_bleu(["the cat sat on the mat", "hello world"], ["the cat is on the mat", "hello there world"])
  want = 100 * math.exp(1 - 9 / 8) * (7 / 8 * 3 / 6 * 1 / 4 * 1 / 6) ** 0.25
  assert got["bleu"] == pytest.approx(want, rel=1e-9)


# ----------------------------------------------------------------------------------------------------------
# End to end: a tiny export, its datastore and index, translation with every mode
# ----------------------------------------------------------------------------------------------------------
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  import ml_collections
  from flax import nnx

  from trime_jax.datastore import build_index
  from trime_jax.mt import data as mt_data
  from trime_jax.mt import datastore as mt_datastore
  from trime_jax.mt import model as mt_model
  from trime_jax.mt import export as mt_export

  root = tmp_path_factory.mktemp("mt")
  vocab = mt_data.SubwordVocab(tokens=list(mt_data.SPECIALS) + WORDS)
  rng = np.random.default_rng(0)
  lines = [" ".join(rng.choice(WORDS, rng.integers(2, 6))) for _ in range(24)]
  pairs = lambda lo, hi, split: mt_data.ParallelData(
      [vocab.encode(l) for l in lines[lo:hi]], [vocab.encode(" ".join(reversed(l.split()))) for l in lines[lo:hi]],
      lines[lo:hi], [" ".join(reversed(l.split())) for l in lines[lo:hi]], vocab, split)
  data_dir = root / "data"
  data_dir.mkdir()
  for split, (lo, hi) in {"train": (0, 20), "valid": (16, 20), "test": (20, 24)}.items():
    (data_dir / f"{split}.de").write_text("".join(l + "\n" for l in lines[lo:hi]))
    (data_dir / f"{split}.en").write_text("".join(" ".join(reversed(l.split())) + "\n" for l in lines[lo:hi]))
  config = ml_collections.ConfigDict({"task": "mt", "data": {
      "format": "fairseq", "path": str(data_dir), "src_lang": "de", "tgt_lang": "en", "max_len": 0}, "model": {
      "d_model": 16, "num_heads": 2, "d_ff": 32, "encoder_layers": 1, "decoder_layers": 2, "dropout": 0.0,
      "max_len": 64, "share_all_embeddings": True, "decoder_normalize_before": True}})

  def export(seed, name):
    model = mt_model.build_mt_model(specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size), seed)
    return mt_export.export_mt(str(root / name), nnx.split(model, nnx.Param)[1], config, vocab)

  ckpt_dir, other = export(0, "export"), export(1, "other")
  train = pairs(0, 20, "train")
  meta = mt_datastore.build_mt_datastore(ckpt_dir, train, str(root / "ds"), batch_tokens=64, progress=False)
  from trime_jax.datastore import Datastore

  build_index(Datastore(str(root / "ds")), kind="flat", progress=False)
  return dict(root=root, vocab=vocab, config=config, ckpt=ckpt_dir, other=other, train=train,
              test=pairs(20, 24, "test"), meta=meta, ds_dir=str(root / "ds"))


def test_cached_decoding_equals_full_prefix_decoding(tiny):
  """decode_step over a key/value cache, with rows reordered to random parents at each step (as beam search
  does), gives the f and g of `decode` over each row's whole prefix."""
  import jax.numpy as jnp
  from flax import nnx

  from trime_jax.mt import export as mt_export

  graphdef, params, config, vocab = mt_export.load_mt_export(tiny["ckpt"])
  model = nnx.merge(graphdef, params)
  rng = np.random.default_rng(5)
  beam, b, steps = 3, 2, 7
  src = np.zeros((b * beam, 6), np.int32)
  for s in range(b):  # sources of different lengths (padding in the cross-attention mask)
    n = 3 + 2 * s
    src[s * beam:(s + 1) * beam, :n] = rng.integers(4, vocab.size, n)
    src[s * beam:(s + 1) * beam, n] = vocab.eos_id
  src = jnp.asarray(src)
  enc = model.encode(src)
  cache = model.init_decode_cache(enc, 16)
  prefix = np.full((b * beam, 1), vocab.eos_id, np.int32)
  for step in range(steps):
    parents = np.arange(b * beam) if step == 0 else (
        np.repeat(np.arange(b) * beam, beam) + rng.integers(0, beam, b * beam))
    prefix = prefix[parents]
    cache = {"self": [(jnp.take(k, parents, 0), jnp.take(v, parents, 0)) for k, v in cache["self"]],
             "cross": cache["cross"]}
    f, g, cache = model.decode_step(cache, src, jnp.asarray(prefix[:, step]), jnp.asarray(step))
    f_full, g_full = model.decode(enc, src, jnp.asarray(prefix))
    np.testing.assert_allclose(np.asarray(f), np.asarray(f_full[:, step]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_full[:, step]), rtol=1e-4, atol=1e-5)
    prefix = np.concatenate([prefix, rng.integers(4, vocab.size, (b * beam, 1)).astype(np.int32)], 1)


def test_mt_datastore_holds_teacher_forced_keys_and_refuses_another_model(tiny):
  from trime_jax.errors import CheckpointError
  from trime_jax.mt import data as mt_data
  from trime_jax.mt import datastore as mt_datastore
  from trime_jax.mt import export as mt_export

  ds, index = mt_datastore.open_mt_datastore(tiny["ds_dir"], tiny["ckpt"])
  train = tiny["train"]
  want_values = np.concatenate([np.append(y, mt_data.EOS) for y in train.tgt])
  np.testing.assert_array_equal(np.asarray(ds.values), want_values)
  assert ds.count == tiny["meta"]["count"] == sum(len(y) + 1 for y in train.tgt)
  # keys: the decoder's g over [eos] + y with its source, in pair order (one batch of other shapes than the
  # builder's length-sorted batches: padding must not matter)
  graphdef, params, _, _ = mt_export.load_mt_export(tiny["ckpt"])
  b = mt_data.collate(train.src, train.tgt, 12, 12)
  _, g = mt_datastore.forced_forward(graphdef, params, b["src"], b["prev"])
  want_keys = np.asarray(g)[b["targets"] >= 0]  # row-major: pair by pair, position by position
  np.testing.assert_allclose(np.asarray(ds.keys, np.float32), want_keys, rtol=2e-3, atol=2e-3)
  with pytest.raises(CheckpointError, match="another model"):
    mt_datastore.open_mt_datastore(tiny["ds_dir"], tiny["other"])
  with pytest.raises(CheckpointError, match="different datastore"):  # same directory, another checkpoint
    mt_datastore.build_mt_datastore(tiny["other"], train, tiny["ds_dir"], progress=False)


def test_mt_datastore_build_resumes_after_an_interruption(tiny, tmp_path, monkeypatch):
  from trime_jax.datastore import Datastore
  from trime_jax.mt import datastore as mt_datastore

  monkeypatch.setattr(mt_datastore, "CHUNK_BATCHES", 1)
  out = str(tmp_path / "ds")
  meta = mt_datastore.build_mt_datastore(tiny["ckpt"], tiny["train"], out, batch_tokens=32, max_chunks=2,
                                         progress=False)
  assert not meta["complete"] and meta["batches_done"] == 2 and 0 < meta["tokens_done"] < tiny["meta"]["count"]
  with pytest.raises(Exception, match="not complete|incomplete"):
    Datastore(out)  # an interrupted build is never read as a datastore
  # the rerun keeps the stored batch plan (batch_tokens=32), whatever it is asked now
  meta = mt_datastore.build_mt_datastore(tiny["ckpt"], tiny["train"], out, batch_tokens=64, progress=False)
  assert meta["complete"] and meta["tokens_done"] == meta["count"] == tiny["meta"]["count"]
  whole = Datastore(tiny["ds_dir"])
  resumed = Datastore(out)
  np.testing.assert_array_equal(np.asarray(resumed.values), np.asarray(whole.values))
  np.testing.assert_allclose(np.asarray(resumed.keys, np.float32), np.asarray(whole.keys, np.float32), atol=2e-3)


def test_mt_datastore_chunk_damaged_after_a_kill_is_recomputed_not_blessed(tiny, tmp_path, monkeypatch, capsys):
  """Entries of a committed chunk changed between the interruption and the rerun: the rerun finds them by
  the chunk's digest (rows found again from the batch plan), says so in one warning line, and recomputes from
  that chunk, so the finished datastore equals an uninterrupted build's."""
  from trime_jax.datastore import Datastore
  from trime_jax.mt import datastore as mt_datastore

  monkeypatch.setattr(mt_datastore, "CHUNK_BATCHES", 1)
  out = str(tmp_path / "ds")
  meta = mt_datastore.build_mt_datastore(tiny["ckpt"], tiny["train"], out, batch_tokens=32, max_chunks=3,
                                         progress=False)
  assert meta["batches_done"] == 3 and [c["batches"] for c in meta["mt_chunks"]] == [[0, 1], [1, 2], [2, 3]]
  batches = mt_datastore.pair_batches(tiny["train"].src, tiny["train"].tgt, batch_tokens=32)
  counts = np.asarray([len(y) + 1 for y in tiny["train"].tgt], np.int64)
  offsets = np.concatenate([[0], np.cumsum(counts)])
  row = int(mt_datastore._rows_of(batches, offsets, counts, 1, 2)[0])  # an entry of the second chunk
  values = np.load(os.path.join(out, "values.npy"), mmap_mode="r+")
  values[row] = (values[row] + 1) % 7
  values.flush()
  del values
  capsys.readouterr()
  meta = mt_datastore.build_mt_datastore(tiny["ckpt"], tiny["train"], out, batch_tokens=32, progress=False)
  lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
  assert len(lines) == 1 and "batches 1..2 were changed" in lines[0], lines
  assert meta["complete"] and "mt_chunks" not in meta
  np.testing.assert_array_equal(np.asarray(Datastore(out).values), np.asarray(Datastore(tiny["ds_dir"]).values))


def test_retrieve_matches_brute_force(tiny):
  from trime_jax.mt import datastore as mt_datastore

  ds, index = mt_datastore.open_mt_datastore(tiny["ds_dir"], tiny["ckpt"])
  keys = np.asarray(ds.keys, np.float64)
  q = np.random.default_rng(3).normal(0, 1, (5, ds.dimension)).astype(np.float32)
  for metric in ("ip", "l2"):
    nb = decode.retrieve(ds, index, q, 7, metric=metric, candidates=ds.count)
    full = q.astype(np.float64) @ keys.T if metric == "ip" else -((q[:, None].astype(np.float64) - keys) ** 2).sum(-1)
    want = -np.sort(-full, axis=1)[:, :7]
    np.testing.assert_allclose(nb.score, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(nb.targets, np.asarray(ds.values)[nb.ids])
    np.testing.assert_allclose(nb.keys, keys[nb.ids], atol=1e-6)


def test_translate_every_mode_and_knn_mt_recalls_training_targets(tiny):
  from trime_jax.mt import bleu
  from trime_jax.mt import datastore as mt_datastore
  from trime_jax.mt import export as mt_export

  graphdef, params, config, vocab = mt_export.load_mt_export(tiny["ckpt"])
  cfg = specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size)
  ds, index = mt_datastore.open_mt_datastore(tiny["ds_dir"], tiny["ckpt"])
  train, test = tiny["train"], tiny["test"]
  opts = decode.SearchOptions(beam=4, max_len_a=1.0, max_len_b=5)
  results = {}
  for dist in [decode.Distribution("model"), decode.Distribution("knn_mt", k=4, knn_mt_temperature=1.0, knn_lambda=0.3),
               decode.Distribution("trime", k=4, tau=1.0, knn_lambda=0.3, tau_prime=0.5),
               decode.Distribution("trime_release", k=4, tau=1.0)]:
    tr = decode.Translator(graphdef, params, cfg, dist=dist, datastore=ds, index=index, options=opts,
                           eos_id=vocab.eos_id)
    hyps = tr.translate(test.src, batch_sentences=4)  # the same shapes in every call: one compilation
    assert all(0 < len(h.tokens) <= len(x) + 1 + 5 for h, x in zip(hyps, test.src))
    assert (tr.search_seconds > 0) == (dist.mode != "model")
    results[dist.mode] = bleu.corpus_bleu([vocab.decode(h.tokens) for h in hyps], test.tgt_text)["bleu"]
  assert all(0 <= b <= 100 + 1e-9 for b in results.values())
  # The training sources' decoder states are the datastore's keys: a kNN-MT dominated by p_kNN at a low
  # temperature translates them exactly as their training targets (the datastore is a translation memory).
  tr = decode.Translator(graphdef, params, cfg, dist=decode.Distribution("knn_mt", k=4, knn_mt_temperature=0.01, knn_lambda=0.99),
                         datastore=ds, index=index, options=opts, eos_id=vocab.eos_id)
  hyps = tr.translate(train.src[:4], batch_sentences=4)
  assert [h.tokens for h in hyps] == [list(y) for y in train.tgt[:4]]
  out = [vocab.decode(h.tokens) for h in hyps]
  assert bleu.corpus_bleu(out, train.tgt_text[:4])["bleu"] == pytest.approx(100.0)


def test_cli_build_datastore_and_translate_tune(tiny):
  import json
  import os
  import subprocess
  import sys

  root, repo = tiny["root"], os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ds2, out = root / "ds_cli", root / "out"
  py = sys.executable
  script = (f"{py} -m trime_jax.launch.build_datastore --checkpoint={tiny['ckpt']} --out={ds2} --index=flat && "
            f"{py} -m trime_jax.launch.translate --checkpoint={tiny['ckpt']} --datastore={ds2} --tune --tune_beam=1 "
            f"--beam=2 --max_len_b=8 --out={out}")
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  meta = json.loads((ds2 / "meta.json").read_text())
  assert meta["complete"] and meta["count"] == tiny["meta"]["count"] and meta["task"] == "mt"
  tuned = json.loads((out / "tuned.json").read_text())
  assert set(tuned["chosen"]) == {"model", "knn_mt", "trime", "trime_interp", "trime_release"}
  assert decode.Distribution.from_tuned(str(out / "tuned.json"), "trime_release").mode == "trime_release"
  assert {r["k"] for r in tuned["nll_grid"] if r["mode"] == "knn_mt"} == set(decode.KS)
  # kNN-MT settings decode from the inner-product candidates they were tuned with (16 · max K), not 16 · K:
  # their neighbours, so their valid nll, are the tuned ones (at K = 4 decoding re-ranked 64 candidates, the
  # tuner 1,024)
  assert {r["setting"]["candidates"] for r in tuned["nll_grid"] if r["mode"] == "knn_mt"} == {16 * max(decode.KS)}
  res = json.loads((out / "valid.tune.knn_mt.1.json").read_text())
  assert res["sentences"] == 4 and res["setting"] == tuned["chosen"]["knn_mt"]["setting"]
  assert 0 <= res["bleu"] <= 100 + 1e-9
  assert len((out / "valid.tune.knn_mt.1.hyp").read_text().splitlines()) == 4
  assert decode.Distribution.from_tuned(str(out / "tuned.json"), "knn_mt") == decode.Distribution(
      **tuned["chosen"]["knn_mt"]["setting"])
  # --tune_modes restricts tuning (and its valid decodes) to one family; the model alone is always there
  proc = subprocess.run([py, "-m", "trime_jax.launch.translate", f"--checkpoint={tiny['ckpt']}", f"--datastore={ds2}",
                         "--tune", "--tune_modes=knn_mt", "--tune_beam=1", "--beam=2", "--max_len_b=8",
                         f"--out={root / 'out_knn'}"], capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  only = json.loads((root / "out_knn" / "tuned.json").read_text())
  assert set(only["chosen"]) == {"model", "knn_mt"}
  assert only["chosen"]["model"]["valid_nll"] == pytest.approx(tuned["chosen"]["model"]["valid_nll"], rel=1e-6)
  plain = decode.Distribution.from_tuned(str(out / "tuned.json"), "trime")
  interp = decode.Distribution.from_tuned(str(out / "tuned.json"), "trime_interp")
  assert plain.mode == interp.mode == "trime" and plain.knn_lambda == 0 < interp.knn_lambda
  best = max(("trime", "trime_interp"), key=lambda m: tuned["chosen"][m]["bleu"])
  assert decode.Distribution.from_tuned(str(out / "tuned.json"), "trime_best") == {
      "trime": plain, "trime_interp": interp}[best]
  # what the run would not read is refused before the model loads; another model's tuned.json too
  assert tuned["params_digest"] == json.loads(open(os.path.join(tiny["ckpt"], "meta.json")).read())["params_digest"]
  foreign = root / "foreign_tuned.json"
  foreign.write_text(json.dumps({**tuned, "params_digest": "0123456789abcdef"}))
  (root / "a_file").write_text("x")
  base = [py, "-m", "trime_jax.launch.translate", f"--checkpoint={tiny['ckpt']}", "--beam=2", "--max_len_b=8"]
  for extra, said in [
      ([f"--datastore={ds2}", f"--settings={out / 'tuned.json'}", "--mode=knn_mt", "--k=2", f"--out={root / 'o1'}"],
       "--k: --settings="),
      ([f"--datastore={ds2}", "--tune", "--split=test", f"--out={root / 'o2'}"], "--split: not read by --tune"),
      (["--index=x.faiss", f"--out={root / 'o3'}"], "--index=x.faiss is a datastore's FAISS index: it needs --datastore"),
      # flags the mode does not read: accepted, and recorded in the results as if used, before
      ([f"--datastore={ds2}", "--knn_lambda=0.3", f"--out={root / 'o3b'}"],
       "--datastore, --knn_lambda: not read by --mode=model (the model alone, no datastore)"),
      ([f"--datastore={ds2}", "--mode=knn_mt", "--tau=2", f"--out={root / 'o3c'}"], "--tau: not read by --mode=knn_mt"),
      # the training pairs translated with their own datastore: the advice is another split (it was to build the
      # datastore from train, which it is)
      ([f"--datastore={ds2}", "--mode=knn_mt", "--split=train", f"--out={root / 'o3d'}"],
       "Translate another split (--split=valid or test), or pass --allow_split_overlap"),
      ([f"--out={root / 'a_file'}"], "is a file: give an output folder"),
      ([f"--datastore={ds2}", f"--settings={foreign}", "--mode=knn_mt", f"--out={root / 'o4'}"],
       "was tuned for another model"),
  ]:
    proc = subprocess.run(base + extra, capture_output=True, text=True, cwd=repo, env=env, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: ") and said in lines[-1], (extra, proc.stderr[-2000:])
  # a refused run leaves no empty --out (o4 is refused after --out was made; it stayed, empty)
  assert not any((root / o).exists() for o in ("o1", "o2", "o3", "o3b", "o3c", "o3d", "o4"))
  # a language-model program given a real translation export (its stored config of the MT schema) says so
  proc = subprocess.run([py, "-m", "trime_jax.launch.eval", f"--checkpoint={tiny['ckpt']}"], capture_output=True,
                        text=True, cwd=repo, env=env, timeout=300)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and lines[-1].startswith("error: ") and "is a machine-translation export" in lines[-1], (
      proc.stderr[-2000:])
  # a rerun of the same translation replaces its files; another translation into the same --out is refused
  plain = base + ["--max_sentences=2", f"--out={root / 'o5'}"]
  for extra in ([], []):
    proc = subprocess.run(plain + extra, capture_output=True, text=True, cwd=repo, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
  first = json.loads((root / "o5" / "test.model.beam2.json").read_text())
  proc = subprocess.run(plain + ["--max_len_b=6"], capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and "another translation (max_len_b differ)" in lines[-1] and "--overwrite" in lines[-1], (
      proc.stderr[-2000:])
  # another beam or length penalty than the paper's is in the files' names: the searches sit side by side (the
  # second was refused as another translation)
  proc = subprocess.run(plain + ["--lenpen=0.5"], capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 0 and (root / "o5" / "test.model.beam2.lenpen0.5.hyp").exists(), proc.stderr[-2000:]
  assert json.loads((root / "o5" / "test.model.beam2.json").read_text()) == first  # untouched
  # ... so is one over other data (the split's texts, recorded by digest) or another search of the index
  (root / "o5" / "test.model.beam2.json").write_text(json.dumps({**first, "data_digest": "0123456789abcdef"}))
  proc = subprocess.run(plain, capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 2 and "(data_digest differ)" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
  knn = base + [f"--datastore={ds2}", "--mode=knn_mt", "--k=2", "--max_sentences=2", f"--out={root / 'o8'}"]
  proc = subprocess.run(knn, capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  searched = json.loads((root / "o8" / "test.knn_mt.beam2.json").read_text())
  assert searched["index"]["kind"] == "flat" and "nprobe" not in searched["index"], searched["index"]
  assert searched["data_digest"] == first["data_digest"]
  # an exact index searches every key whatever --nprobe says: the same run (and so is a result of 2026-12-04,
  # which recorded nprobe for it)
  (root / "o8" / "test.knn_mt.beam2.json").write_text(json.dumps({**searched, "index": {**searched["index"], "nprobe": 32}}))
  proc = subprocess.run(knn + ["--nprobe=8"], capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads((root / "o8" / "test.knn_mt.beam2.json").read_text())["index"] == searched["index"]
  # another index file is another run, and the result is left untouched
  moved = {**searched, "index": {**searched["index"], "file_digest": "0123456789abcdef"}}
  (root / "o8" / "test.knn_mt.beam2.json").write_text(json.dumps(moved))
  proc = subprocess.run(knn, capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 2 and "(index differ)" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
  assert json.loads((root / "o8" / "test.knn_mt.beam2.json").read_text()) == moved  # untouched
  # a result written before translate recorded the index and the data: refused as such (it may be another
  # translation), not as one whose index and data "differ"; another setting is still named; --overwrite replaces it
  older = {k: v for k, v in searched.items() if k not in ("index", "data_digest")}
  (root / "o8" / "test.knn_mt.beam2.json").write_text(json.dumps(older))
  proc = subprocess.run(knn, capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  last = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == 2 and "earlier version, which did not record index, data_digest" in last, proc.stderr
  assert json.loads((root / "o8" / "test.knn_mt.beam2.json").read_text()) == older  # untouched
  proc = subprocess.run(knn + ["--max_len_b=6"], capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 2 and "(max_len_b differ)" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
  proc = subprocess.run(knn + ["--overwrite"], capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads((root / "o8" / "test.knn_mt.beam2.json").read_text())["data_digest"] == first["data_digest"]
  # --split=dev is valid (the language models' name for it, as build_datastore reads it for MT)
  proc = subprocess.run(base + ["--max_sentences=2", "--split=dev", f"--out={root / 'o7'}"], capture_output=True,
                        text=True, cwd=repo, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads((root / "o7" / "valid.model.beam2.json").read_text())["split"] == "valid"
  # --tune into an --out holding another model's tuned.json: refused, --overwrite named
  (root / "o6").mkdir()
  (root / "o6" / "tuned.json").write_text(foreign.read_text())
  proc = subprocess.run(base + [f"--datastore={ds2}", "--tune", "--tune_beam=1", f"--out={root / 'o6'}"],
                        capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and "already holds tuned settings of another model" in lines[-1], proc.stderr[-2000:]
  assert "--overwrite" in lines[-1]


def test_tune_replaces_only_the_same_tuning_and_leaves_no_stale_finalists(tiny, tmp_path):
  """A second --tune of the same model and datastore into one --out with other options (modes, search, valid
  pairs) silently replaced tuned.json and left the first tuning's valid.tune.* finalists beside its own (found by
  a walk-through): it is refused unless --overwrite; a rerun of the same tuning, or --overwrite, replaces
  tuned.json and the finalists, and no earlier finalist remains."""
  import json
  import os
  import subprocess
  import sys

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  out = tmp_path / "tune"
  base = [sys.executable, "-m", "trime_jax.launch.translate", f"--checkpoint={tiny['ckpt']}",
          f"--datastore={tiny['ds_dir']}", "--tune", "--tune_beam=1", "--max_len_b=4", f"--out={out}"]
  run = lambda *extra: subprocess.run(base + list(extra), capture_output=True, text=True, cwd=repo, env=env,
                                      timeout=300)
  finalists = lambda: sorted(f for f in os.listdir(out) if f.startswith("valid.tune."))
  r = run("--tune_modes=knn_mt,trime", "--beam=1")
  assert r.returncode == 0, r.stderr[-2000:]
  first, names = (out / "tuned.json").read_text(), finalists()
  assert set(json.loads(first)["chosen"]) == {"model", "knn_mt", "trime", "trime_interp"}
  assert json.loads(first)["tuning"]["beam"] == 1
  r = run("--tune_modes=knn_mt", "--beam=2")  # another tuning: refused, nothing touched
  last = (r.stderr.strip().splitlines() or [""])[-1]
  assert r.returncode == 2 and "another tuning (tune_modes, beam differ)" in last and "--overwrite" in last, r.stderr
  assert (out / "tuned.json").read_text() == first and finalists() == names
  # the same tuning again (modes in another order) replaces it; a finalist of an earlier tuning (as one with
  # --overwrite, or of before tuned.json recorded its tuning, would have left) is removed
  (out / "valid.tune.trime_release.9.json").write_text("{}")
  r = run("--tune_modes=trime,knn_mt", "--beam=1")
  assert r.returncode == 0 and finalists() == names, r.stderr[-2000:]
  assert json.loads((out / "tuned.json").read_text())["tuning"] == json.loads(first)["tuning"]


def test_model_mode_with_settings_refuses_the_datastore_it_does_not_read(tiny, tmp_path):
  """--mode=model --settings=tuned.json --datastore=...: the model alone searched nothing, but its result
  recorded the datastore and index, so the same translation without them (the documented model-alone command)
  into that --out was refused as another one (found by a walk-through). Refused before the model loads, as
  without --settings."""
  import json
  import os
  import subprocess
  import sys

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  settings = tmp_path / "tuned.json"
  settings.write_text(json.dumps({"chosen": {"model": {"setting": {"mode": "model"}}}}))
  r = subprocess.run([sys.executable, "-m", "trime_jax.launch.translate", f"--checkpoint={tiny['ckpt']}",
                      f"--datastore={tiny['ds_dir']}", f"--settings={settings}", "--mode=model", "--nprobe=8",
                      f"--out={tmp_path / 'o'}"], capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and lines and lines[-1].startswith(
      "error: --datastore, --nprobe: not read by --mode=model (the model alone, no datastore)"), r.stderr[-2000:]
  assert not (tmp_path / "o").exists()


def test_max_sentences_beyond_the_split_is_the_same_translation(tiny, tmp_path):
  """--max_sentences at or above the split's size translates the whole split, as 0 does: the rerun without it
  was refused as "another translation (max_sentences differ)" (found by a walk-through); the pairs translated
  are compared by data_digest, so a real prefix is still another translation."""
  import json
  import os
  import subprocess
  import sys

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  run = lambda *extra: subprocess.run([sys.executable, "-m", "trime_jax.launch.translate",
                                       f"--checkpoint={tiny['ckpt']}", f"--out={tmp_path / 'o'}", "--beam=1",
                                       "--max_len_b=4", *extra], capture_output=True, text=True, cwd=repo, env=env,
                                      timeout=300)
  r = run("--max_sentences=1000")
  assert r.returncode == 0, r.stderr[-2000:]
  first = json.loads((tmp_path / "o" / "test.model.beam1.json").read_text())
  assert first["sentences"] == len(tiny["test"].src) and first["max_sentences"] == 1000
  r = run()
  assert r.returncode == 0, r.stderr[-2000:]
  again = json.loads((tmp_path / "o" / "test.model.beam1.json").read_text())
  assert again["data_digest"] == first["data_digest"] and again["max_sentences"] == 0
  r = run("--max_sentences=1")  # a prefix: other pairs
  assert r.returncode == 2 and "(data_digest differ)" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_translate_holds_its_out_and_checks_it_before_decoding(tiny, tmp_path):
  """Two translations into one --out could leave the .hyp of one and the .json of the other: a second one is
  refused while the first holds --out's lock; an --out that cannot be written is refused before the model loads
  (it decoded the whole split first; found by a review); an empty --out is refused."""
  import os
  import subprocess
  import sys

  from trime_jax.runtime.lock import beside as lock_beside

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  run = lambda out: subprocess.run([sys.executable, "-m", "trime_jax.launch.translate", f"--checkpoint={tiny['ckpt']}",
                                    f"--out={out}", "--beam=1", "--max_len_b=4", "--max_sentences=2"],
                                   capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  out = tmp_path / "held"
  with lock_beside(str(out), "a test's hold"):
    r = run(out)
  assert r.returncode == 2 and "is in use by" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
  assert not (out / "test.model.beam1.json").exists()
  r = run("")
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "error: --out is empty: give the folder to write the translations to"
  (tmp_path / "a_file").write_text("x")  # a folder that cannot be made (as root, permissions would not stop it)
  r = run(tmp_path / "a_file" / "x")
  assert r.returncode == 2 and "cannot create it (Not a directory)" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
  assert run(out).returncode == 0 and (out / "test.model.beam1.json").exists()


def test_config_overrides_other_than_data_are_refused_not_ignored(tiny, tmp_path):
  """translate reads only --config's data settings (the model and TRIME settings are the export's): a
  --config.model.* or --config.trime.* override was accepted and silently ignored (found by a read-through); it is
  one error naming it, before the model loads. A --config.data.* override is read."""
  import os
  import subprocess
  import sys

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-m", "trime_jax.launch.translate", f"--checkpoint={tiny['ckpt']}",
                      f"--config={repo}/configs/ui_de_en.py", "--config.model.dropout=0.5", "--config.trime.tau=2",
                      "--config.data.max_len=64", f"--out={tmp_path / 'o'}"],
                     capture_output=True, text=True, cwd=repo, env=env, timeout=300)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and lines and lines[-1].startswith(
      "error: --config.model.dropout, --config.trime.tau: not read: translate reads only the data settings"), \
      r.stderr[-2000:]
  assert not (tmp_path / "o").exists()
