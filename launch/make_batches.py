"""Write a batch-plan file for consecutive (TrimeLM_long) or BM25 (TrimeLM_ext) batching.

  python -m trime_jax.launch.make_batches --config=configs/wikitext_mini_long.py --kind=consecutive \\
      --out=runs/plans/wikitext_mini_long
  python -m trime_jax.launch.make_batches --config=configs/wikitext_mini.py --kind=bm25 --out=runs/plans/bm25

Training reads it with --config.trime.batching=<kind> --config.trime.batch_plan=<out>. A consecutive plan
follows `trime.consecutive_layout` (stream | packed) and prints its real-token fraction (real target tokens
over all row slots).

A rerun onto the same --out keeps the plan there as it was when it computes the same plan (a training reading it
resumes only on the same digest), and refuses another plan there (another kind, corpus, batch size, seed, ...)
without --overwrite.
"""

import contextlib
import os

from absl import flags
from ml_collections import config_flags

from trime_jax.launch.checks import validated
from trime_jax.launch.entry import run_main
from trime_jax.launch.outputs import check_output_path, refuse_target

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
_KIND = flags.DEFINE_enum("kind", None, ["consecutive", "bm25"], "Batching method.")
_OUT = flags.DEFINE_string("out", None, "Output plan directory.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace what --out holds: another plan (of another kind, "
                               "corpus or config) or any other files; without it that is refused, and the same "
                               "plan again is kept as it was.")
flags.mark_flags_as_required(["config", "kind", "out"])


def main(argv):
  del argv
  from trime_jax.batching import plan as batch_plan
  from trime_jax.errors import ConfigError
  from trime_jax.runtime.lock import UnwritableError

  config = _CONFIG.value
  config.trime.batching = _KIND.value  # checked as the training that reads this plan will run (its batching)
  try:
    config = validated(config, training=True)
  except ConfigError as e:  # trime.batching is --kind's here: said so (the user set no trime.batching)
    if "trime.batching" not in str(e):
      raise
    raise ConfigError(f"--kind={_KIND.value} does not suit this config: {e}") from None
  check_output_path(_OUT.value, "out", reads=[("data.path", str(config.data.get("path", "") or "")),
                                              ("--config", config_flags.get_config_filename(flags.FLAGS["config"]))])
  with contextlib.ExitStack() as held:
    try:  # a second make_batches onto this --out is refused while this one runs
      held.enter_context(batch_plan.lock(_OUT.value))
      # a plan whose replacement was killed between its renames is put back before --out is looked at, so it
      # is compared as any plan there is (else a plan of other settings would replace it unasked)
      from trime_jax import data

      data.recover_replaced(os.path.abspath(_OUT.value).rstrip(os.sep))
    except UnwritableError:  # a read-only place: a rerun of the plan there only reads it (a write says why not)
      pass
    _make(config, _OUT.value)


def _make(config, out_dir: str) -> None:
  import importlib

  from trime_jax import corpora
  from trime_jax.batching import plan as batch_plan
  from trime_jax.errors import ConfigError

  # a workdir, an export, ...: never replaced silently, nor a running training's workdir at all
  what = refuse_target(out_dir, "out", "a batch plan", ok=("a batch plan",), overwrite=_OVERWRITE.value)
  splits = corpora.load_splits(config.data)
  planner = importlib.import_module(f"trime_jax.batching.{_KIND.value}")
  old = None
  if what == "a batch plan" and not _OVERWRITE.value:
    old = batch_plan.load(out_dir)
    h, fp = old.header, splits.train.fingerprint()
    if h.get("kind") != _KIND.value or h.get("corpus_fingerprint") != fp:
      raise ConfigError(f"--out={out_dir} already holds a {h.get('kind')} plan of corpus "
                        f"{h.get('corpus_name') or h.get('corpus_fingerprint')}; this one is a {_KIND.value} "
                        f"plan of {splits.train.name} ({fp}): choose another --out (or add --overwrite to replace "
                        "it)")
    # What the config fixes is compared before the planning (BM25 takes minutes on a large corpus).
    want = {"segment_len": int(config.data.segment_len), "batch_size": int(config.train.batch_size),
            "seed": int(config.train.seed)}
    if _KIND.value == "consecutive":
      want.update(consecutive_segments=int(config.trime.consecutive_segments),
                  layout=config.trime.get("consecutive_layout", "stream"))
    else:
      want.update(planner.neighbour_settings(config))  # k, exclude_same_document, bm25_k1, bm25_b, bm25_analyzer
      want["bm25_search"] = "lucene"  # a plan searched by the rule of before 2026-12-08 is another plan
      want["hits_include_query"] = planner.HITS_INCLUDE_QUERY  # a plan whose k were k others is another plan
      if want["exclude_same_document"]:
        want["exclude_by"] = planner.EXCLUDE_BY  # a plan of the earlier rule is another plan
    differ = [f"{k} {h.get(k)!r} != {v!r}" for k, v in want.items() if h.get(k) != v]
    if differ:
      raise ConfigError(f"--out={out_dir} already holds another {_KIND.value} plan of this corpus ("
                        f"{'; '.join(differ)}: that plan's != this config's), which a training may be reading: "
                        "choose another --out (or add --overwrite to replace it)")
  header, batches = planner.make_plan(splits.train, config, progress=True)
  header.setdefault("corpus_name", splits.train.name)  # what the fingerprint is of, for error messages
  if old is not None:
    differ = batch_plan.differences(old, header, batches)
    if not differ:  # kept as it is: a training that reads it resumes only on the same digest
      print(f"unchanged: {out_dir} already holds this plan ({len(batches):,} batches of {batches.shape[1]} "
            "segments); kept as it was")
      return
    raise ConfigError(f"--out={out_dir} already holds another {_KIND.value} plan of this corpus (it differs in "
                      f"{'; '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}), which a training may be "
                      "reading: choose another --out (or add --overwrite to replace it)")
  out = batch_plan.save(out_dir, header, batches)
  print(f"wrote {out}: {len(batches):,} batches of {batches.shape[1]} segments")
  if "real_token_fraction" in header:
    print(f"{header['layout']} layout: {header['num_segments']:,} segments in {header['num_runs']:,} runs of "
          f"{header['consecutive_segments']}, {header['streams']} per micro-batch; "
          f"real-token fraction {header['real_token_fraction']:.4f}")


if __name__ == "__main__":
  run_main(main)
