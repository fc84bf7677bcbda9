/* What a model holds live after each phase of a training step (fitllm/model.h fl_model_live):
 * the step records it at the phase boundary; forward and backward set no live bytes. */
#include <stdint.h>

#include "model-impl.h"

int fl_model_live(const fl_model *m, fl_live_phase phase, fl_live_region *out) {
    int n = 0;
    void *g = fl_model_grads_buffer(m);
    if (phase == FL_LIVE_ZEROED || phase == FL_LIVE_UPDATED) { /* zeros, or consumed: nothing accumulated */
        if (g) out[n++] = (fl_live_region){g, 0, 0};
        return n;
    }
    const int train = phase == FL_LIVE_FORWARD && m->fwd_train;
    const int B = m->fwd_B, T = m->fwd_T;
    if (m->acts) {
        size_t acts, work;
        const void *lbuf;
        fl_acts_live_bytes(m, B, T, train, &acts, &work);
        out[n++] = (fl_live_region){m->acts_arena, acts, 0};
        out[n++] = (fl_live_region){m->work_arena, work, 0};
        lbuf = NULL;
        size_t lb = m->adapt && m->adapt->h.live_acts ? m->adapt->h.live_acts(m, B, T, train && !m->act_ckpt, &lbuf) : 0;
        if (m->acts->s2s) lb = fl_s2s_adapter_live_bytes(m, train); /* its rows differ by stack */
        if (lbuf) out[n++] = (fl_live_region){lbuf, lb, 0};
    }
    if (!g) return n;
    if (phase == FL_LIVE_BACKWARD) {
        out[n++] = (fl_live_region){g, SIZE_MAX, 0}; /* every gradient holds the step's sum */
    } else if (train && !fl_model_provider(m)) { /* the head's gradient (sharded: in its group's gathered buffer) */
        fl_outer_params op;
        fl_get_outer(m, &op);
        fl_dims d = fl_model_dims(&m->cfg);
        size_t hg = m->adapt ? m->adapt->h.head_grad_bytes
                  : op.dhead ? (size_t)d.V * d.C * (fl_model_grads_16(m) ? sizeof(uint16_t) : sizeof(float)) : 0;
        out[n++] = (fl_live_region){g, hg, 1};
    }
    return n;
}
