/* fitllm_emu: the fitllm command line with the "cuda-emu" backend registered (the CUDA backend over the CPU
 * emulator; a developer's tool, built with FL_CUDA_EMU, never installed). It is how the GPU paths' op sequence is
 * looked at without a GPU, e.g. which ops a bf16-true step issues and how often:
 *
 *     FITLLM_BACKEND=cuda-emu build/fitllm_emu bench-step micro --precision bf16-true --profile --steps 1 --warmup 1
 *
 * The times are the emulator's (meaningless for a GPU); the op names and call counts are the GPU's. With
 * FITLLM_EMU_DEVICE_MEMORY=1 the backend states the real GPU's capabilities (device memory: the host staging pool,
 * the phase syncs), as tests/test_cuda_*.c's fl_cuemu_set_host_memory(0) does. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"

fl_status fl_cuemu_backend_init(fl_backend *be, int n_threads);
void fl_cuemu_backend_free(fl_backend *be);
void fl_cuemu_set_host_memory(int on);

__attribute__((constructor)) static void fl_emu_register(void) {
    const char *dm = getenv("FITLLM_EMU_DEVICE_MEMORY");
    if (dm && !strcmp(dm, "1")) fl_cuemu_set_host_memory(0);
    (void)fl_backend_register("cuda-emu", "the CUDA backend over the CPU emulator (fitllm_emu)", fl_cuemu_backend_init,
                              fl_cuemu_backend_free);
}
