"""`alnair-agent demo [--seconds N]`: the system working on one machine, with no GPU and no cluster: the device
plugin run, then the same workloads through the DRA front-end, both against the stand-ins of alnair_standins.

What it shows is what the system guarantees today: no container exceeds its compute cap or its memory limit, and
capped containers sharing a GPU each get their cap (they take turns on it). The agent's log goes to a file, never
into the table.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import uvloop

from alnair_agent import logs
from alnair_agent.demo.common import DemoResult, DemoUnavailable
from alnair_agent.demo.device_plugin import demo
from alnair_agent.demo.dra import demo_dra
from alnair_standins.simdriver import DriverUnavailable


async def demo_all(root: Path, seconds: float = 15.0, out: TextIO = sys.stdout) -> tuple[DemoResult, DemoResult]:
    """`alnair-agent demo`: the device plugin run, then the DRA run on the same simulated driver."""
    first = await demo(root / "device-plugin", seconds, out)
    return first, await demo_dra(root / "dra", root / "device-plugin" / "sim", seconds, out)


def run_demo(seconds: float = 15.0) -> int:
    with tempfile.TemporaryDirectory(prefix="alnair-demo-") as tmp:
        log_path = Path(tmp) / "agent.log"
        with open(log_path, "w") as log_file:
            # The agent's log, and anything the C libraries (gRPC) write on stderr: into a file, never the table.
            logs.configure("json", "info", log_file)
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(log_file.fileno(), 2)
            try:
                uvloop.run(demo_all(Path(tmp), seconds))
            except (DemoUnavailable, DriverUnavailable) as e:
                problem = str(e)
            else:
                problem = ""
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            if problem:
                print(f"alnair-agent demo: {problem}", file=sys.stderr)
                return 1
        lines = log_path.read_text().splitlines()
        warnings = sum('"level": "warning"' in ln or '"level": "error"' in ln for ln in lines)
        print(f"The agent logged {len(lines)} lines ({warnings} warnings or errors) into a file, deleted now.")
    return 0
