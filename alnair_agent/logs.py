"""structlog set-up: JSON lines by default, console for people; one event name per line of meaning.

Libraries that log through the standard library (grpc, aiohttp, kubernetes-asyncio, asyncio) come out on the same
stream in the same format: the root logger gets one handler whose formatter is structlog's ProcessorFormatter with
the same processors, so a collector parses every line of the agent alike (`logger` names the library).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog
from structlog.typing import Processor

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_HANDLER_NAME = "alnair"


def configure(log_format: str = "json", level: str = "info", stream: TextIO = sys.stderr) -> None:
    renderer = structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer(colors=False)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    renderer],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    # Libraries at the agent's level, but never their debug chatter unless asked for.
    root.setLevel(_LEVELS[level])
