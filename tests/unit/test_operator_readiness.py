"""The operator's readiness (controller/main.py): ready once the webhooks listen and the caches
hold their first listing, whether or not this replica leads."""

from __future__ import annotations

import asyncio
import types

import aiohttp

from e2e.cluster import free_ports
from passthrough.controller import main


def memo(**kwargs) -> dict:
    class Memo(dict):
        __getattr__ = dict.__getitem__

    return Memo(**kwargs)


def informer(synced: bool):
    event = asyncio.Event()
    if synced:
        event.set()
    return types.SimpleNamespace(synced=event)


def filled(listening: bool = True, leading: bool = False) -> dict:
    indexed = asyncio.Event()
    indexed.set()
    return memo(webhook_server=types.SimpleNamespace(listening=listening), indexed=indexed,
                node_devices=informer(True), devices=informer(True),
                leadership=types.SimpleNamespace(leading=lambda: leading))  # fmt: skip


async def test_a_standby_with_its_webhooks_listening_and_caches_filled_is_ready():
    assert main._not_ready(filled(leading=False)) == []


async def test_not_ready_until_the_webhooks_listen_and_every_cache_is_filled():
    assert main._not_ready(memo(webhook_server=types.SimpleNamespace(listening=False))) == [
        "the webhook server does not listen yet",
        "Kopf's indexes are not filled yet",
        "the node devices cache has no listing yet",
        "the devices cache has no listing yet",
    ]
    half = filled()
    half["devices"] = informer(False)
    assert main._not_ready(half) == ["the devices cache has no listing yet"]
    assert main._not_ready(filled(listening=False)) == ["the webhook server does not listen yet"]
    without_webhooks = filled()
    without_webhooks["webhook_server"] = None  # --webhook-port 0: nothing to listen for
    assert main._not_ready(without_webhooks) == []


async def test_the_probe_answers_503_with_the_reasons_then_200():
    missing = ["the devices cache has no listing yet"]
    port = free_ports(1)[0]
    runner = await main._serve_readiness(f"http://127.0.0.1:{port}/readyz", lambda: missing)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as answer:
                assert (answer.status, await answer.text()) == (503, "the devices cache has no listing yet\n")
            missing.clear()
            async with http.get(f"http://127.0.0.1:{port}/readyz") as answer:
                assert (answer.status, await answer.text()) == (200, "ok\n")
    finally:
        await runner.cleanup()
