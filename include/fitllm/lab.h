/* fitllm: the memory lab (`fitllm lab`, `make demo`).
 *
 * Reproduces the sequence of experiments of the course lab (BRIEF section 5):
 * baseline, reduced batch, gradient accumulation (with and without the LR
 * scaled), bf16-true, bf16-mixed, larger models, SGD, 8-bit Adam, activation
 * checkpointing, CPU offload, LoRA, QLoRA, DDP, FSDP, on the lab's models
 * scaled to a CPU (presets lab-1b, lab-3b, lab-7b: widths / 16) with a memory
 * budget scaled the way an 80 GB GPU relates to TinyLlama-1.1B:
 *
 *   budget = 80 GB x params(lab-1b) / params(tinyllama-1.1b)
 *   T      = the sequence length at which one sample's activations per
 *            parameter of lab-1b equal those of a 1024-token sample of
 *            TinyLlama (both from fl_sizing_acts)
 *
 * so every experiment's bytes relate to the budget as the real run's relate
 * to the 80 GB GPU. Each runnable experiment is a fl_run_config run through
 * fl_trainer_run (Synthetic data, built-in byte tokenizer, random init, a few
 * steps, max_memory = the budget); an OOM is a verdict, not a failure; a
 * technique this build lacks is "not available". Every row is also planned
 * (fitllm plan) at lab scale and at the real scale (the real model, 80 GB).
 *
 * Library code: progress and the table go to the FILE* given; files are
 * written by fl_lab_write. Charts need gnuplot (optional).
 */
#ifndef FITLLM_LAB_H
#define FITLLM_LAB_H

#include <stdio.h>

#include "fitllm/blip2.h"
#include "fitllm/lengths.h"
#include "fitllm/mem.h"
#include "fitllm/plan.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_LAB_JSON_VERSION 2 /* 2: peak_min, peak_max, ran, mfu, prefetch; the course's figures (fsdp) */

typedef enum { FL_LAB_FITS = 0, FL_LAB_OOM, FL_LAB_NA, FL_LAB_ERROR, FL_LAB_VERDICT_COUNT } fl_lab_verdict;
const char *fl_lab_verdict_name(fl_lab_verdict v); /* "fits", "OOM", "n/a", "error" */

/* `--peer pytorch`: what PyTorch (HF LlamaForCausalLM, GPT2LMHeadModel, OPTForCausalLM, T5ForConditionalGeneration or
 * Blip2ForConditionalGeneration, sdpa;
 * torch.optim.AdamW, SGD or bitsandbytes' AdamW8bit;
 * autocast; HF checkpointing; PEFT LoRA, bitsandbytes NF4) allocates for one step on one device, bytes. params,
 * quant, grads, optim, saved (autograd's saved tensors) and logits are fitted byte for byte to measurements
 * (tests/ref/pytorch_alloc.py); transient, recompute, step_temp, comm, host and peak are modelled
 * (src/lab/lab_peer.c). */
typedef struct {
    size_t params, quant, grads, optim, saved, logits, transient, step_temp, peak;
    size_t trainable;      /* trainable parameters (LoRA: the adapters) */
    size_t recompute;      /* checkpointing: one layer's saved tensors, live while it is recomputed in backward */
    size_t comm;           /* DDP's gradient buckets; FSDP's gathered blocks and their full gradients */
    size_t host;           /* ZeRO-2 offload: what the host holds (state, fp32 gradients, fp32 master) */
    size_t dev_grads, dev_optim; /* what of grads and optim is on the device (per rank; offload: the bucket) */
    int peak_at;           /* where the peak is: FL_PEER_AT_* */
} fl_lab_peer;
/* fl_lab_peer.peak_at: the start of the backward (the saved tensors and the logits' gradients live), its end (the
 * gradients, the saved tensors freed), the optimizer step (its temporary), a checkpointed block's recompute */
enum { FL_PEER_AT_BWD_START = 0, FL_PEER_AT_BWD_END, FL_PEER_AT_STEP, FL_PEER_AT_RECOMPUTE };

/* One step's setup for fl_lab_peer_pytorch_setup (zero: a full fine-tune with AdamW on one device). */
typedef struct {
    const char *precision;   /* 32-true, bf16-true, bf16-mixed (autocast bf16), 16-mixed (autocast fp16) */
    int B, T;
    int T_dec;               /* an encoder-decoder (Flan-T5): the decoder's length (the labels'); T is the encoder's */
    int act_ckpt;            /* HF gradient checkpointing (reentrant): each layer's input saved, recomputed */
    int lora_r;              /* > 0: PEFT LoRA of rank r on query and value (dropout > 0), fp32 adapters (GPT-2: c_attn) */
    int nf4;                 /* with lora_r: QLoRA, the block linears in bitsandbytes NF4, computing in the precision's
                              * dtype (32-true: fp32, bf16-true: bf16) */
    const char *optim;       /* "adamw" (NULL), "sgd" (no momentum), "adamw8bit" (bitsandbytes) */
    int cpu_dropout;         /* 1: dropout as the CPU runs it (fp32 noise: the fixture's); 0: CUDA's bool mask */
    int offload;             /* DeepSpeed ZeRO-2 offload: the optimizer on the host (modelled) */
    int ranks;               /* > 1: per rank under strategy "ddp" or "fsdp" (modelled) */
    const char *strategy;
    int dq;                  /* with nf4: bitsandbytes' double quantization (the absmax in 8 bits) */
    int lora_proj;           /* GPT-2 LoRA: PEFT's "c_proj" target too (attn.c_proj and mlp.c_proj: the suffix matches
                              * both) beside c_attn (query and value are in c_attn) */
} fl_lab_peer_setup;


typedef struct {
    const char *suite;     /* "quick" (default), "full", "ci" (the unit tests' subset), "fsdp" (the batch-size
                            * sweep of the course's GPT-2-XL FSDP benchmark, 4 ranks FULL_SHARD, T 128 scaled) or
                            * "blip2" (the course's BLIP-2 image-caption sequence, src/lab/lab_blip2.c) */
    const char *only;      /* comma-separated experiment names, NULL = all of the suite (fsdp: [amp-]b<B>[-ckpt],
                            * B of the course's list 1 2 4 7 8 9, with checkpointing also 16 32 64; amp- = 16-mixed) */
    const char *precisions; /* fsdp suite: comma-separated, of 32-true and 16-mixed (the course's AMP); NULL both */
    const char *model;     /* fsdp suite: gpt2-xl (default) or gpt2-xxl (the course's ~3 B GPT); the lab scale runs
                            * its lab- preset */
    int seq_len;           /* fsdp suite at lab scale: T (0 = 128 scaled as the model, fl_lab_scale_fsdp) */
    int no_backward_prefetch; /* fsdp suite: 1 = every row with --fsdp.backward_prefetch off (default on) */
    double peak_tflops;    /* the device's peak TFLOP/s for MFU; 0 = a known GPU's by name (16-bit tensor or fp32
                            * by the row's precision), none on a CPU */
    int threads;           /* 0 = all cores */
    int steps;             /* optimizer steps per runnable experiment; 0 = the suite's */
    const char *run_dir;   /* where the runs' out_dirs go (logs); NULL = a temporary folder ($TMPDIR or /tmp), removed */
    size_t budget;         /* per-device budget in bytes; 0 = the scaled one (fl_lab_scale); the tests set a
                            * smaller one to reach the OOM at a small micro batch */
    int real_scale;        /* 1: the real models (tinyllama-1.1b, open-llama-3b/7b) at T 1024 on an 80 GB budget,
                            * for an 80 GB GPU; the data-parallel rows are n/a (they need 4 devices); not with the
                            * fsdp suite */
    const char *lengths;   /* real scale, quick/full suites: the sample-length table the rows draw their samples'
                            * lengths from (Synthetic data.lengths, cut to the course's max_seq_length 512); NULL =
                            * recipes/data/alpaca-lengths.tsv, looked up from the working directory, then from the
                            * executable's folder's parent; "fixed" = every sample T + 1 = 1025 tokens (byte text) */
    const char *peer;      /* "pytorch": beside each of the course's runs, what PyTorch would allocate
                            * (fl_lab_peer_pytorch); NULL: none */
    int run_oom;           /* 1: also train the rows the plan says OOM, to see the allocator refuse them (the plan's
                            * verdict is the run's: tests/test_plan.c); 0 (default): such a row is decided by its plan
                            * before any model memory is touched (fl_lab_row.ran 0), so it costs the plan's < 1 s
                            * instead of the model's load and random init */
    int plan_only;         /* 1: no row trains: each row's verdict and memory are its plan's (seconds for the whole
                            * suite at any scale; `--plan-only`) */
    const char *data;      /* quick/full suites: the course's own data, an Alpaca-style JSON / JSONL file (the recipes'
                            * data/alpaca2k/alpaca2k.json) the rows fine-tune on instead of Synthetic, each sample cut
                            * to max_seq_length (real scale: the course's 512; lab scale: T + 1); NULL = at the real
                            * scale data/alpaca2k/alpaca2k.json when it is present in the working directory, else none */
    const char *tokenizer; /* with data: the tokenizer folder (the real model's, e.g. TinyLlama's); NULL = the built-in
                            * bytes (each byte a token: samples about 4x longer than with the LLaMA tokenizer) */
    int (*stop)(void *ud); /* NULL, or polled before each row and after each training step (on every rank of a
                            * row's): non-zero (the CLI's: a stop signal's number) ends the run there, the row in
                            * training dropped; fl_lab_run returns FL_OK with fl_lab_report.stopped set */
    void *stop_ud;
} fl_lab_opts;

void fl_lab_opts_default(fl_lab_opts *o);

typedef struct {
    char name[32];             /* "baseline" */
    char lab_step[96];         /* the lab's change, e.g. "full fine-tune, fp32, batch 32" */
    char expect[64];           /* what the lab observes */
    char model[32], ref_model[32];
    int B, accum, T;
    char precision[16];
    char optimizer[24];
    int act_ckpt;
    char technique[32];        /* technique the row needs ("" = none) */
    fl_lab_verdict verdict;
    fl_lab_verdict expected;   /* the lab's verdict (FL_LAB_FITS or FL_LAB_OOM) */
    char note[1024];           /* refusals and errors in full (issue 33: notes are wrapped, never cut) */
    /* measured (fits: all-time peaks of the run; OOM: what was live at the failure) */
    size_t peak[FL_TAG_COUNT];
    size_t peak_total;
    fl_mem_oom oom;
    long steps;
    double step_ms, tok_s, final_loss, wall_s;
    /* planned at lab scale (needed bytes, no budget) and the planned verdict under the budget */
    fl_plan_verdict planned;
    size_t planned_peak;
    size_t planned_tag[FL_TAG_COUNT];
    /* planned at the real scale: the real model, T 1024, 80 GB */
    fl_plan_verdict ref_planned;
    size_t ref_peak;
    size_t ref_tag[FL_TAG_COUNT]; /* its peak per tag (--peer pytorch's "why fitllm differs", by category) */
    /* reserved and live bytes per tag at each phase (after_load, before_fwd, after_fwd,
     * after_bwd, after_opt_step): measured for runs that fit, planned (no budget) otherwise */
    fl_mem_phase phases[FL_PLAN_MAX_PHASES];
    int n_phases;
    int phases_planned;        /* 1: phases come from the plan (the run did not fit) */
    char time_note[256];       /* why a step costs more than the baseline's per sample ("" none) */
    int ranks;                 /* data-parallel rows (ddp, fsdp): ranks run as threads of this process, each with
                                * its own pool and budget; memory and phases are rank 0's, tok/s the global
                                * batch's; 1 otherwise */
    double tflops;             /* model FLOP/s of the step (fl_model_train_flops: 6 N per token + attention, no
                                * recompute) in TFLOP/s, runs that fit */
    size_t peak_min, peak_max; /* several ranks: the least and the most peak_total over the ranks (the course
                                * reports every multi-GPU figure as such a range); one rank: peak_total */
    int ran;                   /* 1: the row trained (its verdict and memory are the run's); 0: it did not (n/a, or OOM
                                * decided by its plan: memory is what the plan had live at the failed allocation) */
    long gpu_samples;          /* NVML samples of device 0 while the row trained (0: none: see fl_lab_report.gpu_note) */
    double gpu_util_mean, gpu_util_std; /* GPU utilization %, mean and standard deviation over the samples */
    double gpu_mem_mean, gpu_mem_std;   /* the device's used bytes (every process), mean and standard deviation */
    double mfu;                /* tflops / the device's peak at the row's precision (0: no peak known) */
    int prefetch;              /* fsdp rows: fsdp.backward_prefetch on */
    int largest;               /* fsdp sweep: 1 on the largest micro batch that fits for its checkpointing setting */
    /* --peer pytorch: what PyTorch would need for the row at the real scale (the real model, the real plan's T and
     * the row's micro batch, per rank), fl_lab_peer_pytorch_setup; peer_note: what of it is measured / modelled, or
     * why it is not modelled */
    int peer_ok;
    fl_lab_peer peer;
    int peer_T;
    char peer_note[256];
    /* real scale (quick, full): the course's memory reading of the same run (GB, 0: none) and, where the row's plan
     * differs from the course (verdict, or leaner by more than 5%), why in bytes (fl_lab_row_course_diff) */
    double course_gb;
    char course_why[640];
} fl_lab_row;

/* One of the course's runs at its own settings (max_seq_length 512, its 80 GB GPU) beside fitllm's plan of it
 * (src/lab/lab_course.c; quick and full suites). */
typedef struct {
    char name[32], step[96], model[32], precision[16];
    int B, global, T;
    fl_lab_verdict course_verdict; /* the course's */
    double course_gb;          /* the course's memory reading in GB (1e9 bytes); 0: not known */
    fl_plan_verdict planned;   /* fitllm's plan for a CUDA device of 80e9 bytes */
    size_t peak, peak_tag[FL_TAG_COUNT];
    double logits_bytes;       /* the fp32 logits PyTorch keeps for the micro batch (B x T x V x 4) */
    char why[480];             /* where fitllm differs (verdict, or leaner by more than 5%): why, in bytes */
    int devices;               /* ranks (1: one GPU) */
    double device_gb;          /* each device's memory, GB (the course's 80; the textbook's GPT-2-XL: 24) */
    int offload;               /* ZeRO-3 with the optimizer and the parameters in host memory (issue 34) */
    size_t host_peak;          /* offload: the host tier's planned peak per rank */
    fl_plan_verdict plain;     /* offload: the same run with everything on the device (deepspeed_stage_3) */
    size_t plain_peak;
    char note[320];            /* offload: the device / host split and the plain run's verdict */
    int peer_ok;               /* --peer pytorch: 1 = peer holds PyTorch's modelled allocation of the same run */
    fl_lab_peer peer;
    char peer_note[200];       /* --peer pytorch, not modelled: why */
} fl_lab_course;

#define FL_LAB_MAX_COURSE 8

typedef struct {
    char suite[16];
    fl_lab_row *rows;
    int n;
    size_t budget;             /* lab budget (bytes) */
    size_t ref_device;         /* 80 GB */
    int T, ref_T;
    double param_ratio;        /* params(lab-1b) / params(tinyllama-1.1b) */
    double act_ratio_ref, act_ratio_lab; /* activation bytes per sample per parameter */
    double wall_s;
    int threads;
    int n_errors;
    int sweep;                 /* 1: the fsdp suite (report.md gets the sweep tables, sweep.png) */
    int real_scale;            /* 1: rows ran the real models at ref_T on ref_device (fl_lab_opts.real_scale) */
    int plan_only;             /* fl_lab_opts.plan_only: the rows' verdicts are their plans' */
    int blip2;                 /* the blip2 suite: T is the captions' tokens, ref_model blip2-opt-2.7b (src/lab/lab_blip2.c) */
    size_t capacity;           /* real scale: the memory of the device the rows run on (GPU memory, or the host's
                                * RAM for the CPU); rows are n/a when it is below the budget */
    int no_prefetch;           /* fsdp suite: every row ran with --fsdp.backward_prefetch off */
    fl_lab_course course[FL_LAB_MAX_COURSE]; /* the course's runs beside fitllm's plans (quick, full suites) */
    int n_course;
    int peer_pytorch;          /* --peer pytorch: the course's runs carry PyTorch's modelled allocation */
    char gpu_note[200];        /* how GPU utilization was sampled ("NVML, device 0, every 100 ms") or why not */
    char sweep_model[32];      /* fsdp suite: gpt2-xl or gpt2-xxl (the real model; the rows run its lab- preset at
                                * lab scale) */
    double peak_tflops[2];     /* the peak used for MFU: [0] fp32 rows, [1] 16-bit rows (0: unknown) */
    char peak_source[96];      /* where the peak comes from ("--peak-tflops", "NVIDIA H100 ...: 989 / 67") */
    char lengths[4096];        /* real scale (quick, full): the table the rows' sample lengths are drawn from ("" =
                                * fixed lengths, text_dir); each row's T is then its plan's (the longest draw - 1) */
    fl_lengths table;          /* its content (lengths[0] != 0) */
    int max_seq_length;        /* with lengths: the samples are cut to this (the course's recipes: 512) */
    char text_dir[4200];       /* real scale: TextFiles folder of byte text the rows train on (every sample
                                * ref_T + 1 tokens: Synthetic's records are ~200 tokens, so the run's T would be
                                * theirs, not ref_T); "" at lab scale (Synthetic, whose samples are longer than T) */
    char data[4096];           /* fl_lab_opts.data as used ("" = synthetic): the rows' Alpaca-style JSON */
    char tokenizer[4096];      /* with data: its tokenizer folder ("" = the built-in bytes) */
    int stopped;               /* fl_lab_opts.stop's value that ended the run (0: it ran to the end); rows holds the
                                * rows finished before it, the course's plans are not made */
    int out_errno;             /* a write to fl_lab_run's out failed (EPIPE: its reader went away): the errno; the
                                * run ended there with FL_ERR_IO */
} fl_lab_report;

/* LLaMA or GPT-2 shapes, a full fine-tune with AdamW at precision (else FL_ERR_UNSUPPORTED naming what is not
 * modelled). */
fl_status fl_lab_peer_pytorch(const fl_model_config *mc, size_t n_params, int B, int T, const char *precision,
                              fl_lab_peer *out);
/* The same for a setup (FL_ERR_UNSUPPORTED naming what is not modelled). */
fl_status fl_lab_peer_pytorch_setup(const fl_model_config *mc, size_t n_params, const fl_lab_peer_setup *u,
                                    fl_lab_peer *out);
/* BLIP-2 (HF Blip2ForConditionalGeneration: the vision tower frozen, the Q-Former, query tokens, projection and the
 * language model trained in full, AdamW, SGD or bitsandbytes' AdamW8bit; or PEFT LoRA / QLoRA on the language
 * model's query and value, all else frozen; autocast and HF checkpointing with either): u->T is the caption's length (OPT reads the queries' placeholders
 * then the caption; Flan-T5's encoder the placeholders, its decoder the caption); the figures cover all three parts
 * (tests/ref/pytorch_alloc.py blip2). */
fl_status fl_lab_peer_pytorch_blip2(const fl_blip2_config *c, const fl_lab_peer_setup *u, fl_lab_peer *out);

/* The scaling alone (budget, T, ratios), without running anything. */
fl_status fl_lab_scale(fl_lab_report *rep);
/* The fsdp suite's scaling for model (gpt2-xl or gpt2-xxl, NULL gpt2-xl): the course's device (a 16 GB V100:
 * 16 GiB per rank) and T 128 at the real scale (ref_device, ref_T); budget = 16 GiB x params(lab-<model>) /
 * params(model) and T = the length at which lab-<model>'s activations per parameter of a sample equal model's
 * at T 128. */
fl_status fl_lab_scale_fsdp(const char *model, fl_lab_report *rep);
/* Plan the course's runs at its settings into rep->course (what fl_lab_run does for the quick and full suites). */
fl_status fl_lab_course_plans(fl_lab_report *rep);
/* Run the suite; progress and the table go to out (may be NULL). Rows that
 * error are recorded (verdict error, note) and counted in rep->n_errors; the
 * call fails only on a bad suite / --only name or when the runs cannot start. */
fl_status fl_lab_run(const fl_lab_opts *o, FILE *out, fl_lab_report *rep);
void fl_lab_report_free(fl_lab_report *rep);
/* Print the results table. */
void fl_lab_print_table(const fl_lab_report *rep, FILE *f);
/* Write report.md, results.csv, phases.csv, results.json and (with gnuplot)
 * memory.png, phases.png and step_time.png into dir (created); charts.gp names
 * its files relative to dir (re-run it with `cd dir && gnuplot charts.gp`). *charts_out = 1 when the PNGs were drawn;
 * a missing gnuplot is noted in report.md, not an error. */
fl_status fl_lab_write(const fl_lab_report *rep, const char *dir, int *charts_out);
/* Names of the experiments of a suite ("quick", "full", "ci", "fsdp": its candidate rows [amp-]b<B>[-ckpt], run
 * per setting up to the first the plan says OOM; "blip2"), NULL-terminated; NULL if no such suite. */
const char *const *fl_lab_experiments(const char *suite);

#ifdef __cplusplus
}
#endif
#endif
