"""`alnair-agent`: parse the environment, set up logs, run the agent on uvloop until SIGTERM/SIGINT.

Exit codes: 0 after a requested stop; 1 when a service failed (the DaemonSet restarts the agent);
2 for a configuration error (one line naming the variable, the value and what is allowed).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys

import structlog
import uvloop

from alnair_agent import logs
from alnair_agent.config import ConfigError, Settings, check_paths
from alnair_agent.gpu import make_backend
from alnair_agent.gpu.backend import GpuBackendError
from alnair_agent.kube.client import KubeConfigError
from alnair_agent.lifecycle import ServiceFailed

log = structlog.get_logger("alnair_agent")

# How long a thread running Python may keep the GIL from one that waits (CPython's default is 5 ms). The agent's
# worker threads parse regions (the profiler, each second) and make files ahead (the DRA front-end) beside the event
# loop, and every system call the loop makes lets one of them take the GIL: at 5 ms each, 20 preads took 47 ms beside
# a busy worker on the 2-vCPU box (3.8 ms at 0.5 ms), and a kubelet call waited that out. This is CPython's convoy
# effect, and `sys.setswitchinterval` is the interpreter's own knob for it (nothing to hand-write; the alternative,
# keeping Python off worker threads, would put the same work back on the loop). The price is up to ten times the GIL
# hand-offs between busy threads; no thread of the agent is throughput-bound (a two-thread spin test showed no loss
# above this box's noise). It is interpreter-wide, so it is set here, once, in the agent's own process: importing
# the package or running the tests in-process changes nothing.
GIL_SWITCH_S = 0.0005


async def serve(settings: Settings) -> None:
    """The production agent: GPUs from the backend, kubelet on the node, pods from the API server."""
    from alnair_agent.app import Agent
    from alnair_agent.kube.wiring import connect_kubernetes, pod_resources_client

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Only set a flag here: the ordered shutdown happens in the services' own finally blocks.
        loop.add_signal_handler(sig, stop.set)
    async with connect_kubernetes(settings) as kubernetes, pod_resources_client(settings) as pod_resources:
        agent = Agent(settings, make_backend(settings), kubernetes, list_held=pod_resources.list,
                      list_claims=pod_resources.list_claims)
        frozen = asyncio.ensure_future(freeze_when_ready(agent.ready))
        try:
            await agent.run(stop)
        finally:
            frozen.cancel()
            await asyncio.gather(frozen, return_exceptions=True)


async def freeze_when_ready(ready: asyncio.Event) -> None:
    """Once the agent serves, everything made so far (the imported libraries' modules, classes and tables: most of
    the heap) goes out of the cyclic collector's reach (gc.freeze, as alnair-scheduler does after its sync): a full
    collection walked it all, a stall of every kubelet call in flight (bench/dra.py's agent on the 2-vCPU box: 59 ms
    before, 1.7 ms after). What is made later is collected as before. Only the agent's own process does this."""
    await ready.wait()
    gc.freeze()
    log.info("gc_frozen", objects=gc.get_freeze_count())


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("alnair")
    except PackageNotFoundError:
        return "unknown"


def help_epilog() -> str:
    """The configuration variables, for --help (the same table as the README's, from config.VARIABLES)."""
    from alnair_agent.config import VARIABLES

    lines = ["configuration (environment variables only; a bad value stops the agent with one line naming it):"]
    for v in VARIABLES:
        default = "required" if v.default is None else f"default {v.default}"
        lines.append(f"  {v.name}  ({default}; {(v.parse.__doc__ or '').replace('`', '')})")
    lines.append("")
    lines.append("commands:")
    lines.append("  demo [--seconds N]  the agent, the shim and simulated GPUs on this machine: no GPU, no cluster")
    lines.append("  install-shim DIR    copy libalnair.so into DIR atomically (the DaemonSet's init container)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alnair-agent", description="Alnair node agent (GPU sharing for Kubernetes)",
                                     epilog=help_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"alnair-agent {version()}")
    parser.add_argument("--demo", action="store_true", help="same as the demo command")
    sub = parser.add_subparsers(dest="command", metavar="{demo,install-shim}")
    demo = sub.add_parser("demo", help="run the demo: containers under the real shim on simulated GPUs, a live table")
    demo.add_argument("--seconds", type=float, default=15.0, help="how long the containers run (default 15)")
    install = sub.add_parser("install-shim", help="copy libalnair.so into a folder atomically (temporary name, rename)")
    install.add_argument("folder", help="the host's shim folder as mounted in the init container")
    args = parser.parse_args(argv)
    if args.command == "install-shim":
        from alnair_agent.shim_install import install_shim

        return install_shim(args.folder)
    if args.demo or args.command == "demo":
        from alnair_agent.demo.run import run_demo

        return run_demo(getattr(args, "seconds", 15.0))
    try:
        settings = Settings.from_env(os.environ)
        warnings = check_paths(settings)
    except ConfigError as e:
        print(f"alnair-agent: configuration error: {e}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    for warning in warnings:
        log.warning("startup_check", problem=warning)
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        uvloop.run(serve(settings))
    except ConfigError as e:  # a setting that only the GPUs found show to be unusable
        print(f"alnair-agent: configuration error: {e}", file=sys.stderr)
        return 2
    except GpuBackendError as e:
        log.error("gpu_backend_failed", error=str(e))
        return 1
    except KubeConfigError as e:
        log.error("kubernetes_config_unusable", error=str(e))
        return 2
    except ServiceFailed as e:
        log.error("agent_failed", service=e.name, error=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
