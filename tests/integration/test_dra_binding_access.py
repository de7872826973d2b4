"""The DRA agent's answer to a binding condition, with the chart's own access, against the real
API server: the agent of node-1 (its ServiceAccount's token bound to a pod on node-1, as the
DaemonSet's is) may write our driver's entries in the status.devices of a claim allocated on
node-1, and not of one allocated on node-2, nor another driver's entries; it reads every claim.
The body is what `dra.binding` builds for the driver.
"""

from __future__ import annotations

import json

import pytest

from passthrough.dra import binding as dra_binding
from passthrough.dra.slice import BOUND, DRIVER
from passthrough.kube.client import session_of
from tests.integration.test_tenancy import nodes  # noqa: F401  (node-1 and node-2 of this module's release)
from tests.integration.test_tenancy_dra import agent, release  # noqa: F401  (the chart in DRA mode; node-1's agent)

pytestmark = pytest.mark.cluster
RESOURCE = "/apis/resource.k8s.io/v1"


async def allocated_on(api, namespace: str, name: str, node: str) -> dict:
    """A claim whose status says what the scheduler writes for a device of our driver on `node`."""
    session = session_of(api)
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "passthrough-pool.gpu"}}]}}}  # fmt: skip
    created = await session.request("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaims", body=body)
    created["status"] = {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": "pci-0000-af-00-0",
                                 "bindingConditions": [BOUND], "bindingFailureConditions": ["VFIOBindFailed"]}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }}  # fmt: skip
    return await session.request("PUT", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}/status", body=created)


def answer(agent, claim: dict, node: str, driver: str = DRIVER):
    """The agent applies its VFIOBound answer into the claim's status, as the driver does."""
    waiting = dra_binding.waiting(node, claim)
    body = dra_binding.status_apply(waiting, node, {"pci-0000-af-00-0": dra_binding.condition(True, "on vfio-pci", "2026-01-01T00:00:00Z")})
    body["status"]["devices"][0]["driver"] = driver
    return agent.kubectl("apply", "--server-side", f"--field-manager={dra_binding.FIELD_MANAGER}", "--subresource=status",
                         "-f", "-", input=json.dumps(body))  # fmt: skip


async def test_the_agent_answers_for_claims_allocated_on_its_node_only(api, agent, release, nodes, namespace):
    assert agent.can_i("list", "resourceclaims.resource.k8s.io", "--all-namespaces")
    assert agent.can_i("watch", "resourceclaims.resource.k8s.io", "--all-namespaces")
    mine = await allocated_on(api, namespace, "on-node-1", nodes.one.name)
    done = answer(agent, mine, nodes.one.name)
    assert done.returncode == 0, done.stderr
    written = await session_of(api).request("GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/on-node-1")
    [entry] = written["status"]["devices"]
    assert (entry["driver"], entry["pool"], entry["conditions"][0]["type"]) == (DRIVER, nodes.one.name, BOUND)
    assert dra_binding.waiting(nodes.one.name, written).devices == ()  # answered: the driver waits no more

    # The API server refuses it as a field it may not change (Invalid, status.devices: Forbidden).
    theirs = await allocated_on(api, namespace, "on-node-2", nodes.two.name)
    message = refused(answer(agent, theirs, nodes.two.name))
    assert 'changing status.devices requires resource="resourceclaims/driver", verb="[arbitrary-node:patch]"' in message, message
    message = refused(answer(agent, mine, nodes.one.name, driver="gpu.nvidia.com"))
    assert 'cannot associated-node:patch resource "resourceclaims/driver"' in message, message
    assert "gpu.nvidia.com" not in json.dumps((await session_of(api).request(
        "GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/on-node-1"))["status"]["devices"])  # fmt: skip


def refused(done) -> str:
    assert done.returncode != 0 and "status.devices: Forbidden" in done.stderr, (done.stdout, done.stderr)
    return done.stderr.strip()
