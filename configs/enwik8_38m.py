"""enwik8, 38M TrimeLM_long (paper Table "model_config", column 4). Byte-level, vocabulary 256.

Needs enwik8 (not available offline here): the raw 100M-byte file at data/enwik8/enwik8, split
90M / 5M / 5M as is standard. Consecutive batching: runs of 24 consecutive segments of the byte stream, read
in order as the original's --keep-order.
"""

from configs import default


def get_config():
  c = default.get_config()
  c.data.corpus = "bytes"  # raw bytes, vocabulary 256
  c.data.path = "data/enwik8/enwik8"  # the unzipped enwik8 file
  c.data.split_fractions = (0.9, 0.05, 0.05)  # 90M / 5M / 5M bytes
  c.data.segment_len = 512  # L (training)
  c.data.segmentation = "stream"  # fairseq --sample-break-mode none (consecutive batching reads the stream)
  c.model.vocab_size = 256  # bytes
  c.model.num_layers = 12  # layers
  c.model.d_model = 512  # hidden dimension
  c.model.num_heads = 8  # heads
  c.model.d_ff = 2048  # FFN inner dimension
  c.model.max_len = 512  # training segments and evaluation blocks
  c.model.dropout = 0.1  # residual dropout
  c.model.dtype = "bfloat16"  # accelerator compute dtype
  c.trime.memory = "long"  # TrimeLM_long
  c.trime.batching = "consecutive"  # runs of m consecutive stream segments
  c.trime.consecutive_layout = "stream"  # the original's in-order runs
  c.trime.batch_plan = "data/enwik8/plans/consecutive_512x24"  # from launch/make_batches.py
  c.trime.consecutive_segments = 24  # m: 24 × 512 = 12,288 in-batch memories
  c.train.batch_size = 24  # segments per forward
  c.train.grad_accum = 4  # 96 segments = 49,152 tokens per update
  c.train.num_steps = 400_000  # updates
  c.train.optimizer = "adam"  # Adam
  c.train.learning_rate = 2.5e-4  # peak
  c.train.schedule = "cosine"  # cosine, no warm-up
  c.train.warmup_steps = 0  # none (paper)
  c.train.min_lr = 1e-6  # cosine floor
  c.train.log_every = 100  # metric lines
  c.train.checkpoint_every = 2000  # orbax checkpoints
  c.train.eval_max_tokens = 200_000  # periodic dev evaluation subset
  c.eval.block_len = 512  # model input at evaluation
  c.eval.context_window = 432  # scored bytes per block: 80 (the paper's evaluation segment length)
  c.eval.batch_size = 16  # blocks per forward
  return c
