/* What a launch costs: estimates per (kernel, grid class) from sampled event pairs, trued up by fences; the shim's
 * own events (made per thread, destroyed at its exit); the in-flight bound; the gate's drain, which measures the
 * queue where the estimate refuses. shim/README.md ("Compute") has the rules. */
#define _GNU_SOURCE
#include "launch_internal.h"

struct est g_est[EST_SETS * EST_WAYS];
struct stream_ctr g_streams[STREAM_SLOTS];

struct est *est_insert(uint64_t k)
{
    struct est *e = est_lookup(k);
    if (e != NULL)
        return e;
    struct est *set = est_set(k), *victim = &set[0];
    for (unsigned w = 0; w < EST_WAYS; w++) {
        uint64_t key = atomic_load_explicit(&set[w].key, memory_order_relaxed);
        if (key == 0) {
            victim = &set[w];
            break;
        }
        if ((int32_t)(atomic_load_explicit(&set[w].used, memory_order_relaxed) -
                      atomic_load_explicit(&victim->used, memory_order_relaxed)) < 0)
            victim = &set[w];
    }
    uint64_t old = atomic_load_explicit(&victim->key, memory_order_relaxed);
    if (!atomic_compare_exchange_strong(&victim->key, &old, 0))
        return NULL; /* another thread took this way just now: the guess applies this once */
    atomic_store_explicit(&victim->ns, 0, memory_order_relaxed);
    atomic_store_explicit(&victim->samples, 0, memory_order_relaxed);
    atomic_store_explicit(&victim->dropped, 0, memory_order_relaxed);
    atomic_store_explicit(&victim->last, 0, memory_order_relaxed);
    atomic_store_explicit(&victim->used, atomic_fetch_add(&alnair_hot.est_clock, 1) + 1, memory_order_relaxed);
    atomic_store_explicit(&victim->key, k, memory_order_release);
    return victim;
}

/* A size class not measured yet: its neighbours' estimate scaled by 2 (a guess, trued up by its sample). */
uint64_t est_neighbour(uintptr_t fn, unsigned cls)
{
    struct est *e;
    uint64_t ns;
    if (cls > 0 && (e = est_lookup(est_key(fn, cls - 1))) != NULL &&
        (ns = atomic_load_explicit(&e->ns, memory_order_relaxed)) != 0)
        return ns * 2;
    if (cls < 64 && (e = est_lookup(est_key(fn, cls + 1))) != NULL &&
        (ns = atomic_load_explicit(&e->ns, memory_order_relaxed)) != 0)
        return ns / 2 > MIN_COST_NS ? ns / 2 : MIN_COST_NS;
    return 0;
}


ALNAIR_HOT_TEXT struct stream_ctr *stream_find(CUstream s, int pt)
{
    uintptr_t key = (((uintptr_t)s << 1) | (uintptr_t)(pt != 0)) + 1;
    size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 54) & (STREAM_SLOTS - 1);
    for (unsigned n = 0; n < 16; n++, i = (i + 1) & (STREAM_SLOTS - 1)) {
        uintptr_t k = atomic_load_explicit(&g_streams[i].key, memory_order_acquire);
        if (k == key)
            return &g_streams[i];
        if (k == 0) {
            uintptr_t zero = 0;
            if (atomic_compare_exchange_strong(&g_streams[i].key, &zero, key) || zero == key)
                return &g_streams[i];
        }
    }
    return NULL;
}

/* Per-thread events are destroyed when the thread exits (a pthread key destructor, armed at the first event). */
static pthread_key_t exit_key;
static pthread_once_t exit_key_once = PTHREAD_ONCE_INIT;
static int exit_key_ok;
static void thread_exit(void *arg)
{
    (void)arg;
    flush_account();
    if (T.gen == atomic_load(&alnair_hot.fork_gen)) /* never the parent's events in a forked child */
        drop_events();
    T.exit_hook = 0;
}
/* The main thread's gathered GPU time at process exit (exit() runs no thread-key destructor for it). */
__attribute__((destructor)) static void process_exit(void)
{
    if (alnair_hot.region != NULL && T.gen == atomic_load(&alnair_hot.fork_gen))
        flush_account();
}

static void make_exit_key(void)
{
    exit_key_ok = pthread_key_create(&exit_key, thread_exit) == 0;
}

/* ---- events of our own --------------------------------------------------------------------------------------- */
void drop_events(void)
{
    CUevent *evs[NFENCE + 3 + HOLD_EVENT_DEPTH];
    unsigned n = 0;
    for (unsigned i = 0; i < NFENCE; i++)
        evs[n++] = &T.f[i].ev;
    evs[n++] = &T.s_start;
    evs[n++] = &T.s_end;
    evs[n++] = &T.d_ev;
    for (unsigned i = 0; i < HOLD_EVENT_DEPTH; i++)
        evs[n++] = &T.q_ev[i];
    T.q_n = 0;
    T.q_done = 0;
    T.q_long = 0;
    T.q_done_w = 0;
    T.q_chunk = 0;
    for (unsigned i = 0; i < n; i++) {
        if (*evs[i] != NULL && alnair_aux.cuEventDestroy != NULL)
            alnair_aux.cuEventDestroy(*evs[i]);
        *evs[i] = NULL;
    }
    T.fcount = T.fhead = 0;
    T.s_busy = 0;
    T.prev_valid = 0;
    T.completed_charged = T.charged;
}

int ensure_ctx(void)
{
    CUcontext c = NULL;
    if (alnair_aux.cuCtxGetCurrent == NULL || alnair_aux.cuEventCreate == NULL || alnair_aux.cuEventQuery == NULL ||
        alnair_aux.cuEventRecord == NULL || alnair_aux.cuCtxGetCurrent(&c) != CUDA_SUCCESS || c == NULL)
        return -1;
    if (c != T.ctx) {
        drop_events();
        T.ctx = c;
    }
    return 0;
}

int get_event(CUevent *ev)
{
    if (*ev != NULL)
        return 0;
    if (!T.exit_hook) {
        pthread_once(&exit_key_once, make_exit_key);
        if (!exit_key_ok || pthread_setspecific(exit_key, &T) != 0)
            return -1; /* an event this thread could not give back at exit: make none */
        T.exit_hook = 1;
    }
    return alnair_aux.cuEventCreate(ev, CU_EVENT_DEFAULT) == CUDA_SUCCESS ? 0 : -1;
}

int record(CUevent ev, CUstream s, int pt)
{
    uint64_t t = PROBE_NOW();
    int rc = (pt ? alnair_aux.cuEventRecord_ptsz : alnair_aux.cuEventRecord)(ev, s) == CUDA_SUCCESS ? 0 : -1;
    PROBE(P_RECORD, PROBE_NOW() - t);
    (void)t;
    return rc;
}

CUresult query(CUevent ev)
{
    uint64_t t = PROBE_NOW();
    CUresult q = alnair_aux.cuEventQuery(ev);
    PROBE(P_QUERY, PROBE_NOW() - t);
    (void)t;
    return q;
}

uint64_t elapsed_ns(CUevent a, CUevent b)
{
    float ms = 0;
    if (alnair_aux.cuEventElapsedTime == NULL || alnair_aux.cuEventElapsedTime(&ms, a, b) != CUDA_SUCCESS || !(ms >= 0))
        return UINT64_MAX;
    return (uint64_t)((double)ms * 1e6);
}

/* What the GPU ran against what was charged: more is counted now (and owed in window time), less is credited
 * against later charges. */
void true_up(uint64_t actual, uint64_t charged)
{
#if HEAD_GUARD_NS
    if (actual > charged && G.valid && G.start != 0) {
        uint64_t now = alnair_now_ns();
        if (now >= G.start && now - G.start < HEAD_GUARD_NS) {
            TRACE('H', actual - charged, now - G.start, 0, 0);
            return;
        }
    }
#endif
    if (actual > charged) {
        account(actual - charged);
        owe(actual - charged); /* it held the GPU that much longer than the gate allowed for */
    } else if (atomic_load_explicit(&g_credit, memory_order_relaxed) < (int64_t)CREDIT_MAX_NS)
        atomic_fetch_add(&g_credit, (int64_t)(charged - actual));
}

/* A fence interval (prev, mine] holding a launch whose guess a sample already corrected is not trued up again. */
static int corrected_in(uint64_t prev, uint64_t mine)
{
    for (unsigned i = 0; i < T.ncorr && i < NCORR; i++)
        if (T.corr[i] > prev && T.corr[i] <= mine)
            return 1;
    return 0;
}

void poll_fences(void)
{
    while (T.fcount > 0 && queries_ok()) {
        struct fence *f = &T.f[T.fhead];
        uint64_t late = 0; /* the interval up to this fence ran this much longer than charged */
        CUresult q = query(f->ev);
        if (q == CUDA_ERROR_NOT_READY)
            break;
        if (q == CUDA_SUCCESS) {
            if (f->backed && T.prev_valid && T.prev_stream == f->stream && f->has_seq && T.prev_has_seq &&
                f->seq - T.prev_seq == f->mine - T.prev_mine && !corrected_in(T.prev_mine, f->mine)) {
                uint64_t actual = elapsed_ns(T.f[T.prev_idx].ev, f->ev);
                if (actual != UINT64_MAX) {
                    uint64_t charged = f->charged - T.prev_charged;
                    TRACE('f', actual, charged, f->mine - T.prev_mine, 0);
                    true_up(actual, charged);
                    late = actual > charged ? actual - charged : 0;
                }
            }
            T.prev_valid = 1;
            T.prev_idx = T.fhead;
            T.prev_charged = f->charged;
            T.prev_stream = f->stream;
            T.prev_seq = f->seq;
            T.prev_mine = f->mine;
            T.prev_has_seq = f->has_seq;
        } else {
            T.prev_valid = 0;
        }
        T.completed_charged = f->charged;
        /* the work before this fence is done: when every launch on its stream since was this thread's, what is
         * queued there now is at most what this thread charged since */
        int alone = f->sc != NULL && f->has_seq &&
                    atomic_load_explicit(&f->sc->launches, memory_order_relaxed) - f->seq == T.done - f->mine;
        TRACE('b', (uint64_t)alone, f->sc ? atomic_load_explicit(&f->sc->vft, memory_order_relaxed) : 0,
              T.charged - f->charged, 0);
        if (alone) {
            uint64_t since = T.charged - f->charged, bound = alnair_now_ns() + since;
            uint64_t v = atomic_load_explicit(&f->sc->vft, memory_order_relaxed);
            /* What ran late before this fence delays what was queued after it by as much, less the idle time the
             * estimate had after it (the lag ran out there): the queue's estimated end moves with it, so the gate
             * stops queueing in time for the window's end. Without it a turn whose head ran interleaved with the
             * previous holder's tail ran its own tail as far into the next holder's window, whose head then ran
             * late in turn: the lag went round the containers (traced on an H100, bench/RESULTS.md 2026-12-07). */
            if (LATE_PUSH && late > 0 && f->vft != 0) {
                /* the queue's end had everything after the fence run back to back, with the moves made since */
                uint64_t packed = f->vft + since + (atomic_load_explicit(&f->sc->pushed, memory_order_relaxed) -
                                                    f->pushed);
                uint64_t gap = v > packed ? v - packed : 0, push = late > gap ? late - gap : 0;
                while (push > 0 && !atomic_compare_exchange_weak(&f->sc->vft, &v, v + push)) {
                }
                if (push > 0) {
                    v += push;
                    atomic_fetch_add_explicit(&f->sc->pushed, push, memory_order_relaxed);
                }
                TRACE('l', late, gap, push, 0);
            }
            while (v > bound && !atomic_compare_exchange_weak(&f->sc->vft, &v, bound)) {
            }
        }
        T.fhead = (T.fhead + 1) % NFENCE;
        T.fcount--;
    }
}

/* Whether the work queued on stream `s` completes before `deadline` (a drain event recorded now, polled in naps);
 * when it does and nothing was launched on the stream meanwhile, the stream's estimated queue is empty. */
int drained(CUstream s, int pt, struct stream_ctr *sc, uint64_t deadline)
{
    if (ensure_ctx() != 0 || get_event(&T.d_ev) != 0)
        return 0;
    uint64_t seq = sc != NULL ? atomic_load_explicit(&sc->launches, memory_order_relaxed) : 0;
    if (record(T.d_ev, s, pt) != 0)
        return 0;
    uint64_t t0 = alnair_now_ns(), nap = DRAIN_NAP_MIN_NS;
    CUresult q;
    for (uint64_t now = t0;; now = alnair_now_ns()) {
        q = query(T.d_ev);
        if (q != CUDA_ERROR_NOT_READY || now >= deadline)
            break;
        uint64_t d = deadline - now;
        alnair_sleep_ns(nap < d ? nap : d);
        nap = nap * 2 > DRAIN_NAP_MAX_NS ? DRAIN_NAP_MAX_NS : nap * 2;
    }
    uint64_t now = alnair_now_ns();
    TRACE('d', now - t0, (uint64_t)q, deadline > now ? deadline - now : 0, 0);
    PROBE(P_W_DRAIN, now - t0);
    if (q != CUDA_SUCCESS)
        return 0;
    if (sc != NULL && atomic_load_explicit(&sc->launches, memory_order_relaxed) == seq) {
        uint64_t v = atomic_load_explicit(&sc->vft, memory_order_relaxed);
        while (v > now && !atomic_compare_exchange_weak(&sc->vft, &v, now)) {
        }
    }
    return 1;
}

/* Sleep until at most `max_ns` of charged work and fewer than `max_fences` fences are pending on the GPU. */
void wait_inflight(uint64_t max_ns, unsigned max_fences)
{
    uint64_t t0 = 0, nap = 20000, progress = T.completed_charged, since = 0;
    poll_fences();
    while (T.fcount > 0 && (T.charged - T.completed_charged > max_ns || T.fcount >= max_fences) && queries_ok()) {
        uint64_t now = alnair_now_ns();
        if (t0 == 0)
            t0 = since = now;
        if (T.completed_charged != progress) {
            progress = T.completed_charged;
            since = now;
        } else if (now - since > WAIT_GIVE_UP_NS) {
            drop_events(); /* the GPU made no progress for WAIT_GIVE_UP_NS: never stall the workload on our fences */
            break;
        }
        alnair_sleep_ns(nap);
        nap = nap * 2 > 1000000 ? 1000000 : nap * 2;
        poll_fences();
    }
    if (t0 != 0) {
        struct alnair_region_slot *s = alnair_slot();
        uint64_t waited = alnair_now_ns() - t0;
        TRACE('i', waited, T.charged - T.completed_charged, T.fcount, 0);
        PROBE(P_W_INFLIGHT, waited);
        if (s != NULL)
            RADD(s->wait_ns, waited);
    }
}

void record_fence(CUstream s, int pt, struct stream_ctr *sc)
{
    if (ensure_ctx() != 0)
        return;
    wait_inflight(UINT64_MAX, NFENCE);
    if (T.fcount >= NFENCE || !queries_ok())
        return; /* a capture began while we waited: record nothing now */
    unsigned idx = (T.fhead + T.fcount) % NFENCE;
    if (T.prev_valid && T.prev_idx == idx)
        T.prev_valid = 0;
    struct fence *f = &T.f[idx];
    if (get_event(&f->ev) != 0)
        return;
    int backed = 0;
    if (T.fcount > 0) {
        struct fence *newest = &T.f[(idx + NFENCE - 1) % NFENCE];
        backed = newest->stream == s && query(newest->ev) == CUDA_ERROR_NOT_READY;
    }
    if (record(f->ev, s, pt) != 0)
        return;
    f->charged = T.charged;
    f->stream = s;
    f->sc = sc;
    f->backed = backed;
    f->vft = sc ? atomic_load_explicit(&sc->vft, memory_order_relaxed) : 0;
    f->pushed = sc ? atomic_load_explicit(&sc->pushed, memory_order_relaxed) : 0;
    f->has_seq = sc != NULL;
    f->seq = sc ? atomic_load_explicit(&sc->launches, memory_order_relaxed) : 0;
    f->mine = T.done;
    T.fcount++;
    PROBE(P_FENCE, 0);
    T.last_fence_charged = T.charged;
    T.last_fence_ns = alnair_now_ns();
    T.since_fence = 0;
}

/* The sample in flight, if its end event has completed: the estimate of its (function, size class) moves towards
 * it; when the launch was charged a guess, the difference is taken (or credited) now. A sample is never abandoned
 * because it is slow: a 300 ms kernel is measured when it ends, however long that is. */
void poll_sample(void)
{
    if (!T.s_busy || !queries_ok())
        return;
    CUresult q = query(T.s_end);
    if (q == CUDA_ERROR_NOT_READY)
        return;
    T.s_busy = 0;
    if (q != CUDA_SUCCESS)
        return;
    uint64_t ns = elapsed_ns(T.s_start, T.s_end);
    if (ns == UINT64_MAX)
        return;
    struct est *e = est_insert(T.s_key);
    /* a launch call that held the host longer is not taken off: the driver may have queued the kernel early in it
     * (the kernel then ran while the call went on), and its sample is dropped as before */
    if (T.s_idle != 0 && T.s_host <= SAMPLE_HOST_MAX_NS) { /* s_idle: 0 unless IDLE_SAMPLE found it idle */
        PROBE(P_SAMPLE_IDLE, ns < T.s_idle ? ns : T.s_idle);
        ns = ns > T.s_idle ? ns - T.s_idle : 0;
    } else if (T.s_host > SAMPLE_HOST_MAX_NS &&
               (e == NULL || atomic_fetch_add_explicit(&e->dropped, 1, memory_order_relaxed) < MAX_DROPS))
        return; /* a guessed launch among them is left to the fences' true-up */
    if (ns < MIN_COST_NS)
        ns = MIN_COST_NS;
    uint64_t g = atomic_load_explicit(&alnair_hot.guess_ns, memory_order_relaxed);
    int known = atomic_load_explicit(&alnair_hot.guess_known, memory_order_relaxed);
    atomic_store_explicit(&alnair_hot.guess_ns, known ? (7 * g + ns) / 8 : ns, memory_order_relaxed);
    if (!known)
        atomic_store_explicit(&alnair_hot.guess_known, 1, memory_order_relaxed);
    TRACE('s', ns, T.s_cost, T.s_key, (uint64_t)T.s_guess);
    if (T.s_guess) {
        true_up(ns, T.s_cost);
        T.corr[T.ncorr++ % NCORR] = T.s_idx;
    }
    for (unsigned i = 0; i < T.npend;) { /* launches of the same kernel and size that ran on a guess meanwhile */
        if (T.pend[i].key != T.s_key) {
            i++;
            continue;
        }
        true_up(ns, T.pend[i].cost);
        T.corr[T.ncorr++ % NCORR] = T.pend[i].idx;
        T.pend[i] = T.pend[--T.npend];
    }
    if (e == NULL)
        return;
    atomic_fetch_add_explicit(&e->samples, 1, memory_order_relaxed);
    uint64_t old = atomic_load_explicit(&e->ns, memory_order_relaxed);
    uint32_t prev = atomic_exchange_explicit(&e->last, ns < UINT32_MAX ? (uint32_t)ns : UINT32_MAX,
                                             memory_order_relaxed);
    /* A latency container's GPU time over its horizon is what its estimates say (latency_gate), and its samples
     * are the ones taken beside other contexts' work: a request's first kernel runs while the neighbours' bounded
     * queue still does, time-sliced, and reads long. Time-slicing only ever lengthens a sample, so a sample over
     * both the one before it and the estimate by more than LAT_SAMPLE_SLACK_PCT leaves the estimate as it is: one
     * slice seen is ignored, a kernel that really got slower is followed a sample later (its previous sample was
     * long too). The flood at cap 30 got 28.9 % of the GPU beside another context's slices without this (tests/shim).
     * Against both, with slack: counting every sample as the lower of it and the one before (2026-12-04) charged a
     * kernel whose own time varies the lower of every two, which let a flood take 34 % of an H100 at cap 30. */
    struct alnair_region *r = alnair_cur_region();
    if (prev != 0 && old != 0 && 100 * ns > (100 + LAT_SAMPLE_SLACK_PCT) * (uint64_t)prev &&
        (!LAT_SAMPLE_VS_ESTIMATE || 100 * ns > (100 + LAT_SAMPLE_SLACK_PCT) * old) && r != NULL &&
        RLOAD(r->agent.compute_class) == ALNAIR_CLASS_LATENCY)
        ns = LAT_SAMPLE_VS_ESTIMATE ? old : prev;
    /* a moving average, except that a sample far under the estimate is taken at once: an estimate made while the
     * GPU was shared with another context holds its slices, and would keep this one stopping early in its turns */
    atomic_store_explicit(&e->ns, old && !T.s_guess && 10 * ns > 7 * old ? (3 * old + ns) / 4 : ns,
                          memory_order_relaxed);
}

/* A launch of a kernel nothing is known about waits for the sample in flight (rather than go on the guess) when that
 * sample is of the same kernel (never queue an unmeasured kernel twice), when no sample has completed yet (the guess
 * is only DEFAULT_COST_NS), or when GUESS_AHEAD launches already went on a guess behind it (a bad guess queues that
 * few). Otherwise it goes on the guess, the mean of recent samples, trued up by its own sample or a fence: a program
 * of thousands of distinct kernels, each launched about once, ran one kernel at a time waiting on each one's
 * predecessor (17.7 % of the GPU at a 30 % cap on the H200). */
int sample_first(uint64_t key)
{
    return T.s_key == key || !atomic_load_explicit(&alnair_hot.guess_known, memory_order_relaxed) ||
           T.s_ahead >= GUESS_AHEAD;
}

void wait_sample(void)
{
    uint64_t t0 = alnair_now_ns(), nap = 10000;
    poll_sample();
    /* bounded: work queued ahead of the sample may wait on something this thread has yet to do */
    while (T.s_busy && alnair_now_ns() - t0 < SAMPLE_WAIT_NS && queries_ok()) {
        alnair_sleep_ns(nap);
        nap = nap * 2 > 1000000 ? 1000000 : nap * 2;
        poll_sample();
    }
    struct alnair_region_slot *s = alnair_slot();
    uint64_t waited = alnair_now_ns() - t0;
    TRACE('w', waited, T.s_key, 0, 0);
    PROBE(P_W_SAMPLE, waited);
    if (s != NULL)
        RADD(s->wait_ns, waited);
}

