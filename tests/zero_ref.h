/* ZeRO-1 / ZeRO-2 scenarios shared by tests/test_zero.c (ranks as threads, in the normal suite)
 * and tests/mpi/ddp_mpi_test.c (ranks as MPI processes); FULL_SHARD (ZeRO-3) runs the same scenarios
 * in tests/test_fsdp.c, checked with the same bounds (check 2) and zr_check_fsdp_memory (check 3).
 *
 * The runs are tests/ddp_ref.h's (the `micro` preset, 51 synthetic samples in micro-batches of 2,
 * so no world size divides the data) with three optimizers and precisions:
 *   adamw_clip       AdamW, fp32, clipping on (the norm decided from the shards under ZeRO-2);
 *   sgd_momentum     SGD with momentum 0.9 (sharded momentum buffer), fp32;
 *   bf16_true_adamw  AdamW under bf16-true (bf16 parameters, gradients and state);
 *   f16_true_adamw   AdamW under 16-true (fp16 parameters and gradients, fp32 state, dynamic loss
 *                    scaling: the overflow check and the skip decided from the reduced gradients);
 *   adamw8bit_clip   bitsandbytes' AdamW8bit with clipping: block-wise state per tensor (blocks of
 *                    256 from each tensor's start, tensors under 4096 elements fp32). A rank keeps
 *                    the blocks that meet its chunk whole, so every block is quantized over the
 *                    same elements as in one process (a block cut by a chunk edge is kept and
 *                    updated alike by both neighbours; ZeRO-2 fetches the neighbours' reduced
 *                    gradients of such blocks: 255 elements from each).
 * micro has 260032 parameters: 3 ranks split them 86678 / 86677 / 86677 (an odd split; the first
 * rank holds one element more).
 *
 * The checks, from independent anchors:
 *   1. ZeRO-1 and ZeRO-2 at N ranks give the same parameters and step losses BIT FOR BIT as DDP at
 *      N ranks (why: src/train/zero.c; the reduced gradient, the clipping norm and the elementwise
 *      update are the same arithmetic, the all-gather copies bits), and every rank ends with the
 *      same bits;
 *   2. against one process training the same global batch: ddp_ref.h's derived bounds (loss at
 *      every step within 1e-6 relative, parameters within 8 D + 4 ulp x steps + the AdamW term).
 *      bf16-true and 16-true store every gradient sum and every update in 16 bits, so a different
 *      grouping moves parameters by 16-bit ulps and the loss by more than 1e-6 from step 2 on: there
 *      the same derivation is applied to the loss too: 8 x the control's largest loss difference
 *      over the run (one realisation of the reassociation noise, like D; per step it fluctuates and
 *      can be near 0 by chance), at least 1e-6 relative; the dtype's ulp (bf16 2^-7, fp16 2^-10
 *      relative) in the parameter bound; and both noise terms scaled by dr_round16_factor for the
 *      reduction's own rounding to 16 bits (ddp_ref.h derives it);
 *      8-bit AdamW has no derived parameter bound (quantizing m and v breaks the Cauchy-Schwarz
 *      argument: a value quantized to 0 can make one update arbitrarily large), so its check against
 *      one process is the loss at every step (1e-6 relative) and, above all, check 1;
 *   3. memory: rank r's OPTIM is the state of its chunk exactly (the ranks' OPTIM add up to DDP's
 *      OPTIM, byte for byte; 8-bit: recomputed here from the layout, the chunk and bitsandbytes'
 *      byte counts), ZeRO-2's live GRADS after the reduction is its chunk (8-bit: + 255 elements
 *      per neighbour), and the plan for rank r (fitllm plan --devices N --strategy ... --rank r)
 *      equals what rank r measured.
 */
#ifndef FL_TESTS_ZERO_REF_H
#define FL_TESTS_ZERO_REF_H

#include <stdint.h>

#include "ddp_ref.h"
#include "fitllm/comm.h"
#include "fitllm/plan.h"

/* ddp_ref.h's helpers that only some includers use */
static inline void zr_unused_(void) {
    (void)dr_loss_rel;
    (void)dr_record;
}

enum { ZR_ADAMW = 0, ZR_SGDM, ZR_BF16, ZR_ADAMW8, ZR_F16, ZR_COUNT };
static const char *const zr_names[ZR_COUNT] = {"adamw_clip", "sgd_momentum", "bf16_true_adamw", "adamw8bit_clip",
                                               "f16_true_adamw"};

typedef struct {
    double loss[DR_MAX_STEPS];
    unsigned char *bytes; /* the trained parameters' raw bytes after the last step */
    size_t nbytes;
    long steps;
} zr_rec;

static int zr_record(void *ud, long step, double loss, const void *params, size_t bytes) {
    zr_rec *r = ud;
    if (step <= DR_MAX_STEPS) r->loss[step - 1] = loss;
    r->steps = step;
    free(r->bytes);
    r->bytes = malloc(bytes + 4);
    if (r->bytes) memcpy(r->bytes, params, bytes);
    r->nbytes = bytes;
    return 0;
}

static void zr_free(zr_rec *r) {
    free(r->bytes);
    memset(r, 0, sizeof *r);
}

/* Same bits (parameters and every step loss). */
static int zr_same(const zr_rec *a, const zr_rec *b) {
    return a->bytes && b->bytes && a->nbytes == b->nbytes && a->steps == b->steps &&
           !memcmp(a->bytes, b->bytes, a->nbytes) && !memcmp(a->loss, b->loss, sizeof a->loss);
}

/* strategy "ddp", "deepspeed_stage_1", "deepspeed_stage_2" or "fsdp" (+ sharding). */
static void zr_config(fl_run_config *c, int sc, int world, int ranks, int micro_mult, const char *strategy,
                      const char *sharding, const char *out) {
    dr_config(c, sc == ZR_SGDM ? DR_SGD : DR_ADAMW, world, ranks, micro_mult, 0, out);
    if (sc == ZR_SGDM) {
        c->optimizer.momentum = 0.9f; /* a momentum buffer: state to shard */
        c->optimizer.lr = 0.1f;
    }
    if (sc == ZR_BF16) snprintf(c->precision, sizeof c->precision, "bf16-true");
    if (sc == ZR_F16) snprintf(c->precision, sizeof c->precision, "16-true");
    if (sc == ZR_ADAMW8) { /* bitsandbytes' AdamW8bit: blocks of 256 per tensor, small tensors fp32 */
        float lr = c->optimizer.lr;
        fl_optim_config_default(&c->optimizer, FL_OPT_ADAMW8BIT);
        c->optimizer.lr = lr;
    }
    snprintf(c->strategy, sizeof c->strategy, "%s", strategy);
    snprintf(c->sharding_strategy, sizeof c->sharding_strategy, "%s", sharding ? sharding : "");
    c->hook_whole_params = 1; /* FULL_SHARD: the records compare whole parameters */
}

/* The storage dtype of the trained parameters (and gradients) under c's precision. */
static fl_dtype zr_store_dtype(const fl_run_config *c) {
    return !strcmp(c->precision, "bf16-true") ? FL_BF16 : !strcmp(c->precision, "16-true") ? FL_F16 : FL_F32;
}

/* A dr_rec view (fp32 values) of r (parameters of dtype dt), for ddp_ref.h's comparisons. */
static dr_rec zr_as_dr(const zr_rec *r, fl_dtype dt) {
    dr_rec d;
    memset(&d, 0, sizeof d);
    memcpy(d.loss, r->loss, sizeof d.loss);
    d.steps = r->steps;
    d.numel = r->nbytes / fl_dtype_size(dt);
    d.params = malloc(d.numel * sizeof(float) + 4);
    if (!d.params || !r->bytes) return d;
    for (size_t i = 0; i < d.numel; i++) {
        if (dt != FL_F32) {
            uint16_t h;
            memcpy(&h, r->bytes + 2 * i, 2);
            d.params[i] = dt == FL_BF16 ? fl_bf16_to_f32(h) : fl_f16_to_f32(h);
        } else {
            memcpy(&d.params[i], r->bytes + 4 * i, 4);
        }
    }
    return d;
}

/* Check 2 above. Returns the number of failures; `why` gets the findings or the figures. */
static int zr_compare_one_process(const zr_rec *z, const zr_rec *ref, const zr_rec *ctl, const fl_run_config *c,
                                  char *why, size_t n) {
    fl_dtype sd = zr_store_dtype(c);
    long steps = c->train.max_steps;
    dr_rec a = zr_as_dr(z, sd), b = zr_as_dr(ref, sd), k = zr_as_dr(ctl, sd);
    int bad;
    if (c->optimizer.kind == FL_OPT_ADAMW8BIT) { /* no parameter bound (above): the loss */
        double lr = dr_loss_rel(&a, &b, steps);
        bad = !(lr <= 1e-6);
        snprintf(why, n, "loss rel %.2g %s 1e-6 (params differ by %.3g, the control by %.3g: no derived bound for "
                 "8-bit)", lr, bad ? ">" : "<=", dr_max_diff(&a, &b), dr_max_diff(&b, &k));
    } else if (sd == FL_F32) {
        bad = dr_compare(&a, &b, dr_max_diff(&b, &k), dr_floor(c), steps, why, n);
    } else {
        bad = 0;
        size_t o = 0;
        why[0] = 0;
        /* the reduction's rounding to 16 bits: K micro-batches per step in one process, a per rank */
        long K = c->train.global_batch_size / c->train.micro_batch_size, ranks = (long)c->devices * c->num_nodes;
        double f16r = dr_round16_factor(K, K / (ranks > 0 ? ranks : 1));
        double worst = 0, lctl = 0; /* the control's loss noise over the run (as D is over the parameters) */
        for (long s = 0; s < steps && s < DR_MAX_STEPS; s++) lctl = fmax(lctl, fabs(ctl->loss[s] - ref->loss[s]));
        for (long s = 0; s < steps && s < DR_MAX_STEPS; s++) {
            double tol = fmax(1e-6 * fabs(ref->loss[s]), 8 * f16r * lctl);
            double d = fabs(z->loss[s] - ref->loss[s]);
            if (!(d <= tol)) {
                bad++;
                o += (size_t)snprintf(why + o, o < n ? n - o : 0, "step %ld loss %.9f vs %.9f (> %.3g); ", s + 1,
                                      z->loss[s], ref->loss[s], tol);
            }
            if (d / fabs(ref->loss[s]) > worst) worst = d / fabs(ref->loss[s]);
        }
        double dctl = dr_max_diff(&b, &k), d = dr_max_diff(&a, &b), mx = 0;
        for (size_t i = 0; i < b.numel; i++) mx = fmax(mx, fabs(b.params[i]));
        /* bf16: 8 significant bits, fp16: 11 */
        double ulp = ldexp(1.0, ilogb(mx > 0 ? mx : 1) - (sd == FL_BF16 ? 7 : 10));
        double bound = 8 * f16r * dctl + 4 * ulp * (double)steps + dr_floor(c);
        if (!(dctl >= 0) || !(d <= bound)) {
            bad++;
            o += (size_t)snprintf(why + o, o < n ? n - o : 0, "params differ by %.3g > bound %.3g (control %.3g); ",
                                  d, bound, dctl);
        }
        if (!bad) snprintf(why, n, "loss rel <= %.2g (%s control bound), params %.3g <= bound %.3g (control %.3g)",
                           worst, fl_dtype_name(sd), d, bound, dctl);
    }
    dr_free(&a);
    dr_free(&b);
    dr_free(&k);
    return bad;
}

/* 8-bit AdamW state bytes of rank r on the micro preset, from the definitions (not the runtime's
 * helpers): per tensor of the layout, its elements inside r's chunk widened to whole blocks of 256
 * (8-bit tensors: >= 4096 elements), q_m and q_v one byte each padded to 4, two fp32 absmax per
 * block; smaller tensors fp32 m and v. 0 when the layout cannot be built. */
/* only some includers compare against one process (tests/test_offload.c compares against the device optimizer) */
static inline void zr_unused2_(void) { (void)zr_compare_one_process; }

static size_t zr_optim8_bytes(size_t n, int world, int rank) {
    fl_model_config mc;
    fl_param_layout lay;
    if (fl_preset_find("micro", &mc) != FL_OK || fl_layout_build(&lay, &mc) != FL_OK) return 0;
    size_t off, len, total = 0;
    fl_comm_chunk(n, world, rank, &off, &len);
    for (int i = 0; i < lay.n; i++) {
        size_t t0 = lay.params[i].offset, tn = lay.params[i].numel;
        size_t lo = off > t0 ? off : t0, hi = off + len < t0 + tn ? off + len : t0 + tn;
        if (lo >= hi) continue;
        if (tn < 4096) {
            total += 8 * (hi - lo);
            continue;
        }
        size_t b0 = (lo - t0) / 256, b1 = (hi - t0 + 255) / 256; /* blocks [b0, b1) */
        size_t e = (b1 * 256 < tn ? b1 * 256 : tn) - b0 * 256;
        total += (2 * e + 3) / 4 * 4 + 8 * (b1 - b0);
    }
    fl_layout_free(&lay);
    return total;
}

static int zr_check_plan(const fl_run_config *cfg, int rank, const fl_trainer_result *res, int exact_peaks, char *why,
                         size_t wn, size_t o);

/* Check 3 for rank r of a ZeRO run: res = what it measured, ddp_optim = DDP's OPTIM bytes (the
 * whole state), trainable elements n. exact_peaks: also the WORKSPACE and total peaks (the plan
 * counts the MPI reduction's scratch, which the threads implementation does not take). */
static inline int zr_check_memory(const fl_run_config *cfg, int rank, int world, const fl_trainer_result *res,
                           size_t state_bytes_whole, size_t n, int exact_peaks, char *why, size_t wn) {
    int bad = 0;
    size_t o = 0;
    why[0] = 0;
    size_t off, len;
    fl_comm_chunk(n, world, rank, &off, &len);
    /* OPTIM: the chunk's share of the whole state, exactly (state is per element); 8-bit: per tensor,
     * the blocks meeting the chunk (bitsandbytes' bytes: 2 per element padded to 4, + 8 per block of
     * 256; tensors under 4096 elements 8 per element) */
    int e8 = cfg->optimizer.kind == FL_OPT_ADAMW8BIT;
    size_t want = e8 ? zr_optim8_bytes(n, world, rank) : (size_t)((unsigned long long)state_bytes_whole / n * len);
    if (res->peak[FL_TAG_OPTIM] != want || (!e8 && state_bytes_whole % n)) {
        bad++;
        o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d OPTIM %zu, want %zu (%zu of %zu elements); ", rank,
                              res->peak[FL_TAG_OPTIM], want, len, n);
    }
    int stage = 0;
    fl_cfg_zero_stage(cfg->strategy, cfg->sharding_strategy, &stage);
    size_t ges = fl_dtype_size(zr_store_dtype(cfg));
    for (int i = 0; i < res->n_phases; i++)
        if (!strcmp(res->phases[i].name, "after_reduce")) {
            size_t halo = e8 && stage == 2 ? (size_t)255 * ((rank > 0) + (rank < world - 1)) : 0;
            size_t live = res->phases[i].live[FL_TAG_GRADS], w2 = stage == 2 ? (len + halo) * ges : n * ges;
            if (live != w2) {
                bad++;
                o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d live GRADS after the reduction %zu, want "
                                      "%zu; ", rank, live, w2);
            }
        }
    return bad + zr_check_plan(cfg, rank, res, exact_peaks, why, wn, o);
}

/* The plan for rank r (fitllm plan --devices N --strategy ... --rank r) against what rank r
 * measured: every tag's peak (exact_peaks: WORKSPACE and the total too), every phase's reserved
 * bytes and the live bytes of the tags that do not depend on a micro-batch's shape. Findings are
 * appended to why at offset o. Returns the number of failures. */
static int zr_check_plan(const fl_run_config *cfg, int rank, const fl_trainer_result *res, int exact_peaks, char *why,
                         size_t wn, size_t o) {
    int bad = 0;
    fl_plan *pl = calloc(1, sizeof *pl);
    fl_plan_opts po;
    fl_plan_opts_default(&po);
    po.no_suggestions = 1;
    po.generation = 0;
    po.rank = rank;
    if (!pl || fl_plan_run(cfg, &po, pl) != FL_OK) {
        free(pl);
        snprintf(why + o, wn > o ? wn - o : 0, "plan failed: %s", fl_error_message());
        return bad + 1;
    }
    for (int k = 0; k < FL_TAG_COUNT; k++)
        if ((exact_peaks || k != FL_TAG_WORKSPACE) && pl->peak[k] != res->peak[k]) {
            bad++;
            o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d tag %s planned peak %zu, measured %zu; ", rank,
                                  fl_mem_tag_name((fl_mem_tag)k), pl->peak[k], res->peak[k]);
        }
    if (exact_peaks && pl->peak_total != res->peak_total) {
        bad++;
        o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d planned peak %zu, measured %zu; ", rank,
                              pl->peak_total, res->peak_total);
    }
    /* CPU offload: the host tier (the optimizer state and the update's staging) to the byte */
    int host_ok = pl->offload == res->offload && pl->host_peak_total == res->host_peak_total &&
                  pl->nvme == res->nvme && pl->nvme_peak_total == res->nvme_peak_total;
    for (int k = 0; k < FL_TAG_COUNT; k++) host_ok &= pl->host_peak[k] == res->host_peak[k];
    for (int k = 0; k < FL_TAG_COUNT; k++) host_ok &= pl->nvme_peak[k] == res->nvme_peak[k];
    if (!host_ok) {
        bad++;
        o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d host/nvme tier: planned %s %zu (OPTIM %zu), measured "
                              "%s %zu (OPTIM %zu); ", rank, pl->offload ? "offload" : "none", pl->host_peak_total,
                              pl->host_peak[FL_TAG_OPTIM], res->offload ? "offload" : "none", res->host_peak_total,
                              res->host_peak[FL_TAG_OPTIM]);
    }
    if (pl->n_phases != res->n_phases) {
        bad++;
        o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d: %d planned phases, %d measured; ", rank,
                              pl->n_phases, res->n_phases);
    }
    for (int i = 0; i < pl->n_phases && i < res->n_phases; i++) {
        const fl_mem_phase *a = &pl->phases[i], *b = &res->phases[i];
        /* live ACTS and WORKSPACE depend on the micro-batch's shape (a rank's last micro-batch may
         * hold one sample where the plan has two); reserved bytes and the other tags do not */
        int live_ok = 1;
        for (int t = 0; t < FL_TAG_COUNT; t++)
            if (t != FL_TAG_ACTS && t != FL_TAG_WORKSPACE && a->live[t] != b->live[t]) live_ok = 0;
        if (strcmp(a->name, b->name) || memcmp(a->cur, b->cur, sizeof a->cur) || !live_ok ||
            (exact_peaks && a->peak_total != b->peak_total)) {
            bad++;
            o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d phase %s/%s differs from the plan; ", rank,
                                  a->name, b->name);
        }
    }
    free(pl);
    return bad;
}

/* The model a scenario trains (the micro preset, or pretrain's model_name / model_config). */
static int zr_model_config(const fl_run_config *cfg, fl_model_config *mc) {
    int have = 0;
    if (cfg->command == FL_CMD_PRETRAIN) return fl_cfg_model_config(cfg, mc, &have) == FL_OK && have;
    return fl_preset_find(cfg->checkpoint_dir, mc) == FL_OK;
}

/* FULL_SHARD (ZeRO-3): the elements of rank r's shard, from the definition: every layout group
 * (unit) split by fl_comm's chunk layout on its own, rank r's piece of each; *n the whole count. */
static size_t zr_fsdp_shard(const fl_model_config *mc, int world, int rank, size_t *n) {
    fl_param_layout lay;
    if (fl_layout_build(&lay, mc) != FL_OK) return 0;
    size_t total = 0;
    for (int g = 0; g < lay.n_groups; g++) {
        size_t u = lay.group_offset[g + 1] - lay.group_offset[g];
        total += u / (size_t)world + ((size_t)rank < u % (size_t)world);
    }
    *n = lay.numel;
    fl_layout_free(&lay);
    return total;
}

/* FULL_SHARD with 8-bit AdamW, from the definitions (not the runtime's helpers): rank r's OPTIM
 * bytes. Each tensor's elements in r's piece of its unit (not widened to blocks): 8-bit tensors
 * (>= 4096 elements) q_m and q_v one byte each padded to 4, two fp32 absmax per block of 256 (from
 * the tensor's start) the piece meets; smaller tensors fp32 m and v. When a rank edge falls strictly
 * inside a block of an 8-bit tensor (*cut: such blocks of the whole model), the exchange: two fp32
 * per cut block and a copy of one cut part (256 x (4 + 2) bytes and two fp32), src/train/optim.c. */
static size_t zr_fsdp_optim8(const fl_model_config *mc, int world, int rank, size_t *cut) {
    fl_param_layout lay;
    *cut = 0;
    if (fl_layout_build(&lay, mc) != FL_OK) return 0;
    size_t total = 0;
    for (int g = 0; g < lay.n_groups; g++) {
        size_t u0 = lay.group_offset[g], u = lay.group_offset[g + 1] - u0;
        size_t last_t = SIZE_MAX, last_b = SIZE_MAX;
        for (int e = 0; e < world; e++) { /* the pieces [off_e, off_e + len_e) of the unit */
            size_t len = u / (size_t)world + ((size_t)e < u % (size_t)world), off = 0;
            for (int q = 0; q < e; q++) off += u / (size_t)world + ((size_t)q < u % (size_t)world);
            for (int i = 0; i < lay.n; i++) {
                size_t t0 = lay.params[i].offset - u0, tn = lay.params[i].numel;
                if (lay.params[i].group != g) continue;
                if (e > 0 && tn >= 4096 && off > t0 && off < t0 + tn && (off - t0) % 256 && /* a cut block */
                    !((size_t)i == last_t && (off - t0) / 256 == last_b)) {
                    (*cut)++;
                    last_t = (size_t)i, last_b = (off - t0) / 256;
                }
                if (e != rank) continue;
                size_t lo = off > t0 ? off : t0, hi = off + len < t0 + tn ? off + len : t0 + tn;
                if (lo >= hi) continue;
                if (tn < 4096) total += 8 * (hi - lo);
                else total += (2 * (hi - lo) + 3) / 4 * 4 + 8 * ((hi - t0 + 255) / 256 - (lo - t0) / 256);
            }
        }
    }
    fl_layout_free(&lay);
    return total + (*cut ? 8 * *cut + 256 * 6 + 8 : 0);
}

/* What FULL_SHARD may hold gathered at once, from its rules (not from the runtime's sequence): the
 * parameters of at most 2 blocks (limit_all_gathers), of the head group and of the embeddings
 * (elements of es bytes, plus ces for a mixed policy's compute copy), the unreduced gradients of one
 * block, the head group and the embeddings (es), and one reduced piece. */
static size_t zr_fsdp_gather_bound(const fl_model_config *mc, int world, size_t es, size_t ces) {
    fl_param_layout lay;
    if (fl_layout_build(&lay, mc) != FL_OK) return 0;
    size_t ub = 0, ue = lay.group_offset[1], uh = lay.numel - lay.group_offset[lay.n_groups - 1];
    for (int g = 1; g + 1 < lay.n_groups; g++)
        if (lay.group_offset[g + 1] - lay.group_offset[g] > ub) ub = lay.group_offset[g + 1] - lay.group_offset[g];
    fl_layout_free(&lay);
    size_t umax = ub > ue ? ub : ue;
    umax = umax > uh ? umax : uh;
    return (2 * ub + uh + ue) * (es + ces) + (ub + uh + ue) * es + (umax / (size_t)world + 1) * es;
}

/* Check 3 for rank r of a FULL_SHARD run (res: what it measured). After the step (after_opt_step)
 * PARAMS and GRADS hold exactly rank r's shard, OPTIM its state (per element: AdamW 2 states, SGD
 * with momentum 1, of 4 bytes, 2 under bf16-true; 16-true keeps fp32 state), GATHER is empty; its peak is above 0 and below the
 * bound of zr_fsdp_gather_bound (at most 2 blocks gathered); and the plan equals the measurement. */
static inline int zr_check_fsdp_memory(const fl_run_config *cfg, int rank, int world, const fl_trainer_result *res,
                                int exact_peaks, char *why, size_t wn) {
    int bad = 0;
    size_t o = 0, n = 0;
    why[0] = 0;
    fl_model_config mc;
    /* HYBRID_SHARD across nodes: FULL_SHARD within the node of --devices ranks (local rank = rank % devices) */
    int hybrid = cfg->num_nodes > 1 && fl_cfg_hybrid_shard(cfg->strategy, cfg->sharding_strategy);
    const int sw = hybrid ? cfg->devices : world, sr = hybrid ? rank % cfg->devices : rank;
    size_t sh = zr_model_config(cfg, &mc) ? zr_fsdp_shard(&mc, sw, sr, &n) : 0;
    size_t es = fl_dtype_size(zr_store_dtype(cfg)), ses = !strcmp(cfg->precision, "bf16-true") ? 2 : 4;
    size_t states = cfg->optimizer.kind == FL_OPT_ADAMW ? 2 : cfg->optimizer.momentum != 0.0f ? 1 : 0;
    const fl_mem_phase *ph = NULL;
    for (int i = 0; i < res->n_phases; i++)
        if (!strcmp(res->phases[i].name, "after_opt_step")) ph = &res->phases[i];
    size_t optim = sh * states * ses, cut = 0;
    if (sh && cfg->optimizer.kind == FL_OPT_ADAMW8BIT) optim = zr_fsdp_optim8(&mc, sw, sr, &cut);
    if (!ph || !sh || ph->cur[FL_TAG_PARAMS] != sh * es || ph->cur[FL_TAG_GRADS] != sh * es ||
        ph->cur[FL_TAG_OPTIM] != optim || ph->cur[FL_TAG_GATHER] != 0) {
        bad++;
        o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d after the step: PARAMS %zu GRADS %zu OPTIM %zu "
                              "GATHER %zu, want %zu %zu %zu 0 (shard of %zu of %zu elements); ", rank,
                              ph ? ph->cur[FL_TAG_PARAMS] : 0, ph ? ph->cur[FL_TAG_GRADS] : 0,
                              ph ? ph->cur[FL_TAG_OPTIM] : 0, ph ? ph->cur[FL_TAG_GATHER] : 0, sh * es, sh * es, optim,
                              sh, n);
    }
    size_t gb = sh ? zr_fsdp_gather_bound(&mc, sw, es, !strcmp(cfg->precision, "bf16-mixed") ? 2 : 0) : 0;
    if (!(res->peak[FL_TAG_GATHER] > 0 && res->peak[FL_TAG_GATHER] <= gb)) {
        bad++;
        o += (size_t)snprintf(why + o, wn > o ? wn - o : 0, "rank %d GATHER peak %zu not in (0, %zu]; ", rank,
                              res->peak[FL_TAG_GATHER], gb);
    }
    return bad + zr_check_plan(cfg, rank, res, exact_peaks, why, wn, o);
}

#endif
