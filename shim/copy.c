/* Memory copies: passed straight through; the bytes of each successful copy are added to the process's slot
 * (`copy_bytes`, a counter). NVML attributes no copy-engine time to processes: the agent's profiler splits the
 * GPU's memory-copy time not explained by kernels between containers by these bytes. Hot path: one relaxed atomic
 * add, nothing else (no lock, no syscall); a synchronous copy to the host in a region also loads the class (a
 * wait, sync.c). 2D/3D copies and peer copies are not counted (documented). */
#include "hook_protos.h"
#include "launch_internal.h"

static inline CUresult counted(CUresult rc, size_t bytes)
{
    if (rc == CUDA_SUCCESS && bytes && alnair_hot.region != NULL) {
        struct alnair_region_slot *s = alnair_slot();
        if (s != NULL && !alnair_slotless())
            __atomic_fetch_add(&s->copy_bytes, (uint64_t)bytes, __ATOMIC_RELAXED);
    }
    return rc;
}

#define COPY_HOOK(name, params, args, bytes)         \
    ALNAIR_API CUresult name params                   \
    {                                                 \
        REAL_OR_FAIL(fn, name);                       \
        return counted(fn args, bytes);               \
    }

/* A synchronous copy to the host waits for the stream's work before it: in a latency container, a wait (sync.c). */
#define WAITING_COPY_HOOK(name, params, args, bytes) \
    ALNAIR_API CUresult name params                   \
    {                                                 \
        REAL_OR_FAIL(fn, name);                       \
        if (LIKELY(alnair_hot.region == NULL))        \
            return fn args;                           \
        uint64_t said_ = latency_wait_begin();        \
        CUresult rc_ = fn args;                       \
        latency_wait_end(said_);                      \
        return counted(rc_, bytes);                   \
    }

WAITING_COPY_HOOK(cuMemcpy, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n), n)
WAITING_COPY_HOOK(cuMemcpy_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n), n)
COPY_HOOK(cuMemcpyAsync, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), n)
COPY_HOOK(cuMemcpyAsync_ptsz, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), n)
COPY_HOOK(cuMemcpyHtoD_v2, (CUdeviceptr dst, const void *src, size_t n), (dst, src, n), n)
COPY_HOOK(cuMemcpyHtoD_v2_ptds, (CUdeviceptr dst, const void *src, size_t n), (dst, src, n), n)
WAITING_COPY_HOOK(cuMemcpyDtoH_v2, (void *dst, CUdeviceptr src, size_t n), (dst, src, n), n)
WAITING_COPY_HOOK(cuMemcpyDtoH_v2_ptds, (void *dst, CUdeviceptr src, size_t n), (dst, src, n), n)
COPY_HOOK(cuMemcpyDtoD_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n), n)
COPY_HOOK(cuMemcpyDtoD_v2_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n), n)
COPY_HOOK(cuMemcpyHtoDAsync_v2, (CUdeviceptr dst, const void *src, size_t n, CUstream s), (dst, src, n, s), n)
COPY_HOOK(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr dst, const void *src, size_t n, CUstream s), (dst, src, n, s), n)
COPY_HOOK(cuMemcpyDtoHAsync_v2, (void *dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), n)
COPY_HOOK(cuMemcpyDtoHAsync_v2_ptsz, (void *dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), n)
COPY_HOOK(cuMemcpyDtoDAsync_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), n)
COPY_HOOK(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s), n)
