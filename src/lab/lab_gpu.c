/* GPU utilization and memory (include/fitllm/gpu_monitor.h): NVML (libnvidia-ml.so.1, the driver's library),
 * loaded at run time with dlopen so fitllm neither links nor needs it; a thread samples device 0 every period and
 * the caller gets the mean and standard deviation (a lab row, a training run's summary). Absent library, symbols
 * or device: the probe says why and the report prints that instead of numbers. FITLLM_NVML_LIB names another
 * library (tests: one that does not exist, one without NVML's functions, an NVML stand-in). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/gpu_monitor.h"
#include "lab-impl.h"

typedef struct { unsigned gpu, memory; } nvml_util;              /* nvmlUtilization_t */
typedef struct { unsigned long long total, free, used; } nvml_mem; /* nvmlMemory_t */

typedef struct {
    void *lib;
    int (*init)(void);
    int (*shutdown)(void);
    int (*handle)(unsigned, void **);
    int (*util)(void *, nvml_util *);
    int (*mem)(void *, nvml_mem *);
    void *dev;
} nvml;

static int nvml_open(nvml *n, char *why, size_t wn) {
    memset(n, 0, sizeof *n);
    const char *name = getenv("FITLLM_NVML_LIB");
    if (!name || !*name) name = "libnvidia-ml.so.1";
    n->lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!n->lib) {
        snprintf(why, wn, "NVML not loaded (%s: %s)", name, dlerror());
        return 0;
    }
    *(void **)&n->init = dlsym(n->lib, "nvmlInit_v2");
    *(void **)&n->shutdown = dlsym(n->lib, "nvmlShutdown");
    *(void **)&n->handle = dlsym(n->lib, "nvmlDeviceGetHandleByIndex_v2");
    *(void **)&n->util = dlsym(n->lib, "nvmlDeviceGetUtilizationRates");
    *(void **)&n->mem = dlsym(n->lib, "nvmlDeviceGetMemoryInfo");
    if (!n->init || !n->shutdown || !n->handle || !n->util || !n->mem) {
        snprintf(why, wn, "NVML not usable (%s lacks the functions fitllm samples)", name);
        dlclose(n->lib);
        return 0;
    }
    int rc = n->init();
    if (rc != 0 || n->handle(0, &n->dev) != 0) {
        snprintf(why, wn, "NVML found no device (nvmlInit or the handle of device 0 failed, code %d)", rc);
        if (rc == 0) n->shutdown();
        dlclose(n->lib);
        return 0;
    }
    return 1;
}

static void nvml_close(nvml *n) {
    n->shutdown();
    dlclose(n->lib);
}

int fl_gpu_monitor_probe(char *why, size_t n) {
    nvml x;
    if (!nvml_open(&x, why, n)) return 0;
    nvml_close(&x);
    snprintf(why, n, "NVML");
    return 1;
}

struct fl_gpu_monitor {
    nvml n;
    pthread_t th;
    pthread_mutex_t mu;
    int stop, period_ms;
    double su, suu, sm, smm; /* sums of utilization % and used bytes, and of their squares */
    long count;
};

static void *sampler(void *ud) {
    fl_gpu_monitor *g = ud;
    for (;;) {
        nvml_util u;
        nvml_mem m;
        if (g->n.util(g->n.dev, &u) == 0 && g->n.mem(g->n.dev, &m) == 0) {
            pthread_mutex_lock(&g->mu);
            g->su += u.gpu, g->suu += (double)u.gpu * u.gpu;
            g->sm += (double)m.used, g->smm += (double)m.used * (double)m.used;
            g->count++;
            pthread_mutex_unlock(&g->mu);
        }
        pthread_mutex_lock(&g->mu);
        int stop = g->stop;
        pthread_mutex_unlock(&g->mu);
        if (stop) return NULL;
        struct timespec ts = {g->period_ms / 1000, (long)(g->period_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

fl_gpu_monitor *fl_gpu_monitor_start(int period_ms, char *why, size_t wn) {
    fl_gpu_monitor *g = calloc(1, sizeof *g);
    if (!g) { snprintf(why, wn, "out of host memory"); return NULL; }
    if (!nvml_open(&g->n, why, wn)) { free(g); return NULL; }
    g->period_ms = period_ms;
    pthread_mutex_init(&g->mu, NULL);
    if (pthread_create(&g->th, NULL, sampler, g) != 0) {
        snprintf(why, wn, "cannot start the sampling thread");
        nvml_close(&g->n);
        pthread_mutex_destroy(&g->mu);
        free(g);
        return NULL;
    }
    return g;
}

static double sd(double s, double ss, long n) {
    if (n < 2) return 0;
    double m = s / n, v = ss / n - m * m;
    return v > 0 ? sqrt(v * n / (n - 1)) : 0;
}

void fl_gpu_monitor_stop(fl_gpu_monitor *g, fl_gpu_usage *u) {
    memset(u, 0, sizeof *u);
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    g->stop = 1;
    pthread_mutex_unlock(&g->mu);
    pthread_join(g->th, NULL);
    u->samples = g->count;
    if (g->count > 0) {
        u->util_mean = g->su / g->count, u->util_std = sd(g->su, g->suu, g->count);
        u->mem_mean = g->sm / g->count, u->mem_std = sd(g->sm, g->smm, g->count);
    }
    nvml_close(&g->n);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

void fl_lab_gpu_stop(fl_gpu_monitor *g, fl_lab_row *r) {
    fl_gpu_usage u;
    fl_gpu_monitor_stop(g, &u);
    r->gpu_samples = u.samples;
    r->gpu_util_mean = u.util_mean, r->gpu_util_std = u.util_std;
    r->gpu_mem_mean = u.mem_mean, r->gpu_mem_std = u.mem_std;
}
