/* CUDA build and device queries (include/fitllm/cuda.h; the --accelerator choice that asks them:
 * src/backend/accel.c).
 *
 * The answers come from the CUDA plugin (cu_loader.c), which is opened only after the NVIDIA
 * driver was found with a GPU: a machine without a driver or a GPU answers "no CUDA device"
 * with the driver's own reason (never a failure: --version and accelerator auto must work
 * everywhere, and fast). */
#include <stdio.h>
#include <string.h>

#include "backend/cuda/cu_plugin.h"
#include "fitllm/cuda.h"

int fl_cuda_built(void) {
#ifdef FL_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

int fl_cuda_device_count(char *why, size_t n) {
    char w[768];
    const fl_cuda_plugin *p = fl_cuda_plugin_try(w, sizeof w);
    if (!p) {
        if (why && n) snprintf(why, n, "%s", w);
        return 0;
    }
    return p->device_count(why, n);
}

void fl_cuda_describe(char *buf, size_t n) {
#ifdef FL_HAVE_CUDA
    char path[4096], why[768];
    if (fl_cuda_plugin_path(path, sizeof path) != 0) snprintf(path, sizeof path, "%s", FL_CUDA_PLUGIN_FILE);
    size_t o = (size_t)snprintf(buf, n, "compiled in as a plugin (experimental; CUDA %s, sm %s): %.400s; ", FL_CUDA_VERSION,
                                FL_CUDA_ARCHS, path);
    char *rest = buf + (o < n ? o : n);
    size_t left = o < n ? n - o : 0;
    const fl_cuda_plugin *p = fl_cuda_plugin_try(why, sizeof why);
    if (!p) {
        snprintf(rest, left, "%s", why);
        return;
    }
    int v = fl_cuda_driver_probe()->version;
    size_t o2 = (size_t)snprintf(rest, left, "NVIDIA driver for CUDA %d.%d; ", v / 1000, v % 1000 / 10);
    p->describe_devices(rest + (o2 < left ? o2 : left), o2 < left ? left - o2 : 0);
#else
    /* the driver all the same: says whether a CUDA build would have a GPU here */
    const fl_cuda_driver *d = fl_cuda_driver_probe();
    snprintf(buf, n, "not compiled in (make build CUDA=1, or cmake -DFL_CUDA=ON, with the CUDA toolkit); this machine: %s",
             d->why);
#endif
}

size_t fl_cuda_device_memory(int device) {
    const fl_cuda_plugin *p = fl_cuda_plugin_try(NULL, 0);
    return p ? p->device_memory(device) : 0;
}
