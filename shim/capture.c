/* Stream captures under way: the driver forbids event queries while a global-mode capture is under way in any
 * thread, or a non-relaxed one in the querying thread; only then does the shim stop querying its events. Launches
 * into a capturing stream wait for no turn: the graph launch does. A capture is forgotten when its stream is no
 * longer capturing after cuStreamEndCapture, whatever that returned. */
#define _GNU_SOURCE
#include "launch_internal.h"

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

/* One capture query, for every caller: 1 the stream is being captured, 0 it is not, -1 the driver cannot tell (e.g.
 * the legacy stream during another stream's capture). Each caller says what "cannot tell" means for it. */
int alnair_stream_capture_state(CUstream s, int pt)
{
    CUresult (*fn)(CUstream, CUstreamCaptureStatus *) =
        pt ? alnair_aux.cuStreamIsCapturing_ptsz : alnair_aux.cuStreamIsCapturing;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (fn == NULL || fn(s, &st) != CUDA_SUCCESS)
        return -1;
    return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* A launch into a capturing stream takes no turn (the graph launch does): one the driver cannot tell about is left
 * alone too, since an event query of ours could break a capture. */
ALNAIR_HOT_TEXT int capturing(CUstream s, int pt)
{
    if (LIKELY(atomic_load_explicit(&alnair_hot.captures, memory_order_relaxed) == 0))
        return 0;
    return alnair_stream_capture_state(s, pt) != 0;
}

void capture_after_fork_child(void)
{
    atomic_store(&alnair_hot.captures, 0);
    atomic_store(&alnair_hot.global_captures, 0);
    memset(g_caps, 0, sizeof g_caps);
}

/* ---- stream capture bookkeeping -------------------------------------------------------------------------- */
int alnair_captures_under_way(void)
{
    return atomic_load_explicit(&alnair_hot.captures, memory_order_relaxed) != 0;
}

static inline uintptr_t cap_key(CUstream s, int pt)
{
    return (((uintptr_t)s << 1) | (uintptr_t)(pt != 0)) + 1;
}

static void cap_count(int mode, int d)
{
    atomic_fetch_add(&alnair_hot.captures, d);
    if (mode == CAPTURE_MODE_GLOBAL)
        atomic_fetch_add(&alnair_hot.global_captures, d);
    if (mode != CAPTURE_MODE_RELAXED)
        T.strict_captures += d;
}

static CUresult began(CUresult rc, CUstream s, int pt, CUstreamCaptureMode mode)
{
    if (rc != CUDA_SUCCESS || alnair_hot.region == NULL)
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
    if (alnair_hot.region == NULL || atomic_load(&alnair_hot.captures) == 0)
        return rc;
    if (alnair_stream_capture_state(s, pt) == 1)
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

