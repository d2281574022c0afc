"""The annotation writer against the API server stand-in: merge patches, only on change, coalesced and
rate-limited, retried after failures, dropped for pods that are gone, and a flush the agent can wait on."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio.client import ApiClient
from service_util import running, wait_until
from structlog.testing import capture_logs

from alnair_agent.constants import NODE_GPU_DEVICES, USAGE_ANNOTATION
from alnair_agent.kube.annotations import AnnotationWriter, WriterTiming
from alnair_standins.apiserver import MERGE_PATCH, FakeApiServer, make_pod

pytestmark = pytest.mark.timeout(20)

NODE = "node-1"
FIG = USAGE_ANNOTATION
FAST = WriterTiming(min_interval_s=0.05, backoff_initial_s=0.01, backoff_max_s=0.05, request_timeout_s=2)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer() as server:
        server.add_node(NODE, {"kubernetes.io/keep": "yes"})
        server.add_pod(make_pod("p1"))
        server.add_pod(make_pod("p2"))
        yield server


@pytest.fixture
async def client(api: FakeApiServer) -> AsyncIterator[ApiClient]:
    async with api.api_client() as c:
        yield c


def figures(**values: object) -> str:
    return json.dumps(values, sort_keys=True)


async def test_writes_pod_and_node_annotations_as_merge_patches(api: FakeApiServer, client: ApiClient) -> None:
    writer = AnnotationWriter(client, NODE, FAST)
    async with running(writer.run()):
        writer.set_pod("default", "p1", {FIG: figures(memoryUsedBytes=1)})
        writer.set_node({NODE_GPU_DEVICES: "[]"})
        assert await writer.flush(5)
    assert api.pod_annotations("default", "p1") == {FIG: figures(memoryUsedBytes=1)}
    assert api.node_annotations(NODE) == {"kubernetes.io/keep": "yes", NODE_GPU_DEVICES: "[]"}  # others kept
    assert {p.content_type for p in api.patches} == {MERGE_PATCH}
    assert writer.written_pod("default", "p1") == {FIG: figures(memoryUsedBytes=1)}


async def test_none_removes_an_annotation(api: FakeApiServer, client: ApiClient) -> None:
    writer = AnnotationWriter(client, NODE, FAST)
    async with running(writer.run()):
        writer.set_node({"kubernetes.io/keep": None, NODE_GPU_DEVICES: "x"})
        assert await writer.flush(5)
    assert api.node_annotations(NODE) == {NODE_GPU_DEVICES: "x"}
    assert api.patches[-1].body == {"metadata": {"annotations": {"kubernetes.io/keep": None, NODE_GPU_DEVICES: "x"}}}


async def test_writes_only_what_changed(api: FakeApiServer, client: ApiClient) -> None:
    writer = AnnotationWriter(client, NODE, FAST)
    async with running(writer.run()):
        writer.set_pod("default", "p1", {"a": "1", "b": "1"})
        assert await writer.flush(5)
        writer.set_pod("default", "p1", {"a": "1", "b": "1"})  # same values: nothing to send
        assert await writer.flush(5)
        assert len(api.patches) == 1
        writer.set_pod("default", "p1", {"a": "1", "b": "2"})
        assert await writer.flush(5)
        assert api.patches[-1].body == {"metadata": {"annotations": {"b": "2"}}}  # only the changed key
        writer.set_pod("default", "p1", {"b": "3"})
        writer.set_pod("default", "p1", {"b": "2"})  # changed back before it was sent: nothing to send
        assert await writer.flush(5)
    assert len(api.patches) == 2
    assert api.pod_annotations("default", "p1") == {"a": "1", "b": "2"}


async def test_coalesces_changes_within_the_rate_limit(api: FakeApiServer, client: ApiClient) -> None:
    timing = WriterTiming(min_interval_s=0.3, backoff_initial_s=0.01)
    writer = AnnotationWriter(client, NODE, timing)
    async with running(writer.run()):
        writer.set_pod("default", "p1", {FIG: "1"})
        await wait_until(lambda: len(api.patches) == 1)
        for value in range(2, 12):  # a burst of figure updates within one interval
            writer.set_pod("default", "p1", {FIG: str(value)})
        writer.set_pod("default", "p2", {FIG: "x"})  # another object has its own limit: not held back
        await wait_until(lambda: len(api.patches) == 3)
        await wait_until(lambda: api.pod_annotations("default", "p1") == {FIG: "11"})
    p1 = [p for p in api.patches if p.name == "p1"]
    assert [p.body["metadata"]["annotations"][FIG] for p in p1] == ["1", "11"]
    assert p1[1].at - p1[0].at >= timing.min_interval_s * 0.9  # event-loop timers may fire a hair early
    assert [p.name for p in api.patches][:2] == ["p1", "p2"]


async def test_flush_does_not_wait_for_the_rate_limit(api: FakeApiServer, client: ApiClient) -> None:
    writer = AnnotationWriter(client, NODE, WriterTiming(min_interval_s=30))
    async with running(writer.run()):
        writer.set_pod("default", "p1", {FIG: "1"})
        assert await writer.flush(5)
        writer.set_pod("default", "p1", {FIG: "final"})
        assert await writer.flush(2)  # the ended container's last figures go out now, not in 30 s
    assert api.pod_annotations("default", "p1") == {FIG: "final"}


async def test_a_burst_of_pods_is_paced_over_all_objects_and_a_flush_skips_the_pace(api: FakeApiServer,
                                                                                    client: ApiClient) -> None:
    """A hundred new pods' first figures go out at `patches_per_s` after a `burst`, the node's report first; what a
    flush waits for (an unprepare's final figures) goes at once."""
    names = [f"q{i:02d}" for i in range(30)]
    for name in names:
        api.add_pod(make_pod(name))
    timing = WriterTiming(min_interval_s=0.05, patches_per_s=20.0, burst=5)
    writer = AnnotationWriter(client, NODE, timing)
    async with running(writer.run()):
        for name in names[:20]:
            writer.set_pod("default", name, {FIG: "1"})
        writer.set_node({NODE_GPU_DEVICES: "report"})
        await wait_until(lambda: len(api.patches) >= 5)
        assert "node" in [p.kind for p in api.patches[:5]]  # in the first burst (its patches race each other)
        cpu = time.process_time()
        await wait_until(lambda: len(api.patches) >= 20, timeout=5)
        assert time.process_time() - cpu < 0.4  # it sleeps until the next token (it once spun through the wait)
        spread = api.patches[19].at - api.patches[0].at
        assert spread >= 15 / timing.patches_per_s * 0.8  # 5 at once, then one per 50 ms
        for name in names[20:]:
            writer.set_pod("default", name, {FIG: "final"})
        before = len(api.patches)
        assert await writer.flush(0.5)  # 10 more at once, not in half a second of tokens
        assert len(api.patches) - before >= 10
    assert all(api.pod_annotations("default", n) == {FIG: "final"} for n in names[20:])


async def test_a_flush_of_one_pod_waits_for_that_pod_only(api: FakeApiServer, client: ApiClient) -> None:
    writer = AnnotationWriter(client, NODE, WriterTiming(min_interval_s=30, patches_per_s=0.1, burst=1))
    async with running(writer.run()):
        writer.set_pod("default", "p1", {FIG: "1"})
        await wait_until(lambda: len(api.patches) == 1)  # the one token: p1's next write waits ~10 s
        writer.set_pod("default", "p1", {FIG: "2"})
        writer.set_pod("default", "p2", {FIG: "final"})
        assert await writer.flush(2, pod=("default", "p2"))
        assert api.pod_annotations("default", "p2") == {FIG: "final"}
        assert api.pod_annotations("default", "p1") == {FIG: "1"}  # not sent with it: paced as before
        assert await writer.flush(2, pod=("default", "gone"))  # nothing set for it: nothing to wait for
        assert await writer.flush(2)  # and a flush of all sends the rest
    assert api.pod_annotations("default", "p1") == {FIG: "2"}


async def test_retries_after_server_errors_with_backoff(api: FakeApiServer, client: ApiClient) -> None:
    api.fail_next("patch_pod", status=500, times=2)
    api.fail_next("patch_node", status=503, times=1)
    writer = AnnotationWriter(client, NODE, FAST)
    with capture_logs() as logs:
        async with running(writer.run()):
            writer.set_pod("default", "p1", {FIG: "1"})
            writer.set_node({NODE_GPU_DEVICES: "inventory"})
            assert await writer.flush(5)
    assert api.pod_annotations("default", "p1") == {FIG: "1"}
    assert api.node_annotations(NODE)[NODE_GPU_DEVICES] == "inventory"
    failed = [e for e in logs if e["event"] == "annotation_patch_failed"]
    assert sorted((e["kind"], e["status"]) for e in failed) == [("node", 503), ("pod", 500), ("pod", 500)]
    pod_delays = [e["retry_in_s"] for e in failed if e["kind"] == "pod"]
    # doubling, each delay jittered to half..all of its backoff (nodes must not retry in lockstep)
    assert 0.005 <= pod_delays[0] <= 0.01 and 0.01 <= pod_delays[1] <= 0.02


async def test_changes_made_during_failures_are_not_lost(api: FakeApiServer, client: ApiClient) -> None:
    api.fail_next("patch_pod", status=500, times=3)
    writer = AnnotationWriter(client, NODE, FAST)
    async with running(writer.run()):
        writer.set_pod("default", "p1", {"a": "1"})
        await wait_until(lambda: len(api.patches) >= 1)
        writer.set_pod("default", "p1", {"b": "1"})
        assert await writer.flush(5)
    assert api.pod_annotations("default", "p1") == {"a": "1", "b": "1"}


async def test_flush_times_out_while_the_server_fails_then_completes(api: FakeApiServer, client: ApiClient) -> None:
    api.fail_next("patch_pod", status=500, times=1000)
    writer = AnnotationWriter(client, NODE, FAST)
    async with running(writer.run()):
        writer.set_pod("default", "p1", {FIG: "1"})
        assert not await writer.flush(0.2)
        assert writer.unwritten() == 1
        api.clear_failures()  # the server recovers
        assert await writer.flush(5)
    assert api.pod_annotations("default", "p1") == {FIG: "1"}


async def test_pod_gone_is_dropped_with_a_warning(api: FakeApiServer, client: ApiClient) -> None:
    writer = AnnotationWriter(client, NODE, FAST)
    with capture_logs() as logs:
        async with running(writer.run()):
            writer.set_pod("default", "deleted-pod", {FIG: "1"})
            writer.set_pod("default", "p1", {FIG: "1"})
            assert await writer.flush(5)
            assert writer.unwritten() == 0
    gone = [e for e in logs if e["event"] == "annotation_target_gone"]
    assert [(e["namespace"], e["name"], e["log_level"]) for e in gone] == [("default", "deleted-pod", "warning")]
    assert len([p for p in api.patches if p.name == "deleted-pod"]) == 1  # not retried
    assert api.pod_annotations("default", "p1") == {FIG: "1"}


async def test_refused_patch_does_not_hold_flush_and_is_retried_later(api: FakeApiServer, client: ApiClient) -> None:
    api.fail_next("patch_pod", status=422)
    writer = AnnotationWriter(client, NODE, FAST)
    with capture_logs() as logs:
        async with running(writer.run()):
            writer.set_pod("default", "p1", {FIG: "refused once"})
            assert await writer.flush(5)  # a refusal completes the flush: the agent's retire is not held
            await wait_until(lambda: api.pod_annotations("default", "p1").get(FIG) == "refused once", 5)
    assert [e["status"] for e in logs if e["event"] == "annotation_patch_rejected"] == [422]
    assert len(api.patches) == 2  # refused, then written after the backoff


async def test_connection_errors_are_retried() -> None:
    async with ApiClient() as client:
        client.configuration.host = "http://127.0.0.1:9"  # nothing listens
        writer = AnnotationWriter(client, NODE, FAST)
        with capture_logs() as logs:
            async with running(writer.run()):
                writer.set_node({NODE_GPU_DEVICES: "x"})
                assert not await writer.flush(0.2)
    failed = [e for e in logs if e["event"] == "annotation_patch_failed"]
    assert len(failed) >= 2 and all(e["error"].startswith("Client") for e in failed)
    assert max(e["retry_in_s"] for e in failed) <= FAST.backoff_max_s


async def test_forget_pod_drops_its_pending_values(api: FakeApiServer, client: ApiClient) -> None:
    writer = AnnotationWriter(client, NODE, FAST)
    writer.set_pod("default", "p1", {FIG: "1"})  # queued before the service runs
    writer.forget_pod("default", "p1")
    assert writer.unwritten() == 0
    assert await writer.flush(0.1)
    assert api.patches == []


async def test_without_kubernetes_everything_is_a_no_op() -> None:
    writer = AnnotationWriter(None, NODE)
    writer.set_pod("default", "p1", {FIG: "1"})
    writer.set_node({NODE_GPU_DEVICES: "x"})
    assert writer.unwritten() == 0
    assert await writer.flush(0)
    async with running(writer.run()) as task:
        await wait_until(lambda: True)
        assert not task.done()
