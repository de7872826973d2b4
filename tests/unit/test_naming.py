"""Resource and object names, checked against what NVIDIA's plugin and Cozystack really use."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from passthrough.pci import naming
from passthrough.pci.pciids import PciIds

REPO = Path(__file__).resolve().parents[2]
DB_2025 = PciIds.load(REPO / "e2e" / "data" / "pci.ids.2025-07-11")
DB_2023 = PciIds.load(REPO / "e2e" / "data" / "pci.ids.2023-04-10")
COZYSTACK = yaml.safe_load((REPO / "tests" / "data" / "cozystack-gpu-passthrough-defaults.yaml").read_text())


def test_rev_dot_gives_two_underscores():
    assert naming.gpu_resource_name("10de", "1f08", DB_2025) == "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"


def test_spaced_slash_gives_three_underscores():
    assert naming.gpu_resource_name("10de", "2342", DB_2025) == "nvidia.com/GH100_GH200_120GB___480GB"


def test_hyphens_are_dropped():
    assert naming.plugin_name("GA100 [A800-SXM4-80GB]") == "GA100_A800SXM480GB"
    assert naming.gpu_resource_name("10de", "20f3", DB_2025) == "nvidia.com/GA100_A800SXM480GB"


def test_an_id_missing_from_the_database_gives_the_lowercase_hex_id():
    assert naming.gpu_resource_name("10de", "26B5", PciIds()) == "nvidia.com/26b5"


def test_the_a10_is_ga102gl_a10():
    assert naming.gpu_resource_name("10de", "2236", DB_2025) == "nvidia.com/GA102GL_A10"


@pytest.mark.parametrize("entry", COZYSTACK["pciHostDevices"], ids=lambda e: e["pciVendorSelector"])
def test_every_cozystack_default_matches_the_2025_edition(entry):
    vendor, device = entry["pciVendorSelector"].split(":")
    assert naming.gpu_resource_name(vendor, device, DB_2025) == entry["resourceName"]


def test_an_older_edition_names_a_card_differently_or_by_its_hex_id():
    assert naming.gpu_resource_name("10de", "2321", DB_2023) == "nvidia.com/GH100"
    assert naming.gpu_resource_name("10de", "2335", DB_2023) == "nvidia.com/2335"


def test_a_name_with_nothing_left_after_the_rule_gives_the_hex_id():
    db = PciIds.parse("10de  NVIDIA Corporation\n\t1234  [???]\n")
    assert naming.gpu_resource_name("10de", "1234", db) == "nvidia.com/1234"


def test_other_gpu_vendors_get_their_own_domain():
    assert naming.gpu_resource_name("1002", "74a1", DB_2025) == "amd.com/AQUA_VANJARAM_INSTINCT_MI300X"
    assert naming.gpu_resource_name("8086", "56c0", DB_2025) == "intel.com/ATSM_DATA_CENTER_GPU_FLEX_170"


def test_a_vendor_outside_the_table_has_no_gpu_name():
    with pytest.raises(ValueError, match="1af4"):
        naming.gpu_resource_name("1af4", "1041", DB_2025)


def test_only_display_controllers_of_gpu_vendors_are_pooled():
    assert naming.pool_resource_name("10de", "2236", "030200", DB_2025) == "nvidia.com/GA102GL_A10"
    assert naming.pool_resource_name("10DE", "2236", "030000", DB_2025) == "nvidia.com/GA102GL_A10"
    assert naming.pool_resource_name("10de", "1aef", "040300", DB_2025) == ""  # the A10's audio function
    assert naming.pool_resource_name("102b", "0536", "030000", DB_2025) == ""  # a BMC's Matrox VGA


# Go's details, worked out by hand from strings.TrimSpace, strings.ToUpper and RE2's \s.
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("\u00a0 GA102GL [A10] \u3000", "GA102GL_A10"),  # Go trims Unicode spaces
        ("A\vB", "AB"),  # a vertical tab is not RE2's \s: dropped, not "_"
        ("A\u00a0B", "AB"),  # nor is a no-break space inside a name
        ("Stra\u00dfe", "STRAE"),  # Go upper-cases rune by rune: ß stays ß and is dropped
        ("\u0131\u017f", "IS"),  # ı and ſ upper-case to ASCII in Go too
        ("\x1c A", "_A"),  # Go does not trim an information separator, Python would
    ],
)
def test_the_rule_follows_go_where_python_differs(name, expected):
    assert naming.plugin_name(name) == expected


def test_exclusive_resources_are_named_for_the_object():
    assert naming.exclusive_resource_name("pci-0123abcd") == "passthrough.io/pci-0123abcd"


def test_node_pci_device_names_are_sha1_of_address_ids_and_node():
    name = naming.node_pci_device_name("0000:3b:00.0", "10de", "2236", "gpu-1")
    assert name == "pci-" + hashlib.sha1(b"0000:3b:00.0-10de-2236-gpu-1").hexdigest()
    assert naming.node_pci_device_name("0000:3B:00.0", "10DE", "2236", "gpu-1") == name
    assert naming.node_pci_device_name("0000:3b:00.0", "10de", "2236", "gpu-2") != name


def test_env_names_upper_case_and_keep_hyphens():
    assert naming.resource_env_name("nvidia.com/GA102GL_A10") == "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10"
    assert naming.resource_env_name("passthrough.io/pci-3f2a") == "PCI_RESOURCE_PASSTHROUGH_IO_PCI-3F2A"
