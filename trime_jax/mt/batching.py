"""Training batches of sentence pairs under a token budget (fairseq `--max-tokens`).

Every batch is padded to a bucketed shape `[rows(L), L]` for source and target alike, where L (from
`BUCKETS`) is the smallest bucket holding the batch's longest side (ids + eos) and rows(L) = max_tokens // L:
rows · L <= max_tokens padded tokens, as fairseq counts them (max(src, tgt) per sentence), and jit compiles
one shape per bucket (a handful), not one per batch.

Orders (`trime.batching`):
  length  fairseq's: pairs sorted by length (ties in seeded random order), cut bucket by bucket into full
          batches — few padded tokens; the vanilla baseline's batches.
  bm25    Algorithm 1 of the paper over TARGET sentences (`batching.bm25.neighbours` / `pack` — the LM's code):
          a chain through every pair, each step to the most BM25-similar unused target sentence, so a target
          token's in-batch memory holds similar translations; the chain is cut into token-budget batches.
  random  a seeded permutation cut the same way (the paper's random-batch ablation).
The plan is fixed for a run (the original also trained on predefined batches); every epoch visits its batches
in a seeded permutation (`batch_at`), so resuming at update s reads the same batch as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from trime_jax.errors import ConfigError
from trime_jax.mt import data as mt_data

BUCKETS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
ORDERS = ("length", "bm25", "random")


def bucket(n: int) -> int:
  """The smallest bucket length >= n (n itself beyond the table)."""
  for b in BUCKETS:
    if b >= n:
      return b
  return int(n)


def rows_for(length: int, max_tokens: int, max_sentences: int = 0) -> int:
  r = max_tokens // length
  return min(r, max_sentences) if max_sentences else r


@dataclasses.dataclass
class Plan:
  """Batches of pair indices: batch i is `indices[offsets[i]:offsets[i + 1]]`, padded to `[rows[i], lengths[i]]`."""

  indices: np.ndarray  # int64 [num_pairs]
  offsets: np.ndarray  # int64 [num_batches + 1]
  lengths: np.ndarray  # int64 [num_batches]: L of the batch's shape
  rows: np.ndarray  # int64 [num_batches]
  header: dict

  @property
  def num_batches(self) -> int:
    return len(self.lengths)

  def batch(self, i: int) -> np.ndarray:
    return self.indices[self.offsets[i]:self.offsets[i + 1]]

  def digest(self) -> str:
    """SHA-256 (16 hex digits) of the batches (indices, cuts, shapes) and the epoch seed: what a resumed
    training must read again (`<workdir>/data.json`)."""
    import hashlib

    h = hashlib.sha256(str(self.header.get("seed")).encode())
    for a in (self.indices, self.offsets, self.lengths, self.rows):
      h.update(np.ascontiguousarray(a, np.int64).tobytes())
    return h.hexdigest()[:16]

  def as_matrix(self) -> np.ndarray:
    """[num_batches, max rows] pair indices, -1 padded (for `bm25.neighbour_in_batch`)."""
    width = int(np.diff(self.offsets).max())
    out = np.full((self.num_batches, width), -1, np.int64)
    for i in range(self.num_batches):
      b = self.batch(i)
      out[i, :len(b)] = b
    return out

  def epoch_order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([int(self.header["seed"]), int(epoch), 17]).permutation(self.num_batches)

  def batch_at(self, step: int) -> int:
    """The plan batch that update `step` reads (epoch = step // num_batches, seeded permutation per epoch)."""
    epoch, j = divmod(int(step), self.num_batches)
    return int(self.epoch_order(epoch)[j])

  def save(self, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, indices=self.indices, offsets=self.offsets, lengths=self.lengths, rows=self.rows,
             header=np.frombuffer(json.dumps(self.header).encode(), np.uint8))
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str) -> "Plan":
    z = np.load(path)
    return cls(z["indices"], z["offsets"], z["lengths"], z["rows"], json.loads(bytes(z["header"]).decode()))


def pair_lengths(src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
  """fairseq's num_tokens of a pair: max(source, target) model tokens (ids + eos)."""
  return np.maximum(np.asarray(src_len), np.asarray(tgt_len))


def cut(order: np.ndarray, n_tokens: np.ndarray, max_tokens: int, max_sentences: int = 0):
  """Cut an order of pairs into consecutive batches whose bucketed shape fits the token budget:
  (offsets, lengths, rows)."""
  offsets, lengths, rows = [0], [], []
  cur_max = 0
  for i, p in enumerate(order.tolist()):
    n = int(n_tokens[p])
    size = i - offsets[-1]
    new_max = max(cur_max, n)
    if size and (size + 1 > rows_for(bucket(new_max), max_tokens, max_sentences)):
      lengths.append(bucket(cur_max))
      rows.append(rows_for(lengths[-1], max_tokens, max_sentences))
      offsets.append(i)
      new_max = n
    cur_max = new_max
  if len(order):
    lengths.append(bucket(cur_max))
    rows.append(rows_for(lengths[-1], max_tokens, max_sentences))
    offsets.append(len(order))
  return np.asarray(offsets, np.int64), np.asarray(lengths, np.int64), np.asarray(rows, np.int64)


def make_plan(pairs: mt_data.ParallelData, *, order: str, max_tokens: int, seed: int, max_sentences: int = 0,
              bm25_k: int = 20, bm25_backend: str = "numpy") -> Plan:
  """A batch plan over every training pair (each exactly once)."""
  if order not in ORDERS:
    raise ConfigError(f"trime.batching must be one of {ORDERS}, got {order!r}")
  src_len, tgt_len = pairs.lengths()
  n_tok = pair_lengths(src_len, tgt_len)
  longest = int(n_tok.max())
  if bucket(longest) > max_tokens:
    raise ConfigError(f"data.max_tokens={max_tokens} is below the longest pair's bucket ({bucket(longest)} "
                      f"tokens): raise it or lower data.max_len")
  rng = np.random.default_rng([seed, 31])
  header = {"order": order, "seed": seed, "max_tokens": max_tokens, "max_sentences": max_sentences,
            "num_pairs": len(pairs)}
  if order == "length":
    # fairseq's LanguagePairDataset.ordered_indices: a random permutation, stably sorted by target length and
    # then by source length, so the source length is the primary key and the target length breaks its ties.
    perm = rng.permutation(len(pairs))
    perm = perm[np.argsort(tgt_len[perm], kind="stable")]
    perm = perm[np.argsort(src_len[perm], kind="stable")]
    # Buckets one after another (`cut` fills each batch to the budget, so a batch at a bucket's end may take
    # the next bucket's first pairs, padded to its longer length).
    by_bucket = np.asarray([bucket(int(n)) for n in n_tok[perm]])
    perm = perm[np.argsort(by_bucket, kind="stable")]
    seq = perm
  elif order == "bm25":
    from trime_jax.batching import bm25

    nbrs, _ = bm25.neighbours([np.asarray(t, np.int32) if len(t) else np.asarray([mt_data.EOS], np.int32)
                               for t in pairs.tgt], bm25_k, backend=bm25_backend)
    seq = bm25.pack(nbrs, seed)
    header["k"] = bm25_k
  else:
    seq = rng.permutation(len(pairs))
  offsets, lengths, rows = cut(seq, n_tok, max_tokens, max_sentences)
  shapes = sorted({(int(r), int(l)) for r, l in zip(rows, lengths)})
  header.update(num_batches=len(lengths), shapes=[list(x) for x in shapes],
                padded_tokens=int((rows * lengths).sum()), real_tokens=int(n_tok.sum()))
  plan = Plan(np.asarray(seq, np.int64), offsets, lengths, rows, header)
  if order == "bm25":
    from trime_jax.batching import bm25

    m = plan.as_matrix()
    rand_seq = np.random.default_rng([seed, 37]).permutation(len(pairs))
    rand = Plan(rand_seq, *cut(rand_seq, n_tok, max_tokens, max_sentences), header={})
    header["neighbour_in_batch"] = bm25.neighbour_in_batch(m, nbrs)
    header["neighbour_in_batch_random"] = bm25.neighbour_in_batch(rand.as_matrix(), nbrs)
  return plan


def collate_batch(pairs: mt_data.ParallelData, plan: Plan, i: int, pack_len: int = 0) -> dict:
  """Arrays of plan batch i: src/prev [rows, L] (pad 0), targets [rows, L] (pad -1); with pack_len > 0 the
  same pairs packed into rows of pack_len tokens (`mt_data.pack`: + segments and positions)."""
  idx = plan.batch(i).tolist()
  if pack_len:
    return mt_data.pack([pairs.src[j] for j in idx], [pairs.tgt[j] for j in idx], pack_len)
  l, r = int(plan.lengths[i]), int(plan.rows[i])
  return mt_data.collate([pairs.src[j] for j in idx], [pairs.tgt[j] for j in idx], l, l, rows=r)
