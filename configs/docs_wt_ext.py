"""docs-wt TrimeLM_ext: BM25 batches (Algorithm 1 as published), local memory dropped with p = 0.9, every other
segment of the batch is memory; evaluated with a datastore of the whole (held-out-free) training split.
Write the plan first (experiments/docs_wt.sh plans)."""

from trime_jax.configs import docs_wt


def get_config():
  c = docs_wt.get_config()
  c.trime.memory = "ext"  # in-batch external memory (other segments) + local memory
  c.trime.batching = "bm25"  # Algorithm 1 batches; trime.batching=random for the "w/o BM25" ablation
  c.trime.batch_plan = "runs/plans/docs_wt_bm25"  # launch/make_batches.py --kind=bm25
  c.trime.bm25_exclude_same_document = False  # Algorithm 1 as published
  c.trime.drop_local_prob = 0.9  # p
  c.eval.mem_size = 8192  # TrimeLM_ext is evaluated with local + long-term + external memory
  c.eval.reset_at_documents = False  # the original's store never resets
  c.eval.knn_k = 1024  # K retrieved per token
  c.eval.nprobe = 32  # IVF lists searched
  return c
