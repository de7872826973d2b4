"""`passthrough discover` and `passthrough resource-name`, run as the CLI runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e import fakesysfs
from e2e.fakesysfs import gpu_node, storage_node
from passthrough import cli
from passthrough.pci import pciids

IDS_2025 = str(Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11")
DEVICE_FIELDS = {
    "pciAddress", "vendorID", "deviceID", "subsystemVendorID", "subsystemDeviceID", "class", "driver",
    "iommuGroup", "numaNode", "vendorName", "name", "resourceName", "eligible", "reason",
}  # fmt: skip


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def discover_args(host, *extra: str) -> list[str]:
    return ["discover", "--sysfs-root", str(host.sysfs), "--proc-root", str(host.proc), "--pci-ids", IDS_2025, *extra]


def test_discover_json_has_the_api_field_names(tmp_path, capsys):
    code, out, err = run(capsys, *discover_args(gpu_node(tmp_path), "-o", "json"))
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["node"] == {"iommuEnabled": True, "vfioAvailable": True}
    addresses = [d["pciAddress"] for d in doc["devices"]]
    assert addresses == ["0000:3b:00.0", "0000:3b:00.1", "0000:af:00.0", "0000:af:00.1"]
    for device in doc["devices"]:
        assert set(device) == DEVICE_FIELDS
    gpu = doc["devices"][0]
    assert (gpu["vendorID"], gpu["deviceID"], gpu["class"], gpu["iommuGroup"]) == ("10de", "2236", "030200", 20)
    assert gpu["resourceName"] == "nvidia.com/GA102GL_A10" and gpu["eligible"] is True


def test_discover_all_also_lists_what_the_agent_leaves_out(tmp_path, capsys):
    _, out, _ = run(capsys, *discover_args(gpu_node(tmp_path), "-o", "json", "--all"))
    addresses = [d["pciAddress"] for d in json.loads(out)["devices"]]
    assert "0000:00:03.0" in addresses and "0000:00:00.0" in addresses and len(addresses) == 7


def test_discover_table_shows_the_reason_under_an_ineligible_row(tmp_path, capsys):
    code, out, _ = run(capsys, *discover_args(storage_node(tmp_path)))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "IOMMU: enabled; vfio-pci: available"
    assert lines[1].split() == [
        "ADDRESS", "VENDOR:DEVICE", "CLASS", "DRIVER", "GROUP", "NUMA", "ELIGIBLE", "RESOURCE", "NAME",
    ]  # fmt: skip
    row = next(i for i, line in enumerate(lines) if line.startswith("0000:18:00.0"))
    assert lines[row].split()[:7] == ["0000:18:00.0", "8086:1593", "020000", "ice", "30", "-", "no"]
    assert lines[row + 1].strip().startswith("reason: network interface eth0 is up")
    assert not any(line.startswith("0000:00:01.0") for line in lines)
    assert "left out" in lines[-1] and "--all" in lines[-1]


def test_discover_says_a_missing_database_once_on_stderr(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pciids, "SEARCH_PATHS", (str(tmp_path / "none.ids"),))
    host = gpu_node(tmp_path / "host")
    code, out, err = run(capsys, "discover", "--sysfs-root", str(host.sysfs), "--proc-root", str(host.proc), "-o", "json")
    assert code == 0
    assert err.count("none.ids") == 1
    assert json.loads(out)["devices"][0]["resourceName"] == "nvidia.com/2236"


def test_discover_refuses_a_named_database_it_cannot_use(tmp_path, capsys):
    host = gpu_node(tmp_path)
    code, out, err = run(capsys, *discover_args(host)[:-1], str(tmp_path / "missing.ids"))
    assert code == 2 and out == "" and "missing.ids" in err


def test_discover_refuses_a_sysfs_root_that_is_not_there(tmp_path, capsys):
    code, out, err = run(capsys, "discover", "--sysfs-root", str(tmp_path / "nowhere"), "--pci-ids", IDS_2025)
    assert code == 2 and out == "" and "nowhere" in err


def test_resource_names_are_printed_in_argument_order(capsys):
    code, out, err = run(capsys, "resource-name", "--pci-ids", IDS_2025, "10de:2342", "10DE:2236", "10de:1f08")
    assert code == 0
    assert err == f"passthrough resource-name: names from pci.ids {IDS_2025} (version 2025.07.11, dated 2025-07-11 03:15:02)\n"
    assert out.splitlines() == [
        "nvidia.com/GH100_GH200_120GB___480GB",
        "nvidia.com/GA102GL_A10",
        "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A",
    ]


def test_an_unknown_device_gets_its_hex_id(capsys):
    _, out, _ = run(capsys, "resource-name", "--pci-ids", IDS_2025, "10de:ffff")
    assert out == "nvidia.com/ffff\n"


def test_a_device_unknown_to_an_older_edition_is_warned_about_naming_the_edition(capsys):
    # 10de:2bb5 came into pci.ids after 2023: that edition names it by its hex ID, and says so.
    older = IDS_2025.replace("2025-07-11", "2023-04-10")
    code, out, err = run(capsys, "resource-name", "--pci-ids", older, "10de:2236", "10de:2bb5")
    assert code == 0 and out == "nvidia.com/GA102GL_A10\nnvidia.com/2bb5\n"
    edition = f"pci.ids {older} (version 2023.04.10, dated 2023-04-10 20:08:02)"
    [said, warning] = err.splitlines()
    assert said == f"passthrough resource-name: names from {edition}"
    assert warning.startswith(f"warning: 10de:2bb5 is not in {edition}, so its name is its device ID; a newer pci.ids")
    assert "10de:2236" not in err


@pytest.mark.parametrize("bad", ["10de:22", "nvidia", "10de-2236", "10de:2236:0", "g0de:2236"])
def test_a_malformed_id_exits_2_naming_it_with_nothing_on_stdout(capsys, bad):
    code, out, err = run(capsys, "resource-name", "--pci-ids", IDS_2025, "10de:2236", bad)
    assert code == 2 and out == ""
    assert bad in err and "VENDOR:DEVICE" in err


def test_a_vendor_outside_the_gpu_table_exits_2_saying_what_is_accepted(capsys):
    code, out, err = run(capsys, "resource-name", "--pci-ids", IDS_2025, "10de:2236", "1af4:1041")
    assert code == 2 and out == ""
    assert "1af4:1041" in err and "10de" in err and "1002" in err and "8086" in err


def test_discover_names_the_damaged_lines_of_a_database_it_still_uses(tmp_path, capsys):
    ids = tmp_path / "pci.ids"
    ids.write_bytes(Path(IDS_2025).read_bytes() + b"\tzzzz  not an entry\n")
    host = gpu_node(tmp_path / "host")
    code, out, err = run(capsys, "discover", "--sysfs-root", str(host.sysfs), "--proc-root", str(host.proc),
                         "--pci-ids", str(ids), "-o", "json")  # fmt: skip
    assert code == 0
    assert json.loads(out)["devices"][0]["resourceName"] == "nvidia.com/GA102GL_A10"
    assert "damaged lines" in err and "zzzz" in err and "reinstall the hwdata" in err


def test_discover_check_passes_a_ready_node_with_exit_0(tmp_path, capsys):
    code, out, err = run(capsys, *discover_args(gpu_node(tmp_path), "--check"))
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "IOMMU     ok    enabled",
        "vfio-pci  ok    loaded",
        "devices   ok    4 of 4 can be passed through: 0000:3b:00.0 (GA102GL [A10]), 0000:3b:00.1 (GA102 High Definition "
        "Audio Controller), 0000:af:00.0 (GA102GL [A10]), 0000:af:00.1 (GA102 High Definition Audio Controller)",
        "ready for passthrough",
    ]


def test_discover_check_fails_a_node_without_vfio_pci_or_iommu_with_exit_3_saying_what_to_do(tmp_path, capsys):
    code, out, _ = run(capsys, *discover_args(gpu_node(tmp_path / "novfio", vfio=False), "--check"))
    assert code == 3
    lines = out.splitlines()
    assert lines[1] == "vfio-pci  FAIL  not loaded: load it (modprobe vfio-pci) and keep it loaded at boot (vfio-pci in /etc/modules-load.d/)"
    assert lines[-1] == "not ready for passthrough (exit 3)"
    # Without an IOMMU, no device can be passed through either; JSON says the same for a script.
    host = fakesysfs.FakeHost(tmp_path / "noiommu", iommu=False)
    host.add_device("0000:3b:00.0", "10de", "2236", "030200", driver="nvidia")
    code, out, _ = run(capsys, "discover", "--sysfs-root", str(host.sysfs), "--proc-root", str(host.proc),
                       "--pci-ids", IDS_2025, "--check", "-o", "json")  # fmt: skip
    doc = json.loads(out)
    assert code == 3 and doc["ready"] is False
    assert [(c["name"], c["ok"]) for c in doc["checks"]] == [("IOMMU", False), ("vfio-pci", True), ("devices", False)]
    assert "intel_iommu=on" in doc["checks"][0]["todo"] and doc["checks"][0]["said"].startswith("not enabled (")


def test_the_agents_node_labels_say_the_preflight_in_its_words():
    from passthrough.pci.discovery import NodeState
    from passthrough.pci.preflight import node_labels

    assert node_labels(NodeState(iommu_enabled=True, vfio_available=False)) == {
        "passthrough.io/vfio": "false", "passthrough.io/iommu": "enabled", "passthrough.io/vfio-pci": "missing"}
    assert node_labels(NodeState(iommu_enabled=True, vfio_available=True))["passthrough.io/vfio"] == "true"
