/* The CUDA plugin's loader (src/backend/cuda/cu_loader.c): where the plugin is looked for, and the
 * phrase for each state of the NVIDIA driver. What the CLI prints for them on a real process (no
 * driver, the stand-in libcuda.so.1 for an old driver, no GPU, a missing plugin): tests/cli_test.sh. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cuda/cu_plugin.h"
#include "fitllm/cuda.h"
#include "test.h"

FL_TEST(cuda_loader_plugin_path) {
    char buf[4096], exe[4096];
    const char *saved = getenv("FITLLM_CUDA_LIB");
    char keep[4096] = "";
    if (saved) snprintf(keep, sizeof keep, "%s", saved);
    unsetenv("FITLLM_CUDA_LIB");
    /* beside the running program: this test binary's directory */
    FL_CHECK(fl_cuda_plugin_path(buf, sizeof buf) == 0);
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    FL_REQUIRE(k > 0);
    exe[k] = 0;
    *strrchr(exe, '/') = 0;
    FL_CHECKF(!strncmp(buf, exe, strlen(exe)) && !strcmp(buf + strlen(exe), "/libfitllm_cuda.so"), "%s", buf);
    FL_CHECK(fl_cuda_plugin_path(buf, 8) == -1); /* does not fit: refused, not cut */
    setenv("FITLLM_CUDA_LIB", "/opt/x/libfitllm_cuda.so", 1);
    FL_CHECK(fl_cuda_plugin_path(buf, sizeof buf) == 0 && !strcmp(buf, "/opt/x/libfitllm_cuda.so"));
    if (saved) setenv("FITLLM_CUDA_LIB", keep, 1);
    else unsetenv("FITLLM_CUDA_LIB");
}

FL_TEST(cuda_loader_driver_phrases) {
    fl_cuda_driver d = {.state = FL_CUDA_DRV_NONE};
    fl_cuda_driver_explain(&d, 13000);
    FL_CHECKF(!strcmp(d.why, "no NVIDIA driver (libcuda.so.1 not found)"), "%s", d.why);
    d = (fl_cuda_driver){.state = FL_CUDA_DRV_OLD, .version = 12080};
    fl_cuda_driver_explain(&d, 13000);
    FL_CHECKF(strstr(d.why, "driver too old: it supports CUDA 12.8, this build needs CUDA 13.0 or newer"), "%s", d.why);
    d = (fl_cuda_driver){.state = FL_CUDA_DRV_NO_GPU, .version = 13020};
    fl_cuda_driver_explain(&d, 13000);
    FL_CHECKF(strstr(d.why, "no GPU (NVIDIA driver for CUDA 13.2 found"), "%s", d.why);
    d = (fl_cuda_driver){.state = FL_CUDA_DRV_OK, .version = 13000, .devices = 2};
    fl_cuda_driver_explain(&d, 13000);
    FL_CHECKF(strstr(d.why, "CUDA 13.0, 2 devices"), "%s", d.why);
    /* the probe of this machine: a state, and a phrase for it; no GPU means no device counted */
    const fl_cuda_driver *p = fl_cuda_driver_probe();
    FL_CHECK(p->state >= 0 && p->state < FL_CUDA_DRV_COUNT && *p->why);
    FL_CHECK(p->state == FL_CUDA_DRV_OK || p->devices == 0);
    /* without a usable GPU the loader says why and the device count is 0 */
    char why[768] = "";
    if (p->state != FL_CUDA_DRV_OK || !fl_cuda_built()) {
        FL_CHECK(fl_cuda_device_count(why, sizeof why) == 0 && *why);
        const fl_cuda_plugin *pl;
        FL_CHECK(fl_cuda_plugin_get(&pl) == FL_ERR_UNSUPPORTED && *fl_error_message());
    }
}
