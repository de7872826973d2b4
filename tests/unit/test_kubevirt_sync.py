"""The operator's KubeVirt sync as a plan: one apply when something changes, none otherwise."""

from __future__ import annotations

import dataclasses
import datetime

from passthrough.controller.kubevirt_sync import (ConfigView, KubeVirtView, advertised, assigned_devices, needs_apply, on_device_plugin_nodes, plan_sync,
                                                  release)
from passthrough.api.views import Device, NodeDevice
from passthrough.kubevirt.allowlist import AssignedDevice
from passthrough.kubevirt.mismatches import Advertised
from passthrough.kubevirt.render import GATES_ANNOTATION
from passthrough.pci.naming import node_pci_device_name

NOW = datetime.datetime(2026, 11, 29, 12, 0, tzinfo=datetime.UTC)


def config(spec=None, status=None, generation=1) -> ConfigView:
    return ConfigView("cluster", "uid", generation, spec or {}, status or {})


def fields_v1(body) -> dict:
    """What an apply of `body` makes the manager own, as the API server writes it in
    managedFields (maps field by field, KubeVirt's lists atomic: the list as a whole)."""
    if not isinstance(body, dict):
        return {}
    return {f"f:{k}": fields_v1(v) for k, v in body.items() if k not in ("apiVersion", "kind", "name", "namespace")}


def kubevirt_after(plan, owned=None) -> KubeVirtView:
    """The CR once the plan's apply landed (the apply's fields owned by our manager, or only `owned`)."""
    managed = [{"manager": "passthrough-operator", "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": fields_v1(plan.apply)}]
    view = KubeVirtView.of({**plan.apply, "metadata": {**plan.apply["metadata"], "managedFields": managed}})
    return view if owned is None else dataclasses.replace(view, owned=frozenset(owned))


def status_after(plan) -> dict:
    return plan.status["status"]


def test_no_config_means_kubevirt_is_not_ours_to_touch():
    plan = plan_sync(None, KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset()), [], [], None, NOW)
    assert plan.apply is None and plan.status is None


def test_first_sync_applies_and_a_second_writes_nothing():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, ("Snapshot",), frozenset())
    first = plan_sync(config(), live, [], [], None, NOW)
    assert first.apply is not None and first.status is not None
    second = plan_sync(config(status=status_after(first)), kubevirt_after(first), [], [], first.rendered, NOW)
    assert second.apply is None and second.status is None and second.events == []


def test_a_hand_edit_of_our_list_is_seen():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    first = plan_sync(config(), live, [], [], None, NOW)
    edited = kubevirt_after(first)
    edited = KubeVirtView(edited.namespace, edited.name, "", edited.pci_host_devices[:-1], None, edited.feature_gates, edited.owned)
    assert needs_apply(first.rendered, edited)


def test_an_emptied_allow_list_lets_go_of_what_we_owned():
    first = plan_sync(config(), KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset()), [], [], None, NOW)
    owned = kubevirt_after(first)
    emptied = plan_sync(config({"gpu": {"replaceDefaults": True}}, status_after(first)), owned, [], [], first.rendered, NOW)
    assert emptied.apply is not None and "permittedHostDevices" not in emptied.apply["spec"]["configuration"]
    # A block someone else owns stays theirs: nothing to write about it.
    theirs = dataclasses.replace(owned, owned=frozenset({"featureGates", GATES_ANNOTATION}))
    assert not needs_apply(emptied.rendered, theirs)


def test_bad_values_keep_the_last_good_configuration():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    good = plan_sync(config(), live, [], [], None, NOW)
    bad_spec = {"gpu": {"permittedHostDevices": {"pciHostDevices": [{"pciVendorSelector": "10DE:2236", "resourceName": "nvidia.com/A10"}]}}}
    bad = plan_sync(config(bad_spec, status_after(good), generation=2), kubevirt_after(good), [], [], good.rendered, NOW)
    assert bad.apply is None and bad.rendered is None
    conditions = {c["type"]: c for c in status_after(bad)["conditions"]}
    assert conditions["Valid"]["status"] == "False" and "nvidia.com/GA102GL_A10" in conditions["Valid"]["message"]
    assert conditions["Applied"]["reason"] == "LastGoodApplied"
    assert ("Warning", "InvalidValues") in [(t, r) for t, r, _ in bad.events]


def test_assigned_devices_and_an_older_node_show_up():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    assigned = [AssignedDevice("pci-abc", "10de", "2236")]
    old_node = [Advertised("old-1", "0000:3b:00.0", "10de", "2321", "nvidia.com/GH100")]
    plan = plan_sync(config(), live, assigned, old_node, None, NOW)
    entries = plan.apply["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
    assert entries[-1] == {"pciVendorSelector": "10DE:2236", "resourceName": "passthrough.io/pci-abc", "externalResourceProvider": True}
    status = status_after(plan)
    assert status["notPermittedCount"] == 1
    assert status["notPermitted"] == [{"resourceName": "nvidia.com/GH100", "pciVendorSelector": "10DE:2321", "nodeName": "old-1",
                                       "pciAddress": "0000:3b:00.0", "expected": "nvidia.com/GH100_H100L_94GB"}]
    match = {c["type"]: c for c in status["conditions"]}["NodesMatchAllowList"]
    assert match["status"] == "False" and "old-1" in match["message"]


def test_waiting_for_a_missing_kubevirt_cr():
    plan = plan_sync(config({"kubevirt": {"name": "kv", "namespace": "virt"}}), None, [], [], None, NOW)
    applied = {c["type"]: c for c in status_after(plan)["conditions"]}["Applied"]
    assert applied["reason"] == "WaitingForKubeVirt" and "virt/kv" in applied["message"]
    assert plan.apply is None


# -- which PCIDevices give allow-list entries --------------------------------------------------


def node_device(name: str, uid: str, vendor: str = "10de", device: str = "2236") -> NodeDevice:
    return NodeDevice.of({"metadata": {"name": name, "uid": uid},
                          "status": {"attributes": {"vendorID": vendor, "deviceID": device, "nodeName": "n1"}}})  # fmt: skip


def pci_device(name: str, namespace: str, owner_uid: str | None, vendor: str = "10de", device: str = "2236") -> Device:
    owners = [{"apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice", "name": name, "uid": owner_uid,
               "controller": True}] if owner_uid else []  # fmt: skip
    return Device.of({"metadata": {"name": name, "namespace": namespace, "ownerReferences": owners},
                      "status": {"attributes": {"vendorID": vendor, "deviceID": device}}})  # fmt: skip


def test_only_pcidevices_the_operator_made_give_allow_list_entries():
    live = {"pci-a": node_device("pci-a", "uid-a")}
    made = pci_device("pci-a", "team-a", "uid-a")
    assert assigned_devices([made], live) == [AssignedDevice("pci-a", "10de", "2236")]
    # Written by someone else: no owner, an owner of an older object of that name, or no such device.
    assert assigned_devices([pci_device("pci-a", "team-b", None)], live) == []
    assert assigned_devices([pci_device("pci-a", "team-b", "uid-old")], live) == []
    assert assigned_devices([pci_device("pci-zzz", "team-b", "uid-a")], live) == []


def test_allow_list_ids_come_from_the_node_device_not_from_the_pcidevice():
    live = {"pci-a": node_device("pci-a", "uid-a", "10de", "2236")}
    lying = pci_device("pci-a", "team-a", "uid-a", vendor="zzzz", device="not-hex")
    assert assigned_devices([lying], live) == [AssignedDevice("pci-a", "10de", "2236")]


def test_a_device_in_two_namespaces_during_a_reassignment_is_one_entry():
    live = {"pci-a": node_device("pci-a", "uid-a")}
    both = [pci_device("pci-a", "team-a", "uid-a"), pci_device("pci-a", "team-b", "uid-a")]
    assert assigned_devices(both, live) == [AssignedDevice("pci-a", "10de", "2236")]


def pooled_gpu(node: str, ready: str, reason: str, name: str = "") -> NodeDevice:
    attributes = {"pciAddress": "0000:3b:00.0", "vendorID": "10de", "deviceID": "2236", "nodeName": node}
    name = name or node_pci_device_name("0000:3b:00.0", "10de", "2236", node)
    return NodeDevice.of({
        "metadata": {"name": name, "uid": name},
        "status": {"resourceName": "nvidia.com/GA102GL_A10", "mode": "Pool", "attributes": attributes,
                   "conditions": [{"type": "Ready", "status": ready, "reason": reason}]},
    })  # fmt: skip


def test_only_ready_pooled_gpus_count_as_advertised():
    devices = [pooled_gpu("ready", "True", "Ready"), pooled_gpu("busy", "False", "NotReady"),
               pooled_gpu("gone", "False", "NotFound"), pooled_gpu("unbound", "False", "VfioNotLoaded")]  # fmt: skip
    assert [(a.node, a.resource_name) for a in advertised(devices)] == [("ready", "nvidia.com/GA102GL_A10")]


def test_an_object_not_named_by_its_attributes_does_not_count_as_advertised():
    # Another node's name taken (an agent that writes what it should not), or a hand-made object.
    taken = node_pci_device_name("0000:3b:00.0", "10de", "2236", "other-node")
    devices = [pooled_gpu("n1", "True", "Ready", name=taken), pooled_gpu("n2", "True", "Ready", name="pci-by-hand")]
    assert advertised(devices) == []


# -- one assignment KubeVirt cannot take ------------------------------------------------------

SERVED_BY_KUBEVIRT = {"gpu": {"replaceDefaults": True, "permittedHostDevices": {"pciHostDevices": [
    {"pciVendorSelector": "10DE:2236", "resourceName": "nvidia.com/A10", "externalResourceProvider": False},
    {"pciVendorSelector": "1AF4:1000", "resourceName": "example.com/virtio"},
]}}}  # fmt: skip
NIC = AssignedDevice("pci-nic", "8086", "1592")


def conditions_of(plan) -> dict:
    return {c["type"]: c for c in status_after(plan)["conditions"]}


def test_an_assignment_of_a_model_kubevirt_serves_itself_leaves_out_only_that_device():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    plan = plan_sync(config(SERVED_BY_KUBEVIRT), live, [AssignedDevice("pci-a10", "10de", "2236"), NIC], [], None, NOW)
    entries = plan.apply["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
    assert [e["resourceName"] for e in entries] == ["nvidia.com/A10", "example.com/virtio", "passthrough.io/pci-nic"]
    assert list(plan.unapplied) == ["pci-a10"] and "externalResourceProvider: false" in plan.unapplied["pci-a10"]
    conditions = conditions_of(plan)
    assert conditions["Valid"]["status"] == "True" and conditions["Applied"]["reason"] == "Applied"
    left_out = conditions["AssignedDevicesPermitted"]
    assert (left_out["status"], left_out["reason"]) == ("False", "DevicesLeftOut")
    assert "pci-a10" in left_out["message"] and "status.leftOut" in left_out["message"]
    assert status_after(plan)["leftOut"] == [{"name": "pci-a10", "reason": plan.unapplied["pci-a10"]}]
    assert status_after(plan)["leftOutCount"] == 1
    assert [(t, r) for t, r, _ in plan.events if t == "Warning"] == [("Warning", "DevicesLeftOut")]
    # Said once: the next sync writes nothing and tells nothing.
    again = plan_sync(config(SERVED_BY_KUBEVIRT, status_after(plan)), kubevirt_after(plan),
                      [AssignedDevice("pci-a10", "10de", "2236"), NIC], [], plan.rendered, NOW)  # fmt: skip
    assert again.apply is None and again.status is None and again.events == []
    assert again.unapplied == plan.unapplied


def test_an_assignment_with_an_over_long_name_leaves_out_only_that_device():
    long = "pci-" + "b" * 70
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    plan = plan_sync(config(SERVED_BY_KUBEVIRT), live, [AssignedDevice(long, "8086", "1592"), NIC], [], None, NOW)
    entries = plan.apply["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
    assert [e["resourceName"] for e in entries] == ["nvidia.com/A10", "example.com/virtio", "passthrough.io/pci-nic"]
    assert list(plan.unapplied) == [long] and "too long for a device plugin" in plan.unapplied[long]
    assert conditions_of(plan)["Valid"]["status"] == "True"
    assert conditions_of(plan)["AssignedDevicesPermitted"]["reason"] == "DevicesLeftOut"


def test_a_left_out_device_unassigned_clears_the_warning():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    bad = plan_sync(config(SERVED_BY_KUBEVIRT), live, [AssignedDevice("pci-a10", "10de", "2236"), NIC], [], None, NOW)
    fixed = plan_sync(config(SERVED_BY_KUBEVIRT, status_after(bad)), kubevirt_after(bad), [NIC], [], bad.rendered, NOW)
    assert fixed.apply is None and fixed.unapplied == {}
    assert conditions_of(fixed)["AssignedDevicesPermitted"]["status"] == "True"
    assert status_after(fixed)["leftOut"] == [] and status_after(fixed)["leftOutCount"] == 0
    assert [t for t, _, _ in fixed.events] == []


def test_a_misspelt_name_of_the_values_is_not_buried_under_the_unused_default_models():
    from passthrough.kubevirt.allowlist import default_table

    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    spec = {"gpu": {"permittedHostDevices": {"pciHostDevices": [
        {"pciVendorSelector": "10DE:2BB5", "resourceName": "nvidia.com/RTX_PRO_6000_TYPO"}]}}}
    a10 = [Advertised("gpu-1", "0000:3b:00.0", "10de", "2236", "nvidia.com/GA102GL_A10")]
    status = status_after(plan_sync(config(spec), live, [], a10, None, NOW))
    assert status["notAdvertised"] == [{"resourceName": "nvidia.com/RTX_PRO_6000_TYPO", "pciVendorSelector": "10DE:2BB5"}]
    assert status["notAdvertisedCount"] == 1
    # Every default model but the A10 is advertised by no node: counted, not listed.
    pooled = [d for d in default_table() if d.get("externalResourceProvider", True)]
    assert status["unusedDefaultModels"] == len(pooled) - 1 > 10


def test_the_models_kubevirt_serves_itself_come_from_the_rendered_allow_list_or_before_it_the_values():
    from passthrough.controller.kubevirt_sync import served_by_kubevirt

    values = config(SERVED_BY_KUBEVIRT)
    assert served_by_kubevirt(None, None) == {}
    before = served_by_kubevirt(values, None)
    assert before == {"10de:2236": "nvidia.com/A10"}
    plan = plan_sync(values, KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset()), [], [], None, NOW)
    assert served_by_kubevirt(values, plan.rendered) == before
    # The values changed but are invalid: KubeVirt keeps the last good allow-list, and so do we.
    assert served_by_kubevirt(config({"gpu": {"variant": "nonsense"}}), plan.rendered) == before


def test_the_config_warns_well_before_the_kubevirt_cr_reaches_etcds_limit():
    import hashlib

    def devices(count: int) -> list[AssignedDevice]:
        return [AssignedDevice(f"pci-{hashlib.sha1(str(i).encode()).hexdigest()}", "10de", "2236") for i in range(count)]

    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    small = plan_sync(config(), live, devices(1000), [], None, NOW)
    assert not any("etcd" in w for w in status_after(small)["warnings"])
    # About 7,400 devices make our part 1 MiB: two thirds of etcd's 1.5 MiB, 3,000 devices before it.
    big = plan_sync(config(), live, devices(7500), [], None, NOW)
    (warning,) = [w for w in status_after(big)["warnings"] if "etcd" in w]
    assert big.rendered.size > 2**20 and f"{big.rendered.size / 2**20:.2f} MiB" in warning
    assert "7519 pciHostDevices entries, 7500 of them assigned devices' own" in warning
    room = int(warning.split("about ")[1].split(" more assigned devices")[0])
    assert 2500 < room < 3500, warning


def test_which_gates_are_ours_comes_from_the_cr_even_when_the_status_write_was_lost():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, ("Snapshot",), frozenset())
    with_gate = config({"kubevirt": {"extraFeatureGates": ["VMExport"]}})
    first = plan_sync(with_gate, live, [], [], None, NOW)
    applied = kubevirt_after(first)
    assert applied.our_gates == ("HostDevices", "VMExport") and applied.feature_gates == ("HostDevices", "VMExport", "Snapshot")
    # The operator died between the CR's apply and the config's status: the status never said VMExport.
    dropped = plan_sync(config({}, status={}), applied, [], [], first.rendered, NOW)
    assert dropped.apply["spec"]["configuration"]["developerConfiguration"]["featureGates"] == ["HostDevices", "Snapshot"]


def test_a_kubevirt_cr_the_values_no_longer_name_is_let_go_of():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, ("Snapshot",), frozenset())
    first = plan_sync(config({"kubevirt": {"extraFeatureGates": ["VMExport"]}}), live, [], [], None, NOW)
    old = kubevirt_after(first)
    body = release(old)
    assert body["metadata"] == {"name": "kubevirt", "namespace": "kubevirt"}  # no annotation: ours goes
    assert body["spec"] == {"configuration": {"developerConfiguration": {"featureGates": ["Snapshot"]}}}  # no allow-list
    # Once let go of, nothing more is written to it.
    after = KubeVirtView.of({**body, "metadata": {**body["metadata"], "managedFields": [
        {"manager": "passthrough-operator", "operation": "Apply", "fieldsV1": fields_v1(body)}]}})
    assert after.owned == frozenset({"featureGates"}) and release(after) is None
    # A CR whose gates were all ours keeps an empty list (its configuration stays an object); one never ours is left alone.
    only_ours = dataclasses.replace(old, feature_gates=("HostDevices", "VMExport"))
    assert release(only_ours)["spec"] == {"configuration": {"developerConfiguration": {"featureGates": []}}}
    assert release(KubeVirtView("kubevirt", "other", "", None, None, ("Snapshot",), frozenset())) is None


def test_the_managed_fields_parser_reads_a_real_kubevirt_cr():
    # tests/data/kubevirt-managed-fields.json: a KubeVirt CR from the real API server after our
    # apply (our gates and one assigned device), beside its installer's Update and an admin's
    # kubectl edit. KubeVirt's featureGates list is atomic: our force apply took all of it.
    import json
    from pathlib import Path

    sample = json.loads((Path(__file__).resolve().parents[1] / "data/kubevirt-managed-fields.json").read_text())
    managers = [(e["manager"], e["operation"]) for e in sample["metadata"]["managedFields"]]
    assert managers == [("passthrough-operator", "Apply"), ("OpenAPI-Generator", "Update"), ("kubectl-edit", "Update")]
    view = KubeVirtView.of(sample)
    assert view.owned == {"pciHostDevices", "featureGates", GATES_ANNOTATION}
    assert view.our_gates == ("HostDevices", "VMExport")
    assert view.feature_gates == ("HostDevices", "VMExport", "Snapshot")
    # Another manager's entries, or ours as an Update, own nothing of ours.
    theirs = [dict(e, manager="kubectl-edit") for e in sample["metadata"]["managedFields"]]
    assert KubeVirtView.of({**sample, "metadata": {**sample["metadata"], "managedFields": theirs}}).our_gates is None


def test_an_empty_allow_list_removes_a_block_another_manager_wrote_and_says_so():
    # DESIGN: an empty result removes the block. An apply lets go only of what our field manager
    # owns, so a block an admin or a GitOps tool wrote is removed by its own patch, and warned of.
    hand_added = ({"pciVendorSelector": "10DE:2236", "resourceName": "nvidia.com/GA102GL_A10"},)
    live = KubeVirtView("kubevirt", "kubevirt", "", hand_added, None, ("Snapshot",), frozenset())
    plan = plan_sync(config({"gpu": {"replaceDefaults": True}}), live, [], [], None, NOW)
    assert "permittedHostDevices" not in plan.apply["spec"]["configuration"]
    assert plan.remove_block == "1 pciHostDevices"
    assert [(t, r) for t, r, _ in plan.events if r == "AllowListRemoved"] == [("Warning", "AllowListRemoved")]
    matched = next(c for c in status_after(plan)["conditions"] if c["type"] == "NodesMatchAllowList")
    assert (matched["status"], matched["reason"]) == ("False", "NoAllowList")
    assert "another field manager wrote, 1 pciHostDevices, was removed" in matched["message"]
    # Invalid values tear nothing down: the block stays, and the status says why.
    bad = plan_sync(config({"gpu": {"replaceDefaults": True, "permittedHostDevices": {"pciHostDevices": [{"x": 1}]}}}),
                    live, [], [], plan.rendered, NOW)  # fmt: skip
    assert bad.problems and not bad.remove_block
    kept = next(c for c in status_after(bad)["conditions"] if c["type"] == "NodesMatchAllowList")
    assert kept["reason"] == "AllowListNotOurs"
    # Ours, being let go of by this very apply: the usual warning that nothing is checked.
    ours = dataclasses.replace(live, owned=frozenset({"pciHostDevices"}))
    plan = plan_sync(config({"gpu": {"replaceDefaults": True}}), ours, [], [], None, NOW)
    assert next(c for c in status_after(plan)["conditions"] if c["type"] == "NodesMatchAllowList")["reason"] == "NoAllowList"
    assert plan.remove_block == ""  # our apply lets go of it


def test_with_dra_invalid_values_leave_no_assigned_device_waiting_for_an_entry():
    live = KubeVirtView("kubevirt", "kubevirt", "", (), None, ("HostDevices",), frozenset())
    assigned = [AssignedDevice("pci-a", "10de", "2236")]
    bad = {"gpu": {"permittedHostDevices": {"pciHostDevices": [{"x": 1}]}}}
    plan = plan_sync(config(bad), live, assigned, [], None, NOW)
    assert plan.problems and plan.unapplied == {"pci-a": plan.unapplied["pci-a"]}  # waits for its entry
    plan = plan_sync(config({**bad, "dra": {"enabled": True}}), live, assigned, [], None, NOW)
    assert plan.problems and plan.unapplied == {}  # with DRA it needs none


def test_where_nodes_choose_only_device_plugin_nodes_devices_need_entries_and_advertise():
    on_plugins = NodeDevice.of({"metadata": {"name": "pci-p", "uid": "uid-p"},
                                "status": {"attributes": {"vendorID": "10de", "deviceID": "2236", "nodeName": "plugins"}}})  # fmt: skip
    live = {"pci-a": node_device("pci-a", "uid-a"), "pci-p": on_plugins}  # pci-a's node, n1, serves through DRA
    assigned = assigned_devices([pci_device("pci-a", "team-a", "uid-a"), pci_device("pci-p", "team-a", "uid-p")], live)
    pools = advertised([pooled_gpu("n1", "True", "Ready"), pooled_gpu("plugins", "True", "Ready")])
    kept, advertising = on_device_plugin_nodes(assigned, pools, live, lambda node: node == "n1")
    assert kept == [AssignedDevice("pci-p", "10de", "2236")]
    assert [a.node for a in advertising] == ["plugins"]
