"""What the agent's services need of the pod watch (alnair_agent.kube.podwatch.PodWatch implements it): one protocol,
so the device plugin's admission, the ledger, the reconciler and the DRA front-end name the same thing the same
way. Kept apart from podwatch.py, which loads the Kubernetes client, so that what only reads pods need not."""

from __future__ import annotations

from typing import Protocol

from alnair_agent.kube.pods import PodInfo


class PodSource(Protocol):
    @property
    def synced(self) -> bool: ...

    @property
    def generation(self) -> int: ...

    def pods(self) -> list[PodInfo]: ...

    def get(self, uid: str) -> PodInfo | None: ...

    def find(self, namespace: str, name: str) -> PodInfo | None: ...

    def bound_order(self, uid: str) -> int: ...

    async def changed(self, since: int, timeout: float | None = None) -> bool: ...
