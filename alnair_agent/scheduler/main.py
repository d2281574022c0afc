"""`alnair-scheduler`: the kube-scheduler extender (filter, prioritize, bind) until SIGTERM/SIGINT.

Options come from the command line, with the environment as the default:
  --host (127.0.0.1: the verbs, which can bind pods, are for kube-scheduler in the same pod only),
  --port (ALNAIR_SCHEDULER_PORT, 8888; 0 picks a free port, logged in `scheduler_listening`),
  --health-port (ALNAIR_SCHEDULER_HEALTH_PORT, 8889: /healthz and /readyz on every address, for kubelet's probes),
  --kubernetes (ALNAIR_KUBERNETES, auto | off: the API server from in-cluster config or KUBECONFIG; without one
    the extender knows no nodes and cannot bind),
  --bind-wait-s (ALNAIR_BIND_WAIT_S, 20: how long a bind waits for the node's lock),
  --log-format (ALNAIR_LOG_FORMAT, json | console), --log-level (ALNAIR_LOG_LEVEL, debug | info | warning | error),
  --webhook-port (ALNAIR_WEBHOOK_PORT, 0 = off: the mutating admission webhook, POST /mutate over HTTPS, see
    webhook.py), --tls-dir (tls.crt and tls.key of a kubernetes.io/tls Secret; without them a self-signed
    certificate for --webhook-dns is made and published as the webhook configuration's caBundle),
  --default-profile (ALNAIR_DEFAULT_PROFILE, alnair-cost-saving: where the webhook routes pods naming none).
Run exactly one instance (one replica, Recreate strategy): it alone decides placements and node locks, so it stops
fast: on SIGTERM it stops taking requests, answers every bind waiting for a node's lock with an Error (kube-scheduler
retries it against the next instance) and exits within 2 s.
Exit codes: 0 after a requested stop; 1 when the server cannot listen or a service fails; 2 for a bad option.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
import uvloop
from kubernetes_asyncio.client import CoreV1Api

from alnair_agent import logs
from alnair_agent.kube.client import KubeConfigError, connect
from alnair_agent.kube.reflector import Reflector
from alnair_agent.lifecycle import ServiceFailed, run_services
from alnair_agent.scheduler.bind import BIND_WAIT_S, Binder
from alnair_agent.scheduler.dra import DraView, dra_reflectors, dra_served
from alnair_agent.scheduler.extender import PROFILES
from alnair_agent.scheduler.server import serve
from alnair_agent.scheduler.view import ClusterView

log = structlog.get_logger("alnair_scheduler")

STOP_TIMEOUT_S = 1.5  # SIGTERM to every service stopped (the verbs' server within its 1 s grace); exit within 2 s
DEFAULT_PORT = 8888
DEFAULT_HEALTH_PORT = 8889
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _port(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0..65535)")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 300.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds 0..300")
    return value


def parse_args(argv: list[str] | None, env: Mapping[str, str]) -> argparse.Namespace:
    """The options; SystemExit(2) with a message naming the option or variable for a bad value."""
    parser = argparse.ArgumentParser(prog="alnair-scheduler",
                                     description="Alnair kube-scheduler extender (filter, prioritize, bind over HTTP)")
    parser.add_argument("--host", default="127.0.0.1", help="address of the verbs (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=None,
                        help=f"port of the verbs (default $ALNAIR_SCHEDULER_PORT or {DEFAULT_PORT})")
    parser.add_argument("--health-port", type=_port, default=None,
                        help=f"port of /healthz and /readyz (default $ALNAIR_SCHEDULER_HEALTH_PORT or "
                             f"{DEFAULT_HEALTH_PORT})")
    parser.add_argument("--kubernetes", choices=("auto", "off"), default=None,
                        help="auto or off (default $ALNAIR_KUBERNETES or auto)")
    parser.add_argument("--bind-wait-s", type=_seconds, default=None,
                        help=f"how long a bind waits for the node's lock (default $ALNAIR_BIND_WAIT_S or {BIND_WAIT_S:g})")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        help="json or console (default $ALNAIR_LOG_FORMAT or json)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="default $ALNAIR_LOG_LEVEL or info")
    parser.add_argument("--webhook-port", type=_port, default=None,
                        help="HTTPS port of the admission webhook, POST /mutate "
                             "(default $ALNAIR_WEBHOOK_PORT or 0: off)")
    parser.add_argument("--tls-dir", default=None,
                        help="folder with tls.crt and tls.key for the webhook (default: a self-signed certificate, "
                             "published as the caBundle of MutatingWebhookConfiguration alnair-scheduler)")
    parser.add_argument("--webhook-dns", default="alnair-webhook.kube-system.svc",
                        help="DNS name of the webhook's Service, for the self-signed certificate")
    parser.add_argument("--default-profile", choices=tuple(PROFILES), default=None,
                        help="profile the webhook gives pods that name none (default $ALNAIR_DEFAULT_PROFILE or "
                             "alnair-cost-saving)")
    args = parser.parse_args(argv)
    for option, variable, convert, default in (
            ("port", "ALNAIR_SCHEDULER_PORT", _port, str(DEFAULT_PORT)),
            ("webhook_port", "ALNAIR_WEBHOOK_PORT", _port, "0"),
            ("health_port", "ALNAIR_SCHEDULER_HEALTH_PORT", _port, str(DEFAULT_HEALTH_PORT)),
            ("bind_wait_s", "ALNAIR_BIND_WAIT_S", _seconds, f"{BIND_WAIT_S:g}")):
        if getattr(args, option) is None:
            try:
                setattr(args, option, convert(env.get(variable, default)))
            except argparse.ArgumentTypeError as e:
                parser.error(f"{variable}: {e}")
    for option, variable, allowed, default in (("log_format", "ALNAIR_LOG_FORMAT", LOG_FORMATS, "json"),
                                               ("log_level", "ALNAIR_LOG_LEVEL", LOG_LEVELS, "info"),
                                               ("kubernetes", "ALNAIR_KUBERNETES", ("auto", "off"), "auto"),
                                               ("default_profile", "ALNAIR_DEFAULT_PROFILE", tuple(PROFILES),
                                                "alnair-cost-saving")):
        if getattr(args, option) is None:
            value = env.get(variable, default)
            if value not in allowed:
                parser.error(f"{variable}: {value!r} is not one of {', '.join(allowed)}")
            setattr(args, option, value)
    return args


def reflectors(core: CoreV1Api, view: ClusterView) -> list[Reflector]:
    """The node watch and one pod watch per Alnair profile (field selector spec.schedulerName), feeding `view`."""
    def on_node(kind: str, obj: Mapping[str, Any]) -> None:
        if kind == "DELETED":
            view.delete_node(((obj.get("metadata") or {}).get("name")) or "")
        else:
            view.apply_node(obj)

    def pod_handlers(profile: str) -> tuple[Any, Any]:
        def on_list(items: Sequence[Any]) -> None:
            view.replace_pods(items, profile)

        def on_event(kind: str, obj: Mapping[str, Any]) -> None:
            if kind == "DELETED":
                view.delete_pod(((obj.get("metadata") or {}).get("uid")) or "")
            else:
                view.apply_pod(obj)
        return on_list, on_event

    out = [Reflector("nodes", core.list_node, view.replace_nodes, on_node)]
    for profile in PROFILES:
        on_list, on_event = pod_handlers(profile)
        out.append(Reflector(f"pods:{profile}", core.list_pod_for_all_namespaces, on_list, on_event,
                             field_selector=f"spec.schedulerName={profile}"))
    return out


async def run(args: argparse.Namespace, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    view = ClusterView()
    dra_view = DraView()
    api = await connect(args.kubernetes)
    try:
        services: list[tuple[str, Any]] = []
        binder = None
        if api is not None:
            core = CoreV1Api(api)
            watches = reflectors(core, view)
            binder = Binder(view, api, bind_wait_s=args.bind_wait_s)

            async def mark_synced() -> None:
                for w in watches:
                    assert w.synced is not None
                    await w.synced.wait()
                view.warm()
                # Thousands of long-lived node summaries: keep them out of every cyclic-GC pass (a gen-2 pass over
                # them would stall a verb for hundreds of ms).
                gc.freeze()
                view.synced = True
                log.info("scheduler_view_synced", nodes=len(view.nodes), pods=len(view.pods))
                await asyncio.Event().wait()

            services += [(w.name, w.run()) for w in watches] + [("view-sync", mark_synced())]
            if await dra_served(api):  # the DRA pods' profiles (scheduler/dra.py); readiness does not wait for them
                services += [(w.name, w.run()) for w in dra_reflectors(api, dra_view)]
        else:
            view.synced = True
        if args.webhook_port:
            services += webhook_services(args, api)[0]
        # The server runs until cancelled (run_services stops it in order); it never ends on its own. It stops
        # first: no new request is taken and the waiting binds are answered while the watches still feed the view.
        services.insert(0, ("http", serve(args.host, args.port, asyncio.Event(), view, binder, args.health_port,
                                          dra_view)))
        await run_services(services, stop, process="scheduler", shutdown_timeout=STOP_TIMEOUT_S)
    finally:
        if api is not None:
            await api.close()


def webhook_services(args: argparse.Namespace, api: Any) -> tuple[list[tuple[str, Any]], bytes]:
    """The webhook's HTTPS server and (self-signed, with an API server) the caBundle publisher; the certificate."""
    from pathlib import Path

    from alnair_agent.scheduler.webhook import keep_ca_bundle_published, serve_webhook, tls_context

    folder = Path(args.tls_dir) if args.tls_dir else None
    given = folder is not None and (folder / "tls.crt").is_file() and (folder / "tls.key").is_file()
    crt, key = (folder / "tls.crt", folder / "tls.key") if given and folder is not None else (None, None)
    ctx, pem = tls_context(crt, key,
                           [args.webhook_dns, args.webhook_dns.split(".svc")[0]])
    out: list[tuple[str, Any]] = [("webhook", serve_webhook("0.0.0.0", args.webhook_port, ctx, args.default_profile))]
    if not given and api is not None:
        out.append(("webhook-ca-bundle", keep_ca_bundle_published(api, pem)))
    return out, pem


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv, os.environ)
    except SystemExit as e:  # argparse has printed the message (or --help)
        return e.code if isinstance(e.code, int) else 2
    logs.configure(args.log_format, args.log_level)
    try:
        uvloop.run(run(args))
    except KubeConfigError as e:
        log.error("kubernetes_config_unusable", error=str(e))
        return 2
    except ServiceFailed as e:
        if isinstance(e.error, OSError):
            log.error("scheduler_listen_failed", host=args.host, port=args.port, error=str(e.error))
        else:
            log.error("scheduler_failed", service=e.name, error=str(e))
        return 1
    log.info("scheduler_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
