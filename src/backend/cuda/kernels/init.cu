/* Random initialization on the device (backend.h init_random; fl_model_init_random): the host's stream, element by
 * element. The stream is splitmix64 as a counter: element k of a tensor whose stream starts at state s belongs to
 * the Box-Muller pair j = k / 2, whose two draws mix the states s + (2j + 1) gamma and s + (2j + 2) gamma; the even
 * element takes the cosine, the odd one the sine (src/model/model.c init_fill). In double precision as the host
 * computes it, then rounded to the parameter's dtype as fl_convert rounds. The emulator computes with the host's
 * libm (the same bits as the host path); a GPU's double-precision log / sin / cos may differ from glibc's in the
 * last place, which can move a rare element by one float ulp (EXPERIMENTAL on a GPU). */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

FL_CU_DEV double fl_cu_init_u01(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return ((double)(z >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

__global__ static void fl_cu_init_random_k(void *dst, int dt, size_t k0, size_t n, int kind, double sd,
                                           unsigned long long s) {
    const unsigned long long gamma = 0x9e3779b97f4a7c15ULL;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t k = k0 + i, j = k >> 1;
        float v = kind == 1 ? 1.0f : 0.0f;
        if (kind == 2) {
            const double u1 = fl_cu_init_u01(s + (2ULL * j + 1ULL) * gamma);
            const double u2 = fl_cu_init_u01(s + (2ULL * j + 2ULL) * gamma);
            const double r = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
            v = (float)(sd * r * ((k & 1) ? sin(th) : cos(th)));
        }
        if (dt == FL_F32) ((float *)dst)[i] = v;
        else if (dt == FL_BF16) ((uint16_t *)dst)[i] = fl_cu_f32_to_bf16(v);
        else ((uint16_t *)dst)[i] = fl_cu_f32_to_f16(v);
    }
}

extern "C" int FL_CUK(init_random)(void *dst, fl_dtype dt, size_t k0, size_t n, int kind, double sd, uint64_t s,
                                   void *stream) {
    if ((dt != FL_F32 && dt != FL_BF16 && dt != FL_F16) || kind < 0 || kind > 2) return -1;
    if (n == 0) return 0;
    size_t b = (n + 255) / 256;
    FL_CU_LAUNCH(fl_cu_init_random_k, dim3((unsigned)(b > 4096 ? 4096 : b)), dim3(256), 0, (fl_cu_stream)stream, dst,
                 (int)dt, k0, n, kind, sd, (unsigned long long)s);
    return fl_cu_launch_error();
}
