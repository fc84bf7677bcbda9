/* The planner's private helpers shared by its files (src/plan/). */
#ifndef FL_PLAN_IMPL_H
#define FL_PLAN_IMPL_H

#include <stdio.h>

/* s as a JSON string literal, quotes and escapes included */
void fl_plan_json_str(FILE *f, const char *s);

#endif
