"""Kubernetes Events where `kubectl describe` shows them: on a pod whose admission the agent refused (why, and the
fix), and on the node when a GPU turns unhealthy and back. The real agent, kubelet emulator and API stand-in."""

from __future__ import annotations

import pytest
from service_util import wait_until

from alnair_agent.constants import RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.kube.events import (
    REASON_GPU_HEALTHY,
    REASON_GPU_UNHEALTHY,
    REASON_REFUSED,
    EventWriter,
)
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.gpu import sim_uuid
from alnair_standins.kubelet import AdmissionError, KubeletEmulator
from alnair_standins.node import (
    NODE,
    kubernetes_for,
    node_settings,
    registered,
    running_agent,
)

pytestmark = pytest.mark.timeout(30)


async def test_refused_admission_and_gpu_health_become_events(root, api: FakeApiServer) -> None:
    settings = node_settings(root, place_unscheduled=False)  # the default: pods must come through the extender
    pod = api.add_pod(make_pod("stray", node=NODE, containers=[{"name": "main", "memory": 2, "compute": 10}]))
    async with api.api_client() as client:
        kubernetes = kubernetes_for(client)
        kubernetes.events = writer = EventWriter(client, NODE)
        async with running_agent(settings, kubernetes) as running, \
                KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
            await registered(kubelet)
            with pytest.raises(AdmissionError):
                await kubelet.admit("default", "stray", "main", {RESOURCE_MEMORY: 2, RESOURCE_COMPUTE: 10})
            await wait_until(lambda: len(api.kube_events) >= 1, 5)
            running.backend.inject_health(1, healthy=False, reason="xid 79")
            await wait_until(lambda: len(api.kube_events) >= 2, 5)
            running.backend.inject_health(1, healthy=True, reason="recovered")
            await wait_until(lambda: len(api.kube_events) >= 3, 5)
            await writer.drain()
    refused, sick, well = api.kube_events[:3]
    assert refused["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "default", "name": "stray",
                                         "uid": pod["metadata"]["uid"]}
    assert refused["reason"] == REASON_REFUSED and refused["type"] == "Warning"
    assert "not placed by alnair-scheduler" in refused["message"] and "schedulerName" in refused["message"]
    assert refused["source"] == {"component": "alnair-agent", "host": NODE}
    assert sick["involvedObject"]["kind"] == "Node" and sick["involvedObject"]["name"] == NODE
    assert sick["metadata"]["namespace"] == "default"
    assert sick["reason"] == REASON_GPU_UNHEALTHY and sick["type"] == "Warning"
    assert sim_uuid(1, NODE) in sick["message"] and "xid 79" in sick["message"]
    assert well["reason"] == REASON_GPU_HEALTHY and well["type"] == "Normal"


async def test_same_event_is_written_once_and_failures_are_only_logged(api: FakeApiServer) -> None:
    async with api.api_client() as client:
        writer = EventWriter(client, NODE)
        for _ in range(3):  # kubelet retrying the same admission
            writer.pod_refused("default", "p", "uid-1", "same reason")
        await writer.drain()
        assert len(api.kube_events) == 1 and writer.written == 1
    broken = EventWriter(client, NODE)  # its client is closed now: the write fails, nothing is raised
    broken.gpu_health("GPU-1", False, "xid 48")
    await broken.drain()
    assert broken.written == 0
