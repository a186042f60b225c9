"""WikiText-103, 7M model of the paper's ablations (Table "model_config", column 3; Appendix "wiki_small").

Configured as TrimeLM_ext (BM25 batches, local memory dropped with p = 0.9), the model of the ablation
tables. The paper's 7M count uses adaptive input/softmax (cutoffs 20k/60k, factor 4); with this
implementation's full tied softmax the model has 35.9M parameters (34.3M of them the embedding).
"""

from configs import default


def get_config():
  c = default.get_config()
  c.data.corpus = "wikitext"  # wiki.{train,valid,test}.tokens
  c.data.path = "data/wikitext-103"  # directory with the three token files
  c.data.cache_dir = "data/wikitext-103/trime_cache"  # tokenized once, then memory-mapped
  c.data.segment_len = 3072  # L (training)
  c.model.vocab_size = 267_735  # WikiText-103 vocabulary
  c.model.num_layers = 8  # layers
  c.model.d_model = 128  # hidden dimension
  c.model.num_heads = 4  # heads
  c.model.d_ff = 512  # FFN inner dimension
  c.model.max_len = 3072  # training segments and evaluation blocks
  c.model.dropout = 0.1  # residual dropout
  c.trime.memory = "ext"  # TrimeLM_ext: every other segment of the batch is memory
  c.trime.batching = "bm25"  # Algorithm 1 batches (launch/make_batches.py --kind=bm25)
  c.trime.batch_plan = "data/wikitext-103/plans/bm25_3072x8"  # written by launch/make_batches.py
  c.trime.bm25_exclude_same_document = False  # Algorithm 1 as published: same-article neighbours allowed
  c.trime.drop_local_prob = 0.9  # p
  c.trime.consecutive_segments = 8  # m for the TrimeLM_long variant (memory=long, batching=consecutive)
  c.train.batch_size = 8  # segments per forward: 24,576 in-batch memories
  c.train.grad_accum = 1  # 24,576 tokens per update
  c.train.num_steps = 200_000  # updates
  c.train.optimizer = "adam"  # Adam
  c.train.learning_rate = 5e-4  # peak
  c.train.schedule = "inverse_sqrt"  # inverse square root after warm-up
  c.train.warmup_steps = 8000  # linear warm-up
  c.train.vocab_chunk = 16_384  # chunked softmax over 267k words
  c.train.log_every = 100  # metric lines
  c.train.checkpoint_every = 2000  # orbax checkpoints
  c.train.eval_max_tokens = 100_000  # periodic dev evaluation subset
  c.eval.block_len = 3072  # model input at evaluation
  c.eval.context_window = 2560  # scored tokens per block: 512
  c.eval.batch_size = 1  # blocks per forward
  return c
