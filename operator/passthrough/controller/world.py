"""What `lifecycle.decide` reads and what it returns: the world of one device name (the
NodePCIDevice, its PCIDevices, namespaces, VMs, claims), and the plan (the writes and Events)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from passthrough.api.views import Device, NodeDevice

if TYPE_CHECKING:
    from passthrough.controller.allocations import Allocation

FINALIZER = "passthrough.io/in-use"
DEFAULT_GRACE = datetime.timedelta(minutes=10)

# Namespaces that never receive devices: VMs do not run there, and a device handed to one is
# almost certainly a typo. The CRD refuses them up front; this catches objects that predate it.
SYSTEM_NAMESPACES = frozenset({"kube-system", "kube-public", "kube-node-lease"})


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
    namespace_created: Mapping[str, str] = field(default_factory=dict)  # name -> creationTimestamp
    # The PassthroughConfig's devices.confirmNewNamespaces: a namespace made after the assignment
    # waits for a device admin's confirmation (spec.confirmedNamespaceUID).
    confirm_new_namespaces: bool = False
    # The models KubeVirt's own device plugin serves (allow-list entries with
    # externalResourceProvider false): "vvvv:dddd" -> its resource name.
    served_by_kubevirt: Mapping[str, str] = field(default_factory=dict)
    # DRA mode: the ResourceClaims whose status allocates this device (by its node and address:
    # controller/allocations.py), whatever their namespace; `Users` decides which count.
    claims: tuple[Allocation, ...] = ()
    # DRA mode: the DeviceClass through which the device's namespace claims it ("" otherwise):
    # the way to use it that the PCIDevice points a tenant to.
    device_class: str = ""


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

    def add(self, other: Plan) -> None:
        self.writes += other.writes
        self.events += other.events
