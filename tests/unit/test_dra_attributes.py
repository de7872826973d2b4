"""The standard attributes a ResourceSlice device carries beside pciBusID, as Kubernetes'
deviceattribute package defines them: `resource.kubernetes.io/pcieRoot` (`pci<domain>:<bus>`,
the first directory under /sys/devices on the way to the device) and
`resource.kubernetes.io/numaNode` (an int, left out where the device has none)."""

from __future__ import annotations

import dataclasses
import os

from passthrough.dra import slice as dra_slice
from tests.unit.test_dra import GPUS, gpu_node, pci_ids  # noqa: F401  (fixtures)


def test_the_pcie_root_is_read_from_where_the_bus_link_leads_as_upstream_reads_it():
    # upstream's own cases (deviceattribute/pci_linux_test.go): a device behind a bridge; a link
    # into no pci root; a link to another device.
    assert dra_slice.pcie_root("../../../devices/pci0000:00/0000:01:00.0/0000:02:00.0", "0000:02:00.0") == "pci0000:00"
    assert dra_slice.pcie_root("../../../devices/invalid-pci-root/0000:01:00.0/0000:02:00.0", "0000:02:00.0") == ""
    assert dra_slice.pcie_root("../../../devices/pci0000:00/0000:01:00.0/0000:00:13.1", "0000:02:00.0") == ""
    # A second domain, and a link that is no sysfs link.
    assert dra_slice.pcie_root("../../../devices/pci10000:80/10000:80:01.0/10000:81:00.0", "10000:81:00.0") == "pci10000:80"
    assert dra_slice.pcie_root("/sys/devices/pci0000:00/0000:02:00.0", "0000:02:00.0") == ""


def test_a_published_device_carries_its_pcie_root_and_numa_node(gpu_node, tmp_path):  # noqa: F811
    devices, names = gpu_node
    host_links = {a: os.readlink(tmp_path / "sys" / "bus" / "pci" / "devices" / a) for a in GPUS}
    roots = {a: dra_slice.pcie_root(link, a) for a, link in host_links.items()}
    assert roots == {a: "pci0000:00" for a in GPUS}
    [item] = dra_slice.publishable(devices, {names[GPUS[1]]: "team-a"}, names, False, roots=roots)
    attributes = dra_slice.attributes(item)
    assert attributes[dra_slice.PCIE_ROOT] == {"string": "pci0000:00"}
    assert attributes[dra_slice.NUMA_NODE] == {"int": 1}
    assert attributes[dra_slice.PCI_BUS_ID] == {"string": GPUS[1]}

    # No NUMA node (-1) and no root known: neither is published (a -1 would match every other -1).
    bare = dataclasses.replace(item, device=dataclasses.replace(item.device, numa_node=-1), pcie_root="")
    assert dra_slice.PCIE_ROOT not in dra_slice.attributes(bare) and dra_slice.NUMA_NODE not in dra_slice.attributes(bare)
