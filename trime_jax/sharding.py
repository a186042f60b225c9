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


def eval_mesh(devices: int, streams: int, what: str = "eval.devices") -> jax.sharding.Mesh | None:
  """The mesh evaluation splits its `streams` (eval.batch_size) over: the first `devices` of this process's
  devices (0 = all of them). None for one device: jit's default device, as the original's one GPU. Each process
  evaluates on its own devices (its host reads every stream's scores and searches the datastore for them).
  ConfigError when the count is not available or does not divide the streams (each device holds whole streams:
  a stream's long-term store and state continue from step to step on the device that holds it)."""
  local = jax.local_devices()
  n = device_count(devices, what) or len(local)
  if n == 1:
    return None
  if streams % n:
    raise ConfigError(f"eval.batch_size={streams} streams do not split over {what}={n} devices: make it a "
                      f"multiple of {n} (a Transformer's scores do not depend on the number of streams)")
  return mesh_of(local[:n])


def eval_submesh(mesh: jax.sharding.Mesh, streams: int) -> jax.sharding.Mesh | None:
  """Where training's dev evaluation runs on a training `mesh`: its first k devices, k the largest device count
  that divides `streams` (eval.batch_size), so that no device computes another's streams again. None (jit
  places it: replicated over the training mesh, every device computing every stream) where k is 1 or the mesh
  spans processes (each process's host reads every score: `eval_mesh`)."""
  devices = list(mesh.devices.flat)
  if jax.process_count() > 1 or len(devices) == 1:
    return None
  k = max(d for d in range(1, len(devices) + 1) if streams % d == 0)
  if k == 1:
    return None
  return mesh_of(devices[:k])
