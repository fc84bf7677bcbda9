/* The BLIP-2 fixtures' training batch (tests/fixtures/blip2-tiny-opt, blip2-tiny-t5: expected.safetensors from
 * tests/ref/make_blip2_fixture.py) and one training pass over it, shared by the BLIP-2 precision and QLoRA tests. */
#ifndef FL_TESTS_BLIP2_BATCH_H
#define FL_TESTS_BLIP2_BATCH_H

#include <stdint.h>

#include "fitllm/blip2.h"
#include "fitllm/io.h"

typedef struct {
    int t5, B, T, Tt, n_valid; /* T: the ids' rows (T5: the source's), Tt: T5's target rows */
    const int32_t *ids, *dec;  /* dec: T5's decoder input */
    int32_t *tg;               /* the targets (OPT: row NQ + i predicts caption[i + 1]; T5: the labels) */
    const float *px;
    fl_st_file x;              /* expected.safetensors: the batch and the float64 reference */
} b2_batch;

/* The test backend (FITLLM_TEST_BACKEND) and its pools. */
typedef struct {
    fl_backend be;
    fl_mem_pool pool, host;
} b2_env;
void b2_env_open(b2_env *e);
void b2_env_close(b2_env *e);

/* The batch of dir's expected.safetensors (fails the test on a missing tensor). */
void b2_batch_open(b2_batch *c, const char *dir, int t5);
void b2_batch_close(b2_batch *c);
/* Elements of the logits of a pass over it. */
size_t b2_batch_logits(const b2_batch *c, const fl_blip2 *b);
/* One training forward (grad scale 1 / valid targets; logits into lg, may be NULL) and the backward, the gradients
 * zeroed first (the LoRA adapters' too); the mean loss into *loss (NAN if a step failed). */
void b2_batch_fwd_bwd(fl_blip2 *b, const b2_batch *c, float *lg, float *loss);

#endif
