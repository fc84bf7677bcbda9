/* Tokenizer encode speed, one thread: LLaMA-2 (tokenizer.json and
 * tokenizer.model) and GPT-2 (tokenizer.json) on tinystories-val-prefix.txt and
 * tinyshakespeare.txt; whole text as one string and line by line; median of 5, MB/s.
 *   ./build/bench_tokenizer [data_dir]      (default ../shared/data or $FITLLM_DATA) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/tokenizer.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) { free(b); b = NULL; }
    fclose(f);
    if (b) b[sz] = 0, *n = (size_t)sz;
    return b;
}

static int cmpd(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* mode 0: whole text; 1: line by line. Returns median seconds; *ntok tokens. */
static double run(const fl_tokenizer *t, const char *text, size_t n, int mode, size_t *ntok) {
    double ts[5];
    for (int r = 0; r < 5; r++) {
        double t0 = now_s();
        size_t tot = 0;
        if (mode == 0) {
            int32_t *ids;
            size_t k;
            if (fl_tok_encode(t, text, n, 0, 0, &ids, &k) != FL_OK) { fprintf(stderr, "encode failed: %s\n", fl_error_message()); exit(1); }
            tot = k;
            free(ids);
        } else {
            const char *p = text, *end = text + n;
            while (p < end) {
                const char *nl = memchr(p, '\n', (size_t)(end - p));
                size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
                int32_t *ids;
                size_t k;
                if (fl_tok_encode(t, p, len, 0, 0, &ids, &k) != FL_OK) { fprintf(stderr, "encode failed\n"); exit(1); }
                tot += k;
                free(ids);
                p = nl ? nl + 1 : end;
            }
        }
        ts[r] = now_s() - t0;
        *ntok = tot;
    }
    qsort(ts, 5, sizeof *ts, cmpd);
    return ts[2];
}

int main(int argc, char **argv) {
    const char *data = argc > 1 ? argv[1] : getenv("FITLLM_DATA") ? getenv("FITLLM_DATA") : "../shared/data";
    const char *toks[][2] = {{"llama2-tokenizer/tokenizer.json", "LLaMA-2 tokenizer.json"},
                             {"llama2-tokenizer/tokenizer.model", "LLaMA-2 tokenizer.model"},
                             {"gpt2-tokenizer/tokenizer.json", "GPT-2 tokenizer.json"}};
    const char *texts[] = {"text/tinystories-val-prefix.txt", "text/tinyshakespeare.txt"};
    printf("| tokenizer | text | MB | mode | tokens | median s | MB/s |\n|---|---|---|---|---|---|---|\n");
    for (int k = 0; k < 3; k++) {
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", data, toks[k][0]);
        fl_tokenizer *t = NULL;
        if (fl_tok_load(&t, p) != FL_OK) { fprintf(stderr, "%s\n", fl_error_message()); return 1; }
        for (int x = 0; x < 2; x++) {
            snprintf(p, sizeof p, "%s/%s", data, texts[x]);
            size_t n;
            char *text = slurp(p, &n);
            if (!text) { fprintf(stderr, "%s: cannot read\n", p); return 1; }
            for (int mode = 0; mode < 2; mode++) {
                size_t ntok = 0;
                double s = run(t, text, n, mode, &ntok);
                printf("| %s | %s | %.2f | %s | %zu | %.3f | %.2f |\n", toks[k][1], strrchr(texts[x], '/') + 1, n / 1e6,
                       mode ? "lines" : "whole", ntok, s, n / 1e6 / s);
                fflush(stdout);
            }
            free(text);
        }
        fl_tok_free(t);
    }
    return 0;
}
