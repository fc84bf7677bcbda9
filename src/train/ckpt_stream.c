/* Consolidated checkpoints written while their bytes are collected from the ranks (dp.h:
 * fl_dp_stream). A whole-model array (parameters or one optimizer state) is cut into units
 * (FSDP: its per-unit pieces, gathered; ZeRO: pieces of each rank's chunk, broadcast by that rank);
 * every rank fetches the units in the same order, rank 0 when its writer first asks for an element
 * of one (fl_st_write_tensor.fill_range), the others one after the other while rank 0 writes.
 * After the writer returns, done or failed part-way, rank 0 fetches what it did not ask for
 * (fl_dp_stream_drain), so every rank ran the same collectives in the same order. One unit's
 * buffer per rank is all the host memory this takes. */
#include <string.h>

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
