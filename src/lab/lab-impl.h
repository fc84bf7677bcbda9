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


#define LAB_MODEL "lab-1b"
#define COURSE_MAX_SEQ_LENGTH 512 /* the course's recipes (LitGPT config_hub: Alpaca2k, max_seq_length 512) */

/* lab_data.c: the rows' data. A TextFiles folder of random letters (0-val.txt, 1-train.txt) long enough for every
 * row; the real scale's sample-length table (rep->lengths, rep->table); the course's file and tokenizer (rep->data,
 * rep->tokenizer), checked before any row. */
fl_status fl_lab_write_text_dir(const char *dir, int T, long steps, int max_global);
fl_status fl_lab_real_lengths(const fl_lab_opts *o, fl_lab_report *rep);
fl_status fl_lab_course_data(const fl_lab_opts *o, fl_lab_report *rep);

/* lab_report.c: drops the time notes of data-parallel rows no slower per sample than the reduced-batch row */
void fl_lab_time_notes_settle(fl_lab_report *rep);

/* a row with timings: it fit and trained (not --plan-only) */
#define FL_LAB_TIMED(r) ((r)->verdict == FL_LAB_FITS && (r)->ran)
#define FL_LAB_MIB(x) ((double)(x) / 1048576.0)
#define REF_SWEEP_T_PUBLIC 128 /* the course's FSDP benchmark's sequence length */

const char *fl_lab_plan_name(fl_plan_verdict v);
int fl_lab_in_list(const char *list, const char *name); /* name is one of a comma-separated list */
/* an OOM verdict, the run's or (suffix " (planned; not run)") its plan's: the note names the allocation that failed */
void fl_lab_set_oom(fl_lab_row *r, const fl_mem_oom *oom, const char *suffix);
void fl_lab_gpu_cells(const fl_lab_row *r, char *u, size_t un, char *m, size_t mn); /* "mean +- std" or "-" */
/* text in lines of at most width columns, the first after prefix, the rest indented (never cut) */
void fl_lab_wrap(FILE *f, const char *prefix, const char *text, int width, int indent); /* "fits", "OOM", "n/a", "?" */
/* a row's console line: name, verdict, time, peak or note; a failed write (EPIPE: the reader went away) FL_ERR_IO with
 * rep->out_errno */
fl_status fl_lab_print_row(FILE *out, const fl_lab_row *r, fl_lab_report *rep);
/* o->stop polled into rep->stopped (once set, kept): non-zero = stop */
int fl_lab_stop_polled(const fl_lab_opts *o, fl_lab_report *rep);
/* lab_sweep.c: the fsdp suite's tables, chart data and script; a row's setting (2 x 16-bit + checkpointing) */
int fl_lab_sweep_group(const fl_lab_row *r);
void fl_lab_sweep_print(const fl_lab_report *rep, FILE *f);
/* the row's "as in the lab": the course's verdict where it ran the row, else none (FL_LAB_NA); why they differ */
void fl_lab_sweep_course_verdict(const fl_lab_report *rep, fl_lab_row *r);
void fl_lab_sweep_md(FILE *f, const fl_lab_report *rep, int charts);
int fl_lab_sweep_data(const fl_lab_report *rep, FILE *f, int idx[4], int fit[4]);
void fl_lab_sweep_script(const fl_lab_report *rep, FILE *f, const int idx[4], const int fit[4]);
/* The course's figures for a fsdp row (16-mixed; 0: none): memory MB (0: OOM), GPU util %, TFLOP/s, iteration ms */
int fl_lab_course_fsdp(const fl_lab_report *rep, const fl_lab_row *r, double *mem_mb, double *util, double *tflops,
                       double *iter_ms);

/* lab_course.c: the course's runs table, console and report.md */
void fl_lab_course_print(const fl_lab_report *rep, FILE *f);
void fl_lab_course_md(FILE *f, const fl_lab_report *rep);
/* lab_peer_rows.c: --peer pytorch for the lab's rows (at the real scale: the plan p of the real model) */
void fl_lab_row_peer(const lab_exp *e, int ranks, const fl_plan *p, fl_lab_row *r);
void fl_lab_b2_row_peer(const lab_exp *e, int ranks, const fl_blip2_config *real, int T, fl_lab_row *r);
/* PyTorch's modelled figure for a BLIP-2 row (q), whether or not --peer is given; 0: the row is not modelled */
int fl_lab_b2_peer_of(const lab_exp *e, int ranks, const fl_blip2_config *real, int T, fl_lab_peer *q);
void fl_lab_peer_rows_print(const fl_lab_report *rep, FILE *f);
void fl_lab_peer_rows_md(FILE *f, const fl_lab_report *rep);
void fl_lab_peer_json(FILE *f, const fl_lab_peer *q);
/* why fitllm's plan of r differs from PyTorch's figure, in GB by category ("" when fitllm has no real-scale plan) */
void fl_lab_peer_why(const fl_lab_report *rep, const fl_lab_row *r, char *b, size_t n);
/* the category (weights, gradients, optimizer state, activations, the rest: d[i] = fitllm - PyTorch) the "why" names
 * for a difference total: the largest with total's sign */
int fl_lab_peer_why_category(const double d[5], double total);
/* real scale: where the row's plan p differs from the course (its verdict e->expected; its memory reading), why */
void fl_lab_row_course_diff(const lab_exp *e, const fl_plan *p, fl_lab_row *r);
/* lab_gpu.c: GPU utilization and memory through NVML (fitllm/gpu_monitor.h) */
#include "fitllm/gpu_monitor.h"
void fl_lab_gpu_stop(fl_gpu_monitor *g, fl_lab_row *r); /* fl_gpu_monitor_stop into the row's gpu_* */

/* lab_blip2.c: the blip2 suite (fl_lab_run's for suite "blip2"), its names, a row's shape (lab: the lab scale's) */
#include "fitllm/blip2.h"
fl_status fl_lab_blip2_run(const fl_lab_opts *o, FILE *out, fl_lab_report *rep);
const char *const *fl_lab_blip2_names(void);
fl_status fl_lab_blip2_shape(const char *real, int lab, fl_blip2_config *c);
void fl_lab_blip2_md_scaling(FILE *f, const fl_lab_report *rep); /* report.md's scale section */
void fl_lab_blip2_short(char *model); /* the console's name: "blip2-" and "flan-" dropped (lab-opt-2.7b, t5-xxl) */

#endif
