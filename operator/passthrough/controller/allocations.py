"""DRA mode: which ResourceClaims are allocated which of our devices, as the operator's index keeps them.

The scheduler writes a claim's allocation (`status.allocation.devices.results[]`: driver, pool =
the node's name, device = `dra.slice.device_name` of the PCI address) and the consumers it reserved
the claim for (`status.reservedFor[]`, the pods); the allocation webhook has already refused any
allocation that names a device not handed out to the claim's namespace. A result is found by its
node and address (`key`), never by the NodePCIDevice name the slice's attributes carry: those are
the agent's words, the address is what the scheduler allocated. Which claims count for a device is
`lifecycle`'s to decide (`verdict.Users`); here is only what a claim says, kept small.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from passthrough.admission.claims import our_results
from passthrough.api.names import MAX_HOLDERS
from passthrough.dra.slice import device_name

PLURAL = "resourceclaims"


@dataclass(frozen=True, slots=True)
class Allocation:
    """A ResourceClaim allocated one of our devices, and whom it is reserved for."""

    namespace: str
    name: str
    consumers: tuple[str, ...] = ()  # "pod virt-launcher-vm1-xyz", from status.reservedFor (empty: no pod yet)

    def describe(self) -> str:
        """`ResourceClaim team-a/gpu (pod virt-launcher-vm1-xyz)`, or without consumers its name alone."""
        claim = f"ResourceClaim {self.namespace}/{self.name}"
        return f"{claim} ({', '.join(self.consumers)})" if self.consumers else claim


def key(node_name: str, address: str) -> tuple[str, str]:
    """Where an allocation of the device at `address` on `node_name` is indexed: (pool, device)."""
    return node_name, device_name(address)


def _consumer(ref: Any) -> str:
    if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str) or not ref["name"]:
        return ""
    resource, group = str(ref.get("resource") or "?"), str(ref.get("apiGroup") or "")
    kind = "pod" if (resource, group) == ("pods", "") else f"{resource}.{group}" if group else resource
    return f"{kind} {ref['name']}"


def consumers(status: Any) -> tuple[str, ...]:
    """Who the claim is reserved for, as `kind name` (at most MAX_HOLDERS of them: a VFIO device
    has one pod, and the message that names them stays short whatever a status holds)."""
    refs = status.get("reservedFor") if isinstance(status, Mapping) else None
    found = [c for c in map(_consumer, refs if isinstance(refs, list) else []) if c]
    return tuple(sorted(found)[:MAX_HOLDERS])


def allocated(namespace: str, name: str, status: Any) -> dict[tuple[str, str], Allocation]:
    """(pool, device) -> the claim, for each device of our driver that `status` allocates it."""
    claim = Allocation(namespace, name, consumers(status))
    found = {(str(r.get("pool") or ""), str(r.get("device") or "")): claim for r in our_results(status)}
    return {where: claim for where, claim in found.items() if all(where)}
