"""Translate a split of an MT export's data with beam search (or greedy), and score it with sacrebleu.

  python -m trime_jax.launch.translate --checkpoint=runs/ui_vanilla/export --split=test --out=runs/ui_vanilla/translate
  python -m trime_jax.launch.translate --checkpoint=... --mode=knn_mt --datastore=runs/ui_vanilla/datastore \\
      --k=16 --knn_lambda=0.3 --knn_mt_temperature=10 --split=test --out=...
  python -m trime_jax.launch.translate --checkpoint=... --mode=trime --datastore=... --k=64 --tau=1 \\
      [--knn_lambda=0.2 --tau_prime=1] --split=test --out=...
  python -m trime_jax.launch.translate --checkpoint=... --mode=trime_release --datastore=... --k=16 --tau=15 \\
      --split=test --out=...     # TrimeMT_ext as the release's decoder combines model and datastore (its README's
                                 # k = 16, t = 15): (1 - λ)·p_model + p_kNN, λ = Z_c / (Z_t + Z_c), not normalised
  python -m trime_jax.launch.translate --checkpoint=... --datastore=... --tune --out=...      # tune on valid
  python -m trime_jax.launch.translate --checkpoint=... --datastore=... --settings=<out>/tuned.json --mode=trime ...

Writes <out>/<split>.<mode>.hyp (one detokenised hypothesis per line) and <out>/<split>.<mode>.json (BLEU,
sacrebleu signature, sentences/s, retrieval seconds, the settings; another search than beam 4, lenpen 0.6 adds it
to the name: test.trime.beam1.hyp is greedy); those of another run (another model,
datastore, index or nprobe, data, setting or search) are replaced only with --overwrite. --tune: one
teacher-forced pass over the valid targets retrieves the top-64 entries of every target token once (by inner product for TRIME, by L2 for kNN-MT);
every K in {1, 2, 4, ..., 64} and every (τ, λ, T, τ′) of the grids is scored from it as valid token NLL; then beam search
on valid runs only the --tune_beam best settings per mode, and the best valid BLEU is written to <out>/tuned.json
(another tuning's there, of other modes, search or valid pairs, is replaced only with --overwrite).
The data comes from the export's stored config (--config=an MT config, task='mt', overrides it; of its overrides
only --config.data.* are read, others are refused: the model and its TRIME settings are the export's).
"""

import dataclasses
import json
import math
import os
import re
import sys
import time

from absl import flags
from ml_collections import config_flags

from trime_jax.launch.checks import overlap_error
from trime_jax.launch.entry import run_main
from trime_jax.launch.flags import check_flag
from trime_jax.mt import decode

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "MT export directory (<workdir>/export).")
_CONFIG = config_flags.DEFINE_config_file("config", None, "An MT config (task='mt') for the data; default: the "
                                          "export's stored config.", lock_config=True)
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "valid", "dev", "test"],
                           "Split to translate (dev = valid, the language models' name for it).")
_OUT = flags.DEFINE_string("out", None, "Output directory.")
_MODE = flags.DEFINE_enum("mode", "model", ["model", "knn_mt", "trime", "trime_interp", "trime_best", "trime_release"],
                          "Next-token distribution: model | knn_mt | trime (TRIME over vocabulary + retrieved "
                          "entries, the paper's normalised law; --knn_lambda > 0 adds Appendix A's interpolation) | "
                          "trime_release (the release's decoder: (1 - λ)·p_model + p_kNN, λ = Z_c / (Z_t + Z_c), "
                          "what its README's BLEU was measured with). With --settings, trime_interp takes the tuned "
                          "interpolated setting and trime_best the better of trime / trime_interp on valid BLEU.")
_BEAM = flags.DEFINE_integer("beam", decode.EVAL_SEARCH.beam, "Beam size (1 = greedy).")
_LENPEN = flags.DEFINE_float("lenpen", decode.EVAL_SEARCH.lenpen,
                             "Length penalty: score / len^lenpen (the original evaluations'; fairseq default 1.0).")
_MAX_LEN_A = flags.DEFINE_float("max_len_a", decode.EVAL_SEARCH.max_len_a,
                                "Max output length = a * source length + b (the original evaluations'; fairseq: 0).")
_MAX_LEN_B = flags.DEFINE_integer("max_len_b", decode.EVAL_SEARCH.max_len_b,
                                  "Max output length = a * source length + b (fairseq: 200).")
_DATASTORE = flags.DEFINE_string("datastore", "", "Datastore directory (trime_jax.launch.build_datastore).")
_INDEX = flags.DEFINE_string("index", "", "FAISS index (default <datastore>/index.faiss).")
_NPROBE = flags.DEFINE_integer("nprobe", 32, "IVF lists searched per query.")
_K = flags.DEFINE_integer("k", 64, "Retrieved entries per query.")
_KNN_LAMBDA = flags.DEFINE_float("knn_lambda", None, "Weight λ of the retrieved distribution: kNN-MT's p_kNN "
                                 "(default 0.5); --mode=trime: Appendix A's P′ (default 0 = no interpolation).")
_KNN_MT_TEMPERATURE = flags.DEFINE_float("knn_mt_temperature", 10.0, "kNN-MT: T of exp(-|q - k|^2 / T).")
_TAU = flags.DEFINE_float("tau", 1.0, "TrimeMT_ext: τ on g·k/√D.")
_TAU_PRIME = flags.DEFINE_float("tau_prime", 1.0, "TrimeMT_ext: Appendix A's τ′.")
_SETTINGS = flags.DEFINE_string("settings", "", "tuned.json of --tune: its setting for --mode replaces the flags.")
_BATCH = flags.DEFINE_integer("batch_sentences", 32, "Sentences decoded together.")
_MAX_SENTENCES = flags.DEFINE_integer("max_sentences", 0, "Translate only the first N sentences (0 = all).")
_TUNE = flags.DEFINE_bool("tune", False, "Tune K, τ, λ, T, τ′ on valid (see the module doc).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace <out>/<split>.<mode>.{hyp,json} of another run (another "
                               "model, datastore, index, data, setting or search), or with --tune a tuned.json of "
                               "another model or datastore; a rerun of the same one replaces them anyway.")
_TUNE_BEAM = flags.DEFINE_integer("tune_beam", 2, "--tune: settings per mode decoded with beam search on valid.")
_TUNE_MODES = flags.DEFINE_list("tune_modes", ["knn_mt", "trime", "trime_release"], "--tune: the datastore "
                                "distributions to tune (knn_mt, trime, trime_release; trime includes Appendix A's "
                                "interpolation); the model alone is always decoded.")
_ALLOW_OVERLAP = flags.DEFINE_bool("allow_split_overlap", False, "Translate (or tune on) the very split the datastore "
                                   "was built from. Refused without this flag: each target token would retrieve "
                                   "itself (leakage); use it only to study that on purpose.")
flags.mark_flags_as_required(["checkpoint", "out"])
# Ranges, checked when the flags are parsed (one `error:` line, before the model is loaded).
_finite = math.isfinite
check_flag(_BEAM, lambda v: v >= 1, "an integer >= 1 (1: greedy)")
check_flag(_LENPEN, _finite, "a finite number")
check_flag(_MAX_LEN_A, lambda v: _finite(v) and v >= 0, "a number >= 0")
check_flag(_MAX_LEN_B, lambda v: v >= 0, "an integer >= 0")
check_flag(_NPROBE, lambda v: v >= 1, "an integer >= 1 (IVF lists searched per query)")
check_flag(_K, lambda v: v >= 1, "an integer >= 1")
check_flag(_KNN_LAMBDA, lambda v: 0 <= v <= 1, "in [0, 1] ([0, 1) with --mode=trime; 0: no interpolation)")
check_flag(_KNN_MT_TEMPERATURE, lambda v: _finite(v) and v > 0, "a number > 0")
check_flag(_TAU, lambda v: _finite(v) and v > 0, "a number > 0")
check_flag(_TAU_PRIME, lambda v: _finite(v) and v > 0, "a number > 0")
check_flag(_BATCH, lambda v: v >= 1, "an integer >= 1")
check_flag(_MAX_SENTENCES, lambda v: v >= 0, "an integer >= 0 (0: every sentence)")
check_flag(_TUNE_BEAM, lambda v: v >= 1, "an integer >= 1")
check_flag(_TUNE_MODES, lambda v: bool(v) and set(v) <= {"knn_mt", "trime", "trime_release"},
           "a non-empty subset of knn_mt,trime,trime_release")


def _check_overlap(ds, pairs, split: str) -> None:
  """The datastore must not hold the targets being translated (its meta.json records the split's pairs by
  fingerprint and name); --allow_split_overlap lets it through on purpose."""
  from trime_jax.mt import datastore as mt_datastore

  if ds is None or _ALLOW_OVERLAP.value:
    return
  if ds.meta.get("corpus_fingerprint") == mt_datastore.corpus_fingerprint(pairs.src, pairs.tgt):
    role = "tunes on (--tune tunes on valid)" if split == "valid" and _TUNE.value else f"translates (--split={split})"
    fix = ("Translate another split (--split=valid or test)" if split == "train" else  # as eval_ext says it
           "Build the datastore from the training pairs (trime_jax.launch.build_datastore --split=train)")
    raise overlap_error(_DATASTORE.value, f"the {ds.meta.get('corpus_name') or split} pairs", split, role, fix)


def _check_flag_combinations(out: str) -> None:
  """Flags the run would not read are refused, not ignored (before the model is loaded): --tune reads neither
  the split, the mode nor a distribution's flags; --settings replaces the distribution's flags; --index needs a
  --datastore; --config must be a translation config; --out must be a folder."""
  from trime_jax import data as lm_data
  from trime_jax import exports
  from trime_jax.errors import CheckpointError, ConfigError

  given = lambda *holders: [f"--{h.name}" for h in holders if h.present]
  dist_flags = (_K, _KNN_LAMBDA, _KNN_MT_TEMPERATURE, _TAU, _TAU_PRIME)
  if _TUNE.value:
    unread = given(_SPLIT, _MODE, _SETTINGS, *dist_flags)
    if unread:
      raise ConfigError(f"{', '.join(unread)}: not read by --tune, which tunes on valid every setting of its grids "
                        "for --tune_modes; drop them (translate with the tuned settings afterwards: --settings)")
  else:
    unread = given(_TUNE_BEAM, _TUNE_MODES)
    if unread:
      raise ConfigError(f"{', '.join(unread)}: read by --tune only")
    unread = given(*dist_flags) if _SETTINGS.value else []
    if unread:
      raise ConfigError(f"{', '.join(unread)}: --settings={_SETTINGS.value} sets the distribution (its tuned setting "
                        "for --mode); drop them, or drop --settings")
  if _INDEX.value and not _DATASTORE.value:
    raise ConfigError(f"--index={_INDEX.value} is a datastore's FAISS index: it needs --datastore")
  unread = sorted({a.partition("=")[0] for a in sys.argv[1:] if a.startswith("--config.")
                   and not a.startswith("--config.data.")})
  if unread:  # (a --config.model.* / trime.* override was accepted and silently ignored: the export's are read)
    raise ConfigError(f"{', '.join(unread)}: not read: translate reads only the data settings of --config "
                      "(--config.data.*); the model and its TRIME settings are the export's, the decoding the flags' "
                      "(--beam, --mode, --k, --tau, ...)")
  # what each mode's distribution reads (mt.decode.distributions.Distribution); the trime modes all of it but T
  reads = {"model": (), "knn_mt": (_K, _KNN_LAMBDA, _KNN_MT_TEMPERATURE), "trime_release": (_K, _TAU)}.get(
      _MODE.value, (_K, _KNN_LAMBDA, _TAU, _TAU_PRIME))
  read_names = {h.name for h in reads}  # (a FlagHolder has no ==)
  # the model alone reads no datastore, with --settings too (its results recorded the datastore and index as if
  # searched, so the same translation without them was refused as another one)
  unread = given(*([_DATASTORE, _INDEX, _NPROBE] if _MODE.value == "model" and not _TUNE.value else []),
                 *(h for h in dist_flags if h.name not in read_names and not (_TUNE.value or _SETTINGS.value)))
  if unread:  # accepted before, and recorded in the results as if used
    raise ConfigError(f"{', '.join(unread)}: not read by --mode={_MODE.value}"
                      + (" (the model alone, no datastore)" if _MODE.value == "model" else "") + "; drop "
                      + ("them" if len(unread) > 1 else "it") + " or choose the --mode that reads "
                      + ("them" if len(unread) > 1 else "it"))
  checkpoint = _CHECKPOINT.value
  meta_path = os.path.join(checkpoint, "meta.json")
  meta = lm_data.read_json(meta_path, "MT export meta", CheckpointError) if os.path.isfile(meta_path) else {}
  if meta.get("model_family") != "mt" and "params_digest" in meta:  # an export, of a language model
    raise ConfigError(f"--checkpoint={checkpoint} is a language-model export, not a translation one: translate "
                      "needs an export of trime_jax.launch.train_mt (a language model is evaluated with "
                      "trime_jax.launch.eval)")
  if _CONFIG.value is not None and not exports.is_mt_config(_CONFIG.value):
    raise ConfigError("--config is not a translation config (task='mt', e.g. configs/ui_de_en.py); without "
                      "--config the export's own data settings are used")
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f"--out={out} is a file: give an output folder")


def _check_settings_are_this_models(path: str, params_digest, ds) -> None:
  """A tuned.json records the model and datastore it was tuned with (since 2026-12-03; older ones are read
  unchecked): another model's settings are refused."""
  from trime_jax.errors import ConfigError

  try:
    with open(path) as f:
      tuned = json.load(f)
  except (OSError, ValueError, UnicodeDecodeError) as e:
    raise ConfigError(f"cannot read tuned settings {path}: {e}") from None
  if not isinstance(tuned, dict) or "chosen" not in tuned:
    raise ConfigError(f"{path} is not a tuned.json of trime_jax.launch.translate --tune (no 'chosen' settings)")
  if tuned.get("params_digest") and tuned["params_digest"] != params_digest:
    raise ConfigError(f"--settings={path} was tuned for another model ({tuned.get('checkpoint', '?')}, params "
                      f"{tuned['params_digest']}; this export's: {params_digest}): tune this one with --tune")
  there = tuned.get("datastore_fingerprint")
  if there and ds is not None and ds.meta.get("fingerprint") != there:
    raise ConfigError(f"--settings={path} was tuned with another datastore (fingerprint {there}; --datastore's: "
                      f"{ds.meta.get('fingerprint')}): tune with this one")


# What makes two translations of a split the same run: a rerun of it recomputes its files, another replaces them
# only with --overwrite. The pairs translated are data_digest's (max_sentences is recorded, not compared: a
# --max_sentences at or above the split's size translates the whole split, as 0 does)
SAME_RUN_FIELDS = ("params_digest", "datastore_fingerprint", "index", "data_digest", "setting", "beam", "lenpen",
                   "max_len_a", "max_len_b")


# SAME_RUN_FIELDS that earlier versions of translate did not record: a result without one is refused as such
# (it may be another translation; nobody can tell), not for a difference nobody measured
FIELDS_SINCE_2026_12 = ("index", "data_digest")


def _index_record(index) -> dict | None:
  """What a translation's retrieval searched: the FAISS index's kind, file digest (its sidecar's) and, for an
  IVF-PQ index, nprobe (another nprobe retrieves other neighbours, so other translations; an exact index searches
  every key whatever nprobe says)."""
  if index is None:
    return None
  record = {"kind": index.kind, "file_digest": index.info.get("file_digest")}
  if index.kind == "ivfpq":
    record["nprobe"] = index.nprobe
  return record


def _compared(field: str, value):
  """A recorded field as this version records it: results of 2026-12-04 recorded nprobe for an exact index too."""
  if field == "index" and isinstance(value, dict) and value.get("kind") != "ivfpq":
    return {k: v for k, v in value.items() if k != "nprobe"}
  return value


def _data_digest(pairs) -> str:
  """SHA-256 of the split's source and reference texts as translated (after --max_sentences): the same split
  of other data (another --config.data.path) is another run."""
  import hashlib

  h = hashlib.sha256()
  for src, tgt in zip(pairs.src_text, pairs.tgt_text):
    h.update(src.encode() + b"\t" + tgt.encode() + b"\n")
  return h.hexdigest()[:16]


def _check_replaces_only_the_same_run(out: str, name: str, record: dict) -> None:
  """<out>/<name>.json of another run (a SAME_RUN_FIELDS field it records differs; not a translate result) is
  refused without --overwrite: a translation with other settings does not silently replace an earlier result. One
  that lacks a field of FIELDS_SINCE_2026_12 (an earlier version's) is refused as such: it may be another."""
  from trime_jax.errors import ConfigError

  path = os.path.join(out, f"{name}.json")
  if _OVERWRITE.value or not os.path.lexists(path):
    return
  try:
    with open(path) as f:
      earlier = json.load(f)
  except (OSError, ValueError, UnicodeDecodeError):
    earlier = None
  if isinstance(earlier, dict):
    unrecorded = [k for k in FIELDS_SINCE_2026_12 if k not in earlier]
    differ = [k for k in SAME_RUN_FIELDS if k not in unrecorded and _compared(k, earlier.get(k)) != record.get(k)]
    if not differ and not unrecorded:
      return
    if not differ:
      raise ConfigError(f"--out={out} already holds {name}.json written by an earlier version, which did not record "
                        f"{', '.join(unrecorded)}: it may be another translation (another index or data). Choose "
                        "another --out, or give --overwrite to replace it")
  else:
    differ = ["not a result of trime_jax.launch.translate"]
  raise ConfigError(f"--out={out} already holds {name}.json of another translation ({', '.join(differ)} differ): "
                    "choose another --out, or give --overwrite to replace it")


TUNE_FILE = re.compile(r"valid\.tune\.[a-z_]+\.[0-9]+\.(hyp|json)")  # a tuning's finalists (translate_split)


def _check_replaces_only_the_same_tuning(out: str, tuning: dict) -> None:
  """A tuned.json of this model and datastore is replaced only by the same tuning (modes, finalists, search,
  valid pairs, index: `tuning`) unless --overwrite: another one silently replaced it, and left the earlier
  tuning's finalists beside the new ones (`_remove_stale_finalists`). A tuned.json of before 2026-12-07 records
  no tuning and is replaced as before."""
  from trime_jax.errors import ConfigError

  path = os.path.join(out, "tuned.json")
  if not _OVERWRITE.value and os.path.isfile(path):
    try:
      with open(path) as f:
        earlier = json.load(f).get("tuning")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
      earlier = None
    if isinstance(earlier, dict):
      differ = [k for k in tuning if k in earlier and _compared(k, earlier[k]) != tuning[k]]
      if differ:
        raise ConfigError(f"--out={out} already holds tuned settings of another tuning ({', '.join(differ)} "
                          "differ): choose another --out, or give --overwrite to replace them")


def _remove_stale_finalists(out: str, written) -> None:
  """An earlier tuning's finalists (valid.tune.*) this one did not write again, once its tuned.json is written (a
  tuning stopped before that leaves the earlier tuned.json with finalists of its own)."""
  for name in os.listdir(out):
    if TUNE_FILE.fullmatch(name) and name.rsplit(".", 1)[0] not in written:
      os.remove(os.path.join(out, name))


def _data(config, checkpoint, split, vocab, limit, ds=None):
  from trime_jax.mt import data as mt_data
  from trime_jax.mt import datastore as mt_datastore

  pairs = mt_data.load_parallel(mt_datastore.mt_config(config, checkpoint), split, vocab)
  _check_overlap(ds, pairs, split)  # the whole split: --max_sentences takes a prefix of it
  return pairs.head(limit)


def translate_split(translator, pairs, vocab, out_dir, name, extra):
  """Decode `pairs`, write <name>.hyp and <name>.json; returns the JSON dict."""
  from trime_jax import data as lm_data
  from trime_jax.mt import bleu

  t0 = time.perf_counter()
  hyps = translator.translate(pairs.src, batch_sentences=_BATCH.value)
  seconds = time.perf_counter() - t0
  text = [pairs.text(h.tokens) for h in hyps]  # detokenised as the references are (Moses: the fairseq format)
  result = {**bleu.corpus_bleu(text, pairs.tgt_text), "split": pairs.split, "sentences": len(text),
            "seconds": round(seconds, 3), "sentences_per_s": round(len(text) / max(seconds, 1e-9), 3),
            "retrieval_seconds": round(translator.search_seconds, 3), "beam": translator.options.beam,
            "lenpen": translator.options.lenpen, **extra}
  os.makedirs(out_dir, exist_ok=True)
  lm_data.atomic_write_text(os.path.join(out_dir, f"{name}.hyp"), "".join(t.replace("\n", " ") + "\n" for t in text))
  lm_data.atomic_write_json(os.path.join(out_dir, f"{name}.json"), result)
  return result


def main(argv):
  """Checks, then the translation or tuning under --out's lock: two runs into one --out would each write a .hyp
  and a .json, and the survivors could be of two runs."""
  del argv
  from trime_jax.errors import ConfigError
  from trime_jax.runtime.lock import beside as lock_beside

  out = _OUT.value
  if not str(out or "").strip():
    raise ConfigError("--out is empty: give the folder to write the translations to")
  _check_flag_combinations(out)
  made = not os.path.lexists(out)
  try:  # writable before the model loads and the split is decoded, not after
    os.makedirs(out, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--out={out}: cannot create it ({os.strerror(e.errno)})") from None
  try:
    if not os.access(out, os.W_OK | os.X_OK):
      raise ConfigError(f"--out={out}: no permission to write in it")
    with lock_beside(out, f"translation output --out={out}"):
      _main(out)
  except BaseException:
    if made:  # a run refused (or stopped) before it wrote anything leaves no empty --out behind
      try:
        os.rmdir(out)
      except OSError:
        pass  # it holds what the run wrote
    raise


def _main(out: str) -> None:
  from trime_jax import data as lm_data
  from trime_jax.errors import CheckpointError, ConfigError
  from trime_jax.mt import data as mt_data
  from trime_jax.mt import datastore as mt_datastore
  from trime_jax import specs
  from trime_jax.mt import export as mt_export

  checkpoint = _CHECKPOINT.value
  graphdef, params, config, vocab = mt_export.load_mt_export(checkpoint)
  # what tuned.json records and --settings compares (load_mt_export checked the parameters against it)
  params_digest = lm_data.read_json(os.path.join(checkpoint, "meta.json"), "MT export meta",
                                    CheckpointError).get("params_digest")
  cfg = specs.mt_model_config(config, vocab_size=vocab.size, tgt_vocab_size=vocab.target_size)
  options = decode.SearchOptions(beam=_BEAM.value, lenpen=_LENPEN.value, max_len_a=_MAX_LEN_A.value,
                                 max_len_b=_MAX_LEN_B.value)
  ds = index = None
  if _DATASTORE.value:
    ds, index = mt_datastore.open_mt_datastore(_DATASTORE.value, checkpoint, index_path=_INDEX.value,
                                               nprobe=_NPROBE.value)
  make = lambda dist, opts=options: decode.Translator(graphdef, params, cfg, dist=dist, datastore=ds, index=index,
                                                     options=opts, eos_id=vocab.eos_id)
  if _TUNE.value:
    if ds is None:
      raise ConfigError("--tune needs --datastore")
    earlier = os.path.join(out, "tuned.json")
    if os.path.isfile(earlier) and not _OVERWRITE.value:  # replaced by a tuning of the same model and datastore
      try:
        _check_settings_are_this_models(earlier, params_digest, ds)
      except ConfigError as e:
        raise ConfigError(f"--out={out} already holds tuned settings of another model or datastore ({e}); "
                          "choose another --out, or give --overwrite to replace them") from None
    pairs = _data(_CONFIG.value, checkpoint, "valid", vocab, _MAX_SENTENCES.value, ds)
    modes = tuple(_TUNE_MODES.value)
    tuning = {"tune_modes": sorted(set(modes)), "tune_beam": _TUNE_BEAM.value, "beam": options.beam,
              "lenpen": options.lenpen, "max_len_a": options.max_len_a, "max_len_b": options.max_len_b,
              "data_digest": _data_digest(pairs), "index": _index_record(index)}
    _check_replaces_only_the_same_tuning(out, tuning)
    t0 = time.perf_counter()
    tp = decode.tune_pass(graphdef, params, pairs, ds, index, k_max=max(decode.KS), modes=modes)
    trime_cfg = config.get("trime")
    rows = decode.tune(tp, modes=modes, train_tau=float(trime_cfg.get("tau", 1.0)) if trime_cfg else 1.0)
    print(f"tune: one teacher-forced pass over {len(tp.targets):,} valid target tokens + {len(rows)} settings in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    tuned, table, written = {}, [], set()
    for mode in ("model", "knn_mt", "trime", "trime_interp", "trime_release"):
      best = [r for r in rows if r["mode"] == mode][:_TUNE_BEAM.value]
      for r in best:
        name = f"valid.tune.{mode}.{len(table)}"
        written.add(name)
        res = translate_split(make(r["setting"]), pairs, vocab, out, name, {"setting": dataclasses.asdict(r["setting"]),
                                                                             "valid_nll": r["nll"]})
        table.append(res)
        print(f"tune: {mode:12s} {r['setting']}  valid nll {r['nll']:.4f}  valid BLEU {res['bleu']:.2f}", flush=True)
        if mode not in tuned or res["bleu"] > tuned[mode]["bleu"]:
          tuned[mode] = {"setting": dataclasses.asdict(r["setting"]), "bleu": res["bleu"], "valid_nll": r["nll"]}
    from trime_jax import data as lm_data

    lm_data.atomic_write_json(os.path.join(out, "tuned.json"), {
        "checkpoint": os.path.abspath(checkpoint), "params_digest": params_digest,
        "datastore_fingerprint": ds.meta.get("fingerprint"), "tuning": tuning, "chosen": tuned, "nll_grid": [{**{k: v for k, v in r.items() if k != "setting"},
                                       "setting": dataclasses.asdict(r["setting"])} for r in rows]})
    _remove_stale_finalists(out, written)
    print(f"tune: best settings -> {os.path.join(out, 'tuned.json')}", flush=True)
    return
  if _MODE.value in ("trime_interp", "trime_best") and not _SETTINGS.value:
    raise ConfigError(f"--mode={_MODE.value} selects a tuned setting: give --settings=<tune out>/tuned.json "
                      "(or --mode=trime with --knn_lambda / --tau_prime)")
  family = "trime" if _MODE.value in ("trime", "trime_interp", "trime_best") else _MODE.value
  dist = decode.Distribution(family, k=_K.value, knn_mt_temperature=_KNN_MT_TEMPERATURE.value,
                             knn_lambda=_KNN_LAMBDA.value, tau=_TAU.value, tau_prime=_TAU_PRIME.value)
  if _SETTINGS.value:
    _check_settings_are_this_models(_SETTINGS.value, params_digest, ds)
    dist = decode.Distribution.from_tuned(_SETTINGS.value, _MODE.value)
    if dist.mode == "knn_mt" and not dist.candidates:  # tuned before 2026-12-06: not what was tuned
      print(f"warning: {_SETTINGS.value} was tuned before settings recorded their L2 candidates: kNN-MT re-ranks "
            f"16 · K = {16 * dist.k} inner-product candidates here, while the tuning re-ranked 16 · 64; tune again "
            "to decode with the neighbours the tuning measured", flush=True)
  split = mt_data.split_name(_SPLIT.value)  # --split=dev is valid, as build_datastore reads it
  # another search than the paper's (beam 4, lenpen 0.6) is named in the files: greedy and beam translations of a
  # split sit side by side in one --out (each was refused as the other's rerun)
  name = f"{split}.{_MODE.value}" + "".join(
      f".{k}{v:g}" for k, v in (("beam", options.beam), ("lenpen", options.lenpen))
      if v != getattr(decode.EVAL_SEARCH, k))
  pairs = _data(_CONFIG.value, checkpoint, split, vocab, _MAX_SENTENCES.value, ds)
  record = {"setting": dataclasses.asdict(dist), "params_digest": params_digest,
            "datastore_fingerprint": ds.meta.get("fingerprint") if ds is not None else None,
            "index": _index_record(index), "data_digest": _data_digest(pairs),
            "max_len_a": options.max_len_a, "max_len_b": options.max_len_b, "max_sentences": _MAX_SENTENCES.value}
  _check_replaces_only_the_same_run(out, name, {**record, "beam": options.beam, "lenpen": options.lenpen})
  res = translate_split(make(dist), pairs, vocab, out, name, record)
  print(json.dumps(res), flush=True)


if __name__ == "__main__":
  run_main(main)
