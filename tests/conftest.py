"""Shared test fixtures: every async test fails if it leaves asyncio tasks behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

# The lazy kubernetes-asyncio packages, installed before any test module imports kubernetes_asyncio: the tests run
# the client the way the agent loads it (alnair_agent/kube/lazy_client.py).
import alnair_agent.kube  # noqa: F401
from alnair_standins.apiserver import FakeApiServer
from alnair_standins.node import remove_tree, short_tmp

try:
    import pytest_asyncio
except ImportError:  # the GPU machine has no pytest-asyncio; the tests it runs (-m gpu) are synchronous
    pytest_asyncio = None


@pytest.fixture
def root() -> Iterator[Path]:
    """A short folder for the node's sockets and workspace, removed after the test."""
    path = short_tmp()
    yield path
    remove_tree(path)


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    """The API server stand-in, serving for the test."""
    async with FakeApiServer() as server:
        yield server


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
