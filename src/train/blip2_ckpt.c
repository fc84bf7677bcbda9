/* BLIP-2 fine-tuning's checkpoints (fitllm/blip2_train.h): step checkpoints (an HF BLIP-2 folder, or the language
 * model's PEFT adapter under LoRA, plus training_state.safetensors: each trained part's parameters and optimizer state,
 * the data position), --resume from them bit-exactly, and the final folder. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/fs.h"
#include "fitllm/adam8bit.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/peft.h"
#include "blip2_train-impl.h"
#include "resume_check.h"
#include "shard_ckpt.h"


/* The language model's adapters as PEFT saves them on Blip2ForConditionalGeneration (language_model.<module>). */
static fl_status save_adapter(b2run *r, const char *dir) {
    fl_model *lm = fl_blip2_part(r->b, FL_BLIP2_TEXT);
    fl_lora_adapters ad;
    if (!fl_model_lora_adapters(lm, &ad)) return FL_OK;
    fl_peft_module *mods = calloc((size_t)ad.n_mods + 1, sizeof *mods);
    float *host = malloc(ad.numel * sizeof(float) + 1);
    fl_status s = mods && host ? FL_RUN(lm->be, to_host, host, ad.params, ad.numel * sizeof(float))
                               : fl_errorf(FL_ERR_OOM, "out of host memory");
    for (int j = 0; s == FL_OK && j < ad.n_mods; j++) {
        static const char pre[] = "language_model.";
        if (strlen(ad.mods[j].name) + sizeof pre > sizeof mods[j].name) {
            s = fl_errorf(FL_ERR_INVALID, "LoRA module name too long for the adapter file: %s", ad.mods[j].name);
            break;
        }
        memcpy(mods[j].name, pre, sizeof pre - 1);
        memcpy(mods[j].name + sizeof pre - 1, ad.mods[j].name, strlen(ad.mods[j].name) + 1);
        mods[j].in = ad.mods[j].in, mods[j].out = ad.mods[j].out;
        mods[j].A = host + ad.off[2 * j], mods[j].B = host + ad.off[2 * j + 1];
    }
    fl_peft_config pc;
    memset(&pc, 0, sizeof pc);
    pc.lora = *ad.cfg;
    pc.inference_mode = 1;
    pc.seq2seq = fl_model_is_s2s(&lm->cfg);
    char abs[4096]; /* an absolute path: PEFT and merge_lora find the base from anywhere */
    const char *base = realpath(r->cfg->checkpoint_dir, abs) ? abs : r->cfg->checkpoint_dir;
    if (s == FL_OK && strlen(base) >= sizeof pc.base_model)
        s = fl_errorf(FL_ERR_INVALID, "base model path too long for adapter_config.json: %s", base);
    else memcpy(pc.base_model, base, strlen(base) + 1);
    if (s == FL_OK) s = fl_peft_save(dir, &pc, mods, ad.n_mods);
    free(mods), free(host);
    return s;
}


/* FSDP: the array `shard` of part k laid out as its shard (es bytes an element) gathered unit by unit (collective):
 * whole into host memory on rank 0, what it writes (checkpoint I/O staging outside the pools; *out), one unit's buffer
 * at a time on the others (*out NULL). A failed allocation on rank 0 still takes part, then says so. */
static fl_status gather_array(b2run *r, int k, const void *shard, size_t es, void **out) {
    const size_t n = fl_blip2_part(r->b, k)->layout.numel;
    *out = r->rank ? NULL : malloc(n * es + 4);
    fl_status s = fl_fsdp_whole_array(&r->pdp[k], shard, es, *out);
    if (s == FL_OK && !r->rank && !*out) s = fl_errorf(FL_ERR_OOM, "checkpoint: out of host memory (%zu bytes)", n * es);
    return fl_error_prefix(s, "FULL_SHARD: gathering a checkpoint's arrays");
}

/* Every sharded part's parameters (rank 0: whole; NULL for a whole part and on the other ranks). */
static fl_status gather_params(b2run *r, void *whole[FL_BLIP2_PARTS]) {
    fl_status s = FL_OK;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        const fl_model *m = fl_blip2_part(r->b, k);
        whole[k] = NULL;
        if (s == FL_OK && r->pdp[k].fsdp)
            s = gather_array(r, k, fl_model_params_data(m), fl_dtype_size(fl_model_store_dtype(m)), &whole[k]);
    }
    return s;
}

static void free_params(void *whole[FL_BLIP2_PARTS]) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++) free(whole[k]), whole[k] = NULL;
}

/* The tokenizer files of the run's checkpoint_dir into dir (none there: nothing), as every checkpoint of the trainer
 * carries its run's tokenizer: a LoRA step's or final/adapter/ folder then serves generate on its own. */
static fl_status copy_tokenizer(const b2run *r, const char *dir) {
    int n = 0;
    return fl_io_has_tokenizer(r->cfg->checkpoint_dir) ? fl_io_copy_tokenizer_files(r->cfg->checkpoint_dir, dir, &n)
                                                       : FL_OK;
}

/* out_dir/name as the trainer's checkpoints are written (checkpoint.c): built in out_dir/.tmp-<name>-<pid> (tracked:
 * a stop by a signal removes it) by fill, with hyperparameters.yaml, then renamed into place and COMMITTED
 * (fl_ckpt_commit: a folder of that name moved aside first, kept when the new one fails); on a failure nothing of the
 * new folder is left. Rank 0. */
typedef fl_status (*b2fill)(b2run *r, const char *dir, const void *ud);
static fl_status save_folder(b2run *r, const char *name, b2fill fill, const void *ud) {
    const char *out = r->cfg->out_dir;
    char tname[96], tmp[4200], dst[4200];
    snprintf(tname, sizeof tname, ".tmp-%s-%d", name, (int)getpid());
    FL_TRY(fl_fs_join(dst, sizeof dst, out, name));
    FL_TRY(fl_fs_join(tmp, sizeof tmp, out, tname)); /* a too-long out_dir is refused, not cut */
    fl_status s = fl_fs_mkdir_p(out);
    if (s == FL_OK) {
        fl_fs_remove_dir(tmp);
        fl_fs_tmp_track(tmp);
        s = fl_fs_mkdir_p(tmp);
        if (s == FL_OK) s = fill(r, tmp, ud);
        if (s == FL_OK) s = fl_ckpt_write_hparams(tmp, r->cfg);
        if (s == FL_OK) s = fl_ckpt_commit(out, name, tmp);
        if (s != FL_OK) fl_fs_remove_dir(tmp);
        fl_fs_tmp_untrack(tmp);
    }
    return s == FL_OK ? FL_OK : fl_error_prefix(s, "saving checkpoint %s", dst);
}

/* ---- step checkpoints and resume -------------------------------------------------------------------- */

static const char *const k_part[FL_BLIP2_PARTS] = {"vision", "qformer", "lm"};
#define B2_STATE "training_state.safetensors"
#define B2_FORMAT "fitllm-blip2-training-state"

/* ZeRO at several ranks: each trained part's optimizer state arrays (m, v, buf) gathered whole into host memory on
 * every rank (collective; checkpoint I/O staging outside the pools), what rank 0 writes. NULLs otherwise. */
typedef struct {
    char *a[FL_BLIP2_PARTS][3];
    void *p[FL_BLIP2_PARTS]; /* FSDP: each sharded part's whole parameters */
    void *s8[FL_BLIP2_PARTS]; /* FSDP with 8-bit AdamW: the part's state in the one-process layout (s8n bytes) */
    size_t s8n[FL_BLIP2_PARTS];
} b2gathered;

/* the dtype of an optimizer's state arrays (bf16-true: bf16, as the trainer's) */
static fl_dtype state_dt(const fl_optimizer *o) { return o->cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32; }
static fl_status save_step_files(b2run *r, const b2pos *p, const b2gathered *g);

static void gathered_free(b2gathered *g) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        for (int j = 0; j < 3; j++) free(g->a[k][j]);
        free(g->s8[k]);
    }
    free_params(g->p);
}

/* 8-bit AdamW under FULL_SHARD: rank q of the shard group (HYBRID_SHARD: the node) holds the pieces
 * fl_optim_8bit_fsdp_piece(q) of every tensor of part k, packed one after another (its q8.state); the one-process
 * layout is every tensor's fl_adam8bit_state_bytes in layout order (what one process's checkpoint holds). */
static size_t full8_bytes(const fl_param_layout *lay) {
    size_t n = 0;
    for (int i = 0; i < lay->n; i++) n += fl_adam8bit_state_bytes(lay->params[i].numel);
    return n;
}

/* rank q's pieces (a, len: lay->n each) and their packed bytes */
static size_t pieces8(const fl_param_layout *lay, int W, int q, size_t *a, size_t *len) {
    size_t bytes = 0, so;
    for (int i = 0; i < lay->n; i++) {
        fl_optim_8bit_fsdp_piece(lay, i, W, q, &a[i], &len[i], &so);
        bytes += fl_adam8bit_piece_bytes(lay->params[i].numel, a[i], len[i]);
    }
    return bytes;
}

/* Part k's 8-bit state gathered into the one-process layout on rank 0 (*out, *n bytes; NULL elsewhere): each rank of
 * the shard group in turn broadcasts its packed pieces (host staging outside the pools) and rank 0 places them (a block
 * cut by a rank edge is written by both ranks holding a part of it, with the same absmax bits). Collective. */
static fl_status gather8(b2run *r, int k, void **out, size_t *n) {
    const fl_dp *dp = &r->pdp[k];
    const fl_optimizer *o = &r->opt[k];
    const fl_param_layout *lay = &fl_blip2_part(r->b, k)->layout;
    fl_comm *grp = dp->node ? dp->node : dp->comm;
    const int W = grp ? fl_comm_size(grp) : 1, me = grp ? fl_comm_rank(grp) : 0;
    size_t *a = calloc(2 * (size_t)lay->n + 2, sizeof *a), cap = 0;
    for (int q = 0; a && q < W; q++) {
        const size_t b = pieces8(lay, W, q, a, a + lay->n);
        cap = b > cap ? b : cap;
    }
    *n = full8_bytes(lay);
    *out = r->rank ? NULL : calloc(1, *n + 4);
    char *buf = malloc(cap + 4);
    fl_status s = a && buf && (r->rank || *out) ? FL_OK : fl_errorf(FL_ERR_OOM, "checkpoint: out of host memory");
    if (grp) s = fl_dp_agree(&r->pdp[k], s); /* a failed allocation: every rank returns before the broadcasts */
    for (int q = 0; s == FL_OK && q < W; q++) {
        const size_t b = pieces8(lay, W, q, a, a + lay->n);
        fl_status c = q == me ? fl_optim_state_read(o, buf, o->q8.state, b) : FL_OK;
        /* the packed bytes as F32 words (each piece's span a multiple of 4 bytes): a broadcast copies bits */
        fl_status t = grp ? fl_comm_broadcast(grp, buf, b / 4, FL_F32, q) : FL_OK;
        s = c != FL_OK ? c : t;
        if (s == FL_OK && *out) s = fl_optim_8bit_fsdp_copy(lay, a, a + lay->n, buf, *out, 1);
    }
    free(a), free(buf);
    return fl_error_prefix(s, "FULL_SHARD: gathering the 8-bit AdamW state of a checkpoint");
}

/* --resume under FULL_SHARD: this rank's pieces of part k's 8-bit state out of the one-process layout (n bytes) */
static fl_status take8(b2run *r, int k, const void *full, size_t n) {
    fl_optimizer *o = &r->opt[k];
    const fl_param_layout *lay = &fl_blip2_part(r->b, k)->layout;
    if (n != full8_bytes(lay))
        return fl_errorf(FL_ERR_FORMAT, "the 8-bit AdamW state has %zu bytes, this run's one-process layout %zu", n,
                         full8_bytes(lay));
    void *host = calloc(1, o->q8.state_bytes + 4);
    if (!host) return fl_errorf(FL_ERR_OOM, "out of host memory");
    fl_status s = fl_optim_8bit_fsdp_copy(lay, o->q8.p_a, o->q8.p_n, host, (void *)full, 0);
    if (s == FL_OK) s = fl_optim_state_write(o, o->q8.state, host, o->q8.state_bytes);
    free(host);
    return s;
}

/* FSDP: each sharded part's parameters and optimizer state arrays gathered whole (layout order) on rank 0. */
static fl_status gather_fsdp(b2run *r, b2gathered *g) {
    FL_TRY(gather_params(r, g->p));
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        if (!r->has_opt[k] || !r->pdp[k].fsdp) continue;
        const fl_optimizer *o = &r->opt[k];
        const void *arr[3] = {o->st.m, o->st.v, o->st.buf};
        for (int j = 0; j < 3; j++) {
            void *w = NULL;
            if (arr[j]) FL_TRY(gather_array(r, k, arr[j], fl_dtype_size(state_dt(o)), &w));
            g->a[k][j] = w;
        }
        if (o->q8.state) FL_TRY(gather8(r, k, &g->s8[k], &g->s8n[k]));
    }
    return FL_OK;
}

static fl_status gather_state(b2run *r, b2gathered *g) {
    memset(g, 0, sizeof *g);
    if (fl_b2t_fsdp(r)) return gather_fsdp(r, g);
    if (!fl_b2t_sharded(r)) return FL_OK;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        if (!r->has_opt[k]) continue;
        const fl_optimizer *o = &r->opt[k];
        const void *arr[3] = {o->st.m, o->st.v, o->st.buf};
        const fl_dtype dt = state_dt(o);
        const size_t es = fl_dtype_size(dt);
        for (int j = 0; j < 3; j++) {
            if (!arr[j]) continue;
            if (!(g->a[k][j] = malloc(o->w.n * es + 1))) return fl_errorf(FL_ERR_OOM, "out of host memory");
            FL_TRY(fl_optim_state_read(o, g->a[k][j] + o->shard.off * es, arr[j], o->shard.len * es));
            FL_TRY(fl_error_prefix(fl_comm_all_gather(r->dp.comm, g->a[k][j] + o->shard.off * es, g->a[k][j], o->w.n, dt),
                                   "%s: gathering the optimizer state for a checkpoint", fl_dp_stage_name(&r->dp)));
        }
    }
    return FL_OK;
}

/* training_state.safetensors: each trained part's parameters (its LoRA adapters under LoRA) and optimizer state, the
 * epoch's record order; the metadata the position in the data, the step and the run's shape (checked on resume). */
static fl_status write_state(b2run *r, const b2pos *p, const char *path, const b2gathered *g) {
    fl_st_write_tensor t[5 * FL_BLIP2_PARTS + 1];
    char names[5 * FL_BLIP2_PARTS][48];
    int nt = 0;
    int64_t *order = malloc(r->n_rec * sizeof *order + 1);
    if (!order) return fl_errorf(FL_ERR_OOM, "out of host memory");
    for (size_t i = 0; i < r->n_rec; i++) order[i] = (int64_t)p->order[i];
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        if (!r->has_opt[k]) continue;
        const fl_optimizer *o = &r->opt[k];
        const void *src[4] = {o->w.p, o->st.m, o->st.v, o->st.buf};
        static const char *const what[4] = {"params", "exp_avg", "exp_avg_sq", "momentum_buffer"};
        /* FSDP: the whole part's elements (gathered), not this rank's shard */
        const size_t n = g->p[k] ? fl_blip2_part(r->b, k)->layout.numel : o->w.n;
        for (int j = 0; j < 4; j++) {
            if (!src[j]) continue;
            snprintf(names[nt], sizeof names[nt], "%s.%s", k_part[k], what[j]);
            /* ZeRO / FSDP: the gathered state (FSDP: and parameters), in host memory */
            const void *gat = j ? g->a[k][j - 1] : g->p[k];
            const fl_dtype dt = j ? state_dt(o) : o->w.pt; /* bf16-true: the stored bf16 parameters and state */
            t[nt] = (fl_st_write_tensor){.name = names[nt], .dtype = dt, .ndim = 1, .shape = {(int64_t)n},
                                         .data = gat ? gat : src[j], .src_dtype = dt,
                                         .be = gat ? NULL : j ? o->home.be : &r->be};
            nt++;
        }
        if (o->q8.state) { /* 8-bit AdamW: the block-wise state of every tensor, bound in layout order: one blob */
            snprintf(names[nt], sizeof names[nt], "%s.state8", k_part[k]);
            const int gat = g->s8[k] != NULL; /* FULL_SHARD: gathered into the one-process layout */
            t[nt] = (fl_st_write_tensor){.name = names[nt], .dtype = FL_U8, .ndim = 1,
                                         .shape = {(int64_t)(gat ? g->s8n[k] : o->q8.state_bytes)},
                                         .data = gat ? g->s8[k] : o->q8.state, .src_dtype = FL_U8,
                                         .be = gat ? NULL : &r->be};
            nt++;
        }
    }
    t[nt++] = (fl_st_write_tensor){.name = "order", .dtype = FL_I64, .ndim = 1, .shape = {(int64_t)r->n_rec},
                                   .data = order, .src_dtype = FL_I64};
    char v[11][64];
    snprintf(v[0], sizeof v[0], "%s", B2_FORMAT);
    snprintf(v[1], sizeof v[1], "%ld", p->step);
    snprintf(v[2], sizeof v[2], "%ld", p->epoch);
    snprintf(v[3], sizeof v[3], "%zu", p->pos);
    snprintf(v[4], sizeof v[4], "%a", p->epoch_sum); /* exact */
    snprintf(v[5], sizeof v[5], "%ld", p->epoch_n);
    snprintf(v[6], sizeof v[6], "%d", r->parts | (r->lora ? 8 : 0));
    snprintf(v[7], sizeof v[7], "%zu", r->n_rec);
    snprintf(v[8], sizeof v[8], "%s", fl_optim_name(r->cfg->optimizer.kind));
    int ostep = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (r->has_opt[k]) ostep = r->opt[k].step;
    snprintf(v[9], sizeof v[9], "%d", ostep);
    snprintf(v[10], sizeof v[10], "%lld", p->tokens);
    static const char *const keys[11] = {"format", "step", "epoch", "pos", "epoch_sum", "epoch_n", "parts", "records",
                                         "optimizer", "optimizer_step", "tokens"};
    const char *vals[11];
    for (int i = 0; i < 11; i++) vals[i] = v[i];
    fl_status s = fl_st_write(path, t, nt, keys, vals, 11);
    free(order);
    return s;
}

/* out_dir/step-NNNNNN: the model as an HF BLIP-2 folder (under LoRA the PEFT adapter of the language model), the
 * training state and hyperparameters.yaml, then COMMITTED: built in .tmp-step-NNNNNN-PID, renamed into place
 * (save_folder; what --resume true picks: fl_ckpt_find_latest), the newest train.keep_checkpoints kept. Every rank
 * calls it; rank 0 writes (under DDP every rank holds the same weights and state; under ZeRO the state is gathered
 * first). */
fl_status fl_b2t_save_step(b2run *r, const b2pos *p) {
    b2gathered g;
    fl_status s = gather_state(r, &g);
    if (s == FL_OK && !r->rank) s = save_step_files(r, p, &g);
    gathered_free(&g);
    return s;
}

typedef struct {
    const b2pos *p;
    const b2gathered *g;
} b2step;

/* a step checkpoint's content: the model (under LoRA the language model's PEFT adapter, with the tokenizer), the
 * training state */
static fl_status fill_step(b2run *r, const char *dir, const void *ud) {
    const b2step *st = ud;
    char path[4200];
    if (fl_blip2_part(r->b, FL_BLIP2_TEXT)->adapt) {
        FL_TRY(save_adapter(r, dir));
        FL_TRY(copy_tokenizer(r, dir));
    } else {
        FL_TRY(fl_blip2_save_whole(r->b, r->cfg->checkpoint_dir, dir, (const void *const *)st->g->p));
    }
    FL_TRY(fl_fs_join(path, sizeof path, dir, B2_STATE));
    return write_state(r, st->p, path, st->g);
}

static fl_status save_step_files(b2run *r, const b2pos *p, const b2gathered *g) {
    char name[40];
    snprintf(name, sizeof name, "step-%06ld", p->step);
    const b2step st = {p, g};
    FL_TRY(save_folder(r, name, fill_step, &st));
    if (r->cfg->train.keep_checkpoints > 0) fl_ckpt_rotate(r->cfg->out_dir, r->cfg->train.keep_checkpoints);
    char dst[4200];
    FL_TRY(fl_fs_join(dst, sizeof dst, r->cfg->out_dir, name));
    fl_b2t_say(r, "saved checkpoint %s\n", dst);
    return FL_OK;
}

/* final/'s content: the weights (FSDP: gathered), LoRA merged, and under LoRA adapter/ (PEFT) first; full
 * fine-tuning: the training state too, as the trainer's final/ (--resume final/ goes on from the finished run) */
static fl_status fill_final(b2run *r, const char *dir, const void *ud) {
    const b2step *st = ud;
    fl_model *lm = fl_blip2_part(r->b, FL_BLIP2_TEXT);
    if (lm->adapt) {
        char ad[4200];
        FL_TRY(fl_fs_join(ad, sizeof ad, dir, "adapter"));
        FL_TRY(save_adapter(r, ad));
        FL_TRY(copy_tokenizer(r, ad));
        FL_TRY(fl_model_lora_merge(lm)); /* the folder's weights: the adapters merged */
    }
    FL_TRY(fl_blip2_save_whole(r->b, r->cfg->checkpoint_dir, dir, (const void *const *)st->g->p));
    if (lm->adapt) return FL_OK; /* a LoRA run's final/ holds no state, as the trainer's */
    char path[4200];
    FL_TRY(fl_fs_join(path, sizeof path, dir, B2_STATE));
    return write_state(r, st->p, path, st->g);
}

fl_status fl_b2t_save_final(b2run *r, const b2pos *p) {
    b2gathered g;
    memset(&g, 0, sizeof g);
    /* every rank gathers (FSDP: the parameters; full fine-tuning under ZeRO / FSDP: the state), rank 0 writes */
    fl_status s = r->lora ? (fl_b2t_fsdp(r) ? gather_params(r, g.p) : FL_OK) : gather_state(r, &g);
    const b2step st = {p, &g};
    if (s == FL_OK && !r->rank) s = save_folder(r, "final", fill_final, &st);
    gathered_free(&g);
    return s;
}

static const char *meta_of(const fl_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta_keys[i], key)) return f->meta_vals[i];
    return "";
}

/* A tensor of the state into device memory (an optimizer's state through it: fl_optim_state_write). */
static fl_status load_tensor(b2run *r, const fl_st_file *f, const char *path, const char *name, void *dst, size_t n,
                             fl_dtype dt, const fl_optimizer *o) {
    const fl_st_tensor *t = fl_st_find(f, name);
    const size_t es = fl_dtype_size(dt);
    if (!t || t->dtype != dt || t->end - t->begin != n * es)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor %s is %s (this run has %zu elements of it: another run's "
                         "checkpoint?)", path, name, t ? "of another size or dtype" : "missing", n);
    if (!dst) return FL_OK;
    /* an optimizer's state: this rank's range of it (ZeRO: its chunk; else all of it) */
    return o ? fl_optim_state_write(o, dst, (const char *)t->data + o->shard.off * es, o->shard.len * es)
             : FL_RUN(&r->be, to_device, dst, t->data, n * es);
}

/* FSDP: this rank's pieces (one per unit of part k) of a whole-part tensor into its shard dst (parameters through the
 * backend; an optimizer's state through fl_optim_state_write). */
static fl_status load_pieces(b2run *r, int k, const fl_st_file *f, const char *path, const char *name, void *dst,
                             fl_dtype dt, const fl_optimizer *o) {
    const fl_model *m = fl_blip2_part(r->b, k);
    const fl_st_tensor *t = fl_st_find(f, name);
    const size_t es = fl_dtype_size(dt), n = m->layout.numel;
    if (!t || t->dtype != dt || t->end - t->begin != n * es)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor %s is %s (this run has %zu elements of it: another run's "
                         "checkpoint?)", path, name, t ? "of another size or dtype" : "missing", n);
    const int G = m->layout.n_groups;
    /* parameter offload: the parameters' shard is host memory of the tier's backend */
    const fl_backend *pbe = r->pdp[k].ptier.be ? r->pdp[k].ptier.be : &r->be;
    size_t *fo = calloc((size_t)G * 3, sizeof *fo);
    if (!fo) return fl_errorf(FL_ERR_OOM, "out of host memory");
    size_t *so = fo + G, *len = fo + 2 * G;
    fl_status s = fl_fsdp_ranges(&r->pdp[k], fo, so, len) == G ? FL_OK : fl_errorf(FL_ERR_INTERNAL, "FSDP ranges");
    for (int g = 0; s == FL_OK && g < G; g++) {
        const char *src = (const char *)t->data + fo[g] * es;
        char *d = (char *)dst + so[g] * es;
        if (len[g]) s = o ? fl_optim_state_write(o, d, src, len[g] * es) : FL_RUN(pbe, to_device, d, src, len[g] * es);
    }
    free(fo);
    return s;
}

/* --resume true|auto (the newest committed step-* in out_dir; auto: none is a fresh start) or a checkpoint folder:
 * the trained parts' parameters and optimizer state, the data position; the run's shape must be the checkpoint's. */
fl_status fl_b2t_resume(b2run *r, b2pos *p, int *resumed) {
    const char *rs = r->cfg->resume;
    char dir[4096], path[4200];
    *resumed = 0;
    if (!rs[0] || !strcmp(rs, "false")) return FL_OK;
    if (!strcmp(rs, "true") || !strcmp(rs, "auto")) {
        fl_status s = fl_ckpt_find_latest(r->cfg->out_dir, dir, sizeof dir);
        if (s == FL_ERR_NOT_FOUND && !strcmp(rs, "auto")) return FL_OK;
        if (s != FL_OK) return fl_error_prefix(s, "--resume %s", rs);
    } else {
        snprintf(dir, sizeof dir, "%s", rs);
    }
    if (!fl_ckpt_is_committed(dir))
        return fl_errorf(FL_ERR_NOT_FOUND, "--resume %s: not a committed checkpoint (no COMMITTED file)", dir);
    /* another model's or another run's checkpoint is refused before anything is read, as the trainer's */
    char notes[4096];
    FL_TRY(fl_ckpt_check_resume_blip2(dir, r->cfg, fl_blip2_get_config(r->b), notes, sizeof notes));
    FL_TRY(fl_fs_join(path, sizeof path, dir, B2_STATE));
    if (!fl_fs_is_file(path)) /* a LoRA run's final/ (the merged model and adapter/), as the trainer's: no state */
        return fl_errorf(FL_ERR_NOT_FOUND, "--resume %s: no training state (%s) there: a LoRA run's final/ folder holds "
                         "the merged model and its adapter only; resume from a step-* checkpoint", dir, B2_STATE);
    fl_st_file f;
    FL_TRY(fl_error_prefix(fl_st_open(&f, path), "--resume"));
    char want[32];
    snprintf(want, sizeof want, "%d", r->parts | (r->lora ? 8 : 0));
    fl_status s = FL_OK;
    if (strcmp(meta_of(&f, "format"), B2_FORMAT))
        s = fl_errorf(FL_ERR_FORMAT, "%s: not a BLIP-2 training state (format '%s')", path, meta_of(&f, "format"));
    else if (strcmp(meta_of(&f, "parts"), want))
        s = fl_errorf(FL_ERR_INVALID, "%s: saved by a run training other parts (blip2.train or LoRA changed)", path);
    else if (strtoull(meta_of(&f, "records"), NULL, 10) != r->n_rec)
        s = fl_errorf(FL_ERR_INVALID, "%s: saved with %s training records, this run has %zu (data changed)", path,
                      meta_of(&f, "records"), r->n_rec);
    else if (strcmp(meta_of(&f, "optimizer"), fl_optim_name(r->cfg->optimizer.kind)))
        s = fl_errorf(FL_ERR_INVALID, "%s: saved with optimizer %s, this run uses %s", path, meta_of(&f, "optimizer"),
                      fl_optim_name(r->cfg->optimizer.kind));
    for (int k = 0; s == FL_OK && k < FL_BLIP2_PARTS; k++) {
        if (!r->has_opt[k]) continue;
        fl_optimizer *o = &r->opt[k];
        void *dst[4] = {o->w.p, o->st.m, o->st.v, o->st.buf};
        static const char *const what[4] = {"params", "exp_avg", "exp_avg_sq", "momentum_buffer"};
        for (int j = 0; s == FL_OK && j < 4; j++) {
            char name[48];
            snprintf(name, sizeof name, "%s.%s", k_part[k], what[j]);
            if (dst[j] && r->pdp[k].fsdp) /* FULL_SHARD: this rank's pieces of the one-process tensor */
                s = load_pieces(r, k, &f, path, name, dst[j], j ? state_dt(o) : o->w.pt, j ? o : NULL);
            else if (dst[j]) s = load_tensor(r, &f, path, name, dst[j], o->w.n, j ? state_dt(o) : o->w.pt, j ? o : NULL);
        }
        char name[48];
        snprintf(name, sizeof name, "%s.state8", k_part[k]);
        const fl_st_tensor *t8 = o->q8.state && r->pdp[k].fsdp ? fl_st_find(&f, name) : NULL;
        if (s == FL_OK && o->q8.state && r->pdp[k].fsdp) /* FULL_SHARD: this rank's pieces of the one-process layout */
            s = !t8 || t8->dtype != FL_U8 ? fl_errorf(FL_ERR_FORMAT, "%s: tensor %s is missing or not U8", path, name)
                                          : fl_error_prefix(take8(r, k, t8->data, t8->end - t8->begin), "%s: %s", path, name);
        else if (s == FL_OK && o->q8.state) s = load_tensor(r, &f, path, name, o->q8.state, o->q8.state_bytes, FL_U8, NULL);
        o->step = atoi(meta_of(&f, "optimizer_step"));
        fl_model_sync_compute_copy(fl_blip2_part(r->b, k)); /* bf16-mixed: the copy of the restored weights */
    }
    if (s == FL_OK) s = load_tensor(r, &f, path, "order", NULL, r->n_rec, FL_I64, NULL);
    if (s == FL_OK) {
        const int64_t *ord = fl_st_find(&f, "order")->data;
        for (size_t i = 0; i < r->n_rec; i++) p->order[i] = (size_t)ord[i];
        p->step = atol(meta_of(&f, "step"));
        p->epoch = atol(meta_of(&f, "epoch"));
        p->pos = (size_t)strtoull(meta_of(&f, "pos"), NULL, 10);
        p->epoch_sum = strtod(meta_of(&f, "epoch_sum"), NULL);
        p->epoch_n = atol(meta_of(&f, "epoch_n"));
        p->tokens = atoll(meta_of(&f, "tokens")); /* absent in an older checkpoint: 0 */
        fl_b2t_say(r, "Resuming training from %s (step %ld)\n%s", dir, p->step, notes);
        *resumed = 1;
    }
    fl_st_close(&f);
    return s;
}
