#!/bin/bash
# TrimeLM_ext evidence on wikitext-mini (docs/external_memory.md): TrimeLM_ext vs kNN-LM and the two ablations,
# equal training budgets (1000 updates of 8 × 256 tokens), datastore = the training split.
#
#   bash experiments/wikitext_mini_ext.sh plans               # BM25 plans: Algorithm 1 as published, and with
#                                                             #   same-document exclusion
#   bash experiments/wikitext_mini_ext.sh train NAME          # one training: bm25 | bm25_excl | random | stopgrad
#                                                             #   | vanilla
#   bash experiments/wikitext_mini_ext.sh eval NAME           # datastore + index + tuned evaluation of runs/ext/NAME
#   bash experiments/wikitext_mini_ext.sh throughput          # IVF-PQ index, K=1024, nprobe=32: with vs without
#
# SEED=1 bash experiments/wikitext_mini_ext.sh ...   repeats the runs with another seed (model initialisation,
# drop-local draws, batch order, BM25 packing) under runs/ext_s1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="nice -n 10 .venv/bin/python -m"
CFG=configs/wikitext_mini_ext.py
SEED=${SEED:-0}
if [ "$SEED" = 0 ]; then OUT=runs/ext; PLAN=runs/plans/wikitext_mini_bm25
else OUT=runs/ext_s$SEED; PLAN=runs/plans/wikitext_mini_bm25_s$SEED; fi
S="--config.train.seed=$SEED"
ALG1="--config.trime.bm25_exclude_same_document=False --config.trime.batch_plan=$PLAN"
EXCL="--config.trime.bm25_exclude_same_document=True --config.trime.batch_plan=${PLAN}_excl"

case "${1:-}" in
  plans)
    $PY trime_jax.launch.make_batches --config=$CFG --kind=bm25 --out=$PLAN $S $ALG1
    $PY trime_jax.launch.make_batches --config=$CFG --kind=bm25 --out=${PLAN}_excl $S $EXCL
    ;;
  train)
    case "${2:-}" in
      bm25) $PY trime_jax.launch.train --config=$CFG --workdir=$OUT/bm25 $S $ALG1 ;;             # TrimeLM_ext (Algorithm 1)
      bm25_excl) $PY trime_jax.launch.train --config=$CFG --workdir=$OUT/bm25_excl $S $EXCL ;;   # BM25, other documents only
      random) $PY trime_jax.launch.train --config=$CFG --workdir=$OUT/random $S --config.trime.batching=random ;;  # w/o BM25
      stopgrad) $PY trime_jax.launch.train --config=$CFG --workdir=$OUT/stopgrad $S $ALG1 \
                  --config.trime.stop_gradient_memory=True ;;                          # w/o back-prop to memory
      vanilla) $PY trime_jax.launch.train --config=configs/wikitext_mini.py --workdir=$OUT/vanilla $S \
                 --config.trime.memory=none ;;                                         # kNN-LM's LM
      *) echo "train NAME: bm25 | bm25_excl | random | stopgrad | vanilla" >&2; exit 2 ;;
    esac
    ;;
  eval)
    NAME=${2:?usage: $0 eval NAME (bm25 | bm25_excl | random | stopgrad | vanilla)}
    $PY trime_jax.launch.build_datastore --config=$CFG --checkpoint=$OUT/$NAME/export --out=$OUT/$NAME/ds --index=flat
    # every family's τ, τ′, λ, θ tuned on dev (grid), then applied to test; both are reported
    $PY trime_jax.launch.eval_ext --config=$CFG --checkpoint=$OUT/$NAME/export --config.eval.datastore=$OUT/$NAME/ds \
      --config.eval.tune=True --config.eval.split=test --output=$OUT/$NAME/eval_ext.json > $OUT/$NAME/eval_ext.txt
    ;;
  throughput)
    $PY trime_jax.launch.build_datastore --config=$CFG --checkpoint=$OUT/bm25/export --out=$OUT/bm25/ds_ivfpq --index=ivfpq \
      --nlist=1024 --pq_m=16
    $PY trime_jax.launch.eval_ext --config=$CFG --checkpoint=$OUT/bm25/export --config.eval.datastore=$OUT/bm25/ds_ivfpq \
      --config.eval.split=test --config.eval.max_tokens=16384 --throughput_tokens=16384 \
      --output=$OUT/bm25/throughput.json > $OUT/bm25/throughput.txt
    ;;
  *) echo "usage: $0 plans | train NAME | eval NAME | throughput" >&2; exit 2 ;;
esac
