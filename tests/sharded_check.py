"""Sharded TRIME loss vs the single-device computation, on 8 virtual CPU devices.

  python tests/sharded_check.py loss|model|train|placed [workdir]

Run in a subprocess by tests/test_sharded.py (the device count must be set before jax initialises, and the
pytest process already has 1 device). Prints one JSON object of measured differences; the test asserts on
it. Every sharded computation of a group is compiled as one jitted function to keep the compile time low.
"""

import os
import subprocess
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")  # LLVM -O0: compiles ~2x faster on CPU
os.environ["JAX_PLATFORMS"] = "cpu"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from trime_jax import loss as L  # noqa: E402
from trime_jax import scoring as S  # noqa: E402
from trime_jax import sharded_loss  # noqa: E402
from trime_jax.sharding import make_mesh  # noqa: E402

N_DEV = 8
B, SEG, D = 24, 6, 8  # 3 rows per device: runs of m=2, 4, 8, 24 cross device boundaries, m=3 does not
# (memory, consecutive_segments): local; long aligned with devices (no communication); long runs spanning
# 2 (whole-run layout), 2-3, 3-4 and all 8 devices (own-queries layout; m=24: one run, the halo reaches past
# row 0 from the last device); ext (drop_local is a traced argument: both values use one compilation).
CASES = [("local", 1), ("long", 3), ("long", 2), ("long", 4), ("long", 8), ("long", 24), ("ext", 1)]
TAU = 0.7


def _targets(rng, v):
  t = rng.integers(0, v, size=(B, SEG))
  t[1, -2:] = -1  # tail padding
  t[7, :3] = -1  # head padding
  t[9] = -1  # an all-padding row (the first row of device 3)
  t[14, 2] = -1  # a hole
  return t


def _max_err(a, b):
  return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _max_abs(a):
  return max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(a))


def local_only_reference(stats, keys, targets, memory, m, drop_local, tau, documents=None):
  """Dense single-device nll `[B, L]` where a memory on another device than the query is stop-gradiented:
  the query-memory similarity uses the live key on the same device and a detached copy across devices."""
  b, l, d = keys.shape
  flat = L.TokenMeta(*(x.reshape(-1) for x in L.batch_meta(targets, memory, m, documents_BxL=documents)))
  causal = L.per_query_causal(memory, drop_local, b, l).reshape(-1)
  mask = L.visible(flat, flat, causal, memory == "ext")
  device = flat.row // (b // N_DEV)
  q = keys.reshape(-1, d)
  scale = 1.0 / (np.sqrt(d) * tau)
  sim = jnp.where(device[:, None] == device[None, :], q @ q.T, q @ jax.lax.stop_gradient(q).T) * scale
  positive = mask & (flat.target[None, :] == flat.target[:, None])
  log_z = S.masked_logsumexp_with(stats.log_normalizer.reshape(-1), sim, mask)
  log_p = S.masked_logsumexp_with(stats.target_logit.reshape(-1), sim, positive)
  return jnp.where(targets >= 0, (log_z - log_p).reshape(b, l), 0.0)


def check_loss():
  """float64: values and d/d(logits, keys) for every mode, both variants, both memory_grad options."""
  jax.config.update("jax_enable_x64", True)
  mesh = make_mesh(N_DEV)
  rng = np.random.default_rng(0)
  v = 5  # few distinct targets: many positive memories
  logits = rng.normal(size=(B, SEG, v))
  keys = rng.normal(size=(B, SEG, D)) * 2
  targets = _targets(rng, v)
  weights = rng.normal(size=(B, SEG))  # a random linear functional of the nll
  # The "rows" pass: ext drops local memory per row (mixed within every device), long runs are packed with
  # document boundaries inside rows, at row starts and at device boundaries (rows 3, 6, 9, 12, ...).
  drop_rows = rng.random(B) < 0.5
  starts = np.zeros(B * SEG, int)
  starts[rng.choice(B * SEG, size=12, replace=False)] = 1
  starts[[3 * SEG, 12 * SEG, 13 * SEG]] = 1
  documents = np.cumsum(starts).reshape(B, SEG)

  runs = [(mem, m, var, "all", False) for mem, m in CASES for var in ("gather", "ring")]
  runs += [(mem, m, var, "local_only", False) for mem, m, var in
           [("local", 1, "gather"), ("long", 3, "gather"), ("long", 2, "gather"), ("long", 8, "ring"),
            ("long", 24, "gather"), ("ext", 1, "gather"), ("ext", 1, "ring")]]
  runs += [("ext", 1, var, "all", True) for var in ("gather", "ring")]  # stop_gradient_memory

  def packed(mem, docs):
    return docs if mem == "long" else None

  def sharded(lg, ks, drop, docs):
    out = []
    for mem, m, var, mg, sg in runs:
      if docs is not None and mem == "local":
        out.append(None)
        continue
      f = lambda lg, ks: (sharded_loss.sharded_trime_nll(
          lg, ks, targets, mesh=mesh, memory=mem, consecutive_segments=m, drop_local=drop,
          documents=packed(mem, docs), stop_gradient_memory=sg, tau=TAU, variant=var,
          memory_grad=mg, memory_chunk=5) * weights).sum()
      out.append(jax.value_and_grad(f, argnums=(0, 1))(lg, ks))
    return out

  ref_keys = sorted({(mem, m, mg if mem != "local" and (mem, m) != ("long", 3) else "all", sg)
                     for mem, m, _, mg, sg in runs})

  def reference(lg, ks, drop, docs):
    out = {}
    for mem, m, mg, sg in ref_keys:
      if docs is not None and mem == "local":
        continue
      if mg == "all":
        f = lambda lg, ks: (L.trime_nll(lg, ks, targets, memory=mem, consecutive_segments=m, drop_local=drop,
                                        documents=packed(mem, docs), stop_gradient_memory=sg,
                                        tau=TAU, implementation="dense") * weights).sum()
      else:
        f = lambda lg, ks: (local_only_reference(L.vocab_stats(lg, targets), ks, targets, mem, m, drop,
                                                 TAU, packed(mem, docs)) * weights).sum()
      out[(mem, m, mg, sg)] = jax.value_and_grad(f, argnums=(0, 1))(lg, ks)
    return out

  sharded_fn, reference_fn = jax.jit(sharded), jax.jit(reference)
  results = []
  for drop, docs in ((False, None), (True, None), (drop_rows, documents)):
    got, want = sharded_fn(logits, keys, drop, docs), reference_fn(logits, keys, drop, docs)
    per_row = docs is not None
    for (mem, m, var, mg, sg), out in zip(runs, got):
      if out is None or (mem != "ext" and drop is True):
        continue
      val, grads = out
      label = ("rows" if mem == "ext" else "documents") if per_row else drop
      aligned = mem == "local" or (mem, m) == ("long", 3)  # no memory on another device
      ref_val, ref_grads = want[(mem, m, "all" if aligned else mg, sg)]
      row = {"memory": mem, "m": m, "drop_local": label, "variant": var, "memory_grad": mg,
             "stop_gradient_memory": sg, "aligned": aligned, "value": float(val),
             "value_err": abs(float(val - ref_val)), "grad_err": _max_err(grads, ref_grads),
             "grad_scale": _max_abs(ref_grads)}
      if mg == "local_only":  # how far the key gradient is from the full ("all") one
        row["keys_grad_diff_vs_all"] = float(jnp.abs(grads[1] - want[(mem, m, "all", sg)][1][1]).max())
        row["logits_grad_diff_vs_all"] = float(jnp.abs(grads[0] - want[(mem, m, "all", sg)][1][0]).max())
      results.append(row)
  # memory_topk (the original MT criterion's --topk-mem), gather variant: the top k of the global batch.
  topk = []
  for drop in (False, True, drop_rows):
    for mg in ("all", "local_only"):
      f = lambda lg, ks, drop=drop, mg=mg: (sharded_loss.sharded_trime_nll(
          lg, ks, targets, mesh=mesh, memory="ext", drop_local=drop, tau=TAU, memory_topk=3,
          memory_grad=mg) * weights).sum()
      val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(logits, keys)
      if mg == "all":
        r = lambda lg, ks, drop=drop: (L.trime_nll(lg, ks, targets, memory="ext", drop_local=drop,
                                                   tau=TAU, memory_topk=3) * weights).sum()
        ref_val, ref_grads = jax.jit(jax.value_and_grad(r, argnums=(0, 1)))(logits, keys)
      topk.append({"drop_local": "rows" if drop is drop_rows else drop, "memory_grad": mg, "value": float(val),
                   "value_err": abs(float(val - ref_val)), "logits_grad_err": _max_err(grads[0], ref_grads[0]),
                   "keys_grad_err": _max_err(grads[1], ref_grads[1]), "grad_scale": _max_abs(ref_grads)})
  group_cut = check_group_cut(mesh, logits, keys, targets, weights, drop_rows)
  # A learned (traced) τ: d/dτ of the sharded loss against the dense single-device one (the blockwise kernels
  # and the ring return the scale's cotangent; shard_map sums the devices' parts of the replicated τ).
  tau_grad = []
  for mem, m, var in [("long", 2, "gather"), ("long", 8, "ring"), ("ext", 1, "gather"), ("ext", 1, "ring")]:
    f = lambda tau: (sharded_loss.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory=mem,
                                                    consecutive_segments=m, tau=tau, variant=var,
                                                    memory_chunk=5) * weights).sum()
    r = lambda tau: (L.trime_nll(logits, keys, targets, memory=mem, consecutive_segments=m, tau=tau,
                                 implementation="dense") * weights).sum()
    got, want = float(jax.jit(jax.grad(f))(TAU)), float(jax.grad(r)(TAU))
    tau_grad.append({"memory": mem, "m": m, "variant": var, "grad": got, "reference": want})
  try:
    sharded_loss.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory="ext", memory_topk=3, variant="ring")
    ring_topk_error = ""
  except ValueError as e:
    ring_topk_error = str(e)
  # long memory with a top k: runs within each device's rows (m = 3) take it as trime_nll does; runs across
  # devices (m = 4) are refused (they were scored over their whole memory, the top k silently dropped)
  aligned = np.abs(np.asarray(sharded_loss.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory="long",
                                                             consecutive_segments=3, memory_topk=2))
                   - np.asarray(L.trime_nll(logits, keys, targets, memory="long", consecutive_segments=3,
                                            memory_topk=2))).max()
  try:
    sharded_loss.sharded_trime_nll(logits, keys, targets, mesh=mesh, memory="long", consecutive_segments=4,
                                   memory_topk=2)
    long_topk_error = ""
  except ValueError as e:
    long_topk_error = str(e)
  # Which collectives each configuration's forward + backward contains (StableHLO before partitioning: only
  # the explicit ones of the shard_map body).
  collectives = {}
  for mem, m, var, mg in [("local", 1, "gather", "all"), ("long", 3, "ring", "all"), ("long", 2, "gather", "all"),
                          ("long", 8, "ring", "all"), ("ext", 1, "gather", "all"),
                          ("ext", 1, "gather", "local_only"), ("ext", 1, "ring", "all"),
                          ("ext", 1, "ring", "local_only")]:
    f = lambda lg, ks: sharded_loss.sharded_trime_nll(lg, ks, targets, mesh=mesh, memory=mem, consecutive_segments=m,
                                           variant=var, memory_grad=mg).sum()
    text = jax.jit(jax.grad(f, argnums=(0, 1))).lower(logits, keys).as_text()
    ops = re.findall(r"stablehlo\.(all_gather|reduce_scatter|collective_permute|all_reduce|all_to_all)", text)
    collectives[f"{mem}/{m}/{var}/{mg}"] = sorted(set(ops))
  return {"cases": results, "collectives": collectives, "topk": topk, "ring_topk_error": ring_topk_error,
          "long_topk": {"aligned_err": float(aligned), "crossing_error": long_topk_error},
          "group_cut": group_cut, "tau_grad": tau_grad}


def check_group_cut(mesh, logits, keys, targets, weights, drop_rows):
  """memory_grad_group_rows = G against the float64 NumPy reference (tests/reference.py `trime_key_grad`): key
  gradients only from queries of the key's group of G rows (and, with local_only, of its device: 3 rows).
  G=1 and 2 lie within a device or cross its boundaries (rows 2|3), G=4 and 6 span devices; long m=3 is aligned
  with the devices (no communication: the per-device path, global row offsets), m=2 / 8 / 24 span them."""
  from tests import reference as ref

  runs = [("ext", 1, "gather", "all", 1), ("ext", 1, "ring", "all", 2), ("ext", 1, "gather", "local_only", 6),
          ("ext", 1, "ring", "local_only", 2), ("long", 3, "gather", "all", 2), ("long", 2, "gather", "all", 1),
          ("long", 8, "ring", "all", 2), ("long", 24, "gather", "local_only", 4)]
  device = ref.same_group_rows(B, B // N_DEV)
  out = []
  for mem, m, var, mg, g in runs:
    drop = drop_rows if mem == "ext" else False
    f = lambda lg, ks: (sharded_loss.sharded_trime_nll(
        lg, ks, targets, mesh=mesh, memory=mem, consecutive_segments=m, drop_local=drop, tau=TAU,
        variant=var, memory_grad=mg, memory_chunk=5, memory_grad_group_rows=g) * weights).sum()
    val, dk = jax.jit(jax.value_and_grad(f, argnums=1))(logits, keys)
    cut = ref.same_group_rows(B, g) & (device if mg == "local_only" else True)
    want = ref.trime_key_grad(logits, keys, targets, mem, m, drop, TAU, cut, weights)
    uncut = ref.trime_key_grad(logits, keys, targets, mem, m, drop, TAU, None, weights)
    want_val = float((ref.trime_nll(logits, keys, targets, mem, m, drop, TAU) * weights).sum())
    out.append({"memory": mem, "m": m, "variant": var, "memory_grad": mg, "group_rows": g, "value": float(val),
                "value_err": abs(float(val) - want_val), "keys_grad_err": float(np.abs(np.asarray(dk) - want).max()),
                "grad_scale": float(np.abs(want).max()), "cut_vs_uncut": float(np.abs(want - uncut).max())})
  return out


def check_model():
  """float32: gradients w.r.t. TransformerLM parameters, the batch sharded over the mesh as in training."""
  from flax import nnx

  from trime_jax import steps
  from trime_jax.model import ModelConfig, TransformerLM

  mesh = make_mesh(N_DEV)
  rng = np.random.default_rng(1)
  v = 11
  cfg = ModelConfig(vocab_size=v, num_layers=1, d_model=16, num_heads=2, d_ff=32, max_len=SEG, dropout=0.0)
  graphdef, params = nnx.split(TransformerLM(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  inputs = rng.integers(0, v, size=(B, SEG)).astype(np.int32)
  targets = _targets(rng, v).astype(np.int32)
  cases = [("local", 1), ("long", 2), ("long", 8), ("ext", 1)]

  def objective(p, inputs, targets, drop, nll_fn, **kw):
    stats, keys = steps.forward(nnx.merge(graphdef, p), inputs, targets)
    return nll_fn(stats, keys, targets, drop_local=drop, tau=TAU, **kw).sum()

  def sharded(p, inputs, targets, drop):
    return [jax.value_and_grad(objective)(p, inputs, targets, drop, sharded_loss.sharded_trime_nll_from_vocab_stats,
                                          mesh=mesh, memory=mem, consecutive_segments=m, variant=var)
            for mem, m in cases for var in ("gather", "ring")]

  def single(p, inputs, targets, drop):
    return [jax.value_and_grad(objective)(p, inputs, targets, drop, L.trime_nll_from_vocab_stats, memory=mem,
                                          consecutive_segments=m) for mem, m in cases]

  rows_sh, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  sharded_fn = jax.jit(sharded, in_shardings=(repl, rows_sh, rows_sh, repl))
  single_fn = jax.jit(single)
  results = []
  for drop in (False, True):
    got = sharded_fn(params, inputs, targets, drop)
    want = single_fn(params, inputs, targets, drop)
    for i, (mem, m) in enumerate(cases):
      if mem != "ext" and drop:
        continue
      ref_val, ref_grads = want[i]
      for j, var in enumerate(("gather", "ring")):
        val, grads = got[2 * i + j]
        results.append({"memory": mem, "m": m, "drop_local": drop, "variant": var, "value": float(val),
                        "value_err": abs(float(val - ref_val)), "grad_err": _max_err(grads, ref_grads),
                        "grad_scale": _max_abs(ref_grads), "n_leaves": len(jax.tree_util.tree_leaves(grads))})
  return {"cases": results}


def check_train(workdir):
  """`train_and_evaluate` on 1 and on 8 devices (ext memory, drop-local, 2 micro-batches): metrics.jsonl."""
  from tests.helpers import TRAIN_MATCH, TRAIN_MATCH_CORPUS_BYTES, tiny_config, write_text_file
  from trime_jax.train import train_and_evaluate

  corpus = write_text_file(os.path.join(workdir, "text.bin"), TRAIN_MATCH_CORPUS_BYTES)
  common = TRAIN_MATCH
  runs = {"1dev": {"train.num_devices": 1},
          "8dev_gather": {"train.num_devices": 8, "trime.sharded_variant": "gather"},
          "8dev_ring": {"train.num_devices": 8, "trime.sharded_variant": "ring"},
          "8dev_local_only": {"train.num_devices": 8, "trime.memory_grad": "local_only"}}
  # Every dropout on, hash masks (model.dropout_mask): a seed per leading index and a counter per position, so the
  # masks do not depend on how the batch is split over devices.
  hashed = {"model.dropout": 0.1, "model.attention_dropout": 0.1, "model.activation_dropout": 0.1,
            "model.dropout_mask": "hash"}
  runs["1dev_dropout_hash"] = {"train.num_devices": 1, **hashed}
  runs["8dev_dropout_hash"] = {"train.num_devices": 8, "trime.sharded_variant": "ring", **hashed}
  out, dev, dev_calls = {}, {}, {}
  from trime_jax import evaluate as evaluate_pkg

  original_evaluate = evaluate_pkg.evaluate

  def recording_evaluate(*args, **kwargs):  # the streams and devices training's dev evaluation asks for
    dev_calls.setdefault(name, []).append([kwargs["streams"], 1 if kwargs["mesh"] is None else kwargs["mesh"].size])
    return original_evaluate(*args, **kwargs)

  evaluate_pkg.evaluate = recording_evaluate
  for name, overrides in runs.items():
    run_dir = os.path.join(workdir, name)
    train_and_evaluate(tiny_config(corpus, **{**common, **overrides}), run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      lines = [json.loads(line) for line in f if line.strip()]
    out[name] = [x for x in lines if "loss" in x]  # training lines (not the dev evaluation)
    dev[name] = [x for x in lines if "none_ppl" in x]  # the dev evaluations
  evaluate_pkg.evaluate = original_evaluate
  # A local_only run on every device (train.num_devices=0, 8 here) stopped after 1 update, resumed by a process
  # with 4 devices: its key gradients would be cut every 4 rows instead of 2 (another objective): refused
  overrides = {**common, "trime.memory_grad": "local_only", "train.num_devices": 0, "train.stop_after": 1}
  train_and_evaluate(tiny_config(corpus, **overrides), os.path.join(workdir, "all_local_only"))
  code = ("import sys; from tests.helpers import tiny_config; from trime_jax.train import train_and_evaluate\n"
          "try: train_and_evaluate(tiny_config(sys.argv[1], **eval(sys.argv[2])), sys.argv[3])\n"
          "except Exception as e: print(f'{type(e).__name__}: {e}')")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  on_4 = lambda settings: subprocess.run(
      [sys.executable, "-c", code + "\nelse: print('ran')", corpus, repr(settings),
       os.path.join(workdir, "all_local_only")], capture_output=True, text=True, env=env,
      timeout=600).stdout.strip().splitlines()[-1:]
  resumed_elsewhere = on_4(overrides)
  # ... and once finished here, its rerun there trains nothing: it runs (re-evaluates, exports)
  finished = {**overrides, "train.stop_after": 0}
  train_and_evaluate(tiny_config(corpus, **finished), os.path.join(workdir, "all_local_only"))
  resumed_elsewhere += on_4(finished)
  return {"runs": out, "dev": dev, "dev_calls": dev_calls, "devices": jax.device_count(), "srupp": check_srupp_train(workdir, corpus),
          "mt": check_mt_train(workdir), "local_only_resumed_on_4": resumed_elsewhere}


def check_mt_train(workdir):
  """TrimeMT_ext (BM25 batches, --topk-mem 8 as configs/ui_de_en.py) on 1 and on 8 devices: training losses
  per update (rows padded to a multiple of 8 on the 8-device mesh: padding rows are never scored or memory)."""
  from tests.test_mt_model import write_pairs
  from tests.test_mt_train import WDE, WEN, tiny_config
  from trime_jax.mt import train as mt_train

  data_dir = os.path.join(workdir, "mt_data")
  write_pairs(data_dir, WDE * 3, WEN * 3)
  losses = {}
  for n in (1, 8, "8packed"):
    c = tiny_config(data_dir)
    c.model.dropout = 0.0
    c.train.update(num_steps=4, num_devices=8 if n == "8packed" else n, eval_every=0)
    if n == "8packed":  # packed rows (data.pack_len): pair ids gathered with the keys
      c.data.pack_len = 32
    assert c.trime.memory_topk == 8
    run_dir = os.path.join(workdir, f"mt_{n}dev")
    mt_train.train_and_evaluate(c, run_dir, log=lambda s: None)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      losses[n] = [(json.loads(line)["objective"], json.loads(line)["loss"]) for line in f
                   if '"loss"' in line and '"split"' not in line]
  # The original's composition (data.batches_per_update=4): 4 GPU batches an update; on 4 devices with
  # memory_grad="local_only" (each device one GPU batch, padded or packed) as on 1 with memory_grad_groups=4;
  # on 1 device without the cut the key gradients (so the later losses) differ; on 2 devices refused
  for name, devices, extra in [("G4_1", 1, {"trime.memory_grad_groups": 4}), ("G4_1_nocut", 1, {}),
                               ("G4_4", 4, {"trime.memory_grad": "local_only"}),
                               ("G4_4packed", 4, {"trime.memory_grad": "local_only", "data.pack_len": 32}),
                               ("G4_2", 2, {"trime.memory_grad": "local_only"})]:
    c = tiny_config(data_dir)
    c.model.dropout = 0.0
    c.train.update(num_steps=4, num_devices=devices, eval_every=0, learning_rate=3e-2)
    c.data.batches_per_update = 4
    for k, v in extra.items():
      section, field = k.split(".")
      c[section][field] = v
    run_dir = os.path.join(workdir, f"mt_{name}")
    try:
      mt_train.train_and_evaluate(c, run_dir, log=lambda s: None)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
      losses[name] = f"{type(e).__name__}: {e}"
      continue
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      losses[name] = [(json.loads(line)["objective"], json.loads(line)["loss"]) for line in f
                      if '"loss"' in line and '"split"' not in line]
  return losses


def check_srupp_train(workdir, corpus):
  """SRU++ TrimeLM_long (stream batches, carried state and previous-segment keys) on 1 and on 8 devices:
  training losses per update."""
  from tests.helpers import tiny_config
  from trime_jax import corpora
  from trime_jax.batching import consecutive
  from trime_jax.batching import plan as batch_plan
  from trime_jax.train import train_and_evaluate

  plan_dir = os.path.join(workdir, "srupp_plan")
  common = {"model.backbone": "srupp", "model.key_type": "final", "model.srupp_attn_dim": 8, "model.dropout": 0.0,
            "model.d_model": 16, "model.num_layers": 1, "train.num_steps": 3, "train.batch_size": 8,
            "train.grad_accum": 2, "trime.memory": "long", "trime.batching": "consecutive",
            "trime.consecutive_layout": "stream", "trime.batch_plan": plan_dir, "trime.ce_warmup_steps": 0,
            "eval.context_window": 0, "eval.block_len": 32, "eval.max_tokens": 64, "train.eval_max_tokens": 64,
            "train.log_every": 1}
  config = tiny_config(corpus, **common)
  header, batches = consecutive.make_plan(corpora.load_splits(config.data).train, config, progress=False)
  batch_plan.save(plan_dir, header, batches)
  from trime_jax import train as train_module

  # Where the carry lives, in and out of the real step (train_state_shardings): the step_fn's outputs recorded
  specs = set()
  original_step_fn = train_module.LMTask.step_fn

  def recording_step_fn(self, objective):
    fn = original_step_fn(self, objective)

    def step(state, batch, key):
      for leaf in jax.tree_util.tree_leaves((state["carry"],)):
        specs.add(("in", tuple(leaf.sharding.spec)))
      new_state, metrics = fn(state, batch, key)
      for leaf in jax.tree_util.tree_leaves((new_state["carry"],)):
        specs.add(("out", tuple(leaf.sharding.spec)))
      return new_state, metrics
    return step

  losses = {}
  for n in (1, 8):
    run_dir = os.path.join(workdir, f"srupp_{n}dev")
    specs.clear()
    train_module.LMTask.step_fn = recording_step_fn
    try:
      train_and_evaluate(tiny_config(corpus, **common, **{"train.num_devices": n}), run_dir)
    finally:
      train_module.LMTask.step_fn = original_step_fn
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      losses[n] = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    losses[f"carry_specs_{n}"] = sorted(specs)
  return losses


def check_placed():
  """Inputs placed on the mesh as a user of a mesh has them (`jax.device_put(x, NamedSharding(mesh,
  P("data")))`), on our mesh (auto axes) and on `jax.make_mesh`'s default (explicit axes), eager and jitted:
  every memory kind and variant of `sharded_trime_nll`, `sharded_trime_nll_from_vocab_stats` and
  `sharded_memory_log_probs` run and equal the single-device results (float32)."""
  rng = np.random.default_rng(1)
  b, seg, d, v = 16, 4, 8, 7  # 2 rows per device: long runs of 4 rows span 2 devices
  logits = rng.normal(size=(b, seg, v)).astype(np.float32)
  keys = rng.normal(size=(b, seg, d)).astype(np.float32)
  targets = rng.integers(0, v, size=(b, seg)).astype(np.int32)
  targets[3, 1:] = -1
  drop = rng.random(b) < 0.5
  docs = np.cumsum(rng.random((b, seg)) < 0.2).reshape(b, seg).astype(np.int32)
  mem_keys = rng.normal(size=(24, d)).astype(np.float32)
  mem_targets = rng.integers(-1, v, size=24).astype(np.int32)
  mask = rng.random((b, 24)) < 0.7
  kinds = [("none", 1, None, None), ("local", 1, None, None), ("long", 4, None, docs), ("ext", 1, drop, None)]
  want = {mem: L.trime_nll(logits, keys, targets, memory=mem, consecutive_segments=m, tau=TAU,
                           drop_local=False if dl is None else dl, documents=dc, implementation="dense")
          for mem, m, dl, dc in kinds}
  want_probs = S.memory_log_probs(logits[:, 0], keys[:, 0], mem_keys, mem_targets, mask, tau=TAU)
  explicit = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  # Every kind and variant on the explicit mesh (where unplaced inputs fail), eager and jitted; on ours (auto
  # axes, the training path) ext's two variants jitted. (mesh, memory kinds, APIs, ways to call)
  runs = [(explicit, kinds, ("logits",), ("eager", "jit")), (explicit, kinds[3:], ("vocab_stats",), ("eager", "jit")),
          (make_mesh(N_DEV), kinds[3:], ("logits",), ("jit",))]
  cases = []
  for mesh, mesh_kinds, apis, hows in runs:
    put = lambda x, mesh=mesh: jax.device_put(x, NamedSharding(mesh, P("data")))
    mesh_name = "explicit" if mesh is explicit else "auto"
    for mem, m, dl, dc in mesh_kinds:
      for var in ("gather", "ring"):
        for api in apis:
          def f(lg, ks, t, dl, dc, mem=mem, m=m, var=var, api=api, mesh=mesh, put=put):
            opts = dict(mesh=mesh, memory=mem, consecutive_segments=m, tau=TAU, variant=var,
                        documents=dc, drop_local=False if dl is None else dl)
            if api == "logits":
              return sharded_loss.sharded_trime_nll(lg, ks, t, **opts)
            st = L.VocabStats(*(put(x) for x in L.vocab_stats(lg, t)))
            return sharded_loss.sharded_trime_nll_from_vocab_stats(st, ks, t, **opts)
          args = (put(logits), put(keys), put(targets), None if dl is None else put(dl),
                  None if dc is None else put(dc))
          for how in hows:
            got = (f if how == "eager" else jax.jit(f))(*args)
            cases.append({"mesh": mesh_name, "memory": mem, "variant": var, "api": api, "how": how,
                          "err": float(jnp.abs(got - want[mem]).max())})
  put = lambda x: jax.device_put(x, NamedSharding(explicit, P("data")))
  g = lambda lg, q, k, t, mk: sharded_loss.sharded_memory_log_probs(lg, q, k, t, mk, mesh=explicit,
                                                                    tau=TAU)
  for how in ("eager", "jit"):
    got = (g if how == "eager" else jax.jit(g))(put(logits[:, 0]), put(keys[:, 0]), put(mem_keys),
                                                put(mem_targets), put(mask))
    cases.append({"mesh": "explicit", "memory": "log_probs", "variant": "-", "api": "memory_log_probs",
                  "how": how, "err": float(jnp.abs(got - want_probs).max())})
  return {"cases": cases}


def check_datastore(workdir):
  """The datastore key pass on 1, 8 and all (0) devices (build_datastore's `devices`; a forward batch of 6
  windows, padded to 8 rows on the mesh): the same keys and values, and meta.json's device count."""
  from flax import nnx

  from tests.helpers import tiny_config
  from trime_jax import data, exports, specs
  from trime_jax import model as M
  from trime_jax.datastore import Datastore, build_datastore

  cfg = tiny_config("unused.bin", **{"model.num_layers": 1, "model.d_model": 16, "model.num_heads": 2,
                                     "model.d_ff": 32, "model.max_len": 32, "model.dropout": 0.0,
                                     "eval.block_len": 32, "eval.context_window": 8, "eval.batch_size": 6})
  vocab = data.Vocab.bytes()
  net = M.TransformerLM(specs.model_config(cfg, vocab_size=len(vocab)), rngs=nnx.Rngs(0))
  export = exports.export(os.path.join(workdir, "ds_export"), nnx.state(net, nnx.Param), cfg, vocab)
  tokens = np.random.default_rng(0).integers(0, 256, 3_000).astype(np.int32)
  corpus = data.Corpus(tokens, np.array([0, len(tokens)]), vocab)
  stores = {}
  for n in (1, 8, 0):
    build_datastore(export, corpus, os.path.join(workdir, f"ds_{n}"), devices=n, chunk_tokens=500, progress=False)
    stores[n] = Datastore(os.path.join(workdir, f"ds_{n}"))
  one = np.asarray(stores[1].keys)

  def close(other):  # float16 rounding of float32 keys that differ in their last bits: 1e-3 relative (two
    # float16 spacings), 1e-6 absolute (subnormal float16 keys near 0)
    return bool(np.allclose(np.asarray(other, np.float32), one.astype(np.float32), rtol=1e-3, atol=1e-6))

  return {"count": int(stores[1].count), "devices": {n: int(ds.meta["devices"]) for n, ds in stores.items()},
          "keys_close": {n: close(ds.keys) for n, ds in stores.items()},
          "keys_differing": {n: float((np.asarray(ds.keys) != one).mean()) for n, ds in stores.items()},
          "values_equal": all(np.array_equal(ds.values, stores[1].values) for ds in stores.values())}


def check_eval(workdir):
  """`evaluate` with its 8 streams split over 8 and over 4 devices (`mesh=`, eval.devices) against one device:
  every scored token's nll under local, cache, long-term and external memory (an exact FAISS index, and the
  datastore on the devices), an SRU++ model's carried state; where each step's arrays were and the collectives
  XLA put in the two jitted halves; `eval_mesh` / `eval_submesh` / a mesh that does not divide the streams."""
  from flax import nnx

  from tests.helpers import tiny_config
  from trime_jax import data, evaluate, exact_memory, exports, knn, sharding, specs
  from trime_jax.datastore import Datastore, build_datastore, build_index
  from trime_jax.errors import ConfigError
  from trime_jax.evaluate import driver
  from trime_jax.evaluate.runner import store_spec
  from trime_jax.train import build_model

  vocab = data.Vocab.bytes()
  rng = np.random.default_rng(0)
  docs = lambda n: [rng.integers(97, 110, int(k)).astype(np.int32) for k in rng.integers(40, 160, n)]
  train, dev = data.Corpus.from_docs(docs(12), vocab, "train"), data.Corpus.from_docs(docs(10), vocab, "dev")
  small = {"model.num_layers": 1, "model.d_model": 16, "model.num_heads": 2, "model.d_ff": 32, "model.max_len": 32,
           "model.dropout": 0.0, "eval.block_len": 32, "eval.context_window": 8, "eval.batch_size": 8}
  cfg = tiny_config("unused.bin", **small)
  graphdef, params = nnx.split(build_model(specs.model_config(cfg, vocab_size=len(vocab)), 0), nnx.Param)
  export = exports.export(os.path.join(workdir, "eval_export"), params, cfg, vocab)
  ds_dir = os.path.join(workdir, "eval_ds")
  build_datastore(export, train, ds_dir, progress=False)
  build_index(Datastore(ds_dir), kind="flat", progress=False)
  faiss_ext = knn.ExternalMemory(ds_dir, k=16)
  device_ext = exact_memory.load_datastore(Datastore(ds_dir))  # on all 8 devices
  points = (evaluate.NONE, evaluate.Point("trime_local", tau=1.0), evaluate.Point("cache", cache_lambda=0.3,
            cache_theta=1.0), evaluate.Point("trime", tau=0.9), evaluate.Point("knnlm", knn_lambda=0.25, knn_theta=1.0))
  meshes = {"1": None, "8": sharding.eval_mesh(8, 8), "4": sharding.eval_mesh(4, 8), "all": sharding.eval_mesh(0, 8)}

  placed, collectives = {}, {}
  originals = {"forward_queries": driver.forward_queries, "score_step": driver.score_step}

  def collectives_in(name, fn, args, kwargs):  # once a run and half: the ops the compiled half communicates with
    key = f"{current}/{name}"
    if key not in collectives:
      hlo = fn.lower(*args, **kwargs).compile().as_text()
      collectives[key] = sum(len(re.findall(rf"\b{op}(-start)?\(", hlo))
                             for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"))

  def forward_spy(*args, **kwargs):
    collectives_in("forward_queries", originals["forward_queries"], args, kwargs)
    return originals["forward_queries"](*args, **kwargs)

  def score_spy(store, keys, *args, **kwargs):  # where a step's arrays are
    placed.setdefault(current, set()).add((len(keys.sharding.device_set), len(store.keys.sharding.device_set),
                                           str(getattr(keys.sharding, "spec", ""))))
    collectives_in("score_step", originals["score_step"], (store, keys) + args, kwargs)
    return originals["score_step"](store, keys, *args, **kwargs)

  def run(model_graph, model_params, corpus, mesh, **kw):
    r = evaluate.evaluate(model_graph, model_params, corpus, kw.pop("points", points), block_len=32,
                          context_window=kw.pop("context_window", 8), streams=8, per_token=True, mesh=mesh, **kw)
    return r

  driver.forward_queries, driver.score_step = forward_spy, score_spy
  out = {"nll_err": {}, "ppl": {}, "tokens": {}}
  try:
    for case, kw in {"transformer": dict(long_term=store_spec(cfg.eval, 64), external=faiss_ext),
                     "on_device": dict(long_term=store_spec(cfg.eval, 64), external=device_ext,
                                       points=(evaluate.Point("trime", tau=0.9),))}.items():
      runs = {}
      variants = [(name, mesh, {}) for name, mesh in meshes.items()]
      if case == "transformer":  # the next group's forward passes dispatched during this group's FAISS search
        variants.append(("8_overlap", meshes["8"], dict(overlap_search=True, search_queries=64)))
      for name, mesh, extra in variants:
        current = f"{case}_{name}"
        runs[name] = run(graphdef, params, dev, mesh, **dict(kw), **extra)
      one = runs["1"]
      out["nll_err"][case] = {n: float(np.nanmax(np.abs(r.token_nll - one.token_nll))) for n, r in runs.items()}
      out["ppl"][case] = {n: [s.ppl for s in r.scores] for n, r in runs.items()}
      out["tokens"][case] = {n: r.tokens for n, r in runs.items()}
    # SRU++: a stateful model whose carry continues on the device that holds its stream
    scfg = tiny_config("unused.bin", **{**small, "model.backbone": "srupp", "model.key_type": "final",
                                       "model.srupp_attn_dim": 8, "eval.context_window": 0})
    sgraph, sparams = nnx.split(build_model(specs.model_config(scfg, vocab_size=len(vocab)), 0), nnx.Param)
    sruns = {}
    for name in ("1", "8"):
      current = f"srupp_{name}"
      sruns[name] = run(sgraph, sparams, dev, meshes[name], context_window=0, points=points[:3])
    out["nll_err"]["srupp"] = {"8": float(np.nanmax(np.abs(sruns["8"].token_nll - sruns["1"].token_nll)))}
    # The API: Model.score's texts split over the devices (load(devices=)), each memory, against one device
    import trime_jax

    texts = ["".join(chr(c) for c in rng.integers(97, 110, int(k))) for k in (20, 45, 70, 90, 130)]
    api = {}
    for name, devices in (("1", 1), ("4", 4), ("all", 0)):
      model = trime_jax.load(export, devices=devices)
      for memory, kw in (("local", {}), ("long", {}), ("external", dict(datastore=ds_dir, k=16))):
        current = f"api_{memory}_{name}"
        api.setdefault(memory, {})[name] = [np.asarray(t.log_probs) for t in model.score(texts, memory, **kw)]
    out["api_err"] = {memory: {name: max(float(np.abs(a - b).max()) for a, b in zip(got, runs["1"]))
                               for name, got in runs.items()} for memory, runs in api.items()}
    refused = []
    for value in (-1, 9, 2.0):
      try:
        trime_jax.load(export, devices=value)
        refused.append("")
      except ConfigError as e:
        refused.append(str(e))
    out["api_refusals"] = refused
  finally:
    driver.forward_queries, driver.score_step = originals["forward_queries"], originals["score_step"]
  out["placed"] = {k: sorted(v) for k, v in placed.items()}
  out["collectives"] = collectives
  refusals = []
  for call in (lambda: sharding.eval_mesh(8, 6), lambda: sharding.eval_mesh(9, 9), lambda: sharding.eval_mesh(-1, 8),
               lambda: run(graphdef, params, dev, sharding.eval_mesh(3, 3), points=points[:1])):
    try:
      call()
      refusals.append("")
    except ConfigError as e:
      refusals.append(str(e))
  train_mesh = sharding.make_mesh(8)
  out["submesh"] = {str(s): (lambda m: 1 if m is None else m.size)(sharding.eval_submesh(train_mesh, s))
                    for s in (1, 3, 4, 6, 8, 12, 16)}
  out["refusals"] = refusals
  # training's dev evaluation: (streams, devices) for eval.batch_size on the 8-device training mesh
  from types import SimpleNamespace

  from trime_jax.train import LMTask
  dev_streams = {}
  for stateful in (False, True):
    for b in (1, 3, 4, 8, 12):
      task = SimpleNamespace(config=SimpleNamespace(eval=SimpleNamespace(batch_size=b)), mesh=train_mesh,
                             stateful=stateful)
      streams, mesh = LMTask.dev_streams(task)
      dev_streams[f"{'srupp' if stateful else 'transformer'}_{b}"] = [streams, 1 if mesh is None else mesh.size]
  out["dev_streams"] = dev_streams
  from trime_jax.evaluate.runner import devices_note
  out["devices_note"] = [devices_note(None, 4), devices_note(meshes["8"], 8)]
  return out


if __name__ == "__main__":
  which = sys.argv[1]
  groups = {"loss": check_loss, "model": check_model, "placed": check_placed}
  with_workdir = {"train": check_train, "datastore": check_datastore, "eval": check_eval}
  result = groups[which]() if which in groups else with_workdir[which](sys.argv[2])
  print("RESULT " + json.dumps(result), flush=True)
