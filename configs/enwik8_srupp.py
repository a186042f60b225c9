"""enwik8, SRU++ 42M with TrimeLM_long (paper Appendix "Applying TrimeLM_long to SRU++", Table "enwik8" bottom
block: 1.05 -> 1.03 bpc at L = 512, 1.02 -> 0.99 at L = 2,048). Byte-level, vocabulary 256.

`--config=configs/enwik8_srupp.py` is L = 512 (test long-term memory 6,144); `--config=configs/enwik8_srupp.py:2048`
is L = 2,048 (long-term memory 12,228, the paper's number). Vanilla SRU++: `--config.trime.memory=none`.

What the paper fixes: batch 16, 400k updates, L, the test memory, "other hyper-parameters and the optimizer as
the SRU++ implementation's defaults". Those defaults are read from the SRU++ enwik8 script (asappresearch/sru,
experiments/srupp_experiments/train_enwik8.py, and its README's commands; those pass --layer_norm on the
3.0.0-dev-tao branch, May 2021, not on the later 3.0.0-dev / -codeclean / -apex; we follow the tao branch's
commands, the SRU++ paper's runs, and the paper does not say which TRIME used): RAdam, lr 3e-4, weight decay 0.1,
gradient clip 1.0, linear warm-up 16k then cosine to 0 over max_iter, dropout and attention dropout 0.22, highway
bias -2, one head, attn_layer_norm on (SRUpp's normalization_type=1: the post-LN inside each layer's attention
or projection), no per-layer pre-LN, U(±√(3/d)) embedding / output init, an untied output layer. On the tao
branch the script's --layer_norm picks that init only: its SRUpp stores the layer_norm argument unused and builds
its LNs from normalization_type (sru/modules.py, SRUpp.__init__); the later branches pass it on as a pre-LN of
each cell, but their commands do not give --layer_norm. So no README command trains a pre-LN, and
srupp_layer_norm stays off (until 2026-12-07 this config set it, adding a pre-LN per layer that no SRU++ run
had).
The script's default shape is the 108M base (d = 3,072, d' = 768, 10 layers, attention in every layer); the 42M
shape is not published, so it is an assumption made to land on 42M: d = 2,048, d' = 512 (the base's d/d' = 4),
10 layers, attention in the last layer only (attention_every = 10; Lei 2021 shows one attention layer keeps most
of the gain): 43.6M parameters (tests/test_srupp.py checks 42M within 5%); attention in every layer is 48M.
Needs enwik8 (not offline here): data/enwik8/enwik8, split 90M / 5M / 5M; the batch plan from
`python -m trime_jax.launch.make_batches --config=configs/enwik8_srupp.py --kind=consecutive`.
"""

from trime_jax.configs import default


def get_config(segment_len: str = "512"):
  seg = int(segment_len)
  if seg not in (512, 2048):
    raise ValueError(f"enwik8_srupp takes segment length 512 or 2048, got {segment_len!r}")
  c = default.get_config()
  c.data.corpus = "bytes"
  c.data.path = "data/enwik8/enwik8"
  c.data.split_fractions = (0.9, 0.05, 0.05)
  c.data.segment_len = seg  # L
  c.data.segmentation = "stream"  # SRU++ reads the byte stream in order
  c.model.backbone = "srupp"
  c.model.vocab_size = 256
  c.model.num_layers = 10
  c.model.d_model = 2048  # d
  c.model.srupp_attn_dim = 512  # d'
  c.model.srupp_attention_every = 10  # attention in layer 10 only (see the docstring)
  c.model.srupp_num_heads = 1
  c.model.srupp_highway_bias = -2.0  # --bias
  c.model.srupp_layer_norm = False  # no pre-LN: the tao branch's --layer_norm only picks the U(±√(3/d)) init
  #   (trime_jax's SRU++ LM always uses it; its LNs: normalization_type=1 = attn_layer_norm); the later branches'
  #   commands do not pass it
  c.model.max_len = max(seg, 2048)
  c.model.dropout = 0.22  # the script's --dropout
  c.model.attention_dropout = 0.22  # --attn_dropout
  c.model.key_type = "final"  # g = input of the final projection
  c.model.dtype = "bfloat16"
  c.trime.memory = "long"  # current segment + the stream's previous segment (stale keys, no gradient)
  c.trime.batching = "consecutive"
  c.trime.consecutive_layout = "stream"  # each row one contiguous stream, consecutive batches continue it
  c.trime.consecutive_segments = 1
  c.trime.batch_plan = f"data/enwik8/plans/srupp_stream_{seg}x16"
  c.trime.ce_warmup_steps = 0  # assumed: the paper states no CE warm-up for SRU++
  c.train.batch_size = 16  # the paper
  c.train.num_steps = 400_000  # the paper
  c.train.optimizer = "radam"  # the script's RAdam (decoupled weight decay)
  c.train.learning_rate = 3e-4  # --lr
  c.train.adam_b1, c.train.adam_b2 = 0.9, 0.999  # RAdam defaults
  c.train.weight_decay = 0.1  # --weight_decay
  c.train.schedule = "torch_cosine"  # torch's CosineAnnealingLR(max_iter) stepped from update 0, the rate
  #   overwritten during the warm-up by lr·(n+1)/W (train.warmup_init_lr is not read)
  c.train.warmup_steps = 16_000  # --warmup_steps
  c.train.min_lr = 0.0
  c.train.clip_norm = 1.0  # --clip_grad
  c.train.log_every = 100
  c.train.checkpoint_every = 2000
  c.train.eval_max_tokens = 200_000
  c.eval.block_len = seg  # windows of L bytes, state carried from one to the next
  c.eval.context_window = 0  # SRU++ carries its state: no overlapping context
  c.eval.batch_size = 16
  c.eval.mem_size = 6_144 if seg == 512 else 12_228  # the paper's long-term memory at test time
  c.eval.reset_at_documents = False  # one stream
  return c
