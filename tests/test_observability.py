"""Observability: TensorBoard event files (read back with tensorboard's own event reader, as `tensorboard
--logdir` would), config text and hparams, the optional W&B writer (offline mode), the profiler trace, the
progress bar's modes, the log filter that quietens orbax, and the new config fields' checks."""

import glob
import json
import logging
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import tiny_config, write_text_file
from trime_jax import event_writer
from trime_jax.train import train_and_evaluate


def _accumulator(logdir):
  """tensorboard's EventAccumulator over every event file in `logdir`; it drops what a SessionLog START (a
  resumed run) supersedes, as TensorBoard's UI does."""
  from tensorboard.backend.event_processing import event_accumulator as ea

  acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
  acc.Reload()
  return acc


def read_events(path):
  """The Event messages of one event file, read by tensorboard's loader (which checks every record's CRCs)."""
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

  return list(EventFileLoader(str(path)).Load())


def scalars(logdir):
  """{tag: [(step, value), ...]} as TensorBoard shows them."""
  acc = _accumulator(logdir)
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _hparams(acc) -> dict:
  """{"session_start_info": proto, "session_end_info": proto} of the HParams plugin's data in a run."""
  from tensorboard.plugins.hparams import plugin_data_pb2

  out = {}
  for content in acc.PluginTagToContent("hparams").values():
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    out[data.WhichOneof("data")] = getattr(data, data.WhichOneof("data"))
  return out


def test_event_writer_scalars_restart_config_and_hparams(tmp_path):
  from trime_jax.configs import default

  cfg = default.get_config()
  w = event_writer.EventWriter(str(tmp_path), config=cfg)
  w.scalars(3, {"train/loss": 2.5, "dev/none_ppl": 123.25})
  w.scalars(8, {"train/loss": 2.0})  # logged by a run that was then interrupted before checkpointing update 8
  w.restart(7)
  w.scalars(7, {"train/loss": 1.0})
  w.close()
  assert scalars(tmp_path) == {"train/loss": [(3, 2.5), (7, 1.0)], "dev/none_ppl": [(3, 123.25)]}
  (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  events = read_events(path)
  assert events[0].file_version == "brain.Event:2" and events[0].wall_time > 1e9
  assert [e.step for e in events if e.HasField("session_log")] == [7]
  acc = _accumulator(tmp_path)
  (text,) = acc.Tensors("config/text_summary")
  shown = text.tensor_proto.string_val[0].decode()
  assert shown.startswith("```\n") and json.loads(shown.strip("`\n")) == json.loads(cfg.to_json_best_effort())
  hp = _hparams(acc)
  assert set(hp) == {"session_start_info", "session_end_info"}
  values = hp["session_start_info"].hparams
  assert values["model.d_model"].number_value == cfg.model.d_model
  assert values["trime.memory"].string_value == cfg.trime.memory
  assert values["train.tensorboard"].bool_value is True
  assert json.loads(values["data.split_fractions"].string_value) == list(cfg.data.split_fractions)
  assert len(values) == len(event_writer.flat_hparams(cfg))

  off = event_writer.EventWriter(str(tmp_path / "off"), enabled=False, config=cfg)
  off.scalars(1, {"x": 1.0})
  off.close()
  assert not os.path.exists(tmp_path / "off")
  with cfg.unlocked():
    cfg.train.tensorboard = False
  none = event_writer.EventWriter(str(tmp_path / "none"), config=cfg)
  none.scalars(1, {"x": 1.0})
  none.close()
  assert not os.path.exists(tmp_path / "none")


def test_wandb_writer_offline(tmp_path, monkeypatch):
  """config.train.wandb_project logs the scalars and the config to W&B (offline mode: files only), and a
  resumed run keeps the workdir's run id."""
  import wandb  # noqa: F401  (the [test] extra installs it)
  from trime_jax.configs import default

  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  cfg = default.get_config()
  with cfg.unlocked():
    cfg.train.wandb_project = "trime-test"
    cfg.train.tensorboard = False
  for step in (1, 2):
    w = event_writer.EventWriter(str(tmp_path / "tb"), config=cfg)
    w.scalars(step, {"train/loss_w": 2.5 - step})
    w.close()
  run_id = (tmp_path / "wandb" / "run_id").read_text()
  # One folder per writer, named offline-run-<start second>-<run id>; W&B (0.31) adds "-1" to the second one's name
  # when both started in the same second.
  runs = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}")) + glob.glob(
    str(tmp_path / "wandb" / f"offline-run-*-{run_id}-[0-9]*"))
  assert len(runs) == 2, os.listdir(tmp_path / "wandb")  # the second writer resumed the same run id
  needles = (b"train/loss_w", b"1.5", b"0.5", b"trime-test", b"d_model", b"ce_warmup_steps")
  # W&B's run files are protobuf records: keys and values appear as text. Its service process (wandb-core) can
  # still be appending to a run file when finish() has returned (seen once in CI on a loaded 2-core machine:
  # the second run's file held only its header), so the files are read until they hold everything, for at most 60 s.
  deadline = time.monotonic() + 60
  while True:
    logged = b"".join(open(f, "rb").read() for r in runs for f in glob.glob(os.path.join(r, "run-*.wandb")))
    missing = [n for n in needles if n not in logged]
    if not missing or time.monotonic() > deadline:
      break
    time.sleep(0.5)
  assert not missing, missing
  assert not os.path.exists(tmp_path / "tb")


def test_training_writes_tensorboard_scalars_and_a_profile_trace(tmp_path):
  corpus = write_text_file(tmp_path / "text.bin", 30_000)
  cfg = tiny_config(corpus, **{"train.num_steps": 4, "train.eval_every": 2, "train.profile_steps": "2,3",
                               "trime.ce_warmup_steps": 1})
  work = tmp_path / "run"
  train_and_evaluate(cfg, str(work))
  with open(work / "metrics.jsonl") as f:
    lines = [json.loads(l) for l in f]
  train = [m for m in lines if "loss" in m]
  dev = [m for m in lines if m.get("split") == "dev"]
  tb = scalars(work / "tb")
  # tensorboardX keeps only [-/\w.] in tags: "trime_local(tau=1)_ppl" shows as "trime_local_tau_1__ppl".
  assert set(tb) == {f"train/{k}" for k in ("loss", "ce_nll", "trime_nll", "ppl", "lr", "grad_norm",
                                            "tokens_per_s")} | {
      "dev/none_ppl", "dev/trime_local_tau_1__ppl"}
  for key in ("loss", "ce_nll", "trime_nll", "lr", "grad_norm"):  # float32 copies of metrics.jsonl
    assert [s for s, _ in tb[f"train/{key}"]] == [m["step"] for m in train] == [1, 2, 3, 4]
    np.testing.assert_array_equal([v for _, v in tb[f"train/{key}"]], np.float32([m[key] for m in train]))
  for key, tag in (("none_ppl", "none_ppl"), ("trime_local(tau=1)_ppl", "trime_local_tau_1__ppl")):
    # the periodic evaluation and the final one
    assert tb[f"dev/{tag}"] == [(m["step"], np.float32(m[key])) for m in dev] and [m["step"] for m in dev] == [2, 4]
  hp = _hparams(_accumulator(work / "tb"))["session_start_info"].hparams
  assert hp["train.num_steps"].number_value == 4 and hp["data.corpus"].string_value == "bytes"
  assert all(v > 0 for _, v in tb["train/tokens_per_s"])
  traces = glob.glob(str(work / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_profile_steps_parse():
  from trime_jax.configs import default
  from trime_jax.runtime.config import profile_steps

  r = default.get_config().train
  assert profile_steps(r) is None
  with r.unlocked():
    r.profile_steps = "10,12"
    assert profile_steps(r) == (10, 12)
    r.profile_steps = " 7 "
    assert profile_steps(r) == (7, 7)


def test_progress_bar_only_where_someone_watches(capsys):
  from trime_jax.runtime.progress import Progress

  for mode in ("auto", "log"):  # pytest's stderr is not a terminal: no bar, the ETA goes to the log lines
    p = Progress(10, 2, mode)
    p.update(3)
    assert p.bar is None and p.eta(3) == "ETA ?"
    p.update(5)
    assert re.fullmatch(r"ETA 0:00:\d\d \([\d.]+ updates/s overall\)", p.eta(5))
    p.close()
  assert capsys.readouterr().err == ""
  from absl import logging as absl_logging

  handler = absl_logging.get_absl_handler().python_handler
  saved, handler.stream = handler.stream, sys.stderr  # as on a terminal: absl logs to stderr
  try:
    p = Progress(10, 2, "bar")
    p.update(3)
    handler.stream.write("I1126 a log line\n")  # printed above the bar (tqdm clears and redraws it)
    p.update(4, loss="1.2345")
    p.close()
    assert handler.stream is sys.stderr  # restored
  finally:
    handler.stream = saved
  err = capsys.readouterr().err
  assert "4/10" in err and "loss=1.2345" in err and "update/s" in err
  assert "\nI1126 a log line\n" in err.replace("\r", "\n")


def test_log_filter_quietens_orbax_and_faiss_info_only():
  from trime_jax.launch.entry import quiet_libraries

  def record(path, level, msg="message"):
    return logging.LogRecord("absl", level, path, 1, msg, None, None)

  site = os.path.join(os.sep, "venv", "lib", "site-packages")
  assert not quiet_libraries(record(os.path.join(site, "orbax", "checkpoint", "checkpoint_manager.py"), logging.INFO))
  assert not quiet_libraries(record(os.path.join(site, "faiss", "loader.py"), logging.INFO))
  assert not quiet_libraries(record(os.path.join(site, "bm25s", "__init__.py"), logging.INFO,
                                    "Building index from token IDs"))
  assert quiet_libraries(record(os.path.join(site, "orbax", "checkpoint", "checkpoint_manager.py"), logging.WARNING))
  assert quiet_libraries(record(os.path.join(os.sep, "repo", "trime_jax", "train.py"), logging.INFO))
  # jax's attempt at a TPU on a CPU machine, at INFO: dropped; its other lines stay
  bridge = os.path.join(site, "jax", "_src", "xla_bridge.py")
  assert not quiet_libraries(record(bridge, logging.INFO, "Unable to initialize backend 'tpu': INTERNAL: Failed "
                                    "to open libtpu.so"))
  assert quiet_libraries(record(bridge, logging.INFO, "other"))
  assert quiet_libraries(record(bridge, logging.WARNING, "Unable to initialize backend 'cuda'"))
  # on a GPU machine the reason jax fell back to the CPU: kept
  assert quiet_libraries(record(bridge, logging.INFO, "Unable to initialize backend 'cuda': no plugin"))
  # orbax's worker threads log a failure with its traceback and hand it to the caller, who reports it once
  def raised_in(filename):
    code = compile("raise RuntimeError('Encountered error while reading array index')", filename, "exec")
    try:
      exec(code, {})
    except RuntimeError:
      return sys.exc_info()

  logged = record(os.path.join(site, "asyncio", "base_events.py"), logging.ERROR)  # Task exception never retrieved
  logged.exc_info = raised_in(os.path.join(site, "orbax", "checkpoint", "_src", "serialization", "serialization.py"))
  assert not quiet_libraries(logged)
  logged.exc_info = raised_in(os.path.join(os.sep, "repo", "trime_jax", "train.py"))
  assert quiet_libraries(logged)  # any other exception is kept


def test_tensorboard_tags_are_cleaned_as_tensorboardx_would_without_its_log_line(tmp_path, caplog):
  import logging

  import tensorboardX.summary as S

  from trime_jax.event_writer import EventWriter, tensorboard_tag

  for name in ("dev/trime_local(tau=1)_ppl", "/train/loss", "dev/cache(lambda=0.6,theta=1.5)_ppl", "a b*c"):
    assert tensorboard_tag(name) == S._clean_tag(name)
  with caplog.at_level(logging.INFO):
    w = EventWriter(str(tmp_path / "tb"))
    w.scalars(3, {"dev/trime_local(tau=1)_ppl": 12.5})
    w.close()
  assert not [r for r in caplog.records if "is illegal" in r.getMessage()]


def test_importing_the_library_leaves_the_logging_configuration_alone():
  """orbax logs at import time, and a module-level logging call on a root logger without handlers runs
  logging.basicConfig(): a user's own basicConfig afterwards would do nothing. trime_jax takes that handler back."""
  code = ("import logging, trime_jax.api, trime_jax.mt.export, trime_jax.launch.train\n"
          "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
          "logging.basicConfig(level=logging.INFO, format='mine %(message)s')\n"
          "logging.info('configured')")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert "mine configured" in out.stderr
