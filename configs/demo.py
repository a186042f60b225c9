"""`make demo`: byte-level LM on the running interpreter's stdlib sources (no download, 2 CPU cores)."""

from trime_jax.configs import default


def get_config():
  c = default.get_config()
  c.data.corpus = "stdlib"  # real text that needs no download: Python standard-library sources
  c.data.max_files = 400  # fixed sorted sample of files, one document each
  c.data.segment_len = 256  # L
  c.model.num_layers = 3  # small enough to train in ~2 minutes on 2 cores
  c.model.d_model = 128  # D
  c.model.d_ff = 512  # FFN
  c.model.num_heads = 4  # heads
  c.model.max_len = 256  # = segment_len = eval block_len
  c.model.dropout = 0.0  # too few updates to overfit
  c.train.batch_size = 16  # 16 × 256 = 4,096 in-batch memories
  c.train.num_steps = 300  # updates per model
  c.train.learning_rate = 2e-3  # peak learning rate
  c.train.warmup_steps = 40  # linear warm-up
  c.train.eval_max_tokens = 20_000  # dev tokens in the final training-time evaluation
  c.eval.block_len = 256  # evaluation block
  c.eval.context_window = 128  # scored tokens per block: 128
  c.eval.max_tokens = 60_000  # held-out bytes scored by the demo table
  return c
