/* fitllm convert: a model folder in any weight format fitllm reads (Hugging Face
 * safetensors, pytorch_model.bin or its shards, LitGPT lit_model.pth) or a llama2.c .bin
 * written as a Hugging Face safetensors folder; the work is fl_hf_convert (src/io/convert.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fitllm/io.h"
#include "fitllm/mem.h"
#include "fitllm/torch_ckpt.h"

static void help(void) {
    printf("usage: fitllm convert <src_dir|model.bin> <dst_dir> [--max-shard-size SIZE]\n\n"
           "  <src_dir>              a model folder: config.json with model.safetensors (or its shards),\n"
           "                         pytorch_model.bin (or pytorch_model-*.bin + pytorch_model.bin.index.json),\n"
           "                         or LitGPT's lit_model.pth; or a llama2.c .bin (stories260K.bin): its\n"
           "                         tokenizer is the tok*.bin / tokenizer files of its folder, copied\n"
           "  <dst_dir>              the new Hugging Face folder (must not exist; written beside itself\n"
           "                         and renamed into place, so a failure or a stop (Ctrl-C, SIGTERM: exit\n"
           "                         130, 143) leaves nothing)\n"
           "  --max-shard-size SIZE  shard above SIZE (a unit is required: KB, MB, GB as 1000s, KiB, MiB,\n"
           "                         GiB as 1024s, B bytes; default 5GB, as save_pretrained):\n"
           "                         model-0000i-of-0000N.safetensors + index\n\n"
           "Tensors keep their dtype on disk (bf16 stays bf16) and are streamed from the mapped source;\n"
           "config.json is copied with its torch_dtype / dtype set to the tensors' dtype, the tokenizer and\n"
           "generation files unchanged. A llama2.c .bin is loaded as generate loads it (the RoPE rows in\n"
           "Hugging Face's order) and written as float32 with a new config.json. PyTorch files are read\n"
           "by a restricted unpickler: nothing in them is executed (docs/ARCHITECTURE.md).\n");
}

int fl_cmd_convert(int argc, char **argv) {
    const char *cmd = "convert", *src = NULL, *dst = NULL;
    size_t shard = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--max-shard-size") || !strcmp(a, "--max_shard_size")) {
            /* the sizes of --max-memory (fl_parse_bytes): a unit required, GB / GiB as save_pretrained's "5GB" / "5GiB" */
            char why[300];
            if (!v || fl_parse_bytes(v, &shard) || !shard)
                return fl_cli_usage(cmd, "%s needs a size such as 5GB, 5GiB or 200MB: %s", a,
                                    v && fl_parse_bytes(v, &shard) == 0 ? "0 bytes would put no tensor in a shard"
                                                                        : fl_bytes_refusal(v, why, sizeof why));
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
    if (!fl_io_has_tokenizer(dst)) /* a llama2.c .bin alone, or a folder without one */
        printf("note: no tokenizer beside %s: %s has none (generate takes --tokenizer PATH; llama2.c's tok512.bin "
               "comes with its repository)\n", src, dst);
    return 0;
}
