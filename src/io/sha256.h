/* fitllm io: SHA-256 (FIPS 180-4), streaming, for the checksums of downloaded model files
 * (the Hugging Face Hub names an LFS file by the SHA-256 of its contents). Library-internal. */
#ifndef FITLLM_IO_SHA256_H
#define FITLLM_IO_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t h[8];
    uint64_t nbytes;   /* message length so far */
    uint8_t buf[64];   /* the partial block */
    size_t nbuf;
} fl_sha256;

void fl_sha256_init(fl_sha256 *s);
void fl_sha256_update(fl_sha256 *s, const void *data, size_t n);
/* The digest as 64 lowercase hex characters + NUL into hex[65]. */
void fl_sha256_final_hex(fl_sha256 *s, char hex[65]);

#endif
