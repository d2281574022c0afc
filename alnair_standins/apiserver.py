"""A stand-in for the Kubernetes API server, speaking real Kubernetes JSON to the real kubernetes-asyncio client.

Serves, on 127.0.0.1 through aiohttp's TestServer:
  GET   /api/v1/pods?fieldSelector=spec.nodeName=X           PodList with metadata.resourceVersion
  GET   /api/v1/pods?watch=true&resourceVersion=N&...          chunked JSON lines {"type", "object"}; a version
                                                              older than the kept history gets an ERROR event
                                                              carrying a 410 Gone Status, as the real server does
  GET   /api/v1/namespaces/{ns}/pods                         PodList of one namespace
  GET   /api/v1/namespaces/{ns}/pods/{name}                  the pod, or 404 Status
  PATCH /api/v1/namespaces/{ns}/pods/{name}                  JSON merge patch (application/merge-patch+json only;
                                                              anything else is 415), 404 for unknown pods
  POST  /api/v1/namespaces/{ns}/pods/{name}/binding          a v1 Binding: sets spec.nodeName (409 if bound)
  GET   /api/v1/nodes, ?watch=true                           NodeList / node watch, as for pods
  GET/PATCH /api/v1/nodes/{name}                             the same for nodes

Usage:
    async with FakeApiServer() as api:          # or: api = FakeApiServer(); await api.start(); ...; await api.close()
        client = api.api_client()               # a kubernetes_asyncio ApiClient for it (caller closes it)
        api.add_pod(make_pod("p1", node="node-1", containers=[{"name": "c", "memory": 2, "compute": 30}]))
        api.set_container_terminated("default", "p1", "c", exit_code=0)
        api.delete_pod("default", "p1")
        api.fail_next("patch_pod", status=500, times=2)   # ops: list, watch, get_pod, patch_pod, get_node, patch_node
        api.clear_failures()
        api.drop_watches()                      # cut every open watch connection (the client must reconnect)
        api.expire_watches()                    # forget history: open and resumed watches get 410 Gone
        api.pod("default", "p1")["metadata"]["annotations"]
        api.patches                             # every PATCH received: Patch(kind, namespace, name, content_type, body)

Field selectors on pods: `spec.nodeName=X`, `spec.schedulerName=X`, or both joined by a comma (and none). A watch
with a selector sees ADDED when an object starts to match it (e.g. a pod bound to X), MODIFIED while it matches,
DELETED when it stops matching or is deleted. A PATCH whose body names metadata.resourceVersion is refused with 409
Conflict when the object has moved on, as the real API server does.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from kubernetes_asyncio.client import ApiClient, Configuration

from alnair_agent import http_stop
from alnair_standins.apiserver_resource import ResourceApiMixin

MERGE_PATCH = "application/merge-patch+json"


def rfc3339(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_pod(
    name: str,
    namespace: str = "default",
    node: str | None = "node-1",
    containers: Iterable[Mapping[str, Any]] = ({"name": "main", "memory": 1, "compute": 10},),
    init_containers: Iterable[Mapping[str, Any]] = (),
    scheduled_at: datetime | None = None,
    phase: str = "Pending",
    restart_policy: str = "Always",
    uid: str | None = None,
    requests_only: bool = False,
    run_as_user: int | None = None,
) -> dict[str, Any]:
    """A realistic pod dict. Each container is {"name": str, "memory": units, "compute": units, "gpus": count,
    "memory_percent": percent of each GPU, "run_as_user": its securityContext.runAsUser}
    where units may be an int or any raw string (e.g. "1.5", to test validation) and either key may be left out. `node=None`
    makes an unbound pod (no nodeName, PodScheduled False). `requests_only` puts the quantities in
    resources.requests only (the API server would copy them to limits; the parser must cope with both)."""
    scheduled_at = scheduled_at or datetime.now(timezone.utc)
    created = rfc3339(scheduled_at)

    def spec_of(c: Mapping[str, Any]) -> dict[str, Any]:
        quantities = {}
        if "memory" in c:
            quantities["alnair/vgpu-memory"] = str(c["memory"])
        if "compute" in c:
            quantities["alnair/vgpu-compute"] = str(c["compute"])
        if "gpus" in c:  # alnair/vgpu-count: memory and compute above are the container's totals over its GPUs
            quantities["alnair/vgpu-count"] = str(c["gpus"])
        if "memory_percent" in c:  # alnair/vgpu-memory-percent: memory as a share of each of its GPUs
            quantities["alnair/vgpu-memory-percent"] = str(c["memory_percent"])
        resources: dict[str, Any] = {"requests": dict(quantities)}
        if not requests_only:
            resources["limits"] = dict(quantities)
        spec = {"name": c["name"], "image": c.get("image", "busybox:1.36"), "resources": resources,
                "imagePullPolicy": "IfNotPresent", "terminationMessagePolicy": "File"}
        if "restartPolicy" in c:  # restartable init container (sidecar)
            spec["restartPolicy"] = c["restartPolicy"]
        if "run_as_user" in c:
            spec["securityContext"] = {"runAsUser": c["run_as_user"]}
        return spec

    conditions = [{"type": "PodScheduled", "status": "True" if node else "False",
                   "lastProbeTime": None, "lastTransitionTime": created}]
    spec: dict[str, Any] = {
        "containers": [spec_of(c) for c in containers],
        "restartPolicy": restart_policy,
        "schedulerName": "default-scheduler",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
    }
    if init_containers:
        spec["initContainers"] = [spec_of(c) for c in init_containers]
    if run_as_user is not None:  # `run_as_user`: the pod's securityContext.runAsUser (its containers' default)
        spec["securityContext"] = {"runAsUser": run_as_user}
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "creationTimestamp": created,
            "labels": {"app": name},
            "annotations": {},
        },
        "spec": spec,
        "status": {"phase": phase, "conditions": conditions, "qosClass": "BestEffort"},
    }


def make_node(name: str, annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": {"kubernetes.io/hostname": name},
                     "annotations": dict(annotations or {}), "creationTimestamp": rfc3339(datetime.now(timezone.utc))},
        "spec": {},
        "status": {"capacity": {}, "allocatable": {}},
    }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


_REASONS = {400: "BadRequest", 404: "NotFound", 409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType",
            422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}


@dataclass
class Patch:
    kind: str  # "pod" | "node"
    namespace: str  # "" for nodes
    name: str
    content_type: str
    body: Any
    at: float = field(default_factory=time.monotonic)  # when it arrived (the event loop's clock is monotonic too)


@dataclass
class _Event:
    rv: int
    old: dict[str, Any] | None  # None: created
    new: dict[str, Any] | None  # None: deleted
    kind: str = "pod"  # "pod" | "node" | "resourceslices" | "resourceclaims"


Selector = dict[str, str]  # field path -> value; all must match


@dataclass
class _Watcher:
    selector: Selector
    kind: str = "pod"
    queue: asyncio.Queue[_Event | str] = field(default_factory=asyncio.Queue)  # str: "drop" | "gone" | "stop"


_SELECTABLE = {"spec.nodeName": ("spec", "nodeName"), "spec.schedulerName": ("spec", "schedulerName")}


def _node_of(pod: Mapping[str, Any] | None) -> str | None:
    return None if pod is None else (pod.get("spec") or {}).get("nodeName")


def _matches(obj: Mapping[str, Any] | None, selector: Selector) -> bool:
    if obj is None:
        return False
    for path, value in selector.items():
        section, key = _SELECTABLE[path]
        if ((obj.get(section) or {}).get(key) or "") != value:
            return False
    return True


def _selector(text: str | None) -> Selector:
    out: Selector = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if key.strip() not in _SELECTABLE or not sep:
            raise web.HTTPBadRequest(text=json.dumps(status(400, "BadRequest", f"unsupported selector {text}")),
                                     content_type="application/json")
        out[key.strip()] = value.lstrip("=").strip()
    return out


def _precondition(old: Mapping[str, Any], body: Any, plural: str, name: str) -> web.Response | None:
    """409 when the patch names a resourceVersion the object no longer has (optimistic concurrency)."""
    wanted = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("resourceVersion")
    if wanted is not None and wanted != old["metadata"].get("resourceVersion"):
        return web.json_response(status(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": the '
                                        "object has been modified; please apply your changes to the latest version"),
                                 status=409)
    return None


class FakeApiServer(ResourceApiMixin):
    """The stand-in API server; see the module docstring. All test hooks are plain (synchronous) methods.
    resource.k8s.io/v1 (ResourceSlices, ResourceClaims, DeviceClasses) is served by alnair_standins.apiserver_resource."""

    def __init__(self) -> None:
        self._init_resources()
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._rv = 1
        self._oldest_rv = 1  # watches from a version below this get 410 Gone
        self._events: list[_Event] = []
        self._watchers: list[_Watcher] = []
        self._failures: dict[str, list[int]] = {}
        self.patches: list[Patch] = []
        self.bindings: list[tuple[str, str, str]] = []  # (namespace, pod, node) of every Binding accepted
        self.kube_events: list[dict[str, Any]] = []  # every core/v1 Event created
        self.on_pod_change: list[Callable[[dict[str, Any] | None, dict[str, Any] | None], None]] = []
        self.requests: list[tuple[str, str]] = []  # (method, path?query) of every request
        self.watch_connections = 0
        self.list_calls = 0
        self._server: TestServer | None = None

    # -- lifetime --------------------------------------------------------------------------------------------
    async def start(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._list_or_watch)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._list_or_watch)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._get_pod)
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}", self._patch_pod)
        app.router.add_post("/api/v1/namespaces/{ns}/pods/{name}/binding", self._bind)
        app.router.add_get("/api/v1/nodes", self._list_or_watch_nodes)
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch_node)
        app.router.add_post("/api/v1/namespaces/{ns}/events", self._create_event)
        self._add_resource_routes(app)
        self._app = app
        self._server = TestServer(app, host="127.0.0.1", port=getattr(self, "_port", None))
        await self._server.start_server()
        self._port = self._server.port
        return self

    async def _create_event(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("kind") != "Event" or body["metadata"]["namespace"] != request.match_info["ns"]:
            return web.json_response(status(400, "BadRequest", "not an Event of this namespace"), status=400)
        self.kube_events.append(body)
        return web.json_response(body, status=201)

    async def outage(self) -> None:
        """The API server goes away: open watches end, the port refuses connections until `recover`."""
        await self.close()

    async def recover(self) -> None:
        """The API server comes back on the same address, with the same objects."""
        await self.start()

    async def close(self) -> None:
        for w in self._watchers:  # end open streams first, or the server would wait for them on shutdown
            w.queue.put_nowait("stop")
        if self._server is not None:
            await http_stop.quiesce(self._server.runner)
            await self._server.close()
            self._server = None

    async def __aenter__(self) -> FakeApiServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def host(self) -> str:
        assert self._server is not None, "start() first"
        return str(self._server.make_url("")).rstrip("/")

    def configuration(self) -> Configuration:
        cfg = Configuration(host=self.host)
        return cfg

    def api_client(self) -> ApiClient:
        """A real kubernetes-asyncio client for this server; the caller closes it."""
        return ApiClient(self.configuration())

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server, for a process (the agent, alnair-scheduler) to reach it by KUBECONFIG."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.host}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))
        return path

    # -- test hooks: objects ---------------------------------------------------------------------------------
    def add_pod(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        pod = copy.deepcopy(dict(pod))
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if key in self._pods:
            raise ValueError(f"pod {key} exists")
        self._commit(key, None, pod)
        return copy.deepcopy(pod)

    def modify_pod(self, namespace: str, name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply `change` (which edits the pod dict in place) as one update (one MODIFIED event)."""
        old = self._pods[(namespace, name)]
        new = copy.deepcopy(old)
        change(new)
        self._commit((namespace, name), old, new)
        return copy.deepcopy(new)

    def bind_pod(self, namespace: str, name: str, node: str, at: datetime | None = None) -> dict[str, Any]:
        """What the scheduler's binding does: set spec.nodeName and the PodScheduled condition."""
        def change(p: dict[str, Any]) -> None:
            p["spec"]["nodeName"] = node
            p["status"]["conditions"] = [{"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                                          "lastTransitionTime": rfc3339(at or datetime.now(timezone.utc))}]
        return self.modify_pod(namespace, name, change)

    def set_phase(self, namespace: str, name: str, phase: str) -> dict[str, Any]:
        def change(p: dict[str, Any]) -> None:
            p["status"]["phase"] = phase
        return self.modify_pod(namespace, name, change)

    def set_container_running(self, namespace: str, name: str, container: str, init: bool = False) -> dict[str, Any]:
        return self._set_state(namespace, name, container, init,
                               {"running": {"startedAt": rfc3339(datetime.now(timezone.utc))}}, ready=True)

    def set_container_terminated(self, namespace: str, name: str, container: str, exit_code: int = 0,
                                 init: bool = False) -> dict[str, Any]:
        now = rfc3339(datetime.now(timezone.utc))
        state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                "startedAt": now, "finishedAt": now, "containerID": f"containerd://{uuid.uuid4().hex}"}}
        return self._set_state(namespace, name, container, init, state, ready=False)

    def delete_pod(self, namespace: str, name: str) -> None:
        old = self._pods[(namespace, name)]
        self._commit((namespace, name), old, None)

    def add_node(self, name: str, annotations: Mapping[str, str] | None = None,
                 node: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Add a node (`node`: a whole Node object to use instead of the minimal one)."""
        obj = copy.deepcopy(dict(node)) if node is not None else make_node(name, annotations)
        self._commit_node(name, None, obj)
        return copy.deepcopy(obj)

    def has_node(self, name: str) -> bool:
        return name in self._nodes

    def delete_node(self, name: str) -> None:
        self._commit_node(name, self._nodes[name], None)

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self._pods[(namespace, name)])

    def node(self, name: str) -> dict[str, Any]:
        return copy.deepcopy(self._nodes[name])

    def pod_annotations(self, namespace: str, name: str) -> dict[str, str]:
        return dict(self._pods[(namespace, name)]["metadata"].get("annotations") or {})

    def node_annotations(self, name: str) -> dict[str, str]:
        return dict(self._nodes[name]["metadata"].get("annotations") or {})

    @property
    def resource_version(self) -> int:
        return self._rv

    # -- test hooks: faults ----------------------------------------------------------------------------------
    def fail_next(self, op: str, status: int = 500, times: int = 1) -> None:
        """The next `times` requests of `op` answer `status` with a Status body. Ops: list, watch, get_pod,
        patch_pod, get_node, patch_node."""
        self._failures.setdefault(op, []).extend([status] * times)

    def clear_failures(self) -> None:
        """Forget failures injected and not yet served (the server "recovers")."""
        self._failures.clear()

    def drop_watches(self) -> int:
        """Cut every open watch connection abruptly; returns how many were open."""
        for w in self._watchers:
            w.queue.put_nowait("drop")
        return len(self._watchers)

    def end_watches(self) -> int:
        """End every open watch cleanly (as the server does when timeoutSeconds passes)."""
        for w in self._watchers:
            w.queue.put_nowait("stop")
        return len(self._watchers)

    def expire_watches(self) -> int:
        """Forget all history (as etcd compaction does): open watches get an ERROR event with 410 Gone, and a
        watch resumed from a version older than the current one gets the same; only a fresh LIST recovers."""
        self._oldest_rv = self._rv
        self._events.clear()
        for w in self._watchers:
            w.queue.put_nowait("gone")
        return len(self._watchers)

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    # -- internals -------------------------------------------------------------------------------------------
    def _set_state(self, namespace: str, name: str, container: str, init: bool, state: dict[str, Any],
                   ready: bool) -> dict[str, Any]:
        def change(p: dict[str, Any]) -> None:
            key = "initContainerStatuses" if init else "containerStatuses"
            statuses = p["status"].setdefault(key, [])
            for st in statuses:
                if st["name"] == container:
                    if "terminated" in st.get("state", {}) or "running" in st.get("state", {}):
                        st["lastState"] = st["state"]
                    st["state"] = state
                    st["ready"] = ready
                    return
            statuses.append({"name": container, "state": state, "lastState": {}, "ready": ready,
                             "restartCount": 0, "image": "busybox:1.36", "imageID": "", "started": ready})
        return self.modify_pod(namespace, name, change)

    def _commit_node(self, name: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self._rv += 1
        if new is None:
            assert old is not None
            del self._nodes[name]
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            event = _Event(self._rv, gone, None, "node")
        else:
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._nodes[name] = new
            event = _Event(self._rv, copy.deepcopy(old) if old else None, copy.deepcopy(new), "node")
        self._events.append(event)
        for w in self._watchers:
            if w.kind == "node":
                w.queue.put_nowait(event)

    def _commit(self, key: tuple[str, str], old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        for hook in self.on_pod_change:
            hook(copy.deepcopy(old) if old else None, copy.deepcopy(new) if new else None)
        self._rv += 1
        if new is None:
            assert old is not None
            del self._pods[key]
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)  # DELETED carries the last state at its version
            event = _Event(self._rv, gone, None)
        else:
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._pods[key] = new
            event = _Event(self._rv, copy.deepcopy(old) if old else None, copy.deepcopy(new))
        self._events.append(event)
        for w in self._watchers:
            if w.kind == "pod":
                w.queue.put_nowait(event)

    def _take_failure(self, op: str) -> web.Response | None:
        queued = self._failures.get(op)
        if not queued:
            return None
        code = queued.pop(0)
        return web.json_response(status(code, _REASONS.get(code, "Failure"), f"injected failure of {op}"),
                                 status=code)

    @staticmethod
    def _event_for(event: _Event, selector: Selector, kind: str = "pod") -> dict[str, Any] | None:
        if event.kind != kind:
            return None
        old_match = _matches(event.old, selector)
        new_match = _matches(event.new, selector)
        if new_match and not old_match:
            return {"type": "ADDED", "object": event.new}
        if new_match and old_match:
            return {"type": "MODIFIED", "object": event.new}
        if old_match:  # deleted, or moved out of the selector
            obj = copy.deepcopy(event.new if event.new is not None else event.old)
            assert obj is not None
            obj["metadata"]["resourceVersion"] = str(event.rv)
            return {"type": "DELETED", "object": obj}
        return None

    def _pods_on(self, selector: Selector, namespace: str | None) -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for (ns, _), p in sorted(self._pods.items())
                if _matches(p, selector) and (namespace is None or ns == namespace)]

    async def _list_or_watch(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        selector = _selector(request.query.get("fieldSelector"))
        namespace = request.match_info.get("ns")
        if request.query.get("watch", "").lower() in ("true", "1"):  # the client sends "True"
            return await self._watch(request, selector)
        self.list_calls += 1
        failure = self._take_failure("list")
        if failure is not None:
            return failure
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self._rv)},
                                  "items": self._pods_on(selector, namespace)})

    async def _list_or_watch_nodes(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        if request.query.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request, {}, "node")
        failure = self._take_failure("list_nodes")
        if failure is not None:
            return failure
        body = json.dumps({"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)},
                           "items": [self._nodes[n] for n in sorted(self._nodes)]})
        return web.Response(body=body.encode(), content_type="application/json")

    async def _watch(self, request: web.Request, selector: Selector, kind: str = "pod") -> web.StreamResponse:
        self.watch_connections += 1
        failure = self._take_failure("watch")
        if failure is not None:
            return failure
        raw_rv = request.query.get("resourceVersion", "")
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(json.dumps(obj).encode() + b"\n")

        gone = status(410, "Expired", "too old resource version")
        watcher = _Watcher(selector, kind)
        if raw_rv in ("", "0"):
            # No version: the current state as ADDED events, then changes (the API server's "start at most recent").
            current = self._pods_on(selector, None) if kind == "pod" else [
                copy.deepcopy(self._nodes[n]) for n in sorted(self._nodes)] if kind == "node" else \
                self._resource_objects(kind)
            backlog: list[dict[str, Any]] = [{"type": "ADDED", "object": p} for p in current]
        else:
            since = int(raw_rv)
            if since < self._oldest_rv:
                await send({"type": "ERROR", "object": gone})
                await resp.write_eof()
                return resp
            backlog = [ev for e in self._events if e.rv > since if (ev := self._event_for(e, selector, kind))]
        self._watchers.append(watcher)
        try:
            for ev in backlog:
                await send(ev)
            async with asyncio.timeout(timeout):
                while True:
                    item = await watcher.queue.get()
                    if item == "drop":
                        assert request.transport is not None
                        request.transport.abort()  # cut mid-stream: no terminating chunk
                        return resp
                    if item == "gone":
                        await send({"type": "ERROR", "object": gone})
                        break
                    if item == "stop":
                        break
                    assert isinstance(item, _Event)
                    ev = self._event_for(item, selector, kind)
                    if ev is not None:
                        await send(ev)
        except TimeoutError:
            pass  # timeoutSeconds passed: end the stream cleanly, as the API server does
        except ConnectionResetError:
            return resp
        finally:
            self._watchers.remove(watcher)
        await resp.write_eof()
        return resp

    async def _get_pod(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path_qs))
        failure = self._take_failure("get_pod")
        if failure is not None:
            return failure
        pod = self._pods.get((request.match_info["ns"], request.match_info["name"]))
        if pod is None:
            return web.json_response(status(404, "NotFound", "pods not found"), status=404)
        return web.json_response(pod)

    async def _patch_pod(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path_qs))
        ns, name = request.match_info["ns"], request.match_info["name"]
        body = await request.json()
        self.patches.append(Patch("pod", ns, name, request.content_type, body))
        failure = self._take_failure("patch_pod")
        if failure is not None:
            return failure
        if request.content_type != MERGE_PATCH:
            return web.json_response(status(415, "UnsupportedMediaType", f"only {MERGE_PATCH}"), status=415)
        old = self._pods.get((ns, name))
        if old is None:
            return web.json_response(status(404, "NotFound", f'pods "{name}" not found'), status=404)
        conflict = _precondition(old, body, "pods", name)
        if conflict is not None:
            return conflict
        new = merge_patch(old, body)
        self._commit((ns, name), old, new)
        return web.json_response(new)

    async def _bind(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path_qs))
        ns, name = request.match_info["ns"], request.match_info["name"]
        failure = self._take_failure("bind")
        if failure is not None:
            return failure
        try:
            body = await request.json()
            target = body["target"]["name"]
        except (ValueError, KeyError, TypeError):
            return web.json_response(status(400, "BadRequest", "not a v1 Binding"), status=400)
        old = self._pods.get((ns, name))
        if old is None:
            return web.json_response(status(404, "NotFound", f'pods "{name}" not found'), status=404)
        uid = (body.get("metadata") or {}).get("uid")
        if uid and uid != old["metadata"]["uid"]:
            return web.json_response(status(409, "Conflict", f"pod {name} uid mismatch"), status=409)
        if (old.get("spec") or {}).get("nodeName"):
            return web.json_response(status(409, "Conflict", f'pod {name} is already assigned to node '
                                            f'"{old["spec"]["nodeName"]}"'), status=409)
        self.bindings.append((ns, name, target))
        self.bind_pod(ns, name, target)
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "code": 201}, status=201)

    async def _get_node(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path_qs))
        failure = self._take_failure("get_node")
        if failure is not None:
            return failure
        node = self._nodes.get(request.match_info["name"])
        if node is None:
            return web.json_response(status(404, "NotFound", "nodes not found"), status=404)
        return web.json_response(node)

    async def _patch_node(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path_qs))
        name = request.match_info["name"]
        body = await request.json()
        self.patches.append(Patch("node", "", name, request.content_type, body))
        failure = self._take_failure("patch_node")
        if failure is not None:
            return failure
        if request.content_type != MERGE_PATCH:
            return web.json_response(status(415, "UnsupportedMediaType", f"only {MERGE_PATCH}"), status=415)
        old = self._nodes.get(name)
        if old is None:
            return web.json_response(status(404, "NotFound", f'nodes "{name}" not found'), status=404)
        conflict = _precondition(old, body, "nodes", name)
        if conflict is not None:
            return conflict
        new = merge_patch(old, body)
        self._commit_node(name, old, new)
        return web.json_response(new)
