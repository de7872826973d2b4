"""The node side on a real kernel: the real agent and the real kubelet in the guest, the operator
and the control plane on the host. An assigned device's whole IOMMU group goes to vfio-pci, the
device plugin's Allocate hands over what a VMM then opens, and the group comes back to its
drivers once unassigned."""

from __future__ import annotations

import json
import time

import pytest

from e2e.guest.machine import AUDIO, DISPLAY, address
from e2e.guest.node import allocate, assign, condition, drivers, wait, wait_drivers
from e2e.guest.vmm import NestedVmm
from passthrough.pci.naming import resource_env_name

DISPLAY_FN, AUDIO_FN = address("gpu", 0), address("gpu", 1)  # a GPU-like pair: one IOMMU group
ORIGINAL = {DISPLAY_FN: DISPLAY.driver, AUDIO_FN: AUDIO.driver}
ON_VFIO = {DISPLAY_FN: "vfio-pci", AUDIO_FN: "vfio-pci"}


@pytest.fixture(scope="module")
def assigned(guest, node, tenant):
    """The display function assigned to the tenant, its group bound by the agent."""
    group = int(guest.sh(f"basename $(readlink /sys/bus/pci/devices/{DISPLAY_FN}/iommu_group)").stdout)
    assert drivers(guest, list(ORIGINAL)) == ORIGINAL
    started = time.monotonic()
    assign(node, DISPLAY_FN, tenant)
    wait_drivers(guest, ON_VFIO, timeout=240)
    bound = time.monotonic() - started
    def served_as_its_own():
        device = node.devices()[DISPLAY_FN]
        return device if condition(device, "Assigned").get("status") == "True" and device["status"].get("resourceName") else None

    device = wait(served_as_its_own, 120, "Assigned=True and a resource name", node)
    print(f"\nassign to both functions on vfio-pci: {bound:.1f}s")
    yield {"group": group, "resource": device["status"]["resourceName"], "bind_seconds": bound}
    if node.devices()[DISPLAY_FN]["spec"].get("assignedNamespace"):  # a test failed before giving it back
        assign(node, DISPLAY_FN, "")


def test_assigned_group_goes_to_vfio_pci(guest, node, assigned):
    group = assigned["group"]
    assert drivers(guest, list(ON_VFIO)) == ON_VFIO, "every member of the group is on vfio-pci"
    assert guest.run("test", "-c", f"/dev/vfio/{group}", check=False).rc == 0, f"/dev/vfio/{group} exists"
    wait(
        lambda: all(node.devices()[a]["status"]["attributes"]["driver"] == "vfio-pci" for a in ON_VFIO),
        60, "the agent to report vfio-pci for both functions",
    )  # fmt: skip


def test_allocate_hands_over_what_a_vmm_opens(guest, node, assigned):
    resource, group = assigned["resource"], assigned["group"]
    # The kubelet in the guest took the plugin's registration: the node offers the device.
    wait(
        lambda: json.loads(node.cluster.kubectl("get", "node", node.name, "-o", "json").stdout)["status"]
        .get("allocatable", {}).get(resource) == "1",
        120, f"{resource}: 1 in the node's allocatable",
    )  # fmt: skip
    answer = allocate(guest, node.device_plugin_dir, resource, [DISPLAY_FN])
    addresses = answer["envs"][resource_env_name(resource)].split(",")
    assert addresses == [DISPLAY_FN], "only the allocated function, not its sibling"
    paths = {d["host_path"] for d in answer["devices"]}
    assert {"/dev/vfio/vfio", f"/dev/vfio/{group}"} <= paths

    # virt-launcher's part: a VMM opens each address it was handed.
    started = time.monotonic()
    with NestedVmm(guest, addresses) as vmm:
        opened = time.monotonic() - started
        seen = vmm.host_devices()
    assert sorted(seen) == addresses
    assert (seen[DISPLAY_FN]["id"]["vendor"], seen[DISPLAY_FN]["id"]["device"]) == (
        int(DISPLAY.vendor_id, 16), int(DISPLAY.device_id, 16),
    )  # fmt: skip
    print(f"\nnested VMM up with {addresses} in {opened:.1f}s")


def test_unassigned_group_comes_back_to_its_drivers(guest, node, assigned):
    group = assigned["group"]
    started = time.monotonic()
    assign(node, DISPLAY_FN, "")
    wait_drivers(guest, ORIGINAL, timeout=240)
    print(f"\nunassign to both functions back on their drivers: {time.monotonic() - started:.1f}s")
    assert guest.run("test", "-e", f"/dev/vfio/{group}", check=False).rc != 0, f"/dev/vfio/{group} is gone"
    wait(lambda: condition(node.devices()[DISPLAY_FN], "Assigned").get("status") == "False", 120, "Assigned=False")
