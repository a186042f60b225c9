"""TrimeMT's training criterion against the original's: the TRIME release's
machine_translation/fairseq/criterions/trime_mt_loss.py (`TrimeMTLoss`, run by tests/oracle/dump_mt_criterion.py on
fixed decoder outputs: four target sentences of a 12-word vocabulary with padding, 16-dim keys) against
`loss.trime_nll_from_vocab_stats` with memory="ext", drop_local=True (the original's only_cross_sent: a sentence's
own tokens are never its memories), τ = --temp and memory_topk = --topk-mem, as trime_jax.mt.train.mt_nll calls it.
Per-token log-probabilities, the summed loss and its gradients with respect to the logits and the keys."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trime_jax import loss, scoring

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "mt_criterion.npz")
CASES = ("topk8_temp10", "topk3_temp1", "all_temp2")  # --topk-mem 8 --temp 10 is configs/iwslt_de_en.py's


@pytest.mark.parametrize("case", CASES)
def test_trime_mt_loss_equals_the_originals_per_token_and_its_gradients(case):
  """Every real target token's log-probability, the loss (a sum over real tokens, padding ignored) and d loss /
  d logits, d loss / d keys within 1e-9 (float64 both). The original masks with -10,000 (same sentence, padding)
  and, with --topk-mem, keeps the top k of the masked logits; ours excludes those memories: the same numbers."""
  fx = np.load(FIXTURE)
  pad = int(fx["pad"])
  target = np.where(fx["target"] == pad, -1, fx["target"])
  temp, topk = float(fx[f"{case}/temp"]), int(fx[f"{case}/topk"])
  spec = loss.ObjectiveSpec(memory="ext", tau=temp, memory_topk=topk)
  with jax.enable_x64(True):
    t = jnp.asarray(target)

    def nll(logits, reps):
      stats = scoring.vocab_stats(logits, t)
      return loss.trime_nll_from_vocab_stats(stats, reps, t, spec, drop_local=True)

    logits, reps = jnp.asarray(fx["logits"]), jnp.asarray(fx["reps"])
    per_token = np.asarray(nll(logits, reps))
    total = lambda lg, rp: jnp.where(t >= 0, nll(lg, rp), 0.0).sum()
    value, (g_logits, g_reps) = jax.value_and_grad(total, argnums=(0, 1))(logits, reps)
  real = target >= 0
  np.testing.assert_allclose(-per_token[real], fx[f"{case}/lprobs"][real], rtol=0, atol=1e-9)
  assert abs(float(value) - float(fx[f"{case}/loss"])) < 1e-9
  np.testing.assert_allclose(np.asarray(g_logits), fx[f"{case}/grad_logits"], rtol=0, atol=1e-9)
  np.testing.assert_allclose(np.asarray(g_reps), fx[f"{case}/grad_reps"], rtol=0, atol=1e-9)
