/* The backends this build has, by name: what the op tests loop over (every registered backend
 * runs the whole op suite), what FITLLM_TEST_BACKEND picks for the rest of the suite, and what
 * `fitllm --version` lists. A new backend (the opaque test backend, CUDA) adds one row here. */
#include <string.h>

#include "backend/cuda/backend_cuda.h"
#include "fitllm/backend.h"

typedef struct {
    const char *name;
    const char *what; /* one line for --version */
    fl_status (*init)(fl_backend *be, int n_threads);
    void (*free)(fl_backend *be);
} fl_backend_entry;

static fl_status ref_init(fl_backend *be, int n_threads) {
    (void)n_threads; /* the reference backend is single-threaded by definition */
    return fl_ref_backend_init(be);
}

#define MAX_BACKENDS 8
static fl_backend_entry g_backends[MAX_BACKENDS] = {
    {"cpu", "the CPU ops (OpenMP, SIMD dispatch, library GEMM)", fl_cpu_backend_init, fl_cpu_backend_free},
    {"ref", "the portable reference: the same ops on one thread, naive GEMM", ref_init, fl_cpu_backend_free},
#ifdef FL_HAVE_CUDA
    {"cuda", "NVIDIA GPUs (EXPERIMENTAL): CUDA kernels, cuBLASLt, device memory", fl_cuda_backend_init,
     fl_cuda_backend_free},
#endif
};
#ifdef FL_HAVE_CUDA
static int g_n_backends = 3;
#else
static int g_n_backends = 2;
#endif
#define N_BACKENDS g_n_backends

fl_status fl_backend_register(const char *name, const char *what, fl_status (*init)(fl_backend *, int),
                              void (*free_fn)(fl_backend *)) {
    if (!name || !init || !free_fn) return fl_errorf(FL_ERR_INVALID, "fl_backend_register: NULL argument");
    for (int i = 0; i < g_n_backends; i++)
        if (!strcmp(g_backends[i].name, name)) return FL_OK; /* already there */
    if (g_n_backends == MAX_BACKENDS)
        return fl_errorf(FL_ERR_INVALID, "fl_backend_register: more than %d backends", MAX_BACKENDS);
    g_backends[g_n_backends++] = (fl_backend_entry){name, what ? what : "", init, free_fn};
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
    return e->init(be, n_threads);
}

void fl_backend_free(fl_backend *be) {
    if (!be) return;
    const fl_backend_entry *e = find(be->name);
    if (e) e->free(be);
}
