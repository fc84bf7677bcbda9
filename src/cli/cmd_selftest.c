/* fitllm selftest: a backend's ops against the CPU backend on the same inputs (fitllm/selftest.h). */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "fitllm/cuda.h"
#include "fitllm/selftest.h"

static void help(void) {
    printf("usage: fitllm selftest [--accelerator cuda|cpu] [--backend NAME] [--only SUBSTRING] [--threads N]\n\n"
           "Runs every op of a backend (GEMMs in every type combination, norms, RoPE, attention forward and\n"
           "backward, SwiGLU/GELU/ReLU, cross-entropy, optimizers incl. 8-bit AdamW, 16-bit conversions, NF4\n"
           "matmuls, LoRA) on random inputs, and the same op on the CPU backend, and compares every output\n"
           "element against a floating-point error bound of the computation. Prints one line per case (worst\n"
           "error as a fraction of its bound; median time of 5 runs on the tested backend) and exits 1 on any\n"
           "mismatch.\n\n"
           "  --accelerator A   cuda (default when this build has CUDA and a GPU is visible; EXPERIMENTAL) or\n"
           "                    cpu (the CPU backend against the portable reference backend)\n"
           "  --backend NAME    any backend of this build by name (fitllm --version lists them)\n"
           "  --only S          only the cases whose name contains S (e.g. gemm, attention)\n"
           "  --small           small shapes (what the test suite runs; seconds on a CPU)\n"
           "  --threads N       CPU threads of the CPU backends (default: all cores)\n");
}

int fl_cmd_selftest(int argc, char **argv) {
    const char *cmd = "selftest", *name = NULL, *only = NULL, *accel = NULL;
    int threads = 0, small = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--accelerator") && i + 1 < argc) accel = argv[++i];
        else if (!strcmp(a, "--backend") && i + 1 < argc) name = argv[++i];
        else if (!strcmp(a, "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(a, "--small")) small = 1;
        else if (!strcmp(a, "--threads")) {
            if (fl_cli_int(cmd, a, i + 1 < argc ? argv[++i] : NULL, 0, 4096, &threads)) return FL_EXIT_USAGE;
        } else return fl_cli_usage(cmd, "unknown option '%s'", a);
    }
    const char *ref_name = "cpu";
    if (!name) {
        fl_accel want = FL_ACCEL_AUTO;
        if (accel && fl_accel_parse(accel, &want))
            return fl_cli_usage(cmd, "--accelerator must be auto, cpu or cuda (got '%s')", accel);
        char why[256];
        if (want == FL_ACCEL_CPU) name = "cpu";
        else if (fl_cuda_built() && fl_cuda_device_count(why, sizeof why) > 0) name = "cuda";
        else if (want == FL_ACCEL_CUDA) {
            fprintf(stderr, "fitllm %s: error: --accelerator cuda: %s\n", cmd,
                    fl_cuda_built() ? "no CUDA device visible" : "this fitllm was built without CUDA");
            return FL_EXIT_RUNTIME;
        } else name = "cpu";
    }
    if (!strcmp(name, "cpu")) ref_name = "ref";
    fl_backend dev, ref;
    fl_status s = fl_backend_init_by_name(name, &dev, threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_init_by_name(ref_name, &ref, threads)) != FL_OK) {
        fl_backend_free(&dev);
        return fl_cli_fail(cmd, s, NULL);
    }
    if (!strcmp(name, "cuda")) {
        char desc[512];
        fl_cuda_describe(desc, sizeof desc);
        printf("cuda: %s\n", desc);
    }
    fl_selftest_result res;
    s = fl_backend_selftest(&dev, &ref, only, small, stdout, &res);
    fl_backend_free(&dev);
    fl_backend_free(&ref);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if (res.n_cases == 0) {
        fprintf(stderr, "fitllm %s: error: no case matches --only '%s'\n", cmd, only ? only : "");
        return FL_EXIT_USAGE;
    }
    return res.n_fail ? FL_EXIT_RUNTIME : 0;
}
