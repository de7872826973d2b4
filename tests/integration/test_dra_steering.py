"""Claims steered to the devices they may have, against the real parts: the chart's mutating
webhooks (DRA mode) add to each request of a claim or claim template through a class of any
device a selector keeping it to its namespace's devices and the pool's; the real kube-scheduler
then finds an allowed device itself, kube-controller-manager makes a template's claim, the real
kubelet prepares it through the agent's DRA driver. The allocation gate stays registered and is
never needed: its refusals do not rise.

Without steering, team-b's claim of every device (allocationMode All) through such a class is
allocated team-a's GPU too, refused by the gate, and stays Pending.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from kubernetes_asyncio import client

from e2e import chart, support
from e2e.support import created
from passthrough.admission.claims import steering
from passthrough.kube.client import session_of
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node, its kubelet and the agent in DRA mode)
    AUDIO, GPU, OTHER_GPU, RESOURCE, agent, cdi_dir, claim, claim_pod, create_claim, gpu_host, kubelet, published, read_claim,
)  # fmt: skip
from tests.integration.test_dra_tenancy import (  # noqa: F401  (fixtures: the operator, its validating webhooks, a class of every device)
    DEVICE, GPU_MODE, OTHER_DEVICE, _release_quietly, _unprepared, denied, device_class, operator, serving, webhooks,
)  # fmt: skip

pytestmark = pytest.mark.cluster


@pytest.fixture
def steering_hooks(cluster, helm, serving, operator, unique):
    """The chart's steering webhooks (its MutatingWebhookConfiguration with DRA mode on, the
    claim ones only), pointed at the operator, under a name of this test's."""
    configuration = chart.webhook_configuration(helm, serving, "--set=agent.devicePlugin.dra=true", kind="MutatingWebhookConfiguration")
    configuration["webhooks"] = [w for w in configuration["webhooks"] if w["name"].startswith("steer-")]
    assert [w["name"] for w in configuration["webhooks"]] == [
        "steer-resourceclaims.admission.passthrough.io", "steer-resourceclaimtemplates.admission.passthrough.io"]
    configuration["metadata"]["name"] = f"steering-{unique}"
    cluster.kubectl("create", "-f", "-", input=json.dumps(configuration))
    try:
        yield configuration
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", configuration["metadata"]["name"], check=False)


async def steered(api, namespace: str, device_class: str) -> None:
    """Until the API server calls the steering webhook: a server-side dry run of a claim comes back with the selector."""
    session = session_of(api)
    probe = claim("probe", device_class)

    async def has_selector():
        made = await session.request("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaims?dryRun=All", body=probe)
        return steering(namespace) in made["spec"]["devices"]["requests"][0]["exactly"].get("selectors", [])

    await support.wait_for(has_selector, 20, 0.2, what="the steering webhook called")


async def test_a_claim_of_any_device_is_steered_to_its_namespaces_device_or_the_pools(
    api, kubelet, agent, webhooks, steering_hooks, operator, namespace, unique, device_class
):
    """team-a holds one A10 (free); the other is first the pool's, then team-b's own. team-b asks
    for every device of a class that matches both (allocationMode All), once by a claim and once
    by a template: each time it is allocated the one it may have and its pod runs."""
    core = client.CoreV1Api(api)
    session = session_of(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO, OTHER_GPU))
    await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: "true"}}})
    await support.assign(api, names[OTHER_GPU], team_a)
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "every"},
                "spec": {"spec": claim("every", device_class, allocationMode="All")["spec"]}}  # fmt: skip
    from_template = claim_pod("own-launcher", "")
    from_template["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "every"}]
    try:
        await published(api, kubelet, agent, {DEVICE: "", OTHER_DEVICE: team_a})
        await steered(api, team_b, device_class)
        before = await denied(operator)

        # The pool's A10 and team-a's both match the class: steered, the claim gets the pool's.
        made = await create_claim(api, team_b, claim("every", device_class, allocationMode="All"))
        assert steering(team_b) in made["spec"]["devices"]["requests"][0]["exactly"]["selectors"], made["spec"]
        await support.create_pod(api, team_b, claim_pod("pool-launcher", "every"))
        await created(core, team_b, kubelet, "pool-launcher", timeout=90)
        results = (await read_claim(api, team_b, "every"))["status"]["allocation"]["devices"]["results"]
        assert [(r["pool"], r["device"]) for r in results] == [(kubelet.node_name, DEVICE)], results
        await support.delete_pod(api, team_b, "pool-launcher")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="the pool claim unprepared")
        await _release_quietly(api, team_b, "every")

        # The same A10 handed out to team-b: a claim made by kube-controller-manager from a steered template gets it.
        await support.assign(api, names[GPU], team_b)
        await published(api, kubelet, agent, {DEVICE: team_b, OTHER_DEVICE: team_a})
        kept = await session.request("POST", f"{RESOURCE}/namespaces/{team_b}/resourceclaimtemplates", body=template)
        assert steering(team_b) in kept["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"], kept["spec"]
        await support.create_pod(api, team_b, from_template)
        await created(core, team_b, kubelet, "own-launcher", timeout=90)
        [made] = (await session.request("GET", f"{RESOURCE}/namespaces/{team_b}/resourceclaims"))["items"]
        assert made["spec"]["devices"]["requests"][0]["exactly"]["selectors"].count(steering(team_b)) == 1, made["spec"]
        results = made["status"]["allocation"]["devices"]["results"]
        assert [(r["pool"], r["device"]) for r in results] == [(kubelet.node_name, DEVICE)], results

        # The scheduler never picked team-a's A10: the allocation gate had nothing to refuse.
        assert await denied(operator) == before
    finally:
        for pod in ("pool-launcher", "own-launcher"):
            await support.delete_pod(api, team_b, pod)
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="team-b's claims unprepared")
        with contextlib.suppress(Exception):
            await _release_quietly(api, team_b, "every")
        for address in (GPU, OTHER_GPU):
            await support.assign(api, names[address], "")
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: None}}})
        await core.delete_namespace(team_b)
    await published(api, kubelet, agent, {})
