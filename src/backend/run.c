/* The backend's one door (issue 29): fl_backend_run_slots, the run every backend of this tree
 * installs, and the kinds' names (fitllm/backend_op.h). A switch over the kinds: each case calls the
 * backend's own slot with the record's arguments in the slot's order, so an op issued through the door
 * has the bits of the slot called directly (three switches, one per group of kinds, for their length). */
#include "fitllm/backend_op.h"

static const char *const kind_names[FL_OPK_COUNT] = {
#define FL_OPK_NAME_(slot) #slot,
    FL_OPK_LIST(FL_OPK_NAME_)
#undef FL_OPK_NAME_
};

const char *fl_opk_name(fl_opk k) { return (unsigned)k < FL_OPK_COUNT ? kind_names[k] : "?"; }

/* an optional slot this backend does not have (NULL) */
static fl_status no_slot(const fl_backend *be, const fl_oprec *op) {
    return fl_errorf(FL_ERR_UNSUPPORTED, "backend %s has no %s op", be->name, fl_opk_name(op->kind));
}

/* r = the record of kind `slot`; a case breaks out to no_slot when the backend lacks the slot */
#define DOOR(slot)                                                                                                     \
    const struct fl_op_##slot *r = &op->slot; (void)r;                                                                    \
    if (!be->slot) break

/* conversions, optimizer updates, reductions, memory, state; the fused-QKV attention */
static fl_status run_memory(const fl_backend *be, const fl_oprec *op) {
    switch (op->kind) {
    case FL_OPK_convert: {
        DOOR(convert);
        return be->convert(be, r->dst, r->dt, r->src, r->st, r->n);
    }
    case FL_OPK_convert_many: {
        DOOR(convert_many);
        return be->convert_many(be, r->count, r->dst, r->dt, r->src, r->st, r->len);
    }
    case FL_OPK_round16: {
        DOOR(round16);
        return be->round16(be, r->dst, r->dt, r->x, r->n);
    }
    case FL_OPK_accumulate16: {
        DOOR(accumulate16);
        return be->accumulate16(be, r->dst, r->t, r->src, r->n);
    }
    case FL_OPK_adamw_update: {
        DOOR(adamw_update);
        return be->adamw_update(be, r->p, r->tp, r->g, r->tg, r->m, r->v, r->ts, r->n, r->lr, r->beta1, r->beta2,
            r->eps, r->weight_decay, r->step, r->grad_scale);
    }
    case FL_OPK_sgd_update: {
        DOOR(sgd_update);
        return be->sgd_update(be, r->p, r->tp, r->g, r->tg, r->buf, r->ts, r->n, r->lr, r->momentum, r->dampening,
            r->weight_decay, r->nesterov, r->first_step, r->grad_scale);
    }
    case FL_OPK_adam8bit_update: {
        DOOR(adam8bit_update);
        return be->adam8bit_update(be, r->p, r->tp, r->g, r->tg, r->st, r->lr, r->beta1, r->beta2, r->eps,
            r->weight_decay, r->step, r->grad_scale);
    }
    case FL_OPK_grad_norm_dev: {
        DOOR(grad_norm_dev);
        return be->grad_norm_dev(be, r->g, r->tg, r->n, r->max_norm, r->scale, r->n_loss, r->ss);
    }
    case FL_OPK_loss_sum_dev: {
        DOOR(loss_sum_dev);
        return be->loss_sum_dev(be, r->loss, r->targets, r->N, r->ignore_index, r->acc);
    }
    case FL_OPK_adamw_update_ss: {
        DOOR(adamw_update_ss);
        return be->adamw_update_ss(be, r->p, r->tp, r->g, r->tg, r->m, r->v, r->ts, r->n, r->lr, r->beta1, r->beta2,
            r->eps, r->weight_decay, r->step, r->ss);
    }
    case FL_OPK_sgd_update_ss: {
        DOOR(sgd_update_ss);
        return be->sgd_update_ss(be, r->p, r->tp, r->g, r->tg, r->buf, r->ts, r->n, r->lr, r->momentum, r->dampening,
            r->weight_decay, r->nesterov, r->first_step, r->ss);
    }
    case FL_OPK_check_finite_dev: {
        DOOR(check_finite_dev);
        return be->check_finite_dev(be, r->x, r->t, r->n, r->inv_scale, r->ss);
    }
    case FL_OPK_input_upload: {
        DOOR(input_upload);
        return be->input_upload(be, r->slot, r->src0, r->n0, r->src1, r->n1, r->off1);
    }
    case FL_OPK_input_wait: {
        DOOR(input_wait);
        return be->input_wait(be, r->slot);
    }
    case FL_OPK_adam8bit_update_ss: {
        DOOR(adam8bit_update_ss);
        return be->adam8bit_update_ss(be, r->p, r->tp, r->g, r->tg, r->st, r->lr, r->beta1, r->beta2, r->eps,
            r->weight_decay, r->step, r->ss);
    }
    case FL_OPK_sumsq: {
        DOOR(sumsq);
        *r->result = be->sumsq(be, r->x, r->t, r->n);
        return FL_OK;
    }
    case FL_OPK_check_finite: {
        DOOR(check_finite);
        return be->check_finite(be, r->x, r->t, r->n, r->inv_scale, r->found_inf);
    }
    case FL_OPK_scale: {
        DOOR(scale);
        be->scale(be, r->x, r->n, r->s);
        return FL_OK;
    }
    case FL_OPK_zero: {
        DOOR(zero);
        be->zero(be, r->x, r->bytes);
        return FL_OK;
    }
    case FL_OPK_copy: {
        DOOR(copy);
        return be->copy(be, r->dst, r->src, r->bytes);
    }
    case FL_OPK_to_device: {
        DOOR(to_device);
        return be->to_device(be, r->dst, r->src, r->bytes);
    }
    case FL_OPK_to_host: {
        DOOR(to_host);
        return be->to_host(be, r->dst, r->src, r->bytes);
    }
    case FL_OPK_sync: {
        DOOR(sync);
        return be->sync(be);
    }
    case FL_OPK_set_scratch: {
        DOOR(set_scratch);
        be->set_scratch(be, r->p, r->bytes);
        return FL_OK;
    }
    case FL_OPK_set_compute_dtype: {
        DOOR(set_compute_dtype);
        be->set_compute_dtype(be, r->t);
        return FL_OK;
    }
    case FL_OPK_attention_qkv_forward: {
        const struct fl_op_attention_qkv_forward *r = &op->attention_qkv_forward;
        return fl_attention_qkv_forward(be, r->out, r->lse, r->qkv, r->B, r->T, r->NH, r->NKV, r->HD);
    }
    case FL_OPK_attention_qkv_backward: {
        const struct fl_op_attention_qkv_backward *r = &op->attention_qkv_backward;
        return fl_attention_qkv_backward(be, r->dqkv, r->dout, r->qkv, r->out, r->lse, r->B, r->T, r->NH, r->NKV,
            r->HD);
    }
    default:
        return fl_errorf(FL_ERR_INVALID, "backend %s: op record of unknown kind %d", be->name, (int)op->kind);
    }
    return no_slot(be, op);
}

/* activations (16-bit outputs), elementwise, attention, 4-bit matmul, LoRA, cross-entropy */
static fl_status run_kernels2(const fl_backend *be, const fl_oprec *op) {
    switch (op->kind) {
    case FL_OPK_gelu_erf_forward: {
        DOOR(gelu_erf_forward);
        be->gelu_erf_forward(be, r->out, r->inp, r->n);
        return FL_OK;
    }
    case FL_OPK_gelu_erf_backward: {
        DOOR(gelu_erf_backward);
        be->gelu_erf_backward(be, r->dinp, r->dout, r->inp, r->n);
        return FL_OK;
    }
    case FL_OPK_geglu_forward: {
        DOOR(geglu_forward);
        be->geglu_forward(be, r->out, r->gu, r->N, r->F);
        return FL_OK;
    }
    case FL_OPK_geglu_backward: {
        DOOR(geglu_backward);
        be->geglu_backward(be, r->dgu, r->dout, r->gu, r->N, r->F);
        return FL_OK;
    }
    case FL_OPK_act_forward16: {
        DOOR(act_forward16);
        return be->act_forward16(be, r->kind, r->out, r->out16, r->in, r->in16, r->N, r->F);
    }
    case FL_OPK_act_backward16: {
        DOOR(act_backward16);
        return be->act_backward16(be, r->kind, r->din, r->din16, r->dout, r->in, r->in16, r->N, r->F);
    }
    case FL_OPK_add: {
        DOOR(add);
        be->add(be, r->out, r->a, r->b, r->n);
        return FL_OK;
    }
    case FL_OPK_add16: {
        DOOR(add16);
        return be->add16(be, r->out, r->out16, r->a, r->b, r->n);
    }
    case FL_OPK_bias_forward: {
        DOOR(bias_forward);
        be->bias_forward(be, r->y, r->b, r->N, r->OC);
        return FL_OK;
    }
    case FL_OPK_bias_backward: {
        DOOR(bias_backward);
        be->bias_backward(be, r->db, r->dy, r->N, r->OC);
        return FL_OK;
    }
    case FL_OPK_attention_forward: {
        DOOR(attention_forward);
        return be->attention_forward(be, r->a, r->out, r->lse, r->q, r->k, r->v, r->bias, r->kmask);
    }
    case FL_OPK_attention_forward16: {
        DOOR(attention_forward16);
        return be->attention_forward16(be, r->a, r->out, r->out16, r->lse, r->q, r->k, r->v, r->bias, r->kmask);
    }
    case FL_OPK_attention_backward16: {
        DOOR(attention_backward16);
        return be->attention_backward16(be, r->a, r->dq, r->dk, r->dv, r->dout, r->q16, r->k16, r->v16, r->kmask,
                                        r->out16, r->lse);
    }
    case FL_OPK_attention_backward: {
        DOOR(attention_backward);
        return be->attention_backward(be, r->a, r->dq, r->dk, r->dv, r->dbias, r->dout, r->q, r->k, r->v, r->bias,
            r->kmask, r->out, r->lse);
    }
    case FL_OPK_attention_decode: {
        DOOR(attention_decode);
        be->attention_decode(be, r->out, r->q, r->kcache, r->vcache, r->T, r->NH, r->NKV, r->HD, r->head_stride);
        return FL_OK;
    }
    case FL_OPK_q4_matmul_forward: {
        DOOR(q4_matmul_forward);
        return be->q4_matmul_forward(be, r->y, r->ldy, r->x, r->w, r->N, r->beta);
    }
    case FL_OPK_q4_matmul_backward: {
        DOOR(q4_matmul_backward);
        return be->q4_matmul_backward(be, r->dx, r->dy, r->ldy, r->w, r->N, r->beta);
    }
    case FL_OPK_q4_matmul_forward16: {
        DOOR(q4_matmul_forward16);
        return be->q4_matmul_forward16(be, r->y, r->ldy, r->x16, r->w, r->nw, r->N, r->beta);
    }
    case FL_OPK_q4_matmul_backward16: {
        DOOR(q4_matmul_backward16);
        return be->q4_matmul_backward16(be, r->dx, r->dy16, r->ldy, r->w, r->nw, r->N, r->beta);
    }
    case FL_OPK_lora_forward: {
        DOOR(lora_forward);
        return be->lora_forward(be, r->y, r->ldy, r->h, r->xd, r->x, r->A, r->B, r->N, r->in, r->out, r->r, r->scaling,
            r->dropout, r->seed);
    }
    case FL_OPK_lora_backward: {
        DOOR(lora_backward);
        return be->lora_backward(be, r->dx, r->dA, r->dB, r->dy, r->ldy, r->xb, r->h, r->A, r->B, r->N, r->in, r->out,
            r->r, r->scaling, r->dropout, r->seed, r->work);
    }
    case FL_OPK_dropout: {
        DOOR(dropout);
        return be->dropout(be, r->y, r->x, r->n, r->p, r->seed, r->accumulate);
    }
    case FL_OPK_dropout_rows: {
        DOOR(dropout_rows);
        return be->dropout_rows(be, r->y, r->x, r->rows, r->w, r->stride, r->p, r->seed, r->accumulate);
    }
    case FL_OPK_vocab_stats: {
        DOOR(vocab_stats);
        return be->vocab_stats(be, r->stats, r->logits, r->targets, r->rows, r->n, r->lo);
    }
    case FL_OPK_attention_forward_in16: {
        DOOR(attention_forward_in16);
        return be->attention_forward_in16(be, r->a, r->out, r->out16, r->lse, r->q16, r->k16, r->v16, r->kmask);
    }
    case FL_OPK_add_norm_forward16: {
        DOOR(add_norm_forward16);
        return be->add_norm_forward16(be, r->ln, r->res, r->res16, r->out, r->out16, r->mean, r->rstd, r->a, r->b, r->w,
                                      r->bias, r->wt, r->N, r->C, r->eps);
    }
    case FL_OPK_add_norm_forward16_b16: {
        DOOR(add_norm_forward16_b16);
        return be->add_norm_forward16_b16(be, r->ln, r->res, r->res16, r->out, r->out16, r->mean, r->rstd, r->a, r->b16,
                                          r->w, r->bias, r->wt, r->N, r->C, r->eps);
    }
    case FL_OPK_bias_backward16: {
        DOOR(bias_backward16);
        return be->bias_backward16(be, r->db, r->dy16, r->dy, r->N, r->OC);
    }
    case FL_OPK_vocab_xent: {
        DOOR(vocab_xent);
        return be->vocab_xent(be, r->loss, r->dlogits, r->logits, r->all, r->targets, r->rows, r->n, r->lo, r->P, r->me,
                              r->V, r->grad_scale, r->ignore_index);
    }
    case FL_OPK_cross_entropy: {
        DOOR(cross_entropy);
        be->cross_entropy(be, r->loss, r->dlogits, r->logits, r->targets, r->N, r->V, r->grad_scale, r->ignore_index);
        return FL_OK;
    }
    case FL_OPK_cross_entropy_dbf16: {
        DOOR(cross_entropy_dbf16);
        return be->cross_entropy_dbf16(be, r->loss, r->dlogits16, r->logits, r->targets, r->N, r->V, r->ld,
                                       r->grad_scale, r->ignore_index);
    }
    default:
        return run_memory(be, op);
    }
    return no_slot(be, op);
}

/* matmul, embeddings, norms, RoPE, activations: then the other groups */
fl_status fl_backend_run_slots(const fl_backend *be, const fl_oprec *op) {
    switch (op->kind) {
    case FL_OPK_gemm: {
        DOOR(gemm);
        return be->gemm(be, r->trans_a, r->trans_b, r->M, r->N, r->K, r->alpha, r->A, r->ta, r->lda, r->B, r->tb,
            r->ldb, r->beta, r->C, r->tc, r->ldc);
    }
    case FL_OPK_gemm_epilogue: {
        DOOR(gemm_epilogue);
        return be->gemm_epilogue(be, r->epi, r->bias, r->aux, r->ldaux, r->trans_a, r->trans_b, r->M, r->N, r->K,
            r->alpha, r->A, r->ta, r->lda, r->B, r->tb, r->ldb, r->beta, r->C, r->ldc);
    }
    case FL_OPK_gemm_res16: {
        DOOR(gemm_res16);
        return be->gemm_res16(be, r->trans_a, r->trans_b, r->M, r->N, r->K, r->alpha, r->A, r->lda, r->B, r->ldb,
            r->c16, r->d16, r->ldc);
    }
    case FL_OPK_embedding_forward: {
        DOOR(embedding_forward);
        be->embedding_forward(be, r->out, r->ids, r->wte, r->wpe, r->B, r->T, r->C);
        return FL_OK;
    }
    case FL_OPK_embedding_forward16: {
        DOOR(embedding_forward16);
        be->embedding_forward16(be, r->out, r->out16, r->ids, r->wte, r->wpe, r->dt, r->B, r->T, r->C);
        return FL_OK;
    }
    case FL_OPK_embedding_backward: {
        DOOR(embedding_backward);
        be->embedding_backward(be, r->dwte, r->dwpe, r->dout, r->ids, r->B, r->T, r->C);
        return FL_OK;
    }
    case FL_OPK_relbias_forward: {
        DOOR(relbias_forward);
        be->relbias_forward(be, r->bias, r->tab, r->rb, r->NH, r->Tq, r->Tk, r->nb);
        return FL_OK;
    }
    case FL_OPK_relbias_backward: {
        DOOR(relbias_backward);
        return be->relbias_backward(be, r->dtab, r->dbias, r->rb, r->NH, r->Tq, r->Tk, r->nb);
    }
    case FL_OPK_rmsnorm_forward: {
        DOOR(rmsnorm_forward);
        be->rmsnorm_forward(be, r->out, r->rstd, r->inp, r->w, r->N, r->C, r->eps);
        return FL_OK;
    }
    case FL_OPK_rmsnorm_forward_w16: {
        DOOR(rmsnorm_forward_w16);
        be->rmsnorm_forward_w16(be, r->out, r->out16, r->rstd, r->inp, r->w, r->wt, r->N, r->C, r->eps);
        return FL_OK;
    }
    case FL_OPK_rmsnorm_backward: {
        DOOR(rmsnorm_backward);
        be->rmsnorm_backward(be, r->dinp, r->dw, r->dout, r->inp, r->w, r->rstd, r->N, r->C);
        return FL_OK;
    }
    case FL_OPK_rmsnorm_backward_w16: {
        DOOR(rmsnorm_backward_w16);
        be->rmsnorm_backward_w16(be, r->dinp, r->dinp16, r->dw, r->dout, r->inp, r->inp16, r->w, r->wt, r->rstd, r->N,
                                 r->C);
        return FL_OK;
    }
    case FL_OPK_add_rmsnorm_forward: {
        DOOR(add_rmsnorm_forward);
        return be->add_rmsnorm_forward(be, r->res, r->out, r->rstd, r->a, r->b, r->w, r->t, r->N, r->C, r->eps);
    }
    case FL_OPK_layernorm_forward: {
        DOOR(layernorm_forward);
        be->layernorm_forward(be, r->out, r->mean, r->rstd, r->inp, r->w, r->b, r->N, r->C, r->eps);
        return FL_OK;
    }
    case FL_OPK_layernorm_backward: {
        DOOR(layernorm_backward);
        be->layernorm_backward(be, r->dinp, r->dw, r->db, r->dout, r->inp, r->w, r->mean, r->rstd, r->N, r->C);
        return FL_OK;
    }
    case FL_OPK_layernorm_forward_w16: {
        DOOR(layernorm_forward_w16);
        be->layernorm_forward_w16(be, r->out, r->out16, r->mean, r->rstd, r->inp, r->w, r->b, r->wt, r->N, r->C,
                                  r->eps);
        return FL_OK;
    }
    case FL_OPK_layernorm_backward_w16: {
        DOOR(layernorm_backward_w16);
        be->layernorm_backward_w16(be, r->dinp, r->dinp16, r->dw, r->db, r->dout, r->inp, r->inp16, r->w, r->wt,
                                   r->mean, r->rstd, r->N, r->C);
        return FL_OK;
    }
    case FL_OPK_rope_forward: {
        DOOR(rope_forward);
        be->rope_forward(be, r->x, r->B, r->T, r->nh, r->HD, r->row_stride, r->cos_t, r->sin_t, r->pos0);
        return FL_OK;
    }
    case FL_OPK_rope_forward16: {
        DOOR(rope_forward16);
        return be->rope_forward16(be, r->out, r->x16, r->x, r->B, r->T, r->nh, r->HD, r->width, r->cos_t, r->sin_t, r->pos0);
    }
    case FL_OPK_rope_backward: {
        DOOR(rope_backward);
        be->rope_backward(be, r->dx, r->B, r->T, r->nh, r->HD, r->row_stride, r->cos_t, r->sin_t, r->pos0);
        return FL_OK;
    }
    case FL_OPK_attention_backward_b16: {
        DOOR(attention_backward_b16);
        return be->attention_backward_b16(be, r->a, r->dq, r->dk, r->dv, r->dq16, r->dk16, r->dv16, r->dout16, r->q16,
                                          r->k16, r->v16, r->out16, r->lse);
    }
    case FL_OPK_rope_backward16: {
        DOOR(rope_backward16);
        return be->rope_backward16(be, r->dout, r->dx16, r->dx, r->B, r->T, r->nh, r->HD, r->width, r->cos_t, r->sin_t, r->pos0);
    }
    case FL_OPK_swiglu_forward: {
        DOOR(swiglu_forward);
        be->swiglu_forward(be, r->out, r->gu, r->N, r->F);
        return FL_OK;
    }
    case FL_OPK_swiglu_backward: {
        DOOR(swiglu_backward);
        be->swiglu_backward(be, r->dgu, r->dout, r->gu, r->N, r->F);
        return FL_OK;
    }
    case FL_OPK_gelu_forward: {
        DOOR(gelu_forward);
        be->gelu_forward(be, r->out, r->inp, r->n);
        return FL_OK;
    }
    case FL_OPK_gelu_backward: {
        DOOR(gelu_backward);
        be->gelu_backward(be, r->dinp, r->dout, r->inp, r->n);
        return FL_OK;
    }
    case FL_OPK_relu_forward: {
        DOOR(relu_forward);
        be->relu_forward(be, r->out, r->inp, r->n);
        return FL_OK;
    }
    case FL_OPK_relu_backward: {
        DOOR(relu_backward);
        be->relu_backward(be, r->dinp, r->dout, r->inp, r->n);
        return FL_OK;
    }
    default:
        return run_kernels2(be, op);
    }
    return no_slot(be, op);
}
