/* Random routing for the tests that permute: each token's k experts are
 * distinct of E, and a choice in 5 is routed nowhere (-1); next() draws
 * uniform 64-bit values (each test its own generator). Shared by CPU and
 * GPU tests. */
#ifndef FM_TEST_ROUTING_IDS_H
#define FM_TEST_ROUTING_IDS_H

#include <stdint.h>

static inline void random_routing(int32_t *ids, int64_t T, int k, int64_t E, uint64_t (*next)(void))
{
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int32_t e;
            int dup;
            do {
                e = next() % 5 == 0 ? -1 : (int32_t)(next() % (uint64_t)E);
                dup = 0;
                for (int i = 0; i < j && e >= 0; i++)
                    dup |= ids[t * k + i] == e;
            } while (dup);
            ids[t * k + j] = e;
        }
}

#endif
