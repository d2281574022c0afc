"""The pod watch against the API server stand-in, through the real kubernetes-asyncio client: it lists, follows
adds/changes/deletes, survives dropped connections and 410 Gone, and tells the device plugin which pending
container kubelet is admitting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import pytest
from kubernetes_asyncio.client import ApiClient
from service_util import running, wait_until
from structlog.testing import capture_logs

from alnair_agent.constants import RESOURCE_MEMORY
from alnair_agent.kube.podwatch import PodWatch, WatchTiming
from alnair_standins.apiserver import FakeApiServer, make_pod

pytestmark = pytest.mark.timeout(20)

NODE = "node-1"
T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)
FAST = WatchTiming(backoff_initial_s=0.01, backoff_max_s=0.1, watch_timeout_s=30, min_healthy_s=0.5)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer() as server:
        yield server


@pytest.fixture
async def client(api: FakeApiServer) -> AsyncIterator[ApiClient]:
    async with api.api_client() as c:
        yield c


def names(watch: PodWatch) -> set[str]:
    return {p.name for p in watch.pods()}


# -- the watch -----------------------------------------------------------------------------------------------
async def test_lists_pods_bound_here_then_follows_add_modify_delete(api: FakeApiServer, client: ApiClient) -> None:
    api.add_pod(make_pod("here", containers=[{"name": "main", "memory": 2, "compute": 30}], scheduled_at=T0))
    api.add_pod(make_pod("elsewhere", node="node-2"))
    api.add_pod(make_pod("unbound", node=None))
    watch = PodWatch(client, NODE, FAST)
    async with running(watch.run()):
        assert await watch.wait_synced(5)
        assert names(watch) == {"here"}
        [pending] = watch.find("default", "here").containers
        assert (pending.pod_name, pending.memory_units, pending.compute_units) == ("here", 2, 30)

        since = watch.generation
        added = api.add_pod(make_pod("new", containers=[{"name": "main", "memory": 1}]))
        assert await watch.changed(since, 5)
        assert names(watch) == {"here", "new"}
        assert watch.get(added["metadata"]["uid"]).name == "new"
        assert watch.find("default", "new").uid == added["metadata"]["uid"]

        api.set_container_running("default", "here", "main")
        api.set_phase("default", "here", "Succeeded")
        await wait_until(lambda: watch.find("default", "here").phase == "Succeeded")
        assert [p.name for p in watch.pods() if p.live] == ["new"]  # finished pods ask for nothing

        api.delete_pod("default", "new")
        await wait_until(lambda: names(watch) == {"here"})
        assert watch.get(added["metadata"]["uid"]) is None
    assert api.list_calls == 1


async def test_binding_a_pod_to_this_node_adds_it(api: FakeApiServer, client: ApiClient) -> None:
    api.add_pod(make_pod("p", node=None, containers=[{"name": "main", "compute": 20}]))
    watch = PodWatch(client, NODE, FAST)
    async with running(watch.run()):
        assert await watch.wait_synced(5)
        assert watch.pods() == []
        api.bind_pod("default", "p", NODE)
        await wait_until(lambda: names(watch) == {"p"})


async def test_bound_order_is_the_order_pods_were_bound_here(api: FakeApiServer, client: ApiClient) -> None:
    """kubelet admits pods in the order it sees them bound; the watch records the same order."""
    api.add_pod(make_pod("listed-late", scheduled_at=T0 + timedelta(seconds=1)))
    api.add_pod(make_pod("listed-early", scheduled_at=T0))
    for name in ("b", "a", "c"):
        api.add_pod(make_pod(name, node=None))
    watch = PodWatch(client, NODE, FAST)
    async with running(watch.run()):
        assert await watch.wait_synced(5)
        for name in ("c", "a", "b"):
            api.bind_pod("default", name, NODE)
        await wait_until(lambda: len(watch.pods()) == 5)
        order = sorted(watch.pods(), key=lambda p: watch.bound_order(p.uid))
        assert [p.name for p in order] == ["listed-early", "listed-late", "c", "a", "b"]


async def test_pods_keep_container_order_and_ended_containers(api: FakeApiServer, client: ApiClient) -> None:
    api.add_pod(make_pod("second", scheduled_at=T0 + timedelta(seconds=1), restart_policy="Never",
                         containers=[{"name": "a", "memory": 1}, {"name": "b", "memory": 1}]))
    api.add_pod(make_pod("first", scheduled_at=T0, init_containers=[{"name": "init", "compute": 5}],
                         containers=[{"name": "main", "memory": 1}]))
    watch = PodWatch(client, NODE, FAST)
    async with running(watch.run()):
        assert await watch.wait_synced(5)
        first = watch.find("default", "first")
        assert [(c.container, c.kind) for c in first.containers] == [("init", "init"), ("main", "regular")]
        api.set_container_terminated("default", "second", "a", exit_code=0)
        await wait_until(lambda: watch.find("default", "second").container_ended("a"))
        assert not watch.find("default", "second").container_ended("b")


async def test_survives_a_dropped_watch_connection(api: FakeApiServer, client: ApiClient) -> None:
    api.add_pod(make_pod("a"))
    watch = PodWatch(client, NODE, FAST)
    with capture_logs() as logs:
        async with running(watch.run()):
            assert await watch.wait_synced(5)
            await wait_until(lambda: api.open_watches == 1)
            assert api.drop_watches() == 1
            api.add_pod(make_pod("b"))  # while disconnected: the resumed watch must deliver it
            await wait_until(lambda: names(watch) == {"a", "b"})
            await wait_until(lambda: api.open_watches == 1)
            api.end_watches()  # a clean end (the server's timeoutSeconds) just resumes
            api.delete_pod("default", "a")
            await wait_until(lambda: names(watch) == {"b"})
    assert api.list_calls == 1  # resumed from its resourceVersion, no re-list
    assert api.watch_connections >= 3
    assert any(e["event"] == "pod_watch_failed" for e in logs)


async def test_a_watch_connection_builds_no_client_of_its_own(api: FakeApiServer, client: ApiClient,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each connection reuses the agent's API client: kubernetes-asyncio's Watch built one per connection, loading
    the CA bundle into a new SSL context on the event loop (50 ms on a 2-core node, at every reconnect)."""
    import ssl

    made: list[object] = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: made.append(a) or real(*a, **k))
    api.add_pod(make_pod("a"))
    watch = PodWatch(client, NODE, FAST)
    async with running(watch.run()):
        assert await watch.wait_synced(5)
        for name in ("b", "c"):
            await wait_until(lambda: api.open_watches == 1)
            api.end_watches()
            api.add_pod(make_pod(name))
            await wait_until(lambda n=name: n in names(watch))
    assert api.watch_connections >= 3 and made == []


async def test_find_by_name_follows_a_pod_made_again_under_the_same_name(api: FakeApiServer,
                                                                          client: ApiClient) -> None:
    first = api.add_pod(make_pod("web-0"))
    watch = PodWatch(client, NODE, FAST)
    async with running(watch.run()):
        assert await watch.wait_synced(5)
        assert watch.find("default", "web-0").uid == first["metadata"]["uid"]
        api.delete_pod("default", "web-0")
        await wait_until(lambda: watch.find("default", "web-0") is None)
        second = api.add_pod(make_pod("web-0"))  # a StatefulSet's next pod: same name, new uid
        await wait_until(lambda: watch.find("default", "web-0") is not None)
        assert watch.find("default", "web-0").uid == second["metadata"]["uid"]
        assert watch.find("other", "web-0") is None


async def test_410_gone_on_an_open_watch_relists(api: FakeApiServer, client: ApiClient) -> None:
    api.add_pod(make_pod("a"))
    watch = PodWatch(client, NODE, FAST)
    with capture_logs() as logs:
        async with running(watch.run()):
            assert await watch.wait_synced(5)
            await wait_until(lambda: api.open_watches == 1)
            api.expire_watches()
            await wait_until(lambda: api.list_calls == 2)
            api.add_pod(make_pod("b"))
            await wait_until(lambda: names(watch) == {"a", "b"})
    assert [e["event"] for e in logs].count("pod_watch_expired") == 1


async def test_resuming_from_a_compacted_version_relists(api: FakeApiServer, client: ApiClient) -> None:
    api.add_pod(make_pod("a"))
    api.add_pod(make_pod("b"))
    watch = PodWatch(client, NODE, FAST)
    async with running(watch.run()):
        assert await watch.wait_synced(5)
        await wait_until(lambda: api.open_watches == 1)
        api.fail_next("watch", status=503)  # the reconnect fails once: the watch is away a while
        api.drop_watches()
        api.delete_pod("default", "a")  # happens while away ...
        api.add_pod(make_pod("c"))
        api.expire_watches()  # ... and falls out of history: only a re-list can see it
        await wait_until(lambda: names(watch) == {"b", "c"})
        assert api.list_calls == 2


async def test_list_failures_back_off_then_sync(api: FakeApiServer, client: ApiClient) -> None:
    api.add_pod(make_pod("a"))
    api.fail_next("list", status=500, times=3)
    watch = PodWatch(client, NODE, FAST)
    with capture_logs() as logs:
        async with running(watch.run()):
            assert await watch.wait_synced(5)
    failures = [e for e in logs if e["event"] == "pod_watch_failed"]
    assert [(e["status"], e["log_level"]) for e in failures] == [(500, "warning")] * 3
    delays = [e["retry_in_s"] for e in failures]
    assert delays == sorted(delays) and delays[-1] <= FAST.backoff_max_s  # doubling, capped
    assert names(watch) == {"a"}


async def test_backoff_is_capped(api: FakeApiServer, client: ApiClient) -> None:
    api.fail_next("list", status=503, times=6)
    watch = PodWatch(client, NODE, WatchTiming(backoff_initial_s=0.005, backoff_max_s=0.02))
    with capture_logs() as logs:
        async with running(watch.run()):
            assert await watch.wait_synced(5)
    delays = [e["retry_in_s"] for e in logs if e["event"] == "pod_watch_failed"]
    backoffs = [0.005, 0.01, 0.02, 0.02, 0.02, 0.02]  # doubling, capped; each delay jittered to half..all of it
    assert len(delays) == len(backoffs)
    assert all(b / 2 - 0.001 <= d <= b + 0.001 for d, b in zip(delays, backoffs, strict=True)), delays


async def test_wait_synced_times_out_without_an_api_server() -> None:
    cfg_client = ApiClient()
    cfg_client.configuration.host = "http://127.0.0.1:9"  # discard port: nothing listens
    async with cfg_client:
        watch = PodWatch(cfg_client, NODE, FAST)
        with capture_logs() as logs:
            async with running(watch.run()):
                assert not await watch.wait_synced(0.2)
        assert any(e["event"] == "pod_watch_failed" and e["error"].startswith("Client") for e in logs)


async def test_malformed_quantity_is_logged_once_not_on_every_event(api: FakeApiServer, client: ApiClient) -> None:
    api.add_pod(make_pod("bad", containers=[{"name": "main", "memory": "1.5"}, {"name": "ok", "memory": 1}]))
    watch = PodWatch(client, NODE, FAST)
    with capture_logs() as logs:
        async with running(watch.run()):
            assert await watch.wait_synced(5)
            api.set_container_running("default", "bad", "ok")
            api.set_phase("default", "bad", "Running")
            await wait_until(lambda: watch.find("default", "bad").phase == "Running")
    warnings = [e for e in logs if e["event"] == "pod_quantity_invalid"]
    assert [(w["pod"], w["container"], w["resource"], w["value"]) for w in warnings] == [
        ("bad", "main", RESOURCE_MEMORY, "1.5")]
    assert [c.container for c in watch.find("default", "bad").containers] == ["ok"]


async def test_without_kubernetes_there_are_no_pods() -> None:
    watch = PodWatch.disabled(NODE)
    assert not watch.enabled
    assert await watch.wait_synced(0)
    assert watch.pods() == []
    async with running(watch.run()) as task:
        await asyncio.sleep(0)
        assert not task.done()  # stays up until cancelled, like every service
