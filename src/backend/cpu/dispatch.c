/* The kernels run-time dispatch chose, for fitllm --version and the benchmarks' headers.
 * CPU features and the FITLLM_CPU cap: include/fitllm/cpu.h; each kernel family reports its
 * own choice (gemm.c, adam8bit.c, core/cvt.c). */
#include "backend/cpu/cpu-impl.h"
#include "core/cvt.h"
#include "fitllm/cpu.h"

void fl_cpu_kernels(fl_cpu_kernel_info *k) {
    fl_backend be;
    k->cpu_level = fl_cpu_level_name(fl_cpu_level());
    k->gemm_library = fl_cpu_gemm_library();
    k->bf16_gemm = fl_cpu_gemm_bf16_path();
    k->f16_gemm = fl_cpu_gemm_f16_path();
    k->adam8bit = fl_cpu_adam8bit_quantizer_path();
    k->convert = fl_cvt_path();
    k->attention = fl_cpu_attn_mm_path();
    k->threads = fl_cpu_backend_init(&be, 0) == FL_OK ? be.n_threads : 1;
}
