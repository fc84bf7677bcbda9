/* finetune_full --tensor_parallel N on T5 (src/train/trainer_tp.c over the T5 slice, tests/test_tp_t5.c), the ranks as
 * threads of this process. A T5 folder as tests/mpi_t5_test.sh makes it (the tiny gated config at vocab 500 with the
 * t5-tok Unigram tokenizer, tests/fixtures/t5-pairs), with 4 heads instead of 3 and T5's own dropout 0.1 (real T5
 * checkpoints' dropout_rate: the masks are one process's, test_tp_t5.c), random init, AdamW with clipping at 0.5,
 * micro-batch 1 x 4 per step. Against one process training the same global batch (the bounds of the decoder TP
 * trainer tests, tests/test_tp_train.c):
 *   - the step loss at every step within 1e-6 relative (ddp_ref.h's bar: the slices sum the same terms grouped by
 *     rank), every rank the same losses;
 *   - step 1's gradient re-assembled tensor by tensor: the consolidated checkpoint's exp_avg after one AdamW step is
 *     (1 - beta1) g_1, within 1e-5 of the tensor's scale (tests/tp_ref.h's bar);
 *   - TP 2's consolidated step-3 checkpoint (one process's HF folder and training state) resumed at TP 4 and in one
 *     process: the later losses within 1e-6 of the uninterrupted run's;
 *   - every rank's plan = its measured peaks per tag (TP 2; DP 2 x TP 2 under ZeRO-2);
 *   - on the opaque backend (memory the host cannot read: the blocks' sums through the NCCL stand-in) the same.
 * The same bars inside the interleaved pipeline schedule (TP x PP x 2 chunks): tpi_t5_train_* at the end. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_ref.h"
#include "fitllm/comm.h"
#include "fitllm/fault.h"
#include "fitllm/io.h"
#include "plan_ref.h"
#include "test.h"

/* the T5 folder (relu: v1.0 with the tied, scaled head; else v1.1 gated with lm_head; 2: v1.1 with the fixture's 3
 * heads, which 2 ranks do not split) under the test's tmp dir */
static const char *t5t_folder(int relu) {
    static char dir[3][600];
    char *d = dir[relu];
    snprintf(d, sizeof dir[0], "%s/t5tp-%s", fl_test_tmpdir(), relu == 1 ? "relu" : relu ? "heads3" : "gated");
    FL_REQUIRE_R(fl_test_t5_folder(d, "t5-tiny-gated") == 0, NULL); /* the tokenizer; config.json rewritten here */
    char b[700];
    snprintf(b, sizeof b, "%s/config.json", d);
    FILE *f = fopen(b, "w");
    FL_REQUIRE_R(f != NULL, NULL);
    fprintf(f, "{\"architectures\": [\"T5ForConditionalGeneration\"], \"model_type\": \"t5\", \"d_model\": 36, "
               "\"d_kv\": 10, \"d_ff\": 52, \"num_layers\": 2, \"num_decoder_layers\": 3, \"num_heads\": %d, "
               "\"relative_attention_num_buckets\": 8, \"relative_attention_max_distance\": 20, "
               "\"feed_forward_proj\": \"%s\", \"layer_norm_epsilon\": 1e-06, \"vocab_size\": 500, \"dropout_rate\": 0.1, "
               "\"decoder_start_token_id\": 0, \"pad_token_id\": 0, \"eos_token_id\": 1, \"is_encoder_decoder\": true, "
               "\"tie_word_embeddings\": %s}\n",
            relu == 2 ? 3 : 4, relu == 1 ? "relu" : "gated-gelu", relu == 1 ? "true" : "false");
    fclose(f);
    return d;
}

static int g_sp; /* --sequence_parallel (with tp > 1) */
/* the 3D grid (tests of TP inside the interleaved schedule, below): pipeline stages of the grids with more than one
 * rank (one process stays one process), their schedule (NULL: 1f1b) and the precision (NULL: 32-true) */
static int g_pp = 1;
static const char *g_sched, *g_prec;
static int g_short; /* the emulator's cut-down run: pairs cut to 8 source / 4 target tokens */

/* the ranks of DP dp x TP tp (x PP g_pp) */
static int t5t_world(int dp, int tp) { return dp * tp > 1 ? dp * tp * g_pp : 1; }

/* dp groups x tp ranks on folder `dir`, output under out */
static void t5t_config(fl_run_config *c, const char *dir, int dp, int tp, const char *out) {
    fl_cfg_defaults(c, FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "%s", dir);
    snprintf(c->out_dir, sizeof c->out_dir, "%s", out);
    c->init_random = 1;
    c->data.kind = FL_DATA_JSON;
    snprintf(c->data.json_path, sizeof c->data.json_path, "tests/fixtures/t5-pairs/pairs.json");
    c->train.max_steps = 6;
    c->train.epochs = 100;
    c->train.global_batch_size = 4;
    c->train.micro_batch_size = 1;
    c->train.log_interval = 1;
    c->train.lr_warmup_steps = 2;
    c->train.max_norm = 0.5f; /* clipping: the group's norm */
    c->train.save_interval = 1; /* step 1's state: the gradient of step 1 */
    c->train.keep_checkpoints = 0;
    c->eval.interval = 100;
    c->eval.final_validation = 0;
    c->optimizer.lr = 3e-3f;
    c->threads = 1;
    c->seed = 5;
    c->devices = t5t_world(dp, tp);
    c->tensor_parallel = tp;
    c->sequence_parallel = g_sp && tp > 1;
    snprintf(c->strategy, sizeof c->strategy, "ddp");
    c->pipeline_parallel = c->devices / (dp * tp);
    if (c->pipeline_parallel > 1) snprintf(c->pipeline_schedule, sizeof c->pipeline_schedule, "%s", g_sched ? g_sched : "1f1b");
    if (g_prec) snprintf(c->precision, sizeof c->precision, "%s", g_prec);
    if (g_short) c->data.max_source_length = 8, c->data.max_target_length = 4;
}

static fl_status t5t_run(dr_job *j, int W) {
    return W == 1 ? fl_trainer_run(&j->cfg[0], NULL, 0, dr_record, &j->rec[0], &j->res[0])
                  : fl_comm_threads_run(W, dr_job_rank, j);
}

/* the step-1 checkpoints' exp_avg of two runs, tensor by tensor (the layout of dir's whole model) */
static void t5t_grads(const char *dir, const char *a_out, const char *b_out, const char *what) {
    char pa[800], pb[800];
    snprintf(pa, sizeof pa, "%s/step-000001/training_state.safetensors", a_out);
    snprintf(pb, sizeof pb, "%s/step-000001/training_state.safetensors", b_out);
    fl_st_file a, b;
    FL_REQUIRE_OK(fl_st_open(&a, pa));
    FL_REQUIRE_OK(fl_st_open(&b, pb));
    fl_model_config mc;
    fl_param_layout lay;
    snprintf(pa, sizeof pa, "%s/config.json", dir);
    FL_REQUIRE_OK(fl_hf_load_config(pa, &mc));
    FL_REQUIRE_OK(fl_config_validate(&mc));
    FL_REQUIRE_OK(fl_layout_build(&lay, &mc));
    const fl_st_tensor *ta = fl_st_find(&a, "optimizer.exp_avg"), *tb = fl_st_find(&b, "optimizer.exp_avg");
    const int ok = ta && tb && ta->dtype == FL_F32 && ta->end - ta->begin == lay.numel * 4 &&
                   tb->end - tb->begin == ta->end - ta->begin;
    FL_CHECKF(ok, "%s: the step-1 checkpoints' exp_avg", what);
    double worst = 0;
    const char *at = "";
    for (int i = 0; ok && i < lay.n; i++) {
        const float *x = ta->data, *y = tb->data;
        double d = 0, mx = 0;
        for (size_t k = lay.params[i].offset; k < lay.params[i].offset + lay.params[i].numel; k++) {
            d = fmax(d, fabs((double)x[k] - y[k]));
            mx = fmax(mx, fabs((double)y[k]));
        }
        const double rel = d / (mx > 0 ? mx : 1);
        FL_CHECKF(rel <= 1e-5, "%s: step 1's gradient of %s re-assembled differs by %.3g of its scale", what,
                  lay.params[i].name, rel);
        if (rel > worst) worst = rel, at = lay.params[i].name;
    }
    if (getenv("FL_TEST_VERBOSE")) printf("    %s: step-1 gradients within %.3g of scale (%s)\n", what, worst, at);
    fl_layout_free(&lay);
    fl_st_close(&a);
    fl_st_close(&b);
}

static int g_ckpt; /* activation checkpointing in both runs (the blocks' recompute runs their sums again) */

/* " x PP n (schedule)" of the 3D grid's tests, "" without stages */
static const char *t5t_pp_name(void) {
    static char b[48];
    snprintf(b, sizeof b, " x PP %d (%s)", g_pp, g_sched ? g_sched : "1f1b");
    return g_pp > 1 ? b : "";
}

/* DP dp x TP tp (x PP g_pp) against one process on the folder (relu: v1.0), `steps` steps */
static void t5t_scenario(int relu, int dp, int tp, const char *backend, int steps) {
    const char *dir = t5t_folder(relu);
    FL_REQUIRE(dir != NULL);
    char out[700], ref_out[700], grid[96];
    snprintf(out, sizeof out, "%s/t5tp-%s-dp%d-tp%d-pp%d%s-%s%s%s", fl_test_tmpdir(), relu ? "relu" : "gated", dp, tp, g_pp,
             g_sched ? g_sched : "", backend, g_sp ? "-sp" : "", g_ckpt ? "-ckpt" : "");
    snprintf(ref_out, sizeof ref_out, "%s/t5tp-%s-one-%s", fl_test_tmpdir(), relu ? "relu" : "gated", backend);
    snprintf(grid, sizeof grid, "DP %d x TP %d%s%s", dp, tp, t5t_pp_name(), g_sp ? " + SP" : "");
    dr_job *j = calloc(1, sizeof *j), *one = calloc(1, sizeof *one);
    FL_REQUIRE(j && one);
    const int W = t5t_world(dp, tp);
    for (int r = 0; r < W; r++) t5t_config(&j->cfg[r], dir, dp, tp, out), j->cfg[r].train.max_steps = steps;
    t5t_config(&one->cfg[0], dir, 1, 1, ref_out);
    one->cfg[0].train.max_steps = steps;
    for (int r = 0; r < W; r++) j->cfg[r].train.activation_checkpointing = g_ckpt;
    one->cfg[0].train.activation_checkpointing = g_ckpt;
    setenv("FITLLM_BACKEND", backend, 1);
    fl_status s = t5t_run(j, W);
    FL_CHECKF(s == FL_OK, "T5 at %s on %s: %s", grid, backend, j->msg[0][0] ? j->msg[0] : fl_error_message());
    fl_status s1 = s == FL_OK ? t5t_run(one, 1) : s;
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s1 == FL_OK, "T5 in one process on %s: %s", backend, fl_error_message());
    if (s == FL_OK && s1 == FL_OK) {
        for (int r = 1; r < W; r++)
            FL_CHECKF(!memcmp(j->rec[r].loss, j->rec[0].loss, sizeof j->rec[0].loss), "T5 %s: rank %d's losses differ "
                      "from rank 0's", grid, r);
        const double lr = dr_loss_rel(&j->rec[0], &one->rec[0], steps);
        FL_CHECKF(j->rec[0].steps == steps && lr <= 1e-6, "T5 %s at %s on %s vs one process: %ld steps, step "
                  "losses differ by %.3g relative", relu ? "v1.0" : "v1.1", grid, backend, j->rec[0].steps, lr);
        if (getenv("FL_TEST_VERBOSE"))
            printf("    T5 %s %s on %s: %d step losses within %.3g relative of one process\n", relu ? "v1.0" : "v1.1",
                   grid, backend, steps, lr);
        char what[160];
        snprintf(what, sizeof what, "T5 %s %s on %s%s", relu ? "v1.0" : "v1.1", grid, backend,
                 g_ckpt ? " (checkpointing)" : "");
        t5t_grads(dir, out, ref_out, what);
    }
    for (int r = 0; r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]), dr_free(&one->rec[r]);
    free(j), free(one);
}

/* finetune_lora on the slices: adapters on every PEFT name of T5 (q, k, v, o of the three attentions, wi_0, wi_1, wo),
 * lora_dropout 0, T5's own dropout 0.1: the step losses of TP 2 within 1e-6 relative of one process's, every rank the
 * same, the same final/adapter files (PEFT); with lora_dropout 0.1 (the row-parallel o and wo draw one process's mask
 * at the rank's columns, lora_model.c) the same */
static void t5_lora(float lora_dropout) {
    const char *dir = t5t_folder(0);
    FL_REQUIRE(dir != NULL);
    dr_job *j = calloc(1, sizeof *j), *one = calloc(1, sizeof *one);
    FL_REQUIRE(j && one);
    char out[700], ref_out[700];
    const int W = t5t_world(1, 2);
    snprintf(out, sizeof out, "%s/t5tp-lora-tp2-pp%d%s-%g", fl_test_tmpdir(), g_pp, g_sched ? g_sched : "",
             (double)lora_dropout);
    snprintf(ref_out, sizeof ref_out, "%s/t5tp-lora-one-%g", fl_test_tmpdir(), (double)lora_dropout);
    for (int r = 0; r <= W; r++) {
        fl_run_config *c = r < W ? &j->cfg[r] : &one->cfg[0];
        t5t_config(c, dir, 1, r < W ? 2 : 1, r < W ? out : ref_out);
        c->command = FL_CMD_FINETUNE_LORA;
        c->lora.query = c->lora.key = c->lora.value = c->lora.projection = c->lora.mlp = 1;
        c->lora.dropout = lora_dropout;
        c->optimizer.lr = 1e-2f;
        c->train.max_steps = 4;
        c->train.save_interval = 0;
    }
    setenv("FITLLM_BACKEND", "cpu", 1);
    fl_status s = t5t_run(j, W);
    FL_CHECKF(s == FL_OK, "T5 LoRA TP 2%s: %s", t5t_pp_name(), j->msg[0][0] ? j->msg[0] : fl_error_message());
    fl_status s1 = s == FL_OK ? t5t_run(one, 1) : s;
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s1 == FL_OK, "T5 LoRA in one process: %s", fl_error_message());
    if (s == FL_OK && s1 == FL_OK) {
        for (int r = 1; r < W; r++) FL_CHECK(!memcmp(j->rec[r].loss, j->rec[0].loss, sizeof j->rec[0].loss));
        const double lr = dr_loss_rel(&j->rec[0], &one->rec[0], 4);
        FL_CHECKF(j->rec[0].steps == 4 && lr <= 1e-6, "T5 LoRA TP 2%s vs one process: step losses differ by %.3g",
                  t5t_pp_name(), lr);
        if (getenv("FL_TEST_VERBOSE"))
            printf("    T5 LoRA (dropout %g) TP 2%s: 4 step losses within %.3g relative\n", (double)lora_dropout,
                   t5t_pp_name(), lr);
        char pa[800], pb[800];
        snprintf(pa, sizeof pa, "%s/final/adapter/adapter_model.safetensors", out);
        snprintf(pb, sizeof pb, "%s/final/adapter/adapter_model.safetensors", ref_out);
        fl_st_file a, b;
        FL_REQUIRE_OK(fl_st_open(&a, pa));
        FL_REQUIRE_OK(fl_st_open(&b, pb));
        /* 47 modules: the encoder's 2 blocks x 7 (q, k, v, o, wi_0, wi_1, wo), the decoder's 3 x 11 (+ the cross q, k, v, o) */
        FL_CHECKF(a.n_tensors == b.n_tensors && a.n_tensors == 2 * 47, "final/adapter: %d and %d tensors (2 x 47 modules)",
                  a.n_tensors, b.n_tensors);
        for (int i = 0; i < b.n_tensors; i++)
            FL_CHECKF(fl_st_find(&a, b.tensors[i].name) != NULL, "final/adapter of TP 2 lacks %s", b.tensors[i].name);
        fl_st_close(&a);
        fl_st_close(&b);
    }
    for (int r = 0; r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]), dr_free(&one->rec[r]);
    free(j), free(one);
}

FL_TEST(tp_t5_train_lora_matches_one_process) { t5_lora(0.0f); }
FL_TEST(tp_t5_train_lora_dropout_matches_one_process) { t5_lora(0.1f); }

FL_TEST(tp_t5_train_threads_match_one_process) {
    t5t_scenario(0, 1, 2, "cpu", 4);
    t5t_scenario(1, 1, 4, "cpu", 4);
    g_ckpt = 1;
    t5t_scenario(0, 2, 2, "cpu", 4);
    g_ckpt = 0;
}

/* opaque: the blocks' sums, d(encoder output)'s and the embedding's through the NCCL stand-in on device memory */
FL_TEST(tp_t5_train_nccl_standin_opaque) { t5t_scenario(0, 1, 2, "opaque", 2); }

/* TP 2's step-3 checkpoint (consolidated) resumed at TP 4 and in one process: later losses = the uninterrupted run's
 * (g_sp: every run with tp > 1 sequence parallel) */
static void t5_resume(const char *name) {
    const char *dir = t5t_folder(0);
    FL_REQUIRE(dir != NULL);
    char out[700], from[800];
    snprintf(out, sizeof out, "%s/%s", fl_test_tmpdir(), name);
    dr_job *j = calloc(1, sizeof *j);
    FL_REQUIRE(j != NULL);
    for (int r = 0; r < 2; r++) t5t_config(&j->cfg[r], dir, 1, 2, out);
    setenv("FITLLM_BACKEND", "cpu", 1);
    fl_status s = t5t_run(j, 2);
    FL_CHECKF(s == FL_OK, "T5 TP 2: %s", j->msg[0]);
    dr_rec full = j->rec[0];
    memset(&j->rec[0], 0, sizeof j->rec[0]);
    const long steps = j->cfg[0].train.max_steps, from_step = 3;
    snprintf(from, sizeof from, "%s/step-000003", out);
    const int sizes[2] = {4, 1};
    for (int k = 0; k < 2 && s == FL_OK; k++) {
        char o2[760];
        snprintf(o2, sizeof o2, "%s-r%d", out, sizes[k]);
        for (int r = 0; r < DR_JOB_RANKS; r++) {
            dr_free(&j->rec[r]);
            t5t_config(&j->cfg[r], dir, 1, sizes[k], o2);
            j->cfg[r].train.save_interval = 0;
            snprintf(j->cfg[r].resume, sizeof j->cfg[r].resume, "%s", from);
        }
        fl_status s2 = t5t_run(j, sizes[k]);
        FL_CHECKF(s2 == FL_OK, "T5 resumed at TP %d: %s", sizes[k], j->msg[0][0] ? j->msg[0] : fl_error_message());
        double w = 0;
        for (long st = from_step; s2 == FL_OK && st < steps; st++)
            w = fmax(w, fabs(j->rec[0].loss[st] - full.loss[st]) / fabs(full.loss[st]));
        FL_CHECKF(s2 != FL_OK || (j->rec[0].steps == steps && w <= 1e-6), "T5 TP 2's step 3 resumed at TP %d: %ld steps, "
                  "later losses differ by %.3g relative", sizes[k], j->rec[0].steps, w);
        if (getenv("FL_TEST_VERBOSE"))
            printf("    T5 TP 2%s's step 3 resumed at TP %d: later losses within %.3g relative\n", g_sp ? " + SP" : "",
                   sizes[k], w);
    }
    unsetenv("FITLLM_BACKEND");
    for (int r = 0; r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]);
    dr_free(&full);
    free(j);
}

FL_TEST(tp_t5_train_checkpoint_resumes_at_another_size) { t5_resume("t5tp-resume-tp2"); }

/* every rank's plan of DP dp x TP 2 (x PP g_pp; ZeRO-2 when dp > 1, LoRA when lora) = its measured peaks per tag, one
 * step of the arena's rows test_plan.c's t5_cfg plans */
static void t5t_plan_grid(int dp, int lora) {
    const char *dir = t5t_folder(0);
    FL_REQUIRE(dir != NULL);
    const int W = t5t_world(dp, 2);
    dr_job *j = calloc(1, sizeof *j);
    FL_REQUIRE(j != NULL);
    char out[700], grid[160];
    snprintf(out, sizeof out, "%s/t5tp-plan-%d-2-%d%s%s%s", fl_test_tmpdir(), dp, g_pp, g_sched ? g_sched : "",
             g_sp ? "-sp" : "", lora ? "-lora" : "");
    snprintf(grid, sizeof grid, "T5 DP %d x TP 2%s%s%s%s", dp, t5t_pp_name(), dp > 1 ? " ZeRO-2" : "", g_sp ? " + SP" : "",
             lora ? " LoRA" : "");
    for (int r = 0; r < W; r++) {
        fl_run_config *c = &j->cfg[r];
        t5t_config(c, dir, dp, 2, out);
        c->train.max_steps = 1;
        c->train.save_interval = 0;
        c->data.max_source_length = 8; /* the arena's (and the plan's) rows: test_plan.c's t5_cfg */
        c->data.max_target_length = 4;
        if (dp > 1) snprintf(c->strategy, sizeof c->strategy, "deepspeed_stage_2");
        if (lora) c->command = FL_CMD_FINETUNE_LORA, c->lora.query = c->lora.value = c->lora.projection = 1;
    }
    setenv("FITLLM_BACKEND", "cpu", 1);
    fl_status s = t5t_run(j, W);
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s == FL_OK, "%s: %s", grid, j->msg[0]);
    for (int r = 0; r < W && s == FL_OK; r++) {
        const size_t total = plan_rank_equals_measured(&j->cfg[r], r, &j->res[r], grid);
        if (getenv("FL_TEST_VERBOSE") && (r == 0 || r == W - 1))
            printf("    %s rank %d: planned = measured = %zu bytes (PARAMS %zu, OPTIM %zu, ACTS %zu)\n", grid, r, total,
                   j->res[r].peak[FL_TAG_PARAMS], j->res[r].peak[FL_TAG_OPTIM], j->res[r].peak[FL_TAG_ACTS]);
    }
    for (int r = 0; r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]);
    free(j);
}

/* every rank's plan = its measured peaks per tag: TP 2 (DDP) and DP 2 x TP 2 under ZeRO-2 (OPTIM: the chunk's) */
FL_TEST(tp_t5_train_plan_equals_measured) {
    t5t_plan_grid(1, 0);
    t5t_plan_grid(2, 0);
}

/* refused with the option and the dimension named on every rank (a rank that fails first ends its peers' set-up
 * with its message, as tests/test_tp_train.c's refusals): 3 heads over 2 ranks */
FL_TEST(tp_t5_train_refusals) {
    for (int k = 0; k < 1; k++) {
        const char *dir = t5t_folder(k ? 0 : 2);
        FL_REQUIRE(dir != NULL);
        dr_job *j = calloc(1, sizeof *j);
        FL_REQUIRE(j != NULL);
        char out[700];
        snprintf(out, sizeof out, "%s/t5tp-refused-%d", fl_test_tmpdir(), k);
        for (int r = 0; r < 2; r++) {
            t5t_config(&j->cfg[r], dir, 1, 2, out);
            if (!k) continue;
            j->cfg[r].command = FL_CMD_FINETUNE_LORA;
            j->cfg[r].lora.projection = 1;
            j->cfg[r].lora.dropout = 0.1f;
        }
        setenv("FITLLM_BACKEND", "cpu", 1);
        fl_status s = t5t_run(j, 2);
        unsetenv("FITLLM_BACKEND");
        const char *want = k ? "LoRA dropout (0.1) on the row-parallel" : "the model's 3 attention heads (num_heads) do "
                                                                         "not split evenly over 2 ranks";
        for (int r = 0; r < 2; r++)
            FL_CHECKF(s != FL_OK && j->st[r] != FL_OK && strstr(j->msg[r], "--tensor_parallel 2") &&
                          strstr(j->msg[r], want),
                      "case %d rank %d: %d '%s'", k, r, j->st[r], j->msg[r]);
        free(j);
    }
}

/* ---- sequence parallelism on T5 (--sequence_parallel; seq2seq.c, docs/ARCHITECTURE.md "Sequence parallelism"): both
 * stacks' streams are the rank's rows between the linears; the encoder output is gathered once per pass for the
 * decoder's cross k|v, d(encoder output) reduce-scattered into the rank's rows; T5's dropout draws one process's masks
 * (a stream's rows: the whole pass's mask at the rank's rows). Micro-batches of 1 sequence: a pass whose B T rows the
 * group does not divide runs padding sequences (masked sources, ignored targets) beside the real one. The bars are
 * TP's (above). */
FL_TEST(sp_t5_train_threads_match_one_process) {
    g_sp = 1;
    t5t_scenario(0, 1, 2, "cpu", 4); /* v1.1 (gated) */
    if (fl_test_asan_budget()) {
        t5t_scenario(1, 1, 4, "cpu", 4); /* v1.0 (tied, scaled head), 4 ranks */
        g_ckpt = 1;
        t5t_scenario(0, 2, 2, "cpu", 4); /* DP 2 x TP 2, checkpointing: the recompute gathers and scatters again */
        g_ckpt = 0;
    }
    g_sp = 0;
}

/* T5 + SP: every rank's plan = its measured peaks per tag (TP 2, DP 2 x TP 2 under ZeRO-2), ACTS below TP 2's (micro-
 * batches of 2: at 1 the arena also holds a padding sequence, seq2seq.c sp_pad); TP 2 +
 * SP's step-3 checkpoint (one process's files) resumed in one process and at TP 4 + SP within 1e-6 of the
 * uninterrupted run's later losses; the opaque backend (the gathers and scatters through the NCCL stand-in) */
FL_TEST(sp_t5_train_plan_resume_opaque) {
    if (!fl_test_asan_budget()) return; /* 7 runs */
    const char *dir = t5t_folder(0);
    FL_REQUIRE(dir != NULL);
    size_t acts[2] = {0, 0};
    for (int g = 0; g < 3; g++) { /* TP 2 without SP, with it, DP 2 x TP 2 + SP under ZeRO-2 */
        const int dp = g == 2 ? 2 : 1, W = 2 * dp;
        g_sp = g > 0;
        dr_job *j = calloc(1, sizeof *j);
        FL_REQUIRE(j != NULL);
        char out[700];
        snprintf(out, sizeof out, "%s/t5sp-plan-%d", fl_test_tmpdir(), g);
        for (int r = 0; r < W; r++) {
            t5t_config(&j->cfg[r], dir, dp, 2, out);
            j->cfg[r].train.max_steps = 1;
            j->cfg[r].train.save_interval = 0;
            j->cfg[r].data.max_source_length = 8;
            j->cfg[r].data.max_target_length = 4;
            j->cfg[r].train.micro_batch_size = 2; /* B a multiple of the group: no room for padding sequences */
            if (g == 2) snprintf(j->cfg[r].strategy, sizeof j->cfg[r].strategy, "deepspeed_stage_2");
        }
        setenv("FITLLM_BACKEND", "cpu", 1);
        fl_status s = t5t_run(j, W);
        unsetenv("FITLLM_BACKEND");
        FL_CHECKF(s == FL_OK, "T5 DP %d x TP 2%s: %s", dp, g_sp ? " + SP" : "", j->msg[0]);
        for (int r = 0; r < W && s == FL_OK && g_sp; r++) {
            char grid[48];
            snprintf(grid, sizeof grid, "T5 DP %d x TP 2 + SP", dp);
            const size_t total = plan_rank_equals_measured(&j->cfg[r], r, &j->res[r], grid);
            if (getenv("FL_TEST_VERBOSE") && r == 0)
                printf("    %s rank %d: planned = measured = %zu bytes (ACTS %zu)\n", grid, r, total,
                       j->res[r].peak[FL_TAG_ACTS]);
        }
        if (s == FL_OK && g < 2) acts[g] = j->res[0].peak[FL_TAG_ACTS];
        for (int r = 0; r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]);
        free(j);
    }
    FL_CHECKF(acts[1] < acts[0], "T5 TP 2: ACTS with SP %zu, without %zu", acts[1], acts[0]);
    if (getenv("FL_TEST_VERBOSE")) printf("    T5 TP 2 rank 0 ACTS: TP %zu, TP + SP %zu bytes\n", acts[0], acts[1]);
    g_sp = 1;
    t5_resume("t5sp-resume-tp2");
    t5t_scenario(0, 1, 2, "opaque", 2);
    g_sp = 0;
}

/* ---- T5 with tensor (and sequence) parallelism inside the interleaved schedule (--tensor_parallel 2
 * --pipeline_parallel 2 --pipeline_schedule interleaved: trainer_tp.c's chunk slices over T5's stage models) ----
 * The folder's 2 + 3 blocks in 4 virtual stages [0, 2) [2, 3) [3, 4) [4, 5): rank s's chunk 0 is virtual stage s, its
 * chunk 1 virtual stage 2 + s, so the encoder (virtual stage 0) and the three decoder blocks sit on both ranks and
 * both chunks; each chunk its TP slice of its virtual stage. d(encoder output) crosses back from the last virtual
 * stage to the first through every chunk (each decoder chunk parks what it received, sums its blocks' parts over the
 * group, adds it back), the shared embedding's and both tables' gradients are summed over every chunk and the stages,
 * the clipping norm (0.5) is one number over every chunk, the group and the stages. The bars are TP's (above): step
 * losses within 1e-6 relative of one process, step 1's gradients (the step-1 checkpoint gathered chunk by chunk over
 * the group, then the virtual stages in order) within 1e-5 of each tensor's scale. */
FL_TEST(tpi_t5_train_threads_match_one_process) {
    g_pp = 2, g_sched = "interleaved";
    t5t_scenario(0, 1, 2, "cpu", 4); /* v1.1 (gated, untied head) */
    if (!fl_test_asan_light()) t5t_scenario(0, 2, 2, "cpu", 4); /* DP 2 x TP 2 x PP 2 x 2 chunks: 8 thread ranks */
    if (!fl_test_quick()) t5t_scenario(1, 1, 2, "cpu", 4); /* v1.0: the tied, scaled head on the last virtual stage */
    g_pp = 1, g_sched = NULL;
}

/* sequence parallelism in the chunks: the streams between virtual stages are the rank's rows, the encoder output
 * whole, d(encoder output) each TP rank's partial sum, which every decoder chunk adds its blocks' to and the encoder's
 * chunk (virtual stage 0) reduce-scatters into its rows; micro-batches of 1 pad a sequence beside the real one
 * (seq2seq.c sp_pad). TP 2 x PP 2 x 2 chunks; DP 2 x TP 2 x PP 2 x 2 in the full tier. */
FL_TEST(tpi_t5_train_sequence_parallel) {
    g_pp = 2, g_sched = "interleaved", g_sp = 1;
    t5t_scenario(0, 1, 2, "cpu", 4);
    if (!fl_test_quick()) t5t_scenario(0, 2, 2, "cpu", 4);
    g_pp = 1, g_sched = NULL, g_sp = 0;
}

/* LoRA on the chunks' slices (each chunk's adapters at the whole model's module index of its first block, the
 * row-parallel A the rank's columns), lora_dropout 0.1 and T5's own 0.1: TP 2 x PP 2 x 2 chunks, 4 steps, the bars of
 * t5_lora above (the adapter files: PEFT's 94 tensors, gathered chunk by chunk) */
FL_TEST(tpi_t5_train_lora) {
    if (!fl_test_asan_budget()) return; /* ~0.5 s; LoRA's chunks under ASan: tpi_t5_train_plan_resume (its LoRA grid) */
    g_pp = 2, g_sched = "interleaved";
    t5_lora(0.1f);
    g_pp = 1, g_sched = NULL;
}

/* 16-mixed with an fp16 overflow injected into ONE rank's gradients at step 2 (fitllm/fault.h; rank 3: TP rank 1 of
 * stage 1, not the rank that reports): one verdict over every chunk, the group and the stages (pp_step.c
 * amp_verdict), so every rank skips that step once and halves its scale (65536 -> 32768); the losses within 1e-6
 * relative of one 16-mixed process with the same injection (one process without it skips nothing: the skip is the
 * hook's) */
FL_TEST(tpi_t5_train_fp16_overflow_on_one_rank) {
    const char *dir = t5t_folder(0);
    FL_REQUIRE(dir != NULL);
    g_prec = "16-mixed";
    dr_job *j[3];
    const int fault[3] = {-2, 0, 3}; /* one process clean, one process with the fault, the grid's rank 3 */
    for (int k = 0; k < 3; k++) {
        g_pp = k == 2 ? 2 : 1, g_sched = k == 2 ? "interleaved" : NULL;
        const int W = k == 2 ? t5t_world(1, 2) : 1;
        j[k] = calloc(1, sizeof *j[k]);
        FL_REQUIRE(j[k] != NULL);
        char out[700];
        snprintf(out, sizeof out, "%s/t5tpi-fp16-%d", fl_test_tmpdir(), k);
        for (int r = 0; r < W; r++) {
            t5t_config(&j[k]->cfg[r], dir, 1, W > 1 ? 2 : 1, out);
            j[k]->cfg[r].train.max_steps = 4;
            j[k]->cfg[r].train.save_interval = 0;
        }
        fl_fault_clear();
        if (fault[k] >= 0) FL_REQUIRE_OK(fl_fault_set(FL_FAULT_GRAD_OVERFLOW, fault[k], 2));
        setenv("FITLLM_BACKEND", "cpu", 1);
        fl_status s = t5t_run(j[k], W);
        unsetenv("FITLLM_BACKEND");
        fl_fault_clear();
        FL_CHECKF(s == FL_OK, "T5 16-mixed run %d: %s", k, j[k]->msg[0][0] ? j[k]->msg[0] : fl_error_message());
    }
    FL_CHECKF(j[0]->res[0].skipped_steps == 0 && j[1]->res[0].skipped_steps == 1 && j[1]->res[0].loss_scale == 32768.0f,
              "one 16-mixed process: %ld skipped steps without the fault (want 0), %ld with it (want 1), scale %g",
              j[0]->res[0].skipped_steps, j[1]->res[0].skipped_steps, (double)j[1]->res[0].loss_scale);
    double worst = 0;
    for (int r = 0; r < 4; r++) {
        const double w = dr_loss_rel(&j[2]->rec[r], &j[1]->rec[0], 4);
        worst = fmax(worst, w);
        FL_CHECKF(j[2]->res[r].skipped_steps == 1 && j[2]->res[r].loss_scale == 32768.0f && w <= 1e-6,
                  "T5 16-mixed TP 2 x PP 2 x 2 chunks, overflow at rank 3 step 2: rank %d skipped %ld steps, scale %g "
                  "(one process: 1, 32768), losses %.3g relative from one process's", r, j[2]->res[r].skipped_steps,
                  (double)j[2]->res[r].loss_scale, w);
    }
    if (getenv("FL_TEST_VERBOSE"))
        printf("    T5 16-mixed TP 2 x PP 2 x 2 chunks, overflow at rank 3: 1 skip on all 4 ranks, losses within %.3g "
               "of one process\n", worst);
    for (int k = 0; k < 3; k++) {
        for (int r = 0; r < DR_JOB_RANKS; r++) dr_free(&j[k]->rec[r]);
        free(j[k]);
    }
    g_pp = 1, g_sched = NULL, g_prec = NULL;
}

/* the opaque backend (the streams between virtual stages, d(encoder output)'s parking, the norms and the checkpoints
 * through its copies; the blocks' sums through the NCCL stand-in) and the CUDA backend's code over the emulator:
 * TP 2 x PP 2 x 2 chunks, 2 steps, the step-1 gradients re-assembled; the full tier (quick: the threads on cpu) */
FL_TEST(tpi_t5_train_nccl_standin_opaque_cuda_emu) {
    if (!fl_test_full_only("tpi_t5_train_threads_match_one_process, tp_t5_train_nccl_standin_opaque")) return;
    g_pp = 2, g_sched = "interleaved";
    t5t_scenario(0, 1, 2, "opaque", 2);
#if defined(FL_HAVE_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
    g_short = 1; /* one step of short pairs (the emulated kernels are slow): its loss and gradients */
    t5t_scenario(0, 1, 2, "cuda-emu", 1);
    g_short = 0;
#endif
    g_pp = 1, g_sched = NULL;
}

/* every rank's plan = its measured peaks per tag under TP inside the interleaved schedule (each rank's 2 chunk slices:
 * their parameters, gradients, state and arenas, the stashes of the chunk-micro-batches in flight): TP 2 x PP 2 x 2
 * chunks (AdamW), DP 2 x TP 2 x PP 2 x 2 under ZeRO-2 (the full tier), with SP, LoRA */
FL_TEST(tpi_t5_train_plan_equals_measured) {
    g_pp = 2, g_sched = "interleaved";
    t5t_plan_grid(1, 0);
    if (!fl_test_quick()) t5t_plan_grid(2, 0);
    t5t_plan_grid(1, 1);
    g_sp = 1;
    t5t_plan_grid(1, 0);
    g_pp = 1, g_sched = NULL, g_sp = 0;
}

/* run TP tp (x PP g_pp under g_sched; tp 1: one process) into out, 5 steps, a checkpoint every `save` steps (0: none),
 * resuming from `resume` when given */
static fl_status t5i_run(dr_job *j, int tp, const char *out, const char *resume, int save) {
    const char *dir = t5t_folder(0);
    FL_REQUIRE_R(dir != NULL, FL_ERR_INVALID);
    const int W = t5t_world(1, tp);
    for (int r = 0; r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]);
    for (int r = 0; r < W; r++) {
        t5t_config(&j->cfg[r], dir, 1, tp, out);
        j->cfg[r].train.max_steps = 5;
        j->cfg[r].train.save_interval = save;
        if (resume) snprintf(j->cfg[r].resume, sizeof j->cfg[r].resume, "%s", resume);
    }
    setenv("FITLLM_BACKEND", "cpu", 1);
    fl_status s = t5t_run(j, W);
    unsetenv("FITLLM_BACKEND");
    return s;
}

/* checkpoints across grids and schedules: TP 2 x PP 2 x 2 chunks' step-3 checkpoint (each chunk gathered over the
 * group, then the virtual stages in order: one process's HF folder and training state) resumed in one process, at TP 2
 * x PP 2 under GPipe and interleaved with SP; the GPipe run's step 4 resumed interleaved (the reverse). Each resumed
 * run's later losses within 1e-6 relative of the uninterrupted interleaved run's (TP's bar: the grids reassociate) */
FL_TEST(tpi_t5_train_resume_across_grids) {
    char out[700], from[800], o2[760];
    snprintf(out, sizeof out, "%s/t5tpi-resume", fl_test_tmpdir());
    dr_job *j = calloc(1, sizeof *j);
    FL_REQUIRE(j != NULL);
    g_pp = 2, g_sched = "interleaved";
    FL_REQUIRE_OK(t5i_run(j, 2, out, NULL, 3));
    dr_rec full = j->rec[0];
    memset(&j->rec[0], 0, sizeof j->rec[0]);
    const struct { const char *from, *sched; long step; int tp, sp; const char *name; } k_case[4] = {
        {"", NULL, 3, 1, 0, "one process"},
        {"", "gpipe", 3, 2, 0, "TP 2 x PP 2 gpipe"},
        {"-gpipe", "interleaved", 4, 2, 0, "TP 2 x PP 2 interleaved"},
        {"", "interleaved", 3, 2, 1, "TP 2 x PP 2 interleaved + SP"},
    };
    for (int k = 0; k < (fl_test_asan_light() ? 2 : fl_test_quick() ? 3 : 4); k++) { /* SP: the full tier */
        snprintf(from, sizeof from, "%s%s/step-%06ld", out, k_case[k].from, k_case[k].step);
        snprintf(o2, sizeof o2, "%s-%s%s", out, k_case[k].sched ? k_case[k].sched : "one", k_case[k].sp ? "-sp" : "");
        g_pp = k_case[k].tp > 1 ? 2 : 1, g_sched = k_case[k].sched, g_sp = k_case[k].sp;
        fl_status s = t5i_run(j, k_case[k].tp, o2, from, k == 1 ? 4 : 0); /* GPipe's step 4: case 2's */
        FL_CHECKF(s == FL_OK, "T5 resumed at %s: %s", k_case[k].name, j->msg[0][0] ? j->msg[0] : fl_error_message());
        double w = 0;
        for (long st = k_case[k].step; s == FL_OK && st < 5; st++)
            w = fmax(w, fabs(j->rec[0].loss[st] - full.loss[st]) / fabs(full.loss[st]));
        FL_CHECKF(s != FL_OK || (j->rec[0].steps == 5 && w <= 1e-6), "T5 %s resumed from '%s': steps %ld, later losses "
                  "differ by %.3g relative from the uninterrupted interleaved run", k_case[k].name, from, j->rec[0].steps, w);
        if (getenv("FL_TEST_VERBOSE")) printf("    T5 %s from %s: later losses within %.3g relative\n", k_case[k].name, from, w);
    }
    g_pp = 1, g_sched = NULL, g_sp = 0;
    for (int r = 0; r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]);
    dr_free(&full);
    free(j);
}
