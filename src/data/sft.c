/* Prompt styles (LitGPT litgpt/prompts.py, the dataset styles) and the SFT
 * sample (LitGPT SFTDataset.__getitem__):
 *   ids    = encode(prompt) ++ encode(output, bos=False, eos=True), cut to max_seq_length
 *   labels = ids, with the first len(encode(prompt)) positions = ignore_index if mask_prompt
 * encode(prompt) uses the tokenizer's default BOS (LitGPT: add_bos_token) and no EOS. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data-impl.h"

#define ALPACA_SYS_INPUT                                                                                         \
    "Below is an instruction that describes a task, paired with an input that provides further context. " \
    "Write a response that appropriately completes the request.\n\n"
#define ALPACA_SYS                          \
    "Below is an instruction that describes a task. " \
    "Write a response that appropriately completes the request.\n\n"

static const char *const KNOWN_STYLES = "alpaca, flan, longform, default";

static char *concat(const char *const *parts, int n) {
    size_t len = 0;
    for (int i = 0; i < n; i++) len += strlen(parts[i]);
    char *o = malloc(len + 1);
    if (!o) return NULL;
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        size_t l = strlen(parts[i]);
        memcpy(o + k, parts[i], l);
        k += l;
    }
    o[k] = '\0';
    return o;
}

fl_status fl_data_format_prompt(const char *style, const char *instruction, const char *input, char **out) {
    *out = NULL;
    if (!style) style = "alpaca";
    if (!instruction) instruction = "";
    int has_input = input && input[0]; /* Python: `if kwargs.get("input")` */
    char *o = NULL;
    if (strcmp(style, "alpaca") == 0) {
        if (has_input) {
            const char *p[] = {ALPACA_SYS_INPUT "### Instruction:\n", instruction, "\n\n### Input:\n", input,
                               "\n\n### Response:\n"};
            o = concat(p, 5);
        } else {
            const char *p[] = {ALPACA_SYS "### Instruction:\n", instruction, "\n\n### Response:\n"};
            o = concat(p, 3);
        }
    } else if (strcmp(style, "flan") == 0) {
        const char *p[] = {ALPACA_SYS "### Instruction:\n", instruction, "\n\n### Response:\n"};
        o = concat(p, 3);
    } else if (strcmp(style, "longform") == 0) {
        const char *p[] = {ALPACA_SYS_INPUT "### Instruction:\n", instruction, "\n\n### Response:\n"};
        o = concat(p, 3);
    } else if (strcmp(style, "default") == 0) {
        const char *p[] = {instruction};
        o = concat(p, 1);
    } else {
        return fl_errorf(FL_ERR_INVALID, "unknown prompt style '%s' (known: %s)", style, KNOWN_STYLES);
    }
    if (!o) return fl_errorf(FL_ERR_OOM, "prompt: out of memory");
    *out = o;
    return FL_OK;
}

fl_status fl_data_sft_tokenize(const fl_data_records *rs, const size_t *order, size_t n, const fl_data_config *cfg,
                               const fl_tokenizer *tok, fl_data_split_buf *b, fl_data_stats *st, const char *source) {
    int32_t *buf = NULL, *lab = NULL;
    size_t cap = 0;
    fl_status s = FL_OK;
    for (size_t k = 0; k < n && s == FL_OK; k++) {
        size_t ri = order ? order[k] : k;
        const fl_data_record *r = &rs->r[ri];
        char *prompt = NULL;
        int32_t *p = NULL, *o = NULL;
        size_t np = 0, no = 0;
        s = fl_data_format_prompt(cfg->prompt_style, r->instruction, r->input, &prompt);
        if (s == FL_OK) s = fl_tok_encode(tok, prompt, strlen(prompt), -1, 0, &p, &np);
        if (s == FL_OK) s = fl_tok_encode(tok, r->output, strlen(r->output), 0, 1, &o, &no);
        free(prompt);
        if (s != FL_OK) {
            s = fl_error_prefix(s, "%s: record %zu: tokenizing", source, ri);
        } else {
            size_t total = np + no;
            size_t len = total;
            if (cfg->max_seq_length > 0 && len > (size_t)cfg->max_seq_length) {
                len = (size_t)cfg->max_seq_length;
                st->n_truncated++;
            }
            if (len > (size_t)INT32_MAX) {
                s = fl_errorf(FL_ERR_FORMAT, "%s: record %zu: %zu tokens is too long", source, ri, len);
            } else if (len > cap) {
                size_t c = len * 2;
                int32_t *nb = realloc(buf, c * sizeof *nb), *nl = nb ? realloc(lab, c * sizeof *nl) : NULL;
                if (nb) buf = nb;
                if (nl) lab = nl;
                if (!nb || !nl) s = fl_errorf(FL_ERR_OOM, "%s: record %zu: out of memory", source, ri);
                else cap = c;
            }
            if (s == FL_OK) {
                size_t plen = np < len ? np : len;
                for (size_t i = 0; i < len; i++) buf[i] = i < np ? p[i] : o[i - np];
                for (size_t i = 0; i < len; i++) lab[i] = (cfg->mask_prompt && i < plen) ? cfg->ignore_index : buf[i];
                s = fl_data_split_push(b, buf, lab, (int)len, (int)plen);
            }
        }
        free(p);
        free(o);
    }
    free(buf);
    free(lab);
    return s;
}
