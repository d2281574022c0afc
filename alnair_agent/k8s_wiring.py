"""Wires the agent to its Kubernetes peers: the API server (pod watch, annotations) and kubelet's pod-resources."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from alnair_agent.app import Kubernetes
from alnair_agent.config import Settings
from alnair_agent.kube import api_client
from alnair_agent.podresources import DeviceAssignment, list_assignments
from alnair_agent.podwatch import PodWatch


def pod_resources_lister(settings: Settings) -> Callable[[], Awaitable[list[DeviceAssignment]]]:
    socket = settings.pod_resources_socket

    async def list_held() -> list[DeviceAssignment]:
        return await list_assignments(socket)

    return list_held


@contextlib.asynccontextmanager
async def connect_kubernetes(settings: Settings) -> AsyncIterator[Kubernetes]:
    """The pod watch and annotation writer on the API server, or an empty Kubernetes() without one."""
    api = await api_client(settings)
    if api is None:
        yield Kubernetes()
        return
    from alnair_agent.annotations import AnnotationWriter

    try:
        watch = PodWatch(api, settings.node_name)
        writer = AnnotationWriter(api, settings.node_name)
        yield Kubernetes(pod_source=watch, pod_states=watch, annotations=writer,
                         services=[("pod-watch", watch.run), ("annotations", writer.run)])
    finally:
        await api.close()
