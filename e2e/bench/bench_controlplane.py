"""Benchmark of the local control plane: cold build, warm start to ready, memory.

    python e2e/bench/bench_controlplane.py [--skip-cold] [--starts N]

The cold build compiles every binary from source into a throw-away cache with an empty Go
build cache (downloaded modules are kept: that is network, not build). It takes minutes;
--skip-cold prints the time recorded by the build that made the current cache entry.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402

from e2e import build, cluster  # noqa: E402
from e2e.bench import table  # noqa: E402


def cold_build() -> float:
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as gocache:
        os.environ["PASSTHROUGH_CACHE_DIR"] = cache
        os.environ["GOCACHE"] = gocache
        try:
            started = time.monotonic()
            build.ensure_binaries()
            return time.monotonic() - started
        finally:
            del os.environ["PASSTHROUGH_CACHE_DIR"], os.environ["GOCACHE"]


# Each figure as the performance page labels it, with its goal (None: none set).
GOALS: dict[str, str | None] = {
    "cold build (empty binary and Go build caches, modules downloaded)": None,
    "warm start to ready (etcd, apiserver, CRDs, controller-manager)": None,
    "memory": None,
}


def page_table(cold: float | None, times: list[float], rss: dict[str, int], *, recorded: bool = False, versions: str = "",
               **lead) -> str:
    """The figures in the performance page's form; `recorded`: the cold build's time is the cache entry's, not timed now."""
    labels = list(GOALS)
    memory = ", ".join(f"{name} {value / 2**20:.0f} MiB" for name, value in rss.items())
    values = {
        labels[0]: (f"{cold:.0f} s" + (" (recorded by the build of the cache entry)" if recorded else "")) if cold else "unknown",
        labels[1]: f"median {statistics.median(times):.2f} s ({min(times):.2f} to {max(times):.2f} s over {len(times)} starts)",
        labels[2]: f"{memory}; {sum(rss.values()) / 2**20:.0f} MiB RSS in all",
    }
    return table.page(table.table(table.figure_rows(values, GOALS)), note=versions, **lead)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-cold", action="store_true", help="report the recorded build time instead of building")
    parser.add_argument("--starts", type=int, default=5, help="warm starts to time")
    args = parser.parse_args()

    bin_dir = build.ensure_binaries()
    if args.skip_cold:
        info = json.loads((bin_dir.parent / "build-info.json").read_text()) if (bin_dir.parent / "build-info.json").exists() else {}
        cold = info.get("seconds")
        cold_note = "recorded by the build of the cache entry"
    else:
        cold = cold_build()
        cold_note = "empty binary cache and Go build cache, modules already downloaded"

    times, rss = [], {}
    for i in range(args.starts):
        with tempfile.TemporaryDirectory() as workdir:
            local = cluster.LocalCluster(workdir=Path(workdir), bin_dir=bin_dir)
            started = time.monotonic()
            local.start(before_controllers=cluster.prepare)
            times.append(time.monotonic() - started)
            if i == args.starts - 1:
                time.sleep(5)  # let the controllers finish their first sync
                rss = {p.name: psutil.Process(p.pid).memory_info().rss for p in local.processes}
            local.stop()

    print(f"kubernetes {build.kubernetes_version()}, etcd {build.etcd_version()}, {os.cpu_count()} CPUs")
    print(f"cold build:               {cold:.0f} s ({cold_note})" if cold else "cold build:               unknown")
    print(
        f"warm start to ready:      median {statistics.median(times):.2f} s, min {min(times):.2f} s, "
        f"max {max(times):.2f} s over {len(times)} starts (etcd + apiserver + CRDs + controller-manager)"
    )
    for name, value in rss.items():
        print(f"memory {name + ':':25} {value / 2**20:.0f} MiB RSS")
    print(f"memory total:             {sum(rss.values()) / 2**20:.0f} MiB RSS")
    print()
    versions = f"Kubernetes {build.kubernetes_version()}, etcd {build.etcd_version()}."
    print(page_table(cold, times, rss, recorded=args.skip_cold, versions=versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
