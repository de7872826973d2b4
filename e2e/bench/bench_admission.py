"""Benchmark of the admission webhooks: what a VM with 8 devices pays, and the operator's memory.

    .venv/bin/python e2e/bench/bench_admission.py [--creates 100]

The operator runs as its own process with its webhook server on 127.0.0.1, and the chart's
ValidatingWebhookConfiguration (rendered by helm) is registered pointing there, so the API
server calls it as in a cluster. One namespace holds 8 devices of one node. What each
figure means:
- VM create, 8 devices: --creates server-side dry-run creates (webhooks run on dry-run: their
  sideEffects are None) of a VM listing all 8, one at a time, timed at the client: p50 / p99.
- VM create, no device: the same for a VM that lists none, which the matchConditions keep
  from the webhook: the API server's own cost, to set the first figure against.
- API server's account: the webhook's mean call time from the API server's own histogram
  (apiserver_admission_webhook_admission_duration_seconds), and its count of calls.
- webhook alone: the same AdmissionReview POSTed straight to the operator (one kept-alive TLS
  connection): p50 / p99 of Kopf and our rules without the API server.
- operator RSS: psutil VmRSS and the peak VmHWM, with the webhook on, after all of the above;
  then an operator without the webhook over the same objects, for comparison.

Nothing is asserted: the figures are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import ssl
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp  # noqa: E402
import psutil  # noqa: E402
from kubernetes_asyncio import client  # noqa: E402

from e2e import chart, cluster, support  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.processes import OperatorProcess, WebhookServing  # noqa: E402
from passthrough.kube.connect import connect  # noqa: E402
from passthrough.kube.custom import Custom  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "bench-admission"
DEVICES = 8
HOOK = "virtualmachines.admission.passthrough.io"
_DURATION = re.compile(r'^apiserver_admission_webhook_admission_duration_seconds_(sum|count)\{([^}]*)\} (\S+)$')


def vm(name: str, devices: list[str]) -> dict:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"runStrategy": "Always", "template": {"spec": {"domain": {
            "devices": {"hostDevices": [{"name": f"dev{i}", "deviceName": f"passthrough.io/{d}"} for i, d in enumerate(devices)]},
            "resources": {"requests": {"memory": "1Gi"}},
        }}}},
    }  # fmt: skip


async def timed_creates(api: client.ApiClient, devices: list[str], count: int) -> list[float]:
    objects = client.CustomObjectsApi(api)
    samples = []
    for i in range(count):
        started = time.perf_counter()
        await objects.create_namespaced_custom_object(
            "kubevirt.io", "v1", NAMESPACE, "virtualmachines", vm(f"vm-{i}", devices), dry_run="All"
        )
        samples.append((time.perf_counter() - started) * 1000)
    return samples


async def webhook_account(api: client.ApiClient) -> tuple[float, int]:
    """The API server's total seconds and count of calls to the VM webhook."""
    totals = {"sum": 0.0, "count": 0.0}
    for line in (await support._raw(api, "/metrics")).splitlines():
        match = _DURATION.match(line)
        if match and f'name="{HOOK}"' in match.group(2):
            totals[match.group(1)] += float(match.group(3))
    return totals["sum"], int(totals["count"])


async def direct(serving: WebhookServing, devices: list[str], count: int) -> list[float]:
    """AdmissionReviews POSTed straight to the operator's webhook, as the API server sends them."""
    context = ssl.create_default_context(cadata=serving.ca.decode())
    body = vm("vm-direct", devices)
    samples = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=1)) as session:
        for i in range(count + 5):  # the first few open the connection and warm up
            review = {
                "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {
                    "uid": str(uuid.uuid4()), "kind": {"group": "kubevirt.io", "version": "v1", "kind": "VirtualMachine"},
                    "resource": {"group": "kubevirt.io", "version": "v1", "resource": "virtualmachines"},
                    "namespace": NAMESPACE, "name": "vm-direct", "operation": "CREATE", "dryRun": True,
                    "userInfo": {"username": "bench"}, "object": body, "oldObject": None,
                },
            }  # fmt: skip
            started = time.perf_counter()
            async with session.post(f"https://127.0.0.1:{serving.port}/validate-vm", json=review) as response:
                answer = await response.json()
            elapsed = (time.perf_counter() - started) * 1000
            assert answer["response"]["allowed"], answer
            if i >= 5:
                samples.append(elapsed)
    return samples


# Each figure as the performance page labels it, with its goal (None: none set).
GOALS: dict[str, str | None] = {
    f"VM create with {DEVICES} devices (client to API server and back, webhook called)": None,
    "VM create with no device (not sent to the webhook)": None,
    "the webhook alone (AdmissionReviews POSTed straight to the operator)": None,
    "operator RSS, webhook on": None,
}
# The figures of this run under the page's labels, printed last as its table.
MEASURED: dict[str, str] = {}


def page_table(measured: dict[str, str], **lead) -> str:
    """The figures in the performance page's form."""
    return table.figures_page(measured, GOALS, **lead)


def rss(operator: OperatorProcess) -> tuple[float, float]:
    pid = operator.proc.pid
    status = Path(f"/proc/{pid}/status").read_text()
    hwm = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 1024
    return psutil.Process(pid).memory_info().rss / 2**20, hwm


async def bench(local: cluster.LocalCluster, tmp: Path, args: argparse.Namespace) -> None:
    serving = WebhookServing(tmp / "webhook-tls")
    operator = OperatorProcess(local, tmp / "operator.log", webhook=serving)
    api = await connect(str(local.kubeconfig))
    try:
        await support.create_namespace(api, NAMESPACE)
        node = await support.ensure_node(api, "bench-node")
        devices = [await support.report_device(api, node, support.gpu(f"0000:{0x10 + i:02x}:00.0")) for i in range(DEVICES)]
        operator.start()
        local.kubectl("create", "-f", "-", input=json.dumps(chart.webhook_configuration(chart.helm(tmp / "helm"), serving)))
        pcidevices = Custom(api, "pcidevices", namespaced=True)
        for name in devices:
            await support.assign(api, name, NAMESPACE)
        npcis = Custom(api, "nodepcidevices")

        async def handed_out(name: str) -> bool:
            # The operator's record of the hand-out (with Assigned=True) comes just after the
            # PCIDevice; the webhook counts the PCIDevice only once it is there.
            ref = (((await npcis.get(name)) or {}).get("status") or {}).get("assignedNamespaceRef") or {}
            return ref.get("name") == NAMESPACE and await pcidevices.get(name, NAMESPACE) is not None

        for name in devices:
            await support.wait_for(lambda: handed_out(name), 30, what=f"PCIDevice {name} handed out")

        print(f"machine:                  {os.cpu_count()} CPUs; {DEVICES} devices of one node in one namespace")
        await timed_creates(api, devices, 10)  # warm-up: connections, the API server's caches
        spent_before, calls_before = await webhook_account(api)
        with_devices = await timed_creates(api, devices, args.creates)
        spent_after, calls_after = await webhook_account(api)
        without = await timed_creates(api, [], args.creates)
        p50, p99 = support.p50_p99(with_devices)
        print(f"VM create, {DEVICES} devices:     p50 {p50:.1f} ms, p99 {p99:.1f} ms over {args.creates} dry-run creates "
              "(client to API server and back, webhook called)")  # fmt: skip
        labels = list(GOALS)
        MEASURED[labels[0]] = f"p50 {p50:.1f} ms, p99 {p99:.1f} ms over {args.creates} dry-run creates"
        p50, p99 = support.p50_p99(without)
        print(f"VM create, no device:     p50 {p50:.1f} ms, p99 {p99:.1f} ms over {args.creates} (not sent to the webhook)")
        MEASURED[labels[1]] = f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"
        calls = calls_after - calls_before
        print(f"API server's account:     {calls} webhook calls, mean {(spent_after - spent_before) / max(calls, 1) * 1000:.1f} ms each "
              "(apiserver_admission_webhook_admission_duration_seconds)")  # fmt: skip
        p50, p99 = support.p50_p99(await direct(serving, devices, args.creates))
        print(f"webhook alone:            p50 {p50:.1f} ms, p99 {p99:.1f} ms over {args.creates} AdmissionReviews POSTed "
              "straight to the operator (one kept-alive TLS connection)")  # fmt: skip
        MEASURED[labels[2]] = f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"
        now, peak = rss(operator)
        print(f"operator RSS, webhook on: {now:.0f} MiB (VmHWM {peak:.0f} MiB) after all of the above")
        MEASURED[labels[3]] = f"{now:.0f} MiB"
    finally:
        operator.stop()
        local.kubectl("delete", "validatingwebhookconfigurations", "-l", "app.kubernetes.io/name=passthrough", check=False)
    problems = [line for line in operator.output().splitlines() if " WARNING " in line or " ERROR " in line or "Traceback" in line]

    plain = OperatorProcess(local, tmp / "operator-plain.log")
    plain.start()
    try:
        await asyncio.sleep(5)  # the initial listing handled, as the first one was
        now, peak = rss(plain)
        print(f"operator RSS, no webhook: {now:.0f} MiB (VmHWM {peak:.0f} MiB), the same objects, 5 s after start")
    finally:
        plain.stop()
        await api.close()
    print(f"operator log:             {len(problems)} warnings or errors" + "".join(f"\n    {p}" for p in problems[:10]))
    print()
    print(page_table(MEASURED))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--creates", type=int, default=100, help="VM creates to time, each way")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        local = cluster.start(Path(tmp) / "controlplane")
        try:
            asyncio.run(bench(local, Path(tmp), args))
        finally:
            local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
