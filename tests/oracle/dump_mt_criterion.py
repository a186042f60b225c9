"""Dump the ORIGINAL TrimeMT criterion (TRIME release, machine_translation/fairseq/criterions/trime_mt_loss.py,
`TrimeMTLoss`: the in-batch memory of other sentences' target tokens, --topk-mem, --temp, --dist-func ip) on fixed
decoder outputs: per-token log-probabilities, the summed loss and its gradients with respect to the logits and
the keys, for tests/test_oracle_mt_criterion.py. The criterion is the original's own class, imported; only the
model is a stand-in (`get_normalized_probs` = log_softmax of the logits, as fairseq's decoder without an adaptive
softmax; `get_targets` = sample["target"]), so what is compared is the criterion's arithmetic and masking.

    cd /work/orig/TRIME/machine_translation && OMP_NUM_THREADS=1 PYTHONPATH=. \\
        /work/orig/venv/bin/python /work/main/tests/oracle/dump_mt_criterion.py OUT.npz

"""

import argparse
import sys
import types

import numpy as np
import torch
import torch.nn.functional as F

# This fork of fairseq does not import under Python 3.11 (its dataclass configs have mutable defaults), so the
# criterion's own file is loaded alone, executed as it is, with stand-ins for the three names it imports from
# fairseq: register_criterion (a registry decorator), metrics / utils (used by its logging only), and
# FairseqCriterion, whose __init__ the stand-in restates (fairseq/criterions/fairseq_criterion.py: self.task,
# self.padding_idx = task.target_dictionary.pad()).
import importlib.util
import os


class FairseqCriterion(torch.nn.Module):
  def __init__(self, task):
    super().__init__()
    self.task = task
    self.padding_idx = task.target_dictionary.pad()


fairseq = types.ModuleType("fairseq")
fairseq.metrics, fairseq.utils = types.ModuleType("fairseq.metrics"), types.ModuleType("fairseq.utils")
fairseq.criterions = types.ModuleType("fairseq.criterions")
fairseq.criterions.FairseqCriterion = FairseqCriterion
fairseq.criterions.register_criterion = lambda name: (lambda cls: cls)
for m in (fairseq, fairseq.metrics, fairseq.utils, fairseq.criterions):
  sys.modules[m.__name__] = m
_path = os.path.join(os.getcwd(), "fairseq", "criterions", "trime_mt_loss.py")  # run from machine_translation/
_spec = importlib.util.spec_from_file_location("trime_mt_loss", _path)
trime_mt_loss = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trime_mt_loss)
TrimeMTLoss = trime_mt_loss.TrimeMTLoss

PAD = 1  # fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3
out = sys.argv[1]
rng = np.random.RandomState(0)
B, L, V, D = 4, 7, 12, 16
lengths = [7, 5, 3, 6]  # target lengths (the rest padding)
target = np.full((B, L), PAD, np.int64)
for b, n in enumerate(lengths):
  target[b, :n] = rng.randint(2, V, size=n)  # eos / unk / words; small V: labels repeat across sentences
  target[b, n - 1] = 2  # each sentence ends with </s>
logits = rng.randn(B, L, V).astype(np.float64)
reps = (rng.randn(B, L, D) * 3.0).astype(np.float64)  # sims of a few units after /√D/temp... and /temp below

cases = {}
for name, temp, topk in (("topk8_temp10", 10.0, 8), ("topk3_temp1", 1.0, 3), ("all_temp2", 2.0, None)):
  task = types.SimpleNamespace(args=argparse.Namespace(dist_func="ip", temp=temp, topk_mem=topk),
                               target_dictionary=types.SimpleNamespace(pad=lambda: PAD))
  crit = TrimeMTLoss(task, sentence_avg=False, label_smoothing=0.0)
  lg = torch.tensor(logits, requires_grad=True)
  rp = torch.tensor(reps, requires_grad=True)
  model = types.SimpleNamespace(get_normalized_probs=lambda net_output, log_probs: F.log_softmax(net_output[0], -1),
                                get_targets=lambda sample, net_output: sample["target"])
  net_output = (lg, {"knn_embed": rp})
  sample = {"target": torch.tensor(target)}
  lprobs, _ = crit.get_lprobs_and_target(model, net_output, sample)
  loss, _ = crit.compute_loss(model, net_output, sample)
  loss.backward()
  cases[name] = dict(lprobs=lprobs.detach().numpy().reshape(B, L), loss=loss.item(), grad_logits=lg.grad.numpy(),
                     grad_reps=rp.grad.numpy(), temp=temp, topk=0 if topk is None else topk)
  print(name, "loss", loss.item())
np.savez_compressed(out, target=target, logits=logits, reps=reps, pad=PAD,
                    **{f"{c}/{k}": v for c, d in cases.items() for k, v in d.items()})
print("saved", out)
