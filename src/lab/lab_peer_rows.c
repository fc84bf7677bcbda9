/* `fitllm lab --peer pytorch` for the lab's own rows (issue 33): beside each row's plan at the real scale (the real
 * model, the plan's T, the row's micro batch, per rank), what PyTorch would need, from fl_lab_peer_pytorch_setup
 * (src/lab/lab_peer.c), and which part of that figure is measured (tests/ref/pytorch_alloc.py) and which modelled. */
#include <math.h>
#include <string.h>

#include "lab-impl.h"

/* The row's technique as PyTorch would run it: the lab's LoRA (r 16 on query and value), QLoRA (NF4, fp32
 * compute), the optimizer, DeepSpeed ZeRO-2 offload, DDP or FSDP over the row's ranks. */
static void row_setup(const lab_exp *e, int ranks, int T, fl_lab_peer_setup *u) {
    memset(u, 0, sizeof *u);
    const char *t = e->technique;
    u->precision = e->precision, u->B = e->B, u->T = T, u->act_ckpt = e->act_ckpt;
    if (!strcmp(t, "lora") || !strcmp(t, "qlora")) u->lora_r = 16, u->nf4 = !strcmp(t, "qlora");
    u->optim = e->optim == FL_OPT_ADAMW ? "adamw" : e->optim == FL_OPT_SGD ? "sgd" : e->optim == FL_OPT_ADAMW8BIT ?
               "adamw8bit" : fl_optim_name(e->optim);
    u->offload = !strcmp(t, "cpu_offload");
    if (ranks > 1) u->ranks = ranks, u->strategy = t;
}

/* What of the figure is measured, what modelled: a line for the report. */
static void basis(const fl_lab_peer_setup *u, const fl_lab_peer *q, char *b, size_t n) {
    char host[32] = "";
    if (u->offload) snprintf(host, sizeof host, " (host: %.2f GB)", q->host / 1e9);
    snprintf(b, n, "measured: %s, %s%s%s; modelled: the peak%s%s%s%s%s%s", u->precision, u->optim,
             u->act_ckpt ? ", checkpointing" : "", u->nf4 ? ", QLoRA NF4 r16" : u->lora_r ? ", LoRA r16" : "",
             u->act_ckpt ? ", one layer's recompute" : "", u->nf4 ? ", the dequantized weight" : "",
             u->lora_r ? ", CUDA's dropout mask" : "", u->offload ? ", ZeRO-2 offload" : "", host,
             u->ranks > 1 ? (!strcmp(u->strategy, "ddp") ? ", DDP's gradient buckets" :
                             ", FSDP's shards and 2 gathered blocks") : "");
}

/* The row's figure (s: the model's status) or what is not modelled, as its note. */
static void peer_done(fl_status s, const fl_lab_peer_setup *u, fl_lab_row *r) {
    if (s != FL_OK) {
        const char *m = fl_error_message(), *k = strstr(m, "--peer pytorch: ");
        snprintf(r->peer_note, sizeof r->peer_note, "%s", k ? k + strlen("--peer pytorch: ") : m);
        return;
    }
    r->peer_ok = 1;
    basis(u, &r->peer, r->peer_note, sizeof r->peer_note);
}

void fl_lab_row_peer(const lab_exp *e, int ranks, const fl_plan *p, fl_lab_row *r) {
    fl_lab_peer_setup u;
    row_setup(e, ranks, p->T, &u);
    r->peer_T = p->T;
    peer_done(fl_lab_peer_pytorch_setup(&p->model, fl_sizing_param_count(&p->model), &u, &r->peer), &u, r);
}

/* A BLIP-2 row (lab_blip2.c) at the real shapes, captions of T tokens, per rank. */
void fl_lab_b2_row_peer(const lab_exp *e, int ranks, const fl_blip2_config *real, int T, fl_lab_row *r) {
    fl_lab_peer_setup u;
    row_setup(e, ranks, T, &u);
    r->peer_T = T;
    peer_done(fl_lab_peer_pytorch_blip2(real, &u, &r->peer), &u, r);
}

int fl_lab_b2_peer_of(const lab_exp *e, int ranks, const fl_blip2_config *real, int T, fl_lab_peer *q) {
    fl_lab_peer_setup u;
    row_setup(e, ranks, T, &u);
    return fl_lab_peer_pytorch_blip2(real, &u, q) == FL_OK;
}

/* The category that explains most of a difference total = fitllm - PyTorch: the largest of the differences d[5] with
 * total's sign (fitllm needs more because of what it holds more of); none with that sign: the largest in size. */
int fl_lab_peer_why_category(const double d[5], double total) {
    int big = -1;
    for (int i = 0; i < 5; i++)
        if ((total >= 0 ? d[i] > 0 : d[i] < 0) && (big < 0 || fabs(d[i]) > fabs(d[big]))) big = i;
    if (big < 0)
        for (int i = 0; i < 5; i++)
            if (big < 0 || fabs(d[i]) > fabs(d[big])) big = i;
    return big;
}

/* Why fitllm's plan of the row differs from PyTorch's figure, in numbers: the verdicts (the course's, fitllm's,
 * PyTorch's) and each category at its own peak, fitllm's tags against PyTorch's measured / modelled parts. "" when
 * fitllm has no plan of the row at the real scale. */
void fl_lab_peer_why(const fl_lab_report *rep, const fl_lab_row *r, char *b, size_t n) {
    b[0] = 0;
    if (!r->peer_ok || (r->ref_planned != FL_PLAN_FITS && r->ref_planned != FL_PLAN_OOM) || !r->ref_peak) return;
    const fl_lab_peer *q = &r->peer;
    const size_t *t = r->ref_tag;
    const double G = 1e9;
    const int pt_fits = q->peak <= rep->ref_device, fl_fits = r->ref_planned == FL_PLAN_FITS, at = q->peak_at;
    char v[160] = "", nf4[64] = "", freed[96] = "";
    if (fl_fits != pt_fits || (r->expected == FL_LAB_FITS) != fl_fits)
        snprintf(v, sizeof v, "verdicts: the course %s, fitllm %s, PyTorch %s (before its CUDA context and caching "
                 "allocator); ", fl_lab_verdict_name(r->expected), fl_fits ? "fits" : "OOM", pt_fits ? "fits" : "OOM");
    if (q->quant) snprintf(nf4, sizeof nf4, " (PyTorch: %.3f of it NF4 absmax and codes)", q->quant / G);
    /* PyTorch's parts live at its peak (lab_peer.c model_peak): the rest is the logits, their gradients, the step's
     * temporary, the head's gradients under a recompute, DDP / FSDP buffers */
    const double pw = (double)(q->params + q->quant), po = (double)q->dev_optim;
    const double pg = at == FL_PEER_AT_BWD_END || at == FL_PEER_AT_STEP ? (double)q->dev_grads : 0;
    const double pa = at == FL_PEER_AT_BWD_START ? (double)q->saved :
                      at == FL_PEER_AT_RECOMPUTE ? (double)(q->saved + q->recompute) : 0;
    const double pr = (double)q->peak - pw - po - pg - pa;
    const double fw = (double)t[FL_TAG_PARAMS], fg = (double)t[FL_TAG_GRADS], fo = (double)t[FL_TAG_OPTIM],
                 fa = (double)t[FL_TAG_ACTS], fr = (double)(t[FL_TAG_WORKSPACE] + t[FL_TAG_OTHER] + t[FL_TAG_GATHER]);
    const double d[5] = {fw - pw, fg - pg, fo - po, fa - pa, fr - pr};
    static const char *const cat[5] = {"weights", "gradients", "optimizer state", "activations", "the rest"};
    static const char *const when[4] = {"the start of its backward", "the end of its backward", "its optimizer step",
                                        "a checkpointed block's recompute"};
    const double total = (double)r->ref_peak - (double)q->peak;
    int big = fl_lab_peer_why_category(d, total);
    /* PyTorch's rest at its peak, item by item (what model_peak adds at that point) */
    char rest[160] = "";
    const double logits = at == FL_PEER_AT_BWD_START || at == FL_PEER_AT_BWD_END ? (double)q->logits : 0,
                 lgrad = at == FL_PEER_AT_BWD_START ? (double)q->transient : 0,
                 stept = at == FL_PEER_AT_STEP ? (double)q->step_temp : 0, comm = (double)q->comm;
    const double head = pr - logits - lgrad - stept - comm; /* under a recompute: the head's gradients */
    size_t k = 0;
    const double item[5] = {logits, lgrad, stept, comm, head > 0.5e7 ? head : 0};
    const char *const iname[5] = {"logits", q->quant ? "their gradients and a dequantized weight" : "their gradients",
                                  "AdamW's foreach step temporary", "DDP / FSDP buffers", "the head's gradients"};
    for (int i = 0; i < 5 && k < sizeof rest; i++)
        if (item[i] > 0)
            k += (size_t)snprintf(rest + k, sizeof rest - k, "%s%s %.2f", k ? ", " : "", iname[i], item[i] / G);
    if (!k) snprintf(rest, sizeof rest, "nothing");
    if (pa == 0 && q->saved)
        snprintf(freed, sizeof freed, ", its saved tensors (%.2f) freed by then", q->saved / G);
    else if (pg == 0 && q->dev_grads)
        snprintf(freed, sizeof freed, ", its gradients (%.2f) not allocated yet", q->dev_grads / G);
    snprintf(b, n, "why fitllm differs: %sfitllm - PyTorch = %+.2f GB, most of it %s (%+.2f GB); fitllm (each tag at its "
             "own peak) vs PyTorch at its peak, GB: weights %.2f vs %.2f%s, gradients %.2f vs %.2f, optimizer state "
             "%.2f vs %.2f, activations (fitllm ACTS; PyTorch's saved tensors) %.2f vs %.2f, the rest (fitllm "
             "WORKSPACE + OTHER + GATHER; PyTorch: %s) %.2f vs %.2f; PyTorch's peak is at %s%s", v,
             total / G, cat[big], d[big] / G, fw / G, pw / G, nf4, fg / G, pg / G,
             fo / G, po / G, fa / G, pa / G, rest, fr / G, pr / G, when[at], freed);
}

static int any_peer(const fl_lab_report *rep) {
    for (int i = 0; i < rep->n; i++)
        if (rep->rows[i].peer_ok || rep->rows[i].peer_note[0]) return 1;
    return 0;
}

/* The console: one line per row (120 columns), the basis wrapped under it. */
void fl_lab_peer_rows_print(const fl_lab_report *rep, FILE *f) {
    if (!rep->peer_pytorch || !any_peer(rep)) return;
    fputc('\n', f);
    char head[400], a[32];
    snprintf(head, sizeof head, "PyTorch would need (--peer pytorch), each row at the real scale (the real model, the "
             "real plan's T (BLIP-2: the caption's tokens), the row's micro batch; per rank), one %s device per rank; GB = 1e9 bytes; fitllm: its plan "
             "of the same run:", rep->ref_device == 80000000000ULL ? "80 GB" : fl_fmt_bytes(rep->ref_device, a, sizeof a));
    fl_lab_wrap(f, "", head, 120, 0);
    fprintf(f, "%-17s %-17s %5s %9s %-7s | %9s %-7s %6s\n", "experiment", "real model", "T", "PyTorch", "verdict",
            "fitllm", "verdict", "fl/pt");
    char pre[128];
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        if (!r->peer_ok && !r->peer_note[0]) continue;
        if (!r->peer_ok) {
            snprintf(pre, sizeof pre, "%-17s %-17s %5d   ", r->name, r->ref_model, r->peer_T);
            fl_lab_wrap(f, pre, r->peer_note, 120, 4);
            continue;
        }
        char fl[16] = "-", ratio[16] = "-";
        const int planned = r->ref_planned == FL_PLAN_FITS || r->ref_planned == FL_PLAN_OOM;
        if (planned) {
            snprintf(fl, sizeof fl, "%.2f", r->ref_peak / 1e9);
            snprintf(ratio, sizeof ratio, "%.3f", (double)r->ref_peak / (double)r->peer.peak);
        }
        fprintf(f, "%-17s %-17s %5d %9.2f %-7s | %9s %-7s %6s\n", r->name, r->ref_model, r->peer_T, r->peer.peak / 1e9,
                r->peer.peak > rep->ref_device ? "OOM" : "fits", fl, fl_lab_plan_name(r->ref_planned), ratio);
        fl_lab_wrap(f, "    ", r->peer_note, 120, 4);
        char why[1024];
        fl_lab_peer_why(rep, r, why, sizeof why);
        if (why[0]) fl_lab_wrap(f, "    ", why, 120, 4);
    }
}

void fl_lab_peer_rows_md(FILE *f, const fl_lab_report *rep) {
    if (!rep->peer_pytorch || !any_peer(rep)) return;
    fprintf(f, "### PyTorch would need (`--peer pytorch`)\n\nEach row at the real scale (its real model, the real "
               "plan's T (BLIP-2: the caption's tokens), the row's micro batch, per rank) as PyTorch would run it (HF "
               "LlamaForCausalLM or GPT2LMHeadModel, or Blip2ForConditionalGeneration with OPT or Flan-T5, the vision "
               "tower frozen; sdpa; the "
               "row's optimizer, autocast, HF checkpointing, PEFT LoRA, bitsandbytes NF4, DeepSpeed ZeRO-2 offload, "
               "DDP, FSDP), from `fl_lab_peer_pytorch_setup` (src/lab/lab_peer.c). Each row says which categories are "
               "**measured** (tests/ref/pytorch_alloc.py on the CPU, reproduced byte for byte) and what is "
               "**modelled**. Not counted: the CUDA caching allocator's rounding and fragmentation, the CUDA context. "
               "GB = 1e9 bytes; the verdict on one %.0f GB GPU per rank. The last column: why fitllm's plan differs, "
               "category by category, each at its own peak (fitllm's tags against PyTorch's parts).\n\n| experiment "
               "| real model | T | micro "
               "batch | PyTorch: GB | verdict | params | grads | optimizer | saved | logits + grads | fitllm: GB | "
               "verdict | fitllm / PyTorch | basis | why fitllm differs |\n|", rep->ref_device / 1e9);
    for (int k = 0; k < 16; k++) fprintf(f, "---|");
    fprintf(f, "\n");
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        if (!r->peer_ok && !r->peer_note[0]) continue;
        fprintf(f, "| %s | %s | %d | %d |", r->name, r->ref_model, r->peer_T, r->B);
        if (!r->peer_ok) {
            fprintf(f, " - | - | | | | | | %.2f | %s | | not modelled: %s | |\n", r->ref_peak / 1e9,
                    fl_lab_plan_name(r->ref_planned), r->peer_note);
            continue;
        }
        const fl_lab_peer *q = &r->peer;
        char why[1024];
        fl_lab_peer_why(rep, r, why, sizeof why);
        fprintf(f, " %.2f | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %s | %.3f | %s | %s |\n", q->peak / 1e9,
                q->peak > rep->ref_device ? "OOM" : "fits", (q->params + q->quant) / 1e9, q->grads / 1e9,
                q->optim / 1e9, q->saved / 1e9, (q->logits + q->transient) / 1e9, r->ref_peak / 1e9,
                fl_lab_plan_name(r->ref_planned), (double)r->ref_peak / (double)q->peak, r->peer_note,
                why[0] ? why + strlen("why fitllm differs: ") : "-");
    }
    fprintf(f, "\n");
}

static const char *const k_peak_at[4] = {"backward_start", "backward_end", "optimizer_step", "recompute"};

void fl_lab_peer_json(FILE *f, const fl_lab_peer *q) {
    fprintf(f, "{\"params\": %zu, \"quant\": %zu, \"grads\": %zu, \"optim\": %zu, \"saved\": %zu, \"logits\": %zu, "
               "\"transient\": %zu, \"step_temp\": %zu, \"recompute\": %zu, \"comm\": %zu, \"host\": %zu, "
               "\"peak\": %zu, \"device_grads\": %zu, \"device_optim\": %zu, \"peak_at\": \"%s\"}", q->params,
            q->quant, q->grads, q->optim, q->saved, q->logits, q->transient, q->step_temp, q->recompute, q->comm,
            q->host, q->peak, q->dev_grads, q->dev_optim, k_peak_at[q->peak_at & 3]);
}

/* The course's memory reading of a lab row's run (GB; 0: none): TinyLlama fp32 at micro batch 8 (x 4), 30.41 GB. */
static double course_gb(const lab_exp *e) {
    return e->B == 8 && !strcmp(e->ref_model, "tinyllama-1.1b") && !strcmp(e->precision, "32-true") &&
                   !e->act_ckpt && !e->technique[0] ? 30.41 : 0;
}

/* PyTorch's modelled peak of the row's run at T (0: not modelled). */
static double peer_gb(const lab_exp *e, int ranks, const fl_plan *p, int T) {
    fl_lab_peer_setup u;
    fl_lab_peer q;
    row_setup(e, ranks, T, &u);
    if (fl_lab_peer_pytorch_setup(&p->model, fl_sizing_param_count(&p->model), &u, &q) != FL_OK) return 0;
    return q.peak / 1e9;
}

void fl_lab_row_course_diff(const lab_exp *e, const fl_plan *p, fl_lab_row *r) {
    r->course_gb = course_gb(e);
    const int fits = p->verdict == FL_PLAN_FITS, course_fits = e->expected == FL_LAB_FITS;
    const int leaner = r->course_gb > 0 && fits && p->peak_total < 0.95 * r->course_gb * 1e9;
    if (fits == course_fits && !leaner) return;
    char a[32], w[32], pt[256] = "";
    const double here = peer_gb(e, r->ranks, p, p->T), at511 = peer_gb(e, r->ranks, p, 511);
    if (here > 0)
        snprintf(pt, sizeof pt, "; PyTorch's modelled peak (--peer pytorch) %.2f GB at this T, %.2f GB at T 511 (the "
                 "course's longest padded batch), before its CUDA context and caching allocator", here, at511);
    const double logits = (double)e->B * p->T * p->model.vocab_size * 4.0;
    char head[96];
    if (fits != course_fits)
        snprintf(head, sizeof head, "%s", fits ? "fitllm fits where the course ran out of memory" :
                 "fitllm runs out of memory where the course fit");
    else
        snprintf(head, sizeof head, "fitllm is leaner than the course's %.2f GB by %.1f%%", r->course_gb,
                 100.0 * (1.0 - p->peak_total / 1e9 / r->course_gb));
    snprintf(r->course_why, sizeof r->course_why, "%s: fitllm plans %.2f GB at T %d (ACTS %s, WORKSPACE %s); PyTorch "
             "keeps the micro batch's fp32 logits, B x T x V x 4 = %d x %d x %d x 4 = %.2f GB, and their gradients, "
             "where fitllm's chunked head holds a chunk%s", head, p->peak_total / 1e9, p->T,
             fl_fmt_bytes(p->peak[FL_TAG_ACTS], a, sizeof a), fl_fmt_bytes(p->peak[FL_TAG_WORKSPACE], w, sizeof w),
             e->B, p->T, p->model.vocab_size, logits / 1e9, pt);
}
