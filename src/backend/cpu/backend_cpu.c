/* The CPU backend vtable: the fast CPU ops (OpenMP) and the reference backend
 * (the same ops on one thread with the naive GEMM). */
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "backend/cpu/cpu-impl.h"

/* fl_cpu_gemm, on one thread when the product is small (FL_CPU_GEMM_PAR_MIN): the libraries
 * open a parallel region for any size, and a tiny model's step is thousands of tiny GEMMs. */
fl_status fl_cpu_gemm_sized(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                            void *C, fl_dtype tc, int ldc) {
    if (be->n_threads > 1 && (int64_t)M * N * K < FL_CPU_GEMM_PAR_MIN) {
        fl_backend one = *be;
        one.n_threads = 1;
        return fl_cpu_gemm(&one, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
    }
    return fl_cpu_gemm(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
}

static void fill_ops(fl_backend *be) {
    be->embedding_forward = fl_cpu_embedding_forward;
    be->embedding_backward = fl_cpu_embedding_backward;
    be->relbias_forward = fl_cpu_relbias_forward;
    be->relbias_backward = fl_cpu_relbias_backward;
    be->rmsnorm_forward = fl_cpu_rmsnorm_forward;
    be->rmsnorm_backward = fl_cpu_rmsnorm_backward;
    be->add_rmsnorm_forward = fl_backend_add_rmsnorm_composed;
    be->add_norm_forward16 = fl_backend_add_norm16_composed;
    be->layernorm_forward = fl_cpu_layernorm_forward;
    be->layernorm_backward = fl_cpu_layernorm_backward;
    be->rope_forward = fl_cpu_rope_forward;
    be->rope_backward = fl_cpu_rope_backward;
    be->attention_forward = fl_cpu_attention_forward;
    be->attention_backward = fl_cpu_attention_backward;
    be->swiglu_forward = fl_cpu_swiglu_forward;
    be->swiglu_backward = fl_cpu_swiglu_backward;
    be->gelu_forward = fl_cpu_gelu_forward;
    be->gelu_backward = fl_cpu_gelu_backward;
    be->relu_forward = fl_cpu_relu_forward;
    be->relu_backward = fl_cpu_relu_backward;
    be->gelu_erf_forward = fl_cpu_gelu_erf_forward;
    be->gelu_erf_backward = fl_cpu_gelu_erf_backward;
    be->geglu_forward = fl_cpu_geglu_forward;
    be->geglu_backward = fl_cpu_geglu_backward;
    be->add = fl_cpu_add;
    be->bias_forward = fl_cpu_bias_forward;
    be->bias_backward = fl_cpu_bias_backward;
    be->cross_entropy = fl_cpu_cross_entropy;
    be->adamw_update = fl_cpu_adamw_update;
    be->sgd_update = fl_cpu_sgd_update;
    be->sumsq = fl_cpu_sumsq;
    be->scale = fl_cpu_scale;
    be->zero = fl_cpu_zero;
    be->convert = fl_cpu_convert;
    be->check_finite = fl_cpu_check_finite;
    be->adam8bit_update = fl_cpu_adam8bit_update;
    be->attention_decode = fl_cpu_attention_decode;
    be->q4_matmul_forward = fl_cpu_q4_matmul_forward;
    be->q4_matmul_backward = fl_cpu_q4_matmul_backward;
    be->lora_forward = fl_cpu_lora_forward;
    be->lora_backward = fl_cpu_lora_backward;
    be->dropout = fl_cpu_dropout;
    be->dropout_rows = fl_cpu_dropout_rows;
    be->vocab_stats = fl_cpu_vocab_stats;
    be->vocab_xent = fl_cpu_vocab_xent;
    be->accumulate16 = fl_cpu_accumulate16;
    be->set_scratch = fl_cpu_set_scratch;
    be->to_device = fl_cpu_to_device;
    be->to_host = fl_cpu_to_host;
    be->copy = fl_cpu_copy;
    be->sync = fl_cpu_sync;
    be->supports_op = fl_cpu_supports_op;
    be->run = fl_backend_run_slots;
    be->rope_tables = fl_cpu_rope_tables;
    be->pool_init = fl_cpu_pool_init;
    be->host_pool_init = fl_cpu_pool_init;
    be->caps = FL_CAP_HOST_MEMORY;
}

/* The scratch lent by the calling thread (ops run on the caller's thread; their OpenMP workers
 * receive pointers into it). Per thread, so backends used by different threads do not mix. */
static _Thread_local struct {
    char *p;
    size_t bytes;
} tl_scratch;

void fl_cpu_set_scratch(const fl_backend *be, void *p, size_t bytes) {
    (void)be;
    tl_scratch.p = bytes >= FL_CPU_SCRATCH_BYTES ? p : NULL;
    tl_scratch.bytes = tl_scratch.p ? bytes : 0;
}

size_t fl_cpu_scratch_bytes(void) { return FL_CPU_SCRATCH_BYTES; }

float *fl_cpu_scratch_part(int part) {
    if (!tl_scratch.p) return NULL;
    return (float *)tl_scratch.p + (part ? FL_CPU_WIDEN_SCRATCH : 0);
}

fl_status fl_cpu_backend_init(fl_backend *be, int n_threads) {
    if (!be) return fl_errorf(FL_ERR_INVALID, "fl_cpu_backend_init: NULL backend");
    memset(be, 0, sizeof *be);
    be->name = "cpu";
    be->device = FL_DEV_CPU;
    be->n_threads = n_threads > 0 ? n_threads : fl_cpu_default_threads();
    if (be->n_threads > FL_CPU_MAX_THREADS) be->n_threads = FL_CPU_MAX_THREADS;
    be->gemm_name = fl_cpu_gemm_library();
    be->gemm_widens16 = fl_cpu_gemm_widens16();
    be->gemm = fl_cpu_gemm_sized;
    fill_ops(be);
    be->scratch_bytes = FL_CPU_SCRATCH_BYTES;
    return FL_OK;
}

void fl_cpu_backend_free(fl_backend *be) {
    if (be) memset(be, 0, sizeof *be);
}

fl_status fl_ref_backend_init(fl_backend *be) {
    if (!be) return fl_errorf(FL_ERR_INVALID, "fl_ref_backend_init: NULL backend");
    memset(be, 0, sizeof *be);
    be->name = "ref";
    be->device = FL_DEV_CPU;
    be->n_threads = 1;
    be->gemm_name = "naive";
    be->gemm = fl_cpu_gemm_naive;
    fill_ops(be);
    return FL_OK;
}

void fl_cpu_process_init(char **argv) {
    /* any explicit choice of the user (or of our own earlier exec) stands */
    int omp = !getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT") && !getenv("KMP_BLOCKTIME");
    /* OpenBLAS builds: its pthread workers yield-spin up to 2^28 cycles (~0.1 s) after each call;
     * 2^4 cycles lets them sleep at once (with passive OpenMP: a GEMM/kernel loop took its parts'
     * sum instead of 1.15x it, gemm_bench --interop-only) */
    int blas = !strcmp(fl_cpu_gemm_library(), "openblas") && !getenv("OPENBLAS_THREAD_TIMEOUT");
    if (!(omp || blas) || !argv || !argv[0]) return;
    /* Passive rather than a short spin (GOMP_SPINCOUNT 1000 or 10000): measured on 2 shared vCPUs,
     * every spin count we tried stayed several times slower than passive under contention, and
     * passive costs one futex wake per region, which idle runs did not show (ARCHITECTURE.md). */
    if (omp && setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
    if (blas && setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1) != 0) return;
    execv("/proc/self/exe", argv);
    /* exec failed (no /proc?): keep going with the defaults, and do not leave settings in the
     * environment that the runtimes never read */
    if (omp) unsetenv("OMP_WAIT_POLICY");
    if (blas) unsetenv("OPENBLAS_THREAD_TIMEOUT");
}
