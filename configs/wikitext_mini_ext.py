"""wikitext-mini TrimeLM_ext: every other segment of the batch is memory, BM25-packed batches, local memory
dropped with p = 0.9 (paper §4.3). Write the plan first:

  python -m trime_jax.launch.make_batches --config=configs/wikitext_mini_ext.py --kind=bm25 \\
      --out=runs/plans/wikitext_mini_bm25
"""

from trime_jax.configs import wikitext_mini


def get_config():
  c = wikitext_mini.get_config()
  c.trime.memory = "ext"  # in-batch external memory (other segments) + local memory
  c.trime.batching = "bm25"  # Algorithm 1 batches; --config.trime.batching=random for "w/o BM25 batching"
  c.trime.batch_plan = "runs/plans/wikitext_mini_bm25"  # from launch/make_batches.py --kind=bm25
  # 124 short articles: plain Algorithm 1 packs 65% same-article batch-mates (docs/external_memory.md)
  c.trime.bm25_exclude_same_document = True  # neighbours from other articles; False = Algorithm 1 as published
  c.trime.drop_local_prob = 0.9  # p: drop the local memory in 90% of batches
  return c
