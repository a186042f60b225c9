# Exact faiss.IndexFlatIP (or with --l2 IndexFlatL2) over a TRIME/kNN-LM datastore's keys (helper, not part of TRIME).
# usage: python build_flat_index.py DSTORE_PREFIX SIZE DIM OUT_INDEX [--fp16] [--l2]
#   fp32: keys = DSTORE_PREFIX_keys.npy (raw float32 memmap [SIZE, DIM])
#   fp16: keys = DSTORE_PREFIX-fp16_keys.npy (raw float16 memmap), cast to float32 exactly as build_dstore.py does
#         (`keys[...].astype(np.float32)`; faiss does not take fp16 vectors).
import sys
import numpy as np
import faiss

prefix, size, dim, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fp16 = '--fp16' in sys.argv[5:]
if fp16:
    keys = np.memmap(prefix + '-fp16_keys.npy', dtype=np.float16, mode='r', shape=(size, dim))
else:
    keys = np.memmap(prefix + '_keys.npy', dtype=np.float32, mode='r', shape=(size, dim))
x = np.ascontiguousarray(keys[:].astype(np.float32))
l2 = '--l2' in sys.argv[5:]
index = faiss.IndexFlatL2(dim) if l2 else faiss.IndexFlatIP(dim)
index.add(x)
faiss.write_index(index, out)
print('IndexFlatL2' if l2 else 'IndexFlatIP', dim, 'ntotal', index.ntotal, 'fp16 keys' if fp16 else 'fp32 keys', '->', out)
