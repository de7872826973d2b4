"""The passthrough.io/v1alpha1 API as pydantic models.

These models are the single source of the API: the CRD manifests in `crds/` are generated
from them (`passthrough crds`), and the agent and operator parse and build objects with them.
Field names are the API's own (camelCase) so that code and manifests read alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from passthrough.api import reasons
from passthrough.api.names import (  # noqa: F401 (re-exported: the operator's code imports them from here)
    GROUP,
    VERSION,
    API_VERSION,
    DNS1123_LABEL,
    PCI_VENDOR_SELECTOR,
    PCI_ADDRESS,
    HEX4,
    HEX6,
    CAMEL_CASE_REASON,
    CONFIG_NAME,
    DNS1123_LABEL_MAX,
    DNS1123_SUBDOMAIN_MAX,
    QUALIFIED_NAME_MAX,
    UID_MAX,
    TIMESTAMP_MAX,
    PCI_IDS_NAME_MAX,
    DRIVER_MAX,
    CONDITION_TYPE_MAX,
    CONDITION_REASON_MAX,
    MESSAGE_MAX,
    MAX_CONDITIONS,
    MAX_LISTED_ITEMS,
    MAX_ALLOW_LIST,
    MAX_FEATURE_GATES,
    FEATURE_GATE_MAX,
    MAX_HOLDERS,
    NODE_PCI_DEVICE_KIND,
    NODE_PCI_DEVICE_PLURAL,
)


class APIModel(BaseModel):
    """Base of every API model: unknown fields are kept (a newer writer may add some)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Condition(APIModel):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str = Field(max_length=CONDITION_TYPE_MAX, description="Type of the condition.")
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds: True, False or Unknown.")
    reason: str = Field(
        pattern=CAMEL_CASE_REASON,
        max_length=CONDITION_REASON_MAX,
        description="Why the condition is in this state, in CamelCase.",
    )
    message: str = Field(default="", max_length=MESSAGE_MAX, description="What happened and what to do next.")
    lastTransitionTime: str = Field(
        max_length=TIMESTAMP_MAX,
        json_schema_extra={"format": "date-time"},
        description="When the status last changed.",
    )
    observedGeneration: int | None = Field(
        default=None, ge=0, description="The metadata.generation the condition was set for."
    )


def _reason(kind: str, *types: str) -> Any:
    """A condition's reason with every reason each of its types can have (api/reasons.py), so that
    `kubectl explain <kind>.status.conditions.reason` lists them: the reasons are the API."""
    listed = " ".join(f"{t}: {', '.join(reasons.of_condition(kind, t))}." for t in types)
    return Field(
        pattern=CAMEL_CASE_REASON,
        max_length=CONDITION_REASON_MAX,
        description=f"Why the condition is in this state, in CamelCase; the troubleshooting page says what each means "
                    f"and what to do. {listed}",
    )  # fmt: skip


# The condition types each kind carries, as `kubectl explain <kind>.status.conditions.type` tells them.
class NodePCIDeviceCondition(Condition):
    """A condition of a NodePCIDevice (metav1.Condition)."""

    type: str = Field(
        max_length=CONDITION_TYPE_MAX,
        description=(
            "Ready (the agent's word: the device is present and can be passed through; NotReady and "
            "NotFound say why not), Assigned (the operator's: its PCIDevice exists in spec.assignedNamespace) "
            "or Attached (a VirtualMachine lists it)."
        )
    )
    reason: str = _reason(NODE_PCI_DEVICE_KIND, "Ready", "Assigned", "Attached")


class PCIDeviceCondition(Condition):
    """A condition of a PCIDevice (metav1.Condition)."""

    type: str = Field(
        max_length=CONDITION_TYPE_MAX,
        description=(
            "Ready (the device's NodePCIDevice is Ready on its node) or Attached (a VirtualMachine of "
            "this namespace lists it, or one of another namespace still holds it)."
        )
    )
    reason: str = _reason("PCIDevice", "Ready", "Attached")


class PassthroughConfigCondition(Condition):
    """A condition of the PassthroughConfig (metav1.Condition)."""

    type: str = Field(
        max_length=CONDITION_TYPE_MAX,
        description=(
            "Valid (the values pass every check), Applied (the KubeVirt CR has the rendered "
            "permittedHostDevices and feature gates), AssignedDevicesPermitted (every assigned device "
            "has its entry in the allow-list) or NodesMatchAllowList (every GPU the nodes advertise "
            "is allow-listed)."
        )
    )
    reason: str = _reason("PassthroughConfig", "Valid", "Applied", "AssignedDevicesPermitted", "NodesMatchAllowList")


def _conditions(description: str) -> Any:
    return Field(
        default_factory=list,
        max_length=MAX_CONDITIONS,
        description=description,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )


def _defaulted(model: type[BaseModel], description: str) -> Any:
    # `default: {}` in the CRD as well: the API server then fills in the object's own fields'
    # defaults, so `kubectl get ptconfig` shows gpu.variant even when nobody wrote it.
    return Field(default_factory=model, description=description, json_schema_extra={"default": {}})


class PCIAttributes(APIModel):
    """What the node agent read from sysfs and pci.ids for one PCI function."""

    name: str = Field(default="", max_length=PCI_IDS_NAME_MAX, description="Device name from the node's pci.ids (hex ID when unknown).")
    vendorName: str = Field(default="", max_length=PCI_IDS_NAME_MAX, description="Vendor name from the node's pci.ids.")
    pciAddress: str = Field(pattern=PCI_ADDRESS, max_length=12, description="PCI address, e.g. 0000:3b:00.0.")
    vendorID: str = Field(pattern=HEX4, max_length=4, description="PCI vendor ID, 4 lowercase hex digits.")
    deviceID: str = Field(pattern=HEX4, max_length=4, description="PCI device ID, 4 lowercase hex digits.")
    subsystemVendorID: str = Field(default="", max_length=4, description="PCI subsystem vendor ID.")
    subsystemDeviceID: str = Field(default="", max_length=4, description="PCI subsystem device ID.")
    class_: str = Field(alias="class", pattern=HEX6, max_length=6, description="PCI class code, 6 hex digits.")
    driver: str = Field(default="", max_length=DRIVER_MAX, description="Kernel driver bound now; empty when none.")
    iommuGroup: int = Field(default=-1, ge=-1, description="IOMMU group; -1 when none.")
    numaNode: int = Field(default=-1, ge=-1, description="NUMA node; -1 when none.")
    nodeName: str = Field(max_length=DNS1123_SUBDOMAIN_MAX, description="Node the device is installed in.")


class NodePCIDeviceSpec(APIModel):
    """What an admin decides about the device: which namespace may use it."""

    assignedNamespace: str = Field(
        default="",
        max_length=DNS1123_LABEL_MAX,
        description=(
            "Namespace whose VMs may use this device. Empty: not assigned. "
            "Setting it creates a PCIDevice of the same name there."
        ),
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self == '' || self.matches('{DNS1123_LABEL}')",
                    "message": (
                        "must be empty or a namespace name (DNS-1123 label: lowercase "
                        "letters, digits and '-', starting and ending with a letter or digit)"
                    ),
                },
                {
                    "rule": "!(self in ['kube-system', 'kube-public', 'kube-node-lease'])",
                    "message": "is a system namespace; devices go to tenant namespaces where VMs run",
                },
            ]
        },
    )
    # No default: an object an admin never confirmed carries no such field (the API server would
    # otherwise add an empty one to every NodePCIDevice).
    confirmedNamespaceUID: str | None = Field(
        default=None,
        max_length=UID_MAX,
        description=(
            "The uid of the namespace a device admin confirms as the one meant by assignedNamespace. Needed, with "
            "the PassthroughConfig's devices.confirmNewNamespaces, when that namespace was created after the "
            "assignment (by a tenant, perhaps): until then the device waits (Assigned=False, NamespaceNotConfirmed, "
            "whose message has the command). It also gives the device to a namespace deleted and created again."
        ),
    )


class Holder(APIModel):
    """A pod that holds the device, as the node's kubelet tells it (PodResources)."""

    namespace: str = Field(max_length=DNS1123_LABEL_MAX, description="The pod's namespace.")
    pod: str = Field(max_length=DNS1123_SUBDOMAIN_MAX, description="The pod's name.")
    resource: str = Field(max_length=QUALIFIED_NAME_MAX, description="The extended resource it holds the device under.")


def _holders(description: str) -> Any:
    return Field(default_factory=list, max_length=MAX_HOLDERS, description=description)


class NamespaceRef(APIModel):
    """A namespace as it was when a device was handed to it."""

    name: str = Field(max_length=DNS1123_LABEL_MAX, description="Namespace name.")
    uid: str = Field(max_length=UID_MAX, description="The namespace's uid when the device was handed to it.")


class NodePCIDeviceStatus(APIModel):
    """What the node's agent reports about the device, and what the operator made of it."""

    attributes: PCIAttributes | None = None
    resourceName: str = Field(
        default="",
        max_length=QUALIFIED_NAME_MAX,
        description=(
            "Extended resource the node's device plugin advertises for this device: the GPU "
            "pool name, or passthrough.io/<name> once assigned; empty when it has none."
        ),
    )
    mode: Literal["", "Pool", "Exclusive"] = Field(
        default="", description="Pool: shared GPU pool. Exclusive: assigned to one namespace."
    )
    eligible: bool = Field(default=False, description="Whether the device can be passed through now.")
    missingSince: str | None = Field(
        default=None,
        max_length=TIMESTAMP_MAX,
        description=(
            "When the operator first saw the device NotFound on its node, by the operator's clock; "
            "an assigned device's grace period counts from here. Unset while the device is present."
        ),
    )
    nodeGoneSince: str | None = Field(
        default=None,
        max_length=TIMESTAMP_MAX,
        description=(
            "When the operator first saw the device's Node deleted, by the operator's clock; the "
            "NodePCIDevice is removed once the Node has stayed gone for the grace period. Unset while the Node exists."
        ),
    )
    assignedNamespaceRef: NamespaceRef | None = Field(
        default=None,
        description=(
            "The namespace the device was handed to, with its uid, recorded by the operator: a namespace "
            "deleted and created again under the same name does not inherit the device."
        ),
    )
    holders: list[Holder] = _holders(
        "The pods on the node that hold the device, by the kubelet's word at the agent's last scan (written by "
        "the agent). A device leaves a resource or a namespace only once no pod holds it under the old one."
    )
    conditions: list[NodePCIDeviceCondition] = _conditions(
        "Ready, Assigned and Attached: the agent writes Ready, the operator the other two."
    )


class PCIDeviceStatus(APIModel):
    """The assigned device as this namespace sees it, copied from its NodePCIDevice by the operator."""

    attributes: PCIAttributes | None = None
    nodeName: str = Field(default="", max_length=DNS1123_SUBDOMAIN_MAX, description="Node the device is installed in.")
    resourceName: str = Field(default="", max_length=QUALIFIED_NAME_MAX, description="Resource name a VM uses as deviceName.")
    attachedTo: str = Field(
        default="", max_length=MESSAGE_MAX, description="VirtualMachine whose spec lists this device (several: comma-separated)."
    )
    holders: list[Holder] = _holders(
        "This namespace's pods on the node that hold the device now. While a pod of another namespace does (of the "
        "namespace the device was assigned to before), no pod here gets it: Ready says HeldByPod without naming it, "
        "and the NodePCIDevice's status.holders names it for the admin."
    )
    conditions: list[PCIDeviceCondition] = _conditions(
        "Ready and Attached: whether a VM here can use the device now, and which VM does."
    )


class PciHostDevice(APIModel):
    """One pciHostDevices entry of KubeVirt's permittedHostDevices."""

    pciVendorSelector: str = Field(
        pattern=PCI_VENDOR_SELECTOR, max_length=9, description="vendor:device in hex, e.g. 10DE:2236."
    )
    resourceName: str = Field(
        min_length=1, max_length=QUALIFIED_NAME_MAX, description="Extended resource name, e.g. nvidia.com/GA102GL_A10."
    )
    externalResourceProvider: bool = Field(
        default=True, description="Leave allocation to an external device plugin (ours)."
    )


class MediatedHostDevice(APIModel):
    """One mediatedDevices entry of KubeVirt's permittedHostDevices."""

    mdevNameSelector: str = Field(min_length=1, max_length=PCI_IDS_NAME_MAX, description="mdev type name, e.g. 'GRID T4-1Q'.")
    resourceName: str = Field(min_length=1, max_length=QUALIFIED_NAME_MAX, description="Extended resource name.")
    externalResourceProvider: bool = Field(
        default=True,
        description="Leave allocation to an external device plugin (such as NVIDIA's vGPU plugin), not KubeVirt's own.",
    )


class PermittedHostDevices(APIModel):
    """Allow-list entries of the admin's, rendered into the KubeVirt CR's permittedHostDevices."""

    pciHostDevices: list[PciHostDevice] = Field(
        default_factory=list,
        max_length=MAX_ALLOW_LIST,
        description="Whole PCI devices (variant default): after the default NVIDIA table, or instead of it "
        "with replaceDefaults.",
    )
    mediatedDevices: list[MediatedHostDevice] = Field(
        default_factory=list, max_length=MAX_ALLOW_LIST, description="Mediated devices (variant vgpu), such as NVIDIA vGPU types."
    )


class KubeVirtTarget(APIModel):
    """The KubeVirt CR whose permittedHostDevices and feature gates the operator writes."""

    name: str = Field(default="kubevirt", max_length=DNS1123_SUBDOMAIN_MAX, description="Name of the KubeVirt CR to manage.")
    namespace: str = Field(default="kubevirt", max_length=DNS1123_LABEL_MAX, description="Namespace of the KubeVirt CR.")
    extraFeatureGates: list[Annotated[str, Field(max_length=FEATURE_GATE_MAX)]] = Field(
        default_factory=list, max_length=MAX_FEATURE_GATES, description="Feature gates to enable besides HostDevices."
    )


class NodeMediatedDeviceTypes(APIModel):
    """One nodeMediatedDeviceTypes entry of KubeVirt's mediatedDevicesConfiguration."""

    nodeSelector: dict[Annotated[str, Field(max_length=QUALIFIED_NAME_MAX)], Annotated[str, Field(max_length=DNS1123_LABEL_MAX)]] = Field(
        description="Node labels that pick the nodes these types are created on, e.g. nvidia.com/gpu.product: NVIDIA-L40S."
    )  # fmt: skip
    mediatedDeviceTypes: list[Annotated[str, Field(min_length=1, max_length=PCI_IDS_NAME_MAX)]] = Field(
        max_length=MAX_ALLOW_LIST,
        description="mdev type names (mdev_supported_types), e.g. nvidia-740; on these nodes they replace mediatedDeviceTypes.",
    )


class MediatedDevicesConfiguration(APIModel):
    """KubeVirt's mediatedDevicesConfiguration: which mdev types virt-handler creates, cluster-wide
    or on the nodes a selector picks."""

    mediatedDeviceTypes: list[Annotated[str, Field(min_length=1, max_length=PCI_IDS_NAME_MAX)]] = Field(
        default_factory=list, max_length=MAX_ALLOW_LIST, description="mdev type names created on every node, e.g. nvidia-740."
    )
    nodeMediatedDeviceTypes: list[NodeMediatedDeviceTypes] = Field(
        default_factory=list, max_length=MAX_ALLOW_LIST, description="mdev types for the nodes each selector picks."
    )


class GPUValues(APIModel):
    """How GPUs are given to VMs, and which models KubeVirt allows."""

    variant: Literal["default", "vgpu"] = Field(
        default="default",
        description="default: PCI passthrough of whole GPUs; vgpu: mediated devices.",
    )
    replaceDefaults: bool = Field(
        default=False, description="Drop the default NVIDIA table instead of appending to it."
    )
    permittedHostDevices: PermittedHostDevices = _defaulted(
        PermittedHostDevices, "Allow-list entries besides (or, with replaceDefaults, instead of) the default NVIDIA table."
    )
    mediatedDevicesConfiguration: MediatedDevicesConfiguration = Field(
        default_factory=MediatedDevicesConfiguration,
        description="The vGPU (mdev) types virt-handler creates on the nodes, written to the KubeVirt CR's "
        "mediatedDevicesConfiguration as is (Cozystack's kubevirt chart takes the same value). Empty: not written.",
    )


# Ten years: longer means "never", and no clock arithmetic overflows.
MAX_GRACE_SECONDS = 315_360_000


class DeviceSettings(APIModel):
    """How the operator treats namespace-assigned devices."""

    notFoundGracePeriodSeconds: int = Field(
        default=600,
        ge=0,
        le=MAX_GRACE_SECONDS,
        description=(
            "How long an assigned device missing from its node keeps its PCIDevice "
            "(kubelet and plugin restarts hide devices for about a minute, reboots for several)."
        ),
    )
    confirmNewNamespaces: bool = Field(
        default=False,
        description=(
            "For platforms where tenants create namespaces (Capsule, Rancher projects): a device assigned to a "
            "namespace that did not exist yet waits, once someone creates it, until a device admin confirms that "
            "namespace by its uid (the NodePCIDevice's spec.confirmedNamespaceUID). Devices already handed out stay."
        ),
    )


class DiscoverySettings(APIModel):
    """Which devices the node agents offer for passthrough, beyond DESIGN.md's rules.

    The chart gives every agent the same setting as a flag (--sriov-virtual-functions): an agent
    reads its flags, not this object, so a change here takes effect with the chart's next upgrade.
    """

    sriovVirtualFunctions: bool = Field(
        default=False,
        description=(
            "Report SR-IOV virtual functions and let them be assigned (a VF whose network interface was moved "
            "into a pod stays in use). Off: VFs are left out, as bridges are; a physical function with VFs "
            "enabled is never eligible either way, since unbinding it destroys its VFs."
        ),
    )


class DRASettings(APIModel):
    """Dynamic Resource Allocation (the chart's agent.devicePlugin.dra and perNode): the agents publish
    ResourceSlices instead of serving device plugins, and VMs ask through ResourceClaims; on every
    node, or on the nodes that choose it."""

    enabled: bool = Field(
        default=False,
        description=(
            "KubeVirt takes devices from ResourceClaims (its HostDevicesWithDRA and GPUsWithDRA gates are turned on), "
            "and an assigned device needs no permittedHostDevices entry of its own: none is written."
        ),
    )
    perNode: bool = Field(
        default=False,
        description=(
            "Nodes choose their mode with the label passthrough.io/mode (dra or device-plugin; `enabled` is the default "
            "of nodes without it): KubeVirt's DRA gates are turned on, and an assigned device gets its permittedHostDevices "
            "entry where its node's agent serves device plugins (the Node's passthrough.io/serving label)."
        ),
    )


class PassthroughConfigSpec(APIModel):
    """The platform values."""

    kubevirt: KubeVirtTarget = _defaulted(KubeVirtTarget, "The KubeVirt CR to configure, and extra feature gates.")
    gpu: GPUValues = _defaulted(GPUValues, "GPU variant and the KubeVirt allow-list (permittedHostDevices).")
    # Not defaulted in the CRD: without a `devices` section, the operator's --not-found-grace
    # applies (600 s unless set); one the API server filled in would always override it.
    devices: DeviceSettings = Field(default_factory=DeviceSettings, description="How assigned devices that go missing, and namespaces made after an assignment, are treated.")
    discovery: DiscoverySettings = _defaulted(DiscoverySettings, "Which devices the node agents offer, beyond the eligibility rules.")
    dra: DRASettings = _defaulted(DRASettings, "Dynamic Resource Allocation instead of device plugins.")


class AllowListMismatch(APIModel):
    """A disagreement between the allow-list and what nodes advertise."""

    # No defaults: the API server would fill every absent key with "" and the list would
    # read as noise. Absent means "not known for this kind of mismatch".
    resourceName: str = Field(max_length=QUALIFIED_NAME_MAX, description="The extended resource name in question.")
    pciVendorSelector: str | None = Field(default=None, max_length=9, description="vendor:device in hex, when known.")
    nodeName: str | None = Field(default=None, max_length=DNS1123_SUBDOMAIN_MAX, description="Node that advertises it, when one does.")
    pciAddress: str | None = Field(default=None, max_length=16, description="PCI address of the GPU on that node.")
    expected: str | None = Field(
        default=None, max_length=QUALIFIED_NAME_MAX, description="The allow-list's name for this card, when a node calls it otherwise."
    )


class LeftOutDevice(APIModel):
    """An assigned device KubeVirt's allow-list leaves out, and why."""

    name: str = Field(max_length=DNS1123_SUBDOMAIN_MAX, description="The NodePCIDevice (and PCIDevice) name.")
    reason: str = Field(max_length=MESSAGE_MAX, description="Why its passthrough.io/ entry cannot be written, and what to do.")


class PassthroughConfigStatus(APIModel):
    """What the operator rendered from the values, applied to KubeVirt, and found amiss."""

    observedGeneration: int | None = Field(default=None, description="The metadata.generation this status is for.")
    conditions: list[PassthroughConfigCondition] = _conditions(
        "Valid, Applied, AssignedDevicesPermitted and NodesMatchAllowList; a False one says what to fix."
    )
    featureGates: list[Annotated[str, Field(max_length=FEATURE_GATE_MAX)]] = Field(
        default_factory=list, max_length=2 * MAX_FEATURE_GATES, description="Feature gates applied."
    )
    pciHostDevices: int = Field(default=0, description="pciHostDevices entries applied.")
    mediatedDevices: int = Field(default=0, description="mediatedDevices entries applied.")
    warnings: list[Annotated[str, Field(max_length=MESSAGE_MAX)]] = Field(
        default_factory=list,
        max_length=MAX_LISTED_ITEMS,
        description="Values that are valid but probably not meant (an empty allow-list, ...).",
    )
    notAdvertised: list[AllowListMismatch] = Field(
        default_factory=list,
        max_length=MAX_LISTED_ITEMS,
        description="Resource names the values allow-list that no node advertises (the first 50): a misspelt "
        "name, or a card no node has. The default table's models are counted in unusedDefaultModels instead.",
    )
    notAdvertisedCount: int = Field(default=0, description="How many names of the values no node advertises.")
    unusedDefaultModels: int = Field(
        default=0,
        description="How many models of the default NVIDIA table no node advertises: expected on a cluster with "
        "few models, and listed nowhere so that they do not bury notAdvertised.",
    )
    notPermitted: list[AllowListMismatch] = Field(
        default_factory=list, max_length=MAX_LISTED_ITEMS, description="GPUs nodes advertise that the allow-list lacks (the first 50)."
    )
    notPermittedCount: int = Field(default=0, description="How many advertised GPUs the allow-list lacks.")
    leftOut: list[LeftOutDevice] = Field(
        default_factory=list,
        max_length=MAX_LISTED_ITEMS,
        description="Assigned devices whose exclusive entry is left out of the allow-list (the first 50); "
        "the rest of the allow-list is applied.",
    )
    leftOutCount: int = Field(default=0, description="How many assigned devices are left out of the allow-list.")


@dataclass(frozen=True)
class Resource:
    """Metadata of a custom resource kind: what the CRD needs beyond the schema."""

    kind: str
    plural: str
    singular: str
    short_names: list[str]
    scope: Literal["Cluster", "Namespaced"]
    spec_model: type[BaseModel] | None
    status_model: type[BaseModel]
    printer_columns: list[dict[str, Any]]
    description: str
    root_validations: list[dict[str, str]] = field(default_factory=list)

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


def _condition_column(name: str, type_: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{type_}")].status',
    }


_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}

NODE_PCI_DEVICE = Resource(
    kind=NODE_PCI_DEVICE_KIND,
    plural=NODE_PCI_DEVICE_PLURAL,
    singular="nodepcidevice",
    short_names=["npci"],
    scope="Cluster",
    spec_model=NodePCIDeviceSpec,
    status_model=NodePCIDeviceStatus,
    description="A PCI device of a node, reported by the node's agent; admins assign it to a namespace.",
    printer_columns=[
        {"name": "Node", "type": "string", "jsonPath": ".status.attributes.nodeName"},
        {"name": "Address", "type": "string", "jsonPath": ".status.attributes.pciAddress"},
        _condition_column("Ready", "Ready"),
        _condition_column("Assigned", "Assigned"),
        _condition_column("Attached", "Attached"),
        {"name": "Namespace", "type": "string", "jsonPath": ".spec.assignedNamespace"},
        _AGE,
        {"name": "Vendor", "type": "string", "jsonPath": ".status.attributes.vendorID", "priority": 1},
        {"name": "Device", "type": "string", "jsonPath": ".status.attributes.deviceID", "priority": 1},
        {"name": "Class", "type": "string", "jsonPath": ".status.attributes.class", "priority": 1},
        {"name": "Resource", "type": "string", "jsonPath": ".status.resourceName", "priority": 1},
        {"name": "Device-Name", "type": "string", "jsonPath": ".status.attributes.name", "priority": 1},
    ],
)

PCI_DEVICE = Resource(
    kind="PCIDevice",
    plural="pcidevices",
    singular="pcidevice",
    short_names=["pci"],
    scope="Namespaced",
    spec_model=None,
    status_model=PCIDeviceStatus,
    description="A PCI device assigned to this namespace; its VMs reference it by resource name.",
    printer_columns=[
        {"name": "Node", "type": "string", "jsonPath": ".status.nodeName"},
        {"name": "Address", "type": "string", "jsonPath": ".status.attributes.pciAddress"},
        # A tenant sees at a glance that a device of theirs cannot be used now.
        _condition_column("Ready", "Ready"),
        _condition_column("Attached", "Attached"),
        _AGE,
        {"name": "Vendor", "type": "string", "jsonPath": ".status.attributes.vendorID", "priority": 1},
        {"name": "Device", "type": "string", "jsonPath": ".status.attributes.deviceID", "priority": 1},
        {"name": "Class", "type": "string", "jsonPath": ".status.attributes.class", "priority": 1},
        {"name": "Resource", "type": "string", "jsonPath": ".status.resourceName", "priority": 1},
    ],
)

PASSTHROUGH_CONFIG = Resource(
    kind="PassthroughConfig",
    plural="passthroughconfigs",
    singular="passthroughconfig",
    short_names=["ptconfig"],
    scope="Cluster",
    spec_model=PassthroughConfigSpec,
    status_model=PassthroughConfigStatus,
    description=f"Platform values for PCI and GPU passthrough; a singleton named '{CONFIG_NAME}'.",
    printer_columns=[
        {"name": "Variant", "type": "string", "jsonPath": ".spec.gpu.variant"},
        _condition_column("Valid", "Valid"),
        _condition_column("Applied", "Applied"),
        {"name": "PCI-Host-Devices", "type": "integer", "jsonPath": ".status.pciHostDevices"},
        _AGE,
    ],
    root_validations=[
        {
            "rule": f"self.metadata.name == '{CONFIG_NAME}'",
            "message": f"there is one PassthroughConfig and it must be named '{CONFIG_NAME}'",
        }
    ],
)

RESOURCES = (NODE_PCI_DEVICE, PCI_DEVICE, PASSTHROUGH_CONFIG)
