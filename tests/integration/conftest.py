"""Fixtures for tests against the real control plane: an API client and the operator process."""

from __future__ import annotations

import contextlib
import uuid

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from e2e import support
from e2e.processes import OperatorProcess
from passthrough.k8s import connect

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


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", "--not-found-grace=4s")
    proc.start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-5000:]
