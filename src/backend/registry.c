/* The backends this build has, by name: what the op tests loop over (every registered backend
 * runs the whole op suite), what FITLLM_TEST_BACKEND picks for the rest of the suite, and what
 * `fitllm --version` lists. A new backend (the opaque test backend, CUDA) adds one row here. */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "backend/cpu/cpu-impl.h"
#include "backend/cuda/cuda-impl.h"
#include "fitllm/backend.h"
#include "fitllm/comm.h"
#include "fitllm/cuda.h"

typedef struct {
    const char *name;
    const char *what; /* one line for --version */
    fl_status (*init)(fl_backend *be, int n_threads);
    void (*free)(fl_backend *be);
    void (*facts)(fl_backend_facts *f); /* NULL (registered from outside): made once to read them */
} fl_backend_entry;

static fl_status ref_init(fl_backend *be, int n_threads) {
    (void)n_threads; /* the reference backend is single-threaded by definition */
    return fl_ref_backend_init(be);
}

/* ---- what each built-in backend is, without making it (fl_backend_facts_of) ---- */
static int cpu_supports(fl_op op, fl_dtype a, fl_dtype b, fl_dtype c) { return fl_cpu_supports_op(NULL, op, a, b, c); }
static void cpu_facts(fl_backend_facts *f) {
    f->caps = FL_CAP_HOST_MEMORY;
    f->scratch_bytes = fl_cpu_scratch_bytes();
    f->gemm_widens16 = fl_cpu_gemm_widens16();
    f->supports_op = cpu_supports;
    f->reference = "ref";
}
static void ref_facts(fl_backend_facts *f) { /* the CPU's ops on one thread, naive GEMM, no scratch */
    f->caps = FL_CAP_HOST_MEMORY;
    f->supports_op = cpu_supports;
}
static void opaque_facts(fl_backend_facts *f) { /* the CPU's, over memory the host cannot read */
    cpu_facts(f);
    f->caps = 0;
    f->reference = "cpu";
}
static void null_facts(fl_backend_facts *f) { /* the registry's null: the CPU's scratch, every op */
    f->caps = FL_CAP_DISCARDS;
    f->scratch_bytes = fl_cpu_scratch_bytes();
    f->gemm_widens16 = fl_cpu_gemm_widens16();
}
static size_t cuda_memory(void) { return fl_cuda_device_memory(0); }
/* in every build: plan --accelerator cuda plans for a GPU without one */
static void cuda_facts(fl_backend_facts *f) {
    const char *ev = getenv("FITLLM_CUDA_VIEWS32"); /* 1: every fp32 view kept, as the backend (cuda-backend-impl.h) */
    const char *es = getenv("FITLLM_CUDA_STREAM16"); /* 0: the stream's fp32 rows kept, as the backend */
    const int v32 = ev && !strcmp(ev, "1");
    f->caps = FL_CAP_ASYNC | FL_CAP_DEVICE_MEMORY | FL_CAP_COMPUTE_BF16 | (v32 ? 0u : FL_CAP_VIEWS16) |
              (v32 || (es && !strcmp(es, "0")) ? 0u : FL_CAP_STREAM16);
    /* FITLLM_CUDA_Q4 unset (scratch, the default), scratch or tc, and FITLLM_CUDA_Q4X16 not 0: the 4-bit matmuls over
     * bf16 inputs, as the backend */
    const char *eq = getenv("FITLLM_CUDA_Q4"), *ex = getenv("FITLLM_CUDA_Q4X16");
    if ((!eq || !*eq || !strcmp(eq, "tc") || !strcmp(eq, "scratch")) && !(ex && !strcmp(ex, "0")))
        f->caps |= FL_CAP_Q4X16;
    f->device = FL_DEV_CUDA;
    f->scratch_bytes = fl_cuda_scratch_bytes();
    f->gemm_widens16 = fl_cuda_gemm_widens16();
    f->supports_op = fl_cuda_supports_op;
    f->memory_capacity = cuda_memory;
    f->describe = fl_cuda_describe;
    f->attn_scratch_bytes = fl_cuda_planned_attn_scratch();
}

#define MAX_BACKENDS 8
static fl_backend_entry g_backends[MAX_BACKENDS] = {
    {"cpu", "the CPU ops (OpenMP, SIMD dispatch, library GEMM)", fl_cpu_backend_init, fl_cpu_backend_free, cpu_facts},
    {"ref", "the portable reference: the same ops on one thread, naive GEMM", ref_init, fl_cpu_backend_free,
     ref_facts},
    {"opaque", "a testing aid: the CPU ops over memory the host cannot read outside them", fl_opaque_backend_init,
     fl_opaque_backend_free, opaque_facts},
    {"null", "the planner's: ops that do nothing over memory that does not exist (fitllm plan)",
     fl_null_backend_init, fl_null_backend_free, null_facts},
#ifdef FL_HAVE_CUDA
    {"cuda", "NVIDIA GPUs (EXPERIMENTAL): CUDA kernels, cuBLASLt, device memory", fl_cuda_backend_init,
     fl_cuda_backend_free, cuda_facts},
#endif
};
#ifdef FL_HAVE_CUDA
static int g_n_backends = 5;
#else
static int g_n_backends = 4;
#endif
#define N_BACKENDS g_n_backends

fl_status fl_backend_register(const char *name, const char *what, fl_status (*init)(fl_backend *, int),
                              void (*free_fn)(fl_backend *)) {
    if (!name || !init || !free_fn) return fl_errorf(FL_ERR_INVALID, "fl_backend_register: NULL argument");
    for (int i = 0; i < g_n_backends; i++)
        if (!strcmp(g_backends[i].name, name)) return FL_OK; /* already there */
    if (g_n_backends == MAX_BACKENDS)
        return fl_errorf(FL_ERR_INVALID, "fl_backend_register: more than %d backends", MAX_BACKENDS);
    g_backends[g_n_backends++] = (fl_backend_entry){name, what ? what : "", init, free_fn, NULL};
    return FL_OK;
}

int fl_backend_count(void) { return N_BACKENDS; }

const char *fl_backend_name(int i) { return i >= 0 && i < N_BACKENDS ? g_backends[i].name : NULL; }

const char *fl_backend_description(int i) { return i >= 0 && i < N_BACKENDS ? g_backends[i].what : NULL; }

static const fl_backend_entry *find(const char *name) {
    for (int i = 0; name && i < N_BACKENDS; i++)
        if (!strcmp(g_backends[i].name, name)) return &g_backends[i];
    return NULL;
}

fl_status fl_backend_init_by_name(const char *name, fl_backend *be, int n_threads) {
    if (!be) return fl_errorf(FL_ERR_INVALID, "fl_backend_init_by_name: NULL backend");
    const fl_backend_entry *e = find(name);
    if (!e) {
        char list[256] = "";
        for (int i = 0; i < N_BACKENDS; i++) {
            if (i) strncat(list, ", ", sizeof list - strlen(list) - 1);
            strncat(list, g_backends[i].name, sizeof list - strlen(list) - 1);
        }
        return fl_errorf(FL_ERR_INVALID, "unknown backend '%s' (this build has: %s)", name ? name : "(null)", list);
    }
    FL_TRY(e->init(be, n_threads));
    if (!be->run) be->run = fl_backend_run_slots; /* a backend registered from outside without a door of its own */
    return FL_OK;
}

void fl_backend_free(fl_backend *be) {
    if (!be) return;
    const fl_backend_entry *e = find(be->name);
    if (e) e->free(be);
}

fl_status fl_backend_facts_of(const char *name, fl_backend_facts *f) {
    if (!name || !f) return fl_errorf(FL_ERR_INVALID, "fl_backend_facts_of: NULL argument");
    memset(f, 0, sizeof *f);
    f->device = FL_DEV_CPU;
    f->reference = "cpu";
    const fl_backend_entry *e = find(name);
    static const fl_backend_entry planned_cuda = {"cuda", "", NULL, NULL, cuda_facts};
    if (!e && !strcmp(name, planned_cuda.name)) e = &planned_cuda; /* a build without the backend */
    if (e && e->facts) {
        e->facts(f);
        return FL_OK;
    }
    /* registered from outside (the test programs' cuda-emu), or unknown (the error lists the names) */
    fl_backend be;
    FL_TRY(fl_backend_init_by_name(name, &be, 1));
    f->caps = be.caps;
    f->device = be.device;
    f->scratch_bytes = be.scratch_bytes;
    f->gemm_widens16 = be.gemm_widens16;
    f->attn_scratch_bytes = be.attn_scratch_bytes;
    fl_backend_free(&be);
    return FL_OK;
}

size_t fl_backend_memory_capacity(const char *name) {
    fl_backend_facts f;
    if (fl_backend_facts_of(name, &f) != FL_OK) return 0;
    if ((f.caps & FL_CAP_DEVICE_MEMORY) && f.memory_capacity) return f.memory_capacity();
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
}

static const char *g_default_name;

void fl_backend_set_default_name(const char *name) { g_default_name = name; }

const char *fl_backend_default_name(void) {
    const char *e = getenv("FITLLM_BACKEND");
    if (e && *e) return e;
    return g_default_name ? g_default_name : "cpu";
}

fl_status fl_backend_pools_init(const fl_backend *be, fl_mem_pool *dev, fl_mem_pool *host, const char *name,
                                size_t budget) {
    if (host) memset(host, 0, sizeof *host);
    /* a backend without pool_init is host memory (the default of the contract) */
    FL_TRY(be->pool_init ? be->pool_init(be, dev, name, budget) : fl_mem_pool_init(dev, name, budget));
    if (fl_backend_discards(be) && fl_backend_host_memory(be) && host) {
        /* the null backend standing in for host memory: one pool's counters as on the CPU, but the
         * host staging that host code writes is real memory (a host pool charging dev's counters) */
        fl_status s = fl_mem_pool_init(host, name ? name : "pool", 0);
        if (s != FL_OK) {
            fl_mem_pool_free(dev);
            return s;
        }
        host->account = dev;
        dev->host = host;
        return FL_OK;
    }
    if (fl_backend_host_memory(be) || !host) return FL_OK;
    char hn[32];
    snprintf(hn, sizeof hn, "%s host", name ? name : "pool");
    fl_status s = fl_mem_pool_init(host, hn, 0);
    if (s != FL_OK) {
        fl_mem_pool_free(dev);
        return s;
    }
    dev->host = host;
    return FL_OK;
}

void fl_backend_pools_free(fl_mem_pool *dev, fl_mem_pool *host) {
    int split = dev && dev->host == host && host;
    if (dev) fl_mem_pool_free(dev);
    if (split) fl_mem_pool_free(host);
}

fl_status fl_backend_calloc(const fl_backend *be, fl_mem_pool *p, fl_mem_tag tag, size_t bytes, void **out) {
    FL_TRY(fl_mem_alloc(p, tag, bytes, out));
    if (bytes && p->device != FL_DEV_DISK) be->zero(be, *out, bytes); /* a disk pool's fresh file reads as zeros */
    return FL_OK;
}

static fl_status staged_to_host(void *ctx, void *dst, const void *src, size_t bytes) {
    const fl_backend *be = ctx;
    return be->to_host(be, dst, src, bytes);
}
static fl_status staged_to_device(void *ctx, void *dst, const void *src, size_t bytes) {
    const fl_backend *be = ctx;
    return be->to_device(be, dst, src, bytes);
}
fl_status fl_backend_comm_staged(const fl_backend *be, fl_comm *host, fl_comm **out) {
    fl_comm_staging st = {(void *)be, staged_to_host, staged_to_device};
    return fl_comm_staged_create(host, &st, out);
}
