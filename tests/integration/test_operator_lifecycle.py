"""The operator against the real control plane: assignment, conditions, VMs, grace, events.

NodePCIDevices are written as the node agent writes them (`e2e.support.report_device`), the
admin's assignment as `kubectl patch` would, and VMs through KubeVirt's real CRD schema.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes_asyncio import client

from e2e import support
from passthrough.controller.world import FINALIZER
from passthrough.kube.custom import OPERATOR_MANAGER, Custom

pytestmark = pytest.mark.cluster


def conditions(obj) -> dict:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


@pytest.fixture
def kinds(api):
    return Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)


@pytest.fixture
async def gpu_device(api, unique, operator):
    """An unassigned, ready GPU on a fresh node; yields (node, NodePCIDevice name)."""
    node = await support.ensure_node(api, f"node-{unique}")
    name = await support.report_device(api, node, support.gpu("0000:3b:00.0"))
    yield node, name
    await support.remove_node(api, node.name)


async def condition_of(kind: Custom, name: str, type_: str, namespace: str | None = None) -> dict:
    return conditions(await kind.get(name, namespace)).get(type_, {})


async def wait_condition(kind, name, type_, reason, namespace=None, timeout=20, contains=""):
    async def check():
        got = await condition_of(kind, name, type_, namespace)
        return got if got.get("reason") == reason and contains in got.get("message", "") else None

    return await support.wait_for(check, timeout, what=f"{type_}={reason} ({contains}) on {namespace or ''}/{name}")


def vm_body(namespace: str, name: str, devices: list[str]) -> dict:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "runStrategy": "Always",
            "template": {
                "spec": {
                    "domain": {
                        "devices": {"hostDevices": [{"name": f"dev{i}", "deviceName": d} for i, d in enumerate(devices)]},
                        "resources": {"requests": {"memory": "1Gi"}},
                    }
                }
            },
        },
    }


async def put_vm(api, namespace: str, name: str, devices: list[str]) -> dict:
    objects = client.CustomObjectsApi(api)
    try:
        live = await objects.get_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines", name)
        body = vm_body(namespace, name, devices)
        body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        return await objects.replace_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines", name, body)
    except client.exceptions.ApiException as exc:
        if exc.status != 404:
            raise
        return await objects.create_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines", vm_body(namespace, name, devices))


async def test_assignment_creates_the_pcidevice_with_attributes_and_owner(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    _, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")

    async def with_status():  # written beside the condition, not before it
        found = await pcidev.get(name, namespace)
        return found if (found or {}).get("status") else None

    device = await support.wait_for(with_status, 20, what=f"PCIDevice {namespace}/{name} with its status")
    node_device = await npci.get(name)
    assert device["status"]["attributes"] == node_device["status"]["attributes"]
    assert device["status"]["nodeName"] == node_device["status"]["attributes"]["nodeName"]
    assert device["status"]["resourceName"] == f"passthrough.io/{name}"
    [owner] = device["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("NodePCIDevice", node_device["metadata"]["uid"], True)
    assert conditions(device)["Ready"]["lastTransitionTime"] == conditions(node_device)["Ready"]["lastTransitionTime"]
    # Kopf leaves no trace on the objects: no annotations, no finalizer nobody needs.
    for obj in (device, node_device):
        assert not any("kopf" in k for k in (obj["metadata"].get("annotations") or {}))
        assert not obj["metadata"].get("finalizers")


async def test_unassigning_deletes_the_pcidevice(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    _, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")
    await support.assign(api, name, "")
    got = await wait_condition(npci, name, "Assigned", "Available", contains="Not assigned")
    assert got["status"] == "False"
    assert await pcidev.get(name, namespace) is None


async def test_the_nodepcidevice_says_assigned_or_not_only_after_the_pcidevice_is_made_or_deleted(api, kinds, gpu_device, namespace):
    """The order the API server recorded the writes in (resourceVersions on one watch each):
    the condition that reports on the PCIDevice is never there before the PCIDevice is."""
    npci, pcidev = kinds
    _, name = gpu_device
    start = (await npci.list())["metadata"]["resourceVersion"]
    seen: list[tuple[int, str]] = []

    async def record(kind: Custom, what) -> None:
        async for type_, obj in kind.watch(resource_version=start, timeout=120):
            if type_ != "BOOKMARK" and obj["metadata"]["name"] == name:
                seen.append((int(obj["metadata"]["resourceVersion"]), what(type_, obj)))

    def assigned(type_, obj) -> str:
        got = conditions(obj).get("Assigned", {})
        return f"npci {got.get('status')} {got.get('reason')}"

    watches = [asyncio.create_task(record(npci, assigned)), asyncio.create_task(record(pcidev, lambda t, o: f"pci {t}"))]
    try:
        for _ in range(5):
            await support.assign(api, name, namespace)
            await wait_condition(npci, name, "Assigned", "Assigned")
            await support.assign(api, name, "")
            await wait_condition(npci, name, "Assigned", "Available", contains="Not assigned")
        await asyncio.sleep(0.5)  # the last events through both watches
    finally:
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
    exists = False
    told = []
    for _, what in sorted(seen):
        if what == "pci ADDED":
            exists = True
        elif what == "pci DELETED":
            exists = False
        elif what.startswith("npci ") and (not told or told[-1][0] != what):
            told.append((what, exists))
    assert [t for t in told if t[0] == "npci True Assigned"] == [("npci True Assigned", True)] * 5, sorted(seen)
    assert [t for t in told if t[0] == "npci False Available"][-5:] == [("npci False Available", False)] * 5, sorted(seen)


async def test_reassigning_moves_the_pcidevice(api, kinds, gpu_device, namespace, unique):
    npci, pcidev = kinds
    _, name = gpu_device
    core = client.CoreV1Api(api)
    other = f"{namespace}-b"
    await support.create_namespace(api, other)
    try:
        await support.assign(api, name, namespace)
        await wait_condition(npci, name, "Assigned", "Assigned")
        await support.assign(api, name, other)
        await support.wait_for(lambda: pcidev.get(name, other), what="PCIDevice in the new namespace")
        await support.wait_for(absent(pcidev, name, namespace), what="old PCIDevice gone")
        assert other in (await condition_of(npci, name, "Assigned"))["message"]
    finally:
        await core.delete_namespace(other)


def absent(kind: Custom, name: str, namespace: str | None = None):
    async def check():
        return await kind.get(name, namespace) is None

    return check


async def test_a_namespace_created_later_completes_the_assignment(api, kinds, gpu_device, unique):
    npci, pcidev = kinds
    _, name = gpu_device
    later = f"late-{unique}"
    await support.assign(api, name, later)
    await wait_condition(npci, name, "Assigned", "NamespaceNotFound", contains=f"Namespace {later} does not exist")
    core = client.CoreV1Api(api)
    await support.create_namespace(api, later)
    try:
        await wait_condition(npci, name, "Assigned", "Assigned")
        assert await pcidev.get(name, later) is not None
        assert (await npci.get(name))["spec"] == {"assignedNamespace": later}  # nobody touched the spec
    finally:
        await core.delete_namespace(later)


async def test_deleting_the_namespace_takes_the_pcidevice_and_the_condition_says_so(api, kinds, gpu_device, unique):
    npci, pcidev = kinds
    _, name = gpu_device
    ns = f"gone-{unique}"
    core = client.CoreV1Api(api)
    await support.create_namespace(api, ns)
    await support.assign(api, name, ns)
    await wait_condition(npci, name, "Assigned", "Assigned")
    await core.delete_namespace(ns)

    async def gone_and_said():
        message = (await condition_of(npci, name, "Assigned")).get("message", "")
        return (await pcidev.get(name, ns)) is None and ("being deleted" in message or "does not exist" in message)

    await support.wait_for(gone_and_said, 60, what="PCIDevice removed with its namespace")


async def test_ready_is_mirrored_and_a_device_back_within_grace_is_just_ready_again(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    node, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")
    uid = (await pcidev.get(name, namespace))["metadata"]["uid"]
    await support.report_device(api, node, support.gpu("0000:3b:00.0"), missing=True)
    lost = await wait_condition(pcidev, name, "Ready", "NotFound", namespace)
    assert lost["lastTransitionTime"] == (await condition_of(npci, name, "Ready"))["lastTransitionTime"]
    await support.report_device(api, node, support.gpu("0000:3b:00.0"))
    await wait_condition(pcidev, name, "Ready", "Ready", namespace)
    assert (await pcidev.get(name, namespace))["metadata"]["uid"] == uid  # the same object throughout


async def test_after_the_grace_period_the_pcidevice_is_removed_and_comes_back_with_the_device(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    node, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")
    await support.report_device(api, node, support.gpu("0000:3b:00.0"), missing=True)
    got = await wait_condition(npci, name, "Assigned", "DeviceMissing", timeout=30, contains="grace period")  # 4s here
    assert "was removed" in got["message"]
    assert await pcidev.get(name, namespace) is None
    assert (await npci.get(name))["spec"]["assignedNamespace"] == namespace
    await support.report_device(api, node, support.gpu("0000:3b:00.0"))
    await wait_condition(npci, name, "Assigned", "Assigned")
    assert await pcidev.get(name, namespace) is not None


async def test_an_unassigned_device_gone_from_its_node_is_deleted(api, kinds, gpu_device):
    npci, _ = kinds
    node, name = gpu_device
    await support.report_device(api, node, support.gpu("0000:3b:00.0"), missing=True)

    await support.wait_for(absent(npci, name), 20, what="NodePCIDevice deleted")


async def test_a_vm_reference_attaches_the_device_on_both_objects(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    _, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")
    await put_vm(api, namespace, "vm-a", [f"passthrough.io/{name}"])
    got = await wait_condition(pcidev, name, "Attached", "AttachedToVirtualMachine", namespace)
    assert f"{namespace}/vm-a" in got["message"]
    mirrored = await wait_condition(npci, name, "Attached", "AttachedToVirtualMachine")
    assert f"{namespace}/vm-a" in mirrored["message"]
    device = await pcidev.get(name, namespace)
    assert device["status"]["attachedTo"] == "vm-a"
    assert device["metadata"]["finalizers"] == [FINALIZER]
    # The VM drops it: detached, and nothing holds the objects any more.
    await put_vm(api, namespace, "vm-a", [])
    await wait_condition(pcidev, name, "Attached", "Available", namespace)
    await wait_condition(npci, name, "Attached", "Available", contains="No VirtualMachine")
    assert not (await pcidev.get(name, namespace))["metadata"].get("finalizers")


async def test_reassigning_while_a_vm_uses_the_device_never_cuts_it_off(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    _, name = gpu_device
    core = client.CoreV1Api(api)
    other = f"{namespace}-new"
    await support.create_namespace(api, other)
    try:
        await support.assign(api, name, namespace)
        await wait_condition(npci, name, "Assigned", "Assigned")
        vm = await put_vm(api, namespace, "running", [f"passthrough.io/{name}"])
        await wait_condition(pcidev, name, "Attached", "AttachedToVirtualMachine", namespace)
        await support.assign(api, name, other)
        await support.wait_for(lambda: pcidev.get(name, other), what="PCIDevice in the new namespace")

        async def old_terminating():
            old = await pcidev.get(name, namespace)
            return old is not None and old["metadata"].get("deletionTimestamp")

        await support.wait_for(old_terminating, what="old PCIDevice Terminating")
        # It stays, the VM still listing it: the operator's word on the NodePCIDevice is the marker.
        says = f"stays until VirtualMachine {namespace}/running drops it"

        async def held():
            return says in (await condition_of(npci, name, "Assigned")).get("message", "")

        await support.wait_for(held, what="the Assigned condition saying the old PCIDevice stays")
        assert await old_terminating()
        live_vm = await client.CustomObjectsApi(api).get_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines", "running")
        assert live_vm["metadata"]["resourceVersion"] == vm["metadata"]["resourceVersion"]  # the VM is untouched

        await put_vm(api, namespace, "running", [])

        await support.wait_for(absent(pcidev, name, namespace), what="old PCIDevice released")
        assert await pcidev.get(name, other) is not None
    finally:
        await core.delete_namespace(other)


async def test_deleting_a_node_device_waits_for_the_pcidevice_a_vm_uses(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    _, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")
    await put_vm(api, namespace, "holder", [f"passthrough.io/{name}"])
    await support.wait_for(lambda: _has_finalizer(npci, name), what="NodePCIDevice finalizer")
    await npci.delete(name)
    # The marker: the operator's decision on the deleted NodePCIDevice, written after its
    # PCIDevice writes and its finalizer decision: it says what it waits for.
    said = await wait_condition(npci, name, "Assigned", "InProgress", contains="Deleting")
    assert f"{namespace}/holder" in said["message"], said
    held = await npci.get(name)
    assert held is not None and held["metadata"].get("deletionTimestamp") and FINALIZER in held["metadata"]["finalizers"]
    assert (await pcidev.get(name, namespace))["metadata"].get("deletionTimestamp")
    await put_vm(api, namespace, "holder", [])

    async def both_gone():
        return await npci.get(name) is None and await pcidev.get(name, namespace) is None

    await support.wait_for(both_gone, what="NodePCIDevice and PCIDevice gone")


async def _has_finalizer(kind, name):
    obj = await kind.get(name)
    return obj and FINALIZER in (obj["metadata"].get("finalizers") or [])


async def test_transitions_are_told_as_events(api, kinds, gpu_device, namespace):
    npci, _ = kinds
    _, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")
    core = client.CoreV1Api(api)

    async def events():
        found = await core.list_namespaced_event("default", field_selector=f"involvedObject.name={name}")
        tenant = await core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
        return (found.items and tenant.items) and (found.items, tenant.items)

    admin, tenant = await support.wait_for(events, what="events")
    assert any(e.reason == "Assigned" and e.involved_object.kind == "NodePCIDevice" for e in admin)
    assert any(e.reason == "Assigned" and e.involved_object.kind == "PCIDevice" for e in tenant)
    # The first Event of the new PCIDevice names its uid, which `kubectl describe pci` selects by.
    uid = (await kinds[1].get(name, namespace))["metadata"]["uid"]
    described = await core.list_namespaced_event(namespace, field_selector=f"involvedObject.uid={uid}")
    assert any(e.reason == "Assigned" for e in described.items), [(e.reason, e.involved_object.uid) for e in tenant]


async def test_racing_assignments_end_in_the_namespace_written_last(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    _, name = gpu_device
    core = client.CoreV1Api(api)
    others = [f"{namespace}-{i}" for i in range(3)]
    for ns in others:
        await support.create_namespace(api, ns)
    try:
        for ns in [namespace, *others]:
            await support.assign(api, name, ns)  # back to back, no waiting
        last = others[-1]

        async def settled():
            found = [ns for ns in [namespace, *others] if await pcidev.get(name, ns) is not None]
            got = await condition_of(npci, name, "Assigned")
            return found == [last] and got.get("reason") == "Assigned" and last in got.get("message", "")

        await support.wait_for(settled, what=f"exactly one PCIDevice, in {last}")
    finally:
        for ns in others:
            await core.delete_namespace(ns)


async def test_system_namespaces_are_refused_up_front(cluster, gpu_device):
    _, name = gpu_device
    result = cluster.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"spec": {"assignedNamespace": "kube-system"}}), check=False)
    assert result.returncode != 0 and "system namespace" in result.stderr


async def test_an_idle_operator_writes_nothing(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    _, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")
    await wait_condition(pcidev, name, "Ready", "Ready", namespace)
    # Earlier tests' namespaces and nodes are still being cleaned up by the controller-manager
    # (which posts Events of its own about them); once our kinds have settled, an idle operator
    # must leave them, and its own Events, alone.
    ours = ("nodepcidevices", "pcidevices")
    await support.quiet(api, ours, settle=3, timeout=60, verbs=support.CHANGE_VERBS)
    await support.wait_for(lambda: _events_settled(api), what="the operator's Events of the assignment posted", timeout=30)
    before, events_before = await support.write_counts(api), await support.events_from(api, OPERATOR_MANAGER)
    assert events_before, "the operator's Events of the assignment are not found by their reporting component"
    await asyncio.sleep(5)
    after, events_after = await support.write_counts(api), await support.events_from(api, OPERATOR_MANAGER)
    assert support.writes_between(before, after, *ours, verbs=support.CHANGE_VERBS) == 0, support.diff(before, after)
    assert events_after == events_before, "the idle operator posted or counted up Events"


async def _events_settled(api) -> bool:
    """True when the operator's Events stay the same for two seconds."""
    first = await support.events_from(api, OPERATOR_MANAGER)
    await asyncio.sleep(2)
    return await support.events_from(api, OPERATOR_MANAGER) == first


async def test_an_iommu_group_goes_to_one_namespace(api, kinds, gpu_device, namespace, unique):
    node_devices, pcidevices = kinds
    node, gpu = gpu_device
    # The A10's audio function, in the same IOMMU group on the same node.
    group = support.gpu("0000:3b:00.0").iommu_group
    audio = await support.report_device(
        api, node, support.gpu("0000:3b:00.1", device="1aef", name="GA102 Audio", resource="", iommu_group=group))
    other = await support.create_namespace(api, f"t-{unique}-b")
    try:
        await support.assign(api, gpu, namespace)
        await wait_condition(node_devices, gpu, "Assigned", "Assigned")
        await support.assign(api, audio, other)
        got = await wait_condition(node_devices, audio, "Assigned", "IOMMUGroupConflict", contains=gpu)
        assert namespace in got["message"] and got["status"] == "False"
        assert await pcidevices.get(audio, other) is None
        # Once the GPU leaves that namespace, the waiting assignment completes by itself.
        await support.assign(api, gpu, "")
        await wait_condition(node_devices, audio, "Assigned", "Assigned")
        assert await pcidevices.get(audio, other) is not None
    finally:
        await client.CoreV1Api(api).delete_namespace(other)


async def test_a_namespace_deleted_and_made_again_does_not_inherit_the_device(api, kinds, gpu_device, unique):
    node_devices, pcidevices = kinds
    _, name = gpu_device
    core = client.CoreV1Api(api)
    team = await support.create_namespace(api, f"t-{unique}-re")
    await support.assign(api, name, team)
    await wait_condition(node_devices, name, "Assigned", "Assigned")
    await core.delete_namespace(team)

    async def gone():
        try:
            await core.read_namespace(team)
        except client.exceptions.ApiException as exc:
            return exc.status == 404
        return False

    await support.wait_for(gone, 60, what=f"namespace {team} deleted")
    await support.create_namespace(api, team)  # perhaps by another tenant
    try:
        got = await wait_condition(node_devices, name, "Assigned", "NamespaceRecreated")
        assert got["status"] == "False"
        assert await pcidevices.get(name, team) is None
        # The admin gives it to the new namespace on purpose: clear, then assign again.
        await support.assign(api, name, "")
        await wait_condition(node_devices, name, "Assigned", "Available")
        await support.assign(api, name, team)
        await wait_condition(node_devices, name, "Assigned", "Assigned")
        assert await pcidevices.get(name, team) is not None
    finally:
        await core.delete_namespace(team)
