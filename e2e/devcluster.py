"""`make run`: a local development cluster with the operator and two simulated nodes.

The real control plane (etcd, kube-apiserver, kube-controller-manager) on loopback, our CRDs
and KubeVirt's, a KubeVirt CR and the `cluster` PassthroughConfig with the default values,
the operator, and one agent per simulated node over a fixture sysfs tree:

- gpu-node-1: two NVIDIA A10s, each with its audio function in the same IOMMU group;
- storage-node-1: an NVMe drive, a NIC that is up (not assignable) and a free NIC.

Everything runs in the foreground; Ctrl-C stops it all and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from e2e import build, fakesysfs
from e2e.cluster import REPO, LocalCluster, _die_with_parent, prepare

WORKDIR = Path(os.environ.get("PASSTHROUGH_DEVCLUSTER_DIR") or REPO / ".devcluster")
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
NODES = {"gpu-node-1": fakesysfs.gpu_node, "storage-node-1": fakesysfs.storage_node}
EXPECTED_DEVICES = 7  # 2 GPUs + 2 audio functions, 2 NICs + 1 NVMe drive

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


def _spawn(name: str, args: list[str], logs: Path) -> subprocess.Popen:
    log = (logs / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "passthrough", *args], stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
    )


def _say(text: str) -> None:
    print(text, flush=True)


def main() -> int:
    started = time.monotonic()
    if WORKDIR.exists():
        shutil.rmtree(WORKDIR)
    (WORKDIR / "logs").mkdir(parents=True)
    cluster = LocalCluster(workdir=WORKDIR, bin_dir=build.ensure_binaries())
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        _say("starting the control plane ...")
        cluster.start(before_controllers=prepare)
        _say(f"control plane ready at {cluster.server} ({time.monotonic() - started:.1f}s)")
        cluster.kubectl("create", "namespace", "kubevirt")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(KUBEVIRT))
        cluster.kubectl("apply", "-f", "-", input=json.dumps(CONFIG))

        logs = WORKDIR / "logs"
        children["operator"] = _spawn("operator", ["operator", f"--kubeconfig={cluster.kubeconfig}"], logs)
        for node, make in NODES.items():
            host = make(WORKDIR / "nodes" / node)
            cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}))
            children[f"agent-{node}"] = _spawn(
                f"agent-{node}",
                ["agent", f"--node-name={node}", f"--kubeconfig={cluster.kubeconfig}", f"--sysfs-root={host.sysfs}",
                 f"--proc-root={host.proc}", f"--pci-ids={PCI_IDS}", "--no-hotplug"],
                logs,
            )

        deadline = time.monotonic() + 60
        while len(cluster.kubectl("get", "npci", "-o", "name").stdout.split()) < EXPECTED_DEVICES:
            for name, proc in children.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}); see {logs / name}.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agents did not report {EXPECTED_DEVICES} devices in 60s; see {logs}")
            time.sleep(0.3)
        time.sleep(1)  # let the operator write the first conditions

        gpu = next(
            line.split()[0]
            for line in cluster.kubectl("get", "npci", "-o", "wide").stdout.splitlines()
            if "nvidia.com/GA102GL_A10" in line
        )
        kubectl = f"{cluster.bin_dir}/kubectl"
        _say("")
        _say(f"$ kubectl get npci   (ready in {time.monotonic() - started:.1f}s)")
        _say(cluster.kubectl("get", "npci").stdout)
        _say("Use the cluster from another shell:")
        _say(f"  export KUBECONFIG={cluster.kubeconfig}")
        _say(f"  alias kubectl={kubectl}")
        _say("  kubectl get npci -o wide")
        _say("  kubectl create namespace team-a")
        _say(f"  kubectl patch npci {gpu} --type=merge -p '{{\"spec\":{{\"assignedNamespace\":\"team-a\"}}}}'")
        _say("  kubectl get pci -n team-a")
        _say("  kubectl get passthroughconfig cluster -o yaml        # what was applied to KubeVirt, and mismatches")
        _say("  kubectl get kubevirt -n kubevirt kubevirt -o yaml     # permittedHostDevices and feature gates")
        _say(f"Logs: {logs}/   Ctrl-C stops everything.")

        while not stopping:
            for name, proc in children.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}); see {logs / name}.log")
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
        cluster.stop()
        _say("stopped")


if __name__ == "__main__":
    sys.exit(main())
