#!/bin/bash
# Issue 17's trainings on a lent accelerator (one GPU; this workplace's `device` tool: a bare machine with JAX and
# no network, whose command gets an empty $OUT to send files back in). The trainings are experiments/docs_wt.sh's
# own `train` command, unchanged; this wrapper supplies what the bare machine lacks and packs the exports.
#
#   here:  bash experiments/docs_wt_device.sh prepare
#            # .gpu/ (git-ignored): the pinned pure-Python packages (flax, optax, orbax-checkpoint, ml_collections;
#            # the machine's own jax runs them), the encoded corpus cache (xz; the raw corpus in ../shared does not
#            # travel), carried with runs/plans (the batch plans)
#   here:  bash experiments/docs_wt_device.sh check "vanilla:0 ext:0"
#            # before a slot: the wheels, the corpus cache and each job's batch plan are here, the carry fits
#   there: bash experiments/docs_wt_device.sh train "vanilla:0 local:0 ..."
#            # every NAME:SEED job at once on the one GPU (each is small; CHUNK seconds at most, then they
#            # checkpoint and stop, as on CPU), logs and exports under runs/, then the exports as one tar split
#            # into 15 MiB parts under runs/device_parts (the first four copied to $OUT; later calls fetch the rest)
#   there: bash experiments/docs_wt_device.sh exact "vanilla ext"
#            # experiments/docs_wt.sh exact NAME for each (carry runs/docs_wt/NAME/export): every training key on
#            # the GPU, scored exactly; results and logs to $OUT
#   here:  bash experiments/docs_wt_device.sh unpack PART...
#            # joins the parts (in name order) and unpacks the exports and logs into runs/docs_wt[_s1]/NAME
#
# Issue 38 (12,000-update models; experiments/docs_wt_long_plan.md has the arithmetic and the job lists):
#   there: STEPS=12000 bash experiments/docs_wt_device.sh train "vanilla:0 ext:0"
#            # the same, each job `STEPS=12000 SEED=s experiments/docs_wt.sh train NAME` (runs/docs_wt_12k[_sS],
#            # the schedule docs_wt.sh derives from STEPS), CHUNK: until 530 s after the call began (timeout_s=600);
#            # the returned tar is xz-compressed (PACK=xz, the default unless STEPS=1200) and also holds
#            # device_jobs.txt's per-job rates; a job that has not finished sends back its logs only (its
#            # checkpoint, 60.3 MiB with Adam's moments, can travel in neither direction: every model must finish
#            # within one call). EVAL=1: after its training each job also runs `docs_wt.sh eval NAME` (table 1's
#            # rows without a datastore, MEM_SIZES) while the chunk lasts; eval.json comes back with the logs.
#            # EXPORTS=0: no export/ in the returned tar (logs, metrics, eval.json only: for runs whose
#            # parameters need not come back, so more than two jobs fit a call); BEST=1: best/ too.
#            # A job the chunk cuts exports its parameters to partial/ (train.export_on_stop), which comes back;
#            # INIT_FROM=1 in a later call (partial/ unpacked here and carried in) continues it from there
#            # (train.init_from: a warm restart, the optimizer's moments start afresh; say so beside its numbers).
#
# Budget (2026-11-27, one H200, 900 s of device time for the session): a call returns at most 64 MiB, i.e. four
# parts (~2.7 exports of 21 MB). Training four models at once took 190 s, the whole first call 390 s of device
# time (start and transfers included); the second call that fetched the last two parts ran 0.3 s but cost 328 s.
# So: one call per ~2–3 models, or train and evaluate there. `exact` beside `train` in one call works (setup runs
# once), but its evaluation over 17.8M keys did not finish within 270 s.
set -euo pipefail
T_START=$(date +%s)  # the call's start: the 12,000-update chunk is measured from here (setup included)
cd "$(dirname "$0")/.."

setup() {  # there: packages, the faiss stand-in and the corpus cache; once per machine (a warm machine keeps /tmp)
  PYBIN=${PYBIN:-python3}  # the machine's python (with its jax)
  export PYTHONPATH=/tmp/site:/tmp/stub:$PWD
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several jobs share the GPU
  if [ -f /tmp/trime_setup.done ]; then return; fi
  $PYBIN -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl
  # faiss: imported by the datastore modules, unused by training and exact evaluation; the machine has none
  mkdir -p /tmp/stub && printf 'def __getattr__(name):\n  raise ImportError("faiss: not on this machine")\n' \
    > /tmp/stub/faiss.py
  KEY=$($PYBIN -c "from trime_jax.configs import docs_wt; from trime_jax import corpora; \
print(corpora._cache_key(docs_wt.get_config().data, None))")
  mkdir -p runs/cache/docs_wt/$KEY && xz -dc .gpu/cache/docs_wt.tar.xz | tar -C runs/cache/docs_wt/$KEY -xf -
  # evaluation reads the corpus encoded with the checkpoint's (the same) vocabulary: a second cache key
  KEYV=$($PYBIN -c "from trime_jax.configs import docs_wt; from trime_jax import corpora; d = docs_wt.get_config().data; \
print(corpora._cache_key(d, corpora.load_splits(d).vocab))")
  [ -e runs/cache/docs_wt/$KEYV ] || cp -al runs/cache/docs_wt/$KEY runs/cache/docs_wt/$KEYV
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PYBIN -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  touch /tmp/trime_setup.done  # a second invocation (exact beside train, a later call) skips all of the above
}

case "${1:-}" in
  prepare)
    mkdir -p .gpu/whl .gpu/cache
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .gpu/whl \
      $(grep -v '^#' experiments/device_wheels.txt)  # one list for both device scripts
    # the corpus cache docs_wt's data config reads (written by any earlier run here: plans, train)
    KEY=$(.venv/bin/python -c "from trime_jax.configs import docs_wt; from trime_jax import corpora; \
print(corpora._cache_key(docs_wt.get_config().data, None))")
    SRC=runs/cache/docs_wt/$KEY
    [ -f "$SRC/COMPLETE" ] || .venv/bin/python -c "from trime_jax.configs import docs_wt; from trime_jax import corpora; \
corpora.load_splits(docs_wt.get_config().data)"  # encodes the corpus once (as any training here would)
    tar -C "$SRC" -cf - . | xz -T2 -6 > .gpu/cache/docs_wt.tar.xz
    du -sh .gpu
    [ -d runs/plans ] && du -sh runs/plans || echo "no runs/plans yet: bash experiments/docs_wt.sh plans (the trainings read them)"
    ;;
  train)
    JOBS=${2:?usage: $0 train "NAME:SEED ..."}
    STEPS=${STEPS:-1200}
    if [ "$STEPS" = 1200 ]; then CHUNK=${CHUNK:-420}; CKPT="--config.train.checkpoint_every=400"; PACK=${PACK:-tar}
    else  # checkpoints cannot leave the machine (60 MiB each): few saves (SIGTERM at the chunk's end saves anyway);
      # a job cut at the chunk's end exports its parameters to partial/ (train.export_on_stop, 21 MiB), which comes
      # back instead of export/: a later call continues it with INIT_FROM (a warm restart, see below)
      CKPT="--config.train.export_on_stop=True"; PACK=${PACK:-xz}; export CKPT_EVERY=${CKPT_EVERY:-4000}; fi
    setup
    # 12,000 updates: the chunk ends 530 s after the call began, whatever setup took, leaving ~70 s of a 600-s call
    # for the SIGTERM checkpoint (a few seconds for these 5.6M-parameter models; SIGKILL 20 s after the SIGTERM
    # should one hang, not 60, so that the worst case still leaves ~50 s), the exports and their xz (~45 MB)
    if [ "$STEPS" != 1200 ]; then CHUNK=${CHUNK:-$(( 530 - ($(date +%s) - T_START) ))}; export KILL_AFTER=${KILL_AFTER:-20}; fi
    T0=$(date +%s)
    echo "$(date -u +%FT%TZ) STEPS=$STEPS CHUNK=$CHUNK jobs: $JOBS" | tee -a runs/device_jobs.txt
    PIDS=""
    for JOB in $JOBS; do
      NAME=${JOB%:*}; SEED=${JOB#*:}; DIR=$(STEPS=$STEPS SEED=$SEED bash experiments/docs_wt.sh dir)
      mkdir -p $DIR/$NAME
      ( START=$(date +%s)
        # INIT_FROM=1: a job cut in an earlier call continues from the partial/ export that call brought back
        # (unpacked here and carried in: runs/docs_wt_12k[_sS]/NAME/partial, with that call's records). Those
        # move to NAME_upto<step> (a fresh workdir would drop their metrics), and NAME starts from its partial/.
        WARM=""; if [ "${INIT_FROM:-0}" = 1 ] && [ -d $DIR/$NAME/partial ] && [ ! -d $DIR/$NAME/checkpoints ]; then
          UPTO=$($PYBIN -c "import json, sys; print(json.load(open(sys.argv[1]))['step'])" $DIR/$NAME/partial/meta.json)
          rm -rf $DIR/${NAME}_upto$UPTO && mv $DIR/$NAME $DIR/${NAME}_upto$UPTO && mkdir -p $DIR/$NAME
          WARM="--config.train.init_from=$PWD/$DIR/${NAME}_upto$UPTO/partial"; fi
        FLAGS="$CKPT $WARM ${EXTRA_FLAGS:-}"
        STEPS=$STEPS SEED=$SEED PYBIN=$PYBIN CHUNK=$CHUNK TRAIN_FLAGS="$FLAGS" \
          bash experiments/docs_wt.sh train $NAME >> $DIR/$NAME/train.log 2>&1 && RC=0 || RC=$?
        E=$([ -d $DIR/$NAME/export ] && echo yes || echo no)
        # the last logged update, the median training rate of its log lines, the last dev line
        LAST=$($PYBIN - $DIR/$NAME/metrics.jsonl <<'PYEOF' 2>/dev/null || true
import json, statistics, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
tr = [r for r in rows if "tokens_per_s" in r]
dev = [r for r in rows if r.get("split") == "dev"]
ppl = " ".join(f"{k}={v:.2f}" for k, v in dev[-1].items() if k.endswith("_ppl")) if dev else ""
timed = [r["tokens_per_s"] for r in tr if r["tokens_per_s"] is not None]  # null: the interval only compiled
rate = statistics.median(timed) if timed else 0
print(f"step={tr[-1]['step'] if tr else 0} median_tokens_per_s={rate:.0f} dev@{dev[-1]['step'] if dev else '-'}: {ppl}")
PYEOF
)
        if [ "${EVAL:-0}" = 1 ] && [ "$E" = yes ]; then  # table 1 without a datastore, in the time left
          LEFT=$(( CHUNK - ($(date +%s) - START) ))
          if [ $LEFT -gt 30 ]; then
            STEPS=$STEPS SEED=$SEED PYBIN=$PYBIN timeout $LEFT bash experiments/docs_wt.sh eval $NAME \
              > $DIR/$NAME/eval.log 2>&1 && EV=0 || EV=$?
          else EV=skipped; fi
          LAST="$LAST eval=$EV"
        fi
        echo "$JOB rc=$RC wall_s=$(( $(date +%s) - START )) exported=$E $LAST" \
          | tee -a runs/device_jobs.txt
        if [ -n "${OUT:-}" ]; then cp runs/device_jobs.txt "$OUT"/; fi ) &  # each job's line, should the call be cut
      PIDS="$PIDS $!"
    done
    wait $PIDS || true
    echo "all jobs: $(( $(date +%s) - T0 )) s" | tee -a runs/device_jobs.txt
    nvidia-smi --query-gpu=name --format=csv,noheader >> runs/device_jobs.txt || true
    rm -rf runs/device_parts && mkdir -p runs/device_parts
    FILES=""  # this call's jobs only (an export carried in for `exact` stays out), in JOBS order; an unfinished
    for JOB in $JOBS; do  # job has no export/: its logs come back, its checkpoints/ do not
      DIR=$(STEPS=$STEPS SEED=${JOB#*:} bash experiments/docs_wt.sh dir)/${JOB%:*}
      PART=$([ -d $DIR/export ] || echo partial)  # an unfinished job: its partial export (export_on_stop)
      for F in $([ "${EXPORTS:-1}" = 0 ] || echo "export $PART") metrics.jsonl train.log config.json eval.json eval.log \
               eval_reset0.json eval_reset1.json ${BEST:+best}; do  # eval_reset*: EVAL=1 with RESET=0 / 1
        [ -e $DIR/$F ] && FILES="$FILES $DIR/$F"; done
    done
    # A call returns at most 8 files of at most 16 MiB, 64 MiB together: 1,200-update parts stay 15 MiB (as before);
    # the 12,000-update ones are 16,000 KiB (four hold 62.5 MiB: two exports of 21.2 MiB with room, three only
    # if xz gets them under 60.7 MiB — it took a float32 export from 22.2 MB to 21.2 MB here).
    if [ "$PACK" = xz ]; then  # float32 parameters: xz gains ~4%, the logs and headers much more
      # blocks of 4 MiB so that -T0 uses the machine's cores (-6's default block, 24 MiB, gives ~2 threads here)
      tar -cf - runs/device_jobs.txt $FILES | xz -T0 -6 --block-size=4MiB | split -b 16000k -d -a 2 - runs/device_parts/exports.txz.
    else
      tar -cf - runs/device_jobs.txt $FILES | split -b 15m -d -a 2 - runs/device_parts/exports.tar.
    fi
    ls -la runs/device_parts
    N=$(ls runs/device_parts | wc -l)
    [ "$N" -le 4 ] || echo "WARNING: $N parts, only the first 4 come back in this call (64 MiB): the last jobs'" \
      "exports are cut; train fewer jobs per call (or EXPORTS=0: logs and eval.json only)"
    if [ -n "${OUT:-}" ]; then cp $(ls runs/device_parts/* | head -4) runs/device_jobs.txt "$OUT"/; fi
    ;;
  exact)  # there: experiments/docs_wt.sh exact NAME for each NAME at once; results and logs copied to $OUT
    setup   # (STEPS=12000: runs/docs_wt_12k/NAME/export, carried)
    D=$(STEPS=${STEPS:-1200} SEED=${SEED:-0} bash experiments/docs_wt.sh dir)
    for NAME in $2; do
      # the whole process group stopped at EXACT_LIMIT s, so the copies below run inside a 600-s call
      ( STEPS=${STEPS:-1200} PYBIN=$PYBIN timeout -k 10 ${EXACT_LIMIT:-540} bash experiments/docs_wt.sh exact $NAME \
          > $D/$NAME/exact.log 2>&1 && RC=0 || RC=$?
        echo "$NAME rc=$RC" ) &
    done
    wait
    for NAME in $2; do
      cp $D/$NAME/exact.log "$OUT"/exact_$NAME.log || true
      cp $D/$NAME/eval_exact.json "$OUT"/eval_exact_$NAME.json || true
    done
    ;;
  ext3)  # there: experiments/docs_wt.sh ext3 NAME (issue 37's three external-memory searches) for one NAME.
    #      carry [".gpu/whl", ".gpu/cache", "runs/docs_wt[_12k]/NAME/export"] (~57 MB with the tree: no room for
    #      .gpu_faiss, 23 MB), right after a `gpu_speed.sh faiss` call on the same warm machine, which left the GPU
    #      FAISS in /tmp (faiss_gpu_env.sh): without it there is no FAISS at all and only `exact` runs.
    setup
    source experiments/faiss_gpu_env.sh  # FAISS_GPU_READY; its PYTHONPATH entry comes before the faiss stub's
    D=$(STEPS=${STEPS:-1200} SEED=${SEED:-0} bash experiments/docs_wt.sh dir)
    if [ "$FAISS_USABLE" = 1 ]; then M="ivfpq_cpu"; [ "$FAISS_GPU_READY" = 1 ] && M="$M ivfpq_gpu"; M="$M exact"
    else M="exact"; export EXT3_INDEX=none; fi
    # The whole at EXT3_LIMIT s (default 540 of a 600-s call; in a session with less device time left: its
    # budget_left_s minus ~60), so that the table and the copies below always run: each search mode EVAL_S
    # (default 90), the key pass (~70 s on the H200, 2026-11-27) with the index what is left (BUILD_S, default
    # EXT3_LIMIT - modes x EVAL_S - 20). A build past BUILD_S with its keys written leaves `exact` to run alone.
    MODES=${MODES:-$M}; L=${EXT3_LIMIT:-540}; EVAL_S=${EVAL_S:-90}
    BUILD_S=${BUILD_S:-$(( L - $(echo $MODES | wc -w) * EVAL_S - 20 ))}
    echo "ext3 limits: EXT3_LIMIT=$L BUILD_S=$BUILD_S EVAL_S=$EVAL_S MODES=$MODES"
    # Last, in whatever time is left (cut by EXT3_LIMIT, it loses only itself): eval.overlap_search on the host
    # IVF-PQ index (bench/eval_overlap.py, OVERLAP_TOKENS default 16,384; 0: not run).
    MODES=$MODES STEPS=${STEPS:-1200} PYBIN=$PYBIN BUILD_S=$BUILD_S EVAL_S=$EVAL_S OVERLAP_TOKENS=${OVERLAP_TOKENS:-16384} \
      timeout -k 10 $L bash experiments/docs_wt.sh ext3 "$2" || true
    $PYBIN experiments/ext3_table.py "$D/$2" > "$D/$2/ext3.md" || true  # whatever finished (a cut run has no table)
    for f in ext3.md ext3_runs.txt ext3_ivfpq_cpu.json ext3_ivfpq_gpu.json ext3_exact.json ext3_overlap.json; do
      cp "$D/$2/$f" "$OUT"/ 2>/dev/null || true
    done
    tar -C "$D/$2" -czf "$OUT/ext3_logs.tgz" $(cd "$D/$2" && ls ext3_*.log ds*/*.json 2>/dev/null) || true
    ;;
  check)  # here, before a slot: what `train JOBS` reads on the device is prepared, and the carry fits (exit 1 if not)
    JOBS=${2:?usage: $0 check "NAME:SEED ..."}
    BAD=0
    for W in $(grep -v '^#' experiments/device_wheels.txt); do  # wheel file names: lower case, - as _
      N=$(echo "${W%%==*}" | tr 'A-Z-' 'a-z_'); V=${W#*==}
      ls .gpu/whl 2>/dev/null | tr 'A-Z' 'a-z' | grep -q "^${N}-${V}-" || { echo "missing: wheel $W (prepare)"; BAD=1; }
    done
    [ -f .gpu/cache/docs_wt.tar.xz ] || { echo "missing: .gpu/cache/docs_wt.tar.xz (prepare)"; BAD=1; }
    for JOB in $JOBS; do
      NAME=${JOB%:*}; S=${JOB#*:}
      case "$NAME" in
        long) P=runs/plans/docs_wt_long ;;
        ext|ext_stopgrad|ext_p05|ext_p099) P=runs/plans/docs_wt_bm25$([ "$S" = 0 ] || echo "_s$S") ;;
        vanilla|local|ext_random) P="" ;;
        *) echo "unknown job name $NAME"; BAD=1; P="" ;;
      esac
      if [ -n "$P" ] && [ ! -f "$P/plan.json" ]; then
        echo "missing: $P for $JOB (SEED=$S bash experiments/docs_wt.sh plans)"; BAD=1
      elif [ "$NAME" != long ] && [ -n "$P" ] && ! grep -q '"bm25_analyzer"' "$P/plan.json"; then
        # a BM25 plan of before 2026-12-08 (trime_jax.batching.bm25.older_rules: token ids with bm25s's lengths and order,
        # before 2026-12-07 also 20 hits besides each segment at bm25s's k1 / b; the original's: Lucene's search of the words)
        echo "stale: $P for $JOB was made before 2026-12-08: remove it, then SEED=$S bash experiments/docs_wt.sh plans"
        BAD=1; fi
    done
    if [ "$BAD" = 0 ]; then bash experiments/carry_size.sh .gpu/whl .gpu/cache runs/plans || BAD=1; fi
    [ "$BAD" = 0 ] && echo "ready: carry [\".gpu/whl\", \".gpu/cache\", \"runs/plans\"]"
    exit $BAD
    ;;
  unpack)  # exports.tar.NN or (STEPS != 1200) exports.txz.NN parts; tar finds the compression itself
    shift
    for f in "$@"; do echo "$(basename "$f") $f"; done | sort | cut -d' ' -f2 | xargs cat > /tmp/docs_wt_exports.tar
    tar -xf /tmp/docs_wt_exports.tar
    tar -tf /tmp/docs_wt_exports.tar | grep -E "/export/$|device_jobs" || true
    rm /tmp/docs_wt_exports.tar
    cat runs/device_jobs.txt >> runs/device_jobs_all.txt  # every call's record (each call's file is its own)
    ;;
  *) echo "usage: $0 prepare | check JOBS | train JOBS | exact NAMES | ext3 NAME | unpack PARTS..." >&2; exit 2 ;;
esac
