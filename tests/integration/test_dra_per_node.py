"""Both modes on one cluster, against the real parts: each node's agent serves its devices the way
its Node's passthrough.io/mode label says, and the operator follows each node's mode.

Two real kubelets (fake CRI runtime) beside the real kube-scheduler, each over a fixture GPU node
with its simulated kernel, and the same agent command line on both, as the chart's DaemonSet
renders it with agent.devicePlugin.perNode (the cluster's default: device plugins). Node `dra` is
labelled passthrough.io/mode=dra, node `plugin` is not. The operator runs --dra (its DeviceClass per
namespace, the claims' index) with the platform values of a mixed cluster (spec.dra.perNode).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess, OperatorProcess, running
from e2e.support import created, resources, wait_resources
from passthrough.api.labels import MODE_LABEL, SERVING_LABEL
from passthrough.dra import cdi
from passthrough.dra.slice import DRIVER, slice_name
from passthrough.kube.client import ApiError, session_of
from passthrough.kube.custom import Custom
from passthrough.pci.naming import exclusive_resource_name, resource_env_name
from tests.integration.test_dra import RESOURCE, cdi_dir, claim, claim_pod, create_claim, delete_claim, read_claim

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
GPU, AUDIO, GROUP = "0000:af:00.0", "0000:af:00.1", 21
DEVICE = "pci-0000-af-00-0"  # its name in a slice


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """A GPU node's sysfs for each kubelet, each with its simulated kernel."""
    found = {mode: fakesysfs.gpu_node(tmp_path_factory.mktemp(f"{mode}-host")) for mode in ("dra", "plugin")}
    with FakeKernel(found["dra"]), FakeKernel(found["plugin"]):
        yield found


@pytest.fixture(scope="module")
def kubelets(module_kubelet_nodes, kube_scheduler):
    return {"dra": module_kubelet_nodes(labels={MODE_LABEL: "dra"}), "plugin": module_kubelet_nodes()}


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", "--not-found-grace=4s", "--dra")
    with running(proc):
        yield proc


@pytest.fixture(scope="module")
def agents(cluster, kubelets, hosts, tmp_path_factory, operator):
    started = {}
    for mode, kubelet in kubelets.items():
        started[mode] = AgentProcess(cluster, tmp_path_factory.mktemp(f"{mode}-agent") / "agent.log", kubelet.node_name, hosts[mode],
                                     PCI_IDS, "--per-node-mode", f"--kubelet-dir={kubelet.root_dir}", f"--cdi-dir={cdi_dir(kubelet)}",
                                     "--rescan-interval=1s", kubelet=kubelet).start()  # fmt: skip
    yield started
    for proc in started.values():
        code = proc.stop()
        output = proc.output()
        assert code == 0 and "Traceback" not in output, output[-5000:]


@pytest.fixture
async def mixed(api, namespace):
    """The platform values of a cluster whose nodes choose, targeting a KubeVirt CR of the test's namespace."""
    configs = Custom(api, "passthroughconfigs")
    await support.create_kubevirt(api, namespace)
    body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
            "spec": {"kubevirt": {"name": "kubevirt", "namespace": namespace}, "dra": {"enabled": False, "perNode": True}}}  # fmt: skip
    await configs.apply(body, "admin")
    yield Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")
    with contextlib.suppress(ApiError):
        await configs.delete("cluster")
    await support.wait_for(lambda: _absent(configs), what="config deleted")


async def _absent(configs) -> bool:
    return await configs.get("cluster") is None


async def serving(core, node: str) -> str:
    return (await core.read_node(node)).metadata.labels.get(SERVING_LABEL, "")


async def live_slice(api, node: str) -> dict | None:
    try:
        return await session_of(api).request("GET", f"{RESOURCE}/resourceslices/{slice_name(node)}")
    except ApiError:
        return None


async def test_each_node_serves_in_its_own_mode_and_a_vm_shaped_pod_on_each_gets_its_device(
    api, kubelets, agents, hosts, mixed, namespace
):
    core = client.CoreV1Api(api)
    dra, plugin = kubelets["dra"].node_name, kubelets["plugin"].node_name
    for node, mode in ((dra, "dra"), (plugin, "device-plugin")):
        await support.wait_for(lambda node=node, mode=mode: _is(serving(core, node), mode), 30, 0.2,
                               what=lambda node=node: f"{node} labelled {SERVING_LABEL}; agent log:\n{agents['dra'].output()[-3000:]}")  # fmt: skip
    on_dra = (await support.reported(api, dra, (GPU, AUDIO)))[GPU]
    on_plugin = (await support.reported(api, plugin, (GPU, AUDIO)))[GPU]
    await support.assign(api, on_dra, namespace)
    await support.assign(api, on_plugin, namespace)
    claimed = False
    try:
        # The DRA node publishes its device in its ResourceSlice and registers no device plugin for it;
        # the device-plugin node advertises it as its own resource and publishes no slice.
        async def published():
            found = await live_slice(api, dra)
            devices = {d["name"]: d["attributes"]["passthrough.io/namespace"]["string"] for d in ((found or {}).get("spec") or {}).get("devices") or []}
            return devices == {DEVICE: namespace}

        await support.wait_for(published, 30, 0.2, what=lambda: f"{dra}'s slice; agent log:\n{agents['dra'].output()[-3000:]}")
        resource = exclusive_resource_name(on_plugin)
        await wait_resources(core, plugin, {resource: "1"}, agents["plugin"])
        assert await live_slice(api, plugin) is None
        assert not [name for name in await resources(core, dra) if name.startswith("passthrough.io/")]
        assert not list(kubelets["dra"].device_plugin_dir.glob("passthrough-*"))

        # A claim of the namespace's DeviceClass (the operator's) gets the DRA node's GPU through CDI.
        device_class = f"passthrough-{namespace}"
        await support.wait_for(lambda: _class_exists(api, device_class), 30, 0.2, what=f"DeviceClass {device_class}")
        await create_claim(api, namespace, claim("vm-gpu", device_class))
        claimed = True
        await support.create_pod(api, namespace, claim_pod("dra-launcher", "vm-gpu"))
        container = await created(core, namespace, kubelets["dra"], "dra-launcher", timeout=60)
        allocated = await read_claim(api, namespace, "vm-gpu")
        [result] = allocated["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (DRIVER, dra, DEVICE)
        edits = cdi.resolve(cdi_dir(kubelets["dra"]), container["cdi_devices"])
        assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/vfio/vfio", f"/dev/vfio/{GROUP}"]
        assert hosts["dra"].driver(GPU) == "vfio-pci"

        # A launcher pod asking for the device-plugin node's GPU by its resource gets its address.
        await support.create_pod(api, namespace, support.launcher_pod("plugin-launcher", resource))
        container = await created(core, namespace, kubelets["plugin"], "plugin-launcher", timeout=60)
        assert container["envs"][resource_env_name(resource)] == GPU
        assert {d["host_path"] for d in container["devices"]} == {"/dev/vfio/vfio", f"/dev/vfio/{GROUP}"}
        assert (await core.read_namespaced_pod("plugin-launcher", namespace)).spec.node_name == plugin

        # The operator tells each device's tenant the way its node serves it...
        devices = Custom(api, "nodepcidevices")

        async def assigned_says(name: str) -> str:
            found = await devices.get(name) or {}
            return next((c["message"] for c in (found.get("status") or {}).get("conditions") or [] if c["type"] == "Assigned"), "")

        assert f"deviceClassName {device_class}" in await assigned_says(on_dra)
        assert f"set deviceName {resource}" in await assigned_says(on_plugin)

        # ...and KubeVirt gets the DRA gates and the entry of the device-plugin node's device alone.
        async def kubevirt_mixed():
            kv = await mixed.get("kubevirt", namespace) or {}
            configuration = (kv.get("spec") or {}).get("configuration") or {}
            gates = (configuration.get("developerConfiguration") or {}).get("featureGates") or []
            entries = {e["resourceName"] for e in (configuration.get("permittedHostDevices") or {}).get("pciHostDevices") or []}
            return {"HostDevicesWithDRA", "GPUsWithDRA"} <= set(gates) and resource in entries and exclusive_resource_name(on_dra) not in entries

        await support.wait_for(kubevirt_mixed, 30, 0.2, what="KubeVirt's DRA gates and the device-plugin node's entry alone")
    finally:
        for pod in ("dra-launcher", "plugin-launcher"):
            with contextlib.suppress(client.exceptions.ApiException):
                await support.delete_pod(api, namespace, pod)
        if claimed:
            await delete_claim(session_of(api), namespace, "vm-gpu")
        await support.assign(api, on_dra, "")
        await support.assign(api, on_plugin, "")


async def assigned_gpu(api, node: str, namespace: str) -> tuple[str, str]:
    """The node's GPU assigned to `namespace`: its NodePCIDevice's name and its resource."""
    gpu = (await support.reported(api, node, (GPU, AUDIO)))[GPU]
    await support.assign(api, gpu, namespace)
    return gpu, exclusive_resource_name(gpu)


async def node_event(core, node: str, reason: str):
    events = await core.list_namespaced_event("default", field_selector=f"involvedObject.name={node}")
    return next((e for e in events.items if e.reason == reason), None)


async def test_a_node_moved_to_device_plugins_stays_in_dra_while_a_claim_holds_its_device_then_serves_it_as_a_resource(
    api, kubelets, agents, hosts, namespace
):
    # After the test of both nodes: it leaves node `dra` in device-plugin mode.
    core = client.CoreV1Api(api)
    kubelet, agent = kubelets["dra"], agents["dra"]
    node = kubelet.node_name
    gpu, resource = await assigned_gpu(api, node, namespace)
    device_class = f"passthrough-{namespace}"
    await support.wait_for(lambda: _class_exists(api, device_class), 30, 0.2, what=f"DeviceClass {device_class}")
    await create_claim(api, namespace, claim("held-gpu", device_class))
    await support.create_pod(api, namespace, claim_pod("held-launcher", "held-gpu"))
    await created(core, namespace, kubelet, "held-launcher", timeout=60)
    checkpoint = kubelet.root_dir / "plugins" / DRIVER / "checkpoint.json"
    try:
        # The admin moves the node to device plugins and its agent restarts: the claim's pod still
        # runs, so the node stays a DRA node, says why, and serves no resource a second pod could get.
        await core.patch_node(node, {"metadata": {"labels": {MODE_LABEL: "device-plugin"}}})
        said = f"Node {node}'s label {MODE_LABEL} is now 'device-plugin': this agent serves in dra mode until it starts again"
        await support.wait_for(lambda: _said(agent, said), 30, 0.2, what="the running agent saying the label waits for its restart")
        assert agent.stop() == 0
        agent.start()
        event = await support.wait_for(lambda: node_event(core, node, "ModeChangeWaiting"), 30, 0.2,
                                       what=lambda: f"ModeChangeWaiting on {node}; agent log:\n{agent.output()[-3000:]}")  # fmt: skip
        assert event.type == "Warning"
        assert f"claim {namespace}/held-gpu still holds devices it served in dra mode" in event.message
        assert await serving(core, node) == "dra" and agent.alive()
        assert not list(kubelet.device_plugin_dir.glob("passthrough-*"))
        assert resource not in await resources(core, node)

        # Its pod and claim gone (the DRA driver, still serving, unprepared it), the next start serves
        # the device as its resource, and a launcher pod gets it.
        await support.delete_pod(api, namespace, "held-launcher")
        await delete_claim(session_of(api), namespace, "held-gpu")
        await support.wait_for(lambda: _empty(checkpoint), 30, 0.2, what="the claim unprepared")
        assert agent.stop() == 0
        agent.start()
        await support.wait_for(lambda: _is(serving(core, node), "device-plugin"), 30, 0.2,
                               what=lambda: f"{node} serving device plugins; agent log:\n{agent.output()[-3000:]}")  # fmt: skip
        await wait_resources(core, node, {resource: "1"}, agent)
        await support.create_pod(api, namespace, support.launcher_pod("moved-launcher", resource))
        container = await created(core, namespace, kubelet, "moved-launcher", timeout=60)
        assert container["envs"][resource_env_name(resource)] == GPU
        assert hosts["dra"].driver(GPU) == "vfio-pci"
    finally:
        for pod in ("held-launcher", "moved-launcher"):
            with contextlib.suppress(client.exceptions.ApiException):
                await support.delete_pod(api, namespace, pod)
        await delete_claim(session_of(api), namespace, "held-gpu")
        await support.assign(api, gpu, "")


async def test_a_node_moved_to_dra_stays_on_device_plugins_while_a_pod_holds_its_device_then_publishes_it(
    api, kubelets, agents, namespace
):
    # The other way, on node `plugin` (left in DRA mode): the pod that holds the device is found in the
    # kubelet's PodResources.
    core = client.CoreV1Api(api)
    kubelet, agent = kubelets["plugin"], agents["plugin"]
    node = kubelet.node_name
    gpu, resource = await assigned_gpu(api, node, namespace)
    try:
        await wait_resources(core, node, {resource: "1"}, agent)
        await support.create_pod(api, namespace, support.launcher_pod("held-by-pod", resource))
        await created(core, namespace, kubelet, "held-by-pod", timeout=60)
        await core.patch_node(node, {"metadata": {"labels": {MODE_LABEL: "dra"}}})
        assert agent.stop() == 0
        agent.start()
        event = await support.wait_for(lambda: node_event(core, node, "ModeChangeWaiting"), 30, 0.2,
                                       what=lambda: f"ModeChangeWaiting on {node}; agent log:\n{agent.output()[-3000:]}")  # fmt: skip
        assert f"pod {namespace}/held-by-pod ({resource}) still holds devices it served in device-plugin mode" in event.message
        assert await serving(core, node) == "device-plugin" and await live_slice(api, node) is None

        await support.delete_pod(api, namespace, "held-by-pod")
        assert agent.stop() == 0
        agent.start()

        async def published():
            found = await live_slice(api, node)
            return [d["name"] for d in ((found or {}).get("spec") or {}).get("devices") or []] == [DEVICE]

        await support.wait_for(published, 30, 0.2, what=lambda: f"{node}'s slice; agent log:\n{agent.output()[-3000:]}")
        assert await serving(core, node) == "dra"
    finally:
        with contextlib.suppress(client.exceptions.ApiException):
            await support.delete_pod(api, namespace, "held-by-pod")
        await support.assign(api, gpu, "")


async def _said(agent, line: str) -> bool:
    return line in agent.output()


async def _empty(checkpoint: Path) -> bool:
    return not checkpoint.exists() or checkpoint.read_text().strip() in ("{}", "")


async def test_a_mode_label_that_names_no_mode_gets_a_warning_on_the_node_and_the_default(api, cluster, node, tmp_path):
    core = client.CoreV1Api(api)
    await core.patch_node(node.name, {"metadata": {"labels": {MODE_LABEL: "DRA"}}})
    host = fakesysfs.gpu_node(tmp_path / "host")
    proc = AgentProcess(cluster, tmp_path / "agent.log", node.name, host, PCI_IDS, "--per-node-mode").start()
    try:
        await support.wait_for(lambda: _is(serving(core, node.name), "device-plugin"), 30, 0.2,
                               what=lambda: f"{node.name} served in the default mode; agent log:\n{proc.output()[-3000:]}")  # fmt: skip

        event = await support.wait_for(lambda: node_event(core, node.name, "ModeLabelNotFollowed"), 30, 0.2,
                                       what="a Warning Event on the Node")
        assert event.type == "Warning" and event.involved_object.kind == "Node"
        assert f"label {MODE_LABEL}=DRA is neither dra nor device-plugin" in event.message
        assert "Set it to dra or device-plugin, or remove it" in event.message
        assert proc.alive()
    finally:
        assert proc.stop() == 0
        assert "Traceback" not in proc.output()


async def _is(value, expected: str) -> bool:
    return await value == expected


async def _class_exists(api, name: str) -> bool:
    try:
        await session_of(api).request("GET", f"{RESOURCE}/deviceclasses/{name}")
    except ApiError:
        return False
    return True
