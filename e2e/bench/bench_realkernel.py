"""Benchmark of the real-kernel rig: its boot time, and bind and give-back latency per IOMMU group shape.

    .venv/bin/python e2e/bench/bench_realkernel.py [--series 6.1] [--rounds 3]

- boot: from QEMU's exec to the guest's command server answering (the kernel under TCG, the
  initramfs, the overlay root over 9p, every driver loaded from modalias, the server's Python).
- node up: the real kubelet in the guest Ready, then the agent's first report of every device.
- bind: from the admin's spec write (kubectl patch on the host) to every member of the group on
  vfio-pci in the guest (polled there every 50 ms): the operator's hand-out (Assigned=True),
  the agent's scan, plan and sysfs writes in its binder child. give-back: from clearing the
  assignment to every member back on its own driver (the agent asks the kubelet's PodResources
  first). Per shape: a single-function group with a driver (e1000e), one without (edu), and
  two-function groups (display + audio, a dual-port NIC). p50 and max over --rounds.
- to Unhealthy: from the rig's monitor command (the guest's clock read just before it) to the
  first ListAndWatch update, read in the guest over the plugin's socket, without the device
  Healthy: an injected AER error (`pcie_aer_inject_error` on the rig's `aer` slot, virtio-pci with
  aer=on behind its root port: QEMU's e1000e never sends its errors upstream) and a
  device taken away (`device_del` of the served pci-testdev). Once each: device_del is for good.

Everything runs under TCG on this machine's busy cores; the figures are the rig's, not a real
node's (where Python is about 12 times faster). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from e2e import cluster as local  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.guest.kernel import DEFAULT_SERIES, SERIES, kernel  # noqa: E402
from e2e.guest.machine import TOPOLOGY, address, boot  # noqa: E402
from e2e.guest.node import GuestNode, PluginWatch, assign, condition, guest_clock, wait, wait_drivers  # noqa: E402
from e2e.processes import OperatorProcess  # noqa: E402

SHAPES = ("nic", "edu", "gpu", "dualnic")  # slot names of e2e/guest/machine.py's TOPOLOGY

# The page's two tables: each group shape's bind and give-back, then the other figures, each
# as the page labels it, with its goal (None: none set).
SHAPE_COLUMNS = ("device", "bind to vfio-pci", "give back to its driver", "goal")
GOALS: dict[str, str | None] = {
    "boot to the command server": None,
    "kubelet Ready in the guest": None,
    "agent start to first report": None,
    "AER error injected to Unhealthy in ListAndWatch": None,
    "surprise removal (`device_del`) to Unhealthy": None,
}


def page_table(shapes: dict[str, tuple[list[float], list[float]]], measured: dict[str, str], note: str = "", **lead) -> str:
    """The figures in the performance page's form: `shapes` is each group shape's bind and give-back seconds."""

    def spread(samples: list[float]) -> str:
        return f"p50 {statistics.median(samples):.2f} s, max {max(samples):.2f} s"

    shape_rows = [(shape, spread(binds), spread(gives), None) for shape, (binds, gives) in shapes.items()]
    return table.page(table.table(shape_rows, SHAPE_COLUMNS), table.table(table.figure_rows(measured, GOALS)),
                      note=note, **lead)  # fmt: skip


def _assign(node: GuestNode, name: str, namespace: str) -> None:
    node.cluster.kubectl("patch", "nodepcidevice", name, "--type=merge", "-p", json.dumps({"spec": {"assignedNamespace": namespace}}))


def measure(node: GuestNode, slot: str, namespace: str, rounds: int) -> tuple[list[float], list[float]]:
    functions = next(s.functions for s in TOPOLOGY if s.name == slot)
    members = [address(slot, i) for i in range(len(functions))]
    original = {a: f.driver for a, f in zip(members, functions)}
    on_vfio = dict.fromkeys(members, "vfio-pci")
    name = node.devices()[members[0]]["metadata"]["name"]
    binds, give_backs = [], []
    for _ in range(rounds):
        started = time.monotonic()
        _assign(node, name, namespace)
        wait_drivers(node.guest, on_vfio, timeout=300)
        binds.append(time.monotonic() - started)
        started = time.monotonic()
        _assign(node, name, "")
        wait_drivers(node.guest, original, timeout=300)
        give_backs.append(time.monotonic() - started)
    return binds, give_backs


def to_unhealthy(node: GuestNode, slot: str, namespace: str, inject) -> str:
    """Hand the slot's device out, then `inject()` on the rig's monitor: seconds to not Healthy."""
    member = address(slot)
    assign(node, member, namespace)
    wait_drivers(node.guest, {member: "vfio-pci"}, timeout=300)

    def resource():
        device = node.devices()[member]
        return condition(device, "Ready").get("status") == "True" and device["status"].get("resourceName")

    name = wait(resource, 120, f"{member} served", node)
    with PluginWatch(node.guest, node.device_plugin_dir, name) as watch:
        wait(lambda: watch.first(lambda d: d.get(member) == "Healthy"), 60, "ListAndWatch Healthy")
        before = guest_clock(node.guest)
        inject()
        try:
            at = wait(lambda: watch.first(lambda d: d.get(member) != "Healthy", before), 60, "not Healthy")
        except AssertionError:
            return "not reached in 60 s"
    return f"{at - before:5.2f} s"


def _figures(samples: list[float]) -> str:
    return f"p50 {statistics.median(samples):5.2f} s  max {max(samples):5.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", choices=list(SERIES), default=DEFAULT_SERIES)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    found = kernel(args.series)
    with tempfile.TemporaryDirectory(prefix="bench-realkernel-") as scratch:
        work = Path(scratch)
        control_plane = local.start(work / "controlplane")
        guest = operator = node = None
        try:
            guest = boot(found, work / "guest")
            print(f"kernel {found.package} {found.version} under TCG, 1 vCPU")
            print(f"boot to the command server:   {guest.boot_seconds:6.1f} s")
            measured = {"boot to the command server": f"{guest.boot_seconds:.1f} s"}
            shapes = {}
            operator = OperatorProcess(control_plane, work / "operator.log")
            operator.start(timeout=60)
            node = GuestNode(guest, control_plane, f"bench-{uuid.uuid4().hex[:6]}")
            node.start_kubelet()
            print(f"kubelet Ready in the guest:   {node.timings['kubelet start']:6.1f} s")
            measured["kubelet Ready in the guest"] = f"{node.timings['kubelet start']:.1f} s"
            started = time.monotonic()
            node.start_agent()
            wanted = {address(slot) for slot in SHAPES}
            wait(lambda: wanted <= set(node.devices()), 300, "the agent's first report", node)
            print(f"agent start to first report:  {time.monotonic() - started:6.1f} s")
            measured["agent start to first report"] = f"{time.monotonic() - started:.1f} s"
            namespace = f"bench-{uuid.uuid4().hex[:6]}"
            control_plane.kubectl("create", "namespace", namespace)
            print(f"\nlatency over {args.rounds} rounds (spec write on the host to drivers changed in the guest):")
            for slot in SHAPES:
                functions = next(s.functions for s in TOPOLOGY if s.name == slot)
                shape = f"{slot} ({' + '.join(f.model for f in functions)}, {len(functions)}-function group)"
                binds, give_backs = measure(node, slot, namespace, args.rounds)
                shapes[shape] = (binds, give_backs)
                print(f"  {shape}")
                print(f"    bind to vfio-pci:        {_figures(binds)}")
                print(f"    give-back to its driver: {_figures(give_backs)}")
            monitor = guest.monitor
            print("\nmonitor command to Unhealthy in ListAndWatch:")
            aer = to_unhealthy(node, "aer", namespace, lambda: monitor.hmp("pcie_aer_inject_error aer-0 POISON_TLP"))
            print(f"  AER error injected (aer):     {aer}")
            gone = to_unhealthy(node, "testdev", namespace, lambda: monitor.execute("device_del", id="testdev-0"))
            print(f"  surprise removal (device_del): {gone}")
            measured["AER error injected to Unhealthy in ListAndWatch"] = aer.strip()
            measured["surprise removal (`device_del`) to Unhealthy"] = gone.strip()
            print()
            release = found.package.removeprefix("linux-image-")
            print(page_table(shapes, measured, note=f"Kernel {release} under QEMU's TCG, one vCPU, {args.rounds} rounds."))
        finally:
            if node is not None:
                node.stop()
            if operator is not None:
                operator.stop()
            if guest is not None:
                guest.stop()
            control_plane.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
