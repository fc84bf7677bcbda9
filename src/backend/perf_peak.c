/* The GPU peak table behind MFU (fitllm/perf.h; issue 30, item 6).
 *
 * Dense 16-bit tensor-core peaks with fp32 accumulation (what our GEMMs and attention run), in TFLOP/s.
 * NVIDIA's datasheets print the 2:4-sparsity figure first ("1,979* TFLOPS", the asterisk saying "with
 * sparsity"); the dense peak is half of it, and MFU (PaLM's definition, as llm.c and TinyLlama report
 * it) is against the dense one. Sources:
 *   A100 SXM4 / PCIe (40 and 80 GB): NVIDIA A100 Tensor Core GPU datasheet: BF16 312 | 624*.
 *   H100 SXM5: NVIDIA H100 datasheet: BF16 1,979* -> 989.5; H100 PCIe 1,513* -> 756.5; H100 NVL 1,671*
 *     -> 835.5. H800 / H800 PCIe: the same chips (H800 datasheet).
 *   H200 SXM: NVIDIA H200 datasheet: BF16 1,979* -> 989.5; H200 NVL 1,671* -> 835.5. GH200: the H100 /
 *     H200 SXM figure (GH200 datasheet: 1,979*).
 *   B200 (HGX B200): NVIDIA HGX B200 datasheet: FP16/BF16 4.5 PFLOPS* per GPU -> 2,250.
 *   L40S: NVIDIA L40S datasheet: BF16 362.05 | 733*. L40: L40 datasheet: BF16 181.05 | 362.1*.
 *   L4: NVIDIA L4 datasheet: BF16 242* -> 121. A10: A10 datasheet: BF16 125 | 250*. A40: A40
 *     datasheet: BF16 149.7 | 299.4*.
 *   GeForce RTX 4090: NVIDIA Ada Lovelace architecture whitepaper, appendix: "Peak BF16 Tensor TFLOPS with
 *     FP32 Accumulate" 165.2 | 330.4*. RTX 3090: NVIDIA Ampere GA102 whitepaper: the same row, 71 | 142*.
 *   V100 (no bf16): Tesla V100 datasheet: tensor (fp16) SXM2 125, PCIe 112; V100S PCIe 130.
 *   T4 (no bf16): Tesla T4 datasheet: mixed-precision (fp16) 65.
 * A name that matches no row (A10G, RTX 4090 D, ...) is an unknown GPU: MFU is not guessed, and
 * $FITLLM_PEAK_TFLOPS gives the peak by hand. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "fitllm/perf.h"

typedef struct {
    const char *tokens[3]; /* every one must be a token of the name (NULL-terminated list) */
    double tflops;         /* 0: a known name with no figure here (unknown on purpose) */
    const char *dtype, *model;
} peak_row;

/* First match wins: the more specific rows (PCIe, NVL, L40S) before the general ones. */
static const peak_row k_rows[] = {
    {{"H100", "NVL"}, 835.5, "bf16", "H100 NVL"},
    {{"H100", "PCIe"}, 756.5, "bf16", "H100 PCIe"},
    {{"H100"}, 989.5, "bf16", "H100 SXM"},
    {{"H800", "PCIe"}, 756.5, "bf16", "H800 PCIe"},
    {{"H800"}, 989.5, "bf16", "H800 SXM"},
    {{"H200", "NVL"}, 835.5, "bf16", "H200 NVL"},
    {{"H200"}, 989.5, "bf16", "H200 SXM"},
    {{"GH200"}, 989.5, "bf16", "GH200"},
    {{"B200"}, 2250.0, "bf16", "B200"},
    {{"A100"}, 312.0, "bf16", "A100"},
    {{"A800"}, 312.0, "bf16", "A800"},
    {{"L40S"}, 362.05, "bf16", "L40S"},
    {{"L40"}, 181.05, "bf16", "L40"},
    {{"L4"}, 121.0, "bf16", "L4"},
    {{"A10"}, 125.0, "bf16", "A10"},
    {{"A40"}, 149.7, "bf16", "A40"},
    {{"4090", "D"}, 0.0, "bf16", NULL}, /* the China variant: fewer SMs, no published figure */
    {{"RTX", "4090"}, 165.2, "bf16", "GeForce RTX 4090"},
    {{"3090", "Ti"}, 0.0, "bf16", NULL}, /* another GA102 bin: not the 3090's figure */
    {{"RTX", "3090"}, 71.0, "bf16", "GeForce RTX 3090"},
    {{"V100S"}, 130.0, "fp16", "V100S PCIe"},
    {{"V100", "PCIE"}, 112.0, "fp16", "V100 PCIe"},
    {{"V100"}, 125.0, "fp16", "V100 SXM2"},
    {{"T4"}, 65.0, "fp16", "T4"},
};

/* 1 when `tok` is one of the name's tokens (split at spaces, '-', '_' and '/'), case-insensitive. */
static int has_token(const char *name, const char *tok) {
    size_t tl = strlen(tok);
    for (const char *s = name; *s;) {
        while (*s && (isspace((unsigned char)*s) || *s == '-' || *s == '_' || *s == '/')) s++;
        const char *e = s;
        while (*e && !(isspace((unsigned char)*e) || *e == '-' || *e == '_' || *e == '/')) e++;
        if ((size_t)(e - s) == tl && tl && !strncasecmp(s, tok, tl)) return 1;
        s = e;
    }
    return 0;
}

fl_gpu_peak fl_gpu_peak_lookup(const char *name) {
    fl_gpu_peak r = {0.0, "bf16", NULL};
    if (!name) return r;
    for (size_t i = 0; i < sizeof k_rows / sizeof k_rows[0]; i++) {
        const peak_row *w = &k_rows[i];
        int all = 1;
        for (int t = 0; t < 3 && w->tokens[t]; t++) all &= has_token(name, w->tokens[t]);
        if (!all) continue;
        r.tflops = w->tflops;
        r.dtype = w->dtype;
        r.model = w->model;
        return r;
    }
    return r;
}

int fl_backend_peak(const fl_backend *be, fl_gpu_peak *out) {
    if (!be || !be->device_name) return 0;
    *out = fl_gpu_peak_lookup(be->device_name);
    const char *e = getenv("FITLLM_PEAK_TFLOPS");
    if (e && *e) {
        char *end;
        double v = strtod(e, &end);
        if (*end == '\0' && v > 0) {
            out->tflops = v;
            out->model = "FITLLM_PEAK_TFLOPS";
        }
    }
    return 1;
}

int fl_mfu_line(const fl_backend *be, double model_tflops, char *buf, size_t n, double *mfu) {
    fl_gpu_peak pk;
    if (mfu) *mfu = -1;
    if (n) buf[0] = '\0';
    if (!fl_backend_peak(be, &pk)) return 0;
    if (pk.tflops <= 0) {
        snprintf(buf, n, "MFU: unknown GPU '%s' (no dense peak in the table; FITLLM_PEAK_TFLOPS=X gives one)",
                 be->device_name);
        return 1;
    }
    double f = model_tflops / pk.tflops;
    if (mfu) *mfu = f;
    snprintf(buf, n, "MFU %.1f%% (%.1f model TFLOP/s of %s's %.1f dense %s TFLOP/s%s%s)", 100.0 * f, model_tflops,
             be->device_name, pk.tflops, pk.dtype, pk.model && !strcmp(pk.model, "FITLLM_PEAK_TFLOPS") ? ", from " : "",
             pk.model && !strcmp(pk.model, "FITLLM_PEAK_TFLOPS") ? "FITLLM_PEAK_TFLOPS" : "");
    return 1;
}
