/* fitllm tokenize: encode text to ids or decode ids to text with any supported
 * tokenizer (tokenizer.json, tokenizer.model, llama2.c .bin, or a model folder). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/tokenizer.h"

static void help(void) {
    printf("usage: fitllm tokenize <tokenizer> (--text STR | --file F | --decode \"ID ...\") [options]\n\n"
           "  <tokenizer>        model folder (tokenizer.json, else tokenizer.model, else spiece.model\n"
           "                     (T5), else tok*.bin, plus tokenizer_config.json / config.json for\n"
           "                     BOS/EOS), a tokenizer file (BPE or SentencePiece Unigram),\n"
           "                     or \"bytes\" for the built-in byte tokenizer\n"
           "  --text STR         text to encode\n"
           "  --file F           encode the contents of file F (bytes as-is)\n"
           "  --decode \"1 2 3\"   decode space-separated ids and print the text\n"
           "  --bos 0|1          add BOS (default: the tokenizer's add_bos_token)\n"
           "  --eos 0|1          add EOS (default: the tokenizer's add_eos_token)\n"
           "  --skip-special 0|1 when decoding, drop special tokens (default 0)\n"
           "  --info             print kind, vocab size, BOS/EOS/PAD ids to stderr\n\n"
           "Encoding prints the ids space-separated on one line.\n");
}

int fl_cmd_tokenize(int argc, char **argv) {
    const char *cmd = "tokenize", *path = NULL, *text = NULL, *file = NULL, *dec = NULL;
    int bos = -1, eos = -1, skip = 0, info = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--text") && i + 1 < argc) text = argv[++i];
        else if (!strcmp(a, "--file") && i + 1 < argc) file = argv[++i];
        else if (!strcmp(a, "--decode") && i + 1 < argc) dec = argv[++i];
        else if (!strcmp(a, "--bos")) { if (fl_cli_int(cmd, a, i + 1 < argc ? argv[++i] : NULL, 0, 1, &bos)) return FL_EXIT_USAGE; }
        else if (!strcmp(a, "--eos")) { if (fl_cli_int(cmd, a, i + 1 < argc ? argv[++i] : NULL, 0, 1, &eos)) return FL_EXIT_USAGE; }
        else if (!strcmp(a, "--skip-special")) { if (fl_cli_int(cmd, a, i + 1 < argc ? argv[++i] : NULL, 0, 1, &skip)) return FL_EXIT_USAGE; }
        else if (!strcmp(a, "--info")) info = 1;
        else if (a[0] == '-' && a[1]) return fl_cli_unknown_option(cmd, a, (const char *const[]){"--bos", "--decode", "--eos", "--file", "--help", "--info", "--skip-special", "--text", NULL});
        else if (!path) path = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!path) return fl_cli_usage(cmd, "missing <tokenizer>");
    if (!!text + !!file + !!dec != 1) return fl_cli_usage(cmd, "give exactly one of --text, --file, --decode");
    fl_tokenizer *t = NULL;
    fl_status s = !strcmp(path, "bytes") ? fl_tok_builtin_bytes(&t) : fl_tok_load(&t, path);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if (info)
        fprintf(stderr, "kind %s, vocab %d, bos %d, eos %d, pad %d\n", fl_tok_kind(t), fl_tok_vocab_size(t), fl_tok_bos_id(t),
                fl_tok_eos_id(t), fl_tok_pad_id(t));
    int rc = 0;
    if (dec) {
        size_t n = 0, cap = 16;
        int32_t *ids = malloc(cap * sizeof *ids);
        const char *p = dec;
        while (ids && *p) {
            char *e;
            while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n') p++;
            if (!*p) break;
            errno = 0;
            long v = strtol(p, &e, 10);
            if (e == p || errno || v < 0 || v > INT32_MAX) {
                free(ids);
                fl_tok_free(t);
                return fl_cli_usage(cmd, "--decode: '%.20s' is not a token id", p);
            }
            if (n == cap) {
                int32_t *ni = realloc(ids, (cap *= 2) * sizeof *ids);
                if (!ni) free(ids);
                ids = ni;
                if (!ids) break;
            }
            ids[n++] = (int32_t)v;
            p = e;
        }
        char *out = NULL;
        size_t len = 0;
        /* the library skips ids it has no piece for (HF does, for a model vocab padded past the
         * tokenizer's); asked to decode, an id outside the vocabulary is the user's mistake */
        s = ids ? FL_OK : fl_errorf(FL_ERR_OOM, "out of memory");
        for (size_t i = 0; s == FL_OK && i < n; i++)
            if (ids[i] >= fl_tok_vocab_size(t))
                s = fl_errorf(FL_ERR_INVALID, "--decode: token id %d (position %zu) is outside the vocabulary of %d ids "
                              "(0 .. %d) of %s", (int)ids[i], i + 1, fl_tok_vocab_size(t), fl_tok_vocab_size(t) - 1, path);
        if (s == FL_OK) s = fl_tok_decode(t, ids, n, skip, &out, &len);
        if (s == FL_OK) {
            fwrite(out, 1, len, stdout);
            putchar('\n');
        } else rc = fl_cli_fail(cmd, s, NULL);
        free(out);
        free(ids);
    } else {
        char *buf = NULL;
        size_t n = text ? strlen(text) : 0;
        if (file && (s = fl_fs_read_file(file, 0, &buf, &n)) != FL_OK) {
            fl_tok_free(t);
            return fl_cli_fail(cmd, s, NULL);
        }
        int32_t *ids = NULL;
        size_t ni = 0;
        s = fl_tok_encode(t, file ? buf : text, n, bos, eos, &ids, &ni);
        if (s == FL_OK) {
            for (size_t i = 0; i < ni; i++) printf(i ? " %d" : "%d", (int)ids[i]);
            putchar('\n');
        } else rc = fl_cli_fail(cmd, s, NULL);
        free(ids);
        free(buf);
    }
    fl_tok_free(t);
    return rc;
}
