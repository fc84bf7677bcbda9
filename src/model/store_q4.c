/* The 4-bit parameter store (store.h; QLoRA, fl_model_storage.quant4): every 2-D weight of the
 * blocks is one fl_q4_weight (bitsandbytes NF4 / FP4 blocks of 64 with their absmax, optionally
 * double-quantized) bound into one PARAMS buffer; the other entries stay in the dense store at
 * soff[i]. fl_store_bind_weight hands a LINEAR the 4-bit parts of its (fused) output. */
#include "store.h"

int fl_layout_entry_quantizable(const fl_param_layout *lay, int i) {
    const fl_param_info *p = &lay->params[i];
    /* (not a relative position table: T5's, a lookup, not a linear's weight) */
    return p->ndim == 2 && p->group >= 1 && p->group <= lay->n_groups - 2 && p->role != FL_ROLE_REL_BIAS;
}

size_t fl_store_q4_plan(const fl_param_layout *lay, const fl_model_storage *st, size_t *soff, size_t *q4_bytes) {
    size_t dense = 0, qb = 0;
    for (int i = 0; i < lay->n; i++) {
        if (st && st->quant4 && fl_layout_entry_quantizable(lay, i)) {
            if (soff) soff[i] = (size_t)-1;
            qb += fl_q4_bytes(lay->params[i].numel, st->q4_double_quant);
        } else {
            if (soff) soff[i] = dense;
            dense += lay->params[i].numel;
        }
    }
    if (q4_bytes) *q4_bytes = qb;
    return dense;
}

fl_status fl_store_q4_bind(fl_param_store *s) {
    fl_status st = FL_OK;
    size_t off = 0; /* bytes: a 7B model's 4-bit store passes 2 GiB */
    for (int i = 0; st == FL_OK && s->q4 && i < s->lay->n; i++) {
        const fl_param_info *p = &s->lay->params[i];
        if (s->soff[i] != (size_t)-1) continue;
        st = fl_q4_bind(&s->q4[i], (int)p->shape[0], (int)p->shape[1], (fl_q4_type)s->storage.q4_type,
                        s->storage.q4_double_quant, (char *)s->q4_mem + off);
        off += fl_q4_bytes(p->numel, s->storage.q4_double_quant);
    }
    return st;
}
