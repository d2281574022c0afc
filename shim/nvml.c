/* NVML per-process queries: a container is shown its own processes only (the pids in its region slots, and this
 * process), never the other tenants of the GPU. With no region at all the calls pass straight through.
 *
 * NVML reports pids as the driver sees them (the host's pid namespace). Where the container shares that namespace
 * they match its slots; in a container with a pid namespace of its own they match none and the lists come back
 * empty, which is what such a container sees without the shim anyway (its processes' host pids mean nothing in
 * it). Sizes follow NVML's contract: a buffer too small (or none) gets NVML_ERROR_INSUFFICIENT_SIZE and the count
 * the filtered answer needs. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hook_protos.h"

#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_LIBRARY_NOT_FOUND 12

static int ours(unsigned int pid)
{
    if (pid == (unsigned int)getpid())
        return 1;
    struct alnair_region *r = alnair_hot.region;
    if (r == NULL || !alnair_region_shared)
        return 0;
    for (unsigned i = 0; i < ALNAIR_REGION_MAX_SLOTS; i++) {
        int32_t p = RLOAD(r->slots[i].pid);
        if (p > 0 && (unsigned int)p == pid)
            return 1;
    }
    return 0;
}

/* Keep the records of our pids (pid at byte `off` of each `size`-byte record); returns how many are left. */
static unsigned int keep_ours(void *recs, unsigned int n, size_t size, size_t off)
{
    unsigned int kept = 0;
    for (unsigned int i = 0; i < n; i++) {
        char *rec = (char *)recs + (size_t)i * size;
        unsigned int pid;
        memcpy(&pid, rec + off, sizeof pid);
        if (!ours(pid))
            continue;
        if (kept != i)
            memmove((char *)recs + (size_t)kept * size, rec, size);
        kept++;
    }
    return kept;
}

typedef nvmlReturn_t (*list_fn)(nvmlDevice_t, unsigned int *, void *);
struct lister {
    nvmlReturn_t (*call)(const struct lister *, nvmlDevice_t, unsigned int *, void *);
    list_fn fn;
    unsigned long long last_seen;
    nvmlReturn_t (*util)(nvmlDevice_t, nvmlProcessUtilizationSample_t *, unsigned int *, unsigned long long);
    nvmlReturn_t (*info)(nvmlDevice_t, nvmlProcessesUtilizationInfo_t *);
    nvmlProcessesUtilizationInfo_t *arg;
};

/* The common shape of "fill up to *count records, or say how many there are". */
static nvmlReturn_t filtered_list(const struct lister *l, nvmlDevice_t dev, unsigned int *count, void *recs,
                                  size_t size, size_t off)
{
    if (count == NULL)
        return l->call(l, dev, count, recs);
    unsigned int cap = recs ? *count : 0, n = cap;
    nvmlReturn_t rc = l->call(l, dev, &n, recs);
    if (rc == NVML_SUCCESS) {
        *count = keep_ours(recs, n, size, off);
        return rc;
    }
    if (rc != NVML_ERROR_INSUFFICIENT_SIZE)
        return rc;
    for (int tries = 0; tries < 4; tries++) { /* the list can grow between calls */
        unsigned int want = n + 8;
        void *buf = calloc(want, size);
        if (buf == NULL)
            return rc;
        n = want;
        nvmlReturn_t rc2 = l->call(l, dev, &n, buf);
        if (rc2 == NVML_SUCCESS) {
            unsigned int k = keep_ours(buf, n, size, off);
            *count = k;
            if (recs != NULL && k <= cap) {
                memcpy(recs, buf, (size_t)k * size);
                free(buf);
                return NVML_SUCCESS;
            }
            free(buf);
            return k == 0 && recs == NULL ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
        }
        free(buf);
        if (rc2 != NVML_ERROR_INSUFFICIENT_SIZE)
            return rc2;
    }
    return rc;
}

static nvmlReturn_t plain_call(const struct lister *l, nvmlDevice_t dev, unsigned int *count, void *recs)
{
    return l->fn(dev, count, recs);
}

#define PROC_LIST(name, type)                                                                  \
    ALNAIR_API nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount, type *infos)    \
    {                                                                                          \
        __typeof__(&name) fn = REAL(name);                                                     \
        if (fn == NULL)                                                                        \
            return NVML_ERROR_LIBRARY_NOT_FOUND;                                               \
        if (alnair_hot.region == NULL)                                                         \
            return fn(device, infoCount, infos);                                               \
        struct lister l = {.call = plain_call, .fn = (list_fn)fn};                             \
        return filtered_list(&l, device, infoCount, infos, sizeof(type), 0);                   \
    }

PROC_LIST(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROC_LIST(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROC_LIST(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_v2_t)
PROC_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
PROC_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROC_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_v2_t)
PROC_LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROC_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROC_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_v2_t)

/* nvmlDeviceGetProcessUtilization(device, samples, &count, lastSeen): the same shape with the count second. */
static nvmlReturn_t util_call(const struct lister *l, nvmlDevice_t dev, unsigned int *count, void *recs)
{
    return l->util(dev, recs, count, l->last_seen);
}

ALNAIR_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                        unsigned int *processSamplesCount,
                                                        unsigned long long lastSeenTimeStamp)
{
    __typeof__(&nvmlDeviceGetProcessUtilization) fn = REAL(nvmlDeviceGetProcessUtilization);
    if (fn == NULL)
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    if (alnair_hot.region == NULL)
        return fn(device, utilization, processSamplesCount, lastSeenTimeStamp);
    struct lister l = {.call = util_call, .util = fn, .last_seen = lastSeenTimeStamp};
    return filtered_list(&l, device, processSamplesCount, utilization, sizeof *utilization, 0);
}

/* nvmlDeviceGetProcessesUtilizationInfo: the array and its size inside a versioned struct. */
static nvmlReturn_t info_call(const struct lister *l, nvmlDevice_t dev, unsigned int *count, void *recs)
{
    nvmlProcessesUtilizationInfo_t a = *l->arg;
    a.processSamplesCount = *count;
    a.procUtilArray = recs;
    nvmlReturn_t rc = l->info(dev, &a);
    *count = a.processSamplesCount;
    l->arg->lastSeenTimeStamp = a.lastSeenTimeStamp;
    return rc;
}

ALNAIR_API nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                              nvmlProcessesUtilizationInfo_t *procesesUtilInfo)
{
    __typeof__(&nvmlDeviceGetProcessesUtilizationInfo) fn = REAL(nvmlDeviceGetProcessesUtilizationInfo);
    if (fn == NULL)
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    if (alnair_hot.region == NULL || procesesUtilInfo == NULL)
        return fn(device, procesesUtilInfo);
    struct lister l = {.call = info_call, .info = fn, .arg = procesesUtilInfo};
    unsigned int count = procesesUtilInfo->processSamplesCount;
    nvmlReturn_t rc = filtered_list(&l, device, &count, procesesUtilInfo->procUtilArray,
                                    sizeof(nvmlProcessUtilizationInfo_v1_t),
                                    offsetof(nvmlProcessUtilizationInfo_v1_t, pid));
    procesesUtilInfo->processSamplesCount = count;
    return rc;
}
