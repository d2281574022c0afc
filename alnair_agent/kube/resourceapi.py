"""The agent's calls on resource.k8s.io/v1 (the DRA front-end): its node's ResourceSlice, the claims kubelet asks it
to prepare, the DeviceClass, and whether the API server serves the group at all.

Raw JSON through kubernetes-asyncio's ResourceV1Api (`_preload_content=False`), as everywhere in the agent: no client
models are built, and the stand-in API server of the tests speaks the same JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, ResourceV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from alnair_agent.dra.claims import ClaimUnavailable
from alnair_agent.kube.client import read_json

REQUEST_TIMEOUT_S = 5.0


class ResourceApiError(RuntimeError):
    """A resource.k8s.io call failed; `status` is the HTTP status (0 for no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def _error(what: str, e: Exception) -> ResourceApiError:
    if isinstance(e, ApiException):
        return ResourceApiError(f"{what}: HTTP {e.status} {e.reason}", e.status or 0)
    return ResourceApiError(f"{what}: {type(e).__name__}: {e}")


class ResourceApi:
    def __init__(self, api: ApiClient, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.v1 = ResourceV1Api(api)
        self.timeout_s = timeout_s

    async def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            resp = await method(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
            return await read_json(resp)
        except (ApiException, aiohttp.ClientError, TimeoutError, OSError) as e:
            raise _error(what, e) from None

    async def served(self) -> bool:
        """Whether the API server serves resource.k8s.io/v1 with ResourceSlices (Kubernetes 1.34 and later)."""
        try:
            body = await self._call("discovery of resource.k8s.io/v1", self.v1.get_api_resources)
        except ResourceApiError as e:
            if e.status == 404:
                return False
            raise
        resources = body.get("resources") if isinstance(body, Mapping) else None
        return any(isinstance(r, Mapping) and r.get("name") == "resourceslices" for r in resources or [])

    async def device_class_exists(self, name: str) -> bool:
        try:
            await self._call(f"DeviceClass {name}", self.v1.read_device_class, name)
        except ResourceApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The ResourceClaim, or None when it does not exist; ClaimUnavailable when the server does not say."""
        try:
            return await self._call(f"ResourceClaim {namespace}/{name}", self.v1.read_namespaced_resource_claim,
                                    name, namespace)
        except ResourceApiError as e:
            if e.status == 404:
                return None
            raise ClaimUnavailable(str(e)) from None

    async def get_slice(self, name: str) -> Mapping[str, Any] | None:
        try:
            return await self._call(f"ResourceSlice {name}", self.v1.read_resource_slice, name)
        except ResourceApiError as e:
            if e.status == 404:
                return None
            raise

    async def create_slice(self, body: Mapping[str, Any], dry_run: bool = False) -> Mapping[str, Any]:
        kwargs = {"dry_run": "All"} if dry_run else {}
        return await self._call("create ResourceSlice", self.v1.create_resource_slice, dict(body), **kwargs)

    async def replace_slice(self, name: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return await self._call(f"update ResourceSlice {name}", self.v1.replace_resource_slice, name, dict(body))

    async def delete_slice(self, name: str) -> bool:
        """Delete the slice; False when it was not there."""
        try:
            await self._call(f"delete ResourceSlice {name}", self.v1.delete_resource_slice, name)
        except ResourceApiError as e:
            if e.status == 404:
                return False
            raise
        return True
