"""WikiText-103, 247M TrimeLM (paper Table "model_config", column 1; Baevski & Auli 2019 architecture).

Needs WikiText-103 (not available offline here): put wiki.{train,valid,test}.tokens in data/wikitext-103.
The paper's 247M count uses adaptive input/softmax (cutoffs 20k/60k, factor 4); this implementation's
output layer is a full tied softmax computed in vocabulary chunks, which has 475.7M parameters (the
embedding alone is 267,735 × 1,024 = 274M). See README "Parameter counts".
"""

from configs import default


def get_config():
  c = default.get_config()
  c.data.corpus = "wikitext"  # wiki.{train,valid,test}.tokens
  c.data.path = "data/wikitext-103"  # directory with the three token files
  c.data.cache_dir = "data/wikitext-103/trime_cache"  # tokenized once, then memory-mapped
  c.data.segment_len = 3072  # L (training)
  c.data.segmentation = "stream"  # fairseq --sample-break-mode none
  c.model.vocab_size = 267_735  # WikiText-103 vocabulary (checked against the data)
  c.model.num_layers = 16  # layers
  c.model.d_model = 1024  # hidden dimension
  c.model.num_heads = 8  # heads (Baevski & Auli)
  c.model.d_ff = 4096  # FFN inner dimension
  c.model.max_len = 3072  # training segments and evaluation blocks
  c.model.dropout = 0.3  # Baevski & Auli
  c.model.attention_dropout = 0.1  # Baevski & Auli
  c.model.activation_dropout = 0.1  # Baevski & Auli
  c.model.dtype = "bfloat16"  # accelerator compute dtype
  c.trime.memory = "local"  # TrimeLM; long: see wiki103_150m; ext: memory=ext + batching=bm25
  c.trime.ce_warmup_steps = -1  # 5% of updates
  c.train.batch_size = 8  # segments per forward: 8 × 3072 = 24,576 in-batch memories
  c.train.grad_accum = 3  # 24 segments = 73,728 tokens per update
  c.train.num_steps = 286_000  # updates
  c.train.optimizer = "nag"  # fairseq nag
  c.train.learning_rate = 1.0  # peak
  c.train.nag_momentum = 0.99  # fairseq nag momentum
  c.train.clip_norm = 0.1  # gradient clipping
  c.train.schedule = "cosine"  # cosine with linear warm-up
  c.train.warmup_steps = 16_000  # linear warm-up
  c.train.min_lr = 1e-4  # cosine floor
  c.train.vocab_chunk = 16_384  # never materialise [24,576 × 267,735] logits
  c.train.log_every = 100  # metric lines
  c.train.checkpoint_every = 2000  # orbax checkpoints
  c.train.eval_max_tokens = 100_000  # periodic dev evaluation subset
  c.eval.block_len = 3072  # fairseq --tokens-per-sample
  c.eval.context_window = 2560  # scored tokens per block: 512 (the paper's evaluation segment length)
  c.eval.batch_size = 1  # blocks per forward
  return c
