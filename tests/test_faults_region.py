"""A hostile container against its own region file: it can write anything over any field of the layout (its slots,
and the agent's header and agent block too, since the file is writable as a whole). The agent stays responsive,
the other containers are untouched, the agent's own fields come back, and a restarted agent starts on the same
file. (Issue 17: an odd sequence word over the grant line used to stop the agent's event loop for good.)"""

from __future__ import annotations

import asyncio
import os
import random
import struct
import time
from dataclasses import replace

import pytest
from faults_util import agent_process, count, free_port, http_get, kill, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_faults import region_of

from alnair_agent.constants import ENV_ALLOCATION_ID, RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.node import region_layout as L
from alnair_agent.node.region import AgentBlock, Region, Turn, monotonic_ns
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import node_settings, registered

MEM, SM = RESOURCE_MEMORY, RESOURCE_COMPUTE


def every_field() -> list[tuple[str, str, int, int]]:
    """(block, field, absolute offset, width) of every field of the layout (slot fields of slot 0)."""
    return [(block, f.name, L.absolute_offset(block, f.name), L.CTYPES[f.ctype][1])
            for block, fields, _, _ in L.BLOCKS for f in fields]


def hostile_values(width: int) -> list[int]:
    top = (1 << (8 * width)) - 1
    return [1, 3, top, top - 1, 1 << (8 * width - 1), 0]  # odd, all ones, sign bit, zero


def scribble(path, offset: int, data: bytes) -> None:  # type: ignore[no-untyped-def]
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


async def responsive(port: int, within_s: float = 1.0) -> None:
    started = time.monotonic()
    status, _ = await asyncio.wait_for(http_get(port, "/livez"), within_s)
    assert status == 200, "the agent's /livez did not answer 200"
    assert time.monotonic() - started < within_s


# -- the Region alone, over every field and many values -------------------------------------------------------
AGENT_FIELDS = [(f, o, w) for b, f, o, w in every_field() if b == "alnair_region_agent"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(AGENT_FIELDS), value=st.integers(min_value=0), junk=st.binary(min_size=64, max_size=64))
def test_no_agent_field_value_blocks_a_read_and_each_is_put_back(tmp_path, which, value, junk):
    name, offset, width = which
    path = tmp_path / "region"
    region = Region.create(path, 4 << 30, 30)
    try:
        before = dict(region.block.values)
        scribble(path, offset, (value % (1 << (8 * width))).to_bytes(width, "little"))
        assert region.turn().fields() == {k: v for k, v in before.items() if k.startswith("turn_") and k != "turn_seq"}
        region.set_turn(Turn(monotonic_ns(), 50_000_000, 0, 20_000_000))  # the agent's own sequence, whatever the file
        written = dict(region.block.values)
        scribble(path, L.HEADER_SIZE, junk)  # and the whole block at random
        region.restore()
        assert region.read_agent_block() == region.block.values  # the file holds the agent's own block again
        assert {k: v for k, v in region.block.values.items() if k != "turn_seq"} == \
               {k: v for k, v in written.items() if k != "turn_seq"}  # (the turns went back under a new sequence)
        assert region.block.values["turn_seq"] % 2 == 0
    finally:
        region.close()


@pytest.mark.parametrize("name,offset,width", AGENT_FIELDS)
def test_an_agent_restarted_on_a_scribbled_region_adopts_a_sound_line(tmp_path, name, offset, width):
    """After a restart (no AgentBlock in memory) the block is taken from the file once: half-written or impossible
    turns are dropped (the shim's default window for its cap) until the dispatcher writes the GPU's again."""
    path = tmp_path / "region"
    Region.create(path, 4 << 30, 30).close()
    for value in hostile_values(width):
        scribble(path, offset, value.to_bytes(width, "little"))
        region = Region.open(path)
        try:
            v = region.block.values
            assert v["turn_seq"] % 2 == 0
            assert region.read_agent_block()["turn_seq"] % 2 == 0
            assert region.turn().sound(monotonic_ns())
            assert region.read_agent_block() == v
        finally:
            region.close()


def test_handles_on_one_region_share_the_agents_record(tmp_path):
    """Each service holds its own handle; what one writes, the others (and restore) know as the agent's own."""
    path = tmp_path / "region"
    a = Region.create(path, 1 << 30, 20)
    b = Region.open(path, a.block)
    try:
        a.set_turn(Turn(monotonic_ns(), 50_000_000, 0, 25_000_000))
        b.beat(123)
        assert a.restore() == {} and b.restore() == {}
        assert isinstance(a.block, AgentBlock) and a.block is b.block
    finally:
        a.close()
        b.close()


# -- the real agent process --------------------------------------------------------------------------------------
async def test_hostile_values_over_every_field_leave_the_agent_and_the_others_untouched(root):
    port = free_port()
    settings_ = node_settings(root, metrics_port=port, resync_interval_s=0.2)
    async with KubeletEmulator(settings_.device_plugin_dir, settings_.pod_resources_socket) as kubelet:
        async with agent_process(settings_) as agent:
            await registered(kubelet, timeout=20)
            victim_id = (await kubelet.admit("default", "victim", "main", {MEM: 1, SM: 30}))[MEM].envs[ENV_ALLOCATION_ID]
            good_id = (await kubelet.admit("default", "good", "main", {MEM: 2, SM: 50}))[MEM].envs[ENV_ALLOCATION_ID]
            victim, good = region_of(settings_.workspace, victim_id), region_of(settings_.workspace, good_id)
            good_region = Region.open(good)
            # both look like running containers: a live process in a slot
            for path in (victim, good):
                scribble(path, L.absolute_offset("alnair_region_slot", "pid"), struct.pack("<i", os.getpid()))
            await asyncio.sleep(0.3)  # the dispatcher has laid out the GPU's turns
            good_before = good_region.read_agent_block()
            rng = random.Random(17)
            for _block, _name, offset, width in every_field():  # one field at a time, then put back
                original = victim.read_bytes()[offset:offset + width]
                for value in hostile_values(width) + [rng.getrandbits(8 * width)]:
                    scribble(victim, offset, value.to_bytes(width, "little"))
                    await asyncio.sleep(0.06)  # a dispatcher tick or more
                    await responsive(port)
                scribble(victim, offset, original)
            for _ in range(40):  # random bytes over the agent block and the slots
                offset = rng.randrange(L.HEADER_SIZE, L.REGION_SIZE - 64)
                scribble(victim, offset, rng.randbytes(rng.randrange(1, 64)))
                await asyncio.sleep(0.03)
            await responsive(port)
            beat = good_region.read_agent_block()["heartbeat_ns"]
            await wait_until(lambda: good_region.read_agent_block()["heartbeat_ns"] > beat, 3)
            after = good_region.read_agent_block()
            assert {k: v for k, v in after.items() if k != "heartbeat_ns"} == \
                   {k: v for k, v in good_before.items() if k != "heartbeat_ns"}, "the other container was touched"
            # the victim's own agent fields come back (its header too is left as it is: its own loss)
            scribble(victim, L.absolute_offset("alnair_region_agent", "turn_seq"), struct.pack("<I", 7))
            await wait_until(lambda: file_block(victim)["turn_seq"] % 2 == 0, 3)
            assert count(agent, "dispatcher_tick_failed") == 0
            assert count(agent, "profiler_tick_failed") == 0
            assert count(agent, "region_restored", allocation=good_id) == 0
            assert agent.proc is not None and agent.proc.poll() is None
            # a restarted agent on the same hostile file: an odd sequence word, garbage in the slots
            scribble(victim, L.absolute_offset("alnair_region_agent", "turn_seq"), struct.pack("<I", 0x7FFFFFFF))
            scribble(victim, L.SLOTS_OFFSET, rng.randbytes(L.MAX_SLOTS * L.SLOT_SIZE))
            kill(agent)
        since = len(kubelet.registrations)
        async with agent_process(settings_) as again:
            await registered(kubelet, timeout=20, since=since)
            for _ in range(10):
                await responsive(port)
                await asyncio.sleep(0.1)
            beat = good_region.read_agent_block()["heartbeat_ns"]
            await wait_until(lambda: good_region.read_agent_block()["heartbeat_ns"] > beat, 3)
            assert count(again, "dispatcher_tick_failed") == 0
            assert count(again, "profiler_tick_failed") == 0
        good_region.close()


def file_block(path) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The agent block as the file holds it (a handle of its own that adopts nothing)."""
    region = Region.open(path, AgentBlock.fresh())
    try:
        return region.read_agent_block()
    finally:
        region.close()


@pytest.mark.parametrize("turn", [
    Turn(1, 50_000_000, 0, 20_000_000, 0, 30_000_001),  # spare past the period's end
    Turn(1, 50_000_000, 0, 20_000_000, 0, -1),
    Turn(0, 0, 0, 0, 0, 1),  # no schedule has no spare
])
def test_a_spare_the_period_cannot_hold_is_refused_and_never_sound(tmp_path, turn):
    path = tmp_path / "region"
    Region.create(path, 0, 30).close()
    region = Region.open(path)
    try:
        if turn.period_ns:
            with pytest.raises(ValueError, match="not a schedule"):
                region.set_turn(turn)
        assert not turn.sound(monotonic_ns())
        assert region.set_turn(Turn(1, 50_000_000, 0, 20_000_000, 0, 30_000_000))  # all the period leaves: fine
    finally:
        region.close()


def test_set_turn_writes_a_turn_that_differs_only_in_its_spare(tmp_path):
    """set_turn skips a turn already written by comparing the block's fields with the Turn's: every field counts,
    the spare included (a change of the spare alone must reach the shim)."""
    path = tmp_path / "region"
    Region.create(path, 0, 30).close()
    region = Region.open(path)
    try:
        turn = Turn(1, 50_000_000, 0, 20_000_000, 0, 0)
        assert region.set_turn(turn)
        assert not region.set_turn(turn)  # already these
        for changed in (replace(turn, spare_ns=5_000_000), replace(turn, spare_ns=5_000_000, free_until_ns=7),
                        replace(turn, spare_ns=5_000_000, free_until_ns=7, offset_ns=1)):
            assert region.set_turn(changed)
            assert region.turn() == changed
            assert not region.set_turn(changed)
    finally:
        region.close()
