/* fitllm tokenizers: the built-in byte tokenizer written as Hugging Face files, so that every
 * checkpoint of a run that used it carries its tokenizer (fitllm generate, transformers).
 *
 * tokenizer.json: a BPE model whose vocabulary is the 256 byte-level pieces (GPT-2's
 * byte-to-unicode map: piece of byte b -> id b) and no merges, a ByteLevel pre-tokenizer without
 * the GPT-2 regex (no splitting: every byte is one token, as the built-in encoder does), a
 * ByteLevel decoder, and <bos> (256) / <eos> (257) as special added tokens. The ids of any text
 * are the built-in's, except that the literal strings "<bos>" and "<eos>" in the text are matched
 * as the special tokens (what Hugging Face does with every added token; the built-in encodes them
 * as bytes). Decoding turns an invalid UTF-8 sequence into U+FFFD, as Hugging Face does.
 * tokenizer_config.json: the BOS/EOS tokens, no BOS/EOS added (the built-in adds none by default),
 * PreTrainedTokenizerFast, and no clean-up of spaces (transformers' default would alter the text). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok-impl.h"

/* GPT-2's bytes_to_unicode (the same table as fl_tok_bytelevel_tables) */
static unsigned byte_cp(int b) {
    int n = 0;
    for (int c = 0; c < 256; c++) {
        int keep = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
        if (c == b) return keep ? (unsigned)c : 256u + (unsigned)n;
        if (!keep) n++;
    }
    return 0;
}

/* the JSON string literal of the piece of byte b (code point < 0x200: one or two UTF-8 bytes) */
static int put_piece(fl_tok_buf *o, int b) {
    unsigned cp = byte_cp(b);
    char tmp[8];
    size_t l = 0;
    tmp[l++] = '"';
    if (cp == '"' || cp == '\\') tmp[l++] = '\\', tmp[l++] = (char)cp;
    else if (cp < 0x80) tmp[l++] = (char)cp;
    else tmp[l++] = (char)(0xC0 | (cp >> 6)), tmp[l++] = (char)(0x80 | (cp & 0x3F));
    tmp[l++] = '"';
    return fl_tok_buf_put(o, tmp, l);
}

static int puts_(fl_tok_buf *o, const char *s) { return fl_tok_buf_put(o, s, strlen(s)); }

static const char k_added[] =
    "  \"added_tokens\": [\n"
    "    {\"id\": 256, \"content\": \"<bos>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
    "\"normalized\": false, \"special\": true},\n"
    "    {\"id\": 257, \"content\": \"<eos>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
    "\"normalized\": false, \"special\": true}\n"
    "  ],\n";

fl_status fl_tok_builtin_bytes_hf_json(char **text, size_t *len) {
    if (!text || !len) return fl_errorf(FL_ERR_INVALID, "fl_tok_builtin_bytes_hf_json: NULL argument");
    *text = NULL;
    *len = 0;
    fl_tok_buf o = {0};
    int bad = puts_(&o, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n") || puts_(&o, k_added) ||
              puts_(&o, "  \"normalizer\": null,\n"
                        "  \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                        "\"use_regex\": false},\n"
                        "  \"post_processor\": null,\n"
                        "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                        "\"use_regex\": false},\n"
                        "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
                        "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, "
                        "\"byte_fallback\": false, \"ignore_merges\": false, \"vocab\": {");
    for (int b = 0; b < 256 && !bad; b++) {
        char id[16];
        snprintf(id, sizeof id, ": %d%s", b, b < 255 ? ", " : "");
        bad = (b % 8 == 0 && puts_(&o, "\n    ")) || put_piece(&o, b) || puts_(&o, id);
    }
    bad = bad || puts_(&o, "\n  }, \"merges\": []}\n}\n") || fl_tok_buf_put(&o, "", 1);
    if (bad) {
        free(o.p);
        return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory writing the byte tokenizer's tokenizer.json");
    }
    *text = o.p;
    *len = o.n - 1; /* without the NUL */
    return FL_OK;
}

fl_status fl_tok_builtin_bytes_hf_config(char **text, size_t *len) {
    if (!text || !len) return fl_errorf(FL_ERR_INVALID, "fl_tok_builtin_bytes_hf_config: NULL argument");
    static const char cfg[] = "{\n"
                              "  \"tokenizer_class\": \"PreTrainedTokenizerFast\",\n"
                              "  \"bos_token\": \"<bos>\",\n"
                              "  \"eos_token\": \"<eos>\",\n"
                              "  \"add_bos_token\": false,\n"
                              "  \"add_eos_token\": false,\n"
                              "  \"clean_up_tokenization_spaces\": false\n"
                              "}\n";
    *len = sizeof cfg - 1;
    if (!(*text = malloc(sizeof cfg))) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
    memcpy(*text, cfg, sizeof cfg);
    return FL_OK;
}
