"""The agent's reader of the simulated driver's per-GPU timelines (tests/shim/simcuda/simtimeline.h has the
layout and its rules; test and demo only). Read with pread, never mapped: a truncated file is a short read."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x4C544D49534E4C41  # "ALNSIMTL"
VERSION = 1
SLOTS = 32
BUCKET_NS = 10_000_000
BUCKETS = 512
HDR_WORDS = 8
SLOT_HDR_WORDS = 4
SLOT_WORDS = SLOT_HDR_WORDS + 2 * BUCKETS
FILE_WORDS = HDR_WORDS + 2 * BUCKETS + SLOTS * SLOT_WORDS
FILE_BYTES = FILE_WORDS * 8


@dataclass(frozen=True)
class SlotWindow:
    pid: int
    memory_bytes: int
    busy_ns: int
    copy_ns: int


@dataclass(frozen=True)
class GpuWindow:
    busy_ns: int
    copy_ns: int
    slots: tuple[SlotWindow, ...]


def create(path: Path) -> None:
    """Make the file (as the simulated driver would) so both sides share it from the start."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        if os.fstat(fd).st_size < FILE_BYTES:
            os.ftruncate(fd, FILE_BYTES)
        os.pwrite(fd, struct.pack("<4Q", MAGIC, VERSION | SLOTS << 32, BUCKET_NS, BUCKETS), 0)
    finally:
        os.close(fd)


def _sum(words: memoryview, base: int, k0: int, k1: int) -> int:
    """ns booked in buckets k0..k1-1 of the bucket array at word `base`."""
    total = 0
    for k in range(k0, k1):
        v = words[base + k % BUCKETS]
        if v >> 32 == k & 0xFFFFFFFF:
            total += v & 0xFFFFFFFF
    return total


def read_window(path: Path, k0: int, k1: int) -> GpuWindow | None:
    """What the GPU and each claimed slot did in buckets k0..k1-1 (None: no valid timeline file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.pread(fd, FILE_BYTES, 0)
    finally:
        os.close(fd)
    if len(data) < FILE_BYTES:
        return None
    words = memoryview(data).cast("Q")
    if words[0] != MAGIC or words[1] != VERSION | SLOTS << 32 or words[2] != BUCKET_NS or words[3] != BUCKETS:
        return None
    k0 = max(k0, k1 - BUCKETS)
    slots = []
    for i in range(SLOTS):
        base = HDR_WORDS + 2 * BUCKETS + i * SLOT_WORDS
        pid = words[base]
        if pid == 0 or pid > 1 << 22:
            continue
        b = base + SLOT_HDR_WORDS
        slots.append(SlotWindow(int(pid), int(words[base + 1]), _sum(words, b, k0, k1),
                                _sum(words, b + BUCKETS, k0, k1)))
    return GpuWindow(_sum(words, HDR_WORDS, k0, k1), _sum(words, HDR_WORDS + BUCKETS, k0, k1), tuple(slots))
