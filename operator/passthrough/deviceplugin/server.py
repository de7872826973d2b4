"""One kubelet device plugin (v1beta1): one resource name served on one unix socket.

The kubelet dials the socket after `Register`, streams the device list from ListAndWatch and
calls Allocate when a container that asks for the resource starts. Registration and
restarts are `manager`'s job; this module only serves.

Socket file names (in the kubelet's device-plugin directory): `passthrough-<resource>.sock`
with `/` turned into `_` (`passthrough-nvidia.com_GA102GL_A10.sock`), unique because a valid
resource name has one `/` and no `_` in its domain. A unix socket path has at most 107 bytes
(sun_path holds 108 with the NUL), so when the readable name would not fit, the file is
`passthrough-<first 16 hex digits of sha1(resource name)>.sock` instead. Under
/var/lib/kubelet/device-plugins/ that happens from 59 characters of resource name on, which
includes every `passthrough.io/pci-<40 hex>` exclusive resource.

A resource served again (withdrawn and back, or its socket removed) listens on a new file,
`+1`, `+2`, ... before `.sock`: the kubelet keys a plugin by resource and socket path, and a
registration at the path of one it has not yet let go of is refused ("device plugin already
connected"); the kubelet's clean-up of the refused one then forgets the old connection too, so
every later registration at that path is refused until the kubelet restarts (kubelet 1.37.2,
pkg/kubelet/cm/devicemanager: `PluginConnected`, `deregisterClient`).
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from pathlib import Path

import grpc

from passthrough import unixgrpc
from passthrough.agent import metrics
from passthrough.deviceplugin.allocation import VFIO_DIR, AllocationError, PluginDevice, allocate_response, preferred_allocation
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2 as api
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2_grpc as api_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
HEALTHY = "Healthy"  # the kubelet's pluginapi.Healthy / Unhealthy
UNHEALTHY = "Unhealthy"
SOCKET_PREFIX = "passthrough-"
UNIX_PATH_MAX = 108  # sizeof(sun_path), the terminating NUL included


# (resource name, device IDs) -> "" to allow the allocation, or why it is refused: the kubelet
# knows resource names, not namespaces, so the agent judges who asks.
Admit = Callable[[str, list[str]], Awaitable[str]]


def socket_name(resource_name: str, plugin_dir: Path, generation: int = 0) -> str:
    """The socket file name of a resource in plugin_dir (see the module's docstring); from the
    second socket of the resource on (`generation` 1, 2, ...), with `+<generation>` added (no
    resource name has a `+`, so no other resource's name can be the same)."""
    suffix = f"+{generation}" if generation else ""
    readable, hashed = (f"{stem}{suffix}.sock" for stem in _stems(resource_name))
    return readable if len(os.fsencode(Path(plugin_dir) / readable)) < UNIX_PATH_MAX else hashed


def live_socket(plugin_dir: Path, resource_name: str) -> Path | None:
    """The socket a resource is served on now, of those `socket_name` gives (its latest
    generation that is a socket), or None: for tools and tests that dial a plugin directly."""
    found: list[tuple[int, Path]] = []
    for stem in _stems(resource_name):
        named = re.compile(rf"{re.escape(stem)}(?:\+(\d+))?\.sock")
        for path in Path(plugin_dir).glob(f"{glob.escape(stem)}*.sock"):
            if (match := named.fullmatch(path.name)) and path.is_socket():
                found.append((int(match[1] or 0), path))
    return max(found)[1] if found else None


def _stems(resource_name: str) -> tuple[str, str]:
    return (f"{SOCKET_PREFIX}{resource_name.replace('/', '_')}",
            f"{SOCKET_PREFIX}{hashlib.sha1(resource_name.encode()).hexdigest()[:16]}")  # fmt: skip


def device_message(device: PluginDevice) -> api.Device:
    message = api.Device(ID=device.id, health=HEALTHY if device.healthy else UNHEALTHY)
    if device.numa_node >= 0:
        message.topology.nodes.add(ID=device.numa_node)
    return message


class DevicePlugin(api_grpc.DevicePluginServicer):
    """The DevicePlugin service of one resource, and the gRPC server it runs in."""

    def __init__(
        self,
        resource_name: str,
        plugin_dir: Path,
        devices: Iterable[PluginDevice] = (),
        vfio_dir: str = VFIO_DIR,
        admit: Admit | None = None,
    ) -> None:
        self.resource_name = resource_name
        self.admit = admit
        self.plugin_dir = Path(plugin_dir)
        self.endpoint = socket_name(resource_name, self.plugin_dir)
        self.socket_path = self.plugin_dir / self.endpoint
        self.vfio_dir = vfio_dir
        self._devices = self._keyed(devices)
        self._watchers: set[asyncio.Event] = set()
        self._server: grpc.aio.Server | None = None
        self._stopping = False
        # (st_dev, st_ino, st_ctime_ns) of the socket we bound: a new file may reuse the inode number.
        self.socket_identity: tuple[int, int, int] | None = None

    @staticmethod
    def _keyed(devices: Iterable[PluginDevice]) -> dict[str, PluginDevice]:
        return {d.id: d for d in sorted(devices, key=lambda d: d.id)}

    @property
    def devices(self) -> dict[str, PluginDevice]:
        return dict(self._devices)

    @property
    def serving(self) -> bool:
        return self._server is not None

    def options(self) -> api.DevicePluginOptions:
        return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def update(self, devices: Iterable[PluginDevice]) -> bool:
        """Serve this device list from now on; every open ListAndWatch stream gets it at once.

        Returns whether anything changed (an equal list wakes no stream).
        """
        keyed = self._keyed(devices)
        if keyed == self._devices:
            return False
        self._devices = keyed
        for wake in self._watchers:
            wake.set()
        return True

    def listen_at(self, endpoint: str) -> None:
        """The socket file (in plugin_dir) the next `start` listens on."""
        if self._server is None:
            self.endpoint, self.socket_path = endpoint, self.plugin_dir / endpoint

    async def start(self) -> None:
        """Listen on the socket (replacing a stale file of the same name) and serve."""
        if self._server is not None:
            return
        try:
            server = await unixgrpc.serve(self.socket_path, self, (api_grpc.add_DevicePluginServicer_to_server,))
        except OSError as exc:
            raise OSError(f"{self.resource_name}: {exc}") from exc
        self._stopping = False
        self._server = server
        self.socket_identity = self._identity()

    async def stop(self, grace: float = 0.2, farewell: bool = False) -> None:
        """Stop serving: end the ListAndWatch streams (each sends the list once more), stop the
        server, remove our socket file. `farewell`: the resource is withdrawn (its device vanished,
        or moved to another resource), so that last list says every device is Unhealthy: the
        kubelet hears it in the stream, before it notices the stream's end."""
        server, self._server = self._server, None
        if server is not None:
            if farewell:
                self._devices = {i: replace(d, healthy=False) for i, d in self._devices.items()}
            self._stopping = True
            for wake in self._watchers:
                wake.set()
            await server.stop(grace)
        self._remove_socket()

    def _remove_socket(self) -> None:
        # Only the file we bound: after a kubelet restart the name may already be someone else's.
        if self.socket_identity is not None and self._identity() == self.socket_identity:
            self.socket_path.unlink(missing_ok=True)
        self.socket_identity = None

    def socket_intact(self) -> bool:
        """Whether the socket file we listen on is still there (the kubelet deletes it on restart)."""
        return self.socket_identity is not None and self._identity() == self.socket_identity

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            stat = self.socket_path.stat()
        except OSError:
            return None
        return stat.st_dev, stat.st_ino, stat.st_ctime_ns

    def list_response(self) -> api.ListAndWatchResponse:
        return api.ListAndWatchResponse(devices=[device_message(d) for d in self._devices.values()])

    # The DevicePlugin service.

    async def GetDevicePluginOptions(self, request, context) -> api.DevicePluginOptions:
        return self.options()

    async def ListAndWatch(self, request, context):
        wake = asyncio.Event()
        self._watchers.add(wake)
        try:
            while True:
                wake.clear()  # before reading the list, so an update() from here on sends again
                yield self.list_response()
                if self._stopping:  # the list as it was at the stop went out: the stream ends
                    return
                await wake.wait()
        finally:
            self._watchers.discard(wake)

    async def GetPreferredAllocation(self, request, context) -> api.PreferredAllocationResponse:
        devices = self._devices
        return api.PreferredAllocationResponse(
            container_responses=[
                api.ContainerPreferredAllocationResponse(
                    deviceIDs=preferred_allocation(r.available_deviceIDs, r.must_include_deviceIDs, r.allocation_size, devices)
                )
                for r in request.container_requests
            ]
        )

    async def Allocate(self, request, context) -> api.AllocateResponse:
        responses = []
        try:
            for container in request.container_requests:
                refusal = await self.admit(self.resource_name, list(container.devices_ids)) if self.admit else ""
                if refusal:
                    raise AllocationError(refusal)
                allocation = allocate_response(self.resource_name, container.devices_ids, self._devices, self.vfio_dir)
                responses.append(
                    api.ContainerAllocateResponse(
                        envs=allocation.envs,
                        devices=[
                            api.DeviceSpec(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
                            for d in allocation.devices
                        ],
                    )
                )
        except AllocationError as exc:
            metrics.ALLOCATIONS.labels(metrics.resource_kind(self.resource_name), "refused").inc()
            log.warning("refused Allocate of %s: %s", self.resource_name, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.ALLOCATIONS.labels(metrics.resource_kind(self.resource_name), "ok").inc(len(responses))
        for response in responses:
            log.info("allocated %s", ", ".join(f"{k}={v}" for k, v in response.envs.items()))
        return api.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request, context) -> api.PreStartContainerResponse:
        return api.PreStartContainerResponse()
