"""`RealNode`: a control plane and one node that runs containers for real, in namespaces of its own.

The caller's side of `e2e/realnode/inside.py`: builds what is missing (the node's programs,
runc, the pause image), makes the node's cgroup parent in every hierarchy of this machine, and
starts the supervisor in new network, mount and PID namespaces; the API server is reached from
here through a loopback port of the caller's network namespace (a kubeconfig is written for
it), and from nowhere else. `stop()` ends the node and removes the cgroup parent and the
workdir; `leftovers()` says what of the node the host still has (a test asserts it is nothing).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from e2e import build as controlplane
from e2e.realnode import build as nodebuild
from e2e.realnode import config, images

REPO = Path(__file__).resolve().parents[2]
CGROUP_FS = Path("/sys/fs/cgroup")
CGROUP_PREFIX = "passthrough-realnode-"
# Debian packages the node's programs run: kube-proxy and the CNI portmap plugin call iptables.
TOOLS = {"iptables": "iptables", "iptables-save": "iptables"}


class RealNodeError(RuntimeError):
    """The node could not be started here, or stopped; the message says why and where to look."""


def _log(message: str) -> None:
    print(f"[realnode] {message}", file=sys.stderr, flush=True)


def ensure_tools() -> None:
    """iptables from Debian's packages when it is missing (apt-get, as `e2e/image.py` does)."""
    missing = sorted({package for command, package in TOOLS.items() if shutil.which(command) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RealNodeError(f"{', '.join(missing)} not on PATH; install it (Debian: apt-get install {' '.join(missing)})")
    _log(f"installing {' '.join(missing)} (apt-get)")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600", *missing]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=600"], env=env, capture_output=True)
        result = subprocess.run(install, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RealNodeError(f"apt-get install {' '.join(missing)} failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")


def why_unavailable() -> str | None:
    """Why a real node cannot run here (one line), or None."""
    if not sys.platform.startswith("linux"):
        return "a real node needs Linux (namespaces, cgroups, iptables)"
    if os.geteuid() != 0:
        return "a real node needs root (network, mount and PID namespaces, cgroups, mknod)"
    for tool in ("unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"a real node needs `{tool}` on PATH (util-linux, iproute2)"
    if not CGROUP_FS.is_dir():
        return f"no cgroup filesystem at {CGROUP_FS}"
    return None


def _cgroup_hierarchies() -> list[Path]:
    """The mount points of every cgroup hierarchy (v1 controllers, named ones and the v2 one)."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] in ("cgroup", "cgroup2") and fields[1].startswith(str(CGROUP_FS)):
            found.append(Path(fields[1]))
    return found


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RealNode:
    """Start with `start()` (or `with RealNode() as node:`); `kubectl`, `helm`, `kubeconfig` from outside.

    `RealNode(joins=first)` is a second node of the first one's cluster (one at most): network,
    mount and PID namespaces of its own, its containerd, kubelet and kube-proxy, the first node's
    images; a veth pair joins its network to the first node's bridge, each node routing the
    other's pods. Stop it before the first.
    """

    def __init__(self, name: str | None = None, project_image: bool = False, timeout: float = 300,
                 joins: RealNode | None = None) -> None:  # fmt: skip
        self.name = name or f"node-{uuid.uuid4().hex[:6]}"
        self.project_image = project_image
        self.joins = joins
        self.joined: RealNode | None = None  # the second node, once it has joined this one
        self.timeout = timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp")).resolve()
        self.cgroup_root = f"/{CGROUP_PREFIX}{uuid.uuid4().hex[:8]}"
        self.info: dict = {}
        self.netns: tuple[int, int] | None = None  # (st_dev, st_ino) of the node's network namespace
        self._proc: subprocess.Popen | None = None
        self._listener: socket.socket | None = None
        self.server = ""

    # -- paths ---------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    @property
    def bin_dir(self) -> Path:
        return controlplane.ensure_binaries()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> RealNode:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if reason := why_unavailable():
            raise RealNodeError(reason)
        if self.joins is not None and self.joins.joined is not None:
            raise RealNodeError(f"node {self.joins.name} has a second node already ({self.joins.joined.name}); stop it first")
        started = time.monotonic()
        ensure_tools()
        controlplane.ensure_binaries()
        node_bin = nodebuild.ensure_binaries()
        from e2e import oci

        runc = oci.ensure_runc()
        if self.joins is not None:
            # The first node's archives, as a cluster's nodes pull the same images.
            archives = sorted((self.joins.workdir / "images").glob("*.tar"))
            role = [f"--joins={self.joins.workdir}", f"--node-ip={config.WORKER_IP}", f"--pod-cidr={config.WORKER_POD_CIDR}"]
        else:
            archives = [images.pause_archive(node_bin / "pause", self.workdir / "images" / "pause.tar")]
            if self.project_image:
                archives.append(images.project_archive(self.workdir / "images" / "project.tar"))
            self._listener = socket.create_server(("127.0.0.1", 0))
            role = [f"--listen-fd={self._listener.fileno()}"]
        self._make_cgroups()
        args = [
            "unshare", "--net", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
            "--kill-child=SIGKILL", "--",
            sys.executable, "-m", "e2e.realnode.inside",
            f"--workdir={self.workdir}", f"--node-name={self.name}", f"--cgroup-root={self.cgroup_root}",
            f"--runc={runc}", *role,
            *[f"--image={archive}" for archive in archives],
        ]  # fmt: skip
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / "supervisor.log").open("ab") as out:
            self._proc = subprocess.Popen(
                args,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=[self._listener.fileno()] if self._listener is not None else [],
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        deadline = time.monotonic() + self.timeout
        ready = self.workdir / "ready.json"
        while not ready.exists():
            failed = self.workdir / "failed.txt"
            if failed.exists() or self._proc.poll() is not None:
                time.sleep(0.2)
                reason = failed.read_text() if failed.exists() else self._supervisor_tail()
                raise RealNodeError(f"the real node did not start: {reason[-6000:]}")
            if time.monotonic() > deadline:
                raise RealNodeError(f"the real node was not ready in {self.timeout:.0f}s; logs in {self.logs}")
            if self.netns is None:
                self.netns = self._supervisor_netns()
                if self.netns is not None and self.joins is not None:
                    self._link_to(self.joins)
            time.sleep(0.2)
        self.netns = self.netns or self._supervisor_netns()
        self.info = json.loads(ready.read_text())
        if self.joins is not None:
            self.server, self.info["token"] = self.joins.server, self.joins.info["token"]
            shutil.copyfile(self.joins.kubeconfig, self.kubeconfig)
            self.kubeconfig.chmod(0o600)
            self.info["start_seconds"] = round(time.monotonic() - started, 1)
            self.joins.joined = self
            _log(f"node {self.name} joined and Ready in {self.info['start_seconds']}s (inside {self.info['seconds']}s)")
            return
        assert self._listener is not None
        self.server = f"https://127.0.0.1:{self._listener.getsockname()[1]}"
        ca = base64.b64encode((self.workdir / "cluster" / "pki" / "ca.crt").read_bytes()).decode()
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "realnode", "cluster": {"server": self.server, "certificate-authority-data": ca}}],
            "users": [{"name": "admin", "user": {"token": self.info["token"]}}],
            "contexts": [{"name": "realnode", "context": {"cluster": "realnode", "user": "admin"}}],
            "current-context": "realnode",
        }
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig, sort_keys=False))
        self.kubeconfig.chmod(0o600)
        self.info["start_seconds"] = round(time.monotonic() - started, 1)
        _log(f"node {self.name} Ready in {self.info['start_seconds']}s (inside {self.info['seconds']}s); KUBECONFIG={self.kubeconfig}")

    def _link_to(self, first: RealNode) -> None:
        """The veth pair between the first node's bridge and this node's network (made in the
        first node's namespace, its peer moved straight into this one: never on the host), each
        node's route to the other's pods, and this node's name in the first node's /etc/hosts
        (where the API server, dialing a kubelet by its node's name, looks it up)."""
        pid = self._supervisor_pid()
        for command in (
            ["ip", "link", "add", config.WORKER_LINK, "type", "veth", "peer", "name", config.NODE_LINK, "netns", str(pid)],
            ["ip", "link", "set", config.WORKER_LINK, "master", config.NODE_LINK, "up"],
            ["ip", "route", "add", config.WORKER_POD_CIDR, "via", config.WORKER_IP, "dev", config.NODE_LINK],
        ):
            result = first.in_node(*command)
            if result.returncode != 0:
                raise RealNodeError(f"{' '.join(command)} in node {first.name}'s network: {result.stderr.strip()}")
        with (first.workdir / "etc" / "hosts").open("a") as hosts:  # the file itself: it is bind-mounted
            hosts.write(f"{config.WORKER_IP} {self.name}\n")

    def _supervisor_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / "supervisor.log").read_text(errors="replace")[-4000:]
        return ""

    def _supervisor_pid(self) -> int | None:
        """The host's pid of the supervisor (PID 1 of the node), the one child of `unshare --fork`."""
        if self._proc is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            children = Path(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children").read_text().split()
            return int(children[0]) if children else None
        return None

    def _supervisor_netns(self) -> tuple[int, int] | None:
        pid = self._supervisor_pid()
        if pid is None:
            return None
        with contextlib.suppress(OSError):
            info = os.stat(f"/proc/{pid}/ns/net")
            if (info.st_dev, info.st_ino) != _own_netns():
                return (info.st_dev, info.st_ino)
        return None

    def stop(self, timeout: float = 60) -> None:
        """Stop the node (SIGTERM to its supervisor; everything left is killed with its PID
        namespace), then remove its cgroups and its workdir (the logs are kept on failure)."""
        if self.joins is not None and self.joins.joined is self:
            self.joins.joined = None
        if self._proc is not None:
            if (pid := self._supervisor_pid()) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()  # unshare --kill-child: the supervisor, then its namespace
                self._proc.wait()
            self._proc = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        deadline = time.monotonic() + 30
        while self.netns is not None and _processes_in(self.netns) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._remove_cgroups(deadline)
        if not any(mount.startswith(str(self.workdir)) for mount in _mount_points()):
            keep = os.environ.get("REALNODE_KEEP_LOGS")
            if keep and self.logs.is_dir():  # the node's processes' logs and its pods' (for CI's artifacts)
                shutil.copytree(self.logs, Path(keep) / self.name, dirs_exist_ok=True)
                with contextlib.suppress(OSError):
                    shutil.copytree(self.workdir / "var" / "log" / "pods", Path(keep) / self.name / "pods", dirs_exist_ok=True)
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- cgroups ---------------------------------------------------------------------------------

    def _make_cgroups(self) -> None:
        for hierarchy in _cgroup_hierarchies():
            parent = hierarchy / self.cgroup_root.lstrip("/")
            parent.mkdir(exist_ok=True)
            # cpuset v1: a new cgroup has no CPUs and memory nodes until given its parent's.
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (hierarchy / name).exists() and (parent / name).exists():
                    (parent / name).write_text((hierarchy / name).read_text())

    def _remove_cgroups(self, deadline: float) -> None:
        for hierarchy in _cgroup_hierarchies():
            parent = hierarchy / self.cgroup_root.lstrip("/")
            if not parent.exists():
                continue
            directories = sorted((p for p in parent.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
            for directory in [*directories, parent]:
                while True:
                    try:
                        directory.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:  # EBUSY: a task still leaving it
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.1)

    # -- what the host still has of it -----------------------------------------------------------

    def leftovers(self) -> list[str]:
        """Everything of this node the host still has: processes in its network namespace,
        cgroups below its parent, and what `host_leftovers` finds."""
        found = []
        if self.netns is not None and (pids := _processes_in(self.netns)):
            found.append(f"processes in the node's network namespace: {pids}")
        for hierarchy in _cgroup_hierarchies():
            parent = hierarchy / self.cgroup_root.lstrip("/")
            if parent.exists():
                found.append(f"cgroup {parent}")
        return found + self.host_leftovers()

    def host_leftovers(self) -> list[str]:
        """What a node must never make on the host, even while it runs: kubepods cgroups at a
        hierarchy's top, mounts under its workdir in the caller's mount namespace, links a
        node makes (cni0, node0, veths) or KUBE-/CNI- iptables rules in the caller's network
        namespace, files a hostPath volume would have made on the host."""
        found = []
        for hierarchy in _cgroup_hierarchies():
            found += [f"cgroup {p}" for p in hierarchy.glob("kubepods*")]
        found += [f"mount {m}" for m in _mount_points() if m.startswith(str(self.workdir))]
        links = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True).stdout or "[]")
        found += [
            f"link {link['ifname']}"
            for link in links
            if link["ifname"] in ("cni0", config.NODE_LINK) or link["ifname"].startswith("veth")
        ]
        if shutil.which("iptables-save"):
            rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
            found += [f"iptables {line}" for line in rules.splitlines() if re.search(r"\b(KUBE|CNI)-", line)]
        found += [f"host path {p}" for p in _HOST_PATHS if Path(p).exists() and p not in _EXISTED]
        return found

    # -- use ---------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}:{os.environ['PATH']}"}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return self._tool("kubectl", args, input=input, check=check, timeout=timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        home = self.workdir / "helm"
        env = {**self.env(), **{f"HELM_{kind}_HOME": str(home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}}
        return self._tool("helm", args, check=check, timeout=timeout, env=env)

    def _tool(self, name: str, args: tuple[str, ...], check: bool, timeout: float, input: str | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        """The control plane's kubectl or helm against this node's cluster; RealNodeError when `check` and it fails."""
        result = subprocess.run(
            [str(self.bin_dir / name), f"--kubeconfig={self.kubeconfig}", *args],
            input=input, capture_output=True, text=True, env=env, timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise RealNodeError(f"{name} {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def named(self, name: str) -> RealNode:
        """This node or the one joined to it, by its Node's name."""
        for node in (self, self.joined):
            if node is not None and node.name == name:
                return node
        raise RealNodeError(f"no node {name} in this cluster")

    def in_node(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a command in the node's network namespace (as its processes see the network)."""
        pid = self._supervisor_pid()
        if pid is None:
            raise RealNodeError("the node is not running")
        return subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "--", *args], capture_output=True, text=True, timeout=timeout)


# Host paths that were there before any node ran (leftovers() only reports new ones).
_HOST_PATHS = ("/dev/vfio", "/run/passthrough", "/opt/containerd", "/var/lib/kubelet", "/var/lib/containerd", "/run/containerd")
_EXISTED = {p for p in _HOST_PATHS if Path(p).exists()}


def _own_netns() -> tuple[int, int]:
    info = os.stat("/proc/self/ns/net")
    return (info.st_dev, info.st_ino)


def _processes_in(netns: tuple[int, int]) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                info = os.stat(entry / "ns" / "net")
                if (info.st_dev, info.st_ino) == netns:
                    pids.append(int(entry.name))
    return pids


def _mount_points() -> list[str]:
    with contextlib.suppress(OSError):
        return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return []
