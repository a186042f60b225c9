#!/bin/bash
# Issue 15: TrimeMT_ext on ui-de-en (German→English UI strings, ../shared/data/ui-de-en), CPU-sized model
# (configs/ui_de_en.py: 3+3 layers, d 256, FFN 1024, 4 heads, 8k joint sentencepiece vocabulary).
# Every model: the same budget of target tokens trained on (BUDGET, default 2,000,000 ≈ 1.5 epochs, what 2 CPU
# cores allow for three models: vanilla's length-sorted batches hold ~3,300 target tokens per 4,096-token update,
# BM25/random batches ~1,100 since they mix lengths, so those run ~3x the updates), seed 0. The TrimeMT runs
# start with plain-CE updates for a tenth of the budget (CE_WARMUP, default 180 updates): our choice, kept because
# the reported ui-de-en numbers were made with it. The original's code runs no CE warm-up at all (its train.py
# resets the criterion to the TRIME loss before every batch unless --ce-warmup-ratio is given, so the README's
# --ce-warmup-epoch 5 never applies; configs/iwslt_de_en.py follows that): CE_WARMUP=0 trains as it does.
#
#   bash experiments/ui_de_en.sh spm              # the joint sentencepiece model (cached under runs/cache/ui_de_en)
#   bash experiments/ui_de_en.sh train NAME       # NAME: vanilla | trime_bm25 | trime_random (| ce_random | ce_bm25:
#                                                 #   CE on the TrimeMT runs' batches, the controls)
#                                                 #   one chunk of at most CHUNK seconds (default 1800); rerun the
#                                                 #   same command to continue (it resumes from the last checkpoint)
#
# SEED=1 repeats under runs/ui_de_en_s1. Commit commands and results, never checkpoints.
#   bash experiments/ui_de_en.sh datastore NAME   # datastore of the training targets of $OUT/NAME/export + IVF-PQ
#   bash experiments/ui_de_en.sh tune NAME        # K, τ, λ, T, τ′ on valid (teacher-forced NLL, then beam search of
#                                                 #   the best; TUNE_SENTENCES valid pairs, default 1000)
#   bash experiments/ui_de_en.sh test NAME        # test BLEU (beam 4) + sentences/s: model, kNN-MT, TrimeMT_ext
#                                                 #   (+ interpolation), each with its valid-tuned setting
#   bash experiments/ui_de_en.sh table            # the markdown table of the test results
#   bash experiments/ui_de_en.sh all              # all of the above for the five models, resumable
#   bash experiments/ui_de_en.sh throughput NAME  # sentences/s with / without the datastore (bench.mt_decode;
#                                                 #   run it on an idle machine)
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
    # BM25 / random batches mix lengths: their pairs are packed into rows of 128 tokens (data.pack_len; the same
    # batches and objective, tested equal to the padded layout; ~2.8x faster on this CPU, bench/mt_packing.py)
    trime_bm25) echo "--config.trime.memory=ext --config.trime.batching=bm25 --config.trime.ce_warmup_steps=${CE_WARMUP:-180} --config.data.pack_len=${PACK_LEN:-128}" ;;
    trime_random) echo "--config.trime.memory=ext --config.trime.batching=random --config.trime.ce_warmup_steps=${CE_WARMUP:-180} --config.data.pack_len=${PACK_LEN:-128}" ;;
    # CE controls on the TrimeMT runs' batches (same plans, same number of updates at the same budget): whether
    # TRIME training helps, apart from the ~3x more updates mixed-length batches take at equal target tokens
    ce_random) echo "--config.trime.memory=none --config.trime.batching=random --config.data.pack_len=${PACK_LEN:-128}" ;;
    ce_bm25) echo "--config.trime.memory=none --config.trime.batching=bm25 --config.data.pack_len=${PACK_LEN:-128}" ;;
    *) echo "NAME: vanilla | trime_bm25 | trime_random | ce_random | ce_bm25" >&2; exit 2 ;;
  esac
}

case "${1:-}" in
  spm)
    nice -n 10 $PYBIN -c "
import time
from trime_jax.configs import ui_de_en
from trime_jax.mt import data, train
c = ui_de_en.get_config(); train.resolve_data_path(c)
t = time.perf_counter(); v = data.load_vocab(c)
print(f'sentencepiece: {v.size} pieces, fingerprint {v.fingerprint()}, {time.perf_counter() - t:.1f} s')"
    ;;
  train)
    NAME=$2; OV=$(overrides_of "$NAME")
    # A chunk ends with SIGTERM after $CHUNK s: training checkpoints at once and the rerun resumes.
    rc=0; timeout --signal=TERM "$CHUNK" $PY trime_jax.launch.train_mt --config=$CFG --workdir=$OUT/$NAME $S $OV \
      --config.train.target_token_budget=${BUDGET:-2000000} --config.train.num_steps=100000 "${@:3}" || rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 143 ]; then echo "chunk over: rerun 'bash $0 train $NAME' to continue"; exit 0; fi
    exit $rc
    ;;
  datastore)
    NAME=$2
    # IVF-PQ (searched with nprobe=8 below): an exact index over ~1M keys would scan them all for every beam row
    # and step; nprobe=32 of 256 lists measured 0.5 s per 200 queries on the loaded 2-core machine
    $PY trime_jax.launch.build_datastore --checkpoint=$OUT/$NAME/export --out=$OUT/$NAME/ds --index=ivfpq --nlist=512 --pq_m=32
    ;;
  tune)
    NAME=$2
    # the vanilla model is tuned for kNN-MT, the TrimeMT models for TRIME's softmax (+ interpolation)
    TM=$([ "$NAME" = vanilla ] && echo knn_mt || echo trime)
    $PY trime_jax.launch.translate --checkpoint=$OUT/$NAME/export --datastore=$OUT/$NAME/ds --tune --nprobe=8 \
      --tune_modes=${TUNE_MODES:-$TM} --max_sentences=${TUNE_SENTENCES:-1000} --out=$OUT/$NAME/translate
    ;;
  test)
    NAME=$2; T=$OUT/$NAME/translate
    for MODE in ${MODES:-model knn_mt trime trime_interp}; do  # e.g. MODES="model knn_mt" for vanilla
      if [ "$MODE" = model ]; then
        $PY trime_jax.launch.translate --checkpoint=$OUT/$NAME/export --mode=model --split=test --out=$T
      else
        $PY trime_jax.launch.translate --checkpoint=$OUT/$NAME/export --datastore=$OUT/$NAME/ds --settings=$T/tuned.json \
          --nprobe=8 --mode=$MODE --split=test --out=$T
      fi
    done
    $PYBIN -c "
import json
import os
for m in ('model', 'knn_mt', 'trime', 'trime_interp'):
  if not os.path.exists('$T/test.' + m + '.json'):
    continue
  r = json.load(open('$T/test.' + m + '.json'))
  print(f\"$NAME {m:7s} BLEU {r['bleu']:6.2f}  {r['sentences_per_s']:7.2f} sentences/s  {r['setting']}\")"
    ;;
  table)  # the issue-15 table (markdown) from the test decodes' JSON files
    $PYBIN - "$OUT" <<'PY'
import json, os, sys
from trime_jax.mt.decode import Distribution
out = sys.argv[1]
rows = [("vanilla", "model", "Transformer (vanilla)"), ("vanilla", "knn_mt", "vanilla + kNN-MT"),
        ("trime_bm25", "model", "TrimeMT_ext (BM25 batches), model alone"),
        ("trime_bm25", "trime", "TrimeMT_ext (BM25 batches) + datastore"),
        ("trime_bm25", "trime_interp", "TrimeMT_ext (BM25 batches) + datastore + interpolation"),
        ("trime_random", "model", "TrimeMT_ext (random batches), model alone"),
        ("trime_random", "trime", "TrimeMT_ext (random batches) + datastore"),
        ("trime_random", "trime_interp", "TrimeMT_ext (random batches) + datastore + interpolation"),
        # the CE controls: plain CE on the TrimeMT runs' batches (same plans, same updates)
        ("ce_bm25", "model", "CE on the BM25 batches (control)"),
        ("ce_bm25", "knn_mt", "CE on the BM25 batches + kNN-MT"),
        ("ce_bm25", "trime", "CE on the BM25 batches + TRIME datastore softmax"),
        ("ce_bm25", "trime_interp", "CE on the BM25 batches + TRIME datastore softmax + interpolation"),
        ("ce_random", "model", "CE on the random batches (control)"),
        ("ce_random", "knn_mt", "CE on the random batches + kNN-MT"),
        ("ce_random", "trime", "CE on the random batches + TRIME datastore softmax"),
        ("ce_random", "trime_interp", "CE on the random batches + TRIME datastore softmax + interpolation")]
print("| model | test BLEU | sentences/s | setting (tuned on valid) |\n|---|---:|---:|---|")
for name, mode, label in rows:
  path = os.path.join(out, name, "translate", f"test.{mode}.json")
  if not os.path.exists(path):
    print(f"| {label} | (not run) | | |")
    continue
  r = json.load(open(path))
  s = Distribution.from_setting(r["setting"])  # also reads settings written before the renames of issue 34
  how = {"model": "beam 4", "knn_mt": f"K {s.k}, T {s.knn_mt_temperature:g}, λ {s.knn_lambda:g}",
         "trime": f"K {s.k}, τ {s.tau:g}" + (f", λ {s.knn_lambda:g}, τ′ {s.tau_prime:g}" if s.knn_lambda else "")
         }[s.mode]
  print(f"| {label} | {r['bleu']:.2f} | {r['sentences_per_s']:.1f} | {how} |")
PY
    ;;
  throughput)
    NAME=$2
    $PYBIN -m bench.mt_decode --checkpoint=$OUT/$NAME/export --datastore=$OUT/$NAME/ds \
      --settings=$OUT/$NAME/translate/tuned.json --modes=${MODES:-model,knn_mt,trime} --nprobe=8 \
      --sentences=${SENTENCES:-512}
    ;;
  all)  # everything, in order; rerun after an interruption (finished steps are skipped or resume)
    bash "$0" spm
    for NAME in trime_bm25 vanilla trime_random; do
      until [ -d $OUT/$NAME/export ]; do bash "$0" train $NAME; done
    done
    for NAME in vanilla trime_bm25 trime_random; do
      [ -f $OUT/$NAME/ds/index.faiss ] || bash "$0" datastore $NAME
      [ -f $OUT/$NAME/translate/tuned.json ] || bash "$0" tune $NAME
    done
    MODES="model knn_mt" bash "$0" test vanilla
    MODES="model trime trime_interp" bash "$0" test trime_bm25
    MODES="model trime trime_interp" bash "$0" test trime_random
    for NAME in ce_random ce_bm25; do  # the controls
      until [ -d $OUT/$NAME/export ]; do bash "$0" train $NAME; done
      [ -f $OUT/$NAME/ds/index.faiss ] || bash "$0" datastore $NAME
      [ -f $OUT/$NAME/translate/tuned.json ] || TUNE_MODES=knn_mt,trime bash "$0" tune $NAME
      MODES="model knn_mt trime trime_interp" bash "$0" test $NAME
    done
    bash "$0" table
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
