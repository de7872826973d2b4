"""The device lifecycle as a pure function: from what is, to what to write.

`decide()` looks at one NodePCIDevice, its PCIDevices, the namespaces and the VMs that
reference it, and returns the writes that move the cluster toward what the admin asked
for. It knows nothing of Kopf or the API client; `controller.reconciler` feeds it from
Kopf's indexes and carries the plan out. Each call is level-triggered: it never depends on
what happened before, only on what is there now, so a restarted operator converges.

What it reads and returns is in `world.py` (World, Plan and the writes); what the world says
of the device before anything is written, in `verdict.py` (Absence, Verdict, Users, Holders).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from passthrough.api.conditions import Cond, condition, timestamp
from passthrough.api.labels import NODE_LABEL
from passthrough.api.models import API_VERSION, NODE_PCI_DEVICE, PCI_DEVICE
from passthrough.api.views import Device, NodeDevice
from passthrough.controller.verdict import Absence, Holders, Users, Verdict, left_in_pool, model_of, pool_claims, users_by_namespace
from passthrough.controller.world import (FINALIZER, SYSTEM_NAMESPACES, ApplyDevice, ApplyDeviceStatus, ApplyNodeDeviceFinalizer,
                                          ApplyNodeDeviceStatus, DeleteDevice, DeleteNodeDevice, Event, Plan, World)
from passthrough.pci.naming import exclusive_resource_name

if TYPE_CHECKING:
    from passthrough.controller.allocations import Allocation


# -- helpers ------------------------------------------------------------------------------


def format_duration(delta: datetime.timedelta) -> str:
    seconds = int(delta.total_seconds())
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def owner_reference(node_device: NodeDevice) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": NODE_PCI_DEVICE.kind,
        "name": node_device.name,
        "uid": node_device.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def device_metadata(node_device: NodeDevice, namespace: str, finalizer: bool) -> dict[str, Any]:
    return {
        "labels": {NODE_LABEL: node_device.node_name} if node_device.node_name else {},
        "ownerReferences": [owner_reference(node_device)],
        "finalizers": [FINALIZER] if finalizer else [],
    }


def own_metadata(device: Device, finalizers: list[str]) -> dict[str, Any]:
    """The part of a live PCIDevice's metadata that is the operator's (what `device_metadata`
    applied: the node label and the controller owner reference), with `finalizers`. An apply of
    the whole live metadata would make the operator co-owner of other managers' labels and
    owner references, and they would stay when those managers let go."""
    labels = device.metadata.get("labels") or {}
    owners = [o for o in device.metadata.get("ownerReferences") or []
              if o.get("controller") and o.get("kind", NODE_PCI_DEVICE.kind) == NODE_PCI_DEVICE.kind]  # fmt: skip
    return {"labels": {NODE_LABEL: labels[NODE_LABEL]} if NODE_LABEL in labels else {}, "ownerReferences": owners[:1],
            "finalizers": finalizers}


def _metadata_differs(live: Device, wanted: dict[str, Any]) -> bool:
    labels = live.metadata.get("labels", {})
    if any(labels.get(k) != v for k, v in wanted["labels"].items()):
        return True
    owners = live.metadata.get("ownerReferences", [])
    if not any(o.get("uid") == wanted["ownerReferences"][0]["uid"] and o.get("controller") for o in owners):
        return True
    return (FINALIZER in live.metadata.get("finalizers", [])) != bool(wanted["finalizers"])


def device_body(name: str, namespace: str, metadata: dict[str, Any], uid: str = "") -> dict[str, Any]:
    """An apply body; with `uid`, one that fails rather than re-create an object deleted meanwhile."""
    return {
        "apiVersion": API_VERSION,
        "kind": PCI_DEVICE.kind,
        "metadata": {"name": name, "namespace": namespace, **({"uid": uid} if uid else {}), **metadata},
    }


# -- the decision -------------------------------------------------------------------------
# Four steps, each of which reads what the earlier ones found: the verdict (where the device
# goes, and whether it may be there now: verdict.py), the PCIDevice writes, the finalizers,
# the NodePCIDevice's status.


def decide(world: World) -> Plan:
    npci = world.node_device
    if npci is None:
        # The NodePCIDevice is gone; the garbage collector deletes its PCIDevices. All that is
        # left to us is to let go of those no VM references any more.
        return Plan(writes=_released_finalizers(world, Holders.of(world, "", None)))
    absence = Absence.of(npci, world)
    verdict = Verdict.of(npci, world, absence)
    holders = Holders.of(world, verdict.target, verdict.phase, verdict.current)
    plan = Plan()
    plan.add(_device_writes(npci, world, verdict, absence, holders))
    collected = _collection(npci, world, absence, verdict, holders)
    if collected is not None:
        plan.add(collected)
        return plan
    plan.writes += _node_finalizer(npci, world, verdict, holders)
    if npci.deleting:
        # Deleted while a VM holds a PCIDevice of it: it stays (the finalizer), and its status says
        # why, in place of what it said before. Deleted and held by nothing: it is going now.
        if holders.lingering:
            plan.add(_node_status(npci, world, verdict, absence, holders))
        return plan
    plan.add(_node_status(npci, world, verdict, absence, holders))
    plan.requeue_after = _requeue_after(world, verdict, absence)
    return plan




# -- the PCIDevices ---------------------------------------------------------------------------


def _device_writes(npci: NodeDevice, world: World, verdict: Verdict, absence: Absence, holders: Holders) -> Plan:
    plan = Plan(writes=_departures(world, verdict, holders))
    plan.add(_target_device(npci, world, verdict, absence, holders))
    plan.writes += _released_finalizers(world, holders)
    return plan


def _departures(world: World, verdict: Verdict, holders: Holders) -> list[Any]:
    """PCIDevices that must go: every one but the current one in the target namespace. One a VM
    references gets the finalizer first, so it stays Terminating until the VM lets go."""
    writes: list[Any] = []
    for device in world.devices:
        if device is verdict.current or device.deleting:
            continue
        if device.namespace == verdict.target and verdict.phase == "Terminating":
            continue  # the namespace controller removes it with everything else there
        if holders.referenced[device.namespace] and FINALIZER not in device.metadata["finalizers"]:
            wanted = own_metadata(device, [FINALIZER])
            writes.append(ApplyDevice(device.namespace, device_body(device.name, device.namespace, wanted, device.uid)))
            writes.append(DeleteDevice(device.namespace, device.uid))  # the finalizer write moved its version
        else:
            writes.append(DeleteDevice(device.namespace, device.uid, device.resource_version))
    return writes


def _target_device(npci: NodeDevice, world: World, verdict: Verdict, absence: Absence, holders: Holders) -> Plan:
    """The PCIDevice in the target namespace, and its status."""
    plan = Plan()
    if not verdict.will_exist:
        return plan
    target, current = verdict.target, verdict.current
    users = Users.of(world, target)
    wanted = device_metadata(npci, target, finalizer=bool(users))
    if current is None or _metadata_differs(current, wanted):
        plan.writes.append(ApplyDevice(target, device_body(npci.name, target, wanted, current.uid if current else "")))
    gone = _node_gone_note(npci, world, absence.node_gone_since) if absence.node_gone else ""
    status = _device_status(npci, current, users, world.now, holders.held_elsewhere, gone, world.device_class,
                            left_in_pool(npci, world))  # fmt: skip
    if current is None or _status_differs(current.status, status):
        plan.writes.append(ApplyDeviceStatus(target, {**device_body(npci.name, target, {}), "status": status}))
        plan.events.extend(_device_events(npci, current, status, target, world.device_class))
    return plan


def _released_finalizers(world: World, holders: Holders) -> list[Any]:
    """A PCIDevice being deleted keeps its finalizer while a VM references it, and loses it once
    none does. It cannot gain one: the API server refuses new finalizers on a deleting object."""
    return [
        ApplyDevice(device.namespace, device_body(device.name, device.namespace, own_metadata(device, []), device.uid))
        for device in world.devices
        if device.deleting and not holders.referenced[device.namespace] and FINALIZER in device.metadata["finalizers"]
    ]


# -- the NodePCIDevice ------------------------------------------------------------------------


def _collection(npci: NodeDevice, world: World, absence: Absence, verdict: Verdict, holders: Holders) -> Plan | None:
    """The NodePCIDevice deleted: when it is unassigned and gone from its node, or when its Node
    has stayed gone longer than the grace period (assigned or not: the admin is told)."""
    if npci.deleting:
        return None
    if absence.node_expired:
        was = f"; it was assigned to {npci.assigned_namespace}, assign it again if the node returns" if npci.assigned_namespace else ""
        message = (f"Node {npci.node_name} has been gone since {timestamp(absence.node_gone_since)}, longer than the "
                   f"{format_duration(world.grace)} grace period: NodePCIDevice {npci.name} removed{was}.")  # fmt: skip
        return Plan(writes=[DeleteNodeDevice(npci.uid, npci.resource_version)],
                    events=[Event(NODE_PCI_DEVICE.kind, "", "Warning", "Collected", message)])  # fmt: skip
    if (absence.missing and not absence.node_gone and not npci.assigned_namespace and not holders.lingering
            and verdict.current is None):  # fmt: skip
        return Plan(writes=[DeleteNodeDevice(npci.uid, npci.resource_version)])
    return None


def _node_finalizer(npci: NodeDevice, world: World, verdict: Verdict, holders: Holders) -> list[Any]:
    """The NodePCIDevice holds the finalizer while a VM uses the device; one being deleted, while
    a PCIDevice lingers. Nor can a NodePCIDevice being deleted gain one."""
    want = bool(holders.lingering) if npci.deleting else bool(users_by_namespace(world, verdict, holders))
    if want == (FINALIZER in npci.finalizers) or (npci.deleting and want):
        return []
    body = {"apiVersion": API_VERSION, "kind": NODE_PCI_DEVICE.kind,
            "metadata": {"name": npci.name, "uid": npci.uid, "finalizers": [FINALIZER] if want else []}}  # fmt: skip
    return [ApplyNodeDeviceFinalizer(body)]


def _node_status(npci: NodeDevice, world: World, verdict: Verdict, absence: Absence, holders: Holders) -> Plan:
    """The NodePCIDevice's Assigned and Attached conditions and the operator's own records
    (missingSince, nodeGoneSince, assignedNamespaceRef), written when one of them changes,
    with an Event for each transition."""
    target = verdict.target
    assigned = _assigned_condition(npci, world, verdict, absence, holders)
    waiting = Users.of(world, target) if verdict.will_exist and holders.held_elsewhere else Users(target)
    users = [found for ns, found in sorted(users_by_namespace(world, verdict, holders).items()) if not (waiting and ns == target)]
    attached = _attached_condition(users, waiting, pool_claims(npci, world), npci.holders, left=left_in_pool(npci, world))
    # Recorded once handed out; kept while the namespace is away or was made anew; cleared with
    # the assignment (the admin assigning again is what gives the device to a new namespace).
    ref = ("", "") if not target else ((target, verdict.target_uid) if verdict.will_exist and verdict.target_uid else npci.handed_to)
    missing_since = timestamp(absence.missing_since) if absence.missing_since else ""
    node_gone_since = timestamp(absence.node_gone_since) if absence.node_gone_since else ""
    if (assigned.same(npci.assigned) and attached.same(npci.attached) and missing_since == npci.missing_since
            and node_gone_since == npci.node_gone_since and ref == npci.handed_to):  # fmt: skip
        return Plan()
    status: dict[str, Any] = {
        "conditions": [
            condition("Assigned", assigned, npci.assigned, world.now),
            condition("Attached", attached, npci.attached, world.now),
        ]
    }
    if missing_since:  # left out, it is removed: the field is ours alone
        status["missingSince"] = missing_since
    if node_gone_since:
        status["nodeGoneSince"] = node_gone_since
    if ref[0]:
        status["assignedNamespaceRef"] = {"name": ref[0], "uid": ref[1]}
    body = {"apiVersion": API_VERSION, "kind": NODE_PCI_DEVICE.kind, "metadata": {"name": npci.name}, "status": status}
    return Plan(writes=[ApplyNodeDeviceStatus(body)], events=_node_events(npci, target, assigned, attached, waiting))


def _node_events(npci: NodeDevice, target: str, assigned: Cond, attached: Cond, waiting: Users) -> list[Event]:
    events = []
    # A new device starting out unassigned is not news; every later transition is.
    if not assigned.same(npci.assigned) and (npci.assigned is not None or target or assigned.reason == "NameMismatch"):
        # The assignment held back (a namespace missing, a device not Ready, a group conflict, ...),
        # its node gone or a forged name is a Warning; handing out, unassigning and waiting for the
        # old PCIDevice to terminate are not.
        warning = assigned.reason in ("NodeGone", "NameMismatch") or (
            bool(target) and assigned.status != "True" and assigned.reason != "InProgress")
        events.append(Event(NODE_PCI_DEVICE.kind, "", "Warning" if warning else "Normal", assigned.reason, assigned.message))
    if not attached.same(npci.attached) and (npci.attached is not None or attached.status == "True"):
        if waiting:  # two namespaces want it at once: never without a Warning
            events.append(Event(NODE_PCI_DEVICE.kind, "", "Warning", "WaitingForRelease", attached.message))
        else:
            reason = "Attached" if attached.status == "True" else "Detached"
            events.append(Event(NODE_PCI_DEVICE.kind, "", "Normal", reason, attached.message))
    return events


def _requeue_after(world: World, verdict: Verdict, absence: Absence) -> float | None:
    """Seconds until a grace period runs out, when one runs: the device is decided again then."""
    running = (absence.missing_since if verdict.usable else None, absence.node_gone_since)
    deadlines = [_later(since, world.grace) - world.now for since in running if since]
    return max(1.0, min(deadlines).total_seconds()) if deadlines else None


# -- what the conditions and Events say ---------------------------------------------------


def _node_gone_note(npci: NodeDevice, world: World, since: datetime.datetime | None) -> str:
    since = since or world.now
    return (f"Node {npci.node_name or '?'} was deleted ({timestamp(since)}); the device is kept for a node that registers "
            f"again under that name until {timestamp(_later(since, world.grace))} (the {format_duration(world.grace)} grace "
            "period), then removed")




def _later(when: datetime.datetime, by: datetime.timedelta) -> datetime.datetime:
    # A time recorded near the end of the calendar (an odd object) plus the grace period.
    try:
        return when + by
    except OverflowError:
        return datetime.datetime.max.replace(tzinfo=when.tzinfo)


def _device_status(
    npci: NodeDevice, current: Device | None, users: Users, now: datetime.datetime,
    held_elsewhere: Mapping[str, Users] | None = None, node_gone: str = "", device_class: str = "",
    left: tuple[Allocation, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """`users`: the VMs and claims of the PCIDevice's namespace that use the device; `node_gone`:
    why the device's Node is away ("" while it exists); `device_class`: World.device_class; `left`:
    claims of other namespaces allocated it while it was in the pool (`verdict.left_in_pool`)."""
    old = {c.get("type"): Cond.of(c) for c in (current.status.get("conditions") if current else None) or []}
    # Ready is the node's word, transition time included; while its Node is gone, ours.
    if node_gone:
        ready = condition("Ready", Cond("False", "NodeGone", node_gone + "."), old.get("Ready"), now)
    elif npci.ready and npci.ready.lastTransitionTime:
        ready = condition("Ready", _as_tenants_see(npci, npci.ready, users.namespace), npci.ready, now)
    else:
        unreported = Cond("Unknown", "NotReady", f"The agent on node {npci.node_name or '?'} has not reported this device yet.")
        ready = condition("Ready", npci.ready or unreported, old.get("Ready"), now)
    resource = exclusive_resource_name(npci.name)
    if held_elsewhere:
        # By what is another namespace's business: the admin reads it on the NodePCIDevice.
        there = (f"Still held by a VM or claim of the namespace the device was assigned to before (a device admin sees "
                 f"which on NodePCIDevice {npci.name})")  # fmt: skip
        attached = (
            Cond("False", "WaitingForRelease", f"{there}; {users.names()} waits (its pod stays Pending) until it lets go.")
            if users
            else Cond("False", "HeldElsewhere",
                      f"{there}; " + (f"a claim here of DeviceClass {device_class}" if device_class else f"a VM here that asks for {resource}")
                      + " waits until it lets go.")
        )  # fmt: skip
    elif left and not users:
        # As a pool pod's hold reads to the tenant in device-plugin mode: HeldByPod, naming nobody.
        attached = Cond("False", "HeldByPod", (
            "Held by a claim of another namespace, allocated while the device was in the pool: no claim here gets it "
            f"until that claim lets go (its pods end, or it is deleted); a device admin sees which on NodePCIDevice "
            f"{npci.name}."))  # fmt: skip
    else:
        pods = tuple(h for h in npci.holders if h[0] == users.namespace)
        attached = _attached_condition([users], pods=pods, idle=f"{how_to_use(resource, device_class)}.")
    return {
        "attributes": dict(npci.attributes),
        "nodeName": npci.node_name,
        "resourceName": resource,
        "attachedTo": "" if held_elsewhere else ", ".join(users.vms),
        # This namespace's pods that hold it, as its agent reported. Another namespace's (the one the
        # device was assigned to before) are none of this one's business, as admission says too:
        # Ready says HeldByPod without naming them, and the NodePCIDevice names them for the admin.
        "holders": [{"namespace": ns, "pod": pod, "resource": resource} for ns, pod, resource in npci.holders
                    if ns == users.namespace],  # fmt: skip
        "conditions": [
            ready,
            condition("Attached", attached, old.get("Attached"), now),
        ],
    }


# How the agent names a pod in its messages (`Holder`'s text): "pod <namespace>/<name>".
_POD = re.compile(r"\bpod ([a-z0-9][-a-z0-9]*)/")


def _as_tenants_see(npci: NodeDevice, ready: Cond, namespace: str) -> Cond:
    """The node's Ready as `namespace`'s PCIDevice shows it: a message that names a pod of another
    namespace (a HeldByPod while the pod of its previous assignment holds it) says so without
    the name, for the same reason admission tells a tenant nothing of another's devices."""
    named = [f"{ns}/{pod}" for ns, pod, _ in npci.holders if ns != namespace]
    if not any(ns != namespace for ns in _POD.findall(ready.message)) and not any(n in ready.message for n in named):
        return ready
    return dataclasses.replace(ready, message=(
        "Held by a pod of another namespace (where the device was assigned before): no pod here gets it until that "
        f"pod ends; a device admin sees which on NodePCIDevice {npci.name}."))  # fmt: skip


def _status_differs(live: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    for key, value in wanted.items():
        if key == "conditions":
            got = {c.get("type"): c for c in live.get("conditions") or []}
            for condition in value:
                have = got.get(condition["type"]) or {}
                keys = ("status", "reason", "message") + (("lastTransitionTime",) if condition["type"] == "Ready" else ())
                if any(have.get(k) != condition[k] for k in keys):
                    return True
        elif key == "attributes":
            have = live.get("attributes") or {}
            if any(have.get(k) != v for k, v in value.items()):
                return True
        elif isinstance(value, list):
            if (live.get(key) or []) != value:
                return True
        elif live.get(key, "") != value:
            return True
    return False


def _device_events(npci: NodeDevice, current: Device | None, status: dict[str, Any], namespace: str,
                   device_class: str = "") -> list[Event]:
    events = []
    old = {c.get("type"): Cond.of(c) for c in (current.status.get("conditions") if current else None) or []}
    new = {c["type"]: Cond.of(c) for c in status["conditions"]}
    if current is None:
        events.append(Event(PCI_DEVICE.kind, namespace, "Normal", "Assigned",
                            f"Device {npci.attributes.get('pciAddress', '?')} of node {npci.node_name} assigned to this namespace; "
                            f"{how_to_use(status['resourceName'], device_class)}."))
    elif not new["Ready"].same(old.get("Ready")):
        ready = new["Ready"]
        events.append(Event(PCI_DEVICE.kind, namespace, "Normal" if ready.status == "True" else "Warning", ready.reason, ready.message))
    if current is not None and not new["Attached"].same(old.get("Attached")):
        reason = new["Attached"].reason
        if reason in ("WaitingForRelease", "HeldElsewhere"):
            events.append(Event(PCI_DEVICE.kind, namespace, "Warning", reason, new["Attached"].message))
        else:
            events.append(Event(PCI_DEVICE.kind, namespace, "Normal",
                                "Attached" if new["Attached"].status == "True" else "Detached", new["Attached"].message))
    return events


def _assigned_condition(npci: NodeDevice, world: World, verdict: Verdict, absence: Absence, holders: Holders) -> Cond:
    target, phase, referenced = verdict.target, verdict.phase, holders.referenced
    held = [(d.namespace, referenced[d.namespace]) for d in holders.lingering if referenced[d.namespace]]
    holding = "; ".join(f"PCIDevice {ns}/{npci.name} stays until {users.until_released()}" for ns, users in held)
    gone = _node_gone_note(npci, world, absence.node_gone_since) if not world.node_present else ""
    if verdict.misnamed:
        return _misnamed(npci, verdict.misnamed, holding)
    if npci.deleting and held:
        return Cond("False", "InProgress", f"Deleting: NodePCIDevice {npci.name} goes once its PCIDevices are gone; {holding}.")
    if not target:
        if held:
            return Cond("False", "InProgress", f"Unassigning: {holding}.")
        if gone:
            return Cond("False", "NodeGone", f"{gone}. Not assigned.")
        return Cond("False", "Available", "Not assigned; set spec.assignedNamespace to give this device to a namespace.")
    if target in SYSTEM_NAMESPACES:
        return Cond("False", "SystemNamespace", f"{target} is a system namespace and cannot receive devices; assign the device to a tenant namespace.")
    if verdict.kubevirt_resource:
        model = model_of(npci).upper()
        return Cond("False", "ServedByKubeVirt",
                    f"KubeVirt's own device plugin serves every {model} device on vfio-pci as {verdict.kubevirt_resource}, "
                    f"to VMs of any namespace (the PassthroughConfig's gpu.permittedHostDevices lists {model} with "
                    f"externalResourceProvider: false), so this device cannot be {target}'s alone. Set "
                    "externalResourceProvider: true on that entry (this operator's agents then serve the model, and assigned "
                    f"devices are each one namespace's), or clear spec.assignedNamespace.{_also(holding)}")
    if phase is None:
        later = (" With devices.confirmNewNamespaces set, a namespace created after the assignment gets the device only "
                 "once a device admin confirms it." if world.confirm_new_namespaces else "")  # fmt: skip
        return Cond("False", "NamespaceNotFound", f"Namespace {target} does not exist; create it or clear spec.assignedNamespace.{later}")
    if phase != "Active":
        return Cond("False", "NamespaceTerminating",
                    f"Namespace {target} is being deleted and its PCIDevice goes with it; create the namespace again or change spec.assignedNamespace.")
    if absence.expired:
        since = f" since {timestamp(absence.missing_since)}" if absence.missing_since else ""
        return Cond("False", "DeviceMissing",
                    f"The device has been missing from node {npci.node_name}{since}, longer than the {format_duration(world.grace)} grace period, "
                    f"so its PCIDevice in {target} was removed; it is assigned again when the device returns.")
    if verdict.recreated:
        return Cond("False", "NamespaceRecreated",
                    f"Namespace {target} was deleted and created again since the device was assigned to it; the new one "
                    f"does not inherit it. To give it to the new {target}, confirm it by its uid: {_confirm(npci, world, verdict)} "
                    "(or clear spec.assignedNamespace and set it again).")
    if verdict.unconfirmed:
        created = world.namespace_created.get(target) or "?"
        assigned = f" ({npci.assigned_at})" if npci.assigned_at else ""
        other = (f" spec.confirmedNamespaceUID is {npci.confirmed_uid}, which is not this namespace's uid."
                 if npci.confirmed_uid else "")  # fmt: skip
        return Cond("False", "NamespaceNotConfirmed",
                    f"Namespace {target} (uid {verdict.target_uid}) was created at {created}, not before the device was "
                    f"assigned to it{assigned}, and the PassthroughConfig sets devices.confirmNewNamespaces: whoever created "
                    f"it gets the device only once a device admin confirms it is the namespace meant.{other} To confirm: "
                    f"{_confirm(npci, world, verdict)}; or clear spec.assignedNamespace.{_also(holding)}")
    if verdict.conflict:
        other, namespace = verdict.conflict
        group = npci.attributes.get("iommuGroup", "?")
        return Cond("False", "IOMMUGroupConflict",
                    f"IOMMU group {group} on node {npci.node_name} also holds {other}, assigned to {namespace}; VFIO gives a "
                    f"group to one VM, so all of its devices go to one namespace: assign {other} to {target} too, or this "
                    f"device to {namespace}.")
    if gone and verdict.will_exist:
        return Cond("True", "NodeGone", f"Assigned to namespace {target} as PCIDevice {target}/{npci.name}, kept while its "
                                        f"node is away: {gone}.")
    if gone:
        return Cond("False", "NodeGone", f"{gone}; the device goes to {target} once the node is back.")
    if verdict.not_ready:
        why = (f"{npci.ready.reason}: {npci.ready.message}" if npci.ready
               else f"node {npci.node_name or '?'} has not reported it yet")  # fmt: skip
        return Cond("False", "DeviceNotReady",
                    f"Waiting for the device to be Ready before it goes to {target} ({why}); it is handed out by itself once it is.")
    if not verdict.will_exist:
        old = referenced.get(target)
        waiting = f" ({old.names()} still uses it)" if old else ""
        return Cond("False", "InProgress", f"Waiting for the previous PCIDevice {target}/{npci.name} to finish terminating{waiting}.")
    resource = exclusive_resource_name(npci.name)
    if world.allow_list_problem:
        return Cond("False", "AllowListNotApplied",
                    f"PCIDevice {target}/{npci.name} exists, but KubeVirt's permittedHostDevices lacks {resource}: "
                    f"{world.allow_list_problem}. VMs listing it get no pod until that is fixed.")
    message = f"Assigned to namespace {target} as PCIDevice {target}/{npci.name}; {how_to_use(resource, world.device_class)}."
    if holding:
        message += f" Meanwhile {holding}."
    return Cond("True", "Assigned", message)


def _confirm(npci: NodeDevice, world: World, verdict: Verdict) -> str:
    """The command that confirms the target namespace as it is now (by its uid)."""
    patch = '{"spec":{"confirmedNamespaceUID":"%s"}}' % verdict.target_uid
    return f"kubectl patch npci {npci.name} --type=merge -p '{patch}'"


def _also(holding: str) -> str:
    return f" Meanwhile {holding}." if holding else ""


def _misnamed(npci: NodeDevice, expected: str, holding: str) -> Cond:
    attrs = npci.attributes
    address, node = attrs.get("pciAddress"), attrs.get("nodeName")
    return Cond("False", "NameMismatch",
                f"This NodePCIDevice is named {npci.name}, but a device at {address} ({attrs.get('vendorID')}:"
                f"{attrs.get('deviceID')}) of node {node} is {expected} (pci- and the sha1 of address-vendor-device-node): "
                f"the agent of {node} did not write it under this name, or its attributes were changed since. The operator "
                f"ignores it: no PCIDevice, no allow-list entry. Delete it (kubectl delete npci {npci.name}) and, if the "
                f"device is real, assign {expected}, which its node's agent reports.{_also(holding)}")


def _attached_condition(
    users: list[Users], waiting: Users | None = None, pool: tuple[Allocation, ...] = (),
    pods: tuple[tuple[str, str, str], ...] = (), idle: str = "", left: tuple[Allocation, ...] = (),
) -> Cond:  # fmt: skip
    """Attached, of the NodePCIDevice and (with one namespace's `users`) of a PCIDevice: `users` of
    each namespace; `waiting`: those of the target namespace that want the device but wait for the
    users holding it elsewhere; `pool`: the claims of any namespace allocated it while it is in the
    pool (`verdict.pool_claims`); `pods`: status.holders, the pods its agent reports holding it
    (device-plugin mode: a VM's virt-launcher pod, or a plain pod that asks for the resource);
    `idle`: the advice that ends the sentence when nothing uses it; `left`: the claims allocated it
    while it was in the pool that still hold it after its assignment (`verdict.left_in_pool`),
    named as the pods that hold it are."""
    if pool:
        users = [*users, *(Users(c.namespace, claims=(c,)) for c in pool)]
    held = ", ".join(([_pod_list(pods)] if pods else []) + [f"{c.describe()}, allocated while it was in the pool" for c in left])
    held = f"held by {held}" if held else ""
    if not any(users):
        if held:
            return Cond("True", "HeldByPod", f"{held[0].upper()}{held[1:]} (no VirtualMachine lists it).")
        return Cond("False", "Available", f"No VirtualMachine, claim or pod uses this device{'; ' + idle if idle else '.'}")
    reason, used = _in_use(users)
    used += f"; {held}" if held else ""
    if waiting:
        return Cond("True", reason, f"{used}; {waiting.names()} waits for it to be released.")
    return Cond("True", reason, f"{used}.")


LAUNCHER_POD_PREFIX = "virt-launcher-"  # KubeVirt's generateName for a VM's pod


def _pod_list(pods: tuple[tuple[str, str, str], ...]) -> str:
    """`virt-launcher pod team-a/virt-launcher-vm1-x2b4c`, `pod team-a/cuda` (each once, in order)."""
    names = sorted({(ns, pod) for ns, pod, _ in pods})
    return ", ".join(f"{'virt-launcher pod' if pod.startswith(LAUNCHER_POD_PREFIX) else 'pod'} {ns}/{pod}" for ns, pod in names)


def how_to_use(resource: str, device_class: str) -> str:
    """How a tenant uses a device handed to its namespace, in the node's mode: in DRA mode KubeVirt's
    allow-list has no entry for it and a claim of the namespace's DeviceClass is the way."""
    if device_class:
        return (f"claim it with a ResourceClaim request of deviceClassName {device_class}, named in a VM's gpus or "
                "hostDevices (claimName)")  # fmt: skip
    return f"set deviceName {resource} in a VM's hostDevices"


def _in_use(users: list[Users]) -> tuple[str, str]:
    """The reason of Attached=True, and who uses the device (a sentence, without its period).
    AttachedToVirtualMachine while a VM lists the device, AllocatedToClaim while only claims (DRA)
    hold it; a claim no pod is reserved for yet is allocated the device, its pod still to come."""
    using = [part for found in users for part in found.using()]
    allocated = [part for found in users for part in found.waiting_for_pods()]
    sentences = [f"Used by {'; '.join(using)}"] if using else []
    if allocated:
        pods = "its pod" if len(allocated) == 1 else "their pods"
        sentences.append(f"{'allocated' if using else 'Allocated'} to {', '.join(allocated)}, waiting for {pods}")
    reason = "AttachedToVirtualMachine" if any(found.vms for found in users) else "AllocatedToClaim"
    return reason, "; ".join(sentences)
