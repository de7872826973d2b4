"""A pool claim that still holds a GPU after the admin assigns it to a namespace is reported as
device-plugin mode reports a pool pod that still holds it, against the real parts: the real
kube-scheduler allocates team-b's claim of the pool's class an unassigned A10 and the real
kubelet prepares it; the admin then assigns that A10 to team-a. The NodePCIDevice says
Attached=True/HeldByPod naming the claim and its pod, for the admin; team-a's PCIDevice says
Attached=False/HeldByPod naming no one. Once the claim lets go, both say Available.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from e2e import support
from e2e.support import created
from passthrough.admission.claims import POOL_CLASS
from passthrough.controller.world import FINALIZER
from passthrough.kube.client import session_of
from passthrough.kube.custom import Custom
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node, its kubelet and the agent in DRA mode)
    AUDIO, GPU, OTHER_GPU, agent, cdi_dir, claim, claim_pod, create_claim, delete_claim, gpu_host, kubelet, published, read_claim,
)  # fmt: skip
from tests.integration.test_dra_attached import attached
from tests.integration.test_dra_tenancy import (  # noqa: F401  (fixtures: the operator with --dra and its webhooks)
    DEVICE, GPU_MODE, OTHER_DEVICE, _unprepared, live_class, operator, serving, webhooks,
)  # fmt: skip

pytestmark = pytest.mark.cluster


async def attached_as(api, name: str, namespace: str, node_device: tuple[str, str], device: tuple[str, str]) -> tuple[dict, dict]:
    """Until the NodePCIDevice says Attached=`node_device` (status, reason) and the PCIDevice in
    `namespace` Attached=`device`; returns the two objects."""
    npci, pci = Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)
    seen: list = []

    async def check():
        seen[:] = [await npci.get(name), await pci.get(name, namespace)]
        got = [(attached(o).get("status"), attached(o).get("reason")) for o in seen]
        return seen[:] if got == [node_device, device] else None

    found = await support.wait_for(check, 30, 0.2, what=lambda: f"Attached {node_device} and {device}: {[attached(o) for o in seen]}")
    return found[0], found[1]


async def test_a_pool_claim_still_holding_a_gpu_after_its_assignment_is_named_to_the_admin_only(
    api, kubelet, agent, webhooks, operator, namespace, unique
):
    core = client.CoreV1Api(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO, OTHER_GPU))
    name = ""
    await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: "true"}}})
    try:
        await published(api, kubelet, agent, {DEVICE: "", OTHER_DEVICE: ""})  # both A10s are the pool's
        await support.wait_for(lambda: live_class(api, POOL_CLASS), 30, 0.2, what=f"DeviceClass {POOL_CLASS}")
        await create_claim(api, team_b, claim("pool-gpu", POOL_CLASS))
        await support.create_pod(api, team_b, claim_pod("pool-launcher", "pool-gpu"))
        await created(core, team_b, kubelet, "pool-launcher", timeout=90)
        [result] = (await read_claim(api, team_b, "pool-gpu"))["status"]["allocation"]["devices"]["results"]
        name = names[{DEVICE: GPU, OTHER_DEVICE: OTHER_GPU}[result["device"]]]

        # The admin assigns the A10 the pool claim still holds.
        await support.assign(api, name, team_a)
        node_device, device = await attached_as(api, name, team_a, ("True", "HeldByPod"), ("False", "HeldByPod"))
        assert attached(node_device)["message"] == (
            f"Held by ResourceClaim {team_b}/pool-gpu (pod pool-launcher), allocated while it was in the pool "
            "(no VirtualMachine lists it).")  # fmt: skip
        told = attached(device)["message"]
        assert team_b not in told and "pool-gpu" not in told and f"NodePCIDevice {name}" in told, told
        # It holds nothing, as in the pool: no finalizer keeps either object.
        assert FINALIZER not in (node_device["metadata"].get("finalizers") or [])
        assert FINALIZER not in (device["metadata"].get("finalizers") or [])

        # The claim lets go: the device is team-a's to use.
        await support.delete_pod(api, team_b, "pool-launcher")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="the pool claim unprepared")
        await delete_claim(session_of(api), team_b, "pool-gpu")
        await attached_as(api, name, team_a, ("False", "Available"), ("False", "Available"))
    finally:
        await support.delete_pod(api, team_b, "pool-launcher")
        await delete_claim(session_of(api), team_b, "pool-gpu")
        if name:
            await support.assign(api, name, "")
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: None}}})
        await core.delete_namespace(team_b)
    await published(api, kubelet, agent, {})
