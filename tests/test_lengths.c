/* The length sampler (fitllm/lengths.h) against the measured table recipes/data/alpaca-lengths.tsv: the
 * draws' quantiles match the table within the Dvoretzky-Kiefer-Wolfowitz bound, draws are deterministic,
 * bad tables are refused naming the file and line, and `fitllm plan` predicts the peak a run with the
 * drawn lengths measures (the planner is exact by rehearsal: equality per tag). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/lengths.h"
#include "fitllm/plan.h"
#include "fitllm/trainer.h"
#include "test.h"

#define TABLE "recipes/data/alpaca-lengths.tsv"

FL_TEST(lengths_quantiles_match_table_dkw) {
    fl_lengths t;
    FL_REQUIRE_OK(fl_lengths_load(TABLE, &t));
    FL_CHECK(t.n == 10 && t.len[0] == 50 && t.len[4] == 118 && t.len[7] == 320 && t.len[9] == 406);
    /* DKW: P(sup |F_n - F| > eps) <= 2 exp(-2 n eps^2); alpha = 1e-6 gives eps = 0.0085 at n = 200000. The
     * sampler's F is the table's: F(L_i - 1) <= q_i <= F(L_i) at every row (rounding to whole tokens). */
    const int n = 200000;
    const double alpha = 1e-6, eps = sqrt(log(2 / alpha) / (2.0 * n));
    int *cnt = calloc((size_t)t.len[t.n - 1] + 2, sizeof *cnt);
    FL_REQUIRE(cnt != NULL);
    for (int i = 0; i < n; i++) {
        int l = fl_lengths_draw(&t, 1337, 0, (uint64_t)i);
        FL_REQUIRE(l >= t.len[0] && l <= t.len[t.n - 1]);
        cnt[l]++;
    }
    for (int r = 0; r < t.n; r++) {
        double below = 0, upto = 0; /* F_n(L - 1), F_n(L) */
        for (int l = 0; l <= t.len[r]; l++) {
            if (l < t.len[r]) below += cnt[l];
            upto += cnt[l];
        }
        below /= n, upto /= n;
        FL_CHECKF(below <= t.q[r] + eps && upto >= t.q[r] - eps,
                  "quantile %.2f (length %d): F_n(%d) = %.4f, F_n(%d) = %.4f, DKW eps %.4f", t.q[r], t.len[r],
                  t.len[r] - 1, below, t.len[r], upto, eps);
    }
    free(cnt);
    /* the inverse CDF itself: exact at the points, linear between them */
    FL_CHECK(fl_lengths_at(&t, 0) == 50 && fl_lengths_at(&t, 0.5) == 118 && fl_lengths_at(&t, 1) == 406);
    FL_CHECK(fl_lengths_at(&t, 0.625) == 140); /* halfway from 118 (0.5) to 162 (0.75) */
}

FL_TEST(lengths_deterministic) {
    fl_lengths t;
    FL_REQUIRE_OK(fl_lengths_load(TABLE, &t));
    int diff_seed = 0, diff_split = 0;
    for (uint64_t i = 0; i < 64; i++) {
        FL_CHECK(fl_lengths_draw(&t, 7, 0, i) == fl_lengths_draw(&t, 7, 0, i));
        diff_seed += fl_lengths_draw(&t, 7, 0, i) != fl_lengths_draw(&t, 8, 0, i);
        diff_split += fl_lengths_draw(&t, 7, 0, i) != fl_lengths_draw(&t, 7, 1, i);
    }
    FL_CHECK(diff_seed > 32 && diff_split > 32);
    int l = fl_lengths_longest(&t, 42, 100, 5, 0), lc = fl_lengths_longest(&t, 42, 100, 5, 200);
    FL_CHECK(l > 320 && l <= 406 && lc == 200);
}

static void bad_table(const char *body, const char *want) {
    char path[600];
    snprintf(path, sizeof path, "%s/bad.tsv", fl_test_tmpdir());
    FILE *f = fopen(path, "w");
    FL_REQUIRE(f != NULL);
    fputs(body, f);
    fclose(f);
    fl_lengths t;
    fl_status s = fl_lengths_load(path, &t);
    FL_CHECKF(s == FL_ERR_FORMAT, "'%s': status %s", want, fl_status_name(s));
    char exp[700];
    snprintf(exp, sizeof exp, "%s%s", path, want);
    FL_CHECKF(strstr(fl_error_message(), exp) != NULL, "want '%s' in: %s", exp, fl_error_message());
}

FL_TEST(lengths_bad_tables) {
    bad_table("# q\tlen\n0\t10\n0.5\tabc\n1\t20\n", ":3: quantile 0.5 has no length");
    bad_table("0\t10\nhalf\t12\n1\t20\n", ":2: expected 'quantile<TAB>length'");
    bad_table("0\t10\n1.5\t20\n", ":2: quantile 1.5 is not in [0, 1]");
    bad_table("0\t10\n0.5\t12\n0.5\t14\n1\t20\n", ":3: quantile 0.5 does not increase");
    bad_table("0\t10\n0.5\t9\n1\t20\n", ":2: length 9 is less than the previous row's 10");
    bad_table("0\t10\n0.5\t12 tokens\n1\t20\n", ":2: unexpected text after the length");
    bad_table("0\t1\n1\t20\n", ":1: length 1 is not in [2, 16777216]");
    bad_table("0.1\t10\n1\t20\n", ": the first quantile is 0.1");
    bad_table("0\t10\n0.9\t20\n", ": the last quantile is 0.9");
    bad_table("# nothing\n\n0\t10\n", ": 1 rows");
    fl_lengths t;
    FL_CHECK(fl_lengths_load("/nonexistent/lengths.tsv", &t) == FL_ERR_NOT_FOUND);
    FL_CHECK(strstr(fl_error_message(), "/nonexistent/lengths.tsv: cannot open the length table") != NULL);
}

static int stop_now(void *ud, long step, double loss, const void *p, size_t n) {
    (void)ud; (void)step; (void)loss; (void)p; (void)n;
    return 1;
}

/* A small model trained on Synthetic data with Alpaca's drawn lengths: plan == measured per tag, with the
 * lengths uncapped (T from the longest draw) and cut by train.max_seq_length. */
FL_TEST(lengths_plan_equals_measured) {
    static const struct { const char *preset; int msl, B, ckpt; } k[] = {
        {"micro", 512, 2, 0}, {"gpt2-micro", 512, 1, 1}, {"micro", 129, 4, 0}};
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        fl_run_config c;
        fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
        snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", k[i].preset);
        snprintf(c.out_dir, sizeof c.out_dir, "%s/lp%zu", fl_test_tmpdir(), i);
        c.data.kind = FL_DATA_SYNTHETIC;
        snprintf(c.data.lengths, sizeof c.data.lengths, "%s", TABLE);
        c.data.synthetic_train = 12;
        c.data.synthetic_val = 2;
        c.train.global_batch_size = 4;
        c.train.micro_batch_size = k[i].B;
        c.train.max_steps = 1;
        c.train.max_seq_length = k[i].msl;
        c.train.lr_warmup_steps = 0;
        c.train.save_interval = 0;
        c.train.activation_checkpointing = k[i].ckpt;
        c.eval.interval = 1 << 30;
        c.eval.max_new_tokens = 0;
        c.eval.final_validation = 0;
        c.eval.initial_validation = 0;
        c.threads = 2;
        c.overwrite = 1;
        fl_lengths t;
        FL_REQUIRE_OK(fl_lengths_load(TABLE, &t));
        int longest = fl_lengths_longest(&t, c.data.seed, 12, 2, k[i].msl);
        fl_plan pl;
        fl_plan_opts o;
        fl_plan_opts_default(&o);
        o.generation = 0;
        FL_REQUIRE_OK(fl_plan_run(&c, &o, &pl));
        FL_CHECKF(pl.T == longest - 1, "%s: plan T %d, longest draw %d", k[i].preset, pl.T, longest);
        if (k[i].msl < 406) FL_CHECK(pl.T == k[i].msl - 1); /* 12 draws: some are longer than 129 */
        else FL_CHECK(pl.T < 405 && pl.T > 118);
        fl_trainer_result r;
        FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, stop_now, NULL, &r));
        for (int tg = 0; tg < FL_TAG_COUNT; tg++)
            FL_CHECKF(pl.peak[tg] == r.peak[tg], "%s msl %d B %d: %s planned %zu, measured %zu", k[i].preset, k[i].msl,
                      k[i].B, fl_mem_tag_name((fl_mem_tag)tg), pl.peak[tg], r.peak[tg]);
        FL_CHECKF(pl.peak_total == r.peak_total, "%s: peak planned %zu, measured %zu", k[i].preset, pl.peak_total,
                  r.peak_total);
    }
}
