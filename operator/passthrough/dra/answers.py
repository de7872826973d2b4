"""The binding conditions' answers (KEP-5007): each claim allocated a device of this driver here
gets, as soon as the allocation is written and before the pod reaches the node, its device's
whole IOMMU group on vfio-pci and `VFIOBound`, or `VFIOBindFailed` with why (the scheduler then
takes the allocation back, and the device is tainted for a while so its next try goes elsewhere)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from passthrough.dra import binding as dra_binding
from passthrough.dra.preparer import BIND_FAILED_HOLD, PrepareError, Preparer
from passthrough.kube.client import APPLY_PATCH, ApiError

log = logging.getLogger(__name__)

RETRY = 5.0  # seconds before a claim whose answer could not be written is tried again


class BindingAnswers:
    def __init__(self, session: Any, node_name: str, preparer: Preparer, published: asyncio.Event,
                 trigger: Callable[[], None]) -> None:  # fmt: skip
        self.session, self.node_name, self.preparer, self.published, self.trigger = session, node_name, preparer, published, trigger
        self._waiting: dict[str, dra_binding.Waiting] = {}  # uid -> a claim with devices to answer
        self._waiting_changed = asyncio.Event()

    def claim_changed(self, old: dra_binding.Waiting | None, new: dra_binding.Waiting | None) -> None:
        if new is not None and new.devices:
            self._waiting[new.uid] = new
            self._waiting_changed.set()
        elif old is not None:
            self._waiting.pop(old.uid, None)

    async def run(self) -> None:
        """Each claim allocated a device of ours here with our binding condition gets its answer:
        the group on vfio-pci and VFIOBound, or VFIOBindFailed with why."""
        while True:
            await self._waiting_changed.wait()
            self._waiting_changed.clear()
            for uid, claim in list(self._waiting.items()):
                try:
                    async with asyncio.timeout(60):
                        await self.answer(claim)
                except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                    log.warning("answering the binding conditions of claim %s/%s failed (%s: %s); again in %.0fs",
                                claim.namespace, claim.name, type(exc).__name__, exc, RETRY)  # fmt: skip
                    asyncio.get_running_loop().call_later(RETRY, self._waiting_changed.set)
                    continue
                if self._waiting.get(uid) is claim:
                    del self._waiting[uid]  # answered; a later change of the claim comes back through the cache

    async def answer(self, claim: dra_binding.Waiting) -> None:
        await self.published.wait()  # the inventory is the slice the scheduler allocated from
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        answers: dict[str, dict[str, Any]] = {}
        async with self.preparer.lock:
            elsewhere = await self.preparer.elsewhere_now()
            items = []
            for _, device, admin_access in claim.devices:
                try:
                    items.append(self.preparer.judge(claim.namespace, claim.uid, device, admin_access, elsewhere))
                except PrepareError as exc:
                    answers[device] = dra_binding.condition(False, str(exc), now, reason="Refused")
            if not answers:
                try:
                    groups = await self.preparer.bind_groups(items)
                except PrepareError as exc:
                    failed = [i for i in items if i.device.iommu_group == getattr(exc, "group", None)]
                    for item in failed:
                        self.preparer.bind_failed[item.device.address] = time.monotonic()
                    answers = {item.name: dra_binding.condition(False, str(exc), now, reason="BindFailed") for item in items}
                    asyncio.get_running_loop().call_later(BIND_FAILED_HOLD + 1, self.trigger)  # past the hold: untainted
                    self.trigger()  # tainted now, so the scheduler's next try goes elsewhere
                else:
                    on = {group: members for group, members in groups}
                    answers = {item.name: dra_binding.condition(True, f"IOMMU group {item.device.iommu_group} "
                                                                f"({', '.join(on[item.device.iommu_group])}) is on vfio-pci", now)
                               for item in items}  # fmt: skip
        path = f"/apis/resource.k8s.io/v1/namespaces/{claim.namespace}/resourceclaims/{claim.name}/status"
        try:
            await self.session.request("PATCH", path, query={"fieldManager": dra_binding.FIELD_MANAGER, "force": True},
                                       body=dra_binding.status_apply(claim, self.node_name, answers), content_type=APPLY_PATCH)  # fmt: skip
        except ApiError as exc:
            if exc.status in (404, 409):
                return  # deleted or replaced meanwhile: nobody waits for this answer
            raise
        for device, answer in sorted(answers.items()):
            log.info("claim %s/%s device %s: %s=True (%s)", claim.namespace, claim.name, device, answer["type"], answer["message"])
