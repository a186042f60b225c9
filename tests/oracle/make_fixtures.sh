#!/bin/bash
# Rebuild every fixture in tests/fixtures/oracle from the ORIGINAL TRIME release (princeton-nlp/TRIME @ 3350ca9).
# Runs on CPU, one thread.  Nothing here is part of trime-jax's package code.
#
# Variables (override from the environment):
#   ORIG    checkout of the original, patched with tests/oracle/patches.diff, Cython extensions built in place
#           (`python setup.py build_ext --inplace`)
#   VENV    its virtualenv (Python 3.11, torch 2.13.0+cpu, numpy 1.23.5, faiss-cpu 1.7.4, cython, cffi, regex, sacrebleu, tqdm)
#   WT2     WikiText-2 tokens directory (wiki.{valid,test}.tokens)
#   SHARED  directory with trime.pt and dict.txt (the shared full-softmax oracle checkpoint)
#   WORK    scratch directory (data, checkpoints, datastores, raw dumps; ~400 MB)
#   REPO    trime-jax checkout (fixtures are written to $REPO/tests/fixtures/oracle)
# Total time at 1 thread on a shared 2-core machine: roughly 1.5 h (the external-memory runs dominate).
set -e
ORIG=${ORIG:-/work/orig/TRIME}
VENV=${VENV:-/work/orig/venv}
WT2=${WT2:-/work/shared/data/wikitext-2}
SHARED=${SHARED:-/work/shared/oracle}
WORK=${WORK:-/work/orig}
REPO=${REPO:-$(cd "$(dirname "$0")/../.." && pwd)}
PY=$VENV/bin/python
HERE=$REPO/tests/oracle
FIX=$REPO/tests/fixtures/oracle
RAW=$WORK/data/raw
DATA=$WORK/data/data-bin/wt2
OUT=$WORK/out
T=$SHARED/trime.pt
A=$WORK/ckpt/adaptive/adaptive.pt
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=$ORIG
mkdir -p $RAW $WORK/logs $OUT $FIX $WORK/dstore $WORK/dstore_fp16
cd $ORIG

# ---- 1. data split, dictionary over all splits, binarize (== shared commands.sh) ----
cp $WT2/wiki.valid.tokens $RAW/train.txt                 # TRAIN = WikiText-2 valid (3760 lines)
head -n 2248 $WT2/wiki.test.tokens > $RAW/valid.txt      # VALID = WikiText-2 test lines 1..2248
tail -n +2249 $WT2/wiki.test.tokens > $RAW/test.txt      # TEST  = WikiText-2 test lines 2249..4357
cat $RAW/train.txt $RAW/valid.txt $RAW/test.txt > $RAW/all.txt
$PY preprocess.py --only-source --trainpref $RAW/all.txt --destdir $WORK/data/dictbuild --workers 2
$PY preprocess.py --only-source --srcdict $WORK/data/dictbuild/dict.txt \
    --trainpref $RAW/train.txt --validpref $RAW/valid.txt --testpref $RAW/test.txt --destdir $DATA --workers 2
diff $DATA/dict.txt $SHARED/dict.txt   # must be identical

# ---- 2. tiny adaptive-input + adaptive-softmax TrimeLM (247M layout), 30 updates ----
$PY train.py --task language_modeling $DATA \
  --save-dir $WORK/ckpt/adaptive --arch transformer_lm \
  --decoder-layers 2 --decoder-embed-dim 64 --decoder-ffn-embed-dim 128 --decoder-attention-heads 2 \
  --adaptive-input --adaptive-input-cutoff 2000,8000 --adaptive-input-factor 4 \
  --adaptive-softmax-cutoff 2000,8000 --adaptive-softmax-factor 4 --adaptive-softmax-dropout 0 \
  --tie-adaptive-weights --tie-adaptive-proj --no-decoder-final-norm --dropout 0.0 \
  --criterion trime_loss --knn-keytype last_ffn_input --ce-warmup-epoch 0 \
  --tokens-per-sample 128 --max-tokens 1024 --sample-break-mode none \
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 0.002 --lr-scheduler fixed --clip-norm 0.1 \
  --max-update 30 --seed 1 --cpu --ddp-backend no_c10d --num-workers 0 --log-format simple --log-interval 5 \
  --skip-invalid-size-inputs-valid-test > $WORK/logs/train_adaptive.log 2>&1
# stripped copy: drop last_optimizer_state; keep args, model, extra_state, optimizer_history
$PY $HERE/strip_ckpt.py $WORK/ckpt/adaptive/checkpoint_last.pt $A
EV="--sample-break-mode none --max-tokens 128 --context-window 64 --softmax-batch 1024 --max-sentences 1 --knn-keytype last_ffn_input --cpu --num-workers 0"
$PY eval_lm.py $DATA --path $WORK/ckpt/adaptive/checkpoint_last.pt $EV --gen-subset test > $WORK/logs/eval_adaptive_full_plain_evallm.txt 2>&1
$PY eval_lm.py $DATA --path $A $EV --gen-subset test > $WORK/logs/eval_adaptive_stripped_plain_evallm.txt 2>&1
diff <(tail -1 $WORK/logs/eval_adaptive_full_plain_evallm.txt) <(tail -1 $WORK/logs/eval_adaptive_stripped_plain_evallm.txt)
cp $A $FIX/adaptive.pt

# ---- 3. datastores of TRAIN for trime.pt (== shared commands.sh section (d)) + indexes ----
$PY eval_lm.py $DATA --path $T --sample-break-mode none --max-tokens 1024 --context-window 64 --softmax-batch 1024 --max-sentences 8 \
   --knn-keytype last_ffn_input --cpu --num-workers 0 \
   --gen-subset train --dstore-mmap $WORK/dstore/dstore --dstore-size 217536 --save-knnlm-dstore > $WORK/logs/build_dstore_keys.txt 2>&1
$PY $HERE/build_flat_index.py $WORK/dstore/dstore 217536 64 $WORK/dstore/knn_flat.index.ip
$PY $HERE/build_flat_index.py $WORK/dstore/dstore 217536 64 $WORK/dstore/knn_flat.index.l2 --l2   # kNN-LM by L2 (g)
$PY build_dstore.py --dstore_mmap $WORK/dstore/dstore --dstore_size 217536 --dimension 64 --faiss_index $WORK/dstore/knn.index \
   --ncentroids 256 --code_size 16 --probe 32 --num_keys_to_add_at_a_time 500000 --starting_point 0 --dist ip > $WORK/logs/build_dstore_faiss_ivfpq.txt 2>&1
# fp16 keys (same command + --dstore-fp16) -> dstore-fp16_keys.npy (float16) + dstore_vals.npy (int64)
$PY eval_lm.py $DATA --path $T --sample-break-mode none --max-tokens 1024 --context-window 64 --softmax-batch 1024 --max-sentences 8 \
   --knn-keytype last_ffn_input --cpu --num-workers 0 \
   --gen-subset train --dstore-mmap $WORK/dstore_fp16/dstore --dstore-size 217536 --save-knnlm-dstore --dstore-fp16 > $WORK/logs/build_dstore_fp16_keys.txt 2>&1
$PY $HERE/build_flat_index.py $WORK/dstore_fp16/dstore 217536 64 $WORK/dstore_fp16/knn_flat.index.ip --fp16
$PY $HERE/save_dstore_fixture.py $WORK/dstore/dstore 217536 64 $FIX/dstore_trime_train.npz

# ---- 4/5. whole-split per-token dumps (ORIGINAL SequenceScorer), TEST split ----
D="$PY $HERE/dump_scores.py --data $DATA --outdir $OUT"
# sanity: first 32 windows against the shared oracle (must agree to ~1e-6; they agreed exactly)
$D --ckpt $T --ckpt-name trime --outdir $WORK/sanity --dstore-dir $WORK/dstore --max-windows 32 --save-targets \
   plain local_T1.0 long_T1.0_mem512 ext_flat_noint_T1.0_mem512 ext_flat_T1.0_mem512_it10.5_l0.3 > $WORK/logs/dump_sanity.txt 2>&1
$PY $HERE/check_first32.py $SHARED/token_scores_trime_first32.npz $WORK/sanity \
   plain local_T1.0 long_T1.0_mem512 ext_flat_noint_T1.0_mem512 ext_flat_T1.0_mem512_it10.5_l0.3
# a. trime.pt, sample-break-mode none, 128-token inputs, context 64, max-sentences 1
$D --ckpt $T --ckpt-name trime --save-targets plain local_T1.0 long_T1.0_mem64 long_T1.0_mem128 long_T1.0_mem512 long_T1.0_mem2000 \
   > $WORK/logs/dump_a.txt 2>&1
# b. adaptive checkpoint, same windows
$D --ckpt $A --ckpt-name adaptive --save-targets plain local_T1.0 long_T1.0_mem512 > $WORK/logs/dump_b.txt 2>&1
# c. sample-break-mode complete (same --max-tokens 128 --context-window 64)
$D --ckpt $T --ckpt-name trime --save-targets --break-mode complete local_T1.0 long_T1.0_mem512 > $WORK/logs/dump_c_trime.txt 2>&1
$D --ckpt $A --ckpt-name adaptive --save-targets --break-mode complete local_T1.0 long_T1.0_mem512 > $WORK/logs/dump_c_adaptive.txt 2>&1
# c'. complete mode on TEST's lines that fit a window (at most 128 tokens with </s>): no block is dropped, so every
#     token of that corpus is scored (tests/test_oracle.py SHORT_LINES); the files are renamed *_completeshort.npz
mkdir -p $WORK/data/raw_short
python3 -c "
import sys; lines = open(sys.argv[1], encoding='utf-8').read().split('\n')[:-1]
open(sys.argv[2], 'w', encoding='utf-8').write(''.join(l + '\n' for l in lines if len(l.split()) + 1 <= 128))
" $WORK/data/raw/test.txt $WORK/data/raw_short/test.txt
(cd $ORIG && $PY preprocess.py --only-source --srcdict $DATA/dict.txt --testpref $WORK/data/raw_short/test.txt \
   --destdir $WORK/data/data-bin/wt2_short --workers 1)
mkdir -p $WORK/out_short
for C in trime adaptive; do
  CK=$T; [ $C = adaptive ] && CK=$A
  $D --data $WORK/data/data-bin/wt2_short --ckpt $CK --ckpt-name $C --outdir $WORK/out_short --break-mode complete \
     local_T1.0 long_T1.0_mem512 > $WORK/logs/dump_cshort_$C.txt 2>&1
  for M in local_T1.0 long_T1.0_mem512; do
    cp $WORK/out_short/scores_${C}_${M}_complete.npz $OUT/scores_${C}_${M}_completeshort.npz
  done
done
# d + e. external memory (exact IndexFlatIP, K 1024) without / with interpolation, and the kNN-LM baseline (eval_lm.py --knnlm path)
$D --ckpt $T --ckpt-name trime --dstore-dir $WORK/dstore \
   ext_flat_noint_T1.0_mem512 ext_flat_T1.0_mem512_it10.5_l0.3 knnlm_flat_k1024_l0.25 > $WORK/logs/dump_de.txt 2>&1
# f. IVF-PQ + interp; fp16-key flat index + interp
$D --ckpt $T --ckpt-name trime --dstore-dir $WORK/dstore --dstore-fp16-dir $WORK/dstore_fp16 \
   ext_ivfpq_T1.0_mem512_it10.5_l0.3 ext_flatfp16_T1.0_mem512_it10.5_l0.3 > $WORK/logs/dump_f.txt 2>&1

# g. the kNN-LM baseline as the original's kNN-LM code defaults to it: --faiss-metric-type l2 over the exact L2 index,
#    keys loaded, -|q - k|^2 recomputed (added 2026-12-07; 5 min)
$D --ckpt $T --ckpt-name trime --dstore-dir $WORK/dstore knnlml2_flat_k1024_l0.25 > $WORK/logs/dump_l2.txt 2>&1
#    and over the original's own IVF-PQ L2 index (build_dstore.py --dist l2; its trained file is a fixture)
$PY build_dstore.py --dstore_mmap $WORK/dstore/dstore --dstore_size 217536 --dimension 64 --faiss_index $WORK/dstore/knn.index \
   --ncentroids 256 --code_size 16 --probe 32 --num_keys_to_add_at_a_time 500000 --starting_point 0 --dist l2 > $WORK/logs/build_dstore_faiss_ivfpq_l2.txt 2>&1
$D --ckpt $T --ckpt-name trime --dstore-dir $WORK/dstore knnlml2_ivfpq_k1024_l0.25 > $WORK/logs/dump_l2_ivfpq.txt 2>&1

# adaptive softmax quirk (ids 2001/8001 lose their tail term in trime_generate)
$PY $HERE/check_adaptive_tail_pad.py $DATA $A $OUT/scores_adaptive_local_T1.0.npz $OUT/scores_adaptive_plain.npz

# ---- 6. compact fixtures ----
$PY $HERE/finalize_fixtures.py $OUT $FIX
# the original's trained (empty) IVF-PQ index: tests add our keys to it (build_index(trained_index=...))
cp $WORK/dstore/knn.index.ip.trained $FIX/ivfpq_trained.index
cp $WORK/dstore/knn.index.l2.trained $FIX/ivfpq_l2_trained.index
$PY $HERE/results_table.py $FIX     # the README's table
du -sh $FIX
