/* fitllm CUDA plugin: the contract between libfitllm and libfitllm_cuda.so (EXPERIMENTAL backend).
 *
 * Why a plugin (docs/ARCHITECTURE.md "CUDA plugin"): everything that needs the CUDA toolkit's
 * libraries (the nvcc kernels, the host code calling the CUDA runtime and cuBLASLt, NCCL's
 * communicator in src/comm/nccl_cuda.c) is built into one shared object placed beside the fitllm
 * binary and linked against cudart (static), cuBLASLt and NCCL. fitllm itself has no CUDA link
 * dependency: a CPU run maps none of those libraries (they cost 0.5 s and 200 MB of RSS at start),
 * and the binary starts on a machine without them. The plugin is opened (cu_loader.c) only when a
 * GPU is asked for or probed, and only after the driver probe found a GPU.
 *
 * The plugin's code calls libfitllm's functions (fl_errorf, the pools, the NCCL communicator's
 * logic in comm_nccl.c) from the program that loads it: the programs that may load it export
 * libfitllm's symbols and link all of it (CMake: fl_cuda_plugin_host). The plugin exports one
 * symbol, FL_CUDA_PLUGIN_ENTRY, which returns the table below. A program that links the plugin's
 * objects directly (the GPU check programs, tests/cuda/) defines the same symbol and the loader
 * uses it without dlopen (one CUDA runtime per process). */
#ifndef FL_CU_PLUGIN_H
#define FL_CU_PLUGIN_H

#include <stddef.h>

#include "fitllm/backend.h"
#include "fitllm/comm_nccl.h"
#include "fitllm/mem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever this table, fl_backend, fl_mem_pool or fl_nccl_api change in a way the sizes
 * below would not catch. */
#define FL_CUDA_PLUGIN_ABI 10 /* 10: attention_backward_b16 / attention_b16_ok; 9: q4 ops take nw stacked parts */
#define FL_CUDA_PLUGIN_ENTRY "fl_cuda_plugin_entry"
#define FL_CUDA_PLUGIN_FILE "libfitllm_cuda.so"

typedef struct fl_cuda_plugin {
    int abi;                   /* FL_CUDA_PLUGIN_ABI */
    size_t backend_size;       /* sizeof(fl_backend), sizeof(fl_mem_pool), sizeof(fl_nccl_api) it was built with */
    size_t pool_size;
    size_t nccl_api_size;
    int runtime_version;       /* CUDART_VERSION it was built with, e.g. 13000 */
    const char *archs;         /* "80,86,89,90": the architectures of its fat binary */
    /* the CUDA runtime's view (cudaGetDeviceCount & co.); never fail */
    int (*device_count)(char *why, size_t n);
    void (*describe_devices)(char *buf, size_t n); /* "1 device: 0 NVIDIA H100 (sm_90, 79.1 GiB)" */
    size_t (*device_memory)(int device);
    /* the "cuda" backend (cuda-backend-impl.h over the real kernels, cuBLASLt, one stream) */
    fl_status (*backend_init)(fl_backend *be, int n_threads);
    void (*backend_free)(fl_backend *be);
    fl_status (*backend_error)(const fl_backend *be);
    /* NCCL (NULL when built without it) and "NCCL 2.28.9" */
    const fl_nccl_api *nccl;
    const char *(*nccl_library)(void);
} fl_cuda_plugin;

/* The entry point (exported by the plugin; weak in libfitllm so a program may link it in). */
const fl_cuda_plugin *fl_cuda_plugin_entry(void);

/* The plugin, loaded on first use (thread-safe; the result is cached for the process): FL_OK and
 * *out, or FL_ERR_UNSUPPORTED naming what is missing: a build without CUDA, no NVIDIA driver, a
 * driver too old, no GPU, the plugin file not found (and how to build it), or dlopen's error.
 * Every caller goes through here, so nothing of CUDA is mapped before a GPU is actually usable. */
fl_status fl_cuda_plugin_get(const fl_cuda_plugin **out);
/* The same without touching the thread's error message: the plugin, or NULL and the reason in why. */
const fl_cuda_plugin *fl_cuda_plugin_try(char *why, size_t n);
/* Where the plugin is looked for: $FITLLM_CUDA_LIB, else FL_CUDA_PLUGIN_FILE in the directory of
 * the running program (/proc/self/exe). 0, or -1 when the path does not fit. */
int fl_cuda_plugin_path(char *buf, size_t n);

/* What the NVIDIA driver says (libcuda.so.1 opened and asked directly, without the plugin). */
typedef enum {
    FL_CUDA_DRV_NONE = 0, /* no libcuda.so.1 (no NVIDIA driver installed) */
    FL_CUDA_DRV_BROKEN,   /* libcuda.so.1 opened but unusable (symbols missing, cuInit failed) */
    FL_CUDA_DRV_OLD,      /* the driver's CUDA version is below what this build needs */
    FL_CUDA_DRV_NO_GPU,   /* driver fine, no device (cuInit: CUDA_ERROR_NO_DEVICE, or 0 devices) */
    FL_CUDA_DRV_OK,       /* driver fine, devices > 0 */
    FL_CUDA_DRV_COUNT
} fl_cuda_drv_state;
typedef struct {
    fl_cuda_drv_state state;
    int version; /* cuDriverGetVersion: 1000 * major + 10 * minor (0 when unknown) */
    int devices; /* cuDeviceGetCount after cuInit */
    char why[256]; /* one phrase, e.g. "no NVIDIA driver (libcuda.so.1 not found)" */
} fl_cuda_driver;
/* Probe the driver once per process (cached; thread-safe), against the CUDA version this build's
 * runtime needs (FL_CUDA_NEED_DRIVER; builds without CUDA need none). */
const fl_cuda_driver *fl_cuda_driver_probe(void);
/* Write d->why for d->state (pure; tests). need = the CUDA version needed, 1000 * major + 10 * minor. */
void fl_cuda_driver_explain(fl_cuda_driver *d, int need);

#ifdef __cplusplus
}
#endif
#endif
