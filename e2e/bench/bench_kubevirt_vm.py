"""Benchmark of a VirtualMachine becoming a launcher container that holds its device, through
KubeVirt's own virt-api and virt-controller (v1.9.0, `e2e/virt.py`).

    .venv/bin/python e2e/bench/bench_kubevirt_vm.py [--vms 20] [--assignments 20]

A real control plane (KubeVirt's generated CRDs), the operator with its webhooks registered
from the chart, virt-api, virt-controller and virt-operator's KubeVirt webhooks, kube-scheduler,
and the real kubelet (`e2e.kubelet`: the stand-in CRI runtime) with the agent's device plugins
over a fixture node of two A10s (`e2e.fakekernel`). With `--dra`, DRA mode: the operator `--dra`
with the chart's DRA webhooks, the values' `dra.enabled` (KubeVirt's DRA gates on), the agent a
DRA driver; each VM's `gpus` entry names a ResourceClaim of the namespace's class
`passthrough-<namespace>`, created just before the VM (its deletion waited for after). What each
figure means:

- VM to container: --vms times, a VM naming an assigned device (`hostDevices`,
  `passthrough.io/<name>`, runStrategy Always) is created; from just before the create call
  to the time the stand-in runtime stamped on its CreateContainer record of the launcher's
  compute container: virt-api's and this project's admission, virt-controller's VMI and
  launcher pod, this project's pod webhook, scheduling, the kubelet's Allocate to our plugin.
  Each VM is deleted and gone before the next; the node's two A10s are used in turn.
- assignment to container: --assignments times, an admin assigns the device to the
  namespace, and the VM naming it is created as soon as this project's webhook admits it
  (tried every 0.1 s: it refuses while the device is not the namespace's); from just before
  the assignment to the compute container's CreateContainer: the operator's PCIDevice, the
  agent's exclusive plugin and the kubelet's status update (up to its 2 s period), then all
  of the above. The device is unassigned after each. In DRA mode only the round's device is
  assigned (the claim would take the other); the claim and VM are created at once (nothing
  refuses them), and the time includes the agent's ResourceSlice, the scheduler's allocation
  and its wait for the driver's binding condition (it asks every 5 s), and the kubelet's
  NodePrepareResources.

Both clocks are this machine's wall clock. p50 / p90 of the rounds whose container came within
30 s; the others are listed as stuck, with their launcher pod's status (the kubelet has refused
a launcher pod for a device it had just let go of: UnexpectedAdmissionError, and the VMI then
stays Pending). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kubernetes_asyncio import client  # noqa: E402

from e2e import chart, cluster, fakesysfs, kubelet, support, virt  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.fakekernel import FakeKernel  # noqa: E402
from e2e.processes import AgentProcess, OperatorProcess, WebhookServing  # noqa: E402
from passthrough.deviceplugin import podresources  # noqa: E402
from passthrough.dra import slice as dra_slice  # noqa: E402
from passthrough.kube.connect import connect  # noqa: E402
from passthrough.kube.custom import Custom  # noqa: E402
from passthrough.pci.naming import exclusive_resource_name  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "bench-vms"
GPUS = ("0000:3b:00.0", "0000:af:00.0")


def vm(name: str, resource: str, claim: str = "") -> dict:
    """A VM naming `resource` in hostDevices, or, with `claim`, the ResourceClaim's request `gpu` in gpus."""
    devices = ({"gpus": [{"name": "gpu", "claimName": "gpu", "requestName": "gpu"}]} if claim
               else {"hostDevices": [{"name": "dev", "deviceName": resource}]})  # fmt: skip
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"runStrategy": "Always", "template": {"spec": {
            **({"resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]} if claim else {}),
            "domain": {"devices": devices, "resources": {"requests": {"memory": "64Mi"}}},
            "terminationGracePeriodSeconds": 0,
        }}},
    }  # fmt: skip


def resource_claim(name: str) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"passthrough-{NAMESPACE}"}}]}}}  # fmt: skip


def p50_p90(samples: list[float]) -> str:
    if not samples:
        return "no samples"
    cuts = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
    return f"p50 {cuts[4] * 1000:.0f} ms, p90 {cuts[8] * 1000:.0f} ms ({len(samples)} VMs)"


# Each figure as the performance page labels it, with its goal (None: none set).
DEVICE_PLUGIN_GOALS: dict[str, str | None] = {
    "`VirtualMachine` created (device already assigned) to the compute container with its device": None,
    "admin's assignment (VM created as soon as admitted) to the compute container with its device": None,
    "stuck rounds (no compute container 30 s after the VM was admitted)": None,
}
DRA_GOALS: dict[str, str | None] = {
    "DRA mode: `VirtualMachine` and its ResourceClaim created (device already assigned) to the compute container with its device": None,
    "DRA mode: admin's assignment (claim and VM created at once) to the compute container with its device": None,
    "DRA mode: stuck rounds (no compute container 30 s after the VM was admitted)": None,
}
GOALS = {**DEVICE_PLUGIN_GOALS, **DRA_GOALS}  # the page's section has both modes' tables


def page_table(vms: list[float], assignments: list[float], rounds: tuple[int, int], stuck: int, dra: bool = False, **lead) -> str:
    """The figures in the performance page's form: `rounds` is how many VM rounds and assignment rounds ran."""
    labels = list(DRA_GOALS if dra else DEVICE_PLUGIN_GOALS)
    measured = {
        labels[0]: p50_p90(vms).replace(" VMs)", f" of {rounds[0]} VMs)"),
        labels[1]: p50_p90(assignments).replace(" VMs)", f" of {rounds[1]} VMs)"),
        labels[2]: f"{stuck} of {sum(rounds)}",
    }
    return table.figures_page(measured, GOALS, **lead)


class Run:
    def __init__(self, local, api, node, agent, gpus: list[str], controllers=None, dra: bool = False) -> None:
        self.local, self.api, self.node, self.agent, self.gpus = local, api, node, agent, gpus
        self.controllers, self.dra = controllers, dra
        self.stuck: list[str] = []
        self.vms = Custom(api, "virtualmachines", namespaced=True, group="kubevirt.io", version="v1")
        self.core = client.CoreV1Api(api)

    async def created_at(self, name: str, timeout: float = 30) -> float | None:
        """The runtime's time stamp of the compute container of VM `name`'s launcher pod; None
        (the round said in `stuck`) when none comes within `timeout`."""

        async def find():
            for record in self.node.created_containers():
                if record["namespace"] == NAMESPACE and record["container"] == "compute" and \
                        record["pod"].startswith(f"virt-launcher-{name}-"):  # fmt: skip
                    return record
            return None

        try:
            record = await support.wait_for(find, timeout, 0.05)
        except AssertionError:
            pods = self.local.kubectl("get", "pods", "-n", NAMESPACE, "-l", f"vm.kubevirt.io/name={name}", "--no-headers",
                                      check=False).stdout.split()  # fmt: skip
            said = [line for line in (self.controllers.output("virt-controller") if self.controllers else "").splitlines()
                    if f"{NAMESPACE}/{name}" in line]  # fmt: skip
            why = f"; virt-controller's last word on it: {said[-1][-400:]}" if said else ""
            self.stuck.append(f"{name}: no container in {timeout:g} s; its launcher pod: {' '.join(pods[2:3]) or 'none'}{why}")
            return None
        return datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00")).timestamp()

    def create(self, name: str, gpu: str) -> bool:
        if self.dra:
            self.local.kubectl("create", "-f", "-", input=json.dumps(resource_claim(name)))
        body = json.dumps(vm(name, exclusive_resource_name(gpu), claim=name if self.dra else ""))
        return self.local.kubectl("create", "-f", "-", input=body, check=False).returncode == 0

    async def gone(self, name: str) -> None:
        """The VM deleted, its instance and launcher pod with it. virt-handler, which would stop
        the domain and finish the VMI, does not run: its part (the pod ended, the finalizers
        let go) is done here in its place."""
        kubectl = self.local.kubectl
        kubectl("delete", "vm", name, "-n", NAMESPACE, "--wait=false")
        kubectl("delete", "vmi", name, "-n", NAMESPACE, "--wait=false", check=False)
        # Not forced: the kubelet removes the pod once it has stopped it and let its device go.
        kubectl("delete", "pods", "-n", NAMESPACE, "-l", f"vm.kubevirt.io/name={name}", "--grace-period=1", "--wait=false")
        for kind in ("vmi", "vm"):
            kubectl("patch", kind, name, "-n", NAMESPACE, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)

        async def absent():
            pods = await self.core.list_namespaced_pod(NAMESPACE, label_selector=f"vm.kubevirt.io/name={name}")
            return await self.vms.get(name, NAMESPACE) is None and not pods.items

        await support.wait_for(absent, 120, 0.1, what=f"VM {name} and its launcher pod gone")

        async def released():  # the kubelet's own account: no pod of the VM holds a device any more
            held = (await podresources.view(self.node.pod_resources_socket)).holders.values()
            return not any(h.pod.startswith(f"virt-launcher-{name}-") for holders in held for h in holders)

        await support.wait_for(released, 60, 0.1, what=f"the kubelet letting go of {name}'s device")
        if self.dra:  # the claim deleted and gone: its allocation no longer holds the device
            kubectl("delete", "resourceclaim", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")


async def bench_vms(run: Run, count: int, prefix: str = "vm") -> list[float]:
    samples = []
    for i in range(count):
        name = f"{prefix}-{i}"
        started = time.time()
        assert run.create(name, run.gpus[i % 2]), f"VM {name} refused"
        if (created := await run.created_at(name)) is not None:
            samples.append(created - started)
        await run.gone(name)
    return samples


async def bench_assignments(run: Run, count: int) -> list[float]:
    samples = []
    for i in range(count):
        name, gpu = f"assigned-{i}", run.gpus[i % 2]
        if run.dra:  # only the round's device may be the namespace's: the claim would take the other
            for each in run.gpus:
                await support.assign(run.api, each, "")
            await published(run, 0)
        else:
            await support.assign(run.api, gpu, "")
            await support.wait_resources(run.core, run.node.node_name, {exclusive_resource_name(gpu): "0"}, run.agent, timeout=60)
        started = time.time()
        await support.assign(run.api, gpu, NAMESPACE)
        while not run.create(name, gpu):
            await asyncio.sleep(0.1)
        if (created := await run.created_at(name)) is not None:
            samples.append(created - started)
        await run.gone(name)
    return samples


async def published(run: Run, count: int) -> None:
    """Until the node's ResourceSlice lists `count` devices of the namespace."""

    async def listed():
        found = json.loads(run.local.kubectl("get", "resourceslice", dra_slice.slice_name(run.node.node_name), "-o", "json",
                                             check=False).stdout or "{}")  # fmt: skip
        devices = (found.get("spec") or {}).get("devices") or []
        mine = [d for d in devices if d["attributes"]["passthrough.io/namespace"]["string"] == NAMESPACE]
        return len(mine) == count

    await support.wait_for(listed, 60, 0.1, what=f"{count} devices of {NAMESPACE} in the node's ResourceSlice")


async def bench(local: cluster.LocalCluster, root: Path, args: argparse.Namespace) -> None:
    reason = kubelet.why_unavailable(local)
    if reason:
        print(f"real kubelet:             not run ({reason}); nothing to measure")
        return
    api = await connect(str(local.kubeconfig))
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    serving = WebhookServing(root / "webhook-tls")
    operator = OperatorProcess(local, logs / "operator.log", *(["--dra"] if args.dra else []), webhook=serving)
    scheduler = node = agent = controllers = kernel = None
    try:
        operator.start()
        dra_chart = ["--set=agent.devicePlugin.dra=true"] if args.dra else []
        local.kubectl("create", "-f", "-", input=json.dumps(chart.webhook_configuration(chart.helm(root / "helm"), serving, *dra_chart)))
        await support.create_namespace(api, NAMESPACE)
        local.kubectl("create", "namespace", virt.NAMESPACE)
        local.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kubevirt", "namespace": virt.NAMESPACE},
             "spec": {}}))  # fmt: skip
        local.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
             "spec": {"dra": {"enabled": True}} if args.dra else {}}))  # fmt: skip
        controllers = virt.KubeVirtControllers(local, root / "kubevirt").start()
        scheduler = kubelet.Scheduler(local, logs).start()
        node = await asyncio.to_thread(kubelet.KubeletNode(local, "bench-vm").start)
        virt.mark_node(local, node.node_name)
        host = fakesysfs.gpu_node(root / "gpu-host")
        kernel = FakeKernel(host).start()
        dra_agent = ["--dra", f"--kubelet-dir={node.root_dir}", f"--cdi-dir={node.var_dir / 'run' / 'cdi'}"] if args.dra else []
        agent = AgentProcess(local, logs / "agent.log", node.node_name, host, REPO / "e2e/data/pci.ids.2025-07-11", *dra_agent,
                             kubelet=node).start()  # fmt: skip
        names = await support.reported(api, node.node_name, GPUS)
        # Two devices, used in turn: a device is used again only after a whole VM of the other,
        # as the kubelet may not have let the last pod's go yet (it refuses the pod: UnexpectedAdmissionError).
        gpus = [names[a] for a in GPUS]
        for gpu in gpus:
            await support.assign(api, gpu, NAMESPACE)
        run = Run(local, api, node, agent, gpus, controllers, args.dra)
        if args.dra:
            await published(run, len(gpus))
        else:
            assigned = {exclusive_resource_name(gpu): "1" for gpu in gpus}
            await support.wait_resources(client.CoreV1Api(api), node.node_name, assigned, agent, timeout=60)
        await bench_vms(run, 2, "warm")  # warm-up: the first VMs pay for caches and connections
        vms = await bench_vms(run, args.vms)
        print(f"VM to container:          {p50_p90(vms)}")
        assignments = await bench_assignments(run, args.assignments)
        print(f"assignment to container:  {p50_p90(assignments)}")
        print(f"stuck rounds:             {len(run.stuck)}" + "".join(f"\n    {s}" for s in run.stuck))
        print()
        print(page_table(vms, assignments, (args.vms, args.assignments), len(run.stuck), args.dra))
    finally:
        for part in (agent, controllers):
            if part:
                part.stop()
        if node:
            await asyncio.to_thread(node.stop)
        if scheduler:
            scheduler.stop()
        operator.stop()
        if kernel:
            kernel.stop()
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vms", type=int, default=20, help="VMs created one after another")
    parser.add_argument("--assignments", type=int, default=20, help="assignments each followed by a VM")
    parser.add_argument("--dra", action="store_true", help="DRA mode: each VM names a ResourceClaim")
    args = parser.parse_args()
    print(f"machine:                  {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-vm-") as tmp:
        root = Path(tmp)
        local = cluster.start(root / "controlplane")
        try:
            asyncio.run(bench(local, root, args))
        finally:
            local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
