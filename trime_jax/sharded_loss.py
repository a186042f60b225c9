"""The TRIME loss on a global batch sharded over the `data` mesh axis.

Every query sees the memories of the whole global batch under exactly the visibility rules of
`loss.trime_nll` (same `TokenMeta` / `visible`, with global row indices); what differs per memory mode is
only how much of the batch has to travel:

  local  block-diagonal per segment: every device scores its own rows, no communication at all.
  long   a document run (m consecutive rows) starts on an earlier device only when B/n is not a multiple of
         m. Then each device receives the m-1 rows preceding its first row from its predecessors (a halo:
         neighbour `ppermute` hops of at most min(m-1, B/n) rows each) and scores its queries against
         them, as whole runs `[G, m·L]` (like `trime_nll`) or, for runs longer than a device's rows, its own
         queries against the window. Aligned runs need no communication.
  ext    the whole batch, by one of two variants:
         gather  all-gather keys and targets, one blockwise pass over the global memory. Its transpose (the
                 backward pass) is a reduce-scatter of the memory-key gradients. Holds the global
                 `[B·L, D]` keys on every device. With memory_topk (the original MT's --topk-mem) each
                 query keeps its k most similar memories of the global batch (dense per device).
         ring    n steps: at step s a device holds the keys of device i-s, folds them into the running
                 log-sum-exp and passes them on with `ppermute` (sent before the block is used, so the
                 transfer can overlap the compute). A custom VJP runs the ring again in the backward pass,
                 the key gradients travelling with their block back to its owner. Never holds more than
                 two memory blocks plus the block being sent, so peak memory does not grow with n.

Segment metadata (row, run, order) is a function of the global row index, so only keys and targets travel
(and, for packed long-term runs, the per-token document ids of the halo). `drop_local` is per row and
sharded with the rows: it decides what a *query* sees, so it never travels.

memory_grad="all" (default): the gradient reaches every memory key on every device (= `trime_nll`).
memory_grad="local_only": the original PyTorch code's behaviour, where `all_gather` cut the graph: a key
receives gradient from queries on its own device only (as a query it still gets its full gradient).
spec.memory_grad_group_rows = G > 0 cuts by global rows instead of devices (key gradient only from queries of
its group of G consecutive rows: one original GPU's segments, whatever the device count here); it combines
with local_only (a key then needs both the same device and the same group).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from trime_jax import loss, scoring
from trime_jax.scoring import TokenMeta, VocabStats
# The full distribution with the memory sharded over devices is the scorer's (it is no loss); importable here too.
from trime_jax.scoring import sharded_memory_log_probs  # noqa: F401
from trime_jax.sharding import DATA

VARIANTS = ("gather", "ring")
MEMORY_GRADS = ("all", "local_only")


def device_cut_rows(spec: loss.ObjectiveSpec, memory_grad: str, batch_rows: int, devices: int) -> int:
  """Rows per device between which memory_grad="local_only" cuts key gradients *and the cut changes the
  gradient* (some key lives on another device than a query that sees it, beyond what stop_gradient_memory and
  memory_grad_group_rows cut anyway); 0 where it does not act. The objective's gradient depends on the device
  count exactly through this number: a resume on another count that changes it trains another objective."""
  if (memory_grad != "local_only" or devices <= 1 or spec.memory not in ("long", "ext") or spec.stop_gradient_memory
      or batch_rows % devices):
    return 0
  rows = batch_rows // devices
  if spec.memory_grad_group_rows and rows % spec.memory_grad_group_rows == 0:
    return 0  # every row group lies on one device: the device cut adds nothing
  if spec.memory == "long" and rows % spec.consecutive_segments == 0:
    return 0  # every run lies on one device: no memory crosses a device boundary
  return rows


class _Static(NamedTuple):
  """Everything the per-device function needs that is not an array (hashable, part of the trace)."""

  spec: loss.ObjectiveSpec  # its τ travels as an array argument (it may be traced)
  variant: str
  detach_own: bool  # stop_gradient_memory: no memory key gets gradient
  detach_remote: bool  # other devices' memories get no gradient (local_only, or stop_gradient_memory)
  axis: str
  n: int  # devices on `axis`
  packed: bool = False  # per-token row ids (packed segments, `loss.batch_meta(rows_BxL=)`) travel with the rows


def sharded_trime_nll_from_vocab_stats(stats: VocabStats, keys, targets, spec: loss.ObjectiveSpec | None = None, *,
                                       mesh, drop_local=False, documents=None, rows=None,
                                       variant: str = "gather", memory_grad: str = "all", axis: str = DATA,
                                       **options):
  """`loss.trime_nll_from_vocab_stats` on a global batch sharded over `axis` of `mesh`.

  stats `[B, L]` (VocabStats), keys `[B, L, D]`, targets `[B, L]`: global arrays, rows sharded over `axis`
  (row i lives on device i // (B/n)); `spec` (or its fields as keywords) as for `loss.trime_nll`; `drop_local` a
  bool or `[B]` (per row), `documents` `[B, L]` (packed long-term runs) and `rows` `[B, L]` (packed segments'
  ids, unique in the global batch: local memory, or ext with the gather variant) sharded like the rows. Returns the nll
  `[B, L]`, sharded the same way. `variant` ("gather" | "ring") only matters for memory="ext"; `memory_grad`
  ("all" | "local_only") for memories that live on another device (ext, and long runs that span devices).
  """
  spec = loss.resolve_spec(spec, options)
  keys, targets = jnp.asarray(keys), jnp.asarray(targets)
  stats = VocabStats(*map(jnp.asarray, stats))
  loss.check_batch_memory(spec, keys, targets)
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
  if memory_grad not in MEMORY_GRADS:
    raise ValueError(f"memory_grad must be one of {MEMORY_GRADS}, got {memory_grad!r}")
  n = scoring.mesh_axis_size(mesh, axis)
  if spec.memory == "none" or n == 1:
    return loss.trime_nll_from_vocab_stats(stats, keys, targets, spec, drop_local=drop_local, documents=documents,
                                           rows=rows)
  if rows is not None and spec.key_grad_group_rows:
    raise ValueError("memory_grad_group_rows groups layout rows; packed segments (rows=) are not supported")
  if rows is not None and (spec.memory == "long" or (spec.memory == "ext" and variant != "gather")):
    raise ValueError("packed rows (rows=) take local memory, or ext memory with variant='gather'")
  if rows is not None and jnp.ndim(drop_local):
    raise ValueError("packed rows take a scalar drop_local (per-row draws would split packed segments alike)")
  if spec.memory_topk and variant != "gather":
    raise ValueError("memory_topk (the original MT's --topk-mem) needs variant='gather': a query's top k is "
                     "taken over the whole gathered memory, not folded block by block")
  if keys.shape[0] % n:
    raise ValueError(f"a global batch of {keys.shape[0]} rows does not split over the {n} devices of "
                     f"mesh axis {axis!r}")
  if spec.memory == "long" and spec.memory_topk and (keys.shape[0] // n) % spec.consecutive_segments:
    raise ValueError(f"memory_topk with memory='long' needs each device's {keys.shape[0] // n} rows to hold whole "
                     f"runs of consecutive_segments={spec.consecutive_segments}: runs that cross devices are "
                     "scored over their whole memory, without the top k")
  memory = spec.memory
  # τ travels as an array (it may be traced); the static part must stay hashable.
  static = _Static(dataclasses.replace(spec, tau=1.0), variant, spec.stop_gradient_memory,
                   spec.stop_gradient_memory or memory_grad == "local_only", axis, n, rows is not None)
  if documents is not None and memory != "long":
    raise ValueError(f"documents restrict long-term memory (packed runs); memory={memory!r} takes none")
  b, l = targets.shape
  causal = loss.per_query_causal(memory, drop_local, b, l)  # [B, L], sharded with the rows
  # One per-token group-id input travels with the rows: document ids (long memory's packed runs) or packed
  # segments' ids (local / ext memory); the two never meet (checked above).
  groups = rows if rows is not None else documents
  groups = jnp.zeros((b, l), jnp.int32) if groups is None else jnp.asarray(groups, jnp.int32)
  rows = P(axis)
  # check_vma=False: the blockwise kernels of `scoring` start their scans from device-invariant zeros, which
  # the varying-manual-axes type check rejects inside shard_map; every output here is per-device anyway.
  specs = (rows, rows, rows, rows, rows, rows, P())
  per_device = jax.shard_map(functools.partial(_device_nll, static), mesh=mesh, in_specs=specs, out_specs=rows,
                             check_vma=False)
  acc = scoring.accumulation_dtype(keys, stats.log_normalizer)
  args = (stats.log_normalizer, stats.target_logit, keys, targets, causal, groups, jnp.asarray(spec.tau, acc))
  # Every input placed as its in_spec: the caller's arrays may be placed otherwise (replicated, or sharded on a
  # mesh with explicit axes), and `causal` / `groups` are built here, unplaced.
  return per_device(*(scoring.on_mesh(mesh, sp, x) for sp, x in zip(specs, args)))


def sharded_trime_nll(token_logits, keys, targets, spec: loss.ObjectiveSpec | None = None, *, mesh, drop_local=False,
                      documents=None, rows=None, variant: str = "gather", memory_grad: str = "all", axis: str = DATA,
                      **options):
  """`loss.trime_nll` on a global batch sharded over `axis` of `mesh`: token_logits `[B, L, V]`, keys
  `[B, L, D]`, targets `[B, L]`, rows sharded over `axis`. Equals `trime_nll` on the same global batch (with
  memory_grad="all"); see `sharded_trime_nll_from_vocab_stats` for the options."""
  return sharded_trime_nll_from_vocab_stats(
      scoring.vocab_stats(token_logits, targets), keys, targets, loss.resolve_spec(spec, options), mesh=mesh,
      drop_local=drop_local, documents=documents, rows=rows, variant=variant, memory_grad=memory_grad, axis=axis)


# ----------------------------------------------------------------------------------------------------------
# Per device (inside shard_map): b = B/n rows of the global batch, starting at global row r0 = i·b.
# ----------------------------------------------------------------------------------------------------------
def _flat(meta: TokenMeta) -> TokenMeta:
  return TokenMeta(*(x.reshape(-1) for x in meta))


def _device_nll(st: _Static, lse_BxL, tgt_BxL, keys_BxLxD, targets_BxL, causal_BxL, groups_BxL, tau):
  b, l, d = keys_BxLxD.shape
  stats = VocabStats(lse_BxL, tgt_BxL)
  memory, m = st.spec.memory, st.spec.consecutive_segments
  docs_BxL = groups_BxL if memory == "long" else None  # document ids (all zeros: one stream)
  rows_BxL = groups_BxL if st.packed else None  # packed segments' ids
  if memory == "local" or (memory == "long" and b % m == 0):  # no memory on another device
    spec = dataclasses.replace(st.spec, stop_gradient_memory=st.detach_own, tau=tau)
    return loss.trime_nll_from_vocab_stats(stats, keys_BxLxD, targets_BxL, spec, documents=docs_BxL,
                                           rows=rows_BxL, row_offset=lax.axis_index(st.axis) * b)

  acc = scoring.accumulation_dtype(keys_BxLxD, lse_BxL)
  scale = scoring.similarity_scale(d, tau, acc)
  own = lax.stop_gradient(keys_BxLxD) if st.detach_own else keys_BxLxD
  remote = lax.stop_gradient(keys_BxLxD) if st.detach_remote else keys_BxLxD
  if memory == "long":
    nll = _long_spanning(st, stats, keys_BxLxD, own, remote, targets_BxL, docs_BxL, scale)
  else:
    if st.variant == "gather":
      nll = _ext_gather(st, stats, keys_BxLxD, own, remote, targets_BxL, causal_BxL.reshape(-1), scale,
                        rows_BxL)
    else:
      nll = _ext_ring(st, stats, keys_BxLxD, own, remote, targets_BxL, causal_BxL.reshape(-1), scale)
  return jnp.where(targets_BxL >= 0, nll, 0.0)


def _shift_right(st: _Static, x):
  """Device i receives device i-1's `x` (device 0 receives zeros)."""
  return lax.ppermute(x, st.axis, perm=[(j, j + 1) for j in range(st.n - 1)])


def _halo(st: _Static, keys, targets, docs, h):
  """Keys, targets and document ids of the h global rows preceding this device's first row (padding before
  row 0).

  h <= b: one hop of this device's trailing h rows. Otherwise whole blocks travel like a partial ring,
  ceil(h / b) hops (at most n-1), each forwarding the block received in the previous hop.
  """
  b = keys.shape[0]
  if h <= b:
    halo_k, halo_t, halo_d = _shift_right(st, (keys[b - h:], targets[b - h:], docs[b - h:]))
  else:
    blocks = [(keys, targets, docs)]
    for _ in range(min(-(-h // b), st.n - 1)):
      blocks.insert(0, _shift_right(st, blocks[0]))
    halo_k, halo_t, halo_d = (jnp.concatenate([blk[i] for blk in blocks[:-1]])[-h:] for i in range(3))
    if halo_k.shape[0] < h:  # fewer predecessors than h rows: the rest lies before row 0
      halo_k = jnp.pad(halo_k, ((h - halo_k.shape[0], 0), (0, 0), (0, 0)))
      halo_t = jnp.pad(halo_t, ((h - halo_t.shape[0], 0), (0, 0)), constant_values=-1)
      halo_d = jnp.pad(halo_d, ((h - halo_d.shape[0], 0), (0, 0)))
  rows = lax.axis_index(st.axis) * b - h + jnp.arange(h)
  # zeros from ppermute before row 0: no memory
  return halo_k, jnp.where(rows[:, None] >= 0, halo_t, -1), halo_d


def _long_spanning(st: _Static, stats, keys, own, remote, targets, docs, scale):
  """memory="long" when runs cross device boundaries: a halo of the m-1 rows before this device's first row
  (a run containing row r0 starts at r0 - (r0 mod m) >= r0 - (m-1)), then the cheaper of two layouts:

    runs: G whole runs touching this device as `[G, m·L]` blocks (like `trime_nll`), G·(m·L)² similarities;
    flat: this device's b·L queries against the (m-1+b)·L window, b·(m-1+b)·L² similarities
          (better when a run is longer than a device's rows: no queries of other devices' rows).
  """
  b, l, d = keys.shape
  m, n = st.spec.consecutive_segments, st.n
  h = m - 1
  r0 = lax.axis_index(st.axis) * b
  halo_k, halo_t, halo_d = _halo(st, remote, targets, docs, h)
  win_k = jnp.concatenate([halo_k, own])  # global rows [r0 - h, r0 + b)
  win_t = jnp.concatenate([halo_t, targets])
  win_d = jnp.concatenate([halo_d, docs])
  g_runs = max((i * b + b - 1) // m - (i * b) // m + 1 for i in range(n))  # most runs any device touches
  cut = st.spec.key_grad_group_rows
  terms = lambda *a: scoring.memory_log_terms(False, *a, grad_group_rows=cut)
  flat_stats = VocabStats(*(x.reshape(-1) for x in stats))

  if b * (h + b) <= g_runs * m * m:
    kmeta = _flat(loss.batch_meta(win_t, "long", m, row_offset=r0 - h, documents_BxL=win_d))
    qmeta = _flat(loss.batch_meta(targets, "long", m, row_offset=r0, documents_BxL=docs))
    chunk = st.spec.memory_chunk or scoring.chunk_len(b * l, (h + b) * l, st.spec.block_elems)
    log_z, log_p = terms(chunk, keys.reshape(-1, d), win_k.reshape(-1, d), qmeta, kmeta, jnp.asarray(True),
                         scale, flat_stats)
    return (log_z - log_p).reshape(b, l)

  # Group g holds global rows (r0 // m + g)·m + [0, m): the window slice starting at h - r0 mod m. Rows past
  # this device's last row are padding (never visible to its queries); rows before r0 are memories only.
  start = h - r0 % m

  def runs(halo, mine, fill):
    x = jnp.concatenate([halo, mine])
    x = jnp.pad(x, [(0, g_runs * m - b)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return lax.dynamic_slice_in_dim(x, start, g_runs * m, axis=0)

  mem_t = runs(halo_t, targets, -1)
  rows = (r0 // m) * m + jnp.arange(g_runs * m)
  mine = (rows >= r0) & (rows < r0 + b)
  kmeta = loss.batch_meta(mem_t, "long", m, row_offset=(r0 // m) * m, documents_BxL=runs(halo_d, docs, 0))
  qmeta = kmeta._replace(target=jnp.where(mine[:, None], mem_t, -1))
  q = runs(jnp.zeros((h, l, d), keys.dtype), keys, 0)
  k = runs(halo_k, own, 0)
  zeros = jnp.zeros((h, l), stats.log_normalizer.dtype)
  gstats = VocabStats(runs(zeros, stats.log_normalizer, 0), runs(zeros, stats.target_logit, 0))

  grouped = lambda x: x.reshape((g_runs, m * l) + x.shape[2:])
  chunk = st.spec.memory_chunk or scoring.chunk_len(g_runs * m * l, m * l, st.spec.block_elems)
  log_z, log_p = jax.vmap(functools.partial(terms, chunk), in_axes=(0, 0, 0, 0, None, None, 0))(
      grouped(q), grouped(k), TokenMeta(*map(grouped, qmeta)), TokenMeta(*map(grouped, kmeta)),
      jnp.asarray(True), scale, VocabStats(*map(grouped, gstats)))
  nll = (log_z - log_p).reshape(g_runs * m, l)
  return lax.dynamic_slice_in_dim(nll, r0 % m, b, axis=0)


def _ext_gather(st: _Static, stats, keys, own, remote, targets, causal, scale, rows=None):
  b, l, d = keys.shape
  r0 = lax.axis_index(st.axis) * b
  mem = lax.all_gather(remote, st.axis, tiled=True)  # [n·b, L, D]; its transpose reduce-scatters dk
  if st.detach_remote and not st.detach_own:
    mem = lax.dynamic_update_slice_in_dim(mem, own, r0, axis=0)  # local_only: own memories stay live
  mem_t = lax.all_gather(targets, st.axis, tiled=True)
  mem_rows = None if rows is None else lax.all_gather(rows, st.axis, tiled=True)  # packed segments' ids
  qmeta = _flat(loss.batch_meta(targets, "ext", row_offset=r0, rows_BxL=rows))
  kmeta = _flat(loss.batch_meta(mem_t, "ext", rows_BxL=mem_rows))
  flat_stats = VocabStats(*(x.reshape(-1) for x in stats))
  cut = st.spec.key_grad_group_rows
  if st.spec.memory_topk:  # each query's k most similar visible memories of the global batch (dense [b·L, n·b·L])
    mask = scoring.visible(qmeta, kmeta, causal, True)
    kg = scoring.same_grad_group(qmeta.row, kmeta.row, cut) if cut else None
    nll = scoring.topk_dense_nll(flat_stats, keys.reshape(-1, d), qmeta.target, mem.reshape(-1, d), kmeta.target,
                                 mask, scale, st.spec.memory_topk, kg)
    return nll.reshape(b, l)
  chunk = st.spec.memory_chunk or scoring.chunk_len(b * l, st.n * b * l, st.spec.block_elems)
  log_z, log_p = scoring.memory_log_terms(True, chunk, keys.reshape(-1, d), mem.reshape(-1, d), qmeta, kmeta,
                                       causal, scale, flat_stats, grad_group_rows=cut)
  return (log_z - log_p).reshape(b, l)


def _ext_ring(st: _Static, stats, keys, own, remote, targets, causal, scale):
  b, l, d = keys.shape
  key_grads = "none" if st.detach_own else "own" if st.detach_remote else "all"
  chunk = st.spec.memory_chunk or scoring.chunk_len(b * l, b * l, st.spec.block_elems)
  log_z, log_p = _ring_log_terms(st.axis, st.n, chunk, key_grads, st.spec.key_grad_group_rows,
                                 keys.reshape(-1, d), own.reshape(-1, d),
                                 targets, causal, scale, VocabStats(*(x.reshape(-1) for x in stats)))
  return (log_z - log_p).reshape(b, l)


# ----------------------------------------------------------------------------------------------------------
# Ring: running log-sum-exp over the blocks passing by; custom VJP that sends key gradients home.
# ----------------------------------------------------------------------------------------------------------
def _ring_pass(axis, n, x):
  """Device i receives device i-1's `x` (cyclic)."""
  return lax.ppermute(x, axis, perm=[(j, (j + 1) % n) for j in range(n)])


def _ext_meta(targets_BxL, row_offset):
  return _flat(loss.batch_meta(targets_BxL, "ext", row_offset=row_offset))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _ring_log_terms(axis, n, chunk, key_grads, grad_group_rows, q_NxD, k_NxD, targets_BxL, causal, scale, stats):
  """(log Z, log P) `[N]` of this device's queries against the ext memory of all n devices' blocks.

  key_grads: "all" (every block's keys get gradient from every device), "own" (from this device's
  queries only) or "none"; grad_group_rows > 0: and only from queries of the key's row group.
  """
  return _ring_fwd(axis, n, chunk, key_grads, grad_group_rows, q_NxD, k_NxD, targets_BxL, causal, scale, stats)[0]


def _ring_fwd(axis, n, chunk, key_grads, grad_group_rows, q, k, targets, causal, scale, stats):
  i = lax.axis_index(axis)
  b = targets.shape[0]
  qmeta = _ext_meta(targets, i * b)
  fold = functools.partial(scoring.fold_memory, chunk, q, qmeta, causal, scale, True)
  src = lambda s: ((i - s) % n) * b  # global row offset of the block held at step s

  def step(carry, s):
    k_blk, t_blk, state = carry
    k_next, t_next = _ring_pass(axis, n, (k_blk, t_blk))  # in flight while this block is folded in
    return (k_next, t_next, fold(state, k_blk, _ext_meta(t_blk, src(s)))), None

  start = scoring.start_log_terms(stats, scale.dtype)
  (k_last, t_last, state), _ = lax.scan(step, (k, targets, start), jnp.arange(n - 1))
  log_z, log_p = scoring.finish_log_terms(fold(state, k_last, _ext_meta(t_last, src(n - 1))))
  return (log_z, log_p), (q, k, targets, causal, scale, stats, log_z, log_p)


def _ring_bwd(axis, n, chunk, key_grads, grad_group_rows, res, cotangents):
  q, k, targets, causal, scale, stats, log_z, log_p = res
  g_z, g_p = cotangents
  i = lax.axis_index(axis)
  b = targets.shape[0]
  qmeta = _ext_meta(targets, i * b)
  travel = key_grads == "all"
  grads = lambda with_dk, k_blk, kmeta: scoring.memory_grads(chunk, q, qmeta, causal, scale, True, log_z, log_p,
                                                             g_z, g_p, with_dk, k_blk, kmeta, grad_group_rows)
  src = lambda s: ((i - s) % n) * b

  dq, dk, d_scale = grads(key_grads != "none", k, qmeta)  # step 0: this device's own block
  k_blk, t_blk = _ring_pass(axis, n, (k, targets))

  def step(carry, s, last=False):
    # Holds the block of device i-s and the gradient so far of block i-s+1; device i-1 sends the gradient
    # so far of block i-s, this device adds its queries' part and sends it on.
    k_blk, t_blk, dk_acc, dq, d_scale = carry
    nxt = (k_blk, t_blk) if last else _ring_pass(axis, n, (k_blk, t_blk))
    dq_s, dk_s, d_scale_s = grads(travel, k_blk, _ext_meta(t_blk, src(s)))
    if travel:
      dk_acc = _ring_pass(axis, n, dk_acc) + dk_s
    return (*nxt, dk_acc, dq + dq_s, d_scale + d_scale_s), None

  carry = (k_blk, t_blk, dk, dq, d_scale)
  if n > 1:
    carry, _ = lax.scan(step, carry, jnp.arange(1, n - 1))
    carry, _ = step(carry, n - 1, last=True)
  _, _, dk_acc, dq, d_scale = carry
  if travel:
    dk = _ring_pass(axis, n, dk_acc)  # the gradient of block i+1 goes to device i+1; ours arrives from i-1
  elif dk is None:
    dk = jnp.zeros(k.shape, scale.dtype)
  d_stats = scoring.vocab_stats_grads(stats, log_z, log_p, g_z, g_p)
  # d_scale: this device's queries' part; scale enters shard_map replicated, so its transpose sums the parts
  return dq.astype(q.dtype), dk.astype(k.dtype), None, None, d_scale, d_stats


_ring_log_terms.defvjp(_ring_fwd, _ring_bwd)
