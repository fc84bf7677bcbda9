/* Adapters on LINEAR ops (model.h): the rewrite's table behind its interface (struct fl_adapter_table, model-impl.h).
 * The model runs what is attached (fl_linear_forward / _backward call each adapter after the base), binds it through
 * the table's bind and tells the owner about the arena, live bytes, merged reads and teardown through its hooks; it
 * never calls into the owner, and a model without adapters never enters this file. */
#include <stdlib.h>
#include <string.h>

#include "model-impl.h"

/* the table: per LINEAR (block l's linear p at l * FL_GRAPH_MAX_LINEARS + p, the head last) the adapters in attach
 * order */
typedef struct {
    struct fl_adapter_table pub; /* first: m->adapt points here */
    int n_keys;
    const fl_linear_adapter ***list; /* (n_keys) */
    int *count;                      /* (n_keys) */
} table;

static void bind(const struct fl_adapter_table *pub, int l, int p, fl_linear *lin, int row_base) {
    const table *t = (const table *)pub;
    const int k = l < 0 ? t->n_keys - 1 : l * FL_GRAPH_MAX_LINEARS + p;
    lin->n_adapters = t->count[k];
    lin->adapters = t->count[k] ? t->list[k] : NULL;
    lin->row_base = row_base;
}

fl_status fl_model_adapters_begin(fl_model *m, const fl_adapter_hooks *h) {
    if (m->adapt) return fl_errorf(FL_ERR_INVALID, "the model has adapters attached already");
    table *t = calloc(1, sizeof *t);
    if (!t) return fl_errorf(FL_ERR_OOM, "adapters: out of host memory");
    t->pub.h = *h;
    t->pub.bind = bind;
    t->n_keys = (m->cfg.n_layers + m->cfg.n_dec_layers) * FL_GRAPH_MAX_LINEARS + 1; /* every stack's blocks */
    t->list = calloc((size_t)t->n_keys, sizeof *t->list);
    t->count = calloc((size_t)t->n_keys, sizeof *t->count);
    if (!t->list || !t->count) {
        free(t->list), free(t->count), free(t);
        return fl_errorf(FL_ERR_OOM, "adapters: out of host memory");
    }
    m->adapt = &t->pub;
    return FL_OK;
}

fl_status fl_model_attach_adapter(fl_model *m, int block, int linear, const fl_linear_adapter *a) {
    table *t = (table *)m->adapt;
    if (!t) return fl_errorf(FL_ERR_INVALID, "fl_model_attach_adapter: no fl_model_adapters_begin");
    if (block < -1 || block >= m->cfg.n_layers + m->cfg.n_dec_layers || (block >= 0 && (linear < 0 || linear >= FL_GRAPH_MAX_LINEARS)))
        return fl_errorf(FL_ERR_INVALID, "fl_model_attach_adapter: no LINEAR %d in block %d", linear, block);
    const int k = block < 0 ? t->n_keys - 1 : block * FL_GRAPH_MAX_LINEARS + linear;
    const fl_linear_adapter **l = realloc(t->list[k], (size_t)(t->count[k] + 1) * sizeof *l);
    if (!l) return fl_errorf(FL_ERR_OOM, "adapters: out of host memory");
    l[t->count[k]++] = a;
    t->list[k] = l;
    t->pub.head = t->count[t->n_keys - 1] > 0;
    /* bf16 stored on an FL_CAP_VIEWS16 backend: an arena made before may lack the fp32 view the adapter reads (its
     * linear's input, acts.c's drop32) */
    const fl_acts *ac = m->acts;
    const unsigned lost = ac && ac->drop32 && !ac->kind ? ac->drop32 & ~fl_block_views_dropped(m, ac->graph) : 0;
    /* ... or the width of an fp32 gradient its linear's backward then writes (acts.c's gdrop) */
    const unsigned glost = ac && ac->gdrop && !ac->kind ? ac->gdrop & ~fl_block_grads_dropped(m, ac->graph, ac->dyb16 && !ac->xb16) : 0;
    for (int s = 0; (lost | glost) && s < FL_GRAPH_MAX_SLOTS; s++)
        if ((lost | glost) >> s & 1u) {
            t->count[k]--; /* refused: the table as it was */
            t->pub.head = t->count[t->n_keys - 1] > 0;
            return fl_errorf(FL_ERR_INVALID, "fl_model_attach_adapter: the activations were allocated before it and "
                             "left out the fp32 %s of '%s' it %s (attach adapters before fl_model_alloc_acts)",
                             lost >> s & 1u ? "view" : "gradient", ac->graph->slot[s].name,
                             lost >> s & 1u ? "reads" : "needs");
        }
    return FL_OK;
}

void fl_model_adapters_merged(fl_model *m) {
    if (m->adapt) m->adapt->merged = 1;
}

void fl_model_detach_adapters(fl_model *m) {
    table *t = (table *)m->adapt;
    if (!t) return;
    if (t->pub.h.free_acts) t->pub.h.free_acts(m);
    if (t->pub.h.release) t->pub.h.release(m);
    for (int k = 0; k < t->n_keys; k++) free(t->list[k]);
    free(t->list), free(t->count), free(t);
    m->adapt = NULL;
}
