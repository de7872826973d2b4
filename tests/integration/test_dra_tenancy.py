"""Claims stay in their namespace, against the real parts: the real kube-scheduler's DRA
allocator writes a claim's allocation, the API server sends that status write to the operator's
webhook (the chart's configuration, rendered with DRA mode on, pointed at the operator on
127.0.0.1), and the real kubelet prepares what was allocated through the agent's DRA driver.

team-b's claim uses a DeviceClass that matches every device of the driver, so the scheduler
picks team-a's GPU for it: the webhook refuses that status write, team-b's pod stays Pending,
and team-a's claim of the same class gets the GPU.
"""

from __future__ import annotations

import json

import pytest
from kubernetes_asyncio import client

from e2e import chart, support
from e2e.cluster import free_ports
from e2e.processes import OperatorProcess, WebhookServing, running
from e2e.support import created
from passthrough.admission.claims import POOL_CLASS
from passthrough.dra.slice import DRIVER
from passthrough.kube.client import ApiError, session_of
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node, its kubelet and the agent in DRA mode)
    AUDIO, GPU, RESOURCE, agent, cdi_dir, claim, claim_pod, create_claim, delete_claim, gpu_host, kubelet, published,
    read_claim,
)  # fmt: skip
from tests.integration.test_metrics import scrape, scrape_when

pytestmark = pytest.mark.cluster
DECISIONS = "passthrough_operator_admission_decisions_total"
ALLOCATIONS = "ResourceClaim status"  # the metric's kind for the allocation gate (webhook.STATUS)
DEVICE = "pci-0000-af-00-0"
OTHER_DEVICE = "pci-0000-3b-00-0"  # the node's other A10
OTHER_GPU = "0000:3b:00.0"
RECONCILES = "passthrough_operator_reconcile_duration_seconds_count"
GPU_MODE = "passthrough.io/gpu-passthrough"
A10 = "nvidia.com/GA102GL_A10"


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    return WebhookServing(tmp_path_factory.mktemp("webhook-tls"))


@pytest.fixture(scope="module")
def operator(cluster, serving, tmp_path_factory):
    """The operator with its webhooks and metrics (the agent fixture runs beside it)."""
    port = free_ports(1)[0]
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", "--not-found-grace=4s", "--dra",
                           f"--metrics-port={port}", "--metrics-addr=127.0.0.1", webhook=serving)  # fmt: skip
    proc.metrics_port = port
    with running(proc):
        yield proc


@pytest.fixture(scope="module")
def webhooks(cluster, helm, serving, operator):
    with chart.webhooks_registered(cluster, chart.webhook_configuration(helm, serving, "--set=agent.devicePlugin.dra=true")) as hooks:
        yield hooks


@pytest.fixture
async def device_class(api, unique):
    """A DeviceClass any tenant might write: every device of the driver, whoever it belongs to."""
    name = f"all-passthrough-{unique}"
    session = session_of(api)
    await session.request("POST", f"{RESOURCE}/deviceclasses", body={
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    })  # fmt: skip
    yield name
    await session.request("DELETE", f"{RESOURCE}/deviceclasses/{name}")


async def denied(operator) -> float:
    return (await scrape(operator.metrics_port))(DECISIONS, kind=ALLOCATIONS, decision="denied")


async def allocation_refused(api, operator, namespace: str, name: str, before: float) -> None:
    """Until the operator has refused an allocation since its denied count was `before`, claim
    `namespace/name` never allocated meanwhile."""

    async def decided():
        allocated = ((await read_claim(api, namespace, name)).get("status") or {}).get("allocation")
        return {"allocated": allocated} if allocated else await denied(operator) > before

    outcome = await support.wait_for(decided, 30, 0.2, what=f"the scheduler's allocation for claim {namespace}/{name} refused")
    assert outcome is True, f"claim {namespace}/{name} was allocated: {outcome}"


async def test_a_claim_of_another_namespace_is_never_allocated_a_device_whatever_its_class(
    api, kubelet, agent, webhooks, operator, namespace, unique, device_class
):
    core = client.CoreV1Api(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], team_a)
    await published(api, kubelet, agent, {DEVICE: team_a})
    try:
        before = await denied(operator)
        await create_claim(api, team_b, claim("stolen", device_class))
        await support.create_pod(api, team_b, claim_pod("b-launcher", "stolen"))
        # The scheduler allocates team-a's GPU to team-b's claim (it matches the class) and writes
        # that into the claim's status: the webhook refuses it.
        await allocation_refused(api, operator, team_b, "stolen", before)
        assert not (await core.read_namespaced_pod("b-launcher", team_b)).spec.node_name

        # team-a's claim of the very same class gets it, through the same webhook.
        await create_claim(api, team_a, claim("vm-gpu", device_class))
        await support.create_pod(api, team_a, claim_pod("a-launcher", "vm-gpu"))
        await created(core, team_a, kubelet, "a-launcher", timeout=90)
        [result] = (await read_claim(api, team_a, "vm-gpu"))["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (DRIVER, kubelet.node_name, DEVICE)

        # team-b's pod is still Pending, its claim unallocated, and it never got a container.
        assert "allocation" not in ((await read_claim(api, team_b, "stolen")).get("status") or {})
        assert not (await core.read_namespaced_pod("b-launcher", team_b)).spec.node_name
        assert not any(c.get("envs", {}).get("MARK") == "b-launcher" for c in kubelet.created_containers())
        assert await denied(operator) > before
    finally:
        await support.delete_pod(api, team_b, "b-launcher")
        await support.delete_pod(api, team_a, "a-launcher")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="team-a's claim unprepared")
        await _release_quietly(api, team_a, "vm-gpu")
        await support.assign(api, names[GPU], "")
        await published(api, kubelet, agent, {})
        await core.delete_namespace(team_b)


async def test_an_unassigned_gpu_of_a_node_in_gpu_mode_goes_to_any_namespace(
    api, kubelet, agent, webhooks, operator, namespace, device_class
):
    """The pool: nothing refuses an unassigned GPU of a node in GPU passthrough mode, whoever claims it."""
    core = client.CoreV1Api(api)
    await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: "true"}}})
    try:
        # Both A10s of the node, neither assigned: the pool.
        await published(api, kubelet, agent, {DEVICE: "", OTHER_DEVICE: ""})
        await create_claim(api, namespace, claim("pool-gpu", device_class))
        await support.create_pod(api, namespace, claim_pod("pool-launcher", "pool-gpu"))
        await created(core, namespace, kubelet, "pool-launcher", timeout=90)
        [result] = (await read_claim(api, namespace, "pool-gpu"))["status"]["allocation"]["devices"]["results"]
        assert result["device"] in (DEVICE, OTHER_DEVICE)
    finally:
        await support.delete_pod(api, namespace, "pool-launcher")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="the pool claim unprepared")
        await _release_quietly(api, namespace, "pool-gpu")
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: None}}})
        await published(api, kubelet, agent, {})


async def test_a_pool_claim_by_model_gets_a_pool_gpu_of_that_model_and_never_an_assigned_one(
    api, kubelet, agent, webhooks, operator, namespace, unique
):
    """The pool's class, `passthrough-pool.gpu`, is every namespace's: a claim picks the model by a
    selector of its own. Of the node's two A10s one is handed out to team-a: team-b's claim by
    model gets the other, and a second such claim waits (no second pool A10) instead of getting
    team-a's."""
    core = client.CoreV1Api(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO, OTHER_GPU))
    await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: "true"}}})
    await support.assign(api, names[OTHER_GPU], team_a)
    by_model = {"selectors": [{"cel": {"expression": f'device.attributes["passthrough.io"].resourceName == "{A10}"'}}]}
    try:
        await published(api, kubelet, agent, {DEVICE: "", OTHER_DEVICE: team_a})
        await support.wait_for(lambda: live_class(api, POOL_CLASS), 30, 0.2, what=f"DeviceClass {POOL_CLASS}")
        await create_claim(api, team_b, claim("a10", POOL_CLASS, **by_model))
        await support.create_pod(api, team_b, claim_pod("model-launcher", "a10"))
        await created(core, team_b, kubelet, "model-launcher", timeout=90)
        [result] = (await read_claim(api, team_b, "a10"))["status"]["allocation"]["devices"]["results"]
        assert (result["pool"], result["device"]) == (kubelet.node_name, DEVICE)

        # The only other A10 is team-a's: a second claim by model waits, the scheduler says why.
        await create_claim(api, team_b, claim("a10-too", POOL_CLASS, **by_model))
        await support.create_pod(api, team_b, claim_pod("model-launcher-2", "a10-too"))

        async def unschedulable():
            pod = await core.read_namespaced_pod("model-launcher-2", team_b)
            return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in pod.status.conditions or [])

        await support.wait_for(unschedulable, 60, 0.2, what="the second pool claim found unschedulable")
        assert "allocation" not in ((await read_claim(api, team_b, "a10-too")).get("status") or {})
        assert not any(c.get("envs", {}).get("MARK") == "model-launcher-2" for c in kubelet.created_containers())
    finally:
        await support.delete_pod(api, team_b, "model-launcher-2")
        await support.delete_pod(api, team_b, "model-launcher")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="the pool claim unprepared")
        await _release_quietly(api, team_b, "a10")
        await support.assign(api, names[OTHER_GPU], "")
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: None}}})
        await core.delete_namespace(team_b)
    await published(api, kubelet, agent, {})


async def live_class(api, name: str) -> dict | None:
    try:
        return await session_of(api).request("GET", f"{RESOURCE}/deviceclasses/{name}")
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def test_each_namespace_with_devices_has_its_device_class_that_no_other_namespace_may_name(
    api, kubelet, agent, webhooks, operator, namespace, unique
):
    core = client.CoreV1Api(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO, OTHER_GPU))
    own = f"passthrough-{team_a}"
    await support.assign(api, names[GPU], team_a)
    try:
        await published(api, kubelet, agent, {DEVICE: team_a})
        found = await support.wait_for(lambda: live_class(api, own), 30, 0.2, what=f"DeviceClass {own}")
        assert found["metadata"]["labels"]["passthrough.io/namespace"] == team_a
        assert found["spec"]["selectors"] == [{"cel": {"expression":
            f'device.driver == "{DRIVER}" && device.attributes["passthrough.io"].namespace == "{team_a}"'}}]  # fmt: skip

        # team-b may not even name it; team-a's claim of it gets its GPU.
        with pytest.raises(ApiError) as refused:
            await create_claim(api, team_b, claim("stolen", own))
        assert f"names DeviceClass {own}, which selects the devices of another namespace" in refused.value.message
        await create_claim(api, team_a, claim("vm-gpu", own))
        await support.create_pod(api, team_a, claim_pod("own-launcher", "vm-gpu"))
        await created(core, team_a, kubelet, "own-launcher", timeout=90)
        [result] = (await read_claim(api, team_a, "vm-gpu"))["status"]["allocation"]["devices"]["results"]
        assert result["device"] == DEVICE

        # A second device for team-a changes nothing about its class: decided again, not written.
        await support.quiet(api, ("deviceclasses",))
        syncs = (await scrape(operator.metrics_port))(RECONCILES, kind="deviceclasses")
        before = await support.write_counts(api)
        await support.assign(api, names[OTHER_GPU], team_a)
        await scrape_when(operator.metrics_port, lambda s: s(RECONCILES, kind="deviceclasses") > syncs,
                          "the DeviceClasses decided again after the second hand-out")  # fmt: skip
        await published(api, kubelet, agent, {DEVICE: team_a, OTHER_DEVICE: team_a})
        after = await support.write_counts(api)
        assert support.writes_between(before, after, "deviceclasses") == 0, support.diff(before, after)
    finally:
        await support.delete_pod(api, team_a, "own-launcher")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="team-a's claim unprepared")
        await _release_quietly(api, team_a, "vm-gpu")
        await support.assign(api, names[GPU], "")
        await support.assign(api, names[OTHER_GPU], "")
        await core.delete_namespace(team_b)
    # The last device gone, so is the class.
    await support.wait_for(lambda: _gone(api, own), 30, 0.2, what=f"DeviceClass {own} deleted")
    await published(api, kubelet, agent, {})


async def test_a_namespaces_class_is_its_own_before_it_exists(api, webhooks, namespace, unique):
    """`passthrough-<namespace>` belongs to that namespace by its name: team-b may not name
    team-a's class before team-a has a device (a claim made then would be allocated the moment
    the class appeared), neither in a claim nor in a claim template; team-a may."""
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    own = f"passthrough-{team_a}"
    assert await live_class(api, own) is None
    try:
        with pytest.raises(ApiError) as refused:
            await create_claim(api, team_b, claim("early", own))
        assert refused.value.status == 403, refused.value.body
        assert (f"ResourceClaim {team_b}/early: request gpu names DeviceClass {own}, which selects the devices of another "
                f"namespace; a claim of {team_b} names passthrough-{team_b}, which the operator makes once a device "
                f"is assigned to {team_b}, or passthrough-pool.gpu for an unassigned GPU.") in refused.value.message, refused.value.message  # fmt: skip
        template = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "early"},
            "spec": {"spec": claim("early", own)["spec"]},
        }  # fmt: skip
        with pytest.raises(ApiError) as refused:
            await session_of(api).request("POST", f"{RESOURCE}/namespaces/{team_b}/resourceclaimtemplates", body=template)
        assert f"names DeviceClass {own}, which selects the devices of another namespace" in refused.value.message
        await create_claim(api, team_a, claim("early", own))
    finally:
        await client.CoreV1Api(api).delete_namespace(team_b)


def extended_pod(name: str, device_class: str) -> dict:
    """A pod asking for a device by the extended resource every DeviceClass has (KEP-5004): the
    scheduler makes the claim itself, in the pod's namespace."""
    resource = f"deviceclass.resource.kubernetes.io/{device_class}"
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "compute", "image": "virt-launcher:test", "env": [{"name": "MARK", "value": name}],
                            "resources": {"limits": {resource: "1"}, "requests": {resource: "1"}}}],
        },
    }  # fmt: skip


async def test_a_device_asked_for_as_an_extended_resource_stays_in_its_namespace(
    api, kubelet, agent, webhooks, operator, namespace, unique
):
    """DRA-backed extended resources: no claim of the tenant's, the scheduler writes one from the
    pod's limits. team-b's pod asking for `deviceclass.resource.kubernetes.io/passthrough-<team-a>`
    makes the scheduler create a claim of team-a's class in team-b, which the claim webhook refuses:
    the pod stays Pending and the scheduler says why. team-a's pod asking the same way gets it."""
    core = client.CoreV1Api(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    own = f"passthrough-{team_a}"
    await support.assign(api, names[GPU], team_a)
    try:
        await published(api, kubelet, agent, {DEVICE: team_a})
        await support.wait_for(lambda: live_class(api, own), 30, 0.2, what=f"DeviceClass {own}")
        await support.create_pod(api, team_b, extended_pod("b-extended", own))

        async def refused():
            events = await core.list_namespaced_event(team_b, field_selector="involvedObject.name=b-extended")
            return next((e.message for e in events.items if "selects the devices of another namespace" in (e.message or "")), None)

        said = await support.wait_for(refused, 60, 0.2, what="the scheduler's report of the refused claim")
        assert f"names DeviceClass {own}" in said, said
        assert not (await core.read_namespaced_pod("b-extended", team_b)).spec.node_name

        await support.create_pod(api, team_a, extended_pod("a-extended", own))
        await created(core, team_a, kubelet, "a-extended", timeout=90)
        assert not (await core.read_namespaced_pod("b-extended", team_b)).spec.node_name
        assert not any(c.get("envs", {}).get("MARK") == "b-extended" for c in kubelet.created_containers())
    finally:
        await support.delete_pod(api, team_b, "b-extended")
        await support.delete_pod(api, team_a, "a-extended")
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="team-a's claim unprepared")
        await support.assign(api, names[GPU], "")
        await core.delete_namespace(team_b)
    await published(api, kubelet, agent, {})


async def _gone(api, name: str) -> bool:
    return await live_class(api, name) is None


async def test_admin_access_to_a_passthrough_class_is_refused(api, webhooks, namespace):
    # The API server itself allows adminAccess only in a namespace labelled for it.
    await client.CoreV1Api(api).patch_namespace(namespace, {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}})
    session = session_of(api)
    with pytest.raises(ApiError) as refused:
        await create_claim(api, namespace, claim("peek", f"passthrough-{namespace}", adminAccess=True))
    message = refused.value.message
    assert "adminAccess" in message and "passthrough devices do not allow" in message, message
    template = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "peek"},
        "spec": {"spec": claim("peek", f"passthrough-{namespace}", adminAccess=True)["spec"]},
    }  # fmt: skip
    with pytest.raises(ApiError) as refused:
        await session.request("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaimtemplates", body=template)
    assert "adminAccess" in refused.value.message, refused.value.body
    # Without adminAccess the same claim is nothing the webhook is asked about.
    await create_claim(api, namespace, claim("plain", f"passthrough-{namespace}"))


async def test_the_other_claim_routes_through_a_class_of_every_device_never_reach_another_namespaces_device(
    api, kubelet, agent, webhooks, operator, namespace, unique, device_class
):
    """A `firstAvailable` subrequest, `allocationMode: All`, and a claim made by
    kube-controller-manager from a ResourceClaimTemplate, each in team-b through a class that
    matches team-a's GPU: the scheduler picks it for each, the allocation gate refuses each (the
    operator's log names every claim), and no pod of team-b starts."""
    core = client.CoreV1Api(api)
    session = session_of(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], team_a)
    first = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "first"}, "spec": {"devices": {
        "requests": [{"name": "gpu", "firstAvailable": [{"name": "any", "deviceClassName": device_class}]}]}}}  # fmt: skip
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "tpl"},
                "spec": {"spec": claim("tpl", device_class)["spec"]}}  # fmt: skip
    from_template = claim_pod("tpl-launcher", "")
    from_template["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "tpl"}]
    pods = ("first-launcher", "all-launcher", "tpl-launcher")
    try:
        await published(api, kubelet, agent, {DEVICE: team_a})
        await create_claim(api, team_b, first)
        await create_claim(api, team_b, claim("all", device_class, allocationMode="All"))
        await session.request("POST", f"{RESOURCE}/namespaces/{team_b}/resourceclaimtemplates", body=template)
        # One at a time: the scheduler, once it has picked the GPU for one pod, finds nothing for
        # the others until that pod is tried again.
        for pod, claim_name in ((claim_pod("first-launcher", "first"), "first"), (claim_pod("all-launcher", "all"), "all"),
                                (from_template, "tpl-launcher-gpu-")):  # fmt: skip
            name = pod["metadata"]["name"]
            await support.create_pod(api, team_b, pod)
            refused = f"device {DEVICE} of node {kubelet.node_name} is not for claim {team_b}/{claim_name}"

            async def said():
                return refused in operator.output()

            await support.wait_for(said, 60, 0.2, what=lambda: f"{name}'s claim refused; operator log:\n{operator.output()[-3000:]}")
            assert not (await core.read_namespaced_pod(name, team_b)).spec.node_name, name
            await support.delete_pod(api, team_b, name)
        claims = (await session.request("GET", f"{RESOURCE}/namespaces/{team_b}/resourceclaims"))["items"]
        assert not any((c.get("status") or {}).get("allocation") for c in claims), claims
        assert not any(c.get("envs", {}).get("MARK") in pods for c in kubelet.created_containers())
    finally:
        for pod in pods:
            await support.delete_pod(api, team_b, pod)
        await support.assign(api, names[GPU], "")
        await core.delete_namespace(team_b)
    await published(api, kubelet, agent, {})


async def test_a_claim_shared_by_several_pods_is_shared_only_in_its_namespace(
    api, kubelet, agent, webhooks, operator, namespace, unique
):
    """Two pods of team-a name one claim: both get its device (one claim, prepared once). A pod of
    team-b naming a claim of that name names its own namespace's claim, never team-a's."""
    core = client.CoreV1Api(api)
    team_a, team_b = namespace, await support.create_namespace(api, f"team-b-{unique}")
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    own = f"passthrough-{team_a}"
    await support.assign(api, names[GPU], team_a)
    try:
        await published(api, kubelet, agent, {DEVICE: team_a})
        await support.wait_for(lambda: live_class(api, own), 30, 0.2, what=f"DeviceClass {own}")
        await create_claim(api, team_a, claim("shared", own))
        for pod in ("one-launcher", "two-launcher"):
            await support.create_pod(api, team_a, claim_pod(pod, "shared"))
        first = await created(core, team_a, kubelet, "one-launcher", timeout=90)
        second = await created(core, team_a, kubelet, "two-launcher", timeout=90)
        assert first["cdi_devices"] == second["cdi_devices"]
        reserved = (await read_claim(api, team_a, "shared"))["status"]["reservedFor"]
        assert sorted(r["name"] for r in reserved) == ["one-launcher", "two-launcher"]

        # team-b's pod naming "shared" names team-b's claim: the scheduler holds it back while
        # there is none, and tries it (no device of team-b: Unschedulable) once team-b makes one.
        await support.create_pod(api, team_b, claim_pod("b-launcher", "shared"))
        await create_claim(api, team_b, claim("shared", f"passthrough-{team_b}"))

        async def tried():
            pod = await core.read_namespaced_pod("b-launcher", team_b)
            return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in pod.status.conditions or [])

        await support.wait_for(tried, 60, 0.2, what="team-b's pod tried with team-b's own claim")
        reserved = (await read_claim(api, team_a, "shared"))["status"]["reservedFor"]
        assert sorted(r["name"] for r in reserved) == ["one-launcher", "two-launcher"]
        assert "allocation" not in ((await read_claim(api, team_b, "shared")).get("status") or {})
    finally:
        for ns, pod in ((team_b, "b-launcher"), (team_a, "one-launcher"), (team_a, "two-launcher")):
            await support.delete_pod(api, ns, pod)
        await support.wait_for(lambda: _unprepared(kubelet), 30, what="team-a's claim unprepared")
        await _release_quietly(api, team_a, "shared")
        await support.assign(api, names[GPU], "")
        await core.delete_namespace(team_b)
    await published(api, kubelet, agent, {})


async def test_an_allocation_with_admin_access_is_refused_whatever_the_class(
    api, kubelet, agent, webhooks, operator, namespace, device_class
):
    """adminAccess through a class that is not a passthrough- one (the claim webhook is not asked):
    the scheduler allocates the namespace's own GPU with adminAccess, and the allocation gate
    refuses it; the pod stays Pending."""
    core = client.CoreV1Api(api)
    await core.patch_namespace(namespace, {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}})
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    await support.assign(api, names[GPU], namespace)
    try:
        await published(api, kubelet, agent, {DEVICE: namespace})
        before = await denied(operator)
        await create_claim(api, namespace, claim("peek", device_class, adminAccess=True))
        await support.create_pod(api, namespace, claim_pod("peek-launcher", "peek"))

        await allocation_refused(api, operator, namespace, "peek", before)
        assert not (await core.read_namespaced_pod("peek-launcher", namespace)).spec.node_name
        assert not any(c.get("envs", {}).get("MARK") == "peek-launcher" for c in kubelet.created_containers())
    finally:
        await support.delete_pod(api, namespace, "peek-launcher")
        await _release_quietly(api, namespace, "peek")
        await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def test_a_claim_of_two_devices_in_one_request_is_admitted_with_a_warning_that_a_vm_cannot_use_it(
    cluster, webhooks, namespace
):
    """KubeVirt gives a VM one device per request: kubectl shows the webhook's warning when the
    claim is made, not the VM's failure later."""
    body = claim("pair", f"passthrough-{namespace}", count=2)
    answer = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(body), check=False)
    assert answer.returncode == 0, answer.stderr
    assert (f"Warning: ResourceClaim {namespace}/pair: request gpu asks for more than one device of DeviceClass "
            f"passthrough-{namespace}; KubeVirt gives a VM exactly one device per request") in answer.stderr, answer.stderr
    one = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(claim("single", f"passthrough-{namespace}")), check=False)
    assert one.returncode == 0 and "Warning" not in one.stderr, one.stderr


async def _unprepared(kubelet) -> bool:
    return not list(cdi_dir(kubelet).glob("*.json"))


async def _release_quietly(api, namespace: str, name: str) -> None:
    """The claim deleted once its pod is gone: kube-controller-manager's resourceclaim controller
    takes its reservation and allocation back, then its finalizer, as on a real cluster."""
    await delete_claim(session_of(api), namespace, name)
