/* fitllm: a small strict JSON DOM (RFC 8259) for config.json, safetensors
 * headers, index files and tokenizer.json.
 *
 * fl_json_parse builds a tree in one malloc'd block set owned by the returned
 * root; free it with fl_json_free. Errors carry line/column and are reported
 * through fl_errorf with the caller-supplied source name.
 */
#ifndef FITLLM_JSON_H
#define FITLLM_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FL_JSON_NULL = 0, FL_JSON_BOOL, FL_JSON_NUMBER, FL_JSON_STRING, FL_JSON_ARRAY, FL_JSON_OBJECT } fl_json_type;

typedef struct fl_json fl_json;
struct fl_json {
    fl_json_type type;
    char *key;          /* member name when inside an object, else NULL */
    char *str;          /* STRING: UTF-8, NUL-terminated (may contain \0 escapes: see len) */
    size_t len;         /* STRING: byte length; ARRAY/OBJECT: number of children */
    double num;         /* NUMBER */
    int is_int;         /* NUMBER written without fraction/exponent and fits int64 */
    int64_t i;          /* NUMBER as integer when is_int */
    int b;              /* BOOL */
    fl_json *child;     /* first child (ARRAY/OBJECT) */
    fl_json *next;      /* next sibling */
};

/* Parse text[0..n). `source` names the file in error messages. */
fl_status fl_json_parse(const char *text, size_t n, const char *source, fl_json **out);
/* Read and parse a whole file. */
fl_status fl_json_parse_file(const char *path, fl_json **out);
void fl_json_free(fl_json *j);

/* Object member lookup (NULL if absent or j is not an object). */
const fl_json *fl_json_get(const fl_json *j, const char *key);
/* Array element i (NULL if out of range). */
const fl_json *fl_json_at(const fl_json *j, size_t i);

#ifdef __cplusplus
}
#endif
#endif
