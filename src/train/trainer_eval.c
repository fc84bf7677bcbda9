/* The trainer's evaluation: the validation loss and the sample (src/train/trainer-impl.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer-impl.h"
#include "fitllm/generate.h"
#include "fitllm/lora.h"
#include "fitllm/tokenizer.h"

int fl_tr_has_val(const trainer *t) { return t->in.val || t->in.s2s_val; }

long fl_tr_val_batches(const trainer *t) {
    if (t->in.s2s_val) return (long)((fl_s2s_count(t->in.s2s_vdata) + (size_t)t->sch.B - 1) / (size_t)t->sch.B);
    return t->in.val ? (long)fl_loader_batches_per_epoch(t->in.val) : 0;
}

/* An encoder-decoder's validation: the pairs' batches in order, each rank its share (as fl_tr_validate); *sum, *cnt
 * this rank's summed loss and valid targets. */
static fl_status validate_s2s(trainer *t, long n, double *sum, long *cnt) {
    fl_loader_state s0 = {t->cfg->seed, 0, 0};
    FL_TRY(fl_s2s_loader_set_state(t->in.s2s_val, &s0));
    fl_s2s_batch b;
    for (long k = 0; k < n; k++) {
        int ne;
        FL_TRY(fl_s2s_loader_next(t->in.s2s_val, &b, &ne));
        if (!fl_dp_mine(&t->dp, k)) continue;
        const fl_micro_batch mb = {.ids = b.dec_in, .targets = b.labels, .B = b.B, .T = b.Tt, .src = b.src,
                                   .src_mask = b.src_mask, .Ts = b.Ts};
        if (t->pp.size > 1) FL_TRY(fl_pp_eval_s2s(&t->pp.rt, &mb)); /* the stages in turn */
        else FL_TRY(fl_model_forward_s2s(&t->model, b.src, b.src_mask, b.dec_in, b.labels, b.B, b.Ts, b.Tt, 0.0f, NULL));
        *sum += t->model.loss_sum;
        *cnt += t->model.n_valid;
    }
    /* FULL_SHARD: every rank runs as many forwards (each gathers every unit from all ranks); a rank without a batch
     * in the last round runs the last one again and discards it, as the decoder-only validation */
    if (!(n > 0 && t->dp.fsdp && n % t->dp.world && t->dp.rank >= n % t->dp.world)) return FL_OK;
    const fl_micro_batch mb = {.ids = b.dec_in, .targets = b.labels, .B = b.B, .T = b.Tt, .src = b.src,
                               .src_mask = b.src_mask, .Ts = b.Ts};
    if (t->pp.size > 1) return fl_pp_eval_s2s(&t->pp.rt, &mb); /* the pipeline's stages together, as above */
    return fl_model_forward_s2s(&t->model, b.src, b.src_mask, b.dec_in, b.labels, b.B, b.Ts, b.Tt, 0.0f, NULL);
}

fl_status fl_tr_validate(trainer *t, int max_iters, double *loss) {
    *loss = NAN;
    if (t->in.s2s_val) {
        long n = fl_tr_val_batches(t), cnt = 0;
        if (max_iters < n) n = max_iters;
        double sum = 0;
        fl_model_lora_set_train(&t->model, 0);
        fl_mem_set_phase(&t->hw.pool, "validation");
        fl_status s = validate_s2s(t, n, &sum, &cnt);
        fl_model_lora_set_train(&t->model, 1);
        FL_TRY(s);
        double v[2] = {sum, (double)cnt};
        FL_TRY(fl_dp_sum(&t->dp, v, 2));
        if (v[1] > 0) *loss = v[0] / v[1];
        if (v[1] > 0 && !isfinite(*loss))
            return fl_errorf(FL_ERR_NONFINITE, "the validation loss is %s", isnan(*loss) ? "NaN" : "inf");
        return FL_OK;
    }
    if (!t->in.val) return FL_OK;
    fl_loader_state s0 = {t->cfg->seed, 0, 0};
    FL_TRY(fl_loader_set_state(t->in.val, &s0));
    long n = (long)fl_loader_batches_per_epoch(t->in.val);
    if (max_iters < n) n = max_iters;
    fl_model_lora_set_train(&t->model, 0);
    double sum = 0;
    long cnt = 0;
    fl_mem_set_phase(&t->hw.pool, "validation");
    fl_batch b;
    for (long k = 0; k < n; k++) {
        int ne;
        FL_TRY(fl_loader_next(t->in.val, &b, &ne));
        if (!fl_dp_mine(&t->dp, k)) continue; /* data parallel: each rank evaluates its share */
        if (t->pp.size > 1) FL_TRY(fl_pp_eval(&t->pp.rt, b.ids, b.targets, b.B, b.T)); /* the stages in turn */
        else FL_TRY(fl_model_forward(&t->model, b.ids, b.targets, b.B, b.T, 0.0f, NULL));
        sum += t->model.loss_sum;
        cnt += t->model.n_valid;
    }
    /* FULL_SHARD: a forward gathers every unit from all ranks, so every rank runs as many; a rank
     * without a batch in the last round runs the last one again and discards it */
    if (t->dp.fsdp && n % t->dp.world && t->dp.rank >= n % t->dp.world) {
        FL_TRY(fl_model_forward(&t->model, b.ids, b.targets, b.B, b.T, 0.0f, NULL));
        for (int c = 1; c < t->pp.chunks; c++) /* interleaved: every chunk's units (each chunk's own gathers) */
            FL_TRY(fl_model_forward(&t->pp.xm[c], b.ids, b.targets, b.B, b.T, 0.0f, NULL));
    }
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
 * 0.8 from the n prompt ids, the cache freed. eos: the n_eos ids that end it (n_eos may be 0). cb, ud: fl_generate's. */
/* the evaluation sample's sampling settings (decoder-only and encoder-decoder alike) */
static fl_gen_params eval_gen_params(const fl_run_config *c) {
    fl_gen_params gp;
    fl_gen_params_default(&gp);
    gp.max_new_tokens = c->eval.max_new_tokens;
    gp.temperature = 0.8f;
    gp.seed = c->seed;
    return gp;
}

/* The tests' stand-in for ranks whose sampling went apart (tests/mpi_test.sh, tests/test_poff.c): with
 * FITLLM_TEST_SAMPLE_SEED_SKEW=R rank R samples the evaluation sample with seed + 1. */
static uint64_t test_seed_skew(const trainer *t) {
    const char *e = getenv("FITLLM_TEST_SAMPLE_SEED_SKEW");
    return e && e[0] && atoi(e) == t->dp.rank && t->dp.world > 1 ? 1 : 0;
}

fl_status fl_tr_sample_tokens(trainer *t, const int32_t *ids, int n, const int32_t *eos, int n_eos, int32_t *gen,
                               int *n_out, fl_gen_callback cb, void *ud) {
    const fl_run_config *c = t->cfg;
    fl_kv_cache kv;
    memset(&kv, 0, sizeof kv);
    fl_model_lora_set_train(&t->model, 0);
    fl_status s = fl_kv_cache_init(&kv, &t->model, n + c->eval.max_new_tokens);
    if (s == FL_OK) {
        fl_gen_params gp = eval_gen_params(c);
        gp.seed += test_seed_skew(t);
        fl_gen_stop why;
        s = fl_generate(&t->model, &kv, ids, n, &gp, eos, n_eos, gen, n_out, &why, cb, ud);
        fl_kv_cache_free(&kv);
    }
    fl_model_lora_set_train(&t->model, 1);
    return s;
}

/* Sharded decoding's agreement (FULL_SHARD / ZeRO-3, parameter offload, several ranks): every rank decodes the
 * sample in step because each token's forward gathers the units from all ranks, which holds only while they pick
 * the same tokens (the same gathered bits, the same sampler seed). After each token the ranks' picks are gathered
 * (one word each); every rank sees the same picks, so on a disagreement all stop at the same token, and the run
 * ends with an error naming the first rank that differs from rank 0 and the step, where a silent divergence would
 * leave the ranks in different collectives (a hang) or print rank 0's text as if it were the model's. */
typedef struct {
    trainer *t;
    int k;       /* tokens checked */
    fl_status s; /* the disagreement, or the gather's failure */
} tok_agree;

static int agree_token(void *ud, int32_t id) {
    tok_agree *a = ud;
    fl_dp *dp = &a->t->dp;
    double mine = (double)id, stack[16], *all = dp->world <= 16 ? stack : malloc((size_t)dp->world * sizeof *all);
    a->s = all ? fl_dp_gather(dp, &mine, 1, all) : fl_errorf(FL_ERR_OOM, "out of host memory");
    for (int r = 1; a->s == FL_OK && r < dp->world; r++)
        if (all[r] != all[0])
            a->s = fl_errorf(FL_ERR_INTERNAL, "sharded generation (the evaluation sample after step %ld): rank %d picked "
                             "token %.0f where rank 0 picked %.0f (generated token %d); the ranks must decode in step "
                             "(the same gathered parameters, the same sampler seed): their sampling went apart",
                             a->t->st.step, r, all[r], all[0], a->k + 1);
    if (all != stack) free(all);
    a->k++;
    return a->s != FL_OK;
}

/* LitGPT's generate_example: the fixed instruction through the prompt style,
 * sampled at temperature 0.8, printed to show what the model has learned.
 * Pretraining has no instructions: the prompt is the first FL_PRETRAIN_PROMPT_TOKENS
 * tokens of the first validation text, and the model continues it. */
fl_status fl_tr_generate_example(trainer *t) {
    const fl_run_config *c = t->cfg;
    /* tensor parallel: the lead's group decodes with it (its blocks' sums), silently */
    FILE *fo = t->out;
    if (c->eval.max_new_tokens <= 0 || t->pp.size > 1) return FL_OK; /* pipelined decoding: not built */
    int lead = fo || (t->tp.size > 1 && t->dp.rank == 0);
    if (t->dp.fsdp && t->dp.world > 1) {
        /* sharded parameters (FULL_SHARD / ZeRO-3, parameter offload): every unit the decoding reads is gathered
         * from all ranks, so they all decode in step when one prints (the same gathered bits, the same sampler
         * seed: the same tokens, the same stop), silently but for the one with the output */
        double v = lead;
        FL_TRY(fl_dp_sum(&t->dp, &v, 1));
        lead = v > 0;
    }
    if (!lead) return FL_OK;
    const char *instruction = "Recommend a movie for me to watch during the weekend and explain the reason.";
    char *prompt = NULL, *text = NULL;
    int32_t *ids = NULL, *gen = NULL;
    size_t n = 0, len = 0;
    int n_out = 0;
    fl_status s = FL_OK;
    if (c->command == FL_CMD_PRETRAIN && t->in.data && fl_data_count(t->in.data, FL_SPLIT_VAL) > 0) {
        const fl_sample *sm = fl_data_get(t->in.data, FL_SPLIT_VAL, 0);
        n = (size_t)(sm->len - 1 < FL_PRETRAIN_PROMPT_TOKENS ? sm->len - 1 : FL_PRETRAIN_PROMPT_TOKENS);
        if (n < 1) n = 1;
        ids = malloc(n * sizeof *ids);
        if (!ids) s = fl_errorf(FL_ERR_OOM, "out of host memory");
        else memcpy(ids, sm->ids, n * sizeof *ids);
        size_t pl = 0;
        if (s == FL_OK) s = fl_tok_decode(t->in.tok, ids, n, 1, &prompt, &pl);
        instruction = prompt; /* printed before the continuation */
    } else {
        s = fl_data_format_prompt(c->data.prompt_style[0] ? c->data.prompt_style : "alpaca", instruction, "", &prompt);
        if (s == FL_OK) s = fl_tok_encode(t->in.tok, prompt, strlen(prompt), -1, 0, &ids, &n);
    }
    int cap = (int)n + c->eval.max_new_tokens;
    if (s == FL_OK && cap > t->model.cfg.max_seq) {
        if (fo) fprintf(fo, "(sample generation skipped: prompt of %zu tokens + eval.max_new_tokens %d exceeds the "
                "context of %d)\n", n, c->eval.max_new_tokens, t->model.cfg.max_seq);
        goto out;
    }
    gen = malloc((size_t)c->eval.max_new_tokens * sizeof *gen);
    if (s == FL_OK && !gen) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    tok_agree ag = {t, 0, FL_OK};
    const int check = t->dp.fsdp && t->dp.world > 1; /* sharded: every rank decodes (above) */
    if (s == FL_OK)
        s = fl_tr_sample_tokens(t, ids, (int)n, t->in.stop_ids, t->in.n_stop, gen, &n_out, check ? agree_token : NULL,
                                &ag);
    if (s == FL_OK) s = ag.s;
    if (s == FL_OK) s = fl_tok_decode(t->in.tok, gen, (size_t)n_out, 1, &text, &len);
    /* pretrain: the text prefix and its continuation read as one text */
    if (s == FL_OK && fo) fprintf(fo, "%s%s%s\n", instruction, c->command == FL_CMD_PRETRAIN ? "" : "\n", text);
out:
    free(gen);
    free(text);
    free(ids);
    free(prompt);
    return s;
}

/* The evaluation sample of an encoder-decoder (T5): the fixed instruction as the source, the decoder sampled at
 * temperature 0.8 (fl_generate_s2s) inside the training arena (B >= 1 row, source >= n, target >= max_new_tokens),
 * so no second arena is allocated; a source or eval.max_new_tokens past the arena is skipped with a line. */
fl_status fl_tr_generate_example_s2s(trainer *t) {
    const fl_run_config *c = t->cfg;
    FILE *fo = t->out;
    if (c->eval.max_new_tokens <= 0 || t->pp.size > 1) return FL_OK; /* pipelined decoding: not built */
    int lead = fo || (t->tp.size > 1 && t->dp.rank == 0); /* tensor parallel: the lead's group decodes with it */
    if (t->dp.fsdp && t->dp.world > 1) { /* sharded: every rank decodes in step (fl_tr_generate_example's reason) */
        double v = lead;
        FL_TRY(fl_dp_sum(&t->dp, &v, 1));
        lead = v > 0;
    }
    if (!lead) return FL_OK;
    const char *instruction = "Recommend a movie for me to watch during the weekend and explain the reason.";
    int32_t *ids = NULL, *gen = NULL;
    size_t n = 0, len = 0;
    char *text = NULL;
    int n_out = 0;
    /* the source ends with EOS as the training sources (data/s2s.c) and `fitllm generate`'s do */
    fl_status s = fl_tok_encode(t->in.tok, instruction, strlen(instruction), -1, 1, &ids, &n);
    if (s == FL_OK && ((int)n > t->sch.Ts || c->eval.max_new_tokens > t->sch.T)) {
        if (fo) fprintf(fo, "(sample generation skipped: a source of %zu tokens and eval.max_new_tokens %d do not fit "
                        "the training arena's source %d / target %d tokens)\n", n, c->eval.max_new_tokens, t->sch.Ts,
                        t->sch.T);
        goto out;
    }
    gen = malloc(((size_t)c->eval.max_new_tokens + 1) * sizeof *gen);
    if (s == FL_OK && !gen) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    if (s == FL_OK) {
        fl_gen_params gp = eval_gen_params(c);
        fl_model_lora_set_train(&t->model, 0);
        s = fl_generate_s2s(&t->model, ids, NULL, (int)n, &gp, gen, &n_out);
        fl_model_lora_set_train(&t->model, 1);
    }
    /* gen[0] is the decoder's start token */
    if (s == FL_OK) s = fl_tok_decode(t->in.tok, gen + 1, (size_t)(n_out - 1), 1, &text, &len);
    if (s == FL_OK && fo) fprintf(fo, "%s\n%.*s\n", instruction, (int)len, text);
out:
    free(text);
    free(gen);
    free(ids);
    return s;
}
