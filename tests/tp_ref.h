/* Tensor-parallel scenarios shared by tests/test_tp.c (ranks as threads) and tests/mpi/tp_mpi_test.c (ranks as
 * MPI processes). A scenario is a golden fixture of tests/ref/make_golden.py (a random LLaMA with GQA, GPT-2 or
 * OPT, one batch, PyTorch's fp32 gradients and 5 AdamW steps in fp32 and in float64). Each rank of a group of N
 * loads the whole model, keeps its slice (fl_tp_scatter), and runs the fixture's steps; rank 0 re-assembles the
 * step-1 gradient and the final parameters (fl_tp_gather). tp_check then holds them to:
 *   - the loss at every step: within 4x the distance between two fp32 implementations of the same math (ours
 *     and PyTorch's, the fixture's losses5: what fp32 reduction order alone moves the loss by), at least 8 fp32
 *     roundings of the loss; every rank the same bits;
 *   - generation through the slices (prefill, and decode with the KV cache): the last row's logits within the
 *     golden test's 1e-5 of PyTorch's;
 *   - each re-assembled gradient tensor: within the golden test's bar to PyTorch's (1e-5 of the tensor's scale),
 *     as the single process is;
 *   - the parameters after the steps, against the float64 run (the anchor): each tensor's distance (scaled by
 *     its max) within 4x the farther of the two other fp32 runs of the same steps (PyTorch's and the single
 *     process's; the golden test holds the single process within 4x PyTorch's), with the golden test's rule for
 *     near-zero gradients (Adam moves them by +-lr on noise in any precision: Adam's bound only). Why not 4x
 *     PyTorch's alone: Adam divides each update by the gradient's own scale, so the worst element of a tensor
 *     moves by integer factors between equally good fp32 runs (test_model.c's golden test; measured here on
 *     GPT-2's c_attn.weight: PyTorch 1.0e-6, one process 2.7e-6, TP 2 4.4e-6 from float64).
 * Mutation: a group whose blocks do not sum (the slices' partial outputs taken as the whole) must land far
 * outside the loss bound (tp_mutant). */
#ifndef FL_TP_REF_H
#define FL_TP_REF_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/generate.h"
#include "fitllm/io.h"
#include "golden_ref.h"
#include "fitllm/tp.h"
#include "fitllm/train.h"

#define TP_STEPS 5
#define TP_MAX_RANKS 8

typedef struct {
    const char *dir;     /* golden fixture folder */
    const char *backend; /* backend name ("cpu", "opaque", ...) */
    int mutant;          /* 1: run the blocks without their sums, 2: the head without its (the check must fail) */
    float max_norm;      /* gradient clipping (0: none, the fixture's steps) */
    int fail_rank;       /* > 0: this rank fails after its first forward (a rank failure must end the group) */
    /* results */
    double loss[TP_MAX_RANKS][TP_STEPS];
    double loss1;         /* the first forward's loss (before any step) */
    double norm[TP_STEPS];  /* rank 0: the gradient norm of each step (clipping) */
    double gen_err[2];      /* rank 0: prefill of the first sequence (all but its last token) and the decode of the
                             * last one with the KV cache: the last row's logits against PyTorch's (scaled) */
    float *grad, *params; /* rank 0: the step-1 gradient and the final parameters, whole layout */
    size_t numel;
    fl_model_config cfg;  /* the whole model's */
    size_t peak[TP_MAX_RANKS];  /* each rank's pool peak (bytes) */
    /* each rank's slice, measured (its own pool's peaks) and sized from the slice's config */
    size_t params_bytes[TP_MAX_RANKS], grads_bytes[TP_MAX_RANKS], optim_bytes[TP_MAX_RANKS], acts_bytes[TP_MAX_RANKS];
    size_t sized_params[TP_MAX_RANKS], sized_optim[TP_MAX_RANKS], sized_acts[TP_MAX_RANKS];
    fl_status st[TP_MAX_RANKS];
    char msg[TP_MAX_RANKS][512];
} tp_job;

#define TP_TRY(x)                   \
    do {                            \
        if ((s = (x)) != FL_OK) goto out; \
    } while (0)

static fl_status tp_rank_run(fl_comm *c, int rank, void *ud) {
    tp_job *j = ud;
    const int N = fl_comm_size(c);
    fl_backend be;
    fl_mem_pool pool, host, ppool, phost; /* the whole model's (loading, re-assembly), the slice's */
    fl_model whole, part;
    fl_optimizer o;
    fl_st_file g;
    fl_comm *dev = NULL;
    fl_tp_dist td;
    int be_ok = 0, pools_ok = 0, ppools_ok = 0, whole_ok = 0, part_ok = 0, o_ok = 0, g_ok = 0;
    char path[600];
    fl_status s = FL_OK;
    TP_TRY(fl_backend_init_by_name(j->backend, &be, 1));
    be_ok = 1;
    TP_TRY(fl_backend_pools_init(&be, &pool, &host, j->backend, 0));
    pools_ok = 1;
    TP_TRY(fl_backend_pools_init(&be, &ppool, &phost, j->backend, 0));
    ppools_ok = 1;
    TP_TRY(fl_hf_load_model(&whole, j->dir, &be, &pool));
    whole_ok = 1;
    fl_model_config pc;
    TP_TRY(fl_tp_config(&whole.cfg, N, rank, &pc));
    TP_TRY(fl_model_init(&part, &pc, &be, &ppool));
    part_ok = 1;
    TP_TRY(fl_tp_scatter(&whole, &part));
    if (rank == 0) {
        j->cfg = whole.cfg;
        j->numel = whole.layout.numel;
        TP_TRY(fl_model_alloc_grads(&whole)); /* where the gradients are re-assembled */
    } else {
        fl_model_free(&whole);
        whole_ok = 0;
    }
    /* memory the host cannot read: the blocks' sums run on the backend's own communicator */
    if (N > 1 && !fl_backend_host_memory(&be) && be.comm_create) TP_TRY(be.comm_create(&be, c, &dev));
    TP_TRY(fl_model_set_tp(&part, j->mutant == 1 ? NULL : dev ? dev : c));
    TP_TRY(fl_model_set_tp_host(&part, j->mutant ? NULL : c)); /* mutant 2: the blocks' sums, not the head's */
    snprintf(path, sizeof path, "%s/golden.safetensors", j->dir);
    TP_TRY(fl_st_open(&g, path));
    g_ok = 1;
    const fl_st_tensor *ids = fl_st_find(&g, "input_ids"), *tg = fl_st_find(&g, "targets");
    if (!ids || !tg) {
        s = fl_errorf(FL_ERR_FORMAT, "%s: no input_ids / targets", path);
        goto out;
    }
    const int B = (int)ids->shape[0], T = (int)ids->shape[1];
    long nvalid = 0;
    for (int i = 0; i < B * T; i++) nvalid += ((const int32_t *)tg->data)[i] != FL_IGNORE_INDEX;
    { /* generation through the slices, before any step: the fixture's logits of sequence 0's last row */
        const fl_st_tensor *lg = fl_st_find(&g, "logits");
        const int V = pc.vocab_size;
        fl_kv_cache kv;
        float *out = malloc((size_t)V * sizeof(float));
        if (!lg || !out) {
            free(out);
            s = fl_errorf(FL_ERR_FORMAT, "%s: no logits", path);
            goto out;
        }
        const float *ref = (const float *)lg->data + (size_t)(T - 1) * V;
        s = fl_kv_cache_init(&kv, &part, T);
        const int kv_ok = s == FL_OK;
        for (int k = 0; s == FL_OK && k < 2; k++) {
            fl_kv_cache_reset(&kv);
            s = k == 0 ? fl_model_prefill(&part, &kv, ids->data, T, out)
                       : fl_model_prefill(&part, &kv, ids->data, T - 1, NULL);
            if (s == FL_OK && k == 1) s = fl_model_decode(&part, &kv, ((const int32_t *)ids->data)[T - 1], out);
            double d = 0, sc = 0;
            for (int v = 0; v < V; v++) d = fmax(d, fabs((double)out[v] - ref[v])), sc = fmax(sc, fabs(ref[v]));
            if (rank == 0) j->gen_err[k] = d / sc;
        }
        if (kv_ok) fl_kv_cache_free(&kv);
        free(out);
        if (s != FL_OK) goto out;
    }
    TP_TRY(fl_model_alloc_grads(&part));
    TP_TRY(fl_model_alloc_acts(&part, B, T));
    fl_model_zero_grads(&part);
    TP_TRY(fl_model_forward(&part, ids->data, tg->data, B, T, 1.0f / (float)nvalid, NULL));
    if (rank == 0) j->loss1 = part.loss_sum / (double)part.n_valid;
    if (j->mutant) goto out;
    if (j->fail_rank > 0 && j->fail_rank == rank) {
        s = fl_errorf(FL_ERR_IO, "rank %d fails on purpose", rank);
        goto out;
    }
    TP_TRY(fl_model_backward(&part));
    TP_TRY(fl_tp_gather(&part, c, rank == 0 ? &whole : NULL, 1));
    if (rank == 0) TP_TRY(be.to_host(&be, j->grad, fl_model_grads_f32(&whole), j->numel * sizeof(float)));
    fl_optim_config oc; /* the fixture's AdamW (tests/ref/make_golden.py) */
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.lr = 1e-3f, oc.beta1 = 0.9f, oc.beta2 = 0.95f, oc.eps = 1e-8f, oc.weight_decay = 0.1f;
    TP_TRY(fl_optim_init(&o, &part, &oc));
    o_ok = 1;
    TP_TRY(fl_tp_optim_attach(&o, c, &td)); /* clipping on the whole model's norm */
    for (int k = 0; k < TP_STEPS; k++) {
        fl_step_result r;
        TP_TRY(fl_train_step(&part, &o, ids->data, tg->data, 1, B, T, oc.lr, j->max_norm, &r));
        j->loss[rank][k] = r.loss;
        if (rank == 0) j->norm[k] = r.grad_norm;
    }
    TP_TRY(fl_tp_gather(&part, c, rank == 0 ? &whole : NULL, 0));
    if (rank == 0)
        for (int i = 0; i < whole.layout.n; i++) fl_model_read_param(&whole, i, j->params + whole.layout.params[i].offset);
    j->peak[rank] = ppool.peak_total;
    j->params_bytes[rank] = ppool.peak[FL_TAG_PARAMS];
    j->grads_bytes[rank] = ppool.peak[FL_TAG_GRADS];
    j->optim_bytes[rank] = ppool.peak[FL_TAG_OPTIM];
    j->acts_bytes[rank] = ppool.peak[FL_TAG_ACTS];
    j->sized_params[rank] = fl_sizing_param_count(&pc) * sizeof(float);
    j->sized_optim[rank] = fl_optim_state_bytes_layout(&oc, &part.layout);
    fl_act_sizes as;
    fl_sizing_acts(&pc, B, T, &as);
    j->sized_acts[rank] = as.acts_bytes;
out:
    if (s != FL_OK) snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fl_error_message());
    j->st[rank] = s;
    if (s != FL_OK) fl_comm_release_peers(c, fl_error_message());
    if (o_ok) fl_optim_free(&o);
    if (g_ok) fl_st_close(&g);
    if (part_ok) fl_model_free(&part);
    if (whole_ok) fl_model_free(&whole);
    if (dev) fl_comm_destroy(dev);
    if (ppools_ok) fl_backend_pools_free(&ppool, &phost);
    if (pools_ok) fl_backend_pools_free(&pool, &host);
    if (be_ok) fl_backend_free(&be);
    return s;
}
#undef TP_TRY

#define tp_find fl_golden_find

/* reference tensor k (fp32, or fp64 when f64) of entry p into our orientation, as doubles */
static void tp_ref_tensor(const fl_st_tensor *t, const fl_param_info *p, int f64, double *dst) {
    const char *src = t->data;
    const int64_t R = p->shape[0], Cc = p->ndim == 2 ? p->shape[1] : 1;
    for (int64_t i = 0; i < R; i++)
        for (int64_t k = 0; k < Cc; k++) {
            const size_t at = p->transposed_on_disk ? (size_t)(k * R + i) : (size_t)(i * Cc + k);
            if (f64) {
                memcpy(&dst[i * Cc + k], src + at * 8, 8);
            } else {
                float f;
                memcpy(&f, src + at * 4, 4);
                dst[i * Cc + k] = f;
            }
        }
}

/* The checks (tests/tp_ref.h's header); one = the single process's job, tp = the group's. check(cond, msg)
 * records a failure; returns the number of failures. */
typedef void (*tp_check_fn)(int ok, const char *msg);
static int tp_check(const tp_job *one, const tp_job *tp, int N, tp_check_fn check) {
    char msg[700], path[600];
    int fails = 0;
#define TPC(cond, ...) \
    do { snprintf(msg, sizeof msg, __VA_ARGS__); check(!!(cond), msg); fails += !(cond); } while (0)
    fl_st_file g;
    snprintf(path, sizeof path, "%s/golden.safetensors", tp->dir);
    if (fl_st_open(&g, path) != FL_OK) {
        TPC(0, "%s: %s", path, fl_error_message());
        return fails;
    }
    fl_param_layout lay;
    if (fl_layout_build(&lay, &tp->cfg) != FL_OK) {
        TPC(0, "layout: %s", fl_error_message());
        fl_st_close(&g);
        return fails;
    }
    /* 1. losses */
    const fl_st_tensor *l5 = fl_st_find(&g, "losses5");
    double noise = 0, worst = 0;
    for (int k = 0; k < TP_STEPS; k++) {
        const double lt = ((const float *)l5->data)[k], l1 = one->loss[0][k];
        noise = fmax(noise, fabs(l1 - lt));
        noise = fmax(noise, 8 * ldexp(fabs(l1), -24));
    }
    for (int k = 0; k < TP_STEPS; k++) {
        const double d = fabs(tp->loss[0][k] - one->loss[0][k]);
        worst = fmax(worst, d);
        TPC(d <= 4 * noise, "%s TP %d: step %d loss %.9f vs one process %.9f: %.3g over 4 x %.3g", tp->dir, N, k + 1,
            tp->loss[0][k], one->loss[0][k], d, noise);
        for (int r = 1; r < N; r++)
            TPC(memcmp(&tp->loss[r][k], &tp->loss[0][k], sizeof(double)) == 0, "%s TP %d: rank %d's step %d loss differs",
                tp->dir, N, r, k + 1);
    }
    for (int k = 0; k < 2; k++)
        TPC(tp->gen_err[k] <= 1e-5, "%s TP %d: %s's last logits %.3g of their scale from PyTorch's (bar 1e-5)", tp->dir, N,
            k ? "decode with the KV cache" : "prefill", tp->gen_err[k]);
    printf("      %s TP %d: prefill / decode logits %.3g / %.3g of scale from PyTorch's (bar 1e-5)\n", tp->dir, N,
           tp->gen_err[0], tp->gen_err[1]);
    printf("      %s TP %d: losses within %.3g of one process (bound 4 x %.3g: ours vs PyTorch fp32)\n", tp->dir, N, worst,
           noise);
    /* 2. gradients, tensor by tensor, and 3. the parameters after the steps against float64 */
    size_t mx = 0;
    for (int i = 0; i < lay.n; i++) mx = lay.params[i].numel > mx ? lay.params[i].numel : mx;
    double *ref = malloc(mx * sizeof(double)), *g1 = malloc(mx * sizeof(double)), *p32 = malloc(mx * sizeof(double));
    double worst_g = 0, worst_p = 0, e_torch = 0, e_one = 0;
    double *pe = calloc((size_t)lay.n, sizeof(double));
    for (int i = 0; ref && g1 && p32 && pe && i < lay.n; i++) {
        const fl_param_info *p = &lay.params[i];
        const fl_st_tensor *tg = tp_find(&g, "grad.", p->name), *t64 = tp_find(&g, "after5_f64.", p->name),
                           *t32 = tp_find(&g, "after5.", p->name);
        if (!tg || !t64 || !t32) {
            TPC(0, "%s: the fixture has no grad / after5 / after5_f64 of %s", tp->dir, p->name);
            continue;
        }
        tp_ref_tensor(tg, p, 0, g1);
        /* the scale of a gradient: the tensor's, or for a q|k|v bias part stored apart (OPT) the run's (the key
         * bias's exact gradient is 0: noise on the run's scale) */
        double gs = 0, dg = 0;
        int a = i, b = i;
        if (p->ndim == 1 && fl_tp_entry_split(&lay, i) == FL_TP_COLUMN) {
            while (a > 0 && lay.params[a].role == FL_ROLE_NONE && lay.params[a - 1].group == p->group) a--;
            while (b + 1 < lay.n && lay.params[b + 1].role == FL_ROLE_NONE && lay.params[b + 1].ndim == 1) b++;
        }
        for (int q = a; q <= b; q++) {
            const fl_st_tensor *tq = tp_find(&g, "grad.", lay.params[q].name);
            tp_ref_tensor(tq, &lay.params[q], 0, ref);
            for (size_t k = 0; k < lay.params[q].numel; k++) gs = fmax(gs, fabs(ref[k]));
        }
        for (size_t k = 0; k < p->numel; k++) dg = fmax(dg, fabs((double)tp->grad[p->offset + k] - g1[k]));
        const double ge = gs > 0 ? dg / gs : dg;
        worst_g = fmax(worst_g, ge);
        TPC(ge <= 1e-5, "%s TP %d: gradient of %s re-assembled: %.3g of its scale from PyTorch's", tp->dir, N, p->name, ge);
        /* parameters */
        tp_ref_tensor(t64, p, 1, ref);
        tp_ref_tensor(t32, p, 0, p32);
        double gmax = 0, pmax = 0, d_ours = 0, d_torch = 0, d_one = 0;
        for (size_t k = 0; k < p->numel; k++) gmax = fmax(gmax, fabs(g1[k])), pmax = fmax(pmax, fabs(ref[k]));
        for (size_t k = 0; k < p->numel; k++) {
            const double d = fabs((double)tp->params[p->offset + k] - ref[k]);
            const int near0 = g1[k] != 0 && fabs(g1[k]) < 1e-4 * gmax;
            /* the key bias: OPT's k_proj.bias (between q's and v's), GPT-2's middle third of c_attn.bias */
            const size_t QD = (size_t)tp->cfg.n_heads * tp->cfg.head_dim, KVD = (size_t)tp->cfg.n_kv_heads * tp->cfg.head_dim;
            const int kbias = (b > a && i > a && i < b) ||
                              (p->role == FL_ROLE_QKV_B && p->numel == QD + 2 * KVD && k >= QD && k < QD + KVD);
            if (near0 || kbias || (p->ndim == 1 && gs > 0 && fabs(g1[k]) < 1e-4 * gs)) {
                TPC(d <= TP_STEPS * 1e-3 * 1.01, "%s TP %d: %s[%zu] moved beyond Adam's bound", tp->dir, N, p->name, k);
                continue;
            }
            d_ours = fmax(d_ours, d);
            d_torch = fmax(d_torch, fabs(p32[k] - ref[k]));
            d_one = fmax(d_one, fabs((double)one->params[p->offset + k] - ref[k]));
        }
        const double sc = pmax > 0 ? pmax : 1;
        pe[i] = d_ours / sc;
        e_torch = fmax(e_torch, d_torch / sc);
        e_one = fmax(e_one, d_one / sc);
        worst_p = fmax(worst_p, pe[i]);
    }
    const double e32 = fmax(e_torch, e_one); /* the farther of the two fp32 runs we have */
    for (int i = 0; pe && i < lay.n; i++)
        TPC(pe[i] <= 4 * e32, "%s TP %d: %s after %d AdamW steps: %.3g from float64, over 4 x %.3g (PyTorch fp32 %.3g, "
            "one process %.3g)", tp->dir, N, lay.params[i].name, TP_STEPS, pe[i], e32, e_torch, e_one);
    printf("      %s TP %d: worst re-assembled gradient %.3g of scale (bar 1e-5); after %d steps %.3g from float64 "
           "(bar 4 x the farther fp32 run: PyTorch %.3g, one process %.3g)\n", tp->dir, N, worst_g, TP_STEPS, worst_p, e_torch, e_one);
    free(ref), free(g1), free(p32), free(pe);
    fl_layout_free(&lay);
    fl_st_close(&g);
    return fails;
#undef TPC
}

#endif
