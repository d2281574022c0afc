"""Housekeeping of the DRA front-end's claims: at start, every prepared claim's CDI spec rebuilt from its records
(specs of claims without records removed); while serving, the slices of claims that are gone retired (a record whose
claim is gone from the API server and from kubelet's pod-resources: an unprepare missed while the agent was down and
kubelet lost its own record). Nothing of a live claim is removed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from alnair_agent.dra.claims import ClaimRef, ClaimUnavailable, PrepareError, share_key
from alnair_agent.dra.prepare import ClaimPreparer
from alnair_agent.node.workspace import Allocation

log = structlog.get_logger(__name__)


class ClaimCleanup:
    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer

    def restore_specs(self) -> None:
        """At start: every prepared claim's CDI spec as its records say; specs of claims without records go (they
        were never answered, or their claim was retired)."""
        try:
            self.preparer.cdi.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("dra_cdi_folder_unusable", folder=str(self.preparer.cdi.folder), error=str(e))
        self.preparer.cdi.remove_spares()  # an earlier run's: no spec is in them
        live = self.preparer.claim_uids()
        for uid in sorted(live):
            self.preparer.write_spec_quietly(uid)
        for uid in self.preparer.cdi.claim_uids() - live:
            log.info("dra_cdi_spec_orphan_removed", claim_uid=uid)
            try:
                self.preparer.cdi.remove(uid)
            except OSError as e:
                log.warning("dra_cdi_spec_unremovable", claim_uid=uid, error=str(e))

    async def collect_orphans(self, list_claims: Callable[[], Awaitable[set[tuple[str, str]]]] | None) -> int:
        """Retire the slices of claims that are gone: no longer on the API server (or allocated otherwise) AND not
        reported by kubelet's pod-resources. Kubelet unprepares claims itself; this catches the one it forgot (its
        state lost, or the agent down through the call). Returns how many claims were retired."""
        if list_claims is None:
            return 0  # no authority to ask: kubelet's own unprepare is the only way out
        by_claim: dict[str, list[Allocation]] = {}
        for alloc in self.preparer.records():
            assert alloc.claim is not None
            by_claim.setdefault(alloc.claim.uid, []).append(alloc)
        if not by_claim:
            return 0
        try:
            in_use = await list_claims()
        except Exception as e:  # noqa: BLE001 - kubelet briefly unreachable: decide nothing this time
            log.warning("pod_resources_unavailable", error=str(e))
            return 0
        retired = 0
        for uid, records in by_claim.items():
            share = records[0].claim
            assert share is not None
            if (share.namespace, share.name) in in_use:
                continue
            ref = ClaimRef(share.namespace, uid, share.name)
            try:
                claim = await self.preparer.reader.claims.get_claim(ref.namespace, ref.name)
            except ClaimUnavailable:
                continue
            if claim is not None:
                try:
                    self.preparer.reader.check_uid(ref, claim)
                    current = {share_key(r.share) for r in self.preparer.reader.results(ref, claim)}
                except PrepareError:
                    current = set()  # another claim of the name, or no longer allocated as recorded
                if any(share_key(a.claim) in current for a in records if a.claim is not None):
                    continue  # allocated as recorded: prepared, maybe not yet started, never removed here
            try:
                await self.preparer.retire(uid, records, why="claim gone")
                retired += 1
            except PrepareError as e:
                log.warning("dra_orphan_pending", claim_uid=uid, error=str(e))
        return retired
