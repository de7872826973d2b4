"""Health of served devices on a real kernel, driven by the rig's own QEMU monitor: what a node sees
in production. An AER error injected on a device behind a root port (`pcie_aer_inject_error`),
and a device taken away (`device_del`), each turn the device Unhealthy in the plugin's
ListAndWatch, read in the guest as the kubelet reads it; the NodePCIDevice says so too.

The latency printed is from the monitor command (the guest's clock read just before it) to the
first ListAndWatch update without the device healthy. device_del takes a device from the guest
for good, so that test runs after all others but the agent's last (`rk_last(1)`).
"""

from __future__ import annotations

import time

import pytest

from e2e.guest.machine import address
from e2e.guest.node import PluginWatch, allocate, assign, condition, events, guest_clock, ready, wait, wait_drivers

# virtio-pci with aer=on, behind its own root port: QEMU sends its injected errors upstream
# (its e1000e does not: Device Control's error-reporting enables are read-only zero there).
AER_FN = address("aer")
TESTDEV = address("testdev")


def handed_out(node, tenant, address_: str) -> str:
    """Assign the device, wait until it is bound, served and Ready; its resource name."""
    assign(node, address_, tenant)
    wait_drivers(node.guest, {address_: "vfio-pci"}, timeout=240)

    def resource():
        device = node.devices()[address_]
        ok = condition(device, "Assigned").get("status") == "True" and condition(device, "Ready").get("status") == "True"
        return ok and device["status"].get("resourceName")

    name = wait(resource, 120, f"{address_} handed out and Ready", node)
    # The plugin registered: the kubelet offers it (a ListAndWatch is then there to read).
    wait(lambda: node.guest.run("ls", node.device_plugin_dir).stdout.count("passthrough-") >= 1, 60, "a plugin socket")
    return name


def test_an_aer_error_makes_a_served_device_unhealthy(guest, node, tenant):
    resource = handed_out(node, tenant, AER_FN)
    # iommufd (KubeVirt 1.9's IOMMUFD gate): this kernel has neither /dev/iommu nor
    # /dev/vfio/devices/, so Allocate hands over neither (KubeVirt 1.9.0 broke on such paths).
    answer = allocate(guest, node.device_plugin_dir, resource, [AER_FN])
    paths = sorted(d["host_path"] for d in answer["devices"])
    group = node.devices()[AER_FN]["status"]["attributes"]["iommuGroup"]
    assert paths == sorted(["/dev/vfio/vfio", f"/dev/vfio/{group}"]), paths

    with PluginWatch(guest, node.device_plugin_dir, resource) as watch:
        wait(lambda: watch.first(lambda d: d.get(AER_FN) == "Healthy"), 30, "ListAndWatch to show it Healthy")
        before = guest_clock(guest)
        said = guest.monitor.hmp("pcie_aer_inject_error aer-0 POISON_TLP")  # uncorrectable, non-fatal by default
        assert said.startswith("OK"), said
        at = wait(lambda: watch.first(lambda d: d.get(AER_FN) == "Unhealthy", before), 30, "ListAndWatch: Unhealthy")
        latency = at - before
    counters = guest.read(f"/sys/bus/pci/devices/{AER_FN}/aer_dev_nonfatal")
    assert "TOTAL_ERR_NONFATAL 1" in counters, counters
    found = wait(lambda: ready(node, AER_FN, "Unhealthy"), 60, "Ready=False/Unhealthy", node)
    assert found["status"] == "False" and "AER" in found["message"], found
    kinds = {(e["type"], e["reason"]) for e in events(node, AER_FN)}
    assert ("Warning", "Unhealthy") in kinds, kinds
    print(f"\nAER error injected: Unhealthy in ListAndWatch {latency:.2f}s after the monitor command")
    assert latency < 3, f"{latency:.2f}s"  # the agent polls every 0.5 s; TCG is slow: generous


@pytest.mark.rk_last(1)
def test_a_device_taken_away_becomes_unhealthy(guest, node, tenant):
    resource = handed_out(node, tenant, TESTDEV)
    with PluginWatch(guest, node.device_plugin_dir, resource) as watch:
        wait(lambda: watch.first(lambda d: d.get(TESTDEV) == "Healthy"), 30, "ListAndWatch to show it Healthy")
        before = guest_clock(guest)
        host_started = time.monotonic()
        guest.monitor.execute("device_del", id="testdev-0")
        at = wait(lambda: watch.first(lambda d: d.get(TESTDEV) != "Healthy", before), 60, "ListAndWatch: not Healthy")
        latency = at - before
        updates = [(round(t - before, 2), d) for t, d in watch.updates() if t >= before]
    gone = not guest.run("test", "-e", f"/sys/bus/pci/devices/{TESTDEV}", check=False).rc == 0
    # The device left the bus: Unhealthy first (the health poll), then withdrawn (the scan).
    assert gone
    found = wait(lambda: condition(node.devices()[TESTDEV], "Ready").get("status") == "False" and
                 condition(node.devices()[TESTDEV], "Ready"), 60, "Ready=False", node)  # fmt: skip
    kinds = {(e["type"], e["reason"]) for e in events(node, TESTDEV)}
    print(f"\ndevice_del: not Healthy in ListAndWatch {latency:.2f}s after the monitor command "
          f"({time.monotonic() - host_started:.1f}s to here); updates: {updates}; "
          f"the object: Ready=False/{found['reason']}; events: {sorted(kinds)}")
    assert latency < 5, f"{latency:.2f}s"
