"""The real node's supervisor: runs inside the network, mount and PID namespaces `RealNode` makes.

Started as `unshare --net --mount --propagation private --pid --fork --mount-proc -- python -m
e2e.realnode.inside ...` (see `e2e/realnode/node.py`), it is PID 1 of the node: when it exits,
the kernel kills every process left in the namespace (containers included), the network
namespace goes with the last of them (the CNI bridge, the pods' veths, kube-proxy's rules),
and every mount made here with the mount namespace.

In here it gives the node what a host would, from nothing of the host's:
- mounts: a tmpfs `/run` and `/dev` (the few device nodes a node uses, made with mknod), the
  workdir's `var/` over `/var` (the kubelet's, containerd's and CNI's fixed paths), `/sys`
  read-only (a pod's writable hostPath under /sys is read-only here too), and the six
  `/proc/sys` files the kubelet's `protectKernelDefaults` reads covered by files holding the
  values it wants (it only reads them; no kernel setting is changed);
- network: loopback, and a bridge `node0` holding the node's address with the default route
  (nothing is connected to it: a packet for no pod or Service goes nowhere); `/etc/hosts` and
  `/etc/resolv.conf` of the node's own, so no name is ever asked of the host's nameserver;
- the cluster DNS pods are given (`e2e/realnode/dns.py`, Service names to ClusterIPs), on the
  node's address;
- the control plane on this namespace's loopback, a second controller-manager with the
  controllers a cluster of pods needs (Deployments, DaemonSets, EndpointSlices, disruption
  budgets, node lifecycle, the root CA ConfigMap), kube-scheduler, containerd with runc and the
  CNI bridge, the kubelet, kube-proxy (iptables);
- the API server, reached from pods through the `kubernetes` Service: its EndpointSlice names
  the node's address, where a forwarder passes connections to the API server's loopback port;
- from outside: the listening socket `RealNode` made in the caller's network namespace
  (inherited as a file descriptor) forwards to the API server too.

A second node (`--joins=<the first node's workdir>`) makes the same mounts and runs only
containerd, the kubelet and kube-proxy: its network is the veth end the caller moves in
(`join_network`), its kubelet and kube-proxy reach the API server through the first node's
forwarder, its pods use the first node's cluster DNS.

When all is ready it writes `ready.json` in the workdir; on failure `failed.txt` with the reason.
SIGTERM stops the node (kubelet, kube-proxy, containerd, control plane) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import yaml

from e2e import build as controlplane
from e2e import cluster as clusters
from e2e import kubevirt
from e2e.kubelet import KERNEL_DEFAULTS, Scheduler, _Child, _condition
from e2e.realnode import build as nodebuild
from e2e.realnode import config, dns

DEVICES = {  # name: (mode, major, minor): what runc, containerd and the kubelet open under /dev
    "null": (0o666, 1, 3),
    "zero": (0o666, 1, 5),
    "full": (0o666, 1, 7),
    "random": (0o666, 1, 8),
    "urandom": (0o666, 1, 9),
    "tty": (0o666, 5, 0),
    "kmsg": (0o644, 1, 11),  # the kubelet's OOM watcher reads it
}


class NodeError(RuntimeError):
    pass


def _sh(*args: str) -> None:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if result.returncode != 0:
        raise NodeError(f"{shlex.join(args)} failed ({result.returncode}): {result.stderr.strip()}")


# -- the namespace's mounts and network --------------------------------------------------------


def make_mounts(workdir: Path, node_name: str, node_ip: str = config.NODE_IP) -> None:
    var = workdir / "var"
    for sub in ("lib/kubelet/device-plugins", "lib/kubelet/pod-resources", "lib/containerd", "lib/cni", "log/pods", "log/containers", "tmp"):
        (var / sub).mkdir(parents=True, exist_ok=True)
    if not (var / "run").is_symlink():
        (var / "run").symlink_to("/run")
    _sh("mount", "--bind", str(var), "/var")
    _sh("mount", "-t", "tmpfs", "-o", "mode=755,nosuid", "tmpfs", "/run")
    _sh("mount", "-t", "tmpfs", "-o", "mode=755,nosuid", "tmpfs", "/dev")
    for name, (mode, major, minor) in DEVICES.items():
        os.mknod(f"/dev/{name}", mode | 0o020000, os.makedev(major, minor))
        os.chmod(f"/dev/{name}", mode)
    for directory in ("pts", "shm", "mqueue"):
        os.mkdir(f"/dev/{directory}")
    _sh("mount", "-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=620", "devpts", "/dev/pts")
    _sh("mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "shm", "/dev/shm")
    os.symlink("pts/ptmx", "/dev/ptmx")
    for index, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{index}", f"/dev/{name}")
    os.symlink("/proc/self/fd", "/dev/fd")
    _sh("mount", "-o", "remount,bind,ro", "/sys")
    # Names resolve here, never through the host's nameserver: the node's own name (the API
    # server dials the kubelet by it) in /etc/hosts, and the node's cluster DNS for the rest.
    etc = workdir / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "hosts").write_text(f"127.0.0.1 localhost\n{node_ip} {node_name}\n")
    (etc / "resolv.conf").write_text(f"nameserver {config.NODE_IP}\n")
    for name in ("hosts", "resolv.conf"):
        _sh("mount", "--bind", "-o", "ro", str(etc / name), f"/etc/{name}")
    sysctl = workdir / "sysctl"
    sysctl.mkdir(exist_ok=True)
    for key, value in KERNEL_DEFAULTS.items():
        source = sysctl / key.replace("/", ".")
        source.write_text(value + "\n")
        _sh("mount", "--bind", "-o", "ro", str(source), f"/proc/sys/{key}")


def make_network() -> None:
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", config.NODE_LINK, "type", "bridge")
    _sh("ip", "addr", "add", f"{config.NODE_IP}/24", "dev", config.NODE_LINK)
    _sh("ip", "link", "set", config.NODE_LINK, "up")
    _sh("ip", "route", "add", "default", "dev", config.NODE_LINK)
    _namespace_sysctls()


def _namespace_sysctls() -> None:
    """This network namespace's own settings (the host's are untouched): replies between two
    pods of the bridge pass iptables, so a Service's DNAT is undone; and it routes, for a joined
    node's pods as for its own (the CNI bridge sets it too, at the first pod)."""
    Path("/proc/sys/net/bridge/bridge-nf-call-iptables").write_text("1\n")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")


def join_network(node_ip: str, deadline: float) -> None:
    """A joined node's network: `NODE_LINK` is its end of the veth pair the caller makes into the
    first node's bridge; the first node's address is its gateway (the API server's forwarder, the
    cluster DNS, the first node's pods)."""
    _sh("ip", "link", "set", "lo", "up")
    while subprocess.run(["ip", "link", "show", config.NODE_LINK], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise NodeError(f"no link {config.NODE_LINK} to the first node was given in time")
        time.sleep(0.1)
    _sh("ip", "addr", "add", f"{node_ip}/24", "dev", config.NODE_LINK)
    _sh("ip", "link", "set", config.NODE_LINK, "up")
    _sh("ip", "route", "add", "default", "via", config.NODE_IP, "dev", config.NODE_LINK)
    _namespace_sysctls()


# -- forwarding to the API server ---------------------------------------------------------------


class Forwarder:
    """TCP forwarders to the API server's loopback port, on an event loop of their own."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="forwarder", daemon=True)
        self.thread.start()

    def serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        asyncio.run_coroutine_threadsafe(self._serve(sock), self.loop).result()

    async def _serve(self, sock: socket.socket) -> None:
        await asyncio.start_server(self._connection, sock=sock)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                if dst.can_write_eof():
                    dst.write_eof()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        for w in (writer, up_writer):
            w.close()


# -- the node ------------------------------------------------------------------------------------


class Node:
    def __init__(self, args: argparse.Namespace) -> None:
        self.workdir: Path = args.workdir
        self.name: str = args.node_name
        self.cgroup_root: str = args.cgroup_root
        self.runc: str = args.runc
        self.images: list[Path] = args.image
        self.listen_fd: int | None = args.listen_fd
        # A joined node: the first node's workdir (its ready.json and CA), this node's address and pods' range.
        self.joins: Path | None = args.joins
        self.node_ip: str = args.node_ip
        self.pod_cidr: str = args.pod_cidr
        self.logs = self.workdir / "logs"
        self.cluster: clusters.LocalCluster | None = None
        self.kubeconfig: Path = self.workdir / "node-kubeconfig"
        self.children: list[_Child] = []
        self.scheduler: Scheduler | None = None
        self.bin = nodebuild.ensure_binaries()

    # -- start -----------------------------------------------------------------------------

    def start(self) -> dict:
        if self.joins is not None:
            return self._join()
        started = time.monotonic()
        make_mounts(self.workdir, self.name)
        make_network()
        self.logs.mkdir(parents=True, exist_ok=True)
        cluster = self.cluster = clusters.LocalCluster(
            workdir=self.workdir / "cluster", bin_dir=controlplane.ensure_binaries()
        )
        cluster.workdir.mkdir(parents=True, exist_ok=True)
        # KubeVirt's CRDs, as on a cluster with KubeVirt; the chart brings its own.
        cluster.start(before_controllers=lambda c: clusters.install_crds(c, [kubevirt_crds(c)]))
        self.kubeconfig = cluster.kubeconfig
        apiserver_port = int(cluster.server.rsplit(":", 1)[1])
        forwarder = Forwarder(apiserver_port)
        assert self.listen_fd is not None
        forwarder.serve(socket.socket(fileno=self.listen_fd))
        inside = socket.create_server((config.NODE_IP, config.APISERVER_PORT))
        forwarder.serve(inside)
        asyncio.run_coroutine_threadsafe(
            forwarder.loop.create_datagram_endpoint(lambda: dns.Server(self._cluster_ip), local_addr=(config.NODE_IP, 53)),
            forwarder.loop,
        ).result()
        self._kubernetes_endpoints()
        self._controllers()
        self.scheduler = Scheduler(cluster, log_dir=self.logs).start()
        self._containerd()
        self._import_images()
        self._kubelet()
        self._kube_proxy()
        self._wait_node_ready(time.monotonic() + 120)
        return {
            "server_port": apiserver_port,
            "token": cluster.token,
            "node": self.name,
            "node_ip": config.NODE_IP,
            "seconds": round(time.monotonic() - started, 1),
            "pid": os.getpid(),
        }

    def _join(self) -> dict:
        """A second node: no control plane of its own; its kubelet and kube-proxy reach the first
        node's API server through the forwarder on the first node's address."""
        assert self.joins is not None
        started = time.monotonic()
        make_mounts(self.workdir, self.name, self.node_ip)
        join_network(self.node_ip, time.monotonic() + 60)
        self.logs.mkdir(parents=True, exist_ok=True)
        first = json.loads((self.joins / "ready.json").read_text())
        ca = (self.joins / "cluster" / "pki" / "ca.crt").read_bytes()
        self.kubeconfig.write_text(yaml.safe_dump(joined_kubeconfig(first["token"], ca), sort_keys=False))
        self.kubeconfig.chmod(0o600)
        self._containerd()
        self._import_images()
        self._kubelet()
        self._kube_proxy()
        self._wait_node_ready(time.monotonic() + 120)
        return {"node": self.name, "node_ip": self.node_ip, "seconds": round(time.monotonic() - started, 1), "pid": os.getpid()}

    def _kubectl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(controlplane.ensure_binaries() / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    def _cluster_ip(self, namespace: str, service: str) -> str | None:
        """A Service's ClusterIP (None for none, a headless one, or an unanswered API call)."""
        assert self.cluster is not None
        request = urllib.request.Request(
            f"{self.cluster.server}/api/v1/namespaces/{namespace}/services/{service}",
            headers={"Authorization": f"Bearer {self.cluster.token}"},
        )
        context = ssl.create_default_context(cafile=str(self.cluster.ca_file))
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as response:
                address = json.load(response)["spec"].get("clusterIP")
        except (OSError, ValueError, KeyError):
            return None
        return address if address and address != "None" else None

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> _Child:
        child = _Child(name, args, self.logs / f"{name}.log", env=env, cwd=self.workdir)
        self.children.append(child)
        return child

    def _kubernetes_endpoints(self) -> None:
        """Where pods reach the API server: the `kubernetes` Service's endpoints (the API server
        writes none itself here: `--endpoint-reconciler-type=none`)."""
        assert self.cluster is not None
        slice_ = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kubernetes",
                "namespace": "default",
                "labels": {
                    "kubernetes.io/service-name": "kubernetes",
                    "endpointslice.kubernetes.io/managed-by": "realnode.e2e.passthrough.io",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [config.NODE_IP], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": config.APISERVER_PORT, "protocol": "TCP"}],
        }
        self.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(slice_))

    def _controllers(self) -> None:
        assert self.cluster is not None
        kubeconfig = str(self.cluster.kubeconfig)
        port = clusters.free_ports(1)[0]
        pki = self.cluster.workdir / "pki"
        child = self._spawn(
            "kube-controller-manager-workloads",
            [
                self.cluster.binary("kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--controllers={','.join(config.WORKLOAD_CONTROLLERS)}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--leader-elect=false",
                "--profiling=false",
                "--v=1",
            ],
        )
        _wait_http(child, f"https://127.0.0.1:{port}/healthz", time.monotonic() + 60)

    def _containerd(self) -> None:
        conf = self.workdir / "containerd.toml"
        cni_dir = self.workdir / "cni"
        cni_dir.mkdir(exist_ok=True)
        (cni_dir / "10-node.conflist").write_text(json.dumps(config.cni_conflist(pod_cidr=self.pod_cidr), indent=2))
        conf.write_text(config.containerd_toml(self.workdir, self.bin, self.runc, cni_dir, not _may_lower_oom_score()))
        child = self._spawn(
            "containerd",
            [str(self.bin / "containerd"), f"--config={conf}", "--log-level=info"],
            env=self._env(),
        )
        socket_path = config.containerd_socket(self.workdir)
        deadline = time.monotonic() + 60
        while not socket_path.is_socket() or self._ctr("version").returncode != 0:
            if not child.alive():
                raise NodeError(f"containerd exited; log {child.log}:\n{child.tail()}")
            if time.monotonic() > deadline:
                raise NodeError(f"containerd did not serve {socket_path}; log {child.log}")
            time.sleep(0.1)

    def _env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.workdir),
            "TMPDIR": "/var/tmp",
            "LIBMOUNT_UTAB": str(self.workdir / "utab"),
        }

    def _ctr(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin / "ctr"), f"--address={config.containerd_socket(self.workdir)}", "--namespace=k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=600,
        )

    def _import_images(self) -> None:
        for archive in self.images:
            result = self._ctr("images", "import", "--local", str(archive))
            if result.returncode != 0:
                raise NodeError(f"ctr images import {archive}: {result.stderr.strip()}")

    def _kube_proxy(self) -> None:
        conf = self.workdir / "kube-proxy.yaml"
        proxy = config.kube_proxy_config(self.kubeconfig, self.name, node_ip=self.node_ip, cluster_cidr=self.pod_cidr)
        conf.write_text(yaml.safe_dump(proxy, sort_keys=False))
        child = self._spawn("kube-proxy", [str(self.bin / "kube-proxy"), f"--config={conf}", "--v=1"], env=self._env())
        _wait_http(child, f"http://127.0.0.1:{config.KUBE_PROXY_HEALTHZ_PORT}/healthz", time.monotonic() + 60, ok=None)

    def _kubelet(self) -> None:
        conf = self.workdir / "kubelet.yaml"
        conf.write_text(yaml.safe_dump(config.kubelet_config(self.workdir, self.cgroup_root, node_ip=self.node_ip), sort_keys=False))
        (self.workdir / "kubelet-pki").mkdir(exist_ok=True)
        (self.workdir / "kubelet-cwd").mkdir(exist_ok=True)
        self._spawn(
            "kubelet",
            [
                str(controlplane.ensure_binaries() / "kubelet"),
                f"--config={conf}",
                f"--kubeconfig={self.kubeconfig}",
                "--root-dir=/var/lib/kubelet",
                f"--cert-dir={self.workdir / 'kubelet-pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.node_ip}",
                "--v=2",
            ],
            env=self._env(),
        )

    def _wait_node_ready(self, deadline: float) -> None:
        while True:
            for child in self.children:
                if not child.alive():
                    raise NodeError(f"{child.name} exited; log {child.log}:\n{child.tail()}")
            found = self._kubectl("get", "node", self.name, "-o", "json")
            if found.returncode == 0:
                node = json.loads(found.stdout)
                ready = _condition(node, "Ready")
                taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") == "NoSchedule"]
                if ready and ready.get("status") == "True" and not taints:
                    return
            if time.monotonic() > deadline:
                kubelet = next(c for c in self.children if c.name == "kubelet")
                raise NodeError(f"node {self.name} not Ready and untainted in time; log {kubelet.log}:\n{kubelet.tail()}")
            time.sleep(0.5)

    # -- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        for child in reversed(self.children):
            with contextlib.suppress(Exception):
                child.stop(timeout=10)
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.cluster is not None:
            self.cluster.stop(timeout=5)


def joined_kubeconfig(token: str, ca: bytes) -> dict:
    """A joined node's kubeconfig: the API server through the first node's forwarder, its
    certificate checked for a name it holds (it names loopback, not the first node's address)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "realnode", "cluster": {
            "server": f"https://{config.NODE_IP}:{config.APISERVER_PORT}",
            "tls-server-name": "localhost",
            "certificate-authority-data": base64.b64encode(ca).decode(),
        }}],  # fmt: skip
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "realnode", "context": {"cluster": "realnode", "user": "admin"}}],
        "current-context": "realnode",
    }


def _may_lower_oom_score() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (bit 24 of its effective set), which lowering
    an oom_score_adj below the current one takes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 24))
    return False


def kubevirt_crds(cluster: clusters.LocalCluster) -> Path:
    directory = cluster.workdir / "kubevirt-crds"
    kubevirt.write_crds(directory)
    return directory


def _wait_http(child: _Child, url: str, deadline: float, ok: bytes | None = b"ok") -> None:
    context = ssl._create_unverified_context()  # its own self-signed certificate, on loopback
    while True:
        if not child.alive():
            raise NodeError(f"{child.name} exited; log {child.log}:\n{child.tail()}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2, context=context if url.startswith("https") else None) as r:
                body = r.read()
                if ok is None or body.strip() == ok:
                    return
        if time.monotonic() > deadline:
            raise NodeError(f"{child.name} not healthy at {url} in time; log {child.log}:\n{child.tail()}")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.realnode.inside")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--node-name", required=True)
    parser.add_argument("--cgroup-root", required=True)
    parser.add_argument("--runc", required=True)
    parser.add_argument("--listen-fd", type=int, help="the first node's: the socket forwarded to the API server")
    parser.add_argument("--joins", type=Path, help="a second node's: the first node's workdir")
    parser.add_argument("--node-ip", default=config.NODE_IP)
    parser.add_argument("--pod-cidr", default=config.POD_CIDR)
    parser.add_argument("--image", type=Path, action="append", default=[])
    args = parser.parse_args(argv)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    node = Node(args)
    try:
        info = node.start()
    except BaseException as exc:  # noqa: BLE001 - any failure is reported to the caller whole
        (args.workdir / "failed.txt").write_text(f"{exc}\n\n{traceback.format_exc()}")
        node.stop()
        return 1
    (args.workdir / "ready.json.partial").write_text(json.dumps(info))
    (args.workdir / "ready.json.partial").rename(args.workdir / "ready.json")
    while not stopping.wait(1):
        for child in node.children:
            if not child.alive():
                (args.workdir / "failed.txt").write_text(f"{child.name} exited; log {child.log}:\n{child.tail()}")
                stopping.set()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
