/* fitllm CUDA backend: the GEMM slots beyond gemm (issue 30 item 3): gemm_epilogue (a linear's bias, GPT-2's bias +
 * GELU, in cuBLASLt's epilogue) and gemm_bench (cuBLASLt's own rate for a shape, for bench-step --profile).
 * Included by cuda-backend-impl.h after flb_gemm (written once, compiled twice). */

/* gemm_epilogue (issue 30 item 3): one matmul of rows of C with the bias (+ GELU) in cuBLASLt's epilogue; where
 * cuBLASLt refuses it (said once; epilogues are off for this backend from then on, or for a bf16 output only) or
 * FITLLM_CUDA_EPILOGUE=0, the GEMM then the bias and GELU kernels: the bits the stand-in's epilogue has (the emulator's
 * kernels' formulas). cuBLASLt takes a bias of D's type only (fl_cu_gemm_lt_bias_ok, cu_gemm.h): it is never asked
 * for another. A bf16 bias with an fp32 D (a bf16 store's bias, GPT-2's c_proj / c_fc) is widened (exact) into the
 * work area first, one launch of N elements, then fused as an fp32 bias; an fp32 bias with a bf16 D (bf16-mixed's
 * c_attn) is fused into the fp32 scratch aux, then rounded into C (RNE of the same fp32 value: the same bits). */
static void *flb_work(const fl_backend *be, size_t bytes, const char *op); /* cuda-work-ops-impl.h */
static fl_status flb_epi_part(const fl_backend *be, int epi, const void *bias, fl_dtype bt, float *aux, int trans_a,
                              int trans_b, int M, int N, int K, float alpha, const void *A, fl_dtype ta, int lda,
                              const void *B, fl_dtype tb, int ldb, float beta, float *C, int c16) {
    flb_impl *im = FLB_IMPL(be);
    const int gelu = epi == FL_GEMM_EPI_BIAS_GELU;
    /* the fused call's bias and D: of one type (c16 with an fp32 bias: D the fp32 aux, rounded into C after) */
    const int d16 = c16 && bt == FL_BF16, via_aux = c16 && !d16;
    const void *fb = bias;
    if (im->epi > 0 && bt == FL_BF16 && !c16 && (size_t)N * sizeof(float) <= FLB_WORK_BYTES) {
        float *w = (float *)flb_work(be, (size_t)N * sizeof(float), "gemm_epilogue (bias widening)");
        if (!w) return flb_sticky(be);
        FLB_RUN_S(be, FLB_K(convert)(w, FL_F32, bias, FL_BF16, (size_t)N, im->stream), "gemm_epilogue (bias widening)");
        fb = w;
    }
    const fl_dtype fbt = fb == bias ? bt : FL_F32;
    if (im->epi > 0 && fbt == (d16 ? FL_BF16 : FL_F32) && (!via_aux || aux) && (!d16 || !(im->epi & 4))) {
        fl_cu_blas *ctx = flb_blas(be);
        if (!ctx) return flb_sticky(be);
        fl_status st = fl_cu_gemm_rowmajor_epi(flb_gemm_fn, ctx, gelu ? FL_CU_EPI_GELU_AUX_BIAS : FL_CU_EPI_BIAS, fb,
                                               fbt, gelu ? aux : NULL, N, trans_a, trans_b, M, N, K, alpha, A, ta, lda,
                                               B, tb, ldb, beta, via_aux ? aux : C, d16 ? FL_BF16 : FL_F32, N);
        if (st == FL_OK && via_aux)
            FLB_RUN_S(be, FLB_K(convert)(C, FL_BF16, aux, FL_F32, (size_t)M * N, im->stream), "gemm_epilogue (bf16)");
        if (st != FL_ERR_UNSUPPORTED) {
            if (st != FL_OK) flb_set_error(be, st, "gemm_epilogue", fl_error_message());
            return st;
        }
        fprintf(stderr, "fitllm: %s backend: cuBLASLt refused an epilogue%s (%s); the bias and GELU of the linears run "
                        "as kernels after their GEMMs from here on\n", FLB_NAME, d16 ? " with a bf16 output" : "",
                fl_error_message());
        if (d16) im->epi |= 4;
        else im->epi = 0;
    }
    if (c16 && !aux)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm_epilogue: a bf16 output unfused needs the fp32 scratch (aux)",
                         FLB_NAME);
    float *y = gelu || c16 ? aux : C; /* c16: the fp32 result in aux, then rounded into C */
    FL_TRY(flb_gemm_direct(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, y, FL_F32, N));
    FLB_RUN_S(be, FLB_K(bias_forward_t)(y, bias, bt, M, N, im->stream), "gemm_epilogue (bias)");
    if (gelu) FLB_RUN_S(be, FLB_K(gelu_forward)(C, aux, (size_t)M * N, im->stream), "gemm_epilogue (gelu)");
    if (c16) FLB_RUN_S(be, FLB_K(convert)(C, FL_BF16, aux, FL_F32, (size_t)M * N, im->stream), "gemm_epilogue (bf16)");
    return FL_OK;
}

static fl_status flb_gemm_epilogue(const fl_backend *be, int epi, const void *bias, float *aux, int ldaux, int trans_a,
                                   int trans_b, int M, int N, int K, float alpha, const void *A, fl_dtype ta, int lda,
                                   const void *B, fl_dtype tb, int ldb, float beta, float *C, int ldc) {
    FL_TRY(flb_sticky(be));
    const fl_dtype bt = epi & FL_GEMM_EPI_BIAS_BF16 ? FL_BF16 : FL_F32; /* the bias as stored */
    const int c16 = epi > 0 && (epi & FL_GEMM_EPI_OUT_BF16); /* C bf16 */
    if (epi > 0) epi &= ~(FL_GEMM_EPI_BIAS_BF16 | FL_GEMM_EPI_OUT_BF16);
    const int gelu = epi == FL_GEMM_EPI_BIAS_GELU;
    if (c16 && (epi != FL_GEMM_EPI_BIAS || beta != 0.0f || ta != FL_BF16 || tb != FL_BF16 || (aux && ldaux != N) ||
                K < 1))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm_epilogue: a bf16 output takes the bias epilogue, beta 0, bf16 A "
                         "and B, K >= 1 and an aux scratch of ldaux N or none (epilogue %d, beta %g, A %s, B %s, K %d, "
                         "ldaux %d)", FLB_NAME, epi, (double)beta, fl_dtype_name(ta), fl_dtype_name(tb), K, ldaux);
    if ((epi != FL_GEMM_EPI_BIAS && !gelu) || !bias || ldc != N || (gelu && (!aux || ldaux != N || beta != 0.0f)))
        return fl_errorf(FL_ERR_INVALID, "%s gemm_epilogue: epilogue %d, bias %s, ldc %d, ldaux %d, beta %g (expected "
                         "bias or bias+GELU, a bias, compact rows ldc = ldaux = N = %d, beta 0 with GELU)", FLB_NAME,
                         epi, bias ? "given" : "NULL", ldc, ldaux, (double)beta, N);
    if (!flb_gemm_types_ok(ta, tb, FL_F32))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm_epilogue: types A=%s B=%s not supported", FLB_NAME,
                         fl_dtype_name(ta), fl_dtype_name(tb));
    if (M < 0 || N < 0 || K < 0)
        return fl_errorf(FL_ERR_INVALID, "%s gemm_epilogue: bad shape %d x %d x %d", FLB_NAME, M, N, K);
    if (M == 0 || N == 0) return FL_OK;
    if (FLB_NULL(be, "gemm_epilogue", C) || (K > 0 && FLB_NULL(be, "gemm_epilogue", A, B))) return flb_sticky(be);
    if (K > 0 && ta == tb) /* the library's own types: one matmul */
        return flb_epi_part(be, epi, bias, bt, aux, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C,
                            c16);
    if (K > 0 && ta == FL_F32 && tb == FL_BF16 && !trans_a) { /* flb_gemm's bf16 row panels, each with the epilogue */
        void *s = flb_scratch(be);
        if (!s) return flb_sticky(be);
        char *panel = (char *)s + FLB_LT_WS_BYTES;
        const int rows = fl_cu_gemm_panel_rows(M, (int)(FLB_PANEL_BYTES / ((size_t)K * 2)));
        if (rows < 1) return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm: K = %d too large for the panel", FLB_NAME, K);
        for (int i0 = 0; i0 < M; i0 += rows) {
            const int mr = M - i0 < rows ? M - i0 : rows;
            FLB_RUN_S(be, FLB_K(convert2d)(panel, FL_BF16, (size_t)K, (const float *)A + (size_t)i0 * lda, FL_F32,
                                           (size_t)lda, mr, K, FLB_IMPL(be)->stream), "gemm_epilogue (bf16 panel)");
            FL_TRY(flb_epi_part(be, epi, bias, bt, gelu ? aux + (size_t)i0 * N : NULL, 0, trans_b, mr, N, K, alpha, panel,
                                FL_BF16, K, B, tb, ldb, beta, C + (size_t)i0 * N, 0));
        }
        return FL_OK;
    }
    /* the other mixed types and K = 0: flb_gemm, then the kernels */
    float *y = gelu ? aux : C;
    FL_TRY(flb_gemm(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, y, FL_F32, N));
    FLB_RUN_S(be, FLB_K(bias_forward_t)(y, bias, bt, M, N, FLB_IMPL(be)->stream), "gemm_epilogue (bias)");
    if (gelu) FLB_RUN_S(be, FLB_K(gelu_forward)(C, aux, (size_t)M * N, FLB_IMPL(be)->stream), "gemm_epilogue (gelu)");
    return FL_OK;
}

/* gemm_res16 (issue 30 items 1 and 3): one matmul, cuBLASLt's C the bf16 c16 read with beta 1 and its D the separate
 * d16 (the stand-in: the same contract, cu_gemm.h), so a bf16 run's residual sum is written by the projection's GEMM:
 * no fp32 output, no add launch. Installed unless FITLLM_CUDA_RESGEMM=0 (flb_gelu16_init). */
static fl_status flb_gemm_res16(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                                const void *A, int lda, const void *B, int ldb, const void *c16, void *d16, int ldc) {
    FL_TRY(flb_sticky(be));
    if (M < 0 || N < 0 || K < 1 || ldc < N)
        return fl_errorf(FL_ERR_INVALID, "%s gemm_res16: bad shape %d x %d x %d, ldc %d (K >= 1, ldc >= N)", FLB_NAME,
                         M, N, K, ldc);
    if (M == 0 || N == 0) return FL_OK;
    if (FLB_NULL(be, "gemm_res16", A, B, c16, d16)) return flb_sticky(be);
    fl_cu_blas *ctx = flb_blas(be);
    if (!ctx) return flb_sticky(be);
    fl_cu_gemm_desc d;
    fl_cu_gemm_desc_rowmajor(&d, trans_a, trans_b, M, N, K, alpha, A, FL_BF16, lda, B, FL_BF16, ldb, 1.0f,
                             (void *)c16, FL_BF16, ldc);
    d.D = d16;
    FL_TRY(fl_cu_gemm_check(&d)); /* a bad argument (D overlapping C) is the caller's: not the backend's sticky error */
    fl_status st = flb_gemm_fn(ctx, &d);
    if (st != FL_OK) {
        flb_set_error(be, st, "gemm_res16", fl_error_message());
        return st;
    }
    FLB_IMPL(be)->count.gemm_res16++;
    FLB_IMPL(be)->count.res16_bytes += (long)M * N * 4;
    return FL_OK;
}

/* FITLLM_CUDA_GELU16 (issue 30 item 3; EXPERIMENTAL: emulator-verified, not yet timed on a GPU): fl_backend's
 * gelu16_epilogue, whether a bf16-activation run's biased linear + tanh GELU (GPT-2's c_fc) is one gemm_epilogue whose
 * GELU reads the fp32 pre-activation, both outputs then stored by round16 (1: closer to a float64 evaluation than the
 * GELU of the bf16-rounded pre-activation, tests/test_cuda_epilogue.c) or the GEMM + bias, then the GELU of the
 * rounded pre-activation in one act_forward16 (0, the default: the fused path stores with two round16 passes where
 * act_forward16 makes one, and moves cuda-emu's bf16 losses off the CPU backend's). Another value is an init error. */
#ifndef FLB_GELU16_DEFAULT
#define FLB_GELU16_DEFAULT 0
#endif
static fl_status flb_bias_backward16(const fl_backend *be, float *db, void *dy16, const float *dy, int N, int OC);
static fl_status flb_attention_forward_in16(const fl_backend *be, const fl_attn_desc *a, float *out, void *out16,
                                            float *lse, const void *q16, const void *k16, const void *v16,
                                            const uint8_t *kmask);
static fl_status flb_add_norm_forward16(const fl_backend *be, int ln, float *res, void *res16, float *out, void *out16,
                                        float *mean, float *rstd, const float *a, const float *b, const void *w,
                                        const void *bias, fl_dtype wt, int N, int C, float eps);
static fl_status flb_add_norm_forward16_b16(const fl_backend *be, int ln, float *res, void *res16, float *out,
                                            void *out16, float *mean, float *rstd, const float *a, const void *b16,
                                            const void *w, const void *bias, fl_dtype wt, int N, int C, float eps);
/* (also installs the issue-30 bf16 slots: bias_backward16, attention_forward_in16, add_norm_forward16 (item 4);
 * cuda-work-ops-impl.h) */
static fl_status flb_gelu16_init(fl_backend *be) {
    be->bias_backward16 = flb_bias_backward16;
    be->add_norm_forward16 = flb_add_norm_forward16;
    be->add_norm_forward16_b16 = flb_add_norm_forward16_b16;
    be->attention_forward_in16 = flb_attention_forward_in16;
    /* FITLLM_CUDA_RESGEMM=0: no gemm_res16, a bf16 run's residual adds after their projections' fp32 outputs (A/B) */
    const char *er = getenv("FITLLM_CUDA_RESGEMM");
    if (er && *er && strcmp(er, "0") && strcmp(er, "1"))
        return fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_RESGEMM=%s: expected 1 (the default: a bf16 run's "
                         "residual add written by its projection's GEMM, C the stored residual) or 0 (the GEMM's fp32 "
                         "output, then the add)", FLB_NAME, er);
    be->gemm_res16 = er && !strcmp(er, "0") ? NULL : flb_gemm_res16;
    const char *e = getenv("FITLLM_CUDA_GELU16");
    be->gelu16_epilogue = !e || !*e ? FLB_GELU16_DEFAULT : !strcmp(e, "1");
    if (!e || !*e || !strcmp(e, "0") || !strcmp(e, "1")) return FL_OK;
    return fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_GELU16=%s: expected 0 (the default: with bf16 activations "
                     "a biased linear's GELU reads its bf16-rounded pre-activation, after the GEMM) or 1 (experimental: "
                     "in the GEMM's epilogue, from the fp32 pre-activation)", FLB_NAME, e);
}

static fl_status flb_init_random(const fl_backend *be, void *dst, fl_dtype dt, size_t k0, size_t k1, size_t numel,
                                 int kind, double sd, uint64_t s);

/* gemm_bench: the shape's operands of the backend's own (normal(0, 1): a GEMM's speed on zeros is not its speed
 * on data), timed by the library's bench (cu_gemm.h: cuBLASLt's candidate algorithms; the stand-in's loop). The
 * types the backend's gemm converts a panel for are timed as the matmul it runs: F32 x BF16 as BF16 x BF16, F32 x
 * F16 as F32 x F32. */
static fl_status flb_gemm_bench(const fl_backend *be, int epi, int trans_a, int trans_b, int M, int N, int K,
                                fl_dtype ta, fl_dtype tb, fl_dtype tc, int reps, double *best_ms, double *chosen_ms) {
    *best_ms = *chosen_ms = -1;
    FL_TRY(flb_sticky(be));
    if (!flb_gemm_types_ok(ta, tb, tc) || (epi && tc != FL_F32))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm_bench: types A=%s B=%s C=%s%s not supported", FLB_NAME,
                         fl_dtype_name(ta), fl_dtype_name(tb), fl_dtype_name(tc), epi ? " with an epilogue" : "");
    if (M < 1 || N < 1 || K < 1 || reps < 1 || epi < 0 || epi > FL_GEMM_EPI_BIAS_GELU)
        return fl_errorf(FL_ERR_INVALID, "%s gemm_bench: shape %d x %d x %d, %d repetitions, epilogue %d", FLB_NAME, M,
                         N, K, reps, epi);
    if (ta == FL_F32 && tb == FL_BF16) ta = FL_BF16;
    if (ta == FL_F32 && tb == FL_F16) tb = FL_F32;
    const size_t na = (size_t)M * K, nb = (size_t)K * N, nc = (size_t)M * N;
    void *A = flb_dev_alloc(na * fl_dtype_size(ta)), *B = flb_dev_alloc(nb * fl_dtype_size(tb));
    void *C = flb_dev_alloc(nc * fl_dtype_size(tc));
    float *bias = epi ? (float *)flb_dev_alloc((size_t)N * sizeof(float)) : NULL;
    float *aux = epi == FL_GEMM_EPI_BIAS_GELU ? (float *)flb_dev_alloc(nc * sizeof(float)) : NULL;
    fl_status st = A && B && C && (!epi || bias) && (epi != FL_GEMM_EPI_BIAS_GELU || aux)
                       ? FL_OK
                       : fl_errorf(FL_ERR_OOM, "%s gemm_bench: cannot allocate the operands of %d x %d x %d", FLB_NAME,
                                   M, N, K);
    if (st == FL_OK) st = flb_init_random(be, A, ta, 0, na, na, 2, 1.0, 0x6e11);
    if (st == FL_OK) st = flb_init_random(be, B, tb, 0, nb, nb, 2, 1.0, 0x6e12);
    if (st == FL_OK && bias) st = flb_init_random(be, bias, FL_F32, 0, (size_t)N, (size_t)N, 2, 1.0, 0x6e13);
    fl_cu_blas *ctx = st == FL_OK ? flb_blas(be) : NULL;
    if (st == FL_OK && !ctx) st = flb_sticky(be);
    if (st == FL_OK) {
        fl_cu_gemm_desc d;
        fl_cu_gemm_desc_rowmajor(&d, trans_a, trans_b, M, N, K, 1.0f, A, ta, trans_a ? M : K, B, tb, trans_b ? K : N,
                                 0.0f, C, tc, N);
        d.epilogue = epi == FL_GEMM_EPI_BIAS_GELU ? FL_CU_EPI_GELU_AUX_BIAS : epi ? FL_CU_EPI_BIAS : FL_CU_EPI_NONE;
        d.bias = bias, d.aux = aux, d.ldaux = N;
        int n_algos = 0;
        st = flb_gemm_bench_fn(ctx, &d, reps, best_ms, chosen_ms, &n_algos);
    }
    (void)flb_stream_sync(FLB_IMPL(be)->stream); /* the operands are freed next */
    if (A) flb_dev_free(A);
    if (B) flb_dev_free(B);
    if (C) flb_dev_free(C);
    if (bias) flb_dev_free(bias);
    if (aux) flb_dev_free(aux);
    return st;
}
