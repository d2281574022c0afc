"""The agent's configuration: every ALNAIR_* environment variable, declared once and parsed at start.

`VARIABLES` is the one table (name, type, default, meaning); `Settings` is built from it; the README's variable
table is generated from it (`python -m alnair_agent.config --markdown`) and a test checks the two agree.
A bad value raises `ConfigError` with one line naming the variable, the value and what is allowed.
`BUILD_VARIABLES` are the package build's own ALNAIR_* names (setup.py reads them from here): the agent knows and
ignores them, and still refuses any other ALNAIR_* name, which is most likely a typo.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from alnair_agent.constants import COMPUTE_UNITS_PER_GPU


class ConfigError(ValueError):
    """A configuration value is missing or malformed; the message names the variable, value and what is allowed."""


@dataclass(frozen=True)
class SimGpu:
    """One simulated GPU: its memory in bytes."""

    memory_bytes: int


_SIZE_UNITS = {"MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIM_RE = re.compile(r"^(?:([0-9]{1,3})x)?([0-9]{1,7})(MiB|GiB|TiB)$", re.ASCII)
MAX_SIM_GPUS = 64
MAX_SIM_GPU_BYTES = 16 << 40  # 16 TiB: far above any GPU, far below what could exhaust the agent
# Device IDs per GPU per resource (memory units): kubelet keeps every ID, so a tiny unit on a large GPU is refused.
MAX_UNITS_PER_GPU = 16384


def parse_sim_gpus(text: str) -> tuple[SimGpu, ...]:
    """'2x16GiB' or '16GiB,80GiB' or '2x16GiB,1x80GiB' -> one SimGpu per GPU."""
    gpus: list[SimGpu] = []
    for part in text.split(","):
        m = _SIM_RE.fullmatch(part.strip())
        if not m:
            raise ValueError(f"a comma-separated list of GPU memory sizes, each [<count>x]<size> in MiB|GiB|TiB "
                             f"such as 2x16GiB or 16GiB,80GiB; '{part.strip()}' is not one")
        count = int(m.group(1) or 1)
        size = int(m.group(2)) * _SIZE_UNITS[m.group(3)]
        if count < 1 or size < 1:
            raise ValueError(f"'{part.strip()}' needs a count >= 1 and a size > 0")
        if size > MAX_SIM_GPU_BYTES:
            raise ValueError(f"'{part.strip()}': at most 16TiB per GPU")
        if len(gpus) + count > MAX_SIM_GPUS:
            raise ValueError(f"more than {MAX_SIM_GPUS} GPUs; 1..{MAX_SIM_GPUS} allowed")
        gpus += [SimGpu(size)] * count
    if not 1 <= len(gpus) <= MAX_SIM_GPUS:
        raise ValueError(f"{len(gpus)} GPUs; 1..{MAX_SIM_GPUS} allowed")
    return tuple(gpus)


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError("one of " + ", ".join(allowed))
        return text

    parse.__doc__ = ", ".join(f"`{a}`" for a in allowed)
    return parse


_INT_TEXT = re.compile(r"^[0-9]{1,12}$", re.ASCII)
_FLOAT_TEXT = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,12})?$", re.ASCII)


def _range(kind: type[int] | type[float], lo: float, hi: float) -> Callable[[str], Any]:
    noun = "integer" if kind is int else "number"

    pattern = _INT_TEXT if kind is int else _FLOAT_TEXT

    def parse(text: str) -> Any:
        try:
            # Only plain ASCII decimals: Python's int()/float() also take '1_000', '１２', 'inf', '1e400'.
            if not pattern.fullmatch(text):
                raise ValueError(text)
            value = kind(text)
        except ValueError:
            raise ValueError(f"an {noun} {lo}..{hi}" if kind is int else f"a {noun} {lo}..{hi}") from None
        if not lo <= value <= hi or value != value:  # value != value: NaN
            raise ValueError(f"an {noun} {lo}..{hi}" if kind is int else f"a {noun} {lo}..{hi}")
        return value

    parse.__doc__ = f"{noun} {lo}..{hi}"
    return parse


def _int_range(lo: int, hi: int) -> Callable[[str], int]:
    return _range(int, lo, hi)


def _float_range(lo: float, hi: float) -> Callable[[str], float]:
    return _range(float, lo, hi)


def _bool(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError("true or false")
    return text == "true"


_bool.__doc__ = "`true`, `false`"


def _abs_path(text: str) -> Path:
    if not text.startswith("/"):
        raise ValueError("an absolute path")
    return Path(text)


_abs_path.__doc__ = "absolute path"

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _node_name(text: str) -> str:
    if not _DNS_SUBDOMAIN.match(text):
        raise ValueError("a Kubernetes node name (lowercase DNS subdomain)")
    return text


_node_name.__doc__ = "node name"


def _sim_gpus(text: str) -> tuple[SimGpu, ...]:
    return parse_sim_gpus(text)


_sim_gpus.__doc__ = "e.g. 2x16GiB or 16GiB,80GiB (1..64 GPUs, each at most 16TiB)"


def _opt_abs_path(text: str) -> Path | None:
    return None if text in ("", "off") else _abs_path(text)


_opt_abs_path.__doc__ = "absolute path, or `off`"


# Variables kubelet injects for a Service whose name starts with "alnair" (service links), not settings.
_SERVICE_LINK = re.compile(r"^ALNAIR[A-Z0-9_]*_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$")


@dataclass(frozen=True)
class Variable:
    """One environment variable of the agent."""

    name: str
    attr: str  # Settings field it fills
    parse: Callable[[str], Any]
    default: str | None  # None: required
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("ALNAIR_NODE_NAME", "node_name", _node_name, None,
             "Name of the node the agent runs on (set from spec.nodeName by the DaemonSet); required."),
    Variable("ALNAIR_DEVICE_PLUGIN_DIR", "device_plugin_dir", _abs_path, "/var/lib/kubelet/device-plugins",
             "Folder of kubelet.sock and the plugin sockets."),
    Variable("ALNAIR_POD_RESOURCES_SOCKET", "pod_resources_socket", _abs_path,
             "/var/lib/kubelet/pod-resources/kubelet.sock", "kubelet's pod-resources API socket."),
    Variable("ALNAIR_WORKSPACE", "workspace", _abs_path, "/var/lib/alnair/workspace",
             "Host folder holding one sub-folder (region, allocation record) per allocated container."),
    Variable("ALNAIR_SHIM_DIR", "shim_dir", _abs_path, "/var/lib/alnair/lib",
             "Host folder holding libalnair.so, mounted read-only into containers at /opt/alnair/lib."),
    Variable("ALNAIR_GPU_BACKEND", "gpu_backend", _choice("nvml", "simulated"), "nvml",
             "Where GPUs come from: the NVIDIA driver (NVML) or simulated GPUs."),
    Variable("ALNAIR_SIM_GPUS", "sim_gpus", _sim_gpus, "2x16GiB",
             "Simulated GPUs when ALNAIR_GPU_BACKEND=simulated."),
    Variable("ALNAIR_GPU_POLICY", "gpu_policy", _choice("binpack", "spread"), "binpack",
             "Where the agent itself places a container (without an API server, or with ALNAIR_PLACE_UNSCHEDULED): "
             "the fullest GPU that fits (binpack) or the emptiest (spread). Pods placed by alnair-scheduler go "
             "where it decided."),
    Variable("ALNAIR_PLACE_UNSCHEDULED", "place_unscheduled", _bool, "false",
             "true: the agent places pods that asked for alnair/* resources but bypassed alnair-scheduler; false: "
             "kubelet's admission of such a pod is refused with a message naming the fix (its schedulerName)."),
    Variable("ALNAIR_MEMORY_UNIT_MIB", "memory_unit_mib", _int_range(1, 1 << 20), "1024",
             "MiB of GPU memory per alnair/vgpu-memory unit."),
    Variable("ALNAIR_KUBERNETES", "kubernetes", _choice("auto", "off"), "auto",
             "auto: talk to the API server (in-cluster, else KUBECONFIG); off: run without one."),
    Variable("ALNAIR_METRICS_PORT", "metrics_port", _int_range(0, 65535), "9475",
             "Port of /metrics and the health endpoints (not dcgm-exporter's 9400); 0 turns the HTTP endpoint off."),
    Variable("ALNAIR_LOG_FORMAT", "log_format", _choice("json", "console"), "json",
             "Log lines as JSON (for collectors) or console (for people)."),
    Variable("ALNAIR_LOG_LEVEL", "log_level", _choice("debug", "info", "warning", "error"), "info",
             "Lowest level logged."),
    Variable("ALNAIR_HEALTH_INTERVAL_S", "health_interval_s", _float_range(0.05, 60.0), "1.0",
             "Seconds between GPU health polls (NVML Xid events are waited on for this long, in waits of at most "
             "0.5 s, so a stopping agent is never held longer)."),
    Variable("ALNAIR_RESYNC_INTERVAL_S", "resync_interval_s", _float_range(0.1, 3600.0), "5.0",
             "Seconds between reconciliations against kubelet's pod-resources (ended containers, restarts)."),
    Variable("ALNAIR_PROFILE_INTERVAL_S", "profile_interval_s", _float_range(0.05, 60.0), "1.0",
             "Seconds between profiler samples (NVML per GPU and per process, mapped to containers)."),
    Variable("ALNAIR_ANNOTATE_INTERVAL_S", "annotate_interval_s", _float_range(0.0, 3600.0), "30.0",
             "Least seconds between two writes of a pod's ai.centaurus.io/usage annotation (plus a final write "
             "when a container ends)."),
    Variable("ALNAIR_DISPATCHER", "dispatcher", _choice("on", "off"), "on",
             "on: the dispatcher lays out each GPU's turns (every capped container a window of its cap's part of "
             "the period, none overlapping) and lends idle time to elastic containers; off: no turns are laid out, "
             "each shim keeps its cap's part of the default period for itself, at its start (the shim alone: "
             "containers' windows may overlap), and may run a window's tail into the rest, owed back."),
    Variable("ALNAIR_COMPUTE_POLICY", "compute_policy", _choice("strict", "elastic"), "strict",
             "strict: a compute cap is a ceiling; elastic: a container may use GPU time no other container on its "
             "GPU wants, and is back at its cap within 200 ms once one does. A pod overrides it with the "
             "annotation ai.centaurus.io/compute-policy (same values)."),
    Variable("ALNAIR_DISPATCH_INTERVAL_S", "dispatch_interval_s", _float_range(0.01, 1.0), "0.05",
             "Seconds between two dispatcher ticks (region counters read, turns laid out, leases renewed or "
             "revoked)."),
    Variable("ALNAIR_TURN_PERIOD_S", "turn_period_s", _float_range(0.005, 1.0), "0.1",
             "The period of each GPU's turns: every capped container gets its cap's part of each period, so a "
             "container waits at most one period minus its window for its turn; shorter periods switch more often."),
    Variable("ALNAIR_DISPATCH_IDLE_S", "dispatch_idle_s", _float_range(0.02, 10.0), "0.15",
             "Seconds without launches or waits after which a container counts as idle (elastic: its share may be "
             "lent; its first launch after that takes it back)."),
    Variable("ALNAIR_MPS_PIPE_DIR", "mps_pipe_dir", _opt_abs_path, "off",
             "Host folder of this node's MPS control daemon's pipes (its CUDA_MPS_PIPE_DIRECTORY), or off: every "
             "container admitted is given it (mounted at /run/nvidia-mps, CUDA_MPS_PIPE_DIRECTORY set), so all "
             "containers of a GPU are clients of one MPS server and a latency container's kernels run beside a "
             "neighbour's instead of waiting for the GPU's switch between contexts. MPS serves one Linux user at a "
             "time and a fatal fault of one client ends the work of every client; see docs/architecture.md (The "
             "latency class). Needs ALNAIR_MPS_SHM_DIR."),
    Variable("ALNAIR_MPS_SHM_DIR", "mps_shm_dir", _opt_abs_path, "off",
             "Host folder the MPS control daemon has as /dev/shm (an MPS server and its clients share memory "
             "there), or off: with ALNAIR_MPS_PIPE_DIR, every container admitted gets it mounted at /dev/shm, so "
             "the containers of a node share one /dev/shm (as under NVIDIA's own MPS sharing). Set both or neither; "
             "a folder on a memory file system (under /run on most hosts)."),
    Variable("ALNAIR_SIM_TIMELINE_DIR", "sim_timeline_dir", _opt_abs_path, "off",
             "Test and demo only: folder of the simulated driver's per-GPU timelines (its SIMCUDA_TIMELINE_DIR), "
             "read by the simulated backend for per-process utilization."),
    Variable("ALNAIR_SIM_FAULTS_FILE", "sim_faults_file", _opt_abs_path, "off",
             "Test only, off by default: a JSON file the simulated backend re-reads while running to inject NVML "
             "faults into the live agent (`{\"unhealthy\": {\"<gpu index>\": \"<reason>\"}, \"sample_error\": "
             "\"<text>\"}`); see docs/reliability.md. Ignored with the NVML backend."),
    # -- the DRA front-end (README "Two front-ends") ---------------------------------------------------------
    Variable("ALNAIR_FRONTEND", "frontend", _choice("auto", "device-plugin", "dra"), "auto",
             "Which front-end offers this node's GPUs (never both): `device-plugin` (alnair/vgpu-memory and "
             "alnair/vgpu-compute, placed by alnair-scheduler), `dra` (ResourceSlices of driver "
             "gpu.alnair.centaurus.io, placed by kube-scheduler from ResourceClaims), or `auto`: `dra` when the API "
             "server serves resource.k8s.io/v1 with consumable capacity and the DeviceClass gpu.alnair.centaurus.io "
             "exists, else `device-plugin`."),
    Variable("ALNAIR_DRA_PLUGIN_DIR", "dra_plugin_dir", _abs_path, "/var/lib/kubelet/plugins/gpu.alnair.centaurus.io",
             "Folder of the DRA plugin's gRPC socket (dra.sock), which kubelet dials."),
    Variable("ALNAIR_PLUGINS_REGISTRY_DIR", "plugins_registry_dir", _abs_path, "/var/lib/kubelet/plugins_registry",
             "kubelet's plugin-watcher folder, where the DRA plugin's registration socket goes."),
    Variable("ALNAIR_CDI_DIR", "cdi_dir", _abs_path, "/var/run/cdi",
             "Folder of the CDI spec files the DRA front-end writes (one per prepared claim), read by the container "
             "runtime."),
)


@dataclass(frozen=True)
class BuildVariable:
    """An ALNAIR_* variable of the package's build (setup.py, at `pip install`), not of the agent."""

    name: str
    meaning: str


SHIM_CC = BuildVariable(
    "ALNAIR_SHIM_CC",
    "Build only (`pip install`): the C compiler that builds libalnair.so (and the demo's simulated driver) instead "
    "of the pinned zig cc, e.g. `cc` (a machine that cannot fetch ziglang); the library then needs whatever glibc "
    "the build host's headers give, not GLIBC_2.17. The agent ignores it.")
# The shell that ran `pip install` often runs the agent too: these names must not stop it.
BUILD_VARIABLES: tuple[BuildVariable, ...] = (SHIM_CC,)


@dataclass(frozen=True)
class Settings:
    """The agent's validated settings. Build with `Settings.from_env`; tests may construct directly."""

    node_name: str
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    workspace: Path = Path("/var/lib/alnair/workspace")
    shim_dir: Path = Path("/var/lib/alnair/lib")
    gpu_backend: str = "nvml"
    sim_gpus: tuple[SimGpu, ...] = field(default_factory=lambda: parse_sim_gpus("2x16GiB"))
    gpu_policy: str = "binpack"
    place_unscheduled: bool = False
    memory_unit_mib: int = 1024
    kubernetes: str = "auto"
    metrics_port: int = 9475
    log_format: str = "json"
    log_level: str = "info"
    health_interval_s: float = 1.0
    resync_interval_s: float = 5.0
    profile_interval_s: float = 1.0
    annotate_interval_s: float = 30.0
    sim_timeline_dir: Path | None = None
    sim_faults_file: Path | None = None
    dispatcher: str = "on"
    compute_policy: str = "strict"
    dispatch_interval_s: float = 0.05
    turn_period_s: float = 0.1
    dispatch_idle_s: float = 0.15
    mps_pipe_dir: Path | None = None
    mps_shm_dir: Path | None = None
    # the DRA front-end
    frontend: str = "auto"
    dra_plugin_dir: Path = Path("/var/lib/kubelet/plugins/gpu.alnair.centaurus.io")
    plugins_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    cdi_dir: Path = Path("/var/run/cdi")

    @property
    def memory_unit_bytes(self) -> int:
        return self.memory_unit_mib << 20

    @property
    def compute_units_per_gpu(self) -> int:
        return COMPUTE_UNITS_PER_GPU

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Settings":
        """Parse every ALNAIR_* variable; raise ConfigError naming the first bad one."""
        # An empty value (`ALNAIR_X=`) means the default, as an unset one does.
        values: dict[str, Any] = {}
        known = {v.name for v in VARIABLES}
        for var in VARIABLES:
            raw = env.get(var.name)
            if raw is None or raw == "":
                if var.default is None:
                    raise ConfigError(f"{var.name} is not set; allowed: {var.parse.__doc__}")
                raw = var.default
            try:
                values[var.attr] = var.parse(raw.strip())
            except ValueError as e:
                expected = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(e))  # one line, always
                raise ConfigError(f"{var.name}={raw!r} is not allowed; expected {expected}") from None
        ignored = {v.name for v in BUILD_VARIABLES}
        unknown = sorted(k for k in env if k.startswith("ALNAIR_") and k not in known | ignored
                         and not _SERVICE_LINK.match(k))
        if unknown:
            raise ConfigError(f"{unknown[0]} is not a known setting; known: {', '.join(sorted(known))}")
        settings = cls(**values)
        if (settings.mps_pipe_dir is None) != (settings.mps_shm_dir is None):
            given, missing = (("ALNAIR_MPS_PIPE_DIR", "ALNAIR_MPS_SHM_DIR") if settings.mps_shm_dir is None
                              else ("ALNAIR_MPS_SHM_DIR", "ALNAIR_MPS_PIPE_DIR"))
            raise ConfigError(f"{given} is set and {missing} is not: an MPS server and its clients share both its "
                              "pipe folder and its /dev/shm, so set both (or neither, MPS off)")
        if settings.gpu_backend == "simulated":
            biggest = max(g.memory_bytes for g in settings.sim_gpus)
            if biggest // settings.memory_unit_bytes > MAX_UNITS_PER_GPU:
                raise ConfigError(
                    f"ALNAIR_MEMORY_UNIT_MIB={settings.memory_unit_mib} makes {biggest // settings.memory_unit_bytes} "
                    f"memory units of a {biggest >> 20} MiB GPU (ALNAIR_SIM_GPUS); at most {MAX_UNITS_PER_GPU} "
                    "allowed: use a larger unit")
        return settings


def check_paths(settings: Settings) -> list[str]:
    """Start-up checks of the host folders, before anything runs: ConfigError naming the variable when one cannot
    work (the workspace is a file, lies under a file, is read-only or cannot be created; the plugin or shim folder
    is not a folder; with real GPUs, the shim folder lacks libalnair.so). Returns warnings for what may still come
    right (simulated GPUs: the shim not installed yet)."""
    from alnair_agent.node.workspace import Workspace, WorkspaceError

    try:
        Workspace(settings.workspace).ensure()
    except WorkspaceError as e:
        raise ConfigError(f"ALNAIR_WORKSPACE={str(settings.workspace)!r} is not usable: {e}") from None
    warnings = []
    folders = [("ALNAIR_DEVICE_PLUGIN_DIR", settings.device_plugin_dir), ("ALNAIR_SHIM_DIR", settings.shim_dir)]
    if settings.mps_pipe_dir is not None:
        folders.append(("ALNAIR_MPS_PIPE_DIR", settings.mps_pipe_dir))
    if settings.mps_shm_dir is not None:
        folders.append(("ALNAIR_MPS_SHM_DIR", settings.mps_shm_dir))
    for name, path in folders:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{name}={str(path)!r} is not usable: it exists and is not a folder")
        if not path.exists() and any(p.exists() and not p.is_dir() for p in path.parents):
            raise ConfigError(f"{name}={str(path)!r} is not usable: it lies under a file")
    if not (settings.shim_dir / "libalnair.so").is_file():
        if settings.gpu_backend == "nvml":
            # Real GPUs: the DaemonSet's init container has installed the shim before the agent starts; without it
            # every container admitted would run unlimited.
            raise ConfigError(f"ALNAIR_SHIM_DIR={str(settings.shim_dir)!r} holds no libalnair.so: containers would "
                              "run without their limits (the init container installs it: `alnair-agent install-shim "
                              "DIR`)")
        warnings.append(f"ALNAIR_SHIM_DIR={str(settings.shim_dir)!r} holds no libalnair.so: containers admitted now "
                        "start without the shim (limits unenforced) until it is installed")
    mps = settings.mps_pipe_dir
    if mps is not None and not (mps / "control").exists():
        # CUDA runs a client without MPS when no daemon answers there: containers work, only without MPS.
        warnings.append(f"ALNAIR_MPS_PIPE_DIR={str(mps)!r} has no MPS control pipe (no daemon running there): "
                        "containers admitted now run without MPS until nvidia-cuda-mps-control serves it")
    return warnings


def _check_table() -> None:
    attrs = {f.name for f in fields(Settings)}
    for var in VARIABLES:
        if var.attr not in attrs:
            raise AssertionError(f"{var.name} fills unknown Settings.{var.attr}")


_check_table()


def markdown_table() -> str:
    """The README's variable table, generated from VARIABLES."""
    rows = ["| Variable | Default | Allowed | Meaning |", "| --- | --- | --- | --- |"]
    for v in VARIABLES:
        default = "(required)" if v.default is None else f"`{v.default}`"
        rows.append(f"| `{v.name}` | {default} | {v.parse.__doc__} | {v.meaning} |")
    return "\n".join(rows) + "\n"


def build_markdown_table() -> str:
    """The README's table of the build's variables, generated from BUILD_VARIABLES."""
    rows = ["| Variable | Meaning |", "| --- | --- |"]
    rows += [f"| `{v.name}` | {v.meaning} |" for v in BUILD_VARIABLES]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(markdown_table())
    elif sys.argv[1:] == ["--markdown-build"]:
        sys.stdout.write(build_markdown_table())
    else:
        sys.exit("usage: python -m alnair_agent.config --markdown | --markdown-build")
