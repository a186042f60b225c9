"""One `data` mesh axis: batches are split over it, parameters are replicated (room for FSDP later)."""

from __future__ import annotations

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
  # Auto axes: jit propagates the batch sharding (GSPMD); the TRIME loss adds explicit collectives itself.
  return jax.make_mesh((n,), (DATA,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])


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
