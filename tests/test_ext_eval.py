"""External memory at evaluation (TrimeLM_ext, kNN-LM) against brute-force float64 computations over the
whole datastore (an exact index with K covering it)."""

import math

import ml_collections
import numpy as np
import pytest
from flax import nnx

from tests import reference as ref
from trime_jax import exports
from trime_jax import data as D
from trime_jax import evaluate
from trime_jax import knn
from trime_jax.datastore import Datastore, build_datastore, build_index
from trime_jax.errors import CheckpointError, ConfigError
from trime_jax.model import ModelConfig, TransformerLM
from trime_jax.configs import default
from trime_jax import specs

BLOCK, CTX, V, DIM = 16, 8, 9, 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  return _setup(tmp_path_factory.mktemp("ext"))


@pytest.fixture(scope="module")
def l2_setup(tmp_path_factory):
  """As `setup`, with a random scale and bias in the last layer's feed-forward LayerNorm: its keys' norms vary,
  so L2 and inner-product neighbours differ (a fresh LayerNorm gives every key the norm √D, and the two orders
  coincide)."""
  return _setup(tmp_path_factory.mktemp("ext_l2"), random_key_norms=True)


def _setup(tmp, random_key_norms=False):
  rng = np.random.default_rng(0)
  vocab = D.Vocab([f"w{i}" for i in range(V)])
  train = D.Corpus.from_docs([rng.integers(0, 5, 40), rng.integers(0, 5, 27)], vocab, "train")
  dev = D.Corpus.from_docs([rng.integers(0, 5, 23), rng.integers(0, 5, 14)], vocab, "dev")
  cfg = default.get_config()
  cfg.model.num_layers, cfg.model.d_model, cfg.model.num_heads, cfg.model.d_ff = 1, DIM, 2, 16
  cfg.model.max_len, cfg.eval.block_len, cfg.eval.context_window, cfg.eval.batch_size = 32, BLOCK, CTX, 2
  model = TransformerLM(specs.model_config(cfg, vocab_size=V), rngs=nnx.Rngs(5))
  if random_key_norms:
    norm = model.blocks[-1].ffn_norm
    norm.scale[...] = norm.scale[...] * (1.0 + rng.uniform(-0.8, 0.8, DIM)).astype(np.float32)
    norm.bias[...] = norm.bias[...] + rng.normal(0.0, 0.7, DIM).astype(np.float32)
  graphdef, params = nnx.split(model, nnx.Param)
  export = exports.export(str(tmp / "export"), params, cfg, vocab)
  build_datastore(export, train, str(tmp / "ds"), progress=False)
  ds = Datastore(str(tmp / "ds"))
  build_index(ds, kind="flat", progress=False)
  build_index(ds, kind="flat", metric="l2", progress=False)  # eval.knnlm_metric="l2": <ds>/index_l2.faiss
  return dict(tmp=tmp, vocab=vocab, train=train, dev=dev, graphdef=graphdef, params=params, model=model,
              export=export, ds=ds, cfg=cfg)


def _brute_force(s, tau, tau_prime, lam_i, lam_k, theta):
  """Per scored token of `dev`: -log P under trime, interp (P′ over all memories / the datastore only), knnlm,
  knnlm_cache, trime_local, cache (float64)."""
  model, dev, ds = s["model"], s["dev"], s["ds"]
  mem_k = np.asarray(ds.keys, np.float64)  # the float16 keys the index holds
  mem_t = np.asarray(ds.values)
  out = {f: [] for f in ("trime", "interp_all", "interp_external", "knnlm", "knnlm_cache", "trime_local", "cache")}
  hits = np.zeros(len(knn.RETRIEVAL_KS))
  for w in D.windows(len(dev), BLOCK, CTX):
    inputs, targets, scored = D.window_batch(dev, [w], BLOCK)
    logits, keys = (np.asarray(x, np.float64)[0] for x in model(inputs))
    for t in np.nonzero(scored[0])[0]:
      y = targets[0, t]
      loc_k, loc_t = keys[:t], targets[0, :t]
      all_k, all_t = np.concatenate([loc_k, mem_k]), np.concatenate([loc_t, mem_t])
      p_trime = ref.distribution(logits[t], keys[t], all_k, all_t, np.ones(len(all_t), bool), tau)[y]
      p_local = ref.distribution(logits[t], keys[t], loc_k, loc_t, np.ones(t, bool), tau)[y]
      p_lm = ref.distribution(logits[t], keys[t], mem_k[:0], mem_t[:0], np.ones(0, bool))[y]

      def p_mem(k, tt, scale):
        if len(tt) == 0:
          return None
        wgt = np.exp(scale * (k @ keys[t]) / math.sqrt(DIM))
        return wgt[tt == y].sum() / wgt.sum()

      out["trime"].append(-math.log(p_trime))
      out["trime_local"].append(-math.log(p_local))
      out["interp_all"].append(-math.log((1 - lam_i) * p_trime + lam_i * p_mem(all_k, all_t, 1 / tau_prime)))
      out["interp_external"].append(-math.log((1 - lam_i) * p_trime + lam_i * p_mem(mem_k, mem_t, 1 / tau_prime)))
      out["knnlm"].append(-math.log((1 - lam_k) * p_lm + lam_k * p_mem(mem_k, mem_t, theta)))
      out["knnlm_cache"].append(-math.log((1 - lam_k) * p_lm + lam_k * p_mem(all_k, all_t, theta)))
      pc = p_mem(loc_k, loc_t, theta)
      out["cache"].append(-math.log(p_lm if pc is None else (1 - lam_k) * p_lm + lam_k * pc))
      order = np.argsort(-(mem_k @ keys[t]), kind="stable")
      first = np.nonzero(mem_t[order] == y)[0]
      hits += [len(first) > 0 and first[0] < k for k in knn.RETRIEVAL_KS]
  return {f: np.mean(v) for f, v in out.items()}, hits


def _key(point):
  return f"interp_{point.interp_memory}" if point.family == "interp" else point.family


def test_external_memory_equals_brute_force_over_the_whole_datastore(setup):
  s = setup
  tau, tau_prime, lam_i, lam_k, theta = 0.8, 2.0, 0.3, 0.25, 1.5
  said = []
  ext = knn.ExternalMemory(str(s["tmp"] / "ds"), checkpoint_dir=s["export"], k=10_000, log=said.append)
  assert ext.k == len(s["train"])  # K covers the datastore, and its line says K was cut to it
  assert f"K={ext.k} (K=10000 asked for, more than the datastore holds)" in said[0], said
  # another K over the same index (the API's k=): cut alike, and said alike (it was cut without a word)
  assert ext.with_k(10_000) is ext and ext.with_k(ext.k) is ext and len(said) == 1, said
  assert ext.with_k(20_000) is ext and said[1:] == [f"external memory: K={ext.k} (K=20000 asked for, more than the "
                                                    "datastore holds)"], said
  assert ext.with_k(3).k == 3 and ext.k == len(s["train"]) and len(said) == 2, said
  P = evaluate.Point
  v = [evaluate.NONE, P("cache", cache_lambda=lam_k, cache_theta=theta), P("trime_local", tau=tau),
       P("trime", tau=tau),
       P("interp", tau=tau, tau_prime=tau_prime, knn_lambda=lam_i, interp_memory="all"),
       P("interp", tau=tau, tau_prime=tau_prime, knn_lambda=lam_i, interp_memory="external"),
       P("knnlm", knn_lambda=lam_k, knn_theta=theta), P("knnlm_cache", knn_lambda=lam_k, knn_theta=theta)]
  res = evaluate.evaluate(s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=2,
                          external=ext)
  want, hits = _brute_force(s, tau, tau_prime, lam_i, lam_k, theta)
  got = {_key(r.point): r.nll for r in res.scores}
  assert res.tokens == len(s["dev"])
  for fam in want:
    assert got[fam] == pytest.approx(want[fam], rel=2e-5), fam
  assert got["trime"] != pytest.approx(got["trime_local"], rel=1e-3)  # the datastore matters
  # Top-k retrieval accuracy from the same search (exact index: ties aside, the brute-force order).
  np.testing.assert_array_equal(res.retrieval_hits, hits)
  # The same numbers with one stream, and with exact re-scoring from the stored keys.
  one = evaluate.evaluate(s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=1,
                          external=knn.ExternalMemory(str(s["tmp"] / "ds"), k=10_000, exact=True))
  np.testing.assert_allclose([r.nll for r in one.scores], [r.nll for r in res.scores], rtol=1e-5)


def test_overlapped_search_scores_what_the_sequential_driver_scores(setup):
  """eval.overlap_search dispatches the next window's forward pass before this window's search: the same
  computations in another order, so every token's nll and every retrieval count is equal (long-term store and
  two streams included: the store is threaded through the scoring steps, which keep their order)."""
  s = setup
  ext = knn.ExternalMemory(str(s["tmp"] / "ds"), k=8)
  v = (evaluate.NONE, evaluate.Point("trime", tau=0.8), evaluate.Point("knnlm_cache", knn_lambda=0.25, knn_theta=1.0))
  run = lambda overlap: evaluate.evaluate(s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK,
                                          context_window=CTX, streams=2, external=ext, per_token=True,
                                          long_term=evaluate.StoreSpec(mem_size=16), overlap_search=overlap)
  seq, over = run(False), run(True)
  np.testing.assert_array_equal(over.token_nll, seq.token_nll)
  np.testing.assert_array_equal(over.retrieval_hits, seq.retrieval_hits)
  assert over.tokens == seq.tokens == len(s["dev"]) and np.isfinite(over.token_nll).all()
  # A top-8 search reports the ranks it can tell apart: no "top64" / "top1024" that would count the top 8.
  acc = seq.retrieval_accuracy()
  assert list(acc) == ["top1", "top8"] and 0 < acc["top1"] <= acc["top8"] <= 1

  # A stream started from the state its first windows left (evaluate(start=)) scores the rest as one pass does
  prefix = 2 * BLOCK
  kept = evaluate.evaluate(s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=1,
                           external=ext, per_token=True, long_term=evaluate.StoreSpec(mem_size=64),
                           keep_state_before=prefix)
  assert kept.state is not None and kept.started_at == 0 and max(w.end for w in kept.state.windows) <= prefix
  k = len(kept.state.windows)
  for overlap in (False, True):
    resumed = evaluate.evaluate(s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX,
                                streams=1, external=ext, per_token=True, long_term=evaluate.StoreSpec(mem_size=64),
                                start=kept.state, overlap_search=overlap)
    assert resumed.started_at == k and resumed.state is None
    skipped = kept.state.windows[-1].end
    assert np.isnan(resumed.token_nll[:, :skipped]).all()
    np.testing.assert_array_equal(resumed.token_nll[:, skipped:], kept.token_nll[:, skipped:])
    assert resumed.tokens == len(s["dev"]) - skipped
  # the state is not used up (score_step donates a copy), and a plan it does not fit runs from the start
  again = evaluate.evaluate(s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=1,
                            external=ext, per_token=True, long_term=evaluate.StoreSpec(mem_size=128), start=kept.state)
  assert again.started_at == 0 and np.isfinite(again.token_nll).all()
  np.testing.assert_array_equal(evaluate.evaluate(
      s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=1, external=ext,
      per_token=True, long_term=evaluate.StoreSpec(mem_size=64), start=kept.state).token_nll[:, skipped:],
      kept.token_nll[:, skipped:])
  # ... nor a corpus with other tokens in those windows (same layout)
  tokens = np.array(s["dev"].tokens)
  tokens[3] = (tokens[3] + 1) % 5
  other = D.Corpus(tokens, s["dev"].doc_starts, s["vocab"], name="dev")
  assert evaluate.evaluate(s["graphdef"], s["params"], other, v, block_len=BLOCK, context_window=CTX, streams=1,
                           external=ext, long_term=evaluate.StoreSpec(mem_size=64), start=kept.state).started_at == 0
  with pytest.raises(ConfigError, match="one stream"):
    evaluate.evaluate(s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=2,
                      external=ext, keep_state_before=prefix)

  # bench.eval_overlap times the two orders and checks the same equality on its own
  from bench import eval_overlap

  cfg = s["cfg"].copy_and_resolve_references()
  cfg.eval.knn_k, cfg.eval.mem_size = 8, 16
  out = eval_overlap.run(cfg, s["export"], str(s["tmp"] / "ds"), "", tokens=len(s["dev"]), repeats=1,
                         corpus=s["dev"])
  assert out["max_abs_nll_diff_overlap_vs_sequential"] == 0.0 and out["tokens"] == len(s["dev"])
  assert set(out["tokens_per_s"]) == {"sequential", "overlap", "no_datastore_sequential", "no_datastore_overlap"}
  assert all(v > 0 for v in out["tokens_per_s"].values()) and out["k"] == 8 and out["mem_size"] == 16


def test_one_search_per_group_of_windows_scores_what_one_search_per_window_scores(setup):
  """eval.search_queries: the scored queries of ⌊search_queries / (streams × Q)⌋ consecutive steps go to one
  search, and the steps are scored in order after it. With a search whose answer does not depend on the call,
  every token's nll and every retrieval count equal those of one search per step, with and without
  eval.overlap_search (two streams, warm-up windows and a long-term store included); the group's queries are
  all searched, once. With FAISS they agree to float rounding (its exact index rounds otherwise in large calls,
  where it computes with BLAS: bench/eval_search_calls.py)."""
  s = setup
  v = (evaluate.NONE, evaluate.Point("trime", tau=0.8), evaluate.Point("knnlm_cache", knn_lambda=0.25, knn_theta=1.0))
  run = lambda ext, queries, overlap=False: evaluate.evaluate(
      s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=2, external=ext,
      per_token=True, long_term=evaluate.StoreSpec(mem_size=16), search_queries=queries, overlap_search=overlap)
  exact = ref.RowByRowSearch(s["ds"].keys, s["ds"].values, 8)
  per_step = run(exact, 0)
  per_step_calls = list(exact.calls)
  assert len(per_step_calls) > 3 and max(per_step_calls) <= 2 * (BLOCK - CTX)
  for queries, overlap in [(48, False), (48, True), (4096, False), (4096, True)]:
    exact.calls.clear()
    grouped = run(exact, queries, overlap)
    np.testing.assert_array_equal(grouped.token_nll, per_step.token_nll)
    np.testing.assert_array_equal(grouped.retrieval_hits, per_step.retrieval_hits)
    assert sum(exact.calls) == sum(per_step_calls) == per_step.tokens == len(s["dev"])
    if queries == 48:  # three steps of 2 × 8 queries a search
      assert max(exact.calls) <= 48 and len(exact.calls) < len(per_step_calls)
    else:
      assert exact.calls == [len(s["dev"])]
  # A stream resumed from a kept state (start=) searches the groups its uncut run searched after that state (a
  # group ends where the state is kept): equal bit for bit even where the search's answer depends on its call.
  noisy = ref.RowByRowSearch(s["ds"].keys, s["ds"].values, 8, row_noise=1e-3)
  one_stream = lambda **kw: evaluate.evaluate(
      s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=1, external=noisy,
      per_token=True, long_term=evaluate.StoreSpec(mem_size=64), search_queries=48, **kw)  # 6 steps a search
  kept = one_stream(keep_state_before=2 * BLOCK)
  k = len(kept.state.windows)
  assert k % 6 and noisy.calls[0] == sum(w.end - w.score_start for w in kept.state.windows)  # a group ends there
  noisy.calls.clear()
  for overlap in (False, True):
    resumed = one_stream(start=kept.state, overlap_search=overlap)
    assert resumed.started_at == k
    skipped = kept.state.windows[-1].end
    np.testing.assert_array_equal(resumed.token_nll[:, skipped:], kept.token_nll[:, skipped:])
  faiss = knn.ExternalMemory(str(s["tmp"] / "ds"), k=8)
  one, grouped = run(faiss, 0), run(faiss, 4096)
  np.testing.assert_allclose(grouped.token_nll, one.token_nll, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(grouped.retrieval_hits, one.retrieval_hits)
  with pytest.raises(ConfigError, match="eval.search_queries must be >= 0, got -1"):
    run(faiss, -1)


def test_grid_tuning_and_frequency_buckets(setup):
  s = setup
  ext = knn.ExternalMemory(str(s["tmp"] / "ds"), k=8)
  grid = evaluate.grid(evaluate.FAMILIES)
  buckets = knn.frequency_buckets(s["train"].tokens, V)
  run = lambda points: evaluate.evaluate(s["graphdef"], s["params"], s["dev"], points, block_len=BLOCK,
                                         context_window=CTX, streams=2, external=ext, word_buckets_V=buckets)
  res = run(grid)
  best = evaluate.tune(res)
  # Every family is tuned; the interpolation once per P′ memory, from the same pass.
  assert set(best) == (set(evaluate.FAMILIES) - {"interp"}) | {"interp[external]", "interp[all]"}
  assert {p.interp_memory for p in grid if p.family == "interp"} == set(evaluate.INTERP_MEMORIES)
  for g, b in best.items():
    assert isinstance(b.point, evaluate.Point) and b.point.group == g
    assert b.nll == min(r.nll for r in res.scores if r.point.group == g)
  picked = [b.point for b in best.values()]
  assert sorted(p.interp_memory for p in picked if p.family == "interp") == sorted(evaluate.INTERP_MEMORIES)
  again = run(picked)
  for r in again.scores:
    assert r.nll == pytest.approx(best[r.point.group].nll, rel=1e-5)
  # Bucket counts add up to the scored tokens and per-bucket means recombine into the overall mean.
  assert again.bucket_tokens.sum() == again.tokens
  filled = again.bucket_tokens > 0
  overall = (np.nan_to_num(again.bucket_nll[:, filled]) * again.bucket_tokens[filled]).sum(1) / again.tokens
  np.testing.assert_allclose(overall, [r.nll for r in again.scores], rtol=1e-5)


def test_mismatches_are_clear_errors(setup, tmp_path):
  s = setup
  trime = [evaluate.Point("trime", tau=1.0)]
  with pytest.raises(ConfigError, match="datastore"):
    evaluate.evaluate(s["graphdef"], s["params"], s["dev"], trime, block_len=BLOCK, context_window=CTX, streams=1,
                      external=None)
  other = TransformerLM(ModelConfig(vocab_size=V, num_layers=1, d_model=2 * DIM, num_heads=2, d_ff=16, max_len=32),
                        rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(other, nnx.Param)
  ext = knn.ExternalMemory(str(s["tmp"] / "ds"), k=4)
  # Every path checks the block length against the model (trime_jax.launch.eval_ext did not before issue 10).
  with pytest.raises(CheckpointError, match="block_len=64 exceeds the model's max_len=32"):
    evaluate.evaluate(s["graphdef"], s["params"], s["dev"], trime, block_len=64, context_window=CTX, streams=1,
                      external=knn.ExternalMemory(str(s["tmp"] / "ds"), k=4))
  with pytest.raises(ConfigError, match="dimension"):
    evaluate.evaluate(graphdef, params, s["dev"], trime, block_len=BLOCK, context_window=CTX, streams=1,
                      external=ext)
  cfg = s["cfg"].copy_and_resolve_references()
  cfg.model.d_model = 2 * DIM
  export = exports.export(str(tmp_path / "other"), params, cfg, s["vocab"])
  with pytest.raises(CheckpointError, match=r"does not match: checkpoint_fingerprint .*; dimension 8 \(datastore\) != 16"):
    knn.ExternalMemory(str(s["tmp"] / "ds"), checkpoint_dir=export, k=4)


def _brute_force_long(s, k, mem_size, reset_at_documents, tau, tau_prime, lam):
  """Per scored token of `dev`, from the equations in float64: memory = local (the window's earlier tokens) +
  long-term (tokens in [window start - mem_size, window start), of the query's document if reset, each with the
  key of the window that scored it) + external (top-k of the datastore by g·k). Returns mean -log P of
  trime, knnlm, and the interpolation with P′ over the external top-k only and over all three memories."""
  model, dev, ds = s["model"], s["dev"], s["ds"]
  mem_k, mem_t = np.asarray(ds.keys, np.float64), np.asarray(ds.values)
  doc = lambda pos: np.searchsorted(dev.doc_starts, pos, side="right") - 1
  stored = {}  # corpus position -> (key, target) of every scored token so far
  out = {f: [] for f in ("trime", "knnlm", "interp_external", "interp_all")}

  def p_mem(keys, tgts, q, y, scale):  # P′(y) ∝ Σ_{x_j = y} exp(scale · g·g_j / √D)
    logits = scale * (keys @ q) / math.sqrt(DIM)
    w = np.exp(logits - logits.max())
    return w[tgts == y].sum() / w.sum()

  for w in D.windows(len(dev), BLOCK, CTX):
    inputs, targets, scored = D.window_batch(dev, [w], BLOCK)
    logits, keys = (np.asarray(x, np.float64)[0] for x in model(inputs))
    for t in np.nonzero(scored[0])[0]:
      y, q, pos = targets[0, t], keys[t], w.start + t
      lt = [p for p in sorted(stored) if w.start - mem_size <= p < w.start
            and (not reset_at_documents or doc(p) == doc(pos))]
      long_k = np.array([stored[p][0] for p in lt]).reshape(-1, DIM)
      long_t = np.array([stored[p][1] for p in lt], np.int64)
      scores = mem_k @ q
      order = np.argsort(-scores, kind="stable")
      assert scores[order[k - 1]] - scores[order[k]] > 1e-4  # a clear top-k: no near-ties at the boundary
      ext_k, ext_t = mem_k[order[:k]], mem_t[order[:k]]
      all_k = np.concatenate([keys[:t], long_k, ext_k])
      all_t = np.concatenate([targets[0, :t], long_t, ext_t])
      p_trime = ref.distribution(logits[t], q, all_k, all_t, np.ones(len(all_t), bool), tau)[y]
      p_lm = ref.distribution(logits[t], q, mem_k[:0], mem_t[:0], np.ones(0, bool))[y]
      out["trime"].append(-math.log(p_trime))
      out["knnlm"].append(-math.log((1 - lam) * p_lm + lam * p_mem(ext_k, ext_t, q, y, 1 / tau_prime)))
      for name, (mk, mt) in (("interp_external", (ext_k, ext_t)), ("interp_all", (all_k, all_t))):
        out[name].append(-math.log((1 - lam) * p_trime + lam * p_mem(mk, mt, q, y, 1 / tau_prime)))
    for t in np.nonzero(scored[0])[0]:
      stored[w.start + t] = (keys[t], targets[0, t])
  assert min(len(v) for v in out.values()) == len(dev)
  return {f: np.mean(v) for f, v in out.items()}


@pytest.mark.parametrize("reset_at_documents", [True, False])
def test_both_interpolation_memories_with_top_k_and_long_term_memory_equal_brute_force(setup, reset_at_documents):
  """P′ over the external top-K only (the original release) and over local + long-term + external (the paper's
  text), with K well below the datastore size and a long-term store, against float64 NumPy."""
  s = setup
  k, mem_size, tau, tau_prime, lam = 6, 12, 0.8, 0.5, 0.35
  ext = knn.ExternalMemory(str(s["tmp"] / "ds"), checkpoint_dir=s["export"], k=k)
  assert ext.k == k < len(s["train"]) // 5  # top-K of a larger datastore
  P = evaluate.Point
  interp = [P("interp", tau=tau, tau_prime=tau_prime, knn_lambda=lam, interp_memory=m) for m in ("external", "all")]
  v = [evaluate.NONE, P("trime", tau=tau), P("knnlm", knn_lambda=lam, knn_theta=1 / tau_prime)] + interp
  assert [p.name for p in interp] == ["interp(tau=0.8,tau_prime=0.5,lambda=0.35,interp_memory=external)",
                                      "interp(tau=0.8,tau_prime=0.5,lambda=0.35,interp_memory=all)"]
  long_term = evaluate.StoreSpec(mem_size, reset_at_documents, "disjoint")
  res = evaluate.evaluate(s["graphdef"], s["params"], s["dev"], v, block_len=BLOCK, context_window=CTX, streams=2,
                          long_term=long_term, external=ext)
  got = {_key(r.point): r.nll for r in res.scores}
  want = _brute_force_long(s, k, mem_size, reset_at_documents, tau, tau_prime, lam)
  for fam in want:
    assert got[fam] == pytest.approx(want[fam], rel=2e-5), fam
  # The two P′ memories give different numbers here (the test can tell them apart).
  assert got["interp_external"] != pytest.approx(got["interp_all"], rel=1e-3)
  # Without a long-term store the numbers change too (the store is part of the memories checked above).
  short = evaluate.evaluate(s["graphdef"], s["params"], s["dev"], interp, block_len=BLOCK, context_window=CTX,
                            streams=2, external=ext)
  assert short.scores[1].nll != pytest.approx(got["interp_all"], rel=1e-4)


def test_retrieval_ranks_are_those_a_top_k_search_tells_apart():
  assert knn.retrieval_ks(1024) == knn.retrieval_ks(50_000) == knn.RETRIEVAL_KS == (1, 8, 64, 1024)
  assert knn.retrieval_ks(100) == (1, 8, 64, 100) and knn.retrieval_ks(8) == (1, 8) and knn.retrieval_ks(1) == (1,)
  hits = knn.retrieval_hits(np.array([[3, 5, 7], [1, 2, 9]]), np.array([7, 4]), knn.retrieval_ks(3))
  np.testing.assert_array_equal(hits, [0, 1])  # (1, 3): the first query's target is third, the second's absent


def test_interp_memory_config():
  e = default.get_config().eval
  assert e.interp_memory == "external"  # the original release's P′ by default
  interp = lambda: evaluate.configured_points(e, ("interp",))[0]
  assert interp() == evaluate.Point("interp", tau=e.tau, tau_prime=e.tau_prime, knn_lambda=e.knn_lambda,
                                    interp_memory="external")
  e.interp_memory = "all"
  assert interp().interp_memory == "all"
  e.interp_memory = "local"
  with pytest.raises(ConfigError, match="interp_memory"):
    interp()
  with pytest.raises(ConfigError, match="interp_memory"):
    evaluate.Point("interp", tau=1.0, tau_prime=1.0, knn_lambda=0.3)


def test_knn_theta_and_cache_theta_are_two_fields():
  """kNN-LM's θ (eval.knn_theta) and the cache's (eval.cache_theta): one name per quantity, each read where it
  belongs; a config stored before knn_theta existed reads θ = 1 (what eval.cache_theta's default gave it)."""
  from trime_jax import train_config

  e = default.get_config().eval
  with e.unlocked():
    e.knn_theta, e.cache_theta = 2.0, 3.0
  points = dict(zip(("cache", "knnlm", "knnlm_cache"), evaluate.configured_points(e, ("cache", "knnlm", "knnlm_cache"))))
  assert (points["cache"].cache_theta, points["knnlm"].knn_theta, points["knnlm_cache"].knn_theta) == (3.0, 2.0, 2.0)
  stored = ml_collections.ConfigDict({k: v for k, v in e.to_dict().items() if k != "knn_theta"})
  assert evaluate.configured_points(stored, ("knnlm",))[0].knn_theta == 1.0
  c = default.get_config()
  c.eval.knn_theta = 0.0
  with pytest.raises(ConfigError, match="eval.knn_theta must be > 0"):
    train_config.validate_config(c)
  c = default.get_config()
  c.eval.tune_max_tokens = -3  # refused with the config, before the evaluation (the runner's check comes later)
  with pytest.raises(ConfigError, match="eval.tune_max_tokens must be >= 0, got -3"):
    train_config.validate_config(c)


def test_points_are_checked():
  with pytest.raises(ConfigError, match="unknown evaluation family"):
    evaluate.Point("knn")
  with pytest.raises(ConfigError, match="cache_theta"):
    evaluate.Point("cache", cache_lambda=0.1)  # θ missing
  with pytest.raises(ConfigError, match="tau"):
    evaluate.Point("knnlm", knn_lambda=0.1, knn_theta=1.0, tau=1.0)  # a parameter the family does not have
  with pytest.raises(ConfigError, match="knn_theta"):
    evaluate.Point("knnlm", knn_lambda=0.1, cache_theta=1.0)  # the cache's θ is not kNN-LM's
  with pytest.raises(ConfigError, match="λ"):
    evaluate.Point("cache", cache_lambda=1.0, cache_theta=1.0)
  with pytest.raises(ConfigError, match="> 0"):
    evaluate.Point("trime", tau=0.0)
  with pytest.raises(ConfigError, match="mem_size"):
    evaluate.StoreSpec(-1)


def _brute_force_l2(s, lam, theta, k=None):
  """Per scored token of `dev`, float64: -log P of the original's kNN-LM (fairseq/knnlm.py, metric l2, no
  knn_sim_func): p_kNN(w) = Σ_{x_j = w} exp(θ·s_j) / Σ_j exp(θ·s_j), s_j = -|q - k_j|² from the float16 keys,
  over the k nearest entries by L2 (all: None), mixed (1-λ)·p_LM + λ·p_kNN; and knnlm_cache: the same
  similarity over the window's earlier tokens + those entries."""
  model, dev, ds = s["model"], s["dev"], s["ds"]
  mem_k, mem_t = np.asarray(ds.keys, np.float64), np.asarray(ds.values)
  out = {"knnlm": [], "knnlm_cache": []}
  for w in D.windows(len(dev), BLOCK, CTX):
    inputs, targets, scored = D.window_batch(dev, [w], BLOCK)
    logits, keys = (np.asarray(x, np.float64)[0] for x in model(inputs))
    for t in np.nonzero(scored[0])[0]:
      y, q = targets[0, t], keys[t]
      p_lm = ref.distribution(logits[t], q, mem_k[:0], mem_t[:0], np.ones(0, bool))[y]
      dist = ((mem_k - q) ** 2).sum(-1)
      near = np.argsort(dist, kind="stable")[:k]
      ext_s, ext_t = -dist[near], mem_t[near]
      loc_s, loc_t = -((keys[:t] - q) ** 2).sum(-1), targets[0, :t]

      def p_knn(sims, tt):
        wgt = np.exp(theta * (sims - sims.max()))
        return wgt[tt == y].sum() / wgt.sum()

      out["knnlm"].append(-math.log((1 - lam) * p_lm + lam * p_knn(ext_s, ext_t)))
      out["knnlm_cache"].append(-math.log((1 - lam) * p_lm + lam * p_knn(np.concatenate([loc_s, ext_s]),
                                                                           np.concatenate([loc_t, ext_t]))))
  return {f: np.mean(v) for f, v in out.items()}


def _l2_points(lam, theta, tau=0.8, tau_prime=2.0):
  P = evaluate.Point
  return [evaluate.NONE, P("trime", tau=tau), P("interp", tau=tau, tau_prime=tau_prime, knn_lambda=lam,
                                                interp_memory="external"),
          P("cache", cache_lambda=lam, cache_theta=theta),
          P("knnlm", knn_lambda=lam, knn_theta=theta), P("knnlm_cache", knn_lambda=lam, knn_theta=theta)]


@pytest.mark.parametrize("exact", [False, True])
def test_knnlm_by_l2_equals_brute_force_over_the_whole_datastore(l2_setup, exact):
  """eval.knnlm_metric="l2": knnlm / knnlm_cache as the original's kNN-LM scores them (an L2 index, -|q - k|²
  recomputed from the stored keys, no √D, θ its scale), against float64 over the whole datastore; the other
  families (the inner-product search) score exactly what they score with knnlm_metric="ip"."""
  s = l2_setup
  lam, theta = 0.25, 1.0  # θ = 1: the original's --softmax-temp 1 (its kNN-LM default)
  said = []
  ext = knn.ExternalMemory(str(s["tmp"] / "ds"), checkpoint_dir=s["export"], k=10_000, exact=exact,
                           knnlm_metric="l2", log=said.append)
  assert ext.k == len(s["train"]) and "kNN-LM by L2" in said[-1] and "index_l2.faiss" in said[-1], said
  points = _l2_points(lam, theta)
  run = lambda e, streams: evaluate.evaluate(s["graphdef"], s["params"], s["dev"], points, block_len=BLOCK,
                                             context_window=CTX, streams=streams, external=e)
  res = run(ext, 2)
  got = {r.point.family: r.nll for r in res.scores}
  want = _brute_force_l2(s, lam, theta)
  for fam in want:
    assert got[fam] == pytest.approx(want[fam], rel=2e-5), fam
  ip = run(knn.ExternalMemory(str(s["tmp"] / "ds"), k=10_000, exact=exact), 2)
  got_ip = {r.point.family: r.nll for r in ip.scores}
  for fam in ("none", "trime", "interp", "cache"):  # the inner-product families: unchanged
    assert got[fam] == pytest.approx(got_ip[fam], rel=1e-6), fam
  for fam in ("knnlm", "knnlm_cache"):  # and the metric matters
    assert got[fam] != pytest.approx(got_ip[fam], rel=1e-3), fam
  np.testing.assert_array_equal(res.retrieval_hits, ip.retrieval_hits)  # retrieval accuracy: the IP search's
  one = run(knn.ExternalMemory(str(s["tmp"] / "ds"), k=10_000, exact=exact, knnlm_metric="l2"), 1)
  np.testing.assert_allclose([r.nll for r in one.scores], [r.nll for r in res.scores], rtol=1e-5)


def test_knnlm_by_l2_reads_the_l2_indexs_top_k(l2_setup):
  """K below the datastore: the kNN-LM families' K entries are the L2 index's nearest, not the inner-product
  search's top-K (which the test tells apart)."""
  s = l2_setup
  lam, theta, k = 0.3, 0.5, 6
  points = [evaluate.Point("knnlm", knn_lambda=lam, knn_theta=theta),
            evaluate.Point("knnlm_cache", knn_lambda=lam, knn_theta=theta)]
  ext = knn.ExternalMemory(str(s["tmp"] / "ds"), k=k, knnlm_metric="l2")
  res = evaluate.evaluate(s["graphdef"], s["params"], s["dev"], points, block_len=BLOCK, context_window=CTX,
                          streams=2, external=ext, search_queries=0)
  got = {r.point.family: r.nll for r in res.scores}
  want = _brute_force_l2(s, lam, theta, k=k)
  for fam in want:
    assert got[fam] == pytest.approx(want[fam], rel=2e-5), fam
  # the whole datastore's L2 distribution differs: K matters, so the entries above are the top-K by L2 ...
  assert want["knnlm"] != pytest.approx(_brute_force_l2(s, lam, theta)["knnlm"], rel=1e-3)
  # ... and not the inner-product search's top-K, re-scored by L2
  q = np.concatenate([np.asarray(s["model"](D.window_batch(s["dev"], [w], BLOCK)[0])[1][0])[
      np.nonzero(D.window_batch(s["dev"], [w], BLOCK)[2][0])[0]] for w in D.windows(len(s["dev"]), BLOCK, CTX)])
  by_ip = ext.index.search(q, k)[1]
  by_l2 = ext.l2_index.search(q, k)[1]
  assert np.mean([set(a) != set(b) for a, b in zip(by_ip, by_l2)]) > 0.3


def test_knnlm_by_l2_without_an_l2_index_is_one_error_naming_its_command(setup, tmp_path):
  import shutil

  from trime_jax import train_config

  s = setup
  ds = str(tmp_path / "ds")
  shutil.copytree(s["tmp"] / "ds", ds, ignore=shutil.ignore_patterns("index_l2.faiss*"))
  knn.ExternalMemory(ds, k=4)  # the inner-product default needs no L2 index
  with pytest.raises(ConfigError, match=r"eval.knnlm_metric=l2: the datastore .* has no L2 index "
                                        r"\(.*index_l2.faiss not found\): rerun .*trime_jax.launch.build_datastore"
                                        r".* with --index_metric=l2"):
    knn.ExternalMemory(ds, k=4, knnlm_metric="l2")
  with pytest.raises(ConfigError, match="eval.knnlm_metric must be one of"):
    knn.ExternalMemory(ds, k=4, knnlm_metric="cos")
  # the config field: "ip" by default, checked with the other eval fields
  c = default.get_config()
  assert c.eval.knnlm_metric == "ip"
  train_config.validate_config(c)
  c.eval.knnlm_metric = "l2"
  train_config.validate_config(c)
  c.eval.knnlm_metric = "L2"
  with pytest.raises(ConfigError, match=r"eval.knnlm_metric must be one of \('ip', 'l2'\), got 'L2'"):
    train_config.validate_config(c)
  c.eval.knnlm_metric, c.eval.datastore_on_device = "l2", True
  with pytest.raises(ConfigError, match="eval.knnlm_metric=l2 .* not supported with eval.datastore_on_device"):
    train_config.validate_config(c)
  assert evaluate.knnlm_metric_of(ml_collections.ConfigDict({})) == "ip"  # a config stored before the field
