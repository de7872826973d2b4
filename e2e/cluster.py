"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager.

Free ports, a fresh CA and serving certificate, a service-account key and an admin token
are generated per cluster; a kubeconfig is written beside them. The controller-manager runs
the namespace, garbage-collector, service-account, cluster-role aggregation and admission-policy
status controllers, so namespace deletion, ownerReference garbage collection and the namespace
roles behave as in a real cluster.

    python -m e2e.cluster up      # start in the background, state in .cluster/
    python -m e2e.cluster down    # stop it, leaving no process behind
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from e2e import build

REPO = Path(__file__).resolve().parent.parent
STATE_DIR = REPO / ".cluster"

_PR_SET_PDEATHSIG = 1


class ClusterError(RuntimeError):
    pass


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out as free right now (held open together, so all distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _die_with_parent() -> None:
    # The control plane must not outlive the test session or `make run`, even when that
    # process is killed outright: the kernel sends SIGKILL to the child when we die.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _write_pki(directory: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1 signed by it, and a service-account key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "passthrough-e2e-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    serving_key = ec.generate_private_key(ec.SECP256R1())
    serving = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(serving_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName("kubernetes.default.svc"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "apiserver.crt").write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    (directory / "apiserver.key").write_bytes(pem_key(serving_key))
    (directory / "sa.key").write_bytes(pem_key(sa_key))
    (directory / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


@dataclass
class Process:
    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    pid: int = 0


@dataclass
class LocalCluster:
    """One control plane in `workdir`. `start()` returns when all three components are ready."""

    workdir: Path
    bin_dir: Path
    detach: bool = False  # True: survive this process (for `make cluster-up`)
    processes: list[Process] = field(default_factory=list)
    server: str = ""
    token: str = ""
    # How each component started is ready (url, check, tls), for `start_component`.
    readiness: dict[str, tuple[str, Callable[[bytes], bool], bool]] = field(default_factory=dict, repr=False)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    def binary(self, name: str) -> str:
        return str(self.bin_dir / name)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, before_controllers: Callable[[LocalCluster], None] | None = None, timeout: float = 90) -> None:
        """Start etcd and the API server, run `before_controllers`, then the controller-manager.

        Installing CRDs in `before_controllers` lets the garbage collector watch them from its
        first sync instead of after its 30-second rediscovery.
        """
        for attempt in range(3):
            try:
                self._start_once(before_controllers, timeout)
                return
            except _PortTaken:
                self.stop()
                if attempt == 2:
                    raise ClusterError("could not find free loopback ports after 3 attempts") from None
            except BaseException:
                self.stop()
                raise

    def _start_once(self, before_controllers, timeout: float) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        if not (pki / "ca.crt").exists():
            _write_pki(pki)
        self.token = self.token or secrets.token_hex(16)
        (pki / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        etcd_client, etcd_peer, apiserver_port, kcm_port = free_ports(4)
        self.server = f"https://127.0.0.1:{apiserver_port}"
        self._write_kubeconfig()
        deadline = time.monotonic() + timeout

        data = self.workdir / "etcd"
        shutil.rmtree(data, ignore_errors=True)
        etcd = self._spawn(
            "etcd",
            [
                self.binary("etcd"),
                "--name=default",
                f"--data-dir={data}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                # A throwaway database: durability buys nothing and fsync costs seconds.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait_ready(etcd, f"http://127.0.0.1:{etcd_client}/health", deadline, _etcd_healthy)

        apiserver = self._spawn(
            "kube-apiserver",
            [
                self.binary("kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={apiserver_port}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                # The default reconciler refuses a loopback advertise address; there are no pods anyway.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._wait_ready(apiserver, f"{self.server}/readyz", deadline, _says_ok)

        if before_controllers is not None:
            before_controllers(self)

        kcm = self._spawn(
            "kube-controller-manager",
            [
                self.binary("kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                # clusterrole-aggregation fills view/edit/admin from aggregated roles (the chart's
                # PCIDevice read); validatingadmissionpolicy-status type-checks policies;
                # resourceclaim-controller takes a ResourceClaim's reservation and allocation back
                # once its pods are gone (DRA: without it a deleted claim keeps its device);
                # device-taint-eviction-controller deletes the pods of claims whose device is
                # tainted NoExecute (the DRA driver's device that fell off the bus);
                # resourcequota counts a ResourceQuota's use, without which the API server's quota
                # admission refuses everything a quota covers (quota on claims and GPUs).
                "--controllers=namespace,garbagecollector,serviceaccount,serviceaccount-token,"
                "clusterrole-aggregation-controller,validatingadmissionpolicy-status-controller,"
                "resourceclaim-controller,device-taint-eviction-controller,resourcequota",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--leader-elect=false",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._wait_ready(kcm, f"https://127.0.0.1:{kcm_port}/healthz", deadline, _says_ok, tls=False)
        self._write_state()

    # -- faults: one component at a time ---------------------------------------------------

    def component(self, name: str) -> Process:
        """The running (or stopped) process of `name`: etcd, kube-apiserver, kube-controller-manager."""
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise ClusterError(f"no component {name!r} in this cluster; it has {', '.join(p.name for p in self.processes)}")

    def stop_component(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15) -> bool:
        """Stop one component and wait for it to exit (SIGKILL after `timeout`); the others keep running.
        Whether it exited on `sig` alone.

        Its data stays (etcd's database included), so `start_component` brings it back as it was.
        Both servers stop listening at once on SIGTERM but take their time to exit (kube-apiserver
        v1.37 about 15 s, etcd about 7 s, here): a short `timeout` makes it a quick stop.
        """
        proc = self.component(name)
        _signal(proc, sig)
        deadline = time.monotonic() + timeout
        while _alive(proc) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _alive(proc):
            return True
        _signal(proc, signal.SIGKILL)
        while _alive(proc):
            time.sleep(0.05)
        return False

    def start_component(self, name: str, wait: bool = True, timeout: float = 60) -> None:
        """Start a stopped component again with the arguments, ports and data it had.

        With `wait=False` it returns once the process is spawned; `wait_component` waits for it
        to be ready. Spawn from the thread that lives as long as the cluster (the main one):
        the component is killed when the thread that spawned it ends.
        """
        proc = self.component(name)
        if _alive(proc):
            raise ClusterError(f"{name} is running; stop_component it first")
        index = self.processes.index(proc)
        self.processes.remove(proc)
        self._spawn(name, proc.args)
        self.processes.insert(index, self.processes.pop())  # its old place: `stop` stops newest first
        if wait:
            self.wait_component(name, timeout)
        self._write_state()

    def wait_component(self, name: str, timeout: float = 60) -> None:
        """Return once `name` answers its readiness check as at start-up; ClusterError if not in `timeout`."""
        url, ok, tls = self.readiness[name]
        self._wait_http(self.component(name), url, time.monotonic() + timeout, ok, tls=tls)

    def stop(self, timeout: float = 15) -> None:
        """Stop every component, newest first; SIGKILL what has not exited in `timeout`.

        One at a time: an API server whose etcd is already gone hangs in its shutdown.
        """
        for proc in reversed(self.processes):
            _signal(proc, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _alive(proc) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(proc):
                _signal(proc, signal.SIGKILL)
                while _alive(proc):
                    time.sleep(0.05)
        self.processes.clear()
        (self.workdir / "state.json").unlink(missing_ok=True)

    # -- helpers ---------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> Process:
        log = self.workdir / "logs" / f"{name}.log"
        proc = Process(name=name, args=args, log=log)
        with log.open("ab") as out:
            proc.popen = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=self.detach,
                preexec_fn=None if self.detach else _die_with_parent,
            )
        proc.pid = proc.popen.pid
        self.processes.append(proc)
        return proc

    def _wait_ready(self, proc: Process, url: str, deadline: float, ok: Callable[[bytes], bool], tls: bool = True) -> None:
        self.readiness[proc.name] = (url, ok, tls)
        self._wait_http(proc, url, deadline, ok, tls)

    def _wait_http(self, proc: Process, url: str, deadline: float, ok: Callable[[bytes], bool], tls: bool = True) -> None:
        context = None
        if url.startswith("https"):
            context = ssl.create_default_context(cafile=str(self.ca_file)) if tls else ssl._create_unverified_context()
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        while True:
            if not _alive(proc):
                tail = proc.log.read_text(errors="replace")[-3000:]
                if "address already in use" in tail:
                    raise _PortTaken()
                raise ClusterError(f"{proc.name} exited during start-up; log {proc.log}:\n{tail}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(request, timeout=2, context=context) as response:
                    if ok(response.read()):
                        return
            if time.monotonic() > deadline:
                raise ClusterError(f"{proc.name} was not ready at {url} in time; log {proc.log}")
            time.sleep(0.1)

    def _write_kubeconfig(self) -> None:
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": {"server": self.server, "certificate-authority-data": ca}}],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
            "current-context": "local",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def _write_state(self) -> None:
        state = {
            "bin_dir": str(self.bin_dir),
            "server": self.server,
            "token": self.token,
            "processes": [{"name": p.name, "pid": p.pid, "exe": p.args[0]} for p in self.processes],
        }
        (self.workdir / "state.json").write_text(json.dumps(state, indent=2))

    @classmethod
    def from_state(cls, workdir: Path) -> LocalCluster:
        state = json.loads((workdir / "state.json").read_text())
        cluster = cls(workdir=workdir, bin_dir=Path(state["bin_dir"]), server=state["server"], token=state["token"])
        for p in state["processes"]:
            cluster.processes.append(Process(name=p["name"], args=[p["exe"]], log=workdir / "logs" / f"{p['name']}.log", pid=p["pid"]))
        return cluster

    # -- use -------------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the real kubectl against this cluster."""
        result = subprocess.run(
            [self.binary("kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}:{os.environ['PATH']}"}


class _PortTaken(Exception):
    pass


def _etcd_healthy(body: bytes) -> bool:
    return b'"true"' in body


def _says_ok(body: bytes) -> bool:
    return body.strip() == b"ok"


def _alive(proc: Process) -> bool:
    if proc.popen is not None:
        return proc.popen.poll() is None
    try:
        # A detached process of an earlier `up`: alive while its pid runs our binary.
        return Path(f"/proc/{proc.pid}/exe").resolve() == Path(proc.args[0]).resolve()
    except OSError:
        return False


def _signal(proc: Process, sig: int) -> None:
    if _alive(proc):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def install_crds(cluster: LocalCluster, paths: Sequence[Path]) -> None:
    """kubectl apply the CRD manifests and wait until the API server serves them."""
    args = ["apply", "--server-side", "--force-conflicts"]
    for path in paths:
        args += ["-f", str(path)]
    cluster.kubectl(*args)
    names = cluster.kubectl("get", "crd", "-o", "name").stdout.split()
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)


def prepare(cluster: LocalCluster) -> None:
    """What every use of the local cluster needs before controllers run: KubeVirt's and our CRDs."""
    from e2e import kubevirt

    crd_dir = cluster.workdir / "kubevirt-crds"
    kubevirt.write_crds(crd_dir)
    install_crds(cluster, [crd_dir, REPO / "crds"])


def start(workdir: Path, detach: bool = False) -> LocalCluster:
    cluster = LocalCluster(workdir=workdir, bin_dir=build.ensure_binaries(), detach=detach)
    cluster.start(before_controllers=prepare)
    return cluster


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["build", "up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=STATE_DIR, help="where the cluster keeps its files")
    args = parser.parse_args(argv)
    try:
        if args.action == "build":
            print(build.ensure_binaries())
        elif args.action == "up":
            if (args.dir / "state.json").exists():
                existing = LocalCluster.from_state(args.dir)
                if all(_alive(p) for p in existing.processes):
                    print(f"already up; KUBECONFIG={existing.kubeconfig}")
                    return 0
                existing.stop()
            started = time.monotonic()
            cluster = start(args.dir, detach=True)
            print(f"control plane ready in {time.monotonic() - started:.1f}s at {cluster.server}")
            print(f"export KUBECONFIG={cluster.kubeconfig}")
            print(f"export PATH={cluster.bin_dir}:$PATH   # kubectl {build.kubernetes_version()}")
        elif args.action == "down":
            if not (args.dir / "state.json").exists():
                print("no cluster is up")
                return 0
            LocalCluster.from_state(args.dir).stop()
            print("control plane stopped")
        elif args.action == "status":
            if not (args.dir / "state.json").exists():
                print("down")
                return 1
            cluster = LocalCluster.from_state(args.dir)
            for p in cluster.processes:
                print(f"{p.name:26} pid {p.pid:7} {'running' if _alive(p) else 'gone'}")
    except (build.BuildError, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
