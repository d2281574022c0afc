/* Launches: each capped container launches only in its turns, and the shim knows what its launches cost.
 *
 * Turns (region.c reads them): the agent gives the container a window in a period common to its GPU; the windows of
 * one GPU's containers do not overlap. A metered launch goes on when the clock is in the window and the work this
 * thread has queued, plus this launch, is estimated to end before the window does; otherwise the thread sleeps until
 * its next window. So the turn is handed over drained: the driver never interleaves two capped contexts, and the
 * container's GPU time is its windows' time, whatever the program's shape (a loop that synchronizes, launch-bound
 * small kernels, long kernels). Where the time after its window is nobody's (turn_spare_ns: the caps leave part of
 * the period unreserved), a launch in the window may run into it, and what runs past the end is owed like an
 * overrun (a tail too short for the next launch is not lost). A kernel longer than the whole window is launched at
 * a window's start with nothing queued, and what it runs past the window's end (overrun_ns) is paid back by
 * skipping as much of the next windows (process-wide). An elastic container lent the GPU (turn_free_until_ns) launches at any time until the lease ends.
 * Each stream's queue is tracked as a virtual finish time: each launch moves it to max(it, now) + cost; a fence that
 * completes bounds it by the work charged since that fence. Work that ran longer than it was charged (a true-up or
 * a sample found it) ran past where the gate thought the queue would end: it is owed as well, like an overrun.
 *
 * Cost of a launch = the shim's estimate of its GPU time, per (CUfunction, grid class) (per CUgraphExec for graph
 * launches); the grid class is the bit length of the block count, since a kernel's time grows with its waves:
 *   - estimates live in a set-associative cache that evicts the least recently used entry of a set, so any number
 *     of distinct kernels keeps working estimates for the ones running now;
 *   - each thread keeps at most one sample in flight: an event pair around one launch (the first FIRST_SAMPLES
 *     launches of a (function, class), then 1 in SAMPLE_EVERY launches); when its end event has completed, the
 *     elapsed time updates that estimate (moving average, 1/4 weight to the new sample). A sample whose launch call
 *     held the host over SAMPLE_HOST_MAX_NS timed the host (its start event ran on an idle GPU that then waited for
 *     the launch: a first launch loading its module) and is dropped. A sample is never given up
 *     for being slow: a 300 ms kernel is measured when it ends. In its own turns a context has the GPU to itself, so
 *     the event pair times the kernel alone.
 *   - a launch with no estimate is charged a guess: the neighbouring grid class's estimate scaled by 2 (or 1/2),
 *     else the mean of recent samples (DEFAULT_COST_NS at first). When its sample completes, the difference is
 *     trued up. A launch with nothing known at all waits (at most SAMPLE_WAIT_NS) for the thread's sample in
 *     flight when that is of the same kernel, when no sample has completed yet, or when GUESS_AHEAD launches went
 *     on a guess behind it (sample_first): an unknown kernel is never queued many times on a guess, nor many
 *     kernels on a bad guess.
 *   - true-up: every FENCE_EVERY launches (or FENCE_EVERY_NS of estimated work) the thread records a fence event on
 *     the stream. When a fence was recorded while the previous fence on the same stream was still pending, the GPU
 *     ran the work between them back to back, so their elapsed time is exactly the GPU time of that work (only for
 *     intervals in which this thread made every launch on that stream, holding no launch a sample already
 *     corrected). The slot's gpu_ns counts charged time plus what true-ups found more, less what they found less.
 *   - in-flight bound: a thread never has more than INFLIGHT_MAX_NS of charged work, nor more than NFENCE fences,
 *     not yet completed by the GPU; past that it sleeps until the GPU catches up.
 * No lock anywhere on this path; wait time goes to wait_ns. Per-thread events are destroyed when the thread exits.
 * Stream capture: the driver forbids event queries while a global-mode capture is under way (any thread) or a
 * non-relaxed one in the querying thread; only then does the shim stop querying its events. Launches into a
 * capturing stream wait for no turn: the graph launch does. A capture is forgotten when its stream is no longer
 * capturing after cuStreamEndCapture, whatever that returned.
 * With no compute limit the launch only bumps the slot's launch counter (when there is a region) and calls on. A
 * process without a region slot (all held by live processes) has its metered launches refused. */
#define _GNU_SOURCE
#include <string.h>
#include <sys/prctl.h>

#include "hook_protos.h"

#define DEFAULT_COST_NS 20000ull
#define MIN_COST_NS 1000ull
#define CREDIT_MAX_NS 100000000ull /* true-up credit kept against later charges, at most */
#define NAP_MAX_NS 2000000ull      /* a thread waiting for its turn re-reads the schedule this often at least */
/* A launch whose work is estimated to end this little past the window's end still goes: otherwise a window of
 * 1 ms kernels that began a wake-up late loses its last kernel's worth every period (7 % of a 15 ms window); the
 * next container's turn starts at most this late. */
#define WINDOW_SLACK_NS 200000ull
/* A thread waiting for its window sleeps until this long before the window's start and spins the rest: a sleep's
 * wake-up comes tens of microseconds late on a VM, and every window would begin that late (a turn's start must not
 * wait on a wake-up). At most this much spinning per window per waiting thread. */
#ifndef WAKE_EARLY_NS
#define WAKE_EARLY_NS 100000ull
#endif
/* Polling a drain (the gate measures what is queued instead of trusting its estimate): first nap, and at most. */
#define DRAIN_NAP_MIN_NS 10000ull
#define DRAIN_NAP_MAX_NS 500000ull
/* Overridable for diagnostic builds only (make CFLAGS="-O2 -DSAMPLE_EVERY=4096u ..."): bench/metering_cost.py */
/* Each event the shim records costs a real driver ~2 us: at 1 in 256 launches (and 3 events per 256) the metered
 * path pays ~25 ns per launch for them; a kernel's estimate is taken at once from its first sample and falls at
 * once to a much lower one, and a fence still comes every FENCE_EVERY_NS of charged work. */
#ifndef SAMPLE_EVERY
#define SAMPLE_EVERY 256u
#endif
#ifndef FENCE_EVERY
#define FENCE_EVERY 256u
#endif
#ifndef FENCE_EVERY_NS
#define FENCE_EVERY_NS 2000000ull
#endif
#ifndef POLL_EVERY_MASK
#define POLL_EVERY_MASK 7u /* a sample in flight is polled every 8 launches */
#endif
/* A sample whose launch call held the host this long measured the host, not the GPU: its start event ran on an idle
 * GPU that then waited for the launch (a kernel's first launch loads its module: 1-5 ms on the H200, which, taken
 * as its estimate, held every later turn of a training step back by milliseconds). It is dropped and taken again. */
#define SAMPLE_HOST_MAX_NS 50000ull
/* ... at most this many times per kernel: a kernel whose every launch holds the host that long would otherwise never
 * get an estimate, and each of its launches would wait for the sample in flight (a stream run one kernel at a time). */
#define MAX_DROPS 2u
/* A kernel's first samples are taken back to back (one per launch, as the sampler frees up), then 1 in SAMPLE_EVERY:
 * a program with many kernels would otherwise keep a kernel's first, least settled sample for thousands of launches. */
#ifndef FIRST_SAMPLES
#define FIRST_SAMPLES 4u
#endif
#define NFENCE 16u
#define NCORR 16u
#define NPEND 8u
#ifndef INFLIGHT_MAX_NS
#define INFLIGHT_MAX_NS 20000000ull
#endif
#define WAIT_GIVE_UP_NS 2000000000ull /* no GPU progress this long: stop waiting on our own events */
#define SAMPLE_WAIT_NS 200000000ull   /* an unknown launch waits this long at most for the sample in flight */
#define GUESS_AHEAD 4u                 /* ... once this many unknown launches went on a guess behind it */
#define EST_WAYS 4u
#define EST_SET_BITS 11
#define EST_SETS (1u << EST_SET_BITS)
#define CAP_SLOTS 64u
#define CAPTURE_MODE_GLOBAL 0
#define CAPTURE_MODE_RELAXED 2
#define CAPTURE_STATUS_ACTIVE 1

/* Per device (a container of several GPUs, issue 27): each GPU has its own windows, so what is owed, credited and
 * counted against them is kept per device; the names below are the calling thread's device's (alnair_cur). */
static struct {
    _Atomic int64_t credit;         /* GPU ns charged that true-ups found the GPU did not run: off later charges */
    _Atomic uint64_t debt;          /* ns of overrun past window ends not yet paid back by skipping */
    _Atomic uint64_t paid_window;   /* the window (its start, ns) whose beginning the debt was paid from */
    _Atomic uint64_t paid_shift;    /* ... and how much of it was skipped */
    _Atomic uint64_t procs_window;  /* the window whose live processes were last counted */
    _Atomic uint32_t procs;         /* ... how many processes of the container live (they share its window) */
} g_dev[ALNAIR_MAX_DEVICES];
#define g_credit (g_dev[alnair_cur].credit)
#define g_debt (g_dev[alnair_cur].debt)
#define g_paid_window (g_dev[alnair_cur].paid_window)
#define g_paid_shift (g_dev[alnair_cur].paid_shift)
#define g_procs_window (g_dev[alnair_cur].procs_window)
#define g_procs (g_dev[alnair_cur].procs)
static _Atomic int g_captures;           /* stream captures under way in this process */
static _Atomic int g_global_captures;    /* of them in global mode: no thread may query an event meanwhile */
static _Atomic uint64_t g_guess_ns = DEFAULT_COST_NS; /* a launch nothing is known about: recent samples' mean */
static _Atomic int g_guess_known;                     /* ... taken from at least one sample */

/* ---- the estimate cache ------------------------------------------------------------------------------------
 * Key: (function or graph, grid-size class = bit length of the block count): a kernel's time grows with its
 * grid, so each size class has its own estimate. Set-associative (EST_WAYS ways per set); a miss evicts the
 * least recently used way of its set, so a program with any number of distinct kernels keeps estimates for
 * the ones it runs now. Lock-free: a way is taken by CAS key -> 0, ns = 0, key = new; a reader that sees the
 * new key reads that key's ns (0 until measured). */
struct est {
    _Atomic uint64_t key;
    _Atomic uint64_t ns; /* 0: not measured yet */
    _Atomic uint32_t used;
    _Atomic uint32_t samples; /* samples taken into ns (the first FIRST_SAMPLES are taken back to back) */
    _Atomic uint32_t dropped; /* samples dropped for holding the host (at most MAX_DROPS, then taken as they are) */
    uint32_t pad;
};
static struct est g_est[EST_SETS * EST_WAYS];
static _Atomic uint32_t g_est_clock = 1;

static inline unsigned grid_class(uint64_t blocks)
{
    return blocks ? 64u - (unsigned)__builtin_clzll(blocks) : 0u; /* 0..64 */
}

static inline uint64_t est_key(uintptr_t fn, unsigned cls)
{
    uint64_t k = ((uint64_t)fn << 7) | cls;
    return k ? k : 1;
}

static inline struct est *est_set(uint64_t k)
{
    return &g_est[(size_t)((k * 0x9E3779B97F4A7C15ull) >> (64 - EST_SET_BITS)) * EST_WAYS];
}

static inline struct est *est_lookup(uint64_t k)
{
    struct est *set = est_set(k);
    for (unsigned w = 0; w < EST_WAYS; w++) {
        if (atomic_load_explicit(&set[w].key, memory_order_acquire) == k) {
            uint32_t now = atomic_load_explicit(&g_est_clock, memory_order_relaxed);
            if (atomic_load_explicit(&set[w].used, memory_order_relaxed) != now)
                atomic_store_explicit(&set[w].used, now, memory_order_relaxed);
            return &set[w];
        }
    }
    return NULL;
}

static struct est *est_insert(uint64_t k)
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
    atomic_store_explicit(&victim->used, atomic_fetch_add(&g_est_clock, 1) + 1, memory_order_relaxed);
    atomic_store_explicit(&victim->key, k, memory_order_release);
    return victim;
}

/* A size class not measured yet: its neighbours' estimate scaled by 2 (a guess, trued up by its sample). */
static uint64_t est_neighbour(uintptr_t fn, unsigned cls)
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

/* ---- captures under way ---------------------------------------------------------------------------------------
 * A table of the streams being captured (stream, mode). The driver forbids event queries while a global-mode
 * capture is under way in any thread, or a non-relaxed one in the querying thread: only then does the shim stop
 * querying its events. Relaxed and other threads' thread-local captures change nothing. A capture is forgotten
 * when the stream is no longer capturing after cuStreamEndCapture, whatever that call returned. */
struct cap {
    _Atomic uintptr_t key;
    int mode;
};
static struct cap g_caps[CAP_SLOTS];

struct fence {
    CUevent ev;
    uint64_t charged; /* this thread's charged total when recorded */
    CUstream stream;
    struct stream_ctr *sc; /* its stream's counters (NULL: the table is full) */
    int backed; /* the previous fence on this stream was still pending when this one was recorded */
    int has_seq;
    uint64_t seq;  /* launches on this stream, by every thread of the process, when recorded */
    uint64_t mine; /* this thread's launches, when recorded */
};

/* Launches per stream, by all threads: the true-up of an interval applies only when every launch on the stream in
 * it was this thread's (with two threads on one stream, each would otherwise be charged for the other's work). */
struct stream_ctr {
    _Atomic uintptr_t key;
    _Atomic uint64_t launches;
    _Atomic uint64_t vft; /* when the GPU is estimated to finish the work queued on this stream (monotonic ns) */
};
#define STREAM_SLOTS 1024u
static struct stream_ctr g_streams[STREAM_SLOTS];

static struct stream_ctr *stream_find(CUstream s, int pt)
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

struct tstate {
    unsigned gen;
    CUcontext ctx;
    uint64_t launches, done, charged, completed_charged, last_fence_charged;
    unsigned since_fence;
    CUevent s_start, s_end;
    CUevent d_ev; /* the gate's drain event: recorded when its estimate of the queue refuses a launch */
    uint64_t s_key, s_cost, s_idx, s_host;
    unsigned s_ahead; /* launches of unknown kernels charged a guess since the sample in flight was taken */
    int s_busy, s_guess;
    struct fence f[NFENCE];
    unsigned fhead, fcount;
    int prev_valid;
    unsigned prev_idx;
    uint64_t prev_charged, prev_seq, prev_mine;
    int prev_has_seq;
    CUstream prev_stream;
    uint64_t corr[NCORR]; /* launches (by T.done) whose guessed cost a sample corrected */
    unsigned ncorr;
    struct {
        uint64_t key, cost, idx;
    } pend[NPEND]; /* launches charged a guess and not sampled (the sampler was busy): settled by their key's sample */
    unsigned npend;
    int strict_captures; /* this thread's non-relaxed captures under way */
    int exit_hook;       /* the thread-exit destructor is armed */
};
static __thread struct tstate T_dev[ALNAIR_MAX_DEVICES] __attribute__((tls_model("initial-exec")));
#define T (T_dev[alnair_cur]) /* per device: its events, fences and queued work are its context's */

/* This thread's last yes of the gate, for as long as the turns it read stay (same turn_seq): the window it was in
 * (its start after any debt) or the lease, so a launch inside them needs no division nor a re-read of the turns. */
static __thread struct {
    int valid;
    uint32_t seq, procs;
    uint64_t start, end, free_until; /* end: UINT64_MAX when every moment is its turn */
    uint64_t room; /* how far past `end` a launch's work may run: the slack, or the spare time after the window */
} G_dev[ALNAIR_MAX_DEVICES] __attribute__((tls_model("initial-exec")));
#define G (G_dev[alnair_cur]) /* per device: each GPU's windows */

/* Per-thread events are destroyed when the thread exits (a pthread key destructor, armed at the first event). */
static pthread_key_t exit_key;
static pthread_once_t exit_key_once = PTHREAD_ONCE_INIT;
static int exit_key_ok;
static void drop_events(void);
static void flush_account(void);
static void thread_exit(void *arg)
{
    (void)arg;
    flush_account();
    if (T.gen == atomic_load(&alnair_fork_gen)) /* never the parent's events in a forked child */
        drop_events();
    T.exit_hook = 0;
}
/* The main thread's gathered GPU time at process exit (exit() runs no thread-key destructor for it). */
__attribute__((destructor)) static void process_exit(void)
{
    if (alnair_region != NULL && T.gen == atomic_load(&alnair_fork_gen))
        flush_account();
}

static void make_exit_key(void)
{
    exit_key_ok = pthread_key_create(&exit_key, thread_exit) == 0;
}

void alnair_launch_after_fork_child(void)
{
    memset(g_dev, 0, sizeof g_dev); /* every device's */
    atomic_store(&g_captures, 0);
    atomic_store(&g_global_captures, 0);
    memset(g_caps, 0, sizeof g_caps);
    memset(g_streams, 0, sizeof g_streams); /* the parent's queues are not the child's */
    memset(&T, 0, sizeof T); /* the parent's events are not ours; other threads' TLS is reset by generation */
    G.valid = 0;
    T.gen = atomic_load(&alnair_fork_gen);
}

static inline int metered(void)
{
    struct alnair_region *r = alnair_region;
    if (r == NULL)
        return 0;
    uint32_t c = __atomic_load_n(&r->agent.compute_limit, __ATOMIC_RELAXED);
    return c - 1u < 99u; /* 1..99 percent */
}

static inline void count_launch(void)
{
    if (alnair_region != NULL) {
        struct alnair_region_slot *s = alnair_slot();
        if (s != NULL)
            __atomic_fetch_add(&s->launches, 1, __ATOMIC_RELAXED);
    }
}

/* Event queries are allowed: no global-mode capture anywhere, no non-relaxed capture in this thread. */
static inline int queries_ok(void)
{
    return atomic_load_explicit(&g_global_captures, memory_order_relaxed) == 0 && T.strict_captures == 0;
}

/* ---- GPU time counted, turns waited for ------------------------------------------------------------------ */
#define ACCOUNT_FLUSH_NS 1000000ull /* a thread's counted GPU time reaches its slot in steps of at most this */
static __thread uint64_t T_unflushed_dev[ALNAIR_MAX_DEVICES] __attribute__((tls_model("initial-exec")));
#define T_unflushed (T_unflushed_dev[alnair_cur])

/* Add `ns` of GPU time to this process's slot, less any credit true-ups found (the counter only grows). Kept in the
 * thread until a millisecond has gathered: one shared-memory atomic per launch less on the metered path (the
 * profiler reads the slots once a second). */
static inline void account(uint64_t ns)
{
    T_unflushed += ns;
    if (UNLIKELY(T_unflushed >= ACCOUNT_FLUSH_NS))
        flush_account();
}

/* What the thread has gathered, into its process's slot (also at thread and process exit). */
static void flush_account(void)
{
    uint64_t ns = T_unflushed;
    T_unflushed = 0;
    if (ns == 0)
        return;
    int64_t c = atomic_load_explicit(&g_credit, memory_order_relaxed);
    while (c > 0 && ns > 0) {
        uint64_t take = (uint64_t)c < ns ? (uint64_t)c : ns;
        if (atomic_compare_exchange_weak(&g_credit, &c, c - (int64_t)take)) {
            ns -= take;
            break;
        }
    }
    struct alnair_region_slot *s = alnair_slot();
    if (ns > 0 && s != NULL)
        RADD(s->gpu_ns, ns);
}

static __thread int T_slack_set __attribute__((tls_model("initial-exec")));

/* `ns` of this process's work held the GPU past where its turns allowed: paid back by skipping as much of its next
 * windows (and counted in the slot's overrun_ns). */
static void owe(uint64_t ns)
{
    struct alnair_region_slot *s = alnair_slot();
    if (s != NULL)
        RADD(s->overrun_ns, ns);
    atomic_fetch_add(&g_debt, ns);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Sleep towards `until` (at most NAP_MAX_NS at a time: the caller re-reads the turns); its last WAKE_EARLY_NS are
 * spun, so the caller is back on time. */
static void nap_until(uint64_t until, uint64_t now)
{
    if (!T_slack_set) {
        /* the kernel's default 50 us timer slack would start every turn that late: 1 us (once per thread) */
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
        T_slack_set = 1;
    }
    uint64_t d = until > now ? until - now : 0;
    if (d <= WAKE_EARLY_NS) {
        while (alnair_now_ns() < until)
            cpu_relax();
        return;
    }
    d -= WAKE_EARLY_NS;
    alnair_sleep_ns(d > NAP_MAX_NS ? NAP_MAX_NS : d);
}

/* The part of the window starting at `ws` (length `len`) that the process's debt skips: taken from the debt once
 * per window, by whichever thread comes first, and decided then even when nothing is owed: debt that arises later
 * in the window (its tail run into spare time, a true-up) is the next window's to pay. Taken again mid-window, it
 * was paid from a start already past, which skipped nothing (a 90 % container with 10 ms of spare ran at 99 %). */
static uint64_t debt_shift(uint64_t ws, uint64_t len)
{
    uint64_t w = atomic_load_explicit(&g_paid_window, memory_order_acquire);
    if (w == ws)
        return atomic_load_explicit(&g_paid_shift, memory_order_relaxed);
    if (w > ws)
        return 0;
    if (!atomic_compare_exchange_strong(&g_paid_window, &w, ws))
        return atomic_load_explicit(&g_paid_shift, memory_order_relaxed);
    uint64_t debt = atomic_load_explicit(&g_debt, memory_order_relaxed), pay = debt < len ? debt : len;
    atomic_fetch_sub(&g_debt, pay);
    atomic_store_explicit(&g_paid_shift, pay, memory_order_release);
    return pay;
}

/* How many processes of the container share its windows, counted once per window (its live slots): each queues
 * on streams of its own, so a process's estimate of how long the GPU needs for what is queued is its own queue times
 * that many. */
static uint32_t window_procs(uint64_t ws)
{
    if (atomic_load_explicit(&g_procs_window, memory_order_relaxed) != ws) {
        atomic_store_explicit(&g_procs_window, ws, memory_order_relaxed);
        uint32_t n = 0;
        struct alnair_region *r = alnair_cur_region();
        for (unsigned i = 0; r != NULL && alnair_devices[alnair_cur].shared && i < ALNAIR_REGION_MAX_SLOTS; i++)
            n += RLOAD(r->slots[i].pid) > 0;
        atomic_store_explicit(&g_procs, n ? n : 1, memory_order_relaxed);
    }
    return atomic_load_explicit(&g_procs, memory_order_relaxed);
}

static void poll_fences(void);
static int drained(CUstream s, int pt, struct stream_ctr *sc, uint64_t deadline);

/* Wait until this launch of `cost` ns may go: in the container's window with room for it after what this thread
 * has queued, or under an elastic lease. Returns the ns waited. */

static inline void clear_debt(void)
{
    if (atomic_load_explicit(&g_debt, memory_order_relaxed) != 0)
        atomic_store_explicit(&g_debt, 0, memory_order_relaxed); /* owed to nobody while lent the GPU */
}

/* A launch whose work (after `backlog`) is estimated to end more than the slack past the window's end (`left` from
 * now) runs into the spare time after the window, nobody's: that part is owed, paid back by skipping as much of the
 * next windows, so the container's time stays its windows' and a tail too short for its next launch is not lost. */
static inline void owe_past(uint64_t backlog, uint64_t cost, uint64_t left)
{
    uint64_t lim = left + WINDOW_SLACK_NS, end = backlog + cost;
    if (UNLIKELY(end > lim))
        owe(end - lim - (backlog > lim ? backlog - lim : 0));
}

static uint64_t turn_gate(uint64_t cost, struct stream_ctr *sc, CUstream stream, int pt)
{
    uint64_t t0 = 0, now = alnair_now_ns();
    uint32_t seq = RLOAD(alnair_cur_region()->agent.turn_seq);
    if (LIKELY(G.valid && seq == G.seq)) {
        if (now < G.free_until) {
            clear_debt();
            goto go;
        }
        if (now >= G.start && now < G.end) {
            uint64_t vft = sc != NULL ? atomic_load_explicit(&sc->vft, memory_order_relaxed) : 0;
            uint64_t backlog = (vft > now ? vft - now : 0) * G.procs;
            if (backlog + cost <= G.end - now + G.room) {
                owe_past(backlog, cost, G.end - now);
                goto go;
            }
        }
    }
    G.valid = 0;
    PROBE(P_GATE_SLOW, 0);
    for (int polled = 0;; now = alnair_now_ns(), seq = RLOAD(alnair_cur_region()->agent.turn_seq)) {
        struct alnair_turn t;
        alnair_turn_read(&t);
        if (now < t.free_until || t.length >= t.period) {
            clear_debt();
            G.seq = seq;
            G.free_until = t.length >= t.period ? UINT64_MAX : t.free_until;
            G.start = G.end = 0;
            G.valid = 1;
            break;
        }
        if (t0 == 0)
            t0 = now;
        uint64_t epoch = t.epoch <= now ? t.epoch : 0;
        uint64_t ws = epoch + (now - epoch) / t.period * t.period + t.offset;
        if (ws > now && ws >= t.period)
            ws -= t.period; /* the window may have begun in the previous period and still run */
        if (now >= ws + t.length)
            ws += t.period;
        if (t.length == 0) {
            nap_until(now + NAP_MAX_NS, now); /* no window at all: only a lease or a new schedule lets it go */
            continue;
        }
        uint64_t we = ws + t.length, start = ws + debt_shift(ws, t.length);
        if (now < start) {
            nap_until(start, now);
            continue;
        }
        uint64_t vft = sc != NULL ? atomic_load_explicit(&sc->vft, memory_order_relaxed) : 0;
        uint32_t procs = window_procs(ws);
        uint64_t backlog = (vft > now ? vft - now : 0) * procs, left = we - now;
        uint64_t room = t.spare > WINDOW_SLACK_NS ? t.spare : WINDOW_SLACK_NS;
        if (backlog + cost <= left + room) {
            TRACE('W', now - start, left, backlog, 0); /* how late after its start a waiting thread goes on */
            owe_past(backlog, cost, left);
            G.seq = seq;
            G.procs = procs;
            G.start = start;
            G.end = we;
            G.room = room;
            G.free_until = 0;
            G.valid = 1;
            break;
        }
        TRACE('g', backlog, left, cost, (uint64_t)polled);
        if (backlog > 0 && !polled && queries_ok()) {
            poll_fences(); /* the queue may have drained further than its estimate says */
            polled = 1;
            continue;
        }
        /* Still refused on the estimate, though the launch alone would fit: measure the queue instead. Estimates
         * of a program that leaves the GPU idle between launches hold the host's launch time too (a sample's start
         * event ran on an idle GPU), so the estimated queue of a training step or batch-1 inference runs ahead of
         * the real one and the window's last milliseconds were lost every period. The drain is waited for only
         * until the window's end, when the launch would be refused anyway. */
        if (backlog > 0 && polled < 2 && cost <= left + room && queries_ok() && drained(stream, pt, sc, we)) {
            polled = 2;
            continue;
        }
        if (backlog == 0 && cost > t.length) {
            owe(cost - left); /* never fits a window: run it now with nothing queued, skip its overrun later */
            break;
        }
        nap_until(we + (t.period - t.length), now); /* the next window's start */
        polled = 0;
    }
go:
    if (sc != NULL) {
        uint64_t v = atomic_load_explicit(&sc->vft, memory_order_relaxed);
        while (!atomic_compare_exchange_weak(&sc->vft, &v, (v > now ? v : now) + cost)) {
        }
    }
    if (t0 == 0)
        return 0;
    uint64_t waited = now - t0;
    PROBE(P_W_GATE, waited);
    struct alnair_region_slot *s = alnair_slot();
    if (waited > 0 && s != NULL)
        RADD(s->wait_ns, waited);
    return waited;
}

/* ---- events of our own --------------------------------------------------------------------------------------- */
static void drop_events(void)
{
    CUevent *evs[NFENCE + 3];
    unsigned n = 0;
    for (unsigned i = 0; i < NFENCE; i++)
        evs[n++] = &T.f[i].ev;
    evs[n++] = &T.s_start;
    evs[n++] = &T.s_end;
    evs[n++] = &T.d_ev;
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

static int ensure_ctx(void)
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

static int get_event(CUevent *ev)
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

static int record(CUevent ev, CUstream s, int pt)
{
    uint64_t t = PROBE_NOW();
    int rc = (pt ? alnair_aux.cuEventRecord_ptsz : alnair_aux.cuEventRecord)(ev, s) == CUDA_SUCCESS ? 0 : -1;
    PROBE(P_RECORD, PROBE_NOW() - t);
    (void)t;
    return rc;
}

static CUresult query(CUevent ev)
{
    uint64_t t = PROBE_NOW();
    CUresult q = alnair_aux.cuEventQuery(ev);
    PROBE(P_QUERY, PROBE_NOW() - t);
    (void)t;
    return q;
}

static uint64_t elapsed_ns(CUevent a, CUevent b)
{
    float ms = 0;
    if (alnair_aux.cuEventElapsedTime == NULL || alnair_aux.cuEventElapsedTime(&ms, a, b) != CUDA_SUCCESS || !(ms >= 0))
        return UINT64_MAX;
    return (uint64_t)((double)ms * 1e6);
}

/* What the GPU ran against what was charged: more is counted now (and owed in window time), less is credited
 * against later charges. */
static void true_up(uint64_t actual, uint64_t charged)
{
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

static void poll_fences(void)
{
    while (T.fcount > 0 && queries_ok()) {
        struct fence *f = &T.f[T.fhead];
        CUresult q = query(f->ev);
        if (q == CUDA_ERROR_NOT_READY)
            break;
        if (q == CUDA_SUCCESS) {
            if (f->backed && T.prev_valid && T.prev_stream == f->stream && f->has_seq && T.prev_has_seq &&
                f->seq - T.prev_seq == f->mine - T.prev_mine && !corrected_in(T.prev_mine, f->mine)) {
                uint64_t actual = elapsed_ns(T.f[T.prev_idx].ev, f->ev);
                if (actual != UINT64_MAX) {
                    TRACE('f', actual, f->charged - T.prev_charged, f->mine - T.prev_mine, 0);
                    true_up(actual, f->charged - T.prev_charged);
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
            uint64_t bound = alnair_now_ns() + (T.charged - f->charged);
            uint64_t v = atomic_load_explicit(&f->sc->vft, memory_order_relaxed);
            while (v > bound && !atomic_compare_exchange_weak(&f->sc->vft, &v, bound)) {
            }
        }
        T.fhead = (T.fhead + 1) % NFENCE;
        T.fcount--;
    }
}

/* Whether the work queued on stream `s` completes before `deadline` (a drain event recorded now, polled in naps);
 * when it does and nothing was launched on the stream meanwhile, the stream's estimated queue is empty. */
static int drained(CUstream s, int pt, struct stream_ctr *sc, uint64_t deadline)
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
static void wait_inflight(uint64_t max_ns, unsigned max_fences)
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

static void record_fence(CUstream s, int pt, struct stream_ctr *sc)
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
    f->has_seq = sc != NULL;
    f->seq = sc ? atomic_load_explicit(&sc->launches, memory_order_relaxed) : 0;
    f->mine = T.done;
    T.fcount++;
    PROBE(P_FENCE, 0);
    T.last_fence_charged = T.charged;
    T.since_fence = 0;
}

/* The sample in flight, if its end event has completed: the estimate of its (function, size class) moves towards
 * it; when the launch was charged a guess, the difference is taken (or credited) now. A sample is never abandoned
 * because it is slow: a 300 ms kernel is measured when it ends, however long that is. */
static void poll_sample(void)
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
    if (T.s_host > SAMPLE_HOST_MAX_NS &&
        (e == NULL || atomic_fetch_add_explicit(&e->dropped, 1, memory_order_relaxed) < MAX_DROPS))
        return; /* a guessed launch among them is left to the fences' true-up */
    if (ns < MIN_COST_NS)
        ns = MIN_COST_NS;
    uint64_t g = atomic_load_explicit(&g_guess_ns, memory_order_relaxed);
    int known = atomic_load_explicit(&g_guess_known, memory_order_relaxed);
    atomic_store_explicit(&g_guess_ns, known ? (7 * g + ns) / 8 : ns, memory_order_relaxed);
    if (!known)
        atomic_store_explicit(&g_guess_known, 1, memory_order_relaxed);
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
static int sample_first(uint64_t key)
{
    return T.s_key == key || !atomic_load_explicit(&g_guess_known, memory_order_relaxed) || T.s_ahead >= GUESS_AHEAD;
}

static void wait_sample(void)
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

/* ---- the metered path ------------------------------------------------------------------------------------------ */
struct pre {
    uint64_t key;
    uint64_t cost;
    uint64_t t_host; /* a sampled launch: when its real call began */
    CUstream stream;
    struct stream_ctr *sc;
    int pt, sampled, skip, guess;
};

static int capturing(CUstream s, int pt)
{
    if (LIKELY(atomic_load_explicit(&g_captures, memory_order_relaxed) == 0))
        return 0;
    CUresult (*fn)(CUstream, CUstreamCaptureStatus *) =
        pt ? alnair_aux.cuStreamIsCapturing_ptsz : alnair_aux.cuStreamIsCapturing;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (fn == NULL || fn(s, &st) != CUDA_SUCCESS)
        return 1; /* cannot tell (e.g. the legacy stream during a capture): do not touch it */
    return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* 0: go on; -1: refused (this process has no region slot: its launches would be invisible to the container). */
static __attribute__((noinline)) int pre_launch(struct pre *p, uintptr_t fn, uint64_t blocks, CUstream s, int pt)
{
    unsigned gen = atomic_load_explicit(&alnair_fork_gen, memory_order_relaxed);
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
    p->cost = est ? est : near ? near : atomic_load_explicit(&g_guess_ns, memory_order_relaxed);
    int quiet = queries_ok();
    if (quiet && est == 0 && near == 0 && T.s_busy && sample_first(p->key))
        wait_sample();
    if (quiet && T.fcount > 0 && T.charged - T.completed_charged > INFLIGHT_MAX_NS)
        wait_inflight(INFLIGHT_MAX_NS, NFENCE);
    p->sc = stream_find(s, pt);
    turn_gate(p->cost, p->sc, s, pt); /* last: nothing sleeps between the gate's yes and the launch */
    T.launches++;
    if (quiet && T.s_busy && est == 0)
        poll_sample(); /* a new size class wants the sampler: is the sample in flight done? */
    if (quiet && !T.s_busy && (est == 0 || settling || T.launches % SAMPLE_EVERY == 0) && ensure_ctx() == 0 &&
        get_event(&T.s_start) == 0 && get_event(&T.s_end) == 0 && record(T.s_start, s, pt) == 0) {
        p->sampled = 1;
        p->t_host = alnair_now_ns();
        PROBE(P_SAMPLE, 0);
    }
    return 0;
}

static __attribute__((noinline)) void post_launch(struct pre *p, CUresult rc)
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
    if (p->sampled && record(T.s_end, p->stream, p->pt) == 0) {
        T.s_busy = 1;
        T.s_host = alnair_now_ns() - p->t_host;
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
    if (T.since_fence >= FENCE_EVERY || T.charged - T.last_fence_charged >= FENCE_EVERY_NS)
        record_fence(p->stream, p->pt, sc);
    if (T.s_busy && (T.launches & POLL_EVERY_MASK) == 0)
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

ALNAIR_API CUresult cuLaunchKernel(KPARAMS, void **kernelParams, void **extra)
{
    LAUNCH_BODY(cuLaunchKernel, f, BLOCKS(gridDimX, gridDimY, gridDimZ), hStream, 0, fn(KARGS, kernelParams, extra));
}

ALNAIR_API CUresult cuLaunchKernel_ptsz(KPARAMS, void **kernelParams, void **extra)
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

ALNAIR_API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    LAUNCH_BODY(cuLaunchKernelEx, f, config ? BLOCKS(config->gridDimX, config->gridDimY, config->gridDimZ) : 0,
                config ? config->hStream : NULL, 0, fn(config, f, kernelParams, extra));
}

ALNAIR_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                          void **extra)
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

/* ---- stream capture bookkeeping -------------------------------------------------------------------------- */
int alnair_captures_under_way(void)
{
    return atomic_load_explicit(&g_captures, memory_order_relaxed) != 0;
}

static inline uintptr_t cap_key(CUstream s, int pt)
{
    return (((uintptr_t)s << 1) | (uintptr_t)(pt != 0)) + 1;
}

static void cap_count(int mode, int d)
{
    atomic_fetch_add(&g_captures, d);
    if (mode == CAPTURE_MODE_GLOBAL)
        atomic_fetch_add(&g_global_captures, d);
    if (mode != CAPTURE_MODE_RELAXED)
        T.strict_captures += d;
}

static CUresult began(CUresult rc, CUstream s, int pt, CUstreamCaptureMode mode)
{
    if (rc != CUDA_SUCCESS || alnair_region == NULL)
        return rc;
    uintptr_t key = cap_key(s, pt);
    for (unsigned i = 0; i < CAP_SLOTS; i++) {
        uintptr_t zero = 0;
        if (atomic_compare_exchange_strong(&g_caps[i].key, &zero, key)) {
            g_caps[i].mode = mode;
            break;
        }
    }
    /* a full table (64 captures at once) still counts: the capture is then forgotten only with its end below */
    cap_count(mode, 1);
    return rc;
}

static CUresult ended(CUresult rc, CUstream s, int pt)
{
    if (alnair_region == NULL || atomic_load(&g_captures) == 0)
        return rc;
    CUresult (*is)(CUstream, CUstreamCaptureStatus *) =
        pt ? alnair_aux.cuStreamIsCapturing_ptsz : alnair_aux.cuStreamIsCapturing;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (is != NULL && is(s, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE)
        return rc; /* still capturing (e.g. ended from the wrong thread): nothing changes */
    uintptr_t key = cap_key(s, pt);
    for (unsigned i = 0; i < CAP_SLOTS; i++) {
        uintptr_t k = key;
        if (atomic_load_explicit(&g_caps[i].key, memory_order_relaxed) == key) {
            int mode = g_caps[i].mode;
            if (atomic_compare_exchange_strong(&g_caps[i].key, &k, 0))
                cap_count(mode, -1);
            return rc;
        }
    }
    return rc; /* not a capture we saw begin */
}

ALNAIR_API CUresult cuStreamBeginCapture(CUstream hStream)
{
    REAL_OR_FAIL(fn, cuStreamBeginCapture);
    return began(fn(hStream), hStream, 0, CAPTURE_MODE_GLOBAL);
}

ALNAIR_API CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    REAL_OR_FAIL(fn, cuStreamBeginCapture_ptsz);
    return began(fn(hStream), hStream, 1, CAPTURE_MODE_GLOBAL);
}

ALNAIR_API CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    REAL_OR_FAIL(fn, cuStreamBeginCapture_v2);
    return began(fn(hStream, mode), hStream, 0, mode);
}

ALNAIR_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    REAL_OR_FAIL(fn, cuStreamBeginCapture_v2_ptsz);
    return began(fn(hStream, mode), hStream, 1, mode);
}

ALNAIR_API CUresult cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,
                                                const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                                CUstreamCaptureMode mode)
{
    REAL_OR_FAIL(fn, cuStreamBeginCaptureToGraph);
    return began(fn(hStream, hGraph, dependencies, dependencyData, numDependencies, mode), hStream, 0, mode);
}

ALNAIR_API CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph,
                                                     const CUgraphNode *dependencies,
                                                     const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                                     CUstreamCaptureMode mode)
{
    REAL_OR_FAIL(fn, cuStreamBeginCaptureToGraph_ptsz);
    return began(fn(hStream, hGraph, dependencies, dependencyData, numDependencies, mode), hStream, 1, mode);
}

ALNAIR_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    REAL_OR_FAIL(fn, cuStreamEndCapture);
    return ended(fn(hStream, phGraph), hStream, 0);
}

ALNAIR_API CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    REAL_OR_FAIL(fn, cuStreamEndCapture_ptsz);
    return ended(fn(hStream, phGraph), hStream, 1);
}
