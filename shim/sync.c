/* Waits for the GPU: stream and event syncs passed through. In a latency container its board slot says busy while
 * the wait lasts (latency.c, latency_wait_begin): what a request's result waits for is measured, not estimated.
 * Anywhere else: one load of the region's class, nothing more. cuCtxSynchronize is not hooked: CUDA 12.9 gave it
 * a second form that cuGetProcAddress hands out by version, and a request's result is a stream's (`.cpu()`,
 * `.item()`: cuStreamSynchronize). */
#include "hook_protos.h"
#include "launch_internal.h"

#define WAIT_HOOK(name, params, args)                    \
    ALNAIR_API CUresult name params                      \
    {                                                    \
        REAL_OR_FAIL(fn, name);                          \
        if (LIKELY(alnair_hot.region == NULL))           \
            return fn args;                              \
        uint64_t said_ = latency_wait_begin();           \
        CUresult rc_ = fn args;                          \
        latency_wait_end(said_);                         \
        return rc_;                                      \
    }

WAIT_HOOK(cuStreamSynchronize, (CUstream hStream), (hStream))
WAIT_HOOK(cuStreamSynchronize_ptsz, (CUstream hStream), (hStream))
WAIT_HOOK(cuEventSynchronize, (CUevent hEvent), (hEvent))
