/* Private to src/config: the key table entry. */
#ifndef FL_CONFIG_IMPL_H
#define FL_CONFIG_IMPL_H

#include "fitllm/config.h"

typedef enum {
    FL_CK_PATH, FL_CK_STR32, FL_CK_STR64, FL_CK_INT, FL_CK_POS, FL_CK_SINT, FL_CK_INT_OPT, FL_CK_INT_OPT0, FL_CK_LL_OPT, FL_CK_U64,
    FL_CK_FLOAT, FL_CK_FLOAT_OPT, FL_CK_FLOAT_OPT0, FL_CK_BOOL, FL_CK_BOOL_OPT, FL_CK_BYTES, FL_CK_PRECISION,
    FL_CK_RESUME, FL_CK_LOGGER, FL_CK_DEVICES, FL_CK_MODEL_CONFIG, FL_CK_DATA, FL_CK_OPTIMIZER, FL_CK_BETAS, FL_CK_DOWNLOAD_DIR, FL_CK_FILE_NAME, FL_CK_STATE_DTYPE, FL_CK_INIT, FL_CK_PATH256,
    FL_CK_IGNORED
} fl_cfg_key_type;

/* INT_OPT: null -> -1; INT_OPT0 / FLOAT_OPT0: null -> 0 (meaning "off"). */
typedef struct {
    const char *name;
    fl_cfg_key_type type;
    size_t off;
    const char *help;
} fl_cfg_key;

/* The key an option is stored under: aliases (model, initial_checkpoint_dir ->
 * checkpoint_dir; data.class_path -> data; X.init_args.Y -> X.Y) map to one name so
 * that a later value replaces an earlier one whatever spelling either used. */
void fl_cfg_canonical_key(const char *key, char *out, size_t n);
/* model_config.<field>: a litgpt.Config field name and a value of its type. */
fl_status fl_cfg_model_field_check(const char *field, const char *value);
int fl_cfg_is_null(const char *v);
/* The key table (run_config.c): its n entries; one entry by its exact name (NULL: none); whether a key is the
 * command's (lora_* are finetune_lora's, model_name / model_config pretrain's). */
const fl_cfg_key *fl_cfg_keys(size_t *n);
const fl_cfg_key *fl_cfg_find_key(const char *key);
int fl_cfg_key_applies(const fl_cfg_key *k, fl_cmd_kind cmd);
/* Whether a model_config field holds a string (written quoted where YAML needs it). */
int fl_cfg_model_field_is_str(const char *field);
/* data_keys.c: the data classes (bits 1 << fl_data_kind) that take data.<field>, 0 for no such option; whether
 * `key` (data.X; any other key: 1) is an option of data class `kind`; and the merged options' data.* ones checked
 * against the class they chose (FL_ERR_INVALID naming the option, the class and its options; *failed its index). */
unsigned fl_cfg_data_key_classes(const char *field);
int fl_cfg_data_key_applies(fl_data_kind kind, const char *key);
fl_status fl_cfg_data_check(const fl_run_config *c, const fl_cfg_entries *l, int *failed);

#endif
