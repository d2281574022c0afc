"""Alnair: GPU sharing for Kubernetes (the node agent, the scheduler extender, the shim's installer)."""

import os

# gRPC's fork handlers, on by default in grpcio, run in every fork() of a process whose gRPC threads are busy, and
# the child then sometimes dies of SIGSEGV before its exec: uvloop spawns subprocesses by fork(), and the demo's
# containers died so (1 run in 3). Alnair never forks without exec, the case gRPC documents this setting for. It must
# be in the environment before grpc is first imported, so here, before any module of the package imports it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
