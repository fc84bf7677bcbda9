/* fitllm convert: a model folder in any weight format fitllm reads (Hugging Face
 * safetensors, pytorch_model.bin or its shards, LitGPT lit_model.pth) written as a
 * Hugging Face safetensors folder; the work is fl_hf_convert (src/io/convert.c). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fitllm/torch_ckpt.h"

static void help(void) {
    printf("usage: fitllm convert <src_dir> <dst_dir> [--max-shard-size SIZE]\n\n"
           "  <src_dir>              a model folder: config.json with model.safetensors (or its shards),\n"
           "                         pytorch_model.bin (or pytorch_model-*.bin + pytorch_model.bin.index.json),\n"
           "                         or LitGPT's lit_model.pth\n"
           "  <dst_dir>              the new Hugging Face folder (must not exist; written beside itself\n"
           "                         and renamed into place, so a failure or a stop (Ctrl-C, SIGTERM: exit\n"
           "                         130, 143) leaves nothing)\n"
           "  --max-shard-size SIZE  shard above SIZE bytes (suffix KB, MB, GB as 1000s; default 5GB, as\n"
           "                         save_pretrained): model-0000i-of-0000N.safetensors + index\n\n"
           "Tensors keep their dtype on disk (bf16 stays bf16) and are streamed from the mapped source;\n"
           "config.json and the tokenizer/generation files are copied unchanged. PyTorch files are read\n"
           "by a restricted unpickler: nothing in them is executed (docs/ARCHITECTURE.md).\n");
}

/* "5GB", "100MB", "4096": bytes (decimal units, as transformers' "5GB"); 0 when invalid. */
static size_t parse_size(const char *v) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || x <= 0) return 0;
    double mul = 1;
    if (!strcmp(end, "KB") || !strcmp(end, "kB")) mul = 1e3;
    else if (!strcmp(end, "MB")) mul = 1e6;
    else if (!strcmp(end, "GB")) mul = 1e9;
    else if (*end) return 0;
    x *= mul;
    return x >= 1 && x < 1e18 ? (size_t)x : 0;
}

int fl_cmd_convert(int argc, char **argv) {
    const char *cmd = "convert", *src = NULL, *dst = NULL;
    size_t shard = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--max-shard-size") || !strcmp(a, "--max_shard_size")) {
            if (!v || !(shard = parse_size(v))) return fl_cli_usage(cmd, "%s needs a size such as 5GB or 200MB (got '%s')", a, v ? v : "");
            i++;
        } else if (a[0] == '-') return fl_cli_usage(cmd, "unknown option '%s'", a);
        else if (!src) src = a;
        else if (!dst) dst = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!src || !dst) return fl_cli_usage(cmd, "needs <src_dir> and <dst_dir>");
    fl_hf_set_max_shard_bytes(shard);
    int n = 0;
    /* Ctrl-C / SIGTERM: the folder under way removed, nothing written (dst appears whole or not at all) */
    const fl_cli_signals sigs = {.cmd = cmd, .threads = 1, .first_stops = 1};
    fl_cli_signals_begin(&sigs);
    fl_status s = fl_hf_convert(src, dst, &n);
    fl_cli_signals_end();
    fl_hf_set_max_shard_bytes(0);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    printf("converted %s -> %s (%d tensors, safetensors)\n", src, dst, n);
    return 0;
}
