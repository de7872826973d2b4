"""The device lifecycle decision, without a cluster: what the operator writes for each state."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from passthrough.api import views
from passthrough.api.conditions import Cond
from passthrough.controller import lifecycle as lc
from passthrough.controller.world import (FINALIZER, SYSTEM_NAMESPACES, ApplyDevice, ApplyDeviceStatus, ApplyNodeDeviceFinalizer,
                                          ApplyNodeDeviceStatus, DeleteDevice, DeleteNodeDevice, World)
from passthrough.pci.naming import node_pci_device_name

NOW = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.UTC)
NAME = node_pci_device_name("0000:3b:00.0", "10de", "2236", "gpu-1")  # the name its agent gives it
RESOURCE = f"passthrough.io/{NAME}"
READY = Cond("True", "Ready", "The device can be passed through.", "2026-11-29T11:00:00Z")
ATTRS = {"pciAddress": "0000:3b:00.0", "vendorID": "10de", "deviceID": "2236", "class": "030200", "nodeName": "gpu-1"}


def node_device(namespace="", ready=READY, deleting=False, finalizers=(), assigned=None, attached=None, missing_since="") -> views.NodeDevice:
    return views.NodeDevice(
        name=NAME, uid="npci-uid", resource_version="10", assigned_namespace=namespace, deleting=deleting,
        finalizers=tuple(finalizers), ready=ready, assigned=assigned, attached=attached, attributes=ATTRS, node_name="gpu-1",
        missing_since=missing_since,
    )


def device(namespace, deleting=False, finalizers=(), status=None, owner_uid="npci-uid") -> views.Device:
    return views.Device(
        name=NAME, namespace=namespace, uid=f"uid-{namespace}", resource_version="11", deleting=deleting,
        metadata={
            "labels": {"passthrough.io/node": "gpu-1"},
            "ownerReferences": [{"uid": owner_uid, "controller": True}],
            "finalizers": list(finalizers),
        },
        status=status or {},
    )


def world(npci, devices=(), namespaces=None, vms=None, now=NOW, grace=datetime.timedelta(minutes=10)) -> World:
    return World(
        name=NAME, node_device=npci, devices=tuple(devices),
        namespaces={"team-a": "Active", "team-b": "Active"} if namespaces is None else namespaces,
        referencing_vms=vms or {}, now=now, grace=grace,
    )


def of(plan, kind):
    return [w for w in plan.writes if isinstance(w, kind)]


def npci_conditions(plan) -> dict[str, dict]:
    [write] = of(plan, ApplyNodeDeviceStatus)
    return {c["type"]: c for c in write.body["status"]["conditions"]}


def settle(w: World) -> World:
    """The world after a plan's writes landed (what the indexes show next)."""
    plan = lc.decide(w)
    npci = w.node_device
    devices = {d.namespace: d for d in w.devices}
    for write in plan.writes:
        if isinstance(write, ApplyDevice):
            old = devices.get(write.namespace)
            meta = write.body["metadata"]
            if old and old.deleting and set(meta.get("finalizers") or ()) - set(old.metadata["finalizers"]):
                # As the API server: "no new finalizers can be added if the object is being deleted".
                raise AssertionError(f"a finalizer planned onto the deleting PCIDevice {write.namespace}/{NAME}")
            devices[write.namespace] = views.Device(
                name=NAME, namespace=write.namespace, uid=old.uid if old else f"uid-{write.namespace}", resource_version="12",
                deleting=old.deleting if old else False,
                metadata={k: meta.get(k, old.metadata.get(k) if old else None) for k in ("labels", "ownerReferences", "finalizers")},
                status=old.status if old else {},
            )
        elif isinstance(write, ApplyDeviceStatus):
            d = devices[write.namespace]
            devices[write.namespace] = views.Device(d.name, d.namespace, d.uid, "13", d.deleting, d.metadata, write.body["status"])
        elif isinstance(write, DeleteDevice):
            d = devices[write.namespace]
            if d.metadata["finalizers"]:
                devices[write.namespace] = views.Device(d.name, d.namespace, d.uid, "14", True, d.metadata, d.status)
            else:
                del devices[write.namespace]
        elif isinstance(write, ApplyNodeDeviceStatus):
            conds = {c["type"]: Cond.of(c) for c in write.body["status"]["conditions"]}
            npci = dataclasses.replace(npci, assigned=conds["Assigned"], attached=conds["Attached"],
                                       missing_since=write.body["status"].get("missingSince", ""),
                                       node_gone_since=write.body["status"].get("nodeGoneSince", ""),
                                       handed_to=views.NodeDevice.of({"metadata": {"name": NAME}, "status": write.body["status"]}).handed_to)  # fmt: skip
        elif isinstance(write, ApplyNodeDeviceFinalizer):
            if npci.deleting and set(write.body["metadata"]["finalizers"]) - set(npci.finalizers):
                raise AssertionError("a finalizer planned onto the deleting NodePCIDevice")
            npci = dataclasses.replace(npci, finalizers=tuple(write.body["metadata"]["finalizers"]))
    for ns, d in list(devices.items()):
        if d.deleting and not d.metadata["finalizers"]:
            del devices[ns]
    return dataclasses.replace(w, node_device=npci, devices=tuple(devices.values()))


def converge(w: World, rounds: int = 5) -> World:
    for _ in range(rounds):
        if not lc.decide(w).writes:
            return w
        w = settle(w)
    raise AssertionError(f"no fixpoint after {rounds} rounds: {lc.decide(w).writes}")


def test_assigning_creates_a_pcidevice_owned_by_the_node_device():
    plan = lc.decide(world(node_device("team-a")))
    [create] = of(plan, ApplyDevice)
    assert create.namespace == "team-a"
    meta = create.body["metadata"]
    assert meta["name"] == NAME and meta["namespace"] == "team-a"
    assert meta["ownerReferences"] == [
        {"apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice", "name": NAME, "uid": "npci-uid",
         "controller": True, "blockOwnerDeletion": True}
    ]
    assert meta["finalizers"] == []  # no VM uses it: nothing to hold
    [status] = of(plan, ApplyDeviceStatus)
    assert status.body["status"]["attributes"] == ATTRS
    assert status.body["status"]["nodeName"] == "gpu-1"
    assert status.body["status"]["resourceName"] == RESOURCE
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("True", "Assigned")
    assert RESOURCE in assigned["message"]


def test_a_state_that_already_holds_writes_nothing():
    settled = converge(world(node_device("team-a")))
    plan = lc.decide(settled)
    assert plan.writes == [] and plan.events == []


def test_unassigning_deletes_the_pcidevice_and_says_available():
    settled = converge(world(node_device("team-a")))
    unassigned = World(NAME, dataclasses.replace(settled.node_device, assigned_namespace=""), settled.devices,
                          settled.namespaces, {}, NOW)
    plan = lc.decide(unassigned)
    assert [(w.namespace, w.uid) for w in of(plan, DeleteDevice)] == [("team-a", "uid-team-a")]
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "Available")


def test_reassigning_deletes_the_old_pcidevice_and_creates_the_new_one():
    settled = converge(world(node_device("team-a")))
    moved = World(NAME, dataclasses.replace(settled.node_device, assigned_namespace="team-b"), settled.devices,
                     settled.namespaces, {}, NOW)
    plan = lc.decide(moved)
    assert [w.namespace for w in of(plan, DeleteDevice)] == ["team-a"]
    assert [w.namespace for w in of(plan, ApplyDevice)] == ["team-b"]
    final = converge(moved)
    assert [d.namespace for d in final.devices] == ["team-b"]


def test_a_missing_namespace_is_named_and_nothing_is_created():
    plan = lc.decide(world(node_device("team-c")))
    assert of(plan, ApplyDevice) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "NamespaceNotFound")
    assert "Namespace team-c does not exist" in assigned["message"]
    assert any(e.type == "Warning" for e in plan.events)


def test_a_terminating_namespace_takes_its_pcidevice_and_the_condition_says_so():
    settled = converge(world(node_device("team-a")))
    going = World(NAME, settled.node_device, settled.devices, {"team-a": "Terminating"}, {}, NOW)
    plan = lc.decide(going)
    assert of(plan, DeleteDevice) == []  # the namespace controller deletes it
    assert "being deleted" in npci_conditions(plan)["Assigned"]["message"]


@pytest.mark.parametrize("namespace", sorted(SYSTEM_NAMESPACES))
def test_system_namespaces_never_receive_devices(namespace):
    plan = lc.decide(world(node_device(namespace), namespaces={namespace: "Active"}))
    assert of(plan, ApplyDevice) == []
    assert "system namespace" in npci_conditions(plan)["Assigned"]["message"]


def test_ready_is_mirrored_with_its_transition_time():
    lost = Cond("False", "NotFound", "No device at 0000:3b:00.0", "2026-11-29T11:58:00Z")
    settled = converge(world(node_device("team-a")))
    plan = lc.decide(World(NAME, dataclasses.replace(settled.node_device, ready=lost), settled.devices,
                              settled.namespaces, {}, NOW))
    [status] = of(plan, ApplyDeviceStatus)
    ready = next(c for c in status.body["status"]["conditions"] if c["type"] == "Ready")
    assert ready == {"type": "Ready", "status": "False", "reason": "NotFound", "message": lost.message,
                     "lastTransitionTime": lost.lastTransitionTime}


def test_an_unassigned_device_gone_from_its_node_is_deleted():
    lost = Cond("False", "NotFound", "gone", "2026-11-29T11:59:00Z")
    plan = lc.decide(world(node_device("", ready=lost)))
    assert of(plan, DeleteNodeDevice) == [DeleteNodeDevice("npci-uid", "10")]  # guarded by its version


def gone(settled: World, since: str, now=NOW) -> World:
    """The settled world once the device is NotFound, the operator having seen it so at `since`."""
    lost = Cond("False", "NotFound", "gone", since)
    npci = dataclasses.replace(settled.node_device, ready=lost, missing_since=since)
    return World(NAME, npci, settled.devices, settled.namespaces, {}, now)


def test_an_assigned_device_gone_keeps_its_pcidevice_for_the_grace_period():
    settled = converge(world(node_device("team-a")))
    plan = lc.decide(gone(settled, "2026-11-29T11:58:00Z"))  # two minutes ago
    assert of(plan, DeleteDevice) == [] and of(plan, DeleteNodeDevice) == []
    assert plan.requeue_after == pytest.approx(8 * 60)


def test_the_grace_period_counts_from_when_the_operator_saw_it_go_not_from_the_nodes_clock():
    settled = converge(world(node_device("team-a")))
    # NotReady for an hour, then NotFound: Ready's transition time stays an hour old (its status
    # stayed False), and a node's clock may be anything. Neither decides.
    an_hour_ago = Cond("False", "NotFound", "gone", "2026-11-29T11:00:00Z")
    w = World(NAME, dataclasses.replace(settled.node_device, ready=an_hour_ago), settled.devices,
                 settled.namespaces, {}, NOW)  # fmt: skip
    plan = lc.decide(w)
    assert of(plan, DeleteDevice) == []
    [write] = of(plan, ApplyNodeDeviceStatus)
    assert write.body["status"]["missingSince"] == "2026-11-29T12:00:00Z"  # now, by the operator's clock
    assert plan.requeue_after == pytest.approx(10 * 60)
    later = settle(w)
    assert lc.decide(later).writes == []  # recorded once
    # Back on its node: the record goes.
    back = World(NAME, dataclasses.replace(later.node_device, ready=READY), later.devices, later.namespaces, {}, NOW)
    [write] = of(lc.decide(back), ApplyNodeDeviceStatus)
    assert "missingSince" not in write.body["status"]


def test_after_the_grace_period_the_pcidevice_is_removed_and_the_condition_says_why():
    settled = converge(world(node_device("team-a")))
    plan = lc.decide(gone(settled, "2026-11-29T11:45:00Z"))  # fifteen minutes ago
    assert [d.namespace for d in of(plan, DeleteDevice)] == ["team-a"]
    assert of(plan, DeleteNodeDevice) == []  # the admin's assignment stands
    message = npci_conditions(plan)["Assigned"]["message"]
    assert "10m00s grace period" in message and "assigned again when the device returns" in message


def test_a_device_that_returns_after_the_grace_period_is_assigned_again():
    settled = converge(world(node_device("team-a")))
    expired = converge(gone(settled, "2026-11-29T11:45:00Z"))
    assert expired.devices == ()
    back = World(NAME, dataclasses.replace(expired.node_device, ready=READY), (), expired.namespaces, {}, NOW)
    assert [w.namespace for w in of(lc.decide(back), ApplyDevice)] == ["team-a"]


def test_a_vm_reference_attaches_and_holds_both_objects():
    vms = {"team-a": ("vm-1",)}
    settled = converge(world(node_device("team-a"), vms=vms))
    [pcidev] = settled.devices
    assert pcidev.metadata["finalizers"] == [FINALIZER]
    assert FINALIZER in settled.node_device.finalizers
    assert settled.node_device.attached.status == "True" and "team-a/vm-1" in settled.node_device.attached.message
    attached = next(c for c in pcidev.status["conditions"] if c["type"] == "Attached")
    assert (attached["status"], attached["reason"]) == ("True", "AttachedToVirtualMachine")
    assert pcidev.status["attachedTo"] == "vm-1"


def test_reassigning_a_device_a_vm_uses_keeps_the_old_pcidevice_terminating():
    vms = {"team-a": ("vm-1",)}
    settled = converge(world(node_device("team-a"), vms=vms))
    moved = World(NAME, dataclasses.replace(settled.node_device, assigned_namespace="team-b"), settled.devices,
                     settled.namespaces, vms, NOW)
    final = converge(moved)
    by_ns = {d.namespace: d for d in final.devices}
    assert by_ns["team-a"].deleting and by_ns["team-a"].metadata["finalizers"] == [FINALIZER]
    assert not by_ns["team-b"].deleting
    assert "stays until VirtualMachine team-a/vm-1 drops it" in final.node_device.assigned.message
    # The VM's spec drops the device: the old PCIDevice lets go.
    released = converge(World(NAME, final.node_device, final.devices, final.namespaces, {}, NOW))
    assert [d.namespace for d in released.devices] == ["team-b"]
    assert FINALIZER not in released.node_device.finalizers


def test_unassigning_a_device_a_vm_uses_is_in_progress_until_the_vm_lets_go():
    vms = {"team-a": ("vm-1",)}
    settled = converge(world(node_device("team-a"), vms=vms))
    unassigned = converge(World(NAME, dataclasses.replace(settled.node_device, assigned_namespace=""),
                                   settled.devices, settled.namespaces, vms, NOW))
    assert unassigned.node_device.assigned.reason == "InProgress"
    assert [d.deleting for d in unassigned.devices] == [True]


def test_a_node_device_being_deleted_waits_for_a_pcidevice_a_vm_uses():
    vms = {"team-a": ("vm-1",)}
    settled = converge(world(node_device("team-a"), vms=vms))
    deleting = World(NAME, dataclasses.replace(settled.node_device, deleting=True), settled.devices,
                        settled.namespaces, vms, NOW)
    held = converge(deleting)
    assert FINALIZER in held.node_device.finalizers and held.devices[0].deleting
    released = converge(World(NAME, held.node_device, held.devices, held.namespaces, {}, NOW))
    assert released.devices == () and FINALIZER not in released.node_device.finalizers


def test_a_node_device_being_deleted_says_what_it_waits_for_and_then_only_goes():
    vms = {"team-a": ("vm-1",)}
    settled = converge(world(node_device("team-a"), vms=vms))
    assert settled.node_device.assigned.status == "True"
    deleting = World(NAME, dataclasses.replace(settled.node_device, deleting=True), settled.devices,
                     settled.namespaces, vms, NOW)
    plan = lc.decide(deleting)
    # Its Assigned=True would tell the admin the device is still handed out; it says why it stays.
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "InProgress")
    assert "Deleting" in assigned["message"] and "team-a/vm-1" in assigned["message"], assigned["message"]
    assert [(e.type, e.reason) for e in plan.events if e.kind == "NodePCIDevice"] == [("Normal", "InProgress")]
    held = converge(deleting)
    assert held.node_device.assigned.reason == "InProgress" and not lc.decide(held).writes
    # The VM lets go: the finalizers go, and nothing is written to a NodePCIDevice about to vanish.
    released = World(NAME, held.node_device, held.devices, held.namespaces, {}, NOW)
    assert not of(lc.decide(released), ApplyNodeDeviceStatus)
    gone = converge(released)
    assert gone.devices == () and FINALIZER not in gone.node_device.finalizers


def test_an_orphaned_pcidevice_no_vm_uses_lets_go_of_its_finalizer():
    orphan = device("team-a", deleting=True, finalizers=[FINALIZER])
    [write] = lc.decide(world(None, [orphan])).writes
    assert isinstance(write, ApplyDevice) and write.body["metadata"]["finalizers"] == []
    assert lc.decide(world(None, [orphan], vms={"team-a": ("vm-1",)})).writes == []


def test_transition_time_is_kept_while_the_status_holds():
    settled = converge(world(node_device("team-a")))
    later = World(NAME, settled.node_device, settled.devices, settled.namespaces, {"team-a": ("vm-1",)},
                     NOW + datetime.timedelta(hours=1))
    plan = lc.decide(later)
    conditions = npci_conditions(plan)
    assert conditions["Assigned"]["lastTransitionTime"] == settled.node_device.assigned.lastTransitionTime
    assert conditions["Attached"]["lastTransitionTime"] == lc.timestamp(later.now)


def test_two_racing_assignments_end_in_the_namespace_written_last():
    # team-b is written while the hand-out to team-a is half done: team-a's PCIDevice made, its
    # status and the NodePCIDevice's not written yet (the worker's first write landed, then the
    # spec changed under it). The next decisions undo team-a's and hand the device to team-b.
    start = world(node_device("team-a"))
    [made] = of(lc.decide(start), ApplyDevice)
    assert made.namespace == "team-a"
    half_done = dataclasses.replace(settle_only(start, made), node_device=node_device("team-b"))
    final = converge(half_done)
    assert [d.namespace for d in final.devices] == ["team-b"]
    assert (final.node_device.assigned.status, final.node_device.assigned.reason) == ("True", "Assigned")
    assert "team-b" in final.node_device.assigned.message


def settle_only(w: World, write: ApplyDevice) -> World:
    """The world after only `write` of a plan landed."""
    meta = write.body["metadata"]
    made = views.Device(NAME, write.namespace, f"uid-{write.namespace}", "12", False,
                     {k: meta.get(k) for k in ("labels", "ownerReferences", "finalizers")}, {})  # fmt: skip
    return dataclasses.replace(w, devices=(*w.devices, made))


def test_a_device_that_is_not_ready_is_not_handed_out_and_the_condition_says_why():
    busy = Cond("False", "NotReady", "network interface eth0 is up; bring it down (ip link set eth0 down)", "2026-11-29T11:00:00Z")
    plan = lc.decide(world(node_device("team-a", ready=busy)))
    assert of(plan, ApplyDevice) == [] and of(plan, ApplyDeviceStatus) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "DeviceNotReady")
    assert "eth0 is up" in assigned["message"] and "team-a" in assigned["message"]
    # Unbound on its node (vfio-pci not loaded) waits the same way; so does a device no agent reported yet.
    unbound = Cond("False", "VfioNotLoaded", "vfio-pci is not loaded on this node: modprobe vfio-pci", "2026-11-29T11:00:00Z")
    assert npci_conditions(lc.decide(world(node_device("team-a", ready=unbound))))["Assigned"]["reason"] == "DeviceNotReady"
    assert npci_conditions(lc.decide(world(node_device("team-a", ready=None))))["Assigned"]["reason"] == "DeviceNotReady"


def test_an_assignment_held_back_is_a_warning_event_and_progress_is_normal():
    def assigned_event(w: World) -> tuple[str, str]:
        [event] = [e for e in lc.decide(w).events if e.kind == "NodePCIDevice" and e.reason not in ("Attached", "Detached")]
        return event.type, event.reason

    busy = Cond("False", "NotReady", "in use", "2026-11-29T11:00:00Z")
    assert assigned_event(world(node_device("team-a", ready=busy))) == ("Warning", "DeviceNotReady")
    conflict = World(NAME, node_device("team-b"), (), {"team-a": "Active", "team-b": "Active"}, {}, NOW, group={"pci-audio": "team-a"})
    assert assigned_event(conflict) == ("Warning", "IOMMUGroupConflict")
    recreated = World(NAME, dataclasses.replace(node_device("team-a"), handed_to=("team-a", "uid-1")), (), {"team-a": "Active"},
                         {}, NOW, namespace_uids={"team-a": "uid-2"})  # fmt: skip
    assert assigned_event(recreated) == ("Warning", "NamespaceRecreated")
    unlisted = World(NAME, node_device("team-a"), (), {"team-a": "Active"}, {}, NOW, allow_list_problem="the config is invalid")
    assert assigned_event(unlisted) == ("Warning", "AllowListNotApplied")
    assert assigned_event(world(node_device("team-a"), namespaces={})) == ("Warning", "NamespaceNotFound")  # no such namespace
    # Handing out, unassigning and waiting for the previous PCIDevice to go are news, not trouble.
    assert assigned_event(world(node_device("team-a"))) == ("Normal", "Assigned")
    was = Cond("True", "Assigned", "Assigned to namespace team-a", "2026-11-29T11:00:00Z")
    assert assigned_event(world(node_device("", assigned=was))) == ("Normal", "Available")
    terminating = device("team-a", deleting=True, finalizers=[FINALIZER])
    assert assigned_event(world(node_device("team-a", assigned=was), [terminating], vms={"team-a": ("vm1",)})) == ("Normal", "InProgress")


def test_a_waiting_assignment_completes_by_itself_once_the_device_is_ready():
    busy = Cond("False", "NotReady", "in use", "2026-11-29T11:00:00Z")
    waiting = converge(world(node_device("team-a", ready=busy)))
    assert waiting.devices == ()
    ready = converge(World(NAME, dataclasses.replace(waiting.node_device, ready=READY), (), waiting.namespaces, {}, NOW))
    assert [d.namespace for d in ready.devices] == ["team-a"] and ready.node_device.assigned.reason == "Assigned"


def test_a_device_already_handed_out_keeps_its_pcidevice_when_it_turns_not_ready():
    settled = converge(world(node_device("team-a")))
    busy = Cond("False", "NotReady", "in use", "2026-11-29T11:59:00Z")
    w = World(NAME, dataclasses.replace(settled.node_device, ready=busy), settled.devices, settled.namespaces, {}, NOW)
    after = converge(w)
    assert [d.namespace for d in after.devices] == ["team-a"] and after.node_device.assigned.reason == "Assigned"


def test_no_finalizer_is_planned_onto_a_pcidevice_being_deleted():
    # Deleted by someone while no VM listed it; a VM lists it just after: the API server would
    # refuse a new finalizer now, so none is planned, and the delete goes its way.
    deleting = device("team-a", deleting=True, finalizers=())
    w = world(node_device("team-a"), [deleting], vms={"team-a": ("vm1",)})
    assert not [x for x in of(lc.decide(w), ApplyDevice) if x.namespace == "team-a" and x.body["metadata"].get("finalizers")]
    settle(w)  # the simulator refuses what the API server refuses


def test_no_finalizer_is_planned_onto_a_node_device_being_deleted():
    npci = node_device("team-a", deleting=True, finalizers=())
    w = world(npci, [device("team-a", finalizers=())], vms={"team-a": ("vm1",)})
    assert of(lc.decide(w), ApplyNodeDeviceFinalizer) == []
    settle(w)


def test_a_delete_is_guarded_by_the_version_it_was_decided_on():
    settled = converge(world(node_device("team-a")))
    unassigned = World(NAME, dataclasses.replace(settled.node_device, assigned_namespace=""), settled.devices,
                          settled.namespaces, {}, NOW)  # fmt: skip
    [delete] = of(lc.decide(unassigned), DeleteDevice)
    [live] = settled.devices
    assert (delete.uid, delete.resource_version) == (live.uid, live.resource_version)


def test_a_group_member_assigned_elsewhere_makes_the_assignment_wait_and_names_it():
    w = World(NAME, node_device("team-b"), (), {"team-a": "Active", "team-b": "Active"}, {}, NOW,
                 group={"pci-audio": "team-a"})  # fmt: skip
    plan = lc.decide(w)
    assert of(plan, ApplyDevice) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "IOMMUGroupConflict")
    assert "pci-audio" in assigned["message"] and "team-a" in assigned["message"]
    # The same namespace, or an unassigned member, is no conflict.
    for group in ({"pci-audio": "team-b"}, {"pci-audio": ""}):
        same = World(NAME, node_device("team-b"), (), w.namespaces, {}, NOW, group=group)
        assert [d.namespace for d in of(lc.decide(same), ApplyDevice)] == ["team-b"]


def test_a_device_already_handed_out_keeps_its_namespace_when_a_group_member_goes_elsewhere():
    settled = converge(world(node_device("team-a")))
    w = World(NAME, settled.node_device, settled.devices, settled.namespaces, {}, NOW, group={"pci-audio": "team-b"})
    assert lc.decide(w).writes == []


def test_an_allow_list_entry_kubevirt_lacks_is_said_on_the_device():
    w = World(NAME, node_device("team-a"), (), {"team-a": "Active"}, {}, NOW,
                 allow_list_problem="the PassthroughConfig is invalid (duplicate selector 10DE:2236)")  # fmt: skip
    plan = lc.decide(w)
    assert [d.namespace for d in of(plan, ApplyDevice)] == ["team-a"]  # the PCIDevice is made all the same
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "AllowListNotApplied")
    assert RESOURCE in assigned["message"] and "duplicate selector" in assigned["message"]


def test_a_namespace_made_again_under_the_same_name_does_not_inherit_the_device():
    first = World(NAME, node_device("team-a"), (), {"team-a": "Active"}, {}, NOW, namespace_uids={"team-a": "uid-1"})
    [write] = of(lc.decide(first), ApplyNodeDeviceStatus)
    assert write.body["status"]["assignedNamespaceRef"] == {"name": "team-a", "uid": "uid-1"}  # recorded as it is handed out
    handed = settle(first)
    assert handed.node_device.handed_to == ("team-a", "uid-1") and lc.decide(handed).writes == []
    # team-a deleted (its PCIDevice went with it) and created again: a new uid.
    again = World(NAME, handed.node_device, (), {"team-a": "Active"}, {}, NOW, namespace_uids={"team-a": "uid-2"})
    plan = lc.decide(again)
    assert of(plan, ApplyDevice) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "NamespaceRecreated")
    assert "clear spec.assignedNamespace and set it again" in assigned["message"]
    # The admin clears the assignment (the record goes) and sets it again: the new namespace gets it.
    cleared = settle(World(NAME, dataclasses.replace(handed.node_device, assigned_namespace=""), (),
                              {"team-a": "Active"}, {}, NOW, namespace_uids={"team-a": "uid-2"}))  # fmt: skip
    assert cleared.node_device.handed_to == ("", "")
    reassigned = World(NAME, dataclasses.replace(cleared.node_device, assigned_namespace="team-a"), (),
                          {"team-a": "Active"}, {}, NOW, namespace_uids={"team-a": "uid-2"})  # fmt: skip
    assert [d.namespace for d in of(lc.decide(reassigned), ApplyDevice)] == ["team-a"]


def test_moving_a_device_to_another_namespace_is_no_recreation():
    handed = settle(World(NAME, node_device("team-a"), (), {"team-a": "Active", "team-b": "Active"}, {}, NOW,
                             namespace_uids={"team-a": "uid-a", "team-b": "uid-b"}))  # fmt: skip
    moved = dataclasses.replace(handed, node_device=dataclasses.replace(handed.node_device, assigned_namespace="team-b"))
    after = converge(moved)
    assert [d.namespace for d in after.devices] == ["team-b"] and after.node_device.handed_to == ("team-b", "uid-b")


def test_a_device_reassigned_while_a_vm_holds_it_says_so_in_the_new_namespace_and_never_double_books():
    vms = {"team-a": ("vm-1",)}
    settled = converge(world(node_device("team-a"), vms=vms))
    moved = converge(dataclasses.replace(
        settled, node_device=dataclasses.replace(settled.node_device, assigned_namespace="team-b")))
    new = {d.namespace: d for d in moved.devices}["team-b"]
    attached = next(c for c in new.status["conditions"] if c["type"] == "Attached")
    assert (attached["status"], attached["reason"]) == ("False", "HeldElsewhere")
    # Held by what is team-a's business: the admin reads it on the NodePCIDevice.
    assert "team-a" not in attached["message"] and "vm-1" not in attached["message"] and new.status["attachedTo"] == ""
    assert "team-a/vm-1" in npci_conditions(lc.decide(dataclasses.replace(moved, node_device=dataclasses.replace(
        moved.node_device, assigned=None))))["Assigned"]["message"]  # fmt: skip
    # A VM of team-b lists it meanwhile: it waits, and nothing claims it for two namespaces without a Warning.
    both = dataclasses.replace(moved, referencing_vms={"team-a": ("vm-1",), "team-b": ("vm-2",)})
    plan = lc.decide(both)
    [status] = of(plan, ApplyDeviceStatus)
    attached = next(c for c in status.body["status"]["conditions"] if c["type"] == "Attached")
    assert (attached["status"], attached["reason"]) == ("False", "WaitingForRelease")
    assert "team-a" not in attached["message"] and "VirtualMachine team-b/vm-2 waits" in attached["message"]
    node_attached = npci_conditions(plan)["Attached"]
    assert "team-a/vm-1" in node_attached["message"] and "team-b/vm-2 waits" in node_attached["message"]
    assert any(e.type == "Warning" and e.reason == "WaitingForRelease" for e in plan.events)
    assert not any(e.type == "Normal" and e.reason == "Attached" for e in plan.events)
    # vm-1 lets go: vm-2 has it, as an ordinary attachment.
    released = converge(dataclasses.replace(settle(both), referencing_vms={"team-b": ("vm-2",)}))
    new = {d.namespace: d for d in released.devices}["team-b"]
    assert next(c for c in new.status["conditions"] if c["type"] == "Attached")["reason"] == "AttachedToVirtualMachine"
    assert released.node_device.attached.message == "Used by VirtualMachine team-b/vm-2."


# -- a deleted Node ---------------------------------------------------------------------------


def node_away(w: World, since: str = "", now=NOW) -> World:
    """`w` with the device's Node deleted, the operator having seen it go at `since` ("" not yet)."""
    npci = dataclasses.replace(w.node_device, missing_since=since, node_gone_since=since)
    return dataclasses.replace(w, node_device=npci, node_present=False, now=now)


def test_a_deleted_node_keeps_its_assignments_and_pcidevices_for_the_grace_period():
    settled = converge(world(node_device("team-a")))
    plan = lc.decide(node_away(settled))
    assert of(plan, DeleteDevice) == [] and of(plan, DeleteNodeDevice) == []
    [write] = of(plan, ApplyNodeDeviceStatus)
    assert write.body["status"]["missingSince"] == "2026-11-29T12:00:00Z"
    assert write.body["status"]["nodeGoneSince"] == "2026-11-29T12:00:00Z"
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("True", "NodeGone")
    assert "Node gpu-1 was deleted" in assigned["message"] and "until 2026-11-29T12:10:00Z" in assigned["message"]
    # Warnings for the admin (the NodePCIDevice) and the tenant (in team-a).
    assert sorted((e.kind, e.namespace, e.type, e.reason) for e in plan.events) == [
        ("NodePCIDevice", "", "Warning", "NodeGone"), ("PCIDevice", "team-a", "Warning", "NodeGone")]
    # The tenant's PCIDevice says so too.
    [status] = of(plan, ApplyDeviceStatus)
    ready = next(c for c in status.body["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NodeGone")
    assert plan.requeue_after == pytest.approx(10 * 60)
    assert lc.decide(settle(node_away(settled))).writes == []  # recorded once, then quiet


def test_a_node_that_registers_again_within_the_grace_period_keeps_everything():
    settled = converge(world(node_device("team-a")))
    away = converge(node_away(settled))
    back = dataclasses.replace(away, node_present=True, now=NOW + datetime.timedelta(minutes=3))
    plan = lc.decide(back)
    assert of(plan, DeleteDevice) == [] and of(plan, DeleteNodeDevice) == []
    assert "missingSince" not in of(plan, ApplyNodeDeviceStatus)[0].body["status"]
    assert npci_conditions(plan)["Assigned"]["reason"] == "Assigned"
    [status] = of(plan, ApplyDeviceStatus)
    assert next(c for c in status.body["status"]["conditions"] if c["type"] == "Ready")["reason"] == "Ready"


def test_the_devices_of_a_node_that_stays_gone_are_collected_after_the_grace_period():
    settled = converge(world(node_device("team-a")))
    plan = lc.decide(node_away(converge(node_away(settled)), since="2026-11-29T11:45:00Z"))
    assert of(plan, DeleteNodeDevice) == [DeleteNodeDevice("npci-uid", "10")]
    [event] = [e for e in plan.events if e.reason == "Collected"]
    assert event.type == "Warning" and "assigned to team-a" in event.message and "10m00s grace period" in event.message


def test_a_node_deleted_while_its_device_was_long_missing_still_gets_the_whole_grace_period():
    # NotFound for an hour (its PCIDevice already removed, the assignment kept), then the Node
    # is deleted: the Node's absence is timed from now, not from when the device went missing.
    long_missing = dataclasses.replace(converge(world(node_device("team-a"))).node_device,
                                       ready=lc.Cond("False", "NotFound", "gone"), missing_since="2026-11-29T11:00:00Z")
    settled = converge(dataclasses.replace(world(long_missing), devices=()))
    plan = lc.decide(dataclasses.replace(settled, node_present=False))
    assert of(plan, DeleteNodeDevice) == []
    [write] = of(plan, ApplyNodeDeviceStatus)
    assert write.body["status"]["nodeGoneSince"] == "2026-11-29T12:00:00Z"
    assert write.body["status"]["missingSince"] == "2026-11-29T11:00:00Z"
    assert plan.requeue_after == pytest.approx(10 * 60)
    later = settle(dataclasses.replace(settled, node_present=False))
    assert of(lc.decide(dataclasses.replace(later, now=NOW + datetime.timedelta(minutes=9))), DeleteNodeDevice) == []
    assert of(lc.decide(dataclasses.replace(later, now=NOW + datetime.timedelta(minutes=10))), DeleteNodeDevice) != []


def test_recorded_times_past_the_end_of_the_calendar_or_in_the_future_count_from_now():
    odd = dataclasses.replace(world(node_device("team-a")).node_device, missing_since="9999-12-31T23:59:59Z",
                              node_gone_since="9999-12-31T23:59:59Z")
    plan = lc.decide(dataclasses.replace(world(odd), node_present=False))
    [write] = of(plan, ApplyNodeDeviceStatus)
    assert write.body["status"]["nodeGoneSince"] == "2026-11-29T12:00:00Z"
    assert plan.requeue_after == pytest.approx(10 * 60)
    huge = dataclasses.replace(world(odd), node_present=False, grace=datetime.timedelta(days=3650))
    assert lc.decide(huge).requeue_after == pytest.approx(3650 * 86400)


def test_an_unassigned_device_of_a_deleted_node_waits_out_the_grace_period_too():
    plan = lc.decide(node_away(world(node_device(""))))
    assert of(plan, DeleteNodeDevice) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "NodeGone")
    assert plan.requeue_after == pytest.approx(10 * 60)
    expired = lc.decide(node_away(world(node_device("", missing_since="2026-11-29T11:45:00Z")), since="2026-11-29T11:45:00Z"))
    assert of(expired, DeleteNodeDevice) == [DeleteNodeDevice("npci-uid", "10")]


def test_a_device_of_a_deleted_node_is_not_handed_out_until_the_node_is_back():
    plan = lc.decide(node_away(world(node_device("team-a"))))
    assert of(plan, ApplyDevice) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "NodeGone")
    assert "goes to team-a once the node is back" in assigned["message"]


# -- forged names, models KubeVirt serves, namespaces made after an assignment, holders -----------


def test_a_node_device_not_named_for_its_attributes_is_ignored_and_flagged():
    forged = dataclasses.replace(node_device("team-a"), name="pci-" + "0" * 40)
    w = dataclasses.replace(world(forged), name=forged.name)
    plan = lc.decide(w)
    assert of(plan, ApplyDevice) == [] and of(plan, ApplyDeviceStatus) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "NameMismatch")
    assert NAME in assigned["message"] and f"kubectl delete npci {forged.name}" in assigned["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "NameMismatch")]
    # Unassigned, it is flagged all the same; and one handed out before loses its PCIDevice.
    unassigned = dataclasses.replace(w, node_device=dataclasses.replace(forged, assigned_namespace=""))
    assert npci_conditions(lc.decide(unassigned))["Assigned"]["reason"] == "NameMismatch"
    assert [e.reason for e in lc.decide(unassigned).events] == ["NameMismatch"]
    handed = dataclasses.replace(w, devices=(device("team-a"),))
    assert [d.namespace for d in of(lc.decide(handed), DeleteDevice)] == ["team-a"]


def test_a_node_device_whose_attributes_moved_to_another_node_is_misnamed():
    moved = dataclasses.replace(node_device("team-a"), attributes={**ATTRS, "nodeName": "gpu-2"})
    assert npci_conditions(lc.decide(world(moved)))["Assigned"]["reason"] == "NameMismatch"


def test_a_model_kubevirts_own_plugin_serves_is_not_handed_out():
    w = dataclasses.replace(world(node_device("team-a")), served_by_kubevirt={"10de:2236": "nvidia.com/GA102GL_A10"})
    plan = lc.decide(w)
    assert of(plan, ApplyDevice) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "ServedByKubeVirt")
    assert "nvidia.com/GA102GL_A10" in assigned["message"] and "externalResourceProvider: true" in assigned["message"]
    assert any(e.type == "Warning" and e.reason == "ServedByKubeVirt" for e in plan.events)
    # Unassigned, the model's entry is no concern of this device.
    unassigned = dataclasses.replace(w, node_device=node_device(""))
    assert npci_conditions(lc.decide(unassigned))["Assigned"]["reason"] == "Available"


def _tenant_world(created: str, assigned_at: str, confirmed: str = "", confirm: bool = True) -> World:
    npci = dataclasses.replace(node_device("team-a"), assigned_at=assigned_at, confirmed_uid=confirmed)
    return dataclasses.replace(world(npci), namespace_uids={"team-a": "uid-a"}, namespace_created={"team-a": created},
                               confirm_new_namespaces=confirm)


def test_with_confirm_new_namespaces_a_namespace_made_after_the_assignment_waits_for_a_device_admin():
    w = _tenant_world(created="2026-11-29T11:30:00Z", assigned_at="2026-11-29T11:00:00Z")
    plan = lc.decide(w)
    assert of(plan, ApplyDevice) == []
    assigned = npci_conditions(plan)["Assigned"]
    assert (assigned["status"], assigned["reason"]) == ("False", "NamespaceNotConfirmed")
    patch = f"""kubectl patch npci {NAME} --type=merge -p '{{"spec":{{"confirmedNamespaceUID":"uid-a"}}}}'"""
    assert patch in assigned["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "NamespaceNotConfirmed")]
    # Made in the same second: the admin is asked too.
    assert lc.decide(_tenant_world("2026-11-29T11:00:00Z", "2026-11-29T11:00:00Z")).writes[0].body["status"]["conditions"][0]["reason"] == "NamespaceNotConfirmed"
    # Confirmed by its uid: handed out, and recorded with that uid.
    confirmed = converge(_tenant_world("2026-11-29T11:30:00Z", "2026-11-29T11:00:00Z", confirmed="uid-a"))
    assert [d.namespace for d in confirmed.devices] == ["team-a"]
    assert confirmed.node_device.handed_to == ("team-a", "uid-a") and confirmed.node_device.assigned.reason == "Assigned"
    # A confirmation of another namespace's uid (the one deleted since) confirms nothing.
    other = lc.decide(_tenant_world("2026-11-29T11:30:00Z", "2026-11-29T11:00:00Z", confirmed="uid-old"))
    assert "spec.confirmedNamespaceUID is uid-old" in npci_conditions(other)["Assigned"]["message"]


def test_with_confirm_new_namespaces_a_namespace_older_than_the_assignment_or_already_served_needs_nothing():
    older = _tenant_world(created="2026-11-29T10:00:00Z", assigned_at="2026-11-29T11:00:00Z")
    assert npci_conditions(lc.decide(older))["Assigned"]["reason"] == "Assigned"
    # Handed out before the setting was turned on: it stays.
    served = converge(_tenant_world("2026-11-29T11:30:00Z", "2026-11-29T11:00:00Z", confirm=False))
    turned_on = dataclasses.replace(served, confirm_new_namespaces=True)
    assert lc.decide(turned_on).writes == []
    # Without the setting, nothing is asked.
    assert npci_conditions(lc.decide(_tenant_world("2026-11-29T11:30:00Z", "", confirm=False)))["Assigned"]["reason"] == "Assigned"
    # An assignment with no record of when it was written is asked about.
    unknown = _tenant_world("2026-11-29T10:00:00Z", "")
    assert npci_conditions(lc.decide(unknown))["Assigned"]["reason"] == "NamespaceNotConfirmed"


def test_a_namespace_made_again_is_given_the_device_once_a_device_admin_confirms_its_uid():
    handed = converge(dataclasses.replace(world(node_device("team-a")), namespace_uids={"team-a": "uid-1"}))
    again = dataclasses.replace(handed, devices=(), namespace_uids={"team-a": "uid-2"})
    assert npci_conditions(lc.decide(again))["Assigned"]["reason"] == "NamespaceRecreated"
    confirmed = converge(dataclasses.replace(again, node_device=dataclasses.replace(again.node_device, confirmed_uid="uid-2")))
    assert confirmed.node_device.handed_to == ("team-a", "uid-2") and [d.namespace for d in confirmed.devices] == ["team-a"]


def test_the_pcidevice_names_the_pods_of_its_own_namespace_that_hold_the_device_and_no_other_namespaces():
    """Another namespace's pods are none of this namespace's business (admission says so too): the
    PCIDevice says a pod of another namespace holds it, the NodePCIDevice says which, for the admin."""
    theirs = ("team-b", "virt-launcher-old", "nvidia.com/GA102GL_A10")
    mine = ("team-a", "virt-launcher-new", "passthrough.io/" + NAME)
    held = Cond("False", "HeldByPod", "pod team-b/virt-launcher-old (nvidia.com/GA102GL_A10) still holds 0000:3b:00.0 under "
                "its previous resource or namespace", "2026-11-29T11:00:00Z")  # fmt: skip
    handed = converge(world(node_device("team-a")))  # handed out while Ready; then the agent finds the pods
    settled = converge(dataclasses.replace(handed, node_device=dataclasses.replace(handed.node_device, holders=(theirs, mine),
                                                                                   ready=held)))  # fmt: skip
    [current] = settled.devices
    assert current.status["holders"] == [{"namespace": "team-a", "pod": "virt-launcher-new", "resource": "passthrough.io/" + NAME}]
    ready = next(c for c in current.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], ready["lastTransitionTime"]) == ("False", "HeldByPod", "2026-11-29T11:00:00Z")
    assert "team-b" not in ready["message"] and "virt-launcher-old" not in ready["message"], ready
    assert "a pod of another namespace" in ready["message"] and f"NodePCIDevice {NAME}" in ready["message"]
    # Its own pods are named where the node's word does, unchanged.
    own = Cond("False", "HeldByPod", "pod team-a/virt-launcher-new (x) holds it", "2026-11-29T11:00:00Z")
    settled = converge(dataclasses.replace(settled, node_device=dataclasses.replace(settled.node_device, holders=(mine,), ready=own)))
    assert next(c for c in settled.devices[0].status["conditions"] if c["type"] == "Ready")["message"] == own.message
    # The pod ends: the list empties, once.
    ended = dataclasses.replace(settled, node_device=dataclasses.replace(settled.node_device, holders=()))
    [write] = of(lc.decide(ended), ApplyDeviceStatus)
    assert write.body["status"]["holders"] == []
    assert lc.decide(settle(ended)).writes == []
    # As the API server gives it back without the empty list: still nothing to write.
    bare = {k: v for k, v in write.body["status"].items() if k != "holders"}
    quiet = dataclasses.replace(settle(ended), devices=(dataclasses.replace(settle(ended).devices[0], status=bare),))
    assert lc.decide(quiet).writes == []
    assert views.NodeDevice.of({"metadata": {"name": NAME}, "status": {"holders": [
        {"namespace": "team-b", "pod": "p", "resource": "r"}, "junk"]}}).holders == (("team-b", "p", "r"),)


def test_finalizer_writes_apply_only_the_operators_own_metadata():
    # Another manager's label, owner reference and finalizer on the PCIDevice stay theirs: an
    # apply that restated them would make the operator co-owner, keeping them after they let go.
    theirs = views.Device(
        name=NAME, namespace="team-a", uid="uid-team-a", resource_version="11", deleting=True,
        metadata={"labels": {"passthrough.io/node": "gpu-1", "backup.example.com/policy": "daily"},
                  "ownerReferences": [{"uid": "npci-uid", "controller": True, "kind": "NodePCIDevice"},
                                      {"uid": "app-uid", "kind": "ConfigMap"}],
                  "finalizers": [FINALIZER, "backup.example.com/hold"]},
        status={},
    )  # fmt: skip
    [released] = lc.decide(world(None, [theirs])).writes
    assert released.body["metadata"]["labels"] == {"passthrough.io/node": "gpu-1"}
    assert released.body["metadata"]["ownerReferences"] == [{"uid": "npci-uid", "controller": True, "kind": "NodePCIDevice"}]
    assert released.body["metadata"]["finalizers"] == []
    # Reassigned while a VM of team-a lists it: the finalizer goes on with our fields only.
    held = dataclasses.replace(theirs, deleting=False, metadata={**theirs.metadata, "finalizers": ["backup.example.com/hold"]})
    plan = lc.decide(world(node_device("team-b"), [held], vms={"team-a": ("vm-1",)}))
    [guard] = [w for w in of(plan, ApplyDevice) if w.namespace == "team-a"]
    assert guard.body["metadata"]["labels"] == {"passthrough.io/node": "gpu-1"}
    assert [o["uid"] for o in guard.body["metadata"]["ownerReferences"]] == ["npci-uid"]
    assert guard.body["metadata"]["finalizers"] == [FINALIZER]


def test_reassigning_back_while_the_old_namespaces_vm_holds_it_waits_for_that_vm():
    # A to B, then back to A, while A's VM lists the device: A's old PCIDevice is Terminating and
    # cannot be revived (a deletion is never cancelled), so A waits until the VM lets go (README).
    vms = {"team-a": ("vm-1",)}
    settled = converge(world(node_device("team-a"), vms=vms))
    to_b = converge(World(NAME, dataclasses.replace(settled.node_device, assigned_namespace="team-b"), settled.devices,
                             settled.namespaces, vms, NOW))  # fmt: skip
    back = converge(World(NAME, dataclasses.replace(to_b.node_device, assigned_namespace="team-a"), to_b.devices,
                             to_b.namespaces, vms, NOW))  # fmt: skip
    assert [(d.namespace, d.deleting) for d in back.devices] == [("team-a", True)]
    assert back.node_device.assigned.reason == "InProgress"
    released = converge(World(NAME, back.node_device, back.devices, back.namespaces, {}, NOW))
    assert [(d.namespace, d.deleting) for d in released.devices] == [("team-a", False)]
    assert released.node_device.assigned.reason == "Assigned"


def test_each_assignment_held_back_has_a_reason_of_its_own():
    def assigned(w: World) -> tuple[str, str]:
        found = npci_conditions(lc.decide(w))["Assigned"]
        return found["reason"], found["message"]

    assert assigned(world(node_device("team-c"))) == (
        "NamespaceNotFound", "Namespace team-c does not exist; create it or clear spec.assignedNamespace.")
    assert assigned(world(node_device("kube-system")))[0] == "SystemNamespace"
    assert assigned(world(node_device("team-a"), namespaces={"team-a": "Terminating"}))[0] == "NamespaceTerminating"
    lost = Cond("False", "NotFound", "gone", "2026-11-29T11:00:00Z")
    missing = world(dataclasses.replace(node_device("team-a", ready=lost), missing_since="2026-11-29T11:00:00Z"))
    assert assigned(missing)[0] == "DeviceMissing"
    # Unassigned is the one Available: nothing is wrong.
    assert assigned(world(node_device("")))[0] == "Available"


def test_attached_names_the_pods_that_hold_the_device():
    launcher = ("team-a", "virt-launcher-vm1-x2b4c", RESOURCE)
    plain = ("team-a", "cuda", RESOURCE)
    # A plain pod holds it, no VM lists it: both objects say so, not "No VirtualMachine uses it".
    settled = converge(world(dataclasses.replace(node_device("team-a"), holders=(plain,))))
    assert (settled.node_device.attached.status, settled.node_device.attached.reason) == ("True", "HeldByPod")
    assert settled.node_device.attached.message == "Held by pod team-a/cuda (no VirtualMachine lists it)."
    [current] = settled.devices
    pcidev = {c["type"]: c for c in current.status["conditions"]}["Attached"]
    assert (pcidev["status"], pcidev["reason"], pcidev["message"]) == (
        "True", "HeldByPod", "Held by pod team-a/cuda (no VirtualMachine lists it).")
    # A VM lists it and its launcher pod holds it: the VM first, then its pod.
    settled = converge(world(dataclasses.replace(node_device("team-a"), holders=(launcher,)), vms={"team-a": ("vm1",)}))
    assert (settled.node_device.attached.reason, settled.node_device.attached.message) == (
        "AttachedToVirtualMachine", "Used by VirtualMachine team-a/vm1; held by virt-launcher pod team-a/virt-launcher-vm1-x2b4c.")
    # Nothing holds it: Available, in words that name all three.
    settled = converge(world(node_device("team-a")))
    assert (settled.node_device.attached.reason, settled.node_device.attached.message) == (
        "Available", "No VirtualMachine, claim or pod uses this device.")
