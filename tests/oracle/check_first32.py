# Compare the first 32 windows of whole-split dumps with the shared oracle's token_scores_trime_first32.npz.
# usage: python check_first32.py SHARED_FIRST32.npz DUMP_DIR MODE [MODE ...]   (dumps made with --save-targets)
import sys
import numpy as np
ref = np.load(sys.argv[1])
bad = False
for mode in sys.argv[3:]:
    d = np.load('%s/scores_trime_%s.npz' % (sys.argv[2], mode))
    cnt = d['win_count'][:32]
    n = cnt.sum()
    rr = np.concatenate([ref['logp_' + mode][i, :cnt[i]] for i in range(32)])
    tt = np.concatenate([ref['target'][i, ref['start_idx'][i]:ref['start_idx'][i] + cnt[i]] for i in range(32)])
    diff = np.abs(d['logp'][:n] - rr).max()
    ok = diff < 1e-5 and np.array_equal(tt, d['target'][:n])
    bad |= not ok
    print(mode, n, 'max|diff|', diff, 'targets equal', np.array_equal(tt, d['target'][:n]))
sys.exit(1 if bad else 0)
