"""One device, one server, as the DRA driver keeps it: which of this node's devices another
server has. The kubelet's PodResources says which devices device plugins serve (in DRA mode none
of theirs is ours), and a watch of this node's ResourceSlices which addresses the other DRA
drivers publish; `dra.others` judges what that means for each device. Such a device and its
IOMMU group leave the slice and are never prepared or bound; the agent's report says
ServedByOtherPlugin (`on_change`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from passthrough.agent.handover import served_elsewhere
from passthrough.deviceplugin.podresources import Asker
from passthrough.dra import others as dra_others
from passthrough.kube.watch import watch_events
from passthrough.pci.discovery import Discovery
from passthrough.pci.vfio import BindError

log = logging.getLogger(__name__)


class OtherServers:
    def __init__(self, session: Any, node_name: str, pod_resources_socket: Path, wake: Callable[[], None]) -> None:
        self.session, self.node_name = session, node_name
        self.wake = wake  # the driver's trigger: a pass follows what changed at once
        self.elsewhere: dict[str, BindError] = {}  # address -> why another server has it, as last judged
        self.on_change: Callable[[], None] | None = None  # called when `elsewhere` changed (the agent reports it)
        self.slices: dict[str, dict[str, str]] = {}  # other drivers' slice of this node -> address -> who
        self.listed = asyncio.Event()  # set once the slices were listed
        self._pod_resources = Asker(Path(pod_resources_socket), "publishing as if no other device plugin served any device")

    async def served_by_plugins(self) -> dict[str, str]:
        """Address -> the device plugin resources the kubelet serves it under (none is ours in DRA
        mode). When the kubelet cannot answer, none, as the device-plugin mode takes it, said once."""
        return served_elsewhere(await self._pod_resources.ask(), ())

    def judge(self, discovery: Discovery, plugins: dict[str, str]) -> dict[str, BindError]:
        """Keep what other servers have (`elsewhere`), saying what changed; returns it."""
        found = dra_others.elsewhere(discovery.devices, plugins, dra_others.merged(self.slices.values()))
        if {a: str(e) for a, e in found.items()} != {a: str(e) for a, e in self.elsewhere.items()}:
            for address in sorted(found.keys() - self.elsewhere.keys()):
                log.warning("left %s out of the ResourceSlice: %s", address, found[address])
            for address in sorted(self.elsewhere.keys() - found.keys()):
                log.info("no other server has %s now: it is ours to publish again", address)
            self.elsewhere = found
            self.wake()  # found between passes (at a prepare): the slice follows at once
            if self.on_change is not None:
                self.on_change()
        return found

    async def now(self, discovery: Discovery | None) -> dict[str, BindError]:
        """What other servers have, asked again: a plugin may have registered since the last pass."""
        if discovery is None:
            return dict(self.elsewhere)
        return self.judge(discovery, await self.served_by_plugins())

    async def watch(self) -> None:
        """The other DRA drivers' slices of this node (a list, then a watch from it; again after
        trouble): a change of the addresses they publish asks for a pass."""
        path = "/apis/resource.k8s.io/v1/resourceslices"
        selector = f"spec.nodeName={self.node_name}"
        backoff = 1.0
        while True:
            try:
                listed = await self.session.request("GET", path, query={"fieldSelector": selector})
                self.slices = {o["metadata"]["name"]: dra_others.by_other_drivers([o], self.node_name)
                               for o in listed.get("items") or []}  # fmt: skip
                self.listed.set()
                self.wake()
                version = (listed.get("metadata") or {}).get("resourceVersion", "")
                async for kind, obj in watch_events(self.session, path, fieldSelector=selector, resourceVersion=version):
                    if kind != "BOOKMARK" and self.seen(kind, obj):
                        self.wake()
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a dropped connection, an expired version: list again
                log.debug("watch of %s's ResourceSlices ended (%s); again in %.0fs", self.node_name, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)

    def seen(self, kind: str, body: dict[str, Any]) -> bool:
        """Take one watch event in; True when the addresses other drivers publish changed."""
        name = (body.get("metadata") or {}).get("name", "")
        before = self.slices.get(name, {})
        now = {} if kind == "DELETED" else dra_others.by_other_drivers([body], self.node_name)
        if now:
            self.slices[name] = now
        else:
            self.slices.pop(name, None)
        return now != before
