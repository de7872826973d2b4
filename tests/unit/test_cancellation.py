"""SIGTERM stops the agent: a cancellation is never lost, and a task that loses one anyway is
said in the log and does not keep the agent running.

On Python 3.11 `asyncio.wait_for` returns the awaited result when the cancellation comes in the
same turns as it (fixed in 3.12): the caller goes on as if never cancelled. SIGTERM reaches the
agent and its binder child together, so the child's death and the cancellation do come
together, and the agent ran on (seen in CI). `asyncio.timeout` has no such race.
"""

from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path

import pytest

from passthrough.agent.main import AgentError, stop_tasks

ROOT = Path(__file__).resolve().parents[2]


def test_no_asyncio_wait_for_in_the_package_nor_the_harness() -> None:
    found = []
    for path in [*(ROOT / "operator" / "passthrough").rglob("*.py"), *(ROOT / "e2e").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for" and ast.unparse(node.value) == "asyncio":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"asyncio.wait_for loses a cancellation on Python 3.11; use `async with asyncio.timeout(...)`: {found}"


async def test_stopping_tasks_that_end_when_cancelled() -> None:
    ended = []

    async def runs() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("cleaned up")

    tasks = [asyncio.create_task(runs(), name=name) for name in ("agent", "uevents")]
    await asyncio.sleep(0)
    assert await stop_tasks(tasks, grace=5) is True
    assert ended == ["cleaned up", "cleaned up"]


async def test_a_task_that_lost_its_cancellation_is_said_and_not_waited_for(caplog) -> None:
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # what a lost cancellation amounts to

    task = asyncio.create_task(deaf(), name="agent")
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.ERROR, "passthrough.agent"):
        assert await stop_tasks([task], grace=0.3) is False
    assert loop.time() - started < 2
    assert "agent still running 0.3s after it was told to stop" in caplog.text
    release.set()
    await task


async def test_a_task_that_failed_to_start_says_why() -> None:
    async def fails() -> None:
        raise AgentError("the CRDs are not installed")

    task = asyncio.create_task(fails(), name="agent")
    await asyncio.wait([task])
    with pytest.raises(AgentError, match="CRDs"):
        await stop_tasks([task], grace=1)
