"""The chart installed on a real node as the README's install section says: `helm install` of
`charts/passthrough-operator`, with only the image reference given (the image built here, imported
into the node's containerd under the name the chart pulls by default)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from e2e.chart import CHART
from e2e.realnode.node import RealNode, RealNodeError

RELEASE = "passthrough"
NAMESPACE = "passthrough-system"
FULLNAME = "passthrough"  # the release name, which already says "passthrough"
OPERATOR = f"{FULLNAME}-operator"
AGENT = f"{FULLNAME}-agent"
# What a cluster with KubeVirt has: its CR as KubeVirt's release manifest writes it, whose
# configuration the operator keeps in line.
KUBEVIRT = {
    "apiVersion": "kubevirt.io/v1",
    "kind": "KubeVirt",
    "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
    "spec": {
        "certificateRotateStrategy": {},
        "configuration": {"developerConfiguration": {"featureGates": []}},
        "customizeComponents": {},
        "imagePullPolicy": "IfNotPresent",
        "workloadUpdateStrategy": {},
    },
}


def values(image_name: str) -> dict:
    """The user's values file: where the image is, nothing else."""
    repository, tag = image_name.rsplit(":", 1)
    return {"image": {"repository": repository, "tag": tag}}


def prepare_kubevirt(node: RealNode) -> None:
    node.kubectl("create", "namespace", "kubevirt")
    node.kubectl("apply", "-f", "-", input=json.dumps(KUBEVIRT))


def install(node: RealNode, values_file: Path, *flags: str) -> str:
    return node.helm(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace", "--values", str(values_file), *flags
    ).stdout


def upgrade(node: RealNode, values_file: Path, *flags: str) -> str:
    return node.helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values", str(values_file), *flags).stdout


def uninstall(node: RealNode) -> str:
    return node.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait").stdout


def set_up(node: RealNode, directory: Path, image_name: str, extra: dict | None = None) -> Path:
    """What a cluster with KubeVirt gets from the README's install: KubeVirt's CR, the values file
    (the image, and `extra`), `helm install`, the pods rolled out. The values file."""
    prepare_kubevirt(node)
    values_file = write_values(directory, {**values(image_name), **(extra or {})})
    install(node, values_file)
    wait_rolled_out(node)
    return values_file


def write_values(directory: Path, data: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "my-values.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def wait_rolled_out(node: RealNode, timeout: float = 300) -> None:
    """Until the operator's Deployment and the agents' DaemonSet have every pod updated and ready."""
    for kind, name in (("deployment", OPERATOR), ("daemonset", AGENT)):
        result = node.kubectl(
            "rollout", "status", f"{kind}/{name}", "-n", NAMESPACE, f"--timeout={int(timeout)}s", check=False, timeout=timeout + 30
        )
        if result.returncode != 0:
            pods = node.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
            events = node.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False).stdout
            logs = node.kubectl("logs", "-n", NAMESPACE, f"{kind}/{name}", "--all-containers", "--previous", "--tail=40", check=False)
            raise RealNodeError(
                f"{kind}/{name} not rolled out in {timeout:.0f}s: {result.stderr.strip()}\n{pods}\n{events[-4000:]}\n"
                f"last log lines of a restarted container:\n{logs.stdout[-4000:]}{logs.stderr[-500:]}"
            )


def pods(node: RealNode) -> list[dict]:
    return json.loads(node.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json").stdout)["items"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        if value := predicate():
            return value
        if time.monotonic() > deadline:
            raise RealNodeError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.5)
