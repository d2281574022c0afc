/* Diagnostic trace of the launch path (see alnair.h): compiled only with -DALNAIR_TRACE. The shipped build has none
 * of it: no environment read, no stdio, nothing on the hot path. */
#ifdef ALNAIR_TRACE
#include <stdio.h>
#include <stdlib.h>

#include "alnair.h"

#define TRACE_N 65536u

struct trace_rec {
    uint64_t t, a, b, c, d;
    char kind;
};
static struct trace_rec g_trace[TRACE_N];
static _Atomic uint32_t g_trace_n;

void alnair_trace(char kind, uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    uint32_t i = atomic_fetch_add(&g_trace_n, 1);
    if (i < TRACE_N)
        g_trace[i] = (struct trace_rec){alnair_now_ns(), a, b, c, d, kind};
}

__attribute__((destructor)) static void trace_dump(void)
{
    const char *path = getenv("ALNAIR_TRACE_FILE");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f == NULL)
        return;
    uint32_t n = atomic_load(&g_trace_n);
    for (uint32_t i = 0; i < n && i < TRACE_N; i++)
        fprintf(f, "%c %llu %llu %llu %llu %llu\n", g_trace[i].kind, (unsigned long long)g_trace[i].t,
                (unsigned long long)g_trace[i].a, (unsigned long long)g_trace[i].b, (unsigned long long)g_trace[i].c,
                (unsigned long long)g_trace[i].d);
    fclose(f);
}
#else
typedef int alnair_trace_unused; /* ISO C forbids an empty translation unit */
#endif
