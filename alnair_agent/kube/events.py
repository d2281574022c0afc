"""Kubernetes Events from the agent, where `kubectl describe` shows them: on the pod whose admission the agent
refused (why, and the fix), on a pod admitted with a warning (an MPS GPU shared with another Linux user), and on
the node when a GPU turns unhealthy or healthy again.

Fire and forget: `pod_refused` and `gpu_health` return at once; the write (core/v1 Event, created with the
agent's own JSON) runs as a task and a failure is logged, never raised, so an API-server outage never slows
kubelet's admission or the health loop. The same event (object, reason, message) is written at most once per
`dedupe_s` (kubelet may retry an admission).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)

COMPONENT = "alnair-agent"
REASON_REFUSED = "AlnairAdmissionRefused"
REASON_GPU_UNHEALTHY = "AlnairGpuUnhealthy"
REASON_GPU_HEALTHY = "AlnairGpuHealthy"
MAX_MESSAGE = 1024  # the API server refuses longer event messages


class EventSink(Protocol):
    def pod_refused(self, namespace: str, name: str, uid: str, message: str) -> None: ...

    def pod_warning(self, namespace: str, name: str, uid: str, reason: str, message: str) -> None: ...

    def gpu_health(self, gpu_uuid: str, healthy: bool, reason: str) -> None: ...


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(involved: dict[str, Any], reason: str, message: str, kind: str, node_name: str) -> dict[str, Any]:
    """A core/v1 Event about `involved` (an ObjectReference), as kubelet writes its own."""
    now = _now()
    namespace = involved.get("namespace") or "default"  # node events live in "default", as kubelet's do
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{involved['name']}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": involved, "reason": reason, "message": message[:MAX_MESSAGE], "type": kind,
        "source": {"component": COMPONENT, "host": node_name},
        "reportingComponent": COMPONENT, "reportingInstance": node_name,
        "firstTimestamp": now, "lastTimestamp": now, "eventTime": None, "count": 1,
    }


class EventWriter:
    """Writes Events through the API client `api` (kubernetes-asyncio ApiClient)."""

    def __init__(self, api: Any, node_name: str, dedupe_s: float = 60.0) -> None:
        self.api = api
        self.node_name = node_name
        self.dedupe_s = dedupe_s
        self._recent: dict[tuple[str, str, str], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.written = 0

    def pod_refused(self, namespace: str, name: str, uid: str, message: str) -> None:
        self._emit({"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name, "uid": uid},
                   REASON_REFUSED, message, "Warning")

    def pod_warning(self, namespace: str, name: str, uid: str, reason: str, message: str) -> None:
        """A pod admitted, with something its owner should know (e.g. node/mps_users.py)."""
        self._emit({"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name, "uid": uid},
                   reason, message, "Warning")

    def gpu_health(self, gpu_uuid: str, healthy: bool, reason: str) -> None:
        if healthy:
            message = f"GPU {gpu_uuid} is healthy again ({reason}); its alnair/* devices are offered again"
        else:
            message = (f"GPU {gpu_uuid} is unhealthy ({reason}); its alnair/* devices are reported Unhealthy to "
                       "kubelet and get no new pods")
        self._emit({"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": self.node_name},
                   REASON_GPU_HEALTHY if healthy else REASON_GPU_UNHEALTHY, message,
                   "Normal" if healthy else "Warning")

    def _emit(self, involved: dict[str, Any], reason: str, message: str, kind: str) -> None:
        key = (f"{involved['kind']}/{involved.get('namespace', '')}/{involved['name']}", reason, message)
        now = time.monotonic()
        self._recent = {k: t for k, t in self._recent.items() if now - t < self.dedupe_s}
        if key in self._recent:
            return
        self._recent[key] = now
        try:
            task = asyncio.get_running_loop().create_task(self._write(event_body(involved, reason, message, kind,
                                                                                  self.node_name)))
        except RuntimeError:  # no running loop: nothing to write with
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, body: dict[str, Any]) -> None:
        from kubernetes_asyncio.client import CoreV1Api

        from alnair_agent.kube.client import read_json

        try:
            await read_json(await CoreV1Api(self.api).create_namespaced_event(
                body["metadata"]["namespace"], body, _preload_content=False, _request_timeout=10))
            self.written += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an Event is best effort: no failure of it may stop the agent
            log.warning("event_write_failed", reason=body["reason"], object=body["involvedObject"].get("name"),
                        error=f"{type(e).__name__}: {e}")

    async def drain(self) -> None:
        """Wait for the writes in flight (tests; shutdown)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
