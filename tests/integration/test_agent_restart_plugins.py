"""An agent restarted on a node never takes its own last device plugins for another server's.

A new agent asks the kubelet's PodResources which devices other plugins serve before its own
plugins run: were its predecessor's devices still listed there, it would count them as another
server's and neither serve nor give back its own devices. The kubelet (1.37.2) keeps a stopped
plugin's resources in the Node's capacity for minutes (endpointStopGracePeriod), but its
GetAllocatableResources lists Healthy devices only, and a plugin's stream that ends (the process
killed, or stopped) marks every device of it Unhealthy at once (devicemanager `PluginDisconnected`,
`markResourceUnhealthy`, `GetAllocatableDevices`). Here the real kubelet (fake CRI runtime) serves a
GPU pool from an agent that runs as its own process over a fixture GPU node; one GPU is held by a
pod, the agent is restarted (killed, as a container is, and stopped by SIGTERM) and a new one
started at once; the free GPU must be served again within seconds and go to the next pod, while
the held one stays the first pod's, on vfio-pci.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess
from e2e.support import created
from passthrough.api.labels import NODE_LABEL
from passthrough.deviceplugin.podresources import view
from passthrough.kube.custom import Custom
from passthrough.pci.naming import resource_env_name

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
POOL = "nvidia.com/GA102GL_A10"
GPUS = ("0000:3b:00.0", "0000:af:00.0")
GPU_MODE = "passthrough.io/gpu-passthrough"
# From the new agent's start: its interpreter and imports (about 2 s on a loaded 2-core machine),
# its first scan, its plugins registered and listed by the kubelet.
SERVED_AGAIN = 10.0


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    host = fakesysfs.gpu_node(tmp_path_factory.mktemp("gpu-host"))
    with FakeKernel(host):
        yield host


@pytest.fixture
def kubelet(kubelet_nodes):
    return kubelet_nodes(labels={GPU_MODE: "true"})  # one per case: the pods of the last are gone with it


async def _healthy(socket: Path) -> dict[str, tuple[str, ...]]:
    return (await view(socket)).allocatable  # the kubelet lists Healthy devices only


async def _listed(socket: Path) -> bool:
    return set(await _healthy(socket)) >= set(GPUS)


async def _ready(api, node: str) -> dict[str, dict]:
    """Address -> the Ready condition of its NodePCIDevice."""
    found = {}
    for item in (await Custom(api, "nodepcidevices").list(f"{NODE_LABEL}={node}"))["items"]:
        status = item.get("status") or {}
        address = status.get("attributes", {}).get("pciAddress")
        ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
        if address and ready:
            found[address] = ready
    return found


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
async def test_a_restarted_agent_serves_its_free_device_again_and_leaves_the_held_one_to_its_pod(
    api, cluster, kubelet, gpu_host, operator, tmp_path_factory, unique, how
):
    core = client.CoreV1Api(api)
    workdir = tmp_path_factory.mktemp("restart")
    agent = AgentProcess(cluster, workdir / "agent.log", kubelet.node_name, gpu_host, PCI_IDS, kubelet=kubelet).start()
    namespace = await support.create_namespace(api, f"restart-{unique}")
    again = None
    try:
        await support.reported(api, kubelet.node_name, GPUS)
        await support.wait_for(lambda: _listed(kubelet.pod_resources_socket), 60, 0.05,
                               what=lambda: f"{POOL} served; agent log:\n{agent.output()[-4000:]}")  # fmt: skip
        pod = support.launcher_pod(f"holder-{unique}", POOL)
        pod.spec.node_name = kubelet.node_name
        await support.create_pod(api, namespace, pod)
        held = (await created(core, namespace, kubelet, pod.metadata.name))["envs"][resource_env_name(POOL)]
        free = next(a for a in GPUS if a != held)

        agent.stop(how)  # and at once a new one, as a container restarts
        started = time.monotonic()
        again = AgentProcess(cluster, workdir / "agent-again.log", kubelet.node_name, gpu_host, PCI_IDS,
                             kubelet=kubelet).start()  # fmt: skip

        await support.wait_for(lambda: _listed(kubelet.pod_resources_socket), 60, 0.05,
                               what=lambda: f"{POOL} served again; agent log:\n{again.output()[-4000:]}")  # fmt: skip
        took = time.monotonic() - started
        print(f"agent restart ({how.name}): both GPUs served again {took:.2f} s after the new agent started")
        assert took < SERVED_AGAIN, f"served again only after {took:.1f} s:\n{again.output()[-4000:]}"

        # The free one goes to the next pod; the held one is still the first pod's, on vfio-pci.
        second = support.launcher_pod(f"next-{unique}", POOL)
        second.spec.node_name = kubelet.node_name
        await support.create_pod(api, namespace, second)
        given = (await created(core, namespace, kubelet, second.metadata.name))["envs"][resource_env_name(POOL)]
        assert given == free
        holders = (await view(kubelet.pod_resources_socket)).holders
        assert {h.pod for h in holders[held]} == {pod.metadata.name}
        assert gpu_host.driver(held) == "vfio-pci" and gpu_host.driver(free) == "vfio-pci"

        async def ready_everywhere() -> bool:
            conditions = await _ready(api, kubelet.node_name)
            return all(conditions.get(a, {}).get("status") == "True" for a in GPUS)

        await support.wait_for(ready_everywhere, 30, 0.2,
                               what=lambda: f"both GPUs Ready again; agent log:\n{again.output()[-4000:]}")  # fmt: skip
        assert "served by another device plugin" not in again.output()  # its Warning, logged with the Event
    finally:
        with contextlib.suppress(client.exceptions.ApiException):
            await core.delete_namespace(namespace)
        code = agent.stop()
        code_again = again.stop() if again is not None else 0
    assert "Traceback" not in agent.output(), agent.output()[-5000:]
    assert code_again == 0 and "Traceback" not in again.output(), again.output()[-5000:]

