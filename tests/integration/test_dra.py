"""DRA mode against the real parts: a claim gets its device through the agent's DRA driver.

The real kubelet (its DRA manager, its plugin watcher) with the fake CRI runtime, the real
kube-scheduler (its DRA allocator) and the API server; the agent runs `--dra` as its own process
over a fixture GPU node whose simulated kernel (`e2e.fakekernel`) moves `driver` links and
creates `/dev/vfio/<group>` as the bind sequence is written, and has its binds done by a
`passthrough binder` process, as the chart's agent pod has them done by its binder container.
The fake runtime records the CDI
device names of each CreateContainer; they are resolved here against the CDI specs the driver
wrote, as a CDI-enabled containerd or CRI-O does.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess, children, start_binder, stop
from e2e.support import created
from passthrough.dra import cdi
from passthrough.dra.slice import DRIVER, PCI_BUS_ID, slice_name
from passthrough.kube.client import ApiError, session_of

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
GPU = "0000:af:00.0"
AUDIO = "0000:af:00.1"
OTHER_GPU = "0000:3b:00.0"  # the node's other A10, NUMA node 0
GROUP = 21
RESOURCE = "/apis/resource.k8s.io/v1"


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    host = fakesysfs.gpu_node(tmp_path_factory.mktemp("gpu-host"))
    with FakeKernel(host) as kernel:
        yield host, kernel


@pytest.fixture(scope="module")
def kubelet(module_kubelet_nodes, kube_scheduler):
    return module_kubelet_nodes()


def cdi_dir(kubelet) -> Path:
    return kubelet.var_dir / "run" / "cdi"  # what the runtime sees as /var/run/cdi


@pytest.fixture(scope="module")
def agent(cluster, kubelet, gpu_host, tmp_path_factory, operator):
    host, _ = gpu_host
    folder = tmp_path_factory.mktemp("agent")
    with (folder / "binder.log").open("ab") as log:
        binder = start_binder(folder / "binder.sock", host, stdout=log)
    proc = AgentProcess(cluster, folder / "agent.log", kubelet.node_name, host, PCI_IDS,
                        "--dra", f"--kubelet-dir={kubelet.root_dir}", f"--cdi-dir={cdi_dir(kubelet)}",
                        "--rescan-interval=1s", f"--binder-socket={folder / 'binder.sock'}", kubelet=kubelet).start()  # fmt: skip
    proc.binder = binder
    yield proc
    code = proc.stop()
    output = proc.output()
    stop(binder)
    assert code == 0 and "Traceback" not in output, output[-5000:]
    assert not (kubelet.root_dir / "plugins_registry" / f"{DRIVER}-reg.sock").exists()
    assert "Traceback" not in (folder / "binder.log").read_text()


async def live_slice(api, kubelet) -> dict | None:
    try:
        return await session_of(api).request("GET", f"{RESOURCE}/resourceslices/{slice_name(kubelet.node_name)}")
    except Exception:
        return None


async def published(api, kubelet, agent, want: dict[str, str]) -> dict:
    """Until the node's slice lists exactly `want` (device name -> passthrough.io/namespace)."""

    async def matches():
        found = await live_slice(api, kubelet)
        devices = {d["name"]: d["attributes"]["passthrough.io/namespace"]["string"] for d in ((found or {}).get("spec") or {}).get("devices") or []}
        return found if devices == want else None

    return await support.wait_for(matches, 30, 0.2, what=lambda: f"ResourceSlice with {want}; agent log:\n{agent.output()[-3000:]}")


def claim(name: str, device_class: str, **request: object) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class, **request}}]}},
    }  # fmt: skip


async def create_claim(api, namespace: str, body: dict) -> dict:
    return await session_of(api).request("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaims", body=body)


async def read_claim(api, namespace: str, name: str) -> dict:
    return await session_of(api).request("GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}")


async def create_namespace_class(api, name: str, namespace: str) -> None:
    """A DeviceClass of our driver's devices handed out to `namespace`."""
    await session_of(api).request("POST", f"{RESOURCE}/deviceclasses", body={
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression":
            f'device.driver == "{DRIVER}" && device.attributes["passthrough.io"].namespace == "{namespace}"'}}]},
    })  # fmt: skip


def claim_files(kubelet, uid: str) -> list[Path]:
    """The CDI specs and metadata files the driver wrote for the claim `uid`."""
    return list(cdi_dir(kubelet).glob(f"*{uid}*"))


async def delete_claim(session, namespace: str, name: str) -> None:
    """Delete a claim and wait until it is gone: an allocated claim holds its device from the
    scheduler of every later test, until the namespace's deletion would get to it."""
    path = f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}"
    with contextlib.suppress(ApiError):
        await session.request("DELETE", path)

    async def gone():
        try:
            await session.request("GET", path)
        except ApiError as exc:
            return exc.status == 404
        return False

    await support.wait_for(gone, 30, 0.2, what=f"claim {namespace}/{name} deleted")


def claim_pod(name: str, claim: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [{"name": "compute", "image": "virt-launcher:test", "env": [{"name": "MARK", "value": name}],
                            "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }  # fmt: skip


async def claimed_pod(api, kubelet, namespace: str, device_class: str, name: str) -> str:
    """A claim `name` through `device_class` and its launcher-shaped pod `<name>-launcher`, until
    the kubelet has created the pod's container; the claim's uid."""
    await create_claim(api, namespace, claim(name, device_class))
    await support.create_pod(api, namespace, claim_pod(f"{name}-launcher", name))
    await created(client.CoreV1Api(api), namespace, kubelet, f"{name}-launcher", timeout=60)
    return (await read_claim(api, namespace, name))["metadata"]["uid"]


async def test_an_assigned_gpu_is_published_for_its_namespace_and_a_claim_gets_it_through_cdi(
    api, kubelet, agent, gpu_host, namespace, unique
):
    host, _ = gpu_host
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    # Nothing handed out, the node not in GPU mode: nothing to offer, and nothing bound.
    await published(api, kubelet, agent, {})
    await support.assign(api, names[GPU], namespace)
    found = await published(api, kubelet, agent, {"pci-0000-af-00-0": namespace})
    [device] = found["spec"]["devices"]
    assert device["attributes"][PCI_BUS_ID] == {"string": GPU}
    assert device["attributes"]["passthrough.io/iommuGroup"] == {"int": GROUP}
    assert device["attributes"]["passthrough.io/vendorID"] == {"string": "10de"}
    assert device["attributes"]["passthrough.io/numaNode"] == {"int": 1}
    assert found["spec"]["pool"]["name"] == kubelet.node_name and found["spec"]["nodeName"] == kubelet.node_name
    assert host.driver(GPU) == "nvidia"  # bound at prepare, not before

    device_class = f"passthrough-{unique}"
    await create_namespace_class(api, device_class, namespace)
    try:
        await create_claim(api, namespace, claim("vm-gpu", device_class))
        await support.create_pod(api, namespace, claim_pod("vm-launcher", "vm-gpu"))
        container = await created(client.CoreV1Api(api), namespace, kubelet, "vm-launcher", timeout=60)

        allocated = await read_claim(api, namespace, "vm-gpu")
        [result] = allocated["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (DRIVER, kubelet.node_name, "pci-0000-af-00-0")
        uid = allocated["metadata"]["uid"]
        assert sorted(container["cdi_devices"]) == sorted([f"passthrough.io/vfio={uid}-pci-0000-af-00-0",
                                                           f"{DRIVER}/metadata={uid}_gpu"])  # fmt: skip
        edits = cdi.resolve(cdi_dir(kubelet), container["cdi_devices"])
        assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/vfio/vfio", f"/dev/vfio/{GROUP}"]
        # The whole IOMMU group went to vfio-pci, the audio function too, and /dev/vfio/<group> is there.
        assert (host.driver(GPU), host.driver(AUDIO)) == ("vfio-pci", "vfio-pci")
        assert (host.root / "dev" / "vfio" / str(GROUP)).exists()
        # Moved by the binder (a child of it holds the agent's connection), as the chart's agent
        # container, which sees sysfs read-only, needs.
        assert children(agent.binder.pid), "the driver did not ask the binder"

        [mount] = edits["mounts"]
        assert mount["containerPath"] == f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-gpu/gpu/{DRIVER}-metadata.json"
        objects = cdi.read_stream(Path(mount["hostPath"]).read_text())
        assert [o["apiVersion"] for o in objects] == ["metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"]
        for obj in objects:
            [request] = obj["requests"]
            [meta_device] = request["devices"]
            assert (request["name"], meta_device["driver"], meta_device["name"]) == ("gpu", DRIVER, "pci-0000-af-00-0")
            assert meta_device["attributes"][PCI_BUS_ID] == {"string": GPU}
            assert obj["metadata"]["uid"] == uid

        # The pod ends: the kubelet unprepares, the claim's files go; the group stays on vfio-pci
        # while the device is handed out, and goes back once it is not.
        await support.delete_pod(api, namespace, "vm-launcher")

        async def unprepared():
            return not claim_files(kubelet, uid)

        await support.wait_for(unprepared, 30, what=lambda: f"the claim's CDI specs removed; agent log:\n{agent.output()[-3000:]}")
        assert not Path(mount["hostPath"]).exists()
        assert host.driver(GPU) == "vfio-pci"
    finally:
        await delete_claim(session, namespace, "vm-gpu")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})

    async def given_back():
        return (host.driver(GPU), host.driver(AUDIO)) == ("nvidia", "snd_hda_intel")

    await support.wait_for(given_back, 30, what=lambda: f"group {GROUP} given back; agent log:\n{agent.output()[-3000:]}")


async def test_a_claim_aligns_two_gpus_by_the_standard_pcie_root_and_numa_node_attributes(
    api, kubelet, agent, gpu_host, namespace, unique
):
    """resource.kubernetes.io/pcieRoot and numaNode as Kubernetes defines them, read by the real
    scheduler: the node's two A10s hang off one root complex (pci0000:00) on NUMA nodes 0 and 1,
    so two requests constrained to one pcieRoot are allocated, two constrained to one NUMA node
    are not."""
    core = client.CoreV1Api(api)
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO, OTHER_GPU))
    for address in (GPU, OTHER_GPU):
        await support.assign(api, names[address], namespace)
    found = await published(api, kubelet, agent, {"pci-0000-af-00-0": namespace, "pci-0000-3b-00-0": namespace})
    attributes = {d["name"]: d["attributes"] for d in found["spec"]["devices"]}
    assert attributes["pci-0000-af-00-0"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert attributes["pci-0000-af-00-0"]["resource.kubernetes.io/numaNode"] == {"int": 1}
    assert attributes["pci-0000-3b-00-0"]["resource.kubernetes.io/numaNode"] == {"int": 0}
    device_class = f"passthrough-aligned-{unique}"
    await create_namespace_class(api, device_class, namespace)

    def pair(name: str, attribute: str) -> dict:
        body = claim(name, device_class)
        body["spec"]["devices"]["requests"].append({"name": "gpu2", "exactly": {"deviceClassName": device_class}})
        body["spec"]["devices"]["constraints"] = [{"matchAttribute": f"resource.kubernetes.io/{attribute}"}]
        return body

    try:
        await create_claim(api, namespace, pair("same-numa", "numaNode"))
        await support.create_pod(api, namespace, claim_pod("numa-launcher", "same-numa"))

        async def unschedulable():
            pod = await core.read_namespaced_pod("numa-launcher", namespace)
            return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in pod.status.conditions or [])

        await support.wait_for(unschedulable, 60, 0.2, what="two GPUs on one NUMA node found impossible")
        await support.delete_pod(api, namespace, "numa-launcher")
        await delete_claim(session, namespace, "same-numa")

        await create_claim(api, namespace, pair("same-root", "pcieRoot"))
        await support.create_pod(api, namespace, claim_pod("root-launcher", "same-root"))
        await created(core, namespace, kubelet, "root-launcher", timeout=90)
        results = (await read_claim(api, namespace, "same-root"))["status"]["allocation"]["devices"]["results"]
        assert sorted(r["device"] for r in results) == ["pci-0000-3b-00-0", "pci-0000-af-00-0"]
    finally:
        await support.delete_pod(api, namespace, "numa-launcher")
        await support.delete_pod(api, namespace, "root-launcher")
        await delete_claim(session, namespace, "same-numa")
        await delete_claim(session, namespace, "same-root")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    for address in (GPU, OTHER_GPU):
        await support.assign(api, names[address], "")
    await published(api, kubelet, agent, {})


async def test_the_resource_slice_at_rest_gets_no_write_per_rescan(api, kubelet, agent, gpu_host, namespace):
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {"pci-0000-af-00-0": namespace})
    await support.quiet(api, ("resourceslices",))
    before = await support.write_counts(api)
    generation = (await live_slice(api, kubelet))["spec"]["pool"]["generation"]
    for _ in range(5):  # rescans every second, and on each SIGHUP
        agent.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(1.0)
    after = await support.write_counts(api)
    assert support.writes_between(before, after, "resourceslices") == 0, support.diff(before, after)
    assert (await live_slice(api, kubelet))["spec"]["pool"]["generation"] == generation
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def taints(api, kubelet, agent, want: dict[str, list[dict]]) -> dict:
    """Until the node's slice lists exactly `want` (device name -> its taints, without the time
    the API server stamps on each)."""

    async def matches():
        found = await live_slice(api, kubelet)
        have = {d["name"]: [{k: v for k, v in t.items() if k != "timeAdded"} for t in d.get("taints") or []]
                for d in ((found or {}).get("spec") or {}).get("devices") or []}  # fmt: skip
        return found if have == want else None

    return await support.wait_for(matches, 30, 0.2, what=lambda: f"ResourceSlice taints {want}; agent log:\n{agent.output()[-3000:]}")


async def test_a_device_that_falls_ill_is_tainted_in_the_slice_and_the_scheduler_leaves_it(
    api, kubelet, agent, gpu_host, namespace, unique
):
    host, _ = gpu_host
    core = client.CoreV1Api(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {"pci-0000-af-00-0": namespace})
    device_class = f"passthrough-ill-{unique}"
    await create_namespace_class(api, device_class, namespace)
    # Its audio function's link goes down (a member of its IOMMU group): no new claim may have it.
    host.write_attribute(AUDIO, "current_link_width", "0")
    try:
        found = await taints(api, kubelet, agent, {"pci-0000-af-00-0": [
            {"key": "passthrough.io/unhealthy", "value": "LinkDown", "effect": "NoSchedule"}]})  # fmt: skip
        [device] = found["spec"]["devices"]
        assert device["taints"][0]["timeAdded"]  # stamped by the API server
        assert "tainted 0000:af:00.0 passthrough.io/unhealthy=LinkDown:NoSchedule in the ResourceSlice" in agent.output()
        assert host.driver(GPU) == "nvidia"  # tainted, not touched
        # The real scheduler does not allocate it to a claim that does not tolerate the taint.
        await create_claim(api, namespace, claim("ill", device_class))
        await support.create_pod(api, namespace, claim_pod("ill-launcher", "ill"))

        async def unschedulable():
            pod = await core.read_namespaced_pod("ill-launcher", namespace)
            return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in pod.status.conditions or [])

        await support.wait_for(unschedulable, 60, 0.2, what="the pod of a claim of the tainted device found unschedulable")
        assert "allocation" not in ((await read_claim(api, namespace, "ill")).get("status") or {})
    finally:
        host.write_attribute(AUDIO, "current_link_width", "16")
    # Healthy again: untainted, and the waiting claim gets it.
    await taints(api, kubelet, agent, {"pci-0000-af-00-0": []})
    try:
        await created(core, namespace, kubelet, "ill-launcher", timeout=90)
    finally:
        await support.delete_pod(api, namespace, "ill-launcher")
        await delete_claim(session_of(api), namespace, "ill")
        await session_of(api).request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def test_a_kubelet_restart_keeps_a_prepared_claim_and_unprepares_it_after(api, kubelet, agent, gpu_host, namespace, unique):
    host, _ = gpu_host
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {"pci-0000-af-00-0": namespace})
    device_class = f"passthrough-restart-{unique}"
    await create_namespace_class(api, device_class, namespace)
    try:
        uid = await claimed_pod(api, kubelet, namespace, device_class, "kept")
        specs = sorted(p.name for p in claim_files(kubelet, uid))
        assert specs and host.driver(GPU) == "vfio-pci"
        containers = sum(1 for c in kubelet.created_containers() if c.get("envs", {}).get("MARK") == "kept-launcher")

        await asyncio.to_thread(kubelet.restart_kubelet)
        # The kubelet wipes its node's slices when it starts: the driver publishes again.
        await published(api, kubelet, agent, {"pci-0000-af-00-0": namespace})
        # The claim stays prepared: its CDI specs, its group on vfio-pci, the container not made again.
        assert sorted(p.name for p in claim_files(kubelet, uid)) == specs
        assert host.driver(GPU) == "vfio-pci"
        assert sum(1 for c in kubelet.created_containers() if c.get("envs", {}).get("MARK") == "kept-launcher") == containers

        # The restarted kubelet still knows it prepared the claim: the pod's end unprepares it.
        await support.delete_pod(api, namespace, "kept-launcher")

        async def unprepared():
            return not claim_files(kubelet, uid)

        await support.wait_for(unprepared, 60, what=lambda: f"the claim's CDI specs removed; agent log:\n{agent.output()[-3000:]}")
    finally:
        await delete_claim(session, namespace, "kept")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})
