/* fitllm generate: text generation with a KV cache, streaming the decoded text. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "fitllm/checkpoint.h"
#include "fitllm/generate.h"
#include "fitllm/io.h"
#include "fitllm/tokenizer.h"

#define DEFAULT_PROMPT "What food do llamas eat?" /* LitGPT's default */

static void help(void) {
    fl_gen_params d;
    fl_gen_params_default(&d);
    printf("usage: fitllm generate <model> [--prompt TEXT | --prompt-ids \"1 2 3\"] [options]\n\n"
           "  <model>                what to generate with:\n"
           "                         - a Hugging Face folder (config.json + safetensors or pytorch_model*.bin, or\n"
           "                           LitGPT's lit_model.pth), e.g. a run's final/\n"
           "                           or a full fine-tuning step-N/ checkpoint, or a llama2.c .bin\n"
           "                         - a run folder (out/finetune/full, out/finetune/lora): its final/ (a LoRA\n"
           "                           run's: the merged model), else its newest committed step-N/\n"
           "                         - a PEFT adapter folder, e.g. a finetune_lora step-N/ checkpoint or a\n"
           "                           LoRA run folder without final/ yet: its base model\n"
           "                           (base_model_name_or_path) with the adapter merged in memory\n"
           "                         - a Hugging Face repo id ORG/NAME: its download (checkpoints/ORG/NAME or\n"
           "                           the Hugging Face cache; `fitllm download --help`)\n"
           "                         - a preset name (micro, gpt2, ...): random initialization with --seed\n"
           "                           and the built-in byte tokenizer (noise: for trying the pipeline)\n"
           "  --prompt TEXT          prompt text, encoded with the tokenizer (BOS added as the tokenizer\n"
           "                         does by default) (default \"%s\")\n"
           "  --prompt-ids \"IDS\"     prompt as whitespace-separated token ids instead of text; the\n"
           "                         generated ids are printed (no tokenizer needed)\n"
           "  --max_new_tokens N     number of tokens to generate (default %d; 0: none, the prompt printed,\n"
           "                         an encoder-decoder's output empty)\n"
           "  --temperature T        0 = greedy; else logits / T (default %.1f)\n"
           "  --top_k K              sample from the K most likely tokens; 0 = all (default %d)\n"
           "  --top_p P              nucleus sampling: the most likely tokens covering P (default %.1f)\n"
           "  --seed N               sampling seed (and preset init seed) (default %llu)\n"
           "  --adapter DIR          PEFT LoRA adapter merged into <model> in memory (an adapter folder,\n"
           "                         a finetune_lora checkpoint or run folder, as merge_lora takes; with --image\n"
           "                         a BLIP-2 adapter on its BLIP-2 base)\n"
           "  --tokenizer PATH       tokenizer file or folder, or \"bytes\" for the built-in byte tokenizer\n"
           "                         (default: the model folder's, which every fitllm checkpoint carries,\n"
           "                         the byte tokenizer as tokenizer.json included; for an adapter, its base's\n"
           "                         or its own; for a .bin model, tok512.bin next to it; for a preset, bytes)\n"
           "  --threads N            CPU threads (default: all cores)\n"
           "  --accelerator A        auto|cpu|cuda (default auto: the GPU when this build has CUDA and one is\n"
           "                         visible, else the CPU). cuda is EXPERIMENTAL (single GPU; README)\n\n"
           "Stops at max_new_tokens, at an EOS id or at the model's context. The EOS ids: generation_config.json's\n"
           "eos_token_id (an id or a list, as transformers), else config.json's, and the tokenizer's; the\n"
           "statistics line names them. A prompt as long as the context or longer is exit 2 (no position for a\n"
           "new token); with --max_new_tokens 0 any prompt is printed as it is (nothing run). The text streams\n"
           "to stdout as it is generated; the statistics (prefill time, ms/token) go to stderr. Dashes work\n"
           "too (--max-new-tokens).\n"
           "A <model> that names nothing is exit 2: \"no such folder: PATH\", or neither a folder nor a preset\n"
           "(with the nearest preset names).\n"
           "--image FILE: <model> is a BLIP-2 folder (model_type blip-2): the image (JPEG / PNG, preprocessed\n"
           "by its preprocessor_config.json) is captioned greedily (the default here), after --prompt's text (its\n"
           "tokenizer) or --prompt-ids when given; the new ids (or, with a tokenizer, their text) print at the end;\n"
           "it stops as above (the OPT variant's context holds the image's query tokens, BOS and the prompt too).\n"
           "An encoder-decoder (T5): the prompt is the source, decoded with the decoder's KV cache, greedily\n"
           "(--temperature 0) or sampled (--temperature, --top_k, --top_p, --seed); the generated ids (or text)\n"
           "print at the end. Several --prompt (up to 256; an encoder-decoder only) are decoded as one batch, the\n"
           "sources padded to the longest and masked there; one line of text per prompt, in order.\n",
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

/* Default tokenizer: the model folder itself; for a .bin model, tok512.bin next to it (else its
 * folder: another tok*.bin). */
static void default_tokenizer(const char *model, char *buf, size_t n) {
    if (is_dir(model)) { snprintf(buf, n, "%s", model); return; }
    const char *slash = strrchr(model, '/');
    if (slash) snprintf(buf, n, "%.*s/tok512.bin", (int)(slash - model), model);
    else snprintf(buf, n, "tok512.bin");
    struct stat st;
    if (stat(buf, &st) != 0) {
        if (slash) snprintf(buf, n, "%.*s", (int)(slash - model), model);
        else snprintf(buf, n, ".");
    }
}

/* What <model> names. A run folder (no config.json, no adapter_config.json) becomes its final/,
 * else its newest committed step-N/; a path that is not there is said to be so, apart from a
 * preset name (which may look like a path: Hugging Face ids such as meta-llama/Llama-3.2-1B). */
typedef struct {
    char path[FL_CLI_PATH]; /* what to load */
    int preset;             /* 1: a preset name (random init, built-in byte tokenizer) */
    char note[FL_CLI_PATH + 128]; /* how a run folder was resolved ("" none) */
} gen_model;

static int looks_like_path(const char *a) {
    size_t n = strlen(a);
    return strchr(a, '/') || a[0] == '.' || a[0] == '~' || (n > 4 && !strcmp(a + n - 4, ".bin")) ||
           (n > 5 && !strcmp(a + n - 5, ".json")) || (n > 12 && !strcmp(a + n - 12, ".safetensors"));
}

static fl_status resolve_model(const char *arg, gen_model *g) {
    struct stat st;
    fl_model_config mc;
    memset(g, 0, sizeof *g);
    if (strlen(arg) >= FL_CLI_PATH - 64) return fl_errorf(FL_ERR_INVALID, "%s: path too long", arg);
    snprintf(g->path, sizeof g->path, "%s", arg);
    if (stat(arg, &st) != 0) {
        if (fl_preset_find(arg, &mc) == FL_OK) {
            g->preset = 1;
            return FL_OK;
        }
        if (looks_like_path(arg)) {
            size_t n = strlen(arg);
            int file = (n > 4 && !strcmp(arg + n - 4, ".bin")) || (n > 12 && !strcmp(arg + n - 12, ".safetensors"));
            return fl_errorf(FL_ERR_NOT_FOUND, "no such %s: %s", file ? "file" : "folder", arg);
        }
        char why[1024]; /* copy first: fl_errorf rewrites the message buffer it would read */
        snprintf(why, sizeof why, "%s", fl_error_message());
        return fl_errorf(FL_ERR_NOT_FOUND, "'%s' is neither a folder nor a model preset (%s)", arg, why);
    }
    return fl_cli_run_folder(arg, g->path, sizeof g->path, g->note, sizeof g->note);
}

/* Says, first, when no weights were loaded (a preset, or an adapter on a preset base), as
 * training says it for a preset. */
static void say_init(const gen_model *gm, const fl_cli_adapter_info *info, int loaded, uint64_t seed,
                     const char *tok_path) {
    if (loaded) return;
    char why[2 * FL_CLI_PATH + 512], hint[FL_CLI_PATH + 128];
    if (info) {
        snprintf(why, sizeof why, "the adapter's base '%s' is a model preset, initialized with seed 1337 (a run's "
                 "default --seed; the run's final/ holds the weights it trained on)", info->base);
        fl_cli_note_random("generate", why);
    } else if (!gm->preset) {
        fprintf(stderr, "fitllm generate: no weights were loaded: %s is a model shape only (config.json)\n", gm->path);
    } else {
        fl_cli_preset_weights_hint(gm->path, hint, sizeof hint);
        snprintf(why, sizeof why, "'%s' is a model preset (seed %llu)%s, so the text is noise; generate from a "
                 "trained run (out/.../final) for text%s", gm->path, (unsigned long long)seed,
                 tok_path ? "" : " with the built-in byte tokenizer", hint);
        fl_cli_note_random("generate", why);
    }
}

/* The tokenizer: --tokenizer (a path, or "bytes"); a preset's built-in bytes; an adapter's (its
 * base's or its own; on a preset base, which has none, the bytes the run used); else the model's
 * folder (every fitllm checkpoint carries its tokenizer). info: the adapter's, NULL without one. */
static fl_status gen_tokenizer(fl_tokenizer **tok, const char *tok_path, const gen_model *gm,
                               const fl_cli_adapter_info *info, const char *model) {
    char tp[FL_CLI_PATH];
    const char *ts;
    struct stat sb;
    int bytes = 0;
    if (tok_path) bytes = !strcmp(tok_path, "bytes"), snprintf(tp, sizeof tp, "%s", tok_path);
    else if (gm->preset) bytes = 1;
    else if (info && (ts = fl_cli_adapter_tokenizer(info, 0, tp, sizeof tp)) != NULL) snprintf(tp, sizeof tp, "%s", ts);
    else if (info && stat(info->base, &sb) != 0) bytes = 1;
    else default_tokenizer(model, tp, sizeof tp);
    fl_status s = bytes ? fl_tok_builtin_bytes(tok) : fl_tok_load(tok, tp);
    if (s == FL_OK) return FL_OK;
    char why[1024]; /* copy first: fl_errorf rewrites the message buffer it would read */
    snprintf(why, sizeof why, "%s", fl_error_message());
    int old_ckpt = s == FL_ERR_NOT_FOUND && !tok_path && is_dir(tp) && fl_ckpt_is_committed(tp);
    return fl_errorf(s, "loading the tokenizer (--tokenizer PATH, or --prompt-ids): %s%s", why,
                     old_ckpt ? "; a checkpoint saved by an older fitllm from a run with the built-in byte tokenizer "
                                "has none: --tokenizer bytes" : "");
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

#define GEN_MAX_PROMPTS 256 /* several --prompt: an encoder-decoder decodes them as one batch */

/* generate's options. */
typedef struct {
    const char *model_path, *prompt, *prompt_ids, *tok_path, *adapter, *image;
    const char *prompts[GEN_MAX_PROMPTS];
    int n_prompts;
    int threads, seed, temp_given;
    fl_gen_params gp;
    char named[FL_CLI_PATH], tok_named[FL_CLI_PATH]; /* Hugging Face repo ids: their downloaded folders */
} gen_opts;

/* The command line into o: -1 to run, else the exit code (help, a usage error). */
static int parse_opts(int argc, char **argv, const char *cmd, gen_opts *o) {
    memset(o, 0, sizeof *o);
    o->seed = -1;
    fl_gen_params_default(&o->gp);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (opt(a, "--prompt") && v) {
            if (o->n_prompts == GEN_MAX_PROMPTS) return fl_cli_usage(cmd, "more than %d --prompt", GEN_MAX_PROMPTS);
            o->prompts[o->n_prompts++] = v;
            if (!o->prompt) o->prompt = v;
            i++;
        }
        else if (opt(a, "--prompt_ids") && v) { o->prompt_ids = v; i++; }
        else if (opt(a, "--image") && v) { o->image = v; i++; }
        else if (opt(a, "--tokenizer") && v) { o->tok_path = v; i++; }
        else if (opt(a, "--adapter") && v) { o->adapter = v; i++; }
        else if (opt(a, "--max_new_tokens")) { if (fl_cli_int(cmd, a, v, 0, 1 << 30, &o->gp.max_new_tokens)) return 2; i++; }
        else if (opt(a, "--top_k")) { if (fl_cli_int(cmd, a, v, 0, 1 << 30, &o->gp.top_k)) return 2; i++; }
        else if (opt(a, "--temperature")) { if (fl_cli_float(cmd, a, v, &o->gp.temperature)) return 2; i++; o->temp_given = 1; }
        else if (opt(a, "--top_p")) { if (fl_cli_float(cmd, a, v, &o->gp.top_p)) return 2; i++; }
        else if (opt(a, "--seed")) { if (fl_cli_int(cmd, a, v, 0, 1 << 30, &o->seed)) return 2; i++; }
        else if (opt(a, "--threads")) { if (fl_cli_threads(cmd, v, 1024, &o->threads)) return 2; i++; }
        else if (opt(a, "--accelerator")) { int rc = fl_cli_accelerator(cmd, v); if (rc) return rc; i++; }
        else if (a[0] == '-')
            return fl_cli_unknown_option(cmd, a, (const char *const[]){"--accelerator", "--adapter", "--help", "--image", "--max_new_tokens",
                                                                         "--prompt", "--prompt_ids", "--seed", "--temperature",
                                                                         "--threads", "--tokenizer", "--top_k", "--top_p", NULL});
        else if (!o->model_path) o->model_path = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!o->model_path) return fl_cli_usage(cmd, "missing <model>");
    int named_rc = fl_cli_model_arg(cmd, &o->model_path, o->named, sizeof o->named);
    if (!named_rc && o->tok_path) named_rc = fl_cli_model_arg(cmd, &o->tok_path, o->tok_named, sizeof o->tok_named);
    if (named_rc) return named_rc;
    if (o->prompt && o->prompt_ids) return fl_cli_usage(cmd, "give --prompt or --prompt-ids, not both");
    if (o->n_prompts > 1 && o->image) return fl_cli_usage(cmd, "--image captions one image: give one --prompt");
    if (o->seed >= 0) o->gp.seed = (uint64_t)o->seed;
    if (fl_gen_params_validate(&o->gp) != FL_OK) return fl_cli_usage(cmd, "%s", fl_error_message());
    if (!o->prompt_ids && !o->prompt && !o->image) o->prompt = DEFAULT_PROMPT;
    return -1;
}

/* An encoder-decoder (T5): the prompt as the source, decoded greedily (--temperature 0) or sampled (temperature,
 * top-k, top-p, seed: fl_generate_s2s). Prints the generated ids (or, with a tokenizer, their text), without the
 * decoder's start token. */
static fl_status s2s_generate(fl_model *m, const int32_t *ids, int n_ids, const fl_gen_params *gp, const fl_tokenizer *tok) {
    int32_t *out = malloc(((size_t)gp->max_new_tokens + 1) * sizeof *out);
    if (!out) return fl_errorf(FL_ERR_OOM, "out of host memory");
    int n = 0;
    double t0 = fl_cli_now_ms();
    fl_status s = fl_model_alloc_gen_s2s(m, 1, n_ids, gp->max_new_tokens); /* linear in max_new_tokens */
    if (s == FL_OK) s = fl_generate_s2s(m, ids, NULL, n_ids, gp, out, &n);
    double t1 = fl_cli_now_ms();
    if (s == FL_OK && tok) {
        char *text = NULL;
        size_t len = 0;
        s = fl_tok_decode(tok, out + 1, (size_t)(n - 1), 1, &text, &len);
        if (s == FL_OK) printf("%.*s\n", (int)len, text);
        free(text);
    } else if (s == FL_OK) {
        for (int i = 1; i < n; i++) printf(i > 1 ? " %d" : "%d", (int)out[i]);
        printf("\n");
    }
    char how[96];
    if (gp->temperature == 0.0f) snprintf(how, sizeof how, "greedy");
    else snprintf(how, sizeof how, "temperature %g, top_k %d, top_p %g, seed %llu", (double)gp->temperature, gp->top_k,
                  (double)gp->top_p, (unsigned long long)gp->seed);
    if (s == FL_OK)
        fprintf(stderr, "%d source + %d new tokens (%s, stop: %s); %.1f ms\n", n_ids, n - 1, how,
                n > 1 && fl_model_is_eos(m, out[n - 1]) ? "EOS" : "max_new_tokens", t1 - t0);
    free(out);
    return s;
}

/* Several --prompt on an encoder-decoder: the sources encoded, right-padded to the longest with the pad id and masked
 * there, decoded as one batch (fl_generate_s2s_batch: each row's ids are its source's alone); one line of text per
 * prompt, in order. */
static fl_status s2s_generate_batch(fl_model *m, const char *const *prompts, int B, const fl_gen_params *gp,
                                    const fl_tokenizer *tok) {
    int32_t *ids[GEN_MAX_PROMPTS] = {0};
    size_t len[GEN_MAX_PROMPTS] = {0};
    int Ts = 0;
    fl_status s = FL_OK;
    for (int b = 0; s == FL_OK && b < B; b++) {
        s = fl_tok_encode(tok, prompts[b], strlen(prompts[b]), -1, 1, &ids[b], &len[b]); /* the EOS as one source */
        if (s == FL_OK && len[b] == 0) s = fl_errorf(FL_ERR_INVALID, "--prompt %d encodes to no tokens", b + 1);
        for (size_t i = 0; s == FL_OK && i < len[b]; i++)
            if (ids[b][i] >= m->cfg.vocab_size)
                s = fl_errorf(FL_ERR_INVALID, "--prompt %d: token id %d is outside the model's vocabulary [0, %d)", b + 1,
                              (int)ids[b][i], m->cfg.vocab_size);
        if (s == FL_OK && (int)len[b] > Ts) Ts = (int)len[b];
    }
    const int W = gp->max_new_tokens + 1;
    int32_t *src = s == FL_OK ? malloc((size_t)B * Ts * sizeof *src) : NULL, *out = malloc((size_t)B * W * sizeof *out);
    uint8_t *mask = s == FL_OK ? calloc((size_t)B * Ts, 1) : NULL;
    if (s == FL_OK && (!src || !out || !mask)) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    for (int b = 0; s == FL_OK && b < B; b++)
        for (int i = 0; i < Ts; i++) {
            const int in = i < (int)len[b];
            src[(size_t)b * Ts + i] = in ? ids[b][i] : m->cfg.pad_id;
            mask[(size_t)b * Ts + i] = (uint8_t)in;
        }
    int n = 0;
    double t0 = fl_cli_now_ms();
    if (s == FL_OK) s = fl_model_alloc_gen_s2s(m, B, Ts, gp->max_new_tokens);
    if (s == FL_OK) s = fl_generate_s2s_batch(m, src, mask, B, Ts, gp, out, &n);
    double t1 = fl_cli_now_ms();
    int ended = 0;
    for (int b = 0; s == FL_OK && b < B; b++) { /* the row up to its eos (pad after it) */
        const int32_t *o = out + (size_t)b * W;
        int k = 1; /* o[1 .. k]: up to its eos, included (decoded as nothing: a special token), else the whole row */
        while (k < n - 1 && !fl_model_is_eos(m, o[k])) k++;
        ended += k < n && fl_model_is_eos(m, o[k]);
        char *text = NULL;
        size_t tl = 0;
        s = fl_tok_decode(tok, o + 1, (size_t)(n > 1 ? k : 0), 1, &text, &tl);
        if (s == FL_OK) printf("%.*s\n", (int)tl, text);
        free(text);
    }
    fflush(stdout);
    if (s == FL_OK)
        fprintf(stderr, "%d sources (longest %d tokens, padded) + %d new tokens at most (%s); %d ended on EOS; %.1f ms\n",
                B, Ts, n - 1, gp->temperature == 0.0f ? "greedy" : "sampled", ended, t1 - t0);
    for (int b = 0; b < B; b++) free(ids[b]);
    free(src), free(mask), free(out);
    return s;
}

/* A decoder-only model's prompt of n tokens and its context ctx, max_new >= 1 new tokens asked for: a prompt that fills
 * the context leaves no position for a new token, refused as a longer one is (not a run that ends at once with 0 new
 * tokens); --max_new_tokens 0 asks for none: the prompt is printed, whatever its length (decoder_generate). */
static fl_status prompt_fits(int n, int ctx) {
    if (n < ctx) return FL_OK;
    return fl_errorf(FL_ERR_INVALID, "prompt of %d tokens %s the model's context of %d%s: shorten the prompt (--prompt / "
                     "--prompt-ids) to at most %d tokens, so that a new token has a position (--max_new_tokens 0 prints "
                     "the prompt alone)", n, n > ctx ? "exceeds" : "fills", ctx,
                     n > ctx ? "" : ", leaving no position for a new token", ctx - 1);
}

/* --image: a BLIP-2 folder captions the image (greedy), after the prompt when one is given. <model> as the LM path
 * takes it (resolve_model): a run folder's final/ or newest committed step; a PEFT adapter folder (a finetune_lora
 * step-N/) or --adapter: the adapter merged into its BLIP-2 base in memory. */
static int image_generate(const char *cmd, const gen_opts *o) {
    gen_model gm;
    if (resolve_model(o->model_path, &gm) != FL_OK) {
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return FL_EXIT_USAGE;
    }
    if (gm.note[0]) fprintf(stderr, "fitllm generate: %s\n", gm.note);
    const char *adapter = o->adapter, *base = gm.path;
    if (!adapter && is_adapter_dir(gm.path)) adapter = gm.path, base = NULL;
    fl_cli_adapter_info info;
    char own[FL_CLI_PATH + 16], hint[FL_CLI_PATH + 64];
    snprintf(own, sizeof own, "%s/adapter", gm.path); /* a LoRA run's final/ is its merged model */
    if (adapter && base && fl_cli_find_adapter(adapter, &info) == FL_OK && fl_cli_same_dir(info.adapter, own)) {
        fprintf(stderr, "fitllm %s: error: %s already has the adapter %s merged in (a finetune_lora final/ is the merged "
                "model): generate %s alone, or the base model with --adapter %s\n", cmd, gm.path, info.adapter,
                gm.path, info.adapter);
        return FL_EXIT_USAGE;
    }
    snprintf(hint, sizeof hint, "`fitllm generate <base_dir> --adapter %s --image FILE`", gm.path);
    fl_backend be;
    fl_mem_pool pool, hpool;
    int32_t *ids = NULL;
    int n = 0;
    fl_blip2 *b = NULL;
    fl_status s = fl_backend_init_by_name(fl_backend_default_name(), &be, o->threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_pools_init(&be, &pool, &hpool, "cpu", 0)) != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if (adapter) s = fl_cli_blip2_with_adapter(&b, base, adapter, hint, &be, &pool, &info);
    if (s == FL_OK && adapter && !base)
        fprintf(stderr, "fitllm generate: %s is a LoRA adapter: base model %s with it merged in memory\n", info.adapter,
                info.base);
    if (s == FL_OK && o->prompt_ids) s = parse_ids(o->prompt_ids, &ids, &n);
    int rc = s != FL_OK ? fl_cli_fail(cmd, s, &pool)
                        : fl_cli_blip2_generate(cmd, adapter ? info.base : gm.path, b, o->image, o->prompt, ids, n,
                                                o->gp.max_new_tokens, o->temp_given ? o->gp.temperature : 0.0f, &be,
                                                &pool);
    if (s != FL_OK) fl_blip2_free(b); /* else fl_cli_blip2_generate's */
    free(ids);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return rc;
}

/* The ids that end generation (fl_hf_stop_ids) and where they came from, for the statistics line. */
typedef struct {
    int32_t ids[FL_MODEL_MAX_EOS];
    int n;
    const char *from;
} gen_stop_ids;

/* "EOS ids 2 13 (config.json + the tokenizer)" into buf */
static void stop_ids_text(const gen_stop_ids *st, char *buf, size_t size) {
    size_t w = (size_t)snprintf(buf, size, "%s", st->n ? "EOS ids" : "no EOS id (no tokenizer, no eos_token_id)");
    for (int i = 0; i < st->n && w < size; i++) w += (size_t)snprintf(buf + w, size - w, " %d", (int)st->ids[i]);
    if (st->n && w < size) snprintf(buf + w, size - w, " (%s)", st->from);
}

/* A decoder-only model: the prompt printed (streamed as text with a tokenizer, else its ids), then each new token
 * (fl_generate with a KV cache of prompt + max_new_tokens positions, capped at the context) until max_new_tokens, an
 * id of stop or the context; the statistics on stderr. --max_new_tokens 0: the prompt alone, nothing run (any length:
 * no position is needed). */
static fl_status decoder_generate(fl_model *m, const int32_t *ids, int n_ids, const fl_gen_params *gp,
                                  const fl_tokenizer *tok, const gen_stop_ids *stop, int threads) {
    fl_status s = gp->max_new_tokens ? prompt_fits(n_ids, m->cfg.max_seq) : FL_OK;
    if (s != FL_OK) return s;
    fl_kv_cache kv = {0};
    stream_state st = {0};
    int32_t *out = malloc(((size_t)gp->max_new_tokens + 1) * sizeof *out);
    if (!out) return fl_errorf(FL_ERR_OOM, "out of host memory");
    st.tok = tok;
    if (tok) {
        st.cap = n_ids + gp->max_new_tokens;
        if (!(st.all = malloc((size_t)st.cap * sizeof *st.all))) s = fl_errorf(FL_ERR_OOM, "out of host memory");
        if (s == FL_OK) memcpy(st.all, ids, (size_t)n_ids * sizeof *ids);
        st.n = n_ids;
    }
    /* The cache holds the prompt + new tokens (LitGPT's max_returned_tokens), capped at the context. */
    long want = (long)n_ids + gp->max_new_tokens;
    if (s == FL_OK && gp->max_new_tokens) s = fl_kv_cache_init(&kv, m, want < m->cfg.max_seq ? (int)want : m->cfg.max_seq);
    if (s == FL_OK && tok) stream_flush(&st, 0); /* the prompt */
    for (int i = 0; s == FL_OK && !tok && i < n_ids; i++) printf(i ? " %d" : "%d", (int)ids[i]);
    fflush(stdout);
    double t0 = fl_cli_now_ms();
    int n_out = 0;
    fl_gen_stop why = FL_GEN_STOP_MAX_TOKENS;
    if (s == FL_OK && gp->max_new_tokens)
        s = fl_generate(m, &kv, ids, n_ids, gp, stop->ids, stop->n, out, &n_out, &why, tok ? on_text : on_id, &st);
    double t1 = fl_cli_now_ms();
    if (tok && st.all) stream_flush(&st, 1);
    printf("\n");
    fflush(stdout); /* the text and its newline before the statistics on stderr, also when both go to one file */
    static const char *const k_why[] = {"max_new_tokens", "EOS", "context limit", "callback"};
    char ids_text[64 + FL_MODEL_MAX_EOS * 12], rate[96] = "";
    stop_ids_text(stop, ids_text, sizeof ids_text);
    if (n_out > 1) /* the rate of the tokens after the first (the prefill's) */
        snprintf(rate, sizeof rate, ", %.2f ms/token (%.1f tok/s)", (t1 - st.t_first) / (n_out - 1),
                 (n_out - 1) * 1e3 / (t1 - st.t_first));
    if (s == FL_OK && !gp->max_new_tokens)
        fprintf(stderr, "%d prompt + 0 new tokens (stop: max_new_tokens); nothing run; %s\n", n_ids, ids_text);
    else if (s == FL_OK)
        fprintf(stderr, "%d prompt + %d new tokens (stop: %s); prefill %.1f ms%s, %d threads; %s\n", n_ids, n_out,
                k_why[why], st.count ? st.t_first - t0 : t1 - t0, rate, threads, ids_text);
    free(st.all);
    free(st.shown);
    free(out);
    fl_kv_cache_free(&kv);
    return s;
}

int fl_cmd_generate(int argc, char **argv) {
    const char *cmd = "generate";
    gen_opts o;
    int prc = parse_opts(argc, argv, cmd, &o);
    if (prc >= 0) return prc;
    if (o.image) return image_generate(cmd, &o);
    gen_model gm;
    if (resolve_model(o.model_path, &gm) != FL_OK) {
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return FL_EXIT_USAGE; /* <model> names nothing there is */
    }
    if (gm.note[0]) fprintf(stderr, "fitllm generate: %s\n", gm.note);
    o.model_path = gm.path;

    fl_backend be;
    fl_mem_pool pool, hpool; /* tensors; host staging when the backend's memory is not host memory */
    fl_model m = {0};
    fl_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    gen_stop_ids stop = {.n = 0};
    int n_ids = 0, loaded = 0, rc = 0;
    fl_status s = fl_backend_init_by_name(fl_backend_default_name(), &be, o.threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_pools_init(&be, &pool, &hpool, "cpu", 0)) != FL_OK) return fl_cli_fail(cmd, s, NULL);
    fl_cli_own_random_note(); /* say_init says it */
    if (gm.preset && !o.adapter) say_init(&gm, NULL, 0, o.gp.seed, o.tok_path); /* first, before the (slow) random init */
    /* a PEFT o.adapter folder as <model> (a finetune_lora step-N/): its base with it merged */
    const char *base = o.model_path;
    if (!o.adapter && is_adapter_dir(o.model_path)) {
        o.adapter = o.model_path;
        base = NULL;
    }
    fl_cli_adapter_info info;
    char hint[FL_CLI_PATH + 64];
    /* a LoRA run's final/ is its merged model: its own adapter/ on top would apply the adapter twice */
    char own[FL_CLI_PATH + 16];
    snprintf(own, sizeof own, "%s/adapter", o.model_path);
    if (o.adapter && base && fl_cli_find_adapter(o.adapter, &info) == FL_OK && fl_cli_same_dir(info.adapter, own)) {
        s = fl_errorf(FL_ERR_INVALID, "%s already has the adapter %s merged in (a finetune_lora final/ is the merged "
                      "model): generate %s alone, or the base model with --adapter %s", o.model_path, info.adapter,
                      o.model_path, info.adapter);
        goto fail;
    }
    snprintf(hint, sizeof hint, "`fitllm generate <base_dir> --adapter %s`", o.model_path);
    /* the model first: a broken config.json is reported as the model's, not as a tokenizer
     * problem (the tokenizer also reads config.json for its special ids) */
    if ((s = o.adapter ? fl_cli_load_with_adapter(&m, base, o.adapter, hint, &be, &pool, &loaded, &info)
                     : fl_cli_load_model(&m, o.model_path, 0, o.gp.seed, &be, &pool, &loaded)) != FL_OK)
        goto fail;
    if (o.adapter && !base)
        fprintf(stderr, "fitllm generate: %s is a LoRA adapter: base model %s with it merged in memory\n", info.adapter,
                info.base);
    if (!gm.preset || o.adapter) say_init(&gm, o.adapter ? &info : NULL, loaded, o.gp.seed, o.tok_path);
    if (o.prompt_ids) {
        if ((s = parse_ids(o.prompt_ids, &ids, &n_ids)) != FL_OK) goto fail;
    } else {
        if ((s = gen_tokenizer(&tok, o.tok_path, &gm, o.adapter ? &info : NULL, base ? base : info.base)) != FL_OK) goto fail;
        size_t n = 0;
        /* an encoder-decoder's source ends with EOS (T5's </s>: transformers' tokenizer(text), the
         * sources it was trained on, and the training data here); a decoder-only prompt is continued, never ended */
        if ((s = fl_tok_encode(tok, o.prompt, strlen(o.prompt), -1, fl_model_is_s2s(&m.cfg) ? 1 : 0, &ids, &n)) != FL_OK)
            goto fail;
        n_ids = (int)n;
        if (n_ids == 0 && o.gp.max_new_tokens == 0) { /* none asked: the (empty) prompt printed as it is */
            printf("\n");
            fprintf(stderr, "0 prompt + 0 new tokens (stop: max_new_tokens); nothing run\n");
            goto done;
        }
        if (n_ids == 0) { /* GPT-2's tokenizer adds no BOS: its <|endoftext|> starts a text */
            const int b = fl_tok_bos_id(tok) >= 0 ? fl_tok_bos_id(tok) : fl_tok_eos_id(tok);
            char h[96] = "";
            if (b >= 0) snprintf(h, sizeof h, ": to start from nothing, give --prompt-ids %d (the model's %s token)", b,
                                 fl_tok_bos_id(tok) >= 0 ? "BOS" : "EOS");
            s = fl_errorf(FL_ERR_INVALID, "the prompt encodes to no tokens (and the tokenizer adds no BOS)%s", h);
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
    if (o.n_prompts > 1 && !fl_model_is_s2s(&m.cfg)) {
        s = fl_errorf(FL_ERR_UNSUPPORTED, "%d --prompt: several prompts are decoded as one batch for an encoder-decoder "
                      "(T5) only so far; give one --prompt", o.n_prompts);
        goto fail;
    }
    /* the ids that end generation: generation_config.json's eos_token_id (else config.json's) and the tokenizer's */
    if ((s = fl_hf_stop_ids(base ? base : info.base, tok, stop.ids, FL_MODEL_MAX_EOS, &stop.n, &stop.from)) != FL_OK)
        goto fail;
    fl_model_set_eos_ids(&m, stop.ids, stop.n); /* an encoder-decoder's (else its config's eos_token_id) */
    if (fl_model_is_s2s(&m.cfg)) { /* an encoder-decoder: the prompt is the source (several: one batch) */
        s = o.n_prompts > 1 ? s2s_generate_batch(&m, o.prompts, o.n_prompts, &o.gp, tok) : s2s_generate(&m, ids, n_ids, &o.gp, tok);
        if (s != FL_OK) goto fail;
        goto done;
    }
    if ((s = decoder_generate(&m, ids, n_ids, &o.gp, tok, &stop, be.n_threads)) != FL_OK) goto fail;
    goto done;
fail:
    rc = fl_cli_fail(cmd, s, &pool);
done:
    free(ids);
    fl_tok_free(tok);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return rc;
}
