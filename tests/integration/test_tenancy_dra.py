"""The agent's ResourceSlice writes confined to its own node, against the real API server.

RBAC lets the agent of DRA mode create and apply any ResourceSlice (it cannot name a node); the
chart's policy `<release>-agent-slices` narrows that to the slice of the node its token is bound
to, of our driver. The agent is a ServiceAccount token bound to a pod on node-1, as the
DaemonSet's is; what it sends is what `dra.slice` builds for the agent.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

from e2e import chart, identities, support
from passthrough.dra import slice as dra_slice
from passthrough.pci.discovery import Device
from tests.integration.test_tenancy import nodes, policy_no, refused  # noqa: F401  (nodes: node-1 and node-2 of this module's release)

pytestmark = pytest.mark.cluster
GPU = "0000:af:00.0"


@pytest.fixture(scope="module")
def release(cluster, helm):
    """The chart's accounts, roles and policies with DRA mode on, installed for real."""
    suffix = os.urandom(3).hex()
    namespace, name = f"tenancy-dra-{suffix}", f"passthrough-{suffix}"
    cluster.kubectl("create", "namespace", namespace)
    objects = chart.access(chart.template(helm, name, namespace, "--set=agent.devicePlugin.dra=true"))
    try:
        with chart.installed(cluster, objects):
            yield SimpleNamespace(suffix=suffix, namespace=namespace, name=name, policy=f"{name}-agent-slices")
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def agent(cluster, release, nodes, tmp_path_factory):
    """The agent of node-1: its ServiceAccount's token bound to a pod on node-1."""
    account = f"{release.name}-agent"
    identities.pod_on_node(cluster, release.namespace, "agent-node-1", nodes.one.name, account)
    who = identities.identity(cluster, release.namespace, account, tmp_path_factory.mktemp("agent"), bound_pod="agent-node-1")
    _wait_for_policy(who, release.policy, nodes.one)
    yield who
    for node in (nodes.one, nodes.two):
        cluster.kubectl("delete", "resourceslice", dra_slice.slice_name(node.name), "--ignore-not-found", check=False)


def gpu() -> Device:
    return support.gpu(GPU)


def slice_of(node, *, node_name: str | None = None, pool: str | None = None, driver: str | None = None, name: str = "") -> dict:
    """The slice the agent of `node` publishes (dra.slice), with one thing changed where asked."""
    published = [dra_slice.Published(gpu(), "pci-abc", "team-a")]
    [body] = dra_slice.pool_bodies(node.name, node.uid, dra_slice.specs(node.name, published), [None])
    body["metadata"]["name"] = name or body["metadata"]["name"]
    body["spec"]["nodeName"] = node_name or body["spec"]["nodeName"]
    body["spec"]["pool"]["name"] = pool or body["spec"]["pool"]["name"]
    body["spec"]["driver"] = driver or body["spec"]["driver"]
    return body


def apply(who, body: dict, *flags: str):
    return who.kubectl("apply", "--server-side", "--field-manager=passthrough-agent", *flags, "-f", "-", input=json.dumps(body))


def _wait_for_policy(who, policy: str, node, timeout: float = 20) -> None:
    """Until the API server enforces the policy (it loads a new one within seconds): probed with a
    server-side dry run of another node's slice."""
    probe = slice_of(node, node_name="probe-node", pool="probe-node")
    deadline = time.monotonic() + timeout
    while f"ValidatingAdmissionPolicy '{policy}'" not in apply(who, probe, "--dry-run=server").stderr:
        if time.monotonic() > deadline:
            raise AssertionError(f"the API server does not enforce {policy} after {timeout:.0f}s")
        time.sleep(0.2)


def not_ours(release, nodes, name: str, node_name: str, pool: str) -> str:
    one = nodes.one.name
    return policy_no(release.policy, f"the agent of node {one} may write only the ResourceSlice of its own node "
                                     f"(spec.nodeName and spec.pool.name {one}), not {name} (spec.nodeName {node_name}, "
                                     f"spec.pool.name {pool})")  # fmt: skip


async def test_the_agent_publishes_its_own_nodes_slice_and_no_other(agent, release, nodes):
    one, two = nodes.one, nodes.two
    assert agent.can_i("create", "resourceslices.resource.k8s.io")  # RBAC: any slice; the policy narrows it
    # Its own node's slice, as the driver writes it: created, and applied again.
    for _ in range(2):
        answer = apply(agent, slice_of(one))
        assert answer.returncode == 0, answer.stderr

    # Another node's slice, under that node's name or its own.
    theirs = slice_of(two)
    name = theirs["metadata"]["name"]
    assert refused(apply(agent, theirs)).endswith(not_ours(release, nodes, name, two.name, two.name))
    # A slice of its own node in node-2's pool: the scheduler reads only a pool's newest
    # generation, so this would hide node-2's own devices. (A slice's node and pool are
    # immutable: the API server refuses moving the one it has before any policy is asked.)
    extra = f"{one.name}-extra"
    assert refused(apply(agent, slice_of(one, pool=two.name, name=extra))).endswith(
        not_ours(release, nodes, extra, one.name, two.name))
    # A slice of node-2 in its own pool.
    assert refused(apply(agent, slice_of(one, node_name=two.name, name=extra))).endswith(
        not_ours(release, nodes, extra, two.name, one.name))
    # Another driver's devices on its own node.
    message = refused(apply(agent, slice_of(one, driver="gpu.nvidia.com", name=extra)))
    assert message.endswith(policy_no(release.policy, f"the agent of node {one.name} may publish only the devices of driver "
                                                      "pci.passthrough.io, not of gpu.nvidia.com"))  # fmt: skip
    for never in (name, extra):
        assert agent.kubectl("get", "resourceslice", never).returncode != 0, never


async def test_a_token_bound_to_no_pod_writes_no_slice(cluster, release, nodes, tmp_path):
    unbound = identities.identity(cluster, release.namespace, f"{release.name}-agent", tmp_path)
    message = refused(apply(unbound, slice_of(nodes.one), "--dry-run=server"))
    assert "writes ResourceSlices only with a token bound to a pod on its node" in message
