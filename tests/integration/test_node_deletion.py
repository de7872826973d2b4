"""A deleted Node: its devices and their assignments wait for it, then are collected.

`kubectl delete node` is routine remediation, and a node that registers again gets a new uid.
Owned by their Node, NodePCIDevices went with it, and with them the admin's assignments. Now
the operator keeps them for the grace period and collects those of a node that stays gone.
The operator here runs with a grace period of its own, long enough to bring a node back.
"""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client

from e2e import support
from e2e.processes import OperatorProcess
from passthrough.kube.custom import Custom

pytestmark = pytest.mark.cluster

GRACE = 12


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", f"--not-found-grace={GRACE}s")
    proc.start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


@pytest.fixture
def kinds(api):
    return Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)


def condition(obj, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def wait_reason(kind: Custom, name: str, type_: str, reason: str, namespace: str | None = None, timeout: float = 20):
    async def check():
        obj = await kind.get(name, namespace)
        return obj if condition(obj, type_).get("reason") == reason else None

    return await support.wait_for(check, timeout, what=f"{type_}={reason} on {namespace or ''}/{name}")


async def events(api, namespace: str, name: str, reason: str) -> list:
    found = await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
    return [e for e in found.items if e.reason == reason]


@pytest.fixture
async def assigned(api, kinds, unique, namespace, operator):
    """A GPU on a fresh node, assigned to `namespace` and handed out; yields (node, name)."""
    npci, pcidev = kinds
    node = await support.ensure_node(api, f"node-{unique}")
    name = await support.report_device(api, node, support.gpu("0000:3b:00.0"))
    await support.assign(api, name, namespace)
    await wait_reason(npci, name, "Assigned", "Assigned")
    await support.wait_for(lambda: pcidev.get(name, namespace), 20, what="the PCIDevice")
    yield node, name
    await support.remove_node(api, node.name)


async def test_a_node_deleted_and_registered_again_keeps_its_assignments(api, kinds, namespace, assigned):
    npci, pcidev = kinds
    node, name = assigned
    before = await pcidev.get(name, namespace)
    await client.CoreV1Api(api).delete_node(node.name)

    # Both objects say what happened and until when; nothing is deleted.
    gone = await wait_reason(npci, name, "Assigned", "NodeGone")
    assert condition(gone, "Assigned")["status"] == "True"
    assert f"Node {node.name} was deleted" in condition(gone, "Assigned")["message"]
    assert gone["spec"]["assignedNamespace"] == namespace and gone["status"].get("missingSince")
    tenant = await wait_reason(pcidev, name, "Ready", "NodeGone", namespace)
    assert tenant["metadata"]["uid"] == before["metadata"]["uid"]
    assert await support.wait_for(lambda: events(api, namespace, name, "NodeGone"), 10, what="a Warning for the tenant")

    # Registered again (a new uid), its agent reports the device again: all as it was.
    node = await support.ensure_node(api, node.name)
    await support.report_device(api, node, support.gpu("0000:3b:00.0"))
    back = await wait_reason(npci, name, "Assigned", "Assigned")
    assert "missingSince" not in back["status"] and back["spec"]["assignedNamespace"] == namespace
    tenant = await wait_reason(pcidev, name, "Ready", "Ready", namespace)
    assert tenant["metadata"]["uid"] == before["metadata"]["uid"]


async def test_the_devices_of_a_node_that_stays_gone_are_collected_after_the_grace_period(api, kinds, namespace, assigned):
    npci, pcidev = kinds
    node, name = assigned
    await client.CoreV1Api(api).delete_node(node.name)
    await wait_reason(npci, name, "Assigned", "NodeGone")
    await asyncio.sleep(GRACE / 2)
    assert await npci.get(name) is not None  # not before the grace period ends

    async def collected():
        return await npci.get(name) is None and await pcidev.get(name, namespace) is None

    await support.wait_for(collected, GRACE + 20, what="the devices of the gone node collected")
    # Events follow once the operator's work queue has settled (10 s at most).
    [event] = await support.wait_for(lambda: events(api, "default", name, "Collected"), 15, what="the Collected Event")
    assert event.type == "Warning" and f"assigned to {namespace}" in event.message
