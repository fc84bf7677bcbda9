/* fitllm CUDA backend object, part 2 (included by backend_cuda_impl.h): the ops over the
 * attention kernels (cu_kernels_attn.h) and the embedding / 8-bit Adam / 4-bit kernels
 * (cu_kernels_more.h). */

static void flb_missing(const fl_backend *be, const char *op) {
    flb_set_error(be, FL_ERR_UNSUPPORTED, op, "no CUDA kernel for this op in this build yet");
}

static void flb_embedding_forward(const fl_backend *be, float *out, const int32_t *ids, const float *wte,
                                  const float *wpe, int B, int T, int C) {
    (void)out; (void)ids; (void)wte; (void)wpe; (void)B; (void)T; (void)C;
    flb_missing(be, "embedding_forward");
}
static void flb_embedding_backward(const fl_backend *be, float *dwte, float *dwpe, const float *dout,
                                   const int32_t *ids, int B, int T, int C) {
    (void)dwte; (void)dwpe; (void)dout; (void)ids; (void)B; (void)T; (void)C;
    flb_missing(be, "embedding_backward");
}
static void flb_attention_forward(const fl_backend *be, float *out, float *lse, const float *qkv, int B, int T, int NH,
                                  int NKV, int HD) {
    (void)out; (void)lse; (void)qkv; (void)B; (void)T; (void)NH; (void)NKV; (void)HD;
    flb_missing(be, "attention_forward");
}
static void flb_attention_backward(const fl_backend *be, float *dqkv, const float *dout, const float *qkv,
                                   const float *out, const float *lse, int B, int T, int NH, int NKV, int HD) {
    (void)dqkv; (void)dout; (void)qkv; (void)out; (void)lse; (void)B; (void)T; (void)NH; (void)NKV; (void)HD;
    flb_missing(be, "attention_backward");
}
static void flb_attention_decode(const fl_backend *be, float *out, const float *q, const float *kcache,
                                 const float *vcache, int T, int NH, int NKV, int HD, size_t head_stride) {
    (void)out; (void)q; (void)kcache; (void)vcache; (void)T; (void)NH; (void)NKV; (void)HD; (void)head_stride;
    flb_missing(be, "attention_decode");
}
static fl_status flb_attention_forward_ex(const fl_backend *be, const fl_attn_desc *a, float *out, float *lse,
                                          const float *q, const float *k, const float *v, const float *bias,
                                          const uint8_t *kmask) {
    (void)a; (void)out; (void)lse; (void)q; (void)k; (void)v; (void)bias; (void)kmask;
    flb_missing(be, "attention_forward_ex");
    return flb_sticky(be);
}
static fl_status flb_attention_backward_ex(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk,
                                           float *dv, float *dbias, const float *dout, const float *q, const float *k,
                                           const float *v, const float *bias, const uint8_t *kmask, const float *out,
                                           const float *lse) {
    (void)a; (void)dq; (void)dk; (void)dv; (void)dbias; (void)dout; (void)q; (void)k; (void)v; (void)bias;
    (void)kmask; (void)out; (void)lse;
    flb_missing(be, "attention_backward_ex");
    return flb_sticky(be);
}
static fl_status flb_adam8bit_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                     const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                     float weight_decay, int step, float grad_scale) {
    (void)p; (void)tp; (void)g; (void)tg; (void)st; (void)lr; (void)beta1; (void)beta2; (void)eps;
    (void)weight_decay; (void)step; (void)grad_scale;
    flb_missing(be, "adam8bit_update");
    return flb_sticky(be);
}
static fl_status flb_q4_matmul_forward(const fl_backend *be, float *y, int ldy, const float *x, const fl_q4_weight *w,
                                       int N, float beta) {
    (void)y; (void)ldy; (void)x; (void)w; (void)N; (void)beta;
    flb_missing(be, "q4_matmul_forward");
    return flb_sticky(be);
}
static fl_status flb_q4_matmul_backward(const fl_backend *be, float *dx, const float *dy, int ldy,
                                        const fl_q4_weight *w, int N, float beta) {
    (void)dx; (void)dy; (void)ldy; (void)w; (void)N; (void)beta;
    flb_missing(be, "q4_matmul_backward");
    return flb_sticky(be);
}
/* until the LoRA dropout kernels land */
static int FLB_K(lora_dropout)(float *xd, const float *x, size_t n, float p, uint64_t seed, void *stream) {
    (void)xd; (void)x; (void)n; (void)p; (void)seed; (void)stream;
    return -1;
}
static int FLB_K(lora_dropout_add)(float *dx, const float *t, size_t n, float p, uint64_t seed, void *stream) {
    (void)dx; (void)t; (void)n; (void)p; (void)seed; (void)stream;
    return -1;
}
