"""Every condition reason and Event reason the agent and the operator write, with what it means
and what to do about it.

One table, so that the troubleshooting page, `kubectl explain` and the code say the same: a unit
test (tests/unit/test_docs_reasons.py) reads the code for every reason it writes and fails on one
missing here, and on one here that the code never writes; the site's troubleshooting page is
generated from this table. Plain data: the agent may import it without pydantic.

`conditions`: where the reason appears as a condition's reason, "Kind/ConditionType".
`events`: where it appears as an Event's reason, "Kind/EventType" (Normal or Warning).
"""

from __future__ import annotations

from dataclasses import dataclass

NODE_PCI_DEVICE, PCI_DEVICE, CONFIG = "NodePCIDevice", "PCIDevice", "PassthroughConfig"
# In DRA mode the node's driver answers in a ResourceClaim's status.devices, per device.
RESOURCE_CLAIM = "ResourceClaim"
NODE = "Node"  # the agent's word on its node's mode, at start-up


@dataclass(frozen=True)
class Reason:
    meaning: str
    todo: str
    conditions: tuple[str, ...] = ()
    events: tuple[str, ...] = ()


_READY = (f"{NODE_PCI_DEVICE}/Ready", f"{PCI_DEVICE}/Ready")
# The agent's Ready reasons reach the tenant too: the PCIDevice's Ready is its NodePCIDevice's,
# and a change of it is an Event on the PCIDevice.
_NODE_SAYS = (f"{NODE_PCI_DEVICE}/Warning", f"{PCI_DEVICE}/Warning")
_NODE_WAITS = (f"{NODE_PCI_DEVICE}/Normal", f"{PCI_DEVICE}/Warning")

REASONS: dict[str, Reason] = {
    # -- the node's word on a device: Ready, written by the agent --------------------------------
    "Ready": Reason(
        "The device is eligible and, when assigned, bound to vfio-pci: it can be passed through.",
        "Nothing.",
        _READY, (f"{PCI_DEVICE}/Normal",),
    ),
    "NotReady": Reason(
        "The device cannot be passed through as it is (its message says why: a bridge, a device the host "
        "uses, a disk holding the root filesystem, no IOMMU group), or, with status Unknown, the agent has "
        "not reported it yet.",
        "Read the message: it names the cause. A device the host needs stays with the host; for Unknown, "
        "check that the agent runs on the node (kubectl -n <namespace> get pods -l app.kubernetes.io/component=agent).",
        _READY, (f"{PCI_DEVICE}/Warning",),
    ),
    "NotFound": Reason(
        "The node no longer has a device at this address (removed, hidden by a firmware or driver change, "
        "or the node booted without it). The object and its assignment are kept for the grace period.",
        "Put the device back, or unassign it; an unassigned device's object goes by itself.",
        _READY, _NODE_SAYS,
    ),
    "VfioNotLoaded": Reason(
        "The vfio-pci driver is not loaded on the node, so no device can be bound to it.",
        "Load it at boot (vfio-pci in /etc/modules-load.d/) or once (modprobe vfio-pci); the agent binds at "
        "its next scan.",
        _READY, _NODE_SAYS,
    ),
    "VendorDriverInUse": Reason(
        "The device's vendor driver (nvidia) holds it and has users: unbinding it would hang or take the "
        "GPU from them.",
        "Prepare the node instead: bind the GPU to vfio-pci at boot (vfio-pci.ids= on the kernel command line, "
        "driverctl set-override), or label the node for NVIDIA's GPU Operator's vm-passthrough workload.",
        _READY, _NODE_SAYS,
    ),
    "HeldByProcess": Reason(
        "/dev/vfio/<group> is open (a VMM or another process holds the IOMMU group): the device cannot be "
        "given back to its driver while it does.",
        "Nothing: it is given back once that process lets go. Stop the VM that holds it to hurry it.",
        _READY, _NODE_WAITS,
    ),
    "HeldUnknown": Reason(
        "The agent's binder cannot tell whether something holds the device's IOMMU group (/dev/vfio/<group> "
        "cannot be opened from the binder, and the members' enable counts cannot be read), so the group stays on "
        "vfio-pci: giving it back under a VM would pull the device out from under it.",
        "Give the agent's binder read access to the host's sysfs (the hostPath mounts the chart renders for it); "
        "the agent looks again at its next scan.",
        _READY, _NODE_SAYS,
    ),
    "HeldByPod": Reason(
        "Ready: a pod on the node holds the device under its previous resource or namespace: nobody else gets "
        "it until that pod ends. Attached: a pod holds the device (device-plugin mode: a plain pod that asks for "
        "its resource, or a VM's virt-launcher pod after its VM no longer lists it; DRA mode: a ResourceClaim of "
        "another namespace allocated it while it was in the pool, and still holds it after its assignment); the "
        "NodePCIDevice's message names it, a PCIDevice's does not.",
        "Ready: nothing, it follows its assignment once the pod ends; delete the pod (stop its VM) to hurry it. "
        "Attached: nothing; to free the device, delete the pod (in DRA mode, the claim's pods, or the claim).",
        (*_READY, f"{NODE_PCI_DEVICE}/Attached", f"{PCI_DEVICE}/Attached"), _NODE_WAITS,
    ),
    "WriteBlocked": Reason(
        "A sysfs write for the device (unbind, bind, driver_override) has not returned: the kernel or a "
        "driver is stuck on it.",
        "Find what holds the device (a process with its sound or GPU device open, a VMM) and stop it; the "
        "node's kernel log (dmesg) names the driver that waits. The agent carries on with other devices and "
        "tells when the write returns. Should the agent's binder container be restarted meanwhile (a crash, "
        "an OOM kill), it comes back only once the write returns: the kernel does not end a process blocked "
        "in it, and the runtime keeps a container until all its processes have ended; until then the agent "
        "pod's binder-standby container takes the node's new binds and give-backs, and what is bound stays "
        "served. A reboot clears a write stuck for good.",
        _READY, _NODE_SAYS,
    ),
    "BindFailed": Reason(
        "Moving the device's IOMMU group to vfio-pci (or back) failed; the message says which write and how, "
        "and the group was rolled back. In DRA mode, as a claim's VFIOBindFailed, the scheduler takes the "
        "allocation back and tries again where the device is no longer offered.",
        "Read the message and the node's kernel log; the agent tries again at its next scan.",
        (*_READY, f"{RESOURCE_CLAIM}/VFIOBindFailed"), _NODE_SAYS,
    ),
    "GiveBackFailed": Reason(
        "Giving the device back to its default driver failed after its unassignment.",
        "Read the message and the node's kernel log; bind the driver by hand (echo <address> > "
        "/sys/bus/pci/drivers/<driver>/bind) if the agent's retries do not.",
        _READY, _NODE_SAYS,
    ),
    "DeviceGone": Reason(
        "The device vanished from sysfs while the agent was binding or giving it back.",
        "Nothing, if it was removed on purpose; otherwise check the node (a hot-unplug, a PCIe link down).",
        _READY, _NODE_SAYS,
    ),
    "NotInGroup": Reason(
        "The device's IOMMU group changed between the scan and the bind.",
        "Nothing: the agent rescans and binds the group it finds then.",
        _READY, _NODE_SAYS,
    ),
    "VfioDeviceMissing": Reason(
        "The IOMMU group is on vfio-pci, but /dev/vfio/<group> did not appear.",
        "Check that the agent sees the host's /dev (its hostPath mount) and that devtmpfs or udev creates the node.",
        _READY, _NODE_SAYS,
    ),
    "OverrideDriverMissing": Reason(
        "The device has no driver: its driver_override names a driver that is not loaded.",
        "Load that driver (modprobe), or clear the override (driverctl unset-override <address>).",
        _READY, _NODE_SAYS,
    ),
    "Unhealthy": Reason(
        "A device the node serves cannot be used now: its IOMMU group is not viable, or a member of the group "
        "left the bus, reads all ones, lost its link or reported new AER errors. The kubelet is told, and no "
        "new pod gets it.",
        "Check the node's kernel log (dmesg) and the device; it is healthy again by itself once it answers (after "
        "AER errors, once its counters have stayed still for five minutes).",
        _READY, _NODE_SAYS,
    ),
    "ServedByOtherPlugin": Reason(
        "Another device plugin (NVIDIA's sandbox plugin, KubeVirt's own, SR-IOV's) or another DRA driver "
        "serves the device, or a member of its IOMMU group: one device, one server, so this agent neither "
        "binds nor serves it.",
        "Leave it to that server, or stop it serving this device (for NVIDIA's plugin, run this agent with "
        "--no-pool-resources, the coexistence mode).",
        _READY, _NODE_SAYS,
    ),
    "JobRefused": Reason(
        "The agent's binder container refused a bind or give-back job as malformed or not allowed (members that "
        "are not the IOMMU group's whole set, an override it may not set); nothing was written.",
        "Nothing to do on the device: the agent and its binder disagree, which a mismatched image or a "
        "compromised agent would cause. Check that both containers of the agent's pod run the same image, and "
        "read the agent's log.",
        _READY, _NODE_SAYS,
    ),
    "NotEligible": Reason(
        "The agent's binder refused to move the device to vfio-pci because discovery's rules keep it from "
        "passthrough (a disk in use, an interface that is up, a bridge, ...); nothing was written.",
        "Read the message: it names the cause, as the device's NotReady would. Free the device on the host, or "
        "leave it unassigned.",
        _READY, _NODE_SAYS,
    ),
    # -- DRA mode: the driver's answer in a claim's status.devices (binding conditions) ---------
    "GroupOnVFIO": Reason(
        "DRA mode: the driver bound the allocated device's whole IOMMU group to vfio-pci, so the scheduler may "
        "bind the claim's pod to the node (the device's binding condition VFIOBound).",
        "Nothing.",
        (f"{RESOURCE_CLAIM}/VFIOBound",),
    ),
    "Refused": Reason(
        "DRA mode: the driver refused the device allocated to the claim (the message says why: another server "
        "has it, it is not handed out to the claim's namespace, adminAccess asked for); the scheduler takes the "
        "allocation back and tries another device.",
        "Read the message in the claim's status.devices (kubectl get resourceclaim <name> -o yaml); claim through "
        "the namespace's DeviceClass, passthrough-<namespace>.",
        (f"{RESOURCE_CLAIM}/VFIOBindFailed",),
    ),
    "BoundToVfio": Reason(
        "The agent bound the device's IOMMU group to vfio-pci: it is ready for a VM.",
        "Nothing.",
        (), (f"{NODE_PCI_DEVICE}/Normal",),
    ),
    "GivenBack": Reason(
        "The agent gave the device back to its default driver after it left passthrough.",
        "Nothing.",
        (), (f"{NODE_PCI_DEVICE}/Normal",),
    ),
    # -- the assignment: Assigned on the NodePCIDevice, written by the operator ------------------
    "Assigned": Reason(
        "The device is handed out: the namespace has its PCIDevice, and VMs there use its deviceName.",
        "Nothing; use the deviceName the message gives in a VM's hostDevices.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Normal", f"{PCI_DEVICE}/Normal"),
    ),
    "Available": Reason(
        "Assigned: the device is not assigned to any namespace. Attached: nothing uses the device (no VM lists "
        "it, no claim is allocated it, no pod holds it).",
        "To hand it out: kubectl patch npci <name> --type=merge -p '{\"spec\":{\"assignedNamespace\":\"<namespace>\"}}' "
        "with a tenant namespace that exists. To use it: name its deviceName in a VM's hostDevices (or, in DRA "
        "mode, claim it).",
        (f"{NODE_PCI_DEVICE}/Assigned", f"{NODE_PCI_DEVICE}/Attached", f"{PCI_DEVICE}/Attached"),
        (f"{NODE_PCI_DEVICE}/Normal", f"{NODE_PCI_DEVICE}/Warning"),
    ),
    "InProgress": Reason(
        "An unassignment, reassignment or deletion waits for a VM or claim that still holds the device, or "
        "for the previous PCIDevice to finish terminating.",
        "Nothing: it completes once the holder named in the message drops the device. To finish it now, remove the "
        "device from that VM's spec (hostDevices) or delete the VM, or delete the claim.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Normal",),
    ),
    "NodeGone": Reason(
        "The device's Node object was deleted. The assignment and the PCIDevice are kept for the grace "
        "period, for a node that registers again under the same name.",
        "Bring the node back (it finds everything as it was), or let the grace period run out: the device's "
        "objects are then removed.",
        (f"{NODE_PCI_DEVICE}/Assigned", f"{PCI_DEVICE}/Ready"),
        (f"{NODE_PCI_DEVICE}/Warning", f"{PCI_DEVICE}/Warning"),
    ),
    "ServedByKubeVirt": Reason(
        "KubeVirt's own device plugin serves every device of this model on vfio-pci, to VMs of any "
        "namespace (its permittedHostDevices entry has externalResourceProvider: false): the device cannot "
        "be one namespace's alone.",
        "Set externalResourceProvider: true on that gpu.permittedHostDevices entry of the PassthroughConfig, "
        "or clear spec.assignedNamespace.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "NamespaceNotFound": Reason(
        "The device is assigned to a namespace that does not exist: no PCIDevice is made.",
        "Create the namespace (the device is handed out by itself then) or fix spec.assignedNamespace.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "NamespaceTerminating": Reason(
        "The namespace the device is assigned to is being deleted; its PCIDevice goes with it.",
        "Create the namespace again once it is gone, or assign the device elsewhere.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "SystemNamespace": Reason(
        "The device is assigned to a system namespace (kube-system, kube-public, kube-node-lease), which never "
        "receives devices (an object from before the CRD refused them).",
        "Assign it to a tenant namespace.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "DeviceMissing": Reason(
        "The assigned device has been missing from its node (Ready NotFound) for longer than the grace period: "
        "its PCIDevice was removed. The assignment stays.",
        "Put the device back (it is handed out again by itself), or unassign it.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "NamespaceRecreated": Reason(
        "The namespace was deleted and created again since the device was assigned to it: the new one does "
        "not inherit the device.",
        "Confirm the new namespace by its uid with the kubectl patch the message gives (spec.confirmedNamespaceUID), "
        "or clear spec.assignedNamespace and set it again.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "NamespaceNotConfirmed": Reason(
        "The PassthroughConfig sets devices.confirmNewNamespaces, and the namespace was created after the "
        "assignment: whoever created it gets the device only once a device admin confirms it.",
        "A device admin confirms it with the kubectl patch the message gives (spec.confirmedNamespaceUID), or "
        "clears spec.assignedNamespace.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "IOMMUGroupConflict": Reason(
        "Another device of the same IOMMU group is assigned to another namespace; VFIO gives a group to one "
        "VM, so all of its devices go to one namespace.",
        "Assign every device of the group to the same namespace (the message names the other one).",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "DeviceNotReady": Reason(
        "The device is assigned but its node has not reported it Ready; the message carries the node's reason.",
        "Fix what the Ready reason says (this table has it); the device is handed out by itself once Ready.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "AllowListNotApplied": Reason(
        "The PCIDevice exists, but KubeVirt's permittedHostDevices lacks the device's resource: VMs listing it "
        "get no pod.",
        "Look at the PassthroughConfig's conditions (kubectl get passthroughconfig cluster -o yaml): they say why "
        "the allow-list was not applied.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "NameMismatch": Reason(
        "The NodePCIDevice's name is not the one its attributes give (the agent did not write it under this "
        "name, or its attributes were edited): the operator ignores it.",
        "Delete it (kubectl delete npci <name>) and, if the device is real, assign the name the message gives, "
        "which its node's agent reports.",
        (f"{NODE_PCI_DEVICE}/Assigned",), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    "Collected": Reason(
        "The device's Node stayed gone longer than the grace period: its NodePCIDevice was deleted (the Event "
        "names the namespace it was assigned to).",
        "If the node returns, its agent reports the device again: assign it again.",
        (), (f"{NODE_PCI_DEVICE}/Warning",),
    ),
    # -- who uses the device: Attached, written by the operator ----------------------------------
    "AttachedToVirtualMachine": Reason(
        "A VirtualMachine of the namespace lists the device (the message names it and its pod).",
        "Nothing. To free the device, remove it from the VM's hostDevices or delete the VM.",
        (f"{NODE_PCI_DEVICE}/Attached", f"{PCI_DEVICE}/Attached"),
    ),
    "AllocatedToClaim": Reason(
        "DRA mode: a ResourceClaim is allocated the device (the message names the claim, and its pod or that "
        "one is still to come).",
        "Nothing. To free the device, delete the claim or the pods that use it.",
        (f"{NODE_PCI_DEVICE}/Attached", f"{PCI_DEVICE}/Attached"),
    ),
    "Attached": Reason(
        "A VM or claim started using the device.",
        "Nothing.",
        (), (f"{NODE_PCI_DEVICE}/Normal", f"{PCI_DEVICE}/Normal"),
    ),
    "Detached": Reason(
        "No VM or claim uses the device any more.",
        "Nothing.",
        (), (f"{NODE_PCI_DEVICE}/Normal", f"{PCI_DEVICE}/Normal"),
    ),
    "WaitingForRelease": Reason(
        "The device was reassigned while a VM or claim of its previous namespace holds it; one here wants it "
        "and waits (its pod stays Pending).",
        "In the previous namespace, remove the device from the spec of the VM the message names (or delete that "
        "VM, or the claim); the waiting one gets the device then.",
        (f"{PCI_DEVICE}/Attached",), (f"{NODE_PCI_DEVICE}/Warning", f"{PCI_DEVICE}/Warning"),
    ),
    "HeldElsewhere": Reason(
        "The device was reassigned while a VM or claim of its previous namespace holds it; nothing here asks "
        "for it yet.",
        "Nothing, unless a VM here needs it now: then the holder the message names must drop it (its VM's spec "
        "without the device, the VM or the claim deleted).",
        (f"{PCI_DEVICE}/Attached",), (f"{PCI_DEVICE}/Warning",),
    ),
    # -- the platform values: the PassthroughConfig's conditions ---------------------------------
    "Valid": Reason(
        "The PassthroughConfig's values are valid.",
        "Nothing.",
        (f"{CONFIG}/Valid",),
    ),
    "InvalidValues": Reason(
        "The PassthroughConfig's values are invalid (the message lists each problem); the last good "
        "configuration stays applied, or nothing is applied when there was none.",
        "Fix the values the message names (kubectl edit passthroughconfig cluster).",
        (f"{CONFIG}/Valid", f"{CONFIG}/Applied"), (f"{CONFIG}/Warning",),
    ),
    "WaitingForKubeVirt": Reason(
        "The KubeVirt CR that spec.kubevirt names does not exist (yet).",
        "Install KubeVirt, or set spec.kubevirt.name and namespace to the CR KubeVirt runs with.",
        (f"{CONFIG}/Applied",),
    ),
    "Applied": Reason(
        "KubeVirt's CR has the allow-list and feature gates the values render (as an Event: the operator "
        "just wrote them).",
        "Nothing.",
        (f"{CONFIG}/Applied",), (f"{CONFIG}/Normal",),
    ),
    "LastGoodApplied": Reason(
        "The values are invalid now; KubeVirt keeps the last good configuration.",
        "Fix the values (the Valid condition says what is wrong).",
        (f"{CONFIG}/Applied",),
    ),
    "AllPermitted": Reason(
        "Every assigned device has its passthrough.io/ entry in KubeVirt's allow-list.",
        "Nothing.",
        (f"{CONFIG}/AssignedDevicesPermitted",),
    ),
    "DevicesLeftOut": Reason(
        "Some assigned devices are left out of KubeVirt's allow-list (the rest is applied); VMs asking for "
        "them will not start. status.leftOut says why for each.",
        "Fix what status.leftOut names (often invalid values, or a device whose IDs cannot be read).",
        (f"{CONFIG}/AssignedDevicesPermitted",), (f"{CONFIG}/Warning",),
    ),
    "Match": Reason(
        "Every GPU the nodes advertise is in KubeVirt's allow-list.",
        "Nothing.",
        (f"{CONFIG}/NodesMatchAllowList",),
    ),
    "NotPermitted": Reason(
        "GPUs the nodes advertise are not in KubeVirt's allow-list; VMs asking for them will not start. "
        "status.notPermitted lists them.",
        "Add their models to gpu.permittedHostDevices in the PassthroughConfig, or leave them if no VM should "
        "have them.",
        (f"{CONFIG}/NodesMatchAllowList",), (f"{CONFIG}/Warning",),
    ),
    "NoAllowList": Reason(
        "The values render an empty permittedHostDevices, so KubeVirt checks no device names at all.",
        "List the models VMs may have in gpu.permittedHostDevices.",
        (f"{CONFIG}/NodesMatchAllowList",), (f"{CONFIG}/Warning",),
    ),
    "AllowListNotOurs": Reason(
        "KubeVirt's CR has a permittedHostDevices block another field manager wrote; it stays while the values "
        "are invalid.",
        "Fix the values; once they are valid the allow-list is theirs (a block written by hand or by GitOps is "
        "removed).",
        (f"{CONFIG}/NodesMatchAllowList",), (f"{CONFIG}/Warning",),
    ),
    "AllowListRemoved": Reason(
        "The operator removed a permittedHostDevices block another field manager wrote: the values' allow-list "
        "is empty, and the allow-list is the values'.",
        "List devices in gpu.permittedHostDevices to permit them; stop the other writer (a GitOps tool) from "
        "writing the block.",
        (), (f"{CONFIG}/Warning",),
    ),
    "Released": Reason(
        "spec.kubevirt names another KubeVirt CR now: the operator let go of the old one (its allow-list and "
        "the operator's feature gates).",
        "Nothing.",
        (), (f"{CONFIG}/Normal",),
    ),
    # -- a node's mode, where nodes choose (the Node's passthrough.io/mode label), said by its agent at start
    "ModeLabelNotFollowed": Reason(
        "The Node's passthrough.io/mode label names no mode (only dra and device-plugin do), or nodes do not "
        "choose their mode in this installation (the chart's agent.devicePlugin.perNode is false): the node's "
        "agent serves in the cluster's default mode.",
        "Set the label to dra or device-plugin, or remove it (with perNode false, set agent.devicePlugin.perNode="
        "true to let nodes choose), then restart the node's agent pod.",
        (), (f"{NODE}/Warning",),
    ),
    "ModeChangeWaiting": Reason(
        "The Node's passthrough.io/mode label asks for the other mode, but claims or pods (the message names "
        "them) still hold devices the node served in the mode it was in: it stays in that mode, so that no "
        "device is served both ways to two users.",
        "Let those pods end (move or stop their VMs), then restart the node's agent pod.",
        (), (f"{NODE}/Warning",),
    ),
}


def of_condition(kind: str, type_: str) -> list[str]:
    """The reasons a condition of `kind` and `type_` can have, in the table's order."""
    where = f"{kind}/{type_}"
    return [name for name, reason in REASONS.items() if where in reason.conditions]
