/* Dynamic loss scaling (torch.amp.GradScaler semantics; see include/fitllm/loss_scale.h) and its plug-in for the
 * step and the update (fl_loss_scaler_dynamic, fitllm/train.h). */
#include "fitllm/loss_scale.h"

#include <math.h>
#include <string.h>

#include "fitllm/train.h"

void fl_loss_scale_init(fl_loss_scale *ls) {
    memset(ls, 0, sizeof *ls);
    ls->scale = 65536.0f;
    ls->growth_factor = 2.0f;
    ls->backoff_factor = 0.5f;
    ls->growth_interval = 2000;
}

fl_status fl_loss_scale_init_ex(fl_loss_scale *ls, float init_scale, float growth_factor, float backoff_factor,
                                int growth_interval, float min_scale) {
    if (!ls) return fl_errorf(FL_ERR_INVALID, "loss_scale: NULL state");
    if (!(init_scale > 0.0f) || !isfinite(init_scale))
        return fl_errorf(FL_ERR_INVALID, "loss_scale: init_scale %g must be finite and > 0", init_scale);
    if (!(growth_factor > 1.0f) || !isfinite(growth_factor))
        return fl_errorf(FL_ERR_INVALID, "loss_scale: growth_factor %g must be > 1", growth_factor);
    if (!(backoff_factor > 0.0f && backoff_factor < 1.0f))
        return fl_errorf(FL_ERR_INVALID, "loss_scale: backoff_factor %g must be in (0, 1)", backoff_factor);
    if (growth_interval < 1)
        return fl_errorf(FL_ERR_INVALID, "loss_scale: growth_interval %d must be >= 1", growth_interval);
    if (!(min_scale >= 0.0f) || !isfinite(min_scale))
        return fl_errorf(FL_ERR_INVALID, "loss_scale: min_scale %g must be finite and >= 0", min_scale);
    fl_loss_scale_init(ls);
    ls->scale = init_scale;
    ls->growth_factor = growth_factor;
    ls->backoff_factor = backoff_factor;
    ls->growth_interval = growth_interval;
    ls->min_scale = min_scale;
    return FL_OK;
}

float fl_loss_scale_inv(const fl_loss_scale *ls) {
    if (ls->scale == 0.0f) return 0.0f;
    return (float)(1.0 / (double)ls->scale);
}

int fl_loss_scale_update(fl_loss_scale *ls, int found_inf) {
    if (found_inf) {
        /* _amp_update_scale_: current_scale * backoff_factor (float32 multiply) */
        float s = ls->scale * ls->backoff_factor;
        if (s < ls->min_scale) s = ls->min_scale;
        ls->scale = s;
        ls->growth_tracker = 0;
        ls->n_skipped++;
        ls->n_backoffs++;
        return 1;
    }
    int successful = ls->growth_tracker + 1;
    if (successful == ls->growth_interval) {
        float s = ls->scale * ls->growth_factor;
        if (isfinite(s)) {
            ls->scale = s;
            ls->n_growths++;
        }
        ls->growth_tracker = 0;
    } else {
        ls->growth_tracker = successful;
    }
    return 0;
}

/* The plug-in over an optimizer's GradScaler state (o->amp.ls): the loss's factor, then per update the overflow check
 * of the gradients times 1/scale and the scale's update; inv computed before the update, as torch does. */
static float dynamic_value(const fl_optimizer *o) { return fl_loss_scale_value(&o->amp.ls); }

static float dynamic_inv(const fl_optimizer *o) { return fl_loss_scale_inv(&o->amp.ls); }
static int dynamic_update(fl_optimizer *o, int found) { return fl_loss_scale_update(&o->amp.ls, found); }

static fl_status dynamic_unscale(fl_optimizer *o, float *inv, int *skip) {
    const float i = dynamic_inv(o);
    int found;
    FL_TRY(fl_optim_found_inf(o, i, &found));
    *skip = dynamic_update(o, found);
    *inv = i;
    return FL_OK;
}

const fl_loss_scaler fl_loss_scaler_dynamic = {"dynamic", dynamic_value, dynamic_unscale, dynamic_inv, dynamic_update};
