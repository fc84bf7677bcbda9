/* The small training runs the trainer's tests share (tests/test_trainer.c, tests/test_trainer_lora.c): the micro
 * preset on Synthetic data, a recorder of each step's loss and trained parameters, LitGPT's finetune_lora defaults. */
#ifndef FL_TESTS_TRAINER_RUNS_H
#define FL_TESTS_TRAINER_RUNS_H

#include <stddef.h>

#include "fitllm/config.h"

/* 8 steps of the micro preset (built-in byte tokenizer) on Synthetic data into out_dir, a checkpoint every 4 */
void small_run(fl_run_config *c, const char *out_dir);

typedef struct {
    double loss[64];
    float *params; /* raw bytes of the trained parameters (fp32 unless a 16-bit policy) */
    size_t numel;  /* bytes / 4 */
    long steps;
    long stop_at;
    char dir[600]; /* the run's out_dir (resume_case_ex) */
} rec;

/* an fl_step_hook: each step's loss and the trained parameters into the rec ud; stops at rec.stop_at */
int record(void *ud, long step, double loss, const void *params, size_t bytes);
/* LitGPT's finetune_lora defaults on top of the small run, with dropout on and the MLP adapted */
void lora_run(fl_run_config *c);

#endif
