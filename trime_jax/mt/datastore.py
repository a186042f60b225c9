"""The translation datastore: the teacher-forced decoder key g(x, y<t) of every training target token, with
that token y_t as its value (Khandelwal et al. 2021's ((x, y<t), y_t) pairs; TRIME §5's external memory).

Same files and guarantees as the LM's datastore (`trime_jax.datastore.build`): keys.npy float16 [N, D],
values.npy int32 [N], meta.json with the identity fields (format, count, dimension, dtypes, checkpoint /
vocabulary / corpus fingerprints, key_type; block_len = context_window = 0: sentence-level), file digests,
`complete`. So `Datastore`, `KnnIndex`, `build_index`, `rescore` and `Datastore.check_checkpoint` work on it
unchanged, and a datastore built by another checkpoint or vocabulary is refused.

Entries are in pair order: pair i contributes len(y_i) + 1 entries (targets y_i + [eos], fairseq's targets),
keyed by the decoder over prev = [eos] + y_i with its source. Padding targets (-1) never become entries.
The files are written by the LM builder's `DatastoreWriter` (identity check, reserved blocks, atomic progress,
digests). Batches are length-sorted, so progress is recorded as `batches_done` of a plan fixed by the pairs and
`batch_tokens` (kept in meta.json): an interrupted build resumes at its first unsaved chunk of batches. Each
committed chunk records the digest of the entries its batches wrote (scattered rows, found again from the plan),
and a resumed build checks them: a chunk changed after it was saved is recomputed, never blessed by `finish()`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from trime_jax import data, exports
from trime_jax.datastore import build as ds_build
from trime_jax.errors import CheckpointError
from trime_jax.mt import data as mt_data
from trime_jax.mt import export as mt_export

CHUNK_BATCHES = 64  # batches per persisted chunk of an MT datastore build


def length_bucket(n: int) -> int:
  """The padded length of a sequence of n tokens: 8, 12, 16, 24, 32, 48, 64, ... (≤ 1.5× padding, few shapes)."""
  b = 8
  while b < n:
    b = b * 3 // 2 if (b & (b - 1)) == 0 else b * 4 // 3
  return b


def pair_batches(src_list, tgt_list, *, batch_tokens: int):
  """[(pair indices, collated batch)]: pairs sorted by length, both sides padded to one length bucket L, and
  batch_tokens // L rows per batch (filler rows are empty): one shape per bucket, so one compilation each."""
  width = [max(len(x), len(y)) + 1 for x, y in zip(src_list, tgt_list)]
  order = sorted(range(len(src_list)), key=lambda i: (width[i], i))
  out, a = [], 0
  while a < len(order):
    length = length_bucket(width[order[a]])
    rows = max(1, batch_tokens // length)
    idx = [i for i in order[a:a + rows] if length_bucket(width[i]) == length]
    a += len(idx)
    out.append((idx, mt_data.collate([src_list[i] for i in idx], [tgt_list[i] for i in idx], length, length,
                                     rows=rows)))
  return out


@functools.partial(jax.jit, static_argnames=("graphdef",))
def forced_forward(graphdef, params, src_BxS, prev_BxT):
  """Teacher-forced (logits [B, T, V] float32, g [B, T, D] float32) of a batch (dropout off)."""
  model = nnx.merge(graphdef, params)
  enc = model.encode(src_BxS, deterministic=True)
  f, g = model.decode(enc, src_BxS, prev_BxT, deterministic=True)
  return model.logits(f).astype(jnp.float32), g.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forced_keys(graphdef, params, src_BxS, prev_BxT):
  model = nnx.merge(graphdef, params)
  enc = model.encode(src_BxS, deterministic=True)
  return model.decode(enc, src_BxS, prev_BxT, deterministic=True)[1].astype(jnp.float16)


def corpus_fingerprint(src_list, tgt_list) -> str:
  h = hashlib.sha256(f"mt-pairs:{len(src_list)}".encode())
  for x, y in zip(src_list, tgt_list):
    h.update(np.asarray(x, np.int32).tobytes() + b"|" + np.asarray(y, np.int32).tobytes() + b"\n")
  return h.hexdigest()[:16]


def _rows_of(batches, offsets, counts, a: int, b: int) -> np.ndarray:
  """The datastore rows (in write order) that batches a..b of the plan fill."""
  idx = [i for pairs_idx, _ in batches[a:b] for i in pairs_idx]
  if not idx:
    return np.zeros(0, np.int64)
  return np.concatenate([np.arange(offsets[i], offsets[i] + counts[i]) for i in idx])


def _chunk_digest(keys, values, rows: np.ndarray, a: int, b: int) -> str:
  h = hashlib.sha256(f"mt:{a}:{b}:".encode())
  h.update(np.ascontiguousarray(keys[rows]).tobytes())
  h.update(np.ascontiguousarray(values[rows]).tobytes())
  return h.hexdigest()[:16]


def _verify_chunks(writer, keys, values, batches, offsets, counts) -> None:
  """Roll meta.json back to the first committed chunk whose entries changed since it was saved (one warning
  line); a resumed build without chunk digests (an older version's) restarts from the first batch."""
  meta, done = writer.meta, int(writer.meta.get("batches_done", 0))
  if not done:
    return
  chunks = meta.get("mt_chunks") or []
  covered = 0
  for c in chunks:
    covered = c["batches"][1] if c["batches"][0] == covered else -1
  if covered != done:
    print(f"warning: datastore build in {writer.out_dir}: its {done:,} saved batches have no per-chunk digests "
          "(an older version's build, or meta.json was edited); restarting from the first batch", flush=True)
    meta.update(batches_done=0, tokens_done=0)
    meta["mt_chunks"] = []
  else:
    bad = next((i for i, c in enumerate(chunks)
                if _chunk_digest(keys, values, _rows_of(batches, offsets, counts, *c["batches"]), *c["batches"])
                != c["digest"]), None)
    if bad is None:
      return
    a, b = chunks[bad]["batches"]
    print(f"warning: datastore build in {writer.out_dir}: the entries of batches {a:,}..{b:,} were changed after "
          f"they were saved; recomputing from batch {a:,}", flush=True)
    meta.update(chunks[bad]["before"])
    meta["mt_chunks"] = chunks[:bad]
  data.atomic_write_json(writer.meta_path, meta)


@ds_build.locked_out_dir
def build_mt_datastore(checkpoint_dir: str, pairs: mt_data.ParallelData, out_dir: str, *,
                       batch_tokens: int = 8192, max_chunks: int | None = None, progress: bool = True) -> dict:
  """Build (or resume) the datastore of `pairs` (the training split) under the MT export `checkpoint_dir` into
  `out_dir`; returns meta.json's dict. A complete datastore with the same identity is reused; a different one is
  refused. `max_chunks`: stop after that many chunks of CHUNK_BATCHES batches (incomplete; a rerun resumes)."""
  graphdef, params, config, vocab = mt_export.load_mt_export(checkpoint_dir)
  if pairs.vocab.fingerprint() != vocab.fingerprint():
    raise CheckpointError(f"the {pairs.split or 'given'} pairs are encoded with vocabulary "
                          f"{pairs.vocab.fingerprint()}, the checkpoint uses {vocab.fingerprint()}: encode them "
                          "with the checkpoint's vocabulary")
  cmeta = exports.read_export_meta(checkpoint_dir)
  counts = np.asarray([len(y) + 1 for y in pairs.tgt], np.int64)
  offsets = np.concatenate([[0], np.cumsum(counts)])
  n, dim = int(offsets[-1]), int(cmeta["d_model"])
  identity = {"format": ds_build.FORMAT, "count": n, "dimension": dim, "key_dtype": "float16",
              "value_dtype": "int32", "checkpoint_fingerprint": exports.fingerprint(checkpoint_dir),
              "vocab_fingerprint": vocab.fingerprint(), "corpus_fingerprint": corpus_fingerprint(pairs.src, pairs.tgt),
              "key_type": cmeta["key_type"], "block_len": 0, "context_window": 0}
  writer = ds_build.DatastoreWriter(out_dir, identity)
  if writer.complete:
    if progress:
      print(f"datastore {out_dir} is already complete ({n:,} target tokens)", flush=True)
    return writer.meta
  with writer.no_space_is_an_error():
    keys, values = writer.open(corpus_name=pairs.split, task="mt", pairs=len(pairs), batch_tokens=batch_tokens,
                               batches_done=0)
    meta = writer.meta
    batches = pair_batches(pairs.src, pairs.tgt, batch_tokens=int(meta["batch_tokens"]))  # the resumed plan
    _verify_chunks(writer, keys, values, batches, offsets, counts)
    first, written = int(meta["batches_done"]), 0
    chunk_first = first
    t0 = time.perf_counter()
    bar = tqdm(total=len(batches), initial=first, desc="mt datastore", unit="batch", disable=not progress)
    try:
      for b_i in range(first, len(batches)):
        if max_chunks is not None and b_i >= first + max_chunks * CHUNK_BATCHES:
          break
        idx, batch = batches[b_i]
        g = np.asarray(_forced_keys(graphdef, params, jnp.asarray(batch["src"]), jnp.asarray(batch["prev"])))
        if not np.isfinite(g[:len(idx)]).all():
          raise CheckpointError("non-finite float16 keys: the model's keys overflow float16 or the checkpoint is "
                                "broken")
        for r, i in enumerate(idx):
          lo, c = offsets[i], counts[i]
          keys[lo:lo + c] = g[r, :c]
          values[lo:lo + c] = batch["targets"][r, :c]
        written += int(counts[idx].sum())
        if (b_i + 1) % CHUNK_BATCHES == 0 or b_i + 1 == len(batches):
          dt, t0 = time.perf_counter() - t0, time.perf_counter()
          keys.flush(), values.flush()
          rows = _rows_of(batches, offsets, counts, chunk_first, b_i + 1)
          meta.setdefault("mt_chunks", []).append(
              {"batches": [chunk_first, b_i + 1], "digest": _chunk_digest(keys, values, rows, chunk_first, b_i + 1),
               "before": {"batches_done": chunk_first, "tokens_done": int(meta["tokens_done"])}})
          writer.commit(dt, batches_done=b_i + 1, tokens_done=int(meta["tokens_done"]) + written)
          written, chunk_first = 0, b_i + 1
        bar.update(1)
    finally:
      bar.close()
    del keys, values
    if meta["batches_done"] == len(batches):
      meta.pop("mt_chunks", None)  # superseded by finish()'s whole-file digests
      meta = writer.finish()
  if progress:
    state = "complete" if meta["complete"] else f"incomplete ({meta['batches_done']} of {len(batches)} batches)"
    print(f"datastore {out_dir}: {state}; {n:,} target tokens of {len(pairs):,} pairs, "
          f"{meta['build_seconds']:.1f} s", flush=True)
  return meta


def open_mt_datastore(datastore_dir: str, checkpoint_dir: str, *, index_path: str = "", nprobe: int = 32,
                      gpu: bool = False):
  """(Datastore, KnnIndex) of an MT datastore, refused unless built by `checkpoint_dir` (same parameters,
  vocabulary, key type and dimension) and indexed over these keys."""
  from trime_jax.datastore import Datastore, KnnIndex, default_index_path

  ds = Datastore(datastore_dir)
  ds.check_checkpoint(checkpoint_dir)  # another model's datastore: one error saying so
  index = KnnIndex.load(index_path or default_index_path(datastore_dir), datastore=ds, nprobe=nprobe,
                        gpu=gpu)
  return ds, index


# ----------------------------------------------------------------------------------------------------------
# trime_jax.launch.build_datastore for translation
# ----------------------------------------------------------------------------------------------------------
def is_mt(config, checkpoint_dir: str) -> bool:
  """A translation build: an MT config, or the checkpoint is an MT export."""
  if exports.is_mt_config(config):
    return True
  path = os.path.join(checkpoint_dir or "", "meta.json")
  if os.path.isfile(path):
    return data.read_json(path, "export meta", CheckpointError).get("model_family") == "mt"
  return False


def mt_config(config, checkpoint_dir: str):
  """The config to read data from: `config` when it is an MT config, else the export's stored config.json
  (trime_jax.launch.flags's implicit export config is the LM schema and would drop the MT fields)."""
  import ml_collections

  from trime_jax.runtime.workdir import read_stored_config

  if not exports.is_mt_config(config):
    path = os.path.join(checkpoint_dir, "config.json")
    config = ml_collections.ConfigDict(read_stored_config(path, "export config", CheckpointError))
  mt_data.resolve_data_path(config)  # a relative data.path: from the working directory, else the repository root
  return config


def build_main(config, checkpoint_dir: str, out_dir: str, *, split: str = "train", index_kind: str = "auto",
               nlist: int = 4096, pq_m: int = 64, k: int = 64, nprobe: int = 32, beam: int = 4) -> None:
  """`trime_jax.launch.build_datastore` for an MT config / export: the datastore of `split`'s target tokens, then its
  index (auto: the cheaper of exact and IVF-PQ for the searches decoding valid + test with `beam` runs)."""
  from trime_jax.datastore import Datastore, build_index

  config = mt_config(config, checkpoint_dir)
  vocab = mt_export.load_mt_export(checkpoint_dir)[3]
  split = mt_data.split_name(split)
  pairs = mt_data.load_parallel(config, split, vocab)
  build_mt_datastore(checkpoint_dir, pairs, out_dir)
  if index_kind != "none":
    # One search per beam row and output token while decoding valid and test (≈ their target tokens).
    queries = beam * sum(int(mt_data.load_parallel(config, s, vocab).lengths()[1].sum()) for s in ("valid", "test"))
    build_index(Datastore(out_dir), kind=index_kind, nlist=nlist, pq_m=pq_m, queries=queries, k=k, nprobe=nprobe,
                reuse=True)  # the CLI's rerun keeps a complete index of the same parameters
