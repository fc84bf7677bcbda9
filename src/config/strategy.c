/* The data-parallel strategy of a run: Lightning's strategy names to ZeRO stages and optimizer offload,
 * and --strategy auto's resolution per command (LitGPT's defaults). Split from run_config.c. */
#include <string.h>

#include "config-impl.h"

/* Lightning's and DeepSpeed's names for what is not built yet: refused, never mapped onto something
 * else. */
static fl_status not_yet(const char *what, const char *name) {
    return fl_errorf(FL_ERR_UNSUPPORTED, "%s '%s' is not implemented yet (a DeepSpeed JSON configuration); use "
                     "deepspeed_stage_3_offload, deepspeed_stage_2_offload or deepspeed_stage_1_offload (the "
                     "optimizer state and its update on the host), fsdp_cpu_offload or deepspeed_stage_3_offload_nvme "
                     "(the parameters too), --strategy ddp, deepspeed_stage_1, deepspeed_stage_2, "
                     "deepspeed_stage_3, or fsdp with --fsdp.sharding_strategy NO_SHARD, SHARD_GRAD_OP, FULL_SHARD or "
                     "HYBRID_SHARD", what, name);
}

/* Lightning's names that offload the parameters as well: fsdp_cpu_offload (FSDP's CPUOffload(offload_params=True):
 * the parameters' and gradients' shards and the optimizer on the host) and deepspeed_stage_3_offload_nvme
 * (ZeRO-Infinity: parameters and optimizer state on NVMe) */
static int param_offload_name(const char *s) {
    return s && (!strcmp(s, "fsdp_cpu_offload") || !strcmp(s, "deepspeed_stage_3_offload_nvme"));
}

int fl_cfg_offload(const char *s) {
    return s && (!strcmp(s, "deepspeed_stage_1_offload") || !strcmp(s, "deepspeed_stage_2_offload") ||
                 !strcmp(s, "deepspeed_stage_3_offload") || param_offload_name(s));
}

int fl_cfg_param_offload(const fl_run_config *c) {
    const char *d = c->offload_param_device;
    if (d[0] && strcmp(d, "none")) return !strcmp(d, "nvme") ? 2 : 1;
    if (d[0]) return 0; /* none given explicitly */
    return !strcmp(c->strategy, "fsdp_cpu_offload") ? 1 : !strcmp(c->strategy, "deepspeed_stage_3_offload_nvme") ? 2 : 0;
}

int fl_cfg_offload_nvme(const fl_run_config *c) {
    if (c->offload_device[0]) return !strcmp(c->offload_device, "nvme");
    return !strcmp(c->strategy, "deepspeed_stage_3_offload_nvme");
}

fl_status fl_cfg_zero_stage(const char *s, const char *sharding, int *stage) {
    static const char *later[] = {"deepspeed"};
    *stage = 0;
    if (!s[0] || !strcmp(s, "auto") || !strcmp(s, "ddp")) return FL_OK;
    if (!strcmp(s, "deepspeed_stage_1") || !strcmp(s, "deepspeed_stage_1_offload")) { *stage = 1; return FL_OK; }
    if (!strcmp(s, "deepspeed_stage_2") || !strcmp(s, "deepspeed_stage_2_offload")) { *stage = 2; return FL_OK; }
    if (!strcmp(s, "deepspeed_stage_3") || !strcmp(s, "deepspeed_stage_3_offload") || param_offload_name(s)) {
        *stage = 3;
        return FL_OK;
    }
    if (!strcmp(s, "fsdp")) {
        /* Lightning's FSDPStrategy default is FULL_SHARD (ZeRO-3) */
        const char *ss = sharding && sharding[0] ? sharding : "FULL_SHARD";
        if (!strcmp(ss, "NO_SHARD")) return FL_OK;
        if (!strcmp(ss, "SHARD_GRAD_OP")) { *stage = 2; return FL_OK; }
        if (!strcmp(ss, "FULL_SHARD")) { *stage = 3; return FL_OK; }
        /* FULL_SHARD within each node (--devices ranks), replicated across nodes: src/train/fsdp.c */
        if (!strcmp(ss, "HYBRID_SHARD")) { *stage = 3; return FL_OK; }
        if (!strcmp(ss, "_HYBRID_SHARD_ZERO2"))
            return fl_errorf(FL_ERR_UNSUPPORTED, "fsdp.sharding_strategy '%s' is not implemented yet "
                             "(SHARD_GRAD_OP within a node, replicated across nodes); use HYBRID_SHARD (FULL_SHARD "
                             "within a node) or SHARD_GRAD_OP over all ranks", ss);
        return fl_errorf(FL_ERR_INVALID, "fsdp.sharding_strategy '%s': unknown (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, "
                         "HYBRID_SHARD)", ss);
    }
    for (size_t i = 0; i < sizeof later / sizeof later[0]; i++)
        if (!strcmp(s, later[i])) return not_yet("strategy", s);
    return fl_errorf(FL_ERR_INVALID, "strategy '%s': unknown (auto, ddp, deepspeed_stage_1, deepspeed_stage_2, "
                     "deepspeed_stage_3, deepspeed_stage_1_offload, deepspeed_stage_2_offload, deepspeed_stage_3_offload, "
                     "deepspeed_stage_3_offload_nvme, fsdp, fsdp_cpu_offload)",
                     s);
}

int fl_cfg_hybrid_shard(const char *strategy, const char *sharding) {
    return strategy && !strcmp(strategy, "fsdp") && sharding && !strcmp(sharding, "HYBRID_SHARD");
}

fl_status fl_cfg_check_strategy(const char *s) {
    int stage;
    return fl_cfg_zero_stage(s, "SHARD_GRAD_OP", &stage);
}

/* Why FULL_SHARD would refuse this run (NULL: it runs it). The same refusals as fl_fsdp_refusal
 * (src/train/fsdp.c): none today, on host or device memory (a GPU communicator: FULL_SHARD gathers and
 * reduces through it, as LitGPT's FSDP on GPUs). tests/test_config.c checks that auto never picks
 * FULL_SHARD where an explicit fsdp is refused. */
/* auto here keeps DDP on a model-parallel grid: FULL_SHARD / HYBRID_SHARD run there when asked, but not with every
 * composition (the interleaved schedule, a node not holding whole groups). The CLI's training commands and the planner
 * choose for such a grid by the per-rank plan before this (fitllm/plan.h fl_plan_auto_strategy: DDP when it fits, then
 * ZeRO-1/2, FULL_SHARD, the offloads) and pass the choice as given; a library caller's auto gets DDP. */
static const char *full_shard_refusal(const fl_run_config *c, int device_comm) {
    (void)device_comm;
    return c->tensor_parallel > 1 ? "--tensor_parallel" : c->pipeline_parallel > 1 ? "--pipeline_parallel" : NULL;
}

static fl_status resolve_strategy(const fl_run_config *c, int device_comm, fl_strategy_choice *out) {
    memset(out, 0, sizeof *out);
    const int world = fl_cfg_dp_ranks(c); /* the data-parallel axis (tensor parallel splits the model, not the data) */
    int stage = 0;
    FL_TRY(fl_cfg_zero_stage(c->strategy, c->sharding_strategy, &stage));
    const char *s = c->strategy[0] ? c->strategy : "auto";
    if (strcmp(s, "auto") || world < 2) { /* given, or one process: as given */
        snprintf(out->strategy, sizeof out->strategy, "%s", s);
        snprintf(out->sharding, sizeof out->sharding, "%s", c->sharding_strategy);
        snprintf(out->desc, sizeof out->desc, "%s", s);
        out->stage = stage; /* one process: as fl_cfg_zero_stage (its users run one process unsharded) */
        return FL_OK;
    }
    const char *why = c->command == FL_CMD_FINETUNE_LORA ? NULL : full_shard_refusal(c, device_comm);
    if (c->command == FL_CMD_FINETUNE_LORA) {
        snprintf(out->desc, sizeof out->desc, "auto: DDP over the adapters, as LitGPT's finetune_lora");
    } else if (why) {
        snprintf(out->desc, sizeof out->desc, "auto: DDP on the data-parallel axis of a %s grid (the CLI and `fitllm "
                 "plan` choose by the per-rank plan, fl_plan_auto_strategy)", why);
    } else {
        snprintf(out->strategy, sizeof out->strategy, "fsdp");
        /* pretrain across nodes: LitGPT's HYBRID_SHARD (FULL_SHARD within each node of --devices ranks,
         * replicated across the nodes); on one node that is FULL_SHARD, which is what runs */
        int hybrid = c->command == FL_CMD_PRETRAIN && c->num_nodes > 1;
        snprintf(out->sharding, sizeof out->sharding, "%s", hybrid ? "HYBRID_SHARD" : "FULL_SHARD");
        out->stage = 3;
        if (c->command != FL_CMD_PRETRAIN)
            snprintf(out->desc, sizeof out->desc, "auto: fsdp FULL_SHARD, as LitGPT's %s", fl_cfg_command_name(c->command));
        else if (hybrid)
            snprintf(out->desc, sizeof out->desc, "auto: fsdp HYBRID_SHARD, as LitGPT's pretrain (FULL_SHARD within "
                     "each of the %d nodes of %d ranks, replicated across the nodes)", c->num_nodes, c->devices);
        else
            snprintf(out->desc, sizeof out->desc, "auto: fsdp FULL_SHARD, as LitGPT's pretrain (HYBRID_SHARD, on one "
                     "node FULL_SHARD)");
        return FL_OK;
    }
    snprintf(out->strategy, sizeof out->strategy, "ddp");
    return FL_OK;
}

fl_status fl_cfg_resolve_strategy(const fl_run_config *c, int device_comm, fl_strategy_choice *out) {
    FL_TRY(resolve_strategy(c, device_comm, out));
    out->offload = fl_cfg_offload(c->strategy);
    out->param_offload = fl_cfg_param_offload(c);
    const int auto_fsdp = (!c->strategy[0] || !strcmp(c->strategy, "auto")) && !strcmp(out->strategy, "fsdp");
    if (c->train.activation_checkpointing >= 0) {
        out->act_ckpt = c->train.activation_checkpointing != 0;
    } else if (auto_fsdp && c->command == FL_CMD_FINETUNE_FULL) { /* LitGPT: activation_checkpointing_policy={Block} */
        out->act_ckpt = 1;
        size_t n = strlen(out->desc);
        snprintf(out->desc + n, sizeof out->desc - n, ", activation checkpointing per block");
    }
    return FL_OK;
}
