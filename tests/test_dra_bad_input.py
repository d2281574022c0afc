"""Bad input to the DRA front-end: malformed claims, unknown devices, capacity that does not match the request policy,
claims that would overbook a GPU, an API server that does not answer. Each is refused with an error naming what was
wrong (kubelet shows it on the pod), and nothing already held changes."""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

from service_util import wait_until

from alnair_agent.constants import DRA_DRIVER
from alnair_agent.dra.spares import SPARES
from alnair_agent.proto import dra_v1_pb2, dra_v1_pb2_grpc
from alnair_standins.dra_node import dra_node
from alnair_standins.kubelet_dra import Claim

GOOD = {"request": "gpu", "driver": DRA_DRIVER, "pool": "node-1", "device": "gpu-0",
        "shareID": "0b7c5f6e-6f0f-4f55-9b43-3f2a0d6f0a11", "consumedCapacity": {"memory": "4Gi", "compute": "30"}}


def forge(api, name: str, results: list[dict[str, Any]] | None, uid: str | None = None) -> Claim:  # type: ignore[no-untyped-def]
    """A claim whose status says what kube-scheduler (or someone pretending to be it) allocated."""
    claim = api.add_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": name, "namespace": "default"},
                           "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                               "deviceClassName": "gpu.alnair.centaurus.io"}}]}}})
    status: dict[str, Any] = {"reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-uid"}]}
    if results is not None:
        status["allocation"] = {"devices": {"results": results}}
    api.set_claim_status("default", name, status)
    return Claim("default", uid or claim["metadata"]["uid"], name)


def with_(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(GOOD)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


CASES = [
    ("not allocated", None, "is not allocated"),
    ("unknown device", [with_(device="gpu-7")], "device 'gpu-7' is not published by this node"),
    ("other node's pool", [with_(pool="node-2")], "pool 'node-2' is not this node's pool 'node-1'"),
    ("memory off the step", [with_(consumedCapacity={"memory": "1500Mi", "compute": "30"})],
     "consumed memory 1500Mi does not match the request policy of gpu-0: 0..16Gi in steps of 1Gi"),
    ("memory over capacity", [with_(consumedCapacity={"memory": "32Gi", "compute": "30"})],
     "consumed memory 32Gi does not match the request policy"),
    ("compute over 100", [with_(consumedCapacity={"memory": "4Gi", "compute": "150"})],
     "consumed compute 150 does not match the request policy of gpu-0: 0..100 in steps of 1"),
    ("compute fraction", [with_(consumedCapacity={"memory": "4Gi", "compute": "30500m"})],
     "consumed compute '30500m' is not a whole number"),
    ("no consumed capacity", [with_(consumedCapacity=None)], "records no consumedCapacity"),
    ("unknown capacity", [with_(consumedCapacity={"memory": "4Gi", "compute": "3", "sram": "1"})],
     "consumedCapacity names sram, which the device does not have"),
    ("a capacity missing", [with_(consumedCapacity={"memory": "4Gi"})], "consumedCapacity lacks compute"),
    ("not a quantity", [with_(consumedCapacity={"memory": "lots", "compute": "3"})],
     "consumed memory: 'lots' is not a quantity"),
    ("no device name", [with_(device="")], "names no request or no device"),
    ("admin access", [with_(adminAccess=True)], "adminAccess is not supported"),
    ("results not a list", {"oops": 1}, "is not a list"),
    ("result not an object", ["gpu-0"], "allocation result 0 is not an object"),
    ("the same share twice", [GOOD, GOOD], "two allocation results name the same request, device and share"),
    ("over the ledger", [with_(consumedCapacity={"memory": "16Gi", "compute": "30"})],
     "more than GPU GPU-"),
    ("neither memory nor compute", [with_(consumedCapacity={"memory": "0", "compute": "0"})],
     "asks for neither memory nor compute"),
    ("second result bad", [with_(device="gpu-1", request="a"), with_(device="gpu-9", request="b")],
     "device 'gpu-9' is not published"),
]


def spec_names(node) -> list[str]:  # type: ignore[no-untyped-def]
    """The CDI folder's specs, as a runtime reads them (not the hidden temporary files, spares made ahead among them)."""
    return sorted(p.name for p in node.settings.cdi_dir.iterdir() if not p.name.startswith("."))


def allocation_folders(node) -> list[str]:  # type: ignore[no-untyped-def]
    """The workspace's allocation folders (not its hidden `.spares`: folders made ahead, which no claim holds)."""
    return sorted(p.name for p in node.settings.workspace.iterdir() if not p.name.startswith("."))


async def test_bad_claims_are_refused_naming_what_is_wrong_and_lose_nothing_held(root, api):
    async with dra_node(root, api) as node:
        node.claim("held", [{"name": "gpu", "memory": "4Gi", "compute": "40"}])
        pod = node.pod("p0", {"gpu": "held"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["held"])
        before_view = (await node.start(pod))["main"]
        ledger = node.running.agent.ledger
        before = {a.id: copy.deepcopy(a) for a in ledger.allocations.values()}
        rooms = ledger.rooms()
        spec_files = spec_names(node)
        for i, (what, results, message) in enumerate(CASES):
            ref = forge(api, f"bad-{i}", results)
            errors = await node.kubelet.prepare_once(DRA_DRIVER, [ref])
            assert message in errors[ref.uid], (what, errors)
            assert {a.id: a for a in ledger.allocations.values()} == before, what
        assert ledger.rooms() == rooms
        assert spec_names(node) == spec_files
        assert allocation_folders(node) == sorted(before)
        again = node.kubelet.resolve(before_view.cdi_ids)  # the held container's devices resolve as before
        assert again.envs == before_view.envs and again.mounts == before_view.mounts


async def test_claims_kubelet_misnames_are_refused_each_on_its_own(root, api):
    async with dra_node(root, api) as node:
        good = forge(api, "good", [GOOD])
        missing = Claim("default", "3f0e0d5e-1111-4111-8111-111111111111", "no-such-claim")
        wrong_uid = Claim("default", "3f0e0d5e-2222-4222-8222-222222222222", "good")
        errors = await node.kubelet.prepare_once(DRA_DRIVER, [missing, wrong_uid, good])
        assert "ResourceClaim default/no-such-claim (uid 3f0e0d5e-1111" in errors[missing.uid]
        assert "does not exist" in errors[missing.uid]
        assert "the claim of that name has uid" in errors[wrong_uid.uid]
        assert good.uid not in errors  # one claim's failure never touches another's
        assert len(node.running.agent.ledger.allocations) == 1
        # a claim without its UID (every field is required): answered under its name, with the reason
        stub = dra_v1_pb2_grpc.DRAPluginStub(node.kubelet.plugins[DRA_DRIVER].channel)
        answer = await stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace="default", name="good")]), timeout=5)
        assert "lacks uid" in answer.claims["default/good"].error


async def test_an_api_server_that_does_not_answer_is_named_and_kubelet_retries(root, api):
    async with dra_node(root, api) as node:
        ref = forge(api, "c", [GOOD])
        api.fail_next("get_claim", status=503, times=2)
        errors = await node.kubelet.prepare_once(DRA_DRIVER, [ref])
        assert "cannot read ResourceClaim default/c" in errors[ref.uid] and "503" in errors[ref.uid]
        await node.kubelet.prepare(DRA_DRIVER, [ref])  # kubelet calls again: the second failure, then success
        assert len(node.running.agent.ledger.allocations) == 1


async def test_a_spec_that_cannot_be_written_refuses_the_claim_and_leaves_nothing_behind(root, api):
    async with dra_node(root, api) as node:
        ref = forge(api, "c", [GOOD])
        cdi = node.settings.cdi_dir
        # the agent makes spec files ahead into this folder: once they are all made it writes nothing there
        await wait_until(lambda: len([n for n in os.listdir(cdi) if n.startswith(".spare-")]) == SPARES)
        shutil.rmtree(cdi)
        cdi.write_text("")  # the spec cannot be written (even by root): its folder is a file
        try:
            errors = await node.kubelet.prepare_once(DRA_DRIVER, [ref])
        finally:
            cdi.unlink()
            cdi.mkdir(exist_ok=True)  # the agent may make it again first (a spare spec file made ahead)
        assert "cannot write its slice" in errors[ref.uid] and "CDI spec" in errors[ref.uid]
        assert not node.running.agent.ledger.allocations
        assert not allocation_folders(node)
        await node.kubelet.prepare(DRA_DRIVER, [ref])
        assert len(node.running.agent.ledger.allocations) == 1


async def test_unpreparing_a_claim_never_prepared_is_a_success(root, api):
    async with dra_node(root, api) as node:
        ref = Claim("default", "3f0e0d5e-3333-4333-8333-333333333333", "never")
        await node.kubelet.unprepare(DRA_DRIVER, [ref], attempts=1)


async def test_a_claim_uid_that_is_no_uid_never_becomes_a_path(root, api):
    async with dra_node(root, api) as node:
        stub = dra_v1_pb2_grpc.DRAPluginStub(node.kubelet.plugins[DRA_DRIVER].channel)
        hostile = dra_v1_pb2.Claim(namespace="default", name="x", uid="../../../etc/passwd")
        for call, request in ((stub.NodePrepareResources, dra_v1_pb2.NodePrepareResourcesRequest),
                              (stub.NodeUnprepareResources, dra_v1_pb2.NodeUnprepareResourcesRequest)):
            answer = await call(request(claims=[hostile]), timeout=5)
            assert "is not a Kubernetes UID" in answer.claims[hostile.uid].error
