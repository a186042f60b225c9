"""The training loop both trainers run (`train.LMTask`, `mt.train.MTTask`): what a run does between "the state is
built" and "the export is written" is the same for a language model and a translation model, and lives here once.

The loop owns: resuming from the newest orbax checkpoint (metrics lines and TensorBoard events past it dropped),
the updates (CE for the task's warm-up, then TRIME), a metrics line every `train.log_every` updates (stdout,
`<workdir>/metrics.jsonl`, TensorBoard / W&B; process 0 only), the progress bar and ETA, a jax.profiler trace
(`train.profile_steps`), a dev evaluation every `train.eval_every` updates with best-export keeping
(`train.keep_best`), checkpoints every `train.checkpoint_every` updates, SIGTERM / preemption (checkpoint, then
`Preempted`), a non-finite loss (`TrainingError`, the last checkpoint intact), `train.stop_after` (stop
checkpointed after that many updates of this invocation), and at the end the final dev evaluation and the export.

The task owns what differs: its batches, its jitted update, its dev evaluation and its export format.

Throughput (`tokens_per_s`) leaves out every update that compiled a program (the first of each objective and
batch shape; translation batches come in several shapes): the loop waits for the device only around those, and
reports their seconds as `compile_s`. A line whose interval held no other update has tokens_per_s = null.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import numpy as np
from absl import logging

from trime_jax import checkpoint as ckpt
from trime_jax import event_writer
from trime_jax.errors import TrainingError
from trime_jax.runtime import workdir as workdir_files
from trime_jax.runtime.best import BestKeeper, host_copy
from trime_jax.runtime.config import profile_steps
from trime_jax.runtime.preemption import Preempted, PreemptionWatch
from trime_jax.runtime.progress import Progress, say

TB_TRAIN_SCALARS = ("loss", "ce_nll", "trime_nll", "ppl", "lr", "grad_norm", "tokens_per_s")


class Task:
  """What a trainer gives the loop. Subclasses set `eval_split` (the metrics.jsonl split of dev lines, as the
  task's data names it) and `best_metric` (the dev metric `train.keep_best` ranks by, lower is better)."""

  eval_split = "dev"
  best_metric = ""

  def objective(self, step: int) -> str:
    """"ce" or "trime": the objective update `step` (0-based) trains."""
    raise NotImplementedError

  def step_fn(self, objective: str):
    """The jitted update (state, batch, dropout_key) -> (state, metrics); metrics holds loss, ce_nll, trime_nll,
    grad_norm, tokens (the tokens the update trained on) and skipped (1 when a non-finite update was not
    applied; a train line's `skipped` counts them since the line before). Cache it: the loop asks for it every update."""
    raise NotImplementedError

  def dev_protocol(self) -> dict:
    """The settings `evaluate`'s numbers depend on beyond the parameters (how much of dev, which windows): a
    best recorded under others is measured again (`evaluate_export`) before it is compared."""
    return {}

  def evaluate_export(self, directory: str) -> dict:
    """`evaluate` of the parameters exported to `directory` (the best so far)."""
    raise NotImplementedError

  def batch(self, step: int) -> dict:
    """The batch of update `step`: a function of `step` only, so a resumed run continues exactly."""
    raise NotImplementedError

  def evaluate(self, step: int, params) -> dict:
    """Dev metrics of `params` after update `step` (perplexities as `<name>_ppl`)."""
    raise NotImplementedError

  def export(self, directory: str, params, extra: dict) -> str:
    """Write `params` (a host copy) as the task's export to `directory` with `extra` in its meta.json."""
    raise NotImplementedError

  def record(self, done: int) -> dict:
    """Task-specific fields of the train line written after update `done`."""
    del done
    return {}

  def describe_eval(self, dev: dict) -> str:
    """The dev line's text on stdout."""
    return " | ".join(f"{k} {v:.3f}" for k, v in dev.items() if k.endswith("_ppl"))


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """The loop's settings, read once from the config's `train` section (`from_train`)."""

  total: int  # the run's length in updates (train.num_steps, or fewer when the task's budget ends it earlier)
  seed: int
  log_every: int
  eval_every: int
  checkpoint_every: int
  keep_checkpoints: int
  keep_best: bool
  progress: str
  stop_after: int
  profile: tuple[int, int] | None

  @classmethod
  def from_train(cls, train_cfg, total: int | None = None) -> "LoopSpec":
    return cls(total=int(train_cfg.num_steps if total is None else total), seed=int(train_cfg.seed),
               log_every=int(train_cfg.log_every), eval_every=int(train_cfg.eval_every),
               checkpoint_every=int(train_cfg.checkpoint_every), keep_checkpoints=int(train_cfg.keep_checkpoints),
               keep_best=bool(train_cfg.keep_best), progress=str(train_cfg.progress),
               stop_after=int(train_cfg.stop_after), profile=profile_steps(train_cfg))


class _Throughput:
  """Tokens per second of the updates that compiled nothing, between two log lines (see the module doc)."""

  def __init__(self):
    self.seen, self.compile_s = set(), 0.0
    self._tokens, self._start, self._compiling = [], time.perf_counter(), 0.0
    self._skipped = []  # every update's `skipped` flag since the last read (on the device until then)

  def run(self, key, fn, state, batch, rng):
    if key in self.seen:
      state, m = fn(state, batch, rng)
      self._tokens.append(m["tokens"])  # stays on the device: reading it here would wait for the update
      self._skipped.append(m["skipped"])
      return state, m
    jax.block_until_ready(state)  # the updates before it finished: the clock below times this one alone
    t0 = time.perf_counter()
    state, m = fn(state, batch, rng)
    jax.block_until_ready(m)
    dt = time.perf_counter() - t0
    self.seen.add(key)
    self.compile_s += dt
    self._compiling += dt
    self._skipped.append(m["skipped"])
    return state, m

  def read(self) -> tuple[float | None, int, int]:
    """(tokens/s since the last read or None, updates timed, updates skipped); restarts the interval."""
    now = time.perf_counter()
    timed = len(self._tokens)
    seconds = now - self._start - self._compiling
    rate = float(np.sum(jax.device_get(self._tokens))) / seconds if timed and seconds > 0 else None
    skipped = int(np.sum(jax.device_get(self._skipped))) if self._skipped else 0
    self._tokens, self._start, self._compiling, self._skipped = [], now, 0.0, []
    return rate, timed, skipped


def _shapes(batch: dict):
  return tuple(sorted((k, tuple(np.shape(v))) for k, v in batch.items()))


def run(task: Task, state, spec: LoopSpec, workdir: str, *, schedule, config, place=lambda s: s, log=say) -> dict:
  """Train `state` ({"step", "params", "opt_state", ...}, freshly initialised) in `workdir` with `task`, resuming
  from the newest checkpoint there. Returns {"train": last train line, eval_split: final dev metrics, "export":
  directory, "step": updates done}; only {"train", "step"} when `train.stop_after` ended this invocation early.
  `place` puts a state on the task's devices (called on the restored state); `config` goes to TensorBoard."""
  mgr = ckpt.manager(os.path.join(workdir, workdir_files.CHECKPOINTS), spec.keep_checkpoints)
  restored_step, restored = ckpt.restore_latest(mgr, ckpt.abstract(state), log=log)
  chief = workdir_files.chief()
  tb = event_writer.EventWriter(os.path.join(workdir, "tb"), enabled=chief, config=config)
  # Metric lines past the checkpoint resumed from (step 0 when there is none: a run stopped before its first
  # checkpoint) are dropped; the rerun writes them again. TensorBoard drops its events past it likewise.
  metrics = workdir_files.MetricsFile(os.path.join(workdir, "metrics.jsonl"), enabled=chief)
  dropped = metrics.truncate(restored_step or 0)
  if restored is not None or dropped:
    tb.restart((restored_step or 0) + 1)
  if restored is not None:
    state = restored
    log(f"resumed from step {restored_step} ({mgr.directory})")
  state = place(state)
  best = BestKeeper(os.path.abspath(os.path.join(workdir, "best")), spec.keep_best, task.best_metric, task.export,
                    protocol=task.dev_protocol(), remeasure=task.evaluate_export, split=task.eval_split)
  split = task.eval_split
  start = int(state["step"])
  stop = spec.total if not spec.stop_after else min(spec.total, start + spec.stop_after)
  base_key = jax.random.PRNGKey(spec.seed)
  clock = _Throughput()
  progress = Progress(spec.total, start, spec.progress)
  last, tracing = {}, False

  def evaluate(done: int, params) -> dict:
    dev = task.evaluate(done, params)
    metrics.write({"step": done, "split": split, **dev})
    log(f"{split} at update {done}: {task.describe_eval(dev)}")
    tb.scalars(done, {f"{split}/{k}": v for k, v in dev.items() if k.endswith("_ppl")})
    return dev

  try:
    with PreemptionWatch(mgr) as preemption:
      for step in range(start, stop):
        done = step + 1
        if spec.profile and done == spec.profile[0]:
          jax.profiler.start_trace(os.path.join(workdir, "profile"))
          tracing = True
        objective = task.objective(step)
        batch = task.batch(step)
        state, m = clock.run((objective, _shapes(batch)), task.step_fn(objective), state, batch,
                             jax.random.fold_in(base_key, step))
        if tracing and done == spec.profile[1]:
          jax.block_until_ready(state)
          jax.profiler.stop_trace()
          tracing = False
          logging.info("profile of updates %d-%d written to %s", *spec.profile, os.path.join(workdir, "profile"))
        progress.update(done)
        if done % spec.log_every == 0 or done == stop:
          last = _train_line(task, done, objective, jax.device_get(m), schedule(_last_schedule_step(state, step)),
                             clock)
          if not math.isfinite(last["loss"]):
            ckpt.finish(mgr)  # the saves before it complete and sealed
            kept = mgr.latest_step()
            where = f"the last checkpoint (update {kept}) is intact in {mgr.directory}" if kept is not None else \
                "no checkpoint had been written yet"
            raise TrainingError(f"non-finite loss at update {done} (updates with a non-finite loss or gradient "
                                f"are skipped, not applied); {where}. Lower train.learning_rate or set "
                                "train.clip_norm.")
          # A stop before the end (train.stop_after) says where it stopped, but records no line off the
          # log_every grid: the resumed run's metrics.jsonl has the uninterrupted run's lines.
          recorded = done % spec.log_every == 0 or done == spec.total
          if recorded:
            metrics.write(last)
          rate = f"{last['tokens_per_s']:,.0f}" if last["tokens_per_s"] is not None else "-"
          skips = f" | {last['skipped']} skipped (non-finite)" if last["skipped"] else ""
          log(f"step {done:>6}/{spec.total} [{objective:>5}] loss {last['loss']:.4f} | ce {last['ce_nll']:.4f}"
              f" | trime {last['trime_nll']:.4f} | lr {last['lr']:.2e} | |g| {last['grad_norm']:.3f}"
              f" | {rate} tok/s (+{clock.compile_s:.0f} s compiling){skips} | {progress.eta(done)}")
          if recorded:
            tb.scalars(done, {f"train/{k}": last[k] for k in TB_TRAIN_SCALARS if last.get(k) is not None})
          progress.update(done, loss=f"{last['loss']:.4f}")
        if spec.eval_every and done % spec.eval_every == 0 and done < spec.total:
          best.update(done, state["params"], evaluate(done, state["params"]))
        saved = done % spec.checkpoint_every == 0 or done == stop
        if saved:
          ckpt.save(mgr, done, state)
          logging.info("checkpoint of update %d: saving to %s", done, mgr.directory)
        if preemption.reached(done) and done < spec.total:
          if not saved:
            ckpt.save(mgr, done, state)
          ckpt.finish(mgr)
          logging.info("preemption signal: checkpoint of update %d saved, stopping", done)
          raise Preempted(done, mgr.directory)
    ckpt.finish(mgr)  # the last save complete and its digest written
    end = int(state["step"])
    if end < spec.total:
      log(f"stopped after update {end} (train.stop_after={spec.stop_after}); rerun the same command to continue")
      return {"train": last, "step": end}
    params = host_copy(state["params"])
    # A rerun of a finished run reuses its final dev line instead of appending a duplicate.
    final = metrics.find(end, split) if start == end else None
    if final is not None:
      final = {k: v for k, v in final.items() if k not in ("step", "split")}
    else:
      final = evaluate(end, params)
    export_dir = task.export(os.path.abspath(os.path.join(workdir, "export")), params, {"step": end, split: final})
    log(f"exported {export_dir}")
    best.update(end, params, final)
    return {"train": last, split: final, "export": export_dir, "step": end}
  finally:
    progress.close()
    if tracing:
      jax.profiler.stop_trace()
    tb.close()


def _last_schedule_step(state, step: int) -> int:
  """The schedule step of the last applied update: the optimizer's own count less one. A skipped update (a
  non-finite loss or gradient: the parameters and optimizer state are kept) advances `state["step"]`, so the
  data moves on, but not the optimizer's count, so the learning rate does not; without skips this is `step`."""
  import optax

  counts = [c for path, c in optax.tree_utils.tree_get_all_with_path(state["opt_state"], "count")
            if getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"]
  return max(int(jax.device_get(counts[0])) - 1, 0) if counts else step


def _train_line(task: Task, done: int, objective: str, m: dict, lr, clock: _Throughput) -> dict:
  rate, timed, skipped = clock.read()
  loss = float(m["loss"])
  return {"step": done, "objective": objective, "loss": loss, "ce_nll": float(m["ce_nll"]),
          # ppl: of the vocabulary softmax alone (exp ce_nll), the same quantity in the CE warm-up and after it
          "trime_nll": float(m["trime_nll"]), "ppl": math.exp(min(float(m["ce_nll"]), 50.0)),
          "grad_norm": float(m["grad_norm"]), "lr": float(lr), "tokens_per_s": rate, "timed_updates": timed,
          "compile_s": round(clock.compile_s, 2), "skipped": skipped, **task.record(done)}
