/* fitllm loss: mean next-token cross-entropy of a model on a token file (an encoder-decoder: of a target given a
 * source). */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/trainer.h"

static void help(void) {
    printf("usage: fitllm loss <model> --tokens-file ids.txt [--target-tokens-file tgt.txt] [--dump-logits out.f32]\n"
           "                  [--image FILE] [--threads N]\n\n"
           "  <model>              HF folder (config.json + safetensors or pytorch_model*.bin; or LitGPT's\n"
           "                       lit_model.pth), a run folder (its final/, else its newest committed\n"
           "                       step-N/, as generate takes it; a finetune_lora step or adapter folder: its\n"
           "                       base with the PEFT adapter merged in memory, as generate), a Hugging Face repo\n"
           "                       id ORG/NAME (downloaded,\n"
           "                       `fitllm download --help`), llama2.c .bin, or preset name\n"
           "                       (presets are randomly initialized: --seed)\n"
           "  --tokens-file FILE   whitespace-separated token ids (at least 2; an encoder-decoder's source: 1)\n"
           "  --target-tokens-file FILE  an encoder-decoder (T5): the target's token ids (at least 1)\n"
           "  --image FILE         a BLIP-2 folder (model_type blip-2): the image (JPEG / PNG, preprocessed by the\n"
           "                       folder's preprocessor_config.json); --tokens-file is the caption (BOS first):\n"
           "                       the mean cross-entropy of caption[1:] after the query tokens; the Flan-T5\n"
           "                       variant: --tokens-file is the source after the query tokens, the loss is\n"
           "                       of --target-tokens-file's ids\n"
           "  --dump-logits FILE   write the logits of positions 0..n-2 as little-endian float32, (n-1) x V\n"
           "  --threads N          CPU threads (default: all cores)\n"
           "  --accelerator A      auto|cpu|cuda (default auto: the GPU when this build has CUDA and one is\n"
           "                       visible, else the CPU). cuda is EXPERIMENTAL (single GPU; README)\n"
           "  --seed N             seed for presets (default 1337)\n\n"
           "Prints the mean cross-entropy of tokens[1:] given tokens[:-1], and perplexity. An encoder-decoder\n"
           "(T5): of the target given the source (labels = the target, decoder input = the decoder start\n"
           "token of config.json, then the target but its last token); --dump-logits writes the target's rows.\n");
}

static fl_status read_tokens(const char *path, int min, int32_t **out, int *n) {
    if (fl_fs_is_dir(path)) return fl_errorf(FL_ERR_INVALID, "%s: is a folder, not a file", path);
    FILE *f = fopen(path, "r");
    if (!f) return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    int cap = 1024, k = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    char tok[64];
    fl_status s = FL_OK;
    while (ids && fscanf(f, "%63s", tok) == 1) {
        char *end;
        errno = 0;
        long v = strtol(tok, &end, 10);
        if (errno || *end || v < 0 || v > INT32_MAX) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: token %d ('%s') is not a non-negative integer", path, k + 1, tok);
            break;
        }
        if (k == cap) {
            int32_t *p = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!p) break;
            ids = p;
        }
        ids[k++] = (int32_t)v;
    }
    fclose(f);
    if (!ids) return fl_errorf(FL_ERR_OOM, "%s: out of host memory", path);
    if (s == FL_OK && k < min)
        s = fl_errorf(FL_ERR_FORMAT, "%s: needs at least %d token id%s, found %d", path, min, min > 1 ? "s" : "", k);
    if (s != FL_OK) { free(ids); return s; }
    *out = ids;
    *n = k;
    return FL_OK;
}

/* An encoder-decoder's loss of tgt (nt ids) given src (ns): labels tgt, decoder input start + tgt[:-1]; the (nt, V)
 * logits into logits (may be NULL). */
static fl_status s2s_loss(fl_model *m, const int32_t *src, int ns, const int32_t *tgt, int nt, float *logits) {
    int32_t *dec = malloc((size_t)nt * sizeof *dec);
    if (!dec) return fl_errorf(FL_ERR_OOM, "decoder input: out of host memory");
    dec[0] = m->cfg.dec_start_id;
    memcpy(dec + 1, tgt, (size_t)(nt - 1) * sizeof *dec);
    fl_status s = fl_model_alloc_acts_s2s(m, 1, ns, nt);
    if (s == FL_OK) s = fl_model_forward_s2s(m, src, NULL, dec, tgt, 1, ns, nt, 0.0f, logits);
    free(dec);
    return s;
}

int fl_cmd_loss(int argc, char **argv) {
    const char *cmd = "loss", *model_path = NULL, *tokens = NULL, *dump = NULL, *target = NULL, *image = NULL;
    int threads = 0, seed = 1337;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--tokens-file") && i + 1 < argc) tokens = argv[++i];
        else if (!strcmp(a, "--target-tokens-file") && i + 1 < argc) target = argv[++i];
        else if (!strcmp(a, "--dump-logits") && i + 1 < argc) dump = argv[++i];
        else if (!strcmp(a, "--image") && i + 1 < argc) image = argv[++i];
        else if (!strcmp(a, "--threads")) { if (fl_cli_threads(cmd, i + 1 < argc ? argv[++i] : NULL, 1024, &threads)) return 2; }
        else if (!strcmp(a, "--accelerator")) { int rc = fl_cli_accelerator(cmd, i + 1 < argc ? argv[++i] : NULL); if (rc) return rc; }
        else if (!strcmp(a, "--seed")) { if (fl_cli_int(cmd, a, i + 1 < argc ? argv[++i] : NULL, 0, 1 << 30, &seed)) return 2; }
        else if (a[0] == '-') return fl_cli_unknown_option(cmd, a, (const char *const[]){"--accelerator", "--dump-logits", "--help", "--image", "--seed", "--target-tokens-file", "--threads", "--tokens-file", NULL});
        else if (!model_path) model_path = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!model_path) return fl_cli_usage(cmd, "missing <model>");
    if (!tokens) return fl_cli_usage(cmd, "missing --tokens-file");
    char resolved[FL_CLI_PATH], note[FL_CLI_PATH + 128]; /* a run folder: its final/ or newest step, as generate's */
    if (fl_cli_run_folder(model_path, resolved, sizeof resolved, note, sizeof note) != FL_OK) {
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return FL_EXIT_USAGE;
    }
    if (note[0]) fprintf(stderr, "fitllm %s: %s\n", cmd, note);
    model_path = resolved;

    fl_backend be;
    fl_mem_pool pool, hpool; /* tensors; host staging when the backend's memory is not host memory */
    fl_model m = {0};
    int32_t *ids = NULL, *tids = NULL;
    float *logits = NULL;
    int n = 0, nt = 0, loaded = 0, rc = 0;
    fl_status s = fl_backend_init_by_name(fl_backend_default_name(), &be, threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_pools_init(&be, &pool, &hpool, "cpu", 0)) != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = read_tokens(tokens, target ? 1 : 2, &ids, &n)) != FL_OK) goto fail;
    if (target && (s = read_tokens(target, 1, &tids, &nt)) != FL_OK) goto fail;
    if (image && dump) {
        s = fl_errorf(FL_ERR_INVALID, "--image: --dump-logits is not built for BLIP-2 yet");
        goto fail;
    }
    if (image) {
        rc = fl_cli_blip2_loss(cmd, model_path, image, ids, n, tids, nt, &be, &pool);
        goto done;
    }
    char ac[FL_CLI_PATH + 32];
    snprintf(ac, sizeof ac, "%s/adapter_config.json", model_path);
    if (fl_fs_is_file(ac)) { /* a PEFT adapter (a finetune_lora step-N/): its base with it merged, as generate does */
        fl_cli_adapter_info info;
        char hint[FL_CLI_PATH + 64];
        snprintf(hint, sizeof hint, "`fitllm merge_lora %s --base <base_dir>`, then the loss of its output", model_path);
        if ((s = fl_cli_load_with_adapter(&m, NULL, model_path, hint, &be, &pool, &loaded, &info)) != FL_OK) goto fail;
        fprintf(stderr, "fitllm %s: %s is a LoRA adapter: base model %s with it merged in memory\n", cmd, info.adapter,
                info.base);
    } else if ((s = fl_cli_load_model(&m, model_path, 0, (uint64_t)seed, &be, &pool, &loaded)) != FL_OK)
        goto fail;
    if (fl_model_is_s2s(&m.cfg) != (target != NULL)) {
        s = fl_errorf(FL_ERR_INVALID, target ? "--target-tokens-file: %s is not an encoder-decoder (its loss is of "
                                               "--tokens-file alone)"
                                             : "%s is an encoder-decoder: give the target with --target-tokens-file "
                                               "(--tokens-file is the source)", model_path);
        goto fail;
    }
    /* ids outside the vocabulary: the file and the token's place in it, counted as read_tokens counts (from 1) */
    for (int f = 0; f < (target ? 2 : 1) && s == FL_OK; f++) {
        const int32_t *v = f ? tids : ids;
        for (int k = 0; k < (f ? nt : n); k++)
            if (v[k] >= m.cfg.vocab_size) {
                s = fl_errorf(FL_ERR_INVALID, "%s: token %d (id %d) is outside %s's vocabulary [0, %d)", f ? target : tokens,
                              k + 1, (int)v[k], model_path, m.cfg.vocab_size);
                break;
            }
    }
    if (s != FL_OK) goto fail;
    int T = target ? nt : n - 1;
    if (!target && T > m.cfg.max_seq) {
        s = fl_errorf(FL_ERR_INVALID, "%s: %d positions exceed the model's context of %d", tokens, T, m.cfg.max_seq);
        goto fail;
    }
    if (!target && (s = fl_model_alloc_acts(&m, 1, T)) != FL_OK) goto fail;
    if (dump && (s = fl_mem_alloc(fl_mem_host_pool(&pool), FL_TAG_OTHER, (size_t)T * m.cfg.vocab_size * sizeof(float), (void **)&logits)) != FL_OK)
        goto fail;
    if (target) s = s2s_loss(&m, ids, n, tids, nt, logits);
    else s = fl_model_forward(&m, ids, ids + 1, 1, T, 0.0f, logits);
    if (s != FL_OK) goto fail;
    double loss = m.loss_sum / (double)m.n_valid;
    printf("loss %.6f  ppl %.4f  tokens %d  model %s%s\n", loss, fl_trainer_perplexity(loss), T, model_path,
           loaded ? "" : " (random init)");
    if (dump) {
        /* a file: through dump.tmp, renamed; a device or a pipe (/dev/stdout, a FIFO): written in place */
        s = fl_fs_write_file_atomic(dump, logits, (size_t)T * m.cfg.vocab_size * sizeof(float));
        if (s != FL_OK) {
            s = fl_error_prefix(s, "cannot write logits");
            goto fail;
        }
        printf("logits (%d x %d float32) written to %s\n", T, m.cfg.vocab_size, dump);
    }
    goto done;
fail:
    rc = fl_cli_fail(cmd, s, &pool);
done:
    fl_mem_free(fl_mem_host_pool(&pool), logits);
    free(ids);
    free(tids);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return rc;
}
