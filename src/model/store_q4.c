/* The 4-bit parameter store (store.h; QLoRA, fl_model_storage.quant4): every 2-D weight of the
 * blocks is one fl_q4_weight (bitsandbytes NF4 / FP4 blocks of 64 with their absmax, optionally
 * double-quantized) bound into one PARAMS buffer; the other entries stay in the dense store at
 * soff[i]. fl_store_bind_weight hands a LINEAR the 4-bit parts of its (fused) output. */
#include <stdlib.h>

#include "fitllm/tp.h"
#include "store.h"

int fl_layout_entry_quantizable(const fl_param_layout *lay, int i) {
    const fl_param_info *p = &lay->params[i];
    /* (not a relative position table: T5's, a lookup, not a linear's weight) */
    return p->ndim == 2 && p->group >= 1 && p->group <= lay->n_groups - 2 && p->role != FL_ROLE_REL_BIAS;
}

/* the 4-bit bytes of entry i: a tensor-parallel rank's part that cuts the blocks keeps the whole blocks covering it */
static size_t entry_bytes(const fl_param_layout *lay, const fl_model_config *cfg, const fl_model_storage *st, int i,
                          size_t *nb) {
    *nb = cfg ? fl_tp_q4_map(cfg, lay, i, NULL, NULL) : 0;
    return *nb ? fl_q4_mapped_bytes((int)lay->params[i].shape[0], *nb)
               : fl_q4_bytes(lay->params[i].numel, st->q4_double_quant);
}

size_t fl_store_q4_plan(const fl_param_layout *lay, const fl_model_config *cfg, const fl_model_storage *st,
                        size_t *soff, size_t *q4_bytes) {
    size_t dense = 0, qb = 0, nb;
    for (int i = 0; i < lay->n; i++) {
        if (st && st->quant4 && fl_layout_entry_quantizable(lay, i)) {
            if (soff) soff[i] = (size_t)-1;
            qb += entry_bytes(lay, cfg, st, i, &nb);
        } else {
            if (soff) soff[i] = dense;
            dense += lay->params[i].numel;
        }
    }
    if (q4_bytes) *q4_bytes = qb;
    return dense;
}

fl_status fl_store_q4_bind(fl_param_store *s, const fl_model_config *cfg) {
    fl_status st = FL_OK;
    size_t off = 0, nb; /* bytes: a 7B model's 4-bit store passes 2 GiB */
    for (int i = 0; st == FL_OK && s->q4 && i < s->lay->n; i++) {
        const fl_param_info *p = &s->lay->params[i];
        if (s->soff[i] != (size_t)-1) continue;
        const size_t bytes = entry_bytes(s->lay, cfg, &s->storage, i, &nb);
        void *mem = (char *)s->q4_mem + off;
        off += bytes;
        if (!nb) {
            st = fl_q4_bind(&s->q4[i], (int)p->shape[0], (int)p->shape[1], (fl_q4_type)s->storage.q4_type,
                            s->storage.q4_double_quant, mem);
            continue;
        }
        /* the row map, computed here and copied in (device memory on a device backend) */
        st = fl_q4_bind_mapped(&s->q4[i], (int)p->shape[0], (int)p->shape[1], (fl_q4_type)s->storage.q4_type, nb, mem);
        uint32_t *rs = st == FL_OK ? malloc((size_t)p->shape[0] * sizeof *rs) : NULL;
        if (st == FL_OK && !rs) st = fl_errorf(FL_ERR_OOM, "4-bit storage: out of host memory");
        if (st == FL_OK) fl_tp_q4_map(cfg, s->lay, i, NULL, rs);
        if (st == FL_OK && !fl_backend_discards(s->be))
            st = FL_RUN(s->be, to_device, s->q4[i].row_start, rs, (size_t)p->shape[0] * sizeof *rs);
        free(rs);
    }
    return st;
}
