"""Model FLOPs utilisation (MFU) of the paper configs' real train step, CE and TRIME (issue 37).

  python -m bench.mfu --tiny --out=/tmp/mfu.json                 # CPU, every config shrunk (about 4 min on 2 CPU cores)
  python -m bench.mfu --configs=wiki103_247m --out=mfu.json       # an accelerator, the paper's shapes
  python -m bench.mfu --configs=wiki103_7m --max_batch            # also the largest per-device batch that fits
  python -m bench.mfu --configs=wiki103_247m --set model.remat=block --set train.batch_size=16   # a lever
  python -m bench.mfu --configs=wiki103_247m --set model.attention_impl=cudnn --check_attention  # GPU only

`--set KEY=VALUE` (repeatable) overrides a config field after loading (and after --tiny's shrinking): the speed
levers of issue 37 (model.attention_impl, model.remat, train.batch_size, ...; docs/performance.md). The
settings are recorded in the JSON (`set`) and printed above the table; the speed options are then checked as
train.py checks them, so an option this backend cannot run is one ConfigError. `--check_attention` first
compares the config's attention_impl with XLA's on a small model of the config's width and dtype (features and
gradients, both against a float32 reference), so a faster kernel is also seen to compute the same numbers.

Per config and objective (CE, and TRIME with the config's own memory: local / long with its m / ext with its
in-batch memory) it compiles `steps.train_step` with the config's optimizer (`runtime.optim.make_optimizer`,
as train.py), LossSpec, grad accumulation and dtype, exactly as train.py jits it (state donated), on random
tokens, and reports the median step time of `--steps` timed updates after `--warmup`, tokens/s, model FLOPs per
token (formula below, printed), MFU against the device's peak, XLA's own FLOP count (cost_analysis), XLA's
memory plan and the device's peak memory, and TRIME ÷ CE. It also times the train loop's host-side batch
production (`train.BatchSource`) for the config, to show whether the input pipeline could stall the device.

Model FLOPs per trained token (forward + backward = 3 × forward; a multiply-add is 2 FLOPs):
  6 · N_mm                      N_mm: parameters used in matmuls per token: per layer 4·D² (q, k, v, out) +
                                2·D·F (FFN); adaptive input: Σ_i dim_i·D (every band's projection runs for
                                every token here); output layer: full softmax V·D, adaptive softmax
                                (c_1 + k)·D head + Σ_i s_i · (D·dim_i + V_i·dim_i) tails, s_i the share of the
                                step's targets in tail i (the model needs a tail only for its own targets, as
                                the original's criterion computes it). MFU counts these; HFU ("hardware") counts
                                what this code executes: every tail for every row (s_i = 1), or for r of the
                                rows under model.adaptive_tail_rows = r < 1. Embedding lookups, biases,
                                LayerNorms, softmaxes: not counted.
  + 12 · n_layers · D · ctx     causal attention: QKᵀ and AV, 2·D each per visible key, ×3; ctx = (L+1)/2 keys
                                seen on average (masked-out keys are not counted, though XLA computes them)
  + 6 · D · M                   TRIME only: the memory similarities g·g_j (2·D forward, 4·D backward: dq, dk)
                                for the M memories a query sees on average: local (L-1)/2; long with m
                                consecutive segments (m-1)·L/2 + (L-1)/2; ext (B-1)·L + (1-p)·(L-1)/2 (B rows
                                of the micro-batch, p = drop_local_prob). The memory aggregation is an
                                elementwise log-sum-exp (no second matmul), not counted.
XLA's count (`compiled.cost_analysis()["flops"]`) counts every op, masked attention entries included; XLA's
HLO cost analysis counts a while-loop body once, so with grad accumulation (a lax.scan) it is multiplied by
the accumulation count when this backend's cost analysis is found (by a probe at start-up) to do so. The
chunked vocabulary path (train.vocab_chunk > 0) is a scan over chunks too, which XLA then counts once: its XLA
count is low by the other chunks' logits (wiki103_* configs).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import check_flags, check_out, fail, run, zipf_tokens
from trime_jax import data, steps
from trime_jax import model as model_lib
from trime_jax import train as train_lib
from trime_jax.runtime.optim import make_optimizer
from trime_jax import specs
from trime_jax.train_config import check_speed_options, validate_config

CONFIGS = ("wiki103_247m", "wiki103_150m", "wiki103_7m", "enwik8_38m", "docs_wt")
DOCS_WT_VOCAB = 82_548  # docs-wt's vocabulary (docs/docs_wt.md); its config takes it from the data

# Dense (no sparsity) peak TFLOP/s by device_kind substring, first match wins: (bfloat16, float32).
# NVIDIA: the H100 SXM / H200 datasheets (989.4 bf16 tensor core, 66.9 fp32 non-tensor; the datasheets' 1,979
# is with 2:4 sparsity); H100 PCIe 756 / 51; A100 312 / 19.5 (A100 datasheet). Google Cloud TPU docs (per
# chip): v4 275, v5e 197, v5p 459, v6e 918 bf16; TPUs have no separate fp32 matmul peak (None: n/a).
# float32 on an NVIDIA GPU: XLA's default matmul precision runs float32 matmuls on TF32 tensor cores, so a
# float32 model's MFU is taken against the dense TF32 peak (TF32_PEAKS: H100 SXM / H200 494.7, H100 PCIe 378,
# A100 156), not the fp32 one (found by a review: docs_wt is float32); the paper configs are bfloat16.
TF32_PEAKS = (("H100 PCIe", 378.0), ("H100", 494.7), ("H200", 494.7), ("A100", 156.0))
PEAKS_TFLOPS = (
    ("H100 PCIe", (756.0, 51.0)),
    ("H100", (989.4, 66.9)),
    ("H200", (989.4, 66.9)),
    ("A100", (312.0, 19.5)),
    ("TPU v4", (275.0, None)),
    ("TPU v5 lite", (197.0, None)),  # v5e's device_kind
    ("TPU v5e", (197.0, None)),
    ("TPU v5p", (459.0, None)),
    ("TPU v5", (459.0, None)),  # v5p's device_kind
    ("TPU v6 lite", (918.0, None)),  # v6e (Trillium)
    ("TPU v6e", (918.0, None)),
)

FORMULA = ("model FLOPs/token = 6·N_mm + 12·n_layers·D·(L+1)/2 [causal attention] + 6·D·M [TRIME memory "
           "similarities; M: local (L-1)/2, long (m-1)·L/2+(L-1)/2, ext (B-1)·L+(1-p)·(L-1)/2]; N_mm = "
           "n_layers·(4·D²+2·D·F) + adaptive-input projections Σ dim_i·D + output layer (V·D, or adaptive head "
           "(c_1+k)·D + Σ s_i·(D·dim_i+V_i·dim_i), s_i = share of the targets in tail i); MFU = model FLOPs/s ÷ "
           "peak; HFU: the tails as executed (s_i = 1, or model.adaptive_tail_rows)")


def peak_tflops(device_kind: str, dtype: str, override: float = 0.0):
  """(peak TFLOP/s or None, where it came from)."""
  if override:
    return override, "--peak_tflops"
  if dtype == "float32":
    for key, tf32 in TF32_PEAKS:
      if key.lower() in device_kind.lower():
        return tf32, f"table: {key} TF32 (XLA's default precision for float32 matmuls on this GPU)"
  for key, (bf16, fp32) in PEAKS_TFLOPS:
    if key.lower() in device_kind.lower():
      peak = bf16 if dtype == "bfloat16" else fp32
      return peak, f"table: {key} {dtype}" if peak else f"table: {key} has no {dtype} peak"
  return None, f"no peak known for {device_kind!r}"


def matmul_params(mcfg, tail_shares=None) -> dict:
  """N_mm per token by part (see the module docstring): the model's, each adaptive-softmax tail at the share
  of targets in it (`tail_shares`); with tail_shares None, as executed (every tail for every row, or for
  model.adaptive_tail_rows of them)."""
  d, f, nl = mcfg.d_model, mcfg.d_ff, mcfg.num_layers
  parts = {"layers": nl * (4 * d * d + 2 * d * f)}
  edges = mcfg.band_edges
  if mcfg.adaptive_input:
    parts["adaptive_input_proj"] = sum(model_lib.band_dim(d, mcfg.adaptive_input_factor, i) * d
                                       for i in range(len(edges) - 1))
  if mcfg.adaptive_softmax:
    k = len(edges) - 2
    if tail_shares is None:  # model.adaptive_tail_rows = r < 1: a tail runs for ceil(r · rows) rows, not every row
      tail_shares = [min(1.0, getattr(mcfg, "adaptive_tail_rows", 1.0))] * k
    if len(tail_shares) != k:
      raise ValueError(f"{k} adaptive-softmax tails, {len(tail_shares)} shares")
    tails = sum(share * model_lib.band_dim(d, mcfg.adaptive_softmax_factor, i + 1)
                * (d + edges[i + 2] - edges[i + 1]) for i, share in enumerate(tail_shares))
    parts["softmax"] = (edges[1] + k) * d + tails
  else:
    parts["softmax"] = mcfg.vocab_size * d
  return parts


def tail_shares_of(mcfg, targets) -> list | None:
  """The share of `targets` in each adaptive-softmax tail band (None without an adaptive softmax)."""
  if not mcfg.adaptive_softmax:
    return None
  t, edges = np.asarray(targets).reshape(-1), mcfg.band_edges
  return [float(((t >= lo) & (t < hi)).mean()) for lo, hi in zip(edges[1:-1], edges[2:])]


def memories_per_query(memory: str, b: int, l: int, m: int, p_drop: float) -> float:
  if memory == "local":
    return (l - 1) / 2
  if memory == "long":
    return (m - 1) * l / 2 + (l - 1) / 2
  if memory == "ext":
    return (b - 1) * l + (1 - p_drop) * (l - 1) / 2
  return 0.0


def flops_per_token(mcfg, l: int, objective: str, memory: str, b: int, m: int, p_drop: float,
                    tail_shares=None) -> dict:
  """Model FLOPs per token ("total"; the adaptive tails at `tail_shares`, as executed when None) and the
  executed count ("executed_total", HFU's)."""
  parts = matmul_params(mcfg, tail_shares)
  n_mm = sum(parts.values())
  out = {"n_mm": n_mm, "n_mm_parts": parts, "matmul": 6 * n_mm,
         "attention": 12 * mcfg.num_layers * mcfg.d_model * (l + 1) / 2}
  mem = memories_per_query(memory, b, l, m, p_drop) if objective == "trime" else 0.0
  out["memories_per_query"] = mem
  out["memory"] = 6 * mcfg.d_model * mem
  out["total"] = out["matmul"] + out["attention"] + out["memory"]
  out["tail_shares"] = tail_shares
  out["executed_total"] = out["total"] + 6 * (sum(matmul_params(mcfg).values()) - n_mm)
  return out


# ----------------------------------------------------------------------------------------------------------
# Configs, at their shapes or shrunk (--tiny)
# ----------------------------------------------------------------------------------------------------------
def load_config(name: str, tiny: bool):
  try:
    c = importlib.import_module(f"trime_jax.configs.{name}").get_config()
  except ModuleNotFoundError as e:
    if e.name != f"trime_jax.configs.{name}":
      raise
    fail(f"--configs: no config {name!r} (configs/{name}.py); the paper's: {','.join(CONFIGS)}")
  if not c.model.vocab_size:
    c.model.vocab_size = DOCS_WT_VOCAB
  if tiny:  # every dimension shrunk; the structure (adaptive bands, memory kind, accumulation, dtype) kept
    with c.unlocked():
      v = c.model.vocab_size
      tv = min(v, 2_000)
      cuts, prev = [], 0
      for x in c.model.adaptive_cutoffs:  # same relative band edges, strictly increasing
        prev = max(prev + 1, int(x * tv / v))
        cuts.append(prev)
      c.model.vocab_size, c.model.adaptive_cutoffs = tv, tuple(cuts)
      c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.d_ff = 1, 64, 4, 128  # 1 layer: compile time
      c.data.segment_len = min(c.data.segment_len, 64)
      c.model.max_len = c.data.segment_len
      c.eval.block_len = min(c.eval.block_len, c.model.max_len)  # unused here; kept valid for validate_config
      c.eval.context_window = min(c.eval.context_window, c.eval.block_len - 1)
      m = c.trime.consecutive_segments if c.trime.memory == "long" else 1
      c.trime.consecutive_segments = min(m, 4)
      c.train.batch_size = 4 if c.trime.memory == "long" else min(c.train.batch_size, 4)
      c.train.grad_accum = min(c.train.grad_accum, 2)
      c.trime.consecutive_gpus = math.gcd(c.trime.consecutive_gpus, c.train.grad_accum)  # must divide it
      if c.train.vocab_chunk:
        c.train.vocab_chunk = 512
  return c


def parse_set(items) -> dict:
  """["model.remat=block", ...] -> {"model.remat": "block", ...} (values still text; `apply_set` types them)."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or key.count(".") != 1:
      fail(f"--set takes SECTION.FIELD=VALUE (e.g. model.remat=block), got {item!r}")
    out[key.strip()] = value.strip()
  return out


def _typed(text: str, current):
  """`text` as the type of the field's current value: str as given, bool from true/false, numbers and tuples
  as Python literals (an int given for a float field becomes a float)."""
  if isinstance(current, str):
    return text
  if isinstance(current, bool):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"{text!r} is not a bool")
    return text.lower() in ("true", "1")
  value = ast.literal_eval(text)
  if isinstance(current, float) and isinstance(value, int):
    return float(value)
  if isinstance(current, tuple) and isinstance(value, list):
    return tuple(value)
  return value


def apply_set(config, settings: dict):
  """The config with `settings` ({"section.field": text}) applied; an unknown field or a value of the wrong type
  is one error line naming it (exit status 2)."""
  for key, text in settings.items():
    section, field = key.split(".")
    if section not in config or field not in config[section]:
      fail(f"--set {key}: no such config field")
    try:
      config[section][field] = _typed(text, config[section][field])
    except (ValueError, SyntaxError, TypeError) as e:
      fail(f"--set {key}={text}: {e}")
  return config


def attention_agreement(mcfg, impl: str, seq_len: int, rows: int = 2, num_layers: int = 2,
                        compiler_options=None) -> dict:
  """Max |difference| of a small model's features f and gradients between `impl` and attention_impl="xla" (both
  in the config's dtype, no dropout), and of each against the float32 model (the rounding a dtype alone
  brings): a kernel that computes the same attention differs from XLA's about as much as XLA's differs from
  float32. Small: `num_layers` blocks of the config's width and heads, a 1,000-word vocabulary, `seq_len` tokens.
  `compiler_options`: XLA's, for the three compilations (the CPU test's: unoptimised, quicker to compile)."""
  small = dict(vocab_size=1000, num_layers=num_layers, d_model=mcfg.d_model, num_heads=mcfg.num_heads,
               d_ff=mcfg.d_ff, max_len=seq_len, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (rows, seq_len), dtype=np.int32))
  # The same float32 parameters for every variant (parameters stay float32 whatever the compute dtype).
  params = nnx.state(model_lib.build_model(model_lib.ModelConfig(**small), rngs=nnx.Rngs(params=0)), nnx.Param)

  def run(**kw):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.build_model(model_lib.ModelConfig(**small, **kw))))

    def scalar(q):
      f, _ = nnx.merge(graphdef, q).features(tokens)
      return jnp.sum(jnp.sin(f.astype(jnp.float32))), f.astype(jnp.float32)

    fn = jax.jit(jax.value_and_grad(scalar, has_aux=True)).lower(params).compile(compiler_options=compiler_options)
    (_, f), g = fn(params)
    return jax.device_get(f), jax.device_get(g)

  ref = run(dtype="float32")
  xla = run(dtype=mcfg.dtype)
  other = run(dtype=mcfg.dtype, attention_impl=impl)

  def gap(a, b):
    fa, ga = a
    fb, gb = b
    leaves = zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb))
    grad = max(float(np.max(np.abs(x - y))) for x, y in leaves)
    return {"features": float(np.max(np.abs(fa - fb))), "grads": grad}

  return {"impl": impl, "dtype": mcfg.dtype, "seq_len": seq_len, "rows": rows, "num_layers": num_layers,
          "impl_vs_xla": gap(other, xla), "xla_vs_float32": gap(xla, ref), "impl_vs_float32": gap(other, ref)}


def flash_agreement(mcfg, seq_len: int, rows: int = 1) -> dict:
  """model.attention_impl="pallas" at the config's heads, head dimension, dtype and attention dropout, on one
  layer's q, k, v: max |difference| of the kernels' output and q / k / v gradients (the config's dtype) from the
  materialised attention with the kernels' own dropout mask in float32, beside the same reference evaluated on
  inputs rounded to the dtype (the rounding the dtype alone brings), and each path's forward + backward time.
  Without a GPU the kernels run in Pallas's interpreter (the CPU test's tiny shapes)."""
  from trime_jax import flash_attention as fa

  heads, rate, dtype = mcfg.num_heads, mcfg.attention_dropout, jnp.dtype(mcfg.dtype)
  shape = (rows, seq_len, heads, mcfg.d_model // heads)
  q, k, v, w = (jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32) for i in range(4))
  key = jax.random.PRNGKey(4)
  keep = fa.dropout_keep_mask(fa.head_seeds(key, rows, heads), seq_len, rate)
  interpret = jax.default_backend() != "gpu"

  def grads(attend, cast):
    def loss(q, k, v):
      return jnp.sum(attend(q, k, v).astype(jnp.float32) * w)

    fn = jax.jit(jax.value_and_grad(lambda q, k, v: loss(q, k, v), argnums=(0, 1, 2)))
    args = [x.astype(cast) for x in (q, k, v)]
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    out = jax.block_until_ready(jax.jit(attend)(*args)), jax.block_until_ready(fn(*args))[1]
    return out, time.perf_counter() - t

  ref, _ = grads(lambda q, k, v: fa.reference_attention(q, k, v, keep, rate), jnp.float32)
  rounded, t_mat = grads(lambda q, k, v: fa.reference_attention(q, k, v, keep, rate), dtype)
  kernel, t_kernel = grads(lambda q, k, v: fa.causal_attention(q, k, v, rate=rate, key=key, interpret=interpret),
                           dtype)

  def gap(a, b):
    (fa_, ga), (fb, gb) = a, b
    return {"output": float(jnp.max(jnp.abs(fa_.astype(jnp.float32) - fb))),
            "grads": max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y))) for x, y in zip(ga, gb))}

  return {"impl": "pallas", "dtype": mcfg.dtype, "shape_BxTxHxK": list(shape), "rate": rate,
          "kernel_vs_float32": gap(kernel, ref), "rounded_inputs_vs_float32": gap(rounded, ref),
          "kernel_s": t_kernel, "materialised_float32_s": t_mat, "interpreted": interpret}


# ----------------------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------------------
def _cost_flops(compiled):
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float(ca["flops"]) if ca and "flops" in ca else None


@functools.lru_cache(maxsize=None)
def loop_body_counted_once() -> bool:
  """Whether this backend's cost analysis counts a lax.scan body once (not × its trip count)."""
  w = jnp.ones((64, 64))
  f = jax.jit(lambda x: jax.lax.scan(lambda c, xi: (c + (xi @ w).sum(), None), 0.0, x)[0])
  one, three = (_cost_flops(f.lower(jnp.ones((a, 8, 64))).compile()) for a in (1, 3))
  return bool(one and three and three < 2 * one)


def _memory_plan(compiled):
  m = compiled.memory_analysis()
  if m is None:
    return None
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def _device_peak():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def random_batch(config, a: int, b: int, l: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  tokens = zipf_tokens(rng, config.model.vocab_size, (a, b, l + 1))  # text-like band shares (bench.common)
  t = config.trime
  drop = rng.random((a, b)) < t.drop_local_prob if t.memory == "ext" else np.zeros((a, b), bool)
  batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "drop_local": drop}
  if t.memory == "long" and t.consecutive_layout == "packed":
    batch["documents"] = np.zeros((a, b, l), np.int32)  # one document per row: memory as in the stream layout
  return batch


def measure(config, objective: str, rows: int, n_steps: int, warmup: int, peak):
  """One row of the table: the config's real train step at `rows` segments per device."""
  mcfg = specs.model_config(config, vocab_size=config.model.vocab_size)
  if not isinstance(mcfg, model_lib.ModelConfig):
    fail(f"bench.mfu counts FLOPs of the Transformer backbone only, not {type(mcfg).__name__}")
  graphdef, params = nnx.split(model_lib.build_model(mcfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  tx, _ = make_optimizer(config.train)  # train.py's optimizer (trime_jax/runtime/optim.py)
  spec = specs.loss_spec(config)
  memory = spec.objective.memory
  use_trime = objective == "trime"
  # train.py reports the TRIME loss beside CE whenever the config has memory; a "ce" row here is the pure CE
  # step (nothing TRIME computed), the baseline TRIME ÷ CE is taken against.
  fn = functools.partial(steps.train_step, graphdef, tx, spec, use_trime, use_trime)
  a, l = config.train.grad_accum, config.data.segment_len
  batch = jax.device_put(random_batch(config, a, rows, l))
  state = jax.device_put({"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)})
  t0 = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=(0,)).lower(state, batch, jax.random.PRNGKey(0)).compile()
  compile_s = time.perf_counter() - t0
  key = jax.random.PRNGKey(1)
  times = []
  for i in range(warmup + n_steps):
    t = time.perf_counter()
    state, metrics = compiled(state, batch, jax.random.fold_in(key, i))  # state donated, as in train.py
    jax.block_until_ready((state, metrics))
    if i >= warmup:
      times.append(time.perf_counter() - t)
  step_s = statistics.median(times)
  tokens = a * rows * l
  m = spec.objective.consecutive_segments
  fl = flops_per_token(mcfg, l, objective, memory, rows, m, float(config.trime.drop_local_prob),
                       tail_shares=tail_shares_of(mcfg, batch["targets"]))
  xla_raw = _cost_flops(compiled)
  xla = xla_raw * (a if loop_body_counted_once() else 1) if xla_raw is not None else None
  model_flops = fl["total"] * tokens
  executed_flops = fl["executed_total"] * tokens
  row = {"objective": objective, "memory": memory if use_trime else "none", "rows_per_device": rows,
         "attention_impl": mcfg.attention_impl, "remat": mcfg.remat,
         "segment_len": l, "grad_accum": a, "tokens_per_step": tokens, "dtype": mcfg.dtype,
         "compile_s": compile_s, "step_s": step_s, "step_s_all": times, "tokens_per_s": tokens / step_s,
         "flops_per_token": fl, "model_flops_per_step": model_flops, "xla_flops_per_step": xla,
         "xla_flops_raw": xla_raw, "xla_loop_body_counted_once": loop_body_counted_once(),
         "model_over_xla": model_flops / xla if xla else None,
         "executed_over_xla": executed_flops / xla if xla else None,
         "achieved_tflops": model_flops / step_s / 1e12,
         "mfu": model_flops / step_s / 1e12 / peak if peak else None,
         "executed_flops_per_step": executed_flops,
         "hfu": executed_flops / step_s / 1e12 / peak if peak else None,
         "xla_memory_plan_bytes": _memory_plan(compiled), "device_peak_bytes_so_far": _device_peak(),
         "loss": float(metrics["loss"]), "skipped": int(metrics["skipped"])}
  return row


def input_pipeline(config, n: int = 20, seed: int = 0, min_tokens: int = 2_000_000) -> dict:
  """Seconds per update of train.py's host-side batch production (`BatchSource(step)`) on a synthetic corpus
  of random tokens (the real corpora are not here), and of putting that batch on the device.

  Batch plans (consecutive / bm25 batching) are replaced by random batching: the plan only swaps how segment
  indices are chosen (a row lookup in a precomputed array); the gather of the segments' tokens, timed here,
  is the same."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.trime.batching = "random"
  a, b, l = c.train.grad_accum, c.train.batch_size, c.data.segment_len
  n_tok = max(4 * a * b * (l + 1), min_tokens)  # a corpus of several batches at least
  rng = np.random.default_rng(seed)
  vocab = data.Vocab([f"w{i}" for i in range(c.model.vocab_size)])
  docs = np.array_split(rng.integers(0, c.model.vocab_size, n_tok, dtype=np.int32), max(n_tok // 3000, 1))
  corpus = data.Corpus.from_docs(docs, vocab, name="synthetic")
  source = train_lib.BatchSource(corpus, c)
  host, put = [], []
  for step in range(n + 1):
    t = time.perf_counter()
    batch = source(step)
    t1 = time.perf_counter()
    jax.block_until_ready(jax.device_put(batch))
    t2 = time.perf_counter()
    if step:  # the first call pays one-time costs
      host.append(t1 - t)
      put.append(t2 - t1)
  return {"host_batch_s": statistics.median(host), "device_put_s": statistics.median(put),
          "global_batch_tokens": a * b * l, "note": "synthetic corpus, random batching"}


def max_batch(config, objective, start_rows, n_steps, warmup, peak, limit):
  """Doubles the per-device rows from `start_rows` until compiling or running fails (out of memory) or `limit`;
  the last row that ran, measured."""
  best, rows = None, start_rows * 2
  while rows <= limit:
    try:
      best = measure(config, objective, rows, n_steps, warmup, peak)
    except Exception as e:  # XlaRuntimeError RESOURCE_EXHAUSTED at compile or run time
      return best, f"{rows} rows failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    rows *= 2
  return best, f"stopped at the limit of {limit} rows"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--configs", default=",".join(CONFIGS))
  ap.add_argument("--tiny", action="store_true", help="shrink every model (CPU smoke run)")
  ap.add_argument("--rows", type=int, default=0, help="segments per device (0: train.batch_size / devices)")
  ap.add_argument("--objectives", default="ce,trime")
  ap.add_argument("--steps", type=int, default=10, help="timed updates (median)")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--max_batch", action="store_true", help="also double the rows until out of memory")
  ap.add_argument("--max_batch_limit", type=int, default=1024)
  ap.add_argument("--peak_tflops", type=float, default=0.0, help="override the device's peak (e.g. on CPU)")
  ap.add_argument("--pipeline_steps", type=int, default=20)
  ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                  help="override a config field of every config (repeatable), e.g. model.remat=block")
  ap.add_argument("--check_attention", action="store_true",
                  help="first compare the config's attention_impl with XLA's on a small model (GPU levers)")
  ap.add_argument("--out", default="")
  ap.add_argument("--overwrite", action="store_true", help="replace an --out that is not this benchmark's result")
  args = ap.parse_args(argv)
  check_flags((args.steps >= 1, f"--steps must be >= 1, got {args.steps}"),
              (args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}"),
              (args.rows >= 0, f"--rows must be >= 0 (0: the config's), got {args.rows}"),
              (args.peak_tflops >= 0, f"--peak_tflops must be >= 0 (0: the device's), got {args.peak_tflops}"),
              (args.pipeline_steps >= 0, f"--pipeline_steps must be >= 0, got {args.pipeline_steps}"),
              (args.max_batch_limit >= 1, f"--max_batch_limit must be >= 1, got {args.max_batch_limit}"),
              (set(args.objectives.split(",")) <= {"ce", "trime"}, f"--objectives takes ce,trime, got {args.objectives!r}"))
  check_out(args.out, "mfu", args.overwrite)
  settings = parse_set(args.set)
  names = [x for x in args.configs.split(",") if x]
  for name in names:  # every name and --set field checked before the first measurement, values as train.py
    validate_config(apply_set(load_config(name, args.tiny), settings))  # checks them (a ConfigError: `run`)

  dev = jax.devices()[0]
  print(f"backend {jax.default_backend()} | device {dev.device_kind} × {jax.device_count()} | jax {jax.__version__}")
  print(FORMULA)
  print(f"XLA cost analysis counts a scan body once: {loop_body_counted_once()} (then × grad_accum)\n")
  results = {"bench": "mfu", "backend": jax.default_backend(), "device_kind": dev.device_kind, "devices": jax.device_count(),
             "jax": jax.__version__, "tiny": args.tiny, "formula": FORMULA, "configs": {},
             "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:],
             "set": settings}
  print(f"settings: {' '.join(f'{k}={v}' for k, v in settings.items()) if settings else 'as configured'}")
  header = ("| config | objective | B×L×A | step (s) | tokens/s | model GFLOP/token | XLA ÷ executed | TFLOP/s | "
            "MFU | HFU | XLA plan GiB | TRIME÷CE |")
  print(header)
  print("|" + "---|" * (header.count("|") - 1))

  def write():  # after every row: a config cut at its budget (gpu_speed.sh's timeout) keeps what it measured
    if args.out:
      with open(args.out, "w") as f:
        json.dump(results, f, indent=1)

  for name in names:
    config = apply_set(load_config(name, args.tiny), settings)
    check_speed_options(config)  # train.py's check: an option this backend cannot run is one ConfigError
    peak, peak_src = peak_tflops(dev.device_kind, config.model.dtype, args.peak_tflops)
    rows = args.rows or max(config.train.batch_size // jax.device_count(), 1)
    entry = results["configs"][name] = {"peak_tflops": peak, "peak_source": peak_src, "rows": {}, "batch_search": {}}
    mcfg = specs.model_config(config, vocab_size=config.model.vocab_size)
    entry["num_params"] = model_lib.abstract_param_count(mcfg)
    if args.check_attention and mcfg.attention_impl == "pallas":  # its kernels run in training with dropout only
      entry["attention_check"] = chk = flash_agreement(mcfg, min(config.data.segment_len, 1024))
      print(f"|   attention pallas ({chk['dtype']}, B×T×H×K {chk['shape_BxTxHxK']}, dropout {chk['rate']}) vs the "
            f"materialised float32 with its mask: max |Δout| {chk['kernel_vs_float32']['output']:.3g}, |Δgrad| "
            f"{chk['kernel_vs_float32']['grads']:.3g}; inputs rounded to {chk['dtype']} alone: "
            f"{chk['rounded_inputs_vs_float32']['output']:.3g}, {chk['rounded_inputs_vs_float32']['grads']:.3g}; "
            f"forward+backward {chk['kernel_s'] * 1e3:.2f} ms vs materialised {chk['materialised_float32_s'] * 1e3:.2f}"
            " ms |", flush=True)
    elif args.check_attention:
      entry["attention_check"] = chk = attention_agreement(mcfg, mcfg.attention_impl,
                                                           min(config.data.segment_len, 1024))
      print(f"|   attention {chk['impl']} vs xla ({chk['dtype']}, {chk['num_layers']} layers × {chk['seq_len']} "
            f"tokens): max |Δf| {chk['impl_vs_xla']['features']:.3g}, |Δgrad| {chk['impl_vs_xla']['grads']:.3g}; "
            f"xla vs float32: {chk['xla_vs_float32']['features']:.3g}, {chk['xla_vs_float32']['grads']:.3g} |",
            flush=True)
    for objective in [x for x in args.objectives.split(",") if x]:
      if objective == "trime" and config.trime.memory == "none":
        continue
      try:
        r = measure(config, objective, rows, args.steps, args.warmup, peak)
      except Exception as e:  # out of memory at the config's batch (an accelerator): recorded, the rest goes on
        entry.setdefault("errors", {})[objective] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(f"| {name} | {objective} | {rows} rows | failed: {entry['errors'][objective]} |", flush=True)
        write()
        continue
      entry["rows"][objective] = r
      ratio = ""
      if objective == "trime" and "ce" in entry["rows"]:
        entry["trime_over_ce"] = r["step_s"] / entry["rows"]["ce"]["step_s"]
        ratio = f"{entry['trime_over_ce']:.3f}"
      mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
      hfu = f"{100 * r['hfu']:.1f}%" if r["hfu"] is not None else "n/a"
      xr = f"{1 / r['executed_over_xla']:.2f}" if r["executed_over_xla"] else "n/a"
      plan = f"{r['xla_memory_plan_bytes'] / 2**30:.2f}" if r["xla_memory_plan_bytes"] else "n/a"
      label = objective if objective == "ce" else f"trime ({r['memory']})"
      print(f"| {name} | {label} | {rows}×{r['segment_len']}×{r['grad_accum']} | {r['step_s']:.4f} | "
            f"{r['tokens_per_s']:,.0f} | {r['flops_per_token']['total'] / 1e9:.4f} | {xr} | "
            f"{r['achieved_tflops']:.3f} | {mfu} | {hfu} | {plan} | {ratio} |", flush=True)
      write()
      if args.max_batch:
        best, why = max_batch(config, objective, rows, max(args.steps // 2, 3), 1, peak, args.max_batch_limit)
        entry["batch_search"][objective] = {"largest": best, "stop": why}
        if best:
          mfu = f"{100 * best['mfu']:.1f}%" if best["mfu"] is not None else "n/a"
          print(f"| {name} | {label}, largest | {best['rows_per_device']}×{best['segment_len']}×"
                f"{best['grad_accum']} | {best['step_s']:.4f} | {best['tokens_per_s']:,.0f} | | | "
                f"{best['achieved_tflops']:.3f} | {mfu} | | | | ({why})", flush=True)
        write()
    if args.pipeline_steps and entry["rows"]:
      entry["input_pipeline"] = p = input_pipeline(config, args.pipeline_steps,
                                                     min_tokens=100_000 if args.tiny else 2_000_000)
      slowest = max(r["step_s"] for r in entry["rows"].values())
      p["host_over_fastest_step"] = p["host_batch_s"] / min(r["step_s"] for r in entry["rows"].values())
      print(f"|   input pipeline | host batch {p['host_batch_s'] * 1e3:.2f} ms, device_put "
            f"{p['device_put_s'] * 1e3:.2f} ms per update (steps {slowest * 1e3:.1f} ms at most) | | | | | | | | |")
    write()
  if args.out:
    write()
    print(f"\nwrote {args.out}")
  return results


if __name__ == "__main__":
  run(main)  # a config this backend cannot run (e.g. attention_impl=cudnn on a CPU): one error line, exit 2
