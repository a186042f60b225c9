"""enwik8, 38M TrimeLM_long (paper Table "model_config", column 4). Byte-level, vocabulary 256.

Needs enwik8 (not available offline here): the raw 100M-byte file at data/enwik8/enwik8, split
90M / 5M / 5M as is standard. Consecutive batching: runs of 24 consecutive segments of the byte stream, read
in order as the original's --keep-order. Every training field follows
train_scripts/enwik8-38M-trime_long.sh of the original release (the TrimeLM script differs only in
criterion and order); docs/paper_configs.md lists each field's source.
"""

from trime_jax.configs import default


def get_config():
  c = default.get_config()
  c.data.corpus = "bytes"  # raw bytes, vocabulary 256
  c.data.path = "data/enwik8/enwik8"  # the unzipped enwik8 file
  c.data.split_fractions = (0.9, 0.05, 0.05)  # 90M / 5M / 5M bytes
  c.data.segment_len = 512  # L (training)
  c.data.segmentation = "stream"  # fairseq --sample-break-mode none (consecutive batching reads the stream)
  # Model: --arch transformer_lm_enwik8 (fairseq transformer_lm.py, over transformer_lm_big).
  c.model.vocab_size = 256  # bytes
  c.model.num_layers = 12  # arch decoder_layers 12
  c.model.d_model = 512  # arch decoder_embed_dim 512
  c.model.num_heads = 8  # arch decoder_attention_heads 8
  c.model.d_ff = 2048  # arch decoder_ffn_embed_dim 2048
  c.model.max_len = 512  # --tokens-per-sample 512 (max_target_positions)
  c.model.positions = "sinusoidal"  # arch decoder_learned_pos False
  c.model.position_offset = 2  # fairseq positions start at padding_idx + 1 = 2
  c.model.tie_embeddings = True  # --tie-adaptive-weights
  c.model.adaptive_input = True  # --adaptive-input: one band, so E · P (a [D, D] projection after the lookup)
  c.model.adaptive_softmax = True  # --adaptive-softmax-cutoff 208: one band, the head is the full tied softmax
  c.model.adaptive_cutoffs = ()  # cutoff 208 = the original's whole dictionary: no tail clusters
  c.model.adaptive_input_factor = 1.0  # --adaptive-input-factor 1
  c.model.adaptive_softmax_factor = 1.0  # --adaptive-softmax-factor 1
  c.model.final_norm = True  # arch no_decoder_final_norm False
  c.model.dropout = 0.3  # arch dropout 0.3
  c.model.attention_dropout = 0.1  # arch attention_dropout 0.1
  c.model.activation_dropout = 0.1  # arch activation_dropout 0.1
  c.model.key_type = "last_ffn_input"  # --knn-keytype last_ffn_input
  c.model.dtype = "bfloat16"  # --fp16 (bfloat16 here)
  c.trime.memory = "long"  # TrimeLM_long
  c.trime.batching = "consecutive"  # runs of m consecutive stream segments
  c.trime.consecutive_layout = "stream"  # the original's in-order runs
  c.trime.batch_plan = "data/enwik8/plans/consecutive_512x24"  # from launch/make_batches.py
  c.trime.consecutive_segments = 24  # m: 24 × 512 = 12,288 in-batch memories
  c.trime.consecutive_gpus = 4  # 4 GPUs (README) × --update-freq 1:
  #   --keep-order gives each GPU a contiguous quarter of the runs
  c.trime.ce_warmup_steps = 5_496  # --ce-warmup-epoch 3: 3 × 1,832 updates (175,782 segments / 96 per update)
  c.trime.memory_grad = "local_only"  # >1 device: the original's all_gather cuts gradients into other GPUs' keys
  c.trime.memory_grad_group_rows = 0  # no cut: trime_long_loss_same_device gathers nothing, the run is one GPU's
  #   --max-tokens (= our batch_size rows) with full key gradients; trime_loss (local) has nothing to cut
  c.train.seed = 1  # --seed 1
  c.train.batch_size = 24  # --max-tokens 12288 / --tokens-per-sample 512 per GPU (one run)
  c.train.grad_accum = 4  # 4 GPUs (README) × --update-freq 1: 96 segments = 49,152 tokens per update
  c.train.num_steps = 400_000  # --max-update 400000
  c.train.optimizer = "adam"  # --optimizer adam (decoupled weight decay, like optax.adamw)
  c.train.adam_b1 = 0.9  # --adam-betas "(0.9, 0.98)"
  c.train.adam_b2 = 0.98  # --adam-betas "(0.9, 0.98)"
  c.train.adam_eps = 1e-8  # --adam-eps default 1e-8
  c.train.weight_decay = 0.01  # --weight-decay 0.01
  c.train.learning_rate = 2.5e-4  # --max-lr 0.00025 (cosine peak)
  c.train.clip_norm = 0.0  # --clip-norm 0.0
  c.train.schedule = "cosine"  # --lr-scheduler cosine (one period of --max-update; --t-mult default 1)
  c.train.warmup_steps = 0  # --warmup-updates 0
  c.train.min_lr = 0.0  # --lr 0.0 (fairseq cosine's floor)
  c.train.log_every = 100  # metric lines
  c.train.checkpoint_every = 2000  # orbax checkpoints
  c.train.eval_max_tokens = 200_000  # periodic dev evaluation subset
  c.eval.block_len = 512  # model input at evaluation
  c.eval.context_window = 432  # scored bytes per block: 80 (the paper's evaluation segment length)
  c.eval.batch_size = 16  # blocks per forward
  c.eval.tau = 1.10  # --softmax-temp (TrimeLM_long; TrimeLM: 1.05)
  c.eval.mem_size = 24_576  # --mem-size 24576 (eval.long_term_layout="original", the default)
  c.eval.reset_at_documents = False  # one stream
  return c
