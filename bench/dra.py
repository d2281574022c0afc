"""The DRA front-end: NodePrepareResources latency with 100 claims on the node (goal: p99 <= 10 ms), and 100 claims
onto 5 simulated nodes through the allocator stand-in with no double booking.

Part 1: three processes, as on a node: the real agent (8 simulated 80 GiB GPUs, ALNAIR_FRONTEND=dra) runs as its own
process (`python -m alnair_agent.main`, reaching the API server stand-in by KUBECONFIG), the API server stand-in
(resource.k8s.io/v1, which the agent reads through kubernetes-asyncio) runs in another (its work for the agent's own
writes must not delay kubelet's calls), and the DRA kubelet emulator runs here; they talk real gRPC over unix sockets
and HTTP. 100 claims of 4 GiB + 6 % are allocated by
the allocator stand-in (kube-scheduler's rules for consumable capacity) and prepared one after the other; each
NodePrepareResources is timed as kubelet sees it (the gRPC round trip: the agent's GET of the claim from the API
server, the folder, region and record, and the CDI spec). Then each is unprepared. Held and left slices are the
agent's records on disk.

The floor under kubelet's figure in this harness: the same gRPC call to a server that does nothing (its answer
fixed; uvloop and grpc.aio in a process of its own, as the agent; the client as the kubelet emulator's), paced as
the prepares are. Both ends are Python here; a real kubelet is Go. The agent's own part is its log's prepare less
its GET of the claim (the API server's answer).

Part 2: five such agents (4 GPUs of 40 GiB each) publish their slices to one API server; 100 claims of random size
(1-8 GiB, 5-30 %, seeded) are allocated by one scheduler stand-in trying the nodes in a random order, then prepared on
the node they landed on. Checked: no device's consumed capacity exceeds what it offers (the claims), every prepare is
accepted by its node's agent, and every agent's ledger holds exactly what the claims on its node consume.

    python bench/dra.py [--claims 100] [--nodes 5] [--seed 1] [--out bench/out/dra.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchstats import machine, pct, write_json

from alnair_agent import logs
from alnair_agent.config import parse_sim_gpus
from alnair_agent.constants import DRA_DEVICE_CLASS
from alnair_agent.dra.capacity import device_class_json
from alnair_agent.dra.quantity import parse_quantity
from alnair_standins.apiserver import FakeApiServer
from alnair_standins.apiserver_process import ApiServerProcess
from alnair_standins.dra_allocator import AllocationFailed, Allocator
from alnair_standins.dra_node import dra_node
from alnair_standins.node import remove_tree, short_tmp

GiB = 1 << 30


def stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": statistics.median(values), "p99_ms": pct(values, 0.99), "max_ms": max(values)}


def records(workspace: Path) -> int:
    """Allocation records on disk: what the agent process holds (its folders are its ledger across restarts)."""
    return sum(1 for f in workspace.glob("*/allocation.json")) if workspace.is_dir() else 0


async def prepare_latency(claims: int) -> dict[str, Any]:
    root = short_tmp()
    try:
        async with ApiServerProcess() as api:
            async with dra_node(root, api, process=True, sim_gpus=parse_sim_gpus("8x80GiB"),
                                resync_interval_s=1.0) as node:
                pods = []
                for n in range(claims):
                    node.claim(f"claim-{n:03d}", [{"name": "gpu", "memory": "4Gi", "compute": "6"}])
                    pod = node.pod(f"pod-{n:03d}", {"gpu": f"claim-{n:03d}"}, [("main", [("gpu", None)])])
                    node.schedule(pod, [f"claim-{n:03d}"])
                    pods.append(pod)
                admit = []
                for pod in pods:
                    t0 = time.perf_counter()
                    await node.start(pod)
                    admit.append((time.perf_counter() - t0) * 1e3)
                held = records(node.settings.workspace)
                for pod in pods:
                    await node.finish(pod)
                calls: dict[str, list[float]] = {}
                for rpc, seconds in node.kubelet.call_times:
                    calls.setdefault(rpc, []).append(seconds * 1e3)
                left = records(node.settings.workspace)
                assert node.process is not None
                inside = agent_times(node.process.output())
    finally:
        remove_tree(root)
    return {"claims": claims, "held_after_prepare": held, "left_after_unprepare": left,
            "calls": {**{k: stats(v) for k, v in calls.items()}, "prepare + start (kubelet)": stats(admit),
                      **{k: stats(v) for k, v in inside.items() if v}},
            "prepare_ms_in_order": calls.get("NodePrepareResources", [])}


FLOOR_CALLS, FLOOR_GAP_S = 300, 0.003  # the gap: kubelet's other work between two prepares in part 1 (~3 ms)


def floor_server(sock: str) -> None:
    """The do-nothing DRA server, run as `bench/dra.py --floor-server SOCK`."""
    import grpc
    import uvloop

    from alnair_agent.proto import dra_v1_pb2 as v1
    from alnair_agent.proto import dra_v1_pb2_grpc as v1_grpc

    class Fixed(v1_grpc.DRAPluginServicer):
        async def NodePrepareResources(self, request: Any, context: Any) -> Any:
            out = v1.NodePrepareResourcesResponse()
            for c in request.claims:
                out.claims[c.uid].devices.extend([v1.Device(request_names=["gpu"], pool_name="node", device_name="gpu-0",
                                                            cdi_device_ids=["centaurus.io/gpu=x"])])
            return out

    async def serve() -> None:
        server = grpc.aio.server()
        v1_grpc.add_DRAPluginServicer_to_server(Fixed(), server)
        server.add_insecure_port(f"unix://{sock}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


async def grpc_floor() -> dict[str, float]:
    """kubelet's figure for a prepare that costs nothing: the Python gRPC round trip of this harness."""
    import grpc

    from alnair_agent.proto import dra_v1_pb2 as v1
    from alnair_agent.proto import dra_v1_pb2_grpc as v1_grpc

    root = short_tmp()
    sock = root / "floor.sock"
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--floor-server", str(sock))
    try:
        for _ in range(200):
            if sock.exists():
                break
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            stub = v1_grpc.DRAPluginStub(channel)
            req = v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace="default", uid="u", name="claim")])
            times = []
            for n in range(FLOOR_CALLS + 20):
                t0 = time.perf_counter()
                await stub.NodePrepareResources(req, timeout=10)
                if n >= 20:  # the channel's first calls connect
                    times.append((time.perf_counter() - t0) * 1e3)
                await asyncio.sleep(FLOOR_GAP_S)
    finally:
        proc.terminate()
        await proc.wait()
        remove_tree(root)
    return stats(times)


def agent_times(log: str) -> dict[str, list[float]]:
    """The agent's own view of each prepare, from its `dra_claim_prepared` log lines: the whole ledger prepare, and
    its GET of the claim (the rest of kubelet's figure is gRPC and waiting for the agent's event loop)."""
    out: dict[str, list[float]] = {"agent: prepare (its log)": [], "agent: GET of the claim": [],
                                   "agent: prepare less the GET": []}
    for line in log.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("event") == "dra_claim_prepared" and "ms" in entry:
                out["agent: prepare (its log)"].append(float(entry["ms"]))
                out["agent: GET of the claim"].append(float(entry["read_ms"]))
                out["agent: prepare less the GET"].append(float(entry["ms"]) - float(entry["read_ms"]))
    return out


def consumed(claim: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    """(pool, device, memory bytes, compute) of each result of the claim."""
    out = []
    for r in (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
        c = r["consumedCapacity"]
        out.append((r["pool"], r["device"], int(parse_quantity(c["memory"])), int(parse_quantity(c["compute"]))))
    return out


async def five_nodes(claims: int, nodes: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    root = short_tmp()
    names = [f"node-{i + 1}" for i in range(nodes)]
    try:
        async with FakeApiServer() as api, contextlib.AsyncExitStack() as stack:
            cluster = {}
            for name in names:
                cluster[name] = await stack.enter_async_context(
                    dra_node(root / name, api, node_name=name, sim_gpus=parse_sim_gpus("4x40GiB"),
                             resync_interval_s=1.0))
            scheduler = Allocator({DRA_DEVICE_CLASS: device_class_json()})  # one kube-scheduler for the cluster
            placed: dict[str, int] = {n: 0 for n in names}
            pending = refused = 0
            t_alloc: list[float] = []
            for n in range(claims):
                memory, compute = rng.randint(1, 8), rng.choice([5, 10, 15, 20, 25, 30])
                order = rng.sample(names, len(names))  # ties between equally good nodes fall randomly
                claim = cluster[order[0]].claim(f"claim-{n:03d}", [{"name": "gpu", "memory": f"{memory}Gi",
                                                                     "compute": str(compute)}])
                t0 = time.perf_counter()
                for name in order:
                    try:
                        allocation = scheduler.allocate(claim, name, api.resource_slices())
                    except AllocationFailed:
                        continue
                    t_alloc.append((time.perf_counter() - t0) * 1e3)
                    node = cluster[name]
                    pod = node.pod(f"pod-{n:03d}", {"gpu": claim["metadata"]["name"]}, [("main", [("gpu", None)])])
                    api.set_claim_status("default", claim["metadata"]["name"], {
                        "allocation": allocation,
                        "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"],
                                         "uid": pod["metadata"]["uid"]}]})
                    try:
                        await node.start(pod)
                        placed[name] += 1
                    except Exception:  # noqa: BLE001 - counted: the goal is none
                        refused += 1
                    break
                else:
                    pending += 1
            # the books: the claims' consumed capacity per device, against what each device offers
            books: dict[tuple[str, str], list[int]] = {}
            for claim in api.claims():
                for pool, device, mem, comp in consumed(claim):
                    b = books.setdefault((pool, device), [0, 0])
                    b[0] += mem
                    b[1] += comp
            offered = {(s["spec"]["pool"]["name"], d["name"]): (int(parse_quantity(d["capacity"]["memory"]["value"])),
                                                                int(parse_quantity(d["capacity"]["compute"]["value"])))
                       for s in api.resource_slices() for d in s["spec"]["devices"]}
            over = sum(1 for key, (m, c) in books.items() if m > offered[key][0] or c > offered[key][1])
            ledger_mismatch = 0
            for name, node in cluster.items():
                agent = node.running.agent
                by_gpu = {f"gpu-{g.index}": g.uuid for g in agent.gpus}
                rooms = {r.uuid: r for r in agent.ledger.rooms()}
                for (pool, device), (mem, comp) in books.items():
                    if pool != name:
                        continue
                    room = rooms[by_gpu[device]]
                    used = (room.memory_total - room.memory_free, room.compute_total - room.compute_free)
                    ledger_mismatch += used != (mem // GiB, comp)
            utilisation = {
                "memory": sum(b[0] for b in books.values()) / sum(o[0] for o in offered.values()),
                "compute": sum(b[1] for b in books.values()) / sum(o[1] for o in offered.values()),
            }
    finally:
        remove_tree(root)
    return {"claims": claims, "nodes": nodes, "seed": seed, "placed_per_node": placed, "pending": pending,
            "prepare_refused": refused, "devices_over_capacity": over, "ledger_mismatches": ledger_mismatch,
            "booked": utilisation, "allocate_ms": stats(t_alloc)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench/out/dra.json")
    parser.add_argument("--floor-server", metavar="SOCK", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_server:
        floor_server(args.floor_server)
        return 0
    logs.configure("json", "error")
    m = machine()
    one = asyncio.run(prepare_latency(args.claims))
    one["calls"]["floor: a do-nothing gRPC server"] = asyncio.run(grpc_floor())
    many = asyncio.run(five_nodes(args.claims, args.nodes, args.seed))
    print(f"DRA front-end, {args.claims} claims of 4 GiB + 6 % on one node ({m['cpus']} CPUs, {m['cpu']}, "
          f"Python {m['python']})")
    print(f"{'call':34} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, r in one["calls"].items():
        print(f"{name:34} {r['n']:>5} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['max_ms']:>8.2f}")
    goal = one["calls"]["NodePrepareResources"]["p99_ms"] <= 10.0
    print(f"goal p99 NodePrepareResources <= 10 ms: {'met' if goal else 'MISSED'}; slices held after prepare "
          f"{one['held_after_prepare']}, left after unprepare {one['left_after_unprepare']}")
    print()
    print(f"{args.claims} claims (1-8 GiB, 5-30 %, seed {args.seed}) onto {args.nodes} nodes of 4 x 40 GiB through "
          "the allocator stand-in")
    print(f"{'node':10} {'claims':>7}")
    for name, n in many["placed_per_node"].items():
        print(f"{name:10} {n:>7}")
    print(f"pending (no room): {many['pending']}; prepares refused: {many['prepare_refused']}; devices over capacity: "
          f"{many['devices_over_capacity']}; agent ledgers differing from the claims: {many['ledger_mismatches']}")
    print(f"booked: memory {many['booked']['memory']:.0%}, compute {many['booked']['compute']:.0%}; allocate p50 "
          f"{many['allocate_ms']['p50_ms']:.2f} ms, p99 {many['allocate_ms']['p99_ms']:.2f} ms")
    ok = not (many["devices_over_capacity"] or many["prepare_refused"] or many["ledger_mismatches"])
    print(f"no double booking: {'held' if ok else 'BROKEN'}")
    write_json(args.out, {"prepare": one, "nodes": many})
    return 0 if goal and ok else 1


if __name__ == "__main__":
    sys.exit(main())
