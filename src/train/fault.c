/* Test-only fault injection (fitllm/fault.h): a small table of armed faults, off by default. */
#include "fitllm/fault.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend_op.h"
#include "fitllm/lora.h"

static struct { fl_fault_kind kind; int rank; long step; } g_fault[FL_FAULT_MAX];
static int g_n;

fl_status fl_fault_set(fl_fault_kind kind, int rank, long step) {
    if (kind != FL_FAULT_GRAD_OVERFLOW) return fl_errorf(FL_ERR_INVALID, "fault injection: unknown fault kind %d", (int)kind);
    if (step < 1 || rank < -1)
        return fl_errorf(FL_ERR_INVALID, "fault injection: step %ld (>= 1) and rank %d (>= 0, -1: every rank)", step, rank);
    if (g_n == FL_FAULT_MAX) return fl_errorf(FL_ERR_INVALID, "fault injection: more than %d faults armed", FL_FAULT_MAX);
    g_fault[g_n].kind = kind, g_fault[g_n].rank = rank, g_fault[g_n].step = step;
    g_n++;
    return FL_OK;
}

void fl_fault_clear(void) { g_n = 0; }

int fl_fault_due(fl_fault_kind kind, int rank, long step) {
    for (int i = 0; i < g_n; i++)
        if (g_fault[i].kind == kind && g_fault[i].step == step && (g_fault[i].rank < 0 || g_fault[i].rank == rank)) return 1;
    return 0;
}

/* one "STEP[:RANK]" of the variable */
static fl_status parse_one(const char *s, size_t n) {
    char buf[64];
    if (n >= sizeof buf || n == 0) goto bad;
    memcpy(buf, s, n);
    buf[n] = 0;
    char *e;
    errno = 0;
    long step = strtol(buf, &e, 10), rank = -1;
    if (errno || e == buf || step < 1) goto bad;
    if (*e == ':') {
        const char *r = e + 1;
        rank = strtol(r, &e, 10);
        if (errno || e == r || rank < 0 || rank > INT32_MAX) goto bad;
    }
    if (*e) goto bad;
    return fl_fault_set(FL_FAULT_GRAD_OVERFLOW, (int)rank, step);
bad:
    return fl_errorf(FL_ERR_INVALID, "FITLLM_FAULT_GRAD_OVERFLOW: '%.*s' is not STEP[:RANK] (STEP >= 1, RANK >= 0)",
                     (int)n, s);
}

fl_status fl_fault_from_env(void) {
    const char *v = getenv("FITLLM_FAULT_GRAD_OVERFLOW");
    while (v && *v) {
        size_t n = strcspn(v, ",");
        FL_TRY(parse_one(v, n));
        v += n + (v[n] == ',');
        if (v[-1] == ',' && !*v) return parse_one(v, 0); /* a trailing comma */
    }
    return FL_OK;
}

fl_status fl_fault_overflow_grads(fl_model *m) {
    fl_lora_adapters ad;
    const int lora = fl_model_lora_adapters(m, &ad);
    void *g = lora ? (void *)ad.grads : fl_model_grads_data(m);
    const fl_dtype dt = lora ? FL_F32 : fl_model_store_dtype(m);
    if (!g) return fl_errorf(FL_ERR_INVALID, "fault injection: the model has no gradient buffer");
    const uint32_t f32 = 0x7f800000u;                         /* +inf */
    const uint16_t h16 = dt == FL_F16 ? 0x7c00u : 0x7f80u;     /* fp16's, bf16's */
    return FL_RUN(m->be, to_device, g, dt == FL_F32 ? (const void *)&f32 : (const void *)&h16, fl_dtype_size(dt));
}

int fl_fault_armed(void) { return g_n > 0; }

fl_fault_fn fl_fault_at(int rank, long step) {
    return fl_fault_due(FL_FAULT_GRAD_OVERFLOW, rank, step) ? fl_fault_overflow_grads : NULL;
}
