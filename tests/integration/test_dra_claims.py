"""The DRA driver as the node's last gate, against the real kubelet: whatever a claim's status
says, a device (and its IOMMU group) is prepared for one claim at a time, and never with
adminAccess.

The allocations here are written into the claims' status as the scheduler would write them, and
no webhook judges them: a race of the scheduler's, or a pod force-deleted before the kubelet
unprepared its claim, leaves the API saying exactly this. The kubelet asks the agent's driver to
prepare them; the fake runtime records which containers it was asked to create, with which CDI
devices.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from e2e import support
from e2e.support import created
from passthrough.dra import cdi
from passthrough.dra.slice import DRIVER
from passthrough.kube.client import session_of
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node, its kubelet and the agent in DRA mode)
    AUDIO, GPU, GROUP, RESOURCE, agent, cdi_dir, claim, claim_pod, create_claim, create_namespace_class, delete_claim,
    gpu_host, kubelet, published, read_claim,
)  # fmt: skip

pytestmark = pytest.mark.cluster
DEVICE = "pci-0000-af-00-0"


async def allocate(api, namespace: str, name: str, node: str, pod: client.V1Pod, **result: object) -> None:
    """Write into claim `name` the allocation of DEVICE and its reservation for `pod`, as the
    scheduler writes them."""
    body = await read_claim(api, namespace, name)
    body["status"] = {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": DEVICE, **result}]}},
        "reservedFor": [{"resource": "pods", "name": pod.metadata.name, "uid": pod.metadata.uid}],
    }
    await session_of(api).request("PUT", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}/status", body=body)


def on_node(body: dict, node: str) -> dict:
    """A pod the scheduler never sees: it is on `node` already."""
    return {**body, "spec": {**body["spec"], "nodeName": node}}


async def refused(api, agent, namespace: str, pod: str, words: str) -> str:
    """The kubelet's Event on `pod` that says `words` (its report of a prepare the driver refused), once there."""

    async def said():
        events = await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}")
        return next((e.message for e in events.items if words in (e.message or "")), None)

    return await support.wait_for(said, 60, 0.2, what=lambda: f"the kubelet's report of the refused prepare; agent log:\n"
                                                             f"{agent.output()[-3000:]}")  # fmt: skip


def containers_of(kubelet, pod: str) -> list[dict]:
    return [c for c in kubelet.created_containers() if c.get("envs", {}).get("MARK") == pod]


async def test_a_device_prepared_for_one_claim_is_not_prepared_for_a_second_whatever_the_api_says(
    api, kubelet, agent, gpu_host, namespace, unique
):
    core = client.CoreV1Api(api)
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {DEVICE: namespace})
    device_class = f"passthrough-twice-{unique}"
    await create_namespace_class(api, device_class, namespace)
    try:
        # The first claim gets the GPU the ordinary way, and its pod runs.
        await create_claim(api, namespace, claim("first", device_class))
        await support.create_pod(api, namespace, claim_pod("first-launcher", "first"))
        await created(core, namespace, kubelet, "first-launcher", timeout=60)

        # The same device written into a second claim of the same namespace, reserved for a pod
        # on the node: the kubelet asks the driver to prepare it, and the driver refuses.
        await create_claim(api, namespace, claim("second", device_class))
        second = await support.create_pod(api, namespace, on_node(claim_pod("second-launcher", "second"), kubelet.node_name))
        await allocate(api, namespace, "second", kubelet.node_name, second)
        refusal = await refused(api, agent, namespace, "second-launcher", "is prepared for claim")
        assert (f"device {DEVICE} ({GPU}, IOMMU group {GROUP}) is prepared for claim {namespace}/first: a device and its "
                "IOMMU group go to one claim at a time") in refusal, refusal  # fmt: skip
        assert not containers_of(kubelet, "second-launcher")
        uid = (await read_claim(api, namespace, "second"))["metadata"]["uid"]
        assert not list(cdi_dir(kubelet).glob(f"*{uid}*"))

        # Once the first pod is gone and its claim unprepared, the kubelet's next try prepares the second.
        await support.delete_pod(api, namespace, "first-launcher")
        container = await created(core, namespace, kubelet, "second-launcher", timeout=90)
        edits = cdi.resolve(cdi_dir(kubelet), container["cdi_devices"])
        assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/vfio/vfio", f"/dev/vfio/{GROUP}"]
        assert len(containers_of(kubelet, "first-launcher")) == 1
    finally:
        for pod in ("second-launcher", "first-launcher"):
            await support.delete_pod(api, namespace, pod)
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="the claims unprepared")
        for name in ("second", "first"):
            await delete_claim(session, namespace, name)
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def test_an_allocation_with_admin_access_is_not_prepared(api, kubelet, agent, gpu_host, namespace, unique):
    """adminAccess reaches a device whoever holds it; VFIO gives a device to one VM. The webhook
    refuses such an allocation; the driver refuses to prepare one that got past it."""
    core = client.CoreV1Api(api)
    session = session_of(api)
    # The API server lets a claim ask for adminAccess only in a namespace labelled for it.
    await core.patch_namespace(namespace, {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}})
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {DEVICE: namespace})
    device_class = f"passthrough-admin-{unique}"
    await create_namespace_class(api, device_class, namespace)
    try:
        await create_claim(api, namespace, claim("peek", device_class, adminAccess=True))
        pod = await support.create_pod(api, namespace, on_node(claim_pod("peek-launcher", "peek"), kubelet.node_name))
        await allocate(api, namespace, "peek", kubelet.node_name, pod, adminAccess=True)
        refusal = await refused(api, agent, namespace, "peek-launcher", "adminAccess")
        assert f"device {DEVICE} ({GPU}) is allocated with adminAccess, which passthrough devices do not allow" in refusal
        assert not containers_of(kubelet, "peek-launcher")
        uid = (await read_claim(api, namespace, "peek"))["metadata"]["uid"]
        assert not list(cdi_dir(kubelet).glob(f"*{uid}*"))
    finally:
        await support.delete_pod(api, namespace, "peek-launcher")
        await delete_claim(session, namespace, "peek")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def _unprepared(kubelet) -> bool:
    return not list(cdi_dir(kubelet).glob("*.json"))
