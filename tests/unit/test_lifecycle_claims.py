"""DRA mode: ResourceClaims as users of a device, without a cluster. What a claim's status says
(controller/allocations.py), and what the lifecycle makes of it: Attached naming the claim and
its pod, the claim holding the device as a VM does, and claims of namespaces the device was not
handed out to counting for nothing."""

from __future__ import annotations

import dataclasses

from hypothesis import given, strategies as st

from passthrough.api import views
from passthrough.controller import allocations, lifecycle as lc
from passthrough.controller.allocations import Allocation
from passthrough.controller.world import FINALIZER, ApplyDeviceStatus, World
from passthrough.dra.slice import DRIVER
from tests.unit.test_lifecycle import NAME, converge, node_device, npci_conditions, of, settle, world

POD = "virt-launcher-vm1-xyz"
GPU_CLAIM = Allocation("team-a", "gpu", (f"pod {POD}",))


def status(*results: dict, reserved_for: list | None = None) -> dict:
    return {"allocation": {"devices": {"results": list(results)}}, "reservedFor": reserved_for or []}


def result(device: str = "pci-0000-3b-00-0", pool: str = "gpu-1", driver: str = DRIVER, request: str = "gpu") -> dict:
    return {"driver": driver, "pool": pool, "device": device, "request": request}


# -- what a claim's status says ---------------------------------------------------------------


def test_a_claims_results_of_our_driver_are_found_by_node_and_the_devices_slice_name():
    found = allocations.allocated("team-a", "gpu", status(
        result(), result("gpu-0", driver="gpu.example.com"), result("pci-0000-af-00-0", request="nic"),
        reserved_for=[{"resource": "pods", "name": POD, "uid": "u1"}]))  # fmt: skip
    assert found == {("gpu-1", "pci-0000-3b-00-0"): GPU_CLAIM, ("gpu-1", "pci-0000-af-00-0"): GPU_CLAIM}
    # The key a NodePCIDevice is looked up by: its node, and its address as the slice names it.
    assert allocations.key("gpu-1", "0000:3B:00.0") == ("gpu-1", "pci-0000-3b-00-0")


def test_a_claim_allocated_but_reserved_for_no_pod_yet_has_no_consumers():
    assert allocations.allocated("team-a", "gpu", status(result())) == {("gpu-1", "pci-0000-3b-00-0"): Allocation("team-a", "gpu")}
    assert Allocation("team-a", "gpu").describe() == "ResourceClaim team-a/gpu"
    assert GPU_CLAIM.describe() == f"ResourceClaim team-a/gpu (pod {POD})"


def test_consumers_other_than_pods_are_named_by_their_resource():
    refs = [{"apiGroup": "example.com", "resource": "jobs", "name": "j"}, {"resource": "pods", "name": "p"}, {"name": ""}, "x"]
    assert allocations.consumers({"reservedFor": refs}) == ("jobs.example.com j", "pod p")


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
                        ["allocation", "devices", "results", "driver", "pool", "device", "reservedFor", "name",
                         "resource"]), inner, max_size=4), max_leaves=20))  # fmt: skip
def test_any_status_gives_allocations_or_nothing_never_an_error(raw):
    for where, claim in allocations.allocated("ns", "c", raw).items():
        assert all(isinstance(part, str) and part for part in where) and claim.namespace == "ns"


# -- what the lifecycle makes of it -----------------------------------------------------------


def claimed(w: World, *claims: Allocation) -> World:
    return dataclasses.replace(w, claims=claims)


def attached(device: views.Device) -> dict:
    return next(c for c in device.status["conditions"] if c["type"] == "Attached")


def test_a_claim_reserved_for_a_pod_attaches_the_device_naming_the_claim_and_the_pod():
    settled = converge(claimed(world(node_device("team-a")), GPU_CLAIM))
    [pcidev] = settled.devices
    message = f"Used by ResourceClaim team-a/gpu (pod {POD})."
    assert (attached(pcidev)["status"], attached(pcidev)["reason"], attached(pcidev)["message"]) == ("True", "AllocatedToClaim", message)
    assert settled.node_device.attached == lc.Cond("True", "AllocatedToClaim", message, settled.node_device.attached.lastTransitionTime)
    assert pcidev.status["attachedTo"] == ""  # the VMs whose spec lists it: none
    # It holds both objects, as a VM does.
    assert pcidev.metadata["finalizers"] == [FINALIZER] and FINALIZER in settled.node_device.finalizers


def test_a_claim_allocated_but_not_yet_reserved_says_it_waits_for_its_pod():
    settled = converge(claimed(world(node_device("team-a")), Allocation("team-a", "gpu")))
    node = settled.node_device.attached
    assert (node.status, node.reason) == ("True", "AllocatedToClaim")
    assert node.message == "Allocated to ResourceClaim team-a/gpu, waiting for its pod."
    # Its pod comes: the same condition (no flip), naming the pod.
    plan = lc.decide(claimed(settled, GPU_CLAIM))
    assert npci_conditions(plan)["Attached"]["message"] == f"Used by ResourceClaim team-a/gpu (pod {POD})."


def test_the_claim_let_go_detaches_and_releases_both_objects():
    settled = converge(claimed(world(node_device("team-a")), GPU_CLAIM))
    released = converge(claimed(settled))
    [pcidev] = released.devices
    assert (attached(pcidev)["status"], attached(pcidev)["reason"]) == ("False", "Available")
    assert released.node_device.attached.status == "False"
    assert pcidev.metadata["finalizers"] == [] and FINALIZER not in released.node_device.finalizers
    detached = [e for e in lc.decide(claimed(settled)).events if e.reason == "Detached"]
    assert {e.kind for e in detached} == {"NodePCIDevice", "PCIDevice"}


def test_a_vm_and_a_claim_are_both_named_and_the_vm_gives_the_reason():
    settled = converge(claimed(world(node_device("team-a"), vms={"team-a": ("vm-1",)}), GPU_CLAIM))
    assert settled.node_device.attached.reason == "AttachedToVirtualMachine"
    assert settled.node_device.attached.message == f"Used by VirtualMachine team-a/vm-1; ResourceClaim team-a/gpu (pod {POD})."


def test_a_claim_of_a_namespace_the_device_was_not_handed_to_counts_for_nothing():
    """An allocation the webhook should have refused (or one made while the device was in the pool):
    it is no user and keeps nothing; the admin reads its hold on the NodePCIDevice, never as AllocatedToClaim."""
    settled = converge(claimed(world(node_device("team-a")), Allocation("team-b", "stolen", ("pod thief",))))
    [pcidev] = settled.devices
    assert attached(pcidev)["status"] == "False" and "team-b" not in attached(pcidev)["message"]
    assert settled.node_device.attached.reason == "HeldByPod"
    assert pcidev.metadata["finalizers"] == [] and FINALIZER not in settled.node_device.finalizers


def test_reassigning_a_device_a_claim_holds_keeps_the_old_pcidevice_and_the_new_namespace_waits():
    settled = converge(claimed(world(node_device("team-a")), GPU_CLAIM))
    moved = converge(dataclasses.replace(settled, node_device=dataclasses.replace(settled.node_device, assigned_namespace="team-b")))
    by_ns = {d.namespace: d for d in moved.devices}
    assert by_ns["team-a"].deleting and by_ns["team-a"].metadata["finalizers"] == [FINALIZER]
    held = attached(by_ns["team-b"])
    assert (held["status"], held["reason"]) == ("False", "HeldElsewhere")
    assert "team-a" not in held["message"] and "Still held by a VM or claim of the namespace the device was assigned to before" in held["message"]
    assert held["message"].endswith("waits until it lets go.")
    # Who waits is told in the mode's words: without DRA mode, a VM that asks for the device's name.
    assert "a VM here that asks for passthrough.io/" in held["message"] and "claim" not in held["message"].split(";")[1]
    assert "stays until ResourceClaim team-a/gpu" in moved.node_device.assigned.message
    assert FINALIZER in moved.node_device.finalizers
    # A claim of team-b meanwhile (the scheduler gives an allocated device to no other claim, but
    # were it written): it waits, with a Warning.
    both = claimed(moved, GPU_CLAIM, Allocation("team-b", "next"))
    plan = lc.decide(both)
    [new] = of(plan, ApplyDeviceStatus)
    waiting = next(c for c in new.body["status"]["conditions"] if c["type"] == "Attached")
    assert waiting["reason"] == "WaitingForRelease" and "ResourceClaim team-b/next waits" in waiting["message"]
    assert any(e.type == "Warning" and e.reason == "WaitingForRelease" for e in plan.events)
    # team-a's claim lets go: the old PCIDevice goes, and the device is team-b's alone.
    released = converge(claimed(moved))
    assert [d.namespace for d in released.devices] == ["team-b"]
    assert FINALIZER not in released.node_device.finalizers


def test_a_pool_gpu_names_the_claim_of_any_namespace_on_its_node_device_and_holds_nothing():
    settled = converge(claimed(world(node_device("")), Allocation("team-c", "pool-gpu", ("pod p",))))
    assert settled.devices == ()
    assert settled.node_device.attached.status == "True" and settled.node_device.attached.reason == "AllocatedToClaim"
    assert settled.node_device.attached.message == "Used by ResourceClaim team-c/pool-gpu (pod p)."
    assert FINALIZER not in settled.node_device.finalizers


def test_a_pool_claim_still_holding_the_gpu_after_its_assignment_is_reported_as_a_pool_pod_would_be():
    """Device-plugin mode names a pool pod that still holds a device after its assignment
    (HeldByPod) on the NodePCIDevice, and the namespace's PCIDevice says it waits without naming
    it: a pool claim the same. It holds nothing (no finalizer), as it did in the pool."""
    settled = converge(claimed(world(node_device("team-a")), Allocation("team-c", "pool-gpu", ("pod p",))))
    assert (settled.node_device.attached.status, settled.node_device.attached.reason) == ("True", "HeldByPod")
    assert settled.node_device.attached.message == (
        "Held by ResourceClaim team-c/pool-gpu (pod p), allocated while it was in the pool (no VirtualMachine lists it).")
    [pcidev] = settled.devices
    assert (attached(pcidev)["status"], attached(pcidev)["reason"]) == ("False", "HeldByPod")
    assert "team-c" not in attached(pcidev)["message"] and "pool-gpu" not in attached(pcidev)["message"]
    assert f"NodePCIDevice {settled.node_device.name}" in attached(pcidev)["message"]
    assert FINALIZER not in settled.node_device.finalizers and pcidev.metadata["finalizers"] == []
    # The claim lets go: nothing left to report, the device is team-a's to use.
    released = converge(claimed(settled))
    assert released.node_device.attached.reason == "Available" and attached(released.devices[0])["reason"] == "Available"
    # A claim of the namespace it is assigned to is that namespace's user, not a leftover of the pool.
    own = converge(claimed(world(node_device("team-a")), GPU_CLAIM))
    assert own.node_device.attached.reason == "AllocatedToClaim"


def test_in_dra_mode_an_unused_device_points_the_tenant_to_its_namespaces_device_class():
    dra = dataclasses.replace(world(node_device("team-a")), device_class="passthrough-team-a")
    [pcidev] = converge(dra).devices
    assert (attached(pcidev)["reason"], attached(pcidev)["message"]) == ("Available", (
        "No VirtualMachine, claim or pod uses this device; claim it with a ResourceClaim request of deviceClassName "
        "passthrough-team-a, named in a VM's gpus or hostDevices (claimName)."))  # fmt: skip
    # Without DRA mode, the device plugins' way: the VM's hostDevices.
    [pcidev] = converge(world(node_device("team-a"))).devices
    assert "set deviceName passthrough.io/" in attached(pcidev)["message"]


def test_in_dra_mode_a_device_held_elsewhere_tells_of_a_claim_of_the_class_not_a_device_name():
    settled = converge(claimed(dataclasses.replace(world(node_device("team-a")), device_class="passthrough-team-a"), GPU_CLAIM))
    moved = converge(dataclasses.replace(settled, node_device=dataclasses.replace(settled.node_device, assigned_namespace="team-b"),
                                         device_class="passthrough-team-b"))  # fmt: skip
    held = attached({d.namespace: d for d in moved.devices}["team-b"])
    assert held["reason"] == "HeldElsewhere"
    assert "; a claim here of DeviceClass passthrough-team-b waits until it lets go" in held["message"], held
    assert "passthrough.io/" not in held["message"]


def test_in_dra_mode_assigned_and_its_event_name_the_device_class_not_a_device_name():
    dra = dataclasses.replace(world(node_device("team-a")), device_class="passthrough-team-a")
    plan = lc.decide(dra)
    assigned = npci_conditions(plan)["Assigned"]
    assert assigned["reason"] == "Assigned"
    assert assigned["message"].endswith("; claim it with a ResourceClaim request of deviceClassName passthrough-team-a, "
                                        "named in a VM's gpus or hostDevices (claimName).")  # fmt: skip
    assert "deviceName passthrough.io/" not in assigned["message"]
    [event] = [e for e in plan.events if e.kind == "PCIDevice" and e.reason == "Assigned"]
    assert "deviceClassName passthrough-team-a" in event.message and "deviceName passthrough.io/" not in event.message
    # Device-plugin mode: the VM's hostDevices, in both.
    plan = lc.decide(world(node_device("team-a")))
    assert "set deviceName passthrough.io/" in npci_conditions(plan)["Assigned"]["message"]
    [event] = [e for e in plan.events if e.kind == "PCIDevice" and e.reason == "Assigned"]
    assert "set deviceName passthrough.io/" in event.message
