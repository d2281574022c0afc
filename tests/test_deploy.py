"""What ships: every manifest and example validates against the Kubernetes schemas (kubernetes-validate, offline,
strict: an unknown field fails); the Dockerfile copies only paths that exist and installs the commands the
manifests run, in the image they name; the DaemonSet, the webhook and the examples say what the docs say."""

from __future__ import annotations

import configparser
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from alnair_agent.config import Settings
from alnair_agent.scheduler.main import parse_args
from alnair_agent.scheduler.webhook import (
    PROFILE_ANNOTATION,
    WEBHOOK_CONFIGURATION,
    build_webhook_app,
    profile_of,
)

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES_VERSION = "1.31"  # the kube-scheduler image the scheduler manifest runs
# resource.k8s.io/v1 (the DRA front-end) is GA from 1.34, its consumable capacity on by default from 1.36: DRA objects
# are checked against the 1.36 schemas, everything else against 1.31.
DRA_KUBERNETES_VERSION = "1.36"


def schema_version(obj: dict[str, Any]) -> str:
    return DRA_KUBERNETES_VERSION if str(obj.get("apiVersion", "")).startswith("resource.k8s.io/") \
        else KUBERNETES_VERSION
FILES = sorted([*ROOT.glob("manifests/*.yaml"), *ROOT.glob("examples/*.yaml")])


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for f in FILES for d in docs(f) if d["kind"] == kind]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in FILES:
        for d in docs(f):
            if d["kind"] == "Pod":
                out.append((d["metadata"]["name"], d["spec"]))
            elif "template" in d.get("spec", {}):
                out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
    return out


def setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manifest_validates_against_the_kubernetes_schemas(path: Path) -> None:
    objs = docs(path)
    assert objs
    for obj in objs:
        kubernetes_validate.validate(obj, schema_version(obj), strict=True)


def test_the_validator_does_catch_a_mistake() -> None:
    [ds] = [d for d in docs(ROOT / "manifests/alnair-agent.yaml") if d["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/livez"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)


# -- the image -------------------------------------------------------------------------------------------------------

def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_every_path_the_dockerfile_copies_exists_and_is_in_the_build_context() -> None:
    text = dockerfile()
    copies = re.findall(r"^COPY\s+(?!--from)(.+)$", text, flags=re.M)
    assert copies
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    allowed = [ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")]
    for line in copies:
        *sources, _dest = line.split()
        for src in sources:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
            assert src.rstrip("/") in allowed, f"{src} is left out of the build context by .dockerignore"
    # what setup.py needs to build: the protos, the shim's Makefile and sources
    assert (ROOT / "alnair_agent/proto").is_dir() and (ROOT / "shim/Makefile").is_file()


def test_dockerfile_stages_user_and_commands() -> None:
    text = dockerfile()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)$", text, flags=re.M)
    assert stages == ["build", "runtime"]
    assert "pip wheel" in text  # the project's own build (setup.py: protos and shim/Makefile)
    assert "COPY --from=build /wheels" in text
    users = re.findall(r"^USER\s+(\S+)$", text, flags=re.M)
    assert users and users[-1] not in ("0", "root")
    assert re.search(r"^CMD \[\"alnair-agent\"\]$", text, flags=re.M)


def test_manifests_run_the_image_and_commands_the_dockerfile_builds() -> None:
    cfg = setup_cfg()
    version = cfg["metadata"]["version"]
    scripts = {ln.split("=")[0].strip() for ln in cfg["options.entry_points"]["console_scripts"].splitlines() if ln}
    assert scripts == {"alnair-agent", "alnair-scheduler"}
    # the runtime stage installs this distribution (whose console scripts those are) from the build stage's wheels
    assert f"--find-links /tmp/wheels {cfg['metadata']['name']}" in dockerfile()
    images = set()
    for name, spec in pod_specs():
        for c in spec.get("initContainers", []) + spec["containers"]:
            if "alnair" in c["image"]:
                images.add(c["image"])
                assert c["command"][0] in scripts, f"{name}/{c['name']} runs {c['command'][0]}"
    assert images == {f"ghcr.io/centaurusinfra/alnair:{version}"}
    for d in by_kind("DaemonSet") + by_kind("Deployment"):
        assert d["metadata"]["labels"]["app.kubernetes.io/version"] == version


# -- the agent's DaemonSet -------------------------------------------------------------------------------------------

def agent() -> dict[str, Any]:
    [ds] = [d for d in by_kind("DaemonSet") if d["metadata"]["name"] == "alnair-agent"]
    return ds


def test_the_mps_daemon_serves_the_folders_the_agent_is_told_to_hand_out() -> None:
    """manifests/alnair-mps.yaml: its daemon's pipe folder and /dev/shm are the host folders that alnair-agent.yaml
    (commented out, off by default) and the README name for ALNAIR_MPS_PIPE_DIR and ALNAIR_MPS_SHM_DIR, those pass
    the agent's own settings, it runs on the agent's nodes, and the agent sees the folders where it checks them."""
    [mps] = [d for d in by_kind("DaemonSet") if d["metadata"]["name"] == "alnair-mps"]
    spec = mps["spec"]["template"]["spec"]
    [ctr] = spec["containers"]
    assert ctr["command"] == ["nvidia-cuda-mps-control", "-f"]
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")  # the toolkit then brings the MPS binaries
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    at = {m["mountPath"]: host.get(m["name"]) for m in ctr["volumeMounts"]}
    pipe, shm = at[env["CUDA_MPS_PIPE_DIRECTORY"]], at["/dev/shm"]
    agent_text = (ROOT / "manifests" / "alnair-agent.yaml").read_text()
    readme = (ROOT / "README.md").read_text()
    for line in (f"ALNAIR_MPS_PIPE_DIR, value: {pipe}", f"ALNAIR_MPS_SHM_DIR, value: {shm}"):
        assert line in agent_text, line
    assert f"ALNAIR_MPS_PIPE_DIR={pipe}" in readme and f"ALNAIR_MPS_SHM_DIR={shm}" in readme
    settings = Settings.from_env({"ALNAIR_NODE_NAME": "n", "ALNAIR_MPS_PIPE_DIR": pipe, "ALNAIR_MPS_SHM_DIR": shm})
    assert (str(settings.mps_pipe_dir), str(settings.mps_shm_dir)) == (pipe, shm)
    assert spec["affinity"] == agent()["spec"]["template"]["spec"]["affinity"]
    assert spec["runtimeClassName"] == agent()["spec"]["template"]["spec"]["runtimeClassName"]
    assert spec["hostPID"] is True  # a server in its own PID namespace does not start
    a_spec = agent()["spec"]["template"]["spec"]
    a_host = {v["name"]: v["hostPath"]["path"] for v in a_spec["volumes"] if "hostPath" in v}
    [main] = a_spec["containers"]
    seen = {m["mountPath"]: a_host[m["name"]] for m in main["volumeMounts"] if m["name"] in a_host}
    assert any(pipe.startswith(h + "/") and seen_at == h for seen_at, h in seen.items()), seen


def test_agent_daemonset_init_container_probes_env_and_resources() -> None:
    spec = agent()["spec"]["template"]["spec"]
    [init] = spec["initContainers"]
    assert init["command"] == ["alnair-agent", "install-shim", "/host-lib"]
    shim_volume = next(v for v in spec["volumes"] if v["name"] == "shim")
    assert {"name": "shim", "mountPath": "/host-lib"} in init["volumeMounts"]
    [main] = spec["containers"]
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    env = {e["name"]: e for e in main["env"]}
    defaults = Settings(node_name="n")
    assert mounts["shim"] == str(defaults.shim_dir) == shim_volume["hostPath"]["path"]
    assert mounts["workspace"] == str(defaults.workspace)
    assert env["ALNAIR_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    port = int(env["ALNAIR_METRICS_PORT"]["value"])
    assert port == defaults.metrics_port != 9400  # dcgm-exporter's port
    assert {p["name"]: p["containerPort"] for p in main["ports"]} == {"metrics": port}
    assert main["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    for c in (init, main):
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
    assert spec["runtimeClassName"] in {d["metadata"]["name"] for d in by_kind("RuntimeClass")}


def test_agent_runs_on_gpu_nodes_with_or_without_gpu_feature_discovery() -> None:
    spec = agent()["spec"]["template"]["spec"]
    assert "nodeSelector" not in spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]

    def matches(labels: dict[str, str]) -> bool:  # terms are ORed, expressions ANDed
        return any(all(labels.get(e["key"]) in e["values"] for e in t["matchExpressions"]) for t in terms)

    assert matches({"nvidia.com/gpu.present": "true"})  # GPU feature discovery
    assert matches({"alnair.centaurus.io/gpu": "true"})  # by hand: kubectl label node ... alnair.centaurus.io/gpu=true
    assert not matches({"kubernetes.io/os": "linux"})


def test_everything_carries_the_recommended_labels() -> None:
    for f in (ROOT / "manifests").glob("*.yaml"):
        for d in docs(f):
            assert d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "alnair", (f.name, d["kind"])
    for d in by_kind("DaemonSet") + by_kind("Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert set(d["spec"]["selector"]["matchLabels"].items()) <= set(labels.items())
        assert {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"} <= set(labels)


# -- the webhook -----------------------------------------------------------------------------------------------------

def test_webhook_configuration_reaches_the_webhook_the_scheduler_serves() -> None:
    [config] = by_kind("MutatingWebhookConfiguration")
    assert config["metadata"]["name"] == WEBHOOK_CONFIGURATION
    [hook] = config["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]} in \
        hook["namespaceSelector"]["matchExpressions"]
    ref = hook["clientConfig"]["service"]
    routes = {r.resource.canonical for r in build_webhook_app("alnair-cost-saving").router.routes()
              if r.method == "POST"}
    assert ref["path"] in routes
    [service] = [s for s in by_kind("Service") if s["metadata"]["name"] == ref["name"]]
    assert service["metadata"]["namespace"] == ref["namespace"]
    [sport] = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]]
    [deployment] = by_kind("Deployment")
    assert set(service["spec"]["selector"].items()) <= set(deployment["spec"]["template"]["metadata"]["labels"].items())
    pod = deployment["spec"]["template"]["spec"]
    extender = next(c for c in pod["containers"] if c["name"] == "extender")
    args = parse_args(extender["command"][1:], {})
    assert {p["name"]: p["containerPort"] for p in extender["ports"]}[sport["targetPort"]] == args.webhook_port
    assert args.webhook_dns == f"{ref['name']}.{ref['namespace']}.svc"
    tls = next(m for m in extender["volumeMounts"] if m["mountPath"] == args.tls_dir)
    assert next(v for v in pod["volumes"] if v["name"] == tls["name"])["secret"]["optional"] is True


# -- the examples ----------------------------------------------------------------------------------------------------

def limits(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c["resources"]["limits"] for c in spec["containers"]]


def test_examples_two_pods_share_a_gpu_at_30_and_70_with_8_gib_each() -> None:
    pods = docs(ROOT / "examples/shared-gpu.yaml")
    assert [limits(p["spec"]) for p in pods] == [[{"alnair/vgpu-memory": 8, "alnair/vgpu-compute": 30}],
                                                 [{"alnair/vgpu-memory": 8, "alnair/vgpu-compute": 70}]]
    assert {profile_of(p["metadata"]["annotations"][PROFILE_ANNOTATION]) for p in pods} == {"alnair-cost-saving"}


def test_examples_a_job_on_each_profile() -> None:
    jobs = by_kind("Job")
    assert sorted(j["spec"]["template"]["spec"]["schedulerName"] for j in jobs) == [
        "alnair-cost-saving", "alnair-high-performance"]


def test_agent_probe_paths_are_served() -> None:
    """The DaemonSet probes /livez and /readyz; the agent's HTTP endpoint (alnair_agent/metrics.py) gets them from
    issue 10. Until then this test skips, and the liveness probe would fail on /livez: do not deploy before."""
    source = (ROOT / "alnair_agent/metrics.py").read_text()
    spec = agent()["spec"]["template"]["spec"]["containers"][0]
    paths = {spec["livenessProbe"]["httpGet"]["path"], spec["readinessProbe"]["httpGet"]["path"]}
    missing = [p for p in sorted(paths) if f'"{p}"' not in source]
    if missing:
        pytest.skip(f"alnair_agent/metrics.py does not serve {', '.join(missing)} yet (issue 10)")
    assert not missing


def test_tox_has_test_lint_and_shim_environments() -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert [e.strip() for e in tox["tox"]["envlist"].split(",")] == ["py3", "lint", "shim"]
    assert "python -m pytest -q" in tox["testenv"]["commands"] and tox["testenv"]["extras"] == "test"
    assert "ruff check" in tox["testenv:lint"]["commands"]
    shim = tox["testenv:shim"]["commands"]
    assert "make -C shim" in shim and "tests/shim" in shim
    for path in ("shim/Makefile", "tests/shim", "alnair_agent", "tests", "bench"):
        assert (ROOT / path).exists()


# -- the DRA front-end -----------------------------------------------------------------------------------------------

def test_the_daemonset_mounts_the_dra_folders_where_the_agent_looks() -> None:
    from alnair_agent.config import Settings

    spec = agent()["spec"]["template"]["spec"]
    [main] = spec["containers"]
    mounts = {m["mountPath"] for m in main["volumeMounts"]}
    hosts = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    defaults = Settings(node_name="n")
    for path in (defaults.plugins_registry_dir, defaults.dra_plugin_dir, defaults.cdi_dir):
        assert str(path) in mounts and str(path) in hosts


def test_the_dra_example_asks_4_gib_and_30_percent_of_the_alnair_device_class() -> None:
    from alnair_agent.constants import (
        DRA_CAP_COMPUTE,
        DRA_CAP_MEMORY,
        DRA_DEVICE_CLASS,
        DRA_DRIVER,
    )
    from alnair_agent.dra.capacity import device_class_json
    from alnair_agent.dra.quantity import parse_quantity

    [cls] = by_kind("DeviceClass")
    assert cls == device_class_json()  # the agent's own definition (the demo creates it from there)
    assert cls["metadata"]["name"] == DRA_DEVICE_CLASS
    assert cls["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{DRA_DRIVER}"'}}]
    [template] = by_kind("ResourceClaimTemplate")
    [request] = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == DRA_DEVICE_CLASS
    wanted = request["exactly"]["capacity"]["requests"]
    assert parse_quantity(wanted[DRA_CAP_MEMORY]) == 4 << 30 and parse_quantity(wanted[DRA_CAP_COMPUTE]) == 30
    [pod] = [d for d in docs(ROOT / "examples/dra-claim.yaml") if d["kind"] == "Pod"]
    [entry] = pod["spec"]["resourceClaims"]
    assert entry["resourceClaimTemplateName"] == template["metadata"]["name"]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": entry["name"]}]
    assert "schedulerName" not in pod["spec"]  # kube-scheduler allocates claims itself
