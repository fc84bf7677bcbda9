/* T5 on pipeline stages composed with FULL_SHARD on the data axis and with sequence parallelism (issue 35): the
 * trainer's ranks as threads on the cpu backend and (the full tier: its NCCL stand-in's waits take ~1 s a grid) the
 * opaque backend (its memory reached only through the ops and copies), against one process on the cpu backend (opaque
 * runs the CPU kernels). The tiny gated config at vocab 500 with 4 heads (TP 2
 * splits them), the fixture pairs cut to 8 source / 4 target tokens, micro-batch 1, global batch 4, 2 AdamW steps.
 *   - DP 2 x PP 2 under fsdp (FULL_SHARD, 1F1B): each stage's units sharded over the axis, the root units gathered
 *     again before each backward, the shared embedding's and tables' parts summed over the pipeline;
 *   - TP 2 x PP 2 with --sequence_parallel (1F1B): the streams as the rank's rows, d(encoder output) as each rank's
 *     partial sum, reduce-scattered where the encoder's norm runs.
 * Each grid's losses within ddp_ref.h's 1e-6 relative of one process's at every step (the pipeline's and the axis'
 * sums reassociate fp32 terms; under mpirun the same grids are 6.4e-9 and 1.6e-8: tests/mpi_t5_test.sh). The check
 * can fail: leaving the shared parts out of the pipeline's sum misses by
 * 8.4e-3, the reduce-scatter on a stage without decoder blocks (TP 2 x PP 3) by 2.7e-4 (docs/ARCHITECTURE.md). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "ddp_ref.h"
#include "test.h"

/* the fixture folder with 4 heads */
static int t5g_model(const char *tmp, char *dir, size_t n) {
    snprintf(dir, n, "%s/t5g", tmp);
    if (fl_test_t5_folder(dir, "t5-tiny-gated") != 0) return -1;
    char p[800];
    snprintf(p, sizeof p, "%s/config.json", dir);
    size_t len = 0;
    char *s = fl_test_slurp(p, &len), *h = s ? strstr(s, "\"num_heads\": 3") : NULL;
    FILE *f = h ? fopen(p, "wb") : NULL;
    if (f) fprintf(f, "%.*s\"num_heads\": 4%s", (int)(h - s), s, h + 14);
    if (f) fclose(f);
    free(s);
    return f ? 0 : -1;
}

static void t5g_config(fl_run_config *c, const char *tmp, const char *model, const char *tag, int devices) {
    fl_cfg_defaults(c, FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "%s", model);
    snprintf(c->out_dir, sizeof c->out_dir, "%s/t5g-%s", tmp, tag);
    c->init_random = 1;
    c->data.kind = FL_DATA_JSON;
    snprintf(c->data.json_path, sizeof c->data.json_path, "tests/fixtures/t5-pairs/pairs.json");
    c->data.max_source_length = 8;
    c->data.max_target_length = 4;
    c->devices = devices;
    c->train.micro_batch_size = 1;
    c->train.global_batch_size = 4;
    c->train.max_steps = 2;
    c->train.save_interval = 0;
    c->train.lr_warmup_steps = 0;
    c->eval.interval = 100;
    c->eval.max_new_tokens = 0;
    c->eval.final_validation = 0;
    c->threads = 1;
    c->overwrite = 1;
}

FL_TEST(pp_t5_full_shard_and_sequence_parallel) {
    char tmp[600], model[700];
    snprintf(tmp, sizeof tmp, "%s", fl_test_tmpdir()); /* one folder for every rank's configuration */
    FL_REQUIRE(t5g_model(tmp, model, sizeof model) == 0);
    dr_rec one;
    memset(&one, 0, sizeof one);
    fl_run_config c;
    t5g_config(&c, tmp, model, "one", 1);
    fl_trainer_result r;
    FL_REQUIRE_OK(fl_trainer_run_comm(&c, NULL, NULL, 0, dr_record, &one, &r));
    static const char *backends[2] = {"cpu", "opaque"};
    const int nb = fl_test_quick() ? 1 : 2;
    for (int g = 0; g < 2 * nb; g++) {
        const char *be = backends[g / 2];
        dr_job *j = calloc(1, sizeof *j);
        FL_REQUIRE(j != NULL);
        for (int k = 0; k < 4; k++) {
            fl_run_config *x = &j->cfg[k];
            t5g_config(x, tmp, model, g % 2 ? "sp" : "fsdp", 4);
            x->pipeline_parallel = 2;
            if (g % 2) x->tensor_parallel = 2, x->sequence_parallel = 1;
            else snprintf(x->strategy, sizeof x->strategy, "fsdp");
        }
        setenv("FITLLM_BACKEND", be, 1);
        const fl_status s = fl_comm_threads_run(4, dr_job_rank, j);
        unsetenv("FITLLM_BACKEND");
        const char *what = g % 2 ? "TP 2 x PP 2 sequence parallel" : "DP 2 x PP 2 FULL_SHARD";
        FL_CHECKF(s == FL_OK, "%s on %s: %s", what, be, j->msg[0][0] ? j->msg[0] : j->msg[1]);
        const double w = dr_loss_rel(&j->rec[0], &one, 2);
        FL_CHECKF(w <= 1e-6, "%s on %s: losses %.3g relative from one process's", what, be, w);
        if (getenv("FL_TEST_VERBOSE")) printf("    %s on %s: %.3g of one process\n", what, be, w);
        for (int k = 0; k < DR_JOB_RANKS; k++) dr_free(&j->rec[k]);
        free(j);
    }
    dr_free(&one);
}
