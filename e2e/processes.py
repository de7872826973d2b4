"""The operator and the node agent as their own processes, started and stopped the way a cluster would."""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from e2e.cluster import _die_with_parent, free_ports


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    """Signal a child and wait for it; SIGKILL what has not exited in `timeout`. Its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def children(pid: int) -> list[int]:
    """The processes `pid` forked that still run (a binder's child per connection)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def start_binder(socket: Path, host, **popen) -> subprocess.Popen:
    """`passthrough binder --listen=socket` over the fixture `host` (its own roots), as the chart's
    binder containers run beside the agent; returns once it listens. A socket file left by an
    earlier one is removed first, as a restarted container's is its own, made anew."""
    socket.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "passthrough", "binder", f"--listen={socket}", f"--sysfs-root={host.sysfs}",
                             f"--dev-root={host.dev}", f"--proc-root={host.proc}"],
                            **{"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, **popen})  # fmt: skip
    deadline = time.monotonic() + 60
    while not socket.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            output = proc.communicate()[0] if proc.stdout else b""
            raise RuntimeError(f"the binder did not listen on {socket}: {(output or b'').decode()[-3000:]}")
        time.sleep(0.05)
    return proc


class WebhookServing:
    """What the chart's webhook Secret holds, for a webhook on 127.0.0.1: a CA and a serving
    certificate it signed (tls.crt, tls.key, ca.crt in `directory`), and a free port.

    The files are laid out as the kubelet writes a Secret volume (each name a link into `..data`,
    itself a link to the current version's folder), so `renew` replaces the pair at once as a
    Secret update does; `renew(atomic=False)` writes the certificate and the key one after the
    other instead, as a hand-made copy would."""

    def __init__(self, directory: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = self._certificate("webhook-ca", self._ca_key, (x509.BasicConstraints(ca=True, path_length=None), True))
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.port, self.versions = directory, free_ports(1)[0], 0
        self.ca = self._pem(ca)
        self.serving = b""  # the serving certificate last written (PEM)
        self._write({"ca.crt": self.ca, **self._serving_pair()})

    def renew(self, atomic: bool = True) -> None:
        """A new key and serving certificate from the same CA, as cert-manager's renewal makes."""
        files = {"ca.crt": self.ca, **self._serving_pair()}
        if atomic:
            self._write(files)
        else:
            for name in ("tls.crt", "tls.key"):
                current = self.directory / "..data"
                (current / name).write_bytes(files[name])

    @staticmethod
    def _pem(certificate) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return certificate.public_bytes(serialization.Encoding.PEM)

    def _certificate(self, subject: str, key, *extensions):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "webhook-ca")]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(self._ca_key, hashes.SHA256())

    def _serving_pair(self) -> dict[str, bytes]:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        key = ec.generate_private_key(ec.SECP256R1())
        serving = self._certificate(
            "127.0.0.1", key,
            (x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        )  # fmt: skip
        self.serving = self._pem(serving)
        pkcs8 = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        return {"tls.crt": self.serving, "tls.key": pkcs8}

    def _write(self, files: dict[str, bytes]) -> None:
        """The kubelet's atomic writer: a new version's folder, `..data` swapped to it by a rename."""
        self.versions += 1
        version = self.directory / f"..version-{self.versions}"
        version.mkdir()
        for name, content in files.items():
            (version / name).write_bytes(content)
        (self.directory / "..data-next").symlink_to(version.name)
        os.replace(self.directory / "..data-next", self.directory / "..data")
        for name in files:
            if not (self.directory / name).is_symlink():
                (self.directory / name).symlink_to(Path("..data") / name)

    def args(self) -> list[str]:
        return [f"--webhook-port={self.port}", "--webhook-addr=127.0.0.1", f"--webhook-cert-dir={self.directory}"]

    def point(self, configuration: dict) -> dict:
        """A webhook configuration rendered by the chart, calling this server instead of the Service."""
        configuration = copy.deepcopy(configuration)
        for webhook in configuration["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"https://127.0.0.1:{self.port}{path}", "caBundle": base64.b64encode(self.ca).decode()}
        return configuration


class OperatorProcess:
    """`passthrough operator` as its own process, the way it runs in a cluster.

    With `webhook`, it also serves the admission webhooks there, and `start` returns once
    they listen.
    """

    def __init__(self, cluster, log: Path, *args: str, webhook: WebhookServing | None = None) -> None:
        self.cluster, self.log_path, self.webhook = cluster, log, webhook
        self.args = (*args, *(webhook.args() if webhook else ()))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> None:
        port = free_ports(1)[0]
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "passthrough", "operator", f"--kubeconfig={self.cluster.kubeconfig}",
             f"--liveness=http://127.0.0.1:{port}/healthz", *self.args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_die_with_parent,  # a benchmark or test killed outright takes its operator with it
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    if self.webhook is None:
                        return
                    with socket.create_connection(("127.0.0.1", self.webhook.port), timeout=1):
                        return
            if time.monotonic() > deadline:
                raise AssertionError(f"operator not live after {timeout}s:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc:
            stop(self.proc, sig)
            self.log.close()

    def output(self) -> str:
        return self.log_path.read_text()


@contextlib.contextmanager
def running(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    """`operator` started, then stopped; what it logged must hold no Traceback."""
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()
    assert "Traceback" not in operator.output(), operator.output()[-5000:]


class AgentProcess:
    """`passthrough agent` as its own process over a fixture host, the way a DaemonSet pod runs it.

    With `kubelet` (an `e2e.kubelet.KubeletNode`), its device plugins register with that
    kubelet and it asks that kubelet's PodResources API; without, both point into the
    fixture tree, where no kubelet ever answers. `args` come last and later flags win, so
    `--kubeconfig=...` among them runs the agent as another user (the admin's by default).
    """

    def __init__(self, cluster, log: Path, node_name: str, host, pci_ids: Path, *args: str, kubelet=None) -> None:
        plugin_dir = kubelet.device_plugin_dir if kubelet else host.root / "device-plugins"
        pod_resources = kubelet.pod_resources_socket if kubelet else host.root / "pod-resources.sock"
        self.log_path = log
        self.args = [
            sys.executable, "-m", "passthrough", "agent", f"--node-name={node_name}",
            f"--kubeconfig={cluster.kubeconfig}", f"--sysfs-root={host.sysfs}", f"--proc-root={host.proc}",
            f"--dev-root={host.root / 'dev'}", f"--pci-ids={pci_ids}", f"--device-plugin-dir={plugin_dir}",
            f"--pod-resources-socket={pod_resources}", f"--state-dir={host.root / 'state'}", "--no-hotplug", *args,
        ]  # fmt: skip
        # As the chart's DaemonSet sets it: the service account's CA, here the cluster's.
        self.env = {"SSL_CERT_FILE": str(cluster.ca_file)}
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return stop(self.proc, sig) if self.proc else None

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""
