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
