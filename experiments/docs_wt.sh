#!/bin/bash
# Issue 17: the paper's tables at one-fifth of WikiText-103 (docs-wt, 19M tokens; linux-doc-6.1 held out).
# Every model: configs/docs_wt*.py, the same budget (1,200 updates × 8 × 512 tokens = 4.9M tokens), seed 0.
#
#   bash experiments/docs_wt.sh plans            # consecutive (TrimeLM_long) and BM25 (TrimeLM_ext) batch plans
#   bash experiments/docs_wt.sh train NAME       # NAME: vanilla | local | long | ext | ext_random | ext_stopgrad
#                                                #   (issue 38: ext_p05 / ext_p099, TrimeLM_ext with p = 0.5 / 0.99)
#                                                #   one chunk of at most CHUNK seconds (default 1800); rerun the
#                                                #   same command to continue (it resumes from the last checkpoint)
#   bash experiments/docs_wt.sh datastore NAME   # keys of every training token (~16M), IVF-PQ index
#   bash experiments/docs_wt.sh partial NAME     # the same build, stopped once the largest of SIZES is done (the
#                                                #   sweep's sizes without the whole build; `datastore` resumes it)
#   bash experiments/docs_wt.sh eval NAME        # test perplexities without the datastore, tuned on dev
#   bash experiments/docs_wt.sh eval_ext NAME    # with the full datastore: kNN-LM families, TrimeLM_ext
#   bash experiments/docs_wt.sh sizes NAME       # datastore-size sweep: first 1M / 4M entries vs all (17.8M); a
#                                                #   size can be taken while the full build is still running
#   bash experiments/docs_wt.sh domain NAME      # linux-doc-6.1 test: kernel datastore vs training datastore
#                                                #   (DOMAIN_MATCHED=1: the training one cut to the kernel one's size;
#                                                #   DATASTORES=ds: evaluate only the whole training one)
#   bash experiments/docs_wt.sh exact NAME       # (an accelerator) every training key on the device, exact scores
#   bash experiments/docs_wt.sh ext3 NAME        # (an accelerator) IVF-PQ on the CPUs / on the GPU / exact on the
#                                                #   device: tokens/s and perplexity on the same test tokens
#
#   bash experiments/docs_wt.sh dir              # prints this STEPS / SEED's directory (runs/docs_wt_12k_s1, ...)
#
# SEED=1 repeats under runs/docs_wt_s1 (the BM25 models read their seed's own plan, runs/plans/docs_wt_bm25_s1;
# `SEED=1 ... plans` writes it). Commit commands and results, never checkpoints.
#
# STEPS (issue 38; default 1200, the budget above; 1200 passes no flag, so every earlier command is unchanged):
# STEPS=12000 trains under runs/docs_wt_12k[_sSEED] (STEPS=N: runs/docs_wt_<N/1000>k if a multiple of 1,000,
# else runs/docs_wt_<N>u), every other command (datastore, eval, ...) reads that directory. The schedule is
# re-sized with the run (experiments/docs_wt_long_plan.md says why):
#   - inverse-sqrt kept (the paper's schedule for its 7M model), peak 1e-3 kept (the 1,200-update models').
#     After the warm-up lr(t) = 1e-3 * sqrt(W / t), so the warm-up W is the schedule's only length. It is
#     WARMUP=STEPS/10 by default (1,200 at 12,000): the 1,200-update schedule stretched ten times, every
#     milestone at the same fraction of the run (peak at 10%, the end at 0.32 of the peak, 3.2e-4) and the CE
#     warm-up (trime.ce_warmup_steps=-1: 5%, 600 updates) inside the LR warm-up as before, so the longer
#     models differ from the old ones in the number of updates only. W = 120 kept would end at 1.0e-4 (a
#     different shape, not just a longer run); WARMUP=480 is the paper's fraction (8,000 of 200,000: 4%, ending
#     at 2.0e-4, its TRIME loss starting after the LR peak as in the paper).
#   - EVAL_EVERY=STEPS/20 (600: 20 points of the dev curve on the first 50,000 dev tokens, ~2 s each on an
#     H200), CKPT_EVERY=500 (a killed chunk loses at most 500 updates; SIGTERM checkpoints at once anyway).
#   - the batch plans need nothing: a plan holds one epoch and training past its end reads the next epoch
#     (batching/plan.py: epoch e = micro-batch // num_batches; BM25 batches in a new seeded order each epoch,
#     the consecutive stream in stored order every epoch, as the original's --keep-order); 12,000 updates are
#     2.76 epochs of the 4,349 batches.
#   - dropout 0.1 and everything else as the 1,200-update configs (`best/` keeps the lowest-dev-perplexity
#     parameters in case the longer run over-fits).
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN=${PYBIN:-.venv/bin/python}
PY="nice -n 10 $PYBIN -m"
SEED=${SEED:-0}
STEPS=${STEPS:-1200}
if [ "$STEPS" = 1200 ]; then TAG=""
elif [ $((STEPS % 1000)) = 0 ]; then TAG="_$((STEPS / 1000))k"
else TAG="_${STEPS}u"; fi
OUT=runs/docs_wt$TAG$([ "$SEED" = 0 ] || echo "_s$SEED")
S="--config.train.seed=$SEED"
CHUNK=${CHUNK:-1800}
SCHED=""  # 1200: the configs' own schedule (no flag), as every 1,200-update result was made
if [ "$STEPS" != 1200 ]; then
  WARMUP=${WARMUP:-$((STEPS / 10))}; EVAL_EVERY=${EVAL_EVERY:-$((STEPS / 20))}; CKPT_EVERY=${CKPT_EVERY:-500}
  SCHED="--config.train.num_steps=$STEPS --config.train.warmup_steps=$WARMUP --config.train.eval_every=$EVAL_EVERY"
  SCHED="$SCHED --config.train.checkpoint_every=$CKPT_EVERY"
fi
BM25_PLAN=runs/plans/docs_wt_bm25$([ "$SEED" = 0 ] || echo "_s$SEED")  # Algorithm 1's packing depends on the seed

ds_complete() {  # a finished datastore build in $1 (meta.json's `complete`)
  $PYBIN -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('complete'))" "$1/meta.json" 2>/dev/null
}
config_of() {
  case "$1" in
    vanilla|local) echo configs/docs_wt.py ;;
    long) echo configs/docs_wt_long.py ;;
    ext|ext_random|ext_stopgrad|ext_p05|ext_p099) echo configs/docs_wt_ext.py ;;
    *) echo "NAME: vanilla | local | long | ext | ext_random | ext_stopgrad | ext_p05 | ext_p099" >&2; exit 2 ;;
  esac
}
overrides_of() {
  case "$1" in
    vanilla) echo "--config.trime.memory=none" ;;
    ext_random) echo "--config.trime.batching=random" ;;
    ext_stopgrad) echo "--config.trime.stop_gradient_memory=True" ;;
    ext_p05) echo "--config.trime.drop_local_prob=0.5" ;;  # issue 38: the drop-local probability p (0.9 as
    ext_p099) echo "--config.trime.drop_local_prob=0.99" ;;  #   published) at 0.5 and 0.99
    *) echo "" ;;
  esac
}
plan_of() {  # the BM25 models of SEED != 0 read their seed's plan (seed 0: the config's runs/plans/docs_wt_bm25)
  case "$1" in
    ext|ext_stopgrad|ext_p05|ext_p099) [ "$SEED" = 0 ] || echo "--config.trime.batch_plan=$BM25_PLAN" ;;
  esac
}

case "${1:-}" in
  plans)  # the consecutive stream plan does not depend on the seed (never shuffled): SEED != 0 writes BM25 only
    [ "$SEED" != 0 ] || \
      $PY trime_jax.launch.make_batches --config=configs/docs_wt_long.py --kind=consecutive --out=runs/plans/docs_wt_long $S
    $PY trime_jax.launch.make_batches --config=configs/docs_wt_ext.py --kind=bm25 --out=$BM25_PLAN $S
    ;;
  dir) echo "$OUT" ;;
  train)
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME")
    # A chunk ends with SIGTERM after $CHUNK s: training checkpoints at once and the rerun resumes (SIGKILL
    # KILL_AFTER s later should it hang; default 60).
    rc=0; timeout --signal=TERM -k "${KILL_AFTER:-60}" "$CHUNK" $PY trime_jax.launch.train --config=$CFG --workdir=$OUT/$NAME $S $SCHED \
      $(overrides_of "$NAME") $(plan_of "$NAME") ${TRAIN_FLAGS:-} || rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 143 ]; then
      ENVS="$([ "$STEPS" = 1200 ] || echo "STEPS=$STEPS ")$([ "$SEED" = 0 ] || echo "SEED=$SEED ")"
      echo "chunk over: rerun '${ENVS}bash $0 train $NAME' to continue"; exit 0; fi
    exit $rc
    ;;
  datastore)
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME")
    /usr/bin/time -v $PY trime_jax.launch.build_datastore --config=$CFG --checkpoint=$OUT/$NAME/export --out=$OUT/$NAME/ds \
      --index=ivfpq --nlist=4096 --pq_m=16 2> $OUT/$NAME/ds_time.txt
    ;;
  partial)
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME"); MAX=$(printf '%s\n' ${SIZES:-1000000 4000000} | sort -n | tail -1)
    $PY trime_jax.launch.build_datastore --config=$CFG --checkpoint=$OUT/$NAME/export --out=$OUT/$NAME/ds --stop_at_tokens=$MAX
    ;;
  eval)  # test perplexities without the datastore, tuned on dev: none and the model's test-time memory (local
    #       + long-term, sizes MEM_SIZES; the vanilla model: the continuous cache over the same sizes).
    #       RESET=1 / RESET=0: the long-term store per document / across documents (eval.reset_at_documents; by
    #       default the config's: per document in docs_wt.py, across in _long / _ext), results in
    #       eval_reset1.json / eval_reset0.json
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME"); MEM=$([ "$NAME" = vanilla ] && echo cache || echo local)
    R=""; [ -z "${RESET:-}" ] || R="--config.eval.reset_at_documents=$([ "$RESET" = 1 ] && echo True || echo False)"
    $PY trime_jax.launch.eval --config=$CFG --checkpoint=$OUT/$NAME/export --config.eval.tune=True --config.eval.split=test \
      --config.eval.memory=$MEM --mem_sizes=${MEM_SIZES:-0,2048,8192} --label=$NAME $R \
      --output=$OUT/$NAME/eval${RESET:+_reset$RESET}.json
    ;;
  eval_ext)  # + the full datastore (kNN-LM families, TrimeLM_ext, interpolation), tuned on dev; MEM_SIZE=0: the
    #          long-term memory off (TrimeLM_ext without long-term memory), results in eval_ext_mem0.json
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME")
    $PY trime_jax.launch.eval_ext --config=$CFG --checkpoint=$OUT/$NAME/export --config.eval.datastore=$OUT/$NAME/ds \
      --config.eval.tune=True --config.eval.split=test ${MEM_SIZE:+--config.eval.mem_size=$MEM_SIZE} \
      --output=$OUT/$NAME/eval_ext${MEM_SIZE:+_mem$MEM_SIZE}.json
    ;;
  sizes)  # table 4: datastore-size sweep (the first 1M / 4M entries of NAME's full datastore; no keys recomputed)
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME")
    for N in ${SIZES:-1000000 4000000}; do  # SIZES="1000000": one size; the build may still be running
      $PY trime_jax.launch.build_datastore --config=$CFG --checkpoint=$OUT/$NAME/export --out=$OUT/$NAME/ds_$N \
        --subset_of=$OUT/$NAME/ds --entries=$N --index=ivfpq --nlist=$((N / 1000)) --pq_m=16
      $PY trime_jax.launch.eval_ext --config=$CFG --checkpoint=$OUT/$NAME/export --config.eval.datastore=$OUT/$NAME/ds_$N \
        --config.eval.tune=True --config.eval.split=test --output=$OUT/$NAME/eval_ext_$N.json
    done
    ;;
  domain)  # table 5: linux-doc-6.1 test, the model unchanged; a datastore of the kernel documentation's training
    #        documents (ds_kernel) vs one of the training corpus: the whole one (ds) or, DOMAIN_MATCHED=1, its first N
    #        entries with N = the kernel datastore's size (ds_matched: the two differ in domain only; a partial build
    #        of ds suffices). Both size-matched indexes: IVF-PQ, 1,024 lists, 16 × 8 bits. MEM_SIZE: the long-term
    #        memory (as for eval_ext); a rerun reuses the finished datastores and their indexes (same parameters).
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME")
    $PY trime_jax.launch.build_datastore --config=configs/docs_wt_kernel.py --checkpoint=$OUT/$NAME/export \
      --out=$OUT/$NAME/ds_kernel --index=ivfpq --nlist=1024 --pq_m=16
    TRAIN_DS=ds
    if [ "${DOMAIN_MATCHED:-0}" = 1 ]; then
      N=$($PYBIN -c "import json, sys; print(json.load(open(sys.argv[1]))['count'])" $OUT/$NAME/ds_kernel/meta.json)
      $PY trime_jax.launch.build_datastore --config=$CFG --checkpoint=$OUT/$NAME/export --out=$OUT/$NAME/ds --stop_at_tokens=$N
      $PY trime_jax.launch.build_datastore --config=$CFG --checkpoint=$OUT/$NAME/export --out=$OUT/$NAME/ds_matched \
        --subset_of=$OUT/$NAME/ds --entries=$N --index=ivfpq --nlist=1024 --pq_m=16
      TRAIN_DS=ds_matched
    fi
    for DS in ${DATASTORES:-ds_kernel $TRAIN_DS}; do  # DATASTORES=ds: only the training one (the kernel rows exist)
      $PY trime_jax.launch.eval_ext --config=configs/docs_wt_kernel.py --checkpoint=$OUT/$NAME/export \
        --config.eval.datastore=$OUT/$NAME/$DS --config.eval.tune=True --config.eval.split=test \
        ${MEM_SIZE:+--config.eval.mem_size=$MEM_SIZE} --output=$OUT/$NAME/domain_$DS${MEM_SIZE:+_mem$MEM_SIZE}.json
    done
    ;;
  exact)  # an accelerator: every training key on the device, scored exactly (eval.datastore_on_device: no FAISS,
    #        no top-K)
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME")
    timeout ${BUILD_S:-900} $PY trime_jax.launch.build_datastore --config=$CFG --checkpoint=$OUT/$NAME/export \
      --out=$OUT/$NAME/ds_exact --index=none --config.eval.batch_size=32  # windows are independent: same keys
    timeout ${EVAL_S:-3600} $PY trime_jax.launch.eval_ext --config=$CFG --checkpoint=$OUT/$NAME/export \
      --config.eval.datastore=$OUT/$NAME/ds_exact --config.eval.datastore_on_device=True --config.eval.tune=True \
      --config.eval.split=test --output=$OUT/$NAME/eval_exact.json
    ;;
  ext3)  # issue 37 (an accelerator): external memory three ways over the same keys and test tokens, each at the
    #       config's own (untuned) points with tokens/s with vs without the datastore (--throughput_tokens):
    #       ivfpq_cpu (FAISS IVF-PQ searched on the host CPUs), ivfpq_gpu (the same index on the GPU:
    #       eval.knn_gpu), exact (every key scored on the device: eval.datastore_on_device). The datastore is the
    #       full one `datastore NAME` builds (same index; reused when present); ENTRIES=N: the first N entries
    #       only (a partial build cut to N, its own index: a quick check of the path). EXT3_TOKENS test tokens
    #       (default 32,768), MODES (default all three), then experiments/ext3_table.py writes ext3.md.
    #       EXT3_INDEX=none (no FAISS on the machine: `exact` only) builds the keys alone, in ds_exact as `exact`.
    #       OVERLAP_TOKENS=N (default 0: not run): then eval.overlap_search's bench on N test tokens (ext3_overlap.json).
    NAME=${2:?usage: $0 $1 NAME}; CFG=$(config_of "$NAME"); T=${EXT3_TOKENS:-32768}; IDX=${EXT3_INDEX:-ivfpq}
    B="--config=$CFG --checkpoint=$OUT/$NAME/export --config.eval.batch_size=32"  # windows are independent: same keys
    if [ -n "${ENTRIES:-}" ]; then
      DS=$OUT/$NAME/ds_$ENTRIES
      if ! ds_complete $DS; then
        $PY trime_jax.launch.build_datastore $B --out=$OUT/$NAME/ds --stop_at_tokens=$ENTRIES
        $PY trime_jax.launch.build_datastore $B --out=$DS --subset_of=$OUT/$NAME/ds --entries=$ENTRIES --index=$IDX \
          --nlist=1024 --pq_m=16
      fi
    else
      DS=$OUT/$NAME/$([ "$IDX" = none ] && echo ds_exact || echo ds)
      if [ "$IDX" = none ] && ds_complete $DS; then :
      elif [ "$IDX" != none ] && [ -f $DS/index.faiss ]; then :  # built before (a rebuild would redo the index)
      else  # a build past BUILD_S: with every key written (its index not), `exact` still runs; without, nothing can
        timeout ${BUILD_S:-900} $PY trime_jax.launch.build_datastore $B --out=$DS --index=$IDX --nlist=4096 --pq_m=16 \
          && RC=0 || RC=$?
        if [ $RC != 0 ]; then
          echo "ext3 $NAME build rc=$RC" | tee -a $OUT/$NAME/ext3_runs.txt
          if ds_complete $DS; then MODES=exact; else exit $RC; fi
        fi
      fi
    fi
    for MODE in ${MODES:-ivfpq_cpu ivfpq_gpu exact}; do
      case $MODE in
        ivfpq_cpu) F="" ;;
        ivfpq_gpu) F="--config.eval.knn_gpu=True" ;;
        exact) F="--config.eval.datastore_on_device=True" ;;
        *) echo "MODES: ivfpq_cpu | ivfpq_gpu | exact" >&2; exit 2 ;;
      esac
      rm -f $OUT/$NAME/ext3_$MODE.json  # a stale result must not stand in for this run's
      S0=$(date +%s)
      timeout ${EVAL_S:-300} $PY trime_jax.launch.eval_ext --config=$CFG --checkpoint=$OUT/$NAME/export \
        --config.eval.datastore=$DS --config.eval.split=test --config.eval.max_tokens=$T --throughput_tokens=$T $F \
        --output=$OUT/$NAME/ext3_$MODE.json > $OUT/$NAME/ext3_$MODE.log 2>&1 && RC=0 || RC=$?
      echo "ext3 $NAME $MODE rc=$RC wall_s=$(( $(date +%s) - S0 ))" | tee -a $OUT/$NAME/ext3_runs.txt
    done
    if [ "${OVERLAP_TOKENS:-0}" != 0 ] && [ -f $DS/index.faiss ]; then
      # eval.overlap_search measured (bench/eval_overlap.py): the host IVF-PQ search with and without the next
      # window's forward pass dispatched before it, and no datastore, interleaved on the same OVERLAP_TOKENS
      rm -f $OUT/$NAME/ext3_overlap.json; S0=$(date +%s)
      timeout ${EVAL_S:-300} $PY bench.eval_overlap --config=$(basename $CFG .py) --checkpoint=$OUT/$NAME/export \
        --datastore=$DS --tokens=$OVERLAP_TOKENS --repeats=1 --out=$OUT/$NAME/ext3_overlap.json \
        > $OUT/$NAME/ext3_overlap.log 2>&1 && RC=0 || RC=$?
      echo "ext3 $NAME overlap rc=$RC wall_s=$(( $(date +%s) - S0 ))" | tee -a $OUT/$NAME/ext3_runs.txt
    fi
    $PYBIN experiments/ext3_table.py $OUT/$NAME | tee $OUT/$NAME/ext3.md
    ;;
  *) echo "usage: $0 plans | train NAME | datastore NAME | partial NAME | eval NAME | eval_ext NAME | sizes NAME | domain NAME" \
       "| exact NAME | ext3 NAME | dir" >&2
     exit 2 ;;
esac
