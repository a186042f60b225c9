"""Generation: the key/value cache against the full forward pass, sampling against NumPy, the memory-augmented
next-token distribution against a float64 NumPy re-statement, batching, stopping, sliding windows, the
long-term store, an external datastore, bad input, and the CLI once."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import run_cli, tiny_config
from trime_jax import data, exports
from trime_jax.datastore import Datastore
from trime_jax import generate as G
from trime_jax import model as M
from trime_jax import scoring
from trime_jax.errors import CheckpointError, ConfigError
from trime_jax import specs

WORDS = ["</s>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "door", ".", ","]


def _export(path, vocab, seed=0, surgery=None, **model):
  """A randomly initialised tiny model exported like a trained one (generation only reads the export)."""
  overrides = {"model.num_layers": 2, "model.d_model": 16, "model.num_heads": 2, "model.d_ff": 32,
               "model.max_len": 32, "model.dropout": 0.0, "eval.tau": 0.5,
               **{f"model.{k}": v for k, v in model.items()}}
  cfg = tiny_config("unused.bin", **overrides)
  net = M.TransformerLM(specs.model_config(cfg, vocab_size=len(vocab)), rngs=nnx.Rngs(seed))
  if surgery:
    surgery(net)
  return exports.export(str(path), nnx.state(net, nnx.Param), cfg, vocab)


@pytest.fixture(scope="module")
def byte_gen(tmp_path_factory):
  return G.Generator(_export(tmp_path_factory.mktemp("gen") / "export", data.Vocab.bytes()), log=lambda m: None)


def _model(gen):
  return nnx.merge(gen.graphdef, gen.params)


@nnx.jit
def _full(model, tokens_1xL):
  """Uncached logits and keys of the whole (right-padded: causal, so padding changes nothing before it) row."""
  return model(tokens_1xL)


def _uncached(model, seq, length=32):
  """(logits [n, V], keys [n, D]) float64 of the uncached model over `seq` (one compilation per `length`)."""
  logits, keys = _full(model, jnp.asarray([list(seq) + [0] * (length - len(seq))]))
  return np.asarray(logits[0, :len(seq)], np.float64), np.asarray(keys[0, :len(seq)], np.float64)


_decode = nnx.jit(lambda model, tokens, cache, pos: model.decode(tokens, cache, pos))


# ----------------------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------------------
CACHE_VARIANTS = {
    "default": {},
    "learned_offset_no_final_norm": dict(positions="learned", position_offset=2, final_norm=False),
    "final_keys": dict(key_type="final"),
    "adaptive": dict(adaptive_input=True, adaptive_softmax=True, adaptive_cutoffs=(10, 30),
                     adaptive_input_factor=2.0, adaptive_softmax_factor=2.0),
}


@pytest.mark.parametrize("variant", list(CACHE_VARIANTS))
def test_cached_decoding_equals_the_full_forward(variant):
  """Rows of different lengths: a right-padded prefill, then one token per step at each row's own position;
  logits and keys equal the full forward of each row alone."""
  cfg = M.ModelConfig(vocab_size=50, num_layers=2, d_model=16, num_heads=2, d_ff=32, max_len=16, dropout=0.0,
                      **CACHE_VARIANTS[variant])
  model = M.TransformerLM(cfg, rngs=nnx.Rngs(0))
  rows = np.random.default_rng(1).integers(0, 50, (2, 14))
  prompt_len, total = [5, 3], [14, 11]
  cache = model.init_cache(2)
  inputs = np.zeros((2, 5), np.int32)
  for r in range(2):
    inputs[r, :prompt_len[r]] = rows[r, :prompt_len[r]]
  f, g, cache = _decode(model, jnp.asarray(inputs), cache, jnp.broadcast_to(jnp.arange(5), (2, 5)))
  got_f = [list(f[r, :prompt_len[r]]) for r in range(2)]
  got_g = [list(g[r, :prompt_len[r]]) for r in range(2)]
  for step in range(max(total) - min(prompt_len)):
    pos = np.array([min(prompt_len[r] + step, total[r] - 1) for r in range(2)])  # a finished row repeats
    f, g, cache = _decode(model, jnp.asarray(rows[np.arange(2), pos][:, None]), cache, jnp.asarray(pos[:, None]))
    for r in range(2):
      if prompt_len[r] + step < total[r]:
        got_f[r].append(f[r, 0])
        got_g[r].append(g[r, 0])
  for r in range(2):
    logits, keys = model(jnp.asarray(rows[r:r + 1, :total[r]]))
    np.testing.assert_allclose(model.logits(jnp.stack(got_f[r])[None]), logits, atol=1e-5)
    np.testing.assert_allclose(jnp.stack(got_g[r])[None], keys, atol=1e-5)


def test_one_prefill_of_a_whole_row_equals_features():
  """decode is additive: one prefill of a whole row over a full-length cache reproduces `features`."""
  cfg = M.ModelConfig(vocab_size=30, num_layers=1, d_model=16, num_heads=2, d_ff=32, max_len=8, dropout=0.0)
  model = M.TransformerLM(cfg, rngs=nnx.Rngs(3))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 30, (1, 8)))
  f, g = model.features(tokens)
  f2, g2, _ = model.decode(tokens, model.init_cache(1), jnp.arange(8)[None])
  np.testing.assert_allclose(f2, f, atol=1e-5)
  with pytest.raises(ValueError, match="cache length"):
    model.init_cache(1, 9)


# ----------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------
def np_keep(log_p, temperature, top_k, top_p):
  """Float64 reference of which tokens sampling may draw."""
  x = log_p.astype(np.float64) / temperature
  p = np.exp(x - x.max())
  p /= p.sum()
  keep = np.ones_like(p, bool)
  if top_k:
    keep &= p >= np.sort(p)[::-1][top_k - 1]
  if top_p < 1:
    q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    srt = np.sort(q)[::-1]
    last = int(np.argmax(np.cumsum(srt) >= top_p)) if np.cumsum(srt)[-1] >= top_p else len(srt) - 1
    keep &= q >= srt[last]
  return keep


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 1.0), (0.7, 0, 0.6), (1.3, 8, 0.5), (1.0, 0, 0.9),
                                                     (2.0, 3, 0.99)])
def test_top_k_top_p_masks_match_numpy(temperature, top_k, top_p):
  log_p = np.random.default_rng(top_k).normal(size=(6, 40)).astype(np.float32) * 2
  log_p[0, :3] = 4.0  # a tie at the top: kept together
  got = np.isfinite(np.asarray(G.filter_log_probs(jnp.asarray(log_p), temperature=temperature, top_k=top_k,
                                                  top_p=top_p)))
  want = np.stack([np_keep(r, temperature, top_k, top_p) for r in log_p])
  np.testing.assert_array_equal(got, want)
  # Draws come only from the kept tokens.
  s = G.Sampling(temperature, top_k, top_p, seed=0)
  draws = np.asarray(G.sample(jnp.asarray(np.repeat(log_p[1:2], 400, 0)), G.row_keys(0, np.arange(400), 0), s))
  assert want[1][draws].all() and len(set(draws)) > 1


def test_a_tiny_temperature_samples_the_most_probable_token():
  """A subnormal temperature (1e-40) is greedy in effect: it overflowed every tempered entry to -inf, and the
  draw was token 0 whatever the distribution (found by a review)."""
  log_p = jax.nn.log_softmax(jnp.asarray(np.random.default_rng(3).normal(size=(4, 30)), jnp.float32) * 3)
  filtered = G.filter_log_probs(log_p, temperature=1e-40)
  assert np.isfinite(np.asarray(filtered)).any(axis=1).all()
  draws = G.sample(log_p, G.row_keys(0, np.arange(4), 0), G.Sampling(1e-40))
  np.testing.assert_array_equal(draws, np.argmax(np.asarray(log_p), axis=1))


def test_sampling_is_deterministic_by_seed(byte_gen):
  run = lambda seed: byte_gen.generate(["def f(x):"], max_new_tokens=12, memory=G.MemorySpec("local"),
                                       sampling=G.Sampling(temperature=1.5, top_p=0.95, seed=seed))[0].tokens
  a = run(3)
  assert run(3) == a and run(4) != a
  greedy = byte_gen.generate(["def f(x):"], max_new_tokens=12, sampling=G.Sampling(temperature=0))[0].tokens
  assert greedy == byte_gen.generate(["def f(x):"], max_new_tokens=12, sampling=G.Sampling(0, seed=9))[0].tokens
  # The seed derives the keys outside the jitted step: a new seed (or any greedy call) compiles nothing more
  # (found by a review: each new seed compiled the step again)
  step = byte_gen.decoder._next_token
  compiled = step._cache_size()
  assert run(5) != a and run(6) != run(5) and step._cache_size() == compiled
  byte_gen.generate(["def f(x):"], max_new_tokens=12, sampling=G.Sampling(0, top_k=3, top_p=0.5, seed=11))
  assert step._cache_size() == compiled


# ----------------------------------------------------------------------------------------------------------
# The distribution
# ----------------------------------------------------------------------------------------------------------
def np_step(logits_V, q_D, keys_MxD, targets_M, tau, ext_M=None, lam=0.0, tau_prime=1.0):
  """P [V] of the TRIME distribution (+ Appendix A's mixture), float64, from the formula."""
  logits, q, k = (np.asarray(x, np.float64) for x in (logits_V, q_D, keys_MxD))
  sim = k @ q / math.sqrt(len(q))
  mass = np.exp(logits)
  for j, t in enumerate(targets_M):
    if t >= 0:
      mass[t] += math.exp(sim[j] / tau)
  p = mass / mass.sum()
  if lam and ext_M is not None and (ext_M & (targets_M >= 0)).any():
    prime = np.zeros_like(p)
    for j, t in enumerate(targets_M):
      if t >= 0 and ext_M[j]:
        prime[t] += math.exp(sim[j] / tau_prime)
    p = (1 - lam) * p + lam * prime / prime.sum()
  return p


@pytest.mark.parametrize("lam", [0.0, 0.3])
def test_next_token_distribution_matches_float64_numpy(lam):
  """Rows see different subsets of one memory (as rows see their own local and retrieved blocks)."""
  rng = np.random.default_rng(5)
  b, v, m, d = 3, 12, 20, 8
  logits = rng.normal(size=(b, v)).astype(np.float32)
  q = rng.normal(size=(b, d)).astype(np.float32) * 2
  keys = rng.normal(size=(m, d)).astype(np.float32) * 2
  targets = rng.integers(0, v, m).astype(np.int32)
  targets[8:10] = -1  # empty slots
  mask = rng.random((b, m)) < 0.7
  mask[2, 12:] = False  # row 2 sees no retrieved entry: the mixture falls back to P_trime
  prime = np.arange(m) >= 12
  got = G.next_token_log_probs(jnp.asarray(logits), jnp.asarray(q), jnp.asarray(keys), jnp.asarray(targets),
                               jnp.asarray(mask), tau=0.7, prime_M=jnp.asarray(prime), knn_lambda=lam,
                               tau_prime=0.4)
  for r in range(b):
    seen = np.where(mask[r], targets, -1)
    np.testing.assert_allclose(np.exp(np.asarray(got[r], np.float64)),
                               np_step(logits[r], q[r], keys, seen, 0.7, prime, lam, 0.4), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("lam", [0.0, 0.3])
def test_trace_parts_are_the_laws_terms(lam):
  """The retrieval trace's parts of P(token) (`scoring.log_contributions`): the vocabulary's and the memories'
  sum to exp(scoring.trime_log_probs) at the token, and each memory's part is its float64 term of the formula
  ((1-λ)·exp(sim/τ)/Z + λ·exp(sim/τ′)/Z′ for P′ memories; λ only where a row sees a P′ memory)."""
  rng = np.random.default_rng(7)
  b, v, m, d = 3, 12, 20, 8
  logits = rng.normal(size=(b, v)).astype(np.float32)
  q = rng.normal(size=(b, d)).astype(np.float32) * 2
  keys = rng.normal(size=(m, d)).astype(np.float32) * 2
  targets = rng.integers(0, 4, m).astype(np.int32)  # few tokens: several memories share one
  targets[8:10] = -1
  mask = rng.random((b, m)) < 0.7
  mask[2, 12:] = False  # row 2 sees no P′ memory: its parts are P_trime's
  prime = np.arange(m) >= 12
  tokens = np.array([targets[np.flatnonzero(mask[r] & (targets >= 0))[0]] for r in range(b)], np.int32)
  kw = dict(tau=0.7, prime_M=jnp.asarray(prime), knn_lambda=lam, tau_prime=0.4)
  args = (jnp.asarray(logits), jnp.asarray(q), jnp.asarray(keys), jnp.asarray(targets), jnp.asarray(mask))
  log_p = np.asarray(scoring.trime_log_probs(*args, **kw), np.float64)
  log_vocab, log_mem = (np.asarray(x, np.float64) for x in scoring.log_contributions(*args, jnp.asarray(tokens), **kw))
  for r in range(b):
    w = tokens[r]
    np.testing.assert_allclose(np.exp(log_vocab[r]) + np.exp(log_mem[r]).sum(), np.exp(log_p[r, w]), rtol=2e-5)
    sim = keys.astype(np.float64) @ q[r].astype(np.float64) / math.sqrt(d)
    vis = mask[r] & (targets >= 0)
    z = np.logaddexp.reduce(np.concatenate([logits[r].astype(np.float64), sim[vis] / 0.7]))
    in_prime = vis & prime
    lam_r = lam if in_prime.any() else 0.0
    want = np.where(vis & (targets == w), (1 - lam_r) * np.exp(sim / 0.7 - z), 0.0)
    if lam_r:
      z_prime = np.logaddexp.reduce(sim[in_prime] / 0.4)
      want = want + np.where(in_prime & (targets == w), lam_r * np.exp(sim / 0.4 - z_prime), 0.0)
    np.testing.assert_allclose(np.exp(log_mem[r]), want, rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(np.exp(log_vocab[r]), (1 - lam_r) * np.exp(logits[r, w] - z), rtol=2e-5)


def test_a_generated_step_equals_the_numpy_restatement(byte_gen):
  """Local memory: P(token) and the share from memory of every traced step, recomputed in float64 from the
  uncached model over the whole sequence (its logits at the last position, its keys of every earlier one)."""
  model, tau = _model(byte_gen), 0.5
  prompt = "abcabcab"
  out = byte_gen.generate([prompt], max_new_tokens=6, sampling=G.Sampling(0), trace=True,
                          memory=G.MemorySpec("local", tau=tau))[0]
  seq = [byte_gen.vocab.bos] + list(prompt.encode()) + out.tokens
  n0 = len(prompt) + 1
  for i, step in enumerate(out.trace):
    ctx = seq[:n0 + i]
    logits, keys = _uncached(model, ctx)
    targets = np.asarray(ctx[1:])
    p = np_step(logits[-1], keys[-1], keys[:-1], targets, tau)
    w = seq[n0 + i]
    assert w == int(np.argmax(p))
    np.testing.assert_allclose(step.prob, p[w], rtol=1e-4)
    mem = sum(math.exp(keys[j] @ keys[-1] / 4.0 / tau) for j in range(len(targets)) if targets[j] == w)
    np.testing.assert_allclose(step.memory_share, mem / (mem + math.exp(logits[-1, w])), rtol=1e-4, atol=1e-7)
    assert all(m.source == "local" and m.token == chr(w) for m in step.top)
    assert step.top == sorted(step.top, key=lambda m: -m.share)


def test_batched_prompts_equal_one_by_one(byte_gen):
  prompts = ["import os", "x = [1, 2, 3]\nfor", "def"]
  kw = dict(max_new_tokens=10, sampling=G.Sampling(0), memory=G.MemorySpec("local", tau=0.5))
  batched = [o.tokens for o in byte_gen.generate(prompts, **kw)]
  assert batched == [byte_gen.generate([p], **kw)[0].tokens for p in prompts]


def test_sliding_window_equals_the_uncached_reference():
  """A prompt longer than max_len and a generation past it (a note, said once); greedy tokens equal the
  uncached model over the same windows (the last max_len // 2 tokens after each slide)."""
  import tempfile

  notes = []
  with tempfile.TemporaryDirectory() as tmp:
    gen = G.Generator(_export(f"{tmp}/e", data.Vocab.bytes(), seed=2), log=notes.append)
    prompt = "for i in range(10):\n    print(i, i * i)\n"  # 41 bytes + bos > max_len = 32
    out = gen.generate([prompt], max_new_tokens=30, sampling=G.Sampling(0), memory=G.MemorySpec("none"))[0]
  assert len(notes) == 1 and "longer than the model's context" in notes[0] and "sliding window" in notes[0]
  model, keep = _model(gen), 16
  seq = [gen.vocab.bos] + list(prompt.encode())
  start, want = len(seq) - keep, []
  for _ in range(30):
    if len(seq) - start > 32:
      start = len(seq) - keep
    t = int(np.argmax(_uncached(model, seq[start:])[0][-1]))
    want.append(t)
    seq.append(t)
  assert out.tokens == want


def test_a_row_ending_on_the_token_that_fills_its_window_does_not_break_the_batch(tmp_path):
  """Row A writes </s> as the 33rd token of its 32-token window (so it is finished and did not slide), row B slides
  later: the re-encoding of every row's window took A's 33 tokens into 32 slots (a ValueError); now each row
  gets what it gets alone (found by a review)."""
  gen = G.Generator(_export(tmp_path / "w", data.Vocab(WORDS)), log=lambda m: None)
  a_prompt = "the cat sat on a mat .\n" * 3 + "the cat sat on"  # bos + 28 tokens; copies "a mat . </s>"
  kw = dict(max_new_tokens=40, sampling=G.Sampling(0), memory=G.MemorySpec("local"))
  a, b = gen.generate([a_prompt], **kw)[0], gen.generate(["a dog"], **kw)[0]
  assert a.stopped == "eos" and len(gen.tokenize(a_prompt)) + 1 + len(a.tokens) == 33  # </s> fills the window
  assert b.stopped == "budget" and len(b.tokens) == 40  # B slides after A has finished
  assert [o.tokens for o in gen.generate([a_prompt, "a dog"], **kw)] == [a.tokens, b.tokens]


# ----------------------------------------------------------------------------------------------------------
# Stopping, words, memories, errors
# ----------------------------------------------------------------------------------------------------------
def _eos_always(net):
  """Every position's output is a constant u whose best match is </s> (id 0)."""
  u = jnp.ones((16,))
  net.final_norm.scale[...] = jnp.zeros((16,))
  net.final_norm.bias[...] = u
  net.embed.embedding[...] = net.embed.embedding[...].at[0].set(5 * u)


def test_word_model_stops_at_eos_and_maps_unknown_words(tmp_path):
  vocab = data.Vocab(WORDS)
  notes = []
  gen = G.Generator(_export(tmp_path / "w", vocab, surgery=_eos_always), log=notes.append)
  out = gen.generate(["the cat sat on the zebra"], max_new_tokens=5, sampling=G.Sampling(0))[0]
  assert out.stopped == "eos" and out.tokens == [0] and out.text == ""
  assert len(notes) == 1 and "zebra" in notes[0] and "<unk>" in notes[0]
  full = gen.generate(["the cat"], max_new_tokens=3, sampling=G.Sampling(0), stop_at_eos=False)[0]
  assert full.stopped == "budget" and full.tokens == [0, 0, 0] and full.text == "\n\n\n"
  assert gen.tokenize("the cat\nsat") == [2, 3, 0, 4]
  assert gen.detokenize([2, 3, 0, 4, 12]) == "the cat\nsat ."


def test_long_term_store_is_read_and_carried_across_calls(byte_gen):
  store = byte_gen.new_store()
  n = byte_gen.read(store, "The password is swordfish. " * 3)
  assert n == len(store) == 81
  np.testing.assert_allclose(store.keys[:20], byte_gen.keys_of(list(b"The password is swordfish. " * 3))[:20])
  spec = G.MemorySpec("long", tau=0.3)
  stored_keys, stored_tokens = store.keys.copy(), store.tokens.copy()
  out = byte_gen.generate(["The password is s"], max_new_tokens=4, sampling=G.Sampling(0), memory=spec,
                          store=store, trace=True)[0]
  assert len(store) == n + len("The password is s") + 4  # this call's prompt and output were appended
  assert any(m.source == "long" for s in out.trace for m in s.top)
  # The first step in float64: the prompt's own keys and the store's, one softmax with the vocabulary.
  seq = [byte_gen.vocab.bos] + list(b"The password is s")
  logits, keys = _uncached(_model(byte_gen), seq)
  p = np_step(logits[-1], keys[-1], np.concatenate([keys[:-1], stored_keys]),
              np.concatenate([seq[1:], stored_tokens]), 0.3)
  np.testing.assert_allclose(out.trace[0].prob, p[out.tokens[0]], rtol=1e-4)
  before = len(store)
  byte_gen.generate(["x"], max_new_tokens=2, memory=spec, store=store, remember=False)
  assert len(store) == before


def _byte_datastore(directory, gen, repeats):
  """A datastore (+ flat index) of `gen`'s model over a repeated line of code."""
  from trime_jax.datastore import build_datastore, build_index

  text = b"def add(a, b):\n    return a + b\n\n" * repeats
  corpus = data.Corpus(np.frombuffer(text, np.uint8).astype(np.int32), np.array([0, len(text)]), gen.vocab)
  build_datastore(gen.checkpoint_dir, corpus, str(directory), block_len=32, context_window=16, batch_size=4,
                  progress=False)
  build_index(Datastore(str(directory)), kind="flat", progress=False)
  return str(directory)


def test_external_datastore_generation_and_mismatch(tmp_path, byte_gen):
  ds_dir = _byte_datastore(tmp_path / "ds", byte_gen, 20)
  ext = byte_gen.external(ds_dir, k=8)
  spec = G.MemorySpec("external", tau=0.5)
  out = byte_gen.generate(["def add(a"], max_new_tokens=5, sampling=G.Sampling(0), memory=spec, external=ext,
                          trace=True)[0]
  assert any(m.source == "external" for s in out.trace for m in s.top)
  assert all(0 < s.prob <= 1 and 0 <= s.memory_share <= 1 for s in out.trace)
  # The first step in float64: brute-force top-8 of the datastore's keys, plus the prompt's own keys.
  seq = [byte_gen.vocab.bos] + list(b"def add(a")
  logits, keys = _uncached(_model(byte_gen), seq)
  ds = Datastore(ds_dir)
  ds_keys = np.asarray(ds.keys, np.float64)
  top = np.argsort(-(ds_keys @ keys[-1]), kind="stable")[:8]
  p = np_step(logits[-1], keys[-1], np.concatenate([keys[:-1], ds_keys[top]]),
              np.concatenate([seq[1:], np.asarray(ds.values)[top]]), 0.5)
  np.testing.assert_allclose(out.trace[0].prob, p[out.tokens[0]], rtol=1e-4)
  mixed = byte_gen.generate(["def add(a"], max_new_tokens=5, sampling=G.Sampling(0), external=ext, trace=True,
                            memory=G.MemorySpec("external", tau=0.5, knn_lambda=0.5, tau_prime=0.2))[0]
  assert [s.prob for s in mixed.trace] != [s.prob for s in out.trace]
  # Appendix A's mixture in the trace: the shares are the mixed law's parts of P(token).
  assert all(0 <= s.memory_share <= 1 and sum(m.share for m in s.top) <= s.memory_share + 1e-6 for s in mixed.trace)
  # The CLI takes τ′ from the export's eval.tau_prime when --tau_prime is not given, as τ from eval.tau (it used
  # 1.0: a 247M export's tuned τ′ is 0.328): an export whose config says τ = 0.5, τ′ = 0.2 generates `mixed`
  import json
  import shutil

  tuned = tmp_path / "tuned_export"
  shutil.copytree(byte_gen.checkpoint_dir, tuned)
  cfg = json.loads((tuned / "config.json").read_text())
  cfg["eval"].update(tau=0.5, tau_prime=0.2)
  (tuned / "config.json").write_text(json.dumps(cfg))
  r = run_cli("trime_jax.launch.generate", f"--checkpoint={tuned}", "--prompt=def add(a", "--memory=external",
              f"--datastore={ds_dir}", "--knn_k=8", "--knn_lambda=0.5", "--temperature=0", "--max_new_tokens=5")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "tau=0.5 knn_lambda=0.5 tau_prime=0.2 interp_memory=external" in r.stdout, r.stdout
  assert "def add(a\u2502" + mixed.text in r.stdout, (mixed.text, r.stdout)
  other = G.Generator(_export(tmp_path / "other", data.Vocab.bytes(), seed=7))
  with pytest.raises(CheckpointError, match="built by another model or vocabulary.*does not match"):
    other.external(ds_dir, k=8)


def test_external_memory_is_scored_as_evaluation_scores_it(tmp_path, byte_gen):
  """With an IVF-PQ index, generation's first-step law = the formula over the prompt's keys and the entries the
  evaluator retrieves (`knn.ExternalMemory.retrieve`) with the similarities it uses: the index's approximate
  scores when not exact, the stored keys' exact ones with exact (found by a review: generation always rescored
  exactly, so a τ tuned by eval_ext on approximate scores met other similarities)."""
  from trime_jax.datastore import build_index

  ds_dir = _byte_datastore(tmp_path / "ds", byte_gen, 40)
  ivf = str(tmp_path / "ds" / "ivfpq.faiss")
  build_index(Datastore(ds_dir), ivf, kind="ivfpq", nlist=4, pq_m=4, pq_bits=4, progress=False)
  seq = [byte_gen.vocab.bos] + list(b"def add(a")
  logits, keys = _uncached(_model(byte_gen), seq)
  local_sim = keys[:-1] @ keys[-1] / math.sqrt(keys.shape[1])
  spec = G.MemorySpec("external", tau=0.5)
  probs = {}
  for exact in (False, True):
    ext = byte_gen.external(ds_dir, index_path=ivf, k=8, nprobe=4, exact=exact, log=lambda m: None)
    got = ext.retrieve(keys[-1:].astype(np.float32))
    sim = np.concatenate([local_sim, got.sim[0].astype(np.float64)])
    targets = np.concatenate([seq[1:], got.targets[0]])
    mass = np.exp(logits[-1])
    for s_j, t in zip(sim, targets):
      if t >= 0:
        mass[t] += math.exp(s_j / 0.5)
    out = byte_gen.generate(["def add(a"], max_new_tokens=1, sampling=G.Sampling(0), memory=spec, external=ext,
                            trace=True)[0]
    probs[exact] = out.trace[0].prob
    np.testing.assert_allclose(out.trace[0].prob, mass[out.tokens[0]] / mass.sum(), rtol=1e-4)
  assert abs(probs[True] - probs[False]) > 1e-4 * probs[True]  # 4-bit PQ scores are not the exact ones


def test_external_defaults_are_the_exports_evaluation_settings(tmp_path, byte_gen):
  """`Generator.external` without k / nprobe / exact takes them from the export's eval (as launch.eval_ext and the
  API do: `retrieval_settings`, one place); before, it searched with k=1024, nprobe=32, approximate scores
  whatever the export was evaluated with."""
  import json
  import shutil

  from trime_jax.datastore import build_index

  ds_dir = _byte_datastore(tmp_path / "ds", byte_gen, 40)
  ivf = str(tmp_path / "ds" / "ivfpq.faiss")
  build_index(Datastore(ds_dir), ivf, kind="ivfpq", nlist=4, pq_m=4, pq_bits=4, progress=False)
  tuned = tmp_path / "tuned_export"
  shutil.copytree(byte_gen.checkpoint_dir, tuned)
  cfg = json.loads((tuned / "config.json").read_text())
  cfg["eval"].update(knn_k=6, nprobe=3, knn_exact=True)
  (tuned / "config.json").write_text(json.dumps(cfg))
  gen = G.Generator(str(tuned))
  ext = gen.external(ds_dir, index_path=ivf, log=lambda m: None)
  assert (ext.k, ext.exact, ext.index.nprobe) == (6, True, 3)
  ext = gen.external(ds_dir, index_path=ivf, k=5, nprobe=2, exact=False, log=lambda m: None)  # arguments win
  assert (ext.k, ext.exact, ext.index.nprobe) == (5, False, 2)
  assert G.retrieval_settings(byte_gen.config, k=7) == {
      "k": 7, "nprobe": int(byte_gen.config.eval.nprobe), "exact": bool(byte_gen.config.eval.get("knn_exact", False)),
      "gpu": bool(byte_gen.config.eval.get("knn_gpu", False))}


def test_on_device_datastore_generation_is_every_entry_exactly(tmp_path, byte_gen):
  """memory=external with the datastore on the devices = FAISS flat with K = every entry (greedy tokens), and
  its first step's distribution = float64 NumPy over the prompt's keys and every datastore entry."""
  from trime_jax import exact_memory

  ds_dir = _byte_datastore(tmp_path / "ds", byte_gen, 8)
  ds = Datastore(ds_dir)
  device = byte_gen.on_device(ds_dir)
  spec = G.MemorySpec("external", tau=0.5)
  every = byte_gen.generate(["def add(a"], max_new_tokens=5, sampling=G.Sampling(0), memory=spec,
                            external=byte_gen.external(ds_dir, k=ds.count))[0]
  exact = byte_gen.generate(["def add(a"], max_new_tokens=5, sampling=G.Sampling(0), memory=spec, external=device)[0]
  assert exact.tokens == every.tokens
  seq = [byte_gen.vocab.bos] + list(b"def add(a")
  logits, keys = _uncached(_model(byte_gen), seq)
  q = jnp.asarray(keys[-1:], jnp.float32)
  base = scoring.memory_log_weights(jnp.asarray(logits[-1:], jnp.float32), q, jnp.asarray(keys[:-1], jnp.float32),
                                    jnp.asarray(seq[1:], jnp.int32), jnp.ones((1, len(seq) - 1), bool), tau=0.5)
  got = np.exp(np.asarray(exact_memory.exact_external_log_probs(base, q, device, tau=0.5), np.float64))[0]
  want = np_step(logits[-1], keys[-1], np.concatenate([keys[:-1], np.asarray(ds.keys, np.float64)]),
                 np.concatenate([seq[1:], np.asarray(ds.values)]), 0.5)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
  with pytest.raises(ConfigError, match="need a FAISS index"):
    byte_gen.generate(["a"], memory=spec, external=device, trace=True)
  other = G.Generator(_export(tmp_path / "other", data.Vocab.bytes(), seed=7))
  with pytest.raises(CheckpointError, match="built by another model or vocabulary"):
    other.on_device(ds_dir)


def test_bad_input_is_a_clear_error(byte_gen):
  with pytest.raises(ConfigError, match="prompt is empty"):
    byte_gen.generate([""])
  with pytest.raises(ConfigError, match="needs a long-term store"):
    byte_gen.generate(["a"], memory=G.MemorySpec("long"))
  with pytest.raises(ConfigError, match="needs a datastore"):
    byte_gen.generate(["a"], memory=G.MemorySpec("external"))
  with pytest.raises(ConfigError, match="top_p"):
    G.Sampling(top_p=0)
  with pytest.raises(ConfigError, match="memory=external"):
    G.MemorySpec("local", knn_lambda=0.2)
  with pytest.raises(ConfigError, match="max_new_tokens"):
    byte_gen.generate(["a"], max_new_tokens=0)
  # Each wrong type is one ConfigError naming the argument, not an error deep in a jitted function
  for call, message in [
      (lambda: byte_gen.generate(["a"], memory="lng"), r"^memory must be one of"),
      (lambda: byte_gen.generate(["a"], memory=3), r"^memory must be a MemorySpec or one of"),
      (lambda: byte_gen.generate(b"abc"), r"^prompts are text: decode bytes first"),
      (lambda: byte_gen.generate([b"abc"]), r"^prompt 0 is bytes"),
      (lambda: byte_gen.generate([3.5]), r"^prompt 0 must be a string or a list of token ids, got float"),
      (lambda: byte_gen.generate(["a"], max_new_tokens=2.5), r"^max_new_tokens must be an integer >= 1"),
      # a memory larger than the machine: one error, not NumPy's MemoryError (found by a walk-through)
      (lambda: byte_gen.generate(["a"], max_new_tokens=10**12),
       r"^max_new_tokens=1,000,000,000,000: the local memory of 1 row\(s\) x .* GiB, more than half of this machine"),
      (lambda: byte_gen.generate(["a"], sampling={"temperature": 0}), r"^sampling must be a generate.Sampling"),
      (lambda: G.Sampling(seed=2**31), r"^seed must be an integer in \[-2\*\*31, 2\*\*31\)"),
      (lambda: G.Sampling(seed=-2**31 - 1), r"^seed must be an integer"),
      (lambda: G.Sampling(top_k=2.5), r"^top_k must be an integer >= 0"),
      (lambda: G.Sampling(temperature="1"), r"^temperature must be a finite number >= 0"),
      (lambda: G.Sampling(temperature=float("inf")), r"^temperature must be a finite number >= 0"),
      (lambda: G.MemorySpec("local", tau="1"), r"^tau must be a number"),
  ]:
    with pytest.raises(ConfigError, match=message):
      call()
  # a memory kind as a string is the MemorySpec of that kind; token ids (NumPy integers too) are one prompt
  kw = dict(max_new_tokens=3, sampling=G.Sampling(0))
  with pytest.raises(ConfigError, match="needs a long-term store"):
    byte_gen.generate(["a"], memory="long")
  assert byte_gen.generate(["ab"], memory="none", **kw)[0].tokens == byte_gen.generate(
      ["ab"], memory=G.MemorySpec("none"), **kw)[0].tokens
  ids = [np.int64(97), np.int64(98)]
  assert [g.tokens for g in byte_gen.generate(ids, **kw)] == [byte_gen.generate(["ab"], **kw)[0].tokens]
  assert G.Sampling(seed=2**31 - 1).seed == 2**31 - 1 and G.Sampling(seed=-2**31).seed == -2**31


def test_cli_generates_with_a_memory_file_and_reports_errors_in_one_line(tmp_path, byte_gen):
  mem = tmp_path / "notes.txt"
  mem.write_text("print('hello world')\n" * 4)
  r = run_cli("trime_jax.launch.generate", f"--checkpoint={byte_gen.checkpoint_dir}", "--prompt=print('hel",
              "--prompt=x", "--memory=long", f"--memory_file={mem}", "--max_new_tokens=6", "--temperature=0",
              "--trace")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "long-term memory: 84 tokens" in r.stdout and r.stdout.count("=== prompt") == 2
  assert "retrieval trace" in r.stdout and "memory" in r.stdout
  r = run_cli("trime_jax.launch.generate", f"--checkpoint={byte_gen.checkpoint_dir}", "--prompt=", "--memory=none")
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert [l for l in r.stderr.splitlines() if l.startswith("error:")] == ["error: the prompt is empty"]
  # refused before the long-term memory is read and the settings line printed (it came after both)
  r = run_cli("trime_jax.launch.generate", f"--checkpoint={byte_gen.checkpoint_dir}", "--prompt=x", "--prompt=",
              "--memory=long", f"--memory_file={mem}")
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "error: the prompt is empty"
  assert "long-term memory" not in r.stdout and "memory=long" not in r.stdout, r.stdout
  # --datastore_on_device conflicts are refused before the datastore is read (it does not even exist here).
  missing = tmp_path / "no_such_ds"
  for extra, want in ((("--memory=external", "--trace"), "--trace needs a FAISS index"),
                      (("--memory=external", "--knn_lambda=0.3", f"--index={missing}/index.faiss"),
                       "--knn_lambda, --index need a FAISS index"),
                      (("--memory=external", "--knn_k=8"), "--knn_k needs a FAISS index"),  # not silently unused
                      (("--memory=local",), "use --memory=external, not local")):
    r = run_cli("trime_jax.launch.generate", f"--checkpoint={byte_gen.checkpoint_dir}", "--prompt=x",
                "--datastore_on_device", *(() if "--memory=local" in extra else (f"--datastore={missing}",)), *extra)
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and want in errors[0], (extra, r.stderr[-2000:])


def test_cli_refuses_settings_its_memory_would_not_read(byte_gen):
  """Retrieval flags without --memory=external, P′'s without --knn_lambda, --tau with no memory: one error each
  (they were accepted and silently unused; the Python API refuses them too)."""
  for extra, want in ((("--memory=local", "--knn_k=5"), "--knn_k sets retrieval from --datastore"),
                      (("--nprobe=4", "--index=x.faiss"), "--index, --nprobe set retrieval"),
                      (("--memory=long", "--memory_file=x", "--knn_k=5"), "--memory=long retrieves nothing"),
                      (("--memory=local", "--tau_prime=0.5"), "--tau_prime sets Appendix A's P′"),
                      (("--memory=none", "--tau=2"), "--memory=none uses no memory")):
    r = run_cli("trime_jax.launch.generate", f"--checkpoint={byte_gen.checkpoint_dir}", "--prompt=x", *extra)
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and want in errors[0], (extra, r.stderr[-2000:])


def test_p_prime_without_a_mask_is_over_every_memory():
  """prime_M=None (the public functions' default): Appendix A's P′ over every visible memory, the same as an
  all-True mask (it was a TypeError)."""
  rng = np.random.default_rng(9)
  b, v, m, d = 2, 10, 12, 8
  args = tuple(jnp.asarray(x) for x in (rng.normal(size=(b, v)).astype(np.float32),
                                         rng.normal(size=(b, d)).astype(np.float32),
                                         rng.normal(size=(m, d)).astype(np.float32),
                                         rng.integers(0, v, m).astype(np.int32), rng.random((b, m)) < 0.8))
  kw = dict(tau=0.7, knn_lambda=0.3, tau_prime=0.4)
  every = jnp.ones((m,), bool)
  np.testing.assert_array_equal(scoring.trime_log_probs(*args, **kw),
                                scoring.trime_log_probs(*args, prime_M=every, **kw))
  tokens = jnp.asarray(np.asarray(args[3])[:b])
  for got, want in zip(scoring.log_contributions(*args, tokens, **kw),
                       scoring.log_contributions(*args, tokens, prime_M=every, **kw)):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(G.next_token_log_probs(*args, **kw),
                                G.next_token_log_probs(*args, prime_M=every, **kw))


def test_a_model_trained_without_memory_generates_without_it_by_default(tmp_path, byte_gen):
  """The API, Generator.generate and the CLI agree on the default memory: none for an export trained with
  trime.memory=none, local otherwise (the CLI and Generator used local for every export, mixing a memory
  term into the vanilla model's law); a byte model's --prompt_file is the file's whole text, final newline
  included (word models drop it: it would end the line to continue)."""
  cfg = tiny_config("unused.bin", **{"model.num_layers": 2, "model.d_model": 16, "model.num_heads": 2,
                                     "model.d_ff": 32, "model.max_len": 32, "model.dropout": 0.0, "eval.tau": 0.5,
                                     "trime.memory": "none"})
  vocab = data.Vocab.bytes()
  net = M.TransformerLM(specs.model_config(cfg, vocab_size=len(vocab)), rngs=nnx.Rngs(0))
  vanilla = G.Generator(exports.export(str(tmp_path / "vanilla"), nnx.state(net, nnx.Param), cfg, vocab),
                        log=lambda m: None)
  assert (vanilla.default_memory, byte_gen.default_memory) == ("none", "local")
  kw = dict(max_new_tokens=6, sampling=G.Sampling(0), trace=True)
  default = vanilla.generate(["abcabcabcab"], **kw)[0]
  assert default.tokens == vanilla.generate(["abcabcabcab"], memory="none", **kw)[0].tokens
  assert all(s.memory_share == 0 for s in default.trace)
  prompt = tmp_path / "prompt.py"
  prompt.write_text("abcabcabcab\n")
  r = run_cli("trime_jax.launch.generate", f"--checkpoint={tmp_path / 'vanilla'}", f"--prompt_file={prompt}",
              "--max_new_tokens=6", "--temperature=0")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "memory=none " in r.stdout
  with_newline = vanilla.generate(["abcabcabcab\n"], memory="none", **kw)[0]
  assert "abcabcabcab\n\u2502" + with_newline.text in r.stdout, r.stdout
