"""Training: `train_and_evaluate(config, workdir)` (a Colab cell can call it; `launch/train.py` is a thin CLI).

Plain CE for the first `trime.ce_warmup_steps` updates, then the TRIME loss; both are reported every
`log_every` updates to stdout, `<workdir>/metrics.jsonl` and TensorBoard event files in `<workdir>/tb`
(process 0; a tqdm bar with rate and ETA on a terminal). Data order, dropout and drop-local decisions
depend only on (seed, step), so a run resumed from an orbax checkpoint continues exactly as if uninterrupted.
On SIGTERM (or JAX's preemption notice on multi-host / TPU runs) the run checkpoints the update it is at and
raises `Preempted`; rerunning resumes there. The final parameters are exported (params + config + vocab) to
`<workdir>/export` for evaluation; with `train.keep_best` the lowest-dev-perplexity ones go to `<workdir>/best`.

The parts both trainers share live in `trime_jax/runtime/` (the workdir's lock, files and metrics, optimizer and
schedule, preemption, progress, best-export keeping); the config checks in `trime_jax/train_config.py`."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from trime_jax import checkpoint as ckpt, exports
from trime_jax import corpora
from trime_jax import data
from trime_jax import distributed
from trime_jax import evaluate
from trime_jax import sharded_loss
from trime_jax import sharding
from trime_jax import specs
from trime_jax import steps
from trime_jax.batching import plan as batch_plan
from trime_jax.train_config import ce_warmup_steps, validate_config
# The shared runtime (trime_jax/runtime/, also mt.train's): the workdir, the loop, the optimizer, progress lines.
from trime_jax.runtime import loop
from trime_jax.runtime import workdir as workdir_files
from trime_jax.runtime.optim import at_update, make_optimizer
from trime_jax.runtime.progress import say
from trime_jax.runtime.workdir import chief
from trime_jax.errors import CheckpointError, ConfigError, DataError
from trime_jax import model as model_lib
from trime_jax.model import count_params



# ----------------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------------
# What training's epochs are, recorded in data.json. EPOCHS_WHOLE since 2026-12-06: an epoch is whole updates, its
# last one padded. EPOCHS_STRADDLING before (data.json had no such field): updates read on through the epochs'
# end, so one could straddle two; a run that began so resumes in that order (nothing changes under a resume).
EPOCHS_WHOLE, EPOCHS_STRADDLING = "whole updates", "straddling"


class BatchSource:
  """Training batch of update `step`: inputs/targets [grad_accum, B, L], drop_local [grad_accum, B] (one draw
  per segment, memory=ext), and documents [grad_accum, B, L] for packed long-term runs."""

  def __init__(self, corpus: data.Corpus, config, epochs: str = EPOCHS_WHOLE):
    if epochs not in (EPOCHS_WHOLE, EPOCHS_STRADDLING):
      raise ValueError(f"epochs must be {EPOCHS_WHOLE!r} or {EPOCHS_STRADDLING!r}, got {epochs!r}")
    self.corpus = corpus
    self.config = config
    self.epochs = epochs
    self.segments = data.make_segments(corpus, config.data.segment_len, config.data.segmentation)
    self.plan = None
    self._rows = None  # the host's rows of the last batch read (resets compare against the same rows)
    t = config.trime
    if t.batching != "random":
      self.plan = batch_plan.load(t.batch_plan)
      consecutive, bm25 = t.batching == "consecutive", t.batching == "bm25"
      if bm25:
        from trime_jax.batching import bm25 as bm25_planner  # here: bm25s is imported by BM25 runs only
      # A BM25 plan's neighbours (k, the same-document option) are what the run's config says it trained on.
      self.plan.check(corpus_fingerprint=corpus.fingerprint(), segment_len=config.data.segment_len,
                      segmentation=config.data.segmentation, batch_size=config.train.batch_size,
                      consecutive_segments=t.consecutive_segments if consecutive else None,
                      kind=t.batching, layout=t.consecutive_layout if consecutive else None,
                      **(bm25_planner.neighbour_settings(config) if bm25 else {}))
      if bm25 and bm25_planner.old_exclusion_rule(self.plan.header):
        logging.warning("batch plan %s excluded same-document batch-mates by each segment's first document only "
                        "(made before 2026-12-06): a segment crossing into the next document can share a batch "
                        "with it. A new run should use a plan made again (make_batches --overwrite); a run that "
                        "trained on this one goes on with it", t.batch_plan)
      seed = self.plan.header.get("seed")
      if self.plan.header.get("shuffle", True) and seed is not None and int(seed) != int(config.train.seed):
        # Allowed (one plan can serve several initialisations), but the batch order is the plan's, not the run's.
        logging.warning("batch plan %s was made with seed %s: its batches and their order per epoch follow that "
                        "seed; train.seed=%s seeds the model, dropout and drop-local only", t.batch_plan, seed,
                        config.train.seed)
      if consecutive:  # a plan sharded for the original's GPUs is laid out update by update
        made = (int(self.plan.header.get("gpus", 1)), self.plan.header.get("grad_accum"))
        gpus, accum = int(t.get("consecutive_gpus", 1)), int(config.train.grad_accum)
        if made[0] != gpus or (gpus > 1 and made[1] != accum):
          raise DataError(f"batch plan {t.batch_plan} does not match this run: it was written for "
                          f"trime.consecutive_gpus={made[0]}" + (f", train.grad_accum={made[1]}" if made[0] > 1 else "")
                          + f"; this run has {gpus}" + (f" and {accum}" if gpus > 1 else "")
                          + " (write its plan with trime_jax.launch.make_batches)")
    # Packed runs hold several documents; their tokens carry document ids so memory stays in the document.
    self.with_documents = t.memory == "long" and t.consecutive_layout == "packed"
    # A stateful backbone learns where a row does not continue the previous micro-batch's row.
    self.with_reset = specs.stateful_backbone(config)

  def first_update_of_another_layout(self) -> int | None:
    """The first update whose batches differ between EPOCHS_WHOLE and EPOCHS_STRADDLING: the first that reaches an
    epoch's end where an update does not divide the epoch (None where it does: the two are the same)."""
    per_update = self.config.train.grad_accum * (1 if self.plan is not None else self.config.train.batch_size)
    n = self.plan.num_batches if self.plan is not None else len(self.segments)
    return None if n % per_update == 0 else n // per_update

  def indices(self, step: int) -> np.ndarray:
    """Segment indices [grad_accum, B] of update `step` (-1: all-padding row)."""
    train_cfg = self.config.train
    micro = train_cfg.grad_accum
    straddling = self.epochs == EPOCHS_STRADDLING
    if self.plan is not None:
      return (np.stack([self.plan.rows(step * micro + a) for a in range(micro)]) if straddling
              else self.plan.update_rows(step, micro))
    draw = data.random_batch_indices_straddling if straddling else data.random_batch_indices
    return draw(len(self.segments), micro * train_cfg.batch_size, step, train_cfg.seed).reshape(micro, -1)

  def __call__(self, step: int, rows=None) -> dict:
    """The batch of update `step`; `rows` (global row indices, sorted): only those rows of each micro-batch
    (a host's slice of the global batch, see `distributed.process_rows`)."""
    idx = self.indices(step)
    self._rows = rows
    t = self.config.trime
    # One drop-local draw per segment (the original draws once per forward of one segment per GPU), drawn for
    # the whole global batch so every host agrees, then sliced like the rows.
    rng = np.random.default_rng([self.config.train.seed, step, 7])
    drop = rng.random(idx.shape) < t.drop_local_prob if t.memory == "ext" else np.zeros(idx.shape, bool)
    if rows is not None:
      idx, drop = idx[:, rows], drop[:, rows]
    inputs, targets = data.gather_segments(self.corpus, self.segments, idx.reshape(-1))
    shape = idx.shape + (self.segments.seg_len,)
    batch = {"inputs": inputs.reshape(shape), "targets": targets.reshape(shape), "drop_local": drop}
    if self.with_documents:
      batch["documents"] = data.segment_documents(self.corpus, self.segments, idx.reshape(-1)).reshape(shape)
    if self.with_reset:
      batch["reset"] = self.resets(step, idx)
    return batch

  def resets(self, step: int, idx) -> np.ndarray:
    """[grad_accum, B] bool: row b of micro-batch a does not hold the segment after row b of the micro-batch
    before it (a stream starts over; every row with random batching). `idx` may be a host's rows only."""
    if self.plan is None or step == 0:
      prev0 = np.full(idx.shape[1:], -2)
    else:
      prev0 = self.indices(step - 1)[-1]
      prev0 = prev0[self._rows] if self._rows is not None else prev0
    prev = np.concatenate([prev0[None], idx[:-1]], axis=0)
    return (self.plan is None) | (idx < 0) | (prev < 0) | (idx != prev + 1)


# ----------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------
_log = say  # a line on stdout from process 0, above the progress bar


def best_metric(config) -> str:
  """The dev perplexity `train.keep_best` ranks by: with local memory for TRIME models (how they are used),
  without memory for vanilla LMs."""
  return "trime_local(tau=1)_ppl" if config.trime.memory != "none" else "none_ppl"


def build_model(mcfg, seed: int):
  """A fresh model of the backbone config `mcfg` (`specs.model_config`; model.backbone picks the backbone)."""
  return model_lib.build_model(mcfg, nnx.Rngs(params=seed))


def graphdef_stateful(graphdef, params) -> bool:
  return bool(getattr(nnx.merge(graphdef, params), "stateful", False))


def _tree_bytes(tree) -> int:
  return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def memory_plan(config, vocab_size: int = 0) -> dict:
  """Parameter count and per-device memory of training `config`, from shapes only (nothing is allocated;
  the corpus is read only when neither `vocab_size` nor model.vocab_size gives the vocabulary).

  Parameters and optimizer state are exact byte counts. The step's temporaries (activations kept for the
  backward pass, gradients, logits chunks) are XLA's compiled plan for one TRIME train step on the default
  backend at the per-device batch (train.batch_size / devices rows); data parallelism replicates parameters
  and optimizer state. On a >1-device mesh the sharded loss also gathers other devices' keys (not included).
  """
  validate_config(config)
  train_cfg = config.train
  if not (vocab_size or config.model.vocab_size) and corpora.would_download(config.data):
    raise ConfigError(f"the memory plan reads the vocabulary size from the training split, and "
                      f"data.corpus={config.data.corpus!r} is not prepared here (it would be downloaded): prepare it "
                      f"first (python -m trime_jax.launch.prepare_data --corpus={config.data.corpus[5:]}"
                      + (f" --data_dir={config.data.tfds_data_dir}" if config.data.get("tfds_data_dir") else "")
                      + ") or give --config.model.vocab_size=N")
  vocab_size = vocab_size or config.model.vocab_size or len(corpora.load_splits(config.data).vocab)
  mcfg, spec = specs.model_config(config, vocab_size=vocab_size), specs.loss_spec(config)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model_lib.build_model(mcfg, rngs=nnx.Rngs(params=0))),
                               nnx.Param)
  tx, _ = make_optimizer(train_cfg)
  opt_state = jax.eval_shape(tx.init, params)
  devices = train_cfg.num_devices or jax.device_count()
  if train_cfg.batch_size % devices:
    raise ConfigError(f"train.batch_size={train_cfg.batch_size} is not divisible by the {devices} devices")
  rows = train_cfg.batch_size // devices
  m = int(config.trime.get("consecutive_segments", 1))
  if config.trime.memory == "long" and rows % m:
    raise ConfigError(f"--dry_run plans one device's step alone, and with {devices} devices each holds "
                      f"{rows} rows, so runs of trime.consecutive_segments={m} cross devices: their memory comes "
                      "from the neighbours' rows (sharded_loss's halo), which a step alone does not have. Plan "
                      f"with --config.train.num_devices=N where train.batch_size / N is a multiple of {m} (N=1 "
                      "plans the whole batch on one device), or measure on the devices (bench.mfu)")
  tokens = jax.ShapeDtypeStruct((train_cfg.grad_accum, rows, config.data.segment_len), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens, "drop_local": jax.ShapeDtypeStruct(tokens.shape[:2], jnp.bool_)}
  if config.trime.memory == "long" and config.trime.consecutive_layout == "packed":
    batch["documents"] = tokens
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": opt_state}
  if graphdef_stateful(graphdef, params):
    batch["reset"] = batch["drop_local"]
    state["carry"] = jax.eval_shape(lambda: steps.init_train_carry(nnx.merge(graphdef, params), rows,
                                                                   config.data.segment_len))
  use_trime = spec.objective.memory != "none"
  fn = functools.partial(steps.train_step, graphdef, tx, spec, use_trime, use_trime)
  compiled = jax.jit(fn, donate_argnums=(0,)).lower(state, batch, jax.random.PRNGKey(0)).compile()
  m = compiled.memory_analysis()
  plan = {"num_params": count_params(params), "vocab_size": vocab_size, "devices": devices,
          "rows_per_device": rows, "segment_len": config.data.segment_len, "grad_accum": train_cfg.grad_accum,
          "backend": jax.default_backend(), "param_bytes": _tree_bytes(params),
          "opt_state_bytes": _tree_bytes(opt_state)}
  if m is not None:  # some backends report no plan
    plan.update(temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes),
                output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes))
    plan["peak_bytes"] = plan["argument_bytes"] + plan["output_bytes"] - plan["alias_bytes"] + plan["temp_bytes"]
  return plan


def format_memory_plan(plan: dict) -> str:
  row = lambda label, b: f"  {label:<62}{b / 2**30:9.3f} GiB"
  lines = [f"model: {plan['num_params']:,} parameters (vocab {plan['vocab_size']:,})",
           f"per-device memory plan: {plan['devices']} device(s), {plan['rows_per_device']} segments × "
           f"{plan['segment_len']} tokens per forward, {plan['grad_accum']} forwards per update "
           f"(one TRIME train step compiled for {plan['backend']})",
           row("parameters (float32)", plan["param_bytes"]),
           row("optimizer state", plan["opt_state_bytes"])]
  if "temp_bytes" in plan:
    lines += [row("step temporaries (activations, gradients, logits; XLA plan)", plan["temp_bytes"]),
              row("peak: arguments + outputs - donated + temporaries", plan["peak_bytes"])]
  else:
    lines.append(f"  step temporaries: the {plan['backend']} backend reports no compiled memory plan")
  return "\n".join(lines)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, splits=None) -> dict:
  """Train (or resume) in `workdir`, evaluate on dev, export. Returns the final metrics.

  Raises `Preempted` after checkpointing, when SIGTERM (or a multi-host preemption notice) arrives. One run per
  workdir: a second one raises LockedError naming the process that holds it."""
  validate_config(config)
  with workdir_files.run_in(workdir):
    return _train_and_evaluate(config, workdir, splits)


def _train_and_evaluate(config, workdir: str, splits) -> dict:
  if not chief():
    logging.set_verbosity(logging.WARNING)  # INFO lines from process 0 only
  # Before any work: refuses another run's workdir, naming fields (written once the exports are checked too).
  ckpt.check_resume_config(workdir, config, write=False)
  splits = splits or corpora.load_splits(config.data)
  vocab = splits.vocab
  if config.model.vocab_size and config.model.vocab_size != len(vocab):
    raise ConfigError(f"model.vocab_size={config.model.vocab_size} but the data's vocabulary has "
                      f"{len(vocab)} tokens (set model.vocab_size=0 to take it from the data)")
  train_cfg = config.train
  identity = {"train_fingerprint": splits.train.fingerprint()}
  # export/ and best/ hold this run's exports or nothing (refused now, not after training; by every process)
  distributed.on_chief(lambda: [exports.check_export_target(os.path.join(workdir, name), config, vocab, identity)
                                for name in ("export", "best")])
  mesh = sharding.make_mesh(train_cfg.num_devices)
  if train_cfg.batch_size % mesh.size:
    raise ConfigError(f"train.batch_size={train_cfg.batch_size} is not divisible by the {mesh.size} devices")

  # The typed specs, made once from the config (`specs`); the model and the loss below take only these.
  mcfg, spec = specs.model_config(config, vocab_size=len(vocab)), specs.loss_spec(config)
  model = build_model(mcfg, train_cfg.seed)
  graphdef, params = nnx.split(model, nnx.Param)
  tx, schedule = make_optimizer(train_cfg)
  # Placed before restoring: the abstract state then carries the mesh shardings, so orbax restores onto
  # every host's devices (multi-host) instead of one default device.
  state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
  if model.stateful:  # per-row state across segments: saved with the checkpoints, so a resume continues it
    state["carry"] = steps.init_train_carry(model, train_cfg.batch_size, config.data.segment_len)
  # None: a new run. Process 0's view (a listing of shared storage may lag on another host), as for data.json
  resumed = distributed.from_chief(workdir_files.newest_step(os.path.join(workdir, workdir_files.CHECKPOINTS)))
  recorded = distributed.from_chief(ckpt.recorded_data_identity(workdir) if resumed is not None else {})
  init_record = None
  if train_cfg.get("init_from"):
    if resumed is None:
      state, init_record = warm_start(state, train_cfg, mcfg, vocab, tx, log=_log)
    else:  # a resume: its checkpoint holds the run; the export it started from is not read again (it may be gone
      # or replaced by a later partial export), and data.json keeps the record of the one it started from
      init_record = recorded.get("init_from")
      _log(f"train.init_from={train_cfg.init_from}: not read, the run resumes from its checkpoints")
  state_sh = sharding.train_state_shardings(mesh, state)
  state = jax.device_put(state, state_sh)
  # The epoch layout: a resume keeps the one its run began with (data.json; a run of before 2026-12-06 has none)
  epochs = recorded.get("epochs", EPOCHS_STRADDLING) if resumed is not None else EPOCHS_WHOLE
  if epochs not in (EPOCHS_WHOLE, EPOCHS_STRADDLING):
    raise CheckpointError(f"{os.path.join(workdir, ckpt.DATA_FILE)} says epochs={epochs!r}, not an epoch layout this "
                          f"version knows ({EPOCHS_WHOLE!r}, {EPOCHS_STRADDLING!r}): restore the file")
  task = LMTask(config, splits, graphdef, tx, spec, mesh, state_sh, epochs=epochs)
  # What the batches are made of: a resume must read the same training split and batch plan (config.json names
  # only their paths; rewriting either between two invocations would silently change the rest of the run).
  data_identity = {"train_fingerprint": splits.train.fingerprint(),
                   "batch_plan_digest": task.source.plan.digest() if task.source.plan else None}
  if init_record is not None:  # the export a warm restart started from (its fingerprint and update)
    data_identity["init_from"] = init_record
  data_identity["epochs"] = epochs
  # trime.memory_grad='local_only' cuts key gradients at device boundaries: where that cut acts, the objective's
  # gradient depends on the device count, and a resume on another count would train another objective
  cut = sharded_loss.device_cut_rows(spec.objective, spec.memory_grad, train_cfg.batch_size, mesh.size)
  if resumed is not None and resumed >= train_cfg.num_steps:  # a finished run's rerun trains nothing: its record
    cut = recorded.get("memory_grad_cut_rows", cut)  # stays (it re-evaluates and exports on any device count)
  data_identity["memory_grad_cut_rows"] = cut
  if resumed is not None:  # (a run from before this record: its first resume records the cut it resumes with)
    check_resume_gradient_cut(workdir, config, recorded.get("memory_grad_cut_rows", cut), cut, mesh.size,
                              train_cfg.batch_size)
  ckpt.check_resume_data(workdir, config, data_identity, write=False)
  changed_at = task.source.first_update_of_another_layout()
  if epochs == EPOCHS_STRADDLING and changed_at is not None and max(changed_at, resumed) < train_cfg.num_steps:
    _log(f"this run began before 2026-12-06 and keeps the epoch layout it began with: its updates read on through "
         f"an epoch's end (from update {changed_at} on, one straddles two epochs); runs begun since make each epoch "
         f"whole updates, the last one padded")

  def starting():  # nothing was refused and the checkpoint restored: the run starts; config.json says what ran
    ckpt.check_resume_config(workdir, config)
    ckpt.check_resume_data(workdir, config, data_identity)

  n_params = count_params(params)
  _log(f"model: {n_params:,} parameters | vocab {len(vocab):,} | train tokens {len(splits.train):,} | "
       f"{len(task.source.segments):,} segments of {config.data.segment_len} | memory={spec.objective.memory} | "
       f"{loop.warm_up_words(task.warm, task.report_trime)} | devices {mesh.size}")
  out = loop.run(task, state, loop.LoopSpec.from_train(train_cfg), workdir, schedule=schedule, config=config,
                 place=lambda s: jax.device_put(s, state_sh), log=_log, starting=starting)
  return {**out, "num_params": n_params}


def check_resume_gradient_cut(workdir: str, config, before: int, now: int, devices: int, batch_rows: int) -> None:
  """ConfigError when trime.memory_grad='local_only' cuts key gradients otherwise than when the run began
  (`sharded_loss.device_cut_rows`: rows per device, 0 = no cut acting): resuming on another device count would
  change the objective halfway through the run without a word (within the CE warm-up too: the record is the
  run's). train.allow_config_change goes on (recorded in config_changes.jsonl with data.json's changes)."""
  if before == now or config.train.get("allow_config_change", False):
    return
  cut = lambda rows: (f"cut key gradients between devices every {rows} rows" if rows
                      else "cut no key gradient (no memory across devices)")
  began = f"train.num_devices={batch_rows // before}" if before else "one where no memory crosses devices"
  raise ConfigError(
      f"workdir {workdir}: trime.memory_grad='local_only' {cut(before)} when the run began, and would "
      f"{cut(now)} on the {devices} device{'s' * (devices != 1)} here: resuming would change the objective "
      f"halfway. Resume on the device count it began with ({began}), or pass "
      f"--config.train.allow_config_change=True to go on (recorded in config_changes.jsonl)")


def warm_start(state: dict, train_cfg, mcfg, vocab, tx, *, log) -> tuple[dict, dict]:
  """train.init_from: the initial state at the export's step (meta.json's `step`; train.export_on_stop writes
  such exports when a run stops early) with its parameters and a fresh optimizer whose schedule continues at that
  step (`optim.at_update`): a warm restart, the optimizer's moments lost. Refused for another architecture or
  vocabulary, a step at or past train.num_steps, and stateful (SRU++) models, whose carry is not exported.
  Returns (state, record): record = the export's fingerprint and step, kept in the workdir's data.json. Called
  when the workdir has no checkpoint only: a resume continues from its own checkpoints."""
  if "carry" in state:
    raise ConfigError("train.init_from: a stateful model's carry across segments is not in an export; resume it "
                      "from its checkpoints instead")
  try:  # a shipped model's name, a training workdir (its export/) or an export, read as `trime_jax.load` reads them
    path = exports.export_path(os.path.expanduser(str(train_cfg.init_from)), say=log)
    _, params, _, export_vocab, meta = exports.load_export(path)
  except (CheckpointError, ConfigError) as e:  # "checkpoint directory not found: ..." did not say which setting
    raise type(e)(f"train.init_from={train_cfg.init_from}: {e}") from None
  if meta.get("arch_digest") != exports.arch_digest(mcfg) or export_vocab.fingerprint() != vocab.fingerprint():
    raise ConfigError(f"train.init_from={path} is an export of another architecture or vocabulary than this "
                      "run's model")
  step = meta.get("step")
  if not isinstance(step, int) or not 0 <= step < int(train_cfg.num_steps):
    raise ConfigError(f"train.init_from={path}: its meta.json step {step!r} is not an update below "
                      f"train.num_steps={train_cfg.num_steps}")
  log(f"warm start from {path}: the parameters of update {step}{' (a partial export)' if meta.get('partial') else ''}"
      "; schedule, CE warm-up and data order continue from there, the optimizer's moments start afresh")
  record = {"fingerprint": exports.fingerprint(path), "step": step}
  return {"step": jnp.int32(step), "params": params, "opt_state": at_update(tx.init(params), step)}, record


class LMTask(loop.Task):
  """The language model's part of the training loop (`runtime.loop`): batches of segments placed on the mesh
  (each process loads only its rows), the train step (the sharded TRIME loss on a >1-device mesh), dev
  perplexity without memory and, for TRIME models, with local memory at τ=1, and `exports.export`."""

  eval_split = "dev"

  def __init__(self, config, splits, graphdef, tx, spec, mesh, state_shardings=None, epochs: str = EPOCHS_WHOLE):
    self.config, self.splits, self.graphdef, self.tx, self.spec, self.mesh = config, splits, graphdef, tx, spec, mesh
    # where the training state lives (`sharding.train_state_shardings`; None: all of it replicated)
    self.state_shardings = state_shardings or sharding.replicated(mesh)
    self.best_metric = best_metric(config)
    self.warm = ce_warmup_steps(config)
    self.report_trime = spec.objective.memory != "none"
    self.stateful = specs.stateful_backbone(config)  # its dev scores depend on the streams
    self.source = BatchSource(splits.train, config, epochs)
    data_sh = sharding.batch_sharding(mesh, batch_axis=1)
    train_cfg = config.train
    tokens_shape = (train_cfg.grad_accum, train_cfg.batch_size, config.data.segment_len)
    self.keys = ("inputs", "targets", "drop_local") + (("documents",) if self.source.with_documents else ()) + \
        (("reset",) if self.source.with_reset else ())
    self.shardings = {k: data_sh for k in self.keys}
    shapes = {"inputs": tokens_shape, "targets": tokens_shape, "drop_local": tokens_shape[:2],
              "documents": tokens_shape, "reset": tokens_shape[:2]}
    self.global_shapes = {k: shapes[k] for k in self.keys}
    # Each process loads only the rows its own devices hold (all of them when there is one process).
    self.rows = distributed.process_rows(data_sh, tokens_shape, axis=1)
    self._fns = {}

  def objective(self, step: int) -> str:
    return "trime" if self.report_trime and step >= self.warm else "ce"

  def step_fn(self, objective: str):
    if objective not in self._fns:
      # On a >1-device mesh the TRIME loss inside is the sharded one (explicit collectives over `data`).
      fn = functools.partial(steps.train_step, self.graphdef, self.tx, self.spec, objective == "trime",
                             self.report_trime, mesh=self.mesh)
      repl = sharding.replicated(self.mesh)
      self._fns[objective] = jax.jit(fn, in_shardings=(self.state_shardings, self.shardings, repl),
                                     out_shardings=(self.state_shardings, repl),
                                     donate_argnums=(0,))
    return self._fns[objective]

  def batch(self, step: int) -> dict:
    local = self.source(step, self.rows)
    return {k: distributed.global_array(self.shardings[k], v, self.global_shapes[k]) for k, v in local.items()}

  def evaluate(self, step: int, params) -> dict:
    """Dev perplexity during training: vanilla scoring and, for TRIME models, local memory at τ=1, on the
    training mesh's devices (`dev_streams`)."""
    del step
    e, train_cfg = self.config.eval, self.config.train
    points = (evaluate.NONE,) + ((evaluate.Point("trime_local", tau=1.0),) if self.report_trime else ())
    streams, mesh = self.dev_streams()
    res = evaluate.evaluate(self.graphdef, params, self.splits.dev, points, block_len=e.block_len,
                            context_window=e.context_window, streams=streams, vocab_chunk=train_cfg.vocab_chunk,
                            max_tokens=train_cfg.eval_max_tokens, mesh=mesh).scores
    return {**{f"{x.name}_ppl": x.ppl for x in res}, "tokens": res[0].tokens}

  def dev_streams(self) -> tuple[int, object]:
    """(streams, mesh) of the dev evaluation. A Transformer's scores do not depend on the number of streams, so
    on a mesh of n devices its eval.batch_size is rounded up to a multiple of n, one share per device (the
    247M's one stream becomes n: n× faster, no device holding more than before; over several processes, each
    evaluates its devices' share, `sharding.process_streams`); a stateful model's streams are part of its dev
    protocol and stay, split over as many devices as divide them (`sharding.eval_submesh`, which also says what
    a mesh of None means)."""
    streams, n = int(self.config.eval.batch_size), self.mesh.size
    if not self.stateful and n > 1:
      streams = -(-streams // n) * n
    return streams, sharding.eval_submesh(self.mesh, streams)

  def dev_protocol(self, config=None) -> dict:
    config = self.config if config is None else config
    e = config.eval
    protocol = {"eval_max_tokens": int(config.train.eval_max_tokens), "block_len": int(e.block_len),
                "context_window": int(e.context_window)}
    if specs.stateful_backbone(config):  # its attention span at evaluation (a config of
      # before 2026-12-06 has no field: the whole memory, as it was measured)
      protocol["srupp_eval_same_length"] = bool(config.model.get("srupp_eval_same_length", False))
      # and its streams: a stateful model's scores depend on how many streams share the dev split (each starts
      # from an empty state; evaluate.evaluate), a Transformer's do not
      protocol["streams"] = int(e.batch_size)
    return protocol

  def evaluate_export(self, directory: str) -> dict:
    return self.evaluate(0, exports.load_export(directory)[1])

  def describe_eval(self, dev: dict) -> str:
    return " | ".join(f"{k[:-4]} ppl {v:.3f}" for k, v in dev.items() if k.endswith("_ppl")) + \
        f" ({dev['tokens']:,} tokens)"

  def export(self, directory: str, params, extra: dict) -> str:
    # every process: orbax synchronises them
    return exports.export(directory, params, self.config, self.splits.vocab,
                       extra={**extra, "train_fingerprint": self.splits.train.fingerprint(),
                              **exports.data_path_meta(self.config)})
