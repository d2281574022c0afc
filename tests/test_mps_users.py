"""MPS serves one Linux user per GPU at a time (node/mps_users.py): a container admitted onto an MPS GPU beside
containers of another declared user gets a Warning Event on its pod saying it will (or may) wait and what to do.
The rule table-driven; then the real agent over real gRPC, the kubelet emulator and the API stand-in, in both
admission orders."""

from __future__ import annotations

import pytest
from service_util import wait_until
from structlog.testing import capture_logs

from alnair_agent.config import parse_sim_gpus
from alnair_agent.constants import RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.kube.events import EventWriter
from alnair_agent.kube.pods import parse_pod
from alnair_agent.node.mps_users import REASON_MPS_USER, Tenant, mismatch
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.gpu import sim_uuid
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import NODE, kubernetes_for, node_settings, registered, running_agent

pytestmark = pytest.mark.timeout(30)

ME = ("ns/infer", "serve")
OTHER = ("ns/train", "main")


@pytest.mark.parametrize(("mine", "others", "says"), [
    (1000, [1000], None),  # one user: MPS serves both
    (None, [None], None),  # neither declares: their images decide, nothing to say
    (None, [], None),  # alone on the GPU
    (1000, [0], "certain"),
    (0, [1000], "certain"),
    (1000, [None], "possible"),
    (None, [1000], "possible"),
    (1000, [1000, None, 0], "certain"),  # a certain mismatch is named before a possible one
    (1000, [None, 1000], "possible"),
])
def test_the_rule(mine, others, says) -> None:
    me = Tenant(*ME, mine)
    why = mismatch("GPU-x", me, [Tenant(*OTHER, u) for u in others])
    if says is None:
        assert why is None
        return
    assert why is not None
    assert "ns/infer container 'serve'" in why and "ns/train container 'main'" in why and "GPU-x" in why
    assert "securityContext.runAsUser" in why and "multi-user" in why  # the way out
    assert ("if those are not the same user" in why) == (says == "possible")
    if mine is not None:
        assert f"UID {mine}" in why
    else:
        assert "its image's user" in why


@pytest.mark.parametrize(("pod_user", "container_user", "expected"), [
    (None, None, None),
    (1000, None, 1000),  # the pod's is every container's default
    (1000, 0, 0),  # a container's own wins
    (None, 7, 7),
    ("1000", None, None),  # not a user ID: as undeclared (the API server would have refused it)
    (True, None, None),
    (-1, None, None),
    (2**31, None, None),
])
def test_a_containers_declared_user(pod_user, container_user, expected) -> None:
    c = {"name": "main", "memory": 1}
    if container_user is not None:
        c["run_as_user"] = container_user
    obj = make_pod("p", containers=[c], init_containers=[{"name": "setup", "memory": 1}])
    if pod_user is not None:
        obj["spec"]["securityContext"] = {"runAsUser": pod_user}
    pod = parse_pod(obj)
    assert pod.user_of("main") == expected
    assert pod.user_of("setup") == (expected if container_user is None else pod_user)  # an init container too
    assert pod.user_of("absent") is None


@pytest.mark.parametrize("first_is_root", [True, False])
@pytest.mark.parametrize(("mps", "users", "warned"), [
    (True, (0, 1000), True),
    (True, (1000, 1000), False),
    (True, (None, None), False),
    (False, (0, 1000), False),  # time-slicing: any users share a GPU
])
async def test_a_container_that_will_wait_for_another_user_is_told_on_its_pod(
        root, api: FakeApiServer, mps, users, warned, first_is_root) -> None:
    """Two pods on the one GPU of a node, admitted one after the other: under MPS with two declared users the
    second gets the Warning (the first is admitted alone and says nothing); both are admitted either way."""
    if not first_is_root:
        users = tuple(reversed(users))
    folders = {"mps_pipe_dir": root / "pipes", "mps_shm_dir": root / "shm"} if mps else {}
    settings = node_settings(root, sim_gpus=parse_sim_gpus("1x16GiB"), **folders)
    with capture_logs() as logs:
        async with api.api_client() as client:
            kubernetes = kubernetes_for(client)
            kubernetes.events = writer = EventWriter(client, NODE)
            async with running_agent(settings, kubernetes), \
                    KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
                await registered(kubelet)
                pods = []
                for name, user in zip(("train", "infer"), users, strict=True):
                    pods.append(api.add_pod(make_pod(name, node=NODE, run_as_user=user,
                                                     containers=[{"name": "main", "memory": 4, "compute": 30}])))
                    answers = await kubelet.admit("default", name, "main",
                                                  {RESOURCE_MEMORY: 4, RESOURCE_COMPUTE: 30})
                    assert {a.envs["NVIDIA_VISIBLE_DEVICES"] for a in answers.values()} == {sim_uuid(0, NODE)}
                if warned:
                    await wait_until(lambda: len(api.kube_events) >= 1, 5)
                await writer.drain()
    said = [e for e in logs if e["event"] == "mps_user_mismatch"]
    if not warned:
        assert api.kube_events == [] and said == []
        return
    [line] = said  # the agent's log says it too, once, with the same words
    assert line["pod"] == "default/infer" and line["gpu"] == sim_uuid(0, NODE)
    [event] = api.kube_events
    assert event["reason"] == REASON_MPS_USER and event["type"] == "Warning"
    assert event["involvedObject"]["name"] == "infer"
    assert event["involvedObject"]["uid"] == pods[1]["metadata"]["uid"]
    second, first = users[1], users[0]
    assert f"default/infer container 'main' runs as UID {second}" in event["message"]
    assert f"default/train container 'main' on the same GPU as UID {first}" in event["message"]
    assert sim_uuid(0, NODE) in event["message"]


async def test_the_dra_front_end_tells_a_claims_pod_the_same(root, api: FakeApiServer) -> None:
    """The same rule for a slice the DRA front-end prepares: two pods' claims on the one GPU, under MPS, of users 0
    and 1000: the second pod's prepare writes the Warning; both start."""
    from alnair_standins.dra_node import dra_node, make_claim_pod

    with capture_logs() as logs:
        async with dra_node(root, api, events=True, sim_gpus=parse_sim_gpus("1x16GiB"),
                            mps_pipe_dir=root / "pipes", mps_shm_dir=root / "shm") as node:
            for name, user in (("train", 0), ("infer", 1000)):
                node.claim(f"c-{name}", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
                pod = make_claim_pod(name, {"gpu": f"c-{name}"}, [("main", [("gpu", None)])])
                pod["spec"]["securityContext"] = {"runAsUser": user}
                node.pods[name] = pod = api.add_pod(pod)
                uid = pod["metadata"]["uid"]
                await wait_until(lambda uid=uid: node.running.agent.kubernetes.pods.get(uid) is not None, 5)
                node.schedule(pod, [f"c-{name}"])
                await node.start(pod)
            await wait_until(lambda: len(api.kube_events) >= 1, 5)
    [line] = [e for e in logs if e["event"] == "mps_user_mismatch"]
    assert line["pod"] == "default/infer" and line["container"] == "main"
    [event] = api.kube_events
    assert line["reason"] == event["message"]
    assert event["reason"] == REASON_MPS_USER and event["involvedObject"]["name"] == "infer"
    assert "default/infer container 'main' runs as UID 1000" in event["message"]
    assert "default/train container 'main' on the same GPU as UID 0" in event["message"]
