"""The metrics endpoints of a real operator and a real agent, scraped over HTTP while they work
against the real control plane.

The operator runs as its own process with `--metrics-port` (and its webhooks, registered from
the chart, for the admission counters); the agent runs as its own process over a fixture GPU
node with its simulated kernel, so an assignment really binds the GPU's IOMMU group to
vfio-pci. Each test scrapes before and after what an admin or a tenant does, and compares.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from e2e import fakesysfs, support
from e2e.cluster import free_ports
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess, OperatorProcess
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.custom import Custom
from tests.integration.test_admission import serving, webhooks  # noqa: F401  (fixtures: the chart's webhooks, calling `operator` here)
from tests.integration.test_operator_lifecycle import vm_body

pytestmark = pytest.mark.cluster
PCI_IDS = Path(__file__).resolve().parents[2] / "e2e/data/pci.ids.2025-07-11"
GPU, OTHER_GPU = "0000:3b:00.0", "0000:af:00.0"


class Scrape:
    """One scrape of an endpoint: every sample, summed over the labels a query leaves open."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]

    def __call__(self, name: str, **labels: str) -> float:
        return sum(v for n, have, v in self.samples if n == name and labels.items() <= have.items())

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


async def scrape(port: int) -> Scrape:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as answer:
            assert answer.status == 200, await answer.text()
            return Scrape(await answer.text())


async def scrape_when(port: int, condition, what: str, timeout: float = 30) -> Scrape:
    async def check():
        with contextlib.suppress(aiohttp.ClientError):
            found = await scrape(port)
            return found if condition(found) else None

    return await support.wait_for(check, timeout, interval=0.3, what=what)


# -- the processes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ports():
    operator, agent = free_ports(2)
    return {"operator": operator, "agent": agent}


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory, ports, serving):
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", "--not-found-grace=4s",
                           f"--metrics-port={ports['operator']}", "--metrics-addr=127.0.0.1", webhook=serving)  # fmt: skip
    proc.start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


@pytest.fixture(scope="module")
async def agent(api, cluster, operator, ports, tmp_path_factory):
    """A GPU node (two A10s with their audio functions), its agent serving metrics, and the
    names of its NodePCIDevices by address once the operator has seen all four Ready."""
    root = tmp_path_factory.mktemp("metrics-node")
    node = await support.ensure_node(api, f"metrics-{uuid.uuid4().hex[:6]}")
    host = fakesysfs.gpu_node(root / "host")
    with FakeKernel(host):
        proc = AgentProcess(cluster, root / "agent.log", node.name, host, PCI_IDS,
                            f"--metrics-port={ports['agent']}", "--metrics-addr=127.0.0.1").start()  # fmt: skip
        try:
            await scrape_when(ports["operator"], lambda s: s("passthrough_operator_devices", node=node.name, condition="Ready",
                                                             status="True") == 4,
                              f"the operator's metrics showing the 4 devices of {node.name} Ready; agent log:\n{proc.output()[-3000:]}")  # fmt: skip
            items = (await Custom(api, "nodepcidevices").list(f"{NODE_LABEL}={node.name}"))["items"]
            names = {o["status"]["attributes"]["pciAddress"]: o["metadata"]["name"] for o in items}
            yield {"node": node, "names": names, "proc": proc}
        finally:
            code = proc.stop()
            await support.remove_node(api, node.name)
    assert code == 0 and "Traceback" not in proc.output(), proc.output()[-5000:]


# -- the tests -----------------------------------------------------------------------------------


async def test_an_assignment_moves_the_operators_and_the_agents_metrics(api, agent, ports, namespace):
    node, name = agent["node"].name, agent["names"][GPU]
    operator_before, agent_before = await scrape(ports["operator"]), await scrape(ports["agent"])
    assert operator_before("passthrough_operator_assignments", namespace=namespace) == 0
    assert operator_before("passthrough_operator_devices", node=node, condition="Assigned", status="True") == 0
    assert operator_before("passthrough_operator_devices", node=node, condition="Assigned") == 4
    assert operator_before.has("passthrough_operator_workqueue_depth") and operator_before.has("passthrough_build_info")
    assert agent_before("passthrough_agent_devices", eligible="true") == 4
    assert agent_before("passthrough_agent_devices", eligible="false") == 0
    assert agent_before("passthrough_agent_scan_duration_seconds_count") >= 1
    assert agent_before("passthrough_agent_api_writes_total", resource="nodepcidevices/status", code="2xx") >= 4  # its first report
    # Not in GPU passthrough mode: nothing bound, nothing served yet.
    assert agent_before("passthrough_agent_vfio_binds_total") == 0
    assert agent_before("passthrough_agent_device_plugins") == 0

    await support.assign(api, name, namespace)

    operator_after = await scrape_when(
        ports["operator"], lambda s: s("passthrough_operator_devices", node=node, condition="Assigned", status="True") == 1
        and s("passthrough_operator_assignments", namespace=namespace) == 1, f"{name} Assigned in the operator's metrics")  # fmt: skip
    agent_after = await scrape_when(
        ports["agent"], lambda s: s("passthrough_agent_device_plugins", kind="exclusive") == 1,
        f"the agent serving {name} as an exclusive resource; log:\n{agent['proc'].output()[-3000:]}")  # fmt: skip

    def grew(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
        return after(name, **labels) - before(name, **labels)

    # The operator handed the device out: the PCIDevice and the NodePCIDevice's conditions were written.
    assert grew(operator_before, operator_after, "passthrough_operator_api_writes_total", resource="pcidevices", verb="apply", code="2xx") >= 1
    assert grew(operator_before, operator_after, "passthrough_operator_api_writes_total", resource="pcidevices/status", code="2xx") >= 1
    assert grew(operator_before, operator_after, "passthrough_operator_api_writes_total", resource="nodepcidevices/status", code="2xx") >= 1
    assert grew(operator_before, operator_after, "passthrough_operator_reconcile_duration_seconds_count", kind="device") >= 1
    assert operator_after("passthrough_operator_devices", node=node, condition="Assigned") == 4  # moved, none added
    # The agent rescanned, bound the GPU's IOMMU group (the GPU and its audio function), serves it
    # (no kubelet here: unregistered), and reported the device's new mode.
    assert grew(agent_before, agent_after, "passthrough_agent_scan_duration_seconds_count") >= 1
    assert grew(agent_before, agent_after, "passthrough_agent_vfio_binds_total") == 1
    assert agent_after("passthrough_agent_vfio_bind_failures_total") == 0
    assert agent_after("passthrough_agent_device_plugins", kind="exclusive", state="unregistered") == 1
    assert agent_after("passthrough_agent_device_plugin_devices", kind="exclusive", health="Healthy") == 1
    assert grew(agent_before, agent_after, "passthrough_agent_api_writes_total", resource="nodepcidevices/status", code="2xx") >= 1
    assert agent_after("passthrough_agent_api_writes_total", code="409") == 0


async def test_admission_decisions_are_counted_by_kind_and_decision(api, agent, ports, namespace, webhooks):
    name, other = agent["names"][OTHER_GPU], agent["names"][GPU]
    await support.assign(api, name, namespace)
    pcidevices = Custom(api, "pcidevices", namespaced=True)
    await support.wait_for(lambda: pcidevices.get(name, namespace), 20, what=f"PCIDevice {namespace}/{name}")
    before = await scrape(ports["operator"])
    objects = client.CustomObjectsApi(api)
    with pytest.raises(client.exceptions.ApiException) as refused:  # a device of no namespace of its own
        await objects.create_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines",
                                                      vm_body(namespace, "takes-another", [f"passthrough.io/{other}"]))  # fmt: skip
    assert refused.value.status == 403 and other in refused.value.body
    await objects.create_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines",
                                                  vm_body(namespace, "uses-its-own", [f"passthrough.io/{name}"]))  # fmt: skip
    after = await scrape(ports["operator"])
    counted = "passthrough_operator_admission_decisions_total"
    assert after(counted, kind="VirtualMachine", decision="denied") - before(counted, kind="VirtualMachine", decision="denied") == 1
    assert after(counted, kind="VirtualMachine", decision="allowed") - before(counted, kind="VirtualMachine", decision="allowed") == 1
    await objects.delete_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines", "uses-its-own")


@pytest.mark.parametrize("command", ["operator", "agent"])
def test_a_metrics_port_already_taken_stops_the_process_with_a_message(cluster, tmp_path, command):
    extra = ["--node-name=nowhere", f"--sysfs-root={tmp_path}", f"--proc-root={tmp_path}", "--no-hotplug",
             "--no-device-plugin", f"--pci-ids={PCI_IDS}"] if command == "agent" else []  # fmt: skip
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "passthrough", command, f"--kubeconfig={cluster.kubeconfig}", f"--metrics-port={port}",
             "--metrics-addr=127.0.0.1", *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert f"passthrough {command}: --metrics-port {port}:" in result.stderr and "Traceback" not in result.stderr, result.stderr
