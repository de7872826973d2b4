"""The real node's addresses and the configuration of its programs (pure: files' contents only)."""

from __future__ import annotations

from pathlib import Path

# Addresses that exist only inside the node's network namespace.
NODE_LINK = "node0"
NODE_IP = "10.99.0.1"  # the node's InternalIP, on NODE_LINK
POD_CIDR = "10.88.0.0/16"  # the CNI bridge's host-local range
APISERVER_PORT = 6443  # on NODE_IP: where the `kubernetes` Service's endpoint forwards to the API server
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
KUBE_PROXY_HEALTHZ_PORT = 10256
KUBE_PROXY_METRICS_PORT = 10249
PAUSE_IMAGE = "localhost/passthrough-e2e/pause:1"
# A second node joined to the first (`RealNode(joins=first)`): a network namespace of its own, its
# `NODE_LINK` one end of a veth pair whose other end, `WORKER_LINK`, is a port of the first node's
# bridge; its pods get a range of their own, routed through it.
WORKER_IP = "10.99.0.2"
WORKER_POD_CIDR = "10.87.0.0/16"
WORKER_LINK = "veth-worker"  # in the first node's namespace

# What the control plane's own controller-manager does not run and a cluster of pods needs.
WORKLOAD_CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "daemonset-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "disruption-controller",
    "job-controller",  # the chart's helm hooks are Jobs
    "node-lifecycle-controller",
    "pod-garbage-collector-controller",
    "root-ca-certificate-publisher-controller",
    "service-cidr-controller",
)


def containerd_socket(workdir: Path) -> Path:
    return workdir / "containerd.sock"


def containerd_toml(workdir: Path, bin_dir: Path, runc: str, cni_conf_dir: Path, restrict_oom_score_adj: bool) -> str:
    """containerd 2.x configuration (version 3): state in the namespace's /run and /var,
    the socket in the workdir (reachable from outside), runc with cgroupfs, our CNI and pause."""
    cri_runtime = '"io.containerd.cri.v1.runtime"'
    return f"""version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
# Plugins that would write outside the node's namespace (/opt/containerd) or need what this
# machine lacks (devmapper pools, ZFS, btrfs: cgo is off).
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "{containerd_socket(workdir)}"

[plugins.{cri_runtime}]
  enable_selinux = false
  enable_cdi = true
  # This machine withholds CAP_SYS_RESOURCE even from root: no process may lower its
  # oom_score_adj, so the kubelet's -998 for sandboxes (-997 for Guaranteed pods) is raised to
  # containerd's own, as on a rootless node.
  restrict_oom_score_adj = {'true' if restrict_oom_score_adj else 'false'}
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins.{cri_runtime}.containerd]
    default_runtime_name = "runc"
    [plugins.{cri_runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.{cri_runtime}.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
  [plugins.{cri_runtime}.cni]
    bin_dirs = ["{bin_dir}"]
    conf_dir = "{cni_conf_dir}"
    max_conf_num = 1

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def cni_conflist(ip_masq: bool = False, pod_cidr: str = POD_CIDR) -> dict:
    """`ip_masq`: where the node has a way out (the QEMU guest's user network), pods' packets to
    it leave with the node's address."""
    return {
        "cniVersion": "1.0.0",
        "name": "node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                # The node's namespace has no way out: nothing to masquerade for.
                "ipMasq": ip_masq,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kube_proxy_config(kubeconfig: Path, node_name: str, node_ip: str = NODE_IP, cluster_cidr: str = POD_CIDR) -> dict:
    """`cluster_cidr`: the node's own pods' range (traffic from it to a Service is not masqueraded)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": cluster_cidr,
        "hostnameOverride": node_name,
        "bindAddress": node_ip,
        "healthzBindAddress": f"127.0.0.1:{KUBE_PROXY_HEALTHZ_PORT}",
        "metricsBindAddress": f"127.0.0.1:{KUBE_PROXY_METRICS_PORT}",
        # Zero: leave the kernel's conntrack settings alone (the table size is the host's).
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
            "udpTimeout": "0s",
            "udpStreamTimeout": "0s",
        },
        "iptables": {"syncPeriod": "30s", "minSyncPeriod": "0s"},
    }


def kubelet_config(workdir: Path, cgroup_root: str, node_ip: str = NODE_IP, cluster_dns: tuple[str, ...] = (NODE_IP,)) -> dict:
    endpoint = f"unix://{containerd_socket(workdir)}"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # On the node's address inside its namespace: the API server reaches it for logs and
        # exec; nothing outside the namespace can.
        "address": node_ip,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": KUBELET_HEALTHZ_PORT,
        # The API server here has no kubelet client certificate.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": endpoint,
        "imageServiceEndpoint": endpoint,
        # This machine's cgroups are v1; every cgroup the kubelet and runc make is below
        # `cgroup_root`, which the harness makes and removes.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": True,
        "cgroupRoot": cgroup_root,
        "enforceNodeAllocatable": ["pods"],
        # The kernel settings are read, never written.
        "protectKernelDefaults": True,
        "makeIPTablesUtilChains": False,
        "oomScoreAdj": 0,
        "kernelMemcgNotification": False,
        "failSwapOn": False,
        # Pods resolve Service names with the node's cluster DNS (e2e/realnode/dns.py).
        "resolvConf": "",
        "clusterDNS": list(cluster_dns),
        "clusterDomain": "cluster.local",
        "volumePluginDir": str(workdir / "volume-plugins"),
        "podLogsDir": "/var/log/pods",
        # A nearly full disk or a busy machine must not evict the pods.
        "evictionHard": {},
        "evictionSoft": {},
        "mergeDefaultEvictionSettings": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "registerNode": True,
        "nodeStatusUpdateFrequency": "2s",
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }
