"""Kept only for bench/shares_gpu.py and bench/turn_trace.py, which put tests/gpu on sys.path to import
`workloads` and are being rewritten for issue 25 (not touched here). The GPU tests' workloads are
`alnair_standins.workloads`; remove this file once those two import that."""

from alnair_standins.workloads import Node, NvmlUtilization, plain_env, run_py

__all__ = ["Node", "NvmlUtilization", "plain_env", "run_py"]
