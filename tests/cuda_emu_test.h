/* Shared by the CUDA emulator's test files (tests/test_cuda_*.c, FL_HAVE_CUDA_EMU builds): EMU_OK(call) checks
 * that an emulated launcher returned 0 and left no emulator error (an out-of-bounds access, a barrier
 * mismatch), naming the call; EMU_WORK the work buffer of the norm backwards / cross-entropy launchers. */
#ifndef FL_TESTS_CUDA_EMU_TEST_H
#define FL_TESTS_CUDA_EMU_TEST_H

#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/emu/cu_emu.h"
#include "test.h"

/* the work the column sums and the cross-entropy take (FL_CU_NORM_WORK_BYTES: the backend lends its op work area) */
static inline void *emu_work(void) {
    static float w[FL_CU_NORM_WORK_BYTES / sizeof(float)];
    return w;
}
#define EMU_WORK emu_work()

#define EMU_OK(call)                                                                                   \
    do {                                                                                               \
        fl_cu_emu_clear_error();                                                                       \
        int rc_ = (call);                                                                              \
        FL_CHECKF(rc_ == 0 && !fl_cu_emu_error(), "%s -> %d (%s)", #call, rc_,                          \
                  fl_cu_emu_error() ? fl_cu_emu_error() : "no emulator error");                        \
    } while (0)

#endif
