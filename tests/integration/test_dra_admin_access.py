"""Who may grant DRA admin access, against the real API server: the chart's policy (DRA mode)
keeps the namespace label resource.kubernetes.io/admin-access=true to cluster admins, as
Kubernetes' DRA hardening guide says to guard it. The tenant is a ServiceAccount token whose
RBAC lets it update its own namespace, as a namespace owner's often does.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from e2e import chart, identities, support

pytestmark = pytest.mark.cluster
LABEL = "resource.kubernetes.io/admin-access"


async def _wait(predicate, what: str) -> None:
    await support.wait_for(lambda: asyncio.to_thread(predicate), 20, 0.2, what=what)


def labels(cluster, namespace: str) -> dict[str, str]:
    return json.loads(cluster.kubectl("get", "namespace", namespace, "-o", "json").stdout)["metadata"].get("labels") or {}


async def test_only_a_cluster_admin_may_label_a_namespace_for_admin_access(cluster, helm, tmp_path):
    suffix = os.urandom(3).hex()
    objects = chart.template(helm, f"rel-{suffix}", "passthrough-system", "--set=agent.devicePlugin.dra=true",
                             "--show-only=templates/admin-access-policy.yaml")  # fmt: skip
    [policy] = [o["metadata"]["name"] for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    team, role = f"team-{suffix}", f"namespace-labeller-{suffix}"
    cluster.kubectl("create", "namespace", team)
    cluster.kubectl("create", "clusterrole", role, "--verb=get,patch,update", "--resource=namespaces")
    try:
        with chart.installed(cluster, objects):
            owner = identities.identity(cluster, team, "owner", tmp_path)
            identities.bind(cluster, owner, role, team)  # its own namespace, and no other
            await _wait(lambda: owner.can_i("patch", f"namespaces/{team}", "-n", team), "RBAC to let the tenant label its namespace")
            grant = ("label", "namespace", team, f"{LABEL}=true")
            await _wait(lambda: policy in owner.kubectl(*grant, "--dry-run=server").stderr, f"the API server to enforce {policy}")

            refused = owner.kubectl(*grant)
            assert refused.returncode != 0 and "(Forbidden)" in refused.stderr, refused.stderr
            assert (f"only cluster admins (system:masters) may label namespace {team} {LABEL}=true, not {owner.user}: "
                    "a ResourceClaim there could reach with adminAccess any DRA device of the cluster") in refused.stderr  # fmt: skip
            assert LABEL not in labels(cluster, team)
            # Any other label is the tenant's, and so is "false".
            assert owner.kubectl("label", "namespace", team, "tier=gold", f"{LABEL}=false").returncode == 0
            assert labels(cluster, team)[LABEL] == "false"

            # A cluster admin may; the tenant may then change other labels, and take the grant away.
            cluster.kubectl("label", "namespace", team, f"{LABEL}=true", "--overwrite")
            assert owner.kubectl("label", "namespace", team, "tier=silver", "--overwrite").returncode == 0
            assert labels(cluster, team)[LABEL] == "true"
            assert owner.kubectl("label", "namespace", team, f"{LABEL}-").returncode == 0
            assert LABEL not in labels(cluster, team)
            # ... but not give it back.
            again = owner.kubectl(*grant)
            assert again.returncode != 0 and policy in again.stderr, again.stderr
    finally:
        cluster.kubectl("delete", "clusterrole", role, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", team, "--wait=false", check=False)
