/* The lab's outputs: the table, report.md, results.csv, results.json and the
 * gnuplot charts (memory by tag, step time). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "core/fs.h"
#include "fitllm/lab.h"
#include "lab-impl.h"

/* Every tag, GATHER (FSDP's gathered units: the 4x FSDP row) last. */
#define LAB_TAGS FL_TAG_COUNT

#define MIB(x) ((double)(x) / 1048576.0)

static const char *match(const fl_lab_row *r) {
    if (r->verdict == FL_LAB_NA) return "n/a";
    if (r->verdict == FL_LAB_ERROR) return "error";
    if (r->expected == FL_LAB_NA) return "-"; /* the fsdp suite: a row the course's table does not have */
    return r->verdict == r->expected ? "yes" : "NO";
}

/* Time per sample: rows differ in samples per optimizer step (micro batch x accumulation),
 * so ms per step does not compare them; ms per sample does (tokens per sample are equal). */
static double ms_per_sample(const fl_lab_row *r) {
    return r->step_ms / ((double)r->B * r->accum * (r->ranks > 1 ? r->ranks : 1));
}

/* A data-parallel row's "extra time per sample" (its ranks share this machine's cores) is a cost that may not show: a
 * row that ran no slower per sample than plain fp32 AdamW at micro batch 8 (the reduced-batch row) has nothing to
 * explain, its note is dropped (DDP was said to lose time when it was the fastest row). A technique's own work
 * (checkpointing's recompute, LoRA's adapters) is said whatever the batch size made of it. */
void fl_lab_time_notes_settle(fl_lab_report *rep) {
    const fl_lab_row *ref = NULL;
    for (int i = 0; i < rep->n; i++)
        if (!strcmp(rep->rows[i].name, "reduced-batch") && FL_LAB_TIMED(&rep->rows[i])) ref = &rep->rows[i];
    for (int i = 0; ref && i < rep->n; i++) {
        fl_lab_row *r = &rep->rows[i];
        if (r != ref && r->ranks > 1 && FL_LAB_TIMED(r) && r->time_note[0] && ms_per_sample(r) <= ms_per_sample(ref))
            r->time_note[0] = 0;
    }
}

/* A row's GPU utilization and memory, mean +- standard deviation over the NVML samples ("-" without). */
void fl_lab_gpu_cells(const fl_lab_row *r, char *u, size_t un, char *m, size_t mn) {
    if (r->gpu_samples <= 0) {
        snprintf(u, un, "-");
        snprintf(m, mn, "-");
        return;
    }
    snprintf(u, un, "%.1f +- %.1f", r->gpu_util_mean, r->gpu_util_std);
    snprintf(m, mn, "%.2f +- %.2f GiB", r->gpu_mem_mean / 1073741824.0, r->gpu_mem_std / 1073741824.0);
}

const char *fl_lab_plan_name(fl_plan_verdict v) {
    return v == FL_PLAN_FITS ? "fits" : v == FL_PLAN_OOM ? "OOM" : v == FL_PLAN_UNAVAILABLE ? "n/a" : "?";
}

/* text as lines of at most width columns (broken at spaces; a word longer than a line is split), the first
 * after prefix, the rest indented by indent spaces: notes are never cut. */
void fl_lab_wrap(FILE *f, const char *prefix, const char *text, int width, int indent) {
    int col = fprintf(f, "%s", prefix), first = 1;
    const char *p = text;
    while (*p) {
        while (*p == ' ') p++;
        if (!*p) break;
        int len = (int)strcspn(p, " ");
        int room = width - col - (first ? 0 : 1);
        if (len > room && !first) { /* next line */
            fprintf(f, "\n%*s", indent, "");
            col = indent;
            first = 1;
            room = width - col;
        }
        if (len > room) len = room > 8 ? room : len; /* a word wider than a line: split it */
        col += fprintf(f, "%s%.*s", first ? "" : " ", len, p);
        first = 0;
        p += len;
    }
    fputc('\n', f);
}

/* MiB in at most 6 characters at lab and real scale (one decimal under 1000) */
static void mib(char *b, size_t n, size_t x) {
    double v = MIB(x);
    snprintf(b, n, v < 1000 ? "%.1f" : "%.0f", v);
}

/* A row's peak: one rank's, or the min-max over its ranks ("141.9-150.2"). */
static void peak_cell(const fl_lab_row *r, char *b, size_t n) {
    char lo[16], hi[16];
    mib(lo, sizeof lo, r->peak_total);
    if (r->ranks > 1 && r->peak_max > r->peak_min) {
        mib(lo, sizeof lo, r->peak_min);
        mib(hi, sizeof hi, r->peak_max);
        if (strcmp(lo, hi)) snprintf(b, n, "%s-%s", lo, hi);
        else snprintf(b, n, "%s", lo);
    } else snprintf(b, n, "%s", lo);
}

/* The console table: 120 columns (the bytes per tag, phases and notes in full are in report.md). */
void fl_lab_print_table(const fl_lab_report *rep, FILE *f) {
    char a[32];
    /* the scale of the verdict and of every column after it (the real-scale plans: report.md) */
    fprintf(f, "\n%61s %s\n", "", rep->real_scale ? "at the real scale (the real models and budget) -----------"
                                                  : "at lab scale (the lab-* models, the scaled budget) -------");
    fprintf(f, "%-17s %-14s %-7s %-10s %-9s %-7s %-3s %13s %7s %9s %7s %6s\n", "experiment", "model", "BxAcc",
            "precision", "optim", "verdict", "lab", "peak MiB", "planned", "ms/sample", "tok/s", "loss");
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        char bx[16], pk[32], pl[16] = "-";
        if (r->ranks > 1) snprintf(bx, sizeof bx, "%dx%dx%d", r->B, r->accum, r->ranks);
        else snprintf(bx, sizeof bx, "%dx%d", r->B, r->accum);
        if (r->verdict == FL_LAB_FITS || r->verdict == FL_LAB_OOM) peak_cell(r, pk, sizeof pk);
        else snprintf(pk, sizeof pk, "-");
        if (r->planned == FL_PLAN_FITS || r->planned == FL_PLAN_OOM) mib(pl, sizeof pl, r->planned_peak);
        char ms[32]; /* blip2 suite: the BLIP-2 model by its language model (the banner names the suite) */
        snprintf(ms, sizeof ms, "%s", r->model);
        if (rep->blip2) fl_lab_blip2_short(ms);
        fprintf(f, "%-17s %-14s %-7s %-10s %-9s %-7s %-3s %13s %7s", r->name, ms, bx, r->precision, r->optimizer,
                fl_lab_verdict_name(r->verdict), match(r), pk, pl);
        if (FL_LAB_TIMED(r)) fprintf(f, " %9.2f %7.0f %6.3f\n", ms_per_sample(r), r->tok_s, r->final_loss);
        else fprintf(f, " %9s %7s %6s\n", "-", "-", "-");
    }
    char legend[700];
    snprintf(legend, sizeof legend, "MiB; fits: the all-time peak; OOM: what was live when the allocation failed; "
             "planned: the planner's peak for the whole run; budget %s per device; several ranks (BxAccxRanks): "
             "memory per rank, min-max over the ranks; ms/sample = ms per optimizer step / samples per step. Bytes "
             "per tag, phases and notes in full: report.md.%s)", fl_fmt_bytes(rep->budget, a, sizeof a),
             rep->plan_only ? " --plan-only: no row trained, every verdict and peak is the row's plan" : "");
    fl_lab_wrap(f, "(", legend, 119, 1);
    char prefix[64];
    for (int i = 0; i < rep->n; i++)
        if (FL_LAB_TIMED(&rep->rows[i]) && rep->rows[i].time_note[0]) {
            snprintf(prefix, sizeof prefix, "  %s: extra time per sample: ", rep->rows[i].name);
            fl_lab_wrap(f, prefix, rep->rows[i].time_note, 120, 4);
        }
    for (int i = 0; i < rep->n; i++)
        if (rep->rows[i].note[0]) {
            snprintf(prefix, sizeof prefix, "  %s: ", rep->rows[i].name);
            fl_lab_wrap(f, prefix, rep->rows[i].note, 120, 4);
        }
    for (int i = 0; i < rep->n; i++)
        if (rep->rows[i].course_why[0]) { /* real scale: where the plan differs from the course, why */
            snprintf(prefix, sizeof prefix, "  %s (the course's run): ", rep->rows[i].name);
            fl_lab_wrap(f, prefix, rep->rows[i].course_why, 120, 4);
        }
    char line[300];
    snprintf(line, sizeof line, "%s", rep->gpu_note[0] ? rep->gpu_note : "not sampled");
    fl_lab_wrap(f, "  GPU utilization: ", line, 120, 4);
    for (int i = 0; i < rep->n; i++)
        if (rep->rows[i].gpu_samples > 0) {
            char gu[48], gm[64];
            fl_lab_gpu_cells(&rep->rows[i], gu, sizeof gu, gm, sizeof gm);
            fprintf(f, "    %s: GPU util %s %%, device memory %s (%ld samples)\n", rep->rows[i].name, gu, gm,
                    rep->rows[i].gpu_samples);
        }
    fl_lab_peer_rows_print(rep, f);
    fl_lab_course_print(rep, f);
    if (rep->sweep) fl_lab_sweep_print(rep, f);
}

/* ---- files ------------------------------------------------------------------------------ */

static FILE *open_out(const char *dir, const char *name, char *path, size_t n) {
    snprintf(path, n, "%s/%s", dir, name);
    return fopen(path, "w");
}

static void machine(char *cpu, size_t n, long *cores, double *ram_gib, char *os, size_t on) {
    snprintf(cpu, n, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    if (f) {
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10)) {
                char *c = strchr(line, ':');
                if (c) {
                    c += 2;
                    c[strcspn(c, "\n")] = '\0';
                    snprintf(cpu, n, "%s", c);
                }
                break;
            }
        fclose(f);
    }
    *cores = sysconf(_SC_NPROCESSORS_ONLN);
    *ram_gib = 0;
    f = fopen("/proc/meminfo", "r");
    if (f) {
        long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemTotal: %ld kB", &kb) == 1) { *ram_gib = kb / 1048576.0; break; }
        fclose(f);
    }
    struct utsname u;
    if (uname(&u) == 0) snprintf(os, on, "%s %s %s", u.sysname, u.release, u.machine);
    else snprintf(os, on, "unknown");
}

static void jstr(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
        else fputc(ch, f);
    }
    fputc('"', f);
}

static void jnum(FILE *f, double x) {
    if (isfinite(x)) fprintf(f, "%.6g", x);
    else fprintf(f, "null");
}

static fl_status write_csv(const fl_lab_report *rep, const char *dir) {
    char path[4200];
    FILE *f = open_out(dir, "results.csv", path, sizeof path);
    if (!f) return fl_errorf(FL_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    /* quoted free text (lab_step, note) last, so the other columns split on commas */
    fprintf(f, "experiment,model,ref_model,micro_batch,accumulation,seq_len,precision,optimizer,act_ckpt,"
               "verdict,lab_verdict,matches_lab,peak_PARAMS,peak_GRADS,peak_OPTIM,peak_ACTS,peak_WORKSPACE,peak_OTHER,peak_GATHER,"
               "peak_total,planned_verdict,planned_peak,ref_planned_verdict,ref_planned_peak,step_ms,tok_s,final_loss,"
               "wall_s,ms_per_sample,tflops,largest_fitting,peak_min,peak_max,ranks,ran,lab_step,note,time_note\n");
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        fprintf(f, "%s,%s,%s,%d,%d,%d,%s,%s,%d,%s,%s,%s", r->name, r->model, r->ref_model, r->B,
                r->accum, r->T, r->precision, r->optimizer, r->act_ckpt, fl_lab_verdict_name(r->verdict),
                fl_lab_verdict_name(r->expected), match(r));
        for (int t = 0; t < LAB_TAGS; t++) fprintf(f, ",%zu", r->peak[t]);
        fprintf(f, ",%zu,%s,%zu,%s,%zu", r->peak_total, fl_lab_plan_name(r->planned), r->planned_peak,
                fl_lab_plan_name(r->ref_planned), r->ref_peak);
        if (FL_LAB_TIMED(r)) fprintf(f, ",%.3f,%.1f,%.5f", r->step_ms, r->tok_s, r->final_loss);
        else fprintf(f, ",,,");
        fprintf(f, ",%.2f,", r->wall_s);
        if (FL_LAB_TIMED(r)) fprintf(f, "%.4f,%.6f", ms_per_sample(r), r->tflops);
        else fputc(',', f);
        fprintf(f, ",%d,%zu,%zu,%d,%d,\"%s\",\"", r->largest, r->peak_min, r->peak_max, r->ranks > 1 ? r->ranks : 1,
                r->ran, r->lab_step);
        for (const char *p = r->note; *p; p++) fputs(*p == '"' ? "\"\"" : (char[2]){*p, 0}, f);
        fprintf(f, "\",\"%s\"\n", r->time_note);
    }
    if (fclose(f) != 0) return fl_errorf(FL_ERR_IO, "%s: write failed", path);
    /* reserved and live bytes per phase: one line per (experiment, phase, kind) */
    f = open_out(dir, "phases.csv", path, sizeof path);
    if (!f) return fl_errorf(FL_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    fprintf(f, "experiment,source,phase,kind,PARAMS,GRADS,OPTIM,ACTS,WORKSPACE,OTHER,GATHER,total\n");
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        for (int k = 0; k < r->n_phases; k++)
            for (int live = 0; live < 2; live++) {
                const fl_mem_phase *ph = &r->phases[k];
                fprintf(f, "%s,%s,%s,%s", r->name, r->phases_planned ? "planned" : "measured", ph->name,
                        live ? "live" : "reserved");
                for (int t = 0; t < LAB_TAGS; t++) fprintf(f, ",%zu", live ? ph->live[t] : ph->cur[t]);
                fprintf(f, ",%zu\n", live ? ph->live_total : ph->cur_total);
            }
    }
    if (fclose(f) != 0) return fl_errorf(FL_ERR_IO, "%s: write failed", path);
    return FL_OK;
}

static void jtags(FILE *f, const size_t *b, size_t total) {
    fputc('{', f);
    for (int t = 0; t < LAB_TAGS; t++) fprintf(f, "\"%s\": %zu, ", fl_mem_tag_name((fl_mem_tag)t), b[t]);
    fprintf(f, "\"total\": %zu}", total);
}

static fl_status write_json(const fl_lab_report *rep, const char *dir, const char *date, const char *cpu, long cores,
                            double ram, const char *os) {
    char path[4200];
    FILE *f = open_out(dir, "results.json", path, sizeof path);
    if (!f) return fl_errorf(FL_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    fprintf(f, "{\n  \"version\": %d,\n  \"suite\": ", FL_LAB_JSON_VERSION);
    jstr(f, rep->suite);
    fprintf(f, ",\n  \"date\": ");
    jstr(f, date);
    fprintf(f, ",\n  \"machine\": {\"cpu\": ");
    jstr(f, cpu);
    fprintf(f, ", \"cores\": %ld, \"ram_gib\": %.1f, \"os\": ", cores, ram);
    jstr(f, os);
    char sweep_lab[48]; /* the fsdp suite's models: the sweep's and its lab- preset */
    snprintf(sweep_lab, sizeof sweep_lab, "lab-%s", rep->sweep_model);
    fprintf(f, "},\n  \"scaling\": {\"scale\": \"%s\", \"budget\": %zu, \"ref_device\": %zu, \"ref_model\": \"%s\", "
               "\"lab_model\": \"%s\", \"param_ratio\": %.8g, \"seq_len\": %d, \"ref_seq_len\": %d, "
               "\"act_per_param_ref\": %.8g, \"act_per_param_lab\": %.8g, \"lengths\": ",
            rep->real_scale ? "real" : "lab", rep->budget, rep->ref_device,
            rep->blip2 ? "blip2-opt-2.7b" : rep->sweep ? rep->sweep_model : "tinyllama-1.1b",
            rep->blip2 ? "lab-blip2-opt-2.7b" : rep->sweep ? sweep_lab : "lab-1b", rep->param_ratio, rep->T, rep->ref_T,
            rep->act_ratio_ref, rep->act_ratio_lab);
    if (rep->lengths[0]) { /* real scale: the drawn lengths (each row's seq_len is its longest - 1) */
        jstr(f, rep->lengths);
        fprintf(f, ", \"max_seq_length\": %d},\n", rep->max_seq_length);
    } else fprintf(f, "null},\n");
    fprintf(f, "  \"gpu_sampling\": ");
    jstr(f, rep->gpu_note);
    fprintf(f, ",\n");
    fprintf(f, "  \"wall_s\": %.2f,\n  \"sweep\": %s,\n  \"experiments\": [", rep->wall_s,
            rep->sweep ? "true" : "false");
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        fprintf(f, "%s\n    {\"name\": ", i ? "," : "");
        jstr(f, r->name);
        fprintf(f, ", \"lab_step\": ");
        jstr(f, r->lab_step);
        fprintf(f, ", \"model\": \"%s\", \"ref_model\": \"%s\", \"micro_batch_size\": %d, \"accumulation\": %d, "
                   "\"ranks\": %d, \"seq_len\": %d, \"precision\": \"%s\", \"optimizer\": \"%s\", \"act_ckpt\": %s, "
                   "\"technique\": ",
                r->model, r->ref_model, r->B, r->accum, r->ranks > 1 ? r->ranks : 1, r->T, r->precision, r->optimizer, r->act_ckpt ? "true" : "false");
        jstr(f, r->technique);
        fprintf(f, ", \"verdict\": \"%s\", \"lab_verdict\": \"%s\", \"matches_lab\": \"%s\", \"peak\": {",
                fl_lab_verdict_name(r->verdict), fl_lab_verdict_name(r->expected), match(r));
        for (int t = 0; t < LAB_TAGS; t++) fprintf(f, "\"%s\": %zu, ", fl_mem_tag_name((fl_mem_tag)t), r->peak[t]);
        fprintf(f, "\"total\": %zu}, \"planned_verdict\": \"%s\", \"planned_peak\": %zu, \"ref_planned_verdict\": "
                   "\"%s\", \"ref_planned_peak\": %zu, \"steps\": %ld, \"step_ms\": ",
                r->peak_total, fl_lab_plan_name(r->planned), r->planned_peak, fl_lab_plan_name(r->ref_planned), r->ref_peak, r->steps);
        jnum(f, FL_LAB_TIMED(r) ? r->step_ms : NAN);
        fprintf(f, ", \"ms_per_sample\": ");
        jnum(f, FL_LAB_TIMED(r) ? ms_per_sample(r) : NAN);
        fprintf(f, ", \"time_note\": ");
        jstr(f, r->time_note);
        fprintf(f, ", \"tok_s\": ");
        jnum(f, FL_LAB_TIMED(r) ? r->tok_s : NAN);
        fprintf(f, ", \"tflops\": ");
        jnum(f, FL_LAB_TIMED(r) ? r->tflops : NAN);
        fprintf(f, ", \"largest_fitting\": %s, \"peak_min\": %zu, \"peak_max\": %zu, \"ran\": %s",
                r->largest ? "true" : "false", r->peak_min, r->peak_max, r->ran ? "true" : "false");
        fprintf(f, ", \"mfu\": ");
        jnum(f, r->mfu > 0 ? r->mfu : NAN);
        fprintf(f, ", \"gpu\": ");
        if (r->gpu_samples > 0)
            fprintf(f, "{\"samples\": %ld, \"util_pct_mean\": %.3f, \"util_pct_std\": %.3f, \"memory_mean\": %.0f, "
                       "\"memory_std\": %.0f}", r->gpu_samples, r->gpu_util_mean, r->gpu_util_std, r->gpu_mem_mean,
                    r->gpu_mem_std);
        else fprintf(f, "null");
        fprintf(f, ", \"prefetch\": %s, \"course\": ", r->prefetch ? "true" : "false");
        double cm, cu, ct, ci;
        if (rep->sweep && fl_lab_course_fsdp(rep, r, &cm, &cu, &ct, &ci)) {
            if (cm == 0) fprintf(f, "{\"verdict\": \"OOM\"}");
            else fprintf(f, "{\"verdict\": \"fits\", \"memory_mb\": %g, \"gpu_util_pct\": %g, \"tflops\": %g, "
                            "\"iteration_ms\": %g}", cm, cu, ct, ci);
        } else fprintf(f, "null");
        if (rep->real_scale && !rep->sweep) { /* the course's reading and why the plan differs (lab_peer_rows.c) */
            fprintf(f, ", \"course_gb\": ");
            jnum(f, r->course_gb > 0 ? r->course_gb : NAN);
            fprintf(f, ", \"course_why\": ");
            jstr(f, r->course_why);
        }
        if (r->peer_ok || r->peer_note[0]) { /* --peer pytorch at the real scale (lab_peer_rows.c) */
            fprintf(f, ", \"pytorch\": ");
            if (r->peer_ok) fl_lab_peer_json(f, &r->peer);
            else fprintf(f, "null");
            fprintf(f, ", \"pytorch_seq_len\": %d, \"pytorch_basis\": ", r->peer_T);
            jstr(f, r->peer_note);
            char why[1024];
            fl_lab_peer_why(rep, r, why, sizeof why);
            fprintf(f, ", \"pytorch_why\": ");
            jstr(f, why);
        }
        fprintf(f, ", \"final_loss\": ");
        jnum(f, r->final_loss);
        fprintf(f, ", \"wall_s\": %.2f, \"note\": ", r->wall_s);
        jstr(f, r->note);
        fprintf(f, ", \"phases_source\": \"%s\", \"phases\": [", r->n_phases ? (r->phases_planned ? "planned" : "measured") : "none");
        for (int k = 0; k < r->n_phases; k++) {
            fprintf(f, "%s{\"name\": ", k ? ", " : "");
            jstr(f, r->phases[k].name);
            fprintf(f, ", \"reserved\": ");
            jtags(f, r->phases[k].cur, r->phases[k].cur_total);
            fprintf(f, ", \"live\": ");
            jtags(f, r->phases[k].live, r->phases[k].live_total);
            fputc('}', f);
        }
        fprintf(f, "]}");
    }
    fprintf(f, "\n  ],\n  \"course_runs\": [");
    for (int i = 0; i < rep->n_course; i++) { /* the course's runs beside fitllm's plans (lab_course.c) */
        const fl_lab_course *c = &rep->course[i];
        fprintf(f, "%s\n    {\"name\": \"%s\", \"model\": \"%s\", \"precision\": \"%s\", \"micro_batch_size\": %d, "
                   "\"global_batch_size\": %d, \"seq_len\": %d, \"course_verdict\": \"%s\", \"course_gb\": ",
                i ? "," : "", c->name, c->model, c->precision, c->B, c->global, c->T,
                fl_lab_verdict_name(c->course_verdict));
        jnum(f, c->course_gb > 0 ? c->course_gb : NAN);
        fprintf(f, ", \"planned_verdict\": \"%s\", \"planned_peak\": %zu, \"pytorch_logits_bytes\": %.0f, \"why\": ",
                fl_lab_plan_name(c->planned), c->peak, c->logits_bytes);
        jstr(f, c->why);
        fprintf(f, ", \"devices\": %d, \"device_gb\": %.0f, \"offload\": %s", c->devices, c->device_gb,
                c->offload ? "true" : "false");
        if (c->offload)
            fprintf(f, ", \"host_peak\": %zu, \"device_only_verdict\": \"%s\", \"device_only_peak\": %zu",
                    c->host_peak, fl_lab_plan_name(c->plain), c->plain_peak);
        if (c->peer_ok) { /* --peer pytorch: measured categories, modelled peak (src/lab/lab_peer.c) */
            fprintf(f, ", \"pytorch\": ");
            fl_lab_peer_json(f, &c->peer);
        }
        fputc('}', f);
    }
    fprintf(f, "\n  ]\n}\n");
    if (fclose(f) != 0) return fl_errorf(FL_ERR_IO, "%s: write failed", path);
    return FL_OK;
}

static int find_gnuplot(void) {
    const char *path = getenv("PATH");
    if (!path) return 0;
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *d = strtok(buf, ":"); d; d = strtok(NULL, ":")) {
        char p[4200];
        snprintf(p, sizeof p, "%s/gnuplot", d);
        if (access(p, X_OK) == 0) return 1;
    }
    return 0;
}

/* memory.dat / phases.dat / step_time.dat + charts.gp, then gnuplot (run in dir: the script
 * names its files relative to its own folder). Returns 1 if drawn. */
static const char *k_tag_colour[LAB_TAGS] = {"#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377",
                                                   "#bbbbbb"};

static const char *short_phase(const char *name) {
    static const char *map[][2] = {{"after_load", "load"}, {"before_fwd", "pre"}, {"after_fwd", "fwd"},
                                   {"after_bwd", "bwd"}, {"after_opt_step", "opt"}, {"eval_generate", "gen"},
                                   {"after_reduce", "reduce"}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(name, map[i][0])) return map[i][1];
    return name;
}

/* What the charts are drawn from (write_chart_data), for the script (write_chart_script). */
typedef struct {
    const fl_lab_row *blk[64]; /* the experiments with phases, one phases.dat block each */
    int nblk, nfit;            /* blocks; runs that fit (step_time.dat) */
    int sweep_idx[4], sweep_fit[4], n_blocks; /* sweep.dat's block per setting (fl_lab_sweep_group), whether any fit */
} chart_data;

/* Whether a row's run marks the live bytes of its gradients, activations or scratch (fl_mem_set_live): 0 when it
 * reserves some of them in a phase and never marks any live. */
static int tracks_live(const fl_lab_row *r) {
    static const fl_mem_tag t[3] = {FL_TAG_GRADS, FL_TAG_ACTS, FL_TAG_WORKSPACE};
    int reserved = 0;
    for (int k = 0; k < r->n_phases; k++)
        for (int j = 0; j < 3; j++) {
            if (r->phases[k].live[t[j]]) return 1;
            reserved |= r->phases[k].cur[t[j]] > 0;
        }
    return !reserved;
}

/* memory.dat, phases.dat, step_time.dat and (the fsdp suite) sweep.dat: 0 with why on failure. */
static int write_chart_data(const fl_lab_report *rep, const char *dir, char *why, size_t wn, chart_data *d) {
    char path[4200];
    FILE *f = open_out(dir, "memory.dat", path, sizeof path);
    if (!f) { snprintf(why, wn, "cannot write %s", path); return 0; }
    fprintf(f, "# experiment PARAMS GRADS OPTIM ACTS WORKSPACE OTHER GATHER (MiB); OOM rows: the planned need; "
               "PyTorch's modelled peak of the same run (--peer pytorch at --scale real; NaN: none)\n");
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        const size_t *b = r->verdict == FL_LAB_FITS ? r->peak : r->planned_tag;
        int show = r->verdict == FL_LAB_FITS || (r->verdict == FL_LAB_OOM && r->planned_peak);
        fprintf(f, "\"%s%s\"", r->name, r->verdict == FL_LAB_OOM ? " (OOM)" : r->verdict == FL_LAB_NA ? " (n/a)" : "");
        for (int t = 0; t < LAB_TAGS; t++) fprintf(f, " %.3f", show ? MIB(b[t]) : 0.0);
        if (rep->real_scale && r->peer_ok) fprintf(f, " %.3f\n", MIB(r->peer.peak));
        else fprintf(f, " NaN\n");
    }
    fclose(f);
    /* one block per experiment with phases (measured when it fits, planned when OOM); a run that marks no gradient,
     * activation or scratch bytes live (BLIP-2 fine-tuning so far) shows its reserved bytes by tag instead, its title
     * says so (else its whole step would look grey) */
    f = open_out(dir, "phases.dat", path, sizeof path);
    if (!f) { snprintf(why, wn, "cannot write %s", path); return 0; }
    fprintf(f, "# per experiment (blocks; OOM rows: planned): phase, live PARAMS GRADS OPTIM ACTS WORKSPACE OTHER GATHER, "
               "reserved but not live (MiB)\n");
    for (int i = 0; i < rep->n && d->nblk < 64; i++) {
        const fl_lab_row *r = &rep->rows[i];
        if (!r->n_phases || (r->verdict != FL_LAB_FITS && r->verdict != FL_LAB_OOM)) continue;
        if (d->nblk) fprintf(f, "\n\n");
        const int live = tracks_live(r);
        for (int k = 0; k < r->n_phases; k++) {
            const fl_mem_phase *ph = &r->phases[k];
            fprintf(f, "\"%s\"", short_phase(ph->name));
            for (int t = 0; t < LAB_TAGS; t++) fprintf(f, " %.3f", MIB(live ? ph->live[t] : ph->cur[t]));
            fprintf(f, " %.3f\n", live ? MIB(ph->cur_total - ph->live_total) : 0.0);
        }
        d->blk[d->nblk++] = r;
    }
    fclose(f);
    f = open_out(dir, "step_time.dat", path, sizeof path);
    if (!f) { snprintf(why, wn, "cannot write %s", path); return 0; }
    fprintf(f, "# experiment ms_per_sample tokens_per_s (runs that fit; ms per optimizer step / (micro batch x "
               "accumulation))\n");
    for (int i = 0; i < rep->n; i++)
        if (FL_LAB_TIMED(&rep->rows[i])) {
            const fl_lab_row *r = &rep->rows[i];
            fprintf(f, "\"%s%s%s\" %.4f %.1f\n", r->name, r->time_note[0] ? ": " : "", r->time_note, ms_per_sample(r),
                    r->tok_s);
            d->nfit++;
        }
    fclose(f);
    if (rep->sweep) { /* the fsdp suite: peak per rank and tok/s against the micro batch, one block per setting */
        f = open_out(dir, "sweep.dat", path, sizeof path);
        if (!f) { snprintf(why, wn, "cannot write %s", path); return 0; }
        d->n_blocks = fl_lab_sweep_data(rep, f, d->sweep_idx, d->sweep_fit);
        fclose(f);
    }
    return 1;
}

/* A gnuplot double-quoted string: quotes and backslashes escaped. */
static void gp_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

/* text broken into lines of at most width characters at spaces, joined by the two characters \ n (a line
 * break inside a gnuplot double-quoted string): a chart's note is wrapped, never cut; quotes escaped */
static void wrap_gp(const char *text, int width, char *out, size_t n) {
    size_t o = 0;
    int col = 0;
    for (const char *p = text; *p && o + 4 < n;) {
        while (*p == ' ') p++;
        int len = (int)strcspn(p, " ");
        if (!len) break;
        if (col && col + 1 + len > width) {
            out[o++] = '\\', out[o++] = 'n';
            col = 0;
        } else if (col) out[o++] = ' ', col++;
        for (int k = 0; k < len && o + 4 < n; k++) {
            if (p[k] == '"' || p[k] == '\\') out[o++] = '\\';
            out[o++] = p[k];
        }
        col += len;
        p += len;
    }
    out[o] = '\0';
}

/* phases.png: one small chart per experiment (its name as the title), 6 to a row, on one scale with the
 * budget line, and the colours' key in the last cell: readable at a glance, where one long row of 18 groups
 * of bars had no names under them. */
static void write_phases_script(const fl_lab_report *rep, FILE *f, const chart_data *d) {
    static const char *tags[LAB_TAGS] = {"PARAMS", "GRADS", "OPTIM", "ACTS", "WORKSPACE", "OTHER", "GATHER"};
    const int cols = 6, rows = (d->nblk + 1 + cols - 1) / cols;
    double ymax = MIB(rep->budget);
    for (int b = 0; b < d->nblk; b++)
        for (int k = 0; k < d->blk[b]->n_phases; k++)
            if (MIB(d->blk[b]->phases[k].cur_total) > ymax) ymax = MIB(d->blk[b]->phases[k].cur_total);
    int untracked = 0;
    for (int b = 0; b < d->nblk; b++) untracked |= !tracks_live(d->blk[b]);
    fprintf(f, "reset\nset terminal pngcairo size %d,%d font 'sans,10'\nset output 'phases.png'\n"
               "set multiplot layout %d,%d title \"Memory at each phase of a step (MiB; colours: live bytes by tag; "
               "light grey: reserved but holding nothing still needed; red: the budget; OOM rows: planned)\\n"
               "load: after the model load; pre: set-up done, before the forward; fwd, bwd: after the forward, the "
               "backward; reduce: after the gradients' reduction (several ranks); opt: after the optimizer step%s\" "
               "noenhanced\n"
               "set style data histograms\nset style histogram rowstacked\nset style fill solid 0.85 border -1\n"
               "set boxwidth 0.8\nset yrange [0:%.3f]\nset xtics norotate scale 0 font ',8'\nset ytics font ',8'\n"
               "set grid ytics\nunset key\nset lmargin 7\nset rmargin 1\n"
               "set arrow 1 from graph 0, first %.3f to graph 1, first %.3f nohead lw 2 dt 2 lc rgb 'red' front\n",
            300 * cols, 250 * rows + 40, rows, cols,
            untracked ? "\\n[reserved]: the run marks no live bytes, its reserved bytes by tag" : "", ymax * 1.05,
            MIB(rep->budget), MIB(rep->budget));
    for (int b = 0; b < d->nblk; b++) {
        const fl_lab_row *r = d->blk[b];
        char t[96];
        snprintf(t, sizeof t, "%s%s%s", r->name, r->verdict == FL_LAB_OOM ? " (OOM, planned)" : "",
                 tracks_live(r) ? "" : " [reserved]");
        fprintf(f, "set title ");
        gp_str(f, t);
        fprintf(f, " noenhanced font ',11'\nplot");
        for (int k = 0; k < LAB_TAGS; k++)
            fprintf(f, "%s 'phases.dat' index %d using %d%s lc rgb '%s'", k ? "," : "", b, k + 2, k ? "" : ":xtic(1)",
                    k_tag_colour[k]);
        fprintf(f, ", 'phases.dat' index %d using %d lc rgb '#dddddd'\n", b, LAB_TAGS + 2);
    }
    /* the key: its own cell */
    fprintf(f, "unset title\nunset arrow 1\nunset border\nunset tics\nunset grid\nset xrange [0:1]\n"
               "set yrange [0:1]\nset key center center vertical font ',11'\nplot");
    for (int k = 0; k < LAB_TAGS; k++)
        fprintf(f, "%s NaN with boxes title '%s' lc rgb '%s'", k ? "," : "", tags[k], k_tag_colour[k]);
    fprintf(f, ", NaN with boxes title 'reserved, not live' lc rgb '#dddddd', NaN with lines lw 2 dt 2 lc rgb "
               "'red' title 'budget'\n");
    fprintf(f, "unset multiplot\n");
}

/* step_time.png: a bar per run that fits, its name on the axis and, beside the bar, why it costs more per
 * sample than the baseline (wrapped to lines of 60 characters, never cut). */
static void write_step_time_script(const fl_lab_report *rep, FILE *f) {
    double xmax = 0;
    int n = 0;
    for (int i = 0; i < rep->n; i++)
        if (FL_LAB_TIMED(&rep->rows[i])) {
            if (ms_per_sample(&rep->rows[i]) > xmax) xmax = ms_per_sample(&rep->rows[i]);
            n++;
        }
    fprintf(f, "reset\nset terminal pngcairo size 1600,%d font 'sans,10'\nset output 'step_time.png'\n"
               "set title 'Time per training sample (ms per optimizer step / samples per step; runs that fit; %s "
               "threads); beside each bar: the work that makes the row slower' noenhanced\n"
               "set grid xtics\nset xlabel 'ms per sample'\nset yrange [%d.6:-0.6]\n"
               "set xrange [0:%.4f]\nset lmargin 20\nunset key\nset style fill solid 0.85 border -1\nset ytics (",
            120 + 44 * n, rep->threads ? "fixed" : "all", n - 1, xmax > 0 ? xmax * 1.9 : 1);
    int k = 0;
    for (int i = 0; i < rep->n; i++)
        if (FL_LAB_TIMED(&rep->rows[i])) {
            fprintf(f, "%s", k ? ", " : "");
            gp_str(f, rep->rows[i].name);
            fprintf(f, " %d", k++);
        }
    fprintf(f, ") scale 0 noenhanced\n");
    k = 0;
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        if (!FL_LAB_TIMED(r)) continue;
        char w[700];
        wrap_gp(r->time_note, 60, w, sizeof w);
        if (w[0])
            fprintf(f, "set label %d \"%s\" at first %.4f, first %d left offset 1,0 font ',9' noenhanced\n", 10 + k, w,
                    ms_per_sample(r), k);
        k++;
    }
    fprintf(f, "plot 'step_time.dat' using (0.5*$2):0:(0.5*$2):(0.38) with boxxyerror lc rgb '#4477aa'\n");
}

/* charts.gp: the gnuplot script over the data files. */
static void write_chart_script(const fl_lab_report *rep, FILE *f, const chart_data *d) {
    fprintf(f, "# gnuplot script written by fitllm lab; its files are named relative to this folder:\n"
               "#   cd <this folder> && gnuplot charts.gp\n"
               "set terminal pngcairo size 1280,640 font 'sans,10'\n"
               "set output 'memory.png'\n"
               "set title 'Memory by tag per experiment (all-time peak; budget %.1f MiB; OOM rows: planned need%s)'\n"
               "set style data histograms\nset style histogram rowstacked\nset style fill solid 0.85 border -1\n"
               "set boxwidth 0.75\nset xtics rotate by -35 scale 0\nset ylabel 'MiB'\nset key outside right top\n"
               "set grid ytics\nset yrange [0:*]\n"
               "set arrow 1 from graph 0, first %.3f to graph 1, first %.3f nohead lw 2 dt 2 lc rgb 'red'\n"
               "set label 1 'budget' at graph 0.99, first %.3f right offset 0,0.8 tc rgb 'red'\n"
               "plot 'memory.dat' using 2:xtic(1) title 'PARAMS' lc rgb '%s', '' using 3 title 'GRADS' lc rgb '%s', "
               "'' using 4 title 'OPTIM' lc rgb '%s', '' using 5 title 'ACTS' lc rgb '%s', '' using 6 title "
               "'WORKSPACE' lc rgb '%s', '' using 7 title 'OTHER' lc rgb '%s', '' using 8 title 'GATHER' lc rgb '%s'%s\n",
            MIB(rep->budget), rep->real_scale && rep->peer_pytorch ? "; triangles: what PyTorch would need, --peer "
            "pytorch" : "", MIB(rep->budget), MIB(rep->budget), MIB(rep->budget), k_tag_colour[0], k_tag_colour[1],
            k_tag_colour[2], k_tag_colour[3], k_tag_colour[4], k_tag_colour[5], k_tag_colour[6],
            rep->real_scale && rep->peer_pytorch ? ", '' using 0:9 with points pt 9 ps 2 lc rgb 'black' title "
                                                   "'PyTorch'" : "");
    if (d->nblk) write_phases_script(rep, f, d);
    if (d->nfit) write_step_time_script(rep, f);
    if (d->n_blocks) fl_lab_sweep_script(rep, f, d->sweep_idx, d->sweep_fit);
}

static int write_charts(const fl_lab_report *rep, const char *dir, char *why, size_t wn) {
    char path[4200];
    if (strchr(dir, '\'') || strchr(dir, '"')) { snprintf(why, wn, "the output folder name has quotes"); return 0; }
    chart_data cd = {.sweep_idx = {-1, -1, -1, -1}};
    if (!write_chart_data(rep, dir, why, wn, &cd)) return 0;
    FILE *f = open_out(dir, "charts.gp", path, sizeof path);
    if (!f) { snprintf(why, wn, "cannot write %s", path); return 0; }
    write_chart_script(rep, f, &cd);
    fclose(f);
    if (!find_gnuplot()) {
        snprintf(why, wn, "gnuplot is not installed (apt-get install gnuplot-nox); the data and charts.gp are there");
        return 0;
    }
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "cd '%s' && gnuplot charts.gp > charts.log 2>&1", dir);
    int rc = system(cmd);
    if (rc != 0) { snprintf(why, wn, "gnuplot failed (see %s/charts.log)", dir); return 0; }
    snprintf(path, sizeof path, "%s/charts.log", dir);
    remove(path);
    return 1;
}

static const fl_lab_row *row_named(const fl_lab_report *rep, const char *name) {
    for (int i = 0; i < rep->n; i++)
        if (!strcmp(rep->rows[i].name, name)) return &rep->rows[i];
    return NULL;
}

/* report.md: how the lab is scaled to this machine (and the real scale, when asked). */
static void md_scaling(FILE *f, const fl_lab_report *rep) {
    char a[32], data_words[800];
    if (rep->data[0]) /* the rows' data as they trained on it */
        snprintf(data_words, sizeof data_words, "the course's data `%.300s`, each sample cut to max_seq_length, tokenizer "
                 "%.300s", rep->data, rep->tokenizer[0] ? rep->tokenizer : "the built-in bytes");
    else
        snprintf(data_words, sizeof data_words, "samples of T + 1 tokens of random letters (every token a target, every "
                 "sample its own), built-in byte tokenizer");
    if (rep->blip2) {
        fl_lab_blip2_md_scaling(f, rep);
        return;
    }
    if (rep->sweep) { /* the fsdp suite: the course's FSDP benchmark (its model on 4x V100 16 GB), not TinyLlama's lab */
        if (rep->real_scale) { /* (the lab scale's budget and T are not computed in such a run) */
            fprintf(f, "## Scale: real (`--scale real`)\n\nEvery row ran %s itself at T = %d with a budget of %s per "
                       "rank (the course's 16 GB V100), on the backend named in the run (`--accelerator`).\n\n",
                    rep->sweep_model, rep->T, fl_fmt_bytes(rep->budget, a, sizeof a));
            return;
        }
        fprintf(f, "## How the lab is scaled to this machine\n\n"
                   "The course's FSDP benchmark trains %s on 4x V100 16 GB (FULL_SHARD, 16-mixed, T %d). Here the model "
                   "is `lab-%s`: every width divided by 16, the depth and heads kept (about 1/256 of the parameters; "
                   "the LM head's logits chunk the real one's rows / 16), on 4 ranks.\n\n"
                   "- **Budget per rank** = 16 GiB x params(lab-%s) / params(%s) = 16 GiB x %.6f = **%s** (%zu "
                   "bytes).\n"
                   "- **Sequence length** T = **%d**: the length at which one sample's activations + workspace per "
                   "parameter of lab-%s (%.4g bytes) equal those of a %d-token sample of %s (%.4g bytes), by "
                   "`fl_sizing_acts`, the runtime's own sizing.\n"
                   "- **Real-scale plan**: each row is also planned (`fitllm plan`) for %s at T=%d with 16 GiB per rank, "
                   "so the scaled verdicts can be compared with what the real run would do with fitllm.\n\n",
                rep->sweep_model, rep->ref_T, rep->sweep_model, rep->sweep_model, rep->sweep_model, rep->param_ratio,
                fl_fmt_bytes(rep->budget, a, sizeof a), rep->budget, rep->T, rep->sweep_model, rep->act_ratio_lab,
                rep->ref_T, rep->sweep_model, rep->act_ratio_ref, rep->sweep_model, rep->ref_T);
        return;
    }
    if (rep->real_scale && rep->lengths[0])
        fprintf(f, "## Scale: real (`--scale real`)\n\n"
                   "Every row ran the lab's real model (tinyllama-1.1b, open-llama-3b, open-llama-7b; random init) at the "
                   "course's settings: Synthetic samples whose lengths are drawn from `%s` (Alpaca's measured lengths: "
                   "median %d, p95 %d, max %d tokens; `data.lengths`, deterministic per seed), cut to max_seq_length %d, "
                   "no packing, each micro batch padded to its longest sample (LitGPT's SFT collate). Every row "
                   "draws from one sample set (the most samples any row reads), so every row's T (the `seq_len` column "
                   "of results.csv) is the comparison's longest drawn sample - 1, which sizes the activations; the "
                   "plan draws the same lengths, so `planned` is the run's peak. tok/s counts the samples' own tokens "
                   "(their mean length - 1), not padding. Budget %s per device (the lab's 80 GB GPU), on the backend "
                   "named in the run (`--accelerator`). The data-parallel rows are n/a: their 4 ranks need 4 devices "
                   "(`mpirun -np 4`). The sections below describe the lab-scale defaults, which this report does not "
                   "use.\n\n",
                rep->lengths, fl_lengths_at(&rep->table, 0.5), fl_lengths_at(&rep->table, 0.95),
                rep->table.len[rep->table.n - 1], rep->max_seq_length, fl_fmt_bytes(rep->budget, a, sizeof a));
    else if (rep->real_scale)
        fprintf(f, "## Scale: real (`--scale real`)\n\n"
                   "Every row ran the lab's real model (tinyllama-1.1b, open-llama-3b, open-llama-7b; random init, "
                   "samples of T + 1 tokens of random letters) at T = %d with a budget of %s per device (the lab's 80 GB GPU), on the backend "
                   "named in the run (`--accelerator`). The data-parallel rows are n/a: their 4 ranks need 4 devices "
                   "(`mpirun -np 4`). The `planned` column is the planner's peak for the same run; the sections below "
                   "describe the lab-scale defaults, which this report does not use.\n\n",
                rep->T, fl_fmt_bytes(rep->budget, a, sizeof a));
    fprintf(f, "## How the lab is scaled to this machine\n\n"
               "The course lab fine-tunes TinyLlama-1.1B on one 80 GB GPU. Here every model is its `lab-*` preset: "
               "the real shape with every width (hidden size, MLP size, heads x head dim, vocabulary) divided by 16 and "
               "the depth and head structure kept, so it has about 1/256 of the parameters "
               "(`fitllm plan lab-1b` shows the shapes); the LM head's logits chunk is the real model's rows / 16, as "
               "the tokens, so its bytes scale by 1/256 as well.\n\n"
               "- **Budget** = 80 GB x params(lab-1b) / params(tinyllama-1.1b) = 80 GB x %.6f = **%s** "
               "(%zu bytes): the budget relates to the scaled model as the GPU to TinyLlama (weights, gradients and "
               "AdamW state are a fixed number of bytes per parameter).\n"
               "- **Sequence length** T = **%d**: narrowing a model by 16 makes one token's activations 16x larger "
               "relative to its parameters, so T is the length at which one sample's activations + workspace per "
               "parameter of lab-1b (%.4g bytes) equal those of a %d-token sample of TinyLlama (%.4g bytes; LitGPT "
               "pads Alpaca batches to the longest sample, about 1K tokens with the LLaMA tokenizer). Both come from "
               "`fl_sizing_acts`, the runtime's own sizing.\n"
               "- Micro batches, accumulation, optimizers and the order of the experiments are the lab's. Every "
               "runnable row trains for real (`fl_trainer_run`, %s, random init) "
               "with the budget as `max_memory`; an out-of-memory is the allocator refusing an allocation, a verdict "
               "not a failure.\n"
               "- **Real-scale plan**: each row is also planned (`fitllm plan`) for the real model at T=%d on an 80 GB "
               "device, so the scaled verdicts can be compared with what the real run would do with fitllm.\n\n",
            rep->param_ratio, fl_fmt_bytes(rep->budget, a, sizeof a), rep->budget, rep->T, rep->act_ratio_lab,
            rep->ref_T, rep->act_ratio_ref, data_words, rep->ref_T);
}

/* report.md: the results table, its notes, the gradient-accumulation comparison. */
static void md_results(FILE *f, const fl_lab_report *rep) {
    char a[32], b[32];
    fprintf(f, "## Results\n\n| experiment | lab's change | model | micro x acc | precision | optimizer | act ckpt | "
               "verdict (%s scale) | as in the lab | PARAMS | GRADS | OPTIM | ACTS | WORKSPACE | OTHER | GATHER | peak | "
               "planned (%s scale) | ms/sample | tok/s | final loss | GPU util %% | GPU memory | extra time per sample |\n|",
            rep->real_scale ? "real" : "lab", rep->real_scale ? "real" : "lab");
    for (int k = 0; k < 24; k++) fprintf(f, "---|");
    fprintf(f, "\n");
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        char ranks[24] = "";
        if (r->ranks > 1) snprintf(ranks, sizeof ranks, " x %d ranks", r->ranks);
        fprintf(f, "| %s | %s | %s | %dx%d%s | %s | %s | %s | **%s** | %s |", r->name, r->lab_step, r->model, r->B,
                r->accum, ranks, r->precision, r->optimizer, r->act_ckpt ? "on" : "off", fl_lab_verdict_name(r->verdict),
                match(r));
        if (r->verdict == FL_LAB_FITS || r->verdict == FL_LAB_OOM) {
            for (int t = 0; t < LAB_TAGS; t++) fprintf(f, " %.2f |", MIB(r->peak[t]));
            if (r->ranks > 1 && r->peak_max > r->peak_min)
                fprintf(f, " %.2f-%.2f |", MIB(r->peak_min), MIB(r->peak_max));
            else fprintf(f, " %.2f |", MIB(r->peak_total));
        } else {
            fprintf(f, " - | - | - | - | - | - | - | - |");
        }
        if (r->planned == FL_PLAN_FITS || r->planned == FL_PLAN_OOM)
            fprintf(f, " %.2f (%s) |", MIB(r->planned_peak), fl_lab_plan_name(r->planned));
        else fprintf(f, " %s |", fl_lab_plan_name(r->planned));
        if (FL_LAB_TIMED(r))
        {
            char gu[48], gm[64];
            fl_lab_gpu_cells(r, gu, sizeof gu, gm, sizeof gm);
            fprintf(f, " %.2f | %.0f | %.3f | %s | %s | %s |\n", ms_per_sample(r), r->tok_s, r->final_loss, gu, gm,
                    r->time_note);
        } else fprintf(f, " - | - | - | - | - | |\n");
    }
    fprintf(f, "\nMemory in MiB. For runs that fit: the all-time peak per tag and in total. For OOM rows: what was live "
               "when the allocation failed (the planned column is what the whole run would need). \"as in the lab\": "
               "whether the verdict is the lab's (%s). Several ranks: the bytes per tag are rank 0's, the peak the least-most over the ranks. ms/sample = ms per optimizer step / (micro batch x accumulation): "
               "rows with different samples per step compare per sample; \"extra time per sample\" names the work "
               "the row does beyond fp32 AdamW on %s (its technique on this CPU, a larger model).\n\n",
            rep->blip2 ? "OOM for the baseline and Flan-T5-XXL with AdamW, fits otherwise"
            : rep->sweep ? "the course's benchmark table: OOM where it has no memory figure, fits where it has one; "
                           "\"-\": a row its table does not have (32-true, batches it did not run)"
                       : "OOM for baseline and the largest model, fits otherwise",
            rep->blip2 ? "the BLIP-2 OPT-2.7B model" : "lab-1b");
    int notes = 0;
    for (int i = 0; i < rep->n; i++)
        if (rep->rows[i].note[0]) {
            if (!notes++) fprintf(f, "Notes:\n\n");
            fprintf(f, "- **%s**: %s\n", rep->rows[i].name, rep->rows[i].note);
        }
    for (int i = 0; i < rep->n; i++)
        if (rep->rows[i].course_why[0]) {
            if (!notes++) fprintf(f, "Notes:\n\n");
            fprintf(f, "- **%s** (the course's run): %s\n", rep->rows[i].name, rep->rows[i].course_why);
        }
    if (notes) fprintf(f, "\n");
    const fl_lab_row *rb = row_named(rep, "reduced-batch"), *ga = row_named(rep, "grad-accum");
    if (rb && ga && rb->verdict == FL_LAB_FITS && ga->verdict == FL_LAB_FITS)
        fprintf(f, "Gradient accumulation (micro 8 x 4) peaks at %s vs %s for micro batch 8 alone (%.3f%% more: the "
                   "step's token buffers); its optimizer step covers 4x the samples.\n\n",
                fl_fmt_bytes(ga->peak_total, a, sizeof a), fl_fmt_bytes(rb->peak_total, b, sizeof b),
                100.0 * ((double)ga->peak_total / (double)rb->peak_total - 1.0));
}

/* report.md: reserved and live memory per phase of a step. */
/* The tags whose reserved bytes differ between the phases of a step after the load (a bit per tag; 0: the same at
 * every phase): FSDP's gathered units (GATHER) are allocated around each unit's use, so its rows' reserved moves. */
static unsigned reserved_varies(const fl_lab_row *r) {
    unsigned v = 0;
    const fl_mem_phase *first = NULL;
    for (int j = 0; j < r->n_phases; j++) {
        const fl_mem_phase *ph = &r->phases[j];
        if (!strcmp(ph->name, "after_load")) continue;
        if (!first) first = ph;
        for (int t = 0; t < LAB_TAGS; t++)
            if (ph->cur[t] != first->cur[t]) v |= 1u << t;
    }
    return v;
}

/* report.md's sentence on the reserved bytes: the same at every phase only where they are (computed per row) */
static void md_reserved_sentence(FILE *f, const fl_lab_report *rep) {
    unsigned tags = 0;
    int n = 0;
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        if (!r->n_phases || (r->verdict != FL_LAB_FITS && r->verdict != FL_LAB_OOM)) continue;
        unsigned v = reserved_varies(r);
        if (v && n++ < 8) fprintf(f, "%s%s", n == 1 ? "The reserved bytes change between the phases of " : ", ", r->name);
        tags |= v;
    }
    if (!n) {
        fprintf(f, "Everything a step needs is allocated (**reserved**) before the first step, so the reserved bytes "
                   "are the same at every phase (after the load) of every row below. ");
        return;
    }
    if (n > 8) fprintf(f, " and %d more rows", n - 8);
    fprintf(f, " (the tags:");
    for (int t = 0; t < LAB_TAGS; t++)
        if (tags & (1u << t)) fprintf(f, " %s", fl_mem_tag_name((fl_mem_tag)t));
    fprintf(f, "%s); every other row allocates (**reserves**) what a step needs before the first step, so its "
               "reserved bytes are the same at every phase after the load. ",
            tags & (1u << FL_TAG_GATHER) ? ": FSDP's gathered units, allocated around each unit's forward and backward" : "");
}

static void md_phases(FILE *f, const fl_lab_report *rep, int charts) {
    /* reserved vs live per phase */
    fprintf(f, "## Reserved and live memory per phase of a step\n\n");
    md_reserved_sentence(f, rep);
    fprintf(f, "**Live** bytes hold data a later phase still reads: "
               "activations saved for the backward are live after the forward and gone after the backward; "
               "gradients are live from the backward (the lm_head's from inside the forward, where its "
               "backward runs) until the optimizer step consumes them; weights, optimizer state and the token "
               "buffers are always live. MiB, reserved / live in total, then live ACTS and GRADS; rows that do "
               "not fit show the plan.\n\n| experiment | source |");
    static const char *phn[] = {"after_load", "before_fwd", "after_fwd", "after_bwd", "after_opt_step"};
    for (int k = 0; k < 5; k++) fprintf(f, " %s reserved / live | live ACTS, GRADS |", phn[k]);
    fprintf(f, "\n|---|---|");
    for (int k = 0; k < 10; k++) fprintf(f, "---|");
    fprintf(f, "\n");
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        if (!r->n_phases || (r->verdict != FL_LAB_FITS && r->verdict != FL_LAB_OOM)) continue;
        fprintf(f, "| %s | %s |", r->name, r->phases_planned ? "planned" : "measured");
        for (int k = 0; k < 5; k++) {
            const fl_mem_phase *ph = NULL;
            for (int j = 0; j < r->n_phases; j++)
                if (!strcmp(r->phases[j].name, phn[k])) ph = &r->phases[j];
            if (ph)
                fprintf(f, " %.2f / %.2f | %.2f, %.2f |", MIB(ph->cur_total), MIB(ph->live_total), MIB(ph->live[FL_TAG_ACTS]),
                        MIB(ph->live[FL_TAG_GRADS]));
            else fprintf(f, " - | - |");
        }
        fprintf(f, "\n");
    }
    fprintf(f, "\nAll tags, reserved and live, per phase: `phases.csv`%s.\n\n", charts ? "; chart `phases.png`" : "");
}

static fl_status write_md(const fl_lab_report *rep, const char *dir, const char *date, const char *cpu, long cores,
                          double ram, const char *os, int charts, const char *why) {
    char path[4200], a[32];
    FILE *f = open_out(dir, "report.md", path, sizeof path);
    if (!f) return fl_errorf(FL_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    fprintf(f, "# fitllm lab report (suite %s)\n\n", rep->suite);
    fprintf(f, "- date: %s\n- machine: %s, %ld cores, %.1f GiB RAM, %s\n- threads: %s\n- wall time: %.1f s\n\n", date,
            cpu, cores, ram, os, rep->threads ? "fixed" : "all cores", rep->wall_s);
    fprintf(f, "- GPU utilization and memory (mean +- standard deviation): %s\n\n",
            rep->gpu_note[0] ? rep->gpu_note : "not sampled");
    if (rep->data[0])
        fprintf(f, "- data: the rows fine-tune on `%s` (the course's own records; tokenizer: %s), each sample cut to "
                   "max_seq_length %d, each micro batch padded to its longest; the plans size T for that cut (an upper "
                   "bound: shorter batches need less); tok/s counts the samples' own tokens\n\n", rep->data,
                rep->tokenizer[0] ? rep->tokenizer : "the built-in bytes", rep->real_scale ? 512 : rep->T + 1);
    md_scaling(f, rep);
    md_results(f, rep);
    fl_lab_peer_rows_md(f, rep);
    fl_lab_course_md(f, rep);
    if (rep->sweep) fl_lab_sweep_md(f, rep, charts);
    md_phases(f, rep, charts);
    if (rep->lengths[0])
        fprintf(f, "## Real scale (planned with fitllm's sizing, 80 GB device, lengths drawn from `%s`: one T for every row, in "
                   "results.csv)\n\n| experiment | model | real-scale plan | real-scale planned peak |\n|---|---|---|---|\n",
                rep->lengths);
    else
        fprintf(f, "## Real scale (planned with fitllm's sizing, %s, T=%d)\n\n| experiment | model | real-scale "
                   "plan | real-scale planned peak |\n|---|---|---|---|\n", rep->sweep ? "16 GiB per rank" : "80 GB device",
                rep->ref_T);
    for (int i = 0; i < rep->n; i++) {
        const fl_lab_row *r = &rep->rows[i];
        fprintf(f, "| %s | %s | %s | %s |\n", r->name, r->ref_model, fl_lab_plan_name(r->ref_planned),
                r->ref_peak ? fl_fmt_bytes(r->ref_peak, a, sizeof a) : "-");
    }
    fprintf(f, "\n## Charts\n\n");
    if (charts)
        fprintf(f, "![memory by tag](memory.png)\n\n![live and reserved per phase](phases.png)\n\n"
                   "![time per sample](step_time.png)\n");
    else fprintf(f, "No charts: %s.\n", why);
    fprintf(f, "\nFiles: `results.csv`, `phases.csv`, `results.json` (schema version %d), `memory.dat`, "
               "`phases.dat`, `step_time.dat`, `charts.gp` (redraw: `cd` into this folder, `gnuplot charts.gp`).\n",
            FL_LAB_JSON_VERSION);
    if (fclose(f) != 0) return fl_errorf(FL_ERR_IO, "%s: write failed", path);
    return FL_OK;
}

fl_status fl_lab_write(const fl_lab_report *rep, const char *dir, int *charts_out) {
    FL_TRY(fl_fs_mkdir_p(dir));
    char cpu[256], os[256], date[64], why[300] = "";
    long cores;
    double ram;
    machine(cpu, sizeof cpu, &cores, &ram, os, sizeof os);
    time_t now = time(NULL);
    struct tm tmv;
    localtime_r(&now, &tmv);
    strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S %Z", &tmv);
    FL_TRY(write_csv(rep, dir));
    FL_TRY(write_json(rep, dir, date, cpu, cores, ram, os));
    int charts = write_charts(rep, dir, why, sizeof why);
    if (charts_out) *charts_out = charts;
    return write_md(rep, dir, date, cpu, cores, ram, os, charts, why);
}

/* ---- the console, as the rows run (lab.c, lab_blip2.c) ---- */

fl_status fl_lab_print_row(FILE *out, const fl_lab_row *r, fl_lab_report *rep) {
    char pre[64], a[32];
    snprintf(pre, sizeof pre, "  %-17s %-6s %8.1f s  ", r->name, fl_lab_verdict_name(r->verdict), r->wall_s);
    fl_lab_wrap(out, pre, r->verdict == FL_LAB_FITS ? fl_fmt_bytes(r->peak_total, a, sizeof a) : r->note, 120, 6);
    errno = 0;
    if (fflush(out) == 0 && !ferror(out)) return FL_OK;
    rep->out_errno = errno ? errno : EIO; /* the banner's failure is kept in ferror: its errno may be gone */
    return fl_errorf(FL_ERR_IO, "lab: writing its progress failed after row %s: %s", r->name, strerror(rep->out_errno));
}

int fl_lab_stop_polled(const fl_lab_opts *o, fl_lab_report *rep) {
    if (!rep->stopped && o->stop) rep->stopped = o->stop(o->stop_ud);
    return rep->stopped;
}
