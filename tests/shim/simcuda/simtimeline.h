/* simtimeline: one shared timeline per simulated GPU, so processes on one GPU take turns on it and the agent's
 * simulated backend sees what each process did (its NVML per-process utilization).
 *
 * A file per GPU, $SIMCUDA_TIMELINE_DIR/<GPU UUID> (device k's is the k-th UUID of NVIDIA_VISIBLE_DEVICES, as
 * Alnair's Allocate answer lists a container's GPUs), mmap'd shared by every simulated-driver process and read by the agent
 * (alnair_agent/gpu/simtimeline.py mirrors this layout; keep both in step). Little-endian u64 fields:
 *   header (64 bytes): magic, version|nslots<<32, bucket_ns, nbuckets, gpu_busy_until, reserved x3
 *   GPU busy[nbuckets], GPU copy[nbuckets]
 *   nslots x slot: pid (i64; 0 free), memory bytes, busy_total_ns, lane_end, busy[nbuckets], copy[nbuckets]
 * A bucket is (bucket number mod 2^32) << 32 | ns booked in it: a stale tag means 0. The GPU is time-sliced
 * between processes, as a real one is without MPS: a kernel that starts while n processes (itself included) have
 * work booked past its start (their lane_end) runs at 1/n speed, so it ends n x its duration later and its GPU
 * time is booked evenly over that span (simtimeline.c). A process's own kernels run one after another (lane_end).
 * Work is booked into the buckets its interval covers at launch (the timeline is known in advance), so a bucket in
 * the past is final. The events around a kernel see it end at its stretched end, as on a time-sliced GPU.
 * Without SIMCUDA_TIMELINE_DIR nothing is shared and simtl_book returns its `earliest` unchanged. */
#pragma once
#include <stdint.h>

#define SIMTL_MAGIC 0x4c544d49534e4c41ull /* "ALNSIMTL" */
#define SIMTL_VERSION 1u
#define SIMTL_SLOTS 32u
#define SIMTL_BUCKET_NS 10000000ull /* 10 ms */
#define SIMTL_BUCKETS 512u          /* 5.12 s of history */

enum simtl_kind { SIMTL_KERNEL = 0, SIMTL_COPY = 1 };

/* Book `dur` ns of work of this process on its device `dev` (the dev-th GPU of NVIDIA_VISIBLE_DEVICES), starting no earlier than `earliest` (CLOCK_MONOTONIC ns);
 * `mem_bytes` is the process's device memory now. Returns when the kernel appears to start: it ends at the
 * returned time + dur (later than `earliest` + dur when it waits for its own process or shares the GPU). */
uint64_t simtl_book(int dev, uint64_t earliest, uint64_t dur, uint64_t mem_bytes, enum simtl_kind kind);
