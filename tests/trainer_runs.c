/* The small training runs the trainer's tests share (tests/trainer_runs.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_runs.h"

void small_run(fl_run_config *c, const char *out_dir) {
    fl_cfg_defaults(c, FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "micro"); /* preset + built-in byte tokenizer */
    snprintf(c->out_dir, sizeof c->out_dir, "%s", out_dir);
    c->data.kind = FL_DATA_SYNTHETIC;
    c->data.synthetic_train = 64;
    c->data.synthetic_val = 8;
    c->train.global_batch_size = 4;
    c->train.micro_batch_size = 2;
    c->train.lr_warmup_steps = 2;
    c->train.max_steps = 8;
    c->train.save_interval = 4;
    c->train.max_seq_length = 96;
    c->eval.interval = 4;
    c->eval.max_iters = 2;
    c->optimizer.lr = 3e-3f;
    c->threads = 2;
    c->seed = 7;
}

int record(void *ud, long step, double loss, const void *params, size_t bytes) {
    rec *r = ud;
    if (step <= 64) r->loss[step - 1] = loss;
    r->steps = step;
    free(r->params);
    r->params = malloc(bytes + 4);
    memcpy(r->params, params, bytes);
    r->numel = bytes / sizeof(float);
    return r->stop_at > 0 && step == r->stop_at;
}

void lora_run(fl_run_config *c) {
    /* LitGPT finetune_lora defaults on top of the small run, with dropout on */
    fl_run_config d;
    fl_cfg_defaults(&d, FL_CMD_FINETUNE_LORA);
    c->command = FL_CMD_FINETUNE_LORA;
    c->lora = d.lora;
    c->lora.dropout = 0.1f;
    c->lora.mlp = 1;
}
