"""Batch-plan files: the offline batchers (consecutive, BM25) write them; training only reads them.

A plan is a directory:
  plan.json     header: format, kind, corpus fingerprint, segment_len, segmentation, batch_size (rows B),
                consecutive_segments (m), seed, num_batches, num_segments, shuffle, batches_sha256 (of
                batches.npy's array, checked on load), plus planner-specific fields (e.g. layout), and
                header_sha256 (of the other fields, checked on load: an edited header is refused; since
                2026-12-06, a plan without it is read unchecked)
  batches.npy   int64 [num_batches, B]: segment indices per batch row (-1 = an all-padding row)

An epoch visits every batch once; it is whole updates, as fairseq's GroupedIterator makes them: with A
micro-batches an update (train.grad_accum), epoch e is updates e·U … e·U + U − 1, U = ⌈num_batches / A⌉, and
micro-batch a of its update u is the epoch's batch j = u·A + a, or all padding rows where j ≥ num_batches (the
original's last update of an epoch holds fewer batches). The planner fixes each batch's composition; the order
in which an epoch visits them is:
  shuffle true (or absent)  a seeded permutation every epoch, the first included:
                            `np.random.default_rng([seed, e, 11]).permutation(num_batches)[j]`, like the
                            original's iterator, which shuffles predefined batches with seed + epoch every
                            epoch (so consecutive updates never simply continue one BM25 chain);
  shuffle false             stored order every epoch (the original's --keep-order; the consecutive 'stream'
                            layout, whose batches continue the token stream).
Files are written to a temporary directory and renamed, so a plan is complete or absent; one writer at a time
(`<directory>.lock` beside it, as for datastores and exports).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

from trime_jax import data
from trime_jax.errors import ConfigError, DataError, DiskFullError, is_no_space
from trime_jax.runtime.lock import DirLock, beside as lock_beside

FORMAT = "trime-batch-plan/1"
# What a damaged plan's error says to do (a plain rerun of make_batches reads the damaged plan and stops there).
REWRITE = "write it again: rerun its trime_jax.launch.make_batches command with --overwrite"


class BatchPlan:
  def __init__(self, header: dict, batches: np.ndarray, directory: str = ""):
    self.header = header
    self.batches = batches
    self.directory = directory
    self._order = None  # (epoch, permutation) of the last epoch read: one permutation per epoch, not per row

  @property
  def num_batches(self) -> int:
    return int(self.batches.shape[0])

  @property
  def batch_size(self) -> int:
    return int(self.batches.shape[1])

  def epoch_order(self, epoch: int) -> np.ndarray:
    """Batch indices [num_batches] in the order epoch `epoch` visits them (see the module docstring)."""
    epoch = int(epoch)
    if not self.header.get("shuffle", True):
      return np.arange(self.num_batches)
    cached = self._order
    if cached is None or cached[0] != epoch:
      perm = np.random.default_rng([int(self.header.get("seed", 0)), epoch, 11]).permutation(self.num_batches)
      self._order = cached = (epoch, perm)
    return cached[1]

  def rows(self, micro_index: int) -> np.ndarray:
    """Segment indices [B] of the `micro_index`-th batch visited, counting on over epochs (batch j of epoch
    e = micro_index // num_batches; deterministic from the header's seed)."""
    epoch, j = divmod(int(micro_index), self.num_batches)
    return np.asarray(self.batches[int(self.epoch_order(epoch)[j])])

  def update_rows(self, step: int, accum: int) -> np.ndarray:
    """Segment indices [accum, B] of training update `step` with `accum` micro-batches an update: epochs are
    whole updates, the last one's missing micro-batches all padding (-1) (see the module docstring). Before
    2026-12-06 training read micro-batch step·accum + a of the `rows` sequence, so an update could hold the end
    of one epoch and the start of the next, and later epochs started mid-update; the same where accum divides
    num_batches."""
    per_epoch = -(-self.num_batches // accum)
    epoch, u = divmod(int(step), per_epoch)
    order = self.epoch_order(epoch)
    out = np.full((accum, self.batch_size), -1, np.int64)
    for a, j in enumerate(range(u * accum, min((u + 1) * accum, self.num_batches))):
      out[a] = self.batches[int(order[j])]
    return out

  def digest(self) -> str:
    """SHA-256 (16 hex digits) of the header and every batch: what a resumed training compares."""
    return _sha256(self.batches, json.dumps(self.header, sort_keys=True).encode())[:16]

  def check(self, *, corpus_fingerprint: str, segment_len: int, segmentation: str, batch_size: int,
            consecutive_segments: int | None = None, kind: str | None = None, layout: str | None = None,
            k: int | None = None, exclude_same_document: bool | None = None, bm25_k1: float | None = None,
            bm25_b: float | None = None, bm25_analyzer: str | None = None) -> None:
    """Clear errors when the plan was made for other data or another batch layout (or, for BM25 plans, other
    neighbours: `k`, `exclude_same_document`, and BM25's `bm25_k1` / `bm25_b` / `bm25_analyzer` where the plan
    records them); a
    field passed as None is not compared."""
    h = self.header
    problems = []
    if h.get("corpus_fingerprint") != corpus_fingerprint:
      made = f" (made from {h['corpus_name']})" if h.get("corpus_name") else ""
      problems.append(f"it was made for another corpus{made}: corpus fingerprint {h.get('corpus_fingerprint')} "
                      f"(plan) != {corpus_fingerprint} (this run's training split; write its plan with "
                      "trime_jax.launch.make_batches)")
    for name, want in [("segment_len", segment_len), ("segmentation", segmentation), ("batch_size", batch_size),
                       ("consecutive_segments", consecutive_segments), ("kind", kind), ("layout", layout),
                       ("k", k), ("exclude_same_document", exclude_same_document),
                       ("bm25_k1", bm25_k1), ("bm25_b", bm25_b), ("bm25_analyzer", bm25_analyzer)]:
      if name in ("bm25_k1", "bm25_b", "bm25_analyzer") and name not in h:  # made before 2026-12-07/08: warned below
        continue
      if want is not None and h.get(name) != want:
        problems.append(f"{name} {h.get(name)!r} != {want!r}")
    if problems:
      where = f" {self.directory}" if self.directory else ""
      raise DataError(f"batch plan{where} does not match this run: " + "; ".join(problems))
    if kind == "bm25" and h.get("kind") == "bm25":
      from trime_jax.batching import bm25  # bm25s only where a BM25 plan is read

      if old := bm25.older_rules(h):  # told, not refused, so a run that trained on it resumes on its batches
        from absl import logging

        logging.warning("batch plan %s was made by an older rule: %s. A new run should use a plan made again "
                        "(make_batches --overwrite); a run that trained on this one goes on with it",
                        self.directory or "(in memory)", "; ".join(old))


def _sha256(batches: np.ndarray, prefix: bytes = b"") -> str:
  h = hashlib.sha256(prefix)
  for a in range(0, len(batches), 1 << 16):  # a memmap in pieces: no copy of a whole plan
    h.update(np.ascontiguousarray(batches[a:a + (1 << 16)], np.int64).tobytes())
  return h.hexdigest()


def _full_header(header: dict, batches: np.ndarray) -> dict:
  """The header as plan.json holds it, its checksum aside: the planner's fields, the format and the shape."""
  full = {"format": FORMAT, **header, "num_batches": int(batches.shape[0]), "batch_size": int(batches.shape[1])}
  return json.loads(json.dumps(full))  # lists, not tuples


# Header fields that say how long the planning took, not what the plan is: two runs of the same command differ
# there and nowhere else.
VOLATILE_FIELDS = ("timing",)
# Checksums of the batches and of the header: written with a plan, compared on load, not plan content.
CHECKSUM_FIELDS = ("batches_sha256", "header_sha256")


def differences(plan: BatchPlan, header: dict, batches: np.ndarray) -> list[str]:
  """What tells a newly computed plan (`header`, `batches`, as a planner returns them) from `plan` on disk:
  header fields as "name old != new", then "the batches" when the segment indices differ; [] for the same plan
  (VOLATILE_FIELDS aside). A rerun of make_batches keeps an identical plan as it is, since a training that reads
  it records its digest and would not resume on a rewritten one."""
  batches = np.asarray(batches, np.int64)
  new, old = _full_header(header, batches), plan.header
  # the checksum is not compared: the batches themselves are, below (a plan of earlier versions has none)
  out = [f"{k} {old.get(k)!r} != {new.get(k)!r}" for k in sorted(set(old) | set(new))
         if k not in VOLATILE_FIELDS and k not in CHECKSUM_FIELDS and old.get(k) != new.get(k)]
  if plan.batches.shape != batches.shape or not np.array_equal(plan.batches, batches):
    out.append("the batches")
  return out


def save(directory: str, header: dict, batches: np.ndarray) -> str:
  """Write the plan to `directory`, replacing what is there (the caller decides whether it may: make_batches'
  --overwrite). Refused (runtime.lock.LockedError) while another process writes the same directory."""
  batches = np.asarray(batches, np.int64)
  if batches.ndim != 2 or batches.shape[0] == 0:
    raise DataError(f"a batch plan needs a non-empty [num_batches, B] array, got shape {batches.shape}")
  if not str(directory).strip():  # "" would be the working directory, which the replacement would delete
    raise ConfigError("a batch plan needs a directory to write, got an empty path")
  directory = os.path.abspath(directory).rstrip(os.sep)
  with lock(directory):
    data.recover_replaced(directory)
    full = {**_full_header(header, batches), "batches_sha256": _sha256(batches)}
    return _save_locked(directory, {**full, "header_sha256": _header_sha256(full)}, batches)


def _header_sha256(header: dict) -> str:
  """SHA-256 of plan.json's fields but itself: an edited header (e.g. "shuffle" flipped) is refused on load."""
  rest = {k: v for k, v in header.items() if k != "header_sha256"}
  return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def lock(directory: str) -> DirLock:
  """`with lock(directory):` one writer of the plan `directory` (`<directory>.lock`); make_batches holds it from
  its look at what --out holds to the write, so two runs onto one --out cannot both decide to write."""
  directory = os.path.abspath(directory).rstrip(os.sep)
  return lock_beside(directory, f"batch plan {directory}")


def _save_locked(directory: str, header: dict, batches: np.ndarray) -> str:
  tmp = directory + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)  # left by a writer that died: the lock says none is running
  try:
    os.makedirs(tmp)
    np.save(os.path.join(tmp, "batches.npy"), batches)
    with open(os.path.join(tmp, "plan.json"), "w") as f:
      json.dump(header, f, indent=1)
  except OSError as e:
    # NumPy's short write (a full disk, a file size limit) is an OSError without errno: "N requested and M written".
    if e.errno is not None and not is_no_space(e):
      raise
    shutil.rmtree(tmp, ignore_errors=True)
    what = os.strerror(e.errno) if e.errno else str(e)
    size = f"{batches.nbytes / 2**20:,.1f} MiB" if batches.nbytes >= 2**20 else f"{batches.nbytes / 2**10:,.1f} KiB"
    raise DiskFullError(f"no space left writing the batch plan {directory} ({what}); nothing was written: free "
                        f"space (the plan needs {size}) and rerun the same command") from None
  if os.path.lexists(directory) and not os.path.isdir(directory):  # a file (the caller's --overwrite allowed it)
    os.remove(directory)
  data.replace_directory(tmp, directory)  # a kill between its renames leaves the previous plan to be put back
  return directory


def load(directory: str) -> BatchPlan:
  """Read a plan; a relative path is tried from the working directory, then the repo root (like data.path)."""
  from trime_jax.corpora import resolve_path

  given, directory = directory, resolve_path(directory)
  head = os.path.join(directory, "plan.json")
  arr = os.path.join(directory, "batches.npy")
  if directory and not os.path.lexists(directory) and os.path.isdir(directory + ".old"):
    raise DataError(f"batch plan {directory} was being replaced when its writer stopped: the previous plan is at "
                    f"{directory}.old; rename it back, or rerun make_batches (which puts it back first)")
  if not directory or not os.path.isdir(directory):
    raise DataError(f"batch plan not found: {given!r} (looked in {os.path.abspath(given or '.')} and the repo root;"
                    " write one with `python -m trime_jax.launch.make_batches` or set --config.trime.batch_plan)")
  if not (os.path.exists(head) and os.path.exists(arr)):
    raise DataError(f"incomplete batch plan in {directory}: needs plan.json and batches.npy")
  header = data.read_json(head, "batch plan header", DataError, fix=REWRITE)
  if header.get("format") != FORMAT:
    raise DataError(f"{head}: unknown batch-plan format {header.get('format')!r}")
  # Plans written before 2026-12-06 have no header checksum (their batches' is checked below where they have one)
  if "header_sha256" in header and _header_sha256(header) != header["header_sha256"]:
    raise DataError(f"batch plan header {head} does not match its checksum (the file was edited after it was "
                    f"written: a field such as shuffle or seed changed would train on other batches); {REWRITE}")
  try:
    batches = np.load(arr, mmap_mode="r")
  except (ValueError, OSError, EOFError) as e:
    raise DataError(f"batch plan {arr} is corrupt or truncated ({e}); {REWRITE}") from None
  want = (header.get("num_batches"), header.get("batch_size"))
  if batches.ndim != 2 or tuple(batches.shape) != want or batches.dtype != np.int64:
    raise DataError(f"batch plan {arr} holds {batches.dtype} of shape {tuple(batches.shape)}, plan.json says "
                    f"int64 of {want}; {REWRITE}")
  # Plans written by earlier versions have no checksum: their shape and index range are still checked.
  if "batches_sha256" in header and _sha256(batches) != header["batches_sha256"]:
    raise DataError(f"batch plan {arr} does not match its checksum in plan.json (the file was changed or damaged "
                    f"after it was written); {REWRITE}")
  n = header.get("num_segments")
  if n is not None and batches.size and not (-1 <= int(batches.min()) and int(batches.max()) < int(n)):
    raise DataError(f"batch plan {arr} holds segment indices in [{int(batches.min())}, {int(batches.max())}], "
                    f"outside [-1, {int(n)}) (plan.json's num_segments); {REWRITE}")
  return BatchPlan(header, batches, directory)
