/* CPU feature detection and the dispatch level; see include/fitllm/cpu.h. */
#include "fitllm/cpu.h"

#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#if (defined(__x86_64__) || defined(__i386__)) && defined(__clang__) && __clang_major__ < 15
#include <cpuid.h>
#endif
#include <string.h>

static struct {
    pthread_once_t once;
    unsigned detected;
    fl_cpu_level_t hw, env_level; /* env_level: hw capped by FITLLM_CPU */
    int env_valid;
    const char *env;
    char names[96];
    _Atomic int forced; /* fl_cpu_set_level: -1 none */
} g_cpu = {.once = PTHREAD_ONCE_INIT, .forced = -1};

static void detect(void) {
    unsigned f = 0;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) f |= FL_CPU_F_AVX2;
    if (__builtin_cpu_supports("fma")) f |= FL_CPU_F_FMA;
#if defined(__clang__) && __clang_major__ < 15
    /* clang < 15 does not know "f16c" here (the fuzz build uses clang 14): CPUID.1:ECX bit 29 */
    unsigned ca, cb, cc, cd;
    int f16c = __get_cpuid(1, &ca, &cb, &cc, &cd) && ((cc >> 29) & 1u);
#else
    int f16c = __builtin_cpu_supports("f16c");
#endif
    if (f16c && __builtin_cpu_supports("avx")) f |= FL_CPU_F_F16C;
    if (__builtin_cpu_supports("avx512f")) f |= FL_CPU_F_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= FL_CPU_F_AVX512BW;
    if (__builtin_cpu_supports("avx512vl")) f |= FL_CPU_F_AVX512VL;
    if (__builtin_cpu_supports("avx512bf16")) f |= FL_CPU_F_AVX512BF16;
#endif
    g_cpu.detected = f;
    unsigned l1 = FL_CPU_F_AVX2 | FL_CPU_F_FMA | FL_CPU_F_F16C;
    unsigned l2 = l1 | FL_CPU_F_AVX512F | FL_CPU_F_AVX512BW | FL_CPU_F_AVX512VL;
    g_cpu.hw = (f & l2) == l2 ? FL_CPU_AVX512 : (f & l1) == l1 ? FL_CPU_AVX2 : FL_CPU_GENERIC;
    static const char *k_names[] = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"};
    g_cpu.names[0] = 0;
    for (int i = 0; i < 7; i++)
        if (f & (1u << i)) {
            if (g_cpu.names[0]) strcat(g_cpu.names, " ");
            strcat(g_cpu.names, k_names[i]);
        }
    const char *env = getenv("FITLLM_CPU");
    g_cpu.env = env ? env : "";
    g_cpu.env_valid = 1;
    g_cpu.env_level = g_cpu.hw;
    if (env && *env) {
        int cap = !strcmp(env, "generic") ? FL_CPU_GENERIC
                  : !strcmp(env, "avx2")  ? FL_CPU_AVX2
                  : !strcmp(env, "avx512") ? FL_CPU_AVX512
                                           : -1;
        if (cap < 0)
            g_cpu.env_valid = 0; /* unknown value: ignored (fitllm --version says so) */
        else if (cap < (int)g_cpu.env_level)
            g_cpu.env_level = (fl_cpu_level_t)cap;
    }
}

static void init(void) { pthread_once(&g_cpu.once, detect); }

unsigned fl_cpu_features_detected(void) {
    init();
    return g_cpu.detected;
}

fl_cpu_level_t fl_cpu_level_detected(void) {
    init();
    return g_cpu.hw;
}

fl_cpu_level_t fl_cpu_level(void) {
    init();
    int f = g_cpu.forced;
    return f >= 0 ? (fl_cpu_level_t)f : g_cpu.env_level;
}

unsigned fl_cpu_features(void) {
    fl_cpu_level_t l = fl_cpu_level();
    unsigned f = g_cpu.detected;
    if (l < FL_CPU_AVX512) f &= ~(unsigned)(FL_CPU_F_AVX512F | FL_CPU_F_AVX512BW | FL_CPU_F_AVX512VL | FL_CPU_F_AVX512BF16);
    if (l < FL_CPU_AVX2) f &= ~(unsigned)(FL_CPU_F_AVX2 | FL_CPU_F_FMA | FL_CPU_F_F16C);
    return f;
}

const char *fl_cpu_level_name(fl_cpu_level_t level) {
    switch (level) {
    case FL_CPU_GENERIC: return "generic";
    case FL_CPU_AVX2: return "avx2";
    case FL_CPU_AVX512: return "avx512";
    }
    return "?";
}

const char *fl_cpu_features_string(void) {
    init();
    return g_cpu.names;
}

const char *fl_cpu_env(int *valid) {
    init();
    if (valid) *valid = g_cpu.env_valid;
    return g_cpu.env;
}

fl_cpu_level_t fl_cpu_set_level(int level) {
    init();
    if (level < 0)
        g_cpu.forced = -1;
    else
        g_cpu.forced = level > (int)g_cpu.hw ? (int)g_cpu.hw : level;
    return fl_cpu_level();
}

/* "All cores": the OpenMP default as the process started, read once. Not omp_get_max_threads() at each
 * init: the GEMM sets the calling thread's count (omp_set_num_threads, gemm.c) to the backend's, and to 1
 * for a small product, so a backend made after one ran on that thread took 1 thread and kept it: every
 * later default-threads run of a process (the lab's rows after the first, a selftest's second training)
 * ran on one core, and the per-thread-count GEMMs gave other bits than the first run. */
static int g_default_threads;
static pthread_once_t g_default_once = PTHREAD_ONCE_INIT;
static void read_default_threads(void) { g_default_threads = omp_get_max_threads(); }
/* Read before main(): read at the first call instead, the value depended on what ran before it on
 * that thread (a test run of `fitllm_tests gemm` made its first default backend after a small GEMM,
 * and got 1 thread). libgomp, a shared library, has set its defaults from the environment by then. */
__attribute__((constructor)) static void default_threads_at_start(void) {
    pthread_once(&g_default_once, read_default_threads);
}

int fl_cpu_default_threads(void) {
    pthread_once(&g_default_once, read_default_threads);
    return g_default_threads > 0 ? g_default_threads : 1;
}
