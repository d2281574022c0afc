/* The hook table and the three routes to the driver: exported names, a wrapped dlsym, and cuGetProcAddress.
 *
 * One table (hooks.def) gives, for every hooked function, its exported name, its slot in the real-function table
 * and the (base name, cudaVersion range, per-thread flag) that cuGetProcAddress maps to it. The exported names
 * are the hook functions themselves (-fvisibility=hidden elsewhere); `nm -D --defined-only` must list exactly the
 * table plus dlsym and the alnair_* introspection functions, which the tests check. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "hook_protos.h"

struct hook_row {
    const char *name;
    const char *base;
    int lib;
    int vmin, vmax, per_thread;
    void *hook;
};

static const struct hook_row rows[H_COUNT] = {
#define ALNAIR_HOOK(n, lib, base, vmin, vmax, pt) [H_##n] = {#n, base, ALNAIR_LIB_##lib, vmin, vmax, pt, (void *)&n},
#include "hooks.def"
#undef ALNAIR_HOOK
};

void *_Atomic alnair_real_fn[H_COUNT];
struct alnair_aux alnair_aux;

/* ---- the real dlsym -------------------------------------------------------------------------------------- */
typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn _Atomic real_dlsym_p;

static dlsym_fn get_real_dlsym(void)
{
    dlsym_fn f = atomic_load_explicit(&real_dlsym_p, memory_order_acquire);
    if (LIKELY(f != NULL))
        return f;
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && f == NULL; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store_explicit(&real_dlsym_p, f, memory_order_release);
    return f;
}

void *alnair_real_dlsym(void *handle, const char *name)
{
    dlsym_fn f = get_real_dlsym();
    return f ? f(handle, name) : NULL;
}

static int hook_by_name(const char *name)
{
    if (name == NULL || !((name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v')))
        return -1;
    for (int i = 0; i < H_COUNT; i++)
        if (strcmp(rows[i].name, name) == 0)
            return i;
    return -1;
}

/* ---- resolving the real functions ------------------------------------------------------------------------ */
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;

static void *open_lib(const char *soname)
{
    void *h = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
    return h ? h : dlopen(soname, RTLD_LAZY);
}

static void fill_real(void *h, int lib)
{
    for (int i = 0; i < H_COUNT; i++) {
        if (rows[i].lib != lib)
            continue;
        void *p = alnair_real_dlsym(h, rows[i].name);
        void *expected = NULL;
        if (p != NULL && p != rows[i].hook)
            atomic_compare_exchange_strong(&alnair_real_fn[i], &expected, p);
    }
}

static void cuda_resolve_once(void)
{
    alnair_init();
    void *h = open_lib("libcuda.so.1");
    if (h == NULL)
        return;
    fill_real(h, ALNAIR_LIB_CU);
#define AUX(field, name) alnair_aux.field = (__typeof__(alnair_aux.field))alnair_real_dlsym(h, name)
    AUX(cuEventCreate, "cuEventCreate");
    AUX(cuEventRecord, "cuEventRecord");
    AUX(cuEventRecord_ptsz, "cuEventRecord_ptsz");
    AUX(cuEventQuery, "cuEventQuery");
    AUX(cuEventElapsedTime, "cuEventElapsedTime_v2");
    if (alnair_aux.cuEventElapsedTime == NULL)
        AUX(cuEventElapsedTime, "cuEventElapsedTime");
    AUX(cuEventDestroy, "cuEventDestroy_v2");
    AUX(cuStreamIsCapturing, "cuStreamIsCapturing");
    AUX(cuStreamIsCapturing_ptsz, "cuStreamIsCapturing_ptsz");
    AUX(cuCtxGetCurrent, "cuCtxGetCurrent");
#undef AUX
    if (alnair_aux.cuEventRecord_ptsz == NULL)
        alnair_aux.cuEventRecord_ptsz = alnair_aux.cuEventRecord;
    if (alnair_aux.cuStreamIsCapturing_ptsz == NULL)
        alnair_aux.cuStreamIsCapturing_ptsz = alnair_aux.cuStreamIsCapturing;
}

static void nvml_resolve_once(void)
{
    alnair_init();
    void *h = open_lib("libnvidia-ml.so.1");
    if (h != NULL)
        fill_real(h, ALNAIR_LIB_NVML);
}

void alnair_cuda_resolve(void)
{
    pthread_once(&cuda_once, cuda_resolve_once);
}

void *alnair_real_slow(int id)
{
    if (id < 0 || id >= H_COUNT)
        return NULL;
    pthread_once(rows[id].lib == ALNAIR_LIB_CU ? &cuda_once : &nvml_once,
                 rows[id].lib == ALNAIR_LIB_CU ? cuda_resolve_once : nvml_resolve_once);
    return atomic_load_explicit(&alnair_real_fn[id], memory_order_acquire);
}

/* ---- route 2: dlsym -------------------------------------------------------------------------------------- */
static __attribute__((noinline)) void *dlsym_hooked(dlsym_fn real, void *handle, const char *name, int id)
{
    alnair_init();
    if (handle == RTLD_NEXT) {
        /* The next definition after the caller: ours is the one to give (we are preloaded). */
        return alnair_real(id) ? rows[id].hook : NULL;
    }
    void *p = real(handle, name);
    if (p == NULL || alnair_region == NULL)
        return p; /* missing stays missing; with no limits at all the caller gets the real function */
    if (alnair_real(id) == NULL) {
        void *expected = NULL;
        if (p != rows[id].hook)
            atomic_compare_exchange_strong(&alnair_real_fn[id], &expected, p);
    }
    return rows[id].hook;
}

ALNAIR_API void *dlsym(void *handle, const char *name)
{
    dlsym_fn real = get_real_dlsym();
    int id = hook_by_name(name);
    if (LIKELY(id < 0))
        return real(handle, name); /* a tail call: RTLD_NEXT stays relative to the original caller */
    return dlsym_hooked(real, handle, name, id);
}

/* ---- route 3: cuGetProcAddress --------------------------------------------------------------------------- */
static int search_base(const char *symbol, int version, int pt)
{
    for (int i = 0; i < H_COUNT; i++) {
        const struct hook_row *r = &rows[i];
        if (r->lib != ALNAIR_LIB_CU || r->per_thread != pt || strcmp(r->base, symbol) != 0)
            continue;
        if (version >= r->vmin && (r->vmax == 0 || version < r->vmax))
            return i;
    }
    return -1;
}

/* The variant cuGetProcAddress(symbol, version, flags) stands for: the per-thread one when asked and one exists
 * for that version, else the plain one of that version. */
static int hook_by_base(const char *symbol, int version, cuuint64_t flags)
{
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        int id = search_base(symbol, version, 1);
        if (id >= 0)
            return id;
    }
    return search_base(symbol, version, 0);
}

static CUresult after_proc_address(const char *symbol, void **pfn, int version, cuuint64_t flags, CUresult rc)
{
    if (rc != CUDA_SUCCESS || pfn == NULL || *pfn == NULL || symbol == NULL || alnair_region == NULL)
        return rc;
    void *p = *pfn;
    int id = -1;
    for (int i = 0; i < H_COUNT; i++) {
        if (rows[i].hook == p)
            return rc; /* already ours */
        if (id < 0 && rows[i].lib == ALNAIR_LIB_CU && atomic_load(&alnair_real_fn[i]) == p)
            id = i;
    }
    if (id < 0)
        id = hook_by_base(symbol, version, flags);
    if (id < 0)
        return rc;
    void *expected = NULL;
    atomic_compare_exchange_strong(&alnair_real_fn[id], &expected, p); /* the driver's pointer for this variant */
    *pfn = rows[id].hook;
    return rc;
}

ALNAIR_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    REAL_OR_FAIL(fn, cuGetProcAddress);
    CUresult rc = fn(symbol, pfn, cudaVersion, flags);
    return after_proc_address(symbol, pfn, cudaVersion, flags, rc);
}

ALNAIR_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus)
{
    REAL_OR_FAIL(fn, cuGetProcAddress_v2);
    CUresult rc = fn(symbol, pfn, cudaVersion, flags, symbolStatus);
    return after_proc_address(symbol, pfn, cudaVersion, flags, rc);
}

/* ---- introspection, for the tests ------------------------------------------------------------------------ */
ALNAIR_API int alnair_hook_count(void)
{
    return H_COUNT;
}

ALNAIR_API const char *alnair_hook_name(int i)
{
    return i >= 0 && i < H_COUNT ? rows[i].name : NULL;
}

/* The real function behind hook i (resolving the table first), or NULL where the real library lacks it. */
ALNAIR_API void *alnair_hook_real(int i)
{
    return i >= 0 && i < H_COUNT ? alnair_real(i) : NULL;
}

ALNAIR_API void *alnair_hook_address(int i)
{
    return i >= 0 && i < H_COUNT ? rows[i].hook : NULL;
}
