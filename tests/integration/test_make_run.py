"""`make run`'s main job: the local cluster comes up, `kubectl get npci` answers, Ctrl-C stops all;
and `make run DRA=1`: the nodes publish ResourceSlices and a claim gets the GPU."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from e2e import devcluster, kubelet, support

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster


@contextlib.contextmanager
def dev_cluster(workdir: Path, *args: str) -> Iterator[str]:
    """`python -m e2e.devcluster *args` until it says it is ready (yields what it printed), then
    Ctrl-C: it must stop cleanly, each of our processes once, and leave none behind."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "e2e.devcluster", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "PASSTHROUGH_DEVCLUSTER_DIR": str(workdir), "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # a process group of its own, as a shell's foreground job
    )  # fmt: skip
    lines: list[str] = []
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 150
        while not any("Ctrl-C stops everything" in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        pids = [int(p) for p in subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()]
        assert pids  # etcd, the API server, the controller-manager, the operator and the agents
        yield "".join(lines)
    finally:
        # Ctrl-C: the terminal sends SIGINT to the whole foreground process group.
        with contextlib.suppress(ProcessLookupError):  # it may have stopped by itself, on an error
            os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, rest
    assert "stopped" in rest
    # Stopped in order, each process once: no ERROR, no traceback in any of our logs.
    for log in sorted((workdir / "logs").glob("*.log")):
        if log.stem.startswith(("operator", "agent-", "kernel-")):
            text = log.read_text()
            assert " ERROR " not in text and "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"
    alive = [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text()]
    assert alive == [], f"left behind: {alive}"


def kubectl_of(cluster, workdir: Path) -> Callable[..., subprocess.CompletedProcess]:
    """kubectl against the dev cluster, as its printed instructions say to use it."""

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={workdir / 'kubeconfig'}", *args],
                              input=stdin, capture_output=True, text=True, timeout=30)  # fmt: skip

    return run


def documented_commands(page: Path) -> list[str]:
    """The `kubectl` lines of a page's first code block, without their comments."""
    block = page.read_text().split("```\n", 2)[1]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("kubectl ")]


def run_printed(output: str, retry: float = 30, only: list[str] | None = None) -> list[str]:
    """Run the commands `make run` printed for another shell, as printed: its `export` and `alias`
    lines, then each `kubectl` line in order (or those of `only`), each until it succeeds (the
    operator may still be at work on the step before, as it would be for a reader). Returns the
    commands without their comments."""
    block = output.split("Use the cluster from another shell:\n", 1)[1].split("Logs: ", 1)[0]
    lines = [line.strip() for line in block.splitlines()]
    setup = [line for line in lines if line.startswith(("export KUBECONFIG=", "alias kubectl="))]
    commands = [line for line in lines if line.startswith("kubectl ")] if only is None else only
    assert len(setup) == 2 and commands, output
    for command in commands:
        def ran(command=command):
            result = subprocess.run(["bash", "-c", "\n".join(["shopt -s expand_aliases", *setup, command])],
                                    capture_output=True, text=True, timeout=30)  # fmt: skip
            return result if result.returncode == 0 else None

        eventually(ran, retry, lambda command=command: f"{command!r} to succeed")
    return [command.split("   #")[0].strip() for command in commands]


def eventually(check: Callable[[], object], timeout: float, what: Callable[[], str]) -> object:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what()}"
        time.sleep(0.5)
    return value


def common_steps(workdir: Path) -> list[str]:
    """The first steps `make run` prints in both modes (devcluster.hints without its comments)."""
    said = devcluster.hints(workdir / "kubeconfig", Path("kubectl"), dra=False, containers=None)
    return [line.split("   #")[0].strip() for line in said if line.strip().startswith("kubectl ")]


def test_the_dev_cluster_comes_up_answers_and_stops_without_leftovers(cluster, tmp_path):
    workdir = tmp_path / "devcluster"
    kubectl = kubectl_of(cluster, workdir)
    with dev_cluster(workdir) as output:
        assert "NAME" in output and "gpu-node-1" in output and "storage-node-1" in output
        # The printed instructions work from another shell.
        got = kubectl("get", "npci")
        assert got.returncode == 0 and len(got.stdout.strip().splitlines()) == 1 + 7, got.stdout + got.stderr
        gates = kubectl("get", "kubevirt", "-n", "kubevirt", "kubevirt", "-o",
                        "jsonpath={.spec.configuration.developerConfiguration.featureGates}")  # fmt: skip
        assert "HostDevices" in gates.stdout and "HostDevicesWithDRA" not in gates.stdout
        # The admission webhook is live: a pod naming a device not assigned to its namespace is refused.
        gpu = next(line.split()[0] for line in got.stdout.splitlines() if "gpu-node-1" in line)
        pod = ('{"apiVersion":"v1","kind":"Pod","metadata":{"name":"thief"},"spec":{"containers":[{"name":"c","image":"x",'
               f'"resources":{{"limits":{{"passthrough.io/{gpu}":"1"}}}}}}]}}}}')
        deadline = time.monotonic() + 30
        while True:
            refused = kubectl("create", "-n", "default", "-f", "-", stdin=pod)
            if "denied the request" in refused.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # the operator's webhook may not listen yet
        assert refused.returncode != 0 and "denied the request" in refused.stderr, refused.stderr
        assert f"passthrough.io/{gpu}" in refused.stderr
        # The walkthrough it printed runs as printed, and gives the docs' first GPU to team-a; the
        # steps are the DRA mode's, and the container records are named where a kubelet runs.
        commands = run_printed(output)
        assert commands[:7] == common_steps(workdir), commands
        # The docs' walkthrough (docs/tasks/assign.md) makes the same changes and reads what it
        # says it reads: its commands run as written too.
        documented = documented_commands(REPO / "docs" / "tasks" / "assign.md")
        assert [c for c in documented if not c.startswith("kubectl get ")] == [
            c for c in commands if not c.startswith(("kubectl get ", "kubectl describe "))], documented
        run_printed(output, only=[c for c in documented if c not in commands])
        eventually(lambda: kubectl("get", "pci", "-n", "team-a", devcluster.FIRST_GPU).returncode == 0, 30,
                   lambda: f"PCIDevice team-a/{devcluster.FIRST_GPU}")  # fmt: skip
        # The chart's mutating webhook is registered too: the assignment carries its own time.
        dated = kubectl("get", "npci", devcluster.FIRST_GPU, "-o", "jsonpath={.metadata.annotations.passthrough\\.io/assigned-at}")
        assert dated.returncode == 0 and dated.stdout.strip(), dated.stdout + dated.stderr
        if not kubelet.why_unavailable(cluster):
            assert "the fake runtime's record of each container: " in output, output


CLAIM_AND_POD = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: gpu}
spec:
  devices:
    requests:
      - name: gpu
        exactly: {deviceClassName: passthrough-team-a}
---
apiVersion: v1
kind: Pod
metadata: {name: vm-launcher}
spec:
  automountServiceAccountToken: false
  resourceClaims:
    - {name: gpu, resourceClaimName: gpu}
  containers:
    - name: compute
      image: virt-launcher
      env: [{name: MARK, value: vm-launcher}]
      resources: {claims: [{name: gpu}]}
"""


def test_the_dev_cluster_in_dra_mode_publishes_slices_and_a_claim_gets_the_gpu(request, cluster, tmp_path):
    if reason := kubelet.why_unavailable(cluster):
        support.cannot_run(request, "real-kubelet", reason, once_key="kubelet")
    workdir = tmp_path / "devcluster"
    kubectl = kubectl_of(cluster, workdir)
    with dev_cluster(workdir, "--dra") as output:
        # Each node's slice is listed; the GPU node's offers its two A10s to any namespace (GPU mode).
        assert "gpu-node-1-pci.passthrough.io" in output and "storage-node-1-pci.passthrough.io" in output, output
        gates = kubectl("get", "kubevirt", "-n", "kubevirt", "kubevirt", "-o",
                        "jsonpath={.spec.configuration.developerConfiguration.featureGates}")  # fmt: skip
        assert "HostDevicesWithDRA" in gates.stdout, gates.stdout + gates.stderr
        # The chart's steering webhooks are registered with the rest of its mutating ones.
        hooks = kubectl("get", "mutatingwebhookconfiguration", "-o", "jsonpath={.items[*].webhooks[*].name}")
        assert "steer-resourceclaims.admission.passthrough.io" in hooks.stdout.split(), hooks.stdout + hooks.stderr
        [record_file] = re.findall(r"record of each container: (\S+)", output)

        # The walkthrough it printed, as printed: the same first steps as without DRA.
        assert run_printed(output)[:7] == common_steps(workdir)
        gpu = devcluster.FIRST_GPU
        address = kubectl("get", "npci", gpu, "-o", "jsonpath={.status.attributes.pciAddress}").stdout
        assert address == "0000:3b:00.0"
        device = "pci-" + address.replace(":", "-").replace(".", "-")

        def team_a_device():
            got = kubectl("get", "resourceslice", "gpu-node-1-pci.passthrough.io", "-o", "json")
            devices = json.loads(got.stdout or "{}").get("spec", {}).get("devices") or []
            return {d["name"] for d in devices if d["attributes"]["passthrough.io/namespace"]["string"] == "team-a"}

        assert eventually(team_a_device, 30, lambda: "the slice to list the GPU for team-a") == {device}
        eventually(lambda: kubectl("get", "deviceclass", "passthrough-team-a").returncode == 0, 30,
                   lambda: "DeviceClass passthrough-team-a")  # fmt: skip
        applied = kubectl("apply", "-n", "team-a", "-f", "-", stdin=CLAIM_AND_POD)
        assert applied.returncode == 0, applied.stderr

        def allocated():
            got = kubectl("get", "resourceclaim", "-n", "team-a", "gpu", "-o", "jsonpath={.status.allocation.devices.results}")
            return json.loads(got.stdout) if got.stdout else None

        [result] = eventually(allocated, 60, lambda: kubectl("describe", "pod", "-n", "team-a", "vm-launcher").stdout)
        assert (result["driver"], result["pool"], result["device"]) == ("pci.passthrough.io", "gpu-node-1", device)

        def container():
            records = [json.loads(line) for line in Path(record_file).read_text().splitlines() if line.strip()]
            return next((r for r in records if r.get("envs", {}).get("MARK") == "vm-launcher"), None)

        created = eventually(container, 60, lambda: kubectl("describe", "pod", "-n", "team-a", "vm-launcher").stdout)
        assert any(name.startswith("passthrough.io/vfio=") and name.endswith(device) for name in created["cdi_devices"]), created
