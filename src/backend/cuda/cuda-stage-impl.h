/* fitllm CUDA backend: host-to-device copies of a step's inputs through a pinned ring (issue 30 item 5).
 * Included by cuda-backend-impl.h (written once, compiled twice: the CUDA runtime and the emulator).
 *
 * Why: a cudaMemcpyAsync from pageable host memory may synchronize with the stream before the runtime stages
 * the bytes (CUDA's API synchronization rules), so each micro-batch's ids / targets upload could make the host
 * wait for the GPU to finish the previous micro-batch, and the host could not queue ahead. A copy from
 * page-locked memory is a DMA the stream runs in order, with no host wait. So to_device copies of up to
 * FLB_STAGE_SLOT_BYTES (the inputs; the parameter loads are larger and go direct) are memcpy'd into one slot of
 * a ring of FLB_STAGE_SLOTS page-locked buffers and copied from there on the backend's stream; an event
 * recorded after the copy says when the slot is free again, and the host waits for it only when it is that many
 * copies ahead of the GPU (a natural throttle, counted: stage_waits). The caller's buffer is free when to_device
 * returns (as before). The ring is page-locked host memory outside the pools (FLB_STAGE_SLOTS x
 * FLB_STAGE_SLOT_BYTES, made on first use), like the scalars buffer. FITLLM_CUDA_PINNED=0: every copy direct.
 *
 * Not done: the copy on a second stream ahead of the compute (a prefetch of the next micro-batch): the
 * destination is the arena's one ids / targets region, which the current micro-batch's kernels still read, so
 * the copy must stay behind them until the arena has two input regions to alternate. */
#ifndef FLB_STAGE_SLOTS
#define FLB_STAGE_SLOTS 8
#define FLB_STAGE_SLOT_BYTES ((size_t)1 << 20)
#endif

typedef struct {
    int on;                      /* FITLLM_CUDA_PINNED (1 default) */
    char *ring;                  /* page-locked, FLB_STAGE_SLOTS slots; NULL until the first staged copy */
    void *ev[FLB_STAGE_SLOTS];   /* the event after each slot's copy */
    int pending[FLB_STAGE_SLOTS]; /* an event recorded and not yet waited for */
    int next;
} flb_stage;

/* 0 ok; else a copy failed (the caller reports it) */
static int flb_stage_copy(flb_stage *st, fl_cu_counters *count, void *dst, const void *src, size_t bytes, void *stream) {
    if (!st->on || bytes > FLB_STAGE_SLOT_BYTES) return flb_h2d(dst, src, bytes, stream);
    if (!st->ring) {
        st->ring = (char *)flb_host_alloc(FLB_STAGE_SLOTS * FLB_STAGE_SLOT_BYTES);
        for (int i = 0; st->ring && i < FLB_STAGE_SLOTS; i++)
            if (flb_mark_new(&st->ev[i])) st->ev[i] = NULL;
        for (int i = 0; st->ring && i < FLB_STAGE_SLOTS; i++)
            if (!st->ev[i]) { /* no events: no ring (the copies go direct) */
                for (int j = 0; j < FLB_STAGE_SLOTS; j++)
                    if (st->ev[j]) flb_mark_free(st->ev[j]), st->ev[j] = NULL;
                flb_host_free(st->ring);
                st->ring = NULL;
            }
        if (!st->ring) {
            st->on = 0;
            return flb_h2d(dst, src, bytes, stream);
        }
    }
    const int k = st->next;
    st->next = (k + 1) % FLB_STAGE_SLOTS;
    if (st->pending[k]) { /* the slot's last copy may still be queued: wait for it (the host is far ahead) */
        int rc = flb_mark_wait(st->ev[k]);
        if (rc) return rc;
        count->stage_waits++;
        st->pending[k] = 0;
    }
    char *slot = st->ring + (size_t)k * FLB_STAGE_SLOT_BYTES;
    memcpy(slot, src, bytes);
    int rc = flb_h2d(dst, slot, bytes, stream);
    if (!rc) rc = flb_mark_record(st->ev[k], stream);
    if (!rc) st->pending[k] = 1, count->h2d_pinned++;
    return rc;
}

static void flb_stage_free(flb_stage *st) {
    for (int i = 0; i < FLB_STAGE_SLOTS; i++)
        if (st->ev[i]) flb_mark_free(st->ev[i]);
    if (st->ring) flb_host_free(st->ring);
    memset(st, 0, sizeof *st);
}
