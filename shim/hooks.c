/* The hook table and the three routes to the driver: exported names, a wrapped dlsym, and cuGetProcAddress.
 *
 * One table (hooks.def) gives, for every hooked function, its exported name, its slot in the real-function table
 * and the (base name, cudaVersion range, per-thread flag) that cuGetProcAddress maps to it. The exported names
 * are the hook functions themselves (-fvisibility=hidden elsewhere); `nm -D --defined-only` must list exactly the
 * table plus dlsym, dlvsym and the alnair_* introspection functions, which the tests check. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <string.h>
#include <sys/auxv.h>

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

/* ---- the real dlsym and dlvsym ---------------------------------------------------------------------------
 * The shim exports dlsym and dlvsym, so a call to either from inside the shim would come back to the shim. The
 * real ones are read from libc's (glibc >= 2.34) or libdl's (older) dynamic symbol table directly. */
typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
static dlsym_fn real_dlsym_p;
static dlvsym_fn real_dlvsym_p;
static pthread_once_t real_dl_once = PTHREAD_ONCE_INIT;

struct elf_find {
    const char *lib; /* "libc" or "libdl": libc.so.6, or libc-2.17.so where the file name is the real one */
    const char *names[2];
    void *found[2];
};

static uintptr_t dyn_ptr(uintptr_t base, uintptr_t v)
{
    return v < base ? v + base : v; /* glibc relocates these in place; others leave them as vaddrs */
}

static int elf_find_cb(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    struct elf_find *q = arg;
    const char *slash = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    const char *base_name = slash ? slash + 1 : info->dlpi_name;
    size_t n = strlen(q->lib);
    if (base_name == NULL || strncmp(base_name, q->lib, n) != 0 ||
        !(strncmp(base_name + n, ".so", 3) == 0 || base_name[n] == '-'))
        return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    if (dyn == NULL)
        return 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *gh = NULL, *sysv = NULL;
    const uint16_t *versym = NULL;
    uintptr_t base = info->dlpi_addr;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        if (dyn->d_tag == DT_SYMTAB)
            symtab = (const ElfW(Sym) *)dyn_ptr(base, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_STRTAB)
            strtab = (const char *)dyn_ptr(base, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_GNU_HASH)
            gh = (const uint32_t *)dyn_ptr(base, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_HASH)
            sysv = (const uint32_t *)dyn_ptr(base, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_VERSYM)
            versym = (const uint16_t *)dyn_ptr(base, dyn->d_un.d_ptr);
    }
    if (symtab == NULL || strtab == NULL)
        return 0;
    if (gh == NULL || gh[0] == 0) { /* a library linked with --hash-style=sysv only: walk every symbol */
        uint32_t nsyms = sysv ? sysv[1] : 0; /* nchain = the number of symbols */
        for (int k = 0; k < 2; k++) {
            void *hidden = NULL;
            for (uint32_t i = 1; i < nsyms && q->found[k] == NULL; i++) {
                const ElfW(Sym) *sym = &symtab[i];
                if (sym->st_shndx == SHN_UNDEF || strcmp(strtab + sym->st_name, q->names[k]) != 0)
                    continue;
                if (versym == NULL || !(versym[i] & 0x8000))
                    q->found[k] = (void *)(base + sym->st_value);
                else
                    hidden = (void *)(base + sym->st_value);
            }
            if (q->found[k] == NULL)
                q->found[k] = hidden;
        }
        return q->found[0] != NULL && q->found[1] != NULL;
    }
    uint32_t nbuckets = gh[0], symoffset = gh[1], bloom_size = gh[2];
    const ElfW(Addr) *bloom = (const ElfW(Addr) *)(gh + 4);
    const uint32_t *buckets = (const uint32_t *)(bloom + bloom_size), *chain = buckets + nbuckets;
    for (int k = 0; k < 2; k++) {
        uint32_t h = 5381;
        for (const unsigned char *c = (const unsigned char *)q->names[k]; *c; c++)
            h = h * 33 + *c;
        uint32_t i = buckets[h % nbuckets];
        if (i < symoffset)
            continue;
        for (void *hidden = NULL;; i++) {
            uint32_t ch = chain[i - symoffset];
            const ElfW(Sym) *sym = &symtab[i];
            if ((h | 1) == (ch | 1) && sym->st_shndx != SHN_UNDEF && strcmp(strtab + sym->st_name, q->names[k]) == 0) {
                void *p = (void *)(base + sym->st_value);
                if (versym == NULL || !(versym[i] & 0x8000)) {
                    q->found[k] = p; /* the default version */
                    break;
                }
                hidden = p;
            }
            if (ch & 1) {
                if (q->found[k] == NULL)
                    q->found[k] = hidden;
                break;
            }
        }
    }
    return q->found[0] != NULL && q->found[1] != NULL;
}

static void find_real_dl(void)
{
    static const char *const libs[] = {"libc", "libdl"};
    for (size_t i = 0; i < sizeof libs / sizeof libs[0] && (real_dlsym_p == NULL || real_dlvsym_p == NULL); i++) {
        struct elf_find q = {libs[i], {"dlsym", "dlvsym"}, {NULL, NULL}};
        dl_iterate_phdr(elf_find_cb, &q);
        if (real_dlsym_p == NULL)
            real_dlsym_p = (dlsym_fn)q.found[0];
        if (real_dlvsym_p == NULL)
            real_dlvsym_p = (dlvsym_fn)q.found[1];
    }
}

void *alnair_real_dlsym(void *handle, const char *name)
{
    pthread_once(&real_dl_once, find_real_dl);
    return real_dlsym_p ? real_dlsym_p(handle, name) : NULL;
}

static void *real_dlvsym(void *handle, const char *name, const char *version)
{
    pthread_once(&real_dl_once, find_real_dl);
    return real_dlvsym_p ? real_dlvsym_p(handle, name, version) : NULL;
}

/* dlsym / dlvsym (RTLD_NEXT, name): the first definition in an object loaded after the CALLER's object. Done here
 * explicitly (the real dlsym would take the shim for the caller): it never depends on the compiler turning the
 * forwarding call into a tail call. */
static void *next_after(const void *caller, const char *name, const char *version)
{
    Dl_info di;
    struct link_map *lm = NULL;
    if (dladdr1(caller, &di, (void **)&lm, RTLD_DL_LINKMAP) == 0 || lm == NULL)
        return version ? real_dlvsym(RTLD_NEXT, name, version) : alnair_real_dlsym(RTLD_NEXT, name);
    uintptr_t vdso = (uintptr_t)getauxval(AT_SYSINFO_EHDR);
    for (struct link_map *m = lm->l_next; m != NULL; m = m->l_next) {
        if (m->l_name == NULL || m->l_name[0] == '\0' || (vdso != 0 && (uintptr_t)m->l_addr == vdso))
            continue; /* the vDSO (no symbol scope of its own) */
        void *h = dlopen(m->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (h == NULL)
            continue;
        void *p = version ? real_dlvsym(h, name, version) : alnair_real_dlsym(h, name);
        dlclose(h);
        struct link_map *owner = NULL;
        if (p != NULL && dladdr1(p, &di, (void **)&owner, RTLD_DL_LINKMAP) != 0 && owner == m)
            return p;
    }
    return NULL;
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
    AUX(cuCtxGetDevice, "cuCtxGetDevice");
    AUX(cuDeviceGetMemPool, "cuDeviceGetMemPool");
    AUX(cuDeviceGetGraphMemAttribute, "cuDeviceGetGraphMemAttribute");
    AUX(cuDeviceGetAttribute, "cuDeviceGetAttribute");
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

/* ---- route 2: dlsym and dlvsym ---------------------------------------------------------------------------- */
static __attribute__((noinline)) void *dlsym_hooked(void *handle, const char *name, const char *version, int id)
{
    alnair_init();
    if (handle == RTLD_NEXT) {
        /* The next definition after the caller: ours is the one to give (we are preloaded). */
        return alnair_real(id) ? rows[id].hook : NULL;
    }
    void *p = version ? real_dlvsym(handle, name, version) : alnair_real_dlsym(handle, name);
    if (p == NULL || alnair_hot.region == NULL)
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
    int id = hook_by_name(name);
    if (LIKELY(id < 0))
        return handle == RTLD_NEXT ? next_after(__builtin_return_address(0), name, NULL)
                                   : alnair_real_dlsym(handle, name);
    return dlsym_hooked(handle, name, NULL, id);
}

ALNAIR_API void *dlvsym(void *handle, const char *name, const char *version)
{
    int id = hook_by_name(name);
    if (LIKELY(id < 0))
        return handle == RTLD_NEXT ? next_after(__builtin_return_address(0), name, version)
                                   : real_dlvsym(handle, name, version);
    return dlsym_hooked(handle, name, version, id);
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
    if (rc != CUDA_SUCCESS || pfn == NULL || *pfn == NULL || symbol == NULL || alnair_hot.region == NULL)
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
