# Shows what the original trime_generate does for targets whose id - cutoff[i] == pad (1), i.e. ids 2001 and 8001
# with --adaptive-softmax-cutoff 2000,8000: F.cross_entropy(tail, ..., ignore_index=pad) gives 0 for them, so the
# vocab term is the head cluster probability only. Compares the dumped local_T1.0 scores with both formulas.
# usage: PYTHONPATH=$ORIG python check_adaptive_tail_pad.py DATA ADAPTIVE_CKPT DUMP_local_T1.0.npz [DUMP_plain.npz]
import sys, math, numpy as np, torch, torch.nn.functional as F
from fairseq import checkpoint_utils, options, tasks, utils
from fairseq.data import LMContextWindowDataset
data, ckpt, dump = sys.argv[1:4]
plain = np.load(sys.argv[4])['logp'] if len(sys.argv) > 4 else None
pa = options.parse_args_and_arch(options.get_eval_lm_parser(), [data, '--path', ckpt, '--sample-break-mode', 'none',
     '--max-tokens', '128', '--context-window', '64', '--max-sentences', '1', '--knn-keytype', 'last_ffn_input', '--cpu'])
task = tasks.setup_task(pa)
models, args = checkpoint_utils.load_model_ensemble([ckpt], task=task)
model = models[0].eval()
for a in vars(pa).keys():
    if a not in {'self_target', 'future_target', 'past_target', 'tokens_per_sample', 'output_size_dictionary', 'add_bos_token'}:
        setattr(args, a, getattr(pa, a))
args.tokens_per_sample -= args.context_window
task = tasks.setup_task(args); task.load_dataset('test')
ds = LMContextWindowDataset(task.dataset('test'), args.tokens_per_sample, args.context_window, 1)
itr = task.get_batch_iterator(dataset=ds, max_tokens=128, max_sentences=1, max_positions=model.max_positions(),
                              ignore_invalid_inputs=True).next_epoch_itr(shuffle=False)
d = np.load(dump); logp = d['logp']; off = d['win_offset']
asm = model.decoder.adaptive_softmax
n = 0
with torch.no_grad():
    for w, s in enumerate(itr):
        tgt = s['target'][0]
        st = s['start_indices'][0]
        sel = [(t, int(tgt[t])) for t in range(st, len(tgt)) if int(tgt[t]) in (2001, 8001)]
        if not sel:
            continue
        out, extra = model(**s['net_input'])
        h = out[0]
        head = asm.head(h)                                    # [T, 2000 + 2]
        reps = extra['last_ffn_input'][:, 0]                  # [T, d]
        lab = tgt.clone(); v = s['net_input']['src_tokens'][0].roll(-1); lab[tgt == 1] = v[tgt == 1]
        T = len(tgt)
        loc = reps @ reps.T / math.sqrt(reps.shape[-1]) + torch.triu(torch.ones(T, T), 0) * -10000.0
        for t, y in sel:
            c = 0 if y < 8000 else 1
            lo = 2000 if c == 0 else 8000
            tail_lp = F.log_softmax(asm.tail[c](h[t:t + 1]), -1)[0, y - lo]
            z_cls = head[t, 2000 + c]
            norm_t = torch.logsumexp(head[t], -1)
            ctx = torch.logsumexp(loc[t] + (lab != y) * -10000.0, -1)
            norm_c = torch.logsumexp(loc[t], -1)
            den = torch.logsumexp(torch.stack([norm_t, norm_c]), 0)
            full = torch.logsumexp(torch.stack([z_cls + tail_lp, ctx]), 0) - den
            headonly = torch.logsumexp(torch.stack([z_cls, ctx]), 0) - den
            got = logp[off[w] + t - st]
            print('window %d pos %d target %d: local dump %.6f | with tail term %.6f | head-cluster only %.6f' % (
                w, t, y, got, full, headonly), end='')
            if plain is not None:  # plain `generate` uses get_log_prob: full log p = log p_head(cluster) + log p_tail
                print(' || plain dump %.6f | full log-softmax %.6f' % (plain[off[w] + t - st],
                      z_cls - norm_t + tail_lp), end='')
            print()
            n += 1
print(n, 'positions')
