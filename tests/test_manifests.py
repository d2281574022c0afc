"""The manifests agree with the code: the scheduler configuration calls verbs the extender serves, on the ports
and address it listens on, with the settings the design needs (node-cache-capable, bind by the extender, a timeout
longer than a bind may wait), and its probes reach the health port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from alnair_agent.scheduler.bind import BIND_WAIT_S
from alnair_agent.scheduler.main import parse_args
from alnair_agent.scheduler.server import build_app
from alnair_agent.scheduler.view import ClusterView

ROOT = Path(__file__).resolve().parent.parent


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "manifests" / name).read_text()) if d]


def test_scheduler_config_calls_what_the_extender_serves() -> None:
    objs = docs("alnair-scheduler.yaml")
    config_map = next(d for d in objs if d["kind"] == "ConfigMap")
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    extender, dra = config["extenders"]
    assert dra["prioritizeVerb"] == "prioritize-dra" and set(dra) >= {"urlPrefix", "weight"}
    assert not {"filterVerb", "bindVerb", "managedResources"} & set(dra)  # prioritize only, for every pod
    assert dra["urlPrefix"] == extender["urlPrefix"]
    assert extender["nodeCacheCapable"] is True
    assert float(extender["httpTimeout"].rstrip("s")) > BIND_WAIT_S
    routes = {r.resource.canonical for r in build_app(ClusterView()).router.routes() if r.method == "POST"}
    for verb in ("filterVerb", "prioritizeVerb", "bindVerb"):
        assert "/" + extender[verb] in routes
    assert "/" + dra["prioritizeVerb"] in routes
    assert {p["schedulerName"] for p in config["profiles"]} == {"alnair-cost-saving", "alnair-high-performance"}

    deployment = next(d for d in objs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "extender")
    args = parse_args(container["command"][1:], {})
    assert extender["urlPrefix"] == f"http://{args.host}:{args.port}"
    health = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    assert health == args.health_port
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path and get["port"] == "health" and "host" not in get


def test_extender_rbac_grants_what_it_uses() -> None:
    role = next(d for d in docs("alnair-scheduler.yaml") if d["kind"] == "ClusterRole")
    grants = {(r, v) for rule in role["rules"] if not rule.get("resourceNames")
              for r in rule["resources"] for v in rule["verbs"]}
    assert grants == {("nodes", "list"), ("nodes", "watch"), ("pods", "get"), ("pods", "list"), ("pods", "watch"),
                      ("pods", "patch"), ("pods/binding", "create"), ("resourceslices", "list"),
                      ("resourceslices", "watch"), ("resourceclaims", "list"), ("resourceclaims", "watch")}
    # the webhook's caBundle: its own configuration only
    [named] = [rule for rule in role["rules"] if rule.get("resourceNames")]
    assert named == {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
                     "resourceNames": ["alnair-scheduler"], "verbs": ["get", "patch"]}
