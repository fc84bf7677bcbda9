/* LitGPT checkpoint folders: model_config.yaml (litgpt.Config's fields, written by
 * `litgpt download` beside lit_model.pth) to a model config, through the same
 * reader pretrain uses for a recipe's `model_config:` (src/config/model_config.c),
 * so a field fitllm cannot build (GPT-NeoX's parallel residual, partial rotary,
 * MoE, ...) is refused naming the field. LitGPT keeps a separate lm_head. */
#include "fitllm/config.h"
#include "fitllm/torch_ckpt.h"

#include "core/fs.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

fl_status fl_lit_load_config(const char *yaml_path, fl_model_config *mc) {
    FILE *f = fopen(yaml_path, "rb");
    if (!f) return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open: %s", yaml_path, strerror(errno));
    /* the file's mapping nested under model_config: (each line indented by two) */
    size_t cap = 1 << 14, len = 0;
    char *b = malloc(cap), line[4096];
    if (b) len = (size_t)snprintf(b, cap, "model_config:\n");
    while (b && fgets(line, sizeof line, f)) {
        size_t l = strlen(line);
        if (len + l + 4 > cap) {
            char *nb = cap > (1u << 24) ? NULL : realloc(b, cap *= 2);
            if (!nb) { free(b); b = NULL; break; }
            b = nb;
        }
        len += (size_t)snprintf(b + len, cap - len, "  %s", line);
    }
    fclose(f);
    if (!b) return fl_errorf(FL_ERR_OOM, "%s: too large or out of memory", yaml_path);
    fl_run_config *rc = calloc(1, sizeof *rc);
    if (!rc) { free(b); return fl_errorf(FL_ERR_OOM, "%s: out of memory", yaml_path); }
    fl_cfg_defaults(rc, FL_CMD_PRETRAIN);
    int have = 0;
    fl_status s = fl_cfg_apply_yaml(rc, b, len, yaml_path);
    if (s == FL_OK) s = fl_cfg_model_config(rc, mc, &have);
    if (s == FL_OK && !have) s = fl_errorf(FL_ERR_FORMAT, "%s: no litgpt.Config fields", yaml_path);
    if (s != FL_OK) s = fl_error_prefix(s, "%s", yaml_path);
    free(rc);
    free(b);
    return s;
}
