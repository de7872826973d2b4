"""The device lifecycle as a pure function: from what is, to what to write.

`decide()` looks at one NodePCIDevice, its PCIDevices, the namespaces and the VMs that
reference it, and returns the writes that move the cluster toward what the admin asked
for. It knows nothing of Kopf or the API client; `controller.reconciler` feeds it from
Kopf's indexes and carries the plan out. Each call is level-triggered: it never depends on
what happened before, only on what is there now, so a restarted operator converges.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from passthrough.api.conditions import Cond, condition, parse_timestamp, timestamp
from passthrough.api.models import API_VERSION, NODE_PCI_DEVICE, PCI_DEVICE
from passthrough.api.labels import NODE_LABEL
from passthrough.pci.naming import exclusive_resource_name

FINALIZER = "passthrough.io/in-use"
DEFAULT_GRACE = datetime.timedelta(minutes=10)

# Namespaces that never receive devices: VMs do not run there, and a device handed to one is
# almost certainly a typo. The CRD refuses them up front; this catches objects that predate it.
SYSTEM_NAMESPACES = frozenset({"kube-system", "kube-public", "kube-node-lease"})


def shared(value: Any) -> Any:
    """`value` (decoded JSON) with its keys and strings interned.

    Each watch event is decoded on its own, so ten thousand views would otherwise each hold
    their own copy of every key, vendor name, driver and condition message; interned, they
    share one. A string that nothing holds any more is freed as any other.
    """
    if isinstance(value, str):
        return sys.intern(value)
    if isinstance(value, dict):
        return {sys.intern(k): shared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shared(v) for v in value]
    return value


def _cond(raw: Mapping[str, Any] | None) -> Cond | None:
    return Cond.of(shared(dict(raw))) if raw else None


NOT_HANDED = ("", "")


@dataclass(frozen=True, slots=True)
class NodeDevice:
    """What the lifecycle needs of a NodePCIDevice (small: ten thousand of these are cached)."""

    name: str
    uid: str
    resource_version: str
    assigned_namespace: str
    deleting: bool
    finalizers: tuple[str, ...]
    ready: Cond | None
    assigned: Cond | None
    attached: Cond | None
    attributes: Mapping[str, Any]
    node_name: str
    resource_name: str = ""
    mode: str = ""
    missing_since: str = ""  # status.missingSince, the operator's own record
    node_gone_since: str = ""  # status.nodeGoneSince, the operator's own record
    handed_to: tuple[str, str] = ("", "")  # status.assignedNamespaceRef: (name, uid) it was handed to

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> NodeDevice:
        meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        attributes = shared(dict(status.get("attributes") or {}))
        handed = status.get("assignedNamespaceRef") or {}
        handed_to = (handed.get("name", ""), handed.get("uid", ""))
        return cls(
            name=meta["name"],
            uid=meta.get("uid", ""),
            resource_version=meta.get("resourceVersion", ""),
            assigned_namespace=sys.intern(spec.get("assignedNamespace") or ""),
            deleting=bool(meta.get("deletionTimestamp")),
            finalizers=tuple(shared(f) for f in meta.get("finalizers") or ()),
            ready=_cond(conditions.get("Ready")),
            assigned=_cond(conditions.get("Assigned")),
            attached=_cond(conditions.get("Attached")),
            attributes=attributes,
            node_name=sys.intern(attributes.get("nodeName") or (meta.get("labels") or {}).get(NODE_LABEL, "")),
            resource_name=sys.intern(status.get("resourceName") or ""),
            mode=sys.intern(status.get("mode") or ""),
            missing_since=status.get("missingSince") or "",
            node_gone_since=status.get("nodeGoneSince") or "",
            handed_to=handed_to if any(handed_to) else NOT_HANDED,
        )


@dataclass(frozen=True, slots=True)
class Device:
    """What the lifecycle needs of a PCIDevice."""

    name: str
    namespace: str
    uid: str
    resource_version: str
    deleting: bool
    metadata: Mapping[str, Any]  # the fields we apply: labels, ownerReferences, finalizers
    status: Mapping[str, Any]

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Device:
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta.get("uid", ""),
            resource_version=meta.get("resourceVersion", ""),
            deleting=bool(meta.get("deletionTimestamp")),
            metadata={
                "labels": shared(dict(meta.get("labels") or {})),
                "ownerReferences": [shared(dict(o)) for o in meta.get("ownerReferences") or []],
                "finalizers": shared(list(meta.get("finalizers") or [])),
            },
            status=shared(dict(body.get("status") or {})),
        )


@dataclass(frozen=True)
class World:
    """Everything `decide` may look at for one device name."""

    name: str
    node_device: NodeDevice | None
    devices: tuple[Device, ...]
    namespaces: Mapping[str, str]  # name -> phase (Active, Terminating); absent: does not exist
    referencing_vms: Mapping[str, tuple[str, ...]]  # namespace -> VMs whose spec lists the resource
    now: datetime.datetime
    grace: datetime.timedelta = DEFAULT_GRACE
    # The other functions of its IOMMU group on its node: name -> assigned namespace ("" when
    # none). VFIO gives a group to one VM, so a group belongs to one namespace.
    group: Mapping[str, str] = field(default_factory=dict)
    # Why KubeVirt's allow-list lacks its exclusive entry ("" when it has it, or is not ours).
    allow_list_problem: str = ""
    namespace_uids: Mapping[str, str] = field(default_factory=dict)  # name -> uid, of the namespaces above
    # Whether the device's Node exists. A deleted Node no longer takes its devices with it: its
    # devices wait out the grace period for a node that registers again under the same name.
    node_present: bool = True


# -- the plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyDevice:
    namespace: str
    body: dict[str, Any]


@dataclass(frozen=True)
class ApplyDeviceStatus:
    namespace: str
    body: dict[str, Any]


@dataclass(frozen=True)
class DeleteDevice:
    namespace: str
    uid: str
    resource_version: str = ""  # the version decided on: a delete of a changed object fails (409)


@dataclass(frozen=True)
class ApplyNodeDeviceFinalizer:
    body: dict[str, Any]


@dataclass(frozen=True)
class ApplyNodeDeviceStatus:
    body: dict[str, Any]


@dataclass(frozen=True)
class DeleteNodeDevice:
    uid: str
    resource_version: str = ""  # the version decided on: a node that came back meanwhile changed it


@dataclass(frozen=True)
class Event:
    kind: str  # NodePCIDevice or PCIDevice
    namespace: str
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass
class Plan:
    writes: list[Any] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


# -- helpers ------------------------------------------------------------------------------


def format_duration(delta: datetime.timedelta) -> str:
    seconds = int(delta.total_seconds())
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _vm_list(namespace: str, vms: tuple[str, ...]) -> str:
    names = ", ".join(f"{namespace}/{vm}" for vm in vms)
    return f"VirtualMachine {names}" if len(vms) == 1 else f"VirtualMachines {names}"


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


def decide(world: World) -> Plan:
    plan = Plan()
    npci = world.node_device
    referenced = {d.namespace: world.referencing_vms.get(d.namespace, ()) for d in world.devices}

    if npci is None:
        # The NodePCIDevice is gone; the garbage collector deletes its PCIDevices. All that is
        # left to us is to let go of those no VM references any more.
        for device in world.devices:
            if device.deleting and not referenced[device.namespace] and FINALIZER in device.metadata["finalizers"]:
                wanted = {**device.metadata, "finalizers": []}
                plan.writes.append(ApplyDevice(device.namespace, device_body(device.name, device.namespace, wanted, device.uid)))
        return plan

    node_gone = not world.node_present
    missing = node_gone or (npci.ready is not None and npci.ready.reason == "NotFound")
    # Counted from when this operator first saw it NotFound (or its Node gone), by its own clock:
    # Ready's transition time is the node's clock, and it does not move when NotReady turns into
    # NotFound.
    missing_since = _since(npci.missing_since, world.now) if missing else None
    expired = missing and world.now - missing_since >= world.grace
    wanted_missing_since = timestamp(missing_since) if missing_since else ""
    # The Node's absence has a clock of its own: a device NotFound for an hour whose Node is
    # then deleted still waits the whole grace period for the Node to register again.
    node_gone_since = _since(npci.node_gone_since, world.now) if node_gone else None
    node_expired = node_gone and world.now - node_gone_since >= world.grace
    wanted_node_gone_since = timestamp(node_gone_since) if node_gone_since else ""

    target = "" if npci.deleting else npci.assigned_namespace
    phase = world.namespaces.get(target) if target else None
    # A device is handed out only while it is Ready (eligible, bound, present); one already
    # handed out keeps its PCIDevice through NotReady, and through NotFound for the grace period.
    # An assignment belongs to the namespace it was handed to (its uid): one deleted and made
    # again under the same name, perhaps by another tenant, does not inherit the device.
    target_uid = world.namespace_uids.get(target, "") if target else ""
    handed_name, handed_uid = npci.handed_to
    recreated = bool(target and handed_name == target and handed_uid and target_uid and handed_uid != target_uid)
    handed_out = any(d.namespace == target and not d.deleting for d in world.devices)
    not_ready = bool(target) and not handed_out and (node_gone or not (npci.ready is not None and npci.ready.status == "True"))
    # A group member assigned elsewhere blocks a new hand-out; one already handed out stays.
    conflict = next(((other, ns) for other, ns in sorted(world.group.items()) if ns and ns != target), None)
    conflict = conflict if target and not handed_out else None
    usable = (bool(target) and phase == "Active" and target not in SYSTEM_NAMESPACES and not expired and not not_ready
              and conflict is None and not recreated)  # fmt: skip
    current = next((d for d in world.devices if d.namespace == target), None) if usable else None

    # PCIDevices that must go: every one but the current one in the target namespace. One a VM
    # references gets the finalizer first, so it stays Terminating until the VM lets go.
    for device in world.devices:
        if device is current or device.deleting:
            continue
        if device.namespace == target and phase == "Terminating":
            continue  # the namespace controller removes it with everything else there
        if referenced[device.namespace] and FINALIZER not in device.metadata["finalizers"]:
            wanted = {**device.metadata, "finalizers": [FINALIZER]}
            plan.writes.append(ApplyDevice(device.namespace, device_body(device.name, device.namespace, wanted, device.uid)))
            plan.writes.append(DeleteDevice(device.namespace, device.uid))  # the finalizer write moved its version
        else:
            plan.writes.append(DeleteDevice(device.namespace, device.uid, device.resource_version))
    leaving = [d for d in world.devices if d is not current or d.deleting]
    # Of those, the ones that outlive this plan: a VM holds them (or their namespace is going).
    lingering = [d for d in leaving if referenced[d.namespace] or (d.namespace == target and phase == "Terminating")]

    # VMs of another namespace that still hold the device (reassigned under them): until they
    # let go, VMs of the target namespace wait, and both objects say so.
    held_elsewhere = {d.namespace: referenced[d.namespace] for d in lingering if d.namespace != target and referenced[d.namespace]}

    # The PCIDevice in the target namespace, and its status.
    will_exist = usable and (current is None or not current.deleting)
    if will_exist:
        vms = world.referencing_vms.get(target, ())
        wanted = device_metadata(npci, target, finalizer=bool(vms))
        if current is None or _metadata_differs(current, wanted):
            plan.writes.append(ApplyDevice(target, device_body(npci.name, target, wanted, current.uid if current else "")))
        gone_since = _node_gone_note(npci, world, node_gone_since) if node_gone else ""
        status = _device_status(npci, current, vms, world.now, held_elsewhere, gone_since)
        if current is None or _status_differs(current.status, status):
            plan.writes.append(
                ApplyDeviceStatus(target, {**device_body(npci.name, target, {}), "status": status})
            )
            plan.events.extend(_device_events(npci, current, status, target))

    # A PCIDevice being deleted keeps its finalizer while a VM references it, and loses it once
    # none does. It cannot gain one: the API server refuses new finalizers on a deleting object.
    for device in world.devices:
        if device.deleting:
            want = bool(referenced[device.namespace])
            if not want and FINALIZER in device.metadata["finalizers"]:
                wanted = {**device.metadata, "finalizers": []}
                plan.writes.append(ApplyDevice(device.namespace, device_body(device.name, device.namespace, wanted, device.uid)))

    # The NodePCIDevice: deleted when it is unassigned and gone from its node, or when its Node
    # has stayed gone longer than the grace period (assigned or not: the admin is told).
    if node_expired and not npci.deleting:
        plan.writes.append(DeleteNodeDevice(npci.uid, npci.resource_version))
        was = f"; it was assigned to {npci.assigned_namespace}, assign it again if the node returns" if npci.assigned_namespace else ""
        plan.events.append(Event(NODE_PCI_DEVICE.kind, "", "Warning", "Collected",
                                 f"Node {npci.node_name} has been gone since {timestamp(node_gone_since)}, longer than the "
                                 f"{format_duration(world.grace)} grace period: NodePCIDevice {npci.name} removed{was}."))
        return plan
    if missing and not node_gone and not npci.assigned_namespace and not npci.deleting and not lingering and current is None:
        plan.writes.append(DeleteNodeDevice(npci.uid, npci.resource_version))
        return plan

    attached_anywhere = {ns: vms for ns, vms in referenced.items() if vms}
    if will_exist and world.referencing_vms.get(target):
        attached_anywhere[target] = world.referencing_vms[target]
    want_finalizer = bool(lingering) if npci.deleting else bool(attached_anywhere)
    # Nor can a NodePCIDevice being deleted gain one.
    if want_finalizer != (FINALIZER in npci.finalizers) and not (npci.deleting and want_finalizer):
        plan.writes.append(
            ApplyNodeDeviceFinalizer(
                {
                    "apiVersion": API_VERSION,
                    "kind": NODE_PCI_DEVICE.kind,
                    "metadata": {"name": npci.name, "uid": npci.uid, "finalizers": [FINALIZER] if want_finalizer else []},
                }
            )
        )
    if npci.deleting:
        return plan

    assigned = _assigned_condition(npci, world, target, phase, expired, missing_since, node_gone_since, will_exist, lingering,
                                   referenced, not_ready, conflict, recreated)  # fmt: skip
    waiting = world.referencing_vms.get(target, ()) if will_exist and held_elsewhere else ()
    claims = {ns: vms for ns, vms in attached_anywhere.items() if not (waiting and ns == target)}
    attached = _attached_condition(claims, (target, waiting) if waiting else None)
    # Recorded once handed out; kept while the namespace is away or was made anew; cleared with
    # the assignment (the admin assigning again is what gives the device to a new namespace).
    wanted_ref = ("", "") if not target else ((target, target_uid) if will_exist and target_uid else npci.handed_to)
    if (not assigned.same(npci.assigned) or not attached.same(npci.attached) or wanted_missing_since != npci.missing_since
            or wanted_node_gone_since != npci.node_gone_since or wanted_ref != npci.handed_to):  # fmt: skip
        status: dict[str, Any] = {
            "conditions": [
                condition("Assigned", assigned, npci.assigned, world.now),
                condition("Attached", attached, npci.attached, world.now),
            ]
        }
        if wanted_missing_since:  # left out, it is removed: the field is ours alone
            status["missingSince"] = wanted_missing_since
        if wanted_node_gone_since:
            status["nodeGoneSince"] = wanted_node_gone_since
        if wanted_ref[0]:
            status["assignedNamespaceRef"] = {"name": wanted_ref[0], "uid": wanted_ref[1]}
        plan.writes.append(
            ApplyNodeDeviceStatus(
                {"apiVersion": API_VERSION, "kind": NODE_PCI_DEVICE.kind, "metadata": {"name": npci.name}, "status": status}
            )
        )
        # A new device starting out unassigned is not news; every later transition is.
        if not assigned.same(npci.assigned) and (npci.assigned is not None or target):
            warning = (assigned.reason == "Available" and bool(target)) or assigned.reason == "NodeGone"
            plan.events.append(Event(NODE_PCI_DEVICE.kind, "", "Warning" if warning else "Normal", assigned.reason, assigned.message))
        if not attached.same(npci.attached) and (npci.attached is not None or attached.status == "True"):
            if waiting:  # two namespaces want it at once: never without a Warning
                plan.events.append(Event(NODE_PCI_DEVICE.kind, "", "Warning", "WaitingForRelease", attached.message))
            else:
                reason = "Attached" if attached.status == "True" else "Detached"
                plan.events.append(Event(NODE_PCI_DEVICE.kind, "", "Normal", reason, attached.message))

    deadlines = [_later(since, world.grace) - world.now for since in (missing_since if usable else None, node_gone_since) if since]
    if deadlines:
        plan.requeue_after = max(1.0, min(deadlines).total_seconds())
    return plan


def _node_gone_note(npci: NodeDevice, world: World, since: datetime.datetime | None) -> str:
    since = since or world.now
    return (f"Node {npci.node_name or '?'} was deleted ({timestamp(since)}); the device is kept for a node that registers "
            f"again under that name until {timestamp(_later(since, world.grace))} (the {format_duration(world.grace)} grace "
            "period), then removed")


def _since(recorded: str, now: datetime.datetime) -> datetime.datetime:
    # Ours, but an object can carry anything: unreadable or in the future counts from now.
    when = parse_timestamp(recorded)
    return when if when is not None and when <= now else now


def _later(when: datetime.datetime, by: datetime.timedelta) -> datetime.datetime:
    # A time recorded near the end of the calendar (an odd object) plus the grace period.
    try:
        return when + by
    except OverflowError:
        return datetime.datetime.max.replace(tzinfo=when.tzinfo)


def _device_status(
    npci: NodeDevice, current: Device | None, vms: tuple[str, ...], now: datetime.datetime,
    held_elsewhere: Mapping[str, tuple[str, ...]] | None = None, node_gone: str = "",
) -> dict[str, Any]:  # fmt: skip
    """`node_gone`: why the device's Node is away ("" while it exists)."""
    old = {c.get("type"): Cond.of(c) for c in (current.status.get("conditions") if current else None) or []}
    # Ready is the node's word, transition time included; while its Node is gone, ours.
    if node_gone:
        ready = condition("Ready", Cond("False", "NodeGone", node_gone + "."), old.get("Ready"), now)
    elif npci.ready and npci.ready.lastTransitionTime:
        ready = condition("Ready", npci.ready, npci.ready, now)
    else:
        unreported = Cond("Unknown", "NotReady", f"The agent on node {npci.node_name or '?'} has not reported this device yet.")
        ready = condition("Ready", npci.ready or unreported, old.get("Ready"), now)
    resource = exclusive_resource_name(npci.name)
    if held_elsewhere:
        holders = "; ".join(_vm_list(ns, held) for ns, held in sorted(held_elsewhere.items()))
        attached = (
            Cond("False", "WaitingForRelease",
                 f"Still held by {holders}, in the device's previous namespace; {_vm_list(npci.assigned_namespace, vms)} "
                 "waits (its launcher pod stays Pending) until that VM drops it from its spec.")
            if vms
            else Cond("False", "HeldElsewhere",
                      f"Still held by {holders}, in the device's previous namespace; a VM here that lists {resource} "
                      "waits until that VM drops it from its spec.")
        )  # fmt: skip
    elif vms:
        attached = Cond("True", "AttachedToVirtualMachine", f"Used by {_vm_list(npci.assigned_namespace, vms)}.")
    else:
        attached = Cond("False", "Available", f"No VirtualMachine uses it; set deviceName {resource} in a VM's hostDevices.")
    return {
        "attributes": dict(npci.attributes),
        "nodeName": npci.node_name,
        "resourceName": resource,
        "attachedTo": "" if held_elsewhere else ", ".join(vms),
        "conditions": [
            ready,
            condition("Attached", attached, old.get("Attached"), now),
        ],
    }


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
        elif live.get(key, "") != value:
            return True
    return False


def _device_events(npci: NodeDevice, current: Device | None, status: dict[str, Any], namespace: str) -> list[Event]:
    events = []
    old = {c.get("type"): Cond.of(c) for c in (current.status.get("conditions") if current else None) or []}
    new = {c["type"]: Cond.of(c) for c in status["conditions"]}
    if current is None:
        events.append(Event(PCI_DEVICE.kind, namespace, "Normal", "Assigned",
                            f"Device {npci.attributes.get('pciAddress', '?')} of node {npci.node_name} assigned to this namespace; use deviceName {status['resourceName']}."))
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


def _assigned_condition(npci, world, target, phase, expired, missing_since, node_gone_since, will_exist, lingering, referenced,
                        not_ready, conflict, recreated) -> Cond:  # fmt: skip
    held = [(d.namespace, referenced[d.namespace]) for d in lingering if referenced[d.namespace]]
    holding = "; ".join(f"PCIDevice {ns}/{npci.name} stays until {_vm_list(ns, vms)} drops it from its spec" for ns, vms in held)
    gone = _node_gone_note(npci, world, node_gone_since) if not world.node_present else ""
    if not target:
        if held:
            return Cond("False", "InProgress", f"Unassigning: {holding}.")
        if gone:
            return Cond("False", "NodeGone", f"{gone}. Not assigned.")
        return Cond("False", "Available", "Not assigned; set spec.assignedNamespace to give this device to a namespace.")
    if target in SYSTEM_NAMESPACES:
        return Cond("False", "Available", f"{target} is a system namespace and cannot receive devices; assign the device to a tenant namespace.")
    if phase is None:
        return Cond("False", "Available", f"Namespace {target} does not exist; create it or clear spec.assignedNamespace.")
    if phase != "Active":
        return Cond("False", "Available",
                    f"Namespace {target} is being deleted and its PCIDevice goes with it; create the namespace again or change spec.assignedNamespace.")
    if expired:
        since = f" since {timestamp(missing_since)}" if missing_since else ""
        return Cond("False", "Available",
                    f"The device has been missing from node {npci.node_name}{since}, longer than the {format_duration(world.grace)} grace period, "
                    f"so its PCIDevice in {target} was removed; it is assigned again when the device returns.")
    if recreated:
        return Cond("False", "NamespaceRecreated",
                    f"Namespace {target} was deleted and created again since the device was assigned to it; the new one "
                    f"does not inherit it. To give it to the new {target}, clear spec.assignedNamespace and set it again.")
    if conflict:
        other, namespace = conflict
        group = npci.attributes.get("iommuGroup", "?")
        return Cond("False", "IOMMUGroupConflict",
                    f"IOMMU group {group} on node {npci.node_name} also holds {other}, assigned to {namespace}; VFIO gives a "
                    f"group to one VM, so all of its devices go to one namespace: assign {other} to {target} too, or this "
                    f"device to {namespace}.")
    if gone and will_exist:
        return Cond("True", "NodeGone", f"Assigned to namespace {target} as PCIDevice {target}/{npci.name}, kept while its "
                                        f"node is away: {gone}.")
    if gone:
        return Cond("False", "NodeGone", f"{gone}; the device goes to {target} once the node is back.")
    if not_ready:
        why = (f"{npci.ready.reason}: {npci.ready.message}" if npci.ready
               else f"node {npci.node_name or '?'} has not reported it yet")  # fmt: skip
        return Cond("False", "DeviceNotReady",
                    f"Waiting for the device to be Ready before it goes to {target} ({why}); it is handed out by itself once it is.")
    if not will_exist:
        old_vms = referenced.get(target) or ()
        waiting = f" ({_vm_list(target, old_vms)} still lists it)" if old_vms else ""
        return Cond("False", "InProgress", f"Waiting for the previous PCIDevice {target}/{npci.name} to finish terminating{waiting}.")
    resource = exclusive_resource_name(npci.name)
    if world.allow_list_problem:
        return Cond("False", "AllowListNotApplied",
                    f"PCIDevice {target}/{npci.name} exists, but KubeVirt's permittedHostDevices lacks {resource}: "
                    f"{world.allow_list_problem}. VMs listing it get no pod until that is fixed.")
    message = f"Assigned to namespace {target} as PCIDevice {target}/{npci.name}; VMs there use deviceName {resource}."
    if holding:
        message += f" Meanwhile {holding}."
    return Cond("True", "Assigned", message)


def _attached_condition(attached: Mapping[str, tuple[str, ...]], waiting: tuple[str, tuple[str, ...]] | None = None) -> Cond:
    """`waiting`: (namespace, VMs) that list the device but wait for the VMs holding it elsewhere."""
    if not attached:
        return Cond("False", "Available", "No VirtualMachine uses this device.")
    users = "; ".join(_vm_list(ns, vms) for ns, vms in sorted(attached.items()))
    if waiting:
        return Cond("True", "AttachedToVirtualMachine",
                    f"Used by {users}; {_vm_list(*waiting)} waits for it to be released.")
    return Cond("True", "AttachedToVirtualMachine", f"Used by {users}.")
