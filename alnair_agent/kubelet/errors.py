"""The device plugin's refusal to kubelet, apart from the admission code so that its helpers (multigpu.py) raise it
without importing the admission that imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from alnair_agent.kube.pods import PodInfo


class AllocationError(Exception):
    """Refusal to kubelet: a gRPC status code and a message naming what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str, pod: PodInfo | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.pod = pod  # the pod refused, when known (an Event goes on it)
