"""A quick first look on the GPU machine: ABI surprises before the full run. Prints findings as JSON lines.

python3 tests/gpu/shim_smoke.py /tmp/shim/libalnair.so
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from alnair_agent.node.region import Region

CHILD = str(Path(__file__).with_name("shim_torch_child.py"))


def child(args, env_extra=None, shim=None, timeout=300):
    env = dict(os.environ)
    env.update(env_extra or {})
    if shim:
        env["LD_PRELOAD"] = shim
    p = subprocess.run([sys.executable, CHILD, *args], env=env, capture_output=True, text=True, timeout=timeout)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    try:
        return json.loads(last) | {"rc": p.returncode, "stderr": p.stderr[-1500:]}
    except json.JSONDecodeError:
        return {"rc": p.returncode, "stdout": p.stdout[-1500:], "stderr": p.stderr[-3000:]}


def main() -> None:
    shim = sys.argv[1]
    # which hooked names the real driver exports
    names = subprocess.run(["nm", "-D", "--defined-only", shim], capture_output=True, text=True).stdout.split()
    hooked = [n for n in names if n.startswith(("cu", "nvml"))]
    lib = subprocess.run("ldconfig -p | grep -m1 'libcuda.so.1 ' | awk '{print $NF}'", shell=True,
                         capture_output=True, text=True).stdout.strip()
    exported = set(subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True).stdout.split())
    print(json.dumps({"libcuda": lib, "hooked_missing_in_driver": [n for n in hooked if n not in exported]}))
    print(json.dumps({"plain_meminfo": child(["meminfo"])}))
    with tempfile.TemporaryDirectory() as d:
        reg = Path(d) / "region"
        Region.create(reg, 16 << 30, 0).close()
        env = {"ALNAIR_REGION": str(reg)}
        print(json.dumps({"shim_meminfo": child(["meminfo"], env, shim)}))
        print(json.dumps({"shim_oom": child(["oom"], env, shim)}))
        Region.create(reg, 0, 30).close()
        print(json.dumps({"shim_throughput_30": child(["throughput", "3"], env, shim)}))
    print(json.dumps({"plain_throughput": child(["throughput", "3"])}))


if __name__ == "__main__":
    main()
