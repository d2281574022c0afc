"""`fit.judge_all` over every node of the view at once, in columns.

Each node kept here has a position; per GPU slot (a node's rooms in their order) one column holds every node's
memory free and one its compute free, a fixed-width field per position inside one big integer. "Do k GPUs have m
memory and c compute free" is then a handful of big-integer operations over all the nodes together (fields
compared in parallel, SWAR), not a Python loop per node: a question no node was asked before (the slowest
requests, bench/RESULTS.md) costs about a millisecond at 5,000 nodes, most of it mapping the request's names to
positions, where the loop took 3-7. Prioritize's PACK score is worked out the same way (`packed`).

The answers are exactly `fit.judge_all`'s (the same facts, the same words; tests/test_columns.py compares them over
many seeded clusters and pods), which answers as `fit.place` decides: this is a faster way to count, not a second
fit rule. A node whose units do not fit a 64-bit field is not kept here (the caller judges it one by one).

Field layout, `width` bytes per field, little-endian, position p at bits [8·width·p, 8·width·(p+1)): a room's free
units v are stored as v + 1 (0: no room there, or a negative free that holds nothing), so that "v >= m" is
"stored >= m + 1" and an empty field never holds anything. The field's top bit stays 0 (the guard): subtracting
the threshold from (field | guard) leaves the guard set exactly where the field is at least the threshold, and no
field borrows from the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from alnair_agent.node import fit

_WIDTHS = (2, 4, 8)  # bytes per field; widened (everything re-laid) when a node's units need more
MAX_CODES = 250  # distinct answers one question may have (a code per position is one byte)
# A question's answer per node, one byte: these three, or the index of a (resolvable, why) in its table.
NOT_JUDGED = 0  # a position no class judged (no node there): as UNDECIDED, i.e. placed
FITS = 1
UNDECIDED = 2
_TABLE: list[fit.Judged] = [fit.UNDECIDED, None, fit.UNDECIDED]

Totals = tuple[tuple[int, int], ...]
_Row = tuple[Totals, tuple[tuple[int, int], ...], tuple[int, int, int] | None]  # totals, rooms' fields, scores'
_LIMIT = 1 << 63  # what a field of 64 bits holds beside its guard bit
_HALF = 1 << 62  # prioritize adds two such numbers in a field


@dataclass
class _Ints:
    """The columns as integers, rebuilt after a change (one `int.from_bytes` per column), for one or more questions."""

    bits: int  # bits per field
    ones: int  # 1 in every field
    guard: int  # the top bit of every field
    memory: list[int]  # per slot: memory column | guard
    compute: list[int]
    classes: dict[Totals, int]  # per set of GPUs offered: 1 in the fields of its nodes


@dataclass
class _Wide:
    """Prioritize's columns as integers (64-bit fields), rebuilt after a change."""

    ones: int
    guard: int
    base: int  # without the guard bits, unlike the two below
    left_memory: int
    left_compute: int
    scorable: int  # 1 where the three above hold
    classes: dict[Totals, int]  # 1 in the fields of each class's nodes


@dataclass
class Columns:
    """The kept nodes' rooms in columns; written when a node is summarized (`set`), dropped when it changes."""

    width: int = _WIDTHS[0]
    pos: dict[str, int] = field(default_factory=dict)  # node -> position
    _rows: dict[str, _Row] = field(default_factory=dict)  # what is stored for each node
    _spare: list[int] = field(default_factory=list)  # positions freed by dropped nodes
    _size: int = 0  # positions in use or spare
    _cap: int = 0  # positions the columns have room for
    _memory: list[bytearray] = field(default_factory=list)  # per slot
    _compute: list[bytearray] = field(default_factory=list)
    _classes: dict[Totals, bytearray] = field(default_factory=dict)
    # Prioritize's columns, 64-bit fields whatever `width`: score_added's numerator part, memory and compute free
    # (+ 1), and 1 where those hold (see `set`)
    _scores: list[bytearray] = field(default_factory=list)
    _members: dict[Totals, int] = field(default_factory=dict)  # how many nodes each class has
    _ints: _Ints | None = None
    _wide: _Wide | None = None

    # -- feeding -------------------------------------------------------------------------------------------------
    def set(self, node: str, rooms: Sequence[fit.Room], free: fit.FreeSummary) -> bool:
        """Keep `node`'s rooms (in their order) and `free`, their summary; False (and the node not kept) when a
        value needs more than a 64-bit field."""
        totals = tuple((r.memory_total, r.compute_total) for r in rooms)
        values = tuple((r.memory_free + 1 if r.memory_free >= 0 else 0, r.compute_free + 1 if r.compute_free >= 0
                        else 0) for r in rooms)
        top = max((max(v) for v in values), default=0)
        if top >= _LIMIT:
            self.drop(node)
            return False
        # prioritize's score: the node's part of score_added's numerator, and the memory and compute free on it
        # (+ 1, as above); none where score_added takes another way (see `packed`)
        base, left_m, left_c = free[9], free[7] + 1, free[8] + 1
        scores = (base, max(0, left_m), max(0, left_c)) if base is not None and 0 <= base < _HALF and max(
            left_m, left_c) < _LIMIT else None
        row = (totals, values, scores)
        if self._rows.get(node) == row:
            return True
        self.drop(node)
        if top >= 1 << (8 * self.width - 1):
            self._relay(next(w for w in _WIDTHS if top < 1 << (8 * w - 1)))
        p = self._spare.pop() if self._spare else self._grow()
        self.pos[node] = p
        self._rows[node] = row
        self._write(p, row, 1)
        return True

    def drop(self, node: str) -> None:
        p = self.pos.pop(node, None)
        if p is None:
            return
        totals, values, _ = self._rows.pop(node)
        self._write(p, (totals, tuple((0, 0) for _ in values), None), 0)
        self._spare.append(p)

    def _grow(self) -> int:
        p = self._size
        self._size += 1
        if self._size > self._cap:
            extra = max(64, self._cap // 4)  # every question's work is in proportion to the room: keep it tight
            for column in (*self._memory, *self._compute, *self._classes.values()):
                column.extend(bytes(extra * self.width))
            for column in self._scores:
                column.extend(bytes(extra * 8))
            self._cap += extra
        return p

    def _write(self, p: int, row: _Row, member: int) -> None:
        totals, values, scores = row
        w = self.width
        while len(self._memory) < len(values):
            self._memory.append(bytearray(self._cap * w))
            self._compute.append(bytearray(self._cap * w))
        while len(self._scores) < 4:
            self._scores.append(bytearray(self._cap * 8))
        at = slice(p * w, (p + 1) * w)
        for j, (m, c) in enumerate(values):
            self._memory[j][at] = m.to_bytes(w, "little")
            self._compute[j][at] = c.to_bytes(w, "little")
        wide = slice(p * 8, (p + 1) * 8)
        for column, value in zip(self._scores, (*scores, 1) if scores else (0, 0, 0, 0), strict=True):
            column[wide] = value.to_bytes(8, "little")
        flags = self._classes.get(totals)
        if flags is None:
            flags = self._classes[totals] = bytearray(self._cap * w)
        flags[at] = member.to_bytes(w, "little")
        count = self._members[totals] = self._members.get(totals, 0) + (1 if member else -1)
        if count <= 0:  # no node of these GPUs any more: forget the class
            del self._members[totals], self._classes[totals]
        self._ints = self._wide = None

    def _relay(self, width: int) -> None:
        """Lay every column out again with `width`-byte fields."""
        rows = [(self.pos[node], self._rows[node]) for node in self.pos]
        self.width = width
        self._memory, self._compute, self._classes, self._members = [], [], {}, {}
        for p, row in rows:
            self._write(p, row, 1)

    def _as_ints(self) -> _Ints:
        ints = self._ints
        if ints is None:
            w, n = self.width, self._cap
            bits = 8 * w
            ones = int.from_bytes(b"\x01".ljust(w, b"\x00") * n, "little")
            guard = ones << (bits - 1)
            ints = self._ints = _Ints(bits, ones, guard,
                                      [int.from_bytes(c, "little") | guard for c in self._memory],
                                      [int.from_bytes(c, "little") | guard for c in self._compute],
                                      {t: int.from_bytes(c, "little") for t, c in self._classes.items()})
        return ints

    def _as_wide(self) -> _Wide:
        wide = self._wide
        if wide is None:
            n, w = self._cap, self.width
            ones = int.from_bytes(b"\x01".ljust(8, b"\x00") * n, "little")
            guard = ones << 63
            base, left_m, left_c, scorable = (int.from_bytes(c, "little") for c in self._scores)
            classes = {}
            for totals, flags in self._classes.items():
                spread = bytearray(n * 8)
                spread[::8] = flags[::w]  # one byte per position, from `width`-byte fields to 8-byte ones
                classes[totals] = int.from_bytes(spread, "little")
            wide = self._wide = _Wide(ones, guard, base, left_m | guard, left_c | guard, scorable, classes)
        return wide

    # -- judging -------------------------------------------------------------------------------------------------
    def judge_all(self, shape: fit.Shape, names: Sequence[str], policy: str) -> list[fit.Judged] | None:
        """`fit.judge_all(shape, [each node's FreeSummary], policy)` for `names`, every one of them kept here;
        None when the question has more distinct answers than a byte tells apart (the caller asks fit.judge_all)."""
        coded = self.codes(shape, names, policy)
        return None if coded is None else list(map(coded[1].__getitem__, coded[0]))

    def codes(self, shape: fit.Shape, names: Sequence[str], policy: str) -> tuple[bytes, list[fit.Judged]] | None:
        """`judge_all` as one byte per name, and what each byte means (FITS: None, UNDECIDED, or an answer): the
        caller sorts thousands of names by answer with C-level maps over the bytes. A name not kept here gets
        NOT_JUDGED (to be judged some other way)."""
        if not shape.needs:
            return bytes([FITS]) * len(names), _TABLE[:]
        if shape.has_init:
            return bytes([UNDECIDED]) * len(names), _TABLE[:]
        ints = self._as_ints()
        question = _Question(ints)
        table = _TABLE[:]
        index: dict[tuple[bool, str], int] = {}

        def code(answer: tuple[bool, str]) -> int:
            i = index.get(answer)
            if i is None:
                i = index[answer] = len(table)
                table.append(answer)
            return i

        codes = 0
        for totals, members in ints.classes.items():
            codes += self._judge_class(shape, totals, members, policy, question, code)
            if len(table) > MAX_CODES:  # at most one answer per container and set of GPU sizes: a pod of hundreds
                return None
        w, cap = self.width, self._cap
        per_position = codes.to_bytes(cap * w, "little")[::w] + bytes([NOT_JUDGED])  # a name not kept: position cap
        return bytes(map(per_position.__getitem__, map(self.pos.get, names, repeat(cap)))), table

    def _judge_class(self, shape: fit.Shape, totals: Totals, members: int, policy: str, q: _Question,
                     code: Callable[[tuple[bool, str]], int]) -> int:
        """The codes (one per field) of the nodes whose GPUs offer `totals`: judge_all's steps, class by class
        (what depends on the GPUs' sizes is the same for all of them)."""
        if shape.per_gpu:
            each = _memory_each(totals)
            if each < 0:  # GPUs of several sizes: placed
                return members * UNDECIDED
            shape = shape.on(each)
        if len(totals) < shape.gpus:  # too few GPUs: place's own words
            return members * UNDECIDED
        # The shared summary of these GPUs empty, as the nodes' own summaries hold it (Shape keeps `never` and
        # `apart` by its identity, so it must be the long-lived one, not a copy).
        empty = fit.empty_summary(totals)
        q.keep.append(empty)  # alive until the question ends, so no other object takes its identity meanwhile
        ones = q.ints.ones
        if len(shape.each) == 1:
            (m, c, k), = shape.each
            fits = q.holds(m, c, k) & members
            if empty.holds(m, c, k):
                answer = (True, shape.whys[0])
            else:
                answer = (False, fit._why_too_big(shape.steady[0], max(x for x, _ in totals),
                                                  max(y for _, y in totals)))
            return fits * FITS + (members ^ fits) * code(answer)
        together = q.holds(*shape.together) & members
        out = together * FITS
        rest = members ^ together
        never = shape.never(empty, policy)
        for (m, c, k), why in zip(shape.each, shape.whys, strict=True):
            failing = rest & (ones ^ q.holds(m, c, k))  # this container alone finds no room
            if failing:
                out += failing * code((True, why) if never is None else (False, never.why))
                rest ^= failing
        ok = rest
        for m, c, k in shape.apart(empty):
            ok &= q.holds(m, c, k)
        return out + ok * FITS + (rest ^ ok) * UNDECIDED

    # -- scoring -------------------------------------------------------------------------------------------------
    def packed(self, shape: fit.Shape, names: Sequence[str]) -> list[int | None]:
        """`fit.score_added(added, node's FreeSummary, PACK)` for `names`, every one kept here and fitting the pod,
        `added` being the units its steady containers hold there; None where score_added takes another way (units
        capped at what the node offers) or `added` depends on where the pod goes (memory as a percent on GPUs of
        several sizes), for the caller to work out. The same integers as score_added: the floor of its numerator /
        denominator, clipped to 0..MAX_SCORE, as there."""
        wide = self._as_wide()
        ones, guard = wide.ones, wide.guard
        codes = 0
        for totals, members in wide.classes.items():
            members &= wide.scorable
            if not members:
                continue
            sized = shape
            if shape.per_gpu:
                each = _memory_each(totals)
                if each < 0:
                    continue
                sized = shape.on(each)
            am, ac = sized.steady_memory, sized.steady_compute
            b, d = sum(m for m, _ in totals), sum(c for _, c in totals)  # FreeSummary's memory and compute offered
            if am + 1 >= _LIMIT or ac + 1 >= _LIMIT:
                continue
            ok = members & _at_least(wide.left_memory, am + 1, ones, guard) & _at_least(
                wide.left_compute, ac + 1, ones, guard)
            if not ok:
                continue
            denominator, added = 2 * b * d, fit.MAX_SCORE * (am * d + ac * b)
            if added >= _HALF or 16 * denominator >= _HALF:
                continue
            # floor(numerator / denominator) by binary search, every field at once (score <= acc + step when
            # numerator >= (acc + step) x denominator); the numerator is below 2^63: base and added below 2^62 each
            numerator = (wide.base + ones * added) | guard
            score = 0
            for step in (8, 4, 2, 1):
                score += step * ((((numerator - (score + ones * step) * denominator) & guard)) >> 63)
            over = (((score | guard) - ones * (fit.MAX_SCORE + 1)) & guard) >> 63  # clipped at MAX_SCORE
            score = (score & ((ones * 0xF) ^ (over * 0xF))) | (over * fit.MAX_SCORE)
            codes += (score + ones) & (ok * 0xF)  # score + 1 (at most 11) where `ok`, else 0
        per_position = codes.to_bytes(self._cap * 8, "little")[::8]
        return list(map(_SCORES.__getitem__, map(per_position.__getitem__, map(self.pos.__getitem__, names))))


_SCORES: list[int | None] = [None, *range(fit.MAX_SCORE + 1)]  # code -> score


def _memory_each(totals: Totals) -> int:
    """The memory units each of these GPUs offers when they are all the same size (FreeSummary's memory_each),
    else -1: memory asked as a percent is in those units."""
    return totals[0][0] if totals and all(m == totals[0][0] for m, _ in totals) else -1


def _at_least(column: int, threshold: int, ones: int, guard: int) -> int:
    """1 in every field of `column` (with its guard bits set) holding at least `threshold` (0 < it < _LIMIT)."""
    return ((column - ones * threshold) & guard) >> 63


@dataclass
class _Question:
    """One question's counts over the columns, each (memory, compute, count) worked out once."""

    ints: _Ints
    _held: dict[tuple[int, int, int], int] = field(default_factory=dict)
    keep: list[object] = field(default_factory=list)

    def holds(self, memory: int, compute: int, count: int) -> int:
        """1 in the field of every node where `count` distinct rooms each have `memory` and `compute` free."""
        key = (memory, compute, count)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = self._holds(memory, compute, count)
        return held

    def _holds(self, memory: int, compute: int, count: int) -> int:
        ints = self.ints
        ones, guard, top = ints.ones, ints.guard, ints.bits - 1
        if count <= 0:
            return ones
        limit = 1 << top
        if memory + 1 >= limit or compute + 1 >= limit or count > len(ints.memory):
            return 0  # no field holds that much; no node has that many rooms here
        tm, tc = ones * (memory + 1), ones * (compute + 1)
        total = 0
        for m, c in zip(ints.memory, ints.compute, strict=True):
            total += ((m - tm) & (c - tc) & guard) >> top
        return (((total | guard) - ones * count) & guard) >> top
