/* The turn gate: a metered launch goes on in its container's window (or under a lease) when its work fits there;
 * what ran past a window is owed and paid back by skipping as much of the next windows. Also the GPU time each
 * process counts in its slot. shim/README.md ("Compute") has the rules. */
#define _GNU_SOURCE
#include <sys/prctl.h>

#include "launch_internal.h"

struct dev_turns g_dev[ALNAIR_MAX_DEVICES];

/* ---- GPU time counted, turns waited for ------------------------------------------------------------------ */
/* What the thread has gathered, into its process's slot (also at thread and process exit). */
void flush_account(void)
{
    uint64_t ns = T.unflushed;
    T.unflushed = 0;
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
void owe(uint64_t ns)
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
void nap_until(uint64_t until, uint64_t now)
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
uint32_t window_procs(uint64_t ws)
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


/* Wait until this launch of `cost` ns may go: in the container's window with room for it after what this thread
 * has queued, or under an elastic lease. Returns the ns waited. */

static inline void clear_debt(void)
{
    if (atomic_load_explicit(&g_debt, memory_order_relaxed) != 0)
        atomic_store_explicit(&g_debt, 0, memory_order_relaxed); /* owed to nobody while lent the GPU */
    if (atomic_load_explicit(&g_lat[alnair_cur].bank, memory_order_relaxed) != 0)
        atomic_store_explicit(&g_lat[alnair_cur].bank, 0, memory_order_relaxed); /* ... nor made up */
}

/* A launch whose work (after `backlog`) is estimated to end more than the slack past the window's end (`left` from
 * now) runs into the spare time after the window, nobody's: that part is owed, paid back by skipping as much of the
 * next windows, so the container's time stays its windows' and a tail too short for its next launch is not lost. */
static inline uint64_t owed_past(uint64_t backlog, uint64_t cost, uint64_t left)
{
    uint64_t lim = left + WINDOW_SLACK_NS, end = backlog + cost;
    return UNLIKELY(end > lim) ? end - lim - (backlog > lim ? backlog - lim : 0) : 0;
}

/* How far a window runs on past its end: what this container was held back for latency containers and has not
 * made up yet (hold_back banks it), at most the spare after the window (the latency containers' own time follows
 * each window: control.py's layout). A latency container needs no window, so that time is free whenever the board
 * does not hold the container back; its cap stays a ceiling, since only time it lost is made up. */
static inline uint64_t bank_extension(uint64_t spare)
{
    uint64_t b = atomic_load_explicit(&g_lat[alnair_cur].bank, memory_order_relaxed);
    return b < spare ? b : spare;
}

/* A launch going past its window's own end runs on banked time. */
static inline void bank_spend(uint64_t now, uint64_t cost)
{
    if (UNLIKELY(now >= G.nominal_end && G.nominal_end != 0)) {
        _Atomic uint64_t *b = &g_lat[alnair_cur].bank;
        uint64_t v = atomic_load_explicit(b, memory_order_relaxed);
        while (v > 0 && !atomic_compare_exchange_weak(b, &v, v > cost ? v - cost : 0)) {
        }
    }
}

/* Wait until this launch of `cost` ns may go by the turns: in the container's window with room for it after what
 * this thread has queued, or under an elastic lease. Returns the ns waited; *now is when it may go and *owed what
 * its work will owe past the window (charged by the caller once the launch is decided). */
ALNAIR_HOT_TEXT static uint64_t windows(uint64_t cost, struct stream_ctr *sc, CUstream stream, int pt,
                                        uint64_t *now_out, uint64_t *owed)
{
    uint64_t t0 = 0, now = alnair_now_ns();
    uint32_t seq = RLOAD(alnair_cur_region()->agent.turn_seq);
    *owed = 0;
    if (LIKELY(G.valid && seq == G.seq)) {
        if (now < G.free_until) {
            clear_debt();
            goto go;
        }
        if (now >= G.start && now < G.end) {
            uint64_t vft = sc != NULL ? atomic_load_explicit(&sc->vft, memory_order_relaxed) : 0;
            uint64_t backlog = (vft > now ? vft - now : 0) * G.procs;
            if (backlog + cost <= G.end - now + G.room) {
                *owed = owed_past(backlog, cost, G.end - now);
                bank_spend(now, cost);
                goto go;
            }
        }
    }
    G.valid = 0;
    PROBE(P_GATE_SLOW, 0);
    for (int polled = 0;; now = alnair_now_ns(), seq = RLOAD(alnair_cur_region()->agent.turn_seq)) {
        /* made a latency container while it waited (its first launch came before the agent set its class): a
         * latency container has no window, so the wait would never end; turn_gate's latency gate decides now */
        if (UNLIKELY(RLOAD(alnair_cur_region()->agent.compute_class) == ALNAIR_CLASS_LATENCY))
            break;
        struct alnair_turn t;
        alnair_turn_read(&t);
        if (now < t.free_until || t.length >= t.period) {
            clear_debt();
            G.seq = seq;
            G.free_until = t.length >= t.period ? UINT64_MAX : t.free_until;
            G.start = G.end = G.nominal_end = 0;
            G.valid = 1;
            break;
        }
        if (t0 == 0)
            t0 = now;
        uint64_t epoch = t.epoch <= now ? t.epoch : 0;
        uint64_t ws = epoch + (now - epoch) / t.period * t.period + t.offset;
        if (ws > now && ws >= t.period)
            ws -= t.period; /* the window may have begun in the previous period and still run */
        uint64_t ext = bank_extension(t.spare);
        if (now >= ws + t.length + ext)
            ws += t.period;
        if (t.length == 0) {
            nap_until(now + NAP_MAX_NS, now); /* no window at all: only a lease or a new schedule lets it go */
            continue;
        }
        uint64_t we = ws + t.length + ext, start = ws + debt_shift(ws, t.length);
        if (now < start) {
            nap_until(start, now);
            continue;
        }
        uint64_t vft = sc != NULL ? atomic_load_explicit(&sc->vft, memory_order_relaxed) : 0;
        uint32_t procs = window_procs(ws);
        uint64_t backlog = (vft > now ? vft - now : 0) * procs, left = we - now;
        uint64_t spare = t.spare - ext;
        uint64_t room = spare > WINDOW_SLACK_NS ? spare : WINDOW_SLACK_NS;
        if (backlog + cost <= left + room) {
            TRACE('W', now - start, left, backlog, 0); /* how late after its start a waiting thread goes on */
            *owed = owed_past(backlog, cost, left);
            G.seq = seq;
            G.procs = procs;
            G.start = start;
            G.end = we;
            G.nominal_end = ws + t.length;
            G.room = room;
            G.free_until = 0;
            G.valid = 1;
            bank_spend(now, cost);
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
            *owed = cost - left; /* never fits a window: run it now with nothing queued, skip its overrun later */
            break;
        }
        nap_until(ws + t.period, now); /* the next window's start */
        polled = 0;
    }
go:
    *now_out = now;
    return t0 == 0 ? 0 : now - t0;
}

ALNAIR_HOT_TEXT uint64_t turn_gate(uint64_t cost, struct stream_ctr *sc, CUstream stream, int pt)
{
    struct alnair_region *r = alnair_cur_region();
    uint32_t cls = RLOAD(r->agent.compute_class), mask = RLOAD(r->agent.hold_mask);
    uint64_t now, owed = 0, waited;
    if (UNLIKELY(cls == ALNAIR_CLASS_LATENCY)) {
        waited = latency_gate(cost, sc, alnair_now_ns());
        now = alnair_now_ns();
    } else {
        waited = windows(cost, sc, stream, pt, &now, &owed);
        /* only a wait that ended without a yes (G.valid 0) can have seen the class change: no second load otherwise */
        if (UNLIKELY(!G.valid) && RLOAD(r->agent.compute_class) == ALNAIR_CLASS_LATENCY) {
            owed = mask = 0; /* it became a latency container while it waited: its own gate, no neighbour's hold */
            waited += latency_gate(cost, sc, now);
            now = alnair_now_ns();
        }
        if (UNLIKELY(mask != 0) && hold_free_short(cost))
            mask = 0;
        /* beside a latency container: hold back while it runs; the hold may outlast the window, so the turns are
         * asked again (a few times at most: a launch never waits on the board for ever) */
        for (int i = 0; UNLIKELY(mask != 0) && i < HOLD_ROUNDS; i++) {
            uint64_t t = hold_back(mask & ((1u << ALNAIR_BOARD_SLOTS) - 1u), sc, now);
            if (t == now)
                break;
            G.valid = 0;
            waited += t - now + windows(cost, sc, stream, pt, &now, &owed);
        }
        if (UNLIKELY(owed != 0))
            owe(owed);
    }
    if (sc != NULL) {
        uint64_t v = atomic_load_explicit(&sc->vft, memory_order_relaxed);
        while (!atomic_compare_exchange_weak(&sc->vft, &v, (v > now ? v : now) + cost)) {
        }
    }
    if (waited == 0)
        return 0;
    PROBE(P_W_GATE, waited);
    struct alnair_region_slot *s = alnair_slot();
    if (s != NULL)
        RADD(s->wait_ns, waited);
    return waited;
}
