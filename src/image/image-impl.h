/* Private helpers of src/image. */
#ifndef FITLLM_IMAGE_IMPL_H
#define FITLLM_IMAGE_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/status.h"

/* A whole file into a malloc'd buffer (one spare byte, set to 0); `what` names it in errors. */
fl_status fl_img_read_file(const char *path, const char *what, uint8_t **data, size_t *size);

#endif
