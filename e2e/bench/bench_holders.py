"""Benchmark of the node's guarantees: the agent's memory with its device plugins, and
how soon a device its pod held is back in its pool once that pod ends.

    .venv/bin/python e2e/bench/bench_holders.py [--trials 10]

One real kubelet (fake CRI runtime, private mount namespace), the real kube-scheduler, the
operator and the agent as their own processes over the fixture GPU node of the isolation tests
(two A10s with their audio functions, `e2e.fakesysfs.gpu_node`), answered by the simulated
kernel; the node in GPU passthrough mode. What each figure means:

- agent RSS with plugins: psutil's VmRSS of `passthrough agent` (and the peak, VmHWM; its USS,
  what it alone holds, and PSS, its share of what it maps with others), serving
  the pool (`nvidia.com/GA102GL_A10`, two GPUs) to the real kubelet, 3 s after the pool showed
  in allocatable; then again after the trials below (an exclusive plugin came and went
  --trials times, pods were admitted).
- unassigned to back in the pool: --trials times, the second GPU is assigned to a namespace,
  a pod there gets it (its exclusive resource), the admin unassigns it (the agent then serves it
  under neither name: a pod holds it), and the pod is deleted (grace period 0). From the delete
  call to: the pool plugin's ListAndWatch listing both GPUs again (read on a stream of our own,
  as the kubelet reads it), and the NodePCIDevice's status.holders empty. The kubelet tells a
  device plugin nothing when a pod ends: the agent learns it from the kubelet's PodResources,
  asked at each scan (a held device's recheck, or a watch of the node's pods). p50 / p90 / max.

Nothing is asserted. Where the real kubelet cannot run, one line says why.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import psutil  # noqa: E402
from kubernetes_asyncio import client  # noqa: E402

from e2e import cluster, fakesysfs, kubelet, support  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.bench.bench_device_plugin import PluginStream, appears  # noqa: E402
from e2e.fakekernel import FakeKernel  # noqa: E402
from e2e.processes import AgentProcess, OperatorProcess  # noqa: E402
from passthrough.deviceplugin.server import live_socket  # noqa: E402
from passthrough.kube.connect import connect  # noqa: E402
from passthrough.kube.custom import Custom  # noqa: E402
from passthrough.pci.naming import exclusive_resource_name  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
POOL = "nvidia.com/GA102GL_A10"
SECOND = "0000:af:00.0"
SETTLE = 3.0


def rss(agent: AgentProcess) -> str:
    """The agent's VmRSS and VmHWM, and its USS (pages no other process maps: what stopping it
    frees) and PSS (shared pages split between the processes that map them), MiB."""
    pid = agent.proc.pid
    memory = psutil.Process(pid).memory_full_info()
    peak = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmHWM:")) / 1024  # fmt: skip
    return f"{memory.rss / 2**20:.1f} MiB (peak {peak:.1f} MiB; USS {memory.uss / 2**20:.1f} MiB, PSS {memory.pss / 2**20:.1f} MiB)"


# Each figure as the performance page labels it, with its goal (None: none set).
GOALS: dict[str, str | None] = {
    "unassigned, pod deleted, to back in the pool (ListAndWatch)": None,
    "to `status.holders` empty": None,
    "agent RSS with plugins and a live kubelet": "— (50 MiB is the goal of `bench_agent`'s line, without a kubelet)",
}


def page_table(to_pool: list[float], to_status: list[float], rss_mib: float, uss_mib: float, **lead) -> str:
    """The figures in the performance page's form."""
    labels = list(GOALS)
    measured = {
        labels[0]: spread(to_pool).replace(f"(n={len(to_pool)})", f"({len(to_pool)} rounds)"),
        labels[1]: spread(to_status).replace(f" (n={len(to_status)})", ""),
        labels[2]: f"{rss_mib:.1f} MiB (USS {uss_mib:.1f} MiB)",
    }
    return table.figures_page(measured, GOALS, **lead)


def spread(samples: list[float]) -> str:
    s = sorted(samples)
    return f"p50 {s[len(s) // 2]:.2f} s, p90 {s[min(len(s) - 1, int(len(s) * 0.9))]:.2f} s, max {s[-1]:.2f} s (n={len(s)})"


async def bench(local, root: Path, trials: int) -> None:
    api = await connect(str(local.kubeconfig))
    core = client.CoreV1Api(api)
    scheduler = kubelet.Scheduler(local, root / "logs").start()
    node = await asyncio.to_thread(kubelet.KubeletNode(local, "bench-holders", labels={"passthrough.io/gpu-passthrough": "true"}).start)
    host = fakesysfs.gpu_node(root / "host")
    operator = OperatorProcess(local, root / "operator.log")
    operator.start()
    agent = None
    try:
        with FakeKernel(host):
            # Its metrics served, as the chart runs it (metrics.enabled, metrics.authentication), on a free port here.
            metrics_port = cluster.free_ports(1)[0]
            agent = AgentProcess(local, root / "agent.log", node.node_name, host, PCI_IDS, f"--metrics-port={metrics_port}",
                                 "--metrics-addr=127.0.0.1", "--metrics-auth", kubelet=node).start()  # fmt: skip
            await support.wait_resources(core, node.node_name, {POOL: "2"}, agent, timeout=60)
            names = await support.device_names(api, node.node_name)
            await asyncio.sleep(SETTLE)
            print(f"agent RSS with plugins:   {rss(agent)}, pool of 2 GPUs served to the real kubelet")
            memory = psutil.Process(agent.proc.pid).memory_full_info()

            pool = PluginStream(live_socket(node.device_plugin_dir, POOL))
            reader = asyncio.create_task(pool.run())
            namespace = await support.create_namespace(api, "bench-holders")
            name = names[SECOND]
            resource = exclusive_resource_name(name)
            to_pool, to_status = [], []
            for i in range(trials):
                await support.assign(api, name, namespace)
                await support.wait_resources(core, node.node_name, {resource: "1", POOL: "1"}, agent, timeout=60)
                pod = f"vm-{i}"
                await support.create_pod(api, namespace, support.launcher_pod(pod, resource))
                await support.created(core, namespace, node, pod)
                await support.assign(api, name, "")
                await appears(lambda: pool.value.get("devices") == 1)
                await _holders(api, name, bool)  # the agent has seen its holder
                started = time.monotonic()
                deleting = asyncio.create_task(core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0))
                back = asyncio.create_task(appears(lambda: pool.value.get("devices") == 2))
                to_status.append(await _holders(api, name, lambda h: not h) - started)
                to_pool.append(await back - started)
                await deleting
                await support.delete_pod(api, namespace, pod)
                # The next round starts from what the scheduler sees, not from a node status of this one.
                await support.wait_resources(core, node.node_name, {resource: "0", POOL: "2"}, agent, timeout=60)
            print(f"unassigned, pod deleted, to back in the pool (plugin's ListAndWatch): {spread(to_pool)}")
            print(f"                         to status.holders empty:                   {spread(to_status)}")
            print(f"agent RSS after the trials: {rss(agent)}")
            print()
            print(page_table(to_pool, to_status, memory.rss / 2**20, memory.uss / 2**20))
            reader.cancel()
    finally:
        if agent is not None:
            agent.stop()
        operator.stop()
        node.stop()
        scheduler.stop()
        await api.close()


async def _holders(api, name: str, check) -> float:
    """The monotonic time status.holders of `name` first satisfies `check`."""
    kind = Custom(api, "nodepcidevices")
    while True:
        obj = await kind.get(name)
        if check(((obj or {}).get("status") or {}).get("holders") or []):
            return time.monotonic()
        await asyncio.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="unassign-and-end-the-pod rounds")
    args = parser.parse_args()
    print(f"machine:                  {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-holders-") as tmp:
        root = Path(tmp)
        local = cluster.start(root / "controlplane")
        try:
            reason = kubelet.why_unavailable(local)
            if reason is not None:
                print(f"the real kubelet cannot run here ({reason}): nothing measured")
                return 0
            asyncio.run(bench(local, root, args.trials))
        finally:
            local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
