"""Binding conditions (resource.k8s.io/v1, beta and on by default since Kubernetes 1.36): every
device in our slice says the scheduler may bind a pod that was allocated it only once the
driver reports `VFIOBound` in the claim's status, and that `VFIOBindFailed` means it never will.
The driver binds the device's whole IOMMU group to vfio-pci as soon as the scheduler has written
the allocation, before the pod is on the node, and answers in `status.devices`; on a failure the
scheduler takes the allocation back and tries again, where the failed device no longer is offered.
Pure functions: which of a claim's devices wait for this node's answer, and the answer itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from passthrough.dra.slice import BIND_FAILED, BOUND, DRIVER

BOUND_REASON = "GroupOnVFIO"
FIELD_MANAGER = "passthrough-dra-driver"  # the agent's entries of status.devices, by server-side apply


@dataclass(frozen=True)
class Waiting:
    """A claim with devices of ours on this node that wait for the driver's answer."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    devices: tuple[tuple[str, str, bool], ...] = ()  # (request, device name, adminAccess), unanswered


def waiting(node_name: str, body: Mapping[str, Any]) -> Waiting:
    """A claim as the driver's cache keeps it: its results of our driver in this node's pool that
    carry our binding condition and have neither condition True in `status.devices` yet."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    answered = {
        entry.get("device") for entry in status.get("devices") or []
        if entry.get("driver") == DRIVER and entry.get("pool") == node_name
        and any(c.get("type") in (BOUND, BIND_FAILED) and c.get("status") == "True" for c in entry.get("conditions") or [])
    }  # fmt: skip
    devices = tuple(
        (r.get("request", ""), r.get("device", ""), bool(r.get("adminAccess")))
        for r in results
        if r.get("driver") == DRIVER and r.get("pool") == node_name and BOUND in (r.get("bindingConditions") or [])
        and r.get("device") not in answered
    )  # fmt: skip
    return Waiting(meta.get("namespace", ""), meta.get("name", ""), meta.get("uid", ""), meta.get("resourceVersion", ""), devices)


def condition(bound: bool, message: str, now: str, reason: str = BOUND_REASON) -> dict[str, Any]:
    return {"type": BOUND if bound else BIND_FAILED, "status": "True", "reason": reason, "message": message[:32768],
            "lastTransitionTime": now}  # fmt: skip


def status_apply(claim: Waiting, node_name: str, answers: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The server-side apply of our answers (device name -> condition) into the claim's
    `status.devices` (a map by driver, pool and device: other drivers' entries stay theirs).
    The uid makes it apply to this claim only, not one of the same name made since."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
        "status": {"devices": [{"driver": DRIVER, "pool": node_name, "device": device, "conditions": [answer]}
                               for device, answer in sorted(answers.items())]},
    }  # fmt: skip
