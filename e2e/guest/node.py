"""A node of the local control plane inside the guest: the real kubelet and the real agent on a
real kernel, talking to the host's API server through QEMU's user network.

The guest reaches the host's loopback as 10.0.2.2, an address the API server's certificate does
not name; the guest's kubeconfig says which name to check instead (`tls-server-name`), and
the guest's /etc/hosts (its own overlay, not the host's) gives the kubelet harness's stdlib
client that name. The kubelet is e2e/kubelet.py's KubeletNode, run in the command server's
process in the guest; the guest's cgroups and /proc/sys are the throwaway kernel's own.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import LocalCluster
from e2e.guest.machine import Guest, GuestProcess

HOST = "10.0.2.2"  # the host's loopback, seen from the guest (QEMU's user network)
SERVER_NAME = "kubernetes.default.svc"  # a name on the local control plane's serving certificate

_KUBELET_START = """
from pathlib import Path
from e2e.cluster import LocalCluster
from e2e.kubelet import KubeletNode
cluster = LocalCluster(workdir=Path(args['dir']), bin_dir=Path(args['bin_dir']), server=args['server'], token=args['token'])
node = KubeletNode(cluster, args['name'], workdir=args['workdir'])
state['kubelet:' + args['name']] = node
node.start(timeout=args['limit'])
result = {'device_plugin_dir': str(node.device_plugin_dir), 'pod_resources_socket': str(node.pod_resources_socket)}
"""
_KUBELET_STOP = """
node = state.pop('kubelet:' + args['name'], None)
if node is not None:
    node.stop()
"""
_DRIVERS = """
import os, time
def drivers():
    found = {}
    for address in args['addresses']:
        try:  # the link comes and goes while a driver binds or unbinds
            found[address] = os.path.basename(os.readlink(f'/sys/bus/pci/devices/{address}/driver'))
        except OSError:
            found[address] = ''
    return found
started = time.monotonic()
deadline = started + args['limit']
while True:
    now = drivers()
    if args['want'] is None or now == args['want'] or time.monotonic() > deadline:
        break
    time.sleep(0.05)
result = {'drivers': now, 'seconds': time.monotonic() - started}
"""


def wait(check: Callable[[], Any], timeout: float, what: str, node: GuestNode | None = None) -> Any:
    """Poll `check` from the host until it returns something truthy; AssertionError naming `what`
    (and the tail of `node`'s agent log) on a timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            log = f"\n--- agent log:\n{node.agent.output(40)}" if node is not None and node.agent else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{log}")
        time.sleep(0.5)


def guest_kubeconfig(cluster: LocalCluster, path: Path) -> Path:
    """The cluster's admin kubeconfig as the guest must use it: the server at 10.0.2.2."""
    port = urllib.parse.urlsplit(cluster.server).port
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {
            "server": f"https://{HOST}:{port}",
            "tls-server-name": SERVER_NAME,
            "certificate-authority-data": base64.b64encode(cluster.ca_file.read_bytes()).decode(),
        }}],  # fmt: skip
        "users": [{"name": "admin", "user": {"token": cluster.token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
        "current-context": "local",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def drivers(guest: Guest, addresses: list[str]) -> dict[str, str]:
    """Each address's driver in the guest ("" none)."""
    return guest.python(_DRIVERS, addresses=addresses, want=None, limit=0)["drivers"]


def wait_drivers(guest: Guest, want: dict[str, str], timeout: float = 120.0) -> float:
    """Wait, polling in the guest, until each address has the driver `want` names; the seconds
    it took (measured in the guest). AssertionError with what is there on a timeout."""
    answer = guest.python(_DRIVERS, addresses=list(want), want=want, limit=timeout, timeout=timeout + 30)
    if answer["drivers"] != want:
        raise AssertionError(f"drivers after {timeout:.0f}s: {answer['drivers']}, expected {want}")
    return answer["seconds"]


class GuestNode:
    """Node `name` in the guest: start_kubelet() (optional), start_agent(), and its objects."""

    def __init__(self, guest: Guest, cluster: LocalCluster, name: str) -> None:
        self.guest, self.cluster, self.name = guest, cluster, name
        self.dir = guest.share / f"node-{name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "pki").mkdir(exist_ok=True)
        shutil.copy(cluster.ca_file, self.dir / "pki" / "ca.crt")  # where a LocalCluster keeps it
        self.kubeconfig = guest_kubeconfig(cluster, self.dir / "kubeconfig")
        # Without a kubelet, paths nobody answers on (the agent then gives nothing back).
        self.device_plugin_dir = f"/run/{name}/device-plugins"
        self.pod_resources_socket = f"/run/{name}/pod-resources.sock"
        self.kubelet = False
        self.agent: GuestProcess | None = None
        self.timings: dict[str, float] = {}

    def start_kubelet(self, timeout: float = 300) -> None:
        """The real kubelet (and the fake runtime) in the guest; returns once the Node is Ready."""
        self.guest.sh(f"grep -q ' {SERVER_NAME}$' /etc/hosts || echo '{HOST} {SERVER_NAME}' >> /etc/hosts")
        port = urllib.parse.urlsplit(self.cluster.server).port
        started = time.monotonic()
        paths = self.guest.python(
            _KUBELET_START,
            timeout=timeout + 60,
            limit=timeout,
            dir=str(self.dir),
            bin_dir=str(self.cluster.bin_dir),
            server=f"https://{SERVER_NAME}:{port}",
            token=self.cluster.token,
            name=self.name,
            workdir=f"/tmp/kl-{self.name}"[:40],  # short: plugin socket paths have at most 107 bytes
        )  # fmt: skip
        self.timings["kubelet start"] = time.monotonic() - started
        self.device_plugin_dir, self.pod_resources_socket = paths["device_plugin_dir"], paths["pod_resources_socket"]
        self.kubelet = True

    def ensure_node(self) -> None:
        """The Node object, where no kubelet registers it."""
        manifest = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name}}
        if self.cluster.kubectl("get", "node", self.name, check=False).returncode != 0:
            self.cluster.kubectl("create", "-f", "-", input=json.dumps(manifest))

    def start_agent(self, *args: str) -> GuestProcess:
        """`passthrough agent` in the guest over its real /sys and /dev, the venv's python called directly."""
        argv = [
            str(self.guest.python_path), "-m", "passthrough.cli", "agent", f"--node-name={self.name}",
            f"--kubeconfig={self.kubeconfig}", "--sysfs-root=/sys", "--proc-root=/proc", "--dev-root=/dev",
            f"--device-plugin-dir={self.device_plugin_dir}", f"--pod-resources-socket={self.pod_resources_socket}",
            f"--state-dir=/var/lib/passthrough-{self.name}", *args,
        ]  # fmt: skip
        self.guest.run("mkdir", "-p", self.device_plugin_dir)
        self.agent = self.guest.spawn(f"agent-{self.name}", argv, env={"PYTHONUNBUFFERED": "1"})
        return self.agent

    def devices(self) -> dict[str, dict[str, Any]]:
        """This node's NodePCIDevices, by PCI address."""
        listing = self.cluster.kubectl("get", "nodepcidevices", "-l", f"passthrough.io/node={self.name}", "-o", "json")
        items = json.loads(listing.stdout)["items"]
        return {item["status"]["attributes"]["pciAddress"]: item for item in items if item.get("status", {}).get("attributes")}

    def stop(self) -> str:
        """Stop the agent and the kubelet, delete the Node and its devices; the agent's log tail."""
        tail = ""
        if self.agent is not None:
            self.agent.stop()
            tail = self.agent.output(60)
            self.agent = None
        if self.kubelet:
            self.guest.python(_KUBELET_STOP, name=self.name, timeout=120)
            self.kubelet = False
        self.cluster.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false", check=False)
        self.cluster.kubectl(
            "delete", "nodepcidevices", "-l", f"passthrough.io/node={self.name}", "--wait=false", check=False
        )
        return tail


_ALLOCATE = """
from pathlib import Path
import grpc
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2 as api, api_pb2_grpc as api_grpc
from passthrough.deviceplugin.server import live_socket
plugin_dir = Path(args['plugin_dir'])
socket = live_socket(plugin_dir, args['resource'])
with grpc.insecure_channel(f'unix://{socket}') as channel:
    request = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=args['ids'])])
    reply = api_grpc.DevicePluginStub(channel).Allocate(request, timeout=60)
(container,) = reply.container_responses
result = {
    'socket': str(socket),
    'envs': dict(container.envs),
    'devices': [{'container_path': d.container_path, 'host_path': d.host_path, 'permissions': d.permissions}
                for d in container.devices],
}
"""


def allocate(guest: Guest, plugin_dir: str, resource: str, ids: list[str]) -> dict[str, Any]:
    """Allocate over the resource's device-plugin socket in the guest, as the kubelet calls it:
    {'socket', 'envs', 'devices'} of the one container asked for."""
    return guest.python(_ALLOCATE, plugin_dir=plugin_dir, resource=resource, ids=ids, timeout=120)


def condition(device: dict[str, Any], kind: str) -> dict[str, Any]:
    """The condition `kind` of a NodePCIDevice ({} when it has none)."""
    return next((c for c in device.get("status", {}).get("conditions") or [] if c["type"] == kind), {})


def assign(node: GuestNode, address: str, namespace: str) -> None:
    """The admin's act: spec.assignedNamespace of the node's device at `address` ("" unassigns)."""
    name = node.devices()[address]["metadata"]["name"]
    patch = json.dumps({"spec": {"assignedNamespace": namespace}})
    node.cluster.kubectl("patch", "nodepcidevice", name, "--type=merge", "-p", patch)


def ready(node: GuestNode, address: str, reason: str) -> dict[str, Any] | None:
    """The device's Ready condition when its reason is `reason`, else None (for `wait`)."""
    found = condition(node.devices().get(address, {}), "Ready")
    return found if found.get("reason") == reason else None


def events(node: GuestNode, address: str) -> list[dict[str, Any]]:
    """The Events about the node's device at `address`."""
    name = node.devices()[address]["metadata"]["name"]
    listing = node.cluster.kubectl("get", "events", "-A", "--field-selector", f"involvedObject.name={name}", "-o", "json")
    return json.loads(listing.stdout)["items"]


def guest_clock(guest: Guest) -> float:
    """time.monotonic() in the guest (what `PluginWatch` stamps its updates with)."""
    return guest.python("import time; result = time.monotonic()")


_WATCH_START = """
import threading, time
from pathlib import Path
import grpc
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2 as api, api_pb2_grpc as api_grpc
from passthrough.deviceplugin.server import live_socket
plugin_dir = Path(args['plugin_dir'])
channel = grpc.insecure_channel(f"unix://{live_socket(plugin_dir, args['resource'])}")
stream = api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty())
seen = []
def read():
    try:
        for reply in stream:
            seen.append((time.monotonic(), {d.ID: d.health for d in reply.devices}))
    except Exception as exc:  # the stream ends when the plugin stops (or the watch is stopped)
        seen.append((time.monotonic(), {'error': type(exc).__name__}))
threading.Thread(target=read, daemon=True).start()
state['watch:' + args['resource']] = (channel, stream, seen)
"""
_WATCH_READ = "result = list(state['watch:' + args['resource']][2])"
_WATCH_STOP = """
channel, stream, seen = state.pop('watch:' + args['resource'])
stream.cancel()
channel.close()
"""


class PluginWatch:
    """ListAndWatch of one resource's device plugin, read in the guest as the kubelet reads it:
    every update, stamped with the guest's time.monotonic()."""

    def __init__(self, guest: Guest, plugin_dir: str, resource: str) -> None:
        self.guest, self.resource = guest, resource
        guest.python(_WATCH_START, plugin_dir=plugin_dir, resource=resource)

    def updates(self) -> list[tuple[float, dict[str, str]]]:
        return [(at, devices) for at, devices in self.guest.python(_WATCH_READ, resource=self.resource)]

    def first(self, check: Callable[[dict[str, str]], bool], since: float = 0.0) -> float | None:
        """The guest time of the first update from `since` on for which `check(devices)` holds."""
        return next((at for at, devices in self.updates() if at >= since and check(devices)), None)

    def stop(self) -> None:
        self.guest.python(_WATCH_STOP, resource=self.resource)

    def __enter__(self) -> PluginWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
