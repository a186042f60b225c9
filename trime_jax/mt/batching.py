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

Composition of an update (`data.batches_per_update`):
  0 (ours)   the order cut once into batches of data.max_tokens padded tokens at a bucketed shape.
  G > 0      the original's (G GPUs, fairseq `--max-tokens` each): the order cut by fairseq's `batch_by_size`
             (`fairseq_batches`) into batches of data.max_tokens / G tokens, each padded to its own longest
             pair, sizes a multiple of data.batch_size_multiple; an update is G consecutive such batches (one a
             GPU) and an epoch shuffles whole updates, as the original's iterator shuffles predefined batches
             in groups of its GPU count. Laid out as [G · R, L]: batch k in rows [k·R, k·R + n_k) (R, L: the
             update's largest batch and longest pair, bucketed), so G contiguous row groups — the devices'
             shards, `trime.memory_grad_groups` — are the original's GPU batches.
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
LENGTH_ORDER_IS_OURS = ("data.batches_per_update (the original's composition of an update) takes trime.batching "
                        "bm25 or random (the original's predefined batches); the length-sorted baseline's batches "
                        "are ours: set data.batches_per_update=0")


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
  # int64 [num_batches, G + 1] or None: with data.batches_per_update = G, where the original's G GPU batches of
  # plan batch i (an update) start and end within it (`batch(i)[parts[i, k]:parts[i, k + 1]]`)
  parts: np.ndarray | None = None
  _order: tuple | None = dataclasses.field(default=None, repr=False, compare=False)  # (epoch, its order)

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
    for a in (self.indices, self.offsets, self.lengths, self.rows) + (() if self.parts is None else (self.parts,)):
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
    if self._order is None or self._order[0] != epoch:  # batch_at asks once an update: the epoch's kept
      self._order = (epoch, self._epoch_order(epoch))
    return self._order[1]

  def _epoch_order(self, epoch: int) -> np.ndarray:
    if self.parts is None:
      return np.random.default_rng([int(self.header["seed"]), int(epoch), 17]).permutation(self.num_batches)
    # The original's composition: its iterator's shuffle of the predefined batches' groups, `np.random.seed(seed
    # + epoch)` then `np.random.shuffle` (fairseq counts epochs from 1)
    order = list(range(self.num_batches))
    np.random.RandomState(int(self.header["seed"]) + int(epoch) + 1).shuffle(order)
    return np.asarray(order, np.int64)

  def batch_at(self, step: int) -> int:
    """The plan batch that update `step` reads (epoch = step // num_batches, seeded permutation per epoch)."""
    epoch, j = divmod(int(step), self.num_batches)
    return int(self.epoch_order(epoch)[j])

  def save(self, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npz"
    parts = {} if self.parts is None else {"parts": self.parts}
    np.savez(tmp, indices=self.indices, offsets=self.offsets, lengths=self.lengths, rows=self.rows,
             header=np.frombuffer(json.dumps(self.header).encode(), np.uint8), **parts)
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str) -> "Plan":
    z = np.load(path)
    return cls(z["indices"], z["offsets"], z["lengths"], z["rows"], json.loads(bytes(z["header"]).decode()),
               z["parts"] if "parts" in z.files else None)


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


def fairseq_batches(order: np.ndarray, n_tokens: np.ndarray, max_tokens: int, multiple: int = 8,
                    max_sentences: int = 0) -> list[np.ndarray]:
  """fairseq's `batch_by_size` over `order`, kept as given: pairs are added to a batch while (size + 1) · its
  longest pair (n_tokens, the new one included) stays <= max_tokens (and size < max_sentences); a full batch
  emits its largest multiple of `multiple` (all of it when smaller than `multiple`) and the rest starts the next
  one, which is not checked again. Each batch is padded to its own longest pair."""
  batches, cur, cur_len = [], [], []
  for p in np.asarray(order).tolist():
    n = int(n_tokens[p])
    longest = max(max(cur_len, default=0), n)
    if cur and ((max_sentences and len(cur) == max_sentences) or (len(cur) + 1) * longest > max_tokens):
      keep = max(multiple * (len(cur) // multiple), len(cur) % multiple)
      batches.append(np.asarray(cur[:keep], np.int64))
      cur, cur_len = cur[keep:], cur_len[keep:]
    cur.append(p)
    cur_len.append(n)
  if cur:
    batches.append(np.asarray(cur, np.int64))
  return batches


def group_updates(batches: list[np.ndarray], n_tokens: np.ndarray, per_update: int):
  """`per_update` consecutive batches an update (the last may have fewer: the original's iterator gives the GPUs
  past the end an empty batch), laid out as [per_update · R, L]: (indices, offsets, lengths, rows, parts)."""
  indices, offsets, lengths, rows, parts = [], [0], [], [], []
  for u in range(0, len(batches), per_update):
    group = batches[u:u + per_update]
    sizes = [len(b) for b in group] + [0] * (per_update - len(group))
    members = np.concatenate(group)
    indices.append(members)
    offsets.append(offsets[-1] + len(members))
    lengths.append(bucket(int(n_tokens[members].max())))
    rows.append(per_update * bucket(max(sizes)))
    parts.append(np.concatenate([[0], np.cumsum(sizes)]))
  as64 = lambda a: np.asarray(a, np.int64)  # noqa: E731
  return np.concatenate(indices), as64(offsets), as64(lengths), as64(rows), as64(parts)


def make_plan(pairs: mt_data.ParallelData, *, order: str, max_tokens: int, seed: int, max_sentences: int = 0,
              bm25_k: int = 20, bm25_backend: str = "numpy", batches_per_update: int = 0,
              batch_size_multiple: int = 8) -> Plan:
  """A batch plan over every training pair (each exactly once). batches_per_update = G > 0: the original's
  composition (module docstring), batches of max_tokens // G tokens, max_sentences a cap per such batch."""
  if order not in ORDERS:
    raise ConfigError(f"trime.batching must be one of {ORDERS}, got {order!r}")
  if batches_per_update and order == "length":
    raise ConfigError(LENGTH_ORDER_IS_OURS)
  src_len, tgt_len = pairs.lengths()
  n_tok = pair_lengths(src_len, tgt_len)
  longest = int(n_tok.max())
  per_batch = max_tokens // batches_per_update if batches_per_update else max_tokens
  if batches_per_update and longest > per_batch:
    raise ConfigError(f"data.max_tokens / data.batches_per_update = {per_batch} tokens a batch is below the "
                      f"longest pair ({longest} tokens): raise data.max_tokens or lower data.max_len")
  if bucket(longest) > max_tokens:
    raise ConfigError(f"data.max_tokens={max_tokens} is below the longest pair's bucket ({bucket(longest)} "
                      f"tokens): raise it or lower data.max_len")
  rng = np.random.default_rng([seed, 31])
  header = {"order": order, "seed": seed, "max_tokens": max_tokens, "max_sentences": max_sentences,
            "num_pairs": len(pairs)}
  if batches_per_update:
    header.update(batches_per_update=batches_per_update, batch_size_multiple=batch_size_multiple)

  def compose(sequence):
    if not batches_per_update:
      return (*cut(sequence, n_tok, max_tokens, max_sentences), None)
    return group_updates(fairseq_batches(sequence, n_tok, per_batch, batch_size_multiple, max_sentences), n_tok,
                         batches_per_update)[1:]
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
  seq = np.asarray(seq, np.int64)
  offsets, lengths, rows, parts = compose(seq)
  shapes = sorted({(int(r), int(l)) for r, l in zip(rows, lengths)})
  header.update(num_batches=len(lengths), shapes=[list(x) for x in shapes],
                padded_tokens=int((rows * lengths).sum()), real_tokens=int(n_tok.sum()))
  if parts is not None:  # what the original's GPUs pad (each batch to its own longest pair)
    header["original_padded_tokens"] = int(sum(
        (parts[i, k + 1] - parts[i, k]) * n_tok[seq[offsets[i] + parts[i, k]:offsets[i] + parts[i, k + 1]]].max()
        for i in range(len(lengths)) for k in range(batches_per_update) if parts[i, k + 1] > parts[i, k]))
  plan = Plan(seq, offsets, lengths, rows, header, parts)
  if order == "bm25":
    from trime_jax.batching import bm25

    m = plan.as_matrix()
    rand_seq = np.random.default_rng([seed, 37]).permutation(len(pairs))
    rand = Plan(rand_seq, *compose(rand_seq)[:3], header={})
    header["neighbour_in_batch"] = bm25.neighbour_in_batch(m, nbrs)
    header["neighbour_in_batch_random"] = bm25.neighbour_in_batch(rand.as_matrix(), nbrs)
  return plan


def collate_batch(pairs: mt_data.ParallelData, plan: Plan, i: int, pack_len: int = 0, rows_multiple: int = 1) -> dict:
  """Arrays of plan batch i: src/prev [rows, L] (pad 0), targets [rows, L] (pad -1); with pack_len > 0 the
  same pairs packed into rows of pack_len tokens (`mt_data.pack`: + segments and positions).

  The original's composition (plan.parts): batch k of the update in the k-th of G equal row blocks. Packed,
  each block packs its own pairs (rows: the fullest block's, rounded up to `rows_multiple`), and block k's pair
  numbers lie in [k·S + 1, k·S + S) with S = block rows · pack_len (more than the pairs a block can hold), so
  `packed_group_span` ids apart are the key-gradient groups."""
  idx = plan.batch(i).tolist()
  take = lambda sel: ([pairs.src[j] for j in sel], [pairs.tgt[j] for j in sel])  # noqa: E731
  if plan.parts is None:
    if pack_len:
      return mt_data.pack(*take(idx), pack_len)
    l, r = int(plan.lengths[i]), int(plan.rows[i])
    return mt_data.collate(*take(idx), l, l, rows=r)
  bounds = plan.parts[i]
  g = len(bounds) - 1
  members = [idx[bounds[k]:bounds[k + 1]] for k in range(g)]
  if not pack_len:
    l, r = int(plan.lengths[i]), int(plan.rows[i])
    blocks = [mt_data.collate(*take(m), l, l, rows=r // g) for m in members]  # GPU k's pairs in rows [k·R, k·R + n_k)
    return {name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]}
  blocks = [mt_data.pack(*take(m), pack_len, rows_multiple=1) for m in members]
  r = -(-max(len(b["src"]) for b in blocks) // rows_multiple) * rows_multiple
  span = r * pack_len
  out = {name: [] for name in blocks[0]}
  for k, b in enumerate(blocks):
    for name, a in b.items():
      a = np.concatenate([a, np.full((r - len(a), pack_len), -1 if name == "targets" else 0, a.dtype)])
      out[name].append(np.where(a > 0, a + k * span, 0) if name.endswith("_seg") else a)
  return {name: np.concatenate(parts) for name, parts in out.items()}


def packed_group_span(targets_shape, groups: int) -> int:
  """The pair-number span of one of `groups` packed row blocks (`collate_batch`): block rows · row length."""
  return targets_shape[0] // groups * targets_shape[1]
