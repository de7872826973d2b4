"""The metrics: what is counted where, what the collectors read from the caches, the endpoint,
and the Grafana dashboard's queries against what the code exports.

The endpoint is scraped over real HTTP and the device plugins are spoken to over real unix
sockets; the operator and agent processes against the control plane are in
tests/integration/test_metrics.py.
"""

from __future__ import annotations

import os

import asyncio
import dataclasses
import datetime
import json
import re
import socket
from pathlib import Path

import aiohttp
import grpc
import pytest
from prometheus_client import CollectorRegistry
from kubernetes_asyncio import client
from passthrough.kube.client import ApiError

from e2e.fakekernel import FakeKernel
from e2e.fakesysfs import gpu_node
from passthrough import metrics
from passthrough.agent import metrics as agent_metrics
from passthrough.agent.handover import Handover
from passthrough.agent.plan import Plan
from passthrough.controller import metrics as operator_metrics
from passthrough.controller import reconciler as rec
from passthrough.api.views import NodeDevice
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2 as api
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2_grpc as api_grpc
from passthrough.deviceplugin.manager import PluginManager
from passthrough.deviceplugin.server import DevicePlugin
from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2 as pr
from tests.unit.test_deviceplugin_server import (  # noqa: F401  (plugin_dir: a fixture)
    A10, GPU0, GPU1, NIC, NIC0, FakeKubelet, FakePodResources, channel_to, eventually, plugin_dir, serve_pod_resources,
)

pytestmark = pytest.mark.timeout(60)
DASHBOARD = Path(__file__).resolve().parents[2] / "charts/passthrough-operator/dashboards/passthrough.json"

# -- the dashboard's queries -------------------------------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: every identifier that is not a function or
    aggregation (followed by a parenthesis), a keyword, a label, a string or a duration."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings (label values)
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries: [5m], [$__rate_interval]
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        name, call = match.groups()
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for panel_or_nested in [panel, *panel.get("panels", [])]:
            for target in panel_or_nested.get("targets", []):
                found.append((panel_or_nested["title"], target["expr"]))
    return found


def exported() -> set[str]:
    return metrics.names(operator_metrics.OPERATOR) | metrics.names(agent_metrics.AGENT)


def test_the_query_parser_finds_metric_names_and_nothing_else():
    expr = ('histogram_quantile(0.99, sum by (le, kind) (rate(a_seconds_bucket{kind=~"device|x(y)", code!="2xx"}[$__rate_interval]))) '
            '+ on (job, instance) group_left (component) b_info * 2 > bool 1e3 or vector(0) unless c_total offset 5m')  # fmt: skip
    assert metric_names(expr) == {"a_seconds_bucket", "b_info", "c_total"}
    assert metric_names("sum(increase(passthrough_agent_vfio_bind_failures_total[1h]))") == {"passthrough_agent_vfio_bind_failures_total"}


def test_every_dashboard_query_names_only_metrics_the_code_exports():
    queries = dashboard_queries()
    assert len(queries) > 20
    unknown = {(title, name) for title, expr in queries for name in metric_names(expr) if name not in exported()}
    assert not unknown, f"the dashboard reads metrics nothing exports: {sorted(unknown)}"
    assert all(metric_names(expr) for _, expr in queries), "a query that names no metric"


def test_every_metric_of_ours_has_a_panel():
    read = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
    families = {f.name for registry in (operator_metrics.OPERATOR, agent_metrics.AGENT) for f in registry.collect() if f.name.startswith("passthrough_")}
    # A family is on the dashboard when one of its series is (a histogram through _bucket or _count).
    missing = {f for f in families if not any(name == f or name.startswith(f + "_") for name in read)}
    assert not missing, f"metrics without a panel: {sorted(missing)}"


def test_dashboard_panels_have_unique_ids_and_read_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_names_follow_the_conventions():
    for registry in (operator_metrics.OPERATOR, agent_metrics.AGENT):
        for family in registry.collect():
            if not family.name.startswith("passthrough_"):
                continue
            assert re.fullmatch(r"passthrough_(operator|agent)_[a-z_]+|passthrough_build", family.name), family.name
            assert family.documentation, family.name
            if family.type == "histogram":
                assert family.name.endswith("_seconds"), family.name
            if family.type == "gauge":
                assert not family.name.endswith("_total"), family.name


# -- counted where it happens ---------------------------------------------------------------------


def value(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_a_write_is_counted_by_how_it_was_answered():
    name, labels = "passthrough_operator_api_writes_total", {"resource": "pcidevices", "verb": "delete"}
    before = {code: value(operator_metrics.OPERATOR, name, **labels, code=code) for code in ("2xx", "409", "422", "none")}
    with metrics.write(operator_metrics.OPERATOR_WRITES, "pcidevices", "delete"):
        pass
    with metrics.write(operator_metrics.OPERATOR_WRITES, "pcidevices", "delete") as answer:
        answer.status(409)  # Custom.delete returns its 404 and 409
    with pytest.raises(ApiError), metrics.write(operator_metrics.OPERATOR_WRITES, "pcidevices", "delete"):
        raise ApiError(422, "Unprocessable Entity")
    with pytest.raises(aiohttp.ServerDisconnectedError), metrics.write(operator_metrics.OPERATOR_WRITES, "pcidevices", "delete"):
        raise aiohttp.ServerDisconnectedError()
    with pytest.raises(asyncio.CancelledError), metrics.write(operator_metrics.OPERATOR_WRITES, "pcidevices", "delete"):
        raise asyncio.CancelledError()  # not a write that was answered, nor one that failed
    after = {code: value(operator_metrics.OPERATOR, name, **labels, code=code) for code in before}
    assert {code: after[code] - before[code] for code in before} == {"2xx": 1, "409": 1, "422": 1, "none": 1}


def _node_device(name: str, node: str, ready: str, reason: str, namespace: str = "", assigned: str | None = None) -> NodeDevice:
    conditions = [{"type": "Ready", "status": ready, "reason": reason}]
    if assigned:
        conditions.append({"type": "Assigned", "status": "True" if assigned == "Assigned" else "False", "reason": assigned})
    return NodeDevice.of({
        "metadata": {"name": name, "uid": name, "resourceVersion": "1"},
        "spec": {"assignedNamespace": namespace},
        "status": {"attributes": {"nodeName": node}, "conditions": conditions},
    })  # fmt: skip


async def test_devices_assignments_and_the_work_queue_are_read_from_the_reconciler_at_scrape():
    devices = [
        _node_device("a", "n1", "True", "Ready", "team-a", "Assigned"),
        _node_device("b", "n1", "True", "Ready", "team-a", "Assigned"),
        _node_device("c", "n2", "False", "NotFound"),
        _node_device("d", "n2", "True", "Ready", "team-b", "IOMMUGroupConflict"),
    ]
    indices = {
        rec.NODE_DEVICES: {d.name: (d,) for d in devices},
        rec.DEVICES_BY_NAMESPACE: {"team-a": ("a", "b"), "team-b": ("d",)},
    }
    async with client.ApiClient() as connection:  # never used: no request is made
        reconciler = rec.Reconciler(connection, indices, default_grace=datetime.timedelta(minutes=1))
        reconciler.queue.add("a")
        reconciler.queue.add("b")
        await reconciler.queue.get()  # "a" is being reconciled
        reconciler.queue.add_after("c", 60)
        collector = operator_metrics.OperatorCollector()
        registry = CollectorRegistry()
        registry.register(collector)
        assert value(registry, "passthrough_operator_workqueue_depth") == 0  # nothing to read yet: no series
        collector.reconciler = lambda: reconciler
        get = lambda name, **labels: registry.get_sample_value(name, labels)  # noqa: E731
        assert get("passthrough_operator_devices", node="n1", condition="Ready", status="True") == 2
        assert get("passthrough_operator_devices", node="n2", condition="Ready", status="False") == 1
        assert get("passthrough_operator_devices", node="n2", condition="Assigned", status="Unknown") == 1
        assert get("passthrough_operator_devices", node="n2", condition="Attached", status="Unknown") == 2
        assert get("passthrough_operator_device_conditions", condition="Ready", reason="NotFound") == 1
        assert get("passthrough_operator_device_conditions", condition="Assigned", reason="IOMMUGroupConflict") == 1
        assert get("passthrough_operator_assignments", namespace="team-a") == 2
        assert get("passthrough_operator_assignments", namespace="team-b") == 1
        assert (get("passthrough_operator_workqueue_depth"), get("passthrough_operator_workqueue_in_progress"),
                get("passthrough_operator_workqueue_delayed")) == (1, 1, 1)  # fmt: skip
        # Read again at the next scrape: a change shows without anyone telling the metrics.
        indices[rec.NODE_DEVICES]["c"] = (_node_device("c", "n2", "True", "Ready"),)
        assert get("passthrough_operator_devices", node="n2", condition="Ready", status="False") is None
        assert get("passthrough_operator_devices", node="n2", condition="Ready", status="True") == 2
        reconciler.queue.close()


# -- vfio-pci, through the agent's handover ----------------------------------------------------------


async def test_binds_and_give_backs_are_counted_with_their_failures_by_reason(tmp_path, plugin_dir):  # noqa: F811
    def counts() -> dict[str, float]:
        return {
            "bound": value(agent_metrics.AGENT, "passthrough_agent_vfio_binds_total"),
            "given back": value(agent_metrics.AGENT, "passthrough_agent_vfio_give_backs_total"),
            "bind refused": value(agent_metrics.AGENT, "passthrough_agent_vfio_bind_failures_total", reason="VendorDriverInUse"),
            "give-back failed": value(agent_metrics.AGENT, "passthrough_agent_vfio_give_back_failures_total", reason="GiveBackFailed"),
        }

    gpu, audio, other_gpu, other_audio = "0000:3b:00.0", "0000:3b:00.1", "0000:af:00.0", "0000:af:00.1"
    pods = await serve_pod_resources(plugin_dir / "pr.sock", FakePodResources(pr.ListPodResourcesResponse()))  # no pod holds any
    try:
        with FakeKernel(gpu_node(tmp_path)) as kernel:
            host = kernel.host
            handover = Handover(host.sysfs, host.dev, plugin_dir, plugin_dir / "pr.sock", bind_timeout=0.3)
            try:
                before = counts()
                await handover.carry_out(Plan(bind={20: (gpu, audio)}))
                await handover.carry_out(Plan(bind={20: (gpu, audio)}))  # already on vfio-pci: no news
                module = host.sysfs / "module" / "nvidia"
                module.mkdir(parents=True)
                (module / "refcnt").write_text("1\n")  # nvidia-persistenced has it open
                await handover.carry_out(Plan(bind={21: (other_gpu, other_audio)}))
                vmm = os.open(host.vfio_node(20), os.O_RDWR)  # a VM holds group 20: waiting, no failure
                view = await handover.look()  # the kubelet's answer: no pod holds anything
                held = await handover.carry_out(Plan(release={20: (gpu, audio)}), view)
                os.close(vmm)
                assert held.waiting[gpu].reason == "HeldByProcess"
                host.set_default_driver(gpu, "vfio-pci")  # vfio-pci.ids=: it comes straight back
                await handover.carry_out(Plan(release={20: (gpu, audio)}), view)
                host.set_default_driver(gpu, "nvidia")
                await handover.carry_out(Plan(release={20: (gpu, audio)}), view)
                after = counts()
            finally:
                await handover.close()
    finally:
        await pods.stop(0)
    assert {key: after[key] - before[key] for key in before} == {"bound": 1, "given back": 1, "bind refused": 1, "give-back failed": 1}


# -- the device plugins ------------------------------------------------------------------------------


async def test_allocations_are_counted_by_resource_kind_and_result(plugin_dir):  # noqa: F811
    name = "passthrough_agent_device_plugin_allocations_total"
    before = {(k, r): value(agent_metrics.AGENT, name, kind=k, result=r) for k in ("pool", "exclusive") for r in ("ok", "refused")}
    pool, exclusive = DevicePlugin(A10, plugin_dir, [GPU0, GPU1]), DevicePlugin(NIC, plugin_dir, [NIC0])
    await pool.start()
    await exclusive.start()
    try:
        two_containers = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=[GPU0.id]),
                                                                 api.ContainerAllocateRequest(devices_ids=[GPU1.id])])  # fmt: skip
        async with channel_to(pool.socket_path) as channel:
            await api_grpc.DevicePluginStub(channel).Allocate(two_containers, timeout=2)
        async with channel_to(exclusive.socket_path) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                unknown = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=[GPU0.id])])
                await api_grpc.DevicePluginStub(channel).Allocate(unknown, timeout=2)
    finally:
        await pool.stop()
        await exclusive.stop()
    after = {key: value(agent_metrics.AGENT, name, kind=key[0], result=key[1]) for key in before}
    assert {key: after[key] - before[key] for key in before} == {
        ("pool", "ok"): 2, ("pool", "refused"): 0, ("exclusive", "ok"): 0, ("exclusive", "refused"): 1,
    }  # fmt: skip


async def test_registrations_and_the_plugins_state_are_counted(plugin_dir):  # noqa: F811
    registrations, failures = "passthrough_agent_device_plugin_registrations_total", "passthrough_agent_device_plugin_registration_failures_total"
    before = value(agent_metrics.AGENT, registrations), value(agent_metrics.AGENT, failures)
    kubelet = FakeKubelet(plugin_dir, refuse=1)
    await kubelet.start()
    manager = PluginManager(plugin_dir, poll_interval=0.05)
    collector = agent_metrics.AgentCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    collector.plugins = lambda: manager
    state = lambda kind, s: registry.get_sample_value("passthrough_agent_device_plugins", {"kind": kind, "state": s})  # noqa: E731
    runner = None
    try:
        await manager.set_resources({A10: [GPU0, dataclasses.replace(GPU1, healthy=False)], NIC: [NIC0]})
        # The kubelet refused the first, took the second.
        assert (state("pool", "unregistered"), state("exclusive", "registered")) == (1, 1)
        runner = asyncio.create_task(manager.run())
        await eventually(lambda: all(s.registered for s in manager.registrations().values()), 5, "both registered")
        assert (state("pool", "registered"), state("exclusive", "registered"), state("pool", "unregistered")) == (1, 1, 0)
        health = lambda kind, h: registry.get_sample_value("passthrough_agent_device_plugin_devices", {"kind": kind, "health": h})  # noqa: E731
        assert (health("pool", "Healthy"), health("pool", "Unhealthy"), health("exclusive", "Healthy")) == (1, 1, 1)
    finally:
        await manager.close()
        if runner is not None:
            await asyncio.wait_for(runner, 2)
        await kubelet.stop()
    assert value(agent_metrics.AGENT, registrations) - before[0] == 2
    assert value(agent_metrics.AGENT, failures) - before[1] == 1


# -- the endpoint ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_endpoint_serves_the_registry_in_either_format():
    port = _free_port()
    endpoint = await metrics.serve(agent_metrics.AGENT, port, "127.0.0.1")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as answer:
                text, content_type = await answer.text(), answer.headers["Content-Type"]
            async with session.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": "application/openmetrics-text"}) as answer:
                open_metrics = answer.headers["Content-Type"], await answer.text()
            async with session.get(f"http://127.0.0.1:{port}/other") as answer:
                assert answer.status == 404
    finally:
        await endpoint.cleanup()
    assert content_type.startswith("text/plain") and "version=0.0.4" in content_type
    assert "# TYPE passthrough_agent_scan_duration_seconds histogram" in text
    assert 'passthrough_build_info{component="agent"' in text
    assert "process_resident_memory_bytes" in text
    assert "passthrough_operator_" not in text  # the operator's metrics are not the agent's
    assert open_metrics[0].startswith("application/openmetrics-text") and open_metrics[1].endswith("# EOF\n")


async def test_port_0_serves_nothing_and_a_taken_port_is_an_error():
    assert await metrics.serve(operator_metrics.OPERATOR, 0) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            await metrics.serve(operator_metrics.OPERATOR, taken.getsockname()[1], "127.0.0.1")


async def _exchange(port: int, data: bytes) -> bytes:
    """Send `data` on one connection and read until the endpoint closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_the_endpoint_answers_again_on_a_kept_connection_and_closes_when_asked():
    port = _free_port()
    endpoint = await metrics.serve(agent_metrics.AGENT, port, "127.0.0.1")
    try:
        answers = await _exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
                                        b"HEAD /metrics?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # fmt: skip
        # HTTP/1.0 closes unless asked not to.
        old = await _exchange(port, b"GET /metrics HTTP/1.0\r\n\r\n")
    finally:
        await endpoint.cleanup()
    first, _, rest = answers.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" not in first
    length = int(next(h for h in first.split(b"\r\n") if h.startswith(b"Content-Length:")).split(b":")[1])
    body, second = rest[:length], rest[length:]
    assert b"passthrough_build_info" in body
    assert second.startswith(b"HTTP/1.1 200 OK") and second.endswith(b"\r\n\r\n")  # HEAD: headers only
    assert b"Connection: close" in second
    assert old.startswith(b"HTTP/1.1 200 OK") and b"passthrough_build_info" in old


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi", b"405"),
        (b"GARBAGE\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"413"),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"431"),
    ],
)
async def test_the_endpoint_refuses_what_it_does_not_serve_with_a_status_and_keeps_serving(request_bytes, status):
    port = _free_port()
    endpoint = await metrics.serve(operator_metrics.OPERATOR, port, "127.0.0.1")
    try:
        refused = await _exchange(port, request_bytes)
        after = await _exchange(port, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
    finally:
        await endpoint.cleanup()
    assert refused.split(b" ")[1] == status, refused[:200]
    assert after.startswith(b"HTTP/1.1 200 OK")


async def test_cleanup_closes_idle_connections():
    port = _free_port()
    endpoint = await metrics.serve(agent_metrics.AGENT, port, "127.0.0.1")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    await asyncio.wait_for(endpoint.cleanup(), 5)
    assert await asyncio.wait_for(reader.read(), 5) is not None  # the rest, then EOF: closed, not left open
    assert reader.at_eof()
    writer.close()
