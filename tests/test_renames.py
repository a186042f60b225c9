"""One name per quantity (issue 34): what was written or typed before the renames.

Stored configs (an export's or a workdir's config.json) with the old field names load, resume and evaluate under
the new ones, with the same numbers; a config given now under an old name is refused naming the new one;
translation settings (tuned.json) written with the old Distribution fields read under the new ones. The command
lines' one-line errors for old flags and fields: tests/test_reliability_cli.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from flax import nnx

from tests.helpers import tiny_config
from trime_jax import checkpoint as ckpt, exports
from trime_jax import data
from trime_jax import model as M
from trime_jax.configs import default
from trime_jax.errors import CheckpointError, ConfigError
from trime_jax.runtime import workdir
from trime_jax import specs

TAU, TAU_PRIME, TRAIN_TAU = 0.7, 0.4, 1.3


def _as_written_before(stored: dict) -> dict:
  """A config dict as trime-jax wrote it before the renames (the old names spelt out, not taken from the table)."""
  out = json.loads(json.dumps(stored))
  out["trime"]["temperature"] = out["trime"].pop("tau")
  out["eval"]["temperature"] = out["eval"].pop("tau")
  out["eval"]["knn_temperature"] = out["eval"].pop("tau_prime")
  return out


def _config():
  return tiny_config("unused.bin", **{"model.num_layers": 1, "model.d_model": 16, "model.num_heads": 2,
                                      "model.d_ff": 32, "model.max_len": 32, "model.dropout": 0.0,
                                      "eval.block_len": 32, "eval.context_window": 16, "eval.tau": TAU,
                                      "eval.tau_prime": TAU_PRIME, "trime.tau": TRAIN_TAU})


@pytest.fixture(scope="module")
def new_and_old_export(tmp_path_factory):
  """(an export as written today, the same export with a config.json written before the renames)."""
  tmp = tmp_path_factory.mktemp("renames")
  cfg, vocab = _config(), data.Vocab.bytes()
  net = M.TransformerLM(specs.model_config(cfg, vocab_size=len(vocab)), rngs=nnx.Rngs(0))
  new = exports.export(str(tmp / "new"), nnx.state(net, nnx.Param), cfg, vocab)
  old = exports.export(str(tmp / "old"), nnx.state(net, nnx.Param), cfg, vocab)
  path = os.path.join(old, "config.json")
  with open(path) as f:
    stored = json.load(f)
  with open(path, "w") as f:
    json.dump(_as_written_before(stored), f)
  return new, old


def test_migrate_config_renames_in_place():
  stored = {"trime": {"memory": "local", "temperature": 2.0, "stop_gradient_memory": False},
            "eval": {"split": "dev", "temperature": 1.5, "knn_temperature": 0.3, "knn_lambda": 0.2}}
  out = workdir.migrate_config(stored)
  assert list(out["trime"]) == ["memory", "tau", "stop_gradient_memory"]  # in place: config.json reads the same
  assert out["eval"] == {"split": "dev", "tau": 1.5, "tau_prime": 0.3, "knn_lambda": 0.2}
  assert stored["eval"]["temperature"] == 1.5  # the caller's dict is not changed
  today = workdir.migrate_config(out)
  assert today is out  # nothing to rename: the same dict
  assert workdir.migrate_config(["not", "a", "config"]) == ["not", "a", "config"]
  both = {"eval": {"temperature": 1.5, "tau": 1.5}}
  assert workdir.migrate_config(both) == {"eval": {"tau": 1.5}}
  with pytest.raises(ConfigError, match=r"x/config.json has both eval.temperature=1.5 and eval.tau=2.0"):
    workdir.migrate_config({"eval": {"temperature": 1.5, "tau": 2.0}}, "x/config.json")


def test_export_written_before_the_renames_loads_and_scores_the_same(new_and_old_export):
  from trime_jax import api
  from trime_jax import generate
  from trime_jax.launch import export_config

  new, old = new_and_old_export
  config = exports.load_export(old)[2]
  assert (config.eval.tau, config.eval.tau_prime, config.trime.tau) == (TAU, TAU_PRIME, TRAIN_TAU)
  assert "temperature" not in config.eval and "knn_temperature" not in config.eval
  implicit = export_config.get_config(old)  # what `--checkpoint=EXPORT` evaluates with
  assert (implicit.eval.tau, implicit.eval.tau_prime, implicit.trime.tau) == (TAU, TAU_PRIME, TRAIN_TAU)
  assert generate.Generator(old, log=lambda m: None).default_tau == TAU
  text = "def f(x):\n  return x + 1\n"
  a, b = api.Model(new), api.Model(old)
  assert a.default_tau == b.default_tau == TAU
  np.testing.assert_array_equal(a.score(text).log_probs, b.score(text).log_probs)  # bit-identical


def test_workdir_written_before_the_renames_resumes(tmp_path):
  cfg = _config()
  work = tmp_path / "work"
  (work / "checkpoints" / "3").mkdir(parents=True)  # something to resume
  (work / "config.json").write_text(json.dumps(_as_written_before(json.loads(cfg.to_json_best_effort()))))
  ckpt.check_resume_config(str(work), cfg, write=False)  # the same run: no change, nothing refused
  ckpt.check_resume_config(str(work), cfg)
  stored = json.loads((work / "config.json").read_text())
  assert stored["eval"]["tau"] == TAU and "temperature" not in stored["eval"]  # rewritten under today's names
  assert not (work / "config_changes.jsonl").exists()
  # A real change of the training τ is still one, named by its new name.
  (work / "config.json").write_text(json.dumps(_as_written_before(json.loads(cfg.to_json_best_effort()))))
  with cfg.unlocked():
    cfg.trime.tau = 2.0
  with pytest.raises(CheckpointError, match=r"trime.tau: 1.3 there, 2.0 now"):
    ckpt.check_resume_config(str(work), cfg, write=False)


def test_config_given_with_an_old_name_is_refused():
  from trime_jax.launch.flags import renamed_field_refused
  from trime_jax.mt.train_config import validate_config as validate_mt
  from trime_jax.configs import ui_de_en
  from trime_jax.train_config import validate_config

  c = default.get_config()
  for old, line in (("eval", "eval.temperature is now eval.tau (τ on memory similarities)"),
                    ("trime", "trime.temperature is now trime.tau (τ on memory similarities during training)")):
    with pytest.raises(AttributeError) as e:  # a locked config (a --config file): which section refused it
      setattr(c[old], "temperature", 2.0)
    assert renamed_field_refused(e.value) == line
  with pytest.raises(AttributeError) as e:
    c.eval.knn_temperature = 0.5
  assert renamed_field_refused(e.value) == "eval.knn_temperature is now eval.tau_prime (τ′ of Appendix A's P′)"
  with pytest.raises(AttributeError) as e:
    c.eval.tempreture = 2.0  # a plain typo stays ml_collections' own error
  assert renamed_field_refused(e.value) == ""
  with c.unlocked():  # an unlocked config would add the old name as a field nothing reads
    c.eval.knn_temperature = 0.5
  with pytest.raises(ConfigError, match=r"^eval.knn_temperature is now eval.tau_prime"):
    validate_config(c)
  mt = ui_de_en.get_config()
  with mt.unlocked():
    mt.trime.temperature = 10.0
  with pytest.raises(ConfigError, match=r"^trime.temperature is now trime.tau"):
    validate_mt(mt)


def test_translation_settings_written_before_the_renames(tmp_path):
  from trime_jax.mt import decode

  old = {"mode": "knn_mt", "k": 8, "temperature": 30.0, "lam": 0.3, "tau": 1.0, "interp_lambda": 0.0,
         "interp_tau": 1.0, "candidates": 0}
  trime = {**old, "mode": "trime", "temperature": 10.0, "lam": 0.5, "tau": 2.0, "interp_lambda": 0.2,
           "interp_tau": 0.5}
  path = tmp_path / "tuned.json"
  path.write_text(json.dumps({"chosen": {"knn_mt": {"setting": old, "bleu": 1.0},
                                         "trime_interp": {"setting": trime, "bleu": 2.0}}}))
  assert decode.Distribution.from_tuned(str(path), "knn_mt") == decode.Distribution(
      "knn_mt", k=8, knn_mt_temperature=30.0, knn_lambda=0.3)
  assert decode.Distribution.from_tuned(str(path), "trime_interp") == decode.Distribution(
      "trime", k=8, tau=2.0, knn_lambda=0.2, tau_prime=0.5)
  # Today's settings read back as they were written; the λ default follows the mode.
  for dist in (decode.Distribution("knn_mt", k=4), decode.Distribution("trime", k=4, knn_lambda=0.1)):
    assert decode.Distribution.from_setting(dataclasses.asdict(dist)) == dist
  assert (decode.Distribution("knn_mt").knn_lambda, decode.Distribution("trime").knn_lambda) == (0.5, 0.0)
  with pytest.raises(ConfigError, match="knn_lambda"):
    decode.Distribution("trime", knn_lambda=1.0)
