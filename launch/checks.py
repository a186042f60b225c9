"""What a program reads, checked before any work: the config (`validated`, as training checks it), an export's
stored config against `--config` overrides, and evaluation or datastore splits that would overlap the training
data."""

from __future__ import annotations

import os

from trime_jax.launch.flags import given_overrides


def validated(config, checkpoint: str | None = None, *, training: bool = False):
  """`config` after train.validate_config (enums and ranges, eval's included): the evaluation CLIs check a config
  up front like training does, before loading a checkpoint or compiling anything. checkpoint: the export they
  read, refused when it is a translation export. training: a config to train with (launch.train, make_batches),
  checked as training checks it."""
  from trime_jax import exports
  from trime_jax.errors import ConfigError
  from trime_jax.train import validate_config

  # A translation export (and its stored config, of configs/ui_de_en.py's schema): said as such, not as the first
  # language-model field it lacks
  if checkpoint and exports.is_mt_export(checkpoint):
    raise ConfigError(exports.MT_EXPORT_MESSAGE.format(directory=checkpoint))
  if exports.is_mt_config(config):
    raise ConfigError("--config is a translation config (configs/ui_de_en.py's schema): train it with "
                      "trime_jax.launch.train_mt, translate with trime_jax.launch.translate")
  if config is not None:
    validate_config(config, training=training)
  return config


def check_export(config, checkpoint: str) -> None:
  """The export's stored config.json has no field this version does not know (exports.check_stored_config), and no
  `--config.model.X=...` differs from it: an export's architecture is fixed (evaluation, datastores and
  generation use the export's `model` section), so such an override would be ignored; nor is
  `--config.data.vocab_min_count` given (the vocabulary is the export's). Each is one error naming the file or
  the field with both values."""
  from trime_jax.exports import check_stored_config
  from trime_jax.errors import ConfigError

  if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "config.json")):
    return  # the export's own checks report a missing export or config.json
  path = os.path.join(checkpoint, "config.json")
  stored_all = check_stored_config(checkpoint)
  stored = stored_all.get("model", {})
  data_given = given_overrides("data")
  there = stored_all.get("data", {}).get("vocab_min_count")
  if "vocab_min_count" in data_given and config is not None and config.data.get("vocab_min_count") != there:
    # the vocabulary is the export's vocab.json: another value would be unread (the export's own is harmless)
    raise ConfigError(f"--config.data.vocab_min_count={data_given['vocab_min_count']}: an export's vocabulary is "
                      f"fixed (its vocab.json; {path} has data.vocab_min_count={there!r}); drop the override")
  given = given_overrides("model")
  if not given or config is None or "model" not in config:
    return
  for field in sorted(given):
    now = config.model.get(field) if field in config.model else None
    there = stored.get(field)
    now, there = (tuple(v) if isinstance(v, list) else v for v in (now, there))
    if field not in stored or now != there:
      raise ConfigError(f"--config.model.{field}={given[field]}: an export's architecture is fixed and is used as "
                        f"stored ({path} has model.{field}={there!r}{'' if field in stored else ' (absent)'}); "
                        "drop the override")


def _datastore_meta(directory: str) -> dict:
  import json

  try:
    with open(os.path.join(directory, "meta.json")) as f:
      meta = json.load(f)
  except (OSError, ValueError, UnicodeDecodeError):
    return {}  # the datastore's own checks report a missing or damaged meta.json
  return meta if isinstance(meta, dict) else {}


def overlap_error(datastore: str, ds_split: str, split: str, role: str, fix: str):
  from trime_jax.errors import ConfigError

  return ConfigError(f"split leakage: the datastore {datastore} was built from {ds_split}, the very split this "
                     f"run {role}: each scored token would retrieve itself. {fix}, or pass "
                     "--allow_split_overlap to study the leakage on purpose")


def check_split_overlap(config, checkpoint: str, allow: bool = False) -> None:
  """External memory must not hold the text it is evaluated on: the datastore's meta.json records the corpus
  it was built from (corpus_fingerprint over its tokens, corpus_name with its split); the splits this
  evaluation scores (eval.split, and dev when eval.tune tunes on it) are compared by content. An error names
  both, unless `allow` (--allow_split_overlap)."""
  e = config.eval
  if allow or not e.get("datastore"):
    return
  meta = _datastore_meta(e.datastore)
  if not meta.get("corpus_fingerprint"):
    return
  from trime_jax import exports
  from trime_jax import evaluate

  splits = evaluate.load_eval_data(config, exports.read_export_vocab(checkpoint))
  scored = [(e.split, f"scores (eval.split={e.split})")]
  if e.tune and e.split != "dev":
    scored.append(("dev", "tunes on (eval.tune=True tunes on dev)"))
  for split, role in scored:
    if splits.get(split).fingerprint() == meta["corpus_fingerprint"]:
      fix = ("Evaluate another split (--config.eval.split=dev or test)" if split == "train" else
             "Build the datastore from the training split (trime_jax.launch.build_datastore --split=train)")
      raise overlap_error(e.datastore, meta.get("corpus_name") or f"the {split} split", split, role, fix)


# Fields that decide which documents (or bytes) land in which split, per corpus whose splits are drawn here
# (wikitext, tfds: and docs-wt package selections keep each document in its released split).
SPLIT_FIELDS = {"wikitext_mini": ("split_fractions", "split_seed"), "bytes": ("split_fractions",),
                "stdlib": ("split_fractions", "split_seed", "max_files", "max_bytes_per_file")}


def check_data_split(config, checkpoint: str, allow: bool = False,
                     effect: str = "this run's dev / test hold training text") -> None:
  """Evaluating an export on the corpus it was trained on, with the splits drawn differently (another
  data.split_seed or split_fractions), puts training text into dev / test: refused, naming the fields and both
  values, unless `allow` (--allow_split_overlap); `effect` says what that does to this program's run. The
  export's config.json records the data section it was trained with."""
  import json

  from trime_jax.errors import ConfigError

  if allow or config is None or not checkpoint:
    return
  try:
    with open(os.path.join(checkpoint, "config.json")) as f:
      stored = json.load(f).get("data", {})
  except (OSError, ValueError, AttributeError):
    return  # the export's own checks report a missing or damaged config.json
  d = config.data
  fields = SPLIT_FIELDS.get(d.corpus, ())
  if not fields or stored.get("corpus") != d.corpus:
    return
  if d.corpus != "stdlib" and os.path.abspath(str(stored.get("path", ""))) != os.path.abspath(str(d.path)):
    if os.path.basename(str(stored.get("path", "")).rstrip("/")) != os.path.basename(str(d.path).rstrip("/")):
      return  # other text: nothing of the training split is in it
  norm = lambda v: [float(x) for x in v] if isinstance(v, (list, tuple)) else v
  diff = [f"data.{f}={norm(d.get(f))!r} now, {norm(stored.get(f))!r} in training" for f in fields
          if f in stored and norm(d.get(f)) != norm(stored.get(f))]
  if diff:
    raise ConfigError(f"split leakage: {checkpoint} was trained on data.corpus={d.corpus!r} with its splits drawn "
                      f"otherwise ({'; '.join(diff)}), so {effect}. Use the export's "
                      "data settings (omit --config, or match them), or pass --allow_split_overlap on purpose")
