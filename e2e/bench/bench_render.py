"""How long rendering KubeVirt's configuration takes for a large allow-list: prints figures, asserts nothing.

2,000 pciHostDevices in the values (after the default table) and 200 assigned devices;
each step is timed over repeated runs and reported as p50 / p99 in milliseconds.

    .venv/bin/python e2e/bench/bench_render.py [--entries N] [--assigned N] [--runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from e2e.bench import table  # noqa: E402

from passthrough.kubevirt.commands import dump  # noqa: E402
from passthrough.kubevirt.allowlist import AssignedDevice  # noqa: E402
from passthrough.kubevirt.mismatches import Advertised, mismatches  # noqa: E402
from passthrough.kubevirt.render import render  # noqa: E402
from passthrough.kubevirt.values import parse_values  # noqa: E402


# Each figure as the performance page labels it, with its goal (None: none set); the page's
# section shares its table with bench_kubevirt.py.
GOALS: dict[str, str | None] = {
    "render the allow-list": "50 ms",
    "values parse and render": None,
}


def page_table(entries: int, timings: dict[str, tuple[float, float]], **lead) -> str:
    """The figures in the performance page's form: `timings` is each step's p50 and p99 in ms."""
    render_p50, render_p99 = timings["render"]
    measured = {
        "render the allow-list": f"p50 {render_p50:.2f} ms, p99 {render_p99:.2f} ms ({entries:,} entries)",
        "values parse and render": f"p50 {timings['parse_values + render'][0]:.2f} ms",
    }
    return table.page(table.table(table.figure_rows(measured, GOALS)), **lead)


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
    timings = {}
    for name, step in steps.items():
        p50, p99 = timed(args.runs, step)
        timings[name] = (p50, p99)
        print(f"{name:<28}{p50:>10.2f}{p99:>10.2f}")
    print()
    print(page_table(len(rendered.pci_host_devices), timings))


if __name__ == "__main__":
    main()
