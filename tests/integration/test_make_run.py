"""`make run`'s main job: the local cluster comes up, `kubectl get npci` answers, the walkthrough
it prints (and the README's and the docs', as written) takes a VirtualMachine through KubeVirt's
virt-api and virt-controller to a launcher pod holding its device, and Ctrl-C stops all, leaving
no process, mount or namespace; in both modes (`make run DRA=1`: the VM names a claim)."""

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
import yaml

from e2e import build, devcluster, kubelet, support, virt
from passthrough.pci.naming import exclusive_resource_name, resource_env_name

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster
NAMESPACE_KINDS = ("mnt", "net", "pid", "ipc", "uts", "cgroup")


@pytest.fixture
def kubevirt_programs(request):
    """KubeVirt's virt-api and virt-controller, which `make run` starts, built (cached)."""
    try:
        virt.ensure_binaries()
    except build.BuildError as exc:
        support.cannot_run(request, "kubevirt-controllers", str(exc))


def _namespaces(pid: int | str) -> set[str]:
    found = set()
    for kind in NAMESPACE_KINDS:
        with contextlib.suppress(OSError):
            found.add(os.readlink(f"/proc/{pid}/ns/{kind}"))
    return found


def _holders_since(namespaces: set[str], since: float) -> list[int]:
    """The processes in one of `namespaces` that started before `since` (CLOCK_BOOTTIME): a
    process started later may hold a new namespace that was given a freed one's number."""
    tick = os.sysconf("SC_CLK_TCK")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / tick
            if started < since and _namespaces(pid) & namespaces:
                found.append(int(pid))
    return found


def _mounts_under(*paths: Path) -> list[str]:
    """This mount namespace's mounts at or below one of `paths` (where make run's simulated
    kernel mounts its FUSE files: the test's namespace, shared with make run)."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if any(p == str(path) or p.startswith(f"{path}/") for path in paths)]


def _described(pids: list[int]) -> list[str]:
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            found.append(f"{pid} {command[:200]}")
    return found


def _kubelet_dir(output: str) -> Path | None:
    """The GPU node's kubelet directory, from the path of its runtime's records make run prints."""
    found = re.findall(r"(\S+)/containers\.jsonl", output)
    return Path(found[0]) if found else None


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
    theirs: set[str] = set()  # the namespaces make run's processes made (the kubelet's)
    places: list[Path] = [workdir]
    try:
        deadline = time.monotonic() + 150
        while not any("Ctrl-C stops everything" in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        output = "".join(lines)
        places += [path] if (path := _kubelet_dir(output)) else []
        pids = [int(p) for place in places
                for p in subprocess.run(["pgrep", "-f", str(place)], capture_output=True, text=True).stdout.split()]  # fmt: skip
        # etcd, the API server, the controller-manager, the operator, the agents, virt-api, virt-controller
        assert pids
        theirs = {ns for pid in pids for ns in _namespaces(pid)} - _namespaces(os.getpid())
        # The simulated kernel's FUSE mounts, in this namespace: what must be gone after.
        assert _mounts_under(workdir / "nodes"), "no simulated kernel mount seen while make run ran"
        yield output
    finally:
        # Ctrl-C: the terminal sends SIGINT to the whole foreground process group.
        with contextlib.suppress(ProcessLookupError):  # it may have stopped by itself, on an error
            os.killpg(proc.pid, signal.SIGINT)
        try:
            rest = proc.communicate(timeout=90)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"make run still stopping 90s after Ctrl-C:\n{proc.communicate()[0]}")
        stopped = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert proc.returncode == 0, rest
    assert "stopped" in rest
    # Stopped in order, each process once: no ERROR, no traceback in any of our logs.
    for log in sorted((workdir / "logs").glob("*.log")):
        if log.stem.startswith(("operator", "agent-", "kernel-")):
            text = log.read_text()
            assert " ERROR " not in text and "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"
    alive = [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text()]
    assert alive == [], f"left behind: {alive}"
    assert _mounts_under(*places) == [], "mounts left behind"
    # A process killed at the end may take a moment to leave its namespaces.
    eventually(lambda: not _holders_since(theirs, stopped), 15,
               lambda: f"no process left in make run's namespaces {theirs}: {_described(_holders_since(theirs, stopped))}")  # fmt: skip
    if _kubelet_dir(rest + "".join(lines)) is not None:
        assert theirs, "the kubelet's private mount namespace was not seen while make run ran"


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


def walkthrough(page: Path, heading: str) -> list[str]:
    """The `kubectl` commands of the code blocks of a page's section (`heading` to the next
    `## `), as written: a `$ ` prompt and a trailing comment taken off, a here-document kept
    whole; output lines are not commands."""
    text = page.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    commands: list[str] = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text[start:] if end < 0 else text[start:end], re.S | re.M):
        lines = iter(block.splitlines())
        for line in lines:
            line = line.removeprefix("$ ")
            if not line.startswith("kubectl "):
                continue
            command = re.sub(r"\s+#\s.*$", "", line)
            if here := re.search(r"<<'(\w+)'", command):
                body = []
                for more in lines:
                    body.append(more)
                    if more == here.group(1):
                        break
                command = "\n".join([command, *body])
            commands.append(command)
    return commands


def applied(commands: list[str]) -> list[list[dict]]:
    """The objects of each here-document among `commands`."""
    return [list(yaml.safe_load_all(c.split("\n", 1)[1].rsplit("\n", 1)[0])) for c in commands if "\n" in c]


def readme_and_page(dra: bool) -> list[str]:
    """The walkthrough's commands in the README and on the dev cluster's page, for one mode."""
    mode = "## In DRA mode" if dra else "## With device plugins"
    readme = walkthrough(REPO / "README.md", "## From an assignment to a VM")
    ours = [c for c in readme if ("ResourceClaim" in c) == dra or "\n" not in c]
    return ours + walkthrough(REPO / "docs" / "tasks" / "dev-cluster.md", mode)


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


def run_documented(output: str, printed: list[str], documented: list[str], dra: bool) -> None:
    """The README's and the docs' walkthrough on make run's cluster, as written: what the printed
    steps did not run already, after them; each here-document the tenant's objects make run
    wrote (so `kubectl apply` of it changes nothing)."""
    heredocs = applied(documented)
    assert heredocs and all(objects == devcluster.tenant_objects(dra) for objects in heredocs), heredocs
    run_printed(output, only=[c for c in documented if c not in printed])


def vm_scheduled(kubectl, record_file: Path) -> dict:
    """The walkthrough's VM as `kubectl get vmi,pods` shows it: its instance Scheduled on the GPU
    node, virt-controller's launcher pod Running there; returns the runtime's record of the
    launcher's compute container."""
    ns, selector = devcluster.TENANT, f"kubevirt.io=virt-launcher,vm.kubevirt.io/name={devcluster.VM}"

    def scheduled():
        got = kubectl("get", "vmi", "-n", ns, devcluster.VM, "-o", "jsonpath={.status.phase} {.status.nodeName}")
        return got.stdout == f"Scheduled {devcluster.GPU_NODE}"

    def why() -> str:
        return kubectl("get", "vmi,pods", "-n", ns, "-o", "yaml").stdout[-4000:]

    eventually(scheduled, 90, lambda: f"VMI {devcluster.VM} Scheduled on {devcluster.GPU_NODE}: {why()}")
    [pod] = json.loads(kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json").stdout)["items"]
    assert pod["status"]["phase"] == "Running" and pod["spec"]["nodeName"] == devcluster.GPU_NODE, pod["status"]
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "VirtualMachineInstance"

    def container():
        records = [json.loads(line) for line in record_file.read_text().splitlines() if line.strip()]
        return next((r for r in records if r["pod"] == pod["metadata"]["name"] and r["container"] == "compute"), None)

    return eventually(container, 30, lambda: f"the compute container of {pod['metadata']['name']}")


def test_the_dev_cluster_comes_up_answers_and_stops_without_leftovers(request, cluster, kubevirt_programs, tmp_path):
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
            c for c in commands[:7] if not c.startswith(("kubectl get ", "kubectl describe "))], documented
        run_printed(output, only=[c for c in documented if c not in commands])
        # The tenant's VirtualMachine, as the README and the dev cluster's page write it.
        assert f"kubectl apply -f {workdir / 'vm1.yaml'}" in commands, commands
        run_documented(output, commands, readme_and_page(dra=False), dra=False)
        eventually(lambda: kubectl("get", "pci", "-n", "team-a", devcluster.FIRST_GPU).returncode == 0, 30,
                   lambda: f"PCIDevice team-a/{devcluster.FIRST_GPU}")  # fmt: skip
        # The chart's mutating webhook is registered too: the assignment carries its own time.
        dated = kubectl("get", "npci", devcluster.FIRST_GPU, "-o", "jsonpath={.metadata.annotations.passthrough\\.io/assigned-at}")
        assert dated.returncode == 0 and dated.stdout.strip(), dated.stdout + dated.stderr
        if reason := kubelet.why_unavailable(cluster):
            support.cannot_run(request, "real-kubelet", reason, once_key="kubelet")
        # KubeVirt's controllers took the VM to a launcher pod whose compute container holds the GPU.
        record_file = _kubelet_dir(output) / "containers.jsonl"
        created = vm_scheduled(kubectl, record_file)
        resource = exclusive_resource_name(devcluster.FIRST_GPU)
        assert created["envs"][resource_env_name(resource)] == "0000:3b:00.0", created["envs"]
        vfio = {d["host_path"] for d in created["devices"]}
        assert "/dev/vfio/20" in vfio and "/dev/vfio/21" not in vfio, vfio
        # The printed `grep` shows that record.
        [grep] = [line.split("   #")[0].strip() for line in output.splitlines() if line.strip().startswith("grep ")]
        shown = subprocess.run(["bash", "-c", grep], capture_output=True, text=True, timeout=30).stdout
        assert f'"{resource_env_name(resource)}":"0000:3b:00.0"' in shown, shown
        # The README's refusal: the same VM in another namespace, before any instance or pod.
        assert kubectl("create", "namespace", "team-b").returncode == 0
        [vm] = devcluster.tenant_objects(dra=False)
        refused = kubectl("apply", "-f", "-", stdin=json.dumps({**vm, "metadata": {**vm["metadata"], "namespace": "team-b"}}))
        said = re.search(r'(admission webhook "[^"]+" denied the request:)\n(VirtualMachine team-b/vm1: passthrough.io/pci-9ace36ad)\.\.\.( is not [^\n]+)',
                         (REPO / "README.md").read_text())  # fmt: skip
        assert said and refused.returncode != 0, refused.stdout
        assert all(part in refused.stderr for part in said.groups()), (said.groups(), refused.stderr)
        assert "No resources found" in kubectl("get", "vmi,pods", "-n", "team-b").stderr
        attached = kubectl("get", "pci", "-n", devcluster.TENANT, devcluster.FIRST_GPU, "-o",
                           'jsonpath={.status.conditions[?(@.type=="Attached")].message}')  # fmt: skip
        assert f"VirtualMachine {devcluster.TENANT}/{devcluster.VM}" in attached.stdout, attached.stdout


def test_the_dev_cluster_in_dra_mode_takes_a_vm_naming_a_claim_to_a_launcher_pod_holding_the_gpu(
    request, cluster, kubevirt_programs, tmp_path
):
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
        record_file = _kubelet_dir(output) / "containers.jsonl"

        # The walkthrough it printed, as printed: the same first steps as without DRA, then the
        # tenant's claim and VM; the README's and the docs' the same way.
        commands = run_printed(output)
        assert commands[:7] == common_steps(workdir)
        assert f"kubectl apply -f {workdir / 'vm1.yaml'}" in commands, commands
        run_documented(output, commands, readme_and_page(dra=True), dra=True)
        gpu = devcluster.FIRST_GPU
        address = kubectl("get", "npci", gpu, "-o", "jsonpath={.status.attributes.pciAddress}").stdout
        assert address == "0000:3b:00.0"
        device = "pci-" + address.replace(":", "-").replace(".", "-")

        # virt-controller's launcher pod carries the claim; the scheduler allocated it team-a's GPU.
        created = vm_scheduled(kubectl, record_file)
        claim = json.loads(kubectl("get", "resourceclaim", "-n", devcluster.TENANT, "gpu", "-o", "json").stdout)
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == ("pci.passthrough.io", devcluster.GPU_NODE, device)
        assert [r["name"] for r in claim["status"]["reservedFor"]] == [created["pod"]], claim["status"]
        assert any(name.startswith("passthrough.io/vfio=") and name.endswith(device) for name in created["cdi_devices"]), created
