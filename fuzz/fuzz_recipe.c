/* libFuzzer harness for run configurations.
 *
 * Default (fuzz_recipe_yaml): the bytes are a YAML recipe applied with
 * fl_cfg_apply_yaml over the defaults of a command (picked from the size), then
 * fl_cfg_validate. A recipe that validates is written back with
 * fl_cfg_write_yaml (as hyperparameters.yaml) and that text must apply and
 * validate again on fresh defaults (abort otherwise).
 *
 * -DFL_FUZZ_OVERRIDES (fuzz_recipe_overrides): the bytes are dotted
 * command-line overrides, one per line, "key=value" (or "key" alone, given as
 * "true"), applied in order with fl_cfg_set until one is refused, then
 * validated and written as above (when the input is valid UTF-8: YAML cannot hold other bytes). Build: fuzz/build.sh */
/* binaries built from this file (fuzz/harnesses.cmake reads these lines: name, then defines): */
// fuzz-build: fuzz_recipe_yaml
// fuzz-build: fuzz_recipe_overrides FL_FUZZ_OVERRIDES
#include "fuzz_util.h"

#include "data/data-impl.h"
#include "fitllm/config.h"

static fl_run_config g_c, g_c2; /* large (paths): static, not on the stack */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fl_cmd_kind cmd = (fl_cmd_kind)(size % FL_CMD_COUNT);
    fl_cfg_defaults(&g_c, cmd);
#ifndef FL_FUZZ_OVERRIDES
    if (fz_dbg(fl_cfg_apply_yaml(&g_c, (const char *)data, size, "fuzz.yaml")) != FL_OK) return 0;
#else
    char *text = malloc(size + 1);
    if (!text) abort();
    memcpy(text, data, size);
    text[size] = 0;
    fl_status s = FL_OK;
    for (char *line = text, *next; line && s == FL_OK; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        if (!*line) continue;
        char *eq = strchr(line, '=');
        if (eq) *eq = 0;
        s = fl_cfg_set(&g_c, line, eq ? eq + 1 : "true");
    }
    free(text);
    if (fz_dbg(s) != FL_OK) return 0;
    size_t bad;
    if (!fl_data_utf8_valid((const char *)data, size, &bad)) return 0; /* YAML holds UTF-8 text only: a path
                                                                           of other bytes cannot be written back */
#endif
    if (fz_dbg(fl_cfg_validate(&g_c)) != FL_OK) return 0;
    char *out = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&out, &n);
    if (!f) abort();
    fl_cfg_write_yaml(&g_c, f);
    fclose(f);
    fl_cfg_defaults(&g_c2, cmd);
    if (fl_cfg_apply_yaml(&g_c2, out, n, "written.yaml") != FL_OK || fl_cfg_validate(&g_c2) != FL_OK) {
        fprintf(stderr, "---- written YAML ----\n%.*s\n----\n", (int)n, out);
        FZ_CHECK(!"the written YAML applies and validates again");
    }
    free(out);
    return 0;
}
