"""The `passthrough` command: one entry point for the operator, the node agent and the tools."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from passthrough import __version__

# Exit codes: 0 ok, 1 a runtime failure (cluster unreachable, ...), 2 bad usage or input, 3 (discover --check)
# the node is not ready for passthrough.


def _lazy(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A command whose code is imported only when it runs, so `--help` stays fast."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    return run


def _add_host_roots(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sysfs-root", default="/sys", metavar="DIR", help="root of sysfs (default /sys)")
    p.add_argument("--proc-root", default="/proc", metavar="DIR", help="root of procfs (default /proc)")
    p.add_argument("--pci-ids", metavar="FILE", help="pci.ids database (default: the host's)")
    p.add_argument(
        "--sriov-virtual-functions",
        action="store_true",
        help="report SR-IOV virtual functions and let them be passed through (default: left out, as bridges are)",
    )


def _kubeconfig_file(path: str) -> str:
    # A path that names no file is a typo, not a cluster that cannot be reached: a usage error (2).
    if not Path(path).exists():
        raise argparse.ArgumentTypeError(
            f"{path}: the file does not exist; pass the path of a kubeconfig, or leave --kubeconfig out "
            "to use $KUBECONFIG (in a pod: the service account)"
        )
    if Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; pass the path of a kubeconfig file")
    return path


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return port


def _add_metrics_flags(p: argparse.ArgumentParser, component: str) -> None:
    p.add_argument(
        "--metrics-port", type=_port, default=0, metavar="PORT",
        help=f"serve the {component}'s Prometheus metrics on http://ADDR:PORT/metrics; 0: none (default)",
    )  # fmt: skip
    p.add_argument("--metrics-addr", default="0.0.0.0", metavar="ADDR", help="address the metrics listen on (default 0.0.0.0)")
    p.add_argument(
        "--metrics-auth", action="store_true",
        help="serve the metrics only to a bearer token whose user may get /metrics (TokenReview, SubjectAccessReview)",
    )  # fmt: skip


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kubeconfig", type=_kubeconfig_file, metavar="FILE", help="kubeconfig (default: in-cluster, else $KUBECONFIG)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="passthrough",
        description="PCI and GPU passthrough for KubeVirt virtual machines.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("operator", help="run the operator (Kopf)")
    p.add_argument(
        "--not-found-grace",
        default="10m",
        metavar="DURATION",
        help="how long an assigned device missing from its node keeps its PCIDevice, unless the "
        "PassthroughConfig sets devices.notFoundGracePeriodSeconds (default 10m)",
    )
    p.add_argument("--workers", type=int, default=64, help="devices reconciled in parallel (default 64)")
    p.add_argument("--liveness", default="", metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument(
        "--webhook-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve the validating admission webhooks (HTTPS) on PORT; 0: no webhooks (default)",
    )
    p.add_argument("--webhook-addr", default="0.0.0.0", metavar="ADDR", help="address the webhooks listen on (default 0.0.0.0)")
    p.add_argument(
        "--webhook-cert-dir",
        default="",
        metavar="DIR",
        help="the webhooks' serving certificate: DIR/tls.crt and DIR/tls.key (a kubernetes.io/tls Secret); "
        "re-read when they change",
    )
    p.add_argument(
        "--webhook-cert-check",
        default="60s",
        metavar="DURATION",
        help="how often the serving certificate's files are looked at for a renewal; a renewed pair serves "
        "new connections at once and no open connection is closed (default 60s)",
    )
    p.add_argument("--dra", action="store_true",
                   help="DRA mode: keep a DeviceClass passthrough-<namespace> for each namespace that has devices "
                   "handed out, selecting exactly those")
    p.add_argument("--readiness", default="", metavar="URL",
                   help="serve a readiness probe, e.g. http://0.0.0.0:8081/readyz: ready once the webhooks listen "
                   "and the caches hold their first listing (leader or not)")
    p.add_argument("--leader-elect", action="store_true",
                   help="reconcile only while holding a coordination.k8s.io Lease, so that two or more replicas can "
                   "run: each serves the webhooks, one reconciles")
    p.add_argument("--leader-elect-resource-name", default="passthrough-operator", metavar="NAME",
                   help="the Lease's name (default passthrough-operator)")
    p.add_argument("--leader-elect-resource-namespace", default="", metavar="NAMESPACE",
                   help="the Lease's namespace (default: $POD_NAMESPACE, else default)")
    p.add_argument("--leader-elect-identity", default="", metavar="ID",
                   help="this replica's holderIdentity (default: $POD_NAME or the host name, and a random suffix)")
    for flag, default, what in (
        ("lease-duration", "10s", "how long a standby waits after the last renewal it saw before it takes over"),
        ("renew-deadline", "7s", "how long the leader goes on reconciling without a successful renewal"),
        ("retry-period", "2s", "how often each replica tries to acquire or renew the Lease"),
    ):
        p.add_argument(f"--leader-elect-{flag}", default=default, metavar="DURATION", help=f"{what} (default {default})")
    _add_metrics_flags(p, "operator")
    _add_client_flags(p)
    p.set_defaults(func=_lazy("passthrough.controller.main", "run"))

    p = sub.add_parser("agent", help="run the node agent")
    p.add_argument("--node-name", default="", help="this node's name (default: $NODE_NAME)")
    _add_host_roots(p)
    p.add_argument("--rescan-interval", default="5m", metavar="DURATION", help="periodic rescan (default 5m)")
    p.add_argument("--start-jitter", metavar="DURATION",
                   help="wait up to this long, at random, before the first request, so that a DaemonSet's agents "
                   "starting together reach the API server spread out (default 10s in a pod, 0 elsewhere)")  # fmt: skip
    p.add_argument("--no-hotplug", dest="hotplug", action="store_false", help="do not listen for kernel hotplug events")
    p.add_argument("--dev-root", default="/dev", metavar="DIR", help="where /dev/vfio is found (default /dev)")
    p.add_argument(
        "--host-root",
        metavar="DIR",
        help="where the node's filesystem is mounted: its pci.ids is preferred to the image's (e.g. /host)",
    )
    p.add_argument(
        "--device-plugin-dir",
        default="/var/lib/kubelet/device-plugins",
        metavar="DIR",
        help="the kubelet's device-plugin directory (default /var/lib/kubelet/device-plugins)",
    )
    p.add_argument(
        "--pod-resources-socket",
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        metavar="FILE",
        help="the kubelet's PodResources API, asked before a device is given back",
    )
    p.add_argument(
        "--state-dir",
        default="/run/passthrough",
        metavar="DIR",
        help="where the agent records what it bound to vfio-pci, to give back only that (default /run/passthrough: "
        "the host's /run, cleared at reboot as the binds are)",
    )
    p.add_argument(
        "--binder-socket",
        action="append",
        metavar="FILE",
        help="write sysfs through `passthrough binder` listening there (a container of its own that may write /sys), "
        "not through a child of this process; may be repeated, in order of preference: each new connection goes to the "
        "first that answers",
    )
    p.add_argument(
        "--write-deadline",
        default="15s",
        metavar="DURATION",
        help="how long a bind or give-back may take before its devices are reported WriteBlocked (default 15s)",
    )
    p.add_argument(
        "--no-pool-resources",
        dest="pool_resources",
        action="store_false",
        help="leave GPU pools (nvidia.com/...) to NVIDIA's sandbox device plugin: serve only assigned devices",
    )
    p.add_argument(
        "--no-device-plugin",
        dest="device_plugin",
        action="store_false",
        help="only report devices: bind nothing to vfio-pci and serve no resources",
    )
    p.add_argument(
        "--dra",
        action="store_true",
        help="serve devices through Dynamic Resource Allocation (a ResourceSlice, claims) instead of device plugins",
    )
    p.add_argument(
        "--per-node-mode",
        action="store_true",
        help="let the Node's passthrough.io/mode label (dra or device-plugin) choose how this node serves devices, "
        "read at start-up; --dra is then the default of nodes without it",
    )
    p.add_argument("--kubelet-dir", default="/var/lib/kubelet", metavar="DIR",
                   help="the kubelet's root directory, for --dra: plugins_registry/ and plugins/ (default /var/lib/kubelet)")  # fmt: skip
    p.add_argument("--cdi-dir", default="/var/run/cdi", metavar="DIR",
                   help="where --dra writes CDI specs for the container runtime (default /var/run/cdi)")  # fmt: skip
    _add_metrics_flags(p, "agent")
    _add_client_flags(p)
    p.set_defaults(func=_lazy("passthrough.agent.main", "run"))

    p = sub.add_parser("binder", help="bind and give back devices for an agent that may not write sysfs itself")
    p.add_argument("--listen", required=True, metavar="FILE", help="the unix socket the agent's --binder-socket names")
    # Its own view of the host, never a job's: what it moves is judged there by discovery's rules.
    _add_host_roots(p)
    p.add_argument("--dev-root", default="/dev", metavar="DIR", help="where /dev/vfio is found (default /dev)")
    p.set_defaults(func=_lazy("passthrough.pci.binder", "run"))

    p = sub.add_parser("discover", help="print what the agent would report on this host (reads sysfs only)")
    _add_host_roots(p)
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--all", action="store_true", help="also list the devices the agent leaves out (bridges, ...)")
    p.add_argument("--check", action="store_true",
                   help="preflight: say whether this node is ready for passthrough (IOMMU, vfio-pci, a device that can "
                   "be passed through) and exit 0 when it is, 3 when it is not")  # fmt: skip
    p.set_defaults(func=_lazy("passthrough.pci.commands", "discover"))

    p = sub.add_parser("resource-name", help="print the resource name of each VENDOR:DEVICE")
    p.add_argument("--pci-ids", metavar="FILE", help="pci.ids database (default: the host's)")
    p.add_argument("ids", nargs="+", metavar="VENDOR:DEVICE", help="PCI IDs in hex, e.g. 10de:2236")
    p.set_defaults(func=_lazy("passthrough.pci.commands", "resource_name"))

    p = sub.add_parser("render", help="print the KubeVirt configuration for a values file")
    p.add_argument("--values", required=True, metavar="FILE", help="platform values (YAML)")
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    p.add_argument("--format", choices=["kubevirt", "cozystack-package"], default="kubevirt")
    p.set_defaults(func=_lazy("passthrough.kubevirt.commands", "render"))

    p = sub.add_parser("uninstall", help="let go of what the operator wrote, once it is gone (the chart's post-delete hook); "
                       "with --give-back, have the agents give their devices back first (its pre-delete hook)",
                       description="Let go of the KubeVirt allow-list entries and feature gates the operator applied, "
                       "the in-use finalizers of PCIDevices and NodePCIDevices, the operator's DeviceClasses and the "
                       "give-back labels on Nodes; leave the CRDs and their objects, and what is still bound to vfio-pci "
                       "(listed, with how to give each back). With --give-back, only ask the running agents to give "
                       "back what they bound and nothing holds, and list what stays and why.")  # fmt: skip
    p.add_argument("--wait-for-pods", default="", metavar="SELECTOR",
                   help="first wait until no pod of --namespace matches SELECTOR (the operator's), so that it writes "
                   "nothing after this; still there after --timeout: exit 1, nothing changed")  # fmt: skip
    p.add_argument("--give-back", action="store_true",
                   help="only ask the agents, still running, to give back the devices they bound that nothing holds, "
                   "wait up to --timeout for each node's answer and list what stays on vfio-pci and why (the chart's "
                   "pre-delete hook); nothing else is changed")  # fmt: skip
    p.add_argument("--namespace", default="default", metavar="NAMESPACE", help="where --wait-for-pods looks (default default)")
    p.add_argument("--timeout", type=float, default=120, metavar="SECONDS",
                   help="how long --wait-for-pods, or --give-back, waits (default 120)")
    p.add_argument("--kubeconfig", type=_kubeconfig_file, metavar="FILE", help="kubeconfig (default: in-cluster, else $KUBECONFIG)")
    p.set_defaults(func=_lazy("passthrough.controller.uninstall", "run"))

    p = sub.add_parser("crds", help="print the CustomResourceDefinitions (or write them to --out)")
    p.add_argument("--out", metavar="DIR", help="write one manifest per CRD into DIR")
    p.set_defaults(func=_lazy("passthrough.api.commands", "crds"))

    p = sub.add_parser("values-schema", help="print the Helm chart's values.schema.json (or write it to --out)")
    p.add_argument("--out", metavar="FILE", help="write it to FILE (the chart's is charts/passthrough-operator/values.schema.json)")
    p.set_defaults(func=_lazy("passthrough.api.commands", "values_schema"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Names read from the host (drivers, interfaces, mount points) are file names, which are
    # bytes: one that is not UTF-8 is printed escaped, not a UnicodeEncodeError on a strict
    # UTF-8 stdout.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
