/* fitllm: pipeline parallelism (issue 35 item 2; EXPERIMENTAL): the schedules, the stage split, a model stage
 * and the pipelined training step.
 *
 * A pipeline of S stages holds contiguous blocks of the model's layers (fl_pp_split balances them by a per-layer
 * cost); a step's M micro-batches (the gradient accumulation steps) flow forward through the stages and their
 * gradients backward, the activations and activation gradients between neighbouring stages travelling with
 * fl_comm_send / fl_comm_recv. fl_pp_schedule_ops gives each stage's order of work:
 *   GPipe: every forward, then every backward (M micro-batches' activations in flight at each stage);
 *   1F1B:  stage s runs min(S - s - 1, M) warm-up forwards, then alternates one forward and one backward, then
 *          the remaining backwards: at most min(S - s, M) micro-batches in flight (stage 0 the most).
 * In both, a stage's backwards run in micro-batch order 0, 1, ..., M - 1, the order a single process accumulates
 * its micro-batches' gradients in, so a pipeline's gradient sums are the single process's bit for bit where each
 * layer's math is unchanged (tests/test_pp.c runs a toy pipeline over threads and checks exactly that). */
#ifndef FITLLM_PP_H
#define FITLLM_PP_H

#include "fitllm/comm.h"
#include "fitllm/model.h"
#include "fitllm/status.h"
#include "fitllm/train.h"

#ifdef __cplusplus
extern "C" {
#endif

/* FL_PP_INTERLEAVED: Megatron-LM's interleaved 1F1B over virtual stages (a rank holds `chunks` model chunks: chunk c
 * of rank s is virtual stage c S + s); the trainer runs it with --pipeline_chunks V (fl_pp_init_v).
 * fl_pp_schedule_parse accepts the one-chunk schedules (gpipe, 1f1b), fl_pp_schedule_parse_all interleaved too. */
/* FL_PP_SCHEDULE_COUNT counts the one-chunk schedules (gpipe, 1f1b); interleaved comes after them. */
typedef enum { FL_PP_GPIPE = 0, FL_PP_1F1B, FL_PP_SCHEDULE_COUNT, FL_PP_INTERLEAVED = FL_PP_SCHEDULE_COUNT } fl_pp_schedule;
typedef enum { FL_PP_FWD = 0, FL_PP_BWD } fl_pp_kind;
typedef struct {
    fl_pp_kind kind;
    int mb;    /* micro-batch 0 .. M - 1 */
    int chunk; /* the rank's model chunk 0 .. chunks - 1 (virtual stage chunk S + stage); 0 but under interleaved */
} fl_pp_op;

/* "gpipe", "1f1b", "interleaved"; and the reverse of the first two (FL_ERR_INVALID naming the choices). */
const char *fl_pp_schedule_name(fl_pp_schedule k);
fl_status fl_pp_schedule_parse(const char *name, fl_pp_schedule *out);
/* The same accepting "interleaved" too (what the trainer and the plan run). */
fl_status fl_pp_schedule_parse_all(const char *name, fl_pp_schedule *out);

/* Stage `stage`'s 2 M operations in order into ops[0 .. 2 M). FL_ERR_INVALID for stages < 1, stage outside
 * [0, stages), micro < 1. */
fl_status fl_pp_schedule_ops(fl_pp_schedule k, int stages, int stage, int micro, fl_pp_op *ops);
/* The same with `chunks` model chunks per rank: 2 M chunks operations. GPipe and 1F1B take chunks 1. Interleaved
 * (Megatron-LM's order): forward i (0 .. M chunks - 1) runs chunk (i / S) % chunks on micro-batch (i / (S chunks)) S +
 * i % S, backward i the same micro-batch on chunk chunks - 1 - (i / S) % chunks; min(2 (S - stage - 1) + (chunks -
 * 1) S, M chunks) warm-up forwards, then one forward one backward, then the rest. Each chunk's backwards run in
 * micro-batch order (one process's accumulation order). It needs M a multiple of S (FL_ERR_INVALID naming
 * gradient accumulation). */
fl_status fl_pp_schedule_ops_v(fl_pp_schedule k, int stages, int chunks, int stage, int micro, fl_pp_op *ops);
/* The most micro-batches whose forward ran and backward did not, over ops[0 .. n): the activations a stage
 * keeps at once (the planner's "activations in flight"). */
int fl_pp_in_flight(const fl_pp_op *ops, int n);

/* Contiguous stages of n_layers layers: stage s holds layers [first[s], first[s + 1]), first[0] = 0,
 * first[stages] = n_layers, every stage at least one layer, the largest stage cost (sum of cost[] over its layers;
 * NULL: 1 each) as small as it can be; among splits with that cost the later stages take as many layers as they
 * can (stage 0 keeps the most micro-batches' activations under 1F1B). FL_ERR_INVALID naming --pipeline_parallel when stages exceeds n_layers or is below 1, or a cost is negative
 * or not finite. */
fl_status fl_pp_split(int n_layers, const double *cost, int stages, int *first);

/* The planner's per-block cost of a decoder-only model (the split's cost[]): each block's training FLOPs of one
 * sequence of T tokens (fl_model_train_flops), the head's added to the last block's (the last stage runs it; the
 * embeddings are a lookup): the split then gives the last stage fewer blocks when lm_head is heavy. */
void fl_pp_block_costs(const fl_model_config *c, int T, double *cost);

/* The schedule run on given per-stage times of one micro-batch's forward (fwd[s]) and backward (bwd[s]), every
 * operation starting as soon as its stage is free and its input has arrived (sends take no time): the step's
 * makespan, and the bubble (the fraction of stage-time idle: 1 - M sum_s (fwd[s] + bwd[s]) / (S makespan); equal
 * stages give (S - 1) / (M + S - 1) under GPipe and 1F1B alike). FL_ERR_INVALID as fl_pp_schedule_ops, or for a
 * negative time. */
fl_status fl_pp_simulate(fl_pp_schedule k, int stages, int micro, const double *fwd, const double *bwd,
                         double *makespan, double *bubble);
/* The same over virtual stages: fwd[v], bwd[v] for v = c S + s (S chunks entries); virtual stage v's forward needs
 * v - 1's, its backward v + 1's. The bubble is 1 - M sum_v (fwd[v] + bwd[v]) / (S makespan). */
fl_status fl_pp_simulate_v(fl_pp_schedule k, int stages, int chunks, int micro, const double *fwd, const double *bwd,
                           double *makespan, double *bubble);

/* The split of a decoder-only model by its per-block costs at sequence length T (fl_pp_block_costs, fl_pp_split):
 * what the trainer runs and the planner plans. */
fl_status fl_pp_split_model(const fl_model_config *c, int T, int stages, int *first);

/* The planner's pipeline figures (stages <= 64): the split, each stage's forward and backward of one micro-batch
 * in units of one block's forward + backward (its blocks' costs over a block's; the FLOPs convention: a third
 * forward, two thirds backward), the schedule simulated on them (fl_pp_simulate): the step and its bubble, and
 * one process's step (M x the whole model's cost) in the same unit. */
typedef struct {
    int first[65];
    double fwd[64], bwd[64];
    double step, one, bubble;
} fl_pp_estimate;
fl_status fl_pp_estimate_step(const fl_model_config *c, int T, int stages, int micro, fl_pp_schedule k,
                              fl_pp_estimate *e);
/* The same over virtual stages (interleaved: chunks per rank; stages x chunks <= 64): first[], fwd[] and bwd[] are the
 * virtual stages' (v = c S + s), split by cost like a pipeline of stages x chunks stages. */
fl_status fl_pp_estimate_step_v(const fl_model_config *c, int T, int stages, int chunks, int micro, fl_pp_schedule k,
                                fl_pp_estimate *e);
/* The plan's notes of it into buf (three lines, a fourth under 1F1B: what interleaved would give): the split, each stage's time, the expected step and its bubble, in ms when
 * block_ms > 0 (a block's measured forward + backward) else in units of a block's time. */
fl_status fl_pp_estimate_text(const fl_model_config *c, int T, int stages, int micro, fl_pp_schedule k,
                              double block_ms, char *buf, size_t n);
/* The same for a run of `chunks` model chunks per rank (interleaved: the virtual stages' split, times and step). */
fl_status fl_pp_estimate_text_v(const fl_model_config *c, int T, int stages, int chunks, int micro, fl_pp_schedule k,
                                double block_ms, char *buf, size_t n);

/* ---- a model stage (src/model/stage.c) ----
 * T5 / Flan-T5: the stages split [encoder blocks; decoder blocks] (fl_pp_stage_config's header comment in stage.c;
 * the streams between stages in seq2seq_stage.c). Stage s of a decoder-only model (LLaMA, GPT-2, OPT) holds its blocks [first, last) as an ordinary model of
 * last - first layers (fl_pp_stage_config), whose blocks run the unchanged forward and backward; the first stage
 * runs the embeddings, the last the final norm, head and loss (fl_model_set_stage). Its embeddings and head
 * entries exist on every stage but are read and trained only where they run (fl_pp_stage_owns). */
fl_status fl_pp_stage_config(const fl_model_config *whole, int first, int last, fl_model_config *out);
/* The whole layout's entry of the stage's entry i (-1: none), and whether the stage trains entry i. */
int fl_pp_stage_entry(const fl_param_layout *whole, const fl_param_layout *stage, int first, int i);
int fl_pp_stage_owns(const fl_model *stage, int i);
int fl_pp_layout_owns(const fl_param_layout *stage, int in, int out, int i); /* the same, of a stage's layout */
/* The same of a stage's config and layout (an encoder-decoder's stage: by where it sits, fl_pp_stage_config). */
int fl_pp_config_owns(const fl_model_config *stage_cfg, const fl_param_layout *stage, int in, int out, int i);
/* The blocks a split divides: n_layers, an encoder-decoder's encoder and decoder blocks in that order. */
int fl_pp_model_blocks(const fl_model_config *c);
/* The stage's parameters copied out of a model of the whole config (fp32 through the host, entry by entry). */
fl_status fl_pp_stage_take(const fl_model *whole, fl_model *stage, int first);
/* in: the blocks' input comes from the previous stage; out: the forward ends after the blocks. A model that ties
 * lm_head to the token embeddings holds them on the first stage (the embeddings) and the last (the head): the
 * step sums their two gradients (fl_pp_step_run), so both update alike. */
fl_status fl_model_set_stage(fl_model *m, int in, int out);
/* The stream between stages, (B T, C) fp32 in host memory: the input of a later stage's forward (before
 * fl_model_forward_body), an earlier stage's output (after its forward), d(output) (before fl_model_backward)
 * and a later stage's d(input) (after it). */
/* The stream's elements for a pass of (B, T): B T C; sequence parallel (--sequence_parallel with TP x PP): the
 * rank's rows of the padded pass (fl_model_forward pads B T to a multiple of the group), sent to the same TP rank of
 * the next stage as they are (no gather at the boundary). */
size_t fl_model_stage_elems(const fl_model *m, int B, int T);
fl_status fl_model_stage_input(fl_model *m, const float *x, int B, int T);
/* An encoder-decoder's stage (seq2seq_stage.c): the message's elements at the stage's input side (out 0) or output
 * side (out 1) for a pass of B sources of Ts and targets of Tt tokens, the stage's input before its forward; the
 * most elements either side holds (the arena's); output, dout and dinput above serve it too (the pass's shapes). */
size_t fl_model_stage_elems_s2s(const fl_model *m, int B, int Ts, int Tt, int out);
fl_status fl_model_stage_input_s2s(fl_model *m, const float *x, int B, int Ts, int Tt);
size_t fl_model_stage_max_elems(const fl_model *m);
fl_status fl_model_stage_output(const fl_model *m, float *y);
fl_status fl_model_stage_dout(fl_model *m, const float *dy);
fl_status fl_model_stage_dinput(const fl_model *m, float *dx, int B, int T);
/* Before a stage's backward under a sharded store (FSDP FULL_SHARD on the data axis): the head group's gathered
 * gradient (a later stage: the embeddings' too) open, zeroed if an earlier backward reduced it. A forward opens it
 * (the head's gradient is written there) and the backward reduces it; with micro-batches in flight the forwards
 * share one open buffer, which the first backward reduces, so the later ones reduce what came since (the sum is the
 * same; its rounding differs). An encoder-decoder's stage: both root units (the shared embedding, the final norms
 * and head) gathered again and their gradients open before every backward (any stage's backward hands them on).
 * A no-op on a whole store. */
fl_status fl_model_stage_open_grads(fl_model *m);
/* A micro-batch in flight parked between its forward and backward: the ACTS arena, the token ids, the head's
 * d(lnf) (ACTS-tagged from the model's pool: fl_model_stage_stash_bytes each). */
typedef struct fl_stage_stash fl_stage_stash;
size_t fl_model_stage_stash_bytes(const fl_model *m);
fl_status fl_model_stage_stash_new(fl_model *m, fl_stage_stash **out);
void fl_model_stage_stash_free(fl_model *m, fl_stage_stash *s);
fl_status fl_model_stage_stash_save(fl_model *m, fl_stage_stash *s);
fl_status fl_model_stage_stash_restore(fl_model *m, const fl_stage_stash *s);
/* The arena's micro-batch and the stash's exchanged (through scratch, the backend's memory, of scratch_bytes): a
 * schedule that needs another micro-batch's activations back parks the current one in the slot it frees. */
fl_status fl_model_stage_stash_swap(fl_model *m, fl_stage_stash *s, void *scratch, size_t scratch_bytes);

/* ---- the pipelined step (src/train/pp_step.c) ---- */
#define FL_PP_MAX_CHUNKS 8
/* One model chunk of a rank (interleaved: virtual stage chunk S + stage; otherwise the rank's one stage). */
typedef struct {
    fl_model *m;               /* its model (fl_model_set_stage done by fl_pp_init_v) */
    fl_optimizer *o;           /* its optimizer (chunk 0: the one fl_pp_step_run is given; later chunks: fl_pp_chunk_optim) */
    fl_stage_stash **stash;    /* slots for micro-batches in flight beyond the arena's one */
    int n_stash;
    void *swap;                /* the stash swap's scratch (WORKSPACE of the model's pool) */
    size_t swap_bytes;
    double fwd_ms, bwd_ms;     /* measured: its forwards' and backwards' compute (not the waits) */
    long n_fwd, n_bwd;
    const fl_optim_dist *inner; /* its data-parallel hooks (FULL_SHARD: its own units' bookkeeping), or NULL */
} fl_pp_chunk;

typedef struct {
    fl_comm *comm;             /* the pipeline group (borrowed): rank s is stage s */
    int stages, stage;
    fl_pp_schedule kind;
    fl_model *m;               /* this stage (chunk 0's model) */
    int chunks;                /* model chunks per rank (1 but under interleaved) */
    fl_pp_chunk ch[FL_PP_MAX_CHUNKS];
    int n_stash;               /* stash slots over the chunks */
    int peak_in_flight;        /* the most chunk-micro-batches whose forward ran and backward did not, measured */
    float *hx;                 /* host staging of one micro-batch's (B T, C) stream (hx_n elements; none on a
                                * discarding backend, whose stream travels empty: the planner's) */
    size_t hx_n;
    int discard;               /* the stage's backend discards (fl_backend_discards: a plan's rehearsal) */
    fl_optim_dist dist;        /* the optimizer's hooks: the clipping norm and overflow verdict over the stages */
    const fl_optim_dist *inner; /* the data-parallel axis' (DDP), or NULL */
    int adapters;              /* the optimizer trains the stage's LoRA adapters (fl_pp_optim_attach) */
    double norm_sq;            /* interleaved: the step's squared norm over every chunk, computed once per step */
    int norm_ok;
    int amp_ok, amp_found;     /* interleaved under loss scaling: the step's overflow verdict over every chunk */
    int lora_reduced;          /* TP x PP interleaved LoRA: every chunk's whole adapter matrices summed over the
                                * group this step (chunk 0's update does it, before the norm reads them) */
    fl_comm *tp_comm;          /* TP x PP interleaved: the tensor-parallel group (host memory; NULL: none), which the
                                * verdict is summed over too */
    double fwd_ms, bwd_ms, step_ms; /* measured: the forwards' and backwards' compute (not the waits), the steps */
    long n_fwd, n_bwd, n_steps;
} fl_pp;

/* m is stage fl_comm_rank(comm) of fl_comm_size(comm) (its arena allocated). */
fl_status fl_pp_init(fl_pp *p, fl_model *m, fl_comm *comm, fl_pp_schedule kind);
/* The same with `chunks` models per rank (interleaved; chunks 1 is fl_pp_init): ms[c] is virtual stage c S + s of
 * S chunks, each its blocks' stage model (arena allocated). */
fl_status fl_pp_init_v(fl_pp *p, fl_model *const *ms, int chunks, fl_comm *comm, fl_pp_schedule kind);
/* Chunk c >= 1's optimizer (over ms[c]'s parameters or LoRA adapters; the data axis' hooks of chunk 0's stage, its
 * own under FULL_SHARD, or none): the step updates it after chunk 0's, with the clipping norm of every chunk of every
 * stage (fl_pp_optim_attach first). */
fl_status fl_pp_chunk_optim(fl_pp *p, int c, fl_optimizer *o);
void fl_pp_free(fl_pp *p);
/* The optimizer's norm and fp16 overflow verdict over every stage (composed with DDP's hooks when present). */
fl_status fl_pp_optim_attach(fl_pp *p, fl_optimizer *o);
/* fl_step_run's step as stage p->stage of the pipeline: every stage is given the same micro-batches (the ids on the
 * first, the targets on the last are what is read); the losses come back on every stage (c->mb_stats, res->loss). A
 * non-finite loss (no loss scaling) fails every stage after the schedule, before the update (c->failed_k). */
fl_status fl_pp_step_run(fl_pp *p, fl_optimizer *o, fl_step_ctx *c, fl_step_result *res);
/* The run's measured means over the pipeline group (a collective of its stages): each stage's forward and
 * backward of one micro-batch, fwd[s] and bwd[s] (p->stages entries; 0 before any step), and a step's time.
 * Interleaved: each virtual stage's, fwd[v], bwd[v] for v = c S + s (S chunks entries). */
fl_status fl_pp_timing(fl_pp *p, double *fwd, double *bwd, double *step_ms);
/* An inference forward with targets through the stages (validation): every stage's m->loss_sum and m->n_valid
 * are the last stage's afterwards. */
fl_status fl_pp_eval(fl_pp *p, const int32_t *ids, const int32_t *targets, int B, int T);
/* The same for an encoder-decoder's micro-batch (its source with it; one chunk per rank). */
fl_status fl_pp_eval_s2s(fl_pp *p, const fl_micro_batch *mb);

#ifdef __cplusplus
}
#endif
#endif
