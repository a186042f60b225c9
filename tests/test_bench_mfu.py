"""bench.mfu at tiny shapes on CPU: the JSON it writes, and its FLOP formula against XLA's own count."""

import json

import pytest

from bench import mfu


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("mfu") / "mfu.json"
  # enwik8_38m: one adaptive band = a plain full-softmax Transformer (the FLOP check) with TRIME long memory;
  # one config keeps the test near a minute on 2 shared cores (experiments/gpu_speed.sh with TINY=1 runs all
  # five); --peak_tflops so that MFU is computed on CPU too.
  mfu.main(["--tiny", "--configs=enwik8_38m", "--steps=2", "--warmup=1", "--pipeline_steps=2",
            "--peak_tflops=1.0", f"--out={out}"])
  return json.loads(out.read_text())


def test_fields_and_ratio(result):
  assert set(result["configs"]) == {"enwik8_38m"}
  for name, entry in result["configs"].items():
    assert set(entry["rows"]) == {"ce", "trime"}, name
    ce, tr = entry["rows"]["ce"], entry["rows"]["trime"]
    assert tr["memory"] == "long" and tr["grad_accum"] == 2
    assert entry["trime_over_ce"] == pytest.approx(tr["step_s"] / ce["step_s"])
    for r in (ce, tr):
      assert r["step_s"] > 0 and len(r["step_s_all"]) == 2
      assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_s"])
      assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / r["step_s"] / 1e12)  # peak 1 TFLOP/s
      assert r["skipped"] == 0 and r["loss"] > 0
    # the memory term is TRIME's only, and positive
    assert ce["flops_per_token"]["memory"] == 0 and tr["flops_per_token"]["memory"] > 0
    assert entry["input_pipeline"]["host_batch_s"] > 0


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


def test_peak_table():
  assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16")[0] == 989.4
  assert mfu.peak_tflops("NVIDIA H100 PCIe", "bfloat16")[0] == 756.0
  assert mfu.peak_tflops("TPU v5 lite", "bfloat16")[0] == 197.0
  assert mfu.peak_tflops("cpu", "float32")[0] is None
