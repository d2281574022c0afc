"""The allocator stand-in follows kube-scheduler's rules for consumable capacity (KEP-5075, the upstream structured
allocator), and the agent's capacity model agrees with it: what the slice publishes, the stand-in rounds and sums
exactly as the agent then checks. Plus the quantities and the CDI spec format."""

from __future__ import annotations

from fractions import Fraction

import pytest

from alnair_agent.constants import (
    CDI_KIND,
    DRA_DEVICE_CLASS,
    DRA_DRIVER,
    RESOURCE_COMPUTE,
    RESOURCE_MEMORY,
)
from alnair_agent.dra import capacity
from alnair_agent.dra.cdi import CdiWriter, device_id
from alnair_agent.dra.quantity import QuantityError, format_bytes, parse_quantity
from alnair_agent.gpu.backend import GpuInfo
from alnair_agent.node.edits import ContainerEdits
from alnair_agent.node.inventory import Gpu
from alnair_standins.dra_allocator import (
    AllocationFailed,
    Allocator,
    consumed_amount,
    violates,
)
from alnair_standins.dra_node import claim_spec, device_class

GiB = 1 << 30


def gpu(index: int, memory_gib: int) -> Gpu:
    return Gpu(GpuInfo(index, f"GPU-{index}", "Sim", memory_gib * GiB, "", index),
               {RESOURCE_MEMORY: memory_gib, RESOURCE_COMPUTE: 100})


def slices(node: str, *gpus: Gpu, generation: int = 1, count: int = 1) -> list[dict]:
    spec = capacity.slice_spec(node, [capacity.device_json(g, GiB) for g in gpus], generation)
    spec["pool"]["resourceSliceCount"] = count
    return [{"metadata": {"name": f"{node}-slice"}, "spec": spec}]


def claim(name: str, *requests: dict) -> dict:
    return {"metadata": {"name": name, "namespace": "default"}, "spec": claim_spec(list(requests))}


def new_allocator() -> Allocator:
    return Allocator({DRA_DEVICE_CLASS: device_class()})


POLICY = {"value": "16Gi", "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "16Gi", "step": "1Gi"}}}


@pytest.mark.parametrize("requested, consumed", [
    (None, 0), ("4Gi", 4 * GiB), ("1", GiB), ("1536Mi", 2 * GiB), ("16Gi", 16 * GiB), ("17Gi", 17 * GiB),
])
def test_requests_are_rounded_up_to_the_policy_step(requested, consumed):
    amount = consumed_amount(None if requested is None else parse_quantity(requested), POLICY)
    assert amount == consumed
    assert violates(amount, POLICY) == (consumed > 16 * GiB)


def test_a_capacity_without_policy_consumes_the_whole_device_when_not_asked():
    assert consumed_amount(None, {"value": "8Gi"}) == 8 * GiB
    assert consumed_amount(Fraction(3), {"value": "8Gi"}) == 3
    values = {"value": "10", "requestPolicy": {"default": "2", "validValues": ["2", "4", "8"]}}
    assert consumed_amount(Fraction(3), values) == 4 and violates(Fraction(9), values)


def test_a_gpu_is_shared_until_a_capacity_is_spent_and_first_fit_packs():
    a = new_allocator()
    sl = slices("n", gpu(0, 16), gpu(1, 16))
    placed = []
    for i in range(4):
        alloc = a.allocate(claim(f"c{i}", {"name": "gpu", "memory": "8Gi", "compute": "20"}), "n", sl)
        [r] = alloc["devices"]["results"]
        assert r["consumedCapacity"] == {"memory": "8Gi", "compute": "20"} and r["shareID"]
        placed.append(r["device"])
    assert placed == ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]  # devices in slice order, each filled first
    with pytest.raises(AllocationFailed):
        a.allocate(claim("c5", {"name": "gpu", "memory": "1Gi"}), "n", sl)
    # compute is a capacity of its own: a compute-only claim still fits
    [r] = a.allocate(claim("c6", {"name": "gpu", "compute": "60"}), "n", sl)["devices"]["results"]
    assert r["consumedCapacity"] == {"memory": "0", "compute": "60"}
    with pytest.raises(AllocationFailed):  # 20 + 20 + 60 = 100 on gpu-0, 40 + 61 > 100 on gpu-1
        a.allocate(claim("c7", {"name": "gpu", "compute": "61"}), "n", sl)


def test_requests_over_the_policy_or_naming_unknown_capacities_fit_nowhere():
    a = new_allocator()
    sl = slices("n", gpu(0, 16))
    for bad in ({"name": "gpu", "memory": "17Gi"}, {"name": "gpu", "compute": "101"}):
        with pytest.raises(AllocationFailed):
            a.allocate(claim("c", bad), "n", sl)
    spec = claim("c", {"name": "gpu"})
    spec["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"sram": "1"}}
    with pytest.raises(AllocationFailed):
        a.allocate(spec, "n", sl)


def test_backtracking_finds_the_placement_first_fit_would_miss():
    a = new_allocator()
    sl = slices("n", gpu(0, 8), gpu(1, 4))
    # first fit would put "small" on gpu-0, then "big" fits nowhere; the allocator revisits
    alloc = a.allocate(claim("c", {"name": "small", "memory": "4Gi"}, {"name": "big", "memory": "8Gi"}), "n", sl)
    assert [r["device"] for r in alloc["devices"]["results"]] == ["gpu-1", "gpu-0"]


def test_only_the_newest_complete_pool_counts_and_other_nodes_slices_never():
    a = new_allocator()
    old = slices("n", gpu(0, 16), generation=1)
    new = slices("n", gpu(1, 16), generation=2)
    new[0]["metadata"]["name"] = "n-slice-2"
    [r] = a.allocate(claim("c", {"name": "gpu", "memory": "1Gi"}), "n", old + new)["devices"]["results"]
    assert r["device"] == "gpu-1"
    with pytest.raises(AllocationFailed):
        a.allocate(claim("c", {"name": "gpu", "memory": "1Gi"}), "n", slices("n", gpu(0, 16), count=2))
    with pytest.raises(AllocationFailed):
        a.allocate(claim("c", {"name": "gpu", "memory": "1Gi"}), "m", slices("n", gpu(0, 16)))


def test_selectors_of_class_and_request_apply():
    a = new_allocator()
    sl = slices("n", gpu(0, 16), gpu(1, 16))
    r = {"name": "gpu", "memory": "1Gi", "selectors": [f'device.attributes["{DRA_DRIVER}"].index == 1']}
    [res] = a.allocate(claim("c", r), "n", sl)["devices"]["results"]
    assert res["device"] == "gpu-1"
    other = Allocator({DRA_DEVICE_CLASS: {"spec": {"selectors": [{"cel": {"expression": 'device.driver == "x.io"'}}]}}})
    with pytest.raises(AllocationFailed):
        other.allocate(claim("c", {"name": "gpu", "memory": "1Gi"}), "n", sl)


def test_the_agent_accepts_exactly_what_the_stand_in_consumes():
    a = new_allocator()
    g = gpu(0, 16)
    for memory in ("1Gi", "1536Mi", "16Gi", None):
        req = {"name": "gpu", "compute": "5"} | ({"memory": memory} if memory else {})
        a = new_allocator()
        [r] = a.allocate(claim("c", req), "n", slices("n", g))["devices"]["results"]
        got = capacity.consumed_of(r["consumedCapacity"], g, GiB)
        assert got.memory_bytes == parse_quantity(r["consumedCapacity"]["memory"]) and got.compute_percent == 5


def test_quantities():
    assert parse_quantity("4Gi") == 4 * GiB and parse_quantity("1.5Gi") == 3 * GiB // 2
    assert parse_quantity("500m") == Fraction(1, 2) and parse_quantity("2e3") == 2000 and parse_quantity(7) == 7
    for bad in ("4GB", "", "1.2.3", "Gi", True, None, "1" * 70):
        with pytest.raises(QuantityError):
            parse_quantity(bad)
    assert [format_bytes(n) for n in (16 * GiB, 1536 << 20, 1000, 0)] == ["16Gi", "1536Mi", "1000", "0"]


def test_the_cdi_spec_names_each_slice_and_is_written_whole(tmp_path):
    writer = CdiWriter(tmp_path / "cdi")
    edits = ContainerEdits({"A": "1", "B": "x=y"}, [("/run/alnair", "/ws/0/run", False), ("/opt/alnair/lib", "/lib", True)])
    uid = "7b2c1d4e-0000-4000-8000-000000000001"
    path = writer.write(uid, [("0123456789abcdef", edits)])
    spec = writer.read(uid)
    assert path.name == f"alnair.centaurus.io-gpu_{uid}.json" and spec["kind"] == CDI_KIND
    [dev] = spec["devices"]
    assert dev["name"] == "0123456789abcdef" and device_id("0123456789abcdef") == f"{CDI_KIND}=0123456789abcdef"
    assert dev["containerEdits"]["env"] == ["A=1", "B=x=y"]
    assert dev["containerEdits"]["mounts"] == [
        {"hostPath": "/ws/0/run", "containerPath": "/run/alnair", "type": "bind", "options": ["bind", "rw"]},
        {"hostPath": "/lib", "containerPath": "/opt/alnair/lib", "type": "bind", "options": ["bind", "ro"]}]
    assert writer.claim_uids() == {uid} and not [p for p in path.parent.iterdir() if p.name.startswith(".")]
    writer.remove(uid)
    writer.remove(uid)
    assert writer.claim_uids() == set()
    with pytest.raises(ValueError):
        writer.path("../etc/x")


def test_the_grpc_services_are_kubelets_by_their_full_names():
    """The package names are part of the method paths kubelet calls; the plugin offers them by kubelet's names."""
    from alnair_agent.constants import DRA_SERVICES
    from alnair_agent.proto import dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2

    assert dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    beta = dra_v1beta1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert beta.full_name == "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    assert [m.name for m in beta.methods] == ["NodePrepareResources", "NodeUnprepareResources"]
    assert pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"].full_name == \
        "pluginregistration.Registration"
    assert DRA_SERVICES == ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # "<last package element>.<service>", v1 first
    claim = dra_v1_pb2.Claim.DESCRIPTOR
    assert [(f.name, f.number) for f in claim.fields] == [("namespace", 1), ("uid", 2), ("name", 3)]
    device = dra_v1_pb2.Device.DESCRIPTOR
    assert [(f.name, f.number) for f in device.fields] == [("request_names", 1), ("pool_name", 2),
                                                          ("device_name", 3), ("cdi_device_ids", 4)]
