"""Runs one device plugin per resource and keeps each registered with the kubelet.

The kubelet forgets every plugin when it restarts: it deletes every socket in its
device-plugin directory and creates a new `kubelet.sock`. Plugins that do not notice keep
a capacity of 0 until they are restarted themselves (a known pain of KubeVirt users), so
`run()` watches for exactly that: our sockets gone, or a new kubelet.sock, and then listens
again and registers again. It also polls device health and pushes changes to the kubelet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from passthrough.agent import metrics
from passthrough.deviceplugin.allocation import VFIO_DIR, PluginDevice
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2 as api
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2_grpc as api_grpc
from passthrough.deviceplugin.server import API_VERSION, HEALTHY, SOCKET_PREFIX, UNHEALTHY, Admit, DevicePlugin, socket_name

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
MAX_BACKOFF = 5.0  # seconds between Register attempts while the kubelet refuses or does not answer


@dataclass
class Registration:
    """What the kubelet knows of one resource, for status and metrics."""

    registered: bool = False
    last_error: str = ""  # "" once registered; else why not (yet)
    registrations: int = 0  # successful Register calls, first and after every kubelet restart


def _identity(path: Path) -> tuple[int, int, int] | None:
    # The change time too: a new kubelet.sock may get the inode number of the old one.
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_ctime_ns


class PluginManager:
    """The device plugins of one node: `set_resources` says what to serve, `run` keeps it served."""

    def __init__(
        self,
        plugin_dir: Path,
        health: Callable[[PluginDevice], bool] | None = None,
        health_interval: float = 0.5,
        *,
        poll_interval: float = 0.5,
        register_timeout: float = 5.0,
        vfio_dir: str = VFIO_DIR,
        admit: Admit | None = None,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.admit = admit
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self.health = health
        self.health_interval = health_interval
        self.poll_interval = poll_interval
        self.register_timeout = register_timeout
        self.vfio_dir = vfio_dir
        self._plugins: dict[str, DevicePlugin] = {}
        self._declared: dict[str, list[PluginDevice]] = {}  # as set_resources gave them, before health checks
        self._state: dict[str, Registration] = {}
        self._retry_at: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._sockets: dict[str, int] = {}  # resource -> sockets listened on for it so far (server.socket_name)
        self._kubelet: tuple[int, int, int] | None = None  # identity of the kubelet.sock we last registered with
        self._waiting_logged = False
        self._health_failures: set[str] = set()
        self._lock = asyncio.Lock()  # set_resources, run and close each change plugins whole
        self._closed = False

    # What callers read.

    def registrations(self) -> dict[str, Registration]:
        """Per resource: registered with the current kubelet or not, and the last error."""
        return {name: replace(state) for name, state in self._state.items()}

    def plugin(self, resource_name: str) -> DevicePlugin | None:
        return self._plugins.get(resource_name)

    @property
    def resources(self) -> list[str]:
        return sorted(self._plugins)

    def declared(self, resource_name: str) -> list[PluginDevice]:
        """The devices of a resource as `set_resources` gave them, before health checks."""
        return list(self._declared.get(resource_name, ()))

    # What callers do.

    async def set_resources(self, resources: dict[str, Iterable[PluginDevice]]) -> None:
        """Serve exactly these resources: start and register new ones, update the device lists
        of existing ones, stop (and remove the sockets of) those no longer listed."""
        async with self._lock:
            if self._closed:
                return
            for name in [n for n in self._plugins if n not in resources]:
                await self._plugins.pop(name).stop(farewell=True)
                for table in (self._declared, self._state, self._retry_at, self._backoff):
                    table.pop(name, None)
                log.info("stopped the device plugin of %s", name)
            for name, devices in resources.items():
                self._declared[name] = list(devices)
                served = self._with_health(self._declared[name])
                plugin = self._plugins.get(name)
                if plugin is None:
                    self._plugins[name] = DevicePlugin(name, self.plugin_dir, served, self.vfio_dir, self.admit)
                    self._state[name] = Registration(last_error="not registered yet")
                else:
                    self._log_health_changes(plugin, served)
                    plugin.update(served)
            await self._reconcile()

    async def run(self) -> None:
        """Keep every plugin served and registered until `close()` (or cancellation)."""
        async with self._lock:
            self._remove_stale_sockets()
        health = asyncio.create_task(self._health_loop(), name="device-plugin-health") if self.health else None
        try:
            while not self._closed:
                async with self._lock:
                    if self._closed:
                        break
                    try:
                        await self._reconcile()
                    except Exception:  # never let one surprise end the plugins of the node
                        log.exception("device plugins: unexpected error; trying again")
                await asyncio.sleep(self.poll_interval)
        finally:
            if health is not None:
                health.cancel()
                await asyncio.gather(health, return_exceptions=True)

    async def close(self) -> None:
        """Stop every plugin and remove our sockets; the kubelet sees the resources go."""
        async with self._lock:
            self._closed = True
            for plugin in self._plugins.values():
                await plugin.stop(grace=0)
            self._plugins.clear()
            for state in self._state.values():
                state.registered = False

    # The work.

    async def _reconcile(self) -> None:
        """One pass: listen where our socket is gone, register what the current kubelet lacks."""
        kubelet = _identity(self.kubelet_socket)
        if kubelet is None or not self.plugin_dir.is_dir():
            if not self._waiting_logged:
                self._waiting_logged = True
                log.warning("waiting for the kubelet: %s does not exist; device plugins register once it does", self.kubelet_socket)
            for state in self._state.values():
                state.registered = False
                state.last_error = f"waiting for the kubelet: {self.kubelet_socket} does not exist"
            return
        if self._waiting_logged:
            self._waiting_logged = False
            log.info("the kubelet's %s is there", self.kubelet_socket)
        if kubelet != self._kubelet:
            if self._kubelet is not None:
                log.info("the kubelet restarted (new %s): registering every device plugin again", self.kubelet_socket)
            self._kubelet = kubelet
            for name, state in self._state.items():
                state.registered = False
                self._retry_at[name] = 0.0
                self._backoff[name] = 0.0
        for name, plugin in self._plugins.items():
            state = self._state[name]
            if not plugin.socket_intact():
                if plugin.serving:
                    log.info("the socket of %s (%s) was removed: listening again", name, plugin.socket_path)
                await plugin.stop(grace=0)
                # Never a path the kubelet may still hold for an earlier socket (server.py's docstring).
                generation = self._sockets.get(name, 0)
                self._sockets[name] = generation + 1
                plugin.listen_at(socket_name(name, self.plugin_dir, generation))
                try:
                    await plugin.start()
                except OSError as exc:
                    self._failed(name, str(exc))
                    continue
                state.registered = False
                self._retry_at[name] = 0.0
            if not state.registered and time.monotonic() >= self._retry_at.get(name, 0.0):
                await self._register(name, plugin)

    async def _register(self, name: str, plugin: DevicePlugin) -> None:
        request = api.RegisterRequest(
            version=API_VERSION, endpoint=plugin.endpoint, resource_name=name, options=plugin.options()
        )
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                await api_grpc.RegistrationStub(channel).Register(request, timeout=self.register_timeout)
        except grpc.aio.AioRpcError as exc:
            metrics.REGISTRATION_FAILURES.inc()
            self._failed(name, f"the kubelet refused or did not answer Register ({exc.code().name}: {exc.details()})")
            return
        state = self._state[name]
        state.registered, state.last_error = True, ""
        state.registrations += 1
        metrics.REGISTRATIONS.inc()
        self._backoff[name] = 0.0
        log.info("registered %s with the kubelet (socket %s, %d devices)", name, plugin.endpoint, len(plugin.devices))

    def _failed(self, name: str, message: str) -> None:
        state = self._state[name]
        if message != state.last_error:
            log.warning("device plugin %s: %s; trying again", name, message)
        state.registered, state.last_error = False, message
        backoff = min(max(2 * self._backoff.get(name, 0.0), self.poll_interval), MAX_BACKOFF)
        self._backoff[name] = backoff
        self._retry_at[name] = time.monotonic() + backoff

    def _remove_stale_sockets(self) -> None:
        # Left by an earlier agent; the kubelet would dial them and fail, and they hide nothing of ours.
        ours = {p.socket_path for p in self._plugins.values() if p.serving}
        for path in self.plugin_dir.glob(f"{SOCKET_PREFIX}*.sock"):
            if path not in ours:
                path.unlink(missing_ok=True)
                log.info("removed stale device-plugin socket %s", path)

    # Health.

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval)
            self.refresh()

    def refresh(self) -> None:
        """Ask `health` about every served device now, and tell the kubelet what changed (each
        open ListAndWatch stream at once). Synchronous: never waits behind a registration."""
        for name, plugin in list(self._plugins.items()):
            served = self._with_health(self._declared.get(name, []))
            self._log_health_changes(plugin, served)
            plugin.update(served)

    def _with_health(self, devices: list[PluginDevice]) -> list[PluginDevice]:
        if self.health is None:
            return list(devices)
        return [replace(d, healthy=d.healthy and self._check(d)) for d in devices]

    def _check(self, device: PluginDevice) -> bool:
        try:
            healthy = bool(self.health(device))
        except Exception as exc:  # a check that cannot say means the device cannot be trusted
            if device.id not in self._health_failures:
                self._health_failures.add(device.id)
                log.warning("health check of %s failed (%s): reporting it unhealthy", device.id, exc)
            return False
        self._health_failures.discard(device.id)
        return healthy

    @staticmethod
    def _log_health_changes(plugin: DevicePlugin, served: list[PluginDevice]) -> None:
        before = plugin.devices
        for device in served:
            old = before.get(device.id)
            if old is not None and old.healthy != device.healthy:
                log.info("%s of %s is now %s", device.id, plugin.resource_name, HEALTHY if device.healthy else UNHEALTHY)
