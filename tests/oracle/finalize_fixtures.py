# Copy the dumps into tests/fixtures/oracle, keeping the (identical) target ids in only one file per window layout.
# usage: python finalize_fixtures.py DUMP_DIR FIXTURE_DIR
import glob, os, sys
import numpy as np
src, dst = sys.argv[1], sys.argv[2]
pattern = sys.argv[3] if len(sys.argv) > 3 else 'scores_*.npz'
# (IVF-PQ's per-token file is kept since the tests reuse the original's trained index: ivfpq_trained.index)
PPL_ONLY = set()
KEEP_TARGET = {'scores_trime_plain.npz', 'scores_trime_local_T1.0_complete.npz'}
ref = {}
lay = {}
for fn in sorted(glob.glob(os.path.join(src, pattern))):
    d = dict(np.load(fn))
    base = os.path.basename(fn)
    layout = 'complete' if base.endswith('_complete.npz') else 'none'
    L = np.stack([d['win_offset'], d['win_count'], d['win_ctx'], d['win_width'], d['win_id']])
    if layout in lay:
        assert np.array_equal(lay[layout], L), fn   # every mode of one break mode has the same windows
    else:
        lay[layout] = L
    if 'target' in d:
        if layout in ref:
            assert np.array_equal(ref[layout], d['target']), fn
        else:
            ref[layout] = d['target']
        if base not in KEEP_TARGET:
            del d['target']
    if base in PPL_ONLY:
        d = {k: d[k] for k in ['log2_loss', 'ppl', 'ppl_f64', 'flags', 'checkpoint', 'mode']}
        d['n_tokens'] = np.int64(L[1].sum())
        base = 'ppl_' + base[len('scores_'):]
    np.savez_compressed(os.path.join(dst, base), **d)
    print(base, os.path.getsize(os.path.join(dst, base)), 'ppl %.2f' % d['ppl'])
