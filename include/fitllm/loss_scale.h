/* fitllm: dynamic loss scaling for fp16 training (16-mixed / 16-true).
 *
 * Exactly torch.amp.GradScaler (torch/amp/grad_scaler.py update() ->
 * torch._amp_update_scale_, CPU kernel checked on torch 2.15):
 *   found_inf:  scale *= backoff_factor; growth_tracker = 0; the optimizer step is SKIPPED;
 *   otherwise:  growth_tracker += 1; if growth_tracker == growth_interval:
 *                   if scale * growth_factor is finite, scale = scale * growth_factor;
 *                   growth_tracker = 0   (reset even when growth would overflow).
 * Defaults: init_scale 2^16, growth_factor 2, backoff_factor 0.5, growth_interval 2000.
 * torch has no lower bound: repeated overflows halve the scale down to subnormals and 0.
 * min_scale (default 0 = torch) optionally clamps the backed-off scale from below.
 *
 * Per step (what the lead wires):
 *   loss is multiplied by fl_loss_scale_value(); backward;
 *   found = 0; for every grad range: be->check_finite(be, g, dtype, n, inv_scale, &found);
 *   skip = fl_loss_scale_update(&ls, found);
 *   if (!skip) optimizer step with grad_scale = inv_scale (times any clip factor);
 * where inv_scale = fl_loss_scale_inv(&ls) is computed before update(), in double then
 * rounded to float as torch does (_unscale_grads_: scale.double().reciprocal().float()).
 */
#ifndef FITLLM_LOSS_SCALE_H
#define FITLLM_LOSS_SCALE_H

#include <stdint.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float scale;            /* current scale (torch keeps it as a float32 tensor) */
    float growth_factor;    /* 2.0 */
    float backoff_factor;   /* 0.5 */
    int growth_interval;    /* 2000 */
    int growth_tracker;     /* consecutive clean steps since the last growth/backoff */
    float min_scale;        /* 0: no floor (torch) */
    int64_t n_skipped;      /* statistics: steps skipped, growths, backoffs */
    int64_t n_growths, n_backoffs;
} fl_loss_scale;

/* Defaults above (init_scale 65536). */
void fl_loss_scale_init(fl_loss_scale *ls);
/* Custom settings; FL_ERR_INVALID if init_scale <= 0 or not finite, growth_factor <= 1,
 * backoff_factor not in (0,1), growth_interval < 1, min_scale < 0. */
fl_status fl_loss_scale_init_ex(fl_loss_scale *ls, float init_scale, float growth_factor, float backoff_factor,
                                int growth_interval, float min_scale);

static inline float fl_loss_scale_value(const fl_loss_scale *ls) { return ls->scale; }
/* (float)(1.0 / (double)scale); 0 if scale is 0 (then every step overflows anyway). */
float fl_loss_scale_inv(const fl_loss_scale *ls);

/* Apply one step's outcome. Returns 1 if the optimizer step must be skipped (found_inf). */
int fl_loss_scale_update(fl_loss_scale *ls, int found_inf);

#ifdef __cplusplus
}
#endif
#endif
