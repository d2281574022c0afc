/* Device memory: every allocation API reserves its bytes container-wide before calling the driver, every free
 * gives them back, and the memory-info calls (CUDA and NVML) report the limit.
 *
 * Reserve (optimistic, race-free against the limit): add the bytes to our own slot's memory_used, sum all slots
 * (sequentially consistent on both sides); over the limit: reclaim dead processes' slots and sum again; still
 * over: take the bytes back out and fail with CUDA_ERROR_OUT_OF_MEMORY without calling the driver. Two processes
 * racing can both back out (a spurious out-of-memory under contention), never both succeed past the limit. Sizes
 * are remembered per pointer / handle in a process-local table, with the context each allocation lives in, so a
 * free gives back exactly what the allocation took and a destroyed or reset context gives back everything in it.
 * A free takes its entry out of the table before the driver call (an address the driver hands straight back to
 * another thread must not lose that thread's entry) and puts it back if the driver fails. A failed driver
 * allocation gives its reservation back at once, so nothing leaks. Memory the driver keeps after a free (VMM
 * handles still mapped, pool caches under their release threshold, graph memory) stays charged until the driver
 * lets it go. Arithmetic saturates: a size that overflows is over any limit, and memory_used never wraps. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "hook_protos.h"

enum { K_DEV = 1, K_HANDLE, K_ARRAY, K_MIPMAP, K_CTX, K_PCTX, K_MAP, K_POOL };

struct entry {
    uint64_t key;
    uint64_t size; /* bytes charged for it (K_MAP: the mapping's length, not charged) */
    uint64_t ctx;  /* the context it lives in (0: none; VMM handles outlive contexts); K_PCTX: the primary context */
    uint64_t aux;  /* K_HANDLE: live mappings; K_MAP: the handle mapped there; K_DEV: its pool (stream-ordered
                      allocations, 0: none known); K_POOL: the release threshold */
    uint32_t kind; /* 0: empty, UINT32_MAX: deleted */
    uint32_t refs; /* K_PCTX: retains; K_HANDLE: 1 until cuMemRelease, then 0 (kept while mapped) */
    uint32_t dev;  /* the device (alnair_cur) it is charged on: its free gives the bytes back there */
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct entry *table;
static size_t cap, live, tomb;

/* The calling thread's context (0 when none or unknown), to give an allocation back when its context dies. */
static uint64_t current_ctx(void)
{
    CUcontext c = NULL;
    if (alnair_aux.cuCtxGetCurrent == NULL || alnair_aux.cuCtxGetCurrent(&c) != CUDA_SUCCESS)
        return 0;
    return (uint64_t)(uintptr_t)c;
}

static size_t hash(uint64_t key, uint32_t kind)
{
    uint64_t h = (key ^ ((uint64_t)kind << 59)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 20);
}

static struct entry *find(uint64_t key, uint32_t kind)
{
    if (cap == 0)
        return NULL;
    for (size_t i = hash(key, kind) & (cap - 1), n = 0; n < cap; i = (i + 1) & (cap - 1), n++) {
        if (table[i].kind == 0)
            return NULL;
        if (table[i].kind == kind && table[i].key == key)
            return &table[i];
    }
    return NULL;
}

static int grow(void)
{
    size_t ncap = cap ? cap * 2 : 1024;
    while ((live + 1) * 2 > ncap)
        ncap *= 2;
    struct entry *nt = calloc(ncap, sizeof *nt);
    if (nt == NULL)
        return -1;
    for (size_t i = 0; i < cap; i++) {
        if (table[i].kind == 0 || table[i].kind == UINT32_MAX)
            continue;
        size_t j = hash(table[i].key, table[i].kind) & (ncap - 1);
        while (nt[j].kind != 0)
            j = (j + 1) & (ncap - 1);
        nt[j] = table[i];
    }
    free(table);
    table = nt;
    cap = ncap;
    tomb = 0;
    return 0;
}

static struct entry *insert(uint64_t key, uint32_t kind, uint64_t size)
{
    if ((live + tomb + 1) * 2 > cap && grow() != 0)
        return NULL;
    size_t i = hash(key, kind) & (cap - 1);
    while (table[i].kind != 0 && table[i].kind != UINT32_MAX && !(table[i].kind == kind && table[i].key == key))
        i = (i + 1) & (cap - 1);
    if (table[i].kind == UINT32_MAX)
        tomb--;
    if (table[i].kind == 0 || table[i].kind == UINT32_MAX)
        live++;
    table[i] = (struct entry){.key = key, .size = size, .kind = kind, .refs = 1, .dev = (uint32_t)alnair_cur};
    if (kind == K_DEV || kind == K_ARRAY || kind == K_MIPMAP)
        table[i].ctx = current_ctx();
    return &table[i];
}

/* Remove every entry of `ctx` (its allocations died with it); adds the bytes they were charged to `give`, per
 * device (a context is on one device, but an entry says where it was charged). mu held. */
static void erase_ctx(uint64_t ctx, uint64_t give[ALNAIR_MAX_DEVICES])
{
    for (size_t i = 0; ctx != 0 && i < cap; i++) {
        struct entry *e = &table[i];
        if (e->kind != 0 && e->kind != UINT32_MAX && e->kind != K_PCTX && e->kind != K_CTX && e->ctx == ctx) {
            uint64_t *g = &give[e->dev < ALNAIR_MAX_DEVICES ? e->dev : 0];
            *g = *g + e->size < *g ? UINT64_MAX : *g + e->size;
            e->kind = UINT32_MAX;
            live--;
            tomb++;
        }
    }
}

static void erase(struct entry *e)
{
    e->kind = UINT32_MAX;
    live--;
    tomb++;
}

static uint64_t g_graph_charged[64]; /* per device: graph memory charged so far; under mu */

void alnair_memory_after_fork_child(void)
{
    pthread_mutex_init(&mu, NULL);
    memset(g_graph_charged, 0, sizeof g_graph_charged); /* the parent's graph memory is not the child's */
    if (table != NULL)
        memset(table, 0, cap * sizeof *table); /* the parent's allocations are not the child's */
    live = tomb = 0;
}

/* ---- reserve / release --------------------------------------------------------------------------------------- */
static void unreserve(uint64_t size)
{
    struct alnair_region_slot *s = alnair_slot();
    if (s == NULL || size == 0)
        return;
    uint64_t old = RLOAD(s->memory_used), nv;
    do
        nv = old > size ? old - size : 0;
    while (!__atomic_compare_exchange_n(&s->memory_used, &old, nv, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
}

/* Give back bytes charged on each device. */
static void unreserve_each(const uint64_t give[ALNAIR_MAX_DEVICES])
{
    for (int i = 0; i < alnair_device_count; i++)
        if (give[i] != 0) {
            alnair_use_device(i);
            unreserve(give[i]);
        }
}

static void unreserve_on(uint32_t dev, uint64_t size)
{
    if (alnair_device_count > 1)
        alnair_use_device((int)dev);
    unreserve(size);
}

/* Count bytes the driver already holds (no limit check: they exist whatever we say). */
static void charge(uint64_t size)
{
    struct alnair_region_slot *s = alnair_hot.region ? alnair_slot() : NULL;
    if (s == NULL || size == 0)
        return;
    uint64_t old = RLOAD(s->memory_used), nv;
    do
        nv = __builtin_add_overflow(old, size, &nv) ? UINT64_MAX : old + size;
    while (!__atomic_compare_exchange_n(&s->memory_used, &old, nv, 1, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
}

/* 0: reserved (or no region); -1: over the limit (or this process has no slot), nothing reserved. */
static int reserve(uint64_t size)
{
    struct alnair_region *r = alnair_hot.region;
    if (r == NULL)
        return 0;
    struct alnair_region_slot *s = alnair_slot();
    if (s == NULL)
        return 0;
    if (UNLIKELY(alnair_slotless()) && (s = alnair_slot_retry(), alnair_slotless()))
        return -1; /* invisible to the container's other processes: refused, never ignored */
    uint64_t limit = RLOAD(r->agent.memory_limit);
    if (limit != 0 && size > limit)
        return -1;
    /* seq_cst add, then seq_cst loads of every slot (alnair_memory_used_all): store -> load ordering, which
     * acquire/release alone does not give on Arm */
    uint64_t old = RLOAD(s->memory_used), nv;
    do
        if (__builtin_add_overflow(old, size, &nv))
            return -1;
    while (!__atomic_compare_exchange_n(&s->memory_used, &old, nv, 1, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    if (limit == 0 || alnair_memory_used_all() <= limit)
        return 0;
    if (alnair_reclaim_dead_slots() > 0 && alnair_memory_used_all() <= limit)
        return 0;
    unreserve(size);
    return -1;
}

static void track(uint32_t kind, uint64_t key, uint64_t size)
{
    pthread_mutex_lock(&mu);
    struct entry *e = find(key, kind);
    if (e != NULL) { /* the driver handed out a key we still hold: the old one was freed behind our back */
        uint64_t stale = e->size;
        uint32_t stale_dev = e->dev, dev = (uint32_t)alnair_cur;
        e->size = size;
        e->ctx = (kind == K_DEV || kind == K_ARRAY || kind == K_MIPMAP) ? current_ctx() : 0;
        e->aux = 0;
        e->refs = 1;
        e->dev = dev;
        pthread_mutex_unlock(&mu);
        unreserve_on(stale_dev, stale);
        unreserve_on(dev, 0); /* back on the allocation's device */
        return;
    }
    if (insert(key, kind, size) == NULL) {
        pthread_mutex_unlock(&mu);
        unreserve(size); /* cannot remember it: do not count what we could never give back */
        return;
    }
    pthread_mutex_unlock(&mu);
}

/* A free takes the entry out of the table BEFORE the driver frees it: once the driver has freed an address another
 * thread may get it back at once, and its new entry must not be the one this free removes. */
static int detach(uint32_t kind, uint64_t key, struct entry *out)
{
    pthread_mutex_lock(&mu);
    struct entry *e = find(key, kind);
    if (e != NULL) {
        *out = *e;
        erase(e);
    }
    pthread_mutex_unlock(&mu);
    return e != NULL;
}

/* After the driver call: on success the bytes go back; on failure the entry is put back as it was. */
static void settle(int had, const struct entry *saved, CUresult rc)
{
    if (!had)
        return;
    if (rc == CUDA_SUCCESS) {
        unreserve_on(saved->dev, saved->size);
        return;
    }
    pthread_mutex_lock(&mu);
    struct entry *e = find(saved->key, saved->kind) == NULL ? insert(saved->key, saved->kind, saved->size) : NULL;
    if (e != NULL)
        *e = *saved;
    pthread_mutex_unlock(&mu);
    if (e == NULL)
        unreserve_on(saved->dev, saved->size);
}

static inline uint64_t mul_sat(uint64_t a, uint64_t b)
{
    uint64_t c;
    return __builtin_mul_overflow(a, b, &c) ? UINT64_MAX : c;
}

/* The common shape: reserve, call the driver, keep or give back. */
#define ALLOC_BODY(kind, bytes, call, keyexpr)           \
    do {                                                 \
        if (alnair_hot.region == NULL)                   \
            return (call);                               \
        uint64_t bytes_ = (bytes);                       \
        if (reserve(bytes_) != 0)                        \
            return CUDA_ERROR_OUT_OF_MEMORY;             \
        CUresult rc_ = (call);                           \
        if (rc_ != CUDA_SUCCESS)                         \
            unreserve(bytes_);                           \
        else                                             \
            track((kind), (uint64_t)(keyexpr), bytes_);  \
        return rc_;                                      \
    } while (0)

#define FREE_BODY(kind, key, call)                       \
    do {                                                 \
        if (alnair_hot.region == NULL)                   \
            return (call);                               \
        struct entry saved_;                             \
        int had_ = detach((kind), (uint64_t)(key), &saved_); \
        CUresult rc_ = (call);                           \
        settle(had_, &saved_, rc_);                      \
        return rc_;                                      \
    } while (0)

/* ---- linear allocations ---------------------------------------------------------------------------------- */
ALNAIR_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    REAL_OR_FAIL(fn, cuMemAlloc_v2);
    ALLOC_BODY(K_DEV, bytesize, fn(dptr, bytesize), *dptr);
}

ALNAIR_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    REAL_OR_FAIL(fn, cuMemAllocManaged);
    ALLOC_BODY(K_DEV, bytesize, fn(dptr, bytesize, flags), *dptr);
}

ALNAIR_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                       unsigned int ElementSizeBytes)
{
    REAL_OR_FAIL(fn, cuMemAllocPitch_v2);
    if (alnair_hot.region == NULL)
        return fn(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* reserve the most the pitch can be (rows padded to 512 bytes), then keep what the driver really took */
    uint64_t row = WidthInBytes > UINT64_MAX - 511 ? UINT64_MAX : (WidthInBytes + 511) & ~511ull;
    uint64_t most = mul_sat(row, Height);
    if (reserve(most) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = fn(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        unreserve(most);
        return rc;
    }
    uint64_t real = mul_sat(*pPitch, Height);
    if (real < most) {
        unreserve(most - real);
    } else if (real > most && reserve(real - most) != 0) {
        /* the driver padded rows wider than assumed and the difference does not fit: give it back, refuse */
        __typeof__(&cuMemFree_v2) free_fn = REAL(cuMemFree_v2);
        CUresult frc = free_fn ? free_fn(*dptr) : CUDA_ERROR_NOT_FOUND;
        unreserve(most);
        if (frc != CUDA_SUCCESS)
            track(K_DEV, *dptr, 0); /* cannot free it: at least never count it twice */
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    track(K_DEV, *dptr, real);
    return rc;
}

ALNAIR_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    REAL_OR_FAIL(fn, cuMemFree_v2);
    FREE_BODY(K_DEV, dptr, fn(dptr));
}

/* ---- stream-ordered allocations and their pools -----------------------------------------------------------
 * A pool keeps freed bytes (up to its release threshold) instead of giving them back to the device: the driver
 * still holds them, so they stay charged, as the pool's cache (a K_POOL entry: size = cached bytes, aux = the
 * threshold). The next allocation from that pool is served from the cache first, and cuMemPoolTrimTo, a lower
 * threshold or cuMemPoolDestroy give the bytes back. An allocation made into a capturing stream is not memory
 * yet: it becomes graph memory, charged when a graph launch makes the driver reserve it (below). */
#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2
static _Atomic int g_pools; /* some pool keeps freed bytes: async allocations look their pool up */
static _Atomic int g_graph_mem; /* graph memory may exist: allocations were captured, or nodes added */

static uint64_t current_pool(void)
{
    CUdevice dev = 0;
    CUmemoryPool pool = NULL;
    if (alnair_aux.cuCtxGetDevice == NULL || alnair_aux.cuDeviceGetMemPool == NULL ||
        alnair_aux.cuCtxGetDevice(&dev) != CUDA_SUCCESS || alnair_aux.cuDeviceGetMemPool(&pool, dev) != CUDA_SUCCESS)
        return 0;
    return (uint64_t)(uintptr_t)pool;
}

/* Take up to `size` bytes out of the pool's cache (their charge moves to the new allocation). */
static uint64_t pool_take(uint64_t pool, uint64_t size)
{
    if (pool == 0)
        return 0;
    pthread_mutex_lock(&mu);
    struct entry *e = find(pool, K_POOL);
    uint64_t take = 0;
    if (e != NULL) {
        take = e->size < size ? e->size : size;
        e->size -= take;
    }
    pthread_mutex_unlock(&mu);
    return take;
}

/* `size` freed bytes go back to the pool: what fits under its threshold stays cached (and charged); returns the
 * bytes no longer held by the driver. */
static uint64_t pool_give(uint64_t pool, uint64_t size)
{
    if (pool == 0)
        return size;
    pthread_mutex_lock(&mu);
    struct entry *e = find(pool, K_POOL);
    uint64_t keep = 0;
    if (e != NULL && e->aux > e->size) {
        keep = e->aux - e->size < size ? e->aux - e->size : size;
        e->size += keep;
    }
    pthread_mutex_unlock(&mu);
    return size - keep;
}

static int stream_capturing(CUstream s, int pt)
{
    if (!alnair_captures_under_way())
        return 0;
    /* a stream the driver cannot tell about is taken as not capturing: its allocation is charged as any other */
    return alnair_stream_capture_state(s, pt) == 1;
}

#define ASYNC_ALLOC_BODY(poolexpr, stream, pt, call)                         \
    do {                                                                     \
        if (alnair_hot.region == NULL)                                       \
            return (call);                                                   \
        if (stream_capturing((stream), (pt))) {                              \
            atomic_store(&g_graph_mem, 1); /* graph memory: charged at launch */ \
            return (call);                                                   \
        }                                                                    \
        uint64_t pool_ = atomic_load_explicit(&g_pools, memory_order_relaxed) ? (poolexpr) : 0; \
        uint64_t cached_ = pool_take(pool_, bytesize);                       \
        uint64_t rest_ = bytesize - cached_;                                 \
        if (reserve(rest_) != 0) {                                           \
            unreserve(pool_give(pool_, cached_));                            \
            return CUDA_ERROR_OUT_OF_MEMORY;                                 \
        }                                                                    \
        CUresult rc_ = (call);                                               \
        if (rc_ != CUDA_SUCCESS) {                                           \
            unreserve(rest_);                                                \
            unreserve(pool_give(pool_, cached_));                            \
            return rc_;                                                      \
        }                                                                    \
        track(K_DEV, *dptr, bytesize);                                       \
        set_pool(*dptr, pool_);                                              \
        return rc_;                                                          \
    } while (0)

static void set_pool(uint64_t ptr, uint64_t pool)
{
    if (pool == 0)
        return;
    pthread_mutex_lock(&mu);
    struct entry *e = find(ptr, K_DEV);
    if (e != NULL)
        e->aux = pool;
    pthread_mutex_unlock(&mu);
}

ALNAIR_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    REAL_OR_FAIL(fn, cuMemAllocAsync);
    ASYNC_ALLOC_BODY(current_pool(), hStream, 0, fn(dptr, bytesize, hStream));
}

ALNAIR_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    REAL_OR_FAIL(fn, cuMemAllocAsync_ptsz);
    ASYNC_ALLOC_BODY(current_pool(), hStream, 1, fn(dptr, bytesize, hStream));
}

ALNAIR_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    REAL_OR_FAIL(fn, cuMemAllocFromPoolAsync);
    ASYNC_ALLOC_BODY((uint64_t)(uintptr_t)pool, hStream, 0, fn(dptr, bytesize, pool, hStream));
}

ALNAIR_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                 CUstream hStream)
{
    REAL_OR_FAIL(fn, cuMemAllocFromPoolAsync_ptsz);
    ASYNC_ALLOC_BODY((uint64_t)(uintptr_t)pool, hStream, 1, fn(dptr, bytesize, pool, hStream));
}

#define ASYNC_FREE_BODY(call)                                                \
    do {                                                                     \
        if (alnair_hot.region == NULL)                                       \
            return (call);                                                   \
        struct entry saved_;                                                 \
        int had_ = detach(K_DEV, dptr, &saved_);                             \
        CUresult rc_ = (call);                                               \
        if (had_ && rc_ == CUDA_SUCCESS) {                                   \
            saved_.size = pool_give(saved_.aux, saved_.size);                \
        }                                                                    \
        settle(had_, &saved_, rc_);                                          \
        return rc_;                                                          \
    } while (0)

ALNAIR_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    REAL_OR_FAIL(fn, cuMemFreeAsync);
    ASYNC_FREE_BODY(fn(dptr, hStream));
}

ALNAIR_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    REAL_OR_FAIL(fn, cuMemFreeAsync_ptsz);
    ASYNC_FREE_BODY(fn(dptr, hStream));
}

ALNAIR_API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    REAL_OR_FAIL(fn, cuMemPoolSetAttribute);
    CUresult rc = fn(pool, attr, value);
    if (rc != CUDA_SUCCESS || alnair_hot.region == NULL || attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD || value == NULL)
        return rc;
    uint64_t threshold = *(const cuuint64_t *)value, give = 0;
    pthread_mutex_lock(&mu);
    struct entry *e = find((uintptr_t)pool, K_POOL);
    if (e == NULL && threshold > 0 && (e = insert((uintptr_t)pool, K_POOL, 0)) != NULL)
        e->refs = 0;
    if (e != NULL) {
        e->aux = threshold;
        if (e->size > threshold) { /* the driver releases what is above the new threshold */
            give = e->size - threshold;
            e->size = threshold;
        }
    }
    pthread_mutex_unlock(&mu);
    if (threshold > 0)
        atomic_store(&g_pools, 1);
    unreserve(give);
    return rc;
}

ALNAIR_API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    REAL_OR_FAIL(fn, cuMemPoolTrimTo);
    CUresult rc = fn(pool, minBytesToKeep);
    if (rc != CUDA_SUCCESS || alnair_hot.region == NULL)
        return rc;
    uint64_t give = 0;
    pthread_mutex_lock(&mu);
    struct entry *e = find((uintptr_t)pool, K_POOL);
    if (e != NULL && e->size > minBytesToKeep) {
        give = e->size - minBytesToKeep;
        e->size = minBytesToKeep;
    }
    pthread_mutex_unlock(&mu);
    unreserve(give);
    return rc;
}

ALNAIR_API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    REAL_OR_FAIL(fn, cuMemPoolDestroy);
    if (alnair_hot.region == NULL)
        return fn(pool);
    struct entry saved;
    int had = detach((uintptr_t)pool, K_POOL, &saved);
    CUresult rc = fn(pool);
    settle(had, &saved, rc);
    return rc;
}

/* ---- graph memory: what the device's graph pool has reserved (cuDeviceGetGraphMemAttribute) is charged after
 * each graph launch and each trim; a graph launch while the container is already over its limit is refused. */
void alnair_graph_mem_sync(void)
{
    if (!atomic_load_explicit(&g_graph_mem, memory_order_relaxed) || alnair_hot.region == NULL)
        return;
    CUdevice dev = 0;
    cuuint64_t reserved = 0;
    if (alnair_aux.cuCtxGetDevice == NULL || alnair_aux.cuDeviceGetGraphMemAttribute == NULL ||
        alnair_aux.cuCtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0 || dev >= 64 ||
        alnair_aux.cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) !=
            CUDA_SUCCESS)
        return;
    pthread_mutex_lock(&mu);
    uint64_t old = g_graph_charged[dev];
    g_graph_charged[dev] = reserved;
    pthread_mutex_unlock(&mu);
    if (reserved > old)
        charge(reserved - old); /* already the driver's: counted, so everything else is refused past the limit */
    else
        unreserve(old - reserved);
}

int alnair_graph_mem_over(void)
{
    alnair_select();
    struct alnair_region *r = alnair_hot.region;
    if (LIKELY(!atomic_load_explicit(&g_graph_mem, memory_order_relaxed)) || r == NULL)
        return 0;
    uint64_t limit = RLOAD(r->agent.memory_limit);
    return limit != 0 && alnair_memory_used_all() > limit;
}

ALNAIR_API CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                           size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    REAL_OR_FAIL(fn, cuGraphAddMemAllocNode);
    CUresult rc = fn(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    if (rc == CUDA_SUCCESS && alnair_hot.region != NULL)
        atomic_store(&g_graph_mem, 1);
    return rc;
}

ALNAIR_API CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    REAL_OR_FAIL(fn, cuDeviceGraphMemTrim);
    CUresult rc = fn(device);
    if (rc == CUDA_SUCCESS)
        alnair_graph_mem_sync();
    return rc;
}

/* ---- virtual memory management: the physical allocation is what counts --------------------------------- */
ALNAIR_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    REAL_OR_FAIL(fn, cuMemCreate);
    ALLOC_BODY(K_HANDLE, size, fn(handle, size, prop, flags), *handle);
}

/* cuMemCreate -> cuMemMap -> cuMemRelease is the documented idiom: the physical memory lives until its last mapping
 * is unmapped. A released handle with live mappings stays charged (refs 0, aux = mappings); the unmap of its last
 * mapping gives the bytes back. */
ALNAIR_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    REAL_OR_FAIL(fn, cuMemRelease);
    if (alnair_hot.region == NULL)
        return fn(handle);
    struct entry saved;
    int had = 0, marked = 0;
    pthread_mutex_lock(&mu);
    struct entry *e = find(handle, K_HANDLE);
    if (e != NULL && e->aux > 0 && e->refs > 0) {
        e->refs = 0; /* still mapped: keep the charge until the last unmap */
        marked = 1;
    } else if (e != NULL && e->aux == 0) {
        saved = *e;
        erase(e);
        had = 1;
    }
    pthread_mutex_unlock(&mu);
    CUresult rc = fn(handle);
    if (marked && rc != CUDA_SUCCESS) {
        pthread_mutex_lock(&mu);
        if ((e = find(handle, K_HANDLE)) != NULL)
            e->refs = 1;
        pthread_mutex_unlock(&mu);
    }
    settle(had, &saved, rc);
    return rc;
}

ALNAIR_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags)
{
    REAL_OR_FAIL(fn, cuMemMap);
    CUresult rc = fn(ptr, size, offset, handle, flags);
    if (rc != CUDA_SUCCESS || alnair_hot.region == NULL)
        return rc;
    pthread_mutex_lock(&mu);
    struct entry *h = find(handle, K_HANDLE);
    if (h != NULL) {
        struct entry *m = find(ptr, K_MAP);
        if (m != NULL) { /* a stale mapping record at this address (unmapped behind our back): drop its count */
            struct entry *old = find(m->aux, K_HANDLE);
            if (old != NULL && old->aux > 0)
                old->aux--;
        }
        m = insert(ptr, K_MAP, size);
        h = find(handle, K_HANDLE); /* insert may have grown the table */
        if (m != NULL && h != NULL) {
            m->aux = handle;
            h->aux++;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

ALNAIR_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    REAL_OR_FAIL(fn, cuMemUnmap);
    CUresult rc = fn(ptr, size);
    if (rc != CUDA_SUCCESS || alnair_hot.region == NULL)
        return rc;
    uint64_t give[ALNAIR_MAX_DEVICES] = {0}, end = (uint64_t)ptr + size < (uint64_t)ptr ? UINT64_MAX : (uint64_t)ptr + size;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < cap; i++) { /* every mapping in [ptr, ptr + size): an unmap may span several */
        struct entry *m = &table[i];
        if (m->kind != K_MAP || m->key < (uint64_t)ptr || m->key >= end)
            continue;
        uint64_t handle = m->aux;
        erase(m);
        struct entry *h = find(handle, K_HANDLE);
        if (h != NULL && h->aux > 0 && --h->aux == 0 && h->refs == 0) {
            give[h->dev < ALNAIR_MAX_DEVICES ? h->dev : 0] += h->size; /* released, last mapping: freed now */
            erase(h);
        }
    }
    pthread_mutex_unlock(&mu);
    unreserve_each(give);
    return rc;
}

/* ---- arrays: bytes estimated from the descriptor (element size x channels x extent, mip levels summed) ----- */
static uint64_t format_bytes(CUarray_format f)
{
    switch (f) {
    case 0x01: case 0x08: return 1;              /* (un)signed int8 */
    case 0x02: case 0x09: case 0x10: return 2;   /* (un)signed int16, half */
    case 0x03: case 0x0a: case 0x20: return 4;   /* (un)signed int32, float */
    default: return 4;                           /* newer and block-compressed formats: at most this per channel */
    }
}

static uint64_t extent_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch)
{
    uint64_t b = mul_sat(format_bytes(f), ch ? ch : 1);
    b = mul_sat(b, w ? w : 1);
    b = mul_sat(b, h ? h : 1);
    return mul_sat(b, d ? d : 1);
}

static uint64_t array3d_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    if (d == NULL)
        return 0;
    uint64_t sum = 0;
    size_t w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t b = extent_bytes(w, h, z, d->Format, d->NumChannels), t;
        sum = __builtin_add_overflow(sum, b, &t) ? UINT64_MAX : t;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        if (!(d->Flags & 0x1)) /* CUDA_ARRAY3D_LAYERED: the layer count does not shrink */
            z = z > 1 ? z / 2 : z;
    }
    return sum;
}

ALNAIR_API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    REAL_OR_FAIL(fn, cuArrayCreate_v2);
    const CUDA_ARRAY_DESCRIPTOR *d = pAllocateArray;
    ALLOC_BODY(K_ARRAY, d ? extent_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels) : 0,
               fn(pHandle, pAllocateArray), (uintptr_t)*pHandle);
}

ALNAIR_API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    REAL_OR_FAIL(fn, cuArray3DCreate_v2);
    ALLOC_BODY(K_ARRAY, array3d_bytes(pAllocateArray, 1), fn(pHandle, pAllocateArray), (uintptr_t)*pHandle);
}

ALNAIR_API CUresult cuArrayDestroy(CUarray hArray)
{
    REAL_OR_FAIL(fn, cuArrayDestroy);
    FREE_BODY(K_ARRAY, (uintptr_t)hArray, fn(hArray));
}

ALNAIR_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pDesc,
                                           unsigned int numMipmapLevels)
{
    REAL_OR_FAIL(fn, cuMipmappedArrayCreate);
    ALLOC_BODY(K_MIPMAP, array3d_bytes(pDesc, numMipmapLevels), fn(pHandle, pDesc, numMipmapLevels),
               (uintptr_t)*pHandle);
}

ALNAIR_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    REAL_OR_FAIL(fn, cuMipmappedArrayDestroy);
    FREE_BODY(K_MIPMAP, (uintptr_t)hMipmappedArray, fn(hMipmappedArray));
}

/* ---- contexts: each one's own device memory counts (ALNAIR_CONTEXT_BYTES) -------------------------------- */
ALNAIR_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    REAL_OR_FAIL(fn, cuCtxCreate_v2);
    alnair_use_device(alnair_device_index(dev)); /* a context is charged on its device */
    ALLOC_BODY(K_CTX, alnair_context_bytes, fn(pctx, flags, dev), (uintptr_t)*pctx);
}

ALNAIR_API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                   unsigned int flags, CUdevice dev)
{
    REAL_OR_FAIL(fn, cuCtxCreate_v3);
    alnair_use_device(alnair_device_index(dev));
    ALLOC_BODY(K_CTX, alnair_context_bytes, fn(pctx, paramsArray, numParams, flags, dev), (uintptr_t)*pctx);
}

ALNAIR_API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                   CUdevice dev)
{
    REAL_OR_FAIL(fn, cuCtxCreate_v4);
    alnair_use_device(alnair_device_index(dev));
    ALLOC_BODY(K_CTX, alnair_context_bytes, fn(pctx, ctxCreateParams, flags, dev), (uintptr_t)*pctx);
}

/* Destroying a context frees everything allocated in it: its own charge and its allocations' go back. */
ALNAIR_API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    REAL_OR_FAIL(fn, cuCtxDestroy_v2);
    if (alnair_hot.region == NULL)
        return fn(ctx);
    struct entry saved;
    int had = detach(K_CTX, (uintptr_t)ctx, &saved);
    CUresult rc = fn(ctx);
    settle(had, &saved, rc);
    if (rc == CUDA_SUCCESS) {
        uint64_t give[ALNAIR_MAX_DEVICES] = {0};
        pthread_mutex_lock(&mu);
        erase_ctx((uintptr_t)ctx, give);
        pthread_mutex_unlock(&mu);
        unreserve_each(give);
        alnair_contexts_changed();
    }
    return rc;
}

/* The primary context is charged on its first retain in this process and given back when our retains drop to 0
 * or it is reset. No lock is held across the driver call. */
ALNAIR_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    REAL_OR_FAIL(fn, cuDevicePrimaryCtxRetain);
    if (alnair_hot.region == NULL)
        return fn(pctx, dev);
    alnair_use_device(alnair_device_index(dev)); /* the primary context is charged on its device */
    pthread_mutex_lock(&mu);
    struct entry *e = find((uint64_t)(uint32_t)dev, K_PCTX);
    int first = e == NULL;
    pthread_mutex_unlock(&mu);
    uint64_t bytes = first ? alnair_context_bytes : 0;
    if (first && reserve(bytes) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = fn(pctx, dev);
    int kept = 0;
    pthread_mutex_lock(&mu);
    e = find((uint64_t)(uint32_t)dev, K_PCTX);
    if (rc == CUDA_SUCCESS) {
        if (e != NULL)
            e->refs++; /* a later retain, or another thread's first retain won the race */
        else if ((e = insert((uint64_t)(uint32_t)dev, K_PCTX, bytes)) != NULL)
            kept = 1;
        if (e != NULL && pctx != NULL)
            e->ctx = (uint64_t)(uintptr_t)*pctx;
    }
    pthread_mutex_unlock(&mu);
    if (first && !kept)
        unreserve(bytes);
    return rc;
}

static void primary_drop(CUdevice dev, int all)
{
    uint64_t give[ALNAIR_MAX_DEVICES] = {0};
    int dropped = 0;
    pthread_mutex_lock(&mu);
    struct entry *e = find((uint64_t)(uint32_t)dev, K_PCTX);
    if (e != NULL && (all || --e->refs == 0)) {
        /* reset, or the last release: the driver destroys the primary context and everything allocated in it */
        uint64_t ctx = e->ctx;
        give[e->dev < ALNAIR_MAX_DEVICES ? e->dev : 0] = e->size;
        erase(e);
        erase_ctx(ctx, give);
        dropped = 1;
    }
    pthread_mutex_unlock(&mu);
    unreserve_each(give);
    if (dropped)
        alnair_contexts_changed();
}

ALNAIR_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    REAL_OR_FAIL(fn, cuDevicePrimaryCtxRelease_v2);
    CUresult rc = fn(dev);
    if (rc == CUDA_SUCCESS && alnair_hot.region != NULL)
        primary_drop(dev, 0);
    return rc;
}

ALNAIR_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    REAL_OR_FAIL(fn, cuDevicePrimaryCtxReset_v2);
    CUresult rc = fn(dev);
    if (rc == CUDA_SUCCESS && alnair_hot.region != NULL)
        primary_drop(dev, 1);
    return rc;
}

/* ---- reporting the limit ------------------------------------------------------------------------------------ */
/* total = min(limit, real total); free = total - used container-wide, clamped to [0, real free]. */
static int limited_view(uint64_t real_total, uint64_t real_free, uint64_t *total, uint64_t *free_, uint64_t *used)
{
    struct alnair_region *r = alnair_hot.region;
    uint64_t limit = r ? RLOAD(r->agent.memory_limit) : 0;
    if (limit == 0)
        return 0;
    uint64_t t = limit < real_total ? limit : real_total;
    uint64_t u = alnair_memory_used_all();
    if (u > t)
        u = t;
    uint64_t f = t - u;
    if (f > real_free)
        f = real_free;
    *total = t;
    *free_ = f;
    *used = u;
    return 1;
}

ALNAIR_API CUresult cuMemGetInfo_v2(size_t *free_, size_t *total)
{
    REAL_OR_FAIL(fn, cuMemGetInfo_v2);
    CUresult rc = fn(free_, total);
    uint64_t t, f, u;
    if (rc == CUDA_SUCCESS && free_ != NULL && total != NULL && limited_view(*total, *free_, &t, &f, &u)) {
        *total = t;
        *free_ = f;
    }
    return rc;
}

ALNAIR_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    REAL_OR_FAIL(fn, cuDeviceTotalMem_v2);
    CUresult rc = fn(bytes, dev);
    alnair_use_device(alnair_device_index(dev));
    struct alnair_region *r = alnair_hot.region;
    uint64_t limit = r ? RLOAD(r->agent.memory_limit) : 0;
    if (rc == CUDA_SUCCESS && bytes != NULL && limit != 0 && limit < *bytes)
        *bytes = limit;
    return rc;
}

ALNAIR_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    __typeof__(&nvmlDeviceGetMemoryInfo) fn = REAL(nvmlDeviceGetMemoryInfo);
    if (fn == NULL)
        return 12; /* NVML_ERROR_LIBRARY_NOT_FOUND */
    nvmlReturn_t rc = fn(device, memory);
    uint64_t t, f, u;
    if (rc == NVML_SUCCESS && memory != NULL && limited_view(memory->total, memory->free, &t, &f, &u)) {
        memory->total = t;
        memory->free = f;
        memory->used = u;
    }
    return rc;
}

ALNAIR_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    __typeof__(&nvmlDeviceGetMemoryInfo_v2) fn = REAL(nvmlDeviceGetMemoryInfo_v2);
    if (fn == NULL)
        return 12;
    nvmlReturn_t rc = fn(device, memory);
    uint64_t t, f, u;
    if (rc == NVML_SUCCESS && memory != NULL && limited_view(memory->total, memory->free, &t, &f, &u)) {
        memory->total = t;
        memory->free = f;
        memory->used = u;
        memory->reserved = 0;
    }
    return rc;
}
