/* The CUDA backend's ops of tensor parallelism (issue 35; included by cuda-backend-impl.h, compiled twice as it is):
 * backend.h's dropout_rows (lora.cu) and the vocabulary-parallel cross-entropy's halves vocab_stats / vocab_xent
 * (xent_vocab.cu). EXPERIMENTAL: emulator-verified, not run on a GPU. */

static fl_status flb_dropout_rows(const fl_backend *be, float *y, const float *x, int rows, size_t w, size_t stride,
                                  float p, uint64_t seed, int accumulate) {
    FL_TRY(flb_sticky(be));
    if (!(p >= 0.0f && p < 1.0f)) return fl_errorf(FL_ERR_INVALID, "dropout_rows: p %g outside [0, 1)", (double)p);
    if (rows < 0 || stride < w)
        return fl_errorf(FL_ERR_INVALID, "dropout_rows: %d rows of %zu values, row stride %zu (< the width)", rows, w,
                         stride);
    FLB_RUN_S(be, FLB_K(dropout_rows)(y, x, rows, w, stride, p, seed, accumulate, STREAM), "dropout_rows");
    return FL_OK;
}

static fl_status flb_vocab_stats(const fl_backend *be, double *stats, const float *logits, const int32_t *targets,
                                 int rows, int n, int lo) {
    FL_TRY(flb_sticky(be));
    if (rows < 0 || n <= 0) return fl_errorf(FL_ERR_INVALID, "vocab_stats: %d rows of %d logits", rows, n);
    FL_TRY(flb_in_check(be, targets, "vocab_stats"));
    FLB_RUN_S(be, FLB_K(vocab_stats)(stats, logits, targets, rows, n, lo, STREAM), "vocab_stats");
    return FL_OK;
}

static fl_status flb_vocab_xent(const fl_backend *be, float *loss, float *dlogits, const float *logits,
                                const double *all, const int32_t *targets, int rows, int n, int lo, int P, int me,
                                int V, float grad_scale, int ignore_index) {
    FL_TRY(flb_sticky(be));
    if (rows < 0 || n <= 0 || P <= 0 || me < 0 || me >= P || V < P)
        return fl_errorf(FL_ERR_INVALID, "vocab_xent: %d rows of %d logits, rank %d of %d, vocabulary %d", rows, n, me,
                         P, V);
    FL_TRY(flb_in_check(be, targets, "vocab_xent"));
    FLB_RUN_S(be, FLB_K(vocab_xent)(loss, dlogits, logits, all, targets, rows, n, lo, P, me, V, grad_scale,
                                    ignore_index, STREAM),
              "vocab_xent");
    return FL_OK;
}

static void flb_tp_ops_fill(fl_backend *be) {
    be->dropout_rows = flb_dropout_rows;
    be->vocab_stats = flb_vocab_stats;
    be->vocab_xent = flb_vocab_xent;
}
