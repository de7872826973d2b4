"""DRA mode reports a claim's device as a VM's: `Attached` on the NodePCIDevice and the PCIDevice
names the ResourceClaim and its pod, against the real parts.

The real kube-scheduler allocates team-a's claim (of the operator's DeviceClass `passthrough-<ns>`)
the GPU the agent's ResourceSlice publishes for team-a and reserves it for the pod; the real kubelet
prepares it through the agent's DRA driver; the operator (`--dra`, with its webhooks, as
test_dra_tenancy runs it) reads the claim's status from its index of ResourceClaims.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from e2e import support
from e2e.support import created
from passthrough.controller.world import FINALIZER
from passthrough.kube.client import session_of
from passthrough.kube.custom import Custom
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node, its kubelet and the agent in DRA mode)
    AUDIO, GPU, agent, cdi_dir, claim, claim_pod, create_claim, delete_claim, gpu_host, kubelet, published, read_claim,
)  # fmt: skip
from tests.integration.test_dra_tenancy import (  # noqa: F401  (fixtures: the operator with --dra and its webhooks)
    DEVICE, _unprepared, live_class, operator, serving, webhooks,
)  # fmt: skip
from tests.integration.test_operator_lifecycle import conditions

pytestmark = pytest.mark.cluster


def attached(obj: dict | None) -> dict:
    return conditions(obj).get("Attached", {})


async def both_attached(api, name: str, namespace: str, status: str, reason: str, message: str = "") -> tuple[dict, dict]:
    """Until the NodePCIDevice and the PCIDevice in `namespace` both say Attached=`status`/`reason`
    (with `message`, when given); returns the two objects."""
    npci, pci = Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)
    seen: list = []

    async def check():
        seen[:] = [await npci.get(name), await pci.get(name, namespace)]
        wanted = [(c.get("status"), c.get("reason"), c.get("message") if message else "") for c in map(attached, seen)]
        return seen[:] if wanted == [(status, reason, message)] * 2 else None

    found = await support.wait_for(check, 30, 0.2, what=lambda: f"Attached={status}/{reason} {message!r} on both: {[attached(o) for o in seen]}")
    return found[0], found[1]


async def test_a_claim_of_the_namespace_attaches_its_device_naming_the_claim_and_pod_and_detaches_when_gone(
    api, kubelet, agent, webhooks, operator, namespace
):
    core = client.CoreV1Api(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    name = names[GPU]
    own = f"passthrough-{namespace}"
    await support.assign(api, name, namespace)
    try:
        await published(api, kubelet, agent, {DEVICE: namespace})
        await support.wait_for(lambda: live_class(api, own), 30, 0.2, what=f"DeviceClass {own}")
        await both_attached(api, name, namespace, "False", "Available")

        await create_claim(api, namespace, claim("gpu", own))
        await support.create_pod(api, namespace, claim_pod("vm1-launcher", "gpu"))
        await created(core, namespace, kubelet, "vm1-launcher", timeout=90)
        status = (await read_claim(api, namespace, "gpu"))["status"]
        assert [r["device"] for r in status["allocation"]["devices"]["results"]] == [DEVICE]
        assert [(c["resource"], c["name"]) for c in status["reservedFor"]] == [("pods", "vm1-launcher")]

        message = f"Used by ResourceClaim {namespace}/gpu (pod vm1-launcher)."
        node_device, device = await both_attached(api, name, namespace, "True", "AllocatedToClaim", message)
        # The claim holds both objects, as a VM does.
        assert FINALIZER in node_device["metadata"]["finalizers"] and FINALIZER in device["metadata"]["finalizers"]

        # The pod ends and the claim goes: nothing uses the device, nothing holds the objects.
        await support.delete_pod(api, namespace, "vm1-launcher")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="the claim unprepared")
        await delete_claim(session_of(api), namespace, "gpu")
        node_device, device = await both_attached(api, name, namespace, "False", "Available")
        assert FINALIZER not in (node_device["metadata"].get("finalizers") or [])
        assert FINALIZER not in (device["metadata"].get("finalizers") or [])
    finally:
        await support.delete_pod(api, namespace, "vm1-launcher")
        await delete_claim(session_of(api), namespace, "gpu")
        await support.assign(api, name, "")
        await published(api, kubelet, agent, {})


async def test_a_device_reassigned_while_a_claim_holds_it_waits_for_the_claim_in_the_new_namespace(
    api, kubelet, agent, webhooks, operator, namespace, unique
):
    """The old namespace's PCIDevice stays Terminating while its claim holds the device, and the new
    one says who holds it, as with a VM; the claim gone, the device is the new namespace's alone."""
    core = client.CoreV1Api(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    name = names[GPU]
    pci = Custom(api, "pcidevices", namespaced=True)
    await support.assign(api, name, team_a)
    try:
        await published(api, kubelet, agent, {DEVICE: team_a})
        await support.wait_for(lambda: live_class(api, f"passthrough-{team_a}"), 30, 0.2, what="team-a's DeviceClass")
        await create_claim(api, team_a, claim("gpu", f"passthrough-{team_a}"))
        await support.create_pod(api, team_a, claim_pod("a-launcher", "gpu"))
        await created(core, team_a, kubelet, "a-launcher", timeout=90)
        await both_attached(api, name, team_a, "True", "AllocatedToClaim")

        await support.assign(api, name, team_b)

        async def held():
            old, new = await pci.get(name, team_a), await pci.get(name, team_b)
            return (old, new) if old and old["metadata"].get("deletionTimestamp") and attached(new).get("reason") == "HeldElsewhere" else None

        old, new = await support.wait_for(held, 30, 0.2, what="team-a's PCIDevice Terminating, team-b's HeldElsewhere")
        assert old["metadata"]["finalizers"] == [FINALIZER]
        # By what is team-a's business: team-b's PCIDevice does not say, the NodePCIDevice does.
        assert team_a not in attached(new)["message"] and "a device admin sees which on NodePCIDevice" in attached(new)["message"]
        node_attached = attached(await Custom(api, "nodepcidevices").get(name))
        assert f"ResourceClaim {team_a}/gpu (pod a-launcher)" in node_attached["message"], node_attached
        # Who waits, in DRA mode's words: a claim of team-b's class, not a device name.
        assert f"; a claim here of DeviceClass passthrough-{team_b} waits until it lets go" in attached(new)["message"]

        await support.delete_pod(api, team_a, "a-launcher")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="team-a's claim unprepared")
        await delete_claim(session_of(api), team_a, "gpu")

        async def released():
            return await pci.get(name, team_a) is None and attached(await pci.get(name, team_b)).get("reason") == "Available"

        await support.wait_for(released, 30, 0.2, what="team-a's PCIDevice gone, team-b's Available")
    finally:
        await support.delete_pod(api, team_a, "a-launcher")
        await delete_claim(session_of(api), team_a, "gpu")
        await support.assign(api, name, "")
        await published(api, kubelet, agent, {})
        await core.delete_namespace(team_b)
