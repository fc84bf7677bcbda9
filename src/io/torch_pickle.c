/* A restricted unpickler for the data.pkl of a torch.save'd state dict.
 *
 * Python's pickle is a program: GLOBAL names any importable callable and REDUCE
 * calls it, so loading an untrusted pytorch_model.bin with pickle runs whatever the
 * file says (torch.load's weights_only exists for this reason). This VM knows the
 * few opcodes torch.save writes for a dict of tensors and the few globals it names
 * (collections.OrderedDict, torch._utils._rebuild_tensor_v2 / _rebuild_parameter,
 * the torch.*Storage classes). Nothing is ever imported or called: the allowed
 * globals are interpreted here (an OrderedDict() is an empty dict, a
 * _rebuild_tensor_v2(...) call is a record of storage, offset and shape), and every
 * other opcode or global is refused by name when it is read. Protocol 2 is what
 * torch.save writes; the protocol 4 spellings of the same values (FRAME, MEMOIZE,
 * SHORT_BINUNICODE, STACK_GLOBAL) are accepted too.
 */
#include "io/torch-impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { V_NONE, V_BOOL, V_INT, V_STR, V_TUPLE, V_DICT, V_GLOBAL, V_STORAGE, V_TENSOR };
enum { G_ODICT, G_REBUILD_V2, G_REBUILD_PARAM, G_STORAGE };

/* Bounds that keep a hostile file from costing more than its size: every opcode
 * creates at most one value, and the stack and memo are capped. */
#define PK_MAX_STACK (1 << 20)
#define PK_MAX_MEMO (1 << 22)
#define PK_MAX_MARKS (1 << 16)

typedef struct pk_val {
    int kind;
    int64_t i;            /* V_INT, V_BOOL; V_STORAGE: numel */
    char *s;              /* V_STR (NUL-terminated copy); V_STORAGE: key */
    size_t slen;
    struct pk_val **it;   /* V_TUPLE items; V_DICT keys and values alternating (n / 2 pairs) */
    size_t n, cap;
    int g;                /* V_GLOBAL: G_*; V_STORAGE, V_GLOBAL G_STORAGE: dtype in dt */
    fl_dtype dt;
    fl_torch_rec *t;      /* V_TENSOR */
    struct pk_val *all;   /* every value, for freeing */
} pk_val;

typedef struct {
    const char *path;
    const uint8_t *p;
    size_t n, pos, op_at;
    pk_val *all;
    pk_val **stack;
    size_t sp, scap;
    size_t *marks;
    size_t nmarks, mcap;
    pk_val **memo;
    size_t memo_cap, memo_len; /* memo_len: filled slots (Python's len(memo), MEMOIZE's next index) */
} pk_vm;

static const char *pk_kind_name(int k) {
    static const char *n[] = {"None", "bool", "int", "str", "tuple", "dict", "global", "storage", "tensor"};
    return k >= 0 && k <= V_TENSOR ? n[k] : "?";
}

/* The standard pickle opcodes by byte, to name a refused one. */
static const char *pk_op_name(uint8_t op) {
    switch (op) {
    case '(': return "MARK"; case '.': return "STOP"; case '0': return "POP"; case '1': return "POP_MARK";
    case '2': return "DUP"; case 'F': return "FLOAT"; case 'I': return "INT"; case 'J': return "BININT";
    case 'K': return "BININT1"; case 'L': return "LONG"; case 'M': return "BININT2"; case 'N': return "NONE";
    case 'P': return "PERSID"; case 'Q': return "BINPERSID"; case 'R': return "REDUCE"; case 'S': return "STRING";
    case 'T': return "BINSTRING"; case 'U': return "SHORT_BINSTRING"; case 'V': return "UNICODE";
    case 'X': return "BINUNICODE"; case 'a': return "APPEND"; case 'b': return "BUILD"; case 'c': return "GLOBAL";
    case 'd': return "DICT"; case '}': return "EMPTY_DICT"; case 'e': return "APPENDS"; case 'g': return "GET";
    case 'h': return "BINGET"; case 'i': return "INST"; case 'j': return "LONG_BINGET"; case 'l': return "LIST";
    case ']': return "EMPTY_LIST"; case 'o': return "OBJ"; case 'p': return "PUT"; case 'q': return "BINPUT";
    case 'r': return "LONG_BINPUT"; case 's': return "SETITEM"; case 't': return "TUPLE"; case ')': return "EMPTY_TUPLE";
    case 'u': return "SETITEMS"; case 'G': return "BINFLOAT"; case 0x80: return "PROTO"; case 0x81: return "NEWOBJ";
    case 0x82: return "EXT1"; case 0x83: return "EXT2"; case 0x84: return "EXT4"; case 0x85: return "TUPLE1";
    case 0x86: return "TUPLE2"; case 0x87: return "TUPLE3"; case 0x88: return "NEWTRUE"; case 0x89: return "NEWFALSE";
    case 0x8a: return "LONG1"; case 0x8b: return "LONG4"; case 'B': return "BINBYTES"; case 'C': return "SHORT_BINBYTES";
    case 0x8c: return "SHORT_BINUNICODE"; case 0x8d: return "BINUNICODE8"; case 0x8e: return "BINBYTES8";
    case 0x8f: return "EMPTY_SET"; case 0x90: return "ADDITEMS"; case 0x91: return "FROZENSET";
    case 0x92: return "NEWOBJ_EX"; case 0x93: return "STACK_GLOBAL"; case 0x94: return "MEMOIZE"; case 0x95: return "FRAME";
    case 0x96: return "BYTEARRAY8"; case 0x97: return "NEXT_BUFFER"; case 0x98: return "READONLY_BUFFER";
    default: return NULL;
    }
}

static fl_status pk_err(pk_vm *vm, const char *what) {
    return fl_errorf(FL_ERR_FORMAT, "%s: data.pkl: %s (at byte %zu)", vm->path, what, vm->op_at);
}

static pk_val *pk_new(pk_vm *vm, int kind) {
    pk_val *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    v->kind = kind;
    v->all = vm->all;
    vm->all = v;
    return v;
}

static void pk_free_all(pk_vm *vm) {
    for (pk_val *v = vm->all, *nx; v; v = nx) {
        nx = v->all;
        free(v->s);
        free(v->it);
        free(v->t);
        free(v);
    }
    vm->all = NULL;
    free(vm->stack);
    free(vm->marks);
    free(vm->memo);
}

static fl_status pk_oom(pk_vm *vm) { return fl_errorf(FL_ERR_OOM, "%s: out of memory reading data.pkl", vm->path); }

static fl_status pk_push(pk_vm *vm, pk_val *v) {
    if (!v) return pk_oom(vm);
    if (vm->sp == vm->scap) {
        if (vm->scap >= PK_MAX_STACK) return pk_err(vm, "pickle stack deeper than 2^20 values");
        size_t c = vm->scap ? vm->scap * 2 : 64;
        pk_val **ns = realloc(vm->stack, c * sizeof *ns);
        if (!ns) return pk_oom(vm);
        vm->stack = ns;
        vm->scap = c;
    }
    vm->stack[vm->sp++] = v;
    return FL_OK;
}

/* The stack above the innermost mark must hold at least k values. */
static size_t pk_floor(const pk_vm *vm) { return vm->nmarks ? vm->marks[vm->nmarks - 1] : 0; }

static pk_val *pk_pop(pk_vm *vm) { return vm->sp > pk_floor(vm) ? vm->stack[--vm->sp] : NULL; }

static pk_val *pk_top(pk_vm *vm) { return vm->sp > pk_floor(vm) ? vm->stack[vm->sp - 1] : NULL; }

static int pk_need(pk_vm *vm, size_t k) { return vm->sp - pk_floor(vm) >= k; }

static fl_status pk_append(pk_vm *vm, pk_val *c, pk_val *x) {
    if (c->n == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 4;
        pk_val **ni = realloc(c->it, cap * sizeof *ni);
        if (!ni) return pk_oom(vm);
        c->it = ni;
        c->cap = cap;
    }
    c->it[c->n++] = x;
    return FL_OK;
}

/* A tuple of the k values on top of the stack (k = -1: those above the innermost mark, which is popped). */
static fl_status pk_tuple(pk_vm *vm, long k) {
    size_t from;
    if (k < 0) {
        if (!vm->nmarks) return pk_err(vm, "TUPLE without a MARK");
        from = vm->marks[--vm->nmarks];
    } else {
        if (!pk_need(vm, (size_t)k)) return pk_err(vm, "TUPLE of more values than the stack holds");
        from = vm->sp - (size_t)k;
    }
    pk_val *t = pk_new(vm, V_TUPLE);
    if (!t) return pk_oom(vm);
    for (size_t i = from; i < vm->sp; i++) FL_TRY(pk_append(vm, t, vm->stack[i]));
    vm->sp = from;
    return pk_push(vm, t);
}

static int pk_read(pk_vm *vm, void *dst, size_t k) {
    if (k > vm->n - vm->pos) return -1;
    memcpy(dst, vm->p + vm->pos, k);
    vm->pos += k;
    return 0;
}

static uint64_t pk_le(const uint8_t *b, int k) {
    uint64_t x = 0;
    for (int i = k - 1; i >= 0; i--) x = (x << 8) | b[i];
    return x;
}

static fl_status pk_str(pk_vm *vm, size_t len) {
    if (len > vm->n - vm->pos) return pk_err(vm, "string runs past the end of data.pkl (truncated?)");
    pk_val *v = pk_new(vm, V_STR);
    if (!v || !(v->s = malloc(len + 1))) return pk_oom(vm);
    memcpy(v->s, vm->p + vm->pos, len);
    v->s[len] = 0;
    v->slen = len;
    vm->pos += len;
    return pk_push(vm, v);
}

static fl_status pk_put(pk_vm *vm, uint64_t idx) {
    pk_val *v = pk_top(vm);
    if (!v) return pk_err(vm, "memo PUT with an empty stack");
    if (idx >= PK_MAX_MEMO) return pk_err(vm, "memo index above 2^22");
    if (idx >= vm->memo_cap) {
        size_t c = vm->memo_cap ? vm->memo_cap : 64;
        while (c <= idx) c *= 2;
        pk_val **nm = realloc(vm->memo, c * sizeof *nm);
        if (!nm) return pk_oom(vm);
        memset(nm + vm->memo_cap, 0, (c - vm->memo_cap) * sizeof *nm);
        vm->memo = nm;
        vm->memo_cap = c;
    }
    if (!vm->memo[idx]) vm->memo_len++;
    vm->memo[idx] = v;
    return FL_OK;
}

static fl_status pk_get(pk_vm *vm, uint64_t idx) {
    if (idx >= vm->memo_cap || !vm->memo[idx]) {
        char m[96];
        snprintf(m, sizeof m, "memo GET of index %llu that was never PUT", (unsigned long long)idx);
        return pk_err(vm, m);
    }
    return pk_push(vm, vm->memo[idx]);
}

/* GLOBAL module.name: only the ones a state dict needs. */
static fl_status pk_global(pk_vm *vm, const char *mod, const char *name) {
    static const struct { const char *name; fl_dtype dt; } storages[] = {
        {"FloatStorage", FL_F32}, {"HalfStorage", FL_F16}, {"BFloat16Storage", FL_BF16}, {"DoubleStorage", FL_F64},
        {"LongStorage", FL_I64}, {"IntStorage", FL_I32}, {"ByteStorage", FL_U8},
    };
    pk_val *g = pk_new(vm, V_GLOBAL);
    if (!g) return pk_oom(vm);
    if (!strcmp(mod, "collections") && !strcmp(name, "OrderedDict")) g->g = G_ODICT;
    else if (!strcmp(mod, "torch._utils") && !strcmp(name, "_rebuild_tensor_v2")) g->g = G_REBUILD_V2;
    else if (!strcmp(mod, "torch._utils") && !strcmp(name, "_rebuild_parameter")) g->g = G_REBUILD_PARAM;
    else {
        int k = -1;
        for (int i = 0; mod && !strcmp(mod, "torch") && i < (int)(sizeof storages / sizeof storages[0]); i++)
            if (!strcmp(name, storages[i].name)) k = i;
        if (k < 0) {
            if (!strcmp(mod, "torch") && strlen(name) > 7 && !strcmp(name + strlen(name) - 7, "Storage"))
                return fl_errorf(FL_ERR_UNSUPPORTED, "%s: tensors of torch.%s are not supported (float, half, bfloat16, "
                                 "double, long, int, byte storages are)", vm->path, name);
            return fl_errorf(FL_ERR_FORMAT, "%s: pickle global %.100s.%.100s is not allowed (only torch state dicts are "
                             "read; at byte %zu of data.pkl)", vm->path, mod, name, vm->op_at);
        }
        g->g = G_STORAGE;
        g->dt = storages[k].dt;
    }
    return pk_push(vm, g);
}

/* GLOBAL's operand: "module\nname\n". */
static fl_status pk_global_text(pk_vm *vm) {
    const char *b = (const char *)vm->p + vm->pos, *end = (const char *)vm->p + vm->n;
    const char *nl1 = memchr(b, '\n', (size_t)(end - b));
    const char *nl2 = nl1 ? memchr(nl1 + 1, '\n', (size_t)(end - nl1 - 1)) : NULL;
    if (!nl2 || nl1 - b > 200 || nl2 - nl1 > 200) return pk_err(vm, "GLOBAL operand is not 'module\\nname\\n'");
    char mod[256], name[256];
    snprintf(mod, sizeof mod, "%.*s", (int)(nl1 - b), b);
    snprintf(name, sizeof name, "%.*s", (int)(nl2 - nl1 - 1), nl1 + 1);
    vm->pos = (size_t)(nl2 + 1 - (const char *)vm->p);
    return pk_global(vm, mod, name);
}

/* A persistent id: ('storage', torch.XStorage, key, location, numel). */
static fl_status pk_persid(pk_vm *vm) {
    pk_val *t = pk_pop(vm);
    if (!t) return pk_err(vm, "BINPERSID with an empty stack");
    if (t->kind != V_TUPLE || t->n != 5 || t->it[0]->kind != V_STR || strcmp(t->it[0]->s, "storage") ||
        t->it[1]->kind != V_GLOBAL || t->it[1]->g != G_STORAGE || t->it[2]->kind != V_STR || t->it[3]->kind != V_STR ||
        t->it[4]->kind != V_INT || t->it[4]->i < 0)
        return pk_err(vm, "persistent id is not ('storage', torch.<type>Storage, key, location, numel)");
    const char *key = t->it[2]->s;
    int ok = key[0] != 0 && t->it[2]->slen < 64;
    for (const char *c = key; ok && *c; c++) ok = (*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || *c == '_';
    if (!ok) return pk_err(vm, "storage key is not a short name of letters, digits and '_'");
    pk_val *s = pk_new(vm, V_STORAGE);
    if (!s || !(s->s = strdup(key))) return pk_oom(vm);
    s->dt = t->it[1]->dt;
    s->i = t->it[4]->i;
    return pk_push(vm, s);
}

static int pk_int_tuple(const pk_val *t, int64_t *out) {
    if (t->kind != V_TUPLE || t->n > 8) return -1;
    for (size_t i = 0; i < t->n; i++) {
        if (t->it[i]->kind != V_INT || t->it[i]->i < 0) return -1;
        out[i] = t->it[i]->i;
    }
    return 0;
}

/* _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]) */
static fl_status pk_rebuild_tensor(pk_vm *vm, const pk_val *a, pk_val **out) {
    int64_t stride[8];
    if (a->n < 6 || a->n > 7 || a->it[0]->kind != V_STORAGE || a->it[1]->kind != V_INT || a->it[1]->i < 0 ||
        a->it[2]->kind != V_TUPLE || a->it[3]->kind != V_TUPLE || a->it[2]->n != a->it[3]->n ||
        a->it[4]->kind != V_BOOL || a->it[5]->kind != V_DICT || (a->n == 7 && a->it[6]->kind != V_NONE && a->it[6]->kind != V_DICT))
        return pk_err(vm, "_rebuild_tensor_v2 arguments are not (storage, offset, size, stride, requires_grad, hooks)");
    fl_torch_rec *r = calloc(1, sizeof *r);
    pk_val *v = pk_new(vm, V_TENSOR);
    if (!r || !v) { free(r); return pk_oom(vm); }
    v->t = r;
    if (pk_int_tuple(a->it[2], r->shape) || pk_int_tuple(a->it[3], stride))
        return pk_err(vm, "tensor size or stride is not a tuple of at most 8 non-negative ints");
    const pk_val *st = a->it[0];
    r->ndim = (int)a->it[2]->n;
    r->dtype = st->dt;
    r->storage_numel = st->i;
    r->offset = a->it[1]->i;
    r->storage_key = st->s; /* borrowed until the records are copied out */
    /* contiguous (row-major) is all the loaders read in place; numel bounded by the storage */
    int64_t numel = 1, want = 1;
    int contiguous = 1;
    for (int d = r->ndim - 1; d >= 0; d--) {
        if (r->shape[d] != 1 && stride[d] != want) contiguous = 0;
        if (r->shape[d] && want > INT64_MAX / r->shape[d]) return pk_err(vm, "tensor size overflows 64 bits");
        want *= r->shape[d];
    }
    numel = want;
    r->numel = numel;
    if (numel && !contiguous) v->i = -1; /* reported with the tensor's name */
    else if (numel && (r->offset > r->storage_numel || numel > r->storage_numel - r->offset)) v->i = -2;
    *out = v;
    return FL_OK;
}

static fl_status pk_reduce(pk_vm *vm) {
    pk_val *args = pk_pop(vm), *fn = pk_pop(vm);
    if (!args || !fn) return pk_err(vm, "REDUCE needs a callable and its arguments on the stack");
    if (fn->kind != V_GLOBAL || fn->g == G_STORAGE || args->kind != V_TUPLE)
        return pk_err(vm, fn->kind == V_GLOBAL ? "REDUCE of a torch storage class is not allowed"
                                               : "REDUCE of a value that is not an allowed global");
    pk_val *r = NULL;
    if (fn->g == G_ODICT) {
        if (args->n) return pk_err(vm, "collections.OrderedDict called with arguments (torch.save writes OrderedDict())");
        r = pk_new(vm, V_DICT);
        if (!r) return pk_oom(vm);
    } else if (fn->g == G_REBUILD_V2) {
        FL_TRY(pk_rebuild_tensor(vm, args, &r));
    } else { /* _rebuild_parameter(data, requires_grad, backward_hooks): the tensor itself */
        if (args->n != 3 || args->it[0]->kind != V_TENSOR || args->it[1]->kind != V_BOOL || args->it[2]->kind != V_DICT)
            return pk_err(vm, "_rebuild_parameter arguments are not (tensor, requires_grad, hooks)");
        r = args->it[0];
    }
    return pk_push(vm, r);
}

static fl_status pk_setitems(pk_vm *vm, int one) {
    size_t from;
    if (one) {
        if (!pk_need(vm, 3)) return pk_err(vm, "SETITEM needs a dict, a key and a value on the stack");
        from = vm->sp - 2;
    } else {
        if (!vm->nmarks) return pk_err(vm, "SETITEMS without a MARK");
        from = vm->marks[--vm->nmarks];
        if ((vm->sp - from) % 2) return pk_err(vm, "SETITEMS with an odd number of keys and values");
        if (from == pk_floor(vm)) return pk_err(vm, "SETITEMS with no dict below its MARK");
    }
    pk_val *d = vm->stack[from - 1];
    if (d->kind != V_DICT) return pk_err(vm, "SETITEM(S) on a value that is not a dict");
    for (size_t i = from; i < vm->sp; i++) FL_TRY(pk_append(vm, d, vm->stack[i]));
    vm->sp = from;
    return FL_OK;
}

/* One opcode at vm->pos. *stop set by STOP. */
static fl_status pk_step(pk_vm *vm, int *stop) {
    uint8_t op, b[8];
    vm->op_at = vm->pos;
    if (pk_read(vm, &op, 1)) return pk_err(vm, "ends without STOP (truncated?)");
    switch (op) {
    case 0x80: /* PROTO */
        if (pk_read(vm, b, 1)) return pk_err(vm, "truncated PROTO");
        if (b[0] < 2 || b[0] > 5) return pk_err(vm, "pickle protocol is not 2 to 5");
        return FL_OK;
    case 0x95: /* FRAME: a length hint, the frame's opcodes follow inline */
        return pk_read(vm, b, 8) ? pk_err(vm, "truncated FRAME") : FL_OK;
    case '}': return pk_push(vm, pk_new(vm, V_DICT));
    case ')': return pk_push(vm, pk_new(vm, V_TUPLE));
    case 'N': return pk_push(vm, pk_new(vm, V_NONE));
    case 0x88: case 0x89: {
        pk_val *v = pk_new(vm, V_BOOL);
        if (v) v->i = op == 0x88;
        return pk_push(vm, v);
    }
    case 'K': case 'M': case 'J': case 0x8a: {
        int k = op == 'K' ? 1 : op == 'M' ? 2 : 4;
        if (op == 0x8a) { /* LONG1: a length byte, then that many little-endian two's-complement bytes */
            if (pk_read(vm, b, 1)) return pk_err(vm, "truncated LONG1");
            k = b[0];
            if (k > 8) return pk_err(vm, "LONG1 integer wider than 64 bits");
        }
        memset(b, 0, sizeof b);
        if (pk_read(vm, b, (size_t)k)) return pk_err(vm, "truncated integer");
        uint64_t u = pk_le(b, k);
        int64_t x;
        if ((op == 'J' || op == 0x8a) && k > 0 && k < 8 && (b[k - 1] & 0x80)) /* sign-extend */
            u |= ~(uint64_t)0 << (8 * k);
        memcpy(&x, &u, sizeof x);
        pk_val *v = pk_new(vm, V_INT);
        if (v) v->i = x;
        return pk_push(vm, v);
    }
    case 'X': case 0x8c: {
        int k = op == 'X' ? 4 : 1;
        if (pk_read(vm, b, (size_t)k)) return pk_err(vm, "truncated string length");
        return pk_str(vm, (size_t)pk_le(b, k));
    }
    case '(':
        if (vm->nmarks == vm->mcap) {
            if (vm->mcap >= PK_MAX_MARKS) return pk_err(vm, "MARKs nested deeper than 2^16");
            size_t c = vm->mcap ? vm->mcap * 2 : 16;
            size_t *nm = realloc(vm->marks, c * sizeof *nm);
            if (!nm) return pk_oom(vm);
            vm->marks = nm;
            vm->mcap = c;
        }
        vm->marks[vm->nmarks++] = vm->sp;
        return FL_OK;
    case 't': return pk_tuple(vm, -1);
    case 0x85: case 0x86: case 0x87: return pk_tuple(vm, op - 0x84);
    case 'q': case 'r': {
        int k = op == 'q' ? 1 : 4;
        if (pk_read(vm, b, (size_t)k)) return pk_err(vm, "truncated memo index");
        return pk_put(vm, pk_le(b, k));
    }
    case 0x94: return pk_put(vm, vm->memo_len); /* MEMOIZE: index len(memo) */
    case 'h': case 'j': {
        int k = op == 'h' ? 1 : 4;
        if (pk_read(vm, b, (size_t)k)) return pk_err(vm, "truncated memo index");
        return pk_get(vm, pk_le(b, k));
    }
    case 'c': return pk_global_text(vm);
    case 0x93: { /* STACK_GLOBAL: module and name strings on the stack */
        pk_val *name = pk_pop(vm), *mod = pk_pop(vm);
        if (!name || !mod || name->kind != V_STR || mod->kind != V_STR) return pk_err(vm, "STACK_GLOBAL needs two strings");
        return pk_global(vm, mod->s, name->s);
    }
    case 'Q': return pk_persid(vm);
    case 'R': return pk_reduce(vm);
    case 's': return pk_setitems(vm, 1);
    case 'u': return pk_setitems(vm, 0);
    case 'b': { /* BUILD on a dict: the OrderedDict's attributes (state_dict._metadata), not entries */
        pk_val *state = pk_pop(vm), *obj = pk_top(vm);
        if (!state || !obj || obj->kind != V_DICT || (state->kind != V_DICT && state->kind != V_NONE))
            return pk_err(vm, "BUILD is only read for an OrderedDict's metadata");
        return FL_OK;
    }
    case '.':
        *stop = 1;
        return FL_OK;
    default: {
        const char *nm = pk_op_name(op);
        return fl_errorf(FL_ERR_FORMAT, "%s: pickle opcode %s (0x%02x) at byte %zu of data.pkl is not allowed (only "
                         "torch state dicts are read)", vm->path, nm ? nm : "(unknown)", op, vm->op_at);
    }
    }
}

static int pk_cmp_name(const void *a, const void *b) {
    return strcmp(((const fl_torch_rec *)a)->name, ((const fl_torch_rec *)b)->name);
}

/* The state dict out of the unpickled top value (or its "model" / "state_dict" entry). */
static fl_status pk_collect(pk_vm *vm, const pk_val *top, fl_torch_rec **recs, int *n_recs) {
    if (top->kind != V_DICT)
        return fl_errorf(FL_ERR_FORMAT, "%s: holds a pickled %s, not a state dict (a dict of tensors)", vm->path, pk_kind_name(top->kind));
    int any_tensor = 0;
    const pk_val *inner = NULL;
    for (size_t i = 0; i < top->n / 2; i++) {
        const pk_val *k = top->it[2 * i], *v = top->it[2 * i + 1];
        if (v->kind == V_TENSOR) any_tensor = 1;
        if (k->kind == V_STR && v->kind == V_DICT && (!strcmp(k->s, "model") || !strcmp(k->s, "state_dict"))) inner = v;
    }
    if (!any_tensor && inner) top = inner; /* a Lightning/LitGPT training checkpoint: {"model": state_dict, ...} */
    if (top->n / 2 > (size_t)1 << 24) return fl_errorf(FL_ERR_FORMAT, "%s: state dict has more than 2^24 entries", vm->path);
    fl_torch_rec *r = calloc(top->n / 2 + 1, sizeof *r);
    if (!r) return pk_oom(vm);
    int n = 0;
    fl_status s = FL_OK;
    for (size_t i = 0; i < top->n / 2 && s == FL_OK; i++) {
        const pk_val *k = top->it[2 * i], *v = top->it[2 * i + 1];
        if (k->kind != V_STR) { s = fl_errorf(FL_ERR_FORMAT, "%s: state dict key #%zu is a %s, not a string", vm->path, i, pk_kind_name(k->kind)); break; }
        if (v->kind != V_TENSOR) { s = fl_errorf(FL_ERR_FORMAT, "%s: state dict entry '%s' is a %s, not a tensor", vm->path, k->s, pk_kind_name(v->kind)); break; }
        if (v->i == -1) { s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: tensor '%s' is not contiguous (a strided view was saved); re-save it with .contiguous()", vm->path, k->s); break; }
        if (v->i == -2) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': offset %lld + %lld elements run past its storage '%s' of %lld elements",
                          vm->path, k->s, (long long)v->t->offset, (long long)v->t->numel, v->t->storage_key, (long long)v->t->storage_numel);
            break;
        }
        r[n] = *v->t;
        r[n].name = strdup(k->s);
        r[n].storage_key = strdup(v->t->storage_key);
        n++;
        if (!r[n - 1].name || !r[n - 1].storage_key) s = pk_oom(vm);
    }
    if (s == FL_OK && n > 1) { /* a key twice: the later would silently win in Python */
        fl_torch_rec *c = malloc((size_t)n * sizeof *c);
        if (!c) s = pk_oom(vm);
        else {
            memcpy(c, r, (size_t)n * sizeof *c);
            qsort(c, (size_t)n, sizeof *c, pk_cmp_name);
            for (int i = 1; i < n && s == FL_OK; i++)
                if (!strcmp(c[i].name, c[i - 1].name)) s = fl_errorf(FL_ERR_FORMAT, "%s: state dict key '%s' appears twice", vm->path, c[i].name);
            free(c);
        }
    }
    if (s != FL_OK) { fl_torch_recs_free(r, n); return s; }
    *recs = r;
    *n_recs = n;
    return FL_OK;
}

fl_status fl_torch_unpickle(const uint8_t *p, size_t n, const char *path, fl_torch_rec **recs, int *n_recs) {
    *recs = NULL;
    *n_recs = 0;
    pk_vm vm = {.path = path, .p = p, .n = n};
    fl_status s = FL_OK;
    int stop = 0;
    while (s == FL_OK && !stop) s = pk_step(&vm, &stop);
    if (s == FL_OK) {
        if (vm.nmarks || vm.sp != 1) s = fl_errorf(FL_ERR_FORMAT, "%s: data.pkl: STOP with %zu values and %zu MARKs on the stack (expected one value)", path, vm.sp, vm.nmarks);
        else s = pk_collect(&vm, vm.stack[0], recs, n_recs);
    }
    pk_free_all(&vm);
    return s;
}

void fl_torch_recs_free(fl_torch_rec *r, int n) {
    if (!r) return;
    for (int i = 0; i < n; i++) { free(r[i].name); free(r[i].storage_key); }
    free(r);
}
