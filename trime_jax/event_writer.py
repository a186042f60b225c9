"""Metric writers of a training run: TensorBoard through tensorboardX (no TensorFlow) and, optionally, Weights &
Biases.

`EventWriter(logdir, enabled, config)` is what the trainer holds. With a config it writes, besides the scalars:
  - the config as text (TensorBoard's Text tab, tag `config`; W&B: the run's config),
  - the config's fields as hyperparameters (TensorBoard's HParams tab: one session whose metrics are the run's
    scalars, which TensorBoard lists by itself because no experiment summary fixes them).
`config.train.tensorboard` turns the event files in `logdir` off; `config.train.wandb_project` (non-empty, with
`pip install 'trime-jax[wandb]'`) logs the same scalars to that W&B project, the run's files under
`<workdir>/wandb` (WANDB_MODE=offline keeps them there). `tensorboard --logdir <workdir>/tb` reads the event files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid


def flat_hparams(config) -> dict:
  """{"model.d_model": 128, ...}: a config's leaves as TensorBoard hyperparameter values (bool / int / float / str;
  lists, tuples and None as their JSON text)."""
  tree = json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") else dict(config)
  out = {}

  def walk(node, prefix):
    for k, v in node.items():
      if isinstance(v, dict):
        walk(v, f"{prefix}{k}.")
      elif isinstance(v, (bool, int, float, str)):
        out[f"{prefix}{k}"] = v
      else:
        out[f"{prefix}{k}"] = json.dumps(v)

  walk(tree, "")
  return out


def config_text(config) -> str:
  """The config as a Markdown code block (TensorBoard renders text summaries as Markdown)."""
  body = config.to_json_best_effort(indent=2) if hasattr(config, "to_json_best_effort") else json.dumps(
      config, indent=2, default=str)
  return "```\n" + body + "\n```"


@contextlib.contextmanager
def _names_path(logdir: str):
  """tensorboardX's writes raise OSError without a file name (a full disk, a file size limit): name the event
  folder, so the CLIs' one error line says where."""
  try:
    yield
  except OSError as e:
    if e.filename is not None or not e.errno:
      raise
    raise OSError(e.errno, os.strerror(e.errno), os.path.abspath(logdir)) from e


_INVALID_TAG = re.compile(r"[^-/\w.]")


def tensorboard_tag(name: str) -> str:
  """`name` as TensorBoard keeps it (tensorboardX's rule: characters outside [-/\\w.] become _, no leading /),
  cleaned here so that tensorboardX does not log a line per metric and dev evaluation
  ("Summary name dev/trime_local(tau=1)_ppl is illegal"). W&B keeps the names as they are."""
  return _INVALID_TAG.sub("_", name).lstrip("/")


class EventWriter:
  """Scalars (and, given the config, config text and hyperparameters) to TensorBoard and optionally W&B.

  Every `scalars` call is flushed to the event file, so a killed run keeps what it logged. `enabled=False`
  (processes other than 0) makes every call a no-op and creates nothing."""

  def __init__(self, logdir: str, enabled: bool = True, config=None):
    self._tb = self._wandb = None
    self._hparams = None
    self._logdir = logdir
    if not enabled:
      return
    train = config.get("train", {}) if config is not None else {}
    if train.get("tensorboard", True):
      from tensorboardX import SummaryWriter

      # The pid keeps two writers of one second apart (tensorboardX names files by time and host only).
      self._tb = SummaryWriter(logdir, flush_secs=10, filename_suffix=f".{os.getpid()}")
    project = train.get("wandb_project", "")
    if project:
      self._wandb = _wandb_run(project, os.path.dirname(os.path.abspath(logdir)), config)
    if config is not None and self._tb is not None:
      from tensorboardX.summary import hparams

      with _names_path(logdir):
        self._tb.add_text("config", config_text(config), 0)
        # Only the session start: without an experiment summary TensorBoard's HParams tab takes the metrics from
        # the run's scalar tags, so nothing here has to know which dev metrics training will log.
        _, start, self._hparams = hparams(flat_hparams(config), {})
        self._tb.file_writer.add_summary(start)
        self._tb.flush()

  def scalars(self, step: int, values: dict[str, float]) -> None:
    if self._tb is not None:
      with _names_path(self._logdir):
        for tag, v in values.items():
          self._tb.add_scalar(tensorboard_tag(tag), float(v), int(step))
        self._tb.flush()
    if self._wandb is not None:
      self._wandb.log({k: float(v) for k, v in values.items()}, step=int(step))

  def restart(self, step: int) -> None:
    """A resumed run: a SessionLog START at `step` tells TensorBoard to drop the interrupted run's events at
    `step` and later (they are logged again), as TensorFlow's own writer does on restart. (W&B keeps a resumed
    run's history and ignores steps it has seen.)"""
    if self._tb is not None:
      from tensorboardX.proto.event_pb2 import Event, SessionLog

      with _names_path(self._logdir):
        self._tb.file_writer.add_event(Event(step=int(step), session_log=SessionLog(status=SessionLog.START)))
        self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      tb, self._tb = self._tb, None
      with _names_path(self._logdir):
        if self._hparams is not None:
          tb.file_writer.add_summary(self._hparams)  # the HParams session's end (status: success)
        tb.close()
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


def _wandb_run(project: str, workdir: str, config):
  """A W&B run for `workdir`, resumed when the workdir had one (its id is kept in `<workdir>/wandb/run_id`)."""
  try:
    import wandb
  except ImportError:
    raise ImportError("train.wandb_project needs wandb: pip install 'trime-jax[wandb]'") from None
  directory = os.path.join(workdir, "wandb")
  os.makedirs(directory, exist_ok=True)
  id_path = os.path.join(directory, "run_id")
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = f.read().strip()
  else:
    run_id = uuid.uuid4().hex[:12]
    with open(id_path, "w") as f:
      f.write(run_id)
  return wandb.init(project=project, dir=workdir, id=run_id, resume="allow", name=os.path.basename(workdir),
                    config=json.loads(config.to_json_best_effort()))
