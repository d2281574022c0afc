"""NVML health: which Xid events make a GPU unhealthy. pynvml's event calls are stood in for (no GPU here); the
filtering and reporting are the agent's own code, exercised as written."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from alnair_agent.gpu.backend import HealthEvent
from alnair_agent.gpu.nvml import NvmlBackend

UUID = "GPU-0b8a5f29-a68d-c604-39f3-5174ded264da"


@pytest.fixture
def backend(monkeypatch):
    events: list = []

    def wait(event_set, timeout_ms):
        if not events:
            raise pynvml.NVMLError_Timeout()
        return events.pop(0)

    monkeypatch.setattr(pynvml, "nvmlEventSetWait_v2", wait)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda handle: UUID.encode())
    b = NvmlBackend()
    b._event_set = object()  # as after start(): registered for Xid events
    return b, events


@pytest.mark.parametrize(("xid", "unhealthy"), [
    (13, False), (31, False), (43, False), (45, False), (68, False), (109, False),  # caused by the application
    (48, True), (63, True), (64, True), (74, True), (79, True), (92, True), (94, True), (95, True),
])
def test_xid_decides_health(backend, xid, unhealthy):
    b, events = backend
    events.append(SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid, device="h0"))
    expected = [HealthEvent(UUID, healthy=False, reason=f"xid {xid}")] if unhealthy else []
    assert b.wait_health_events(0.01) == expected


def test_timeout_and_other_event_types_change_nothing(backend):
    b, events = backend
    assert b.wait_health_events(0.01) == []
    events.append(SimpleNamespace(eventType=pynvml.nvmlEventTypeSingleBitEccError, eventData=0, device="h0"))
    assert b.wait_health_events(0.01) == []
