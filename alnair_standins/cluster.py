"""A small cluster for the placement tests and the placement benchmark, run in one event loop:

- the API server stand-in (real Kubernetes JSON to the real kubernetes-asyncio clients);
- `alnair-scheduler` (the real extender: its view fed by real watches, its verbs over real HTTP, binding through the
  API) and a kube-scheduler emulator that drives it the way kube-scheduler does: one scheduling cycle at a time
  (filter with node names, prioritize, the best score, ties broken at random), binding asynchronously, a pod whose
  bind fails going back into a backoff queue (1 s doubling to 10 s);
- per node, the real agent (in-process) beside a kubelet emulator speaking the real device plugin and pod-resources
  protocols, and a driver doing what kubelet's pod workers do: admit the pods bound to the node one at a time in
  the order its watch delivers them, each container in pod order, each container's resources in random (Go map)
  order; then report the pod's containers running, or the pod Failed with UnexpectedAdmissionError; free a pod's
  devices when it finishes or is deleted (pod-resources lists active pods only).

Randomness comes from one seeded generator, so a failing seed replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from kubernetes_asyncio.client import ApiClient, CoreV1Api

from alnair_agent import http_stop
from alnair_agent.app import Agent, Kubernetes
from alnair_agent.config import Settings
from alnair_agent.kube.annotations import AnnotationWriter, WriterTiming
from alnair_agent.kube.podwatch import PodWatch, WatchTiming
from alnair_agent.kube.wiring import pod_resources_lister
from alnair_agent.scheduler.bind import Binder
from alnair_agent.scheduler.extender import PROFILES
from alnair_agent.scheduler.main import reflectors
from alnair_agent.scheduler.server import SHUTDOWN_TIMEOUT_S, build_app
from alnair_agent.scheduler.view import ClusterView
from alnair_standins.apiserver import FakeApiServer, make_pod
from alnair_standins.gpu import SimulatedBackend
from alnair_standins.kubelet import AdmissionError, KubeletEmulator

MEM = "alnair/vgpu-memory"
SM = "alnair/vgpu-compute"


def alnair_pod(name: str, containers: list[dict[str, Any]], profile: str = "alnair-cost-saving",
               namespace: str = "default", **kwargs: Any) -> dict[str, Any]:
    """An unbound pod for one of Alnair's profiles."""
    pod = make_pod(name, namespace=namespace, node=None, containers=containers, **kwargs)
    pod["spec"]["schedulerName"] = profile
    return pod


# -- kube-scheduler ---------------------------------------------------------------------------------------------

@dataclass
class SchedulerEmulator:
    """kube-scheduler with the extender configured (filter, prioritize, bind; nodeCacheCapable)."""

    api: FakeApiServer
    url: str
    nodes: list[str]
    rng: random.Random
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 10.0
    queue: asyncio.Queue[tuple[str, str]] = field(default_factory=asyncio.Queue)
    attempts: dict[tuple[str, str], int] = field(default_factory=dict)
    bind_errors: list[tuple[str, str]] = field(default_factory=list)
    unschedulable: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    bound_at: dict[tuple[str, str], float] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def on_pod_change(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if new is None or old is not None:
            return
        if new["spec"].get("schedulerName") in PROFILES and not new["spec"].get("nodeName"):
            self.queue.put_nowait((new["metadata"]["namespace"], new["metadata"]["name"]))

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            try:
                while True:
                    key = await self.queue.get()
                    await self._schedule_one(http, key)
            finally:
                for task in self._tasks:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)

    def _retry_later(self, key: tuple[str, str]) -> None:
        n = self.attempts.get(key, 0)
        delay = min(self.backoff_initial_s * (2 ** max(0, n - 1)), self.backoff_max_s)

        async def later() -> None:
            await asyncio.sleep(delay)
            self.queue.put_nowait(key)
        self._spawn(later())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _schedule_one(self, http: aiohttp.ClientSession, key: tuple[str, str]) -> None:
        namespace, name = key
        try:
            pod = self.api.pod(namespace, name)
        except KeyError:
            return  # deleted meanwhile
        if pod["spec"].get("nodeName"):
            return
        self.attempts[key] = self.attempts.get(key, 0) + 1
        args = {"Pod": pod, "Nodes": None, "NodeNames": list(self.nodes)}
        try:
            async with http.post(self.url + "/filter", json=args) as resp:
                result = await resp.json()
            passed = result.get("NodeNames") or []
            if not result.get("Error") and passed:
                async with http.post(self.url + "/prioritize", json={**args, "NodeNames": passed}) as resp:
                    scores = {h["Host"]: h["Score"] for h in await resp.json()}
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # the extender restarted mid-request
            result, passed = {"Error": f"extender unreachable: {e}"}, []
        if result.get("Error") or not passed:
            self.unschedulable.append((name, {**(result.get("FailedNodes") or {}),
                                              **(result.get("FailedAndUnresolvableNodes") or {}),
                                              "error": result.get("Error", "")}))
            self._retry_later(key)
            return
        best = max(scores.values(), default=0)
        node = self.rng.choice(sorted(n for n in passed if scores.get(n, 0) == best))
        self._spawn(self._bind(http, key, pod, node))

    async def _bind(self, http: aiohttp.ClientSession, key: tuple[str, str], pod: dict[str, Any], node: str) -> None:
        meta = pod["metadata"]
        try:
            async with http.post(self.url + "/bind", json={"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                                           "PodUID": meta["uid"], "Node": node}) as resp:
                result = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # the extender restarted mid-request
            result = {"Error": f"extender unreachable: {e}"}
        if result.get("Error"):
            self.bind_errors.append((meta["name"], result["Error"]))
            self._retry_later(key)
        else:
            self.bound_at[key] = time.monotonic()


# -- kubelet's pod workers --------------------------------------------------------------------------------------

@dataclass
class Admission:
    pod: str
    namespace: str
    answers: dict[str, dict[str, Any]]  # container -> resource -> ContainerAllocateResponse
    at: float


@dataclass
class KubeletDriver:
    """Admits the pods bound to `node` as kubelet does, through `kubelet` (the device-plugin side)."""

    api: FakeApiServer
    kubelet: KubeletEmulator
    node: str
    rng: random.Random
    max_delay_s: float = 0.02  # kubelet's watch trails or leads the agent's by up to this much
    order: str = "fifo"  # how a batch of pods waiting together is admitted: fifo, reverse or random
    queue: asyncio.Queue[tuple[str, str, str]] = field(default_factory=asyncio.Queue)
    admitted: dict[str, Admission] = field(default_factory=dict)  # uid -> what its containers got
    refused: dict[str, str] = field(default_factory=dict)  # uid -> why
    paused: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: admissions wait (kubelet down)

    def __post_init__(self) -> None:
        self.paused.set()

    def on_pod_change(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        was_here = old is not None and old["spec"].get("nodeName") == self.node
        here = new is not None and new["spec"].get("nodeName") == self.node
        if here and not was_here:
            meta = new["metadata"]
            self.queue.put_nowait((meta["namespace"], meta["name"], meta["uid"]))
        if was_here and (not here or new["status"].get("phase") in ("Succeeded", "Failed")):
            self.kubelet.remove_pod(old["metadata"]["namespace"], old["metadata"]["name"])

    async def run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            await asyncio.sleep(self.rng.uniform(0, self.max_delay_s))
            await self.paused.wait()
            while not self.queue.empty():  # every pod that arrived meanwhile is admitted in this batch's order
                batch.append(self.queue.get_nowait())
            if self.order == "reverse":
                batch.reverse()
            elif self.order == "random":
                self.rng.shuffle(batch)
            for namespace, name, uid in batch:
                try:
                    pod = self.api.pod(namespace, name)
                except KeyError:
                    continue  # deleted before kubelet got to it
                if pod["metadata"]["uid"] != uid or pod["status"].get("phase") in ("Succeeded", "Failed"):
                    continue
                await self._admit(pod)

    async def _admit(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        answers: dict[str, dict[str, Any]] = {}
        try:
            for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
                limits = (c.get("resources") or {}).get("limits") or {}
                requests = [(r, int(limits[r])) for r in (MEM, SM) if int(limits.get(r, 0) or 0) > 0]
                self.rng.shuffle(requests)  # Go map order
                if requests:
                    answers[c["name"]] = await self.kubelet.admit(meta["namespace"], meta["name"], c["name"],
                                                                  dict(requests))
        except AdmissionError as e:
            message = self.refused[meta["uid"]] = str(e)
            self.kubelet.remove_pod(meta["namespace"], meta["name"])
            with contextlib.suppress(KeyError):
                def failed(p: dict[str, Any]) -> None:
                    p["status"]["phase"] = "Failed"
                    p["status"]["reason"] = "UnexpectedAdmissionError"
                    p["status"]["message"] = message
                self.api.modify_pod(meta["namespace"], meta["name"], failed)
            return
        self.admitted[meta["uid"]] = Admission(meta["name"], meta["namespace"], answers, time.monotonic())
        with contextlib.suppress(KeyError):
            for c in pod["spec"]["containers"]:
                self.api.set_container_running(meta["namespace"], meta["name"], c["name"])
            self.api.set_phase(meta["namespace"], meta["name"], "Running")


# -- the cluster ------------------------------------------------------------------------------------------------

@dataclass
class Node:
    name: str
    settings: Settings
    kubelet: KubeletEmulator
    driver: KubeletDriver
    client: ApiClient
    agent: Agent | None = None
    stop: asyncio.Event | None = None
    task: asyncio.Task[None] | None = None
    lister: Any = None

    @property
    def workspace(self) -> Path:
        return self.settings.workspace


def _kubernetes(client: ApiClient, node: str) -> Kubernetes:
    watch = PodWatch(client, node, WatchTiming(backoff_initial_s=0.05, backoff_max_s=0.5))
    writer = AnnotationWriter(client, node, WriterTiming(min_interval_s=0.5, backoff_initial_s=0.05,
                                                         backoff_max_s=0.5))
    return Kubernetes(pods=watch, annotations=writer,
                      services=[("pod-watch", watch.run), ("annotations", writer.run)])


@dataclass
class Cluster:
    api: FakeApiServer
    root: Path
    rng: random.Random
    nodes: dict[str, Node] = field(default_factory=dict)
    scheduler: SchedulerEmulator | None = None
    view: ClusterView | None = None
    _extender_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _extender_server: TestServer | None = None
    _binder: Binder | None = None
    _extender_client: ApiClient | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    # -- agents ----------------------------------------------------------------------------------------------
    async def start_agent(self, name: str) -> None:
        node = self.nodes[name]
        backend = SimulatedBackend.from_settings(node.settings)
        registered = len(node.kubelet.registrations)
        node.lister = pod_resources_lister(node.settings)
        list_held = await node.lister.__aenter__()
        node.agent = Agent(node.settings, backend, _kubernetes(node.client, name), list_held=list_held)
        node.stop = asyncio.Event()
        node.task = asyncio.create_task(node.agent.run(node.stop), name=f"agent-{name}")
        await asyncio.wait_for(node.agent.ready.wait(), 10)
        # kubelet talks to the new plugin only once it has registered (its old channels are closed then).
        await node.kubelet.wait_for(lambda k: len(k.registrations) >= registered + 2
                                    and len(k.plugins) == 2 and all(v.devices for v in k.plugins.values()), 10)

    async def stop_agent(self, name: str) -> None:
        node = self.nodes[name]
        if node.task is None:
            return
        assert node.stop is not None
        node.stop.set()
        await asyncio.wait_for(node.task, 10)
        await node.lister.__aexit__(None, None, None)
        node.task = node.agent = None

    # -- the extender ----------------------------------------------------------------------------------------
    async def start_extender(self) -> str:
        self.view = ClusterView()
        self._extender_client = self.api.api_client()
        core = CoreV1Api(self._extender_client)
        watches = reflectors(core, self.view)
        self._extender_tasks = [asyncio.create_task(w.run(), name=w.name) for w in watches]
        for w in watches:
            assert w.synced is not None
            await asyncio.wait_for(w.synced.wait(), 10)
        self.view.warm()
        self.view.synced = True
        self._binder = Binder(self.view, self._extender_client)
        self._extender_server = TestServer(build_app(self.view, self._binder), host="127.0.0.1")
        # As alnair-scheduler's server: requests still in flight at a stop get SHUTDOWN_TIMEOUT_S, not aiohttp's 60 s.
        await self._extender_server.start_server(shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        return str(self._extender_server.make_url("")).rstrip("/")

    async def stop_extender(self) -> None:
        if self._binder is not None:  # as alnair-scheduler stops: waiting binds answered at once, not held 20 s
            self._binder.stop()
        for task in self._extender_tasks:
            task.cancel()
        await asyncio.gather(*self._extender_tasks, return_exceptions=True)
        if self._extender_server is not None:
            await http_stop.quiesce(self._extender_server.runner)
            await self._extender_server.close()
        if self._extender_client is not None:
            await self._extender_client.close()
        self._extender_tasks, self._extender_server, self._extender_client, self._binder = [], None, None, None

    async def restart_extender(self) -> None:
        assert self.scheduler is not None
        await self.stop_extender()
        self.scheduler.url = await self.start_extender()

    # -- queries ---------------------------------------------------------------------------------------------
    def admitted(self) -> dict[str, tuple[str, Admission]]:
        """uid -> (node, admission) over all nodes."""
        return {uid: (n.name, a) for n in self.nodes.values() for uid, a in n.driver.admitted.items()}

    def refused(self) -> dict[str, str]:
        return {uid: why for n in self.nodes.values() for uid, why in n.driver.refused.items()}

    async def settle(self, pods: int, timeout: float) -> None:
        """Until `pods` pods are admitted or refused (then a little longer for confirmations)."""
        deadline = time.monotonic() + timeout
        while len(self.admitted()) + len(self.refused()) < pods:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.admitted())} admitted + {len(self.refused())} refused of {pods} in "
                                   f"{timeout} s; bind errors: {self.scheduler.bind_errors[-3:] if self.scheduler else []}"
                                   f"; unschedulable: {self.scheduler.unschedulable[-3:] if self.scheduler else []}")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def cluster(root: Path, nodes: Mapping[str, str], seed: int, backoff_initial_s: float = 1.0,
                  admission_order: str = "fifo", **settings: Any) -> AsyncIterator[Cluster]:
    """`nodes`: name -> ALNAIR_SIM_GPUS spec. Everything started; everything stopped on exit."""
    from alnair_agent.config import parse_sim_gpus

    rng = random.Random(seed)
    async with FakeApiServer() as api:
        c = Cluster(api, root, rng)
        try:
            for name, gpus in nodes.items():
                base = root / name
                s = Settings(node_name=name, device_plugin_dir=base / "dp", pod_resources_socket=base / "pr" / "k.sock",
                             workspace=base / "ws", shim_dir=base / "lib", gpu_backend="simulated",
                             sim_gpus=parse_sim_gpus(gpus), kubernetes="auto", metrics_port=0,
                             resync_interval_s=0.2, health_interval_s=0.1, **settings)
                api.add_node(name)
                kubelet = KubeletEmulator(s.device_plugin_dir, s.pod_resources_socket)
                await kubelet.start()
                driver = KubeletDriver(api, kubelet, name, random.Random(rng.random()), order=admission_order)
                api.on_pod_change.append(driver.on_pod_change)
                c.nodes[name] = Node(name, s, kubelet, driver, api.api_client())
                c._tasks.append(asyncio.create_task(driver.run(), name=f"kubelet-{name}"))
                await c.start_agent(name)
            # The extender starts once every agent has reported its GPUs on its node.
            deadline = time.monotonic() + 10
            while not all("ai.centaurus.io/gpu-devices" in api.node_annotations(n) for n in nodes):
                if time.monotonic() > deadline:
                    raise TimeoutError("agents never reported their GPUs")
                await asyncio.sleep(0.02)
            url = await c.start_extender()
            c.scheduler = SchedulerEmulator(api, url, list(nodes), random.Random(rng.random()),
                                            backoff_initial_s=backoff_initial_s)
            api.on_pod_change.append(c.scheduler.on_pod_change)
            c._tasks.append(asyncio.create_task(c.scheduler.run(), name="kube-scheduler"))
            yield c
        finally:
            for task in c._tasks:
                task.cancel()
            await asyncio.gather(*c._tasks, return_exceptions=True)
            await c.stop_extender()
            for name in list(c.nodes):
                await c.stop_agent(name)
                await c.nodes[name].kubelet.stop()
                await c.nodes[name].client.close()
