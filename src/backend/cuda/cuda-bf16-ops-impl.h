/* The CUDA backend's conversions and bf16-stored outputs (issue 30 item 1): convert, round16, convert_many, and the
 * ops that write a bf16-stored slot's copy themselves (act_forward16, add16, rope_forward16 / rope_backward16,
 * act_backward16). Included once, by cuda-backend-impl.h (backend_cuda.c / emu/backend_cuemu.c), inside it: the
 * helpers (flb_sticky, FLB_RUN_S, FLB_NULL, FLB_K, STREAM) are its. */
static fl_status flb_convert(const fl_backend *be, void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n) {
    FL_TRY(flb_sticky(be));
    if (!flb_float3(dt) || !flb_float3(st))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s convert: %s -> %s not supported", FLB_NAME, fl_dtype_name(st),
                         fl_dtype_name(dt));
    if (n && FLB_NULL(be, "convert", dst, src)) return flb_sticky(be);
    FLB_RUN_S(be, FLB_K(convert)(dst, dt, src, st, n, STREAM), "convert");
    return FL_OK;
}
static fl_status flb_round16(const fl_backend *be, void *dst, fl_dtype dt, float *x, size_t n) {
    FL_TRY(flb_sticky(be));
    if (dt != FL_BF16 && dt != FL_F16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s round16: %s is not a 16-bit type", FLB_NAME, fl_dtype_name(dt));
    if (n && FLB_NULL(be, "round16", dst, x)) return flb_sticky(be);
    FLB_RUN_S(be, FLB_K(round16)(dst, dt, x, n, STREAM), "round16");
    return FL_OK;
}
/* bf16-stored outputs (backend.h act_forward16 / add16 / rope_forward16): refused shapes and kinds answer
 * UNSUPPORTED here, before any launch */
_Static_assert(FL_CU_ACT16_SWIGLU == FL_ACT16_SWIGLU && FL_CU_ACT16_GELU == FL_ACT16_GELU &&
                   FL_CU_ACT16_RELU == FL_ACT16_RELU && FL_CU_ACT16_GEGLU == FL_ACT16_GEGLU &&
                   FL_CU_ACT16_ROUND_IN == FL_ACT16_ROUND_IN,
               "act_forward16: the kernels' kinds");
static fl_status flb_act_forward16(const fl_backend *be, int kind, float *out, void *out16, float *in,
                                   const void *in16, int N, int F) {
    FL_TRY(flb_sticky(be));
    const int k = kind & ~FL_ACT16_ROUND_IN;
    if (k < FL_ACT16_SWIGLU || k > FL_ACT16_GEGLU || ((kind & FL_ACT16_ROUND_IN) && !in16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s act_forward16: kind %d", FLB_NAME, kind);
    if ((!out && !out16) || (!in && (!in16 || (kind & FL_ACT16_ROUND_IN))))
        return fl_errorf(FL_ERR_INVALID, "%s act_forward16: NULL %s", FLB_NAME, !out && !out16 ? "output" : "input");
    FLB_RUN_S(be, FLB_K(act_forward16)(kind, out, out16, in, in16, N, F, STREAM), "act_forward16");
    return FL_OK;
}
static fl_status flb_add16(const fl_backend *be, float *out, void *out16, const float *a, const float *b, size_t n) {
    FL_TRY(flb_sticky(be));
    if (n && FLB_NULL(be, "add16", out, a, b)) return flb_sticky(be);
    FLB_RUN_S(be, FLB_K(add16)(out, out16, a, b, n, STREAM), "add16");
    return FL_OK;
}
/* an op that wrote the bf16 copy alone: n fp32 elements not written (fl_cu_counters.only16) */
static void flb_count_only16(const fl_backend *be, size_t n) {
    FLB_IMPL(be)->count.only16++;
    FLB_IMPL(be)->count.only16_bytes += (long)(n * sizeof(float));
}
/* out (NULL: the bf16 copy alone, x16 then required) from the rows of x (in place: out == x); the backward with x and
 * out NULL: x16 in place (cuDNN's bf16 gradients, attention_backward_b16) */
static fl_status flb_rope16(const fl_backend *be, float *out, void *x16, const float *x, int B, int T, int nh, int HD,
                            int width, const float *cos_t, const float *sin_t, int pos0, int backward) {
    FL_TRY(flb_sticky(be));
    const char *op = backward ? "rope_backward16" : "rope_forward16";
    const int inplace16 = backward && !x && !out;
    if (B > 0 && T > 0 && (inplace16 ? FLB_NULL(be, op, x16) : FLB_NULL(be, op, x) || (!out && FLB_NULL(be, op, x16))))
        return flb_sticky(be);
    if (B < 0 || T < 0 || nh < 0 || HD < 0 || HD % 2 || width < nh * HD)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s rope_%s16: %d heads of %d in rows of %d", FLB_NAME,
                         backward ? "backward" : "forward", nh, HD, width);
    if (backward)
        FLB_RUN_S(be, FLB_K(rope_backward16)(out, x16, x, B, T, nh, HD, width, cos_t, sin_t, pos0, STREAM), op);
    else
        FLB_RUN_S(be, FLB_K(rope_forward16)(out, x16, x, B, T, nh, HD, width, cos_t, sin_t, pos0, STREAM), op);
    if (!out && !inplace16) flb_count_only16(be, (size_t)B * T * width);
    return FL_OK;
}
static fl_status flb_rope_forward16(const fl_backend *be, float *out, void *x16, const float *x, int B, int T, int nh,
                                    int HD, int width, const float *cos_t, const float *sin_t, int pos0) {
    return flb_rope16(be, out, x16, x, B, T, nh, HD, width, cos_t, sin_t, pos0, 0);
}
static fl_status flb_rope_backward16(const fl_backend *be, float *dout, void *dx16, const float *dx, int B, int T,
                                     int nh, int HD, int width, const float *cos_t, const float *sin_t, int pos0) {
    return flb_rope16(be, dout, dx16, dx, B, T, nh, HD, width, cos_t, sin_t, pos0, 1);
}
static fl_status flb_act_backward16(const fl_backend *be, int kind, float *din, void *din16, const float *dout,
                                    const float *in, const void *in16, int N, int F) {
    FL_TRY(flb_sticky(be));
    if (kind < FL_ACT16_SWIGLU || kind > FL_ACT16_GEGLU || (!din16 && !in16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s act_backward16: kind %d%s", FLB_NAME, kind,
                         din16 || in16 ? "" : ", neither a bf16 copy nor a bf16 input");
    /* din NULL: the bf16 copy alone (of a zero din's update) */
    if (N > 0 && F > 0 && (FLB_NULL(be, "act_backward16", din16 ? din16 : (void *)din, dout) ||
                           FLB_NULL(be, "act_backward16", in16 ? in16 : (const void *)in)))
        return flb_sticky(be);
    FLB_RUN_S(be, FLB_K(act_backward16)(kind, din, din16, dout, in, in16, N, F, STREAM), "act_backward16");
    const int pair = kind == FL_ACT16_SWIGLU || kind == FL_ACT16_GEGLU; /* (N, 2F) gradients */
    if (!din && N > 0 && F > 0) flb_count_only16(be, (size_t)N * F * (pair ? 2 : 1));
    return FL_OK;
}
_Static_assert(FL_CU_CONVERT_MANY_MAX == FL_CONVERT_MANY_MAX, "convert_many: the kernel's segment list");
static fl_status flb_convert_many(const fl_backend *be, int count, void *const *dst, fl_dtype dt,
                                  const void *const *src, fl_dtype st, const size_t *len) {
    FL_TRY(flb_sticky(be));
    if (count < 0 || count > FL_CONVERT_MANY_MAX)
        return fl_errorf(FL_ERR_INVALID, "%s convert_many: %d segments (at most %d)", FLB_NAME, count,
                         FL_CONVERT_MANY_MAX);
    for (int k = 0; k < count; k++)
        if (len[k] && FLB_NULL(be, "convert_many", dst[k], src[k])) return flb_sticky(be);
    FLB_RUN_S(be, FLB_K(convert_many)(count, dst, dt, src, st, len, STREAM), "convert_many");
    return FL_OK;
}
