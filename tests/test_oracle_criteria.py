"""One training step of trime-jax == the ORIGINAL release's training criteria, same parameters, same batch.

The fixture (tests/fixtures/oracle/criteria.npz; how it was made: tests/oracle/README_criteria.md) holds, for a
tiny model of the 247M's kind (tied adaptive input + adaptive softmax with two tail clusters, pre-LN, no final
norm, last_ffn_input keys; checkpoint criteria_model.pt + criteria_dict.txt, its tensors also in the npz) and
one batch of 4 consecutive 32-token stream segments, what princeton-nlp/TRIME's criteria
(fairseq/criterions/trime_loss.py, trime_long_loss.py, trime_long_loss_same_device.py, trime_ext_loss.py) compute
in float64: the loss per token, the logged CE (`ori_loss`) and the gradient of every parameter (backward of the
summed loss / sample_size, as fairseq's trainer). Cases:

  local             trime_loss (TrimeLM)
  ce_warmup         trime_loss with return_ce_loss (epoch <= --ce-warmup-epoch): plain CE
  long              trime_long_loss, one GPU, --train-mem-size = --max-tokens: the 4 segments are one run
  long_same_device  trime_long_loss_same_device (the 150M / enwik8 scripts): the same memory
  ext_p0.9          trime_ext_loss --cross-sent-ratio 0.9, the coin random.random() drew (0.134: dropped)
  ext_p0, ext_p1    --cross-sent-ratio 0 (never drops) and 1 (always drops); ext_none: no --cross-sent-ratio
  ext_4gpu          trime_ext_loss on 4 GPUs (DDP simulated in one process), one segment per GPU as the 247M
                    script; coins [0.95, 0.3, 0.5, 0.99] (ranks 1 and 2 drop local memory); keys gathered
                    from other GPUs carry no gradient (all_gather)
  long_4gpu         trime_long_loss on 4 GPUs, --train-mem-size 4 × --max-tokens (num_comb_shards 4): one run
                    over the 4 GPUs' consecutive segments, other GPUs' keys without gradient

trime-jax side: the paper config (configs/wiki103_247m.py; the `_long` / `_ext` variants as
docs/paper_configs.md states them, long_same_device as configs/wiki103_150m.py: one run = one forward's rows)
with the imported model, `specs.loss_spec`, `trime.ce_warmup_steps` and the jitted `steps.train_step`
(the update's gradient captured by an optimizer that stores it). The drop-local mask is the fixture's. The
4-GPU cases (one segment per GPU, as the 247M script) take the paper config's `trime.memory_grad_group_rows = 1`
(key gradients only from queries of the key's own segment = GPU) and match on ONE device; in a subprocess (this
file run as a script) also on a 4-device CPU mesh (1 row per device) and a 2-device one (2 rows per device),
with the paper configs' `trime.memory_grad = "local_only"`. The single-GPU cases hold all 4 segments on one
GPU (--max-tokens 128): `memory_grad_group_rows = 4`, the whole batch.

Tolerances (trime-jax in float32 against the float64 original): loss and logged CE rtol 1e-5; every gradient
tensor max |Δ| <= 1e-4 · max |g| of that tensor (+1e-7 absolute), and the global norm rtol 1e-5.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FIXTURE = os.path.join(HERE, "fixtures", "oracle", "criteria.npz")
DICT = os.path.join(HERE, "fixtures", "oracle", "criteria_dict.txt")
CHECKPOINT = os.path.join(HERE, "fixtures", "oracle", "criteria_model.pt")

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4  # of the tensor's largest |gradient|
GRAD_ATOL = 1e-7
NORM_RTOL = 1e-5

# case -> (paper config module, trime overrides, number of devices). The fixture's single-GPU cases put the 4
# segments on ONE GPU (--max-tokens 128): memory_grad_group_rows = 4 rows per original GPU (the paper's 247M
# script has one segment per GPU: the config's 1, which the 4-GPU cases keep).
ONE_GPU = dict(memory_grad_group_rows=4)
CASES = {
    "local": ("wiki103_247m", dict(memory="local", **ONE_GPU), 1),
    "ce_warmup": ("wiki103_247m", dict(memory="local", **ONE_GPU), 1),
    "long": ("wiki103_247m", dict(memory="long", batching="consecutive", consecutive_segments=4, **ONE_GPU), 1),
    "long_same_device": ("wiki103_150m", dict(memory="long", consecutive_segments=4), 1),
    "ext_p0.9": ("wiki103_247m", dict(memory="ext", batching="bm25", drop_local_prob=0.9, **ONE_GPU), 1),
    "ext_p0": ("wiki103_247m", dict(memory="ext", batching="bm25", drop_local_prob=0.0, **ONE_GPU), 1),
    "ext_p1": ("wiki103_247m", dict(memory="ext", batching="bm25", drop_local_prob=1.0, **ONE_GPU), 1),
    "ext_none": ("wiki103_247m", dict(memory="ext", batching="bm25", drop_local_prob=0.0, **ONE_GPU), 1),
    "ext_4gpu": ("wiki103_247m", dict(memory="ext", batching="bm25", drop_local_prob=0.9), 4),
    "long_4gpu": ("wiki103_247m", dict(memory="long", batching="consecutive", consecutive_segments=4), 4),
}


def fixture():
  return np.load(FIXTURE)


def imported(fx):
  """(ModelConfig, nnx params) of the fixture's checkpoint, through the importer (tensors from the npz: no torch)."""
  from trime_jax import fairseq_import as FI

  flags = FI.complete_flags(json.loads(str(fx["flags"])))
  sd = {k[len("param/"):]: fx[k] for k in fx.files if k.startswith("param/")}
  vocab = FI.read_dictionary(DICT)
  cfg = FI.model_config(flags, sd, len(vocab))
  return cfg, FI.params_tree(cfg, FI.convert(sd, cfg)), sd


def paper_config(case, cfg, batch_size, seq_len):
  """The case's paper config, its model replaced by the imported one (the rest as the paper config has it)."""
  import importlib

  module, trime, _ = CASES[case]
  c = importlib.import_module(f"trime_jax.configs.{module}").get_config()
  for f in dataclasses.fields(cfg):
    setattr(c.model, f.name, getattr(cfg, f.name))
  c.model.dtype = "float32"
  c.data.segment_len = seq_len
  c.train.batch_size = batch_size
  c.train.grad_accum = 1
  for k, v in trime.items():
    setattr(c.trime, k, v)
  return c


def trime_jax_step(case, fx, cfg, params, mesh=None, dtype=None):
  """(metrics, {our parameter path: gradient}) of one `steps.train_step` under the case's paper config."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from tests.helpers import grad_capture  # here, not at the top: a subprocess runs this file as a script
  from trime_jax import sharding, specs, steps
  from trime_jax import train as T
  from trime_jax.model import TransformerLM

  src, tgt = fx["src_tokens"].astype(np.int32), fx["target"].astype(np.int32)
  b, l = tgt.shape
  config = paper_config(case, cfg, b, l)
  spec = specs.loss_spec(config)
  warm = T.ce_warmup_steps(config)
  step = 0 if case == "ce_warmup" else warm  # train.py: use_trime = memory != "none" and step >= warm
  assert (case == "ce_warmup") == (step < warm)
  use_trime = spec.objective.memory != "none" and step >= warm
  report_trime = spec.objective.memory != "none"
  drop = fx[f"{case}/drop_local"] if f"{case}/drop_local" in fx.files else np.zeros((b,), bool)
  batch = {"inputs": src[None], "targets": tgt[None], "drop_local": np.asarray(drop, bool)[None]}
  model_cfg = dataclasses.replace(cfg, dtype=dtype) if dtype else cfg
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
  if dtype:
    params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
  tx = grad_capture()
  state = {"step": jnp.int32(step), "params": params, "opt_state": tx.init(params)}
  if mesh is not None:
    repl, data_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh, batch_axis=1)
    state = jax.device_put(state, repl)
    batch = {k: jax.device_put(v, data_sh) for k, v in batch.items()}
  jitted = _jitted_step(graphdef, tx, spec, use_trime, report_trime, mesh)
  new_state, metrics = jitted(state, batch, jax.random.PRNGKey(0))
  flat = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(new_state["opt_state"]["g"]):
    keys = [getattr(p, "key", getattr(p, "idx", getattr(p, "name", None))) for p in path]
    flat[".".join(str(k) for k in keys if k != "value")] = np.asarray(leaf, np.float64)
  return {k: float(v) for k, v in jax.device_get(metrics).items()}, flat, spec, use_trime


_JIT_CACHE = {}


def _jitted_step(graphdef, tx, spec, use_trime, report_trime, mesh):
  """`steps.train_step` jitted as train.py jits it (shardings on a mesh); one compilation per distinct step."""
  import jax

  from trime_jax import sharding, steps

  key = (graphdef, spec, use_trime, report_trime, id(mesh))
  if key not in _JIT_CACHE:
    fn = functools.partial(steps.train_step, graphdef, tx, spec, use_trime, report_trime, mesh=mesh)
    if mesh is not None:
      repl, data_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh, batch_axis=1)
      in_batch = {k: data_sh for k in ("inputs", "targets", "drop_local")}
      _JIT_CACHE[key] = jax.jit(fn, in_shardings=(repl, in_batch, repl), out_shardings=(repl, repl))
    else:
      _JIT_CACHE[key] = jax.jit(fn)
  return _JIT_CACHE[key]


def oracle_grads(fx, case, cfg):
  """The fixture's gradients in our layout (the importer's mapping applied to the gradient state dict)."""
  from trime_jax import fairseq_import as FI

  prefix = f"{case}/grad/"
  g = {k[len(prefix):]: fx[k] for k in fx.files if k.startswith(prefix)}
  return FI.convert(g, cfg)


def compare(fx, case, cfg, metrics, grads):
  """{'loss': rel err, 'ce': rel err, 'grad': max over tensors of max|Δ| / max|g|, 'norm': rel err, ...}."""
  ref = oracle_grads(fx, case, cfg)
  assert set(ref) == set(grads), (set(ref) ^ set(grads))
  worst, worst_name, ok = 0.0, None, True
  for k, r in ref.items():
    d = np.abs(grads[k] - r).max()
    scale = np.abs(r).max()
    ok &= bool(d <= GRAD_RTOL * scale + GRAD_ATOL)
    if d / max(scale, 1e-30) > worst:
      worst, worst_name = float(d / max(scale, 1e-30)), k
  ref_norm = float(fx[f"{case}/grad_norm"])
  norm = float(np.sqrt(sum((g ** 2).sum() for g in grads.values())))
  loss, ce = float(fx[f"{case}/loss"]), float(fx[f"{case}/ori_loss"])
  return {"loss": abs(metrics["loss"] - loss) / abs(loss), "ce": abs(metrics["ce_nll"] - ce) / abs(ce),
          "grad": worst, "grad_tensor": worst_name, "grads_ok": ok, "norm": abs(norm - ref_norm) / ref_norm,
          "grad_norm_metric": abs(metrics["grad_norm"] - ref_norm) / ref_norm}


def assert_matches(r):
  assert r["loss"] <= LOSS_RTOL, r
  assert r["ce"] <= LOSS_RTOL, r
  assert r["grads_ok"], r
  assert r["norm"] <= NORM_RTOL and r["grad_norm_metric"] <= NORM_RTOL, r


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------
def test_fixture_cases_are_distinct():
  """The cases really differ (memory kinds, drop-local, CE warm-up), so equality below means something."""
  fx = fixture()
  losses = {c: float(fx[f"{c}/loss"]) for c in CASES}
  assert abs(losses["ce_warmup"] - float(fx["local/ori_loss"])) < 1e-12  # return_ce_loss: loss = ori_loss
  assert len({round(losses[c], 9) for c in ("local", "ce_warmup", "long", "ext_p0", "ext_p1", "ext_4gpu")}) == 6
  assert abs(losses["long"] - losses["long_4gpu"]) < 1e-12  # same memory; only the gradients differ (gather)
  assert abs(float(fx["long/grad_norm"]) - float(fx["long_4gpu/grad_norm"])) > 1e-3
  assert bool(fx["ext_p0.9/drop_local"].all()) and not bool(fx["ext_p0/drop_local"].any())
  assert list(fx["ext_4gpu/drop_local"]) == [False, True, True, False]


def test_single_device_cases_match_the_original():
  fx = fixture()
  cfg, params, _ = imported(fx)
  results = {}
  for case, (_, _, n_dev) in CASES.items():
    if n_dev != 1:
      continue
    metrics, grads, spec, use_trime = trime_jax_step(case, fx, cfg, params)
    results[case] = compare(fx, case, cfg, metrics, grads)
  print(json.dumps(results, indent=1))
  for case, r in results.items():
    assert_matches(r)


def test_float64_agrees_to_roundoff():
  """The same objective in float64 (jax x64, parameters cast), through `steps.nll_sums` (what train_step's
  micro-batch differentiates; train_step's own scan keeps an int32 token count that x64 turns into int64).
  The model keeps some float32 internals under x64 (sinusoidal positions, attention and output-layer logits
  accumulate in float32), so this is bounded by those: loss within 1e-8 relative (float32 run: ~6e-8), every
  gradient tensor within 1e-6 of its max (global norm 1e-7). No objective-level difference hides below the float32 tolerance."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from trime_jax import specs, steps
  from trime_jax import train as T
  from trime_jax.model import TransformerLM

  fx = fixture()
  with jax.enable_x64(True):
    cfg, params, _ = imported(fx)
    cfg64 = dataclasses.replace(cfg, dtype="float64")
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(cfg64, rngs=nnx.Rngs(0))), nnx.Param)
    src, tgt = fx["src_tokens"].astype(np.int32), fx["target"].astype(np.int32)
    for case in ("local", "ce_warmup", "long", "ext_p0.9", "ext_p0"):
      config = paper_config(case, cfg, *tgt.shape)
      spec = specs.loss_spec(config)
      use_trime = case != "ce_warmup"
      drop = fx[f"{case}/drop_local"] if f"{case}/drop_local" in fx.files else np.zeros(tgt.shape[:1], bool)
      batch = {"inputs": src, "targets": tgt, "drop_local": drop}

      def objective(p):
        obj, ce, _, n = steps.nll_sums(nnx.merge(graphdef, p), batch, spec, use_trime=use_trime, report_trime=True,
                                       rngs=nnx.Rngs(dropout=0))
        return obj / n, ce / n

      (loss, ce), g = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
      flat = {}
      for path, leaf in jax.tree_util.tree_leaves_with_path(g):
        keys = [getattr(p, "key", getattr(p, "idx", getattr(p, "name", None))) for p in path]
        flat[".".join(str(k) for k in keys if k != "value")] = np.asarray(leaf, np.float64)
      norm = float(np.sqrt(sum((x ** 2).sum() for x in flat.values())))
      r = compare(fx, case, cfg, {"loss": float(loss), "ce_nll": float(ce), "grad_norm": norm}, flat)
      assert r["loss"] < 1e-8 and r["ce"] < 1e-8 and r["grad"] < 1e-6 and r["norm"] < 1e-7, (case, r)


def test_perturbation_is_detected():
  """The comparison can fail: a wrong drop-local mask, the CE objective for a TRIME case, a temperature of
  1.1, or one parameter nudged by 1e-3 each break it."""
  fx = fixture()
  cfg, params, _ = imported(fx)
  metrics, grads, _, _ = trime_jax_step("ext_p0", fx, cfg, params)
  assert_matches(compare(fx, "ext_p0", cfg, metrics, grads))
  # ext_p0's step compared against ext_p0.9's fixture (mask differs)
  r = compare(fx, "ext_p0.9", cfg, metrics, grads)
  assert r["loss"] > 1e-2 and not r["grads_ok"], r
  # the CE warm-up's step against the TRIME fixture
  m2, g2, _, _ = trime_jax_step("ce_warmup", fx, cfg, params)
  r = compare(fx, "local", cfg, m2, g2)
  assert r["loss"] > 1e-2 and not r["grads_ok"], r
  # the exact tail term for the words at tail-relative index 1 (the batch holds two of each tail's: fairseq's
  # F.cross_entropy(ignore_index=pad=1) drops their tail term in the original criteria)
  assert cfg.adaptive_tail_ignores_pad  # the importer sets the original's rule
  exact = dataclasses.replace(cfg, adaptive_tail_ignores_pad=False)
  m4, g4, _, _ = trime_jax_step("local", fx, exact, params)
  r = compare(fx, "local", cfg, m4, g4)
  assert r["loss"] > 1e-4 and r["ce"] > 1e-4 and not r["grads_ok"], r
  # one parameter nudged: the scale of the LayerNorm whose output is the memory key (last_ffn_input)
  import jax

  def nudge(path, x):
    name = ".".join(str(getattr(p, "key", getattr(p, "idx", ""))) for p in path)
    return x.at[0].add(1e-3) if name.startswith("blocks.1.ffn_norm.scale") else x

  nudged = jax.tree_util.tree_map_with_path(nudge, params)
  assert any(float(np.abs(np.asarray(a) - np.asarray(b)).max()) > 0
             for a, b in zip(jax.tree_util.tree_leaves(nudged), jax.tree_util.tree_leaves(params)))
  m3, g3, _, _ = trime_jax_step("local", fx, cfg, nudged)
  r = compare(fx, "local", cfg, m3, g3)
  assert not (r["loss"] <= LOSS_RTOL and r["grads_ok"]), r


def test_four_gpu_cases_match_the_original_on_one_device():
  """ext and long on 4 GPUs (one segment each, other GPUs' keys without gradient) on ONE device: the paper
  config's memory_grad_group_rows = 1 cuts key gradients at the original's GPU (= segment) boundaries. Without
  the cut (0) the loss is the same and the gradients are not the original's."""
  fx = fixture()
  cfg, params, _ = imported(fx)
  results = {}
  for case in ("ext_4gpu", "long_4gpu"):
    metrics, grads, spec, _ = trime_jax_step(case, fx, cfg, params)
    assert spec.objective.memory_grad_group_rows == 1
    results[case] = compare(fx, case, cfg, metrics, grads)
    original = paper_config
    try:
      globals()["paper_config"] = lambda c, *a: _with(original(c, *a), memory_grad_group_rows=0)
      metrics, grads, spec, _ = trime_jax_step(case, fx, cfg, params)
    finally:
      globals()["paper_config"] = original
    assert spec.objective.memory_grad_group_rows == 0
    results[case + "_uncut"] = compare(fx, case, cfg, metrics, grads)
  print(json.dumps(results, indent=1))
  for case in ("ext_4gpu", "long_4gpu"):
    assert_matches(results[case])
    r = results[case + "_uncut"]
    assert r["loss"] <= LOSS_RTOL and not r["grads_ok"] and r["grad"] > 1e-2, r


def test_checkpoint_file_imports_to_the_same_parameters():
  """criteria_model.pt (the release's format) through `import_checkpoint` = the npz's tensors (needs torch)."""
  import torch  # noqa: F401  (make test installs it; torch.load reads the .pt)
  import jax

  from trime_jax import fairseq_import as FI

  fx = fixture()
  cfg, params, _ = imported(fx)
  imp = FI.import_checkpoint(CHECKPOINT, DICT, trust_pickle=True)
  assert imp.cfg == cfg
  for a, b in zip(jax.tree_util.tree_leaves(imp.params), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_four_device_cases_match_the_original():
  """ext and long on 4 GPUs (other GPUs' keys without gradient) = train_step on a 4-device mesh (1 row per
  device) and on a 2-device mesh (2 rows per device) with the paper configs' memory_grad=local_only and
  memory_grad_group_rows=1. On 4 devices either cut alone reproduces the original; on 2 devices only the row
  groups do. Runs this file as a script: the device count must be set before jax starts."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, os.path.abspath(__file__), "four_devices"], capture_output=True, text=True,
                     env=env, cwd=REPO, timeout=900)
  assert p.returncode == 0, p.stderr[-4000:]
  results = json.loads(p.stdout.strip().splitlines()[-1])
  print(json.dumps(results, indent=1))
  assert results["devices"] == 4
  for case in ("ext_4gpu", "long_4gpu"):
    for n, mg, g in [(4, "local_only", 1), (4, "local_only", 0), (4, "all", 1), (2, "local_only", 1),
                     (2, "all", 1)]:
      r = results[f"{case}/{n}dev/{mg}/{g}"]
      assert (r["memory_grad"], r["memory_grad_group_rows"]) == (mg, g)
      assert_matches(r)
    # no cut at the original's GPUs (memory_grad="all" and no row groups: our own configs' exact gradient, or
    # local_only on 2 devices of 2 rows: cut only at our device boundaries) is a different gradient, same loss
    for key in ("4dev/all/0", "2dev/local_only/0"):
      r = results[f"{case}/{key}"]
      assert r["loss"] <= LOSS_RTOL and not r["grads_ok"], (key, r)


def _four_devices():
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  sys.path.insert(0, REPO)
  import jax

  from trime_jax.sharding import make_mesh

  fx = fixture()
  cfg, params, _ = imported(fx)
  meshes = {4: make_mesh(4), 2: make_mesh(2)}
  out = {"devices": jax.device_count()}
  original = paper_config
  for case in ("ext_4gpu", "long_4gpu"):
    for n, mg, g in [(4, "local_only", 1), (4, "local_only", 0), (4, "all", 1), (4, "all", 0),
                     (2, "local_only", 1), (2, "all", 1), (2, "local_only", 0)]:
      try:
        globals()["paper_config"] = lambda c, *a: _with(original(c, *a), memory_grad=mg, memory_grad_group_rows=g)
        metrics, grads, spec, _ = trime_jax_step(case, fx, cfg, params, mesh=meshes[n])
      finally:
        globals()["paper_config"] = original
      out[f"{case}/{n}dev/{mg}/{g}"] = dict(compare(fx, case, cfg, metrics, grads), memory_grad=spec.memory_grad,
                                           memory_grad_group_rows=spec.objective.memory_grad_group_rows)
  print(json.dumps(out))


def _with(c, **trime):
  for k, v in trime.items():
    setattr(c.trime, k, v)
  return c


if __name__ == "__main__":
  if sys.argv[1:] == ["four_devices"]:
    _four_devices()
