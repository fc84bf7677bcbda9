/* The block graph beyond one residual stream (src/model/graph.c): cross-attention to a stream from
 * outside the block (an encoder output, XSTREAM) whose gradient the block sends back into the caller's
 * buffer, with Tk != T, an additive bias (T5's) and a key padding mask; and the ALLREDUCE op kind (tensor parallelism as a graph rewrite): a no-op
 * without a communicator (the same bits as the graph without it), and over the threads communicator of
 * 2 ranks a sum whose effect is exact to check (identical inputs on both ranks: the reduced slot doubles,
 * so what follows from it doubles bit for bit). The block runs over micro's block-0 weights: q is the
 * first QD rows of its fused QKV matrix, the stream's k|v the first 2 KVD rows of its fused gate|up. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/model.h"
#include "model/model-impl.h"
#include "test.h"

enum { SX = 0, SOUT = 1, SENC, SQ, SKV, SATT, SLSE, SMID, SRSTD };

/* x, enc (B x Tk rows) -> q = x Wq^T, kv = enc Wkv^T -> att = cross-attention(q; k, v) -> mid = att Wo^T
 * [-> ALLREDUCE(mid) in the forward: ar bit 0] + x -> out = rmsnorm(mid) (a post-norm block); ar bit 1:
 * ALLREDUCE(q) in the backward. */
static void cross_graph(const fl_model_config *c, int ar, fl_block_graph *g) {
    fl_dims d = fl_model_dims(c);
    memset(g, 0, sizeof *g);
    fl_graph_slot(g, "x", d.C, FL_GSLOT_STREAM, 1);
    fl_graph_slot(g, "out", d.C, FL_GSLOT_STREAM, 1);
    fl_graph_slot(g, "enc", d.C, FL_GSLOT_XSTREAM, 0);
    fl_graph_slot(g, "q", d.QD, FL_GSLOT_WIDE, 0);
    fl_graph_slot(g, "kv", 2 * d.KVD, FL_GSLOT_WIDE, 0);
    fl_graph_slot(g, "att", d.QD, FL_GSLOT_WIDE, 0);
    fl_graph_slot(g, "lse", d.NH, FL_GSLOT_STAT, 0);
    fl_graph_slot(g, "mid", d.C, FL_GSLOT_WIDE, 1);
    fl_graph_slot(g, "rstd", 1, FL_GSLOT_STAT, 0);
    fl_graph_op(g, FL_GOP_LINEAR, SX, SQ, -1, -1, 0, FL_ROLE_QKV_W, -1);
    if (ar & 2) fl_graph_op(g, FL_GOP_ALLREDUCE, SQ, SQ, -1, -1, FL_GAR_BWD, -1, -1);
    fl_graph_op(g, FL_GOP_LINEAR, SENC, SKV, -1, -1, 2, FL_ROLE_FC_W, -1);
    fl_gop *a = fl_graph_op(g, FL_GOP_ATTN, SQ, SATT, SLSE, -1, -1, -1, -1);
    a->attn = FL_ATTN_CROSS;
    a->attn_flags = FL_GATTN_BIAS | FL_GATTN_MASK; /* T5's relative bias, a padded key */
    a->in2 = SKV;
    fl_graph_op(g, FL_GOP_LINEAR, SATT, SMID, -1, -1, 1, FL_ROLE_O_W, -1);
    if (ar & 1) fl_graph_op(g, FL_GOP_ALLREDUCE, SMID, SMID, -1, -1, FL_GAR_FWD, -1, -1);
    fl_graph_op(g, FL_GOP_ADD, SX, SMID, -1, -1, -1, -1, -1);
    fl_graph_op(g, FL_GOP_NORM, SMID, SOUT, -1, SRSTD, 0, FL_ROLE_LN1_W, -1);
    g->n_norms = 1;
    g->n_linears = 3;
}

typedef struct {
    const fl_model *m;
    const fl_block_graph *g;
    int B, T, Tk;
    const float *x, *enc, *r; /* inputs and d(out) */
    const float *bias;        /* (NH, T, Tk) */
    const uint8_t *kmask;     /* (B, Tk) */
    float *dbias[2];          /* per rank: d(bias) */
    float *out[2], *mid[2], *dx[2], *denc[2], *dwq[2]; /* per rank: output, mid, d(x), d(enc), d(Wq) */
} run_ctx;

/* One forward + backward of ctx->g as rank `rank` of comm (NULL: alone), with its own backend and
 * gradient buffers (the model's parameters are only read). */
static fl_status run_rank(fl_comm *comm, int rank, void *vctx) {
    run_ctx *c = vctx;
    fl_backend be;
    FL_TRY(fl_backend_init_by_name("cpu", &be, 1));
    fl_model m = *c->m; /* a shallow copy that runs on this thread's backend */
    m.be = &be;
    fl_dims d = fl_model_dims(&m.cfg);
    const size_t N = (size_t)c->B * c->T, NK = (size_t)c->B * c->Tk;
    float *s[FL_GRAPH_MAX_SLOTS] = {0}, *gb[FL_GRAPH_MAX_GBUF] = {0}, *dxs[FL_GRAPH_MAX_SLOTS] = {0};
    for (int k = 0; k < c->g->n_slots; k++)
        s[k] = calloc((c->g->slot[k].xrows ? NK : N) * (size_t)c->g->slot[k].width + 16, sizeof(float));
    for (int k = 0; k < c->g->n_gbuf; k++) gb[k] = calloc(NK * 4 * (size_t)(k ? c->g->gbuf_width[k] : d.C) + 16, sizeof(float));
    memcpy(s[SX], c->x, N * d.C * sizeof(float));
    memcpy(s[SENC], c->enc, NK * d.C * sizeof(float));
    memcpy(gb[FL_GBUF_RES], c->r, N * d.C * sizeof(float));
    dxs[SENC] = calloc(NK * d.C, sizeof(float));
    fl_block_params bp;
    fl_get_block(&m, c->g, 0, &bp);
    float *dw[3];
    for (int p = 0; p < 3; p++) { /* this rank's weight gradients */
        dw[p] = calloc((size_t)bp.lin[p].out * bp.lin[p].in, sizeof(float));
        bp.lin[p].dw = dw[p];
        bp.lin[p].db = NULL;
    }
    bp.d_norm_w[0] = NULL; /* the norm's weight does not train here (no shared gradient between ranks) */
    fl_block_ctx cx = {.B = c->B, .T = c->T, .Tk = c->Tk, .dxs = dxs, .comm = comm, .attn_bias = c->bias,
                       .kmask = c->kmask, .dattn_bias = c->dbias[rank]};
    memset(c->dbias[rank], 0, (size_t)d.NH * c->T * c->Tk * sizeof(float));
    fl_status st = fl_block_forward(&m, c->g, &bp, s, &cx);
    if (st == FL_OK) memcpy(c->out[rank], s[SOUT], N * d.C * sizeof(float));
    if (st == FL_OK) memcpy(c->mid[rank], s[SMID], N * d.C * sizeof(float));
    if (st == FL_OK) st = fl_block_backward(&m, c->g, &bp, s, gb, &cx);
    if (st == FL_OK) {
        memcpy(c->dx[rank], gb[FL_GBUF_RES], N * d.C * sizeof(float));
        memcpy(c->denc[rank], dxs[SENC], NK * d.C * sizeof(float));
        memcpy(c->dwq[rank], dw[0], (size_t)d.QD * d.C * sizeof(float));
    }
    for (int k = 0; k < c->g->n_slots; k++) free(s[k]);
    for (int k = 0; k < c->g->n_gbuf; k++) free(gb[k]);
    for (int p = 0; p < 3; p++) free(dw[p]);
    free(dxs[SENC]);
    fl_backend_free(&be);
    return st;
}

static double dot(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

FL_TEST(graph_cross_attention_stream_and_allreduce) {
    fl_model_config cfg;
    FL_REQUIRE_OK(fl_preset_find("micro", &cfg));
    fl_block_graph plain, ar, arf, arb;
    cross_graph(&cfg, 0, &plain);
    cross_graph(&cfg, 3, &ar);
    cross_graph(&cfg, 1, &arf);
    cross_graph(&cfg, 2, &arb);
    FL_REQUIRE_OK(fl_block_graph_finish(&plain));
    FL_REQUIRE_OK(fl_block_graph_finish(&ar));
    FL_REQUIRE_OK(fl_block_graph_finish(&arf));
    FL_REQUIRE_OK(fl_block_graph_finish(&arb));
    FL_CHECK(plain.slot[SX].grad != FL_GBUF_RES && plain.slot[SOUT].grad == FL_GBUF_RES); /* copied at the end */
    FL_CHECK(plain.slot[SKV].xrows && plain.slot[SENC].xrows && !plain.slot[SQ].xrows && !plain.slot[SATT].xrows);
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &be, 1));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model m;
    FL_REQUIRE_OK(fl_model_init(&m, &cfg, &be, &pool));
    fl_model_init_random(&m, 3);
    fl_dims d = fl_model_dims(&cfg);
    const int B = 2, T = 7, Tk = 5;
    const size_t N = (size_t)B * T, NK = (size_t)B * Tk;
    float *x = malloc(N * d.C * 4), *enc = malloc(NK * d.C * 4), *r = malloc(N * d.C * 4);
    fl_test_rng rng = {9};
    fl_test_fill(&rng, x, N * d.C, -1.0f, 1.0f);
    fl_test_fill(&rng, enc, NK * d.C, -1.0f, 1.0f);
    fl_test_fill(&rng, r, N * d.C, -1.0f, 1.0f);
    float *bias = malloc((size_t)d.NH * T * Tk * 4);
    fl_test_fill(&rng, bias, (size_t)d.NH * T * Tk, -1.0f, 1.0f);
    uint8_t kmask[2 * 5] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 0}; /* sequence 1's last key padded */
    run_ctx c = {&m, &plain, B, T, Tk, x, enc, r, bias, kmask, {0}, {0}, {0}, {0}, {0}, {0}};
    for (int k = 0; k < 2; k++) c.dbias[k] = malloc((size_t)d.NH * T * Tk * 4);
    for (int k = 0; k < 2; k++) {
        c.out[k] = malloc(N * d.C * 4), c.mid[k] = malloc(N * d.C * 4), c.dx[k] = malloc(N * d.C * 4);
        c.denc[k] = malloc(NK * d.C * 4), c.dwq[k] = malloc((size_t)d.QD * d.C * 4);
    }
    /* 1. d(enc) is the gradient of sum(out * r) with respect to the stream: central differences in double
     * of the fp32 block (step 1e-2: rounding ~1e-4 and truncation ~1e-4 against gradients of ~0.1..1) */
    FL_REQUIRE_OK(run_rank(NULL, 0, &c));
    const float *denc = c.denc[0];
    float *xe = malloc(NK * d.C * 4);
    double worst = 0;
    for (size_t i = 3; i < NK * d.C; i += NK * d.C / 7) {
        double l[2];
        for (int s = 0; s < 2; s++) {
            memcpy(xe, enc, NK * d.C * 4);
            xe[i] += s ? -1e-2f : 1e-2f;
            c.enc = xe;
            FL_REQUIRE_OK(run_rank(NULL, 1, &c));
            l[s] = dot(c.out[1], r, N * d.C);
        }
        const double fd = (l[0] - l[1]) / 2e-2;
        worst = fmax(worst, fabs(fd - denc[i]) / (1 + fabs(denc[i])));
        FL_CHECKF(fabs(fd - denc[i]) <= 2e-3 * (1 + fabs(denc[i])), "d(enc)[%zu]: finite difference %.6g, backward %.6g",
                  i, fd, (double)denc[i]);
    }
    c.enc = enc;
    /* d(x): the post-norm block's input path ends outside dres while d(out) is there, and is copied in */
    const float *dx = c.dx[0];
    for (size_t i = 5; i < N * d.C; i += N * d.C / 5) {
        double l[2];
        for (int s = 0; s < 2; s++) {
            float *xp = fl_test_fdup(x, N * d.C);
            xp[i] += s ? -1e-2f : 1e-2f;
            c.x = xp;
            FL_REQUIRE_OK(run_rank(NULL, 1, &c));
            l[s] = dot(c.out[1], r, N * d.C);
            free(xp);
        }
        const double fd = (l[0] - l[1]) / 2e-2;
        FL_CHECKF(fabs(fd - dx[i]) <= 2e-3 * (1 + fabs(dx[i])), "d(x)[%zu]: finite difference %.6g, backward %.6g", i, fd,
                  (double)dx[i]);
    }
    c.x = x;
    /* d(bias): summed over the batch; the padded key's column has none from sequence 1 */
    const float *dbias = c.dbias[0];
    float *bp = fl_test_fdup(bias, (size_t)d.NH * T * Tk);
    for (size_t i = 2; i < (size_t)d.NH * T * Tk; i += (size_t)d.NH * T * Tk / 4) {
        double l[2];
        for (int s = 0; s < 2; s++) {
            memcpy(bp, bias, (size_t)d.NH * T * Tk * 4);
            bp[i] += s ? -1e-2f : 1e-2f;
            c.bias = bp;
            FL_REQUIRE_OK(run_rank(NULL, 1, &c));
            l[s] = dot(c.out[1], r, N * d.C);
        }
        const double fd = (l[0] - l[1]) / 2e-2;
        FL_CHECKF(fabs(fd - dbias[i]) <= 2e-3 * (1 + fabs(dbias[i])), "d(bias)[%zu]: finite difference %.6g, backward %.6g",
                  i, fd, (double)dbias[i]);
    }
    c.bias = bias;
    free(bp);
    double nz = 0;
    for (size_t i = 0; i < NK * d.C; i++) nz = fmax(nz, fabs(denc[i]));
    FL_CHECKF(nz > 1e-3, "d(enc) is zero");
    printf("      cross-attention: d(enc) vs finite differences %.2g (max |d(enc)| %.2g)\n", worst, nz);

    /* 2. ALLREDUCE without a communicator: the same bits as the graph without it */
    float *out0 = malloc(N * d.C * 4), *dx0 = malloc(N * d.C * 4), *dwq0 = malloc((size_t)d.QD * d.C * 4);
    float *mid0 = malloc(N * d.C * 4);
    memcpy(mid0, c.mid[0], N * d.C * 4);
    memcpy(out0, c.out[0], N * d.C * 4), memcpy(dx0, c.dx[0], N * d.C * 4), memcpy(dwq0, c.dwq[0], (size_t)d.QD * d.C * 4);
    c.g = &ar;
    FL_REQUIRE_OK(run_rank(NULL, 0, &c));
    FL_CHECK(memcmp(out0, c.out[0], N * d.C * 4) == 0 && memcmp(dx0, c.dx[0], N * d.C * 4) == 0 &&
             memcmp(dwq0, c.dwq[0], (size_t)d.QD * d.C * 4) == 0 && memcmp(denc, c.denc[0], NK * d.C * 4) == 0);

    /* 3. two ranks with the same inputs, each direction alone: in the forward, mid - x doubles (att Wo^T
     * exactly doubled, then + x rounded once: within a few roundings); in the backward (the forward
     * unchanged), d(Wq) doubles bit for bit (the sum of d(q)); both ranks agree */
    c.g = &arf;
    FL_REQUIRE_OK(fl_comm_threads_run(2, run_rank, &c));
    int same = 1, twice = 1, wq = 1;
    for (size_t i = 0; i < N * d.C; i++) {
        same &= c.out[0][i] == c.out[1][i];
        twice &= fabs((double)c.mid[0][i] - x[i] - 2 * ((double)mid0[i] - x[i])) <=
                 4 * 6e-8 * (fabs(x[i]) + fabs(c.mid[0][i]) + fabs(mid0[i]));
    }
    c.g = &arb;
    FL_REQUIRE_OK(fl_comm_threads_run(2, run_rank, &c));
    for (size_t i = 0; i < N * d.C; i++) same &= c.out[0][i] == out0[i] && c.out[1][i] == out0[i];
    for (size_t i = 0; i < (size_t)d.QD * d.C; i++) wq &= c.dwq[0][i] == 2 * dwq0[i] && c.dwq[1][i] == c.dwq[0][i];
    FL_CHECKF(same && twice && wq, "2 ranks: outputs agree %d, mid - x doubled %d, d(Wq) doubled %d", same, twice, wq);
    free(mid0);
    for (int k = 0; k < 2; k++) free(c.mid[k]), free(c.out[k]), free(c.dx[k]), free(c.denc[k]), free(c.dwq[k]);
    free(c.dbias[0]), free(c.dbias[1]), free(bias);
    free(x), free(enc), free(r), free(xe), free(out0), free(dx0), free(dwq0);
    fl_model_free(&m);
    fl_mem_pool_free(&pool);
    fl_backend_free(&be);
}
