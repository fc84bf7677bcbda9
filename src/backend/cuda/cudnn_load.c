/* Opening cuDNN at run time (contract: cudnn-impl.h). Nothing here includes cuDNN's headers: the
 * symbols are taken as plain C function pointers, so this file is in every build and its failure
 * paths (no library, a library without a symbol, one too old) are tested without cuDNN. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <glob.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cudnn-impl.h"

void fl_cudnn_unload(fl_cudnn_api *api) {
    if (!api) return;
    if (api->lib) dlclose(api->lib);
    memset(api, 0, sizeof *api);
}

static int load_fail(fl_cudnn_api *api, char *why, size_t n, const char *fmt, const char *a, const char *b) {
    if (why && n) snprintf(why, n, fmt, a, b);
    fl_cudnn_unload(api);
    return -1;
}

int fl_cudnn_search(char *out, size_t n) {
    static const char *const wheel = "lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn.so.9";
    const char *venv = getenv("VIRTUAL_ENV"), *conda = getenv("CONDA_PREFIX"), *home = getenv("HOME");
    char pat[12][512];
    int np = 0;
    if (venv && *venv) snprintf(pat[np++], sizeof pat[0], "%s/%s", venv, wheel);
    if (conda && *conda) {
        snprintf(pat[np++], sizeof pat[0], "%s/%s", conda, wheel);
        snprintf(pat[np++], sizeof pat[0], "%s/lib/libcudnn.so.9", conda);
    }
    if (home && *home) snprintf(pat[np++], sizeof pat[0], "%s/.local/%s", home, wheel);
    static const char *const sys[] = {"/usr/local/lib/python3*/dist-packages/nvidia/cudnn/lib/libcudnn.so.9",
                                      "/usr/local/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn.so.9",
                                      "/usr/lib/python3/dist-packages/nvidia/cudnn/lib/libcudnn.so.9",
                                      "/usr/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn.so.9",
                                      "/usr/local/cuda/lib64/libcudnn.so.9", "/usr/local/cuda/lib/libcudnn.so.9"};
    for (size_t i = 0; i < sizeof sys / sizeof sys[0]; i++) snprintf(pat[np++], sizeof pat[0], "%s", sys[i]);
    for (int i = 0; i < np; i++) {
        glob_t g;
        memset(&g, 0, sizeof g);
        const int found = glob(pat[i], 0, NULL, &g) == 0 && g.gl_pathc > 0;
        if (found) snprintf(out, n, "%s", g.gl_pathv[0]);
        globfree(&g);
        if (found) return 1;
    }
    return 0;
}

int fl_cudnn_load(fl_cudnn_api *api, const char *path, char *why, size_t n) {
    memset(api, 0, sizeof *api);
    const char *env = getenv("FITLLM_CUDNN_LIB");
    if (!path && env && *env) path = env;
    const char *tried = path ? path : "libcudnn.so.9 or libcudnn.so";
    char found[512];
    if (path) api->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    else {
        api->lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
        if (!api->lib) api->lib = dlopen("libcudnn.so", RTLD_NOW | RTLD_LOCAL);
        if (!api->lib && fl_cudnn_search(found, sizeof found)) { /* PyTorch's wheel, conda, the toolkit's folder */
            tried = found;
            api->lib = dlopen(found, RTLD_NOW | RTLD_LOCAL);
        }
    }
    if (!api->lib) {
        const char *e = dlerror();
        if (path)
            return load_fail(api, why, n, "cuDNN not found (%s: %s; install cuDNN 9, e.g. the cudnn9-cuda-13 package or "
                             "PyTorch's nvidia-cudnn wheel, or name it with FITLLM_CUDNN_LIB)", tried,
                             e ? e : "dlopen failed");
        return load_fail(api, why, n, "cuDNN not found (%s: %s; nor PyTorch's nvidia-cudnn wheel under $VIRTUAL_ENV, "
                         "$CONDA_PREFIX, ~/.local or /usr/local/lib/python3*, nor /usr/local/cuda/lib64; install cuDNN "
                         "9, e.g. the cudnn9-cuda-13 package or that wheel, or name it with FITLLM_CUDNN_LIB)", tried,
                         e ? e : "dlopen failed");
    }
    /* name, slot: every one must resolve (a library that lacks one is not the cuDNN 9 this code is for) */
    struct { const char *name; void **slot; } sym[] = {
        {"cudnnGetVersion", (void **)&api->get_version},
        {"cudnnGetErrorString", (void **)&api->error_string},
        {"cudnnCreate", (void **)&api->create},
        {"cudnnDestroy", (void **)&api->destroy},
        {"cudnnSetStream", (void **)&api->set_stream},
        {"cudnnBackendCreateDescriptor", (void **)&api->be_create},
        {"cudnnBackendDestroyDescriptor", (void **)&api->be_destroy},
        {"cudnnBackendSetAttribute", (void **)&api->be_set},
        {"cudnnBackendGetAttribute", (void **)&api->be_get},
        {"cudnnBackendFinalize", (void **)&api->be_finalize},
        {"cudnnBackendExecute", (void **)&api->be_execute},
    };
    for (size_t i = 0; i < sizeof sym / sizeof sym[0]; i++) {
        *sym[i].slot = dlsym(api->lib, sym[i].name);
        if (!*sym[i].slot)
            return load_fail(api, why, n, "%s has no %s (not cuDNN 9's C API)", tried, sym[i].name);
    }
    api->version = api->get_version();
    if (api->version < FL_CUDNN_MIN_VERSION) {
        char v[32];
        snprintf(v, sizeof v, "%zu.%zu.%zu", api->version / 10000, api->version / 100 % 100, api->version % 100);
        return load_fail(api, why, n, "cuDNN %s is too old (%s; 9.0 or newer needed for the fused attention graphs)",
                         v, tried);
    }
    if (why && n) why[0] = '\0';
    return 0;
}

void fl_cudnn_describe(char *out, size_t n) {
    fl_cudnn_api api;
    char why[768];
    if (fl_cudnn_load(&api, NULL, why, sizeof why) != 0) {
        snprintf(out, n, "%s", why);
        return;
    }
    struct link_map *lm = NULL;
    const char *where = dlinfo(api.lib, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name ? lm->l_name : "?";
    snprintf(out, n, "%zu.%zu.%zu (%s)", api.version / 10000, api.version / 100 % 100, api.version % 100, where);
    fl_cudnn_unload(&api);
}

const char *fl_cudnn_status_name(const fl_cudnn_api *api, int status, char *buf, size_t n) {
    const char *s = api && api->error_string ? api->error_string(status) : NULL;
    if (s && *s) return s;
    snprintf(buf, n, "cudnn status %d", status);
    return buf;
}

int fl_cudnn_attn_parse(const char *env) {
    if (!env || !*env || !strcmp(env, "auto")) return FL_CUDNN_ATTN_AUTO;
    if (!strcmp(env, "cudnn")) return FL_CUDNN_ATTN_CUDNN;
    if (!strcmp(env, "own")) return FL_CUDNN_ATTN_OWN;
    if (!strcmp(env, "legacy")) return FL_CUDNN_ATTN_LEGACY;
    if (!strcmp(env, "fp32")) return FL_CUDNN_ATTN_FP32;
    return -1;
}
