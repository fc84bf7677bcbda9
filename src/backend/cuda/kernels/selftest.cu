/* Emulator self-test kernels (tests/test_cuda_emu.c): they exist to fail when the emulator's
 * barrier or shuffle semantics are wrong, or when a kernel forgets a barrier. */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/kernels/attn_common.h"
#include "backend/cuda/kernels/attn_mma.h" /* fl_cu_cp16, fl_cu_cp_commit, fl_cu_cp_wait */

/* out[i] = in[(i + n - 1) % n]: each thread stores its element in shared memory and reads its
 * left neighbour's. Without the barrier the read races the neighbour's write: run in thread
 * order the neighbour has always written already (the bug hides); shuffled, it often has not. */
__global__ static void FL_CU_BOUNDS(1024) fl_cu_selftest_shift_k(float *out, const float *in, int n, int with_barrier) {
    FL_CU_DYN_SMEM(float, s);
    int i = threadIdx.x;
    if (i < n) s[i] = in[i];
    if (with_barrier) __syncthreads();
    if (i < n) out[i] = s[(i + n - 1) % n];
}

/* Per thread t (lane l): [xor 5 of l, down 3 of l (l itself past the warp's end), lane 7's id,
 * warp sum of the lane ids]. */
__global__ static void FL_CU_BOUNDS(1024) fl_cu_selftest_shuffles_k(int *out) {
    int t = threadIdx.x, l = t & 31;
    out[t * 4 + 0] = __shfl_xor_sync(FL_CU_FULL_MASK, l, 5);
    out[t * 4 + 1] = __shfl_down_sync(FL_CU_FULL_MASK, l, 3);
    out[t * 4 + 2] = __shfl_sync(FL_CU_FULL_MASK, l, 7);
    out[t * 4 + 3] = (int)fl_cu_warp_sum((float)l);
}

/* Undefined behaviour on purpose, for the emulator only (never launch it on a GPU: it may hang):
 * lanes 0-15 of the warp wait at __syncthreads while lanes 16-31 wait at __syncwarp. */
__global__ static void fl_cu_selftest_divergent_k(int *out) {
    if (threadIdx.x < 16) __syncthreads();
    else __syncwarp();
    out[threadIdx.x] = 1;
}

extern "C" int FL_CUK(selftest_divergent)(int *out, void *stream) {
    FL_CU_LAUNCH(fl_cu_selftest_divergent_k, dim3(1), dim3(32), 0, (fl_cu_stream)stream, out);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(selftest_shift)(float *out, const float *in, int n, int with_barrier, void *stream) {
    FL_CU_LAUNCH(fl_cu_selftest_shift_k, dim3(1), dim3((unsigned)n), (size_t)n * sizeof(float),
                 (fl_cu_stream)stream, out, in, n, with_barrier);
    return fl_cu_launch_error();
}

/* The launch checks' kernel (tests/test_cuda_emu.c cuda_emu_launch_limits): the shift above through smem bytes of
 * dynamic shared memory (>= n floats, the rest unused) in a (1, gy) grid whose first block writes out; optin: the
 * kernel's limit raised to smem first (refused by a device whose maximum is smaller: nothing launched); optin < 0 (the
 * emulator's ASan test only, never on a GPU): smem not checked against n, the kernel writes past it */
__global__ static void FL_CU_BOUNDS(1024) fl_cu_selftest_smem_k(float *out, const float *in, int n) {
    FL_CU_DYN_SMEM(float, s);
    int i = threadIdx.x;
    if (i < n) s[i] = in[i];
    __syncthreads();
    if (i < n && blockIdx.y == 0) out[i] = s[(i + n - 1) % n];
}

extern "C" int FL_CUK(selftest_smem)(float *out, const float *in, int n, size_t smem, int optin, unsigned gy,
                                     void *stream) {
    if (n < 1 || n > 1024 || (optin >= 0 && smem < (size_t)n * sizeof(float))) return -1;
    if (optin > 0 && FL_CU_SMEM_OPTIN(fl_cu_selftest_smem_k, smem)) return fl_cu_launch_error();
    FL_CU_LAUNCH(fl_cu_selftest_smem_k, dim3(1, gy), dim3((unsigned)n), smem, (fl_cu_stream)stream, out, in, n);
    return fl_cu_launch_error();
}

/* cp.async as the emulator holds it (cu_emu.h fl_cu_emu_cp_async; modes 1-3 for the emulator only: on a GPU they read a
 * copy before it is known to have landed, or leave one in flight): 32 threads each copy in's 4 floats at 4 t into shared
 * memory, in two groups (threads 0-15 first), and thread t reads thread (t + 1) % 32's chunk into out after a barrier.
 * mode 0: both groups waited for (out = in shifted by one chunk); 1: none waited for before the barrier (then all);
 * 2: all but the newest group (threads 16-31's chunks not landed); 3: the thread returns with its copies in flight. */
__global__ static void fl_cu_selftest_cp_k(float *out, const float *in, int mode) {
    FL_CU_DYN_SMEM(float, s); /* 32 x 4 floats, 16-byte aligned */
    const int t = threadIdx.x;
    if (t < 16) fl_cu_cp16(s + 4 * t, in + 4 * t, 1);
    fl_cu_cp_commit();
    if (t >= 16) fl_cu_cp16(s + 4 * t, in + 4 * t, 1);
    fl_cu_cp_commit();
    if (mode == 3) return;
    if (mode == 0) fl_cu_cp_wait<0>();
    if (mode == 2) fl_cu_cp_wait<1>();
    __syncthreads();
    const int u = (t + 1) % 32;
    for (int k = 0; k < 4; k++) out[4 * t + k] = s[4 * u + k];
    __syncthreads(); /* every read done before any copy left in flight lands */
    fl_cu_cp_wait<0>();
}

extern "C" int FL_CUK(selftest_cp)(float *out, const float *in, int mode, void *stream) {
    FL_CU_LAUNCH(fl_cu_selftest_cp_k, dim3(1), dim3(32), 32 * 4 * sizeof(float), (fl_cu_stream)stream, out, in, mode);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(selftest_shuffles)(int *out, int block, void *stream) {
    FL_CU_LAUNCH(fl_cu_selftest_shuffles_k, dim3(1), dim3((unsigned)block), 0, (fl_cu_stream)stream, out);
    return fl_cu_launch_error();
}
