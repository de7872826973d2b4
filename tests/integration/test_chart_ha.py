"""The chart's high-availability pieces, rendered by the real helm: the operator's replicas, their
rollout, disruption budget, spread and readiness, the Lease's RBAC (checked by the API server),
and the webhook's certificate in both modes (generated, and cert-manager with a CA of its own).
"""

from __future__ import annotations

import base64
import os

import pytest
from cryptography import x509

from e2e import chart
from tests.integration.test_chart import container, one, template

pytestmark = pytest.mark.cluster

SELECTOR = {"app.kubernetes.io/name": "passthrough", "app.kubernetes.io/instance": "p", "app.kubernetes.io/component": "operator"}


def flag(command: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]
    return value


def test_two_replicas_rolled_one_at_a_time_each_ready_when_it_can_answer_the_webhooks(helm):
    objects = template(helm, "p", "infra")
    deployment = one(objects, "Deployment")
    spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    operator = container(objects, "Deployment")
    command = operator["command"]
    assert "--leader-elect" in command
    # Readiness is the webhook server and the caches, leader or not: a standby answers as well.
    assert flag(command, "readiness") == "http://0.0.0.0:8081/readyz"
    assert operator["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "readyz"}
    assert {"name": "readyz", "containerPort": 8081, "protocol": "TCP"} in operator["ports"]
    # A terminating replica keeps answering while the Service forgets it.
    assert operator["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in operator["env"]
    # Spread over nodes where it can be, never refused for want of them.
    [term] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": SELECTOR}}
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["podAntiAffinity"]
    budget = one(objects, "PodDisruptionBudget")
    assert budget["metadata"]["namespace"] == "infra"
    assert budget["spec"] == {"minAvailable": 1, "selector": {"matchLabels": SELECTOR}}
    assert SELECTOR.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_lease_role_names_the_lease_the_operator_is_told_to_hold(helm):
    objects = template(helm, "p", "infra")
    command = container(objects, "Deployment")["command"]
    lease, namespace = flag(command, "leader-elect-resource-name"), flag(command, "leader-elect-resource-namespace")
    assert (lease, namespace) == ("p-passthrough-operator", "infra")
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Role"}
    role = roles["p-passthrough-operator-leader-election"]
    assert role["metadata"]["namespace"] == namespace
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [lease], "verbs": ["get", "update"]},
    ]
    [binding] = [o for o in objects if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "p-passthrough-operator", "namespace": "infra"}]


def test_one_replica_gets_no_disruption_budget_that_would_block_every_drain(helm):
    objects = template(helm, "p", "infra", "--set=operator.replicas=1")
    assert one(objects, "Deployment")["spec"]["replicas"] == 1
    assert "PodDisruptionBudget" not in {o["kind"] for o in objects}


def test_an_affinity_of_the_admins_replaces_the_default_spread(helm):
    objects = template(helm, "p", "infra", "--set=operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                       ".nodeSelectorTerms[0].matchExpressions[0].key=infra",
                       "--set=operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                       ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists")  # fmt: skip
    affinity = one(objects, "Deployment")["spec"]["template"]["spec"]["affinity"]
    assert list(affinity) == ["nodeAffinity"]


def test_the_generated_ca_bundle_verifies_the_serving_certificate_for_the_service(helm):
    objects = template(helm, "p", "infra", "--show-only=templates/webhook.yaml")
    secret = one(objects, "Secret")["data"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["ca.crt"]))
    serving = x509.load_pem_x509_certificate(base64.b64decode(secret["tls.crt"]))
    serving.verify_directly_issued_by(ca)
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "p-passthrough-webhook.infra.svc" in names
    configuration = one(objects, "ValidatingWebhookConfiguration")
    assert "annotations" not in configuration["metadata"]
    assert {w["clientConfig"]["caBundle"] for w in configuration["webhooks"]} == {secret["ca.crt"]}


def test_cert_manager_signs_the_serving_certificate_with_a_ca_of_its_own_whose_bundle_outlives_renewals(helm):
    objects = template(helm, "p", "infra", "--show-only=templates/webhook.yaml", "--set=webhook.certManager.enabled=true")
    assert "Secret" not in {o["kind"] for o in objects}  # cert-manager writes it
    issuers = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Issuer"}
    certificates = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Certificate"}
    assert set(issuers) == {"p-passthrough-webhook-selfsigned", "p-passthrough-webhook-ca"}
    assert set(certificates) == {"p-passthrough-webhook-ca", "p-passthrough-webhook"}
    # The self-signed Issuer makes only the CA, which lives ten years and keeps its key when renewed.
    ca = certificates["p-passthrough-webhook-ca"]
    assert issuers["p-passthrough-webhook-selfsigned"] == {"selfSigned": {}}
    assert ca["isCA"] is True and ca["issuerRef"]["name"] == "p-passthrough-webhook-selfsigned"
    assert ca["duration"] == "87600h" and ca["privateKey"]["rotationPolicy"] == "Never"
    # The CA Issuer signs with the CA's Secret; the serving certificate is its, for the Service.
    assert issuers["p-passthrough-webhook-ca"] == {"ca": {"secretName": ca["secretName"]}}
    serving = certificates["p-passthrough-webhook"]
    assert serving["issuerRef"] == {"name": "p-passthrough-webhook-ca", "kind": "Issuer", "group": "cert-manager.io"}
    assert serving["secretName"] == "p-passthrough-webhook-tls"
    assert "isCA" not in serving and "p-passthrough-webhook.infra.svc" in serving["dnsNames"]
    # The caBundle is injected from the CA certificate, not the serving one: a renewal of the
    # serving certificate changes nothing the API server trusts.
    configuration = one(objects, "ValidatingWebhookConfiguration")
    assert configuration["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "infra/p-passthrough-webhook-ca"}
    assert all("caBundle" not in w["clientConfig"] for w in configuration["webhooks"])
    # The operator mounts the Secret the serving certificate fills.
    deployment = one(template(helm, "p", "infra", "--set=webhook.certManager.enabled=true"), "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["webhook-tls"]["secret"]["secretName"] == serving["secretName"]


def test_cert_manager_with_the_admins_issuer_makes_no_ca_and_injects_what_that_issuer_signs_with(helm):
    objects = template(helm, "p", "infra", "--show-only=templates/webhook.yaml", "--set=webhook.certManager.enabled=true",
                       "--set=webhook.certManager.issuerRef.name=corp-ca", "--set=webhook.certManager.issuerRef.kind=ClusterIssuer")  # fmt: skip
    assert "Issuer" not in {o["kind"] for o in objects}
    [serving] = [o for o in objects if o["kind"] == "Certificate"]
    assert serving["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}
    configuration = one(objects, "ValidatingWebhookConfiguration")
    assert configuration["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "infra/p-passthrough-webhook"}


# -- against the API server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def access(cluster, helm):
    suffix = os.urandom(3).hex()
    namespace, name = f"chart-ha-{suffix}", f"passthrough-{suffix}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        with chart.installed(cluster, chart.access(template(helm, name, namespace))):
            yield namespace, name
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_operator_may_create_its_lease_and_renew_only_that_one_in_its_namespace(cluster, access):
    namespace, name = access
    account = f"--as=system:serviceaccount:{namespace}:{name}-operator"

    def can(verb: str, what: str, where: str = namespace) -> bool:
        return cluster.kubectl("auth", "can-i", verb, what, account, "-n", where, check=False).stdout.strip() == "yes"

    lease = f"leases.coordination.k8s.io/{name}-operator"
    assert can("create", "leases.coordination.k8s.io") and can("get", lease) and can("update", lease)
    assert not can("update", "leases.coordination.k8s.io/kube-controller-manager")
    assert not can("delete", lease) and not can("list", "leases.coordination.k8s.io")
    assert not can("update", lease, "kube-system") and not can("create", "leases.coordination.k8s.io", "kube-system")

