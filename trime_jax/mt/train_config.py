"""The translation trainer's config checks (`validate_config`): enums, ranges and consistency, one ConfigError
before any data is read or anything is compiled."""

from __future__ import annotations

from trime_jax import sharded_loss
from trime_jax.errors import ConfigError
from trime_jax.mt import batching
from trime_jax.mt import data as mt_data
from trime_jax.runtime import workdir
from trime_jax.runtime.config import check_train_section

MEMORIES = ("none", "ext")


def pack_len_of(config) -> int:
  """data.pack_len (0: one pair per row, padded; else pairs packed into rows of that many tokens)."""
  return int(config.data.get("pack_len", 0))


def batches_per_update_of(config) -> int:
  """data.batches_per_update (0: ours, one bucketed cut an update; G: the original's G GPU batches an update)."""
  return int(config.data.get("batches_per_update", 0))


BEST_METRICS = ("ce_ppl", "bleu")  # train.best_metric: what <workdir>/best keeps (lowest ce_ppl, highest bleu)


def _check_model_and_lengths(config) -> None:
  """The model section (`mt.model.MTConfig`'s own checks, as a ConfigError, and the ranges it does not check),
  data.max_len / data.max_sentences, and positions for the longest batch: refused before the workdir is written
  (they were tracebacks once training had started, or trained silently: dropout 1.5, bm25_k 0)."""
  import jax.numpy as jnp

  from trime_jax import specs

  m, d = config.model, config.data
  for name in ("d_model", "num_heads", "d_ff", "max_len"):
    if int(m[name]) < 1:
      raise ConfigError(f"model.{name} must be >= 1, got {m[name]}")
  for name in ("dropout", "attention_dropout", "activation_dropout"):
    if not 0.0 <= float(m.get(name, 0.0)) < 1.0:
      raise ConfigError(f"model.{name} must be in [0, 1), got {m[name]}")
  try:
    ok = jnp.issubdtype(jnp.dtype(str(m.get("dtype", "float32"))), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    raise ConfigError(f"model.dtype must be a floating dtype (float32, bfloat16, float16), got {m.dtype!r}")
  try:  # key_type, d_model % num_heads, layers >= 1, ... (vocabulary sizes are checked once it is read)
    specs.mt_model_config(config, vocab_size=max(int(m.get("pad_id", 0)) + 1, 4))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if int(d.max_len) < 0:
    raise ConfigError(f"data.max_len must be >= 0 (0: no limit), got {d.max_len}")
  if int(d.max_sentences) < 0:
    raise ConfigError(f"data.max_sentences must be >= 0 (0: no cap), got {d.max_sentences}")
  if int(d.max_len) and batching.bucket(int(d.max_len)) > int(m.max_len):
    raise ConfigError(f"model.max_len={m.max_len} positions are fewer than the longest batch's "
                      f"{batching.bucket(int(d.max_len))} (data.max_len={d.max_len}, rounded up to its length "
                      "bucket): raise model.max_len or lower data.max_len")
  if pack_len_of(config) > int(m.max_len):  # packed rows are pack_len long
    raise ConfigError(f"model.max_len={m.max_len} positions are fewer than data.pack_len={pack_len_of(config)} "
                      "(packed rows): raise model.max_len or lower data.pack_len")
  if config.trime.batching == "bm25" and int(config.trime.bm25_k) < 2:
    raise ConfigError(f"trime.bm25_k must be >= 2 (the sentence's own hit and at least one neighbour), got "
                      f"{config.trime.bm25_k}")


def validate_config(config) -> None:
  from trime_jax.configs import ui_de_en
  from trime_jax.exports import is_mt_config

  if not is_mt_config(config):  # said as such, not as a list of every field translation lacks
    raise ConfigError("the config is a language-model config (configs/default.py's schema): train it with "
                      "trime_jax.launch.train; translation configs follow configs/ui_de_en.py (also "
                      "configs/iwslt_de_en.py)")
  workdir.check_no_renamed_fields(config)  # a retired name (workdir.RENAMED_FIELDS) added by an unlocked config
  workdir.check_known_fields(config.to_dict(), ui_de_en.get_config())  # a misspelt one (every MT config's fields)
  t, r = config.trime, config.train
  if t.memory not in MEMORIES:
    raise ConfigError(f"trime.memory must be one of {MEMORIES} for translation, got {t.memory!r}")
  if t.batching not in batching.ORDERS:
    raise ConfigError(f"trime.batching must be one of {batching.ORDERS}, got {t.batching!r}")
  if t.batching == "bm25":
    from trime_jax.batching import bm25

    bm25.check_scoring(t.bm25_k1, t.bm25_b)
    bm25.check_analyzer(t.get("bm25_analyzer", "english"))
  check_train_section(r)  # the section both trainers share (runtime.config): optimizer, schedule, cadences, ranges
  for name in ("eval_max_pairs", "target_token_budget", "stop_after", "num_epochs"):  # 0: all / none / no limit
    if int(r.get(name, 0)) < 0:
      raise ConfigError(f"train.{name} must be >= 0, got {r[name]}")
  if str(r.get("best_metric", "ce_ppl")) not in BEST_METRICS:
    raise ConfigError(f"train.best_metric must be one of {BEST_METRICS}, got {r.best_metric!r}")
  if r.label_smoothing and t.memory != "none":
    raise ConfigError("train.label_smoothing is an option of the CE baseline (trime.memory=none) only")
  if not 0.0 <= r.label_smoothing < 1.0:
    raise ConfigError(f"train.label_smoothing must be in [0, 1), got {r.label_smoothing}")
  if r.label_smoothing and r.vocab_chunk:
    raise ConfigError("train.label_smoothing needs the full logits: set train.vocab_chunk=0")
  if str(config.data.get("dictionaries", "joint")) not in mt_data.DICTIONARIES:
    raise ConfigError(f"data.dictionaries must be one of {mt_data.DICTIONARIES}, got {config.data.dictionaries!r}")
  if str(config.data.get("dictionaries", "joint")) == "separate":
    if str(config.data.get("format", "text")) != "fairseq":
      raise ConfigError("data.dictionaries='separate' is of data.format='fairseq' (BPE token lists): a "
                        "sentencepiece model is one joint vocabulary")
    if config.model.get("share_all_embeddings", False):
      raise ConfigError("model.share_all_embeddings needs one joint vocabulary: data.dictionaries='joint'")
  if int(config.data.max_tokens) < 8:
    raise ConfigError(f"data.max_tokens must be >= 8, got {config.data.max_tokens}")
  _check_model_and_lengths(config)
  per_update, multiple = batches_per_update_of(config), int(config.data.get("batch_size_multiple", 8))
  if per_update < 0 or multiple < 1:
    raise ConfigError(f"data.batches_per_update must be >= 0 and data.batch_size_multiple >= 1, got "
                      f"{per_update} and {multiple}")
  if per_update and int(t.get("memory_grad_groups", 0)) not in (0, per_update):
    raise ConfigError(f"trime.memory_grad_groups={t.memory_grad_groups} must be 0 or data.batches_per_update="
                      f"{per_update}: the key-gradient groups are the update's batches (the original's GPUs)")
  if not t.tau > 0:
    raise ConfigError(f"trime.tau must be > 0, got {t.tau}")
  if t.memory_topk < 0:
    raise ConfigError(f"trime.memory_topk must be >= 0, got {t.memory_topk}")
  if t.sharded_variant not in sharded_loss.VARIANTS:
    raise ConfigError(f"trime.sharded_variant must be one of {sharded_loss.VARIANTS}, got {t.sharded_variant!r}")
  if t.memory_grad not in sharded_loss.MEMORY_GRADS:
    raise ConfigError(f"trime.memory_grad must be one of {sharded_loss.MEMORY_GRADS}, got {t.memory_grad!r}")
  pack_len = pack_len_of(config)
  groups = int(t.get("memory_grad_groups", 0))
  if groups < 0:
    raise ConfigError(f"trime.memory_grad_groups must be >= 0, got {groups}")
  if groups and pack_len and not batches_per_update_of(config):
    raise ConfigError("trime.memory_grad_groups groups the batch's rows: with data.pack_len (packed rows) only "
                      "under data.batches_per_update (each GPU batch packed in its own row block)")
  if pack_len and pack_len < int(config.data.max_len):
    raise ConfigError(f"data.pack_len={pack_len} must be 0 (no packing) or >= data.max_len={config.data.max_len}")
  if pack_len and t.sharded_variant != "gather":
    raise ConfigError("data.pack_len (packed rows) needs trime.sharded_variant='gather' (the sharded loss "
                      "gathers the pair ids with the keys)")
  if t.memory_topk and t.sharded_variant != "gather":
    raise ConfigError("trime.memory_topk needs trime.sharded_variant='gather' (a query's top k over the whole "
                      "gathered batch)")
