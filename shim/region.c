/* The region: the container's shared file (or, when that is refused, a private in-process stand-in built from
 * ALNAIR_MEMORY_LIMIT / ALNAIR_COMPUTE_LIMIT), slot claim, dead-slot reclaim, container-wide sums, the turns.
 *
 * Slot protocol (the shim's side of alnair_agent/region_layout.py):
 *   claim    CAS pid 0 -> -mypid (negative: being set up, the agent ignores it), write start_time and
 *            memory_used = 0, then store pid = mypid. The counters are never zeroed: a new owner continues the
 *            old owner's, so the container's sums never fall (readers take differences and see the pid change).
 *   reclaim  a slot whose owner is dead (kill(pid, 0) fails with ESRCH, a zombie, or its start time differs from
 *            /proc/<pid>/stat field 22: the pid was reused) is taken by CAS pid -> -mypid, its memory_used set to 0,
 *            then pid = 0. Done at claim time and whenever an allocation would otherwise exceed the limit.
 *   exec     a slot holding our own pid (and start time) that is not ours belongs to this process's image before
 *            exec, whose device memory died with it: reclaimed at claim time. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alnair.h"

int alnair_region_shared;
uint64_t alnair_context_bytes = ALNAIR_DEFAULT_CONTEXT_BYTES;
struct alnair_device alnair_devices[ALNAIR_MAX_DEVICES];
int alnair_device_count = 1;
__thread int alnair_cur __attribute__((tls_model("initial-exec")));
static pthread_mutex_t claim_mu = PTHREAD_MUTEX_INITIALIZER;

/* ---- environment ----------------------------------------------------------------------------------------- */
/* 1: set and well-formed; 0: unset; -1: malformed (a warning names the variable and value). */
static int env_u64(const char *var, uint64_t max, uint64_t *out)
{
    const char *s = getenv(var);
    if (s == NULL || *s == '\0')
        return 0;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-' || v > max) {
        alnair_warn("alnair: %s='%s' is not an integer in 0..%llu; that limit is not enforced", var, s,
                    (unsigned long long)max);
        return -1;
    }
    *out = v;
    return 1;
}

static uint64_t read_start_time(pid_t pid, char *state)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return 0;
    p++;
    /* after ')': field 3 (state) is token 0, field 22 (starttime) is token 19 */
    int field = 0;
    char *save = NULL;
    for (char *tok = strtok_r(p, " ", &save); tok != NULL; tok = strtok_r(NULL, " ", &save), field++) {
        if (field == 0 && state)
            *state = tok[0];
        if (field == 19)
            return strtoull(tok, NULL, 10);
    }
    return 0;
}

/* ---- opening ---------------------------------------------------------------------------------------------- */
static struct alnair_region *open_shared(const char *path, char *why, size_t whylen, int *missing)
{
    *missing = 0;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        *missing = errno == ENOENT;
        snprintf(why, whylen, "cannot open: %s", strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size != (off_t)ALNAIR_REGION_SIZE) {
        snprintf(why, whylen, "size %lld bytes, expected %u", (long long)st.st_size, ALNAIR_REGION_SIZE);
        close(fd);
        return NULL;
    }
    void *m = mmap(NULL, ALNAIR_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        snprintf(why, whylen, "cannot map: %s", strerror(errno));
        return NULL;
    }
    struct alnair_region *r = m;
    uint32_t magic = RLOAD(r->header.magic), version = RLOAD(r->header.version);
    if (magic != ALNAIR_REGION_MAGIC || version != ALNAIR_REGION_VERSION || r->header.size != ALNAIR_REGION_SIZE ||
        r->header.slot_count != ALNAIR_REGION_MAX_SLOTS || r->header.slot_size != ALNAIR_REGION_SLOT_SIZE) {
        snprintf(why, whylen, "magic 0x%08x version %u size %llu, expected 0x%08x version %u size %u", magic, version,
                 (unsigned long long)r->header.size, ALNAIR_REGION_MAGIC, ALNAIR_REGION_VERSION, ALNAIR_REGION_SIZE);
        munmap(m, ALNAIR_REGION_SIZE);
        return NULL;
    }
    return r;
}

static struct alnair_region *private_region(uint64_t memory_limit, uint32_t compute_limit)
{
    void *m = mmap(NULL, ALNAIR_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    struct alnair_region *r = m;
    r->header.magic = ALNAIR_REGION_MAGIC;
    r->header.version = ALNAIR_REGION_VERSION;
    r->header.size = ALNAIR_REGION_SIZE;
    r->header.slot_count = ALNAIR_REGION_MAX_SLOTS;
    r->header.slot_size = ALNAIR_REGION_SLOT_SIZE;
    r->agent.memory_limit = memory_limit;
    r->agent.compute_limit = compute_limit;
    /* no schedule (turn_period_ns 0): the cap's part of the default period, on the clock, nothing needs to tick */
    return r;
}

static void device_setup(struct alnair_device *d, const char *path, const char *explicit_path);
static void devices_map_setup(void);

void alnair_region_setup(void)
{
    uint64_t ctx = 0;
    if (env_u64("ALNAIR_CONTEXT_BYTES", UINT64_MAX, &ctx) == 1)
        alnair_context_bytes = ctx;

    const char *explicit_path = getenv("ALNAIR_REGION");
    const char *path = explicit_path && *explicit_path ? explicit_path : "/run/alnair/region";
    const char *list = getenv("ALNAIR_REGIONS");
    if (list != NULL && *list != '\0') { /* a container of several GPUs: one region per device, in order */
        char buf[4096];
        snprintf(buf, sizeof buf, "%s", list);
        int n = 0;
        char *save = NULL;
        for (char *tok = strtok_r(buf, ",", &save); tok != NULL && n < ALNAIR_MAX_DEVICES;
             tok = strtok_r(NULL, ",", &save))
            device_setup(&alnair_devices[n++], tok, tok);
        if (n == 0)
            device_setup(&alnair_devices[n++], path, explicit_path);
        alnair_device_count = n;
        devices_map_setup();
        struct alnair_region *any = NULL;
        for (int i = 0; i < n && any == NULL; i++)
            any = alnair_devices[i].region;
        for (int i = 0; i < n && any != NULL; i++) /* a device whose region is gone keeps the others' limits */
            if (alnair_devices[i].region == NULL)
                alnair_devices[i].region = private_region(RLOAD(any->agent.memory_limit),
                                                          RLOAD(any->agent.compute_limit));
    } else {
        device_setup(&alnair_devices[0], path, explicit_path);
    }
    alnair_hot.region = alnair_devices[0].region;
    alnair_region_shared = alnair_devices[0].shared;
}

static void device_setup(struct alnair_device *d, const char *path, const char *explicit_path)
{
    char why[256];
    int missing = 0;
    struct alnair_region *r = open_shared(path, why, sizeof why, &missing);
    if (r != NULL) {
        d->region = r;
        d->shared = 1;
        const char *slash = strrchr(path, '/');
        int dir = slash != NULL ? (int)(slash - path) : 0;
        if (snprintf(d->board_path, sizeof d->board_path, "%.*s%s" ALNAIR_BOARD_FILE, dir, path,
                     slash != NULL ? "/" : "") >= (int)sizeof d->board_path)
            d->board_path[0] = '\0'; /* too long a path: no board (the latency class then takes turns) */
        return;
    }
    int mem_set = getenv("ALNAIR_MEMORY_LIMIT") != NULL, comp_set = getenv("ALNAIR_COMPUTE_LIMIT") != NULL;
    if (missing && explicit_path == NULL && !mem_set && !comp_set)
        return; /* not in an Alnair container at all: no limits, no noise */

    uint64_t mem = 0, comp = 0;
    if (env_u64("ALNAIR_MEMORY_LIMIT", UINT64_MAX, &mem) != 1)
        mem = 0;
    if (env_u64("ALNAIR_COMPUTE_LIMIT", 100, &comp) != 1)
        comp = 0;
    if (comp >= 100)
        comp = 0;
    if (mem == 0 && comp == 0) {
        alnair_warn("alnair: region %s refused (%s) and no ALNAIR_MEMORY_LIMIT / ALNAIR_COMPUTE_LIMIT: no limits "
                    "enforced", path, why);
        return;
    }
    d->region = private_region(mem, (uint32_t)comp);
    d->shared = 0;
    alnair_warn("alnair: region %s refused (%s); enforcing ALNAIR_MEMORY_LIMIT=%llu bytes and "
                "ALNAIR_COMPUTE_LIMIT=%llu%% for this process alone",
                path, why, (unsigned long long)mem, (unsigned long long)comp);
}

/* ---- devices ---------------------------------------------------------------------------------------------
 * A process's device ordinal k is the container's GPU cvd[k] when the process set CUDA_VISIBLE_DEVICES (indices,
 * or GPU UUIDs or their prefixes, which are looked up in NVIDIA_VISIBLE_DEVICES), else GPU k: the agent lists the
 * GPUs in PCI bus order and sets CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA's ordinals are that order. */
static int g_cvd[ALNAIR_MAX_DEVICES], g_cvd_n = -1; /* -1: no CUDA_VISIBLE_DEVICES, ordinals are indices */
static _Atomic unsigned g_ctx_gen;                  /* bumped when a context dies: cached selections are void */
static __thread void *sel_ctx __attribute__((tls_model("initial-exec")));
static __thread unsigned sel_gen __attribute__((tls_model("initial-exec")));
static int warned_ordinal;

static void devices_map_setup(void)
{
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES"), *nvd = getenv("NVIDIA_VISIBLE_DEVICES");
    if (cvd == NULL)
        return;
    char uuids[ALNAIR_MAX_DEVICES][96];
    int nu = 0;
    if (nvd != NULL) {
        char buf[2048];
        snprintf(buf, sizeof buf, "%s", nvd);
        char *save = NULL;
        for (char *t = strtok_r(buf, ",", &save); t != NULL && nu < ALNAIR_MAX_DEVICES; t = strtok_r(NULL, ",", &save))
            snprintf(uuids[nu++], sizeof uuids[0], "%s", t);
    }
    char buf[2048];
    snprintf(buf, sizeof buf, "%s", cvd);
    g_cvd_n = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t != NULL && g_cvd_n < ALNAIR_MAX_DEVICES; t = strtok_r(NULL, ",", &save)) {
        while (*t == ' ')
            t++;
        char *end = NULL;
        long v = strtol(t, &end, 10);
        int idx = -1;
        if (end != t && *end == '\0' && v >= 0 && v < alnair_device_count) {
            idx = (int)v;
        } else if (*t != '\0') {
            for (int i = 0; i < nu && idx < 0; i++)
                if (strncmp(uuids[i], t, strlen(t)) == 0)
                    idx = i;
        }
        if (idx < 0)
            break; /* CUDA stops at the first entry it cannot use */
        g_cvd[g_cvd_n++] = idx;
    }
}

int alnair_device_index(CUdevice ordinal)
{
    int k = (int)ordinal;
    if (alnair_device_count <= 1)
        return 0;
    if (g_cvd_n >= 0)
        k = k >= 0 && k < g_cvd_n ? g_cvd[k] : -1;
    if (k < 0 || k >= alnair_device_count) {
        /* a device the container was not given cannot be opened; charge its first GPU rather than nothing */
        if (!warned_ordinal)
            alnair_warn("alnair: device ordinal %d is none of this container's %d GPUs; charging GPU 0", (int)ordinal,
                        alnair_device_count);
        warned_ordinal = 1;
        return 0;
    }
    return k;
}

void alnair_select_slow(void)
{
    CUcontext c = NULL;
    if (alnair_aux.cuCtxGetCurrent == NULL || alnair_aux.cuCtxGetCurrent(&c) != CUDA_SUCCESS || c == NULL) {
        sel_ctx = NULL;
        alnair_cur = 0;
        return;
    }
    unsigned gen = atomic_load_explicit(&g_ctx_gen, memory_order_relaxed);
    if ((void *)c == sel_ctx && gen == sel_gen)
        return; /* alnair_cur is still this context's device */
    CUdevice dev = 0;
    if (alnair_aux.cuCtxGetDevice == NULL || alnair_aux.cuCtxGetDevice(&dev) != CUDA_SUCCESS)
        dev = 0;
    alnair_cur = alnair_device_index(dev);
    sel_ctx = (void *)c;
    sel_gen = gen;
}

void alnair_use_device(int index)
{
    alnair_cur = index >= 0 && index < alnair_device_count ? index : 0;
    sel_ctx = NULL; /* the next hook selects its device again */
}

void alnair_contexts_changed(void)
{
    atomic_fetch_add_explicit(&g_ctx_gen, 1, memory_order_relaxed);
}

/* ---- slots ------------------------------------------------------------------------------------------------ */
static int owner_dead(int32_t pid, uint64_t start_time)
{
    pid_t p = pid < 0 ? -pid : pid;
    if (p <= 0)
        return 0;
    if (kill(p, 0) != 0 && errno == ESRCH)
        return 1;
    char state = 0;
    uint64_t now_start = read_start_time(p, &state);
    if (state == 'Z' || state == 'X')
        return 1;
    /* a pid reused by another process; only for settled slots (a negative pid is still being set up) */
    return pid > 0 && start_time != 0 && now_start != 0 && now_start != start_time;
}

static int reclaim(struct alnair_region_slot *s, int32_t seen)
{
    int32_t mine = -(int32_t)getpid();
    if (!__atomic_compare_exchange_n(&s->pid, &seen, mine, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return 0;
    RSTORE(s->memory_used, 0);
    RSTORE(s->pid, 0);
    return 1;
}

int alnair_reclaim_dead_slots(void)
{
    struct alnair_region *r = alnair_cur_region();
    if (r == NULL || !alnair_devices[alnair_cur].shared)
        return 0;
    int32_t me = (int32_t)getpid(), n = 0;
    for (unsigned i = 0; i < ALNAIR_REGION_MAX_SLOTS; i++) {
        struct alnair_region_slot *s = &r->slots[i];
        int32_t pid = RLOAD(s->pid);
        if (pid == 0 || pid == me || pid == -me)
            continue;
        if (owner_dead(pid, RLOAD(s->start_time)))
            n += reclaim(s, pid);
    }
    return n;
}

/* Claim a free slot for this process (reclaiming dead owners first). Called with claim_mu held. */
static struct alnair_region_slot *claim_free_slot(struct alnair_region *r, int32_t me, uint64_t start)
{
    alnair_reclaim_dead_slots();
    for (unsigned i = 0; i < ALNAIR_REGION_MAX_SLOTS; i++) {
        struct alnair_region_slot *s = &r->slots[i];
        int32_t zero = 0;
        if (!__atomic_compare_exchange_n(&s->pid, &zero, -me, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            continue;
        RSTORE(s->start_time, start);
        RSTORE(s->memory_used, 0);
        RSTORE(s->pid, me);
        return s;
    }
    return NULL;
}

struct alnair_region_slot *alnair_slot_slow(void)
{
    struct alnair_device *d = &alnair_devices[alnair_cur];
    struct alnair_region *r = d->region;
    if (r == NULL)
        return NULL;
    pthread_mutex_lock(&claim_mu);
    struct alnair_region_slot *mine = atomic_load(&d->slot);
    if (mine == NULL) {
        int32_t me = (int32_t)getpid();
        uint64_t start = read_start_time(me, NULL);
        if (!d->shared) {
            mine = &r->slots[0];
            mine->pid = me;
            mine->start_time = start;
        } else {
            for (unsigned i = 0; i < ALNAIR_REGION_MAX_SLOTS; i++) { /* our own image before exec */
                int32_t pid = RLOAD(r->slots[i].pid);
                if (pid == me || pid == -me)
                    reclaim(&r->slots[i], pid);
            }
            mine = claim_free_slot(r, me, start);
            if (mine == NULL) {
                /* Every slot is held by a live process. A process the others cannot see must not hold GPU memory
                 * or launch metered kernels (that would be a hole in the container's limits): it is refused both (no
                 * context, no allocation, no metered launch) until a slot frees up; alnair_slot_retry claims it
                 * then. One warning says so. */
                if (!d->overflow_warned)
                    alnair_warn("alnair: all %u region slots of this container are held by live processes; process "
                                "%d is refused GPU memory and contexts until one exits",
                                ALNAIR_REGION_MAX_SLOTS, (int)me);
                d->overflow_warned = 1;
                mine = &d->overflow;
            }
        }
        atomic_store(&d->slot, mine);
    }
    pthread_mutex_unlock(&claim_mu);
    return mine;
}

struct alnair_region_slot *alnair_slot_retry(void)
{
    struct alnair_device *d = &alnair_devices[alnair_cur];
    struct alnair_region_slot *s = alnair_slot();
    if (s != &d->overflow)
        return s;
    pthread_mutex_lock(&claim_mu);
    s = atomic_load(&d->slot);
    if (s == &d->overflow) {
        int32_t me = (int32_t)getpid();
        struct alnair_region_slot *got = claim_free_slot(d->region, me, read_start_time(me, NULL));
        if (got != NULL) {
            atomic_store(&d->slot, got);
            s = got;
        }
    }
    pthread_mutex_unlock(&claim_mu);
    return s;
}

void alnair_region_after_fork_child(void)
{
    pthread_mutex_init(&claim_mu, NULL);
    for (int i = 0; i < alnair_device_count; i++) {
        struct alnair_device *d = &alnair_devices[i];
        struct alnair_region_slot *old = atomic_load(&d->slot);
        atomic_store(&d->slot, NULL); /* the child claims its own slot on first use */
        if (d->region != NULL && !d->shared && old != NULL) {
            old->memory_used = 0; /* private copy: the parent's device memory is not the child's */
        }
        memset(&d->overflow, 0, sizeof d->overflow);
    }
}

/* ---- sums ------------------------------------------------------------------------------ */
static inline uint64_t sat_add(uint64_t a, uint64_t b)
{
    uint64_t c;
    return __builtin_add_overflow(a, b, &c) ? UINT64_MAX : c;
}

uint64_t alnair_memory_used_all(void)
{
    struct alnair_region *r = alnair_cur_region();
    uint64_t sum = 0;
    if (r == NULL)
        return 0;
    /* sequentially consistent: a reserve() adds to its own slot then reads everyone's (store -> load). With
     * acquire loads alone two processes on a weakly ordered CPU (Arm) could each miss the other's add and both
     * pass the limit; seq_cst on both sides makes at least one of them see the other. */
    for (unsigned i = 0; i < ALNAIR_REGION_MAX_SLOTS; i++)
        sum = sat_add(sum, __atomic_load_n(&r->slots[i].memory_used, __ATOMIC_SEQ_CST));
    return sum;
}

/* ---- turns -------------------------------------------------------------------------------------------------
 * The agent writes the turn fields under turn_seq (odd while it writes). A reader takes a few tries at a
 * consistent, even reading and never waits longer: a word left odd (an agent that died mid-write, or the container
 * itself scribbling over its region) only leaves this thread on the last schedule it read. A schedule no agent
 * writes (a window outside its period, a period past 10 s) counts as none: the cap's part of the default period. */
static __thread struct alnair_turn last_turns[ALNAIR_MAX_DEVICES] __attribute__((tls_model("initial-exec")));
static __thread int last_turns_valid[ALNAIR_MAX_DEVICES] __attribute__((tls_model("initial-exec")));
#define last_turn last_turns[alnair_cur]
#define last_turn_valid last_turns_valid[alnair_cur]

static void default_turn(struct alnair_region *r, struct alnair_turn *t)
{
    uint32_t c = RLOAD(r->agent.compute_limit);
    t->epoch = 0;
    t->period = ALNAIR_DEFAULT_TURN_PERIOD_NS;
    t->offset = 0;
    t->length = c - 1u < 99u ? (uint64_t)c * (ALNAIR_DEFAULT_TURN_PERIOD_NS / 100u) : ALNAIR_DEFAULT_TURN_PERIOD_NS;
    t->free_until = 0;
    /* No agent lays out this GPU's windows: the rest of the period is nobody's as far as this container can know
     * (containers without a schedule all share offset 0 anyway), so a window's tail may run into it, owed back,
     * and a big launch that does not fit the rest of its window is not lost (25.5 % at cap 30 on the H200). */
    t->spare = ALNAIR_DEFAULT_TURN_PERIOD_NS - t->length;
}

void alnair_turn_read(struct alnair_turn *t)
{
    struct alnair_region *r = alnair_cur_region();
    if (r == NULL)
        r = alnair_hot.region;
    for (unsigned tries = 0; tries < 4; tries++) {
        uint32_t s1 = RLOAD(r->agent.turn_seq);
        struct alnair_turn x = {RLOAD(r->agent.turn_epoch_ns), RLOAD(r->agent.turn_period_ns),
                                RLOAD(r->agent.turn_offset_ns), RLOAD(r->agent.turn_length_ns),
                                RLOAD(r->agent.turn_free_until_ns), RLOAD(r->agent.turn_spare_ns)};
        uint32_t s2 = RLOAD(r->agent.turn_seq);
        if (s1 != s2 || (s1 & 1))
            continue;
        if (x.period == 0) {
            uint64_t free_until = x.free_until;
            default_turn(r, &x);
            x.free_until = free_until;
        } else if (x.period > ALNAIR_MAX_TURN_PERIOD_NS || x.offset >= x.period || x.length > x.period) {
            default_turn(r, &x);
        } else if (x.spare > x.period - x.length) {
            x.spare = 0; /* more than the period leaves: not the agent's; no running past the window */
        }
        last_turn = x;
        last_turn_valid = 1;
        *t = x;
        return;
    }
    if (!last_turn_valid) {
        default_turn(r, &last_turn);
        last_turn_valid = 1;
    }
    *t = last_turn;
}
