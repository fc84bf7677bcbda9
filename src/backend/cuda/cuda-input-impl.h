/* fitllm CUDA backend: the next micro-batch's inputs uploaded ahead on a second stream (issue 30 item 5;
 * EXPERIMENTAL: emulator-verified, compiled for sm_90, not yet run on a GPU). Included by cuda-backend-impl.h
 * (written once, compiled twice: the CUDA runtime and the emulator).
 *
 * Why: the inputs' upload (ids, targets) on the backend's own stream runs after every kernel queued before it, so
 * micro-batch k+1's copy waited for micro-batch k's backward, and under CUDA graphs each upload (a copy from host
 * memory the caller may reuse: outside any graph) cut the step into more graphs. Here the backend owns
 * FL_INPUT_SLOTS (2) device slots at fixed addresses, micro-batch k of a step reading slot k % 2 (the model points
 * its ids / targets there: fl_model_prefetch):
 *
 *   - input_upload(slot, ...): the host waits until the slot's page-locked staging is free (its last copy done: on
 *     a GPU long since), copies the caller's bytes there (the caller's buffers are free on return), records an
 *     event on the backend's stream (`freed`: every op queued so far, i.e. the slot's last readers, micro-batch
 *     k-1) which the second stream waits for, and copies staging -> slot on the second stream, then records the
 *     slot's `ready` event there. The step issues micro-batch k+1's upload before micro-batch k's ops, so the copy
 *     runs while they compute.
 *   - input_wait(slot): the backend's stream waits for `ready` (cudaStreamWaitEvent): the ops after it read the
 *     slot's new bytes.
 *   - CUDA graphs (FITLLM_CUDA_GRAPHS=1, cuda-graph-impl.h): an upload is a per-step slot op: inside the capture the
 *     copy is a node of the graph on the backend's stream, from a page-locked buffer of its own per upload of the
 *     step (fixed addresses), which the host rewrites before each replay once the segment's last launch passed
 *     (as the per-step scalars); input_wait is then nothing. So the uploads no longer cut the step.
 *
 * On the emulator (backend_cuemu.c) the second stream's copies are queued and run only when waited for, and the ops
 * that read the slots (embedding forward / backward, the cross-entropy, the loss sum) refuse to read bytes a queued
 * copy is still to write: a missing input_wait is an error naming the op, not a silent race.
 * FITLLM_CUDA_PREFETCH=0: no slots (input_slots NULL), the model uploads through to_device as before. */

#define FLB_GSLOTS 1024 /* (cuda-graph-impl.h's per-step slots: a captured upload's page-locked copy per slot) */

typedef struct {
    int on;                      /* FITLLM_CUDA_PREFETCH (1 default) */
    void *s2;                    /* the second stream (made with the slots) */
    char *dev;                   /* FL_INPUT_SLOTS x stride bytes of device memory */
    size_t stride;
    char *pin;                   /* page-locked staging, FL_INPUT_SLOTS x stride */
    void *ready[FL_INPUT_SLOTS]; /* on the second stream after the slot's last copy */
    int recorded[FL_INPUT_SLOTS]; /* ready recorded at least once */
    int staged[FL_INPUT_SLOTS];  /* the staging's copy may still be queued (the host waits before reusing it) */
    void *freed;                 /* recorded on the backend's stream before each upload; the second stream waits */
    char **gpin;                 /* CUDA graphs: a page-locked copy per captured upload (FLB_GSLOTS), made lazily */
} flb_input;

static void flb_input_free(flb_input *in) {
    if (in->s2) flb_s2_free(in->s2); /* after its copies */
    for (int i = 0; i < FL_INPUT_SLOTS; i++)
        if (in->ready[i]) flb_s2_ev_free(in->ready[i]);
    if (in->freed) flb_s2_ev_free(in->freed);
    if (in->dev) flb_dev_free(in->dev);
    if (in->pin) flb_host_free(in->pin);
    for (int i = 0; in->gpin && i < FLB_GSLOTS; i++)
        if (in->gpin[i]) flb_host_free(in->gpin[i]);
    free(in->gpin);
    const int on = in->on;
    memset(in, 0, sizeof *in);
    in->on = on;
}

/* The slots of `bytes` each (made on the first call; a larger request than the first is refused: NULL). */
static void *flb_input_make(flb_input *in, size_t bytes, size_t *stride) {
    const size_t st = (bytes + 255) / 256 * 256;
    if (!in->on || !bytes) return NULL;
    if (in->dev) {
        if (st > in->stride) return NULL;
        *stride = in->stride;
        return in->dev;
    }
    int ok = !flb_s2_new(&in->s2) && (in->dev = (char *)flb_dev_alloc(FL_INPUT_SLOTS * st)) &&
             (in->pin = (char *)flb_host_alloc(FL_INPUT_SLOTS * st)) && !flb_s2_ev_new(&in->freed, in->s2) &&
             (in->gpin = (char **)calloc(FLB_GSLOTS, sizeof *in->gpin));
    for (int i = 0; ok && i < FL_INPUT_SLOTS; i++) ok = !flb_s2_ev_new(&in->ready[i], in->s2);
    if (!ok) {
        flb_input_free(in);
        return NULL;
    }
    in->stride = st;
    *stride = st;
    return in->dev;
}

static int flb_input_args_ok(const flb_input *in, int slot, size_t n0, size_t n1, size_t off1) {
    return in->dev && slot >= 0 && slot < FL_INPUT_SLOTS && n0 <= in->stride && off1 <= in->stride &&
           n1 <= in->stride - off1 && (n1 == 0 || off1 >= n0);
}

/* The upload on the second stream (op by op). 0 ok, else the CUDA / emulator error. */
static int flb_input_upload_s2(flb_input *in, fl_cu_counters *count, void *stream, int slot, const void *src0,
                               size_t n0, const void *src1, size_t n1, size_t off1) {
    char *pin = in->pin + (size_t)slot * in->stride, *dev = in->dev + (size_t)slot * in->stride;
    if (in->staged[slot]) { /* the staging's last copy: done before it is overwritten */
        int rc = flb_host_after_s2(in->ready[slot]);
        if (rc) return rc;
        in->staged[slot] = 0;
    }
    if (n0) memcpy(pin, src0, n0);
    if (n1) memcpy(pin + off1, src1, n1);
    int rc = flb_s2_after_main(in->s2, stream, in->freed); /* after the slot's last readers */
    if (!rc && n0) rc = flb_s2_h2d(dev, pin, n0, in->s2);
    if (!rc && n1) rc = flb_s2_h2d(dev + off1, pin + off1, n1, in->s2);
    if (!rc) rc = flb_s2_record(in->ready[slot], in->s2);
    if (rc) return rc;
    in->recorded[slot] = in->staged[slot] = 1;
    const long pieces = (n0 > 0) + (n1 > 0);
    count->h2d += pieces, count->h2d_pinned += pieces, count->h2d_s2 += pieces;
    return 0;
}
