/* fitllm: GPU utilization and memory while something runs (the course watched nvtop): NVML, the driver's
 * library (libnvidia-ml.so.1), loaded at run time with dlopen, so fitllm neither links nor needs it; a thread
 * samples device 0 every period. Absent library, functions or device: start returns NULL and says why.
 * FITLLM_NVML_LIB names another library. Implemented in src/lab/lab_gpu.c (the lab's rows, the training
 * commands' summary on a GPU). */
#ifndef FITLLM_GPU_MONITOR_H
#define FITLLM_GPU_MONITOR_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fl_gpu_monitor fl_gpu_monitor;

typedef struct {
    long samples;                 /* 0: none */
    double util_mean, util_std;   /* GPU utilization %, mean and standard deviation */
    double mem_mean, mem_std;     /* the device's used bytes (every process), mean and standard deviation */
} fl_gpu_usage;

/* 1 when NVML can be loaded and sees device 0; else 0 and why. */
int fl_gpu_monitor_probe(char *why, size_t n);
/* Start sampling every period_ms; NULL (and why) when NVML is absent. */
fl_gpu_monitor *fl_gpu_monitor_start(int period_ms, char *why, size_t n);
/* Stop (NULL: nothing) and fill u (zeros without samples). */
void fl_gpu_monitor_stop(fl_gpu_monitor *m, fl_gpu_usage *u);

#ifdef __cplusplus
}
#endif
#endif
