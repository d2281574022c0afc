"""Slice folders and CDI spec files made ahead, in a worker thread, for prepares to take: a prepare then renames
files instead of creating them on kubelet's clock (`Workspace.make_spare`, `CdiWriter.make_spare`). A burst of more
prepares than SPARES makes the rest as before, in the call.
"""

from __future__ import annotations

import asyncio

import structlog

from alnair_agent.dra.cdi import CdiWriter
from alnair_agent.node.workspace import Spare, Workspace

log = structlog.get_logger(__name__)

SPARES = 4
SPARE_RETRY_S = 5.0  # after a spare could not be made (a full disk): the prepares make their own meanwhile


class SparePool:
    def __init__(self, workspace: Workspace, cdi: CdiWriter) -> None:
        self.workspace = workspace
        self.cdi = cdi
        self.folders: list[Spare] = []
        self.specs: list[str] = []
        self.taken = asyncio.Event()

    def take_folder(self) -> Spare | None:
        spare = self.folders.pop() if self.folders else None
        if spare is not None:
            self.taken.set()
        return spare

    def take_spec(self) -> str | None:
        spare = self.specs.pop() if self.specs else None
        if spare is not None:
            self.taken.set()
        return spare

    def _make(self, folder: bool, spec: bool) -> tuple[Spare | None, str | None, OSError | None]:
        """In a worker thread: a slice folder and/or a spec file made ahead (each touches only its own new files;
        nothing of the ledger's), with the error that stopped it, if any: what was made is kept all the same."""
        made: Spare | None = None
        try:
            if folder:
                made = self.workspace.make_spare()
            return made, self.cdi.make_spare() if spec else None, None
        except OSError as e:
            return made, None, e

    async def run(self) -> None:
        """Service: SPARES slice folders and spec files made ahead, in a worker thread (its file calls never hold
        the event loop), made again as prepares take them. Stopped, it waits for the ones being made and removes
        them all."""
        making: asyncio.Future[tuple[Spare | None, str | None, OSError | None]] | None = None
        failing = ""
        try:
            while True:
                folder, spec = len(self.folders) < SPARES, len(self.specs) < SPARES
                if not folder and not spec:
                    self.taken.clear()
                    await self.taken.wait()
                    continue
                making = asyncio.ensure_future(asyncio.to_thread(self._make, folder, spec))
                error = self._keep(await asyncio.shield(making))
                if error is None:
                    failing = ""
                    continue
                if str(error) != failing:
                    log.warning("dra_spare_failed", workspace=str(self.workspace.spares_folder),
                                cdi=str(self.cdi.folder), error=str(error), retry_in_s=SPARE_RETRY_S)
                    failing = str(error)
                await asyncio.sleep(SPARE_RETRY_S)
        finally:
            if making is not None:
                if not making.done():
                    await asyncio.wait([making], timeout=5.0)
                if making.done() and not making.cancelled() and making.exception() is None:
                    self._keep(making.result())  # made while the service was being stopped: removed below
            for spare in self.folders:
                spare.close()
            self.folders.clear()
            self.specs.clear()
            self.workspace.remove_spares()
            self.cdi.remove_spares()

    def _keep(self, made: tuple[Spare | None, str | None, OSError | None]) -> OSError | None:
        folder, spec, error = made
        if folder is not None and folder not in self.folders:
            self.folders.append(folder)
        if spec is not None and spec not in self.specs:
            self.specs.append(spec)
        return error
