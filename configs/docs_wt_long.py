"""docs-wt TrimeLM_long: consecutive batches (2 runs × m = 4 consecutive segments of 512 tokens), the stream
layout of the original; long-term memory at evaluation. Write the plan first (experiments/docs_wt.sh plans)."""

from trime_jax.configs import docs_wt


def get_config():
  c = docs_wt.get_config()
  c.trime.memory = "long"  # a token sees every earlier token of its run of m segments
  c.trime.batching = "consecutive"  # batches from the plan below (launch/make_batches.py --kind=consecutive)
  c.trime.consecutive_layout = "stream"  # the original's --keep-order stream
  c.trime.consecutive_segments = 4  # m: up to 2,048 tokens of memory per run in training
  c.trime.batch_plan = "runs/plans/docs_wt_long"  # relative to the repo root
  c.eval.mem_size = 8192  # long-term memory at evaluation (swept by experiments/docs_wt.sh)
  c.eval.reset_at_documents = False  # the original's store never resets
  return c
