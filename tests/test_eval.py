"""Evaluation: fairseq-style windows, and every variant (none / local τ / continuous cache) against direct
float64 computations on a tiny random model."""

import math

import numpy as np
import pytest
from flax import nnx

from tests import reference as ref
from trime_jax import data as D
from trime_jax import evaluate
from trime_jax.model import ModelConfig, TransformerLM


@pytest.mark.parametrize("n,block,ctx", [(100, 16, 8), (17, 16, 0), (5, 16, 15), (64, 16, 15)])
def test_windows_score_every_target_once_with_bounded_context(n, block, ctx):
  wins = D.windows(n, block, ctx)
  scored = np.concatenate([np.arange(w.score_start, w.end) for w in wins])
  assert np.array_equal(scored, np.arange(n))
  for w in wins:
    assert w.end - w.start <= block and w.score_start - w.start <= ctx
    assert w.score_start - w.start == min(ctx, w.score_start)  # as much context as is available


def _tiny_model(vocab_size=12, d=8):
  cfg = ModelConfig(vocab_size=vocab_size, num_layers=1, d_model=d, num_heads=2, d_ff=16, max_len=64, dropout=0.0)
  model = TransformerLM(cfg, rngs=nnx.Rngs(3))
  return nnx.split(model, nnx.Param), model


def test_single_window_variants_match_direct_float64_computation():
  rng = np.random.default_rng(0)
  vocab = D.Vocab([f"w{i}" for i in range(12)])
  corpus = D.Corpus.from_docs([rng.integers(0, 4, 30)], vocab)  # few distinct tokens: memory matters
  (graphdef, params), model = _tiny_model()
  taus, cache = (0.7, 1.0), ((0.2, 0.5), (0.05, 2.0))
  points = [evaluate.NONE] + [evaluate.Point("trime_local", tau=t) for t in taus] + [
      evaluate.Point("cache", lam=lam, theta=theta) for lam, theta in cache]
  res = evaluate.evaluate(graphdef, params, corpus, points, block_len=32, context_window=0, streams=2).scores
  assert [r.tokens for r in res] == [30] * 5

  tokens = np.asarray(corpus.tokens)
  inputs = np.concatenate([[vocab.bos], tokens[:-1]])[None]
  logits, keys = (np.asarray(x, np.float64)[0] for x in model(inputs))
  lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
  ce = -lsm[np.arange(30), tokens]
  assert res[0].nll == pytest.approx(ce.mean(), rel=1e-5)
  for r, tau in zip(res[1:3], taus):
    want = ref.trime_nll(logits[None], keys[None], tokens[None], "local", temperature=tau)[0]
    assert r.nll == pytest.approx(want.mean(), rel=1e-5)
  d = keys.shape[-1]
  for r, (lam, theta) in zip(res[3:], cache):
    nll = []
    for t in range(30):
      p_lm = math.exp(lsm[t, tokens[t]])
      if t == 0:
        nll.append(-math.log(p_lm))
        continue
      w = np.exp(theta * keys[:t] @ keys[t] / math.sqrt(d))
      p_cache = w[tokens[:t] == tokens[t]].sum() / w.sum()
      nll.append(-math.log((1 - lam) * p_lm + lam * p_cache))
    assert r.nll == pytest.approx(np.mean(nll), rel=1e-5)
  assert res[1].ppl == pytest.approx(math.exp(res[1].nll))


def test_context_window_gives_context_and_batching_does_not_matter():
  rng = np.random.default_rng(1)
  vocab = D.Vocab([f"w{i}" for i in range(12)])
  corpus = D.Corpus.from_docs([rng.integers(0, 12, 50), rng.integers(0, 12, 21)], vocab)
  (graphdef, params), _ = _tiny_model()
  v = [evaluate.NONE, evaluate.Point("trime_local", tau=1.0)]
  a = evaluate.evaluate(graphdef, params, corpus, v, block_len=16, context_window=8, streams=1).scores
  b = evaluate.evaluate(graphdef, params, corpus, v, block_len=16, context_window=8, streams=3).scores
  assert a[0].tokens == 71 and [x.nll for x in a] == pytest.approx([x.nll for x in b], rel=1e-6)
  no_ctx = evaluate.evaluate(graphdef, params, corpus, v, block_len=8, context_window=0, streams=2).scores
  assert no_ctx[0].tokens == 71 and no_ctx[0].nll != pytest.approx(a[0].nll, rel=1e-6)
