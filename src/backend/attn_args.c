/* The argument checks of the general attention ops (fitllm/backend.h attention_forward_ex /
 * attention_backward_ex), shared by every backend so that a bad descriptor gets the same error,
 * naming the field, wherever it runs. */
#include <math.h>

#include "fitllm/backend.h"

fl_status fl_attn_check_args(const char *op, const fl_attn_desc *a, int max_hd, const char *why_max, const void *out,
                             const void *lse, const float *q, const float *k, const float *v, const float *bias,
                             const float *dbias) {
    if (!a) return fl_errorf(FL_ERR_INVALID, "%s: NULL descriptor", op);
    if (a->B < 0 || a->Tq < 0 || a->Tk < 0 || a->NH <= 0 || a->NKV <= 0 || a->HD <= 0 || a->NH % a->NKV)
        return fl_errorf(FL_ERR_INVALID, "%s: bad shape B %d Tq %d Tk %d NH %d NKV %d HD %d (NH must be a multiple of NKV)",
                         op, a->B, a->Tq, a->Tk, a->NH, a->NKV, a->HD);
    if (a->HD > max_hd)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: head dimension %d > %d (%s)", op, a->HD, max_hd, why_max);
    size_t wq = (size_t)a->NH * a->HD, wk = (size_t)a->NKV * a->HD;
    if (a->ldq < wq || a->ldo < wq || a->ldk < wk || a->ldv < wk)
        return fl_errorf(FL_ERR_INVALID, "%s: row strides ldq %zu ldo %zu (need >= %zu), ldk %zu ldv %zu (need >= %zu)",
                         op, a->ldq, a->ldo, wq, a->ldk, a->ldv, wk);
    if (!out || !lse || !q || !k || !v) return fl_errorf(FL_ERR_INVALID, "%s: NULL tensor", op);
    if (dbias && !bias) return fl_errorf(FL_ERR_INVALID, "%s: dbias given without bias", op);
    if (!isfinite(a->scale)) return fl_errorf(FL_ERR_INVALID, "%s: scale %g is not finite", op, (double)a->scale);
    return FL_OK;
}

