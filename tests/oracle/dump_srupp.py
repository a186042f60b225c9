# SRU++ oracle: the ORIGINAL enwik8 SRU++ LM (asappresearch/sru @ branch 3.0.0-dev-tao,
# experiments/srupp_experiments/train_enwik8.py `Model`, sru/modules.py `SRUpp`), tiny, evaluated on CPU exactly as
# its `eval_model` does (model.eval(), set_mask(unroll, same_length=True), hidden and memory carried from segment
# to segment): per-token losses of three consecutive segments, with the weights and inputs, for
# tests/test_oracle_srupp.py. Nothing here is part of trime-jax's package code, nor copied from the original: the
# Model is imported from the original's own script.
# usage: PYTHONPATH=$SRU:$SRU/experiments/srupp_experiments python dump_srupp.py OUT.npz
import argparse
import sys

import numpy as np
import torch

import types

# the script imports its optimizer from a file of another repository (LiyuanLucasLiu/RAdam's radam.py), which
# evaluation never calls: a placeholder module stands in for that import only
sys.modules.setdefault('radam', types.SimpleNamespace(RAdam=None))
import train_enwik8 as orig  # noqa: E402  the original script (imports sru.SRUpp); its main() is not run

out = sys.argv[1]
V, T, B, UNROLL = 20, 48, 2, 16
args = argparse.Namespace(n_d=32, depth=3, n_proj=8, bias=-2.0, dropout=0.1, attn_dropout=0.0, attn_heads=1,
                          layer_norm=True,  # the tao README's commands pass it (it picks the U(±√(3/d)) init)
                          attn_every_n_layers=2, unroll_size=UNROLL, eval_unroll_size=UNROLL)
orig.set_seed(0)
model = orig.Model(list(range(V)), args)
with torch.no_grad():  # alpha (rezero) starts at 0: set it so the attention term is exercised
    for name, p in model.named_parameters():
        if name.endswith('alpha'):
            p.fill_(0.7)
rng = np.random.RandomState(0)
stream = rng.randint(0, V, size=(T + 1, B))
x, y = torch.from_numpy(stream[:-1].copy()), torch.from_numpy(stream[1:].copy())
# eval_model's loop, its per-token losses kept
with torch.no_grad():
    model.eval()
    model.set_mask(UNROLL, same_length=True)
    hidden = model.init_hidden(B)
    memory = [None] * args.depth
    losses = []
    for i in range((T - 1) // UNROLL + 1):
        loss, hidden, memory = model(x[i * UNROLL:(i + 1) * UNROLL], y[i * UNROLL:(i + 1) * UNROLL], hidden,
                                     memory=memory)
        losses.append(loss.numpy().copy())
print(model)
state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
np.savez_compressed(out, x=stream[:-1].astype(np.int32), y=stream[1:].astype(np.int32),
                    loss=np.concatenate(losses).astype(np.float32), final_c=hidden.numpy(),
                    **{'param/' + k: v for k, v in state.items()})
print('saved', out, 'mean loss', float(np.concatenate(losses).mean()), 'params', sorted(state))
