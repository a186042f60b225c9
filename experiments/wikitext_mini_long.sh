#!/bin/bash
# TrimeLM_long evidence on wikitext-mini (docs/long_memory.md): 1,000-update trainings with consecutive batches
# (the stream layout of the original, or our packed layout), then the dev sweep over long-term memory sizes.
#
#   bash experiments/wikitext_mini_long.sh train stream|packed     # plan + training under runs/long_LAYOUT
#   bash experiments/wikitext_mini_long.sh sweep stream|packed     # dev sweep -> runs/sweep/dev1k_long_LAYOUT.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY="nice -n 10 .venv/bin/python -m"
CFG=configs/wikitext_mini_long.py
LAYOUT=${2:?layout: stream | packed}
PLAN=runs/plans/wikitext_mini_long_$LAYOUT
L="--config.trime.consecutive_layout=$LAYOUT --config.trime.batch_plan=$PLAN --config.train.num_steps=1000"
SWEEP=--mem_sizes=0,1024,2048,4096,8192,16384

case "${1:-}" in
  train)
    $PY trime_jax.launch.make_batches --config=$CFG --kind=consecutive --out=$PLAN $L
    $PY trime_jax.launch.train --config=$CFG --workdir=runs/long_$LAYOUT $L
    ;;
  sweep)
    mkdir -p runs/sweep
    $PY trime_jax.launch.eval --config=$CFG --checkpoint=runs/long_$LAYOUT/export --config.eval.tune=True $SWEEP \
      --label="TrimeLM_long ($LAYOUT)" --output=runs/sweep/dev1k_long_$LAYOUT.json
    ;;
  *) echo "usage: $0 train|sweep stream|packed" >&2; exit 2 ;;
esac
