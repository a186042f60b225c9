"""External memory per evaluation step: FAISS top-K (flat, IVF-PQ) vs exact on-device scoring of every key.

  python -m bench.exact_memory [--sizes=16384,65536,262144,1048576] [--dim=128] [--queries=256] [--k=1024]
                               [--nprobe=32] [--scales=3] [--devices=1,8] [--repeats=3]

One step = the external-memory work of one evaluation step of `--queries` scored tokens (8 streams x 32 here;
8 x 128 with the default eval config):
  faiss_flat   IndexFlatIP top-K search (exact, K best) + the K next tokens, on the host
  faiss_ivfpq  IVF-PQ top-K search at nprobe (kNN-LM's index: nlist <= 4096, 64 sub-quantizers x 8 bits,
               clamped for small stores as `build_index` does; trained on <= 65,536 keys) + the K next tokens
  faiss_*_gpu  (--faiss_gpu) the same index on GPU 0, as `eval.knn_gpu` loads it (`KnnIndex.to_gpu`); its
               "agrees" column: the share of its top-K ids that the same index on the host also returns (float16
               lookup tables on the GPU shift a few near-ties; a wrong answer would show as a small share)
  on_device    `exact_memory.external_log_terms`: every key, sharded over n (virtual CPU) devices, log-sum-exp at
               `--scales` scales (3 = one configured trime / interp / knnlm point each; the tuning grid reads 21)
Keys are random float16 [M, D] (the datastore dtype); the search only depends on sizes. The top-K paths leave
the scoring of the K retrieved entries to the evaluator (on device, small); the on-device path has no K.

Also prints the memory the on-device path needs at WikiText-103 scale (no measurement: the datastore's shape).
Virtual CPU devices share this host's cores: more devices only split the same work (the times show the cost of
sharding, not accelerator speed); FAISS uses all host cores (OpenMP).
"""

import argparse
import os
import sys

_DEVICES = max(int(x) for x in next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")),
                                    "1,8").split(","))
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import faiss  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from trime_jax import exact_memory, sharding  # noqa: E402
from trime_jax.datastore import index as faiss_index  # noqa: E402

GIB = 1 << 30
WIKI103_KEYS = 103_224_461  # the original release's --dstore-size for WikiText-103 train (keys x 1024, fp16)
WIKI103_DIM = 1024


class _Synthetic:
  """The fields of a `Datastore` that `build_index` reads."""

  def __init__(self, keys, directory):
    self.keys, self.directory = keys, directory
    self.count, self.dimension = keys.shape
    self.fingerprint = "bench"


def _median(fn, repeats):
  fn()  # warm-up (compilation, FAISS allocations)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def faiss_version():
  """faiss's version, or None where `import faiss` found only the GPU machine's stand-in (no FAISS there: the
  device scripts put a module in its place whose every attribute raises ImportError)."""
  try:
    return faiss.__version__
  except ImportError:
    return None


def measure(size, dim, queries, k, nprobe, n_scales, device_counts, repeats, tmp, faiss_gpu=False, with_faiss=True):
  rng = np.random.default_rng(0)
  keys = rng.normal(size=(size, dim)).astype(np.float16)
  values = rng.integers(0, 50_000, size).astype(np.int32)
  q = rng.normal(size=(queries, dim)).astype(np.float32)
  y = rng.integers(0, 50_000, queries).astype(np.int32)
  kk = min(k, size)
  for kind in ("flat", "ivfpq") if with_faiss else ():
    idx = faiss_index.build_index(_Synthetic(keys, tmp), os.path.join(tmp, f"{kind}.faiss"), kind=kind,
                                  train_size=65_536, progress=False)
    idx.nprobe = nprobe

    def search():
      _, ids = idx.search(q, kk)
      return values[np.maximum(ids, 0)]

    nbytes = size * (dim * 4 if kind == "flat" else 72)
    yield f"faiss_{kind}", 1, _median(search, repeats), nbytes, None
    if faiss_gpu:  # the same index moved to GPU 0 as `eval.knn_gpu` moves it (KnnIndex.to_gpu)
      host_ids = idx.search(q, kk)[1]
      idx.to_gpu(0)
      yield f"faiss_{kind}_gpu", 1, _median(search, repeats), nbytes, _overlap(idx.search(q, kk)[1], host_ids)
    idx = None  # frees the index (host and GPU) before the next one is built
  scales = tuple(float(x) for x in np.linspace(0.5, 2.0, n_scales))
  for n in device_counts:
    store = exact_memory.from_arrays(keys, values, sharding.make_mesh(n))
    step = lambda: jax.block_until_ready(exact_memory.external_log_terms(q, y, store, scales))
    yield "on_device", n, _median(step, repeats), exact_memory.device_bytes(size, dim, n), None
    store = None  # frees the device copy before the next mesh


def _overlap(ids_NxK, reference_NxK):
  """The share of the top-K ids in `ids_NxK` that the same query's `reference_NxK` row also holds."""
  return float(np.mean([np.isin(a, b).mean() for a, b in zip(ids_NxK, reference_NxK)]))


def wiki103_table():
  """Bytes per device of the on-device datastore at WikiText-103 scale, and of the FAISS indexes."""
  lines = [f"WikiText-103 datastore: {WIKI103_KEYS:,} keys x D={WIKI103_DIM} (+ int32 next tokens)", "",
           "| path | devices | key dtype | per device (GiB) | fits in 80 % of (80 GiB H100 / 40 GiB A100 / "
           "32 GiB v4 / 16 GiB v5e) |",
           "|---|---:|---|---:|---|"]
  for dtype, nbytes in (("float16", 2), ("bfloat16", 2), ("float32", 4)):
    for n in (1, 8, 16, 64):
      if dtype == "bfloat16" and n != 8:
        continue
      per = exact_memory.device_bytes(WIKI103_KEYS, WIKI103_DIM, n, nbytes) / GIB
      fits = " / ".join("yes" if per <= exact_memory.MAX_MEMORY_SHARE * cap else "no" for cap in (80, 40, 32, 16))
      lines.append(f"| on_device | {n} | {dtype} | {per:,.2f} | {fits} |")
  flat = WIKI103_KEYS * WIKI103_DIM * 4 / GIB
  ivfpq = WIKI103_KEYS * (64 + 8) / GIB  # 64 one-byte PQ codes + an int64 id per key (+ 4096 centroids)
  lines += [f"| faiss_flat (host RAM) | 1 | float32 | {flat:,.2f} | host |",
            f"| faiss_ivfpq (host RAM) | 1 | 64 B codes + 8 B ids | {ivfpq:,.2f} | host |"]
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sizes", default="16384,65536,262144,1048576")
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--queries", type=int, default=256)
  p.add_argument("--k", type=int, default=1024)
  p.add_argument("--nprobe", type=int, default=32)
  p.add_argument("--scales", type=int, default=3)
  p.add_argument("--devices", default="1,8")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--faiss_gpu", action="store_true",
                 help="also each FAISS index moved to GPU 0 (a GPU build of faiss; JAX_PLATFORMS=cuda for on_device)")
  a = p.parse_args()
  version = faiss_version()
  if a.faiss_gpu and (version is None or not faiss_index.gpu_available()):
    print(f"error: --faiss_gpu: this faiss ({version or 'none'}) has no GPU support or sees no GPU", file=sys.stderr)
    sys.exit(2)
  faiss_note = (f"faiss {version} ({faiss.omp_get_max_threads()} threads)" if version else
                "no faiss on this machine: the exact on-device path only")
  device_counts = [int(x) for x in a.devices.split(",")]
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, {os.cpu_count()} cores (load average "
        f"{os.getloadavg()[0]:.1f}), {faiss_note}, D={a.dim}, "
        f"{a.queries} queries per step, K={a.k}, nprobe={a.nprobe}, {a.scales} scales, median of {a.repeats}\n")
  print("| datastore keys | path | devices | ms / step | queries / s | memory (MiB; per device for on_device) "
        "| agrees with the host index |")
  print("|---:|---|---:|---:|---:|---:|---:|")
  with tempfile.TemporaryDirectory() as tmp:
    for size in (int(s) for s in a.sizes.split(",")):
      for name, n, sec, nbytes, agrees in measure(size, a.dim, a.queries, a.k, a.nprobe, a.scales, device_counts,
                                                  a.repeats, tmp, faiss_gpu=a.faiss_gpu,
                                                  with_faiss=version is not None):
        print(f"| {size:,} | {name} | {n} | {sec * 1e3:,.1f} | {a.queries / sec:,.0f} | {nbytes / 2**20:,.1f} | "
              f"{'' if agrees is None else f'{agrees:.4f}'} |", flush=True)
  print()
  print(wiki103_table())


if __name__ == "__main__":
  main()
