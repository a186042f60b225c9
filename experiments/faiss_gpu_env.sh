# shellcheck shell=bash
# Sourced (bash) on the GPU machine by experiments/gpu_speed.sh faiss and experiments/docs_wt_device.sh ext3:
# makes `import faiss` load PyPI's CUDA 12 GPU build of FAISS on the CUDA 13 image (see `gpu_speed.sh
# prepare_faiss` for why it is carried this way). Unpacks .gpu_faiss/faiss_gpu_cu12_site.tar.xz into $FAISS_SITE
# once per machine (a warm machine keeps /tmp, so a later call that does not carry .gpu_faiss still finds it),
# builds experiments/cublas12_shim.c, finds the machine's cuBLAS 13, and exports PYTHONPATH / LD_LIBRARY_PATH.
# Sets FAISS_USABLE=1 when that faiss imports (the paths stay exported; else they are not, so a broken GPU build
# cannot shadow anything) and FAISS_GPU_READY=1 when it also sees a GPU, else 0 with the reason in FAISS_GPU_WHY.
# Sourced under `set -e`: every step that can fail is tested, so a failure here leaves the CPU FAISS (when it
# imports) and the exact runs to go on.
FAISS_SITE=${FAISS_SITE:-/tmp/faiss_gpu_site}
FAISS_SHIM=${FAISS_SHIM:-/tmp/cublas12_shim}
FAISS_GPU_READY=0 FAISS_USABLE=0 FAISS_GPU_WHY=""
if [ ! -d "$FAISS_SITE/faiss" ] && [ -f .gpu_faiss/faiss_gpu_cu12_site.tar.xz ]; then
  mkdir -p "$FAISS_SITE"
  if ! tar -C "$FAISS_SITE" -xJf .gpu_faiss/faiss_gpu_cu12_site.tar.xz; then
    rm -rf "$FAISS_SITE/faiss"  # a broken unpack counts as none (below)
  fi
fi
if [ ! -d "$FAISS_SITE/faiss" ]; then
  FAISS_GPU_WHY="no GPU FAISS on this machine: carry .gpu_faiss (experiments/gpu_speed.sh prepare_faiss), or call right after a call that did"
elif ! command -v gcc > /dev/null; then
  FAISS_GPU_WHY="no C compiler (gcc) to build experiments/cublas12_shim.c"
else
  mkdir -p "$FAISS_SHIM"
  if ! gcc -O2 -shared -fPIC -Wl,-soname,libcublas.so.12 -Wl,--version-script=experiments/cublas12_shim.map \
         -o "$FAISS_SHIM/libcublas.so.12" experiments/cublas12_shim.c -ldl \
     || ! gcc -O2 -shared -fPIC -Wl,-soname,libcublasLt.so.12 -o "$FAISS_SHIM/libcublasLt.so.12" -x c /dev/null; then
    FAISS_GPU_WHY="experiments/cublas12_shim.c did not build (gcc's messages above)"  # libcublasLt: NEEDED only
  fi
fi
if [ -d "$FAISS_SITE/faiss" ] && [ -z "$FAISS_GPU_WHY" ]; then
  # The machine's cuBLAS 13: a pip package's (nvidia/.../lib, as jax-cuda13 and torch cu130 bring it) or CUDA's own
  CUBLAS13=$(${PYBIN:-python3} - <<'PY'
import glob, os, site, sys
roots = [*site.getsitepackages(), *sys.path]
hits = [h for r in roots if os.path.isdir(os.path.join(r, "nvidia"))
        for h in glob.glob(os.path.join(r, "nvidia", "**", "libcublas.so.13*"), recursive=True)]
hits += glob.glob("/usr/local/cuda*/lib64/libcublas.so.13*") + glob.glob("/usr/local/cuda*/targets/*/lib/libcublas.so.13*")
print(min(hits, key=len) if hits else "")
PY
) || CUBLAS13=""
  export CUBLAS_SHIM_TARGET=$CUBLAS13  # empty: the loader's search path
  export _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1  # the wheel would look for nvidia-cublas-cu12's files
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX would otherwise take 75% of the GPU before FAISS asks
  FAISS_LD="$FAISS_SHIM:$FAISS_SITE/nvidia/cuda_runtime/lib${CUBLAS13:+:$(dirname "$CUBLAS13")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  FAISS_PP="$FAISS_SITE${PYTHONPATH:+:$PYTHONPATH}"
  # exit 0: imports and sees a GPU; 3: imports, no GPU (the CPU indexes still run); else it does not import
  FAISS_GPU_WHY=$(LD_LIBRARY_PATH=$FAISS_LD PYTHONPATH=$FAISS_PP ${PYBIN:-python3} -c "
import faiss
n = faiss.get_num_gpus()
print(f'faiss {faiss.__version__} ({faiss.__file__}) sees {n} GPU(s); cuBLAS 13: ${CUBLAS13:-the loader path}')
raise SystemExit(0 if n > 0 else 3)" 2>&1 | tail -1; exit "${PIPESTATUS[0]}") && RC=0 || RC=$?
  if [ $RC = 0 ] || [ $RC = 3 ]; then
    FAISS_USABLE=1; [ $RC = 0 ] && FAISS_GPU_READY=1
    export LD_LIBRARY_PATH=$FAISS_LD PYTHONPATH=$FAISS_PP
  else
    FAISS_GPU_WHY="the GPU FAISS does not import, left out of the paths: $FAISS_GPU_WHY"
  fi
fi
echo "GPU FAISS: ready=$FAISS_GPU_READY usable=$FAISS_USABLE; $FAISS_GPU_WHY"
