# Print the README's results table from the fixtures (helper).
import glob, os, sys
import numpy as np
fix = sys.argv[1]
print('| checkpoint | layout | mode | scored tokens | log2 loss | ppl (printed) | ppl (float64) | shared log | file size |')
print('|---|---|---|---|---|---|---|---|---|')
shared = {('trime', 'none', 'plain'): '1200.21', ('trime', 'none', 'local_T1.0'): '660.98',
          ('trime', 'none', 'long_T1.0_mem512'): '547.12', ('trime', 'none', 'ext_flat_T1.0_mem512_it10.5_l0.3'): '937.18',
          ('trime', 'none', 'ext_ivfpq_T1.0_mem512_it10.5_l0.3'): '941.87'}
for fn in sorted(glob.glob(os.path.join(fix, 'scores_*.npz')) + glob.glob(os.path.join(fix, 'ppl_*.npz'))):
    if fn.endswith('completeshort.npz'):  # not made by these scripts
        continue
    d = np.load(fn)
    ck, mode = str(d['checkpoint']), str(d['mode'])
    layout = 'complete' if fn.endswith('_complete.npz') else 'none'
    n = d['logp'].shape[0] if 'logp' in d else int(d['n_tokens'])
    print('| %s | %s | `%s` | %d | %.4f | %.2f | %.4f | %s | %d |' % (ck, layout, mode, n, d['log2_loss'], d['ppl'],
          d['ppl_f64'], shared.get((ck, layout, mode), '—'), os.path.getsize(fn)))
