"""One server per device in DRA mode (`dra.others`): which devices other device plugins or other
DRA drivers have, with the rest of their IOMMU group, and why, as the NodePCIDevice says it."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import fakesysfs
from passthrough.dra import others
from passthrough.dra.preparer import _address_of
from passthrough.dra.slice import DRIVER, PCI_BUS_ID, device_name
from passthrough.pci.discovery import discover
from passthrough.pci.pciids import PciIds

NODE = "gpu-1"
GPU, AUDIO, OTHER_GPU = "0000:af:00.0", "0000:af:00.1", "0000:3b:00.0"  # af:00.x: IOMMU group 21


@pytest.fixture
def devices(tmp_path):
    host = fakesysfs.gpu_node(tmp_path)
    return discover(host.sysfs, host.proc, PciIds.load(Path(__file__).resolve().parents[2] / "e2e/data/pci.ids.2025-07-11")).devices


def a_slice(name: str, driver: str, node: str, *addresses: object) -> dict:
    return {"metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "devices": [{"name": f"d{i}", "attributes": {PCI_BUS_ID: {"string": a}} if a is not None else {}}
                                 for i, a in enumerate(addresses)]}}  # fmt: skip


def test_another_drivers_slice_of_this_node_names_the_addresses_it_publishes():
    found = others.by_other_drivers([a_slice("nv", "gpu.nvidia.com", NODE, "0000:AF:00.0 ", None)], NODE)
    assert found == {GPU: "DRA driver gpu.nvidia.com (ResourceSlice nv, device d0)"}


def test_our_own_slice_and_other_nodes_slices_are_no_other_server():
    slices = [a_slice("ours", DRIVER, NODE, GPU), a_slice("elsewhere", "gpu.nvidia.com", "gpu-2", GPU),
              {"metadata": {"name": "broken"}, "spec": {"driver": "x.io", "nodeName": NODE, "devices": [{"attributes": {PCI_BUS_ID: {"int": 3}}}]}}]  # fmt: skip
    assert others.by_other_drivers(slices, NODE) == {}


def test_two_drivers_publishing_one_address_are_both_named():
    found = others.merged([others.by_other_drivers([a_slice("b", "b.io", NODE, GPU)], NODE),
                           others.by_other_drivers([a_slice("a", "a.io", NODE, GPU)], NODE)])  # fmt: skip
    assert found[GPU].startswith("DRA driver a.io") and "DRA driver b.io" in found[GPU]


def test_a_device_a_plugin_serves_and_its_whole_group_are_not_ours(devices):
    found = others.elsewhere(devices, {GPU: "example.com/other-gpu"}, {})
    assert set(found) == {GPU, AUDIO}
    assert all(e.reason == "ServedByOtherPlugin" for e in found.values())
    assert "example.com/other-gpu" in str(found[GPU]) and "example.com/other-gpu" in str(found[AUDIO])
    assert f"shares its IOMMU group with {GPU}" in str(found[AUDIO])


def test_a_device_another_driver_publishes_is_not_ours_and_the_message_names_the_driver(devices):
    drivers = others.by_other_drivers([a_slice("nv", "gpu.nvidia.com", NODE, OTHER_GPU)], NODE)
    found = others.elsewhere(devices, {}, drivers)
    assert GPU not in found and OTHER_GPU in found
    assert found[OTHER_GPU].reason == "ServedByOtherPlugin" and "DRA driver gpu.nvidia.com" in str(found[OTHER_GPU])


def test_an_address_no_device_of_ours_has_costs_nothing(devices):
    assert set(others.elsewhere(devices, {"0000:01:00.0": "x.io/nic", "not-an-address": "y.io/z"}, {})) == {
        "0000:01:00.0", "not-an-address"}  # fmt: skip
    assert others.elsewhere(devices, {}, {}) == {}


def test_a_slice_device_name_gives_back_its_address():
    assert _address_of(device_name(GPU)) == GPU
    assert _address_of("gpu-0") == "" and _address_of("pci-0000-af-00") == ""
