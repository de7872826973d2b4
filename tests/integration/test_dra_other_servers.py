"""One server per device, in DRA mode, against the real kubelet: a GPU handed out to a namespace
and published in the node's ResourceSlice leaves the slice when another device plugin registers
with the kubelet serving its address (what `GetAllocatableResources` shows), its NodePCIDevice
says Ready=False ServedByOtherPlugin naming that plugin's resource, a claim allocated it before
is refused at prepare with the same words (and nothing is bound), and it is published again once
that plugin serves it no more."""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from e2e import support
from passthrough.kube.client import session_of
from tests.integration.test_dra import (  # noqa: F401  (fixtures: a DRA agent on a real kubelet)
    AUDIO, GPU, GROUP, RESOURCE, agent, claim, claim_pod, create_claim, delete_claim, gpu_host, kubelet, published,
)
from tests.integration.test_node_isolation import other_plugin, wait_ready

pytestmark = pytest.mark.cluster
OTHER = "example.com/other-gpu"
SLICE_DEVICE = "pci-0000-af-00-0"


async def allocate_for(api, namespace: str, claim_name: str, pod: dict, node: str, device: str) -> None:
    """Write the allocation and reservation the scheduler would have written before the other
    plugin came (the scheduler itself allocates only what the slice offers)."""
    body = {"status": {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": "pci.passthrough.io", "pool": node, "device": device}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        },
        "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}],
    }}  # fmt: skip
    await session_of(api).request("PATCH", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{claim_name}/status",
                                  body=body, content_type="application/merge-patch+json")  # fmt: skip


async def prepare_refused(api, namespace: str, pod: str, agent) -> str:
    """The kubelet's event that our driver refused the pod's claim; its message."""
    core = client.CoreV1Api(api)

    async def refused():
        events = await core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}")
        return next((e.message for e in events.items if e.reason == "FailedPrepareDynamicResources" and OTHER in (e.message or "")), None)

    return await support.wait_for(refused, 90, 0.5, what=lambda: f"prepare of {pod}'s claim refused; agent log:\n{agent.output()[-3000:]}")


async def test_a_device_another_plugin_serves_leaves_the_slice_is_never_prepared_and_comes_back_after(
    api, kubelet, agent, gpu_host, namespace
):
    host, _ = gpu_host
    node = kubelet.node_name
    names = await support.reported(api, node, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {SLICE_DEVICE: namespace})
    try:
        async with other_plugin(kubelet, GPU, GROUP, OTHER) as other:
            # The slice drops it (and its IOMMU group), and its NodePCIDevice names the other server.
            await published(api, kubelet, agent, {})
            cond = await wait_ready(api, node, GPU, "ServedByOtherPlugin", agent, says=OTHER)
            assert cond["status"] == "False"
            audio = await wait_ready(api, node, AUDIO, "ServedByOtherPlugin", agent, says=GPU)
            assert OTHER in audio["message"]

            # A claim allocated it before the plugin came: its prepare is refused, naming the plugin, and nothing is bound.
            await create_claim(api, namespace, claim("before", "passthrough-anything"))
            pod = await support.create_pod(api, namespace, {**claim_pod("early-launcher", "before"),
                                                            "spec": {**claim_pod("early-launcher", "before")["spec"], "nodeName": node}})  # fmt: skip
            await allocate_for(api, namespace, "before", {"metadata": {"name": pod.metadata.name, "uid": pod.metadata.uid}},
                               node, SLICE_DEVICE)  # fmt: skip
            message = await prepare_refused(api, namespace, "early-launcher", agent)
            assert "not this driver's to prepare" in message
            assert (host.driver(GPU), host.driver(AUDIO)) == ("nvidia", "snd_hda_intel")
            await support.delete_pod(api, namespace, "early-launcher")
            await delete_claim(session_of(api), namespace, "before")

            # The plugin lets it go (serves nothing now): ours again.
            other.update([])
            await published(api, kubelet, agent, {SLICE_DEVICE: namespace})
            await wait_ready(api, node, GPU, "Ready", agent)
            await wait_ready(api, node, AUDIO, "Ready", agent)
    finally:
        await support.assign(api, names[GPU], "")
        await published(api, kubelet, agent, {})


async def test_a_device_another_dra_driver_publishes_on_this_node_leaves_our_slice_until_that_slice_goes(
    api, kubelet, agent, gpu_host, namespace
):
    node = kubelet.node_name
    session = session_of(api)
    names = await support.reported(api, node, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {SLICE_DEVICE: namespace})
    theirs = f"{node}-gpu.example.com"
    await session.request("POST", f"{RESOURCE}/resourceslices", body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": theirs},
        "spec": {"driver": "gpu.example.com", "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0", "attributes": {"resource.kubernetes.io/pciBusID": {"string": GPU}}}]},
    })  # fmt: skip
    try:
        await published(api, kubelet, agent, {})
        cond = await wait_ready(api, node, GPU, "ServedByOtherPlugin", agent, says="DRA driver gpu.example.com")
        assert theirs in cond["message"] and cond["status"] == "False"
    finally:
        await session.request("DELETE", f"{RESOURCE}/resourceslices/{theirs}")
    await published(api, kubelet, agent, {SLICE_DEVICE: namespace})
    await wait_ready(api, node, GPU, "Ready", agent)
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})
