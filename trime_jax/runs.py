"""Glue that CLIs and notebooks share: evaluate an exported checkpoint on a config's data."""

from __future__ import annotations

from trime_jax import checkpoint as ckpt
from trime_jax import corpora
from trime_jax import evaluate as E
from trime_jax.errors import CheckpointError


def load_eval_data(config, vocab):
  """The config's corpora encoded with the checkpoint's vocabulary (kinds must agree)."""
  splits = corpora.load_splits(config.data, vocab=vocab if vocab.kind == "words" else None)
  if splits.vocab.kind != vocab.kind or len(splits.vocab) != len(vocab):
    raise CheckpointError(
        f"checkpoint vocabulary ({vocab.kind}, {len(vocab)} tokens) does not match data.corpus="
        f"{config.data.corpus!r} ({splits.vocab.kind}, {len(splits.vocab)} tokens)")
  return splits


def evaluate_checkpoint(config, checkpoint_dir: str, *, progress: bool = False) -> list[dict]:
  """Rows (one per variant) of perplexity on `config.eval.split`; with `eval.tune`, the best is marked."""
  graphdef, params, train_config, vocab, meta = ckpt.load_export(checkpoint_dir)
  splits = load_eval_data(config, vocab)
  e = config.eval
  if e.block_len > train_config.model.max_len:
    raise CheckpointError(f"eval.block_len={e.block_len} exceeds the checkpoint's model.max_len="
                          f"{train_config.model.max_len}")
  variants = E.variants_from_config(e)
  results = E.evaluate(graphdef, params, splits.get(e.split), block_len=e.block_len,
                       context_window=e.context_window, batch_size=e.batch_size, variants=variants,
                       vocab_chunk=train_config.train.vocab_chunk, max_tokens=e.max_tokens, progress=progress)
  rows = [r.as_dict() for r in results]
  if e.tune and len(rows) > 2:
    best = min(rows[1:], key=lambda r: r["nll"])
    best["variant"] += "  <- best"
  for r in rows:
    r["split"] = e.split
  return rows
