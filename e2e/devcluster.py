"""`make run`: a local development cluster with the operator and two simulated nodes.

The real control plane (etcd, kube-apiserver, kube-controller-manager) on loopback, our CRDs
and KubeVirt's, a KubeVirt CR and the `cluster` PassthroughConfig with the default values,
the operator, and one agent per simulated node over a fixture sysfs tree:

- gpu-node-1: two NVIDIA A10s, each with its audio function in the same IOMMU group, in GPU
  passthrough mode; as root it runs a real kubelet (and the cluster a real kube-scheduler),
  so the agent's device plugins register and pods receive their devices;
- storage-node-1: an NVMe drive, a NIC that is up (not assignable) and a free NIC.

The operator serves its admission webhooks on 127.0.0.1, registered from the chart's own
ValidatingWebhookConfiguration, so a pod or VM naming another namespace's device is refused.

KubeVirt's virt-api and virt-controller (`e2e.virt`, the build the tests use) run too and read
the KubeVirt CR the operator configures: a VirtualMachine that names an assigned device gets
virt-controller's launcher pod, which the kubelet creates with the device, and its instance
reaches `Scheduled`. virt-handler and virt-launcher do not run (no libvirt), so it goes no
further; the GPU node carries what virt-handler would put on it (`virt.mark_node`).

Each node's tree has a simulated kernel (`e2e.fakekernel`) that reacts to the vfio-pci bind
sequence as the real one does.

With `--dra` (`make run DRA=1`) the cluster is in DRA mode, as the chart's
`agent.devicePlugin.dra=true` makes it: the PassthroughConfig has `spec.dra.enabled`, the
operator runs `--dra` (a DeviceClass `passthrough-<namespace>` per namespace with devices) and
its claim webhooks are registered, and each agent is a DRA driver instead of device plugins.
The GPU node's driver registers with its real kubelet, publishes the node's ResourceSlice, and
hands a claim's container its `/dev/vfio` nodes through CDI specs under the kubelet's
`/var/run/cdi`; the fake runtime records the CDI device names each CreateContainer got.

Everything runs in the foreground; Ctrl-C stops it all and leaves no process behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from e2e import build, chart, fakesysfs, kubelet, virt
from e2e.cluster import REPO, LocalCluster, _die_with_parent, prepare
from e2e.processes import WebhookServing
from passthrough.pci.naming import node_pci_device_name

WORKDIR = Path(os.environ.get("PASSTHROUGH_DEVCLUSTER_DIR") or REPO / ".devcluster")
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
GPU_NODE = "gpu-node-1"
GPU_MODE_LABEL = "passthrough.io/gpu-passthrough"
NODES = {GPU_NODE: fakesysfs.gpu_node, "storage-node-1": fakesysfs.storage_node}
EXPECTED_DEVICES = 7  # 2 GPUs + 2 audio functions, 2 NICs + 1 NVMe drive
# The walkthroughs' devices, the same in both modes and in the docs: the GPU a tenant is given
# first, and the one the GPU-pool walkthrough assigns beside it (names are a hash of address,
# IDs and node, so they are the same on every run).
FIRST_GPU = node_pci_device_name("0000:3b:00.0", "10de", "2236", GPU_NODE)  # pci-9ace36ad...
SECOND_GPU = node_pci_device_name("0000:af:00.0", "10de", "2236", GPU_NODE)  # pci-892226a0...
TENANT = "team-a"
VM = "vm1"

KUBEVIRT = {
    "apiVersion": "kubevirt.io/v1",
    "kind": "KubeVirt",
    "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
    "spec": {"configuration": {"developerConfiguration": {"featureGates": ["Snapshot"]}}},
}
CONFIG = {
    "apiVersion": "passthrough.io/v1alpha1",
    "kind": "PassthroughConfig",
    "metadata": {"name": "cluster"},
    "spec": {"kubevirt": {"name": "kubevirt", "namespace": "kubevirt"}},
}
DRA_CHART = "--set=agent.devicePlugin.dra=true"  # the chart's switch: its DRA webhooks too


def config(dra: bool) -> dict:
    """The `cluster` PassthroughConfig as the chart renders it, `spec.dra.enabled` from the switch."""
    return {**CONFIG, "spec": {**CONFIG["spec"], "dra": {"enabled": dra}}}


def tenant_objects(dra: bool) -> list[dict]:
    """What the walkthrough's tenant creates: a VirtualMachine naming FIRST_GPU, by its exclusive
    resource in `hostDevices`, or in DRA mode through a ResourceClaim of the namespace's class.
    The README and the docs show the same objects (a test holds them to these)."""
    meta = {"name": VM, "namespace": TENANT}
    spec: dict = {}
    claims: list[dict] = []
    if dra:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "gpu"}]
        device = {"name": "gpu0", "claimName": "gpu", "requestName": "gpu"}
        claims = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "gpu", "namespace": TENANT},
                   "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"passthrough-{TENANT}"}}]}}}]  # fmt: skip
    else:
        device = {"name": "gpu0", "deviceName": f"passthrough.io/{FIRST_GPU}"}
    spec["domain"] = {"devices": {"hostDevices": [device]}, "resources": {"requests": {"memory": "1Gi"}}}
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": meta,
          "spec": {"runStrategy": "Always", "template": {"spec": spec}}}  # fmt: skip
    return [*claims, vm]


def agent_serving_args(dra: bool, host_root: Path, node_kubelet: kubelet.KubeletNode | None, sockets: Path) -> list[str]:
    """How a node's agent serves its devices: device plugins (to the kubelet where one runs), or
    with `dra` a DRA driver whose registration and CDI specs go where the kubelet and its
    runtime look. On a node without a kubelet the driver still publishes its slice (nobody
    prepares a claim there); its sockets go under `sockets`, a short directory, since a path
    in the fixture tree may pass the 107 bytes of a unix socket's path."""
    if node_kubelet is not None:
        plugin_dir, pod_resources = node_kubelet.device_plugin_dir, node_kubelet.pod_resources_socket
        kubelet_dir, cdi_dir = node_kubelet.root_dir, node_kubelet.var_dir / "run" / "cdi"
    else:
        plugin_dir, pod_resources = host_root / "device-plugins", host_root / "pod-resources.sock"
        kubelet_dir, cdi_dir = sockets, host_root / "cdi"
    args = [f"--device-plugin-dir={plugin_dir}", f"--pod-resources-socket={pod_resources}"]
    if dra:
        args += ["--dra", f"--kubelet-dir={kubelet_dir}", f"--cdi-dir={cdi_dir}"]
    return args


def _spawn(name: str, args: list[str], logs: Path) -> subprocess.Popen:
    return _spawn_module(name, ["passthrough", *args], logs)


def _spawn_module(name: str, args: list[str], logs: Path) -> subprocess.Popen:
    log = (logs / f"{name}.log").open("ab")
    # A session of its own: Ctrl-C reaches only this process, which stops the children in order,
    # each once (a second stop signal is an error to Kopf, and a child's own helpers would die
    # mid-line with a KeyboardInterrupt).
    return subprocess.Popen(
        [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, cwd=REPO,
        start_new_session=True,
    )


def _say(text: str) -> None:
    print(text, flush=True)


def _wait_until(check, what: str, children: dict[str, subprocess.Popen], logs: Path, timeout: float = 60) -> None:
    """Poll `check` until it holds; a child that exits meanwhile, or the timeout, is an error
    that names the log to read."""
    deadline = time.monotonic() + timeout
    while not check():
        for name, proc in children.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); see {logs / name}.log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} in {timeout:.0f}s; see {logs}")
        time.sleep(0.3)


def hints(kubeconfig: Path, kubectl: Path, dra: bool, containers: Path | None, tenant_file: Path | None = None) -> list[str]:
    """What `make run` prints to use the cluster from another shell: the same walkthrough in both
    modes (the docs' first steps, with the same device), then what only one mode has, then the
    tenant's VirtualMachine (`tenant_file`, `tenant_objects` written out) and what it became.
    Each line that starts with `  kubectl` runs as printed, once the two lines before it are run."""
    patch = '{"spec":{"assignedNamespace":"%s"}}' % TENANT
    steps = [
        ("kubectl get npci -o wide", "every device of both nodes, FIRST_GPU at 0000:3b:00.0 of gpu-node-1"),
        (f"kubectl create namespace {TENANT}", ""),
        (f"kubectl patch npci {FIRST_GPU} --type=merge -p '{patch}'", ""),
        (f"kubectl get pci -n {TENANT}", "its PCIDevice: READY, ATTACHED"),
        (f"kubectl describe npci {FIRST_GPU}", "Assigned: how a VM of the namespace uses it"),
        ("kubectl get passthroughconfig cluster -o yaml", "what was applied to KubeVirt, and mismatches"),
        ("kubectl get kubevirt -n kubevirt kubevirt -o yaml", "permittedHostDevices and feature gates"),
    ]
    if dra:
        steps += [(f"kubectl get deviceclass passthrough-{TENANT}", f"the operator's class for {TENANT}'s devices"),
                  ("kubectl get resourceslice -o yaml", f"the node's slice: passthrough.io/namespace={TENANT}")]  # fmt: skip
    elif containers is not None:
        steps.append((f"kubectl get node {GPU_NODE} -o jsonpath='{{.status.allocatable}}'", "the pool, and the assigned GPU"))
    if tenant_file is not None:
        what = f"a ResourceClaim gpu of class passthrough-{TENANT}, and {VM} naming it" if dra else f"{VM}, hostDevices: FIRST_GPU"
        steps.append((f"kubectl apply -f {tenant_file}", what))
        if dra:
            state = "allocated,reserved" if containers is not None else "pending: no scheduler runs here"
            steps.append((f"kubectl get resourceclaim -n {TENANT}", f"gpu: {state}"))
        reached = f"{VM} Scheduled, its launcher pod Running" if containers is not None else f"{VM} Scheduling: no kubelet here runs its launcher pod"
        steps.append((f"kubectl get vmi,pods -n {TENANT}", reached))
    width = max(len(command) for command, _ in steps if len(command) < 60)
    lines = ["Use the cluster from another shell:", f"  export KUBECONFIG={kubeconfig}", f"  alias kubectl={kubectl}"]
    lines += [f"  {command.ljust(width)}   # {why}".replace("FIRST_GPU", FIRST_GPU[:12] + "...") if why else f"  {command}"
              for command, why in steps]  # fmt: skip
    if containers is not None:
        got = "its CDI devices" if dra else "PCI_RESOURCE_PASSTHROUGH_IO_<NAME>=0000:3b:00.0 and /dev/vfio/20"
        lines += [f"  grep '\"container\":\"compute\"' {containers}   # the launcher's compute container as created: {got}"]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m e2e.devcluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dra", action="store_true",
                        help="DRA mode: agents publish ResourceSlices and prepare claims instead of serving device plugins")  # fmt: skip
    parser.add_argument("--real-node", action="store_true",
                        help="a real node (containerd, runc, CNI, kube-proxy) with the chart helm-installed on it (e2e/realnode)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.real_node:
        from e2e.realnode import run

        return run.main()
    started = time.monotonic()
    if WORKDIR.exists():
        shutil.rmtree(WORKDIR)
    (WORKDIR / "logs").mkdir(parents=True)
    cluster = LocalCluster(workdir=WORKDIR, bin_dir=build.ensure_binaries())
    children: dict[str, subprocess.Popen] = {}
    services: list = []  # the kube-scheduler and the GPU node's kubelet, when they run
    gpu_kubelet: kubelet.KubeletNode | None = None
    kubevirt: virt.KubeVirtControllers | None = None
    sockets = Path(tempfile.mkdtemp(prefix="ptdev", dir="/tmp"))  # a kubelet-less node's DRA sockets
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    # Ctrl-C stops it even when started from a shell that ignores SIGINT for its background
    # jobs (Python then installs no KeyboardInterrupt handler of its own).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _say("starting the control plane ...")
        cluster.start(before_controllers=prepare)
        _say(f"control plane ready at {cluster.server} ({time.monotonic() - started:.1f}s)")
        cluster.kubectl("create", "namespace", "kubevirt")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(KUBEVIRT))
        cluster.kubectl("apply", "-f", "-", input=json.dumps(config(args.dra)))

        logs = WORKDIR / "logs"
        # The admission webhooks on 127.0.0.1, registered from the chart's own configuration.
        serving = WebhookServing(WORKDIR / "webhook-tls")
        dra_flags = ["--dra"] if args.dra else []
        children["operator"] = _spawn("operator", ["operator", f"--kubeconfig={cluster.kubeconfig}", *serving.args(), *dra_flags], logs)
        helm, chart_flags = chart.helm(WORKDIR / "helm"), [DRA_CHART] if args.dra else []
        for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
            # The mutating one dates each assignment (passthrough.io/assigned-at), as in a cluster.
            hooks = chart.webhook_configuration(helm, serving, *chart_flags, kind=kind)
            cluster.kubectl("create", "-f", "-", input=json.dumps(hooks))
        no_kubelet = kubelet.why_unavailable(cluster)
        if no_kubelet:
            _say(f"left the kubelet out: {no_kubelet}; the GPU node is a Node object only")
        else:
            services.append(kubelet.Scheduler(cluster, log_dir=logs).start())
        for node, make in NODES.items():
            host = make(WORKDIR / "nodes" / node)
            # The node's simulated kernel: the agent's vfio-pci binds move the tree's driver links.
            children[f"kernel-{node}"] = _spawn_module(f"kernel-{node}", ["e2e.fakekernel", str(host.root)], logs)
            node_kubelet = None
            if node == GPU_NODE and not no_kubelet:
                # A real kubelet: the agent's device plugins (or DRA driver) register with it, pods get the devices.
                node_kubelet = gpu_kubelet = kubelet.KubeletNode(cluster, node, labels={GPU_MODE_LABEL: "true"})
                services.append(node_kubelet)
                node_kubelet.start()
                virt.mark_node(cluster, node)  # schedulable for launcher pods, as virt-handler would make it
            else:
                labels = {GPU_MODE_LABEL: "true"} if node == GPU_NODE else {}
                cluster.kubectl("apply", "-f", "-", input=json.dumps(
                    {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}))  # fmt: skip
            children[f"agent-{node}"] = _spawn(
                f"agent-{node}",
                ["agent", f"--node-name={node}", f"--kubeconfig={cluster.kubeconfig}", f"--sysfs-root={host.sysfs}",
                 f"--proc-root={host.proc}", f"--dev-root={host.dev}", f"--pci-ids={PCI_IDS}", "--no-hotplug",
                 *agent_serving_args(args.dra, host.root, node_kubelet, sockets / node),
                 f"--state-dir={host.root / 'state'}"],
                logs,
            )  # fmt: skip

        # KubeVirt's controllers start while the agents find their devices.
        kubevirt = virt.KubeVirtControllers(cluster, WORKDIR / "kubevirt")
        kubevirt.start()
        _say(f"KubeVirt {virt.kubevirt_version()}'s virt-api and virt-controller ready ({time.monotonic() - started:.1f}s)")
        tenant_file = WORKDIR / f"{VM}.yaml"
        tenant_file.write_text(yaml.safe_dump_all(tenant_objects(args.dra), sort_keys=False))

        def listed(kind: str) -> int:
            return len(cluster.kubectl("get", kind, "-o", "name").stdout.split())

        _wait_until(lambda: listed("npci") >= EXPECTED_DEVICES, f"the agents' {EXPECTED_DEVICES} devices", children, logs)
        if args.dra:
            _wait_until(lambda: listed("resourceslices") >= len(NODES), "a ResourceSlice of each node", children, logs)
        time.sleep(1)  # let the operator write the first conditions

        _say("")
        _say(f"$ kubectl get npci   (ready in {time.monotonic() - started:.1f}s)")
        _say(cluster.kubectl("get", "npci").stdout)
        if args.dra:
            _say("$ kubectl get resourceslices")
            _say(cluster.kubectl("get", "resourceslices").stdout)
        containers = gpu_kubelet.containers_file if gpu_kubelet is not None else None
        for line in hints(cluster.kubeconfig, cluster.bin_dir / "kubectl", args.dra, containers, tenant_file):
            _say(line)
        _say(f"Logs: {logs}/ (KubeVirt's: {kubevirt.workdir}/)   Ctrl-C stops everything.")

        while not stopping:
            for name, proc in children.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}); see {logs / name}.log")
            for name, proc in kubevirt.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}); see {kubevirt.log(name)}")
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        _say("\nstopping ...")
        for proc in children.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in children.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if kubevirt is not None:
            # Its webhooks go with the cluster, so none is taken away first: after a terminal's
            # Ctrl-C, etcd has had the signal too and the API server may no longer answer.
            kubevirt.webhooks.clear()
            kubevirt.stop()
        for service in reversed(services):
            service.stop()
        cluster.stop()
        shutil.rmtree(sockets, ignore_errors=True)
        _say("stopped")


if __name__ == "__main__":
    sys.exit(main())
