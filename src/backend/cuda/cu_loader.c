/* Finding and opening the CUDA plugin, and asking the NVIDIA driver first (contract: cu_plugin.h).
 *
 * Nothing here links CUDA: the driver (libcuda.so.1) and the plugin (libfitllm_cuda.so) are opened
 * with dlopen, and only on the way to a GPU. The order gives each missing piece its own message:
 *   1. a build without CUDA says so (and how to get one);
 *   2. the plugin file beside the binary (or $FITLLM_CUDA_LIB) must exist: else how to build it;
 *   3. the driver: libcuda.so.1 absent = "no NVIDIA driver"; cuDriverGetVersion below the CUDA
 *      version this build's runtime needs = "driver too old"; cuInit's NO_DEVICE or 0 devices =
 *      "no GPU". The CUDA runtime would answer all three with "CUDA driver version is insufficient";
 *   4. dlopen of the plugin (its libraries: cuBLASLt, NCCL) and its table's ABI check.
 * A CPU run stops at 3 with the driver absent, having mapped nothing of CUDA. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cuda/cu_plugin.h"

#ifndef FL_CUDA_NEED_DRIVER
#define FL_CUDA_NEED_DRIVER 0 /* a build without CUDA needs no particular driver */
#endif

/* A program that links the plugin's objects in (tests/cuda/) defines this; others leave it NULL. */
extern const fl_cuda_plugin *fl_cuda_plugin_entry(void) __attribute__((weak));

/* ---- the driver ---------------------------------------------------------------------------- */

#define CU_ERROR_NO_DEVICE 100 /* CUresult CUDA_ERROR_NO_DEVICE */

static void ver_str(int v, char *buf, size_t n) { snprintf(buf, n, "%d.%d", v / 1000, v % 1000 / 10); }

void fl_cuda_driver_explain(fl_cuda_driver *d, int need) {
    char have[16], want[16];
    ver_str(d->version, have, sizeof have);
    ver_str(need, want, sizeof want);
    switch (d->state) {
    case FL_CUDA_DRV_NONE:
        snprintf(d->why, sizeof d->why, "no NVIDIA driver (libcuda.so.1 not found)");
        break;
    case FL_CUDA_DRV_OLD:
        snprintf(d->why, sizeof d->why, "NVIDIA driver too old: it supports CUDA %s, this build needs CUDA %s or newer "
                 "(update the driver, or run --accelerator cpu)", have, want);
        break;
    case FL_CUDA_DRV_NO_GPU:
        snprintf(d->why, sizeof d->why, "no GPU (NVIDIA driver for CUDA %s found, but it sees no device)", have);
        break;
    case FL_CUDA_DRV_OK:
        snprintf(d->why, sizeof d->why, "NVIDIA driver for CUDA %s, %d device%s", have, d->devices,
                 d->devices == 1 ? "" : "s");
        break;
    default: break; /* BROKEN: the prober wrote the phrase */
    }
}

static fl_cuda_driver g_drv;
static int g_drv_done;
static pthread_mutex_t g_drv_lock = PTHREAD_MUTEX_INITIALIZER;

static void drv_probe(fl_cuda_driver *d) {
    memset(d, 0, sizeof *d);
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        d->state = FL_CUDA_DRV_NONE;
        return;
    }
    int (*get_version)(int *) = (int (*)(int *))dlsym(h, "cuDriverGetVersion");
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    int (*count)(int *) = (int (*)(int *))dlsym(h, "cuDeviceGetCount");
    int (*err_name)(int, const char **) = (int (*)(int, const char **))dlsym(h, "cuGetErrorName");
    if (!get_version || !init || !count || get_version(&d->version) != 0) {
        d->state = FL_CUDA_DRV_BROKEN;
        snprintf(d->why, sizeof d->why, "unusable NVIDIA driver: libcuda.so.1 lacks cuDriverGetVersion, cuInit or "
                 "cuDeviceGetCount, or cuDriverGetVersion failed");
        dlclose(h);
        return;
    }
    /* CUDA 11 and later: a runtime of major version X runs on any driver for X.0 or newer */
    if (FL_CUDA_NEED_DRIVER && d->version < FL_CUDA_NEED_DRIVER / 1000 * 1000) {
        d->state = FL_CUDA_DRV_OLD;
        dlclose(h);
        return;
    }
    int rc = init(0);
    if (rc == CU_ERROR_NO_DEVICE) {
        d->state = FL_CUDA_DRV_NO_GPU;
        return; /* libcuda stays open after cuInit: it may have started threads */
    }
    if (rc != 0) {
        const char *nm = NULL;
        if (!err_name || err_name(rc, &nm) != 0 || !nm) nm = "unknown error";
        d->state = FL_CUDA_DRV_BROKEN;
        snprintf(d->why, sizeof d->why, "the NVIDIA driver failed to start: cuInit: %s (%d)", nm, rc);
        return;
    }
    if (count(&d->devices) != 0 || d->devices <= 0) {
        d->devices = 0;
        d->state = FL_CUDA_DRV_NO_GPU;
        return;
    }
    d->state = FL_CUDA_DRV_OK;
}

const fl_cuda_driver *fl_cuda_driver_probe(void) {
    pthread_mutex_lock(&g_drv_lock);
    if (!g_drv_done) {
        drv_probe(&g_drv);
        fl_cuda_driver_explain(&g_drv, FL_CUDA_NEED_DRIVER);
        g_drv_done = 1;
    }
    pthread_mutex_unlock(&g_drv_lock);
    return &g_drv;
}

/* ---- the plugin ---------------------------------------------------------------------------- */

int fl_cuda_plugin_path(char *buf, size_t n) {
    const char *e = getenv("FITLLM_CUDA_LIB");
    if (e && *e) return snprintf(buf, n, "%s", e) < (int)n ? 0 : -1;
    char exe[4096];
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (k <= 0) return snprintf(buf, n, "%s", FL_CUDA_PLUGIN_FILE) < (int)n ? 0 : -1; /* the loader's search path */
    exe[k] = 0;
    char *slash = strrchr(exe, '/');
    if (slash) *slash = 0;
    return snprintf(buf, n, "%s/%s", slash ? exe : ".", FL_CUDA_PLUGIN_FILE) < (int)n ? 0 : -1;
}

static const fl_cuda_plugin *g_plugin;
static int g_plugin_done;
static pthread_mutex_t g_plugin_lock = PTHREAD_MUTEX_INITIALIZER; /* taken before g_drv_lock, never after */
static char g_plugin_why[768];

#ifdef FL_HAVE_CUDA
static const char *abi_mismatch(const fl_cuda_plugin *p) {
    if (p->abi != FL_CUDA_PLUGIN_ABI) return "its interface version differs";
    if (p->backend_size != sizeof(fl_backend) || p->pool_size != sizeof(fl_mem_pool) ||
        p->nccl_api_size != sizeof(fl_nccl_api))
        return "its structure sizes differ";
    return NULL;
}
#endif

static const fl_cuda_plugin *plugin_open(char *why, size_t n) {
#ifndef FL_HAVE_CUDA
    snprintf(why, n, "this fitllm was built without CUDA (on a machine with the CUDA toolkit: make build CUDA=1, "
             "or cmake -DFL_CUDA=ON)");
    return NULL;
#else
    char path[4096];
    const fl_cuda_plugin *(*entry)(void) = fl_cuda_plugin_entry; /* linked in (the GPU check programs) */
    if (!entry) {
        if (fl_cuda_plugin_path(path, sizeof path) != 0) {
            snprintf(why, n, "the CUDA plugin's path is too long");
            return NULL;
        }
        if (access(path, R_OK) != 0) {
            snprintf(why, n, "the CUDA plugin %.400s is missing (it is built with the binary by make build CUDA=1, or "
                     "cmake -DFL_CUDA=ON, and must stay beside it; FITLLM_CUDA_LIB=path names another)", path);
            return NULL;
        }
    }
    const fl_cuda_driver *d = fl_cuda_driver_probe();
    if (d->state != FL_CUDA_DRV_OK) {
        snprintf(why, n, "%s", d->why);
        return NULL;
    }
    if (!entry) {
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            snprintf(why, n, "cannot load the CUDA plugin: %.400s (it needs the CUDA toolkit's cuBLASLt and NCCL "
                     "libraries on the loader's path, and a fitllm built with it)", dlerror());
            return NULL;
        }
        entry = (const fl_cuda_plugin *(*)(void))dlsym(h, FL_CUDA_PLUGIN_ENTRY);
        if (!entry) {
            snprintf(why, n, "%.400s is not a fitllm CUDA plugin (no %s)", path, FL_CUDA_PLUGIN_ENTRY);
            dlclose(h);
            return NULL;
        }
    }
    const fl_cuda_plugin *p = entry();
    const char *bad = p ? abi_mismatch(p) : "it returned no table";
    if (bad) {
        snprintf(why, n, "the CUDA plugin does not belong to this fitllm (%s): rebuild both from the same source", bad);
        return NULL;
    }
    return p;
#endif
}

const fl_cuda_plugin *fl_cuda_plugin_try(char *why, size_t n) {
    pthread_mutex_lock(&g_plugin_lock);
    if (!g_plugin_done) {
        g_plugin = plugin_open(g_plugin_why, sizeof g_plugin_why);
        g_plugin_done = 1;
    }
    pthread_mutex_unlock(&g_plugin_lock);
    if (!g_plugin && why && n) snprintf(why, n, "%s", g_plugin_why);
    return g_plugin;
}

fl_status fl_cuda_plugin_get(const fl_cuda_plugin **out) {
    char why[768];
    *out = fl_cuda_plugin_try(why, sizeof why);
    return *out ? FL_OK : fl_errorf(FL_ERR_UNSUPPORTED, "%s", why);
}
