"""TrimeLM_long on wikitext-mini: consecutive batching (b = 2 runs × m = 4 consecutive segments of 256 tokens
per batch of B = 8), long-term memory at training and evaluation. Stream layout (the original's): the training
split is one stream cut into runs of 4 consecutive segments (crossing article boundaries), split into 2
contiguous streams read in order, so consecutive batches continue both streams; no padding but the stream's
last run (real-token fraction 0.996 here, printed by make_batches).

  python -m trime_jax.launch.make_batches --config=configs/wikitext_mini_long.py --kind=consecutive \\
      --out=runs/plans/wikitext_mini_long
  python -m trime_jax.launch.train --config=configs/wikitext_mini_long.py --workdir=runs/wikitext_mini_long
"""

from trime_jax.configs import wikitext_mini


def get_config():
  c = wikitext_mini.get_config()
  c.data.segmentation = "stream"  # fairseq --sample-break-mode none (consecutive batching reads the stream)
  c.trime.memory = "long"  # a token sees every earlier token of its run of m segments
  c.trime.batching = "consecutive"  # batches from the plan below (launch/make_batches.py)
  c.trime.consecutive_layout = "stream"  # packed: adjacent runs, shuffled, memory within each article
  c.trime.batch_plan = "runs/plans/wikitext_mini_long"  # relative to the repo root
  c.trime.consecutive_segments = 4  # m: up to 4 × 256 = 1,024 tokens of memory per run in training
  c.eval.mem_size = 8192  # long-term memory at evaluation: whole articles (dev optimum, docs/long_memory.md)
  c.eval.tau = 1.25  # τ tuned on dev for the 1000-update model with long-term memory
  return c
