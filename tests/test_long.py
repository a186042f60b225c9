"""TrimeLM_long: consecutive batch plans and long-term memory at evaluation (tiny corpora, no ../shared)."""

import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trime_jax.configs import default
from tests import reference as ref
from tests.helpers import wikitext_config_file, wikitext_dir
from trime_jax import exports
from trime_jax import corpora
from trime_jax import data as D
from trime_jax import evaluate
from trime_jax import loss
from trime_jax import scoring
from trime_jax import sweep
from trime_jax.batching import consecutive
from trime_jax.batching import plan as batch_plan
from trime_jax.errors import ConfigError, DataError
from trime_jax.model import TransformerLM
from trime_jax.train import BatchSource
from trime_jax import specs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_LENS = [5, 40, 23, 60, 1, 17, 33]  # some shorter than one segment / one run, one a single token


def _corpus(lens=DOC_LENS, n_words=6, seed=0):
  rng = np.random.default_rng(seed)
  vocab = D.Vocab(["</s>", "<unk>"] + [f"w{i}" for i in range(n_words)])
  return D.Corpus.from_docs([rng.integers(2, 2 + n_words, size=n) for n in lens], vocab, "tiny")


def _config(**kw):
  c = default.get_config()
  c.data.segment_len, c.data.segmentation = 4, "stream"
  c.train.batch_size, c.trime.consecutive_segments, c.trime.memory = 6, 3, "long"
  c.train.num_steps, c.train.seed = 40, 5
  c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.d_ff, c.model.max_len = 1, 16, 2, 32, 32
  c.model.dropout = 0.0
  for k, v in kw.items():
    node, *path = k.split(".")
    getattr(c, node)[path[0]] = v
  return c


# ----------------------------------------------------------------------------------------------------------
# Consecutive batch plans
# ----------------------------------------------------------------------------------------------------------
def _brute_real_fraction(corpus, segments, batches):
  _, targets = D.gather_segments(corpus, segments, batches.reshape(-1))
  return float((targets >= 0).mean())


@pytest.mark.parametrize("layout", ["stream", "packed"])
@pytest.mark.parametrize("m,b", [(3, 2), (4, 3), (1, 4), (5, 1)])
def test_plan_covers_every_segment_once_in_runs_of_consecutive_stream_segments(layout, m, b):
  corpus = _corpus()  # 179 tokens -> 45 segments of 4, the last one 3 tokens
  config = _config(**{"trime.consecutive_segments": m, "train.batch_size": b * m, "trime.consecutive_layout": layout})
  header, batches = consecutive.make_plan(corpus, config, progress=False)
  segs = D.make_segments(corpus, 4, "stream")
  n_runs = -(-len(segs) // m)
  assert batches.shape == (-(-n_runs // b), b * m)
  real = batches[batches >= 0]
  assert np.array_equal(np.sort(real), np.arange(len(segs)))  # every segment exactly once per epoch
  starts = []
  for run in batches.reshape(-1, m):  # rows [r·m, (r+1)·m) of every batch
    r = run[run >= 0]
    if not len(r):
      continue  # an all-padding run: a stream (or the last batch) has no run left
    assert r[0] % m == 0 and np.array_equal(run[:len(r)], r[0] + np.arange(len(r)))  # consecutive stream segments
    assert len(r) == m or r[-1] == len(segs) - 1  # only the stream's last run is short
    starts.append(r[0])
  assert len(starts) == n_runs
  # Only the stream's last run and the -1 runs of an uneven last batch / stream are padding.
  assert (batches < 0).sum() == batches.size - len(segs)
  assert (batches < 0).sum() < m + (b - 1) * m
  assert header["layout"] == layout and header["shuffle"] == (layout == "packed")
  assert header["segmentation"] == "stream" and header["consecutive_segments"] == m and header["streams"] == b
  assert header["num_segments"] == len(segs) and header["num_runs"] == n_runs
  assert header["batches_per_epoch"] == len(batches) and header["kind"] == "consecutive"
  assert header["real_token_fraction"] == pytest.approx(_brute_real_fraction(corpus, segs, batches), abs=1e-12)
  if layout == "packed":  # adjacent runs in stream order
    assert np.array_equal(np.asarray(starts), np.arange(n_runs) * m)
  again = consecutive.make_plan(corpus, config, progress=False)[1]
  assert np.array_equal(again, batches)  # deterministic


def _original_keep_order_batches(runs, num_shards):
  """The original's micro-batches with --keep-order: an independent re-statement of fairseq's
  SequentialShardedIterator (num_comb_shards=1, fill_value=[]) over the unshuffled list of runs; micro-batch
  i concatenates every shard's i-th item (one shard per GPU)."""
  n = len(runs)
  per_shard = n // num_shards + (1 if n % num_shards else 0)
  shards = []
  for shard_id in range(num_shards):
    piece = itertools.islice(runs, shard_id * per_shard, min(n, (shard_id + 1) * per_shard))
    shards.append([item for _, item in itertools.zip_longest(range(per_shard), piece, fillvalue=[])])
  return [[item for shard in shards for item in shard[i]] for i in range(per_shard)]


@pytest.mark.parametrize("num_runs,b", [(1, 1), (5, 1), (7, 2), (8, 2), (10, 3), (11, 4), (3, 5), (9, 3)])
def test_stream_layout_is_the_original_keep_order_iterator(num_runs, b):
  m, seg_len = 2, 2
  # Corpus length so that the stream has exactly `num_runs` runs; odd run counts end with a short run.
  n_tokens = (2 * num_runs - (num_runs % 2)) * seg_len - 1
  corpus = _corpus(lens=[n_tokens // 3, n_tokens - n_tokens // 3])
  config = _config(**{"data.segment_len": seg_len, "trime.consecutive_segments": m, "train.batch_size": b * m})
  header, batches = consecutive.make_plan(corpus, config, progress=False)
  assert header["num_runs"] == num_runs
  # The original's runs: fairseq batches of m consecutive samples (segments) of the unshuffled stream.
  segs = list(range(header["num_segments"]))
  runs = [segs[i:i + m] for i in range(0, len(segs), m)]
  want = _original_keep_order_batches(runs, b)
  assert len(batches) == len(want)
  for got, w in zip(batches, want):
    got_runs = got.reshape(b, m)
    assert [int(s) for s in got[got >= 0]] == w  # same segments, same order
    # Each stream's slot holds one run (or nothing), padded only at its end.
    for run in got_runs:
      r = run[run >= 0]
      assert np.array_equal(run[:len(r)], r)


def _original_gpu_forwards(runs, gpus, update_freq):
  """[update][gpu] -> that GPU's forwards (each a run, [] for the iterator's fill) in the original with --keep-order
  on `gpus` GPUs: an independent re-statement of the fork's SequentialShardedIterator (num_comb_shards=1, shard g
  = the g-th contiguous piece of the unshuffled list) followed by fairseq's GroupedIterator(update_freq) per GPU."""
  n = len(runs)
  per_shard = n // gpus + (1 if n % gpus else 0)
  out = []
  for g in range(gpus):
    piece = itertools.islice(runs, g * per_shard, min(n, (g + 1) * per_shard))
    items = [item for _, item in itertools.zip_longest(range(per_shard), piece, fillvalue=[])]
    out.append([items[i:i + update_freq] for i in range(0, len(items), update_freq)])
  return [[out[g][u] for g in range(gpus)] for u in range(len(out[0]))]


@pytest.mark.parametrize("num_runs,gpus,update_freq", [(8, 2, 2), (9, 2, 2), (7, 4, 1), (10, 2, 3), (3, 4, 1),
                                                       (13, 3, 2)])
def test_stream_layout_for_several_gpus_is_each_gpus_contiguous_shard_update_by_update(tmp_path, num_runs, gpus,
                                                                                      update_freq):
  """trime.consecutive_gpus = G (wiki103_150m: 2 GPUs × --update-freq 2, enwik8_38m: 4 × 1): update u trains on
  forwards u·F … u·F + F − 1 of each GPU's contiguous shard, as the original with --keep-order does; with G = 1 an
  update would hold A adjacent runs."""
  m, seg_len, accum = 2, 2, gpus * update_freq
  n_tokens = (2 * num_runs - (num_runs % 2)) * seg_len - 1
  corpus = _corpus(lens=[n_tokens // 3, n_tokens - n_tokens // 3])
  config = _config(**{"data.segment_len": seg_len, "trime.consecutive_segments": m, "train.batch_size": m,
                      "train.grad_accum": accum, "trime.consecutive_gpus": gpus, "trime.batching": "consecutive",
                      "trime.batch_plan": str(tmp_path / "plan")})
  header, batches = consecutive.make_plan(corpus, config, progress=False)
  assert header["num_runs"] == num_runs and (header["gpus"], header["grad_accum"]) == (gpus, accum)
  segs = list(range(header["num_segments"]))
  runs = [segs[i:i + m] for i in range(0, len(segs), m)]
  want = _original_gpu_forwards(runs, gpus, update_freq)
  assert len(batches) == len(want) * accum  # an epoch is whole updates
  batch_plan.save(str(tmp_path / "plan"), header, batches)
  source = BatchSource(corpus, config)
  for u, per_gpu in enumerate(want):
    got = source.indices(u)  # [grad_accum, batch_size]
    for g, forwards in enumerate(per_gpu):
      for f in range(update_freq):
        row = got[g * update_freq + f]
        assert [int(x) for x in row[row >= 0]] == (forwards[f] if f < len(forwards) else []), (u, g, f)
  assert np.array_equal(np.sort(batches[batches >= 0]), np.arange(len(segs)))  # every segment once an epoch
  # The plan is refused by a run with another GPU count (or, for G > 1, another grad_accum).
  for other in ({"trime.consecutive_gpus": 1, "train.grad_accum": accum},
                {"trime.consecutive_gpus": gpus, "train.grad_accum": 2 * accum}):
    with pytest.raises(DataError, match="it was written for trime.consecutive_gpus="):
      BatchSource(corpus, _config(**{"data.segment_len": seg_len, "trime.consecutive_segments": m,
                                     "train.batch_size": m, "trime.batching": "consecutive",
                                     "trime.batch_plan": str(tmp_path / "plan"), **other}))


def test_consecutive_gpus_is_checked_with_the_batching_it_describes():
  from trime_jax.train_config import validate_config

  base = {"data.segmentation": "stream", "trime.memory": "long", "trime.consecutive_segments": 2,
          "train.batch_size": 2, "trime.batching": "consecutive", "trime.batch_plan": "p"}
  cases = [({"train.grad_accum": 3, "trime.consecutive_gpus": 2}, "must be >= 1 and divide train.grad_accum=3"),
           ({"train.grad_accum": 2, "trime.consecutive_gpus": 2, "trime.consecutive_layout": "packed"},
            "needs trime.consecutive_layout='stream', got 'packed'"),
           ({"train.grad_accum": 2, "trime.consecutive_gpus": 2, "model.backbone": "srupp"},
            "a stateful backbone"),
           # a Transformer's run of one segment is the segment itself: TrimeLM, not TrimeLM_long (an SRU++'s long
           # memory is the stream's previous segment, so m = 1 is its layout)
           ({"trime.consecutive_segments": 1}, "consecutive_segments=1 is local memory"),
           ({"trime.consecutive_segments": 1, "trime.batching": "random"}, "consecutive_segments=1 is local memory")]
  for kw, message in cases:
    with pytest.raises(ConfigError, match=message):
      validate_config(_config(**{**base, **kw}))
  with pytest.raises(ConfigError, match="must be >= 1 and divide"):
    consecutive.make_plan(_corpus(), _config(**base, **{"train.grad_accum": 3, "trime.consecutive_gpus": 2}),
                          progress=False)


def test_the_paper_long_configs_shard_the_stream_as_their_gpus():
  import importlib

  for name, gpus in (("wiki103_150m", 2), ("enwik8_38m", 4)):
    c = importlib.import_module(f"trime_jax.configs.{name}").get_config()
    assert c.trime.consecutive_gpus == gpus and c.train.grad_accum % gpus == 0


def test_stream_batches_continue_the_streams_across_updates(tmp_path):
  corpus = _corpus()
  config = _config(**{"trime.batching": "consecutive", "trime.batch_plan": str(tmp_path / "plan"),
                      "train.grad_accum": 2})
  header, batches = consecutive.make_plan(corpus, config, progress=False)
  batch_plan.save(str(tmp_path / "plan"), header, batches)
  source = BatchSource(corpus, config)
  p = len(batches)
  flat = np.concatenate([source.indices(step) for step in range(p + 1)])  # more than one epoch
  assert np.array_equal(flat, batches[np.arange(len(flat)) % p])  # stored order, every epoch
  # Micro-batch i+1 holds the run after micro-batch i's in every stream (within one epoch).
  for i in range(p - 1):
    cur, nxt = batches[i].reshape(2, 3), batches[i + 1].reshape(2, 3)
    for k in range(2):
      if nxt[k, 0] >= 0:
        assert nxt[k, 0] == cur[k, 0] + 3


def test_stream_resets_at_a_padded_epoch_end(tmp_path):
  """An epoch whose last update is padded: a stateful model's rows start over there (padding, then the next
  epoch's first runs), and nowhere inside an epoch where a stream continues."""
  corpus = _corpus()
  # one segment per run, as a stateful model (SRU++) reads its streams: row k of micro-batch i + 1 continues row k
  # of micro-batch i
  kw = {"trime.batching": "consecutive", "trime.batch_plan": str(tmp_path / "plan"), "trime.consecutive_segments": 1,
        "trime.memory": "local"}
  header, batches = consecutive.make_plan(corpus, _config(**kw), progress=False)
  batch_plan.save(str(tmp_path / "plan"), header, batches)
  p = len(batches)
  accum = next(a for a in range(2, p) if p % a)
  source = BatchSource(corpus, _config(**kw, **{"train.grad_accum": accum}))
  per_epoch = -(-p // accum)
  for step in range(2 * per_epoch + 1):
    idx = source.indices(step)
    flat_before = np.concatenate([source.indices(s) for s in range(step)]) if step else np.zeros((0, idx.shape[1]))
    prev = np.concatenate([flat_before[-1:] if step else np.full((1, idx.shape[1]), -2), idx[:-1]])
    want = (idx < 0) | (prev < 0) | (idx != prev + 1)  # the row does not continue the micro-batch before it
    got = source.resets(step, idx)
    np.testing.assert_array_equal(got, want)
    if step % per_epoch == 0:  # an epoch's first update: every row starts over
      assert got[0].all(), (step, got)
  assert (~source.resets(1, source.indices(1))).any()  # streams do continue inside an epoch


@pytest.mark.parametrize("layout", ["stream", "packed"])
def test_plan_rows_are_the_layout_of_the_long_loss(layout):
  """In a gathered batch, trime_nll(memory="long", m) lets a token see exactly the earlier tokens of its run of m
  consecutive stream segments: across documents in the stream layout, within its own document (per-token
  document ids) in the packed layout."""
  corpus = _corpus()
  _, batches = consecutive.make_plan(corpus, _config(**{"trime.consecutive_layout": layout}), progress=False)
  segs = D.make_segments(corpus, 4, "stream")
  doc_of = corpus.doc_ids()
  for rows in batches:
    _, targets = D.gather_segments(corpus, segs, rows)
    valid = targets.reshape(-1) >= 0
    pos = (segs.start[np.maximum(rows, 0)][:, None] + np.arange(4)).reshape(-1)
    pos = np.where(valid, pos, 0)
    docs = D.segment_documents(corpus, segs, rows) if layout == "packed" else None  # what BatchSource feeds
    meta = loss.batch_meta(jnp.asarray(targets), "long", 3, documents_BxL=docs)
    flat = scoring.TokenMeta(*(x.reshape(-1) for x in meta))
    got = np.asarray(scoring.visible(flat, flat, True, False))
    run = np.repeat(np.arange(len(rows)) // 3, 4)
    want = (run[:, None] == run[None, :]) & (pos[None, :] < pos[:, None]) & valid[None, :]
    if layout == "packed":
      want &= doc_of[pos][:, None] == doc_of[pos][None, :]
    assert np.array_equal(got[valid], want[valid])  # (padding queries score nothing)
    assert np.array_equal(targets.reshape(-1)[valid], corpus.tokens[pos[valid]])
  if layout == "stream":  # the tiny corpus's runs do cross documents
    runs = batches.reshape(-1, 3)
    assert any(len(set(segs.doc[r[r >= 0]])) > 1 for r in runs)


@pytest.fixture(scope="module")
def wikitext_mini_train():
  from trime_jax.configs import wikitext_mini
  return corpora.load_splits(wikitext_mini.get_config().data).train  # ../shared/data/wikitext-2


@pytest.mark.parametrize("layout", ["stream", "packed"])
@pytest.mark.parametrize("name", ["wiki103_150m", "wikitext_mini_long"])
def test_real_token_fraction_on_wikitext_mini(wikitext_mini_train, name, layout):
  """The paper configs' plan shape on wikitext-mini wastes < 1% of the row slots (document-padded runs wasted
  62% at L = 150, m = 60)."""
  import importlib
  from trime_jax.configs import wikitext_mini
  config = importlib.import_module(f"trime_jax.configs.{name}").get_config()
  seg_len = config.data.segment_len
  config.data = wikitext_mini.get_config().data
  config.data.segment_len, config.data.segmentation = seg_len, "stream"
  config.trime.consecutive_layout = layout
  gpus = config.trime.consecutive_gpus if layout == "stream" else 1  # the original's GPUs: its stream layout only
  config.trime.consecutive_gpus = gpus
  corpus = wikitext_mini_train
  header, batches = consecutive.make_plan(corpus, config, progress=False)
  segs = D.make_segments(corpus, seg_len, "stream")
  m = config.trime.consecutive_segments
  runs = batches.reshape(-1, m)
  empty = int((runs < 0).all(axis=1).sum())
  if gpus == 1:
    assert header["real_token_fraction"] >= 0.99
  else:  # each GPU's shard ends on a whole update: under one update's forwards of every GPU are empty runs
    assert empty < config.train.grad_accum * (config.train.batch_size // m) + gpus, (empty, len(runs))
    assert header["real_token_fraction"] >= 1 - (empty + 1) / len(runs)
  assert header["real_token_fraction"] == pytest.approx(_brute_real_fraction(corpus, segs, batches), abs=1e-12)
  assert header["real_token_fraction"] == pytest.approx(len(corpus) / (batches.size * seg_len), abs=1e-12)


def test_plan_errors_and_batch_source_reads_it(tmp_path):
  corpus = _corpus()
  with pytest.raises(ConfigError, match="segmentation"):
    consecutive.make_plan(corpus, _config(**{"data.segmentation": "document"}), progress=False)
  with pytest.raises(ConfigError, match="multiple"):
    consecutive.make_plan(corpus, _config(**{"train.batch_size": 8}), progress=False)
  with pytest.raises(ConfigError, match="consecutive_layout"):
    consecutive.make_plan(corpus, _config(**{"trime.consecutive_layout": "padded"}), progress=False)
  config = _config(**{"trime.batching": "consecutive", "trime.batch_plan": str(tmp_path / "plan"),
                      "train.grad_accum": 2, "trime.consecutive_layout": "packed"})
  header, batches = consecutive.make_plan(corpus, config, progress=False)
  batch_plan.save(str(tmp_path / "plan"), header, batches)
  source = BatchSource(corpus, config)
  got = source(3)
  plan = batch_plan.load(str(tmp_path / "plan"))
  want = D.gather_segments(corpus, source.segments, np.concatenate([plan.rows(6), plan.rows(7)]))[1]
  assert np.array_equal(got["targets"].reshape(-1, 4), want)
  # Epochs are whole updates (fairseq's): the last update of an epoch is padded, the next epoch starts afresh.
  n = plan.num_batches
  accum = next(a for a in range(2, n) if n % a)
  source = BatchSource(corpus, _config(**{"trime.batching": "consecutive", "trime.batch_plan": str(tmp_path / "plan"),
                                         "train.grad_accum": accum, "trime.consecutive_layout": "packed"}))
  per_epoch = -(-n // accum)
  epoch0 = np.concatenate([source.indices(s) for s in range(per_epoch)])
  np.testing.assert_array_equal(epoch0[:n], np.stack([plan.rows(j) for j in range(n)]))
  assert len(epoch0) - n == accum - n % accum and np.all(epoch0[n:] == -1)
  np.testing.assert_array_equal(source.indices(per_epoch)[0], plan.rows(n))
  with pytest.raises(DataError, match="consecutive_segments"):
    BatchSource(corpus, _config(**{"trime.batching": "consecutive", "trime.batch_plan": str(tmp_path / "plan"),
                                   "trime.consecutive_segments": 2}))


def _wiki_dir(tmp_path):
  return wikitext_dir(tmp_path)


def _cli(*args):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=120)


def test_make_batches_cli(tmp_path):
  data = _wiki_dir(tmp_path)
  cfg = wikitext_config_file(tmp_path, data, "c.trime.consecutive_segments = 2")
  out = _cli("trime_jax.launch.make_batches", f"--config={cfg}", "--kind=consecutive", f"--out={tmp_path / 'plan'}")
  assert out.returncode == 0, out.stderr
  plan = batch_plan.load(str(tmp_path / "plan"))
  h = plan.header
  assert h["kind"] == "consecutive" and h["consecutive_segments"] == 2 and h["layout"] == "stream"
  assert h["shuffle"] is False and h["num_batches"] == h["batches_per_epoch"] == len(plan.batches)
  train = corpora.load_splits(_config(**{"data.corpus": "wikitext", "data.path": str(data)}).data).train
  assert h["real_token_fraction"] == pytest.approx(len(train) / (plan.batches.size * 8), abs=1e-12)
  assert f"real-token fraction {h['real_token_fraction']:.4f}" in out.stdout


def test_make_batches_keeps_the_same_plan_and_refuses_another_without_overwrite(tmp_path):
  """A rerun of the same command keeps plan.json and batches.npy as they are (a training that reads the plan
  resumes only on its digest, and BM25's header records its timing); another plan over it (here another batch
  size) is refused before planning, with the field named, unless --overwrite; --overwrite replaces a file."""
  data = _wiki_dir(tmp_path)
  cfg = wikitext_config_file(tmp_path, data)
  plan_dir = tmp_path / "plan"
  args = ("trime_jax.launch.make_batches", f"--config={cfg}", "--kind=bm25", f"--out={plan_dir}")
  first = _cli(*args)
  assert first.returncode == 0, first.stderr
  before = {n: (plan_dir / n).stat().st_mtime_ns for n in ("plan.json", "batches.npy")}
  digest = batch_plan.load(str(plan_dir)).digest()
  again = _cli(*args)
  assert again.returncode == 0, again.stderr
  assert f"unchanged: {plan_dir} already holds this plan" in again.stdout
  assert {n: (plan_dir / n).stat().st_mtime_ns for n in before} == before
  assert batch_plan.load(str(plan_dir)).digest() == digest
  other = _cli(*args, "--config.train.batch_size=8")
  assert other.returncode == 2 and other.stderr.strip().splitlines()[-1].startswith("error: ")
  assert "batch_size 4 != 8" in other.stderr and "--overwrite" in other.stderr and "bm25:" not in other.stdout
  assert batch_plan.load(str(plan_dir)).digest() == digest  # untouched
  other_k = _cli(*args, "--config.trime.bm25_k=3")  # BM25's own settings are compared before planning too
  assert other_k.returncode == 2 and "k 20 != 3" in other_k.stderr and "bm25:" not in other_k.stdout
  # a replacement killed between its renames left the plan at <plan>.old: put back first, so another plan is
  # still refused (it replaced it unasked: nothing was at --out to compare)
  os.replace(plan_dir, str(plan_dir) + ".old")
  other = _cli(*args, "--config.train.batch_size=8")
  assert other.returncode == 2 and "batch_size 4 != 8" in other.stderr, other.stderr
  assert batch_plan.load(str(plan_dir)).digest() == digest and not os.path.exists(str(plan_dir) + ".old")
  replaced = _cli(*args, "--config.train.batch_size=8", "--overwrite")
  assert replaced.returncode == 0, replaced.stderr
  assert batch_plan.load(str(plan_dir)).batch_size == 8
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  onto_file = _cli("trime_jax.launch.make_batches", f"--config={cfg}", "--kind=bm25", f"--out={a_file}", "--overwrite")
  assert onto_file.returncode == 0, onto_file.stderr
  assert batch_plan.load(str(a_file)).batch_size == 4
  # One writer per --out: while another process holds the plan's lock, make_batches is refused naming it
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time\nfrom trime_jax.batching import plan\n"
       f"with plan.lock({str(plan_dir)!r}):\n  print('held', flush=True)\n  time.sleep(60)\n"],
      stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
  try:
    assert holder.stdout.readline().strip() == "held"
    busy = _cli(*args, "--overwrite")
  finally:
    holder.kill()
    holder.wait()
  assert busy.returncode == 2 and "bm25:" not in busy.stdout, busy.stderr  # refused before planning, not at the write
  assert busy.stderr.strip().splitlines()[-1].startswith(f"error: batch plan {plan_dir} is in use by process "
                                                          f"{holder.pid} ")
  assert batch_plan.load(str(plan_dir)).batch_size == 8  # untouched


def test_a_plan_changed_after_it_was_written_is_refused(tmp_path):
  """plan.json holds the SHA-256 of batches.npy's array: a file changed in place (same shape, one index
  edited) is one DataError on load, not a training on other batches; a plan from before the checksum is still
  read, its indices checked against num_segments; a rerun's comparison (differences) ignores the field."""
  header = {"kind": "consecutive", "num_segments": 10, "seed": 0}
  batches = np.arange(10, dtype=np.int64).reshape(5, 2)
  path = batch_plan.save(str(tmp_path / "plan"), header, batches)
  plan = batch_plan.load(path)
  assert len(plan.header["batches_sha256"]) == 64 and not os.path.exists(path + ".lock")
  assert batch_plan.differences(plan, header, batches) == []
  assert batch_plan.differences(plan, header, batches[::-1]) == ["the batches"]
  arr = np.load(os.path.join(path, "batches.npy"), mmap_mode="r+")
  arr[2, 1] = 3  # a duplicate index, still in range: only the checksum sees it
  arr.flush()
  del arr
  rewrite = re.escape(batch_plan.REWRITE) + "$"  # make_batches' --overwrite: a plain rerun reads the damaged plan
  with pytest.raises(DataError, match=r"batches.npy does not match its checksum in plan.json .*; " + rewrite):
    batch_plan.load(path)
  # an edited header (a field changed after the plan was written): refused, before the batches are read
  meta = json.load(open(os.path.join(path, "plan.json")))
  assert len(meta["header_sha256"]) == 64
  json.dump({**meta, "seed": 1}, open(os.path.join(path, "plan.json"), "w"))
  with pytest.raises(DataError, match=r"plan.json does not match its checksum \(the file was edited after it was "
                                      r"written: .*\); " + rewrite):
    batch_plan.load(path)
  # A plan written before the checksums: read as it is, but an index beyond num_segments is refused
  del meta["batches_sha256"], meta["header_sha256"]
  json.dump(meta, open(os.path.join(path, "plan.json"), "w"))
  old = batch_plan.load(path)
  assert batch_plan.differences(old, header, old.batches) == []
  np.save(os.path.join(path, "batches.npy"), np.where(batches == 7, 10, batches))
  with pytest.raises(DataError, match=r"holds segment indices in \[0, 10\], outside \[-1, 10\) \(plan.json's "
                                      r"num_segments\); " + rewrite):
    batch_plan.load(path)


def test_a_plan_replacement_killed_between_its_renames_keeps_the_previous_plan(tmp_path):
  """Replacing a plan (make_batches --overwrite) moves the old one to <plan>.old, then the new one into place: a
  kill between leaves the old one, which a reader names and the next writer puts back before it replaces it."""
  header = {"kind": "consecutive", "num_segments": 10, "seed": 0}
  batches = np.arange(10, dtype=np.int64).reshape(5, 2)
  path = batch_plan.save(str(tmp_path / "plan"), header, batches)
  os.replace(path, path + ".old")  # the state such a kill leaves
  with pytest.raises(DataError, match=rf"^batch plan {re.escape(path)} was being replaced when its writer stopped: "
                                      rf"the previous plan is at {re.escape(path)}.old"):
    batch_plan.load(path)
  batch_plan.save(path, header, batches[::-1])
  assert sorted(os.listdir(tmp_path)) == ["plan"]
  np.testing.assert_array_equal(batch_plan.load(path).batches, batches[::-1])


def test_a_plan_where_nothing_can_be_written_is_one_error(tmp_path, monkeypatch):
  """A read-only location (EROFS here; this suite runs as root, which file permissions do not stop): the lock
  file cannot be created, which is one UnwritableError naming it, not an OSError traceback; nothing written."""
  import errno

  from trime_jax.runtime.lock import UnwritableError

  real_open = os.open

  def read_only(path, *a, **k):
    if str(path).endswith(".lock"):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return real_open(path, *a, **k)

  monkeypatch.setattr(os, "open", read_only)
  out = tmp_path / "plan"
  with pytest.raises(UnwritableError, match=rf"^batch plan {re.escape(str(out))} cannot be written: its lock file "
                                            rf"{re.escape(str(out))}.lock cannot be created \(Read-only file system\)"):
    batch_plan.save(str(out), {"num_segments": 2}, np.arange(2).reshape(1, 2))
  assert os.listdir(tmp_path) == []


def test_another_users_lock_file_still_names_its_holder(tmp_path, monkeypatch):
  """A lock file this process may not open for writing (another user's, 0644) is opened read-only: flock works
  on it, so a running holder is still refused by name (not taken for a read-only location), a free one held."""
  import errno
  import fcntl

  from trime_jax.runtime.lock import DirLock, LockedError

  path = tmp_path / "plan.lock"
  path.write_text('{"pid": 4242, "host": "elsewhere", "since": "2026-12-04T00:00:00"}')
  real_open = os.open

  def not_ours(p, flags, *a, **k):
    if str(p) == str(path) and flags & (os.O_RDWR | os.O_WRONLY):
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
    return real_open(p, flags, *a, **k)

  monkeypatch.setattr(os, "open", not_ours)
  with DirLock(str(path), "batch plan x"):  # free: held (read-only descriptor), the file's contents left as they are
    assert json.loads(path.read_text())["pid"] == 4242
  path.write_text('{"pid": 4242, "host": "elsewhere", "since": "2026-12-04T00:00:00"}')
  holder = real_open(str(path), os.O_RDONLY)
  fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other user's run, holding it
  try:
    monkeypatch.setattr(DirLock, "_held", {})
    with pytest.raises(LockedError, match=r"^batch plan x is in use by process 4242 "):
      with DirLock(str(path), "batch plan x"):
        pass
  finally:
    os.close(holder)


# ----------------------------------------------------------------------------------------------------------
# Long-term memory at evaluation
# ----------------------------------------------------------------------------------------------------------
BLOCK, CONTEXT = 16, 8
TAUS = (0.4, 1.0)
CACHE = ((0.2, 0.5), (0.3, 2.0))
POINTS = ((evaluate.NONE,) + tuple(evaluate.Point("trime_local", tau=t) for t in TAUS)
          + tuple(evaluate.Point("cache", cache_lambda=lam, cache_theta=theta) for lam, theta in CACHE))


def _lines_corpus(seed=4):
  """`_corpus()` cut into lines (`</s>` = id 0) of 1-12 tokens: complete-mode blocks, some longer than S = 8."""
  rng = np.random.default_rng(seed)
  base = _corpus()
  docs = []
  for d in range(base.num_docs):
    toks = np.array(base.tokens[base.doc_starts[d]:base.doc_starts[d + 1]])
    cut = 0
    while cut < len(toks):
      cut += int(rng.integers(1, 13))
      toks[min(cut, len(toks)) - 1] = base.vocab.eos  # every document ends a line
    docs.append(toks)
  return D.Corpus.from_docs(docs, base.vocab, "tiny-lines")


class Tiny:
  """A tiny random model on `_corpus()` (complete mode: `_lines_corpus()`); evaluations are memoised (each new
  shape is a jit compilation)."""

  def __init__(self, break_mode="none"):
    self.break_mode = break_mode
    self.corpus = _corpus() if break_mode == "none" else _lines_corpus()
    cfg = specs.model_config(_config(), vocab_size=len(self.corpus.vocab))
    self.model = TransformerLM(cfg, rngs=nnx.Rngs(params=3))
    self.graphdef, self.params = nnx.split(self.model, nnx.Param)
    self.wins = D.eval_windows(self.corpus, len(self.corpus), BLOCK, CONTEXT, break_mode)
    self.outs, self.key_of = [], {}  # per window: float64 (logits, keys, targets); key of each scored token
    forward = jax.jit(lambda params, x: nnx.merge(self.graphdef, params)(x))
    for w in self.wins:
      inputs, targets, _ = D.window_batch(self.corpus, [w], BLOCK)
      logits, keys = forward(self.params, inputs)
      self.outs.append((np.float64(logits[0]), np.float64(keys[0]), targets[0]))
      for p in range(w.score_start, w.end):
        self.key_of[p] = self.outs[-1][1][p - w.start]
    self.cache = {}

  def run(self, mem_size, reset=True, streams=3, layout="disjoint"):
    """Mean nll per point from `evaluate.evaluate`."""
    if (mem_size, reset, streams, layout) not in self.cache:
      res = evaluate.evaluate(self.graphdef, self.params, self.corpus, POINTS, block_len=BLOCK,
                              context_window=CONTEXT, streams=streams,
                              long_term=evaluate.StoreSpec(mem_size, reset, layout), break_mode=self.break_mode).scores
      assert all(r.tokens == len(self.corpus) for r in res)
      self.cache[mem_size, reset, streams, layout] = np.array([r.nll for r in res])
    return self.cache[mem_size, reset, streams, layout]

  def brute_force(self, mem_size, reset, layout="disjoint"):
    """Mean nll per variant in float64: each scored token sees the earlier tokens of its window and a store of
    earlier scored tokens (of its own document if `reset`), each keyed from its scoring window. disjoint: the
    tokens from `mem_size` + CONTEXT before the window's first scored token up to the window's start (the
    original's store of its last mem_size + CONTEXT scored tokens, without counting the window's own tokens
    twice); original: the last `mem_size` scored tokens before the window's first scored token, the window's
    context tokens included (so they count twice, with two keys: SequenceScorer's update_mem / retrieve_logits)."""
    corpus, doc = self.corpus, self.corpus.doc_ids()
    d = self.outs[0][1].shape[-1]
    totals = np.zeros(1 + len(TAUS) + len(CACHE))
    for w, (logits, keys, targets) in zip(self.wins, self.outs):
      for p in range(w.score_start, w.end):
        i, y = p - w.start, int(corpus.tokens[p])
        if layout == "original":
          store_range = range(max(0, w.score_start - mem_size), w.score_start)  # empty for mem_size 0
        else:
          lo = max(0, w.score_start - CONTEXT - mem_size) if mem_size else w.start  # 0: local memory only
          store_range = range(lo, w.start)
        store = [q for q in store_range if not reset or doc[q] == doc[p]]
        mk = np.array([keys[j] for j in range(i)] + [self.key_of[q] for q in store]).reshape(-1, d)
        mt = np.array([targets[j] for j in range(i)] + [corpus.tokens[q] for q in store], np.int64)
        lp = logits[i] - ref.logsumexp(logits[i])
        row = [-lp[y]]
        for tau in TAUS:
          row.append(ref.memory_nll(logits[i:i + 1], keys[i:i + 1], np.array([y]), mk, mt,
                                    np.ones((1, len(mt)), bool), tau)[0])
        for lam, theta in CACHE:
          if not len(mt):
            row.append(-lp[y])
            continue
          s = theta * (mk @ keys[i]) / np.sqrt(d)
          pc = np.exp(s - s.max())
          row.append(-np.log((1 - lam) * np.exp(lp[y]) + lam * pc[mt == y].sum() / pc.sum()))
        totals += row
    return totals / len(corpus)


@pytest.fixture(scope="module")
def tiny():
  return Tiny()


@pytest.mark.parametrize("mem_size,reset", [(6, True), (25, True), (10_000, True), (10_000, False)])
def test_long_memory_equals_brute_force(tiny, mem_size, reset):
  """The ring buffer wraps (capacity mem_size + context_window < 179 tokens) for the small sizes."""
  np.testing.assert_allclose(tiny.run(mem_size, reset), tiny.brute_force(mem_size, reset), rtol=2e-5)


@pytest.fixture(scope="module")
def tiny_complete():
  return Tiny("complete")


@pytest.mark.parametrize("mem_size,reset,streams", [(0, True, 3), (6, True, 3), (25, False, 3), (25, False, 1)])
def test_complete_mode_long_memory_equals_brute_force(tiny_complete, mem_size, reset, streams):
  """fairseq's --sample-break-mode complete windows (the released 247M evaluation): blocks of whole lines with
  varying context, some longer than S (the input grows to fit them), the store reaching mem_size + context
  before each block's first scored token."""
  t = tiny_complete
  assert any(w.end - w.score_start > BLOCK - CONTEXT for w in t.wins)
  assert any(0 < w.score_start - w.start < CONTEXT for w in t.wins if w.start > 0)  # trimmed contexts
  np.testing.assert_allclose(t.run(mem_size, reset, streams), t.brute_force(mem_size, reset), rtol=2e-5)


@pytest.mark.parametrize("mem_size,reset,streams", [(6, False, 3), (25, True, 3), (40, False, 1), (10_000, False, 3)])
def test_original_layout_equals_brute_force(tiny, mem_size, reset, streams):
  """The release's store (eval.long_term_layout="original"): the last mem_size scored tokens, the window's
  context included; the ring buffer wraps for the small sizes."""
  np.testing.assert_allclose(tiny.run(mem_size, reset, streams, "original"),
                             tiny.brute_force(mem_size, reset, "original"), rtol=2e-5)


@pytest.mark.parametrize("mem_size,reset,streams", [(25, False, 3), (6, True, 1)])
def test_complete_mode_original_layout_equals_brute_force(tiny_complete, mem_size, reset, streams):
  t = tiny_complete
  np.testing.assert_allclose(t.run(mem_size, reset, streams, "original"),
                             t.brute_force(mem_size, reset, "original"), rtol=2e-5)


def test_the_layouts_differ_by_the_context_tokens(tiny):
  """Same tokens in reach (original M = disjoint mem_size + CONTEXT), but the original counts the window's
  context twice: the numbers differ; with no context window they would not."""
  orig, disj = tiny.run(25 + CONTEXT, False, 3, "original"), tiny.run(25, False, 3, "disjoint")
  assert np.abs(orig[1:] - disj[1:]).min() > 1e-4
  assert orig[0] == pytest.approx(disj[0], rel=1e-6)


def test_memory_sizes_and_document_resets_change_the_numbers(tiny):
  local, small, full, across = tiny.run(0), tiny.run(6), tiny.run(10_000), tiny.run(10_000, reset=False)
  for a, b in [(local, small), (small, full), (full, across)]:
    assert np.abs(a[1:] - b[1:]).min() > 1e-3  # every memory variant sees the difference
    assert a[0] == pytest.approx(b[0], rel=1e-6)  # the vanilla softmax does not


def test_streams_do_not_change_the_numbers(tiny):
  for s in (1, 4):
    np.testing.assert_allclose(tiny.run(25, streams=s), tiny.run(25), rtol=1e-5)
  # mem_size=0 is the plain local evaluation: every window scored on its own, against float64.
  np.testing.assert_allclose(tiny.run(0), tiny.brute_force(0, True), rtol=2e-5)
  assert POINTS[1].name == "trime_local(tau=0.4)"


@pytest.mark.parametrize("streams,mem_size,reset", [(1, 25, True), (3, 25, True), (4, 40, False), (9, 6, True)])
def test_stream_schedule_scores_every_window_once(streams, mem_size, reset):
  corpus = _corpus()
  wins = D.windows(len(corpus), BLOCK, CONTEXT)
  win, score = D.stream_schedule(wins, corpus.doc_starts, streams, mem_size, reset, context_window=CONTEXT)
  assert win.shape[1] == streams
  assert np.array_equal(np.sort(win[score]), np.arange(len(wins)))
  doc = corpus.doc_ids()
  for s in range(streams):
    run = win[:, s][win[:, s] >= 0]
    assert np.array_equal(run, run[0] + np.arange(len(run)))  # contiguous windows, warm-up first
    assert np.all(score[:len(run), s] == (run >= run[score[:len(run), s]].min()))
    if s and len(run):  # the warm-up covers what the first scored window's store needs
      k = run[score[:len(run), s]].min()
      lo = max(0, wins[k].start - mem_size)
      if reset:
        lo = max(lo, corpus.doc_starts[doc[wins[k].score_start]])
      assert wins[run[0]].score_start <= lo or run[0] == 0


def test_sweep_table_reads_rows_written_before_the_config_names():
  """Rows of --output files written while evaluate.Point's λ / θ were the family-generic `lam` / `theta` read as
  rows with the config's names (cache_lambda, cache_theta, knn_lambda, knn_theta) do: --include keeps working."""
  new = [{"family": "cache", "params": {"cache_lambda": 0.3, "cache_theta": 1.0}, "nll": 1.0, "ppl": 2.0},
         {"family": "knnlm", "params": {"knn_lambda": 0.25, "knn_theta": 0.5}, "nll": 1.0, "ppl": 2.0}]
  old = [{"family": "cache", "params": {"lam": 0.3, "theta": 1.0}, "nll": 1.0, "ppl": 2.0},
         {"family": "knnlm", "params": {"lam": 0.25, "theta": 0.5}, "nll": 1.0, "ppl": 2.0}]
  assert sweep.sweep_table(old) == sweep.sweep_table(new)
  assert "2.000 (lambda=0.3,theta=1)" in sweep.sweep_table(new) and "(lambda=0.25,theta=0.5)" in sweep.sweep_table(new)
  assert evaluate.Point("knnlm", knn_lambda=0.25, knn_theta=0.5).name == "knnlm(lambda=0.25,theta=0.5)"


def test_memory_size_sweep_table_and_plot(tmp_path, capsys):
  """`evaluate_checkpoint(mem_sizes=...)` rows, the summary table, and `trime_jax.launch.eval --include --plot`."""
  config = _config(**{"data.corpus": "wikitext", "data.path": str(_wiki_dir(tmp_path)), "eval.block_len": 16,
                      "eval.context_window": 8, "eval.batch_size": 2, "eval.tune": True})
  vocab = corpora.load_splits(config.data).vocab
  model = TransformerLM(specs.model_config(config, vocab_size=len(vocab)), rngs=nnx.Rngs(params=0))
  export = exports.export(str(tmp_path / "export"), nnx.split(model, nnx.Param)[1], config, vocab)
  rows = evaluate.evaluate_checkpoint(config, export, mem_sizes=[0, 16], label="tiny")["rows"]
  n = 1 + len(evaluate.TAU_GRID)
  assert [r["mem_size"] for r in rows] == [0] * n + [16] * n
  assert [r["family"] for r in rows[:n]] == ["none"] + ["trime_local"] * (n - 1)
  assert rows[1]["variant"].startswith("trime_local(") and rows[n + 1]["params"] == {"tau": evaluate.TAU_GRID[0]}
  assert rows[1]["nll"] != pytest.approx(rows[n + 1]["nll"], rel=1e-4)  # the store changes the numbers
  assert sum(bool(r.get("best")) for r in rows) == 2 and all(r["model"] == "tiny" for r in rows)
  assert not any("<-" in r["variant"] for r in rows)  # the rows' variant is the point's name; tables mark the best
  assert sum("<- best" in line for line in evaluate.format_table(rows).splitlines()) == 2
  best = [r for r in rows if r.get("best")]
  assert [r["nll"] for r in best] == [min(r["nll"] for r in rows[1:n]), min(r["nll"] for r in rows[n + 1:])]
  printed = evaluate.format_table(rows).splitlines()  # the per-row table of launch.eval: sizes told apart
  assert printed[0].startswith("| mem_size | variant") and printed[2].startswith("| 0 ") and printed[-1].startswith(
      "| 16 ")
  assert not evaluate.format_table(rows[:n]).startswith("| mem_size")  # no long-term memory: no column
  # one size with a store: the column still says it (two runs' tables had rows of the same name, one with 16
  # tokens of long-term memory, one without)
  assert evaluate.format_table(rows[n:]).startswith("| mem_size") and "| 16 " in evaluate.format_table(rows[n:])
  table = sweep.sweep_table(rows)
  assert "| tiny | TRIME (local + long-term) |" in table
  none = f"{rows[0]['ppl']:.3f}"
  assert f"| tiny | none | {none} | {none} |" in table  # the model alone in every column, not an empty cell
  assert f"(tau={best[1]['params']['tau']:g})" in table  # the tuned parameter, from the rows' typed params
  unlabelled = sweep.sweep_table([{k: v for k, v in r.items() if k != "model"} for r in rows])
  assert "| (no --label) | none |" in unlabelled  # not an empty model column
  (tmp_path / "rows.json").write_text(json.dumps(rows))
  out = _cli("trime_jax.launch.eval", f"--include={tmp_path / 'rows.json'}", f"--plot={tmp_path / 'sweep.png'}")
  assert out.returncode == 0, out.stderr
  assert "| model |" in out.stdout and (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
  for bad, said in [("sweep.txt", "ends in .txt"), ("sweep", "has no extension")]:  # refused before any work
    out = _cli("trime_jax.launch.eval", f"--include={tmp_path / 'rows.json'}", f"--plot={tmp_path / bad}")
    assert out.returncode == 2 and said in out.stderr and ".png" in out.stderr, out.stderr
    assert not (tmp_path / bad).exists() and "| model |" not in out.stdout
  # a rerun replaces its own plot; another image a mistyped name points at is kept unless --overwrite (was replaced)
  inc = f"--include={tmp_path / 'rows.json'}"
  assert _cli("trime_jax.launch.eval", inc, f"--plot={tmp_path / 'sweep.png'}").returncode == 0
  (tmp_path / "photo.png").write_bytes(b"\x89PNG precious")
  out = _cli("trime_jax.launch.eval", inc, f"--plot={tmp_path / 'photo.png'}")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      f"error: --plot={tmp_path / 'photo.png'} exists and is not a plot an earlier evaluation wrote (which would be "
      "replaced): it is left as it is; move it away, choose another file name, or pass --overwrite"), out.stderr
  assert (tmp_path / "photo.png").read_bytes() == b"\x89PNG precious" and "| model |" not in out.stdout
  assert _cli("trime_jax.launch.eval", inc, f"--plot={tmp_path / 'photo.png'}", "--overwrite").returncode == 0
  assert sweep.PLOT_CREATOR.encode() in (tmp_path / "photo.png").read_bytes()
  (tmp_path / "photo.jpg").write_bytes(b"jpeg")  # a format that cannot carry the mark: --overwrite only, said so
  with pytest.raises(ConfigError, match=r"photo.jpg exists \(a .jpg image cannot record that a plot of ours wrote "
                                        r"it: only .png, .pdf, .svg, .ps and .eps are replaced without --overwrite\)"):
    sweep.check_plot_path(str(tmp_path / "photo.jpg"))
  sweep.check_plot_path(str(tmp_path / "photo.jpg"), overwrite=True)
  if shutil.which("xelatex"):  # a .pgf plot: accepted where its TeX system is, else refused before the evaluation
    sweep.check_plot_path(str(tmp_path / "sweep.pgf"))  # (it failed after it: xelatex not found)
  else:
    with pytest.raises(ConfigError, match=r"sweep.pgf: a .pgf plot needs xelatex \(LaTeX\), which is not installed"):
      sweep.check_plot_path(str(tmp_path / "sweep.pgf"))
  sweep.plot_sweep(rows, str(tmp_path / "photo.jpg"))  # unmarked formats are written without metadata=
  assert (tmp_path / "photo.jpg").read_bytes()[:2] == b"\xff\xd8"
  # eval.tune_max_tokens: the grid is searched on the first dev targets only, the split is scored in full
  config.eval.update(split="test", tune_max_tokens=24)
  out = evaluate.evaluate_checkpoint(config, export, mem_sizes=[16])
  assert out["dev_tokens"] == 24 and out["rows"][0]["tokens"] > 24
  # ... also when the split is dev: its rows cover eval.max_tokens of it, not the grid's 24 targets (they did)
  config.eval.update(split="dev")
  out = evaluate.evaluate_checkpoint(config, export, mem_sizes=[16])
  assert out["dev_tokens"] == 24 and all(r["tokens"] > 24 and "dev_ppl" in r for r in out["rows"][1:])
  assert len(out["rows"]) == 2 and out["rows"][0]["family"] == "none"  # the best point, applied
  # eval.memory=none has nothing to tune: said, and no dev pass (it ran one and reported nothing from it)
  config.eval.update(memory="none", split="test")
  out = evaluate.evaluate_checkpoint(config, export, progress=True)
  assert "dev_tokens" not in out and [r["family"] for r in out["rows"]] == ["none"]
  assert "warning: eval.tune: nothing to tune: eval.memory=none" in capsys.readouterr().err


@pytest.mark.parametrize("split", ["dev", "train"])
def test_frequency_buckets_count_words_on_the_development_set(tmp_path, split):
  """eval_ext's perplexity by word frequency groups target words by their count on the development set, as the
  paper does (they were counted in the training split); eval.frequency_split=train counts them there."""
  from trime_jax import knn
  from trime_jax.datastore import Datastore, build_datastore, build_index

  data = tmp_path / "wiki"
  data.mkdir()
  common = "".join(f" = Article {i} = \n\n alpha beta gamma .\n" for i in range(3))
  (data / "wiki.train.tokens").write_text(common + " delta epsilon .\n" * 12)  # delta: 12 in train, 1 in dev
  (data / "wiki.valid.tokens").write_text(common + " delta .\n")
  (data / "wiki.test.tokens").write_text(common + " delta epsilon .\n")
  config = _config(**{"data.corpus": "wikitext", "data.path": str(data), "eval.block_len": 16,
                      "eval.context_window": 8, "eval.batch_size": 1, "eval.split": "test", "eval.knn_k": 4,
                      "eval.frequency_split": split})
  splits = corpora.load_splits(config.data)
  model = TransformerLM(specs.model_config(config, vocab_size=len(splits.vocab)), rngs=nnx.Rngs(params=0))
  export = exports.export(str(tmp_path / "export"), nnx.split(model, nnx.Param)[1], config, splits.vocab)
  build_datastore(export, splits.train, str(tmp_path / "ds"), progress=False)
  build_index(Datastore(str(tmp_path / "ds")), kind="flat", progress=False)
  config.eval.datastore = str(tmp_path / "ds")
  out = evaluate.evaluate_checkpoint(config, export, external_memory=True)
  assert out["buckets"]["frequency_split"] == split
  by = knn.frequency_buckets(splits.get(split).tokens, len(splits.vocab))
  want = np.bincount(by[splits.test.tokens], minlength=len(knn.FREQ_BUCKETS))
  assert out["buckets"]["tokens"] == want.tolist()
  delta = splits.vocab.index["delta"]
  assert knn.FREQ_BUCKETS[by[delta]][2] == ("<=10" if split == "dev" else "10-100")  # the splits disagree on it


def test_tuned_dev_rows_report_their_own_perplexity_and_name_their_windows(tmp_path, capsys):
  """split=dev with eval.tune_max_tokens: the rows cover eval.max_tokens, and their dev_ppl is theirs (it was the
  grid's, over the first tune_max_tokens targets, so launch.eval's table showed the grid's perplexity beside the
  rows' token count); the grid's is tune_ppl. Rows name their windows; a negative tune_max_tokens is one error
  (it was an IndexError); a dev optimum at an end of its grid is said; progress lines name the corpus."""
  config = _config(**{"data.corpus": "wikitext", "data.path": str(_wiki_dir(tmp_path)), "eval.block_len": 16,
                      "eval.context_window": 8, "eval.batch_size": 2, "eval.tune": True, "eval.tune_max_tokens": 24,
                      "eval.split": "dev"})
  vocab = corpora.load_splits(config.data).vocab
  model = TransformerLM(specs.model_config(config, vocab_size=len(vocab)), rngs=nnx.Rngs(params=0))
  export = exports.export(str(tmp_path / "export"), nnx.split(model, nnx.Param)[1], config, vocab)
  out = evaluate.evaluate_checkpoint(config, export, mem_sizes=[16], progress="log")
  assert out["dev_tokens"] == 24
  err = capsys.readouterr().err  # the progress lines name the corpus: the grid's pass is told from the rows'
  assert "eval wikitext:dev mem=16: step 1/" in err
  for r in out["rows"]:
    assert r["tokens"] > 24 and r["dev_ppl"] == r["ppl"] and "tune_ppl" in r and r["tune_ppl"] != r["ppl"]
    assert (r["block_len"], r["context_window"], r["sample_break_mode"]) == (16, 8, "none")
  best = out["rows"][1]
  edges = evaluate.grid_edges(evaluate.Point("trime_local", tau=best["params"]["tau"]))
  assert ("note: eval.tune: trime_local(" in err) == bool(edges)
  assert evaluate.grid_edges(evaluate.Point("cache", cache_lambda=0.75, cache_theta=2.0)) == [
      "lambda=0.75 (grid 0.02 … 0.75)"]
  assert evaluate.grid_edges(evaluate.Point("trime_local", tau=1.25)) == []
  config.eval.update(tune_max_tokens=-5)
  with pytest.raises(ConfigError, match=r"eval.tune_max_tokens must be >= 0 \(0: as eval.max_tokens\), got -5"):
    evaluate.evaluate_checkpoint(config, export)


def test_eval_cli_refuses_a_summary_that_would_tune_on_test(tmp_path):
  """`launch.eval --include` of two test evaluations at τ = 1 and τ = 2 under one label: one error line, exit 2,
  before anything is written (its table showed the better test perplexity of the two, cell by cell)."""
  row = lambda tau, mem, nll: {"model": "m", "family": "trime_local", "mem_size": mem, "split": "test",
                               "variant": f"trime_local(tau={tau:g})", "params": {"tau": tau}, "nll": nll,
                               "ppl": float(np.exp(nll)), "tokens": 10}
  (tmp_path / "a.json").write_text(json.dumps([row(1.0, 0, 3.0), row(1.0, 16, 2.9)]))
  (tmp_path / "b.json").write_text(json.dumps([row(2.0, 0, 3.1), row(2.0, 16, 2.8)]))
  out = _cli("trime_jax.launch.eval", f"--include={tmp_path / 'a.json'},{tmp_path / 'b.json'}",
             f"--plot={tmp_path / 'p.png'}")
  assert out.returncode == 2 and "| model |" not in out.stdout and not (tmp_path / "p.png").exists()
  lines = out.stderr.strip().splitlines()
  assert len([l for l in lines if l.startswith("error:")]) == 1 and lines[-1].startswith(
      "error: the sweep table's cell (m, TRIME (local + long-term), memory size 0) has 2 rows of split test"), \
      out.stderr
  # each file alone (or one file twice) is a table
  out = _cli("trime_jax.launch.eval", f"--include={tmp_path / 'a.json'},{tmp_path / 'a.json'}")
  assert out.returncode == 0 and "| m | TRIME (local + long-term) | 20.086 (tau=1) | 18.174 (tau=1) |" in out.stdout, \
      out.stderr
