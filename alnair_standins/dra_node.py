"""A DRA node for the tests: the real agent in DRA mode, the DRA kubelet emulator, the API server stand-in serving
resource.k8s.io/v1 and the allocator stand-in playing kube-scheduler; and the objects users write (claims, pods).

    async with dra_node(root, api) as node:              # agent + kubelet, slice published, plugin registered
        claim = node.claim("c1", [{"name": "gpu", "memory": "4Gi", "compute": "30"}])
        pod = node.pod("p1", {"gpu": "c1"}, [("main", [("gpu", None)])])
        node.schedule(pod, ["c1"])                       # allocation + reservedFor, as kube-scheduler writes them
        view = await node.start(pod)                     # kubelet: prepare the pod's claims, create its containers
        await node.finish(pod)                           # containers gone, claims unprepared

    async with dra_node(root, api, process=True) as node:  # the agent as its own process (`python -m
        ...                                                # alnair_agent.main`, KUBECONFIG to the stand-in): no
                                                           # `node.running`; measures the agent on its own loop
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from alnair_agent.config import Settings
from alnair_agent.constants import DRA_ATTR_UUID, DRA_DEVICE_CLASS, DRA_DRIVER
from alnair_agent.dra.capacity import slice_name
from alnair_agent.kube.events import EventWriter
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.apiserver_process import ApiServerProcess
from alnair_standins.dra_allocator import Allocator, reserved_for
from alnair_standins.kubelet_dra import Claim, ContainerView, DraKubeletEmulator
from alnair_standins.node import (
    NODE,
    AgentProcess,
    RunningAgent,
    kubernetes_for,
    node_settings,
    running_agent,
)

ROOT = Path(__file__).resolve().parents[1]  # a checkout: the manifests are read from it


def device_class() -> dict[str, Any]:
    """The DeviceClass as manifests/alnair-dra.yaml ships it."""
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "alnair-dra.yaml").read_text()) if d]
    return next(d for d in docs if d["kind"] == "DeviceClass" and d["metadata"]["name"] == DRA_DEVICE_CLASS)


def claim_spec(requests: list[Mapping[str, Any]], distinct: list[list[str]] | None = None) -> dict[str, Any]:
    """A claim's spec: each request {"name", "memory"?, "compute"?, "count"?, "selectors"?} of the Alnair class;
    `distinct`: sets of requests whose devices must be distinct GPUs (a distinctAttribute constraint on the uuid
    attribute each; [] binds all requests)."""
    out = []
    for r in requests:
        capacity = {k: str(r[k]) for k in ("memory", "compute") if k in r}
        exactly: dict[str, Any] = {"deviceClassName": r.get("class", DRA_DEVICE_CLASS)}
        if capacity:
            exactly["capacity"] = {"requests": capacity}
        if "count" in r:
            exactly["count"] = r["count"]
        if "selectors" in r:
            exactly["selectors"] = [{"cel": {"expression": e}} for e in r["selectors"]]
        out.append({"name": r["name"], "exactly": exactly})
    devices: dict[str, Any] = {"requests": out}
    if distinct is not None:
        devices["constraints"] = [{**({"requests": names} if names else {}),
                                   "distinctAttribute": f"{DRA_DRIVER}/{DRA_ATTR_UUID}"} for names in distinct]
    return {"devices": devices}


def make_claim(name: str, requests: list[Mapping[str, Any]], namespace: str = "default",
               distinct: list[list[str]] | None = None) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
            "spec": claim_spec(requests, distinct)}


def make_claim_pod(name: str, claims: Mapping[str, str], containers: list[tuple[str, list[tuple[str, str | None]]]],
                   namespace: str = "default", node: str = NODE) -> dict[str, Any]:
    """A pod whose containers reference claims: `claims` maps the pod's claim entry to a ResourceClaim name;
    each container names entries, each with a request or None for the whole claim."""
    pod = make_pod(name, namespace=namespace, node=node, containers=[{"name": c} for c, _ in containers])
    pod["spec"]["resourceClaims"] = [{"name": k, "resourceClaimName": v} for k, v in claims.items()]
    for spec, (_, refs) in zip(pod["spec"]["containers"], containers, strict=True):
        spec["resources"] = {"claims": [{"name": k, **({"request": r} if r else {})} for k, r in refs]}
    return pod


@dataclass
class DraNode:
    api: FakeApiServer | ApiServerProcess
    settings: Settings
    kubelet: DraKubeletEmulator
    running: RunningAgent
    allocator: Allocator
    client: Any = None
    node: str = NODE
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> pod JSON
    _agent: Any = None  # the running agent's context manager
    process: AgentProcess | None = None  # the agent as its own process (then `running` is None)
    events: EventWriter | None = None  # the agent's Event writer (dra_node(events=True)), drained as it stops

    async def start_agent(self) -> None:
        since = sum(d == DRA_DRIVER for d, _ in self.kubelet.registrations)
        if self.process is not None:
            await self._start_process(since)
            return
        self._agent = running_agent(self.settings, kubernetes_for(self.client, dra=True, node=self.node,
                                                                  events=self.events))
        self.running = await self._agent.__aenter__()
        await self.kubelet.wait_registered(DRA_DRIVER, since=since)
        dra = self.running.agent.dra
        assert dra is not None and self.running.agent.frontend == "dra"
        await dra.slices.synced.wait()

    async def _start_process(self, since: int) -> None:
        """`python -m alnair_agent.main`: registered with kubelet and its slice published (a fresh interpreter
        imports for a few seconds; the slice is what tells the agent is serving)."""
        assert self.process is not None
        self.process.start()
        try:
            await self.kubelet.wait_registered(DRA_DRIVER, timeout=60, since=since)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while self.api.resource_slice(slice_name(self.node)) is None:
                assert self.process.proc is not None and self.process.proc.poll() is None, self.process.output()[-3000:]
                assert loop.time() < deadline, "no ResourceSlice from the agent process"
                await asyncio.sleep(0.05)
        except BaseException:
            self._stop_process()
            raise

    def _stop_process(self) -> None:
        proc = self.process.proc if self.process is not None else None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    async def stop_agent(self) -> None:
        if self.process is not None:
            await asyncio.to_thread(self._stop_process)  # the stand-ins keep answering while it shuts down
            return
        agent, self._agent = self._agent, None
        if agent is not None:
            await agent.__aexit__(None, None, None)

    async def restart_agent(self) -> None:
        """The agent restarts (a crash, an upgrade); kubelet, its checkpoint and the API server stay."""
        await self.stop_agent()
        await self.start_agent()

    def claim(self, name: str, requests: list[Mapping[str, Any]], namespace: str = "default",
              distinct: list[list[str]] | None = None) -> dict[str, Any]:
        return self.api.add_claim(make_claim(name, requests, namespace, distinct))

    def pod(self, name: str, claims: Mapping[str, str], containers: list[tuple[str, list[tuple[str, str | None]]]],
            namespace: str = "default") -> dict[str, Any]:
        pod = self.api.add_pod(make_claim_pod(name, claims, containers, namespace, self.node))
        self.pods[name] = pod
        return pod

    def slices(self) -> list[dict[str, Any]]:
        return self.api.resource_slices()

    def schedule(self, pod: Mapping[str, Any], claim_names: list[str]) -> list[dict[str, Any]]:
        """What kube-scheduler does for the pod: allocate each claim not yet allocated (allocator stand-in), then
        reserve it for the pod. AllocationFailed when one does not fit (nothing of this pod is then written)."""
        ns = pod["metadata"]["namespace"]
        done: list[tuple[str, dict[str, Any]]] = []
        try:
            for name in claim_names:
                claim = self.api.claim(ns, name)
                status = dict(claim.get("status") or {})
                if "allocation" not in status:
                    status["allocation"] = self.allocator.allocate(claim, self.node, self.slices())
                    done.append((name, status))
                status["reservedFor"] = [*(status.get("reservedFor") or []),
                                         *[r for r in reserved_for(pod) if r not in (status.get("reservedFor") or [])]]
                self.api.set_claim_status(ns, name, status)
        except Exception:
            for name, status in done:
                self.allocator.release({"status": status})
                self.api.set_claim_status(ns, name, {})
            raise
        return [self.api.claim(ns, n) for n in claim_names]

    def refs(self, pod: Mapping[str, Any]) -> dict[str, Claim]:
        """The pod's claim entries as kubelet names the claims to the plugin."""
        ns = pod["metadata"]["namespace"]
        out = {}
        for entry in pod["spec"]["resourceClaims"]:
            c = self.api.claim(ns, entry["resourceClaimName"])
            out[entry["name"]] = Claim(ns, c["metadata"]["uid"], c["metadata"]["name"])
        return out

    async def prepare(self, pod: Mapping[str, Any]) -> None:
        await self.kubelet.prepare(DRA_DRIVER, list(dict.fromkeys(self.refs(pod).values())))

    def start_containers(self, pod: Mapping[str, Any]) -> dict[str, ContainerView]:
        refs = self.refs(pod)
        out = {}
        for c in pod["spec"]["containers"]:
            claims = [(refs[r["name"]], r.get("request")) for r in c["resources"]["claims"]]
            out[c["name"]] = self.kubelet.start_container(pod["metadata"]["namespace"], pod["metadata"]["name"],
                                                          c["name"], claims)
        return out

    async def start(self, pod: Mapping[str, Any]) -> dict[str, ContainerView]:
        await self.prepare(pod)
        return self.start_containers(pod)

    async def finish(self, pod: Mapping[str, Any], deallocate: bool = True) -> None:
        """The pod ends: its containers go, kubelet unprepares its claims; kube-scheduler's claim controller then
        deallocates them (their capacity free again)."""
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.kubelet.stop_pod(ns, name)
        refs = list(dict.fromkeys(self.refs(pod).values()))
        await self.kubelet.unprepare(DRA_DRIVER, refs)
        if deallocate:
            for ref in refs:
                claim = self.api.claim(ns, ref.name)
                self.allocator.release(claim)
                self.api.set_claim_status(ns, ref.name, {})


@contextlib.asynccontextmanager
async def dra_node(root: Path, api: FakeApiServer | ApiServerProcess, process: bool = False, events: bool = False,
                   **overrides: Any) -> AsyncIterator[DraNode]:
    """The real agent with the DRA front-end on `root`, its kubelet, and the DeviceClass on the API server
    (`node_name=` in `overrides` names another node: several can share one API server). `process`: the agent runs
    as its own process, reaching the stand-in by KUBECONFIG, as on a node. `events`: the agent writes Events (in
    process only)."""
    settings = replace(node_settings(root, frontend="dra", dra_plugin_dir=root / "plugins" / "alnair",
                                     plugins_registry_dir=root / "plugins_registry", cdi_dir=root / "cdi",
                                     place_unscheduled=False), **overrides)
    if not api.has_device_class(DRA_DEVICE_CLASS):
        api.add_device_class(device_class())
    agent_process = None
    if process:
        if not api.has_node(settings.node_name):  # the agent's node report goes on it
            api.add_node(settings.node_name)
        root.mkdir(parents=True, exist_ok=True)
        agent_process = AgentProcess(settings, extra_env={
            "ALNAIR_KUBERNETES": "auto", "KUBECONFIG": str(api.write_kubeconfig(root / "kubeconfig"))})
    client = api.api_client()
    try:
        async with DraKubeletEmulator(settings.plugins_registry_dir, settings.cdi_dir,
                                      settings.pod_resources_socket) as kubelet:
            allocator = Allocator({DRA_DEVICE_CLASS: device_class()})
            allocator.learn(api.claims())  # kube-scheduler's view: what claims already hold
            node = DraNode(api, settings, kubelet, None, allocator, client, settings.node_name,  # type: ignore[arg-type]
                           process=agent_process,
                           events=EventWriter(client, settings.node_name) if events and not process else None)
            await node.start_agent()
            assert api.resource_slice(slice_name(settings.node_name)) is not None
            try:
                yield node
            finally:
                await node.stop_agent()
                if node.events is not None:
                    await node.events.drain()
    finally:
        await client.close()
