/* Data-parallel (DDP) scenarios shared by tests/test_ddp.c (ranks as threads, in the normal
 * suite) and tests/mpi/ddp_mpi_test.c (ranks as MPI processes under mpirun).
 *
 * Each scenario is a short run of the `micro` preset on synthetic data; DDP at N ranks with
 * micro-batch b and accumulation a per rank is compared with ONE process training the same global
 * batch N*a*b:
 *   ref     micro b, accumulation N*a: the same micro-batches in the same order (global
 *           micro-batch j is rank j % N's), the same LoRA dropout masks (keyed on the global
 *           iteration), so only the association of the gradient sums differs;
 *   control micro N*b, accumulation a: the same global batch associated differently again.
 * Checks:
 *   - the step loss (mean over the step's valid targets) at every step within 1e-6 relative of
 *     ref (issue #14's figure);
 *   - the trained parameters after the last step within 8 x D + 4 ulp(max |p|) x steps of ref, where
 *     D = max |p_ref - p_control|. Why: every gradient element of every run is an fp32 sum of the
 *     same per-row contributions (the micro-batch forward/backward of step 1 are bitwise the same;
 *     only how the partial sums are grouped differs: the single process accumulates micro-batch
 *     after micro-batch into one buffer, DDP accumulates each rank's micro-batches and then adds
 *     the ranks in rank order). Any grouping of K terms is within gamma_K * sum|c| of the exact
 *     sum (Higham, Accuracy and Stability, 4.2), so two groupings differ by at most twice that;
 *     the control is a second grouping of the same sums, and D measures that reassociation noise
 *     on this model and these steps (updates are applied identically, so later steps carry it
 *     forward alike). Factor 2 for the two-sided bound, 4 for D being one realisation rather than
 *     the worst case; the ulp term covers the final rounding of each update. A DDP bug (a missing or
 *     averaged reduction, a wrong data split, different masks) moves parameters by ~lr per step,
 *     orders of magnitude above it — and the loss check at 1e-6 catches those from step 2 on.
 *     For LoRA the control is run without dropout (different micro-batch shapes draw different
 *     masks). D can be 0 there (the adapters' small GEMMs happened to group both controls alike)
 *     while DDP's rank sum still reassociates. AdamW normalizes each element's update: for an
 *     element whose contributions nearly cancel, a last-bit change of its gradient can move
 *     the update by up to the whole step, so the reassociation argument does not bound AdamW
 *     parameters tightly. AdamW runs therefore add the one bound that holds for ANY two
 *     gradient sequences: |m_hat / sqrt(v_hat)| <= kappa_t at step t, by Cauchy-Schwarz on
 *     m = (1-b1) sum b1^(t-i) g_i against v = (1-b2) sum b2^(t-i) g_i^2:
 *       kappa_t = (1-b1) sqrt(1-b2^t) / ((1-b1^t) sqrt(1-b2)) * sqrt(sum_{k<t} (b1^2/b2)^k),
 *     so two AdamW trajectories differ by at most sum_t 2 lr kappa_t (weight decay only
 *     contracts the difference). That bound is weak on purpose: it is derived, not fitted; for
 *     AdamW the strong check is the loss at every step (1e-6 relative), and SGD (update lr x g,
 *     no normalization) keeps the tight parameter bound with no addition.
 * 16-bit gradients (bf16-true, 16-true; applied in tests/zero_ref.h): every stored partial sum is
 * rounded to the 16-bit dtype (unit roundoff u = 2^-8 bf16, 2^-11 fp16; the fp32 roundings inside a
 * micro-batch are 2^13 times smaller or more). A contribution's error grows with the roundings on
 * its path to the step's gradient, at most gamma_d sum|c| for the longest path d. One process with
 * accumulation K = N a rounds once per micro-batch (d = K); the control (micro N b, accumulation a)
 * d = a; DDP, ZeRO and FULL_SHARD a on the rank (FULL_SHARD: the unit's gradient, reduced, then one
 * add per later micro-batch) plus ONE MORE: the reduction's rounding of the rank sum (fl_comm sums
 * in fp32 and rounds once), d = a + 1. The worst-case distance DDP-ref is then (K + a + 1) u sum|c|
 * against the control pair's (K + a) u sum|c|, of which D (and the control's loss noise) is the
 * measured realisation: the 16-bit bounds scale both by dr_round16_factor = (K + a + 1) / (K + a)
 * (7/6 at 2 ranks x accumulation 2). Under 16-true a loss-scale skip decided differently (an
 * overflow seen by some ranks only, or before the reduction) would move parameters by a whole
 * update, far beyond any of these bounds.
 * The data split of 51 samples in micro-batches of 2 gives 26 micro-batches per epoch, the last
 * of one sample: no world size divides it, epochs wrap inside steps, and one rank gets the short
 * micro-batch. */
#ifndef FL_TESTS_DDP_REF_H
#define FL_TESTS_DDP_REF_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/config.h"
#include "fitllm/trainer.h"

enum { DR_ADAMW = 0, DR_SGD, DR_LORA, DR_COUNT };
static const char *const dr_names[DR_COUNT] = {"adamw_clip", "sgd", "lora_dropout"};

#define DR_MAX_STEPS 8

typedef struct {
    double loss[DR_MAX_STEPS];
    float *params; /* the trained parameters' raw bytes (fp32) after the last step */
    size_t numel;
    long steps;
} dr_rec;

static inline int dr_record(void *ud, long step, double loss, const void *params, size_t bytes) {
    dr_rec *r = ud;
    if (step <= DR_MAX_STEPS) r->loss[step - 1] = loss;
    r->steps = step;
    free(r->params);
    r->params = malloc(bytes + 4);
    if (r->params) memcpy(r->params, params, bytes);
    r->numel = bytes / sizeof(float);
    return 0;
}

static inline void dr_free(dr_rec *r) {
    free(r->params);
    memset(r, 0, sizeof *r);
}

/* One trainer run per rank of an in-process grid (fl_comm_threads_run's callback, or called with no communicator for
 * one process): each rank's configuration in, its step records, status, error message and result out (the grid
 * tests of TP, PP and T5 TP). */
#define DR_JOB_RANKS 8 /* DP 2 x TP 2 x PP 2 */
typedef struct {
    fl_run_config cfg[DR_JOB_RANKS];
    dr_rec rec[DR_JOB_RANKS];
    fl_status st[DR_JOB_RANKS];
    char msg[DR_JOB_RANKS][600];
    fl_trainer_result res[DR_JOB_RANKS];
} dr_job;

static inline fl_status dr_job_rank(fl_comm *c, int rank, void *ud) {
    dr_job *j = ud;
    fl_status s = fl_trainer_run_comm(&j->cfg[rank], c, NULL, 0, dr_record, &j->rec[rank], &j->res[rank]);
    j->st[rank] = s;
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", s != FL_OK ? fl_error_message() : "");
    return s;
}

/* Scenario sc for `world` ranks; micro_mult 1 (DDP and ref) or world (control: micro N*b). For
 * the single-process runs pass world_ranks 1 and the DDP world as `world`. */
static inline void dr_config(fl_run_config *c, int sc, int world, int ranks, int micro_mult, int dropout, const char *out) {
    fl_cfg_defaults(c, sc == DR_LORA ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "micro");
    snprintf(c->out_dir, sizeof c->out_dir, "%s", out);
    c->data.kind = FL_DATA_SYNTHETIC;
    /* no epoch ends within a run (8 steps x 4 ranks x 4 = 128 samples): at an epoch's end the loader's
     * last micro-batch is short (LitGPT's DataLoader), so which samples share a micro-batch after it
     * depends on the micro size, and N ranks x micro b would no longer be one process x micro N*b */
    c->data.synthetic_train = 131;
    c->data.synthetic_val = 7;
    /* the bare instruction (prompt style "default"): samples of different lengths and tokens, so every
     * micro-batch differs. (Alpaca's template cut at 48 tokens made every micro-batch the same 47
     * template tokens: a reduction that dropped or double-counted a rank's micro-batches then changed
     * only the gradient's scale, which clipping and Adam's normalization hide.) Cut at 20 tokens, the
     * samples still differ ("Add 23 and 41", "Reverse: abcd", ...). */
    snprintf(c->data.prompt_style, sizeof c->data.prompt_style, "default");
    c->train.micro_batch_size = 2 * micro_mult;
    c->train.global_batch_size = 2 * 2 * world; /* micro 2 x accumulation 2 per rank x world */
    c->train.lr_warmup_steps = 1;
    c->train.max_steps = sc == DR_ADAMW ? 8 : 5;
    c->train.save_interval = 0;
    c->train.max_seq_length = 20; /* shorter than the longest sample: T = 19 in the run and in the plan */
    c->eval.interval = 3;
    c->eval.max_iters = 3;
    c->eval.max_new_tokens = 0;
    c->eval.final_validation = 1;
    c->threads = 1;
    c->seed = 11;
    c->devices = ranks;
    snprintf(c->strategy, sizeof c->strategy, "ddp"); /* these are DDP's tests (auto: FULL_SHARD for finetune_full) */
    c->optimizer.lr = 3e-3f;
    if (sc == DR_ADAMW) c->train.max_norm = 0.5f; /* clipping on: decided from the reduced gradients */
    if (sc == DR_SGD) {
        fl_optim_config_default(&c->optimizer, FL_OPT_SGD);
        c->optimizer.lr = 0.5f; /* plain SGD: a gradient scaled by the wrong factor shows at once */
    }
    if (sc == DR_LORA) {
        c->lora.mlp = 1;
        c->lora.dropout = dropout ? 0.1f : 0.0f;
        c->optimizer.lr = 1e-2f;
    }
}

/* D: max |a - b| over the parameters (-1 when the runs do not match in size). */
static inline double dr_max_diff(const dr_rec *a, const dr_rec *b) {
    if (!a->params || !b->params || a->numel != b->numel) return -1;
    double d = 0;
    for (size_t i = 0; i < a->numel; i++) {
        double e = fabs((double)a->params[i] - b->params[i]);
        if (!(e <= d)) d = e;
    }
    return d;
}

/* Step losses of a and b within 1e-6 relative at every step (N ranks x micro b against one process
 * x micro N*b: issue #14's equivalence). Returns the worst relative difference, or 1 when a step
 * is missing. */
static inline double dr_loss_rel(const dr_rec *a, const dr_rec *b, long steps) {
    if (a->steps != steps || b->steps != steps) return 1;
    double w = 0;
    for (long s = 0; s < steps; s++) {
        double r = fabs(a->loss[s] - b->loss[s]) / fabs(b->loss[s]);
        if (!(r <= w)) w = r;
    }
    return w;
}

/* The AdamW term of the parameter bound (above): sum over steps of 2 lr kappa_t (lr at its
 * largest: the schedule only lowers it); 0 for SGD. */
static inline double dr_floor(const fl_run_config *c) {
    if (c->optimizer.kind == FL_OPT_SGD) return 0.0;
    const double b1 = c->optimizer.beta1, b2 = c->optimizer.beta2, r = b1 * b1 / b2;
    double sum = 0, geo = 0, rk = 1;
    for (long t = 1; t <= c->train.max_steps; t++) {
        geo += rk, rk *= r; /* sum_{k<t} (b1^2/b2)^k */
        double kappa = (1 - b1) * sqrt(1 - pow(b2, (double)t)) / ((1 - pow(b1, (double)t)) * sqrt(1 - b2)) * sqrt(geo);
        sum += 2 * c->optimizer.lr * kappa;
    }
    return sum;
}

/* The 16-bit reduction's factor on the noise terms (above): K micro-batches per step in one
 * process, a per rank. */
static inline double dr_round16_factor(long K, long a) { return (double)(K + a + 1) / (double)(K + a); }

/* The checks above, dctl = D of the control pair; writes the findings (or the figures when all
 * pass) to `why`. Returns the number of failures. */
static inline int dr_compare(const dr_rec *ddp, const dr_rec *ref, double dctl, double floor, long steps, char *why,
                      size_t n) {
    int bad = 0;
    size_t o = 0;
    why[0] = 0;
    if (ddp->steps != steps || ref->steps != steps || !ddp->params || !ref->params || ddp->numel != ref->numel ||
        !(dctl >= 0)) {
        snprintf(why, n, "runs incomplete: steps %ld/%ld of %ld, numel %zu/%zu, control D %g", ddp->steps, ref->steps,
                 steps, ddp->numel, ref->numel, dctl);
        return 1;
    }
    double worst_rel = 0;
    for (long s = 0; s < steps; s++) {
        double rel = fabs(ddp->loss[s] - ref->loss[s]) / fabs(ref->loss[s]);
        if (!(rel <= 1e-6)) {
            bad++;
            o += (size_t)snprintf(why + o, o < n ? n - o : 0, "step %ld loss %.9f vs %.9f (rel %.3g > 1e-6); ", s + 1,
                                  ddp->loss[s], ref->loss[s], rel);
        }
        if (rel > worst_rel) worst_rel = rel;
    }
    double d = 0, mx = 0;
    size_t at = 0;
    for (size_t i = 0; i < ref->numel; i++) {
        double e = fabs((double)ddp->params[i] - ref->params[i]);
        if (!(e <= d)) { d = e; at = i; }
        if (fabs(ref->params[i]) > mx) mx = fabs(ref->params[i]);
    }
    double ulp = ldexp(1.0, ilogb(mx > 0 ? mx : 1) - 23);
    double bound = 8 * dctl + 4 * ulp * (double)steps + floor;
    if (!(d <= bound)) {
        bad++;
        o += (size_t)snprintf(why + o, o < n ? n - o : 0,
                              "params differ by %.3g at %zu (%.9g vs %.9g) > bound %.3g (control %.3g, max |p| %.3g); ",
                              d, at, ddp->params[at], ref->params[at], bound, dctl, mx);
    }
    if (!bad) snprintf(why, n, "loss rel <= %.2g, params %.3g <= bound %.3g (control %.3g)", worst_rel, d, bound, dctl);
    return bad;
}

#endif
