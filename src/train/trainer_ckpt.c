/* The trainer's checkpoints, resume and divergence reports (src/train/trainer-impl.h). */
#include <dirent.h>
#include <sys/stat.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer-impl.h"
#include "fitllm/checkpoint.h"

/* A diverged run (FL_ERR_NONFINITE from the step, the update or evaluation):
 * say where, what to try, and which checkpoint is the last good one. */
fl_status fl_tr_diverged(const trainer *t, fl_status s, long step, long iter) {
    if (s != FL_ERR_NONFINITE) return s;
    char what[1024], last[FL_CFG_PATH + 300], kept[FL_CFG_PATH + 400];
    snprintf(what, sizeof what, "%s", fl_error_message());
    if (fl_ckpt_find_latest(t->cfg->out_dir, last, sizeof last) == FL_OK) {
        const char *base = strrchr(last, '/') ? strrchr(last, '/') + 1 : last;
        long saved = -1;
        if (sscanf(base, "step-%ld", &saved) == 1 && saved == step - 1 && iter > t->st.iter)
            /* this step's forward read the weights of that checkpoint: they are the ones that diverged */
            snprintf(kept, sizeof kept, "'%s' holds the weights this loss came from: resume from an earlier "
                     "checkpoint with --resume <dir>", last);
        else
            snprintf(kept, sizeof kept, "the last good checkpoint, '%s', is kept", last);
    } else
        snprintf(kept, sizeof kept, "no checkpoint had been saved yet");
    return fl_errorf(FL_ERR_NONFINITE,
                     "training diverged at step %ld (iter %ld): %s; stopped without saving final/ (%s). "
                     "hint: lower the learning rate (--optimizer.lr, now %g), clip gradients (--train.max_norm 1.0) "
                     "or warm up longer (--train.lr_warmup_steps)",
                     step, iter, what, kept, t->cfg->optimizer.lr);
}

/* Refuse to save weights an update has pushed to inf/NaN (a finite loss can
 * still give a huge step): the last good checkpoint must not be rotated away. */
fl_status fl_tr_check_weights(trainer *t) {
    int found = 0;
    if (t->dp.fsdp) FL_TRY(fl_fsdp_check_finite(&t->dp, &t->opt, &found)); /* every rank's shard */
    else FL_TRY(FL_RUN(&t->hw.be, check_finite, t->opt.w.p, t->opt.w.pt, t->opt.w.n, 1.0f, &found));
    if (found) return fl_errorf(FL_ERR_NONFINITE, "the weights hold inf/NaN after the update");
    return FL_OK;
}

/* The step-* checkpoint of the current step (collective). rotate: delete the older ones beyond
 * train.keep_checkpoints (not while the loss is above the divergence limit: they may be the last
 * good ones). */
fl_status fl_tr_save_step(trainer *t, int lead, int rotate) {
    const fl_run_config *cfg = t->cfg;
    char name[32];
    snprintf(name, sizeof name, "step-%06ld", t->st.step);
    fl_tr_bar_clear(t);
    if (t->out) fprintf(t->out, "Saving checkpoint to '%s/%s'\n", cfg->out_dir, name);
    fl_mem_set_phase(&t->hw.pool, "checkpoint");
    FL_TRY(fl_tr_diverged(t, fl_tr_check_weights(t), t->st.step, t->st.iter));
    /* the ranks hold the same weights (and, but under ZeRO, state): one writer, the single-process
     * format; ZeRO's state chunks travel to rank 0 first (collective) */
    if (lead) FL_TRY(fl_tr_save_base(t, 0, 0)); /* LoRA on random weights: the base its adapters name, once */
    if (t->tp.size > 1) FL_TRY(fl_tr_tp_save(t, lead, name, &t->opt, &t->st)); /* gathered from the slices */
    else if (t->pp.size > 1) FL_TRY(fl_tr_pp_save(t, lead, name, &t->opt, &t->st)); /* from the stages */
    else FL_TRY(fl_dp_ckpt_save(&t->dp, lead, cfg->out_dir, name, &t->model, &t->opt, &t->st, fl_tr_saved_cfg(t),
                                t->in.tok_dir[0] ? t->in.tok_dir : NULL));
    if (lead && rotate) fl_ckpt_rotate(cfg->out_dir, cfg->train.keep_checkpoints);
    return FL_OK;
}

fl_status fl_tr_save_base(trainer *t, int setup, int resumed) {
    const fl_run_config *cfg = t->cfg;
    if (!t->model.lora || t->in.weights_loaded || t->in.base_kept) return FL_OK; /* checkpoint_dir's files, or done */
    char dir[FL_CFG_PATH + 300];
    snprintf(dir, sizeof dir, "%s/" FL_CKPT_BASE, cfg->out_dir);
    if (setup && resumed && fl_ckpt_is_committed(dir)) { /* written by the run this one continues */
        t->in.base_kept = 1;
        return FL_OK;
    }
    const int whole = t->tp.size <= 1 && t->pp.size <= 1;
    if (setup == whole) return FL_OK; /* a whole model's when an adapter is saved; slices' and stages' now */
    const char *tok = t->in.tok_dir[0] ? t->in.tok_dir : NULL;
    fl_status s;
    if (whole) {
        s = fl_ckpt_save_base(cfg->out_dir, &t->model, tok); /* the run's own base, whole on every rank */
    } else { /* slices or stages: the whole model made again as the load made it (the same seed), then freed */
        tp_whole w;
        memset(&w, 0, sizeof w);
        s = fl_backend_pools_init(&t->hw.be, &w.pool, &w.hpool, "the base model (whole)", 0);
        w.pool_ok = s == FL_OK;
        const fl_model_storage keep = t->stg;
        t->stg.shard = NULL;
        if (s == FL_OK) s = fl_tr_load_model(t, NULL, &w.m, &w.pool, &w.m_ok);
        t->stg = keep;
        if (s == FL_OK) s = fl_ckpt_save_base(cfg->out_dir, &w.m, tok);
        fl_tr_whole_free(&w);
    }
    FL_TRY(s);
    t->in.base_kept = 1;
    struct stat st;
    if (t->out)
        fprintf(t->out, "note: the base model's weights are random (%s%s%s, seed %llu): saved once to '%s' (config.json, "
                "model.safetensors, tokenizer), which the adapters of step-*/ and final/adapter name as their base "
                "(base_model_name_or_path), so that merge_lora, generate and PEFT load the weights they were trained "
                "on\n", cfg->init_random ? "--init random" : "'", cfg->init_random ? "" : cfg->checkpoint_dir,
                cfg->init_random ? "" : stat(cfg->checkpoint_dir, &st) == 0 ? "' holds no weights" : "' is a model preset",
                (unsigned long long)cfg->seed, dir);
    return FL_OK;
}

/* --resume auto found nothing committed: a step-* folder without its COMMITTED marker (a save that did not finish)
 * is said, so that the fresh start is not taken for a resume */
static void note_uncommitted(trainer *t) {
    DIR *d = t->out ? opendir(t->cfg->out_dir) : NULL;
    if (!d) return;
    struct dirent *e;
    char newest[256] = "", p[FL_CFG_PATH + 300];
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "step-", 5) || strlen(e->d_name) >= sizeof newest) continue;
        snprintf(p, sizeof p, "%s/%s", t->cfg->out_dir, e->d_name);
        if (!fl_ckpt_is_committed(p) && strcmp(e->d_name, newest) > 0) snprintf(newest, sizeof newest, "%s", e->d_name);
    }
    closedir(d);
    if (newest[0])
        fprintf(t->out, "note: --resume auto: no committed checkpoint in '%s' (%s has no COMMITTED marker: a save that "
                "did not finish); starting from the beginning\n", t->cfg->out_dir, newest);
}

fl_status fl_tr_resume(trainer *t, int *resumed) {
    const char *r = t->cfg->resume;
    char path[FL_CFG_PATH + 300];
    *resumed = 0;
    if (!strcmp(r, "false")) return FL_OK;
    if (!strcmp(r, "true") || !strcmp(r, "auto")) {
        fl_status s = fl_ckpt_find_latest(t->cfg->out_dir, path, sizeof path);
        if (s == FL_ERR_NOT_FOUND && !strcmp(r, "auto")) {
            note_uncommitted(t);
            return FL_OK;
        }
        if (s != FL_OK) return fl_error_prefix(s, "--resume true");
    } else {
        snprintf(path, sizeof path, "%s", r);
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) /* was "not a committed checkpoint (no COMMITTED file)" */
            return fl_errorf(FL_ERR_NOT_FOUND, "--resume '%s': no such checkpoint folder (--resume takes auto, true, "
                             "false or a checkpoint folder such as out/step-000100)", r);
    }
    /* another model's or another run's checkpoint is refused before anything is read (resume_check.c) */
    const fl_model_config *whole = t->pp.size > 1 ? &t->pp.whole /* TP x PP: t->tp.whole is the stage */
                                   : t->tp.size > 1 ? &t->tp.whole : &t->model.cfg;
    char notes[4096];
    FL_TRY(fl_ckpt_check_resume(path, t->cfg, whole, notes, sizeof notes));
    if (t->tp.size > 1) FL_TRY(fl_tr_tp_ckpt_load(t, path)); /* the whole checkpoint, then this rank's slice */
    else if (t->pp.size > 1) FL_TRY(fl_tr_pp_ckpt_load(t, path)); /* the whole checkpoint, then this stage */
    else FL_TRY(fl_dp_ckpt_load(&t->dp, path, &t->model, &t->opt, &t->st)); /* ZeRO: each rank keeps its chunk */
    FL_TRY(fl_tr_loader_set_state(t, &t->st.loader));
    if (t->out) fprintf(t->out, "Resuming training from %s (step %ld, iter %ld)\n%s", path, t->st.step, t->st.iter, notes);
    *resumed = 1;
    return FL_OK;
}
