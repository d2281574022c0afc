"""The extender's bind verb: decide every container's GPU, record it on the pod, then bind the pod.

ExtenderBindingArgs (`PodName`, `PodNamespace`, `PodUID`, `Node`) in, ExtenderBindingResult (`Error`) out.
  1. Wait (up to `bind_wait_s`) until no other pod holds the node's lock: at most one pod per node is between bind
     and admission, so the node agent always knows which pod kubelet is admitting.
  2. Place the pod's containers by its profile with the shared fit rule on the view's free units, and reserve
     them in the view at once (no await in between: concurrent binds never see the same free units).
  3. Write the decision (`ai.centaurus.io/placement`) on the pod, then POST its Binding.
A failure at any step undoes the reservation (and the annotation, best effort) and answers `Error`, which sends
the pod back to kube-scheduler's queue; nothing is left held. `stop()` (SIGTERM) answers every bind waiting for a
lock, and every later one, with an `Error` at once: kube-scheduler retries them against the next extender.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from alnair_agent.kube.client import MERGE_PATCH, read_json
from alnair_agent.kube.pods import PodError, PodInfo, parse_pod
from alnair_agent.node import fit
from alnair_agent.node.decision import LOCK_TTL_S, PLACEMENT_ANNOTATION, Decision
from alnair_agent.scheduler.extender import PROFILES, _field
from alnair_agent.scheduler.view import ClusterView, Reservation, utcnow

log = structlog.get_logger(__name__)

BIND_WAIT_S = 20.0  # below the httpTimeout the manifest gives kube-scheduler for the extender (30 s)
REQUEST_TIMEOUT_S = 10.0


class BindError(Exception):
    """Why the pod was not bound (goes into ExtenderBindingResult.Error)."""


@dataclass(frozen=True)
class BindArgs:
    name: str
    namespace: str
    uid: str
    node: str


def parse_bind_args(args: Any) -> BindArgs:
    if not isinstance(args, Mapping):
        raise BindError(f"ExtenderBindingArgs must be a JSON object, not {type(args).__name__}")
    values = {}
    for key in ("PodName", "PodNamespace", "PodUID", "Node"):
        value = _field(args, key)
        if not isinstance(value, str) or not value:
            raise BindError(f"ExtenderBindingArgs.{key} must be a non-empty string, not {json.dumps(value)[:80]}")
        values[key] = value
    return BindArgs(values["PodName"], values["PodNamespace"], values["PodUID"], values["Node"])


@dataclass
class Binder:
    view: ClusterView
    api: ApiClient
    bind_wait_s: float = BIND_WAIT_S
    request_timeout_s: float = REQUEST_TIMEOUT_S
    _stopping: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self.core = CoreV1Api(self.api)

    def stop(self) -> None:
        """The extender is stopping: answer the binds waiting for a lock, and any new one, with an Error now."""
        self._stopping.set()
        self.view.wake()

    async def bind(self, raw: Any) -> str:
        """"" when bound, else the reason (never raises for bad input or API failures)."""
        try:
            args = parse_bind_args(raw)
            if self._stopping.is_set():
                raise BindError(self._stopping_error(args))
            await self._bind(args)
        except BindError as e:
            return str(e)
        return ""

    @staticmethod
    def _stopping_error(args: BindArgs) -> str:
        return (f"pod {args.namespace}/{args.name}: alnair-scheduler is stopping (a restart or a rollout); "
                "kube-scheduler will retry")

    async def _pod(self, args: BindArgs) -> PodInfo:
        pod = self.view.pods.get(args.uid)
        if pod is None:  # not one of the profiles' pods the view watches, or the watch is behind
            try:
                resp = await self.core.read_namespaced_pod(args.name, args.namespace, _preload_content=False,
                                                           _request_timeout=self.request_timeout_s)
                pod = parse_pod(await read_json(resp))
            except ApiException as e:
                raise BindError(f"pod {args.namespace}/{args.name}: cannot read it: {e.status} {e.reason}") from None
            except (aiohttp.ClientError, TimeoutError, OSError, PodError) as e:
                raise BindError(f"pod {args.namespace}/{args.name}: cannot read it: {e}") from None
        if pod.uid != args.uid:
            raise BindError(f"pod {args.namespace}/{args.name} has uid {pod.uid}, not {args.uid}: it was replaced")
        if pod.invalid:
            bad = pod.invalid[0]
            raise BindError(f"pod {pod.namespace}/{pod.name}: {bad.describe()}")
        return pod

    async def _bind(self, args: BindArgs) -> None:
        pod = await self._pod(args)
        ref = f"{args.namespace}/{args.name}"
        needs = tuple(pod.needs())
        if not needs:
            await self._post_binding(args)
            log.info("bound", pod=ref, node=args.node, gpus={})
            return
        policy = PROFILES.get(pod.scheduler_name, fit.PACK)
        loop = asyncio.get_running_loop()
        started = loop.time()
        holder = self.view.locked(args.node)
        if holder:
            log.info("bind_waiting_for_lock", pod=ref, node=args.node, holder=holder)
        if not await self.view.wait_unlocked(args.node, self.bind_wait_s, self._stopping):
            if self._stopping.is_set():
                raise BindError(self._stopping_error(args))
            holder = self.view.locked(args.node)
            raise BindError(f"pod {ref}: node {args.node} stayed locked by pod {holder} (waiting for kubelet to "
                            f"admit it) for {self.bind_wait_s:.0f} s; kube-scheduler will retry")
        # From here to reserve() nothing awaits: no other bind can take the same units.
        summary = self.view.summary(args.node)
        if summary.rooms is None:
            raise BindError(f"pod {ref}: node {args.node}: {summary.error}")
        placed = fit.place(needs, summary.rooms, policy)
        if not isinstance(placed, fit.Placement):
            raise BindError(f"pod {ref}: node {args.node}: {placed.reason}")
        decision = Decision(args.node, pod.scheduler_name, utcnow(), dict(placed.gpus))
        self.view.reserve(Reservation(args.uid, args.namespace, args.name, needs, decision))
        waited = loop.time() - started
        annotated = False
        try:
            await self._annotate(args, decision.to_json())
            annotated = True
            await self._post_binding(args)
        except BindError:
            self.view.unreserve(args.uid)
            if annotated:
                await self._unannotate(args)
            raise
        except asyncio.CancelledError:  # stopping, and its API calls outlasted the server's grace
            self.view.unreserve(args.uid)
            raise
        log.info("bound", pod=ref, node=args.node, gpus=dict(placed.gpus), profile=pod.scheduler_name,
                 lock_wait_s=round(waited, 3))

    async def _annotate(self, args: BindArgs, value: str) -> None:
        body = {"metadata": {"annotations": {PLACEMENT_ANNOTATION: value}}}
        try:
            resp = await self.core.patch_namespaced_pod(args.name, args.namespace, body, _content_type=MERGE_PATCH,
                                                        _preload_content=False,
                                                        _request_timeout=self.request_timeout_s)
            await read_json(resp)
        except ApiException as e:
            raise BindError(f"pod {args.namespace}/{args.name}: cannot record the placement: {e.status} "
                            f"{e.reason}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise BindError(f"pod {args.namespace}/{args.name}: cannot record the placement: {e}") from None

    async def _unannotate(self, args: BindArgs) -> None:
        try:
            await self._annotate(args, None)  # type: ignore[arg-type]  # null removes the key
        except BindError as e:
            # An unbound pod's stale decision counts nowhere (the view counts bound pods only) and the next bind
            # overwrites it.
            log.warning("placement_not_removed", pod=f"{args.namespace}/{args.name}", error=str(e))

    async def _post_binding(self, args: BindArgs) -> None:
        body = {"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": args.name, "namespace": args.namespace, "uid": args.uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": args.node}}
        try:
            resp = await self.core.create_namespaced_pod_binding(args.name, args.namespace, body,
                                                                 _preload_content=False,
                                                                 _request_timeout=self.request_timeout_s)
            await read_json(resp)
        except ApiException as e:
            raise BindError(f"pod {args.namespace}/{args.name}: binding to {args.node} refused: {e.status} "
                            f"{e.reason}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise BindError(f"pod {args.namespace}/{args.name}: binding to {args.node} failed: {e}") from None


__all__ = ["BIND_WAIT_S", "LOCK_TTL_S", "BindError", "Binder", "parse_bind_args"]
