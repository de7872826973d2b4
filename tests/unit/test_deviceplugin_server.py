"""The device plugin, its manager and the PodResources client, over real unix sockets.

The kubelet here is a stand-in that only does what the gRPC contract says (a Registration
server on kubelet.sock that records Register calls and dials the plugin back; a restart
deletes every socket in the directory and listens on a new kubelet.sock). The real
kubelet is exercised by the integration tests.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from passthrough.agent.handover import served_elsewhere
from passthrough.deviceplugin.allocation import PluginDevice
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2 as api
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2_grpc as api_grpc
from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2 as pr
from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2_grpc as pr_grpc
from passthrough.deviceplugin.manager import PluginManager
from passthrough.deviceplugin.holder import Holder
from passthrough.deviceplugin.podresources import PodResourcesUnavailable, view
from passthrough.deviceplugin.server import UNIX_PATH_MAX, DevicePlugin, live_socket, socket_name

pytestmark = pytest.mark.timeout(30)

A10 = "nvidia.com/GA102GL_A10"
NIC = "passthrough.io/pci-9ace36adc8088aa0a354e3f0a277e5923f852d16"
GPU0 = PluginDevice("0000:3b:00.0", iommu_group=12, numa_node=0)
GPU1 = PluginDevice("0000:af:00.0", iommu_group=40, numa_node=1)
NIC0 = PluginDevice("0000:18:00.1", iommu_group=7, numa_node=-1)


@pytest.fixture
def plugin_dir():
    # Short on purpose: pytest's tmp_path can exceed the 107 bytes of a unix socket path.
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def eventually(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


def channel_to(path: Path) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"unix://{path}")


class FakeKubelet(api_grpc.RegistrationServicer):
    """The kubelet's side of registration, as the contract has it, and its restart."""

    def __init__(self, plugin_dir: Path, refuse: int = 0) -> None:
        self.plugin_dir = plugin_dir
        self.socket = plugin_dir / "kubelet.sock"
        self.calls: list[api.RegisterRequest] = []
        self.dialed: list[str] = []  # endpoints that answered GetDevicePluginOptions after Register
        self.refuse = refuse
        self._server: grpc.aio.Server | None = None

    async def Register(self, request, context):
        if self.refuse:
            self.refuse -= 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resource already registered")
        self.calls.append(request)
        async with channel_to(self.plugin_dir / request.endpoint) as channel:
            await api_grpc.DevicePluginStub(channel).GetDevicePluginOptions(api.Empty(), timeout=2)
        self.dialed.append(request.endpoint)
        return api.Empty()

    def registered(self, resource: str) -> list[api.RegisterRequest]:
        return [c for c in self.calls if c.resource_name == resource]

    async def start(self) -> None:
        self._server = grpc.aio.server()
        api_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        self.socket.unlink(missing_ok=True)

    async def restart(self) -> None:
        """What the kubelet does at start: delete every socket in its directory, listen anew."""
        await self.stop()
        for entry in self.plugin_dir.iterdir():
            entry.unlink()
        await self.start()


@pytest.fixture
async def kubelet(plugin_dir):
    fake = FakeKubelet(plugin_dir)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def plugin(plugin_dir):
    served = DevicePlugin(A10, plugin_dir, [GPU0, GPU1])
    await served.start()
    yield served
    await served.stop()


# Socket names.


def test_socket_name_is_readable_and_stable_when_it_fits():
    assert socket_name(A10, Path("/var/lib/kubelet/device-plugins")) == "passthrough-nvidia.com_GA102GL_A10.sock"


def test_socket_name_is_a_hash_when_the_path_would_pass_the_unix_limit():
    plugin_dir = Path("/var/lib/kubelet/device-plugins")
    name = socket_name(NIC, plugin_dir)
    assert name == socket_name(NIC, plugin_dir)
    assert name.startswith("passthrough-") and len(name) == len("passthrough-") + 16 + len(".sock")
    assert socket_name(NIC.replace("9ace", "9acf"), plugin_dir) != name
    for resource in (A10, NIC, "example.com/" + "x" * 63):
        assert len(os.fsencode(plugin_dir / socket_name(resource, plugin_dir))) < UNIX_PATH_MAX


# One plugin, spoken to as the kubelet would.


async def test_options_say_preferred_allocation_is_available_and_no_pre_start(plugin):
    async with channel_to(plugin.socket_path) as channel:
        options = await api_grpc.DevicePluginStub(channel).GetDevicePluginOptions(api.Empty(), timeout=2)
    assert options.get_preferred_allocation_available and not options.pre_start_required


async def test_list_and_watch_sends_the_list_at_once_and_each_update_within_a_second(plugin):
    async with channel_to(plugin.socket_path) as channel:
        stream = api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty())
        first = await asyncio.wait_for(stream.read(), 1)
        assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in first.devices] == [
            ("0000:3b:00.0", "Healthy", [0]),
            ("0000:af:00.0", "Healthy", [1]),
        ]
        assert plugin.update([GPU0, PluginDevice(GPU1.id, GPU1.iommu_group, GPU1.numa_node, healthy=False), NIC0])
        second = await asyncio.wait_for(stream.read(), 1)
        assert [(d.ID, d.health) for d in second.devices] == [
            ("0000:18:00.1", "Healthy"),
            ("0000:3b:00.0", "Healthy"),
            ("0000:af:00.0", "Unhealthy"),
        ]
        assert not second.devices[0].HasField("topology")  # no NUMA node known: no topology at all
        assert plugin.update([GPU0])
        third = await asyncio.wait_for(stream.read(), 1)
        assert [d.ID for d in third.devices] == ["0000:3b:00.0"]
        stream.cancel()


def test_an_equal_device_list_is_no_update():
    served = DevicePlugin(A10, Path("/tmp"), [GPU0, GPU1])
    assert not served.update([GPU1, GPU0])


async def test_allocate_returns_the_addresses_in_the_order_asked_and_the_vfio_nodes(plugin):
    request = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=[GPU1.id, GPU0.id])]
    )
    async with channel_to(plugin.socket_path) as channel:
        answer = await api_grpc.DevicePluginStub(channel).Allocate(request, timeout=2)
    (container,) = answer.container_responses
    assert dict(container.envs) == {"PCI_RESOURCE_NVIDIA_COM_GA102GL_A10": "0000:af:00.0,0000:3b:00.0"}
    assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "rw"),
        ("/dev/vfio/40", "/dev/vfio/40", "rw"),
        ("/dev/vfio/12", "/dev/vfio/12", "rw"),
    ]


async def test_allocate_of_an_unknown_device_fails_with_the_reason(plugin):
    request = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=["0000:99:00.0"])])
    async with channel_to(plugin.socket_path) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await api_grpc.DevicePluginStub(channel).Allocate(request, timeout=2)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown device 0000:99:00.0 for nvidia.com/GA102GL_A10" in error.value.details()


async def test_preferred_allocation_and_pre_start_answer(plugin):
    request = api.PreferredAllocationRequest(
        container_requests=[
            api.ContainerPreferredAllocationRequest(
                available_deviceIDs=[GPU0.id, GPU1.id], must_include_deviceIDs=[GPU1.id], allocation_size=1
            )
        ]
    )
    async with channel_to(plugin.socket_path) as channel:
        stub = api_grpc.DevicePluginStub(channel)
        preferred = await stub.GetPreferredAllocation(request, timeout=2)
        pre_start = await stub.PreStartContainer(api.PreStartContainerRequest(devices_ids=[GPU0.id]), timeout=2)
    assert [list(c.deviceIDs) for c in preferred.container_responses] == [[GPU1.id]]
    assert pre_start == api.PreStartContainerResponse()


async def test_stop_ends_the_streams_and_removes_the_socket(plugin_dir):
    served = DevicePlugin(A10, plugin_dir, [GPU0])
    await served.start()
    assert served.socket_path.exists()
    async with channel_to(served.socket_path) as channel:
        stream = api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty())
        await asyncio.wait_for(stream.read(), 1)
        await served.stop()
        try:
            last = await asyncio.wait_for(stream.read(), 2)  # the list as it was at the stop
            assert {(d.ID, d.health) for d in last.devices} == {(GPU0.id, "Healthy")}
            end = await asyncio.wait_for(stream.read(), 2)
        except grpc.aio.AioRpcError:
            end = grpc.aio.EOF  # cut by the server's stop: an end all the same
        assert end is grpc.aio.EOF
    assert not served.socket_path.exists()


async def test_a_withdrawn_resource_tells_its_streams_every_device_is_unhealthy_before_they_end(plugin_dir):
    """A resource leaves (its device vanished before a health poll saw it, or moved elsewhere): the
    stream's last list says Unhealthy, so a kubelet hears it before it notices the stream's end."""
    served = DevicePlugin(A10, plugin_dir, [GPU0, GPU1])
    await served.start()
    async with channel_to(served.socket_path) as channel:
        stream = api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty())
        first = await asyncio.wait_for(stream.read(), 1)
        assert {d.health for d in first.devices} == {"Healthy"}
        await served.stop(farewell=True)
        last = await asyncio.wait_for(stream.read(), 2)
        assert {(d.ID, d.health) for d in last.devices} == {(GPU0.id, "Unhealthy"), (GPU1.id, "Unhealthy")}
        assert await asyncio.wait_for(stream.read(), 2) is grpc.aio.EOF


def test_each_later_socket_of_a_resource_has_a_name_of_its_own_within_the_unix_limit():
    plugin_dir = Path("/var/lib/kubelet/device-plugins")
    for resource in (A10, NIC, "example.com/" + "x" * 63):
        names = [socket_name(resource, plugin_dir, generation) for generation in range(12)]
        assert len(set(names)) == len(names) and names[0] == socket_name(resource, plugin_dir)
        assert all(n.startswith("passthrough-") and n.endswith(".sock") for n in names)
        assert all(len(os.fsencode(plugin_dir / n)) < UNIX_PATH_MAX for n in names)


async def test_live_socket_finds_the_latest_socket_of_a_resource_and_no_other_resources(plugin_dir):
    assert live_socket(plugin_dir, A10) is None
    plugins = [DevicePlugin(A10, plugin_dir, [GPU0]) for _ in range(3)]
    other = DevicePlugin("nvidia.com/GA102GL_A10-1", plugin_dir, [GPU1])  # a name like a generation's, but with "-"
    try:
        await other.start()
        for generation, plugin in enumerate(plugins):
            plugin.listen_at(socket_name(A10, plugin_dir, generation))
            await plugin.start()
            assert live_socket(plugin_dir, A10) == plugin.socket_path
        await plugins[2].stop()
        assert live_socket(plugin_dir, A10) == plugins[1].socket_path
        assert live_socket(plugin_dir, NIC) is None and live_socket(plugin_dir, other.resource_name) == other.socket_path
    finally:
        for plugin in (*plugins, other):
            await plugin.stop()


# The manager, against the stand-in kubelet.


async def test_each_resource_is_served_and_registered_with_the_kubelet(plugin_dir, kubelet):
    manager = PluginManager(plugin_dir)
    try:
        await manager.set_resources({A10: [GPU0, GPU1], NIC: [NIC0]})
        for resource in (A10, NIC):
            (call,) = kubelet.registered(resource)
            assert call.version == "v1beta1"
            assert call.endpoint == socket_name(resource, plugin_dir)
            assert "/" not in call.endpoint and (plugin_dir / call.endpoint).exists()
            assert call.options.get_preferred_allocation_available
            state = manager.registrations()[resource]
            assert state.registered and state.last_error == "" and state.registrations == 1
        assert sorted(kubelet.dialed) == sorted(socket_name(r, plugin_dir) for r in (A10, NIC))
    finally:
        await manager.close()


async def test_resources_no_longer_listed_are_stopped_and_their_sockets_removed(plugin_dir, kubelet):
    manager = PluginManager(plugin_dir)
    try:
        await manager.set_resources({A10: [GPU0], NIC: [NIC0]})
        nic_socket = manager.plugin(NIC).socket_path
        await manager.set_resources({A10: [GPU0, GPU1]})
        assert not nic_socket.exists()
        assert manager.resources == [A10] and list(manager.registrations()) == [A10]
        assert sorted(manager.plugin(A10).devices) == [GPU0.id, GPU1.id]
        assert len(kubelet.registered(A10)) == 1  # an update is no new registration
    finally:
        await manager.close()


async def test_close_stops_every_plugin_and_removes_our_sockets(plugin_dir, kubelet):
    manager = PluginManager(plugin_dir)
    await manager.set_resources({A10: [GPU0], NIC: [NIC0]})
    await manager.close()
    assert sorted(p.name for p in plugin_dir.iterdir()) == ["kubelet.sock"]
    assert not any(s.registered for s in manager.registrations().values())


async def test_a_missing_kubelet_is_waited_for_then_registered_with(plugin_dir):
    manager = PluginManager(plugin_dir, poll_interval=0.1)
    runner = asyncio.create_task(manager.run())
    kubelet = FakeKubelet(plugin_dir)
    try:
        await manager.set_resources({A10: [GPU0]})
        state = manager.registrations()[A10]
        assert not state.registered and "waiting for the kubelet" in state.last_error
        await asyncio.sleep(0.3)
        assert not runner.done()
        await kubelet.start()
        await eventually(lambda: manager.registrations()[A10].registered, 5, "registered once kubelet.sock appears")
        assert len(kubelet.registered(A10)) == 1
    finally:
        await manager.close()
        await asyncio.wait_for(runner, 2)
        await kubelet.stop()


async def test_a_refused_registration_is_retried(plugin_dir):
    kubelet = FakeKubelet(plugin_dir, refuse=2)
    await kubelet.start()
    manager = PluginManager(plugin_dir, poll_interval=0.05)
    try:
        await manager.set_resources({A10: [GPU0]})
        state = manager.registrations()[A10]
        assert not state.registered and "resource already registered" in state.last_error
        runner = asyncio.create_task(manager.run())
        await eventually(lambda: manager.registrations()[A10].registered, 5, "registered after two refusals")
        assert manager.registrations()[A10].last_error == ""
    finally:
        await manager.close()
        await kubelet.stop()
    await asyncio.wait_for(runner, 2)


async def test_after_a_kubelet_restart_every_plugin_listens_and_registers_again_within_5s(plugin_dir, kubelet):
    manager = PluginManager(plugin_dir)  # the default polling: this is the promise to users
    runner = asyncio.create_task(manager.run())
    try:
        await manager.set_resources({A10: [GPU0, GPU1], NIC: [NIC0]})
        await kubelet.restart()
        started = time.monotonic()
        await eventually(
            lambda: all(s.registrations == 2 and s.registered for s in manager.registrations().values()),
            5,
            "both resources registered again",
        )
        assert time.monotonic() - started < 5
        assert all(len(kubelet.registered(r)) == 2 for r in (A10, NIC))
        async with channel_to(manager.plugin(A10).socket_path) as channel:  # a new socket, as the kubelet was told
            first = await asyncio.wait_for(api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty()).read(), 1)
        assert [d.ID for d in first.devices] == [GPU0.id, GPU1.id]
    finally:
        await manager.close()
    await asyncio.wait_for(runner, 2)


async def test_a_resource_served_again_registers_a_socket_it_has_not_used_before(plugin_dir, kubelet):
    manager = PluginManager(plugin_dir)
    try:
        await manager.set_resources({A10: [GPU0]})
        await manager.set_resources({})
        await manager.set_resources({A10: [GPU0]})
        first, second = kubelet.registered(A10)
        assert first.endpoint == socket_name(A10, plugin_dir) and second.endpoint == socket_name(A10, plugin_dir, 1)
        assert not (plugin_dir / first.endpoint).exists() and (plugin_dir / second.endpoint).exists()
    finally:
        await manager.close()


async def test_stale_sockets_of_an_earlier_agent_are_removed_at_start(plugin_dir, kubelet):
    stale, foreign = plugin_dir / "passthrough-old.example.com_x.sock", plugin_dir / "nvidia-gpu.sock"
    stale.touch()
    foreign.touch()
    manager = PluginManager(plugin_dir)
    runner = asyncio.create_task(manager.run())
    try:
        await eventually(lambda: not stale.exists(), 2, "the stale socket removed")
        assert foreign.exists()  # not ours to remove
    finally:
        await manager.close()
    await asyncio.wait_for(runner, 2)


async def test_health_changes_reach_list_and_watch_within_a_second(plugin_dir, kubelet):
    broken: set[str] = set()
    manager = PluginManager(plugin_dir, health=lambda d: d.id not in broken, health_interval=0.1)
    runner = asyncio.create_task(manager.run())
    try:
        await manager.set_resources({A10: [GPU0, GPU1]})
        async with channel_to(plugin_dir / socket_name(A10, plugin_dir)) as channel:
            stream = api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty())
            first = await asyncio.wait_for(stream.read(), 1)
            assert {d.ID: d.health for d in first.devices} == {GPU0.id: "Healthy", GPU1.id: "Healthy"}
            broken.add(GPU1.id)
            second = await asyncio.wait_for(stream.read(), 1)
            assert {d.ID: d.health for d in second.devices} == {GPU0.id: "Healthy", GPU1.id: "Unhealthy"}
            broken.clear()
            third = await asyncio.wait_for(stream.read(), 1)
            assert {d.ID: d.health for d in third.devices} == {GPU0.id: "Healthy", GPU1.id: "Healthy"}
            stream.cancel()
    finally:
        await manager.close()
    await asyncio.wait_for(runner, 2)


async def test_a_failing_health_check_reports_the_device_unhealthy(plugin_dir, kubelet):
    def health(device):
        raise OSError("sysfs is gone")

    manager = PluginManager(plugin_dir, health=health)
    try:
        await manager.set_resources({A10: [GPU0]})
        assert not manager.plugin(A10).devices[GPU0.id].healthy
    finally:
        await manager.close()


# PodResources.


class FakePodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, answer: pr.ListPodResourcesResponse | None, hang: bool = False) -> None:
        self.answer, self.hang = answer, hang

    async def List(self, request, context):
        if self.hang:
            await asyncio.sleep(10)
        return self.answer


async def serve_pod_resources(path: Path, servicer) -> grpc.aio.Server:
    server = grpc.aio.server()
    pr_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


def container(name: str, *devices: tuple[str, list[str]]) -> pr.ContainerResources:
    return pr.ContainerResources(
        name=name, devices=[pr.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devices]
    )


async def test_the_kubelets_view_names_every_pod_that_holds_each_device(plugin_dir):
    answer = pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name="virt-launcher-a",
                namespace="team-a",
                containers=[container("compute", (A10, [GPU0.id]), (NIC, [NIC0.id])), container("sidecar")],
            ),
            pr.PodResources(name="virt-launcher-b", namespace="team-b", containers=[container("compute", (A10, [GPU1.id]))]),
            pr.PodResources(name="web", namespace="default", containers=[container("app", ("example.com/x", []))]),
        ]
    )
    path = plugin_dir / "pr.sock"
    server = await serve_pod_resources(path, FakePodResources(answer))
    try:
        seen = await view(path)
        assert seen.holders == {
            GPU0.id: (Holder("team-a", "virt-launcher-a", A10),),
            NIC0.id: (Holder("team-a", "virt-launcher-a", NIC),),
            GPU1.id: (Holder("team-b", "virt-launcher-b", A10),),
        }
        assert seen.allocatable == {}  # a kubelet without GetAllocatableResources: no other plugin seen
    finally:
        await server.stop(0)


class AllocatablePodResources(FakePodResources):
    def __init__(self, served: pr.AllocatableResourcesResponse) -> None:
        super().__init__(pr.ListPodResourcesResponse())
        self.served = served

    async def GetAllocatableResources(self, request, context):
        return self.served


async def test_a_device_two_plugins_serve_is_seen_under_both_names(plugin_dir):
    # Ours pools GPU0 and GPU1; another plugin (NVIDIA's sandbox plugin) serves GPU0 too.
    served = pr.AllocatableResourcesResponse(devices=[
        pr.ContainerDevices(resource_name=A10, device_ids=[GPU0.id, GPU1.id]),
        pr.ContainerDevices(resource_name="example.com/other-gpu", device_ids=[GPU0.id]),
    ])  # fmt: skip
    path = plugin_dir / "pr.sock"
    server = await serve_pod_resources(path, AllocatablePodResources(served))
    try:
        seen = await view(path)
        assert seen.allocatable == {GPU0.id: (A10, "example.com/other-gpu"), GPU1.id: (A10,)}
        assert served_elsewhere(seen, [A10]) == {GPU0.id: "example.com/other-gpu"}
        assert served_elsewhere(seen, [A10, "example.com/other-gpu"]) == {}
    finally:
        await server.stop(0)


async def test_the_kubelets_view_is_unavailable_without_a_socket(plugin_dir):
    with pytest.raises(PodResourcesUnavailable, match="does not exist"):
        await view(plugin_dir / "missing.sock")


async def test_the_kubelets_view_is_unavailable_when_nothing_listens(plugin_dir):
    path = plugin_dir / "dead.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))  # the file of a kubelet that died: bound, never listening
    try:
        with pytest.raises(PodResourcesUnavailable, match="UNAVAILABLE"):
            await view(path, timeout=1)
    finally:
        dead.close()


async def test_the_kubelets_view_is_unavailable_when_the_kubelet_does_not_answer(plugin_dir):
    path = plugin_dir / "slow.sock"
    server = await serve_pod_resources(path, FakePodResources(None, hang=True))
    try:
        started = time.monotonic()
        with pytest.raises(PodResourcesUnavailable, match="DEADLINE_EXCEEDED"):
            await view(path, timeout=0.3)
        assert time.monotonic() - started < 2
    finally:
        await server.stop(0)
