/* fitllm CUDA kernels: one source, two compilers.
 *
 * Every kernel file in src/backend/cuda/kernels/ (*.cu) includes this header and is compiled
 * twice: by nvcc for the GPU (FL_CUDA builds: real <<<>>> launches), and by the host C++ compiler
 * for the CPU under our emulator (src/backend/cuda/emu/: one fiber per CUDA thread), which is how
 * `make test` checks the kernels on machines without a GPU. Kernels use only what this header
 * provides in both worlds:
 *   static __global__ (kernels have internal linkage: the two object sets link into one program) /
 *   __device__ / __shared__ (static arrays) / FL_CU_DYN_SMEM (dynamic shared memory),
 *   threadIdx, blockIdx, blockDim, gridDim, __syncthreads, __syncwarp,
 *   __shfl_xor_sync / __shfl_down_sync / __shfl_sync (float, int, unsigned, double),
 *   float math from <math.h> plus rsqrtf, the 16-bit conversions below, FL_CU_LAUNCH;
 *   and, including cu_mma.h, the bf16 tensor-core mma (emulated through a warp gather).
 * Host launchers are named FL_CUK(name) (fl_cuk_* on the GPU, fl_cuemu_* emulated) so both
 * object sets link into one test program. */
#ifndef FL_CU_COMPAT_H
#define FL_CU_COMPAT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__ /* ================================ nvcc ================================ */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fitllm/dtype.h"

#define FL_CUK(name) fl_cuk_##name
#define FL_CU_EMULATED 0
/* One launch macro: <<<grid, block, dynamic shared bytes, stream>>>. */
#define FL_CU_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
/* Dynamic shared memory as a T* named `name` (one untyped extern array per translation unit). */
#define FL_CU_DYN_SMEM(T, name)                                                                   \
    extern __shared__ __align__(16) unsigned char fl_cu_dyn_smem_raw[];                            \
    T *name = reinterpret_cast<T *>(fl_cu_dyn_smem_raw)
typedef cudaStream_t fl_cu_stream;
/* A kernel launched with more than 256 threads a block: ptxas holds its registers to what n threads may have (65,536
 * / n), so the launch cannot fail for registers (tools/cuda_regs.sh; up to 256 threads even 255 registers fit) */
#define FL_CU_BOUNDS(n) __launch_bounds__(n)
#define FL_CU_DEV static __device__ __forceinline__
static inline int fl_cu_launch_error(void) { return (int)cudaGetLastError(); }

FL_CU_DEV float fl_cu_f16_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
FL_CU_DEV uint16_t fl_cu_f32_to_f16(float f) { return __half_as_ushort(__float2half_rn(f)); }
FL_CU_DEV uint32_t fl_cu_float_bits(float f) { return __float_as_uint(f); }
FL_CU_DEV float fl_cu_bits_float(uint32_t u) { return __uint_as_float(u); }
/* 4 consecutive floats at a 16-byte aligned address: one 128-bit load / store */
FL_CU_DEV void fl_cu_ld4(const float *p, float *v) {
    const float4 t = *reinterpret_cast<const float4 *>(p);
    v[0] = t.x;
    v[1] = t.y;
    v[2] = t.z;
    v[3] = t.w;
}
FL_CU_DEV void fl_cu_st4(float *p, const float *v) { *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]); }
/* 8 consecutive 16-bit values (bf16 / fp16) at a 16-byte aligned address: one 128-bit load / store (uint4) */
FL_CU_DEV void fl_cu_ld8h(const uint16_t *p, uint16_t *h) {
    const uint4 t = *reinterpret_cast<const uint4 *>(p);
    const uint32_t w[4] = {t.x, t.y, t.z, t.w};
    for (int k = 0; k < 4; k++) h[2 * k] = (uint16_t)(w[k] & 0xffffu), h[2 * k + 1] = (uint16_t)(w[k] >> 16);
}
/* 4 consecutive 16-bit values at an 8-byte aligned address: one 64-bit load (uint2) */
FL_CU_DEV void fl_cu_ld4h(const uint16_t *p, uint16_t *h) {
    const uint2 t = *reinterpret_cast<const uint2 *>(p);
    h[0] = (uint16_t)(t.x & 0xffffu), h[1] = (uint16_t)(t.x >> 16), h[2] = (uint16_t)(t.y & 0xffffu);
    h[3] = (uint16_t)(t.y >> 16);
}
/* 4 consecutive 16-bit values at an 8-byte aligned address: one 64-bit store (uint2) */
FL_CU_DEV void fl_cu_st4h(uint16_t *p, const uint16_t *h) {
    *reinterpret_cast<uint2 *>(p) = make_uint2((uint32_t)h[0] | (uint32_t)h[1] << 16, (uint32_t)h[2] | (uint32_t)h[3] << 16);
}
FL_CU_DEV void fl_cu_st8h(uint16_t *p, const uint16_t *h) {
    uint32_t w[4];
    for (int k = 0; k < 4; k++) w[k] = (uint32_t)h[2 * k] | (uint32_t)h[2 * k + 1] << 16;
    *reinterpret_cast<uint4 *>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

#else /* ======================= host C++ compiler: the emulator ======================= */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/emu/cu_emu.h"
#include "fitllm/dtype.h"

#ifndef __cplusplus
#error "cu_compat.h: kernel sources compile as C++ (nvcc, or g++ for the emulator)"
#endif

#define FL_CUK(name) fl_cuemu_##name
#define FL_CU_EMULATED 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
/* One copy per block: the blocks of a launch run one after another on one OS thread, so a
 * function-local static is exactly "shared by the threads of the running block" (thread_local:
 * launches from different OS threads do not collide). NOT re-initialized per block: a kernel
 * must write shared memory before reading it, as on the GPU. */
#define __shared__ static thread_local

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef fl_cu_emu_dim uint3;
#define threadIdx (*fl_cu_emu_thread_idx())
#define blockIdx (*fl_cu_emu_block_idx())
#define blockDim (*fl_cu_emu_block_dim())
#define gridDim (*fl_cu_emu_grid_dim())
#define __syncthreads() fl_cu_emu_syncthreads()
#define __syncwarp(...) fl_cu_emu_syncwarp()
typedef void *fl_cu_stream;
#define FL_CU_BOUNDS(n)
#define FL_CU_DEV static inline
/* cudaGetLastError's: a launch's error, or an opt-in's refusal (returned once, as CUDA clears it) */
static inline int fl_cu_launch_error(void) {
    const int pending = fl_cu_emu_take_pending();
    return fl_cu_emu_error() ? 1 : pending;
}
/* a kernel's address as the launch checks' key (fl_cu_emu_launch_ok, fl_cu_emu_smem_optin) */
template <class K> static inline uintptr_t fl_cu_emu_key(K k) {
    uintptr_t u = 0;
    memcpy(&u, &k, sizeof k < sizeof u ? sizeof k : sizeof u);
    return u;
}

template <class F> static void fl_cu_emu_tramp(void *f) { (*(F *)f)(); }
template <class F> static void fl_cu_emu_del(void *f) { delete (F *)f; }
template <class F> static void fl_cu_emu_launch_fn(dim3 g, dim3 b, size_t smem, uintptr_t key, F f) {
    if (!fl_cu_emu_launch_ok(key, fl_cu_emu_dim{g.x, g.y, g.z}, fl_cu_emu_dim{b.x, b.y, b.z}, smem)) return;
    if (fl_cu_emu_capturing()) { /* a graph node: the closure (the arguments by value) kept for the replays */
        fl_cu_emu_capture_kernel(fl_cu_emu_dim{g.x, g.y, g.z}, fl_cu_emu_dim{b.x, b.y, b.z}, smem, fl_cu_emu_tramp<F>,
                                 new F(f), fl_cu_emu_del<F>);
        return;
    }
    fl_cu_emu_launch(fl_cu_emu_dim{g.x, g.y, g.z}, fl_cu_emu_dim{b.x, b.y, b.z}, smem, fl_cu_emu_tramp<F>, &f);
}
/* The arguments are captured by value, as a launch passes them (a stream capture keeps them for its replays);
 * each CUDA thread gets its own copy as the kernel's parameters. */
#define FL_CU_LAUNCH(kernel, grid, block, smem, stream, ...)                                      \
    fl_cu_emu_launch_fn((grid), (block), (smem), fl_cu_emu_key(kernel), [=]() { kernel(__VA_ARGS__); })
#define FL_CU_DYN_SMEM(T, name) T *name = (T *)fl_cu_emu_dyn_smem()

/* Warp shuffles: the value travels as 64 bits through the warp's exchange slots. `mask` is not
 * checked: every live lane of the warp must call (the emulator deadlocks, an error, otherwise). */
template <class T> static inline uint64_t fl_cu_emu_tobits(T v) {
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <class T> static inline T fl_cu_emu_frombits(uint64_t u) {
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    int lane = fl_cu_emu_lane(), src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = -1; /* outside the segment: own value */
    return fl_cu_emu_frombits<T>(fl_cu_emu_exchange(fl_cu_emu_tobits(v), src));
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    int lane = fl_cu_emu_lane(), src = lane + (int)delta;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = -1;
    return fl_cu_emu_frombits<T>(fl_cu_emu_exchange(fl_cu_emu_tobits(v), src));
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    int lane = fl_cu_emu_lane(), src = (lane & ~(width - 1)) + (src_lane & (width - 1));
    return fl_cu_emu_frombits<T>(fl_cu_emu_exchange(fl_cu_emu_tobits(v), src));
}

static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
FL_CU_DEV float fl_cu_f16_to_f32(uint16_t h) { return fl_f16_to_f32(h); }
FL_CU_DEV uint16_t fl_cu_f32_to_f16(float f) { return fl_f32_to_f16(f); }
FL_CU_DEV uint32_t fl_cu_float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
FL_CU_DEV float fl_cu_bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* The 128-bit accesses: a misaligned address faults on the GPU, so the emulator stops there too. */
FL_CU_DEV void fl_cu_check16(const void *p) {
    fl_cu_emu_vec_accesses++;
    if ((uintptr_t)p & 15u) {
        fprintf(stderr, "cuda emulator: 128-bit access at %p, not 16-byte aligned (a GPU faults)\n", p);
        abort();
    }
}
FL_CU_DEV void fl_cu_ld4(const float *p, float *v) {
    fl_cu_check16(p);
    memcpy(v, p, 4 * sizeof(float));
}
FL_CU_DEV void fl_cu_st4(float *p, const float *v) {
    fl_cu_check16(p);
    memcpy(p, v, 4 * sizeof(float));
}
FL_CU_DEV void fl_cu_ld8h(const uint16_t *p, uint16_t *h) {
    fl_cu_check16(p);
    memcpy(h, p, 8 * sizeof(uint16_t));
}
FL_CU_DEV void fl_cu_ld4h(const uint16_t *p, uint16_t *h) {
    if ((uintptr_t)p & 7u) {
        fprintf(stderr, "cuda emulator: 64-bit access at %p, not 8-byte aligned (a GPU faults)\n", (const void *)p);
        abort();
    }
    memcpy(h, p, 4 * sizeof(uint16_t));
}
FL_CU_DEV void fl_cu_st4h(uint16_t *p, const uint16_t *h) {
    if ((uintptr_t)p & 7u) {
        fprintf(stderr, "cuda emulator: 64-bit access at %p, not 8-byte aligned (a GPU faults)\n", (void *)p);
        abort();
    }
    memcpy(p, h, 4 * sizeof(uint16_t));
}
FL_CU_DEV void fl_cu_st8h(uint16_t *p, const uint16_t *h) {
    fl_cu_check16(p);
    memcpy(p, h, 8 * sizeof(uint16_t));
}
#endif
/* Raise a kernel's dynamic shared memory limit above the default 48 KB (host side): 0, or an error that
 * fl_cu_launch_error then returns once (a device whose per-block maximum is smaller: sm_86 / 89's 99 KiB against
 * sm_90's 227). Under the emulator the opt-in is recorded for the launch's check and refused above the emulated
 * device's maximum (cu_emu.h fl_cu_emu_smem_optin: sm_90's by default, FITLLM_EMU_SMEM_MAX). */
#if FL_CU_EMULATED
#define FL_CU_SMEM_OPTIN(kernel, bytes) fl_cu_emu_smem_optin(fl_cu_emu_key(kernel), (size_t)(bytes))
#else
#define FL_CU_SMEM_OPTIN(kernel, bytes)                                                                          \
    (int)cudaFuncSetAttribute((const void *)(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(bytes))
#endif

/* 1 when every pointer is 16-byte aligned (NULL counts as aligned): the 128-bit paths may run. */
static inline int fl_cu_aligned16(const void *a, const void *b, const void *c, const void *d, const void *e) {
    return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e) & 15u) == 0;
}

/* ---- shared by both worlds ---------------------------------------------------------------- */
#define FL_CU_FULL_MASK 0xffffffffu
/* Row n = q / w and column c = q % w of a grid-stride loop's index q without a 64-bit division per step (a
 * software routine of ~100 instructions on a GPU): start once, then each stride S advances (n, c) by
 * (S / w, S % w) with one carry. */
struct fl_cu_rowcol {
    size_t n, c, sn, sc, w;
};
static inline __host__ __device__ fl_cu_rowcol fl_cu_rc_start(size_t q, size_t S, size_t w) {
    fl_cu_rowcol r = {q / w, q % w, S / w, S % w, w};
    return r;
}
static inline __host__ __device__ void fl_cu_rc_next(fl_cu_rowcol &r) {
    r.n += r.sn;
    r.c += r.sc;
    if (r.c >= r.w) r.c -= r.w, r.n++;
}
/* Fully unrolled loops over register arrays (a dynamically indexed array goes to local memory) */
#ifdef __CUDACC__
#define FL_CU_UNROLL _Pragma("unroll")
#define FL_CU_NO_UNROLL _Pragma("unroll 1") /* a loop kept rolled (its body: one group of loads in flight) */
#else
#define FL_CU_UNROLL
#define FL_CU_NO_UNROLL
#endif

/* bf16 <-> fp32 exactly as include/fitllm/dtype.h (round to nearest even, NaN kept quiet). */
FL_CU_DEV float fl_cu_bf16_to_f32(uint16_t h) { return fl_cu_bits_float((uint32_t)h << 16); }
FL_CU_DEV uint16_t fl_cu_f32_to_bf16(float f) {
    uint32_t u = fl_cu_float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A bf16-stored output (o16 != NULL): o16[i] = bf16(v) and the fp32 view gets widen(o16[i]) (returned): round16's
 * bits inside the kernel that makes v (issue 30 item 1); o16 NULL: v. */
FL_CU_DEV float fl_cu_keep16(uint16_t *o16, size_t i, float v) {
    if (!o16) return v;
    o16[i] = fl_cu_f32_to_bf16(v);
    return fl_cu_bf16_to_f32(o16[i]);
}

/* out[i] = v through the bf16 copy o16 (fl_cu_keep16's bits); out NULL: the copy only (a stored slot's fp32 view that
 * nothing reads is not written: issue 30 item 1) */
FL_CU_DEV void fl_cu_put16(float *out, uint16_t *o16, size_t i, float v) {
    v = fl_cu_keep16(o16, i, v);
    if (out) out[i] = v;
}

/* 8 consecutive elements from element i (a multiple of 8, the pointer 16-byte aligned) of a row of type t (F32: two
 * 128-bit accesses; BF16 / F16: one), widened exactly / stored rounded as element-by-element code does (issue 30
 * item 4: the vector paths of the elementwise kernels keep their bits) */
FL_CU_DEV void fl_cu_ld8t(const void *p, int t, size_t i, float *v) {
    if (t == FL_F32) {
        fl_cu_ld4((const float *)p + i, v);
        fl_cu_ld4((const float *)p + i + 4, v + 4);
        return;
    }
    uint16_t h[8];
    fl_cu_ld8h((const uint16_t *)p + i, h);
    for (int k = 0; k < 8; k++) v[k] = t == FL_BF16 ? fl_cu_bf16_to_f32(h[k]) : fl_cu_f16_to_f32(h[k]);
}
FL_CU_DEV void fl_cu_st8t(void *p, int t, size_t i, const float *v) {
    if (t == FL_F32) {
        fl_cu_st4((float *)p + i, v);
        fl_cu_st4((float *)p + i + 4, v + 4);
        return;
    }
    uint16_t h[8];
    for (int k = 0; k < 8; k++) h[k] = t == FL_BF16 ? fl_cu_f32_to_bf16(v[k]) : fl_cu_f32_to_f16(v[k]);
    fl_cu_st8h((uint16_t *)p + i, h);
}
/* An 8-wide bf16 copy (o16 NULL: none): o16[i + k] = bf16(v[k]) and v[k] its widening (fl_cu_keep16's bits) */
FL_CU_DEV void fl_cu_keep16x8(uint16_t *o16, size_t i, float *v) {
    if (!o16) return;
    uint16_t h[8];
    for (int k = 0; k < 8; k++) {
        h[k] = fl_cu_f32_to_bf16(v[k]);
        v[k] = fl_cu_bf16_to_f32(h[k]);
    }
    fl_cu_st8h(o16 + i, h);
}

/* A 4-wide bf16 copy (o16 NULL: none), fl_cu_keep16's bits: o16[i + k] = bf16(v[k]) and v[k] its widening; one
 * 64-bit store where o16 + i is 8-byte aligned, else four */
FL_CU_DEV void fl_cu_keep16x4(uint16_t *o16, size_t i, float *v) {
    if (!o16) return;
    uint16_t h[4];
    for (int k = 0; k < 4; k++) {
        h[k] = fl_cu_f32_to_bf16(v[k]);
        v[k] = fl_cu_bf16_to_f32(h[k]);
    }
    if (((uintptr_t)(o16 + i) & 7u) == 0)
        fl_cu_st4h(o16 + i, h);
    else
        for (int k = 0; k < 4; k++) o16[i + k] = h[k];
}

/* Sum over a warp (every lane gets it). */
FL_CU_DEV float fl_cu_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FL_CU_FULL_MASK, v, o);
    return v;
}
FL_CU_DEV float fl_cu_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FL_CU_FULL_MASK, v, o));
    return v;
}

/* Sum over a 1-D block of a multiple of 32 threads (<= 1024); every thread gets it. `buf` is 32
 * values of shared memory, free again when this returns (the trailing barrier: two sums in a row
 * reuse it). The order is fixed (lanes by xor butterfly, then warps): deterministic. */
template <class T> FL_CU_DEV T fl_cu_block_sum(T v, T *buf) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FL_CU_FULL_MASK, v, o);
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    v = lane < nwarp ? buf[lane] : (T)0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FL_CU_FULL_MASK, v, o);
    __syncthreads();
    return v;
}
#endif
