"""What Allocate and GetPreferredAllocation answer: the pure functions behind the device plugin."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from passthrough.deviceplugin.allocation import (
    AllocationError,
    DeviceNode,
    PluginDevice,
    allocate_response,
    preferred_allocation,
)

A10 = "nvidia.com/GA102GL_A10"


def pci(n: int) -> str:
    return f"0000:{n // 32:02x}:{n % 32:02x}.0"


def devices_of(*specs: tuple[int, int, int]) -> dict[str, PluginDevice]:
    """(address number, IOMMU group, NUMA node) -> the devices of a plugin."""
    return {pci(n): PluginDevice(pci(n), group, numa) for n, group, numa in specs}


# A pool of up to 12 devices, each in its own or a shared group, on NUMA node 0, 1 or none.
pools = st.lists(
    st.tuples(st.integers(0, 5), st.integers(-1, 1)), min_size=1, max_size=12
).map(lambda specs: {pci(i): PluginDevice(pci(i), group, numa) for i, (group, numa) in enumerate(specs)})


def test_env_is_named_for_the_resource_as_virt_launcher_reads_it():
    devices = devices_of((1, 7, 0))
    allocation = allocate_response(A10, [pci(1)], devices)
    assert allocation.envs == {"PCI_RESOURCE_NVIDIA_COM_GA102GL_A10": pci(1)}
    exclusive = allocate_response("passthrough.io/pci-ab-cd", [pci(1)], devices)
    assert list(exclusive.envs) == ["PCI_RESOURCE_PASSTHROUGH_IO_PCI-AB-CD"]  # hyphens kept


@given(pools, st.randoms())
def test_env_lists_exactly_the_asked_addresses_in_the_order_asked(devices, rnd):
    asked = rnd.sample(sorted(devices), rnd.randint(1, len(devices)))
    allocation = allocate_response(A10, asked, devices)
    assert list(allocation.envs.values()) == [",".join(asked)]


def test_a_sibling_function_in_the_same_iommu_group_takes_no_slot():
    # The GPU's audio function shares group 7; asking for the GPU alone lists the GPU alone.
    devices = devices_of((1, 7, 0), (2, 7, 0))
    allocation = allocate_response(A10, [pci(1)], devices)
    assert allocation.envs["PCI_RESOURCE_NVIDIA_COM_GA102GL_A10"] == pci(1)
    assert [d.host_path for d in allocation.devices] == ["/dev/vfio/vfio", "/dev/vfio/7"]


@given(pools, st.randoms())
def test_device_nodes_are_the_vfio_container_and_each_group_once(devices, rnd):
    asked = rnd.sample(sorted(devices), rnd.randint(1, len(devices)))
    allocation = allocate_response(A10, asked, devices, vfio_dir="/host/dev/vfio/")
    groups = list(dict.fromkeys(devices[a].iommu_group for a in asked))
    assert allocation.devices == tuple(
        DeviceNode(p, p, "rw") for p in ["/host/dev/vfio/vfio", *(f"/host/dev/vfio/{g}" for g in groups)]
    )


def test_an_unknown_device_is_refused_naming_the_device_and_the_resource():
    with pytest.raises(AllocationError, match=r"0000:99:00\.0.*nvidia\.com/GA102GL_A10"):
        allocate_response(A10, [pci(1), "0000:99:00.0"], devices_of((1, 7, 0)))


def test_an_unhealthy_device_is_refused():
    devices = {pci(1): PluginDevice(pci(1), 7, 0, healthy=False)}
    with pytest.raises(AllocationError, match=r"0000:00:01\.0 of nvidia\.com/GA102GL_A10 is unhealthy"):
        allocate_response(A10, [pci(1)], devices)


def test_a_device_asked_for_twice_or_nothing_asked_is_refused():
    devices = devices_of((1, 7, 0))
    with pytest.raises(AllocationError, match="twice"):
        allocate_response(A10, [pci(1), pci(1)], devices)
    with pytest.raises(AllocationError, match="no device"):
        allocate_response(A10, [], devices)


def test_preferred_allocation_stays_on_one_numa_node():
    # Node 0 has 0:01, 0:03; node 1 has 0:02, 0:04, 0:05.
    devices = devices_of((1, 1, 0), (2, 2, 1), (3, 3, 0), (4, 4, 1), (5, 5, 1))
    everything = sorted(devices)
    assert preferred_allocation(everything, [], 2, devices) == [pci(2), pci(4)]  # the node with most free
    assert preferred_allocation(everything, [pci(3)], 2, devices) == [pci(3), pci(1)]  # the must-include's node
    assert preferred_allocation(everything, [pci(3)], 3, devices) == [pci(3), pci(1), pci(2)]  # then the next node


def test_preferred_allocation_breaks_ties_by_node_then_address():
    devices = devices_of((4, 1, 1), (3, 2, 1), (2, 3, 0), (1, 4, 0))
    assert preferred_allocation(sorted(devices, reverse=True), [], 2, devices) == [pci(1), pci(2)]


def test_preferred_allocation_puts_devices_of_no_numa_node_last():
    devices = devices_of((1, 1, -1), (2, 2, -1), (3, 3, 0), (4, 4, 0))
    assert preferred_allocation(sorted(devices), [], 3, devices) == [pci(3), pci(4), pci(1)]


@given(pools, st.data())
def test_preferred_allocation_includes_the_must_and_only_what_is_available(devices, data):
    ids = sorted(devices)
    available = data.draw(st.lists(st.sampled_from(ids), unique=True, min_size=1))
    must = data.draw(st.lists(st.sampled_from(available), unique=True, max_size=len(available)))
    size = data.draw(st.integers(len(must), len(available)))
    chosen = preferred_allocation(available, must, size, devices)
    assert len(chosen) == len(set(chosen)) == max(size, len(must))
    assert set(must) <= set(chosen) <= set(available)
    assert chosen[: len(must)] == sorted(must)
    shuffled = random.Random(0).sample(available, len(available))
    assert preferred_allocation(shuffled, list(reversed(must)), size, devices) == chosen


@given(pools, st.integers(1, 12))
def test_preferred_allocation_uses_one_node_when_one_node_has_enough(devices, size):
    available = sorted(devices)
    per_node: dict[int, int] = {}
    for d in devices.values():
        per_node[d.numa_node] = per_node.get(d.numa_node, 0) + 1
    if max(per_node.values()) < size:
        return
    chosen = preferred_allocation(available, [], size, devices)
    assert len({devices[c].numa_node for c in chosen}) == 1


def test_iommufd_nodes_are_handed_over_only_for_devices_that_have_them():
    # KubeVirt 1.9's IOMMUFD gate opens /dev/vfio/devices/vfio<N> and /dev/iommu; 1.9.0 broke on
    # kernels without them, so a device without its character device gets neither.
    devices = {
        "0000:3b:00.0": PluginDevice("0000:3b:00.0", 20, cdev="vfio0"),
        "0000:af:00.0": PluginDevice("0000:af:00.0", 21),
    }
    with_cdev = allocate_response("nvidia.com/GA102GL_A10", ["0000:3b:00.0"], devices)
    assert [d.container_path for d in with_cdev.devices] == [
        "/dev/vfio/vfio", "/dev/vfio/20", "/dev/vfio/devices/vfio0", "/dev/iommu"]  # fmt: skip
    without = allocate_response("nvidia.com/GA102GL_A10", ["0000:af:00.0"], devices)
    assert [d.container_path for d in without.devices] == ["/dev/vfio/vfio", "/dev/vfio/21"]
