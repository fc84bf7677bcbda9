/* The training loop (LitGPT's fit()): see include/fitllm/trainer.h.
 *
 * One iteration = one micro-batch forward+backward; every `accum` iterations
 * the optimizer steps. The micro-batches of a step are fetched first so the
 * loss can be normalized by the number of valid targets of the whole step
 * (accumulation == one large batch). */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "core/fs.h"
#include "fitllm/checkpoint.h"
#include "fitllm/generate.h"
#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/peft.h"
#include "fitllm/tokenizer.h"
#include "fitllm/trainer.h"
#include "dp.h"
#include "metrics.h"

typedef struct {
    const fl_run_config *cfg;
    FILE *out;
    int bar;
    fl_backend be;
    int be_ok;
    fl_mem_pool pool;
    fl_mem_pool hpool;          /* host staging when the backend's memory is not host memory (pool.host) */
    int pool_ok;
    /* CPU offload (fl_cfg_offload): the host tier (the backend's host_pool_init, outside the device budget)
     * and the backend the optimizer's update runs on (hbe: a CPU backend when the device's memory is not
     * host memory; else the run's own) */
    fl_mem_pool opool;
    int opool_ok;
    fl_mem_pool dpool;          /* NVMe offload (offload_optimizer_device nvme): the state's disk tier */
    int dpool_ok;
    fl_backend hbe;
    int hbe_ok;
    fl_optim_offload off;
    fl_model model;
    fl_model_storage stg; /* parameter storage of the precision policy */
    int model_ok;
    fl_optimizer opt;
    fl_tokenizer *tok;
    char tok_dir[FL_CFG_PATH];  /* where tokenizer files come from ("" = built-in) */
    fl_dataset *data;
    fl_loader *train, *val;
    fl_metrics metrics;
    int32_t *ids, *tgt;         /* (accum, B, T_max) step buffers of this rank, OTHER */
    fl_micro_batch *mbs;        /* (accum) this rank's micro-batches of the step */
    long *mb_epoch;             /* (G) epoch each global micro-batch of the step was drawn from */
    long long *mb_tokens;       /* (G) padded tokens of each global micro-batch */
    double *mb_stats;           /* (2 G) loss sum and valid targets of each global micro-batch, rank-major */
    double *mb_ms;              /* (accum) wall ms of this rank's micro-batches */
    fl_dp dp;                   /* data parallel: rank, world, communicator (see dp.h) */
    int accum, G, B, T;         /* G = accum x world: micro-batches of one optimizer step, all ranks */
    long max_steps, warmup, steps_per_epoch;
    fl_train_state st;
    char notes[1024];           /* user settings the run could not take as given, one "note: ..." line each */
} trainer;

/* A setting the run adjusts is said, never changed without a word (printed with the run's header). */
static void add_note(trainer *t, const char *fmt, ...) {
    size_t o = strlen(t->notes);
    if (o + 8 >= sizeof t->notes) return;
    va_list ap;
    va_start(ap, fmt);
    o += (size_t)snprintf(t->notes + o, sizeof t->notes - o, "note: ");
    if (o < sizeof t->notes) vsnprintf(t->notes + o, sizeof t->notes - o, fmt, ap);
    va_end(ap);
    o = strlen(t->notes);
    if (o + 1 < sizeof t->notes) t->notes[o] = '\n', t->notes[o + 1] = 0;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int dir_has_run(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while ((e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, "step-", 5) || !strcmp(e->d_name, "final") || !strcmp(e->d_name, "logs")) found = 1;
    closedir(d);
    return found;
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

/* ---- set-up ------------------------------------------------------------------ */

/* name is a whole item of the comma-separated list */
static int list_has(const char *list, const char *name) {
    const size_t n = strlen(name);
    for (const char *q = list; *q;) {
        if (!strncmp(q, name, n) && (q[n] == ',' || !q[n])) return 1;
        const char *comma = strchr(q, ',');
        if (!comma) break;
        q = comma + 1;
    }
    return 0;
}

/* LitGPT's lora_* switches (or a PEFT target list) -> an fl_lora_config. */
fl_status fl_trainer_lora_config(const fl_run_config *c, const fl_model_config *mc, fl_lora_config *lc) {
    char t[256] = "";
    const fl_lora_args *a = &c->lora;
    if (a->target_modules[0]) {
        snprintf(t, sizeof t, "%s", a->target_modules);
    } else {
        /* each switch's targets in the architecture's names (fl_arch_info.lora_switch), each module once, in
         * switch order (GPT-2: q, k, v are all c_attn; PEFT's suffix match makes c_proj both projections) */
        const fl_arch_info *ai = fl_arch_get(mc->arch);
        const int on[5] = {a->query, a->key, a->value, a->projection, a->mlp};
        size_t o = 0;
#define ADD(name) o += (size_t)snprintf(t + o, sizeof t - o, "%s%s", o ? "," : "", name)
        for (int k = 0; k < 5; k++) {
            if (!on[k]) continue;
            char list[128];
            snprintf(list, sizeof list, "%s", ai->lora_switch[k]);
            for (char *save = NULL, *name = strtok_r(list, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
                if (!list_has(t, name)) ADD(name);
            }
        }
        if (a->head) ADD("lm_head");
#undef ADD
    }
    if (!t[0]) return fl_errorf(FL_ERR_INVALID, "finetune_lora: no target modules (set lora_query/lora_value/... or lora_target_modules)");
    return fl_lora_config_init(lc, mc, a->r, a->alpha, a->dropout, a->use_rslora, t);
}

/* The run's model. given (the planner's, fl_trainer_rehearse): that configuration, created and
 * randomly initialized as a preset is (no weights read: the loader's allocations are the random
 * init's, one 4-bit weight's fp32 staging at most). */
static fl_status load_model(trainer *t, const fl_model_config *given) {
    const fl_run_config *c = t->cfg;
    fl_model_config mc;
    const char *ck = c->checkpoint_dir;
    int have_weights = 0;
    int have_cfg = 0; /* pretrain: model_config fields, a config.json, or model_name */
    if (!given && c->command == FL_CMD_PRETRAIN) FL_TRY(fl_cfg_model_config(c, &mc, &have_cfg));
    if (given) {
        FL_TRY(fl_model_init_ex(&t->model, given, &t->be, &t->pool, &t->stg));
        t->model_ok = 1;
        FL_TRY(fl_model_init_random_ex(&t->model, c->seed));
    } else if (have_cfg) {
        FL_TRY(fl_model_init_ex(&t->model, &mc, &t->be, &t->pool, &t->stg));
        t->model_ok = 1;
        FL_TRY(fl_model_init_random_ex(&t->model, c->seed));
        if (ck[0]) { FL_TRY(fl_hf_load_weights(&t->model, ck)); have_weights = 1; }
    } else if (ck[0] && !exists(ck)) {
        /* A preset name: random init (for speed/memory experiments without weights). */
        fl_status s = fl_preset_find(ck, &mc);
        if (s != FL_OK) {
            char why[1024]; /* fl_errorf must not read the message it is writing */
            snprintf(why, sizeof why, "%s", fl_error_message());
            return fl_errorf(FL_ERR_NOT_FOUND, "checkpoint_dir '%s' is neither a model folder nor a preset (%s)", ck,
                             why);
        }
        FL_TRY(fl_model_init_ex(&t->model, &mc, &t->be, &t->pool, &t->stg));
        t->model_ok = 1;
        FL_TRY(fl_model_init_random_ex(&t->model, c->seed));
    } else if (ck[0] && c->init_random) {
        /* --init random: the folder's (or config.json's) shape, fresh weights */
        char cp[FL_CFG_PATH + 16];
        struct stat st;
        if (stat(ck, &st) == 0 && S_ISDIR(st.st_mode)) snprintf(cp, sizeof cp, "%s/config.json", ck);
        else snprintf(cp, sizeof cp, "%s", ck);
        FL_TRY(fl_hf_load_config(cp, &mc));
        FL_TRY(fl_model_init_ex(&t->model, &mc, &t->be, &t->pool, &t->stg));
        t->model_ok = 1;
        FL_TRY(fl_model_init_random_ex(&t->model, c->seed));
    } else if (ck[0]) {
        int loaded = 0;
        FL_TRY(fl_model_load_auto_ex(&t->model, ck, &t->be, &t->pool, &t->stg, &loaded));
        t->model_ok = 1;
        have_weights = loaded;
        if (!loaded) FL_TRY(fl_model_init_random_ex(&t->model, c->seed));
    } else {
        return fl_errorf(FL_ERR_INVALID, "no model: give checkpoint_dir%s",
                         c->command == FL_CMD_PRETRAIN ? ", model_name or model_config" : "");
    }
    (void)have_weights;
    if (c->train.tie_embeddings >= 0 && c->train.tie_embeddings != t->model.cfg.tie_embeddings)
        return fl_errorf(FL_ERR_UNSUPPORTED, "train.tie_embeddings=%d differs from the model's tie_word_embeddings=%d",
                         c->train.tie_embeddings, t->model.cfg.tie_embeddings);
    return FL_OK;
}

/* Tokenizer: the model folder's, an explicit tokenizer_dir, or the built-in bytes. */
static fl_status load_tokenizer(trainer *t) {
    const fl_run_config *c = t->cfg;
    const char *ck = c->checkpoint_dir;
    const char *td = c->tokenizer_dir[0] ? c->tokenizer_dir : NULL;
    char beside[FL_CFG_PATH];
    if (!td && ck[0] && exists(ck)) {
        struct stat st;
        if (stat(ck, &st) == 0 && S_ISDIR(st.st_mode)) {
            td = ck;
        } else { /* a model file (llama2.c's stories260K.bin): the tokenizer beside it (tok512.bin) */
            const char *slash = strrchr(ck, '/');
            snprintf(beside, sizeof beside, "%.*s", slash ? (int)(slash - ck) : 1, slash ? (slash == ck ? "/" : ck) : ".");
            if (fl_io_has_tokenizer(beside)) td = beside;
        }
    }
    if (td) {
        FL_TRY(fl_tok_load(&t->tok, td));
        snprintf(t->tok_dir, sizeof t->tok_dir, "%s", td);
    } else {
        FL_TRY(fl_tok_builtin_bytes(&t->tok));
    }
    if (fl_tok_vocab_size(t->tok) > t->model.cfg.vocab_size)
        return fl_errorf(FL_ERR_INVALID, "tokenizer (%s, %d ids%s%s%s) does not fit the model's vocab_size %d%s",
                         fl_tok_kind(t->tok), fl_tok_vocab_size(t->tok), td ? ", from '" : "", td ? td : "",
                         td ? "'" : "", t->model.cfg.vocab_size, td && td == beside ? "; give the model's with "
                         "--tokenizer_dir" : "");
    return FL_OK;
}

static int ds_truncated(const fl_dataset *d) { return fl_data_get_stats(d)->n_truncated > 0; }

static fl_status load_data(trainer *t) {
    const fl_run_config *c = t->cfg;
    fl_data_config dc = c->data;
    dc.max_seq_length = c->train.max_seq_length;
    /* LitGPT's pretrain cuts the token stream into blocks of the model's context
     * (model.max_seq_length = block_size) unless train.max_seq_length says less */
    if (dc.kind == FL_DATA_TEXTFILES && dc.max_seq_length <= 0) dc.max_seq_length = t->model.cfg.max_seq;
    const int ctx = t->model.cfg.max_seq;
    if (c->train.max_seq_length > ctx) {
        /* LitGPT's pretrain: min(train.max_seq_length, block_size); longer blocks would only be cut */
        if (dc.kind == FL_DATA_TEXTFILES) dc.max_seq_length = ctx;
        add_note(t, "train.max_seq_length %d is more than the model's %d positions (its context): samples are cut to "
                 "%d tokens", c->train.max_seq_length, ctx, ctx);
    }
    if (dc.kind == FL_DATA_ALPACA && !dc.json_path[0])
        snprintf(dc.json_path, sizeof dc.json_path, "data/alpaca/alpaca_data_cleaned_archive.json");
    FL_TRY(fl_data_load(&t->data, &dc, t->tok));
    if (fl_data_count(t->data, FL_SPLIT_TRAIN) == 0) return fl_errorf(FL_ERR_INVALID, "the training split is empty");
    /* Longest sample decides the activation arena (LitGPT sets model.max_seq_length the same way). */
    int longest = 2;
    for (int s = 0; s < FL_SPLIT_COUNT; s++)
        for (size_t i = 0; i < fl_data_count(t->data, (fl_split)s); i++) {
            int n = fl_data_get(t->data, (fl_split)s, i)->len;
            if (n > longest) longest = n;
        }
    int T = longest - 1; /* inputs are the sample minus its last token */
    if (c->train.max_seq_length > 0 && T > c->train.max_seq_length) T = c->train.max_seq_length;
    if (T > t->model.cfg.max_seq) T = t->model.cfg.max_seq;
    if (c->train.max_seq_length <= 0 && longest - 1 > ctx) /* null: the longest sample would decide */
        add_note(t, "the longest sample has %d input tokens, more than the model's %d positions (its context): "
                 "samples are cut to %d tokens (train.max_seq_length null)", longest - 1, ctx, ctx);
    t->T = T;
    t->B = c->train.micro_batch_size;
    /* every target masked (an empty response with mask_prompt, responses cut away by
     * max_seq_length): the loss is 0/0 and nothing would be learnt; say so before training */
    size_t n_train = fl_data_count(t->data, FL_SPLIT_TRAIN), n_targets = 0;
    for (size_t i = 0; i < n_train && !n_targets; i++) {
        const fl_sample *sm = fl_data_get(t->data, FL_SPLIT_TRAIN, i);
        for (int j = 1; j < sm->len && j <= T; j++) n_targets += sm->labels[j] != dc.ignore_index;
    }
    if (!n_targets)
        return fl_errorf(FL_ERR_INVALID,
                         "nothing to learn from: every target token of the %zu training samples is masked "
                         "(ignore_index %d)%s; check data.mask_prompt, the responses of the dataset and "
                         "train.max_seq_length", n_train, dc.ignore_index,
                         ds_truncated(t->data) ? ", some after truncation to max_seq_length" : "");
    FL_TRY(fl_loader_init(&t->train, t->data, FL_SPLIT_TRAIN, t->B, T, c->seed, 1));
    if (fl_data_count(t->data, FL_SPLIT_VAL) > 0) FL_TRY(fl_loader_init(&t->val, t->data, FL_SPLIT_VAL, t->B, T, c->seed, 0));
    return FL_OK;
}

static void schedule(trainer *t) {
    const fl_train_args *a = &t->cfg->train;
    t->accum = a->global_batch_size / (t->cfg->devices * t->cfg->num_nodes) / a->micro_batch_size;
    t->G = t->accum * t->dp.world;
    long bpe = (long)fl_loader_batches_per_epoch(t->train);
    t->steps_per_epoch = bpe / t->G > 0 ? bpe / t->G : 1;
    long ms = -1;
    if (a->epochs > 0) ms = a->epochs * t->steps_per_epoch;
    if (a->max_steps >= 0 && (ms < 0 || a->max_steps < ms)) ms = a->max_steps;
    if (a->max_tokens > 0) {
        long by_tokens = (long)((a->max_tokens + (long long)a->global_batch_size * t->T - 1) /
                                ((long long)a->global_batch_size * t->T));
        if (ms < 0 || by_tokens < ms) ms = by_tokens;
    }
    if (ms < 0) ms = t->steps_per_epoch;
    t->max_steps = ms;
    long w = 0;
    if (a->lr_warmup_fraction >= 0) w = (long)ceil(a->lr_warmup_fraction * t->steps_per_epoch);
    else if (a->lr_warmup_steps > 0) w = a->lr_warmup_steps;
    t->warmup = w < ms ? w : ms;
    if (w > ms)
        add_note(t, "the warm-up of %ld steps (%s) is longer than the run's %ld steps: the learning rate rises over "
                 "all %ld and never decays", w, a->lr_warmup_fraction >= 0 ? "train.lr_warmup_fraction" :
                 "train.lr_warmup_steps", ms, ms);
    if (bpe < t->G)
        add_note(t, "the training split has %ld micro-batches, fewer than the %d of one optimizer step: an epoch is "
                 "counted as one step", bpe, t->G);
}

/* ---- evaluation ---------------------------------------------------------------- */

static fl_status validate(trainer *t, int max_iters, double *loss) {
    *loss = NAN;
    if (!t->val) return FL_OK;
    fl_loader_state s0 = {t->cfg->seed, 0, 0};
    FL_TRY(fl_loader_set_state(t->val, &s0));
    long n = (long)fl_loader_batches_per_epoch(t->val);
    if (max_iters < n) n = max_iters;
    fl_model_lora_set_train(&t->model, 0);
    double sum = 0;
    long cnt = 0;
    fl_mem_set_phase(&t->pool, "validation");
    fl_batch b;
    for (long k = 0; k < n; k++) {
        int ne;
        FL_TRY(fl_loader_next(t->val, &b, &ne));
        if (!fl_dp_mine(&t->dp, k)) continue; /* data parallel: each rank evaluates its share */
        FL_TRY(fl_model_forward(&t->model, b.ids, b.targets, b.B, b.T, 0.0f, NULL));
        sum += t->model.loss_sum;
        cnt += t->model.n_valid;
    }
    /* FULL_SHARD: a forward gathers every unit from all ranks, so every rank runs as many; a rank
     * without a batch in the last round runs the last one again and discards it */
    if (t->dp.fsdp && n % t->dp.world && t->dp.rank >= n % t->dp.world)
        FL_TRY(fl_model_forward(&t->model, b.ids, b.targets, b.B, b.T, 0.0f, NULL));
    fl_model_lora_set_train(&t->model, 1);
    double v[2] = {sum, (double)cnt};
    FL_TRY(fl_dp_sum(&t->dp, v, 2));
    sum = v[0];
    cnt = (long)v[1];
    /* token-weighted mean over the evaluated batches */
    if (cnt > 0) *loss = sum / (double)cnt;
    if (cnt > 0 && !isfinite(*loss)) return fl_errorf(FL_ERR_NONFINITE, "the validation loss is %s", isnan(*loss) ? "NaN" : "inf");
    return FL_OK;
}

/* The evaluation sample's model part (generate_example's, and the planner's): the adapters in
 * evaluation mode, a KV cache of n + eval.max_new_tokens positions, fl_generate at temperature
 * 0.8 from the n prompt ids, the cache freed. eos: NULL or one id. cb, ud: fl_generate's. */
static fl_status sample_tokens(trainer *t, const int32_t *ids, int n, const int32_t *eos, int32_t *gen, int *n_out,
                               fl_gen_callback cb, void *ud) {
    const fl_run_config *c = t->cfg;
    fl_kv_cache kv;
    memset(&kv, 0, sizeof kv);
    fl_model_lora_set_train(&t->model, 0);
    fl_status s = fl_kv_cache_init(&kv, &t->model, n + c->eval.max_new_tokens);
    if (s == FL_OK) {
        fl_gen_params gp;
        fl_gen_params_default(&gp);
        gp.max_new_tokens = c->eval.max_new_tokens;
        gp.temperature = 0.8f;
        gp.seed = c->seed;
        fl_gen_stop why;
        s = fl_generate(&t->model, &kv, ids, n, &gp, eos, eos ? 1 : 0, gen, n_out, &why, cb, ud);
        fl_kv_cache_free(&kv);
    }
    fl_model_lora_set_train(&t->model, 1);
    return s;
}

/* LitGPT's generate_example: the fixed instruction through the prompt style,
 * sampled at temperature 0.8, printed to show what the model has learned.
 * Pretraining has no instructions: the prompt is the first FL_PRETRAIN_PROMPT_TOKENS
 * tokens of the first validation text, and the model continues it. */
static fl_status generate_example(trainer *t) {
    const fl_run_config *c = t->cfg;
    if (!t->out || c->eval.max_new_tokens <= 0) return FL_OK;
    if (t->dp.fsdp) { /* decoding token by token would gather every block for every token */
        fprintf(t->out, "(sample generation skipped: the parameters are sharded (FULL_SHARD); generate from a "
                "checkpoint with fitllm generate)\n");
        return FL_OK;
    }
    const char *instruction = "Recommend a movie for me to watch during the weekend and explain the reason.";
    char *prompt = NULL, *text = NULL;
    int32_t *ids = NULL, *gen = NULL;
    size_t n = 0, len = 0;
    int n_out = 0;
    int32_t eos = -1;
    fl_status s = FL_OK;
    if (c->command == FL_CMD_PRETRAIN && t->data && fl_data_count(t->data, FL_SPLIT_VAL) > 0) {
        const fl_sample *sm = fl_data_get(t->data, FL_SPLIT_VAL, 0);
        n = (size_t)(sm->len - 1 < FL_PRETRAIN_PROMPT_TOKENS ? sm->len - 1 : FL_PRETRAIN_PROMPT_TOKENS);
        if (n < 1) n = 1;
        ids = malloc(n * sizeof *ids);
        if (!ids) s = fl_errorf(FL_ERR_OOM, "out of host memory");
        else memcpy(ids, sm->ids, n * sizeof *ids);
        size_t pl = 0;
        if (s == FL_OK) s = fl_tok_decode(t->tok, ids, n, 1, &prompt, &pl);
        instruction = prompt; /* printed before the continuation */
    } else {
        s = fl_data_format_prompt(c->data.prompt_style[0] ? c->data.prompt_style : "alpaca", instruction, "", &prompt);
        if (s == FL_OK) s = fl_tok_encode(t->tok, prompt, strlen(prompt), -1, 0, &ids, &n);
    }
    int cap = (int)n + c->eval.max_new_tokens;
    if (s == FL_OK && cap > t->model.cfg.max_seq) {
        fprintf(t->out, "(sample generation skipped: prompt of %zu tokens + eval.max_new_tokens %d exceeds the "
                "context of %d)\n", n, c->eval.max_new_tokens, t->model.cfg.max_seq);
        goto out;
    }
    gen = malloc((size_t)c->eval.max_new_tokens * sizeof *gen);
    if (s == FL_OK && !gen) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    if (s == FL_OK) eos = fl_tok_eos_id(t->tok);
    if (s == FL_OK) s = sample_tokens(t, ids, (int)n, eos >= 0 ? &eos : NULL, gen, &n_out, NULL, NULL);
    if (s == FL_OK) s = fl_tok_decode(t->tok, gen, (size_t)n_out, 1, &text, &len);
    /* pretrain: the text prefix and its continuation read as one text */
    if (s == FL_OK) fprintf(t->out, "%s%s%s\n", instruction, c->command == FL_CMD_PRETRAIN ? "" : "\n", text);
out:
    free(gen);
    free(text);
    free(ids);
    free(prompt);
    return s;
}

/* ---- output -------------------------------------------------------------------- */

static void bar_clear(trainer *t) {
    if (t->bar && t->out) fputs("\r\033[K", t->out);
}

/* "1h02m", "3m05s", "42s" */
static void fmt_duration(double s, char *buf, size_t n) {
    long v = s > 0 ? (long)(s + 0.5) : 0;
    if (v >= 3600) snprintf(buf, n, "%ldh%02ldm", v / 3600, v / 60 % 60);
    else if (v >= 60) snprintf(buf, n, "%ldm%02lds", v / 60, v % 60);
    else snprintf(buf, n, "%lds", v);
}

/* Remaining training time: the mean step time measured in this session times the steps
 * left, capped by what train.max_time leaves. Evaluation and checkpoint time are not in
 * it (they are not training time either). Returns -1 before anything was measured. */
double fl_trainer_eta(double session_seconds, long session_steps, long steps_left, double max_time,
                      double train_seconds) {
    if (session_steps <= 0 || session_seconds <= 0) return -1;
    double eta = session_seconds / (double)session_steps * (double)(steps_left > 0 ? steps_left : 0);
    if (max_time > 0) {
        double left = max_time - train_seconds;
        if (left < eta) eta = left > 0 ? left : 0;
    }
    return eta;
}

static void bar_draw(trainer *t, long step, double eta) {
    if (!t->bar || !t->out) return;
    int w = 30, fill = (int)(w * (double)step / (double)(t->max_steps > 0 ? t->max_steps : 1));
    if (fill > w) fill = w;
    char e[32] = "--";
    if (eta >= 0) fmt_duration(eta, e, sizeof e);
    fprintf(t->out, "\r[%.*s%*s] step %ld/%ld, ETA %s", fill, "##############################", w - fill, "", step,
            t->max_steps, e);
    fflush(t->out);
}

static void print_box(trainer *t, const fl_trainer_result *r) {
    if (!t->out) return;
    char b[32];
    double secs = r->train_seconds > 0 ? r->train_seconds : 1e-9;
    fprintf(t->out, "\n+-------------------------------------------------------------+\n");
    fprintf(t->out, "| %-28s %30lld |\n", "input tokens (non-prompt)", r->tokens_real - r->tokens_prompt);
    fprintf(t->out, "| %-28s %30lld |\n", "tokens with prompt", r->tokens_real);
    fprintf(t->out, "| %-28s %30lld |\n", "total tokens with padding", r->tokens_padded);
    fprintf(t->out, "| %-28s %28.2f s |\n", "training time", r->train_seconds);
    fprintf(t->out, "| %-28s %30.1f |\n", "tokens/s (with prompt)", r->tokens_real / secs);
    fprintf(t->out, "| %-28s %30.4f |\n", "TFLOP/s (model FLOPs)", t->st.flops / secs / 1e12);
    for (int k = 0; k < FL_TAG_COUNT; k++) {
        char lbl[40];
        snprintf(lbl, sizeof lbl, "peak %s", fl_mem_tag_name((fl_mem_tag)k));
        fprintf(t->out, "| %-28s %30s |\n", lbl, fl_fmt_bytes(r->peak[k], b, sizeof b));
    }
    fprintf(t->out, "| %-28s %30s |\n", "peak total", fl_fmt_bytes(r->peak_total, b, sizeof b));
    if (r->offload) { /* CPU offload: the host tier beside the device */
        fprintf(t->out, "| %-28s %30s |\n", "host tier (offload) OPTIM", fl_fmt_bytes(r->host_peak[FL_TAG_OPTIM], b, sizeof b));
        fprintf(t->out, "| %-28s %30s |\n", "host tier (offload) total", fl_fmt_bytes(r->host_peak_total, b, sizeof b));
    }
    if (r->nvme)
        fprintf(t->out, "| %-28s %30s |\n", "nvme tier (offload) OPTIM", fl_fmt_bytes(r->nvme_peak[FL_TAG_OPTIM], b, sizeof b));
    if (t->dp.world > 1) {
        /* in units of the whole model's trainable gradients (ZeRO's psi; under FULL_SHARD opt.n is
         * this rank's shard), said in words: DDP's all-reduce sends 2 (N-1)/N of it */
        size_t n_grad = t->dp.fsdp ? t->model.layout.numel : t->opt.n;
        double psi = (double)n_grad * fl_dtype_size(t->opt.gt);
        char g[32], line[96];
        fprintf(t->out, "| %-28s %30s |\n", "sent per step (this rank)",
                fl_fmt_bytes((size_t)r->comm_sent_last_step, b, sizeof b));
        snprintf(line, sizeof line, "= %.2f x the model's gradients (%s)",
                 psi > 0 ? (double)r->comm_sent_last_step / psi : 0.0, fl_fmt_bytes((size_t)psi, g, sizeof g));
        fprintf(t->out, "| %59s |\n", line);
    }
    fprintf(t->out, "+-------------------------------------------------------------+\n");
}

static void mem_values(const fl_mem_pool *p, fl_metrics_values *v) {
    for (int k = 0; k < 6; k++) v->mem[k] = (double)p->cur[k];
    v->mem_peak = (double)p->peak_total;
    v->comm_sent = NAN;
}

/* A diverged run (FL_ERR_NONFINITE from the step, the update or evaluation):
 * say where, what to try, and which checkpoint is the last good one. */
static fl_status diverged(const trainer *t, fl_status s, long step, long iter) {
    if (s != FL_ERR_NONFINITE) return s;
    char what[1024], last[FL_CFG_PATH + 300], kept[FL_CFG_PATH + 400];
    snprintf(what, sizeof what, "%s", fl_error_message());
    if (fl_ckpt_find_latest(t->cfg->out_dir, last, sizeof last) == FL_OK) {
        const char *base = strrchr(last, '/') ? strrchr(last, '/') + 1 : last;
        long saved = -1;
        if (sscanf(base, "step-%ld", &saved) == 1 && saved == step - 1 && iter > t->st.iter)
            /* this step's forward read the weights of that checkpoint: they are the ones that diverged */
            snprintf(kept, sizeof kept, "'%s' holds the weights this loss came from: resume from an earlier "
                     "checkpoint with --resume <dir>", last);
        else
            snprintf(kept, sizeof kept, "the last good checkpoint, '%s', is kept", last);
    } else
        snprintf(kept, sizeof kept, "no checkpoint had been saved yet");
    return fl_errorf(FL_ERR_NONFINITE,
                     "training diverged at step %ld (iter %ld): %s; stopped without saving final/ (%s). "
                     "hint: lower the learning rate (--optimizer.lr, now %g), clip gradients (--train.max_norm 1.0) "
                     "or warm up longer (--train.lr_warmup_steps)",
                     step, iter, what, kept, t->cfg->optimizer.lr);
}

/* Refuse to save weights an update has pushed to inf/NaN (a finite loss can
 * still give a huge step): the last good checkpoint must not be rotated away. */
static fl_status check_weights(trainer *t) {
    int found = 0;
    if (t->dp.fsdp) FL_TRY(fl_fsdp_check_finite(&t->dp, &t->opt, &found)); /* every rank's shard */
    else FL_TRY(t->be.check_finite(&t->be, t->opt.p, t->opt.pt, t->opt.n, 1.0f, &found));
    if (found) return fl_errorf(FL_ERR_NONFINITE, "the weights hold inf/NaN after the update");
    return FL_OK;
}

/* The step-* checkpoint of the current step (collective). rotate: delete the older ones beyond
 * train.keep_checkpoints (not while the loss is above the divergence limit: they may be the last
 * good ones). */
static fl_status save_step(trainer *t, int lead, int rotate) {
    const fl_run_config *cfg = t->cfg;
    char name[32];
    snprintf(name, sizeof name, "step-%06ld", t->st.step);
    bar_clear(t);
    if (t->out) fprintf(t->out, "Saving checkpoint to '%s/%s'\n", cfg->out_dir, name);
    fl_mem_set_phase(&t->pool, "checkpoint");
    FL_TRY(diverged(t, check_weights(t), t->st.step, t->st.iter));
    /* the ranks hold the same weights (and, but under ZeRO, state): one writer, the single-process
     * format; ZeRO's state chunks travel to rank 0 first (collective) */
    FL_TRY(fl_dp_ckpt_save(&t->dp, lead, cfg->out_dir, name, &t->model, &t->opt, &t->st, cfg,
                           t->tok_dir[0] ? t->tok_dir : NULL));
    if (lead && rotate) fl_ckpt_rotate(cfg->out_dir, cfg->train.keep_checkpoints);
    return FL_OK;
}

/* ---- the run --------------------------------------------------------------------- */

static void cleanup(trainer *t) {
    fl_metrics_close(&t->metrics);
    if (t->pool_ok) {
        fl_mem_free(fl_mem_host_pool(&t->pool), t->ids);
        fl_mem_free(fl_mem_host_pool(&t->pool), t->tgt);
    }
    free(t->mbs);
    free(t->mb_epoch);
    free(t->mb_tokens);
    free(t->mb_stats);
    free(t->mb_ms);
    fl_dp_done(&t->dp);
    fl_loader_free(t->train);
    fl_loader_free(t->val);
    fl_data_free(t->data);
    fl_tok_free(t->tok);
    fl_fsdp_free(&t->dp);
    fl_optim_free(&t->opt);
    if (t->model_ok) fl_model_free(&t->model);
    if (t->pool_ok) fl_backend_pools_free(&t->pool, &t->hpool);
    if (t->dpool_ok) fl_mem_pool_free(&t->dpool);
    if (t->opool_ok) fl_mem_pool_free(&t->opool);
    if (t->hbe_ok) fl_cpu_backend_free(&t->hbe);
    if (t->be_ok) fl_backend_free(&t->be);
}

/* cleanup after a failure keeps the failure's message: tearing down what was in flight (FSDP's
 * gathers on an aborted communicator) records errors of its own */
static void cleanup_keep_error(trainer *t, fl_status s) {
    char *keep = s != FL_OK ? strdup(fl_error_message()) : NULL;
    cleanup(t);
    if (keep) fl_errorf(s, "%s", keep);
    free(keep);
}

static fl_status resume_if_asked(trainer *t, int *resumed) {
    const char *r = t->cfg->resume;
    char path[FL_CFG_PATH + 300];
    *resumed = 0;
    if (!strcmp(r, "false")) return FL_OK;
    if (!strcmp(r, "true") || !strcmp(r, "auto")) {
        fl_status s = fl_ckpt_find_latest(t->cfg->out_dir, path, sizeof path);
        if (s == FL_ERR_NOT_FOUND && !strcmp(r, "auto")) return FL_OK;
        if (s != FL_OK) return fl_error_prefix(s, "--resume true");
    } else {
        snprintf(path, sizeof path, "%s", r);
    }
    FL_TRY(fl_dp_ckpt_load(&t->dp, path, &t->model, &t->opt, &t->st)); /* ZeRO: each rank keeps its chunk */
    FL_TRY(fl_loader_set_state(t->train, &t->st.loader));
    if (t->out) fprintf(t->out, "Resuming training from %s (step %ld, iter %ld)\n", path, t->st.step, t->st.iter);
    *resumed = 1;
    return FL_OK;
}

fl_status fl_trainer_storage(const fl_run_config *c, const fl_precision *p, fl_model_storage *st) {
    fl_model_storage_for(p, st);
    if (c->command != FL_CMD_FINETUNE_LORA || !c->lora.quantize[0]) return FL_OK;
    fl_q4_type qt;
    FL_TRY(fl_q4_parse_mode(c->lora.quantize, &qt, &st->q4_double_quant));
    st->quant4 = 1; /* QLoRA: the blocks' linear weights in 4 bits */
    st->q4_type = qt;
    return FL_OK;
}

/* ---- the pieces fl_trainer_run and fl_trainer_rehearse share ------------------------------
 * The planner runs these same functions on the null backend (fl_trainer_rehearse): whatever
 * they allocate is what the plan shows, so a change here is planned without touching plan.c. */

/* "model load": the model (given: see load_model), its precision policy's compute copy, then
 * the after_load snapshot (the weights alone). */
static fl_status setup_model(trainer *t, const fl_precision *prec, const fl_model_config *given) {
    fl_mem_set_phase(&t->pool, "model load");
    FL_TRY(load_model(t, given));
    FL_TRY(fl_model_set_precision(&t->model, prec));
    fl_mem_snapshot(&t->pool, "after_load");
    return FL_OK;
}

/* CPU offload (ZeRO-Offload, --strategy deepspeed_stage_{1,2}_offload): the host tier, from the backend's
 * host_pool_init (cuda: page-locked memory; null: counted fake addresses) without a budget, and the backend
 * the update runs on: the run's own where its memory is host memory (cpu, ref, cuda-emu) or where it
 * computes nothing (the planner's null), else a CPU backend with the run's threads. */
static fl_status setup_offload(trainer *t, const fl_strategy_choice *sc) {
    if (!sc->offload) return FL_OK;
    const fl_backend *be = &t->be;
    FL_TRY(be->host_pool_init ? be->host_pool_init(be, &t->opool, "host (offload)", 0)
                              : fl_mem_pool_init(&t->opool, "host (offload)", 0));
    t->opool_ok = 1;
    if (be->host_memory || be->discards) {
        t->off.be = be;
    } else {
        FL_TRY(fl_error_prefix(fl_cpu_backend_init(&t->hbe, t->cfg->threads), "CPU offload: the host's optimizer"));
        t->hbe_ok = 1;
        t->off.be = &t->hbe;
    }
    t->off.pool = &t->opool;
    t->dp.offload = &t->off;
    if (strcmp(t->cfg->offload_device, "nvme")) return FL_OK;
    /* NVMe (ZeRO-Infinity's offload_optimizer device nvme): the state in files under nvme_path (out_dir by
     * default, made here: the files are unlinked at creation, so an OOM still leaves no files); the plan's
     * null backend stands it in with its counted fake addresses */
    if (be->discards) {
        FL_TRY(be->host_pool_init(be, &t->dpool, "nvme (offload)", 0));
    } else {
        const char *dir = t->cfg->nvme_path[0] ? t->cfg->nvme_path : t->cfg->out_dir;
        if (!t->cfg->nvme_path[0]) FL_TRY(fl_fs_mkdir_p(dir));
        FL_TRY(fl_mem_disk_pool_init(&t->dpool, "nvme (offload)", dir));
    }
    t->dpool_ok = 1;
    t->off.state_pool = &t->dpool;
    return FL_OK;
}

/* "setup": gradients (or the LoRA adapters), optimizer state, the activation arena for
 * (t->B, t->T) and the step's buffers for t->accum micro-batches (t->G global). */
static fl_status setup_training(trainer *t, const fl_run_config *rcfg, const fl_strategy_choice *sc) {
    const fl_run_config *cfg = t->cfg;
    fl_mem_set_phase(&t->pool, "setup");
    if (cfg->command == FL_CMD_FINETUNE_LORA) {
        /* adapters only: the base stays frozen and needs no gradient buffer */
        fl_lora_config lc;
        FL_TRY(fl_trainer_lora_config(cfg, &t->model.cfg, &lc));
        FL_TRY(fl_model_lora_init(&t->model, &lc, cfg->seed));
    } else {
        FL_TRY(fl_fsdp_init(&t->dp, rcfg, &t->model)); /* FULL_SHARD: the gathered units' compute copy */
        FL_TRY(fl_model_alloc_grads(&t->model));      /* (sharded: of the gradients) */
    }
    FL_TRY(setup_offload(t, sc));
    FL_TRY(fl_dp_optim_init(&t->dp, rcfg, &t->opt, &t->model)); /* ZeRO: state for this rank's chunk only; offload:
                                                                  * in the host tier */
    FL_TRY(fl_dp_check(&t->dp, &t->opt));
    if (t->opt.use_loss_scale && cfg->loss_scale_init > 0) t->opt.ls.scale = cfg->loss_scale_init;
    t->model.act_ckpt = sc->act_ckpt; /* given, or LitGPT's default under auto's FSDP */
    FL_TRY(fl_model_alloc_acts(&t->model, t->B, t->T));
    size_t per = (size_t)t->B * t->T;
    /* the step's token ids and targets: host memory (the loader writes them; the forward uploads) */
    fl_status s = fl_mem_alloc(fl_mem_host_pool(&t->pool), FL_TAG_OTHER, (size_t)t->accum * per * sizeof(int32_t),
                               (void **)&t->ids);
    if (s == FL_OK)
        s = fl_mem_alloc(fl_mem_host_pool(&t->pool), FL_TAG_OTHER, (size_t)t->accum * per * sizeof(int32_t),
                         (void **)&t->tgt);
    if (s != FL_OK) return fl_error_prefix(s, "the step's token ids and targets (%d x %d x %d)", t->accum, t->B, t->T);
    t->mbs = calloc((size_t)t->accum, sizeof *t->mbs);
    t->mb_epoch = calloc((size_t)t->G, sizeof *t->mb_epoch);
    t->mb_tokens = calloc((size_t)t->G, sizeof *t->mb_tokens);
    t->mb_stats = calloc((size_t)t->G * 2, sizeof *t->mb_stats);
    t->mb_ms = calloc((size_t)t->accum, sizeof *t->mb_ms);
    if (!t->mbs || !t->mb_epoch || !t->mb_tokens || !t->mb_stats || !t->mb_ms)
        return fl_errorf(FL_ERR_OOM, "out of host memory");
    return FL_OK;
}

/* One optimizer step over this rank's fetched micro-batches t->mbs: forward + backward of each
 * (gradients accumulate locally; the memory snapshots are fl_train_micro's), the reduction over
 * the ranks, the update. iter0: global micro-batches before this step; step_valid: the valid
 * targets of the whole step (0: nothing to learn, no update). (loss sum, valid) per micro-batch
 * go to this rank's slots of t->mb_stats. */
static fl_status train_step(trainer *t, long iter0, long step_valid, float lr, fl_step_result *sr) {
    const fl_run_config *cfg = t->cfg;
    fl_model_zero_grads(&t->model);
    memset(sr, 0, sizeof *sr);
    double *mine = t->mb_stats + (size_t)t->dp.rank * 2 * t->accum; /* (loss sum, valid) per k */
    for (int k = 0; k < t->accum; k++) {
        double it0 = now_s(), ls_k = 0;
        long nv_k = 0, j = (long)k * t->dp.world + t->dp.rank;
        if (step_valid > 0) { /* every target of the step masked: nothing to learn, skip the update */
            /* LoRA dropout masks depend on (seed, global iteration) only: a resumed run, and
             * any world size, draws the same */
            fl_model_lora_set_seed(&t->model, cfg->seed * 0x9e3779b97f4a7c15ULL + (uint64_t)(iter0 + j));
            fl_dp_buckets_arm(&t->dp, &t->opt, k == t->accum - 1); /* the last backward reduces block by block */
            FL_TRY(diverged(t, fl_train_micro(&t->model, &t->opt, &t->mbs[k], k, 0, step_valid, lr,
                                              cfg->train.max_norm, &ls_k, &nv_k, sr), t->st.step + 1, iter0 + j + 1));
        }
        mine[2 * k] = ls_k;
        mine[2 * k + 1] = (double)nv_k;
        t->mb_ms[k] = (now_s() - it0) * 1e3;
    }
    if (step_valid > 0) {
        double u0 = now_s();
        /* the sum over ranks, then one update: clipping and fp16 overflow skips see the same
         * reduced gradients on every rank, so they decide alike */
        FL_TRY(fl_dp_reduce_grads(&t->dp, &t->opt));
        FL_TRY(diverged(t, fl_train_update(&t->model, &t->opt, lr, cfg->train.max_norm, sr), t->st.step + 1,
                        iter0 + t->G));
        t->mb_ms[t->accum - 1] += (now_s() - u0) * 1e3; /* the step's last iteration carries the update */
    }
    return FL_OK;
}

/* The pool's memory record into r: the all-time peaks, the snapshots, and on FL_ERR_OOM the
 * failed allocation (also on failure: what was reached). */
static void result_memory(const trainer *t, fl_status s, fl_trainer_result *r) {
    for (int k = 0; k < FL_TAG_COUNT; k++) r->peak[k] = t->pool.peak[k];
    r->peak_total = t->pool.peak_total;
    r->offload = t->opool_ok;
    for (int k = 0; t->opool_ok && k < FL_TAG_COUNT; k++) r->host_peak[k] = t->opool.peak[k];
    r->host_peak_total = t->opool_ok ? t->opool.peak_total : 0;
    r->nvme = t->dpool_ok;
    for (int k = 0; t->dpool_ok && k < FL_TAG_COUNT; k++) r->nvme_peak[k] = t->dpool.peak[k];
    r->nvme_peak_total = t->dpool_ok ? t->dpool.peak_total : 0;
    r->n_phases = t->pool.n_phases < FL_TRAINER_MAX_PHASES ? t->pool.n_phases : FL_TRAINER_MAX_PHASES;
    memcpy(r->phases, t->pool.phases, (size_t)r->n_phases * sizeof r->phases[0]);
    if (s == FL_ERR_OOM) r->oom = t->pool.oom;
}

/* The rehearsal's sample: the "eval_generate" snapshot at the first sampled token (the cache,
 * the decode scratch, the sampler and its logits held; the prefill's scratch, gone by then, is
 * in the phase peak), then stop after the first decode step: every later step repeats it
 * (fl_model_decode allocates nothing) and sampling over the vocabulary on the host would cost
 * the plan more than everything else (3/4 of a Llama-3-8B plan's time). */
static int snapshot_eval_generate(void *ud, int32_t id) {
    (void)id;
    fl_mem_pool *p = ud;
    if (fl_mem_find_phase(p, "eval_generate")) return 1;
    fl_mem_snapshot(p, "eval_generate");
    return 0;
}

fl_status fl_trainer_rehearse(const fl_run_config *cfg, const fl_model_config *mc, const fl_backend *be,
                              size_t budget, int B, int T, int accum, int gen_prompt, fl_trainer_result *res) {
    return fl_trainer_rehearse_comm(cfg, mc, be, NULL, budget, B, T, accum, gen_prompt, res);
}

fl_status fl_trainer_rehearse_comm(const fl_run_config *cfg, const fl_model_config *mc, const fl_backend *be,
                                   fl_comm *comm, size_t budget, int B, int T, int accum, int gen_prompt,
                                   fl_trainer_result *res) {
    trainer t;
    memset(&t, 0, sizeof t);
    t.cfg = cfg;
    fl_dp_init(&t.dp, comm, NULL);
    fl_trainer_result r;
    memset(&r, 0, sizeof r);
    r.val_loss = NAN;
    int32_t *prompt = NULL, *gen = NULL;
    fl_precision prec;
    fl_status s = fl_precision_find(cfg->precision, &prec);
    if (s == FL_OK && !prec.available)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "precision '%s' is not available yet in this build", cfg->precision);
    if (s == FL_OK) s = fl_trainer_storage(cfg, &prec, &t.stg);
    if (s != FL_OK) goto done;
    t.be = *be; /* borrowed (be_ok stays 0: the caller frees it) */
    s = fl_backend_pools_init(&t.be, &t.pool, &t.hpool, be->host_memory ? "cpu" : "cuda", budget);
    if (s != FL_OK) goto done;
    t.pool_ok = 1;
    /* fl_trainer_run_comm's set-up sequence; its agreements are left out (they allocate nothing, and a
     * rank that fails here breaks the group: see done) */
    fl_dp_init(&t.dp, comm, &t.pool);
    t.dp.be = &t.be;
    if (t.dp.world > 1 && !be->comm_create)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "rehearsing %d ranks needs a backend with a device communicator (the null "
                      "backend's)", t.dp.world);
    if (s == FL_OK) s = fl_dp_device_comm(&t.dp, &t.be);
    fl_strategy_choice sc;
    /* the planned backend's choice: a GPU's under --accelerator cuda (the null communicator is a
     * device one on either) */
    if (s == FL_OK) s = fl_cfg_resolve_strategy(cfg, !be->host_memory, &sc);
    fl_run_config rcfg = *cfg;
    if (s == FL_OK) {
        snprintf(rcfg.strategy, sizeof rcfg.strategy, "%s", sc.strategy);
        snprintf(rcfg.sharding_strategy, sizeof rcfg.sharding_strategy, "%s", sc.sharding);
        s = fl_fsdp_prepare(&t.dp, &rcfg, &prec, &t.stg);
    }
    if (s == FL_OK) s = setup_model(&t, &prec, mc);
    t.B = B;
    t.T = T;
    t.accum = accum;
    t.G = accum * t.dp.world;
    if (s == FL_OK) s = setup_training(&t, &rcfg, &sc);
    if (s == FL_OK) s = fl_dp_broadcast_params(&t.dp, &t.opt); /* rank 0's weights everywhere, as DDP starts */
    if (s != FL_OK) goto done;
    /* a step of token 0 everywhere, every target valid (the values do not matter: nothing computes) */
    const size_t per = (size_t)B * T;
    memset(t.ids, 0, (size_t)accum * per * sizeof *t.ids);
    memset(t.tgt, 0, (size_t)accum * per * sizeof *t.tgt);
    for (int k = 0; k < accum; k++) t.mbs[k] = (fl_micro_batch){t.ids + k * per, t.tgt + k * per, B, T};
    fl_step_result sr;
    s = train_step(&t, 0, (long)(accum * per), cfg->optimizer.lr, &sr);
    if (s != FL_OK || gen_prompt <= 0) goto done;
    /* the evaluation (validate, then generate_example): one forward without gradients, then the
     * sample, snapshotted at its first token ("eval_generate": the KV cache, the decode scratch,
     * the sampler and its logits held) */
    fl_mem_set_phase(&t.pool, "validation");
    fl_model_lora_set_train(&t.model, 0);
    s = fl_model_forward(&t.model, t.ids, t.tgt, B, T, 0.0f, NULL);
    fl_model_lora_set_train(&t.model, 1);
    prompt = calloc((size_t)gen_prompt, sizeof *prompt);
    gen = malloc(((size_t)cfg->eval.max_new_tokens + 1) * sizeof *gen);
    if (s == FL_OK && (!prompt || !gen)) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    int n_out = 0;
    if (s == FL_OK) s = sample_tokens(&t, prompt, gen_prompt, NULL, gen, &n_out, snapshot_eval_generate, &t.pool);
done:
    /* several ranks: a failure anywhere (this rank's OOM under its budget) breaks the group, so the
     * others' next collective fails at once instead of waiting for this rank */
    if (s != FL_OK && t.dp.comm) fl_comm_release_peers(fl_dp_dcomm(&t.dp), fl_error_message());
    if (t.pool_ok) result_memory(&t, s, &r);
    if (res) *res = r;
    free(prompt);
    free(gen);
    cleanup_keep_error(&t, s);
    return s;
}

fl_status fl_trainer_run(const fl_run_config *cfg, FILE *out, int progress_bar, fl_step_hook hook, void *hook_ud,
                         fl_trainer_result *res) {
    return fl_trainer_run_comm(cfg, NULL, out, progress_bar, hook, hook_ud, res);
}

fl_status fl_trainer_run_comm(const fl_run_config *cfg, fl_comm *comm, FILE *out, int progress_bar, fl_step_hook hook,
                              void *hook_ud, fl_trainer_result *res) {
    trainer t;
    double *window = NULL;
    memset(&t, 0, sizeof t);
    t.cfg = cfg;
    fl_dp_init(&t.dp, comm, NULL);
    const int lead = t.dp.rank == 0; /* only rank 0 prints, logs and writes checkpoints */
    if (!lead) out = NULL;
    t.out = out;
    t.bar = progress_bar && out;
    fl_trainer_result r;
    memset(&r, 0, sizeof r);
    r.val_loss = NAN;
    r.error_all_ranks = 1; /* the checks before set-up fail alike on every rank */
    if (res) *res = r;
    fl_status s = fl_cfg_validate(cfg);
    if (s != FL_OK) return s;
    if (cfg->devices * cfg->num_nodes != t.dp.world)
        return fl_errorf(FL_ERR_INVALID, "devices x num_nodes = %d x %d = %d ranks, but this run has %d (%s): give "
                         "--devices %d, or launch %d ranks (mpirun -np %d)", cfg->devices, cfg->num_nodes,
                         cfg->devices * cfg->num_nodes, t.dp.world, comm ? fl_comm_impl_name(comm) : "no communicator",
                         t.dp.world, cfg->devices * cfg->num_nodes, cfg->devices * cfg->num_nodes);
    fl_precision prec;
    if ((s = fl_precision_find(cfg->precision, &prec)) != FL_OK) return s;
    if (!prec.available)
        return fl_errorf(FL_ERR_UNSUPPORTED, "precision '%s' is not available yet in this build", cfg->precision);
    if ((s = fl_trainer_storage(cfg, &prec, &t.stg)) != FL_OK) return s;
    if (!strcmp(cfg->resume, "false") && !cfg->overwrite && dir_has_run(cfg->out_dir))
        return fl_errorf(FL_ERR_INVALID,
                         "out_dir '%s' holds another run (checkpoints or logs); use --resume auto to continue it "
                         "or --overwrite to start over",
                         cfg->out_dir);
#define CHECK(x) do { if ((s = (x)) != FL_OK) goto done; } while (0)
    /* Set-up runs on every rank; its failures are agreed on (fl_dp_agree) at fixed points, so a
     * rank that fails does not leave the others waiting in a collective: every rank returns the
     * lowest failing rank's error. A failing rank enters `done` and agrees there. */
    int in_setup = 1, agreed = 0;
#define AGREE() do { agreed = 1; if ((s = fl_dp_agree(&t.dp, s)) != FL_OK) goto done; agreed = 0; } while (0)
    CHECK(fl_dp_check_config(&t.dp, cfg)); /* the same command line and recipe on every rank */
    CHECK(fl_backend_init_by_name(fl_backend_default_name(), &t.be, cfg->threads));
    t.be_ok = 1;
    CHECK(fl_backend_pools_init(&t.be, &t.pool, &t.hpool, t.be.name, cfg->max_memory));
    t.pool_ok = 1;
    fl_dp_init(&t.dp, comm, &t.pool);
    t.dp.be = &t.be; /* the checkpoint streams read and write the backend's memory through it */
    if (t.dp.world > 1 && t.be.comm_create) { /* the device communicator (NCCL): collective set-up */
        AGREE();
        CHECK(fl_dp_device_comm(&t.dp, &t.be));
    }
    if (t.dp.world > 1 && !t.be.host_memory && !t.dp.dev) /* the host communicator cannot read its memory */
        CHECK(fl_errorf(FL_ERR_UNSUPPORTED, "data-parallel training on backend '%s' (whose memory the host cannot "
                        "read) needs a device-memory communicator, which this backend does not have; run one rank, or "
                        "--accelerator cpu", t.be.name));
    /* --strategy auto: the strategy this run uses (fl_cfg_resolve_strategy, as the planner); the
     * sharding code reads it from rcfg, a copy of cfg with the resolved names (cfg, written to
     * hyperparameters.yaml and compared across ranks, keeps what was given) */
    fl_strategy_choice sc;
    CHECK(fl_cfg_resolve_strategy(cfg, t.dp.dev != NULL, &sc));
    fl_run_config rcfg = *cfg;
    snprintf(rcfg.strategy, sizeof rcfg.strategy, "%s", sc.strategy);
    snprintf(rcfg.sharding_strategy, sizeof rcfg.sharding_strategy, "%s", sc.sharding);
    CHECK(fl_fsdp_prepare(&t.dp, &rcfg, &prec, &t.stg)); /* FULL_SHARD: the model is created sharded */
    CHECK(setup_model(&t, &prec, NULL));
    CHECK(load_tokenizer(&t));
    CHECK(load_data(&t));
    schedule(&t);
    fl_mem_set_phase(&t.pool, "setup");
    if (cfg->command != FL_CMD_FINETUNE_LORA) AGREE(); /* every rank has its model (FULL_SHARD: its shard) before the gradients */
    CHECK(setup_training(&t, &rcfg, &sc));
    size_t per = (size_t)t.B * t.T;
    AGREE(); /* every rank holds its model, data and buffers; nothing was written yet */
    if (lead) {
        CHECK(fl_fs_mkdir_p(cfg->out_dir));
        fl_ckpt_clean_tmp(cfg->out_dir);
    }
    AGREE(); /* out_dir is ready before any rank looks for checkpoints in it */
    int resumed = 0;
    CHECK(resume_if_asked(&t, &resumed)); /* every rank reads the same checkpoint (a shared file system) */
    fl_model_sync_compute_copy(&t.model); /* resumed master weights -> compute copy */
    AGREE();
    CHECK(fl_dp_broadcast_params(&t.dp, &t.opt)); /* rank 0's weights everywhere, as DDP starts */
    if (lead) CHECK(fl_metrics_open(&t.metrics, cfg->out_dir, cfg->logger_name, resumed, resumed ? t.st.iter : -1));
    AGREE();
    in_setup = 0;

    const fl_data_stats *ds = fl_data_get_stats(t.data);
    if (out) {
        fprintf(out, "model: %s, %zu parameters (%s); tokenizer: %s%s%s%s\n", t.model.cfg.name[0] ? t.model.cfg.name : "?",
                t.model.layout.numel, cfg->checkpoint_dir[0] ? cfg->checkpoint_dir : cfg->model_name,
                fl_tok_kind(t.tok), t.tok_dir[0] ? " from '" : " (built in: no tokenizer files with the model; "
                "--tokenizer_dir gives one", t.tok_dir[0] ? t.tok_dir : "", t.tok_dir[0] ? "'" : ")");
        fprintf(out, "data: %s, %zu train / %zu val samples, %zu truncated to max_seq_length; longest input %d\n",
                fl_data_kind_name(cfg->data.kind), ds->n_samples[FL_SPLIT_TRAIN], ds->n_samples[FL_SPLIT_VAL],
                ds->n_truncated, t.T);
        if (ds->val_source[0]) fprintf(out, "validation: %s\n", ds->val_source);
        if (strcmp(cfg->logger_name, "csv") && strcmp(cfg->logger_name, "jsonl"))
            fprintf(out, "logger_name %s: fitllm writes CSV metrics (%s/logs/metrics.csv); the %s logger is not "
                    "available in this build\n", cfg->logger_name, cfg->out_dir, cfg->logger_name);
        fprintf(out, "precision %s%s\n", prec.name, t.model.act_ckpt ? ", activation checkpointing" : "");
        char ranks[48] = "";
        if (t.dp.world > 1) snprintf(ranks, sizeof ranks, " x %d ranks", t.dp.world);
        fprintf(out, "micro_batch %d x accumulation %d%s = global batch %d; %ld steps/epoch, %ld steps, warmup %ld; "
                "%s lr %g, min_lr %g\n",
                t.B, t.accum, ranks, cfg->train.global_batch_size, t.steps_per_epoch, t.max_steps, t.warmup,
                fl_optim_name(cfg->optimizer.kind), cfg->optimizer.lr, cfg->train.min_lr);
        fputs(t.notes, out);
        if (t.dp.world > 1) {
            char lb[300];
            fprintf(out, "data parallel (%s, strategy %s): %d ranks over %s (%s); rank 0 reports; gradients summed "
                    "over the ranks %s (%s, deterministic rank order)%s\n",
                    fl_dp_stage_name(&t.dp), sc.desc, t.dp.world,
                    fl_comm_impl_name(comm), fl_launch_describe(&comm->launch, lb, sizeof lb),
                    t.dp.fsdp ? "unit by unit in every micro-batch" : "once per step",
                    t.dp.fsdp && t.dp.node ? "one reduce-scatter per unit within the node as its backward ends, then "
                    "an all-reduce of the piece across the nodes: each rank keeps its node's shard"
                    : t.dp.fsdp ? "one reduce-scatter per unit as its backward ends: each rank keeps its shard"
                    : t.dp.stage == 2 ? "one reduce-scatter: each rank keeps its chunk"
                    : t.model.lora ? "one all-reduce of the adapters"
                                   : "all-reduced block by block as the last micro-batch's backward ends each",
                    t.dp.fsdp ? "; each rank holds its shard of every unit's parameters, gradients and optimizer "
                    "state; a unit's parameters are all-gathered right before its forward and its backward (the next "
                    "unit's gather posted ahead, at most 2 blocks at once)"
                    : t.dp.stage ? "; each rank holds the optimizer state of its chunk of the parameters, updates it, "
                    "and the updated parameters are all-gathered" : "");
        }
        long bpe = (long)fl_loader_batches_per_epoch(t.train);
        if (bpe < t.G) /* the epoch counter then moves every few iterations, inside one step */
            fprintf(out, "note: the training split is %ld micro-batch%s of %d, fewer than the %d of one optimizer "
                    "step: every step goes over it %.3g times (epochs are counted per micro-batch)\n",
                    bpe, bpe == 1 ? "" : "es", t.B, t.G, (double)t.G / (double)bpe);
    }

    double val_loss = NAN;
    long val_step = -1; /* the step of the last evaluation in the loop */
    if (cfg->eval.initial_validation) {
        CHECK(validate(&t, cfg->eval.max_iters, &val_loss));
        if (out) fprintf(out, "initial validation | val loss: %.3f | val ppl: %.3f\n", val_loss,
                         fl_trainer_perplexity(val_loss));
    }

    /* running mean of per-iteration losses over the last `accum` iterations (LitGPT's RunningMean) */
    window = calloc((size_t)t.G, sizeof *window);
    if (!window) { s = fl_errorf(FL_ERR_OOM, "out of host memory"); goto done; }
    long wn = 0;
    fl_trainer_diverge dv; /* finite divergence: the loss stays above a uniform guess's */
    fl_trainer_diverge_init(&dv, t.model.cfg.vocab_size, t.warmup);
    double t_start = now_s() - t.st.train_seconds;
    const double train0 = t.st.train_seconds; /* a resumed run measures its own steps for the ETA */
    const long step0 = t.st.step;
    int stopped = 0;
    while (t.st.step < t.max_steps) {
        fl_loader_state ls;
        fl_loader_get_state(t.train, &ls);
        if (cfg->train.epochs > 0 && ls.epoch >= cfg->train.epochs) break;
        if (cfg->train.max_tokens > 0 && t.st.tokens_real >= cfg->train.max_tokens) break;
        /* fetch the step's G global micro-batches: every rank walks the whole stream (so the
         * loader position, token counters and the valid-target count are global everywhere)
         * and keeps j % world == rank in its slot j / world */
        long step_valid = 0;
        long long tokens0 = t.st.tokens_padded; /* before this step: the log counts iteration by iteration */
        const long iter0 = t.st.iter;           /* global micro-batches before this step */
        for (int j = 0; j < t.G; j++) {
            fl_batch b;
            int ne;
            CHECK(fl_loader_next(t.train, &b, &ne));
            fl_loader_state lk;
            fl_loader_get_state(t.train, &lk);
            t.mb_epoch[j] = (long)lk.epoch; /* the loader moves to the next epoch when it wraps */
            t.mb_tokens[j] = b.padded_tokens;
            step_valid += b.target_tokens;
            t.st.tokens_real += b.real_tokens;
            t.st.tokens_prompt += b.prompt_tokens;
            t.st.tokens_padded += b.padded_tokens;
            t.st.flops += fl_model_train_flops(&t.model.cfg, b.B, b.T);
            if (!fl_dp_mine(&t.dp, j)) continue;
            int k = j / t.dp.world;
            int32_t *di = t.ids + (size_t)k * per, *dt = t.tgt + (size_t)k * per;
            memcpy(di, b.ids, (size_t)b.B * b.T * sizeof *di);
            memcpy(dt, b.targets, (size_t)b.B * b.T * sizeof *dt);
            t.mbs[k] = (fl_micro_batch){di, dt, b.B, b.T};
        }
        float lr = (float)fl_lr_schedule(cfg->optimizer.lr, cfg->train.min_lr, t.st.step, t.warmup, t.max_steps);
        const unsigned long long sent0 = fl_dp_sent(&t.dp); /* this rank's traffic before the step: the step's bytes go to the log */
        double step_loss = 0;
        fl_step_result sr;
        CHECK(train_step(&t, iter0, step_valid, lr, &sr));
        double *mine = t.mb_stats + (size_t)t.dp.rank * 2 * t.accum; /* (loss sum, valid) per k */
        /* every rank's (loss sum, valid) per micro-batch, for the log and the step loss */
        CHECK(fl_dp_gather(&t.dp, mine, 2 * t.accum, t.mb_stats));
        const double step_sent = (double)(fl_dp_sent(&t.dp) - sent0);
        if (t.dp.world > 1) r.comm_sent_last_step = (unsigned long long)step_sent;
        int timed_k = -1; /* the round whose time a printed line has shown */
        for (int j = 0; j < t.G; j++) {
            int k = j / t.dp.world;
            const double *st = t.mb_stats + ((size_t)(j % t.dp.world) * t.accum + k) * 2;
            double ls_k = st[0];
            long nv_k = (long)st[1];
            int last = j == t.G - 1;
            t.st.iter++;
            tokens0 += t.mb_tokens[j]; /* tokens through this iteration */
            step_loss += ls_k;
            double it_loss = nv_k > 0 ? ls_k / nv_k : NAN;
            if (nv_k > 0) window[wn++ % t.G] = it_loss; /* a fully masked micro-batch has no loss */
            double run = 0;
            long cnt = wn < t.G ? wn : t.G;
            for (long q = 0; q < cnt; q++) run += window[q];
            run = cnt ? run / cnt : NAN;
            r.last_loss = run;
            double it_time = t.mb_ms[k] / 1e3; /* rank 0's micro-batch of the same round */
            if (t.st.iter % cfg->train.log_interval == 0) {
                long step_now = t.st.step + (last ? 1 : 0);
                char vbuf[32];
                if (isnan(val_loss)) snprintf(vbuf, sizeof vbuf, "n/a");
                else snprintf(vbuf, sizeof vbuf, "%.3f", val_loss);
                bar_clear(&t);
                /* several ranks: the iterations of one round ran at once, one per rank, and took
                 * rank 0's time: printed once, on the round's first printed line */
                char tbuf[64];
                if (timed_k != k) snprintf(tbuf, sizeof tbuf, "iter time: %.2f ms", it_time * 1e3);
                else snprintf(tbuf, sizeof tbuf, "rank %d's micro-batch, in parallel with iter %ld", j % t.dp.world,
                              t.st.iter - j % t.dp.world);
                timed_k = k;
                if (out)
                    fprintf(out, "Epoch %lld | iter %ld step %ld | loss train: %.3f, val: %s | %s%s\n",
                            (long long)t.mb_epoch[j] + 1, t.st.iter, step_now, run, vbuf, tbuf, last ? " (step)" : "");
                /* tokens: cumulative through this iteration (LitGPT's iter_num x micro batch x T) */
                fl_metrics_values mv = {t.st.iter, step_now, t.mb_epoch[j], run, it_time, lr, NAN,
                                        t.mb_tokens[j] / (it_time > 0 ? it_time : 1e-9),
                                        tokens0, tokens0, {0}, 0, NAN};
                mem_values(&t.pool, &mv);
                if (last && t.dp.world > 1) mv.comm_sent = step_sent;
                fl_metrics_row(&t.metrics, &mv);
            }
        }
        if (!isfinite(step_loss) && !sr.skipped) { /* fp16 loss scaling let a non-finite loss through */
            s = fl_errorf(FL_ERR_NONFINITE, "the loss is %s", isnan(step_loss) ? "NaN" : "inf");
            CHECK(diverged(&t, s, t.st.step + 1, t.st.iter));
        }
        if (cfg->train.divergence_check && step_valid > 0 && !sr.skipped &&
            fl_trainer_diverge_train(&dv, t.st.step + 1, step_loss / (double)step_valid))
            CHECK(fl_trainer_diverge_error(&dv, cfg->out_dir, cfg->optimizer.lr, t.st.step + 1, t.st.iter));
        if (sr.skipped && out) { /* loss scaling: overflow, the update was skipped and the scale halved */
            bar_clear(&t);
            fprintf(out, "step %ld: inf/NaN in the fp16 gradients: update skipped, loss scale -> %g\n", t.st.step + 1,
                    (double)sr.loss_scale);
        }
        t.st.step++;
        fl_loader_get_state(t.train, &t.st.loader);
        t.st.train_seconds = now_s() - t_start;
        if (t.st.step == 1 && out && !resumed) {
            bar_clear(&t);
            fprintf(out, "\n");
            if (t.dp.world > 1 && !t.dp.stage)
                fprintf(out, "memory of rank 0 (DDP: every rank holds the same; WORKSPACE includes the all-reduce's "
                        "scratch)\n");
            else if (t.dp.fsdp)
                fprintf(out, "memory of rank 0 (%s: PARAMS, GRADS and OPTIM hold its shard, %zu of %zu elements; "
                        "GATHER the units gathered at a time and their unreduced gradients; WORKSPACE includes the "
                        "reduction's scratch)\n", fl_dp_stage_name(&t.dp), t.opt.n, t.model.layout.numel);
            else if (t.dp.world > 1)
                fprintf(out, "memory of rank 0 (%s: OPTIM holds its chunk's state, %zu of %zu elements%s; WORKSPACE "
                        "includes the reduction's scratch)\n", fl_dp_stage_name(&t.dp), t.opt.s_len, t.opt.n,
                        t.dp.stage == 2 ? "; GRADS live after the reduction: its chunk" : "");
            fl_mem_print_report(&t.pool, out);
            if (t.opool_ok) {
                fprintf(out, "\nhost tier (CPU offload: %s%s, outside the device's budget)\n",
                        t.dpool_ok ? "the optimizer state is in the nvme tier below" : "the optimizer state",
                        t.opt.hp ? "; the update's staging of one piece" : "");
                fl_mem_print_report(&t.opool, out);
            }
            if (t.dpool_ok) {
                fprintf(out, "\nnvme tier (the optimizer state in files under '%s', paged through a few pieces of host "
                        "memory)\n", cfg->nvme_path[0] ? cfg->nvme_path : cfg->out_dir);
                fl_mem_print_report(&t.dpool, out);
            }
            fprintf(out, "\n");
        }
        if (t.st.step % cfg->eval.interval == 0 && t.val) {
            double e0 = now_s();
            CHECK(diverged(&t, validate(&t, cfg->eval.max_iters, &val_loss), t.st.step, t.st.iter));
            bar_clear(&t);
            CHECK(generate_example(&t));
            if (out) fprintf(out, "iter %ld: val loss %.4f, val time: %.2f ms\n", t.st.iter, val_loss, (now_s() - e0) * 1e3);
            if (cfg->train.divergence_check && fl_trainer_diverge_val(&dv, t.st.step, val_loss))
                CHECK(fl_trainer_diverge_error(&dv, cfg->out_dir, cfg->optimizer.lr, t.st.step, t.st.iter));
            fl_metrics_values mv = {t.st.iter, t.st.step, (long)t.st.loader.epoch, NAN, NAN, NAN, val_loss, NAN, -1, -1, {0}, 0, NAN};
            mem_values(&t.pool, &mv);
            mv.tokens = t.st.tokens_padded;
            mv.total_tokens = t.st.tokens_padded;
            fl_metrics_row(&t.metrics, &mv);
            val_step = t.st.step;
            t_start += now_s() - e0; /* evaluation time is not training time */
        }
        const int saved = cfg->train.save_interval > 0 && t.st.step % cfg->train.save_interval == 0;
        if (saved) CHECK(save_step(&t, lead, !fl_trainer_diverge_suspect(&dv)));
        /* after evaluation and checkpointing, so a hook that stops the run acts
         * like a crash right after this step's checkpoint */
        /* stopping is decided together: a hook (Ctrl-C) or the time budget on any rank stops all; a
         * hook that returns 2 (a signal under train.save_on_signal) asks for this step's checkpoint */
        double stop[3] = {0, cfg->train.max_time > 0 && t.st.train_seconds >= cfg->train.max_time, 0};
        if (hook) { /* the hook reads the trained parameters on the host: a copy when they are device memory */
            size_t pb = t.opt.n * fl_dtype_size(t.opt.pt);
            void *hp = NULL;
            if (t.dp.fsdp && cfg->hook_whole_params) { /* FULL_SHARD: the whole parameters gathered for it
                                                         * (collective: every rank has a hook); else the shard */
                CHECK(fl_fsdp_whole_params(&t.dp, &hp, &pb));
            } else {
                hp = t.be.host_memory ? NULL : malloc(pb + 1);
                if (!t.be.host_memory && !hp) CHECK(fl_errorf(FL_ERR_OOM, "out of host memory"));
            }
            s = hp && !(t.dp.fsdp && cfg->hook_whole_params) ? t.be.to_host(&t.be, hp, t.opt.p, pb) : FL_OK;
            if (s == FL_OK) {
                int h = hook(hook_ud, t.st.step, step_valid ? step_loss / step_valid : NAN, hp ? hp : t.opt.p, pb);
                stop[0] = h > 0;
                stop[2] = h > 1;
            }
            free(hp);
            CHECK(s);
        }
        CHECK(fl_dp_sum(&t.dp, stop, 3));
        if (stop[0] > 0) {
            /* not while the loss is above the divergence limit: that checkpoint would be a bad one */
            if (stop[2] > 0 && !saved && !fl_trainer_diverge_suspect(&dv)) CHECK(save_step(&t, lead, 1));
            stopped = 1;
            break;
        }
        if (stop[1] > 0) {
            /* the time budget ends the run like max_steps would: final validation and final/ */
            bar_clear(&t);
            if (out)
                fprintf(out, "train.max_time (%g s) reached after step %ld of %ld (%.1f s of training): finishing\n",
                        (double)cfg->train.max_time, t.st.step, t.max_steps, t.st.train_seconds);
            break;
        }
        bar_draw(&t, t.st.step,
                 fl_trainer_eta(t.st.train_seconds - train0, t.st.step - step0, t.max_steps - t.st.step,
                                cfg->train.max_time, t.st.train_seconds));
    }
    bar_clear(&t);
    r.steps = t.st.step;
    r.iters = t.st.iter;
    r.train_seconds = t.st.train_seconds;
    r.tokens_real = t.st.tokens_real;
    r.tokens_prompt = t.st.tokens_prompt;
    r.tokens_padded = t.st.tokens_padded;
    if (!stopped) {
        /* the evaluation of the last step already covered every validation batch with these
         * weights: that is the final evaluation (no second, identical row in the log) */
        long n_val = t.val ? (long)fl_loader_batches_per_epoch(t.val) : 0;
        int have_final = val_step == t.st.step && cfg->eval.max_iters >= n_val;
        if (cfg->eval.final_validation && t.val) {
            if (!have_final)
                CHECK(diverged(&t, validate(&t, (int)n_val, &val_loss), t.st.step, t.st.iter));
            r.val_loss = val_loss;
            if (out) fprintf(out, "Final evaluation | val loss: %.3f | val ppl: %.3f\n", val_loss,
                             fl_trainer_perplexity(val_loss));
            if (cfg->train.divergence_check && fl_trainer_diverge_val(&dv, t.st.step, val_loss))
                CHECK(fl_trainer_diverge_error(&dv, cfg->out_dir, cfg->optimizer.lr, t.st.step, t.st.iter));
        }
        if (cfg->eval.final_validation && t.val && !have_final) {
            fl_metrics_values mv = {t.st.iter, t.st.step, (long)t.st.loader.epoch, NAN, NAN, NAN, val_loss, NAN, -1, -1, {0}, 0, NAN};
            mem_values(&t.pool, &mv);
            mv.tokens = t.st.tokens_padded;
            mv.total_tokens = t.st.tokens_padded;
            fl_metrics_row(&t.metrics, &mv);
        }
        fl_mem_set_phase(&t.pool, "checkpoint");
        CHECK(diverged(&t, check_weights(&t), t.st.step, t.st.iter));
        /* LoRA: final/ is the merged model (loads anywhere without PEFT), final/adapter the PEFT adapter */
        if (t.model.lora && lead) CHECK(fl_model_lora_merge(&t.model));
        CHECK(fl_dp_ckpt_save(&t.dp, lead, cfg->out_dir, "final", &t.model, t.model.lora ? NULL : &t.opt,
                              t.model.lora ? NULL : &t.st, cfg, t.tok_dir[0] ? t.tok_dir : NULL));
        snprintf(r.final_dir, sizeof r.final_dir, "%s/final", cfg->out_dir);
        /* fl_ckpt_save wrote final/adapter (the PEFT adapter) with final/ */
        if (t.model.lora && lead && out) fprintf(out, "Saved the PEFT adapter to '%s/adapter'\n", r.final_dir);
        if (out) fprintf(out, "Saved the final model to '%s'\n", r.final_dir);
    }
    result_memory(&t, FL_OK, &r);
    print_box(&t, &r);
done:
    if (s != FL_OK && in_setup && !agreed) s = fl_dp_agree(&t.dp, s); /* meet the others' next AGREE */
    /* no agreement follows: peers that are threads would wait in their next collective */
    if (s != FL_OK && !in_setup && t.dp.comm) fl_comm_release_peers(fl_dp_dcomm(&t.dp), fl_error_message());
    r.error_all_ranks = in_setup;
#undef AGREE
#undef CHECK
    free(window);
    if (t.pool_ok) result_memory(&t, s, &r); /* also on failure: what was reached, and the OOM record */
    if (t.opt.model && t.opt.use_loss_scale) {
        r.loss_scale = t.opt.ls.scale;
        r.skipped_steps = (long)t.opt.ls.n_skipped;
    }
    if (res) *res = r;
    cleanup_keep_error(&t, s);
    return s;
}
