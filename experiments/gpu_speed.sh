#!/bin/bash
# Issue 37's first GPU measurement: `python -m bench.mfu` at the paper shapes of every config, one process per
# config (so a config that runs out of memory or time does not take the others with it, and the device's
# peak-memory counter is that config's), on one H100 / H200 within a 10-minute device slot.
#
#   here:  bash experiments/gpu_speed.sh prepare
#            # .gpu/whl (git-ignored): the pinned pure-Python packages the bare machine lacks (flax, optax,
#            # orbax-checkpoint, ml_collections; its own jax runs them), as experiments/docs_wt_device.sh
#   there: bash experiments/gpu_speed.sh run        (device tool: carry [".gpu"], timeout_s ≈ 560)
#            # $OUT/mfu_<config>.json and .log per config, $OUT/summary.txt (the tables), $OUT/env.txt
#   here, to check the script's logic without a GPU:
#          TINY=1 OUT=/tmp/gpu_speed bash experiments/gpu_speed.sh run
#            # the same loop with --tiny shapes and this checkout's .venv
#
# Budget: the slot is 10 minutes of device time, machine start and transfers included; the loop below gives each
# config its own wall-clock limit (BUDGETS, seconds; 440 s in all), after which that config's process is killed
# and the next one starts (its log says how far it got; no JSON). Compiling the 247M step (16 layers, 267k-word
# adaptive softmax) is the largest single cost, hence its share. MAX_BATCH=1 adds the doubling search for the
# largest per-device batch (each size compiles again: give it a slot of its own, with fewer configs).
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIGS=${CONFIGS:-"wiki103_247m wiki103_150m wiki103_7m enwik8_38m docs_wt"}
declare -A BUDGETS=([wiki103_247m]=130 [wiki103_150m]=100 [wiki103_7m]=80 [enwik8_38m]=70 [docs_wt]=60)

setup() {  # there: the carried packages and a faiss stand-in (nothing here uses faiss; some modules import it)
  if [ -n "${TINY:-}" ]; then PYBIN=${PYBIN:-.venv/bin/python}; return; fi
  PYBIN=${PYBIN:-python3}  # the machine's python (with its jax)
  export PYTHONPATH=/tmp/site:/tmp/stub:$PWD
  if [ ! -f /tmp/trime_speed_setup.done ]; then
    if ! $PYBIN -c "import flax, optax, orbax.checkpoint, ml_collections" 2>/dev/null; then
      $PYBIN -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl
    fi
    mkdir -p /tmp/stub
    $PYBIN -c "import faiss" 2>/dev/null || \
      printf 'def __getattr__(name):\n  raise ImportError("faiss: not on this machine")\n' > /tmp/stub/faiss.py
    touch /tmp/trime_speed_setup.done
  fi
}

case "${1:-}" in
  prepare)
    mkdir -p .gpu/whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .gpu/whl \
      flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8 ml_collections==1.1.0
    du -sh .gpu/whl
    ;;
  run)
    setup
    OUT=${OUT:-/tmp/gpu_speed_out}
    mkdir -p "$OUT"
    { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
      $PYBIN -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
      git log -1 --format='commit %H %s' 2>/dev/null || true; } > "$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
    FLAGS="--steps=${STEPS:-5} --warmup=2 --pipeline_steps=10"
    if [ -n "${TINY:-}" ]; then FLAGS="--tiny --steps=2 --warmup=1 --pipeline_steps=2"; fi
    if [ -n "${MAX_BATCH:-}" ]; then FLAGS="$FLAGS --max_batch"; fi
    T0=$(date +%s)
    for C in $CONFIGS; do
      B=${BUDGETS[$C]:-60}
      S=$(date +%s)
      # --foreground: the benchmark gets the signal itself; -k: SIGKILL 10 s later if it ignores SIGTERM
      timeout --foreground -k 10 "$B" $PYBIN -m bench.mfu --configs="$C" $FLAGS --out="$OUT/mfu_$C.json" \
        > "$OUT/mfu_$C.log" 2>&1 && RC=0 || RC=$?
      echo "$C rc=$RC wall_s=$(( $(date +%s) - S )) budget_s=$B" | tee -a "$OUT/summary.txt"
      grep '^|' "$OUT/mfu_$C.log" >> "$OUT/summary.txt" || tail -5 "$OUT/mfu_$C.log" >> "$OUT/summary.txt"
    done
    echo "all configs: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/summary.txt"
    cat "$OUT/summary.txt"
    ;;
  *) echo "usage: $0 prepare | run   (env: TINY=1, OUT=dir, CONFIGS=\"...\", STEPS=n, MAX_BATCH=1)" >&2; exit 2 ;;
esac
