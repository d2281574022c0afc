/* Internal interface between the shim's modules:
 *   hooks.c   the hook table, the real-function table, the dlsym and cuGetProcAddress routes
 *   init.c    one-time initialisation (environment, region), fork handling, the one warning line
 *   region.c  the shared region: slot claim, dead-slot reclaim, container-wide sums, the turns
 *   memory.c  allocation and free hooks, the per-pointer size table, memory-info hooks (CUDA and NVML)
 *   launch.c  launch hooks: the turn gate, per-function cost estimates, the in-flight bound, capture tracking */
#ifndef ALNAIR_H
#define ALNAIR_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cuda_abi.h"
#include "region_layout.h"

#define ALNAIR_API __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
/* The metered launch path's functions, side by side: called after a program's own work, the path's code is cold,
 * and spread over the shim's text it touched six pages of it (a VM's TLB miss is a two-level walk); together they
 * are two (shim/hot_text.ld; bench/RESULTS.md, 2026-12-07, eighteenth session). */
#define ALNAIR_HOT_TEXT __attribute__((section(".text.hot.alnair")))

/* ---- hooks.c ---------------------------------------------------------------------------------------------- */
enum alnair_lib { ALNAIR_LIB_CU, ALNAIR_LIB_NVML };
enum alnair_hook_id {
#define ALNAIR_HOOK(name, lib, base, vmin, vmax, pt) H_##name,
#include "hooks.def"
#undef ALNAIR_HOOK
    H_COUNT
};

/* Real functions, indexed by hook id. Filled once (pthread_once) from the real library, and per variant by the
 * cuGetProcAddress route. Read with relaxed loads on the hot path. */
extern void *_Atomic alnair_real_fn[H_COUNT];
void *alnair_real_slow(int id);
static inline void *alnair_real(int id)
{
    void *p = atomic_load_explicit(&alnair_real_fn[id], memory_order_acquire); /* a plain load on x86 */
    return LIKELY(p != NULL) ? p : alnair_real_slow(id);
}
/* REAL(cuMemAlloc_v2) is the real function, typed like the hook of the same name. */
#define REAL(name) ((__typeof__(&name))alnair_real(H_##name))
#define REAL_OR_FAIL(fn, name)                   \
    __typeof__(&name) fn = REAL(name);           \
    if (UNLIKELY(fn == NULL))                    \
        return CUDA_ERROR_NOT_FOUND;             \
    alnair_select()

/* Unhooked driver functions the shim itself calls (events, capture state), resolved with the real table. */
struct alnair_aux {
    CUresult (*cuEventCreate)(CUevent *, unsigned int);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventRecord_ptsz)(CUevent, CUstream);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuStreamIsCapturing)(CUstream, CUstreamCaptureStatus *);
    CUresult (*cuStreamIsCapturing_ptsz)(CUstream, CUstreamCaptureStatus *);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuCtxGetDevice)(CUdevice *);
    CUresult (*cuDeviceGetMemPool)(CUmemoryPool *, CUdevice);
    CUresult (*cuDeviceGetGraphMemAttribute)(CUdevice, int, void *);
    CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
};
extern struct alnair_aux alnair_aux;
void alnair_cuda_resolve(void); /* pthread_once: libcuda's real table + aux */
void *alnair_real_dlsym(void *handle, const char *name);

/* ---- init.c ----------------------------------------------------------------------------------------------- */
#define DEFAULT_COST_NS 20000ull /* a launch nothing is known about, before any sample (alnair_hot.guess_ns) */
/* The process-wide words every metered launch reads, on one cache line (one definition, init.c). A program's own
 * work between its launches evicts what the shim's launch path touches, and each line it touches is then a miss:
 * these were five lines of their own (bench/launch_overhead.py --gap-kb; bench/RESULTS.md, 2026-12-07, eighteenth
 * session). */
struct alnair_hot {
    struct alnair_region *region; /* region.c sets it: see "region.c" below */
    _Atomic uint64_t guess_ns;     /* a launch nothing is known about: recent samples' mean (estimate.c) */
    _Atomic unsigned fork_gen;     /* bumped in a forked child: thread-local state of the parent is void */
    _Atomic int captures;          /* stream captures under way in this process (capture.c) */
    _Atomic int global_captures;   /* ... of them in global mode: no thread may query an event meanwhile */
    _Atomic int guess_known;       /* guess_ns was taken from at least one sample */
    _Atomic uint32_t est_clock;    /* the estimate cache's LRU clock (estimate.c) */
} __attribute__((aligned(64)));
_Static_assert(sizeof(struct alnair_hot) == 64, "alnair_hot: one cache line");
extern struct alnair_hot alnair_hot;
void alnair_init(void); /* pthread_once: environment + region; cheap after the first call */
void alnair_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
uint64_t alnair_now_ns(void); /* CLOCK_MONOTONIC (vDSO, no syscall) */
void alnair_sleep_ns(uint64_t ns);

/* ---- region.c --------------------------------------------------------------------------------------------- */
/* alnair_hot.region (init.c): NULL, no limits at all, every call passes straight through. Otherwise the container's
 * shared region, or a private in-process one built from ALNAIR_MEMORY_LIMIT / ALNAIR_COMPUTE_LIMIT when the shared
 * one is refused. A container of several GPUs (ALNAIR_REGIONS) has one region per device, all with the same limits:
 * this is the first device's, and every per-device figure (slots, turns) is read from alnair_cur_region(). */
extern int alnair_region_shared; /* 1: the container's file; 0: private (env limits, this process alone) */
void alnair_region_setup(void);  /* called by alnair_init */
struct alnair_board *alnair_board_get(void); /* the calling thread's device's board, or NULL (latency.c) */

/* ---- devices (region.c) -------------------------------------------------------------------------------------
 * One entry per GPU of the container, in the order of its ALNAIR_REGIONS (NVIDIA_VISIBLE_DEVICES order); a
 * one-GPU container has one. Every hook selects the calling thread's device first (REAL_OR_FAIL): the device of
 * its current context (cuCtxGetDevice, cached per thread while the context stays current), mapped through
 * CUDA_VISIBLE_DEVICES when the process set one; a hook naming a device (cuCtxCreate, cuDevicePrimaryCtxRetain,
 * cuDeviceTotalMem) and a free (the device its allocation was charged on) set alnair_cur themselves. */
#define ALNAIR_MAX_DEVICES 16
struct alnair_device {
    struct alnair_region *region;
    int shared;
    int overflow_warned;
    struct alnair_region_slot *_Atomic slot; /* this process's slot in the device's region */
    struct alnair_region_slot overflow;      /* when every slot is held: this process is refused (region.c) */
    /* The GPU's board (the latency class): `board` beside the region, shared by the GPU's containers; mapped on
     * first need (latency.c), tried again at most every BOARD_RETRY_NS while it is missing. */
    struct alnair_board *_Atomic board;
    _Atomic uint64_t board_tried;
    _Atomic int board_lost; /* its mapping faulted (the file was cut short): zeros there now, mapped again later */
    char board_path[1024];
    _Atomic int mps; /* its contexts are an MPS server's clients: 0 not asked yet, 1 no, 2 yes (latency.c) */
};
extern struct alnair_device alnair_devices[ALNAIR_MAX_DEVICES];
extern int alnair_device_count;
extern __thread int alnair_cur __attribute__((tls_model("initial-exec"))); /* the device index this call works on */
void alnair_select_slow(void);
static inline void alnair_select(void)
{
    if (UNLIKELY(alnair_device_count > 1))
        alnair_select_slow();
}
int alnair_device_index(CUdevice ordinal); /* the region index of a device ordinal as this process sees it */
void alnair_contexts_changed(void);        /* a context died: selections cached per thread are re-made */
void alnair_use_device(int index);         /* this call works on device `index` (the next hook selects again) */
static inline struct alnair_region *alnair_cur_region(void)
{
    return alnair_devices[alnair_cur].region;
}

struct alnair_region_slot *alnair_slot_slow(void);
static inline struct alnair_region_slot *alnair_slot(void)
{
    struct alnair_region_slot *s = atomic_load_explicit(&alnair_devices[alnair_cur].slot, memory_order_relaxed);
    return LIKELY(s != NULL) ? s : alnair_slot_slow();
}
/* All slots held by live processes: this process got none and is refused memory, contexts and metered launches. */
static inline int alnair_slotless(void)
{
    struct alnair_device *d = &alnair_devices[alnair_cur];
    return atomic_load_explicit(&d->slot, memory_order_relaxed) == &d->overflow;
}
struct alnair_region_slot *alnair_slot_retry(void); /* alnair_slot(), claiming a slot if one has freed up */
void alnair_region_after_fork_child(void);
uint64_t alnair_memory_used_all(void);     /* sum of memory_used over the slots, saturating */
int alnair_reclaim_dead_slots(void);        /* returns how many were reclaimed */
/* The container's turns: it may launch in [epoch + k*period + offset, + length), and at any time before
 * free_until; work may run up to spare past a window's end (nobody's time; owed back). Read under turn_seq with a
 * few tries at most (never a wait on a value the container can set); a region without a schedule, or with one no
 * agent writes, gives the cap's part of the default period. */
struct alnair_turn {
    uint64_t epoch, period, offset, length, free_until, spare;
};
void alnair_turn_read(struct alnair_turn *t);
/* Device memory charged for each context (ALNAIR_CONTEXT_BYTES, read once at init). */
#ifndef ALNAIR_DEFAULT_CONTEXT_BYTES
#define ALNAIR_DEFAULT_CONTEXT_BYTES (256ull << 20)
#endif
extern uint64_t alnair_context_bytes;

/* ---- memory.c --------------------------------------------------------------------------------------------- */
void alnair_memory_after_fork_child(void);
void alnair_graph_mem_sync(void); /* charge what the device's graph memory pool holds now */
int alnair_graph_mem_over(void);  /* graph memory exists and the container is past its limit */

/* ---- launch.c --------------------------------------------------------------------------------------------- */
void alnair_launch_after_fork_child(void);
int alnair_captures_under_way(void); /* some stream of this process is being captured */
int alnair_stream_capture_state(CUstream s, int pt); /* 1 capturing, 0 not, -1 the driver cannot tell */

/* atomics on region fields (the layout's plain integers) */
#define RLOAD(p) __atomic_load_n(&(p), __ATOMIC_ACQUIRE)
#define RSTORE(p, v) __atomic_store_n(&(p), (v), __ATOMIC_RELEASE)
#define RADD(p, v) __atomic_add_fetch(&(p), (v), __ATOMIC_ACQ_REL)
#define RSUB(p, v) __atomic_sub_fetch(&(p), (v), __ATOMIC_ACQ_REL)

/* ---- trace.c: diagnostic builds only (make CFLAGS="-O2 -DALNAIR_TRACE") ------------------------------------
 * Records of the launch path's decisions (samples, gate refusals, fence bounds) kept in memory and written to
 * $ALNAIR_TRACE_FILE at process exit; bench/turn_trace.py reads them. A normal build compiles every TRACE to nothing. */
#ifdef ALNAIR_TRACE
void alnair_trace(char kind, uint64_t a, uint64_t b, uint64_t c, uint64_t d);
#define TRACE(k, a, b, c, d) alnair_trace((k), (a), (b), (c), (d))
/* Where a launch's host time goes, summed per process (count, ns) and written to $ALNAIR_TRACE_FILE.sum at exit. */
enum alnair_probe { P_LAUNCH, P_PRE, P_CALL, P_POST, P_W_SAMPLE, P_W_INFLIGHT, P_W_GATE, P_RECORD, P_QUERY,
                    P_SAMPLE, P_FENCE, P_GATE_SLOW, P_W_DRAIN, P_W_HOLD, P_SAMPLE_IDLE, P_NPROBE };
void alnair_probe(enum alnair_probe k, uint64_t ns);
#define PROBE(k, ns) alnair_probe((k), (ns))
#define PROBE_NOW() alnair_now_ns()
#else
#define TRACE(k, a, b, c, d) ((void)0)
#define PROBE(k, ns) ((void)0)
#define PROBE_NOW() 0ull
#endif

#endif /* ALNAIR_H */
