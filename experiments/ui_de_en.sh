#!/bin/bash
# Issue 15: TrimeMT_ext on ui-de-en (German→English UI strings, ../shared/data/ui-de-en), CPU-sized model
# (configs/ui_de_en.py: 3+3 layers, d 256, FFN 1024, 4 heads, 8k joint sentencepiece vocabulary).
# Every model: the same budget of target tokens trained on (BUDGET, default 4,000,000 ≈ 2.5 epochs: vanilla's
# length-sorted batches hold ~3,300 target tokens per 4,096-token update, BM25/random batches ~1,100 since they
# mix lengths, so those run ~3x the updates), seed 0.
#
#   bash experiments/ui_de_en.sh spm              # the joint sentencepiece model (cached under runs/cache/ui_de_en)
#   bash experiments/ui_de_en.sh train NAME       # NAME: vanilla | trime_bm25 | trime_random
#                                                 #   one chunk of at most CHUNK seconds (default 1800); rerun the
#                                                 #   same command to continue (it resumes from the last checkpoint)
#
# SEED=1 repeats under runs/ui_de_en_s1. Commit commands and results, never checkpoints.
# (Decoding, datastore, kNN-MT and BLEU subcommands are appended below by the decoding half.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN=${PYBIN:-.venv/bin/python}
PY="nice -n 10 $PYBIN -m"
SEED=${SEED:-0}
OUT=runs/ui_de_en$([ "$SEED" = 0 ] || echo "_s$SEED")
S="--config.train.seed=$SEED"
CHUNK=${CHUNK:-1800}
CFG=configs/ui_de_en.py

overrides_of() {
  case "$1" in
    vanilla) echo "--config.trime.memory=none --config.trime.batching=length" ;;
    trime_bm25) echo "--config.trime.memory=ext --config.trime.batching=bm25" ;;
    trime_random) echo "--config.trime.memory=ext --config.trime.batching=random" ;;
    *) echo "NAME: vanilla | trime_bm25 | trime_random" >&2; exit 2 ;;
  esac
}

case "${1:-}" in
  spm)
    nice -n 10 $PYBIN -c "
import time
from configs import ui_de_en
from trime_jax.mt import data, train
c = ui_de_en.get_config(); train.resolve_data_path(c)
t = time.perf_counter(); v = data.load_vocab(c)
print(f'sentencepiece: {v.size} pieces, fingerprint {v.fingerprint()}, {time.perf_counter() - t:.1f} s')"
    ;;
  train)
    NAME=$2; OV=$(overrides_of "$NAME")
    # A chunk ends with SIGTERM after $CHUNK s: training checkpoints at once and the rerun resumes.
    rc=0; timeout --signal=TERM "$CHUNK" $PY launch.train_mt --config=$CFG --workdir=$OUT/$NAME $S $OV \
      --config.train.target_token_budget=${BUDGET:-4000000} --config.train.num_steps=100000 "${@:3}" || rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 143 ]; then echo "chunk over: rerun 'bash $0 train $NAME' to continue"; exit 0; fi
    exit $rc
    ;;
  *)
    sed -n 2,12p "$0"; exit 2 ;;
esac
