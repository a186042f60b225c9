"""Train-step time of SRU++ vs the Transformer at (about) equal parameter count, one run, steps interleaved.

Both take a TrimeLM_long step on the same B × L byte batch: SRU++ with its carry (state + the previous
segment's keys as extra memory, `steps.previous_segment_nll`), the Transformer with runs of 4 consecutive
segments in the batch (`loss.trime_nll(memory="long")`). Plain-CE steps are timed too.

  python -m bench.srupp_vs_transformer [--repeats=10]                # CPU: configs/bytes_srupp.py shapes
  python -m bench.srupp_vs_transformer --settings=enwik8 --repeats=5  # enwik8 shapes (accelerator)
"""

import argparse
import functools

import jax
import numpy as np
import optax
from flax import nnx

from bench.common import time_interleaved
from trime_jax.configs import bytes_srupp, enwik8_38m, enwik8_srupp
from trime_jax import loss, steps
from trime_jax import model as model_lib
from trime_jax import specs


def _bytes(backbone):
  return bytes_srupp.get_config(backbone)


SETTINGS = {  # name -> (srupp config, transformer config, B, L)
    "cpu": [("bytes_srupp (d=232, d'=64, 5L) vs 2L D=128 Transformer", _bytes("srupp"), _bytes("transformer"), 16,
             128)],
    "enwik8": [("enwik8_srupp (43.0M) vs enwik8_38m Transformer (12L D=512)", enwik8_srupp.get_config(),
                enwik8_38m.get_config(), 16, 512)],
}


def step_fns(config, b, l, m, vocab=256):
  model = model_lib.build_model(specs.model_config(config, vocab_size=vocab), nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adam(1e-3)
  state = {"step": np.int32(0), "params": params, "opt_state": tx.init(params)}
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (1, b, l + 1))
  batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "drop_local": np.zeros((1, b), bool)}
  if model.stateful:
    state["carry"] = steps.init_train_carry(model, b, l)
    batch["reset"] = np.zeros((1, b), bool)  # every row continues: the previous segment's keys are memory
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  state, batch = jax.device_put((state, batch))
  key = jax.random.PRNGKey(0)
  fns = {}
  for name, use_trime in [("ce", False), ("trime_long", True)]:
    spec = steps.LossSpec(loss.ObjectiveSpec("long", consecutive_segments=m))
    fn = jax.jit(functools.partial(steps.train_step, graphdef, tx, spec, use_trime, False))
    fns[name] = functools.partial(fn, state, batch, key)  # same state every call: pure timing
  return n, fns


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--settings", choices=sorted(SETTINGS), default="cpu")
  args = ap.parse_args()
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), median of {args.repeats} "
        "interleaved steps\n")
  print("| setting | B × L | params SRU++ / Transformer | objective | SRU++ step (s) | Transformer step (s) | "
        "SRU++ ÷ Transformer |")
  print("|---|---|---|---|---|---|---|")
  for name, s_cfg, t_cfg, b, l in SETTINGS[args.settings]:
    t_cfg.model.max_len = max(t_cfg.model.max_len, l)
    n_s, fs = step_fns(s_cfg, b, l, 1)
    n_t, ft = step_fns(t_cfg, b, l, 4)
    t = time_interleaved({**{f"s_{k}": v for k, v in fs.items()}, **{f"t_{k}": v for k, v in ft.items()}},
                         repeats=args.repeats)
    for obj in ("ce", "trime_long"):
      print(f"| {name} | {b} × {l} | {n_s:,} / {n_t:,} | {obj} | {t['s_' + obj]:.4f} | {t['t_' + obj]:.4f} | "
            f"{t['s_' + obj] / t['t_' + obj]:.2f} |", flush=True)


if __name__ == "__main__":
  main()
