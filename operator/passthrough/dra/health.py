"""What the DRA driver tells of its devices' health: to the kubelet (KEP-4680, the
DRAResourceHealth stream), which devices it speaks for and the report it sends; to the scheduler,
the device's taint in the ResourceSlice (`taint`). Pure; the driver reads the hardware.

The kubelet takes each report as the driver's whole list: a device left out of it, or not
reported again within the timeout, reads as Unknown on the pods that hold it. So every report
names every device a claim may hold here, and the driver sends it again well within the timeout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from passthrough.dra.kubeletapi.drahealth_v1 import api_pb2 as health
from passthrough.dra.slice import device_name

SERVICE = health.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name  # "v1.DRAResourceHealth", as registration lists it
TIMEOUT = 30  # seconds the kubelet trusts a report for (its default, said out loud)
RESEND = 10.0  # seconds between reports when nothing changes: well within TIMEOUT
MESSAGE_MAX = 1024  # the kubelet cuts a longer message


TAINT_KEY = "passthrough.io/unhealthy"
NO_SCHEDULE, NO_EXECUTE = "NoSchedule", "NoExecute"
# A device whose IOMMU group would not go to vfio-pci when a claim was allocated it (`dra.binding`):
# no claim is allocated it for a while, so the scheduler's next try goes elsewhere.
BIND_FAILED_TAINT = (TAINT_KEY, "VFIOBindFailed", NO_SCHEDULE)
# The hardware's words (`pci.health.Health.hardware_problem`) for a device that is gone or fell off.
VANISHED, FELL_OFF = "vanished from the bus", "fell off the bus"


def taint(problem: str) -> tuple[str, str, str] | None:
    """The taint (key, value, effect) of a device with `problem` ("" = healthy: none) in the
    slice: NoSchedule (no new claim is allocated it; the pods that hold it hear why through the
    health stream), NoExecute when it fell off the bus (kube-controller-manager evicts the pods
    of the claims that hold it: their VM has lost the device). None too for a device gone from
    the bus: that one leaves the slice."""
    if not problem or VANISHED in problem:
        return None
    if FELL_OFF in problem:
        return TAINT_KEY, "FellOffBus", NO_EXECUTE
    if "link is down" in problem:
        return TAINT_KEY, "LinkDown", NO_SCHEDULE
    if "AER" in problem:
        return TAINT_KEY, "AERErrors", NO_SCHEDULE
    return TAINT_KEY, "Unhealthy", NO_SCHEDULE


def watched(candidates: Mapping[str, int], prepared: Iterable[Mapping[str, Any]], pool: str) -> dict[str, tuple[str, int]]:
    """Slice device name -> (PCI address, IOMMU group) of every device whose health the kubelet
    hears: those the slice offers or withdrew for their health (`candidates`, address -> group),
    and those a prepared claim holds (a device unassigned or gone from the bus since is still in
    a pod; `prepared`: their devices as the checkpoint keeps them)."""
    found = {device_name(address): (address, group) for address, group in candidates.items()}
    for device in prepared:
        if device.get("pool") == pool and device.get("name") and device.get("address"):
            found.setdefault(device["name"], (device["address"], int(device.get("iommu_group", -1))))
    return found


def response(pool: str, problems: Mapping[str, str], now: float) -> health.NodeWatchResourcesResponse:
    """The report: each device (name -> its problem, "" when fine) Healthy, or Unhealthy with
    the problem as its message; `now`: Unix time of the reading."""
    return health.NodeWatchResourcesResponse(
        devices=[
            health.DeviceHealth(
                device=health.DeviceIdentifier(pool_name=pool, device_name=name),
                health=health.UNHEALTHY if problem else health.HEALTHY,
                last_updated_time=int(now),
                health_check_timeout_seconds=TIMEOUT,
                message=_cut(problem),
            )
            for name, problem in sorted(problems.items())
        ]
    )


def _cut(message: str) -> str:
    return message if len(message) <= MESSAGE_MAX else message[: MESSAGE_MAX - 3] + "..."
