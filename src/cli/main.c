/* fitllm command-line entry point: dispatches to the subcommands; --version. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fitllm/comm.h"
#include "fitllm/comm_nccl.h"
#include "fitllm/cpu.h"
#include "backend/cuda/cudnn-impl.h"
#include "fitllm/cuda.h"

/* Build facts come from CMake (CMakeLists.txt, "CLI"); defaults for other build systems. */
#ifndef FL_VERSION
#define FL_VERSION "0.9.0-dev"
#endif
#ifdef FL_GIT_HEADER
#include "fl_git.h" /* generated at build time (cmake/git_describe.cmake) */
#endif
#ifndef FL_GIT_DESCRIBE
#define FL_GIT_DESCRIBE ""
#endif
#ifndef FL_BUILD_TYPE
#define FL_BUILD_TYPE "?"
#endif
#ifndef FL_BUILD_NATIVE
#define FL_BUILD_NATIVE "?"
#endif
#ifndef FL_BUILD_SANITIZE
#define FL_BUILD_SANITIZE "?"
#endif

int fl_cmd_convert(int argc, char **argv); /* src/cli/cmd_convert.c */
int fl_cmd_image_info(int argc, char **argv); /* src/cli/cmd_image.c */

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} k_cmds[] = {
    {"finetune_full", fl_cmd_finetune_full, "full fine-tuning of a model (LitGPT options and YAML recipes)"},
    {"pretrain", fl_cmd_pretrain, "train a model from scratch or continue pretraining"},
    {"finetune_lora", fl_cmd_finetune_lora, "LoRA fine-tuning: PEFT adapters on a frozen base"},
    {"finetune", fl_cmd_finetune_lora, "alias of finetune_lora"},
    {"download", fl_cmd_download, "fetch a model from the Hugging Face Hub into checkpoints/ORG/NAME (as litgpt download)"},
    {"merge_lora", fl_cmd_merge_lora, "merge a PEFT LoRA adapter into its base model (HF folder out)"},
    {"merge_shards", fl_cmd_merge_shards, "consolidate a sharded checkpoint into one HF folder (offline, streamed)"},
    {"convert", fl_cmd_convert, "write a model folder (pytorch_model*.bin, lit_model.pth, ...) as HF safetensors"},
    {"plan", fl_cmd_plan, "predict memory per tag and phase, the verdict on a device, what to try (no run)"},
    {"lab", fl_cmd_lab, "run the memory lab's experiments on scaled models; table, report, CSV/JSON, charts"},
    {"demo", fl_cmd_demo, "short real training run on a built-in model with synthetic data + memory report"},
    {"loss", fl_cmd_loss, "mean next-token cross-entropy of a model on token ids (optionally dump logits)"},
    {"image-info", fl_cmd_image_info, "decode an image; with --processor, BLIP pixel_values shape and checksums"},
    {"tokenize", fl_cmd_tokenize, "encode text to token ids or decode ids to text (tokenizer.json/.model/llama2.c .bin)"},
    {"generate", fl_cmd_generate, "generate text from a prompt with a KV cache (greedy, temperature, top-k, top-p)"},
    {"selftest", fl_cmd_selftest, "check a backend's ops against the CPU backend (--accelerator cuda: the GPU; EXPERIMENTAL)"},
    {"bench-step", fl_cmd_bench_step, "time full training steps (median ms/step, tok/s, GFLOP/s, memory report)"},
};

/* "model name" of /proc/cpuinfo into buf ("unknown" if absent). */
static const char *cpu_model(char *buf, size_t n) {
    snprintf(buf, n, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return buf;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10)) continue;
        const char *v = strchr(line, ':');
        if (!v) break;
        v++;
        while (*v == ' ' || *v == '\t') v++;
        snprintf(buf, n, "%s", v);
        buf[strcspn(buf, "\n")] = 0;
        break;
    }
    fclose(f);
    return buf;
}

const char *fl_cli_version(void) { return FL_VERSION " " FL_GIT_DESCRIBE; }

/* fitllm --version: version, build options, the CPU and the kernels run-time dispatch chose. */
static int version(void) {
    char model[256];
    fl_cpu_kernel_info k;
    fl_cpu_kernels(&k);
    int env_ok;
    const char *env = fl_cpu_env(&env_ok);
    printf("fitllm %s%s%s%s\n", FL_VERSION, *FL_GIT_DESCRIBE ? " (git " : "", FL_GIT_DESCRIBE, *FL_GIT_DESCRIBE ? ")" : "");
#if defined(__clang__)
    const char *cc = "clang";
#elif defined(__GNUC__)
    const char *cc = "gcc";
#else
    const char *cc = "cc";
#endif
    printf("build:    %s %s, %s, FL_NATIVE=%s, GEMM library %s, sanitize %s\n", cc, __VERSION__, FL_BUILD_TYPE,
           FL_BUILD_NATIVE, fl_cpu_gemm_library(), FL_BUILD_SANITIZE);
    printf("cpu:      %s\n", cpu_model(model, sizeof model));
    const char *feat = fl_cpu_features_string();
    printf("features: %s (level %s", *feat ? feat : "none of avx2/fma/f16c/avx512", fl_cpu_level_name(fl_cpu_level_detected()));
    if (*env) printf("; FITLLM_CPU=%s%s", env, env_ok ? "" : " not understood (generic|avx2|avx512), ignored");
    printf("; in use: %s)\n", k.cpu_level);
    printf("kernels:  gemm %s, bf16 gemm %s, f16 gemm %s, adam8bit quantizer %s, 16-bit conversions %s, attention "
           "tiles %s\n",
           k.gemm_library, k.bf16_gemm, k.f16_gemm, k.adam8bit, k.convert, k.attention);
    /* the default's source: OMP_NUM_THREADS as set (OpenMP read it), else the CPUs this process may run on */
    const char *omp = getenv("OMP_NUM_THREADS");
    int phys, cpus = fl_cli_usable_cpus(&phys);
    if (omp && *omp)
        printf("threads:  %d (OMP_NUM_THREADS=%s; --threads N where a command has it overrides)\n", k.threads, omp);
    else
        printf("threads:  %d (OMP_NUM_THREADS unset: the %d CPUs this process may run on; --threads N where a command "
               "has it)\n", k.threads, cpus);
    printf("backends:");
    for (int i = 0; i < fl_backend_count(); i++) printf("%s %s", i ? "," : "", fl_backend_name(i));
    printf(" (the CLI runs cpu; the op tests run every one)\n");
    /* how this process was launched (environment only: --version never initializes MPI) */
    fl_launch_info li;
    char how[384];
    if (fl_launch_detect(&li) == FL_OK) fl_launch_describe(&li, how, sizeof how);
    else snprintf(how, sizeof how, "%s", fl_error_message());
    char cu[1024];
    fl_cuda_describe(cu, sizeof cu);
    printf("cuda:     %s\n", cu);
    if (fl_comm_mpi_built()) printf("comm:     MPI (%s); launched by %s\n", fl_comm_mpi_library(), how);
    else printf("comm:     single process only (built without MPI); launched by %s\n", how);
    if (fl_cuda_built()) /* several GPUs: NCCL, one process per GPU under mpirun */
        printf("nccl:     %s%s\n", fl_comm_nccl_built() ? fl_comm_nccl_library() : "not compiled in (one GPU per run)",
               fl_comm_nccl_built() ? " (experimental: several GPUs, one process per GPU under mpirun)" : "");
    if (fl_cuda_built()) { /* cuDNN's fused attention for bf16 runs (FITLLM_CUDA_ATTN=auto), opened at run time */
        char dn[1024];
        fl_cudnn_describe(dn, sizeof dn);
        printf("cudnn:    %s\n", dn);
    }
    return 0;
}

static void usage(FILE *f) {
    fprintf(f, "usage: fitllm <command> [options]   (fitllm <command> --help for its options)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++) fprintf(f, "  %-12s %s\n", k_cmds[i].name, k_cmds[i].help);
    fprintf(f, "\n  --version    version, build options, CPU features and the kernels chosen for this CPU\n");
    fprintf(f, "\n  --accelerator auto|cpu|cuda (on the commands that run a model; default auto = the GPU when this\n"
               "               build has CUDA and one is visible, else the CPU): the CUDA backend is EXPERIMENTAL\n"
               "               (one GPU; `fitllm selftest --accelerator cuda` checks it against the CPU)\n");
    fprintf(f, "\n  FITLLM_BACKEND=opaque (environment; a testing aid): run on the test backend whose tensor memory the\n"
               "               host cannot read outside its ops (same results as the CPU; default: cpu)\n");
    fprintf(f, "\n  FITLLM_CUDA_ATTN=auto|cudnn|own|legacy|fp32 (environment): a bf16 run's attention on the GPU at\n"
               "               head size 64 or 128 (own: any even size from 66 to 128 too, padded to 128, and at 64 /\n"
               "               128 an attention bias and dropout: T5's, the Q-Former's; cuDNN: any size up to 128, padded\n"
               "               to a multiple of 8 (OpenLLaMA 3B's 100 at 104), no bias or dropout; EXPERIMENTAL):\n"
               "               auto (default) = NVIDIA cuDNN's fused attention where libcudnn.so.9\n"
               "               loads and takes the shape (EXPERIMENTAL: the graphs as cuDNN's frontend writes them, not\n"
               "               yet run on a GPU in this form, planned by cuDNN 9.19 for an H200 / A100 without one;\n"
               "               FITLLM_CUDNN_LIB names the file), else own, said once;\n"
               "               cudnn = require it (the engine and workspace of its first forward / backward plan said on\n"
               "               stderr); own = FlashAttention-2-structured kernels, EXPERIMENTAL (correct on an\n"
               "               H200, ~5x slower than cuDNN there before their tiles' loads were pipelined, not yet timed\n"
               "               since); legacy = the earlier tensor-core kernels; fp32 = the fp32 kernels. `fitllm\n"
               "               selftest` compares them\n");
    fprintf(f, "\n  FITLLM_CUDA_FA2_BK=64|128 (environment): the own attention backward's key blocks: 64 (default, 4 warps)\n"
               "               or 128 (8 warps, half the dq atomic adds; EXPERIMENTAL: not yet timed on a GPU); a padded\n"
               "               head size (66..126) defaults to 128 where the GPU has the shared memory\n");
    fprintf(f, "\n  FITLLM_CUDA_CUDNN_DIRECT=1|0 (environment): 1 (default) = cuDNN's attention reads a bf16 run's stored\n"
               "               q, k, v (and o) in place, else (refused there) compact copies; 0 = compact copies first\n"
               "               (EXPERIMENTAL, for an A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_CUDNN_B16=1|0 (environment): 1 (default) = a bf16 run's attention backward through cuDNN\n"
               "               takes dO from the output projection in bf16 and writes bf16 gradients (into the q|k|v\n"
               "               projection's dy where RoPE follows), no fp32 copies between (the same bits;\n"
               "               EXPERIMENTAL: not yet timed on a GPU); 0 = fp32 dO and gradients, converted (an A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_DETERMINISTIC=1 (environment): the own attention backward adds dq across key blocks in a\n"
               "               fixed order, and a bias's gradient (T5) in batch order (the same bits every run, somewhat\n"
               "               slower; cuDNN's backward is then not used)\n");
    fprintf(f, "\n  FITLLM_CUDA_HEAD_GROUP=1|0 (environment): 1 (default) = a trained bf16 LM head's weight gradient over\n"
               "               a group of loss chunks in one GEMM (EXPERIMENTAL: not yet timed on a GPU); 0 = one per chunk\n");
    fprintf(f, "\n  FITLLM_CUDA_HEAD_DBF16=1|0 (environment): 1 (default) = the LM head's cross-entropy writes its gradient\n"
               "               in bf16 for the head's bf16 GEMMs; 0 = in fp32, then converted (the same bits; for timing)\n");
    fprintf(f, "\n  FITLLM_CUDA_EPILOGUE=1|0 (environment): 1 (default) = a linear's bias, and GPT-2's bias + GELU, in the\n"
               "               GEMM's cuBLASLt epilogue (EXPERIMENTAL: not yet run on a GPU); 0 = kernels after the GEMM\n");
    fprintf(f, "\n  FITLLM_CUDA_GELU16=0|1 (environment): bf16 activations, GPT-2's bias + GELU: 0 (default) = the GELU of the\n"
               "               bf16-rounded pre-activation after the GEMM; 1 = EXPERIMENTAL: in the GEMM's epilogue, the GELU\n"
               "               of the fp32 pre-activation (closer to float64; the stored pre-activation is the same)\n");
    fprintf(f, "\n  FITLLM_CUDA_PINNED=1|0 (environment): 1 (default) = a step's inputs uploaded through a page-locked ring\n"
               "               (no wait for the GPU; EXPERIMENTAL); 0 = straight from the caller's memory\n");
    fprintf(f, "\n  FITLLM_CUDA_GRAPHS=0|1 (environment): 1 = EXPERIMENTAL: the training step captured as CUDA graphs on\n"
               "               step 2 and replayed after (one process; what reads back to the host runs between them,\n"
               "               per-step values come from device slots; op by op with a one-line reason where it cannot);\n"
               "               0 (default) = off\n");
    fprintf(f, "\n  FITLLM_CUDA_STEP_SCALARS=1|0 (environment): 1 (default) = EXPERIMENTAL: a step's gradient norm, clip\n"
               "               scale and loss sums stay on the GPU, read once at the step's end (the same values);\n"
               "               0 = read on the host per micro-batch and before the update\n");
    fprintf(f, "\n  FITLLM_CUDA_Q4=scratch|tc|fp32 (environment): a bf16-true run's QLoRA 4-bit matmuls:\n"
               "               scratch (default) = NF4/FP4 dequantized into a bf16 panel, then cuBLASLt (bf16 operands, as\n"
               "               bitsandbytes with a bf16 compute dtype); tc = EXPERIMENTAL: tensor cores, dequantized in the\n"
               "               GEMM's load; fp32 = the fp32 kernels (exact fp32 products, slow). Other precisions: fp32\n");
    fprintf(f, "\n  FITLLM_CUDA_Q4X16=1|0 (environment): 1 (default) = EXPERIMENTAL: under FITLLM_CUDA_Q4=scratch|tc the\n"
               "               4-bit linears read their input's and their dy's stored bf16 copies (fp32 copies nothing\n"
               "               else reads not written or allocated; the same values, and the same bits where a weight\n"
               "               is one scratch panel either way); 0 = their fp32 values (A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_Q4_STACK=1|0 (environment): 1 (default) = EXPERIMENTAL: scratch dequantizes a fused\n"
               "               output's 4-bit parts (q|k|v, gate|up) side by side and multiplies them in one GEMM (not yet\n"
               "               timed on a GPU); 0 = one GEMM per part (A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_PREFETCH=1|0 (environment): 1 (default) = EXPERIMENTAL: the next micro-batch's ids and\n"
               "               targets uploaded ahead on a second stream while the current one computes (inside the\n"
               "               graphs under FITLLM_CUDA_GRAPHS=1); 0 = uploaded on the stream before each micro-batch\n");
    fprintf(f, "\n  FITLLM_CUDA_VIEWS32=0|1 (environment): 0 (default) = EXPERIMENTAL: a bf16 run's stored activations whose\n"
               "               fp32 copy nothing reads are written in bf16 only and that copy is not allocated (less\n"
               "               WORKSPACE; the same values); 1 = every fp32 copy kept (A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_STREAM16=1|0 (environment): 1 (default) = EXPERIMENTAL: under bf16 storage the residual adds\n"
               "               read the stream's stored bf16 rows, so its fp32 rows take one buffer, not three (less\n"
               "               WORKSPACE and traffic; the same bits); 0 = the fp32 rows as before (A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_RESGEMM=1|0 (environment): 1 (default) = EXPERIMENTAL: under bf16 storage with the stream in\n"
               "               bf16, LLaMA's o and down GEMMs write the residual sum's bf16 rows themselves (cuBLASLt's C\n"
               "               the stored residual, D the sum: less traffic; the same bits); 0 = their fp32 outputs,\n"
               "               then the add (A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_XBLOCK_NORM=0|1 (environment): 1 (default) = EXPERIMENTAL: under bf16 storage a block's last\n"
               "               residual add runs fused with the next block's first norm (or the final norm), one launch\n"
               "               (the same bits); 0 = each block does its own add (A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_DW16=0|1 (environment): 1 (default) = EXPERIMENTAL: under bf16-true a block's bias-free\n"
               "               linears' (LLaMA's, T5's) dW GEMMs add into the bf16 gradient in place, rounded once\n"
               "               (the same bits);\n"
               "               0 = staged in fp32, zeroed and added back by accumulate16 (A/B)\n");
    fprintf(f, "\n  FITLLM_CUDA_LORA16=1|0 (environment): 1 (default) = EXPERIMENTAL: LoRA / QLoRA with bf16 compute: a\n"
               "               frozen base's dx GEMM reads a bf16 dy written by the op that makes dy, and adapters\n"
               "               with dropout read their dropped copy, the input not widened (no conversion kernels;\n"
               "               the same bits); 0 = the GEMM rounds the fp32 dy, the input is widened first (A/B)\n");
    fprintf(f, "\nexit codes: 0 ok; 1 runtime error (I/O, a malformed file, a diverged run); 2 usage or configuration\n"
               "error (a bad value, a file or name that is not there, a request this build cannot do: the command\n"
               "must change); 3 out of memory; the training commands and lab: 130 SIGINT, 143 SIGTERM, 138 SIGUSR1\n");
}

int main(int argc, char **argv) {
    fl_cpu_process_init(argv); /* idle OpenMP workers sleep (may re-execute the program once) */
    if (argc < 2) { usage(stderr); return FL_EXIT_USAGE; }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) { usage(stdout); return 0; }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) return version();
    /* --accelerator auto (every command's default): the GPU when this build has CUDA and one is
     * visible; a command's --accelerator cpu|cuda overrides it. Not probed for --accelerator cpu:
     * probing a usable GPU opens the CUDA plugin and its libraries (~200 MB), which a CPU run never needs. */
    int cpu_asked = 0;
    fl_accel asked;
    for (int i = 2; i < argc; i++)
        cpu_asked |= (!strncmp(argv[i], "--accelerator=", 14) && !fl_accel_parse(argv[i] + 14, &asked) &&
                      asked == FL_ACCEL_CPU) ||
                     (i + 1 < argc && !strcmp(argv[i], "--accelerator") && !fl_accel_parse(argv[i + 1], &asked) &&
                      asked == FL_ACCEL_CPU);
    fl_accel use;
    if (!cpu_asked && fl_accel_resolve(FL_ACCEL_AUTO, &use) == FL_OK && use != FL_ACCEL_CPU)
        fl_backend_set_default_name(fl_accel_backend(use));
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++)
        if (!strcmp(argv[1], k_cmds[i].name)) {
            fl_cli_set_command(k_cmds[i].name); /* notes of shared helpers name it */
            return k_cmds[i].fn(argc - 1, argv + 1);
        }
    const char *names[sizeof k_cmds / sizeof k_cmds[0] + 4];
    size_t n = 0;
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++) names[n++] = k_cmds[i].name;
    names[n++] = "--version";
    names[n++] = "--help";
    names[n] = NULL;
    const char *near = fl_cli_nearest(argv[1], names);
    if (near) {
        fprintf(stderr, "fitllm: unknown %s '%s' (did you mean '%s'?)\n", argv[1][0] == '-' ? "option" : "command",
                argv[1], near);
        fprintf(stderr, "usage: fitllm <command> [options]   (fitllm --help lists the commands)\n");
        return FL_EXIT_USAGE;
    }
    fprintf(stderr, "fitllm: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return FL_EXIT_USAGE;
}
