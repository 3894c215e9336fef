/* Command-line helpers shared by the tools. */
#include "cli.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int cli_option(int argc, char **argv, int *i, const char *const *names, size_t nnames, const char **name,
               const char **val)
{
    const char *a = argv[*i];
    for (size_t k = 0; k < nnames; k++) {
        size_t n = strlen(names[k]);
        if (strncmp(a, names[k], n) || (a[n] != '\0' && a[n] != '='))
            continue;
        *name = names[k];
        if (a[n] == '=') {
            *val = a + n + 1;
            return 1;
        }
        if (*i + 1 >= argc)
            return -1;
        *val = argv[++*i];
        return 1;
    }
    return 0;
}

int cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *v)
{
    char *end;
    /* strtoull would accept a sign or leading blanks; an option value may not. */
    if (!s || *s < '0' || *s > '9')
        return -1;
    errno = 0;
    unsigned long long x = strtoull(s, &end, 10);
    if (errno || *end || x < (unsigned long long)lo || x > (unsigned long long)hi)
        return -1;
    *v = (int64_t)x;
    return 0;
}
