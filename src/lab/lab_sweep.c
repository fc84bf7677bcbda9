/* The fsdp suite's report (the course's FSDP benchmark): the sweep tables in the console and report.md, side
 * by side with the course's figures, and sweep.dat / sweep.png. lab_report.c writes the rest. */
#include <math.h>
#include <string.h>

#include "lab-impl.h"

/* The course's table ("efficient training of LLMs": Lightning Lite + FSDP, minGPT-style GPT-2, blocks wrapped per
 * Block, 16-mixed, T 128, per-GPU batch, 100 iterations averaged, 4x V100 16 GB). mem_mb 0: OOM. The checkpointed
 * batch 64 of gpt2-xl was measured without and with backward prefetch. */
typedef struct {
    const char *model;
    int ckpt, B, prefetch; /* prefetch -1: either */
    double mem_mb, util, tflops, iter_ms;
} course_row;

static const course_row k_course[] = {
    {"gpt2-xl", 0, 1, -1, 9028, 71.9, 6.28, 823},    {"gpt2-xl", 0, 2, -1, 10510, 70.4, 12.68, 754},
    {"gpt2-xl", 0, 4, -1, 12488, 79.9, 24.96, 744},  {"gpt2-xl", 0, 7, -1, 14736, 86.2, 43.52, 748},
    {"gpt2-xl", 0, 8, -1, 14992, 88.1, 36.8, 1676},  {"gpt2-xl", 0, 9, -1, 0, 0, 0, 0},
    {"gpt2-xl", 1, 8, -1, 8458, 83.5, 47.28, 1024},  {"gpt2-xl", 1, 16, -1, 8604, 94.3, 95.88, 1097},
    {"gpt2-xl", 1, 32, -1, 10188, 94.8, 127.68, 1575}, {"gpt2-xl", 1, 64, 0, 11490, 96.4, 142.28, 2748},
    {"gpt2-xl", 1, 64, 1, 11490, 97.3, 144.96, 2700}, {"gpt2-xxl", 1, 8, -1, 14340, 83.7, 47.4, 2054},
    {"gpt2-xxl", 1, 16, -1, 14984, 93.2, 95.3, 2098}, {"gpt2-xxl", 1, 32, -1, 14992, 91.6, 100.4, 3844},
};

static const course_row *course_of(const fl_lab_report *rep, const fl_lab_row *r) {
    if (strcmp(r->precision, "16-mixed")) return NULL; /* the course ran AMP only */
    for (size_t i = 0; i < sizeof k_course / sizeof k_course[0]; i++) {
        const course_row *c = &k_course[i];
        if (!strcmp(c->model, rep->sweep_model) && c->ckpt == r->act_ckpt && c->B == r->B &&
            (c->prefetch < 0 || c->prefetch == r->prefetch))
            return c;
    }
    return NULL;
}

int fl_lab_course_fsdp(const fl_lab_report *rep, const fl_lab_row *r, double *mem_mb, double *util, double *tflops,
                       double *iter_ms) {
    const course_row *c = course_of(rep, r);
    if (!c) return 0;
    *mem_mb = c->mem_mb, *util = c->util, *tflops = c->tflops, *iter_ms = c->iter_ms;
    return 1;
}

/* The fsdp suite's "as in the lab": the course's verdict where its table has the row (its 16-mixed batches; a memory
 * figure: fits, none: OOM), none elsewhere (FL_LAB_NA: "-"). Where fitllm's verdict differs, why, in the row's
 * course_why: the course's run is PyTorch's on 4x V100 16 GB, fitllm's plan of the same run at the real scale. */
void fl_lab_sweep_course_verdict(const fl_lab_report *rep, fl_lab_row *r) {
    const course_row *c = course_of(rep, r);
    r->expected = FL_LAB_NA;
    r->course_why[0] = 0;
    if (!c) return;
    r->expected = c->mem_mb > 0 ? FL_LAB_FITS : FL_LAB_OOM;
    if (r->verdict == r->expected || (r->verdict != FL_LAB_FITS && r->verdict != FL_LAB_OOM)) return;
    const course_row *last = NULL; /* the course's largest batch that fit in this setting */
    for (size_t i = 0; i < sizeof k_course / sizeof k_course[0]; i++) {
        const course_row *k = &k_course[i];
        if (!strcmp(k->model, c->model) && k->ckpt == c->ckpt && k->mem_mb > 0 && (!last || k->B > last->B)) last = k;
    }
    char a[32], lastb[96] = "";
    if (last) snprintf(lastb, sizeof lastb, "; the course's largest fitting micro batch: %d at %.0f MB", last->B,
                       last->mem_mb);
    snprintf(r->course_why, sizeof r->course_why, "the course %s at micro batch %d (PyTorch FSDP, 4x V100 16 GB%s); "
             "fitllm %s at the %s scale, its real-scale plan (%s, T %d, 16 GiB per rank) %s at %s per rank: fitllm's "
             "verdict, not the course's (PyTorch's CUDA context and caching allocator are not in fitllm's figure)",
             c->mem_mb > 0 ? "fit" : "ran out of memory", r->B, lastb, fl_lab_verdict_name(r->verdict),
             rep->real_scale ? "real" : "lab", rep->sweep_model, REF_SWEEP_T_PUBLIC, fl_lab_plan_name(r->ref_planned),
             fl_fmt_bytes(r->ref_peak, a, sizeof a));
}

int fl_lab_sweep_group(const fl_lab_row *r) { return 2 * (strcmp(r->precision, "32-true") != 0) + r->act_ckpt; }

static const char *group_name(int g) {
    static const char *n[4] = {"activation checkpointing off, 32-true", "activation checkpointing on, 32-true",
                               "activation checkpointing off, 16-mixed", "activation checkpointing on, 16-mixed"};
    return n[g];
}

static void range_mib(const fl_lab_row *r, char *b, size_t n) {
    if (r->ranks > 1 && r->peak_max > r->peak_min && r->verdict == FL_LAB_FITS)
        snprintf(b, n, "%.1f-%.1f", FL_LAB_MIB(r->peak_min), FL_LAB_MIB(r->peak_max));
    else snprintf(b, n, "%.1f", FL_LAB_MIB(r->peak_total));
}

/* The console's sweep tables: 120 columns. */
void fl_lab_sweep_print(const fl_lab_report *rep, FILE *f) {
    for (int g = 0; g < 4; g++) {
        int any = 0;
        for (int i = 0; i < rep->n; i++) any |= fl_lab_sweep_group(&rep->rows[i]) == g;
        if (!any) continue;
        fprintf(f, "\nbatch-size sweep, %s, %s (per rank, min-max over the ranks)\n  *: fitllm's largest "
                   "fitting; real: %s planned at T %d, %.0f GiB per rank; course: 4x V100 16 GB, 16-mixed\n"
                   "%-72s | %-12s | %s\n%6s %-7s %13s %8s %9s %8s %8s %6s | %-4s %7s | %6s %5s %7s %7s\n",
                group_name(g), rep->sweep_model, rep->sweep_model, REF_SWEEP_T_PUBLIC, 16.0,
                rep->real_scale ? "       at the real scale -----------------------------------------------"
                                : "       at lab scale ----------------------------------------------------",
                "real scale", "the course", "micro", "verdict",
                "peak MiB", "planned", "iter ms", "tok/s", "TFLOP/s", "MFU", "real", "GiB", "MB", "util%", "TFLOP/s",
                "iter ms");
        for (int i = 0; i < rep->n; i++) {
            const fl_lab_row *r = &rep->rows[i];
            if (fl_lab_sweep_group(r) != g) continue;
            char pk[32], mfu[16] = "-";
            range_mib(r, pk, sizeof pk);
            if (r->verdict != FL_LAB_FITS && r->verdict != FL_LAB_OOM) snprintf(pk, sizeof pk, "-");
            fprintf(f, "%5d%s %-7s %13s %8.1f", r->B, r->largest ? "*" : " ", fl_lab_verdict_name(r->verdict), pk,
                    FL_LAB_MIB(r->planned_peak));
            if (r->mfu > 0) snprintf(mfu, sizeof mfu, "%.1f%%", 100 * r->mfu);
            if (FL_LAB_TIMED(r)) fprintf(f, " %9.1f %8.0f %8.4f %6s |", r->step_ms, r->tok_s, r->tflops, mfu);
            else fprintf(f, " %9s %8s %8s %6s |", "-", "-", "-", "-");
            fprintf(f, " %-4s %7.2f |", fl_lab_plan_name(r->ref_planned), (double)r->ref_peak / 1073741824.0);
            const course_row *c = course_of(rep, r);
            if (!c) fprintf(f, "\n");
            else if (c->mem_mb == 0) fprintf(f, " %6s %5s %7s %7s\n", "OOM", "-", "-", "-");
            else fprintf(f, " %6.0f %5.1f %7.2f %7.0f\n", c->mem_mb, c->util, c->tflops, c->iter_ms);
        }
    }
}

/* report.md: the sweep. */
void fl_lab_sweep_md(FILE *f, const fl_lab_report *rep, int charts) {
    char a[32];
    fprintf(f, "## Batch-size sweep: %s with FSDP on 4 devices, %s\n\n"
               "The course's benchmark trains GPT-2-XL (and a ~3 B \"gpt2-xxl\") with FSDP FULL_SHARD on 4 V100 16 GB, "
               "16-mixed (AMP), T 128, and sweeps the micro batch (1 2 4 7 8 9; with activation checkpointing 8 16 32 "
               "64) against memory, GPU utilization, TFLOP/s and iteration time. Here: `%s%s`, %s; 4 ranks as threads, "
               "each with the budget %s; micro batch 1 2 4 7 8 9 (with checkpointing also 16 32 64), then doubling, "
               "until the planner says OOM (that row is a result, decided by its plan); 32-true and 16-mixed; "
               "backward prefetch %s. Memory per rank in MiB, **min-max over the 4 ranks**; OOM rows: what the plan "
               "had in use at the failure, the planned column what the run would need. Iteration = one optimizer step "
               "of the global batch (micro batch x 4 ranks); TFLOP/s = model FLOPs (6 x parameters per token + "
               "attention, no recompute) / iteration time; MFU = TFLOP/s / the device's peak (%s). **Bold**: "
               "fitllm's largest micro batch that fits (where the course's verdict differs, the notes say why). *real*: fitllm's plan of the real model at the course's settings "
               "(%s, T %d, 16 GiB per rank); *course*: the course's figures (16-mixed rows only; the checkpointed "
               "batch 64 row by the prefetch setting).\n\n",
            rep->sweep_model, rep->real_scale ? "at the real scale" : "at lab scale", rep->real_scale ? "" : "lab-",
            rep->sweep_model,
            rep->real_scale ? "T 128" : "widths / 16, T scaled from 128 as the lab's T from 1024",
            fl_fmt_bytes(rep->budget, a, sizeof a), rep->no_prefetch ? "off" : "on (BACKWARD_PRE)",
            rep->peak_source[0] ? rep->peak_source : "no peak known for this device: --peak-tflops", rep->sweep_model,
            REF_SWEEP_T_PUBLIC);
    static const fl_mem_tag tags[] = {FL_TAG_PARAMS, FL_TAG_GRADS, FL_TAG_OPTIM, FL_TAG_ACTS, FL_TAG_WORKSPACE,
                                      FL_TAG_GATHER};
    for (int g = 0; g < 4; g++) {
        int any = 0;
        for (int i = 0; i < rep->n; i++) any |= fl_lab_sweep_group(&rep->rows[i]) == g;
        if (!any) continue;
        const char *sc = rep->real_scale ? "real scale" : "lab scale";
        fprintf(f, "### %s\n\n| micro batch | verdict (%s) | planned (%s) | PARAMS | GRADS | OPTIM | ACTS | WORKSPACE | "
                   "GATHER | peak (min-max) | planned peak | iteration ms | tok/s | TFLOP/s | MFU | GPU util %% | real "
                   "scale: plan | real scale: peak | course: memory MB | course: GPU util %% | course: TFLOP/s | course: "
                   "iteration ms |\n|", group_name(g), sc, sc);
        for (int k = 0; k < 22; k++) fprintf(f, "---|");
        fprintf(f, "\n");
        for (int i = 0; i < rep->n; i++) {
            const fl_lab_row *r = &rep->rows[i];
            if (fl_lab_sweep_group(r) != g) continue;
            const char *bo = r->largest ? "**" : "";
            char pk[32];
            range_mib(r, pk, sizeof pk);
            fprintf(f, "| %s%d%s | %s | %s |", bo, r->B, bo, fl_lab_verdict_name(r->verdict),
                    fl_lab_plan_name(r->planned));
            for (size_t t = 0; t < sizeof tags / sizeof tags[0]; t++) fprintf(f, " %.2f |", FL_LAB_MIB(r->peak[tags[t]]));
            fprintf(f, " %s%s%s | %.2f |", bo, pk, bo, FL_LAB_MIB(r->planned_peak));
            if (FL_LAB_TIMED(r)) {
                fprintf(f, " %.1f | %.0f | %.4f |", r->step_ms, r->tok_s, r->tflops);
                if (r->mfu > 0) fprintf(f, " %.2f%% |", 100 * r->mfu);
                else fprintf(f, " - |");
                char gu[48], gm[64];
                fl_lab_gpu_cells(r, gu, sizeof gu, gm, sizeof gm);
                fprintf(f, " %s |", gu);
            } else fprintf(f, " - | - | - | - | - |");
            fprintf(f, " %s | %s |", fl_lab_plan_name(r->ref_planned), r->ref_peak ? fl_fmt_bytes(r->ref_peak, a, sizeof a) : "-");
            const course_row *c = course_of(rep, r);
            if (!c) fprintf(f, " | | | |\n");
            else if (c->mem_mb == 0) fprintf(f, " OOM | - | - | - |\n");
            else fprintf(f, " %.0f | %.1f | %.2f | %.0f |\n", c->mem_mb, c->util, c->tflops, c->iter_ms);
        }
        fprintf(f, "\n");
    }
    if (charts) fprintf(f, "![memory and tokens/s vs micro batch](sweep.png)\n\n");
}

/* sweep.dat: one block per setting (precision, checkpointing): micro batch, peak MiB per rank (the most over the
 * ranks; OOM: the planned need), tok/s (? = OOM or not trained: --plan-only). idx[g]: the setting's block, -1 none;
 * fit[g]: any row of it trained and fits (it has a tok/s). */
int fl_lab_sweep_data(const fl_lab_report *rep, FILE *f, int idx[4], int fit[4]) {
    int n = 0;
    fprintf(f, "# micro_batch peak_MiB_per_rank (the most over the ranks; OOM: planned need) tokens_per_s (? = OOM "
               "or not trained); "
               "one block per setting:");
    for (int g = 0; g < 4; g++) idx[g] = -1, fit[g] = 0;
    for (int g = 0; g < 4; g++)
        for (int i = 0; i < rep->n; i++) {
            const fl_lab_row *r = &rep->rows[i];
            if (fl_lab_sweep_group(r) != g || (r->verdict != FL_LAB_FITS && r->verdict != FL_LAB_OOM)) continue;
            if (idx[g] < 0) { /* gnuplot's index: blocks split by two blank lines */
                fprintf(f, "%s# %s\n", n ? "\n\n" : "\n", group_name(g));
                idx[g] = n++;
            }
            fprintf(f, "%d %.3f ", r->B, FL_LAB_MIB(r->verdict == FL_LAB_FITS ? r->peak_max : r->planned_peak));
            if (r->verdict == FL_LAB_FITS && r->ran) fprintf(f, "%.1f\n", r->tok_s), fit[g] = 1;
            else fprintf(f, "?\n");
        }
    return n;
}

void fl_lab_sweep_script(const fl_lab_report *rep, FILE *f, const int idx[4], const int fit[4]) {
    static const char *col[4] = {"#4477aa", "#228833", "#ee6677", "#aa3377"};
    static const char *nm[4] = {"32-true", "32-true ckpt", "16-mixed", "16-mixed ckpt"};
    const int any_tok = fit[0] || fit[1] || fit[2] || fit[3];
    fprintf(f, "reset\nset terminal pngcairo size 1280,640 font 'sans,10'\nset output 'sweep.png'\n"
               "set title \"%s%s 4x FSDP FULL_SHARD: memory per rank (solid, left)%s vs micro batch\\nOOM points: "
               "planned need; the largest batch that fits of each setting marked\" noenhanced\n"
               "set datafile missing '?'\nset logscale x 2\nset xlabel 'micro batch per rank'\n"
               "set ylabel 'peak MiB per rank (most over the ranks)'\n%s"
               "set grid\nset key outside right top\nset yrange [0:*]\n"
               "set arrow 1 from graph 0, first %.3f to graph 1, first %.3f nohead lw 2 dt 2 lc rgb 'red'\n"
               "set label 1 'budget per rank' at graph 0.01, first %.3f left offset 0,0.8 tc rgb 'red'\n",
            rep->real_scale ? "" : "lab-", rep->sweep_model,
            any_tok ? " and tokens/s (dashed, right)" : " (planned: no row trained, so no tokens/s)",
            any_tok ? "set y2label 'tokens/s (global batch)'\nset ytics nomirror\nset y2tics\nset y2range [0:*]\n" : "",
            FL_LAB_MIB(rep->budget), FL_LAB_MIB(rep->budget), FL_LAB_MIB(rep->budget));
    int placed[4], np = 0; /* the labels' batches: two settings' labels at one batch stack, not overlap */
    for (int i = 0, n = 2; i < rep->n; i++) { /* the largest fitting batch of each setting */
        const fl_lab_row *r = &rep->rows[i];
        const int g = fl_lab_sweep_group(r);
        if (!(r->largest && g >= 0 && g < 4 && r->verdict == FL_LAB_FITS) || np >= 4) continue;
        int above = 0;
        for (int k = 0; k < np; k++) above += placed[k] == r->B;
        placed[np++] = r->B;
        fprintf(f, "set label %d 'largest: %d (%s)' at first %d, first %.3f center offset 0,%.1f tc rgb '%s'\n", n++,
                r->B, nm[g], r->B, FL_LAB_MIB(r->peak_max), 1.2 + 1.3 * above, col[g]);
    }
    fprintf(f, "plot");
    int k = 0;
    for (int g = 0; g < 4; g++) {
        if (idx[g] < 0) continue;
        fprintf(f, "%s 'sweep.dat' index %d using 1:2 with linespoints lw 2 lc rgb '%s' title 'memory, %s'",
                k++ ? "," : "", idx[g], col[g], nm[g]);
        if (fit[g]) /* gnuplot refuses an axis with no defined point */
            fprintf(f, ", 'sweep.dat' index %d using 1:3 axes x1y2 with linespoints dt 2 lc rgb '%s' title "
                       "'tok/s, %s'", idx[g], col[g], nm[g]);
    }
    fprintf(f, "\n");
}
