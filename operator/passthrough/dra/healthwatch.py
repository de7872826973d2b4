"""The DRA driver's watch of its devices' health: every device a pass would publish or a
prepared claim holds, read every HEALTH_POLL seconds in threads (`pci.health.Health.problems`,
never in the event loop: a config-space read waits while the kernel resets the device, and the
driver's gRPC answers and passes go on meanwhile); what the slice makes of it (`unhealthy`: a
taint, or withdrawn when gone) and what the kubelet hears (`device_health`, its stream)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from passthrough.dra import health as dra_health
from passthrough.pci.health import Health

log = logging.getLogger(__name__)

HEALTH_POLL = 0.5  # seconds between health reads of the published devices (cheap: no device lock)


class HealthWatch:
    def __init__(self, node_name: str, health: Health) -> None:
        self.node_name, self.health = node_name, health
        self.unhealthy: dict[str, str] = {}  # address -> why, of published devices tainted or withdrawn for their health
        self.device_health: dict[str, str] = {}  # slice device name -> its problem ("" = fine), as the kubelet hears it
        self._changed = asyncio.Event()  # set (and replaced) when device_health changes
        self.closing = asyncio.Event()  # set at shutdown: health streams end

    async def judge(self, candidates: Mapping[str, int], prepared: Iterable[dict[str, Any]]) -> bool:
        """Read the health of every candidate (address -> IOMMU group, what a pass would publish)
        and every prepared device; True when the slice's share of it changed. An unhealthy device
        is tainted in the slice (no new claim gets it; NoExecute evicts the pods of one that fell
        off the bus), one gone from the bus withdrawn, until it recovers (`dra.health.taint`);
        the kubelet hears of every change."""
        watched = dra_health.watched(candidates, list(prepared), self.node_name)
        read = await self.health.problems({address: group for address, group in watched.values()}, binding=False)
        problems = {name: read[address] for name, (address, _) in watched.items()}
        self.report(problems)
        found = {address: problems[name] for name, (address, _) in watched.items()
                 if problems[name] and address in candidates}  # fmt: skip
        if found == self.unhealthy:
            return False
        for address, why in found.items():
            if self.unhealthy.get(address) != why:
                if (mark := dra_health.taint(why)) is None:
                    log.warning("withdrew %s from the ResourceSlice: %s", address, why)
                else:
                    log.warning("tainted %s %s=%s:%s in the ResourceSlice: %s", address, *mark, why)
        for address in self.unhealthy.keys() - found.keys():
            log.info("%s is healthy again: back in the ResourceSlice, untainted", address)
        self.unhealthy = found
        return True

    def report(self, problems: dict[str, str]) -> None:
        """Keep what the kubelet hears; wake its streams when that changed."""
        if problems == self.device_health:
            return
        for name in sorted(problems.keys() & self.device_health.keys()):
            if bool(problems[name]) != bool(self.device_health[name]):
                log.info("telling the kubelet %s is %s", name, f"unhealthy: {problems[name]}" if problems[name] else "healthy")
        self.device_health = problems
        self._changed.set()
        self._changed = asyncio.Event()

    async def stream(self):
        """The kubelet's health stream: every device's health at once, then again on each change
        and every `dra_health.RESEND` seconds (the kubelet counts a device it has not heard of
        within the timeout as Unknown); ends when the driver shuts down."""
        log.info("the kubelet watches the health of %d device(s)", len(self.device_health))
        while not self.closing.is_set():
            changed = self._changed
            yield dra_health.response(self.node_name, self.device_health, time.time())
            await first(changed, self.closing, timeout=dra_health.RESEND)


async def first(*events: asyncio.Event, timeout: float) -> None:
    """Until one of `events` is set, or `timeout` seconds pass."""
    waits = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
