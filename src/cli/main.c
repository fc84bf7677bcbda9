/* fitllm command-line entry point: dispatches to the subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} k_cmds[] = {
    {"finetune_full", fl_cmd_finetune_full, "full fine-tuning of a model (LitGPT options and YAML recipes)"},
    {"pretrain", fl_cmd_pretrain, "train a model from scratch or continue pretraining"},
    {"finetune_lora", fl_cmd_finetune_lora, "LoRA fine-tuning: PEFT adapters on a frozen base"},
    {"finetune", fl_cmd_finetune_lora, "alias of finetune_lora"},
    {"merge_lora", fl_cmd_merge_lora, "merge a PEFT LoRA adapter into its base model (HF folder out)"},
    {"plan", fl_cmd_plan, "predict memory per tag and phase, the verdict on a device, what to try (no run)"},
    {"lab", fl_cmd_lab, "run the memory lab's experiments on scaled models; table, report, CSV/JSON, charts"},
    {"demo", fl_cmd_demo, "short real training run on a built-in model with synthetic data + memory report"},
    {"loss", fl_cmd_loss, "mean next-token cross-entropy of a model on token ids (optionally dump logits)"},
    {"tokenize", fl_cmd_tokenize, "encode text to token ids or decode ids to text (tokenizer.json/.model/llama2.c .bin)"},
    {"generate", fl_cmd_generate, "generate text from a prompt with a KV cache (greedy, temperature, top-k, top-p)"},
    {"bench-step", fl_cmd_bench_step, "time full training steps (median ms/step, tok/s, GFLOP/s, memory report)"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: fitllm <command> [options]   (fitllm <command> --help for its options)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++) fprintf(f, "  %-12s %s\n", k_cmds[i].name, k_cmds[i].help);
    fprintf(f, "\nexit codes: 0 ok, 1 runtime error, 2 usage error, 3 out of memory\n");
}

int main(int argc, char **argv) {
    fl_cpu_process_init(argv); /* idle OpenMP workers sleep (may re-execute the program once) */
    if (argc < 2) { usage(stderr); return FL_EXIT_USAGE; }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) { usage(stdout); return 0; }
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++)
        if (!strcmp(argv[1], k_cmds[i].name)) return k_cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "fitllm: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return FL_EXIT_USAGE;
}
