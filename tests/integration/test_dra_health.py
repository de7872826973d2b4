"""A claim's pod hears when its device falls ill, against the real parts (KEP-4680).

The agent's DRA driver registers the DRAResourceHealth service with the real kubelet, which opens
its health stream; when a prepared claim's device falls ill (a member of its IOMMU group loses
its link, as `test_dra`'s taint test makes it), the kubelet shows the device Unhealthy, with
the driver's reason, in the pod's `status.containerStatuses[].allocatedResourcesStatus`, and
Healthy again once it recovers; the slice taints it meanwhile. A device that falls off the bus
is tainted NoExecute, and the real kube-controller-manager evicts the pods that hold it. Same
GPU node, kubelet and agent as `test_dra`.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e import support
from e2e.support import created
from passthrough.dra import health as dra_health
from passthrough.kube.client import session_of
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node, its kubelet and the agent in DRA mode)
    AUDIO, GPU, RESOURCE, agent, claim, claim_pod, create_claim, create_namespace_class, delete_claim, gpu_host, kubelet,
    published, read_claim, taints,
)  # fmt: skip

pytestmark = pytest.mark.cluster
DEVICE = "pci-0000-af-00-0"
RESOURCE_NAME = "claim:gpu/gpu"  # the pod's claim `gpu`, its request `gpu`, as the kubelet names it
LINK_DOWN = {"key": "passthrough.io/unhealthy", "value": "LinkDown", "effect": "NoSchedule"}
KUBELET_SYNC = 10  # seconds between the test kubelet's pod syncs (its syncFrequency), each one rewriting the status


def health_pod(name: str, claim_name: str) -> dict:
    """test_dra's claim pod, its container naming the claim's request too."""
    pod = claim_pod(name, claim_name)
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu", "request": "gpu"}]
    return pod


async def device_health(api, namespace: str, pod: str) -> list[dict]:
    """The pod's allocatedResourcesStatus entries for the claim's request (health, message, resourceID)."""
    found = await session_of(api).request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
    statuses = (found.get("status") or {}).get("containerStatuses") or []
    return [
        resource
        for status in statuses
        for entry in status.get("allocatedResourcesStatus") or []
        if entry.get("name") == RESOURCE_NAME
        for resource in entry.get("resources") or []
    ]


async def health_shown(api, agent, namespace: str, pod: str, health: str, timeout: float = 60) -> dict:
    """Until the pod shows its one claimed device as `health`; that entry."""
    last: list[dict] = []

    async def shown():
        last[:] = await device_health(api, namespace, pod)
        return last[0] if len(last) == 1 and last[0].get("health") == health else None

    return await support.wait_for(shown, timeout, 0.2,
                                  what=lambda: f"{pod} showing {RESOURCE_NAME} {health} (it shows {last}); "
                                               f"agent log:\n{agent.output()[-3000:]}")  # fmt: skip


async def health_kept(api, namespace: str, pod: str, health: str, seconds: float) -> None:
    """The pod shows its device as `health` at every look for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        resources = await device_health(api, namespace, pod)
        assert [r.get("health") for r in resources] == [health], f"{pod} shows {resources}, not {health}"
        await asyncio.sleep(1)


async def test_a_pod_sees_its_claimed_device_fall_ill_and_recover(api, kubelet, agent, gpu_host, namespace, unique):
    host, _ = gpu_host
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {DEVICE: namespace})
    device_class = f"passthrough-health-{unique}"
    await create_namespace_class(api, device_class, namespace)
    try:
        await create_claim(api, namespace, claim("watched", device_class))
        await support.create_pod(api, namespace, health_pod("watched-launcher", "watched"))
        await created(client.CoreV1Api(api), namespace, kubelet, "watched-launcher", timeout=60)
        uid = (await read_claim(api, namespace, "watched"))["metadata"]["uid"]

        fine = await health_shown(api, agent, namespace, "watched-launcher", "Healthy")
        assert fine["resourceID"] == f"passthrough.io/vfio={uid}-{DEVICE}"  # the kubelet names it by its first CDI device
        assert not fine.get("message")
        # Nothing changes past the kubelet's timeout and its next pod syncs: still Healthy, not
        # Unknown (the kubelet forgets a report older than the timeout; the driver sends it again).
        await health_kept(api, namespace, "watched-launcher", "Healthy", dra_health.TIMEOUT + 2 * KUBELET_SYNC)

        # Its audio function (a member of its IOMMU group) loses its link: the pod holding the GPU hears why.
        host.write_attribute(AUDIO, "current_link_width", "0")
        try:
            ill = await health_shown(api, agent, namespace, "watched-launcher", "Unhealthy")
            assert ill["message"] == f"{AUDIO}'s PCIe link is down (current_link_width 0)"
            assert ill["resourceID"] == fine["resourceID"]
            # ... and no new claim gets it: tainted NoSchedule (the pod that holds it stays).
            await taints(api, kubelet, agent, {DEVICE: [LINK_DOWN]})
        finally:
            host.write_attribute(AUDIO, "current_link_width", "16")
        await health_shown(api, agent, namespace, "watched-launcher", "Healthy")
        await taints(api, kubelet, agent, {DEVICE: []})
    finally:
        await support.delete_pod(api, namespace, "watched-launcher")  # the pod first: it holds the claim
        await delete_claim(session, namespace, "watched")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def test_a_device_that_fell_off_the_bus_has_the_pods_that_hold_it_evicted(api, kubelet, agent, gpu_host, namespace, unique):
    """NoExecute: kube-controller-manager's device taint eviction deletes the pod of a claim that
    holds a device gone dead (its VM has lost it), and says so on the pod."""
    host, _ = gpu_host
    core = client.CoreV1Api(api)
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {DEVICE: namespace})
    device_class = f"passthrough-dead-{unique}"
    await create_namespace_class(api, device_class, namespace)
    config = host.device_dir(AUDIO) / "config"  # the fixture host has none: nothing to read, nothing wrong
    try:
        await create_claim(api, namespace, claim("dead", device_class))
        await support.create_pod(api, namespace, health_pod("dead-launcher", "dead"))
        await created(core, namespace, kubelet, "dead-launcher", timeout=60)
        config.write_bytes(b"\xff" * 64)  # the audio function reads all ones: the group fell off the bus
        try:
            await taints(api, kubelet, agent, {DEVICE: [{"key": "passthrough.io/unhealthy", "value": "FellOffBus", "effect": "NoExecute"}]})

            async def evicted():
                events = await core.list_namespaced_event(namespace, field_selector="involvedObject.name=dead-launcher")
                return [e for e in events.items if e.reason == "DeviceTaintManagerEviction"]

            await support.wait_for(evicted, 60, 0.2, what="kube-controller-manager's eviction of the pod")
            await support.wait_for(lambda: _gone(core, namespace, "dead-launcher"), 60, 0.2, what="the evicted pod deleted")
        finally:
            config.unlink()
        await taints(api, kubelet, agent, {DEVICE: []})
    finally:
        await support.delete_pod(api, namespace, "dead-launcher")
        await delete_claim(session, namespace, "dead")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def _gone(core, namespace: str, name: str) -> bool:
    try:
        await core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        return exc.status == 404
    return False
