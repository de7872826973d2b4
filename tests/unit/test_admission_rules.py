"""Who may use a namespace's devices: the admission decisions, without a cluster."""

from __future__ import annotations

from passthrough.admission import rules
from passthrough.api.views import Device

NS = "team-a"
READY = {"type": "Ready", "status": "True", "reason": "Ready", "message": "The device can be passed through."}


def device(name: str, namespace: str = NS, node: str = "gpu-1", deleting: bool = False, ready: dict | None = READY) -> Device:
    return Device(
        name=name, namespace=namespace, uid=f"uid-{name}", resource_version="1", deleting=deleting, metadata={},
        status={"nodeName": node, "resourceName": f"passthrough.io/{name}", "conditions": [ready] if ready else []},
    )  # fmt: skip


def devices(*items: Device) -> dict[str, Device]:
    return {d.name: d for d in items}


def judge(listed, before=None, known=(), users=None, kind="VirtualMachine", name="vm1", exempt=(), forged=()):
    return rules.judge_vm(kind, NS, name, listed, before, devices(*known), users or {}, exempt, forged)


# -- what objects list ------------------------------------------------------------------------


def test_host_devices_and_gpus_of_a_vm_are_listed_in_order_with_repeats_and_other_resources_left_out():
    spec = {"template": {"spec": {"domain": {"devices": {
        "hostDevices": [{"name": "a", "deviceName": "passthrough.io/pci-a"}, {"name": "n", "deviceName": "nvidia.com/GA102GL_A10"}],
        "gpus": [{"name": "b", "deviceName": "passthrough.io/pci-b"}, {"name": "c", "deviceName": "passthrough.io/pci-a"}],
    }}}}}  # fmt: skip
    assert rules.vm_device_references(spec) == ["pci-a", "pci-b", "pci-a"]
    assert rules.referenced_device_names(spec) == {"pci-a", "pci-b"}


def test_a_vm_also_lists_the_passthrough_resources_of_domain_resources_each_once():
    # KubeVirt copies domain.resources into the launcher pod, which then asks for the device.
    spec = {"template": {"spec": {"domain": {
        "devices": {"hostDevices": [{"name": "a", "deviceName": "passthrough.io/pci-a"}]},
        "resources": {"requests": {"memory": "1Gi", "passthrough.io/pci-b": "1"},
                      "limits": {"passthrough.io/pci-b": "1", "passthrough.io/pci-c": "1", "nvidia.com/GA102GL_A10": "1"}},
    }}}}  # fmt: skip
    assert rules.vm_device_references(spec) == ["pci-a", "pci-b", "pci-c"]
    assert rules.referenced_device_names(spec) == {"pci-a", "pci-b", "pci-c"}
    assert rules.vmi_device_references({"domain": {"resources": {"limits": {"passthrough.io/pci-d": "1"}}}}) == ["pci-d"]


def test_a_device_both_listed_and_in_domain_resources_is_listed_twice():
    # KubeVirt adds one to the launcher's request per listing: two of a resource that has one.
    spec = {"template": {"spec": {"domain": {"devices": {"gpus": [{"name": "a", "deviceName": "passthrough.io/pci-a"}]},
                                             "resources": {"limits": {"passthrough.io/pci-a": "1"}}}}}}  # fmt: skip
    verdict = judge(rules.vm_device_references(spec), known=[device("pci-a")])
    assert "passthrough.io/pci-a is listed 2 times; list each device once" in verdict.refusal


def test_a_vmi_lists_its_devices_under_spec_domain():
    spec = {"domain": {"devices": {"gpus": [{"name": "g", "deviceName": "passthrough.io/pci-a"}]}}}
    assert rules.vmi_device_references(spec) == ["pci-a"]


def test_specs_without_devices_list_nothing():
    for spec in (None, {}, {"template": None}, {"template": {"spec": {"domain": {"devices": {"hostDevices": None}}}}}):
        assert rules.vm_device_references(spec) == []
    assert rules.vmi_device_references({"domain": {}}) == []


def test_a_pod_asks_for_devices_in_requests_or_limits_of_any_container_or_init_container():
    spec = {
        "containers": [
            {"name": "a", "resources": {"limits": {"passthrough.io/pci-a": "1", "cpu": "1"}}},
            {"name": "b", "resources": {"requests": {"passthrough.io/pci-b": "1"}, "limits": {"passthrough.io/pci-b": "1"}}},
            {"name": "c"},
        ],
        "initContainers": [{"name": "i", "resources": {"requests": {"passthrough.io/pci-c": "1", "nvidia.com/GA102GL_A10": "1"}}}],
    }
    assert rules.pod_device_requests(spec) == ["pci-a", "pci-b", "pci-c"]
    assert rules.pod_device_requests({"containers": [{"name": "x", "resources": {"limits": {"nvidia.com/x": "1"}}}]}) == []


# -- VM rules -----------------------------------------------------------------------------------


def test_a_vm_with_devices_of_its_namespace_on_one_node_is_admitted_without_warnings():
    verdict = judge(["pci-a", "pci-b"], known=[device("pci-a"), device("pci-b")])
    assert verdict.allowed and verdict.warnings == ()


def test_a_device_that_is_not_a_pcidevice_of_the_namespace_is_refused_and_the_message_says_what_to_do():
    verdict = judge(["pci-a"])
    assert not verdict.allowed
    assert verdict.refusal == (
        "VirtualMachine team-a/vm1: passthrough.io/pci-a is not a PCIDevice of namespace team-a; ask an admin to "
        "assign the device to team-a, or use one that `kubectl get pcidevices -n team-a` lists."
    )


def test_another_namespaces_device_is_refused_without_saying_where_it_is():
    verdict = judge(["pci-a"], known=[device("pci-a", namespace="team-b")])
    assert "is not a PCIDevice of namespace team-a" in verdict.refusal
    assert "team-b" not in verdict.refusal


def test_a_device_being_removed_from_the_namespace_is_refused():
    verdict = judge(["pci-a"], known=[device("pci-a", deleting=True)])
    assert "PCIDevice pci-a is being removed from namespace team-a (unassigned or reassigned); use another device" in verdict.refusal


def test_more_than_eight_devices_are_refused():
    names = [f"pci-{i}" for i in range(9)]
    verdict = judge(names, known=[device(n) for n in names])
    assert "9 passthrough devices are listed, at most 8 fit one VM; remove 1" in verdict.refusal
    assert judge(names[:8], known=[device(n) for n in names]).allowed


def test_devices_on_different_nodes_are_refused_and_each_node_is_named():
    verdict = judge(["pci-a", "pci-b", "pci-c"], known=[device("pci-a", node="n1"), device("pci-b", node="n2"), device("pci-c", node="n1")])
    assert "the devices are on different nodes (pci-a, pci-c on n1; pci-b on n2) and a VM runs on one" in verdict.refusal


def test_the_same_device_twice_is_refused():
    verdict = judge(["pci-a", "pci-a"], known=[device("pci-a")])
    assert "passthrough.io/pci-a is listed 2 times; list each device once" in verdict.refusal


def test_a_device_another_vm_of_the_namespace_lists_is_refused_and_that_vm_is_named():
    verdict = judge(["pci-a"], known=[device("pci-a")], users={"pci-a": ["vm0"]})
    assert verdict.refusal == (
        "VirtualMachine team-a/vm1: PCIDevice pci-a is already used by VirtualMachine team-a/vm0; "
        "remove it from that VM first, or use another device."
    )


def test_the_vm_itself_listing_the_device_is_no_other_user():
    assert judge(["pci-a"], before=[], known=[device("pci-a")], users={"pci-a": ["vm1"]}).allowed


def test_a_vmi_of_the_same_name_as_the_vm_listing_the_device_is_another_user_unless_exempted():
    # Only the webhook's check of the owner reference (uid included) exempts that VM.
    refused = judge(["pci-a"], known=[device("pci-a")], users={"pci-a": ["vm0"]}, kind="VirtualMachineInstance", name="vm0")
    assert "PCIDevice pci-a is already used by VirtualMachine team-a/vm0" in refused.refusal


def test_a_forged_pcidevice_is_refused_with_what_to_do_and_nothing_else_about_it():
    verdict = judge(["pci-a"], known=[], forged={"pci-a"})
    assert verdict.refusal == (
        "VirtualMachine team-a/vm1: PCIDevice pci-a in namespace team-a is not one the passthrough operator handed to "
        "team-a, so it gives the namespace no device; if an admin has just assigned it, retry in a moment, otherwise ask "
        "one to assign the device to team-a."
    )
    assert "handed to team-a" in rules.judge_pod(NS, "launcher", ["pci-a"], {}, forged={"pci-a"}).refusal


def test_a_vm_list_already_holding_a_forged_device_stays_editable():
    assert judge(["pci-a"], before=["pci-a"], forged={"pci-a"}).allowed


def test_a_vmi_made_from_the_vm_that_lists_the_device_is_admitted():
    verdict = judge(["pci-a"], known=[device("pci-a")], users={"pci-a": ["vm0"]}, kind="VirtualMachineInstance", name="vmi-x", exempt=["vm0"])
    assert verdict.allowed
    refused = judge(["pci-a"], known=[device("pci-a")], users={"pci-a": ["vm0"]}, kind="VirtualMachineInstance", name="vmi-x")
    assert refused.refusal.startswith("VirtualMachineInstance team-a/vmi-x: PCIDevice pci-a is already used by VirtualMachine team-a/vm0")


def test_a_device_that_is_not_ready_is_admitted_with_a_warning_naming_why():
    not_ready = {"type": "Ready", "status": "False", "reason": "VfioNotLoaded", "message": "vfio-pci is not loaded on this node."}
    verdict = judge(["pci-a"], known=[device("pci-a", ready=not_ready)])
    assert verdict.allowed
    assert verdict.warnings == (
        "PCIDevice pci-a is not Ready (VfioNotLoaded: vfio-pci is not loaded on this node.); the VM will not start on it until it is",
    )
    assert "not reported yet" in judge(["pci-a"], known=[device("pci-a", ready=None)]).warnings[0]


def test_every_problem_is_named_in_one_refusal():
    verdict = judge(["pci-a", "pci-a", "pci-b", "pci-c"], known=[device("pci-a"), device("pci-c", deleting=True)])
    assert verdict.refusal.count(";") >= 3
    for part in ("pci-a is listed 2 times", "passthrough.io/pci-b is not a PCIDevice", "PCIDevice pci-c is being removed"):
        assert part in verdict.refusal


def test_a_vm_without_a_name_yet_is_named_by_its_namespace():
    assert judge(["pci-a"], name="").refusal.startswith("VirtualMachine in namespace team-a: ")


# -- updates: only what the update adds is judged ---------------------------------------------


def test_an_update_keeping_a_device_that_is_being_removed_is_admitted():
    assert judge(["pci-a"], before=["pci-a"], known=[device("pci-a", deleting=True)]).allowed
    assert judge(["pci-a"], before=["pci-a"]).allowed  # already gone from the namespace


def test_an_update_adding_a_device_judges_only_the_added_one():
    verdict = judge(["pci-a", "pci-b"], before=["pci-a"], known=[device("pci-a", deleting=True)])
    assert "passthrough.io/pci-b is not a PCIDevice" in verdict.refusal
    assert "pci-a" not in verdict.refusal


def test_an_update_adding_a_device_on_another_node_is_refused():
    verdict = judge(["pci-a", "pci-b"], before=["pci-a"], known=[device("pci-a", node="n1"), device("pci-b", node="n2")])
    assert "different nodes (pci-a on n1; pci-b on n2)" in verdict.refusal


def test_an_update_adding_a_ninth_device_is_refused_but_a_list_already_past_the_limit_stays_editable():
    names = [f"pci-{i}" for i in range(10)]
    known = [device(n) for n in names]
    assert "at most 8" in judge(names[:9], before=names[:8], known=known).refusal
    assert judge(names[:9], before=names[:9], known=known).allowed
    assert judge(names[:9], before=names, known=known).allowed  # one fewer, still past the limit


def test_an_update_listing_a_held_device_a_second_time_is_refused():
    assert "listed 2 times" in judge(["pci-a", "pci-a"], before=["pci-a"], known=[device("pci-a")]).refusal
    assert judge(["pci-a", "pci-a"], before=["pci-a", "pci-a"], known=[device("pci-a")]).allowed


def test_an_update_keeping_a_device_another_vm_also_lists_is_admitted():
    assert judge(["pci-a"], before=["pci-a"], known=[device("pci-a")], users={"pci-a": ["vm0", "vm1"]}).allowed


def test_an_update_adding_a_device_that_is_not_ready_warns():
    not_ready = {"type": "Ready", "status": "False", "reason": "NotFound", "message": "gone"}
    verdict = judge(["pci-a", "pci-b"], before=["pci-a"], known=[device("pci-a", ready=not_ready), device("pci-b", ready=not_ready)])
    assert verdict.allowed and len(verdict.warnings) == 1 and "pci-b" in verdict.warnings[0]


# -- pods -----------------------------------------------------------------------------------------


def test_a_pod_asking_for_a_device_of_its_namespace_is_admitted():
    assert rules.judge_pod(NS, "launcher", ["pci-a"], devices(device("pci-a"))).allowed


def test_a_pod_asking_for_a_device_of_another_namespace_is_refused_and_told_what_to_do():
    verdict = rules.judge_pod(NS, "launcher", ["pci-a"], devices(device("pci-a", namespace="team-b")))
    assert verdict.refusal == (
        "Pod team-a/launcher: passthrough.io/pci-a is not a PCIDevice of namespace team-a; ask an admin to assign "
        "the device to team-a, or use one that `kubectl get pcidevices -n team-a` lists."
    )


def test_a_pod_asking_for_a_device_that_is_being_removed_from_its_namespace_is_refused():
    verdict = rules.judge_pod(NS, "launcher", ["pci-a"], devices(device("pci-a", deleting=True)))
    assert "PCIDevice pci-a is being removed from namespace team-a (unassigned or reassigned); no new pod may use it" in verdict.refusal


def test_a_pod_gets_no_warning_for_a_device_that_is_not_ready():
    verdict = rules.judge_pod(NS, "launcher", ["pci-a"], devices(device("pci-a", ready=None)))
    assert verdict.allowed and verdict.warnings == ()
