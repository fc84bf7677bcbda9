/* fitllm CUDA backend: the input slots' ops (input_slots, input_upload, input_wait; cuda-input-impl.h has the state
 * and the second stream's part). Included by cuda-backend-impl.h where the backend's state and the staging ring are
 * known (written once, compiled twice). */
static void *flb_input_slots(const fl_backend *be, size_t bytes, size_t *stride) {
    return flb_input_make(&FLB_IMPL(be)->in, bytes, stride);
}
/* inside CUDA graphs (capture or replay) an upload is a node on the backend's stream (cuda-graph-impl.h); one that
 * reaches the slot there (a replay that stopped part way) copies in stream order through the pinned ring */
static int flb_input_in_graphs(const flb_impl *im) {
    return im->graph.on && (im->graph.state == FLB_G_CAPTURE || im->graph.state == FLB_G_REPLAY);
}
static fl_status flb_input_upload(const fl_backend *be, int slot, const void *src0, size_t n0, const void *src1,
                                  size_t n1, size_t off1) {
    FL_TRY(flb_sticky(be));
    flb_impl *im = FLB_IMPL(be);
    flb_input *in = &im->in;
    if (!flb_input_args_ok(in, slot, n0, n1, off1))
        return fl_errorf(FL_ERR_INVALID, "%s input_upload: slot %d, %zu + %zu bytes at %zu (slots of %zu bytes%s)",
                         FLB_NAME, slot, n0, n1, off1, in->stride, in->dev ? "" : ": none made");
    int rc;
    char *dev = in->dev + (size_t)slot * in->stride;
    if (flb_input_in_graphs(im)) {
        rc = n0 ? flb_stage_copy(&im->stage, &im->count, dev, src0, n0, STREAM) : 0;
        if (!rc && n1) rc = flb_stage_copy(&im->stage, &im->count, dev + off1, src1, n1, STREAM);
        im->count.h2d += (n0 > 0) + (n1 > 0);
    } else {
        rc = flb_input_upload_s2(in, &im->count, STREAM, slot, src0, n0, src1, n1, off1);
    }
    if (rc) {
        flb_set_error(be, FL_ERR_IO, "input_upload", flb_last_error(rc));
        return flb_sticky(be);
    }
    return FL_OK;
}
static fl_status flb_input_wait(const fl_backend *be, int slot) {
    FL_TRY(flb_sticky(be));
    flb_impl *im = FLB_IMPL(be);
    if (slot < 0 || slot >= FL_INPUT_SLOTS || !im->in.dev)
        return fl_errorf(FL_ERR_INVALID, "%s input_wait: slot %d (%s)", FLB_NAME, slot,
                         im->in.dev ? "out of range" : "no slots made");
    if (flb_input_in_graphs(im) || !im->in.recorded[slot]) return FL_OK; /* in stream order already */
    int rc = flb_main_after_s2(STREAM, im->in.ready[slot]);
    if (rc) flb_set_error(be, FL_ERR_IO, "input_wait", flb_last_error(rc));
    return flb_sticky(be);
}
/* An op about to read p (an input slot's ids or targets): refused when a copy on the second stream is still to write
 * it (the emulator knows; a GPU would race): the upload's input_wait is missing (cuda-input-impl.h). */
static fl_status flb_in_check(const fl_backend *be, const void *p, const char *op) {
    flb_impl *im = FLB_IMPL(be);
    if (!im->in.s2 || !p || !flb_s2_pending(im->in.s2, p)) return FL_OK;
    char why[160];
    snprintf(why, sizeof why, "reads input slot bytes at %p that a copy on the second stream is still to write (no "
             "input_wait for the slot before it)", p);
    flb_set_error(be, FL_ERR_INTERNAL, op, why);
    return flb_sticky(be);
}
