"""resource.k8s.io/v1 in the API server stand-in (FakeApiServer mixes this in): ResourceSlices, ResourceClaims,
DeviceClasses, in real Kubernetes JSON for the real kubernetes-asyncio client.

Serves:
  GET    /apis/resource.k8s.io/v1                                     APIResourceList (404 with `serve_dra=False`)
  GET    /apis/resource.k8s.io/v1/resourceslices[?fieldSelector=spec.nodeName=X,spec.driver=D]
  POST   /apis/resource.k8s.io/v1/resourceslices[?dryRun=All]         create (generateName too); 409 if it exists
  GET/PUT/DELETE /apis/resource.k8s.io/v1/resourceslices/{name}        PUT: 409 on a stale metadata.resourceVersion
  GET    /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims[/{name}], /apis/resource.k8s.io/v1/resourceclaims
  ?watch=true on both lists                                           the same watch as pods (events, 410 Gone)
  GET    /apis/resource.k8s.io/v1/deviceclasses/{name}

Writes are validated against the Kubernetes 1.36 schemas (kubernetes-validate, strict): an object the real API
server would refuse gets 422 with the validator's message. `consumable_capacity=False` plays an API server without
the DRAConsumableCapacity feature: it drops allowMultipleAllocations and the capacity request policies, silently,
as a disabled feature's fields are dropped. Test hooks (synchronous): add_claim, claim, set_claim_status,
delete_claim, claims, add_device_class, has_device_class, resource_slice, resource_slices, delete_resource_slice; faults through
fail_next with the ops get_claim, list_slices, get_slice, create_slice, replace_slice, delete_slice.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

try:  # a test requirement; the demo runs the stand-in without it (then writes are not schema-checked)
    import kubernetes_validate
except ImportError:  # pragma: no cover - the demo from a plain install
    kubernetes_validate = None

GROUP = "/apis/resource.k8s.io/v1"
SCHEMA_VERSION = "1.36"


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _drop_consumable_capacity(obj: dict[str, Any]) -> None:
    for device in (obj.get("spec") or {}).get("devices") or []:
        device.pop("allowMultipleAllocations", None)
        for cap in (device.get("capacity") or {}).values():
            if isinstance(cap, dict):
                cap.pop("requestPolicy", None)


_SLICE_FIELDS = {"spec.nodeName": "nodeName", "spec.driver": "driver"}


class ResourceApiMixin:
    """The resource.k8s.io/v1 part of FakeApiServer; see the module doc."""

    _rv: int
    requests: list[tuple[str, str]]

    def _init_resources(self) -> None:
        self._slices: dict[str, dict[str, Any]] = {}
        self._claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._classes: dict[str, dict[str, Any]] = {}
        self.serve_dra = True
        self.consumable_capacity = True
        self.validate_dra = True
        self.slice_writes: list[tuple[str, str]] = []  # (verb, name) of every slice create/update/delete accepted

    def _add_resource_routes(self, app: web.Application) -> None:
        app.router.add_get(GROUP, self._discovery)
        app.router.add_get(GROUP + "/", self._discovery)  # the client asks with the slash
        app.router.add_get(GROUP + "/resourceslices", self._list_slices)
        app.router.add_post(GROUP + "/resourceslices", self._create_slice)
        app.router.add_get(GROUP + "/resourceslices/{name}", self._get_slice)
        app.router.add_put(GROUP + "/resourceslices/{name}", self._replace_slice)
        app.router.add_delete(GROUP + "/resourceslices/{name}", self._delete_slice)
        app.router.add_get(GROUP + "/resourceclaims", self._list_claims)
        app.router.add_get(GROUP + "/namespaces/{ns}/resourceclaims", self._list_claims)
        app.router.add_get(GROUP + "/namespaces/{ns}/resourceclaims/{name}", self._get_claim)
        app.router.add_get(GROUP + "/deviceclasses/{name}", self._get_class)

    # -- test hooks --------------------------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _publish(self, kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """A change of a slice or claim, for watches (the same event log as pods and nodes)."""
        from alnair_standins.apiserver import _Event

        if new is None:
            assert old is not None
            old = copy.deepcopy(old)
            old["metadata"]["resourceVersion"] = self._next_rv()
            event = _Event(self._rv, old, None, kind)
        else:
            event = _Event(int(new["metadata"]["resourceVersion"]), copy.deepcopy(old) if old else None,
                           copy.deepcopy(new), kind)
        self._events.append(event)  # type: ignore[attr-defined]
        for w in self._watchers:  # type: ignore[attr-defined]
            if w.kind == kind:
                w.queue.put_nowait(event)

    def _resource_objects(self, kind: str) -> list[dict[str, Any]]:
        store = self._slices if kind == "resourceslices" else self._claims
        return [copy.deepcopy(v) for _, v in sorted(store.items())]

    def add_claim(self, claim: Mapping[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(dict(claim))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["resourceVersion"] = self._next_rv()
        key = (meta["namespace"], meta["name"])
        if key in self._claims:
            raise ValueError(f"claim {key} exists")
        self._claims[key] = obj
        self._publish("resourceclaims", None, obj)
        return copy.deepcopy(obj)

    def claim(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self._claims[(namespace, name)])

    def claims(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(c) for _, c in sorted(self._claims.items())]

    def set_claim_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """What kube-scheduler's allocation and reservation write (status.allocation, status.reservedFor)."""
        obj = self._claims[(namespace, name)]
        old = copy.deepcopy(obj)
        obj["status"] = copy.deepcopy(dict(status))
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._publish("resourceclaims", old, obj)
        return copy.deepcopy(obj)

    def delete_claim(self, namespace: str, name: str) -> None:
        self._publish("resourceclaims", self._claims.pop((namespace, name)), None)

    def has_device_class(self, name: str) -> bool:
        return name in self._classes

    def add_device_class(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        cls = copy.deepcopy(dict(obj))
        cls["metadata"]["resourceVersion"] = self._next_rv()
        cls["metadata"].setdefault("uid", str(uuid.uuid4()))
        self._classes[cls["metadata"]["name"]] = cls
        return copy.deepcopy(cls)

    def resource_slice(self, name: str) -> dict[str, Any] | None:
        obj = self._slices.get(name)
        return copy.deepcopy(obj) if obj is not None else None

    def resource_slices(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(s) for _, s in sorted(self._slices.items())]

    def delete_resource_slice(self, name: str) -> None:
        """What kubelet does to a driver's slices at its start and when the plugin has been away a while."""
        old = self._slices.pop(name, None)
        if old is not None:
            self._publish("resourceslices", old, None)

    # -- handlers ----------------------------------------------------------------------------------------------
    def _fail(self, op: str) -> web.Response | None:
        return self._take_failure(op)  # type: ignore[attr-defined]

    async def _discovery(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path_qs))
        if not self.serve_dra:
            return _status(404, "NotFound", "the server could not find the requested resource")
        return web.json_response({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "resource.k8s.io/v1",
                                  "resources": [
                                      {"name": n, "singularName": "", "namespaced": ns, "kind": k, "verbs": ["get", "list"]}
                                      for n, ns, k in (("resourceslices", False, "ResourceSlice"),
                                                       ("resourceclaims", True, "ResourceClaim"),
                                                       ("deviceclasses", False, "DeviceClass"),
                                                       ("resourceclaimtemplates", True, "ResourceClaimTemplate"))]})

    def _gate(self, request: web.Request) -> web.Response | None:
        self.requests.append((request.method, request.path_qs))
        if not self.serve_dra:
            return _status(404, "NotFound", "the server could not find the requested resource")
        return None

    async def _list_slices(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._gate(request) or self._fail("list_slices")) is not None:
            return refused
        if request.query.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request, {}, "resourceslices")  # type: ignore[attr-defined]
        wanted: dict[str, str] = {}
        for part in (request.query.get("fieldSelector") or "").split(","):
            key, _, value = part.partition("=")
            if key.strip() in _SLICE_FIELDS:
                wanted[_SLICE_FIELDS[key.strip()]] = value.lstrip("=").strip()
        items = [s for _, s in sorted(self._slices.items())
                 if all((s.get("spec") or {}).get(k) == v for k, v in wanted.items())]
        return web.json_response({"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                                  "metadata": {"resourceVersion": str(self._rv)}, "items": items})

    def _invalid(self, obj: dict[str, Any]) -> web.Response | None:
        if not self.validate_dra or kubernetes_validate is None:
            return None
        try:
            kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            return _status(422, "Invalid", f"{obj.get('kind')} is invalid: {getattr(e, 'message', e)}")
        return None

    async def _create_slice(self, request: web.Request) -> web.Response:
        if (refused := self._gate(request) or self._fail("create_slice")) is not None:
            return refused
        try:
            obj = await request.json()
        except json.JSONDecodeError:
            return _status(400, "BadRequest", "body is not JSON")
        if (bad := self._invalid(obj)) is not None:
            return bad
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                return _status(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if meta["name"] in self._slices and request.query.get("dryRun") != "All":
            return _status(409, "AlreadyExists", f'resourceslices.resource.k8s.io "{meta["name"]}" already exists')
        if not self.consumable_capacity:
            _drop_consumable_capacity(obj)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if request.query.get("dryRun") == "All":
            meta["resourceVersion"] = ""
            return web.json_response(obj, status=201)
        meta["resourceVersion"] = self._next_rv()
        self._slices[meta["name"]] = obj
        self._publish("resourceslices", None, obj)
        self.slice_writes.append(("create", meta["name"]))
        return web.json_response(obj, status=201)

    async def _get_slice(self, request: web.Request) -> web.Response:
        if (refused := self._gate(request) or self._fail("get_slice")) is not None:
            return refused
        obj = self._slices.get(request.match_info["name"])
        if obj is None:
            return _status(404, "NotFound", f'resourceslices.resource.k8s.io "{request.match_info["name"]}" not found')
        return web.json_response(obj)

    async def _replace_slice(self, request: web.Request) -> web.Response:
        if (refused := self._gate(request) or self._fail("replace_slice")) is not None:
            return refused
        name = request.match_info["name"]
        old = self._slices.get(name)
        if old is None:
            return _status(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')
        obj = await request.json()
        if (bad := self._invalid(obj)) is not None:
            return bad
        meta = obj.setdefault("metadata", {})
        if meta.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"]):
            return _status(409, "Conflict", f'Operation cannot be fulfilled on resourceslices.resource.k8s.io "{name}": '
                                            "the object has been modified; please apply your changes to the latest "
                                            "version and try again")
        if (obj.get("spec") or {}).get("nodeName") != (old.get("spec") or {}).get("nodeName"):
            return _status(422, "Invalid", "spec.nodeName: field is immutable")
        if not self.consumable_capacity:
            _drop_consumable_capacity(obj)
        meta.update(uid=old["metadata"]["uid"], creationTimestamp=old["metadata"]["creationTimestamp"],
                    generation=old["metadata"].get("generation", 1) + (obj.get("spec") != old.get("spec")),
                    resourceVersion=self._next_rv(), name=name)
        self._slices[name] = obj
        self._publish("resourceslices", old, obj)
        self.slice_writes.append(("update", name))
        return web.json_response(obj)

    async def _delete_slice(self, request: web.Request) -> web.Response:
        if (refused := self._gate(request) or self._fail("delete_slice")) is not None:
            return refused
        name = request.match_info["name"]
        obj = self._slices.pop(name, None)
        if obj is None:
            return _status(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')
        self._publish("resourceslices", obj, None)
        self.slice_writes.append(("delete", name))
        return web.json_response(obj)

    async def _list_claims(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._gate(request)) is not None:
            return refused
        if request.query.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request, {}, "resourceclaims")  # type: ignore[attr-defined]
        ns = request.match_info.get("ns")
        items = [c for (cns, _), c in sorted(self._claims.items()) if ns is None or cns == ns]
        return web.json_response({"kind": "ResourceClaimList", "apiVersion": "resource.k8s.io/v1",
                                  "metadata": {"resourceVersion": str(self._rv)}, "items": items})

    async def _get_claim(self, request: web.Request) -> web.Response:
        if (refused := self._gate(request) or self._fail("get_claim")) is not None:
            return refused
        obj = self._claims.get((request.match_info["ns"], request.match_info["name"]))
        if obj is None:
            return _status(404, "NotFound", f'resourceclaims.resource.k8s.io "{request.match_info["name"]}" not found')
        return web.json_response(obj)

    async def _get_class(self, request: web.Request) -> web.Response:
        if (refused := self._gate(request)) is not None:
            return refused
        obj = self._classes.get(request.match_info["name"])
        if obj is None:
            return _status(404, "NotFound", f'deviceclasses.resource.k8s.io "{request.match_info["name"]}" not found')
        return web.json_response(obj)
