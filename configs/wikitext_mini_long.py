"""TrimeLM_long on wikitext-mini: consecutive batching (b = 2 articles × m = 4 consecutive segments of 256
tokens per batch of B = 8), long-term memory at training and evaluation.

  python -m launch.make_batches --config=configs/wikitext_mini_long.py --kind=consecutive \
      --out=runs/plans/wikitext_mini_long
  python -m launch.train --config=configs/wikitext_mini_long.py --workdir=runs/wikitext_mini_long
"""

from configs import wikitext_mini


def get_config():
  c = wikitext_mini.get_config()
  c.data.segmentation = "document"  # a segment never crosses an article boundary (runs are one article)
  c.trime.memory = "long"  # a token sees every earlier token of its article's run of m segments
  c.trime.batching = "consecutive"  # batches from the plan below (launch/make_batches.py)
  c.trime.batch_plan = "runs/plans/wikitext_mini_long"  # relative to the repo root
  c.trime.consecutive_segments = 4  # m: up to 4 × 256 = 1,024 tokens of memory per article in training
  c.eval.mem_size = 8192  # long-term memory at evaluation: whole articles (dev optimum, docs/long_memory.md)
  c.eval.temperature = 1.25  # τ tuned on dev for the 1000-update model with long-term memory
  return c
