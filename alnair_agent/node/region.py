"""The agent's side of the region file: create it, publish limits, turns and heartbeat, read the slots.

The layout comes from `alnair_agent.node.region_layout`; nothing here hard-codes an offset. Everything read from
the slots was written by the container and is untrusted: values are bounds-checked before anyone uses them.

The agent reads and writes the file with pread/pwrite, never through a mapping: the container can truncate the
file, and a mapped page past the end would kill the agent with SIGBUS. A short read is a RegionError instead.

The file is writable by the container as a whole, the agent's own fields included. So the agent never trusts a
field it wrote when it reads it back: what it wrote lives in memory (`AgentBlock`, one per allocation, shared by
every service's handle on that region), every read of the agent block is one bounded pread whose values are only
compared against that record (`restore` puts back what the container changed), and nothing the agent does waits on
a value in the file (a sequence word a container left odd once froze the agent's event loop for good). Only after
an agent restart, when memory is empty, is the agent block adopted from the file once, checked: turns that are
torn or impossible are dropped until the dispatcher publishes the GPU's again.
"""

from __future__ import annotations

import contextlib
import errno
import operator
import os
import stat
import struct
import time
from dataclasses import astuple, dataclass
from pathlib import Path

from alnair_agent.node import region_layout as L

_FMT = {name: "<" + code for name, (code, _) in L.CTYPES.items()}


class RegionError(Exception):
    """The region file is missing, the wrong size, or has a bad magic/version."""


def _check_plain(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"region {path}: not a regular file (mode 0o{st.st_mode:o})")
    if st.st_nlink != 1:
        raise RegionError(f"region {path}: has {st.st_nlink} links, expected 1")
    if st.st_size != L.REGION_SIZE:
        raise RegionError(f"region {path}: size {st.st_size} bytes, expected {L.REGION_SIZE}")


def _fields(block: str) -> dict[str, tuple[int, str]]:
    for name, fields, _, _ in L.BLOCKS:
        if name == block:
            return {f.name: (f.offset, _FMT[f.ctype]) for f in fields}
    raise KeyError(block)


_HEADER = _fields("alnair_region_header")
_AGENT = _fields("alnair_region_agent")
_SLOT = _fields("alnair_region_slot")


def _block_struct(block: str, size: int) -> tuple[struct.Struct, tuple[str, ...]]:
    """One struct for a whole block (padding as 'x') and its field names in order: one pread, one unpack."""
    fields = sorted(next(fs for name, fs, _, _ in L.BLOCKS if name == block), key=lambda f: f.offset)
    fmt, pos = "<", 0
    for f in fields:
        fmt += "x" * (f.offset - pos) + L.CTYPES[f.ctype][0]
        pos = f.offset + L.CTYPES[f.ctype][1]
    return struct.Struct(fmt + "x" * (size - pos)), tuple(f.name for f in fields)


_SLOT_STRUCT, _SLOT_NAMES = _block_struct("alnair_region_slot", L.SLOT_SIZE)
# where each SlotReading field sits in a slot's unpacked tuple
_SLOT_READ = tuple(_SLOT_NAMES.index(n) for n in ("pid", "start_time", "memory_used", "launches", "gpu_ns",
                                                   "overrun_ns", "wait_ns", "copy_bytes", "held_ns", "holds"))
_AGENT_STRUCT, _AGENT_NAMES = _block_struct("alnair_region_agent", L.AGENT_BLOCK_SIZE)
_TURN = ("turn_epoch_ns", "turn_period_ns", "turn_offset_ns", "turn_length_ns", "turn_free_until_ns", "turn_spare_ns")
_TURN_OF = operator.itemgetter(*_TURN)  # the turn fields of an agent block's values, in Turn's order
_TURN_ATTRS = operator.attrgetter(*(f.removeprefix("turn_") for f in _TURN))  # the same fields of a Turn
# No lease the agent writes is longer (a few dispatcher ticks): found in a file after a restart, a longer one is a
# container's doing, as is a period over L.MAX_TURN_PERIOD_NS.
MAX_LEASE_NS = 10_000_000_000
_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Turn:
    """A container's turns on its GPU: it may launch during [epoch + k*period + offset, ... + length) for every k,
    and at any time before free_until (monotonic ns); work may run spare_ns past a window's end (nobody's time, owed
    back). period 0: no schedule (the shim takes its cap's part of the default period at offset 0)."""

    epoch_ns: int = 0
    period_ns: int = 0
    offset_ns: int = 0
    length_ns: int = 0
    free_until_ns: int = 0
    spare_ns: int = 0

    def fields(self) -> dict[str, int]:
        return dict(zip(_TURN, astuple(self), strict=True))

    def inside(self) -> bool:
        """The window inside its period (or the whole of it), and the spare after it within what the period leaves;
        no schedule (period 0): neither."""
        return (0 <= self.offset_ns <= max(self.period_ns - 1, 0) and 0 <= self.length_ns <= self.period_ns
                and 0 <= self.spare_ns <= self.period_ns - self.length_ns)

    def sound(self, now_ns: int) -> bool:
        """A schedule the agent could have written: a period within bounds, a window inside it (or the whole of
        it), an epoch not in the future and a lease not far beyond now."""
        if not self.inside() or self.free_until_ns > now_ns + MAX_LEASE_NS:
            return False
        if self.period_ns == 0:
            return self.epoch_ns == 0
        return self.period_ns <= L.MAX_TURN_PERIOD_NS and self.epoch_ns <= now_ns


@dataclass
class AgentBlock:
    """What the agent last wrote into one region's agent block: the truth for the agent, whatever the file says
    now. Every field of the layout's agent block, by name."""

    values: dict[str, int]

    @classmethod
    def fresh(cls) -> "AgentBlock":
        return cls({name: 0 for name in _AGENT_NAMES})


def _pids_struct() -> struct.Struct:
    """Every slot's pid in one unpack: the dispatcher reads each capped container's slots 20 times a second, and
    unpacking only the claimed ones (a few of 64) costs 40 % less."""
    pid = next(f for f in next(fs for name, fs, _, _ in L.BLOCKS if name == "alnair_region_slot") if f.name == "pid")
    code, size = L.CTYPES[pid.ctype]
    one = "x" * pid.offset + code + "x" * (L.SLOT_SIZE - pid.offset - size)
    return struct.Struct("<" + one * L.MAX_SLOTS)


_PIDS_STRUCT = _pids_struct()


@dataclass(frozen=True)
class SlotReading:
    """One live process slot as the agent read it (already checked for sane values)."""

    index: int
    pid: int
    start_time: int
    memory_used: int
    launches: int
    gpu_ns: int
    overrun_ns: int
    wait_ns: int
    copy_bytes: int = 0
    held_ns: int = 0  # held back for a latency container of its GPU
    holds: int = 0


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in ns: the clock the shim reads too (same kernel, so the same epoch)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class Region:
    """An open region file. Use `Region.create` for a new container, `Region.open` for one that exists (pass the
    allocation's `AgentBlock` when the agent has one; without, the block is adopted from the file, checked)."""

    def __init__(self, path: Path, fd: int, block: AgentBlock | None = None) -> None:
        self.path = path
        self._fd = fd
        self.block = block if block is not None else AgentBlock.fresh()

    # -- lifetime -------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, memory_limit: int, compute_limit: int) -> "Region":
        """Write a fresh region with these limits (bytes; percent, 0 = none) and no turns yet (the shim's default
        window for its cap until the dispatcher lays out the GPU's turns)."""
        if memory_limit < 0:
            raise ValueError(f"memory_limit must be >= 0 bytes, got {memory_limit}")
        if not 0 <= compute_limit <= 100:
            raise ValueError(f"compute_limit must be 0..100 percent, got {compute_limit}")
        tmp = path.with_name(path.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        region = cls(path, fd)
        try:
            region._fill(memory_limit, compute_limit)
            # The container may open the file the moment it exists under its final name: publish it complete.
            # 0666: the container's user may be any uid; no host user reaches it (its folders are 0700/0711).
            os.fchmod(fd, 0o666)
            os.replace(tmp, path)
        except BaseException:
            region.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return region

    def _fill(self, memory_limit: int, compute_limit: int) -> None:
        """Write the header and the limits into a new file. ENOSPC shows here, not later: the whole file is
        allocated first (a sparse file could fail on the container's first write instead)."""
        region = self
        try:
            os.posix_fallocate(self._fd, 0, L.REGION_SIZE)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self._fd, L.REGION_SIZE)
        region._put(_HEADER, "magic", L.MAGIC)
        region._put(_HEADER, "version", L.VERSION)
        region._put(_HEADER, "size", L.REGION_SIZE)
        region._put(_HEADER, "slot_count", L.MAX_SLOTS)
        region._put(_HEADER, "slot_size", L.SLOT_SIZE)
        region._aput("memory_limit", memory_limit)
        region._aput("compute_limit", compute_limit)

    @classmethod
    def open(cls, path: Path, block: AgentBlock | None = None) -> "Region":
        """Open an existing region, refusing anything but a plain file of the right size, magic and version.

        The container can put anything at this path (a link to a host file, a FIFO, a device node it made with
        mknod, a socket, a folder). Nothing is opened for reading or writing before it is known to be a plain
        file: an O_PATH descriptor (opens nothing, follows no link, never blocks) is checked with fstat, and only
        that same inode is then reopened read-write through /proc/self/fd (so a swap in between changes nothing).
        """
        try:
            pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise RegionError(f"region {path}: cannot open: {e.strerror}") from e
        try:
            st = os.fstat(pfd)
            _check_plain(path, st)
            try:
                fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                raise RegionError(f"region {path}: cannot open: {e.strerror}") from e
        finally:
            os.close(pfd)
        try:
            again = os.fstat(fd)
            if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
                raise RegionError(f"region {path}: replaced while being opened")
            _check_plain(path, again)
        except BaseException:
            os.close(fd)
            raise
        region = cls(path, fd, block)
        try:
            magic, version = region._get(_HEADER, "magic"), region._get(_HEADER, "version")
            if magic != L.MAGIC or version != L.VERSION:
                raise RegionError(f"region {path}: magic 0x{magic:08x} version {version}, expected "
                                  f"0x{L.MAGIC:08x} version {L.VERSION}")
            if block is None:
                region._adopt()
        except BaseException:
            region.close()
            raise
        return region

    def _adopt(self) -> None:
        """Take the agent block from the file (an agent restart: nothing in memory), checked. The limits are taken
        as found (the caller compares them with the allocation's record and rewrites them). Turns that are
        half-written (odd sequence) or that no agent writes (see Turn.sound) are replaced by no schedule (the
        shim's default window for its cap) until the dispatcher publishes the GPU's; sound ones stay in force."""
        found = self.read_agent_block()
        self.block.values.update(found)
        seq = found["turn_seq"]
        self.block.values["turn_seq"] = (seq + (seq & 1)) & _U32
        if seq & 1 or not self.turn().sound(monotonic_ns()):
            self._write_turn(Turn())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- raw access -----------------------------------------------------------------------------------------
    def _read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise RegionError(f"region {self.path}: truncated (read {len(data)} of {size} bytes at {offset})")
        return data

    def _get(self, block: dict[str, tuple[int, str]], field: str, base: int = 0) -> int:
        off, fmt = block[field]
        return struct.unpack(fmt, self._read(base + off, struct.calcsize(fmt)))[0]

    def _put(self, block: dict[str, tuple[int, str]], field: str, value: int, base: int = 0) -> None:
        off, fmt = block[field]
        os.pwrite(self._fd, struct.pack(fmt, value), base + off)

    def _aput(self, field: str, value: int) -> None:
        """Write one agent field, and remember it as the agent's own value."""
        self._put(_AGENT, field, value, L.HEADER_SIZE)
        self.block.values[field] = value

    def read_agent_block(self) -> dict[str, int]:
        """The agent block as the file holds it now (one read; untrusted: the container may have written it)."""
        return dict(zip(_AGENT_NAMES, _AGENT_STRUCT.unpack(self._read(L.HEADER_SIZE, _AGENT_STRUCT.size)),
                        strict=True))

    def restore(self) -> dict[str, tuple[int, int]]:
        """Put back every agent field the file holds differently from what the agent wrote; returns them as
        {field: (found, written)}. The turn fields go back whole, under their sequence lock."""
        found = self.read_agent_block()
        changed = {f: (v, self.block.values[f]) for f, v in found.items() if v != self.block.values[f]}
        for f in changed:
            if f != "turn_seq" and f not in _TURN:
                self._aput(f, self.block.values[f])
        if "turn_seq" in changed or any(f in changed for f in _TURN):
            self._write_turn(self.turn())
        return changed

    # -- agent fields (the agent is their only writer; these are its own values, never the file's) -------------
    @property
    def memory_limit(self) -> int:
        return self.block.values["memory_limit"]

    @property
    def compute_limit(self) -> int:
        return self.block.values["compute_limit"]

    @property
    def heartbeat_ns(self) -> int:
        return self.block.values["heartbeat_ns"]

    def set_limits(self, memory_limit: int, compute_limit: int) -> None:
        """Change the limits of a live region (the dispatcher lays out the turns for a new compute limit)."""
        if memory_limit < 0:
            raise ValueError(f"memory_limit must be >= 0 bytes, got {memory_limit}")
        if not 0 <= compute_limit <= 100:
            raise ValueError(f"compute_limit must be 0..100 percent, got {compute_limit}")
        self._aput("memory_limit", memory_limit)
        if compute_limit != self.compute_limit:
            self._aput("compute_limit", compute_limit)

    def set_class(self, compute_class: int, board_slot: int = 0, hold_mask: int = 0, hold_pct: int = 0) -> None:
        """The container's compute class and what it holds back for (region_layout's agent fields); only what
        changed is written (the dispatcher sets them every tick)."""
        if compute_class not in (L.CLASS_TURNS, L.CLASS_LATENCY):
            raise ValueError(f"compute_class must be {L.CLASS_TURNS} or {L.CLASS_LATENCY}, got {compute_class}")
        if not 0 <= board_slot < L.BOARD_SLOTS or not 0 <= hold_mask < 1 << L.BOARD_SLOTS or not 0 <= hold_pct <= 100:
            raise ValueError(f"board slot {board_slot}, hold mask {hold_mask:#x}, hold {hold_pct} %: out of range")
        for f, v in (("compute_class", compute_class), ("board_slot", board_slot), ("hold_mask", hold_mask),
                     ("hold_pct", hold_pct)):
            if self.block.values[f] != v:
                self._aput(f, v)

    def beat(self, now_ns: int | None = None) -> None:
        self._aput("heartbeat_ns", monotonic_ns() if now_ns is None else now_ns)

    def turn(self) -> Turn:
        """The container's turns as the agent last wrote them."""
        return Turn(*_TURN_OF(self.block.values))

    def set_turn(self, turn: Turn) -> bool:
        """Publish the container's turns (under the sequence lock); False when they are already these."""
        if turn.period_ns < 0 or min(turn.epoch_ns, turn.free_until_ns) < 0 or not turn.inside():
            raise ValueError(f"not a schedule: {turn}")
        if _TURN_OF(self.block.values) == _TURN_ATTRS(turn):
            return False  # the dispatcher's every tick, for every capped container: no Turn built to compare
        self._write_turn(turn)
        return True

    def _write_turn(self, turn: Turn) -> None:
        """The turn fields under their sequence lock (odd while written), the sequence continuing the agent's own."""
        seq = self.block.values["turn_seq"]
        self._aput("turn_seq", (seq + 1) & _U32)
        for f, v in turn.fields().items():
            self._aput(f, v)
        self._aput("turn_seq", (seq + 2) & _U32)

    # -- slots (written by the container: untrusted) --------------------------------------------------------
    def slots(self) -> list[SlotReading]:
        """The claimed slots. A slot with a pid <= 0 is free (or garbage only the container could have written)."""
        data = self._read(L.SLOTS_OFFSET, L.MAX_SLOTS * L.SLOT_SIZE)
        pids = _PIDS_STRUCT.unpack(data)
        if max(pids) <= 0:  # no process in it (a slice whose containers have not started): the common case
            return []
        return [
            SlotReading(i, *(values[k] for k in _SLOT_READ))
            for i, pid in enumerate(pids) if pid > 0
            for values in (_SLOT_STRUCT.unpack_from(data, i * L.SLOT_SIZE),)
        ]

    def memory_in_use(self, slots: list[SlotReading] | None = None) -> int:
        """Bytes the container's live slots claim to hold, clamped to the limit so a liar cannot overflow us.
        Pass `slots` already read to avoid reading them again."""
        total = sum(s.memory_used for s in (self.slots() if slots is None else slots))
        limit = self.memory_limit
        return min(total, limit) if limit else total


_BOARD_HEADER = _fields("alnair_board_header")
_BOARD_SLOT = _fields("alnair_board_slot")


class Board:
    """A GPU's board (region_layout's board blocks): created and kept whole by the agent, hard-linked into each
    capped container's run folder of that GPU. Every container of the GPU may write it, so the agent reads nothing
    from it that it trusts; it only makes it, clears a slot it hands out, and puts back a file cut short (a shim
    reading a truncated mapping would fault)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def create(cls, path: Path) -> "Board":
        """The board at `path`, made whole (created when missing, its header and size put back when not)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        board = cls(path, fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RegionError(f"board {path}: not a regular file")
            os.fchmod(fd, 0o666)  # any container uid maps it; its folder keeps host users out
            board.repair()
        except BaseException:
            board.close()
            raise
        return board

    def repair(self) -> bool:
        """Put the size and header back if anyone changed them; True when something was put back."""
        fixed = False
        if os.fstat(self._fd).st_size != L.BOARD_SIZE:
            os.ftruncate(self._fd, L.BOARD_SIZE)
            fixed = True
        for f, v in (("magic", L.BOARD_MAGIC), ("version", L.BOARD_VERSION), ("size", L.BOARD_SIZE)):
            off, fmt = _BOARD_HEADER[f]
            if struct.unpack(fmt, os.pread(self._fd, struct.calcsize(fmt), off).ljust(struct.calcsize(fmt), b"\0"))[0] != v:
                os.pwrite(self._fd, struct.pack(fmt, v), off)
                fixed = True
        return fixed

    def clear(self, slot: int) -> None:
        """A slot handed to a new latency container starts idle (its last owner's busy time is not its own)."""
        off, fmt = _BOARD_SLOT["busy_until_ns"]
        os.pwrite(self._fd, struct.pack(fmt, 0), L.BOARD_HEADER_SIZE + slot * L.BOARD_SLOT_SIZE + off)

    def busy_until(self, slot: int) -> int:
        """What slot `slot` says now (untrusted: for people and tests, never for a decision)."""
        off, fmt = _BOARD_SLOT["busy_until_ns"]
        data = os.pread(self._fd, 8, L.BOARD_HEADER_SIZE + slot * L.BOARD_SLOT_SIZE + off)
        return struct.unpack(fmt, data)[0] if len(data) == 8 else 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
