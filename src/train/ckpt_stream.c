/* Consolidated checkpoints written while their bytes are collected from the ranks (dp.h:
 * fl_dp_stream). A whole-model array (parameters or one optimizer state) is cut into units
 * (FSDP: its per-unit pieces, gathered; ZeRO: pieces of each rank's chunk, broadcast by that rank);
 * every rank fetches the units in the same order, rank 0 when its writer first asks for an element
 * of one (fl_st_write_tensor.fill_range), the others one after the other while rank 0 writes.
 * After the writer returns, done or failed part-way, rank 0 fetches what it did not ask for
 * (fl_dp_stream_drain), so every rank ran the same collectives in the same order. One unit's
 * buffer per rank is all the host memory this takes. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/adam8bit.h"

#include "dp.h"

fl_status fl_dp_stream_upto(fl_dp_stream *s, int unit) {
    while (s->err == FL_OK && s->next <= unit) {
        int k = s->next++;
        s->err = fl_error_prefix(s->fetch(s, k), "checkpoint: collecting piece %d of %d", k, s->n_units);
    }
    return s->err;
}

fl_status fl_dp_stream_drain(fl_dp_stream *s) { return fl_dp_stream_upto(s, s->n_units - 1); }

/* n elements from whole-array element `at` into dst, fetching units forward as needed */
static fl_status copy_out(fl_dp_stream *s, char *dst, size_t at, size_t n) {
    while (n > 0) {
        int g = s->next > 0 ? s->next - 1 : 0;
        if (at < s->start[g]) /* the writer reads forward: a unit is not asked for again */
            return fl_errorf(FL_ERR_INTERNAL, "checkpoint stream: element %zu asked for after piece %d", at, g);
        while (g + 1 < s->n_units && at >= s->start[g + 1]) g++;
        if (at >= s->start[g + 1])
            return fl_errorf(FL_ERR_INTERNAL, "checkpoint stream: element %zu past the array's %zu", at,
                             s->start[s->n_units]);
        FL_TRY(fl_dp_stream_upto(s, g));
        size_t len = s->start[g + 1] - at < n ? s->start[g + 1] - at : n;
        memcpy(dst, s->buf + (at - s->start[g]) * s->es, len * s->es);
        dst += len * s->es;
        at += len;
        n -= len;
    }
    return FL_OK;
}

fl_status fl_dp_stream_fill(void *ud, void *dst, size_t off, size_t n) {
    fl_dp_stream_tensor *t = ud;
    return copy_out(t->s, dst, t->start + off, n);
}

int fl_dp_stream_state_tensors(const fl_optimizer *o, size_t numel, fl_dp_stream *us, fl_dp_stream *u8,
                               fl_dp_stream_tensor *ut, fl_st_write_tensor *t) {
    static const char *names[3] = {"optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.momentum_buffer"};
    int nt = 0;
    for (int a = 0; a < 3; a++) {
        if (!us[a].src) continue;
        ut[nt] = (fl_dp_stream_tensor){&us[a], 0};
        t[nt] = (fl_st_write_tensor){.name = names[a], .dtype = o->cfg.state_dtype, .ndim = 1,
                                     .shape = {(int64_t)numel}, .src_dtype = o->cfg.state_dtype,
                                     .fill_range = fl_dp_stream_fill, .fill_ud = &ut[nt]};
        nt++;
    }
    if (u8) { /* checkpoint.c write_state's blob */
        ut[nt] = (fl_dp_stream_tensor){u8, 0};
        t[nt] = (fl_st_write_tensor){.name = "optimizer.state8", .dtype = FL_U8, .ndim = 1,
                                     .shape = {(int64_t)u8->start[u8->n_units]}, .src_dtype = FL_U8,
                                     .fill_range = fl_dp_stream_fill, .fill_ud = &ut[nt]};
        nt++;
    }
    return nt;
}

/* ---- 8-bit AdamW's state (dp.h: fl_dp_stream8) ------------------------------------------------ */

static size_t piece_bytes8(size_t tn, size_t a, size_t len) { return fl_adam8bit_piece_bytes(tn, a, len); }

static fl_status fetch8(fl_dp_stream *s, int i) {
    fl_dp_stream8 *c = s->ctx;
    if (c->skip) return FL_OK;
    const size_t tn = c->t_n[i];
    if (s->dp->rank == 0) memset(s->buf, 0, s->start[i + 1] - s->start[i]);
    for (int r = 0; r < c->world; r++) {
        const size_t a = c->a[(size_t)r * c->n_t + i], len = c->len[(size_t)r * c->n_t + i];
        if (!len) continue;
        const size_t pb = piece_bytes8(tn, a, len);
        /* the owner's piece of device memory into host memory; the broadcast runs whatever came of it (every
         * rank takes part), then a failed copy is reported */
        fl_status cs = r == c->me ? fl_dp_to_host(s->dp, c->stage, (const char *)c->o->q8.state + c->own[i], pb) : FL_OK;
        FL_TRY(fl_comm_broadcast(c->comm, c->stage, (pb + 1) / 2, FL_BF16, r)); /* bytes as 16-bit words */
        FL_TRY(cs);
        if (s->dp->rank == 0) FL_TRY(fl_optim_8bit_piece_to_full(tn, a, len, c->stage, s->buf));
    }
    return FL_OK;
}

fl_status fl_dp_stream8_init(fl_dp_stream *s, fl_dp_stream8 *c, fl_dp *dp, fl_comm *comm, int world, int me, int skip,
                             const fl_optimizer *o, const fl_param_layout *lay) {
    memset(c, 0, sizeof *c);
    memset(s, 0, sizeof *s);
    const int n = lay ? lay->n : o->w.n_tensors;
    c->comm = comm, c->world = world, c->me = me, c->skip = skip, c->n_t = n, c->o = o;
    c->t_n = calloc((size_t)n + 1, sizeof *c->t_n);
    c->a = calloc((size_t)n * world + 1, sizeof *c->a);
    c->len = calloc((size_t)n * world + 1, sizeof *c->len);
    c->own = calloc((size_t)n + 1, sizeof *c->own);
    c->start = calloc((size_t)n + 1, sizeof *c->start);
    if (!c->t_n || !c->a || !c->len || !c->own || !c->start) return fl_errorf(FL_ERR_OOM, "checkpoint: out of host memory");
    size_t unit = 0, piece = 0, own = 0;
    for (int i = 0; i < n; i++) {
        c->t_n[i] = lay ? lay->params[i].numel : o->w.t_n[i];
        for (int r = 0; r < world; r++) {
            size_t *a = &c->a[(size_t)r * n + i], *len = &c->len[(size_t)r * n + i], so;
            if (lay) fl_optim_8bit_fsdp_piece(lay, i, world, r, a, len, &so);
            else fl_optim_8bit_piece(o->w.n, o->w.t_off[i], o->w.t_n[i], world, r, a, len);
            const size_t pb = piece_bytes8(c->t_n[i], *a, *len);
            piece = pb > piece ? pb : piece;
            if (r == me) c->own[i] = own, own += pb;
        }
        const size_t tb = fl_adam8bit_state_bytes(c->t_n[i]);
        c->start[i + 1] = c->start[i] + tb;
        unit = tb > unit ? tb : unit;
    }
    if (!skip && own != o->q8.state_bytes)
        return fl_errorf(FL_ERR_INTERNAL, "checkpoint: 8-bit state of %zu bytes, its pieces make %zu", o->q8.state_bytes,
                         own);
    c->stage = malloc(piece + 8);
    char *buf = malloc(unit + 8);
    if (!c->stage || !buf) {
        free(buf);
        return fl_errorf(FL_ERR_OOM, "checkpoint: out of host memory");
    }
    *s = (fl_dp_stream){dp, n, c->start, 1, fetch8, NULL, 0, buf, 0, FL_OK, c};
    return FL_OK;
}

void fl_dp_stream8_free(fl_dp_stream *s, fl_dp_stream8 *c) {
    free(s->buf);
    free(c->t_n), free(c->a), free(c->len), free(c->own), free(c->start), free(c->stage);
    memset(c, 0, sizeof *c);
    s->buf = NULL;
}
