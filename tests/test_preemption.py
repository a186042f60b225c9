"""Preemption-safe training: SIGTERM mid-run checkpoints the current update and exits 143; the same command
resumes bit-identically to an uninterrupted run. The best-by-dev-perplexity export holds the best step."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.helpers import REPO, config_file, read_metrics, tiny_config, write_text_file
from tests.test_observability import read_events, scalars
from trime_jax import checkpoint as ckpt, exports
from trime_jax.runtime.preemption import PREEMPTED_EXIT_CODE
from trime_jax.train import train_and_evaluate

# Long enough (a few ms an update) that SIGTERM, sent once update 52 is logged, lands mid-run; checkpoints
# only at the end, so the one the preempted run leaves is the SIGTERM one. The dev evaluation at update 50
# (before the signal) writes the first best export, which the resumed run must carry on from.
RUN = {"train.num_steps": 200, "trime.ce_warmup_steps": 2, "train.checkpoint_every": 10_000,
       "train.eval_every": 50, "train.eval_max_tokens": 64, "eval.max_tokens": 64}
SIGNAL_AFTER = 52


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_text_file(tmp_path_factory.mktemp("data") / "text.bin", 40_000)


TIMING = ("tokens_per_s", "timed_updates", "compile_s")  # wall-clock fields (which updates compiled differs on resume)


def _without_timing(lines):
  return [{k: v for k, v in m.items() if k not in TIMING} for m in lines]


def _leaves(export_dir):
  return jax.tree_util.tree_leaves(exports.load_export(str(export_dir))[1])


def _train_cli(cfg, work, out_dir):
  """`python -m trime_jax.launch.train` in the background; stdout/stderr to files (a full pipe would block it)."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  out, err = open(out_dir / "stdout.txt", "w"), open(out_dir / "stderr.txt", "w")
  return subprocess.Popen([sys.executable, "-m", "trime_jax.launch.train", f"--config={cfg}", f"--workdir={work}"],
                          cwd=REPO, env=env, stdout=out, stderr=err)


def _wait_for_step(work, proc, step, timeout=240):
  path = os.path.join(work, "metrics.jsonl")
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(path):
      with open(path) as f:
        done = [json.loads(l) for l in f.read().split("\n")[:-1]]  # complete lines only: it is being written
      if any(m.get("step", 0) >= step for m in done if "loss" in m):
        return
    time.sleep(0.02)
  raise AssertionError(f"training never reached step {step} (exit {proc.poll()})")


def test_sigterm_checkpoints_and_the_same_command_resumes_bit_identically(corpus, tmp_path):
  cfg = config_file(tmp_path, corpus, **RUN)
  work = tmp_path / "preempted"
  proc = _train_cli(cfg, work, tmp_path)
  _wait_for_step(work, proc, SIGNAL_AFTER)  # past the CE -> TRIME switch and the first dev evaluation
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=240) == PREEMPTED_EXIT_CODE == 143
  stdout, stderr = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
  assert "Traceback" not in stderr
  stopped = int(re.search(r"preempted: checkpoint of update (\d+) saved", stderr).group(1))
  assert SIGNAL_AFTER <= stopped < RUN["train.num_steps"]
  assert exports.read_export_meta(str(work / "best"))["step"] == 50
  assert ckpt.manager(str(work / "checkpoints"), 2).all_steps() == [stopped]  # saved at the current update
  assert [m["step"] for m in read_metrics(work) if "loss" in m][-1] == stopped
  # Observability of a CLI run, checked here to spare a subprocess: our absl INFO lines on, orbax's per-save
  # INFO lines off; no progress bar in a log file, the rate and ETA in the log lines instead.
  assert f"preemption signal: checkpoint of update {stopped} saved" in stderr
  assert "Saving checkpoint at step" not in stderr and "Finished saving checkpoint" not in stderr
  assert "\r" not in stdout and re.search(r"ETA \d+:\d\d:\d\d \([\d.]+ updates/s overall\)", stdout)

  resumed = _train_cli(cfg, work, tmp_path)  # the same command
  assert resumed.wait(timeout=300) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
  assert f"resumed from step {stopped}" in (tmp_path / "stdout.txt").read_text()
  # TensorBoard: the resumed run's event file starts with a restart marker; together the files hold every
  # update once.
  _, second = sorted(glob.glob(str(work / "tb" / "events.out.tfevents.*")))  # one file per run
  assert [e.step for e in read_events(second) if e.HasField("session_log")] == [stopped + 1]
  loss = [(m["step"], np.float32(m["loss"])) for m in read_metrics(work) if "loss" in m]
  assert scalars(work / "tb")["train/loss"] == loss

  straight = tmp_path / "straight"
  train_and_evaluate(tiny_config(corpus, **RUN), str(straight))
  a, b = read_metrics(straight), read_metrics(work)
  assert [m["step"] for m in b if "loss" in m] == list(range(1, RUN["train.num_steps"] + 1))
  assert _without_timing(a) == _without_timing(b)  # every loss, grad norm, lr and dev perplexity, exactly
  for x, y in zip(_leaves(straight / "export"), _leaves(work / "export"), strict=True):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(_leaves(straight / "best"), _leaves(work / "best"), strict=True):
    np.testing.assert_array_equal(x, y)
  best_a, best_b = (exports.read_export_meta(str(w / "best")) for w in (straight, work))
  assert (best_a["step"], best_a["dev_ppl"]) == (best_b["step"], best_b["dev_ppl"])


def test_best_export_holds_the_update_with_the_lowest_dev_perplexity(corpus, tmp_path, monkeypatch):
  # Dev perplexity that goes down, then up (scripted: the evaluations at updates 2, 4, 6, 8 score nll 3.0, 2.0,
  # 2.5, 2.8), so the best is not the last update whatever the corpus (the repository's own sources) holds.
  import dataclasses

  from trime_jax import train as train_module

  real, scripted = train_module.evaluate.evaluate, iter([3.0, 2.0, 2.5, 2.8])

  def evaluate_scripted(*args, **kwargs):
    res = real(*args, **kwargs)
    nll = next(scripted)
    return dataclasses.replace(res, scores=[dataclasses.replace(x, nll=nll) for x in res.scores])

  monkeypatch.setattr(train_module.evaluate, "evaluate", evaluate_scripted)
  cfg = tiny_config(corpus, **{"train.num_steps": 8, "train.eval_every": 2, "train.checkpoint_every": 2,
                               "train.keep_checkpoints": 10, "trime.ce_warmup_steps": 0, "model.dropout": 0.0})
  work = tmp_path / "run"
  train_and_evaluate(cfg, str(work))
  dev = {m["step"]: m["trime_local(tau=1)_ppl"] for m in read_metrics(work) if m.get("split") == "dev"}
  assert sorted(dev) == [2, 4, 6, 8]
  best_step = min(dev, key=dev.get)
  meta = exports.read_export_meta(str(work / "best"))
  assert meta["step"] == best_step and meta["dev_ppl"] == dev[best_step]
  assert meta["best_metric"] == "trime_local(tau=1)_ppl"
  # Its parameters are those of the orbax checkpoint of that update, and evaluation can load it.
  saved = ocp.CheckpointManager(os.path.abspath(work / "checkpoints")).restore(best_step)
  for x, y in zip(_leaves(work / "best"), jax.tree_util.tree_leaves(saved["params"]), strict=True):
    np.testing.assert_array_equal(x, y)
  assert best_step == 4 and dev[8] > dev[best_step]  # the export is the last update, the best one is not
  assert exports.read_export_meta(str(work / "export"))["step"] == 8


def test_keep_best_and_tensorboard_off_write_neither(corpus, tmp_path):
  train_and_evaluate(tiny_config(corpus, **{"train.num_steps": 1, "train.keep_best": False,
                                            "train.tensorboard": False}), str(tmp_path / "run"))
  assert os.path.isdir(tmp_path / "run" / "export")
  assert not os.path.exists(tmp_path / "run" / "best") and not os.path.exists(tmp_path / "run" / "tb")


def test_a_ctrl_c_that_lands_in_a_finaliser_is_not_lost():
  """Python raises KeyboardInterrupt wherever the main thread is when SIGINT's handler runs; in a finaliser
  (`__del__`, a gc callback: JAX's `_xla_gc_callback` runs after collections) it is printed as "Exception ignored"
  and dropped, and the run trained on (CI: a training run still going 120 s after its SIGINT; by hand here 3 of 16
  interrupts, each swallowed in `_xla_gc_callback`). `InterruptWatch` turns the first SIGINT into a flag the loop
  reads between updates: the same SIGINT, landing in a finaliser, is kept. A second SIGINT raises at once."""
  from trime_jax.runtime.preemption import InterruptWatch

  class SignalsInItsFinaliser:
    def __del__(self):
      os.kill(os.getpid(), signal.SIGINT)
      sum(range(1000))  # bytecode after the kill: where Python runs the handler

  def interrupt_inside_a_finaliser():
    obj = SignalsInItsFinaliser()
    del obj
    time.sleep(0.05)

  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell starts Python (xdist: ignored)
  previous_hook, dropped = sys.unraisablehook, []
  sys.unraisablehook = lambda u: dropped.append(u.exc_type)
  try:
    try:
      interrupt_inside_a_finaliser()
    except KeyboardInterrupt:  # pragma: no cover - what a Python without the failure mode would do
      dropped.append("raised")
    assert dropped == [KeyboardInterrupt]  # the mechanism: Python's own handler's KeyboardInterrupt is dropped
    with InterruptWatch() as watch:
      interrupt_inside_a_finaliser()
      assert watch.requested  # kept
      with pytest.raises(KeyboardInterrupt):
        watch.check()
      with pytest.raises(KeyboardInterrupt):  # the second: at once
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ignored (a script's background job): left ignored
    with InterruptWatch():
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    sys.unraisablehook = previous_hook
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_dropped_in_a_finaliser_is_delivered_again_by_the_clis():
  """The CLIs (launch.entry.run_main) hook unraisable exceptions: a KeyboardInterrupt Python dropped in a
  finaliser (JAX's gc callback for one) is signalled to the main thread again and raised in its own code, so
  an evaluation or a datastore build stops on Ctrl-C as training does (there it was lost: the run went on)."""
  from trime_jax.launch.entry import redeliver_interrupts

  class SignalsInItsFinaliser:
    def __del__(self):
      os.kill(os.getpid(), signal.SIGINT)
      sum(range(1000))

  others = []
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  previous_hook = sys.unraisablehook
  sys.unraisablehook = redeliver_interrupts(lambda u: others.append(u.exc_type))
  try:
    with pytest.raises(KeyboardInterrupt):
      obj = SignalsInItsFinaliser()
      del obj  # the first KeyboardInterrupt is dropped here ...
      deadline = time.monotonic() + 5
      while time.monotonic() < deadline:  # ... and raised again in this loop
        sum(range(100))
    assert others == []
    sys.unraisablehook(type("U", (), {"exc_type": ValueError})())  # other exceptions: the hook before
    assert others == [ValueError]
  finally:
    sys.unraisablehook = previous_hook
    signal.signal(signal.SIGINT, previous)
