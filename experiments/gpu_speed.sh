#!/bin/bash
# Issue 37's first GPU measurement: `python -m bench.mfu` at the paper shapes of every config, one process per
# config (so a config that runs out of memory or time does not take the others with it, and the device's
# peak-memory counter is that config's), on one H100 / H200 within a 10-minute device slot.
#
#   here:  bash experiments/gpu_speed.sh prepare
#            # .gpu/whl (git-ignored): the pinned pure-Python packages the bare machine lacks (flax, optax,
#            # orbax-checkpoint, ml_collections; its own jax runs them), as experiments/docs_wt_device.sh
#   there: bash experiments/gpu_speed.sh run        (device tool: carry [".gpu/whl"], timeout_s ≈ 560)
#            # $OUT/summary.txt (the tables), $OUT/env.txt, $OUT/raw.tgz (mfu_<config>.json and .log per config)
#   there: bash experiments/gpu_speed.sh levers     (device tool: carry [".gpu/whl"], timeout_s ≈ 560)
#            # the speed levers of issue 37, each alone against the baseline, for wiki103_247m (CONFIGS=...
#            # to change): $OUT/levers_summary.md (the comparison), levers.txt, raw.tgz (each run's .json, .log)
#   there: bash experiments/gpu_speed.sh eval       (device tool: carry [".gpu/whl"], timeout_s ≈ 560)
#            # bench.eval_speed per config: evaluation tokens/s (local; long-term at the paper's store size) and
#            # the datastore key pass: $OUT/eval_summary.txt, $OUT/raw.tgz (eval_<config>.json and .log)
#   there: bash experiments/gpu_speed.sh faiss      (device tool: carry [".gpu/whl", ".gpu_faiss"], timeout_s ≈ 560)
#            # GPU FAISS vs CPU FAISS vs exact on-device search at docs-wt's sizes (prepare_faiss here first)
#   here, to check the script's logic without a GPU:
#          TINY=1 OUT=/tmp/gpu_speed bash experiments/gpu_speed.sh run      (or levers)
#            # the same loop with --tiny shapes and this checkout's .venv
# $OUT receives at most seven files (DEVICE_OUT_FILES below and raw.tgz; the device tool returns eight): the
# summaries, and every run's files in raw.tgz, re-packed after each run (experiments/device_out.sh; `tar -xzf
# raw.tgz` unpacks them).
#
# Budget: a session has 15 minutes of device time, the machine's start (~200 s) and transfers included, and a
# command at most 10 minutes (docs/performance.md "On accelerators" plans the slots); the loop below gives each
# config its own wall-clock limit (BUDGETS, seconds; 450 s in all), after which that config's process is killed
# and the next one starts (its log says how far it got; no JSON). Compiling the 247M step (16 layers, 267k-word
# adaptive softmax) is the largest single cost, hence its share. MAX_BATCH=1 adds the doubling search for the
# largest per-device batch (each size compiles again: give it a slot of its own, with fewer configs).
set -euo pipefail
cd "$(dirname "$0")/.."
source experiments/device_out.sh
DEVICE_OUT_FILES="env.txt summary.txt levers_summary.md levers.txt eval_summary.txt faiss.log"

LEVER_CONFIGS=${CONFIGS:-wiki103_247m}  # levers: one config unless CONFIGS says otherwise
CONFIGS=${CONFIGS:-"wiki103_247m wiki103_150m wiki103_7m enwik8_38m docs_wt"}
declare -A BUDGETS=([wiki103_247m]=180 [wiki103_150m]=90 [wiki103_7m]=70 [enwik8_38m]=60 [docs_wt]=50)

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

record_env() {
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    $PYBIN -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" || true
    # for experiments/orig_gpu_speed.sh (the original needs PyTorch with CUDA and a compiler there)
    $PYBIN -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.is_available())" \
      2>&1 | tail -1 || true; command -v g++ || echo "g++: none"
    git log -1 --format='commit %H %s' 2>/dev/null || true; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

# Levers (issue 37; docs/performance.md "Levers prepared for the GPU"): bench.mfu arguments and XLA flags of
# each, measured one at a time against the baseline (the config as it is). attention_impl=cudnn only changes
# attention without dropout, and the paper configs train with attention_dropout 0.1: so the kernel is measured
# as the pair attn_dropout0 (XLA) / cudnn_attn_dropout0, and the recipe change itself against the baseline.
declare -A LEVER_ARGS=(
  [baseline]=""
  # Our flash kernels with the dropout inside (trime_jax/flash_attention.py): the paper recipe as it is, no
  # [B, H, L, L] weights; --check_attention first compares them with the materialised float32 attention.
  [pallas_attn]="--set model.attention_impl=pallas --check_attention"
  [pallas_attn_small_tiles]="--set model.attention_impl=pallas"  # its tiles: LEVER_ENV
  # Every dropout's mask from the kernels' counter hash in place of nnx.Dropout's random bits (threefry): the
  # paper recipe, XLA's [B, H, L, L] weights as before, each mask a few fused integer operations per element;
  # then the same with the kernels (their attention masks are the hash's, the other dropouts hashed too).
  # The adaptive softmax's tails for their own rows only, as the original computes them (bench.mfu's tokens follow
  # Zipf's law, so 20% of the 247M model's targets are in its tails; a quarter of the rows is room enough).
  [tail_rows_025]="--set model.adaptive_tail_rows=0.25"
  [dropout_hash]="--set model.dropout_mask=hash"
  [pallas_dropout_hash]="--set model.attention_impl=pallas --set model.dropout_mask=hash"
  [cudnn_attn_dropout0]="--set model.attention_impl=cudnn --set model.attention_dropout=0.0 --check_attention"
  [attn_dropout0]="--set model.attention_dropout=0.0"
  [remat_block]="--set model.remat=block"
  [remat_dots_no_batch]="--set model.remat=dots_with_no_batch_dims_saveable"
  [remat_dots]="--set model.remat=dots_saveable"
  [xla_no_triton_gemm]=""
  [xla_latency_hiding]=""
  # The chunked vocabulary path: wiki103_* configs compute the adaptive head and tails (or the full softmax) in
  # chunks of 16,384 words, a scan of small matmuls (the 207,735-word tail of the 247M model in 13). An H200 holds
  # the whole [rows, V_i] logits of one micro-batch (3,072 x 207,735 x 4 B = 2.5 GB): no chunks, or larger ones.
  [vocab_chunk_0]="--set train.vocab_chunk=0"
  [vocab_chunk_64k]="--set train.vocab_chunk=65536"
  # Both: a quarter of the rows through each tail in one matmul ([768, 207,735] logits at 3,072 rows, 0.6 GB);
  # the every-row fallback keeps to blocks of that size (model._tail_term), so the plan stays small.
  [tail_rows_025_vocab_chunk_0]="--set model.adaptive_tail_rows=0.25 --set train.vocab_chunk=0"
  # Not in the default list (two changes at once, wiki103_247m's tokens per update): remat's room for larger
  # micro-batches, 24 rows × 1 instead of 8 rows × 3.
  [remat_block_accum1]="--set model.remat=block --set train.batch_size=24 --set train.grad_accum=1"
)
# Environment of a lever's run: the flash kernels' tiles (trime_jax/flash_attention.py; defaults q=128, k=64,
# bwd=64, 8 warps at head dimension 128), smaller against register pressure.
declare -A LEVER_ENV=(
  [pallas_attn_small_tiles]="TRIME_FLASH_TILES=q=64,k=64,bwd=32,warps=4"
)
declare -A LEVER_XLA=(
  [xla_no_triton_gemm]="--xla_gpu_enable_triton_gemm=false"  # cuBLAS for every matmul, not Triton's
  [xla_latency_hiding]="--xla_gpu_enable_latency_hiding_scheduler=true"  # overlap scheduling (mostly collectives)
)
# In priority order: when the budget runs out, the last ones are skipped (and say so).
LEVERS=${LEVERS:-"baseline pallas_attn dropout_hash tail_rows_025 pallas_dropout_hash vocab_chunk_0 tail_rows_025_vocab_chunk_0 pallas_attn_small_tiles cudnn_attn_dropout0 attn_dropout0 vocab_chunk_64k remat_block remat_dots_no_batch xla_no_triton_gemm remat_dots xla_latency_hiding"}

levers() {
  # Budget: LEVER_BUDGET seconds of runs in all (default 420: the 10-minute slot less machine start, setup and
  # transfers), shared equally by the configs. The first lever (the baseline) runs with at most BASELINE_MAX s;
  # its wall time W (mostly compilation) predicts the others': a later lever runs when W + 10 s are left, with
  # 1.5 W + 20 s (at most what is left) as its limit, and is skipped, saying so, otherwise. If the first run
  # failed, W is LEVER_LIMIT (default 120 s).
  local budget=${LEVER_BUDGET:-420} n_cfg
  n_cfg=$(echo $LEVER_CONFIGS | wc -w)
  local per_cfg=$(( budget / n_cfg ))
  local flags="--objectives=${OBJECTIVES:-ce} --steps=${STEPS:-4} --warmup=2 --pipeline_steps=0"
  if [ -n "${TINY:-}" ]; then flags="--tiny --objectives=${OBJECTIVES:-ce} --steps=1 --warmup=1 --pipeline_steps=0"; fi
  printf 'config\tlever\trc\twall_s\tlimit_s\n' > "$OUT/levers_runs.tsv"
  : > "$OUT/levers.txt"
  for C in $LEVER_CONFIGS; do
    local t_cfg need="" cap="" L
    t_cfg=$(date +%s)
    for L in $LEVERS; do
      if [ -z "${LEVER_ARGS[$L]+x}" ]; then echo "unknown lever $L (known: ${!LEVER_ARGS[*]})" >&2; exit 2; fi
      local left=$(( per_cfg - ($(date +%s) - t_cfg) )) limit
      if [ -z "$need" ]; then limit=$(( left < ${BASELINE_MAX:-200} ? left : ${BASELINE_MAX:-200} ))
      else limit=$(( left < cap ? left : cap )); fi
      if [ "$left" -lt "${need:-30}" ] || [ "$limit" -lt 30 ]; then
        echo "$C $L skipped: ${left} s left of ${per_cfg} s, a run needs ~${need:-30} s" | tee -a "$OUT/levers.txt"
        printf '%s\t%s\tskipped\t0\t%s\n' "$C" "$L" "$left" >> "$OUT/levers_runs.tsv"
        continue
      fi
      local s rc xf="${XLA_FLAGS:-}" runenv=(env)
      # XLA flags: the lever's added to any the caller set (XLA reads a blank XLA_FLAGS as a file name: none then)
      if [ -n "${LEVER_XLA[$L]:-}" ]; then xf="${xf:+$xf }${LEVER_XLA[$L]}"; fi
      if [ -n "$xf" ]; then runenv=(env "XLA_FLAGS=$xf"); fi
      if [ -n "${LEVER_ENV[$L]:-}" ]; then runenv+=("${LEVER_ENV[$L]}"); fi
      s=$(date +%s)
      # Each lever its own process: one that fails or runs out of memory leaves the others alone.
      "${runenv[@]}" timeout --foreground -k 10 "$limit" $PYBIN -m bench.mfu \
        --configs="$C" $flags ${LEVER_ARGS[$L]} --out="$OUT/levers_${C}_$L.json" > "$OUT/levers_${C}_$L.log" 2>&1 \
        && rc=0 || rc=$?
      local wall=$(( $(date +%s) - s ))
      echo "$C $L rc=$rc wall_s=$wall limit_s=$limit" | tee -a "$OUT/levers.txt"
      printf '%s\t%s\t%s\t%s\t%s\n' "$C" "$L" "$rc" "$wall" "$limit" >> "$OUT/levers_runs.tsv"
      device_out_sync
      if [ "$L" = baseline ] || [ -z "$need" ]; then  # a failed first run predicts nothing: LEVER_LIMIT then
        local w=$wall
        if [ "$rc" != 0 ]; then w=${LEVER_LIMIT:-120}; fi
        need=$(( w + 10 )) cap=$(( w * 3 / 2 + 20 ))
      fi
    done
  done
  $PYBIN - "$OUT" <<'PY' | tee "$OUT/levers_summary.md"
import csv, json, os, sys
out = sys.argv[1]
runs = list(csv.DictReader(open(os.path.join(out, "levers_runs.tsv")), delimiter="\t"))
print("| config | lever | objective | B×L×A | step (s) | tokens/s | MFU | vs baseline | XLA plan GiB | "
      "device peak GiB | run |")
print("|" + "---|" * 11)
base = {}
gib = lambda b: f"{b / 2**30:.2f}" if b else "n/a"
for r in runs:
  c, lever = r["config"], r["lever"]
  path = os.path.join(out, f"levers_{c}_{lever}.json")
  run = "skipped (budget)" if r["rc"] == "skipped" else f"rc {r['rc']}, {r['wall_s']} s of {r['limit_s']}"
  entry = json.load(open(path))["configs"].get(c, {}) if os.path.exists(path) and r["rc"] != "skipped" else {}
  if not entry.get("rows"):
    log = os.path.join(out, f"levers_{c}_{lever}.log")
    lines = [x.strip() for x in open(log, errors="replace")] if os.path.exists(log) else []
    why = next((x for x in reversed(lines) if x), "") if r["rc"] != "0" else ""
    why = "; ".join(f"{k}: {v}" for k, v in entry.get("errors", {}).items()) or why
    print(f"| {c} | {lever} | | | | | | | | | {run}{': ' + why[:160] if why else ''} |")
    continue
  for obj, row in entry["rows"].items():
    if lever == "baseline":
      base[(c, obj)] = row["step_s"]
    ref = base.get((c, obj))
    vs = f"{ref / row['step_s']:.3f}×" if ref else "n/a"
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
    print(f"| {c} | {lever} | {obj} | {row['rows_per_device']}×{row['segment_len']}×{row['grad_accum']} | "
          f"{row['step_s']:.4f} | {row['tokens_per_s']:,.0f} | {mfu} | {vs} | {gib(row['xla_memory_plan_bytes'])} | "
          f"{gib(row['device_peak_bytes_so_far'])} | {run} |")
  chk = entry.get("attention_check")
  if chk:
    print(f"|   | {lever}: attention {chk['impl']} vs xla ({chk['dtype']}) | max abs Δ features "
          f"{chk['impl_vs_xla']['features']:.3g}, grads {chk['impl_vs_xla']['grads']:.3g}; xla vs float32 "
          f"{chk['xla_vs_float32']['features']:.3g}, {chk['xla_vs_float32']['grads']:.3g} | | | | | | | | |")
print("\nvs baseline: baseline step time ÷ this lever's (> 1: faster). Levers are measured alone; MFU against the "
      "table's peak.")
PY
}

begin_there() {  # the packages, $OUT (a scratch folder from here on; device_out.sh) and the environment record
  setup
  device_out_begin /tmp/gpu_speed_out
  trap device_out_sync EXIT
  record_env
  device_out_sync
}

# One benchmark process per config (one that fails, or runs out of memory or time, leaves the others alone, and
# the device's peak-memory counter is its own): MODULE FLAGS PREFIX SUMMARY BUDGET_FN CONFIGS. Writes
# $OUT/PREFIX_<config>.json / .log and appends each config's table rows (or its last lines) to $OUT/SUMMARY.
per_config() {
  local module=$1 flags=$2 prefix=$3 summary=$4 budget_fn=$5 configs=$6 C B S RC T0
  T0=$(date +%s)
  for C in $configs; do
    B=$($budget_fn "$C")
    S=$(date +%s)
    # --foreground: the benchmark gets the signal itself; -k: SIGKILL 10 s later if it ignores SIGTERM
    timeout --foreground -k 10 "$B" $PYBIN -m "$module" --configs="$C" $flags --out="$OUT/${prefix}_$C.json" \
      > "$OUT/${prefix}_$C.log" 2>&1 && RC=0 || RC=$?
    echo "$C rc=$RC wall_s=$(( $(date +%s) - S )) budget_s=$B" | tee -a "$OUT/$summary"
    grep '^|' "$OUT/${prefix}_$C.log" >> "$OUT/$summary" || tail -5 "$OUT/${prefix}_$C.log" >> "$OUT/$summary"
    device_out_sync
  done
  echo "all configs: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/$summary"
  cat "$OUT/$summary"
}

case "${1:-}" in
  prepare)
    mkdir -p .gpu/whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .gpu/whl \
      $(grep -v '^#' experiments/device_wheels.txt)  # one list for both device scripts
    du -sh .gpu/whl
    ;;
  run)
    begin_there
    FLAGS="--steps=${STEPS:-5} --warmup=2 --pipeline_steps=10"
    if [ -n "${TINY:-}" ]; then FLAGS="--tiny --steps=2 --warmup=1 --pipeline_steps=2"; fi
    if [ -n "${MAX_BATCH:-}" ]; then FLAGS="$FLAGS --max_batch"; fi
    mfu_budget() { echo "${BUDGETS[$1]:-60}"; }
    per_config bench.mfu "$FLAGS" mfu summary.txt mfu_budget "$CONFIGS"
    ;;
  prepare_faiss)  # issue 37's GPU FAISS. The registry's GPU builds are for CUDA 12 only (faiss-gpu-cu12; faiss-gpu-cuvs
    # is 119 MB), and the GPU image is CUDA 13. The CUDA 12 runtime is carried (nvidia-cuda-runtime-cu12, 3 MiB;
    # the CUDA 13 driver runs CUDA 12 programs); cuBLAS 12 (554 MiB) cannot be, so experiments/cublas12_shim.c
    # (built there) forwards FAISS's eight cuBLAS calls to the machine's cuBLAS 13. Both wheels unpacked into one
    # folder (pip install --target's layout, CUDA's headers and static libraries left out) and xz-compressed:
    # 23 MB, against 48 MB as a wheel, so that the tracked tree (~18 MB) + .gpu/whl + this pass the device
    # tool's 64 MiB. Kept out of .gpu/: the other scripts carry .gpu/whl (and .gpu/cache, .gpu/orig).
    T=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d "$T/whl" faiss-gpu-cu12==1.14.1.post1 nvidia-cuda-runtime-cu12==12.9.79
    mkdir -p "$T/site"
    for W in "$T"/whl/*.whl; do python3 -m zipfile -e "$W" "$T/site"; done
    rm -rf "$T/site/nvidia/cuda_runtime/include" "$T"/site/nvidia/cuda_runtime/lib/*.a
    mkdir -p .gpu_faiss
    rm -f .gpu_faiss/*.whl  # the wheel this subcommand kept before
    tar -C "$T/site" -cf - . | xz -9e -T2 > .gpu_faiss/faiss_gpu_cu12_site.tar.xz
    rm -rf "$T"
    du -sh .gpu_faiss/*
    ;;
  faiss)  # there (carry [".gpu/whl", ".gpu_faiss"]): bench.exact_memory at docs-wt's datastore sizes (D = 128, up
    # to 17.8M keys), 1,024 queries a step (the eval config's 8 x 128), K = 1,024, nprobe = 32: FAISS flat / IVF-PQ
    # on the host CPUs and on the GPU (with the share of its answers the host index agrees with), and the exact
    # on-device path on the GPU. Random keys: the search cost depends on the sizes only.
    begin_there
    source experiments/faiss_gpu_env.sh  # FAISS_GPU_READY, FAISS_GPU_WHY; its PYTHONPATH entry before the stub's
    echo "GPU FAISS: ready=$FAISS_GPU_READY; $FAISS_GPU_WHY" >> "$OUT/env.txt"
    JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} timeout --foreground -k 10 "${FAISS_LIMIT:-420}" $PYBIN -m bench.exact_memory \
      --sizes="${SIZES:-1048576,4194304,17825792}" --dim=128 --queries=1024 --k=1024 --nprobe=32 --devices=1 \
      --repeats=3 ${FAISS_GPU_FLAG-$([ "$FAISS_GPU_READY" = 1 ] && echo --faiss_gpu)} 2>&1 | tee "$OUT/faiss.log"
    ;;
  eval)  # there (carry [".gpu/whl"]): bench.eval_speed at the paper configs' evaluation shapes:
    # launch.eval's tokens/s with local memory and with the long-term store of the paper's size, and the datastore
    # key pass, on a randomly initialised model and a synthetic corpus (the cost depends on the shapes only). One
    # process per config, EVAL_BUDGET seconds each (default 100; 247M: 160).
    begin_there
    EFLAGS="--tokens=${EVAL_TOKENS:-65536}"
    if [ -n "${TINY:-}" ]; then EFLAGS="--tiny"; fi
    eval_budget() { echo "${EVAL_BUDGET:-$([ "$1" = wiki103_247m ] && echo 160 || echo 100)}"; }
    per_config bench.eval_speed "$EFLAGS" eval eval_summary.txt eval_budget \
      "${EVAL_CONFIGS:-wiki103_247m wiki103_150m enwik8_38m docs_wt}"
    ;;
  levers)
    begin_there
    levers
    ;;
  *) echo "usage: $0 prepare | prepare_faiss | run | levers | faiss | eval   (env: TINY=1, OUT=dir, CONFIGS=\"...\", STEPS=n, MAX_BATCH=1;" \
       "levers: LEVERS=\"...\", LEVER_BUDGET=s, OBJECTIVES=ce,trime)" >&2; exit 2 ;;
esac
