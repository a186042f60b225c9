"""Exact external memory on device: every datastore key, sharded over the `data` mesh axis, instead of FAISS top-K.

When the datastore's keys fit in the devices' combined memory (`eval.datastore_on_device=True`), a query is
scored against all of them: nothing is approximated (no IVF lists, no product quantisation) and nothing is
truncated (no K). Two entry points share one layout (`DeviceDatastore`, keys `[M, D]` in the datastore's dtype
sharded as `P("data")`, padded to a multiple of the device count with invisible entries):

  external_log_terms       for evaluation: per query and per scale c, log Σ exp(c·sim) over the memories whose
                           next token is the query's target and over all the others (`[C, N]` each). Every
                           family of `evaluate` needs only these (TRIME at c = 1/τ, p_mem at θ, P′ at 1/τ′), so
                           the memory never leaves the devices and a query costs `[C, N]` numbers of traffic
                           (`scoring.sharded_scaled_log_sums`).
  exact_external_log_probs for generation: the full TRIME distribution `[N, V]` over the vocabulary plus all
                           datastore memories (`scoring.sharded_memory_log_probs`, no mask).

sim = g(c)·k_j / √D, as `knn.ExternalMemory` returns it. The sums are the scorer's (sharded over the devices,
combined with one `pmax` and one `psum`); this module owns the datastore on the devices and its checks.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from trime_jax import scoring, sharding
from trime_jax.datastore import Datastore
from trime_jax.errors import CheckpointError, ConfigError

# Share of a device's memory the datastore may take (the rest: the model, activations, similarity blocks).
MAX_MEMORY_SHARE = 0.8
# Host memory a datastore load holds at once: one chunk of one device's rows, read from the memmap.
LOAD_CHUNK_BYTES = 256 * 2**20


def device_bytes(count: int, dimension: int, devices: int, key_bytes: int = 2) -> int:
  """Bytes one device holds for a datastore of `count` keys of `dimension` (keys + int32 targets), padded."""
  per = -(-count // devices)
  return per * (dimension * key_bytes + 4)


def device_memory_limit(device) -> int | None:
  """Bytes the device can allocate, or None where the backend does not say (CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 - backends without memory stats
    return None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


@dataclasses.dataclass
class DeviceDatastore:
  """A datastore's keys and next tokens on the devices of `mesh`, rows sharded over `axis`."""

  keys: jax.Array  # [M_pad, D] datastore dtype (float16), P(axis)
  targets: jax.Array  # [M_pad] int32, -1 for the padding rows past `count`
  count: int
  mesh: jax.sharding.Mesh
  axis: str = sharding.DATA
  max_target: int = -1  # the largest target id stored (read once at load: checked against V per call on the host)
  search_seconds: float = 0.0  # time spent in `log_terms` (the counterpart of FAISS search time)
  queries: int = 0

  @property
  def dimension(self) -> int:
    return int(self.keys.shape[1])

  @property
  def k(self) -> int:  # every query sees every entry
    return self.count

  @property
  def devices(self) -> int:
    return int(self.mesh.shape[self.axis])

  def log_terms(self, queries_NxD, targets_N, scales) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays (lse_neg, lse_pos) `[C, N]`: see `external_log_terms`."""
    t0 = time.perf_counter()
    out = jax.device_get(external_log_terms(queries_NxD, targets_N, self, scales))
    self.search_seconds += time.perf_counter() - t0
    self.queries += int(np.prod(np.shape(targets_N)))
    return out


def load_datastore(ds: Datastore | str, mesh=None, *, axis: str = sharding.DATA, dtype=None,
                   chunk_bytes: int = LOAD_CHUNK_BYTES) -> DeviceDatastore:
  """Put a datastore on the devices of `mesh` (default: all devices), each device's rows read from the
  memory-mapped file in chunks of at most `chunk_bytes` of host memory (a 100M-key float16 datastore of
  1,024 dimensions is 211 GB: neither it nor one device's share is ever a host array). Raises ConfigError
  when the keys would not fit (devices that report their memory: GPUs, TPUs)."""
  ds = Datastore(ds) if isinstance(ds, str) else ds
  mesh = mesh if mesh is not None else sharding.make_mesh(0)
  n = int(mesh.shape[axis])
  dtype = np.dtype(dtype or ds.keys.dtype)
  need = device_bytes(ds.count, ds.dimension, n, dtype.itemsize)
  # a device of this process (another's does not report its memory here): every process takes the same verdict
  limit = device_memory_limit(next(d for d in mesh.devices.flat if d.process_index == jax.process_index()))
  if limit is not None and need > MAX_MEMORY_SHARE * limit:
    raise ConfigError(
        f"eval.datastore_on_device: the datastore ({ds.count:,} keys x {ds.dimension} {dtype.name}) needs "
        f"{need / 2**30:.2f} GiB per device on {n} devices, more than {MAX_MEMORY_SHARE:.0%} of a device's "
        f"{limit / 2**30:.2f} GiB: use more devices or FAISS top-K (eval.datastore_on_device=False)")
  rows = -(-ds.count // n) * n
  keys = rows_to_devices(ds.keys, ds.count, rows, 0, dtype, NamedSharding(mesh, P(axis, None)), chunk_bytes)
  targets = rows_to_devices(ds.values, ds.count, rows, -1, np.int32, NamedSharding(mesh, P(axis)), chunk_bytes)
  top = max((int(np.max(ds.values[i:i + (1 << 24)])) for i in range(0, ds.count, 1 << 24)), default=-1)
  return DeviceDatastore(keys, targets, ds.count, mesh, axis, max_target=top)


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buf, part, start):
  return jax.lax.dynamic_update_slice_in_dim(buf, part, start, 0)


def rows_to_devices(src, count: int, rows: int, fill, dtype, row_sharding: NamedSharding,
                    chunk_bytes: int = LOAD_CHUNK_BYTES) -> jax.Array:
  """A `[rows, ...]` array placed by `row_sharding` (rows split over one mesh axis, the rest whole) whose row r
  is `src[r]` for r < `count` and `fill` after: each addressable device's rows are written into a buffer on that
  device one chunk of at most `chunk_bytes` at a time (`src` is read by slices, e.g. a memmap), so the host
  holds one chunk, not the array or a device's shard (`jax.make_array_from_callback` would hold every shard's
  host copy until one transfer at the end)."""
  dtype = np.dtype(dtype)
  shape = (rows,) + tuple(src.shape[1:])
  row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)
  step = max(1, int(chunk_bytes) // row_bytes)
  shards = []
  for device, index in row_sharding.addressable_devices_indices_map(shape).items():
    if any(sl != slice(None) for sl in index[1:]):
      raise ValueError(f"rows_to_devices splits rows only, not {row_sharding.spec}")
    lo, hi = index[0].start or 0, rows if index[0].stop is None else index[0].stop
    buf = jnp.full((hi - lo,) + shape[1:], fill, dtype, device=device)
    for start in range(lo, min(hi, count), step):
      part = np.asarray(src[start:min(start + step, hi, count)]).astype(dtype, copy=False)
      buf = _write_rows(buf, jax.device_put(part, device), np.int32(start - lo))
      del part
    shards.append(buf)
  return jax.make_array_from_single_device_arrays(shape, row_sharding, shards)


def from_arrays(keys_MxD, targets_M, mesh, *, axis: str = sharding.DATA) -> DeviceDatastore:
  """A DeviceDatastore from in-memory arrays (tests, a long-term store built on the fly)."""
  keys, targets = np.asarray(keys_MxD), np.asarray(targets_M, np.int32)
  n = int(mesh.shape[axis])
  pad = -len(targets) % n
  keys = np.pad(keys, ((0, pad), (0, 0)))
  targets = np.pad(targets, (0, pad), constant_values=-1)
  return DeviceDatastore(jax.device_put(keys, NamedSharding(mesh, P(axis, None))),
                         jax.device_put(targets, NamedSharding(mesh, P(axis))), int(len(targets_M)), mesh, axis,
                         max_target=int(targets.max(initial=-1)))


def replicated(store: DeviceDatastore, x) -> jax.Array:
  """`x` on every device of the store's mesh (query-side arrays usually come from a jit on one device)."""
  return jax.device_put(x, NamedSharding(store.mesh, P()))


# ----------------------------------------------------------------------------------------------------------
# Evaluation: log-sum-exp terms at several scales.
# ----------------------------------------------------------------------------------------------------------
def external_log_terms(queries_NxD, targets_N, store: DeviceDatastore, scales, *, memory_chunk: int = 0):
  """(lse_neg, lse_pos) `[C, N]` (float32; float64 for float64 inputs) for scales c (a tuple of positive floats):

    lse_pos[c, i] = log Σ_{j: x_j = y_i} exp(c·sim_ij),   lse_neg[c, i] = log Σ_{j: x_j != y_i} exp(c·sim_ij)

  over every datastore entry j (-inf where a sum is empty), sim = q·k_j / √D. Any leading shape of queries /
  targets is allowed (`[..., D]` / `[...]`; the outputs are `[C, ...]`). The two sums are kept apart (rather
  than all and positive) so that neither is a difference of nearly equal numbers."""
  q = replicated(store, queries_NxD)
  lead = q.shape[:-1]
  q = q.reshape(-1, q.shape[-1])
  t = replicated(store, jnp.asarray(targets_N, jnp.int32)).reshape(-1)
  if q.shape[-1] != store.dimension:
    raise CheckpointError(f"queries of dimension {q.shape[-1]} cannot score a datastore of dimension "
                          f"{store.dimension}")
  scales = tuple(float(c) for c in scales)
  per = store.keys.shape[0] // store.devices
  # One chunk holds [C + 1, N, chunk] floats (similarities and their exps at every scale).
  chunk = memory_chunk or scoring.chunk_len(q.shape[0] * (len(scales) + 1), per)
  neg, pos = scoring.sharded_scaled_log_sums(q, t, store.keys, store.targets, scales, mesh=store.mesh,
                                             axis=store.axis, memory_chunk=chunk)
  return neg.reshape((len(scales),) + lead), pos.reshape((len(scales),) + lead)


def summary_blocks(lse_neg_CxSxQ, lse_pos_CxSxQ, scales) -> dict:
  """{scale c: a two-entry `scoring.MemoryBlock` (sim, visible, positive) `[S, Q, 2]`} whose
  masked log-sum-exp at scale c (c·sim) gives back lse_neg / lse_pos exactly: entry 0 holds the non-target
  memories' sum, entry 1 the target's (positive). Lets `evaluate.point_nlls` score the exact memory with the
  code that scores retrieved top-K entries."""
  out = {}
  for i, c in enumerate(scales):
    neg, pos = lse_neg_CxSxQ[i], lse_pos_CxSxQ[i]
    has_neg, has_pos = jnp.isfinite(neg), jnp.isfinite(pos)
    sim = jnp.stack([jnp.where(has_neg, neg, 0.0), jnp.where(has_pos, pos, 0.0)], -1) / c
    visible = jnp.stack([has_neg, has_pos], -1)
    positive = jnp.stack([jnp.zeros_like(has_pos), has_pos], -1)
    out[c] = scoring.MemoryBlock(sim, visible, positive)
  return out


# ----------------------------------------------------------------------------------------------------------
# Generation: the full distribution.
# ----------------------------------------------------------------------------------------------------------
def exact_external_log_probs(token_logits_NxV, queries_NxD, store: DeviceDatastore, *, tau: float = 1.0,
                             memory_chunk: int = 0):
  """The TRIME next-token distribution `[N, V]` (log-probabilities) over the vocabulary and every entry of the
  on-device datastore `store`, at τ = `tau`:

    P(w | c) ∝ exp(logit_w) + Σ_{j: x_j = w} exp(g(c)·k_j / √D / τ)

  For generation (one query per prompt and step): token_logits `[N, V]` the model's logits, queries `[N, D]`
  its keys g(c). Replicated output. `scoring.sharded_memory_log_probs` with every entry visible."""
  queries_NxD, token_logits_NxV = replicated(store, queries_NxD), replicated(store, token_logits_NxV)
  if queries_NxD.shape[-1] != store.dimension:
    raise CheckpointError(f"queries of dimension {queries_NxD.shape[-1]} cannot score a datastore of dimension "
                          f"{store.dimension}")
  if store.max_target >= token_logits_NxV.shape[-1]:  # (checked here, not by reading the targets back each call)
    raise CheckpointError(f"the datastore holds target id {store.max_target}, outside the model's vocabulary of "
                          f"{token_logits_NxV.shape[-1]}: it was built for another model")
  return scoring.sharded_memory_log_probs(token_logits_NxV, queries_NxD, store.keys, store.targets, None, mesh=store.mesh,
                                          tau=tau, axis=store.axis, memory_chunk=memory_chunk, targets_checked=True)
