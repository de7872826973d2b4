"""What the operator's code reads of our objects: small, interned views of NodePCIDevices and
PCIDevices, the values of the caches that the lifecycle, the KubeVirt sync and admission share.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from passthrough.api.conditions import Cond, parse_timestamp
from passthrough.api.labels import NODE_LABEL
from passthrough.api.models import MAX_HOLDERS
from passthrough.pci.naming import node_pci_device_name


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


def _holders(raw: Any) -> tuple[tuple[str, str, str], ...]:
    """status.holders as (namespace, pod, resource), the agent's report of the kubelet's word."""
    if not isinstance(raw, list):
        return ()
    found = [h for h in raw if isinstance(h, Mapping)][:MAX_HOLDERS]
    return tuple(tuple(sys.intern(str(h.get(k) or "")) for k in ("namespace", "pod", "resource")) for h in found)  # type: ignore[misc]


# On a NodePCIDevice: when spec.assignedNamespace was last set, written by the operator's admission
# webhook into the very request that sets it (the API server's format, whole seconds). Nothing
# else changes it (the webhook refuses a hand edit), so no later patch moves it.
ASSIGNED_AT = "passthrough.io/assigned-at"

# What an assignment's own managedFields entry may hold of spec: the device admin's confirmation
# goes with it, and "." is spec itself, where the same write made it.
_ASSIGNMENT_FIELDS = frozenset({"f:assignedNamespace", "f:confirmedNamespaceUID", "."})


def _assigned_at(meta: Mapping[str, Any]) -> str:
    """When spec.assignedNamespace was written, as far as the record proves it; "" when none says.

    The webhook's annotation (ASSIGNED_AT) says it, held within what the API server's own record
    allows: no earlier than the object's creation, no later than the latest managedFields entry
    that owns the field (stamped by that write or a later one), so a clock ahead of the API
    server's, or an annotation written while the webhook was off, never makes a namespace look
    older than the assignment.

    Without it (the webhook off, or an assignment from before it): an entry of managedFields is
    stamped whenever its manager changes any field it owns, so its time is the assignment's only
    while it owns nothing but the assignment (and its confirmation); then the latest such
    entry's time. Where an owner of the field owns more (the same `kubectl patch` later set a
    label), the assignment can be no older than the object: its creationTimestamp, so that a
    namespace made since is asked about, never trusted."""
    owners = [
        entry for entry in meta.get("managedFields") or []
        if isinstance(entry, Mapping) and not entry.get("subresource")
        and "f:assignedNamespace" in (((entry.get("fieldsV1") or {}).get("f:spec")) or {})
    ]  # fmt: skip
    created = str(meta.get("creationTimestamp") or "")
    latest = max((str(entry.get("time") or "") for entry in owners), default="")
    recorded = str((meta.get("annotations") or {}).get(ASSIGNED_AT) or "")
    if parse_timestamp(recorded) is not None:
        # The API server's format sorts as its times do.
        return min(max(recorded, created), latest or recorded)
    if not owners:
        return ""
    if all(_owns_only_the_assignment(entry.get("fieldsV1") or {}) for entry in owners):
        return latest
    return created


def _owns_only_the_assignment(fields: Mapping[str, Any]) -> bool:
    spec = fields.get("f:spec")
    return set(fields) == {"f:spec"} and isinstance(spec, Mapping) and set(spec) <= _ASSIGNMENT_FIELDS


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
    holders: tuple[tuple[str, str, str], ...] = ()  # status.holders: (namespace, pod, resource), the agent's
    confirmed_uid: str = ""  # spec.confirmedNamespaceUID: the namespace a device admin confirmed
    assigned_at: str = ""  # when spec.assignedNamespace was last written (_assigned_at), "" unknown

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
            holders=_holders(status.get("holders")),
            confirmed_uid=spec.get("confirmedNamespaceUID") or "",
            assigned_at=_assigned_at(meta) if spec.get("assignedNamespace") else "",
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


def expected_name(npci: NodeDevice) -> str:
    """The name the agent of its node gives a device with these attributes (pci/naming.py); ""
    while they do not say (no status yet: such a device is not Ready, so never handed out)."""
    attrs = npci.attributes
    parts = [attrs.get(k) for k in ("pciAddress", "vendorID", "deviceID", "nodeName")]
    if not all(isinstance(p, str) and p for p in parts):
        return ""
    return node_pci_device_name(*parts)
