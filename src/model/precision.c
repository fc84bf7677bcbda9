/* Precision policies: see include/fitllm/precision.h. */
#include <string.h>

#include "fitllm/precision.h"

static const fl_precision k_policies[FL_PREC_COUNT] = {
    {FL_PREC_32_TRUE, "32-true", FL_F32, FL_F32, 0, FL_F32, 0, 1, FL_F32, FL_F32},
    {FL_PREC_BF16_MIXED, "bf16-mixed", FL_F32, FL_BF16, 1, FL_F32, 0, 1, FL_F32, FL_BF16},
    {FL_PREC_BF16_TRUE, "bf16-true", FL_BF16, FL_BF16, 0, FL_BF16, 0, 1, FL_BF16, FL_BF16},
    {FL_PREC_16_MIXED, "16-mixed", FL_F32, FL_F16, 1, FL_F32, 1, 1, FL_F32, FL_F16},
    {FL_PREC_16_TRUE, "16-true", FL_F16, FL_F16, 0, FL_F16, 1, 1, FL_F32, FL_F16},
};

const fl_precision *fl_precision_get(fl_precision_kind k) {
    return (k >= 0 && k < FL_PREC_COUNT) ? &k_policies[k] : NULL;
}

fl_status fl_precision_find(const char *name, fl_precision *out) {
    for (int i = 0; i < FL_PREC_COUNT; i++)
        if (!strcmp(k_policies[i].name, name)) {
            *out = k_policies[i];
            return FL_OK;
        }
    return fl_errorf(FL_ERR_INVALID, "precision '%s' is not one of 32-true, bf16-mixed, bf16-true, 16-mixed, 16-true",
                     name);
}

size_t fl_precision_copy_bytes(const fl_precision *p, size_t n) {
    return p->compute_copy ? n * fl_dtype_size(p->compute_dtype) : 0;
}
