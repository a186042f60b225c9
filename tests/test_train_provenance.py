"""What a workdir's files say about the run that made them, and what a train line says about the updates: a
best/ export left by another run is not taken over, settings a resume may change really only lengthen the run,
skipped updates are counted and the learning rate logged is the one applied, a stop before the end writes no
metrics line an uninterrupted run would not, and a long-memory config without consecutive batches is refused."""

import json
import math
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import read_metrics, tiny_config, write_text_file
from trime_jax import checkpoint as ckpt
from trime_jax import corpora, exports, steps, train
from trime_jax.errors import CheckpointError, ConfigError
from trime_jax.runtime.optim import make_schedule
from trime_jax.train_config import validate_config

FAST = {"trime.ce_warmup_steps": 0, "train.eval_max_tokens": 64, "eval.max_tokens": 64}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_text_file(tmp_path_factory.mktemp("prov") / "text.bin", 20_000)


def _train_lines(workdir):
  return [m for m in read_metrics(workdir) if "loss" in m]


def test_a_best_export_of_another_run_without_checkpoints_is_not_taken_over(corpus, tmp_path, monkeypatch):
  """Run A stops (a crash) after a dev evaluation wrote best/ and before its first checkpoint. Another config in
  the workdir is refused, naming the field; the same config (the rerun of A's command) continues A's record."""
  base = dict(FAST, **{"train.num_steps": 8, "train.eval_every": 4, "train.checkpoint_every": 100})
  workdir = str(tmp_path / "w")
  real_batch = train.LMTask.batch

  def crashing(self, step):
    if step == 5:
      raise RuntimeError("the node went away")
    return real_batch(self, step)

  monkeypatch.setattr(train.LMTask, "batch", crashing)
  with pytest.raises(RuntimeError, match="node went away"):
    train.train_and_evaluate(tiny_config(corpus, **base), workdir)
  monkeypatch.setattr(train.LMTask, "batch", real_batch)
  assert exports.read_export_meta(os.path.join(workdir, "best"))["step"] == 4
  assert not [n for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()]
  other = tiny_config(corpus, **base, **{"train.learning_rate": 1e-5})
  with pytest.raises(CheckpointError, match=r"holds the best/ or export/ of a run without checkpoints with other "
                                            r"settings \(train.learning_rate: 0.003 there, 1e-05 now\)"):
    train.train_and_evaluate(other, workdir)
  out = train.train_and_evaluate(tiny_config(corpus, **base), workdir)  # the same run, again from update 0
  assert out["step"] == 8
  with open(os.path.join(workdir, "best", "config.json")) as f:
    assert json.load(f)["train"]["learning_rate"] == 3e-3


def test_checkpoints_without_a_config_json_are_not_resumed_with_any_config(corpus, tmp_path):
  workdir = str(tmp_path / "w")
  cfg = tiny_config(corpus, **FAST, **{"train.num_steps": 3})
  train.train_and_evaluate(cfg, workdir)
  os.remove(os.path.join(workdir, "config.json"))
  with pytest.raises(CheckpointError, match="but no config.json, so its settings cannot be compared"):
    train.train_and_evaluate(tiny_config(corpus, **FAST, **{"train.num_steps": 4}), workdir)
  allowed = tiny_config(corpus, **FAST, **{"train.num_steps": 4, "train.allow_config_change": True})
  assert train.train_and_evaluate(allowed, workdir)["step"] == 4


@pytest.mark.parametrize("case", ["cosine", "derived_ce_warmup", "inverse_sqrt"])
def test_a_longer_run_is_a_resumable_change_only_when_nothing_else_depends_on_num_steps(corpus, tmp_path, case):
  """train.num_steps may grow on resume without allow_config_change when the updates already planned stay the
  same (inverse-sqrt, an explicit CE warm-up); a cosine period or the 5%-of-num_steps CE warm-up would change."""
  kw = {"cosine": {"train.schedule": "cosine", "trime.ce_warmup_steps": 0},
        "derived_ce_warmup": {"trime.ce_warmup_steps": -1},  # 5% of 20 = 1 update, of 40 = 2
        "inverse_sqrt": {"trime.ce_warmup_steps": 0}}[case]
  short = tiny_config(corpus, **{**FAST, **kw, "train.num_steps": 20, "train.stop_after": 2})
  workdir = str(tmp_path / case)
  train.train_and_evaluate(short, workdir)
  longer = tiny_config(corpus, **{**FAST, **kw, "train.num_steps": 40, "train.stop_after": 1})
  if case == "inverse_sqrt":
    assert train.train_and_evaluate(longer, workdir)["step"] == 3
    return
  why = {"cosine": "the cosine schedule decays over train.num_steps",
         "derived_ce_warmup": "the CE warm-up is 5% of train.num_steps: 1 update there, 2 now"}[case]
  with pytest.raises(CheckpointError, match=rf"train.num_steps: 20 there, 40 now \({why}\)"):
    train.train_and_evaluate(longer, workdir)


def _poison_update_2(monkeypatch):
  """The loss of update 2 (0-based step 1) is NaN: drop_local, unused by memory="local", carries the poison."""
  real = steps.nll_sums

  def poisoned(model, batch, spec, **kw):
    o, ce, tr, n = real(model, batch, spec, **kw)
    return o * jnp.where(batch["drop_local"][0], jnp.nan, 1.0), ce, tr, n

  real_batch = train.LMTask.batch

  def batch(self, step):
    b = real_batch(self, step)
    if step == 1:
      d = np.zeros(b["drop_local"].shape, bool)
      d[0, 0] = True
      b["drop_local"] = jnp.asarray(d)
    return b

  monkeypatch.setattr(steps, "nll_sums", poisoned)
  monkeypatch.setattr(train.LMTask, "batch", batch)


def test_one_skipped_update_is_counted_alike_wherever_the_lines_and_stops_fall(corpus, tmp_path, monkeypatch):
  """One non-finite update never stops training, whatever train.log_every (its line was the one checked), and
  its line counts it after a resume that falls between the skip and the line (the count of this invocation
  only, before): the resumed run's train lines are the uninterrupted run's."""
  _poison_update_2(monkeypatch)
  kw = dict(FAST, **{"train.num_steps": 8, "train.log_every": 4})
  train.train_and_evaluate(tiny_config(corpus, **kw), str(tmp_path / "straight"))
  straight = _train_lines(str(tmp_path / "straight"))
  assert [(m["step"], m["skipped"], m["skipped_total"]) for m in straight] == [(4, 1, 1), (8, 0, 1)]
  train.train_and_evaluate(tiny_config(corpus, **dict(kw, **{"train.log_every": 1})), str(tmp_path / "every"))
  assert [m["skipped"] for m in _train_lines(str(tmp_path / "every"))] == [0, 1, 0, 0, 0, 0, 0, 0]
  stopped = str(tmp_path / "stopped")  # checkpoint at 3 (train.checkpoint_every), past the skip, before the line
  train.train_and_evaluate(tiny_config(corpus, **dict(kw, **{"train.stop_after": 3})), stopped)
  train.train_and_evaluate(tiny_config(corpus, **kw), stopped)
  resumed = _train_lines(stopped)
  assert [(m["step"], m["skipped"], m["skipped_total"]) for m in resumed] == [(4, 1, 1), (8, 0, 1)]
  np.testing.assert_allclose([m["loss"] for m in resumed], [m["loss"] for m in straight], rtol=1e-6)


def test_skipped_updates_are_counted_and_the_logged_rate_is_the_one_applied(corpus, tmp_path, monkeypatch):
  """A non-finite loss at update 2 of a line every 3 updates: the update is skipped (parameters and optimizer
  kept); the line at 3 counts it, and later lines log the learning rate the optimizer applied, which lags the
  update count by the skipped update."""
  _poison_update_2(monkeypatch)
  cfg = tiny_config(corpus, **FAST, **{"train.num_steps": 6, "train.log_every": 3, "train.warmup_steps": 4})
  train.train_and_evaluate(cfg, str(tmp_path / "w"))
  lines = _train_lines(str(tmp_path / "w"))
  assert [(m["step"], m["skipped"]) for m in lines] == [(3, 1), (6, 0)]
  schedule = make_schedule(cfg.train)
  # update 6 is the 5th applied: it ran at schedule step 4 (update 3, the 2nd applied, at step 1)
  np.testing.assert_allclose([m["lr"] for m in lines], [float(schedule(1)), float(schedule(4))], rtol=1e-6)
  assert float(schedule(4)) != float(schedule(5))  # the case tells the two apart (warm-up of 4 updates)


def test_without_skips_the_logged_rate_is_the_schedule_at_the_update(corpus, tmp_path):
  cfg = tiny_config(corpus, **FAST, **{"train.num_steps": 6, "train.log_every": 2, "train.warmup_steps": 4})
  train.train_and_evaluate(cfg, str(tmp_path / "w"))
  schedule = make_schedule(cfg.train)
  lines = _train_lines(str(tmp_path / "w"))
  assert [m["skipped"] for m in lines] == [0, 0, 0]
  np.testing.assert_allclose([m["lr"] for m in lines], [float(schedule(s)) for s in (1, 3, 5)], rtol=1e-6)


def test_a_stop_before_the_end_leaves_the_uninterrupted_runs_metrics_lines(corpus, tmp_path):
  kw = dict(FAST, **{"train.num_steps": 6, "train.log_every": 2})
  train.train_and_evaluate(tiny_config(corpus, **kw), str(tmp_path / "straight"))
  stopped = str(tmp_path / "stopped")
  assert train.train_and_evaluate(tiny_config(corpus, **kw, **{"train.stop_after": 3}), stopped)["step"] == 3
  train.train_and_evaluate(tiny_config(corpus, **kw), stopped)
  straight, resumed = _train_lines(str(tmp_path / "straight")), _train_lines(stopped)
  assert [m["step"] for m in resumed] == [m["step"] for m in straight] == [2, 4, 6]
  np.testing.assert_allclose([m["loss"] for m in resumed], [m["loss"] for m in straight], rtol=1e-6)


def test_long_memory_over_runs_of_several_segments_needs_consecutive_batches(corpus):
  cfg = tiny_config(corpus, **{"trime.memory": "long", "trime.consecutive_segments": 2, "data.segmentation": "stream"})
  with pytest.raises(ConfigError, match=r"trime.memory='long' with trime.consecutive_segments=2 .* needs "
                                        r"trime.batching='consecutive'.* got 'random'"):
    validate_config(cfg)
  one = tiny_config(corpus, **{"trime.memory": "long", "trime.consecutive_segments": 1})
  with pytest.raises(ConfigError, match="consecutive_segments=1 is local memory"):  # runs of one segment: TrimeLM
    validate_config(one)
  validate_config(one, training=False)  # an export trained so (before the refusal) is still evaluated


def test_resumable_changes_are_documented_with_their_exception():
  assert "train.num_steps".startswith(ckpt.RESUMABLE_CHANGES)  # usually resumable; the exceptions above


def test_a_resume_on_a_rewritten_corpus_or_batch_plan_is_refused(corpus, tmp_path):
  """config.json names the corpus and the plan by path: rewriting either between two invocations is found by
  <workdir>/data.json (the training split's fingerprint, the plan's digest), not trained on silently."""
  from trime_jax.batching import consecutive
  from trime_jax.batching import plan as batch_plan
  from trime_jax import corpora

  text = tmp_path / "text.bin"
  text.write_bytes(open(corpus, "rb").read())
  plan_dir = str(tmp_path / "plan")
  kw = dict(FAST, **{"train.num_steps": 6, "train.stop_after": 3, "data.segmentation": "stream",
                     "trime.memory": "long", "trime.consecutive_segments": 2, "trime.batching": "consecutive",
                     "trime.batch_plan": plan_dir})

  def write_plan(seed_shift=0):
    cfg = tiny_config(str(text), **kw)
    header, batches = consecutive.make_plan(corpora.load_splits(cfg.data).train, cfg, progress=False)
    batch_plan.save(plan_dir, header, np.roll(batches, seed_shift, axis=0))

  write_plan()
  workdir = str(tmp_path / "w")
  train.train_and_evaluate(tiny_config(str(text), **kw), workdir)
  with open(os.path.join(workdir, "data.json")) as f:
    recorded = json.load(f)
  assert set(recorded) == {"train_fingerprint", "batch_plan_digest", "epochs", "memory_grad_cut_rows"}
  assert recorded["batch_plan_digest"] and recorded["memory_grad_cut_rows"] == 0  # one device: no cut
  assert recorded["epochs"] == "whole updates"
  write_plan(seed_shift=1)  # the same corpus, its batches in another order
  with pytest.raises(CheckpointError, match=r"was trained on other data \(batch_plan_digest: "):
    train.train_and_evaluate(tiny_config(str(text), **kw), workdir)
  assert train.train_and_evaluate(tiny_config(str(text), **kw, **{"train.allow_config_change": True}),
                                  workdir)["step"] == 6  # told: goes on, and says so
  with open(os.path.join(workdir, "config_changes.jsonl")) as f:
    assert "batch_plan_digest" in f.read()
  # Random batches (no plan to check the corpus against): the training split's fingerprint.
  plain = dict(FAST, **{"train.num_steps": 6, "train.stop_after": 3})
  workdir = str(tmp_path / "w_random")
  train.train_and_evaluate(tiny_config(str(text), **plain), workdir)
  data = bytearray(text.read_bytes())
  data[:200] = data[:200][::-1]  # the corpus file rewritten in place
  text.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match=r"was trained on other data \(train_fingerprint: "):
    train.train_and_evaluate(tiny_config(str(text), **plain), workdir)


def test_a_run_begun_before_whole_epoch_updates_resumes_in_its_own_order(corpus, tmp_path, capsys):
  """A run whose data.json has no "epochs" (begun before 2026-12-06, when an update could straddle two epochs)
  keeps that layout when it resumes, and says so once: its updates past the epoch's end are the ones an
  uninterrupted run of the old layout trains on, loss for loss, not today's (whole updates, the last padded)."""
  kw = dict(FAST, **{"train.batch_size": 64, "train.num_steps": 12, "train.log_every": 1})
  config = tiny_config(corpus, **kw)
  source = train.BatchSource(corpora.load_splits(config.data).train, config)
  changed_at = source.first_update_of_another_layout()
  assert changed_at is not None and 3 < changed_at < 11, changed_at  # the epoch ends inside update changed_at
  old_source = train.BatchSource(source.corpus, config, epochs=train.EPOCHS_STRADDLING)
  assert not np.array_equal(source.indices(changed_at), old_source.indices(changed_at))
  assert np.array_equal(source.indices(changed_at - 1), old_source.indices(changed_at - 1))
  whole = str(tmp_path / "whole")  # today's layout, uninterrupted
  train.train_and_evaluate(config, whole)
  assert json.load(open(os.path.join(whole, "data.json")))["epochs"] == "whole updates"
  old = str(tmp_path / "old")  # begun under the old layout: stopped at update 3, its data.json as it was then
  train.train_and_evaluate(tiny_config(corpus, **{**kw, "train.stop_after": 3}), old)
  path = os.path.join(old, "data.json")
  record = json.load(open(path))
  del record["epochs"]
  with open(path, "w") as f:
    json.dump(record, f)
  capsys.readouterr()
  train.train_and_evaluate(config, old)
  said = [line for line in capsys.readouterr().out.splitlines() if "keeps the epoch layout it began with" in line]
  assert len(said) == 1 and f"from update {changed_at} on" in said[0], said
  assert json.load(open(path))["epochs"] == "straddling"  # recorded: later resumes keep it too
  lines_whole, lines_old = _train_lines(whole), _train_lines(old)
  assert [m["step"] for m in lines_old] == list(range(1, 13))
  # the same updates up to the epoch's end, then the old layout's (other segments, so other losses)
  for a, b in zip(lines_whole[:changed_at], lines_old[:changed_at]):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
  assert lines_whole[changed_at]["loss"] != pytest.approx(lines_old[changed_at]["loss"], rel=1e-6)


def test_a_best_measured_with_another_dev_protocol_is_measured_again_before_it_is_compared(corpus, tmp_path,
                                                                                          monkeypatch):
  """train.eval_max_tokens (and eval.*) may change on resume; the best so far was measured on another part of
  dev, so the resumed run measures the exported best again under its own protocol before comparing with it."""
  workdir = str(tmp_path / "w")
  kw = dict(FAST, **{"train.num_steps": 8, "train.eval_every": 2, "train.stop_after": 4})
  train.train_and_evaluate(tiny_config(corpus, **kw), workdir)
  meta = exports.read_export_meta(os.path.join(workdir, "best"))
  assert meta["dev_protocol"] == {"eval_max_tokens": 64, "block_len": 64, "context_window": 32}
  calls, real = [], train.LMTask.evaluate_export

  def remeasure(self, directory):
    calls.append(directory)
    got = real(self, directory)
    calls.append(got)
    return got

  monkeypatch.setattr(train.LMTask, "evaluate_export", remeasure)
  same = tiny_config(corpus, **dict(kw, **{"train.stop_after": 1}))
  train.train_and_evaluate(same, workdir)  # the same protocol: nothing measured again
  assert calls == []
  other = tiny_config(corpus, **dict(kw, **{"train.stop_after": 1, "train.eval_max_tokens": 128}))
  train.train_and_evaluate(other, workdir)
  assert len(calls) == 2 and calls[0] == os.path.join(workdir, "best") and calls[1]["tokens"] == 128
  # Update 6's dev (128 tokens) is compared with update 4's best remeasured on 128 tokens, not with its 64-token
  # value: here it wins although it is above that value (without the remeasure best/ would have stayed at 4).
  metric = "trime_local(tau=1)_ppl"
  now = exports.read_export_meta(os.path.join(workdir, "best"))
  assert now["step"] == 6 and now["dev_protocol"]["eval_max_tokens"] == 128
  # (that update 6's 128-token value lies above update 4's 64-token one depends on the tiny run's numbers, which
  # moved between commits of 2026-12-02 without a code path of training changing: not asserted)
  assert now["dev_ppl"] < calls[1][metric] and calls[1][metric] != meta["dev_ppl"]
  from trime_jax.runtime.best import BestKeeper

  keep = lambda protocol: BestKeeper(os.path.join(workdir, "best"), True, metric, None, protocol=protocol,
                                     remeasure=lambda d: {metric: 1234.5})
  assert keep(now["dev_protocol"]).ppl == now["dev_ppl"] and keep(meta["dev_protocol"]).ppl == 1234.5


def test_a_refused_run_leaves_no_workdir_it_created(tmp_path):
  """Bad data is refused before anything is written: the workdir the run made is removed again with the parent
  folders made for it (a mistyped --workdir leaves nothing behind), and one that was there before stays."""
  from trime_jax.errors import DataError

  cfg = tiny_config(str(tmp_path / "no_such_corpus.bin"), **{"train.num_steps": 2})
  fresh = tmp_path / "runs" / "fresh"
  with pytest.raises(DataError, match=r"^byte corpus not found: data.path="):
    train.train_and_evaluate(cfg, str(fresh))
  assert not (tmp_path / "runs").exists()  # made for it: removed too (it stayed)
  kept = tmp_path / "kept"
  kept.mkdir()
  with pytest.raises(DataError, match=r"^byte corpus not found: data.path="):
    train.train_and_evaluate(cfg, str(kept))
  assert kept.is_dir() and not os.listdir(kept)
  # refused later, after config.json was written (a batch plan that is not there): the same
  cfg = tiny_config(str(tmp_path / "corpus.bin"), **{"train.num_steps": 2, "trime.memory": "long",
                                                     "trime.batching": "consecutive",
                                                     "trime.consecutive_segments": 2,
                                                     "trime.batch_plan": str(tmp_path / "no_plan")})
  write_text_file(tmp_path / "corpus.bin", 4_000)
  with pytest.raises((ConfigError, DataError), match="batch plan not found"):
    train.train_and_evaluate(cfg, str(fresh))
  assert not fresh.exists()


def test_a_refused_resume_changes_nothing_in_the_workdir(corpus, tmp_path):
  """Resumes refused at the checkpoint (another optimizer's state layout: train.clip_norm 0 -> 1, which an
  earlier version took for damage and moved every checkpoint aside; other shapes; fewer updates than the
  checkpoint holds) leave config.json, config_changes.jsonl, data.json and the checkpoints as they were, so the
  original command still resumes."""
  from trime_jax.errors import DamagedCheckpointError

  kw = dict(FAST, **{"train.num_steps": 6})
  workdir = str(tmp_path / "w")
  train.train_and_evaluate(tiny_config(corpus, **dict(kw, **{"train.stop_after": 3})), workdir)  # no export yet
  records = {n: open(os.path.join(workdir, n), "rb").read() for n in ("config.json", "data.json")}
  allow = {"train.allow_config_change": True}
  for change, said in [({"train.clip_norm": 1.0}, r"holds another optimizer's or model's state \(\d+ arrays expected "
                                                   r"but not stored, e\.g\. opt_state/1/0/count; .*undo that change"),
                       ({"model.d_ff": 48}, r"does not match this config's model/optimizer \(float32\["),
                       ({"train.num_steps": 2}, r"newest checkpoint in .* is update 3, past this run's 2 updates")]:
    with pytest.raises(CheckpointError, match=said) as e:
      train.train_and_evaluate(tiny_config(corpus, **{**kw, **allow, **change}), workdir)
    assert not isinstance(e.value, DamagedCheckpointError)
    assert {n: open(os.path.join(workdir, n), "rb").read() for n in records} == records, change
    assert not os.path.exists(os.path.join(workdir, "config_changes.jsonl"))
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["3"] and not os.path.exists(workdir + "/checkpoints_damaged")
  assert train.train_and_evaluate(tiny_config(corpus, **kw), workdir)["step"] == 6


def test_a_torn_last_metrics_line_is_dropped_and_a_damaged_one_named(corpus, tmp_path):
  """A kill mid-write leaves a last line without its newline: the resume drops it (the rerun writes it again);
  a line before the last that is not a record is one error naming the file and the line."""
  from trime_jax.errors import DamagedCheckpointError

  kw = dict(FAST, **{"train.num_steps": 3})
  workdir = tmp_path / "w"
  train.train_and_evaluate(tiny_config(corpus, **kw), str(workdir))
  path = workdir / "metrics.jsonl"
  whole = path.read_bytes()
  path.write_bytes(whole[:-40])  # the final dev line, cut
  train.train_and_evaluate(tiny_config(corpus, **dict(kw, **{"train.num_steps": 6})), str(workdir))
  rows = [json.loads(ln) for ln in path.read_text().splitlines()]  # every line a record again
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
  lines = path.read_text().splitlines(keepends=True)
  path.write_text("".join(lines[:2] + ['{"step": 3, "lo\n'] + lines[2:]))
  with pytest.raises(DamagedCheckpointError, match=rf"^{path} line 3 is not a metrics record \(.*remove that line"):
    train.train_and_evaluate(tiny_config(corpus, **dict(kw, **{"train.num_steps": 9})), str(workdir))


def test_a_rerun_measuring_dev_otherwise_evaluates_dev_again(corpus, tmp_path):
  """A finished run rerun with other dev settings (eval.block_len / context_window) measures dev again instead
  of reusing the final dev line of the other settings; best/ (the same parameters) keeps its value with the
  settings it was measured by (an earlier version re-exported it with the old value under the new settings)."""
  kw = dict(FAST, **{"train.num_steps": 3})
  workdir = str(tmp_path / "w")
  train.train_and_evaluate(tiny_config(corpus, **kw), workdir)
  again = train.train_and_evaluate(tiny_config(corpus, **dict(kw, **{"eval.block_len": 32, "eval.context_window": 16})),
                                   workdir)
  dev = [m for m in read_metrics(workdir) if m.get("split") == "dev"]
  assert [(m["step"], m["dev_protocol"]["block_len"]) for m in dev] == [(3, 64), (3, 32)]
  assert again["dev"]["none_ppl"] == dev[-1]["none_ppl"] != dev[0]["none_ppl"]
  best = exports.read_export_meta(os.path.join(workdir, "best"))
  assert (best["dev_protocol"]["block_len"], best["dev_ppl"]) == (64, dev[0]["trime_local(tau=1)_ppl"])
  # the same settings again: the final line is reused, none appended
  train.train_and_evaluate(tiny_config(corpus, **dict(kw, **{"eval.block_len": 32, "eval.context_window": 16})),
                           workdir)
  assert len([m for m in read_metrics(workdir) if m.get("split") == "dev"]) == 2


def test_a_rerun_of_a_run_whose_dev_lines_predate_dev_protocol_reuses_its_final_line(corpus, tmp_path):
  """Dev lines written before they recorded their protocol (versions before 2026-12-04) were measured under the
  workdir's config.json: a rerun with the same settings reuses the final line (no duplicate), one with other dev
  settings measures dev again."""
  kw = dict(FAST, **{"train.num_steps": 3})
  workdir = str(tmp_path / "w")
  train.train_and_evaluate(tiny_config(corpus, **kw), workdir)
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path) as f:
    rows = [json.loads(ln) for ln in f]
  older = "".join(json.dumps({k: v for k, v in r.items() if k != "dev_protocol"}) + "\n" for r in rows)
  with open(path, "w") as f:
    f.write(older)
  train.train_and_evaluate(tiny_config(corpus, **kw), workdir)
  with open(path) as f:
    assert f.read() == older  # nothing appended
  other = dict(kw, **{"eval.block_len": 32, "eval.context_window": 16})
  train.train_and_evaluate(tiny_config(corpus, **other), workdir)
  dev = [m for m in read_metrics(workdir) if m.get("split") == "dev"]
  assert [m["step"] for m in dev] == [3, 3] and dev[-1]["dev_protocol"]["block_len"] == 32
  # Those versions also reused the final line when a rerun changed the dev settings, and wrote the new ones to
  # config.json: after a recorded change of an evaluation setting, config.json does not say how the line was
  # measured, so dev is measured again
  with open(path, "w") as f:
    f.write(older)
  with open(os.path.join(workdir, "config_changes.jsonl"), "a") as f:
    f.write(json.dumps({"changes": {"eval.block_len": [64, 32]}, "allowed": False}) + "\n")
  train.train_and_evaluate(tiny_config(corpus, **other), workdir)
  dev = [m for m in read_metrics(workdir) if m.get("split") == "dev"]
  assert [m["step"] for m in dev] == [3, 3] and dev[-1]["dev_protocol"]["block_len"] == 32


def test_a_negative_seed_is_one_config_error(corpus, tmp_path):
  with pytest.raises(ConfigError, match=r"^train.seed must be >= 0, got -1$"):
    train.train_and_evaluate(tiny_config(corpus, **{"train.seed": -1}), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")


def test_a_checkpoints_file_is_refused_before_training(corpus, tmp_path):
  workdir = tmp_path / "w"
  workdir.mkdir()
  (workdir / "checkpoints").write_text("not a folder")
  with pytest.raises(CheckpointError, match=r"checkpoints is a file, not the run's checkpoint folder"):
    train.train_and_evaluate(tiny_config(corpus, **FAST), str(workdir))
  assert not os.path.exists(workdir / "metrics.jsonl")  # refused before the first update


def _fairseq_rate(n, warmup, warmup_init, peak, schedule, floor=0.0, period=0):
  """fairseq's warm-up (init + n·(peak - init)/W), then its inverse_sqrt (peak·√W/√n) or its cosine (the first
  period, t_mult 2's restarts never reached: floor + (peak - floor)(1 + cos(π(n - W)/period))/2), float64."""
  if n < warmup:
    return warmup_init + n * (peak - warmup_init) / warmup
  if schedule == "inverse_sqrt":
    return peak * math.sqrt(warmup) / math.sqrt(n)
  return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * (n - warmup) / period))


@pytest.mark.parametrize("name", ["wiki103_247m", "wiki103_150m"])
def test_paper_schedules_are_fairseqs_number_for_number(name):
  """The paper configs' rates at every kind of update, update 0 included, against fairseq's formulas
  (--lr-period-updates 270000 = 286000 - 16000 for the 247M's cosine; inverse_sqrt from 1e-7 for the 150M)."""
  import importlib
  c = importlib.import_module(f"trime_jax.configs.{name}").get_config().train
  warm, peak = int(c.warmup_steps), float(c.learning_rate)
  steps = sorted({0, 1, 2, warm // 2, warm - 1, warm, warm + 1, 100_000, int(c.num_steps) - 1})
  schedule = make_schedule(c)
  want = [_fairseq_rate(n, warm, float(c.warmup_init_lr), peak, c.schedule, float(c.min_lr),
                        int(c.num_steps) - warm) for n in steps]
  np.testing.assert_allclose([float(schedule(n)) for n in steps], want, rtol=2e-6)


def test_torch_cosine_is_the_srupp_scripts_schedule_step_by_step():
  """train.schedule="torch_cosine" (configs/enwik8_srupp.py) gives every update the rate of SRU++'s
  train_enwik8.py: torch's CosineAnnealingLR(optimizer, max_iter) stepped after every update from update 0, the
  rate overwritten during the warm-up by lr·(niter + 1) / warmup_steps (the plain cosine squeezed the decay into
  the updates after the warm-up: 8% above the script's rate near the end at the paper's 400k / 16k)."""
  import ml_collections
  import torch

  lr, warm, total = 3e-4, 8, 60
  param = torch.nn.Parameter(torch.zeros(1))
  opt = torch.optim.SGD([param], lr=lr)
  sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
  want = []
  for niter in range(total):
    if niter < warm:
      for group in opt.param_groups:
        group["lr"] = lr * (niter + 1) / warm
    want.append(opt.param_groups[0]["lr"])
    opt.step()
    sched.step()
  cfg = ml_collections.ConfigDict({"learning_rate": lr, "warmup_steps": warm, "warmup_init_lr": 1e-7,
                                   "schedule": "torch_cosine", "num_steps": total, "min_lr": 0.0})
  got = [float(make_schedule(cfg)(n)) for n in range(total)]
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-10)  # float32 cos near the end
  cfg.schedule = "cosine"  # the plain cosine differs: it restarts the decay at the warm-up's end
  assert abs(float(make_schedule(cfg)(total // 2)) - want[total // 2]) > 1e-3 * lr


def test_a_warm_restart_continues_a_partial_export_at_its_update(corpus, tmp_path):
  """train.export_on_stop exports the parameters of a stopped run to <workdir>/partial (its step recorded);
  train.init_from starts a fresh workdir from them: the first update is the uninterrupted run's update 4 on the
  same parameters, batch, dropout and learning rate (equal loss and lr), after which the runs differ (the
  optimizer's moments started afresh, as documented)."""
  base = dict(FAST, **{"train.num_steps": 6, "train.log_every": 1, "train.eval_every": 0,
                       "train.checkpoint_every": 100, "train.keep_best": False})
  straight = str(tmp_path / "straight")
  train.train_and_evaluate(tiny_config(corpus, **base), straight)
  stopped = str(tmp_path / "stopped")
  out = train.train_and_evaluate(tiny_config(corpus, **base, **{"train.stop_after": 3,
                                                                "train.export_on_stop": True}), stopped)
  assert out["step"] == 3 and not os.path.exists(os.path.join(stopped, "export"))
  meta = exports.read_export_meta(os.path.join(stopped, "partial"))
  assert (meta["step"], meta["partial"]) == (3, True)
  warm = str(tmp_path / "warm")
  done = train.train_and_evaluate(tiny_config(corpus, **base, **{"train.init_from": os.path.join(stopped, "partial")}),
                                  warm)
  assert done["step"] == 6
  a, b = _train_lines(straight), _train_lines(warm)
  assert [m["step"] for m in b] == [4, 5, 6]
  assert b[0]["loss"] == pytest.approx(a[3]["loss"], rel=1e-6) and b[0]["lr"] == pytest.approx(a[3]["lr"], rel=1e-7)
  assert b[1]["lr"] == pytest.approx(a[4]["lr"], rel=1e-7) and b[1]["loss"] != pytest.approx(a[4]["loss"], rel=1e-6)
  assert b[0]["skipped_total"] == 0
  # data.json records the export the warm restart started from
  record = json.load(open(os.path.join(warm, "data.json")))["init_from"]
  assert record == {"fingerprint": exports.fingerprint(os.path.join(stopped, "partial")), "step": 3}
  # A warm-started run that stopped resumes from its own checkpoint, without the export (found by a review: the
  # rerun read the export again, so it failed once the export was gone, and warm-started from a replaced one)
  interrupted = str(tmp_path / "interrupted")
  partial_copy = str(tmp_path / "partial_copy")
  shutil.copytree(os.path.join(stopped, "partial"), partial_copy)
  cfg = dict(base, **{"train.init_from": partial_copy})
  assert train.train_and_evaluate(tiny_config(corpus, **cfg, **{"train.stop_after": 1}), interrupted)["step"] == 4
  shutil.rmtree(partial_copy)
  assert train.train_and_evaluate(tiny_config(corpus, **cfg), interrupted)["step"] == 6
  c = _train_lines(interrupted)
  assert [m["step"] for m in c] == [4, 5, 6] and c[-1]["loss"] == pytest.approx(b[-1]["loss"], rel=1e-6)
  assert json.load(open(os.path.join(interrupted, "data.json")))["init_from"]["step"] == 3
  # Refused: a step at or past num_steps, another architecture
  with pytest.raises(ConfigError, match="is not an update below train.num_steps=3"):
    train.train_and_evaluate(tiny_config(corpus, **{**base, "train.num_steps": 3, "train.init_from":
                                                    os.path.join(stopped, "partial")}), str(tmp_path / "x"))
  with pytest.raises(ConfigError, match="another architecture or vocabulary"):
    train.train_and_evaluate(tiny_config(corpus, **base, **{"model.d_ff": 48, "train.init_from":
                                                           os.path.join(stopped, "partial")}), str(tmp_path / "y"))
  with pytest.raises(CheckpointError, match=r"^train.init_from=\S+nothere: checkpoint directory not found"):
    train.train_and_evaluate(tiny_config(corpus, **base, **{"train.init_from": str(tmp_path / "nothere")}),
                             str(tmp_path / "z"))
  # Read as trime_jax.load reads a path: a shipped model's name (here of another model: refused as such, where the
  # name was a missing folder before), a bare word that is neither, a training workdir (its export/)
  with pytest.raises(ConfigError, match=r"^train.init_from=\S+pretrained/demo is an export of another architecture"):
    train.train_and_evaluate(tiny_config(corpus, **base, **{"train.init_from": "demo"}), str(tmp_path / "d"))
  with pytest.raises(ConfigError, match=r"^train.init_from=dmeo: 'dmeo' is neither a path nor a shipped model"):
    train.train_and_evaluate(tiny_config(corpus, **base, **{"train.init_from": "dmeo"}), str(tmp_path / "d"))
  with pytest.raises(ConfigError, match=r"^train.init_from=\S+/warm/export: its meta.json step 6 is not an update"):
    train.train_and_evaluate(tiny_config(corpus, **base, **{"train.init_from": warm}), str(tmp_path / "w"))


def test_an_srupp_dev_protocol_names_its_streams(corpus):
  """A stateful model's dev perplexity depends on how many streams share the split (each starts from an empty
  state), so SRU++'s dev protocol holds eval.batch_size: a resume with another one measures the best again
  instead of comparing numbers of two protocols (found by a review). A Transformer's does not depend on it."""
  task = object.__new__(train.LMTask)
  srupp = {"model.backbone": "srupp", "model.key_type": "final"}
  four, eight = (tiny_config(corpus, **srupp, **{"eval.batch_size": n}) for n in (4, 8))
  assert task.dev_protocol(four)["streams"] == 4 and task.dev_protocol(eight)["streams"] == 8
  assert "streams" not in task.dev_protocol(tiny_config(corpus, **{"eval.batch_size": 8}))
