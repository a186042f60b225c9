"""Training loop for translation: vanilla CE (optionally label-smoothed) or TrimeMT_ext.

TrimeMT_ext (paper §5): the TRIME loss with external in-batch memory over target tokens and no local memory —
`loss.trime_nll_from_vocab_stats(memory="ext", drop_local=True)` for every row, so a target token sees every
target token of every *other* sentence pair in the batch (a pair's own tokens never: sentence-level MT has no
local or long-term memory). Padding targets are -1: never scored, never memory. On a >1-device mesh the same
loss is `sharded_loss.sharded_trime_nll_from_vocab_stats` (rows sharded over `data`). The first
`trime.ce_warmup_steps` updates train plain CE.

The loop is the LM trainer's (`runtime.loop.run`, with `MTTask` below): resuming from the newest checkpoint
(rerunning the same command continues; the batch of update s is a function of s, `batching.Plan.update_at`),
metrics lines, TensorBoard / W&B, the progress bar, profiling, SIGTERM (checkpoint, then `Preempted`), a
non-finite loss (`TrainingError`), best-export keeping (`train.keep_best`, by valid ce_ppl), `train.stop_after`,
the final evaluation and the export. Also shared: the optimizer and schedule, the workdir's lock,
`checkpoint.check_resume_config` (the stored config.json compared with the LM trainer's rules:
train.allow_config_change) and `check_export_target`. One run per workdir (a second raises LockedError naming
the process).

Writes `<workdir>/`: config.json, plan.npz (the batch plan), checkpoints/, metrics.jsonl (train lines and
`{"split": "valid", ...}` dev lines: CE nll/ppl, and TRIME nll/ppl with in-batch memory for memory=ext), tb/,
`export/` (params + config + the subword model, atomic; `mt.export.load_mt_export`) and, with train.keep_best,
`best/` (the same layout).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from trime_jax import checkpoint as ckpt, distributed, exports
from trime_jax.errors import ConfigError
from trime_jax import loss
from trime_jax import scoring
from trime_jax import sharded_loss
from trime_jax import sharding
from trime_jax import specs
from trime_jax.runtime import loop
from trime_jax.runtime import workdir as workdir_files
from trime_jax.runtime.optim import make_optimizer
from trime_jax.runtime.progress import say
from trime_jax.mt import batching
from trime_jax.mt import bleu
from trime_jax.mt import data as mt_data
from trime_jax.mt import decode
from trime_jax.mt import model as mt_model
from trime_jax.mt import export as mt_export

from trime_jax.mt.train_config import batches_per_update_of, pack_len_of, validate_config


# ----------------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------------
def mt_nll(model, batch, spec: loss.ObjectiveSpec, *, use_trime: bool, vocab_chunk=0, label_smoothing=0.0,
           deterministic=True, rngs=None, mesh=None, variant="gather", memory_grad="all", grad_groups=0):
  """Sums over the batch's valid target tokens: (objective, ce, trime, n_tokens).

  batch: src [B, S], prev [B, T], targets [B, T] (-1 = padding). The TRIME term is computed (and reported)
  whenever spec.memory == "ext"; it is the objective only when `use_trime`. `grad_groups` = G > 0 (one
  device; trime.memory_grad_groups): the rows as G contiguous groups of ceil(B / G), a memory key's gradient
  from the queries of its own group only, as the original's G GPUs all_gather their keys without gradient.
  batch["loss_mask"] [B, T] (optional; `batching.collate_update`'s idle-GPU blocks): tokens where it is 0 are
  memory only: neither scored nor counted (the original's dummy batch, whose keys the other GPUs gather)."""
  src, prev, targets = batch["src"], batch["prev"], batch["targets"]
  drop = dict(deterministic=deterministic, rngs=rngs)
  packed = batch.get("tgt_seg")  # packed rows (data.pack_len): pair numbers per target position
  enc = model.encode(src, **drop, segments_BxS=batch.get("src_seg"), positions_BxS=batch.get("src_pos"))
  f, g = model.decode(enc, src, prev, **drop, src_segments_BxS=batch.get("src_seg"), segments_BxT=packed,
                      positions_BxT=batch.get("tgt_pos"))
  valid = targets >= 0  # memory: every real target token
  scored = valid if batch.get("loss_mask") is None else valid & (batch["loss_mask"] > 0)
  ntok = scored.sum()
  if label_smoothing:  # the release's label_smoothed_nll_loss (its fairseq fork, machine_translation/fairseq/
    # criterions/label_smoothed_cross_entropy.py): (1 - ε)·nll + ε_i·Σ_v -log p_v, ε_i = ε/V (later fairseq:
    # (1 - ε - ε_i)·nll + ε_i·Σ_v, ε_i = ε/(V-1), which this followed until 2026-12-06)
    logits = model.logits(f)
    stats = scoring.vocab_stats(logits, targets)
    v = logits.shape[-1]
    nll = stats.log_normalizer - stats.target_logit
    smooth = v * stats.log_normalizer - logits.sum(-1)
    eps_i = label_smoothing / v
    obj = jnp.where(scored, (1.0 - label_smoothing) * nll + eps_i * smooth, 0.0).sum()
  else:
    stats = model.vocab_stats(f, targets, vocab_chunk=vocab_chunk, **drop)
    obj = None
  ce = jnp.where(scored, stats.log_normalizer - stats.target_logit, 0.0).sum()
  obj = ce if obj is None else obj
  if spec.memory == "none":
    return obj, ce, ce, ntok

  def trime(keys):
    if mesh is not None and mesh.size > 1:
      nll = sharded_loss.sharded_trime_nll_from_vocab_stats(stats, keys, targets, spec, mesh=mesh, drop_local=True,
                                                            rows=packed, variant=variant, memory_grad=memory_grad)
      return jnp.where(scored, nll, 0.0).sum()
    # G groups: of ceil(B / G) rows; packed (the original's composition, `batching.collate_update`), of the G row
    # blocks' pair-number spans
    span = (batching.packed_group_span(targets.shape, grad_groups) if packed is not None
            else -(-targets.shape[0] // grad_groups)) if grad_groups else 0
    one = dataclasses.replace(spec, memory_grad_group_rows=span) if grad_groups else spec
    return jnp.where(scored, loss.trime_nll_from_vocab_stats(stats, keys, targets, one, drop_local=True, rows=packed),
                     0.0).sum()

  if use_trime:
    tr = trime(g)
    return tr, ce, tr, ntok
  return obj, ce, jax.lax.stop_gradient(trime(jax.lax.stop_gradient(g))), ntok


def train_step(graphdef, tx, spec, use_trime, vocab_chunk, label_smoothing, sharded, state, batch, dropout_key,
               grad_groups=0):
  """One update on one batch; gradients of the summed objective over its target-token count (fairseq).
  sharded: None (one device) or (mesh, variant, memory_grad) of the sharded loss; grad_groups: `mt_nll`'s (one
  device)."""
  mesh, variant, memory_grad = sharded or (None, "gather", "all")
  params = state["params"]

  def objective(p):
    model = nnx.merge(graphdef, p)
    obj, ce, tr, n = mt_nll(model, batch, spec, use_trime=use_trime, vocab_chunk=vocab_chunk,
                            label_smoothing=label_smoothing, deterministic=False,
                            rngs=nnx.Rngs(dropout=dropout_key), mesh=mesh, variant=variant,
                            memory_grad=memory_grad, grad_groups=0 if sharded else grad_groups)
    return obj / jnp.maximum(n, 1), (ce, tr, n)

  (obj, (ce, tr, n)), grads = jax.value_and_grad(objective, has_aux=True)(params)
  grad_norm = optax.tree.norm(grads)
  updates, new_opt = tx.update(grads, state["opt_state"], params)
  new_params = optax.apply_updates(params, updates)
  ok = jnp.isfinite(obj) & jnp.isfinite(grad_norm)  # a non-finite update is skipped, not applied
  keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)
  nf = jnp.maximum(n, 1).astype(jnp.float32)
  new_state = {"step": state["step"] + 1, "params": keep(new_params, params),
               "opt_state": keep(new_opt, state["opt_state"])}
  return (new_state,
          {"loss": obj, "ce_nll": ce / nf, "trime_nll": tr / nf, "tokens": n, "grad_norm": grad_norm,
           "skipped": 1 - ok.astype(jnp.int32)})


@functools.lru_cache(maxsize=16)
def _step_fn(graphdef, train_json: str, spec, use_trime: bool, sharded, grad_groups: int = 0):
  """The jitted update, cached across runs in one process (a resumed run in a notebook or a test does not
  recompile): keyed by the model graph, the train section (optimizer, schedule, smoothing) and the objective."""
  r = ml_collections.ConfigDict(json.loads(train_json))
  tx, _ = make_optimizer(r)
  fn = functools.partial(train_step, graphdef, tx, spec, use_trime, int(r.vocab_chunk), float(r.label_smoothing),
                         sharded, grad_groups=grad_groups)
  return jax.jit(fn, donate_argnums=(0,))


def eval_sums(graphdef, spec, vocab_chunk, params, batch):
  model = nnx.merge(graphdef, params)
  _, ce, tr, n = mt_nll(model, batch, spec, use_trime=spec.memory != "none", vocab_chunk=vocab_chunk)
  return ce, tr, n


def evaluate(graphdef, params, pairs, config, spec, *, max_pairs=0) -> dict:
  """Dev CE nll/ppl (model alone) and, for memory=ext, TRIME nll/ppl with in-batch memory (length batches)."""
  pairs = pairs.head(max_pairs)
  plan = batching.make_plan(pairs, order="length", max_tokens=int(config.data.max_tokens), seed=0,
                            max_sentences=int(config.data.max_sentences))
  fn = _eval_fn(graphdef, spec, int(config.train.vocab_chunk))
  ce = tr = 0.0
  n = 0
  for i in range(plan.num_batches):
    b = batching.collate_batch(pairs, plan, i)
    c, t, k = fn(params, b)
    ce, tr, n = ce + float(c), tr + float(t), n + int(k)
  out = {"ce_nll": ce / max(n, 1), "ce_ppl": math.exp(min(ce / max(n, 1), 50)), "tokens": n, "pairs": len(pairs)}
  if spec.memory != "none":
    out.update(trime_nll=tr / max(n, 1), trime_ppl=math.exp(min(tr / max(n, 1), 50)))
  return out


# The original's valid translations for --best-checkpoint-metric bleu: --eval-bleu-args '{"beam": 5, "max_len_a":
# 1.2, "max_len_b": 10}' (lenpen: fairseq's default 1), detokenised by Moses with the BPE removed (`ParallelData.text`)
VALID_BLEU_SEARCH = decode.SearchOptions(beam=5, lenpen=1.0, max_len_a=1.2, max_len_b=10)


def valid_bleu(graphdef, params, pairs, config, vocab, *, max_pairs=0, batch_sentences: int = 32) -> float:
  """Corpus BLEU of beam-search translations (the model alone, `VALID_BLEU_SEARCH`) of the first `max_pairs`
  valid pairs (0: all) against their references, as `trime_jax.launch.translate` scores a split."""
  pairs = pairs.head(max_pairs)
  cfg = specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size)
  translator = decode.Translator(graphdef, params, cfg, options=VALID_BLEU_SEARCH, eos_id=vocab.eos_id)
  hyps = translator.translate(pairs.src, batch_sentences=batch_sentences)
  return float(bleu.corpus_bleu([pairs.text(h.tokens) for h in hyps], pairs.tgt_text)["bleu"])


@functools.lru_cache(maxsize=8)
def _eval_fn(graphdef, spec, vocab_chunk):
  return jax.jit(functools.partial(eval_sums, graphdef, spec, vocab_chunk))


# ----------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------
def plan_target_tokens(pairs, plan: batching.Plan) -> np.ndarray:
  """[num_batches] target tokens (ids + eos) of each plan batch."""
  per_pair = np.asarray([len(t) + 1 for t in pairs.tgt], np.int64)
  return np.add.reduceat(per_pair[plan.indices], plan.offsets[:-1])


def run_updates(train_cfg, plan: batching.Plan) -> int:
  """The run's length cap in updates: train.num_steps, or train.num_epochs passes over the plan's batches when
  that is fewer (fairseq's --max-epoch with --max-update: whichever ends the run first)."""
  epochs = int(train_cfg.get("num_epochs", 0))
  steps = int(train_cfg.num_steps)
  return min(steps, epochs * plan.num_updates) if epochs > 0 else steps


def target_tokens_seen(plan: batching.Plan, tokens_of: np.ndarray, num_steps: int, budget: int) -> np.ndarray:
  """[updates] int64: the target tokens trained on after each update of the run. Its length is the run's length:
  num_steps (`run_updates`), or fewer when `train.target_token_budget` (> 0) is reached first — the first update
  after which the target tokens trained on reach the budget (deterministic: the plan fixes every batch). Equal
  target-token budgets compare objectives whose batches pad differently (BM25 batches mix lengths)."""
  seen, total = [], 0
  for s in range(num_steps):
    total += int(tokens_of[plan.update_at(s)].sum())
    seen.append(total)
    if 0 < budget <= total:
      break
  return np.asarray(seen, np.int64)


def load_plan(workdir: str, pairs, config) -> tuple[batching.Plan, bool]:
  """The run's batch plan: read from <workdir>/plan.npz when it matches the config, else made; (plan, made). A
  made plan is saved by the caller once the run starts (a refused run leaves the workdir as it was)."""
  t, d = config.trime, config.data
  per_update = batches_per_update_of(config)
  composition = {"batches_per_update": per_update}  # 0 in a plan written before the field: ours
  if per_update:
    composition["batch_size_multiple"] = int(d.get("batch_size_multiple", 8))
  want = {"order": t.batching, "seed": int(config.train.seed), "max_tokens": int(d.max_tokens),
          "max_sentences": int(d.max_sentences), "num_pairs": len(pairs), "pairs_fingerprint": pairs.fingerprint()}
  if t.batching == "bm25":
    want.update(k=int(t.bm25_k), bm25_k1=float(t.bm25_k1), bm25_b=float(t.bm25_b),
                bm25_analyzer=t.get("bm25_analyzer", "english"))
  path = os.path.join(workdir, "plan.npz")
  if os.path.exists(path):
    plan = batching.Plan.load(path)
    # A plan written before plans recorded their pairs' fingerprint is kept when the rest matches: a run resumed
    # across versions goes on with its batches (its data are checked against <workdir>/data.json instead)
    # (BM25's k1 / b likewise: a plan of before 2026-12-07 has none, made at bm25s's 1.5 / 0.75; its analyzer:
    # a plan of before 2026-12-08 searched target subword ids)
    if all(plan.header.get(k) == v for k, v in want.items()
           if k not in ("pairs_fingerprint", "bm25_k1", "bm25_b", "bm25_analyzer") or k in plan.header) and \
        all(plan.header.get(k, 0) == v for k, v in composition.items()):
      return plan, False
  t0 = time.perf_counter()
  plan = batching.make_plan(pairs, order=t.batching, max_tokens=int(d.max_tokens), seed=int(config.train.seed),
                            max_sentences=int(d.max_sentences), bm25_k=int(t.bm25_k), bm25_k1=float(t.bm25_k1),
                            bm25_b=float(t.bm25_b), bm25_analyzer=t.get("bm25_analyzer", "english"),
                            bm25_backend=t.get("bm25_backend", "numba"), batches_per_update=per_update,
                            batch_size_multiple=int(d.get("batch_size_multiple", 8)))
  plan.header["plan_s"] = round(time.perf_counter() - t0, 2)
  plan.header["pairs_fingerprint"] = want["pairs_fingerprint"]  # a plan of other pairs is not reused
  return plan, True


def train_and_evaluate(config, workdir: str, *, log=say) -> dict:
  """Train (or resume) in `workdir`, evaluate on valid, export. Returns the final metrics."""
  validate_config(config)
  mt_data.resolve_data_path(config)
  with workdir_files.run_in(workdir):
    return _train_and_evaluate(config, workdir, log)


def _train_and_evaluate(config, workdir: str, log) -> dict:
  # Before any work: refuses another run's workdir (the LM trainer's rule: an unknown field in config.json, or a
  # resumed run whose training fields changed without train.allow_config_change), naming the fields.
  ckpt.check_resume_config(workdir, config, write=False)
  vocab = mt_data.load_vocab(config)
  # export/ and best/ hold this run's exports or nothing: refused now, not after training.
  for name in ("export", "best"):
    # (its architecture too: exports carry arch_digest since 2026-12-06, and comparing it with none refused every
    # rerun and every resume after a best/ was written)
    exports.check_export_target(os.path.join(workdir, name), config, vocab, meta=mt_export.identity(config, vocab))
  train_pairs = mt_data.load_parallel(config, "train", vocab)
  valid_pairs = mt_data.load_parallel(config, "valid", vocab)
  plan, made = load_plan(workdir, train_pairs, config)
  # What the batches are made of: a resume must read the same training pairs (config.json names only their
  # path; pairs rewritten between two invocations would silently change the rest of the run), as the LM trainer
  data_identity = {"train_fingerprint": train_pairs.fingerprint(), "batch_plan_digest": plan.digest()}
  ckpt.check_resume_data(workdir, config, data_identity, write=False)
  r = config.train
  mesh = sharding.make_mesh(r.num_devices)
  # The typed specs, made once from the config (`specs`); what lies below takes only these.
  spec, mcfg = specs.objective_spec(config), specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size)
  model = mt_model.build_mt_model(mcfg, int(r.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  tx, schedule = make_optimizer(r)
  state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
  task = MTTask(config, graphdef, spec, mesh, plan, train_pairs, valid_pairs, vocab)
  n_params = mt_model.count_params(params)
  log(f"mt model: {n_params:,} parameters | vocab {vocab.size:,} ({vocab.kind}"
      + (f"; target dictionary {vocab.target_size:,}" if vocab.separate else "") + f") | train pairs {len(train_pairs):,} | "
      f"{plan.num_updates:,} updates/epoch" + (f" of {plan.per_update} GPU batches ({plan.num_batches:,} GPU batches)"
                                                if plan.per_update else "")
      + f" ({config.trime.batching}, shapes {plan.header['shapes']}) | "
      f"memory={spec.memory} | {loop.warm_up_words(task.warm, task.report_trime)} | devices {mesh.size}")
  if "neighbour_in_batch" in plan.header:
    log(f"bm25 plan: neighbours (of the top-k hits) in the same batch {plan.header['neighbour_in_batch']:.1%} "
        f"(random batches {plan.header['neighbour_in_batch_random']:.1%})")
    from trime_jax.batching import bm25  # bm25s only where a BM25 plan was read

    if not made and (old := bm25.older_rules(plan.header)):
      log(f"note: {workdir}/plan.npz was made before 2026-12-07 ({'; '.join(old)}): this run goes on with it")
  def starting():  # the checkpoint restored and nothing refused: the run starts; config.json says what ran
    ckpt.check_resume_config(workdir, config)
    ckpt.check_resume_data(workdir, config, data_identity)
    if made:  # one writer (several processes would each write the same file)
      distributed.on_chief(lambda: plan.save(os.path.join(workdir, "plan.npz")))

  out = loop.run(task, state, loop.LoopSpec.from_train(r, total=task.total), workdir, schedule=schedule,
                 config=config, log=log, starting=starting)
  return {**out, "num_params": n_params}


class MTTask(loop.Task):
  """Translation's part of the training loop (`runtime.loop`): the plan's batches (a function of the update),
  padded to split over the devices; the update of `train_step`; valid CE (and TRIME with in-batch memory) nll and
  perplexity; `mt.export.export_mt`. The run ends at train.num_steps, after train.num_epochs passes over the plan
  (`run_updates`) or when train.target_token_budget target tokens were trained on (`target_tokens_seen`),
  whichever comes first; train lines add target_tokens_seen."""

  eval_split = "valid"

  def __init__(self, config, graphdef, spec, mesh, plan, train_pairs, valid_pairs, vocab):
    self.config, self.graphdef, self.spec, self.mesh, self.plan = config, graphdef, spec, mesh, plan
    # train.best_metric: ce_ppl (the model's own distribution, which every decoding mode starts from) or bleu
    # (valid BLEU of beam search, higher is better: the original's --best-checkpoint-metric bleu)
    self.best_metric = str(config.train.get("best_metric", "ce_ppl"))
    self.best_maximize = self.best_metric == "bleu"
    self.train_pairs, self.valid_pairs, self.vocab = train_pairs, valid_pairs, vocab
    r, t = config.train, config.trime
    self.warm = int(t.ce_warmup_steps)
    self.pack_len = pack_len_of(config)
    self.seen = target_tokens_seen(plan, plan_target_tokens(train_pairs, plan), run_updates(r, plan),
                                   int(r.get("target_token_budget", 0)))
    self.total = len(self.seen)
    self.train_json = json.dumps(json.loads(r.to_json_best_effort()), sort_keys=True)
    self.sharded = (mesh, str(t.sharded_variant), str(t.memory_grad)) if mesh.size > 1 else None
    if self.sharded and plan.per_update and str(t.memory_grad) == "local_only" and mesh.size != plan.per_update:
      raise ConfigError(f"trime.memory_grad='local_only' cuts key gradients between devices, and the update's "
                        f"{plan.per_update} GPU batches (data.batches_per_update) are the original's groups:"
                        f" train on that many devices (train.num_devices), on one (trime.memory_grad_groups), or "
                        f"with trime.memory_grad='all' ({mesh.size} devices here)")
    self.grad_groups = int(t.get("memory_grad_groups", 0))
    self.report_trime = self.spec.memory != "none"

  def objective(self, step: int) -> str:
    return "trime" if self.report_trime and step >= self.warm else "ce"

  def step_fn(self, objective: str):
    return _step_fn(self.graphdef, self.train_json, self.spec, objective == "trime", self.sharded, self.grad_groups)

  def batch(self, step: int) -> dict:
    # the original's composition packed: each row block a whole number of device shards
    b = batching.collate_update(self.train_pairs, self.plan, step, pack_len=self.pack_len,
                                rows_multiple=self.mesh.size // math.gcd(self.mesh.size, max(self.plan.per_update, 1)))
    if self.mesh.size > 1 and b["src"].shape[0] % self.mesh.size:  # rows must split over the devices
      pad = self.mesh.size - b["src"].shape[0] % self.mesh.size
      b = {k: np.pad(v, ((0, pad), (0, 0)), constant_values=(-1 if k == "targets" else 0)) for k, v in b.items()}
    return b

  def evaluate(self, step: int, params) -> dict:
    del step
    out = evaluate(self.graphdef, params, self.valid_pairs, self.config, self.spec,
                   max_pairs=int(self.config.train.eval_max_pairs))
    if self.best_metric == "bleu":
      out["bleu"] = valid_bleu(self.graphdef, params, self.valid_pairs, self.config, self.vocab,
                               max_pairs=int(self.config.train.eval_max_pairs))
    return out

  def dev_protocol(self, config=None) -> dict:
    config = self.config if config is None else config
    protocol = {"eval_max_pairs": int(config.train.eval_max_pairs)}
    if str(config.train.get("best_metric", "ce_ppl")) == "bleu":  # and how the valid translations are searched
      protocol["bleu_search"] = dataclasses.asdict(VALID_BLEU_SEARCH)
    return protocol

  def evaluate_export(self, directory: str) -> dict:
    return self.evaluate(0, mt_export.load_mt_export(directory)[1])

  def describe_eval(self, dev: dict) -> str:
    return " | ".join(f"{k} {v:.3f}" for k, v in dev.items() if k.endswith(("_nll", "_ppl")) or k == "bleu") + \
        f" ({dev['tokens']:,} target tokens, {dev['pairs']:,} pairs)"

  def export(self, directory: str, params, extra: dict) -> str:
    return mt_export.export_mt(directory, params, self.config, self.vocab,
                               extra={**extra, "plan": {k: self.plan.header[k] for k in ("order", "num_batches")}})

  def record(self, done: int) -> dict:
    return {"target_tokens_seen": int(self.seen[done - 1])}
