"""Observability: TensorBoard event files (decoded with protobuf, independently of the writer), the profiler
trace, the progress bar's modes, the log filter that quietens orbax, and the new config fields' checks."""

import glob
import json
import logging
import os
import struct
import sys

import numpy as np
import pytest

from tests.helpers import tiny_config, write_text_file
from trime_jax import event_writer
from trime_jax.train import train_and_evaluate


def _event_class():
  """tensorboard.Event / Summary / SessionLog built from a descriptor written out here (field numbers as in
  tensorboard's event.proto and summary.proto), so decoding does not go through our encoder."""
  from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

  f = descriptor_pb2.FileDescriptorProto(name="tb_event_test.proto", package="tbtest", syntax="proto3")
  T = descriptor_pb2.FieldDescriptorProto
  value = f.message_type.add(name="Value")
  value.field.add(name="tag", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
  value.field.add(name="simple_value", number=2, type=T.TYPE_FLOAT, label=T.LABEL_OPTIONAL)
  summary = f.message_type.add(name="Summary")
  summary.field.add(name="value", number=1, type=T.TYPE_MESSAGE, type_name=".tbtest.Value", label=T.LABEL_REPEATED)
  log = f.message_type.add(name="SessionLog")
  log.field.add(name="status", number=1, type=T.TYPE_INT32, label=T.LABEL_OPTIONAL)
  event = f.message_type.add(name="Event")
  event.field.add(name="wall_time", number=1, type=T.TYPE_DOUBLE, label=T.LABEL_OPTIONAL)
  event.field.add(name="step", number=2, type=T.TYPE_INT64, label=T.LABEL_OPTIONAL)
  event.field.add(name="file_version", number=3, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
  event.field.add(name="summary", number=5, type=T.TYPE_MESSAGE, type_name=".tbtest.Summary", label=T.LABEL_OPTIONAL)
  event.field.add(name="session_log", number=7, type=T.TYPE_MESSAGE, type_name=".tbtest.SessionLog",
                  label=T.LABEL_OPTIONAL)
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("tbtest.Event"))


def read_events(path):
  """The Event messages of one event file; every record's length and payload CRCs are checked."""
  Event = _event_class()
  with open(path, "rb") as f:
    data = f.read()
  events, pos = [], 0
  while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == event_writer.masked_crc32c(header)
    payload = data[pos + 12:pos + 12 + length]
    assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == event_writer.masked_crc32c(payload)
    events.append(Event.FromString(payload))
    pos += 16 + length
  return events


def scalars(logdir):
  """{tag: [(step, value), ...]} over a run's event files in order, dropping what a SessionLog START (a
  resumed run) supersedes, as TensorBoard does."""
  out = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    for e in read_events(path):
      if e.HasField("session_log") and e.session_log.status == 1:
        out = {tag: [(s, v) for s, v in pts if s < e.step] for tag, pts in out.items()}
      for v in e.summary.value:
        out.setdefault(v.tag, []).append((e.step, v.simple_value))
  return out


def test_crc32c_and_records_decode_with_protobuf(tmp_path):
  assert event_writer.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
  assert event_writer.crc32c(b"") == 0
  w = event_writer.EventWriter(str(tmp_path))
  w.scalars(3, {"train/loss": 2.5, "dev/none_ppl": 123.25})
  w.restart(7)
  w.scalars(7, {"train/loss": 1.0})
  w.close()
  (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  version, first, restart, second = read_events(path)
  assert version.file_version == "brain.Event:2" and version.wall_time > 1e9
  assert first.step == 3 and [(v.tag, v.simple_value) for v in first.summary.value] == [("train/loss", 2.5),
                                                                                      ("dev/none_ppl", 123.25)]
  assert restart.step == 7 and restart.session_log.status == 1
  assert second.step == 7 and second.summary.value[0].simple_value == 1.0
  data = bytearray(open(path, "rb").read())
  data[-6] ^= 1  # a flipped bit in the last payload fails its CRC
  open(path, "wb").write(bytes(data))
  with pytest.raises(AssertionError):
    read_events(path)
  off = event_writer.EventWriter(str(tmp_path / "off"), enabled=False)
  off.scalars(1, {"x": 1.0})
  assert not os.path.exists(tmp_path / "off")


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
  assert set(tb) == {f"train/{k}" for k in ("loss", "ce_nll", "trime_nll", "ppl", "lr", "grad_norm", "tokens_per_s")} | {
      "dev/none_ppl", "dev/trime_local(tau=1)_ppl"}
  for key in ("loss", "ce_nll", "trime_nll", "lr", "grad_norm"):  # float32 copies of metrics.jsonl
    assert [s for s, _ in tb[f"train/{key}"]] == [m["step"] for m in train] == [1, 2, 3, 4]
    np.testing.assert_array_equal([v for _, v in tb[f"train/{key}"]], np.float32([m[key] for m in train]))
  for key in ("none_ppl", "trime_local(tau=1)_ppl"):  # the periodic evaluation and the final one
    assert tb[f"dev/{key}"] == [(m["step"], np.float32(m[key])) for m in dev] and [m["step"] for m in dev] == [2, 4]
  assert all(v > 0 for _, v in tb["train/tokens_per_s"])
  traces = glob.glob(str(work / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_profile_steps_parse():
  from configs import default
  from trime_jax.train import profile_steps

  r = default.get_config().train
  assert profile_steps(r) is None
  with r.unlocked():
    r.profile_steps = "10,12"
    assert profile_steps(r) == (10, 12)
    r.profile_steps = " 7 "
    assert profile_steps(r) == (7, 7)


def test_progress_bar_only_where_someone_watches(capsys):
  from trime_jax.train import _Progress

  for mode in ("auto", "log"):  # pytest's stderr is not a terminal: no bar, the ETA goes to the log lines
    p = _Progress(10, 2, mode)
    p.update(3)
    assert p.bar is None and p.eta(3) == "ETA ?"
    p.update(5)
    assert "updates/s | ETA 0:00:" in p.eta(5)
    p.close()
  assert capsys.readouterr().err == ""
  from absl import logging as absl_logging

  handler = absl_logging.get_absl_handler().python_handler
  saved, handler.stream = handler.stream, sys.stderr  # as on a terminal: absl logs to stderr
  try:
    p = _Progress(10, 2, "bar")
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
  from launch.common import quiet_libraries

  def record(path, level):
    return logging.LogRecord("absl", level, path, 1, "message", None, None)

  site = os.path.join(os.sep, "venv", "lib", "site-packages")
  assert not quiet_libraries(record(os.path.join(site, "orbax", "checkpoint", "checkpoint_manager.py"), logging.INFO))
  assert not quiet_libraries(record(os.path.join(site, "faiss", "loader.py"), logging.INFO))
  assert quiet_libraries(record(os.path.join(site, "orbax", "checkpoint", "checkpoint_manager.py"), logging.WARNING))
  assert quiet_libraries(record(os.path.join(os.sep, "repo", "trime_jax", "train.py"), logging.INFO))
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
