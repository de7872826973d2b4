"""The views of our objects that the caches hold (api/views.py): what they keep, and what they share."""

from __future__ import annotations

import json

from passthrough.api import views
from passthrough.api.conditions import Cond
from tests.unit.test_lifecycle import ATTRS, NAME


def _watch_event_body(address: str) -> dict:
    """A NodePCIDevice as one watch event decodes it: every string its own copy."""
    body = {
        "metadata": {"name": f"pci-{address}", "uid": "u", "resourceVersion": "1", "finalizers": ["passthrough.io/in-use"]},
        "spec": {"assignedNamespace": "team-a"},
        "status": {
            "attributes": {**ATTRS, "pciAddress": address, "vendorName": "NVIDIA Corporation", "iommuGroup": 12},
            "resourceName": "nvidia.com/GA102GL_A10", "mode": "Pool",
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "The device can be passed through.",
                            "lastTransitionTime": "2026-11-29T11:00:00Z"}],
        },
    }
    return json.loads(json.dumps(body))


def test_views_of_many_devices_share_their_repeated_strings():
    one, other = views.NodeDevice.of(_watch_event_body("0000:3b:00.0")), views.NodeDevice.of(_watch_event_body("0000:5e:00.0"))
    key_one = next(k for k in one.attributes if k == "vendorName")
    key_other = next(k for k in other.attributes if k == "vendorName")
    assert key_one is key_other and one.attributes["vendorName"] is other.attributes["vendorName"]
    assert one.ready.message is other.ready.message and one.mode is other.mode and one.finalizers[0] is other.finalizers[0]
    # ...and lose nothing: the PCIDevice's status copies every attribute.
    assert dict(one.attributes) == _watch_event_body("0000:3b:00.0")["status"]["attributes"]
    assert one.ready == Cond("True", "Ready", "The device can be passed through.", "2026-11-29T11:00:00Z")
    assert one.handed_to is views.NOT_HANDED and one.node_name == "gpu-1"


def test_shared_interns_strings_at_every_depth_and_keeps_other_values():
    value = json.loads('{"a": [{"b": "x", "n": 3, "t": true, "z": null}], "c": {"d": "x"}}')
    out = views.shared(value)
    assert out == value
    assert out["a"][0]["b"] is out["c"]["d"]


def test_the_assignment_time_is_the_latest_write_of_spec_assigned_namespace_in_managed_fields():
    def entry(manager, time, fields, subresource=None):
        return {"manager": manager, "time": time, "fieldsV1": fields, **({"subresource": subresource} if subresource else {})}

    body = {"metadata": {"name": NAME, "managedFields": [
        entry("passthrough-agent", "2026-11-29T12:00:00Z", {"f:metadata": {"f:labels": {}}}),
        entry("kubectl-patch", "2026-11-29T11:00:00Z", {"f:spec": {"f:assignedNamespace": {}}}),
        entry("admin", "2026-11-29T11:05:00Z", {"f:spec": {"f:assignedNamespace": {}, "f:confirmedNamespaceUID": {}}}),
        entry("passthrough-operator", "2026-11-29T12:30:00Z", {"f:status": {}}, "status"),
    ]}, "spec": {"assignedNamespace": "team-a"}}  # fmt: skip
    assert views.NodeDevice.of(body).assigned_at == "2026-11-29T11:05:00Z"
    assert views.NodeDevice.of({**body, "spec": {}}).assigned_at == ""


def test_an_owner_of_the_assignment_that_owns_more_dates_it_no_later_than_the_object():
    """Its time moved with whatever else it changed since (a label, by the same `kubectl patch`):
    the assignment is then known only to be no older than the object itself."""
    body = {"metadata": {"name": NAME, "creationTimestamp": "2026-11-29T10:00:00Z", "managedFields": [
        {"manager": "kubectl-patch", "time": "2026-11-29T11:00:00Z", "fieldsV1": {"f:spec": {".": {}, "f:assignedNamespace": {}}}},
    ]}, "spec": {"assignedNamespace": "team-a"}}  # fmt: skip
    assert views.NodeDevice.of(body).assigned_at == "2026-11-29T11:00:00Z"
    body["metadata"]["managedFields"][0] = {"manager": "kubectl-patch", "time": "2026-11-29T12:00:00Z", "fieldsV1": {
        "f:metadata": {"f:labels": {"f:team": {}}}, "f:spec": {".": {}, "f:assignedNamespace": {}}}}  # fmt: skip
    assert views.NodeDevice.of(body).assigned_at == "2026-11-29T10:00:00Z"
