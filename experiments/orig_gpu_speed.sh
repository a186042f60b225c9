#!/bin/bash
# Issue 37, "the original on the same GPU": the original release's train.py (the fairseq fork at
# princeton-nlp/TRIME, with shared/oracle/patches.diff) for a few dozen updates per (model, criterion), with its
# own flags and --fp16, then this repository's bench.mfu at the same per-GPU shape (rows x segment x
# accumulation) and precision class (bfloat16), in one run on one GPU: words per second side by side.
#
#   here:  bash experiments/orig_gpu_speed.sh prepare
#            .gpu/orig/src.tar.gz   the original's source as checked out for the oracle (ORIG, default
#                                   /work/orig/TRIME: shared/oracle/commands.sh makes it) with the NumPy-alias fix
#                                   below (COMPAT). Its two Cython extensions are compiled there: translated from
#                                   the .pyx by that machine's Cython against its NumPy (the GPU image has NumPy
#                                   2.5, whose headers the C++ that Cython wrote here against NumPy 1.23 does not
#                                   compile with), or, without Cython there, from that carried C++
#            .gpu/orig/data-bin/    real text: docs-wt train's first TRAIN_LINES lines, binarized by the original's
#                                   preprocess.py with a dictionary of WikiText-103's size (docs-wt's types by
#                                   frequency, then unused filler words up to 267,735 entries with fairseq's four
#                                   specials), so every model has the paper's shapes and the adaptive softmax sees
#                                   real word frequencies (the original computes a tail only for the targets in it)
#          (and experiments/gpu_speed.sh prepare: .gpu/whl, the packages bench.mfu needs there)
#   there: bash experiments/orig_gpu_speed.sh run     (device tool: carry [".gpu/whl", ".gpu/orig"], timeout_s ≈ 560)
#            $OUT/orig_env.txt          python, torch, CUDA, compiler: why the original can or cannot run
#            $OUT/orig_runs.txt         one line per run (rc, wall time)
#            $OUT/orig_vs_ours.md       the table: tokens/s of each, and ours ÷ original
#            $OUT/raw.tgz               every file: each original run's log orig_<model>_<crit>.log, bench.mfu's
#                                       ours_<model>.json / .log (re-packed after each run: experiments/device_out.sh)
#          One deadline for the whole command (DEADLINE s from its start, default 530): the original's runs end
#          OURS_BUDGET (default 300: bench.mfu compiles two objectives per model) s before it, ours at it, so the
#          table is written inside a 560-s call; each run gets at most an equal share of its side's time left.
#   here, the logic without a GPU (the oracle's CPU venv, tiny models, no --fp16):
#          TINY=1 OUT=/tmp/orig_speed bash experiments/orig_gpu_speed.sh run
#
# What is compared (docs/paper_configs.md has the flags' sources):
#   247m  train_scripts/wiki103-247M-trime.sh: transformer_lm_wiki103, --max-tokens 3072 --update-freq 6
#         --tokens-per-sample 3072, nag      -> ours: wiki103_247m at 1 row x 3072 x 6
#   150m  train_scripts/wiki103-150M-trime.sh: transformer_lm_wiki103_150M, --max-tokens 9000 --update-freq 2
#         --tokens-per-sample 150, adam      -> ours: wiki103_150m at 60 rows x 150 x 2
#   7m    no script: transformer_lm_wiki103_small_sm with the 150M's adaptive flags (factor 4), 8 segments of
#         3072 per forward                   -> ours: wiki103_7m at 8 rows x 3072 x 1
# Criteria: adaptive_loss (fairseq's cross-entropy for adaptive-softmax models: its cross_entropy criterion
# asserts on a model with tail clusters), and trime_loss (local memory) with --ce-warmup-epoch 0 (the scripts'
# CE warm-up would otherwise make the first epochs plain CE); ours: ce and trime with trime.memory=local.
# Tokens/s of the original: fairseq's own `wps` meter, which skips the first 10 updates (ignore_first=10: CUDA
# start-up, cuDNN autotuning) and averages the rest, read at the run's last update; ours: bench.mfu's median
# step after its warm-up. Both count target tokens (fairseq's wps: ntokens / s).
#
# COMPAT: the oracle's original runs on numpy 1.23.5, which has no wheel for Python >= 3.12. Newer NumPy removed
# the aliases np.float and np.int, which fairseq/data/indexed_dataset.py uses at import time; `prepare` writes
# np.float64 / np.int64 in their place (the dtypes the aliases meant), in the source copy only. Nothing else of
# the original is changed.
set -euo pipefail
T_START=$(date +%s)
cd "$(dirname "$0")/.."
REPO=$PWD
source experiments/device_out.sh
DEVICE_OUT_FILES="orig_env.txt orig_unavailable.txt orig_runs.txt orig_vs_ours.md"
ORIG=${ORIG:-/work/orig/TRIME}
ORIG_VENV_PY=${ORIG_VENV_PY:-$(dirname "$ORIG")/venv/bin/python}
TRAIN_LINES=${TRAIN_LINES:-200000}  # ~3.3M tokens of docs-wt train: more than 40 updates of any model read
WT103_DICT=267735  # fairseq's len(dictionary) for WikiText-103, the four specials included
MODELS=${MODELS:-"7m 150m 247m"}  # fastest first: what a fast run leaves goes to the later ones (the 247M)
CRITERIA=${CRITERIA:-"adaptive_loss trime_loss"}
UPDATES=${UPDATES:-30}

prepare() {
  [ -f "$ORIG/train.py" ] || { echo "error: no original checkout at $ORIG (shared/oracle/commands.sh makes it)" >&2; exit 2; }
  [ -f "$ORIG/fairseq/data/data_utils_fast.cpp" ] || { echo "error: $ORIG lacks its Cython output (run its setup.py build_ext --inplace once)" >&2; exit 2; }
  local dst=.gpu/orig tmp
  mkdir -p "$dst"
  tmp=$(mktemp -d)
  tar -C "$ORIG" --exclude=./build --exclude='*.so' --exclude=./images --exclude=./poster.pdf --exclude=./.git \
    --exclude=./machine_translation --exclude='__pycache__' -cf - . | tar -C "$tmp" -xf -
  # COMPAT (see the header): the removed NumPy aliases, as the dtypes they meant
  sed -i -E 's/\bnp\.float\b([^0-9_]|$)/np.float64\1/g; s/\bnp\.int\b([^0-9_]|$)/np.int64\1/g' \
    "$tmp/fairseq/data/indexed_dataset.py" "$tmp/fairseq/knnlm.py"
  tar -C "$tmp" -czf "$dst/src.tar.gz" .
  rm -rf "$tmp"
  # The dictionary: docs-wt's types by frequency, filled to WikiText-103's size with words no text contains.
  local raw=$dst/raw
  mkdir -p "$raw"
  head -n "$TRAIN_LINES" ../shared/data/docs-wt/wiki.train.tokens > "$raw/train.txt"
  head -n 2000 ../shared/data/docs-wt/wiki.valid.tokens > "$raw/valid.txt"
  python3 - "$raw/dict.txt" "$WT103_DICT" ../shared/data/docs-wt/wiki.train.tokens <<'PY'
import collections, sys
out, size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
counts = collections.Counter()
with open(path, encoding="utf-8") as f:
  for line in f:
    counts.update(line.split())
specials = {"<s>", "<pad>", "</s>", "<unk>"}
words = [(w, c) for w, c in counts.most_common() if w not in specials][:size - 4]
words += [(f"madeupword{i:06d}", 0) for i in range(size - 4 - len(words))]
with open(out, "w", encoding="utf-8") as f:
  f.writelines(f"{w} {c}\n" for w, c in words)
print(f"dictionary: {len(counts):,} docs-wt types, {size - 4:,} words written (+4 specials = {size:,})")
PY
  rm -rf "$dst/data-bin"
  (cd "$ORIG" && "$ORIG_VENV_PY" preprocess.py --only-source --srcdict "$REPO/$raw/dict.txt" \
     --trainpref "$REPO/$raw/train.txt" --validpref "$REPO/$raw/valid.txt" --destdir "$REPO/$dst/data-bin" \
     --workers 2) > "$dst/preprocess.log" 2>&1 || { tail -5 "$dst/preprocess.log"; exit 1; }
  rm -rf "$raw"
  du -sh "$dst"/*
}

setup_there() {  # the GPU machine: its python; the original unpacked and its two Cython extensions compiled
  PYBIN=${PYBIN:-python3}
  if [ -n "${TINY:-}" ]; then PYBIN=$ORIG_VENV_PY; fi
  WORK=${WORK:-/tmp/orig_speed_src}
  { date -u; $PYBIN --version
    $PYBIN -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1 | tail -1 || true
    $PYBIN -c "import numpy; print('numpy', numpy.__version__)" 2>&1 | tail -1 || true
    $PYBIN -c "import sysconfig, os; h = sysconfig.get_paths()['include']; print('Python.h', os.path.exists(os.path.join(h, 'Python.h')), h)"
    (command -v g++ && g++ --version | head -1) || echo "g++: none"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  } > "$OUT/orig_env.txt" 2>&1
  cat "$OUT/orig_env.txt"
  local why=""
  if ! $PYBIN -c "import torch" 2>/dev/null; then
    why="the machine's Python has no torch: the original (fairseq fork) needs PyTorch, and a CUDA build of it (~2 GB of wheels) cannot be carried within the device tool's 64 MiB"
  elif [ -z "${TINY:-}" ] && ! $PYBIN -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    why="torch is installed but sees no CUDA device (torch.cuda.is_available() is False)"
  elif ! $PYBIN -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
    why="no Python headers (Python.h) to compile the original's two Cython extensions (data_utils_fast, token_block_utils_fast)"
  elif ! command -v g++ > /dev/null; then
    why="no C++ compiler (g++) to compile the original's two Cython extensions"
  fi
  if [ -n "$why" ]; then
    echo "the original cannot run here: $why" | tee "$OUT/orig_unavailable.txt"
    return 1
  fi
  rm -rf "$WORK" && mkdir -p "$WORK" && tar -C "$WORK" -xzf .gpu/orig/src.tar.gz
  # Only the two extensions language-model training imports (setup.py would also build libbleu and libnat).
  (cd "$WORK" && $PYBIN - > "$OUT/orig_build.log" 2>&1 <<'PY') || { echo "the original's extensions did not build:"; tail -5 "$OUT/orig_build.log"; return 1; }
import numpy
from setuptools import Extension, setup
mods = ("data_utils_fast", "token_block_utils_fast")
def ext(m, suffix):
  return Extension(f"fairseq.data.{m}", [f"fairseq/data/{m}.{suffix}"], language="c++",
                   include_dirs=[numpy.get_include()], extra_compile_args=["-std=c++11", "-O3"])
# The carried C++ was written by Cython against the oracle's NumPy 1.23 and does not compile against NumPy 2's
# headers (PyArray_Descr lost its public `subarray` field). Where this Python has Cython, the .pyx files are
# translated again here, against this machine's NumPy; otherwise the carried C++ is used (NumPy 1.x only).
try:
  from Cython.Build import cythonize
except ImportError:
  print(f"no Cython here: the carried C++ files (NumPy {numpy.__version__})")
  exts = [ext(m, "cpp") for m in mods]
else:
  print(f"the .pyx files translated by Cython here, against NumPy {numpy.__version__}")
  exts = cythonize([ext(m, "pyx") for m in mods], force=True, quiet=True)
setup(name="fairseq_ext", ext_modules=exts, script_args=["build_ext", "--inplace", "-q"])
PY
  head -1 "$OUT/orig_build.log"  # which C++ was compiled
}

orig_flags() {  # model criterion -> the original's train.py flags (see the header)
  local model=$1 crit=$2 warm=""
  if [ "$crit" = trime_loss ]; then warm="--ce-warmup-epoch 0"; fi
  local common="--task language_modeling $REPO/.gpu/orig/data-bin --seed 1 --sample-break-mode none
    --skip-invalid-size-inputs-valid-test --ddp-backend=no_c10d --knn-keytype last_ffn_input --criterion $crit $warm
    --max-update $UPDATES --log-format json --log-interval 5 --no-save --disable-validation --num-workers 2"
  if [ -n "${TINY:-}" ]; then
    common="$common --cpu --decoder-layers 2 --decoder-embed-dim 64 --decoder-ffn-embed-dim 128 --decoder-attention-heads 2"
  else
    common="$common --fp16"
  fi
  case $model in
    247m) echo "$common --arch transformer_lm_wiki103 --max-lr 1.0 --t-mult 2 --lr-period-updates 270000
      --lr-scheduler cosine --lr-shrink 0.75 --warmup-updates 16000 --warmup-init-lr 1e-07 --min-lr 1e-09
      --optimizer nag --lr 0.0001 --clip-norm 0.1 --max-tokens $(tiny 3072 256) --update-freq 6
      --tokens-per-sample $(tiny 3072 256)" ;;
    150m) echo "$common --arch transformer_lm_wiki103_150M --optimizer adam --adam-betas (0.9,0.98) --weight-decay 0.01
      --clip-norm 0.0 --lr 0.0005 --lr-scheduler inverse_sqrt --warmup-updates 8000 --warmup-init-lr 1e-07
      --max-tokens 9000 --update-freq 2 --tokens-per-sample 150 --adaptive-input --tie-adaptive-weights
      --adaptive-input-cutoff 20000,60000 --adaptive-softmax-cutoff 20000,60000 --required-batch-size-multiple 1
      --adaptive-softmax-factor 1 --adaptive-input-factor 1" ;;
    7m) echo "$common --arch transformer_lm_wiki103_small_sm --optimizer adam --adam-betas (0.9,0.98)
      --weight-decay 0.01 --clip-norm 0.0 --lr 0.0005 --lr-scheduler inverse_sqrt --warmup-updates 8000
      --warmup-init-lr 1e-07 --max-tokens $(tiny 24576 2048) --update-freq 1 --tokens-per-sample $(tiny 3072 256)
      --adaptive-input --tie-adaptive-weights --adaptive-input-cutoff 20000,60000
      --adaptive-softmax-cutoff 20000,60000 --adaptive-softmax-factor 4 --adaptive-input-factor 4" ;;
    *) echo "unknown model $model (247m 150m 7m)" >&2; exit 2 ;;
  esac
}
tiny() { if [ -n "${TINY:-}" ]; then echo "$2"; else echo "$1"; fi; }

ours_args() {  # model -> bench.mfu arguments at the original's per-GPU shape
  case $1 in
    247m) echo "--configs=wiki103_247m --rows=1 --set train.grad_accum=6" ;;
    150m) echo "--configs=wiki103_150m --rows=60 --set train.grad_accum=2" ;;
    7m) echo "--configs=wiki103_7m --rows=8 --set train.grad_accum=1" ;;
  esac
}

run_there() {
  device_out_begin /tmp/orig_speed_out
  trap device_out_sync EXIT
  local ok=1
  setup_there || ok=0
  device_out_sync
  local deadline=$(( T_START + ${DEADLINE:-530} )) ours_budget=${OURS_BUDGET:-300} m c
  local orig_end=$(( deadline - ours_budget ))  # the original's runs stop here, whatever setup took
  # Each run gets at most an equal share of what is left for the runs still to come (so one slow or hung run
  # cannot starve the rest; a run that ends early leaves its time to the later ones).
  local runs_left=$(( $(echo $MODELS | wc -w) * $(echo $CRITERIA | wc -w) ))
  if [ "$ok" = 1 ]; then
    for m in $MODELS; do
      for c in $CRITERIA; do
        local left=$(( (orig_end - $(date +%s)) / runs_left ))
        runs_left=$(( runs_left - 1 ))
        if [ "$left" -lt 30 ]; then echo "orig $m $c skipped: budget" | tee -a "$OUT/orig_runs.txt"; continue; fi
        local s rc
        s=$(date +%s)
        # shellcheck disable=SC2046  # the flags are words
        (cd "$WORK" && timeout --foreground -k 10 "$left" $PYBIN train.py $(orig_flags "$m" "$c")) \
          > "$OUT/orig_${m}_${c}.log" 2>&1 && rc=0 || rc=$?
        echo "orig $m $c rc=$rc wall_s=$(( $(date +%s) - s ))" | tee -a "$OUT/orig_runs.txt"
        device_out_sync
      done
    done
  fi
  # Ours at the same shapes (the machine's jax; experiments/gpu_speed.sh's packages), until the deadline.
  if [ -z "${TINY:-}" ] && [ "${OURS:-1}" = 1 ]; then
    export PYTHONPATH=/tmp/site:/tmp/stub:$REPO
    if ! python3 -c "import flax, optax, orbax.checkpoint, ml_collections" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
    fi
    mkdir -p /tmp/stub
    python3 -c "import faiss" 2>/dev/null || printf 'def __getattr__(name):\n  raise ImportError("faiss: not on this machine")\n' > /tmp/stub/faiss.py
  fi
  local ours_py=python3 tinyflag="" ours_models=$MODELS
  if [ -n "${TINY:-}" ]; then ours_py=.venv/bin/python; tinyflag="--tiny"; fi
  if [ "${OURS:-1}" = 0 ]; then ours_models=""; fi  # OURS=0: the original only
  runs_left=$(echo $ours_models | wc -w)
  for m in $ours_models; do
    local left=$(( (deadline - $(date +%s)) / runs_left ))  # an equal share of the rest, as the original's
    runs_left=$(( runs_left - 1 ))
    if [ "$left" -lt 30 ]; then echo "ours $m skipped: budget" | tee -a "$OUT/orig_runs.txt"; continue; fi
    local rc
    # shellcheck disable=SC2046
    timeout --foreground -k 10 "$left" $ours_py -m bench.mfu $(ours_args "$m") $tinyflag --objectives=ce,trime \
      --set trime.memory=local --steps=${OURS_STEPS:-5} --warmup=2 --pipeline_steps=0 --out="$OUT/ours_$m.json" \
      > "$OUT/ours_$m.log" 2>&1 && rc=0 || rc=$?
    echo "ours $m rc=$rc" | tee -a "$OUT/orig_runs.txt"
    device_out_sync
  done
  $ours_py experiments/orig_gpu_speed_table.py "$OUT" | tee "$OUT/orig_vs_ours.md"
  device_out_sync
}

case "${1:-}" in
  prepare) prepare ;;
  run) run_there ;;
  *) echo "usage: $0 prepare | run   (env: TINY=1, OUT=dir, MODELS=\"247m 150m 7m\", CRITERIA=..., UPDATES=n, OURS=0, DEADLINE=s, OURS_BUDGET=s)" >&2
     exit 2 ;;
esac
