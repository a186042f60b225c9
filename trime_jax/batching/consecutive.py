"""Consecutive batching for TrimeLM_long (paper §4.2): b documents × m consecutive segments per batch.

Each document (segmentation="document": a segment never crosses a document boundary) is cut into *runs*
of m consecutive segments, in document order. A batch of B = b·m rows is b runs, each run's rows adjacent
and in document order — the layout `trime_nll(memory="long", consecutive_segments=m)` expects (rows
`[r·m, (r+1)·m)` are one group; a token sees every earlier token of its run).

Tails and short documents are padded, never packed: a document of n segments gives ⌈n/m⌉ runs and its last
run is filled up with all-padding rows (-1); the last batch of an epoch is filled up with all-padding runs.
Padding rows have target -1 everywhere, so they are neither memory nor loss. Packing another document into
a run's free rows would need per-row group ids in the loss; padding keeps the loss's "one run = one
document" rule. No token is dropped: every segment appears exactly once per epoch.

Epoch e visits the runs in the order `permutation(seed, e)`, so documents are regrouped into different
batches each epoch. The plan holds as many epochs as the training run needs (capped at `MAX_EPOCHS`; after
that, `BatchPlan.rows` re-permutes the batch order on every further pass).
"""

from __future__ import annotations

import math

import numpy as np
from tqdm import tqdm

from trime_jax import data as D
from trime_jax.errors import ConfigError

KIND = "consecutive"
MAX_EPOCHS = 16  # regroupings written to the plan; bounds its size for long runs on large corpora


def document_runs(segments: D.Segments, m: int) -> np.ndarray:
  """[R, m] segment indices: every document's segments in order, m per run, the last run -1 padded."""
  docs = segments.doc
  if len(docs) and np.any(np.diff(docs) < 0):
    raise ConfigError("segments must be in corpus order (data.make_segments)")
  n_seg = np.bincount(docs, minlength=int(docs.max()) + 1 if len(docs) else 0)
  n_seg = n_seg[n_seg > 0]
  n_runs = -(-n_seg // m)
  # Row k of a document's runs holds its segment k; padded slots (k >= n_seg) stay -1.
  out = np.full((int(n_runs.sum()) * m,), -1, np.int64)
  run_start = np.repeat(np.cumsum(n_runs) - n_runs, n_seg)  # first run of each segment's document
  out[run_start * m + segments.index_in_doc] = np.arange(len(docs))
  return out.reshape(-1, m)


def epoch_batches(runs_Rxm: np.ndarray, docs_per_batch: int, seed: int, epoch: int) -> np.ndarray:
  """[num_batches, b·m] rows of one epoch: runs in a seeded order, b per batch, -1 runs fill the last."""
  r, m = runs_Rxm.shape
  order = np.random.default_rng([seed, epoch, 23]).permutation(r)
  n_batches = -(-r // docs_per_batch)
  padded = np.full((n_batches * docs_per_batch, m), -1, np.int64)
  padded[:r] = runs_Rxm[order]
  return padded.reshape(n_batches, docs_per_batch * m)


def make_plan(corpus: D.Corpus, config, *, progress: bool = True, epochs: int | None = None):
  """(header, batches [num_batches, B]) for `launch/make_batches.py --kind=consecutive`.

  `epochs`: regroupings to write; default enough for `train.num_steps · train.grad_accum` micro-batches,
  capped at `MAX_EPOCHS`.
  """
  t, r, d = config.trime, config.train, config.data
  m, b_rows = int(t.consecutive_segments), int(r.batch_size)
  if d.segmentation != "document":
    raise ConfigError(f"consecutive batching needs data.segmentation='document' (a segment must belong to one "
                      f"document), got {d.segmentation!r}")
  if m < 1 or b_rows % m:
    raise ConfigError(f"train.batch_size={b_rows} must be a positive multiple of trime.consecutive_segments={m}")
  segments = D.make_segments(corpus, d.segment_len, "document")
  runs = document_runs(segments, m)
  b = b_rows // m
  per_epoch = -(-len(runs) // b)
  if epochs is None:
    epochs = min(MAX_EPOCHS, max(1, math.ceil(r.num_steps * r.grad_accum / per_epoch)))
  parts = [epoch_batches(runs, b, int(r.seed), e)
           for e in tqdm(range(epochs), desc="consecutive plan", unit="epoch", disable=not progress)]
  batches = np.concatenate(parts)
  pad_rows = int((parts[0] < 0).sum())
  header = {
      "kind": KIND,
      "corpus_fingerprint": corpus.fingerprint(),
      "segment_len": int(d.segment_len),
      "segmentation": "document",
      "consecutive_segments": m,
      "docs_per_batch": b,
      "seed": int(r.seed),
      "epochs": int(epochs),
      "batches_per_epoch": int(per_epoch),
      "num_segments": len(segments),
      "num_runs": len(runs),
      "padding_rows_per_epoch": pad_rows,
      "tails": "padded: a document's last run and an epoch's last batch are filled with all-padding rows (-1)",
  }
  return header, batches
