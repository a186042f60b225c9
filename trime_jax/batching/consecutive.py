"""Consecutive batching for TrimeLM_long (paper §4.2): runs of m consecutive segments of the training stream.

The training split is read as one stream cut into segments of L targets (`data.segmentation="stream"`,
fairseq `--sample-break-mode none`: a segment may cross a document boundary; only the stream's last segment
is short). The segments, in stream order, are cut into *runs* of m consecutive segments; only the stream's
last run may be short, and only its missing rows are padding (-1). A micro-batch of B = b·m rows holds b runs,
rows `[r·m, (r+1)·m)` being run r in stream order — the layout `trime_nll(memory="long",
consecutive_segments=m)` expects (a token sees every earlier token of its run). Nothing else is padded, so
the real-token fraction is ~1; it is recorded in the header.

Two layouts (`trime.consecutive_layout`):

  stream  the original's iterator (fairseq `--keep-order`: batches never shuffled; SequentialShardedIterator
          with one shard per GPU). The list of R runs is split into b contiguous pieces of P = ⌈R/b⌉ runs, one
          per stream; micro-batch i holds run k·P + i of every stream k (a -1 run where piece k has ended).
          Micro-batches are read in stored order every epoch (header `shuffle: false`), so consecutive
          micro-batches, within an update (grad_accum, the original's update-freq) and across updates,
          continue every stream. Memory crosses document boundaries, as in the original.
  packed  the same runs, b adjacent runs per micro-batch in stream order (the last micro-batch filled with -1
          runs); the plan reader visits the micro-batches in a seeded permutation every epoch (header
          `shuffle: true`). A run may hold several documents; training restricts a token's memory to earlier
          tokens of its own document (per-token document ids, see train.py), not the batch plan.

The plan holds one epoch; every segment appears exactly once in it.
"""

from __future__ import annotations

import numpy as np

from trime_jax import data
from trime_jax.errors import ConfigError

KIND = "consecutive"
LAYOUTS = ("stream", "packed")


def stream_runs(num_segments: int, m: int) -> np.ndarray:
  """[R, m] segment indices: the stream's segments in order, m per run; the last run's missing rows are -1."""
  n_runs = -(-num_segments // m)
  out = np.full(n_runs * m, -1, np.int64)
  out[:num_segments] = np.arange(num_segments)
  return out.reshape(n_runs, m)


def stream_batches(runs_Rxm: np.ndarray, streams: int, gpus: int = 1, accum: int = 1) -> np.ndarray:
  """Micro-batches [N, b·m] of the original's in-order sharded iterator (SequentialShardedIterator: each GPU
  reads a contiguous shard of the runs, in order).

  gpus = 1: b = `streams` shards, P = ⌈R/b⌉ runs each; micro-batch i holds run k·P + i of shard k (an all -1
  run once shard k is used up); N = P.
  gpus = G > 1 (the original's GPUs an update's `accum` = A micro-batches stand for, F = A / G per GPU, its
  --update-freq): b·G shards of P = ⌈R/(b·G)⌉ runs; micro-batch u·A + g·F + f (update u, GPU g, its f-th
  forward) holds position u·F + f of shards g·b … g·b + b − 1; N = ⌈P/F⌉·A, so an epoch is whole updates."""
  r, m = runs_Rxm.shape
  shards = streams * gpus
  p = -(-r // shards)
  padded = np.full((shards * p, m), -1, np.int64)
  padded[:r] = runs_Rxm
  if gpus == 1:  # padded[k·P + i] -> batch i, slot k
    return padded.reshape(streams, p, m).transpose(1, 0, 2).reshape(p, streams * m)
  f = accum // gpus
  updates = -(-p // f)
  by_position = np.full((shards, updates * f, m), -1, np.int64)
  by_position[:, :p] = padded.reshape(shards, p, m)
  # [g, k, u, f, m] -> [u, g, f, k, m]: update-major, then GPU, then its forward, the GPU's b shards in a row
  x = by_position.reshape(gpus, streams, updates, f, m).transpose(2, 0, 3, 1, 4)
  return x.reshape(updates * gpus * f, streams * m)


def packed_batches(runs_Rxm: np.ndarray, runs_per_batch: int) -> np.ndarray:
  """[⌈R/b⌉, b·m] micro-batches of b adjacent runs in stream order; -1 runs fill the last one."""
  r, m = runs_Rxm.shape
  n = -(-r // runs_per_batch)
  padded = np.full((n * runs_per_batch, m), -1, np.int64)
  padded[:r] = runs_Rxm
  return padded.reshape(n, runs_per_batch * m)


def real_token_fraction(segments: data.Segments, batches_NxB: np.ndarray) -> float:
  """Real target tokens / (rows · L) over all rows of the plan (-1 rows and short segments count as padding)."""
  rows = batches_NxB.reshape(-1)
  real = int(segments.length[rows[rows >= 0]].sum())
  return real / (rows.size * segments.seg_len)


def check_gpus(gpus: int, accum: int, layout: str) -> None:
  """trime.consecutive_gpus: G >= 1 GPUs sharing an update's `accum` micro-batches, F = accum / G each, in the
  stream layout only (the original's --keep-order)."""
  if gpus < 1 or accum % gpus:
    raise ConfigError(f"trime.consecutive_gpus={gpus} must be >= 1 and divide train.grad_accum={accum} (the GPUs "
                      "an update's micro-batches stand for)")
  if gpus > 1 and layout != "stream":
    raise ConfigError(f"trime.consecutive_gpus={gpus} shards the stream as the original's GPUs read it: it needs "
                      f"trime.consecutive_layout='stream', got {layout!r}")


def make_plan(corpus: data.Corpus, config, *, progress: bool = True):
  """(header, batches [num_batches, B]) for `launch/make_batches.py --kind=consecutive` (one epoch).

  `progress` is accepted for the planners' common interface; this plan takes no noticeable time.
  """
  del progress
  t, r, d = config.trime, config.train, config.data
  m, b_rows = int(t.consecutive_segments), int(r.batch_size)
  layout = t.get("consecutive_layout", "stream")
  if d.segmentation != "stream":
    raise ConfigError(f"consecutive batching reads runs of the concatenated stream: it needs "
                      f"data.segmentation='stream', got {d.segmentation!r}")
  if layout not in LAYOUTS:
    raise ConfigError(f"trime.consecutive_layout must be one of {LAYOUTS}, got {layout!r}")
  if m < 1 or b_rows < 1 or b_rows % m:
    raise ConfigError(f"train.batch_size={b_rows} must be a positive multiple of trime.consecutive_segments={m}")
  segments = data.make_segments(corpus, d.segment_len, "stream")
  runs = stream_runs(len(segments), m)
  b = b_rows // m
  gpus, accum = int(t.get("consecutive_gpus", 1)), int(r.grad_accum)
  check_gpus(gpus, accum, layout)
  if layout == "stream" and gpus == 1:
    batches = stream_batches(runs, b)
    description = (f"stream: the {len(runs)} runs of {m} consecutive stream segments split into {b} contiguous "
                   f"streams; micro-batch i holds run k*{batches.shape[0]}+i of stream k; read in order")
  elif layout == "stream":
    batches = stream_batches(runs, b, gpus, accum)
    p, f = -(-len(runs) // (b * gpus)), accum // gpus
    description = (f"stream: the {len(runs)} runs of {m} consecutive stream segments split into {b * gpus} "
                   f"contiguous shards of {p} runs, {b} per micro-batch, for {gpus} GPUs × {f} forwards an update "
                   f"(grad_accum {accum}): micro-batch u*{accum}+g*{f}+i holds run s*{p}+u*{f}+i of shards "
                   f"s = g*{b}..g*{b}+{b - 1}; read in order")
  else:
    batches = packed_batches(runs, b)
    description = (f"packed: {b} adjacent runs of {m} consecutive stream segments per micro-batch; batch order "
                   f"shuffled every epoch; memory restricted to a token's own document in training")
  header = {
      "kind": KIND,
      "corpus_fingerprint": corpus.fingerprint(),
      "corpus_name": corpus.name,  # e.g. "wikitext_mini:train": what the fingerprint is of
      "segment_len": int(d.segment_len),
      "segmentation": "stream",
      "consecutive_segments": m,
      "layout": layout,
      "seed": int(r.seed),
      "shuffle": layout == "packed",
      "num_segments": len(segments),
      "num_runs": len(runs),
      "streams": b,
      **({"gpus": gpus, "grad_accum": accum} if layout == "stream" and gpus > 1 else {}),
      "batches_per_epoch": int(batches.shape[0]),
      "real_token_fraction": real_token_fraction(segments, batches),
      "description": description,
  }
  return header, batches
