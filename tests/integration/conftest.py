"""Fixtures for tests against the real control plane: an API client, the operator process, helm."""

from __future__ import annotations

import contextlib
import uuid

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from e2e import chart, support
from e2e.cluster import free_ports
from e2e.processes import OperatorProcess
from passthrough.kube.connect import connect

pytestmark = pytest.mark.cluster


@pytest_asyncio.fixture(scope="session")
async def api(cluster):
    connection = await connect(str(cluster.kubeconfig))
    yield connection
    await connection.close()


@pytest.fixture
def unique():
    """A short unique suffix for names, so tests sharing the cluster never collide."""
    return uuid.uuid4().hex[:6]


@pytest_asyncio.fixture
async def namespace(api, unique):
    core = client.CoreV1Api(api)
    name = f"t-{unique}"
    await support.create_namespace(api, name)
    yield name
    with contextlib.suppress(client.exceptions.ApiException):
        await core.delete_namespace(name)


@pytest.fixture
async def node(api, unique):
    """A Node object of this test's own (no kubelet behind it), deleted after."""
    node = await support.ensure_node(api, f"node-{unique}")
    yield node
    with contextlib.suppress(client.exceptions.ApiException):
        await support.remove_node(api, node.name)


@pytest.fixture(scope="session")
def helm(tmp_path_factory):
    """The real helm (e2e/chart.py), with a throwaway home."""
    return chart.helm(tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    # Its metrics on loopback: a test that asserts "no write" waits for a reconcile to have run.
    port = free_ports(1)[0]
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", "--not-found-grace=4s",
                           f"--metrics-port={port}", "--metrics-addr=127.0.0.1")  # fmt: skip
    proc.metrics_port = port
    proc.start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


# -- the real kubelet and kube-scheduler (e2e/kubelet.py) ----------------------------------


def _kubelet_or_skip(request, cluster) -> None:
    """Skip, with one line saying why, where the real kubelet cannot run here (fail under CI)."""
    from e2e import kubelet

    reason = kubelet.why_unavailable(cluster)
    if reason is not None:
        support.cannot_run(request, "real-kubelet", reason, once_key="kubelet")


class KubeletNodes:
    """Starts KubeletNodes on request (`nodes()` or `nodes("name", labels={...})`), stops them all after."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.started = []

    def __call__(self, node_name=None, **kwargs):
        from e2e.kubelet import KubeletNode

        node = KubeletNode(self.cluster, node_name, **kwargs)
        self.started.append(node)
        return node.start()

    def stop_all(self) -> None:
        for node in reversed(self.started):
            node.stop()
        self.started.clear()


@pytest.fixture(scope="session")
def kube_scheduler(request, cluster):
    """The real kube-scheduler for the whole session (pods without nodeName get placed)."""
    from e2e.kubelet import Scheduler

    _kubelet_or_skip(request, cluster)
    scheduler = Scheduler(cluster).start()
    yield scheduler
    scheduler.stop()


@pytest.fixture
def kubelet_nodes(request, cluster):
    """A factory of real-kubelet nodes, each stopped (Node and its pods deleted) after the test."""
    _kubelet_or_skip(request, cluster)
    nodes = KubeletNodes(cluster)
    yield nodes
    nodes.stop_all()


@pytest.fixture(scope="module")
def module_kubelet_nodes(request, cluster):
    """The same factory, its nodes shared by the tests of a module."""
    _kubelet_or_skip(request, cluster)
    nodes = KubeletNodes(cluster)
    yield nodes
    nodes.stop_all()
