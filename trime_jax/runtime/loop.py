"""The training loop both trainers run (`train.LMTask`, `mt.train.MTTask`): what a run does between "the state is
built" and "the export is written" is the same for a language model and a translation model, and lives here once.

The loop owns: resuming from the newest orbax checkpoint (metrics lines and TensorBoard events past it dropped),
the updates (CE for the task's warm-up, then TRIME), a metrics line every `train.log_every` updates (stdout,
`<workdir>/metrics.jsonl`, TensorBoard / W&B; process 0 only), the progress bar and ETA, a jax.profiler trace
(`train.profile_steps`), a dev evaluation every `train.eval_every` updates with best-export keeping
(`train.keep_best`), checkpoints every `train.checkpoint_every` updates, SIGTERM / preemption (checkpoint, then
`Preempted`), non-finite updates (skipped; `TrainingError` after MAX_SKIPS_IN_A_ROW in a row, or when the final
parameters are not finite: nothing is exported), `train.stop_after` (stop
checkpointed after that many updates of this invocation), and at the end the final dev evaluation and the export.

The task owns what differs: its batches, its jitted update, its dev evaluation and its export format.

Throughput (`tokens_per_s`) leaves out every update that compiled a program (the first of each objective and
batch shape; translation batches come in several shapes): the loop waits for the device only around those, and
reports their seconds as `compile_s`. It leaves out the dev evaluations, `best/` exports and checkpoint saves
between updates as well (the line after an evaluation read 166 tokens/s against 6-10k; found by a helper's
walk-through). A line whose interval held no other update has tokens_per_s = null.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time

import jax
import numpy as np
from absl import logging

from trime_jax import checkpoint as ckpt
from trime_jax import event_writer
from trime_jax.distributed import from_chief, on_chief
from trime_jax.errors import CheckpointError, ConfigError, TrainingError
from trime_jax.runtime import workdir as workdir_files
from trime_jax.runtime.best import BestKeeper, host_copy
from trime_jax.runtime.config import profile_steps
from trime_jax.runtime.preemption import InterruptWatch, Preempted, PreemptionWatch
from trime_jax.runtime.progress import Progress, say

TB_TRAIN_SCALARS = ("loss", "ce_nll", "trime_nll", "ppl", "lr", "grad_norm", "tokens_per_s")


def warm_up_words(warm: int, trime: bool) -> str:
  """The training header's words for the objective: "CE warm-up 1 update", "... 600 updates", or "objective CE"
  for a model without memory (all of its updates are CE)."""
  return f"CE warm-up {warm} update{'' if warm == 1 else 's'}" if trime else "objective CE"


class Task:
  """What a trainer gives the loop. Subclasses set `eval_split` (the metrics.jsonl split of dev lines, as the
  task's data names it) and `best_metric` (the dev metric `train.keep_best` ranks by, lower is better unless
  `best_maximize`)."""

  eval_split = "dev"
  best_metric = ""
  best_maximize = False
  report_trime = True  # train lines show trime_nll; False for a model without memory (there it equals ce_nll)

  def objective(self, step: int) -> str:
    """"ce" or "trime": the objective update `step` (0-based) trains."""
    raise NotImplementedError

  def step_fn(self, objective: str):
    """The jitted update (state, batch, dropout_key) -> (state, metrics); metrics holds loss, ce_nll, trime_nll,
    grad_norm, tokens (the tokens the update trained on) and skipped (1 when a non-finite update was not
    applied; a train line's `skipped` counts them since the line before, `skipped_total` since the run began).
    Cache it: the loop asks for it every update."""
    raise NotImplementedError

  def dev_protocol(self, config=None) -> dict:
    """The settings `evaluate`'s numbers depend on beyond the parameters (how much of dev, which windows) under
    `config` (a ConfigDict; None: this run's): a best recorded under others is measured again
    (`evaluate_export`) before it is compared. Given a stored config.json, the protocol of the run that wrote it
    (dev lines of versions before 2026-12-04 do not record theirs)."""
    del config
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
  export_on_stop: bool = False  # a stop before the end also exports the parameters to <workdir>/partial

  @classmethod
  def from_train(cls, train_cfg, total: int | None = None) -> "LoopSpec":
    return cls(total=int(train_cfg.num_steps if total is None else total), seed=int(train_cfg.seed),
               log_every=int(train_cfg.log_every), eval_every=int(train_cfg.eval_every),
               checkpoint_every=int(train_cfg.checkpoint_every), keep_checkpoints=int(train_cfg.keep_checkpoints),
               keep_best=bool(train_cfg.keep_best), progress=str(train_cfg.progress),
               stop_after=int(train_cfg.stop_after), profile=profile_steps(train_cfg),
               export_on_stop=bool(train_cfg.get("export_on_stop", False)))


class _Throughput:
  """Tokens per second of the updates that compiled nothing, between two log lines (see the module doc)."""

  def __init__(self):
    self.seen, self.compile_s = set(), 0.0
    self._tokens, self._start, self._excluded = [], time.perf_counter(), 0.0  # compiling, evaluating, saving
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
    self._excluded += dt
    self._skipped.append(m["skipped"])
    return state, m

  def read(self) -> tuple[float | None, int, list]:
    """(tokens/s since the last read or None, updates timed, each update's skipped flag in order); restarts the
    interval."""
    now = time.perf_counter()
    timed = len(self._tokens)
    seconds = now - self._start - self._excluded
    rate = float(np.sum(jax.device_get(self._tokens))) / seconds if timed and seconds > 0 else None
    flags = [int(f) for f in jax.device_get(self._skipped)]
    self._tokens, self._start, self._excluded, self._skipped = [], now, 0.0, []
    return rate, timed, flags

  @contextlib.contextmanager
  def outside(self, state):
    """Work between updates (a dev evaluation, a checkpoint save) left out of the interval: the updates before it
    finish first (their time is training time; the work would wait for them anyway)."""
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self._excluded += time.perf_counter() - t0


# Updates skipped in a row (a non-finite loss or gradient each) after which training stops: one such update
# (a bad batch, a transient overflow) is skipped and training goes on; a run of them is divergence. Counted
# from the flags of every update, so where the log lines fall (train.log_every, train.stop_after) does not
# decide it; a resumed run counts from its first update.
PARTIAL = "partial"  # <workdir>/partial: train.export_on_stop's export of a run stopped before its end
MAX_SKIPS_IN_A_ROW = 10
# An update's skipped flag is read this many updates after it was dispatched (the device has finished it by
# then, so the read does not stall the pipeline), and at every log line: a diverged run stops within this many
# updates of its MAX_SKIPS_IN_A_ROW-th skip, whatever train.log_every.
SKIP_READ_LAG = 4


class _SkipWatch:
  """The current run of skipped updates, from each update's flag (see SKIP_READ_LAG)."""

  def __init__(self):
    self.pending, self.in_a_row = [], 0  # (update, flag on the device) not read yet, oldest first

  def add(self, done: int, flag, *, lag: int = SKIP_READ_LAG) -> tuple[int, int] | None:
    """Record update `done`'s flag and read those `lag` or more updates old; (first, last) update of a run of
    MAX_SKIPS_IN_A_ROW skipped updates when one is complete, else None."""
    self.pending.append((done, flag))
    ready = len(self.pending) - lag
    if ready <= 0:
      return None
    read, self.pending = self.pending[:ready], self.pending[ready:]
    for update, f in zip([u for u, _ in read], jax.device_get([f for _, f in read])):
      self.in_a_row = self.in_a_row + 1 if int(f) else 0
      if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
        return update - self.in_a_row + 1, update
    return None


def skipped_so_far(state) -> int | None:
  """Updates skipped since the run began: the updates made (`state["step"]`) less those the optimizer applied
  (its schedule count), exact across resumes; None for an optimizer without a schedule count."""
  applied = _applied_updates(state)
  return None if applied is None else int(jax.device_get(state["step"])) - applied


def _shapes(batch: dict):
  return tuple(sorted((k, tuple(np.shape(v))) for k, v in batch.items()))


def run(task: Task, state, spec: LoopSpec, workdir: str, *, schedule, config, place=lambda s: s, log=say,
        starting=lambda: None) -> dict:
  """Train `state` ({"step", "params", "opt_state", ...}, freshly initialised) in `workdir` with `task`, resuming
  from the newest checkpoint there. Returns {"train": last train line, eval_split: final dev metrics, "export":
  directory, "step": updates done}; only {"train", "step"} when `train.stop_after` ended this invocation early.
  `place` puts a state on the task's devices (called on the restored state); `config` goes to TensorBoard.
  `starting()` writes the run's records (config.json, ...): called once the checkpoint is restored and nothing
  was refused, so a refused run leaves the workdir's records as they were."""
  mgr = ckpt.manager(os.path.join(workdir, workdir_files.CHECKPOINTS), spec.keep_checkpoints)
  restored_step, restored = ckpt.restore_latest(mgr, ckpt.abstract(state), log=log)
  if restored_step is not None and restored_step > spec.total:
    raise CheckpointError(f"the newest checkpoint in {mgr.directory} is update {restored_step}, past this run's "
                          f"{spec.total} updates (train.num_steps; translation: also train.num_epochs, "
                          f"train.target_token_budget): give train.num_steps={restored_step} or more to export or "
                          f"continue it, or use a fresh workdir")
  # A finished run rerun: its final dev line is reused when it was measured as this run measures dev. A line of
  # a version before dev lines recorded their protocol was measured under the config.json the last invocation
  # wrote, read here before starting() replaces it.
  stored_protocol = _stored_dev_protocol(task, workdir) if restored_step == spec.total else None
  starting()
  chief = workdir_files.chief()
  metrics = workdir_files.MetricsFile(os.path.join(workdir, "metrics.jsonl"), enabled=chief)

  def open_records() -> event_writer.EventWriter:
    # Metric lines past the checkpoint resumed from (step 0 when there is none: a run stopped before its first
    # checkpoint) are dropped; the rerun writes them again. TensorBoard drops its events past it likewise.
    dropped = metrics.truncate(restored_step or 0)  # first: a damaged line stops the run before a writer starts
    writer = event_writer.EventWriter(os.path.join(workdir, "tb"), config=config)
    if dropped or restored is not None:
      writer.restart((restored_step or 0) + 1)
    return writer

  # Process 0's (the others' writer does nothing): a damaged metric line or a writer that cannot start stops
  # every process (`on_chief`), not only process 0
  tb = on_chief(open_records) or event_writer.EventWriter(os.path.join(workdir, "tb"), enabled=False)
  if restored is not None:
    state = restored
    log(f"resumed from step {restored_step} ({mgr.directory})")
  state = place(state)
  protocol = task.dev_protocol()  # how dev is measured: recorded in dev lines and beside the best
  best = BestKeeper(os.path.abspath(os.path.join(workdir, "best")), spec.keep_best, task.best_metric, task.export,
                    protocol=protocol, remeasure=task.evaluate_export, split=task.eval_split,
                    maximize=task.best_maximize)
  split = task.eval_split
  start = int(state["step"])
  stop = spec.total if not spec.stop_after else min(spec.total, start + spec.stop_after)
  base_key = jax.random.PRNGKey(spec.seed)
  clock = _Throughput()
  progress = Progress(spec.total, start, spec.progress)
  last, tracing = {}, False
  # A train line's `skipped`: the updates skipped since the line before, from the run's exact count (the line
  # before may be an earlier invocation's: its `skipped_total`); `skip_watch`: the current run of skipped updates.
  kept_lines = [r for r in metrics.rows() if r.get("split") is None and "loss" in r]
  if not kept_lines:
    skipped_before = 0
  elif "skipped_total" in kept_lines[-1]:
    skipped_before = kept_lines[-1]["skipped_total"]
  else:  # an earlier version's lines: counted from the checkpoint resumed from, as they were
    skipped_before = skipped_so_far(state) or 0
  skip_watch = _SkipWatch()
  if start >= stop and kept_lines:  # a finished run rerun: its result names the last train line it recorded
    last = dict(kept_lines[-1])

  interrupt = InterruptWatch()

  def record(done: int, line: dict, scalars: dict) -> None:
    """A metrics.jsonl line and its TensorBoard scalars, written by process 0. A write that fails there (a full
    disk) stops every process (`on_chief`): the others would wait for it in the next update's collectives until
    the shutdown timeout ended them."""
    on_chief(lambda: (metrics.write(line), tb.scalars(done, scalars)))

  def evaluate(done: int, params) -> dict:
    interrupt.check()
    dev = task.evaluate(done, params)
    record(done, {"step": done, "split": split, **dev, "dev_protocol": protocol},
           {f"{split}/{k}": v for k, v in dev.items() if k.endswith("_ppl")})
    log(f"{split} at update {done}: {task.describe_eval(dev)}")
    return dev

  interrupt.__enter__()  # left in `finally`
  try:
    with PreemptionWatch(mgr) as preemption:
      for step in range(start, stop):
        interrupt.check()  # a Ctrl-C during the update before: stopped here, between updates
        done = step + 1
        if spec.profile and done == spec.profile[0]:
          jax.profiler.start_trace(os.path.join(workdir, "profile"))
          tracing = True
        objective = task.objective(step)
        batch = task.batch(step)
        state, m = clock.run((objective, _shapes(batch)), task.step_fn(objective), state, batch,
                             jax.random.fold_in(base_key, step))
        logged = done % spec.log_every == 0 or done == stop
        diverged = skip_watch.add(done, m["skipped"], lag=0 if logged else SKIP_READ_LAG)
        if diverged:
          ckpt.finish(mgr)  # the saves before it complete and sealed
          kept = mgr.latest_step()
          where = (f"the last checkpoint (update {kept}, in {mgr.directory}) holds the parameters of the last "
                   "update applied" if kept is not None else "no checkpoint had been written yet")
          raise TrainingError(f"training diverged: updates {diverged[0]}-{diverged[1]} all had a non-finite loss "
                              f"or gradient ({MAX_SKIPS_IN_A_ROW} in a row; such updates are skipped, not "
                              f"applied; stopped at update {done}); {where}. Lower train.learning_rate or set "
                              "train.clip_norm.")
        if tracing and done == spec.profile[1]:
          jax.block_until_ready(state)
          jax.profiler.stop_trace()
          tracing = False
          logging.info("profile of updates %d-%d written to %s", *spec.profile, os.path.join(workdir, "profile"))
        progress.update(done)
        if logged:
          rate, timed, flags = clock.read()
          total = skipped_so_far(state)
          skipped = (total - skipped_before) if total is not None else sum(flags)
          last = _train_line(task, done, objective, jax.device_get(m), schedule(_last_schedule_step(state, step)),
                             rate, timed, skipped, clock)
          # A stop before the end (train.stop_after) says where it stopped, but records no line off the
          # log_every grid: the resumed run's metrics.jsonl has the uninterrupted run's lines.
          recorded = done % spec.log_every == 0 or done == spec.total
          if recorded:
            if total is not None:
              last["skipped_total"] = total
              skipped_before = total
            record(done, last, {f"train/{k}": last[k] for k in TB_TRAIN_SCALARS if last.get(k) is not None})
          rate = f"{last['tokens_per_s']:,.0f}" if last["tokens_per_s"] is not None else "-"
          skips = f" | {last['skipped']} skipped (non-finite)" if last["skipped"] else ""
          trime = f" | trime {last['trime_nll']:.4f}" if task.report_trime else ""
          log(f"step {done:>6}/{spec.total} [{objective:>5}] loss {last['loss']:.4f} | ce {last['ce_nll']:.4f}"
              f"{trime} | lr {last['lr']:.2e} | |g| {last['grad_norm']:.3f}"
              f" | {rate} tok/s (+{clock.compile_s:.0f} s compiling){skips} | {progress.eta(done)}")
          progress.update(done, loss=f"{last['loss']:.4f}")
        evaluated = spec.eval_every and done % spec.eval_every == 0 and done < spec.total
        saved = done % spec.checkpoint_every == 0 or done == stop
        if evaluated or saved:
          with clock.outside(state):  # not training time: left out of tokens_per_s
            if evaluated:
              best.update(done, state["params"], evaluate(done, state["params"]))
            if saved:
              ckpt.save(mgr, done, state)
              logging.info("checkpoint of update %d: saving to %s", done, mgr.directory)
        if preemption.reached(done) and done < spec.total:
          if not saved:
            ckpt.save(mgr, done, state)
          ckpt.finish(mgr)
          logging.info("preemption signal: checkpoint of update %d saved, stopping", done)
          _export_partial(task, spec, workdir, state, done, log)
          raise Preempted(done, mgr.directory)
    ckpt.finish(mgr)  # the last save complete and its digest written
    end = int(state["step"])
    if end < spec.total:
      log(f"stopped after update {end} (train.stop_after={spec.stop_after}: updates per invocation); rerun the same "
          "command to continue")
      _export_partial(task, spec, workdir, state, end, log)
      return {"train": last, "step": end}
    params = host_copy(state["params"])
    bad = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
           if not np.isfinite(np.asarray(x)).all()]
    if bad:  # diverged in fewer than MAX_SKIPS_IN_A_ROW updates before the end (or an infinite step size)
      raise TrainingError(f"the parameters after update {end} are not finite ({len(bad)} arrays, e.g. {bad[0]}); "
                          "nothing was exported. Lower train.learning_rate or set train.clip_norm, and train in a "
                          f"fresh workdir (the checkpoints in {mgr.directory} hold these parameters).")
    # A rerun of a finished run reuses its final dev line instead of appending a duplicate, if it was measured
    # the same way (eval settings may change on a rerun: then dev is measured again, as the best is).
    # Process 0 decides for all: the others read config.json after it may have rewritten it (starting()).
    line = metrics.find(end, split) if start == end else None
    reused = None
    if line is not None and line.get("dev_protocol", stored_protocol) == protocol:
      reused = {k: v for k, v in line.items() if k not in ("step", "split", "dev_protocol")}
    reused = from_chief(reused)
    final = reused if reused is not None else evaluate(end, params)
    export_dir = task.export(os.path.abspath(os.path.join(workdir, "export")), params, {"step": end, split: final})
    log(f"exported {export_dir}")
    best.update(end, params, final)
    return {"train": last, split: final, "export": export_dir, "step": end}
  except KeyboardInterrupt:
    # Ctrl-C (raised by `interrupt` between updates, or at once by a second one): the save in flight finishes
    # before the process exits (its writer threads still running while the
    # interpreter shut down made the exit a segmentation fault, rc 139 instead of 130, about one time in two)
    try:
      mgr.wait_until_finished()
    except Exception:  # noqa: BLE001 - a save that fails now is a step on_disk does not name
      pass
    raise
  finally:
    interrupt.__exit__()
    progress.close()
    if tracing:
      jax.profiler.stop_trace()
    tb.close()


def _stored_dev_protocol(task: Task, workdir: str) -> dict | None:
  """The dev protocol of the workdir's config.json (the last invocation's settings), or None when it cannot be
  told (no or an unreadable file, a field the protocol needs missing): dev is then measured again."""
  import ml_collections

  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  # Versions before dev lines recorded their protocol also reused a final dev line when a rerun changed how dev
  # is measured, and wrote the new settings to config.json: after any recorded change of an evaluation setting
  # config.json may not be what the line was measured under
  changes = os.path.join(workdir, "config_changes.jsonl")
  if os.path.exists(changes):
    try:
      with open(changes, encoding="utf-8") as f:
        changed = {k for line in f if line.strip() for k in json.loads(line).get("changes", {})}
    except (OSError, ValueError, AttributeError) as e:
      logging.info("%s cannot be read (%s): the final dev line is measured again", changes, e)
      return None
    if any(k.startswith(("eval.", "train.eval_max", "model.srupp_eval")) for k in changed):
      return None
  try:
    stored = workdir_files.read_stored_config(path, "workdir config", CheckpointError)
    return task.dev_protocol(ml_collections.ConfigDict(stored))
  except (CheckpointError, ConfigError, AttributeError, KeyError, TypeError, ValueError) as e:  # measured again;
    # starting() names a damaged or unknown config.json in its own error
    logging.info("the dev protocol of %s cannot be read (%s): the final dev line is measured again", path, e)
    return None


def _export_partial(task: Task, spec: LoopSpec, workdir: str, state, done: int, log) -> None:
  """train.export_on_stop: the parameters of a run stopped at update `done` (before its end) exported to
  <workdir>/partial (replacing an earlier stop's), meta.json recording the step: train.init_from's input."""
  if not spec.export_on_stop:
    return
  directory = task.export(os.path.abspath(os.path.join(workdir, PARTIAL)), host_copy(state["params"]),
                          {"step": done, "partial": True})
  log(f"exported the parameters of update {done} to {directory} (train.export_on_stop)")


def _applied_updates(state) -> int | None:
  """The optimizer's own count of applied updates (its schedule state's), or None without one."""
  import optax

  counts = [c for path, c in optax.tree_utils.tree_get_all_with_path(state["opt_state"], "count")
            if getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"]
  return int(jax.device_get(counts[0])) if counts else None


def _last_schedule_step(state, step: int) -> int:
  """The schedule step of the last applied update: the optimizer's own count less one. A skipped update (a
  non-finite loss or gradient: the parameters and optimizer state are kept) advances `state["step"]`, so the
  data moves on, but not the optimizer's count, so the learning rate does not; without skips this is `step`."""
  applied = _applied_updates(state)
  return max(applied - 1, 0) if applied is not None else step


def _train_line(task: Task, done: int, objective: str, m: dict, lr, rate, timed: int, skipped: int,
                clock: _Throughput) -> dict:
  loss = float(m["loss"])
  return {"step": done, "objective": objective, "loss": loss, "ce_nll": float(m["ce_nll"]),
          # ppl: of the vocabulary softmax alone (exp ce_nll), the same quantity in the CE warm-up and after it
          "trime_nll": float(m["trime_nll"]), "ppl": math.exp(min(float(m["ce_nll"]), 50.0)),
          "grad_norm": float(m["grad_norm"]), "lr": float(lr), "tokens_per_s": rate, "timed_updates": timed,
          "compile_s": round(clock.compile_s, 2), "skipped": skipped, **task.record(done)}
