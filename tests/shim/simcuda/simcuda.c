/* simcuda: a simulated CUDA driver (libcuda.so.1) for testing the Alnair shim on machines without a GPU.
 *
 * - Device memory of SIMCUDA_MEMORY_BYTES (default 80 GiB), counted per process; allocations return fake,
 *   deterministic addresses (no host memory behind them). A freed address (or VMM handle) is handed out again by
 *   the next allocation that fits in it, as the real allocator does; SIMCUDA_FREE_LATENCY_NS makes cuMemFree
 *   return that long after the address became reusable (to widen free/alloc races).
 * - Allocations belong to the current context: cuCtxDestroy, cuDevicePrimaryCtxReset and the last
 *   cuDevicePrimaryCtxRelease free them. VMM: cuMemRelease frees a handle's memory only once its last mapping is
 *   unmapped (cuMemMap / cuMemUnmap). Pitch rows are padded to SIMCUDA_PITCH_ALIGN bytes (default 256).
 * - Kernels take GPU time: a launch runs ceil(blocks / SIMCUDA_WAVE_BLOCKS (default 128)) waves (a kernel's time
 *   grows with its grid), each of *(uint64_t *)kernelParams[0] ns when given, else of the number after the last
 *   ':' in the function's name (cuModuleGetFunction(..., "k:250000")), else 1 us.
 *   Each stream is a timeline in real (CLOCK_MONOTONIC) time: a launch starts when the stream is free and ends
 *   `duration` later; events, queries and synchronize follow that timeline, so GPU busy time is measurable.
 *   A stream holds at most 1024 launches in flight; the 1025th blocks (sleeps) like the real driver's queue.
 * - Stream capture records launches into a graph; a graph launch runs their summed duration. Capture modes as
 *   documented: an event query while a global-mode capture is under way in any thread, or a non-relaxed one in
 *   the querying thread, invalidates those captures (cuStreamEndCapture then fails with
 *   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED); a non-relaxed capture ended from another thread fails with
 *   CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD and goes on. SIMCUDA_END_CAPTURE_RC=n: cuStreamEndCapture ends the
 *   capture but returns n (as with an unjoined fork).
 * - Legacy launches (cuLaunch, cuLaunchGrid[Async]) and cuLaunchCooperativeKernelMultiDevice.
 * - cuGetProcAddress(_v2) maps (symbol, cudaVersion, per-thread flag) to variants like the real driver does,
 *   from its own table (never through dlsym).
 * - SIMCUDA_FIRST_LAUNCH_NS: a function's first launch holds the host that long (lazy module loading);
 *   SIMCUDA_LAUNCH_HOLD_NS: every launch does. SIMCUDA_EVENT_NS: each cuEventRecord and cuEventQuery holds the
 *   host that long (the H200 VM's driver: 3.3-3.4 us each), read once.
 * - SIMCUDA_STATS=path: at exit, "name count" lines: calls per entry point, busy_ns, peak memory.
 * - SIMCUDA_TIMELINE_DIR=dir: kernels of all processes on one GPU (NVIDIA_VISIBLE_DEVICES) take turns on a shared
 *   timeline file there, which the agent's simulated backend reads (simtimeline.h); with SIMCUDA_DEVICES=n, device k's
 *   kernels go on the k-th GPU's timeline.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_abi.h"
#include "simtimeline.h"

#define API __attribute__((visibility("default")))

/* ---- call counters ---------------------------------------------------------------------------------------- */
#define MAXNAMES 160
static const char *cnames[MAXNAMES];
static _Atomic unsigned long long ccount[MAXNAMES];
static pthread_mutex_t cmu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic unsigned long long busy_ns, peak_mem;

static void count_call(const char *name)
{
    for (int i = 0; i < MAXNAMES; i++) {
        const char *n = __atomic_load_n(&cnames[i], __ATOMIC_ACQUIRE);
        if (n == name) {
            ccount[i]++;
            return;
        }
        if (n == NULL) {
            pthread_mutex_lock(&cmu);
            if (cnames[i] == NULL)
                __atomic_store_n(&cnames[i], name, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&cmu);
            if (cnames[i] == name) {
                ccount[i]++;
                return;
            }
        }
    }
}
#define CALLED() count_call(__func__)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t)
{
    for (uint64_t n = now_ns(); n < t; n = now_ns()) {
        uint64_t d = t - n;
        struct timespec ts = {.tv_sec = (time_t)(d / 1000000000ull), .tv_nsec = (long)(d % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

static void write_stats(void)
{
    const char *path = getenv("SIMCUDA_STATS");
    if (path == NULL)
        return;
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return;
    for (int i = 0; i < MAXNAMES && cnames[i]; i++)
        fprintf(f, "%s %llu\n", cnames[i], (unsigned long long)ccount[i]);
    fprintf(f, "busy_ns %llu\npeak_mem %llu\n", (unsigned long long)busy_ns, (unsigned long long)peak_mem);
    fclose(f);
}

__attribute__((constructor)) static void sim_init(void)
{
    atexit(write_stats);
}

/* ---- memory ----------------------------------------------------------------------------------------------- */
struct CUctx_st { int dev; int primary; };
static __thread CUcontext cur_ctx;
static pthread_mutex_t mmu = PTHREAD_MUTEX_INITIALIZER;
struct alloc {
    uint64_t key, size, span, pool;
    CUcontext ctx;  /* NULL for VMM handles: they outlive contexts */
    int maps, released;
};
static struct alloc *allocs;
static size_t nallocs, capallocs;
struct hole { uint64_t key, span; int handle; };
static struct hole holes[256]; /* freed addresses / handles, most recent last */
static unsigned nholes;
static uint64_t mem_used, next_addr = 0x7f0000000000ull, next_handle = 1;

static uint64_t mem_total(void)
{
    const char *s = getenv("SIMCUDA_MEMORY_BYTES");
    return s ? strtoull(s, NULL, 10) : 80ull << 30;
}

static void hole_add(uint64_t key, uint64_t span, int handle)
{
    if (nholes == 256) {
        memmove(holes, holes + 1, sizeof holes - sizeof holes[0]);
        nholes--;
    }
    holes[nholes++] = (struct hole){key, span, handle};
}

static CUresult sim_alloc(unsigned long long *key, uint64_t size, int handle)
{
    if (key == NULL || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mmu);
    if (size > mem_total() - mem_used) {
        pthread_mutex_unlock(&mmu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (nallocs == capallocs) {
        capallocs = capallocs ? capallocs * 2 : 256;
        allocs = realloc(allocs, capallocs * sizeof *allocs);
    }
    uint64_t span = (size + 0xFFFFF) & ~0xFFFFFull, k = 0;
    for (unsigned i = nholes; i-- > 0;) { /* reuse the most recently freed place that fits */
        if (holes[i].handle == handle && (handle || holes[i].span >= span)) {
            k = holes[i].key;
            if (!handle)
                span = holes[i].span;
            memmove(holes + i, holes + i + 1, (nholes - i - 1) * sizeof holes[0]);
            nholes--;
            break;
        }
    }
    if (k == 0) {
        k = handle ? next_handle++ : next_addr;
        if (!handle)
            next_addr += span;
    }
    allocs[nallocs++] = (struct alloc){k | ((uint64_t)handle << 62), size, span, 0, handle ? NULL : cur_ctx, 0, 0};
    mem_used += size;
    if (mem_used > peak_mem)
        peak_mem = mem_used;
    pthread_mutex_unlock(&mmu);
    *key = k;
    return CUDA_SUCCESS;
}

static void drop_alloc(size_t i) /* mmu held */
{
    mem_used -= allocs[i].size;
    hole_add(allocs[i].key & ~(3ull << 62), allocs[i].span, (int)(allocs[i].key >> 62));
    allocs[i] = allocs[--nallocs];
}

static CUresult sim_free(uint64_t key, int handle)
{
    pthread_mutex_lock(&mmu);
    for (size_t i = 0; i < nallocs; i++) {
        if (allocs[i].key == (key | ((uint64_t)handle << 62)) && !allocs[i].released) {
            if (handle && allocs[i].maps > 0)
                allocs[i].released = 1; /* freed when its last mapping goes */
            else
                drop_alloc(i);
            pthread_mutex_unlock(&mmu);
            const char *lat = getenv("SIMCUDA_FREE_LATENCY_NS");
            if (lat != NULL) { /* the address is reusable already; this call has yet to return */
                struct timespec ts = {0, (long)(strtoull(lat, NULL, 10) % 1000000000ull)};
                nanosleep(&ts, NULL);
            }
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mmu);
    return CUDA_ERROR_INVALID_VALUE;
}

static void free_ctx_allocs(CUcontext c)
{
    pthread_mutex_lock(&mmu);
    for (size_t i = nallocs; i-- > 0;)
        if (allocs[i].ctx == c)
            drop_alloc(i);
    pthread_mutex_unlock(&mmu);
}

/* VMM mappings: va -> handle */
struct mapping { uint64_t va, size, handle; };
static struct mapping maps[1024];
static unsigned nmaps;
API CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long f)
{
    (void)align; (void)addr; (void)f; CALLED();
    static uint64_t next_va = 0x100000000000ull;
    if (p == NULL || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mmu);
    *p = next_va;
    next_va += (size + 0xFFFFF) & ~0xFFFFFull;
    pthread_mutex_unlock(&mmu);
    return CUDA_SUCCESS;
}
API CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { (void)p; (void)size; CALLED(); return CUDA_SUCCESS; }
API CUresult cuMemMap(CUdeviceptr va, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long f)
{
    (void)off; (void)f; CALLED();
    pthread_mutex_lock(&mmu);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < nallocs && nmaps < 1024; i++) {
        if (allocs[i].key == (h | (1ull << 62)) && !allocs[i].released) {
            allocs[i].maps++;
            maps[nmaps++] = (struct mapping){va, size, h};
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&mmu);
    return rc;
}
API CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
    CALLED();
    pthread_mutex_lock(&mmu);
    int found = 0;
    for (unsigned m = nmaps; m-- > 0;) {
        if (maps[m].va < va || maps[m].va >= va + size)
            continue;
        found = 1;
        for (size_t i = 0; i < nallocs; i++) {
            if (allocs[i].key == (maps[m].handle | (1ull << 62))) {
                if (--allocs[i].maps == 0 && allocs[i].released)
                    drop_alloc(i);
                break;
            }
        }
        maps[m] = maps[--nmaps];
    }
    pthread_mutex_unlock(&mmu);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { CALLED(); return sim_alloc(p, n, 0); }
API CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned f) { (void)f; CALLED(); return sim_alloc(p, n, 0); }
API CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e)
{
    CALLED();
    (void)e;
    const char *a = getenv("SIMCUDA_PITCH_ALIGN");
    size_t align = a ? strtoull(a, NULL, 10) : 256;
    size_t pp = (w + align - 1) / align * align;
    CUresult rc = sim_alloc(p, pp * h, 0);
    if (rc == CUDA_SUCCESS)
        *pitch = pp;
    return rc;
}
API CUresult cuMemFree_v2(CUdeviceptr p) { CALLED(); return sim_free(p, 0); }
API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop, unsigned long long f)
{
    (void)prop; (void)f; CALLED();
    return sim_alloc(h, n, 1);
}
API CUresult cuMemRelease(CUmemGenericAllocationHandle h) { CALLED(); return sim_free(h, 1); }

static uint64_t fmt_bytes(CUarray_format f)
{
    switch (f) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    default: return 4;
    }
}
API CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    CALLED();
    if (d == NULL || a == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned long long k;
    CUresult rc = sim_alloc(&k, d->Width * (d->Height ? d->Height : 1) * d->NumChannels * fmt_bytes(d->Format), 0);
    if (rc == CUDA_SUCCESS)
        *a = (CUarray)(uintptr_t)k;
    return rc;
}
API CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    CALLED();
    if (d == NULL || a == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned long long k;
    CUresult rc = sim_alloc(&k, d->Width * (d->Height ? d->Height : 1) * (d->Depth ? d->Depth : 1) * d->NumChannels *
                                    fmt_bytes(d->Format), 0);
    if (rc == CUDA_SUCCESS)
        *a = (CUarray)(uintptr_t)k;
    return rc;
}
API CUresult cuArrayDestroy(CUarray a) { CALLED(); return sim_free((uint64_t)(uintptr_t)a, 0); }
API CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    CALLED();
    if (d == NULL || a == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned long long k; uint64_t sz = d->Width * (d->Height ? d->Height : 1) * (d->Depth ? d->Depth : 1) * d->NumChannels * fmt_bytes(d->Format);
    (void)levels;
    CUresult rc = sim_alloc(&k, sz + sz / 3, 0);
    if (rc == CUDA_SUCCESS)
        *a = (CUmipmappedArray)(uintptr_t)k;
    return rc;
}
API CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) { CALLED(); return sim_free((uint64_t)(uintptr_t)a, 0); }

API CUresult cuMemGetInfo_v2(size_t *f, size_t *t)
{
    CALLED();
    if (f == NULL || t == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mmu);
    *t = mem_total();
    *f = *t - mem_used;
    pthread_mutex_unlock(&mmu);
    return CUDA_SUCCESS;
}
API CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { (void)d; CALLED(); if (!b) return CUDA_ERROR_INVALID_VALUE; *b = mem_total(); return CUDA_SUCCESS; }

/* ---- init, devices, contexts -------------------------------------------------------------------------------- */
static struct CUctx_st primary_ctxs[16] = {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}, {7, 1},
                                           {8, 1}, {9, 1}, {10, 1}, {11, 1}, {12, 1}, {13, 1}, {14, 1}, {15, 1}};
static int primary_refs_dev[16];
#define primary_ctx primary_ctxs[0]
#define DEV_OK(d) ((d) >= 0 && (d) < sim_devices())

API CUresult cuInit(unsigned f) { (void)f; CALLED(); return CUDA_SUCCESS; }
API CUresult cuDriverGetVersion(int *v)
{
    CALLED();
    const char *s = getenv("SIMCUDA_DRIVER_VERSION");
    *v = s ? atoi(s) : 13000;
    return CUDA_SUCCESS;
}
/* SIMCUDA_DEVICES=n (1..16, default 1): that many devices, each with its own primary context; contexts know their
 * device (cuCtxGetDevice). Memory stays one pool for the process; kernel time goes on the device's own timeline. */
#define SIM_MAX_DEVICES 16
static int sim_devices(void)
{
    const char *s = getenv("SIMCUDA_DEVICES");
    int n = s ? atoi(s) : 1;
    return n < 1 ? 1 : n > SIM_MAX_DEVICES ? SIM_MAX_DEVICES : n;
}
API CUresult cuDeviceGet(CUdevice *d, int o) { CALLED(); if (o < 0 || o >= sim_devices()) return CUDA_ERROR_INVALID_VALUE; *d = o; return CUDA_SUCCESS; }
API CUresult cuDeviceGetCount(int *n) { CALLED(); *n = sim_devices(); return CUDA_SUCCESS; }
API CUresult cuDeviceGetName(char *name, int len, CUdevice d) { (void)d; CALLED(); snprintf(name, (size_t)len, "simcuda"); return CUDA_SUCCESS; }
API CUresult cuCtxCreate_v2(CUcontext *c, unsigned f, CUdevice d)
{
    (void)f; CALLED();
    *c = calloc(1, sizeof **c);
    (*c)->dev = d;
    cur_ctx = *c;
    return CUDA_SUCCESS;
}
API CUresult cuCtxCreate_v3(CUcontext *c, CUexecAffinityParam *p, int n, unsigned f, CUdevice d) { (void)p; (void)n; CALLED(); return cuCtxCreate_v2(c, f, d); }
API CUresult cuCtxCreate_v4(CUcontext *c, CUctxCreateParams *p, unsigned f, CUdevice d) { (void)p; CALLED(); return cuCtxCreate_v2(c, f, d); }
API CUresult cuCtxDestroy_v2(CUcontext c) { CALLED(); if (!c || c->primary) return CUDA_ERROR_INVALID_VALUE; free_ctx_allocs(c); if (cur_ctx == c) cur_ctx = NULL; free(c); return CUDA_SUCCESS; }
API CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { CALLED(); if (!DEV_OK(d)) return CUDA_ERROR_INVALID_VALUE; primary_refs_dev[d]++; *c = &primary_ctxs[d]; return CUDA_SUCCESS; }
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { CALLED(); if (!DEV_OK(d) || primary_refs_dev[d] == 0) return CUDA_ERROR_INVALID_VALUE; if (--primary_refs_dev[d] == 0) free_ctx_allocs(&primary_ctxs[d]); return CUDA_SUCCESS; }
API CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) { CALLED(); if (!DEV_OK(d)) return CUDA_ERROR_INVALID_VALUE; primary_refs_dev[d] = 0; free_ctx_allocs(&primary_ctxs[d]); return CUDA_SUCCESS; }
API CUresult cuCtxSetCurrent(CUcontext c) { CALLED(); cur_ctx = c; return CUDA_SUCCESS; }
API CUresult cuCtxGetCurrent(CUcontext *c) { *c = cur_ctx; return CUDA_SUCCESS; }

/* ---- modules and functions ------------------------------------------------------------------------------------ */
struct CUfunc_st { char name[32]; uint64_t base_ns; _Atomic int loaded; };
API CUresult cuModuleLoadData(void **m, const void *img) { (void)img; CALLED(); *m = (void *)0x1; return CUDA_SUCCESS; }
API CUresult cuModuleGetFunction(CUfunction *f, void *m, const char *name)
{
    (void)m; CALLED();
    *f = calloc(1, sizeof **f);
    snprintf((*f)->name, sizeof (*f)->name, "%s", name);
    const char *c = strrchr(name, ':');
    (*f)->base_ns = c ? strtoull(c + 1, NULL, 10) : 0;
    return CUDA_SUCCESS;
}

/* ---- streams, timelines, capture ------------------------------------------------------------------------------- */
#define QDEPTH 1024
struct graph { uint64_t dur, mem; };
struct CUstream_st {
    pthread_mutex_t mu;
    uint64_t busy_until;
    uint64_t spell; /* when its current busy spell began (SIMCUDA_FOREIGN_SLICE's head) */
    uint64_t ends[QDEPTH];
    unsigned qpos;
    int capturing, mode, invalidated;
    pthread_t owner;
    struct graph *capture;
};
static _Atomic int global_captures;
static __thread int my_strict_captures;
static struct CUstream_st legacy_stream = {.mu = PTHREAD_MUTEX_INITIALIZER};
static __thread struct CUstream_st *ptds_stream;

static struct CUstream_st *S(CUstream s, int pt)
{
    if (s != NULL && s != (CUstream)0x1 && s != (CUstream)0x2)
        return s;
    if (s == (CUstream)0x2 || (s == NULL && pt)) { /* CU_STREAM_PER_THREAD, or 0 through a _ptsz entry */
        if (ptds_stream == NULL) {
            ptds_stream = calloc(1, sizeof *ptds_stream);
            pthread_mutex_init(&ptds_stream->mu, NULL);
        }
        return ptds_stream;
    }
    return &legacy_stream;
}

API CUresult cuStreamCreate(CUstream *s, unsigned f)
{
    (void)f; CALLED();
    *s = calloc(1, sizeof **s);
    pthread_mutex_init(&(*s)->mu, NULL);
    return CUDA_SUCCESS;
}
API CUresult cuStreamDestroy_v2(CUstream s) { CALLED(); (void)s; return CUDA_SUCCESS; }

static uint64_t stream_tail(struct CUstream_st *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t t = s->busy_until;
    pthread_mutex_unlock(&s->mu);
    return t;
}
static CUresult stream_sync(CUstream s, int pt) { sleep_until(stream_tail(S(s, pt))); return CUDA_SUCCESS; }
API CUresult cuStreamSynchronize(CUstream s) { CALLED(); return stream_sync(s, 0); }
API CUresult cuStreamSynchronize_ptsz(CUstream s) { CALLED(); return stream_sync(s, 1); }
API CUresult cuStreamQuery(CUstream s) { CALLED(); return stream_tail(S(s, 0)) <= now_ns() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY; }
API CUresult cuCtxSynchronize(void) { CALLED(); sleep_until(stream_tail(&legacy_stream)); if (ptds_stream) sleep_until(stream_tail(ptds_stream)); return CUDA_SUCCESS; }

/* SIMCUDA_FOREIGN_SLICE=ns:every[:head]: before every `every`-th kernel the stream waits `ns` for another context's
 * time slice (a GPU that time-slices between processes): event pairs and fence intervals around it hold that time,
 * which is not this process's GPU time. With `head` (ns), only kernels that start within `head` of the start of the
 * stream's busy spell (a launch onto a stream idle for 5 ms) wait: the head of a turn that runs interleaved with the
 * previous holder's tail, as on an H100 (bench/RESULTS.md, 2026-12-07). */
#define SPELL_GAP_NS 5000000ull /* idle this long, the stream's next launch starts a new busy spell (a new turn) */
static uint64_t foreign_slice(struct CUstream_st *s, uint64_t now, uint64_t from)
{
    static _Atomic uint64_t n;
    static uint64_t ns, every, head;
    static int parsed;
    if (!parsed) {
        const char *v = getenv("SIMCUDA_FOREIGN_SLICE");
        char *end = NULL;
        if (v != NULL) {
            ns = strtoull(v, &end, 10);
            every = end && *end == ':' ? strtoull(end + 1, &end, 10) : 0;
            head = end && *end == ':' ? strtoull(end + 1, NULL, 10) : 0;
        }
        parsed = 1;
    }
    if (s->busy_until + SPELL_GAP_NS <= now)
        s->spell = now;
    if (head && from - s->spell >= head)
        return 0;
    return every && (atomic_fetch_add(&n, 1) + 1) % every == 0 ? ns : 0;
}

/* The memory a device's timeline reports for this process: all of it with one device (graphs and pools included);
 * with several, the allocations made in that device's contexts (VMM handles count on device 0). */
static uint64_t mem_on(int dev)
{
    static int devices; /* SIMCUDA_DEVICES, read once: this is on every launch */
    if (devices == 0)
        devices = sim_devices();
    if (devices == 1)
        return mem_used;
    uint64_t sum = 0;
    pthread_mutex_lock(&mmu);
    for (size_t i = 0; i < nallocs; i++)
        if ((allocs[i].ctx ? allocs[i].ctx->dev : 0) == dev)
            sum += allocs[i].size;
    pthread_mutex_unlock(&mmu);
    return sum;
}

static CUresult run_kind(CUstream hs, int pt, uint64_t dur, enum simtl_kind kind);
static CUresult run(CUstream hs, int pt, uint64_t dur) { return run_kind(hs, pt, dur, SIMTL_KERNEL); }
static CUresult run_kind(CUstream hs, int pt, uint64_t dur, enum simtl_kind kind)
{
    struct CUstream_st *s = S(hs, pt);
    for (;;) {
        pthread_mutex_lock(&s->mu);
        if (s->capturing) {
            s->capture->dur += dur;
            pthread_mutex_unlock(&s->mu);
            return CUDA_SUCCESS;
        }
        uint64_t now = now_ns(), oldest = s->ends[s->qpos];
        if (oldest > now) { /* queue full: block until its oldest launch finishes */
            pthread_mutex_unlock(&s->mu);
            sleep_until(oldest);
            continue;
        }
        uint64_t from = s->busy_until > now ? s->busy_until : now;
        if (kind == SIMTL_KERNEL)
            from += foreign_slice(s, now, from);
        int dev = cur_ctx ? cur_ctx->dev : 0;
        uint64_t start = simtl_book(dev, from, dur, mem_on(dev), kind);
        s->busy_until = start + dur;
        s->ends[s->qpos] = s->busy_until;
        s->qpos = (s->qpos + 1) % QDEPTH;
        busy_ns += dur;
        pthread_mutex_unlock(&s->mu);
        return CUDA_SUCCESS;
    }
}

/* SIMCUDA_FIRST_LAUNCH_NS: a function's first launch holds the host this long before it is queued, as the real
 * driver's lazy module loading does (CUDA_MODULE_LOADING=LAZY, the default: 1-5 ms per module on the H200). */
static void first_launch(CUfunction f)
{
    const char *every = getenv("SIMCUDA_LAUNCH_HOLD_NS"); /* every launch holds the host this long */
    uint64_t ns = every ? strtoull(every, NULL, 10) : 0;
    if (f != NULL && !atomic_exchange(&f->loaded, 1)) {
        const char *v = getenv("SIMCUDA_FIRST_LAUNCH_NS");
        ns += v ? strtoull(v, NULL, 10) : 0;
    }
    if (ns == 0)
        return;
    uint64_t until = now_ns() + ns;
    if (ns < 200000) { /* the driver's own CPU time per launch (~5 us on the H200 VM): a sleep would be the timer's */
        while (now_ns() < until) {
        }
    } else {
        sleep_until(until);
    }
}

static uint64_t duration(CUfunction f, uint64_t blocks, void **params)
{
    first_launch(f);
    const char *w = getenv("SIMCUDA_WAVE_BLOCKS");
    uint64_t per = w ? strtoull(w, NULL, 10) : 128, waves = (blocks + per - 1) / per;
    uint64_t base = params && params[0] ? *(uint64_t *)params[0] : f && f->base_ns ? f->base_ns : 1000u;
    return base * (waves ? waves : 1);
}
#define BL(x, y, z) ((uint64_t)(x) * (uint64_t)(y) * (uint64_t)(z))

#define KP CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, CUstream hs
#define UNUSED_K (void)bx, (void)by, (void)bz, (void)sh
API CUresult cuLaunchKernel(KP, void **p, void **e) { (void)e; UNUSED_K; CALLED(); if (!f) return CUDA_ERROR_INVALID_VALUE; return run(hs, 0, duration(f, BL(gx, gy, gz), p)); }
API CUresult cuLaunchKernel_ptsz(KP, void **p, void **e) { (void)e; UNUSED_K; CALLED(); if (!f) return CUDA_ERROR_INVALID_VALUE; return run(hs, 1, duration(f, BL(gx, gy, gz), p)); }
API CUresult cuLaunchCooperativeKernel(KP, void **p) { UNUSED_K; CALLED(); if (!f) return CUDA_ERROR_INVALID_VALUE; return run(hs, 0, duration(f, BL(gx, gy, gz), p)); }
API CUresult cuLaunchCooperativeKernel_ptsz(KP, void **p) { UNUSED_K; CALLED(); if (!f) return CUDA_ERROR_INVALID_VALUE; return run(hs, 1, duration(f, BL(gx, gy, gz), p)); }
API CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e) { (void)e; CALLED(); if (!f || !c) return CUDA_ERROR_INVALID_VALUE; return run(c->hStream, 0, duration(f, BL(c->gridDimX, c->gridDimY, c->gridDimZ), p)); }
API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e) { (void)e; CALLED(); if (!f || !c) return CUDA_ERROR_INVALID_VALUE; return run(c->hStream, 1, duration(f, BL(c->gridDimX, c->gridDimY, c->gridDimZ), p)); }
API CUresult cuLaunch(CUfunction f) { CALLED(); if (!f) return CUDA_ERROR_INVALID_VALUE; return run(NULL, 0, duration(f, 1, NULL)); }
API CUresult cuLaunchGrid(CUfunction f, int w, int h) { CALLED(); if (!f || w <= 0 || h <= 0) return CUDA_ERROR_INVALID_VALUE; return run(NULL, 0, duration(f, BL(w, h, 1), NULL)); }
API CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream hs) { CALLED(); if (!f || w <= 0 || h <= 0) return CUDA_ERROR_INVALID_VALUE; return run(hs, 0, duration(f, BL(w, h, 1), NULL)); }
API CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *l, unsigned n, unsigned flags)
{
    (void)flags; CALLED();
    if (!l || n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < n; i++) /* one simulated GPU: every device's share runs on it */
        run(l[i].hStream, 0, duration(l[i].function, BL(l[i].gridDimX, l[i].gridDimY, l[i].gridDimZ), l[i].kernelParams));
    return CUDA_SUCCESS;
}

/* capture streams, to invalidate on a forbidden event query */
static struct CUstream_st *_Atomic capturing_streams[64];

static CUresult begin_capture(CUstream hs, int pt, int mode)
{
    struct CUstream_st *s = S(hs, pt);
    pthread_mutex_lock(&s->mu);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (!s->capturing) {
        s->capturing = 1;
        s->mode = mode;
        s->invalidated = 0;
        s->owner = pthread_self();
        s->capture = calloc(1, sizeof *s->capture);
        if (mode == 0)
            global_captures++;
        if (mode != 2)
            my_strict_captures++;
        for (int i = 0; i < 64; i++) {
            struct CUstream_st *z = NULL;
            if (atomic_compare_exchange_strong(&capturing_streams[i], &z, s))
                break;
        }
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}
static CUresult end_capture(CUstream hs, int pt, CUgraph *g)
{
    struct CUstream_st *s = S(hs, pt);
    pthread_mutex_lock(&s->mu);
    CUresult rc = 401; /* CUDA_ERROR_ILLEGAL_STATE */
    if (s->capturing && s->mode != 2 && !pthread_equal(s->owner, pthread_self())) {
        rc = 908; /* CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: the capture goes on */
    } else if (s->capturing) {
        s->capturing = 0;
        if (s->mode == 0)
            global_captures--;
        if (s->mode != 2)
            my_strict_captures--;
        for (int i = 0; i < 64; i++) {
            struct CUstream_st *me = s;
            if (atomic_compare_exchange_strong(&capturing_streams[i], &me, NULL))
                break;
        }
        const char *forced = getenv("SIMCUDA_END_CAPTURE_RC");
        if (s->invalidated) {
            *g = NULL;
            free(s->capture);
            rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        } else if (forced != NULL) {
            *g = NULL;
            free(s->capture);
            rc = atoi(forced);
        } else {
            *g = (CUgraph)s->capture;
            rc = CUDA_SUCCESS;
        }
        s->capture = NULL;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}
/* An event query while a capture forbids it: the driver invalidates the capture(s) concerned. */
static int query_forbidden(void)
{
    if (global_captures == 0 && my_strict_captures == 0)
        return 0;
    for (int i = 0; i < 64; i++) {
        struct CUstream_st *s = capturing_streams[i];
        if (s != NULL && (s->mode == 0 || (s->mode == 1 && pthread_equal(s->owner, pthread_self()))))
            s->invalidated = 1;
    }
    return 1;
}
API CUresult cuStreamBeginCapture(CUstream s) { CALLED(); return begin_capture(s, 0, 0); }
API CUresult cuStreamBeginCapture_ptsz(CUstream s) { CALLED(); return begin_capture(s, 1, 0); }
API CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode m) { CALLED(); return begin_capture(s, 0, m); }
API CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode m) { CALLED(); return begin_capture(s, 1, m); }
API CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *d, const CUgraphEdgeData *e, size_t n, CUstreamCaptureMode m) { (void)g; (void)d; (void)e; (void)n; CALLED(); return begin_capture(s, 0, m); }
API CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode *d, const CUgraphEdgeData *e, size_t n, CUstreamCaptureMode m) { (void)g; (void)d; (void)e; (void)n; CALLED(); return begin_capture(s, 1, m); }
API CUresult cuStreamEndCapture(CUstream s, CUgraph *g) { CALLED(); return end_capture(s, 0, g); }
API CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g) { CALLED(); return end_capture(s, 1, g); }
static CUresult is_capturing(CUstream hs, int pt, CUstreamCaptureStatus *st)
{
    struct CUstream_st *s = S(hs, pt);
    pthread_mutex_lock(&s->mu);
    *st = s->capturing ? (s->invalidated ? 2 : 1) : 0;
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}
API CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st) { CALLED(); return is_capturing(s, 0, st); }
API CUresult cuStreamIsCapturing_ptsz(CUstream s, CUstreamCaptureStatus *st) { CALLED(); return is_capturing(s, 1, st); }
API CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long f)
{
    (void)f; CALLED();
    struct graph *x = malloc(sizeof *x);
    *x = *(struct graph *)g;
    *e = (CUgraphExec)x;
    return CUDA_SUCCESS;
}
/* graph memory: a launch reserves what the graph's memory nodes need; the reservation stays until trimmed */
static uint64_t graph_reserved;
static CUresult graph_mem(struct graph *g)
{
    pthread_mutex_lock(&mmu);
    if (g->mem > graph_reserved) {
        if (g->mem - graph_reserved > mem_total() - mem_used) {
            pthread_mutex_unlock(&mmu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        mem_used += g->mem - graph_reserved;
        graph_reserved = g->mem;
        if (mem_used > peak_mem)
            peak_mem = mem_used;
    }
    pthread_mutex_unlock(&mmu);
    return CUDA_SUCCESS;
}
API CUresult cuGraphLaunch(CUgraphExec e, CUstream s) { CALLED(); if (!e) return CUDA_ERROR_INVALID_VALUE; CUresult rc = graph_mem((struct graph *)e); return rc ? rc : run(s, 0, ((struct graph *)e)->dur); }
API CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s) { CALLED(); if (!e) return CUDA_ERROR_INVALID_VALUE; CUresult rc = graph_mem((struct graph *)e); return rc ? rc : run(s, 1, ((struct graph *)e)->dur); }
API CUresult cuDeviceGraphMemTrim(CUdevice d) { (void)d; CALLED(); pthread_mutex_lock(&mmu); mem_used -= graph_reserved; graph_reserved = 0; pthread_mutex_unlock(&mmu); return CUDA_SUCCESS; }
API CUresult cuDeviceGetGraphMemAttribute(CUdevice d, int attr, void *v)
{
    (void)d; CALLED();
    if (v == NULL || attr < 0 || attr > 3)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mmu);
    *(cuuint64_t *)v = graph_reserved; /* used and reserved alike: one graph pool, no fragmentation */
    pthread_mutex_unlock(&mmu);
    return CUDA_SUCCESS;
}
API CUresult cuGraphAddMemAllocNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t nd, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    (void)d; (void)nd; (void)p; CALLED();
    if (n == NULL || g == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *n = (CUgraphNode)0x1;
    return CUDA_SUCCESS;
}

/* stream-ordered allocation: pools keep freed bytes up to their release threshold (one default pool per device,
 * handle 0x5000; cuMemPoolSetAttribute(RELEASE_THRESHOLD), cuMemPoolTrimTo); an allocation into a capturing
 * stream becomes graph memory (reserved by the graph's launch). */
struct pool { uint64_t handle, threshold, cached; };
static struct pool pools[8] = {{0x5000, 0, 0}};
static unsigned npools = 1;
static struct pool *pool_of(uint64_t h)
{
    for (unsigned i = 0; i < npools; i++)
        if (pools[i].handle == h)
            return &pools[i];
    if (npools < 8) {
        pools[npools] = (struct pool){h, 0, 0};
        return &pools[npools++];
    }
    return NULL;
}
static CUresult alloc_async(CUdeviceptr *p, size_t n, uint64_t pl, CUstream hs, int pt)
{
    if (p == NULL || n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = S(hs, pt);
    pthread_mutex_lock(&s->mu);
    if (s->capturing) {
        s->capture->mem += n;
        pthread_mutex_unlock(&s->mu);
        pthread_mutex_lock(&mmu);
        *p = next_addr;
        next_addr += (n + 0xFFFFF) & ~0xFFFFFull;
        pthread_mutex_unlock(&mmu);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&mmu);
    struct pool *po = pool_of(pl);
    uint64_t take = po ? (po->cached < n ? po->cached : n) : 0;
    if (po)
        po->cached -= take;
    mem_used -= take; /* sim_alloc counts the whole size again */
    pthread_mutex_unlock(&mmu);
    CUresult rc = sim_alloc(p, n, 0);
    pthread_mutex_lock(&mmu);
    if (rc != CUDA_SUCCESS) {
        mem_used += take;
        if (po)
            po->cached += take;
    } else {
        for (size_t i = nallocs; i-- > 0;)
            if (allocs[i].key == *p) {
                allocs[i].pool = pl;
                break;
            }
    }
    pthread_mutex_unlock(&mmu);
    return rc;
}
static CUresult free_async(CUdeviceptr p)
{
    pthread_mutex_lock(&mmu);
    for (size_t i = 0; i < nallocs; i++) {
        if (allocs[i].key == p) {
            struct pool *po = allocs[i].pool ? pool_of(allocs[i].pool) : NULL;
            uint64_t keep = 0;
            if (po && po->threshold > po->cached)
                keep = po->threshold - po->cached < allocs[i].size ? po->threshold - po->cached : allocs[i].size;
            if (po)
                po->cached += keep;
            mem_used += keep; /* drop_alloc gives the whole size back; the pool still holds `keep` */
            drop_alloc(i);
            pthread_mutex_unlock(&mmu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mmu);
    return CUDA_ERROR_INVALID_VALUE;
}
#define DEFAULT_POOL 0x5000
API CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { CALLED(); return alloc_async(p, n, DEFAULT_POOL, s, 0); }
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { CALLED(); return alloc_async(p, n, DEFAULT_POOL, s, 1); }
API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pl, CUstream s) { CALLED(); return alloc_async(p, n, (uintptr_t)pl, s, 0); }
API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pl, CUstream s) { CALLED(); return alloc_async(p, n, (uintptr_t)pl, s, 1); }
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; CALLED(); return free_async(p); }
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { (void)s; CALLED(); return free_async(p); }
API CUresult cuDeviceGetMemPool(CUmemoryPool *pl, CUdevice d) { CALLED(); if (!pl || d != 0) return CUDA_ERROR_INVALID_VALUE; *pl = (CUmemoryPool)DEFAULT_POOL; return CUDA_SUCCESS; }
/* SIMCUDA_MPS=1: contexts are an MPS server's clients (CU_DEVICE_ATTRIBUTE_MPS_ENABLED, 133; the only attribute
 * the simulated driver knows: any other is CUDA_ERROR_INVALID_VALUE, as a driver answers one it does not know). */
API CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d)
{
    CALLED();
    if (v == NULL || !DEV_OK(d) || attr != 133)
        return CUDA_ERROR_INVALID_VALUE;
    const char *s = getenv("SIMCUDA_MPS");
    *v = s != NULL && strcmp(s, "1") == 0;
    return CUDA_SUCCESS;
}
API CUresult cuCtxGetDevice(CUdevice *d) { if (!d) return CUDA_ERROR_INVALID_VALUE; *d = cur_ctx ? cur_ctx->dev : 0; return CUDA_SUCCESS; }
API CUresult cuMemPoolSetAttribute(CUmemoryPool pl, CUmemPool_attribute attr, void *v)
{
    CALLED();
    if (v == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mmu);
    struct pool *po = pool_of((uintptr_t)pl);
    if (po && attr == 4) {
        po->threshold = *(cuuint64_t *)v;
        if (po->cached > po->threshold) {
            mem_used -= po->cached - po->threshold;
            po->cached = po->threshold;
        }
    }
    pthread_mutex_unlock(&mmu);
    return CUDA_SUCCESS;
}
API CUresult cuMemPoolTrimTo(CUmemoryPool pl, size_t keep)
{
    CALLED();
    pthread_mutex_lock(&mmu);
    struct pool *po = pool_of((uintptr_t)pl);
    if (po && po->cached > keep) {
        mem_used -= po->cached - keep;
        po->cached = keep;
    }
    pthread_mutex_unlock(&mmu);
    return CUDA_SUCCESS;
}
API CUresult cuMemPoolDestroy(CUmemoryPool pl)
{
    CALLED();
    pthread_mutex_lock(&mmu);
    struct pool *po = pool_of((uintptr_t)pl);
    if (po) {
        mem_used -= po->cached;
        po->cached = 0;
        po->threshold = 0;
    }
    pthread_mutex_unlock(&mmu);
    return CUDA_SUCCESS;
}

/* ---- events ------------------------------------------------------------------------------------------------ */
struct CUevent_st { uint64_t t; int recorded; };
API CUresult cuEventCreate(CUevent *e, unsigned f) { (void)f; CALLED(); *e = calloc(1, sizeof **e); return CUDA_SUCCESS; }
API CUresult cuEventDestroy_v2(CUevent e) { CALLED(); free(e); return CUDA_SUCCESS; }
/* SIMCUDA_EVENT_NS: the host time an event call costs the real driver (read once; 0 by default). */
static void event_cost(void)
{
    static int64_t ns = -1;
    if (ns < 0) {
        const char *v = getenv("SIMCUDA_EVENT_NS");
        ns = v ? (int64_t)strtoull(v, NULL, 10) : 0;
    }
    if (ns > 0)
        for (uint64_t until = now_ns() + (uint64_t)ns; now_ns() < until;) {
        }
}

static CUresult event_record(CUevent e, CUstream hs, int pt)
{
    event_cost();
    if (e == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = S(hs, pt);
    pthread_mutex_lock(&s->mu);
    uint64_t now = now_ns();
    e->t = s->busy_until > now ? s->busy_until : now;
    e->recorded = 1;
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent e, CUstream s) { CALLED(); return event_record(e, s, 0); }
API CUresult cuEventRecord_ptsz(CUevent e, CUstream s) { CALLED(); return event_record(e, s, 1); }
API CUresult cuEventQuery(CUevent e)
{
    CALLED();
    if (!e)
        return CUDA_ERROR_INVALID_VALUE;
    if (query_forbidden())
        return 900;
    event_cost();
    return e->t <= now_ns() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
API CUresult cuEventSynchronize(CUevent e) { CALLED(); sleep_until(e->t); return CUDA_SUCCESS; }
API CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
    CALLED();
    if (!a || !b || !a->recorded || !b->recorded)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t now = now_ns();
    if (a->t > now || b->t > now)
        return CUDA_ERROR_NOT_READY;
    *ms = (float)(((double)b->t - (double)a->t) / 1e6);
    return CUDA_SUCCESS;
}
API CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

/* ---- memory copies: copy-engine time on the stream's timeline (SIMCUDA_COPY_BYTES_PER_US, default 25000: 25 GB/s);
 * the synchronous forms wait for it ------------------------------------------------------------------------------ */
static uint64_t copy_ns(size_t n)
{
    const char *r = getenv("SIMCUDA_COPY_BYTES_PER_US");
    uint64_t per_us = r ? strtoull(r, NULL, 10) : 25000u;
    return per_us ? (uint64_t)n * 1000u / per_us : 0;
}
static CUresult copy_async(CUstream hs, int pt, size_t n) { return n ? run_kind(hs, pt, copy_ns(n), SIMTL_COPY) : CUDA_SUCCESS; }
static CUresult copy_sync(int pt, size_t n)
{
    CUresult rc = copy_async(NULL, pt, n);
    if (rc == CUDA_SUCCESS)
        stream_sync(NULL, pt);
    return rc;
}
API CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { (void)d; (void)s; CALLED(); return copy_sync(0, n); }
API CUresult cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { (void)d; (void)s; CALLED(); return copy_sync(1, n); }
API CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { (void)d; (void)s; CALLED(); return copy_async(h, 0, n); }
API CUresult cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { (void)d; (void)s; CALLED(); return copy_async(h, 1, n); }
API CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { (void)d; (void)s; CALLED(); return copy_sync(0, n); }
API CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *s, size_t n) { (void)d; (void)s; CALLED(); return copy_sync(1, n); }
API CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { (void)d; (void)s; CALLED(); return copy_sync(0, n); }
API CUresult cuMemcpyDtoH_v2_ptds(void *d, CUdeviceptr s, size_t n) { (void)d; (void)s; CALLED(); return copy_sync(1, n); }
API CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { (void)d; (void)s; CALLED(); return copy_sync(0, n); }
API CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { (void)d; (void)s; CALLED(); return copy_sync(1, n); }
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream h) { (void)d; (void)s; CALLED(); return copy_async(h, 0, n); }
API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *s, size_t n, CUstream h) { (void)d; (void)s; CALLED(); return copy_async(h, 1, n); }
API CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream h) { (void)d; (void)s; CALLED(); return copy_async(h, 0, n); }
API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *d, CUdeviceptr s, size_t n, CUstream h) { (void)d; (void)s; CALLED(); return copy_async(h, 1, n); }
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { (void)d; (void)s; CALLED(); return copy_async(h, 0, n); }
API CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { (void)d; (void)s; CALLED(); return copy_async(h, 1, n); }

/* ---- cuGetProcAddress --------------------------------------------------------------------------------------- */
struct proc { const char *base; int vmin; int pt; void *fn; };
#define PR(base, vmin, pt, fn) {base, vmin, pt, (void *)&fn}
API CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags);
API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, CUdriverProcAddressQueryResult *st);
static const struct proc procs[] = {
    PR("cuInit", 2000, 0, cuInit), PR("cuDriverGetVersion", 2020, 0, cuDriverGetVersion),
    PR("cuGetProcAddress", 11030, 0, cuGetProcAddress), PR("cuGetProcAddress", 12000, 0, cuGetProcAddress_v2),
    PR("cuDeviceGet", 2000, 0, cuDeviceGet), PR("cuDeviceGetCount", 2000, 0, cuDeviceGetCount),
    PR("cuDeviceGetName", 2000, 0, cuDeviceGetName), PR("cuDeviceTotalMem", 3020, 0, cuDeviceTotalMem_v2),
    PR("cuCtxCreate", 3020, 0, cuCtxCreate_v2), PR("cuCtxCreate", 11040, 0, cuCtxCreate_v3),
    PR("cuCtxCreate", 12050, 0, cuCtxCreate_v4), PR("cuCtxDestroy", 4000, 0, cuCtxDestroy_v2),
    PR("cuDevicePrimaryCtxRetain", 7000, 0, cuDevicePrimaryCtxRetain),
    PR("cuDevicePrimaryCtxRelease", 11000, 0, cuDevicePrimaryCtxRelease_v2),
    PR("cuDevicePrimaryCtxReset", 11000, 0, cuDevicePrimaryCtxReset_v2),
    PR("cuCtxSetCurrent", 4000, 0, cuCtxSetCurrent), PR("cuCtxGetCurrent", 4000, 0, cuCtxGetCurrent),
    PR("cuCtxSynchronize", 2000, 0, cuCtxSynchronize),
    PR("cuModuleLoadData", 2000, 0, cuModuleLoadData), PR("cuModuleGetFunction", 2000, 0, cuModuleGetFunction),
    PR("cuMemAlloc", 3020, 0, cuMemAlloc_v2), PR("cuMemAllocPitch", 3020, 0, cuMemAllocPitch_v2),
    PR("cuMemAllocManaged", 6000, 0, cuMemAllocManaged), PR("cuMemFree", 3020, 0, cuMemFree_v2),
    PR("cuMemCreate", 10020, 0, cuMemCreate), PR("cuMemRelease", 10020, 0, cuMemRelease),
    PR("cuMemMap", 10020, 0, cuMemMap), PR("cuMemUnmap", 10020, 0, cuMemUnmap),
    PR("cuMemAddressReserve", 10020, 0, cuMemAddressReserve), PR("cuMemAddressFree", 10020, 0, cuMemAddressFree),
    PR("cuMemAllocAsync", 11020, 0, cuMemAllocAsync), PR("cuMemAllocAsync", 11020, 1, cuMemAllocAsync_ptsz),
    PR("cuMemAllocFromPoolAsync", 11020, 0, cuMemAllocFromPoolAsync),
    PR("cuMemAllocFromPoolAsync", 11020, 1, cuMemAllocFromPoolAsync_ptsz),
    PR("cuMemFreeAsync", 11020, 0, cuMemFreeAsync), PR("cuMemFreeAsync", 11020, 1, cuMemFreeAsync_ptsz),
    PR("cuArrayCreate", 3020, 0, cuArrayCreate_v2), PR("cuArray3DCreate", 3020, 0, cuArray3DCreate_v2),
    PR("cuArrayDestroy", 2000, 0, cuArrayDestroy), PR("cuMipmappedArrayCreate", 5000, 0, cuMipmappedArrayCreate),
    PR("cuMipmappedArrayDestroy", 5000, 0, cuMipmappedArrayDestroy), PR("cuMemGetInfo", 3020, 0, cuMemGetInfo_v2),
    PR("cuStreamCreate", 2000, 0, cuStreamCreate), PR("cuStreamDestroy", 4000, 0, cuStreamDestroy_v2),
    PR("cuStreamSynchronize", 2000, 0, cuStreamSynchronize), PR("cuStreamSynchronize", 7000, 1, cuStreamSynchronize_ptsz),
    PR("cuStreamQuery", 2000, 0, cuStreamQuery),
    PR("cuLaunchKernel", 4000, 0, cuLaunchKernel), PR("cuLaunchKernel", 7000, 1, cuLaunchKernel_ptsz),
    PR("cuLaunchKernelEx", 11060, 0, cuLaunchKernelEx), PR("cuLaunchKernelEx", 11060, 1, cuLaunchKernelEx_ptsz),
    PR("cuLaunchCooperativeKernel", 9000, 0, cuLaunchCooperativeKernel),
    PR("cuLaunchCooperativeKernel", 9000, 1, cuLaunchCooperativeKernel_ptsz),
    PR("cuLaunch", 2000, 0, cuLaunch), PR("cuLaunchGrid", 2000, 0, cuLaunchGrid),
    PR("cuLaunchGridAsync", 2000, 0, cuLaunchGridAsync),
    PR("cuLaunchCooperativeKernelMultiDevice", 9000, 0, cuLaunchCooperativeKernelMultiDevice),
    PR("cuGraphLaunch", 10000, 0, cuGraphLaunch), PR("cuGraphLaunch", 10000, 1, cuGraphLaunch_ptsz),
    PR("cuGraphInstantiateWithFlags", 11040, 0, cuGraphInstantiateWithFlags),
    PR("cuDeviceGraphMemTrim", 11040, 0, cuDeviceGraphMemTrim),
    PR("cuDeviceGetGraphMemAttribute", 11040, 0, cuDeviceGetGraphMemAttribute),
    PR("cuGraphAddMemAllocNode", 11040, 0, cuGraphAddMemAllocNode),
    PR("cuDeviceGetMemPool", 11020, 0, cuDeviceGetMemPool), PR("cuCtxGetDevice", 2000, 0, cuCtxGetDevice),
    PR("cuDeviceGetAttribute", 2000, 0, cuDeviceGetAttribute),
    PR("cuMemPoolSetAttribute", 11020, 0, cuMemPoolSetAttribute), PR("cuMemPoolTrimTo", 11020, 0, cuMemPoolTrimTo),
    PR("cuMemPoolDestroy", 11020, 0, cuMemPoolDestroy),
    PR("cuStreamBeginCapture", 10000, 0, cuStreamBeginCapture), PR("cuStreamBeginCapture", 10000, 1, cuStreamBeginCapture_ptsz),
    PR("cuStreamBeginCapture", 10010, 0, cuStreamBeginCapture_v2), PR("cuStreamBeginCapture", 10010, 1, cuStreamBeginCapture_v2_ptsz),
    PR("cuStreamBeginCaptureToGraph", 12030, 0, cuStreamBeginCaptureToGraph),
    PR("cuStreamBeginCaptureToGraph", 12030, 1, cuStreamBeginCaptureToGraph_ptsz),
    PR("cuStreamEndCapture", 10000, 0, cuStreamEndCapture), PR("cuStreamEndCapture", 10000, 1, cuStreamEndCapture_ptsz),
    PR("cuStreamIsCapturing", 10000, 0, cuStreamIsCapturing), PR("cuStreamIsCapturing", 10000, 1, cuStreamIsCapturing_ptsz),
    PR("cuEventCreate", 2000, 0, cuEventCreate), PR("cuEventDestroy", 4000, 0, cuEventDestroy_v2),
    PR("cuEventRecord", 2000, 0, cuEventRecord), PR("cuEventRecord", 7000, 1, cuEventRecord_ptsz),
    PR("cuEventQuery", 2000, 0, cuEventQuery), PR("cuEventSynchronize", 2000, 0, cuEventSynchronize),
    PR("cuEventElapsedTime", 2000, 0, cuEventElapsedTime), PR("cuEventElapsedTime", 12080, 0, cuEventElapsedTime_v2),
    PR("cuMemcpy", 4000, 0, cuMemcpy), PR("cuMemcpy", 7000, 1, cuMemcpy_ptds),
    PR("cuMemcpyAsync", 4000, 0, cuMemcpyAsync), PR("cuMemcpyAsync", 7000, 1, cuMemcpyAsync_ptsz),
    PR("cuMemcpyHtoD", 3020, 0, cuMemcpyHtoD_v2), PR("cuMemcpyHtoD", 7000, 1, cuMemcpyHtoD_v2_ptds),
    PR("cuMemcpyDtoH", 3020, 0, cuMemcpyDtoH_v2), PR("cuMemcpyDtoH", 7000, 1, cuMemcpyDtoH_v2_ptds),
    PR("cuMemcpyDtoD", 3020, 0, cuMemcpyDtoD_v2), PR("cuMemcpyDtoD", 7000, 1, cuMemcpyDtoD_v2_ptds),
    PR("cuMemcpyHtoDAsync", 3020, 0, cuMemcpyHtoDAsync_v2), PR("cuMemcpyHtoDAsync", 7000, 1, cuMemcpyHtoDAsync_v2_ptsz),
    PR("cuMemcpyDtoHAsync", 3020, 0, cuMemcpyDtoHAsync_v2), PR("cuMemcpyDtoHAsync", 7000, 1, cuMemcpyDtoHAsync_v2_ptsz),
    PR("cuMemcpyDtoDAsync", 3020, 0, cuMemcpyDtoDAsync_v2), PR("cuMemcpyDtoDAsync", 7000, 1, cuMemcpyDtoDAsync_v2_ptsz),
};

static CUresult lookup(const char *sym, void **pfn, int ver, cuuint64_t flags, CUdriverProcAddressQueryResult *st)
{
    if (sym == NULL || pfn == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    const struct proc *best = NULL;
    int exists = 0;
    for (int pass = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) ? 1 : 0; pass >= 0 && !best; pass--) {
        for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
            if (strcmp(procs[i].base, sym) != 0 || procs[i].pt != pass)
                continue;
            exists = 1;
            if (procs[i].vmin <= ver && (best == NULL || procs[i].vmin > best->vmin))
                best = &procs[i];
        }
    }
    *pfn = best ? best->fn : NULL;
    if (st)
        *st = best ? 0 : exists ? 2 : 1; /* SUCCESS, VERSION_NOT_SUFFICIENT, SYMBOL_NOT_FOUND */
    return best ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
API CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags) { CALLED(); return lookup(sym, pfn, ver, flags, NULL); }
API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, CUdriverProcAddressQueryResult *st) { CALLED(); return lookup(sym, pfn, ver, flags, st); }

