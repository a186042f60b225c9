"""Training: the loss goes down, CE warm-up then TRIME, exact resume, accumulation, non-finite losses."""

import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import read_metrics, tiny_config, write_text_file
from trime_jax import checkpoint as ckpt, data, exports
from trime_jax.errors import ConfigError, TrainingError
from trime_jax.train import train_and_evaluate
from trime_jax import specs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_text_file(tmp_path_factory.mktemp("data") / "text.bin", 60_000)


def _train_lines(workdir):
  return [m for m in read_metrics(workdir) if "loss" in m]


def test_loss_goes_down_and_ce_warmup_switches_objective(corpus, tmp_path):
  cfg = tiny_config(corpus, **{"train.num_steps": 40, "trime.ce_warmup_steps": 5, "model.dropout": 0.0})
  out = train_and_evaluate(cfg, str(tmp_path / "run"))
  lines = _train_lines(tmp_path / "run")
  assert [m["objective"] for m in lines[:6]] == ["ce"] * 5 + ["trime"]
  for m in lines:  # the optimised loss is the one the objective names; both are always reported
    assert m["loss"] == pytest.approx(m["ce_nll"] if m["objective"] == "ce" else m["trime_nll"], rel=1e-6)
  first = np.mean([m["trime_nll"] for m in lines[:3]])
  last = np.mean([m["trime_nll"] for m in lines[-3:]])
  assert last < first - 0.5, (first, last)
  assert os.path.isdir(out["export"]) and "trime_local(tau=1)_ppl" in out["dev"]


def test_resume_continues_identically(corpus, tmp_path):
  cfg = tiny_config(corpus, **{"train.num_steps": 6, "trime.ce_warmup_steps": 2})
  train_and_evaluate(cfg, str(tmp_path / "straight"))
  half = tiny_config(corpus, **{"train.num_steps": 3, "trime.ce_warmup_steps": 2})
  train_and_evaluate(half, str(tmp_path / "resumed"))  # "interrupted" after the step-3 checkpoint
  train_and_evaluate(cfg, str(tmp_path / "resumed"))  # same command again: resumes at step 3
  a = _train_lines(tmp_path / "straight")
  b = _train_lines(tmp_path / "resumed")
  assert [m["step"] for m in b] == list(range(1, 7))  # metrics past the checkpoint were not duplicated
  assert [m["loss"] for m in a] == [m["loss"] for m in b]
  pa = exports.load_export(str(tmp_path / "straight" / "export"))[1]
  pb = exports.load_export(str(tmp_path / "resumed" / "export"))[1]
  for x, y in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)):
    np.testing.assert_array_equal(x, y)


def test_gradient_accumulation_matches_one_big_batch(corpus, tmp_path):
  common = {"train.num_steps": 2, "trime.memory": "none", "model.dropout": 0.0, "train.learning_rate": 1e-2,
            "train.warmup_steps": 0, "train.log_every": 1}
  one = tiny_config(corpus, **common, **{"train.batch_size": 4, "train.grad_accum": 1})
  two = tiny_config(corpus, **common, **{"train.batch_size": 2, "train.grad_accum": 2})
  train_and_evaluate(one, str(tmp_path / "one"))
  train_and_evaluate(two, str(tmp_path / "two"))
  a, b = _train_lines(tmp_path / "one"), _train_lines(tmp_path / "two")
  np.testing.assert_allclose([m["loss"] for m in a], [m["loss"] for m in b], rtol=1e-5)
  np.testing.assert_allclose([m["grad_norm"] for m in a], [m["grad_norm"] for m in b], rtol=1e-4)


def test_non_finite_loss_stops_with_a_clear_error(corpus, tmp_path):
  """An infinite step size: update 1 makes the parameters infinite, every later update is non-finite and
  skipped. Ten in a row stop training within loop.SKIP_READ_LAG updates, wherever the log lines fall (a line
  every 100 updates stopped it only at update 100); a run that ends sooner exports nothing."""
  from trime_jax.runtime.loop import SKIP_READ_LAG

  for log_every, stopped in ((1, 11), (4, 12), (100, 11 + SKIP_READ_LAG)):
    cfg = tiny_config(corpus, **{"train.num_steps": 40, "train.learning_rate": float("inf"),
                                 "train.warmup_steps": 0, "train.log_every": log_every,
                                 "train.checkpoint_every": 9})
    with pytest.raises(TrainingError, match=r"^training diverged: updates 2-11 all had a non-finite loss or "
                                            rf"gradient \(10 in a row; .*stopped at update {stopped}\); the last "
                                            r"checkpoint \(update 9, in "):
      train_and_evaluate(cfg, str(tmp_path / f"nan{log_every}"))
  cfg = tiny_config(corpus, **{"train.num_steps": 6, "train.learning_rate": float("inf"), "train.warmup_steps": 0})
  with pytest.raises(TrainingError, match=r"^the parameters after update 6 are not finite \(\d+ arrays, e\.g\. "
                                          r".*nothing was exported"):
    train_and_evaluate(cfg, str(tmp_path / "short"))
  assert not os.path.exists(tmp_path / "short" / "export")


def test_config_errors(corpus, tmp_path):
  with pytest.raises(ConfigError, match="trime.memory"):
    train_and_evaluate(tiny_config(corpus, **{"trime.memory": "global"}), str(tmp_path / "x"))
  with pytest.raises(ConfigError, match="vocab_size"):
    train_and_evaluate(tiny_config(corpus, **{"model.vocab_size": 1000}), str(tmp_path / "y"))
  with pytest.raises(ConfigError, match="max_len"):
    train_and_evaluate(tiny_config(corpus, **{"data.segment_len": 128}), str(tmp_path / "z"))


def test_every_shipped_config_is_valid():
  import glob
  import importlib

  from trime_jax.train import validate_config

  names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                           "*.py")) if not p.endswith("__init__.py"))
  assert {"default", "demo", "wikitext_mini", "wiki103_247m", "wiki103_150m", "wiki103_7m", "enwik8_38m"} <= set(names)
  from trime_jax.mt import train as mt_train

  for name in names:  # each family by its own validator: LM configs and MT configs
    config = importlib.import_module(f"trime_jax.configs.{name}").get_config()
    (mt_train.validate_config if exports.is_mt_config(config) else validate_config)(config)


@pytest.mark.parametrize("optimizer", ["adam", "nag"])
def test_weight_decay_is_decoupled_like_fairseq(optimizer):
  """fairseq's Adam and NAG both decay weights outside the adaptive / momentum update: with a zero gradient
  one step multiplies the parameters by exactly 1 - lr·wd (an L2 term inside NAG's momentum would give
  1 - lr·(1 + momentum)·wd)."""
  from trime_jax.configs import default
  from trime_jax.runtime.optim import make_optimizer

  r = default.get_config().train
  r.unlock()
  r.optimizer, r.weight_decay, r.learning_rate, r.warmup_steps, r.schedule = optimizer, 0.01, 0.5, 0, "constant"
  tx, _ = make_optimizer(r)
  params = {"w": jnp.asarray([1.0, -2.0, 3.0])}
  updates, _ = tx.update(jax.tree_util.tree_map(jnp.zeros_like, params), tx.init(params), params)
  np.testing.assert_allclose(params["w"] + updates["w"], params["w"] * (1 - 0.5 * 0.01), rtol=1e-6)


@pytest.mark.parametrize("field,value,message", [
    ("train.log_every", 0, "train.log_every must be >= 1"),
    ("train.checkpoint_every", 0, "train.checkpoint_every must be >= 1"),
    ("train.keep_checkpoints", 0, "train.keep_checkpoints must be >= 1"),
    ("train.learning_rate", -1.0, "train.learning_rate must be > 0"),
    ("train.weight_decay", -0.1, "train.weight_decay must be >= 0"),
    ("model.dropout", 1.5, r"model.dropout must be in \[0, 1\)"),
    ("model.attention_dropout", -0.1, r"model.attention_dropout must be in \[0, 1\)"),
    ("model.num_heads", 3, "not divisible by model.num_heads=3"),
    ("eval.batch_size", -1, "eval.batch_size must be >= 1"),
    ("eval.batch_size", 0, "eval.batch_size must be >= 1"),
    ("eval.max_tokens", -5, "eval.max_tokens must be >= 0"),
    ("eval.context_window", 256, "eval.context_window=256 must be shorter than eval.block_len=256"),
    ("train.progress", "fancy", "train.progress must be one of"),
    ("train.profile_steps", "5,3", "1 <= first <= last"),
    ("train.profile_steps", "0", "1 <= first <= last"),
    ("train.profile_steps", "2,400", "train.num_steps=300"),
    ("train.profile_steps", "a,b", "'FIRST,LAST' or 'STEP'"),
    ("train.profile_steps", "1,2,3", "'FIRST,LAST' or 'STEP'"),
])
def test_out_of_range_fields_are_refused_before_compiling(field, value, message):
  """Each bad value is one ConfigError naming the field, raised by validate_config (before any compilation);
  the shipped configs stay valid (test_every_shipped_config_is_valid)."""
  from trime_jax.configs import default
  from trime_jax.train import validate_config

  cfg = default.get_config()
  section, name = field.split(".")
  with cfg.unlocked():
    cfg[section][name] = value
  with pytest.raises(ConfigError, match=message):
    validate_config(cfg)


# ----------------------------------------------------------------------------------------------------------
# One writer per directory, exports that refuse another model's directory (issue 35); no training needed.
# ----------------------------------------------------------------------------------------------------------
def _hold(lock_path):
  """Another process holding `lock_path` as a running training would (until its stdin closes)."""
  import subprocess
  import sys

  code = ("import sys\nfrom trime_jax.runtime.lock import DirLock\n"
          "with DirLock(sys.argv[1], 'x'):\n  print('held', flush=True)\n  sys.stdin.read()\n")
  p = subprocess.Popen([sys.executable, "-c", code, str(lock_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert p.stdout.readline().strip() == "held"
  return p


def _release(p):
  p.stdin.close()
  p.wait(timeout=30)


def _tiny_export_args():
  from flax import nnx

  from trime_jax.configs import default
  from trime_jax import data as D
  from trime_jax.model import TransformerLM

  c = default.get_config()
  c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.d_ff, c.model.max_len = 1, 16, 2, 32, 32
  vocab = D.Vocab.bytes()
  model = TransformerLM(specs.model_config(c, vocab_size=len(vocab)), rngs=nnx.Rngs(params=0))
  return nnx.split(model, nnx.Param)[1], c, vocab


def test_workdir_lock_names_the_holder_and_is_released(corpus, tmp_path):
  from trime_jax.runtime.lock import LockedError

  work = tmp_path / "run"
  work.mkdir()
  holder = _hold(work / ".lock")
  try:
    with pytest.raises(LockedError, match=f"workdir {work} is in use by process {holder.pid} "):
      train_and_evaluate(tiny_config(corpus, **{"train.num_steps": 2}), str(work))
  finally:
    _release(holder)
  assert sorted(os.listdir(work)) == []  # the refused run wrote nothing; the holder removed its lock file
  from trime_jax.runtime.lock import DirLock

  with DirLock(str(work / ".lock"), "w"), DirLock(str(work / ".lock"), "w"):  # free again; reentrant in-process
    assert os.path.exists(work / ".lock")
  assert not os.path.exists(work / ".lock")
  nested = work / "new" / "parents" / "ds.lock"  # an --out in folders not made yet: made, as for any output
  with DirLock(str(nested), "datastore"):
    assert nested.exists()


def test_workdir_that_is_a_file_is_refused(corpus, tmp_path):
  f = tmp_path / "f"
  f.write_text("x")
  with pytest.raises(ConfigError, match="is a file, not a folder"):
    train_and_evaluate(tiny_config(corpus), str(f))
  with pytest.raises(ConfigError, match="is a file, not a folder"):
    train_and_evaluate(tiny_config(corpus), str(f / "run"))


def test_export_refuses_another_kind_or_model_unless_overwrite(tmp_path):
  from trime_jax.errors import CheckpointError
  from trime_jax.runtime.lock import LockedError

  params, cfg, vocab = _tiny_export_args()
  target = tmp_path / "export"
  target.mkdir()
  (target / "notes.txt").write_text("mine")
  with pytest.raises(CheckpointError, match="not an export .*notes.txt"):
    exports.export(str(target), params, cfg, vocab)
  assert os.listdir(target) == ["notes.txt"]  # untouched
  exports.export(str(target), params, cfg, vocab, extra={"train_fingerprint": "a"}, overwrite=True)
  assert exports.read_export_meta(str(target))["train_fingerprint"] == "a"
  exports.export(str(target), params, cfg, vocab, extra={"train_fingerprint": "a", "step": 5})  # same model: fine
  with pytest.raises(CheckpointError, match="another model .*train_fingerprint 'a' there, 'b' now"):
    exports.export(str(target), params, cfg, vocab, extra={"train_fingerprint": "b"})
  with cfg.unlocked():
    cfg.model.num_heads = 4  # same shapes, another architecture
  with pytest.raises(CheckpointError, match="another model .*arch_digest"):
    exports.export(str(target), params, cfg, vocab, extra={"train_fingerprint": "a"})
  holder = _hold(str(target) + ".lock")
  try:
    with pytest.raises(LockedError, match=f"export directory {target} is in use by process {holder.pid}"):
      exports.export(str(target), params, cfg, vocab, extra={"train_fingerprint": "a"}, overwrite=True)
  finally:
    _release(holder)
  assert exports.read_export_meta(str(target))["step"] == 5


def test_a_link_and_its_target_take_one_lock(tmp_path):
  """An output named through a symlink (or with a trailing '/') locks the directory it resolves to: a run
  writing `target` refuses `--out=link`, for exports, datastores and batch plans alike (runtime.lock.beside).
  An export written over a link replaces the link, and the link's target is left as it was."""
  from trime_jax import datastore as ds
  from trime_jax.batching import plan as batch_plan
  from trime_jax.runtime.lock import LockedError, beside

  target, link = tmp_path / "target", tmp_path / "link"
  target.mkdir()
  link.symlink_to(target)
  for name in (str(link), str(link) + "/", str(target) + "/"):
    assert beside(name, "x").path == str(target) + ".lock"
  holder = _hold(str(target) + ".lock")
  try:
    params, cfg, vocab = _tiny_export_args()
    with pytest.raises(LockedError, match=f"^export directory {link} is in use by process {holder.pid} .*"
                                          f"lock file {target}.lock"):
      exports.export(str(link), params, cfg, vocab)
    with pytest.raises(LockedError, match=f"^batch plan {link} is in use by process {holder.pid} "):
      batch_plan.save(str(link), {"num_segments": 2}, np.arange(2).reshape(1, 2))
    with pytest.raises(LockedError, match=f"^datastore {link}/ is in use by process {holder.pid} "):
      ds.build_datastore(str(tmp_path / "no-export"), None, str(link) + "/")
  finally:
    _release(holder)
  assert os.listdir(target) == [] and sorted(os.listdir(tmp_path)) == ["link", "target"]
  (target / "mine.txt").write_text("kept")
  exports.export(str(link), params, cfg, vocab, overwrite=True)
  assert not os.path.islink(link) and exports.read_export_meta(str(link))
  assert os.listdir(target) == ["mine.txt"]
  assert sorted(os.listdir(tmp_path)) == ["link", "target"]  # no .old / .tmp / .lock left


def test_a_lock_refused_under_leaves_no_folder_it_made(tmp_path):
  """The folders a lock file needed (--out=a/new/folder) are removed at its release when nothing was written in
  them (a command refused under the lock); a folder holding the output, or anything else, stays."""
  from trime_jax.runtime.lock import beside

  (tmp_path / "had").mkdir()
  with pytest.raises(ConfigError, match="refused"):
    with beside(str(tmp_path / "had" / "new" / "deep" / "out"), "x"):
      assert (tmp_path / "had" / "new" / "deep").is_dir()
      raise ConfigError("refused")
  assert os.listdir(tmp_path / "had") == []  # made for the lock: gone; there before: kept
  with beside(str(tmp_path / "had" / "new" / "deep" / "out"), "x"):
    (tmp_path / "had" / "new" / "deep" / "out").mkdir()
  assert os.listdir(tmp_path / "had" / "new" / "deep") == ["out"]


def test_workdir_config_json_with_an_unknown_field_is_refused(corpus, tmp_path):
  import json

  work = tmp_path / "run"
  work.mkdir()
  cfg = tiny_config(corpus)
  stored = json.loads(cfg.to_json_best_effort())
  stored["train"]["lerning_rate"] = 1.0
  (work / "config.json").write_text(json.dumps(stored))
  with pytest.raises(ckpt.CheckpointError,
                     match=r"config.json has field .*train.lerning_rate \(train.learning_rate\?\)"):
    ckpt.check_resume_config(str(work), cfg)


def test_step_digest_names_the_changed_file(tmp_path):
  from trime_jax.errors import DamagedCheckpointError

  mgr = ckpt.manager(str(tmp_path / "checkpoints"), 3)
  state = {"step": jnp.int32(1), "w": jnp.arange(4096, dtype=jnp.float32)}
  ckpt.save(mgr, 1, state)
  ckpt.finish(mgr)
  step_dir = tmp_path / "checkpoints" / "1"
  assert (step_dir / ckpt.DIGEST_FILE).exists()
  ckpt.verify_step(str(tmp_path / "checkpoints"), 1, "checkpoint at step 1")  # intact: silent
  big = max((p for p in step_dir.rglob("*") if p.is_file() and p.name != ckpt.DIGEST_FILE), key=os.path.getsize)
  data = bytearray(big.read_bytes())
  data[len(data) // 2] ^= 1
  big.write_bytes(bytes(data))
  with pytest.raises(DamagedCheckpointError, match=f"{big} changed after it was saved"):
    ckpt.verify_step(str(tmp_path / "checkpoints"), 1, "checkpoint at step 1")


def test_an_export_killed_between_its_renames_is_put_back_not_lost(tmp_path):
  """Killed after moving the previous export to <export>.old and before renaming the new one into place: the
  previous one is put back before anything reads or replaces it. The rerun's export replaces it (no .old left);
  an export of another model is refused as it was before the kill; a best-keeper reads the best so far from it
  (for best/, that copy is the only one of the best: deleting it let a worse model become the best)."""
  from trime_jax.runtime.best import BestKeeper

  params, cfg, vocab = _tiny_export_args()
  target = tmp_path / "export"
  exports.export(str(target), params, cfg, vocab)
  os.replace(target, str(target) + ".old")  # the state such a kill leaves
  exports.export(str(target), params, cfg, vocab)
  assert sorted(os.listdir(tmp_path)) == ["export"] and exports.read_export_meta(str(target))
  os.replace(target, str(target) + ".old")
  with pytest.raises(ckpt.CheckpointError, match="holds an export of another model"):
    exports.export(str(target), params, cfg, vocab, extra={"train_fingerprint": "another corpus"})
  assert sorted(os.listdir(tmp_path)) == ["export"] and "train_fingerprint" not in exports.read_export_meta(str(target))
  best = tmp_path / "best"
  exports.export(str(best), params, cfg, vocab, extra={"step": 4, "best_metric": "none_ppl", "dev_ppl": 12.5})
  os.replace(best, str(best) + ".old")
  written = []
  keeper = BestKeeper(str(best), True, "none_ppl", lambda d, p, extra: written.append(extra))
  assert keeper.ppl == 12.5 and exports.read_export_meta(str(best))["step"] == 4
  assert not os.path.lexists(str(best) + ".old")
  keeper.update(5, params, {"none_ppl": 13.0})  # worse than the best put back: not exported
  assert written == []
  keeper.update(4, params, {"none_ppl": 12.5})  # the best's own update measured again (a rerun): not a new best
  keeper.update(6, params, {"none_ppl": math.nan})  # NaN and inf never win
  keeper.update(6, params, {"none_ppl": math.inf})
  assert written == []
  keeper.update(6, params, {"none_ppl": 12.5})  # a tie: the later update, as fairseq's is_better (a <= b)
  assert [w["step"] for w in written] == [6]
  keeper.update(6, params, {"none_ppl": 12.5})  # the same update measured again: not a new best
  keeper.update(6, params, {"none_ppl": 12.0})  # ... a better value there is (a resumed run whose evaluation changed)
  assert [(w["step"], w["dev_ppl"]) for w in written] == [(6, 12.5), (6, 12.0)]
  # a kill after the new one was in place leaves the previous one at .old beside it: removed at the next look, so
  # it is never put back over a newer best (were best/ removed later)
  shutil.copytree(best, str(best) + ".old")
  BestKeeper(str(best), True, "none_ppl", lambda d, p, extra: None)
  assert sorted(os.listdir(tmp_path)) == ["best", "export"]


def test_a_link_replaced_by_an_export_is_put_back_after_a_kill_between_the_renames(tmp_path):
  """An export over a symlink renames the link itself to <export>.old first (its target untouched): a kill
  before the new export is in place leaves the link to be put back, not a missing export."""
  params, cfg, vocab = _tiny_export_args()
  target, link = tmp_path / "target", tmp_path / "link"
  target.mkdir()
  (target / "mine.txt").write_text("kept")
  link.symlink_to(target)
  os.replace(link, str(link) + ".old")  # the state a kill between the renames leaves
  assert data.recover_replaced(str(link)) and os.path.islink(link) and os.readlink(link) == str(target)
  assert not data.recover_replaced(str(link))  # nothing more to put back
  exports.export(str(link), params, cfg, vocab, overwrite=True)
  assert not os.path.islink(link) and exports.read_export_meta(str(link))
  assert os.listdir(target) == ["mine.txt"] and sorted(os.listdir(tmp_path)) == ["link", "target"]


@pytest.mark.parametrize("memory", ["local", "ext", "srupp_long"])
def test_an_all_padding_micro_batch_changes_nothing(memory):
  """An epoch's last update may hold all-padding micro-batches (epochs are whole updates): the update's loss and
  every gradient are those of its real micro-batches alone, wherever the padding stands, and nothing is skipped."""
  import functools

  from flax import nnx

  from tests.helpers import grad_capture
  from trime_jax import model as model_lib
  from trime_jax import steps
  from trime_jax.configs import default

  b, length = 4, 8
  c = default.get_config()
  c.model.update(vocab_size=32, num_layers=1, d_model=16, num_heads=2, d_ff=32, max_len=length, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0)
  c.data.segment_len = c.eval.block_len = length
  c.trime.memory = "ext" if memory == "ext" else "long" if memory == "srupp_long" else "local"
  if memory == "srupp_long":
    c.model.backbone, c.model.key_type = "srupp", "final"
  mcfg = specs.model_config(c)
  graphdef, params = nnx.split(model_lib.build_model(mcfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  tx = grad_capture()

  def run(batch):
    state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
    if memory == "srupp_long":
      state["carry"] = steps.init_train_carry(nnx.merge(graphdef, params), b, length)
    step = functools.partial(steps.train_step, graphdef, tx, specs.loss_spec(c), True, True)
    new, metrics = jax.jit(step)(state, batch, jax.random.PRNGKey(3))
    return jax.device_get(metrics), jax.device_get(new["opt_state"]["g"])

  tokens = np.random.default_rng(0).integers(2, 32, (1, b, length + 1)).astype(np.int32)
  real = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "drop_local": np.zeros((1, b), bool),
          "reset": np.ones((1, b), bool)}
  pad = {"inputs": np.zeros((1, b, length), np.int32), "targets": np.full((1, b, length), -1, np.int32),
         "drop_local": np.zeros((1, b), bool), "reset": np.ones((1, b), bool)}
  if memory != "srupp_long":
    del real["reset"], pad["reset"]
  alone = run(real)
  for first, second in ((real, pad), (pad, real)):
    metrics, grads = run({k: np.concatenate([first[k], second[k]]) for k in real})
    assert int(metrics["skipped"]) == 0 and float(metrics["loss"]) == pytest.approx(float(alone[0]["loss"]), rel=1e-6)
    for g, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(alone[1])):
      np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_throughput_leaves_out_evaluations_and_saves_between_updates():
  """tokens_per_s counts the updates' time, not a dev evaluation or a checkpoint save between two log lines (the
  line after an evaluation read 166 tokens/s against 6-10k; found by a helper's walk-through)."""
  import time

  import jax.numpy as jnp

  from trime_jax.runtime.loop import _Throughput

  def update(state, batch, rng):
    return state + 1, {"tokens": jnp.asarray(1000), "skipped": jnp.asarray(0)}

  clock = _Throughput()
  state = jnp.zeros(())
  state, _ = clock.run("k", update, state, None, None)  # compiles: left out, as before
  clock.read()
  for _ in range(3):
    state, _ = clock.run("k", update, state, None, None)
  with clock.outside(state):  # e.g. the dev evaluation of this update
    time.sleep(1.0)
  rate, timed, _ = clock.read()
  assert timed == 3 and rate > 3000 / 0.5, rate  # the second of evaluation is not in it (it read < 3,000/s)
