"""What the agent writes for each device, and whether the live object already says it.

Pure functions: the loop in `agent.loop` feeds them discovery results and live objects and
writes only what `changed()` reports, so a rescan of unchanged hardware costs no API write.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from passthrough.api.conditions import Cond, condition
from passthrough.api.names import API_VERSION, DRIVER_MAX, MAX_HOLDERS, NODE_PCI_DEVICE_KIND, PCI_IDS_NAME_MAX
from passthrough.api.labels import NODE_LABEL
from passthrough.pci.discovery import Device
from passthrough.pci.naming import exclusive_resource_name, node_pci_device_name

READY = "Ready"
# Reasons whose message already says when the device comes back (a holder lets go, a write
# returns, an admin acts): no "tries again" to add.
SAYS_WHEN = frozenset({"HeldByPod", "HeldByProcess", "WriteBlocked", "Unhealthy", "VendorDriverInUse", "ServedByOtherPlugin",
                       "OverrideDriverMissing"})  # fmt: skip


@dataclass(frozen=True)
class Node:
    name: str
    uid: str


def object_name(device: Device, node: str) -> str:
    return node_pci_device_name(device.address, device.vendor_id, device.device_id, node)


def identity(name: str, node: Node) -> dict[str, Any]:
    """The object itself: name and node label.

    No ownerReference to the Node: deleting a Node (remediation, a node that registers again)
    must not take the admin's assignments with it. The operator collects the devices of a node
    that stays gone, after the grace period. An apply without the field also removes the Node
    ownerReference that earlier versions of the agent set.
    """
    return {
        "apiVersion": API_VERSION,
        "kind": NODE_PCI_DEVICE_KIND,
        "metadata": {"name": name, "labels": {NODE_LABEL: node.name}},
    }


def has_identity(live: dict[str, Any], node: Node) -> bool:
    meta = live.get("metadata", {})
    owners = meta.get("ownerReferences") or []
    return meta.get("labels", {}).get(NODE_LABEL) == node.name and not any(o.get("kind") == "Node" for o in owners)


def handed_out(live: dict[str, Any]) -> str:
    """The namespace the operator has handed the device to, "" while it has not: the spec names
    it, and the operator says `Assigned=True` and recorded that same namespace (with its uid).
    Until then the node neither binds nor serves it (a namespace that does not exist yet, a
    group conflict, an allow-list not applied)."""
    wanted = (live.get("spec") or {}).get("assignedNamespace", "")
    status = live.get("status") or {}
    ref = status.get("assignedNamespaceRef") or {}
    assigned = next((c for c in status.get("conditions") or [] if c.get("type") == "Assigned"), {})
    if wanted and ref.get("name") == wanted and ref.get("uid") and assigned.get("status") == "True":
        return wanted
    return ""


def assignment_view(objects: dict[str, dict[str, Any]]) -> tuple[dict[str, str], frozenset[str]]:
    """Object name -> the namespace it is handed out to (only those), and the names an admin
    assigned (handed out or not), of a node's NodePCIDevices by name."""
    handed = {name: namespace for name, obj in objects.items() if (namespace := handed_out(obj))}
    claimed = frozenset(name for name, obj in objects.items() if (obj.get("spec") or {}).get("assignedNamespace"))
    return handed, claimed


def requests(pod: dict[str, Any], resource: str) -> bool:
    """Whether a pod's containers (init containers too) ask for `resource`."""
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        asked = container.get("resources") or {}
        if resource in (asked.get("limits") or {}) or resource in (asked.get("requests") or {}):
            return True
    return False


def resource_and_mode(device: Device, name: str, assigned_namespace: str) -> tuple[str, str]:
    """An assigned device leaves the GPU pool for its own exclusive resource."""
    if assigned_namespace:
        return exclusive_resource_name(name), "Exclusive"
    if device.resource_name:
        return device.resource_name, "Pool"
    return "", ""


def _text(value: str, limit: int) -> str:
    """A name read from the kernel or pci.ids as the API server takes it: bytes that are not
    UTF-8 (a driver link named with 0xff) as U+FFFD, and no longer than the CRD allows (only a
    damaged pci.ids has longer names)."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")[:limit]


def attributes(device: Device, node: str) -> dict[str, Any]:
    """status.attributes, every field of the schema's PCIAttributes (a unit test holds them to
    it; the agent does not load pydantic to build a dict)."""
    return {
        "name": _text(device.name, PCI_IDS_NAME_MAX),
        "vendorName": _text(device.vendor_name, PCI_IDS_NAME_MAX),
        "pciAddress": device.address,
        "vendorID": device.vendor_id,
        "deviceID": device.device_id,
        "subsystemVendorID": device.subsystem_vendor_id,
        "subsystemDeviceID": device.subsystem_device_id,
        "class": device.class_code,
        "driver": _text(device.driver, DRIVER_MAX),
        "iommuGroup": device.iommu_group,
        "numaNode": device.numa_node,
        "nodeName": node,
    }


def ready_condition(device: Device, failure: Exception | None = None) -> tuple[str, str, str]:
    """`failure`: why the device's IOMMU group could not be bound to vfio-pci (a `BindError`)."""
    if not device.eligible:
        return "False", "NotReady", device.reason
    if failure is not None:
        reason = getattr(failure, "reason", "BindFailed")
        if reason in SAYS_WHEN:
            return "False", reason, f"{failure}."
        return "False", reason, f"{failure}; the agent tries again at its next scan."
    return "True", "Ready", "The device can be passed through."


def present_status(
    device: Device, name: str, node: str, assigned_namespace: str, failure: Exception | None = None,
    holders: Iterable[Any] | None = (),
) -> dict[str, Any]:
    """The agent's part of the status of a device it found. `holders`: the pods that hold it
    (`Holder`s, from the kubelet's PodResources); None when the kubelet could not be asked, and
    the object then keeps what it said."""
    resource, mode = resource_and_mode(device, name, assigned_namespace)
    status, reason, message = ready_condition(device, failure)
    found = {
        "attributes": attributes(device, node),
        "resourceName": resource,
        "mode": mode,
        "eligible": device.eligible and failure is None,
        "conditions": [{"type": READY, "status": status, "reason": reason, "message": message}],
    }
    if holders is not None:
        found["holders"] = holder_list(holders)
    return found


def holder_list(holders: Iterable[Any]) -> list[dict[str, str]]:
    """status.holders: each pod once per resource, in a stable order, at most the CRD's bound."""
    listed = sorted({(h.namespace, h.pod, h.resource) for h in holders})[:MAX_HOLDERS]
    return [{"namespace": ns, "pod": pod, "resource": resource} for ns, pod, resource in listed]


def missing_status(live: dict[str, Any], node: str, known: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A device the node no longer has: keep what was known, say it is gone.

    `known`: the attributes this agent reported for it, for an object whose status never
    landed (the answer to its first status write lost); None when nothing is known, as the
    API server refuses a status without them.
    """
    previous = live.get("status") or {}
    attributes = previous.get("attributes") or known
    if not attributes:
        return None
    address = attributes.get("pciAddress", "?")
    return {
        "attributes": attributes,
        "resourceName": previous.get("resourceName", ""),
        "mode": previous.get("mode", ""),
        "eligible": False,
        "conditions": [
            {
                "type": READY,
                "status": "False",
                "reason": "NotFound",
                "message": (
                    f"No device at {address} on node {node} at the last scan (removed, hidden by a "
                    "firmware or driver change, or the node rebooted without it)."
                ),
            }
        ],
    }


def _live_condition(live: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in live.get("status", {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def changed(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Whether applying `desired` (our status fields) would change the live object."""
    if live is None:
        return True
    status = live.get("status", {})
    for key, value in desired.items():
        if key == "conditions":
            continue
        if key == "attributes":
            got = status.get("attributes", {})
            if any(got.get(k) != v for k, v in value.items()):
                return True
        elif key == "holders":
            if (status.get(key) or []) != value:
                return True
        elif status.get(key) != value:
            return True
    for c in desired["conditions"]:
        if not Cond.of(c).same(Cond.of(_live_condition(live, c["type"]))):
            return True
    return False


def status_body(name: str, desired: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
    """The apply body; a condition keeps its transition time unless its status flips. Holders
    not known this time (`present_status` without them) are sent as the object has them, and
    none are left out: an apply without a field of ours removes it."""
    now = datetime.datetime.now(datetime.UTC)
    conditions = [
        condition(c["type"], Cond.of(c), Cond.of(_live_condition(live or {}, c["type"])), now) for c in desired["conditions"]
    ]
    status = {k: v for k, v in desired.items() if k != "holders"}
    held = desired["holders"] if "holders" in desired else ((live or {}).get("status") or {}).get("holders")
    if held:  # none: left out, which removes the field
        status["holders"] = held
    return {
        "apiVersion": API_VERSION,
        "kind": NODE_PCI_DEVICE_KIND,
        "metadata": {"name": name},
        "status": {**status, "conditions": conditions},
    }
