/* One-time initialisation (pthread_once): the environment is read here and nowhere else, the region is opened,
 * fork handlers are installed. Nothing here holds a lock across context creation: the driver is not called. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

#include "alnair.h"

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
struct alnair_hot alnair_hot = {.guess_ns = DEFAULT_COST_NS, .est_clock = 1};

ALNAIR_HOT_TEXT uint64_t alnair_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no system call */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void alnair_sleep_ns(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

void alnair_warn(const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof buf - 2)
        n = sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, (size_t)n);
    (void)w;
}

static void atfork_child(void)
{
    atomic_fetch_add(&alnair_hot.fork_gen, 1);
    alnair_region_after_fork_child();
    alnair_memory_after_fork_child();
    alnair_launch_after_fork_child();
}

static void init_once_fn(void)
{
    int saved = errno; /* initialisation happens inside the application's calls: leave errno as it was */
    alnair_region_setup();
    pthread_atfork(NULL, NULL, atfork_child);
    errno = saved;
}

void alnair_init(void)
{
    pthread_once(&init_once, init_once_fn);
}
