"""External memory for TrimeLM_ext / kNN-LM: a datastore of (key g(c), next token) pairs and a FAISS index.

  from trime_jax.datastore import Datastore, KnnIndex, build_datastore, build_index, rescore

  meta = build_datastore(export_dir, corpus, "runs/ds")     # resumable; keys float16 [N, D], values int32 [N]
  ds = Datastore("runs/ds")                                  # memory-mapped; refuses an incomplete build
  ds.check_checkpoint(export_dir)                            # same model / vocabulary / key dimension?
  subset_datastore("runs/ds", "runs/ds_1m", 1_000_000)      # the first 1M entries (size sweeps), no recompute
  build_index(ds)                                            # <ds>/index.faiss + index.faiss.json
  index = KnnIndex.load("runs/ds/index.faiss", datastore=ds, nprobe=32)
  scores, ids = index.search(queries_NxD, k=1024)            # raw inner products, best first
  exact, ids = rescore(ds, queries_NxD, ids)                 # exact q·k from the stored keys
  next_tokens = ds.values[ids]                               # the memories' targets x_j (mask ids < 0)

See `build.py` and `index.py` for the file formats and guarantees.
"""

from trime_jax.datastore.build import Datastore, build_datastore, subset_datastore
from trime_jax.datastore.index import KnnIndex, build_index, default_index_path, gpu_available, rescore

__all__ = ["Datastore", "KnnIndex", "build_datastore", "build_index", "default_index_path", "gpu_available", "rescore",
           "subset_datastore"]
