"""Least privilege: the agent's files, folders and sockets have the tightest modes that work; the DaemonSet runs
unprivileged with every capability dropped; its RBAC grants exactly the verbs the agent's code calls."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import yaml

from alnair_agent.constants import (
    ALLOCATION_FILE_NAME,
    CONTAINER_FOLDER_NAME,
    REGION_FILE_NAME,
    SOCKET_NAME,
)
from alnair_agent.constants import RESOURCE_COMPUTE as SM
from alnair_agent.constants import RESOURCE_MEMORY as MEM
from alnair_standins.kubelet import KubeletEmulator
from alnair_standins.node import node_settings, registered, running_agent

REPO = Path(__file__).resolve().parent.parent
# The API calls the agent makes (not the scheduler: its own manifest and test) -> (resource, verb).
CALL_VERBS = {
    "list_pod_for_all_namespaces": {("pods", "list"), ("pods", "watch")},  # LIST, then WATCH through the same call
    "list_namespaced_pod": {("pods", "list"), ("pods", "watch")},
    "read_namespaced_pod": {("pods", "get")},
    "patch_namespaced_pod": {("pods", "patch")},
    "read_node": {("nodes", "get")},
    "patch_node": {("nodes", "patch")},
    "list_node": {("nodes", "list"), ("nodes", "watch")},
    "create_namespaced_event": {("events", "create")},
    # the DRA front-end (resource.k8s.io/v1): its node's ResourceSlice, the claims kubelet names, the DeviceClass
    "read_resource_slice": {("resourceslices", "get")},
    "create_resource_slice": {("resourceslices", "create")},
    "replace_resource_slice": {("resourceslices", "update")},
    "delete_resource_slice": {("resourceslices", "delete")},
    "read_namespaced_resource_claim": {("resourceclaims", "get")},
    "read_device_class": {("deviceclasses", "get")},
}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


async def test_files_folders_and_sockets_have_the_tightest_modes(root):
    settings = node_settings(root)
    async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        async with running_agent(settings) as running:
            await registered(kubelet)
            await kubelet.admit("default", "p", "main", {MEM: 1, SM: 10})
            alloc_id = next(iter(running.agent.ledger.allocations))
            ws = settings.workspace
            assert mode(ws) == 0o700  # no host user but root reaches any region or record
            assert mode(ws / alloc_id) == 0o700
            assert mode(ws / alloc_id / ALLOCATION_FILE_NAME) == 0o600
            assert mode(ws / alloc_id / CONTAINER_FOLDER_NAME) == 0o755  # the container's user lists it
            assert mode(ws / alloc_id / CONTAINER_FOLDER_NAME / REGION_FILE_NAME) == 0o666  # any container uid
            for resource in (MEM, SM):
                sock = settings.device_plugin_dir / SOCKET_NAME[resource]
                assert stat.S_ISSOCK(sock.lstat().st_mode) and mode(sock) == 0o600  # only kubelet (root) dials


def _agent_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / "manifests" / "alnair-agent.yaml").read_text()) if d]


def test_daemonset_is_unprivileged_with_every_capability_dropped():
    ds = next(d for d in _agent_docs() if d["kind"] == "DaemonSet")
    agent = next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "agent")
    sc = agent["securityContext"]
    assert sc.get("privileged") is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}  # no capability added back
    assert sc["readOnlyRootFilesystem"] is True
    assert ds["spec"]["template"]["spec"]["hostPID"] is True  # the profiler's host PIDs (documented)


def test_agent_rbac_grants_exactly_the_verbs_its_code_calls():
    used: set[tuple[str, str]] = set()
    # The agent's API calls live in alnair_agent/kube/ (the scheduler's in alnair_agent/scheduler/).
    for path in sorted((REPO / "alnair_agent" / "kube").glob("*.py")):
        for call in re.findall(r"\b(?:core|api|v1)\.((?:list|read|patch|create|delete|replace)_\w+)",
                               path.read_text()):
            assert call in CALL_VERBS, f"{path.name} calls {call}: add it to CALL_VERBS and to the ClusterRole"
            used |= CALL_VERBS[call]
    role = next(d for d in _agent_docs() if d["kind"] == "ClusterRole")
    grants = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert grants == used, f"the ClusterRole grants {sorted(grants - used)} unused, lacks {sorted(used - grants)}"
    assert used  # the scan found the calls


async def test_folders_of_an_earlier_agent_get_the_tight_modes_at_start(root):
    settings = node_settings(root)
    async with KubeletEmulator(settings.device_plugin_dir, settings.pod_resources_socket) as kubelet:
        async with running_agent(settings) as running:
            await registered(kubelet)
            await kubelet.admit("default", "p", "main", {MEM: 1, SM: 10})
            alloc_id = next(iter(running.agent.ledger.allocations))
        folder = settings.workspace / alloc_id
        folder.chmod(0o755)  # what the agent before issue 10 made
        (folder / CONTAINER_FOLDER_NAME).chmod(0o777)
        (folder / ALLOCATION_FILE_NAME).chmod(0o644)
        async with running_agent(settings):
            assert mode(folder) == 0o700
            assert mode(folder / CONTAINER_FOLDER_NAME) == 0o755
            assert mode(folder / ALLOCATION_FILE_NAME) == 0o600
