"""What the world says of one device, read before `lifecycle.decide` writes anything: how long
it has been missing (Absence), where it goes and whether it may be there now (Verdict), and who
uses it in each namespace (Users, Holders)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from passthrough.api.conditions import parse_timestamp
from passthrough.api.views import NOT_HANDED, Device, NodeDevice, expected_name
from passthrough.controller.world import SYSTEM_NAMESPACES, World

if TYPE_CHECKING:
    from passthrough.controller.allocations import Allocation


@dataclass(frozen=True)
class Absence:
    """How long the device has been missing from its node (NotFound, or its Node gone), and
    its Node gone: each counted from when this operator first saw it, by its own clock (Ready's
    transition time is the node's clock, and it does not move when NotReady turns into
    NotFound). The Node's absence has a clock of its own: a device NotFound for an hour whose
    Node is then deleted still waits the whole grace period for the Node to register again."""

    node_gone: bool
    missing_since: datetime.datetime | None  # None while the device is not missing
    node_gone_since: datetime.datetime | None  # None while its Node exists
    expired: bool  # missing for longer than the grace period
    node_expired: bool  # its Node gone for longer than the grace period

    @classmethod
    def of(cls, npci: NodeDevice, world: World) -> Absence:
        node_gone = not world.node_present
        missing = node_gone or (npci.ready is not None and npci.ready.reason == "NotFound")
        missing_since = _since(npci.missing_since, world.now) if missing else None
        node_gone_since = _since(npci.node_gone_since, world.now) if node_gone else None
        return cls(
            node_gone=node_gone,
            missing_since=missing_since,
            node_gone_since=node_gone_since,
            expired=missing_since is not None and world.now - missing_since >= world.grace,
            node_expired=node_gone_since is not None and world.now - node_gone_since >= world.grace,
        )

    @property
    def missing(self) -> bool:
        return self.missing_since is not None


@dataclass(frozen=True)
class Verdict:
    """Where the device goes, and whether it may have its PCIDevice there now.

    A device is handed out only while it is Ready (eligible, bound, present); one already
    handed out keeps its PCIDevice through NotReady, and through NotFound for the grace period.
    An assignment belongs to the namespace it was handed to (its uid): one deleted and made
    again under the same name, perhaps by another tenant, does not inherit the device (unless a
    device admin confirms the new one by its uid). A group member assigned elsewhere blocks a new
    hand-out; one already handed out stays. With devices.confirmNewNamespaces, a namespace made
    after the assignment waits for that confirmation too.

    Never handed out, nor kept: a NodePCIDevice whose name is not the one the agent gives a
    device with its attributes (written by someone else, or its attributes changed: an agent
    could take the name another node's device will get), and a model KubeVirt's own device
    plugin serves (to VMs of every namespace, whatever is assigned).
    """

    target: str  # the namespace assigned ("" when none, or the NodePCIDevice is being deleted)
    phase: str | None  # the target's phase (None: it does not exist)
    target_uid: str
    recreated: bool  # the target was deleted and made again since the device was handed to it
    not_ready: bool  # not handed out yet, and not Ready to be
    conflict: tuple[str, str] | None  # (member, namespace) of the IOMMU group assigned elsewhere
    usable: bool  # the target may have its PCIDevice now
    current: Device | None  # the target's PCIDevice, when usable and there is one
    will_exist: bool  # the target's PCIDevice is there (or made) after this plan
    misnamed: str = ""  # the name its attributes give, when the object has another one
    kubevirt_resource: str = ""  # the resource KubeVirt's own plugin serves its model as, when it does
    unconfirmed: bool = False  # its namespace was made after the assignment and awaits a device admin

    @classmethod
    def of(cls, npci: NodeDevice, world: World, absence: Absence) -> Verdict:
        target = "" if npci.deleting else npci.assigned_namespace
        phase = world.namespaces.get(target) if target else None
        target_uid = world.namespace_uids.get(target, "") if target else ""
        confirmed = bool(target_uid) and npci.confirmed_uid == target_uid
        handed_name, handed_uid = npci.handed_to
        recreated = bool(target and handed_name == target and handed_uid and target_uid and handed_uid != target_uid
                         and not confirmed)  # fmt: skip
        # The target already has its PCIDevice (and keeps it: what was handed out is not taken back
        # for a member assigned elsewhere, a device not Ready, or a namespace since confirmable).
        has_pcidevice = any(d.namespace == target and not d.deleting for d in world.devices)
        expected = expected_name(npci)
        misnamed = expected if expected and expected != npci.name else ""
        kubevirt_resource = world.served_by_kubevirt.get(model_of(npci), "") if target else ""
        unconfirmed = bool(
            target and world.confirm_new_namespaces and phase is not None and not confirmed and not has_pcidevice
            and npci.handed_to != (target, target_uid)
            and not _older(world.namespace_created.get(target, ""), npci.assigned_at)
        )  # fmt: skip
        ready = npci.ready is not None and npci.ready.status == "True"
        not_ready = bool(target) and not has_pcidevice and (absence.node_gone or not ready)
        conflict = next(((other, ns) for other, ns in sorted(world.group.items()) if ns and ns != target), None)
        conflict = conflict if target and not has_pcidevice else None
        usable = (bool(target) and phase == "Active" and target not in SYSTEM_NAMESPACES and not absence.expired
                  and not not_ready and conflict is None and not recreated and not misnamed and not kubevirt_resource
                  and not unconfirmed)  # fmt: skip
        current = next((d for d in world.devices if d.namespace == target), None) if usable else None
        return cls(target=target, phase=phase, target_uid=target_uid, recreated=recreated, not_ready=not_ready,
                   conflict=conflict, usable=usable, current=current,
                   will_exist=usable and (current is None or not current.deleting), misnamed=misnamed,
                   kubevirt_resource=kubevirt_resource, unconfirmed=unconfirmed)  # fmt: skip


def model_of(npci: NodeDevice) -> str:
    return f"{npci.attributes.get('vendorID', '')}:{npci.attributes.get('deviceID', '')}".lower()


def _older(created: str, assigned_at: str) -> bool:
    """Whether a namespace created at `created` existed before the assignment written at
    `assigned_at`. Both are the API server's whole seconds: the same second, or either unknown,
    is not "before" (the admin is asked rather than a tenant trusted)."""
    made, assigned = parse_timestamp(created), parse_timestamp(assigned_at)
    return made is not None and assigned is not None and made < assigned


@dataclass(frozen=True)
class Users:
    """Who uses the device in one namespace: the VMs whose spec lists it and, in DRA mode, the
    ResourceClaims of that namespace allocated it.

    A claim is a user as a VM is: it keeps the namespace's PCIDevice Terminating (the finalizer)
    and the NodePCIDevice, and while it is of the namespace the device was assigned to before, the
    new namespace's VMs and claims wait (HeldElsewhere; the scheduler gives an allocated device to
    no other claim). A claim lets go when its last pod ends (kube-controller-manager then takes its
    allocation back) or when it is deleted. Only claims of a namespace the device was handed out
    to count (`Holders`, `users_by_namespace`): an allocation the webhook should have refused
    does not keep a device anywhere.
    """

    namespace: str
    vms: tuple[str, ...] = ()
    claims: tuple[Allocation, ...] = ()

    @classmethod
    def of(cls, world: World, namespace: str) -> Users:
        claims = tuple(c for c in world.claims if c.namespace == namespace)
        return cls(namespace, world.referencing_vms.get(namespace, ()), claims)

    def __bool__(self) -> bool:
        return bool(self.vms or self.claims)

    def using(self) -> list[str]:
        """Those that use it now: the VMs, and the claims reserved for a pod."""
        vms = [_vm_list(self.namespace, self.vms)] if self.vms else []
        return vms + [c.describe() for c in self.claims if c.consumers]

    def waiting_for_pods(self) -> list[str]:
        """The claims allocated it that no pod is reserved for yet."""
        return [c.describe() for c in self.claims if not c.consumers]

    def names(self) -> str:
        return "; ".join(self.using() + self.waiting_for_pods())

    def until_released(self) -> str:
        """What letting go takes, to end a sentence `... until <this>`."""
        parts = [f"{_vm_list(self.namespace, self.vms)} drops it from its spec"] if self.vms else []
        if len(self.claims) == 1:
            parts.append(f"{self.claims[0].describe()} lets go of it (its pods end, or it is deleted)")
        elif self.claims:
            parts.append(f"{', '.join(c.describe() for c in self.claims)} let go of it (their pods end, or they are deleted)")
        return " and ".join(parts)


@dataclass(frozen=True)
class Holders:
    """The users of the device in each namespace it has a PCIDevice in, and the PCIDevices that go
    (every one but the current one)."""

    referenced: Mapping[str, Users]  # namespace of each PCIDevice -> the VMs and claims there that use it
    leaving: tuple[Device, ...]
    # Of those, the ones that outlive this plan: a user holds them (or their namespace is going).
    lingering: tuple[Device, ...]
    # Users of another namespace that still hold the device (reassigned under them): until they
    # let go, the target namespace's wait, and both objects say so.
    held_elsewhere: Mapping[str, Users]

    @classmethod
    def of(cls, world: World, target: str, phase: str | None, current: Device | None = None) -> Holders:
        referenced = {d.namespace: Users.of(world, d.namespace) for d in world.devices}
        leaving = tuple(d for d in world.devices if d is not current or d.deleting)
        lingering = tuple(d for d in leaving if referenced[d.namespace] or (d.namespace == target and phase == "Terminating"))
        held_elsewhere = {d.namespace: referenced[d.namespace] for d in lingering if d.namespace != target and referenced[d.namespace]}
        return cls(referenced, leaving, lingering, held_elsewhere)


def users_by_namespace(world: World, verdict: Verdict, holders: Holders) -> dict[str, Users]:
    """Namespace -> the VMs and claims there that use the device, wherever its PCIDevice is."""
    users = {ns: found for ns, found in holders.referenced.items() if found}
    if verdict.will_exist and (found := Users.of(world, verdict.target)):
        users[verdict.target] = found
    return users


def pool_claims(npci: NodeDevice, world: World) -> tuple[Allocation, ...]:
    """The claims of any namespace allocated a device nobody has: an unassigned GPU is the pool
    every namespace may claim (admission/claims.py). They are reported on the NodePCIDevice, and
    hold nothing: like a VM that asks for a pool GPU by model, they keep no finalizer."""
    return world.claims if not npci.assigned_namespace and npci.handed_to == NOT_HANDED and not world.devices else ()


def left_in_pool(npci: NodeDevice, world: World) -> tuple[Allocation, ...]:
    """The claims still allocated a device that has left the pool: of a namespace that is neither
    the one it is assigned to now nor one with its PCIDevice, so allocated while it was the pool's
    (the allocation gate refuses such a claim once it is assigned). As device-plugin mode reports a
    pool pod that still holds a device after its assignment (HeldByPod), they are named on the
    NodePCIDevice, for the admin, and the namespace's PCIDevice says it waits without naming them.
    Like the pool's claims, they hold nothing: no finalizer, no Users."""
    if pool_claims(npci, world):
        return ()
    counted = {npci.assigned_namespace, *(d.namespace for d in world.devices)}
    return tuple(c for c in world.claims if c.namespace not in counted)


def _vm_list(namespace: str, vms: tuple[str, ...]) -> str:
    names = ", ".join(f"{namespace}/{vm}" for vm in vms)
    return f"VirtualMachine {names}" if len(vms) == 1 else f"VirtualMachines {names}"


def _since(recorded: str, now: datetime.datetime) -> datetime.datetime:
    # Ours, but an object can carry anything: unreadable or in the future counts from now.
    when = parse_timestamp(recorded)
    return when if when is not None and when <= now else now
