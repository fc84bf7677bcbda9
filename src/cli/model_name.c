/* Models by name in the CLI: a Hugging Face repo id where a model is accepted resolves to the
 * downloaded folder (fitllm/hub.h); a preset (a shape without weights) is said to be one on
 * the first line of the output, so a run on random weights is never mistaken for fine-tuning. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "fitllm/checkpoint.h"
#include "fitllm/hub.h"

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static const char *g_cmd;   /* the running subcommand, for the notes of shared helpers */
static int g_said, g_own;   /* the random-init note was printed / the command prints it itself */

void fl_cli_set_command(const char *cmd) { g_cmd = cmd; }
int fl_cli_said_random(void) { return g_said; }
void fl_cli_own_random_note(void) { g_own = 1; }

/* "ORG/NAME" whose ORG is a folder here (out/mcro, a typo under ./out) is a path that is not
 * there, not a repo id: the command says "no such folder" */
static int local_path_like(const char *name) {
    const char *slash = strchr(name, '/');
    char first[FL_CLI_PATH];
    if (!slash || (size_t)(slash - name) >= sizeof first) return 0;
    snprintf(first, sizeof first, "%.*s", (int)(slash - name), name);
    struct stat st;
    return strcmp(first, "checkpoints") && stat(first, &st) == 0 && S_ISDIR(st.st_mode);
}

fl_status fl_cli_resolve_model(const char *cmd, const char *name, char *out, size_t n, int shape_ok) {
    if (!name || !name[0] || exists(name)) {
        snprintf(out, n, "%s", name ? name : "");
        return FL_OK;
    }
    fl_hub_where where;
    if (fl_hub_is_repo_id(name) && local_path_like(name)) {
        snprintf(out, n, "%s", name);
        return FL_OK;
    }
    fl_status s = fl_hub_resolve(name, out, n, &where);
    if (s == FL_OK) {
        if (cmd) {
            fflush(stdout);
            fprintf(stderr, "fitllm %s: %s is %s (%s)\n", cmd, name, out, fl_hub_where_name(where));
        }
        return FL_OK;
    }
    if (s == FL_ERR_INVALID) { /* no repo id: a preset, or an error that names it later */
        snprintf(out, n, "%s", name);
        return FL_OK;
    }
    char why[2048]; /* copied: fl_errorf rewrites the message it would read */
    snprintf(why, sizeof why, "%s", fl_error_message());
    fl_blip2_config bc; /* plan: a BLIP-2 preset's repo id (Salesforce/blip2-opt-2.7b) is its shape */
    if (shape_ok && fl_blip2_preset(name, &bc) == FL_OK) {
        snprintf(out, n, "%s", name);
        return FL_OK;
    }
    fl_model_config mc;
    char repo[256];
    int preset = fl_hub_repo_of(name, repo, sizeof repo) && fl_preset_find(repo, &mc) == FL_OK;
    if (preset && shape_ok) { /* plan: the preset of the same shape needs no weights */
        snprintf(out, n, "%s", repo);
        return FL_OK;
    }
    if (preset)
        return fl_errorf(FL_ERR_NOT_FOUND, "%s (or give the preset name '%s' for the model's shape with random "
                         "weights)", why, mc.name);
    return fl_errorf(FL_ERR_NOT_FOUND, "%s", why);
}

int fl_cli_model_arg(const char *cmd, const char **path, char *buf, size_t n) {
    if (fl_cli_resolve_model(cmd, *path, buf, n, 0) != FL_OK) {
        fflush(stdout);
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return FL_EXIT_RUNTIME;
    }
    *path = buf;
    return 0;
}

void fl_cli_note_random(const char *cmd, const char *why) {
    if (g_said) return; /* once: the command's own and a helper's would say the same */
    g_said = 1;
    if (!cmd) cmd = g_cmd;
    fflush(stdout);
    fprintf(stderr, "fitllm%s%s: random initialization (no weights were loaded): %s\n", cmd ? " " : "", cmd ? cmd : "",
            why);
}

void fl_cli_preset_weights_hint(const char *name, char *buf, size_t n) {
    const char *repo = fl_preset_repo_id(name);
    if (repo) snprintf(buf, n, "; for its weights run `fitllm download %s` and give %s", repo, repo);
    else if (n) buf[0] = 0;
}

void fl_cli_note_preset(const char *cmd, const char *name) {
    if (g_own && !cmd) return; /* the command says it, with its own details */
    fl_model_config mc;
    if (fl_preset_find(name, &mc) != FL_OK) return;
    const char *repo = fl_preset_repo_id(name);
    char why[512];
    if (repo)
        snprintf(why, sizeof why, "'%s' is a model preset (%s), the shape of %s only; for its weights run `fitllm "
                 "download %s` and give %s", name, mc.name, repo, repo, repo);
    else
        snprintf(why, sizeof why, "'%s' is a model preset, a model shape only", name);
    fl_cli_note_random(cmd, why);
}

void fl_cli_note_run_weights(const char *cmd, const fl_run_config *c) {
    const char *ck = c->checkpoint_dir;
    char why[FL_CFG_PATH + 128], last[FL_CFG_PATH + 64];
    size_t len = strlen(ck);
    /* a resumed run takes its weights from the checkpoint (--resume auto: when there is one) */
    if (c->resume[0] && strcmp(c->resume, "false") &&
        (strcmp(c->resume, "auto") || fl_ckpt_find_latest(c->out_dir, last, sizeof last) == FL_OK))
        return;
    if (c->command == FL_CMD_PRETRAIN && !ck[0] && (c->n_model_fields || c->model_config[0] || c->model_name[0])) {
        if (c->model_name[0] && !c->n_model_fields && !c->model_config[0])
            snprintf(why, sizeof why, "pretraining model_name %s from scratch", c->model_name);
        else
            snprintf(why, sizeof why, "pretraining from scratch (model_config)");
        fl_cli_note_random(cmd, why);
    } else if (ck[0] && !exists(ck)) {
        fl_cli_note_preset(cmd, ck); /* silent for a name that is no preset: the run fails and says so */
    } else if (ck[0] && c->init_random) {
        snprintf(why, sizeof why, "--init random: the shape of %s, fresh weights", ck);
        fl_cli_note_random(cmd, why);
    } else if (len > 5 && !strcmp(ck + len - 5, ".json")) {
        snprintf(why, sizeof why, "%s is a config.json, the model's shape only", ck);
        fl_cli_note_random(cmd, why);
    }
}
