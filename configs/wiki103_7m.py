"""WikiText-103, 7M model of the paper's ablations (Table "model_config", column 3; Appendix "wiki_small").

Configured as TrimeLM_ext (BM25 batches, local memory dropped with p = 0.9), the model of the ablation
tables. The paper's 7M count needs tied adaptive input/softmax (cutoffs 20k/60k, factor 4): 7,115,192
parameters here (a full tied softmax would have 35.9M). No script says how the 7M's adaptive softmax was
configured: its flags are the 150M script's (--adaptive-input --tie-adaptive-weights, no --tie-adaptive-proj,
softmax dropout 0) with the paper's factor 4; docs/paper_models.md.
The original release has no 7M train script: shapes and the optimizer row come from the paper's appendix
table; the architecture is the fork's transformer_lm_wiki103_small_sm ("7M model without using adaptive softmax",
8 × 128, 4 heads; adaptive here as the paper's table marks it, the only way to about 7M at 267k words), and
what the paper leaves open (Adam betas, weight decay, seed, warm-up init) is taken from the 150M script,
whose optimizer row in the paper is identical. docs/paper_configs.md lists each field's source.
"""

from trime_jax.configs import default


def get_config():
  c = default.get_config()
  c.data.corpus = "wikitext"  # wiki.{train,valid,test}.tokens
  c.data.path = "data/wikitext-103"  # directory with the three token files
  c.data.cache_dir = "data/wikitext-103/trime_cache"  # tokenized once, then memory-mapped
  c.data.segment_len = 3072  # L (training)
  # Model: transformer_lm_wiki103_small_sm (fairseq transformer_lm.py), the paper's appendix shapes.
  c.model.vocab_size = 267_735  # WikiText-103 vocabulary
  c.model.num_layers = 8  # paper appendix; arch decoder_layers 8
  c.model.d_model = 128  # paper appendix; arch decoder_embed_dim 128
  c.model.num_heads = 4  # paper appendix; arch decoder_attention_heads 4
  c.model.d_ff = 512  # paper appendix; arch decoder_ffn_embed_dim 512
  c.model.max_len = 3072  # paper: segment length 3072 (max_target_positions = --tokens-per-sample)
  c.model.positions = "sinusoidal"  # arch decoder_learned_pos False
  c.model.position_offset = 2  # fairseq positions start at padding_idx + 1 = 2
  c.model.tie_embeddings = True  # tied adaptive input/softmax (--tie-adaptive-weights)
  c.model.adaptive_input = True  # --adaptive-input (150M script; the paper's count needs it)
  c.model.adaptive_softmax = True  # --adaptive-softmax-cutoff 20000,60000
  c.model.adaptive_cutoffs = (20_000, 60_000)  # --adaptive-input-cutoff = --adaptive-softmax-cutoff 20000,60000
  c.model.adaptive_input_factor = 4.0  # paper: factor 4 (fairseq default)
  c.model.adaptive_softmax_factor = 4.0  # paper: factor 4 (fairseq default)
  c.model.tie_adaptive_proj = False  # as the 150M script (no --tie-adaptive-proj; inferred)
  c.model.adaptive_softmax_dropout = 0.0  # fairseq default (the 150M script sets none; inferred)
  c.model.final_norm = True  # arch no_decoder_final_norm False
  c.model.dropout = 0.3  # arch dropout 0.3
  c.model.attention_dropout = 0.1  # arch attention_dropout 0.1
  c.model.activation_dropout = 0.1  # arch activation_dropout 0.1
  c.model.key_type = "last_ffn_input"  # --knn-keytype last_ffn_input (every original script)
  c.model.dtype = "bfloat16"  # --fp16 (every original script; bfloat16 here)
  c.trime.memory = "ext"  # TrimeLM_ext: every other segment of the batch is memory
  c.trime.batching = "bm25"  # Algorithm 1 batches (launch/make_batches.py --kind=bm25)
  c.trime.batch_plan = "data/wikitext-103/plans/bm25_3072x8"  # written by launch/make_batches.py
  c.trime.bm25_exclude_same_document = False  # Algorithm 1 as published: same-article neighbours allowed
  c.trime.drop_local_prob = 0.9  # p
  c.trime.consecutive_segments = 8  # m for the TrimeLM_long variant (memory=long, batching=consecutive)
  c.trime.ce_warmup_steps = -1  # no script: the paper's "first 5% updates" (10,000)
  c.trime.memory_grad = "local_only"  # >1 device: the original's all_gather cuts gradients into other GPUs' keys
  c.trime.memory_grad_group_rows = 0  # no script, so no GPU layout to reproduce (the 247M _ext script's one segment
  #   per GPU would be 1): the 8 segments of a forward get full key gradients, as the paper's equations
  c.train.seed = 1  # --seed 1 (every original script)
  c.train.batch_size = 8  # paper table: 8 segments per forward, 24,576 in-batch memories
  c.train.grad_accum = 1  # paper table: gradient accumulation 1 (24,576 tokens per update)
  c.train.num_steps = 200_000  # paper table: 200,000 update steps
  c.train.optimizer = "adam"  # paper table: adam
  c.train.adam_b1 = 0.9  # 150M script --adam-betas "(0.9, 0.98)"
  c.train.adam_b2 = 0.98  # 150M script --adam-betas "(0.9, 0.98)"
  c.train.adam_eps = 1e-8  # fairseq --adam-eps default 1e-8
  c.train.weight_decay = 0.01  # 150M script --weight-decay 0.01 (inferred: the paper does not say)
  c.train.learning_rate = 5e-4  # paper table: 5e-4
  c.train.clip_norm = 0.0  # paper table: grad clip norm 0.0
  c.train.schedule = "inverse_sqrt"  # paper table: inverse_sqrt
  c.train.warmup_steps = 8000  # paper table: 8000 linear warm-up steps
  c.train.warmup_init_lr = 1e-7  # 150M script --warmup-init-lr 1e-07
  c.train.vocab_chunk = 16_384  # chunked softmax over 267k words
  c.train.log_every = 100  # metric lines
  c.train.checkpoint_every = 2000  # orbax checkpoints
  c.train.eval_max_tokens = 100_000  # periodic dev evaluation subset
  c.eval.block_len = 3072  # model input at evaluation
  c.eval.context_window = 2560  # scored tokens per block: 512
  c.eval.sample_break_mode = "complete"  # as the released 247M evaluation (no 7M command was released)
  c.eval.batch_size = 1  # blocks per forward
  return c
