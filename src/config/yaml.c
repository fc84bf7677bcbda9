/* YAML recipes through libyaml: the document is walked and every leaf becomes a
 * dotted option ("train.micro_batch_size" = "8") in an fl_cfg_entries list, so
 * YAML and the command line share one parser and one set of error messages, and
 * are merged before any value is applied (entries.c). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "config-impl.h"

#define MAX_YAML_BYTES (16u << 20)
/* Mapping entries walked per document. Aliases let a document repeat a mapping inside itself:
 * 40 lines of "mK: &mK {a: *mK-1, b: *mK-1}" would be walked 2^40 times (a "billion laughs"). */
#define MAX_YAML_WALK 100000
static _Thread_local unsigned long g_walked;

static fl_status walk(fl_cfg_entries *c, yaml_document_t *doc, yaml_node_t *node, const char *prefix,
                      const char *source);

static fl_status set_leaf(fl_cfg_entries *c, const char *key, const char *val, const yaml_node_t *node,
                          const char *source) {
    char where[FL_CFG_PATH + 32];
    snprintf(where, sizeof where, "%s:%lu", source, (unsigned long)node->start_mark.line + 1);
    return fl_cfg_entries_add(c, key, val, where, 0);
}

static const char *scalar_value(const yaml_node_t *n) {
    const char *v = (const char *)n->data.scalar.value;
    /* A plain empty scalar ("max_steps:") is YAML null. */
    if (n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE && n->data.scalar.length == 0) return "null";
    return v;
}

static fl_status walk(fl_cfg_entries *c, yaml_document_t *doc, yaml_node_t *node, const char *prefix,
                      const char *source) {
    if (node->type != YAML_MAPPING_NODE)
        return fl_errorf(FL_ERR_INVALID, "%s:%lu: expected a mapping of options%s%s", source,
                         (unsigned long)node->start_mark.line + 1, *prefix ? " under " : "", prefix);
    for (yaml_node_pair_t *p = node->data.mapping.pairs.start; p < node->data.mapping.pairs.top; p++) {
        if (++g_walked > MAX_YAML_WALK)
            return fl_errorf(FL_ERR_INVALID, "%s:%lu: more than %d options to walk (aliases repeating a mapping?)", source,
                             (unsigned long)node->start_mark.line + 1, MAX_YAML_WALK);
        yaml_node_t *k = yaml_document_get_node(doc, p->key), *v = yaml_document_get_node(doc, p->value);
        if (!k || !v || k->type != YAML_SCALAR_NODE)
            return fl_errorf(FL_ERR_INVALID, "%s: malformed mapping key near line %lu", source,
                             (unsigned long)(k ? k->start_mark.line + 1 : 0));
        /* an empty name is no option, and it would not lengthen the dotted key: a mapping that holds
         * itself through an alias under an empty key recursed until the stack overflowed */
        if (k->data.scalar.length == 0)
            return fl_errorf(FL_ERR_INVALID, "%s:%lu: empty option name", source, (unsigned long)k->start_mark.line + 1);
        /* a key given twice in one mapping: libyaml keeps both, PyYAML (LitGPT) the last one whole (a second train:
         * mapping replaces the first), fitllm merged them; either way one of the two is not what was meant. Bounded:
         * a mapping with more keys than a recipe can have (entries.c: 4096) is refused there anyway */
        for (yaml_node_pair_t *q = node->data.mapping.pairs.start; q < p && p - q <= 4096; q++) {
            yaml_node_t *k0 = yaml_document_get_node(doc, q->key);
            if (k0 && k0->type == YAML_SCALAR_NODE && k0->data.scalar.length == k->data.scalar.length &&
                !memcmp(k0->data.scalar.value, k->data.scalar.value, k->data.scalar.length))
                return fl_errorf(FL_ERR_INVALID, "%s:%lu: '%s%s%s' is given twice in the same mapping (first at line "
                                 "%lu); give it once", source, (unsigned long)k->start_mark.line + 1, prefix,
                                 *prefix ? "." : "", (const char *)k->data.scalar.value,
                                 (unsigned long)k0->start_mark.line + 1);
        }
        char key[256];
        int n = snprintf(key, sizeof key, "%s%s%s", prefix, *prefix ? "." : "", (const char *)k->data.scalar.value);
        if (n < 0 || (size_t)n >= sizeof key) return fl_errorf(FL_ERR_INVALID, "%s: key too long", source);
        if (v->type == YAML_SCALAR_NODE) {
            FL_TRY(set_leaf(c, key, scalar_value(v), v, source));
        } else if (v->type == YAML_MAPPING_NODE) {
            /* data: {class_path: ..., init_args: {...}} -> data.class_path, data.init_args.* */
            FL_TRY(walk(c, doc, v, key, source));
        } else if (v->type == YAML_SEQUENCE_NODE) {
            char buf[512] = "[";
            size_t off = 1;
            for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top; it++) {
                yaml_node_t *e = yaml_document_get_node(doc, *it);
                if (!e || e->type != YAML_SCALAR_NODE)
                    return fl_errorf(FL_ERR_INVALID, "%s:%lu: option '%s' must be a list of scalars", source,
                                     (unsigned long)v->start_mark.line + 1, key);
                off += (size_t)snprintf(buf + off, sizeof buf - off, "%s%s", off > 1 ? ", " : "",
                                        (const char *)e->data.scalar.value);
                if (off >= sizeof buf - 2) return fl_errorf(FL_ERR_INVALID, "%s: list '%s' too long", source, key);
            }
            snprintf(buf + off, sizeof buf - off, "]");
            FL_TRY(set_leaf(c, key, buf, v, source));
        }
    }
    return FL_OK;
}

fl_status fl_cfg_entries_load_yaml(fl_cfg_entries *c, const char *text, size_t n, const char *source) {
    yaml_parser_t parser;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&parser)) return fl_errorf(FL_ERR_OOM, "%s: cannot initialize the YAML parser", source);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, n);
    if (!yaml_parser_load(&parser, &doc)) {
        fl_status s = fl_errorf(FL_ERR_INVALID, "%s:%lu:%lu: malformed YAML: %s%s%s", source,
                                (unsigned long)parser.problem_mark.line + 1, (unsigned long)parser.problem_mark.column + 1,
                                parser.problem ? parser.problem : "syntax error", parser.context ? " " : "",
                                parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        return s;
    }
    fl_status s = FL_OK;
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    g_walked = 0;
    if (root && !(root->type == YAML_SCALAR_NODE && root->data.scalar.length == 0))
        s = walk(c, &doc, root, "", source);
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    return s;
}

fl_status fl_cfg_entries_load_yaml_file(fl_cfg_entries *c, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return fl_errorf(FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *buf = malloc(MAX_YAML_BYTES + 1);
    if (!buf) { fclose(f); return fl_errorf(FL_ERR_OOM, "%s: out of host memory", path); }
    size_t n = fread(buf, 1, MAX_YAML_BYTES + 1, f);
    int err = ferror(f);
    fclose(f);
    fl_status s;
    if (err) s = fl_errorf(FL_ERR_IO, "%s: read error", path);
    else if (n > MAX_YAML_BYTES) s = fl_errorf(FL_ERR_INVALID, "%s: larger than 16 MiB; not a recipe", path);
    else s = fl_cfg_entries_load_yaml(c, buf, n, path);
    free(buf);
    return s;
}

/* Apply a recipe on its own (the command line merges first: fl_cfg_apply_entries). */
fl_status fl_cfg_apply_yaml(fl_run_config *c, const char *text, size_t n, const char *source) {
    fl_cfg_entries l;
    fl_cfg_entries_init(&l);
    fl_status s = fl_cfg_entries_load_yaml(&l, text, n, source);
    if (s == FL_OK) s = fl_cfg_apply_entries(c, &l, NULL);
    fl_cfg_entries_free(&l);
    return s;
}

fl_status fl_cfg_apply_yaml_file(fl_run_config *c, const char *path) {
    fl_cfg_entries l;
    fl_cfg_entries_init(&l);
    fl_status s = fl_cfg_entries_load_yaml_file(&l, path);
    if (s == FL_OK) s = fl_cfg_apply_entries(c, &l, NULL);
    fl_cfg_entries_free(&l);
    return s;
}
