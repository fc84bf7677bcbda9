/* fitllm core: small text helpers shared by train/ and the CLI (library-internal). fl_text_*. */
#ifndef FITLLM_CORE_TEXT_H
#define FITLLM_CORE_TEXT_H

#include <stddef.h>

/* The first line where the multi-line texts a and b differ, each cut at its newline into la / lb
 * (n bytes each); a text that ran out gives "(nothing)". Used to name the difference between two
 * ranks' configurations or file descriptions. */
void fl_text_first_diff(const char *a, const char *b, char *la, char *lb, size_t n);
/* The shortest decimal ("%.Ng", N up to 9) that reads back as the same float: 0.05f as "0.05", not %.9g's
 * "0.0500000007" (what the same number typed in Python or a JSON file would be). */
void fl_text_float(float v, char *buf, size_t n);

#endif
