/* The trainer's set-up and tear-down: model, tokenizer, data, schedule, gradients, optimizer,
 * activations, the step's buffers (src/train/trainer-impl.h). */
#include <dirent.h>
#include <limits.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer-impl.h"
#include "resume_check.h"
#include "core/fs.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/tokenizer.h"

/* A setting the run adjusts is said, never changed without a word (printed with the run's header). */
static void add_note(trainer *t, const char *fmt, ...) {
    size_t o = strlen(t->notes);
    if (o + 8 >= sizeof t->notes) return;
    va_list ap;
    va_start(ap, fmt);
    o += (size_t)snprintf(t->notes + o, sizeof t->notes - o, "note: ");
    if (o < sizeof t->notes) vsnprintf(t->notes + o, sizeof t->notes - o, fmt, ap);
    va_end(ap);
    o = strlen(t->notes);
    if (o + 1 < sizeof t->notes) t->notes[o] = '\n', t->notes[o + 1] = 0;
}

int fl_tr_dir_has_run(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while ((e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, "step-", 5) || !strcmp(e->d_name, "final") || !strcmp(e->d_name, "logs") ||
            !strcmp(e->d_name, FL_CKPT_BASE))
            found = 1;
    closedir(d);
    return found;
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

/* name is a whole item of the comma-separated list */
static int list_has(const char *list, const char *name) {
    const size_t n = strlen(name);
    for (const char *q = list; *q;) {
        if (!strncmp(q, name, n) && (q[n] == ',' || !q[n])) return 1;
        const char *comma = strchr(q, ',');
        if (!comma) break;
        q = comma + 1;
    }
    return 0;
}

/* LitGPT's lora_* switches (or a PEFT target list) -> an fl_lora_config. */
fl_status fl_trainer_lora_config(const fl_run_config *c, const fl_model_config *mc, fl_lora_config *lc) {
    char t[256] = "";
    const fl_lora_args *a = &c->lora;
    if (a->target_modules[0]) {
        snprintf(t, sizeof t, "%s", a->target_modules);
    } else {
        /* each switch's targets in the architecture's names (fl_arch_info.lora_switch), each module once, in
         * switch order (GPT-2: q, k, v are all c_attn, trained in the enabled parts only: qkv_parts below;
         * projection attn.c_proj, mlp c_fc and mlp.c_proj) */
        const fl_arch_info *ai = fl_arch_get(mc->arch);
        const int on[5] = {a->query, a->key, a->value, a->projection, a->mlp};
        size_t o = 0;
#define ADD(name) o += (size_t)snprintf(t + o, sizeof t - o, "%s%s", o ? "," : "", name)
        for (int k = 0; k < 5; k++) {
            if (!on[k]) continue;
            char list[128];
            snprintf(list, sizeof list, "%s", ai->lora_switch[k]);
            for (char *save = NULL, *name = strtok_r(list, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
                if (!list_has(t, name)) ADD(name);
            }
        }
        if (a->head) ADD("lm_head");
#undef ADD
    }
    if (!t[0]) return fl_errorf(FL_ERR_INVALID, "finetune_lora: no target modules (set lora_query/lora_value/... or lora_target_modules)");
    FL_TRY(fl_lora_config_init(lc, mc, a->r, a->alpha, a->dropout, a->use_rslora, t));
    /* a fused q|k|v (the same target for the three switches: GPT-2's c_attn): LitGPT's LoRAQKVLinear trains the
     * enabled parts alone; PEFT adapts the whole module, so the others' lora_B rows are frozen at 0 in it */
    const fl_arch_info *ai = fl_arch_get(mc->arch);
    const unsigned qkv = (a->query ? 1u : 0u) | (a->key ? 2u : 0u) | (a->value ? 4u : 0u);
    if (!a->target_modules[0] && qkv && qkv != 7u && !strcmp(ai->lora_switch[0], ai->lora_switch[1]) &&
        !strcmp(ai->lora_switch[0], ai->lora_switch[2]))
        lc->qkv_parts = qkv;
    return FL_OK;
}

/* pretrain --initial_checkpoint_dir: its config.json's shape against the model model_name / model_config build (a
 * mismatch was a tensor's shape "expected (from config.json)", the wrong file named, exit 1): a configuration error */
static fl_status initial_fits(const char *ck, const fl_model_config *mc) {
    char cp[FL_CFG_PATH + 16];
    fl_model_config kc;
    snprintf(cp, sizeof cp, "%s/config.json", ck);
    if (!fl_fs_is_file(cp) || fl_hf_load_config(cp, &kc) != FL_OK) {
        fl_error_clear(); /* no or another config.json: the weights' own checks decide */
        return FL_OK;
    }
    if (kc.vocab_size == mc->vocab_size && kc.dim == mc->dim && kc.n_layers == mc->n_layers && kc.ffn_dim == mc->ffn_dim &&
        kc.n_heads == mc->n_heads && kc.n_kv_heads == mc->n_kv_heads)
        return FL_OK;
    return fl_errorf(FL_ERR_INVALID, "initial_checkpoint_dir %s holds another shape than the model pretrain builds (%s): "
                     "its config.json has vocab %d, dim %d, %d layers, MLP %d, heads %d/%d, the run's model vocab %d, "
                     "dim %d, %d layers, MLP %d, heads %d/%d: give the model_name or model_config that matches it",
                     ck, mc->name[0] ? mc->name : "model_config", kc.vocab_size, kc.dim, kc.n_layers, kc.ffn_dim,
                     kc.n_heads, kc.n_kv_heads, mc->vocab_size, mc->dim, mc->n_layers, mc->ffn_dim, mc->n_heads,
                     mc->n_kv_heads);
}

/* The run's model. given (the planner's, fl_trainer_rehearse): that configuration, created and
 * randomly initialized as a preset is (no weights read: the loader's allocations are the random
 * init's, one 4-bit weight's fp32 staging at most). */
/* The seed in the checkpoint dir's hyperparameters.yaml into *seed; 0 when it holds none (a library caller's). */
static int ckpt_seed(const char *dir, unsigned long long *seed) {
    char p[FL_CFG_PATH + 340];
    snprintf(p, sizeof p, "%.*s/hyperparameters.yaml", FL_CFG_PATH + 300, dir);
    fl_cfg_entries e;
    fl_cfg_entries_init(&e);
    const char *v = fl_fs_is_file(p) && fl_cfg_entries_load_yaml_file(&e, p) == FL_OK ? fl_cfg_entries_value(&e, "seed")
                                                                                   : NULL;
    char *end = NULL;
    if (v) *seed = strtoull(v, &end, 10);
    const int ok = v && end != v;
    fl_cfg_entries_free(&e);
    fl_error_clear();
    return ok;
}

/* A LoRA run on random base weights (a preset, --init random, a config.json alone) that resumes with another seed than
 * its checkpoint's run: the base the checkpoint's adapters were trained on, the committed base/ beside the checkpoint
 * (the run's out_dir for --resume auto / true), into dir (room: FL_CFG_PATH); 0 when there is none (a fresh
 * run, a checkpoint of another kind of run) or the seed makes the checkpoint's base again (bit for bit: a 4-bit base
 * read back from base/, stored dequantized, would be quantized anew). */
static int resumed_base(const fl_run_config *c, char *dir) {
    char ck[FL_CFG_PATH + 300];
    if (c->command != FL_CMD_FINETUNE_LORA || !strcmp(c->resume, "false") || !c->resume[0]) return 0;
    /* --init random, a preset, a config.json alone */
    if (!c->init_random && (!c->checkpoint_dir[0] || fl_rs_has_weights(c->checkpoint_dir))) return 0;
    if (!strcmp(c->resume, "true") || !strcmp(c->resume, "auto")) {
        if (fl_ckpt_find_latest(c->out_dir, ck, sizeof ck) != FL_OK) return fl_error_clear(), 0;
    } else {
        snprintf(ck, sizeof ck, "%.*s", FL_CFG_PATH + 200, c->resume);
    }
    unsigned long long seed = 0;
    if (ckpt_seed(ck, &seed) && seed == (unsigned long long)c->seed) return 0;
    char *slash = strrchr(ck, '/');
    if (slash) *slash = 0;
    snprintf(dir, FL_CFG_PATH, "%.*s/" FL_CKPT_BASE, FL_CFG_PATH - 8, slash ? ck : ".");
    return fl_ckpt_is_committed(dir);
}

fl_status fl_tr_load_model(trainer *t, const fl_model_config *given, fl_model *m, fl_mem_pool *pool, int *ok) {
    const fl_run_config *c = t->cfg;
    fl_model_config mc;
    const char *ck = c->checkpoint_dir;
    char base[FL_CFG_PATH];
    if (!given && resumed_base(c, base)) { /* its weights, not the seed's */
        ck = base;
        if (t->out && !t->in.base_said)
            fprintf(t->out, "note: --resume: the base model's weights are random (%s%s%s): they are read from '%s', "
                    "the base the checkpoint's adapters were trained on, not made anew from seed %llu\n",
                    c->init_random ? "--init random" : "'", c->init_random ? "" : c->checkpoint_dir,
                    c->init_random ? "" : "'", base, (unsigned long long)c->seed);
        t->in.base_said = 1; /* said once (TP / PP make the whole model again to save it) */
    }
    int have_weights = 0;
    int have_cfg = 0; /* pretrain: model_config fields, a config.json, or model_name */
    if (!given && c->command == FL_CMD_PRETRAIN) FL_TRY(fl_cfg_model_config(c, &mc, &have_cfg));
    if (given) {
        FL_TRY(fl_model_init_ex(m, given, &t->hw.be, pool, &t->stg));
        *ok = 1;
        FL_TRY(fl_model_init_random_ex(m, c->seed));
    } else if (have_cfg) {
        FL_TRY(fl_model_init_ex(m, &mc, &t->hw.be, pool, &t->stg));
        *ok = 1;
        FL_TRY(fl_model_init_random_ex(m, c->seed));
        if (ck[0]) {
            FL_TRY(initial_fits(ck, &mc));
            FL_TRY(fl_hf_load_weights(m, ck));
            have_weights = 1;
        }
    } else if (ck[0] && !exists(ck)) {
        /* A preset name: random init (for speed/memory experiments without weights). */
        if (fl_fs_is_path_form(ck)) return fl_errorf(FL_ERR_NOT_FOUND, "checkpoint_dir '%s': no such file or folder", ck);
        fl_status s = fl_preset_find(ck, &mc);
        if (s != FL_OK) {
            char why[1024]; /* fl_errorf must not read the message it is writing */
            snprintf(why, sizeof why, "%s", fl_error_message());
            return fl_errorf(FL_ERR_NOT_FOUND, "checkpoint_dir '%s' is neither a model folder nor a preset (%s)", ck,
                             why);
        }
        FL_TRY(fl_model_init_ex(m, &mc, &t->hw.be, pool, &t->stg));
        *ok = 1;
        FL_TRY(fl_model_init_random_ex(m, c->seed));
    } else if (ck[0] && c->init_random && ck == c->checkpoint_dir) {
        /* --init random: the folder's (or config.json's) shape, fresh weights */
        char cp[FL_CFG_PATH + 16];
        struct stat st;
        if (stat(ck, &st) == 0 && S_ISDIR(st.st_mode)) snprintf(cp, sizeof cp, "%s/config.json", ck);
        else snprintf(cp, sizeof cp, "%s", ck);
        FL_TRY(fl_hf_load_config(cp, &mc));
        FL_TRY(fl_model_init_ex(m, &mc, &t->hw.be, pool, &t->stg));
        *ok = 1;
        FL_TRY(fl_model_init_random_ex(m, c->seed));
    } else if (ck[0]) {
        int loaded = 0;
        FL_TRY(fl_model_load_auto_ex(m, ck, &t->hw.be, pool, &t->stg, &loaded));
        *ok = 1;
        have_weights = loaded;
        if (!loaded) FL_TRY(fl_model_init_random_ex(m, c->seed));
    } else {
        return fl_errorf(FL_ERR_INVALID, "no model: give checkpoint_dir%s",
                         c->command == FL_CMD_PRETRAIN ? ", model_name or model_config" : "");
    }
    if (have_weights && ck == c->checkpoint_dir) t->in.weights_loaded = 1; /* not a random base read back */
    /* hyperparameters.yaml's init: what happened (a from-scratch pretrain, a preset, a folder without weights, a
     * random base read back from base/: random weights; LitGPT's pretrain starts from random weights unless
     * initial_checkpoint_dir), not what was asked */
    if (!t->saved_cfg && !(t->saved_cfg = malloc(sizeof *t->saved_cfg))) return fl_errorf(FL_ERR_OOM, "out of host memory");
    *t->saved_cfg = *c;
    t->saved_cfg->init_random = !have_weights || ck != c->checkpoint_dir;
    if (c->train.tie_embeddings >= 0 && c->train.tie_embeddings != m->cfg.tie_embeddings)
        return fl_errorf(FL_ERR_UNSUPPORTED, "train.tie_embeddings=%d differs from the model's tie_word_embeddings=%d",
                         c->train.tie_embeddings, m->cfg.tie_embeddings);
    return FL_OK;
}

/* Tokenizer: the model folder's, an explicit tokenizer_dir, or the built-in bytes. */
fl_status fl_tr_load_tokenizer(trainer *t) {
    const fl_run_config *c = t->cfg;
    const char *ck = c->checkpoint_dir;
    const char *td = c->tokenizer_dir[0] ? c->tokenizer_dir : NULL;
    char beside[FL_CFG_PATH];
    if (!td && ck[0] && exists(ck)) {
        struct stat st;
        if (stat(ck, &st) == 0 && S_ISDIR(st.st_mode)) {
            td = ck;
        } else { /* a model file (llama2.c's stories260K.bin): the tokenizer beside it (tok512.bin) */
            const char *slash = strrchr(ck, '/');
            snprintf(beside, sizeof beside, "%.*s", slash ? (int)(slash - ck) : 1, slash ? (slash == ck ? "/" : ck) : ".");
            if (fl_io_has_tokenizer(beside)) td = beside;
        }
    }
    if (td) {
        FL_TRY(fl_tok_load(&t->in.tok, td));
        snprintf(t->in.tok_dir, sizeof t->in.tok_dir, "%s", td);
    } else {
        FL_TRY(fl_tok_builtin_bytes(&t->in.tok));
        /* pretrained weights (a llama2.c .bin alone) learned another vocabulary: the bytes' ids would train them on
         * the wrong tokens (and "diverge"); refused as generate refuses it. Random weights (presets) keep the bytes;
         * a model of exactly the bytes' vocabulary may have been trained with them. */
        if (t->in.weights_loaded && t->model.cfg.vocab_size != fl_tok_vocab_size(t->in.tok))
            return fl_errorf(FL_ERR_NOT_FOUND, "%s: no tokenizer found beside the model file (tokenizer.json, "
                             "tokenizer.model, spiece.model or tok*.bin), and its pretrained weights (vocab_size %d) "
                             "do not use the built-in byte tokenizer: give the model's with --tokenizer_dir (a folder "
                             "or a file such as tok512.bin)",
                             ck[0] ? ck : "the model", t->model.cfg.vocab_size);
    }
    if (fl_tok_vocab_size(t->in.tok) > t->model.cfg.vocab_size)
        return fl_errorf(FL_ERR_INVALID, "tokenizer (%s, %d ids%s%s%s) does not fit the model's vocab_size %d%s",
                         fl_tok_kind(t->in.tok), fl_tok_vocab_size(t->in.tok), td ? ", from '" : "", td ? td : "",
                         td ? "'" : "", t->model.cfg.vocab_size, td && td == beside ? "; give the model's with "
                         "--tokenizer_dir" : "");
    /* the ids that end the evaluation sample, as generate's: the model folder's generation_config.json eos_token_id
     * (else config.json's) and the tokenizer's; an encoder-decoder's sample reads them from the model */
    FL_TRY(fl_hf_stop_ids(ck[0] ? ck : NULL, t->in.tok, t->in.stop_ids, FL_MODEL_MAX_EOS, &t->in.n_stop, NULL));
    fl_model_set_eos_ids(&t->model, t->in.stop_ids, t->in.n_stop);
    return FL_OK;
}


/* An encoder-decoder's data: the pairs of data.json_path (fl_s2s_load, cut to data.max_source_length /
 * max_target_length tokens: 512 / 128 as HF's run_summarization; train.max_seq_length, LitGPT's sample limit, caps
 * the source too), tokenized by the model folder's tokenizer; the decoder starts
 * from config.json's decoder_start_token_id. (B, Ts, T): the longest source and target. */
static fl_status load_data_s2s(trainer *t) {
    const fl_run_config *c = t->cfg;
    if (c->data.kind != FL_DATA_JSON || !c->data.json_path[0])
        return fl_errorf(FL_ERR_UNSUPPORTED, "an encoder-decoder (%s) trains on input/output pairs: give --data JSON "
                         "--data.json_path FILE (.json or .jsonl records with \"input\" and \"output\"); --data %s is "
                         "not supported for it", t->model.cfg.name, fl_data_kind_name(c->data.kind));
    fl_s2s_config sc;
    fl_s2s_config_default(&sc);
    sc.max_source_length = fl_s2s_source_limit(c->data.max_source_length, c->train.max_seq_length);
    sc.max_target_length = c->data.max_target_length;
    fl_s2s_data *all = NULL;
    FL_TRY(fl_s2s_load(&all, c->data.json_path, &sc, t->in.tok));
    size_t n = fl_s2s_count(all);
    if (!n) {
        fl_s2s_free(all);
        return fl_errorf(FL_ERR_INVALID, "'%s' holds no pairs", c->data.json_path);
    }
    int ls = 1, lt = 1; /* the arena: the longest of either split (validation runs in it too) */
    for (size_t i = 0; i < n; i++) {
        const int32_t *a, *b;
        int na, nb;
        fl_s2s_get(all, i, &a, &na, &b, &nb);
        if (na > ls) ls = na;
        if (nb > lt) lt = nb;
    }
    /* the validation split: LitGPT's random_split of the file (fl_s2s_split), as the decoder-only JSON data */
    fl_status s = fl_s2s_split(all, c->data.val_split_fraction, c->seed, &t->in.s2s, &t->in.s2s_vdata);
    fl_s2s_free(all);
    FL_TRY(s);
    if (!fl_s2s_count(t->in.s2s))
        return fl_errorf(FL_ERR_INVALID, "'%s': data.val_split_fraction %g leaves no training pairs of %zu",
                         c->data.json_path, (double)c->data.val_split_fraction, n);
    /* T5's dropout (config.json dropout_rate) in the training passes (fl_model_set_dropout before the arena), where
     * transformers drops: said once, since it changes what training computes */
    if (t->model.cfg.dropout_rate > 0)
        add_note(t, "config.json dropout_rate %g is applied in training (embeddings, attention weights, sublayer "
                 "outputs, FFN, final norms; not in evaluation or generation)", (double)t->model.cfg.dropout_rate);
    t->sch.B = c->train.micro_batch_size;
    t->sch.Ts = ls;
    t->sch.T = lt;
    int pad = t->model.cfg.pad_id, start = t->model.cfg.dec_start_id;
    if (fl_s2s_count(t->in.s2s_vdata))
        FL_TRY(fl_s2s_loader_init(&t->in.s2s_val, t->in.s2s_vdata, t->sch.B, pad, start, c->seed, 0));
    return fl_s2s_loader_init(&t->in.s2s_train, t->in.s2s, t->sch.B, pad, start, c->seed, 1);
}

fl_status fl_tr_check_s2s(const trainer *t, const fl_precision *prec, const fl_strategy_choice *sc) {
    const fl_run_config *c = t->cfg;
    const char *m = t->model.cfg.name[0] ? t->model.cfg.name : "encoder-decoder";
    if (!fl_model_is_s2s(&t->model.cfg)) return FL_OK;
    /* every policy runs: the mixed ones read the compute-dtype copy of the weights in the matmuls, the *-true ones
     * store the parameters in 16 bits (seq2seq.c stages them), all 16-bit ones save the blocks' activations in their
     * dtype; fp16 (16-true, 16-mixed) scales the loss dynamically as a decoder-only model (a step whose gradients
     * overflow is skipped and the scale halved) */
    /* every strategy runs: DDP and ZeRO-1/2 (the optimizer offloaded too) keep the whole model on every rank;
     * FULL_SHARD / ZeRO-3 (and its parameter offload) shard it, the passes (seq2seq.c) gathering each layout group
     * (a block of either stack) around its use */
    /* T5's pipeline stages run every schedule, strategy and offload, TP and SP inside the interleaved one too
     * (tests/test_tp_t5_train.c, mpi_t5_test.sh) */
    if (c->command == FL_CMD_PRETRAIN)
        return fl_errorf(FL_ERR_UNSUPPORTED, "pretrain: an encoder-decoder (%s) is fine-tuned only (finetune_full, "
                         "finetune_lora) so far", m);
    return FL_OK;
}

size_t fl_tr_batches_per_epoch(const trainer *t) {
    if (t->in.s2s) return (fl_s2s_count(t->in.s2s) + (size_t)t->sch.B - 1) / (size_t)t->sch.B;
    return fl_loader_batches_per_epoch(t->in.train);
}

void fl_tr_loader_get_state(const trainer *t, fl_loader_state *s) {
    if (t->in.s2s_train) fl_s2s_loader_get_state(t->in.s2s_train, s);
    else fl_loader_get_state(t->in.train, s);
}

fl_status fl_tr_loader_set_state(trainer *t, const fl_loader_state *s) {
    return t->in.s2s_train ? fl_s2s_loader_set_state(t->in.s2s_train, s) : fl_loader_set_state(t->in.train, s);
}

/* The samples not used whole: cut to train.max_seq_length tokens by the dataset (its count), or to T + 1 tokens (T
 * inputs and the last one's target) by the loader where the model's context is shorter (max_seq_length null or more
 * than the context). A sample the dataset cut is longer than T + 1 whenever the loader cuts any (T is then the context,
 * below max_seq_length), so the count is the loader's when it cuts, else the dataset's. The notes say what was given
 * and what is used. */
static void count_cuts(trainer *t, fl_data_kind kind, int T, int longest) {
    const int ctx = t->model.cfg.max_seq, msl = t->cfg->train.max_seq_length;
    size_t over = 0;
    for (int s = 0; s < FL_SPLIT_COUNT; s++)
        for (size_t i = 0; i < fl_data_count(t->in.data, (fl_split)s); i++)
            over += fl_data_get(t->in.data, (fl_split)s, i)->len > T + 1;
    t->in.n_cut = over ? over : fl_data_get_stats(t->in.data)->n_truncated;
    t->in.cut_to = over ? T + 1 : msl;
    t->in.cut_by_ctx = over > 0;
    if (kind != FL_DATA_TEXTFILES && t->in.n_cut) { /* instruction samples cut inside their prompt: no response left */
        const size_t n = fl_data_count(t->in.data, FL_SPLIT_TRAIN);
        size_t bare = 0;
        for (size_t i = 0; i < n; i++) {
            const fl_sample *x = fl_data_get(t->in.data, FL_SPLIT_TRAIN, i);
            bare += x->prompt_len >= (x->len < T + 1 ? x->len : T + 1); /* prompt_len: the prompt's tokens kept */
        }
        if (bare)
            add_note(t, "%zu of the %zu training samples keep none of their response: cut to %d tokens inside their "
                     "prompt (prompt style %s), they train on the prompt alone%s; give a train.max_seq_length above "
                     "the prompts' length", bare, n, t->in.cut_to, t->cfg->data.prompt_style,
                     bare == n ? " (every one: the same template text step after step)" : "");
    }
    if (kind == FL_DATA_TEXTFILES) {
        if (msl > ctx)
            add_note(t, "train.max_seq_length %d is more than the model's %d positions (its context): the text is cut "
                     "into blocks of %d tokens (%d inputs) instead of %d", msl, ctx, ctx + 1, ctx, msl + 1);
    } else if (msl > ctx + 1) {
        add_note(t, "train.max_seq_length %d is more than the model's %d positions (its context): samples longer than "
                 "%d tokens (%d inputs and the last one's target) are cut to that, not to %d tokens: %zu of them",
                 msl, ctx, ctx + 1, ctx, msl, over);
    } else if (msl == ctx + 1) {
        add_note(t, "train.max_seq_length %d is more than the model's %d positions (its context), but a sample of %d "
                 "tokens has %d inputs (its last token is only a target): the limit is used as given", msl, ctx, msl, ctx);
    } else if (msl <= 0 && longest - 1 > ctx) { /* null: the longest sample would decide */
        add_note(t, "the longest sample has %d input tokens, more than the model's %d positions (its context): "
                 "samples longer than %d tokens (%d inputs and the last one's target) are cut to that "
                 "(train.max_seq_length null): %zu of them", longest - 1, ctx, ctx + 1, ctx, over);
    }
}

fl_status fl_tr_load_data(trainer *t) {
    const fl_run_config *c = t->cfg;
    if (fl_model_is_s2s(&t->model.cfg)) return load_data_s2s(t);
    fl_data_config dc = c->data;
    dc.max_seq_length = c->train.max_seq_length;
    /* LitGPT's pretrain cuts the token stream into blocks of the model's context
     * (model.max_seq_length = block_size) unless train.max_seq_length says less */
    if (dc.kind == FL_DATA_TEXTFILES && dc.max_seq_length <= 0) dc.max_seq_length = t->model.cfg.max_seq;
    const int ctx = t->model.cfg.max_seq;
    /* LitGPT's pretrain: min(train.max_seq_length, block_size); longer blocks would only be cut */
    if (c->train.max_seq_length > ctx && dc.kind == FL_DATA_TEXTFILES) dc.max_seq_length = ctx;
    if (dc.kind == FL_DATA_ALPACA && !dc.json_path[0])
        snprintf(dc.json_path, sizeof dc.json_path, "data/alpaca/alpaca_data_cleaned_archive.json");
    FL_TRY(fl_data_load(&t->in.data, &dc, t->in.tok));
    if (fl_data_count(t->in.data, FL_SPLIT_TRAIN) == 0) return fl_errorf(FL_ERR_INVALID, "the training split is empty");
    /* Longest sample decides the activation arena (LitGPT sets model.max_seq_length the same way). */
    int longest = 2;
    for (int s = 0; s < FL_SPLIT_COUNT; s++)
        for (size_t i = 0; i < fl_data_count(t->in.data, (fl_split)s); i++) {
            int n = fl_data_get(t->in.data, (fl_split)s, i)->len;
            if (n > longest) longest = n;
        }
    int T = longest - 1; /* inputs are the sample minus its last token */
    if (c->train.max_seq_length > 0 && T > c->train.max_seq_length) T = c->train.max_seq_length;
    if (T > t->model.cfg.max_seq) T = t->model.cfg.max_seq;
    count_cuts(t, dc.kind, T, longest);
    t->sch.T = T;
    t->sch.B = c->train.micro_batch_size;
    /* every target masked (an empty response with mask_prompt, responses cut away by
     * max_seq_length): the loss is 0/0 and nothing would be learnt; say so before training */
    size_t n_train = fl_data_count(t->in.data, FL_SPLIT_TRAIN), n_targets = 0;
    for (size_t i = 0; i < n_train && !n_targets; i++) {
        const fl_sample *sm = fl_data_get(t->in.data, FL_SPLIT_TRAIN, i);
        for (int j = 1; j < sm->len && j <= T; j++) n_targets += sm->labels[j] != dc.ignore_index;
    }
    if (!n_targets)
        return fl_errorf(FL_ERR_INVALID,
                         "nothing to learn from: every target token of the %zu training samples is masked "
                         "(ignore_index %d)%s; check data.mask_prompt, the responses of the dataset and "
                         "train.max_seq_length", n_train, dc.ignore_index,
                         t->in.n_cut ? ", some after truncation (the data line's count)" : "");
    FL_TRY(fl_loader_init(&t->in.train, t->in.data, FL_SPLIT_TRAIN, t->sch.B, T, c->seed, 1));
    if (fl_data_count(t->in.data, FL_SPLIT_VAL) > 0) FL_TRY(fl_loader_init(&t->in.val, t->in.data, FL_SPLIT_VAL, t->sch.B, T, c->seed, 0));
    return FL_OK;
}

/* One line per split: "NAME: N samples, T tokens, fingerprint HEX" (fl_data_fingerprint: the ids, labels and
 * sample boundaries as tokenized). */
static void describe_split(FILE *f, const char *name, const fl_dataset *d, fl_split sp) {
    size_t n = fl_data_count(d, sp), tok = 0;
    for (size_t i = 0; i < n; i++) tok += (size_t)fl_data_get(d, sp, i)->len;
    fprintf(f, "%s: %zu samples, %zu tokens, fingerprint %016llx\n", name, n, tok,
            (unsigned long long)fl_data_fingerprint(d, sp));
}

static void describe_pairs(FILE *f, const char *name, const fl_s2s_data *d) {
    size_t tok = 0;
    for (size_t i = 0; i < fl_s2s_count(d); i++) {
        const int32_t *a, *b;
        int na, nb;
        fl_s2s_get(d, i, &a, &na, &b, &nb);
        tok += (size_t)na + (size_t)nb;
    }
    fprintf(f, "%s: %zu pairs, %zu tokens, fingerprint %016llx\n", name, fl_s2s_count(d), tok,
            (unsigned long long)fl_s2s_fingerprint(d));
}

/* "OPTION 'PATH' (ABSOLUTE)": a data path as this rank resolves it (relative to its working directory). */
static size_t name_path(char *buf, size_t n, const char *option, const char *path) {
    char abs[PATH_MAX];
    const char *r = realpath(path, abs);
    int w = snprintf(buf, n, "%s '%s'%s%s%s", option, path, r && strcmp(r, path) ? " (" : "",
                     r && strcmp(r, path) ? r : "", r && strcmp(r, path) ? ")" : r ? "" : " (missing here)");
    return w < 0 ? 0 : (size_t)w < n ? (size_t)w : n - 1;
}

fl_status fl_tr_check_data(trainer *t) {
    if (!t->dp.grid && !t->dp.comm) return FL_OK; /* one rank */
    const fl_data_config *dc = &t->cfg->data;
    char *mine = NULL, files[3 * FL_CFG_PATH + 64];
    size_t len = 0;
    FILE *f = open_memstream(&mine, &len);
    if (!f) return fl_errorf(FL_ERR_OOM, "out of host memory");
    if (t->in.s2s) {
        describe_pairs(f, "training set", t->in.s2s);
        describe_pairs(f, "validation set", t->in.s2s_vdata);
    } else {
        describe_split(f, "training set", t->in.data, FL_SPLIT_TRAIN);
        describe_split(f, "validation set", t->in.data, FL_SPLIT_VAL);
    }
    fclose(f);
    /* the files this rank read, for the message (the command line, compared already, gives the same names) */
    size_t o = 0;
    if (t->in.s2s || dc->kind == FL_DATA_ALPACA || dc->kind == FL_DATA_JSON) {
        const char *jp = dc->json_path[0] ? dc->json_path : "data/alpaca/alpaca_data_cleaned_archive.json";
        o = name_path(files, sizeof files, "data.json_path", jp);
    } else if (dc->kind == FL_DATA_TEXTFILES) {
        o = name_path(files, sizeof files, "data.train_data_path", dc->train_data_path);
        if (dc->val_data_path[0] && o + 8 < sizeof files) {
            o += (size_t)snprintf(files + o, sizeof files - o, " and ");
            o += name_path(files + o, sizeof files - o, "data.val_data_path", dc->val_data_path);
        }
    } else {
        o = (size_t)snprintf(files, sizeof files, "the Synthetic data");
        if (dc->lengths[0]) name_path(files + o, sizeof files - o, " of data.lengths", dc->lengths);
    }
    if (dc->cache_dir[0] && o < sizeof files)
        name_path(files + strlen(files), sizeof files - strlen(files), " through data.cache_dir", dc->cache_dir);
    fl_status s = fl_dp_check_data(&t->dp, mine, files);
    free(mine);
    return s;
}

void fl_tr_schedule(trainer *t) {
    const fl_train_args *a = &t->cfg->train;
    t->sch.accum = a->global_batch_size / fl_cfg_dp_ranks(t->cfg) / a->micro_batch_size;
    t->sch.G = t->sch.accum * t->dp.world;
    long bpe = (long)fl_tr_batches_per_epoch(t);
    t->sch.steps_per_epoch = bpe / t->sch.G > 0 ? bpe / t->sch.G : 1;
    long ms = -1;
    if (a->epochs > 0) ms = a->epochs * t->sch.steps_per_epoch;
    if (a->max_steps >= 0 && (ms < 0 || a->max_steps < ms)) ms = a->max_steps;
    if (a->max_tokens > 0) { /* LitGPT's max_tokens // tokens per step: never past the limit (at least one step) */
        const long long per = (long long)a->global_batch_size * t->sch.T;
        long by_tokens = (long)(a->max_tokens / per);
        if (by_tokens < 1) by_tokens = 1;
        if (ms < 0 || by_tokens < ms) {
            ms = by_tokens;
            if (a->max_tokens % per)
                add_note(t, "train.max_tokens %lld is %ld step%s of %lld tokens (global batch %d x T %d) = %lld tokens%s",
                         (long long)a->max_tokens, by_tokens, by_tokens == 1 ? "" : "s", per, a->global_batch_size,
                         t->sch.T, per * by_tokens, per > a->max_tokens ? ": less than one step, one is run" :
                         " (LitGPT's max_tokens // tokens per step: the part step left is not run)");
        }
    }
    if (ms < 0) ms = t->sch.steps_per_epoch;
    t->sch.max_steps = ms;
    long w = 0;
    if (a->lr_warmup_fraction >= 0) w = (long)ceil(a->lr_warmup_fraction * t->sch.steps_per_epoch);
    else if (a->lr_warmup_steps > 0) w = a->lr_warmup_steps;
    t->sch.warmup = w < ms ? w : ms;
    if (w > ms)
        add_note(t, "the warm-up of %ld steps (%s) is longer than the run's %ld steps: it is cut to %ld (LitGPT's "
                 "min(max_iters, warm-up)), so the learning rate reaches optimizer.lr at the last step and never "
                 "decays", w, a->lr_warmup_fraction >= 0 ? "train.lr_warmup_fraction" : "train.lr_warmup_steps", ms,
                 ms);
    /* bpe < G (fewer micro-batches than one step): said once with the data (trainer_out.c) */
}

fl_status fl_trainer_storage(const fl_run_config *c, const fl_precision *p, fl_model_storage *st) {
    fl_model_storage_for(p, st);
    if (c->command != FL_CMD_FINETUNE_LORA || !c->lora.quantize[0]) return FL_OK;
    fl_q4_type qt;
    FL_TRY(fl_q4_parse_mode(c->lora.quantize, &qt, &st->q4_double_quant));
    st->quant4 = 1; /* QLoRA: the blocks' linear weights in 4 bits */
    st->q4_type = qt;
    return FL_OK;
}

/* ---- the pieces fl_trainer_run and fl_trainer_rehearse share ------------------------------
 * The planner runs these same functions on the null backend (fl_trainer_rehearse): whatever
 * they allocate is what the plan shows, so a change here is planned without touching plan.c. */

/* "model load": the model (given: see load_model), its precision policy's compute copy, then
 * the after_load snapshot (the weights alone). */
fl_status fl_tr_setup_model(trainer *t, const fl_precision *prec, const fl_model_config *given) {
    fl_mem_set_phase(&t->hw.pool, "model load");
    if (t->tp.size > 1) FL_TRY(fl_tr_tp_load(t, given)); /* the whole model outside the pool, then the slice */
    else if (t->pp.size > 1) FL_TRY(fl_tr_pp_load(t, given)); /* the same, then the stage's blocks */
    else FL_TRY(fl_tr_load_model(t, given, &t->model, &t->hw.pool, &t->model_ok));
    FL_TRY(fl_model_set_precision(&t->model, prec));
    fl_mem_snapshot(&t->hw.pool, "after_load");
    return FL_OK;
}

/* CPU offload (ZeRO-Offload, --strategy deepspeed_stage_{1,2}_offload): the host tier, from the backend's
 * host_pool_init (cuda: page-locked memory; null: counted fake addresses) without a budget, and the backend
 * the update runs on: the run's own where its memory is host memory (cpu, ref, cuda-emu) or where it
 * computes nothing (the planner's null), else a CPU backend with the run's threads. */
fl_status fl_tr_setup_offload(trainer *t, const fl_strategy_choice *sc) {
    if (!sc->offload || t->hw.opool_ok) return FL_OK; /* parameter offload makes it before the model: once */
    const fl_backend *be = &t->hw.be;
    FL_TRY(be->host_pool_init ? be->host_pool_init(be, &t->hw.opool, "host (offload)", 0)
                              : fl_mem_pool_init(&t->hw.opool, "host (offload)", 0));
    t->hw.opool_ok = 1;
    if (fl_backend_host_memory(be) || fl_backend_discards(be)) {
        t->hw.off.be = be;
    } else {
        FL_TRY(fl_error_prefix(fl_cpu_backend_init(&t->hw.hbe, t->cfg->threads), "CPU offload: the host's optimizer"));
        t->hw.hbe_ok = 1;
        t->hw.off.be = &t->hw.hbe;
    }
    t->hw.off.pool = &t->hw.opool;
    t->dp.offload = &t->hw.off;
    t->dp.update_overlap = t->cfg->offload_update_overlap; /* FULL_SHARD: the units' updates beside the backward */
    if (fl_cfg_offload_nvme(t->cfg) || sc->param_offload == 2) {
        /* NVMe (ZeRO-Infinity's offload_optimizer / offload_param device nvme): files under nvme_path (out_dir by
         * default, made here: the files are unlinked at creation, so an OOM still leaves no files); the plan's
         * null backend stands it in with its counted fake addresses */
        if (fl_backend_discards(be)) {
            FL_TRY(be->host_pool_init(be, &t->hw.dpool, "nvme (offload)", 0));
        } else {
            const char *dir = t->cfg->nvme_path[0] ? t->cfg->nvme_path : t->cfg->out_dir;
            if (!t->cfg->nvme_path[0]) FL_TRY(fl_fs_mkdir_p(dir));
            FL_TRY(fl_mem_disk_pool_init(&t->hw.dpool, "nvme (offload)", dir));
        }
        t->hw.dpool_ok = 1;
        if (fl_cfg_offload_nvme(t->cfg)) t->hw.off.state_pool = &t->hw.dpool;
    }
    if (sc->param_offload) { /* the shards of the parameters and gradients in the tier, updated there in place */
        t->hw.off.params_host = 1;
        t->dp.ptier.be = t->hw.off.be;
        t->dp.ptier.pool = sc->param_offload == 2 ? &t->hw.dpool : &t->hw.opool;
        t->dp.ptier.host = &t->hw.opool;
        t->dp.ptier.disk = sc->param_offload == 2 && !fl_backend_discards(be);
        t->dp.ptier.prefetch = t->cfg->offload_prefetch;
        t->dp.ptier.overlap = t->cfg->offload_overlap;
        if (t->dp.ptier.disk) t->hw.off.param_pool = &t->hw.dpool; /* the update drops their pieces behind it */
    }
    return FL_OK;
}

/* OPT's dropout (config.json dropout, attention_dropout) in the training passes, where OPTDecoderLayer drops (masks: run
 * seed, global micro-batch, block, site, element; fl_model_set_dropout before the arena). One process's masks on every
 * grid: a tensor-parallel rank draws its heads' attention-weight masks at the whole's indices (exec.c attn_tp_drop) and
 * the o / fc2 outputs' after their all-reduce (every rank the whole tensor's, sequence parallel its rows'); a pipeline
 * stage seeds its blocks by the whole model's index (fl_model.stage.first); the micro-batch seed is the global one. */
static fl_status fl_tr_opt_dropout(trainer *t) {
    const fl_model_config *c = &t->model.cfg;
    if (c->arch != FL_ARCH_OPT || (c->dropout_rate <= 0 && c->attn_dropout_rate <= 0)) return FL_OK;
    add_note(t, "config.json dropout %g / attention_dropout %g are applied in training (OPT's attention and FFN outputs / "
             "attention weights; not in evaluation or generation)", (double)c->dropout_rate, (double)c->attn_dropout_rate);
    return fl_model_set_dropout(&t->model, 1);
}

/* "setup": gradients (or the LoRA adapters), optimizer state, the activation arena for
 * (t->sch.B, t->sch.T) and the step's buffers for t->sch.accum micro-batches (t->sch.G global). */
fl_status fl_tr_setup_training(trainer *t, const fl_run_config *rcfg, const fl_strategy_choice *sc) {
    const fl_run_config *cfg = t->cfg;
    fl_mem_set_phase(&t->hw.pool, "setup");
    if (cfg->command == FL_CMD_FINETUNE_LORA) {
        /* adapters only: the base stays frozen and needs no gradient buffer */
        fl_lora_config lc;
        FL_TRY(fl_trainer_lora_config(cfg, &t->model.cfg, &lc));
        int base = 0; /* a pipeline stage's modules count from its first block's (the whole model's seeds) */
        if (t->pp.size > 1) FL_TRY(fl_tr_pp_lora_base(t, &lc, &base));
        FL_TRY(fl_model_lora_init_at(&t->model, &lc, cfg->seed, base));
    } else {
        FL_TRY(fl_fsdp_init(&t->dp, rcfg, &t->model)); /* FULL_SHARD: the gathered units' compute copy */
        /* (sharded: of the gradients; parameter offload on NVMe: a disk that refuses them is an I/O error) */
        FL_TRY(fl_fsdp_tier_fault(&t->dp, fl_model_alloc_grads(&t->model), "gradient",
                                  fl_model_store_numel(&t->model) * fl_dtype_size(fl_model_store_dtype(&t->model))));
    }
    FL_TRY(fl_tr_setup_offload(t, sc));
    FL_TRY(fl_dp_optim_init(&t->dp, rcfg, &t->opt, &t->model)); /* ZeRO: state for this rank's chunk only; offload:
                                                                  * in the host tier */
    FL_TRY(fl_dp_check(&t->dp, &t->opt));
    if (t->opt.amp.on && cfg->loss_scale_init > 0) t->opt.amp.ls.scale = cfg->loss_scale_init;
    t->model.act_ckpt = sc->act_ckpt; /* given, or LitGPT's default under auto's FSDP */
    if (t->sch.Ts) {
        FL_TRY(fl_model_set_dropout(&t->model, 1)); /* config.json's dropout_rate in the training passes */
        FL_TRY(fl_model_alloc_acts_s2s(&t->model, t->sch.B, t->sch.Ts, t->sch.T));
        size_t ps = (size_t)t->sch.accum * t->sch.B * t->sch.Ts;
        fl_status s = fl_mem_alloc(fl_mem_host_pool(&t->hw.pool), FL_TAG_OTHER, ps * sizeof(int32_t), (void **)&t->buf.src);
        if (s == FL_OK) s = fl_mem_alloc(fl_mem_host_pool(&t->hw.pool), FL_TAG_OTHER, ps, (void **)&t->buf.src_mask);
        if (s != FL_OK) return fl_error_prefix(s, "the step's sources (%d x %d x %d)", t->sch.accum, t->sch.B, t->sch.Ts);
    } else {
        FL_TRY(fl_tr_opt_dropout(t));
        FL_TRY(fl_model_alloc_acts(&t->model, t->sch.B, t->sch.T));
    }
    size_t per = (size_t)t->sch.B * t->sch.T;
    /* the step's token ids and targets: host memory (the loader writes them; the forward uploads) */
    fl_status s = fl_mem_alloc(fl_mem_host_pool(&t->hw.pool), FL_TAG_OTHER, (size_t)t->sch.accum * per * sizeof(int32_t),
                               (void **)&t->buf.ids);
    if (s == FL_OK)
        s = fl_mem_alloc(fl_mem_host_pool(&t->hw.pool), FL_TAG_OTHER, (size_t)t->sch.accum * per * sizeof(int32_t),
                         (void **)&t->buf.tgt);
    if (s != FL_OK) return fl_error_prefix(s, "the step's token ids and targets (%d x %d x %d)", t->sch.accum, t->sch.B, t->sch.T);
    t->buf.mbs = calloc((size_t)t->sch.accum, sizeof *t->buf.mbs);
    t->buf.mb_epoch = calloc((size_t)t->sch.G, sizeof *t->buf.mb_epoch);
    t->buf.mb_tokens = calloc((size_t)t->sch.G, sizeof *t->buf.mb_tokens);
    t->buf.mb_stats = calloc((size_t)t->sch.G * FL_TR_MB_SLOTS, sizeof *t->buf.mb_stats);
    if (!t->buf.mbs || !t->buf.mb_epoch || !t->buf.mb_tokens || !t->buf.mb_stats)
        return fl_errorf(FL_ERR_OOM, "out of host memory");
    return FL_OK;
}

void fl_tr_cleanup(trainer *t) {
    fl_metrics_close(&t->metrics);
    free(t->st.loss_window);
    t->st.loss_window = NULL;
    if (t->hw.pool_ok) {
        fl_mem_free(fl_mem_host_pool(&t->hw.pool), t->buf.ids);
        fl_mem_free(fl_mem_host_pool(&t->hw.pool), t->buf.tgt);
        fl_mem_free(fl_mem_host_pool(&t->hw.pool), t->buf.src);
        fl_mem_free(fl_mem_host_pool(&t->hw.pool), t->buf.src_mask);
    }
    free(t->buf.mbs);
    free(t->buf.mb_epoch);
    free(t->buf.mb_tokens);
    free(t->buf.mb_stats);
    free(t->saved_cfg);
    t->saved_cfg = NULL;
    fl_dp_done(&t->dp);
    fl_loader_free(t->in.train);
    fl_loader_free(t->in.val);
    fl_data_free(t->in.data);
    fl_s2s_loader_free(t->in.s2s_train);
    fl_s2s_loader_free(t->in.s2s_val);
    fl_s2s_free(t->in.s2s);
    fl_s2s_free(t->in.s2s_vdata);
    fl_tok_free(t->in.tok);
    fl_fsdp_free(&t->dp);
    fl_optim_free(&t->opt);
    fl_tr_pp_free_chunks(t); /* the pipelined step's stash and the interleaved chunks are in the model's pool */
    if (t->model_ok) fl_model_free(&t->model);
    if (t->hw.pool_ok) fl_backend_pools_free(&t->hw.pool, &t->hw.hpool);
    if (t->hw.dpool_ok) fl_mem_pool_free(&t->hw.dpool);
    if (t->hw.opool_ok) fl_mem_pool_free(&t->hw.opool);
    if (t->hw.hbe_ok) fl_cpu_backend_free(&t->hw.hbe);
    if (t->hw.be_ok) fl_backend_free(&t->hw.be);
    fl_tr_tp_end(t); /* after fl_dp_done: the data-parallel axis is its communicator */
}

/* cleanup after a failure keeps the failure's message: tearing down what was in flight (FSDP's
 * gathers on an aborted communicator) records errors of its own */
void fl_tr_cleanup_keep_error(trainer *t, fl_status s) {
    char *keep = s != FL_OK ? strdup(fl_error_message()) : NULL;
    fl_tr_cleanup(t);
    if (keep) fl_errorf(s, "%s", keep);
    free(keep);
}
