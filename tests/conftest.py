"""Shared test fixtures: every async test fails if it leaves asyncio tasks behind."""

from __future__ import annotations

import asyncio

import pytest

# The lazy kubernetes-asyncio packages, installed before any test module imports kubernetes_asyncio: the tests run
# the client the way the agent loads it (alnair_agent/kube/lazy_client.py).
import alnair_agent.kube  # noqa: F401

# Node fixtures (root, api) for the agent's tests; the GPU machine runs tests/gpu with --confcutdir=tests/gpu.
pytest_plugins = ["agent_harness"]

try:
    import pytest_asyncio
except ImportError:  # the GPU machine has no pytest-asyncio; the tests it runs (-m gpu) are synchronous
    pytest_asyncio = None

if pytest_asyncio is not None:

    @pytest_asyncio.fixture(autouse=True)
    async def _no_leftover_tasks():
        """Fail a test that leaves tasks running on its loop: a leaked task is a leaked service."""
        before = set(asyncio.all_tasks())
        yield
        await asyncio.sleep(0)
        left = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
        for t in left:
            t.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
            pytest.fail(f"test left {len(left)} task(s) running: {[t.get_name() for t in left]}")
