"""Claims stay in their namespace: the DRA admission decisions, as pure functions.

DRA knows no device that belongs to a namespace: any claim whose selectors match a device of the
agent's ResourceSlices may be allocated it. Two gates keep a claim of namespace X to X's devices:

- the allocation the scheduler writes into a claim's status (`judge_allocation`): every device
  of our driver it names must be one the operator handed out to X (decided from the
  NodePCIDevices, never from what the slice or the claim says), or an unassigned GPU of a node
  in GPU passthrough mode, which is the pool any namespace may claim by model. This gate holds
  whatever selectors or DeviceClasses a tenant writes;
- the claim itself (`judge_claim`): no other namespace's DeviceClass `passthrough-<namespace>`
  (the operator's, in DRA mode: controller/deviceclasses.py), and no `adminAccess` on a
  passthrough class (VFIO gives a device to one VM, and admin access would let a claim reach a
  device another claim holds). Whose class it is follows from its name (`class_owner`), not from
  the class: a claim made before the class exists is allocated the moment it appears.

Before both, the claim is steered (`steer`): each request through any other class gets a selector
keeping it to its namespace's devices and the pool's, so the scheduler finds an allowed device
itself where one is free; the allocation gate stays the second line.

`admission.webhook` feeds them from the operator's indexes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from passthrough.admission.rules import Verdict
from passthrough.api.names import DNS1123_LABEL, DNS1123_LABEL_MAX
from passthrough.api.views import NodeDevice
from passthrough.dra.slice import DOMAIN, DRIVER, device_name

# The prefix of the DeviceClasses that select passthrough devices (the operator's per-namespace
# classes are `passthrough-<namespace>`).
CLASS_PREFIX = "passthrough-"
# The operator's class of the pool (unassigned GPUs of nodes in GPU mode), open to every namespace.
POOL_CLASS = CLASS_PREFIX + "pool.gpu"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


# -- the allocation ---------------------------------------------------------------------------


def allocation(status: Any) -> Any:
    return _mapping(status).get("allocation")


def our_results(status: Any) -> list[Mapping[str, Any]]:
    """The allocation results of a claim's status that name a device of our driver."""
    results = _list(_mapping(_mapping(allocation(status)).get("devices")).get("results"))
    return [r for r in results if isinstance(r, Mapping) and r.get("driver") == DRIVER]


def added_results(old_status: Any, new_status: Any) -> list[Mapping[str, Any]]:
    """What an update of a claim's status allocates of ours that it did not before. The kubelet
    and the scheduler write the status for other reasons too (reservedFor, devices' health): an
    update that leaves the allocation as it was is not judged again."""
    if allocation(old_status) == allocation(new_status):
        return []
    before = [dict(r) for r in our_results(old_status)]
    return [r for r in our_results(new_status) if dict(r) not in before]


def handed_to(device: NodeDevice) -> tuple[str, str]:
    """The namespace (name, uid) the operator has handed `device` out to, ("", "") while none: the
    spec names it, Assigned=True, and status.assignedNamespaceRef records that namespace with its
    uid (what the agent publishes in the slice, `agent.report.handed_out`, and the uid besides)."""
    name, uid = device.handed_to
    assigned = device.assigned is not None and device.assigned.status == "True"
    if device.assigned_namespace and name == device.assigned_namespace and uid and assigned:
        return name, uid
    return "", ""


def _gone(device: NodeDevice) -> bool:
    return device.ready is not None and device.ready.reason == "NotFound"


def _pooled(device: NodeDevice, node_devices: Sequence[NodeDevice], in_gpu_mode: bool) -> str:
    """Why `device` is not a pool GPU any namespace may claim; "" when it is: unassigned, a GPU
    the agent names a pool for, Ready, on a node in GPU passthrough mode, and no member of its
    IOMMU group assigned (the group is the unit: `agent.plan`)."""
    if device.assigned_namespace:
        return "it is assigned to a namespace and not handed out to this one"
    if not (device.mode == "Pool" and device.resource_name):
        return "it is assigned to no namespace and is not a pool GPU"
    if not in_gpu_mode:
        return f"node {device.node_name} is not in GPU passthrough mode"
    if device.ready is None or device.ready.status != "True":
        return "it is not Ready"
    group = device.attributes.get("iommuGroup", -1)
    if any(d.assigned_namespace for d in node_devices if d.attributes.get("iommuGroup", -2) == group):
        return f"a member of its IOMMU group {group} is assigned to a namespace"
    return ""


def why_not(
    namespace: str, namespace_uid: str, pool: str, device: str, node_devices: Sequence[NodeDevice], in_gpu_mode: bool,
) -> str:  # fmt: skip
    """Why device `device` of pool `pool` (a node name: the slice's pool, `dra.slice`) may not go to
    a claim of `namespace`, for the admin's log; "" when it may. `node_devices`: the node's
    NodePCIDevices. A device the node reported twice (the same address with other IDs, the old one
    NotFound) is judged by those still present."""
    found = [d for d in node_devices if device_name(str(d.attributes.get("pciAddress") or "")) == device]
    present = [d for d in found if not _gone(d)] or found
    if not present:
        return f"no NodePCIDevice of node {pool} is device {device}"
    for candidate in present:
        handed = handed_to(candidate)
        if handed == ("", ""):
            why = _pooled(candidate, node_devices, in_gpu_mode)
            if why:
                return f"NodePCIDevice {candidate.name}: {why}"
        elif handed != (namespace, namespace_uid) or not namespace_uid:
            return (f"NodePCIDevice {candidate.name} is handed out to {handed[0]} (uid {handed[1]}), not to "
                    f"{namespace} (uid {namespace_uid or 'unknown'})")  # fmt: skip
    return ""


def judge_allocation(
    namespace: str, name: str, results: Sequence[Mapping[str, Any]], reasons: Mapping[tuple[str, str], str],
) -> Verdict:
    """The allocation results of ours that an update of claim `namespace/name` adds
    (`added_results`), given `reasons`: for each (pool, device) named, `why_not`'s answer. The
    refusal, which the scheduler reports on the pod, says nothing of whose device it is."""
    problems = []
    for result in results:
        pool, device = str(result.get("pool") or ""), str(result.get("device") or "")
        if result.get("adminAccess"):
            problems.append(f"device {device} of node {pool} is allocated with adminAccess, which passthrough devices "
                            "do not allow (VFIO gives a device to one VM at a time)")  # fmt: skip
        elif reasons.get((pool, device)):
            problems.append(f"device {device} of node {pool} is not one the passthrough operator handed out to "
                            f"namespace {namespace}")  # fmt: skip
    if problems:
        return Verdict(
            f"ResourceClaim {namespace}/{name}: " + "; ".join(problems) + f". A claim of {namespace} may be allocated only "
            f"the {DRIVER} devices assigned to {namespace} (DeviceClass {CLASS_PREFIX}{namespace}) or unassigned pool GPUs."
        )
    return Verdict()


# -- the claim --------------------------------------------------------------------------------


def requests(devices: Any) -> list[tuple[str, str, bool]]:
    """(request name, deviceClassName, adminAccess) of each request of a claim's `spec.devices`,
    and of each `firstAvailable` subrequest (which has no adminAccess)."""
    found = []
    for request in _list(_mapping(devices).get("requests")):
        request = _mapping(request)
        name = str(request.get("name") or "")
        exactly = _mapping(request.get("exactly"))
        if exactly:
            found.append((name, str(exactly.get("deviceClassName") or ""), exactly.get("adminAccess") is True))
        for sub in _list(request.get("firstAvailable")):
            sub = _mapping(sub)
            found.append((f"{name}/{sub.get('name') or ''}", str(sub.get("deviceClassName") or ""), False))
    return found


def _several(request: Mapping[str, Any]) -> bool:
    """Whether a request (or subrequest) asks for more than one device: allocationMode All, or a count above 1."""
    count = request.get("count")
    return request.get("allocationMode") == "All" or (isinstance(count, int) and not isinstance(count, bool) and count > 1)


def several_devices(devices: Any) -> list[tuple[str, str]]:
    """(request name, deviceClassName) of each request or subrequest that asks for more than one device."""
    found = []
    for request in _list(_mapping(devices).get("requests")):
        request = _mapping(request)
        name = str(request.get("name") or "")
        exactly = _mapping(request.get("exactly"))
        if exactly and _several(exactly):
            found.append((name, str(exactly.get("deviceClassName") or "")))
        for sub in _list(request.get("firstAvailable")):
            sub = _mapping(sub)
            if _several(sub):
                found.append((f"{name}/{sub.get('name') or ''}", str(sub.get("deviceClassName") or "")))
    return found


def template_devices(spec: Any) -> Any:
    """A ResourceClaimTemplate's `spec.spec.devices`."""
    return _mapping(_mapping(spec).get("spec")).get("devices")


def passthrough_class(name: str) -> bool:
    return name.startswith(CLASS_PREFIX)


def class_owner(device_class: str) -> str:
    """The namespace whose class `device_class` is: `passthrough-<namespace>` is that namespace's
    whether the class exists yet or not (the operator makes it with the namespace's first device,
    and a claim that named it before would be allocated then). "" for the pool's class (a dot: no
    namespace has it) and every other name."""
    rest = device_class.removeprefix(CLASS_PREFIX)
    if rest == device_class or len(rest) > DNS1123_LABEL_MAX or not re.match(DNS1123_LABEL, rest):
        return ""
    return rest


def steering(namespace: str) -> dict[str, Any]:
    """The selector that keeps a request of `namespace` to the devices of ours it may be allocated:
    those the agents publish for `namespace` and the pool's (`passthrough.io/namespace` "", as
    `dra.slice` writes it). Other drivers' devices pass untouched. A namespace name is a DNS label:
    nothing in it needs quoting in CEL."""
    mine = f'device.attributes["{DOMAIN}"].namespace'
    return {"cel": {"expression": f'device.driver != "{DRIVER}" || {mine} == "{namespace}" || {mine} == ""'}}


def _steered(request: Mapping[str, Any], selector: Mapping[str, Any]) -> dict[str, Any]:
    """`request` (an `exactly` or a subrequest) with `selector` among its selectors, once."""
    selectors = _list(request.get("selectors"))
    return dict(request) if selector in selectors else {**request, "selectors": [*selectors, dict(selector)]}


def steer(namespace: str, devices: Any) -> Any:
    """A claim's `spec.devices` (or a template's `spec.spec.devices`) with the namespace's
    `steering` selector added to each request and each `firstAvailable` subrequest, so that the
    scheduler looks only at devices the allocation gate would let through and finds an allowed one
    where there is one, instead of picking another namespace's and being refused. A request that
    names a passthrough- class is left as it is (that class already keeps to one namespace's
    devices or the pool's, and another namespace's is refused by `judge_claim`); adding the
    selector again changes nothing, so a claim made from a steered template stays as it is."""
    if not isinstance(devices, Mapping):
        return devices
    selector, requests_ = steering(namespace), []
    for request in _list(devices.get("requests")):
        request = dict(_mapping(request))
        exactly = _mapping(request.get("exactly"))
        if exactly and not passthrough_class(str(exactly.get("deviceClassName") or "")):
            request["exactly"] = _steered(exactly, selector)
        if isinstance(request.get("firstAvailable"), list):
            request["firstAvailable"] = [
                _steered(_mapping(sub), selector) if not passthrough_class(str(_mapping(sub).get("deviceClassName") or "")) else sub
                for sub in request["firstAvailable"]
            ]  # fmt: skip
        requests_.append(request)
    return {**devices, "requests": requests_} if "requests" in devices else dict(devices)


def judge_claim(kind: str, namespace: str, name: str, devices: Any) -> Verdict:
    """A ResourceClaim's `spec.devices` (or a template's `spec.spec.devices`), on create or update."""
    problems = []
    for request, device_class, admin in requests(devices):
        owner = class_owner(device_class)
        if owner and owner != namespace:
            problems.append(f"request {request} names DeviceClass {device_class}, which selects the devices of another "
                            f"namespace; a claim of {namespace} names {CLASS_PREFIX}{namespace}, which the operator "
                            f"makes once a device is assigned to {namespace}, or {POOL_CLASS} for an unassigned GPU")  # fmt: skip
        elif admin and passthrough_class(device_class):
            problems.append(f"request {request} asks for adminAccess to DeviceClass {device_class}, which passthrough "
                            "devices do not allow (VFIO gives a device to one VM at a time, and admin access would reach "
                            "devices other claims hold); remove adminAccess")  # fmt: skip
    who = f"{kind} {namespace}/{name}" if name else f"{kind} in namespace {namespace}"
    if problems:
        return Verdict(f"{who}: " + "; ".join(problems) + ".")
    # Admitted, but a VM cannot use such a request: KubeVirt (1.9) takes exactly one device per
    # request a VM's gpus or hostDevices name, and refuses to start the VM otherwise. A pod that
    # uses vfio itself may want several, so this is a warning, not a refusal.
    warnings = tuple(
        f"{who}: request {request} asks for more than one device of DeviceClass {device_class}; KubeVirt gives a VM "
        "exactly one device per request it names (gpus[].requestName, hostDevices[].requestName) and does not start "
        "a VM that names this one: for a VM, make one request per device"
        for request, device_class in several_devices(devices) if passthrough_class(device_class)
    )  # fmt: skip
    return Verdict(warnings=warnings)
