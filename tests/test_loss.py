"""The TRIME objective against the float64 NumPy reference (tests/reference.py)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference as ref
from trime_jax import loss, scoring, sharded_loss, sharding
from trime_jax import specs

# (memory, m, variant): variant False / True = drop_local for every row; "rows" = drop_local per row (mixed);
# "docs" = packed long-term runs whose rows hold several documents (per-token document ids).
MODES = [("none", 1, False), ("local", 1, False), ("long", 2, False), ("long", 3, False), ("long", 3, "docs"),
         ("ext", 1, False), ("ext", 1, True), ("ext", 1, "rows")]


def _opts(variant, b, l):
  """(drop_local, documents) of a MODES variant for a [b, l] batch (same values for JAX and the reference)."""
  if variant == "rows":
    return np.arange(b) % 3 == 1, None  # rows 1 and 4 drop local memory, the others keep it
  if variant == "docs":
    # Document boundaries inside rows and at row starts; ids increase along the stream like a packed run.
    starts = np.zeros(b * l, int)
    starts[[l // 2, l + 1, 3 * l, 3 * l + l - 2, 5 * l + 2]] = 1
    return False, np.cumsum(starts).reshape(b, l)
  return variant, None


def _batch(rng, b=6, l=7, d=5, v=6, pad=True, key_scale=3.0):
  """A small batch with few distinct targets (so memories often match) and some padding."""
  logits = rng.normal(size=(b, l, v))
  keys = rng.normal(size=(b, l, d)) * key_scale
  targets = rng.integers(0, v, size=(b, l))
  if pad:
    targets[1, -3:] = -1  # tail padding
    targets[b - 2, :2] = -1  # head padding
    targets[-1, :] = -1  # an all-padding row
  return logits, keys, targets


@pytest.mark.parametrize("memory,m,drop_local", MODES)
@pytest.mark.parametrize("tau", [1.0, 0.37, 2.5])
@pytest.mark.parametrize("implementation,chunk", [("blockwise", 5), ("blockwise", 64), ("dense", None),
                                                  ("auto", None)])
def test_trime_nll_matches_reference(memory, m, drop_local, tau, implementation, chunk):
  rng = np.random.default_rng(hash((memory, m, drop_local, tau)) % 2**32)
  logits, keys, targets = _batch(rng)
  drop, docs = _opts(drop_local, *targets.shape)
  want = ref.trime_nll(logits, keys, targets, memory, m, drop, tau, docs)
  with jax.enable_x64(True):
    got = loss.trime_nll(jnp.asarray(logits), jnp.asarray(keys), jnp.asarray(targets), memory=memory,
                         consecutive_segments=m, drop_local=drop, documents=docs, tau=tau,
                         implementation=implementation, memory_chunk=chunk)
    got = np.asarray(got)
  assert got.dtype == np.float64
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
  assert np.all(got[targets < 0] == 0.0)


def test_masking_is_exact_and_memory_matters():
  """No visible memory -> exactly the plain softmax; memory without the target only adds to the normaliser."""
  rng = np.random.default_rng(0)
  logits, keys, targets = _batch(rng, pad=False)
  with jax.enable_x64(True):
    ce = np.asarray(loss.trime_nll(logits, keys, targets, memory="none"))
    local = np.asarray(loss.trime_nll(logits, keys, targets, memory="local", memory_chunk=3))
  # Token 0 of every segment has no local memory: identical to CE, bit for bit.
  assert np.array_equal(local[:, 0], ce[:, 0])
  seen = np.array([[targets[b, t] in targets[b, :t] for t in range(targets.shape[1])]
                   for b in range(targets.shape[0])])
  unseen = ~seen
  unseen[:, 0] = False
  # Visible memory but no memory with the target: nll strictly above CE.
  assert unseen.any() and np.all(local[unseen] > ce[unseen])
  # Some token whose target is in memory must differ from CE.
  assert seen.any() and not np.allclose(local[seen], ce[seen])


@pytest.mark.parametrize("memory,m,drop_local", MODES[1:])
def test_gradients_match_finite_differences(memory, m, drop_local):
  """d nll / d keys (as query and as memory) and d nll / d logits against central differences of the
  float64 reference."""
  rng = np.random.default_rng(1)
  logits, keys, targets = _batch(rng, b=6, l=3, d=3, v=4, key_scale=1.5)
  weights = rng.normal(size=targets.shape)  # a random linear functional of the nll
  drop, docs = _opts(drop_local, *targets.shape)

  def ref_obj(lg, ks):
    return float((ref.trime_nll(lg, ks, targets, memory, m, drop, 0.8, docs) * weights).sum())

  with jax.enable_x64(True):
    f = lambda lg, ks: (loss.trime_nll(lg, ks, jnp.asarray(targets), memory=memory, consecutive_segments=m,
                                       drop_local=drop, documents=docs, tau=0.8, memory_chunk=3)
                        * weights).sum()
    g_logits, g_keys = jax.grad(f, argnums=(0, 1))(jnp.asarray(logits), jnp.asarray(keys))
    g_logits, g_keys = np.asarray(g_logits), np.asarray(g_keys)

  eps = 1e-6
  for x, g, name in [(keys, g_keys, "keys"), (logits, g_logits, "logits")]:
    fd = np.zeros_like(x)
    for idx in itertools.product(*map(range, x.shape)):
      xp, xm = x.copy(), x.copy()
      xp[idx] += eps
      xm[idx] -= eps
      args_p = (logits, xp) if name == "keys" else (xp, keys)
      args_m = (logits, xm) if name == "keys" else (xm, keys)
      fd[idx] = (ref_obj(*args_p) - ref_obj(*args_m)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-7, err_msg=name)
  assert np.abs(g_keys).sum() > 0


@pytest.mark.parametrize("memory,m,drop_local", MODES[1:])
@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
def test_a_learned_tau_gets_its_gradient_on_every_path(memory, m, drop_local, implementation):
  """τ may be traced (`ObjectiveSpec.tau`): d nll / d τ against a central difference of the float64 reference.
  The blockwise path's custom VJP once returned no cotangent for the scale: d/dτ was silently 0 there, and
  `implementation="auto"` picks that path by batch size."""
  rng = np.random.default_rng(2)
  logits, keys, targets = _batch(rng, b=6, l=3, d=3, v=4, key_scale=1.5)
  weights = rng.normal(size=targets.shape)
  drop, docs = _opts(drop_local, *targets.shape)
  ref_obj = lambda tau: float((ref.trime_nll(logits, keys, targets, memory, m, drop, tau, docs) * weights).sum())
  with jax.enable_x64(True):
    f = lambda tau: (loss.trime_nll(jnp.asarray(logits), jnp.asarray(keys), jnp.asarray(targets), memory=memory,
                                    consecutive_segments=m, drop_local=drop, documents=docs, tau=tau,
                                    implementation=implementation, memory_chunk=3) * weights).sum()
    g = float(jax.grad(f)(0.8))
  eps = 1e-6
  fd = (ref_obj(0.8 + eps) - ref_obj(0.8 - eps)) / (2 * eps)
  assert g == pytest.approx(fd, rel=1e-6, abs=1e-8) and abs(fd) > 1e-3


def test_gradient_into_separate_memory_keys_and_stop_gradient():
  """With distinct query and memory keys: blockwise d/d memory_keys matches finite differences of the
  reference; stop_gradient_memory keeps only the query-side gradient."""
  rng = np.random.default_rng(2)
  n, mm, d, v = 5, 9, 3, 4
  logits = rng.normal(size=(n, v))
  q = rng.normal(size=(n, d))
  k = rng.normal(size=(mm, d))
  t = rng.integers(0, v, n)
  mt = rng.integers(0, v, mm)
  mt[3] = -1
  mask = rng.random((n, mm)) < 0.6
  mask[0] = False  # a query with no memory at all
  w = rng.normal(size=n)

  def ref_obj(qq, kk):
    return float((ref.memory_nll(logits, qq, t, kk, mt, mask, 1.3) * w).sum())

  with jax.enable_x64(True):
    f = lambda qq, kk: (loss.memory_nll(logits, qq, t, kk, mt, mask, tau=1.3) * w).sum()
    gq, gk = map(np.asarray, jax.grad(f, argnums=(0, 1))(q, k))
  eps = 1e-6
  for x, g, which in [(q, gq, 0), (k, gk, 1)]:
    fd = np.zeros_like(x)
    for idx in itertools.product(*map(range, x.shape)):
      xp, xm = x.copy(), x.copy()
      xp[idx] += eps
      xm[idx] -= eps
      fd[idx] = ((ref_obj(xp, k) - ref_obj(xm, k)) if which == 0 else
                 (ref_obj(q, xp) - ref_obj(q, xm))) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)
  assert np.all(gk[3] == 0)  # a padding memory gets no gradient

  # stop_gradient_memory on the in-batch objective: gradient == query-side part only.
  logits_b, keys_b, targets_b = _batch(rng, b=3, l=5, d=3, v=4, pad=False)
  with jax.enable_x64(True):
    def obj(ks, stop):
      return loss.trime_nll(logits_b, ks, targets_b, memory="ext", stop_gradient_memory=stop,
                            memory_chunk=4).sum()
    g_full = np.asarray(jax.grad(obj)(jnp.asarray(keys_b), False))
    g_stop = np.asarray(jax.grad(obj)(jnp.asarray(keys_b), True))
    flat = jnp.asarray(keys_b.reshape(15, 3))
    mask_b = ref.batch_mask("ext", targets_b)
    q_only = jax.grad(lambda qq: loss.memory_nll(logits_b.reshape(15, 4), qq, targets_b.reshape(-1), flat,
                                                 targets_b.reshape(-1), mask_b).sum())(flat)
  np.testing.assert_allclose(g_stop.reshape(15, 3), np.asarray(q_only), rtol=1e-9, atol=1e-12)
  assert not np.allclose(g_full, g_stop)


def test_memory_nll_matches_reference_with_padding_and_empty_rows():
  rng = np.random.default_rng(3)
  n, mm, d, v = 8, 11, 4, 5
  logits = rng.normal(size=(n, v)) * 2
  q, k = rng.normal(size=(n, d)) * 2, rng.normal(size=(mm, d)) * 2
  t, mt = rng.integers(-1, v, n), rng.integers(-1, v, mm)
  mask = rng.random((n, mm)) < 0.5
  mask[2] = False
  for temp in (1.0, 0.5, 3.0):
    want = ref.memory_nll(logits, q, t, k, mt, mask, temp)
    with jax.enable_x64(True):
      got = np.asarray(loss.memory_nll(logits, q, t, k, mt, mask, tau=temp))
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_memory_log_probs_is_the_distribution(tau):
  """Rows sum to 1, equal the float64 reference distribution, and agree with memory_nll at the targets."""
  rng = np.random.default_rng(4)
  n, mm, d, v = 9, 13, 4, 7
  logits = rng.normal(size=(n, v))
  q, k = rng.normal(size=(n, d)) * 2, rng.normal(size=(mm, d)) * 2
  t, mt = rng.integers(0, v, n), rng.integers(0, v, mm)
  mt[0] = -1
  mask = rng.random((n, mm)) < 0.5
  mask[1] = False
  with jax.enable_x64(True):
    lp = np.asarray(scoring.memory_log_probs(logits, q, k, mt, mask, tau=tau))
    nll = np.asarray(loss.memory_nll(logits, q, t, k, mt, mask, tau=tau))
  np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, rtol=1e-12)
  for i in range(n):
    np.testing.assert_allclose(np.exp(lp[i]), ref.distribution(logits[i], q[i], k, mt, mask[i], tau),
                               rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(-lp[np.arange(n), t], nll, rtol=1e-10, atol=1e-12)
  # float32 under jit, larger: still consistent.
  n, mm, v = 64, 300, 50
  logits = rng.normal(size=(n, v)).astype(np.float32)
  q, k = (rng.normal(size=(n, d)) * 3).astype(np.float32), (rng.normal(size=(mm, d)) * 3).astype(np.float32)
  t, mt = rng.integers(0, v, n), rng.integers(0, v, mm)
  mask = rng.random((n, mm)) < 0.3
  lp = np.asarray(scoring.memory_log_probs(logits, q, k, mt, mask, tau=tau))
  nll = np.asarray(loss.memory_nll(logits, q, t, k, mt, mask, tau=tau))
  np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(-lp[np.arange(n), t], nll, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("memory,m,drop_local", MODES[1:])
def test_blockwise_equals_dense_float32(memory, m, drop_local):
  """The fast path (several chunks, vmapped groups) agrees with the dense path in float32, values and grads."""
  rng = np.random.default_rng(5)
  b, l, d, v = 6, 40, 16, 30
  logits = jnp.asarray(rng.normal(size=(b, l, v)), jnp.float32)
  keys = jnp.asarray(rng.normal(size=(b, l, d)) * 4, jnp.float32)
  targets = rng.integers(0, v, size=(b, l))
  targets[2, 30:] = -1
  targets = jnp.asarray(targets)
  drop, docs = _opts(drop_local, b, l)

  def f(impl, chunk, lg, ks):
    return loss.trime_nll(lg, ks, targets, memory=memory, consecutive_segments=m, drop_local=drop,
                          documents=docs, implementation=impl, memory_chunk=chunk).sum()

  def value_and_grads(impl, chunk):
    return jax.jit(jax.value_and_grad(lambda lg, ks: f(impl, chunk, lg, ks), argnums=(0, 1)))(logits, keys)

  vd, gd = value_and_grads("dense", None)
  for impl, chunk in [("blockwise", 23), ("auto", None)]:  # auto: per-group dense blocks, plain autodiff
    vb, gb = value_and_grads(impl, chunk)
    np.testing.assert_allclose(vb, vd, rtol=1e-5)
    for x, y in zip(gb, gd):
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("implementation", ["blockwise", "dense"])
def test_similarities_of_float32_keys_ask_for_full_precision(implementation):
  """Every similarity matmul (forward, and the blockwise backward's recomputation, dq and dk) of float32 keys
  is compiled at HIGHEST precision — accelerators would otherwise round them (TF32, one bfloat16 pass; on an
  H200 that broke test_blockwise_equals_dense_float32) — and bfloat16 keys keep the default."""
  rng = np.random.default_rng(7)
  logits = jnp.asarray(rng.normal(size=(4, 16, 9)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 9, size=(4, 16)))

  def hlo(dtype):
    keys = jnp.asarray(rng.normal(size=(4, 16, 8)), dtype)

    def f(ks):
      return loss.trime_nll(logits, ks, targets, memory="ext", implementation=implementation,
                            memory_chunk=16 if implementation == "blockwise" else None).sum()
    return jax.jit(jax.grad(f)).lower(keys).as_text()

  full = hlo(jnp.float32).count("HIGHEST")
  assert full >= (4 if implementation == "blockwise" else 3), full  # forward s, backward s, dq, dk
  assert hlo(jnp.bfloat16).count("HIGHEST") == 0


def test_drop_local_can_be_traced_and_large_similarities_are_stable():
  rng = np.random.default_rng(6)
  logits, keys, targets = _batch(rng, key_scale=300.0)  # similarities in the thousands

  @jax.jit
  def f(drop):
    return loss.trime_nll(logits.astype(np.float32), keys.astype(np.float32), targets, memory="ext",
                          drop_local=drop, memory_chunk=8)

  a, b = np.asarray(f(jnp.bool_(False))), np.asarray(f(jnp.bool_(True)))
  rows = np.arange(6) % 2 == 0
  c = np.asarray(f(jnp.asarray(rows)))  # per-row decisions: the same compilation shape [B] each step
  assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
  np.testing.assert_allclose(a, ref.trime_nll(logits, keys, targets, "ext", 1, False), rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(b, ref.trime_nll(logits, keys, targets, "ext", 1, True), rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(c, ref.trime_nll(logits, keys, targets, "ext", 1, rows), rtol=1e-4, atol=1e-3)
  assert np.array_equal(c[rows], b[rows]) and np.array_equal(c[~rows], a[~rows])
  g = jax.grad(lambda k: loss.trime_nll(logits.astype(np.float32), k, targets, memory="ext",
                                        memory_chunk=8).sum())(keys.astype(np.float32))
  assert np.all(np.isfinite(np.asarray(g)))


def test_chunked_vocab_stats_match_full_softmax():
  rng = np.random.default_rng(7)
  n, d, v = 12, 6, 37
  h = rng.normal(size=(3, 4, d))
  w = rng.normal(size=(v, d))
  bias = rng.normal(size=(v,))
  t = rng.integers(0, v, size=(3, 4))
  t[0, 0] = -1
  wts = rng.normal(size=(3, 4))

  def full(h, w, bias):
    s = scoring.vocab_stats(h @ w.T + bias, t)
    return ((s.log_normalizer - s.target_logit) * wts).sum()

  def chunked(h, w, bias):
    s = scoring.chunked_vocab_stats(h, w, t, bias_V=bias, chunk=8)  # 37 = 4×8 + 5: a ragged last chunk
    return ((s.log_normalizer - s.target_logit) * wts).sum()

  with jax.enable_x64(True):
    h, w, bias = map(jnp.asarray, (h, w, bias))
    vf, gf = jax.value_and_grad(full, argnums=(0, 1, 2))(h, w, bias)
    vc, gc = jax.value_and_grad(chunked, argnums=(0, 1, 2))(h, w, bias)
    np.testing.assert_allclose(vc, vf, rtol=1e-12)
    for a, b in zip(gc, gf):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_bad_arguments_raise_clear_errors():
  x = jnp.zeros((4, 3, 2))
  t = jnp.zeros((4, 3), jnp.int32)
  lg = jnp.zeros((4, 3, 5))
  with pytest.raises(ValueError, match="memory must be one of"):
    loss.trime_nll(lg, x, t, memory="global")
  with pytest.raises(ValueError, match="consecutive_segments"):
    loss.trime_nll(lg, x, t, memory="long", consecutive_segments=3)
  with pytest.raises(ValueError, match="drop_local must be"):
    loss.trime_nll(lg, x, t, memory="ext", drop_local=jnp.zeros((3,), bool))
  with pytest.raises(ValueError, match="documents restrict long-term memory"):
    loss.trime_nll(lg, x, t, memory="ext", documents=jnp.zeros((4, 3), jnp.int32))
  # τ ≤ 0 used to give finite wrong values (or inf, or a ZeroDivisionError); a target ≥ V NaN or a clamped id
  for tau in (-1.0, 0.0, float("inf"), True, "1.0"):
    with pytest.raises(ValueError, match="tau must be a positive finite number"):
      loss.trime_nll(lg, x, t, memory="local", tau=tau)
  # an array of one τ broadcast unchecked (inf / NaN / a negative τ); a drop asked of a memory that has none
  for tau in (np.array([0.0]), [-1.0], jnp.ones((2,))):
    with pytest.raises(ValueError, match=r"tau must be one number, got an array of shape"):
      loss.trime_nll(lg, x, t, memory="local", tau=tau)
  assert np.isfinite(loss.trime_nll(lg, x, t, memory="local", tau=jnp.float32(0.5))).all()  # a JAX scalar
  for memory in ("local", "long"):
    with pytest.raises(ValueError, match=rf"drop_local drops ext memory's local part; memory='{memory}' has no"):
      loss.trime_nll(lg, x, t, memory=memory, drop_local=True)
  # (on a mesh too: the check is per_query_causal's, which the sharded loss calls; a traced drop is not read)
  with pytest.raises(ValueError, match=r"drop_local drops ext memory's local part; memory='local' has no drop"):
    sharded_loss.sharded_trime_nll(lg, x, t, mesh=sharding.make_mesh(1), memory="local", drop_local=True)
  assert jax.jit(lambda d: loss.trime_nll(lg, x, t, memory="local", drop_local=d))(True).shape == (4, 3)
  # trime_nll passes packed rows on as trime_nll_from_vocab_stats takes them (was a TypeError)
  rows = jnp.zeros((4, 3), jnp.int32)
  np.testing.assert_array_equal(loss.trime_nll(lg, x, t, memory="ext", rows=rows),
                                loss.trime_nll_from_vocab_stats(loss.vocab_stats(lg, t), x, t, memory="ext", rows=rows))
  np.testing.assert_array_equal(  # ... and so does sharded_trime_nll (it took no rows=)
      sharded_loss.sharded_trime_nll(lg, x, t, mesh=sharding.make_mesh(1), memory="ext", rows=rows),
      loss.trime_nll(lg, x, t, memory="ext", rows=rows))
  with pytest.raises(ValueError, match="tau must be a positive finite number"):
    scoring.memory_log_probs(lg[0], x[0], x[0], t[0], jnp.ones((3, 3), bool), tau=0)
  with pytest.raises(ValueError, match=r"targets must lie in \[0, 5\)"):
    loss.trime_nll(lg, x, t.at[1, 2].set(5), memory="local")
  with pytest.raises(ValueError, match=r"targets must lie in \[0, 5\)"):
    scoring.chunked_vocab_stats(x, jnp.zeros((5, 2)), t.at[0, 0].set(9), chunk=2)
  with pytest.raises(ValueError, match=r"memory_targets must lie in \[0, 5\)"):
    scoring.memory_log_probs(lg[0], x[0], x[0], t[0].at[0].set(5), jnp.ones((3, 3), bool))
  with pytest.raises(ValueError, match="disagree on the leading axes"):
    loss.trime_nll(lg[:2], x, t, memory="local")
  with pytest.raises(ValueError, match=r"memory_mask must be bool \[N, M\]"):
    loss.memory_nll(lg[0], x[0], t[0], x[0], t[0], jnp.ones((3, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"memory_mask must be bool \[N, M\]"):
    loss.memory_nll(lg[0], x[0], t[0], x[0], t[0], jnp.ones((3, 2), bool))
  # a traced τ is not checked (it is the caller's to keep positive) and still works
  assert np.isfinite(jax.jit(lambda tau: loss.trime_nll(lg, x, t, memory="local", tau=tau).sum())(0.5))
  # Found by a walk-through of the loss API: a memory target ≥ V added to memory_nll's normaliser (a wrong nll),
  # sharded_memory_log_probs and memory_log_weights dropped it; τ ≤ 0 gave NaN (or finite nonsense) on the
  # sharded and test-time paths; each of the rest was a bare ZeroDivisionError / TypeError / KeyError / math domain
  # error, or a probability taken for a drop decision
  mesh = sharding.make_mesh(1)
  mask = jnp.ones((3, 3), bool)
  bad_memory = t[0].at[0].set(7)
  for call in (lambda: loss.memory_nll(lg[0], x[0], t[0], x[0], bad_memory, mask),
               lambda: scoring.memory_log_weights(lg[0], x[0], x[0], bad_memory, mask),
               lambda: scoring.sharded_memory_log_probs(lg[0], x[0], x[0], bad_memory, mask, mesh=mesh)):
    with pytest.raises(ValueError, match=r"memory_targets must lie in \[0, 5\) \(negative: padding\), got 7"):
      call()
  block = scoring.MemoryBlock(sim=jnp.zeros((3, 3)), visible=mask, positive=mask)
  for call in (lambda: scoring.sharded_memory_log_probs(lg[0], x[0], x[0], t[0], mask, mesh=mesh, tau=0.0),
               lambda: scoring.trime_log_prob(jnp.zeros(3), jnp.zeros(3), [block], -1.0),
               lambda: scoring.similarity_scale(2, 0.0, jnp.float32)):
    with pytest.raises(ValueError, match="tau must be a positive finite number"):
      call()
  for kwargs, said in [(dict(memory="local", consecutive_segments=0), "consecutive_segments must be >= 1, got 0"),
                       (dict(memory="local", memory_chunk=0), "memory_chunk must be >= 1"),
                       (dict(memory="local", memory_chunk=-3), "memory_chunk must be >= 1"),
                       (dict(memory="local", block_elems=0), "block_elems must be >= 1"),
                       (dict(memory="ext", drop_local=0.9), r"drop_local must be a bool or a \[B=4\] bool array \(the "
                                                            r"drop decisions, not their probability\), got 0.9"),
                       (dict(memory="long", documents=jnp.zeros((4, 4), jnp.int32)),
                        r"documents must be \[B, L\] = \[4, 3\] like the targets, got \[4, 4\]")]:
    with pytest.raises(ValueError, match=said):
      loss.trime_nll(lg, x, t, **kwargs)
  np.testing.assert_array_equal(loss.trime_nll(lg, x, t, memory="ext", drop_local=np.array([1, 0, 0, 1])),
                                loss.trime_nll(lg, x, t, memory="ext", drop_local=np.array([1, 0, 0, 1], bool)))
  with pytest.raises(ValueError, match=r"the mesh has no axis 'batch' \(its axes: 'data'"):
    sharded_loss.sharded_trime_nll(lg, x, t, mesh=mesh, memory="ext", axis="batch")
  with pytest.raises(ValueError, match=r"shapes do not fit: .* memory_mask \[N, M\] \(3, 2\)"):
    scoring.memory_log_probs(lg[0], x[0], x[0], t[0], jnp.ones((3, 2), bool))
  with pytest.raises(ValueError, match=r"the interpolation weight lambda must lie in \[0, 1\], got 1.5"):
    scoring.trime_log_probs(lg[0], x[0], x[0], t[0], mask, tau=1.0, knn_lambda=1.5)


def test_no_memories_is_the_vocabulary_softmax():
  """memory_nll with M = 0 memories (an empty store) used to fail in a max over an empty axis."""
  rng = np.random.default_rng(3)
  lg, q, t = jnp.asarray(rng.normal(size=(4, 5))), jnp.asarray(rng.normal(size=(4, 3))), jnp.arange(4)
  nll = loss.memory_nll(lg, q, t, jnp.zeros((0, 3)), jnp.zeros((0,), jnp.int32), jnp.zeros((4, 0), bool))
  np.testing.assert_allclose(nll, -jax.nn.log_softmax(lg)[jnp.arange(4), t], rtol=1e-6)


def test_packed_documents_cut_memory_exactly_at_boundaries():
  """A packed run with one document equals the stream run; a document boundary at a row start makes its rows
  see nothing of the run's earlier rows (the first token of a new document gets the plain softmax)."""
  rng = np.random.default_rng(11)
  logits, keys, targets = _batch(rng, b=4, l=5, pad=False)
  with jax.enable_x64(True):
    stream = np.asarray(loss.trime_nll(logits, keys, targets, memory="long", consecutive_segments=4))
    one_doc = np.asarray(loss.trime_nll(logits, keys, targets, memory="long", consecutive_segments=4,
                                        documents=np.full((4, 5), 7)))
    docs = np.array([[0] * 5, [0] * 5, [1] * 5, [1] * 5])  # rows 2-3 start a new document
    packed = np.asarray(loss.trime_nll(logits, keys, targets, memory="long", consecutive_segments=4,
                                       documents=docs))
    two_runs = np.asarray(loss.trime_nll(logits, keys, targets, memory="long", consecutive_segments=2))
    ce = np.asarray(loss.trime_nll(logits, keys, targets, memory="none"))
  assert np.array_equal(one_doc, stream)
  np.testing.assert_allclose(packed, two_runs, rtol=1e-12)
  assert packed[2, 0] == ce[2, 0] and stream[2, 0] != ce[2, 0]


def _topk_reference(logits, keys, targets, k, tau):
  """float64 NumPy statement of the original TrimeMT criterion with --topk-mem k (trime_mt_loss.py): memory =
  every token of every other row (no padding); per query, the k most similar of them enter one softmax with
  the vocabulary; the target's probability sums the vocabulary term and the selected memories of that label."""
  b, l, v = logits.shape
  q, t = keys.reshape(b * l, -1), targets.reshape(-1)
  row = np.repeat(np.arange(b), l)
  sim = q @ q.T / np.sqrt(q.shape[1]) / tau
  out = np.zeros(b * l)
  for i in range(b * l):
    if t[i] < 0:
      continue
    cand = [j for j in range(b * l) if row[j] != row[i] and t[j] >= 0]
    top = sorted(cand, key=lambda j: -sim[i, j])[:k]
    lg = logits.reshape(b * l, v)[i]
    terms = np.concatenate([lg, sim[i, top]])
    z = np.log(np.exp(terms - terms.max()).sum()) + terms.max()
    num = [lg[t[i]]] + [sim[i, j] for j in top if t[j] == t[i]]
    p = np.log(np.exp(np.array(num) - max(num)).sum()) + max(num)
    out[i] = z - p
  return out.reshape(b, l)


@pytest.mark.parametrize("k", [1, 3, 8, 1000])
def test_memory_topk_matches_the_original_mt_criterion(k):
  logits, keys, targets = _batch(np.random.default_rng(7))
  with jax.enable_x64(True):
    got = loss.trime_nll(jnp.asarray(logits), jnp.asarray(keys), jnp.asarray(targets), memory="ext",
                         drop_local=True, tau=2.0, memory_topk=k)
    np.testing.assert_allclose(np.asarray(got), _topk_reference(logits, keys, targets, k, 2.0), rtol=1e-10, atol=1e-10)
    if k == 1000:  # k above the memory size: the plain objective
      full = loss.trime_nll(jnp.asarray(logits), jnp.asarray(keys), jnp.asarray(targets), memory="ext",
                            drop_local=True, tau=2.0, implementation="dense")
      np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-12)
    if k == 1:  # gradients reach only the memories some query selected (and the queries themselves)
      grad = jax.grad(lambda kk: loss.trime_nll(jnp.asarray(logits), kk, jnp.asarray(targets), memory="ext",
                                                drop_local=True, memory_topk=1, stop_gradient_memory=True).sum())(
          jnp.asarray(keys))
      valid = targets >= 0
      assert np.all(np.asarray(grad)[~valid] == 0)
  with pytest.raises(ValueError, match="memory_topk"):
    loss.ObjectiveSpec("ext", memory_topk=-1)


# memory_grad_group_rows: (memory, m, drop_local variant, G) on 6 rows. G=2, m=3 and G=4, m=6: run and group
# boundaries interleave.
GROUP_CUT_MODES = [("local", 1, False, 1), ("long", 3, False, 1), ("long", 3, False, 2), ("long", 6, False, 4),
                   ("ext", 1, False, 1), ("ext", 1, "rows", 2), ("ext", 1, True, 3)]


@pytest.mark.parametrize("memory,m,drop_local,group_rows", GROUP_CUT_MODES)
@pytest.mark.parametrize("implementation,chunk", [("dense", None), ("auto", None), ("blockwise", 5),
                                                  ("blockwise", 64)])
def test_memory_grad_group_rows_matches_reference(memory, m, drop_local, group_rows, implementation, chunk):
  """memory_grad_group_rows = G: the value is unchanged and a memory key's gradient comes only from queries of
  rows in its group of G consecutive rows (float64 NumPy reference: `ref.trime_key_grad`)."""
  rng = np.random.default_rng(hash((memory, m, str(drop_local), group_rows)) % 2**32)
  logits, keys, targets = _batch(rng)
  b = targets.shape[0]
  drop, _ = _opts(drop_local, *targets.shape)
  weights = rng.normal(size=targets.shape)
  want_nll = ref.trime_nll(logits, keys, targets, memory, m, drop, 0.7)
  want = ref.trime_key_grad(logits, keys, targets, memory, m, drop, 0.7, ref.same_group_rows(b, group_rows), weights)
  uncut = ref.trime_key_grad(logits, keys, targets, memory, m, drop, 0.7, None, weights)
  with jax.enable_x64(True):
    def f(k, g):
      nll = loss.trime_nll(jnp.asarray(logits), k, jnp.asarray(targets), memory=memory, consecutive_segments=m,
                           drop_local=drop, tau=0.7, implementation=implementation, memory_chunk=chunk,
                           memory_grad_group_rows=g)
      return (nll * weights).sum(), nll

    (_, nll), got = jax.value_and_grad(f, has_aux=True)(jnp.asarray(keys), group_rows)
    (_, nll0), got0 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(keys), 0)
  np.testing.assert_allclose(np.asarray(nll), want_nll, rtol=1e-10, atol=1e-10)
  np.testing.assert_array_equal(np.asarray(nll), np.asarray(nll0))  # the forward value is untouched
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-9, atol=1e-10)
  np.testing.assert_allclose(np.asarray(got0), uncut, rtol=1e-9, atol=1e-10)
  if memory == "local":  # memory within a row: nothing to cut
    np.testing.assert_allclose(want, uncut, rtol=1e-12, atol=1e-12)
  else:  # the cut changes the key gradient, so the comparison above can fail
    assert np.abs(want - uncut).max() > 1e-2 * np.abs(uncut).max()


def test_memory_grad_group_rows_spec():
  from ml_collections import ConfigDict

  cfg = ConfigDict({"trime": {"memory": "ext", "consecutive_segments": 1, "tau": 1.0,
                              "stop_gradient_memory": False, "memory_chunk": 0, "memory_grad_group_rows": 1}})
  spec = specs.objective_spec(cfg)
  assert spec.memory_grad_group_rows == 1 and spec.key_grad_group_rows == 1
  assert loss.ObjectiveSpec("local", memory_grad_group_rows=1).key_grad_group_rows == 0
  assert loss.ObjectiveSpec("ext", memory_grad_group_rows=1, stop_gradient_memory=True).key_grad_group_rows == 0
  with pytest.raises(ValueError, match="memory_grad_group_rows"):
    loss.ObjectiveSpec("ext", memory_grad_group_rows=-1)
  # packed segments (rows=): groups of memory_grad_group_rows consecutive segment ids (mt's packed GPU batches);
  # ids equal to the layout rows cut as the layout does, and ids of one group do not cut
  rng = np.random.default_rng(0)
  stats = loss.VocabStats(jnp.asarray(rng.normal(size=(4, 3)) + 3, jnp.float32), jnp.asarray(rng.normal(size=(4, 3)), jnp.float32))
  keys = jnp.asarray(rng.normal(size=(4, 3, 5)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 2, (4, 3)), jnp.int32)

  def key_grad(group_rows, rows):
    f = lambda k: loss.trime_nll_from_vocab_stats(stats, k, targets, memory="ext", memory_grad_group_rows=group_rows,
                                                  rows=rows, implementation="dense").sum()
    return np.asarray(jax.grad(f)(keys))

  layout = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32)[:, None], (4, 3))
  np.testing.assert_allclose(key_grad(2, layout), key_grad(2, None), rtol=1e-6)
  np.testing.assert_allclose(key_grad(8, layout), key_grad(0, None), rtol=1e-6)
  assert np.abs(key_grad(2, None) - key_grad(0, None)).max() > 1e-4


def test_similarity_precision_is_full_whenever_an_operand_is_float32():
  """Memory similarities are computed at full float32 precision when an operand is float32: float32 queries
  against a float16 datastore (the exact on-device memory's default) lost their low bits to TF32 / one bfloat16
  pass on accelerators (only float32 pairs were full); bfloat16 / float16 operands alone keep the default."""
  x = lambda dtype: jnp.zeros((2, 4), dtype)
  full, fast = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
  assert scoring.similarity_precision(x(jnp.float32), x(jnp.float16)) == full
  assert scoring.similarity_precision(x(jnp.float32), x(jnp.float32)) == full
  assert scoring.similarity_precision(x(jnp.bfloat16), x(jnp.bfloat16)) == fast
  assert scoring.similarity_precision(x(jnp.float16), x(jnp.float16)) == fast
