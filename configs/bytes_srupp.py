"""Tiny byte-level SRU++ (TrimeLM_long) for CPU evidence on Tiny Shakespeare (experiments/srupp_bytes.sh).

~430k parameters (437,666): d = 232, d' = 64, 5 layers, attention every 2nd layer; the Transformer of the same size is
`configs/bytes_srupp.py:transformer` (2 layers, D = 128, FFN 512). Both read the stream in order (consecutive
'stream' plans): SRU++ one segment per row (its long memory: the row's previous segment, carried), the
Transformer runs of 4 consecutive segments (its long memory: the earlier segments of the run). Vanilla:
--config.trime.memory=none.
"""

from trime_jax.configs import default


def get_config(backbone: str = "srupp"):
  if backbone not in ("srupp", "transformer"):
    raise ValueError(f"bytes_srupp takes srupp or transformer, got {backbone!r}")
  c = default.get_config()
  c.data.corpus = "bytes"
  c.data.path = "../shared/data/tinyshakespeare/input.txt"
  c.data.split_fractions = (0.9, 0.05, 0.05)
  c.data.segment_len = 128
  c.data.segmentation = "stream"
  c.model.vocab_size = 256
  c.model.max_len = 128
  c.model.dropout = 0.1
  c.trime.memory = "long"
  c.trime.batching = "consecutive"
  c.trime.consecutive_layout = "stream"
  c.trime.consecutive_segments = 1
  c.trime.batch_plan = f"data/plans/bytes_srupp_{backbone}"
  c.trime.ce_warmup_steps = 0
  c.train.batch_size = 16
  c.train.num_steps = 300
  c.train.learning_rate = 2e-3
  c.train.warmup_steps = 30
  c.train.log_every = 50
  c.train.checkpoint_every = 1000
  c.train.eval_max_tokens = 8_192
  c.eval.block_len = 128
  c.eval.batch_size = 8
  c.eval.max_tokens = 32_768
  if backbone == "srupp":
    c.model.backbone = "srupp"
    c.model.num_layers = 5
    c.model.d_model = 232
    c.model.srupp_attn_dim = 64
    c.model.srupp_attention_every = 2
    c.model.key_type = "final"
    c.eval.context_window = 0  # state carried from window to window
    c.trime.memory = "long"  # current + previous segment of the stream (stale keys)
  else:
    c.model.num_layers = 2
    c.model.d_model = 128
    c.model.num_heads = 4
    c.model.d_ff = 512
    c.eval.context_window = 64
    c.trime.consecutive_segments = 4  # TrimeLM_long: runs of 4 consecutive segments (4 streams of runs)
  return c
