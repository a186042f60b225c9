"""Dump one training step of the ORIGINAL TRIME criteria (loss, logged values, every parameter's gradient).

Runs in the original release's environment (princeton-nlp/TRIME @ 3350ca9, fairseq fork; see
tests/oracle/README_criteria.md), NOT in trime-jax's:

    cd /work/orig/TRIME && OMP_NUM_THREADS=1 PYTHONPATH=/work/orig/TRIME \\
        /work/orig/venv/bin/python /work/main/tests/oracle/dump_criteria.py /work/main/tests/fixtures/oracle

Writes to OUT: criteria.npz (the cases), criteria_model.pt (the model in the release's checkpoint format:
{"args": Namespace, "model": state_dict}) and criteria_dict.txt (its fairseq dictionary).

The model is a tiny transformer_lm of the 247M's kind (--arch transformer_lm_wiki103 at toy size: tied adaptive
input + adaptive softmax with two tail clusters and tied projections, pre-LN, no final norm, sinusoidal
positions, --knn-keytype last_ffn_input), dropout 0, trained for a few CE steps so that it is not random. Every
case evaluates the criterion objects of fairseq/criterions/*.py on the same parameters (float32 values, run in
float64 with model.double()) and a fixed batch of consecutive stream segments of WikiText-2 text (the oracle's
TRAIN split), then backpropagates the summed loss and divides by sample_size, as fairseq's trainer does.
"""

import argparse
import collections
import copy
import json
import math
import os
import random
import sys
import types

import numpy as np
import torch

from fairseq.criterions import trime_ext_loss, trime_long_loss, trime_long_loss_same_device, trime_loss
from fairseq.data import Dictionary
from fairseq.models.transformer_lm import TransformerLanguageModel

TEXT = "/work/shared/data/wikitext-2/wiki.valid.tokens"  # the oracle's TRAIN split (NOTES.md)
BASE_CKPT = "/work/shared/oracle/trime.pt"  # only its args Namespace is used (the fork's full flag set)
N_WORDS = 188  # dictionary: 4 specials + the 188 most frequent words (everything else is <unk>): V = 192
CUTOFFS = "24,64"  # head: 24 symbols + 2 cluster tokens; tails of 40 and 128 words
TAIL_PAD_WORDS = (25, 65)  # tail-relative index 1 = fairseq's padding_idx: the criteria's F.cross_entropy(
#   ignore_index=pad) drops these words' tail term; the batch is chosen to contain both as targets
FACTOR = 2
D, FFN, HEADS, LAYERS = 16, 32, 2, 2
B, L = 4, 32  # one forward: 4 consecutive stream segments of 32 tokens
OFFSET0 = 2048  # the fixture batch: the first stream position >= this (step 32) whose targets hold
#   TAIL_PAD_WORDS and at least one target of each tail
WARM_STEPS = 40  # CE steps that make the model non-random (on stream blocks after the fixture batch)
SEED = 1


def read_stream():
  words = []
  with open(TEXT, encoding="utf-8") as f:
    for line in f:
      words.extend(line.split())
      words.append("</s>")
  return words


def build_dictionary(words, path):
  counts = collections.Counter(w for w in words if w not in ("</s>", "<unk>"))
  top = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:N_WORDS]]
  with open(path, "w", encoding="utf-8") as f:
    for w in top:
      f.write(f"{w} {counts[w]}\n")
  return Dictionary.load(path)


def model_args():
  args = copy.deepcopy(torch.load(BASE_CKPT, map_location="cpu", weights_only=False)["args"])
  upd = dict(arch="transformer_lm_wiki103", decoder_layers=LAYERS, decoder_embed_dim=D, decoder_input_dim=D,
             decoder_output_dim=D, decoder_ffn_embed_dim=FFN, decoder_attention_heads=HEADS,
             adaptive_input=True, adaptive_input_cutoff=CUTOFFS, adaptive_softmax_cutoff=CUTOFFS,
             adaptive_input_factor=FACTOR, adaptive_softmax_factor=FACTOR, tie_adaptive_weights=True,
             tie_adaptive_proj=True, no_decoder_final_norm=True, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, adaptive_softmax_dropout=0.0, tokens_per_sample=L, max_target_positions=L,
             max_tokens=B * L, max_tokens_valid=B * L, num_comb_shards=1, distributed_world_size=1,
             knn_keytype="last_ffn_input", temp=1.0, ce_warmup_epoch=0, cross_sent_ratio=None, seed=SEED,
             criterion="trime_loss")
  for k, v in upd.items():
    setattr(args, k, v)
  return args


def encode(words, d):
  return np.array([d.index(w) for w in words], np.int64)


def sample_of(stream, start, b=B, l=L):
  """fairseq LM training blocks (--sample-break-mode none): target = stream[start:start+b*l], source = the
  stream shifted right by one."""
  tgt = stream[start:start + b * l].reshape(b, l)
  src = stream[start - 1:start - 1 + b * l].reshape(b, l)
  return {"id": torch.arange(b), "nsentences": b, "ntokens": b * l,
          "net_input": {"src_tokens": torch.from_numpy(src), "src_lengths": torch.full((b,), l)},
          "target": torch.from_numpy(tgt)}


def warm_up(model, stream, args):
  """A few Adam steps of plain CE (trime_loss with return_ce_loss) on blocks after the fixture batch."""
  crit = trime_loss.TrimeLoss(args, TASK)
  crit.return_ce_loss = True
  opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
  rng = np.random.default_rng(SEED)
  for _ in range(WARM_STEPS):
    start = int(rng.integers(OFFSET + 8 * B * L, len(stream) - B * L - 1))
    loss, n, _ = crit(model, sample_of(stream, start))
    opt.zero_grad()
    (loss / n).backward()
    opt.step()


def grads_of(model):
  return {k: (p.grad.detach().numpy().copy() if p.grad is not None else np.zeros(p.shape)) for k, p in
          model.named_parameters()}


def run_case(model, crit, sample):
  """One process: loss, sample_size, logging output and gradients of sum-loss / sample_size (fairseq trainer)."""
  model.zero_grad()
  loss, n, log = crit(model, sample)
  (loss / n).backward()  # fairseq: backward of the summed loss, then multiply_grads(world_size / sample_size)
  return {"loss": float(loss.detach()) / n, "ori_loss": float(log["ori_loss"]) / n, "sample_size": n,
          "grads": grads_of(model)}


class FakeWorld:
  """torch.distributed inside one process: rank r of W ranks, each with its own sample. `all_gather` hands back
  the other ranks' tensors (recorded in a first pass) detached, exactly what NCCL's all_gather gives the
  criteria's `my_gather` (no autograd edge to other GPUs); the own entry is replaced by the live tensor there."""

  def __init__(self, world):
    self.world, self.rank, self.calls, self.record = world, 0, 0, None
    self.recorded = {}

  def patch(self, module):
    dist = types.SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: self.world,
                                 get_rank=lambda: self.rank, all_gather=self.all_gather)
    module.dist = dist

  def all_gather(self, tensor_list, tensor):
    i = self.calls
    self.calls += 1
    if self.record:
      self.recorded[(self.rank, i)] = tensor.detach().clone()
      for t in tensor_list:
        t.copy_(tensor.detach())
      return
    for r, t in enumerate(tensor_list):
      t.copy_(self.recorded[(r, i)])


def run_world(model, make_crit, samples, module, coins=None):
  """W ranks (DDP): gradients summed over ranks, divided by the summed sample_size (fairseq trainer)."""
  world = FakeWorld(len(samples))
  world.patch(module)
  try:
    for record in (True, False):
      world.record = record
      model.zero_grad()
      total_loss, total_n, total_ori = 0.0, 0, 0.0
      losses = []
      for r, s in enumerate(samples):
        world.rank, world.calls = r, 0
        crit = make_crit()
        if coins is not None:
          crit_random = module.random
          module.random = types.SimpleNamespace(random=lambda c=coins[r]: c)
        loss, n, log = crit(model, s)
        if coins is not None:
          module.random = crit_random
        if not record:
          loss.backward()
        total_loss += float(loss.detach())
        total_ori += float(log["ori_loss"])
        total_n += n
        losses.append(float(loss.detach()))
    g = grads_of(model)
    g = {k: v / total_n for k, v in g.items()}
  finally:
    module.dist = torch.distributed
  return {"loss": total_loss / total_n, "ori_loss": total_ori / total_n, "sample_size": total_n, "grads": g,
          "rank_loss": np.array(losses)}


def main():
  out = sys.argv[1]
  os.makedirs(out, exist_ok=True)
  torch.manual_seed(SEED)
  random.seed(SEED)
  words = read_stream()
  dpath = os.path.join(out, "criteria_dict.txt")
  d = build_dictionary(words, dpath)
  global TASK
  TASK = types.SimpleNamespace(source_dictionary=d, target_dictionary=d, args=None)
  stream = encode(words, d)
  global OFFSET
  lo, mid = (int(c) for c in CUTOFFS.split(","))
  for OFFSET in range(OFFSET0, len(stream), 32):
    t = stream[OFFSET:OFFSET + B * L]
    if all((t == w).any() for w in TAIL_PAD_WORDS) and ((t >= lo) & (t < mid)).any() and (t >= mid).any():
      break
  args = model_args()
  model = TransformerLanguageModel.build_model(args, TASK)
  warm_up(model, stream, args)
  # The checkpoint (float32, the release's format) and the float64 copy every case runs on.
  sd = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
  torch.save({"args": args, "model": sd}, os.path.join(out, "criteria_model.pt"))
  model.load_state_dict(sd)
  model = model.double()
  model.train()

  sample = sample_of(stream, OFFSET)
  src, tgt = sample["net_input"]["src_tokens"].numpy(), sample["target"].numpy()
  res, meta = {}, {}

  def put(name, r, **extra):
    res[f"{name}/loss"] = np.float64(r["loss"])
    res[f"{name}/ori_loss"] = np.float64(r["ori_loss"])
    res[f"{name}/sample_size"] = np.int64(r["sample_size"])
    for k, v in r["grads"].items():
      res[f"{name}/grad/{k}"] = v.astype(np.float32)
    for k, v in extra.items():
      res[f"{name}/{k}"] = v
    if "rank_loss" in r:
      res[f"{name}/rank_loss"] = r["rank_loss"]
    gn = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in r["grads"].values()))
    res[f"{name}/grad_norm"] = np.float64(gn)
    meta[name] = dict(loss_bits=r["loss"] / math.log(2), ori_loss_bits=r["ori_loss"] / math.log(2), grad_norm=gn,
                      **{k: np.asarray(v).tolist() for k, v in extra.items()})
    print(name, json.dumps(meta[name]))

  def crit_of(cls, **over):
    a = copy.deepcopy(args)
    for k, v in over.items():
      setattr(a, k, v)
    return cls(a, TASK)

  # 1. trime_loss (TrimeLM): local memory, previous tokens of the same segment.
  put("local", run_case(model, crit_of(trime_loss.TrimeLoss), sample))
  # 2. CE warm-up: fairseq_cli/train.py sets criterion.return_ce_loss = True while epoch <= --ce-warmup-epoch.
  c = crit_of(trime_loss.TrimeLoss, ce_warmup_epoch=1)
  c.return_ce_loss = True
  put("ce_warmup", run_case(model, c, sample))
  # 3. trime_long_loss (TrimeLM_long), one process: mem_size = max_tokens * num_comb_shards = B*L, num_docs = 1:
  #    the batch's 4 consecutive segments are one run, every token sees every earlier token of the run.
  put("long", run_case(model, crit_of(trime_long_loss.TrimeLongLoss, keep_order=True, train_mem_size=B * L,
                                      criterion="trime_long_loss"), sample))
  # 4. trime_long_loss_same_device (the 150M and enwik8 scripts): the same memory, computed without my_gather.
  put("long_same_device", run_case(model, crit_of(trime_long_loss_same_device.TrimeLongLoss_same_device,
                                                  keep_order=True, criterion="trime_long_loss_same_device"), sample))
  # 5. trime_ext_loss (TrimeLM_ext), one process: every token of the other 3 segments + earlier tokens of its own
  #    unless the forward's single coin (random.random() < --cross-sent-ratio) drops local memory for ALL the
  #    forward's segments. The coin is recorded by wrapping the module's random.random.
  for ratio, name in ((0.9, "ext_p0.9"), (0.0, "ext_p0"), (1.0, "ext_p1")):
    drawn = []
    orig_random = trime_ext_loss.random
    trime_ext_loss.random = types.SimpleNamespace(random=lambda: drawn.append(orig_random.random()) or drawn[-1])
    try:
      random.seed(SEED)
      r = run_case(model, crit_of(trime_ext_loss.TrimeExtLoss, cross_sent_ratio=ratio, criterion="trime_ext_loss"),
                   sample)
    finally:
      trime_ext_loss.random = orig_random
    assert len(drawn) == 1, drawn
    drop = np.full((B,), drawn[0] < ratio)  # one coin for the whole forward (all its segments)
    put(name, r, coin=np.float64(drawn[0]), drop_local=drop)
  # 6. trime_ext_loss without --cross-sent-ratio (None): local memory always on (= ratio 0).
  put("ext_none", run_case(model, crit_of(trime_ext_loss.TrimeExtLoss, criterion="trime_ext_loss"), sample))

  # 7. Four GPUs (DDP, simulated in one process: FakeWorld), one segment per GPU as the 247M scripts
  #    (--max-tokens 3072 = --tokens-per-sample). Rank r holds segment r of the batch.
  ranks = [sample_of(stream, OFFSET + r * L, b=1) for r in range(B)]
  #    trime_ext_loss, --cross-sent-ratio 0.9: one coin per GPU; fixed coins [0.95, 0.3, 0.5, 0.99] (drop on
  #    ranks 1 and 2) so that both outcomes occur; memory = all 4 segments (gathered), keys of other GPUs detached.
  coins = [0.95, 0.3, 0.5, 0.99]
  r = run_world(model, lambda: crit_of(trime_ext_loss.TrimeExtLoss, cross_sent_ratio=0.9, max_tokens=L,
                                       distributed_world_size=B, criterion="trime_ext_loss"),
                ranks, trime_ext_loss, coins=coins)
  put("ext_4gpu", r, coin=np.array(coins), drop_local=np.array(coins) < 0.9)
  #    trime_long_loss with --train-mem-size = 4 * --max-tokens: num_comb_shards 4, num_docs 1: the 4 GPUs'
  #    consecutive segments are one run (SequentialShardedIterator), gathered; keys of other GPUs detached.
  r = run_world(model, lambda: crit_of(trime_long_loss.TrimeLongLoss, max_tokens=L, distributed_world_size=B,
                                       num_comb_shards=B, train_mem_size=B * L, keep_order=True,
                                       criterion="trime_long_loss"), ranks, trime_long_loss)
  put("long_4gpu", r)

  for k, v in sd.items():  # the checkpoint's tensors, so that the test needs no torch to read them
    res[f"param/{k}"] = v.numpy()
  res["flags"] = np.array(json.dumps({k: v for k, v in vars(args).items()
                                      if isinstance(v, (str, int, float, bool, type(None)))}))
  res["src_tokens"] = src
  res["target"] = tgt
  res["meta"] = np.array(json.dumps(dict(B=B, L=L, offset=OFFSET, dict_words=N_WORDS, cutoffs=CUTOFFS, factor=FACTOR,
                                         d=D, ffn=FFN, heads=HEADS, layers=LAYERS, warm_steps=WARM_STEPS, seed=SEED,
                                         torch=torch.__version__, cases=meta)))
  np.savez_compressed(os.path.join(out, "criteria.npz"), **res)
  print("wrote", out, sum(v.nbytes for v in res.values()), "bytes")


if __name__ == "__main__":
  main()
