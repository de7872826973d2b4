"""The allow-list against the resource names nodes really advertise.

The "older node" reads Debian 12's pci.ids (e2e/data/pci.ids.2023-04-10), where 10de:2321 is
`GH100` and 10de:2335 is missing, so its agent advertises nvidia.com/GH100 and nvidia.com/2335
for cards the table calls nvidia.com/GH100_H100L_94GB and nvidia.com/GH100_H200_SXM_141GB.
"""

from pathlib import Path

import pytest

from passthrough.kubevirt.allowlist import AssignedDevice, default_table
from passthrough.kubevirt.mismatches import Advertised, Mismatch, mismatches
from passthrough.kubevirt.render import render
from passthrough.kubevirt.values import parse_values
from passthrough.pci.naming import gpu_resource_name
from passthrough.pci.pciids import PciIds

DATA = Path(__file__).resolve().parents[2] / "e2e" / "data"

H100L = "nvidia.com/GH100_H100L_94GB"
H200 = "nvidia.com/GH100_H200_SXM_141GB"
A10 = "nvidia.com/GA102GL_A10"


def gpu(node, address, device, name, vendor="10de"):
    return Advertised(node=node, pci_address=address, vendor_id=vendor, device_id=device, resource_name=name)


def allow_list(pci=(), replace=False, assigned=()):
    spec = parse_values({"gpu": {"replaceDefaults": replace, "permittedHostDevices": {"pciHostDevices": list(pci)}}})
    return render(spec, assigned=assigned).pci_host_devices


def test_a_card_an_older_pci_ids_names_differently_is_reported_with_the_name_expected():
    nodes = [gpu("new", "0000:3b:00.0", "2321", H100L), gpu("old", "0000:3b:00.0", "2321", "nvidia.com/GH100")]
    _, not_permitted = mismatches(allow_list(), nodes)
    assert not_permitted == [Mismatch("nvidia.com/GH100", "10DE:2321", "old", "0000:3b:00.0", H100L)]
    assert not_permitted[0].message == (
        "node old advertises nvidia.com/GH100 for 10DE:2321 (0000:3b:00.0), "
        "the allow-list expects nvidia.com/GH100_H100L_94GB"
    )


def test_a_card_an_older_pci_ids_lacks_is_reported_by_its_hex_name():
    _, not_permitted = mismatches(allow_list(), [gpu("old", "0000:af:00.0", "2335", "nvidia.com/2335")])
    assert not_permitted == [Mismatch("nvidia.com/2335", "10DE:2335", "old", "0000:af:00.0", H200)]


def test_names_compare_case_sensitively_as_virt_controller_does():
    _, not_permitted = mismatches(allow_list(), [gpu("n1", "0000:3b:00.0", "2236", A10.lower())])
    assert [m.expected for m in not_permitted] == [A10]


def test_a_gpu_of_a_model_the_allow_list_lacks_has_no_selector():
    _, not_permitted = mismatches(allow_list(), [gpu("n1", "0000:3b:00.0", "2684", "nvidia.com/AD102_GEFORCE_RTX_4090")])
    assert not_permitted == [Mismatch("nvidia.com/AD102_GEFORCE_RTX_4090", "", "n1", "0000:3b:00.0")]
    assert "which the allow-list lacks" in not_permitted[0].message


def test_every_advertised_gpu_is_reported_sorted():
    nodes = [
        gpu("old-2", "0000:3b:00.0", "2321", "nvidia.com/GH100"),
        gpu("old-1", "0000:86:00.0", "2321", "nvidia.com/GH100"),
        gpu("old-1", "0000:3b:00.0", "2321", "nvidia.com/GH100"),
        gpu("old-1", "0000:3b:00.0", "2335", "nvidia.com/2335"),
    ]
    _, not_permitted = mismatches(allow_list(), nodes)
    assert [(m.resource_name, m.node, m.pci_address) for m in not_permitted] == [
        ("nvidia.com/2335", "old-1", "0000:3b:00.0"),
        ("nvidia.com/GH100", "old-1", "0000:3b:00.0"),
        ("nvidia.com/GH100", "old-1", "0000:86:00.0"),
        ("nvidia.com/GH100", "old-2", "0000:3b:00.0"),
    ]


def test_allow_listed_names_no_node_advertises_are_reported_sorted():
    not_advertised, not_permitted = mismatches(allow_list(), [gpu("n1", "0000:3b:00.0", "2236", A10)])
    assert not_permitted == []
    expected = sorted(Mismatch(d["resourceName"], d["pciVendorSelector"]) for d in default_table() if d["resourceName"] != A10)
    assert not_advertised == expected
    assert not_advertised[0].message.endswith("is allow-listed but no node advertises it")


def test_exclusive_and_kubevirt_served_entries_are_not_pool_names():
    pci = [{"pciVendorSelector": "8086:4940", "resourceName": "intel.com/QAT", "externalResourceProvider": False},
           {"pciVendorSelector": "10DE:2236", "resourceName": A10}]
    entries = allow_list(pci, replace=True, assigned=[AssignedDevice("pci-aaa", "15b3", "101d")])
    assert mismatches(entries, []) == ([Mismatch(A10, "10DE:2236")], [])


def test_an_exclusive_resource_a_node_advertises_is_permitted():
    entries = allow_list(replace=True, pci=[{"pciVendorSelector": "10DE:2236", "resourceName": A10}],
                         assigned=[AssignedDevice("pci-aaa", "10de", "2236")])
    nodes = [gpu("n1", "0000:3b:00.0", "2236", A10), gpu("n1", "0000:86:00.0", "2236", "passthrough.io/pci-aaa")]
    assert mismatches(entries, nodes) == ([], [])


def test_gpus_without_a_resource_name_are_ignored():
    assert mismatches(allow_list([{"pciVendorSelector": "10DE:2236", "resourceName": A10}], replace=True),
                      [gpu("n1", "0000:3b:00.0", "2236", A10), gpu("n1", "0000:86:00.0", "2236", "")]) == ([], [])


def test_without_an_allow_list_kubevirt_checks_nothing_and_nothing_mismatches():
    assert mismatches([], [gpu("old", "0000:3b:00.0", "2321", "nvidia.com/GH100")]) == ([], [])


def _node_with(edition):
    """One node with every card of the default table, named by its agent from `edition` of pci.ids."""
    pci_ids = PciIds.load(DATA / f"pci.ids.{edition}")
    cards = []
    for i, entry in enumerate(default_table()):
        vendor, device = entry["pciVendorSelector"].lower().split(":")
        cards.append(gpu(edition, f"0000:{i + 1:02x}:00.0", device, gpu_resource_name(vendor, device, pci_ids), vendor))
    return cards


def test_a_node_with_the_pci_ids_the_table_was_made_from_matches_it():
    assert mismatches(allow_list(), _node_with("2025-07-11")) == ([], [])


def test_a_node_with_an_older_pci_ids_is_reported_card_by_card():
    not_advertised, not_permitted = mismatches(allow_list(), _node_with("2023-04-10"))
    assert [(m.resource_name, m.selector, m.expected) for m in not_permitted] == [
        ("nvidia.com/2335", "10DE:2335", H200),
        ("nvidia.com/26b9", "10DE:26B9", "nvidia.com/AD102GL_L40S"),
        ("nvidia.com/GH100", "10DE:2321", H100L),
        ("nvidia.com/GH100H100_SXM5_80GB", "10DE:2330", "nvidia.com/GH100_H100_SXM5_80GB"),
    ]
    assert {m.resource_name for m in not_advertised} == {m.expected for m in not_permitted}


@pytest.mark.parametrize(("device", "name"), [("2321", "nvidia.com/GH100"), ("2335", "nvidia.com/2335")])
def test_the_older_names_used_above_are_the_2023_editions(device, name):
    assert gpu_resource_name("10de", device, PciIds.load(DATA / "pci.ids.2023-04-10")) == name


def test_an_exclusive_entry_is_not_the_pool_name_an_older_node_should_use():
    # With the table replaced, an assigned A10 is the only 10DE:2236 entry; a pooled A10 on a
    # node is simply not permitted, and no "expected" name is invented for it.
    from passthrough.kubevirt.mismatches import Advertised, mismatches

    entries = [{"pciVendorSelector": "10DE:2236", "resourceName": "passthrough.io/pci-abc", "externalResourceProvider": True}]
    _, not_permitted = mismatches(entries, [Advertised("n1", "0000:3b:00.0", "10de", "2236", "nvidia.com/GA102GL_A10")])
    assert [(m.resource_name, m.expected) for m in not_permitted] == [("nvidia.com/GA102GL_A10", "")]
