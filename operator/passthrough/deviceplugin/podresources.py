"""Which devices the node's pods hold, from the kubelet's PodResources API (v1 `List`).

The agent asks before it gives a device back to its host driver: a device a pod holds must
never be pulled from under its VM. When the kubelet cannot be asked, the answer is "unknown",
never "nothing": callers get PodResourcesUnavailable and give nothing back.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2 as api
from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2_grpc as api_grpc

POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


class PodResourcesUnavailable(RuntimeError):
    """The kubelet's PodResources API could not be asked; which devices are held is unknown."""


async def held_devices(socket: Path = POD_RESOURCES_SOCKET, timeout: float = 2.0) -> dict[str, set[str]]:
    """Resource name -> IDs of the devices that some container of some pod on this node holds."""
    socket = Path(socket)
    if not socket.exists():
        raise PodResourcesUnavailable(f"{socket} does not exist (is the kubelet running?)")
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            answer = await api_grpc.PodResourcesListerStub(channel).List(api.ListPodResourcesRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        raise PodResourcesUnavailable(f"PodResources List on {socket} failed ({exc.code().name}: {exc.details()})") from None
    held: dict[str, set[str]] = {}
    for pod in answer.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.device_ids:
                    held.setdefault(devices.resource_name, set()).update(devices.device_ids)
    return held
