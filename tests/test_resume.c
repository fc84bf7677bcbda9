/* Resuming a checkpoint with another run's settings (src/train/resume_check.c): another model of the same tensor
 * shapes is refused naming both (a copy of the same model elsewhere is resumed with a note), a setting the saved state
 * depends on (lora_alpha, use_rslora, data.seed) is refused naming the key, both values and the way on, one that only
 * changes the steps to come (lora_dropout, seed) is resumed with a note. And the running loss's window in the training
 * state (src/train/checkpoint.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fitllm/checkpoint.h"
#include "fitllm/config.h"
#include "fitllm/io.h"
#include "fitllm/trainer.h"
#include "test.h"
#include "train/shard_ckpt.h"

/* dst/name := src/name, with the text `from` replaced by `to` (NULL: a copy); 0 or -1 */
static int copy_file(const char *src, const char *dst, const char *name, const char *from, const char *to) {
    char p[1200];
    size_t n = 0;
    snprintf(p, sizeof p, "%s/%s", src, name);
    char *text = fl_test_slurp(p, &n);
    if (!text) return -1;
    char *at = from ? strstr(text, from) : NULL;
    if (from && !at) { free(text); return -1; }
    snprintf(p, sizeof p, "%s/%s", dst, name);
    FILE *f = fopen(p, "wb");
    int ok = f != NULL;
    if (ok && at) {
        ok = fwrite(text, 1, (size_t)(at - text), f) == (size_t)(at - text) && fputs(to, f) >= 0;
        size_t rest = n - (size_t)(at - text) - strlen(from);
        ok = ok && fwrite(at + strlen(from), 1, rest, f) == rest;
    } else if (ok) {
        ok = fwrite(text, 1, n, f) == n;
    }
    if (f && fclose(f) != 0) ok = 0;
    free(text);
    return ok ? 0 : -1;
}

/* The HF model folder src copied to dst (config.json's `from` replaced by `to` when given). */
static int copy_model(const char *src, const char *dst, const char *from, const char *to) {
    static const char *files[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json"};
    if (mkdir(dst, 0755) != 0 || copy_file(src, dst, "config.json", from, to) != 0) return -1;
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        if (copy_file(src, dst, files[i], NULL, NULL) != 0) return -1;
    return 0;
}

/* fl_trainer_run with its output into out (cut at n) and its error message into err. */
static fl_status run_said(const fl_run_config *c, char *out, size_t n, char *err, size_t en) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return FL_ERR_OOM;
    fl_status s = fl_trainer_run(c, f, 0, NULL, NULL, NULL);
    snprintf(err, en, "%s", s == FL_OK ? "" : fl_error_message());
    fclose(f);
    snprintf(out, n, "%s", text ? text : "");
    free(text);
    return s;
}

/* A run of `cmd` on model at out_dir/<out> (under this test's folder), 2 steps, a checkpoint at step 2. */
static void two_steps(fl_run_config *c, fl_cmd_kind cmd, const char *model, const char *out) {
    fl_test_tiny_run_config(c, cmd, model, out, 32);
    c->train.max_steps = 2;
    c->train.save_interval = 2;
}

/* The step-2 checkpoint of c's run resumed by a run of `model` into out_dir/<out>, 3 steps. */
static void resumed_by(fl_run_config *r, const fl_run_config *c, const char *model, const char *out) {
    *r = *c;
    snprintf(r->checkpoint_dir, sizeof r->checkpoint_dir, "%s", model);
    snprintf(r->out_dir, sizeof r->out_dir, "%s/%s", fl_test_tmpdir(), out);
    snprintf(r->resume, sizeof r->resume, "%.4000s/step-000002", c->out_dir);
    r->train.max_steps = 3;
}

FL_TEST(resume_refuses_another_model) {
    static char out[65536], err[8192];
    static fl_run_config c, r;
    char base[600], m1[600], m2[600], m3[600];
    const char *tmp = fl_test_tmpdir();
    fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_FULL, "micro", "base", 32);
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL)); /* base/final: micro as a Hugging Face folder */
    snprintf(base, sizeof base, "%s/base/final", tmp);
    snprintf(m1, sizeof m1, "%s/m1", tmp);
    snprintf(m2, sizeof m2, "%s/m2", tmp);
    snprintf(m3, sizeof m3, "%s/m3", tmp);
    FL_REQUIRE(copy_model(base, m1, NULL, NULL) == 0);
    /* another model of the same tensor shapes: its rotary base differs */
    FL_REQUIRE(copy_model(base, m2, "\"rope_theta\": 10000.0", "\"rope_theta\": 500000.0") == 0);
    FL_REQUIRE(copy_model(base, m3, NULL, NULL) == 0); /* the same model in another folder */
    for (int lora = 0; lora < 2; lora++) { /* a full checkpoint (config.json in it), a LoRA one (the base's) */
        two_steps(&c, lora ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL, m1, lora ? "lora" : "full");
        FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL));
        resumed_by(&r, &c, m2, lora ? "lora-m2" : "full-m2");
        fl_status s = run_said(&r, out, sizeof out, err, sizeof err);
        FL_CHECKF(s == FL_ERR_INVALID && strstr(err, m1) && strstr(err, m2) && strstr(err, "rope_theta"),
                  "%s: another model resumed (status %d): %s", lora ? "LoRA" : "full", (int)s, err);
        resumed_by(&r, &c, m3, lora ? "lora-m3" : "full-m3");
        s = run_said(&r, out, sizeof out, err, sizeof err);
        FL_CHECKF(s == FL_OK, "%s: a copy of the model refused: %s", lora ? "LoRA" : "full", err);
        const char *note = strstr(out, "note: --resume: the checkpoint was trained from");
        FL_CHECKF(note && strstr(note, m1) && strstr(note, m3) && strstr(note, "same architecture"),
                  "%s: a copy of the model resumed without a note:\n%s", lora ? "LoRA" : "full", out);
    }
}

FL_TEST(resume_refuses_changed_settings) {
    static const struct {
        const char *key, *value;
        int refused;
        const char *said; /* in the error (refused) or the output (a note) */
    } cases[] = {
        {"lora_alpha", "32", 1, "lora_alpha 16.0, this run gives 32.0"},
        {"use_rslora", "true", 1, "use_rslora false, this run gives true"},
        {"data.seed", "43", 1, "data.seed 42, this run gives 43"},
        {"lora_dropout", "0.2", 0, "note: --resume: the checkpoint's run had lora_dropout 0.05, this run gives 0.2"},
        {"seed", "8", 0, "note: --resume: the checkpoint's run had seed 7, this run gives 8"},
    };
    static char out[65536], err[8192];
    static fl_run_config c, r;
    two_steps(&c, FL_CMD_FINETUNE_LORA, "micro", "lora");
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL));
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dir[64];
        snprintf(dir, sizeof dir, "resumed-%zu", i);
        resumed_by(&r, &c, "micro", dir);
        FL_REQUIRE_OK(fl_cfg_set(&r, cases[i].key, cases[i].value));
        fl_status s = run_said(&r, out, sizeof out, err, sizeof err);
        if (cases[i].refused)
            FL_CHECKF(s == FL_ERR_INVALID && strstr(err, cases[i].said) && strstr(err, "--overwrite"),
                      "%s %s: status %d, error: %s", cases[i].key, cases[i].value, (int)s, err);
        else
            FL_CHECKF(s == FL_OK && strstr(out, cases[i].said), "%s %s: status %d (%s), output:\n%s", cases[i].key,
                      cases[i].value, (int)s, err, out);
    }
    /* the same settings but a longer run: one note, the schedule's */
    resumed_by(&r, &c, "micro", "same");
    fl_status s = run_said(&r, out, sizeof out, err, sizeof err);
    const char *note = strstr(out, "note: --resume");
    FL_CHECKF(s == FL_OK && note && !strstr(note + 1, "note: --resume") &&
              strstr(note, "train.max_steps 2, this run gives 3: the resumed steps' learning-rate schedule"),
              "status %d (%s), output:\n%s", (int)s, err, out);
}

/* The running loss's window through the training state's metadata: the same ring back into a window of its size, the
 * last losses that fit into a smaller one, those saved pushed anew into a larger one; a state without it (an older
 * checkpoint) loads with an empty window. */
FL_TEST(resume_loss_window_in_training_state) {
    char p[600], q[600];
    snprintf(p, sizeof p, "%s/state.safetensors", fl_test_tmpdir());
    snprintf(q, sizeof q, "%s/old.safetensors", fl_test_tmpdir());
    double ring[4] = {0.25, 1.0 / 3, 2.5, 3.75}; /* pushes 0 .. 5: 0.25 at 0 and 4, 1/3 at 1 and 5 */
    fl_train_state st = {.step = 3, .iter = 6, .loss_window = ring, .loss_window_size = 4, .loss_window_n = 6};
    FL_REQUIRE_OK(fl_ckpt_write_state_meta(p, "fitllm-training-state", NULL, &st, NULL, 0, NULL, NULL, 0));
    fl_train_state none = {.step = 3, .iter = 6};
    FL_REQUIRE_OK(fl_ckpt_write_state_meta(q, "fitllm-training-state", NULL, &none, NULL, 0, NULL, NULL, 0));
    static const struct {
        int size;
        long n;
        double want[8];
    } cases[] = {
        {4, 6, {0.25, 1.0 / 3, 2.5, 3.75}}, /* the same ring, bit for bit */
        {2, 6, {0.25, 1.0 / 3}},            /* the last two (pushes 4 and 5) where a ring of 2 holds them */
        {3, 6, {3.75, 0.25, 1.0 / 3}},      /* pushes 3, 4, 5 (3.75, 0.25, 1/3) at 3 % 3 = 0, 1, 2 */
        {8, 4, {2.5, 3.75, 0.25, 1.0 / 3}}, /* only 4 of the 6 were kept: pushed anew, oldest first */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double w[8];
        for (int j = 0; j < 8; j++) w[j] = -1;
        fl_train_state got = {.loss_window = w, .loss_window_size = cases[i].size};
        fl_st_file f;
        FL_REQUIRE_OK(fl_st_open(&f, p));
        fl_status s = fl_ckpt_read_state_meta(&f, p, NULL, &got);
        fl_st_close(&f);
        FL_REQUIRE_OK(s);
        FL_CHECKF(got.step == 3 && got.iter == 6 && got.loss_window == w && got.loss_window_size == cases[i].size,
                  "size %d: the state or the caller's window lost", cases[i].size);
        FL_CHECKF(got.loss_window_n == cases[i].n, "size %d: n %ld, want %ld", cases[i].size, got.loss_window_n,
                  cases[i].n);
        for (int j = 0; j < cases[i].size; j++)
            FL_CHECKF(w[j] == (j < 4 || cases[i].size < 8 ? cases[i].want[j] : 0), "size %d: [%d] = %.17g",
                      cases[i].size, j, w[j]);
    }
    double w[4] = {9, 9, 9, 9};
    fl_train_state got = {.loss_window = w, .loss_window_size = 4, .loss_window_n = 7};
    fl_st_file f;
    FL_REQUIRE_OK(fl_st_open(&f, q));
    fl_status s = fl_ckpt_read_state_meta(&f, q, NULL, &got);
    fl_st_close(&f);
    FL_REQUIRE_OK(s);
    FL_CHECK(got.loss_window_n == 0 && w[0] == 0 && w[3] == 0 && got.step == 3);
}

/* The architecture comparison against what config.json holds: every preset written as config.json and read back is
 * the same architecture (a copy of the model under another name: resumed with a note), and one field changed is another
 * (refused, naming it). */
FL_TEST(resume_architecture_round_trips_every_preset) {
    static fl_run_config c;
    static char notes[8192];
    char dir[600], p[700];
    snprintf(dir, sizeof dir, "%s/ck", fl_test_tmpdir());
    FL_REQUIRE(mkdir(dir, 0755) == 0);
    snprintf(p, sizeof p, "%s/hyperparameters.yaml", dir);
    FILE *f = fopen(p, "w");
    FL_REQUIRE(f != NULL);
    fputs("checkpoint_dir: saved-model\n", f);
    fclose(f);
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "this-model");
    snprintf(p, sizeof p, "%s/config.json", dir);
    int n = 0;
    for (const char *const *name = fl_preset_names(); *name; name++, n++) {
        fl_model_config mc, other;
        FL_REQUIRE_OK(fl_preset_find(*name, &mc));
        FL_REQUIRE_OK(fl_hf_save_config(p, &mc));
        fl_status s = fl_ckpt_check_resume(dir, &c, &mc, notes, sizeof notes);
        FL_CHECKF(s == FL_OK && strstr(notes, "'saved-model', this run names 'this-model': the same architecture"),
                  "%s: status %d (%s), notes: %s", *name, (int)s, s ? fl_error_message() : "", notes);
        other = mc;
        other.norm_eps *= 2;
        s = fl_ckpt_check_resume(dir, &c, &other, notes, sizeof notes);
        FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "another architecture (its config.json: the norm's eps"),
                  "%s: another eps: status %d (%s)", *name, (int)s, s ? fl_error_message() : "");
    }
    FL_CHECK(n > 20);
}

/* The LoRA targets compared as the module sets they make: LitGPT's switches lora_query / lora_value and the PEFT list
 * v_proj,q_proj are one set on LLaMA (resumed; it was refused as lora_query true -> false), another set is refused
 * naming both sets and the checkpoint's as the way on. */
FL_TEST(resume_compares_lora_target_sets) {
    static char out[65536], err[8192];
    static fl_run_config c, r;
    two_steps(&c, FL_CMD_FINETUNE_LORA, "micro", "lora-sets");
    c.lora.query = c.lora.value = 1, c.lora.key = c.lora.projection = c.lora.mlp = c.lora.head = 0;
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL));
    resumed_by(&r, &c, "micro", "lora-sets-same");
    r.lora.query = r.lora.value = 0;
    snprintf(r.lora.target_modules, sizeof r.lora.target_modules, "v_proj,q_proj");
    fl_status s = run_said(&r, out, sizeof out, err, sizeof err);
    FL_CHECKF(s == FL_OK && !strstr(out, "note: --resume: the checkpoint's run had lora_"), "status %d (%s):\n%s",
              (int)s, err, out);
    resumed_by(&r, &c, "micro", "lora-sets-other");
    snprintf(r.lora.target_modules, sizeof r.lora.target_modules, "q_proj,k_proj");
    s = run_said(&r, out, sizeof out, err, sizeof err);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(err, "the checkpoint's adapters are on the modules q_proj,v_proj, this run's "
                                                 "LoRA targets are k_proj,q_proj") &&
              strstr(err, "--lora_target_modules q_proj,v_proj"), "status %d: %s", (int)s, err);
}

/* a step hook: stop after step 2, its checkpoint committed (as a signal under train.save_on_signal) */
static int stop_after_2(void *ud, long step, double loss, const void *params, size_t bytes) {
    (void)ud, (void)loss, (void)params, (void)bytes;
    return step == 2 ? 2 : 0;
}

/* A LoRA run on random base weights (the micro preset) resumed with another seed: the base is read back from
 * out_dir/base (said), so that the resumed run ends on the uninterrupted run's final/ byte for byte (lora_dropout 0:
 * the seed changes nothing else); it made seed 8's base and trained the saved adapters on it. */
FL_TEST(resume_random_base_read_back) {
    static char out[65536], err[8192];
    static fl_run_config c, r;
    char a[4200], b[4200];
    two_steps(&c, FL_CMD_FINETUNE_LORA, "micro", "rb-whole");
    c.lora.dropout = 0;
    c.train.max_steps = 3;
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL));
    snprintf(a, sizeof a, "%.4000s/final/model.safetensors", c.out_dir);
    two_steps(&c, FL_CMD_FINETUNE_LORA, "micro", "rb-first");
    c.lora.dropout = 0;
    c.train.max_steps = 3; /* the same schedule, stopped after step 2's checkpoint */
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, stop_after_2, NULL, NULL));
    r = c; /* the same out_dir, --resume auto, seed 8 */
    r.seed = 8;
    snprintf(r.resume, sizeof r.resume, "auto");
    fl_status s = run_said(&r, out, sizeof out, err, sizeof err);
    FL_REQUIRE(s == FL_OK);
    FL_CHECKF(strstr(out, "note: --resume: the base model's weights are random ('micro'): they are read from '") &&
              strstr(out, "rb-first/base', the base the checkpoint's adapters were trained on, not made anew from seed 8"),
              "output:\n%s", out);
    snprintf(b, sizeof b, "%.4000s/final/model.safetensors", c.out_dir);
    size_t na = 0, nb = 0;
    char *x = fl_test_slurp(a, &na), *y = fl_test_slurp(b, &nb);
    FL_CHECKF(x && y && na == nb && !memcmp(x, y, na), "the resumed run's final/ is not the uninterrupted run's (%zu, "
              "%zu bytes)", na, nb);
    free(x);
    free(y);
}

/* The divergence detector's window in the training state: written when the trainer set it, read back exactly (the
 * EMA's bits, NaN before a loss), absent in an older state (dv_set 0). */
FL_TEST(resume_divergence_window_in_training_state) {
    char p[600];
    snprintf(p, sizeof p, "%s/dv.safetensors", fl_test_tmpdir());
    const double emas[2] = {1.0 / 3 + 8, NAN};
    for (int i = 0; i < 3; i++) {
        fl_train_state st = {.step = 30, .iter = 60, .dv_set = i < 2, .dv_ema = i < 2 ? emas[i] : 0, .dv_above = 7,
                             .dv_since = 24, .dv_last_good = 22};
        FL_REQUIRE_OK(fl_ckpt_write_state_meta(p, "fitllm-training-state", NULL, &st, NULL, 0, NULL, NULL, 0));
        fl_train_state got = {.dv_set = 1, .dv_above = -1};
        fl_st_file f;
        FL_REQUIRE_OK(fl_st_open(&f, p));
        fl_status s = fl_ckpt_read_state_meta(&f, p, NULL, &got);
        fl_st_close(&f);
        FL_REQUIRE_OK(s);
        if (i == 2) {
            FL_CHECK(!got.dv_set && got.step == 30);
            continue;
        }
        FL_CHECKF(got.dv_set && (i ? isnan(got.dv_ema) : got.dv_ema == emas[0]) && got.dv_above == 7 &&
                  got.dv_since == 24 && got.dv_last_good == 22, "case %d: ema %.17g above %d since %ld good %ld", i,
                  got.dv_ema, got.dv_above, got.dv_since, got.dv_last_good);
    }
}
