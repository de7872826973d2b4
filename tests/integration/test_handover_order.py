"""A device given back is first withdrawn from the kubelet, then the kubelet is asked who holds it.

The race it closes: the agent asks PodResources (nobody holds the device), the kubelet then hands
the device to a pod that asks for it (a pool's device goes to any namespace's pod), and the agent
withdraws and unbinds it on its earlier answer: the device leaves under a running VM. Here the
real kubelet (fake CRI runtime) answers through a relay that keeps the kubelet's answer back
while a pod bound to the node is admitted and given the device, so that order happens for sure.
The agent runs as its own process over a fixture GPU node with its simulated kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess
from e2e.support import created, wait_resources
from passthrough.api.labels import NODE_LABEL
from passthrough.deviceplugin.podresources import view
from passthrough.kube.custom import Custom
from passthrough.pci.naming import resource_env_name

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
POOL = "nvidia.com/GA102GL_A10"
GPUS = ("0000:3b:00.0", "0000:af:00.0")  # IOMMU groups 20 and 21, each with its audio function
GPU_MODE = "passthrough.io/gpu-passthrough"
# The agent gives each PodResources call 2 s: a held answer is let through this long after the
# agent's last request on the connection, whatever happens.
HOLD = 1.6


class HeldAnswers:
    """A unix-socket relay in front of the kubelet's PodResources socket. Once `arm()`ed, the next
    connection's answers from the kubelet are kept back until `let_go()`, each at most HOLD s
    after the agent's last request (the agent's view is two calls: List, then
    GetAllocatableResources). `answered` is set once the kubelet's first answer (an HTTP/2 DATA
    frame of the first stream) has reached the relay: the kubelet had answered then. `missed`:
    the agent had its whole view, and hung up, before `let_go()`."""

    def __init__(self, path: Path, kubelet: Path) -> None:
        self.path, self.kubelet = path, kubelet
        self.armed = False
        self.answered = asyncio.Event()
        self.released = asyncio.Event()
        self.missed = False
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> HeldAnswers:
        self._server = await asyncio.start_unix_server(self._serve, str(self.path))
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()

    def arm(self) -> None:
        self.armed = True

    def let_go(self) -> None:
        self.released.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held, self.armed = self.armed, False
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_reader, up_writer = await asyncio.open_unix_connection(str(self.kubelet))
        last_request = [asyncio.get_running_loop().time()]
        answers: asyncio.Queue[bytes] = asyncio.Queue()
        try:
            await asyncio.gather(self._requests(reader, up_writer, last_request), self._read(up_reader, answers, held),
                                 self._answer(answers, writer, held, last_request))  # fmt: skip
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            if held and not self.released.is_set():
                self.missed = True
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()

    @staticmethod
    async def _requests(reader, writer, last_request: list[float]) -> None:
        while data := await reader.read(1 << 16):
            last_request[0] = asyncio.get_running_loop().time()
            writer.write(data)
            await writer.drain()
        writer.write_eof()

    async def _read(self, reader, answers: asyncio.Queue, held: bool) -> None:
        frames = b""
        while data := await reader.read(1 << 16):
            if held:
                frames = self._note(frames + data)
            answers.put_nowait(data)
        answers.put_nowait(b"")

    async def _answer(self, answers: asyncio.Queue, writer, held: bool, last_request: list[float]) -> None:
        while data := await answers.get():
            if held and not self.released.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(last_request[0] + HOLD - asyncio.get_running_loop().time(), 0)):
                        await self.released.wait()
            writer.write(data)
            await writer.drain()
        writer.write_eof()

    def _note(self, frames: bytes) -> bytes:
        """Walk the HTTP/2 frames seen so far; set `answered` at a DATA frame of stream 1."""
        while len(frames) >= 9:
            length = int.from_bytes(frames[:3], "big")
            kind, stream = frames[3], struct.unpack(">I", frames[5:9])[0] & 0x7FFFFFFF
            if len(frames) < 9 + length:
                break
            if kind == 0 and stream == 1:
                self.answered.set()
            frames = frames[9 + length:]
        return frames


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    host = fakesysfs.gpu_node(tmp_path_factory.mktemp("gpu-host"))
    with FakeKernel(host):
        yield host


@pytest.fixture(scope="module")
def kubelet(module_kubelet_nodes):
    return module_kubelet_nodes(labels={GPU_MODE: "true"})


async def ready(api, node: str, address: str) -> dict:
    items = (await Custom(api, "nodepcidevices").list(f"{NODE_LABEL}={node}"))["items"]
    device = next(o for o in items if (o.get("status") or {}).get("attributes", {}).get("pciAddress") == address)
    return next(c for c in device["status"]["conditions"] if c["type"] == "Ready")


async def test_a_pod_given_a_device_while_the_agent_looks_keeps_it(api, cluster, kubelet, gpu_host, operator, tmp_path_factory, unique):
    core = client.CoreV1Api(api)
    workdir = tmp_path_factory.mktemp("order")
    relay = await HeldAnswers(Path(f"/tmp/pr-{unique}.sock"), kubelet.pod_resources_socket).start()
    agent = AgentProcess(cluster, workdir / "agent.log", kubelet.node_name, gpu_host, PCI_IDS,
                         f"--pod-resources-socket={relay.path}", kubelet=kubelet).start()  # fmt: skip
    namespace = await support.create_namespace(api, f"order-{unique}")
    try:
        await support.reported(api, kubelet.node_name, GPUS)
        await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)

        # GPU mode off: both pool groups are to be given back. The agent's next look is held.
        relay.arm()
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: None}}})
        await support.wait_for(lambda: _set(relay.answered), 30, 0.02, what="the agent's look, answered by the kubelet")
        # The kubelet has answered (nobody holds a GPU); now a pod on this node gets one.
        pod = support.launcher_pod(f"order-{unique}", POOL)
        pod.spec.node_name = kubelet.node_name
        await support.create_pod(api, namespace, pod)
        container = await created(core, namespace, kubelet, pod.metadata.name)
        held = container["envs"][resource_env_name(POOL)]

        async def listed():
            holders = (await view(kubelet.pod_resources_socket)).holders
            return held in holders

        await support.wait_for(listed, 30, 0.02, what=f"the kubelet's PodResources listing {held}")
        relay.let_go()
        assert not relay.missed, "the pod was admitted only after the agent had its answers: the order was not made"

        other = next(a for a in GPUS if a != held)
        await support.wait_for(lambda: _driver_is(gpu_host, other, "nvidia"), 30, 0.1,
                               what=lambda: f"{other} given back; agent log:\n{agent.output()[-3000:]}")  # fmt: skip
        assert gpu_host.driver(held) == "vfio-pci", f"{held} was given back under pod {pod.metadata.name}"
        found = await ready(api, kubelet.node_name, held)
        assert found["reason"] == "HeldByPod" and pod.metadata.name in found["message"], found
    finally:
        await relay.close()
        with contextlib.suppress(client.exceptions.ApiException):
            await core.delete_namespace(namespace)
        code = agent.stop()
    assert code == 0 and "Traceback" not in agent.output(), agent.output()[-5000:]


async def _set(event: asyncio.Event) -> bool:
    return event.is_set()


async def _driver_is(host, address: str, driver: str) -> bool:
    return host.driver(address) == driver
