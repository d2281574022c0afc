/* simtimeline: see simtimeline.h. */
#define _GNU_SOURCE
#include "simtimeline.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define HDR_WORDS 8u
#define SLOT_HDR_WORDS 4u
#define SLOT_WORDS (SLOT_HDR_WORDS + 2u * SIMTL_BUCKETS)
#define FILE_WORDS (HDR_WORDS + 2u * SIMTL_BUCKETS + SIMTL_SLOTS * SLOT_WORDS)

/* per device of the process (SIMCUDA_DEVICES): device k books on the timeline of the k-th GPU of
 * NVIDIA_VISIBLE_DEVICES, as a container of several GPUs sees them */
#define SIMTL_DEVICES 16
static uint64_t *tls[SIMTL_DEVICES];     /* the mapped files, or NULL */
static uint64_t *myslots[SIMTL_DEVICES]; /* this process's slot in each, or NULL */
static pid_t mypids[SIMTL_DEVICES];
static pthread_mutex_t tlmu = PTHREAD_MUTEX_INITIALIZER;
static int tried[SIMTL_DEVICES];
static double switch_loss = 0.05; /* SIMCUDA_SWITCH_LOSS: the GPU time lost while contexts are time-sliced */

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define CAS(p, o, n) __atomic_compare_exchange_n((p), (o), (n), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)

static uint64_t *open_timeline(int dev)
{
    const char *dir = getenv("SIMCUDA_TIMELINE_DIR"), *gpus = getenv("NVIDIA_VISIBLE_DEVICES");
    const char *loss = getenv("SIMCUDA_SWITCH_LOSS");
    if (loss != NULL && *loss != 0) {
        double v = strtod(loss, NULL);
        if (v >= 0.0 && v < 1.0)
            switch_loss = v;
    }
    if (dir == NULL || *dir == 0 || gpus == NULL || *gpus == 0 || strchr(gpus, '/') != NULL)
        return NULL;
    for (int k = 0; k < dev; k++) { /* the dev-th GPU of the list */
        gpus = strchr(gpus, ',');
        if (gpus == NULL)
            return NULL;
        gpus++;
    }
    char uuid[128], path[PATH_MAX];
    size_t n = strcspn(gpus, ",");
    if (n == 0 || n >= sizeof uuid)
        return NULL;
    memcpy(uuid, gpus, n);
    uuid[n] = 0;
    if (snprintf(path, sizeof path, "%s/%s", dir, uuid) >= (int)sizeof path)
        return NULL;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0 || (st.st_size < (off_t)(FILE_WORDS * 8) && ftruncate(fd, FILE_WORDS * 8) != 0)) {
        close(fd);
        return NULL;
    }
    void *m = mmap(NULL, FILE_WORDS * 8, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return NULL;
    uint64_t *h = m;
    /* whoever comes first writes the header; every writer writes the same constants */
    h[1] = SIMTL_VERSION | ((uint64_t)SIMTL_SLOTS << 32);
    h[2] = SIMTL_BUCKET_NS;
    h[3] = SIMTL_BUCKETS;
    STORE(&h[0], SIMTL_MAGIC);
    return h;
}

static uint64_t *slot_at(uint64_t *tl, unsigned i) { return tl + HDR_WORDS + 2u * SIMTL_BUCKETS + (uint64_t)i * SLOT_WORDS; }

static uint64_t *claim_slot(uint64_t *tl, pid_t me)
{
    for (int pass = 0; pass < 2; pass++) {
        for (unsigned i = 0; i < SIMTL_SLOTS; i++) {
            uint64_t *s = slot_at(tl, i);
            uint64_t pid = LOAD(&s[0]);
            int dead = pass == 1 && pid != 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH;
            if ((pid == 0 || dead) && CAS(&s[0], &pid, (uint64_t)me)) {
                memset(&s[1], 0, (SLOT_WORDS - 1) * 8);
                return s;
            }
        }
    }
    return NULL;
}

static void bucket_add(uint64_t *b, uint64_t k, uint64_t ns)
{
    uint64_t tag = k & 0xffffffffull, old = LOAD(b);
    for (;;) {
        uint64_t nv = (old >> 32) == tag ? old + ns : (tag << 32) | ns;
        if (CAS(b, &old, nv))
            return;
    }
}

/* Book `ns` of work spread evenly over [start, end) into the buckets it covers. */
static void book(uint64_t *buckets, uint64_t start, uint64_t end, uint64_t ns)
{
    uint64_t span = end - start, done = 0;
    for (uint64_t k = start / SIMTL_BUCKET_NS, n = 0; k * SIMTL_BUCKET_NS < end && n < SIMTL_BUCKETS; k++, n++) {
        uint64_t lo = k * SIMTL_BUCKET_NS, hi = lo + SIMTL_BUCKET_NS;
        uint64_t a = start > lo ? start : lo, z = end < hi ? end : hi;
        uint64_t part = z >= end ? ns - done : (uint64_t)((unsigned __int128)(z - a) * ns / span);
        done += part;
        bucket_add(&buckets[k % SIMTL_BUCKETS], k, part);
    }
}

/* Time-slicing, as a GPU without MPS does it, on a timeline booked in advance. A kernel runs at speed
 *     1 / n   (x (1 - SIMCUDA_SWITCH_LOSS) while n > 1)
 * where n counts the processes with work on the GPU when it starts (itself included): processes that have work at
 * the same time split the GPU equally, and lose SIMCUDA_SWITCH_LOSS (default 0.05) of its time to switching between
 * their contexts, as the H200 does (two or three matmul contexts together do 4-6 % less work than one); one alone
 * runs at full speed. A kernel at speed s ends dur / s after its start and its dur ns of GPU time are booked evenly
 * over that span, so the events around it see the stretched time a time-sliced kernel shows. A process's own
 * kernels run one after another (its lane_end). Speeds are fixed when a kernel is booked, so a change in who is
 * busy is felt within one in-flight horizon. */
uint64_t simtl_book(int dev, uint64_t earliest, uint64_t dur, uint64_t mem_bytes, enum simtl_kind kind)
{
    pid_t me = getpid();
    if (dev < 0 || dev >= SIMTL_DEVICES)
        dev = 0;
    if (!tried[dev] || (tls[dev] != NULL && me != mypids[dev])) {
        pthread_mutex_lock(&tlmu);
        if (!tried[dev]) {
            tls[dev] = open_timeline(dev);
            tried[dev] = 1;
        }
        if (tls[dev] != NULL && me != mypids[dev]) { /* first booking, or a forked child */
            myslots[dev] = claim_slot(tls[dev], me);
            mypids[dev] = me;
        }
        pthread_mutex_unlock(&tlmu);
    }
    uint64_t *tl = tls[dev], *myslot = myslots[dev];
    if (tl == NULL || dur == 0)
        return earliest;
    uint64_t start = earliest, n = 1;
    if (myslot != NULL) {
        uint64_t lane = LOAD(&myslot[3]);
        if (lane > start)
            start = lane;
    }
    for (unsigned i = 0; i < SIMTL_SLOTS; i++) {
        uint64_t *s = slot_at(tl, i);
        if (s == myslot || LOAD(&s[0]) == 0)
            continue;
        if (LOAD(&s[3]) > start)
            n++;
    }
    if (myslot == NULL) /* no slot of its own (all taken): it still shares the GPU */
        n++;
    double speed = 1.0 / (double)n;
    if (n > 1)
        speed *= 1.0 - switch_loss;
    uint64_t end = start + (uint64_t)((double)dur / speed);
    if (myslot != NULL) {
        uint64_t lane = LOAD(&myslot[3]);
        while (lane < end && !CAS(&myslot[3], &lane, end))
            ;
    }
    uint64_t busy = LOAD(&tl[4]);
    while (busy < end && !CAS(&tl[4], &busy, end))
        ;
    book(tl + HDR_WORDS + (kind == SIMTL_COPY ? SIMTL_BUCKETS : 0), start, end, dur);
    if (myslot != NULL) {
        STORE(&myslot[1], mem_bytes);
        __atomic_fetch_add(&myslot[2], dur, __ATOMIC_RELAXED);
        book(myslot + SLOT_HDR_WORDS + (kind == SIMTL_COPY ? SIMTL_BUCKETS : 0), start, end, dur);
    }
    /* the caller ends the kernel at the returned start + dur: it appears to start late, as a time-sliced one
     * does to the events around it */
    return end - dur;
}
