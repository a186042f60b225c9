# Save the datastore's values (all) and its first 1,000 keys as a compact fixture (helper, not part of TRIME).
# usage: python save_dstore_fixture.py DSTORE_PREFIX SIZE DIM OUT.npz
import sys
import numpy as np
prefix, size, dim, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
keys = np.memmap(prefix + '_keys.npy', dtype=np.float32, mode='r', shape=(size, dim))
vals = np.memmap(prefix + '_vals.npy', dtype=np.int64, mode='r', shape=(size, 1))  # np.int == int64
np.savez_compressed(out, vals=vals[:, 0].astype(np.int32), keys_first1000=np.array(keys[:1000], dtype=np.float32),
                    size=np.int64(size), dim=np.int64(dim),
                    note=np.array('TRAIN-split datastore of trime.pt (eval_lm.py --save-knnlm-dstore, 64/64 windows, '
                                  'max-sentences 8, fp32 keys = last_ffn_input). vals[i] = train stream token 64+i.'))
print('saved', out, vals.shape, keys.shape)
