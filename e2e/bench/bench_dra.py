"""Benchmark of DRA mode beside the device plugins, on one node with the real kubelet.

    .venv/bin/python e2e/bench/bench_dra.py [--gpus 8] [--rounds 20] [--rescans 30] [--large-devices 512]

One node: Kubernetes' own kubelet with the fake CRI runtime (`e2e.kubelet`), the real
kube-scheduler (its DRA allocator) and kube-controller-manager (its resourceclaim controller),
and a fixture host of --gpus NVIDIA A10s, each with its audio function in its own IOMMU group,
answered by the simulated kernel (`e2e.fakekernel`). The node is in GPU passthrough mode and
the first GPU is handed out to namespace `bench-vms` by the operator (a process of its own,
`--dra`, with its admission webhooks registered from the chart with DRA on, so both paths pass
the webhooks they pass in a cluster). The agent cannot serve device plugins and DRA at once, so
the node is measured in two phases: the agent with device plugins, then a fresh agent with
`--dra` over the same host and kubelet.

What each figure means:
- device plugin, pod to CreateContainer: --rounds pods one after another (each deleted before
  the next), each with a limit of `passthrough.io/<NodePCIDevice name>` (the exclusive device);
  from just before the create call to the time the fake runtime stamped on the
  CreateContainer that carried the device (env PCI_RESOURCE_..., /dev/vfio nodes): scheduling,
  admission, the kubelet's Allocate to our plugin, the fake sandbox.
- DRA, claim + pod to CreateContainer: --rounds times a ResourceClaim of the operator's
  DeviceClass `passthrough-bench-vms` and a pod using it; from just before the claim's create
  call to the CreateContainer that carried the claim's CDI devices: the scheduler's allocation,
  the claim-status webhook, the binding condition (the driver's VFIOBound answer in the claim's
  status, which the scheduler waits for before it binds the pod, asking every 5 s), the kubelet's
  NodePrepareResources to our driver (the group bind is a no-op both times: it stays on
  vfio-pci between rounds, as the device plugins keep it), the CDI specs and metadata written.
  Each claim is read back before it is deleted: the line after says how many of them were
  allocated with the binding condition and answered VFIOBound, so the figure is with binding
  conditions on. Each round waits for the pod, the claim and the claim's CDI files to be
  gone before the next, and starts once the kubelet has registered the driver. p50, p90 and
  the slowest of each; both clocks are this machine's wall clock.
- ResourceSlice writes at rest: the DRA agent runs `--rescan-interval=1s`; with nothing
  changing, the API server's own request counters (`apiserver_request_total`, every client)
  for resourceslices and nodepcidevices, and the slice's resourceVersion, over --rescans
  seconds, and the DRA passes the agent made meanwhile (counted in its debug log: the DRA agent
  runs `--verbose`). Should be 0 writes over about as many passes as seconds.
- slice size: the node's live ResourceSlice as the API server returns it (compact JSON), with
  and without `metadata.managedFields`, and per device. Then the largest fixture node
  (`fakesysfs.synthetic_host` of --large-devices functions, as bench_agent discovers), every
  eligible device handed out: the slices the driver would write for it (the same pure
  functions: resource.k8s.io/v1 takes at most 128 devices in one slice, so a bigger node is a
  pool of several), each applied to the API server for a Node of that name, and its size (or
  what the API server said, where it refused one).

Where the real kubelet cannot run (not root, no binaries), one line says why and nothing is
measured. Everything runs on loopback over fixture trees; nothing is written to the host's
/sys or /dev.
Nothing is asserted: the figures are printed, with the agent logs' warnings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from kubernetes_asyncio import client  # noqa: E402

from e2e import chart, cluster, fakesysfs, kubelet, support  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.bench.bench_device_plugin import Node as DevicePluginNode  # noqa: E402
from e2e.bench.bench_device_plugin import gpu_host, wall  # noqa: E402
from e2e.devcluster import DRA_CHART  # noqa: E402
from e2e.fakekernel import FakeKernel  # noqa: E402
from e2e.processes import AgentProcess, OperatorProcess, WebhookServing, running  # noqa: E402
from passthrough.agent import report  # noqa: E402
from passthrough.dra import slice as dra_slice  # noqa: E402
from passthrough.dra.driver import PASS_LOGGED  # noqa: E402
from passthrough.dra.slice import BOUND  # noqa: E402
from passthrough.kube.client import APPLY_PATCH, ApiError, session_of  # noqa: E402
from passthrough.kube.connect import connect  # noqa: E402
from passthrough.kube.custom import AGENT_MANAGER  # noqa: E402
from passthrough.pci.discovery import discover  # noqa: E402
from passthrough.pci.naming import exclusive_resource_name  # noqa: E402
from passthrough.pci.pciids import PciIds  # noqa: E402
from tests.integration.test_dra import RESOURCE, claim, claim_pod, create_claim, delete_claim, read_claim  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
GPU_MODE = "passthrough.io/gpu-passthrough"
NAMESPACE = "bench-vms"
DEVICE_CLASS = f"passthrough-{NAMESPACE}"  # the operator's class for the namespace's devices
NODE = "bench-dra"
TIMEOUT = 60.0

# Each figure as the performance page labels it, with its goal (None: none set).
GOALS: dict[str, str | None] = {
    "device plugin: pod to CreateContainer with its env and `/dev/vfio`": None,
    "DRA: claim and pod to CreateContainer with its CDI devices": None,
    "at rest, rescans every second": "0",
    "slice size": None,
    "largest fixture node, every device handed out": None,
}
# The figures of this run under the page's labels, printed last as its table.
MEASURED: dict[str, str] = {}


def page_table(measured: dict[str, str], **lead) -> str:
    """The figures in the performance page's form."""
    return table.figures_page(measured, GOALS, **lead)


def print_latency(what: str, samples: list[float], unit: str, meaning: str) -> str:
    """p50, p90 and the slowest: with a few dozen samples a p99 is the slowest one anyway."""
    p50, p90 = (statistics.quantiles(samples, n=10, method="inclusive")[i] * 1000 for i in (4, 8))
    figure = f"p50 {p50:.0f} ms, p90 {p90:.0f} ms, max {max(samples) * 1000:.0f} ms"
    print(f"{what:<26}{figure} over {len(samples)} {unit} ({meaning})")
    return figure


def compact(obj: dict) -> int:
    """Bytes of `obj` as compact JSON (what the API server sends and etcd keeps, give or take)."""
    return len(json.dumps(obj, separators=(",", ":")).encode())


def without_managed_fields(obj: dict) -> dict:
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "managedFields"}}


class Bench:
    """The node under test: the kubelet, the fixture host, the agent of the current phase."""

    def __init__(self, local, api, root: Path, gpus: int, kubelet_node: kubelet.KubeletNode) -> None:
        self.local, self.api, self.root = local, api, root
        self.session = session_of(api)
        self.kubelet = kubelet_node
        self.host, self.groups = gpu_host(root / "host", gpus)
        self.agents: list[AgentProcess] = []
        self.device = ""  # the NodePCIDevice handed out to NAMESPACE

    @property
    def agent(self) -> AgentProcess:
        return self.agents[-1]

    def start_agent(self, *args: str) -> AgentProcess:
        if self.agents:
            self.agent.stop()
        log = self.root / f"agent-{len(self.agents)}.log"
        self.agents.append(AgentProcess(self.local, log, NODE, self.host, PCI_IDS, "--rescan-interval=1s", *args,
                                        kubelet=self.kubelet).start())  # fmt: skip
        return self.agent

    def dra_args(self) -> list[str]:
        # --verbose: the debug log says each pass, which the at-rest figure counts.
        return ["--dra", f"--kubelet-dir={self.kubelet.root_dir}", f"--cdi-dir={self.cdi_dir}", "--verbose"]

    @property
    def cdi_dir(self) -> Path:
        return self.kubelet.var_dir / "run" / "cdi"  # what the runtime sees as /var/run/cdi

    async def hand_out(self) -> None:
        names = await support.reported(self.api, NODE, self.groups, timeout=TIMEOUT)
        self.device = names[sorted(self.groups)[0]]
        await support.assign(self.api, self.device, NAMESPACE)

    async def created(self, mark: str) -> dict:
        async def find():
            return next((c for c in self.kubelet.created_containers() if c.get("envs", {}).get("MARK") == mark), None)

        return await support.wait_for(find, TIMEOUT, 0.02, what=lambda: f"CreateContainer of {mark}; agent log:\n{self.agent.output()[-3000:]}")

    async def live_slice(self) -> dict | None:
        try:
            return await self.session.request("GET", f"{RESOURCE}/resourceslices/{dra_slice.slice_name(NODE)}")
        except ApiError:
            return None

    problems = DevicePluginNode.problems  # the warnings and errors of every agent's log, read the same way


# --- Phase 1: the device plugins ------------------------------------------------------------


async def bench_device_plugin(bench: Bench, rounds: int) -> list[float]:
    resource = exclusive_resource_name(bench.device)
    await support.wait_resources(client.CoreV1Api(bench.api), NODE, {resource: "1"}, bench.agent, timeout=TIMEOUT)
    samples = []
    for i in range(rounds):
        name = f"dp-{i}"
        started = time.time()
        await support.create_pod(bench.api, NAMESPACE, support.launcher_pod(name, resource))
        record = await bench.created(name)
        if not any(key.startswith("PCI_RESOURCE_") for key in record.get("envs", {})):
            raise RuntimeError(f"{name}'s container got no PCI_RESOURCE_ env: {record}")
        samples.append(wall(record["time"]) - started)
        await support.delete_pod(bench.api, NAMESPACE, name)
    return samples


# --- Phase 2: DRA ---------------------------------------------------------------------------


async def published(bench: Bench, devices: int) -> dict:
    """Until the node's slice lists `devices` devices, ours among them for NAMESPACE."""

    async def ready():
        found = await bench.live_slice()
        listed = ((found or {}).get("spec") or {}).get("devices") or []
        ours = [d for d in listed if d["attributes"].get("passthrough.io/namespace") == {"string": NAMESPACE}]
        return found if len(listed) == devices and ours else None

    return await support.wait_for(ready, TIMEOUT, 0.1, what=lambda: f"the slice of {devices}; agent log:\n{bench.agent.output()[-3000:]}")


async def registered(bench: Bench) -> None:
    """Until the kubelet has registered the driver: it publishes its slice before that, and a
    claim allocated in between fails its first NodePrepareResources ("DRA driver ... is not
    registered") and waits for the kubelet's retry, about 12 s later (seen in a trial run)."""

    async def said():
        return "the kubelet registered DRA driver" in bench.agent.output()

    await support.wait_for(said, TIMEOUT, 0.05, what=lambda: f"the driver's registration; agent log:\n{bench.agent.output()[-3000:]}")


async def class_made(bench: Bench) -> None:
    async def there():
        try:
            return await bench.session.request("GET", f"{RESOURCE}/deviceclasses/{DEVICE_CLASS}")
        except ApiError:
            return None

    await support.wait_for(there, TIMEOUT, 0.1, what=f"DeviceClass {DEVICE_CLASS}")


async def bench_claims(bench: Bench, rounds: int) -> tuple[list[float], int]:
    """The samples, and how many of the claims waited for and got their VFIOBound answer."""
    samples, answered = [], 0
    for i in range(rounds):
        claim_name, pod_name = f"claim-{i}", f"dra-{i}"
        started = time.time()
        made = await create_claim(bench.api, NAMESPACE, claim(claim_name, DEVICE_CLASS))
        await support.create_pod(bench.api, NAMESPACE, claim_pod(pod_name, claim_name))
        record = await bench.created(pod_name)
        if not record.get("cdi_devices"):
            raise RuntimeError(f"{pod_name}'s container got no CDI devices: {record}")
        samples.append(wall(record["time"]) - started)
        body = await read_claim(bench.api, NAMESPACE, claim_name)
        [result] = body["status"]["allocation"]["devices"]["results"]
        answers = [c for d in body["status"].get("devices") or [] if d.get("device") == result["device"]
                   for c in d.get("conditions") or [] if c.get("type") == BOUND and c.get("status") == "True"]  # fmt: skip
        answered += BOUND in (result.get("bindingConditions") or []) and bool(answers)
        await support.delete_pod(bench.api, NAMESPACE, pod_name)
        await delete_claim(bench.session, NAMESPACE, claim_name)
        uid = made["metadata"]["uid"]

        async def unprepared(uid=uid):
            return not list(bench.cdi_dir.glob(f"*{uid}*"))

        await support.wait_for(unprepared, TIMEOUT, 0.05, what=f"{claim_name}'s CDI files removed")
    return samples, answered


async def bench_at_rest(bench: Bench, seconds: int) -> None:
    await support.quiet(bench.api, ("resourceslices", "nodepcidevices"))
    before = await support.write_counts(bench.api)
    version = (await bench.live_slice())["metadata"]["resourceVersion"]
    logged = len(bench.agent.output())
    await asyncio.sleep(seconds)
    after = await support.write_counts(bench.api)
    now = (await bench.live_slice())["metadata"]["resourceVersion"]
    passes = sum(1 for line in bench.agent.output()[logged:].splitlines() if f" {PASS_LOGGED} " in line)
    slices = support.writes_between(before, after, "resourceslices")
    devices = support.writes_between(before, after, "nodepcidevices")
    print(f"{f'at rest, {seconds} s:':<26}{slices} ResourceSlice writes, {devices} NodePCIDevice writes over {passes} "
          f"DRA passes (the agent's debug log); resourceVersion {'unchanged' if now == version else f'{version} -> {now}'}")
    MEASURED["at rest, rescans every second"] = f"{slices} ResourceSlice writes, {devices} NodePCIDevice writes in {seconds} s"


def print_slice_size(what: str, obj: dict) -> int:
    devices = len(obj["spec"].get("devices") or [])
    whole, bare = compact(obj), compact(without_managed_fields(obj))
    print(f"{what:<26}{whole:,} bytes, {bare:,} without managedFields, {devices} devices "
          f"({bare / max(devices, 1):.0f} bytes a device)")
    return bare


# --- The largest fixture node ----------------------------------------------------------------


async def bench_large_slice(api, root: Path, functions: int) -> None:
    """The slice of a node with every eligible device handed out, applied as the driver applies it."""
    session = session_of(api)
    host = fakesysfs.synthetic_host(root / "large", functions)
    node_name = "bench-dra-large"
    devices = discover(host.sysfs, host.proc, PciIds.load(PCI_IDS)).devices
    names = {d.address: report.object_name(d, node_name) for d in devices if d.reported}
    handed = {name: NAMESPACE for name in names.values()}
    published = dra_slice.publishable(devices, handed, names, in_gpu_mode=True, claimed=frozenset(handed))
    uid = (await support.ensure_node(api, node_name)).uid
    eligible = sum(1 for d in devices if d.reported and d.eligible)
    print(f"largest fixture node:     {len(devices)} functions (synthetic_host {functions}), {eligible} eligible, "
          f"{len(published)} published when all are handed out")
    bodies = dra_slice.pool_bodies(node_name, uid, dra_slice.specs(node_name, published), [None])
    stored, refused = [], 0
    for index, body in enumerate(bodies):
        label = f"  slice {index + 1} of {len(bodies)}:"
        path = f"{RESOURCE}/resourceslices/{body['metadata']['name']}"
        try:
            written = await session.request("PATCH", path, query={"fieldManager": AGENT_MANAGER, "force": True},
                                            body=body, content_type=APPLY_PATCH)  # fmt: skip
        except ApiError as exc:
            print(f"{label:<26}{compact(body):,} bytes as applied, {len(body['spec']['devices'])} devices: refused by the "
                  f"API server ({exc.status}: {exc.message[:300] or exc})")  # fmt: skip
            refused += 1
            continue
        print_slice_size(label, written)
        stored.append(len(written["spec"].get("devices") or []))
        await session.request("DELETE", path)
    await support.remove_node(api, node_name)
    MEASURED["largest fixture node, every device handed out"] = (
        f"{len(published)} devices: {len(bodies)} slices of one pool ({' and '.join(str(n) for n in stored)} devices)"
        + (f"; {refused} refused" if refused else "")
    )


# --- The run ----------------------------------------------------------------------------------


async def bench(local, root: Path, args) -> None:
    api = await connect(str(local.kubeconfig))
    scheduler = kubelet_node = kernel = node = None
    serving = WebhookServing(root / "webhook-tls")
    operator = OperatorProcess(local, root / "operator.log", "--dra", webhook=serving)
    try:
        await support.create_namespace(api, NAMESPACE)
        scheduler = kubelet.Scheduler(local, root / "logs").start()
        kubelet_node = await asyncio.to_thread(kubelet.KubeletNode(local, NODE, labels={GPU_MODE: "true"}).start)
        node = Bench(local, api, root, args.gpus, kubelet_node)
        kernel = FakeKernel(node.host).start()
        hooks = chart.webhook_configuration(chart.helm(root / "helm"), serving, DRA_CHART)
        with running(operator), chart.webhooks_registered(local, hooks):
            node.start_agent()
            await node.hand_out()
            dp = await bench_device_plugin(node, args.rounds)

            node.start_agent(*node.dra_args())
            live = await published(node, args.gpus)
            await registered(node)
            await class_made(node)
            dra, answered = await bench_claims(node, args.rounds)
            labels = list(GOALS)
            MEASURED[labels[0]] = print_latency("device plugin:", dp, "pods",
                                                "pod with passthrough.io/<name> to CreateContainer with its env and /dev/vfio")
            MEASURED[labels[1]] = print_latency("DRA:", dra, "claims", "claim + pod to CreateContainer with its CDI devices")
            print(f"{'DRA, binding condition:':<26}{answered} of {len(dra)} claims allocated with {BOUND} and answered it "
                  "before their pod was bound")  # fmt: skip
            await bench_at_rest(node, args.rescans)
            live = await node.live_slice() or live
            bare = print_slice_size(f"slice, {args.gpus} GPUs:", live)
            MEASURED["slice size"] = f"{bare / args.gpus:.0f} bytes a device ({args.gpus} GPUs: {bare:,} bytes)"
        await bench_large_slice(api, root, args.large_devices)
    finally:
        if node:
            for agent in node.agents:
                agent.stop()
        if kubelet_node:
            await asyncio.to_thread(kubelet_node.stop)
        if scheduler:
            scheduler.stop()
        if kernel:
            kernel.stop()
        await api.close()
    problems = node.problems() if node else []
    print(f"agent logs:               {len(problems)} warnings or errors" + "".join(f"\n    {p}" for p in problems[:10]))
    print()
    print(page_table(MEASURED))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8, help="A10s (each with its audio function) on the node")
    parser.add_argument("--rounds", type=int, default=20, help="pods (device plugin) and claims + pods (DRA), one after another")
    parser.add_argument("--rescans", type=int, default=30, help="seconds at rest, the DRA agent rescanning every second")
    parser.add_argument("--large-devices", type=int, default=512, help="PCI functions of the largest fixture node")
    args = parser.parse_args()
    if args.gpus < 1 or args.rounds < 2:
        parser.error("--gpus: at least 1; --rounds: at least 2")
    print(f"machine:                  {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-dra-") as tmp:
        root = Path(tmp)
        local = cluster.start(root / "controlplane")
        try:
            reason = kubelet.why_unavailable(local)
            if reason:  # said, not failed: `make bench` goes on with the other scripts
                print(f"no figures: {reason} (both paths need the real kubelet)")
                return 0
            asyncio.run(bench(local, root, args))
        finally:
            local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
