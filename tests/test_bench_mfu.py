"""bench.mfu at tiny shapes on CPU: the JSON it writes, and its FLOP formula against XLA's own count."""

import contextlib
import io
import json

import numpy as np
import pytest

from bench import mfu
from trime_jax.configs import default
from trime_jax.errors import ConfigError


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("mfu") / "mfu.json"
  # enwik8_38m: one adaptive band = a plain full-softmax Transformer (the FLOP check) with TRIME long memory;
  # one config keeps the test near a minute on 2 shared cores (experiments/gpu_speed.sh with TINY=1 runs all
  # five); --peak_tflops so that MFU is computed on CPU too. --set: m = 2 consecutive segments (tiny: 4), and
  # the default attention kernel named explicitly (both must reach the measured step and the record).
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    mfu.main(["--tiny", "--configs=enwik8_38m", "--steps=2", "--warmup=1", "--pipeline_steps=2",
              "--peak_tflops=1.0", f"--out={out}", "--set", "trime.consecutive_segments=2",
              "--set", "model.attention_impl=xla"])
  result = json.loads(out.read_text())
  result["stdout"] = stdout.getvalue()
  return result


def test_fields_and_ratio(result):
  assert set(result["configs"]) == {"enwik8_38m"}
  for name, entry in result["configs"].items():
    assert set(entry["rows"]) == {"ce", "trime"}, name
    ce, tr = entry["rows"]["ce"], entry["rows"]["trime"]
    assert tr["memory"] == "long" and tr["grad_accum"] == 2
    l = tr["segment_len"]
    assert tr["flops_per_token"]["memories_per_query"] == (2 - 1) * l / 2 + (l - 1) / 2  # m = 2, from --set
    assert entry["trime_over_ce"] == pytest.approx(tr["step_s"] / ce["step_s"])
    for r in (ce, tr):
      assert r["step_s"] > 0 and len(r["step_s_all"]) == 2
      assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_s"])
      assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / r["step_s"] / 1e12)  # peak 1 TFLOP/s
      assert r["skipped"] == 0 and r["loss"] > 0
    # the memory term is TRIME's only, and positive
    assert ce["flops_per_token"]["memory"] == 0 and tr["flops_per_token"]["memory"] > 0
    assert entry["input_pipeline"]["host_batch_s"] > 0


def test_set_is_recorded_and_printed(result):
  assert result["set"] == {"trime.consecutive_segments": "2", "model.attention_impl": "xla"}
  assert "settings: trime.consecutive_segments=2 model.attention_impl=xla\n| config |" in result["stdout"]
  for r in result["configs"]["enwik8_38m"]["rows"].values():
    assert (r["attention_impl"], r["remat"]) == ("xla", "none")


def test_set_types_and_refusals(capsys):
  c = default.get_config()
  mfu.apply_set(c, mfu.parse_set(["model.remat=block", "train.batch_size=8", "train.learning_rate=1",
                                  "model.final_norm=false", "data.split_fractions=(0.8, 0.1, 0.1)"]))
  assert (c.model.remat, c.train.batch_size, c.model.final_norm) == ("block", 8, False)
  assert c.train.learning_rate == 1.0 and isinstance(c.train.learning_rate, float)
  assert c.data.split_fractions == (0.8, 0.1, 0.1)
  for bad, match in (["model.remat"], "SECTION.FIELD=VALUE"), (["model.rematt=block"], "no such config field"), \
                    (["train.batch_size=eight"], "batch_size=eight"):
    with pytest.raises(SystemExit) as e:
      mfu.apply_set(c, mfu.parse_set(bad))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --set ") and match in err, err


def test_cudnn_on_cpu_is_refused_before_compiling():
  with pytest.raises(ConfigError, match=r"^model.attention_impl='cudnn' needs an NVIDIA GPU"):
    mfu.main(["--tiny", "--configs=docs_wt", "--set", "model.attention_impl=cudnn", "--set", "model.dtype=bfloat16"])


def test_attention_agreement_runs():
  """The GPU lever check's own arithmetic, with XLA against itself on CPU: no gap; bfloat16 vs float32: some."""
  from trime_jax.model import ModelConfig

  chk = mfu.attention_agreement(ModelConfig(vocab_size=10, d_model=16, num_heads=2, d_ff=32, dtype="bfloat16"),
                                "xla", seq_len=8, num_layers=1,
                                compiler_options={"xla_backend_optimization_level": 0})  # compiles in ~1/5
  assert chk["impl_vs_xla"] == {"features": 0.0, "grads": 0.0}
  assert chk["xla_vs_float32"]["features"] > 0 and chk["impl_vs_float32"] == chk["xla_vs_float32"]


def test_flash_agreement_runs():
  """The "pallas" lever's check on CPU (the kernels interpreted): in float32 the kernels equal the materialised
  attention with their mask; in bfloat16 they differ by about what rounding the inputs alone does."""
  from trime_jax.model import ModelConfig

  for dtype in ("float32", "bfloat16"):
    chk = mfu.flash_agreement(ModelConfig(vocab_size=10, d_model=32, num_heads=2, attention_dropout=0.1,
                                          dtype=dtype), seq_len=32)
    assert chk["interpreted"] and chk["shape_BxTxHxK"] == [1, 32, 2, 16] and chk["rate"] == 0.1
    if dtype == "float32":
      assert chk["rounded_inputs_vs_float32"] == {"output": 0.0, "grads": 0.0}
      assert chk["kernel_vs_float32"]["output"] < 1e-5 and chk["kernel_vs_float32"]["grads"] < 1e-4, chk
    else:
      assert 0 < chk["kernel_vs_float32"]["output"] < 10 * chk["rounded_inputs_vs_float32"]["output"], chk


def test_flops_formula_against_xla(result):
  """For a plain Transformer (enwik8 tiny: full softmax over 256 bytes, one adaptive-input band) XLA's count
  is the formula's plus what the formula leaves out on purpose (masked attention entries: ~1/2 of the
  attention term; elementwise ops, the optimizer): within [1, 2] of it. A formula that dropped the
  backward pass (÷3) or doubled a term would fall outside."""
  ce = result["configs"]["enwik8_38m"]["rows"]["ce"]
  assert ce["xla_flops_per_step"] is not None
  assert 1.0 <= ce["xla_flops_per_step"] / ce["model_flops_per_step"] <= 2.0


def test_formula_by_hand():
  """N_mm of a full-softmax model written out: 2 layers, D = 8, F = 16, V = 10."""
  from trime_jax.model import ModelConfig

  cfg = ModelConfig(vocab_size=10, num_layers=2, d_model=8, num_heads=2, d_ff=16)
  f = mfu.flops_per_token(cfg, l=5, objective="trime", memory="ext", b=3, m=1, p_drop=0.5)
  n_mm = 2 * (4 * 64 + 2 * 8 * 16) + 10 * 8
  assert f["n_mm"] == n_mm
  assert f["attention"] == 12 * 2 * 8 * 3  # (L + 1) / 2 = 3 keys on average
  assert f["memories_per_query"] == 2 * 5 + 0.5 * 2
  assert f["total"] == 6 * n_mm + f["attention"] + 6 * 8 * 11


def test_formula_adaptive_by_hand():
  """N_mm of an adaptive model written out (D = 16, cutoffs 10 / 30 of V = 50, factor 2: tails of 8 and 4
  dimensions), every tail for every row, then for a quarter of the rows (model.adaptive_tail_rows)."""
  from trime_jax.model import ModelConfig

  kw = dict(vocab_size=50, num_layers=1, d_model=16, num_heads=2, d_ff=32, adaptive_input=True,
            adaptive_softmax=True, adaptive_cutoffs=(10, 30), adaptive_input_factor=2.0,
            adaptive_softmax_factor=2.0)
  layers, proj, head = 4 * 256 + 2 * 16 * 32, (16 + 8 + 4) * 16, (10 + 2) * 16
  tails = 8 * (16 + 20) + 4 * (16 + 20)
  assert mfu.matmul_params(ModelConfig(**kw)) == {"layers": layers, "adaptive_input_proj": proj,
                                                  "softmax": head + tails}
  assert mfu.matmul_params(ModelConfig(**kw, adaptive_tail_rows=0.25))["softmax"] == head + tails / 4
  # The model's count (MFU): each tail at the share of the targets in its band, whatever the code executes
  # (found by a review: counting every tail for every row overstated the 150M's FLOPs 2.5 times)
  cfg = ModelConfig(**kw)
  targets = np.array([0, 1, 12, 29, 30, 49, 3, 5])  # 2 of 8 in band [10, 30), 2 in [30, 50)
  shares = mfu.tail_shares_of(cfg, targets)
  assert shares == [0.25, 0.25]
  assert mfu.matmul_params(cfg, shares)["softmax"] == head + 8 * (16 + 20) / 4 + 4 * (16 + 20) / 4
  f = mfu.flops_per_token(cfg, l=5, objective="ce", memory="none", b=3, m=1, p_drop=0.0, tail_shares=shares)
  assert f["executed_total"] - f["total"] == 6 * (tails - tails / 4)
  assert mfu.tail_shares_of(ModelConfig(vocab_size=50, num_layers=1, d_model=16, num_heads=2, d_ff=32),
                            targets) is None


def test_peak_table():
  assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16")[0] == 989.4
  assert mfu.peak_tflops("NVIDIA H100 PCIe", "bfloat16")[0] == 756.0
  assert mfu.peak_tflops("NVIDIA H200", "float32")[0] == 494.7  # XLA's float32 matmuls run as TF32 there
  assert mfu.peak_tflops("TPU v5 lite", "bfloat16")[0] == 197.0
  assert mfu.peak_tflops("cpu", "float32")[0] is None


def test_the_json_holds_each_row_as_it_is_measured(tmp_path, monkeypatch):
  """gpu_speed.sh stops a config at its budget: the rows measured before that must already be in --out."""
  out = tmp_path / "mfu.json"
  measure, seen = mfu.measure, []

  def measure_then_read(config, objective, *args):
    if objective == "trime":  # what a kill while TRIME compiles would leave behind
      seen.append(json.loads(out.read_text()))
      raise KeyboardInterrupt
    return measure(config, objective, *args)

  monkeypatch.setattr(mfu, "measure", measure_then_read)
  with contextlib.redirect_stdout(io.StringIO()), pytest.raises(KeyboardInterrupt):
    mfu.main(["--tiny", "--configs=docs_wt", "--steps=1", "--warmup=1", "--pipeline_steps=0", f"--out={out}"])
  [left] = seen
  assert set(left["configs"]["docs_wt"]["rows"]) == {"ce"} and left["configs"]["docs_wt"]["rows"]["ce"]["step_s"] > 0
