"""Which devices the node's pods hold, and which every device plugin serves, from the kubelet's
PodResources API (v1 `List`, `GetAllocatableResources`).

The agent asks at every scan: a device a pod holds must never be pulled from under its VM, nor
handed to a second pod under another resource; a device another plugin serves is not ours.
When the kubelet cannot be asked, the answer is "unknown", never "nothing": callers get
PodResourcesUnavailable and give nothing back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from passthrough.deviceplugin.holder import Holder
from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2 as api
from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2_grpc as api_grpc

log = logging.getLogger(__name__)

POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


class PodResourcesUnavailable(RuntimeError):
    """The kubelet's PodResources API could not be asked; which devices are held is unknown."""


@dataclass(frozen=True)
class KubeletView:
    holders: dict[str, tuple[Holder, ...]]  # device ID -> the pods that hold it
    allocatable: dict[str, tuple[str, ...]]  # device ID -> every resource a plugin (ours or not) serves it under


async def view(socket: Path = POD_RESOURCES_SOCKET, timeout: float = 2.0) -> KubeletView:
    """Who holds what, and which resource every served device is under."""
    socket = Path(socket)
    if not socket.exists():
        raise PodResourcesUnavailable(f"{socket} does not exist (is the kubelet running?)")
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = api_grpc.PodResourcesListerStub(channel)
            answer = await stub.List(api.ListPodResourcesRequest(), timeout=timeout)
            served = await _allocatable(stub, timeout)
    except grpc.aio.AioRpcError as exc:
        raise PodResourcesUnavailable(f"PodResources on {socket} failed ({exc.code().name}: {exc.details()})") from None
    return KubeletView(_holders(answer), served)


class Asker:
    """Asks the kubelet's PodResources each scan; when it cannot answer, says so once (with
    `consequence`: what the caller does meanwhile), and again only after it answered in between."""

    def __init__(self, socket: Path, consequence: str) -> None:
        self.socket = Path(socket)
        self.consequence = consequence
        self._said = False

    async def ask(self) -> KubeletView | None:
        try:
            found = await view(self.socket)
        except PodResourcesUnavailable as exc:
            if not self._said:
                self._said = True
                log.warning("%s (%s); %s", "cannot ask the kubelet which devices pods hold and plugins serve", exc, self.consequence)
            return None
        self._said = False
        return found


async def _allocatable(stub: api_grpc.PodResourcesListerStub, timeout: float) -> dict[str, tuple[str, ...]]:
    try:
        answer = await stub.GetAllocatableResources(api.AllocatableResourcesRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        return {}  # a kubelet older than 1.23, or with the endpoint turned off: other plugins go unseen
    # One device may be served under two names (ours and another plugin's): keep both, or the
    # other one hides behind ours.
    served: dict[str, tuple[str, ...]] = {}
    for devices in answer.devices:
        for device_id in devices.device_ids:
            served[device_id] = (*served.get(device_id, ()), devices.resource_name)
    return served


def _holders(answer: api.ListPodResourcesResponse) -> dict[str, tuple[Holder, ...]]:
    found: dict[str, dict[Holder, None]] = {}
    for pod in answer.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                for device_id in devices.device_ids:
                    found.setdefault(device_id, {})[Holder(pod.namespace, pod.name, devices.resource_name)] = None
    return {device_id: tuple(holders) for device_id, holders in found.items()}
