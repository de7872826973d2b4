"""The namespace-confirmation setting dates an assignment by what the real API server recorded of
it: an unrelated patch later by the same manager (the same `kubectl patch` setting a label)
stamps that manager's managedFields entry anew, and must not make a namespace that a tenant
created after the assignment look older than it."""

from __future__ import annotations

import json
import time

import pytest

from e2e import support
from passthrough.api.views import NodeDevice
from passthrough.controller.verdict import _older
from passthrough.kube.custom import Custom

pytestmark = pytest.mark.cluster


def next_second() -> None:
    """The API server stamps whole seconds: what follows is stamped a later second than what came before."""
    time.sleep(1.1)


async def test_an_unrelated_patch_by_the_assigning_manager_does_not_date_the_assignment_later(api, cluster, unique):
    node = await support.ensure_node(api, f"at-{unique}")
    kinds = Custom(api, "nodepcidevices")
    before, team = f"before-{unique}", f"team-{unique}"
    try:
        await support.create_namespace(api, before)  # a namespace that existed before the assignment
        next_second()
        name = await support.report_device(api, node, support.gpu("0000:3b:00.0"))
        next_second()
        cluster.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"spec": {"assignedNamespace": team}}))
        next_second()
        await support.create_namespace(api, team)  # the tenant's, made after the assignment
        created = {n: json.loads(cluster.kubectl("get", "namespace", n, "-o", "json").stdout)["metadata"]["creationTimestamp"]
                   for n in (before, team)}  # fmt: skip
        assigned = NodeDevice.of(await kinds.get(name)).assigned_at
        assert not _older(created[team], assigned) and _older(created[before], assigned), (created, assigned)

        next_second()
        cluster.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"metadata": {"labels": {"team": "c"}}}))
        body = await kinds.get(name)
        # The scene as the API server set it: the assignment's entry now carries the label's time.
        (entry,) = [e for e in body["metadata"]["managedFields"] if e["manager"] == "kubectl-patch"]
        assert _older(created[team], entry["time"]) and "f:labels" in json.dumps(entry["fieldsV1"]), entry
        later = NodeDevice.of(body).assigned_at
        assert not _older(created[team], later), f"the tenant's namespace ({created[team]}) looks older than {later}"
        assert _older(created[before], later), "a namespace from before the device is still trusted"
    finally:
        await support.remove_node(api, node.name)
        for namespace in (before, team):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
