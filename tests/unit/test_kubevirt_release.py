"""What lets go of the KubeVirt CR never leaves spec.configuration with nothing in it (the API
server would write it as null, which KubeVirt's schema refuses), and the uninstall's error says
what the API server said."""

from __future__ import annotations

import json

from passthrough.controller.kubevirt_sync import KubeVirtView, needs_apply, release
from passthrough.controller.uninstall import api_error_text
from passthrough.kube.client import ApiError
from passthrough.kubevirt.render import GATES_ANNOTATION, render
from passthrough.kubevirt.values import parse_values

ALL_OURS = frozenset({"pciHostDevices", "featureGates", GATES_ANNOTATION})


def view(gates: tuple[str, ...], owned: frozenset[str] = ALL_OURS, ours: tuple[str, ...] | None = ("HostDevices",)) -> KubeVirtView:
    return KubeVirtView("kubevirt", "kubevirt", "uid", ({"pciVendorSelector": "10DE:2236"},), None, gates, owned, "1", ours)


def test_letting_go_of_every_gate_keeps_an_empty_list_so_the_configuration_stays_an_object():
    body = release(view(("HostDevices",)))
    assert body is not None and body["spec"] == {"configuration": {"developerConfiguration": {"featureGates": []}}}
    assert "annotations" not in body["metadata"]  # our record goes with our gates


def test_the_gates_of_others_stay_in_their_order():
    body = release(view(("HostDevices", "Snapshot", "VMExport")))
    assert body is not None and body["spec"]["configuration"]["developerConfiguration"]["featureGates"] == ["Snapshot", "VMExport"]


def test_a_cr_already_let_go_of_is_not_written_again():
    # What a release leaves: the empty list still ours, the allow-list and the record gone.
    assert release(view((), owned=frozenset({"featureGates"}), ours=None), recorded_gates=["HostDevices"]) is None


def test_a_cr_whose_gates_were_never_ours_is_left_without_a_gates_list_of_ours():
    body = release(view(("Snapshot",), owned=frozenset({"pciHostDevices"}), ours=None))
    assert body is not None and "spec" not in body  # featureGates is another manager's: not ours to write


def test_values_that_render_nothing_still_write_a_configuration_object():
    # No allow-list and the one gate of ours disabled: the apply still holds a (empty) gates list.
    spec = parse_values({"gpu": {"replaceDefaults": True}})
    patch = render(spec, disabled_gates=["HostDevices"]).patch
    assert patch["spec"]["configuration"] == {"developerConfiguration": {"featureGates": []}}


def test_an_api_error_says_the_api_servers_message_and_the_causes_it_leaves_out():
    status = {"kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
              "message": 'KubeVirt.kubevirt.io "kubevirt" is invalid: spec.configuration: Invalid value: "null": '
                         "spec.configuration in body must be of type object: \"null\"",
              "details": {"name": "kubevirt", "group": "kubevirt.io", "kind": "KubeVirt",
                          "causes": [{"reason": "FieldValueTypeInvalid", "field": "spec.configuration",
                                      "message": 'Invalid value: "null": spec.configuration in body must be of type object: "null"'},
                                     {"reason": "FieldValueRequired", "field": "spec.other", "message": "Required value"}]}}  # fmt: skip
    text = api_error_text(ApiError(422, "Unprocessable Entity", json.dumps(status)))
    assert text == (f"422 Unprocessable Entity: {status['message']}: spec.other: Required value")


def test_an_api_error_without_a_status_says_what_came_back():
    assert api_error_text(ApiError(502, "Bad Gateway", "upstream connect error\n")) == "502 Bad Gateway: upstream connect error"
    assert api_error_text(ApiError(500, "Internal Server Error")) == "500 Internal Server Error"


def test_an_empty_gates_list_already_applied_is_not_applied_again():
    rendered = render(parse_values({"gpu": {"replaceDefaults": True}}), disabled_gates=["HostDevices"])
    live = KubeVirtView("kubevirt", "kubevirt", "uid", None, None, (), frozenset({"featureGates", GATES_ANNOTATION}), "1", ())
    assert not needs_apply(rendered, live)
    assert needs_apply(rendered, KubeVirtView("kubevirt", "kubevirt", "uid", None, None, ("HostDevices",),
                                              frozenset({"featureGates", GATES_ANNOTATION}), "1", ("HostDevices",)))  # fmt: skip
