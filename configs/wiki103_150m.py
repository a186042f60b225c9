"""WikiText-103, 150M TrimeLM_long (paper Table "model_config", column 2; Transformer-XL-base shapes).

Consecutive batching: each forward holds a run of 60 consecutive segments of 150 tokens of the training
stream (9,000 in-batch memories, crossing documents, read in order as the original's --keep-order); write
the plan with `python -m launch.make_batches --kind=consecutive`. The paper's
adaptive softmax here has factor 1 (a full-size embedding), so a full tied softmax has the same size.
"""

from configs import default


def get_config():
  c = default.get_config()
  c.data.corpus = "wikitext"  # wiki.{train,valid,test}.tokens
  c.data.path = "data/wikitext-103"  # directory with the three token files
  c.data.cache_dir = "data/wikitext-103/trime_cache"  # tokenized once, then memory-mapped
  c.data.segment_len = 150  # L (training)
  c.data.segmentation = "stream"  # fairseq --sample-break-mode none (consecutive batching reads the stream)
  c.model.vocab_size = 267_735  # WikiText-103 vocabulary
  c.model.num_layers = 16  # layers
  c.model.d_model = 410  # hidden dimension
  c.model.num_heads = 10  # heads (Transformer-XL base)
  c.model.d_ff = 2100  # FFN inner dimension
  c.model.max_len = 150  # training segments and evaluation blocks
  c.model.dropout = 0.1  # Transformer-XL base
  c.model.dtype = "bfloat16"  # accelerator compute dtype
  c.trime.memory = "long"  # TrimeLM_long
  c.trime.batching = "consecutive"  # runs of m consecutive stream segments
  c.trime.consecutive_layout = "stream"  # the original's in-order runs (packed: memory within each document)
  c.trime.batch_plan = "data/wikitext-103/plans/consecutive_150x60"  # from launch/make_batches.py
  c.trime.consecutive_segments = 60  # m
  c.train.batch_size = 60  # segments per forward (one run): 9,000 in-batch memories
  c.train.grad_accum = 4  # 240 segments = 36,000 tokens per update
  c.train.num_steps = 200_000  # updates
  c.train.optimizer = "adam"  # Adam
  c.train.learning_rate = 5e-4  # peak
  c.train.schedule = "inverse_sqrt"  # inverse square root after warm-up
  c.train.warmup_steps = 8000  # linear warm-up
  c.train.vocab_chunk = 16_384  # chunked softmax over 267k words
  c.train.log_every = 100  # metric lines
  c.train.checkpoint_every = 2000  # orbax checkpoints
  c.train.eval_max_tokens = 100_000  # periodic dev evaluation subset
  c.eval.block_len = 150  # model input at evaluation
  c.eval.context_window = 86  # scored tokens per block: 64 (the paper's evaluation segment length)
  c.eval.batch_size = 16  # blocks per forward
  return c
