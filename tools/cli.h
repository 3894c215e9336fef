/* Command-line helpers shared by the tools. */
#ifndef FM_TOOLS_CLI_H
#define FM_TOOLS_CLI_H

#include <stddef.h>
#include <stdint.h>

/* argv[*i] against `names` (options that take a value, as "--name VALUE" or
 * "--name=VALUE"): 1 with *name and *val set (and *i moved past a separate
 * value), 0 when it is none of them, -1 when the value is missing (*name set). */
int cli_option(int argc, char **argv, int *i, const char *const *names, size_t nnames, const char **name,
               const char **val);

/* A decimal integer in [lo, hi] (lo >= 0), digits only: 0, else -1. */
int cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *v);

#endif
