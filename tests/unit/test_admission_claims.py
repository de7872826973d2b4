"""Claims stay in their namespace: the DRA admission decisions, without a cluster."""

from __future__ import annotations

from passthrough.admission import claims
from passthrough.api.views import NodeDevice
from passthrough.dra.slice import DRIVER

NODE = "gpu-1"
GPU, AUDIO, OTHER = "0000:af:00.0", "0000:af:00.1", "0000:3b:00.0"
NS, NS_UID = "team-a", "uid-team-a"
READY = {"type": "Ready", "status": "True", "reason": "Ready", "message": ""}
NOT_FOUND = {"type": "Ready", "status": "False", "reason": "NotFound", "message": ""}


def node_device(address: str, assigned: str = "", handed: tuple[str, str] | None = None, group: int = 21,
                mode: str = "Pool", resource: str = "nvidia.com/GA102GL_A10", ready: dict = READY, name: str = "") -> NodeDevice:  # fmt: skip
    """A NodePCIDevice of node gpu-1; `handed` (namespace, uid) as the operator records it, with Assigned=True."""
    conditions = [ready]
    status = {"attributes": {"pciAddress": address, "nodeName": NODE, "iommuGroup": group}, "mode": mode, "resourceName": resource}
    if handed:
        status["assignedNamespaceRef"] = {"name": handed[0], "uid": handed[1]}
        conditions.append({"type": "Assigned", "status": "True", "reason": "Assigned", "message": ""})
    status["conditions"] = conditions
    return NodeDevice.of({"metadata": {"name": name or f"pci-{address}"}, "spec": {"assignedNamespace": assigned}, "status": status})


def why(device: str, node_devices, namespace: str = NS, uid: str = NS_UID, gpu_mode: bool = False) -> str:
    return claims.why_not(namespace, uid, NODE, device, node_devices, gpu_mode)


def result(device: str = "pci-0000-af-00-0", driver: str = DRIVER, **more) -> dict:
    return {"request": "gpu", "driver": driver, "pool": NODE, "device": device, **more}


def status(*results: dict) -> dict:
    return {"allocation": {"devices": {"results": list(results)}, "nodeSelector": {}}}


# -- which devices a namespace may be allocated -----------------------------------------------


def test_a_device_handed_out_to_the_claims_namespace_may_be_allocated_to_it():
    assert why("pci-0000-af-00-0", [node_device(GPU, NS, (NS, NS_UID))]) == ""


def test_a_device_handed_out_to_another_namespace_is_not_for_the_claim():
    reason = why("pci-0000-af-00-0", [node_device(GPU, "team-b", ("team-b", "uid-b"))])
    assert "handed out to team-b" in reason and "not to team-a" in reason


def test_a_namespace_made_again_under_the_same_name_does_not_inherit_the_device():
    assert "handed out to team-a (uid uid-team-a), not to team-a (uid uid-new)" in why(
        "pci-0000-af-00-0", [node_device(GPU, NS, (NS, NS_UID))], uid="uid-new")


def test_a_device_assigned_but_not_handed_out_yet_is_for_nobody():
    # The spec names team-a, the operator has not recorded the hand-out: neither team-a nor the pool.
    reason = why("pci-0000-af-00-0", [node_device(GPU, NS)], gpu_mode=True)
    assert "assigned to a namespace" in reason


def test_an_unknown_device_is_refused():
    assert "no NodePCIDevice of node gpu-1 is device pci-0000-ff-00-0" in why("pci-0000-ff-00-0", [node_device(GPU)])
    assert why("pci-0000-af-00-0", []) != ""


def test_an_unassigned_gpu_of_a_node_in_gpu_mode_is_the_pool_any_namespace_may_have():
    node = [node_device(GPU), node_device(AUDIO, mode="", resource="")]
    assert why("pci-0000-af-00-0", node, gpu_mode=True) == ""
    assert why("pci-0000-af-00-0", node, namespace="team-b", uid="uid-b", gpu_mode=True) == ""


def test_a_pool_gpu_is_for_nobody_when_the_node_is_not_in_gpu_mode_or_it_is_not_ready():
    assert "not in GPU passthrough mode" in why("pci-0000-af-00-0", [node_device(GPU)])
    not_ready = {"type": "Ready", "status": "False", "reason": "NotReady", "message": "ineligible"}
    assert "not Ready" in why("pci-0000-af-00-0", [node_device(GPU, ready=not_ready)], gpu_mode=True)


def test_an_unassigned_device_that_is_not_a_pool_gpu_is_for_nobody():
    assert "not a pool GPU" in why("pci-0000-3b-00-0", [node_device(OTHER, mode="", resource="")], gpu_mode=True)


def test_a_gpu_whose_iommu_group_has_an_assigned_member_is_not_pooled():
    # The group is the unit: its audio function assigned to team-b keeps the GPU out of the pool.
    node = [node_device(GPU), node_device(AUDIO, "team-b", ("team-b", "uid-b"), mode="Exclusive", resource="passthrough.io/x")]
    assert "member of its IOMMU group 21 is assigned" in why("pci-0000-af-00-0", node, gpu_mode=True)
    # A device of another group is no obstacle.
    node = [node_device(GPU), node_device(OTHER, "team-b", ("team-b", "uid-b"), group=7)]
    assert why("pci-0000-af-00-0", node, gpu_mode=True) == ""


def test_a_device_reported_again_with_other_ids_is_judged_by_the_present_one():
    gone = node_device(GPU, "team-b", ("team-b", "uid-b"), ready=NOT_FOUND, name="pci-old")
    present = node_device(GPU, NS, (NS, NS_UID), name="pci-new")
    assert why("pci-0000-af-00-0", [gone, present]) == ""
    assert why("pci-0000-af-00-0", [gone, present], namespace="team-b", uid="uid-b") != ""


# -- what a status update allocates -----------------------------------------------------------


def test_only_what_an_update_newly_allocates_of_our_driver_is_judged():
    ours, theirs = result(), result(driver="gpu.example.com", device="gpu-0")
    assert claims.added_results({}, status(ours, theirs)) == [ours]
    assert claims.added_results(None, status(theirs)) == []
    # The kubelet's or the scheduler's later writes leave the allocation as it was: not judged again.
    assert claims.added_results(status(ours), {**status(ours), "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}) == []
    # Deallocation allocates nothing.
    assert claims.added_results(status(ours), {}) == []


def test_malformed_statuses_allocate_nothing_and_never_raise():
    for bad in (None, "x", 3, [], {"allocation": "x"}, {"allocation": {"devices": {"results": "x"}}},
                {"allocation": {"devices": {"results": ["x", None, 3]}}}):  # fmt: skip
        assert claims.added_results({}, bad) == []


def test_an_allocation_of_another_namespaces_device_is_refused_without_naming_whose_it_is():
    verdict = claims.judge_allocation("team-b", "stolen", [result()], {(NODE, "pci-0000-af-00-0"): "handed out to team-a"})
    assert not verdict.allowed
    assert "ResourceClaim team-b/stolen: device pci-0000-af-00-0 of node gpu-1 is not one the passthrough operator" in verdict.refusal
    assert "team-a" not in verdict.refusal
    assert claims.judge_allocation("team-a", "vm", [result()], {}).allowed


def test_admin_access_in_an_allocation_of_ours_is_refused_even_for_the_namespaces_own_device():
    verdict = claims.judge_allocation(NS, "peek", [result(adminAccess=True)], {})
    assert "adminAccess" in verdict.refusal


# -- the claim ---------------------------------------------------------------------------------


def devices(*requests: dict) -> dict:
    return {"requests": list(requests)}


def test_admin_access_to_a_passthrough_class_is_refused_with_what_to_do():
    spec = devices({"name": "gpu", "exactly": {"deviceClassName": "passthrough-team-a", "adminAccess": True}})
    verdict = claims.judge_claim("ResourceClaim", NS, "peek", spec)
    assert verdict.refusal.startswith("ResourceClaim team-a/peek: request gpu asks for adminAccess to DeviceClass passthrough-team-a")
    assert "remove adminAccess" in verdict.refusal


def test_admin_access_to_other_classes_and_passthrough_classes_without_it_pass():
    assert claims.judge_claim("ResourceClaim", NS, "x", devices({"name": "a", "exactly": {"deviceClassName": "gpu.example.com", "adminAccess": True}})).allowed
    assert claims.judge_claim("ResourceClaim", NS, "x", devices({"name": "a", "exactly": {"deviceClassName": "passthrough-team-a"}})).allowed
    sub = {"name": "a", "firstAvailable": [{"name": "one", "deviceClassName": "passthrough-team-a"}]}
    assert claims.requests(devices(sub)) == [("a/one", "passthrough-team-a", False)]
    assert claims.judge_claim("ResourceClaim", NS, "x", devices(sub)).allowed


def test_a_template_is_judged_by_its_claims_spec():
    spec = {"spec": {"devices": devices({"name": "gpu", "exactly": {"deviceClassName": "passthrough-x", "adminAccess": True}})}}
    assert not claims.judge_claim("ResourceClaimTemplate", NS, "t", claims.template_devices(spec)).allowed


def test_malformed_claims_are_judged_without_raising():
    for bad in (None, "x", {"requests": "x"}, {"requests": [None, "x", {"exactly": "x"}, {"firstAvailable": [None]}]}):
        assert claims.judge_claim("ResourceClaim", NS, "x", bad).allowed
    assert claims.template_devices("x") is None


def test_a_claim_naming_another_namespaces_class_is_refused_its_own_admitted():
    spec = devices({"name": "gpu", "exactly": {"deviceClassName": "passthrough-team-a"}},
                   {"name": "alt", "firstAvailable": [{"name": "x", "deviceClassName": "passthrough-team-a"}]})  # fmt: skip
    verdict = claims.judge_claim("ResourceClaim", "team-b", "stolen", spec)
    assert verdict.refusal == (
        "ResourceClaim team-b/stolen: request gpu names DeviceClass passthrough-team-a, which selects the devices of "
        "another namespace; a claim of team-b names passthrough-team-b, which the operator makes once a device is "
        "assigned to team-b, or passthrough-pool.gpu for an unassigned GPU; request alt/x names DeviceClass "
        "passthrough-team-a, which selects the devices of another namespace; a claim of team-b names "
        "passthrough-team-b, which the operator makes once a device is assigned to team-b, or passthrough-pool.gpu "
        "for an unassigned GPU."
    )
    assert claims.judge_claim("ResourceClaim", "team-a", "vm", spec).allowed


def test_the_owner_of_a_class_follows_from_its_name_alone():
    assert claims.class_owner("passthrough-team-a") == "team-a"  # whether the class exists yet or not
    # The pool's class, names no namespace can have, and other classes: nobody's.
    for name in (claims.POOL_CLASS, "passthrough-", "passthrough-Team", "passthrough-a.b", "passthrough-" + "a" * 64, "gpu.example.com"):
        assert claims.class_owner(name) == "", name
    # A passthrough- class that is no namespace's is judged only for adminAccess.
    odd = devices({"name": "gpu", "exactly": {"deviceClassName": "passthrough-a.b"}})
    assert claims.judge_claim("ResourceClaim", "team-b", "x", odd).allowed


# -- steering a claim to the devices it may have ----------------------------------------------


def test_steering_keeps_a_request_to_its_namespaces_devices_and_the_pools_and_leaves_other_drivers_alone():
    expression = claims.steering("team-b")["cel"]["expression"]
    assert expression == (f'device.driver != "{DRIVER}" || device.attributes["passthrough.io"].namespace == "team-b" '
                          '|| device.attributes["passthrough.io"].namespace == ""')  # fmt: skip


def test_each_request_and_subrequest_through_another_class_is_steered_once():
    mine = claims.steering("team-b")
    own = {"cel": {"expression": "device.attributes['x'].model == 'A10'"}}
    devices = {"requests": [
        {"name": "any", "exactly": {"deviceClassName": "gpus", "selectors": [own], "count": 2}},
        {"name": "first", "firstAvailable": [{"name": "a", "deviceClassName": "gpus"}, {"name": "p", "deviceClassName": claims.POOL_CLASS}]},
        {"name": "pool", "exactly": {"deviceClassName": "passthrough-team-b"}},
    ], "constraints": [{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]}  # fmt: skip
    steered = claims.steer("team-b", devices)
    assert steered["requests"][0]["exactly"] == {"deviceClassName": "gpus", "selectors": [own, mine], "count": 2}
    assert steered["requests"][1]["firstAvailable"] == [
        {"name": "a", "deviceClassName": "gpus", "selectors": [mine]}, {"name": "p", "deviceClassName": claims.POOL_CLASS}]
    # A passthrough- class already keeps to one namespace's devices (or the pool's).
    assert steered["requests"][2] == devices["requests"][2]
    assert steered["constraints"] == devices["constraints"]
    # The claim kube-controller-manager makes from a steered template is left as it is.
    assert claims.steer("team-b", steered) == steered
    assert devices["requests"][0]["exactly"]["selectors"] == [own]  # the input is not changed


def test_nothing_to_steer_in_a_claim_without_devices():
    assert claims.steer("team-b", None) is None
    assert claims.steer("team-b", {}) == {}
