/* The launch hooks: each capped container launches only in its turns (turns.c), charged what its launches are
 * estimated to cost (estimate.c). With no compute limit a launch only bumps the slot's launch counter (when there is
 * a region) and calls on. A process without a region slot (all held by live processes) has its metered launches
 * refused. shim/README.md ("Compute") has the rules, docs/architecture.md ("Sharing compute") why. */
#define _GNU_SOURCE
#include "launch_internal.h"

__thread struct tstate T_dev[ALNAIR_MAX_DEVICES] __attribute__((tls_model("initial-exec")));

void alnair_launch_after_fork_child(void)
{
    memset(g_dev, 0, sizeof g_dev); /* every device's */
    capture_after_fork_child();
    memset(g_streams, 0, sizeof g_streams); /* the parent's queues are not the child's */
    memset(&T, 0, sizeof T); /* the parent's events are not ours; other threads' TLS is reset by generation */
    G.valid = 0;
    T.gen = atomic_load(&alnair_hot.fork_gen);
}

/* ---- the metered path ------------------------------------------------------------------------------------------ */
struct pre {
    uint64_t key;
    uint64_t cost;
    uint64_t t_host; /* a sampled launch: when its real call began */
    CUstream stream;
    struct stream_ctr *sc;
    int pt, sampled, skip, guess;
    int idle; /* IDLE_SAMPLE: its sample's start event had run before the launch call: nothing queued ahead */
};

/* A settled kernel's periodic sample is due (SAMPLE_GAP_NS since the last one): read 1 launch in SAMPLE_EVERY. */
static inline int sample_paced(void)
{
    return alnair_now_ns() - T.last_sample_ns >= SAMPLE_GAP_NS;
}

/* 0: go on; -1: refused (this process has no region slot: its launches would be invisible to the container). */
ALNAIR_HOT_TEXT static __attribute__((noinline)) int pre_launch(struct pre *p, uintptr_t fn, uint64_t blocks,
                                                                CUstream s, int pt)
{
    unsigned gen = atomic_load_explicit(&alnair_hot.fork_gen, memory_order_relaxed);
    if (UNLIKELY(T.gen != gen)) {
        memset(&T, 0, sizeof T);
        G.valid = 0;
        T.gen = gen;
    }
    if (UNLIKELY(alnair_slot() == NULL || (alnair_slotless() && (alnair_slot_retry(), alnair_slotless()))))
        return -1; /* no slot yet: a slot that has freed up since is claimed here */
    unsigned cls = grid_class(blocks);
    p->key = est_key(fn, cls);
    p->stream = s;
    p->pt = pt;
    p->sampled = 0;
    p->idle = 0;
    p->guess = 0;
    p->skip = capturing(s, pt);
    if (p->skip)
        return 0;
    struct est *e = est_lookup(p->key);
    uint64_t est = e ? atomic_load_explicit(&e->ns, memory_order_relaxed) : 0, near = 0;
    int settling = e != NULL && atomic_load_explicit(&e->samples, memory_order_relaxed) < FIRST_SAMPLES;
    if (est == 0) {
        p->guess = 1;
        near = est_neighbour(fn, cls);
        if (e == NULL)
            est_insert(p->key);
    }
    p->cost = est ? est : near ? near : atomic_load_explicit(&alnair_hot.guess_ns, memory_order_relaxed);
    int quiet = queries_ok();
    if (quiet && est == 0 && near == 0 && T.s_busy && sample_first(p->key))
        wait_sample();
    /* under a lease (the last gate's yes) its own bound: what is queued when it ends runs into a newcomer's turn */
    uint64_t inflight = UNLIKELY(G.free_until != 0 && G.free_until != UINT64_MAX) ? LEASE_INFLIGHT_NS : INFLIGHT_MAX_NS;
    if (quiet && T.fcount > 0 && T.charged - T.completed_charged > inflight)
        wait_inflight(inflight, NFENCE);
    p->sc = stream_find(s, pt);
    turn_gate(p->cost, p->sc, s, pt); /* last: nothing sleeps between the gate's yes and the launch */
    T.launches++;
    if (quiet && T.s_busy && est == 0)
        poll_sample(); /* a new size class wants the sampler: is the sample in flight done? */
    if (quiet && !T.s_busy && (est == 0 || settling || (T.launches % SAMPLE_EVERY == 0 && sample_paced())) &&
        ensure_ctx() == 0 && get_event(&T.s_start) == 0 && get_event(&T.s_end) == 0 &&
        record(T.s_start, s, pt) == 0) {
        p->sampled = 1;
        p->t_host = alnair_now_ns();
        /* asked before the launch: a start that had run only by the launch's return may have waited behind work
         * queued ahead (a launch call blocked on a full queue while it drained), and its sample is the GPU's */
        p->idle = IDLE_SAMPLE && query(T.s_start) == CUDA_SUCCESS;
        if (est != 0 && !settling)
            T.last_sample_ns = p->t_host;
        PROBE(P_SAMPLE, 0);
    }
    return 0;
}

ALNAIR_HOT_TEXT static __attribute__((noinline)) void post_launch(struct pre *p, CUresult rc)
{
    count_launch();
    if (p->skip)
        return;
    struct stream_ctr *sc = p->sc;
    if (rc != CUDA_SUCCESS) {
        if (sc != NULL) /* nothing was queued */
            atomic_fetch_sub_explicit(&sc->vft, p->cost, memory_order_relaxed);
        return;
    }
    account(p->cost);
    if (sc != NULL)
        atomic_fetch_add_explicit(&sc->launches, 1, memory_order_relaxed);
    T.done++;
    uint64_t t_call = p->sampled && p->idle ? alnair_now_ns() : 0; /* the launch call returned */
    if (p->sampled && record(T.s_end, p->stream, p->pt) == 0) {
        T.s_busy = 1;
        T.s_host = alnair_now_ns() - p->t_host;
        T.s_idle = t_call != 0 ? t_call - p->t_host : 0;
        T.s_due = POLL_WHEN_DUE && sc != NULL ? atomic_load_explicit(&sc->vft, memory_order_relaxed) : 0;
        T.s_ahead = 0;
        T.s_key = p->key;
        T.s_cost = p->cost;
        T.s_guess = p->guess;
        T.s_idx = T.done;
    } else if (p->guess) {
        if (T.s_busy)
            T.s_ahead++;
        if (T.npend == NPEND) /* full: the oldest is left to the fences' true-up */
            memmove(&T.pend[0], &T.pend[1], (NPEND - 1) * sizeof T.pend[0]);
        else
            T.npend++;
        T.pend[T.npend - 1].key = p->key;
        T.pend[T.npend - 1].cost = p->cost;
        T.pend[T.npend - 1].idx = T.done;
    }
    T.charged += p->cost;
    T.since_fence++;
    if (!queries_ok())
        return;
    if (UNLIKELY(RLOAD(alnair_cur_region()->agent.hold_mask) != 0)) {
        int chunk = HOLD_CHUNK && !hold_free_short(p->cost);
        if (chunk)
            T.q_acc += p->cost;
        if (p->cost >= HOLD_EVENT_MIN_NS || (chunk && T.q_acc >= (T.q_chunk ? T.q_chunk : HOLD_EVENT_MIN_NS))) {
            T.q_acc = 0;
            hold_mark(p->stream, p->pt, p->cost);
        }
    }
    if (T.charged - T.last_fence_charged >= FENCE_EVERY_NS)
        record_fence(p->stream, p->pt, sc);
    else if (T.since_fence >= FENCE_EVERY) {
        if (alnair_now_ns() - T.last_fence_ns >= FENCE_GAP_NS)
            record_fence(p->stream, p->pt, sc);
        else
            T.since_fence = 0; /* looked at again FENCE_EVERY launches on: a clock read per launch costs too */
    }
    if (T.s_busy && (T.launches & POLL_EVERY_MASK) == 0 && (!POLL_WHEN_DUE || alnair_now_ns() >= T.s_due))
        poll_sample();
}

#define LAUNCH_BODY(name, key, blocks, stream, pt, call)                  \
    do {                                                                  \
        REAL_OR_FAIL(fn, name);                                           \
        if (LIKELY(!metered())) {                                         \
            count_launch();                                               \
            return call;                                                  \
        }                                                                 \
        struct pre p_;                                                    \
        uint64_t t0_ = PROBE_NOW();                                       \
        if (pre_launch(&p_, (uintptr_t)(key), (blocks), (stream), (pt)) != 0) \
            return CUDA_ERROR_OUT_OF_MEMORY;                              \
        uint64_t t1_ = PROBE_NOW();                                       \
        CUresult rc_ = call;                                              \
        uint64_t t2_ = PROBE_NOW();                                       \
        post_launch(&p_, rc_);                                            \
        PROBE(P_PRE, t1_ - t0_);                                          \
        PROBE(P_CALL, t2_ - t1_);                                         \
        PROBE(P_POST, PROBE_NOW() - t2_);                                 \
        PROBE(P_LAUNCH, PROBE_NOW() - t0_);                               \
        (void)t0_, (void)t1_, (void)t2_;                                  \
        return rc_;                                                       \
    } while (0)

#define BLOCKS(x, y, z) ((uint64_t)(x) * (uint64_t)(y) * (uint64_t)(z))

#define KARGS f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream
#define KPARAMS                                                                                                \
    CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
        unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream

ALNAIR_HOT_TEXT ALNAIR_API CUresult cuLaunchKernel(KPARAMS, void **kernelParams, void **extra)
{
    LAUNCH_BODY(cuLaunchKernel, f, BLOCKS(gridDimX, gridDimY, gridDimZ), hStream, 0, fn(KARGS, kernelParams, extra));
}

ALNAIR_HOT_TEXT ALNAIR_API CUresult cuLaunchKernel_ptsz(KPARAMS, void **kernelParams, void **extra)
{
    LAUNCH_BODY(cuLaunchKernel_ptsz, f, BLOCKS(gridDimX, gridDimY, gridDimZ), hStream, 1, fn(KARGS, kernelParams, extra));
}

ALNAIR_API CUresult cuLaunchCooperativeKernel(KPARAMS, void **kernelParams)
{
    LAUNCH_BODY(cuLaunchCooperativeKernel, f, BLOCKS(gridDimX, gridDimY, gridDimZ), hStream, 0, fn(KARGS, kernelParams));
}

ALNAIR_API CUresult cuLaunchCooperativeKernel_ptsz(KPARAMS, void **kernelParams)
{
    LAUNCH_BODY(cuLaunchCooperativeKernel_ptsz, f, BLOCKS(gridDimX, gridDimY, gridDimZ), hStream, 1, fn(KARGS, kernelParams));
}

ALNAIR_HOT_TEXT ALNAIR_API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                                      void **extra)
{
    LAUNCH_BODY(cuLaunchKernelEx, f, config ? BLOCKS(config->gridDimX, config->gridDimY, config->gridDimZ) : 0,
                config ? config->hStream : NULL, 0, fn(config, f, kernelParams, extra));
}

ALNAIR_HOT_TEXT ALNAIR_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                                           void **kernelParams, void **extra)
{
    LAUNCH_BODY(cuLaunchKernelEx_ptsz, f, config ? BLOCKS(config->gridDimX, config->gridDimY, config->gridDimZ) : 0,
                config ? config->hStream : NULL, 1, fn(config, f, kernelParams, extra));
}

/* A graph launch may make the driver reserve graph memory (memory nodes): charged after it (memory.c), and a
 * launch while graph memory has taken the container past its limit is refused. */
static CUresult graph_launch(CUgraphExec hGraphExec, CUstream hStream)
{
    LAUNCH_BODY(cuGraphLaunch, hGraphExec, 0, hStream, 0, fn(hGraphExec, hStream));
}

static CUresult graph_launch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    LAUNCH_BODY(cuGraphLaunch_ptsz, hGraphExec, 0, hStream, 1, fn(hGraphExec, hStream));
}

ALNAIR_API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    if (UNLIKELY(alnair_graph_mem_over()))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = graph_launch(hGraphExec, hStream);
    if (rc == CUDA_SUCCESS)
        alnair_graph_mem_sync();
    return rc;
}

ALNAIR_API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    if (UNLIKELY(alnair_graph_mem_over()))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = graph_launch_ptsz(hGraphExec, hStream);
    if (rc == CUDA_SUCCESS)
        alnair_graph_mem_sync();
    return rc;
}

/* The pre-CUDA 4 launches (grid from cuFuncSetBlockShape, legacy stream) and the multi-device cooperative launch
 * (charged as its first device's launch: the container's share is of one GPU). */
ALNAIR_API CUresult cuLaunch(CUfunction f)
{
    LAUNCH_BODY(cuLaunch, f, 1, NULL, 0, fn(f));
}

ALNAIR_API CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    LAUNCH_BODY(cuLaunchGrid, f, BLOCKS(grid_width > 0 ? grid_width : 1, grid_height > 0 ? grid_height : 1, 1), NULL,
                0, fn(f, grid_width, grid_height));
}

ALNAIR_API CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
{
    LAUNCH_BODY(cuLaunchGridAsync, f, BLOCKS(grid_width > 0 ? grid_width : 1, grid_height > 0 ? grid_height : 1, 1),
                hStream, 0, fn(f, grid_width, grid_height, hStream));
}

ALNAIR_API CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices,
                                                         unsigned int flags)
{
    const CUDA_LAUNCH_PARAMS *l = launchParamsList != NULL && numDevices > 0 ? &launchParamsList[0] : NULL;
    LAUNCH_BODY(cuLaunchCooperativeKernelMultiDevice, l ? l->function : NULL,
                l ? BLOCKS(l->gridDimX, l->gridDimY, l->gridDimZ) : 0, l ? l->hStream : NULL, 0,
                fn(launchParamsList, numDevices, flags));
}

