/* The launch path's shared state, split by concern (shim/README.md has the rules, docs/architecture.md why):
 *   launch.c    the launch hooks and the metered path around each launch;
 *   turns.c     the turn gate (a container's windows and leases), what is owed, the GPU time counted;
 *   estimate.c  what a launch costs: the estimate cache, the shim's own events, fences, samples, true-ups,
 *               the in-flight bound and the gate's drain;
 *   capture.c   stream captures under way (no event query may break one);
 *   latency.c   the latency class: the board, a latency container's launches, its neighbours' holds.
 * Private to the shim: every name here is hidden (-fvisibility=hidden). */
#ifndef ALNAIR_LAUNCH_INTERNAL_H
#define ALNAIR_LAUNCH_INTERNAL_H
#include <string.h>

#include "hook_protos.h"

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
/* Each event call costs the H200 VM's driver ~3.3 us of host (a record, a query; bench/RESULTS.md): a sample is two
 * records and a query, a fence a record and a query. Taken 1 in SAMPLE_EVERY / FENCE_EVERY launches alone, they cost
 * a loop of 4 us launches ~80 ns a launch, 2 % of its thread. So both are paced in time too: a settled kernel's
 * sample at most once per SAMPLE_GAP_NS, a fence by count at most once per FENCE_GAP_NS (the meter's event calls
 * then take at most ~0.5 % of a launching thread, whatever its launch rate). A kernel's first samples, and a fence
 * every FENCE_EVERY_NS of charged work, are not paced: a new kernel is measured at once, and the true-up and the
 * in-flight bound see GPU-bound work as often as before. */
#ifndef SAMPLE_EVERY
#define SAMPLE_EVERY 256u
#endif
#ifndef SAMPLE_GAP_NS
#define SAMPLE_GAP_NS 4000000ull
#endif
#ifndef FENCE_EVERY
#define FENCE_EVERY 256u
#endif
#ifndef FENCE_GAP_NS
#define FENCE_GAP_NS 4000000ull
#endif
#ifndef FENCE_EVERY_NS
#define FENCE_EVERY_NS 2000000ull
#endif
#ifndef POLL_EVERY_MASK
#define POLL_EVERY_MASK 7u /* a sample in flight is polled every 8 launches */
#endif
/* Diagnostic builds (-DPOLL_WHEN_DUE=1): ... and only once the GPU is estimated to have reached it (its stream's
 * estimated queue when it was taken). Behind a deep queue a query almost always says not ready, and each costs the
 * H200 VM's driver ~3.3 us: 118 queries per 1,000 launches of back-to-back small kernels on the simulated driver
 * (bench/RESULTS.md, 2026-12-04). Not the default until the H200 says what it does to the estimates. */
#ifndef POLL_WHEN_DUE
#define POLL_WHEN_DUE 0
#endif
/* A sample whose launch call held the host this long measured the host, not the GPU: its start event ran on an idle
 * GPU that then waited for the launch (a kernel's first launch loads its module: 1-5 ms on the H200, which, taken
 * as its estimate, held every later turn of a training step back by milliseconds). It is dropped and taken again. */
#define SAMPLE_HOST_MAX_NS 50000ull
/* IDLE_SAMPLE (0, the sample as it is; diagnostic builds set 1): a sample whose start event has run when the
 * host asks, right after recording it and before the launch call, had nothing queued ahead of it: the kernel came
 * only with the host's launch call, so the host time from the start's record to the launch's return is taken off the
 * sample (at least MIN_COST_NS is left). One event query more per sample. Without it a host-bound program's GPU time
 * was counted 1.2 to 8 times what it used on the simulated driver with the H200 VM's host costs, and beside a
 * GPU-bound neighbour the profiler's one scaling factor moved the excess onto the neighbour's usage (2 us kernels
 * read 18.7 % for 5.8, the neighbour 55.1 % for 69.5: tests/test_usage_host_bound.py; bench/RESULTS.md,
 * 2026-12-07, seventeenth session). A start asked only after the launch would also read done when it had waited
 * behind work that drained while the launch call blocked on a full queue (a latency flood then took 41 % at cap
 * 30). A launch call over SAMPLE_HOST_MAX_NS keeps the drop rule: the driver may have queued the kernel early in
 * it. A kernel shorter than the end event's own record call stays counted that long (its end runs when recorded).
 * Not the default: with a core busy beside them, the 30 % container of a 30 / 50 pair of GPU-bound mixed kernels
 * (tests/shim/test_shim_compute_workloads.py, spare time) got 0.234 of the GPU in 6 of 20 runs with it, never under
 * 0.242 in 20 without; its corrected samples read 1-1.5 % under the kernels' time there (preemption after the
 * driver queued the kernel, before the launch returned). Until that is understood and a GPU has weighed it
 * (bench/gpu_idle_sample.sh), the usage it corrects stays as it was. */
#ifndef IDLE_SAMPLE
#define IDLE_SAMPLE 0
#endif
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
/* ... and under an elastic lease: a lease ends at a dispatcher tick with no notice (a newcomer's window starts at
 * once), and what the lender has queued then runs interleaved with the newcomer's first window (traced on an H100,
 * 2026-12-06: 18 ms queued, the newcomer's first 40 ms at half pace and billed for the lender's work). 6 ms keeps
 * 4-6 ms queued between fences (one every 2 ms of charged work), more than a 1 ms nap of the waiting thread. */
#ifndef LEASE_INFLIGHT_NS
#define LEASE_INFLIGHT_NS 6000000ull
#endif
_Static_assert(LEASE_INFLIGHT_NS >= 2 * FENCE_EVERY_NS && LEASE_INFLIGHT_NS <= INFLIGHT_MAX_NS,
               "LEASE_INFLIGHT_NS: at least two fences' worth of work, at most INFLIGHT_MAX_NS");
/* LATE_PUSH (diagnostic builds may set 0): a fence interval that ran late moves its stream's estimated end of queue
 * by as much (estimate.c poll_fences). */
#ifndef LATE_PUSH
#define LATE_PUSH 1
#endif
/* HEAD_GUARD_NS (diagnostic builds; 0: off): a true-up's excess measured within this long after the start of the
 * container's window is neither counted nor owed, since the previous holder's tail ran interleaved there (traced on
 * an H100, 2026-12-06: 70-80 % of each tenant's excess fell in its windows' first 15 ms). */
#ifndef HEAD_GUARD_NS
#define HEAD_GUARD_NS 0ull
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
#define ACCOUNT_FLUSH_NS 1000000ull /* a thread's counted GPU time reaches its slot in steps of at most this */

/* Per device (a container of several GPUs, issue 27): each GPU has its own windows, so what is owed, credited and
 * counted against them is kept per device; the names below are the calling thread's device's (alnair_cur). */
struct dev_turns {
    _Atomic int64_t credit;         /* GPU ns charged that true-ups found the GPU did not run: off later charges */
    _Atomic uint64_t debt;          /* ns of overrun past window ends not yet paid back by skipping */
    _Atomic uint64_t paid_window;   /* the window (its start, ns) whose beginning the debt was paid from */
    _Atomic uint64_t paid_shift;    /* ... and how much of it was skipped */
    _Atomic uint64_t procs_window;  /* the window whose live processes were last counted */
    _Atomic uint32_t procs;         /* ... how many processes of the container live (they share its window) */
};
extern struct dev_turns g_dev[ALNAIR_MAX_DEVICES];
#define g_credit (g_dev[alnair_cur].credit)
#define g_debt (g_dev[alnair_cur].debt)
#define g_paid_window (g_dev[alnair_cur].paid_window)
#define g_paid_shift (g_dev[alnair_cur].paid_shift)
#define g_procs_window (g_dev[alnair_cur].procs_window)
#define g_procs (g_dev[alnair_cur].procs)

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
    _Atomic uint32_t last;    /* the last sample taken, ns (saturated): a latency container's estimate uses it */
};
extern struct est g_est[EST_SETS * EST_WAYS];


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
            uint32_t now = atomic_load_explicit(&alnair_hot.est_clock, memory_order_relaxed);
            if (atomic_load_explicit(&set[w].used, memory_order_relaxed) != now)
                atomic_store_explicit(&set[w].used, now, memory_order_relaxed);
            return &set[w];
        }
    }
    return NULL;
}


struct fence {
    CUevent ev;
    uint64_t charged; /* this thread's charged total when recorded */
    CUstream stream;
    struct stream_ctr *sc; /* its stream's counters (NULL: the table is full) */
    int backed; /* the previous fence on this stream was still pending when this one was recorded */
    int has_seq;
    uint64_t seq;  /* launches on this stream, by every thread of the process, when recorded */
    uint64_t mine; /* this thread's launches, when recorded */
    uint64_t vft;  /* its stream's estimated end of queue when recorded: when the fence is estimated to run */
    uint64_t pushed; /* ... and its stream's `pushed` then */
};

/* Launches per stream, by all threads: the true-up of an interval applies only when every launch on the stream in
 * it was this thread's (with two threads on one stream, each would otherwise be charged for the other's work). */
struct stream_ctr {
    _Atomic uintptr_t key;
    _Atomic uint64_t launches;
    _Atomic uint64_t vft; /* when the GPU is estimated to finish the work queued on this stream (monotonic ns) */
    _Atomic uint64_t pushed; /* ns vft was moved on by fence intervals that ran late (estimate.c), in all */
};
#define STREAM_SLOTS 1024u
extern struct stream_ctr g_streams[STREAM_SLOTS];

/* A latency container's sample more than this many percent over both the sample before it of the same kernel and
 * its estimate leaves the estimate as it is (estimate.c poll_sample: another context's time slice inside it, not
 * the kernel's own jitter). LAT_SAMPLE_VS_ESTIMATE 0, a diagnostic build: over the sample before it alone, counted
 * as that one (with a slack of 0 the rule of 2026-12-04). */
#ifndef LAT_SAMPLE_SLACK_PCT
#define LAT_SAMPLE_SLACK_PCT 25ull
#endif
#ifndef LAT_SAMPLE_VS_ESTIMATE
#define LAT_SAMPLE_VS_ESTIMATE 1
#endif
/* Beside a latency container a neighbour's launch waits until a mark of its queue has run (hold_mark's events: after
 * each launch estimated at HOLD_EVENT_MIN_NS or more, and after each HOLD_EVENT_MIN_NS of shorter launches): the
 * last mark when it followed a long launch (HOLD_LONG_DEPTH), else the one HOLD_EVENT_DEPTH - 1 before the last.
 * One long launch queued: a request meets at most the neighbour's kernel running, not a second behind it (on the
 * H200 beside matmuls p99 1.2 / 1.6 ms strict at 200 / 500 per s, 3.5 / 7.7 with two; the neighbour at 69 / 65 %
 * of its pace alone, its goal 63). Two marks of short launches: a training step's host stays ahead of the GPU
 * (beside the stream 58 / 62 % of its pace with two, 53 / 55 with one, its request p99 no better with one;
 * bench/RESULTS.md, 2026-12-04). Powers of two from 1 to 16, HOLD_LONG_DEPTH at most HOLD_EVENT_DEPTH; diagnostic
 * builds may move them to weigh a neighbour's overlap against a request's wait (bench/gpu_pace_latency.sh). */
#ifndef HOLD_EVENT_DEPTH
#define HOLD_EVENT_DEPTH 2u
#endif
#ifndef HOLD_LONG_DEPTH
#define HOLD_LONG_DEPTH 1u
#endif
_Static_assert(HOLD_EVENT_DEPTH >= 1 && HOLD_EVENT_DEPTH <= 16 && (HOLD_EVENT_DEPTH & (HOLD_EVENT_DEPTH - 1)) == 0,
               "HOLD_EVENT_DEPTH: a power of two from 1 to 16");
_Static_assert(HOLD_LONG_DEPTH >= 1 && HOLD_LONG_DEPTH <= HOLD_EVENT_DEPTH, "HOLD_LONG_DEPTH: 1 to HOLD_EVENT_DEPTH");
/* This thread's last yes of the gate, for as long as the turns it read stay (same turn_seq): the window it was in
 * (its start after any debt) or the lease, so a launch inside them needs no division nor a re-read of the turns. */
struct gate {
    int valid;
    uint32_t seq, procs;
    uint64_t start, end, free_until; /* end: UINT64_MAX when every moment is its turn */
    uint64_t nominal_end; /* the window's own end (`end` may run on past it on banked time: latency.c) */
    uint64_t room; /* how far past `end` a launch's work may run: the slack, or the spare time after the window */
};

/* Its first two cache lines hold what every metered launch reads and writes, so that a launch after the program's
 * own work (which evicts them) misses on two lines of this thread's state, not five on two pages 28 KB apart (the
 * gate, the unflushed time and these fields were each apart; bench/RESULTS.md, 2026-12-07, eighteenth session). */
struct tstate {
    unsigned gen;
    unsigned since_fence;
    uint64_t launches, done, charged, completed_charged, last_fence_charged;
    int s_busy;
    unsigned fcount;
    int strict_captures; /* this thread's non-relaxed captures under way */
    unsigned npend;
    struct gate g;      /* G */
    uint64_t unflushed; /* GPU time counted and not yet added to the slot (account, flush_account) */
    CUcontext ctx;
    uint64_t last_fence_ns, last_sample_ns; /* when the last fence / settled kernel's sample was recorded */
    CUevent s_start, s_end;
    CUevent d_ev; /* the gate's drain event: recorded when its estimate of the queue refuses a launch */
    CUevent q_ev[HOLD_EVENT_DEPTH]; /* beside a latency container: its last marks (hold_mark, latency.c) */
    unsigned q_n; /* ... how many were recorded (q_ev[q_n % HOLD_EVENT_DEPTH] is the next) */
    unsigned q_done; /* ... the first q_done of them seen to have run: not queried again */
    int q_long;      /* ... the last followed a long launch (HOLD_LONG_DEPTH applies) */
    uint64_t q_acc;  /* HOLD_CHUNK: short launches' estimated work since the last mark */
    uint64_t q_w[HOLD_EVENT_DEPTH]; /* ... the work charged up to each mark (HOLD_QUEUE_WORK_NS) */
    uint64_t q_done_w; /* ... up to the last mark seen to have run */
    uint64_t q_chunk;  /* ... short launches' work between marks now (0: HOLD_EVENT_MIN_NS) */
    uint64_t s_key, s_cost, s_idx, s_host;
    uint64_t s_idle; /* IDLE_SAMPLE: the host time taken off the sample in flight (0: its GPU was busy) */
    uint64_t s_due; /* POLL_WHEN_DUE: when the sample in flight is estimated to have run */
    unsigned s_ahead; /* launches of unknown kernels charged a guess since the sample in flight was taken */
    int s_guess;
    struct fence f[NFENCE];
    unsigned fhead;
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
    int exit_hook; /* the thread-exit destructor is armed */
} __attribute__((aligned(64)));
_Static_assert(__builtin_offsetof(struct tstate, ctx) <= 128,
               "tstate: the launch path's fields in its first two lines");
extern __thread struct tstate T_dev[ALNAIR_MAX_DEVICES] __attribute__((tls_model("initial-exec")));
#define T (T_dev[alnair_cur]) /* per device: its events, fences and queued work are its context's */
#define G (T.g)               /* per device: each GPU's windows */


static inline int metered(void)
{
    struct alnair_region *r = alnair_hot.region;
    if (r == NULL)
        return 0;
    uint32_t c = __atomic_load_n(&r->agent.compute_limit, __ATOMIC_RELAXED);
    return c - 1u < 99u; /* 1..99 percent */
}

static inline void count_launch(void)
{
    if (alnair_hot.region != NULL) {
        struct alnair_region_slot *s = alnair_slot();
        if (s != NULL)
            __atomic_fetch_add(&s->launches, 1, __ATOMIC_RELAXED);
    }
}

/* Event queries are allowed: no global-mode capture anywhere, no non-relaxed capture in this thread. */
static inline int queries_ok(void)
{
    return atomic_load_explicit(&alnair_hot.global_captures, memory_order_relaxed) == 0 && T.strict_captures == 0;
}

void flush_account(void);

/* Add `ns` of GPU time to this process's slot, less any credit true-ups found (the counter only grows). Kept in the
 * thread until a millisecond has gathered: one shared-memory atomic per launch less on the metered path (the
 * profiler reads the slots once a second). */
static inline void account(uint64_t ns)
{
    T.unflushed += ns;
    if (UNLIKELY(T.unflushed >= ACCOUNT_FLUSH_NS))
        flush_account();
}


/* turns.c: the turn gate, what is owed, the GPU time counted */
void owe(uint64_t ns);
uint64_t turn_gate(uint64_t cost, struct stream_ctr *sc, CUstream stream, int pt);
void nap_until(uint64_t until, uint64_t now);
uint32_t window_procs(uint64_t ws);

/* latency.c: the latency class (docs/architecture.md, "The latency class") */
#define LAT_BUCKET_NS 10000000ull /* a rolling horizon in buckets of this (1 % of a second: the cap's resolution) */
#define LAT_BUCKETS ((unsigned)(ALNAIR_LATENCY_HORIZON_NS / LAT_BUCKET_NS))
#define LAT_NAP_NS 1000000ull      /* a latency container over its cap naps this long, then looks again */
/* A latency container's launches this close together are one request: its neighbours stay held between them (the
 * host's gaps between a request's kernels). */
#ifndef LAT_GRACE_NS
#define LAT_GRACE_NS 100000ull
#endif
/* -DLAT_WAIT_HOLD=1 (diagnostic builds): a latency container waiting for its queue (latency_wait_begin) says busy
 * until its wait returns, this long at most (a wait that never returns: a process killed in it). Off by default:
 * on the H200 beside matmuls at 500 requests/s it fell behind in 3 runs of 3 (p99 83-114 ms; in one its own cap's
 * gate waited 0.39 s) where one long launch queued without it held p99 at 2.2 ms (bench/RESULTS.md, 2026-12-04). */
#define LAT_WAIT_MAX_NS 50000000ull
#ifndef LAT_WAIT_HOLD
#define LAT_WAIT_HOLD 0
#endif
#define LAT_ANNOUNCE_NS 20000ull /* its board slot is rewritten when the end it says moves by more than this */
#ifndef LAT_BACKLOG_MAX_NS
#define LAT_BACKLOG_MAX_NS 500000ull /* ... its estimated queue counts for at most this (latency.c) */
#endif
#define LAT_COST_MAX_NS 1000000ull /* ... and its launch's estimate for at most this */
/* Beside a latency container, a container keeps at most this much estimated work queued ahead of the GPU: a request
 * arriving waits for about that and the kernel running. */
#ifndef HOLD_QUEUE_NS
#define HOLD_QUEUE_NS 100000ull
#endif
/* Beside a latency container a launch estimated this long or longer is followed by an event, and the next waits
 * until it has run (HOLD_LONG_DEPTH): one such kernel queued, whatever the estimates say (an estimate too short let
 * a matmul tenant queue milliseconds). Shorter launches get an event per this much of their estimated work, not one
 * each (an event each would cost the host microseconds a launch): HOLD_CHUNK below. */
#ifndef HOLD_EVENT_MIN_NS /* diagnostic builds may move it: -DHOLD_EVENT_MIN_NS=UINT64_MAX turns the bound off */
#define HOLD_EVENT_MIN_NS 50000ull
#endif
/* Short launches count too: an event after each HOLD_EVENT_MIN_NS of their estimated work, so the queue a request
 * meets is bounded by measurement for every shape (a host-bound neighbour's short launches otherwise queue on
 * estimates alone). On the H200 beside the training step: request p99 2.16 / 2.00 ms strict at 200 / 500 per s
 * (3.45 / 4.02 without), the neighbour's pace no lower (bench/RESULTS.md, 2026-12-04). -DHOLD_CHUNK=0: long
 * launches alone (diagnostic builds). */
#ifndef HOLD_CHUNK
#define HOLD_CHUNK 1
#endif
/* HOLD_QUEUE_WORK_NS (0: the depth rule of HOLD_EVENT_DEPTH; diagnostic builds set it): a launch waits instead for
 * the oldest mark after which at most this much estimated work is queued, so a request meets at most this much of
 * a neighbour's work ahead of the kernel it launched (0.2 ms matmuls keep one queued at 150 us; a training step's
 * shorter kernels queue behind each other). HOLD_EVENT_DEPTH is then how many marks it may look back over. */
#ifndef HOLD_QUEUE_WORK_NS
#define HOLD_QUEUE_WORK_NS 0ull
#endif
/* Short launches get a mark each HOLD_EVENT_MIN_NS of their estimated work, doubled up to HOLD_CHUNK_MAX_NS while
 * every mark asked about had run at the first question (its queue is short by measurement: a host-bound neighbour,
 * each mark costing it an event record and a query), and back at the first wait (its queue grows). */
#ifndef HOLD_CHUNK_MAX_NS
#define HOLD_CHUNK_MAX_NS HOLD_EVENT_MIN_NS
#endif
_Static_assert(HOLD_CHUNK_MAX_NS >= HOLD_EVENT_MIN_NS, "HOLD_CHUNK_MAX_NS: at least HOLD_EVENT_MIN_NS");
_Static_assert(HOLD_QUEUE_WORK_NS == 0 || (HOLD_CHUNK_MAX_NS <= HOLD_QUEUE_WORK_NS && HOLD_EVENT_DEPTH >= 4),
               "HOLD_QUEUE_WORK_NS: chunks no longer than it, and at least 4 marks to look back over");
/* HOLD_BOARD: whether a neighbour holds back while the board says a latency container runs. 1: always; 0: never
 * (the short queue alone); 2: unless its contexts are an MPS server's clients (CU_DEVICE_ATTRIBUTE_MPS_ENABLED),
 * where kernels of two containers run side by side and there is no switch between contexts to keep a request from.
 * Diagnostic builds set 0 and 2 (bench/gpu_mps.sh holds). */
#ifndef HOLD_BOARD
#define HOLD_BOARD 1
#endif
_Static_assert(HOLD_BOARD >= 0 && HOLD_BOARD <= 2, "HOLD_BOARD: 0, 1 or 2");
/* HOLD_MPS_SHORT_FREE: where the contexts are an MPS server's clients, a neighbour's launch estimated under
 * HOLD_EVENT_MIN_NS neither holds back nor is counted towards a mark; long launches keep every rule. Under MPS a
 * short kernel runs beside a request's kernels (no switch between contexts), and bounding a training step's short
 * launches cost it 7 points of its pace and gave its requests nothing; what delays a request there is a long kernel
 * resident on every SM (H100, bench/RESULTS.md 2026-12-07, fourteenth session). -DHOLD_MPS_SHORT_FREE=0: as under
 * time-slicing. */
#ifndef HOLD_MPS_SHORT_FREE
#define HOLD_MPS_SHORT_FREE 1
#endif
#define HOLD_ONCE_MAX_NS 50000000ull /* one look at the board holds a launch back this long at most */
#define HOLD_STEP_NS 200000ull       /* a held thread looks at the board again this often at least */
#define HOLD_ROUNDS 8                /* holds and turns asked again, for one launch, at most */
#define BOARD_RETRY_NS 100000000ull  /* a board not there (yet) is looked for again this often at most */
#define BANK_MAX_NS ALNAIR_LATENCY_HORIZON_NS /* time held back and banked, at most (a horizon's worth) */
struct horizon {
    _Atomic uint64_t idx[ALNAIR_LATENCY_HORIZON_NS / LAT_BUCKET_NS];
    _Atomic uint64_t ns[ALNAIR_LATENCY_HORIZON_NS / LAT_BUCKET_NS];
    _Atomic uint64_t cached_for, cached;
};
struct dev_latency {
    struct horizon spent;           /* a latency container: its GPU time (charged) over the horizon */
    struct horizon held;            /* any other: the time its launches were held back over the horizon */
    _Atomic uint64_t bank;          /* held back and not made up yet: its windows may run on this far (turns.c) */
};
extern struct dev_latency g_lat[ALNAIR_MAX_DEVICES];
void horizon_add(struct horizon *h, uint64_t now, uint64_t ns);
uint64_t horizon_sum(struct horizon *h, uint64_t now);
uint64_t latency_gate(uint64_t cost, struct stream_ctr *sc, uint64_t now);
uint64_t hold_back(uint32_t mask, struct stream_ctr *sc, uint64_t now);
int alnair_under_mps(void);        /* this device's contexts are an MPS server's clients (asked once per device) */
static inline int hold_free_short(uint64_t cost) /* HOLD_MPS_SHORT_FREE: this launch is free of the holds */
{
    return HOLD_MPS_SHORT_FREE && cost < HOLD_EVENT_MIN_NS && alnair_under_mps();
}
uint64_t latency_wait_begin(void);  /* a latency container's sync or synchronous copy: busy while it waits */
void latency_wait_end(uint64_t said);
void hold_mark(CUstream s, int pt, uint64_t cost); /* after a launch beside a latency container */

/* estimate.c: the estimate cache, the shim's own events, fences, samples, the in-flight bound */
struct est *est_insert(uint64_t k);
uint64_t est_neighbour(uintptr_t fn, unsigned cls);
struct stream_ctr *stream_find(CUstream s, int pt);
void drop_events(void);
int ensure_ctx(void);
int get_event(CUevent *ev);
int record(CUevent ev, CUstream s, int pt);
CUresult query(CUevent ev);
uint64_t elapsed_ns(CUevent a, CUevent b);
void true_up(uint64_t actual, uint64_t charged);
void poll_fences(void);
int drained(CUstream s, int pt, struct stream_ctr *sc, uint64_t deadline);
void wait_inflight(uint64_t max_ns, unsigned max_fences);
void record_fence(CUstream s, int pt, struct stream_ctr *sc);
void poll_sample(void);
int sample_first(uint64_t key);
void wait_sample(void);

/* capture.c: stream captures under way */
int capturing(CUstream s, int pt);
void capture_after_fork_child(void);

#endif /* ALNAIR_LAUNCH_INTERNAL_H */
