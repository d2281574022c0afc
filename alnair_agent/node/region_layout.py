"""The region: the ONE definition of the shared-memory file between the agent and the shim.

Everything else derives from this module: the agent's mmap mirror (`alnair_agent.node.region`) reads offsets from
here, and the C header `shim/region_layout.h` is generated from here (`python -m alnair_agent.node.region_layout`);
a test fails when the checked-in header differs from what this module generates.

Layout (little-endian, naturally aligned, every field 4 or 8 bytes so plain atomics work on it):

    [header 64 B][agent block 128 B][slot 0 .. MAX_SLOTS-1, 128 B each]

Writers: the header and the agent block are written by the agent only (the shim only reads them); each slot is
claimed by one process of the container (compare-and-swap on `pid`) and written by that process only. Counters
only grow; readers take differences.

Compute is shared by turns. The agent gives each capped container of a GPU a window in a period common to the GPU
(`turn_epoch_ns`, `turn_period_ns`): the container may launch kernels during [epoch + k*period + offset,
epoch + k*period + offset + length), published under a sequence lock (`turn_seq` odd while the agent writes it). The
windows of one GPU's containers do not overlap, so the driver never interleaves two capped contexts and a
container's GPU time is its windows' time by construction: a cap of c % is a window of c % of the period. The shim
stops launching when its queued work would run past its window's end, so a turn hands the GPU over drained; work it
could not help running past the end (a kernel longer than the window) is paid back by skipping that much of its
next windows. The time after a window that is nobody's (`turn_spare_ns`: the caps of the GPU's containers leave
part of the period unreserved) may be run into, and what runs there is owed back the same way: a window's tail
too short for the next launch is not lost when nobody needs it. An elastic container may be lent the whole period
(`turn_free_until_ns`: until then it may launch at any time); the lease is short and the agent renews it, so when the agent stops the windows rule again. Because the
schedule runs on the clock, a dead or restarting agent leaves the last windows in force: never a stall, never
uncapped.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

MAGIC = 0x524E4C41  # b"ALNR" read as a little-endian u32
VERSION = 4  # 2: turns (windows in a period) replace the token grant line of version 1; 3: turn_spare_ns;
# 4: the latency class (compute_class, board_slot, hold_mask, hold_pct; the slots' held_ns and holds)
MAX_SLOTS = 64
HEADER_SIZE = 64
AGENT_BLOCK_SIZE = 128
SLOT_SIZE = 128
SLOTS_OFFSET = HEADER_SIZE + AGENT_BLOCK_SIZE
REGION_SIZE = SLOTS_OFFSET + MAX_SLOTS * SLOT_SIZE

# The agent's heartbeat is stale when older than this (monotonic ns); the shim then keeps the last turns.
HEARTBEAT_STALE_NS = 2_000_000_000
# The period of a region whose agent has published no schedule (turn_period_ns 0), or of the private region a shim
# builds from ALNAIR_COMPUTE_LIMIT: the container's window is then its cap's part of this period, at offset 0, and
# the rest of the period is its spare (no agent says it is anyone's).
DEFAULT_TURN_PERIOD_NS = 100_000_000
# No turn period the agent writes is longer (ALNAIR_TURN_PERIOD_S is at most 1 s): a reader takes a longer one, or a
# window outside its period, for no schedule at all.
MAX_TURN_PERIOD_NS = 10_000_000_000
# compute_class values. A latency container launches at once, whatever turn it is, while the other capped
# containers of its GPU hold back; its GPU time is held to its cap over LATENCY_HORIZON_NS (docs/architecture.md,
# "The latency class").
CLASS_TURNS = 0
CLASS_LATENCY = 1
LATENCY_HORIZON_NS = 1_000_000_000
# compute_limit value meaning "no compute cap": launches pass straight through.
COMPUTE_UNLIMITED = 0
# memory_limit value meaning "no memory cap".
MEMORY_UNLIMITED = 0


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str  # one of CTYPES
    offset: int  # from the start of its block
    doc: str


CTYPES = {"uint32_t": ("I", 4), "int32_t": ("i", 4), "uint64_t": ("Q", 8)}

HEADER_FIELDS = (
    Field("magic", "uint32_t", 0, "MAGIC; anything else: the reader refuses the region"),
    Field("version", "uint32_t", 4, "VERSION of this layout"),
    Field("size", "uint64_t", 8, "total bytes of the region (REGION_SIZE)"),
    Field("slot_count", "uint32_t", 16, "number of process slots (MAX_SLOTS)"),
    Field("slot_size", "uint32_t", 20, "bytes per slot (SLOT_SIZE)"),
)

AGENT_FIELDS = (
    Field("memory_limit", "uint64_t", 0, "bytes of GPU memory the container may hold; 0 = no limit"),
    Field("compute_limit", "uint32_t", 8, "percent of one GPU, 1..100; 0 = no compute limit"),
    Field("turn_seq", "uint32_t", 12, "sequence lock over the turn fields below: odd while the agent writes them"),
    Field("heartbeat_ns", "uint64_t", 16, "CLOCK_MONOTONIC ns of the agent's last tick; 0 = never"),
    Field("turn_epoch_ns", "uint64_t", 24, "turns: CLOCK_MONOTONIC ns at which period 0 begins"),
    Field("turn_period_ns", "uint64_t", 32, "turns: the GPU's period; 0 = no schedule (the cap's part of "
          "DEFAULT_TURN_PERIOD_NS, at offset 0, the rest spare)"),
    Field("turn_offset_ns", "uint64_t", 40, "turns: where this container's window begins in each period"),
    Field("turn_length_ns", "uint64_t", 48, "turns: its window's length (>= the period: always its turn)"),
    Field("turn_free_until_ns", "uint64_t", 56, "turns: until this CLOCK_MONOTONIC ns it may launch at any time "
          "(an elastic container lent the GPU; 0 = never)"),
    Field("turn_spare_ns", "uint64_t", 64, "turns: how long after its window's end no other window begins "
          "(<= period - length; work may run that far past the end, owed back by skipping its next windows)"),
    Field("compute_class", "uint32_t", 72, "CLASS_TURNS (windows, leases) or CLASS_LATENCY (launch at once, the GPU "
          "time held to the cap over LATENCY_HORIZON_NS, announced in board slot board_slot)"),
    Field("board_slot", "uint32_t", 76, "a latency container's slot on its GPU's board (0..BOARD_SLOTS-1)"),
    Field("hold_mask", "uint32_t", 80, "board slots (bit k: slot k) whose latency containers this one holds back "
          "for; 0 = none on its GPU, the board is not read"),
    Field("hold_pct", "uint32_t", 84, "at most this percent of LATENCY_HORIZON_NS it is held back (what the latency "
          "containers of its GPU may take from it, whatever the board says)"),
)

SLOT_FIELDS = (
    Field("pid", "int32_t", 0, "owner's pid in the container; 0 = free (claimed by CAS 0 -> pid)"),
    Field("flags", "uint32_t", 4, "reserved, 0"),
    Field("start_time", "uint64_t", 8, "owner's start time (/proc/<pid>/stat field 22), to tell pid reuse"),
    Field("memory_used", "uint64_t", 16, "bytes of GPU memory the owner holds now (a level, not a counter)"),
    Field("launches", "uint64_t", 24, "counter: kernel and graph launches"),
    Field("gpu_ns", "uint64_t", 32, "counter: GPU time (ns) of the owner's metered launches, as the shim "
          "estimated and trued up its kernels"),
    Field("overrun_ns", "uint64_t", 40, "counter: ns of its work that ran past the end of its windows (paid back "
          "by skipping as much of its next ones)"),
    Field("wait_ns", "uint64_t", 48, "counter: ns spent waiting for its turn"),
    Field("copy_bytes", "uint64_t", 56, "counter: bytes moved by the owner's memory copies (host<->device, "
          "device<->device)"),
    Field("held_ns", "uint64_t", 64, "counter: ns its launches were held back for a latency container"),
    Field("holds", "uint64_t", 72, "counter: launches held back for a latency container"),
)

# The board: one small file per GPU, shared by every capped container on it (a hard link in each container's run
# folder, `board` beside its region). A latency container writes its slot (when its queued work is expected to end);
# the others read the slots their hold_mask names. Any container of the GPU can write the file, so what it says
# only ever holds a container back within that container's own hold_pct.
BOARD_MAGIC = 0x424E4C41  # b"ALNB"
BOARD_VERSION = 1
BOARD_SLOTS = 8
BOARD_HEADER_SIZE = 64
BOARD_SLOT_SIZE = 64
BOARD_SIZE = BOARD_HEADER_SIZE + BOARD_SLOTS * BOARD_SLOT_SIZE
BOARD_FILE_NAME = "board"

BOARD_HEADER_FIELDS = (
    Field("magic", "uint32_t", 0, "BOARD_MAGIC"),
    Field("version", "uint32_t", 4, "BOARD_VERSION"),
    Field("size", "uint64_t", 8, "BOARD_SIZE"),
)

BOARD_SLOT_FIELDS = (
    Field("busy_until_ns", "uint64_t", 0, "CLOCK_MONOTONIC ns until which the latency container in this slot "
          "expects its queued work to run (its last launch's estimated end and a grace); 0 = idle"),
    Field("launches", "uint64_t", 8, "counter: its launches (its writer's; for people reading the board)"),
)

BLOCKS = (
    ("alnair_region_header", HEADER_FIELDS, HEADER_SIZE, 0),
    ("alnair_region_agent", AGENT_FIELDS, AGENT_BLOCK_SIZE, HEADER_SIZE),
    ("alnair_region_slot", SLOT_FIELDS, SLOT_SIZE, SLOTS_OFFSET),
    ("alnair_board_header", BOARD_HEADER_FIELDS, BOARD_HEADER_SIZE, 0),
    ("alnair_board_slot", BOARD_SLOT_FIELDS, BOARD_SLOT_SIZE, BOARD_HEADER_SIZE),
)

CONSTANTS = (
    ("ALNAIR_REGION_MAGIC", f"0x{MAGIC:08X}u"),
    ("ALNAIR_REGION_VERSION", f"{VERSION}u"),
    ("ALNAIR_REGION_MAX_SLOTS", f"{MAX_SLOTS}u"),
    ("ALNAIR_REGION_HEADER_SIZE", f"{HEADER_SIZE}u"),
    ("ALNAIR_REGION_AGENT_BLOCK_SIZE", f"{AGENT_BLOCK_SIZE}u"),
    ("ALNAIR_REGION_SLOT_SIZE", f"{SLOT_SIZE}u"),
    ("ALNAIR_REGION_SLOTS_OFFSET", f"{SLOTS_OFFSET}u"),
    ("ALNAIR_REGION_SIZE", f"{REGION_SIZE}u"),
    ("ALNAIR_HEARTBEAT_STALE_NS", f"{HEARTBEAT_STALE_NS}ull"),
    ("ALNAIR_DEFAULT_TURN_PERIOD_NS", f"{DEFAULT_TURN_PERIOD_NS}ull"),
    ("ALNAIR_MAX_TURN_PERIOD_NS", f"{MAX_TURN_PERIOD_NS}ull"),
    ("ALNAIR_COMPUTE_UNLIMITED", f"{COMPUTE_UNLIMITED}u"),
    ("ALNAIR_CLASS_TURNS", f"{CLASS_TURNS}u"),
    ("ALNAIR_CLASS_LATENCY", f"{CLASS_LATENCY}u"),
    ("ALNAIR_LATENCY_HORIZON_NS", f"{LATENCY_HORIZON_NS}ull"),
    ("ALNAIR_BOARD_MAGIC", f"0x{BOARD_MAGIC:08X}u"),
    ("ALNAIR_BOARD_VERSION", f"{BOARD_VERSION}u"),
    ("ALNAIR_BOARD_SLOTS", f"{BOARD_SLOTS}u"),
    ("ALNAIR_BOARD_HEADER_SIZE", f"{BOARD_HEADER_SIZE}u"),
    ("ALNAIR_BOARD_SLOT_SIZE", f"{BOARD_SLOT_SIZE}u"),
    ("ALNAIR_BOARD_SIZE", f"{BOARD_SIZE}u"),
    ("ALNAIR_BOARD_FILE", f'"{BOARD_FILE_NAME}"'),
    ("ALNAIR_MEMORY_UNLIMITED", f"{MEMORY_UNLIMITED}ull"),
)


def _check() -> None:
    """Fail at import if the table above is not a gap-free, aligned, in-bounds layout."""
    for name, fields, size, _ in BLOCKS:
        end = 0
        for f in fields:
            width = CTYPES[f.ctype][1]
            if f.offset % width or f.offset < end:
                raise AssertionError(f"{name}.{f.name}: misaligned or overlapping at {f.offset}")
            end = f.offset + width
        if end > size:
            raise AssertionError(f"{name} overflows its {size} bytes")


_check()


def absolute_offset(block: str, field: str, slot: int = 0) -> int:
    """Byte offset of `field` in the region file (for slot fields, of slot number `slot`)."""
    for name, fields, size, base in BLOCKS:
        if name == block:
            for f in fields:
                if f.name == field:
                    return base + (slot * size if block.endswith("_slot") else 0) + f.offset
    raise KeyError(f"{block}.{field}")


def c_header() -> str:
    """The C header the shim compiles against, generated from the tables above."""
    out = [
        "/* GENERATED by `python -m alnair_agent.node.region_layout` from alnair_agent/node/region_layout.py.",
        " * Do not edit: change the Python definition and regenerate; tests fail when the two differ. */",
        "#ifndef ALNAIR_REGION_LAYOUT_H",
        "#define ALNAIR_REGION_LAYOUT_H",
        "",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
    ]
    for cname, value in CONSTANTS:
        out.append(f"#define {cname} {value}")
    out.append("")
    for name, fields, size, base in BLOCKS:
        where = "of the board file" if name.startswith("alnair_board") else ""
        out.append(f"/* {size} bytes at offset {base}{' + slot * size' if name.endswith('_slot') else ''} {where}*/")
        out.append(f"struct {name} {{")
        pos = 0
        for f in fields:
            if f.offset > pos:
                out.append(f"    uint8_t _pad{pos}[{f.offset - pos}];")
            out.append(f"    {f.ctype} {f.name}; /* {f.doc} */")
            pos = f.offset + CTYPES[f.ctype][1]
        if pos < size:
            out.append(f"    uint8_t _pad{pos}[{size - pos}];")
        out.append("};")
        out.append(f"_Static_assert(sizeof(struct {name}) == {size}, \"{name} size\");")
        for f in fields:
            out.append(f"_Static_assert(offsetof(struct {name}, {f.name}) == {f.offset}, \"{name}.{f.name}\");")
        out.append("")
    out += [
        "struct alnair_region {",
        "    struct alnair_region_header header;",
        "    struct alnair_region_agent agent;",
        "    struct alnair_region_slot slots[ALNAIR_REGION_MAX_SLOTS];",
        "};",
        "_Static_assert(sizeof(struct alnair_region) == ALNAIR_REGION_SIZE, \"alnair_region size\");",
        "",
        "struct alnair_board {",
        "    struct alnair_board_header header;",
        "    struct alnair_board_slot slots[ALNAIR_BOARD_SLOTS];",
        "};",
        "_Static_assert(sizeof(struct alnair_board) == ALNAIR_BOARD_SIZE, \"alnair_board size\");",
        "",
        "#endif /* ALNAIR_REGION_LAYOUT_H */",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(c_header())
