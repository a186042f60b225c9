/* libcublas.so.12 for a CUDA 13 machine, for issue 37's GPU FAISS (experiments/gpu_speed.sh prepare_faiss).
 *
 * Why: the package registry's only GPU FAISS builds are for CUDA 12 (faiss-gpu-cu12 1.14.1.post1; faiss-gpu-cuvs
 * is 119 MB). faiss-gpu-cu12 links libcudart.so.12 (carried: nvidia-cuda-runtime-cu12, 3 MiB; CUDA 13's driver
 * runs CUDA 12 programs) and libcublas.so.12 / libcublasLt.so.12, whose wheel (nvidia-cublas-cu12) is 554 MiB
 * against the device tool's 64 MiB. The GPU machine has cuBLAS 13 (jax-cuda13 / torch cu130). FAISS calls eight
 * cuBLAS functions (`nm -D --undefined-only libfaiss*.so | grep @libcublas`), whose C signatures and enum
 * values are the same in cuBLAS 12 and 13; this library defines those eight under the symbol version
 * `libcublas.so.12` that faiss asks for, and calls the same-named function of libcublas.so.13 (found with
 * dlopen: $CUBLAS_SHIM_TARGET, else the loader's search path). Nothing else of FAISS changes; bench/exact_memory
 * compares the GPU index's answers with the CPU index's, so a wrong forward would show.
 *
 * Build (x86-64, any glibc >= 2.2.5; experiments/gpu_speed.sh prepare_faiss does it):
 *   gcc -O2 -shared -fPIC -Wl,-soname,libcublas.so.12 -Wl,--version-script=cublas12_shim.map \
 *       -o libcublas.so.12 cublas12_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef void *Handle;  /* cublasHandle_t: a pointer */
typedef void *Stream;  /* cudaStream_t: a pointer */
typedef int Enum;      /* cublasOperation_t, cudaDataType, cublasComputeType_t, cublasGemmAlgo_t, cublasMath_t */
typedef int Status;    /* cublasStatus_t */

static void *target(const char *name) {
  static void *lib;
  if (!lib) {
    const char *path = getenv("CUBLAS_SHIM_TARGET");
    lib = dlopen(path && *path ? path : "libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      fprintf(stderr, "error: cublas12 shim: cannot load cuBLAS 13: %s\n", dlerror());
      abort();
    }
  }
  void *f = dlsym(lib, name);
  if (!f) {
    fprintf(stderr, "error: cublas12 shim: %s not in cuBLAS 13: %s\n", name, dlerror());
    abort();
  }
  return f;
}

#define FORWARD(name, params, args)                        \
  Status name params {                                     \
    static Status(*f) params;                              \
    if (!f) f = (Status(*) params)target(#name);           \
    return f args;                                         \
  }

FORWARD(cublasCreate_v2, (Handle *handle), (handle))
FORWARD(cublasDestroy_v2, (Handle handle), (handle))
FORWARD(cublasSetStream_v2, (Handle handle, Stream stream), (handle, stream))
FORWARD(cublasGetMathMode, (Handle handle, Enum *mode), (handle, mode))
FORWARD(cublasSetMathMode, (Handle handle, Enum mode), (handle, mode))
FORWARD(cublasSgemmEx,
        (Handle h, Enum ta, Enum tb, int m, int n, int k, const float *alpha, const void *A, Enum at, int lda,
         const void *B, Enum bt, int ldb, const float *beta, void *C, Enum ct, int ldc),
        (h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc))
FORWARD(cublasGemmEx,
        (Handle h, Enum ta, Enum tb, int m, int n, int k, const void *alpha, const void *A, Enum at, int lda,
         const void *B, Enum bt, int ldb, const void *beta, void *C, Enum ct, int ldc, Enum compute, Enum algo),
        (h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, compute, algo))
FORWARD(cublasGemmStridedBatchedEx,
        (Handle h, Enum ta, Enum tb, int m, int n, int k, const void *alpha, const void *A, Enum at, int lda,
         long long sa, const void *B, Enum bt, int ldb, long long sb, const void *beta, void *C, Enum ct, int ldc,
         long long sc, int batch, Enum compute, Enum algo),
        (h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, batch, compute, algo))
