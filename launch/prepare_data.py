"""Build a paper corpus once as tensorflow-datasets array_record files (no TensorFlow): downloaded from its public
source, or read from a manual dir holding the released files when offline.

  python -m trime_jax.launch.prepare_data --corpus=wikitext103                        # or trime-prepare-data ...
  python -m trime_jax.launch.prepare_data --corpus=enwik8 --manual_dir=~/dl/enwik8    # offline: enwik8.zip there
  python -m trime_jax.launch.prepare_data --corpus=wikitext2 --data_dir=/big/disk/tfds

Then train on it with --config.data.corpus=tfds:<corpus> --config.data.path= (plus
--config.data.tfds_data_dir=<data_dir> if given): corpora.py reads the build with `tfds.data_source`.
"""

from absl import flags

from trime_jax.launch.entry import run_main

_CORPUS = flags.DEFINE_string("corpus", None, "wikitext103 | wikitext2 | enwik8 (a `tfds:` prefix is accepted).")
_MANUAL_DIR = flags.DEFINE_string("manual_dir", "", "Directory with the released files (offline); empty: download.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets).")
flags.mark_flags_as_required(["corpus"])


def main(argv):
  del argv
  import os

  from trime_jax import tfds_builders
  from trime_jax.errors import ConfigError

  name = _CORPUS.value.removeprefix("tfds:")
  if name not in tfds_builders.NAMES:
    raise ConfigError(f"--corpus must be one of {tfds_builders.NAMES}, got {_CORPUS.value!r}")
  manual = os.path.expanduser(_MANUAL_DIR.value) if _MANUAL_DIR.value else ""
  if manual and not os.path.isdir(manual):
    raise ConfigError(f"manual dir for {name} " + (f"is a file, not a folder: {manual} (give the folder that holds "
                      "it)" if os.path.exists(manual) else f"not found: {manual}") + " (--manual_dir)")
  data_dir = os.path.expanduser(_DATA_DIR.value) if _DATA_DIR.value else ""
  if data_dir and os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise ConfigError(f"--data_dir={_DATA_DIR.value} is a file, not a folder")
  reused = tfds_builders.is_prepared(tfds_builders.builder(name, _DATA_DIR.value))
  b = tfds_builders.prepare(name, _DATA_DIR.value, manual)
  if reused:  # said: a build is never made again, whatever --manual_dir holds now; its files read back first
    records = tfds_builders.check_build(name, b)
    print(f"reused the build already in {b.data_dir} (every one of its {records:,} records read back; "
          "--manual_dir is not read again; delete that folder to rebuild)")
  unit = "chunks of 1 MiB" if name == "enwik8" else "articles"
  for split, info in sorted(b.info.splits.items()):
    print(f"{name} {split}: {info.num_examples:,} {unit}")
  if "train" not in b.info.splits:
    print(f"note: no train split (the source had no training file): this build serves evaluation only; for "
          f"training, delete {b.data_dir} and rerun with the full release")
  print(f"built in {b.data_dir}; train with --config.data.corpus=tfds:{name} --config.data.path="
        + (f" --config.data.tfds_data_dir={_DATA_DIR.value}" if _DATA_DIR.value else ""))


if __name__ == "__main__":
  run_main(main)
