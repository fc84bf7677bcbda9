/* The --accelerator choice (include/fitllm/backend.h fl_accel_*): parsed and resolved here, next
 * to the registry that maps it to a backend, so no command compares backend names itself. */
#include <stdio.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/cuda.h"

int fl_accel_parse(const char *s, fl_accel *out) {
    if (!s) return -1;
    if (!strcmp(s, "auto")) *out = FL_ACCEL_AUTO;
    else if (!strcmp(s, "cpu")) *out = FL_ACCEL_CPU;
    else if (!strcmp(s, "cuda")) *out = FL_ACCEL_CUDA;
    else return -1;
    return 0;
}

fl_status fl_accel_resolve(fl_accel want, fl_accel *use) {
    *use = FL_ACCEL_CPU;
    if (want == FL_ACCEL_CPU) return FL_OK;
    char why[768];
    int have = fl_cuda_built() && fl_cuda_device_count(why, sizeof why) > 0;
    if (want == FL_ACCEL_AUTO) { /* the GPU when this build has CUDA and one is visible */
        if (have) *use = FL_ACCEL_CUDA;
        return FL_OK;
    }
    if (!fl_cuda_built())
        return fl_errorf(FL_ERR_UNSUPPORTED, "--accelerator cuda: this fitllm was built without CUDA (rebuild with "
                                             "the CUDA toolkit installed: make build CUDA=1; or use --accelerator cpu)");
    if (!have) return fl_errorf(FL_ERR_UNSUPPORTED, "--accelerator cuda: %s", why);
    *use = FL_ACCEL_CUDA;
    return FL_OK;
}

const char *fl_accel_backend(fl_accel a) { return a == FL_ACCEL_CUDA ? "cuda" : "cpu"; }
