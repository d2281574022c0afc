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

static const char *const probe_names[P_NPROBE] = {"launch", "pre", "call", "post", "wait_sample", "wait_inflight",
                                                    "wait_gate", "event_record", "event_query", "sample", "fence",
                                                    "gate_slow", "wait_drain", "wait_hold", "sample_idle"};
static _Atomic uint64_t g_probe_n[P_NPROBE], g_probe_ns[P_NPROBE];

void alnair_probe(enum alnair_probe k, uint64_t ns)
{
    atomic_fetch_add_explicit(&g_probe_n[k], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_probe_ns[k], ns, memory_order_relaxed);
}

static void probe_dump(const char *path)
{
    char name[4096];
    snprintf(name, sizeof name, "%s.sum", path);
    FILE *f = fopen(name, "w");
    if (f == NULL)
        return;
    for (unsigned k = 0; k < P_NPROBE; k++)
        fprintf(f, "%s %llu %llu\n", probe_names[k], (unsigned long long)atomic_load(&g_probe_n[k]),
                (unsigned long long)atomic_load(&g_probe_ns[k]));
    fclose(f);
}

__attribute__((destructor)) static void trace_dump(void)
{
    const char *path = getenv("ALNAIR_TRACE_FILE");
    if (path != NULL)
        probe_dump(path);
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
