"""Dump one TrimeMT training step of the ORIGINAL code (TRIME release, machine_translation/: its fairseq fork's
`transformer_iwslt_de_en` with --share-decoder-input-output-embed --decoder-normalize-before, and its criterion
trime_mt_loss --dist-func ip --temp 10 --topk-mem 8) on a tiny model: the parameters, a batch of four sentence
pairs, every target token's log-probability, the summed loss and every parameter's gradient, in float64, for
tests/test_oracle_mt_model.py.

Runs in the original's environment with machine_translation/ patched to import under Python 3.11
(tests/oracle/patches_mt.diff: dataclass defaults as default_factory; no numerics change) and a placeholder for
torch_scatter (imported by the decoder's datastore module, which this run never calls):

    cd /work/orig/TRIME/machine_translation && OMP_NUM_THREADS=1 PYTHONPATH=. \\
        /work/orig/venv/bin/python /work/main/tests/oracle/dump_mt_model.py OUT.npz
"""

import sys
import types

import numpy as np
import torch

sys.modules.setdefault("torch_scatter", types.SimpleNamespace(scatter=None))
from fairseq import options  # noqa: E402
from fairseq.criterions.trime_mt_loss import TrimeMTLoss  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.models.transformer import TransformerModel  # noqa: E402

out = sys.argv[1]
torch.manual_seed(0)
rng = np.random.RandomState(0)
src_dict, tgt_dict = Dictionary(), Dictionary()  # <s> 0, <pad> 1, </s> 2, <unk> 3, then the words
for d, letters in ((src_dict, "abcdefghijklmnop"), (tgt_dict, "ABCDEFGHIJKL")):
  for w in letters:
    d.add_symbol(w)
parser = options.get_training_parser()
args = options.parse_args_and_arch(parser, input_args=[
    "/nonexistent", "--arch", "transformer_iwslt_de_en", "--share-decoder-input-output-embed",
    "--decoder-normalize-before", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "4",
    "--decoder-attention-heads", "4", "--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.0",
    "--criterion", "trime_mt_loss", "--dist-func", "ip", "--temp", "10.0", "--topk-mem", "8",
    "--label-smoothing", "0.0", "--cpu"])
task = types.SimpleNamespace(args=args, source_dictionary=src_dict, target_dictionary=tgt_dict)
model = TransformerModel.build_model(args, task).double()
model.train()  # as in training (dropout 0)
crit = TrimeMTLoss(task, sentence_avg=False, label_smoothing=0.0)

PAD, EOS = tgt_dict.pad(), tgt_dict.eos()
src_lens, tgt_lens = [5, 3, 6, 4], [4, 6, 2, 5]  # with </s>
B, S, T = 4, max(src_lens), max(tgt_lens)
src = np.full((B, S), PAD, np.int64)  # left-padded, as fairseq's language-pair datasets by default
tgt = np.full((B, T), PAD, np.int64)  # right-padded
prev = np.full((B, T), PAD, np.int64)
for b in range(B):
  s = list(rng.randint(4, len(src_dict), size=src_lens[b] - 1)) + [EOS]
  y = list(rng.randint(4, len(tgt_dict), size=tgt_lens[b] - 1)) + [EOS]
  src[b, S - len(s):] = s
  tgt[b, :len(y)] = y
  prev[b, :len(y)] = [EOS] + y[:-1]  # fairseq's prev_output_tokens: </s> then the target shifted right
sample = {"net_input": {"src_tokens": torch.tensor(src), "src_lengths": torch.tensor(src_lens),
                        "prev_output_tokens": torch.tensor(prev)},
          "target": torch.tensor(tgt), "ntokens": int(sum(tgt_lens))}
loss, sample_size, _ = crit(model, sample)
net_output = model(**sample["net_input"])
lprobs, _ = crit.get_lprobs_and_target(model, net_output, sample)
loss.backward()
state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
grads = {k: p.grad.detach().numpy().copy() for k, p in model.named_parameters() if p.grad is not None}
print("loss", loss.item(), "sample_size", sample_size, "params", len(state), "grads", len(grads))
np.savez_compressed(out, src=src, src_lens=np.array(src_lens), tgt=tgt, prev=prev, pad=PAD, eos=EOS,
                    src_vocab=len(src_dict), tgt_vocab=len(tgt_dict), loss=loss.item(),
                    lprobs=lprobs.detach().numpy().reshape(B, T),
                    **{"param/" + k: v for k, v in state.items()}, **{"grad/" + k: v for k, v in grads.items()})
print("saved", out, sorted(state))
