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
in a seeded permutation (`update_at`), so resuming at update s reads the same batch as an uninterrupted run.

Composition of an update (`data.batches_per_update`):
  0 (ours)   the order cut once into batches of data.max_tokens padded tokens at a bucketed shape: a batch an
             update.
  G > 0      the original's (G GPUs, fairseq `--max-tokens` each): the order cut by fairseq's `batch_by_size`
             (`fairseq_batches`) into GPU batches of data.max_tokens / G tokens, each padded to its own longest
             pair, sizes a multiple of data.batch_size_multiple; an update is G consecutive batches of the
             epoch's order (`Plan.update_at`), which shuffles groups of G consecutive predefined batches (bm25,
             random) or every batch (length: fairseq's ordered_indices, not predefined), as the original's
             iterator does. Laid out as [G · R, L] (`collate_update`): batch k in rows [k·R, k·R + n_k)
             (R, L: the update's largest batch and longest pair, bucketed), so G contiguous row groups — the
             devices' shards, `trime.memory_grad_groups` — are the original's GPU batches.
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
  """Batches of pair indices: batch i is `indices[offsets[i]:offsets[i + 1]]`, padded to `[rows[i], lengths[i]]`.

  Ours (header batches_per_update 0): a batch is an update. The original's composition (G > 0): a batch is one
  GPU's (rows = its pairs, lengths = its longest pair: the original's own padding) and an update is G of them
  (`update_at`): G consecutive batches of the epoch's order, a shuffle of the groups of G predefined batches
  (bm25, random) or of every batch (length batches: `regroups`)."""

  indices: np.ndarray  # int64 [num_pairs]
  offsets: np.ndarray  # int64 [num_batches + 1]
  lengths: np.ndarray  # int64 [num_batches]: L of the batch's shape
  rows: np.ndarray  # int64 [num_batches]
  header: dict
  _order: tuple | None = dataclasses.field(default=None, repr=False, compare=False)  # (epoch, its order)

  @property
  def num_batches(self) -> int:
    return len(self.lengths)

  @property
  def per_update(self) -> int:
    """G: GPU batches an update (the original's composition), 0: ours (a batch an update)."""
    return int(self.header.get("batches_per_update", 0))

  @property
  def regroups(self) -> bool:
    """The original's length batches: not predefined, so its iterator shuffles them one by one each epoch and
    an update is G of that shuffle (predefined ones are shuffled in their groups of G)."""
    return bool(self.per_update) and self.header.get("order") == "length"

  @property
  def num_updates(self) -> int:
    """Updates an epoch (the original's iterator gives the GPUs past the last batch an empty one, which its
    trainer replaces with a dummy: `collate_update`)."""
    return -(-self.num_batches // self.per_update) if self.per_update else self.num_batches

  def batch(self, i: int) -> np.ndarray:
    return self.indices[self.offsets[i]:self.offsets[i + 1]]

  def digest(self) -> str:
    """SHA-256 (16 hex digits) of the batches (indices, cuts, shapes) and the epoch seed: what a resumed
    training must read again (`<workdir>/data.json`)."""
    import hashlib

    h = hashlib.sha256(str(self.header.get("seed")).encode())
    if self.per_update:  # how batches make updates (ours: one each, the digest of plans before the field)
      h.update(f"per_update={self.per_update},regroups={self.regroups}".encode())
    for a in (self.indices, self.offsets, self.lengths, self.rows):
      h.update(np.ascontiguousarray(a, np.int64).tobytes())
    return h.hexdigest()[:16]

  def as_matrix(self, epoch: int = 0) -> np.ndarray:
    """[updates, max pairs] pair indices of an epoch's updates, -1 padded (for `bm25.neighbour_in_batch`: the
    in-batch memory is the update's)."""
    members = [np.concatenate([self.batch(b) for b in self.update_at(epoch * self.num_updates + u)])
               for u in range(self.num_updates)]
    out = np.full((len(members), max(len(m) for m in members)), -1, np.int64)
    for i, m in enumerate(members):
      out[i, :len(m)] = m
    return out

  def epoch_order(self, epoch: int) -> np.ndarray:
    """The epoch's order of batches (ours: a batch an update)."""
    if self._order is None or self._order[0] != epoch:  # update_at asks once an update: the epoch's kept
      self._order = (epoch, self._epoch_order(epoch))
    return self._order[1]

  def _epoch_order(self, epoch: int) -> np.ndarray:
    if not self.per_update:
      return np.random.default_rng([int(self.header["seed"]), int(epoch), 17]).permutation(self.num_batches)
    # The original's iterator: `np.random.seed(seed + epoch)` then `np.random.shuffle` (fairseq counts epochs
    # from 1) of every batch, or of the groups of G consecutive predefined batches, flattened; GPU k then takes
    # batches k, k + G, ... (so an update is G consecutive of this order: after a last, shorter group the
    # updates straddle two groups, as the original's do)
    g = self.per_update
    items = [[b] for b in range(self.num_batches)] if self.regroups else \
        [list(range(u * g, min((u + 1) * g, self.num_batches))) for u in range(self.num_updates)]
    np.random.RandomState(int(self.header["seed"]) + int(epoch) + 1).shuffle(items)
    return np.asarray([b for item in items for b in item], np.int64)

  def update_at(self, step: int) -> list[int]:
    """The plan batches update `step` reads: [one] for ours; the G GPU batches (fewer at an epoch's end) for
    the original's composition. Epoch = step // num_updates, a seeded order per epoch."""
    epoch, j = divmod(int(step), self.num_updates)
    order = self.epoch_order(epoch)
    g = max(self.per_update, 1)
    return [int(b) for b in order[j * g:(j + 1) * g]]

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


def make_plan(pairs: mt_data.ParallelData, *, order: str, max_tokens: int, seed: int, max_sentences: int = 0,
              bm25_k: int = 20, bm25_backend: str = "numpy", batches_per_update: int = 0,
              batch_size_multiple: int = 8, bm25_k1: float | None = None, bm25_b: float | None = None,
              bm25_analyzer: str = "english") -> Plan:
  """A batch plan over every training pair (each exactly once). batches_per_update = G > 0: the original's
  composition (module docstring), GPU batches of max_tokens // G tokens, max_sentences a cap per such batch."""
  if order not in ORDERS:
    raise ConfigError(f"trime.batching must be one of {ORDERS}, got {order!r}")
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

  def compose(sequence):  # (offsets, lengths, rows) of the plan's batches
    if not batches_per_update:
      return cut(sequence, n_tok, max_tokens, max_sentences)
    batches = fairseq_batches(sequence, n_tok, per_batch, batch_size_multiple, max_sentences)
    sizes = np.asarray([len(b) for b in batches], np.int64)
    return (np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            np.asarray([n_tok[b].max() for b in batches], np.int64), sizes)

  if order == "length":
    # fairseq's LanguagePairDataset.ordered_indices: a random permutation, stably sorted by target length and
    # then by source length, so the source length is the primary key and the target length breaks its ties
    # (the original's composition: its permutation under np.random.seed(seed))
    perm = np.random.RandomState(seed).permutation(len(pairs)) if batches_per_update else rng.permutation(len(pairs))
    perm = perm[np.argsort(tgt_len[perm], kind="stable")]
    perm = perm[np.argsort(src_len[perm], kind="stable")]
    if not batches_per_update:
      # Buckets one after another (`cut` fills each batch to the budget, so a batch at a bucket's end may take
      # the next bucket's first pairs, padded to its longer length).
      by_bucket = np.asarray([bucket(int(n)) for n in n_tok[perm]])
      perm = perm[np.argsort(by_bucket, kind="stable")]
    seq = perm
  elif order == "bm25":
    from trime_jax.batching import bm25

    bm25_k1 = bm25.DEFAULT_K1 if bm25_k1 is None else bm25_k1  # the original's (Pyserini's) unless given
    bm25_b = bm25.DEFAULT_B if bm25_b is None else bm25_b
    bm25.check_analyzer(bm25_analyzer)
    if bm25_analyzer == "english":  # the original: each target sentence's text (detokenised, subwords joined)
      from trime_jax.batching import lucene

      docs = lucene.text_terms(pairs.tgt_text)
    else:
      docs = [np.asarray(t, np.int32) if len(t) else np.asarray([mt_data.EOS], np.int32) for t in pairs.tgt]
    nbrs, _ = bm25.neighbours(docs, bm25_k, backend=bm25_backend, hits_include_query=bm25.HITS_INCLUDE_QUERY,
                              k1=bm25_k1, b=bm25_b, lucene=True)  # top-20 as Pyserini returned them, hits[1:]
    seq = bm25.pack(nbrs, seed)
    header.update(k=bm25_k, bm25_k1=float(bm25_k1), bm25_b=float(bm25_b), bm25_analyzer=bm25_analyzer,
                  bm25_search="lucene")
    header["hits_include_query"] = bm25.HITS_INCLUDE_QUERY  # (a run's plan.npz of before 2026-12-07 resumes as is)
  else:
    seq = rng.permutation(len(pairs))
  seq = np.asarray(seq, np.int64)
  plan = Plan(seq, *compose(seq), header)
  header.update(num_batches=plan.num_batches, real_tokens=int(n_tok.sum()))
  if batches_per_update:  # the first epoch's update shapes
    shapes = [update_shape(plan, plan.update_at(u)) for u in range(plan.num_updates)]
    header.update(num_updates=plan.num_updates, original_padded_tokens=int((plan.rows * plan.lengths).sum()))
  else:
    shapes = list(zip(plan.rows.tolist(), plan.lengths.tolist()))
  header.update(shapes=[list(x) for x in sorted(set(shapes))], padded_tokens=int(sum(r * l for r, l in shapes)))
  if order == "bm25":
    from trime_jax.batching import bm25

    rand_seq = np.random.default_rng([seed, 37]).permutation(len(pairs))
    rand = Plan(rand_seq, *compose(rand_seq), dict(header))
    header["neighbour_in_batch"] = bm25.neighbour_in_batch(plan.as_matrix(), nbrs)
    header["neighbour_in_batch_random"] = bm25.neighbour_in_batch(rand.as_matrix(), nbrs)
  return plan


def update_shape(plan: Plan, members: list[int]) -> tuple[int, int]:
  """[G · R, L] of the original's composition's update of plan batches `members` (G row blocks of R rows: R
  and L the bucketed largest batch and longest pair)."""
  return (plan.per_update * bucket(int(plan.rows[members].max())), bucket(int(plan.lengths[members].max())))


def _sides(pairs: mt_data.ParallelData, idx) -> tuple[list, list]:
  """The source and target id arrays of pairs `idx`, in that order."""
  return [pairs.src[j] for j in idx], [pairs.tgt[j] for j in idx]


def collate_batch(pairs: mt_data.ParallelData, plan: Plan, i: int, pack_len: int = 0) -> dict:
  """Arrays of plan batch i (ours: an update): src/prev [rows, L] (pad 0), targets [rows, L] (pad -1); with
  pack_len > 0 the same pairs packed into rows of pack_len tokens (`mt_data.pack`: + segments and positions)."""
  src, tgt = _sides(pairs, plan.batch(i).tolist())
  if pack_len:
    return mt_data.pack(src, tgt, pack_len)
  l = int(plan.lengths[i])
  return mt_data.collate(src, tgt, l, l, rows=int(plan.rows[i]) if not plan.per_update else None)


def collate_update(pairs: mt_data.ParallelData, plan: Plan, step: int, pack_len: int = 0,
                   rows_multiple: int = 1) -> dict:
  """The arrays update `step` trains on (`collate_batch` of its batch for ours).

  The original's composition: GPU batch k of the update in the k-th of G equal row blocks (`update_shape`;
  empty rows after its pairs). A GPU past the epoch's last batch gets an empty one from the original's iterator,
  which its trainer replaces with a dummy, the first batch (`frozen_batches[0]`), run with its loss ignored but
  its keys all_gathered: such a block holds plan batch 0 as memory only (`loss_mask` 0 there; `mt_nll`). Packed,
  each block packs its own pairs (rows: the fullest block's, rounded up to `rows_multiple`), and block k's pair
  numbers lie in [k·S + 1, k·S + S) with S = block rows · pack_len, so the key-gradient groups are spans of
  `packed_group_span` pair numbers."""
  members = plan.update_at(step)
  if not plan.per_update:
    return collate_batch(pairs, plan, members[0], pack_len)
  g = plan.per_update
  idle = g - len(members)
  shaped = members + [0] * idle
  groups = [plan.batch(b).tolist() for b in shaped]
  if not pack_len:
    rows, l = update_shape(plan, shaped)
    blocks = [mt_data.collate(*_sides(pairs, m), l, l, rows=rows // g) for m in groups]
    out = {name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]}
  else:
    blocks = [mt_data.pack(*_sides(pairs, m), pack_len, rows_multiple=1) for m in groups]
    r = -(-max(len(b["src"]) for b in blocks) // rows_multiple) * rows_multiple
    span = r * pack_len
    parts = {name: [] for name in blocks[0]}
    for k, (b, m) in enumerate(zip(blocks, groups)):
      assert len(m) < span, (len(m), span)  # every pair takes >= 2 target positions (no empty sides in training)
      for name, a in b.items():
        a = np.concatenate([a, np.full((r - len(a), pack_len), -1 if name == "targets" else 0, a.dtype)])
        parts[name].append(np.where(a > 0, a + k * span, 0) if name.endswith("_seg") else a)
    out = {name: np.concatenate(p) for name, p in parts.items()}
  if idle:  # the last blocks are the dummy's: memory only
    block = out["targets"].shape[0] // g
    out["loss_mask"] = np.ones(out["targets"].shape, np.int32)
    out["loss_mask"][(g - idle) * block:] = 0
  return out


def packed_group_span(targets_shape, groups: int) -> int:
  """The pair-number span of one of `groups` packed row blocks (`collate_update`): block rows · row length."""
  return targets_shape[0] // groups * targets_shape[1]
