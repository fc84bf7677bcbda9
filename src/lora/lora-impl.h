/* LoRA's private state (src/lora): the adapters it attaches to a model's LINEAR ops through the
 * model's adapter interface (model.h: fl_linear_adapter, fl_model_attach_adapter). */
#ifndef FL_LORA_IMPL_H
#define FL_LORA_IMPL_H

#include "fitllm/lora.h"
#include "fitllm/model.h"

struct fl_lora_state;

/* One LoRA adapter on a LINEAR (possibly on a row slice of a fused output: q/k/v of the fused QKV,
 * gate/up of the fused 2F projection): an fl_linear_adapter. */
typedef struct {
    fl_linear_adapter base; /* first: the model calls base.ops with &base */
    const struct fl_lora_state *st;
    const float *A, *B;   /* (r, in), (out, r) adapter parameters */
    float *dA, *dB;       /* their gradients */
    float *h;             /* (N, r) saved LoRA intermediate (ACTS); lm_head: (chunk rows, r) */
    float *xd;            /* (N, in) dropped input (ACTS) when dropout > 0, else NULL; lm_head: (chunk rows, in) */
    int row0, out, in, r; /* slice [row0, row0+out) of the linear's output */
    int parts;            /* a fused q|k|v module's adapter: B's rows in 3 parts, of which ... */
    unsigned frozen;      /* ... these never train: their dB rows are zeroed after each backward (fl_lora_module) */
    float scaling, dropout;
    int index;            /* module index (st->mods) */
    int stream;           /* the whole model's module index: part of the init and dropout seeds (a pipeline stage's
                           * modules count from its first block's) */
    int tp_n, tp_c0;      /* a row-parallel linear's slice (tensor parallel): its input is the rank's columns
                           * [tp_c0, tp_c0 + in) of the whole's tp_n in (the dropout mask: the whole's at them); else 0 */
} fl_lora_slot;

/* LoRA state of a model (fl_model_lora_init; the model holds it as m->lora, opaque). */
struct fl_lora_state {
    fl_lora_config cfg;
    float scaling;
    fl_lora_module *mods;
    int n_mods;
    size_t *off;          /* (2 n_mods) element offsets of A_j, B_j in params/grads */
    size_t numel;
    float *params, *grads;/* PARAMS, GRADS */
    fl_lora_slot *slots;  /* n_mods, grouped by (layer, linear kind), then lm_head's */
    int *first, *count;   /* (L * 4 + 1): slots of layer l, kind k (0 qkv, 1 o, 2 fc, 3 proj); [L * 4]: lm_head */
    float *acts;          /* h and xd of every slot for the arena's (B, T) (ACTS) */
    size_t acts_bytes;
    float *work;          /* (N * (r + max in)) WORKSPACE */
    int merged;           /* fl_model_lora_merge ran: 4-bit entries read back merged */
    uint64_t seed;        /* dropout seed of the current micro-batch */
};

#endif
