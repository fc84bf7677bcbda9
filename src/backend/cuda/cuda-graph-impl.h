/* fitllm CUDA backend: FITLLM_CUDA_GRAPHS (issue 30 item 5; EXPERIMENTAL, default 0). Included by
 * cuda-backend-impl.h (written once, compiled twice).
 *
 * A CUDA Graph replays a captured kernel sequence with the arguments it was captured with, and a capture region
 * must not read anything back to the host. So before a step can be captured and replayed, it must (1) issue the
 * same ops step after step, (2) pass no by-value argument that changes from step to step (AdamW's step and
 * learning rate, the cross-entropy's 1 / valid targets, LoRA dropout's seed) and (3) read nothing back (the
 * per-micro-batch losses, the gradient norm that clipping needs on the host, the overflow flag). The backend's
 * one door (fl_backend.run) sees every op of a step, so with FITLLM_CUDA_GRAPHS=1 it installs a run that
 * forwards each record to fl_backend_run_slots (the same bits) and checks those three conditions over two
 * consecutive steps (a step ends at its optimizer update), then says once on stderr why the step is not
 * captured, naming each blocker with its values (FLB_PREFIX(backend_graph_verdict) for tests). Capture and
 * replay themselves are not written: every step found so far has blockers (the device-resident per-step scalars
 * and the device-side loss / clipping they need are the next step; docs/ARCHITECTURE.md "MFU, the profile and
 * host round trips"). 0 (the default): the door is fl_backend_run_slots, nothing observed. */

typedef struct {
    long ops, to_host, sumsq, check_finite; /* this step's ops and host read-backs */
    int upd_kind, step;                      /* the step's optimizer update (FL_OPK_*), its step number */
    float lr, upd_scale, ce_scale;           /* its learning rate and gradient scale; the cross-entropy's */
    uint64_t seed;                           /* a LoRA dropout seed (0: none) */
} flb_graph_step;

typedef struct {
    int on;         /* FITLLM_CUDA_GRAPHS=1 */
    int said;       /* the verdict is made (and said once) */
    int have_prev;  /* prev holds a complete step */
    flb_graph_step prev, cur;
    char verdict[640];
} flb_graph;

static void flb_graph_observe(flb_graph *g, const fl_oprec *op) {
    flb_graph_step *c = &g->cur;
    c->ops++;
    switch (op->kind) {
    case FL_OPK_to_host: c->to_host++; break;
    case FL_OPK_sumsq: c->sumsq++; break;
    case FL_OPK_check_finite: c->check_finite++; break;
    case FL_OPK_cross_entropy: c->ce_scale = op->cross_entropy.grad_scale; break;
    case FL_OPK_cross_entropy_dbf16: c->ce_scale = op->cross_entropy_dbf16.grad_scale; break;
    case FL_OPK_lora_forward:
        if (op->lora_forward.dropout > 0) c->seed = op->lora_forward.seed;
        break;
    case FL_OPK_adamw_update:
        c->upd_kind = op->kind, c->step = op->adamw_update.step, c->lr = op->adamw_update.lr;
        c->upd_scale = op->adamw_update.grad_scale;
        break;
    case FL_OPK_adam8bit_update:
        c->upd_kind = op->kind, c->step = op->adam8bit_update.step, c->lr = op->adam8bit_update.lr;
        c->upd_scale = op->adam8bit_update.grad_scale;
        break;
    case FL_OPK_sgd_update:
        c->upd_kind = op->kind, c->step = op->sgd_update.first_step, c->lr = op->sgd_update.lr;
        c->upd_scale = op->sgd_update.grad_scale;
        break;
    default: break;
    }
}

/* At a step's end (its update): with the previous step, the verdict. */
static void flb_graph_step_end(flb_graph *g) {
    if (g->have_prev && !g->said) {
        const flb_graph_step *p = &g->prev, *c = &g->cur;
        char *w = g->verdict;
        size_t n = sizeof g->verdict, k = 0;
#define FLB_GW(...) (k += (size_t)snprintf(w + k, k < n ? n - k : 0, __VA_ARGS__))
        FLB_GW("capture skipped:");
        if (p->ops != c->ops) FLB_GW(" the ops differ between steps (%ld, then %ld);", p->ops, c->ops);
        if (c->to_host || c->sumsq || c->check_finite)
            FLB_GW(" the step reads values back to the host (to_host %ld, sumsq %ld, check_finite %ld);", c->to_host,
                   c->sumsq, c->check_finite);
        if (p->step != c->step || p->lr != c->lr || p->upd_scale != c->upd_scale)
            FLB_GW(" %s takes per-step arguments (step %d -> %d, lr %g -> %g, gradient scale %g -> %g);",
                   fl_opk_name((fl_opk)c->upd_kind), p->step, c->step, (double)p->lr, (double)c->lr,
                   (double)p->upd_scale, (double)c->upd_scale);
        if (p->ce_scale != c->ce_scale)
            FLB_GW(" the cross-entropy's gradient scale changes (%g -> %g);", (double)p->ce_scale, (double)c->ce_scale);
        if (p->seed != c->seed) FLB_GW(" LoRA dropout's seed changes;");
        if (k == strlen("capture skipped:"))
            FLB_GW(" the step repeats with the same arguments and no read-back, but capture and replay are not "
                   "written yet;");
#undef FLB_GW
        if (k && k <= n) w[k - 1] = 0; /* the last ';' */
        g->said = 1;
        fprintf(stderr, "fitllm: %s backend: FITLLM_CUDA_GRAPHS=1: %s (the ops run one by one, as before)\n",
                FLB_NAME, g->verdict);
    }
    g->prev = g->cur;
    g->have_prev = 1;
    memset(&g->cur, 0, sizeof g->cur);
}

/* The door with FITLLM_CUDA_GRAPHS=1 (g: the backend's): the same slots, observed. */
static fl_status flb_graph_run(flb_graph *g, const fl_backend *be, const fl_oprec *op) {
    fl_status s = fl_backend_run_slots(be, op);
    flb_graph_observe(g, op);
    if (op->kind == FL_OPK_adamw_update || op->kind == FL_OPK_adam8bit_update || op->kind == FL_OPK_sgd_update)
        flb_graph_step_end(g);
    return s;
}
