"""One `data` mesh axis: batches are split over it, parameters are replicated (room for FSDP later)."""

from __future__ import annotations

import numbers

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from trime_jax.errors import ConfigError

DATA = "data"


def make_mesh(num_devices: int = 0, what: str = "train.num_devices") -> jax.sharding.Mesh:
  """A 1-D mesh over the first `num_devices` devices (0 = all); `what` names the setting in the error."""
  available = jax.device_count()
  n = num_devices or available
  if n < 0 or n > available:
    raise ConfigError(f"{what}={n} but only {available} devices are visible")
  return mesh_of(jax.devices()[:n])


def mesh_of(devices) -> jax.sharding.Mesh:
  """The 1-D `data` mesh over `devices`. Auto axes: jit propagates the batch sharding (GSPMD); the TRIME loss adds
  explicit collectives itself."""
  return jax.make_mesh((len(devices),), (DATA,), axis_types=(jax.sharding.AxisType.Auto,), devices=list(devices))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh, batch_axis: int = 0) -> NamedSharding:
  """Shard dimension `batch_axis` over `data` (train batches are [accum, B, L]: batch_axis=1)."""
  return NamedSharding(mesh, P(*([None] * batch_axis), DATA))


def train_state_shardings(mesh, state: dict) -> dict:
  """Where a training state lives: the step, parameters and optimizer state replicated; a stateful model's
  `carry` (each row's state across segments: every leaf [B, ...]) split over `data` along its rows, as the
  batch rows it continues are (replicated, every step would gather every row's carry onto every device)."""
  out = {k: replicated(mesh) for k in state}
  if "carry" in state:
    out["carry"] = batch_sharding(mesh, 0)
  return out


def device_count(devices, what: str) -> int:
  """`devices` (0: all of this process's) as an int, else one ConfigError naming `what`: not a count >= 0, or
  more than this process sees."""
  if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 0:
    raise ConfigError(f"{what} must be a device count >= 0 (0: all of this process's), got {devices!r}")
  have = len(jax.local_devices())
  if devices > have:
    raise ConfigError(f"{what}={devices} but this process sees {have} device{'s' if have > 1 else ''}")
  return int(devices)


def process_streams(streams: int) -> tuple[int, int] | None:
  """[lo, hi): the evaluation streams this process computes in a run of several processes, each process its
  own contiguous share on its own devices (the scores and sums are gathered at the end, `evaluate`). None
  where every process computes every stream: one process, or streams that are not a multiple of the
  processes (then each computes all of them, as before 2026-12-07)."""
  p = jax.process_count()
  if p == 1 or streams % p:
    return None
  i = jax.process_index()
  return i * streams // p, (i + 1) * streams // p


def streams_here(streams: int) -> int:
  """How many of `streams` this process evaluates (`process_streams`)."""
  share = process_streams(streams)
  return streams if share is None else share[1] - share[0]


def eval_mesh(devices: int, streams: int, what: str = "eval.devices",
              split_over_processes: bool = True) -> jax.sharding.Mesh | None:
  """The mesh evaluation splits its `streams` (eval.batch_size) over: the first `devices` of this process's
  devices (0 = all of them). None for one device: jit's default device, as the original's one GPU. In a run of
  several processes each splits its share of the streams (`process_streams`) over its own devices (all of them
  with `split_over_processes=False`, as `evaluate`'s). ConfigError
  when the count is not available or does not divide the streams (each device holds whole streams: a stream's
  long-term store and state continue from step to step on the device that holds it)."""
  local = jax.local_devices()
  n = device_count(devices, what) or len(local)
  if n == 1:
    return None
  here = streams_here(streams) if split_over_processes else streams
  if here % n:
    of = "" if here == streams else f" ({here} on each of the {jax.process_count()} processes)"
    # over several processes: the multiple that splits them over every process's devices
    per = n * (jax.process_count() if split_over_processes else 1)
    raise ConfigError(f"eval.batch_size={streams} streams{of} do not split over {what}={n} devices: make it a "
                      f"multiple of {per} (a Transformer's scores do not depend on the number of streams)")
  return mesh_of(local[:n])


def eval_submesh(mesh: jax.sharding.Mesh, streams: int) -> jax.sharding.Mesh | None:
  """Where training's dev evaluation runs on a training `mesh`: k of this process's devices of it, k the largest
  count that divides the streams it evaluates (eval.batch_size, or its share of them in a run of several
  processes: `process_streams`), so that no device computes another's streams again. None where k is 1 (one
  device: in a run of several processes, this process's first, the parameters copied there by `evaluate`), or
  where every process computes every stream (the streams not a multiple of the processes): jit places it,
  replicated over the training mesh, every device computing every stream."""
  if jax.process_count() > 1 and process_streams(streams) is None:
    return None
  devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  here = streams_here(streams)
  k = max(d for d in range(1, len(devices) + 1) if here % d == 0)
  if k == 1:
    return None
  return mesh_of(devices[:k])


def local_copy(tree):
  """`tree` with each array that spans several processes (replicated over a multi-process mesh: a training
  state's parameters) as this process's own copy of it, for work done on this process's devices alone."""
  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    if not x.is_fully_replicated:
      raise ValueError(f"an array of shape {x.shape} split over several processes has no copy on each of them")
    return x.addressable_data(0)
  return jax.tree_util.tree_map(one, tree)
