/* The CPU backend's memory contract (include/fitllm/backend.h "memory: host <-> device"): device
 * memory is host memory, so the copies are memcpy and sync has nothing to wait for; and
 * supports_op, the dtype combinations the CPU kernels implement (the same conditions their
 * FL_ERR_UNSUPPORTED checks test: tests/test_ops.c checks the two agree). */
#include <string.h>

#include "backend/cpu/cpu-impl.h"

static fl_status copy_bytes(void *dst, const void *src, size_t bytes, const char *who) {
    if (bytes == 0) return FL_OK;
    if (!dst || !src) return fl_errorf(FL_ERR_INVALID, "%s: NULL buffer for %zu bytes", who, bytes);
    if (dst != src) memmove(dst, src, bytes);
    return FL_OK;
}

fl_status fl_cpu_to_device(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    return copy_bytes(dst, src, bytes, "to_device");
}

fl_status fl_cpu_to_host(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    return copy_bytes(dst, src, bytes, "to_host");
}

fl_status fl_cpu_copy(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    return copy_bytes(dst, src, bytes, "copy");
}

fl_status fl_cpu_sync(const fl_backend *be) {
    (void)be;
    return FL_OK;
}

/* Device memory is host memory: the pool is the ordinary host pool. */
fl_status fl_cpu_pool_init(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget) {
    (void)be;
    return fl_mem_pool_init(p, name, budget);
}

static int isfloat(fl_dtype t) { return t == FL_F32 || t == FL_BF16 || t == FL_F16; }

int fl_cpu_supports_op(const fl_backend *be, fl_op op, fl_dtype a, fl_dtype b, fl_dtype c) {
    (void)be;
    switch (op) {
    case FL_OP_GEMM: /* the combinations of backend.h's gemm contract */
        return (a == FL_F32 && b == FL_F32 && c == FL_F32) ||
               (a == FL_BF16 && b == FL_BF16 && (c == FL_F32 || c == FL_BF16)) ||
               (a == FL_F32 && b == FL_BF16 && c == FL_F32) ||
               ((a == FL_F32 || a == FL_F16) && b == FL_F16 && c == FL_F32);
    case FL_OP_CONVERT: return isfloat(a) && isfloat(b);
    case FL_OP_ADAMW:
    case FL_OP_SGD: return isfloat(a) && isfloat(b) && (c == FL_F32 || c == FL_BF16);
    case FL_OP_ADAM8BIT: return fl_adam8bit_dtype_ok(a) && fl_adam8bit_dtype_ok(b);
    case FL_OP_ACCUMULATE16: return a == FL_BF16 || a == FL_F16;
    case FL_OP_SUMSQ: return isfloat(a);
    case FL_OP_Q4_MATMUL: return 1;
    case FL_OP_VOCAB_XENT: return a == FL_F32;
    default: return 0;
    }
}

fl_status fl_cpu_rope_tables(const fl_backend *be, float *cos_t, float *sin_t, int maxT, int HD, float theta,
                             const fl_rope_scaling *scaling) {
    (void)be;
    if (!cos_t || !sin_t || maxT < 0 || HD < 2)
        return fl_errorf(FL_ERR_INVALID, "rope_tables: bad arguments (maxT %d, HD %d)", maxT, HD);
    fl_rope_table_init(cos_t, sin_t, maxT, HD, theta, scaling);
    return FL_OK;
}
