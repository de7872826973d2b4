"""How long rendering KubeVirt's configuration takes for a large allow-list: prints figures, asserts nothing.

2,000 pciHostDevices in the values (after the default table) and 200 assigned devices;
each step is timed over repeated runs and reported as p50 / p99 in milliseconds.

    .venv/bin/python e2e/bench/bench_render.py [--entries N] [--assigned N] [--runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from passthrough.kubevirt.commands import dump
from passthrough.kubevirt.allowlist import AssignedDevice
from passthrough.kubevirt.mismatches import Advertised, mismatches
from passthrough.kubevirt.render import render
from passthrough.kubevirt.values import parse_values


def values(entries: int) -> dict:
    # Vendor 1af4 keeps clear of the default table's 10de selectors.
    pci = [
        {"pciVendorSelector": f"1AF4:{i:04X}", "resourceName": f"example.com/device-{i}", "externalResourceProvider": True}
        for i in range(entries)
    ]
    return {"kubevirt": {"extraFeatureGates": ["Snapshot", "VMExport"]}, "gpu": {"permittedHostDevices": {"pciHostDevices": pci}}}


def timed(runs: int, step: Callable[[], object]) -> tuple[float, float]:
    step()  # warm caches (templates, the default table) out of the figures
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1000)
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49], cuts[98]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=2000)
    parser.add_argument("--assigned", type=int, default=200)
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()

    data = values(args.entries)
    assigned = [AssignedDevice(f"pci-{i:040x}", "15b3", "101d") for i in range(args.assigned)]
    spec = parse_values(data)
    rendered = render(spec, assigned, live_gates=["CPUManager", "Snapshot"], previous_gates=["HostDevices"])
    advertised = [Advertised(f"node-{i % 50}", f"0000:{i % 256:02x}:00.0", "1af4", f"{i:04x}", f"example.com/device-{i}")
                  for i in range(0, args.entries, 2)]

    steps = {
        "parse_values": lambda: parse_values(data),
        "render": lambda: render(spec, assigned, live_gates=["CPUManager", "Snapshot"], previous_gates=["HostDevices"]),
        "parse_values + render": lambda: render(parse_values(data), assigned),
        "render + YAML dump (CLI)": lambda: dump(render(spec, assigned).patch, "yaml"),
        "mismatches": lambda: mismatches(rendered.pci_host_devices, advertised),
    }
    print(f"machine: {len(os.sched_getaffinity(0))} CPUs")
    print(f"pciHostDevices: {len(rendered.pci_host_devices)} rendered "
          f"({args.entries} from values, {args.assigned} assigned, the rest the default table); {args.runs} runs")
    print(f"{'step':<28}{'p50 ms':>10}{'p99 ms':>10}")
    for name, step in steps.items():
        p50, p99 = timed(args.runs, step)
        print(f"{name:<28}{p50:>10.2f}{p99:>10.2f}")


if __name__ == "__main__":
    main()
