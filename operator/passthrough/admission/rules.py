"""Who may use a namespace-assigned device: the admission decisions, as pure functions.

A VM, VMI or pod names a device by its exclusive resource, `passthrough.io/<PCIDevice name>`.
These functions take what the object lists and what the operator's indexes know (the
namespace's PCIDevices, the VMs that list each one) and return a verdict; they know nothing
of Kopf or the API. `admission.webhook` feeds them from the indexes.

A PCIDevice counts only as the operator made it (`why_not_handed_out`): anyone who can write a
PCIDevice of the right name into a namespace must not thereby give that namespace a device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from passthrough.api.views import ASSIGNED_AT, Device, NodeDevice
from passthrough.pci.naming import EXCLUSIVE_DOMAIN

PREFIX = f"{EXCLUSIVE_DOMAIN}/"
# Deckhouse's limit, and what one VM's PCI topology comfortably takes.
MAX_DEVICES = 8


@dataclass(frozen=True)
class Verdict:
    """Empty `refusal`: admitted (with `warnings`, which kubectl prints)."""

    refusal: str = ""
    warnings: tuple[str, ...] = ()

    @property
    def allowed(self) -> bool:
        return not self.refusal


# -- what an object lists -------------------------------------------------------------------


def device_references(devices: Mapping[str, Any] | None) -> list[str]:
    """PCIDevice names a KubeVirt `domain.devices` lists (hostDevices, then gpus), repeats kept."""
    devices = devices or {}
    names = []
    for entry in [*(devices.get("hostDevices") or []), *(devices.get("gpus") or [])]:
        device_name = (entry or {}).get("deviceName") or ""
        if device_name.startswith(PREFIX):
            names.append(device_name[len(PREFIX):])
    return names


def _get(obj: Mapping[str, Any] | None, *path: str) -> Any:
    for key in path:
        obj = (obj or {}).get(key)
    return obj


def _resource_requests(containers_resources: Sequence[Mapping[str, Any] | None]) -> list[str]:
    """PCIDevice names asked for as `passthrough.io/` resources in requests or limits (a limit
    alone implies the request), each name once however many times it is asked for."""
    names: dict[str, None] = {}
    for resources in containers_resources:
        resources = resources or {}
        for resource in [*(resources.get("requests") or {}), *(resources.get("limits") or {})]:
            if isinstance(resource, str) and resource.startswith(PREFIX):
                names[resource[len(PREFIX):]] = None
    return list(names)


def domain_device_references(domain: Mapping[str, Any] | None) -> list[str]:
    """What a KubeVirt `domain` lists: hostDevices and gpus by deviceName (repeats kept), then
    the `passthrough.io/` resources of `domain.resources`, which KubeVirt copies into the
    launcher pod's requests just the same (each name once)."""
    return [*device_references(_get(domain, "devices")), *_resource_requests([_get(domain, "resources")])]


def vm_device_references(spec: Mapping[str, Any] | None) -> list[str]:
    """What a VirtualMachine's spec lists (spec.template.spec.domain)."""
    return domain_device_references(_get(spec, "template", "spec", "domain"))


def vmi_device_references(spec: Mapping[str, Any] | None) -> list[str]:
    """What a VirtualMachineInstance's spec lists (spec.domain)."""
    return domain_device_references(_get(spec, "domain"))


def referenced_device_names(spec: Mapping[str, Any] | None) -> set[str]:
    """Names of the PCIDevices a VirtualMachine's spec lists (devices by deviceName, and resources)."""
    return set(vm_device_references(spec))


def pod_device_requests(spec: Mapping[str, Any] | None) -> list[str]:
    """PCIDevice names a pod asks for: `passthrough.io/` resources of any container or init
    container, in requests or limits (a limit alone implies the request), each name once."""
    containers = [*(_get(spec, "containers") or []), *(_get(spec, "initContainers") or [])]
    return _resource_requests([(c or {}).get("resources") for c in containers])


# -- about one device -----------------------------------------------------------------------


def _controlled_by(device: Device, owner: NodeDevice) -> bool:
    return any(
        o.get("controller") and o.get("kind") == "NodePCIDevice" and o.get("uid") == owner.uid
        for o in device.metadata.get("ownerReferences") or []
    )


def why_not_handed_out(device: Device, owner: NodeDevice | None, namespace_uid: str) -> str:
    """Why `device` is not a PCIDevice the operator handed to its namespace; "" when it is.

    The operator's PCIDevice has the live NodePCIDevice of its name as controller owner (by
    uid), and that NodePCIDevice records the namespace it was handed to, uid included
    (`status.assignedNamespaceRef`). The record moves with a reassignment while the old
    namespace's PCIDevice lingers for the VM that holds it, so a PCIDevice being deleted needs
    only the owner: it is refused to newcomers as being removed anyway. For the admin's log;
    a tenant is told less (`_not_handed_out`).
    """
    if owner is None:
        return f"NodePCIDevice {device.name} does not exist"
    if not _controlled_by(device, owner):
        return f"its controller owner is not NodePCIDevice {device.name} (uid {owner.uid})"
    if device.deleting:
        return ""
    name, uid = owner.handed_to
    if (name, uid) != (device.namespace, namespace_uid) or not uid:
        handed = f"{name} (uid {uid})" if name else "no namespace"
        return (f"NodePCIDevice {device.name} was handed to {handed}, not to namespace {device.namespace} "
                f"(uid {namespace_uid or 'unknown'})")
    return ""


def node_of(device: Device) -> str:
    return device.status.get("nodeName") or (device.status.get("attributes") or {}).get("nodeName") or ""


def _ready(device: Device) -> Mapping[str, Any] | None:
    return next((c for c in device.status.get("conditions") or [] if c.get("type") == "Ready"), None)


def _not_assigned(name: str, namespace: str) -> str:
    # Says nothing of where the device is: another namespace's devices are none of the asker's business.
    return (
        f"{PREFIX}{name} is not a PCIDevice of namespace {namespace}; ask an admin to assign the device "
        f"to {namespace}, or use one that `kubectl get pcidevices -n {namespace}` lists"
    )


def _not_handed_out(name: str, namespace: str) -> str:
    # Also what a VM reads in the moment between the operator's PCIDevice and its record of the
    # hand-out (the NodePCIDevice's Assigned=True comes with it), hence "retry".
    return (
        f"PCIDevice {name} in namespace {namespace} is not one the passthrough operator handed to {namespace}, "
        f"so it gives the namespace no device; if an admin has just assigned it, retry in a moment, otherwise "
        f"ask one to assign the device to {namespace}"
    )


def _being_removed(name: str, namespace: str) -> str:
    return f"PCIDevice {name} is being removed from namespace {namespace} (unassigned or reassigned)"


def _who(kind: str, namespace: str, name: str) -> str:
    return f"{kind} {namespace}/{name}" if name else f"{kind} in namespace {namespace}"


# -- the verdicts ---------------------------------------------------------------------------


def judge_vm(
    kind: str,
    namespace: str,
    name: str,
    listed: Sequence[str],
    before: Sequence[str] | None,
    devices: Mapping[str, Device],
    users: Mapping[str, Collection[str]],
    exempt: Collection[str] = (),
    forged: Collection[str] = (),
) -> Verdict:
    """A VirtualMachine's or VMI's device list, on create (`before` None) or update.

    `devices`: the namespace's PCIDevices by name (at least those listed) that the operator
    handed out; `forged`: names of the namespace's PCIDevices it did not make (`why_not_handed_out`);
    `users`: for each device name, the VMs of the namespace whose spec lists it; `exempt`: VMs
    that do not count as another user (for a VMI, the VM it was made from, once checked; a VM
    is never another user of its own devices).

    On update only what the update adds is judged: a device the object already held stays
    editable while it is being reassigned, and a list grandfathered past a rule stays as it is.
    """
    counts, counted_before = Counter(listed), Counter(before or ())
    added = [d for d in counts if before is None or d not in counted_before]
    problems: list[str] = []
    warnings: list[str] = []

    for device, n in counts.items():
        if n > 1 and n > counted_before[device]:
            problems.append(f"{PREFIX}{device} is listed {n} times; list each device once")
    if len(listed) > MAX_DEVICES and (before is None or len(listed) > len(before)):
        problems.append(
            f"{len(listed)} passthrough devices are listed, at most {MAX_DEVICES} fit one VM; "
            f"remove {len(listed) - MAX_DEVICES}"
        )
    itself = {name} if kind == "VirtualMachine" else set()
    for device in added:
        live = devices.get(device)
        if device in forged:
            problems.append(_not_handed_out(device, namespace))
            continue
        if live is None or live.namespace != namespace:
            problems.append(_not_assigned(device, namespace))
            continue
        if live.deleting:
            problems.append(f"{_being_removed(device, namespace)}; use another device of the namespace")
            continue
        others = sorted(set(users.get(device, ())) - set(exempt) - itself)
        if others:
            problems.append(
                f"PCIDevice {device} is already used by VirtualMachine {namespace}/{others[0]}; "
                "remove it from that VM first, or use another device"
            )
            continue
        ready = _ready(live)
        if not ready or ready.get("status") != "True":
            why = f"{ready.get('reason')}: {ready.get('message')}" if ready else "not reported yet"
            warnings.append(f"PCIDevice {device} is not Ready ({why}); the VM will not start on it until it is")
    if added:
        by_node: dict[str, list[str]] = {}
        for device in counts:
            live = devices.get(device)
            if live is not None and live.namespace == namespace and node_of(live):
                by_node.setdefault(node_of(live), []).append(device)
        if len(by_node) > 1:
            where = "; ".join(f"{', '.join(names)} on {node}" for node, names in sorted(by_node.items()))
            problems.append(f"the devices are on different nodes ({where}) and a VM runs on one; list devices of one node only")

    if problems:
        return Verdict(f"{_who(kind, namespace, name)}: " + "; ".join(problems) + ".")
    return Verdict(warnings=tuple(warnings))


def judge_pod(
    namespace: str, name: str, requested: Collection[str], devices: Mapping[str, Device], forged: Collection[str] = (),
) -> Verdict:  # fmt: skip
    """A pod asking for `passthrough.io/` resources (create): each must be a PCIDevice the
    operator handed to its namespace that is not being removed (`devices` and `forged` as for
    `judge_vm`). This keeps a bare pod away from another tenant's /dev/vfio; KubeVirt's
    launcher pods, made in the VM's namespace, pass it."""
    problems = []
    for device in requested:
        live = devices.get(device)
        if device in forged:
            problems.append(_not_handed_out(device, namespace))
        elif live is None or live.namespace != namespace:
            problems.append(_not_assigned(device, namespace))
        elif live.deleting:
            problems.append(f"{_being_removed(device, namespace)}; no new pod may use it")
    if problems:
        return Verdict(f"{_who('Pod', namespace, name)}: " + "; ".join(problems) + ".")
    return Verdict()


# -- when a device was assigned -------------------------------------------------------------


def date_assignment(
    assigned: str, assigned_before: str, recorded: str, recorded_before: str, now: str,
) -> tuple[Verdict, str]:  # fmt: skip
    """A NodePCIDevice's write (a create: the `_before`s empty), and the ASSIGNED_AT annotation it
    leaves: `now` when it sets spec.assignedNamespace anew, "" (none) when it clears it, what it
    was otherwise.

    The annotation is what devices.confirmNewNamespaces compares a namespace's creation with, so
    no hand may move it: a write that leaves the assignment as it was and changes the annotation
    is refused, saying how to date the assignment anew; one that changes the assignment gets the
    webhook's time whatever it carried, with a warning when it carried another."""
    if assigned == assigned_before:
        if recorded != recorded_before:
            was = f"as it was ({recorded_before})" if recorded_before else "unset"
            return Verdict(
                f"metadata.annotations[{ASSIGNED_AT}] is when spec.assignedNamespace was last set, recorded by the "
                "passthrough operator's webhook for devices.confirmNewNamespaces, and is not written by hand: leave it "
                f"{was}. To date the assignment anew, clear spec.assignedNamespace and set it again."
            ), recorded_before  # fmt: skip
        return Verdict(), recorded
    value = now if assigned else ""
    replaced = recorded and recorded != recorded_before and recorded != value
    warning = f"{ASSIGNED_AT} is recorded by the passthrough operator's webhook: {recorded} was replaced" if replaced else ""
    return Verdict(warnings=(f"{warning} by {value or 'nothing (no namespace is assigned)'}",) if warning else ()), value
