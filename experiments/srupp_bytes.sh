#!/bin/bash
# SRU++ vs Transformer with TrimeLM_long on a byte-level corpus (Tiny Shakespeare, ../shared/data), equal
# budgets: 200 updates of 16 × 128 bytes each (410k training bytes), same optimizer settings
# (configs/bytes_srupp.py; STEPS=... to change the budget). Test bits per byte of the first 32,768 test bytes, with local memory only
# (mem 0) and with a 1,536-byte long-term store (12 segments, the paper's 6,144 / 512 ratio).
#
#   bash experiments/srupp_bytes.sh          # all models: plans, training, evaluation -> runs/srupp_bytes
#   TUNE=0 WARMUP=0 bash experiments/srupp_bytes.sh   # without the τ-tuned evaluations / the CE warm-up variant
#   PYTHON=/path/to/python bash experiments/srupp_bytes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PY="nice -n 10 $PYTHON -m"
OUT=runs/srupp_bytes
mkdir -p $OUT
MEM=--mem_sizes=0,1536
STEPS=${STEPS:-200}
S=configs/bytes_srupp.py
T=configs/bytes_srupp.py:transformer
TRAIN="--config.train.num_steps=$STEPS"
EVAL="--config.eval.split=test"

# 1. SRU++ vanilla (CE only; its state still runs along the stream)
$PY trime_jax.launch.make_batches --config=$S --kind=consecutive --out=$OUT/plan_srupp --config.trime.batch_plan=$OUT/plan_srupp
$PY trime_jax.launch.train --config=$S --workdir=$OUT/srupp_vanilla --config.trime.memory=none $TRAIN \
  --config.trime.batch_plan=$OUT/plan_srupp
$PY trime_jax.launch.eval --config=$S --checkpoint=$OUT/srupp_vanilla/export --config.eval.memory=none $EVAL \
  --label="SRU++ vanilla" --output=$OUT/srupp_vanilla.json
# 2. SRU++ + TrimeLM_long (current + previous segment in training; local + long-term memory at test)
$PY trime_jax.launch.train --config=$S --workdir=$OUT/srupp_long --config.trime.batch_plan=$OUT/plan_srupp $TRAIN
$PY trime_jax.launch.eval --config=$S --checkpoint=$OUT/srupp_long/export $EVAL $MEM \
  --label="SRU++ TrimeLM_long" --output=$OUT/srupp_long.json
# 3. Transformer TrimeLM_long of similar size (runs of 4 consecutive segments)
$PY trime_jax.launch.make_batches --config=$T --kind=consecutive --out=$OUT/plan_transformer \
  --config.trime.batch_plan=$OUT/plan_transformer
$PY trime_jax.launch.train --config=$T --workdir=$OUT/transformer_long --config.trime.batch_plan=$OUT/plan_transformer $TRAIN
$PY trime_jax.launch.eval --config=$T --checkpoint=$OUT/transformer_long/export $EVAL $MEM \
  --label="Transformer TrimeLM_long" --output=$OUT/transformer_long.json
# 4. The two TrimeLM_long models with τ tuned on dev (one pass over the τ grid), applied to test
if [ "${TUNE:-1}" = 1 ]; then
  $PY trime_jax.launch.eval --config=$S --checkpoint=$OUT/srupp_long/export $EVAL --mem_sizes=1536 --config.eval.tune=True \
    --config.eval.max_tokens=16384 --label="SRU++ TrimeLM_long (tuned)" --output=$OUT/srupp_long_tuned.json
  $PY trime_jax.launch.eval --config=$T --checkpoint=$OUT/transformer_long/export $EVAL --mem_sizes=1536 \
    --config.eval.tune=True --config.eval.max_tokens=16384 --label="Transformer TrimeLM_long (tuned)" \
    --output=$OUT/transformer_long_tuned.json
fi
# 5. SRU++ TrimeLM_long with plain CE for the first half of the budget (the Transformer recipe's CE warm-up)
if [ "${WARMUP:-1}" = 1 ]; then
  $PY trime_jax.launch.train --config=$S --workdir=$OUT/srupp_long_ce_warmup --config.trime.batch_plan=$OUT/plan_srupp $TRAIN \
    --config.trime.ce_warmup_steps=$((STEPS / 2))
  $PY trime_jax.launch.eval --config=$S --checkpoint=$OUT/srupp_long_ce_warmup/export $EVAL $MEM \
    --label="SRU++ TrimeLM_long (CE warm-up)" --output=$OUT/srupp_long_ce_warmup.json
fi
