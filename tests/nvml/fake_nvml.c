/* A stand-in for the driver's NVML (libnvidia-ml.so.1) with the five functions the lab samples: device 0 reports
 * 10 % and 30 % utilization alternately and 5 GiB used, so a sampler's mean and standard deviation are known
 * (tests/test_lab.c lab_gpu_sampling_through_nvml). Built as a shared library for the unit tests only. */
typedef struct { unsigned gpu, memory; } nvml_util;
typedef struct { unsigned long long total, free, used; } nvml_mem;

static int calls, dev;

int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) {
    if (i != 0) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *h = &dev;
    return 0;
}
int nvmlDeviceGetUtilizationRates(void *h, nvml_util *u) {
    (void)h;
    u->gpu = __atomic_fetch_add(&calls, 1, __ATOMIC_SEQ_CST) % 2 ? 30 : 10;
    u->memory = 0;
    return 0;
}
/* How many utilization samples were taken so far (the test waits for enough of them instead of sleeping a fixed
 * time, which a loaded machine can stretch past the sampler's first few periods). */
int fake_nvml_calls(void) { return __atomic_load_n(&calls, __ATOMIC_SEQ_CST); }
int nvmlDeviceGetMemoryInfo(void *h, nvml_mem *m) {
    (void)h;
    m->total = 16ULL << 30, m->used = 5ULL << 30, m->free = m->total - m->used;
    return 0;
}
