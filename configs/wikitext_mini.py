"""wikitext-mini: the 124 WikiText-2 articles in ../shared/data/wikitext-2 split by article (train/dev/test),
a small word-level model that trains in minutes on 2 CPU cores. Memory effects here are real: words recur
within an article and across similar articles."""

from trime_jax.configs import default
from trime_jax.corpora import WIKITEXT_MINI_PATH


def get_config():
  c = default.get_config()
  c.data.corpus = "wikitext_mini"  # valid + test articles of WikiText-2, split by article
  c.data.path = WIKITEXT_MINI_PATH  # ../shared/data/wikitext-2, relative to the repo root (CI has ../shared
  #                                  beside it); where it is missing, TFDS's WikiText-2 (another path: an error)
  c.data.split_fractions = (0.8, 0.1, 0.1)  # 98 / 12 / 12 articles (~375k / 35k / 52k tokens)
  c.data.vocab_min_count = 3  # ~9.5k words; rarer training words -> <unk> (keeps the softmax CPU-sized)
  c.data.segment_len = 256  # L
  c.model.num_layers = 4  # blocks
  c.model.d_model = 128  # D (= key dimension)
  c.model.num_heads = 4  # heads
  c.model.d_ff = 512  # FFN inner size
  c.model.max_len = 512  # covers training segments and evaluation blocks
  c.model.dropout = 0.2  # small corpus: regularise
  c.train.batch_size = 8  # 8 × 256 = 2,048 in-batch memories
  c.train.num_steps = 1000  # updates (~5.5 epochs of the training split)
  c.train.learning_rate = 1e-3  # peak learning rate (Adam)
  c.train.warmup_steps = 100  # linear warm-up
  c.train.log_every = 100  # metric lines
  c.train.checkpoint_every = 500  # orbax checkpoints
  c.train.eval_max_tokens = 0  # final dev evaluation on the whole dev split
  c.eval.block_len = 512  # L_eval
  c.eval.context_window = 256  # scored tokens per block: 256
  c.eval.batch_size = 4  # blocks per forward pass
  c.eval.long_term_layout = "disjoint"  # long-term store as docs/long_memory.md measured it: the tokens before
  c.eval.reset_at_documents = True  #   the window, of the query's own article (not the original's layout)
  return c
