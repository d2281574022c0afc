/* libnext.so / libnext2.so (built from this file with -DNEXT_NAME): preloaded after libalnair.so, each defines
 * next_probe(); libnext's asks dlsym(RTLD_NEXT, "next_probe") for the next definition, which must be libnext2's
 * (what glibc gives the caller), not its own (what a dlsym forwarding the call without a tail call would give). */
#define _GNU_SOURCE
#include <dlfcn.h>

__attribute__((visibility("default"))) const char *next_probe(void)
{
#ifdef NEXT_FIRST
    const char *(*next)(void) = (const char *(*)(void))dlsym(RTLD_NEXT, "next_probe");
    return next ? next() : "none";
#else
    return NEXT_NAME;
#endif
}
