/* ZeRO-1, ZeRO-2 and FSDP (FULL_SHARD, HYBRID_SHARD) on device memory, "as CUDA" on the CPU: 2 (HYBRID:
 * 4) ranks as threads on the "cuda-emu" backend, whose parameters, gradients and gathered units travel
 * through the NCCL communicator (src/comm/comm_nccl.c) over the CPU stand-in of the NCCL calls, and
 * whose checkpoints stream through the backend's to_host.
 *
 * Anchors (tests/zero_ref.h, tests/test_zero.c, tests/test_fsdp.c): at accumulation 1 without clipping
 * DDP, ZeRO-1, ZeRO-2 and FULL_SHARD give the same parameters bit for bit (the reduced gradient of
 * every element is the same rank-order sum, the updates are elementwise, the gathers copy bits), and
 * the NCCL stand-in reduces in rank order with fl_comm's kernel, so routing the device buffers
 * through the NCCL code must not change a bit. So every run here must give, on every rank, the bits
 * of DDP over the host (threads) communicator on the same backend (fl_cuemu_use_nccl(0): the run has
 * no device communicator, the pre-existing path), and the stand-in must have carried its collectives.
 * Consolidated checkpoints are in the single-process format at every stage: DDP's bytes. cuda-emu's
 * GEMMs are not the cpu backend's bits (test_cuda_model.c bounds them), so the comparisons stay on
 * cuda-emu. Small on purpose (the emulator runs ~1000x slower than the CPU ops): gpt2-micro, 8
 * tokens, 1 sample per rank, 2 steps. On a GPU NCCL's sums at 2 ranks are one rounding (the same
 * bits, comm_nccl.h); tests/cuda/nccl_check.sh runs the real thing under mpirun on 2 GPUs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/comm.h"
#include "fitllm/comm_nccl.h"
#include "test.h"
#include "zero_ref.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cuda-impl.h"
#else
static void fl_cuemu_use_nccl(int on) { (void)on; } /* no cuda-emu: the opaque runs only */
#endif

#define SN_MAX_RANKS 4

typedef struct {
    fl_run_config cfg;
    zr_rec rec[SN_MAX_RANKS];
    fl_status st[SN_MAX_RANKS];
    fl_trainer_result res[SN_MAX_RANKS];
    char msg[SN_MAX_RANKS][700];
    unsigned long calls; /* collectives the NCCL stand-in accepted during the run */
    int world;
    const char *backend; /* "cuda-emu" (default), "opaque" or "cpu" */
} sjob;

static inline void sn_unused_(void) { (void)zr_compare_one_process; } /* zero_ref.h's, unused here */

static double sn_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static fl_status sj_rank(fl_comm *c, int rank, void *ud) {
    sjob *j = ud;
    j->st[rank] = fl_trainer_run_comm(&j->cfg, c, NULL, 0, zr_record, &j->rec[rank], &j->res[rank]);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", j->st[rank] != FL_OK ? fl_error_message() : "");
    if (j->st[rank] != FL_OK && getenv("FL_TEST_VERBOSE")) fprintf(stderr, "    rank %d failed: %s\n", rank, j->msg[rank]);
    return j->st[rank];
}

/* zero_ref.h's scenario cut down for the emulator: accumulation 1 (1 sample of 8 tokens per rank), 2
 * steps (the optimizer state carries into the second), no clipping (the norm is computed over the
 * ranks' pieces but does not clip: FULL_SHARD's partition of the norm differs from ZeRO's in the last
 * bits, and clipping would hide a wrongly scaled gradient). */
static void cfg_small(fl_run_config *c, int sc, int world, const char *strategy, const char *sharding,
                      const char *tag) {
    char out[700];
    snprintf(out, sizeof out, "%s/snccl-%s-%s", fl_test_tmpdir(), zr_names[sc], tag);
    zr_config(c, sc, world, world, 1, strategy, sharding, out);
    c->train.micro_batch_size = 1;
    c->train.global_batch_size = world;
    c->train.max_steps = 2;
    c->train.save_interval = 1; /* consolidated checkpoints after steps 1 and 2 */
    c->train.lr_warmup_steps = 0;
    c->train.max_seq_length = 8;
    c->train.max_norm = 1e4f;
    c->eval.interval = 100;
    c->eval.final_validation = 0;
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "gpt2-micro"); /* 2 layers: fewer emulated launches */
}

/* Run j->cfg on j->world thread ranks of cuda-emu; use_nccl 0: the host communicator takes the
 * backend's buffers directly (no device communicator). */
static int g_sn_staged; /* opaque's device communicator is the staged one (fl_opaque_use_comm(2)) */
static unsigned long sn_calls(void) { return g_sn_staged ? fl_comm_staged_calls() : fl_nccl_standin_calls(); }
static fl_status sj_run(sjob *j, int use_nccl) {
    setenv("FITLLM_BACKEND", j->backend ? j->backend : "cuda-emu", 1);
    fl_cuemu_use_nccl(use_nccl);
    fl_opaque_use_comm(g_sn_staged ? 2 : 1);
    unsigned long c0 = sn_calls();
    double t0 = sn_now_ms();
    fl_status s = fl_comm_threads_run(j->world, sj_rank, j);
    if (getenv("FL_TEST_VERBOSE")) printf("    [%s: %.0f ms]\n", j->cfg.out_dir, sn_now_ms() - t0);
    j->calls = sn_calls() - c0;
    fl_cuemu_use_nccl(1);
    fl_opaque_use_comm(1);
    unsetenv("FITLLM_BACKEND");
    return s;
}

static sjob *sj_new(int sc, int world, const char *strategy, const char *sharding, const char *tag) {
    sjob *j = calloc(1, sizeof *j);
    if (!j) abort(); /* FL_REQUIRE returns no value */
    j->world = world;
    cfg_small(&j->cfg, sc, world, strategy, sharding, tag);
    return j;
}

static void sj_free(sjob *j) {
    if (!j) return;
    for (int r = 0; r < SN_MAX_RANKS; r++) zr_free(&j->rec[r]);
    free(j);
}

/* Every rank of j holds rank 0's bits, and rank 0 the reference's. */
static void check_bits(const sjob *j, const sjob *ref, const char *what) {
    for (int r = 1; r < j->world; r++)
        FL_CHECKF(zr_same(&j->rec[r], &j->rec[0]), "%s: rank %d's parameters or losses differ from rank 0's", what, r);
    FL_CHECKF(j->rec[0].steps == j->cfg.train.max_steps && zr_same(&j->rec[0], &ref->rec[0]),
              "%s: parameters or losses differ in bits from DDP over the host communicator (steps %ld; loss %.9g vs "
              "%.9g)", what, j->rec[0].steps, j->rec[0].loss[0], ref->rec[0].loss[0]);
}

/* Whether `file` of checkpoint folder `step` holds the same tensor data under both runs (the headers
 * differ: the training state's records the wall time). */
static int same_ckpt_data(const sjob *a, const sjob *b, const char *step, const char *file) {
    char pa[4200], pb[4200];
    snprintf(pa, sizeof pa, "%s/%s/%s", a->cfg.out_dir, step, file);
    snprintf(pb, sizeof pb, "%s/%s/%s", b->cfg.out_dir, step, file);
    size_t la = 0, lb = 0;
    unsigned char *da = fl_test_st_data(pa, &la), *db = fl_test_st_data(pb, &lb);
    int same = da && db && la == lb && !memcmp(da, db, la);
    free(da);
    free(db);
    return same;
}

/* Both checkpoints of j (steps 1 and 2, consolidated: the single-process format) hold ref's tensor data. */
static void check_ckpts(const sjob *j, const sjob *ref, const char *what) {
    static const char *steps[2] = {"step-000001", "step-000002"};
    static const char *files[2] = {"model.safetensors", "training_state.safetensors"};
    for (int k = 0; k < 2; k++)
        for (int f = 0; f < 2; f++)
            FL_CHECKF(same_ckpt_data(j, ref, steps[k], files[f]), "%s: %s/%s differs from DDP's (host communicator)",
                      what, steps[k], files[f]);
}

/* j's run resumed from its step-1 checkpoint (step 2 again) ends on ref's bits. */
static void check_resume(const sjob *j, const sjob *ref, const char *what) {
    sjob *r = calloc(1, sizeof *r);
    FL_REQUIRE(r != NULL);
    r->world = j->world;
    r->backend = j->backend;
    r->cfg = j->cfg;
    r->cfg.train.save_interval = 0;
    FL_REQUIRE(snprintf(r->cfg.resume, sizeof r->cfg.resume, "%s/step-000001", j->cfg.out_dir) <
                   (int)sizeof r->cfg.resume &&
               snprintf(r->cfg.out_dir, sizeof r->cfg.out_dir, "%s-resumed", j->cfg.out_dir) < (int)sizeof r->cfg.out_dir);
    FL_CHECKF(sj_run(r, 1) == FL_OK, "%s resumed: %s", what, r->msg[0]);
    for (int q = 0; r->st[0] == FL_OK && q < r->world; q++)
        FL_CHECKF(r->rec[q].steps == 2 && r->rec[q].bytes && r->rec[q].nbytes == ref->rec[0].nbytes &&
                      !memcmp(r->rec[q].bytes, ref->rec[0].bytes, ref->rec[0].nbytes) &&
                      r->rec[q].loss[1] == ref->rec[0].loss[1],
                  "%s resumed from step 1: rank %d's step-2 loss or parameters differ in bits from the uninterrupted "
                  "run's", what, q);
    sj_free(r);
}

/* ZeRO-1, ZeRO-2 and FULL_SHARD through the NCCL stand-in = DDP over the host communicator, bit for
 * bit (parameters, losses and both consolidated checkpoints' tensors; on cuda-emu, slow, ZeRO-1 in
 * 32-true only and the resumes of FULL_SHARD only; on opaque ZeRO-2 and FULL_SHARD also saving sharded
 * checkpoints, resumed), in 32-true and bf16-true
 * (AdamW: two state buffers) or with AdamW8bit (FULL_SHARD: blocks cut by a rank edge exchange their
 * new scales, which the kernels take as floors from device memory: optim.c fsdp8_step);
 * FULL_SHARD over the host communicator on the same backend too (32-true); ZeRO-2 and FULL_SHARD
 * resumed from their step-1 checkpoints end on the same bits. The stand-in carried, per rank, at
 * least: ZeRO, the parameters' broadcast and per step a reduction and the parameters' all-gather;
 * FULL_SHARD, per step every unit (4 on gpt2-micro) gathered in forward and reduce-scattered, and each
 * block (2) gathered again in backward. */
static void stages(int sc, const char *backend) {
    static const char *strat[3][2] = {{"deepspeed_stage_1", NULL}, {"deepspeed_stage_2", NULL}, {"fsdp", "FULL_SHARD"}};
    static const char *tags[3] = {"zero1", "zero2", "fsdp"};
    const int opaque = !strcmp(backend, "opaque");
    char tag[64];
    snprintf(tag, sizeof tag, "ddp-host-%s", backend);
    sjob *ref = sj_new(sc, 2, "ddp", NULL, tag);
    ref->backend = opaque ? "cpu" : backend; /* opaque runs the CPU kernels: the cpu backend's bits */
    FL_CHECKF(sj_run(ref, 0) == FL_OK && ref->calls == 0, "%s DDP host: %s (%lu stand-in calls)", zr_names[sc],
              ref->msg[0], ref->calls);
    for (int k = 0; k < 3 && ref->st[0] == FL_OK; k++) {
        if (!opaque && k == 0 && sc != ZR_ADAMW) continue; /* the emulator is slow: ZeRO-1 in 32-true only there */
        snprintf(tag, sizeof tag, "%s-%s", tags[k], backend);
        sjob *j = sj_new(sc, 2, strat[k][0], strat[k][1], tag);
        j->backend = backend;
        char what[128];
        snprintf(what, sizeof what, "%s %s on %s (%s)", zr_names[sc], tags[k], backend, g_sn_staged ? "staged communicator" : "NCCL stand-in");
        FL_CHECKF(sj_run(j, 1) == FL_OK, "%s: %s", what, j->msg[0]);
        if (j->st[0] == FL_OK) {
            check_bits(j, ref, what);
            check_ckpts(j, ref, what);
            /* resumes: ZeRO-2 and FULL_SHARD on opaque, FULL_SHARD (32-true, 8-bit) on the slow emulator */
            if (opaque ? k > 0 : k == 2 && sc != ZR_BF16) check_resume(j, ref, what);
        }
        const unsigned long steps = (unsigned long)j->cfg.train.max_steps, want = k < 2 ? 2 * (1 + 2 * steps)
                                                                                    : 2 * steps * (2 * 4 + 2);
        FL_CHECKF(j->calls >= want, "%s: only %lu collectives went through the stand-in (want >= %lu)", what, j->calls,
                  want);
        if (getenv("FL_TEST_VERBOSE")) printf("    %s: %lu device-communicator collectives, DDP's bits\n", what, j->calls);
        sj_free(j);
        if (opaque && k > 0 && sc != ZR_BF16) { /* sharded checkpoints (shard_ckpt.c: each rank its ranges) */
            snprintf(tag, sizeof tag, "%s-%s-sharded", tags[k], backend);
            sjob *h = sj_new(sc, 2, strat[k][0], strat[k][1], tag);
            h->backend = backend;
            snprintf(h->cfg.state_dict_type, sizeof h->cfg.state_dict_type, "sharded");
            snprintf(what, sizeof what, "%s %s on %s, sharded checkpoints", zr_names[sc], tags[k], backend);
            FL_CHECKF(sj_run(h, 1) == FL_OK, "%s: %s", what, h->msg[0]);
            if (h->st[0] == FL_OK) {
                check_bits(h, ref, what);
                check_resume(h, ref, what);
            }
            sj_free(h);
        }
    }
    if (sc == ZR_ADAMW && !opaque) { /* (opaque memory has no host-communicator path) */
        sjob *h = sj_new(sc, 2, "fsdp", "FULL_SHARD", "fsdp-host");
        FL_CHECKF(sj_run(h, 0) == FL_OK && h->calls == 0, "%s FULL_SHARD host: %s", zr_names[sc], h->msg[0]);
        if (h->st[0] == FL_OK && ref->st[0] == FL_OK) check_bits(h, ref, "FULL_SHARD over the host communicator");
        sj_free(h);
    }
    sj_free(ref);
}

/* HYBRID_SHARD at 4 ranks as 2 nodes x 2: the device communicator is split into the nodes and the replica
 * groups (comm_nccl.c's split: a new NCCL communicator over each part of the host's split); the run
 * through the stand-in gives the host communicator's bits (the same sums in the same order: each
 * node's rank-order sum, then the nodes') on every rank, and the same consolidated checkpoints. */
static void hybrid(const char *backend) {
    sjob *j[2];
    const int opaque = !strcmp(backend, "opaque");
    for (int k = 0; k < 2; k++) {
        char tag[64];
        snprintf(tag, sizeof tag, "hybrid-%s-%s", k ? "nccl" : "host", backend);
        j[k] = sj_new(ZR_ADAMW, 4, "fsdp", "HYBRID_SHARD", tag);
        j[k]->backend = k == 0 && opaque ? "cpu" : backend;
        j[k]->cfg.devices = 2;
        j[k]->cfg.num_nodes = 2;
        FL_CHECKF(sj_run(j[k], k) == FL_OK, "HYBRID_SHARD %s: %s", k ? "NCCL" : "host", j[k]->msg[0]);
    }
    if (j[0]->st[0] == FL_OK && j[1]->st[0] == FL_OK) {
        const char *what = g_sn_staged ? "HYBRID_SHARD 2 x 2 (staged communicator) vs the host communicator"
                                       : "HYBRID_SHARD 2 x 2 (NCCL stand-in) vs the host communicator";
        check_bits(j[1], j[0], what);
        check_ckpts(j[1], j[0], what);
    }
    /* per rank and step: every unit gathered in forward within the node and reduce-scattered, its
     * piece all-reduced across the nodes, each block gathered again in backward */
    const unsigned long want = 4 * (unsigned long)j[1]->cfg.train.max_steps * (3 * 4 + 2);
    FL_CHECKF(j[1]->calls >= want && j[0]->calls == 0, "HYBRID_SHARD: %lu collectives through the stand-in (want >= %lu), "
              "%lu in the host run", j[1]->calls, want, j[0]->calls);
    if (getenv("FL_TEST_VERBOSE")) printf("    HYBRID_SHARD 2 x 2: %lu stand-in collectives, the host run's bits\n", j[1]->calls);
    sj_free(j[0]);
    sj_free(j[1]);
}

/* Whether to run (emu: the test needs the CUDA emulator): the release pass runs these; under ASan (make
 * test's time budget) only when FITLLM_TEST_ASAN_ALL=1 asks (they take ~40 s there, the emulated kernels
 * most). */
static int sn_run(int emu) {
#ifndef FL_HAVE_CUDA_EMU
    if (emu) {
        fl_test_skip("no CUDA emulator in this build");
        return 0;
    }
#endif
    (void)emu;
    return fl_test_asan_budget();
}

FL_TEST(shard_nccl_zero_fsdp_32_true_equal_ddp_bits) {
    if (sn_run(1)) stages(ZR_ADAMW, "cuda-emu");
}

FL_TEST(shard_nccl_zero_fsdp_bf16_true_equal_ddp_bits) {
    if (sn_run(1)) stages(ZR_BF16, "cuda-emu");
}

FL_TEST(shard_nccl_zero_adamw8bit_equal_ddp_bits) {
    if (sn_run(1)) stages(ZR_ADAMW8, "cuda-emu");
}

FL_TEST(shard_nccl_hybrid_shard_split_device_comm) {
    if (sn_run(1)) hybrid("cuda-emu");
}

/* The same on the opaque backend (its memory is PROT_NONE to the host outside its ops, copies and the
 * device communicator's data-moving calls: a host access to parameter, gradient, optimizer-state or
 * gathered memory anywhere in ZeRO / FSDP / the checkpoint streams faults), against the cpu backend
 * over the host communicator: opaque runs the CPU kernels, so the bits must be the cpu backend's. */
FL_TEST(shard_nccl_opaque_zero_fsdp_equal_cpu_bits) {
    if (!sn_run(0)) return;
    stages(ZR_ADAMW, "opaque");
    stages(ZR_BF16, "opaque");
    stages(ZR_ADAMW8, "opaque");
    hybrid("opaque");
}

/* The staged device communicator (src/comm/comm_staged.c: the CUDA backend's for thread ranks sharing
 * one GPU, e.g. the lab's DDP and FSDP rows) on the opaque backend, whose memory it reaches only through
 * the backend's to_host / to_device: DDP, ZeRO-1/2, FULL_SHARD (resumed, sharded checkpoints) and
 * HYBRID_SHARD give the cpu backend's bits over the host communicator, and the collectives went through
 * the staged communicator ("calls" counts them there). */
FL_TEST(shard_staged_opaque_ddp_zero_fsdp_equal_cpu_bits) {
    if (!sn_run(0)) return;
    g_sn_staged = 1;
    sjob *ref = sj_new(ZR_ADAMW, 2, "ddp", NULL, "ddp-host-staged"), *j = sj_new(ZR_ADAMW, 2, "ddp", NULL, "ddp-staged");
    ref->backend = "cpu";
    j->backend = "opaque";
    FL_CHECKF(sj_run(ref, 0) == FL_OK && ref->calls == 0, "DDP host: %s", ref->msg[0]);
    FL_CHECKF(sj_run(j, 1) == FL_OK, "DDP on opaque, staged: %s", j->msg[0]);
    if (ref->st[0] == FL_OK && j->st[0] == FL_OK) {
        check_bits(j, ref, "DDP on opaque (staged communicator)");
        check_ckpts(j, ref, "DDP on opaque (staged communicator)");
    }
    FL_CHECKF(j->calls >= 2 * (1 + (unsigned long)j->cfg.train.max_steps), "DDP staged: %lu staged collectives", j->calls);
    sj_free(ref);
    sj_free(j);
    stages(ZR_ADAMW, "opaque");
    stages(ZR_ADAMW8, "opaque");
    hybrid("opaque");
    g_sn_staged = 0;
}

/* A rank that fails inside a step, where no agreement follows, releases its peers from the NCCL
 * stand-in's own thread group too (fl_comm_release_peers: ncclCommAbort of the stand-in). Without
 * it they wait there for the group's 120 s timeout: the host group, broken when rank 0's thread
 * returns, is not the group their gather waits in. FULL_SHARD at 3 thread ranks of the opaque backend
 * (device communicator: the stand-in) under a budget of rank 1's measured peak, which ranks 1 and 2
 * fit and rank 0 (the largest pieces) does not, and not before its step (its set-up fits): rank 0 is
 * out of memory in the step, and says so; ranks 1 and 2 fail with its abort, not with a timeout naming
 * the ranks that did not join. */
FL_TEST(shard_nccl_oom_in_step_releases_the_other_ranks) {
    sjob *f = sj_new(ZR_ADAMW, 3, "fsdp", NULL, "release-ref");
    f->backend = "opaque";
    FL_REQUIRE_OK(sj_run(f, 1));
    size_t setup0 = 0; /* rank 0's reserved bytes when the step starts */
    for (int i = 0; i < f->res[0].n_phases; i++)
        if (!strcmp(f->res[0].phases[i].name, "before_fwd")) setup0 = f->res[0].phases[i].cur_total;
    const size_t budget = f->res[1].peak_total;
    FL_REQUIRE(f->res[0].peak_total > budget && f->res[2].peak_total <= budget && setup0 > 0 && setup0 <= budget);
    sjob *g = sj_new(ZR_ADAMW, 3, "fsdp", NULL, "release");
    g->backend = "opaque";
    g->cfg.max_memory = budget;
    double t0 = sn_now_ms();
    fl_status s = sj_run(g, 1);
    const double ms = sn_now_ms() - t0;
    /* its message is the OOM's (the teardown of its gathers in flight on the aborted communicator
     * records errors of its own, which must not replace it) */
    FL_CHECKF(s == FL_ERR_OOM && g->st[0] == FL_ERR_OOM && g->res[0].oom.valid && strstr(g->msg[0], "out of memory"),
              "rank 0: %s (%s)", fl_status_name(g->st[0]), g->msg[0]);
    FL_CHECKF(strcmp(g->res[0].oom.phase, "setup") && strcmp(g->res[0].oom.phase, "model load"),
              "rank 0 ran out of memory in '%s', not in the step", g->res[0].oom.phase);
    for (int r = 1; r < 3; r++)
        FL_CHECKF(g->st[r] != FL_OK && !strstr(g->msg[r], "did not join") && !strstr(g->msg[r], "timed out"),
                  "rank %d (after %.0f ms): %s: %s", r, ms, fl_status_name(g->st[r]), g->msg[r]);
    sj_free(g);
    sj_free(f);
}

/* An encoder-decoder (T5, the tiny gated config at vocab 500; issue 31) on cuda-emu at 2 ranks: FULL_SHARD (its units
 * the layout groups: the shared embedding and the final norms with the head kept gathered for the pass, each block of
 * either stack gathered around its forward and backward) and ZeRO-2 through the NCCL stand-in give DDP's bits over the
 * host communicator (accumulation 1, no clipping, as above: the same rank-order sums, elementwise updates), with the
 * same consolidated checkpoints; FULL_SHARD resumed from step 1 ends on the same bits. On opaque against the cpu
 * backend's DDP likewise. The stand-in carried, per rank
 * and step, at least the two root units' gather and reduce-scatter and each of the 5 blocks' two gathers and one
 * reduce-scatter. */
static void t5_cfg_small(fl_run_config *c, const char *model, const char *strategy, const char *sharding, const char *tag) {
    fl_cfg_defaults(c, FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "%s", model);
    snprintf(c->out_dir, sizeof c->out_dir, "%s/snccl-t5-%s", fl_test_tmpdir(), tag);
    snprintf(c->strategy, sizeof c->strategy, "%s", strategy);
    snprintf(c->sharding_strategy, sizeof c->sharding_strategy, "%s", sharding ? sharding : "");
    c->init_random = 1;
    c->data.kind = FL_DATA_JSON;
    snprintf(c->data.json_path, sizeof c->data.json_path, "tests/fixtures/t5-pairs/pairs.json");
    c->data.max_source_length = 8;
    c->data.max_target_length = 4;
    c->devices = 2;
    c->train.micro_batch_size = 1;
    c->train.global_batch_size = 2;
    c->train.max_steps = 2;
    c->train.save_interval = 1;
    c->train.lr_warmup_steps = 0;
    c->train.max_norm = 0;
    c->eval.interval = 100;
    c->eval.max_new_tokens = 0;
    c->eval.final_validation = 0;
    c->threads = 1;
    c->overwrite = 1;
    c->hook_whole_params = 1; /* FULL_SHARD: the records compare whole parameters */
}

static void t5_nccl(const char *backend) {
    const int opaque = !strcmp(backend, "opaque");
    char model[700];
    snprintf(model, sizeof model, "%s/t5m", fl_test_tmpdir());
    FL_REQUIRE(fl_test_t5_folder(model, "t5-tiny-gated") == 0);
    static const char *strat[2][2] = {{"fsdp", "FULL_SHARD"}, {"deepspeed_stage_2", NULL}};
    static const char *tags[2] = {"fsdp", "zero2"};
    sjob *ref = calloc(1, sizeof *ref);
    FL_REQUIRE(ref != NULL);
    ref->world = 2;
    ref->backend = opaque ? "cpu" : backend; /* opaque runs the CPU kernels: the cpu backend's bits */
    t5_cfg_small(&ref->cfg, model, "ddp", NULL, opaque ? "ddp-host-cpu" : "ddp-host");
    FL_CHECKF(sj_run(ref, 0) == FL_OK && ref->calls == 0, "T5 DDP host: %s (%lu stand-in calls)", ref->msg[0], ref->calls);
    for (int k = 0; k < 2 && ref->st[0] == FL_OK; k++) {
        sjob *j = calloc(1, sizeof *j);
        FL_REQUIRE(j != NULL);
        j->world = 2;
        j->backend = backend;
        char tag[64], what[96];
        snprintf(tag, sizeof tag, "%s-%s", tags[k], backend);
        t5_cfg_small(&j->cfg, model, strat[k][0], strat[k][1], tag);
        snprintf(what, sizeof what, "T5 %s on %s (NCCL stand-in)", tags[k], backend);
        FL_CHECKF(sj_run(j, 1) == FL_OK, "%s: %s", what, j->msg[0]);
        if (j->st[0] == FL_OK) {
            check_bits(j, ref, what);
            check_ckpts(j, ref, what);
            if (k == 0) check_resume(j, ref, what);
        }
        const unsigned long steps = (unsigned long)j->cfg.train.max_steps;
        const unsigned long want = k == 0 ? 2 * steps * (2 * 2 + 3 * 5) : 2 * (1 + 2 * steps);
        FL_CHECKF(j->calls >= want, "%s: only %lu collectives went through the stand-in (want >= %lu)", what, j->calls,
                  want);
        if (getenv("FL_TEST_VERBOSE")) printf("    %s: %lu device-communicator collectives, DDP's bits\n", what, j->calls);
        sj_free(j);
    }
    sj_free(ref);
}

FL_TEST(shard_nccl_t5_fsdp_zero2_equal_ddp_bits) {
    if (sn_run(1)) t5_nccl("cuda-emu");
}

/* the same on opaque (its memory reached only through the ops, copies and the stand-in) against the cpu backend */
FL_TEST(shard_nccl_opaque_t5_fsdp_zero2_equal_cpu_bits) {
    if (sn_run(0)) t5_nccl("opaque");
}
