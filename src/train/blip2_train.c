/* BLIP-2 image-caption fine-tuning (fitllm/blip2_train.h): the captions and images into micro-batches, the step over the
 * three parts (accumulation, DDP's reductions, one clipping norm, each trained part's optimizer), validation, the
 * per-phase memory lines and the memory report; the run (or a rehearsal) behind fl_blip2_train. Checkpoints:
 * blip2_ckpt.c. */
#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "blip2_train-impl.h"
#include "core/fs.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/tokenizer.h"
#include "fitllm/trainer.h"


/* --blip2.train: "vision,qformer,lm" (any subset, at least one); "" the command's default. */
static fl_status parse_parts(const char *s, int lora, int *parts) {
    if (!s[0]) s = lora ? "lm" : "qformer,lm";
    *parts = 0;
    char buf[64];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *w = strtok_r(buf, ", ", &save); w; w = strtok_r(NULL, ", ", &save)) {
        const int k = !strcmp(w, "vision") ? FL_BLIP2_VISION : !strcmp(w, "qformer") ? FL_BLIP2_QFORMER
                      : !strcmp(w, "lm") ? FL_BLIP2_TEXT : -1;
        if (k < 0) return fl_errorf(FL_ERR_INVALID, "blip2.train: unknown part '%s' (vision, qformer, lm)", w);
        *parts |= 1 << k;
    }
    if (!*parts) return fl_errorf(FL_ERR_INVALID, "blip2.train: no part to train (vision, qformer, lm)");
    return FL_OK;
}

/* What this first slice runs; the rest refused by name. */
static fl_status check_run(const fl_run_config *c, int synth) {
    if (c->tensor_parallel > 1)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d: BLIP-2 fine-tuning runs data-parallel (DDP) only so far",
                         c->tensor_parallel);
    if (strcmp(c->precision, "32-true") && strcmp(c->precision, "bf16-mixed") && strcmp(c->precision, "bf16-true"))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--precision %s: BLIP-2 fine-tuning runs 32-true, bf16-true and bf16-mixed "
                         "only so far", c->precision);
    FL_TRY(fl_b2t_check_strategy(c));
    /* what the trainer does that this loop does not: refused rather than ignored */
    if (c->train.max_time > 0 || c->train.max_tokens > 0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--train.%s: BLIP-2 fine-tuning stops at train.max_steps or "
                         "train.epochs so far", c->train.max_time > 0 ? "max_time" : "max_tokens");
    if (c->train.lr_warmup_fraction >= 0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--train.lr_warmup_fraction: BLIP-2 fine-tuning warms up over "
                         "train.lr_warmup_steps");
    if (c->eval.initial_validation)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--eval.initial_validation true: BLIP-2 fine-tuning validates every "
                         "eval.interval steps and at the end");
    if (!synth && (c->data.kind != FL_DATA_JSON || !c->data.json_path[0]))
        return fl_errorf(FL_ERR_INVALID, "a BLIP-2 checkpoint trains on image captions: --data JSON --data.json_path "
                         "CAPTIONS (a .json/.jsonl of {\"image\", \"text\"} records, or an image folder)");
    return FL_OK;
}

/* A caption without a tokenizer: whitespace-separated token ids in [0, V). */
static fl_status parse_ids(const char *text, int V, const char *image, int32_t **out, size_t *n) {
    size_t cap = 16;
    *n = 0;
    *out = malloc(cap * sizeof **out);
    if (!*out) return fl_errorf(FL_ERR_OOM, "out of host memory");
    for (const char *p = text; *p;) {
        while (isspace((unsigned char)*p)) p++;
        if (!*p) break;
        char *end;
        const long v = strtol(p, &end, 10);
        if (end == p || (*end && !isspace((unsigned char)*end)) || v < 0 || v >= V)
            return fl_errorf(FL_ERR_FORMAT, "caption of %s: the checkpoint has no tokenizer, so a caption is token ids "
                             "in [0, %d) separated by spaces (got '%s')", image, V, text);
        if (*n == cap) {
            int32_t *nb = realloc(*out, (cap *= 2) * sizeof *nb);
            if (!nb) return fl_errorf(FL_ERR_OOM, "out of host memory");
            *out = nb;
        }
        (*out)[(*n)++] = (int32_t)v;
        p = end;
    }
    return FL_OK;
}

/* Every caption to ids: BOS (the language model's, OPT) first, cut to train.max_seq_length (default 50, the lab's). */
static fl_status tokenize_all(b2run *r) {
    const fl_blip2_config *bc = fl_blip2_get_config(r->b);
    const char *dir = r->cfg->checkpoint_dir;
    fl_tokenizer *tok = NULL;
    if (fl_io_has_tokenizer(dir)) FL_TRY(fl_tok_load(&tok, dir));
    const int NQ = bc->image_token >= 0 ? bc->n_queries : 0, s2s = fl_model_is_s2s(&bc->text);
    int maxlen = r->cfg->train.max_seq_length > 0 ? r->cfg->train.max_seq_length : 50;
    if (!s2s && maxlen > bc->text.max_seq - NQ) maxlen = bc->text.max_seq - NQ;
    r->n_rec = r->caps.n;
    r->ids = calloc(r->n_rec, sizeof *r->ids);
    r->n_ids = calloc(r->n_rec, sizeof *r->n_ids);
    fl_status s = r->ids && r->n_ids ? FL_OK : fl_errorf(FL_ERR_OOM, "out of host memory");
    for (size_t i = 0; s == FL_OK && i < r->n_rec; i++) {
        int32_t *raw = NULL;
        size_t n = 0;
        s = tok ? fl_tok_encode(tok, r->caps.text[i], strlen(r->caps.text[i]), 0, 0, &raw, &n)
                : parse_ids(r->caps.text[i], bc->text.vocab_size, r->caps.image[i], &raw, &n);
        /* OPT: BOS first; T5: the target ends with EOS (kept when the caption is cut, as the tokenizer's truncation) */
        const int bos = !s2s && bc->bos_id >= 0 && !(n && raw[0] == bc->bos_id);
        const int eos = s2s && !(n && raw[n - 1] == bc->eos_id);
        int32_t *ids = s == FL_OK ? malloc((n + 2) * sizeof *ids) : NULL;
        if (s == FL_OK && !ids) s = fl_errorf(FL_ERR_OOM, "out of host memory");
        size_t k = 0;
        if (ids && bos) ids[k++] = bc->bos_id;
        for (size_t j = 0; ids && j < n; j++) ids[k++] = raw[j];
        if (ids && eos) ids[k++] = bc->eos_id;
        free(raw);
        if (s == FL_OK && k < 2) s = fl_errorf(FL_ERR_FORMAT, "caption of %s: fewer than 2 tokens with %s", r->caps.image[i],
                                               s2s ? "EOS" : "BOS");
        if (s == FL_OK && (int)k > maxlen) {
            k = (size_t)maxlen;
            if (s2s) ids[k - 1] = bc->eos_id;
        }
        for (size_t j = 0; s == FL_OK && j < k; j++)
            if (ids[j] == bc->image_token)
                s = fl_errorf(FL_ERR_FORMAT, "caption of %s holds the image token id %d", r->caps.image[i], bc->image_token);
        r->ids[i] = ids;
        r->n_ids[i] = (int)k;
    }
    if (tok) fl_tok_free(tok);
    return s;
}

static uint64_t next_rng(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* plan / bench-step: n records of synth tokens each (BOS first for OPT, EOS last for T5; random ids in between, never
 * the image token): every micro-batch is synth tokens long, as the longest caption cut to train.max_seq_length. */
static fl_status synth_all(b2run *r, size_t n) {
    const fl_blip2_config *bc = fl_blip2_get_config(r->b);
    const int s2s = fl_model_is_s2s(&bc->text), L = r->synth, V = bc->text.vocab_size;
    r->n_rec = n;
    r->ids = calloc(n, sizeof *r->ids);
    r->n_ids = calloc(n, sizeof *r->n_ids);
    if (!r->ids || !r->n_ids) return fl_errorf(FL_ERR_OOM, "out of host memory");
    for (size_t i = 0; i < n; i++) {
        if (!(r->ids[i] = malloc((size_t)L * sizeof(int32_t)))) return fl_errorf(FL_ERR_OOM, "out of host memory");
        for (int j = 0; j < L; j++) {
            int32_t v = (int32_t)(next_rng(&r->rng) % (uint64_t)V);
            if (v == bc->image_token) v = (v + 1) % V;
            r->ids[i][j] = v;
        }
        if (!s2s && bc->bos_id >= 0) r->ids[i][0] = bc->bos_id;
        if (s2s) r->ids[i][L - 1] = bc->eos_id;
        r->n_ids[i] = L;
    }
    return FL_OK;
}

/* Micro-batch of records [i0, i0 + B): pixels, the ids (the placeholders, the caption, padded to the longest with the
 * language model's pad id) and the targets (row of caption token j predicts token j + 1). Returns the valid count. */
static fl_status make_batch(b2run *r, const size_t *order, size_t i0, int B, float *px, int32_t **ids, int32_t **tg,
                            int *T, long *n_valid) {
    const fl_blip2_config *bc = fl_blip2_get_config(r->b);
    const int NQ = bc->image_token >= 0 ? bc->n_queries : 0, S = bc->vision.image_size;
    int L = 0;
    for (int n = 0; n < B; n++)
        if (r->n_ids[order[i0 + n]] > L) L = r->n_ids[order[i0 + n]];
    const int s2s = fl_model_is_s2s(&bc->text);
    *T = s2s ? L : NQ + L; /* T5: the decoder's rows; the source is the placeholders (NQ) */
    *ids = malloc((size_t)B * (*T + NQ) * sizeof **ids);
    *tg = malloc((size_t)B * *T * sizeof **tg);
    if (!*ids || !*tg) return fl_errorf(FL_ERR_OOM, "out of host memory");
    *n_valid = 0;
    const int pad = bc->text.pad_id >= 0 ? bc->text.pad_id : 0;
    for (int n = 0; n < B; n++) {
        const size_t rec = order[i0 + n];
        const int32_t *c = r->ids[rec];
        const int nc = r->n_ids[rec];
        /* T5 (the labels are the caption: dec = the start token, then the labels but the last; after ids' B x T
         * decoder rows come the B x NQ source rows) */
        for (int t = 0; s2s && t < *T; t++) {
            (*ids)[n * *T + t] = t == 0 ? bc->text.dec_start_id : t - 1 < nc ? c[t - 1] : pad;
            (*tg)[n * *T + t] = t < nc ? c[t] : FL_IGNORE_INDEX;
            *n_valid += t < nc;
        }
        for (int t = 0; s2s && t < NQ; t++) (*ids)[(size_t)B * *T + n * NQ + t] = bc->image_token;
        for (int t = 0; !s2s && t < *T; t++) {
            const int j = t - NQ;
            (*ids)[n * *T + t] = t < NQ ? bc->image_token : j < nc ? c[j] : pad;
            const int lab = j >= 0 && j + 1 < nc;
            (*tg)[n * *T + t] = lab ? c[j + 1] : FL_IGNORE_INDEX;
            *n_valid += lab;
        }
        if (r->synth) { /* random pixels in the processor's range */
            for (size_t k = 0; k < (size_t)3 * S * S; k++)
                px[(size_t)n * 3 * S * S + k] = (float)(next_rng(&r->rng) >> 40) / (float)(1 << 23) - 1.0f;
            continue;
        }
        fl_img im;
        FL_TRY(fl_img_load(r->caps.image[rec], &im));
        int h = 0, w = 0;
        fl_status s = fl_img_preprocess(&r->proc, &im, px + (size_t)n * 3 * S * S, &h, &w);
        fl_img_free(&im);
        FL_TRY(s);
        if (h != S || w != S)
            return fl_errorf(FL_ERR_FORMAT, "%s: the processor makes %dx%d pixel_values, the vision tower reads %dx%d",
                             r->caps.image[rec], w, h, S, S);
    }
    return FL_OK;
}


/* data.val_split_fraction f of the (seeded, shuffled) records validate: the last floor(n f) of them, the lengths as
 * torch's random_split computes them (floors, the remainder round-robin from the training split). */
static void split_val(b2run *r) {
    const double f = r->cfg->data.val_split_fraction;
    const size_t n = r->n_rec;
    if (f <= 0 || n < 2) return;
    size_t tr = (size_t)((double)n * (1.0 - f)), va = (size_t)((double)n * f);
    for (size_t i = 0; tr + va < n; i++) *(i % 2 ? &va : &tr) += 1;
    r->n_rec = tr, r->n_val = va;
}

/* The mean loss over the validation records (micro-batches of B, at most eval.max_iters of them), no gradients,
 * LoRA dropout off. */
static fl_status validate(b2run *r, int B, double *loss) {
    const fl_blip2_config *bc = fl_blip2_get_config(r->b);
    const int S = bc->vision.image_size, NQ = bc->n_queries, s2s = fl_model_is_s2s(&bc->text);
    size_t *ord = malloc(r->n_val * sizeof *ord);
    float *px = malloc((size_t)B * 3 * S * S * sizeof *px);
    fl_status s = ord && px ? FL_OK : fl_errorf(FL_ERR_OOM, "out of host memory");
    for (size_t i = 0; ord && i < r->n_val; i++) ord[i] = r->n_rec + i;
    fl_model *lm = fl_blip2_part(r->b, FL_BLIP2_TEXT);
    fl_model_lora_set_train(lm, 0);
    double sum = 0;
    long nv = 0;
    for (size_t i0 = 0; s == FL_OK && i0 < r->n_val && i0 / (size_t)B < (size_t)r->cfg->eval.max_iters; i0 += (size_t)B) {
        const int b = r->n_val - i0 < (size_t)B ? (int)(r->n_val - i0) : B;
        int32_t *ids = NULL, *tg = NULL;
        int T = 0;
        long n = 0;
        float l = 0;
        s = make_batch(r, ord, i0, b, px, &ids, &tg, &T, &n);
        if (s == FL_OK) s = s2s ? fl_blip2_alloc_acts_s2s(r->b, b, NQ, T) : fl_blip2_alloc_acts(r->b, b, T);
        if (s == FL_OK)
            s = s2s ? fl_blip2_forward_s2s(r->b, px, ids + (size_t)b * T, ids, tg, b, NQ, T, 0.0f, NULL, &l)
                    : fl_blip2_forward(r->b, px, ids, tg, b, T, 0.0f, NULL, &l);
        sum += (double)l * (double)n, nv += n;
        free(ids), free(tg);
    }
    fl_model_lora_set_train(lm, 1);
    free(ord), free(px);
    *loss = nv ? sum / (double)nv : 0;
    return s;
}

/* The micro-batch size and the accumulation of a run (what the loop and the plan both read). */
static fl_status batch_shape(const fl_run_config *c, int *B, int *accum) {
    *B = c->train.micro_batch_size > 0 ? c->train.micro_batch_size : 1;
    const int gb = c->train.global_batch_size > 0 ? c->train.global_batch_size : *B;
    if (gb % *B) return fl_errorf(FL_ERR_INVALID, "train.global_batch_size %d is not a multiple of micro_batch_size %d",
                                  gb, *B);
    *accum = gb / *B;
    return FL_OK;
}

/* The model (the folder's weights, or a shape with no weights read: plan, bench-step), then the data, gradients,
 * adapters and optimizer state, in the order the memory report shows them (after_load is the weights alone). */
static fl_status setup(b2run *r) {
    const fl_run_config *c = r->cfg;
    FL_TRY(check_run(c, r->synth));
    FL_TRY(parse_parts(c->blip2_train, r->lora, &r->parts));
    if (r->borrowed) r->be = *r->borrowed;
    else FL_TRY(fl_backend_init_by_name(fl_backend_default_name(), &r->be, c->threads));
    FL_TRY(fl_backend_pools_init(&r->be, &r->pool, &r->hpool, fl_backend_host_memory(&r->be) ? "cpu" : r->be.name,
                                 r->budget ? r->budget : c->max_memory));
    r->pools_ok = 1;
    fl_mem_set_phase(&r->pool, "model load");
    fl_precision prec;
    FL_TRY(fl_precision_find(c->precision, &prec));
    /* bf16-true: every part stored in bf16; QLoRA (finetune_lora --quantize): the block linears of every part that does
     * not train whole (the frozen ones and the one with the adapters) in 4 bits, as bitsandbytes quantizes the model */
    fl_model_storage *stg = r->stg;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        const int whole = (r->parts & (1 << k)) && !(r->lora && k == FL_BLIP2_TEXT);
        fl_model_storage_for(&prec, &stg[k]);
        if (!whole) FL_TRY(fl_trainer_storage(c, &prec, &stg[k]));
    }
    FL_TRY(fl_b2t_fsdp_prepare(r, &prec)); /* FULL_SHARD: every part created sharded */
    /* a shape without weights: zeros on the plan's null backend (nothing computes), else random (bench-step) */
    fl_status ls = r->given ? fl_blip2_create_ex(&r->b, r->given, &r->be, &r->pool, r->borrowed ? 0 : c->seed | 1, stg)
                            : fl_blip2_load_ex(&r->b, c->checkpoint_dir, &r->be, &r->pool, stg);
    if (ls != FL_OK) { /* the parts are freed already: FSDP's bookkeeping forgets them */
        for (int k = 0; k < FL_BLIP2_PARTS; k++) fl_fsdp_drop_model(&r->pdp[k]);
        return ls;
    }
    fl_mem_snapshot(&r->pool, "after_load");
    fl_mem_set_phase(&r->pool, "setup");
    FL_TRY(fl_blip2_set_precision(r->b, &prec)); /* bf16-mixed: the parts' bf16 weight copies */
    FL_TRY(fl_b2t_fsdp_init(r));
    /* train.activation_checkpointing true: every stack keeps its blocks' inputs, recomputes their slots in backward */
    FL_TRY(fl_blip2_set_act_ckpt(r->b, c->train.activation_checkpointing == 1));
    const fl_blip2_config *bc = fl_blip2_get_config(r->b);
    if (fl_model_is_s2s(&bc->text) && !(r->parts & (1 << FL_BLIP2_TEXT)))
        return fl_errorf(FL_ERR_UNSUPPORTED, "blip2.train %s: the Flan-T5 variant trains its language model (lm, or "
                         "LoRA on it under finetune_lora) so far", c->blip2_train);
    if (fl_model_is_s2s(&bc->text) && bc->image_token < 0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: the Flan-T5 variant without image_token_index is not built for "
                         "fine-tuning", c->checkpoint_dir);
    /* dropout in the training forwards at each part's config rates, where transformers' Blip2ForConditionalGeneration
     * drops in training mode (the T5 trainer's masks: run seed, global micro-batch, site, element); rate 0: nothing
     * changes */
    FL_TRY(fl_blip2_set_dropout(r->b, 1));
    if (r->synth) {
        int B = 1, accum = 1;
        FL_TRY(batch_shape(c, &B, &accum));
        r->rng = c->seed;
        FL_TRY(synth_all(r, (size_t)B * (size_t)accum));
    } else {
        FL_TRY(fl_img_proc_load(c->checkpoint_dir, &r->proc));
        FL_TRY(fl_img_captions_load(c->data.json_path, &r->caps));
        fl_img_captions_shuffle(&r->caps, c->seed);
        FL_TRY(tokenize_all(r));
        split_val(r);
    }
    int grads = r->parts & ~(r->lora ? 1 << FL_BLIP2_TEXT : 0);
    FL_TRY(fl_blip2_alloc_grads_parts(r->b, grads));
    if (r->lora && (r->parts & (1 << FL_BLIP2_TEXT))) {
        fl_model *lm = fl_blip2_part(r->b, FL_BLIP2_TEXT);
        fl_lora_config lc;
        FL_TRY(fl_trainer_lora_config(c, &lm->cfg, &lc));
        FL_TRY(fl_model_lora_init(lm, &lc, c->seed));
    }
    FL_TRY(fl_b2t_dist_setup(r));
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        if (!(r->parts & (1 << k))) continue;
        FL_TRY(fl_b2t_optim_init(r, k));
        r->has_opt[k] = 1;
    }
    return FL_OK;
}

/* A new epoch's order of the records: a splitmix64 Fisher-Yates seeded by the run's seed and the epoch. */
static void reorder(size_t *order, size_t n, uint64_t seed) {
    uint64_t x = seed;
    for (size_t i = n; i > 1; i--) {
        const size_t j = (size_t)(next_rng(&x) % i), t = order[i - 1];
        order[i - 1] = order[j], order[j] = t;
    }
}


/* What the run prints: rank 0's lines only (DDP) */
void fl_b2t_say(const b2run *r, const char *fmt, ...) {
    if (r->rank || !r->o->out) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(r->o->out, fmt, ap);
    va_end(ap);
}

/* The options' stop callback (the CLI's: a stop signal, SIGINT, SIGTERM, SIGUSR1, after this step) into r->stopped;
 * DDP: any rank's stops every rank at the same step. */
static fl_status stop_signal(b2run *r) {
    float sig = r->o->stop ? (float)r->o->stop(r->o->stop_ud) : 0.0f;
    if (r->world > 1) FL_TRY(fl_comm_all_reduce(r->comm, &sig, &sig, 1, FL_F32, FL_COMM_MAX));
    r->stopped = (int)sig;
    return FL_OK;
}

/* One optimizer step over `accum` micro-batches of B records (an epoch's tail that does not fill one is dropped).
 * snap: the memory snapshots of the session's first step (before_fwd once the first micro-batch's arena exists,
 * after_fwd after its forward, after_bwd after the last backward, after_opt_step), the phases plan rehearses. */
/* train.memory_snapshot_interval: the course's per-phase line (allocated now and the peak so far, per tag and in all;
 * this pool reserves what it allocates, so reserved = allocated) */
static void phase_line(b2run *r, long step, const char *phase) {
    FILE *f = r->o->out;
    if (!r->snapline || r->rank || !f) return;
    char a[32], pk[32];
    fprintf(f, "memory step %ld %-14s allocated %s, peak %s:", step, phase, fl_fmt_bytes(r->pool.cur_total, a, sizeof a),
            fl_fmt_bytes(r->pool.peak_total, pk, sizeof pk));
    for (int t = 0; t < FL_TAG_COUNT; t++)
        if (r->pool.cur[t]) fprintf(f, " %s %s", fl_mem_tag_name((fl_mem_tag)t), fl_fmt_bytes(r->pool.cur[t], a, sizeof a));
    fprintf(f, "\n");
}

/* A phase boundary, as the trainer's step (step.c): the regions the model leaves live after phase ph (fl_blip2_live;
 * ph < 0: nothing to record), the snapshot `tag` (NULL: none), the label of the phase that follows (NULL: kept). */
static void edge(b2run *r, int ph, const char *tag, const char *next) {
    fl_live_region g[FL_BLIP2_LIVE_MAX];
    fl_mem_phase_edge(&r->pool, g, ph < 0 ? 0 : fl_blip2_live(r->b, (fl_live_phase)ph, g), tag, next);
}

static fl_status step(b2run *r, b2pos *p, int B, int accum, long it, double lr, int snap, double *loss) {
    const fl_blip2_config *bc = fl_blip2_get_config(r->b);
    const int S = bc->vision.image_size, s2s = fl_model_is_s2s(&bc->text), NQ = bc->n_queries;
    float *px = malloc((size_t)B * 3 * S * S * sizeof *px);
    size_t *starts = malloc((size_t)accum * sizeof *starts);
    long *mv = calloc((size_t)accum, sizeof *mv);  /* each micro-batch's valid targets (every rank knows them) */
    float *ml = calloc((size_t)accum, sizeof *ml); /* its mean loss, 0 where another rank ran it */
    fl_status s = px && starts && mv && ml ? FL_OK : fl_errorf(FL_ERR_OOM, "out of host memory");
    fl_blip2_zero_grads(r->b);
    edge(r, FL_LIVE_ZEROED, NULL, NULL);
    double lsum = 0;
    long vsum = 0; /* the step's valid targets: each micro-batch is scaled by 1 / vsum (one big batch) */
    for (int a = 0; s == FL_OK && a < accum; a++) {
        if (p->pos + (size_t)B > r->n_rec) {
            if (p->epoch_n && !r->synth)
                fl_b2t_say(r, "epoch %ld average loss %.4f\n", p->epoch + 1, p->epoch_sum / (double)p->epoch_n);
            p->epoch++, p->pos = 0, p->epoch_sum = 0, p->epoch_n = 0;
            reorder(p->order, r->n_rec, r->cfg->seed + (uint64_t)p->epoch);
        }
        starts[a] = p->pos;
        for (int n = 0; n < B; n++) mv[a] += r->n_ids[p->order[p->pos + (size_t)n]] - (s2s ? 0 : 1);
        vsum += mv[a];
        p->pos += (size_t)B;
    }
    /* several ranks (DDP): micro-batch a is rank a % world's; the gradients and losses summed over the ranks after */
    const int w = r->world > 1 ? r->world : 1, mine = r->rank, last = accum - 1 - (accum - 1 - mine) % w;
    for (int a = mine; s == FL_OK && a < accum; a += w) {
        int32_t *ids = NULL, *tg = NULL;
        int T = 0;
        long n_valid = 0;
        float l = 0;
        s = make_batch(r, p->order, starts[a], B, px, &ids, &tg, &T, &n_valid);
        /* the micro-batch's seed: LoRA dropout's and the Flan-T5 language model's own dropout masks */
        fl_model_adapters_seed(fl_blip2_part(r->b, FL_BLIP2_TEXT), r->cfg->seed * 1000003u + (uint64_t)it * accum + a);
        /* the arena of this micro-batch's length: the session's first one's is the set-up's (a plan's OOM says so),
         * the others' the forward's */
        if (s == FL_OK && !(snap && a == mine)) fl_mem_set_phase(&r->pool, "forward");
        if (s == FL_OK) s = s2s ? fl_blip2_alloc_acts_s2s(r->b, B, NQ, T) : fl_blip2_alloc_acts(r->b, B, T);
        if (s == FL_OK) edge(r, -1, snap && a == mine ? "before_fwd" : NULL, "forward");
        if (s == FL_OK && a == mine) phase_line(r, it + 1, "before_fwd");
        if (s == FL_OK)
            s = s2s ? fl_blip2_forward_s2s(r->b, px, ids + (size_t)B * T, ids, tg, B, NQ, T, 1.0f / (float)vsum, NULL, &l)
                    : fl_blip2_forward(r->b, px, ids, tg, B, T, 1.0f / (float)vsum, NULL, &l);
        if (s == FL_OK) edge(r, FL_LIVE_FORWARD, snap && a == mine ? "after_fwd" : NULL, "backward");
        if (s == FL_OK && a == mine) phase_line(r, it + 1, "after_fwd");
        if (s == FL_OK && snap && a == mine) {
            for (int k = 0; k < FL_BLIP2_PARTS; k++) r->acts_part[k] = fl_blip2_acts_bytes(r->b, k);
            r->acts_total = r->pool.cur[FL_TAG_ACTS];
        }
        if (s == FL_OK) s = fl_blip2_backward(r->b);
        if (s == FL_OK) edge(r, FL_LIVE_BACKWARD, snap && a == last ? "after_bwd" : NULL, NULL);
        if (s == FL_OK && a == last) phase_line(r, it + 1, "after_bwd");
        ml[a] = l;
        free(ids), free(tg);
    }
    if (s == FL_OK && w > 1) s = fl_b2t_reduce(r, ml, accum);
    for (int a = 0; a < accum; a++) lsum += (double)ml[a] * (double)mv[a];
    if (s == FL_OK && r->cfg->train.max_norm > 0) s = fl_b2t_clip(r, r->cfg->train.max_norm);
    if (s == FL_OK) edge(r, -1, NULL, "optimizer step");
    for (int k = 0; s == FL_OK && k < FL_BLIP2_PARTS; k++)
        if (r->has_opt[k]) s = fl_optim_step(&r->opt[k], (float)lr, 0.0f, NULL);
    if (s == FL_OK) edge(r, FL_LIVE_UPDATED, snap ? "after_opt_step" : NULL, NULL); /* the gradients consumed */
    if (s == FL_OK) phase_line(r, it + 1, "after_opt_step");
    free(px), free(starts), free(mv), free(ml);
    *loss = vsum ? lsum / (double)vsum : 0;
    p->epoch_sum += lsum;
    p->epoch_n += vsum;
    p->tokens += vsum;
    return s;
}


/* PARAMS / GRADS / OPTIM bytes of part k (the bf16-mixed weight copy and the LoRA adapters in PARAMS). */
static void part_bytes(const b2run *r, int k, size_t *pb, size_t *gb, size_t *ob, int *lora) {
    const fl_model *m = fl_blip2_part(r->b, k);
    fl_lora_adapters ad;
    *lora = fl_model_lora_adapters(m, &ad);
    const size_t es = fl_dtype_size(fl_model_store_dtype(m)); /* bf16-true: 2 */
    size_t dense = 0, q4 = 0; /* QLoRA: the 4-bit block linears beside the dense store */
    fl_sizing_param_split(&m->cfg, &r->stg[k], &dense, &q4);
    /* FSDP: this rank's shard (the bf16-mixed copy exists per gathered unit only: GATHER) */
    const int shard = fl_model_provider(m) != NULL;
    if (shard) dense = fl_model_store_numel(m);
    *pb = dense * es + q4 + (*lora ? ad.numel * sizeof(float) : 0) +
          (m->prec.name && !shard ? fl_precision_copy_bytes(&m->prec, m->layout.numel) : 0); /* bf16-mixed copy */
    *gb = fl_model_grads_data(m) ? fl_model_store_numel(m) * es : *lora ? ad.numel * sizeof(float) : 0;
    const fl_optimizer *o = &r->opt[k]; /* this rank's range of the state (ZeRO: its chunk); 8-bit: its blocks */
    *ob = !r->has_opt[k] ? 0 : o->q8.state ? o->q8.state_bytes + o->q8.x_bytes : fl_optim_state_bytes(&o->cfg, o->shard.len);
}

/* The memory of the run: the pool's report (bytes per tag at the snapshots: after set-up, after step 1, at the end)
 * and PARAMS / GRADS / OPTIM by part (ACTS is one arena for the three parts). */
static void memory_report(b2run *r, FILE *f) {
    static const char *const name[FL_BLIP2_PARTS] = {"vision", "qformer", "lm"};
    fprintf(f, "memory by part (MiB):");
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        size_t pb, gb, ob;
        int lora;
        part_bytes(r, k, &pb, &gb, &ob, &lora);
        fprintf(f, "%s %s PARAMS %.3f GRADS %.3f OPTIM %.3f%s", k ? ";" : "", name[k], pb / 1048576.0, gb / 1048576.0,
                ob / 1048576.0, lora ? " (LoRA)" : "");
    }
    fprintf(f, "\n");
    size_t parts = 0;
    fprintf(f, "activations by part (MiB, the first step's arena):");
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fprintf(f, "%s %s ACTS %.3f", k ? ";" : "", name[k], r->acts_part[k] / 1048576.0);
        parts += r->acts_part[k];
    }
    fprintf(f, "; LoRA adapters ACTS %.3f\n", (r->acts_total > parts ? r->acts_total - parts : 0) / 1048576.0);
    if (fl_b2t_sharded(r))
        fprintf(f, "memory of rank 0 (%s: OPTIM holds its chunk of each trained part's state%s)\n",
                fl_dp_stage_name(&r->dp), r->dp.stage == 2 ? "; GRADS: each part's reduced chunk is what stays live" : "");
    fl_mem_print_report(&r->pool, f);
    if (r->opool_ok) {
        fprintf(f, "\nhost tier (CPU offload: %s, outside the device's budget)\n",
                r->dpool_ok ? "the pieces on their way to and from the nvme tier below"
                : r->off.params_host ? "the optimizer state, the parameters' and gradients' shards" : "the optimizer state");
        fl_mem_print_report(&r->opool, f);
    }
    if (r->dpool_ok) {
        const fl_run_config *c = r->cfg;
        fprintf(f, "\nnvme tier (%s in files under '%s')\n", !r->off.param_pool ? "the optimizer state"
                : r->off.state_pool ? "the parameters' and gradients' shards and the optimizer state"
                : "the parameters' and gradients' shards", c->nvme_path[0] ? c->nvme_path : c->out_dir);
        fl_mem_print_report(&r->dpool, f);
    }
}

static size_t trained_count(const b2run *r) {
    size_t n = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (r->has_opt[k]) n += r->pdp[k].fsdp ? fl_blip2_part(r->b, k)->layout.numel : r->opt[k].w.n; /* FSDP: whole */
    return n;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Step k of this session took ms and its loss was loss: the result's figures and the caller's arrays. */
static void record_step(b2run *r, long k, double ms, double loss) {
    fl_blip2_train_result *res = r->res;
    if (k < r->o->n_step_out) {
        if (r->o->step_ms) r->o->step_ms[k] = ms;
        if (r->o->step_loss) r->o->step_loss[k] = loss;
    }
    res->session_steps = k + 1;
    res->last_loss = loss;
    res->train_seconds += ms / 1e3;
    if (k == 0) res->step_ms_mean = ms; /* the first step's alone until there are others */
    else res->step_ms_mean = k == 1 ? ms : (res->step_ms_mean * (double)(k - 1) + ms) / (double)k;
}

/* A row of metrics.csv (rank 0), the language-model trainer's schema (metrics.h, README): one per step, at its last
 * iteration (iter = steps x the accum micro-batches of a step, every rank's), with the step's loss, the mean time of
 * the iterations a rank ran in it (secs / (accum / world), the update included), the LR, the caption targets so far
 * over every rank (total_tokens; tokens: a rank's share) and the step's per rank per second; or a validation's
 * (val_loss); with the pool's bytes per tag now and its peak. */
static void metrics_row(b2run *r, const b2pos *p, int accum, double loss, double secs, double lr, long long tokens,
                        double val) {
    const double per_rank = (double)accum / (r->world > 1 ? r->world : 1); /* a rank's iterations of a step */
    fl_metrics_values mv = {.iter = p->step * accum, .step = p->step, .epoch = p->epoch, .loss = loss,
                            .iter_time = secs / per_rank, .learning_rate = lr, .val_loss = val,
                            .tok_s = secs > 0 ? (double)tokens / (r->world > 1 ? r->world : 1) / secs : NAN,
                            .total_tokens = p->tokens, .comm_sent = NAN};
    for (int k = 0; k < 6; k++) mv.mem[k] = (double)r->pool.cur[k];
    mv.mem_peak = (double)r->pool.peak_total;
    fl_metrics_row(&r->metrics, &mv);
}

static fl_status train(b2run *r) {
    const fl_run_config *c = r->cfg;
    int B = 1, accum = 1;
    FL_TRY(batch_shape(c, &B, &accum));
    if ((size_t)B > r->n_rec)
        return fl_errorf(FL_ERR_INVALID, "%s: %zu training records, fewer than micro_batch_size %d", c->data.json_path,
                         r->n_rec, B);
    if (accum % (r->world > 1 ? r->world : 1))
        return fl_errorf(FL_ERR_INVALID, "train.global_batch_size %d: %d micro-batches of %d per step do not split over "
                         "%d ranks", B * accum, accum, B, r->world);
    const long per_epoch = (long)(r->n_rec / (size_t)B / (size_t)accum);
    long max_steps = c->train.max_steps > 0 ? c->train.max_steps
                     : (c->train.epochs > 0 ? c->train.epochs : 1) * (per_epoch > 0 ? per_epoch : 1);
    const long warm = c->train.lr_warmup_steps > 0 ? c->train.lr_warmup_steps : 0;
    b2pos p = {.order = malloc(r->n_rec * sizeof(size_t))};
    if (!p.order) return fl_errorf(FL_ERR_OOM, "out of host memory");
    for (size_t i = 0; i < r->n_rec; i++) p.order[i] = i;
    char ranks[48] = "";
    if (r->world > 1)
        snprintf(ranks, sizeof ranks, " over %d ranks (%s)", r->world,
                 !fl_b2t_fsdp(r) ? fl_dp_stage_name(&r->dp) : r->pdp[0].node ? "HYBRID_SHARD" : "FULL_SHARD");
    fl_b2t_say(r, "BLIP-2 image-caption fine-tuning: %zu records, micro batch %d x %d accumulated%s, %ld steps; trains %s%s%s"
           "%s (%zu parameters), vision tower %s\n", r->n_rec, B, accum / (r->world > 1 ? r->world : 1), ranks, max_steps,
           r->parts & (1 << FL_BLIP2_VISION) ? "vision " : "", r->parts & (1 << FL_BLIP2_QFORMER) ? "qformer " : "",
           r->parts & (1 << FL_BLIP2_TEXT) ? (r->lora ? "lm(LoRA)" : "lm") : "", "", trained_count(r),
           r->parts & (1 << FL_BLIP2_VISION) ? "trained" : "frozen");
    const fl_model_config *tc = &fl_blip2_part(r->b, FL_BLIP2_TEXT)->cfg;
    const fl_model_config *qc = &fl_blip2_part(r->b, FL_BLIP2_QFORMER)->cfg, *vc = &fl_blip2_part(r->b, 0)->cfg;
    if (tc->dropout_on && tc->dropout_rate > 0 && fl_model_is_s2s(tc))
        fl_b2t_say(r, "text_config.dropout_rate %g is applied in training (the language model's embeddings, attention "
                   "weights, sublayer outputs, FFN, final norms; not in evaluation or generation)\n",
                   (double)tc->dropout_rate);
    if (tc->dropout_on && !fl_model_is_s2s(tc) && (tc->dropout_rate > 0 || tc->attn_dropout_rate > 0))
        fl_b2t_say(r, "text_config.dropout %g / attention_dropout %g are applied in training (the OPT language model's "
                   "attention and FFN outputs / attention weights; not in evaluation or generation)\n",
                   (double)tc->dropout_rate, (double)tc->attn_dropout_rate);
    if (qc->dropout_on && (qc->dropout_rate > 0 || qc->attn_dropout_rate > 0))
        fl_b2t_say(r, "qformer_config.hidden_dropout_prob %g / attention_probs_dropout_prob %g are applied in training "
                   "(the Q-Former's embedding norm and dense outputs / attention weights)\n", (double)qc->dropout_rate,
                   (double)qc->attn_dropout_rate);
    if (vc->dropout_on && vc->attn_dropout_rate > 0)
        fl_b2t_say(r, "vision_config.attention_dropout %g is applied in training (the vision tower's attention weights)"
                   "\n", (double)vc->attn_dropout_rate);
    if (r->n_val)
        fl_b2t_say(r, "%zu train / %zu val records (data.val_split_fraction %g)\n", r->n_rec, r->n_val,
               (double)c->data.val_split_fraction);
    int resumed = 0;
    fl_status s = fl_b2t_resume(r, &p, &resumed);
    r->steps_done = p.step;
    /* logs/metrics.csv (LitGPT's columns; a resumed run keeps the rows up to its checkpoint's step) */
    if (s == FL_OK && !r->rank) s = fl_fs_mkdir_p(c->out_dir);
    if (s == FL_OK && !r->rank) fl_ckpt_clean_tmp(c->out_dir); /* what an interrupted save left */
    if (s == FL_OK && !r->rank)
        s = fl_metrics_open(&r->metrics, c->out_dir, c->logger_name, resumed, resumed ? p.step * accum : -1);
    r->metrics.ranks = r->world; /* tokens = total_tokens / the ranks */
    const long first = p.step;
    for (long it = p.step; s == FL_OK && it < max_steps; it++) {
        const double lr = fl_lr_schedule(c->optimizer.lr, c->train.min_lr, it, warm, max_steps);
        double loss = 0, vl = 0;
        const int every = c->train.memory_snapshot_interval;
        r->snapline = every > 0 && (it < 2 || (it + 1) % every == 0); /* steps 1, 2 and every N-th */
        const double t0 = now_ms();
        const long long tok0 = p.tokens;
        s = step(r, &p, B, accum, it, lr, it == first, &loss);
        const double ms = now_ms() - t0;
        if (s == FL_OK) record_step(r, it - first, ms, loss);
        p.step = it + 1;
        if (s == FL_OK) metrics_row(r, &p, accum, loss, ms / 1e3, lr, p.tokens - tok0, NAN);
        r->steps_done = p.step;
        if (s == FL_OK && (it % (c->train.log_interval > 0 ? c->train.log_interval : 1) == 0 || it + 1 == max_steps))
            fl_b2t_say(r, "step %ld/%ld loss %.6f lr %.3g\n", it + 1, max_steps, loss, lr);
        if (s == FL_OK && r->n_val && p.step % c->eval.interval == 0 && p.step < max_steps) {
            s = validate(r, B, &vl);
            if (s == FL_OK) fl_b2t_say(r, "step %ld val loss %.6f\n", p.step, vl);
            if (s == FL_OK) metrics_row(r, &p, accum, NAN, NAN, NAN, 0, vl);
        }
        const int saved = c->train.save_interval > 0 && p.step % c->train.save_interval == 0;
        if (s == FL_OK && saved) s = fl_b2t_save_step(r, &p); /* rank 0 writes (ZeRO: the state gathered first) */
        if (s == FL_OK && p.step < max_steps && r->o->after_step) r->o->after_step(r->o->stop_ud, p.step);
        if (s == FL_OK && p.step < max_steps && (s = stop_signal(r)) == FL_OK && r->stopped) {
            if (c->train.save_on_signal && !saved) s = fl_b2t_save_step(r, &p);
            break;
        }
    }
    if (r->stopped) { /* no final evaluation or folder: the run goes on from its checkpoint (--resume auto) */
        free(p.order);
        return s;
    }
    if (s == FL_OK && p.epoch_n) fl_b2t_say(r, "epoch %ld average loss %.4f\n", p.epoch + 1, p.epoch_sum / (double)p.epoch_n);
    if (s == FL_OK && r->n_val && c->eval.final_validation) {
        double vl = 0;
        s = validate(r, B, &vl);
        if (s == FL_OK) r->res->val_loss = vl;
        if (s == FL_OK) metrics_row(r, &p, accum, NAN, NAN, NAN, 0, vl);
        if (s == FL_OK) fl_b2t_say(r, "Final evaluation | val loss: %.3f | val ppl: %.3f\n", vl, exp(vl));
    }
    if (s == FL_OK) fl_mem_snapshot(&r->pool, "end");
    if (s == FL_OK && r->o->report && !r->rank) memory_report(r, r->o->report);
    char dir[4096];
    if (s == FL_OK) s = fl_fs_join(dir, sizeof dir, c->out_dir, "final");
    if (s == FL_OK) s = fl_b2t_save_final(r, &p); /* rank 0 writes (FSDP: the ranks gather first) */
    free(p.order);
    if (s == FL_OK && !r->rank) snprintf(r->res->final_dir, sizeof r->res->final_dir, "%s", dir);
    if (s == FL_OK) fl_b2t_say(r, "saved %s%s\n", dir, r->lora ? " (weights with the LoRA adapters merged; adapter/: PEFT)" : "");
    return s;
}

static void close_run(b2run *r) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (r->has_opt[k]) fl_optim_free(&r->opt[k]);
    for (size_t i = 0; r->ids && i < r->n_rec + r->n_val; i++) free(r->ids[i]);
    free(r->ids), free(r->n_ids);
    fl_img_captions_free(&r->caps);
    fl_b2t_fsdp_free(r); /* the gathered units and the bookkeeping, before the parts */
    fl_blip2_free(r->b);
    fl_metrics_close(&r->metrics);
    fl_b2t_dist_free(r);
    if (r->pools_ok) fl_backend_pools_free(&r->pool, &r->hpool);
    if (r->be.name && !r->borrowed) fl_backend_free(&r->be);
}

/* DDP: the ranks' set-up agreed on (a MAX all-reduce of {failed, rank 0 failed}), so that a rank whose set-up failed
 * alone (a file it could not read) does not leave the others waiting in the first reduction: every rank returns, the
 * failed ones say why (rank 0 for all when it failed too), rank 0 that another failed. *quiet: this rank says nothing. */
static fl_status agree_setup(b2run *r, fl_status s, int *quiet) {
    *quiet = 0;
    if (r->world <= 1) return s;
    float v[2] = {s != FL_OK ? 1.0f : 0.0f, !r->rank && s != FL_OK ? 1.0f : 0.0f};
    fl_status c = fl_comm_all_reduce(r->comm, v, v, 2, FL_F32, FL_COMM_MAX);
    if (s != FL_OK) {
        *quiet = r->rank && v[1] > 0;
        return s;
    }
    if (c != FL_OK) return c;
    if (v[0] > 0) {
        *quiet = r->rank != 0;
        return fl_errorf(FL_ERR_INVALID, "another rank's set-up failed (its message above)");
    }
    return FL_OK;
}

/* A rehearsal: o->rehearse_steps steps at the configured LR, no checkpoint, validation or files; o->stop polled. */
static fl_status rehearse(b2run *r) {
    int B = 1, accum = 1;
    FL_TRY(batch_shape(r->cfg, &B, &accum));
    if (accum % (r->world > 1 ? r->world : 1))
        return fl_errorf(FL_ERR_INVALID, "train.global_batch_size %d: %d micro-batches of %d per step do not split over "
                         "%d ranks", B * accum, accum, B, r->world);
    b2pos p = {.order = malloc(r->n_rec * sizeof(size_t) + 1)};
    if (!p.order) return fl_errorf(FL_ERR_OOM, "out of host memory");
    for (size_t i = 0; i < r->n_rec; i++) p.order[i] = i;
    fl_status s = FL_OK;
    for (long it = 0; s == FL_OK && it < r->o->rehearse_steps; it++) {
        const double t0 = now_ms();
        double loss = 0;
        s = step(r, &p, B, accum, it, r->cfg->optimizer.lr, it == 0, &loss);
        if (s == FL_OK) record_step(r, it, now_ms() - t0, loss);
        if (s == FL_OK) r->res->steps = it + 1;
        if (s == FL_OK && it + 1 < r->o->rehearse_steps && r->o->stop && (s = stop_signal(r)) == FL_OK && r->stopped)
            break; /* the lab's stop (its rows rehearse): every rank at the same step */
    }
    if (s == FL_OK && r->o->report && !r->rank) fl_mem_print_report(&r->pool, r->o->report);
    free(p.order);
    return s;
}

/* The result's memory figures from the pool and the parts (before they are freed). */
static void fill_memory(b2run *r) {
    fl_blip2_train_result *res = r->res;
    res->trained = trained_count(r);
    if (r->b) {
        size_t parts = 0;
        for (int k = 0; k < FL_BLIP2_PARTS; k++) {
            int lora;
            part_bytes(r, k, &res->part_params[k], &res->part_grads[k], &res->part_optim[k], &lora);
            res->part_acts[k] = r->acts_part[k];
            parts += r->acts_part[k];
        }
        res->lora_acts = r->acts_total > parts ? r->acts_total - parts : 0;
    }
    if (!r->pools_ok) return;
    res->n_phases = r->pool.n_phases < FL_BLIP2_TRAIN_MAX_PHASES ? r->pool.n_phases : FL_BLIP2_TRAIN_MAX_PHASES;
    memcpy(res->phases, r->pool.phases, (size_t)res->n_phases * sizeof *res->phases);
    memcpy(res->peak, r->pool.peak, sizeof res->peak);
    res->peak_total = r->pool.peak_total;
    res->oom = r->pool.oom;
    res->offload = r->opool_ok;
    for (int k = 0; r->opool_ok && k < FL_TAG_COUNT; k++) res->host_peak[k] = r->opool.peak[k];
    res->host_peak_total = r->opool_ok ? r->opool.peak_total : 0;
    res->nvme = r->dpool_ok;
    for (int k = 0; r->dpool_ok && k < FL_TAG_COUNT; k++) res->nvme_peak[k] = r->dpool.peak[k];
    res->nvme_peak_total = r->dpool_ok ? r->dpool.peak_total : 0;
}

fl_status fl_blip2_train(const fl_run_config *cfg, const fl_blip2_train_opts *o, fl_blip2_train_result *res) {
    static const fl_blip2_train_opts none;
    fl_blip2_train_result own;
    if (!o) o = &none;
    if (!res) res = &own;
    const int plan_n = fl_b2t_plan_ranks(cfg, o); /* FULL_SHARD planned: the ranks rehearse as threads */
    if (plan_n) return fl_b2t_plan_fsdp(cfg, o, plan_n, res);
    memset(res, 0, sizeof *res);
    res->val_loss = NAN;
    b2run r;
    memset(&r, 0, sizeof r);
    r.cfg = cfg, r.o = o, r.res = res;
    r.lora = cfg->command == FL_CMD_FINETUNE_LORA;
    r.given = o->shape, r.borrowed = o->be, r.budget = o->budget, r.synth = o->synth_len;
    r.comm = o->comm, r.rank = o->comm ? fl_comm_rank(o->comm) : 0, r.world = o->comm ? fl_comm_size(o->comm) : 1;
    fl_status s = FL_OK;
    if (o->rehearse_steps > 0 && o->synth_len < 2)
        s = fl_errorf(FL_ERR_INVALID, "BLIP-2: a caption of %d tokens (at least 2)", o->synth_len);
    else if (o->rehearse_steps <= 0 && o->synth_len)
        s = fl_errorf(FL_ERR_INVALID, "BLIP-2: synthetic captions (synth_len %d) are for rehearsals (rehearse_steps > 0)",
                      o->synth_len);
    if (s == FL_OK) s = setup(&r);
    s = agree_setup(&r, s, &res->quiet);
    if (s == FL_OK && (s = fl_b2t_check_data(&r)) != FL_OK) res->quiet = r.rank != 0; /* agreed: rank 0 says it */
    res->set_up = s == FL_OK;
    if (s == FL_OK) s = o->rehearse_steps > 0 ? rehearse(&r) : train(&r);
    if (o->rehearse_steps <= 0) res->steps = r.steps_done;
    res->stopped = r.stopped;
    fill_memory(&r);
    close_run(&r);
    return s;
}
