/* The ids that end generation, as transformers' generate takes them: generation_config.json's eos_token_id, else
 * config.json's (its text_config's for a composite such as BLIP-2), an id or a list (Llama-3: [128001, 128008,
 * 128009]); plus the tokenizer's EOS ids. */
#include "fitllm/io.h"
#include "fitllm/json.h"
#include "fitllm/tokenizer.h"

#include "core/fs.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

/* id into the set ids[0..*n) (capacity cap) unless it is there already */
static void gc_add(int32_t *ids, int cap, int *n, int32_t id) {
    for (int i = 0; i < *n; i++)
        if (ids[i] == id) return;
    if (*n < cap) ids[(*n)++] = id;
}

/* eos_token_id of object o (where: "" or "text_config." for messages): absent or null leaves *found 0 */
static fl_status gc_key(const char *path, const fl_json *o, const char *where, int32_t *ids, int cap, int *n,
                        int *found) {
    const fl_json *e = o && o->type == FL_JSON_OBJECT ? fl_json_get(o, "eos_token_id") : NULL;
    *found = 0;
    if (!e || e->type == FL_JSON_NULL) return FL_OK;
    const int list = e->type == FL_JSON_ARRAY;
    for (const fl_json *c = list ? e->child : e; c; c = list ? c->next : NULL) {
        if (c->type != FL_JSON_NUMBER || !c->is_int || c->i < 0 || c->i > INT32_MAX)
            return fl_errorf(FL_ERR_FORMAT, "%s: key '%seos_token_id' must be a token id or a list of token ids "
                             "(non-negative integers)", path, where);
        gc_add(ids, cap, n, (int32_t)c->i);
    }
    *found = 1;
    return FL_OK;
}

fl_status fl_hf_eos_ids(const char *dir, int32_t *ids, int cap, int *n, const char **from) {
    static const char *const names[] = {"generation_config.json", "config.json"};
    *n = 0;
    if (from) *from = "";
    if (!dir || !fl_fs_is_dir(dir)) return FL_OK; /* a llama2.c .bin, a preset: no such files */
    for (int f = 0; f < 2; f++) {
        char path[4096];
        FL_TRY(fl_fs_join(path, sizeof path, dir, names[f]));
        if (!fl_fs_is_file(path)) continue;
        fl_json *root = NULL;
        FL_TRY(fl_json_parse_file(path, &root));
        int found = 0;
        fl_status s = root->type == FL_JSON_OBJECT ? gc_key(path, root, "", ids, cap, n, &found)
                                                   : fl_errorf(FL_ERR_FORMAT, "%s: top level must be a JSON object", path);
        if (s == FL_OK && !found && f == 1) /* a composite's language model (BLIP-2): its text_config's */
            s = gc_key(path, fl_json_get(root, "text_config"), "text_config.", ids, cap, n, &found);
        fl_json_free(root);
        if (s != FL_OK) return s;
        if (found) {
            if (from) *from = names[f];
            return FL_OK;
        }
    }
    return FL_OK;
}

fl_status fl_hf_stop_ids(const char *dir, const fl_tokenizer *tok, int32_t *ids, int cap, int *n, const char **from) {
    FL_TRY(fl_hf_eos_ids(dir, ids, cap, n, from));
    const int k = *n, tv = tok ? fl_tok_vocab_size(tok) : 0;
    for (int32_t i = 0; i < tv; i++)
        if (fl_tok_is_eos(tok, i)) gc_add(ids, cap, n, i);
    if (from && *n > k) *from = k ? (!strcmp(*from, "config.json") ? "config.json + the tokenizer"
                                                                     : "generation_config.json + the tokenizer")
                                  : "the tokenizer";
    return FL_OK;
}
