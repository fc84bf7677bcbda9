/* fitllm CUDA backend object: LoRA's forward / backward and dropout (included by cuda-backend-impl.h, written once,
 * compiled twice: the plugin and the emulator). */
/* LoRA: the CPU backend's composition (GEMMs through this backend's gemm) with the dropout mask as kernels (the same
 * pure function of (seed, index) as fitllm/lora.h); with dropout the dx product is inside the masked update's kernel
 * (lora_dx_fused: its r-term sums in order, where the CPU's GEMM sums in its own). */
/* dseed (NULL or) device memory holding the seed (a CUDA graph's per-step slot: cuda-graph-impl.h) */
static fl_status flb_lora_forward_s(const fl_backend *be, float *y, int ldy, float *h, float *xd, const float *x,
                                    const float *A, const float *B, int N, int in, int out, int r, float scaling,
                                    float dropout, uint64_t seed, const uint64_t *dseed) {
    FL_TRY(flb_sticky(be));
    FL_TRY(fl_lora_check_args("lora_forward", N, in, out, r, ldy, dropout));
    if (N == 0) return FL_OK;
    const float *xb = x;
    if (dropout > 0.0f) {
        if (!xd) return fl_errorf(FL_ERR_INVALID, "lora_forward: dropout %g needs the xd buffer", (double)dropout);
        FLB_RUN_S(be, FLB_K(lora_dropout)(xd, x, (size_t)N * in, dropout, seed, dseed, STREAM), "lora_forward (dropout)");
        xb = xd;
    }
    FL_TRY(flb_gemm(be, 0, 1, N, r, in, 1.0f, xb, FL_F32, in, A, FL_F32, in, 0.0f, h, FL_F32, r));
    return flb_gemm(be, 0, 1, N, out, r, scaling, h, FL_F32, r, B, FL_F32, r, 1.0f, y, FL_F32, ldy);
}
static fl_status flb_lora_forward(const fl_backend *be, float *y, int ldy, float *h, float *xd, const float *x,
                                  const float *A, const float *B, int N, int in, int out, int r, float scaling,
                                  float dropout, uint64_t seed) {
    return flb_lora_forward_s(be, y, ldy, h, xd, x, A, B, N, in, out, r, scaling, dropout, seed, NULL);
}
static fl_status flb_lora_backward_s(const fl_backend *be, float *dx, float *dA, float *dB, const float *dy, int ldy,
                                     const float *xb, const float *h, const float *A, const float *B, int N, int in,
                                     int out, int r, float scaling, float dropout, uint64_t seed, float *work,
                                     const uint64_t *dseed) {
    FL_TRY(flb_sticky(be));
    FL_TRY(fl_lora_check_args("lora_backward", N, in, out, r, ldy, dropout));
    if (N == 0) return FL_OK;
    if (!work) return fl_errorf(FL_ERR_INVALID, "lora_backward: NULL work buffer");
    if (dB) FL_TRY(flb_gemm(be, 1, 0, out, r, N, scaling, dy, FL_F32, ldy, h, FL_F32, r, 1.0f, dB, FL_F32, r));
    if (!dA && !dx) return FL_OK;
    float *g = work;
    FL_TRY(flb_gemm(be, 0, 0, N, r, out, 1.0f, dy, FL_F32, ldy, B, FL_F32, r, 0.0f, g, FL_F32, r));
    if (dA) FL_TRY(flb_gemm(be, 1, 0, r, in, N, scaling, g, FL_F32, r, xb, FL_F32, in, 1.0f, dA, FL_F32, in));
    if (!dx) return FL_OK;
    if (dropout == 0.0f) return flb_gemm(be, 0, 0, N, in, r, scaling, g, FL_F32, r, A, FL_F32, in, 1.0f, dx, FL_F32, in);
    /* dx += drop(scaling g @ A): the r-term products inside the masked update (lora_dx_fused), no N x in temporary
     * written and read back (the work's second part, N x in floats, stays in the contract for other backends) */
    FLB_RUN_S(be, FLB_K(lora_dx_fused)(dx, g, A, N, in, r, scaling, dropout, seed, dseed, STREAM),
              "lora_backward (dropout)");
    return FL_OK;
}
static fl_status flb_lora_backward(const fl_backend *be, float *dx, float *dA, float *dB, const float *dy, int ldy,
                                   const float *xb, const float *h, const float *A, const float *B, int N, int in,
                                   int out, int r, float scaling, float dropout, uint64_t seed, float *work) {
    return flb_lora_backward_s(be, dx, dA, dB, dy, ldy, xb, h, A, B, N, in, out, r, scaling, dropout, seed, work, NULL);
}

/* backend.h dropout (T5's dropout in training): the LoRA dropout kernels on any tensor (the same mask bits) */
static fl_status flb_dropout_s(const fl_backend *be, float *y, const float *x, size_t n, float p, uint64_t seed,
                               int accumulate, const uint64_t *dseed) {
    FL_TRY(flb_sticky(be));
    if (!(p >= 0.0f && p < 1.0f)) return fl_errorf(FL_ERR_INVALID, "dropout: p %g outside [0, 1)", (double)p);
    if (n == 0) return FL_OK;
    if (p == 0.0f) { /* no mask: a copy or a sum */
        if (accumulate) return be->add(be, y, y, x, n), FL_OK;
        return y == x ? FL_OK : be->copy(be, y, x, n * sizeof(float));
    }
    if (accumulate) FLB_RUN_S(be, FLB_K(lora_dropout_dx)(y, x, n, p, seed, dseed, STREAM), "dropout (accumulate)");
    else FLB_RUN_S(be, FLB_K(lora_dropout)(y, x, n, p, seed, dseed, STREAM), "dropout");
    return FL_OK;
}
static fl_status flb_dropout(const fl_backend *be, float *y, const float *x, size_t n, float p, uint64_t seed,
                             int accumulate) {
    return flb_dropout_s(be, y, x, n, p, seed, accumulate, NULL);
}
