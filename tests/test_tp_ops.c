/* Tensor parallelism's backend ops (issue 35; fitllm/backend.h), on every backend against float64 and the mask's
 * definition: vocab_stats / vocab_xent, the vocabulary-parallel cross-entropy's halves around the group's all-gather
 * (here the ranks' statistics are assembled on the host, as the all-gather would), and dropout_rows, the row-parallel
 * LoRA adapters' (and T5's tensor-parallel) dropout in one call, the bits of one dropout call per row. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/lora.h"
#include "test.h"

typedef struct {
    fl_backend *be;
    fl_mem_pool pool, hpool;
} ops_rig;

static void *dev_alloc(ops_rig *r, size_t bytes) {
    void *p = NULL;
    return fl_mem_alloc(&r->pool, FL_TAG_OTHER, bytes ? bytes : 1, &p) == FL_OK ? p : NULL;
}
static void *dev_copy(ops_rig *r, const void *h, size_t bytes) {
    void *p = dev_alloc(r, bytes);
    if (p && r->be->to_device(r->be, p, h, bytes) != FL_OK) return NULL;
    return p;
}

/* One shape: rows x V logits over P ranks' slices [k V / P, (k + 1) V / P); targets: ignored (-100) every 5th row,
 * else spread over the whole vocabulary (so most rows' targets lie outside a given slice). Each rank's statistics
 * against float64 (the max exactly, the sum within (n + 2) double roundings, the target's logit exactly or 0), then
 * every rank's loss (the same bits on every rank) and its slice's gradient against float64 (bounds: a float lse
 * within 2 roundings of its own size, the gradient's float product and subtraction). Rank 0's gradient overwrites
 * its logits (aliasing); a rank without dlogits gets the loss alone. */
static void vocab_case(ops_rig *r, int rows, int V, int P, float gs) {
    fl_backend *be = r->be;
    fl_test_rng rng = {1234u + (unsigned)V};
    float *x = fl_test_frand(&rng, (size_t)rows * V, -8.0f, 8.0f);
    int32_t *tg = malloc((size_t)rows * sizeof *tg);
    double *all = malloc((size_t)P * rows * 3 * sizeof *all), *lse64 = malloc((size_t)rows * sizeof *lse64);
    float *loss0 = malloc((size_t)rows * sizeof *loss0), *lk = malloc((size_t)rows * sizeof *lk);
    FL_REQUIRE(x && tg && all && lse64 && loss0 && lk);
    for (int i = 0; i < rows; i++) tg[i] = i % 5 == 2 ? -100 : (int)(fl_test_rng_u64(&rng) % (unsigned)V);
    tg[0] = V / P / 2; /* rank 0's slice, and the last row on the last rank's last column */
    tg[rows - 1] = V - 1;
    for (int i = 0; i < rows; i++) {
        double m = -INFINITY, s = 0;
        for (int v = 0; v < V; v++) m = fmax(m, x[(size_t)i * V + v]);
        for (int v = 0; v < V; v++) s += exp((double)x[(size_t)i * V + v] - m);
        lse64[i] = m + log(s);
    }
    int32_t *dt = dev_copy(r, tg, (size_t)rows * sizeof *tg);
    double *dst = dev_alloc(r, (size_t)rows * 3 * sizeof(double)), *dall = NULL;
    FL_REQUIRE(dt && dst);
    /* the statistics of each rank's slice */
    for (int k = 0; k < P; k++) {
        const int lo = (int)((long long)k * V / P), n = (int)((long long)(k + 1) * V / P) - lo;
        float *h = malloc((size_t)rows * n * sizeof *h);
        FL_REQUIRE(h);
        for (int i = 0; i < rows; i++) memcpy(h + (size_t)i * n, x + (size_t)i * V + lo, (size_t)n * sizeof *h);
        float *dl = dev_copy(r, h, (size_t)rows * n * sizeof *h);
        FL_REQUIRE(dl);
        FL_REQUIRE_OP(be, FL_RUN(be, vocab_stats, dst, dl, dt, rows, n, lo));
        double *st = all + (size_t)k * rows * 3;
        FL_REQUIRE_OK(be->to_host(be, st, dst, (size_t)rows * 3 * sizeof *st));
        int bad = 0;
        for (int i = 0; i < rows && bad < 3; i++) {
            double m = -INFINITY, s = 0;
            for (int v = 0; v < n; v++) m = fmax(m, h[(size_t)i * n + v]);
            for (int v = 0; v < n; v++) s += exp((double)h[(size_t)i * n + v] - m);
            const int t = tg[i] - lo;
            const double want_t = t >= 0 && t < n ? h[(size_t)i * n + t] : 0.0;
            const double tol = (n + 2) * ldexp(s, -52);
            if (st[3 * i] != m || fabs(st[3 * i + 1] - s) > tol || st[3 * i + 2] != want_t) {
                bad++;
                FL_CHECKF(0, "%s vocab_stats rows %d V %d rank %d of %d row %d: max %.9g (%.9g), sum %.17g (%.17g, tol "
                          "%.3g), target logit %.9g (%.9g)", be->name, rows, V, k, P, i, st[3 * i], m, st[3 * i + 1], s,
                          tol, st[3 * i + 2], want_t);
            }
        }
        fl_mem_free(&r->pool, dl);
        free(h);
    }
    dall = dev_copy(r, all, (size_t)P * rows * 3 * sizeof *all);
    FL_REQUIRE(dall);
    float *dloss = dev_alloc(r, (size_t)rows * sizeof(float));
    FL_REQUIRE(dloss);
    double worst_l = 0, worst_g = 0;
    for (int k = 0; k < P; k++) {
        const int lo = (int)((long long)k * V / P), n = (int)((long long)(k + 1) * V / P) - lo;
        float *h = malloc((size_t)rows * n * sizeof *h), *g = malloc((size_t)rows * n * sizeof *g);
        FL_REQUIRE(h && g);
        for (int i = 0; i < rows; i++) memcpy(h + (size_t)i * n, x + (size_t)i * V + lo, (size_t)n * sizeof *h);
        for (size_t j = 0; j < (size_t)rows * n; j++) g[j] = NAN; /* every element must be written */
        float *dl = dev_copy(r, h, (size_t)rows * n * sizeof *h), *dg = k == 0 ? dl : dev_copy(r, g, (size_t)rows * n * 4);
        FL_REQUIRE(dl && dg);
        const int with_grad = k != 1; /* rank 1: the loss alone (dlogits NULL) */
        FL_REQUIRE_OP(be, FL_RUN(be, vocab_xent, dloss, with_grad ? dg : NULL, dl, dall, dt, rows, n, lo, P, k, V, gs,
                                 -100));
        FL_REQUIRE_OK(be->to_host(be, lk, dloss, (size_t)rows * sizeof *lk));
        if (with_grad) FL_REQUIRE_OK(be->to_host(be, g, dg, (size_t)rows * n * sizeof *g));
        if (k == 0) memcpy(loss0, lk, (size_t)rows * sizeof *lk);
        FL_CHECKF(!memcmp(loss0, lk, (size_t)rows * sizeof *lk), "%s vocab_xent V %d: rank %d's losses differ from "
                  "rank 0's", be->name, V, k);
        int bad = 0;
        for (int i = 0; i < rows; i++) {
            if (tg[i] == -100) {
                FL_CHECKF(lk[i] == 0.0f, "%s vocab_xent: ignored row %d has loss %g", be->name, i, (double)lk[i]);
                for (int v = 0; with_grad && v < n; v++)
                    if (g[(size_t)i * n + v] != 0.0f && bad++ < 3)
                        FL_CHECKF(0, "%s vocab_xent: ignored row %d's gradient %g at %d", be->name, i,
                                  (double)g[(size_t)i * n + v], v);
                continue;
            }
            const double xt = x[(size_t)i * V + tg[i]], want = lse64[i] - xt;
            const double tl = 8 * ldexp(fabs(lse64[i]) + fabs(xt), -24), el = fabs(lk[i] - want);
            worst_l = fmax(worst_l, el / tl);
            if (el > tl && bad++ < 3)
                FL_CHECKF(0, "%s vocab_xent V %d rank %d row %d: loss %.9g, float64 %.9g (tol %.3g)", be->name, V, k, i,
                          (double)lk[i], want, tl);
            for (int v = 0; with_grad && v < n; v++) {
                const double p = exp((double)h[(size_t)i * n + v] - lse64[i]);
                const double ref = gs * (p - (lo + v == tg[i] ? 1.0 : 0.0));
                const double tg_ = fabs(gs) * (4 * ldexp(p * (fabs(lse64[i]) + 1), -24) + ldexp(1.0, -23));
                const double e = fabs(g[(size_t)i * n + v] - ref);
                worst_g = fmax(worst_g, e / tg_);
                if (!(e <= tg_) && bad++ < 3)
                    FL_CHECKF(0, "%s vocab_xent V %d rank %d row %d col %d: dlogits %.9g, float64 %.9g (tol %.3g)",
                              be->name, V, k, i, v, (double)g[(size_t)i * n + v], ref, tg_);
            }
        }
        if (dg != dl) fl_mem_free(&r->pool, dg);
        fl_mem_free(&r->pool, dl);
        free(h), free(g);
    }
    printf("      %s rows %d, V %d over %d slices: losses within %.2f of their bound, gradients %.2f\n", be->name, rows,
           V, P, worst_l, worst_g);
    /* bad arguments: a clear error, nothing written */
    FL_CHECK(FL_RUN(be, vocab_xent, dloss, NULL, (float *)dst, dall, dt, rows, 4, 0, P, P, V, gs, -100) != FL_OK);
    FL_CHECK(FL_RUN(be, vocab_stats, dst, (float *)dall, dt, rows, 0, 0) != FL_OK);
    fl_mem_free(&r->pool, dloss);
    fl_mem_free(&r->pool, dall);
    fl_mem_free(&r->pool, dst);
    fl_mem_free(&r->pool, dt);
    free(x), free(tg), free(all), free(lse64), free(loss0), free(lk);
}

FL_TEST(tp_ops_vocab_xent_vs_float64) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) {
        ops_rig r = {.be = &be};
        FL_REQUIRE_OK(fl_backend_pools_init(&be, &r.pool, &r.hpool, "tp-ops", 0));
        FL_CHECK(be.supports_op(&be, FL_OP_VOCAB_XENT, FL_F32, FL_F32, FL_F32));
        vocab_case(&r, 37, 301, 3, 0.125f);  /* 37 rows (not a warp's multiple), slices of 100 / 100 / 101 */
        vocab_case(&r, 5, 1543, 2, 1.0f);    /* slices of 771 / 772: several strides of a 256-thread block */
        fl_backend_pools_free(&r.pool, &r.hpool);
    }
}

/* dropout_rows against one dropout call per row at the row's shifted seed (keep(seed, i0 + j) = keep(seed + i0 K, j)):
 * the same bits, overwriting, in place and accumulating, p 0.3 and 0; and against the mask's definition */
static void rows_case(ops_rig *r, int rows, size_t w, size_t stride, float p) {
    fl_backend *be = r->be;
    const size_t n = (size_t)rows * w;
    const uint64_t seed = 0x5eedULL + (uint64_t)stride;
    fl_test_rng rng = {99u + (unsigned)w};
    float *x = fl_test_frand(&rng, n, -2.0f, 2.0f), *y0 = fl_test_frand(&rng, n, -1.0f, 1.0f);
    float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    FL_REQUIRE(x && y0 && a && b);
    float *dx = dev_copy(r, x, n * 4), *dy = dev_copy(r, y0, n * 4), *dz = dev_copy(r, y0, n * 4);
    FL_REQUIRE(dx && dy && dz);
    for (int acc = 0; acc < 2; acc++) {
        FL_REQUIRE_OK(be->to_device(be, dy, y0, n * 4));
        FL_REQUIRE_OK(be->to_device(be, dz, y0, n * 4));
        FL_REQUIRE_OP(be, FL_RUN(be, dropout_rows, dy, dx, rows, w, stride, p, seed, acc));
        for (int i = 0; i < rows; i++)
            FL_REQUIRE_OK(FL_RUN(be, dropout, dz + (size_t)i * w, dx + (size_t)i * w, w, p,
                                 seed + (uint64_t)((size_t)i * stride) * 0x9E3779B97F4A7C15ULL, acc));
        FL_REQUIRE_OK(be->to_host(be, a, dy, n * 4));
        FL_REQUIRE_OK(be->to_host(be, b, dz, n * 4));
        FL_CHECKF(!memcmp(a, b, n * 4), "%s dropout_rows (%d rows of %zu, stride %zu, p %g, accumulate %d): not the "
                  "bits of one dropout call per row", be->name, rows, w, stride, (double)p, acc);
        size_t off = 0, kept = 0;
        const float sc = fl_lora_dropout_scale(p);
        for (int i = 0; i < rows; i++)
            for (size_t j = 0; j < w; j++) {
                const size_t e = (size_t)i * w + j;
                const int keep = fl_lora_dropout_keep(seed, (size_t)i * stride + j, p);
                const double want = (acc ? (double)y0[e] : 0.0) + (keep ? (double)x[e] * sc : 0.0);
                kept += keep;
                off += fabs(a[e] - want) > ldexp(fabs(want) + fabs(x[e]) * sc, -23);
            }
        FL_CHECKF(off == 0, "%s dropout_rows (p %g, accumulate %d): %zu values off the mask's", be->name, (double)p, acc,
                  off);
        if (p == 0.0f) FL_CHECK(kept == n);
    }
    /* in place (y = x) */
    FL_REQUIRE_OK(be->to_device(be, dy, x, n * 4));
    FL_REQUIRE_OP(be, FL_RUN(be, dropout_rows, dy, dy, rows, w, stride, p, seed, 0));
    FL_REQUIRE_OK(FL_RUN(be, dropout_rows, dz, dx, rows, w, stride, p, seed, 0));
    FL_REQUIRE_OK(be->to_host(be, a, dy, n * 4));
    FL_REQUIRE_OK(be->to_host(be, b, dz, n * 4));
    FL_CHECKF(!memcmp(a, b, n * 4), "%s dropout_rows in place differs", be->name);
    /* refusals */
    FL_CHECK(FL_RUN(be, dropout_rows, dy, dx, rows, w, w - 1, p, seed, 0) == FL_ERR_INVALID); /* stride < width */
    FL_CHECK(FL_RUN(be, dropout_rows, dy, dx, rows, w, stride, 1.0f, seed, 0) == FL_ERR_INVALID);
    fl_mem_free(&r->pool, dz), fl_mem_free(&r->pool, dy), fl_mem_free(&r->pool, dx);
    free(x), free(y0), free(a), free(b);
}

FL_TEST(tp_ops_dropout_rows_same_bits) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) {
        ops_rig r = {.be = &be};
        FL_REQUIRE_OK(fl_backend_pools_init(&be, &r.pool, &r.hpool, "tp-ops", 0));
        rows_case(&r, 13, 37, 111, 0.3f); /* rank 1 of 3's columns: odd widths */
        rows_case(&r, 7, 300, 600, 0.0f); /* p 0: a copy / a sum */
        rows_case(&r, 5, 64, 64, 0.5f);   /* stride = width: the plain dropout */
        fl_backend_pools_free(&r.pool, &r.hpool);
    }
}

/* ---- what a tensor-parallel pass makes the host wait for on the CUDA backend's code (the emulator with the GPU's
 * paths: fl_cuemu_set_host_memory(0)), counted by the backend (fl_cuemu_backend_counters) around one training forward
 * and backward of golden-gpt2 (B 2, T 8) at TP 1 and TP 2 through the NCCL stand-in: the vocabulary-parallel
 * cross-entropy's statistics stay on the device (vocab_stats, the device all-gather, vocab_xent), so TP 2 copies no
 * logits or statistics to the host (the host path before the ops copied each logits chunk to the host and its loss and
 * gradient back: the check fails on it). */
#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cuda-impl.h"
#include "fitllm/comm.h"
#include "fitllm/io.h"
#include "fitllm/tp.h"

typedef struct {
    fl_cu_counters c[2];
    double loss;
    fl_status st[2];
    char msg[2][256];
} rt_job;

static fl_status rt_rank(fl_comm *c, int rank, void *ud) {
    rt_job *j = ud;
    const int N = c ? fl_comm_size(c) : 1;
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model whole, part;
    fl_comm *dev = NULL;
    int ok_be = 0, ok_pool = 0, ok_whole = 0, ok_part = 0;
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    ok_be = s == FL_OK;
    if (s == FL_OK) s = fl_backend_pools_init(&be, &pool, &host, "rt", 0), ok_pool = s == FL_OK;
    if (s == FL_OK) s = fl_hf_load_model(&whole, "tests/fixtures/golden-gpt2", &be, &pool), ok_whole = s == FL_OK;
    fl_model_config pc;
    if (s == FL_OK) s = fl_tp_config(&whole.cfg, N, rank, &pc);
    if (s == FL_OK && N > 1) {
        s = fl_model_init(&part, &pc, &be, &pool), ok_part = s == FL_OK;
        if (s == FL_OK) s = fl_tp_scatter(&whole, &part);
        if (s == FL_OK) s = be.comm_create(&be, c, &dev);
        if (s == FL_OK) s = fl_model_set_tp(&part, dev);
        if (s == FL_OK) s = fl_model_set_tp_host(&part, c);
    }
    fl_model *m = N > 1 ? &part : &whole;
    enum { B = 2, T = 8 };
    int32_t ids[B * T], tg[B * T];
    for (int i = 0; i < B * T; i++) ids[i] = (i * 37 + 5) % pc.vocab_size, tg[i] = i % 7 == 6 ? -100 : (i * 11 + 3) % pc.vocab_size;
    if (s == FL_OK) s = fl_model_alloc_grads(m);
    if (s == FL_OK) s = fl_model_alloc_acts(m, B, T);
    fl_cu_counters a = {0}, b = {0};
    for (int k = 0; s == FL_OK && k < 2; k++) { /* the second pass counted (the first makes first-use buffers) */
        fl_model_zero_grads(m);
        fl_cuemu_backend_counters(&be, &a);
        s = fl_model_forward(m, ids, tg, B, T, 1.0f / (B * T), NULL);
        if (s == FL_OK) s = fl_model_backward(m);
        fl_cuemu_backend_counters(&be, &b);
    }
    j->c[rank] = (fl_cu_counters){b.sync - a.sync, b.d2h - a.d2h, b.h2d - a.h2d, b.h2d_pinned - a.h2d_pinned,
                                  b.stage_waits - a.stage_waits, b.h2d_s2 - a.h2d_s2, b.only16 - a.only16,
                                  b.only16_bytes - a.only16_bytes,
                                  b.zero_bytes - a.zero_bytes, b.acc16_bytes - a.acc16_bytes, b.gemm_acc16 - a.gemm_acc16,
                                  b.gemm_res16 - a.gemm_res16, b.res16_bytes - a.res16_bytes};
    if (s == FL_OK && rank == 0) j->loss = m->loss_sum / (double)m->n_valid;
    if (s != FL_OK) snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fl_error_message());
    j->st[rank] = s;
    if (s != FL_OK && c) fl_comm_release_peers(c, fl_error_message());
    if (ok_part) fl_model_free(&part);
    if (ok_whole) fl_model_free(&whole);
    if (dev) fl_comm_destroy(dev);
    if (ok_pool) fl_backend_pools_free(&pool, &host);
    if (ok_be) fl_backend_free(&be);
    return s;
}

FL_TEST(tp_ops_cuda_emu_round_trips) {
    if (!fl_test_asan_budget()) return;
    rt_job one = {0}, tp = {0};
    fl_cuemu_set_host_memory(0); /* the GPU's paths: host staging, ids copied, what waits for the device */
    rt_rank(NULL, 0, &one);
    fl_comm_threads_run(2, rt_rank, &tp);
    fl_cuemu_set_host_memory(1);
    FL_REQUIRE(one.st[0] == FL_OK && tp.st[0] == FL_OK && tp.st[1] == FL_OK);
    for (int r = 0; r < 2; r++)
        printf("      TP 2 rank %d: %ld syncs, %ld copies to the host, %ld from it (TP 1: %ld, %ld, %ld); loss %.6f (TP 1 "
               "%.6f)\n", r, tp.c[r].sync, tp.c[r].d2h, tp.c[r].h2d, one.c[0].sync, one.c[0].d2h, one.c[0].h2d, tp.loss,
               one.loss);
    /* the embedding's backward still reads the ids on the host (fl_tp_embed_backward: one copy); nothing else */
    for (int r = 0; r < 2; r++)
        FL_CHECKF(tp.c[r].sync == one.c[0].sync && tp.c[r].d2h <= one.c[0].d2h + 1 && tp.c[r].h2d <= one.c[0].h2d,
                  "TP 2 rank %d: %ld syncs, %ld / %ld copies to / from the host; TP 1 %ld, %ld, %ld", r, tp.c[r].sync,
                  tp.c[r].d2h, tp.c[r].h2d, one.c[0].sync, one.c[0].d2h, one.c[0].h2d);
    FL_CHECKF(fabs(tp.loss - one.loss) <= 1e-6 * fabs(one.loss), "TP 2 loss %.9g vs one process %.9g", tp.loss,
              one.loss);
}
#endif
