"""Wires the agent to its Kubernetes peers: the API server (pod watch, annotations) and kubelet's pod-resources."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from alnair_agent.app import Kubernetes
from alnair_agent.config import Settings
from alnair_agent.kube.client import api_client
from alnair_agent.kube.podwatch import PodWatch
from alnair_agent.kube.resourceapi import ResourceApi
from alnair_agent.kubelet.podresources import DeviceAssignment, PodResourcesClient


@contextlib.asynccontextmanager
async def pod_resources_lister(settings: Settings) -> AsyncIterator[Callable[[], Awaitable[list[DeviceAssignment]]]]:
    """kubelet's pod-resources List over one channel kept for the agent's lifetime."""
    async with PodResourcesClient(settings.pod_resources_socket) as client:
        yield client.list


@contextlib.asynccontextmanager
async def pod_resources_client(settings: Settings) -> AsyncIterator[PodResourcesClient]:
    """kubelet's pod-resources client (List of devices, and of the DRA claims containers use), one channel."""
    async with PodResourcesClient(settings.pod_resources_socket) as client:
        yield client


@contextlib.asynccontextmanager
async def connect_kubernetes(settings: Settings) -> AsyncIterator[Kubernetes]:
    """The pod watch and annotation writer on the API server, or an empty Kubernetes() without one."""
    api = await api_client(settings)
    if api is None:
        yield Kubernetes()
        return
    from alnair_agent.kube.annotations import AnnotationWriter
    from alnair_agent.kube.events import EventWriter

    try:
        watch = PodWatch(api, settings.node_name)
        writer = AnnotationWriter(api, settings.node_name)
        yield Kubernetes(pods=watch, annotations=writer,
                         events=EventWriter(api, settings.node_name),
                         services=[("pod-watch", watch.run), ("annotations", writer.run)],
                         resources=ResourceApi(api))
    finally:
        await api.close()
