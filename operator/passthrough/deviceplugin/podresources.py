"""Which devices the node's pods hold, from the kubelet's PodResources API (v1 `List`).

The agent asks before it gives a device back to its host driver: a device a pod holds must
never be pulled from under its VM. When the kubelet cannot be asked, the answer is "unknown",
never "nothing": callers get PodResourcesUnavailable and give nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2 as api
from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2_grpc as api_grpc

POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


class PodResourcesUnavailable(RuntimeError):
    """The kubelet's PodResources API could not be asked; which devices are held is unknown."""


@dataclass(frozen=True)
class Holder:
    """A pod that holds a device, and under which resource."""

    namespace: str
    pod: str
    resource: str

    def __str__(self) -> str:
        return f"pod {self.namespace}/{self.pod} ({self.resource})"


async def held_devices(socket: Path = POD_RESOURCES_SOCKET, timeout: float = 2.0) -> dict[str, set[str]]:
    """Resource name -> IDs of the devices that some container of some pod on this node holds."""
    held: dict[str, set[str]] = {}
    for device_id, found in (await holders(socket, timeout)).items():
        for holder in found:
            held.setdefault(holder.resource, set()).add(device_id)
    return held


async def holders(socket: Path = POD_RESOURCES_SOCKET, timeout: float = 2.0) -> dict[str, tuple[Holder, ...]]:
    """Device ID -> the pods on this node that hold it, each with the resource it holds it under."""
    socket = Path(socket)
    if not socket.exists():
        raise PodResourcesUnavailable(f"{socket} does not exist (is the kubelet running?)")
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            answer = await api_grpc.PodResourcesListerStub(channel).List(api.ListPodResourcesRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        raise PodResourcesUnavailable(f"PodResources List on {socket} failed ({exc.code().name}: {exc.details()})") from None
    found: dict[str, dict[Holder, None]] = {}
    for pod in answer.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                for device_id in devices.device_ids:
                    found.setdefault(device_id, {})[Holder(pod.namespace, pod.name, devices.resource_name)] = None
    return {device_id: tuple(holders) for device_id, holders in found.items()}
