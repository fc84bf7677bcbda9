/* BLIP-2 fine-tuning as a library call (fitllm/blip2_train.h, src/train/blip2_train.c): a run on the shipped tiny
 * OPT folder (tests/fixtures/blip2-tiny-opt) and captions of token ids over the shipped images; a stop after step 2
 * resumed to the end equals the uninterrupted run bit for bit; a rehearsal's result (steps, losses, times, snapshots,
 * peaks per tag, bytes per part) and its OOM verdict under a budget below its own peak; refusals by name. The CLI
 * suite checks the commands over this entry (tests/cli_test.sh blip2_*). */
#include <dirent.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitllm/blip2_train.h"
#include "fitllm/checkpoint.h"
#include "fitllm/comm.h"
#include "fitllm/config.h"
#include "fitllm/io.h"
#include "fitllm/peft.h"
#include "test.h"

#define FIX "tests/fixtures/blip2-tiny-opt"

/* captions.jsonl in dir: 8 of the shipped images, each captioned with 5 token ids (the fixture has no tokenizer) */
static int write_captions(const char *dir, char *path, size_t n) {
    static const char *const img[8] = {"palette_45x31.png", "rgb_13x7.png", "rgba_37x53.png", "one_1x1.png",
                                       "prog_50x33.jpg", "rgb420_97x61.jpg", "palette_45x31.png", "rgb_13x7.png"};
    char cwd[PATH_MAX];
    if (!realpath(".", cwd)) return 0;
    snprintf(path, n, "%s/captions.jsonl", dir);
    FILE *f = fopen(path, "w");
    if (!f) return 0;
    for (int k = 0; k < 8; k++)
        fprintf(f, "{\"image\": \"%s/tests/fixtures/images/%s\", \"text\": \"%d %d 9 11 %d\"}\n", cwd, img[k],
                3 * (k + 1), k + 41, 2 * k + 22);
    return fclose(f) == 0;
}

static void run_config(fl_run_config *c, const char *captions, const char *out_dir, long max_steps) {
    fl_cfg_defaults(c, FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "%s", FIX);
    c->data.kind = FL_DATA_JSON;
    snprintf(c->data.json_path, sizeof c->data.json_path, "%s", captions);
    snprintf(c->out_dir, sizeof c->out_dir, "%s", out_dir);
    c->train.max_steps = max_steps;
    c->train.micro_batch_size = 2;
    c->train.global_batch_size = 4;
    c->train.lr_warmup_steps = 0;
    c->train.save_interval = 100;
    c->optimizer.lr = 0.003f;
    c->threads = 2;
}

static int stop_after_2(void *ud) {
    int *calls = ud;
    return ++*calls == 2 ? 15 : 0; /* after the second step, as SIGTERM would */
}

FL_TEST(blip2_train_entry_run_stop_resume) {
    const char *tmp = fl_test_tmpdir();
    char caps[4200], a[4200], b[4200], fa[4300], fb[4300];
    FL_REQUIRE(write_captions(tmp, caps, sizeof caps));
    snprintf(a, sizeof a, "%s/straight", tmp);
    snprintf(b, sizeof b, "%s/stopped", tmp);
    fl_run_config c;
    run_config(&c, caps, a, 4);
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    double loss[4] = {0}, ms[4] = {0};
    fl_blip2_train_opts o = {.be = &be, .step_ms = ms, .step_loss = loss, .n_step_out = 4};
    fl_blip2_train_result r;
    FL_REQUIRE_OK(fl_blip2_train(&c, &o, &r));
    FL_CHECKF(r.steps == 4 && r.session_steps == 4 && r.stopped == 0 && r.set_up, "steps %ld/%ld", r.steps,
              r.session_steps);
    FL_CHECKF(loss[3] < loss[0] && r.last_loss == loss[3] && isnan(r.val_loss), "loss %g -> %g", loss[0], loss[3]);
    FL_CHECK(ms[0] > 0 && r.step_ms_mean > 0 && r.train_seconds > 0);
    FL_CHECKF(strstr(r.final_dir, "straight/final") != NULL, "final_dir '%s'", r.final_dir);
    /* the default parts: the vision tower frozen (no gradients, no state), the Q-Former and OPT trained */
    FL_CHECK(r.part_params[FL_BLIP2_VISION] > 0 && r.part_grads[FL_BLIP2_VISION] == 0 && r.part_optim[FL_BLIP2_VISION] == 0);
    FL_CHECK(r.part_grads[FL_BLIP2_QFORMER] > 0 && r.part_optim[FL_BLIP2_QFORMER] == 2 * r.part_grads[FL_BLIP2_QFORMER]);
    FL_CHECK(r.part_grads[FL_BLIP2_TEXT] > 0 && r.trained * 4 == r.part_grads[FL_BLIP2_QFORMER] + r.part_grads[FL_BLIP2_TEXT]);
    size_t acts = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) acts += r.part_acts[k];
    FL_CHECKF(acts > 0 && acts <= r.peak[FL_TAG_ACTS] && r.peak[FL_TAG_OPTIM] > 0, "acts %zu, peak ACTS %zu", acts,
              r.peak[FL_TAG_ACTS]);
    FL_CHECKF(r.n_phases >= 6 && !strcmp(r.phases[0].name, "after_load") && !strcmp(r.phases[4].name, "after_opt_step"),
              "%d phases", r.n_phases);

    /* stopped after step 2 (its checkpoint committed: train.save_on_signal), then resumed to step 4 */
    int calls = 0;
    run_config(&c, caps, b, 4);
    fl_blip2_train_opts os = {.be = &be, .stop = stop_after_2, .stop_ud = &calls};
    FL_REQUIRE_OK(fl_blip2_train(&c, &os, &r));
    FL_CHECKF(r.stopped == 15 && r.steps == 2 && !r.final_dir[0], "stopped %d at %ld", r.stopped, r.steps);
    snprintf(c.resume, sizeof c.resume, "auto");
    fl_blip2_train_opts on = {.be = &be};
    FL_REQUIRE_OK(fl_blip2_train(&c, &on, &r));
    FL_CHECKF(r.steps == 4 && r.session_steps == 2, "resumed: %ld steps, %ld this session", r.steps, r.session_steps);
    snprintf(fa, sizeof fa, "%s/final/model.safetensors", a);
    snprintf(fb, sizeof fb, "%s/final/model.safetensors", b);
    size_t na = 0, nb = 0;
    unsigned char *da = fl_test_st_data(fa, &na), *db = fl_test_st_data(fb, &nb);
    FL_CHECKF(da && db && na == nb && !memcmp(da, db, na), "%s and %s differ", fa, fb);
    free(da), free(db);
    fl_backend_free(&be);
}

/* finetune_lora's command and defaults (the lab's q, v on the language model), rank 4 */
static void lora_config(fl_run_config *c) {
    fl_run_config d;
    fl_cfg_defaults(&d, FL_CMD_FINETUNE_LORA);
    c->command = d.command, c->lora = d.lora, c->lora.r = 4;
}

/* What a save leaves in out_dir: logs/ and whole committed folders (step-*, final/), each with hyperparameters.yaml
 * (final/ of a LoRA run also adapter/); never a temporary or an uncommitted folder. 0 and a message otherwise. */
static int out_dir_whole(const char *out, int lora, char *why, size_t n) {
    DIR *d = opendir(out);
    if (!d) return snprintf(why, n, "%s: cannot open", out), 0;
    struct dirent *e;
    int ok = 1;
    char p[4400], q[4500];
    while (ok && (e = readdir(d)) != NULL) {
        const char *nm = e->d_name;
        if (!strcmp(nm, ".") || !strcmp(nm, "..") || !strcmp(nm, "logs")) continue;
        snprintf(p, sizeof p, "%s/%s", out, nm);
        if (strncmp(nm, "step-", 5) && strcmp(nm, "final")) ok = 0, snprintf(why, n, "%s left", p);
        else if (!fl_ckpt_is_committed(p)) ok = 0, snprintf(why, n, "%s is not committed", p);
        for (int k = 0; ok && k < 3; k++) {
            static const char *const need[3] = {"hyperparameters.yaml", "training_state.safetensors", "adapter"};
            if (k && !strcmp(nm, "final") && !lora) break; /* final/: no training state; adapter/ under LoRA */
            if (k == 1 && !strcmp(nm, "final")) continue;
            if (k == 2 && strcmp(nm, "final")) continue;
            snprintf(q, sizeof q, "%s/%s", p, need[k]);
            if (access(q, F_OK) != 0) ok = 0, snprintf(why, n, "%s has no %s", p, need[k]);
        }
    }
    closedir(d);
    return ok;
}

/* BLIP-2's saves are the trainer's (a temporary folder, renamed, COMMITTED; hyperparameters.yaml in each): a run saving
 * step-000001, step-000002 and final/ commits all three; each of its file writes made to fail in turn (ENOSPC:
 * fl_io_fail_writes_after) fails the run with the I/O error and leaves no temporary and no uncommitted folder, the
 * checkpoints committed before it whole. Full fine-tuning (HF folders) and LoRA (the adapter's folders). */
FL_TEST(blip2_train_entry_failed_saves_leave_nothing) {
    const char *tmp = fl_test_tmpdir();
    char caps[4200], out[1024], why[9000];
    FL_REQUIRE(write_captions(tmp, caps, sizeof caps));
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    for (int lora = 0; lora < 2; lora++) {
        fl_run_config c;
        snprintf(out, sizeof out, "%s/b2save%d", tmp, lora);
        run_config(&c, caps, out, 2);
        if (lora) lora_config(&c);
        c.train.save_interval = 1;
        c.train.global_batch_size = 2;
        fl_blip2_train_opts o = {.be = &be};
        fl_blip2_train_result r;
        fl_io_fail_writes_after(1L << 40);
        FL_REQUIRE_OK(fl_blip2_train(&c, &o, &r));
        const long total = (1L << 40) - fl_io_writes_left();
        fl_io_fail_writes_after(-1);
        FL_CHECKF(out_dir_whole(out, lora, why, sizeof why), "%s", why);
        snprintf(why, sizeof why, "%s/final", out);
        FL_CHECKF(fl_ckpt_is_committed(why), "%s is not committed", why);
        FL_REQUIRE(total > 30);
        /* every write (456 with full fine-tuning, 195 with LoRA: most of them model.safetensors' tensors); the quick
         * tier every 5th and the last 20 (final/'s adapter, hyperparameters.yaml and marker), under ASan every 17th
         * and the last 8 */
        const long stride = fl_test_asan_light() ? 17 : fl_test_quick() ? 5 : 1, tail = fl_test_asan_light() ? 8 : 20;
        for (long k = 0; k < total; k = k >= total - tail ? k + 1 : k + stride < total - tail ? k + stride : total - tail) {
            snprintf(out, sizeof out, "%s/b2save%d-%ld", tmp, lora, k);
            snprintf(c.out_dir, sizeof c.out_dir, "%s", out);
            fl_io_fail_writes_after(k);
            const fl_status s = fl_blip2_train(&c, &o, &r);
            fl_io_fail_writes_after(-1);
            FL_CHECKF(s == FL_ERR_IO && strstr(fl_error_message(), "No space left"), "lora %d, write %ld of %ld failing: "
                      "status %d, %s", lora, k, total, (int)s, fl_error_message());
            FL_CHECKF(out_dir_whole(out, lora, why, sizeof why), "lora %d, write %ld of %ld failing: %s", lora, k, total,
                      why);
        }
    }
    fl_backend_free(&be);
}

/* A BLIP-2 PEFT adapter merged by the library (fl_blip2_merge_peft: what merge_lora and generate --adapter run on a
 * BLIP-2 base): a LoRA run's last step adapter (modules language_model.<module>) merged into the base and saved is the
 * run's final/ (the trainer's own merge) byte for byte, OPT and Flan-T5; an adapter module the model lacks, or of
 * another shape, is refused by name. */
FL_TEST(blip2_merge_peft_equals_final) {
    const char *tmp = fl_test_tmpdir();
    static const char *const fix[2] = {FIX, "tests/fixtures/blip2-tiny-t5"};
    char caps[4200], out[1024], p[1200], q[1200];
    FL_REQUIRE(write_captions(tmp, caps, sizeof caps));
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    for (int v = 0; v < 2; v++) {
        fl_run_config c;
        snprintf(out, sizeof out, "%s/b2merge%d", tmp, v);
        run_config(&c, caps, out, 2);
        snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", fix[v]);
        lora_config(&c);
        c.train.save_interval = 2;
        c.optimizer.lr = 0.05f;
        const fl_blip2_train_opts o = {.be = &be};
        fl_blip2_train_result r;
        FL_REQUIRE_OK(fl_blip2_train(&c, &o, &r));
        fl_peft_adapter a;
        snprintf(p, sizeof p, "%s/step-000002", out);
        FL_REQUIRE_OK(fl_peft_load(p, &a));
        FL_CHECKF(a.n > 0 && !strncmp(a.mods[0].name, "language_model.", 15), "%d modules, '%s'", a.n, a.mods[0].name);
        fl_blip2 *b = NULL;
        FL_REQUIRE_OK(fl_blip2_load(&b, fix[v], &be, &pool));
        FL_REQUIRE_OK(fl_blip2_merge_peft(b, &a));
        snprintf(p, sizeof p, "%s/merged", out);
        FL_REQUIRE_OK(fl_blip2_save(b, fix[v], p));
        snprintf(p, sizeof p, "%s/merged/model.safetensors", out);
        snprintf(q, sizeof q, "%s/final/model.safetensors", out);
        size_t np = 0, nq = 0;
        unsigned char *dp = fl_test_st_data(p, &np), *dq = fl_test_st_data(q, &nq);
        FL_CHECKF(dp && dq && np == nq && !memcmp(dp, dq, np), "%s: the merged step adapter differs from %s", fix[v], q);
        free(dp), free(dq);
        /* refusals: a module the model lacks, one of another shape */
        char keep[sizeof a.mods[0].name];
        memcpy(keep, a.mods[0].name, sizeof keep);
        snprintf(a.mods[0].name, sizeof a.mods[0].name, "language_model.no.such.proj");
        FL_CHECK(fl_blip2_merge_peft(b, &a) == FL_ERR_INVALID && strstr(fl_error_message(), "'language_model.no.such.proj' "
                                                                        "is not a linear layer of this BLIP-2 model"));
        memcpy(a.mods[0].name, keep, sizeof keep);
        a.mods[0].in--;
        FL_CHECK(fl_blip2_merge_peft(b, &a) == FL_ERR_INVALID && strstr(fl_error_message(), "the model's"));
        a.mods[0].in++;
        fl_blip2_free(b);
        fl_peft_free(&a);
    }
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* The live rows of the memory report follow the decoder trainer's rule per tag (docs/ARCHITECTURE.md "Reserved and
 * live memory"): PARAMS, OPTIM and OTHER (the patch staging, in every phase row) live in full; ACTS nothing before the
 * forward, after a training forward what the backward reads (less than the arena: the OPT head's norm output is not),
 * after the backward nothing; WORKSPACE after the forward the OPT head's d(final norm out) and ids (N (C + 1) floats),
 * else nothing; GRADS 0 after zeroing, the tied head's V x C after the forward (the first micro-batch of 2), all after
 * the backward, 0 after the update. LoRA: the adapters' gradients all after the backward; the Flan-T5 variant: its
 * language model's arena counted as a T5's. */
FL_TEST(blip2_train_entry_live_by_phase) {
    const char *tmp = fl_test_tmpdir();
    char caps[4200], out[1024];
    FL_REQUIRE(write_captions(tmp, caps, sizeof caps));
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    static const char *const fix[2] = {FIX, "tests/fixtures/blip2-tiny-t5"};
    for (int v = 0; v < 3; v++) { /* OPT full, OPT LoRA, Flan-T5 full */
        fl_run_config c;
        snprintf(out, sizeof out, "%s/b2live%d", tmp, v);
        run_config(&c, caps, out, 1);
        snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", fix[v == 2]);
        if (v == 1) lora_config(&c);
        const fl_blip2_train_opts o = {.be = &be};
        fl_blip2_train_result r;
        FL_REQUIRE_OK(fl_blip2_train(&c, &o, &r));
        FL_REQUIRE(r.n_phases >= 5);
        const fl_mem_phase *ph = r.phases; /* after_load, before_fwd, after_fwd, after_bwd, after_opt_step */
        for (int i = 1; i < 5; i++) {
            for (int t = 0; t < FL_TAG_COUNT; t++)
                FL_CHECKF(ph[i].live[t] <= ph[i].cur[t], "v %d %s: %s live %zu > %zu", v, ph[i].name,
                          fl_mem_tag_name((fl_mem_tag)t), ph[i].live[t], ph[i].cur[t]);
            FL_CHECKF(ph[i].live[FL_TAG_PARAMS] == ph[i].cur[FL_TAG_PARAMS] &&
                          ph[i].live[FL_TAG_OPTIM] == ph[i].cur[FL_TAG_OPTIM] &&
                          ph[i].live[FL_TAG_OTHER] == ph[i].cur[FL_TAG_OTHER] && ph[i].cur[FL_TAG_OTHER] > 0,
                      "v %d %s: PARAMS, OPTIM, OTHER not live in full (OTHER %zu of %zu)", v, ph[i].name,
                      ph[i].live[FL_TAG_OTHER], ph[i].cur[FL_TAG_OTHER]);
        }
        FL_CHECKF(r.peak[FL_TAG_OTHER] == ph[1].cur[FL_TAG_OTHER], "v %d: OTHER peak %zu, in the phase rows %zu", v,
                  r.peak[FL_TAG_OTHER], ph[1].cur[FL_TAG_OTHER]);
        const size_t *b0 = ph[1].live, *f = ph[2].live, *bw = ph[3].live, *u = ph[4].live;
        FL_CHECKF(b0[FL_TAG_ACTS] == 0 && b0[FL_TAG_GRADS] == 0 && b0[FL_TAG_WORKSPACE] == 0, "v %d before_fwd: ACTS %zu "
                  "GRADS %zu WORKSPACE %zu", v, b0[FL_TAG_ACTS], b0[FL_TAG_GRADS], b0[FL_TAG_WORKSPACE]);
        FL_CHECKF(f[FL_TAG_ACTS] > 0 && f[FL_TAG_ACTS] < ph[2].cur[FL_TAG_ACTS], "v %d after_fwd: ACTS live %zu of %zu", v,
                  f[FL_TAG_ACTS], ph[2].cur[FL_TAG_ACTS]);
        FL_CHECKF(bw[FL_TAG_ACTS] == 0 && bw[FL_TAG_WORKSPACE] == 0 && bw[FL_TAG_GRADS] == ph[3].cur[FL_TAG_GRADS] &&
                      bw[FL_TAG_GRADS] > 0, "v %d after_bwd: ACTS %zu WORKSPACE %zu GRADS %zu of %zu", v,
                  bw[FL_TAG_ACTS], bw[FL_TAG_WORKSPACE], bw[FL_TAG_GRADS], ph[3].cur[FL_TAG_GRADS]);
        FL_CHECKF(u[FL_TAG_GRADS] == 0 && u[FL_TAG_ACTS] == 0, "v %d after_opt_step: GRADS %zu ACTS %zu", v,
                  u[FL_TAG_GRADS], u[FL_TAG_ACTS]);
        if (v == 2) continue;
        /* OPT: 2 captions of BOS + 5 ids after the 5 queries, N = 22 rows; the tied head V x C (LoRA: no head adapter) */
        fl_blip2_config bc;
        FL_REQUIRE_OK(fl_blip2_config_load(FIX "/config.json", &bc));
        const size_t N = 2 * (size_t)(bc.n_queries + 6), C = (size_t)bc.text.dim, V = (size_t)bc.text.vocab_size;
        FL_CHECKF(f[FL_TAG_WORKSPACE] == N * C * 4 + (v ? 0 : N * 4), "v %d after_fwd: WORKSPACE live %zu, want %zu", v,
                  f[FL_TAG_WORKSPACE], N * C * 4 + (v ? 0 : N * 4));
        FL_CHECKF(f[FL_TAG_GRADS] == (v ? 0 : V * C * 4), "v %d after_fwd: GRADS live %zu, the head's %zu", v,
                  f[FL_TAG_GRADS], v ? 0 : V * C * 4);
    }
    fl_backend_free(&be);
}

FL_TEST(blip2_train_entry_rehearsal_and_oom) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_LORA);
    c.train.micro_batch_size = c.train.global_batch_size = 2;
    c.optimizer.lr = 0.002f;
    c.threads = 2;
    double loss[3], ms[3];
    fl_blip2_train_opts o = {.shape = &bc, .synth_len = 6, .rehearse_steps = 3, .step_ms = ms, .step_loss = loss,
                             .n_step_out = 3};
    fl_blip2_train_result r;
    FL_REQUIRE_OK(fl_blip2_train(&c, &o, &r));
    FL_CHECKF(r.steps == 3 && r.session_steps == 3 && isfinite(loss[0]) && loss[2] < loss[0], "loss %g -> %g", loss[0],
              loss[2]);
    /* LoRA on the language model: only its adapters train, the rest is frozen */
    FL_CHECKF(r.trained > 0 && r.part_grads[FL_BLIP2_QFORMER] == 0 && r.part_grads[FL_BLIP2_TEXT] == r.trained * 4,
              "trained %zu, lm grads %zu", r.trained, r.part_grads[FL_BLIP2_TEXT]);
    FL_CHECKF(r.n_phases == 5 && !strcmp(r.phases[1].name, "before_fwd"), "%d phases", r.n_phases);
    FL_CHECK(r.peak_total > 0 && !r.oom.valid && !r.final_dir[0]);
    /* the same rehearsal under a budget below its own peak: out of memory, the failed allocation recorded */
    const size_t need = r.peak_total;
    o.budget = need - need / 8;
    FL_CHECK(fl_blip2_train(&c, &o, &r) == FL_ERR_OOM && r.oom.valid && r.oom.budget == need - need / 8);
    o.budget = need;
    FL_CHECK(fl_blip2_train(&c, &o, &r) == FL_OK);

    /* refusals, by name */
    o.budget = 0;
    o.synth_len = 1;
    FL_CHECK(fl_blip2_train(&c, &o, &r) == FL_ERR_INVALID && strstr(fl_error_message(), "a caption of 1 tokens"));
    o.synth_len = 6, o.rehearse_steps = 0;
    FL_CHECK(fl_blip2_train(&c, &o, &r) == FL_ERR_INVALID && strstr(fl_error_message(), "are for rehearsals"));
    o.rehearse_steps = 1;
    snprintf(c.precision, sizeof c.precision, "16-mixed");
    FL_CHECK(fl_blip2_train(&c, &o, &r) == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "--precision 16-mixed"));
}

/* Data parallelism through the entry (the lab's rows run their ranks as threads): 2 ranks on the threads
 * communicator, a rehearsal of blip2-micro; ZeRO-2 and ZeRO-2 with CPU offload give DDP's losses bit for bit, each
 * rank holding about half of each trained part's optimizer state (offload: in the host tier, none on the device). */
typedef struct {
    const fl_run_config *c;
    const fl_blip2_config *bc;
    double loss[2][3];
    fl_blip2_train_result res[2];
} ranks_ctx;

static fl_status rank_fn(fl_comm *comm, int rank, void *ud) {
    ranks_ctx *x = ud;
    const fl_blip2_train_opts o = {.shape = x->bc, .synth_len = 6, .rehearse_steps = 3, .comm = comm,
                                   .step_loss = x->loss[rank], .n_step_out = 3};
    return fl_blip2_train(x->c, &o, &x->res[rank]);
}

FL_TEST(blip2_train_entry_zero_over_threads) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    static const char *const st[3] = {"ddp", "deepspeed_stage_2", "deepspeed_stage_2_offload"};
    ranks_ctx *x = calloc(3, sizeof *x);
    FL_REQUIRE(x != NULL);
    for (int k = 0; k < 3; k++) {
        fl_run_config c;
        fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
        c.train.micro_batch_size = 1, c.train.global_batch_size = 2;
        c.optimizer.lr = 0.002f;
        c.threads = 1;
        snprintf(c.strategy, sizeof c.strategy, "%s", st[k]);
        x[k].c = &c, x[k].bc = &bc;
        FL_CHECKF(fl_comm_threads_run(2, rank_fn, &x[k]) == FL_OK, "%s: %s", st[k], fl_error_message());
    }
    for (int k = 1; k < 3; k++) {
        FL_CHECKF(!memcmp(x[k].loss, x[0].loss, sizeof x[0].loss), "%s: losses %.9g %.9g %.9g, DDP's %.9g %.9g %.9g",
                  st[k], x[k].loss[0][0], x[k].loss[0][1], x[k].loss[0][2], x[0].loss[0][0], x[0].loss[0][1],
                  x[0].loss[0][2]);
        const size_t z = x[k].res[0].part_optim[FL_BLIP2_TEXT], d = x[0].res[0].part_optim[FL_BLIP2_TEXT];
        FL_CHECKF(z > 0 && z <= d / 2 + 8, "%s: rank 0's lm OPTIM %zu bytes, DDP's %zu", st[k], z, d);
    }
    FL_CHECK(x[0].loss[0][2] < x[0].loss[0][0] && !x[0].res[0].offload && !x[1].res[1].offload);
    FL_CHECK(x[2].res[0].offload && x[2].res[0].peak[FL_TAG_OPTIM] == 0 && x[2].res[0].host_peak[FL_TAG_OPTIM] > 0);
    free(x);
}

/* Activation checkpointing on the three stacks through the entry: the same losses bit for bit as without it, every
 * part trained, and a smaller ACTS peak (each stack keeps its blocks' inputs and one block's slots per block graph). */
FL_TEST(blip2_train_entry_act_ckpt) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    double loss[2][3];
    fl_blip2_train_result r[2];
    for (int k = 0; k < 2; k++) {
        fl_run_config c;
        fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
        c.train.micro_batch_size = c.train.global_batch_size = 2;
        c.optimizer.lr = 0.002f;
        c.threads = 2;
        c.train.activation_checkpointing = k;
        snprintf(c.blip2_train, sizeof c.blip2_train, "vision,qformer,lm");
        const fl_blip2_train_opts o = {.shape = &bc, .synth_len = 6, .rehearse_steps = 3, .step_loss = loss[k],
                                       .n_step_out = 3};
        FL_REQUIRE_OK(fl_blip2_train(&c, &o, &r[k]));
    }
    FL_CHECKF(!memcmp(loss[0], loss[1], sizeof loss[0]), "losses %.9g %.9g %.9g, with checkpointing %.9g %.9g %.9g",
              loss[0][0], loss[0][1], loss[0][2], loss[1][0], loss[1][1], loss[1][2]);
    FL_CHECKF(r[1].peak[FL_TAG_ACTS] < r[0].peak[FL_TAG_ACTS] * 3 / 4, "ACTS %zu -> %zu", r[0].peak[FL_TAG_ACTS],
              r[1].peak[FL_TAG_ACTS]);
    /* blip2-micro's Q-Former has one block of each graph (cross-attention in block 0 of 2): nothing to share there */
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        FL_CHECKF(k == FL_BLIP2_QFORMER ? r[1].part_acts[k] == r[0].part_acts[k] : r[1].part_acts[k] < r[0].part_acts[k],
                  "part %d ACTS %zu -> %zu", k, r[0].part_acts[k], r[1].part_acts[k]);
}
