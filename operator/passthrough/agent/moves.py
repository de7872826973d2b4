"""One scan's moves in device-plugin mode: bind and give back as the plan says, then serve what
is bound, in the order that lets no pod be given a device that is leaving; and when to look
again (a refusing driver backs off, a held device is asked about every few seconds)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from passthrough.agent import plan as node_plan
from passthrough.agent import report
from passthrough.agent.handover import Handover, Outcome, held_elsewhere, other_plugin, served_elsewhere
from passthrough.pci.binder import BinderAway
from passthrough.pci.discovery import Discovery

HELD_RECHECK = 5.0  # seconds between asking the kubelet whether a device to give back is still held
BINDER_AWAY_RECHECK = 5.0  # seconds between tries while no binder container answers


class Moves:
    def __init__(self, handover: Handover, node_name: str, rescan_interval: float, wake: Callable[[], None],
                 discover: Callable[[], Awaitable[Discovery]]) -> None:  # fmt: skip
        self.handover, self.node_name, self.rescan_interval = handover, node_name, rescan_interval
        self._wake, self._discover = wake, discover
        self.holders: dict[str, tuple] | None = None  # address -> the pods holding it, this scan (None: unknown)
        self._retry = 0  # consecutive scans whose bind or give-back failed
        self._again: asyncio.TimerHandle | None = None  # the next scan that this work asks for

    async def carry_out(self, discovery: Discovery, assignments: Mapping[str, str], claimed: frozenset[str],
                        node_labels: Mapping[str, str]) -> tuple[Discovery, Outcome]:  # fmt: skip
        """Bind and give back as the plan says, then serve what is bound; returns the scan after."""
        handover = self.handover
        names = {d.address: report.object_name(d, self.node_name) for d in discovery.devices if d.reported}
        in_gpu_mode = node_plan.gpu_mode(node_labels)
        serve_pools = handover.serve_pools
        view = await handover.look()
        self.holders = view.holders if view is not None else None  # reported in status.holders
        others = served_elsewhere(view, handover.plugins.resources)
        context = {"claimed": claimed, "holders": view.holders if view else None, "others": others}
        wanted = node_plan.plan(discovery.devices, assignments, names, in_gpu_mode, serve_pools,
                                ours=handover.bound, locked=handover.locked(), claimed=claimed,
                                others=others)  # fmt: skip
        if wanted.release:
            # Withdrawn from the kubelet, then the kubelet is asked again who holds it: a pod given
            # the device after the first answer is in this one, and no pod gets it from now on.
            # Released on the first answer, a pod admitted in between would lose it under its VM.
            await handover.serve(node_plan.resources(discovery.devices, assignments, names, in_gpu_mode,
                                                     serve_pools, handover.locked(), **context))  # fmt: skip
            view = await handover.look()
            self.holders = context["holders"] = view.holders if view is not None else None
        outcome = await handover.carry_out(wanted, view)
        if outcome.writes:
            # Drivers moved: report what the kernel says now, not what it said before.
            discovery = await self._discover()
        outcome.overrides = handover.override_problems(discovery.devices)
        outcome.unhealthy = dict(handover.unhealthy)
        outcome.others = {a: other_plugin(a, r) for a, r in others.items()}
        serving = node_plan.serving(discovery.devices, assignments, names, in_gpu_mode, serve_pools,
                                    outcome.failures, **context)  # fmt: skip
        for address, holders in serving.blocked.items():
            outcome.waiting[address] = held_elsewhere(address, holders)
        await handover.serve(serving.resources)
        self._look_again(outcome, bool(serving.blocked))
        return discovery, outcome

    def _look_again(self, outcome: Outcome, blocked: bool) -> None:
        if self._again is not None:
            self._again.cancel()
            self._again = None
        loop = asyncio.get_running_loop()
        failures = [*outcome.failures.values(), *outcome.release_failures.values()]
        # A blocked write's own end wakes a scan; what else failed decides when to look again.
        others = [f for f in failures if f.reason != "WriteBlocked"]
        if others and all(isinstance(f, BinderAway) for f in others):
            # No binder container answering (restarting): ask again soon, one may be back any second.
            self._again = loop.call_later(BINDER_AWAY_RECHECK, self._wake)
        elif failures:
            # A refusing driver, vfio-pci not loaded: try again, backing off to the rescan interval.
            delay = min(5 * 2**self._retry, self.rescan_interval)
            self._retry += 1
            self._again = loop.call_later(delay, self._wake)
        else:
            self._retry = 0
            if outcome.held or blocked:
                # Given back once the pod that holds it is gone; the kubelet tells no one, so ask again.
                self._again = loop.call_later(HELD_RECHECK, self._wake)
