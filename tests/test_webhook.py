"""The admission webhook as the API server meets it: AdmissionReview admission.k8s.io/v1 in, a JSONPatch that
routes pods asking for alnair/* to a profile (the annotation's, else the default) out; pods that set the agent's
variables refused; served over HTTPS with a self-signed certificate whose PEM is the caBundle."""

from __future__ import annotations

import base64
import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from alnair_agent.scheduler.main import parse_args, webhook_services
from alnair_agent.scheduler.webhook import (
    PROFILE_ANNOTATION,
    publish_ca_bundle,
    review,
    tls_context,
)

pytestmark = pytest.mark.timeout(30)
DEFAULT = "alnair-cost-saving"


def pod(resources: dict[str, Any] | None = None, annotations: dict[str, str] | None = None,
        scheduler: str | None = None, env: list[dict[str, str]] | None = None, init: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime"}
    if resources is not None:
        container["resources"] = {"limits": resources}
    if env is not None:
        container["env"] = env
    spec: dict[str, Any] = {"containers": [{"name": "sidecar", "image": "busybox"}]}
    if init:
        spec["initContainers"] = [container]
    else:
        spec["containers"].append(container)
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "trainer-", "namespace": "team-a", "annotations": annotations or {}},
            "spec": spec}


def admission(obj: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                        "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": "team-a", "operation": operation, "object": obj,
                        "userInfo": {"username": "alice"}, "dryRun": False}}


def patch_of(answer: dict[str, Any]) -> list[dict[str, Any]] | None:
    r = answer["response"]
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert r["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002" and r["allowed"] is True
    if "patch" not in r:
        return None
    assert r["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(r["patch"]))


GPU = {"alnair/vgpu-memory": "8", "alnair/vgpu-compute": "30"}


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"resources": GPU}, [{"op": "add", "path": "/spec/schedulerName", "value": DEFAULT}]),
    ({"resources": GPU, "scheduler": "default-scheduler"},
     [{"op": "replace", "path": "/spec/schedulerName", "value": DEFAULT}]),
    ({"resources": {"alnair/vgpu-compute": 10}, "init": True},
     [{"op": "add", "path": "/spec/schedulerName", "value": DEFAULT}]),
    ({"resources": GPU, "annotations": {PROFILE_ANNOTATION: "high-performance"}},
     [{"op": "add", "path": "/spec/schedulerName", "value": "alnair-high-performance"}]),
    ({"resources": GPU, "annotations": {PROFILE_ANNOTATION: "alnair-high-performance"}, "scheduler": DEFAULT},
     [{"op": "replace", "path": "/spec/schedulerName", "value": "alnair-high-performance"}]),
    ({"resources": GPU, "scheduler": "alnair-high-performance"}, None),  # already routed: untouched
    ({"resources": {"nvidia.com/gpu": 1}}, None),  # no alnair/*: untouched
    ({}, None),
])
def test_patch_routes_pods_asking_for_alnair_and_only_them(kwargs: dict[str, Any], expected: Any) -> None:
    assert patch_of(review(admission(pod(**kwargs)), DEFAULT)) == expected


def test_the_default_profile_is_configurable() -> None:
    assert patch_of(review(admission(pod(GPU)), "alnair-high-performance"))[0]["value"] == "alnair-high-performance"


@pytest.mark.parametrize("name", ["NVIDIA_VISIBLE_DEVICES", "LD_PRELOAD", "ALNAIR_MEMORY_LIMIT", "ALNAIR_REGION"])
@pytest.mark.parametrize("resources", [GPU, None])
def test_pods_setting_the_agents_variables_are_refused(name: str, resources: Any) -> None:
    r = review(admission(pod(resources, env=[{"name": "HOME", "value": "/x"}, {"name": name, "value": "all"}])),
               DEFAULT)["response"]
    assert r["allowed"] is False and r["status"]["code"] == 403
    assert f"main/{name}" in r["status"]["message"] and "may not set" in r["status"]["message"]


def test_an_unknown_profile_is_refused_with_the_allowed_ones() -> None:
    r = review(admission(pod(GPU, annotations={PROFILE_ANNOTATION: "fastest"})), DEFAULT)["response"]
    assert r["allowed"] is False and "cost-saving, high-performance" in r["status"]["message"]


def test_other_operations_and_garbage() -> None:
    assert patch_of(review(admission(pod(GPU), "UPDATE"), DEFAULT)) is None
    for body in (None, [], {"request": {}}, {"request": {"uid": ""}}):
        r = review(body, DEFAULT)["response"]
        assert r["allowed"] is False and "AdmissionReview" in r["status"]["message"]


async def test_https_mutate_with_a_self_signed_certificate(unused_tcp_port: int, tmp_path: Path) -> None:
    import asyncio

    args = parse_args([f"--webhook-port={unused_tcp_port}", "--kubernetes=off",
                       "--default-profile=alnair-high-performance", "--webhook-dns=localhost"], {})
    services, pem = webhook_services(args, None)  # no API server: nothing to publish the caBundle to
    [(name, server)] = services
    task = asyncio.create_task(server)
    try:
        # the API server verifies with caBundle: the self-signed certificate itself
        ctx = ssl.create_default_context(cadata=pem.decode())
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.post(f"https://localhost:{unused_tcp_port}/mutate", json=admission(pod(GPU)),
                                            ssl=ctx) as resp:
                        answer = await resp.json()
                        break
                except aiohttp.ClientConnectorError:
                    await asyncio.sleep(0.05)
        assert patch_of(answer)[0]["value"] == "alnair-high-performance"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_ca_bundle_is_published_on_every_webhook(tmp_path: Path, unused_tcp_port: int) -> None:
    from kubernetes_asyncio.client import ApiClient, Configuration

    _, pem = tls_context(None, None, ["alnair-webhook.kube-system.svc"])
    seen: list[Any] = []
    config = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
              "metadata": {"name": "alnair-scheduler"},
              "webhooks": [{"name": "route.alnair.centaurus.io", "clientConfig": {"service": {}}}]}

    async def get(request: web.Request) -> web.Response:
        return web.json_response(config)

    async def patch(request: web.Request) -> web.Response:
        seen.append((request.content_type, await request.json()))
        return web.json_response(config)

    app = web.Application()
    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/alnair-scheduler"
    app.router.add_get(path, get)
    app.router.add_patch(path, patch)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    try:
        cfg = Configuration(host=f"http://127.0.0.1:{unused_tcp_port}")
        async with ApiClient(cfg) as api:
            assert await publish_ca_bundle(api, pem) == 1
    finally:
        await runner.cleanup()
    [(ctype, body)] = seen
    assert ctype == "application/json-patch+json"
    assert body == [{"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": base64.b64encode(pem).decode()}]


@pytest.mark.parametrize(("prefix", "refused"), [("ALNAIR_", True), ("ALNAIR_X_", True), ("LD_", True),
                                                 ("NVIDIA_", True), ("A", True), ("APP_", False), ("", False)])
def test_env_from_with_a_prefix_that_makes_the_agents_variables_is_refused(prefix: str, refused: bool) -> None:
    p = pod(GPU)
    p["spec"]["containers"][1]["envFrom"] = [{"prefix": prefix, "configMapRef": {"name": "settings"}}]
    assert review(admission(p), DEFAULT)["response"]["allowed"] is not refused


# -- fuzzed input: the API server's call always gets a well-formed answer ------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=12)
_names = st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "LD_PRELOAD", "ALNAIR_MEMORY_LIMIT", "PATH", "", "nvidia_x"])
_env = st.lists(st.fixed_dictionaries({"name": _names | st.text(max_size=6), "value": st.text(max_size=4)}) | _json,
                max_size=3)
_container = st.fixed_dictionaries({"name": st.text(max_size=6)}, optional={
    "env": _env | _json, "envFrom": st.lists(st.fixed_dictionaries({"prefix": _names | st.text(max_size=4)}) | _json,
                                             max_size=2) | _json,
    "resources": st.fixed_dictionaries({"limits": st.dictionaries(
        st.sampled_from(["alnair/vgpu-memory", "alnair/vgpu-compute", "cpu"]), _json | st.text(max_size=4),
        max_size=2)}) | _json})
_pod = st.fixed_dictionaries({}, optional={
    "metadata": st.fixed_dictionaries({}, optional={"annotations": st.dictionaries(
        st.sampled_from([PROFILE_ANNOTATION, "x"]), st.text(max_size=12) | _json, max_size=2) | _json,
        "name": _json}) | _json,
    "spec": st.fixed_dictionaries({}, optional={"containers": st.lists(_container | _json, max_size=3) | _json,
                                                "initContainers": st.lists(_container, max_size=2) | _json,
                                                "schedulerName": _json}) | _json})
_request = st.fixed_dictionaries({}, optional={
    "uid": st.text(max_size=6) | _json, "kind": st.just({"kind": "Pod"}) | _json,
    "operation": st.sampled_from(["CREATE", "UPDATE"]) | _json, "namespace": _json, "object": _pod | _json})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.fixed_dictionaries({"request": _request}), _json))
def test_fuzzed_admission_reviews_always_get_a_well_formed_answer(body: Any) -> None:
    answer = review(body, DEFAULT)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    r = answer["response"]
    assert isinstance(r["allowed"], bool) and isinstance(r["uid"], str)
    assert "internal error" not in json.dumps(r)  # no input reaches the bug path
    if r["allowed"] and "patch" in r:
        [op] = json.loads(base64.b64decode(r["patch"]))
        assert op["path"] == "/spec/schedulerName" and op["value"].startswith("alnair-")
