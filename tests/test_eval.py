"""Evaluation: fairseq-style windows, and every variant (none / local τ / continuous cache) against direct
float64 computations on a tiny random model."""

import math

import numpy as np
import pytest
from flax import nnx

from tests import reference as ref
from trime_jax import data as D
from trime_jax import evaluate
from trime_jax.errors import ConfigError
from trime_jax.model import ModelConfig, TransformerLM


@pytest.mark.parametrize("n,block,ctx", [(100, 16, 8), (17, 16, 0), (5, 16, 15), (64, 16, 15)])
def test_windows_score_every_target_once_with_bounded_context(n, block, ctx):
  wins = D.windows(n, block, ctx)
  scored = np.concatenate([np.arange(w.score_start, w.end) for w in wins])
  assert np.array_equal(scored, np.arange(n))
  for w in wins:
    assert w.end - w.start <= block and w.score_start - w.start <= ctx
    assert w.score_start - w.start == min(ctx, w.score_start)  # as much context as is available


def _fairseq_complete_samples(tokens, eos, block_len, context_window):
  """fairseq eval_lm with --sample-break-mode complete --context-window C, re-stated in NumPy: sentences are
  the lines (each ends with its `</s>`); TokenBlockDataset(block_size = block_len - C, 'complete') packs whole
  lines greedily, the source is the stream shifted right by one (`</s>` first); LMContextWindowDataset's
  collater prepends its `prev_tokens`, trimmed so prev + sample <= block_len, keeping the last C fed tokens.
  Returns [(fed input tokens, scored targets)] per sample, in order."""
  tokens = np.asarray(tokens, np.int64)
  ends = list(np.flatnonzero(tokens == eos) + 1)
  if not ends or ends[-1] != len(tokens):
    ends.append(len(tokens))
  sizes = np.diff([0] + ends)
  block_size = block_len - context_window
  slices, tok_idx, curr, i = [], 0, 0, 0
  while i < len(sizes):  # token_block_utils_fast.pyx, break_mode == 'complete'
    if curr + sizes[i] <= block_size or curr == 0:
      curr += sizes[i]
      i += 1
    else:
      slices.append((tok_idx, tok_idx + curr))
      tok_idx, curr = tok_idx + curr, 0
  if curr > 0:
    slices.append((tok_idx, tok_idx + curr))
  source = np.concatenate([[eos], tokens[:-1]])
  prev, out = np.empty(0, np.int64), []
  for s, e in slices:  # lm_context_window_dataset.py collater, one sample per batch (--max-sentences 1)
    extra = len(prev) + (e - s) - (block_size + context_window)
    if extra > 0:
      prev = prev[extra:]
    fed = np.concatenate([prev, source[s:e]])
    out.append((fed, tokens[s:e]))
    prev = fed[-context_window:] if context_window else np.empty(0, np.int64)
  return out


@pytest.mark.parametrize("block,ctx,seed", [(16, 8, 0), (16, 12, 1), (12, 0, 2), (20, 10, 3)])
def test_complete_windows_are_fairseq_eval_lm_samples(block, ctx, seed):
  """Every window fed and scored exactly as fairseq's complete-mode sample with its context window, including
  lines longer than S = block - ctx (a block of their own, with less context)."""
  rng = np.random.default_rng(seed)
  vocab = D.Vocab(["</s>", "<unk>"] + [f"w{i}" for i in range(6)])
  lens = rng.integers(1, block + 1, size=40)  # up to a whole block; many longer than S
  lines = [np.append(rng.integers(2, 8, n - 1), vocab.eos) for n in lens]
  docs = [np.concatenate(lines[:15]), np.concatenate(lines[15:])[:-1]]  # the last line has no </s>
  corpus = D.Corpus.from_docs(docs, vocab, "lines")
  n = len(corpus)
  wins = D.eval_windows(corpus, n, block, ctx, "complete")
  want = _fairseq_complete_samples(corpus.tokens, vocab.eos, block, ctx)
  assert len(wins) == len(want)
  assert any(w.end - w.score_start > block - ctx for w in wins) == (ctx > 0)  # long lines, where S < block
  for w, (fed, scored) in zip(wins, want):
    inputs, targets, mask = D.window_batch(corpus, [w], block)
    m = w.end - w.start
    assert np.array_equal(inputs[0, :m], fed) and np.array_equal(targets[0, mask[0]], scored)
    assert not mask[0, m:].any() and (targets[0, m:] == -1).all()
  scored = np.concatenate([np.arange(w.score_start, w.end) for w in wins])
  assert np.array_equal(scored, np.arange(n))
  # none mode is unchanged by the dispatcher
  assert D.eval_windows(corpus, n, block, ctx, "none") == D.windows(n, block, ctx)


def test_complete_windows_refuse_what_fairseq_would_feed_differently():
  vocab = D.Vocab(["</s>", "<unk>", "a"])
  long_line = D.Corpus.from_docs([np.array([2] * 20 + [0])], vocab, "long")
  with pytest.raises(D.ConfigError, match="line 0 has 21 tokens, more than eval.block_len=16"):
    D.eval_windows(long_line, len(long_line), 16, 8, "complete", overlong="refuse")  # the default drops it
  no_lines = D.Corpus.from_docs([np.array([2] * 20)], vocab, "bytes")
  with pytest.raises(D.ConfigError, match="needs `</s>` line ends"):
    D.eval_windows(no_lines, len(no_lines), 16, 8, "complete")
  with pytest.raises(D.ConfigError, match="sample_break_mode='eos'"):
    D.eval_windows(no_lines, len(no_lines), 16, 8, "eos")


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
      evaluate.Point("cache", cache_lambda=lam, cache_theta=theta) for lam, theta in cache]
  res = evaluate.evaluate(graphdef, params, corpus, points, block_len=32, context_window=0, streams=2).scores
  assert [r.tokens for r in res] == [30] * 5

  tokens = np.asarray(corpus.tokens)
  inputs = np.concatenate([[vocab.bos], tokens[:-1]])[None]
  logits, keys = (np.asarray(x, np.float64)[0] for x in model(inputs))
  lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
  ce = -lsm[np.arange(30), tokens]
  assert res[0].nll == pytest.approx(ce.mean(), rel=1e-5)
  for r, tau in zip(res[1:3], taus):
    want = ref.trime_nll(logits[None], keys[None], tokens[None], "local", tau=tau)[0]
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


def test_progress_log_prints_plain_lines_with_rate_and_eta(capsys):
  """Without a terminal (a log file, a remote accelerator's output) evaluation reports progress as lines."""
  rng = np.random.default_rng(2)
  vocab = D.Vocab([f"w{i}" for i in range(12)])
  corpus = D.Corpus.from_docs([rng.integers(0, 12, 60)], vocab)
  (graphdef, params), _ = _tiny_model()
  v = [evaluate.NONE]
  quiet = evaluate.evaluate(graphdef, params, corpus, v, block_len=8, context_window=0, streams=1).scores
  assert capsys.readouterr().err == ""
  logged = evaluate.evaluate(graphdef, params, corpus, v, block_len=8, context_window=0, streams=1,
                             progress="log").scores
  assert logged[0].nll == quiet[0].nll  # reporting changes nothing
  err = capsys.readouterr().err
  assert "\r" not in err and "eval: step 1/8 after" in err and "(the first step compiles)" in err
  assert "eval: step 8/8 after" in err  # the last step always
  log = evaluate.ProgressLog("x", 4, every_s=0.0)
  for done in range(1, 5):
    log.step(done)
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 4 and "steps/s, ETA" in lines[1] and "ETA" not in lines[3]


def test_tuning_never_picks_a_nan_point():
  """A diverged grid point (NaN nll) first in its group is replaced by any finite one, in `tune` and in the
  sweep's table (found by a review: NaN < x is always False, so a NaN first point stayed)."""
  import types

  from trime_jax import sweep
  from trime_jax.evaluate.points import tune

  pts = [evaluate.Point("trime_local", tau=t) for t in (0.5, 1.0, 2.0)]
  scores = [types.SimpleNamespace(point=p, nll=v) for p, v in zip(pts, (float("nan"), 3.0, 2.5))]
  assert tune(types.SimpleNamespace(scores=scores))[pts[0].group].nll == 2.5
  rows = [{"model": "m", "family": "trime_local", "mem_size": 0, "nll": v} for v in (float("nan"), 3.0, 2.5)]
  assert sweep.sweep_best(rows)[("m", "trime_local")][0]["nll"] == 2.5


def test_the_sweep_keeps_other_splits_layouts_and_interpolation_memories_apart():
  """Rows merged with --include (a dev file beside a test file, a store per document beside one across
  documents) and interpolation over the two P′ memories are other measurements: never one cell's candidates
  (found by a review: the lowest nll won, so a dev number could stand in a test column)."""
  from trime_jax import sweep

  row = lambda split, reset, nll, **kw: {"model": "m", "family": "trime_local", "mem_size": 16, "split": split,
                                         "long_term_layout": "original", "reset_at_documents": reset, "nll": nll,
                                         "ppl": 2.0 ** nll, **kw}
  rows = [row("test", False, 3.0), row("dev", False, 2.0), row("test", True, 2.5)]
  best = sweep.sweep_best(rows)
  assert {k: v[16]["nll"] for k, v in best.items()} == {
      ("m [test, store across documents]", "trime_local"): 3.0, ("m [dev, store across documents]", "trime_local"): 2.0,
      ("m [test, store per document]", "trime_local"): 2.5}
  assert list(sweep.sweep_best(rows[:1])) == [("m", "trime_local")]  # one of each: the model's name alone
  interp = [row("test", False, 3.0, family="interp", interp_memory="external"),
            row("test", False, 2.0, family="interp", interp_memory="all")]
  assert {k[1]: v[16]["nll"] for k, v in sweep.sweep_best(interp).items()} == {"interp[external]": 3.0,
                                                                              "interp[all]": 2.0}
  table = sweep.sweep_table(interp)
  assert "(P′ over external) | 8.000" in table and "(P′ over all) | 4.000" in table


def test_one_device_evaluation_says_nothing_about_devices():
  """launch.eval's note on unused devices (`runner.devices_note`) only where the process has several (8 devices:
  tests/test_sharded.py); and eval.devices=1 is no mesh, the driver's one-device path."""
  import jax

  from trime_jax import sharding
  from trime_jax.evaluate.runner import devices_note

  assert jax.local_device_count() == 1
  assert devices_note(None, 8) is None
  assert sharding.eval_mesh(1, 8) is None and sharding.eval_mesh(0, 3) is None


def test_the_sweep_never_chooses_a_cell_by_test_perplexity():
  """Rows of a test split at different settings (e.g. --include of two runs at τ = 1 and τ = 2) are chosen between
  by their dev perplexity (eval.tune's rows), never by the test numbers; without dev numbers it is one error
  (found by a review: the lowest test nll won, so the table tuned τ on test cell by cell)."""
  from trime_jax import sweep

  row = lambda tau, nll, mem=16, **kw: {"model": "m", "family": "trime_local", "mem_size": mem, "split": "test",
                                        "variant": f"trime_local(tau={tau:g})", "params": {"tau": tau}, "nll": nll,
                                        "ppl": 2.0 ** nll, **kw}
  with pytest.raises(ConfigError, match=r"cell \(m, TRIME \(local \+ long-term\), memory size 16\) has 2 rows of split "
                                        r"test at different settings .*would tune on it"):
    sweep.sweep_best([row(1.0, 3.0), row(2.0, 2.0)])
  # eval.tune's rows: the lower dev perplexity wins, though its test nll is the higher
  best = sweep.sweep_best([row(1.0, 3.0, dev_ppl=5.0), row(2.0, 2.0, dev_ppl=6.0)])
  assert best[("m", "trime_local")][16]["params"] == {"tau": 1.0}
  # the same point twice (a file included twice): no choice to make
  assert sweep.sweep_best([row(1.0, 3.0), row(1.0, 3.0)])[("m", "trime_local")][16]["nll"] == 3.0
  # dev rows: the grid itself, chosen by its nll (the tuning)
  dev = [dict(row(1.0, 3.0), split="dev"), dict(row(2.0, 2.0), split="dev")]
  assert sweep.sweep_best(dev)[("m", "trime_local")][16]["params"] == {"tau": 2.0}


def test_the_sweep_keeps_other_windows_and_exports_apart_and_shows_the_model_alone():
  """Rows of other windows (block, context, break mode) or of another export are other measurements: series of
  their own, not candidates for one cell; the model alone is shown where no memory size 0 was run (it was left
  out of the table: only its rows of size 0 were read)."""
  from trime_jax import sweep

  row = lambda fam, mem, nll, **kw: {"model": "m", "family": fam, "mem_size": mem, "split": "dev", "nll": nll,
                                     "ppl": 2.0 ** nll, "params": {"tau": 1.0} if fam != "none" else {},
                                     "block_len": 32, "context_window": 16, "sample_break_mode": "none", **kw}
  rows = [row("trime_local", 16, 3.0), row("trime_local", 16, 2.0, context_window=8),
          row("trime_local", 16, 2.5, checkpoint_fingerprint="v-abcdef0123-a"),
          row("trime_local", 16, 2.6, checkpoint_fingerprint="v-99999999aa-a")]
  got = {k: v[16]["nll"] for k, v in sweep.sweep_best(rows).items()}
  assert got == {("m [context 16]", "trime_local"): 3.0, ("m [context 8]", "trime_local"): 2.0,
                 ("m [context 16, export abcdef01]", "trime_local"): 2.5,
                 ("m [context 16, export 99999999]", "trime_local"): 2.6}
  # models of their own exports and windows (a sweep of several models) are not tagged for what sets them apart
  other = [dict(r, model="n", checkpoint_fingerprint="v-1111111111-a", block_len=64) for r in rows[:1]]
  mine = [dict(r, checkpoint_fingerprint="v-2222222222-a") for r in rows[:1]]
  assert {k[0] for k in sweep.sweep_best(mine + other)} == {"m", "n"}
  rows = [row("none", 512, 8.0), row("trime_local", 512, 3.0), row("none", 1024, 8.0), row("trime_local", 1024, 2.0)]
  assert "| m | none | 256.000 | 256.000 |" in sweep.sweep_table(rows)
