/* Tensor parallelism (src/model/tp.c, graph_tp.c) with the ranks as threads: tests/tp_ref.h's scenarios on the
 * golden fixtures (LLaMA with GQA at 2 ranks, GPT-2 and OPT at 2 and 4; their 257 tokens split into uneven
 * vocabulary slices: 128 / 129 rows, 64 x 3 / 65) against one process, PyTorch and the float64 run; the slices'
 * memory; the refusals. The same scenarios run under mpirun in tests/mpi/tp_mpi_test.c. */
#include "fitllm/backend.h"
#include "test.h"
#include "tp_ref.h"

static void tp_check_cb(int ok, const char *msg) {
    if (!ok) fl_test_fail(__FILE__, __LINE__, "%s", msg);
}

static void run_job(tp_job *j, int N) {
    fl_status s = fl_comm_threads_run(N, tp_rank_run, j);
    for (int r = 0; r < N; r++) FL_CHECKF(j->st[r] == FL_OK, "%s TP %d rank %d: %s", j->dir, N, r, j->msg[r]);
    (void)s;
}

static void tp_case(const char *dir, int N) {
    const char *bn = fl_test_backend_name();
    tp_job *one = calloc(1, sizeof *one), *tp = calloc(1, sizeof *tp), *mut = calloc(1, sizeof *mut);
    FL_REQUIRE(one && tp && mut);
    one->dir = tp->dir = mut->dir = dir;
    one->backend = tp->backend = mut->backend = bn;
    mut->mutant = 1;
    /* the whole layout's size, for the re-assembled buffers */
    fl_model_config c;
    char cfgp[512];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
    FL_REQUIRE_OK(fl_hf_load_config(cfgp, &c));
    FL_REQUIRE_OK(fl_config_validate(&c));
    const size_t n = fl_sizing_param_count(&c);
    one->grad = malloc(n * sizeof(float)), one->params = malloc(n * sizeof(float));
    tp->grad = malloc(n * sizeof(float)), tp->params = malloc(n * sizeof(float));
    FL_REQUIRE(one->grad && one->params && tp->grad && tp->params);
    run_job(one, 1);
    run_job(tp, N);
    if (!fl_test_failed()) {
        tp_check(one, tp, N, tp_check_cb);
        /* each rank holds its slice (the split entries' share, the replicated ones whole): measured = sized from
         * the slice's config, for parameters, gradients, AdamW's state and the activation arena */
        for (int r = 0; r < N; r++) {
            FL_CHECKF(tp->params_bytes[r] == tp->sized_params[r] && tp->grads_bytes[r] == tp->sized_params[r] &&
                          tp->optim_bytes[r] == tp->sized_optim[r] && tp->acts_bytes[r] == tp->sized_acts[r] &&
                          tp->params_bytes[r] < one->params_bytes[0] && tp->acts_bytes[r] < one->acts_bytes[0],
                      "TP %d rank %d: params %zu (sized %zu, one process %zu), grads %zu, optim %zu (%zu), acts %zu (%zu, "
                      "one process %zu)", N, r, tp->params_bytes[r], tp->sized_params[r], one->params_bytes[0],
                      tp->grads_bytes[r], tp->optim_bytes[r], tp->sized_optim[r], tp->acts_bytes[r], tp->sized_acts[r],
                      one->acts_bytes[0]);
        }
        printf("      %s TP %d: rank 0 holds params %zu, optim %zu, acts %zu bytes (one process %zu, %zu, %zu)\n", dir, N,
               tp->params_bytes[0], tp->optim_bytes[0], tp->acts_bytes[0], one->params_bytes[0], one->optim_bytes[0],
               one->acts_bytes[0]);
        /* the check can fail: without the blocks' sums the first loss is far outside the bound */
        run_job(mut, N);
        const double d = fabs(mut->loss1 - one->loss1), bound = 4 * fmax(fabs(one->loss[0][0] - one->loss1), 1e-6);
        FL_CHECKF(d > 100 * 8 * ldexp(fabs(one->loss1), -24), "%s TP %d without the sums: loss %.7f, one process %.7f",
                  dir, N, mut->loss1, one->loss1);
        printf("      %s TP %d without the blocks' sums: first loss off by %.3g (%.3g)\n", dir, N, d, bound);
        /* the vocabulary slices cover the vocabulary; without the cross-entropy's combined row statistics (the
         * blocks summed) the loss is off */
        fl_model_config sl;
        int rows = 0, lo, at = 0;
        for (int r = 0; r < N; r++) {
            FL_REQUIRE_OK(fl_tp_config(&c, N, r, &sl));
            rows = fl_config_vocab_rows(&sl, &lo);
            FL_CHECKF(lo == at && rows >= c.vocab_size / N && rows <= c.vocab_size / N + 1, "%s TP %d rank %d: "
                      "vocabulary rows [%d, %d)", dir, N, r, lo, lo + rows);
            at = lo + rows;
        }
        FL_CHECKF(at == c.vocab_size, "%s TP %d: the slices end at row %d of %d", dir, N, at, c.vocab_size);
        {
            memset(mut, 0, sizeof *mut);
            mut->dir = dir, mut->backend = bn, mut->mutant = 2;
            run_job(mut, N);
            const double dv = fabs(mut->loss1 - one->loss1);
            FL_CHECKF(dv > 100 * 8 * ldexp(fabs(one->loss1), -24), "%s TP %d without the head's statistics: loss "
                      "%.7f, one process %.7f", dir, N, mut->loss1, one->loss1);
            printf("      %s TP %d: vocabulary slices of %d .. %d rows; without their combined statistics the first "
                   "loss is off by %.3g\n", dir, N, c.vocab_size / N, rows, dv);
        }
    }
    free(one->grad), free(one->params), free(tp->grad), free(tp->params);
    free(one), free(tp), free(mut);
}

FL_TEST(tp_llama_gqa_2_ranks) { tp_case("tests/fixtures/golden-llama", 2); }
FL_TEST(tp_gpt2_2_and_4_ranks) {
    tp_case("tests/fixtures/golden-gpt2", 2);
    tp_case("tests/fixtures/golden-gpt2", 4);
}
FL_TEST(tp_opt_2_and_4_ranks) {
    tp_case("tests/fixtures/golden-opt", 2);
    tp_case("tests/fixtures/golden-opt", 4);
}
/* Clipping decides on the whole model's gradient norm (fl_tp_optim_attach): at every step the group's norm is
 * the single process's within the norm of the difference of the two re-assembled step-1 gradients (|‖a‖ - ‖b‖|
 * <= ‖a - b‖; later steps: 4x that), and with the norm at half the first step's every step clips; the losses
 * stay within tp_ref.h's bound. A rank that fails ends every rank of the group (no hang). */
FL_TEST(tp_clipping_and_a_failing_rank) {
    const char *dir = "tests/fixtures/golden-gpt2";
    const int N = 2;
    tp_job *one = calloc(1, sizeof *one), *tp = calloc(1, sizeof *tp), *bad = calloc(1, sizeof *bad);
    FL_REQUIRE(one && tp && bad);
    fl_model_config c;
    FL_REQUIRE_OK(fl_hf_load_config("tests/fixtures/golden-gpt2/config.json", &c));
    FL_REQUIRE_OK(fl_config_validate(&c));
    const size_t n = fl_sizing_param_count(&c);
    tp_job *js[2] = {one, tp};
    for (int k = 0; k < 2; k++) {
        js[k]->dir = dir, js[k]->backend = fl_test_backend_name();
        js[k]->grad = malloc(n * sizeof(float)), js[k]->params = malloc(n * sizeof(float));
        FL_REQUIRE(js[k]->grad && js[k]->params);
    }
    run_job(one, 1); /* the first norm, unclipped */
    one->max_norm = tp->max_norm = (float)(0.5 * one->norm[0]);
    run_job(one, 1);
    run_job(tp, N);
    double dg = 0;
    for (size_t i = 0; i < n; i++) dg += ((double)tp->grad[i] - one->grad[i]) * ((double)tp->grad[i] - one->grad[i]);
    dg = sqrt(dg);
    for (int k = 0; k < TP_STEPS; k++) {
        const double d = fabs(tp->norm[k] - one->norm[k]), b = (k ? 4 : 1) * dg + 1e-12 * one->norm[k];
        FL_CHECKF(d <= b && one->norm[k] > one->max_norm, "step %d: norm %.9g vs one process %.9g: %.3g over %.3g (max %.4g)",
                  k + 1, tp->norm[k], one->norm[k], d, b, one->max_norm);
        FL_CHECKF(fabs(tp->loss[0][k] - one->loss[0][k]) <= 4 * 2.65e-6, "step %d: loss %.9f vs %.9f", k + 1,
                  tp->loss[0][k], one->loss[0][k]);
    }
    printf("      clipped at %.4g: norms within %.3g of one process (step 1 bound %.3g)\n", one->max_norm,
           fabs(tp->norm[0] - one->norm[0]), dg);
    /* rank 1 fails after its first forward: rank 0 must not wait for it */
    bad->dir = dir, bad->backend = fl_test_backend_name(), bad->fail_rank = 1;
    bad->grad = malloc(n * sizeof(float)), bad->params = malloc(n * sizeof(float));
    fl_status s = fl_comm_threads_run(N, tp_rank_run, bad);
    FL_CHECKF(s != FL_OK && bad->st[0] != FL_OK && bad->st[1] == FL_ERR_IO && strstr(bad->msg[1], "on purpose") &&
                  strstr(bad->msg[0], "aborted"),
              "a failing rank: rank 0 %d '%s', rank 1 %d '%s'", bad->st[0], bad->msg[0], bad->st[1], bad->msg[1]);
    for (int k = 0; k < 2; k++) free(js[k]->grad), free(js[k]->params), free(js[k]);
    free(bad->grad), free(bad->params), free(bad);
}

/* What does not split is refused naming --tensor_parallel and the dimension. */
FL_TEST(tp_config_refusals) {
    fl_model_config c, p;
    FL_REQUIRE_OK(fl_hf_load_config("tests/fixtures/golden-llama/config.json", &c));
    FL_REQUIRE_OK(fl_config_validate(&c));
    fl_status s = fl_tp_config(&c, 4, 0, &p); /* 6 heads */
    FL_CHECK(s == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "--tensor_parallel 4") &&
             strstr(fl_error_message(), "6 attention heads"));
    s = fl_tp_config(&c, 3, 0, &p); /* 6 heads, but 2 key/value heads */
    FL_CHECK(s == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "2 key/value heads"));
    FL_REQUIRE_OK(fl_tp_config(&c, 2, 1, &p));
    FL_CHECK(p.n_heads == 3 && p.n_kv_heads == 1 && p.ffn_dim == 80 && p.head_dim == 16 && p.dim == 96 && p.tp_rank == 1);
    s = fl_tp_config(&p, 2, 0, &c);
    FL_CHECK(s == FL_ERR_INVALID && strstr(fl_error_message(), "slice already"));
    FL_CHECK(fl_tp_config(&c, 2, 2, &p) == FL_ERR_INVALID);
    fl_model_config bert = {.arch = FL_ARCH_BERT, .vocab_size = 99, .dim = 32, .n_layers = 1, .n_heads = 4,
                            .ffn_dim = 37, .max_seq = 16};
    FL_REQUIRE_OK(fl_config_validate(&bert));
    s = fl_tp_config(&bert, 2, 0, &p);
    FL_CHECK(s == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "BERT"));
}
