/* fitllm generate: text generation with a KV cache, streaming the decoded text. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "fitllm/generate.h"
#include "fitllm/tokenizer.h"

#define DEFAULT_PROMPT "What food do llamas eat?" /* LitGPT's default */

static void help(void) {
    fl_gen_params d;
    fl_gen_params_default(&d);
    printf("usage: fitllm generate <model> [--prompt TEXT | --prompt-ids \"1 2 3\"] [options]\n\n"
           "  <model>                HF folder (config.json + safetensors), a Hugging Face repo id ORG/NAME\n"
           "                         (downloaded, `fitllm download --help`), llama2.c .bin, or preset name\n"
           "                         (presets are randomly initialized with --seed); or a PEFT adapter\n"
           "                         folder, e.g. a finetune_lora step-N/ checkpoint: its base model\n"
           "                         (base_model_name_or_path) with the adapter merged in memory\n"
           "  --prompt TEXT          prompt text, encoded with the tokenizer (BOS added as the tokenizer\n"
           "                         does by default) (default \"%s\")\n"
           "  --prompt-ids \"IDS\"     prompt as whitespace-separated token ids instead of text; the\n"
           "                         generated ids are printed (no tokenizer needed)\n"
           "  --max_new_tokens N     number of tokens to generate (default %d)\n"
           "  --temperature T        0 = greedy; else logits / T (default %.1f)\n"
           "  --top_k K              sample from the K most likely tokens; 0 = all (default %d)\n"
           "  --top_p P              nucleus sampling: the most likely tokens covering P (default %.1f)\n"
           "  --seed N               sampling seed (and preset init seed) (default %llu)\n"
           "  --adapter DIR          PEFT LoRA adapter merged into <model> in memory (an adapter folder,\n"
           "                         a finetune_lora checkpoint or run folder, as merge_lora takes)\n"
           "  --tokenizer PATH       tokenizer file or folder (default: the model folder; for a .bin model,\n"
           "                         tok512.bin next to it)\n"
           "  --threads N            CPU threads (default: all cores)\n"
           "  --accelerator A        auto|cpu|cuda (default auto: the GPU when this build has CUDA and one is\n"
           "                         visible, else the CPU). cuda is EXPERIMENTAL (single GPU; README)\n\n"
           "Stops at max_new_tokens, at an EOS token or at the model's context. The text streams to\n"
           "stdout as it is generated; timing (ms/token) goes to stderr. Dashes work too (--max-new-tokens).\n",
           DEFAULT_PROMPT, d.max_new_tokens, d.temperature, d.top_k, d.top_p, (unsigned long long)d.seed);
}

static fl_status parse_ids(const char *s, int32_t **out, int *n) {
    int cap = 16, k = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) return fl_errorf(FL_ERR_OOM, "out of host memory");
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == ',') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            free(ids);
            return fl_errorf(FL_ERR_INVALID, "--prompt-ids: '%s' is not a list of non-negative integers", s);
        }
        if (k == cap) {
            int32_t *q = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!q) { free(ids); return fl_errorf(FL_ERR_OOM, "out of host memory"); }
            ids = q;
        }
        ids[k++] = (int32_t)v;
        p = end;
    }
    if (k == 0) { free(ids); return fl_errorf(FL_ERR_INVALID, "--prompt-ids: no token ids"); }
    *out = ids;
    *n = k;
    return FL_OK;
}

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_adapter_dir(const char *p) {
    char q[4096 + 32];
    struct stat st;
    snprintf(q, sizeof q, "%s/adapter_config.json", p);
    return stat(q, &st) == 0 && S_ISREG(st.st_mode);
}

/* Default tokenizer: the model folder itself; for a .bin model, tok512.bin next to it. */
static void default_tokenizer(const char *model, char *buf, size_t n) {
    if (is_dir(model)) { snprintf(buf, n, "%s", model); return; }
    const char *slash = strrchr(model, '/');
    if (slash) snprintf(buf, n, "%.*s/tok512.bin", (int)(slash - model), model);
    else snprintf(buf, n, "tok512.bin");
}

/* Streaming: after each token, decode prompt + generated so far and print what
 * is new. A trailing U+FFFD (an incomplete UTF-8 sequence from byte-fallback
 * tokens) is held back until the next token completes it. */
typedef struct {
    const fl_tokenizer *tok;
    int32_t *all; /* prompt + generated */
    int n, cap;
    size_t printed;
    char *shown;  /* text printed so far (to check the prefix property) */
    double t_first;
    int count;
} stream_state;

static void stream_flush(stream_state *st, int final) {
    char *text = NULL;
    size_t len = 0;
    if (fl_tok_decode(st->tok, st->all, (size_t)st->n, 1, &text, &len) != FL_OK) return;
    size_t upto = len;
    if (!final && len >= 3 && !memcmp(text + len - 3, "\xEF\xBF\xBD", 3)) upto = len - 3;
    if (upto > st->printed && (!st->shown || !memcmp(text, st->shown, st->printed))) {
        fwrite(text + st->printed, 1, upto - st->printed, stdout);
        fflush(stdout);
        st->printed = upto;
        free(st->shown);
        st->shown = text;
        return;
    }
    free(text);
}

static int on_text(void *ud, int32_t id) {
    stream_state *st = ud;
    if (st->count++ == 0) st->t_first = fl_cli_now_ms();
    if (st->n < st->cap) st->all[st->n++] = id;
    stream_flush(st, 0);
    return 0;
}

static int on_id(void *ud, int32_t id) {
    stream_state *st = ud;
    if (st->count++ == 0) st->t_first = fl_cli_now_ms();
    printf(" %d", (int)id);
    fflush(stdout);
    return 0;
}

static int opt(const char *a, const char *under) {
    /* --max_new_tokens and --max-new-tokens */
    if (!strcmp(a, under)) return 1;
    char dash[64];
    snprintf(dash, sizeof dash, "%s", under);
    for (char *c = dash + 2; *c; c++)
        if (*c == '_') *c = '-';
    return !strcmp(a, dash);
}

int fl_cmd_generate(int argc, char **argv) {
    const char *cmd = "generate", *model_path = NULL, *prompt = NULL, *prompt_ids = NULL, *tok_path = NULL, *adapter = NULL;
    int threads = 0, seed = -1;
    fl_gen_params gp;
    fl_gen_params_default(&gp);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (opt(a, "--prompt") && v) { prompt = v; i++; }
        else if (opt(a, "--prompt_ids") && v) { prompt_ids = v; i++; }
        else if (opt(a, "--tokenizer") && v) { tok_path = v; i++; }
        else if (opt(a, "--adapter") && v) { adapter = v; i++; }
        else if (opt(a, "--max_new_tokens")) { if (fl_cli_int(cmd, a, v, 0, 1 << 30, &gp.max_new_tokens)) return 2; i++; }
        else if (opt(a, "--top_k")) { if (fl_cli_int(cmd, a, v, 0, 1 << 30, &gp.top_k)) return 2; i++; }
        else if (opt(a, "--temperature")) { if (fl_cli_float(cmd, a, v, &gp.temperature)) return 2; i++; }
        else if (opt(a, "--top_p")) { if (fl_cli_float(cmd, a, v, &gp.top_p)) return 2; i++; }
        else if (opt(a, "--seed")) { if (fl_cli_int(cmd, a, v, 0, 1 << 30, &seed)) return 2; i++; }
        else if (opt(a, "--threads")) { if (fl_cli_int(cmd, a, v, 0, 1024, &threads)) return 2; i++; }
        else if (opt(a, "--accelerator")) { int rc = fl_cli_accelerator(cmd, v); if (rc) return rc; i++; }
        else if (a[0] == '-') return fl_cli_usage(cmd, "unknown or incomplete option '%s'", a);
        else if (!model_path) model_path = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!model_path) return fl_cli_usage(cmd, "missing <model>");
    char named[FL_CLI_PATH], tok_named[FL_CLI_PATH]; /* Hugging Face repo ids: their downloaded folders */
    int named_rc = fl_cli_model_arg(cmd, &model_path, named, sizeof named);
    if (!named_rc && tok_path) named_rc = fl_cli_model_arg(cmd, &tok_path, tok_named, sizeof tok_named);
    if (named_rc) return named_rc;
    if (prompt && prompt_ids) return fl_cli_usage(cmd, "give --prompt or --prompt-ids, not both");
    if (seed >= 0) gp.seed = (uint64_t)seed;
    if (fl_gen_params_validate(&gp) != FL_OK) return fl_cli_usage(cmd, "%s", fl_error_message());
    if (!prompt_ids && !prompt) prompt = DEFAULT_PROMPT;

    fl_backend be;
    fl_mem_pool pool, hpool; /* tensors; host staging when the backend's memory is not host memory */
    fl_model m = {0};
    fl_kv_cache kv = {0};
    fl_tokenizer *tok = NULL;
    int32_t *ids = NULL, *out = NULL, *eos = NULL;
    stream_state st = {0};
    int n_ids = 0, loaded = 0, rc = 0;
    fl_status s = fl_backend_init_by_name(fl_backend_default_name(), &be, threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_pools_init(&be, &pool, &hpool, "cpu", 0)) != FL_OK) return fl_cli_fail(cmd, s, NULL);
    /* a PEFT adapter folder as <model> (a finetune_lora step-N/): its base with it merged */
    const char *base = model_path;
    if (!adapter && is_adapter_dir(model_path)) {
        adapter = model_path;
        base = NULL;
    }
    fl_cli_adapter_info info;
    char hint[FL_CLI_PATH + 64];
    snprintf(hint, sizeof hint, "`fitllm generate <base_dir> --adapter %s`", model_path);
    /* the model first: a broken config.json is reported as the model's, not as a tokenizer
     * problem (the tokenizer also reads config.json for its special ids) */
    if ((s = adapter ? fl_cli_load_with_adapter(&m, base, adapter, hint, &be, &pool, &loaded, &info)
                     : fl_cli_load_model(&m, model_path, 0, gp.seed, &be, &pool, &loaded)) != FL_OK)
        goto fail;
    if (adapter && !base)
        fprintf(stderr, "fitllm generate: %s is a LoRA adapter: base model %s with it merged in memory\n", info.adapter,
                info.base);
    if (prompt_ids) {
        if ((s = parse_ids(prompt_ids, &ids, &n_ids)) != FL_OK) goto fail;
    } else {
        char tp[4096];
        const char *ts;
        if (tok_path) snprintf(tp, sizeof tp, "%s", tok_path);
        else if (adapter && (ts = fl_cli_adapter_tokenizer(&info, tp, sizeof tp)) != NULL) snprintf(tp, sizeof tp, "%s", ts);
        else default_tokenizer(base ? base : info.base, tp, sizeof tp);
        if ((s = fl_tok_load(&tok, tp)) != FL_OK) {
            s = fl_error_prefix(s, "loading the tokenizer (--tokenizer PATH, or --prompt-ids)");
            goto fail;
        }
        size_t n = 0;
        if ((s = fl_tok_encode(tok, prompt, strlen(prompt), -1, 0, &ids, &n)) != FL_OK) goto fail;
        n_ids = (int)n;
        if (n_ids == 0) {
            s = fl_errorf(FL_ERR_INVALID, "the prompt encodes to no tokens (and the tokenizer adds no BOS)");
            goto fail;
        }
    }
    if (tok && fl_tok_vocab_size(tok) > m.cfg.vocab_size) {
        s = fl_errorf(FL_ERR_INVALID, "tokenizer vocabulary (%d) is larger than the model's (%d)", fl_tok_vocab_size(tok),
                      m.cfg.vocab_size);
        goto fail;
    }
    for (int i = 0; i < n_ids; i++)
        if (ids[i] >= m.cfg.vocab_size) {
            s = fl_errorf(FL_ERR_INVALID, "prompt token id %d is outside the model's vocabulary [0, %d)", (int)ids[i],
                          m.cfg.vocab_size);
            goto fail;
        }
    /* The cache holds prompt + new tokens (LitGPT's max_returned_tokens), capped at the context. */
    long want = (long)n_ids + gp.max_new_tokens;
    int cap_T = want < m.cfg.max_seq ? (int)want : m.cfg.max_seq;
    if (n_ids > m.cfg.max_seq) {
        s = fl_errorf(FL_ERR_INVALID, "prompt of %d tokens exceeds the model's context of %d", n_ids, m.cfg.max_seq);
        goto fail;
    }
    if ((s = fl_kv_cache_init(&kv, &m, cap_T)) != FL_OK) goto fail;
    if (!(out = malloc(((size_t)gp.max_new_tokens + 1) * sizeof *out))) { s = fl_errorf(FL_ERR_OOM, "out of host memory"); goto fail; }
    /* every EOS id of the tokenizer (some have several, e.g. <|eot_id|> and <|end_of_text|>) */
    int n_eos = 0;
    if (tok) {
        int tv = fl_tok_vocab_size(tok);
        if (!(eos = malloc((size_t)tv * sizeof *eos))) { s = fl_errorf(FL_ERR_OOM, "out of host memory"); goto fail; }
        for (int32_t i = 0; i < tv; i++)
            if (fl_tok_is_eos(tok, i)) eos[n_eos++] = i;
    }
    st.tok = tok;
    if (tok) {
        st.cap = n_ids + gp.max_new_tokens;
        if (!(st.all = malloc((size_t)st.cap * sizeof *st.all))) { s = fl_errorf(FL_ERR_OOM, "out of host memory"); goto fail; }
        memcpy(st.all, ids, (size_t)n_ids * sizeof *ids);
        st.n = n_ids;
        stream_flush(&st, 0); /* the prompt */
    } else {
        for (int i = 0; i < n_ids; i++) printf(i ? " %d" : "%d", (int)ids[i]);
        fflush(stdout);
    }
    if (!loaded) fprintf(stderr, "fitllm generate: note: %s is randomly initialized (seed %llu)\n", model_path,
                         (unsigned long long)gp.seed);
    double t0 = fl_cli_now_ms();
    int n_out = 0;
    fl_gen_stop why;
    s = fl_generate(&m, &kv, ids, n_ids, &gp, eos, n_eos, out, &n_out, &why, tok ? on_text : on_id, &st);
    double t1 = fl_cli_now_ms();
    if (tok) stream_flush(&st, 1);
    printf("\n");
    fflush(stdout); /* the text and its newline before the statistics on stderr, also when both go to one file */
    if (s != FL_OK) goto fail;
    static const char *const k_why[] = {"max_new_tokens", "EOS", "context limit", "callback"};
    double prefill_ms = st.count ? st.t_first - t0 : t1 - t0;
    fprintf(stderr, "%d prompt + %d new tokens (stop: %s); prefill %.1f ms, %.2f ms/token (%.1f tok/s), %d threads\n",
            n_ids, n_out, k_why[why], prefill_ms, n_out > 1 ? (t1 - st.t_first) / (n_out - 1) : 0.0,
            n_out > 1 ? (n_out - 1) * 1e3 / (t1 - st.t_first) : 0.0, be.n_threads);
    goto done;
fail:
    rc = fl_cli_fail(cmd, s, &pool);
done:
    free(st.all);
    free(st.shown);
    free(out);
    free(eos);
    free(ids);
    fl_tok_free(tok);
    fl_kv_cache_free(&kv);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return rc;
}
