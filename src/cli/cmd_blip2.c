/* `fitllm loss` / `fitllm generate` with --image: a BLIP-2 folder (fitllm/blip2.h) on one image, preprocessed by the
 * folder's preprocessor_config.json (fitllm/image.h: BLIP's processor, bit-exact with transformers'). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/blip2.h"
#include "fitllm/image.h"
#include "fitllm/io.h"
#include "fitllm/tokenizer.h"
#include "fitllm/trainer.h"

/* The model (*b: the caller's, else loaded from dir) and the image's pixel_values (3 x S x S, S the vision tower's
 * image_size) by dir's preprocessor_config.json. */
static fl_status open_blip2(const char *dir, const char *image, const fl_backend *be, fl_mem_pool *pool, fl_blip2 **b,
                            float **px) {
    *px = NULL;
    if (!*b && !fl_blip2_is_folder(dir))
        return fl_errorf(FL_ERR_INVALID, "--image: %s is not a BLIP-2 folder (config.json with model_type \"blip-2\")", dir);
    if (!*b) FL_TRY(fl_blip2_load(b, dir, be, pool));
    char pp[4096];
    FL_TRY(fl_fs_join(pp, sizeof pp, dir, "preprocessor_config.json"));
    fl_img_proc proc;
    if (!fl_fs_is_file(pp))
        return fl_errorf(FL_ERR_NOT_FOUND, "%s: no preprocessor_config.json (the image processor's size, mean and std)",
                         dir);
    FL_TRY(fl_img_proc_load(pp, &proc));
    fl_img im;
    FL_TRY(fl_img_load(image, &im));
    int h = 0, w = 0;
    fl_status s = fl_img_preprocess_alloc(&proc, &im, px, &h, &w);
    fl_img_free(&im);
    FL_TRY(s);
    const int S = fl_blip2_get_config(*b)->vision.image_size;
    if (h != S || w != S)
        return fl_errorf(FL_ERR_FORMAT, "%s: the processor makes %dx%d pixel_values, the vision tower reads %dx%d "
                         "(vision_config.image_size)", pp, w, h, S, S);
    return FL_OK;
}

/* The Flan-T5 variant: the loss of tgt (nt ids) given the image and src (the placeholders first) */
static fl_status loss_s2s(fl_blip2 *b, const float *px, const int32_t *src, int ns, const int32_t *tgt, int nt,
                          float *loss) {
    const fl_blip2_config *c = fl_blip2_get_config(b);
    const int NQ = c->image_token >= 0 ? c->n_queries : 0, Ts = NQ + ns;
    int32_t *ids = malloc((size_t)Ts * sizeof *ids), *dec = malloc((size_t)nt * sizeof *dec);
    fl_status s = ids && dec ? FL_OK : fl_errorf(FL_ERR_OOM, "out of host memory");
    for (int t = 0; s == FL_OK && t < Ts; t++) ids[t] = t < NQ ? c->image_token : src[t - NQ];
    for (int t = 0; s == FL_OK && t < nt; t++) dec[t] = t ? tgt[t - 1] : c->text.dec_start_id;
    if (s == FL_OK) s = fl_blip2_alloc_acts_s2s(b, 1, Ts, nt);
    if (s == FL_OK) s = fl_blip2_forward_s2s(b, px, ids, dec, tgt, 1, Ts, nt, 0, NULL, loss);
    free(ids), free(dec);
    return s;
}

int fl_cli_blip2_loss(const char *cmd, const char *dir, const char *image, const int32_t *caption, int n,
                      const int32_t *tgt, int nt, const fl_backend *be, fl_mem_pool *pool) {
    fl_blip2 *b = NULL;
    float *px = NULL, loss = 0;
    int32_t *ids = NULL, *tg = NULL;
    fl_status s = open_blip2(dir, image, be, pool, &b, &px);
    const int s2s = b && fl_model_is_s2s(&fl_blip2_get_config(b)->text);
    if (s == FL_OK && s2s != (tgt != NULL))
        s = fl_errorf(FL_ERR_INVALID, s2s ? "%s: the Flan-T5 variant: give the target with --target-tokens-file "
                                            "(--tokens-file is the source after the query tokens)"
                                          : "--target-tokens-file: %s has a decoder-only language model (its loss is "
                                            "of --tokens-file alone)", dir);
    if (s == FL_OK && s2s) s = loss_s2s(b, px, caption, n, tgt, nt, &loss);
    else if (s == FL_OK && n < 2) s = fl_errorf(FL_ERR_FORMAT, "--tokens-file: a caption needs at least 2 token ids");
    if (s == FL_OK && !s2s) {
        const fl_blip2_config *c = fl_blip2_get_config(b);
        const int NQ = c->image_token >= 0 ? c->n_queries : 0, T = NQ + n;
        ids = malloc((size_t)T * sizeof *ids);
        tg = malloc((size_t)T * sizeof *tg);
        if (!ids || !tg) s = fl_errorf(FL_ERR_OOM, "out of host memory");
        /* the placeholders, then the caption; row NQ + i predicts caption[i + 1] */
        for (int t = 0; s == FL_OK && t < T; t++) {
            ids[t] = t < NQ ? c->image_token : caption[t - NQ];
            tg[t] = t >= NQ && t - NQ + 1 < n ? caption[t - NQ + 1] : FL_IGNORE_INDEX;
        }
        if (s == FL_OK) s = fl_blip2_alloc_acts(b, 1, T);
        if (s == FL_OK) s = fl_blip2_forward(b, px, ids, tg, 1, T, 0, NULL, &loss);
    }
    int rc = 0;
    if (s == FL_OK)
        printf("loss %.6f  ppl %.4f  tokens %d  image %s  model %s\n", (double)loss, fl_trainer_perplexity(loss),
               s2s ? nt : n - 1, image, dir);
    else
        rc = fl_cli_fail(cmd, s, pool);
    free(ids), free(tg), free(px);
    fl_blip2_free(b);
    return rc;
}

int fl_cli_blip2_generate(const char *cmd, const char *dir, fl_blip2 *b, const char *image, const char *prompt,
                          const int32_t *prompt_ids, int n_prompt_ids, int max_new, float temperature,
                          const fl_backend *be, fl_mem_pool *pool) {
    fl_tokenizer *tok = NULL;
    float *px = NULL;
    int32_t *pids = NULL, *out = NULL;
    size_t np = 0;
    int n = 0;
    fl_status s = temperature != 0.0f ? fl_errorf(FL_ERR_UNSUPPORTED, "--temperature %g: captioning is greedy only so "
                                                  "far (--temperature 0)", (double)temperature)
                                      : open_blip2(dir, image, be, pool, &b, &px);
    if (s == FL_OK && (prompt || fl_io_has_tokenizer(dir))) s = fl_tok_load(&tok, dir);
    if (s == FL_OK && prompt) s = fl_tok_encode(tok, prompt, strlen(prompt), -1, 0, &pids, &np);
    int32_t stop[FL_MODEL_MAX_EOS]; /* generation_config.json's eos_token_id (else text_config's) and the tokenizer's */
    int n_stop = 0;
    if (s == FL_OK) s = fl_hf_stop_ids(dir, tok, stop, FL_MODEL_MAX_EOS, &n_stop, NULL);
    if (s == FL_OK) fl_model_set_eos_ids(fl_blip2_part(b, FL_BLIP2_TEXT), stop, n_stop);
    const fl_blip2_config *c = b ? fl_blip2_get_config(b) : NULL;
    const int32_t *p = prompt ? pids : prompt_ids;
    int npr = prompt ? (int)np : n_prompt_ids;
    if (s == FL_OK && npr > 0 && p[0] == c->bos_id) p++, npr--; /* BOS is the model's own, before the prompt */
    /* OPT: at most the context's ids (generation stops there) */
    const int cap = c && !fl_model_is_s2s(&c->text) && max_new > c->text.max_seq ? c->text.max_seq : max_new;
    if (s == FL_OK && !(out = malloc(((size_t)cap + 1) * sizeof *out))) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    const double t0 = fl_cli_now_ms();
    fl_gen_stop why = FL_GEN_STOP_MAX_TOKENS;
    if (s == FL_OK) s = fl_blip2_generate(b, px, p, npr, max_new, out, &n, &why);
    if (s == FL_OK && tok) {
        char *text = NULL;
        size_t len = 0;
        s = fl_tok_decode(tok, out, (size_t)n, 1, &text, &len);
        if (s == FL_OK) printf("%.*s\n", (int)len, text);
        free(text);
    } else if (s == FL_OK) {
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", (int)out[i]);
        printf("\n");
    }
    if (s == FL_OK)
        fprintf(stderr, "%d new tokens (greedy, stop: %s); %.1f ms\n", n,
                why == FL_GEN_STOP_EOS || (n && (out[n - 1] == c->eos_id ||
                                                 fl_model_is_eos(fl_blip2_part(b, FL_BLIP2_TEXT), out[n - 1]))) ? "EOS"
                : why == FL_GEN_STOP_CONTEXT ? "context limit" : "max_new_tokens", fl_cli_now_ms() - t0);
    const int rc = s == FL_OK ? 0 : fl_cli_fail(cmd, s, pool);
    free(out), free(pids), free(px);
    if (tok) fl_tok_free(tok);
    fl_blip2_free(b);
    return rc;
}
