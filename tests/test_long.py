"""TrimeLM_long: consecutive batch plans and long-term memory at evaluation (tiny corpora, no ../shared)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from tests import reference as ref
from trime_jax import checkpoint as ckpt
from trime_jax import corpora
from trime_jax import data as D
from trime_jax import evaluate as E
from trime_jax import loss
from trime_jax import runs
from trime_jax.batching import consecutive
from trime_jax.batching import plan as batch_plan
from trime_jax.errors import ConfigError, DataError
from trime_jax.model import ModelConfig, TransformerLM
from trime_jax.train import BatchSource

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_LENS = [5, 40, 23, 60, 1, 17, 33]  # some shorter than one segment / one run, one a single token


def _corpus(lens=DOC_LENS, n_words=6, seed=0):
  rng = np.random.default_rng(seed)
  vocab = D.Vocab(["</s>", "<unk>"] + [f"w{i}" for i in range(n_words)])
  return D.Corpus.from_docs([rng.integers(2, 2 + n_words, size=n) for n in lens], vocab, "tiny")


def _config(**kw):
  c = default.get_config()
  c.data.segment_len, c.data.segmentation = 4, "document"
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
def test_plan_covers_every_segment_once_per_epoch_in_document_runs():
  corpus, config = _corpus(), _config()
  header, batches = consecutive.make_plan(corpus, config, progress=False)
  segs = D.make_segments(corpus, 4, "document")
  m, per_epoch = 3, header["batches_per_epoch"]
  assert batches.shape[1] == 6 and header["epochs"] > 1 and len(batches) == header["epochs"] * per_epoch
  orders = []
  for e in range(header["epochs"]):
    epoch = batches[e * per_epoch:(e + 1) * per_epoch]
    real = epoch[epoch >= 0]
    assert np.array_equal(np.sort(real), np.arange(len(segs)))  # every segment exactly once
    runs = epoch.reshape(-1, m)
    for run in runs:
      r = run[run >= 0]
      if not len(r):
        continue
      assert np.all(run[:len(r)] == r)  # padding only at the tail of a run
      assert len(set(segs.doc[r])) == 1  # one document per run ...
      assert np.array_equal(segs.index_in_doc[r], segs.index_in_doc[r[0]] + np.arange(len(r)))  # ... in order
      assert segs.index_in_doc[r[0]] % m == 0
    assert np.all((runs[:-2] >= 0).any(axis=1))  # all-padding runs only fill the epoch's last batch
    orders.append(tuple(runs[:, 0]))
  assert len(set(orders)) > 1  # epochs regroup documents
  again = consecutive.make_plan(corpus, config, progress=False)[1]
  assert np.array_equal(again, batches)  # deterministic from the seed
  other = consecutive.make_plan(corpus, _config(**{"train.seed": 6}), progress=False)[1]
  assert not np.array_equal(other, batches)
  # Short documents and tails are padded, never packed: rows per epoch = m · Σ_d ⌈n_d / m⌉ rounded up to B.
  n_seg = np.bincount(segs.doc)
  runs_total = int((-(-n_seg // m)).sum())
  assert header["num_runs"] == runs_total and per_epoch == -(-runs_total // 2)
  assert header["padding_rows_per_epoch"] == per_epoch * 6 - len(segs)


def test_plan_rows_are_the_layout_of_the_long_loss():
  """In a gathered batch, trime_nll(memory="long", m) lets a token see exactly the earlier tokens of its own
  document within its run of m segments."""
  corpus, config = _corpus(), _config()
  _, batches = consecutive.make_plan(corpus, config, progress=False)
  segs = D.make_segments(corpus, 4, "document")
  doc_of = corpus.doc_ids()
  for rows in batches[:6]:
    _, targets = D.gather_segments(corpus, segs, rows)
    meta = loss.batch_meta(jnp.asarray(targets), "long", 3)
    flat = loss.TokenMeta(*(x.reshape(-1) for x in meta))
    got = np.asarray(loss.visible(flat, flat, True, False))
    valid = targets.reshape(-1) >= 0
    pos = (segs.start[np.maximum(rows, 0)][:, None] + np.arange(4)).reshape(-1)
    pos = np.where(valid, pos, 0)
    run = np.repeat(np.arange(len(rows)) // 3, 4)
    want = ((run[:, None] == run[None, :]) & (pos[None, :] < pos[:, None]) & valid[None, :]
            & (doc_of[pos][:, None] == doc_of[pos][None, :]))
    assert np.array_equal(got[valid], want[valid])  # (padding queries score nothing)
    assert np.array_equal(targets.reshape(-1)[valid], corpus.tokens[pos[valid]])


def test_plan_errors_and_batch_source_reads_it(tmp_path):
  corpus = _corpus()
  with pytest.raises(ConfigError, match="segmentation"):
    consecutive.make_plan(corpus, _config(**{"data.segmentation": "stream"}), progress=False)
  with pytest.raises(ConfigError, match="multiple"):
    consecutive.make_plan(corpus, _config(**{"train.batch_size": 8}), progress=False)
  config = _config(**{"trime.batching": "consecutive", "trime.batch_plan": str(tmp_path / "plan"),
                      "train.grad_accum": 2})
  header, batches = consecutive.make_plan(corpus, config, progress=False)
  batch_plan.save(str(tmp_path / "plan"), header, batches)
  source = BatchSource(corpus, config)
  got = source(3)
  plan = batch_plan.load(str(tmp_path / "plan"))
  want = D.gather_segments(corpus, source.segments, np.concatenate([plan.rows(6), plan.rows(7)]))[1]
  assert np.array_equal(got["targets"].reshape(-1, 4), want)
  with pytest.raises(DataError, match="consecutive_segments"):
    BatchSource(corpus, _config(**{"trime.batching": "consecutive", "trime.batch_plan": str(tmp_path / "plan"),
                                   "trime.consecutive_segments": 2}))


def _wiki_dir(tmp_path):
  data = tmp_path / "wiki"
  data.mkdir()
  text = "".join(f" = Article {i} = \n\n" + " alpha beta gamma delta .\n" * (i + 1) for i in range(6))
  for name in ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"):
    (data / name).write_text(text)
  return data


def _cli(*args):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=120)


def test_make_batches_cli(tmp_path):
  data = _wiki_dir(tmp_path)
  cfg = tmp_path / "cfg.py"
  cfg.write_text(textwrap.dedent(f"""
      from configs import default
      def get_config():
        c = default.get_config()
        c.data.corpus, c.data.path = "wikitext", {str(data)!r}
        c.data.segment_len, c.data.segmentation = 8, "document"
        c.train.batch_size, c.trime.consecutive_segments = 4, 2
        return c
      """))
  out = _cli("launch.make_batches", f"--config={cfg}", "--kind=consecutive", f"--out={tmp_path / 'plan'}")
  assert out.returncode == 0, out.stderr
  plan = batch_plan.load(str(tmp_path / "plan"))
  assert plan.header["kind"] == "consecutive" and plan.header["consecutive_segments"] == 2
  assert "consecutive plan" in out.stderr  # the progress bar


# ----------------------------------------------------------------------------------------------------------
# Long-term memory at evaluation
# ----------------------------------------------------------------------------------------------------------
BLOCK, CONTEXT = 16, 8
TAUS = (0.4, 1.0)
CACHE = ((0.2, 0.5), (0.3, 2.0))


class Tiny:
  """A tiny random model on `_corpus()`; evaluations are memoised (each new shape is a jit compilation)."""

  def __init__(self):
    self.corpus = _corpus()
    cfg = ModelConfig.from_config(_config().model, vocab_size=len(self.corpus.vocab))
    self.model = TransformerLM(cfg, rngs=nnx.Rngs(params=3))
    self.graphdef, self.params = nnx.split(self.model, nnx.Param)
    self.wins = E.windows(len(self.corpus), BLOCK, CONTEXT)
    self.outs, self.key_of = [], {}  # per window: float64 (logits, keys, targets); key of each scored token
    forward = jax.jit(lambda params, x: nnx.merge(self.graphdef, params)(x))
    for w in self.wins:
      inputs, targets, _ = E.window_batch(self.corpus, [w], BLOCK)
      logits, keys = forward(self.params, inputs)
      self.outs.append((np.float64(logits[0]), np.float64(keys[0]), targets[0]))
      for p in range(w.score_start, w.end):
        self.key_of[p] = self.outs[-1][1][p - w.start]
    self.cache = {}

  def run(self, mem_size, reset=True, streams=3):
    """Mean nll per variant from `evaluate_streams`."""
    if (mem_size, reset, streams) not in self.cache:
      variants = E.Variants(taus=TAUS, cache=CACHE, mem_size=mem_size, reset_at_documents=reset)
      res = E.evaluate_streams(self.graphdef, self.params, self.corpus, block_len=BLOCK, context_window=CONTEXT,
                               streams=streams, variants=variants)
      assert all(r.tokens == len(self.corpus) for r in res)
      self.cache[mem_size, reset, streams] = np.array([r.nll for r in res])
    return self.cache[mem_size, reset, streams]

  def brute_force(self, mem_size, reset):
    """Mean nll per variant in float64: each scored token sees the earlier tokens of its window and the
    `mem_size` tokens before the window (of its own document if `reset`), keyed from their scoring window."""
    corpus, doc = self.corpus, self.corpus.doc_ids()
    d = self.outs[0][1].shape[-1]
    totals = np.zeros(1 + len(TAUS) + len(CACHE))
    for w, (logits, keys, targets) in zip(self.wins, self.outs):
      for p in range(w.score_start, w.end):
        i, y = p - w.start, int(corpus.tokens[p])
        store = [q for q in range(max(0, w.start - mem_size), w.start) if not reset or doc[q] == doc[p]]
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


def test_memory_sizes_and_document_resets_change_the_numbers(tiny):
  local, small, full, across = tiny.run(0), tiny.run(6), tiny.run(10_000), tiny.run(10_000, reset=False)
  for a, b in [(local, small), (small, full), (full, across)]:
    assert np.abs(a[1:] - b[1:]).min() > 1e-3  # every memory variant sees the difference
    assert a[0] == pytest.approx(b[0], rel=1e-6)  # the vanilla softmax does not


def test_streams_do_not_change_the_numbers(tiny):
  for s in (1, 4):
    np.testing.assert_allclose(tiny.run(25, streams=s), tiny.run(25), rtol=1e-5)
  # mem_size=0 through the streamed path is the plain local evaluation (as `evaluate` computes it).
  plain = E.evaluate(tiny.graphdef, tiny.params, tiny.corpus, block_len=BLOCK, context_window=CONTEXT,
                     batch_size=3, variants=E.Variants(taus=TAUS, cache=CACHE))
  np.testing.assert_allclose(tiny.run(0), [r.nll for r in plain], rtol=1e-5)
  assert [r.name for r in plain][1] == "local(tau=0.4)"


@pytest.mark.parametrize("streams,mem_size,reset", [(1, 25, True), (3, 25, True), (4, 40, False), (9, 6, True)])
def test_stream_schedule_scores_every_window_once(streams, mem_size, reset):
  corpus = _corpus()
  wins = E.windows(len(corpus), BLOCK, CONTEXT)
  win, score = E.stream_schedule(wins, corpus.doc_starts, streams, mem_size, reset)
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


def test_memory_size_sweep_table_and_plot(tmp_path):
  """`evaluate_checkpoint(mem_sizes=...)` rows, the summary table, and `launch.eval --include --plot`."""
  config = _config(**{"data.corpus": "wikitext", "data.path": str(_wiki_dir(tmp_path)), "eval.block_len": 16,
                      "eval.context_window": 8, "eval.batch_size": 2, "eval.tune": True})
  vocab = corpora.load_splits(config.data).vocab
  model = TransformerLM(ModelConfig.from_config(config.model, vocab_size=len(vocab)), rngs=nnx.Rngs(params=0))
  export = ckpt.export(str(tmp_path / "export"), nnx.split(model, nnx.Param)[1], config, vocab)
  rows = runs.evaluate_checkpoint(config, export, mem_sizes=[0, 16], label="tiny")
  n = 1 + len(E.TAU_GRID)
  assert [r["mem_size"] for r in rows] == [0] * n + [16] * n
  assert [r["family"] for r in rows[:n]] == ["none"] + ["trime"] * (n - 1)
  assert rows[1]["variant"].startswith("local(") and rows[n + 1]["variant"].startswith("local+long(")
  assert sum("<- best" in r["variant"] for r in rows) == 2 and all(r["model"] == "tiny" for r in rows)
  table = runs.sweep_table(rows)
  assert "| tiny | TRIME (local + long-term) |" in table and "| tiny | none |" in table
  (tmp_path / "rows.json").write_text(json.dumps(rows))
  out = _cli("launch.eval", f"--include={tmp_path / 'rows.json'}", f"--plot={tmp_path / 'sweep.png'}")
  assert out.returncode == 0, out.stderr
  assert "| model |" in out.stdout and (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
