"""A pod's Alnair requests, as the agent reads them from the pod's JSON: good and bad quantities, init
containers, scheduling time, and when a container has ended for good."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from alnair_agent.constants import RESOURCE_COMPUTE, RESOURCE_MEMORY
from alnair_agent.kube.pods import (
    EPOCH,
    InvalidQuantity,
    PodError,
    container_ended,
    log_invalid,
    parse_pod,
    parse_quantity,
    pod_gone,
)
from alnair_standins.apiserver import make_pod

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("value, units", [("0", 0), ("1", 1), ("16", 16), ("100", 100), ("007", 7), (3, 3)])
def test_good_quantities(value: Any, units: int) -> None:
    assert parse_quantity(value) == units


@pytest.mark.parametrize("value", ["1.5", "-2", "abc", "2Gi", "1k", "1e3", "", " 1", "1\n", "+1", "0x10",
                                   "\u0661", True, -1, None, 1.0, "1" * 13])
def test_bad_quantities(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_quantity(value)


@given(st.integers(0, 10**12 - 1))
def test_every_plain_non_negative_integer_parses(n: int) -> None:
    assert parse_quantity(str(n)) == n


@given(st.text(min_size=1, max_size=8).filter(lambda t: not t.isascii() or not t.isdigit()))
def test_anything_but_digits_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_requests_come_from_limits_with_requests_as_fallback() -> None:
    pod = make_pod("p", containers=[{"name": "a", "memory": 4, "compute": 50}])
    pod["spec"]["containers"][0]["resources"]["requests"] = {RESOURCE_MEMORY: "1"}  # limits win
    info = parse_pod(pod)
    assert [(c.container, c.memory_units, c.compute_units) for c in info.containers] == [("a", 4, 50)]

    only_requests = parse_pod(make_pod("q", containers=[{"name": "b", "memory": 2}], requests_only=True))
    assert [(c.container, c.memory_units, c.compute_units) for c in only_requests.containers] == [("b", 2, 0)]


def test_identity_node_phase_and_container_order() -> None:
    pod = make_pod(
        "train", namespace="ml", node="gpu-1", scheduled_at=T0, phase="Running",
        init_containers=[{"name": "warmup", "compute": 10}],
        containers=[{"name": "cpu-only"}, {"name": "worker", "memory": 8, "compute": 100},
                    {"name": "helper", "memory": 1}],
    )
    info = parse_pod(pod)
    assert (info.uid, info.namespace, info.name, info.node_name, info.phase) == (
        pod["metadata"]["uid"], "ml", "train", "gpu-1", "Running")
    # Init containers first (kubelet admits them first); containers without Alnair resources are left out.
    assert [(c.container, c.init, c.index) for c in info.containers] == [
        ("warmup", True, 0), ("worker", False, 2), ("helper", False, 3)]
    assert all(c.pod_uid == info.uid and c.scheduled_at == T0 for c in info.containers)
    assert info.request("worker") is not None and info.request("worker").units(RESOURCE_COMPUTE) == 100
    assert info.request("cpu-only") is None
    assert info.invalid == ()


@pytest.mark.parametrize("value", ["1.5", "-2", "abc", "2Gi"])
def test_malformed_quantity_leaves_that_container_out_and_is_logged_once(value: str) -> None:
    pod = make_pod("bad", namespace="team", containers=[{"name": "ok", "memory": 1},
                                                        {"name": "broken", "memory": 2, "compute": value}])
    info = parse_pod(pod)
    assert [c.container for c in info.containers] == ["ok"]
    assert info.invalid == (InvalidQuantity("broken", RESOURCE_COMPUTE, value),)
    with capture_logs() as logs:
        log_invalid(info)
    assert logs == [{"event": "pod_quantity_invalid", "log_level": "warning", "namespace": "team", "pod": "bad",
                     "container": "broken", "resource": RESOURCE_COMPUTE, "value": value}]


def test_scheduled_at_prefers_pod_scheduled_condition_then_creation_time() -> None:
    pod = make_pod("p", scheduled_at=T0)
    pod["metadata"]["creationTimestamp"] = "2026-11-29T11:00:00Z"
    assert parse_pod(pod).scheduled_at == T0
    pod["status"]["conditions"] = []
    assert parse_pod(pod).scheduled_at == datetime(2026, 11, 29, 11, 0, tzinfo=timezone.utc)
    del pod["metadata"]["creationTimestamp"]
    assert parse_pod(pod).scheduled_at == EPOCH


def test_pod_without_identity_is_an_error() -> None:
    pod = make_pod("p")
    del pod["metadata"]["uid"]
    with pytest.raises(PodError):
        parse_pod(pod)
    with pytest.raises(PodError):
        parse_pod({})


def test_unbound_pod_has_no_node() -> None:
    assert parse_pod(make_pod("p", node=None)).node_name == ""


def _terminated(pod: dict[str, Any], container: str, exit_code: int, init: bool = False) -> dict[str, Any]:
    key = "initContainerStatuses" if init else "containerStatuses"
    pod["status"].setdefault(key, []).append(
        {"name": container, "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": exit_code, "reason": "Completed"}}})
    return pod


@pytest.mark.parametrize("policy, exit_code, ended", [
    ("Never", 0, True), ("Never", 1, True),
    ("OnFailure", 0, True), ("OnFailure", 1, False),  # kubelet restarts it with the same devices
    ("Always", 0, False), ("Always", 1, False),
])
def test_terminated_container_has_ended_unless_kubelet_restarts_it(policy: str, exit_code: int, ended: bool) -> None:
    info = parse_pod(_terminated(make_pod("p", restart_policy=policy), "main", exit_code))
    assert container_ended(info, "main") is ended
    assert not pod_gone(info)


def test_init_containers_end_when_done_but_sidecars_do_not() -> None:
    pod = make_pod("p", init_containers=[{"name": "setup", "memory": 1},
                                         {"name": "sidecar", "memory": 1, "restartPolicy": "Always"}])
    _terminated(pod, "setup", 0, init=True)
    _terminated(pod, "sidecar", 0, init=True)
    info = parse_pod(pod)
    assert container_ended(info, "setup")
    assert not container_ended(info, "sidecar")
    assert not container_ended(info, "main")


def test_terminated_container_of_a_pod_being_deleted_has_ended() -> None:
    pod = _terminated(make_pod("p", restart_policy="Always"), "main", 137)
    pod["metadata"]["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    info = parse_pod(pod)
    assert info.deleting and container_ended(info, "main")


@pytest.mark.parametrize("phase, gone", [("Pending", False), ("Running", False), ("Succeeded", True),
                                         ("Failed", True), ("Unknown", False)])
def test_terminal_phase_ends_every_container(phase: str, gone: bool) -> None:
    info = parse_pod(make_pod("p", phase=phase))
    assert pod_gone(info) is gone
    assert container_ended(info, "main") is gone


def test_a_pod_missing_from_the_api_is_gone() -> None:
    assert pod_gone(None)
    assert container_ended(None, "main")
