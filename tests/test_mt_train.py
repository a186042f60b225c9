"""End to end: TrimeMT_ext training in resumable chunks -> export -> mt.export.load_mt_export; the CLI's
one-line errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from trime_jax.configs import ui_de_en
from tests.test_mt_model import write_pairs
from trime_jax.errors import CheckpointError, ConfigError, DamagedCheckpointError
from trime_jax.mt import batching
from trime_jax.mt import data as mt_data
from trime_jax.mt import model as mt_model
from trime_jax.mt import export as mt_export
from trime_jax.mt import train as mt_train
from trime_jax import specs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(path, **trime):
  c = ui_de_en.get_config()
  c.data.update(path=str(path), vocab_size=200, cache_dir="", max_len=32, max_tokens=96)
  c.model.update(d_model=16, num_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1, dropout=0.1)
  c.trime.update(memory="ext", batching="bm25", bm25_k=3, bm25_backend="numpy", ce_warmup_steps=1, **trime)
  c.train.update(num_steps=6, warmup_steps=2, log_every=1, eval_every=4, checkpoint_every=2, eval_max_pairs=0)
  return c


# Short words: every pair fits the 8-token bucket, so training compiles one batch shape.
WDE = ["ja", "nein", "Datei", "Hilfe", "neu", "alt", "Ende", "Menü"]
WEN = ["yes", "no", "file", "help", "new", "old", "end", "menu"]


def test_train_resume_export_round_trip(tmp_path):
  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  work = str(tmp_path / "run")
  c = tiny_config(tmp_path / "d")
  c.train.stop_after = 3
  first = mt_train.train_and_evaluate(c, work, log=lambda s: None)
  assert first["step"] == 3 and not os.path.exists(os.path.join(work, "export"))
  plan = batching.Plan.load(os.path.join(work, "plan.npz"))
  assert plan.header["shapes"] == [[12, 8]] and plan.header["order"] == "bm25"  # rows·L <= max_tokens=96
  changed = tiny_config(tmp_path / "d")  # the LM trainer's rule (checkpoint.check_resume_config): a resumed run
  changed.train.learning_rate = 5e-4  # whose training fields changed is refused, naming them, before any work
  with pytest.raises(CheckpointError, match=r"holds a run with other settings \(train.learning_rate: 0.001 there"):
    mt_train.train_and_evaluate(changed, work, log=lambda s: None)
  out = mt_train.train_and_evaluate(tiny_config(tmp_path / "d"), work, log=lambda s: None)  # resumes at 3
  assert out["step"] == 6
  lines = [json.loads(l) for l in open(os.path.join(work, "metrics.jsonl"))]
  train_steps = [l["step"] for l in lines if "split" not in l]
  assert train_steps == [1, 2, 3, 4, 5, 6]
  assert [l["objective"] for l in lines if "split" not in l] == ["ce", "trime", "trime", "trime", "trime", "trime"]
  dev = [l for l in lines if l.get("split") == "valid"]
  assert [l["step"] for l in dev] == [4, 6] and all(np.isfinite(l["trime_ppl"]) for l in dev)
  # A rerun of the finished run trains nothing and returns: its export/ and best/ are its own (both were refused
  # as "an export of another model" once exports carried arch_digest; found by a helper's walk-through)
  assert sorted(d for d in ("export", "best") if os.path.isdir(os.path.join(work, d))) == ["best", "export"]
  again = mt_train.train_and_evaluate(tiny_config(tmp_path / "d"), work, log=lambda s: None)
  assert again["step"] == 6 and len(open(os.path.join(work, "metrics.jsonl")).readlines()) == len(lines)
  # A plan.npz of before 2026-12-07 (no hits rule, no k1 / b in its header) is kept, and the run is told how it
  # differs (batching.bm25.older_rules, the LM plan's check's words)
  plan_path = os.path.join(work, "plan.npz")
  held_plan = open(plan_path, "rb").read()
  old = batching.Plan.load(plan_path)
  old.header = {k: v for k, v in old.header.items() if k not in ("hits_include_query", "bm25_k1", "bm25_b")}
  os.remove(plan_path)
  old.save(plan_path)
  said = []
  mt_train.train_and_evaluate(tiny_config(tmp_path / "d"), work, log=said.append)
  note = [s for s in said if "plan.npz was made before 2026-12-07" in s]
  assert len(note) == 1 and "one more candidate per step" in note[0] and "k1 = 1.5, b = 0.75" in note[0], said
  assert "bm25_k1" not in batching.Plan.load(plan_path).header  # kept, not made again
  open(plan_path, "wb").write(held_plan)

  graphdef, params, config, vocab = mt_export.load_mt_export(out["export"])
  assert config.trime.memory == "ext" and vocab.kind == "spm"
  assert vocab.fingerprint() == mt_data.load_vocab(tiny_config(tmp_path / "d")).fingerprint()
  assert mt_model.count_params(params) == out["num_params"]
  pairs = mt_data.load_parallel(config, "valid", vocab)
  # The exported parameters score valid exactly as the run's final evaluation did.
  ev = mt_train.evaluate(graphdef, params, pairs, config, specs.objective_spec(config))
  assert ev == out["valid"] and np.isfinite(ev["trime_nll"]) and ev["pairs"] == len(pairs)
  # A config.json whose model section was edited without changing a shape (the key) is refused, as an LM
  # export's is (arch_digest); restored, it loads.
  config_path = os.path.join(out["export"], "config.json")
  held = open(config_path).read()
  edited = json.loads(held)
  edited["model"]["key_type"] = "final" if edited["model"]["key_type"] != "final" else "last_ffn_input"
  json.dump(edited, open(config_path, "w"))
  with pytest.raises(DamagedCheckpointError, match="describes another architecture than the one exported"):
    mt_export.load_mt_export(out["export"])
  open(config_path, "w").write(held)
  mt_export.load_mt_export(out["export"])
  # A changed export is refused.
  meta_path = os.path.join(out["export"], "meta.json")
  meta = json.load(open(meta_path))
  meta["params_digest"] = "0" * 16
  json.dump(meta, open(meta_path, "w"))
  try:
    mt_export.load_mt_export(out["export"])
    raise AssertionError("a damaged export must be refused")
  except DamagedCheckpointError as e:
    assert "digest" in str(e)


def test_cli_error_is_one_line(tmp_path):
  """launch/train_mt with missing data: one `error:` line, exit status 2, no traceback."""
  r = subprocess.run([sys.executable, "-m", "trime_jax.launch.train_mt", "--config=configs/ui_de_en.py",
                      f"--workdir={tmp_path / 'w'}", "--config.data.path=/nonexistent/mt"], cwd=REPO,
                     capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert r.returncode == 2, r.stderr[-2000:]
  errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert errors == ["error: parallel data file not found: /nonexistent/mt/train.de"], r.stderr[-2000:]
  assert "Traceback" not in r.stderr


def test_config_errors(tmp_path):
  for field, value, match in (("memory", "long", "trime.memory must be one of"),
                              ("batching", "consecutive", "trime.batching must be one of"),
                              ("sharded_variant", "tree", "trime.sharded_variant must be one of"),
                              ("sharded_variant", "ring", "memory_topk needs trime.sharded_variant='gather'"),
                              ("memory_grad", "some", "trime.memory_grad must be one of")):
    c = tiny_config(tmp_path)
    c.trime[field] = value
    with pytest.raises(ConfigError, match=match):
      mt_train.train_and_evaluate(c, str(tmp_path / "w"))
  c = tiny_config(tmp_path)
  c.train.label_smoothing = 0.1  # with memory=ext
  with pytest.raises(ConfigError, match="CE baseline"):
    mt_train.train_and_evaluate(c, str(tmp_path / "w"))


@pytest.mark.parametrize("field,value", [
    ("log_every", 0), ("checkpoint_every", 0), ("optimizer", "bogus"), ("schedule", "bogus"),
    ("learning_rate", -1.0), ("keep_checkpoints", 0), ("eval_every", -1), ("num_steps", 0),
    ("warmup_steps", -1), ("eval_max_pairs", -1), ("stop_after", -1)])
def test_train_section_is_checked(field, value):
  """The shared train section (runtime.config.check_train_section) is refused by the MT validator too, naming the
  field, before anything divides by it or trains with another optimizer (validation only, no data read)."""
  c = ui_de_en.get_config()
  c.train[field] = value
  with pytest.raises(ConfigError, match=f"train.{field} must be"):
    mt_train.validate_config(c)


@pytest.mark.parametrize("section,field,value,match", [
    ("data", "max_sentences", -1, "data.max_sentences must be >= 0"),  # a ValueError traceback at the first batch
    ("data", "max_len", -1, "data.max_len must be >= 0"),  # "no usable sentence pairs"
    ("model", "num_heads", 0, "model.num_heads must be >= 1"),  # ZeroDivisionError
    ("model", "d_ff", 0, "model.d_ff must be >= 1"),  # ZeroDivisionError in the initialiser
    ("model", "num_heads", 3, "not divisible by num_heads=3"),  # ValueError tracebacks from MTConfig
    ("model", "key_type", "foo", "model.key_type must be one of"),
    ("model", "encoder_layers", 0, "model.encoder_layers and model.decoder_layers must be >= 1"),
    ("model", "dtype", "float8", "model.dtype must be a floating dtype"),  # TypeError
    ("model", "dropout", 1.5, r"model.dropout must be in \[0, 1\)"),  # trained silently
    ("model", "attention_dropout", -0.1, r"model.attention_dropout must be in \[0, 1\)"),
    ("model", "max_len", 16, "model.max_len=16 positions are fewer than the longest batch's 128"),  # traceback
    ("trime", "bm25_k", 0, "trime.bm25_k must be >= 2"),  # a "BM25" plan with no neighbours, trained silently
    ("data", "pack_len", 2048, "model.max_len=1024 positions are fewer than data.pack_len=2048"),  # traceback
])
def test_model_and_length_fields_are_checked(section, field, value, match):
  """The model section and data lengths are refused by the validator, naming the field, before the workdir is
  written (found by a walk-through: tracebacks once training started, or silent training)."""
  c = ui_de_en.get_config()
  c.trime.batching = "bm25"
  c[section][field] = value
  with pytest.raises(ConfigError, match=match):
    mt_train.validate_config(c)
  mt_train.validate_config(ui_de_en.get_config())  # the shipped config passes


def test_bad_model_field_is_one_error_line_and_leaves_no_workdir(tmp_path):
  """The CLI: exit 2, one `error:` line, and no workdir left to refuse the corrected rerun."""
  r = subprocess.run([sys.executable, "-m", "trime_jax.launch.train_mt", "--config=configs/ui_de_en.py",
                      f"--workdir={tmp_path / 'w'}", "--config.data.path=/nonexistent/mt", "--config.model.num_heads=3"],
                     cwd=REPO, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert r.returncode == 2 and len(errors) == 1 and "not divisible by num_heads=3" in errors[0], r.stderr[-2000:]
  assert "Traceback" not in r.stderr and not (tmp_path / "w").exists()


@pytest.mark.parametrize("field", ["optimizer", "schedule"])
def test_unknown_optimizer_or_schedule_is_refused_by_the_runtime(field):
  """runtime.optim raises on a name it does not know instead of falling through to another optimizer/schedule."""
  from trime_jax.runtime import optim

  c = ui_de_en.get_config()
  c.train[field] = "bogus"
  with pytest.raises(ConfigError, match=f"train.{field} must be one of"):
    optim.make_optimizer(c.train)


def test_target_token_budget_sets_the_run_length():
  from tests.test_mt_model import synthetic_pairs

  pairs = synthetic_pairs(120)
  plan = batching.make_plan(pairs, order="random", max_tokens=128, seed=2)
  tokens_of = mt_train.plan_target_tokens(pairs, plan)
  assert tokens_of.sum() == sum(len(t) + 1 for t in pairs.tgt)
  assert len(mt_train.target_tokens_seen(plan, tokens_of, 50, 0)) == 50
  seen = mt_train.target_tokens_seen(plan, tokens_of, 10_000, 1000)
  assert seen.tolist() == np.cumsum([tokens_of[plan.update_at(s)[0]] for s in range(len(seen))]).tolist()
  assert seen[-1] >= 1000 > seen[-2]
  assert len(mt_train.target_tokens_seen(plan, tokens_of, 3, 10**9)) == 3  # num_steps stays the cap


def test_num_epochs_ends_the_run_after_that_many_passes(tmp_path):
  """train.num_epochs (fairseq's --max-epoch): the run is that many passes over the plan's batches, or
  train.num_steps when fewer (--max-update)."""
  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  c = tiny_config(tmp_path / "d")
  c.train.update(num_steps=100, num_epochs=2, eval_every=0, checkpoint_every=100)
  work = str(tmp_path / "run")
  out = mt_train.train_and_evaluate(c, work, log=lambda s: None)
  plan = batching.Plan.load(os.path.join(work, "plan.npz"))
  assert plan.num_batches == 2 and out["step"] == 4  # 24 pairs, 12 rows per batch: 2 batches per epoch
  c.train.update(num_steps=3)
  assert mt_train.run_updates(c.train, plan) == 3
  c.train.update(num_epochs=0)
  assert mt_train.run_updates(c.train, plan) == 3
  c.train.update(num_epochs=-1)
  with pytest.raises(ConfigError, match="train.num_epochs must be >= 0"):
    mt_train.validate_config(c)


def test_iwslt_config_is_the_original_run_as_its_code_runs_it():
  """configs/iwslt_de_en.py: the original's train.py resets its criterion to the TRIME loss before every batch
  unless --ce-warmup-ratio is given (so --ce-warmup-epoch 5 never applies); --max-epoch 50 (the paper's table's
  170k updates the cap); its 4 GPUs all_gather keys without gradient (local_only); fairseq inverse_sqrt from 0."""
  from trime_jax.configs import iwslt_de_en
  c = iwslt_de_en.get_config()
  assert c.trime.ce_warmup_steps == 0 and c.trime.memory_grad == "local_only" and c.trime.memory_grad_groups == 4
  assert (c.train.num_epochs, c.train.num_steps, c.train.warmup_init_lr) == (50, 170_000, 0.0)
  assert (c.trime.tau, c.trime.memory_topk, c.data.max_tokens) == (10.0, 8, 16384)
  mt_train.validate_config(c)


def test_packed_training_equals_padded_training(tmp_path):
  """data.pack_len: the same plan batches, packed, train to the same losses update for update (dropout off)."""
  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  losses = {}
  for pack_len in (0, 32):
    c = tiny_config(tmp_path / "d")
    c.model.dropout = 0.0
    c.data.pack_len = pack_len
    c.train.update(num_steps=4, eval_every=0)
    work = str(tmp_path / f"run{pack_len}")
    mt_train.train_and_evaluate(c, work, log=lambda s: None)
    losses[pack_len] = [json.loads(l)["loss"] for l in open(os.path.join(work, "metrics.jsonl"))
                        if '"split"' not in l]
  assert len(losses[0]) == 4
  np.testing.assert_allclose(losses[32], losses[0], rtol=1e-5)
  c = tiny_config(tmp_path / "d")
  c.data.pack_len = 16  # below data.max_len=32
  with pytest.raises(ConfigError, match="pack_len"):
    mt_train.train_and_evaluate(c, str(tmp_path / "w"))


def test_mt_workdir_lock_and_stored_config_are_checked_before_data(tmp_path):
  """One run per MT workdir (the runtime's lock, the holder named) and no unknown field in its config.json:
  both refused before any data is read (the data path here does not exist)."""
  from tests.test_train import _hold, _release
  from trime_jax.runtime.lock import LockedError

  c = tiny_config(tmp_path / "no_data")
  work = tmp_path / "run"
  work.mkdir()
  holder = _hold(work / ".lock")
  try:
    with pytest.raises(LockedError, match=f"workdir {work} is in use by process {holder.pid} "):
      mt_train.train_and_evaluate(c, str(work), log=lambda s: None)
  finally:
    _release(holder)
  stored = json.loads(c.to_json_best_effort())
  stored["train"]["lerning_rate"] = 1.0
  (work / "config.json").write_text(json.dumps(stored))
  with pytest.raises(CheckpointError, match=r"config.json has field .*train.lerning_rate \(train.learning_rate\?\)"):
    mt_train.train_and_evaluate(c, str(work), log=lambda s: None)
  assert sorted(os.listdir(work)) == ["config.json"]


def test_cli_requires_workdir():
  r = subprocess.run([sys.executable, "-m", "trime_jax.launch.train_mt", "--config=configs/ui_de_en.py"], cwd=REPO,
                     capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO,
                                                                          JAX_PLATFORMS="cpu"))
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert [l for l in r.stderr.splitlines() if l.startswith("error:")] == [
      "error: --workdir is required: the run directory for checkpoints, metrics.jsonl and export/ "
      "(e.g. --workdir=runs/ui_vanilla); rerunning with the same --workdir resumes"], r.stderr[-2000:]


def test_mt_export_target_of_another_kind_is_refused_before_training(tmp_path):
  from trime_jax.errors import CheckpointError

  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  work = tmp_path / "run"
  (work / "export").mkdir(parents=True)
  (work / "export" / "notes.txt").write_text("mine\n")
  with pytest.raises(CheckpointError, match=f"export target {work / 'export'} holds 1 file that is not an export"):
    mt_train.train_and_evaluate(tiny_config(tmp_path / "d"), str(work), log=lambda s: None)
  assert not (work / "checkpoints").exists() and (work / "export" / "notes.txt").read_text() == "mine\n"


def test_translation_trains_in_the_shared_loop(tmp_path):
  """The translation trainer runs the LM trainer's loop (runtime.loop): TensorBoard scalars, the best valid export
  (train.keep_best, by ce_ppl), the final valid metrics in the export's meta.json, and a non-finite loss stops the
  run with the LM trainer's error."""
  from tests.test_observability import scalars
  from trime_jax.errors import TrainingError

  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  work = tmp_path / "run"
  c = tiny_config(tmp_path / "d")
  c.train.eval_every = 2
  out = mt_train.train_and_evaluate(c, str(work), log=lambda s: None)
  lines = [json.loads(l) for l in open(work / "metrics.jsonl")]
  train = [l for l in lines if "split" not in l]
  valid = [l for l in lines if l.get("split") == "valid"]
  assert [l["step"] for l in valid] == [2, 4, 6]
  assert [l["target_tokens_seen"] for l in train] == sorted(l["target_tokens_seen"] for l in train)
  tb = scalars(work / "tb")
  assert [s for s, _ in tb["train/loss"]] == [l["step"] for l in train]
  np.testing.assert_array_equal([v for _, v in tb["train/loss"]], np.float32([l["loss"] for l in train]))
  for key in ("ce_ppl", "trime_ppl"):
    assert tb[f"valid/{key}"] == [(l["step"], np.float32(l[key])) for l in valid]
  best = json.load(open(work / "best" / "meta.json"))
  i = int(np.argmin([l["ce_ppl"] for l in valid]))
  assert best["best_metric"] == "ce_ppl" and best["dev_ppl"] == valid[i]["ce_ppl"] and best["step"] == valid[i]["step"]
  graphdef, params, config, vocab = mt_export.load_mt_export(str(work / "best"))  # a complete, checked export
  assert json.load(open(os.path.join(out["export"], "meta.json")))["valid"] == out["valid"] == {
      k: v for k, v in valid[-1].items() if k not in ("step", "split", "dev_protocol")}
  assert valid[-1]["dev_protocol"] == {"eval_max_pairs": 0}  # how valid was measured, in its lines

  c = tiny_config(tmp_path / "d")
  c.train.update(learning_rate=float("inf"), warmup_steps=0)
  with pytest.raises(TrainingError, match=r"^the parameters after update \d+ are not finite .*nothing was exported"):
    mt_train.train_and_evaluate(c, str(tmp_path / "nan"), log=lambda s: None)  # diverged at once, stopped at the end
  assert not os.path.exists(tmp_path / "nan" / "export")


def test_best_by_valid_bleu_keeps_the_highest_as_the_original(tmp_path):
  """train.best_metric="bleu" (configs/iwslt_de_en.py: the original's --best-checkpoint-metric bleu with
  --eval-bleu beam 5, max length 1.2·x + 10): every valid line has the BLEU of beam-search translations, best/
  holds the parameters of the highest (ties: the last, as fairseq's is_better, a >= b), and its BLEU is what mt.train.valid_bleu gives for those
  parameters; the protocol names the search."""
  import dataclasses

  from trime_jax.configs import iwslt_de_en

  assert iwslt_de_en.get_config().train.best_metric == "bleu"
  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  work = tmp_path / "run"
  c = tiny_config(tmp_path / "d")
  c.train.update(eval_every=2, best_metric="bleu", learning_rate=3e-3)
  mt_train.train_and_evaluate(c, str(work), log=lambda s: None)
  valid = [json.loads(l) for l in open(work / "metrics.jsonl") if '"split": "valid"' in l]
  assert [l["step"] for l in valid] == [2, 4, 6] and all(0 <= l["bleu"] <= 100 for l in valid)
  assert valid[0]["dev_protocol"]["bleu_search"] == dataclasses.asdict(mt_train.VALID_BLEU_SEARCH)
  best = json.load(open(work / "best" / "meta.json"))
  bleus = [l["bleu"] for l in valid]
  i = len(bleus) - 1 - int(np.argmax(bleus[::-1]))  # the last of the highest
  assert best["best_metric"] == "bleu" and (best["step"], best["dev_ppl"]) == (valid[i]["step"], valid[i]["bleu"])
  graphdef, params, config, vocab = mt_export.load_mt_export(str(work / "best"))
  pairs = mt_data.load_parallel(c, "valid", vocab)
  assert mt_train.valid_bleu(graphdef, params, pairs, c, vocab) == pytest.approx(best["dev_ppl"], abs=1e-9)
  with pytest.raises(ConfigError, match="train.best_metric must be one of"):
    bad = tiny_config(tmp_path / "d")
    bad.train.best_metric = "accuracy"
    mt_train.train_and_evaluate(bad, str(tmp_path / "bad"), log=lambda s: None)


def test_a_refused_fresh_run_leaves_no_plan_in_its_workdir(tmp_path):
  """The batch plan is made before training's own refusals (a mesh of more devices than are visible) and saved
  only once the run starts: a refused run leaves its workdir as it was (it left plan.npz)."""
  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  work = tmp_path / "run"
  c = tiny_config(tmp_path / "d")
  c.train.num_devices = 999
  with pytest.raises(ConfigError, match="train.num_devices=999 but only"):
    mt_train.train_and_evaluate(c, str(work), log=lambda s: None)
  assert not (work / "plan.npz").exists()


def test_a_resume_over_other_training_pairs_is_refused_and_a_plan_of_other_pairs_is_not_reused(tmp_path, monkeypatch):
  """The MT trainer records its training pairs' fingerprint (<workdir>/data.json, and in the batch plan): pairs
  rewritten between two invocations are refused on resume, as the LM trainer refuses another training split (it
  resumed on them, and reused the old plan whenever the number of pairs was the same)."""
  from trime_jax.mt import data as mt_data

  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  work = str(tmp_path / "run")
  c = tiny_config(tmp_path / "d")
  c.train.stop_after = 3
  mt_train.train_and_evaluate(c, work, log=lambda s: None)
  plan = batching.Plan.load(os.path.join(work, "plan.npz"))
  vocab = mt_data.load_vocab(c)
  assert plan.header["pairs_fingerprint"] == mt_data.load_parallel(c, "train", vocab).fingerprint()
  # a lost plan made again otherwise (say, by a version that orders pairs differently) is refused too, not
  # trained on from the resume
  os.remove(os.path.join(work, "plan.npz"))
  real = batching.make_plan

  def reordered(*a, **k):
    made = real(*a, **k)
    return batching.Plan(made.indices[::-1].copy(), made.offsets, made.lengths, made.rows, made.header)

  monkeypatch.setattr(batching, "make_plan", reordered)
  with pytest.raises(CheckpointError, match=r"was trained on other data \(batch_plan_digest: "):
    mt_train.train_and_evaluate(tiny_config(tmp_path / "d"), work, log=lambda s: None)
  monkeypatch.setattr(batching, "make_plan", real)
  assert not os.path.exists(os.path.join(work, "plan.npz"))  # the refused run saved none
  plan.save(os.path.join(work, "plan.npz"))
  write_pairs(tmp_path / "d", WDE[::-1] * 3, WEN[::-1] * 3)  # the same number of pairs, other pairs
  with pytest.raises(CheckpointError, match=r"was trained on other data \(train_fingerprint: "):
    mt_train.train_and_evaluate(tiny_config(tmp_path / "d"), work, log=lambda s: None)
  assert batching.Plan.load(os.path.join(work, "plan.npz")).header == plan.header  # left as it was


def test_memory_grad_groups_cut_key_gradients_between_row_groups():
  """trime.memory_grad_groups = G on one device (the original's G GPUs all_gathering each other's keys without
  gradient): the same loss; every parameter's gradient equals a reference that sums, per group of ceil(B / G)
  contiguous rows, its queries' TRIME loss with the other groups' keys detached; and it differs from no cut."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tests.test_mt_model import synthetic_pairs
  from trime_jax import loss as L

  pairs = synthetic_pairs(16, seed=3)
  plan = batching.make_plan(pairs, order="random", max_tokens=128, seed=0)
  batch = {k: jnp.asarray(v) for k, v in batching.collate_batch(pairs, plan, 0).items()}
  c = tiny_config("unused", memory_topk=0)
  c.model.dropout = 0.0
  spec = specs.objective_spec(c)
  model = mt_model.build_mt_model(specs.mt_model_config(c, vocab_size=len(pairs.vocab)), 0)
  graphdef, params = nnx.split(model, nnx.Param)
  b, groups = batch["targets"].shape[0], 3
  assert b > groups
  cut = -(-b // groups)

  def ours(p, g):
    return mt_train.mt_nll(nnx.merge(graphdef, p), batch, spec, use_trime=True, grad_groups=g)[0]

  def reference(p):
    m = nnx.merge(graphdef, p)
    enc = m.encode(batch["src"])
    f, keys = m.decode(enc, batch["src"], batch["prev"])
    stats = m.vocab_stats(f, batch["targets"])
    total = 0.0
    for k in range(groups):
      mine = (jnp.arange(b) // cut == k)[:, None]
      seen = jnp.where(mine[..., None], keys, jax.lax.stop_gradient(keys))
      nll = L.trime_nll_from_vocab_stats(stats, seen, batch["targets"], spec, drop_local=True)
      total = total + jnp.where(mine, nll, 0.0).sum()
    return total

  (v_cut, g_cut), (v_ref, g_ref) = (jax.value_and_grad(ours)(params, groups), jax.value_and_grad(reference)(params))
  v_all, g_all = jax.value_and_grad(ours)(params, 0)
  np.testing.assert_allclose(v_cut, v_ref, rtol=1e-5)
  np.testing.assert_allclose(v_cut, v_all, rtol=1e-5)  # values unchanged
  for a, r in zip(jax.tree_util.tree_leaves(g_cut), jax.tree_util.tree_leaves(g_ref)):
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6)
  assert max(float(jnp.abs(a - r).max()) for a, r in zip(jax.tree_util.tree_leaves(g_cut),
                                                          jax.tree_util.tree_leaves(g_all))) > 1e-5


@pytest.mark.parametrize("pack_len", [0, 32])
def test_the_originals_composition_trains_and_its_plan_is_not_taken_for_ours(tmp_path, pack_len):
  """data.batches_per_update = 2 with trime.memory_grad_groups = 2 (padded, and packed per GPU batch): a run
  trains on updates of 2 GPU batches (plan.npz records them); a workdir's plan of one composition is not reused
  by a config of the other (both directions: a plan written before the field is ours)."""
  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  work = str(tmp_path / "run")
  c = tiny_config(tmp_path / "d", memory_grad_groups=2)
  c.data.update(batches_per_update=2, pack_len=pack_len)  # GPU batches of 48 tokens
  c.train.update(num_steps=4, eval_every=0)
  out = mt_train.train_and_evaluate(c, work, log=lambda s: None)
  assert out["step"] == 4 and np.isfinite(out["valid"]["trime_ppl"])
  plan = batching.Plan.load(os.path.join(work, "plan.npz"))
  assert plan.header["batches_per_update"] == 2 and plan.per_update == 2
  pairs = mt_data.load_parallel(c, "train", mt_data.load_vocab(c))
  gpu = batching.fairseq_batches(plan.indices, batching.pair_lengths(*pairs.lengths()), 48, 8)
  assert len(gpu) > 2 and [len(b) for b in gpu] == plan.rows.tolist()
  ours = tiny_config(tmp_path / "d")
  again, made = mt_train.load_plan(work, pairs, c)
  assert not made and again.digest() == plan.digest()
  other, made = mt_train.load_plan(work, pairs, ours)
  assert made and other.per_update == 0
  other.save(os.path.join(work, "plan.npz"))
  assert mt_train.load_plan(work, pairs, c)[1]  # ours is not reused for the original's composition


def test_separate_dictionaries_train_export_and_translate(tmp_path):
  """data.dictionaries="separate" (configs/iwslt_de_en.py) end to end: a fairseq-format run trains a decoder of
  the target dictionary's size, exports (the vocabulary file keeps its sides), and the export builds a datastore
  and translates with a beam of that vocabulary (trime_release over the datastore included)."""
  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  c = tiny_config(tmp_path / "d")
  c.data.update(format="fairseq", dictionaries="separate")
  c.model.share_all_embeddings = False  # the original's: --share-decoder-input-output-embed only
  c.train.update(num_steps=3, eval_every=0)
  work = tmp_path / "run"
  mt_train.train_and_evaluate(c, str(work), log=lambda s: None)
  graphdef, params, _, vocab = mt_export.load_mt_export(str(work / "export"))
  assert vocab.separate and vocab.target_size == 16 < vocab.size  # 4 + 8 English words, padded to 16
  assert params["tgt_embed"]["embedding"].shape[0] == 16 and params["src_embed"]["embedding"].shape[0] == vocab.size
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  run = lambda *a: subprocess.run([sys.executable, "-m", *a], cwd=REPO, env=env, capture_output=True, text=True)
  # a language-model --config for a translation export: refused (its build read the export's config instead)
  r = run("trime_jax.launch.build_datastore", "--config=configs/demo.py", f"--checkpoint={work}/export",
          f"--out={tmp_path}/ds", "--index=flat")
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
      f"error: --checkpoint={work}/export is a translation export and --config (or a --config.x override) a "
      "language-model config"), r.stderr[-2000:]
  assert not (tmp_path / "ds").exists()
  r = run("trime_jax.launch.build_datastore", f"--checkpoint={work}/export", f"--out={tmp_path}/ds", "--index=flat")
  assert r.returncode == 0, r.stderr[-2000:]
  r = run("trime_jax.launch.translate", f"--checkpoint={work}/export", f"--datastore={tmp_path}/ds", "--mode=trime_release",
          "--k=4", f"--out={tmp_path}/tr", "--split=test", "--allow_split_overlap")
  assert r.returncode == 0, r.stderr[-2000:]
  hyp = (tmp_path / "tr" / "test.trime_release.hyp").read_text().splitlines()
  assert len(hyp) == len(WDE * 3) and all(w in WEN or w == "<unk>" for line in hyp for w in line.split())


def test_a_run_stored_before_a_field_was_added_resumes_as_it_ran(tmp_path):
  """A workdir whose config.json predates data.dictionaries / data.batches_per_update ran with one joint
  dictionary and one bucketed batch an update: resuming it with those values goes on; with the paper config's
  new values the refusal names the field (it was a refusal about the vocabulary or the batches)."""
  write_pairs(tmp_path / "d", WDE * 3, WEN * 3)
  work = tmp_path / "run"
  c = tiny_config(tmp_path / "d")
  c.train.stop_after = 2
  mt_train.train_and_evaluate(c, str(work), log=lambda s: None)
  stored = json.loads((work / "config.json").read_text())
  for field in ("dictionaries", "batches_per_update", "batch_size_multiple"):
    stored["data"].pop(field)
  (work / "config.json").write_text(json.dumps(stored))
  changed = tiny_config(tmp_path / "d", memory_grad_groups=2)
  changed.data.batches_per_update = 2
  with pytest.raises(CheckpointError, match=r"data.batches_per_update: 0 there, 2 now"):
    mt_train.train_and_evaluate(changed, str(work), log=lambda s: None)
  out = mt_train.train_and_evaluate(tiny_config(tmp_path / "d"), str(work), log=lambda s: None)  # as it ran
  assert out["step"] == 6
