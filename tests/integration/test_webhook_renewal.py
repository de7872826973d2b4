"""A renewed serving certificate refuses nothing: the webhook server keeps listening and keeps
its connections while it starts serving the new pair.

The API server keeps its connections to a webhook alive between calls. A server that restarts
to load a renewed certificate closes them without the SIGTERM drain and, for a moment, listens
on nothing: with the same Secret mounted in every replica, every replica does that at about the
same time, and admission calls in flight then fail. Here the operator serves its webhooks from a
directory laid out as the kubelet writes a Secret volume; a connection made before the renewal
must still answer after it, and a probe connecting every 10 ms must never be refused.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from e2e.processes import OperatorProcess, WebhookServing, running

pytestmark = pytest.mark.cluster

CHECK = "0.2s"  # how often the operator looks at the files (--webhook-cert-check)
RENEWED_WITHIN = 15.0


def _review(namespace: str) -> bytes:
    """A pod CREATE the pod webhook judges (a pod asking for no device: allowed)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "namespace": namespace},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}  # fmt: skip
    return json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": namespace,
            "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod, "oldObject": None, "dryRun": False,
        },
    }).encode()  # fmt: skip


def _served_certificate(port: int, context: ssl.SSLContext) -> bytes:
    """The serving certificate (PEM) a new connection is given."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return ssl.DER_cert_to_PEM_cert(tls.getpeercert(binary_form=True)).encode()


class Prober(threading.Thread):
    """Connects and completes a TLS handshake every 10 ms; counts what fails and how."""

    def __init__(self, port: int, context: ssl.SSLContext) -> None:
        super().__init__(daemon=True)
        self.port, self.context = port, context
        self.done, self.tries, self.failures = threading.Event(), 0, []

    def run(self) -> None:
        while not self.done.is_set():
            self.tries += 1
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as raw, self.context.wrap_socket(raw, server_hostname="127.0.0.1"):
                    pass
            except OSError as exc:
                self.failures.append(repr(exc))
            time.sleep(0.01)


@pytest.fixture(scope="module")
def webhooks(cluster, tmp_path_factory):
    serving = WebhookServing(tmp_path_factory.mktemp("webhook-tls"))
    operator = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log",
                               f"--webhook-cert-check={CHECK}", webhook=serving)  # fmt: skip
    with running(operator):
        yield serving, operator


def _wait_served(serving: WebhookServing, context: ssl.SSLContext, operator: OperatorProcess) -> float:
    """Seconds until a new connection is given the certificate last written."""
    began = time.monotonic()
    while _served_certificate(serving.port, context) != serving.serving:
        assert time.monotonic() - began < RENEWED_WITHIN, f"the renewed certificate was not served:\n{operator.output()[-3000:]}"
        time.sleep(0.05)
    return time.monotonic() - began


@pytest.mark.parametrize("atomic", [True, False], ids=["secret-volume-swap", "written-one-file-at-a-time"])
def test_a_renewed_certificate_is_served_without_closing_a_connection_or_refusing_one(webhooks, atomic):
    serving, operator = webhooks
    with tempfile.NamedTemporaryFile(suffix=".crt") as ca:
        Path(ca.name).write_bytes(serving.ca)
        context = ssl.create_default_context(cafile=ca.name)
    before = serving.serving
    assert _served_certificate(serving.port, context) == before

    kept = http.client.HTTPSConnection("127.0.0.1", serving.port, context=context, timeout=10)
    kept.request("POST", "/validate-pod", body=_review("default"), headers={"Content-Type": "application/json"})
    first = kept.getresponse()
    assert first.status == 200 and json.loads(first.read())["response"]["allowed"] is True
    socket_before = kept.sock

    prober = Prober(serving.port, context)
    prober.start()
    try:
        time.sleep(0.3)
        serving.renew(atomic=atomic)
        took = _wait_served(serving, context, operator)
        time.sleep(0.5)  # the probe goes on past the switch
    finally:
        prober.done.set()
        prober.join()
    assert serving.serving != before

    assert prober.failures == [], f"{len(prober.failures)} of {prober.tries} connects failed: {prober.failures[:5]}"
    assert prober.tries > 30, prober.tries
    # The connection made before the renewal answers after it, on the same socket.
    kept.request("POST", "/validate-pod", body=_review("default"), headers={"Content-Type": "application/json"})
    second = kept.getresponse()
    assert second.status == 200 and json.loads(second.read())["response"]["allowed"] is True
    assert kept.sock is socket_before
    kept.close()
    assert "serving the renewed webhook certificate" in operator.output()
    print(f"renewed certificate served {took:.2f}s after it was written; {prober.tries} connects, none failed")
