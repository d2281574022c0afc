/* A slice of a simulated NVML (libnvidia-ml.so.1): one device whose memory is SIMCUDA_MEMORY_BYTES. */
#include <stdlib.h>
#include "cuda_abi.h"
#define API __attribute__((visibility("default")))
static unsigned long long total(void)
{
    const char *s = getenv("SIMCUDA_MEMORY_BYTES");
    return s ? strtoull(s, NULL, 10) : 80ull << 30;
}
API nvmlReturn_t nvmlInit_v2(void) { return 0; }
API nvmlReturn_t nvmlShutdown(void) { return 0; }
API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d) { if (i) return 2; *d = (nvmlDevice_t)0x10; return 0; }
API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    (void)d;
    m->total = total(); m->used = 1ull << 20; m->free = m->total - m->used;
    return 0;
}
API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    (void)d;
    m->total = total(); m->reserved = 1ull << 20; m->used = 1ull << 20; m->free = m->total - m->used - m->reserved;
    return 0;
}

/* Per-process queries: the GPU runs the calling process and the pids in SIMCUDA_NVML_PIDS ("1,2,3": other
 * containers' processes, as the driver would list them). */
#include <string.h>
#include <unistd.h>
static unsigned gpu_pids(unsigned *out, unsigned cap)
{
    unsigned n = 0;
    if (n < cap)
        out[n] = (unsigned)getpid();
    n++;
    const char *s = getenv("SIMCUDA_NVML_PIDS");
    while (s && *s) {
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s)
            break;
        if (n < cap)
            out[n] = (unsigned)v;
        n++;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define LIST(name, type, fill)                                                     \
    API nvmlReturn_t name(nvmlDevice_t d, unsigned *count, type *infos)            \
    {                                                                              \
        (void)d;                                                                   \
        unsigned pids[64], n = gpu_pids(pids, 64);                                 \
        if (count == NULL)                                                         \
            return 2;                                                              \
        if (infos == NULL || *count < n) {                                         \
            *count = n;                                                            \
            return n == 0 ? 0 : NVML_ERROR_INSUFFICIENT_SIZE;                      \
        }                                                                          \
        for (unsigned i = 0; i < n; i++) {                                         \
            memset(&infos[i], 0, sizeof infos[i]);                                 \
            infos[i].pid = pids[i];                                                \
            fill;                                                                  \
        }                                                                          \
        *count = n;                                                                \
        return 0;                                                                  \
    }
LIST(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t, infos[i].usedGpuMemory = 1u << 20)
LIST(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, infos[i].usedGpuMemory = 1u << 20)
LIST(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_v2_t, infos[i].usedGpuMemory = 1u << 20)
LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t, (void)0)
LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t, (void)0)
LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_v2_t, (void)0)
LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t, (void)0)
LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, (void)0)
LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_v2_t, (void)0)

API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *u, unsigned *count,
                                                 unsigned long long last)
{
    (void)d; (void)last;
    unsigned pids[64], n = gpu_pids(pids, 64);
    if (count == NULL)
        return 2;
    if (u == NULL || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        memset(&u[i], 0, sizeof u[i]);
        u[i].pid = pids[i];
        u[i].smUtil = 10;
    }
    *count = n;
    return 0;
}

API nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t d, nvmlProcessesUtilizationInfo_t *info)
{
    (void)d;
    unsigned pids[64], n = gpu_pids(pids, 64);
    if (info == NULL)
        return 2;
    if (info->procUtilArray == NULL || info->processSamplesCount < n) {
        info->processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        memset(&info->procUtilArray[i], 0, sizeof info->procUtilArray[i]);
        info->procUtilArray[i].pid = pids[i];
        info->procUtilArray[i].smUtil = 10;
    }
    info->processSamplesCount = n;
    info->lastSeenTimeStamp = 1;
    return 0;
}
