# Dump whole-split per-token log-probabilities from the ORIGINAL TRIME scorer (princeton-nlp/TRIME @ 3350ca9,
# fairseq/sequence_scorer.py), for use as oracle fixtures by trime-jax's tests. Not part of TRIME itself.
#
# It replicates eval_lm-trime.py / fairseq_cli/eval_lm.py exactly: same option parser, same checkpoint-args
# override, same `tokens_per_sample -= context_window`, same LMContextWindowDataset, same batch iterator, and it calls
#   scorer.generate(models, sample)                       for `plain`        (eval_lm-trime.py --mode lm, == eval_lm.py)
#   scorer.trime_generate(models, sample, dstore=..., mode='gn', use_local=..., use_long=..., use_external=...,
#                         use_interp=...)                 for memory modes   (eval_lm-trime.py default --mode gn)
#   scorer.generate(models, sample, knn_dstore=dstore)    for kNN-LM         (eval_lm.py --knnlm)
# Each mode has its own SequenceScorer (its own long-term memory), its own parsed args and its own model copy.
# Several modes given on one command line run in lockstep over ONE shared window iterator (each gets a deep copy of
# every sample), which is what the original does per mode (the iterator/collater is deterministic).
#
# Faiss memoisation: modes that query the same index file with the same k share the search results of
# byte-identical query matrices within a window (a transparent cache in front of index.search; faiss is
# deterministic, so the results are identical to a fresh search). This only saves time when, e.g., ext_noint,
# ext+interp and kNN-LM run together.
#
# usage (run from anywhere; the original checkout must be importable):
#   PYTHONPATH=$ORIG python dump_scores.py --data $DATA --ckpt CKPT --ckpt-name trime --outdir OUT \
#       [--dstore-dir DIR] [--dstore-fp16-dir DIR] [--break-mode none|complete] [--max-windows N] MODE [MODE ...]
# MODE names: plain | local_T<t> | long_T<t>_mem<M> | ext_flat_noint_T<t>_mem<M> | ext_flat_T<t>_mem<M>_it<it>_l<l>
#             | ext_ivfpq_T<t>_mem<M>_it<it>_l<l> | ext_flatfp16_T<t>_mem<M>_it<it>_l<l> | knnlm_flat_k<K>_l<l>[_T<t>]
#             | knnlml2_{flat,ivfpq}_k<K>_l<l>[_T<t>] (kNN-LM over an L2 index, -|q - k|^2 recomputed)
# Output: OUT/scores_<ckpt-name>_<MODE>[_complete].npz (np.savez_compressed) with
#   logp       float32 [N]  natural-log prob of every scored target, in stream order (N = scored test tokens)
#   target     int32   [N]  the scored target ids (same order)   [only with --save-targets]
#   win_offset int64   [W]  offset in logp of each window's first scored token
#   win_count  int64   [W]  number of scored tokens in the window
#   win_ctx    int64   [W]  context length = index in the window input of the first scored token (start_indices)
#   win_width  int64   [W]  width of the window input tensor (context + block + right padding)
#   win_id     int64   [W]  sample id (block index) of the window
#   log2_loss, ppl  float64 scalars, from the float32 scores exactly as eval_lm(-trime).py prints them
#                   (float32 running sum of per-window float32 sums), ppl_f64 from a float64 sum
#   flags      str     the exact eval command-line arguments (paths replaced by placeholders)
import argparse, copy, os, re, sys, time, math
import numpy as np
import torch

ap = argparse.ArgumentParser()
ap.add_argument('--data', required=True)
ap.add_argument('--ckpt', required=True)
ap.add_argument('--ckpt-name', required=True)
ap.add_argument('--outdir', required=True)
ap.add_argument('--dstore-dir', default=None, help='dir with dstore_{keys,vals}.npy, knn_flat.index.ip, knn.index.ip')
ap.add_argument('--dstore-fp16-dir', default=None, help='dir with dstore-fp16_keys.npy, dstore_vals.npy, knn_flat.index.ip')
ap.add_argument('--dstore-size', type=int, default=217536)
ap.add_argument('--break-mode', default='none')
ap.add_argument('--max-tokens', type=int, default=128)
ap.add_argument('--context-window', type=int, default=64)
ap.add_argument('--max-windows', type=int, default=0, help='stop after N windows (0 = whole split)')
ap.add_argument('--save-targets', action='store_true')
ap.add_argument('--gen-subset', default='test')
ap.add_argument('modes', nargs='+')
cli = ap.parse_args()

from fairseq import checkpoint_utils, options, tasks, utils
from fairseq.data import LMContextWindowDataset
from fairseq.sequence_scorer import SequenceScorer
from fairseq.knnlm import KNN_Dstore

F = r'(\d+(?:\.\d+)?)'


def mode_args(name):
    """(kind, extra eval args) for a mode name."""
    def ext(index, T, M, fp16=False):
        d = cli.dstore_fp16_dir if fp16 else cli.dstore_dir
        a = ['--use-local', '--use-long', '--mem-size', M, '--softmax-temp', T,
             '--use-external', '--dstore-filename', os.path.join(d, 'dstore'), '--dstore-size', str(cli.dstore_size),
             '--probe', '32', '--faiss-metric-type', 'ip', '--no-load-keys', '--k', '1024', '--use-faiss-cpu',
             '--indexfile', os.path.join(d, index)]
        return a + (['--dstore-fp16'] if fp16 else [])
    if name == 'plain':
        return 'plain', []
    m = re.fullmatch(r'local_T' + F, name)
    if m:
        return 'trime', ['--use-local', '--softmax-temp', m[1]]
    m = re.fullmatch(r'long_T' + F + r'_mem(\d+)', name)
    if m:
        return 'trime', ['--use-local', '--use-long', '--mem-size', m[2], '--softmax-temp', m[1]]
    m = re.fullmatch(r'ext_flat_noint_T' + F + r'_mem(\d+)', name)
    if m:
        return 'trime', ext('knn_flat.index.ip', m[1], m[2])
    m = re.fullmatch(r'ext_(flat|ivfpq|flatfp16)_T' + F + r'_mem(\d+)_it' + F + r'_l' + F, name)
    if m:
        index = {'flat': 'knn_flat.index.ip', 'ivfpq': 'knn.index.ip', 'flatfp16': 'knn_flat.index.ip'}[m[1]]
        return 'trime', ext(index, m[2], m[3], fp16=(m[1] == 'flatfp16')) + [
            '--use-interp', '--interp-temp', m[4], '--lmbda', m[5]]
    m = re.fullmatch(r'knnlm_flat_k(\d+)_l' + F + r'(?:_T' + F + ')?', name)
    if m:
        # eval_lm.py --knnlm: KNN_Dstore.temp = --softmax-temp (default 1.0); IP index -> faiss scores used as-is
        # (knn_sim_func unset: dist_func returns the faiss inner products for metric 'ip').
        return 'knnlm', ['--knnlm', '--dstore-filename', os.path.join(cli.dstore_dir, 'dstore'),
                         '--dstore-size', str(cli.dstore_size), '--probe', '32', '--faiss-metric-type', 'ip',
                         '--no-load-keys', '--k', m[1], '--use-faiss-cpu', '--lmbda', m[2],
                         '--indexfile', os.path.join(cli.dstore_dir, 'knn_flat.index.ip'),
                         '--softmax-temp', m[3] or '1.0']
    m = re.fullmatch(r'knnlml2_(flat|ivfpq)_k(\d+)_l' + F + r'(?:_T' + F + ')?', name)
    if m:
        # eval_lm.py --knnlm over an L2 index (flat: IndexFlatL2, build_flat_index.py --l2; ivfpq: build_dstore.py
        # --dist l2), keys loaded: with metric 'l2' and knn_sim_func unset, dist_func recomputes -|q - k|^2 from
        # the stored keys (its default for L2).
        index = {'flat': 'knn_flat.index.l2', 'ivfpq': 'knn.index.l2'}[m[1]]
        return 'knnlm', ['--knnlm', '--dstore-filename', os.path.join(cli.dstore_dir, 'dstore'),
                         '--dstore-size', str(cli.dstore_size), '--probe', '32', '--faiss-metric-type', 'l2',
                         '--k', m[2], '--use-faiss-cpu', '--lmbda', m[3],
                         '--indexfile', os.path.join(cli.dstore_dir, index),
                         '--softmax-temp', m[4] or '1.0']
    raise SystemExit('unknown mode ' + name)


base = [cli.data, '--path', cli.ckpt, '--sample-break-mode', cli.break_mode, '--max-tokens', str(cli.max_tokens),
        '--context-window', str(cli.context_window), '--softmax-batch', '1024', '--max-sentences', '1',
        '--knn-keytype', 'last_ffn_input', '--cpu', '--num-workers', '0', '--gen-subset', cli.gen_subset]


class CachedIndex:
    """Transparent memo in front of a faiss index's search(): same index file, same k, byte-identical queries."""
    cache = {}
    hits = 0
    calls = 0

    def __init__(self, index, key):
        self.index, self.key = index, key

    def search(self, q, k):
        CachedIndex.calls += 1
        ck = (self.key, k, q.shape, q.tobytes())
        if ck in CachedIndex.cache:
            CachedIndex.hits += 1
            d, i = CachedIndex.cache[ck]
            return d.copy(), i.copy()
        d, i = self.index.search(q, k)
        CachedIndex.cache[ck] = (d.copy(), i.copy())
        return d, i


class Mode:
    def __init__(self, name):
        self.name = name
        self.kind, extra = mode_args(name)
        self.argv = base + extra
        pa = options.parse_args_and_arch(options.get_eval_lm_parser(), self.argv)
        task = tasks.setup_task(pa)
        models, args = checkpoint_utils.load_model_ensemble([cli.ckpt], arg_overrides=eval(pa.model_overrides),
                                                            task=task)
        # exactly eval_lm-trime.py / fairseq_cli/eval_lm.py
        for a in vars(pa).keys():
            if a not in {'self_target', 'future_target', 'past_target', 'tokens_per_sample',
                         'output_size_dictionary', 'add_bos_token'}:
                setattr(args, a, getattr(pa, a))
        args.keep_order = False
        args.tokens_per_sample -= args.context_window
        for m in models:
            m.make_generation_fast_()
            m.eval()
        self.models, self.args = models, args
        self.scorer = SequenceScorer(task.target_dictionary, args.softmax_batch, args=args)
        self.dstore = None
        if self.kind == 'knnlm' or args.use_interp or args.use_external:
            self.dstore = KNN_Dstore(args)
            self.dstore.index = CachedIndex(self.dstore.index, (os.path.realpath(args.indexfile), args.probe))
        self.scores, self.targets = [], []
        self.layout = []

    def step(self, sample):
        a = self.args
        if self.kind == 'plain':
            hypos = self.scorer.generate(self.models, sample)
        elif self.kind == 'knnlm':
            hypos = self.scorer.generate(self.models, sample, knn_dstore=self.dstore)
        else:
            hypos = self.scorer.trime_generate(self.models, sample, dstore=self.dstore, mode=a.mode,
                                               use_local=a.use_local, use_long=a.use_long,
                                               use_external=a.use_external, use_interp=a.use_interp)
        assert len(hypos) == 1
        h = hypos[0][0]
        ps = h['positional_scores'].float()
        self.scores.append(ps.numpy().astype(np.float32).copy())
        self.targets.append(h['tokens'].numpy().astype(np.int32).copy())


modes = [Mode(n) for n in cli.modes]
args0 = modes[0].args
for m in modes[1:]:
    for f in ['tokens_per_sample', 'context_window', 'sample_break_mode', 'max_tokens', 'max_sentences']:
        assert getattr(m.args, f) == getattr(args0, f), f

task = tasks.setup_task(args0)
task.load_dataset(args0.gen_subset)
dataset = task.dataset(args0.gen_subset)
print('Building LMContextWindowDataset w/ tokens_per_sample = %d' % args0.tokens_per_sample, flush=True)
dataset = LMContextWindowDataset(dataset=dataset, tokens_per_sample=args0.tokens_per_sample,
                                 context_window=args0.context_window, pad_idx=task.source_dictionary.pad())
itr = task.get_batch_iterator(
    dataset=dataset, max_tokens=args0.max_tokens or 36000, max_sentences=args0.max_sentences,
    max_positions=utils.resolve_max_positions(*[m.max_positions() for m in modes[0].models]),
    ignore_invalid_inputs=True, num_shards=args0.num_shards, shard_id=args0.shard_id,
    num_workers=args0.num_workers).next_epoch_itr(shuffle=False)

layout = []  # (offset, count, ctx, width, id)
off = 0
t0 = time.time()
for wi, sample in enumerate(itr):
    if cli.max_windows and wi >= cli.max_windows:
        break
    if 'net_input' not in sample:
        continue
    CachedIndex.cache.clear()
    for m in modes:
        m.step(copy.deepcopy(sample))
    cnt = modes[0].scores[-1].shape[0]
    for m in modes:
        assert m.scores[-1].shape[0] == cnt
        assert np.array_equal(m.targets[-1], modes[0].targets[-1])
    layout.append((off, cnt, int(sample['start_indices'][0]), int(sample['net_input']['src_tokens'].shape[1]),
                   int(sample['id'][0])))
    off += cnt
    if wi % 200 == 0:
        print('window %d  tokens %d  %.1fs  faiss calls %d hits %d' % (wi, off, time.time() - t0,
              CachedIndex.calls, CachedIndex.hits), flush=True)

lay = np.array(layout, dtype=np.int64).reshape(-1, 5)
os.makedirs(cli.outdir, exist_ok=True)


def sanitize(argv):
    rep = {cli.data: '$DATA', cli.ckpt: '$CKPT'}
    if cli.dstore_dir:
        rep[os.path.join(cli.dstore_dir, '')] = '$DSTORE/'
    if cli.dstore_fp16_dir:
        rep[os.path.join(cli.dstore_fp16_dir, '')] = '$DSTORE_FP16/'
    out = []
    for x in argv:
        for k, v in rep.items():
            x = x.replace(k, v)
        out.append(x)
    return ' '.join(out)


suffix = '' if cli.break_mode == 'none' else '_' + cli.break_mode
for m in modes:
    logp = np.concatenate(m.scores).astype(np.float32)
    tgt = np.concatenate(m.targets).astype(np.int32)
    # the original's printed number: score_sum (float32 tensor) += pos_scores.sum() per window
    score_sum = 0.
    for s in m.scores:
        score_sum += torch.from_numpy(s).sum()
    n = logp.shape[0]
    log2_loss = float(-score_sum / n / math.log(2))
    ppl = 2 ** log2_loss
    ppl64 = 2 ** (-logp.astype(np.float64).sum() / n / math.log(2))
    tool = {'plain': 'eval_lm-trime.py --mode lm', 'knnlm': 'eval_lm.py', 'trime': 'eval_lm-trime.py'}[m.kind]
    out = dict(logp=logp, win_offset=lay[:, 0], win_count=lay[:, 1], win_ctx=lay[:, 2], win_width=lay[:, 3],
               win_id=lay[:, 4], log2_loss=np.float64(log2_loss), ppl=np.float64(ppl), ppl_f64=np.float64(ppl64),
               flags=np.array(tool + ' ' + sanitize(m.argv)), checkpoint=np.array(cli.ckpt_name),
               mode=np.array(m.name))
    if cli.save_targets:
        out['target'] = tgt
    fn = os.path.join(cli.outdir, 'scores_%s_%s%s.npz' % (cli.ckpt_name, m.name, suffix))
    np.savez_compressed(fn, **out)
    print('%s: %d windows, %d tokens, Loss (base 2): %.4f, Perplexity: %.2f (f64 %.4f)  target_sum %d  -> %s' % (
        m.name, lay.shape[0], n, log2_loss, ppl, ppl64, int(tgt.astype(np.int64).sum()), fn), flush=True)
print('done in %.1fs; faiss calls %d, cache hits %d' % (time.time() - t0, CachedIndex.calls, CachedIndex.hits))
