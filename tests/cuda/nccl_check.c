/* The NCCL communicator on real GPUs (for a machine with 2+ GPUs; run by tests/cuda/nccl_check.sh):
 *   mpirun -np N fitllm_nccl_check TMPDIR        (one rank per GPU, N <= the GPUs of the node)
 * Built when the build has CUDA, NCCL and MPI. Every rank uses the "cuda" backend (device = its
 * local rank) and the NCCL communicator that backend makes (fl_nccl_cuda_api: libnccl), and:
 *   1. every fl_comm case of tests/comm_ref.h on DEVICE buffers (each kind, dtype, op, in place,
 *      counts 0 / below N / not divisible by N (grouped ncclReduce / ncclBroadcast) / divisible):
 *      gathers and broadcasts exact; reductions within the float64 bound of comm_ref.h, widened
 *      for NCCL's order (any order of N terms: gamma_{N-1}; BF16: up to N-1 roundings of 2^-8),
 *      and at N = 2 equal to fl_comm's bits (x_0 + x_1 is one rounding in either order; AVG's
 *      premultiplication by 1/2 is exact);
 *   2. 40 asynchronous all-reduces completed in reverse order;
 *   3. DDP training (tests/ddp_ref.h's SGD and AdamW-with-clipping scenarios) on the GPUs against
 *      one process on rank 0's GPU: the step losses within 1e-6 relative and the parameters within
 *      ddp_ref.h's bound; every rank ends with the same parameter bits; the AdamW scenario also
 *      under ZeRO-2 and FSDP FULL_SHARD (parameters, gradients, gathered units and optimizer state
 *      on the GPUs, through NCCL), against the same bounds (any grouping of the same terms).
 * Prints "nccl check: N ranks, C checks, F failures" on rank 0; exit 1 on a failure, 0 with a
 * message when there is nothing to check (size 1, no GPU). */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../comm_ref.h"
#include "../ddp_ref.h"
#include "fitllm/backend.h"
#include "fitllm/comm.h"
#include "fitllm/comm_nccl.h"
#include "fitllm/cuda.h"

static int g_rank, g_checks, g_fails;

#define CHECK(cond, ...)                                                                                             \
    do {                                                                                                             \
        g_checks++;                                                                                                  \
        if (!(cond)) {                                                                                               \
            g_fails++;                                                                                               \
            fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank, __FILE__, __LINE__);                                    \
            fprintf(stderr, __VA_ARGS__);                                                                            \
            fputc('\n', stderr);                                                                                     \
        }                                                                                                            \
    } while (0)

static void *dalloc(size_t bytes) {
    void *p = NULL;
    return cudaMalloc(&p, bytes ? bytes : 4) == cudaSuccess ? p : NULL;
}
static void h2d(void *d, const void *h, size_t b) { if (b) cudaMemcpy(d, h, b, cudaMemcpyHostToDevice); }
static void d2h(void *h, const void *d, size_t b) { if (b) cudaMemcpy(h, d, b, cudaMemcpyDeviceToHost); }

/* comm_ref.h's cr_run on device buffers. */
static fl_status run_dev(fl_comm *c, const cr_case *cs, const void *in, void *out) {
    int n = fl_comm_size(c), r = fl_comm_rank(c);
    size_t es = fl_dtype_size(cs->dt), off, len, b = cs->count * es;
    fl_comm_chunk(cs->count, n, r, &off, &len);
    char *din = dalloc(b), *dout = dalloc(b), *buf = dalloc(b);
    if (!din || !dout || !buf) return fl_errorf(FL_ERR_OOM, "cudaMalloc");
    h2d(din, in, b);
    fl_status s = FL_OK;
    switch (cs->kind) {
    case FL_COLL_ALL_REDUCE:
        if (cs->inplace) {
            h2d(buf, in, b);
            s = fl_comm_all_reduce(c, buf, buf, cs->count, cs->dt, cs->op);
            d2h(out, buf, b);
        } else {
            s = fl_comm_all_reduce(c, din, dout, cs->count, cs->dt, cs->op);
            d2h(out, dout, b);
        }
        break;
    case FL_COLL_REDUCE_SCATTER:
        if (cs->inplace) {
            h2d(buf, in, b);
            s = fl_comm_reduce_scatter(c, buf, buf + off * es, cs->count, cs->dt, cs->op);
            d2h(out, buf + off * es, len * es);
        } else {
            s = fl_comm_reduce_scatter(c, din, dout, cs->count, cs->dt, cs->op);
            d2h(out, dout, len * es);
        }
        break;
    case FL_COLL_ALL_GATHER:
        if (cs->inplace) {
            cudaMemset(buf, 0xA5, b);
            h2d(buf + off * es, (const char *)in + off * es, len * es);
            s = fl_comm_all_gather(c, buf + off * es, buf, cs->count, cs->dt);
            d2h(out, buf, b);
        } else {
            cudaMemset(dout, 0xA5, b);
            s = fl_comm_all_gather(c, din + off * es, dout, cs->count, cs->dt);
            d2h(out, dout, b);
        }
        break;
    case FL_COLL_BROADCAST:
        s = fl_comm_broadcast(c, din, cs->count, cs->dt, cs->root);
        d2h(out, din, b);
        break;
    default: break;
    }
    cudaFree(din);
    cudaFree(dout);
    cudaFree(buf);
    return s;
}

/* A reduction's elements within the bound of ANY summation order (NCCL's ring/tree), BF16 with
 * up to n-1 roundings. Returns failures. */
static int check_reduce_any_order(const char *label, const cr_case *cs, int n, const void *const *in, size_t off,
                                  size_t len, const void *got) {
    const double u = ldexp(1.0, -24), ub = ldexp(1.0, -8);
    int fails = 0;
    for (size_t j = 0; j < len; j++) {
        double sum = 0, asum = 0, mx = -INFINITY;
        for (int r = 0; r < n; r++) {
            double x = cr_get(cs->dt, in[r], off + j);
            sum += x, asum += fabs(x), mx = x > mx ? x : mx;
        }
        double g = cr_get(cs->dt, got, j), ref = mx, bound = 0;
        if (cs->op != FL_COMM_MAX) {
            int k = n; /* n-1 additions, + AVG's scaling */
            ref = cs->op == FL_COMM_AVG ? sum / n : sum;
            bound = k * u / (1 - k * u) * asum;
            if (cs->dt == FL_BF16) bound += n * ub * (asum + bound);
            if (cs->op == FL_COMM_AVG) bound /= n;
        }
        if (!(fabs(g - ref) <= bound)) {
            if (!fails) fprintf(stderr, "  %s: element %zu: %.9g, float64 %.12g, bound %.3g\n", label, off + j, g, ref, bound);
            fails++;
        }
    }
    return fails;
}

static void collectives(fl_comm *c) {
    int n = fl_comm_size(c), m = cr_cases(n, NULL);
    cr_case *cases = malloc((size_t)m * sizeof *cases);
    cr_cases(n, cases);
    int bad = 0;
    for (int k = 0; k < m; k++) {
        const cr_case *cs = &cases[k];
        size_t es = fl_dtype_size(cs->dt), off, len;
        fl_comm_chunk(cs->count, n, g_rank, &off, &len);
        void **in = calloc((size_t)n, sizeof *in), *out = malloc(cs->count * es + 4);
        for (int r = 0; r < n; r++) in[r] = malloc(cs->count * es + 4), cr_input(cs, r, in[r]);
        char label[256];
        cr_label(cs, n, label, sizeof label);
        fl_status s = run_dev(c, cs, in[g_rank], out);
        CHECK(s == FL_OK, "%s: %s", label, fl_error_message());
        if (s == FL_OK) {
            int reduction = cs->kind == FL_COLL_ALL_REDUCE || cs->kind == FL_COLL_REDUCE_SCATTER;
            if (!reduction || n == 2) {
                bad += cr_check(label, cs, n, g_rank, (const void *const *)in, out, NULL) != 0;
            } else {
                size_t o = cs->kind == FL_COLL_REDUCE_SCATTER ? off : 0, l = cs->kind == FL_COLL_REDUCE_SCATTER ? len : cs->count;
                bad += check_reduce_any_order(label, cs, n, (const void *const *)in, o, l, out) != 0;
            }
        }
        for (int r = 0; r < n; r++) free(in[r]);
        free(in);
        free(out);
    }
    CHECK(bad == 0, "%d of %d collective cases wrong at %d ranks (%s)", bad, m, n,
          n == 2 ? "fl_comm's bits and the float64 bound" : "the float64 bound of any summation order");
    free(cases);
    /* asynchronous: 40 all-reduces in flight, completed in reverse order */
    enum { K = 40, L = 1001 };
    float *h = malloc(sizeof(float) * L), *dev[K];
    fl_comm_req *req[K];
    int ok = 1;
    for (int k = 0; k < K; k++) {
        for (int i = 0; i < L; i++) h[i] = (float)(k + i % 7) * (float)(g_rank + 1);
        dev[k] = dalloc(sizeof(float) * L);
        h2d(dev[k], h, sizeof(float) * L);
        ok &= fl_comm_iall_reduce(c, dev[k], dev[k], L, FL_F32, FL_COMM_SUM, &req[k]) == FL_OK;
    }
    for (int k = K - 1; k >= 0; k--) ok &= fl_comm_wait(&req[k]) == FL_OK;
    for (int k = 0; k < K && ok; k++) {
        d2h(h, dev[k], sizeof(float) * L);
        for (int i = 0; i < L; i++) ok &= h[i] == (float)(k + i % 7) * (float)(n * (n + 1) / 2); /* small integers: exact */
    }
    for (int k = 0; k < K; k++) cudaFree(dev[k]);
    free(h);
    CHECK(ok, "asynchronous all-reduces: %s", fl_error_message());
}

static void ddp(fl_comm *c, const char *tmp, int sc, const char *strategy) {
    int n = fl_comm_size(c);
    char out[600];
    fl_run_config cfg;
    snprintf(out, sizeof out, "%s/nccl-%s-%s", tmp, dr_names[sc], strategy); /* rank 0 writes there */
    dr_config(&cfg, sc, n, n, 1, 1, out);
    snprintf(cfg.strategy, sizeof cfg.strategy, "%s", strategy);
    cfg.hook_whole_params = 1; /* FULL_SHARD: the record sees the whole parameters, gathered */
    dr_rec run = {0};
    fl_status s = fl_trainer_run_comm(&cfg, c, NULL, 0, dr_record, &run, NULL);
    CHECK(s == FL_OK, "%s: %s over NCCL: %s", dr_names[sc], strategy, fl_error_message());
    if (s != FL_OK) return;
    double hsum = 0, hx = 0;
    for (size_t i = 0; i < run.numel; i++) {
        uint32_t b;
        memcpy(&b, &run.params[i], 4);
        hx += (double)(b % 65521) * (double)(i % 7919 + 1);
        hsum += run.params[i];
    }
    float mine[4] = {(float)hx, (float)(hx - (float)hx), (float)hsum, (float)(hsum - (float)hsum)};
    float *all = calloc((size_t)n * 4, sizeof *all);
    CHECK(all && fl_comm_all_gather(c, mine, all, (size_t)n * 4, FL_F32) == FL_OK, "gathering checksums");
    for (int r = 1; all && r < n; r++)
        CHECK(!memcmp(all, all + 4 * r, 4 * sizeof *all), "%s: rank %d's parameters differ from rank 0's", dr_names[sc], r);
    free(all);
    if (g_rank == 0) {
        fl_run_config rc;
        dr_rec ref = {0}, ctl = {0};
        snprintf(out, sizeof out, "%s/nccl-%s-ref", tmp, dr_names[sc]);
        dr_config(&rc, sc, n, 1, 1, 1, out);
        CHECK(fl_trainer_run(&rc, NULL, 0, dr_record, &ref, NULL) == FL_OK, "ref: %s", fl_error_message());
        snprintf(out, sizeof out, "%s/nccl-%s-ctl", tmp, dr_names[sc]);
        dr_config(&rc, sc, n, 1, n, 0, out);
        CHECK(fl_trainer_run(&rc, NULL, 0, dr_record, &ctl, NULL) == FL_OK, "control: %s", fl_error_message());
        double lr = dr_loss_rel(&run, &ctl, cfg.train.max_steps);
        CHECK(lr <= 1e-6, "%s %s at %d GPUs vs one GPU with micro %d: step losses differ by %.3g relative", dr_names[sc],
              strategy, n, 2 * n, lr);
        char why[1024];
        int bad = dr_compare(&run, &ref, dr_max_diff(&ref, &ctl), dr_floor(&cfg), cfg.train.max_steps, why, sizeof why);
        CHECK(bad == 0, "%s %s at %d GPUs vs one GPU: %s", dr_names[sc], strategy, n, why);
        printf("  %s %s at %d GPUs vs one GPU: %s\n", dr_names[sc], strategy, n, why);
        dr_free(&ref);
        dr_free(&ctl);
    }
    dr_free(&run);
    CHECK(fl_comm_barrier(c) == FL_OK, "barrier");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: mpirun -np N fitllm_nccl_check TMPDIR (one rank per GPU)\n");
        return 2;
    }
    fl_comm *c;
    if (fl_comm_init(&c, &argc, &argv) != FL_OK) {
        fprintf(stderr, "nccl check: %s\n", fl_error_message());
        return 1;
    }
    g_rank = fl_comm_rank(c);
    int n = fl_comm_size(c);
    char why[256];
    if (n < 2 || fl_cuda_device_count(why, sizeof why) == 0) {
        if (g_rank == 0)
            printf("nccl check: nothing to check (%s)\n", n < 2 ? "run it under mpirun -np 2 or more, one rank per GPU" : why);
        fl_comm_destroy(c);
        return 0;
    }
    /* the backend picks device = local rank; its communicator is the trainer's */
    fl_backend be;
    fl_status s = fl_backend_init_by_name("cuda", &be, 1);
    fl_comm *nc = NULL;
    if (s == FL_OK) s = be.comm_create(&be, c, &nc);
    if (s != FL_OK) {
        fprintf(stderr, "rank %d: %s\n", g_rank, fl_error_message());
        fl_comm_abort(c, 1, "nccl check set-up failed");
        return 1;
    }
    int dev = -1;
    cudaGetDevice(&dev);
    printf("rank %d of %d: device %d, %s (%s)\n", g_rank, n, dev, fl_comm_nccl_library(), fl_comm_impl_name(nc));
    collectives(nc);
    fl_comm_destroy(nc);
    fl_backend_free(&be);
    setenv("FITLLM_BACKEND", "cuda", 1);
    ddp(c, argv[1], DR_SGD, "ddp");
    ddp(c, argv[1], DR_ADAMW, "ddp");
    ddp(c, argv[1], DR_ADAMW, "deepspeed_stage_2");
    ddp(c, argv[1], DR_ADAMW, "fsdp");
    float f = (float)g_fails, fmax = 0, chk = (float)g_checks, csum = 0;
    if (fl_comm_all_reduce(c, &f, &fmax, 1, FL_F32, FL_COMM_MAX) != FL_OK ||
        fl_comm_all_reduce(c, &chk, &csum, 1, FL_F32, FL_COMM_SUM) != FL_OK)
        return 1;
    if (g_rank == 0) printf("nccl check: %d ranks, %.0f checks, %.0f failures (most on one rank)\n", n, csum, fmax);
    fl_comm_destroy(c);
    return fmax > 0;
}
