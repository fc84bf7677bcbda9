/* "The largest model that fits" a machine (issue 34 item 4; plan.h fl_plan_largest): the LLaMA presets from 1.1 B
 * to 13 B, each planned by fl_plan_run under the run's own options, first as given, then with ZeRO-3 and the
 * optimizer in host memory, then the parameters too, then both on NVMe; a model fits when one of these fits the
 * device and its host and disk tiers fit the machine. The tiers are per rank: the machine's ranks (devices) share
 * its host RAM and its disk, so a tier fits when devices x its peak does. On a CPU the "device" is the host's RAM:
 * each rank's budget is RAM / devices, and its host tier (the same RAM) counts against it too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/plan.h"

static const char *const k_ladder[] = {"tinyllama-1.1b", "open-llama-3b", "open-llama-7b", "open-llama-13b"};
#define N_LADDER (int)(sizeof k_ladder / sizeof k_ladder[0])

/* the variants, least offload first: the strategy as given, then ZeRO-3 with the optimizer, then also the parameters,
 * in host memory, then both on NVMe */
static const char *const k_variant[][3] = {
    {"", "", ""},
    {"deepspeed_stage_3_offload", "", "--strategy deepspeed_stage_3_offload"},
    {"deepspeed_stage_3_offload", "cpu", "--strategy deepspeed_stage_3_offload --offload_param_device cpu"},
    {"deepspeed_stage_3_offload_nvme", "", "--strategy deepspeed_stage_3_offload_nvme --nvme_path DIR"},
};
#define N_VARIANT (int)(sizeof k_variant / sizeof k_variant[0])

static int tiers_fit(const fl_plan *p, const fl_plan_machine *mc) {
    const double ranks = mc->devices > 1 ? mc->devices : 1;
    const double host = mc->cuda ? (double)p->host_peak_total : (double)p->host_peak_total + (double)p->peak_total;
    if (p->verdict != FL_PLAN_FITS) return 0;
    if (mc->host_memory && ranks * host > (double)mc->host_memory) return 0;
    return !mc->disk || ranks * (double)p->nvme_peak_total <= (double)mc->disk;
}

fl_status fl_plan_largest(const fl_run_config *base, const fl_plan_machine *mc, fl_plan_fit *out) {
    memset(out, 0, sizeof *out);
    out->best = -1;
    if (!mc->cuda && !mc->host_memory)
        return fl_errorf(FL_ERR_INVALID, "largest model: a CPU machine needs its host memory (--host-memory SIZE)");
    if (mc->cuda && !mc->device_memory)
        return fl_errorf(FL_ERR_INVALID, "largest model: a GPU machine needs its device memory (--device-memory SIZE)");
    fl_run_config *c = malloc(sizeof *c);
    fl_plan *p = malloc(sizeof *p);
    fl_status s = c && p ? FL_OK : fl_errorf(FL_ERR_OOM, "largest model: out of host memory");
    for (int i = 0; s == FL_OK && i < N_LADDER; i++) {
        fl_plan_fit_row *r = &out->rows[out->n++];
        snprintf(r->model, sizeof r->model, "%s", k_ladder[i]);
        for (int v = 0; s == FL_OK && v < N_VARIANT && !r->fits; v++) {
            *c = *base;
            snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "%s", k_ladder[i]);
            if (k_variant[v][0][0]) snprintf(c->strategy, sizeof c->strategy, "%s", k_variant[v][0]);
            snprintf(c->offload_param_device, sizeof c->offload_param_device, "%s", k_variant[v][1]);
            if (v) c->offload_device[0] = 0, c->nvme_path[0] = 0;
            fl_plan_opts o;
            fl_plan_opts_default(&o);
            o.devices = mc->devices;
            o.cuda = mc->cuda;
            o.seq_len = mc->seq_len;
            o.generation = 0;
            o.no_suggestions = 1;
            o.device_memory = mc->cuda ? mc->device_memory : mc->host_memory / (size_t)(mc->devices > 1 ? mc->devices : 1);
            s = fl_plan_run(c, &o, p);
            if (s != FL_OK) { /* a variant this run refuses (e.g. LoRA with offload) is no answer, not an error */
                if (v == 0) break;
                s = FL_OK;
                continue;
            }
            r->n_params = p->n_params;
            r->device_peak = p->peak_total, r->host_peak = p->host_peak_total, r->nvme_peak = p->nvme_peak_total;
            r->device_fits = p->verdict == FL_PLAN_FITS;
            if (!tiers_fit(p, mc)) continue;
            r->fits = 1;
            snprintf(r->how, sizeof r->how, "%s", v ? k_variant[v][2] : "as given");
            out->best = i;
        }
    }
    free(c);
    free(p);
    return fl_error_prefix(s, "largest model that fits");
}

void fl_plan_fit_print(const fl_plan_fit *f, const fl_plan_machine *mc, FILE *out) {
    char a[32], b[32], d[32];
    fprintf(out, "machine: %d %s%s%s, host memory %s, disk %s\n", mc->devices > 1 ? mc->devices : 1,
            mc->cuda ? "GPU(s) of " : "CPU rank(s)", mc->cuda ? fl_fmt_bytes(mc->device_memory, a, sizeof a) : "",
            mc->cuda ? "" : " (the device is the host's RAM)", mc->host_memory ? fl_fmt_bytes(mc->host_memory, b, sizeof b) : "not limited",
            mc->disk ? fl_fmt_bytes(mc->disk, d, sizeof d) : "not limited");
    for (int i = 0; i < f->n; i++) {
        const fl_plan_fit_row *r = &f->rows[i];
        if (!r->fits) { /* the last variant tried (everything on NVMe): what it needs per rank */
            fprintf(out, "  %-16s %6.2f B parameters: does not fit, not even with ZeRO-3 and everything on NVMe (per "
                    "rank: device %s%s, nvme %s)\n", r->model, r->n_params / 1e9, fl_fmt_bytes(r->device_peak, a, sizeof a),
                    r->device_fits ? "" : ", more than it has", fl_fmt_bytes(r->nvme_peak, d, sizeof d));
            continue;
        }
        fprintf(out, "  %-16s %6.2f B parameters: fits %s (per rank: device %s, host tier %s, nvme %s)\n", r->model,
                r->n_params / 1e9, r->how, fl_fmt_bytes(r->device_peak, a, sizeof a),
                fl_fmt_bytes(r->host_peak, b, sizeof b), fl_fmt_bytes(r->nvme_peak, d, sizeof d));
    }
    if (f->best < 0) fprintf(out, "largest model that fits: none of the presets (%s is the smallest)\n", f->rows[0].model);
    else
        fprintf(out, "largest model that fits: %s (%.2f B parameters), %s%s\n", f->rows[f->best].model,
                f->rows[f->best].n_params / 1e9, f->rows[f->best].how,
                f->best == f->n - 1 ? " (the largest preset tried: a larger model may fit too)" : "");
}
