"""The real kubelet and kube-scheduler against the local control plane, without touching the host.

`KubeletNode` runs Kubernetes' own kubelet (the release the control plane is built from)
with `fakeruntime`, a CRI runtime stand-in that runs nothing and writes every
CreateContainer request to `<workdir>/containers.jsonl`. The kubelet runs in a private mount
namespace (`unshare --mount --propagation private`) in which:

- `<workdir>/var` is bind-mounted over `/var`, so the paths the kubelet fixes
  (`/var/lib/kubelet/device-plugins/`, `/var/log/containers`) are directories of the
  workdir, the same ones a process outside the namespace (a device plugin) sees under
  `<workdir>/var/...`; every mount the kubelet makes (volumes) vanishes with the namespace;
- a read-only bind mount of a file holding the value `protectKernelDefaults` expects is put
  over each of the six `/proc/sys` files it checks, so its check passes while no host
  kernel setting is changed (with that setting the kubelet only reads them);
- `LIBMOUNT_UTAB` points into the workdir, so util-linux creates no `/run/mount` on the host.

Every process dies with the test process (PR_SET_PDEATHSIG) and runs in its own process
group, which `stop()` kills whole. Logs are in `<workdir>/logs/`.

The kubelet needs a node IP that is not loopback: a global address of this machine's
interfaces is used (IPv4 first). The API server would connect to it only for logs, exec,
attach and port-forward, which no test uses, so no traffic ever leaves the machine.

No node-lifecycle controller runs here, so the harness does its part: it takes the
`not-ready` taint the kubelet registers with off a Ready node, and `stop()` deletes the
Node and the pods bound to it (else the scheduler would keep placing pods on a dead node).

`Scheduler` runs kube-scheduler against the cluster (no leader election, loopback ports).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import datetime
import functools
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import yaml

from e2e import build
from e2e.cluster import LocalCluster, free_ports

# The six settings `protectKernelDefaults: true` checks, with the values it requires.
KERNEL_DEFAULTS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
NODE_LABEL = "e2e.passthrough.io/kubelet"
# Device-plugin sockets are named under this directory, and a unix socket path has at most
# 107 bytes: keep the workdir short.
_MAX_DEVICE_PLUGIN_DIR = 64
BINARIES = ("kubelet", "kube-scheduler", "fakeruntime")
_LIFECYCLE_TAINTS = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


class KubeletError(RuntimeError):
    """The kubelet, the fake runtime or the scheduler did not start, or stopped."""


# -- where it can run ---------------------------------------------------------------------


def binaries_for(cluster: LocalCluster) -> Path | None:
    """A bin directory holding the kubelet, kube-scheduler and fakeruntime, or None.

    The cluster's own first; a cluster reused from an older build may lack them, then the
    current cache entry (never built here: `make controlplane` builds it).
    """
    candidates = [cluster.bin_dir]
    with contextlib.suppress(Exception):
        if found := build.cached_binaries():
            candidates.append(found)
    for directory in candidates:
        if all((Path(directory) / name).is_file() for name in BINARIES):
            return Path(directory)
    return None


def node_ip() -> str | None:
    """A global, non-loopback address of one of this machine's interfaces (IPv4 first).

    Read from `ip -j addr`, else from the route the kernel would pick (a UDP `connect`
    sends nothing); only an address a socket can bind to here counts.
    """
    candidates: list[str] = []
    with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
        out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=10, check=True).stdout
        for link in json.loads(out):
            if "LOOPBACK" in link.get("flags", []) or "UP" not in link.get("flags", []):
                continue
            for addr in link.get("addr_info", []):
                if addr.get("scope") == "global" and not addr.get("tentative") and not addr.get("dadfailed"):
                    candidates.append(addr["local"])
    if not candidates:
        for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
            with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))  # UDP: picks a source address, sends no packet
                candidates.append(s.getsockname()[0])
    candidates.sort(key=lambda a: ipaddress.ip_address(a).version)
    for candidate in candidates:
        ip = ipaddress.ip_address(candidate)
        if ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified:
            continue
        family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((candidate, 0))  # on this machine (binding sends nothing)
            return candidate
    return None


@functools.cache
def _private_mount_namespace_works() -> str | None:
    try:
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if result.returncode == 0 else (result.stderr.strip() or f"exit {result.returncode}")


def why_unavailable(cluster: LocalCluster) -> str | None:
    """Why a KubeletNode cannot run here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "the real kubelet needs root (a private mount namespace with bind mounts over /var and /proc/sys)"
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"the real kubelet needs `{tool}` (util-linux) on PATH"
    if binaries_for(cluster) is None:
        return (
            f"no kubelet, kube-scheduler and fakeruntime beside the control plane in {cluster.bin_dir}"
            " (run `make controlplane`)"
        )
    if (error := _private_mount_namespace_works()) is not None:
        return f"cannot make a private mount namespace (`unshare --mount`): {error}"
    if node_ip() is None:
        return "the kubelet needs a non-loopback address on one of this machine's interfaces, and there is none"
    return None


# -- processes ------------------------------------------------------------------------------


# The kernel sends the parent-death signal when the *thread* that forked the child ends, not
# the process: a kubelet (re)started from `asyncio.to_thread` would die with that worker.
# Every child is forked from this one thread, which lives as long as the process.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="e2e-kubelet-spawner")
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: no dlopen between fork and exec
_PR_SET_PDEATHSIG = 1


def _die_with_spawner(parent: int) -> None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent went before prctl took effect
        os._exit(1)


class _Child:
    """One process in its own process group, dying with us, logging to a file."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.name, self.args, self.log = name, args, log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            out.write(f"\n==== {time.strftime('%H:%M:%S')} {shlex.join(args)[:2000]}\n".encode())
            out.flush()
            parent = os.getpid()
            self.popen = _SPAWNER.submit(
                subprocess.Popen,
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,  # its own process group: stop() kills what it started too
                preexec_fn=lambda: _die_with_spawner(parent),
            ).result()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""

    def stop(self, timeout: float = 10) -> None:
        pgid = self.popen.pid  # the leader's pid is the group's id (start_new_session)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            try:
                self.popen.wait(timeout if sig == signal.SIGTERM else 30)
                break
            except subprocess.TimeoutExpired:
                continue
        # Whatever the leader started and left in its group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies of our own children count as gone.
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    return True
    return False


# -- the API -------------------------------------------------------------------------------


class _Api:
    """The few API calls the harness makes itself (stdlib only, the cluster's admin token)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.server, self.token = cluster.server, cluster.token
        self.context = ssl.create_default_context(cafile=str(cluster.ca_file))

    def call(
        self, method: str, path: str, body: dict | None = None, timeout: float = 10, content_type: str = "application/json"
    ) -> dict | None:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self.context) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


def _condition(node: dict | None, kind: str) -> dict | None:
    for condition in ((node or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return None


def _timestamp(value: str) -> float:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


# -- the node -------------------------------------------------------------------------------


class KubeletNode:
    """A real kubelet with the fake CRI runtime, registered as Node `node_name`.

    `workdir` must be short (a device plugin's socket path under it has at most 107 bytes);
    by default a fresh `/tmp/klXXXXXXXX`. It is removed by `stop()`.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        node_name: str | None = None,
        workdir: Path | str | None = None,
        *,
        labels: dict[str, str] | None = None,
        bin_dir: Path | None = None,
        verbosity: int = 2,
    ) -> None:
        self.cluster = cluster
        self.node_name = node_name or f"kl-{uuid.uuid4().hex[:8]}"
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kl", dir="/tmp"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = self.workdir.resolve()
        if len(str(self.device_plugin_dir)) > _MAX_DEVICE_PLUGIN_DIR:
            raise ValueError(
                f"workdir {self.workdir} is too long: device-plugin sockets under {self.device_plugin_dir}/"
                " would pass the 107-byte limit of a unix socket path"
            )
        self.labels = {NODE_LABEL: self.node_name, **(labels or {})}
        self.bin_dir = bin_dir or binaries_for(cluster)
        self.verbosity = verbosity
        self.ip: str | None = None
        self.kubelet_port = self.healthz_port = 0
        self._api = _Api(cluster)
        self._runtime: _Child | None = None
        self._kubelet: _Child | None = None

    # -- paths (as seen from outside the kubelet's mount namespace) --------------------------

    @property
    def var_dir(self) -> Path:
        """What the kubelet sees as /var."""
        return self.workdir / "var"

    @property
    def root_dir(self) -> Path:
        return self.var_dir / "lib" / "kubelet"

    @property
    def device_plugin_dir(self) -> Path:
        """Where a device plugin finds kubelet.sock and puts its own socket."""
        return self.root_dir / "device-plugins"

    @property
    def kubelet_socket(self) -> Path:
        """The kubelet's device-plugin Registration service."""
        return self.device_plugin_dir / "kubelet.sock"

    @property
    def pod_resources_socket(self) -> Path:
        return self.root_dir / "pod-resources" / "kubelet.sock"

    @property
    def cri_socket(self) -> Path:
        return self.workdir / "cri.sock"

    @property
    def containers_file(self) -> Path:
        return self.workdir / "containers.jsonl"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def kubelet_log(self) -> Path:
        return self.log_dir / "kubelet.log"

    @property
    def runtime_log(self) -> Path:
        return self.log_dir / "fakeruntime.log"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 90) -> KubeletNode:
        """Start the fake runtime and the kubelet; return once the Node is Ready in the API."""
        try:
            if reason := why_unavailable(self.cluster):
                raise KubeletError(reason)
            self._prepare()
            self._start_runtime(timeout)
            self._start_kubelet()
            self._wait_ready(time.monotonic() + timeout, since=0)
            self._untaint(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def restart_kubelet(self, timeout: float = 90) -> None:
        """Stop the kubelet alone and start it again (the runtime and its containers stay).

        At start the kubelet removes every socket in the device-plugin directory and makes a
        new kubelet.sock: a device plugin has to notice, serve again and register again.
        Returns once the new kubelet serves kubelet.sock and has posted a Ready status.
        """
        if self._kubelet is not None:
            self._kubelet.stop()
            self._kubelet = None
        since = time.time()
        self._start_kubelet()
        self._wait_ready(time.monotonic() + timeout, since=since)

    def stop_kubelet(self) -> None:
        """Stop the kubelet only (the Node stays in the API, as when a kubelet crashes)."""
        if self._kubelet is not None:
            self._kubelet.stop()
            self._kubelet = None

    def stop(self, delete_node: bool = True) -> None:
        """Stop both processes, delete the Node and its pods (by default), remove the workdir.

        No controller here deletes a dead node's pods or taints it, so without deleting them
        the scheduler would go on placing pods on it.
        """
        self.stop_kubelet()
        if self._runtime is not None:
            self._runtime.stop()
            self._runtime = None
        if delete_node:
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                self._delete_node()
        # The kubelet's mounts lived in its namespace and are gone with it; make sure.
        if not any(mount.startswith(str(self.workdir)) for mount in _host_mount_points()):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> KubeletNode:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what happened ---------------------------------------------------------------------

    def created_containers(self) -> list[dict]:
        """Every CreateContainer request the runtime got, oldest first.

        Each: time, pod_sandbox_id, container, pod, namespace, pod_uid, image,
        envs {key: value}, devices [{container_path, host_path, permissions}], cdi_devices,
        mounts [{container_path, host_path, readonly}], annotations.
        """
        try:
            text = self.containers_file.read_text()
        except FileNotFoundError:
            return []
        complete = text[: text.rfind("\n") + 1]  # a line being written right now is left for later
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def node(self) -> dict | None:
        """The Node object, or None."""
        return self._api.call("GET", f"/api/v1/nodes/{self.node_name}")

    def kubelet_alive(self) -> bool:
        return self._kubelet is not None and self._kubelet.alive()

    def freeze(self) -> None:
        """Stop the kubelet process (SIGSTOP): what reaches it waits, unread, until `thaw`."""
        os.kill(self._kubelet.popen.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self._kubelet.popen.pid, signal.SIGCONT)

    # -- internals ----------------------------------------------------------------------------

    def _prepare(self) -> None:
        if self.bin_dir is None:
            raise KubeletError(f"no kubelet binaries for {self.cluster.bin_dir}")
        self.ip = node_ip()
        if self.ip is None:
            raise KubeletError("no non-loopback address on this machine for the kubelet's node IP")
        for directory in (
            self.device_plugin_dir,
            self.root_dir / "pod-resources",
            self.var_dir / "log" / "containers",
            self.var_dir / "log" / "pods",
            self.var_dir / "run",
            self.var_dir / "tmp",
            self.workdir / "pki",
            self.workdir / "volume-plugins",
            self.workdir / "kubelet-cwd",
            self.log_dir,
        ):
            directory.mkdir(parents=True, exist_ok=True)
        sysctl = self.workdir / "sysctl"
        sysctl.mkdir(exist_ok=True)
        for key, value in KERNEL_DEFAULTS.items():
            (sysctl / key.replace("/", ".")).write_text(value + "\n")
        self.containers_file.touch()

    def _start_runtime(self, timeout: float) -> None:
        self.cri_socket.unlink(missing_ok=True)
        self._runtime = _Child(
            "fakeruntime",
            [str(self.bin_dir / "fakeruntime"), f"--socket={self.cri_socket}", f"--record={self.containers_file}"],
            self.runtime_log,
            cwd=self.workdir,
        )
        deadline = time.monotonic() + min(timeout, 30)
        while not self.cri_socket.is_socket():
            if not self._runtime.alive():
                raise KubeletError(f"fakeruntime exited; log {self.runtime_log}:\n{self._runtime.tail()}")
            if time.monotonic() > deadline:
                raise KubeletError(f"fakeruntime did not serve {self.cri_socket}; log {self.runtime_log}")
            time.sleep(0.05)

    def _config(self) -> dict:
        endpoint = f"unix://{self.cri_socket}"
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # Loopback only, no unauthenticated endpoints.
            "address": "127.0.0.1",
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": endpoint,
            "imageServiceEndpoint": endpoint,
            # Nothing on the host: read the kernel settings (never write them), no cgroups made,
            # no iptables, no OOM score for anyone but itself, no kernel memcg notifications.
            "protectKernelDefaults": True,
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "makeIPTablesUtilChains": False,
            "oomScoreAdj": 0,
            "kernelMemcgNotification": False,
            "failSwapOn": False,
            "hairpinMode": "none",
            "resolvConf": "",
            "volumePluginDir": str(self.workdir / "volume-plugins"),  # default is under /usr/libexec
            "podLogsDir": str(self.var_dir / "log" / "pods"),
            # A nearly full disk or a busy machine must not taint the node or evict pods.
            "evictionHard": {},
            "evictionSoft": {},
            "mergeDefaultEvictionSettings": False,
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "registerNode": True,
            "nodeStatusUpdateFrequency": "2s",
            "nodeStatusReportFrequency": "2s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "20s",
            "serializeImagePulls": False,
            "shutdownGracePeriod": "0s",
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
        }

    def _start_kubelet(self) -> None:
        assert self.bin_dir is not None and self.ip is not None
        self.kubelet_port, self.healthz_port = free_ports(2)
        config = self.workdir / "kubelet-config.yaml"
        config.write_text(yaml.safe_dump(self._config(), sort_keys=False))
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        kubelet = [
            str(self.bin_dir / "kubelet"),
            f"--config={config}",
            f"--kubeconfig={self.cluster.kubeconfig}",
            f"--root-dir={self.root_dir}",
            f"--cert-dir={self.workdir / 'pki'}",
            f"--hostname-override={self.node_name}",
            f"--node-ip={self.ip}",
            f"--node-labels={labels}",
            f"--v={self.verbosity}",
        ]
        q = shlex.quote
        script = ["set -e", f"mount --bind {q(str(self.var_dir))} /var"]
        for key in KERNEL_DEFAULTS:
            source = self.workdir / "sysctl" / key.replace("/", ".")
            script.append(f"mount --bind -o ro {q(str(source))} /proc/sys/{key}")
        script.append("exec " + shlex.join(kubelet))
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(self.workdir),
            "TMPDIR": str(self.var_dir / "tmp"),
            "LIBMOUNT_UTAB": str(self.workdir / "utab"),
        }
        # unshare and sh exec in turn: the kubelet keeps the pid, the process group and the
        # parent-death signal; its namespace (and every mount in it) ends with it.
        # An empty working directory: the kubelet deletes glob("<log path>*") of each container
        # it removes, which is every file of its working directory when a runtime reports no
        # log path (fakeruntime reports one; this is the second line of defence).
        self._kubelet = _Child(
            "kubelet",
            ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(script)],
            self.kubelet_log,
            env=env,
            cwd=self.workdir / "kubelet-cwd",
        )

    def _socket_since(self, since: float) -> bool:
        try:
            info = self.kubelet_socket.stat()
        except OSError:
            return False
        return self.kubelet_socket.is_socket() and info.st_mtime_ns >= since * 1e9

    def _wait_ready(self, deadline: float, since: float) -> None:
        """Until the Node is Ready with a heartbeat from after `since` (a wall-clock time),
        and the kubelet serves its device-plugin Registration socket again."""
        last = None
        while True:
            if self._kubelet is None or not self._kubelet.alive():
                tail = self._kubelet.tail() if self._kubelet else ""
                raise KubeletError(f"kubelet for {self.node_name} exited; log {self.kubelet_log}:\n{tail}")
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                last = self.node()
                ready = _condition(last, "Ready")
                if (
                    ready
                    and ready.get("status") == "True"
                    # Heartbeats are in whole seconds: one of the same second may be the old kubelet's.
                    and (not since or _timestamp(ready.get("lastHeartbeatTime") or "1970-01-01T00:00:00Z") > int(since))
                    and self._socket_since(since)
                ):
                    return
            if time.monotonic() > deadline:
                raise KubeletError(
                    f"node {self.node_name} not Ready in time (Ready condition: {_condition(last, 'Ready')});"
                    f" log {self.kubelet_log}:\n{self._kubelet.tail()}"
                )
            time.sleep(0.2)

    def _untaint(self, deadline: float) -> None:
        """Do what the node-lifecycle controller (not run here) does for a Ready node.

        The kubelet registers its Node with the `not-ready` NoSchedule taint, and only that
        controller takes it off; without it the scheduler would never place a pod here.
        """
        while True:
            node = self.node() or {}
            taints = (node.get("spec") or {}).get("taints") or []
            keep = [t for t in taints if t.get("key") not in _LIFECYCLE_TAINTS]
            if len(keep) == len(taints):
                return
            patch = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]}, "spec": {"taints": keep}}
            try:
                self._api.call(
                    "PATCH", f"/api/v1/nodes/{self.node_name}", patch, content_type="application/merge-patch+json"
                )
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 409 or time.monotonic() > deadline:  # 409: changed meanwhile, read again
                    raise

    def _delete_node(self) -> None:
        selector = urllib.parse.quote(f"spec.nodeName={self.node_name}")
        pods = self._api.call("GET", f"/api/v1/pods?fieldSelector={selector}") or {}
        for pod in pods.get("items", []):
            meta = pod["metadata"]
            # Nothing will ever confirm their end on a node that is gone: delete them now.
            self._api.call(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
            )
        self._api.call("DELETE", f"/api/v1/nodes/{self.node_name}")
        # Its devices outlive a deleted Node (kept for one that registers again): a test's node is done.
        selector = urllib.parse.quote(f"passthrough.io/node={self.node_name}")
        with contextlib.suppress(urllib.error.HTTPError):
            self._api.call("DELETE", f"/apis/passthrough.io/v1alpha1/nodepcidevices?labelSelector={selector}")


def _host_mount_points() -> list[str]:
    with contextlib.suppress(OSError):
        return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return []


# -- the scheduler ------------------------------------------------------------------------------


class Scheduler:
    """kube-scheduler against `cluster`: leader election off, its port on loopback."""

    def __init__(self, cluster: LocalCluster, log_dir: Path | None = None, bin_dir: Path | None = None) -> None:
        self.cluster = cluster
        self.bin_dir = bin_dir or binaries_for(cluster)
        self.log = (log_dir or cluster.workdir / "logs") / "kube-scheduler.log"
        self.port = 0
        self._child: _Child | None = None

    def start(self, timeout: float = 60) -> Scheduler:
        if self.bin_dir is None:
            raise KubeletError(f"no kube-scheduler beside the control plane in {self.cluster.bin_dir}")
        self.port = free_ports(1)[0]
        kubeconfig = str(self.cluster.kubeconfig)
        self._child = _Child(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.port}",
                "--profiling=false",
                "--v=1",
            ],
            self.log,
        )
        deadline = time.monotonic() + timeout
        context = ssl._create_unverified_context()  # its self-signed serving certificate, on loopback
        while True:
            if not self._child.alive():
                tail = self._child.tail()
                self.stop()
                raise KubeletError(f"kube-scheduler exited; log {self.log}:\n{tail}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"https://127.0.0.1:{self.port}/healthz", timeout=2, context=context) as r:
                    if r.read().strip() == b"ok":
                        return self
            if time.monotonic() > deadline:
                self.stop()
                raise KubeletError(f"kube-scheduler not healthy in {timeout}s; log {self.log}")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self._child is not None and self._child.alive()

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
