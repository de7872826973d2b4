"""Rendering KubeVirt's allow-list and feature gates from the platform values."""

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from e2e import kubevirt as kubevirt_crds
from passthrough.kubevirt.allowlist import SOCKET_PATH_MAX, AssignedDevice, default_table, resource_name_problems, socket_path
from passthrough.kubevirt.render import cozystack_package, render
from passthrough.kubevirt.values import ValuesError, parse_values
from passthrough.pci.naming import exclusive_resource_name, gpu_resource_name, node_pci_device_name
from passthrough.pci.pciids import PciIds

REPO = Path(__file__).resolve().parents[2]
TABLE = [d["resourceName"] for d in default_table()]
A10 = "nvidia.com/GA102GL_A10"


def values(pci=(), mdev=(), replace=False, variant="default", gates=(), **kubevirt):
    return {
        "kubevirt": {"extraFeatureGates": list(gates), **kubevirt},
        "gpu": {
            "variant": variant,
            "replaceDefaults": replace,
            "permittedHostDevices": {"pciHostDevices": list(pci), "mediatedDevices": list(mdev)},
        },
    }


def pci(selector, resource, external=True):
    return {"pciVendorSelector": selector, "resourceName": resource, "externalResourceProvider": external}


def mdev(selector, resource, external=True):
    return {"mdevNameSelector": selector, "resourceName": resource, "externalResourceProvider": external}


def rendered(data, **kwargs):
    return render(parse_values(data), **kwargs)


def names(result):
    return [d["resourceName"] for d in result.pci_host_devices]


def problems(data, **kwargs):
    with pytest.raises(ValuesError) as raised:
        rendered(data, **kwargs)
    return raised.value.problems


def problems_of(spec, **kwargs):
    with pytest.raises(ValuesError) as raised:
        render(spec, **kwargs)
    return raised.value.problems


# --- the default table ------------------------------------------------------------------------


def test_default_table_equals_cozystacks():
    cozystack = yaml.safe_load((REPO / "tests/data/cozystack-gpu-passthrough-defaults.yaml").read_text())
    assert default_table() == cozystack["pciHostDevices"]


def test_default_table_is_the_documented_cards_in_order():
    expected = [
        ("2335", "GH100_H200_SXM_141GB"), ("2330", "GH100_H100_SXM5_80GB"), ("2331", "GH100_H100_PCIE"),
        ("2321", "GH100_H100L_94GB"), ("26B9", "AD102GL_L40S"), ("26B5", "AD102GL_L40"), ("27B8", "AD104GL_L4"),
        ("20B2", "GA100_A100_SXM4_80GB"), ("20B0", "GA100_A100_SXM4_40GB"), ("20B5", "GA100_A100_PCIE_80GB"),
        ("20F1", "GA100_A100_PCIE_40GB"), ("20B7", "GA100GL_A30_PCIE"), ("2235", "GA102GL_A40"),
        ("2236", "GA102GL_A10"), ("1EB8", "TU104GL_TESLA_T4"), ("1DB1", "GV100GL_TESLA_V100_SXM2_16GB"),
        ("1DB5", "GV100GL_TESLA_V100_SXM2_32GB"), ("1DB4", "GV100GL_TESLA_V100_PCIE_16GB"),
        ("1DF6", "GV100GL_TESLA_V100S_PCIE_32GB"),
    ]
    assert default_table() == [pci(f"10DE:{d}", f"nvidia.com/{n}") for d, n in expected]


def test_default_table_names_are_what_our_agent_calls_the_cards_with_current_pci_ids():
    pci_ids = PciIds.load(REPO / "e2e/data/pci.ids.2025-07-11")
    for entry in default_table():
        vendor, device = entry["pciVendorSelector"].split(":")
        assert gpu_resource_name(vendor, device, pci_ids) == entry["resourceName"], entry


def test_default_table_is_a_copy_callers_may_change():
    default_table()[0]["resourceName"] = "changed"
    assert default_table()[0]["resourceName"] == "nvidia.com/GH100_H200_SXM_141GB"


# --- append / replace / variants --------------------------------------------------------------


def test_user_entries_follow_the_default_table():
    result = rendered(values(pci=[pci("1AF4:1000", "example.com/virtio")]))
    assert names(result) == [*TABLE, "example.com/virtio"]


def test_replace_defaults_drops_the_table():
    result = rendered(values(pci=[pci("1AF4:1000", "example.com/virtio")], replace=True))
    assert names(result) == ["example.com/virtio"]


def test_empty_allow_list_leaves_the_block_out_and_warns():
    result = rendered(values(replace=True))
    assert "permittedHostDevices" not in result.patch["spec"]["configuration"]
    assert result.pci_host_devices == [] and result.mediated_devices == []
    assert any("checks no device names at all" in w for w in result.warnings)


def test_a_full_allow_list_does_not_warn():
    assert rendered(values()).warnings == []


def test_selectors_are_written_upper_case():
    result = rendered(values(pci=[pci("1af4:10f1", "example.com/virtio")], replace=True))
    assert result.pci_host_devices[0]["pciVendorSelector"] == "1AF4:10F1"


def test_vgpu_variant_never_adds_the_passthrough_table():
    data = values(pci=[pci("10DE:26B9", "nvidia.com/L40S-24Q", False)],
                  mdev=[mdev("GRID T4-16Q", "nvidia.com/GRID_T4-16Q")], variant="vgpu")
    result = rendered(data)
    assert names(result) == ["nvidia.com/L40S-24Q"]
    assert result.mediated_devices == [mdev("GRID T4-16Q", "nvidia.com/GRID_T4-16Q")]
    assert result.patch["spec"]["configuration"]["permittedHostDevices"]["mediatedDevices"] == result.mediated_devices


def test_vgpu_variant_keeps_exclusive_devices():
    data = values(mdev=[mdev("GRID T4-16Q", "nvidia.com/GRID_T4-16Q")], variant="vgpu")
    result = rendered(data, assigned=[AssignedDevice("pci-nic", "15b3", "101d")])
    assert names(result) == ["passthrough.io/pci-nic"]


def test_vgpu_without_mediated_devices_warns():
    result = rendered(values(pci=[pci("10DE:26B9", "nvidia.com/L40S-24Q")], variant="vgpu"))
    assert any("no vGPU type is permitted" in w for w in result.warnings)


def test_mediated_devices_are_rendered_in_the_default_variant_too():
    result = rendered(values(mdev=[mdev("GRID T4-16Q", "nvidia.com/GRID_T4-16Q")]))
    assert names(result) == TABLE and len(result.mediated_devices) == 1


def test_an_empty_list_inside_the_block_is_left_out():
    patch = rendered(values()).patch
    assert "mediatedDevices" not in patch["spec"]["configuration"]["permittedHostDevices"]


def test_unknown_variant_names_the_allowed_values():
    with pytest.raises(ValuesError) as raised:
        parse_values(values(variant="passthrough"))
    assert raised.value.problems == ["gpu.variant: 'passthrough' is not a known variant; use one of: default, vgpu"]


def test_unknown_variant_is_refused_by_render_too():
    spec = parse_values(values())
    spec.gpu.variant = "mig"  # a model built without validation, as model_construct would
    assert any("use one of: default, vgpu" in p for p in problems_of(spec))


# --- assigned devices -----------------------------------------------------------------------


def test_assigned_devices_follow_the_values_sorted_by_name():
    assigned = [AssignedDevice("pci-bbb", "15b3", "101d"), AssignedDevice("pci-aaa", "8086", "1592")]
    result = rendered(values(pci=[pci("1AF4:1000", "example.com/virtio")]), assigned=assigned)
    assert result.pci_host_devices[len(TABLE) + 1:] == [
        pci("8086:1592", "passthrough.io/pci-aaa"),
        pci("15B3:101D", "passthrough.io/pci-bbb"),
    ]


def test_the_same_assigned_device_twice_is_listed_once():
    device = AssignedDevice("pci-aaa", "8086", "1592")
    assert names(rendered(values(replace=True), assigned=[device, device])) == ["passthrough.io/pci-aaa"]


def test_assigned_devices_of_a_pool_model_share_its_selector():
    # Two A10s assigned to namespaces while the others stay in the pool: KubeVirt ignores the selector
    # of entries an external plugin serves, so this is no conflict.
    assigned = [AssignedDevice("pci-a10-1", "10de", "2236"), AssignedDevice("pci-a10-2", "10de", "2236")]
    result = rendered(values(), assigned=assigned)
    assert [d for d in result.pci_host_devices if d["pciVendorSelector"] == "10DE:2236"] == [
        pci("10DE:2236", A10),
        pci("10DE:2236", "passthrough.io/pci-a10-1"),
        pci("10DE:2236", "passthrough.io/pci-a10-2"),
    ]


# One assignment must not freeze the allow-list of everyone else: a device whose entry cannot be
# written is left out alone, with the reason, and the values' and other devices' entries stay.
SERVED_BY_KUBEVIRT = values(pci=[pci("10DE:2236", "nvidia.com/A10", external=False), pci("1AF4:1000", "example.com/virtio")],
                            replace=True)  # fmt: skip
NIC = AssignedDevice("pci-nic", "8086", "1592")


def test_assigned_device_of_a_model_kubevirt_serves_itself_is_left_out_alone():
    result = rendered(SERVED_BY_KUBEVIRT, assigned=[AssignedDevice("pci-a10", "10de", "2236"), NIC])
    assert names(result) == ["nvidia.com/A10", "example.com/virtio", "passthrough.io/pci-nic"]
    assert list(result.left_out) == ["pci-a10"]
    assert result.left_out["pci-a10"] == (
        "its model 10DE:2236 is listed in gpu.permittedHostDevices.pciHostDevices[0] (nvidia.com/A10) with "
        "externalResourceProvider: false, so KubeVirt's own device plugin would serve every device of that model, "
        "this one included; set externalResourceProvider: true on that entry, or unassign the device"
    )


def test_assigned_device_whose_own_name_is_listed_for_kubevirt_to_serve_is_left_out_alone():
    data = values(pci=[pci("10DE:2236", "passthrough.io/pci-a10", external=False)], replace=True)
    result = rendered(data, assigned=[AssignedDevice("pci-a10", "10de", "2236"), NIC])
    assert names(result) == ["passthrough.io/pci-a10", "passthrough.io/pci-nic"]
    assert result.pci_host_devices[0]["externalResourceProvider"] is False  # the admin's entry, as written
    assert "externalResourceProvider: false" in result.left_out["pci-a10"]


def test_assigned_device_with_a_name_too_long_for_a_device_plugin_is_left_out_alone():
    long = "pci-" + "a" * 70
    result = rendered(SERVED_BY_KUBEVIRT, assigned=[AssignedDevice(long, "8086", "1592"), NIC])
    assert names(result) == ["nvidia.com/A10", "example.com/virtio", "passthrough.io/pci-nic"]
    assert list(result.left_out) == [long]
    assert "must be 1 to 63 letters" in result.left_out[long] and "is too long for a device plugin" in result.left_out[long]
    assert "unassign the device" in result.left_out[long]


def test_assigned_device_with_bad_ids_is_left_out_alone():
    result = rendered(values(replace=True), assigned=[AssignedDevice("pci-x", "10de", "23"), NIC])
    assert names(result) == ["passthrough.io/pci-nic"]
    assert "'10DE:23' is not VVVV:DDDD hex" in result.left_out["pci-x"]


def test_values_problems_still_refuse_the_render_whatever_is_assigned():
    data = values(pci=[pci("10DE:2236", "nvidia.com/A10")])  # re-points a card of the default table
    [problem] = problems(data, assigned=[AssignedDevice("pci-a10", "10de", "2236")])
    assert problem.startswith("gpu.permittedHostDevices.pciHostDevices[0].pciVendorSelector: 10DE:2236 is listed twice")


def test_nothing_is_left_out_when_every_assigned_device_fits():
    assert rendered(values(), assigned=[NIC]).left_out == {}


def test_exclusive_names_of_real_device_names_fit_the_socket_limit():
    name = node_pci_device_name("0000:3b:00.0", "10de", "2236", "a-rather-long-node-name.example.internal")
    assert resource_name_problems(exclusive_resource_name(name)) == ()


# --- duplicates -----------------------------------------------------------------------------


def test_conflicting_duplicate_with_the_table_is_refused_naming_both_entries():
    [problem] = problems(values(pci=[pci("10DE:2236", "nvidia.com/A10")]))
    assert problem.startswith("gpu.permittedHostDevices.pciHostDevices[0].pciVendorSelector: 10DE:2236 is listed twice")
    assert "default table entry 13: nvidia.com/GA102GL_A10" in problem
    assert "values entry pciHostDevices[0]: nvidia.com/A10" in problem
    assert "set gpu.replaceDefaults: true" in problem


def test_conflicting_duplicate_within_the_values_is_refused_naming_both_entries():
    data = values(pci=[pci("1AF4:1000", "example.com/a"), pci("1AF4:1041", "example.com/b"),
                       pci("1AF4:1000", "example.com/c")], replace=True)
    [problem] = problems(data)
    assert problem.startswith("gpu.permittedHostDevices.pciHostDevices[2].pciVendorSelector: ")
    assert "values entry pciHostDevices[0]: example.com/a" in problem
    assert "values entry pciHostDevices[2]: example.com/c" in problem


def test_selectors_compare_case_insensitively():
    [problem] = problems(values(pci=[pci("10de:2236", "nvidia.com/A10")]))
    assert "default table entry 13" in problem


def test_exact_duplicate_is_dropped_silently():
    result = rendered(values(pci=[pci("10de:2236", A10), pci("1AF4:1000", "example.com/a"),
                                  pci("1af4:1000", "example.com/a")]))
    assert names(result) == [*TABLE, "example.com/a"]
    assert result.warnings == []


def test_duplicate_with_another_external_resource_provider_is_refused():
    [problem] = problems(values(pci=[pci("10DE:2236", A10, external=False)]))
    assert "with different externalResourceProvider" in problem
    assert "default table entry 13" in problem and "values entry pciHostDevices[0]" in problem


def test_the_same_resource_under_two_selectors_is_fine():
    # Two device IDs of one card model share a name (e.g. two A100 PCIe 40GB IDs).
    data = values(pci=[pci("10DE:20F1", "nvidia.com/GA100_A100_PCIE_40GB"),
                       pci("10DE:20BF", "nvidia.com/GA100_A100_PCIE_40GB")], replace=True)
    assert len(rendered(data).pci_host_devices) == 2


def test_mediated_duplicate_with_another_resource_is_refused():
    # KubeVirt reads "GRID T4-1Q" as "GRID_T4-1Q".
    data = values(mdev=[mdev("GRID T4-1Q", "nvidia.com/GRID_T4-1Q"), mdev("GRID_T4-1Q", "nvidia.com/T4_1Q")])
    [problem] = problems(data)
    assert problem.startswith("gpu.permittedHostDevices.mediatedDevices[1].mdevNameSelector: GRID_T4-1Q is listed twice")
    assert "values entry mediatedDevices[0]: nvidia.com/GRID_T4-1Q" in problem


def test_exact_mediated_duplicate_is_dropped():
    data = values(mdev=[mdev("GRID T4-1Q", "nvidia.com/GRID_T4-1Q"), mdev("GRID T4-1Q", "nvidia.com/GRID_T4-1Q")])
    assert len(rendered(data).mediated_devices) == 1


# --- feature gates --------------------------------------------------------------------------


def test_host_devices_comes_first_then_the_extra_gates_without_duplicates():
    result = rendered(values(gates=["Snapshot", "HostDevices", "Snapshot", "VMExport"]))
    assert result.our_feature_gates == ["HostDevices", "Snapshot", "VMExport"]
    assert result.feature_gates == result.our_feature_gates
    assert result.patch["spec"]["configuration"]["developerConfiguration"]["featureGates"] == result.feature_gates


def test_live_gates_that_are_not_ours_are_kept_after_ours_in_live_order():
    result = rendered(values(gates=["Snapshot"]), live_gates=["LiveMigration", "HostDevices", "CPUManager", "LiveMigration"])
    assert result.feature_gates == ["HostDevices", "Snapshot", "LiveMigration", "CPUManager"]
    assert result.our_feature_gates == ["HostDevices", "Snapshot"]


def test_a_gate_we_applied_last_time_and_no_longer_ask_for_is_dropped():
    result = rendered(values(gates=["Snapshot"]), live_gates=["HostDevices", "Snapshot", "VMExport", "CPUManager"],
                      previous_gates=["HostDevices", "Snapshot", "VMExport"])
    assert result.feature_gates == ["HostDevices", "Snapshot", "CPUManager"]


def test_a_gate_we_applied_last_time_and_still_ask_for_stays():
    result = rendered(values(gates=["VMExport"]), live_gates=["HostDevices", "VMExport"],
                      previous_gates=["HostDevices", "VMExport"])
    assert result.feature_gates == ["HostDevices", "VMExport"]


def test_listing_the_ga_gpu_gate_warns():
    assert any("GPU, which is GA" in w for w in rendered(values(gates=["GPU"])).warnings)


def test_a_blank_feature_gate_is_reported():
    with pytest.raises(ValuesError) as raised:
        parse_values(values(gates=["Snapshot", " "]))
    assert raised.value.problems == ["kubevirt.extraFeatureGates[1]: ' ' is not a feature gate name"]


GATE_NAMES = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1).filter(
    lambda g: g == g.strip() and " " not in g
)


@given(st.lists(GATE_NAMES, max_size=5))
def test_any_gate_name_reaches_the_patch_unchanged(gates):
    # Gates go through YAML on their way out: "on", "1e3", "- x" or "\U0001F600" must come back as written.
    result = rendered(values(gates=gates))
    assert result.patch["spec"]["configuration"]["developerConfiguration"]["featureGates"] == result.feature_gates
    assert result.feature_gates == list(dict.fromkeys(["HostDevices", *gates]))


# --- validation -----------------------------------------------------------------------------


def test_invalid_selector_is_reported():
    with pytest.raises(ValuesError) as raised:
        parse_values(values(pci=[pci("10de-2236", "nvidia.com/A10")], replace=True))
    assert raised.value.problems == [
        "gpu.permittedHostDevices.pciHostDevices[0].pciVendorSelector: '10de-2236' is not VVVV:DDDD hex "
        "(vendor and device ID, e.g. 10DE:2236)"
    ]


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("GA102GL_A10", "needs a domain"),
        ("kubernetes.io/gpu", "kubernetes.io domain"),
        ("node.kubernetes.io/gpu", "kubernetes.io domain"),
        ("NVIDIA.com/A10", "not a DNS-1123 subdomain"),
        ("nvidia_com/A10", "not a DNS-1123 subdomain"),
        ("nvidia.com/", "must be 1 to 63"),
        ("nvidia.com/A10 PCIe", "must be 1 to 63"),
        ("nvidia.com/-A10", "must be 1 to 63"),
        ("nvidia.com/a/b", "must be 1 to 63"),
        ("x.io/" + "a" * 64, "must be 1 to 63"),
    ],
)
def test_invalid_resource_name_is_reported(name, reason):
    assert any(reason in p for p in resource_name_problems(name)), resource_name_problems(name)


@pytest.mark.parametrize("name", ["nvidia.com/GA102GL_A10", "nvidia.com/L40S-24Q", "intel.com/qat.4xxx", "a.b/c"])
def test_valid_resource_names_pass(name):
    assert resource_name_problems(name) == ()


def test_socket_path_limit_is_107_bytes():
    fits = "example.com/" + "a" * (61 - len("example.com/"))
    too_long = fits + "a"
    assert len(socket_path(fits).encode()) == SOCKET_PATH_MAX
    assert resource_name_problems(fits) == ()
    [problem] = resource_name_problems(too_long)
    assert "108 bytes, the limit is 107" in problem and socket_path(too_long) in problem


def test_resource_name_problem_names_the_field():
    with pytest.raises(ValuesError) as raised:
        parse_values(values(mdev=[mdev("GRID T4-1Q", "GRID_T4-1Q")]))
    [problem] = raised.value.problems
    assert problem.startswith("gpu.permittedHostDevices.mediatedDevices[0].resourceName: 'GRID_T4-1Q' is not an")


def test_every_problem_is_listed_at_once():
    data = values(
        pci=[
            pci("10de-2236", "nvidia.com/A10"),
            pci("1AF4:1000", "virtio"),
            pci("1AF4:1041", "example.com/" + "x" * 55),
            pci("10DE:1EB8", "nvidia.com/T4"),
            {"pciVendorSelector": "1AF4:1042"},
        ],
        variant="mig",
        gates=[""],
        namespace="Cozy_KubeVirt",
    )
    data["gpu"]["replaceDefault"] = True
    with pytest.raises(ValuesError) as raised:
        parse_values(data)
    where = [p.split(": ", 1)[0] for p in raised.value.problems]
    assert sorted(where) == sorted([
        "gpu.replaceDefault",
        "gpu.variant",
        "gpu.permittedHostDevices.pciHostDevices[0].pciVendorSelector",
        "gpu.permittedHostDevices.pciHostDevices[4].resourceName",
        "gpu.permittedHostDevices.pciHostDevices[1].resourceName",
        "gpu.permittedHostDevices.pciHostDevices[2].resourceName",
        "kubevirt.namespace",
        "kubevirt.extraFeatureGates[0]",
    ]), raised.value.problems


def test_every_problem_is_listed_at_once_when_the_schema_is_fine():
    data = values(pci=[pci("10DE:2236", "nvidia.com/A10"), pci("1AF4:1000", "virtio"),
                       pci("1AF4:1041", "example.com/" + "x" * 55)])
    with pytest.raises(ValuesError) as raised:
        parse_values(data)
    assert len(raised.value.problems) == 3
    assert str(raised.value) == "\n".join(raised.value.problems)


def test_misspelt_setting_is_reported_with_a_suggestion():
    with pytest.raises(ValuesError) as raised:
        parse_values({"gpu": {"replaceDefault": True, "permittedHostDevices": {"pciHostDevice": []}}})
    assert raised.value.problems == [
        "gpu.replaceDefault: unknown setting; did you mean replaceDefaults?",
        "gpu.permittedHostDevices.pciHostDevice: unknown setting; did you mean pciHostDevices?",
    ]


def test_other_unknown_settings_pass_so_helm_values_can_be_used_as_is():
    spec = parse_values({"gpu": {"vgpuManager": {"image": "x"}}, "bundles": {"iaas": {}}})
    assert spec.gpu.variant == "default"


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ([], "values: expected a mapping of settings (kubevirt, gpu, ...), got a list"),
        ({"gpu": "vgpu"}, "gpu: expected a mapping, got 'vgpu'"),
        ({"gpu": {"replaceDefaults": "maybe"}}, "gpu.replaceDefaults: expected true or false, got 'maybe'"),
        ({"gpu": {"permittedHostDevices": {"pciHostDevices": [{"resourceName": "nvidia.com/A10"}]}}},
         "gpu.permittedHostDevices.pciHostDevices[0].pciVendorSelector: is required"),
        ({"kubevirt": {"extraFeatureGates": "Snapshot"}}, "kubevirt.extraFeatureGates: expected a list, got 'Snapshot'"),
    ],
)
def test_schema_errors_become_sentences_naming_the_field(data, problem):
    with pytest.raises(ValuesError) as raised:
        parse_values(data)
    assert raised.value.problems == [problem]


def test_empty_values_are_the_defaults():
    assert parse_values(None) == parse_values({})


# --- the output's shape -----------------------------------------------------------------------


def test_patch_holds_only_the_fields_this_operator_owns():
    result = rendered(values(namespace="cozy-kubevirt", name="kv"))
    assert result.patch["apiVersion"] == "kubevirt.io/v1" and result.patch["kind"] == "KubeVirt"
    # The gates we apply are recorded in the same apply (their list is atomic, so its managedFields cannot say which).
    assert result.patch["metadata"] == {"name": "kv", "namespace": "cozy-kubevirt",
                                        "annotations": {"passthrough.io/feature-gates": "HostDevices"}}
    assert list(result.patch["spec"]) == ["configuration"]
    assert set(result.patch["spec"]["configuration"]) == {"permittedHostDevices", "developerConfiguration"}
    assert list(result.patch["spec"]["configuration"]["developerConfiguration"]) == ["featureGates"]
    assert result.patch["spec"]["configuration"]["permittedHostDevices"] == {"pciHostDevices": result.pci_host_devices}



def test_allow_list_entries_reach_the_patch_unchanged_as_copies():
    data = values(pci=[pci("1af4:1000", "example.com/on")], mdev=[mdev("GRID T4-16Q", "nvidia.com/GRID_T4-16Q", False)])
    result = rendered(data)
    permitted = result.patch["spec"]["configuration"]["permittedHostDevices"]
    assert permitted == {"pciHostDevices": result.pci_host_devices, "mediatedDevices": result.mediated_devices}
    assert list(permitted["pciHostDevices"][-1]) == ["pciVendorSelector", "resourceName", "externalResourceProvider"]
    permitted["pciHostDevices"][-1]["resourceName"] = "example.com/changed"
    assert result.pci_host_devices[-1]["resourceName"] == "example.com/on"
    package = cozystack_package(result)["spec"]["components"]["kubevirt"]["values"]
    assert package["permittedHostDevices"]["pciHostDevices"][-1]["resourceName"] == "example.com/on"

def _conforms(value, schema, path="$"):
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind in types:
        assert isinstance(value, types[kind]), f"{path}: {value!r} is not {kind}"
    if isinstance(value, dict) and "properties" in schema:
        for key in schema.get("required", []):
            assert key in value, f"{path}.{key} is required"
        for key, sub in value.items():
            assert key in schema["properties"], f"{path}.{key} is not in KubeVirt's schema"
            _conforms(sub, schema["properties"][key], f"{path}.{key}")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _conforms(item, schema["items"], f"{path}[{i}]")


def test_patch_conforms_to_kubevirts_own_schema():
    [crd] = [c for c in kubevirt_crds.crds() if c["spec"]["names"]["kind"] == "KubeVirt"]
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    data = values(pci=[pci("1AF4:1000", "example.com/virtio", False)], mdev=[mdev("GRID T4-1Q", "nvidia.com/T4")],
                  gates=["Snapshot"])
    result = rendered(data, assigned=[AssignedDevice("pci-aaa", "8086", "1592")], live_gates=["CPUManager"])
    _conforms(result.patch["spec"], schema["properties"]["spec"], "spec")


def test_cozystack_package_carries_our_gates_and_the_allow_list():
    data = values(pci=[pci("1AF4:1000", "example.com/virtio")], gates=["Snapshot"])
    result = rendered(data, live_gates=["CPUManager"])
    package = cozystack_package(result)
    assert package["apiVersion"] == "cozystack.io/v1alpha1" and package["kind"] == "Package"
    assert package["metadata"] == {"name": "cozystack.kubevirt"}
    component = package["spec"]["components"]["kubevirt"]["values"]
    assert component["extraFeatureGates"] == ["HostDevices", "Snapshot"]
    assert component["permittedHostDevices"] == {"pciHostDevices": result.pci_host_devices}


def test_cozystack_package_leaves_an_empty_allow_list_out():
    package = cozystack_package(rendered(values(replace=True)))
    assert "permittedHostDevices" not in package["spec"]["components"]["kubevirt"]["values"]


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"kubevirt": {"gpu": {"replaceDefaults": True}}},
         "kubevirt.gpu: unknown setting here: gpu is a setting of the top level (check the indentation)"),
        ({"gpu": {"permittedHostDevices": {"replaceDefaults": True}}},
         "gpu.permittedHostDevices.replaceDefaults: unknown setting here: replaceDefaults is a setting of gpu (check the indentation)"),
        ({"extraFeatureGates": ["Snapshot"]},
         "extraFeatureGates: unknown setting here: extraFeatureGates is a setting of kubevirt (check the indentation)"),
    ],
)
def test_a_setting_nested_at_the_wrong_level_is_refused_with_its_path(data, problem):
    # It used to be dropped without a word: the default table stayed, the gate was not applied.
    with pytest.raises(ValuesError) as raised:
        parse_values(data)
    assert raised.value.problems == [problem]


def test_with_dra_assigned_devices_get_no_entry_and_kubevirt_takes_claims():
    assigned = [AssignedDevice("pci-a10", "10de", "2236"), AssignedDevice("pci-nic", "8086", "1592")]
    plain = rendered(values(), assigned=assigned)
    assert {"passthrough.io/pci-a10", "passthrough.io/pci-nic"} <= set(names(plain))
    assert plain.feature_gates == ["HostDevices"]
    dra = rendered({**values(), "dra": {"enabled": True}}, assigned=assigned)
    # A VM names a ResourceClaim: no exclusive entries (nor their share of the CR's ceiling).
    assert names(dra) == TABLE and not dra.left_out
    assert dra.our_feature_gates == ["HostDevices", "HostDevicesWithDRA", "GPUsWithDRA"]
    assert dra.patch["spec"]["configuration"]["developerConfiguration"]["featureGates"] == dra.feature_gates


def test_where_nodes_choose_their_mode_kubevirt_gets_the_dra_gates_and_the_entries_it_is_given():
    # The operator passes only the devices of device-plugin nodes: those keep their entries beside the DRA gates.
    assigned = [AssignedDevice("pci-a10", "10de", "2236")]
    for dra in ({"enabled": False, "perNode": True}, {"enabled": True, "perNode": True}):
        mixed = rendered({**values(), "dra": dra}, assigned=assigned)
        assert "passthrough.io/pci-a10" in names(mixed)
        assert mixed.our_feature_gates == ["HostDevices", "HostDevicesWithDRA", "GPUsWithDRA"]
