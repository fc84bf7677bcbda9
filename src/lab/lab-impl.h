/* The lab's private pieces: the experiment table entry. */
#ifndef FL_LAB_IMPL_H
#define FL_LAB_IMPL_H

#include "fitllm/lab.h"
#include "fitllm/train.h"

typedef struct {
    const char *name;         /* row name, also for --only */
    const char *lab_step;     /* the lab's change */
    const char *expect;       /* what the lab observes */
    const char *ref_model;    /* the model of the real lab (planned at 80 GB) */
    const char *lab_model;    /* its scaled preset (run here) */
    int B, global;            /* micro batch, global batch (accumulation = global / B) */
    float lr_mult;            /* x 1e-3 */
    const char *precision;
    fl_optim_kind optim;
    int act_ckpt;
    const char *technique;    /* technique the row needs ("" none), a k_tech name */
    fl_lab_verdict expected;  /* the lab's verdict */
    int suites;               /* SUITE_* bits */
} lab_exp;

#endif
