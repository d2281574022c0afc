"""`alnair-agent`: parse the environment, set up logs, run the agent on uvloop until SIGTERM/SIGINT.

Exit codes: 0 after a requested stop; 1 when a service failed (the DaemonSet restarts the agent);
2 for a configuration error (one line naming the variable, the value and what is allowed).
"""

from __future__ import annotations

import argparse
import asyncio
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


async def serve(settings: Settings) -> None:
    """The production agent: GPUs from the backend, kubelet on the node, pods from the API server."""
    from alnair_agent.app import Agent
    from alnair_agent.kube.wiring import connect_kubernetes, pod_resources_lister

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Only set a flag here: the ordered shutdown happens in the services' own finally blocks.
        loop.add_signal_handler(sig, stop.set)
    async with connect_kubernetes(settings) as kubernetes, pod_resources_lister(settings) as list_held:
        agent = Agent(settings, make_backend(settings), kubernetes, list_held=list_held)
        await agent.run(stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alnair-agent", description="Alnair node agent (GPU sharing for Kubernetes)")
    parser.add_argument("--demo", action="store_true",
                        help="run on simulated GPUs against an in-process kubelet, admit a few containers, print, exit")
    args = parser.parse_args(argv)
    if args.demo:
        from alnair_agent.demo import run_demo

        return run_demo()
    try:
        settings = Settings.from_env(os.environ)
        warnings = check_paths(settings)
    except ConfigError as e:
        print(f"alnair-agent: configuration error: {e}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    for warning in warnings:
        log.warning("startup_check", problem=warning)
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
