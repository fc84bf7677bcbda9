/* BLIP-2 fine-tuning under FSDP FULL_SHARD / ZeRO-3 (src/train/blip2_dist.c, the passes' units in blip2_pass.c), ranks
 * as threads (fl_comm_threads_run), rehearsals of blip2-micro through the library's entry (fl_blip2_train).
 *
 * The anchors: at one micro-batch per rank and step without clipping FULL_SHARD's reduced gradient of every element is
 * ZeRO-2's rank-order sum (a unit's reduce-scatter and ZeRO-2's reduce-scatter of the whole buffer add the same ranks'
 * values in the same order) and the update is elementwise, so its losses are ZeRO-2's bit for bit; with clipping the
 * norm sums the squared shards in another partition (its last bits may differ), with accumulation the ranks' sum comes
 * before the micro-batches' (a reassociation): there DDP / ZeRO-2's losses within fp32 reduction-order noise. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/blip2.h"
#include "fitllm/blip2_train.h"
#include "fitllm/backend.h"
#include "fitllm/comm.h"
#include "fitllm/comm_nccl.h"
#include "fitllm/config.h"
#include "fitllm/io.h"
#include "test.h"
#include "train/dp.h"

#define NSTEP 3

typedef struct {
    const fl_run_config *c;
    const fl_blip2_config *bc;
    double loss[4][NSTEP];
    fl_blip2_train_result res[4];
} fsdp_ctx;

static fl_status rank_fn(fl_comm *comm, int rank, void *ud) {
    fsdp_ctx *x = ud;
    const fl_blip2_train_opts o = {.shape = x->bc, .synth_len = 6, .rehearse_steps = NSTEP, .comm = comm,
                                   .step_loss = x->loss[rank], .n_step_out = NSTEP};
    return fl_blip2_train(x->c, &o, &x->res[rank]);
}

/* A run at `world` ranks of c with strategy st into x (0 on success). */
static int run_ranks(fl_run_config c, const char *st, int world, const fl_blip2_config *bc, fsdp_ctx *x) {
    memset(x, 0, sizeof *x);
    snprintf(c.strategy, sizeof c.strategy, "%s", st);
    x->c = &c, x->bc = bc;
    return fl_comm_threads_run(world, rank_fn, x) == FL_OK ? 0 : -1;
}

static fl_run_config base_cfg(const char *prec, const char *parts, int world) {
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    c.train.micro_batch_size = 1, c.train.global_batch_size = world;
    c.optimizer.lr = 0.002f;
    c.threads = 1;
    snprintf(c.precision, sizeof c.precision, "%s", prec);
    snprintf(c.blip2_train, sizeof c.blip2_train, "%s", parts);
    return c;
}

/* HYBRID_SHARD over `nodes` nodes of `devices` ranks */
static void hybrid(fl_run_config *c, int devices, int nodes) {
    snprintf(c->sharding_strategy, sizeof c->sharding_strategy, "HYBRID_SHARD");
    c->devices = devices, c->num_nodes = nodes;
}

/* rank r's losses of got are ref's rank 0's bit for bit, and they fall */
static void check_bits(const char *what, const fsdp_ctx *got, int r, const fsdp_ctx *ref, const char *ref_name) {
    FL_CHECKF(!memcmp(got->loss[r], ref->loss[0], sizeof ref->loss[0]) && got->loss[r][NSTEP - 1] < got->loss[r][0],
              "%s rank %d: losses %.9g %.9g %.9g, %s's %.9g %.9g %.9g", what, r, got->loss[r][0], got->loss[r][1],
              got->loss[r][2], ref_name, ref->loss[0][0], ref->loss[0][1], ref->loss[0][2]);
}

/* FULL_SHARD and deepspeed_stage_3 = ZeRO-2 bit for bit at 2 and 3 ranks (the units split unevenly at 3), in every
 * precision, every part trained or the vision tower frozen (the lab's script), SGD with momentum, checkpointing. */
FL_TEST(blip2_fsdp_threads_equal_zero2_bits) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    static const struct {
        const char *prec, *parts, *st;
        int world, sgd, ckpt;
    } cs[] = {
        {"32-true", "vision,qformer,lm", "fsdp", 2, 0, 0},
        {"32-true", "qformer,lm", "deepspeed_stage_3", 3, 0, 0},
        {"bf16-mixed", "vision,qformer,lm", "fsdp", 2, 0, 1},
        {"bf16-true", "qformer,lm", "fsdp", 2, 1, 0},
        {"32-true", "qformer", "fsdp", 3, 1, 1},
    };
    fsdp_ctx *x = calloc(2, sizeof *x);
    FL_REQUIRE(x != NULL);
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        fl_run_config c = base_cfg(cs[i].prec, cs[i].parts, cs[i].world);
        c.train.activation_checkpointing = cs[i].ckpt;
        if (cs[i].sgd) c.optimizer.kind = FL_OPT_SGD, c.optimizer.momentum = 0.9f;
        FL_CHECKF(run_ranks(c, "deepspeed_stage_2", cs[i].world, &bc, &x[0]) == 0, "case %zu ZeRO-2: %s", i,
                  fl_error_message());
        FL_CHECKF(run_ranks(c, cs[i].st, cs[i].world, &bc, &x[1]) == 0, "case %zu %s: %s", i, cs[i].st,
                  fl_error_message());
        for (int r = 0; r < cs[i].world; r++)
            FL_CHECKF(!memcmp(x[1].loss[r], x[0].loss[0], sizeof x[0].loss[0]),
                      "case %zu (%s %s %s, %d ranks) rank %d: losses %.9g %.9g %.9g, ZeRO-2's %.9g %.9g %.9g", i,
                      cs[i].prec, cs[i].parts, cs[i].st, cs[i].world, r, x[1].loss[r][0], x[1].loss[r][1],
                      x[1].loss[r][2], x[0].loss[0][0], x[0].loss[0][1], x[0].loss[0][2]);
        FL_CHECKF(x[1].loss[0][NSTEP - 1] < x[1].loss[0][0], "case %zu: the loss does not fall", i);
        /* each rank holds about 1/world of each part's parameters (frozen parts too) */
        for (int k = 0; k < FL_BLIP2_PARTS; k++) {
            const size_t whole = x[0].res[0].part_params[k], shard = x[1].res[0].part_params[k];
            FL_CHECKF(shard > 0 && shard * (size_t)cs[i].world <= whole + 64 * (size_t)cs[i].world,
                      "case %zu part %d: rank 0 PARAMS %zu, the whole part's %zu", i, k, shard, whole);
        }
    }
    free(x);
}

/* With clipping and accumulation (2 micro-batches per rank) FSDP's losses are DDP's within fp32 reduction-order noise
 * (the rehearsal draws each rank's pixels from its own stream, so one process is no anchor here: tests/mpi_blip2_test.sh
 * compares with one process on real data). Bound: 1e-6 relative, as tests/mpi_blip2_test.sh's DDP against one process. */
FL_TEST(blip2_fsdp_threads_clip_accum_near_ddp) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(2, sizeof *x);
    FL_REQUIRE(x != NULL);
    fl_run_config c = base_cfg("32-true", "vision,qformer,lm", 2);
    c.train.global_batch_size = 4;
    c.train.max_norm = 0.5f;
    FL_REQUIRE(run_ranks(c, "ddp", 2, &bc, &x[0]) == 0);
    FL_CHECKF(run_ranks(c, "fsdp", 2, &bc, &x[1]) == 0, "%s", fl_error_message());
    for (int s = 0; s < NSTEP; s++) {
        const double ddp = x[0].loss[0][s], fs = x[1].loss[0][s];
        FL_CHECKF(fabs(fs - ddp) <= 1e-6 * fabs(ddp) && fs == x[1].loss[1][s], "step %d: DDP %.9g, FSDP %.9g (rank 1 %.9g)",
                  s + 1, ddp, fs, x[1].loss[1][s]);
    }
    free(x);
}

/* LoRA under FULL_SHARD: the base stays whole on every rank, the adapters train as ZeRO-2 (the same bits; their state
 * divided over the ranks, the parameters replicated). */
FL_TEST(blip2_fsdp_threads_lora_as_zero2) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(2, sizeof *x);
    FL_REQUIRE(x != NULL);
    fl_run_config c = base_cfg("32-true", "", 2);
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_LORA);
    c.train.micro_batch_size = 1, c.train.global_batch_size = 2;
    c.optimizer.lr = 0.01f;
    c.threads = 1;
    c.lora.r = 4, c.lora.alpha = 8;
    FL_REQUIRE(run_ranks(c, "deepspeed_stage_2", 2, &bc, &x[0]) == 0);
    FL_CHECKF(run_ranks(c, "fsdp", 2, &bc, &x[1]) == 0, "%s", fl_error_message());
    FL_CHECKF(!memcmp(x[1].loss[0], x[0].loss[0], sizeof x[0].loss[0]) && x[1].res[0].part_optim[FL_BLIP2_TEXT] > 0 &&
                  x[1].res[0].part_params[FL_BLIP2_TEXT] == x[0].res[0].part_params[FL_BLIP2_TEXT],
              "LoRA FSDP losses %.9g %.9g %.9g, ZeRO-2's %.9g %.9g %.9g", x[1].loss[0][0], x[1].loss[0][1],
              x[1].loss[0][2], x[0].loss[0][0], x[0].loss[0][1], x[0].loss[0][2]);
    free(x);
}

/* What FSDP does not run for BLIP-2 is refused by name before any collective: parameter offload under LoRA (the base
 * stays whole; the CLI refuses it first, the library too), 8-bit AdamW with the optimizer offloaded (the optimizer's). */
FL_TEST(blip2_fsdp_refusals) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(1, sizeof *x);
    FL_REQUIRE(x != NULL);
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_LORA);
    c.train.micro_batch_size = 1, c.train.global_batch_size = 2, c.threads = 1;
    FL_CHECK(run_ranks(c, "fsdp_cpu_offload", 2, &bc, x) != 0 && strstr(fl_error_message(), "under finetune_lora"));
    c = base_cfg("32-true", "qformer,lm", 2);
    c.optimizer.kind = FL_OPT_ADAMW8BIT;
    FL_CHECK(run_ranks(c, "fsdp_cpu_offload", 2, &bc, x) != 0 && strstr(fl_error_message(), "AdamW8bit"));
    free(x);
}

/* HYBRID_SHARD (FULL_SHARD within each node's --devices ranks, replicated across --num_nodes): 2 nodes of 1 rank sum
 * each element's gradient in DDP's rank order (the node's sum is one rank's, the nodes' in node order), so its losses
 * are ZeRO-2's bit for bit; 2 nodes of 2 ranks add (g0 + g1) + (g2 + g3) where DDP adds ((g0 + g1) + g2) + g3: DDP's
 * losses within 1e-6 relative (the bound of the clip / accumulation case above), every rank the same; rank 0 holds
 * half of each part (its node's shard), not a quarter. */
FL_TEST(blip2_fsdp_threads_hybrid_shard) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(3, sizeof *x);
    FL_REQUIRE(x != NULL);
    fl_run_config c = base_cfg("32-true", "vision,qformer,lm", 2);
    hybrid(&c, 1, 2);
    FL_REQUIRE(run_ranks(c, "deepspeed_stage_2", 2, &bc, &x[0]) == 0);
    FL_CHECKF(run_ranks(c, "fsdp", 2, &bc, &x[1]) == 0, "2 x 1: %s", fl_error_message());
    for (int r = 0; r < 2; r++) check_bits("HYBRID 2 x 1", &x[1], r, &x[0], "ZeRO-2");
    for (int k = 0; k < FL_BLIP2_PARTS; k++) /* one rank per node: the node's shard is the whole part */
        FL_CHECK(x[1].res[0].part_params[k] == x[0].res[0].part_params[k]);
    c = base_cfg("32-true", "qformer,lm", 4);
    hybrid(&c, 2, 2);
    FL_REQUIRE(run_ranks(c, "ddp", 4, &bc, &x[0]) == 0);
    FL_CHECKF(run_ranks(c, "fsdp", 4, &bc, &x[1]) == 0, "2 x 2: %s", fl_error_message());
    fl_run_config f = c; /* FULL_SHARD over the 4 ranks: each holds a quarter */
    f.sharding_strategy[0] = 0;
    FL_REQUIRE(run_ranks(f, "fsdp", 4, &bc, &x[2]) == 0);
    for (int s = 0; s < NSTEP; s++) {
        const double ddp = x[0].loss[0][s], hy = x[1].loss[0][s];
        FL_CHECKF(fabs(hy - ddp) <= 1e-6 * fabs(ddp), "step %d: DDP %.9g, HYBRID 2 x 2 %.9g", s + 1, ddp, hy);
        for (int r = 1; r < 4; r++) FL_CHECK(x[1].loss[r][s] == hy);
    }
    FL_CHECK(x[1].loss[0][NSTEP - 1] < x[1].loss[0][0]);
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        const size_t whole = x[0].res[0].part_params[k], hy = x[1].res[0].part_params[k], fs = x[2].res[0].part_params[k];
        FL_CHECKF(hy * 2 <= whole + 128 && hy * 2 + 128 >= whole && fs < hy,
                  "part %d: rank 0 PARAMS %zu under HYBRID 2 x 2, %zu under FULL_SHARD at 4, whole %zu", k, hy, fs, whole);
    }
    free(x);
}

/* 8-bit AdamW on FULL_SHARD's shards: each rank updates its pieces of every tensor, a block cut by a rank edge takes the
 * max of its parts' absmax over the ranks (optim.c), so every element gets one process's 8-bit arithmetic on DDP's
 * reduced gradient: DDP's losses bit for bit at 2 and 3 ranks (the units cut blocks at 3), and under HYBRID_SHARD 2 x 1;
 * the ranks' OPTIM adds up to DDP's (a rank's share is uneven: small tensors keep fp32 state, 8 bytes an element). */
FL_TEST(blip2_fsdp_threads_adamw8bit_equal_ddp_bits) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(2, sizeof *x);
    FL_REQUIRE(x != NULL);
    for (int v = 0; v < 3; v++) {
        const int world = v == 1 ? 3 : 2;
        fl_run_config c = base_cfg("32-true", v == 1 ? "qformer" : "qformer,lm", world);
        c.optimizer.kind = FL_OPT_ADAMW8BIT;
        if (v == 2) hybrid(&c, 1, 2);
        FL_REQUIRE(run_ranks(c, "ddp", world, &bc, &x[0]) == 0);
        FL_CHECKF(run_ranks(c, "fsdp", world, &bc, &x[1]) == 0, "case %d: %s", v, fl_error_message());
        for (int r = 0; r < world; r++) check_bits(v == 2 ? "8-bit HYBRID 2 x 1" : "8-bit FULL_SHARD", &x[1], r, &x[0], "DDP");
        /* the shard group's pieces add up to the whole state, plus per rank the exchange scratch and the cut blocks'
         * absmax (< 4 KiB here); HYBRID 2 x 1: each node (one rank) holds the whole state */
        const int ws = v == 2 ? 1 : world;
        for (int k = FL_BLIP2_QFORMER; k < FL_BLIP2_PARTS; k++) {
            const size_t whole = x[0].res[0].part_optim[k];
            if (!whole && k == FL_BLIP2_TEXT && v == 1) continue; /* the Q-Former alone */
            size_t sum = 0;
            for (int r = 0; r < ws; r++) sum += x[1].res[r].part_optim[k];
            FL_CHECKF(sum >= whole && sum <= whole + 4096 * (size_t)ws && (ws == 1 || x[1].res[0].part_optim[k] < whole),
                      "case %d part %d: the ranks' OPTIM add up to %zu (rank 0 %zu), DDP's %zu", v, k, sum,
                      x[1].res[0].part_optim[k], whole);
        }
    }
    free(x);
}

/* Parameter offload (fsdp_cpu_offload: FSDP's CPUOffload(offload_params=True)): the shards of the parameters and
 * gradients and the optimizer live in the host tier, outside the device pool; each unit comes up for its use and its
 * reduced gradient goes down. The same arithmetic: at 2 ranks FULL_SHARD's losses bit for bit, at one rank (the whole
 * part is the rank's shard) the plain run's; PARAMS and OPTIM 0 in the device pool, the host tier holds them; bf16-mixed
 * with checkpointing and clipping too. */
FL_TEST(blip2_fsdp_threads_param_offload_bits) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(2, sizeof *x);
    FL_REQUIRE(x != NULL);
    static const struct {
        const char *prec, *ref;
        int world, ckpt;
        float clip;
    } cs[] = {{"32-true", "fsdp", 2, 0, 0}, {"bf16-mixed", "fsdp", 2, 1, 0.5f}, {"32-true", "ddp", 1, 0, 0.5f}};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        fl_run_config c = base_cfg(cs[i].prec, "vision,qformer,lm", cs[i].world);
        c.train.activation_checkpointing = cs[i].ckpt;
        c.train.max_norm = cs[i].clip;
        FL_REQUIRE(run_ranks(c, cs[i].ref, cs[i].world, &bc, &x[0]) == 0);
        FL_CHECKF(run_ranks(c, "fsdp_cpu_offload", cs[i].world, &bc, &x[1]) == 0, "case %zu: %s", i, fl_error_message());
        const fl_blip2_train_result *m = &x[1].res[0];
        check_bits(cs[i].prec, &x[1], 0, &x[0], cs[i].ref);
        FL_CHECKF(m->offload && m->peak[FL_TAG_PARAMS] == 0 && m->peak[FL_TAG_OPTIM] == 0 && m->peak[FL_TAG_GRADS] == 0 &&
                      m->host_peak[FL_TAG_PARAMS] > 0 && m->host_peak[FL_TAG_OPTIM] > 0 && m->peak[FL_TAG_GATHER] > 0,
                  "case %zu: device PARAMS %zu GRADS %zu OPTIM %zu, host PARAMS %zu OPTIM %zu", i, m->peak[FL_TAG_PARAMS],
                  m->peak[FL_TAG_GRADS], m->peak[FL_TAG_OPTIM], m->host_peak[FL_TAG_PARAMS], m->host_peak[FL_TAG_OPTIM]);
    }
    free(x);
}

/* The gradients tensor by tensor after re-assembly: the fixture's batch (tests/fixtures/blip2-tiny-opt: B 2 x 12 ids,
 * transformers' float64 reference and PyTorch fp32's own distance to it, noise.*) split over 2 and 3 thread ranks, 4 under
 * HYBRID_SHARD 2 x 2 and 2 with parameter offload (rank r the batch's sequence r; ranks past the batch run sequence 0
 * with every target ignored: no gradient, the collectives all the same), every part sharded and trained: each rank's gradient shards gathered unit by unit into the whole
 * layout (fl_fsdp_whole_array) are within test_blip2.c's bound of the reference (8 x PyTorch fp32's error + 16 fp32
 * roundings of the tensor's scale), as one process's are; and within that bound of one process's. */
#define GFIX "tests/fixtures/blip2-tiny-opt"

typedef struct {
    float *g[FL_BLIP2_PARTS]; /* rank 0's re-assembled gradients */
    size_t n[FL_BLIP2_PARTS];
    int nodes;                /* > 1: HYBRID_SHARD over this many nodes */
    int poff;                 /* parameter offload: the shards in a host tier */
} grad_ctx;

static fl_status grad_rank(fl_comm *comm, int rank, void *ud) {
    grad_ctx *x = ud;
    fl_backend be;
    fl_mem_pool pool, host;
    FL_TRY(fl_backend_init_by_name("cpu", &be, 1));
    fl_status s = fl_backend_pools_init(&be, &pool, &host, "cpu", 0);
    if (s != FL_OK) {
        fl_backend_free(&be);
        return s;
    }
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    snprintf(c.strategy, sizeof c.strategy, "fsdp");
    if (x->nodes > 1) hybrid(&c, fl_comm_size(comm) / x->nodes, x->nodes);
    fl_mem_pool tier; /* parameter offload: the shards' host tier */
    if (x->poff) fl_mem_pool_init(&tier, "host (offload)", 0);
    fl_precision prec;
    fl_model_storage stg[FL_BLIP2_PARTS];
    fl_dp dp[FL_BLIP2_PARTS];
    memset(dp, 0, sizeof dp);
    fl_blip2 *b = NULL;
    fl_st_file f;
    int fopen_ok = 0;
    s = fl_precision_find("32-true", &prec);
    for (int k = 0; s == FL_OK && k < FL_BLIP2_PARTS; k++) {
        fl_model_storage_for(&prec, &stg[k]);
        dp[k].comm = comm, dp[k].rank = rank, dp[k].world = fl_comm_size(comm);
        if (x->poff) dp[k].ptier.be = &be, dp[k].ptier.pool = dp[k].ptier.host = &tier;
        s = fl_fsdp_prepare(&dp[k], &c, &prec, &stg[k]);
    }
    if (s == FL_OK) s = fl_blip2_load_ex(&b, GFIX, &be, &pool, stg);
    if (s == FL_OK) s = fl_blip2_set_precision(b, &prec);
    for (int k = 0; s == FL_OK && k < FL_BLIP2_PARTS; k++) s = fl_fsdp_init(&dp[k], &c, fl_blip2_part(b, k));
    if (s == FL_OK) s = fl_blip2_alloc_grads(b);
    if (s == FL_OK && (s = fl_st_open(&f, GFIX "/expected.safetensors")) == FL_OK) fopen_ok = 1;
    const fl_st_tensor *px = fopen_ok ? fl_st_find(&f, "pixels") : NULL, *ids = fopen_ok ? fl_st_find(&f, "ids") : NULL;
    const fl_st_tensor *lab = fopen_ok ? fl_st_find(&f, "labels") : NULL;
    if (s == FL_OK && (!px || !ids || !lab)) s = fl_errorf(FL_ERR_FORMAT, "fixture incomplete");
    if (s == FL_OK) {
        const int B = (int)ids->shape[0], T = (int)ids->shape[1], TC = (int)lab->shape[1], NQ = T - TC, S = (int)px->shape[2];
        const int row = rank < B ? rank : 0;
        int32_t tg[64];
        int n_valid = 0;
        for (int bb = 0; bb < B; bb++) /* the whole batch's valid targets: each rank's scale */
            for (int t = 0; t < T; t++) {
                const int i = t - NQ, v = i >= 0 && i + 1 < TC ? ((const int32_t *)lab->data)[bb * TC + i + 1] : FL_IGNORE_INDEX;
                if (bb == row) tg[t] = rank < B ? v : FL_IGNORE_INDEX;
                n_valid += v != FL_IGNORE_INDEX;
            }
        float loss;
        fl_blip2_zero_grads(b);
        s = fl_blip2_alloc_acts(b, 1, T);
        if (s == FL_OK)
            s = fl_blip2_forward(b, (const float *)px->data + (size_t)row * 3 * S * S, (const int32_t *)ids->data + row * T,
                                 tg, 1, T, 1.0f / (float)n_valid, NULL, &loss);
        if (s == FL_OK) s = fl_blip2_backward(b);
    }
    for (int k = 0; s == FL_OK && k < FL_BLIP2_PARTS; k++) {
        const fl_model *m = fl_blip2_part(b, k);
        float *full = malloc(m->layout.numel * sizeof *full + 4);
        s = full ? fl_fsdp_whole_array(&dp[k], fl_model_grads_data(m), 4, full) : FL_ERR_OOM;
        if (rank == 0) x->g[k] = full, x->n[k] = m->layout.numel;
        else free(full);
    }
    if (fopen_ok) fl_st_close(&f);
    for (int k = 0; k < FL_BLIP2_PARTS; k++) fl_dp_done(&dp[k]); /* the sharding, HYBRID's groups */
    fl_blip2_free(b);
    if (x->poff) fl_mem_pool_free(&tier);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
    return s;
}

static double gbound(const fl_st_tensor *noise, double scale) {
    return 8.0 * ((const float *)noise->data)[0] + 16.0 * FLT_EPSILON * scale;
}

FL_TEST(blip2_fsdp_threads_gradients_vs_transformers) {
    /* one process, the whole batch */
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &be, 1));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, "cpu", 0));
    fl_blip2 *one = NULL;
    FL_REQUIRE_OK(fl_blip2_load(&one, GFIX, &be, &pool));
    FL_REQUIRE_OK(fl_blip2_alloc_grads(one));
    fl_st_file f;
    FL_REQUIRE_OK(fl_st_open(&f, GFIX "/expected.safetensors"));
    const fl_st_tensor *px = fl_st_find(&f, "pixels"), *ids = fl_st_find(&f, "ids"), *lab = fl_st_find(&f, "labels");
    FL_REQUIRE(px && ids && lab);
    const int B = (int)ids->shape[0], T = (int)ids->shape[1], TC = (int)lab->shape[1], NQ = T - TC;
    int32_t tg[128];
    int n_valid = 0;
    FL_REQUIRE(B * T <= 128);
    for (int bb = 0; bb < B; bb++)
        for (int t = 0; t < T; t++) {
            const int i = t - NQ, v = i >= 0 && i + 1 < TC ? ((const int32_t *)lab->data)[bb * TC + i + 1] : FL_IGNORE_INDEX;
            tg[bb * T + t] = v;
            n_valid += v != FL_IGNORE_INDEX;
        }
    float loss;
    fl_blip2_zero_grads(one);
    FL_REQUIRE_OK(fl_blip2_alloc_acts(one, B, T));
    FL_REQUIRE_OK(fl_blip2_forward(one, px->data, ids->data, tg, B, T, 1.0f / (float)n_valid, NULL, &loss));
    FL_REQUIRE_OK(fl_blip2_backward(one));
    /* 2 and 3 ranks FULL_SHARD, 4 ranks HYBRID_SHARD 2 x 2 (ranks 2, 3 ignore every target), 2 ranks with the
     * parameters' and gradients' shards in a host tier */
    static const struct {
        int world, nodes, poff;
        const char *what;
    } cs[] = {{2, 1, 0, "FULL_SHARD"}, {3, 1, 0, "FULL_SHARD"}, {4, 2, 0, "HYBRID 2 x 2"}, {2, 1, 1, "param offload"}};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const int world = cs[ci].world;
        grad_ctx x;
        memset(&x, 0, sizeof x);
        x.nodes = cs[ci].nodes, x.poff = cs[ci].poff;
        FL_CHECKF(fl_comm_threads_run(world, grad_rank, &x) == FL_OK, "%d ranks: %s", world, fl_error_message());
        int checked = 0;
        double worst = 0, dist = 0;
        for (int k = 0; k < FL_BLIP2_PARTS; k++) {
            const fl_model *m = fl_blip2_part(one, k);
            if (!x.g[k] || x.n[k] != m->layout.numel) continue;
            for (int i = 0; i < m->layout.n; i++) {
                const fl_param_info *p = &m->layout.params[i];
                char gk[200], nk[208];
                snprintf(gk, sizeof gk, "grad.%s%s", k == FL_BLIP2_TEXT ? "language_model." : "", p->name);
                snprintf(nk, sizeof nk, "noise.%s", gk + 5);
                const fl_st_tensor *g = fl_st_find(&f, gk), *gn = fl_st_find(&f, nk);
                FL_CHECKF(g && gn && (size_t)(g->end - g->begin) == p->numel * 4, "reference gradient of %s", gk);
                if (!g || !gn || p->transposed_on_disk) continue;
                const float *ref = g->data, *fs = x.g[k] + p->offset, *o1 = fl_model_grads_f32(m) + p->offset;
                double e = 0, e1 = 0, sc = 0;
                for (size_t j = 0; j < p->numel; j++) {
                    e = fmax(e, fabs((double)fs[j] - ref[j]));
                    e1 = fmax(e1, fabs((double)fs[j] - o1[j]));
                    sc = fmax(sc, fabs(ref[j]));
                }
                FL_CHECKF(e <= gbound(gn, sc) && e1 <= gbound(gn, sc),
                          "%d ranks: gradient of %s: error %.3g from the reference, %.3g from one process, bound %.3g",
                          world, gk + 5, e, e1, gbound(gn, sc));
                worst = fmax(worst, e / gbound(gn, sc));
                dist = fmax(dist, e1 / gbound(gn, sc));
                checked++;
            }
        }
        FL_CHECKF(checked == 139, "%d ranks: %d gradients checked", world, checked);
        printf("      %d ranks %s: %d gradients, worst %.2f of the bound from the reference, %.2f from one process\n",
               world, cs[ci].what, checked, worst, dist);
        for (int k = 0; k < FL_BLIP2_PARTS; k++) free(x.g[k]);
    }
    fl_st_close(&f);
    fl_blip2_free(one);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* plan = measured per rank: each of 3 thread ranks' pool (every phase's bytes and peak per tag, the all-time peaks) of a
 * FULL_SHARD run on the CPU equals what `plan --devices 3 --strategy fsdp --rank R` rehearses for it on the null backend
 * (the ranks as threads, the units through the null communicator): every part trained with checkpointing in 32-true,
 * bf16-mixed (the gathered units' bf16 copies in GATHER) and bf16-true. */
FL_TEST(blip2_fsdp_plan_equals_measured_per_rank) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(1, sizeof *x);
    fl_blip2_train_result *pr = calloc(1, sizeof *pr);
    FL_REQUIRE(x && pr);
    static const char *const precs[3] = {"32-true", "bf16-mixed", "bf16-true"};
    for (int v = 0; v < 3; v++) {
        fl_run_config c = base_cfg(precs[v], "vision,qformer,lm", 3);
        c.train.activation_checkpointing = 1;
        FL_REQUIRE(run_ranks(c, "fsdp", 3, &bc, x) == 0);
        fl_run_config one = c; /* the plan's configuration: one rank's share of the step */
        snprintf(one.strategy, sizeof one.strategy, "fsdp");
        one.train.global_batch_size = 1;
        for (int r = 0; r < 3; r++) {
            fl_backend nb;
            FL_REQUIRE_OK(fl_null_backend_init_for(&nb, "cpu"));
            const fl_blip2_train_opts o = {.shape = &bc, .be = &nb, .synth_len = 6, .rehearse_steps = NSTEP,
                                           .plan_world = 3, .plan_rank = r};
            const fl_status s = fl_blip2_train(&one, &o, pr);
            fl_null_backend_free(&nb);
            FL_CHECKF(s == FL_OK, "%s plan of rank %d: %s", precs[v], r, fl_error_message());
            const fl_blip2_train_result *m = &x->res[r];
            FL_CHECKF(!memcmp(pr->peak, m->peak, sizeof m->peak) && pr->peak_total == m->peak_total &&
                          pr->n_phases == m->n_phases &&
                          !memcmp(pr->phases, m->phases, (size_t)m->n_phases * sizeof m->phases[0]),
                      "%s rank %d: planned peak %zu (GATHER %zu, %d phases), measured %zu (GATHER %zu, %d phases)",
                      precs[v], r, pr->peak_total, pr->peak[FL_TAG_GATHER], pr->n_phases, m->peak_total,
                      m->peak[FL_TAG_GATHER], m->n_phases);
            FL_CHECK(m->peak[FL_TAG_GATHER] > 0);
        }
    }
    free(x), free(pr);
}

/* plan = measured per rank under HYBRID_SHARD (2 nodes of 2: each rank its node's shard) and under parameter offload
 * (fsdp_cpu_offload at 2 ranks and at one: the device pool and the host tier, phase by phase): what
 * `plan --devices D --num_nodes N --strategy ... --rank R` rehearses on the null backend for each rank. */
FL_TEST(blip2_fsdp_plan_equals_measured_hybrid_offload) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(1, sizeof *x);
    fl_blip2_train_result *pr = calloc(1, sizeof *pr);
    FL_REQUIRE(x && pr);
    static const struct {
        const char *st, *prec;
        int devices, nodes;
    } cs[] = {{"fsdp", "32-true", 2, 2}, {"fsdp_cpu_offload", "bf16-mixed", 2, 1}, {"fsdp_cpu_offload", "32-true", 1, 1}};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const int world = cs[i].devices * cs[i].nodes;
        fl_run_config c = base_cfg(cs[i].prec, "vision,qformer,lm", world);
        c.train.activation_checkpointing = 1;
        if (cs[i].nodes > 1) hybrid(&c, cs[i].devices, cs[i].nodes);
        FL_REQUIRE(run_ranks(c, cs[i].st, world, &bc, x) == 0);
        fl_run_config one = c; /* the plan's configuration: one rank's share of the step */
        snprintf(one.strategy, sizeof one.strategy, "%s", cs[i].st);
        one.train.global_batch_size = 1;
        for (int r = 0; r < world; r++) {
            fl_backend nb;
            FL_REQUIRE_OK(fl_null_backend_init_for(&nb, "cpu"));
            const fl_blip2_train_opts o = {.shape = &bc, .be = &nb, .synth_len = 6, .rehearse_steps = NSTEP,
                                           .plan_world = world, .plan_rank = r};
            const fl_status s = fl_blip2_train(&one, &o, pr);
            fl_null_backend_free(&nb);
            FL_CHECKF(s == FL_OK, "case %zu plan of rank %d: %s", i, r, fl_error_message());
            const fl_blip2_train_result *m = &x->res[r];
            FL_CHECKF(!memcmp(pr->peak, m->peak, sizeof m->peak) && pr->peak_total == m->peak_total &&
                          pr->n_phases == m->n_phases &&
                          !memcmp(pr->phases, m->phases, (size_t)m->n_phases * sizeof m->phases[0]) &&
                          !memcmp(pr->host_peak, m->host_peak, sizeof m->host_peak) && pr->offload == m->offload,
                      "case %zu rank %d: planned peak %zu (GATHER %zu, host %zu), measured %zu (GATHER %zu, host %zu)", i,
                      r, pr->peak_total, pr->peak[FL_TAG_GATHER], pr->host_peak_total, m->peak_total,
                      m->peak[FL_TAG_GATHER], m->host_peak_total);
            FL_CHECK(m->peak[FL_TAG_GATHER] > 0);
        }
    }
    free(x), free(pr);
}

/* On device memory (the opaque backend: the host never reads its buffers): the units' gathers and reduce-scatters go
 * through the backend's device communicator, the NCCL stand-in or the staged one (the CUDA thread ranks' on one GPU),
 * and give the CPU backend's FULL_SHARD losses bit for bit (opaque computes with the CPU kernels); so do parameter
 * offload (the shards in the host tier, the update on a CPU backend; bf16-true clipped: the host's 16-bit gradients
 * scaled through host staging), HYBRID_SHARD and 8-bit AdamW on the shards. */
FL_TEST(blip2_fsdp_threads_opaque_equal_cpu_bits) {
    if (!fl_test_asan_budget()) return; /* ~10 s in the release pass */
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fsdp_ctx *x = calloc(2, sizeof *x);
    FL_REQUIRE(x != NULL);
    const char *prev = getenv("FITLLM_BACKEND");
    char keep[64] = "";
    if (prev) snprintf(keep, sizeof keep, "%s", prev);
    /* FULL_SHARD (NCCL stand-in and staged), and over the stand-in: parameter offload (the units up from the host
     * tier, their gradients down), HYBRID_SHARD 2 x 1, 8-bit AdamW on the shards */
    static const struct {
        const char *st, *what;
        int staged, hybrid, a8;
        const char *prec;
        float clip;
    } vs[] = {{"fsdp", "NCCL stand-in", 0, 0, 0, "32-true", 0}, {"fsdp", "staged", 1, 0, 0, "32-true", 0},
              {"fsdp_cpu_offload", "param offload", 0, 0, 0, "32-true", 0},
              {"fsdp_cpu_offload", "param offload, bf16-true clipped", 0, 0, 0, "bf16-true", 0.01f},
              {"fsdp", "HYBRID 2 x 1", 0, 1, 0, "32-true", 0}, {"fsdp", "8-bit AdamW", 0, 0, 1, "32-true", 0}};
    int ok0 = 1;
    for (size_t v = 0; ok0 && v < sizeof vs / sizeof vs[0]; v++) {
        fl_run_config c = base_cfg(vs[v].prec, "vision,qformer,lm", 2);
        c.train.max_norm = vs[v].clip;
        if (vs[v].hybrid) hybrid(&c, 1, 2);
        if (vs[v].a8) c.optimizer.kind = FL_OPT_ADAMW8BIT;
        setenv("FITLLM_BACKEND", "cpu", 1);
        ok0 = run_ranks(c, vs[v].st, 2, &bc, &x[0]) == 0;
        if (!ok0) break;
        const int staged = vs[v].staged;
        setenv("FITLLM_BACKEND", "opaque", 1);
        fl_opaque_use_comm(staged ? 2 : 1);
        const unsigned long c0 = staged ? fl_comm_staged_calls() : fl_nccl_standin_calls();
        const int ok = run_ranks(c, vs[v].st, 2, &bc, &x[1]) == 0;
        const unsigned long calls = (staged ? fl_comm_staged_calls() : fl_nccl_standin_calls()) - c0;
        fl_opaque_use_comm(1);
        FL_CHECKF(ok && calls > 0 && !memcmp(x[1].loss, x[0].loss, sizeof x[0].loss),
                  "opaque (%s): %s; %lu device collectives; losses %.9g %.9g %.9g, cpu's %.9g %.9g %.9g", vs[v].what,
                  ok ? "ran" : fl_error_message(), calls, x[1].loss[0][0], x[1].loss[0][1], x[1].loss[0][2],
                  x[0].loss[0][0], x[0].loss[0][1], x[0].loss[0][2]);
    }
    if (keep[0]) setenv("FITLLM_BACKEND", keep, 1);
    else unsetenv("FITLLM_BACKEND");
    FL_CHECKF(ok0, "cpu: %s", fl_error_message());
    free(x);
}

/* The Flan-T5 variant (tests/fixtures/blip2-tiny-t5's shape: the language model an encoder-decoder, whose own
 * interpreter gathers its units, the queries entering the encoder's rows) = ZeRO-2 bit for bit at 3 ranks, every part
 * trained, in 32-true and in bf16-mixed with checkpointing. */
FL_TEST(blip2_fsdp_threads_t5_equal_zero2_bits) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_config_load("tests/fixtures/blip2-tiny-t5/config.json", &bc));
    fsdp_ctx *x = calloc(2, sizeof *x);
    FL_REQUIRE(x != NULL);
    for (int v = 0; v < 2; v++) {
        fl_run_config c = base_cfg(v ? "bf16-mixed" : "32-true", "vision,qformer,lm", 3);
        c.train.activation_checkpointing = v;
        FL_REQUIRE(run_ranks(c, "deepspeed_stage_2", 3, &bc, &x[0]) == 0);
        FL_CHECKF(run_ranks(c, "fsdp", 3, &bc, &x[1]) == 0, "%s", fl_error_message());
        FL_CHECKF(!memcmp(x[1].loss[0], x[0].loss[0], sizeof x[0].loss[0]) && x[1].loss[0][NSTEP - 1] < x[1].loss[0][0],
                  "%s: FSDP losses %.9g %.9g %.9g, ZeRO-2's %.9g %.9g %.9g", c.precision, x[1].loss[0][0],
                  x[1].loss[0][1], x[1].loss[0][2], x[0].loss[0][0], x[0].loss[0][1], x[0].loss[0][2]);
    }
    free(x);
}

/* The Flan-T5 variant under the same three: HYBRID_SHARD 2 nodes x 1 = ZeRO-2's losses bit for bit, 8-bit AdamW on
 * the shards at 3 ranks = DDP's 8-bit losses bit for bit, fsdp_cpu_offload at 2 ranks (bf16-mixed, checkpointing) =
 * FULL_SHARD's bits; every part trained. */
FL_TEST(blip2_fsdp_threads_t5_hybrid_8bit_offload) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_config_load("tests/fixtures/blip2-tiny-t5/config.json", &bc));
    fsdp_ctx *x = calloc(2, sizeof *x);
    FL_REQUIRE(x != NULL);
    static const struct {
        const char *what, *ref, *st, *prec;
        int world, hybrid, a8, ckpt;
    } cs[] = {{"HYBRID 2 x 1", "deepspeed_stage_2", "fsdp", "32-true", 2, 1, 0, 0},
              {"8-bit FULL_SHARD", "ddp", "deepspeed_stage_3", "32-true", 3, 0, 1, 0},
              {"fsdp_cpu_offload", "fsdp", "fsdp_cpu_offload", "bf16-mixed", 2, 0, 0, 1}};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        fl_run_config c = base_cfg(cs[i].prec, "vision,qformer,lm", cs[i].world);
        c.train.activation_checkpointing = cs[i].ckpt;
        if (cs[i].a8) c.optimizer.kind = FL_OPT_ADAMW8BIT;
        if (cs[i].hybrid) hybrid(&c, 1, 2);
        FL_REQUIRE(run_ranks(c, cs[i].ref, cs[i].world, &bc, &x[0]) == 0);
        FL_CHECKF(run_ranks(c, cs[i].st, cs[i].world, &bc, &x[1]) == 0, "%s: %s", cs[i].what, fl_error_message());
        check_bits(cs[i].what, &x[1], 0, &x[0], cs[i].ref);
    }
    free(x);
}

/* A plan out of memory while the parts are created (the language model's shard does not fit after the vision tower's
 * and the Q-Former's): the verdict is the failing rank's OOM record (PARAMS), the parts' sharding given back after the
 * failed load freed them. */
FL_TEST(blip2_fsdp_plan_oom_at_load) {
    fl_blip2_config bc;
    FL_REQUIRE_OK(fl_blip2_preset("blip2-micro", &bc));
    fl_run_config c = base_cfg("32-true", "qformer,lm", 1);
    snprintf(c.strategy, sizeof c.strategy, "fsdp");
    fl_backend nb;
    FL_REQUIRE_OK(fl_null_backend_init_for(&nb, "cpu"));
    fl_blip2_train_result *res = calloc(1, sizeof *res);
    FL_REQUIRE(res != NULL);
    const fl_blip2_train_opts o = {.shape = &bc, .be = &nb, .budget = 300 << 10, .synth_len = 6, .rehearse_steps = 1,
                                   .plan_world = 2};
    const fl_status s = fl_blip2_train(&c, &o, res);
    fl_null_backend_free(&nb);
    FL_CHECKF(s == FL_ERR_OOM && res->oom.valid && res->oom.tag == FL_TAG_PARAMS && strstr(fl_error_message(), "rank "),
              "status %d, OOM record %d tag %d: %s", s, res->oom.valid, res->oom.tag, fl_error_message());
    free(res);
}
