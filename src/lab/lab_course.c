/* The course's own table beside fitllm's plan at the course's settings (issue 33 item 1): the recipes' runs on the
 * course's 80 GB GPU at max_seq_length 512, planned with fitllm (the CUDA stand-in), each row's verdict and memory
 * against the course's, and where they differ why, in bytes. The course's figures we have: its verdicts (the lab
 * sequence, BRIEF section 5) and two memory readings (issue 33: TinyLlama 32-true micro 8 at 30.41 GB, OpenLLaMA-7B
 * bf16-true global 16 micro 4 at 69.71 GB; GB = 1e9 bytes, as LitGPT prints them). The multi-GPU part (4x A100,
 * OpenLLaMA-7B under DDP / FSDP) is not here: its precision and batches are not in our notes.
 *
 * Two rows are ZeRO-3 with offload (issue 34 item 4), planned as the others (no GPU runs them here): the lab's 4-GPU
 * part, OpenLLaMA-13B under DeepSpeed ZeRO-3 with CPU offload at 4 ranks (bf16-true, micro batch 1, as the 13B row
 * before it), and the textbook chapter's GPT-2-XL on one 24 GB GPU with ZeRO-3 offload at batch 16 (16-mixed, the
 * chapter's fp16). Both offload the optimizer and the parameters to the host (`--strategy deepspeed_stage_3_offload
 * --offload_param_device cpu`); each row also plans the same run with everything on the device (the plain strategy)
 * and says what the offload moved to the host per rank. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "lab-impl.h"

typedef struct {
    const char *name, *step, *model, *precision;
    int B, global;
    fl_lab_verdict verdict;
    double gb;       /* the course's memory reading, 0 = none */
    int devices;     /* ranks (0: 1) */
    double device_gb; /* each device's memory (0: the course's 80 GB) */
    int offload;     /* 1: ZeRO-3 with the optimizer and the parameters offloaded to the host */
} course_exp;

static const course_exp k_course_runs[] = {
    {"baseline", "TinyLlama-1.1B, fp32, batch 32 (the recipe)", "tinyllama-1.1b", "32-true", 32, 32, FL_LAB_OOM, 0, 0, 0, 0},
    {"reduced-batch", "TinyLlama-1.1B, fp32, micro batch 8 x 4", "tinyllama-1.1b", "32-true", 8, 32, FL_LAB_FITS, 30.41, 0, 0, 0},
    {"larger-model-7b", "OpenLLaMA-7B, bf16-true, global 16, micro 4", "open-llama-7b", "bf16-true", 4, 16, FL_LAB_FITS,
     69.71, 0, 0, 0},
    {"even-larger-b1", "OpenLLaMA-13B, bf16-true, batch 1", "open-llama-13b", "bf16-true", 1, 1, FL_LAB_OOM, 0, 0, 0, 0},
    {"zero3-offload-13b", "OpenLLaMA-13B, 4x 80 GB, ZeRO-3 + CPU offload, batch 1 per GPU", "open-llama-13b",
     "bf16-true", 1, 4, FL_LAB_FITS, 0, 4, 80, 1},
    {"gpt2-xl-offload", "GPT-2-XL, one 24 GB GPU, ZeRO-3 offload, batch 16", "gpt2-xl", "16-mixed", 16, 16,
     FL_LAB_FITS, 0, 1, 24, 1},
};
#define N_COURSE (int)(sizeof k_course_runs / sizeof k_course_runs[0])
#define COURSE_T 512
#define COURSE_DEVICE ((size_t)80000000000ULL)

static void why_differs(fl_lab_course *c, const fl_model_config *mc) {
    char a[32], b[32], w[32];
    const double logits = (double)c->B * (COURSE_T - 1) * mc->vocab_size * 4.0;
    c->logits_bytes = logits;
    const int verdict_differs = (c->planned == FL_PLAN_FITS) != (c->course_verdict == FL_LAB_FITS);
    const int leaner = c->course_gb > 0 && c->planned == FL_PLAN_FITS && (double)c->peak < 0.95 * c->course_gb * 1e9;
    if (!verdict_differs && !leaner) return;
    snprintf(c->why, sizeof c->why, "%s: fitllm's peak %s (ACTS %s, WORKSPACE %s); PyTorch keeps the micro batch's "
             "fp32 logits, B x T x V x 4 = %d x %d x %d x 4 = %.2f GB, and their gradient (as much again), where "
             "fitllm's chunked head holds a chunk in WORKSPACE; PyTorch's whole allocation of the run, category by "
             "category: --peer pytorch",
             verdict_differs ? "fitllm fits where the course ran out of memory" : "fitllm is leaner",
             fl_fmt_bytes(c->peak, a, sizeof a), fl_fmt_bytes(c->peak_tag[FL_TAG_ACTS], b, sizeof b),
             fl_fmt_bytes(c->peak_tag[FL_TAG_WORKSPACE], w, sizeof w), c->B, COURSE_T - 1, mc->vocab_size, logits / 1e9);
}

/* One plan of the course's run e: as given, or (plain) with everything on the device (ZeRO-3 at several ranks). */
static fl_status plan_course(const course_exp *e, int plain, fl_run_config *cfg, fl_plan *p) {
    fl_cfg_defaults(cfg, FL_CMD_FINETUNE_FULL);
    snprintf(cfg->checkpoint_dir, sizeof cfg->checkpoint_dir, "%s", e->model);
    snprintf(cfg->precision, sizeof cfg->precision, "%s", e->precision);
    cfg->data.kind = FL_DATA_SYNTHETIC;
    cfg->train.micro_batch_size = e->B;
    cfg->train.global_batch_size = e->global;
    cfg->train.max_seq_length = COURSE_T; /* the recipes' max_seq_length: T = 511 */
    cfg->max_memory = e->device_gb > 0 ? (size_t)(e->device_gb * 1e9) : COURSE_DEVICE;
    if (e->devices > 1) cfg->devices = e->devices;
    if (e->offload || e->devices > 1)
        snprintf(cfg->strategy, sizeof cfg->strategy, "%s",
                 e->offload && !plain ? "deepspeed_stage_3_offload" : "deepspeed_stage_3");
    if (e->offload && !plain) snprintf(cfg->offload_param_device, sizeof cfg->offload_param_device, "cpu");
    fl_plan_opts o;
    fl_plan_opts_default(&o);
    o.generation = 0;
    o.no_suggestions = 1;
    o.cuda = 1; /* the course's GPU */
    o.comm_threads = e->devices > 1;
    return fl_plan_run(cfg, &o, p);
}

/* The offload rows' note: what the offload moved to the host per rank, and the plain run's verdict. */
static void offload_note(fl_lab_course *c, const fl_plan *plain) {
    char a[32], b[32], d[32];
    snprintf(c->note, sizeof c->note, "ZeRO-3 with the optimizer and parameters in host memory: device peak %s per "
             "rank, host tier %s per rank (PARAMS, GRADS and OPTIM shards); everything on the device instead "
             "(deepspeed_stage_3): %s, %s", fl_fmt_bytes(c->peak, a, sizeof a), fl_fmt_bytes(c->host_peak, b, sizeof b),
             fl_fmt_bytes(plain->peak_total, d, sizeof d), plain->verdict == FL_PLAN_FITS ? "fits" : "out of memory");
}

fl_status fl_lab_course_plans(fl_lab_report *rep) {
    fl_run_config *cfg = malloc(sizeof *cfg);
    fl_plan *p = malloc(sizeof *p);
    if (!cfg || !p) {
        free(cfg);
        free(p);
        return fl_errorf(FL_ERR_OOM, "out of host memory");
    }
    fl_status s = FL_OK;
    rep->n_course = 0;
    for (int i = 0; i < N_COURSE && i < FL_LAB_MAX_COURSE && s == FL_OK; i++) {
        const course_exp *e = &k_course_runs[i];
        fl_lab_course *c = &rep->course[rep->n_course++];
        memset(c, 0, sizeof *c);
        snprintf(c->name, sizeof c->name, "%s", e->name);
        snprintf(c->step, sizeof c->step, "%s", e->step);
        snprintf(c->model, sizeof c->model, "%s", e->model);
        snprintf(c->precision, sizeof c->precision, "%s", e->precision);
        c->B = e->B, c->global = e->global, c->T = COURSE_T - 1;
        c->course_verdict = e->verdict, c->course_gb = e->gb;
        c->devices = e->devices > 1 ? e->devices : 1;
        c->device_gb = e->device_gb > 0 ? e->device_gb : COURSE_DEVICE / 1e9;
        c->offload = e->offload;
        s = plan_course(e, 0, cfg, p);
        if (s != FL_OK) break;
        c->planned = p->verdict;
        c->T = p->T;
        c->peak = p->peak_total;
        c->host_peak = p->host_peak_total;
        memcpy(c->peak_tag, p->peak, sizeof c->peak_tag);
        why_differs(c, &p->model);
        if (rep->peer_pytorch) { /* PyTorch's allocation of the same run, one device (the model's scope) */
            if (e->devices > 1 || e->offload)
                snprintf(c->peer_note, sizeof c->peer_note, "not modelled: %s", e->offload ? "ZeRO-3 offload" : "several devices");
            else if (fl_lab_peer_pytorch(&p->model, p->n_params, c->B, c->T, c->precision, &c->peer) == FL_OK)
                c->peer_ok = 1;
            else snprintf(c->peer_note, sizeof c->peer_note, "%s", fl_error_message());
        }
        if (e->offload) {
            s = plan_course(e, 1, cfg, p);
            if (s != FL_OK) break;
            c->plain = p->verdict;
            c->plain_peak = p->peak_total;
            offload_note(c, p);
        }
    }
    free(cfg);
    free(p);
    return s;
}

/* --peer pytorch in the console: PyTorch's modelled allocation of each course run beside fitllm's plan, as ratios. */
static void peer_print(const fl_lab_report *rep, FILE *f) {
    fputc('\n', f);
    fl_lab_wrap(f, "", "PyTorch beside fitllm (--peer pytorch). MEASURED with torch on the CPU and reproduced byte for "
                "byte (tests/ref/pytorch_alloc.py): parameters, gradients, AdamW state, autograd's saved tensors, "
                "logits. MODELLED: which are live at once (the peak), the logits' gradients and AdamW's step temporary; not counted: the "
                "caching allocator's rounding and fragmentation, the CUDA context. GB = 1e9 bytes:", 120, 0);
    fprintf(f, "%-17s %9s %8s %8s | %9s %8s | %9s %9s\n", "run", "pytorch", "saved", "logits", "fitllm", "fl/pt",
            "course", "pt/course");
    for (int i = 0; i < rep->n_course; i++) {
        const fl_lab_course *c = &rep->course[i];
        if (!c->peer_ok) {
            fprintf(f, "%-17s %s\n", c->name, c->peer_note);
            continue;
        }
        char cg[16] = "-", r[16] = "-";
        if (c->course_gb > 0) {
            snprintf(cg, sizeof cg, "%.2f", c->course_gb);
            snprintf(r, sizeof r, "%.3f", (double)c->peer.peak / 1e9 / c->course_gb);
        }
        fprintf(f, "%-17s %9.2f %8.2f %8.2f | %9.2f %8.3f | %9s %9s%s\n", c->name, c->peer.peak / 1e9,
                c->peer.saved / 1e9, (c->peer.logits + c->peer.transient) / 1e9, (double)c->peak / 1e9,
                (double)c->peak / (double)c->peer.peak, cg, r,
                (double)c->peer.peak > c->device_gb * 1e9 ? "  (PyTorch: OOM)" : "");
    }
}

/* The console's course table (120 columns) and report.md's. */
void fl_lab_course_print(const fl_lab_report *rep, FILE *f) {
    if (!rep->n_course) return;
    fputc('\n', f);
    fl_lab_wrap(f, "", "the course's runs (its 80 GB GPU, max_seq_length 512; the offload rows: the device their step "
                "names) beside fitllm's plan of the same run:", 120, 0);
    fprintf(f, "%-17s %-16s %-10s %7s | %-7s %9s | %-7s %9s %7s\n", "run", "model", "precision", "BxAcc", "course",
            "GB", "fitllm", "GB", "diff");
    for (int i = 0; i < rep->n_course; i++) {
        const fl_lab_course *c = &rep->course[i];
        char bx[16], gb[16] = "-", d[16] = "-";
        snprintf(bx, sizeof bx, "%dx%d", c->B, c->global / c->B);
        if (c->course_gb > 0) snprintf(gb, sizeof gb, "%.2f", c->course_gb);
        if (c->course_gb > 0 && c->planned == FL_PLAN_FITS)
            snprintf(d, sizeof d, "%+.1f%%", 100.0 * ((double)c->peak / 1e9 / c->course_gb - 1));
        fprintf(f, "%-17s %-16s %-10s %7s | %-7s %9s | %-7s %9.2f %7s\n", c->name, c->model, c->precision, bx,
                fl_lab_verdict_name(c->course_verdict), gb, fl_lab_plan_name(c->planned), (double)c->peak / 1e9, d);
    }
    if (rep->peer_pytorch) peer_print(rep, f);
    char pre[64];
    for (int i = 0; i < rep->n_course; i++) {
        snprintf(pre, sizeof pre, "  %s: ", rep->course[i].name);
        if (rep->course[i].why[0]) fl_lab_wrap(f, pre, rep->course[i].why, 120, 4);
        if (rep->course[i].note[0]) fl_lab_wrap(f, pre, rep->course[i].note, 120, 4);
    }
}

void fl_lab_course_md(FILE *f, const fl_lab_report *rep) {
    if (!rep->n_course) return;
    fprintf(f, "## The course's runs beside fitllm's plan\n\nEach run at the course's settings (the recipes: "
               "max_seq_length 512, T 511; its 80 GB GPU, 80e9 bytes), planned by fitllm for a CUDA device (`fitllm "
               "plan --accelerator cuda`); the two ZeRO-3 offload rows on the devices their step names (4x 80 GB; one 24 GB), "
               "planned per rank with the optimizer and parameters in host memory. GB = 1e9 bytes, as LitGPT prints them. The course's memory readings are "
               "given where we have them; tolerance: fitllm within -15%% and +5%% of the course (leaner is expected: "
               "no fp32 logits, no caching allocator), outside it or where the verdict differs, the row says why.\n\n"
               "| run | the course's step | model | precision | micro x acc | course: verdict | course: GB | fitllm: "
               "verdict | fitllm: GB | difference | PARAMS | GRADS | OPTIM | ACTS | WORKSPACE | why |\n|");
    for (int k = 0; k < 16; k++) fprintf(f, "---|");
    fprintf(f, "\n");
    for (int i = 0; i < rep->n_course; i++) {
        const fl_lab_course *c = &rep->course[i];
        fprintf(f, "| %s | %s | %s | %s | %dx%d | %s |", c->name, c->step, c->model, c->precision, c->B,
                c->global / c->B, fl_lab_verdict_name(c->course_verdict));
        if (c->course_gb > 0) fprintf(f, " %.2f |", c->course_gb);
        else fprintf(f, " - |");
        fprintf(f, " %s | %.2f |", fl_lab_plan_name(c->planned), (double)c->peak / 1e9);
        if (c->course_gb > 0 && c->planned == FL_PLAN_FITS)
            fprintf(f, " %+.1f%% |", 100.0 * ((double)c->peak / 1e9 / c->course_gb - 1));
        else fprintf(f, " - |");
        static const fl_mem_tag tags[] = {FL_TAG_PARAMS, FL_TAG_GRADS, FL_TAG_OPTIM, FL_TAG_ACTS, FL_TAG_WORKSPACE};
        for (size_t t = 0; t < sizeof tags / sizeof tags[0]; t++) fprintf(f, " %.2f |", (double)c->peak_tag[tags[t]] / 1e9);
        fprintf(f, " %s%s%s |\n", c->why, c->why[0] && c->note[0] ? "; " : "", c->note);
    }
    fprintf(f, "\n");
    if (!rep->peer_pytorch) return;
    fprintf(f, "### PyTorch beside fitllm (`--peer pytorch`)\n\nWhat PyTorch (HF LlamaForCausalLM, sdpa, "
               "torch.optim.AdamW) would allocate for each run, from `fl_lab_peer_pytorch` (src/lab/lab_peer.c). "
               "**Measured** (tests/ref/pytorch_alloc.py with torch 2.15.0 / transformers 5.23.0 on the CPU, "
               "reproduced byte for byte at 8 small shapes, tests/fixtures/pytorch-alloc.json): parameters, gradients, "
               "AdamW state, the tensors autograd saves in the forward, the returned logits. **Modelled**: the peak "
               "(the larger of the start of backward: parameters + state + saved + logits + their fp32 and model-dtype "
               "gradients; its end: parameters + state + gradients + logits; the optimizer step: parameters + state + "
               "gradients + foreach AdamW's parameter-sized sqrt(exp_avg_sq) temporary) and the logits' gradients. **Not "
               "counted**: the CUDA caching allocator's rounding and fragmentation, the CUDA context. GB = 1e9 bytes.\n\n"
               "| run | PyTorch: peak GB | params | grads | AdamW state | saved | logits + grads | fitllm: GB | fitllm / "
               "PyTorch | course: GB | PyTorch / course |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < rep->n_course; i++) {
        const fl_lab_course *c = &rep->course[i];
        if (!c->peer_ok) {
            fprintf(f, "| %s | %s | | | | | | %.2f | | | |\n", c->name, c->peer_note, (double)c->peak / 1e9);
            continue;
        }
        const fl_lab_peer *q = &c->peer;
        fprintf(f, "| %s | %.2f%s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.3f |", c->name, q->peak / 1e9,
                (double)q->peak > c->device_gb * 1e9 ? " (OOM)" : "", q->params / 1e9, q->grads / 1e9, q->optim / 1e9,
                q->saved / 1e9, (q->logits + q->transient) / 1e9, (double)c->peak / 1e9, (double)c->peak / (double)q->peak);
        if (c->course_gb > 0) fprintf(f, " %.2f | %.3f |\n", c->course_gb, q->peak / 1e9 / c->course_gb);
        else fprintf(f, " - | - |\n");
    }
    fprintf(f, "\n");
}
