/* simtimeline: one shared timeline per simulated GPU, so processes on one GPU take turns on it and the agent's
 * simulated backend sees what each process did (its NVML per-process utilization).
 *
 * A file per GPU, $SIMCUDA_TIMELINE_DIR/<GPU UUID> (the UUID from NVIDIA_VISIBLE_DEVICES, as Alnair's Allocate
 * answer sets it), mmap'd shared by every simulated-driver process and read by the agent
 * (alnair_agent/gpu/simtimeline.py mirrors this layout; keep both in step). Little-endian u64 fields:
 *   header (64 bytes): magic, version|nslots<<32, bucket_ns, nbuckets, gpu_busy_until, reserved x3
 *   GPU busy[nbuckets], GPU copy[nbuckets]
 *   nslots x slot: pid (i64; 0 free), memory bytes, busy_total_ns, reserved, busy[nbuckets], copy[nbuckets]
 * A bucket is (bucket number mod 2^32) << 32 | ns booked in it: a stale tag means 0. Kernels of all processes on
 * the GPU run one at a time: start = max(now, stream free, GPU free); their ns are booked into the buckets their
 * interval covers at launch (the timeline is known in advance), so a bucket in the past is final.
 * Without SIMCUDA_TIMELINE_DIR nothing is shared and simtl_book returns its `earliest` unchanged. */
#pragma once
#include <stdint.h>

#define SIMTL_MAGIC 0x4c544d49534e4c41ull /* "ALNSIMTL" */
#define SIMTL_VERSION 1u
#define SIMTL_SLOTS 32u
#define SIMTL_BUCKET_NS 10000000ull /* 10 ms */
#define SIMTL_BUCKETS 512u          /* 5.12 s of history */

enum simtl_kind { SIMTL_KERNEL = 0, SIMTL_COPY = 1 };

/* Book `dur` ns of work of this process on its GPU, starting no earlier than `earliest` (CLOCK_MONOTONIC ns);
 * `mem_bytes` is the process's device memory now. Returns the start time on the shared GPU. */
uint64_t simtl_book(uint64_t earliest, uint64_t dur, uint64_t mem_bytes, enum simtl_kind kind);
