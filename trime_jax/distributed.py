"""Multi-process (multi-host) runs: `jax.distributed` start-up and per-process slices of global batches.

Every host runs the same program on its own devices; the `data` mesh spans all devices of all hosts. Each
process loads only the rows of a global batch that its own devices hold (`process_rows`) and assembles the
global `jax.Array` with `jax.make_array_from_process_local_data`. Orbax checkpoints need no extra code:
every process calls save/restore and orbax coordinates the hosts (the workdir must be on storage all hosts
share, e.g. a GCS bucket or NFS).

Launch (see launch/tpu_pod.sh, launch/multi_gpu.sh):

  python -m trime_jax.distributed trime_jax.launch.train --config=configs/wiki103_247m.py --workdir=...

starts `jax.distributed` from the environment (`initialize_from_env`), then runs the module like `python -m`.
trime_jax.launch.eval and eval_ext run so too: each process evaluates its share of the streams
(`evaluate.evaluate`), process 0 prints and writes the result.

What only process 0 checks or writes (a lock, the shared files of a workdir) runs under `on_chief`, so that its
error stops every process instead of leaving the others waiting in the next collective; a decision taken from
shared files is process 0's for all (`from_chief`).
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import jax
import numpy as np

from trime_jax.errors import ENVIRONMENT_ERRNOS, TrimeError, os_error_line


def initialize_from_env() -> bool:
  """Start `jax.distributed` if this process is one of several; returns whether it did.

  JAX_NUM_PROCESSES > 1: explicit, with JAX_COORDINATOR_ADDRESS (host:port of process 0) and JAX_PROCESS_ID
    (GPU hosts; JAX_LOCAL_DEVICE_IDS, if set, is read by jax itself).
  TRIME_DISTRIBUTED=auto: jax's own cluster detection (Cloud TPU pod slices, SLURM, Open MPI).
  Otherwise a single process: nothing to do. Must run before any JAX computation.
  """
  n = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
  if n > 1:
    missing = [v for v in ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID") if v not in os.environ]
    if missing:
      raise RuntimeError(f"JAX_NUM_PROCESSES={n} but {', '.join(missing)} is not set")
    # A dead peer is detected when its heartbeats stop for this long; the survivors then abort with JAX's
    # "another task died" message (jax's default, 100 s, leaves them blocked in a collective that long).
    jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=n,
                               process_id=int(os.environ["JAX_PROCESS_ID"]),
                               heartbeat_timeout_seconds=int(os.environ.get("TRIME_HEARTBEAT_TIMEOUT_S", "30")),
                               shutdown_timeout_seconds=_shutdown_timeout())
    return True
  if os.environ.get("TRIME_DISTRIBUTED") == "auto":
    jax.distributed.initialize(shutdown_timeout_seconds=_shutdown_timeout())
    return True
  return False


def _shutdown_timeout() -> int:
  """How long a process that ends waits at exit for the others to end too. A process that stops on an error
  while the others wait in a collective (an error only it met) stays alive in that wait, so its peers see no
  missed heartbeat: all of them end when it times out (jax's default, 300 s). The processes of a run that
  ends well reach it within seconds of each other (process 0 writes its outputs last)."""
  return int(os.environ.get("TRIME_SHUTDOWN_TIMEOUT_S", "60"))


def sync_processes(name: str) -> None:
  """A barrier across the processes of a multi-host run (named, so a mismatch is visible); nothing on one."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def every_process(value) -> list:
  """Every process's `value` (anything JSON carries), in process order, on every process; [value] on one."""
  if jax.process_count() == 1:
    return [value]
  from jax.experimental import multihost_utils

  mine = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(mine.size))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:mine.size] = mine
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  return [json.loads(row[:n].tobytes().decode()) for row, n in zip(rows, sizes)]


def from_chief(value):
  """Process 0's `value` on every process. For a decision each process could take from shared files read at its
  own moment (process 0 may be rewriting them): taken apart, processes could disagree and leave some in a
  collective the others never enter."""
  return every_process(value)[0]


class ChiefStopped(TrimeError):
  """Process 0 stopped on an error (its own line names it) in something only it does: the others stop too."""


def on_chief(fn):
  """`fn()` on process 0 only (a check of shared files, a lock, a write); returns its value there, None on the
  others. If it raises, every process raises: process 0 its error, the others ChiefStopped with its message.
  Without this the others would go on into the next collective and wait there for process 0, which is gone."""
  if jax.process_count() == 1:
    return fn()
  value = error = None
  if jax.process_index() == 0:
    try:
      value = fn()
    except Exception as e:  # noqa: BLE001 - raised again below, after the others are told
      error = e
  stopped = from_chief(None if error is None else _one_line(error))
  if error is not None:
    raise error
  if stopped is not None:
    raise ChiefStopped(f"process 0 stopped ({stopped})")
  return value


def _one_line(error: Exception) -> str:
  """Process 0's error as the others say it: an OSError of the machine in the words process 0's `error:` line
  uses (`errors.os_error_line`), anything else with its type."""
  if isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS:
    return os_error_line(error)
  return f"{type(error).__name__}: {error}"


def process_rows(sharding: jax.sharding.Sharding, global_shape, axis: int) -> np.ndarray:
  """Sorted global indices along `axis` of the rows this process's devices hold under `sharding`.

  These are the rows to load on this host, in the order `jax.make_array_from_process_local_data` expects.
  """
  rows = set()
  for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
    rows.update(range(*index[axis].indices(global_shape[axis])))
  return np.asarray(sorted(rows), np.int64)


def global_array(sharding: jax.sharding.Sharding, local, global_shape) -> jax.Array:
  """The global array whose rows on this process's devices are `local` (see `process_rows`)."""
  return jax.make_array_from_process_local_data(sharding, np.asarray(local), tuple(global_shape))


def main(argv) -> None:
  """`python -m trime_jax.distributed MODULE [ARGS...]`: initialise from the environment, run MODULE."""
  if len(argv) < 2:
    raise SystemExit("usage: python -m trime_jax.distributed MODULE [ARGS...]  "
                     "(e.g. trime_jax.launch.train --config=...)")
  initialize_from_env()
  sys.argv = argv[1:]
  runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main(sys.argv)
