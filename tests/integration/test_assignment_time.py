"""The namespace-confirmation setting dates an assignment by what the real API server recorded of
it: an unrelated patch later by the same manager (the same `kubectl patch` setting a label)
stamps that manager's managedFields entry anew, and must not make a namespace that a tenant
created after the assignment look older than it.

With the operator's webhook (the chart's MutatingWebhookConfiguration, calling the operator on
127.0.0.1), the assignment carries its own time, set in the request that makes it: a namespace
made between the device's report and its assignment stays older than the assignment through
such a patch, and the time can be changed only by assigning again."""

from __future__ import annotations

import json
import time

import pytest

from e2e import chart, support
from e2e.processes import OperatorProcess, WebhookServing, running
from passthrough.api.views import ASSIGNED_AT, NodeDevice
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


@pytest.fixture(scope="module")
def dating(cluster, helm, tmp_path_factory):
    """The operator serving its webhooks on 127.0.0.1, and the chart's MutatingWebhookConfiguration
    calling it, live: a server-side dry run of an assignment comes back dated."""
    serving = WebhookServing(tmp_path_factory.mktemp("webhook-tls"))
    objects = chart.template(helm, "passthrough", "passthrough-system", "--show-only=templates/webhook.yaml")
    [configuration] = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
    configuration = serving.point(configuration)
    probe = {"apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice", "metadata": {"name": "probe-dating"},
             "spec": {"assignedNamespace": "probe"}}  # fmt: skip

    def dated() -> bool:
        out = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(probe), check=False)
        return out.returncode == 0 and ASSIGNED_AT in (json.loads(out.stdout)["metadata"].get("annotations") or {})

    with running(OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", webhook=serving)):
        cluster.kubectl("create", "-f", "-", input=json.dumps(configuration))
        try:
            deadline = time.monotonic() + 30
            while not dated():
                assert time.monotonic() < deadline, "the API server never called the webhook that dates an assignment"
                time.sleep(0.2)
            yield configuration
        finally:
            cluster.kubectl("delete", "mutatingwebhookconfiguration", configuration["metadata"]["name"], check=False)


async def test_the_webhook_dates_the_assignment_itself_so_a_namespace_made_after_the_device_stays_older_through_a_patch(
    api, cluster, unique, dating,
):  # fmt: skip
    node = await support.ensure_node(api, f"dated-{unique}")
    kinds = Custom(api, "nodepcidevices")
    before, early, team = f"before-{unique}", f"early-{unique}", f"team-{unique}"
    try:
        await support.create_namespace(api, before)  # before the device
        next_second()
        name = await support.report_device(api, node, support.gpu("0000:3b:00.0"))
        assert ASSIGNED_AT not in ((await kinds.get(name))["metadata"].get("annotations") or {})  # no assignment, no time
        next_second()
        await support.create_namespace(api, early)  # after the device, before its assignment
        next_second()
        cluster.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"spec": {"assignedNamespace": early}}))
        next_second()
        await support.create_namespace(api, team)  # after the assignment
        created = {n: json.loads(cluster.kubectl("get", "namespace", n, "-o", "json").stdout)["metadata"]["creationTimestamp"]
                   for n in (before, early, team)}  # fmt: skip
        body = await kinds.get(name)
        assigned = NodeDevice.of(body).assigned_at
        assert body["metadata"]["annotations"][ASSIGNED_AT] == assigned, body["metadata"]
        assert _older(created[before], assigned) and _older(created[early], assigned), (created, assigned)
        assert not _older(created[team], assigned), (created, assigned)

        next_second()
        cluster.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"metadata": {"labels": {"team": "c"}}}))
        body = await kinds.get(name)
        (entry,) = [e for e in body["metadata"]["managedFields"] if e["manager"] == "kubectl-patch"]
        assert _older(created[team], entry["time"]), entry  # the assigning manager's entry moved on
        assert NodeDevice.of(body).assigned_at == assigned, "an unrelated patch moved the assignment's time"

        # By hand, the time is neither moved nor removed: refused, saying how to date the assignment anew.
        for value in ("2020-01-01T00:00:00Z", None):
            refused = cluster.kubectl("patch", "npci", name, "--type=merge", "-p",
                                      json.dumps({"metadata": {"annotations": {ASSIGNED_AT: value}}}), check=False)  # fmt: skip
            assert refused.returncode != 0 and "clear spec.assignedNamespace and set it again" in refused.stderr, refused
            assert f"leave it as it was ({assigned})" in refused.stderr, refused.stderr
        assert (await kinds.get(name))["metadata"]["annotations"][ASSIGNED_AT] == assigned

        # Assigned anew, dated anew (a write that carries the old time too); cleared, no time is left.
        next_second()
        cluster.kubectl("patch", "npci", name, "--type=merge", "-p",
                        json.dumps({"metadata": {"annotations": {ASSIGNED_AT: assigned}}, "spec": {"assignedNamespace": team}}))  # fmt: skip
        again = NodeDevice.of(await kinds.get(name)).assigned_at
        assert _older(created[team], again) and _older(assigned, again), (created, assigned, again)
        cluster.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"spec": {"assignedNamespace": None}}))
        assert ASSIGNED_AT not in ((await kinds.get(name))["metadata"].get("annotations") or {})
    finally:
        await support.remove_node(api, node.name)
        for namespace in (before, early, team):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
