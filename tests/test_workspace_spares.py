"""Slice folders made ahead (`Workspace.make_spare`) and spec files made ahead (`CdiWriter.make_spare`): a creation
that takes one makes no file, ends exactly as a fresh creation would, and nothing of a spare outlives a restart."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from alnair_agent.constants import (
    ALLOCATION_FILE_NAME,
    CONTAINER_FOLDER_NAME,
    REGION_FILE_NAME,
)
from alnair_agent.dra.cdi import CdiWriter
from alnair_agent.node.edits import ContainerEdits
from alnair_agent.node.region import Region
from alnair_agent.node.workspace import Allocation, Workspace, new_allocation_id

GiB = 1 << 30


def allocation() -> Allocation:
    return Allocation(id=new_allocation_id(), gpu_uuid="GPU-1", device_ids={}, wanted={"alnair/vgpu-memory": 4},
                      memory_limit=4 * GiB, compute_limit=30)


def workspace(tmp_path: Path) -> Workspace:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    return ws


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.lstat().st_mode) for p in [folder, *folder.rglob("*")]}


def test_a_creation_from_a_spare_ends_as_a_fresh_one_and_makes_no_file(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    fresh, taken = allocation(), allocation()
    ws.create(fresh).close()
    spare = ws.make_spare()
    region_inode = (ws.spares_folder / spare.name / CONTAINER_FOLDER_NAME / REGION_FILE_NAME).stat().st_ino
    record_inode = (ws.spares_folder / spare.name / f"{ALLOCATION_FILE_NAME}.tmp").stat().st_ino
    ws.create(taken, spare).close()
    folder = ws.path(taken.id)
    assert (folder / CONTAINER_FOLDER_NAME / REGION_FILE_NAME).stat().st_ino == region_inode
    assert (folder / ALLOCATION_FILE_NAME).stat().st_ino == record_inode  # the record went into the spare's file
    assert sorted(os.listdir(folder)) == sorted(os.listdir(ws.path(fresh.id)))
    assert modes(folder) == modes(ws.path(fresh.id))
    region = ws.open_region(taken.id)
    try:
        assert (region.memory_limit, region.compute_limit) == (4 * GiB, 30)
    finally:
        region.close()
    assert json.loads((folder / ALLOCATION_FILE_NAME).read_text())["id"] == taken.id
    assert os.listdir(ws.spares_folder) == []
    assert [a.id for a in ws.load_all()] == sorted([fresh.id, taken.id])


def test_spares_never_outlive_a_restart(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    held = allocation()
    ws.create(held).close()
    for _ in range(3):
        ws.make_spare().close()
    restarted = Workspace(ws.root)
    assert [a.id for a in restarted.load_all()] == [held.id]  # a spare is no allocation ...
    assert not ws.spares_folder.exists()  # ... and goes at the start


def test_a_spare_that_went_is_replaced_by_a_fresh_creation(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    spare = ws.make_spare()
    ws.remove_spares()  # the workspace cleared under the agent
    alloc = allocation()
    ws.create(alloc, spare).close()
    assert [a.id for a in ws.load_all()] == [alloc.id]


def test_a_spare_that_cannot_be_taken_leaves_the_held_folder_alone_and_its_region_closed(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    held = allocation()
    ws.create(held).close()
    spare = ws.make_spare()
    with pytest.raises(OSError):  # the same id: the rename fails, it never replaces the held folder
        ws.create(replace(held, memory_limit=GiB), spare)
    assert spare.region._fd < 0  # closed with the failure, not leaked
    assert [(a.id, a.memory_limit) for a in ws.load_all()] == [(held.id, held.memory_limit)]


def test_a_spec_written_through_a_spare_is_the_spare_file_and_spares_are_removable(tmp_path: Path) -> None:
    cdi = CdiWriter(tmp_path / "cdi")
    spare = cdi.make_spare()
    assert spare.startswith(".") and not spare.endswith(".json")  # a runtime reading the folder skips it
    inode = (cdi.folder / spare).stat().st_ino
    uid = "c9137fc8-fabe-4d02-a619-e06fd46343f5"
    path = cdi.write(uid, [("0123456789abcdef", ContainerEdits({"A": "1"}, []))], spare)
    assert path.stat().st_ino == inode and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert cdi.read(uid)["devices"][0]["containerEdits"]["env"] == ["A=1"]
    others = [cdi.make_spare() for _ in range(2)]
    assert sorted(os.listdir(cdi.folder)) == sorted([path.name, *others])
    cdi.remove_spares()
    assert os.listdir(cdi.folder) == [path.name]
    # a spare that went (a tmpfs cleared) is no error: the spec is made as without one
    assert cdi.write(uid, [("0123456789abcdef", ContainerEdits({"A": "2"}, []))], others[0]) == path
    assert cdi.read(uid)["devices"][0]["containerEdits"]["env"] == ["A=2"]


def test_a_region_made_ahead_is_a_region_without_limits(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    spare = ws.make_spare()
    spare.close()
    region = Region.open(ws.spares_folder / spare.name / CONTAINER_FOLDER_NAME / REGION_FILE_NAME)
    try:
        assert (region.memory_limit, region.compute_limit) == (0, 0)
    finally:
        region.close()
