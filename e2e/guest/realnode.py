"""A node that runs containers for real on the real-kernel rig's guest: containerd, runc, the CNI
bridge, kube-proxy and the kubelet in the QEMU guest (its own kernel, IOMMU and cgroup v2),
joined to the host's control plane.

The pieces are `e2e/realnode`'s (its configuration writers, the pause image, the CNI
configuration, containerd's), given the guest's addresses: the node is 10.0.2.15 (QEMU's user
network), pods get 10.88.0.0/16 on the guest's `cni0` and Services 10.0.0.0/24 from kube-proxy's
rules in the guest, so no pod or Service address exists outside the guest. Pods reach the API
server through the `kubernetes` Service, whose endpoint is the host's loopback as the guest sees
it (10.0.2.2, the API server's own port): the API server's certificate names the Service's
ClusterIP (10.0.0.1), so a pod's in-cluster login verifies as in a cluster. The guest's own
state (containerd's snapshots, the kubelet's directory) is on tmpfs mounts of the guest.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import LocalCluster
from e2e.guest.machine import Guest, GuestProcess
from e2e.guest.node import HOST, SERVER_NAME, guest_kubeconfig
from e2e.kubelet import KERNEL_DEFAULTS
from e2e.realnode import config

NODE_IP = "10.0.2.15"  # the guest's address on QEMU's user network (e2e/guest/initramfs.py)
WORKDIR = "/run/rn"  # in the guest: short, for the sockets below it
# What containerd, the CNI bridge and kube-proxy's iptables (nf_tables) rules need of the kernel,
# loaded before they start (the kernel's own module loading would call the host's modprobe).
# crc32c_generic first: libcrc32c (nf_conntrack's, nf_nat's) needs it, a soft dependency busybox's
# modprobe does not follow.
MODULES = (
    "crc32c_generic", "libcrc32c", "overlay", "bridge", "br_netfilter", "veth", "nfnetlink", "nf_conntrack", "nf_nat", "nf_tables", "nft_compat",
    "nft_chain_nat", "nft_ct", "nft_masq", "nft_nat", "nft_redir", "nft_reject_ipv4",
    "nft_limit", "xt_MASQUERADE", "xt_conntrack", "xt_comment", "xt_mark", "xt_addrtype", "xt_nat",
    "xt_statistic", "xt_multiport", "xt_tcpudp", "xt_physdev", "iptable_nat", "iptable_filter",
    "iptable_mangle", "ip6_tables", "ip6table_filter", "ip6table_nat", "ip6table_mangle",
)  # fmt: skip
# Fresh tmpfs in the guest: containerd's overlayfs snapshots cannot sit on the guest's overlay root.
TMPFS = ("/var/lib/containerd", "/run/containerd", "/var/lib/kubelet", "/var/log/pods", "/var/lib/cni", WORKDIR)
ENDPOINTS_MANAGER = "guest-realnode.e2e.passthrough.io"

_PREPARE = """
set -e
bb=/run/rk/busybox
for m in {modules}; do $bb modprobe -q $m || echo "no module $m" >&2; done
for d in {tmpfs}; do mkdir -p $d; mountpoint -q $d || mount -t tmpfs -o mode=755 tmpfs $d; done
mkdir -p {workdir}/cni /var/lib/kubelet/device-plugins /var/lib/kubelet/pod-resources /var/log/containers
echo 1 > /proc/sys/net/ipv4/ip_forward
echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables
{sysctls}
grep -q ' {server_name}$' /etc/hosts || echo '{host} {server_name}' >> /etc/hosts
grep -q ' {node}$' /etc/hosts || echo '{node_ip} {node}' >> /etc/hosts
"""


class GuestRealNodeError(RuntimeError):
    """The guest's node did not start; the message says which program and carries its log's tail."""


class GuestRealNode:
    """Node `name` in `guest` with containerd, runc, CNI, kube-proxy and the kubelet; `start(archives)`
    imports the image archives (docker-archive or OCI layout tars on the results share)."""

    def __init__(self, guest: Guest, cluster: LocalCluster, name: str, bin_dir: Path, runc: Path) -> None:
        self.guest, self.cluster, self.name = guest, cluster, name
        self.bin_dir, self.runc = bin_dir, runc
        self.dir = guest.share / f"realnode-{name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = guest_kubeconfig(cluster, self.dir / "kubeconfig")
        self.processes: dict[str, GuestProcess] = {}
        self.timings: dict[str, float] = {}

    # -- start ---------------------------------------------------------------------------------

    def start(self, archives: list[Path], timeout: float = 600) -> GuestRealNode:
        started = time.monotonic()
        workdir = Path(WORKDIR)
        sysctls = "\n".join(f"echo {v} > /proc/sys/{k}" for k, v in KERNEL_DEFAULTS.items())
        prepared = self.guest.sh(_PREPARE.format(
            modules=" ".join(MODULES), tmpfs=" ".join(TMPFS), workdir=WORKDIR, sysctls=sysctls,
            server_name=SERVER_NAME, host=HOST, node=self.name, node_ip=NODE_IP,
        ), timeout=300)  # fmt: skip
        self.timings["prepare"] = prepared.seconds
        if prepared.stderr.strip():
            print(f"[guest realnode] {prepared.stderr.strip()}")
        cni_dir = workdir / "cni"
        self.guest.write(str(cni_dir / "10-node.conflist"), json.dumps(config.cni_conflist(ip_masq=True), indent=2))
        toml = config.containerd_toml(workdir, self.bin_dir, str(self.runc), cni_dir, restrict_oom_score_adj=False)
        self.guest.write(f"{WORKDIR}/containerd.toml", toml)
        self._spawn("containerd", [str(self.bin_dir / "containerd"), f"--config={WORKDIR}/containerd.toml", "--log-level=info"])
        self._wait(lambda: self.ctr("version", check=False).rc == 0, 180, "containerd to serve")
        self.timings["containerd"] = time.monotonic() - started
        for archive in archives:
            imported = time.monotonic()
            self.ctr("images", "import", "--local", str(archive), timeout=900)
            self.timings[f"import {archive.name}"] = time.monotonic() - imported
        self._kubernetes_endpoints()
        kubelet = config.kubelet_config(workdir, "/", node_ip=NODE_IP, cluster_dns=())
        self.guest.write(f"{WORKDIR}/kubelet.yaml", yaml.safe_dump(kubelet, sort_keys=False))
        self._spawn("kubelet", [
            str(self.cluster.bin_dir / "kubelet"), f"--config={WORKDIR}/kubelet.yaml", f"--kubeconfig={self.kubeconfig}",
            "--root-dir=/var/lib/kubelet", f"--cert-dir={WORKDIR}/kubelet-pki", f"--hostname-override={self.name}",
            f"--node-ip={NODE_IP}", "--v=2",
        ])  # fmt: skip
        proxy = config.kube_proxy_config(self.kubeconfig, self.name, node_ip=NODE_IP)
        self.guest.write(f"{WORKDIR}/kube-proxy.yaml", yaml.safe_dump(proxy, sort_keys=False))
        self._spawn("kube-proxy", [str(self.bin_dir / "kube-proxy"), f"--config={WORKDIR}/kube-proxy.yaml", "--v=1"])
        self._wait(self._ready, timeout, f"node {self.name} Ready")
        self.timings["node Ready"] = time.monotonic() - started
        return self

    def _env(self) -> dict[str, str]:
        return {"PATH": f"{self.bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": WORKDIR, "TMPDIR": "/var/tmp"}

    def _spawn(self, name: str, argv: list[str]) -> GuestProcess:
        self.processes[name] = self.guest.spawn(f"realnode-{self.name}-{name}", argv, env=self._env())
        return self.processes[name]

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> Any:
        socket = config.containerd_socket(Path(WORKDIR))
        return self.guest.run(str(self.bin_dir / "ctr"), f"--address={socket}", "--namespace=k8s.io", *args,
                              timeout=timeout, check=check, env=self._env())  # fmt: skip

    def _kubernetes_endpoints(self) -> None:
        """The `kubernetes` Service's endpoint as the guest reaches the API server (the control
        plane writes none: `--endpoint-reconciler-type=none`)."""
        port = urllib.parse.urlsplit(self.cluster.server).port
        slice_ = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "namespace": "default", "labels": {
                "kubernetes.io/service-name": "kubernetes", "endpointslice.kubernetes.io/managed-by": ENDPOINTS_MANAGER}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [HOST], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        }  # fmt: skip
        self.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(slice_))

    def _ready(self) -> bool:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise GuestRealNodeError(f"{name} exited in the guest; its log {process.log}:\n{process.output(40)}")
        found = self.cluster.kubectl("get", "node", self.name, "-o", "json", check=False)
        if found.returncode != 0:
            return False
        conditions = json.loads(found.stdout).get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _wait(self, check, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                logs = "".join(f"\n--- {n} ({p.log}):\n{p.output(30)}" for n, p in self.processes.items())
                raise GuestRealNodeError(f"timed out after {timeout:.0f}s waiting for {what}{logs}")
            time.sleep(0.5)

    # -- pods and devices --------------------------------------------------------------------------

    agent = None  # `e2e.guest.node.wait` names a bare agent's log; this node's agent is a pod

    def devices(self) -> dict[str, dict[str, Any]]:
        """This node's NodePCIDevices, by PCI address (as `e2e.guest.node.GuestNode.devices`)."""
        listing = self.cluster.kubectl("get", "nodepcidevices", "-l", f"passthrough.io/node={self.name}", "-o", "json")
        items = json.loads(listing.stdout)["items"]
        return {i["status"]["attributes"]["pciAddress"]: i for i in items if i.get("status", {}).get("attributes")}

    def publish_root_ca(self, namespace: str) -> None:
        """The `kube-root-ca.crt` ConfigMap of `namespace`, as kube-controller-manager's root CA
        publisher writes it (the session's control plane does not run that controller): every
        pod's projected service-account volume takes its ca.crt from it."""
        config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kube-root-ca.crt", "namespace": namespace},
                      "data": {"ca.crt": self.cluster.ca_file.read_text()}}  # fmt: skip
        self.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(config_map))

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        found = self.cluster.kubectl("get", "pod", "-n", namespace, name, "-o", "json", check=False)
        return json.loads(found.stdout) if found.returncode == 0 else {}

    def pod_logs(self, namespace: str, pod: str, container: str) -> str:
        """A container's log as the kubelet keeps it in the guest (the API server cannot dial the guest's kubelet)."""
        return self.guest.sh(f"cat /var/log/pods/{namespace}_{pod}_*/{container}/*.log 2>/dev/null || true").stdout

    # -- stop ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """The kubelet, kube-proxy and containerd stopped; every container killed; the Node deleted."""
        for name in ("kubelet", "kube-proxy"):
            if name in self.processes:
                self.processes.pop(name).stop(timeout=20)
        if "containerd" in self.processes:
            self.guest.sh("for t in $(ls /run/containerd/io.containerd.runtime.v2.task/k8s.io 2>/dev/null); do "
                          f"{self.runc} --root /run/containerd/runc/k8s.io kill $t KILL; done; true", check=False)  # fmt: skip
            self.processes.pop("containerd").stop(timeout=20)
        self.cluster.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false", check=False)
        self.cluster.kubectl("delete", "nodepcidevices", "-l", f"passthrough.io/node={self.name}", "--wait=false", check=False)
        self.cluster.kubectl("delete", "endpointslice", "-n", "default", "kubernetes", "--ignore-not-found", check=False)
