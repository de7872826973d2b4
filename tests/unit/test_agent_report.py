"""What the agent writes per device, and when it writes nothing."""

from __future__ import annotations

import dataclasses

from e2e.support import gpu
from passthrough.agent import report

NODE = report.Node("gpu-1", "node-uid")


def live_after_apply(body: dict) -> dict:
    """The object as the API server returns it: the schema's defaults filled in."""
    status = {**body["status"]}
    status["attributes"] = {"vendorName": "", "subsystemVendorID": "", "subsystemDeviceID": "", **status["attributes"]}
    return {"metadata": {"name": body["metadata"]["name"]}, "status": status}


def test_an_unchanged_device_needs_no_write_even_with_server_defaults():
    device = gpu("0000:3b:00.0")
    name = report.object_name(device, NODE.name)
    desired = report.present_status(device, name, NODE.name, "")
    live = live_after_apply(report.status_body(name, desired, None))
    assert not report.changed(desired, live)


def test_a_changed_driver_or_eligibility_is_a_write():
    device = gpu("0000:3b:00.0")
    name = report.object_name(device, NODE.name)
    live = live_after_apply(report.status_body(name, report.present_status(device, name, NODE.name, ""), None))
    rebound = gpu("0000:3b:00.0").__class__(**{**device.__dict__, "driver": "nvidia"})
    assert report.changed(report.present_status(rebound, name, NODE.name, ""), live)
    busy = device.__class__(**{**device.__dict__, "eligible": False, "reason": "network interface eth0 is up"})
    assert report.changed(report.present_status(busy, name, NODE.name, ""), live)


def test_assignment_swaps_the_pool_name_for_the_exclusive_one():
    device = gpu("0000:3b:00.0")
    name = report.object_name(device, NODE.name)
    pooled = report.present_status(device, name, NODE.name, "")
    assigned = report.present_status(device, name, NODE.name, "team-a")
    assert (pooled["resourceName"], pooled["mode"]) == ("nvidia.com/GA102GL_A10", "Pool")
    assert (assigned["resourceName"], assigned["mode"]) == (f"passthrough.io/{name}", "Exclusive")


def test_a_missing_device_keeps_its_attributes_and_says_where_it_was():
    device = gpu("0000:3b:00.0")
    name = report.object_name(device, NODE.name)
    live = live_after_apply(report.status_body(name, report.present_status(device, name, NODE.name, ""), None))
    gone = report.missing_status(live, NODE.name)
    [ready] = gone["conditions"]
    assert (ready["status"], ready["reason"]) == ("False", "NotFound")
    assert "0000:3b:00.0" in ready["message"] and "gpu-1" in ready["message"]
    assert gone["attributes"] == live["status"]["attributes"]


def test_a_device_gone_before_its_first_status_landed_is_marked_with_what_the_agent_reported():
    # The object was made, the answer to its status write lost (a server hanging up), then the
    # device went: the API server refuses a status without attributes, for ever.
    device = gpu("0000:3b:00.0")
    name = report.object_name(device, NODE.name)
    bare = {"metadata": {"name": name, "resourceVersion": "5"}}
    known = report.present_status(device, name, NODE.name, "")["attributes"]
    gone = report.missing_status(bare, NODE.name, known)
    assert gone["attributes"]["pciAddress"] == "0000:3b:00.0" and gone["conditions"][0]["reason"] == "NotFound"
    assert report.missing_status(bare, NODE.name) is None  # nothing known (a restarted agent): nothing to write


def test_transition_time_moves_only_when_the_status_flips():
    device = gpu("0000:3b:00.0")
    name = report.object_name(device, NODE.name)
    first = report.status_body(name, report.present_status(device, name, NODE.name, ""), None)
    live = live_after_apply(first)
    live["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T00:00:00Z"
    again = report.status_body(name, report.present_status(device, name, NODE.name, "team-a"), live)
    assert again["status"]["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    flipped = report.status_body(name, report.missing_status(live, NODE.name), live)
    assert flipped["status"]["conditions"][0]["lastTransitionTime"] != "2026-01-01T00:00:00Z"


def test_identity_names_the_node_but_is_not_owned_by_it():
    # Owned by its Node, `kubectl delete node` made the garbage collector take the admin's
    # assignments with it; a node that registers again (a new uid) must keep them.
    body = report.identity("pci-x", NODE)
    assert "ownerReferences" not in body["metadata"]
    assert body["metadata"]["labels"] == {"passthrough.io/node": "gpu-1"}
    assert report.has_identity(body, NODE)
    assert report.has_identity(body, report.Node("gpu-1", "a-new-uid"))  # the Node was re-created


def test_an_object_an_older_agent_gave_to_its_node_is_applied_again():
    live = report.identity("pci-x", NODE)
    live["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "node-uid"}]
    assert not report.has_identity(live, NODE)  # the apply without the field removes it


def test_names_the_api_server_would_refuse_are_made_writable_not_fatal():
    # A driver link named with a byte that is not UTF-8, a pci.ids name past the CRD's bound:
    # the agent's write must still be an object the API server takes (the loop never crashes).
    from passthrough.api.models import DRIVER_MAX, PCI_IDS_NAME_MAX

    device = dataclasses.replace(gpu("0000:3b:00.0"), driver="nv\udcffidia", name="A" * (PCI_IDS_NAME_MAX + 50))
    attributes = report.attributes(device, "node-a")
    assert attributes["driver"] == "nv\ufffdidia" and len(attributes["driver"]) <= DRIVER_MAX
    assert attributes["name"] == "A" * PCI_IDS_NAME_MAX


def test_the_attributes_the_agent_writes_are_the_schemas_every_field_and_valid():
    from passthrough.api.models import PCIAttributes

    for device in (gpu("0000:3b:00.0"), dataclasses.replace(gpu("0000:af:00.1"), driver="", iommu_group=-1, numa_node=-1)):
        attributes = report.attributes(device, "node-a")
        # Every field of the schema, none else, each as the model would write it.
        assert PCIAttributes.model_validate(attributes).model_dump(by_alias=True) == attributes


def test_a_device_is_handed_out_only_when_the_operator_says_so_for_the_namespace_the_spec_names():
    def npci(spec: str, ref: dict | None, assigned: str) -> dict:
        return {"spec": {"assignedNamespace": spec},
                "status": {"assignedNamespaceRef": ref, "conditions": [{"type": "Assigned", "status": assigned}]}}  # fmt: skip

    team_a = {"name": "team-a", "uid": "u-a"}
    assert report.handed_out(npci("team-a", team_a, "True")) == "team-a"
    assert report.handed_out(npci("team-a", team_a, "False")) == ""  # waiting: a conflict, no namespace yet
    assert report.handed_out(npci("team-b", team_a, "True")) == ""  # reassigned: not yet handed to team-b
    assert report.handed_out(npci("team-a", None, "True")) == ""
    assert report.handed_out(npci("", team_a, "True")) == ""  # unassigned
    assert report.handed_out({"metadata": {"name": "x"}}) == ""


def test_a_pod_asks_for_a_resource_in_its_limits_or_requests_of_any_container():
    pod = {"spec": {"initContainers": [{"resources": {"requests": {"passthrough.io/pci-a": "1"}}}],
                    "containers": [{"resources": {"limits": {"passthrough.io/pci-b": "1"}}}, {}]}}  # fmt: skip
    assert report.requests(pod, "passthrough.io/pci-a") and report.requests(pod, "passthrough.io/pci-b")
    assert not report.requests(pod, "passthrough.io/pci-c") and not report.requests({}, "passthrough.io/pci-a")


def test_the_pods_that_hold_a_device_are_reported_and_a_kubelet_that_cannot_say_changes_nothing():
    from passthrough.deviceplugin.holder import Holder

    device = gpu("0000:3b:00.0")
    name = report.object_name(device, NODE.name)
    held = [Holder("team-a", "virt-launcher-vm1", f"passthrough.io/{name}")] * 2  # two containers of one pod
    desired = report.present_status(device, name, NODE.name, "team-a", holders=held)
    body = report.status_body(name, desired, None)
    assert body["status"]["holders"] == [{"namespace": "team-a", "pod": "virt-launcher-vm1", "resource": f"passthrough.io/{name}"}]
    live = live_after_apply(body)
    assert not report.changed(desired, live)
    # The kubelet cannot be asked this scan: the object keeps what it said, no write for that.
    unknown = report.present_status(device, name, NODE.name, "team-a", holders=None)
    assert not report.changed(unknown, live)
    assert report.status_body(name, unknown, live)["status"]["holders"] == body["status"]["holders"]
    # The pod ended: a write, which leaves the field out (server-side apply removes it).
    free = report.present_status(device, name, NODE.name, "team-a", holders=())
    assert report.changed(free, live) and "holders" not in report.status_body(name, free, live)["status"]
    assert not report.changed(free, live_after_apply(report.status_body(name, free, live)))
    # Never more than the CRD takes.
    many = [Holder("ns", f"pod-{i:03d}", "r") for i in range(100)]
    assert len(report.present_status(device, name, NODE.name, "", holders=many)["holders"]) == 16
