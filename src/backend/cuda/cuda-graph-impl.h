/* fitllm CUDA backend: FITLLM_CUDA_GRAPHS=1, the training step as CUDA Graphs (issue 30 item 5; EXPERIMENTAL,
 * default 0). Included by cuda-backend-impl.h (written once, compiled twice).
 *
 * The backend's one door (fl_backend.run) sees every op of a step. A step ends at its optimizer update. With
 * FITLLM_CUDA_GRAPHS=1 the door runs step 1 op by op, captures step 2 and replays it from step 3 on:
 *
 *   - The ops that cannot be in a graph run outside it, op by op, in stream order: what reads a value back to the
 *     host or synchronizes (to_host, sync, sumsq, check_finite), what copies from host memory the caller may
 *     reuse (to_device: the next micro-batch's ids), the host path's SGD and 8-bit AdamW updates, and set-up (set_scratch,
 *     set_compute_dtype, convert_many's host arrays). They cut the step into segments: each run of the other ops
 *     between two of them is one graph (about 2 n_micro + 2 per step: a micro-batch's forward + head, its
 *     backward, the zeroing before, the update).
 *   - A step ends at its update; 8-bit AdamW updates tensor by tensor (adam8bit_update_ss, one per tensor, their
 *     constants from one slot shared by the step's tensors): its step ends at the first other op after them.
 *   - Per-step scalars: AdamW's constants (step, learning rate, bias corrections, gradient scale), the
 *     cross-entropy's gradient scale (1 / the step's valid targets), the dropout seeds (LoRA's, T5's dropout op)
 *     and the step scalars' unscale (grad_norm_dev's and check_finite_dev's 1 / the fp16 loss scale) change;
 *     inside a graph their kernels read them from a device slot the graph fills from page-locked memory, which the
 *     host rewrites before each replay (flb_graph_slot_*).
 *   - Capture (the second step): each segment's ops are issued inside cudaStreamBeginCapture / EndCapture
 *     (the emulator: its capture records each launch with its arguments by value, cu_emu.h) and their records
 *     kept (an attention's descriptor and a 4-bit weight's header copied with them, padding cleared); the
 *     graph is instantiated and launched.
 *   - Replay (the later steps): an op that equals the kept record at its place (kind, arguments, the copied
 *     headers) is absorbed; when a segment's last op is absorbed, its graph is launched. An op that differs
 *     (a new shape, pointer or by-value argument: T5's attention dropout seed), an op more or less, or a read
 *     from the host in the middle of a segment: the absorbed ops of the segment run op by op as issued (the same
 *     bits), the rest of the step runs op by op, and the next step replays again; after two such steps in a row the step is captured
 *     again (cudaGraphExecUpdate keeps an executable graph where only arguments changed), after 4 recaptures
 *     the run stays op by op. Any capture that fails (an op inside it synchronized) or an error: op by op from
 *     then on, with one line on stderr saying why.
 *
 * The bits are the op-by-op ones: a replay runs the same kernels with the same arguments in the same order
 * (`cuda_emu_graphs_replay` checks losses, norms and weights over several steps, with accumulation and a changing
 * learning rate). Not with several ranks (the collectives are not captured: the door stays op by op once a
 * communicator is made), nor where the device memory is the host's (cuda-emu's default; the host would read
 * results the graph has not yet written), nor on cuda-emu with a cuDNN library (its stand-in computes on the host as
 * it is called: not captured). FLB_PREFIX(backend_graph_verdict) says what happens;
 * FLB_PREFIX(backend_graph_stats) counts. The including file defines flb_capture_begin / _end, flb_graph_launch /
 * _free / _nodes and flb_capture_clear. */

typedef struct {
    fl_oprec rec;       /* the record, its pointer to a header NULL (the header in aux when has_hdr) */
    int has_hdr;
    int slot;           /* its per-step scalars' slot (flb_graph_slot_op), -1: none */
    int share;          /* 8-bit AdamW's next tensor: the slot of the record before it (the same constants) */
#define FLB_GMAX_(a, b) (sizeof(a) > sizeof(b) ? sizeof(a) : sizeof(b))
    _Alignas(16) unsigned char aux[FLB_GMAX_(fl_attn_desc, fl_q4_weight[FL_Q4_MAX_PARTS]) > sizeof(fl_adam8bit_state)
                                       ? FLB_GMAX_(fl_attn_desc, fl_q4_weight[FL_Q4_MAX_PARTS])
                                       : sizeof(fl_adam8bit_state)];
#undef FLB_GMAX_
} flb_grec;

typedef struct {
    flb_grec *r;
    int n, cap;
    int s0, s1; /* the per-step scalar slots [s0, s1) its graph copies to the device (given out in order) */
    void *ev;   /* recorded after its launch: its slots may be rewritten once it passed */
    int armed;
    void *exec; /* the executable graph */
} flb_gseg;

enum { FLB_G_OFF, FLB_G_FIRST, FLB_G_CAPTURE, FLB_G_REPLAY, FLB_G_EAGER };
#define FLB_GSLOTS 1024
#define FLB_GSLOT_BYTES 64

typedef struct {
    int on;                 /* FITLLM_CUDA_GRAPHS=1 */
    int state;              /* FLB_G_* */
    void *stream;           /* the backend's */
    fl_status *err;         /* the backend's sticky error (a failed capture's launches are not the run's) */
    flb_input *in;          /* the backend's input slots (an upload is a per-step slot op: cuda-input-impl.h) */
    flb_gseg *seg;          /* the captured step's segments */
    int nseg, capseg;
    int cur, pos;           /* replay: the segment, the next record in it; capture: a segment is open (pos) */
    int bad, bad_run;       /* replay: this step fell back to op by op; steps in a row that did */
    int upd_open;           /* 8-bit AdamW's per-tensor updates ran: the step ends at the next other op */
    fl_status saved_err;    /* the sticky error when the open capture began */
    int said;               /* the line on stderr */
    /* per-step scalars (AdamW's constants, the cross-entropy's gradient scale, dropout seeds): FLB_GSLOTS slots of
     * FLB_GSLOT_BYTES, written to pin (page-locked) by the host, copied to dslot (device) by the graph that reads
     * them; a segment's slots are rewritten only once the event after its last launch passed */
    char *pin, *dslot;
    int nslot; /* capture: the slots given out this step */
    char miss[160];         /* where the last replay stopped */
    flb_grec *live;         /* replay: the absorbed ops of the current segment as issued (a miss runs these) */
    int live_cap;
    fl_cu_graph_stats st;
    char verdict[320];
} flb_graph;

static void flb_set_error(const fl_backend *be, fl_status s, const char *op, const char *why);
static fl_status flb_lora_forward_s(const fl_backend *be, float *y, int ldy, float *h, float *xd, const float *x,
                                    const float *A, const float *B, int N, int in, int out, int r, float scaling,
                                    float dropout, uint64_t seed, const uint64_t *dseed);
static fl_status flb_lora_backward_s(const fl_backend *be, float *dx, float *dA, float *dB, const float *dy, int ldy,
                                     const float *xb, const float *h, const float *A, const float *B, int N, int in,
                                     int out, int r, float scaling, float dropout, uint64_t seed, float *work,
                                     const uint64_t *dseed);
static fl_status flb_dropout_s(const fl_backend *be, float *y, const float *x, size_t n, float p, uint64_t seed,
                               int accumulate, const uint64_t *dseed);
static fl_status flb_grad_norm_dev_s(const fl_backend *be, const void *g, fl_dtype tg, size_t n, float max_norm,
                                     float scale, int n_loss, double *ss, const float *dscale);
static fl_status flb_check_finite_dev_s(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                                        double *ss, const float *dinv);

/* Ops whose by-value arguments change every step and that read them from a device slot inside a graph: AdamW's
 * update (step, learning rate, bias corrections, gradient scale) and the cross-entropy (its gradient scale,
 * 1 / the step's valid targets). */
static int flb_graph_adamw_types(fl_dtype tp, fl_dtype tg, fl_dtype ts) {
    const int f3 = (tp == FL_F32 || tp == FL_BF16 || tp == FL_F16) && (tg == FL_F32 || tg == FL_BF16 || tg == FL_F16);
    return f3 && (ts == FL_F32 || ts == FL_BF16);
}
static int flb_graph_slot_op(const flb_graph *g, const fl_oprec *op) {
    if (!g->pin) return 0;
    if (op->kind == FL_OPK_input_upload) /* the inputs, copied up (past the slots: outside, between the graphs) */
        return g->in && g->in->dev && g->in->gpin && (g->state != FLB_G_CAPTURE || g->nslot < FLB_GSLOTS);
    if (op->kind == FL_OPK_cross_entropy || op->kind == FL_OPK_cross_entropy_dbf16) return 1;
    if (op->kind == FL_OPK_lora_forward) return op->lora_forward.dropout > 0.0f;
    if (op->kind == FL_OPK_lora_backward) return op->lora_backward.dropout > 0.0f;
    if (op->kind == FL_OPK_dropout) return op->dropout.p > 0.0f;
    /* the step scalars' norm and fp16's overflow check: the unscale 1 / the loss scale, which changes on an overflow
     * or a growth */
    if (op->kind == FL_OPK_grad_norm_dev || op->kind == FL_OPK_check_finite_dev) return 1;
    if (op->kind == FL_OPK_adam8bit_update_ss) { /* likewise, one update per tensor (adam8bit_update_dss): the
                                                  * tensors of a step share one slot (flb_graph_a8_shares) */
        const struct fl_op_adam8bit_update_ss *u = &op->adam8bit_update_ss;
        return fl_adam8bit_dtype_ok(u->tp) && fl_adam8bit_dtype_ok(u->tg) && u->st && u->ss && u->step >= 1;
    }
    if (op->kind == FL_OPK_sgd_update_ss) { /* likewise: lr and first_step from the slot (sgd_update_dss) */
        const struct fl_op_sgd_update_ss *u = &op->sgd_update_ss;
        return flb_graph_adamw_types(u->tp, u->tg, u->ts);
    }
    if (op->kind == FL_OPK_adamw_update_ss) { /* the step scalars' update: its scale from ss, the rest from the slot */
        const struct fl_op_adamw_update_ss *u = &op->adamw_update_ss;
        return flb_graph_adamw_types(u->tp, u->tg, u->ts) && u->step >= 1;
    }
    if (op->kind != FL_OPK_adamw_update) return 0;
    const struct fl_op_adamw_update *u = &op->adamw_update;
    return flb_graph_adamw_types(u->tp, u->tg, u->ts) && u->step >= 1;
}

/* Kinds that run outside the graphs (see above). */
static int flb_graph_outside(const flb_graph *g, const fl_oprec *op) {
    if (flb_graph_slot_op(g, op)) return 0;
    /* tensor parallelism's: a collective between them, their seeds and scales per call (outside, as the copies) */
    if (op->kind == FL_OPK_dropout_rows || op->kind == FL_OPK_vocab_stats || op->kind == FL_OPK_vocab_xent) return 1;
    switch (op->kind) {
    case FL_OPK_to_host: case FL_OPK_to_device: case FL_OPK_sync: case FL_OPK_sumsq: case FL_OPK_check_finite:
    case FL_OPK_adamw_update: case FL_OPK_sgd_update: case FL_OPK_adam8bit_update: case FL_OPK_set_scratch:
    case FL_OPK_set_compute_dtype: case FL_OPK_convert_many: case FL_OPK_adamw_update_ss: case FL_OPK_sgd_update_ss:
    case FL_OPK_input_upload: case FL_OPK_adam8bit_update_ss:
        return 1;
    default: return 0;
    }
}

static size_t flb_graph_recbytes(fl_opk k) {
#define FLB_GSZ_(slot) sizeof(struct fl_op_##slot),
    static const size_t sz[] = {FL_OPK_LIST(FLB_GSZ_)};
#undef FLB_GSZ_
    return (unsigned)k < FL_OPK_COUNT ? sz[k] : 0;
}

/* A record's bytes compare only with its padding cleared: a compound literal (FL_RUN) leaves the padding between
 * members as the stack held it, which differs from call to call (GCC 11+ and Clang with the builtin; elsewhere a
 * replay may miss, op by op, the same bits). */
#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
#define FLB_CLEAR_PADDING(p) __builtin_clear_padding(p)
#endif
#endif
#ifndef FLB_CLEAR_PADDING
#define FLB_CLEAR_PADDING(p) ((void)(p))
#endif

/* a record's count of 4-bit parts as the graph keeps them: 1 .. FL_Q4_MAX_PARTS */
static int flb_q4_nw(int nw) { return nw < 1 ? 1 : nw > FL_Q4_MAX_PARTS ? FL_Q4_MAX_PARTS : nw; }

/* The header a record points to (an attention's descriptor, 4-bit weights), its size; NULL: none. */
static const void **flb_graph_hdr(fl_oprec *r, size_t *hb) {
    *hb = sizeof(fl_attn_desc);
    switch (r->kind) {
    case FL_OPK_attention_forward: return (const void **)&r->attention_forward.a;
    case FL_OPK_attention_backward: return (const void **)&r->attention_backward.a;
    case FL_OPK_attention_forward16: return (const void **)&r->attention_forward16.a;
    case FL_OPK_attention_backward16: return (const void **)&r->attention_backward16.a;
    case FL_OPK_attention_forward_in16: return (const void **)&r->attention_forward_in16.a;
    case FL_OPK_attention_backward_b16: return (const void **)&r->attention_backward_b16.a;
    case FL_OPK_q4_matmul_forward: *hb = sizeof(fl_q4_weight); return (const void **)&r->q4_matmul_forward.w;
    case FL_OPK_q4_matmul_backward: *hb = sizeof(fl_q4_weight); return (const void **)&r->q4_matmul_backward.w;
    case FL_OPK_q4_matmul_forward16: /* nw stacked parts (the op refuses a count outside 1 .. FL_Q4_MAX_PARTS) */
        *hb = sizeof(fl_q4_weight) * (size_t)flb_q4_nw(r->q4_matmul_forward16.nw);
        return (const void **)&r->q4_matmul_forward16.w;
    case FL_OPK_q4_matmul_backward16:
        *hb = sizeof(fl_q4_weight) * (size_t)flb_q4_nw(r->q4_matmul_backward16.nw);
        return (const void **)&r->q4_matmul_backward16.w;
    case FL_OPK_adam8bit_update_ss: *hb = sizeof(fl_adam8bit_state); return (const void **)&r->adam8bit_update_ss.st;
    default: return NULL;
    }
}

/* A record's copy into d, its padding cleared: the header it points to copied into d->aux and the pointer left
 * NULL (a kept record moves as its segment grows: flb_graph_run_kept points it at its aux). */
static void flb_graph_keep(flb_grec *d, const fl_oprec *op) {
    memset(d, 0, sizeof *d);
    d->slot = -1;
    d->rec.kind = op->kind;
    memcpy(&d->rec.gemm, &op->gemm, flb_graph_recbytes(op->kind));
    switch (op->kind) {
#define FLB_GCLR_(slot)                                                                                              \
    case FL_OPK_##slot: FLB_CLEAR_PADDING(&d->rec.slot); break;
        FL_OPK_LIST(FLB_GCLR_)
#undef FLB_GCLR_
    default: break;
    }
    size_t hb;
    const void **hp = flb_graph_hdr(&d->rec, &hb);
    if (hp && *hp) {
        memcpy(d->aux, *hp, hb);
        const int q4 = op->kind == FL_OPK_q4_matmul_forward || op->kind == FL_OPK_q4_matmul_backward ||
                       op->kind == FL_OPK_q4_matmul_forward16 || op->kind == FL_OPK_q4_matmul_backward16;
        if (op->kind == FL_OPK_adam8bit_update_ss) FLB_CLEAR_PADDING((fl_adam8bit_state *)(void *)d->aux);
        else if (!q4) FLB_CLEAR_PADDING((fl_attn_desc *)(void *)d->aux);
        else /* by the record's kind, not the header's size: nw weights */
            for (size_t k = 0; k < hb / sizeof(fl_q4_weight); k++)
                FLB_CLEAR_PADDING((fl_q4_weight *)(void *)d->aux + k);
        *hp = NULL;
        d->has_hdr = 1;
    }
}

/* Whether op is the kept record k (its arguments, the headers' contents); live: op's own copy (with this step's
 * scalars) for the replay that stops part way. */
static int flb_graph_same(const flb_grec *k, const fl_oprec *op, flb_grec *live) {
    if (op->kind != k->rec.kind) return 0;
    flb_graph_keep(live, op);
    live->slot = k->slot;
    live->share = k->share;
    flb_grec t = *live;
    if (k->slot >= 0 && op->kind == FL_OPK_adamw_update) { /* per-step scalars: from the device slot */
        t.rec.adamw_update.lr = k->rec.adamw_update.lr;
        t.rec.adamw_update.step = k->rec.adamw_update.step;
        t.rec.adamw_update.grad_scale = k->rec.adamw_update.grad_scale;
    } else if (k->slot >= 0 && op->kind == FL_OPK_adamw_update_ss) {
        t.rec.adamw_update_ss.lr = k->rec.adamw_update_ss.lr;
        t.rec.adamw_update_ss.step = k->rec.adamw_update_ss.step;
    } else if (k->slot >= 0 && op->kind == FL_OPK_adam8bit_update_ss) {
        const struct fl_op_adam8bit_update_ss *a = &op->adam8bit_update_ss;
        if (k->share) { /* its slot holds the tensor before's constants: this step's must equal them */
            const struct fl_op_adam8bit_update_ss *b = &live[-1].rec.adam8bit_update_ss;
            if (memcmp(&a->lr, &b->lr, sizeof a->lr) || a->step != b->step) return 0;
        }
        t.rec.adam8bit_update_ss.lr = k->rec.adam8bit_update_ss.lr;
        t.rec.adam8bit_update_ss.step = k->rec.adam8bit_update_ss.step;
    } else if (k->slot >= 0 && op->kind == FL_OPK_sgd_update_ss) {
        t.rec.sgd_update_ss.lr = k->rec.sgd_update_ss.lr;
        t.rec.sgd_update_ss.first_step = k->rec.sgd_update_ss.first_step;
    } else if (k->slot >= 0 && op->kind == FL_OPK_cross_entropy) {
        t.rec.cross_entropy.grad_scale = k->rec.cross_entropy.grad_scale;
    } else if (k->slot >= 0 && op->kind == FL_OPK_cross_entropy_dbf16) {
        t.rec.cross_entropy_dbf16.grad_scale = k->rec.cross_entropy_dbf16.grad_scale;
    } else if (k->slot >= 0 && op->kind == FL_OPK_lora_forward) {
        t.rec.lora_forward.seed = k->rec.lora_forward.seed;
    } else if (k->slot >= 0 && op->kind == FL_OPK_lora_backward) {
        t.rec.lora_backward.seed = k->rec.lora_backward.seed;
    } else if (k->slot >= 0 && op->kind == FL_OPK_dropout) {
        t.rec.dropout.seed = k->rec.dropout.seed;
    } else if (k->slot >= 0 && op->kind == FL_OPK_grad_norm_dev) {
        t.rec.grad_norm_dev.scale = k->rec.grad_norm_dev.scale;
    } else if (k->slot >= 0 && op->kind == FL_OPK_check_finite_dev) {
        t.rec.check_finite_dev.inv_scale = k->rec.check_finite_dev.inv_scale;
    } else if (k->slot >= 0 && op->kind == FL_OPK_input_upload) { /* the caller's host buffers: the bytes go up */
        t.rec.input_upload.src0 = k->rec.input_upload.src0;
        t.rec.input_upload.src1 = k->rec.input_upload.src1;
    }
    return !memcmp(&t, k, sizeof t);
}

static void flb_graph_free_segs(flb_graph *g) {
    for (int i = 0; i < g->nseg; i++) {
        free(g->seg[i].r);
        if (g->seg[i].exec) flb_graph_free(g->seg[i].exec);
        if (g->seg[i].ev) flb_mark_free(g->seg[i].ev);
    }
    free(g->seg);
    g->seg = NULL, g->nseg = g->capseg = 0;
}

/* Op by op from now on, saying why once. */
static void flb_graph_give_up(flb_graph *g, const char *why) {
    if (g->state == FLB_G_EAGER) return;
    g->state = FLB_G_EAGER;
    snprintf(g->verdict, sizeof g->verdict, "op by op: %s", why);
    fprintf(stderr, "fitllm: %s backend: FITLLM_CUDA_GRAPHS=1: the step runs op by op: %s\n", FLB_NAME, why);
    g->said = 1;
}

/* Run the kept records [0, n) of segment s op by op (a segment replay that stopped part way). */
static fl_status flb_graph_run_kept(const fl_backend *be, const flb_gseg *s, int n) {
    for (int i = 0; i < n; i++) {
        fl_oprec r = s->r[i].rec;
        size_t hb;
        const void **hp = flb_graph_hdr(&r, &hb);
        if (hp && s->r[i].has_hdr) *hp = s->r[i].aux;
        FL_TRY(fl_backend_run_slots(be, &r));
    }
    return FL_OK;
}

/* This step's scalars of op into its page-locked slot (once the graph that copied the last ones passed). */
static fl_status flb_graph_slot_write(flb_graph *g, flb_gseg *s, const fl_oprec *op, int slot) {
    if (s->armed && flb_mark_wait(s->ev))
        return fl_errorf(FL_ERR_IO, "%s backend: CUDA graphs: waiting for a per-step scalar's copy failed", FLB_NAME);
    s->armed = 0;
    char *pin = g->pin + (size_t)slot * FLB_GSLOT_BYTES;
    if (op->kind == FL_OPK_input_upload) { /* the inputs into this upload's own page-locked copy */
        const struct fl_op_input_upload *u = &op->input_upload;
        flb_input *in = g->in;
        if (!in->gpin[slot] && !(in->gpin[slot] = (char *)flb_host_alloc(in->stride)))
            return fl_errorf(FL_ERR_OOM, "%s backend: CUDA graphs: no page-locked memory for an input upload", FLB_NAME);
        if (!flb_input_args_ok(in, u->slot, u->n0, u->n1, u->off1))
            return fl_errorf(FL_ERR_INVALID, "%s input_upload: slot %d, %zu + %zu bytes at %zu", FLB_NAME, u->slot,
                             u->n0, u->n1, u->off1);
        if (u->n0) memcpy(in->gpin[slot], u->src0, u->n0);
        if (u->n1) memcpy(in->gpin[slot] + u->off1, u->src1, u->n1);
        return FL_OK;
    }
    if (op->kind == FL_OPK_adamw_update) {
        const struct fl_op_adamw_update *u = &op->adamw_update;
        FLB_K(adamw_consts)(pin, u->lr, u->beta1, u->beta2, u->eps, u->weight_decay, u->step, u->grad_scale);
        g->st.graph_updates++;
    } else if (op->kind == FL_OPK_sgd_update_ss) { /* likewise */
        const struct fl_op_sgd_update_ss *u = &op->sgd_update_ss;
        FLB_K(sgd_consts)(pin, u->lr, u->momentum, u->dampening, u->weight_decay, u->nesterov, u->first_step,
                          u->buf != NULL);
        g->st.graph_updates++;
    } else if (op->kind == FL_OPK_adam8bit_update_ss) { /* likewise (the step's first tensor: the others share it) */
        const struct fl_op_adam8bit_update_ss *u = &op->adam8bit_update_ss;
        FLB_K(adam8bit_consts)(pin, u->lr, u->beta1, u->beta2, u->eps, u->weight_decay, u->step);
        g->st.graph_updates++;
    } else if (op->kind == FL_OPK_adamw_update_ss) { /* grad_scale 1 here: the kernel reads ss[FL_SS_SCALE] */
        const struct fl_op_adamw_update_ss *u = &op->adamw_update_ss;
        FLB_K(adamw_consts)(pin, u->lr, u->beta1, u->beta2, u->eps, u->weight_decay, u->step, 1.0f);
        g->st.graph_updates++;
    } else if (op->kind == FL_OPK_cross_entropy || op->kind == FL_OPK_cross_entropy_dbf16) {
        const float gs = op->kind == FL_OPK_cross_entropy ? op->cross_entropy.grad_scale
                                                           : op->cross_entropy_dbf16.grad_scale;
        memcpy(pin, &gs, sizeof gs);
    } else if (op->kind == FL_OPK_grad_norm_dev || op->kind == FL_OPK_check_finite_dev) {
        const float sc = op->kind == FL_OPK_grad_norm_dev ? op->grad_norm_dev.scale : op->check_finite_dev.inv_scale;
        memcpy(pin, &sc, sizeof sc);
    } else { /* a dropout's seed (LoRA's per micro-batch, T5's) */
        const uint64_t seed = op->kind == FL_OPK_lora_forward    ? op->lora_forward.seed
                              : op->kind == FL_OPK_lora_backward ? op->lora_backward.seed
                                                                 : op->dropout.seed;
        memcpy(pin, &seed, sizeof seed);
    }
    return FL_OK;
}

/* Capture: the scalars copied to the device slot, the kernel reading them (the bits of the op's own slot). */
static fl_status flb_graph_slot_run(flb_graph *g, const fl_backend *be, flb_gseg *s, const fl_oprec *op, int slot,
                                    int share) {
    void *d = g->dslot + (size_t)slot * FLB_GSLOT_BYTES;
    if (share) { /* 8-bit AdamW's next tensor: the slot the tensor before copied up */
        const struct fl_op_adam8bit_update_ss *u = &op->adam8bit_update_ss;
        if (FLB_K(adam8bit_update_dss)(u->p, u->tp, u->g, u->tg, u->st, d, u->ss, g->stream)) {
            flb_set_error(be, FL_ERR_IO, "adam8bit_update_ss", "the graph's kernel failed to launch");
            return fl_errorf(FL_ERR_IO, "%s backend: adam8bit_update_ss (CUDA graph): launch failed", FLB_NAME);
        }
        return FL_OK;
    }
    FL_TRY(flb_graph_slot_write(g, s, op, slot));
    if (op->kind == FL_OPK_input_upload) { /* a node: this upload's page-locked copy -> the input slot */
        const struct fl_op_input_upload *u = &op->input_upload;
        char *dev = g->in->dev + (size_t)u->slot * g->in->stride;
        int rc = u->n0 ? flb_h2d(dev, g->in->gpin[slot], u->n0, g->stream) : 0;
        if (!rc && u->n1) rc = flb_h2d(dev + u->off1, g->in->gpin[slot] + u->off1, u->n1, g->stream);
        if (rc) {
            flb_set_error(be, FL_ERR_IO, "input_upload", "the graph's copy failed");
            return fl_errorf(FL_ERR_IO, "%s backend: input_upload (CUDA graph): copy failed", FLB_NAME);
        }
        return FL_OK;
    }
    int rc = flb_h2d(d, g->pin + (size_t)slot * FLB_GSLOT_BYTES, FLB_GSLOT_BYTES, g->stream);
    const uint64_t *ds = (const uint64_t *)d;
    if (!rc && op->kind == FL_OPK_lora_forward) {
        const struct fl_op_lora_forward *l = &op->lora_forward;
        return flb_lora_forward_s(be, l->y, l->ldy, l->h, l->xd, l->x, l->A, l->B, l->N, l->in, l->out, l->r,
                                  l->scaling, l->dropout, l->seed, ds);
    }
    if (!rc && op->kind == FL_OPK_lora_backward) {
        const struct fl_op_lora_backward *l = &op->lora_backward;
        return flb_lora_backward_s(be, l->dx, l->dA, l->dB, l->dy, l->ldy, l->xb, l->h, l->A, l->B, l->N, l->in,
                                   l->out, l->r, l->scaling, l->dropout, l->seed, l->work, ds);
    }
    if (!rc && op->kind == FL_OPK_dropout) {
        const struct fl_op_dropout *o = &op->dropout;
        return flb_dropout_s(be, o->y, o->x, o->n, o->p, o->seed, o->accumulate, ds);
    }
    if (!rc && op->kind == FL_OPK_grad_norm_dev) {
        const struct fl_op_grad_norm_dev *o = &op->grad_norm_dev;
        return flb_grad_norm_dev_s(be, o->g, o->tg, o->n, o->max_norm, o->scale, o->n_loss, o->ss, (const float *)d);
    }
    if (!rc && op->kind == FL_OPK_check_finite_dev) {
        const struct fl_op_check_finite_dev *o = &op->check_finite_dev;
        return flb_check_finite_dev_s(be, o->x, o->t, o->n, o->inv_scale, o->ss, (const float *)d);
    }
    if (!rc && op->kind == FL_OPK_adamw_update) {
        const struct fl_op_adamw_update *u = &op->adamw_update;
        rc = FLB_K(adamw_update_dev)(u->p, u->tp, u->g, u->tg, u->m, u->v, u->ts, u->n, d, g->stream);
    } else if (!rc && op->kind == FL_OPK_sgd_update_ss) {
        const struct fl_op_sgd_update_ss *u = &op->sgd_update_ss;
        rc = FLB_K(sgd_update_dss)(u->p, u->tp, u->g, u->tg, u->buf, u->ts, u->n, d,
                                   u->momentum != 0.0f && u->buf != NULL, u->ss, g->stream);
    } else if (!rc && op->kind == FL_OPK_adam8bit_update_ss) {
        const struct fl_op_adam8bit_update_ss *u = &op->adam8bit_update_ss;
        rc = FLB_K(adam8bit_update_dss)(u->p, u->tp, u->g, u->tg, u->st, d, u->ss, g->stream);
    } else if (!rc && op->kind == FL_OPK_adamw_update_ss) {
        const struct fl_op_adamw_update_ss *u = &op->adamw_update_ss;
        rc = FLB_K(adamw_update_dss)(u->p, u->tp, u->g, u->tg, u->m, u->v, u->ts, u->n, d, u->ss, g->stream);
    } else if (!rc && op->kind == FL_OPK_cross_entropy) {
        const struct fl_op_cross_entropy *c = &op->cross_entropy;
        rc = FLB_K(cross_entropy_dev)(c->loss, c->dlogits, NULL, c->logits, c->targets, c->N, c->V, c->V,
                                      (const float *)d, c->ignore_index, FLB_NWORK(be, "cross_entropy"), g->stream);
    } else if (!rc) {
        const struct fl_op_cross_entropy_dbf16 *c = &op->cross_entropy_dbf16;
        rc = FLB_K(cross_entropy_dev)(c->loss, NULL, c->dlogits16, c->logits, c->targets, c->N, c->V, c->ld,
                                      (const float *)d, c->ignore_index, FLB_NWORK(be, "cross_entropy_dbf16"),
                                      g->stream);
    }
    if (rc) {
        flb_set_error(be, FL_ERR_IO, fl_opk_name(op->kind), "the graph's kernel failed to launch");
        return fl_errorf(FL_ERR_IO, "%s backend: %s (CUDA graph): launch failed", FLB_NAME, fl_opk_name(op->kind));
    }
    return FL_OK;
}

/* After a launch of a segment's graph: its scalars' copies passed when their events do. */
static int flb_graph_launched(flb_graph *g, flb_gseg *s) {
    if (s->s1 <= s->s0) return 0;
    if (!s->ev && flb_mark_new(&s->ev)) return 1;
    if (flb_mark_record(s->ev, g->stream)) return 1;
    s->armed = 1;
    return 0;
}

/* Capture: close the open segment (end the capture, make its graph, launch it). A failed capture ran nothing:
 * its ops run op by op from their records, and the run stays op by op. */
static fl_status flb_graph_close(flb_graph *g, const fl_backend *be) {
    if (g->state != FLB_G_CAPTURE || !g->pos) return FL_OK;
    flb_gseg *s = &g->seg[g->nseg - 1];
    g->pos = 0;
    const char *why = NULL;
    void *old = s->exec;
    s->exec = NULL;
    if (flb_capture_end(g->stream, &s->exec, old, &why) || !s->exec) {
        *g->err = g->saved_err; /* the launches refused inside the broken capture are not the run's errors */
        flb_capture_clear();
        char line[200];
        snprintf(line, sizeof line, "the capture of segment %d failed (%s)", g->nseg, why ? why : "?");
        g->nseg--;
        flb_graph_give_up(g, line);
        fl_status st = flb_graph_run_kept(be, s, s->n);
        free(s->r);
        s->r = NULL, s->n = s->cap = 0;
        return st;
    }
    g->st.graphs++;
    g->st.nodes += (long)flb_graph_nodes(s->exec);
    g->st.launches++;
    if (flb_graph_launch(s->exec, g->stream) || flb_graph_launched(g, s)) {
        flb_graph_give_up(g, "a graph launch failed");
        return fl_errorf(FL_ERR_IO, "%s backend: launching a CUDA graph failed", FLB_NAME);
    }
    return FL_OK;
}

/* Replay: a segment begun but not finished (an op differs, or the host reads in the middle): its absorbed ops
 * op by op (as issued this step: their per-step scalars are this step's), and the rest of the step too. */
static fl_status flb_graph_miss(flb_graph *g, const fl_backend *be) {
    fl_status st = FL_OK;
    if (g->pos) {
        const flb_gseg live = {g->live, g->pos, g->live_cap, 0, 0, NULL, 0, NULL};
        st = flb_graph_run_kept(be, &live, g->pos);
    }
    g->pos = 0;
    g->bad = 1;
    return st;
}

/* Before an op outside the graphs, or a direct call that reads or synchronizes: nothing of a segment pending. */
static fl_status flb_graph_flush(flb_graph *g, const fl_backend *be) {
    if (g->state == FLB_G_CAPTURE) return flb_graph_close(g, be);
    if (g->state == FLB_G_REPLAY && !g->bad && g->pos) return flb_graph_miss(g, be);
    return FL_OK;
}

/* The step ended (its update ran). */
static void flb_graph_step_end(flb_graph *g) {
    if (g->state == FLB_G_FIRST) {
        g->state = FLB_G_CAPTURE;
    } else if (g->state == FLB_G_CAPTURE) {
        g->st.captured_steps++;
        if (!g->nseg) {
            flb_graph_give_up(g, "no op of the step can be captured");
        } else {
            g->state = FLB_G_REPLAY;
            long ops = 0;
            for (int i = 0; i < g->nseg; i++) ops += g->seg[i].n;
            snprintf(g->verdict, sizeof g->verdict, "replaying the step as %d CUDA graphs (%ld ops; %ld outside them)",
                     g->nseg, ops, g->st.outside_ops);
        }
    } else if (g->state == FLB_G_REPLAY) {
        if (!g->bad && g->cur == g->nseg) {
            g->st.replayed_steps++;
            g->bad_run = 0;
            if (!g->said) {
                fprintf(stderr, "fitllm: %s backend: FITLLM_CUDA_GRAPHS=1: %s\n", FLB_NAME, g->verdict);
                g->said = 1;
            }
        } else {
            g->st.missed_steps++;
            if (++g->bad_run >= 2) { /* the step changed for good: capture it again */
                if (++g->st.recaptures > 4) {
                    char line[240];
                    snprintf(line, sizeof line, "the step's ops keep changing (4 captures; the last replay stopped at %s)",
                             g->miss[0] ? g->miss : "a host read inside a segment");
                    flb_graph_give_up(g, line);
                } else {
                    (void)flb_stream_sync(g->stream); /* the slots change hands: the graphs that read them ran */
                    for (int i = 0; i < g->nseg; i++) {
                        free(g->seg[i].r);
                        g->seg[i].r = NULL, g->seg[i].n = g->seg[i].cap = 0, g->seg[i].armed = 0;
                    }
                    g->state = FLB_G_CAPTURE;
                    g->bad_run = 0;
                    g->nseg = 0; /* the executable graphs stay with their slots, updated by the next capture */
                }
            }
        }
    }
    g->cur = g->pos = g->bad = g->nslot = 0;
}

/* Capture: whether kept record k (8-bit AdamW's update of a tensor) can read the slot of prev, the record before it in
 * its segment (the tensor before, with the same constants: one slot and one copy per step, not one per tensor). */
static int flb_graph_a8_shares(const flb_grec *prev, const flb_grec *k) {
    if (k->rec.kind != FL_OPK_adam8bit_update_ss || prev->rec.kind != FL_OPK_adam8bit_update_ss || prev->slot < 0)
        return 0;
    const struct fl_op_adam8bit_update_ss *a = &prev->rec.adam8bit_update_ss, *b = &k->rec.adam8bit_update_ss;
    return !memcmp(&a->lr, &b->lr, 5 * sizeof a->lr) && a->step == b->step; /* lr, beta1, beta2, eps, weight_decay */
}

static fl_status flb_graph_capture_op(flb_graph *g, const fl_backend *be, const fl_oprec *op) {
    if (!g->pos) { /* a new segment */
        if (g->nseg == g->capseg) {
            int cap = g->capseg ? 2 * g->capseg : 8;
            flb_gseg *s = (flb_gseg *)realloc(g->seg, (size_t)cap * sizeof *s);
            if (!s) return fl_errorf(FL_ERR_OOM, "%s backend: CUDA graphs: out of host memory", FLB_NAME);
            memset(s + g->capseg, 0, (size_t)(cap - g->capseg) * sizeof *s);
            g->seg = s, g->capseg = cap;
        }
        g->saved_err = *g->err;
        if (flb_capture_begin(g->stream)) {
            flb_capture_clear();
            flb_graph_give_up(g, "cudaStreamBeginCapture failed");
            return fl_backend_run_slots(be, op);
        }
        g->nseg++;
        g->seg[g->nseg - 1].n = 0;
        g->seg[g->nseg - 1].s0 = g->seg[g->nseg - 1].s1 = g->nslot;
    }
    flb_gseg *s = &g->seg[g->nseg - 1];
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 64;
        flb_grec *r = (flb_grec *)realloc(s->r, (size_t)cap * sizeof *r);
        if (!r) {
            g->pos = 1;
            (void)flb_graph_close(g, be);
            flb_graph_give_up(g, "out of host memory for the records");
            return fl_backend_run_slots(be, op);
        }
        s->r = r, s->cap = cap;
    }
    flb_grec *k = &s->r[s->n++];
    flb_graph_keep(k, op);
    g->pos = 1;
    g->st.captured_ops++;
    if (flb_graph_slot_op(g, op) && s->n >= 2 && flb_graph_a8_shares(&s->r[s->n - 2], k)) {
        k->slot = s->r[s->n - 2].slot;
        k->share = 1;
    } else if (flb_graph_slot_op(g, op) && g->nslot < FLB_GSLOTS) { /* (past the slots: captured with its values) */
        k->slot = g->nslot++;
        s->s1 = k->slot + 1;
    }
    fl_status st = k->slot >= 0 ? flb_graph_slot_run(g, be, s, op, k->slot, k->share) : fl_backend_run_slots(be, op);
    if (st != FL_OK) { /* end the capture; the error is the caller's */
        const char *why = NULL;
        void *x = NULL;
        if (!flb_capture_end(g->stream, &x, s->exec, &why) && x) flb_graph_free(x);
        s->exec = NULL;
        g->pos = 0;
        g->nseg--;
        flb_graph_give_up(g, "an op failed inside the capture");
    }
    return st;
}

/* Replay: absorb op if it is the next kept record; launch the segment's graph after its last one. */
static fl_status flb_graph_replay_op(flb_graph *g, const fl_backend *be, const fl_oprec *op) {
    if (g->cur < g->nseg && g->live_cap < g->seg[g->cur].n) {
        flb_grec *l = (flb_grec *)realloc(g->live, (size_t)g->seg[g->cur].n * sizeof *l);
        if (!l) {
            flb_graph_give_up(g, "out of host memory for the records");
            FL_TRY(flb_graph_miss(g, be));
            return fl_backend_run_slots(be, op);
        }
        g->live = l, g->live_cap = g->seg[g->cur].n;
    }
    if (g->cur < g->nseg && flb_graph_same(&g->seg[g->cur].r[g->pos], op, &g->live[g->pos])) {
        const flb_grec *k = &g->seg[g->cur].r[g->pos];
        if (k->slot >= 0 && !k->share) FL_TRY(flb_graph_slot_write(g, &g->seg[g->cur], op, k->slot));
        if (++g->pos < g->seg[g->cur].n) return FL_OK;
        g->pos = 0;
        g->st.launches++;
        flb_gseg *s = &g->seg[g->cur++];
        if (flb_graph_launch(s->exec, g->stream) || flb_graph_launched(g, s)) {
            flb_graph_give_up(g, "a graph launch failed");
            return fl_errorf(FL_ERR_IO, "%s backend: launching a CUDA graph failed", FLB_NAME);
        }
        return FL_OK;
    }
    if (g->cur < g->nseg) {
        const flb_grec *k = &g->seg[g->cur].r[g->pos];
        flb_grec t;
        flb_graph_keep(&t, op);
        size_t at = 0;
        while (at < sizeof t && ((const unsigned char *)&t)[at] == ((const unsigned char *)k)[at]) at++;
        snprintf(g->miss, sizeof g->miss, "segment %d op %d: %s, then %s (byte %zu)", g->cur + 1, g->pos + 1,
                 fl_opk_name(k->rec.kind), fl_opk_name(op->kind), at);
    } else {
        snprintf(g->miss, sizeof g->miss, "%s after the step's %d segments", fl_opk_name(op->kind), g->nseg);
    }
    FL_TRY(flb_graph_miss(g, be));
    return fl_backend_run_slots(be, op);
}

static int flb_graph_is_update(fl_opk k) {
    return k == FL_OPK_adamw_update || k == FL_OPK_adam8bit_update || k == FL_OPK_sgd_update ||
           k == FL_OPK_adamw_update_ss || k == FL_OPK_sgd_update_ss || k == FL_OPK_adam8bit_update_ss;
}

/* The step's update ran: its last segment closed (capture) or checked (replay), the step ended. */
static fl_status flb_graph_update_end(flb_graph *g, const fl_backend *be, fl_status st) {
    g->upd_open = 0;
    if (st == FL_OK && g->state == FLB_G_CAPTURE) st = flb_graph_close(g, be);
    if (st == FL_OK && g->state == FLB_G_REPLAY && !g->bad && g->pos) st = flb_graph_miss(g, be);
    flb_graph_step_end(g);
    return st;
}

/* The door with FITLLM_CUDA_GRAPHS=1. */
static fl_status flb_graph_run(flb_graph *g, const fl_backend *be, const fl_oprec *op) {
    fl_status st;
    /* 8-bit AdamW updates tensor by tensor: its step ends at the first other op (the step scalars' read) */
    if (g->upd_open && op->kind != FL_OPK_adam8bit_update_ss) FL_TRY(flb_graph_update_end(g, be, FL_OK));
    if (g->state == FLB_G_FIRST || g->state == FLB_G_EAGER || g->state == FLB_G_OFF) {
        st = fl_backend_run_slots(be, op);
    } else if (flb_graph_outside(g, op)) {
        FL_TRY(flb_graph_flush(g, be));
        g->st.outside_ops += g->state == FLB_G_CAPTURE;
        st = fl_backend_run_slots(be, op);
    } else if (g->state == FLB_G_CAPTURE) {
        st = flb_graph_capture_op(g, be, op);
    } else {
        st = g->bad ? fl_backend_run_slots(be, op) : flb_graph_replay_op(g, be, op);
    }
    if (op->kind == FL_OPK_adam8bit_update_ss && st == FL_OK) g->upd_open = 1; /* more tensors may follow */
    else if (flb_graph_is_update(op->kind)) st = flb_graph_update_end(g, be, st); /* the step ends */
    return st;
}

static void flb_graph_slots_free(flb_graph *g) {
    if (g->pin) flb_host_free(g->pin);
    if (g->dslot) flb_dev_free(g->dslot);
    g->pin = g->dslot = NULL;
}

/* The slots (init; without them the ops with per-step scalars run between the graphs). */
static void flb_graph_slots_init(flb_graph *g) {
    const size_t bytes = (size_t)FLB_GSLOTS * FLB_GSLOT_BYTES;
    if (FLB_K(adamw_consts)(NULL, 0, 0, 0, 0, 0, 1, 0) > FLB_GSLOT_BYTES ||
        FLB_K(adam8bit_consts)(NULL, 0, 0, 0, 0, 0, 1) > FLB_GSLOT_BYTES ||
        FLB_K(sgd_consts)(NULL, 0, 0, 0, 0, 0, 0, 0) > FLB_GSLOT_BYTES)
        return;
    int ok = (g->pin = (char *)flb_host_alloc(bytes)) && (g->dslot = (char *)flb_dev_alloc(bytes));
    if (ok) memset(g->pin, 0, bytes);
    else flb_graph_slots_free(g);
}

static void flb_graph_free_all(flb_graph *g) {
    if (g->state == FLB_G_CAPTURE && g->pos) {
        const char *why = NULL;
        void *x = NULL;
        if (!flb_capture_end(g->stream, &x, NULL, &why) && x) flb_graph_free(x);
        g->pos = 0;
    }
    g->nseg = g->capseg; /* every slot's executable graph */
    flb_graph_free_segs(g);
    free(g->live);
    g->live = NULL, g->live_cap = 0;
    flb_graph_slots_free(g);
}
