/* simapp: a CUDA driver-API program for the shim tests. It reaches the driver one of three ways, chosen by the
 * first argument `route=direct|dlsym|gpa` (direct: linked symbols; dlsym: dlopen + dlsym on the libcuda handle;
 * gpa: cuGetProcAddress_v2 with `ver=N` and, with `pt=1`, the per-thread default stream flag), then runs the
 * operations given as arguments and prints one line per operation. See the tests for the vocabulary. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"

/* prototypes of the simulated driver's exports this program links against */
#define KP CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream
CUresult cuInit(unsigned);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoH_v2_ptds(void *, CUdeviceptr, size_t);
CUresult cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyAsync_ptsz(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuArrayDestroy(CUarray);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuModuleGetFunction(CUfunction *, void *, const char *);
CUresult cuLaunchKernel(KP, void **, void **);
CUresult cuLaunchKernel_ptsz(KP, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchCooperativeKernel(KP, void **);
CUresult cuLaunchCooperativeKernel_ptsz(KP, void **);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphLaunch_ptsz(CUgraphExec, CUstream);
CUresult cuStreamBeginCapture_v2(CUstream, CUstreamCaptureMode);
CUresult cuStreamBeginCapture_v2_ptsz(CUstream, CUstreamCaptureMode);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuStreamEndCapture_ptsz(CUstream, CUgraph *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamSynchronize_ptsz(CUstream);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuLaunch(CUfunction);
CUresult cuDeviceGetMemPool(CUmemoryPool *, CUdevice);
CUresult cuMemPoolSetAttribute(CUmemoryPool, CUmemPool_attribute, void *);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
CUresult cuDeviceGraphMemTrim(CUdevice);
CUresult cuLaunchGrid(CUfunction, int, int);
CUresult cuLaunchGridAsync(CUfunction, int, int, CUstream);
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *, unsigned, unsigned);

/* X(field, type, plain symbol, per-thread symbol, base name for cuGetProcAddress) */
#define APIS(X)                                                                                                  \
    X(Init, CUresult (*)(unsigned), cuInit, cuInit, "cuInit")                                                  \
    X(PrimaryRetain, CUresult (*)(CUcontext *, CUdevice), cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain,   \
      "cuDevicePrimaryCtxRetain")                                                                                \
    X(PrimaryRelease, CUresult (*)(CUdevice), cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease_v2,       \
      "cuDevicePrimaryCtxRelease")                                                                               \
    X(SetCurrent, CUresult (*)(CUcontext), cuCtxSetCurrent, cuCtxSetCurrent, "cuCtxSetCurrent")                 \
    X(CtxCreate, void *, cuCtxCreate_v2, cuCtxCreate_v2, "cuCtxCreate")                                         \
    X(CtxDestroy, CUresult (*)(CUcontext), cuCtxDestroy_v2, cuCtxDestroy_v2, "cuCtxDestroy")                    \
    X(MemAlloc, CUresult (*)(CUdeviceptr *, size_t), cuMemAlloc_v2, cuMemAlloc_v2, "cuMemAlloc")                \
    X(MemFree, CUresult (*)(CUdeviceptr), cuMemFree_v2, cuMemFree_v2, "cuMemFree")                              \
    X(Managed, CUresult (*)(CUdeviceptr *, size_t, unsigned), cuMemAllocManaged, cuMemAllocManaged,             \
      "cuMemAllocManaged")                                                                                       \
    X(Pitch, CUresult (*)(CUdeviceptr *, size_t *, size_t, size_t, unsigned), cuMemAllocPitch_v2,               \
      cuMemAllocPitch_v2, "cuMemAllocPitch")                                                                     \
    X(AllocAsync, CUresult (*)(CUdeviceptr *, size_t, CUstream), cuMemAllocAsync, cuMemAllocAsync_ptsz,         \
      "cuMemAllocAsync")                                                                                         \
    X(AllocPool, CUresult (*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream), cuMemAllocFromPoolAsync,          \
      cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync")                                                   \
    X(FreeAsync, CUresult (*)(CUdeviceptr, CUstream), cuMemFreeAsync, cuMemFreeAsync_ptsz, "cuMemFreeAsync")    \
    X(MemCreate, CUresult (*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,              \
                              unsigned long long),                                                               \
      cuMemCreate, cuMemCreate, "cuMemCreate")                                                                   \
    X(MemRelease, CUresult (*)(CUmemGenericAllocationHandle), cuMemRelease, cuMemRelease, "cuMemRelease")       \
    X(ArrayCreate, CUresult (*)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *), cuArrayCreate_v2, cuArrayCreate_v2,  \
      "cuArrayCreate")                                                                                           \
    X(Array3DCreate, CUresult (*)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *), cuArray3DCreate_v2,              \
      cuArray3DCreate_v2, "cuArray3DCreate")                                                                     \
    X(ArrayDestroy, CUresult (*)(CUarray), cuArrayDestroy, cuArrayDestroy, "cuArrayDestroy")                    \
    X(MipCreate, CUresult (*)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned),                  \
      cuMipmappedArrayCreate, cuMipmappedArrayCreate, "cuMipmappedArrayCreate")                                  \
    X(MipDestroy, CUresult (*)(CUmipmappedArray), cuMipmappedArrayDestroy, cuMipmappedArrayDestroy,             \
      "cuMipmappedArrayDestroy")                                                                                 \
    X(MemGetInfo, CUresult (*)(size_t *, size_t *), cuMemGetInfo_v2, cuMemGetInfo_v2, "cuMemGetInfo")           \
    X(TotalMem, CUresult (*)(size_t *, CUdevice), cuDeviceTotalMem_v2, cuDeviceTotalMem_v2, "cuDeviceTotalMem") \
    X(GetFunction, CUresult (*)(CUfunction *, void *, const char *), cuModuleGetFunction, cuModuleGetFunction,  \
      "cuModuleGetFunction")                                                                                     \
    X(Launch, CUresult (*)(KP, void **, void **), cuLaunchKernel, cuLaunchKernel_ptsz, "cuLaunchKernel")        \
    X(LaunchEx, CUresult (*)(const CUlaunchConfig *, CUfunction, void **, void **), cuLaunchKernelEx,           \
      cuLaunchKernelEx_ptsz, "cuLaunchKernelEx")                                                                 \
    X(Coop, CUresult (*)(KP, void **), cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz,               \
      "cuLaunchCooperativeKernel")                                                                               \
    X(GraphLaunch, CUresult (*)(CUgraphExec, CUstream), cuGraphLaunch, cuGraphLaunch_ptsz, "cuGraphLaunch")     \
    X(BeginCapture, CUresult (*)(CUstream, CUstreamCaptureMode), cuStreamBeginCapture_v2,                       \
      cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture")                                                      \
    X(EndCapture, CUresult (*)(CUstream, CUgraph *), cuStreamEndCapture, cuStreamEndCapture_ptsz,               \
      "cuStreamEndCapture")                                                                                      \
    X(Instantiate, CUresult (*)(CUgraphExec *, CUgraph, unsigned long long), cuGraphInstantiateWithFlags,       \
      cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags")                                                \
    X(StreamSync, CUresult (*)(CUstream), cuStreamSynchronize, cuStreamSynchronize_ptsz, "cuStreamSynchronize") \
    X(StreamCreate, CUresult (*)(CUstream *, unsigned), cuStreamCreate, cuStreamCreate, "cuStreamCreate")      \
    X(MemMap, CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long),      \
      cuMemMap, cuMemMap, "cuMemMap")                                                                            \
    X(MemUnmap, CUresult (*)(CUdeviceptr, size_t), cuMemUnmap, cuMemUnmap, "cuMemUnmap")                        \
    X(AddrReserve, CUresult (*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long),                \
      cuMemAddressReserve, cuMemAddressReserve, "cuMemAddressReserve")                                           \
    X(PrimaryReset, CUresult (*)(CUdevice), cuDevicePrimaryCtxReset_v2, cuDevicePrimaryCtxReset_v2,             \
      "cuDevicePrimaryCtxReset")                                                                                 \
    X(Launch0, CUresult (*)(CUfunction), cuLaunch, cuLaunch, "cuLaunch")                                        \
    X(GetMemPool, CUresult (*)(CUmemoryPool *, CUdevice), cuDeviceGetMemPool, cuDeviceGetMemPool,               \
      "cuDeviceGetMemPool")                                                                                      \
    X(PoolSetAttr, CUresult (*)(CUmemoryPool, CUmemPool_attribute, void *), cuMemPoolSetAttribute,              \
      cuMemPoolSetAttribute, "cuMemPoolSetAttribute")                                                            \
    X(PoolTrim, CUresult (*)(CUmemoryPool, size_t), cuMemPoolTrimTo, cuMemPoolTrimTo, "cuMemPoolTrimTo")        \
    X(GraphMemTrim, CUresult (*)(CUdevice), cuDeviceGraphMemTrim, cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim") \
    X(LaunchGrid, CUresult (*)(CUfunction, int, int), cuLaunchGrid, cuLaunchGrid, "cuLaunchGrid")               \
    X(LaunchGridAsync, CUresult (*)(CUfunction, int, int, CUstream), cuLaunchGridAsync, cuLaunchGridAsync,      \
      "cuLaunchGridAsync")                                                                                       \
    X(LaunchMulti, CUresult (*)(CUDA_LAUNCH_PARAMS *, unsigned, unsigned), cuLaunchCooperativeKernelMultiDevice, \
      cuLaunchCooperativeKernelMultiDevice, "cuLaunchCooperativeKernelMultiDevice")                            \
    X(CopyHtoD, CUresult (*)(CUdeviceptr, const void *, size_t), cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds,          \
      "cuMemcpyHtoD")                                                                                            \
    X(CopyDtoH, CUresult (*)(void *, CUdeviceptr, size_t), cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, "cuMemcpyDtoH") \
    X(CopyAsync, CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream), cuMemcpyAsync, cuMemcpyAsync_ptsz,    \
      "cuMemcpyAsync")

static struct {
#define FIELD(f, t, plain, ptv, base) __typeof__(t) f;
    APIS(FIELD)
#undef FIELD
} api;

static int route_dlsym, route_dlvsym, route_gpa, per_thread, version = 12000;

/* ver=N applies to the functions under test; the rest (init, contexts, ...) are looked up as a CUDA 12 program */
static int versioned(const char *field)
{
    static const char *const under_test[] = {"CtxCreate", "Launch", "LaunchEx", "Coop", "GraphLaunch", "MemAlloc",
                                             "MemFree", "MemGetInfo", NULL};
    for (int i = 0; under_test[i]; i++)
        if (!strcmp(field, under_test[i]))
            return 1;
    return 0;
}

static void *resolve(const char *field, const char *plain, const char *ptv, const char *base, void *direct_plain,
                     void *direct_pt)
{
    static void *h;
    if (!route_dlsym && !route_gpa && !route_dlvsym)
        return per_thread ? direct_pt : direct_plain;
    if (h == NULL)
        h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h == NULL) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        exit(2);
    }
    if (route_dlsym)
        return dlsym(h, per_thread ? ptv : plain);
    if (route_dlvsym)
        return dlvsym(h, per_thread ? ptv : plain, "SIMCUDA_1.0");
    static CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    if (gpa == NULL)
        gpa = (__typeof__(gpa))dlsym(h, "cuGetProcAddress_v2");
    void *p = NULL;
    CUdriverProcAddressQueryResult st = 0;
    gpa(base, &p, versioned(field) ? version : 12000, per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0, &st);
    return p;
}

static uint64_t mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static uint64_t cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

enum kind { DEV, ASYNC, HANDLE, ARRAY, MIP, CTX, MAPPED };
struct held { enum kind k; uint64_t v, n; };
static struct held held[4096];
static int nheld;
static CUfunction kfn;
static CUcontext primary;
static CUcontext ctx;

static void hold(enum kind k, uint64_t v) { if (nheld < 4096) held[nheld++] = (struct held){k, v, 0}; }

static CUresult release(struct held h)
{
    switch (h.k) {
    case DEV: return api.MemFree(h.v);
    case ASYNC: return api.FreeAsync(h.v, NULL);
    case HANDLE: return api.MemRelease(h.v);
    case ARRAY: return api.ArrayDestroy((CUarray)(uintptr_t)h.v);
    case MIP: return api.MipDestroy((CUmipmappedArray)(uintptr_t)h.v);
    case CTX: return api.CtxDestroy((CUcontext)(uintptr_t)h.v);
    case MAPPED: return api.MemUnmap(h.v, h.n);
    }
    return -1;
}

static CUfunction named_fn(const char *prefix, uint64_t dur)
{
    char name[32];
    CUfunction f = NULL;
    snprintf(name, sizeof name, "%s:%llu", prefix, (unsigned long long)dur);
    api.GetFunction(&f, (void *)1, name);
    return f;
}

static CUresult launch(const char *how, uint64_t dur, CUstream s)
{
    void *params[] = {&dur};
    static CUfunction legacy_fn;
    static uint64_t legacy_dur;
    if (!strcmp(how, "legacy") || !strcmp(how, "grid") || !strcmp(how, "gridasync")) {
        if (legacy_fn == NULL || legacy_dur != dur) { /* these take no parameters: the duration is in the name */
            legacy_fn = named_fn("legacy", dur);
            legacy_dur = dur;
        }
        if (!strcmp(how, "legacy"))
            return api.Launch0(legacy_fn);
        if (!strcmp(how, "grid"))
            return api.LaunchGrid(legacy_fn, 1, 1);
        return api.LaunchGridAsync(legacy_fn, 1, 1, s);
    }
    if (!strcmp(how, "multidev")) {
        CUDA_LAUNCH_PARAMS l = {kfn, 1, 1, 1, 1, 1, 1, 0, s, params};
        return api.LaunchMulti(&l, 1, 0);
    }
    if (!strcmp(how, "launch"))
        return api.Launch(kfn, 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
    if (!strcmp(how, "coop"))
        return api.Coop(kfn, 1, 1, 1, 1, 1, 1, 0, s, params);
    CUlaunchConfig c = {1, 1, 1, 1, 1, 1, 0, s, NULL, 0};
    return api.LaunchEx(&c, kfn, params, NULL);
}

static void do_init(void)
{
    CUcontext c;
    CUresult rc = api.Init(0);
    CUresult rc2 = api.PrimaryRetain(&c, 0);
    if (rc2 == CUDA_SUCCESS) {
        api.SetCurrent(c);
        primary = c;
    }
    api.GetFunction(&kfn, (void *)1, "sleep_kernel");
    printf("init rc=%d retain=%d\n", rc, rc2);
}

static void run_ops(int argc, char **argv, int start);

static CUstream capstream;
static pthread_t capth;
static int capmode, capstate, capbegin_rc, capend_rc;
static void *capmain(void *arg)
{
    (void)arg;
    CUstream s;
    CUgraph g = NULL;
    api.SetCurrent(primary);
    api.StreamCreate(&s, 0);
    capbegin_rc = api.BeginCapture(s, (CUstreamCaptureMode)capmode);
    __atomic_store_n(&capstate, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&capstate, __ATOMIC_SEQ_CST) != 2)
        usleep(1000);
    capend_rc = api.EndCapture(s, &g);
    return NULL;
}

static void *launch_n(void *arg)
{
    unsigned long long n = *(unsigned long long *)arg;
    api.SetCurrent(primary);
    for (unsigned long long k = 0; k < n; k++)
        launch("launch", 1000, NULL);
    return NULL;
}

struct churn { unsigned long long n, size, held; int bad; };
static void *churn_main(void *arg)
{
    struct churn *c = arg;
    CUdeviceptr ring[8] = {0};
    api.SetCurrent(primary);
    for (unsigned long long k = 0; k < c->n; k++) {
        CUdeviceptr p = 0, *slot = &ring[k % 8];
        if (*slot != 0 && api.MemFree(*slot) != CUDA_SUCCESS)
            __atomic_fetch_add(&c->bad, 1, __ATOMIC_RELAXED);
        *slot = 0;
        if (api.MemAlloc(&p, c->size) == CUDA_SUCCESS)
            *slot = p;
        else
            __atomic_fetch_add(&c->bad, 1, __ATOMIC_RELAXED);
    }
    for (int i = 0; i < 8; i++) /* the last eight stay allocated */
        if (ring[i] != 0)
            __atomic_fetch_add(&c->held, c->size, __ATOMIC_RELAXED);
    return NULL;
}

struct tjob {
    unsigned long long ms, dur;
    unsigned long long launched;
};
static CUresult launch(const char *how, uint64_t dur, CUstream s);
static void *tmain(void *arg)
{
    struct tjob *j = arg;
    api.SetCurrent(primary); /* as the CUDA runtime does in every thread */
    uint64_t t0 = mono();
    while (mono() - t0 < j->ms * 1000000ull)
        if (launch("launch", j->dur, NULL) == CUDA_SUCCESS)
            __atomic_fetch_add(&j->launched, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* devices:N:MS:DUR  one thread per device k < N: device k's primary context current (as cudaSetDevice(k) in that
 * thread), a stream of its own, DUR-ns kernels back to back for MS ms: a program busy on all its GPUs at once */
struct djob {
    unsigned long long dev, ms, dur, launched, bad;
    uint64_t wall;
};
static void *dmain(void *arg)
{
    struct djob *j = arg;
    CUcontext c = NULL;
    CUstream s = NULL;
    if (api.PrimaryRetain(&c, (CUdevice)j->dev) != CUDA_SUCCESS || api.SetCurrent(c) != CUDA_SUCCESS ||
        api.StreamCreate(&s, 0) != CUDA_SUCCESS) {
        j->bad = 1;
        return NULL;
    }
    uint64_t t0 = mono();
    while (mono() - t0 < j->ms * 1000000ull) {
        if (launch("launch", j->dur, s) == CUDA_SUCCESS)
            j->launched++;
        else
            j->bad++;
    }
    api.StreamSync(s);
    j->wall = mono() - t0;
    return NULL;
}

static void run_op(const char *op, int argc, char **argv, int i)
{
    unsigned long long a = 0, b = 0, c = 0, d = 0, e6 = 0;
    CUresult rc;
    if (!strcmp(op, "init")) {
        do_init();
    } else if (!strcmp(op, "ctx")) {
        CUcontext x = NULL;
        if (!route_gpa || version < 11040)
            rc = ((CUresult(*)(CUcontext *, unsigned, CUdevice))api.CtxCreate)(&x, 0, 0);
        else if (version < 12050)
            rc = ((CUresult(*)(CUcontext *, void *, int, unsigned, CUdevice))api.CtxCreate)(&x, NULL, 0, 0, 0);
        else
            rc = ((CUresult(*)(CUcontext *, void *, unsigned, CUdevice))api.CtxCreate)(&x, NULL, 0, 0);
        if (rc == CUDA_SUCCESS)
            hold(CTX, (uintptr_t)x);
        ctx = x;
        printf("ctx rc=%d\n", rc);
    } else if (sscanf(op, "setdev:%llu", &a) == 1) {
        /* as cudaSetDevice(a): retain device a's primary context (once) and make it current */
        static CUcontext prim[16];
        rc = CUDA_SUCCESS;
        if (a < 16 && prim[a] == NULL)
            rc = api.PrimaryRetain(&prim[a], (CUdevice)a);
        if (rc == CUDA_SUCCESS && a < 16)
            rc = api.SetCurrent(prim[a]);
        if (rc == CUDA_SUCCESS && a < 16)
            primary = prim[a];
        printf("setdev %llu rc=%d\n", a, rc);
    } else if (sscanf(op, "alloc:%llu", &a) == 1) {
        CUdeviceptr p = 0;
        rc = api.MemAlloc(&p, a);
        if (rc == CUDA_SUCCESS)
            hold(DEV, p);
        printf("alloc %llu rc=%d ptr=0x%llx\n", a, rc, (unsigned long long)p);
    } else if (sscanf(op, "managed:%llu", &a) == 1) {
        CUdeviceptr p = 0;
        rc = api.Managed(&p, a, 1);
        if (rc == CUDA_SUCCESS)
            hold(DEV, p);
        printf("managed %llu rc=%d ptr=0x%llx\n", a, rc, (unsigned long long)p);
    } else if (sscanf(op, "async:%llu", &a) == 1) {
        CUdeviceptr p = 0;
        rc = api.AllocAsync(&p, a, NULL);
        if (rc == CUDA_SUCCESS)
            hold(ASYNC, p);
        printf("async %llu rc=%d ptr=0x%llx\n", a, rc, (unsigned long long)p);
    } else if (sscanf(op, "pool:%llu", &a) == 1) {
        CUdeviceptr p = 0;
        rc = api.AllocPool(&p, a, NULL, NULL);
        if (rc == CUDA_SUCCESS)
            hold(ASYNC, p);
        printf("pool %llu rc=%d ptr=0x%llx\n", a, rc, (unsigned long long)p);
    } else if (sscanf(op, "pitch:%llu:%llu", &a, &b) == 2) {
        CUdeviceptr p = 0;
        size_t pitch = 0;
        rc = api.Pitch(&p, &pitch, a, b, 4);
        if (rc == CUDA_SUCCESS)
            hold(DEV, p);
        printf("pitch %llux%llu rc=%d pitch=%zu\n", a, b, rc, pitch);
    } else if (sscanf(op, "vmm:%llu", &a) == 1) {
        CUmemGenericAllocationHandle h = 0;
        rc = api.MemCreate(&h, a, NULL, 0);
        if (rc == CUDA_SUCCESS)
            hold(HANDLE, h);
        printf("vmm %llu rc=%d\n", a, rc);
    } else if (sscanf(op, "vmmmap:%llu", &a) == 1) {
        /* the documented VMM idiom: create, reserve a range, map, release the handle (the mapping keeps it) */
        CUmemGenericAllocationHandle h = 0;
        CUdeviceptr va = 0;
        CUresult r1 = api.MemCreate(&h, a, NULL, 0), r2 = -1, r3 = -1, r4 = -1;
        if (r1 == CUDA_SUCCESS && (r2 = api.AddrReserve(&va, a, 0, 0, 0)) == CUDA_SUCCESS &&
            (r3 = api.MemMap(va, a, 0, h, 0)) == CUDA_SUCCESS && (r4 = api.MemRelease(h)) == CUDA_SUCCESS &&
            nheld < 4096)
            held[nheld++] = (struct held){MAPPED, va, a};
        printf("vmmmap %llu rc=%d map=%d release=%d\n", a, r1, r3, r4);
        (void)r2;
    } else if (sscanf(op, "poolthreshold:%llu", &a) == 1) {
        /* the current (default) pool keeps up to this many freed bytes */
        CUmemoryPool pl = NULL;
        cuuint64_t v = a;
        CUresult r1 = api.GetMemPool(&pl, 0);
        printf("poolthreshold rc=%d,%d\n", r1, r1 == CUDA_SUCCESS ? api.PoolSetAttr(pl, 4, &v) : -1);
    } else if (sscanf(op, "trim:%llu", &a) == 1) {
        CUmemoryPool pl = NULL;
        CUresult r1 = api.GetMemPool(&pl, 0);
        printf("trim rc=%d,%d\n", r1, r1 == CUDA_SUCCESS ? api.PoolTrim(pl, a) : -1);
    } else if (sscanf(op, "memgraph:%llu", &a) == 1) {
        /* a graph captured with an allocation in it (cudaMallocAsync in a captured region, kept): launched once */
        CUstream s;
        CUgraph g = NULL;
        CUgraphExec e = NULL;
        CUdeviceptr p = 0;
        api.StreamCreate(&s, 0);
        CUresult r1 = api.BeginCapture(s, 2);
        CUresult r2 = api.AllocAsync(&p, a, s);
        CUresult r3 = api.EndCapture(s, &g);
        CUresult r4 = api.Instantiate(&e, g, 0);
        CUresult r5 = api.GraphLaunch(e, NULL);
        CUresult r6 = api.GraphLaunch(e, NULL);
        printf("memgraph %llu rc=%d,%d,%d,%d launch=%d again=%d\n", a, r1, r2, r3, r4, r5, r6);
    } else if (!strcmp(op, "graphtrim")) {
        printf("graphtrim rc=%d\n", api.GraphMemTrim(0));
    } else if (!strcmp(op, "reset")) {
        rc = api.PrimaryReset(0);
        CUcontext c = NULL;
        CUresult r2 = api.PrimaryRetain(&c, 0); /* as the runtime does on its next call */
        if (r2 == CUDA_SUCCESS)
            api.SetCurrent(c);
        nheld = 0; /* everything allocated in the primary context died with it */
        printf("reset rc=%d retain=%d\n", rc, r2);
    } else if (!strcmp(op, "ctxdestroy")) {
        rc = api.CtxDestroy(ctx);
        api.SetCurrent(primary);
        nheld = 0;
        printf("ctxdestroy rc=%d\n", rc);
    } else if (sscanf(op, "churn:%llu:%llu:%llu", &c, &a, &b) == 3) {
        /* churn:T:N:SIZE  T threads each allocate SIZE bytes N times at once, freeing their allocation of eight
         * rounds before; the last eight of each stay allocated (held= their bytes) */
        pthread_t th[64];
        struct churn job = {a, b, 0, 0};
        for (unsigned long long k = 0; k < c && k < 64; k++)
            pthread_create(&th[k], NULL, churn_main, &job);
        for (unsigned long long k = 0; k < c && k < 64; k++)
            pthread_join(th[k], NULL);
        printf("churn held=%llu bad=%d\n", job.held, job.bad);
    } else if (sscanf(op, "array:%llu:%llu", &a, &b) == 2) {
        CUDA_ARRAY_DESCRIPTOR d = {a, b, 0x20, 4};
        CUarray x = NULL;
        rc = api.ArrayCreate(&x, &d);
        if (rc == CUDA_SUCCESS)
            hold(ARRAY, (uintptr_t)x);
        printf("array %llux%llu rc=%d\n", a, b, rc);
    } else if (sscanf(op, "array3d:%llu:%llu:%llu", &a, &b, &c) == 3) {
        CUDA_ARRAY3D_DESCRIPTOR d = {a, b, c, 0x20, 4, 0};
        CUarray x = NULL;
        rc = api.Array3DCreate(&x, &d);
        if (rc == CUDA_SUCCESS)
            hold(ARRAY, (uintptr_t)x);
        printf("array3d %llux%llux%llu rc=%d\n", a, b, c, rc);
    } else if (sscanf(op, "mipmap:%llu:%llu:%llu", &a, &b, &c) == 3) {
        CUDA_ARRAY3D_DESCRIPTOR d = {a, b, 0, 0x20, 4, 0};
        CUmipmappedArray x = NULL;
        rc = api.MipCreate(&x, &d, (unsigned)c);
        if (rc == CUDA_SUCCESS)
            hold(MIP, (uintptr_t)x);
        printf("mipmap %llux%llu/%llu rc=%d\n", a, b, c, rc);
    } else if (!strcmp(op, "free")) {
        rc = nheld ? release(held[--nheld]) : -1;
        printf("free rc=%d\n", rc);
    } else if (!strcmp(op, "freeall")) {
        int bad = 0;
        while (nheld)
            bad += release(held[--nheld]) != CUDA_SUCCESS;
        printf("freeall bad=%d\n", bad);
    } else if (!strcmp(op, "info")) {
        size_t f = 0, t = 0;
        rc = api.MemGetInfo(&f, &t);
        printf("info rc=%d free=%zu total=%zu\n", rc, f, t);
    } else if (!strcmp(op, "totalmem")) {
        size_t t = 0;
        rc = api.TotalMem(&t, 0);
        printf("totalmem rc=%d total=%zu\n", rc, t);
    } else if (!strcmp(op, "nvml")) {
        void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        nvmlReturn_t (*v1)(nvmlDevice_t, nvmlMemory_t *) = h ? dlsym(h, "nvmlDeviceGetMemoryInfo") : NULL;
        nvmlReturn_t (*v2)(nvmlDevice_t, nvmlMemory_v2_t *) = h ? dlsym(h, "nvmlDeviceGetMemoryInfo_v2") : NULL;
        nvmlMemory_t m1 = {0};
        nvmlMemory_v2_t m2 = {0};
        int r1 = v1 ? v1((nvmlDevice_t)0x10, &m1) : -1, r2 = v2 ? v2((nvmlDevice_t)0x10, &m2) : -1;
        printf("nvml rc=%d total=%llu free=%llu used=%llu v2rc=%d total=%llu free=%llu used=%llu\n", r1, m1.total,
               m1.free, m1.used, r2, m2.total, m2.free, m2.used);
    } else if (sscanf(op, "launch:%llu:%llu", &a, &b) == 2 || sscanf(op, "launchex:%llu:%llu", &a, &b) == 2 ||
               sscanf(op, "coop:%llu:%llu", &a, &b) == 2) {
        char how[16];
        sscanf(op, "%15[a-z]", how);
        int bad = 0;
        for (unsigned long long k = 0; k < a; k++)
            bad += launch(how, b, NULL) != CUDA_SUCCESS;
        printf("%s %llu bad=%d\n", how, a, bad);
    } else if (sscanf(op, "graph:%llu:%llu", &a, &b) == 2) {
        CUstream s;
        CUgraph g = NULL;
        CUgraphExec e = NULL;
        api.StreamCreate(&s, 0);
        CUresult r1 = api.BeginCapture(s, 0);
        CUresult r2 = launch("launch", b, s);
        CUresult r3 = api.EndCapture(s, &g);
        CUresult r4 = api.Instantiate(&e, g, 0);
        int bad = 0;
        for (unsigned long long k = 0; k < a; k++)
            bad += api.GraphLaunch(e, NULL) != CUDA_SUCCESS;
        printf("graph %llu rc=%d,%d,%d,%d bad=%d\n", a, r1, r2, r3, r4, bad);
    } else if (!strcmp(op, "sync")) {
        printf("sync rc=%d\n", api.StreamSync(NULL));
    } else if (sscanf(op, "run:%llu:%llu", &a, &b) == 2) {
        /* run:MS:DUR[:kind] launches kernels of DUR ns back to back for MS ms of wall time, then waits for the
         * GPU. kind: launch (default), launchex, coop, graph (a captured one-kernel graph, launched repeatedly) */
        char how[16] = "launch";
        sscanf(op, "run:%*u:%*u:%15[a-z]", how);
        CUgraphExec e = NULL;
        if (!strcmp(how, "graph")) {
            CUstream s;
            CUgraph g = NULL;
            api.StreamCreate(&s, 0);
            api.BeginCapture(s, 0);
            launch("launch", b, s);
            api.EndCapture(s, &g);
            api.Instantiate(&e, g, 0);
        }
        uint64_t t0 = mono(), c0 = cpu(), n = 0, bad = 0;
        while (mono() - t0 < a * 1000000ull) {
            bad += (e ? api.GraphLaunch(e, NULL) : launch(how, b, NULL)) != CUDA_SUCCESS;
            n++;
        }
        api.StreamSync(NULL);
        uint64_t wall = mono() - t0, used = cpu() - c0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=%llu\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)(n * b), (unsigned long long)wall,
               (unsigned long long)used);
    } else if (sscanf(op, "jitter:%llu:%llu:%llu", &a, &b, &c) == 3 && c < 100) {
        /* jitter:MS:DUR:PCT launches one kernel back to back for MS ms of wall time, each launch DUR ns longer or
         * shorter by PCT % at random (a fixed seed): a kernel whose own time varies, as real ones do. */
        uint64_t t0 = mono(), c0 = cpu(), n = 0, bad = 0, sum = 0, x = 0x9e3779b97f4a7c15ull;
        while (mono() - t0 < a * 1000000ull) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            uint64_t dur = b * (x & 1 ? 100 + c : 100 - c) / 100;
            bad += launch("launch", dur, NULL) != CUDA_SUCCESS;
            sum += dur;
            n++;
        }
        api.StreamSync(NULL);
        uint64_t wall = mono() - t0, used = cpu() - c0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=%llu\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)sum, (unsigned long long)wall,
               (unsigned long long)used);
    } else if (sscanf(op, "loop:%llu:%llu:%llu:%llu", &a, &b, &c, &d) == 4) {
        /* loop:MS:DUR:SYNC:HOST  DUR-ns kernels for MS ms of wall time; every SYNC-th launch waits for the GPU (0:
         * never), and HOST ns of host work (a spin) come before each launch: a loop that synchronizes, a
         * launch-bound one (small kernels, host time between them). "steps_at" lists when every LOOP_MARK-th
         * launch call returned (monotonic ns), so the pace inside a window can be told from the pace outside it. */
        enum { LOOP_MARK = 50 };
        uint64_t t0 = mono(), n = 0, bad = 0, nmarks = 0, cap = 1u << 20;
        uint64_t *marks = malloc(cap * sizeof *marks);
        while (mono() - t0 < a * 1000000ull) {
            for (uint64_t h = mono(); d && mono() - h < d;) {
            }
            bad += launch("launch", b, NULL) != CUDA_SUCCESS;
            n++;
            if (marks != NULL && n % LOOP_MARK == 0 && nmarks < cap)
                marks[nmarks++] = mono();
            if (c && n % c == 0)
                api.StreamSync(NULL);
        }
        api.StreamSync(NULL);
        uint64_t wall = mono() - t0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=0\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)(n * b), (unsigned long long)wall);
        printf("steps_at");
        for (uint64_t i = 0; i < nmarks; i++)
            printf(" %llu", (unsigned long long)marks[i]);
        printf("\n");
        free(marks);
    } else if (sscanf(op, "hsteps:%llu:%llu:%llu:%llu", &a, &b, &c, &d) == 4) {
        /* hsteps:MS:K:DUR:THINK  a host-bound training step: before each of its K distinct kernels of DUR ns the
         * host works THINK ns (Python, autograd: a spin), then it waits for the GPU (loss.item()), for MS ms. Each
         * step's end time is kept so the pace inside a window can be told from the pace outside it:
         * "steps_at" lists them (ns since the op began) after the run line. */
        CUfunction fns[256];
        char prefix[16];
        for (unsigned long long k = 0; k < b && k < 256; k++) {
            snprintf(prefix, sizeof prefix, "hstep%llu", k);
            fns[k] = named_fn(prefix, c);
        }
        uint64_t t0 = mono(), n = 0, steps = 0, bad = 0, cap = 1u << 20;
        uint64_t *ends = malloc(cap * sizeof *ends);
        while (mono() - t0 < a * 1000000ull) {
            for (unsigned long long k = 0; k < b && k < 256; k++, n++) {
                for (uint64_t until = mono() + d; mono() < until;) {
                }
                bad += api.Launch(fns[k], 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS;
            }
            api.StreamSync(NULL);
            if (ends != NULL && steps < cap)
                ends[steps] = mono() - t0;
            steps++;
        }
        uint64_t wall = mono() - t0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=0 steps=%llu\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)(n * c), (unsigned long long)wall,
               (unsigned long long)steps);
        printf("steps_at");
        for (uint64_t i = 0; ends != NULL && i < steps && i < cap; i++)
            printf(" %llu", (unsigned long long)(ends[i] + t0));
        printf("\n");
        free(ends);
    } else if (sscanf(op, "steps:%llu:%llu:%llu", &a, &b, &c) == 3) {
        /* steps:MS:K:DUR  a training-like step: K distinct kernels of DUR ns each (functions of their own, so each
         * has its own estimate), then a wait for the GPU (loss.item()), for MS ms; "steps" counts the steps */
        CUfunction fns[256];
        char prefix[16];
        for (unsigned long long k = 0; k < b && k < 256; k++) {
            snprintf(prefix, sizeof prefix, "step%llu", k);
            fns[k] = named_fn(prefix, c);
        }
        uint64_t t0 = mono(), n = 0, steps = 0, bad = 0;
        while (mono() - t0 < a * 1000000ull) {
            for (unsigned long long k = 0; k < b && k < 256; k++, n++)
                bad += api.Launch(fns[k], 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS;
            api.StreamSync(NULL);
            steps++;
        }
        uint64_t wall = mono() - t0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=0 steps=%llu\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)(n * c), (unsigned long long)wall,
               (unsigned long long)steps);
    } else if (sscanf(op, "requests:%llu:%llu:%llu:%llu:%llu", &a, &b, &c, &d, &e6) == 5) {
        /* requests:MS:RATE:K:DUR:THINK  an inference service: requests arrive at RATE per second (Poisson, seeded:
         * each 10 us an arrival with probability RATE x 10 us) for MS ms; each is K kernels of DUR ns, THINK ns of
         * host work before each, then a wait for its result (a stream sync; requests:...:copy a synchronous copy
         * of its result to the host). A request that arrives while the last one runs queues. Prints each
         * request's latency from its arrival to its result (an open-loop client's view). */
        int by_copy = strstr(op, ":copy") != NULL;
        char result[64];
        uint64_t slots = a * 100, n_arr = 0, cap = 1u << 16, x = 0x9E3779B97F4A7C15ull;
        uint64_t *arr = malloc(cap * sizeof *arr), *lat = malloc(cap * sizeof *lat);
        uint64_t p = b * 10000ull; /* per 10 us slot, in 1e-9 */
        for (uint64_t k = 0; arr != NULL && lat != NULL && k < slots && n_arr < cap; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            if (x % 1000000000ull < p)
                arr[n_arr++] = k * 10000ull;
        }
        CUfunction fn = named_fn("request", d);
        uint64_t t0 = mono(), bad = 0, n = 0;
        for (uint64_t i = 0; lat != NULL && i < n_arr; i++) {
            uint64_t at = t0 + arr[i];
            while (mono() + 300000ull < at) {
                struct timespec ts = {0, 200000};
                nanosleep(&ts, NULL);
            }
            while (mono() < at) {
            }
            for (unsigned long long k = 0; k < c; k++, n++) {
                for (uint64_t until = mono() + e6; mono() < until;) {
                }
                bad += api.Launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS;
            }
            if (by_copy)
                bad += api.CopyDtoH(result, 0x1000, sizeof result) != CUDA_SUCCESS;
            else
                api.StreamSync(NULL);
            lat[i] = mono() - at;
        }
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=0 requests=%llu\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)(n * d), (unsigned long long)(mono() - t0),
               (unsigned long long)n_arr);
        printf("latencies");
        for (uint64_t i = 0; lat != NULL && i < n_arr; i++)
            printf(" %llu", (unsigned long long)lat[i]);
        printf("\n");
        free(arr);
        free(lat);
    } else if (sscanf(op, "syncs:%llu", &a) == 1) {
        /* syncs:MS  one request (a 1 ms kernel, its result waited for), 10 ms of nothing, then stream syncs with
         * nothing queued, one every 100 us for MS ms (an idle service polling) */
        CUfunction fn = named_fn("request", 1000000);
        uint64_t bad = api.Launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS;
        api.StreamSync(NULL);
        struct timespec quiet = {0, 10000000};
        nanosleep(&quiet, NULL);
        uint64_t t0 = mono(), n = 0;
        for (; mono() - t0 < a * 1000000ull; n++) {
            api.StreamSync(NULL);
            struct timespec ts = {0, 100000};
            nanosleep(&ts, NULL);
        }
        printf("run syncs=%llu bad=%llu wall_ns=%llu\n", (unsigned long long)n, (unsigned long long)bad,
               (unsigned long long)(mono() - t0));
    } else if (sscanf(op, "gaps:%llu:%llu:%llu", &a, &b, &c) == 3) {
        /* gaps:MS:DUR:SLEEP  a DUR-ns kernel, wait for it, sleep SLEEP ns, for MS ms: a job that leaves the GPU idle
         * part of the time (an inference server between requests, a training loop waiting for data) */
        uint64_t t0 = mono(), n = 0, bad = 0;
        while (mono() - t0 < a * 1000000ull) {
            bad += launch("launch", b, NULL) != CUDA_SUCCESS;
            n++;
            api.StreamSync(NULL);
            struct timespec ts = {(time_t)(c / 1000000000ull), (long)(c % 1000000000ull)};
            nanosleep(&ts, NULL);
        }
        uint64_t wall = mono() - t0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=0\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)(n * b), (unsigned long long)wall);
    } else if (sscanf(op, "devices:%llu:%llu:%llu", &c, &a, &b) == 3) {
        pthread_t th[16];
        struct djob jobs[16];
        for (unsigned long long k = 0; k < c && k < 16; k++) {
            jobs[k] = (struct djob){k, a, b, 0, 0, 0};
            pthread_create(&th[k], NULL, dmain, &jobs[k]);
        }
        for (unsigned long long k = 0; k < c && k < 16; k++) {
            pthread_join(th[k], NULL);
            printf("device dev=%llu launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu\n", k, jobs[k].launched,
                   jobs[k].bad, jobs[k].launched * b, (unsigned long long)jobs[k].wall);
        }
    } else if (sscanf(op, "threads:%llu:%llu:%llu", &c, &a, &b) == 3) {
        /* threads:N:MS:DUR  N threads launch DUR-ns kernels on the one legacy stream for MS ms */
        pthread_t th[64];
        struct tjob job = {a, b, 0};
        uint64_t t0 = mono();
        for (unsigned long long k = 0; k < c && k < 64; k++)
            pthread_create(&th[k], NULL, tmain, &job);
        for (unsigned long long k = 0; k < c && k < 64; k++)
            pthread_join(th[k], NULL);
        api.StreamSync(NULL);
        uint64_t wall = mono() - t0, n = __atomic_load_n(&job.launched, __ATOMIC_RELAXED);
        printf("threads launches=%llu gpu_ns=%llu wall_ns=%llu\n", (unsigned long long)n,
               (unsigned long long)(n * b), (unsigned long long)wall);
    } else if (sscanf(op, "burst:%llu:%llu", &a, &b) == 2) {
        /* a launches of b ns as fast as they go, then wait for the GPU: how long until the work is done */
        uint64_t t0 = mono(), bad = 0;
        for (unsigned long long k = 0; k < a; k++)
            bad += launch("launch", b, NULL) != CUDA_SUCCESS;
        uint64_t enq = mono() - t0;
        api.StreamSync(NULL);
        printf("burst launches=%llu bad=%llu gpu_ns=%llu enqueue_ns=%llu wall_ns=%llu\n", a, (unsigned long long)bad,
               a * b, (unsigned long long)enq, (unsigned long long)(mono() - t0));
    } else if (sscanf(op, "distinct:%llu:%llu:%llu", &a, &c, &b) == 3) {
        /* distinct:MS:N:DUR  N distinct kernels of DUR ns, round robin, for MS ms of wall time */
        CUfunction *fs = calloc(c ? c : 1, sizeof *fs);
        for (unsigned long long k = 0; k < c; k++) {
            char name[32];
            snprintf(name, sizeof name, "d%llu:%llu", k, b);
            api.GetFunction(&fs[k], (void *)1, name);
        }
        uint64_t t0 = mono(), n = 0, bad = 0;
        while (mono() - t0 < a * 1000000ull) {
            bad += api.Launch(fs[n % c], 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS;
            n++;
        }
        api.StreamSync(NULL);
        uint64_t wall = mono() - t0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=0\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)(n * b), (unsigned long long)wall);
    } else if (sscanf(op, "warm:%llu", &a) == 1) {
        /* warm:N  launch N distinct 1 us kernels once each (a program that has seen many kernels) */
        int bad = 0;
        for (unsigned long long k = 0; k < a; k++) {
            char name[32];
            CUfunction f = NULL;
            snprintf(name, sizeof name, "w%llu:1000", k);
            api.GetFunction(&f, (void *)1, name);
            bad += api.Launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS;
        }
        api.StreamSync(NULL);
        printf("warm %llu bad=%d\n", a, bad);
    } else if (sscanf(op, "fresh:%llu:%llu", &a, &b) == 2) {
        /* fresh:MS:DUR  a never-seen kernel of DUR ns at every launch, for MS ms */
        uint64_t t0 = mono(), n = 0, bad = 0;
        while (mono() - t0 < a * 1000000ull) {
            char name[32];
            CUfunction f = NULL;
            snprintf(name, sizeof name, "f%llu:%llu", (unsigned long long)n, b);
            api.GetFunction(&f, (void *)1, name);
            bad += api.Launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS;
            n++;
        }
        api.StreamSync(NULL);
        uint64_t wall = mono() - t0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=0\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)(n * b), (unsigned long long)wall);
    } else if (sscanf(op, "mix:%llu:%llu:%llu:%llu", &a, &b, &c, &d) == 4) {
        /* mix:MS:DUR:WAVES:EVERY  one kernel, DUR ns per wave: every EVERY-th launch has a WAVES-wave grid
         * (128 blocks a wave), the others one wave; for MS ms. The big launch comes first. */
        CUfunction f = named_fn("mix", b);
        uint64_t t0 = mono(), n = 0, bad = 0, gpu = 0;
        while (mono() - t0 < a * 1000000ull) {
            unsigned waves = n % d == 0 ? (unsigned)c : 1;
            bad += api.Launch(f, 128 * waves, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS;
            gpu += b * waves;
            n++;
        }
        api.StreamSync(NULL);
        uint64_t wall = mono() - t0;
        printf("run launches=%llu bad=%llu gpu_ns=%llu wall_ns=%llu cpu_ns=0\n", (unsigned long long)n,
               (unsigned long long)bad, (unsigned long long)gpu, (unsigned long long)wall);
    } else if (sscanf(op, "capbegin:%llu", &a) == 1) {
        /* capbegin:MODE  begin capturing a new stream in this thread (0 global, 1 thread-local, 2 relaxed) */
        api.StreamCreate(&capstream, 0);
        printf("capbegin rc=%d\n", api.BeginCapture(capstream, (CUstreamCaptureMode)a));
    } else if (!strcmp(op, "capend")) {
        CUgraph g = NULL;
        printf("capend rc=%d\n", api.EndCapture(capstream, &g));
    } else if (sscanf(op, "capthread:%llu", &a) == 1) {
        /* capthread:MODE  another thread begins a capture and keeps it open until capjoin */
        capmode = (int)a;
        __atomic_store_n(&capstate, 0, __ATOMIC_SEQ_CST);
        pthread_create(&capth, NULL, capmain, NULL);
        while (__atomic_load_n(&capstate, __ATOMIC_SEQ_CST) == 0)
            usleep(100);
        printf("capthread rc=%d\n", capbegin_rc);
    } else if (!strcmp(op, "capjoin")) {
        __atomic_store_n(&capstate, 2, __ATOMIC_SEQ_CST);
        pthread_join(capth, NULL);
        printf("capjoin rc=%d\n", capend_rc);
    } else if (sscanf(op, "spawnthreads:%llu:%llu", &a, &b) == 2) {
        /* spawnthreads:N:L  N threads, eight at a time, each makes L launches of 1 us and exits */
        unsigned long long done = 0;
        while (done < a) {
            pthread_t th[8];
            unsigned k = 0;
            for (; k < 8 && done < a; k++, done++)
                pthread_create(&th[k], NULL, launch_n, &b);
            for (unsigned q = 0; q < k; q++)
                pthread_join(th[q], NULL);
        }
        api.StreamSync(NULL);
        printf("spawnthreads %llu\n", a);
    } else if (!strcmp(op, "nvmlprocs")) {
        void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; } pinfo;
        nvmlReturn_t (*procs)(nvmlDevice_t, unsigned *, pinfo *) =
            h ? dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v3") : NULL;
        typedef struct { unsigned pid; unsigned long long ts; unsigned sm, mem, enc, dec; } usample;
        nvmlReturn_t (*util)(nvmlDevice_t, usample *, unsigned *, unsigned long long) =
            h ? dlsym(h, "nvmlDeviceGetProcessUtilization") : NULL;
        pinfo p[16];
        usample u[16];
        unsigned n = 16, m = 16;
        int r1 = procs ? procs((nvmlDevice_t)0x10, &n, p) : -1, r2 = util ? util((nvmlDevice_t)0x10, u, &m, 0) : -1;
        unsigned need = 0, small = 1;
        pinfo one[1];
        int rq = procs ? procs((nvmlDevice_t)0x10, &need, NULL) : -1;
        int rs = procs ? procs((nvmlDevice_t)0x10, &small, one) : -1;
        printf("nvmlprocs rq=%d need=%u rs=%d small=%u rc=%d n=%u pids=", rq, need, rs, small, r1, r1 == 0 ? n : 0);
        for (unsigned k = 0; r1 == 0 && k < n; k++)
            printf("%s%u", k ? "," : "", p[k].pid);
        printf(" urc=%d un=%u upids=", r2, r2 == 0 ? m : 0);
        for (unsigned k = 0; r2 == 0 && k < m; k++)
            printf("%s%u", k ? "," : "", u[k].pid);
        printf("\n");
    } else if (sscanf(op, "copy:%llu:%llu", &a, &b) == 2) {
        /* copy:MS:BYTES copies BYTES host->device (synchronously) back to back for MS ms; prints copies and bytes */
        unsigned long long n = 0;
        char host[1];
        uint64_t t0 = mono();
        while (mono() - t0 < a * 1000000ull)
            if (api.CopyHtoD(0x1000, host, (size_t)b) == CUDA_SUCCESS)
                n++;
        printf("copy copies=%llu bytes=%llu\n", n, n * b);
    } else if (sscanf(op, "copyasync:%llu", &a) == 1) {
        rc = api.CopyAsync(0x1000, 0x2000, (size_t)a, NULL);
        printf("copyasync rc=%d\n", rc);
    } else if (sscanf(op, "sleep:%llu", &a) == 1) {
        usleep((useconds_t)(a * 1000));
    } else if (!strcmp(op, "hold")) {
        printf("holding\n");
        fflush(stdout);
        char line[16];
        if (fgets(line, sizeof line, stdin) == NULL) {
        }
    } else if (!strcmp(op, "fork") || !strcmp(op, "spawn")) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            if (!strcmp(op, "spawn")) {
                char **args = calloc((size_t)argc + 2, sizeof *args);
                int n = 0;
                args[n++] = argv[0];
                args[n++] = argv[1]; /* the route */
                for (int k = i + 1; k < argc; k++)
                    args[n++] = argv[k];
                execv("/proc/self/exe", args);
                _exit(127);
            }
            run_ops(argc, argv, i + 1);
            fflush(stdout);
            _exit(0);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        printf("%s child=%d status=%d\n", op, pid, st);
        fflush(stdout);
        exit(0);
    } else if (!strcmp(op, "hooks")) {
        int (*count)(void) = dlsym(RTLD_DEFAULT, "alnair_hook_count");
        const char *(*name)(int) = dlsym(RTLD_DEFAULT, "alnair_hook_name");
        void *(*real)(int) = dlsym(RTLD_DEFAULT, "alnair_hook_real");
        void *(*addr)(int) = dlsym(RTLD_DEFAULT, "alnair_hook_address");
        void *h = dlopen("libcuda.so.1", RTLD_NOW), *hn = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        for (int k = 0; count && k < count(); k++) {
            void *lib = strncmp(name(k), "nvml", 4) == 0 ? hn : h;
            void *viadl = lib ? dlsym(lib, name(k)) : NULL; /* the wrapped dlsym: our hook, or real when unlimited */
            printf("hook %s real=%d exported=%d dlsym_is_hook=%d\n", name(k), real(k) != NULL,
                   dlsym(RTLD_DEFAULT, name(k)) == addr(k), viadl == addr(k));
        }
    } else if (!strcmp(op, "nextprobe")) {
        const char *(*probe)(void) = (const char *(*)(void))dlsym(RTLD_DEFAULT, "next_probe");
        printf("nextprobe %s\n", probe ? probe() : "missing");
    } else if (!strcmp(op, "pid")) {
        printf("pid %d\n", getpid());
    } else {
        printf("unknown %s\n", op);
    }
    fflush(stdout);
}

static void run_ops(int argc, char **argv, int start)
{
    for (int i = start; i < argc; i++) {
        run_op(argv[i], argc, argv, i);
    }
}

int main(int argc, char **argv)
{
    int i = 1;
    for (; i < argc && strchr(argv[i], '='); i++) {
        if (!strcmp(argv[i], "route=dlsym"))
            route_dlsym = 1;
        else if (!strcmp(argv[i], "route=dlvsym"))
            route_dlvsym = 1;
        else if (!strcmp(argv[i], "route=gpa"))
            route_gpa = 1;
        else if (!strcmp(argv[i], "pt=1"))
            per_thread = 1;
        else if (!strncmp(argv[i], "ver=", 4))
            version = atoi(argv[i] + 4);
    }
#define RESOLVE(f, t, plain, ptv, base) api.f = (t)resolve(#f, #plain, #ptv, base, (void *)&plain, (void *)&ptv);
    APIS(RESOLVE)
#undef RESOLVE
    setvbuf(stdout, NULL, _IOLBF, 0);
    run_ops(argc, argv, i);
    return 0;
}
