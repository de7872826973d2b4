"""Who may do what, against the real API server, each person a user of their own.

The chart's RBAC and agent policies are installed from `helm template`. The people are
ServiceAccount tokens (e2e/identities.py), so the API server authenticates and authorizes
each for real: tenants of team-a holding the namespace roles `view`, `edit` and `admin` (the
chart's aggregated role adds PCIDevice read to them), a tenant of team-b, a device admin bound
to the chart's device-admin role, and the agent of node-1 with a token bound to a pod on
node-1, as the DaemonSet's is. The cluster admin sets the scene; the operator and the real
agent (over a fixture GPU host with its simulated kernel) run throughout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from e2e import chart, fakesysfs, identities, support
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess
from passthrough.agent import report
from passthrough.api.labels import IOMMU_LABEL, NODE_LABEL, VFIO_LABEL, VFIO_PCI_LABEL
from passthrough.kube.connect import connect
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.kube.client import ApiError

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
GPU, OTHER_GPU = "0000:3b:00.0", "0000:af:00.0"
AUDIO = "0000:af:00.1"  # the second GPU's audio function: what the whole-job test takes off the node
PCI = "pcidevices.passthrough.io"
NPCI = "nodepcidevices.passthrough.io"
GROUP, VERSION = "passthrough.io", "v1alpha1"


# -- the scene -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release(cluster, helm):
    """The chart's accounts, roles and agent policies, installed for real."""
    suffix = os.urandom(3).hex()
    namespace, name = f"tenancy-{suffix}", f"passthrough-{suffix}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        with chart.installed(cluster, chart.access(chart.template(helm, name, namespace))):
            yield SimpleNamespace(suffix=suffix, namespace=namespace, name=name)
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
async def nodes(api, release):
    """node-1 (in GPU passthrough mode: its agent binds and serves) and node-2."""
    one = await support.ensure_node(api, f"node-1-{release.suffix}")
    two = await support.ensure_node(api, f"node-2-{release.suffix}")
    await client.CoreV1Api(api).patch_node(one.name, {"metadata": {"labels": {"passthrough.io/gpu-passthrough": "true"}}})
    yield SimpleNamespace(one=one, two=two)
    for node in (one, two):
        with contextlib.suppress(ApiException):
            await support.remove_node(api, node.name)


@pytest.fixture(scope="module")
def people(cluster, release, nodes, tmp_path_factory):
    """Everyone, each a ServiceAccount token of their own, bound as the README's table says."""
    folder = tmp_path_factory.mktemp("people")
    team_a, team_b = f"team-a-{release.suffix}", f"team-b-{release.suffix}"
    for team in (team_a, team_b):
        cluster.kubectl("create", "namespace", team)
    agent_account = f"{release.name}-agent"
    identities.pod_on_node(cluster, release.namespace, "agent-node-1", nodes.one.name, agent_account)
    cast = SimpleNamespace(
        team_a=team_a, team_b=team_b,
        viewer=identities.identity(cluster, team_a, "viewer", folder),
        editor=identities.identity(cluster, team_a, "editor", folder),
        owner=identities.identity(cluster, team_a, "owner", folder),
        team_b_editor=identities.identity(cluster, team_b, "editor", folder),
        device_admin=identities.identity(cluster, release.namespace, "device-admin", folder),
        agent=identities.identity(cluster, release.namespace, agent_account, folder, bound_pod="agent-node-1"),
        agent_on_no_node=identities.identity(cluster, release.namespace, agent_account, folder),
    )  # fmt: skip
    for who, role in ((cast.viewer, "view"), (cast.editor, "edit"), (cast.owner, "admin")):
        identities.bind(cluster, who, role, team_a)
    identities.bind(cluster, cast.team_b_editor, "edit", team_b)
    admin_binding = identities.bind(cluster, cast.device_admin, f"{release.name}-device-admin")
    try:
        # The controller-manager aggregates the chart's role into view, edit and admin, and the
        # API server loads the agent policies: both within a few seconds.
        _wait(lambda: all(w.can_i("list", PCI, "-n", team_a) for w in (cast.viewer, cast.editor, cast.owner)),
              "the namespace roles to aggregate PCIDevice read")  # fmt: skip
        chart.wait_for_agent_policies(cluster, release.namespace, release.name, nodes.one.name)
        yield cast
    finally:
        cluster.kubectl("delete", "clusterrolebinding", admin_binding, "--ignore-not-found", check=False)
        for team in (team_a, team_b):
            cluster.kubectl("delete", "namespace", team, "--wait=false", check=False)


def _wait(predicate, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
async def agent(api, cluster, nodes, people, tmp_path_factory):
    """The real agent of node-1, logged in with its node-bound token, over a fixture GPU host."""
    root = tmp_path_factory.mktemp("agent-node-1")
    host = fakesysfs.gpu_node(root / "host")
    kernel = FakeKernel(host).start()
    process = AgentProcess(cluster, root / "agent.log", nodes.one.name, host, PCI_IDS,
                           f"--kubeconfig={people.agent.kubeconfig}").start()  # fmt: skip

    async def reported():
        items = (await Custom(api, "nodepcidevices").list(f"{NODE_LABEL}={nodes.one.name}"))["items"]
        return {o["status"]["attributes"]["pciAddress"]: o for o in items if o.get("status")} if len(items) == 4 else None

    try:
        await support.wait_for(reported, 30, what=lambda: f"node-1's report; agent log:\n{process.output()[-3000:]}")
        yield SimpleNamespace(process=process, host=host, kernel=kernel, reported=reported)
    finally:
        process.stop()
        kernel.stop()


@pytest.fixture(scope="module")
async def devices(api, nodes, people, agent, operator):
    """node-1's first GPU assigned to team-a by the device admin (its PCIDevice made by the
    operator), node-1's second GPU unassigned, and a GPU of node-2 (written as node-2's agent would)."""
    reported = await agent.reported()
    assigned, free = reported[GPU]["metadata"]["name"], reported[OTHER_GPU]["metadata"]["name"]
    answer = people.device_admin.kubectl("patch", "npci", assigned, "--type=merge", "-p", assignment(people.team_a))
    assert answer.returncode == 0, answer.stderr
    pcidevices = Custom(api, "pcidevices", namespaced=True)

    async def made():
        obj = await pcidevices.get(assigned, people.team_a)
        return obj if obj and obj.get("status") else None

    await support.wait_for(made, 20, what=f"the PCIDevice {people.team_a}/{assigned}")
    other_node = await support.report_device(api, nodes.two, support.gpu(GPU))
    return SimpleNamespace(assigned=assigned, free=free, other_node=other_node)


@contextlib.asynccontextmanager
async def logged_in(who: identities.Identity):
    api = await connect(str(who.kubeconfig))
    try:
        yield api
    finally:
        await api.close()


async def refusal(call) -> str:
    """The message of the API server's 403 to `call` (an awaitable)."""
    with pytest.raises((ApiException, ApiError)) as caught:
        await call
    assert caught.value.status == 403, caught.value.body
    return json.loads(caught.value.body)["message"]


def refused(answer) -> str:
    """The message of the API server's 403 to a kubectl run."""
    assert answer.returncode != 0 and "(Forbidden)" in answer.stderr, (answer.stdout, answer.stderr)
    return answer.stderr.strip()


def rbac_no(who: identities.Identity, verb: str, resource: str, where: str) -> str:
    return f'User "{who.user}" cannot {verb} resource "{resource}" in API group "passthrough.io" {where}'


def policy_no(policy: str, message: str) -> str:
    return f"ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request: {message}"


def merge(api, plural: str, name: str, body: dict, status: bool = False):
    objects = client.CustomObjectsApi(api)
    call = objects.patch_cluster_custom_object_status if status else objects.patch_cluster_custom_object
    return call(GROUP, VERSION, plural, name, body, _content_type="application/merge-patch+json")


async def watched(who: identities.Identity, namespace: str) -> list[str]:
    """Names a watch of `namespace`'s PCIDevices sends (ADDED for each that exists) within a second."""
    async with logged_in(who) as api:
        objects = client.CustomObjectsApi(api)
        async with watch.Watch().stream(
            objects.list_namespaced_custom_object, GROUP, VERSION, namespace, "pcidevices", timeout_seconds=1
        ) as stream:
            return [event["raw_object"]["metadata"]["name"] async for event in stream]


def assignment(namespace: str) -> str:
    return json.dumps({"spec": {"assignedNamespace": namespace}})


def tenant(people, role: str) -> identities.Identity:
    return {"view": people.viewer, "edit": people.editor, "admin": people.owner}[role]


# -- tenants -------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["view", "edit", "admin"])
async def test_a_tenant_reads_the_pcidevices_of_its_namespace(people, devices, role):
    who, team = tenant(people, role), people.team_a
    assert all(who.can_i(verb, PCI, "-n", team) for verb in ("get", "list", "watch"))
    got = who.kubectl("get", "pci", devices.assigned, "-n", team, "-o", "json")
    assert got.returncode == 0 and json.loads(got.stdout)["status"]["resourceName"] == f"passthrough.io/{devices.assigned}"
    listed = who.kubectl("get", "pci", "-n", team, "-o", "name")
    assert listed.stdout.split() == [f"pcidevice.passthrough.io/{devices.assigned}"], listed.stderr
    assert await watched(who, team) == [devices.assigned]


@pytest.mark.parametrize("role", ["view", "edit", "admin"])
async def test_a_tenant_cannot_create_patch_or_delete_a_pcidevice(people, devices, role):
    who, team, name = tenant(people, role), people.team_a, devices.assigned
    here = f'in the namespace "{team}"'
    assert not any(who.can_i(verb, PCI, "-n", team) for verb in ("create", "patch", "update", "delete"))
    assert not who.can_i("patch", PCI, "-n", team, "--subresource=status")

    body = yaml.safe_dump({"apiVersion": f"{GROUP}/{VERSION}", "kind": "PCIDevice", "metadata": {"name": "mine"}})
    assert rbac_no(who, "create", "pcidevices", here) in refused(who.kubectl("create", "-n", team, "-f", "-", input=body))
    label = json.dumps({"metadata": {"labels": {"mine": "yes"}}})
    answer = who.kubectl("patch", "pci", name, "-n", team, "--type=merge", "-p", label)
    assert rbac_no(who, "patch", "pcidevices", here) in refused(answer)
    # (kubectl reads the status subresource before patching it: the client sends the PATCH alone.)
    async with logged_in(who) as api:
        message = await refusal(client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            GROUP, VERSION, team, "pcidevices", name, {"status": {"nodeName": "elsewhere"}},
            _content_type="application/merge-patch+json"))  # fmt: skip
    assert rbac_no(who, "patch", "pcidevices/status", here) in message
    assert rbac_no(who, "delete", "pcidevices", here) in refused(who.kubectl("delete", "pci", name, "-n", team))
    assert who.kubectl("get", "pci", name, "-n", team).returncode == 0  # still there


@pytest.mark.parametrize("role", ["view", "edit", "admin"])
async def test_a_tenant_cannot_patch_or_read_a_nodepcidevice(people, devices, role):
    who = tenant(people, role)
    assert not any(who.can_i(verb, NPCI) for verb in ("get", "list", "patch", "update"))
    async with logged_in(who) as api:
        message = await refusal(merge(api, "nodepcidevices", devices.free, {"spec": {"assignedNamespace": people.team_a}}))
    denied = rbac_no(who, "patch", "nodepcidevices", "at the cluster scope")
    assert message == f'nodepcidevices.passthrough.io "{devices.free}" is forbidden: {denied}'
    assert rbac_no(who, "list", "nodepcidevices", "at the cluster scope") in refused(who.kubectl("get", "npci"))


async def test_team_b_cannot_read_team_a_pcidevices(people, devices):
    who, there = people.team_b_editor, f'in the namespace "{people.team_a}"'
    assert not any(who.can_i(verb, PCI, "-n", people.team_a) for verb in ("get", "list", "watch"))
    assert rbac_no(who, "get", "pcidevices", there) in refused(who.kubectl("get", "pci", devices.assigned, "-n", people.team_a))
    assert rbac_no(who, "list", "pcidevices", there) in refused(who.kubectl("get", "pci", "-n", people.team_a))
    assert rbac_no(who, "list", "pcidevices", "at the cluster scope") in refused(who.kubectl("get", "pci", "-A"))
    with pytest.raises(ApiException) as caught:
        await watched(who, people.team_a)
    assert caught.value.status == 403 and rbac_no(who, "watch", "pcidevices", there) in (caught.value.body or caught.value.reason)
    # Its own namespace: readable, and empty.
    assert who.can_i("list", PCI, "-n", people.team_b)
    listed = who.kubectl("get", "pci", "-n", people.team_b, "-o", "name")
    assert listed.returncode == 0 and listed.stdout == ""


# -- the device admin ------------------------------------------------------------------------


async def test_the_device_admin_assigns_devices_and_does_nothing_else(api, people, devices, release):
    who = people.device_admin
    # The `devices` fixture's assignment was the device admin's: it reads what followed.
    got = json.loads(who.kubectl("get", "npci", devices.assigned, "-o", "json").stdout)
    assert got["spec"]["assignedNamespace"] == people.team_a
    assert who.kubectl("get", "pci", devices.assigned, "-n", people.team_a).returncode == 0
    assert all(who.can_i(verb, NPCI) for verb in ("get", "list", "watch", "patch", "update"))
    assert all(who.can_i(verb, r, "-A") for verb in ("get", "list", "watch") for r in (PCI, "passthroughconfigs.passthrough.io"))
    assert not any(who.can_i(verb, NPCI) for verb in ("create", "delete"))
    assert not who.can_i("patch", NPCI, "--subresource=status")
    assert not any(who.can_i(verb, PCI, "-A") for verb in ("create", "patch", "delete"))
    assert not any(who.can_i(verb, "passthroughconfigs.passthrough.io") for verb in ("create", "patch", "delete"))

    # Another assignment, and back: the status is not the device admin's, nor are the values.
    for namespace in (people.team_b, ""):
        answer = who.kubectl("patch", "npci", devices.free, "--type=merge", "-p", assignment(namespace))
        assert answer.returncode == 0, answer.stderr
    scope = "at the cluster scope"
    async with logged_in(who) as admin_api:
        message = await refusal(merge(admin_api, "nodepcidevices", devices.free, {"status": {"eligible": False}}, status=True))
        assert rbac_no(who, "patch", "nodepcidevices/status", scope) in message
        objects = client.CustomObjectsApi(admin_api)
        message = await refusal(objects.delete_cluster_custom_object(GROUP, VERSION, "nodepcidevices", devices.free))
        assert rbac_no(who, "delete", "nodepcidevices", scope) in message
        message = await refusal(merge(admin_api, "passthroughconfigs", "cluster", {"spec": {"gpu": {"replaceDefaults": True}}}))
        assert rbac_no(who, "patch", "passthroughconfigs", scope) in message


# -- the agent of node-1 -----------------------------------------------------------------------


async def test_the_agent_does_its_whole_job_under_its_node_policy(api, nodes, people, agent, devices):
    """Reports, node label, vfio-pci binds with their Events, status after an assignment, a device gone."""
    node = nodes.one.name
    reported = await agent.reported()
    assert all(next(c for c in o["status"]["conditions"] if c["type"] == "Ready")["status"] == "True" for o in reported.values())
    labels = (await client.CoreV1Api(api).read_node(node)).metadata.labels
    # The preflight's words (passthrough discover --check), written under the node policy.
    assert (labels[VFIO_LABEL], labels[IOMMU_LABEL], labels[VFIO_PCI_LABEL]) == ("true", "enabled", "loaded")
    assert {agent.host.driver(a) for a in reported} == {"vfio-pci"}
    about = f"involvedObject.name={devices.assigned}"
    events = await client.CoreV1Api(api).list_namespaced_event("default", field_selector=about)
    assert any(e.reason == "BoundToVfio" and e.source.component == "passthrough-agent" for e in events.items)

    # The admin's assignment reached the agent, whose status says so; the spec is untouched.
    async def exclusive():
        obj = await Custom(api, "nodepcidevices").get(devices.assigned)
        return obj if obj["status"].get("mode") == "Exclusive" else None

    obj = await support.wait_for(exclusive, 20, what="the agent's status of the assigned device")
    assert obj["status"]["resourceName"] == f"passthrough.io/{devices.assigned}"
    assert obj["spec"]["assignedNamespace"] == people.team_a
    # Its identity apply (what a restarted agent sends) passes with the admin's spec in place.
    async with logged_in(people.agent) as agent_api:
        await Custom(agent_api, "nodepcidevices").apply(report.identity(devices.assigned, nodes.one), AGENT_MANAGER)

    # A device leaves the node: the agent marks it NotFound through the status (and the operator
    # deletes it, unassigned, after its grace).
    gone = reported[AUDIO]["metadata"]["name"]
    agent.host.remove_device(AUDIO)
    agent.process.proc.send_signal(signal.SIGHUP)

    async def not_found():
        obj = await Custom(api, "nodepcidevices").get(gone)
        conditions = (obj or {}).get("status", {}).get("conditions") or []
        return obj is None or any(c["type"] == "Ready" and c["reason"] == "NotFound" for c in conditions)

    await support.wait_for(not_found, 20, what=lambda: f"{AUDIO} NotFound; agent log:\n{agent.process.output()[-3000:]}")
    log = agent.process.output()
    assert "forbidden" not in log.lower() and " 403 " not in log and "Traceback" not in log, log[-5000:]


async def test_the_agent_of_node_1_cannot_write_the_devices_of_node_2(people, nodes, devices, release):
    policy, node, other = f"{release.name}-agent-devices", nodes.one.name, nodes.two.name

    def not_ours(name: str) -> str:
        return policy_no(policy, f"the agent of node {node} may write only NodePCIDevices labelled "
                                 f"passthrough.io/node={node}, not {name} (passthrough.io/node={other})")  # fmt: skip

    # RBAC cannot name a node, so it says yes; the policy is what refuses.
    assert people.agent.can_i("patch", NPCI) and people.agent.can_i("patch", NPCI, "--subresource=status")
    theirs = devices.other_node
    async with logged_in(people.agent) as api:
        kind = Custom(api, "nodepcidevices")
        status = report.status_body(theirs, report.present_status(support.gpu(GPU), theirs, node, ""), None)
        assert (await refusal(kind.apply(status, AGENT_MANAGER, status=True))).endswith(not_ours(theirs))
        # Taking node-2's device over by relabelling it.
        message = await refusal(merge(api, "nodepcidevices", theirs, {"metadata": {"labels": {NODE_LABEL: node}}}))
        assert message.endswith(not_ours(theirs))
        # Creating a device for node-2.
        name = report.object_name(support.gpu("0000:5e:00.0"), other)
        assert (await refusal(kind.apply(report.identity(name, nodes.two), AGENT_MANAGER))).endswith(not_ours(name))
        # Moving one of its own to node-2, in the label or in the status.
        mine = devices.assigned
        message = await refusal(merge(api, "nodepcidevices", mine, {"metadata": {"labels": {NODE_LABEL: other}}}))
        assert message.endswith(not_ours(mine))
        message = await refusal(merge(api, "nodepcidevices", mine, {"status": {"attributes": {"nodeName": other}}}, status=True))
        assert message.endswith(policy_no(policy, f"the agent of node {node} may not report NodePCIDevice {mine} as a device "
                                                  f"of node {other} (status.attributes.nodeName)"))  # fmt: skip


async def test_the_agent_cannot_change_any_assigned_namespace(api, people, nodes, devices, release):
    policy, node = f"{release.name}-agent-devices", nodes.one.name

    def says(verb: str, name: str) -> str:
        return policy_no(policy, f"the agent of node {node} may not {verb} the spec of NodePCIDevice {name}: "
                                 "spec.assignedNamespace is set by a device admin")  # fmt: skip

    async with logged_in(people.agent) as agent_api:
        for name, namespace in ((devices.assigned, ""), (devices.assigned, people.team_b), (devices.free, people.team_b)):
            message = await refusal(merge(agent_api, "nodepcidevices", name, {"spec": {"assignedNamespace": namespace}}))
            assert message.endswith(says("change", name))
        # Node-2's device: refused for being node-2's, before its spec is looked at.
        message = await refusal(merge(agent_api, "nodepcidevices", devices.other_node, {"spec": {"assignedNamespace": "x"}}))
        assert f"may write only NodePCIDevices labelled passthrough.io/node={node}" in message
        # A new device of its own node, created already assigned.
        name = report.object_name(support.gpu("0000:5e:00.0"), node)
        created = {**report.identity(name, nodes.one), "spec": {"assignedNamespace": people.team_a}}
        assert (await refusal(Custom(agent_api, "nodepcidevices").apply(created, AGENT_MANAGER))).endswith(says("set", name))
    assert (await Custom(api, "nodepcidevices").get(devices.assigned))["spec"]["assignedNamespace"] == people.team_a
    assert await Custom(api, "nodepcidevices").get(name) is None


async def test_the_agent_changes_only_the_passthrough_labels_of_its_own_node(api, people, nodes, release):
    policy, node, other, who = f"{release.name}-agent-node", nodes.one.name, nodes.two.name, people.agent
    assert who.can_i("patch", "nodes")  # RBAC: any node; the policy narrows it
    assert refused(who.kubectl("label", "node", other, f"{VFIO_LABEL}=true")).endswith(
        policy_no(policy, f"the agent of node {node} may change only its own Node, not {other}"))
    assert refused(who.kubectl("label", "node", node, "team=mine")).endswith(
        policy_no(policy, f"the agent of node {node} may change only the passthrough.io/ labels of its Node, not team"))
    not_labels = policy_no(policy, f"the agent of node {node} may change only the passthrough.io/ labels of its Node, "
                                   "not its spec, annotations, finalizers or owner references")  # fmt: skip
    assert refused(who.kubectl("annotate", "node", node, "note=mine")).endswith(not_labels)
    cordon = json.dumps({"spec": {"unschedulable": True}})
    assert refused(who.kubectl("patch", "node", node, "--type=merge", "-p", cordon)).endswith(not_labels)
    # Its own node's passthrough.io/ labels: yes, added and removed.
    for change in ("passthrough.io/probe=yes", "passthrough.io/probe-"):
        answer = who.kubectl("label", "node", node, change)
        assert answer.returncode == 0, answer.stderr
    labels = (await client.CoreV1Api(api).read_node(other)).metadata.labels or {}
    assert VFIO_LABEL not in labels


async def test_an_agent_token_bound_to_no_node_is_refused(api, people, nodes, devices, release):
    who, node = people.agent_on_no_node, nodes.one.name
    why = ("the passthrough agent writes NodePCIDevices and Nodes only with a token bound to a pod on its node, and this "
           "token names no node (no authentication.kubernetes.io/node-name in its user info): run the agent as the "
           "chart's DaemonSet, whose pods get such a token")  # fmt: skip
    async with logged_in(who) as agent_api:
        kind = Custom(agent_api, "nodepcidevices")
        listed = (await kind.list(f"{NODE_LABEL}={node}"))["items"]  # reads: yes
        assert devices.assigned in {o["metadata"]["name"] for o in listed}
        status = report.status_body(devices.assigned, report.present_status(support.gpu(GPU), devices.assigned, node, ""), None)
        message = await refusal(kind.apply(status, AGENT_MANAGER, status=True))
        assert message.endswith(policy_no(f"{release.name}-agent-devices", why))
    answer = who.kubectl("label", "node", node, f"{VFIO_LABEL}=false", "--overwrite")
    assert refused(answer).endswith(policy_no(f"{release.name}-agent-node", why))


async def test_the_agent_cannot_write_what_the_operator_records(api, people, nodes, devices, release):
    """The grace period's clocks, the hand-out record, the operator's conditions and finalizer."""
    policy, node, name = f"{release.name}-agent-devices", nodes.one.name, devices.assigned
    npci = Custom(api, "nodepcidevices")
    before = await npci.get(name)
    assert before["status"]["assignedNamespaceRef"]["name"] == people.team_a  # the operator's record of the hand-out

    def says(fields: str) -> str:
        them = "them" if ", " in fields else "it"
        return policy_no(policy, f"the agent of node {node} may not change {fields} of NodePCIDevice {name}: "
                                 f"the passthrough operator writes {them}")  # fmt: skip

    conditions = before["status"]["conditions"]
    flipped = [{**c, "status": "False", "reason": "Available"} if c["type"] == "Assigned" else c for c in conditions]
    async with logged_in(people.agent) as agent_api:
        for status, fields in (
            ({"missingSince": "2000-01-01T00:00:00Z"}, "status.missingSince"),  # would expire the grace period at once
            ({"nodeGoneSince": "2000-01-01T00:00:00Z"}, "status.nodeGoneSince"),
            ({"assignedNamespaceRef": {"name": people.team_b, "uid": "4b6c9c4e-0000-4000-8000-000000000000"}},
             "status.assignedNamespaceRef"),
            ({"conditions": flipped}, "the Assigned condition"),
            ({"missingSince": "2000-01-01T00:00:00Z", "assignedNamespaceRef": None}, "status.missingSince, status.assignedNamespaceRef"),
        ):  # fmt: skip
            message = await refusal(merge(agent_api, "nodepcidevices", name, {"status": status}, status=True))
            assert message.endswith(says(fields)), message
        # The in-use finalizer is the operator's too (added here; taking it off is refused alike).
        message = await refusal(merge(agent_api, "nodepcidevices", name, {"metadata": {"finalizers": ["passthrough.io/in-use"]}}))
        assert message.endswith(says("metadata.finalizers")), message
    after = await npci.get(name)
    assert {k: after["status"].get(k) for k in ("missingSince", "nodeGoneSince", "assignedNamespaceRef", "conditions")} == {
        k: before["status"].get(k) for k in ("missingSince", "nodeGoneSince", "assignedNamespaceRef", "conditions")}
    assert after["metadata"].get("finalizers") == before["metadata"].get("finalizers")


async def test_only_the_operator_writes_pcidevices_even_where_rbac_lets_a_tenant(cluster, people, devices, release, tmp_path):
    """A namespace owner as Capsule or Rancher make them (every verb on every resource of the
    namespace) passes RBAC for PCIDevices; the chart's policy refuses every write but the operator's."""
    team, name, policy = people.team_a, devices.assigned, f"{release.name}-pcidevices"
    operator_user = f"system:serviceaccount:{release.namespace}:{release.name}-operator"
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "everything", "namespace": team},
            "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]}  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(role))
    owner = identities.identity(cluster, team, "namespace-owner", tmp_path)
    cluster.kubectl("create", "rolebinding", "namespace-owner", "--role=everything", f"--serviceaccount={team}:namespace-owner",
                    "-n", team)  # fmt: skip
    _wait(lambda: owner.can_i("create", PCI, "-n", team), "RBAC to let the namespace owner create PCIDevices")
    assert all(owner.can_i(verb, PCI, "-n", team) for verb in ("patch", "update", "delete"))
    assert owner.can_i("patch", PCI, "-n", team, "--subresource=status")

    says = policy_no(policy, f"PCIDevices are written by the passthrough operator ({operator_user}) only, not by {owner.user}: "
                             f"a device reaches namespace {team} when a device admin sets spec.assignedNamespace of its NodePCIDevice")  # fmt: skip
    forged = yaml.safe_dump({"apiVersion": f"{GROUP}/{VERSION}", "kind": "PCIDevice", "metadata": {"name": f"pci-{'0' * 40}"}})
    _wait(lambda: policy in owner.kubectl("create", "-n", team, "--dry-run=server", "-f", "-", input=forged).stderr,
          f"the API server to enforce {policy}")  # fmt: skip
    assert refused(owner.kubectl("create", "-n", team, "-f", "-", input=forged)).endswith(says)
    label = json.dumps({"metadata": {"labels": {"mine": "yes"}}})
    assert refused(owner.kubectl("patch", "pci", name, "-n", team, "--type=merge", "-p", label)).endswith(says)
    async with logged_in(owner) as owner_api:
        message = await refusal(client.CustomObjectsApi(owner_api).patch_namespaced_custom_object_status(
            GROUP, VERSION, team, "pcidevices", name, {"status": {"nodeName": "elsewhere"}},
            _content_type="application/merge-patch+json"))  # fmt: skip
    assert message.endswith(says)
    assert refused(owner.kubectl("delete", "pci", name, "-n", team)).endswith(says)
    assert owner.kubectl("get", "pci", name, "-n", team).returncode == 0  # still there, and still the operator's
    assert owner.kubectl("get", "pci", f"pci-{'0' * 40}", "-n", team).returncode != 0

    # The operator's own ServiceAccount passes (a server-side dry run: nothing is written).
    operator = identities.identity(cluster, release.namespace, f"{release.name}-operator", tmp_path)
    async with logged_in(operator) as operator_api:
        await client.CustomObjectsApi(operator_api).patch_namespaced_custom_object(
            GROUP, VERSION, team, "pcidevices", name, {"metadata": {"labels": {"probe": "yes"}}},
            _content_type="application/merge-patch+json", dry_run="All")  # fmt: skip


# -- who holds a device, and namespaces tenants create --------------------------------------------


async def test_the_agent_reports_who_holds_its_devices_and_the_operator_tells_the_namespace(api, people, nodes, devices):
    """status.holders is the agent's to write (its node policy lets it, for its own node's devices
    only); the operator copies it into the PCIDevice, which only the operator writes."""
    name, team = devices.assigned, people.team_a
    holders = [{"namespace": team, "pod": "virt-launcher-vm-1", "resource": f"passthrough.io/{name}"}]
    async with logged_in(people.agent) as agent_api:
        await merge(agent_api, "nodepcidevices", name, {"status": {"holders": holders}}, status=True)
        message = await refusal(merge(agent_api, "nodepcidevices", devices.other_node, {"status": {"holders": holders}}, status=True))
        assert f"may write only NodePCIDevices labelled passthrough.io/node={nodes.one.name}" in message
    try:
        assert (await Custom(api, "nodepcidevices").get(name))["status"]["holders"] == holders

        async def told():
            device = await Custom(api, "pcidevices", namespaced=True).get(name, team)
            return device if (device.get("status") or {}).get("holders") == holders else None

        await support.wait_for(told, 20, what=f"the PCIDevice {team}/{name} to name its holders")
        # A tenant sees it; `kubectl get pci` lists them for the namespace's own reader.
        got = people.viewer.kubectl("get", "pci", name, "-n", team, "-o", "jsonpath={.status.holders[*].pod}")
        assert got.returncode == 0 and got.stdout == "virt-launcher-vm-1", (got.stdout, got.stderr)
    finally:
        async with logged_in(people.agent) as agent_api:
            await merge(agent_api, "nodepcidevices", name, {"status": {"holders": None}}, status=True)


async def test_with_confirm_new_namespaces_a_namespace_a_tenant_makes_after_the_assignment_waits_for_a_device_admin(
    api, cluster, people, devices, release, tmp_path
):
    """Where tenants create namespaces (Capsule, Rancher projects), whoever first creates the namespace
    an assignment names would get the device: with devices.confirmNewNamespaces, it gets nothing until a
    device admin confirms that namespace by its uid, with the command the NodePCIDevice gives."""
    # Node-2's GPU (no agent there moves it): node-1's agent, with no kubelet to ask, holds a device
    # it may not give back as NotReady, and a device that is not Ready is not handed out either way.
    name, team = devices.other_node, f"team-c-{release.suffix}"
    configs, npci = Custom(api, "passthroughconfigs"), Custom(api, "nodepcidevices")
    pcidevices = Custom(api, "pcidevices", namespaced=True)
    await configs.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
                         "spec": {"devices": {"confirmNewNamespaces": True}}}, "admin")  # fmt: skip
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "namespace-creator"},
            "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["create", "get"]}]}  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(role))
    creator = identities.identity(cluster, people.team_b, "namespace-creator", tmp_path)
    binding = identities.bind(cluster, creator, "namespace-creator")

    async def assigned(reason: str, says: str = "") -> dict | None:
        got = next((c for c in ((await npci.get(name)) or {}).get("status", {}).get("conditions", []) if c["type"] == "Assigned"), {})
        return got if got.get("reason") == reason and says in got.get("message", "") else None

    try:
        answer = people.device_admin.kubectl("patch", "npci", name, "--type=merge", "-p", assignment(team))
        assert answer.returncode == 0, answer.stderr
        await support.wait_for(lambda: assigned("NamespaceNotFound", f"Namespace {team} does not exist"), 20,
                               what="the assignment to a namespace nobody has")
        got = await support.wait_for(lambda: assigned("NamespaceNotFound", "devices.confirmNewNamespaces"), 20,
                                     what="the note that a tenant's namespace will wait")
        _wait(lambda: creator.can_i("create", "namespaces"), "RBAC to let the tenant create namespaces")
        answer = creator.kubectl("create", "namespace", team)
        assert answer.returncode == 0, answer.stderr
        got = await support.wait_for(lambda: assigned("NamespaceNotConfirmed"), 20, what="NamespaceNotConfirmed")
        uid = json.loads(cluster.kubectl("get", "namespace", team, "-o", "json").stdout)["metadata"]["uid"]
        assert got["status"] == "False" and f"uid {uid}" in got["message"], got
        # Nothing reached the namespace: no PCIDevice, no hand-out (which is what the node acts on).
        # The condition is the marker: the operator writes a NodePCIDevice's status only after the
        # PCIDevice writes of the same decision, and decides the same again from the same objects.
        assert await pcidevices.get(name, team) is None
        assert (await npci.get(name))["status"].get("assignedNamespaceRef") is None
        # The tenant cannot confirm it itself.
        confirm = json.dumps({"spec": {"confirmedNamespaceUID": uid}})
        assert "(Forbidden)" in creator.kubectl("patch", "npci", name, "--type=merge", "-p", confirm).stderr
        # The device admin runs the command the condition gives, as it is written there.
        command = re.search(r"kubectl patch npci (\S+) --type=merge -p '([^']*)'", got["message"])
        assert command is not None and command[1] == name and json.loads(command[2]) == json.loads(confirm), got["message"]
        answer = people.device_admin.kubectl("patch", "npci", command[1], "--type=merge", "-p", command[2])
        assert answer.returncode == 0, answer.stderr
        await support.wait_for(lambda: assigned("Assigned"), 20, what="the hand-out once confirmed")
        assert await pcidevices.get(name, team) is not None
        assert (await npci.get(name))["status"]["assignedNamespaceRef"] == {"name": team, "uid": uid}
    finally:
        people.device_admin.kubectl("patch", "npci", name, "--type=merge", "-p",
                                    json.dumps({"spec": {"assignedNamespace": "", "confirmedNamespaceUID": ""}}))  # fmt: skip
        with contextlib.suppress(ApiException):
            await configs.delete("cluster")
        cluster.kubectl("delete", "namespace", team, "--wait=false", check=False)
        cluster.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "clusterrole", "namespace-creator", "--ignore-not-found", check=False)
