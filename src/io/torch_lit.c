/* LitGPT (lit_model.pth) parameter names to Hugging Face LLaMA names; see
 * include/fitllm/torch_ckpt.h. The map and the qkv layouts follow what LitGPT's
 * convert_lit_checkpoint.py undoes (copy_weights_llama): since LitGPT PR #1013
 * (Dec 2024) attn.qkv.weight is q, k, v stacked; before it attn.attn.weight held, per
 * key/value group, that group's q heads, then its k head, then its v head. LLaMA's
 * q/k rows are in rotate-half (HF) order in both, so no RoPE permutation. */
#include "fitllm/torch_ckpt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct { const char *lit, *hf; } lit_map[] = {
    {"norm_1.weight", "input_layernorm.weight"},
    {"attn.proj.weight", "self_attn.o_proj.weight"},
    {"norm_2.weight", "post_attention_layernorm.weight"},
    {"mlp.fc_1.weight", "mlp.gate_proj.weight"},
    {"mlp.fc_2.weight", "mlp.up_proj.weight"},
    {"mlp.proj.weight", "mlp.down_proj.weight"},
};

static fl_status lit_rename(fl_st_tensor *t, const char *name) {
    char *n = strdup(name);
    if (!n) return fl_errorf(FL_ERR_OOM, "out of memory renaming '%s'", t->name);
    free(t->name);
    t->name = n;
    return FL_OK;
}

/* The fused qkv of layer `layer` at f->tensors[i] -> q, k, v tensors (i and two appended). */
static fl_status lit_split_qkv(fl_st_file *f, int i, long layer, int interleaved, int nh, int nkv, int hd,
                               char *buf, size_t *buf_off) {
    fl_st_tensor *t = &f->tensors[i];
    const int64_t rows = (int64_t)(nh + 2 * nkv) * hd;
    if (t->ndim != 2 || t->shape[0] != rows)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': expected %lld rows ((n_heads %d + 2 x n_kv_heads %d) x head_dim %d), "
                         "file has shape [%lld%s", f->path, t->name, (long long)rows, nh, nkv, hd,
                         (long long)(t->ndim ? t->shape[0] : 0), t->ndim == 2 ? ", ...]" : "] (not 2-D)");
    const size_t row_bytes = (size_t)t->shape[1] * fl_dtype_size(t->dtype), head = (size_t)hd * row_bytes;
    const char *src = t->data;
    if (interleaved) { /* per group: q_per_kv q heads, k, v -> all q heads, all k, all v */
        char *dst = buf + *buf_off;
        const int qpk = nh / nkv;
        for (int g = 0; g < nkv; g++) {
            const char *grp = src + (size_t)g * (size_t)(qpk + 2) * head;
            memcpy(dst + (size_t)g * qpk * head, grp, (size_t)qpk * head);
            memcpy(dst + ((size_t)nh + (size_t)g) * head, grp + (size_t)qpk * head, head);
            memcpy(dst + ((size_t)nh + (size_t)nkv + (size_t)g) * head, grp + (size_t)(qpk + 1) * head, head);
        }
        src = dst;
        *buf_off += (size_t)rows * row_bytes;
    }
    const int64_t nrow[3] = {(int64_t)nh * hd, (int64_t)nkv * hd, (int64_t)nkv * hd};
    const char *proj[3] = {"q_proj", "k_proj", "v_proj"};
    fl_st_tensor base = *t;
    size_t off = 0;
    for (int k = 0; k < 3; k++) {
        fl_st_tensor *o = k == 0 ? t : &f->tensors[f->n_tensors];
        if (k) *o = base;
        o->name = k == 0 ? base.name : NULL;
        char nm[128];
        snprintf(nm, sizeof nm, "model.layers.%ld.self_attn.%s.weight", layer, proj[k]);
        if (k == 0) FL_TRY(lit_rename(o, nm));
        else if (!(o->name = strdup(nm))) return fl_errorf(FL_ERR_OOM, "%s: out of memory", f->path);
        else f->n_tensors++;
        o->shape[0] = nrow[k];
        o->data = src + off;
        if (!interleaved) o->begin = base.begin + off; /* still inside the mapping */
        o->end = o->begin + (size_t)nrow[k] * row_bytes;
        off += (size_t)nrow[k] * row_bytes;
    }
    return FL_OK;
}

fl_status fl_torch_lit_to_hf(fl_st_file *f, int nh, int nkv, int hd) {
    if (nh <= 0 || nkv <= 0 || hd <= 0 || nh % nkv)
        return fl_errorf(FL_ERR_INVALID, "%s: head counts %d / %d (head_dim %d) cannot split a fused qkv", f->path, nh, nkv, hd);
    /* room for the two extra tensors of every fused qkv, and the regrouped copies of interleaved ones */
    int n_qkv = 0;
    size_t need = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const char *n = f->tensors[i].name;
        size_t l = strlen(n);
        if (l > 16 && (!strcmp(n + l - 16, ".attn.qkv.weight") || !strcmp(n + l - 17, ".attn.attn.weight"))) {
            n_qkv++;
            if (!strcmp(n + l - 17, ".attn.attn.weight")) need += f->tensors[i].end - f->tensors[i].begin;
        }
    }
    fl_st_tensor *nt = realloc(f->tensors, (size_t)(f->n_tensors + 2 * n_qkv + 1) * sizeof *nt);
    if (!nt) return fl_errorf(FL_ERR_OOM, "%s: out of memory", f->path);
    f->tensors = nt;
    char *buf = NULL;
    if (need) {
        if (!(buf = malloc(need))) return fl_errorf(FL_ERR_OOM, "%s: out of memory regrouping qkv (%zu bytes)", f->path, need);
        free(f->owned);
        f->owned = buf;
    }
    size_t buf_off = 0;
    const int n0 = f->n_tensors;
    for (int i = 0; i < n0; i++) {
        const char *n = f->tensors[i].name;
        if (!strcmp(n, "transformer.wte.weight")) { FL_TRY(lit_rename(&f->tensors[i], "model.embed_tokens.weight")); continue; }
        if (!strcmp(n, "transformer.ln_f.weight")) { FL_TRY(lit_rename(&f->tensors[i], "model.norm.weight")); continue; }
        if (!strcmp(n, "lm_head.weight")) continue;
        char *end;
        long layer = -1;
        if (!strncmp(n, "transformer.h.", 14)) layer = strtol(n + 14, &end, 10);
        if (layer < 0 || end == n + 14 || *end != '.')
            return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' is not a LitGPT LLaMA parameter (transformer.wte, transformer.h.N.*, "
                             "transformer.ln_f, lm_head)", f->path, n);
        const char *rest = end + 1;
        if (!strcmp(rest, "attn.qkv.weight") || !strcmp(rest, "attn.attn.weight")) {
            FL_TRY(lit_split_qkv(f, i, layer, !strcmp(rest, "attn.attn.weight"), nh, nkv, hd, buf, &buf_off));
            continue;
        }
        int k = 0, nm = (int)(sizeof lit_map / sizeof lit_map[0]);
        while (k < nm && strcmp(rest, lit_map[k].lit)) k++;
        if (k == nm)
            return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' has no LLaMA counterpart (biases, MoE and non-LLaMA LitGPT "
                             "models are not read)", f->path, n);
        char hf[160];
        snprintf(hf, sizeof hf, "model.layers.%ld.%s", layer, lit_map[k].hf);
        FL_TRY(lit_rename(&f->tensors[i], hf));
    }
    return FL_OK;
}
