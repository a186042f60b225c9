"""FAISS index (inner product, or L2 for the original's kNN-LM) over a datastore's keys, with a JSON sidecar and
exact re-scoring.

Files: `<path>` (faiss.write_index) and `<path>.json` (format, index_type, metric, dimension, count,
datastore_fingerprint, the IVF-PQ parameters actually used, timings). The sidecar is written last, so an index
without one is incomplete and refused. While a build runs (it resumes): `<path>.trained.*` and `<path>.partial.*`
(`build_index`).

  build_index(ds, path=None, kind="auto", queries=Q, k=K, nprobe=P, metric="inner_product", ...)
                                                   auto: the cheaper of exact IndexFlatIP and IVF-PQ
                                                   (kNN-LM: 4096 lists, 64 sub-quantizers × 8 bits, trained on
                                                   a seeded sample) for Q searches of K neighbours, stated when
                                                   chosen (`index_choice`); without Q: exact while N·D ≤ 2^27
  KnnIndex.load(path, datastore=ds, nprobe=32, gpu=False, metric="inner_product")
  index.search(queries [n, D] float32, k) -> (scores [n, k] float32, ids [n, k] int64), best first;
                                                   ids index the datastore (-1 / -inf: fewer than k found)
  rescore(ds, queries, ids, metric=...) -> (scores, ids)
                                                   exact q·k ("inner_product") or -|q - k|² ("l2") from the
                                                   stored float16 keys, re-sorted
  default_index_path(datastore_dir, metric)        <datastore>/index.faiss (inner product) | index_l2.faiss (L2)
  gpu_available()                                  whether this faiss build can move indexes to a GPU

Verified on load: the sidecar parses, the index file matches the digest the sidecar recorded (`file_digest`,
the datastore's), its dimension and count match the sidecar and the datastore, and its metric (the sidecar's
`metric`; sidecars without one are inner-product indexes) is the one the caller expects.

Scores are raw inner products q·k (metric "inner_product"); TRIME's similarity is q·k / √D (the evaluator
applies the scale and its τ). An L2 index (metric "l2": the original release's kNN-LM, build_dstore.py
--dist l2) scores -|q - k|² (faiss's squared distances negated, so that larger is better with either metric).
IVF-PQ scores are approximate (PQ codes); `rescore` recovers the exact ones for the retrieved ids.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import sys
import time

import faiss
import numpy as np
from tqdm import tqdm

from trime_jax import data
from trime_jax.datastore.build import Datastore, file_digest
from trime_jax.errors import NO_SPACE_ERRNOS, CheckpointError, ConfigError, DamagedCheckpointError, first_line

FORMAT = "trime-faiss-index/1"
KINDS = ("auto", "flat", "ivfpq")
# The sidecar's `metric` of each index metric ("inner_product": TRIME's, the default; "l2": the original's kNN-LM)
METRICS = ("inner_product", "l2")
INDEX_FILES = {"inner_product": "index.faiss", "l2": "index_l2.faiss"}  # default_index_path's file names
EXACT_MAX_FLOATS = 1 << 27  # auto: exact IndexFlatIP while its float32 copy of the keys (N·D) fits 512 MiB
MIN_POINTS_PER_CENTROID = 39  # below this faiss k-means warns that clustering is unreliable
RESCORE_FLOATS = 1 << 22  # float32 keys gathered at a time by `rescore` (16 MiB)
# Cost model of `index_choice` and of the build's stated estimate, measured 2026-12-01 with faiss-cpu 1.15.1 on
# the 2-core machine, idle, random keys (D = 16, 32, 128): one (point, centroid) distance of the coarse k-means
# (GEMM + argmin) takes (D + 32) / 1.18e11 s (D = 128: 9.4e10 multiply-adds/s), for 10 iterations (IndexIVF's own
# clustering parameters) over at most 256 points per centroid (faiss subsamples); adding assigns and encodes a
# key at (D + 25) / 8.9e10 s per centroid (coarse lists and PQ codewords; D = 128: 7.4e10/s); the product
# quantizer's k-means, 25 iterations over at most 256 · 2^bits points, takes 1.7e-10 s per (point, centroid,
# iteration) for sub-vectors of 2-8 floats and 1.5e-9 s for 1 float; an exact search (K = 64-1,024) takes
# 1.1e-9 + 8.2e-12 · D s per (query, key) (D = 128: 6e10 multiply-adds/s); an IVF-PQ search 2e9 of its
# nlist · D + nprobe · N/nlist · m operations per second. Measured: 1M keys of D = 128, nlist 1,000, m = 16
# trained and added in 10.8 s (docs-wt's 1M-key index); 17.8M keys, nlist 4,096: 58 s of training, 122 s
# of adding. The earlier calibration (exact 1.6e9/s, k-means 3.6e9/s over every training point, 25 iterations,
# PQ 1e-8 s) was measured with the cores busy with other work, where faiss's OpenMP threads ran 20-60x slower,
# and stated a 10-s build as ~15 min.
KMEANS_MACS_PER_S, KMEANS_OVERHEAD = 1.18e11, 32  # per distance: (D + overhead) / rate
ADD_MACS_PER_S, ADD_OVERHEAD = 8.9e10, 25
IVF_KMEANS_ITERS = 10  # faiss IndexIVF's clustering parameters (cp.niter)
KMEANS_MAX_POINTS_PER_CENTROID = 256  # faiss Clustering's default: k-means samples at most 256 points a centroid
PQ_KMEANS_ITERS = 25  # faiss ProductQuantizer's cp.niter
PQ_MAX_POINTS_PER_CENTROID = 256  # faiss Clustering's default: PQ k-means samples at most 256 · 2^bits points
IVF_SEARCH_OPS_PER_S = 2e9
# Resumable index builds (`build_index`): the trained empty index and the keys added so far, beside the index.
TRAINED, PARTIAL = ".trained", ".partial"
SAVE_EVERY_S = 1800.0  # adding 100M keys takes hours on a CPU; a save of the partial index costs a write of it
HEARTBEAT_S = 30.0  # an index being trained says every this many seconds how long it has taken and should take
# Sidecar fields that say where the datastore and a --trained_index lay, not what was built: a kept index or a
# resumed state is matched without them (the datastore's fingerprint and the trained file's digest say which
# they are), so moving either between an interrupted build and its rerun does not throw hours of adding away.
LOCATION_FIELDS = ("datastore", "trained_from")


def pq_seconds_per_distance(dsub: int) -> float:
  """Seconds per (point, centroid, iteration) of one PQ sub-quantizer's k-means (see the measurements above)."""
  return 1.5e-9 if dsub <= 1 else 1.7e-10


def flat_seconds_per_distance(d: int) -> float:
  """Seconds per (query, key) of an exact IndexFlatIP search with a top-K heap (see the measurements above)."""
  return 1.1e-9 + 8.2e-12 * d


def ivfpq_build_seconds(n: int, d: int, *, nlist: int, pq_m: int, pq_bits: int = 8,
                        train_size: int = 1_000_000) -> dict:
  """Estimated seconds of an IVF-PQ build with these (already clamped) parameters on an idle 2-core machine:
  {coarse, pq, add, total}."""
  n_train = min(n, int(train_size))
  coarse = (IVF_KMEANS_ITERS * min(n_train, KMEANS_MAX_POINTS_PER_CENTROID * nlist) * nlist
            * (d + KMEANS_OVERHEAD) / KMEANS_MACS_PER_S)
  k = 2 ** int(pq_bits)
  pq = (pq_m * PQ_KMEANS_ITERS * min(n_train, PQ_MAX_POINTS_PER_CENTROID * k) * k
        * pq_seconds_per_distance(max(1, d // max(1, pq_m))))
  add = n * (nlist + k) * (d + ADD_OVERHEAD) / ADD_MACS_PER_S  # list assignment + PQ encoding of every key
  return {"coarse": coarse, "pq": pq, "add": add, "total": coarse + pq + add}


def index_choice(n: int, d: int, queries: int, k: int, *, nprobe: int = 32, nlist: int = 4096, pq_m: int = 64,
                 train_size: int = 1_000_000, exact_max_floats: int = EXACT_MAX_FLOATS) -> tuple[str, str]:
  """("flat" | "ivfpq", why): the index whose build + `queries` searches of K neighbours costs less.

  flat:  queries · N · D multiply-adds (every query scans every key).
  ivfpq: its build (`ivfpq_build_seconds`: coarse k-means, PQ training, adding) + queries · (nlist · D +
  nprobe · N/nlist · m).
  Exact wins ties, and whenever IVF-PQ's nprobe lists hold fewer than 2K candidates (it could not return K good
  neighbours) or the store is too small to train; it loses when its float32 keys exceed `exact_max_floats`."""
  n_train = min(n, int(train_size))
  nlist_used = max(1, min(int(nlist), n_train // MIN_POINTS_PER_CENTROID))
  m_used = _largest_divisor_at_most(d, int(pq_m))
  bits_used = _pq_bits(8, n_train)
  flat_s = queries * n * flat_seconds_per_distance(d)
  build = ivfpq_build_seconds(n, d, nlist=nlist_used, pq_m=m_used, pq_bits=bits_used, train_size=train_size)
  ivf_s = build["total"] + queries * (nlist_used * d + nprobe * n / nlist_used * m_used) / IVF_SEARCH_OPS_PER_S
  costs = (f"{queries:,} searches of K={k} over {n:,} × {d} keys: exact ~{_dur(flat_s)}, IVF-PQ (nlist={nlist_used},"
           f" m={m_used}, nprobe={nprobe}) ~{_dur(ivf_s)} of which ~{_dur(build['total'])} to build it, at the "
           "idle 2-core rates in trime_jax/datastore/index.py")
  if n * d > exact_max_floats:
    return "ivfpq", f"IVF-PQ: an exact index's float32 keys ({n * d * 4 / 2**30:.1f} GiB) exceed the limit; {costs}"
  if n_train < 2 * MIN_POINTS_PER_CENTROID or nprobe * n / nlist_used < 2 * k:
    return "flat", f"exact: too few keys for IVF-PQ to return K={k} good neighbours; {costs}"
  if flat_s <= ivf_s:
    return "flat", f"exact: the cheaper one; {costs}"
  return "ivfpq", f"IVF-PQ: the cheaper one (approximate scores; --index=flat forces exact); {costs}"


def _pq_bits(pq_bits: int, n_train: int) -> int:
  return max(1, min(int(pq_bits), int(math.log2(max(n_train // MIN_POINTS_PER_CENTROID, 2)))))


class _Heartbeat:
  """While a blocking FAISS call runs (faiss releases the GIL), print every `every` seconds how long it has
  taken and, from the cost model's `estimate`, about how long it should still take: minutes of silence are
  otherwise indistinguishable from a hang."""

  def __init__(self, what: str, estimate: float | None, every: float = HEARTBEAT_S, enabled: bool = True):
    import threading

    self.what, self.estimate, self.every, self.enabled = what, estimate, every, enabled
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    t0 = time.perf_counter()
    while not self._stop.wait(self.every):
      spent = time.perf_counter() - t0
      if self.estimate is None:
        eta = ""
      elif spent < self.estimate:
        eta = f", ~{_dur(self.estimate - spent)} left (estimated ~{_dur(self.estimate)} in all)"
      else:
        eta = f", longer than the ~{_dur(self.estimate)} estimated (a loaded machine); still working"
      print(f"index: {self.what}: {_dur(spent)} elapsed{eta}", flush=True)

  def __enter__(self):
    if self.enabled:
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    if self.enabled:
      self._thread.join()


def _dur(seconds: float) -> str:
  return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def gpu_available() -> bool:
  """True when this faiss build has GPU support and sees at least one GPU (faiss-cpu: False)."""
  return (hasattr(faiss, "StandardGpuResources") and hasattr(faiss, "index_cpu_to_gpu")
          and faiss.get_num_gpus() > 0)


def host_memory_bytes() -> int:
  """This machine's physical memory."""
  return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _sidecar(path: str) -> str:
  return path + ".json"


def _check_metric(metric: str) -> str:
  if metric not in METRICS:
    raise ConfigError(f"index metric must be one of {METRICS}, got {metric!r}")
  return metric


def _faiss_metric(metric: str):
  return faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT


def _metric_words(metric: str) -> str:
  return "L2" if metric == "l2" else "inner product"


def default_index_path(datastore_dir: str, metric: str = "inner_product") -> str:
  """Where build_index writes (and evaluation looks for) a datastore's index of `metric` by default:
  `<datastore>/index.faiss` (inner product) or `<datastore>/index_l2.faiss` (L2)."""
  return os.path.join(os.fspath(datastore_dir), INDEX_FILES[_check_metric(metric)])


def _largest_divisor_at_most(n: int, cap: int) -> int:
  return max(m for m in range(1, max(1, min(n, cap)) + 1) if n % m == 0)


def _f32(x) -> np.ndarray:
  return np.ascontiguousarray(x, dtype=np.float32)


def build_index(ds: Datastore, path: str | None = None, *, kind: str = "auto",
                exact_max_floats: int = EXACT_MAX_FLOATS, queries: int | None = None, k: int = 1024,
                nprobe: int = 32,
                nlist: int = 4096, pq_m: int = 64, pq_bits: int = 8, train_size: int = 1_000_000,
                add_chunk: int = 1 << 20, seed: int = 0, progress: bool = True,
                trained_index: str | None = None, save_every_s: float = SAVE_EVERY_S,
                reuse: bool = False, metric: str = "inner_product") -> "KnnIndex":
  """Build, save (`path`, default `default_index_path`: `<datastore>/index.faiss`, or `index_l2.faiss` for
  metric="l2") and return an index over `ds.keys`.

  metric: "inner_product" (TRIME's, the evaluation's one search; the default) or "l2" (IndexFlatL2 / IVF-PQ
  with METRIC_L2 and an L2 coarse quantizer, as the original release's build_dstore.py --dist l2: its kNN-LM
  baseline, `eval.knnlm_metric="l2"`). Recorded in the sidecar and checked on load.

  IVF-PQ parameters are clamped for small stores: nlist ≤ train_points / 39, pq_m the largest divisor of D
  not above pq_m, pq_bits ≤ log2(train_points / 39); the sidecar records the values used.

  trained_index: a faiss file holding an already trained, empty IVF-PQ index of `metric` (e.g. the
  `knn.index.ip.trained` the original release's build_dstore.py writes). Its coarse centroids and PQ codebooks
  are used as they are and only the keys are added, so the index equals one built by that code from the same
  keys: k-means and PQ training are not reproducible across faiss versions, adding is. Implies kind="ivfpq".

  Resumable (WikiText-103's 100M keys take hours to add on a CPU): the trained, empty IVF-PQ index is kept as
  `<path>.trained.*` as soon as it is trained, and the keys added so far as `<path>.partial.*` every
  `save_every_s` seconds of adding and on Ctrl-C; each a data file and a sidecar (`_save_state`) naming the
  datastore and parameters it belongs to. A
  rerun with the same datastore and parameters continues from the furthest of them (the result is the index
  a build without the interruption makes from those quantizers: ids are sequential and adding is
  deterministic); state of another datastore or other parameters is never used (said, then replaced). Both
  files are removed once the index is written.

  reuse=True (the CLI's): an intact index already at `path` over this datastore with these parameters is
  returned as it is (said) instead of being built again; anything else at `path` is rebuilt.
  """
  if kind not in KINDS:
    raise ConfigError(f"index kind must be one of {KINDS}, got {kind!r}")
  _check_metric(metric)
  if trained_index:
    kind = "ivfpq"
  path = path or default_index_path(ds.directory, metric)
  n, d = ds.count, ds.dimension
  if kind == "auto" and queries is None:  # no search cost to weigh: exact while the keys fit
    kind = "flat" if n * d <= exact_max_floats else "ivfpq"
  elif kind == "auto":
    kind, why = index_choice(n, d, int(queries), int(k), nprobe=nprobe, nlist=nlist, pq_m=pq_m,
                             train_size=train_size, exact_max_floats=exact_max_floats)
    if progress:
      print(f"index: auto chose {why}", flush=True)
  if kind == "flat" and n * d * 4 > host_memory_bytes():  # asked for by name: auto never picks it at this size
    raise ConfigError(f"an exact (flat) index of {n:,} x {d} keys holds {n * d * 4 / 2**30:,.1f} GiB of float32 "
                      f"keys in memory, more than this machine's {host_memory_bytes() / 2**30:,.1f} GiB: use "
                      "--index=ivfpq (or auto), or eval.datastore_on_device=True to score every key on accelerators")
  info = {"format": FORMAT, "index_type": kind, "metric": metric, "dimension": d, "count": n,
          "datastore_fingerprint": ds.fingerprint, "datastore": ds.directory}
  say = (lambda msg: print(f"index: {msg}", flush=True)) if progress else (lambda msg: None)
  t0 = time.perf_counter()
  spent = {"train_seconds": 0.0, "add_seconds": 0.0}  # carried over from resumed states
  trained = _read_trained_ivfpq(trained_index, d, metric) if trained_index else None
  if trained is not None:
    info.update(nlist=int(trained.nlist), pq_m=int(trained.pq.M), pq_bits=int(trained.pq.nbits),
                trained_from=os.path.abspath(trained_index), trained_digest=file_digest(trained_index))
  elif kind == "ivfpq":
    n_train = min(n, int(train_size))
    info.update(nlist=max(1, min(int(nlist), n_train // MIN_POINTS_PER_CENTROID)),
                pq_m=_largest_divisor_at_most(d, int(pq_m)), pq_bits=_pq_bits(pq_bits, n_train), train_size=n_train,
                seed=seed)
  belongs = dict(info)  # what a kept index or a resumed state must have been built with
  if reuse and (kept := _complete_index(path, belongs, ds, say)) is not None:
    return kept
  # The furthest state of this build: keys added so far, else (IVF-PQ trained here) the trained quantizers.
  index = _first_state(path, (PARTIAL, TRAINED) if kind == "ivfpq" and trained is None else (PARTIAL,), belongs,
                       say, spent)
  if index is None and kind == "flat":
    index = faiss.IndexFlatL2(d) if metric == "l2" else faiss.IndexFlatIP(d)
  elif index is None and trained is not None:
    index = trained
    say(f"IVF-PQ (nlist={trained.nlist}, m={trained.pq.M}, bits={trained.pq.nbits}) trained by {trained_index}; "
        f"adding {n:,} keys")
  elif index is None:
    nlist_used, m_used, bits_used, n_train = info["nlist"], info["pq_m"], info["pq_bits"], info["train_size"]
    quantizer = faiss.IndexFlatL2(d) if metric == "l2" else faiss.IndexFlatIP(d)
    index = faiss.IndexIVFPQ(quantizer, d, nlist_used, m_used, bits_used, _faiss_metric(metric))
    sample = np.sort(np.random.default_rng(seed).choice(n, size=n_train, replace=False))
    train = _f32(ds.keys[sample])
    est = ivfpq_build_seconds(n, d, nlist=nlist_used, pq_m=m_used, pq_bits=bits_used, train_size=train_size)
    say(f"training IVF-PQ (nlist={nlist_used}, m={m_used}, bits={bits_used}) on {n_train:,} keys: "
        f"estimated ~{_dur(est['coarse'] + est['pq'])} (coarse k-means ~{_dur(est['coarse'])}, product "
        f"quantizer ~{_dur(est['pq'])}), then ~{_dur(est['add'])} to add the keys")
    with _Heartbeat("training IVF-PQ", est["coarse"] + est["pq"], enabled=progress):
      index.train(train)
    del train
    spent["train_seconds"] = round(time.perf_counter() - t0, 3)
    _save_state(index, path + TRAINED, belongs, spent)
  t1 = time.perf_counter()
  added = lambda: dict(spent, add_seconds=round(spent["add_seconds"] + time.perf_counter() - t1, 3))
  # Keys are added in chunks of at most 1/20 of the store, so the bar (keys, rate, ETA) moves on small stores too.
  step = max(1, min(int(add_chunk), -(-n // 20)))
  done = saved = int(index.ntotal)
  last_save = time.monotonic()
  try:
    with tqdm(total=n, initial=done, desc="index add", unit="key", unit_scale=True, disable=not progress) as bar:
      for a in range(done, n, step):
        index.add(_f32(ds.keys[a:a + step]))  # ids are sequential: id = datastore row
        bar.update(min(step, n - a))
        if index.ntotal < n and time.monotonic() - last_save >= save_every_s:
          try:
            _save_state(index, path + PARTIAL, belongs, added())
            saved = int(index.ntotal)
          except OSError as e:  # a full disk: the build goes on; the last good state stays
            print(f"warning: could not save the partial index {path + PARTIAL} ({first_line(e)}); the build "
                  "goes on, a resume would start from the last saved state", file=sys.stderr, flush=True)
          last_save = time.monotonic()
  except KeyboardInterrupt:
    if index.ntotal > saved:  # an interrupt lands between two adds (faiss holds the interpreter while adding)
      try:
        _save_state(index, path + PARTIAL, belongs, added())  # a second Ctrl-C here keeps the previous state
      except OSError as e:  # a full disk: the interrupt still stops the build; the last good state stays
        print(f"warning: could not save the partial index {path + PARTIAL} ({first_line(e)}); a resume starts "
              "from the last saved state", file=sys.stderr, flush=True)
    raise
  if index.ntotal != n:
    raise CheckpointError(f"index holds {index.ntotal} keys after adding {n}")
  info.update(added())
  info["build_seconds"] = round(info["train_seconds"] + info["add_seconds"], 3)
  if os.path.exists(_sidecar(path)):
    os.remove(_sidecar(path))  # the old sidecar must not vouch for a half-written index
  _write_index(index, path)
  info["file_digest"] = file_digest(path)
  data.atomic_write_json(_sidecar(path), info)
  for state in (path + PARTIAL, path + TRAINED):
    _remove_state(state)
  say(f"{kind} ({_metric_words(metric)}) over {n:,} × {d} keys in {info['build_seconds']:.1f} s -> {path}")
  return KnnIndex(index, info, path)


def _complete_index(path: str, belongs: dict, ds: Datastore, say):
  """The intact index at `path` if it was built over `ds` with the parameters of `belongs`, else None."""
  if not os.path.exists(path):
    return None
  try:
    index = KnnIndex.load(path, datastore=ds, metric=belongs["metric"])
  except (CheckpointError, OSError, KeyError, TypeError, ValueError, AttributeError) as e:
    say(f"{path} cannot be kept ({first_line(e)}): building it again")
    return None
  differ = _differing(index.info, belongs, only=belongs)
  if differ:
    say(f"{path} was built with other {', '.join(differ)}: building it again")
    return None
  say(f"{path} already holds this datastore's keys with these parameters: kept (delete it to build it again)")
  return index


def _indexes_in(folder: str) -> list:
  """The finished indexes in `folder`: files with a sidecar of this format beside them."""
  found = []
  for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
    index = os.path.join(folder, name[:-len(".json")])
    if name.endswith(".json") and os.path.isfile(index):
      try:
        with open(os.path.join(folder, name)) as f:
          if json.load(f).get("format") == FORMAT:
            found.append(index)
      except (OSError, ValueError, AttributeError):
        continue
  return found


def _differing(recorded: dict, belongs: dict, only=None) -> list:
  """The fields (of `only`, else of either) in which `recorded` and `belongs` differ, LOCATION_FIELDS aside."""
  names = set(only if only is not None else {*recorded, *belongs}) - set(LOCATION_FIELDS)
  return sorted(k for k in names if recorded.get(k) != belongs.get(k))


def saved_state(path: str) -> str:
  """What an interrupted `build_index` of `path` left to resume from, in words."""
  for state, what in ((path + PARTIAL, "keys added"), (path + TRAINED, "trained quantizers")):
    try:
      with open(_sidecar(state)) as f:
        meta = json.load(f)
      return (f"{meta['ntotal']:,} {what} ({os.path.basename(state)})" if meta["ntotal"] else
              f"its {what} ({os.path.basename(state)})")
    except (OSError, ValueError, KeyError, TypeError):
      continue
  return "nothing of the index (it was interrupted before the first save)"


def _save_state(index, state: str, belongs: dict, spent: dict) -> None:
  """`index` as the resumable state `state`: its data file `<state>.<ntotal>` written whole first, then the
  sidecar that points at it (atomically), then the previous data file removed. Whenever this stops (a second
  Ctrl-C, a full disk), the sidecar on disk names an intact file: the new one or the previous one."""
  target = f"{state}.{int(index.ntotal)}"
  previous = _state_file(state)
  _write_index(index, target)
  data.atomic_write_json(_sidecar(state), {"belongs_to": belongs, "ntotal": int(index.ntotal),
                                            "file": os.path.basename(target), "file_digest": file_digest(target),
                                            **spent})
  if previous and previous != target and os.path.exists(previous):
    os.remove(previous)


def _write_index(index, path: str) -> None:
  """faiss.write_index, whole or absent: written beside `path`, then renamed; the temporary never stays.

  faiss reports a failed write (a full disk, a quota, a file size limit) as a RuntimeError whose text ends in
  strerror(errno); it is raised here as the OSError it is, so callers handle it as any other failed write."""
  tmp = f"{path}.tmp.{os.getpid()}"
  try:
    try:
      faiss.write_index(index, tmp)
    except RuntimeError as e:
      code = next((c for c in NO_SPACE_ERRNOS if os.strerror(c) in str(e)), errno.EIO)
      raise OSError(code, os.strerror(code), path) from None
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _state_file(state: str) -> str | None:
  """The data file the sidecar of `state` points at, or None."""
  try:
    with open(_sidecar(state)) as f:
      return os.path.join(os.path.dirname(state) or ".", os.path.basename(json.load(f)["file"]))
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _remove_state(state: str) -> None:
  """The sidecar of `state` and every data file of it (`<state>.<ntotal>`, temporaries)."""
  for f in [_sidecar(state)] + sorted(glob.glob(glob.escape(state) + ".*")):
    if os.path.exists(f):
      os.remove(f)


def _first_state(path: str, suffixes, belongs: dict, say, spent: dict):
  """The first usable state among `path + suffix` (the furthest first), or None; `spent` takes its timings."""
  for suffix in suffixes:
    index = _resume_state(path + suffix, belongs, say, spent)
    if index is not None:
      return index
  return None


def _resume_state(state: str, belongs: dict, say, spent: dict):
  """The index saved as `state` if its sidecar says it belongs to this build (`belongs`: datastore and
  parameters) and its file is intact, else None (a state of another build or a damaged one is said and
  ignored; the next save replaces it)."""
  if not os.path.exists(_sidecar(state)):
    return None
  try:
    with open(_sidecar(state)) as f:
      meta = json.load(f)
    if not isinstance(meta.get("belongs_to"), dict) or _differing(meta["belongs_to"], belongs):
      say(f"ignoring {state}: left by a build of other keys or parameters; this build replaces it")
      return None
    file = _state_file(state)
    if file is None or not os.path.exists(file):
      raise ValueError(f"its file {meta.get('file')!r} is missing")
    if file_digest(file) != meta.get("file_digest"):
      raise ValueError("its digest differs from its sidecar's")
    index = faiss.read_index(file)
    if int(index.ntotal) != int(meta["ntotal"]) or index.d != belongs["dimension"]:
      raise ValueError(f"it holds {index.ntotal} keys of dimension {index.d}, its sidecar says {meta['ntotal']}")
  except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
    say(f"ignoring {state}: unreadable or damaged ({first_line(e)}); this build replaces it")
    return None
  say(f"resuming from {state}: " + (f"{index.ntotal:,} of {belongs['count']:,} keys already added"
                                    if index.ntotal else "trained quantizers, no keys yet"))
  spent.update({k: float(meta.get(k, 0.0)) for k in spent})
  return index


def check_trained_index(path: str, d: int, metric: str = "inner_product") -> None:
  """ConfigError unless `path` is a trained, empty IndexIVFPQ of dimension `d` and `metric` (build_index's
  `trained_index`): checked before a datastore build, not after its key pass."""
  _read_trained_ivfpq(path, d, metric)


def _read_trained_ivfpq(path: str, d: int, metric: str = "inner_product"):
  """The trained, empty IndexIVFPQ of `metric` in `path`, or one ConfigError saying what it is instead."""
  if not os.path.isfile(path):
    raise ConfigError(f"trained index {path} is not a file")
  try:
    index = faiss.read_index(path)  # already the concrete class (downcast_index would drop the owning proxy)
  except RuntimeError as e:
    raise ConfigError(f"trained index {path} cannot be read by faiss ({first_line(e)})") from None
  problems = []
  if not isinstance(index, faiss.IndexIVFPQ):
    problems.append(f"it is an {type(index).__name__}, not an IndexIVFPQ")
  else:
    if index.d != d:
      problems.append(f"its dimension is {index.d}, the datastore's {d}")
    if index.metric_type != _faiss_metric(metric):
      problems.append(f"its metric is not {_metric_words(metric)}")
    if not index.is_trained:
      problems.append("it is not trained")
    if index.ntotal:
      problems.append(f"it already holds {index.ntotal:,} keys")
  if problems:
    raise ConfigError(f"trained index {path} cannot be used: " + "; ".join(problems))
  return index


class KnnIndex:
  """A loaded index: `search(queries, k)`; `nprobe` (IVF lists visited per query) is settable."""

  def __init__(self, index, info: dict, path: str, nprobe: int = 32):
    self.index = index
    self.info = info
    self.path = path
    self.nprobe = int(nprobe)
    self.on_gpu = False
    self._gpu_resources = None  # must outlive the GPU index

  @property
  def dimension(self) -> int:
    return int(self.info["dimension"])

  @property
  def count(self) -> int:
    return int(self.info["count"])

  @property
  def kind(self) -> str:
    return self.info["index_type"]

  @property
  def metric(self) -> str:
    """"inner_product" | "l2" (sidecars written before the field existed: inner product, the only metric then)."""
    return self.info.get("metric", "inner_product")

  @classmethod
  def load(cls, path: str, datastore: Datastore | None = None, *, nprobe: int = 32, gpu: bool = False,
           device: int = 0, metric: str = "inner_product") -> "KnnIndex":
    """Read an index; with `datastore`, refuse one built over other keys; refuse one of another metric than
    `metric` (its sidecar's). gpu=True moves it to `device`."""
    _check_metric(metric)
    if not os.path.exists(path):
      folder = os.path.dirname(os.path.abspath(path))
      base = os.path.basename(path)
      stopped = os.path.isdir(folder) and any(n.startswith(base + TRAINED) or n.startswith(base + PARTIAL)
                                              for n in os.listdir(folder))
      # finished indexes there (a sidecar beside the file): a mistyped eval.index is not a datastore without one
      # (unless this index's own build was stopped: said below)
      there = [] if stopped else _indexes_in(folder)
      if there:
        raise CheckpointError(f"FAISS index not found: {path}; the index{'es' if len(there) > 1 else ''} in "
                              f"{folder}: {', '.join(there)} (eval.index names the file; \"\" takes "
                              "<datastore>/index.faiss)")
      if os.path.isfile(os.path.join(folder, "meta.json")) and os.path.isfile(os.path.join(folder, "keys.npy")):
        why = ("its index build was stopped before the end (the trained or partial files it resumes from are there)"
               if stopped else "built with --index=none?")
        raise CheckpointError(f"FAISS index not found: {path}; the datastore in {folder} has no index ({why}): "
                              "rerun its build_datastore command (the same flags, --subset_of and --entries "
                              "included) with --index=auto, flat or ivfpq: its keys are reused")
      raise CheckpointError(f"FAISS index not found: {path} (build one with `python -m trime_jax.launch.build_datastore`)")
    if os.path.isdir(path):
      inside = os.path.join(path, "index.faiss")
      raise CheckpointError(f"FAISS index {path} is a folder: give the index file"
                            + (f" ({inside})" if os.path.isfile(inside) else ""))
    if not os.path.exists(_sidecar(path)):
      raise CheckpointError(f"FAISS index {path} is incomplete: its sidecar {_sidecar(path)} is missing; rebuild it")
    info = data.read_json(_sidecar(path), "FAISS index sidecar", DamagedCheckpointError, fix="rebuild the index")
    if info.get("format") != FORMAT:
      raise CheckpointError(f"{_sidecar(path)}: unknown index format {info.get('format')!r}")
    if "file_digest" in info and file_digest(path) != info["file_digest"]:
      raise DamagedCheckpointError(f"FAISS index {path} is damaged: its digest {file_digest(path)} != "
                                   f"{info['file_digest']} recorded in {_sidecar(path)}; rebuild it")
    try:
      index = faiss.read_index(path)
    except RuntimeError as e:
      raise DamagedCheckpointError(f"FAISS index {path} cannot be read ({first_line(e)}); "
                                   "rebuild it") from None
    if index.d != info["dimension"] or index.ntotal != info["count"]:
      raise CheckpointError(f"FAISS index {path} holds {index.ntotal} × {index.d} keys, its sidecar says "
                            f"{info['count']} × {info['dimension']}; rebuild it")
    out = cls(index, info, path, nprobe)
    if out.metric != metric or index.metric_type != _faiss_metric(metric):
      raise CheckpointError(f"FAISS index {path} is an index of metric {out.metric!r} (its sidecar), not the "
                            f"{metric!r} index expected here"
                            + (" (eval.knnlm_metric=l2 reads <datastore>/index_l2.faiss: build it with "
                               "`python -m trime_jax.launch.build_datastore ... --index_metric=l2`)"
                               if metric == "l2" else ""))
    if datastore is not None:
      out.check_datastore(datastore)
    if gpu:
      out.to_gpu(device)
    return out

  def check_datastore(self, ds: Datastore) -> None:
    problems = []
    if self.info["datastore_fingerprint"] != ds.fingerprint:
      problems.append(f"datastore fingerprint {self.info['datastore_fingerprint']} (index) != {ds.fingerprint}")
    if self.dimension != ds.dimension:
      problems.append(f"dimension {self.dimension} (index) != {ds.dimension}")
    if self.count != ds.count:
      problems.append(f"count {self.count} (index) != {ds.count}")
    if problems:
      raise CheckpointError(f"FAISS index {self.path} was not built over datastore {ds.directory}: "
                            + "; ".join(problems))

  def to_gpu(self, device: int = 0) -> "KnnIndex":
    """Move the index to GPU `device` (float16 PQ lookup tables, as kNN-LM); a clear error without a GPU."""
    if not gpu_available():
      reason = ("this faiss build has no GPU support (faiss-cpu); install a GPU build of faiss"
                if not hasattr(faiss, "StandardGpuResources") else "faiss sees no GPU")
      raise ConfigError(f"cannot move the FAISS index to a GPU: {reason}. Search it on the CPU instead.")
    self._gpu_resources = faiss.StandardGpuResources()
    options = faiss.GpuClonerOptions()
    # IVF-PQ with 64 sub-quantizers needs float16 lookup tables on a GPU; on a flat index the same option stores
    # the keys (and casts the queries) in float16, so the exact index would no longer be exact: float32 there
    options.useFloat16 = self.kind == "ivfpq"
    self.index = faiss.index_cpu_to_gpu(self._gpu_resources, device, self.index, options)
    self.on_gpu = True
    return self

  def search(self, queries_NxD, k: int, *, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores [n, k] float32, ids [n, k] int64) of the k largest inner products (an L2 index: the k smallest
    squared distances, as scores -|q - k|²), best first."""
    q = _f32(queries_NxD)
    if q.ndim != 2 or q.shape[1] != self.dimension:
      raise CheckpointError(f"queries of shape {tuple(q.shape)} do not match the index dimension {self.dimension}"
                            " (was the index built from another model's keys?)")
    if k < 1:
      raise ConfigError(f"k must be >= 1, got {k}")
    params = None
    if self.kind == "ivfpq":
      params = faiss.SearchParametersIVF(nprobe=int(nprobe or self.nprobe))
    scores, ids = self.index.search(q, int(k), params=params)
    if self.metric == "l2":  # faiss's squared distances (ascending; +FLT_MAX where none) as scores: larger better
      scores = np.where(ids >= 0, -scores, -np.inf).astype(np.float32)
    return scores, ids.astype(np.int64, copy=False)


def rescore(ds: Datastore, queries_NxD, ids_NxK, *, sort: bool = True, with_keys: bool = False,
            metric: str = "inner_product"):
  """Exact scores [n, k] float32 of each query with its retrieved keys (float16 keys read back as float32; -inf
  where ids is -1): inner products q·k (metric "inner_product") or -|q - k|² (metric "l2": the original's
  kNN-LM recomputes its L2 distances so, knnlm.py `dist_func`), re-sorted best first (stable: ties keep the
  index's order) unless sort=False.
  Returns (scores, ids), and with_keys=True (scores, ids, keys): the float32 keys [n, k, D] in that order (zeros
  where ids is -1), from the one gather the scores were computed from."""
  _check_metric(metric)
  q = _f32(queries_NxD)
  ids = np.asarray(ids_NxK, np.int64)
  if q.ndim != 2 or q.shape[1] != ds.dimension or ids.ndim != 2 or ids.shape[0] != q.shape[0]:
    raise CheckpointError(f"queries {tuple(q.shape)} / ids {tuple(ids.shape)} do not match the datastore "
                          f"dimension {ds.dimension}")
  scores = np.empty(ids.shape, np.float32)
  keys = np.empty(ids.shape + (ds.dimension,), np.float32) if with_keys else None
  rows = max(1, RESCORE_FLOATS // max(ids.shape[1] * ds.dimension, 1))  # bounds the gathered [rows, k, D]
  for a in range(0, len(q), rows):
    gathered = ds.gather_keys(ids[a:a + rows])
    if metric == "l2":
      scores[a:a + rows] = -np.sum(np.square(q[a:a + rows][:, None, :] - gathered), axis=-1)
    else:
      scores[a:a + rows] = np.einsum("nd,nkd->nk", q[a:a + rows], gathered)
    if with_keys:
      keys[a:a + rows] = gathered
  scores[ids < 0] = -np.inf
  if sort:
    order = np.argsort(-scores, axis=1, kind="stable")
    scores, ids = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
    keys = None if keys is None else np.take_along_axis(keys, order[..., None], 1)
  return (scores, ids, keys) if with_keys else (scores, ids)
