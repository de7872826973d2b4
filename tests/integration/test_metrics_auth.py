"""`--metrics-auth`: the metrics go only to a bearer token whose user may get /metrics, as the
real API server decides (TokenReview, SubjectAccessReview), and the chart's roles allow both
processes to ask it.

The scrapers are real identities: ServiceAccounts with tokens from the TokenRequest API, one
bound to a ClusterRole like the chart's `<release>-metrics-reader`, one bound to nothing.
"""

from __future__ import annotations

import aiohttp
import pytest
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry, Counter

from e2e.cluster import free_ports
from passthrough import metrics
from passthrough.kube.client import session_of
from passthrough.kube.review import MetricsReviewer

pytestmark = pytest.mark.cluster


async def token_of(api, namespace: str, account: str) -> str:
    core = client.CoreV1Api(api)
    await core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=account)))
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
    answer = await session_of(api).request("POST", path, body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                                               "spec": {"expirationSeconds": 600}})  # fmt: skip
    return answer["status"]["token"]


@pytest.fixture
async def scrapers(api, namespace, unique):
    """(a token allowed to get /metrics, a token of a user allowed nothing)."""
    rbac = client.RbacAuthorizationV1Api(api)
    role = f"t-metrics-reader-{unique}"
    await rbac.create_cluster_role(client.V1ClusterRole(
        metadata=client.V1ObjectMeta(name=role),
        rules=[client.V1PolicyRule(non_resource_urls=["/metrics"], verbs=["get"])],
    ))  # fmt: skip
    await rbac.create_cluster_role_binding(client.V1ClusterRoleBinding(
        metadata=client.V1ObjectMeta(name=role),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=role),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name="prometheus", namespace=namespace)],
    ))  # fmt: skip
    try:
        yield await token_of(api, namespace, "prometheus"), await token_of(api, namespace, "tenant")
    finally:
        await rbac.delete_cluster_role_binding(role)
        await rbac.delete_cluster_role(role)


async def scrape(port: int, token: str | None) -> tuple[int, str, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics", headers=headers) as answer:
        return answer.status, await answer.text(), dict(answer.headers)


async def test_only_a_token_whose_user_may_get_metrics_reads_them(api, scrapers):
    allowed, denied = scrapers
    registry = CollectorRegistry()
    Counter("passthrough_test_scrapes", "a sample to find", registry=registry).inc()
    port = free_ports(1)[0]
    endpoint = await metrics.serve(registry, port, "127.0.0.1", MetricsReviewer(api))
    try:
        status, body, headers = await scrape(port, None)
        assert status == 401 and "Bearer" in headers.get("WWW-Authenticate", "") and "passthrough_test" not in body
        status, body, _ = await scrape(port, "not-a-token")
        assert status == 401 and "passthrough_test" not in body
        status, body, _ = await scrape(port, denied)
        assert status == 403 and "metrics-reader" in body and "passthrough_test" not in body
        status, body, _ = await scrape(port, allowed)
        assert status == 200 and "passthrough_test_scrapes_total 1.0" in body
        # The same token again is answered from what was decided a moment ago: no review.
        status, body, _ = await scrape(port, allowed)
        assert status == 200
    finally:
        await endpoint.cleanup()

