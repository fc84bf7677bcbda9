/* fitllm CUDA backend objects (EXPERIMENTAL): "cuda" (the GPU; FL_CUDA builds) and "cuda-emu"
 * (the same backend code over the CPU emulator and the cuBLASLt stand-in, host memory; linked
 * into the test programs only, registered with fl_backend_register). See backend_cuda_impl.h. */
#ifndef FL_BACKEND_CUDA_H
#define FL_BACKEND_CUDA_H

#include "fitllm/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

fl_status fl_cuda_backend_init(fl_backend *be, int n_threads);
void fl_cuda_backend_free(fl_backend *be);
/* FL_OK, or the backend's sticky error (the first failed op) */
fl_status fl_cuda_backend_error(const fl_backend *be);

fl_status fl_cuemu_backend_init(fl_backend *be, int n_threads);
void fl_cuemu_backend_free(fl_backend *be);
fl_status fl_cuemu_backend_error(const fl_backend *be);

#ifdef __cplusplus
}
#endif
#endif
