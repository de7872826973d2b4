"""The webhooks' availability on a real node with the chart installed, as clients see it.

`Load` creates launcher-shaped pods and VMs that name a device their namespace does not hold,
as a client of the API server (its own kept-alive HTTPS connections, several at once), so the
API server must call the webhook through the chart's Service for every one: an answer is the
webhook's denial, anything else (`failed calling webhook`, a timeout) is a refusal as the
client sees it. `Probe` connects and completes a TLS handshake every 10 ms, from the node's
network, to the Service's ClusterIP and to each replica's address, and names the certificate
each handshake met. `renew_certificate` renews the serving certificate as an issuer does.
The disruptions (a SIGKILL of a replica's process, a kill of its container through the
runtime, a rollout restart) are the caller's; this counts. `drain_the_leaders_node` drains the
leader's node (two nodes: `RealNode(joins=...)`) and counts.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from e2e.realnode import build as nodebuild
from e2e.realnode import config, install
from e2e.realnode.node import RealNode, RealNodeError

NAMESPACE = "ha-load"
ABSENT = "passthrough.io/pci-ha-absent"  # a device no namespace holds: the webhook denies it
DENIED = "denied the request"
WEBHOOK_SERVICE = f"{install.FULLNAME}-webhook"
SECRET = f"{install.FULLNAME}-webhook-tls"
WEBHOOK_PORT = 9443


def _pod(name: str) -> dict:
    """What virt-controller makes for a VM with a host device: a compute container asking for it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"kubevirt.io": "virt-launcher"}},
        "spec": {"containers": [{"name": "compute", "image": "virt-launcher:test",
                                 "resources": {"limits": {ABSENT: "1"}, "requests": {ABSENT: "1"}}}]},
    }  # fmt: skip


def _vm(name: str) -> dict:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {
            "runStrategy": "Halted",
            "template": {"spec": {"domain": {"devices": {"hostDevices": [{"name": "dev0", "deviceName": ABSENT}]}}}},
        },
    }


@dataclass
class Call:
    started: float  # monotonic
    ended: float
    outcome: str  # "answered" (the webhook's denial), or what the client got instead
    detail: str = ""


@dataclass
class Outcomes:
    calls: list[Call] = field(default_factory=list)

    def between(self, start: float, end: float) -> list[Call]:
        return [c for c in self.calls if c.ended >= start and c.started <= end]

    @staticmethod
    def refused(calls: list[Call]) -> list[Call]:
        return [c for c in calls if c.outcome != "answered"]

    @staticmethod
    def latency_ms(calls: list[Call]) -> tuple[float, float, float]:
        """p50, p99 and max of the answered calls' latency, in ms."""
        times = sorted((c.ended - c.started) * 1000 for c in calls if c.outcome == "answered")
        if not times:
            return (0.0, 0.0, 0.0)
        return (times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))], times[-1])


class Load:
    """`workers` clients, each creating a pod or a VM (alternately) every `interval` seconds on one
    kept-alive connection to the API server; every answer is recorded with its times."""

    def __init__(self, node: RealNode, workers: int = 4, interval: float = 0.05) -> None:
        self.node, self.workers, self.interval = node, workers, interval
        host, port = node.server.removeprefix("https://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.context = ssl.create_default_context(cafile=str(node.workdir / "cluster" / "pki" / "ca.crt"))
        self.headers = {"Authorization": f"Bearer {node.info['token']}", "Content-Type": "application/json"}
        self.outcomes = Outcomes()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Load:
        self.node.kubectl("create", "namespace", NAMESPACE, check=False)
        for worker in range(self.workers):
            thread = threading.Thread(target=self._run, args=(worker,), daemon=True, name=f"load-{worker}")
            thread.start()
            self._threads.append(thread)
        return self

    def until_answered(self, timeout: float = 60) -> Load:
        """Until the webhook answered a call: rolled out is not yet reachable, kube-proxy has the
        Service's endpoints a moment later."""
        install.wait_for(lambda: any(c.outcome == "answered" for c in self.outcomes.calls), timeout, "a webhook answer through the Service")
        return self

    def stop(self) -> Outcomes:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        return self.outcomes

    def _run(self, worker: int) -> None:
        connection: http.client.HTTPSConnection | None = None
        n = 0
        while not self._stop.is_set():
            n += 1
            if n % 2:
                path, body = f"/api/v1/namespaces/{NAMESPACE}/pods", _pod(f"launcher-{worker}-{n}")
            else:
                path, body = f"/apis/kubevirt.io/v1/namespaces/{NAMESPACE}/virtualmachines", _vm(f"vm-{worker}-{n}")
            if connection is None:
                connection = http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=40)
            started = time.monotonic()
            try:
                connection.request("POST", path, json.dumps(body), self.headers)
                response = connection.getresponse()
                text = response.read().decode(errors="replace")
                status = response.status
            except (OSError, http.client.HTTPException) as exc:
                status, text = 0, f"{type(exc).__name__}: {exc}"
                connection.close()
                connection = None
            ended = time.monotonic()
            if status == 403 and DENIED in text:
                call = Call(started, ended, "answered")
            else:
                message = text
                with contextlib.suppress(ValueError, AttributeError):
                    message = json.loads(text).get("message", text)
                call = Call(started, ended, f"HTTP {status}" if status else "client error", message[:300])
            with self._lock:
                self.outcomes.calls.append(call)
            self._stop.wait(max(0.0, self.interval - (ended - started)))
        if connection is not None:
            connection.close()


# -- the connect probe ----------------------------------------------------------------------------

PROBE = r"""
import http.client, json, os, socket, ssl, sys, time, hashlib, pathlib
targets = json.loads(sys.argv[1]); stop = pathlib.Path(sys.argv[2]); out = pathlib.Path(sys.argv[3])
def write():  # whole or not at all: the reader never meets half a file
    pathlib.Path(f"{out}.new").write_text(json.dumps(counts)); os.replace(f"{out}.new", out)
context = ssl.create_default_context(); context.check_hostname = False; context.verify_mode = ssl.CERT_NONE
counts = {t: {"connects": 0, "refused": 0, "failed": 0, "served": {}, "errors": [], "kept_asks": 0, "kept_closed": 0}
          for t in targets}
kept = {}
round = 0
while not stop.exists():
    round += 1
    for target in targets:
        host, port = target.rsplit(":", 1)
        c = counts[target]; c["connects"] += 1
        try:
            with socket.create_connection((host, int(port)), timeout=2) as raw:
                with context.wrap_socket(raw) as tls:
                    digest = hashlib.sha256(tls.getpeercert(binary_form=True)).hexdigest()[:16]
                    c["served"][digest] = c["served"].get(digest, 0) + 1
        except ConnectionRefusedError as exc:
            c["refused"] += 1; c["errors"].append(f"{time.monotonic():.3f} {exc}")
        except (OSError, ssl.SSLError) as exc:
            c["failed"] += 1; c["errors"].append(f"{time.monotonic():.3f} {type(exc).__name__}: {exc}")
        # One kept-alive connection per target, as the API server keeps them, asked every 200 ms:
        # a server that closes it (or says it will) is counted.
        if round % 20 == 0:
            connection = kept.get(target) or http.client.HTTPSConnection(host, int(port), context=context, timeout=5)
            kept[target] = connection
            c["kept_asks"] += 1
            try:
                connection.request("GET", "/healthz")
                response = connection.getresponse(); response.read()
                if response.will_close:
                    raise http.client.HTTPException("the server closes the connection")
            except (OSError, http.client.HTTPException) as exc:
                if c["kept_asks"] > 1:
                    c["kept_closed"] += 1; c["errors"].append(f"{time.monotonic():.3f} kept connection: {type(exc).__name__}: {exc}")
                connection.close(); kept.pop(target, None)
    write()
    time.sleep(0.01)
write()
"""


class Probe:
    """A connect and TLS handshake every 10 ms to each target, from the node's network, and a
    request every 200 ms on one kept-alive connection to each; `counts()` says, per target,
    connects, refusals, other failures, how often each certificate was served, and how often
    the kept connection was closed under it."""

    def __init__(self, node: RealNode, targets: list[str], folder: Path) -> None:
        self.node, self.targets = node, targets
        self.stop_file, self.out = folder / "probe.stop", folder / "probe.json"
        self._proc: subprocess.Popen | None = None

    def start(self) -> Probe:
        pid = self.node._supervisor_pid()
        if pid is None:
            raise RealNodeError("the node is not running")
        # A probe before this one in the same folder left its stop mark and its counts.
        self.stop_file.unlink(missing_ok=True)
        self.out.unlink(missing_ok=True)
        self._proc = subprocess.Popen(
            ["nsenter", f"--net=/proc/{pid}/ns/net", "--", sys.executable, "-c", PROBE, json.dumps(self.targets), str(self.stop_file),
             str(self.out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        install.wait_for(lambda: self.out.exists(), 30, "the connect probe's first round")
        return self

    def counts(self) -> dict:
        return json.loads(self.out.read_text())

    def stop(self) -> dict:
        self.stop_file.touch()
        if self._proc is not None:
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        return self.counts()


def fingerprint(pem: bytes) -> str:
    import hashlib

    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.decode())).hexdigest()[:16]


# -- the cluster's side -------------------------------------------------------------------------


def operator_pods(node: RealNode) -> list[dict]:
    return [p for p in install.pods(node) if p["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"
            and p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def leader(node: RealNode, timeout: float = 60) -> dict:
    """The pod whose running process holds the operator's Lease: its holderIdentity is the pod's
    name and a suffix of the process's own, so a Lease left by a killed process names no one
    until a replica takes it."""

    def holder() -> dict | None:
        lease = json.loads(node.kubectl("get", "lease", install.OPERATOR, "-n", install.NAMESPACE, "-o", "json").stdout)
        identity = lease["spec"].get("holderIdentity") or ""
        for pod in operator_pods(node):
            if identity.startswith(pod["metadata"]["name"]) and all(s["ready"] for s in pod["status"]["containerStatuses"]):
                # The running container's log names the identity it leads as; a killed one's does not.
                log = node.kubectl("logs", "-n", install.NAMESPACE, pod["metadata"]["name"], check=False).stdout
                if f"as {identity} " in log:
                    return pod
        return None

    return install.wait_for(holder, timeout, "a running replica holding the Lease")


def ready_endpoints(node: RealNode) -> int:
    """How many of the webhook Service's endpoints are ready, as kube-proxy reads them."""
    slices = json.loads(node.kubectl("get", "endpointslices", "-n", install.NAMESPACE, "-o", "json",
                                     f"-l=kubernetes.io/service-name={WEBHOOK_SERVICE}").stdout)["items"]  # fmt: skip
    return sum(1 for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready"))


def targets(node: RealNode) -> list[str]:
    """The webhook Service's ClusterIP and each Running replica's address."""
    service = json.loads(node.kubectl("get", "service", WEBHOOK_SERVICE, "-n", install.NAMESPACE, "-o", "json").stdout)
    return [f"{service['spec']['clusterIP']}:443"] + [f"{p['status']['podIP']}:{WEBHOOK_PORT}" for p in operator_pods(node)]


def container_id(pod: dict) -> str:
    [status] = pod["status"]["containerStatuses"]
    return status["containerID"].removeprefix("containerd://")


def process_of(pod: dict) -> int:
    """The host's pid of the pod's operator process (its environment names the pod)."""
    name = pod["metadata"]["name"].encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if b"operator" in (entry / "cmdline").read_bytes() and b"POD_NAME=" + name + b"\0" in (entry / "environ").read_bytes() + b"\0":
                return int(entry.name)
    raise RealNodeError(f"no process of pod {pod['metadata']['name']}")


def _unread_request(pid: int) -> bool:
    """Whether a connection to the webhook port of `pid`'s network holds bytes the process has
    not read yet: a request the API server sent, in flight on that process."""
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                port, state, queues = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[4]
                if port == WEBHOOK_PORT and state == "01" and int(queues.split(":")[1], 16) > 0:
                    return True
    return False


def when_a_request_is_in_flight(pod: dict, timeout: float = 20) -> bool:
    """Until a request is in flight on the pod's process (polled as fast as this can); False if
    none was caught in `timeout` seconds."""
    pid = process_of(pod)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _unread_request(pid):
            return True
    return False


def sigkill(pod: dict) -> None:
    """As the OOM killer does: SIGKILL to the container's process; the kubelet restarts it in place."""
    os.kill(process_of(pod), signal.SIGKILL)


def runtime_kill(node: RealNode, pod: dict) -> None:
    """As a node's runtime does it (`ctr task kill -s SIGKILL`): the containerd of the pod's node kills the container's task."""
    holder = node.named(pod["spec"]["nodeName"])
    result = subprocess.run(
        [str(nodebuild.ensure_binaries() / "ctr"), f"--address={config.containerd_socket(holder.workdir)}", "--namespace=k8s.io",
         "task", "kill", "--signal", "SIGKILL", container_id(pod)], capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if result.returncode != 0:
        raise RealNodeError(f"ctr task kill: {result.stderr.strip()}")


@dataclass
class Drain:
    node: str  # the drained node's name
    moved: set[str]  # the replicas it held
    calls: list[Call]  # the load's, from the drain's start until both replicas were ready elsewhere, and 3 s more
    service: dict  # the connect probe's counts for the Service
    seconds: float  # from the drain's start until both replicas were ready elsewhere
    held_by_budget: bool  # whether an eviction was answered that it would violate the PDB (kubectl then retries)


def drain_the_leaders_node(node: RealNode, load: Load, folder: Path) -> Drain:
    """`kubectl drain` of the leader's node as an admin runs it, under a connect probe to the
    Service: cordoned, each pod evicted through the Eviction API (the PDB answers 429 while an
    eviction would leave no replica; kubectl asks again every 5 s), DaemonSet pods left, until
    every evicted pod is gone and both replicas are ready on the other node; then uncordoned."""
    name = leader(node)["spec"]["nodeName"]
    moved = {p["metadata"]["name"] for p in operator_pods(node) if p["spec"]["nodeName"] == name}
    service = targets(node)[0]
    probe = Probe(node, [service], folder).start()
    try:
        time.sleep(2)
        begun = time.monotonic()
        result = node.kubectl("drain", name, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s", timeout=330)
        install.wait_for(lambda: drained(node, name, moved), 180, f"the operator moved off {name}")
        seconds = time.monotonic() - begun
        time.sleep(3)
        calls = load.outcomes.between(begun, time.monotonic())
    finally:
        counts = probe.stop()
        node.kubectl("uncordon", name)
    return Drain(name, moved, calls, counts[service], seconds, "disruption budget" in result.stdout + result.stderr)


def drained(node: RealNode, name: str, before: set[str]) -> bool:
    """Whether the drain has moved the operator: every replica of `before` gone (terminating ones
    too), two others ready elsewhere, both the Service's ready endpoints."""
    names = {p["metadata"]["name"] for p in install.pods(node)}
    running = operator_pods(node)
    return (not names & before and len(running) == 2 and all(p["spec"]["nodeName"] != name for p in running)
            and all(s["ready"] for p in running for s in p["status"]["containerStatuses"]) and ready_endpoints(node) == 2)  # fmt: skip


def renew_certificate(node: RealNode) -> str:
    """A renewal as an issuer makes it: a new CA and a serving certificate signed by it; the
    webhooks' caBundle first trusts both CAs, then the Secret the replicas mount holds the new
    pair (the kubelet swaps the files). The new certificate's fingerprint."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ns = install.NAMESPACE
    names = [WEBHOOK_SERVICE, f"{WEBHOOK_SERVICE}.{ns}", f"{WEBHOOK_SERVICE}.{ns}.svc", f"{WEBHOOK_SERVICE}.{ns}.svc.cluster.local"]

    def certificate(subject: str, key, issuer: str, signer, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=60))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("passthrough-webhook-ca-renewed", ca_key, "passthrough-webhook-ca-renewed", ca_key, True)
    cert = certificate(names[2], key, "passthrough-webhook-ca-renewed", ca_key, False)
    ca_pem, cert_pem = ca.public_bytes(serialization.Encoding.PEM), cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    configs = json.loads(node.kubectl("get", "validatingwebhookconfigurations,mutatingwebhookconfigurations", "-l",
                                      f"app.kubernetes.io/instance={install.RELEASE}", "-o", "json").stdout)["items"]  # fmt: skip
    for item in configs:
        for webhook in item["webhooks"]:
            old = base64.b64decode(webhook["clientConfig"]["caBundle"])
            webhook["clientConfig"]["caBundle"] = base64.b64encode(old.rstrip(b"\n") + b"\n" + ca_pem).decode()
        node.kubectl("replace", "-f", "-", input=json.dumps(item))
    secret = json.loads(node.kubectl("get", "secret", SECRET, "-n", ns, "-o", "json").stdout)
    secret["data"] = {"tls.crt": base64.b64encode(cert_pem).decode(), "tls.key": base64.b64encode(key_pem).decode(),
                      "ca.crt": base64.b64encode(ca_pem).decode()}  # fmt: skip
    node.kubectl("replace", "-f", "-", input=json.dumps(secret))
    return fingerprint(cert_pem)
