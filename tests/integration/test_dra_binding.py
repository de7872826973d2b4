"""Binding conditions against the real kube-scheduler and kubelet: the scheduler binds a pod that
was allocated one of our devices only once the agent's DRA driver has moved the device's whole
IOMMU group to vfio-pci and said `VFIOBound` in the claim's status; a group that will not move
answers `VFIOBindFailed`, the scheduler takes the allocation back, and the pod goes to another
device (the failed one is tainted a while, so the next try does not take it again).

The fake kernel makes the group's move slow (a probe that takes seconds) or impossible (a member
whose driver_override refuses writes); the fake runtime records the containers made.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from e2e import support
from e2e.support import created
from passthrough.dra import health as dra_health
from passthrough.dra.slice import BIND_FAILED, BOUND, DRIVER
from passthrough.kube.client import session_of
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node, its kubelet and the agent in DRA mode)
    AUDIO, GPU, GROUP, OTHER_GPU, RESOURCE, agent, claim, claim_pod, create_claim, create_namespace_class, delete_claim,
    gpu_host, kubelet, published, read_claim, taints,
)  # fmt: skip

pytestmark = pytest.mark.cluster
DEVICE = "pci-0000-af-00-0"
OTHER_DEVICE = "pci-0000-3b-00-0"
OTHER_AUDIO = "0000:3b:00.1"  # in OTHER_GPU's IOMMU group
PROBE = 3.0  # seconds the audio function's probe by vfio-pci takes: the group's move is slow


def device_status(claim_body: dict, node: str, device: str) -> dict[str, dict]:
    """The conditions (by type) our driver wrote for `device` in the claim's status.devices."""
    for entry in (claim_body.get("status") or {}).get("devices") or []:
        if (entry.get("driver"), entry.get("pool"), entry.get("device")) == (DRIVER, node, device):
            return {c["type"]: c for c in entry.get("conditions") or []}
    return {}


async def events_of(api, namespace: str, pod: str) -> list[str]:
    events = await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}")
    return [f"{e.reason}: {e.message}" for e in events.items]


async def test_the_pod_is_bound_only_once_the_devices_whole_iommu_group_is_on_vfio_pci(
    api, kubelet, agent, gpu_host, namespace, unique
):
    host, _ = gpu_host
    core = client.CoreV1Api(api)
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    found = await published(api, kubelet, agent, {DEVICE: namespace})
    [device] = found["spec"]["devices"]
    assert (device["bindingConditions"], device["bindingFailureConditions"]) == ([BOUND], [BIND_FAILED])
    assert host.driver(GPU) == "nvidia"
    device_class = f"passthrough-binding-{unique}"
    await create_namespace_class(api, device_class, namespace)
    host.set_probe_time(AUDIO, PROBE)
    try:
        await create_claim(api, namespace, claim("vm-gpu", device_class))
        await support.create_pod(api, namespace, claim_pod("bound-launcher", "vm-gpu"))
        seen: list[tuple[bool, bool]] = []  # (pod bound to the node, group on vfio-pci), once the claim is allocated

        async def bound():
            on_vfio = (host.driver(GPU), host.driver(AUDIO)) == ("vfio-pci", "vfio-pci")
            pod = await core.read_namespaced_pod("bound-launcher", namespace)
            allocated = (await read_claim(api, namespace, "vm-gpu")).get("status", {}).get("allocation")
            if allocated:
                seen.append((bool(pod.spec.node_name), on_vfio))
            return pod.spec.node_name

        assert await support.wait_for(bound, 90, 0.1, what=lambda: f"the pod bound; agent log:\n{agent.output()[-3000:]}") == kubelet.node_name
        # Allocated, and the pod waited unbound while the group moved; never bound before it was there.
        assert (False, False) in seen, seen
        assert all(on_vfio for pod_bound, on_vfio in seen if pod_bound), seen
        body = await read_claim(api, namespace, "vm-gpu")
        [result] = body["status"]["allocation"]["devices"]["results"]
        assert (result["device"], result["bindingConditions"], result["bindingFailureConditions"]) == (DEVICE, [BOUND], [BIND_FAILED])
        conditions = device_status(body, kubelet.node_name, DEVICE)
        assert list(conditions) == [BOUND] and conditions[BOUND]["status"] == "True", conditions
        assert conditions[BOUND]["message"] == f"IOMMU group {GROUP} ({GPU}, {AUDIO}) is on vfio-pci"
        assert any(e.startswith("BindingConditionsPending") for e in await events_of(api, namespace, "bound-launcher"))
        container = await created(core, namespace, kubelet, "bound-launcher", timeout=60)
        assert f"passthrough.io/vfio={body['metadata']['uid']}-{DEVICE}" in container["cdi_devices"]
    finally:
        host.set_probe_time(AUDIO, None)
        await support.delete_pod(api, namespace, "bound-launcher")
        await delete_claim(session, namespace, "vm-gpu")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def test_a_group_that_will_not_go_to_vfio_pci_fails_the_binding_and_the_pod_gets_another_device(
    api, kubelet, agent, gpu_host, namespace, unique
):
    """Last in the module: OTHER_GPU's group is left unable to move."""
    host, _ = gpu_host
    core = client.CoreV1Api(api)
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO, OTHER_GPU))
    await support.assign(api, names[OTHER_GPU], namespace)
    await published(api, kubelet, agent, {OTHER_DEVICE: namespace})
    device_class = f"passthrough-bindfail-{unique}"
    await create_namespace_class(api, device_class, namespace)
    host.refuse_writes(OTHER_AUDIO, "driver_override")  # a member that vfio-pci cannot be given
    try:
        await create_claim(api, namespace, claim("vm-gpu", device_class))
        await support.create_pod(api, namespace, claim_pod("failed-launcher", "vm-gpu"))
        # The only device offered is allocated, its group will not move: the driver says so and
        # taints it, so no claim is allocated it for a while.
        await taints(api, kubelet, agent, {OTHER_DEVICE: [{"key": dra_health.TAINT_KEY, "value": "VFIOBindFailed",
                                                           "effect": "NoSchedule"}]})  # fmt: skip
        assert f"device {OTHER_DEVICE}: {BIND_FAILED}=True (binding IOMMU group 20" in agent.output()
        assert not (await core.read_namespaced_pod("failed-launcher", namespace)).spec.node_name

        # The scheduler took the allocation back; another device of the namespace appears, and the pod gets it.
        await support.assign(api, names[GPU], namespace)
        container = await created(core, namespace, kubelet, "failed-launcher", timeout=120)
        body = await read_claim(api, namespace, "vm-gpu")
        [result] = body["status"]["allocation"]["devices"]["results"]
        assert result["device"] == DEVICE
        assert device_status(body, kubelet.node_name, DEVICE)[BOUND]["status"] == "True"
        assert f"passthrough.io/vfio={body['metadata']['uid']}-{DEVICE}" in container["cdi_devices"]
        assert (host.driver(GPU), host.driver(AUDIO)) == ("vfio-pci", "vfio-pci")
    finally:
        await support.delete_pod(api, namespace, "failed-launcher")
        await delete_claim(session, namespace, "vm-gpu")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    for address in (GPU, OTHER_GPU):
        await support.assign(api, names[address], "")
    await published(api, kubelet, agent, {})
