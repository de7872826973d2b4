"""The agent answers `helm uninstall`'s give-back request as the chart's DaemonSet runs it: as its
own service account (a token bound to a pod on its node), under the chart's RBAC and the policy
that confines its Node writes to its own node's passthrough.io/ labels, against the real API
server. Withdrawn, the request's answer goes too."""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from e2e import support
from passthrough.api.labels import GIVE_BACK_LABEL, GIVEN_BACK_LABEL
from tests.integration.test_chart import agent, denied_requests, node, release, since  # noqa: F401 (fixtures)

pytestmark = pytest.mark.cluster


async def test_the_agent_answers_a_give_back_request_with_only_its_service_account_and_the_node_policy(api, agent, node):
    core = client.CoreV1Api(api)
    before = await denied_requests(api)

    async def answer():
        return (await core.read_node(node.name)).metadata.labels.get(GIVEN_BACK_LABEL, "")

    await core.patch_node(node.name, {"metadata": {"labels": {GIVE_BACK_LABEL: "42"}}})
    await support.wait_for(lambda: _is(answer, "42"), 30, 0.2, what=lambda: f"the agent's answer; log:\n{_tail(agent)}")
    await core.patch_node(node.name, {"metadata": {"labels": {GIVE_BACK_LABEL: None}}})
    await support.wait_for(lambda: _is(answer, ""), 30, 0.2, what=lambda: f"the answer withdrawn; log:\n{_tail(agent)}")
    assert since(before, await denied_requests(api)) == {}
    assert agent["proc"].poll() is None


async def _is(read, value: str) -> bool:
    return await read() == value


def _tail(agent) -> str:
    return agent["log"].read_text()[-3000:]
