"""`alnair-scheduler`: serve the kube-scheduler extender until SIGTERM/SIGINT.

Options come from the command line, with the environment as the default: `--port` (ALNAIR_SCHEDULER_PORT, 8888;
0 picks a free port, logged in `scheduler_listening`), `--host` (0.0.0.0), `--log-format` (ALNAIR_LOG_FORMAT,
json | console), `--log-level` (ALNAIR_LOG_LEVEL, debug | info | warning | error).
Exit codes: 0 after a requested stop; 1 when the server cannot listen; 2 for a bad option or variable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Mapping

import structlog
import uvloop

from alnair_agent import logs
from alnair_agent.scheduler.server import serve

log = structlog.get_logger("alnair_scheduler")

DEFAULT_PORT = 8888
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _port(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0..65535)")
    return int(text)


def parse_args(argv: list[str] | None, env: Mapping[str, str]) -> argparse.Namespace:
    """The options; SystemExit(2) with a message naming the option or variable for a bad value."""
    parser = argparse.ArgumentParser(prog="alnair-scheduler",
                                     description="Alnair kube-scheduler extender (filter + prioritize over HTTP)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=_port, default=None,
                        help=f"port to listen on (default $ALNAIR_SCHEDULER_PORT or {DEFAULT_PORT})")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        help="json or console (default $ALNAIR_LOG_FORMAT or json)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="default $ALNAIR_LOG_LEVEL or info")
    args = parser.parse_args(argv)
    if args.port is None:
        raw = env.get("ALNAIR_SCHEDULER_PORT", str(DEFAULT_PORT))
        try:
            args.port = _port(raw)
        except argparse.ArgumentTypeError as e:
            parser.error(f"ALNAIR_SCHEDULER_PORT: {e}")
    for option, variable, allowed, default in (("log_format", "ALNAIR_LOG_FORMAT", LOG_FORMATS, "json"),
                                               ("log_level", "ALNAIR_LOG_LEVEL", LOG_LEVELS, "info")):
        if getattr(args, option) is None:
            value = env.get(variable, default)
            if value not in allowed:
                parser.error(f"{variable}: {value!r} is not one of {', '.join(allowed)}")
            setattr(args, option, value)
    return args


async def run(host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(host, port, stop)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv, os.environ)
    except SystemExit as e:  # argparse has printed the message (or --help)
        return e.code if isinstance(e.code, int) else 2
    logs.configure(args.log_format, args.log_level)
    try:
        uvloop.run(run(args.host, args.port))
    except OSError as e:  # address in use, cannot bind
        log.error("scheduler_listen_failed", host=args.host, port=args.port, error=str(e))
        return 1
    log.info("scheduler_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
