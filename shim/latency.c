/* The latency class (docs/architecture.md, "The latency class"). A latency container launches at once, whatever
 * turn it is, and says on its GPU's board until when its queued work should run; its GPU time is held to its cap
 * over ALNAIR_LATENCY_HORIZON_NS. Every other capped container of the GPU (hold_mask) holds its launches back while
 * the board says so, within its hold_pct of the same horizon whatever the board says, and keeps at most
 * HOLD_QUEUE_NS of work queued ahead of the GPU, so a request waits for about one of its kernels at most. The time
 * it was held is banked: its windows run on that far into the spare after them, where no window is (turns.c). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "launch_internal.h"

struct dev_latency g_lat[ALNAIR_MAX_DEVICES];

/* ---- a rolling second: buckets of LAT_BUCKET_NS ----------------------------------------------------------- */
void horizon_add(struct horizon *h, uint64_t now, uint64_t ns)
{
    uint64_t i = now / LAT_BUCKET_NS;
    unsigned k = (unsigned)(i % LAT_BUCKETS);
    uint64_t have = atomic_load_explicit(&h->idx[k], memory_order_acquire);
    if (have != i && atomic_compare_exchange_strong(&h->idx[k], &have, i))
        atomic_store_explicit(&h->ns[k], 0, memory_order_release); /* a bucket a horizon old starts again */
    atomic_fetch_add_explicit(&h->ns[k], ns, memory_order_relaxed);
}

/* What was added over the last horizon (the full buckets before this one are summed once per bucket). */
uint64_t horizon_sum(struct horizon *h, uint64_t now)
{
    uint64_t i = now / LAT_BUCKET_NS;
    if (atomic_load_explicit(&h->cached_for, memory_order_acquire) != i) {
        uint64_t s = 0;
        for (unsigned j = 1; j < LAT_BUCKETS && j <= i; j++) {
            unsigned k = (unsigned)((i - j) % LAT_BUCKETS);
            if (atomic_load_explicit(&h->idx[k], memory_order_acquire) == i - j)
                s += atomic_load_explicit(&h->ns[k], memory_order_relaxed);
        }
        atomic_store_explicit(&h->cached, s, memory_order_relaxed);
        atomic_store_explicit(&h->cached_for, i, memory_order_release);
    }
    unsigned k = (unsigned)(i % LAT_BUCKETS);
    uint64_t cur = atomic_load_explicit(&h->idx[k], memory_order_acquire) == i
                       ? atomic_load_explicit(&h->ns[k], memory_order_relaxed)
                       : 0;
    return atomic_load_explicit(&h->cached, memory_order_relaxed) + cur;
}

/* ---- the board -------------------------------------------------------------------------------------------- */
/* Any container of the GPU can write the board file, and so cut it short: a mapping past a file's end faults
 * (SIGBUS) on the next read. A fault inside a board is answered by mapping zeros over it (an idle board: nobody
 * holds back for it, nothing anyone writes there counts) and mapping the file again later; any other goes to
 * whatever handled SIGBUS before. */
static struct sigaction prev_bus;
static pthread_once_t bus_once = PTHREAD_ONCE_INIT;

static void on_bus(int sig, siginfo_t *si, void *uc)
{
    for (int i = 0; i < ALNAIR_MAX_DEVICES; i++) {
        struct alnair_board *b = atomic_load_explicit(&alnair_devices[i].board, memory_order_relaxed);
        char *p = (char *)b, *a = si != NULL ? (char *)si->si_addr : NULL;
        if (b != NULL && a >= p && a < p + ALNAIR_BOARD_SIZE) {
            mmap(b, ALNAIR_BOARD_SIZE, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            atomic_store_explicit(&alnair_devices[i].board_tried, 0, memory_order_relaxed); /* a new map, later */
            atomic_store_explicit(&alnair_devices[i].board_lost, 1, memory_order_relaxed);
            return;
        }
    }
    if (prev_bus.sa_flags & SA_SIGINFO) {
        prev_bus.sa_sigaction(sig, si, uc);
    } else if (prev_bus.sa_handler != SIG_DFL && prev_bus.sa_handler != SIG_IGN) {
        prev_bus.sa_handler(sig);
    } else {
        sigaction(SIGBUS, &prev_bus, NULL); /* the default: the fault comes again and ends the process */
    }
}

static void arm_bus(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_bus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &prev_bus);
}

static struct alnair_board *board_map(const char *path)
{
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != (off_t)ALNAIR_BOARD_SIZE) {
        close(fd);
        return NULL;
    }
    pthread_once(&bus_once, arm_bus);
    void *m = mmap(NULL, ALNAIR_BOARD_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return NULL;
    struct alnair_board *b = m;
    if (RLOAD(b->header.magic) != ALNAIR_BOARD_MAGIC || RLOAD(b->header.version) != ALNAIR_BOARD_VERSION) {
        munmap(m, ALNAIR_BOARD_SIZE);
        return NULL;
    }
    return b;
}

struct alnair_board *alnair_board_get(void)
{
    struct alnair_device *d = &alnair_devices[alnair_cur];
    struct alnair_board *b = atomic_load_explicit(&d->board, memory_order_acquire);
    if (LIKELY(b != NULL && !atomic_load_explicit(&d->board_lost, memory_order_relaxed)))
        return b;
    if (!d->shared || d->board_path[0] == '\0')
        return NULL;
    uint64_t now = alnair_now_ns(), tried = atomic_load_explicit(&d->board_tried, memory_order_relaxed);
    if (tried != 0 && now - tried < BOARD_RETRY_NS)
        return NULL;
    if (!atomic_compare_exchange_strong(&d->board_tried, &tried, now))
        return NULL; /* another thread is trying */
    struct alnair_board *nb = board_map(d->board_path);
    if (nb == NULL)
        return NULL;
    /* a lost board's zero page stays mapped (a reader may still hold it): 576 bytes, once per loss */
    atomic_store_explicit(&d->board, nb, memory_order_release);
    atomic_store_explicit(&d->board_lost, 0, memory_order_relaxed);
    return nb;
}

/* ---- the latency container -------------------------------------------------------------------------------- */
/* Its launch goes now unless its GPU time over the horizon would pass its cap (its processes' shares of it): then
 * it waits for the horizon to move on. Its board slot then says until when its queued work should run. */
uint64_t latency_gate(uint64_t cost, struct stream_ctr *sc, uint64_t now)
{
    struct alnair_region *r = alnair_cur_region();
    struct dev_latency *L = &g_lat[alnair_cur];
    uint32_t cap = RLOAD(r->agent.compute_limit), procs = window_procs(now / LAT_BUCKET_NS * LAT_BUCKET_NS);
    uint64_t budget = ALNAIR_LATENCY_HORIZON_NS / 100u * (cap < 100u ? cap : 100u) / (procs ? procs : 1u);
    uint64_t t0 = now;
    for (;;) {
        uint64_t used = horizon_sum(&L->spent, now);
        /* a launch larger than the whole budget goes once the horizon is empty (never a stall) */
        if (used + cost <= budget || used == 0)
            break;
        TRACE('L', used, budget, cost, 0);
        alnair_sleep_ns(LAT_NAP_NS);
        now = alnair_now_ns();
        if (RLOAD(r->agent.compute_class) != ALNAIR_CLASS_LATENCY)
            break; /* the agent took the class away: the turns rule from the next launch */
    }
    horizon_add(&L->spent, now, cost);
    /* What it announces is bounded: its estimates hold the neighbours' slices where a sample ran beside their work
     * (a 20 us kernel sampled across a neighbour's 200 us matmul), and an estimated queue of milliseconds held the
     * neighbours that long after each request, spent their hold_pct, and left the next requests unprotected. */
    uint64_t vft = sc != NULL ? atomic_load_explicit(&sc->vft, memory_order_relaxed) : 0;
    uint64_t backlog = vft > now ? vft - now : 0;
    uint64_t until = now + (backlog < LAT_BACKLOG_MAX_NS ? backlog : LAT_BACKLOG_MAX_NS) +
                     (cost < LAT_COST_MAX_NS ? cost : LAT_COST_MAX_NS) + LAT_GRACE_NS;
    struct alnair_board *b = alnair_board_get();
    uint32_t k = RLOAD(r->agent.board_slot);
    if (b != NULL && k < ALNAIR_BOARD_SLOTS) {
        struct alnair_board_slot *s = &b->slots[k];
        if (RLOAD(s->busy_until_ns) + LAT_ANNOUNCE_NS < until) /* one store per request's few launches */
            RSTORE(s->busy_until_ns, until);
        RADD(s->launches, 1);
    }
    return now - t0; /* counted as a wait for its turn by the caller */
}

/* A latency container waiting for its own queue (a stream or event sync, a synchronous copy: what `.cpu()`,
 * `.item()` and a request's result wait in). What it announced at its launches is an estimate of when its queue
 * runs (latency_gate); its kernels run later than that whenever a neighbour's work queued before the request ran
 * first, and a board that lapses before the queue has run lets the neighbours queue again, so the GPU time-slices
 * the rest of the request with them (the H200's p99 of 3.3-4.2 ms beside matmuls, alone 1.4-2.1 ms). In the
 * diagnostic build -DLAT_WAIT_HOLD=1, while it waits its slot says busy (LAT_WAIT_MAX_NS at most), measured by the
 * wait itself, and once the wait returns the request's grace from then (off by default: launch_internal.h). Only
 * a wait entered while its slot says busy is announced: a sync with nothing queued, or an idle service polling,
 * holds nobody. Returns the end it wrote (0: none); latency_wait_end takes it. */
uint64_t latency_wait_begin(void)
{
    struct alnair_region *r = alnair_cur_region();
    if (!LAT_WAIT_HOLD || r == NULL || RLOAD(r->agent.compute_class) != ALNAIR_CLASS_LATENCY ||
        RLOAD(r->agent.compute_limit) - 1u >= 99u)
        return 0;
    uint32_t k = RLOAD(r->agent.board_slot);
    struct alnair_board *b = k < ALNAIR_BOARD_SLOTS ? alnair_board_get() : NULL;
    if (b == NULL)
        return 0;
    uint64_t now = alnair_now_ns(), until = now + LAT_WAIT_MAX_NS, have = RLOAD(b->slots[k].busy_until_ns);
    if (have <= now || have >= until)
        return 0;
    /* another thread's announcement that moved in between wins (it is later, or its own wait's) */
    if (!__atomic_compare_exchange_n(&b->slots[k].busy_until_ns, &have, until, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return 0;
    TRACE('w', have > now ? have - now : 0, 0, 0, 0);
    return until;
}

void latency_wait_end(uint64_t said)
{
    if (said == 0)
        return;
    struct alnair_region *r = alnair_cur_region();
    struct alnair_board *b = alnair_board_get();
    uint32_t k = r != NULL ? RLOAD(r->agent.board_slot) : ALNAIR_BOARD_SLOTS;
    if (b == NULL || k >= ALNAIR_BOARD_SLOTS)
        return;
    uint64_t expect = said;
    /* only what this wait wrote is taken back: a launch or wait of another thread since then keeps its own */
    __atomic_compare_exchange_n(&b->slots[k].busy_until_ns, &expect, alnair_now_ns() + LAT_GRACE_NS, 0,
                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* ---- its neighbours --------------------------------------------------------------------------------------- */
/* The latest end any latency container of `mask` announces (bounded: a board can say anything). */
static uint64_t board_until(struct alnair_board *b, uint32_t mask, uint64_t now)
{
    uint64_t until = 0;
    for (uint32_t k = 0; k < ALNAIR_BOARD_SLOTS; k++)
        if (mask & (1u << k)) {
            uint64_t u = RLOAD(b->slots[k].busy_until_ns);
            if (u > until)
                until = u;
        }
    return until > now + HOLD_ONCE_MAX_NS ? now + HOLD_ONCE_MAX_NS : until;
}

/* Which mark the next launch waits for (launch_internal.h): by the depth rule the last after a long launch
 * (HOLD_LONG_DEPTH), else the one HOLD_EVENT_DEPTH - 1 before it; with HOLD_QUEUE_WORK_NS the oldest after which no
 * more than that much work is queued. Returns 0 where it need not wait for one (none, or one seen to have run). */
static int mark_to_wait_for(unsigned *w)
{
    if (HOLD_QUEUE_WORK_NS != 0) {
        uint64_t W = T.charged;
        if (T.q_done != 0 && W - T.q_done_w <= HOLD_QUEUE_WORK_NS)
            return 0;
        unsigned j = T.q_n > HOLD_EVENT_DEPTH ? T.q_n - HOLD_EVENT_DEPTH : 0;
        if (j < T.q_done)
            j = T.q_done;
        while (j < T.q_n && W - T.q_w[j & (HOLD_EVENT_DEPTH - 1u)] > HOLD_QUEUE_WORK_NS)
            j++;
        *w = j;
        return j < T.q_n;
    }
    unsigned depth = T.q_long ? HOLD_LONG_DEPTH : HOLD_EVENT_DEPTH;
    /* Each query costs the H200 VM's driver ~3.3 us of host: an event seen to have run is not asked again by the
     * short launches that follow it (a training step's launches each asked, ~10 % of its step). */
    if (T.q_n < depth || T.q_done > T.q_n - depth)
        return 0;
    *w = T.q_n - depth;
    return 1;
}

/* The mark the next launch waits for has run: wait for it, measured, not estimated. Returns 1 when it waited. */
static int queue_short(uint64_t now)
{
    unsigned w;
    if (!mark_to_wait_for(&w) || !queries_ok())
        return 0;
    CUevent ev = T.q_ev[w & (HOLD_EVENT_DEPTH - 1u)];
    if (ev == NULL)
        return 0;
    CUresult q = query(ev);
    uint64_t t0 = now;
    for (; q == CUDA_ERROR_NOT_READY && now - t0 < WAIT_GIVE_UP_NS; now = alnair_now_ns()) {
        nap_until(now + DRAIN_NAP_MIN_NS, now);
        q = query(ev);
    }
    if (q != CUDA_ERROR_NOT_READY) {
        T.q_done = w + 1;
        T.q_done_w = T.q_w[w & (HOLD_EVENT_DEPTH - 1u)];
    }
    uint64_t chunk = T.q_chunk ? T.q_chunk : HOLD_EVENT_MIN_NS;
    if (now == t0) {
        T.q_chunk = chunk >= HOLD_CHUNK_MAX_NS / 2u ? HOLD_CHUNK_MAX_NS : 2u * chunk;
        return 0;
    }
    T.q_chunk = HOLD_EVENT_MIN_NS;
    TRACE('q', now - t0, 0, 0, 0);
    return 1;
}

void hold_mark(CUstream s, int pt, uint64_t cost)
{
    unsigned k = T.q_n & (HOLD_EVENT_DEPTH - 1u);
    if (ensure_ctx() != 0 || get_event(&T.q_ev[k]) != 0 || record(T.q_ev[k], s, pt) != 0)
        return;
    T.q_w[k] = T.charged;
    T.q_n++;
    T.q_long = cost >= HOLD_EVENT_MIN_NS;
}

/* This device's contexts are an MPS server's clients (asked once per device; a driver that does not know the
 * attribute, or a failed call, reads as no: the board's holds stay). */
int alnair_under_mps(void)
{
    struct alnair_device *d = &alnair_devices[alnair_cur];
    int m = atomic_load_explicit(&d->mps, memory_order_relaxed);
    if (LIKELY(m != 0))
        return m == 2;
    CUdevice dev;
    int v = 0;
    if (alnair_aux.cuCtxGetDevice == NULL || alnair_aux.cuDeviceGetAttribute == NULL ||
        alnair_aux.cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
        alnair_aux.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev) != CUDA_SUCCESS)
        v = 0;
    atomic_store_explicit(&d->mps, v == 1 ? 2 : 1, memory_order_relaxed);
    return v == 1;
}

/* Before a launch of a container beside latency containers: wait while the board says one of them runs (within
 * hold_pct of the horizon), and while this stream has more than HOLD_QUEUE_NS queued. Returns the time now; the
 * time held is counted in the slot (held_ns, holds) and, inside a window, given back at the window's end. */
uint64_t hold_back(uint32_t mask, struct stream_ctr *sc, uint64_t now)
{
    struct alnair_board *b = HOLD_BOARD == 1 || (HOLD_BOARD == 2 && !alnair_under_mps()) ? alnair_board_get() : NULL;
    struct alnair_region *r = alnair_cur_region();
    struct dev_latency *L = &g_lat[alnair_cur];
    uint64_t allow = ALNAIR_LATENCY_HORIZON_NS / 100u * RLOAD(r->agent.hold_pct), held = 0;
    for (;;) {
        uint64_t until = b != NULL ? board_until(b, mask, now) : 0;
        uint64_t step = until > now ? (until - now < HOLD_STEP_NS ? until - now : HOLD_STEP_NS) : 0;
        /* judged a step at a time: a long announcement (a latency container's wait) holds while the budget lasts */
        if (step != 0 && horizon_sum(&L->held, now) + step <= allow) {
            nap_until(now + step, now);
            uint64_t t = alnair_now_ns();
            horizon_add(&L->held, t, t - now);
            held += t - now;
            now = t;
            continue;
        }
        uint64_t vft = sc != NULL ? atomic_load_explicit(&sc->vft, memory_order_relaxed) : 0;
        if (vft > now + HOLD_QUEUE_NS) {
            nap_until(vft - HOLD_QUEUE_NS, now); /* the queue drains to the bound (not a hold: nobody asked) */
            now = alnair_now_ns();
            continue;
        }
        if (!queue_short(now))
            break;
        now = alnair_now_ns();
    }
    if (held == 0)
        return now;
    TRACE('h', held, mask, 0, 0);
    PROBE(P_W_HOLD, held);
    struct alnair_region_slot *s = alnair_slot();
    if (s != NULL) {
        RADD(s->held_ns, held);
        RADD(s->holds, 1);
    }
    uint64_t banked = atomic_fetch_add_explicit(&L->bank, held, memory_order_relaxed) + held;
    if (banked > BANK_MAX_NS)
        atomic_store_explicit(&L->bank, BANK_MAX_NS, memory_order_relaxed);
    return now;
}
