"""The real kubelet and kube-scheduler (e2e/kubelet.py) against the local control plane.

The kubelet runs with a fake CRI runtime in a private mount namespace; these tests pin what
the device-plugin tests rely on: the node registers Ready, the scheduler places pods on it,
the runtime records what the kubelet asked to create, a kubelet restart wipes the
device-plugin directory and comes back, and nothing is left on the host afterwards.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from e2e import kubelet as kl

pytestmark = pytest.mark.cluster


def _wait(predicate, timeout=60.0, interval=0.2, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def _kernel_values() -> dict[str, str]:
    return {key: Path("/proc/sys", key).read_text().strip() for key in kl.KERNEL_DEFAULTS}


def _host_mounts() -> list[str]:
    return [line for line in Path("/proc/self/mounts").read_text().splitlines() if re.search(r" (/var|/proc/sys/\S*) ", line)]


@pytest.fixture(scope="module")
def host_before():
    return {"kernel": _kernel_values(), "var_lib_kubelet": Path("/var/lib/kubelet").exists()}


@pytest.fixture(scope="module")
def node(host_before, module_kubelet_nodes):
    return module_kubelet_nodes()


@pytest.fixture(scope="module")
def ns(cluster):
    name = f"kl-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _pod(cluster, ns: str, name: str) -> dict | None:
    result = cluster.kubectl("-n", ns, "get", "pod", name, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _create_pod(cluster, ns: str, manifest: dict) -> None:
    # The ServiceAccount admission refuses pods until the namespace's `default` account exists.
    def created():
        result = cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(manifest), check=False)
        assert result.returncode == 0 or "serviceaccount" in result.stderr, result.stderr
        return result.returncode == 0

    _wait(created, timeout=30, what="pod creation")


def test_node_registers_ready(cluster, node):
    got = node.node()
    ready = next(c for c in got["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    assert got["metadata"]["labels"][kl.NODE_LABEL] == node.node_name
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert got["status"]["nodeInfo"]["kubeletVersion"] == version
    assert {"type": "InternalIP", "address": node.ip} in got["status"]["addresses"]
    assert not got["spec"].get("taints"), got["spec"].get("taints")
    # What a device plugin outside the kubelet's namespace uses.
    assert node.kubelet_socket.is_socket()
    assert node.pod_resources_socket.is_socket()
    assert len(str(node.device_plugin_dir / ("x" * 40))) < 108


def test_scheduler_places_a_pod_and_the_runtime_records_its_container(cluster, kube_scheduler, node, ns):
    name = "sleeper"
    _create_pod(cluster, ns, {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {kl.NODE_LABEL: node.node_name},  # no nodeName: the scheduler's job
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "main",
                "image": "registry.invalid/sleeper:1",  # the fake runtime pulls nothing
                "env": [{"name": "HARNESS_GREETING", "value": "hello-kubelet"}],
            }],
        },
    })
    pod = _wait(lambda: (p := _pod(cluster, ns, name)) and p["status"].get("phase") == "Running" and p,
                timeout=60, what="pod Running")
    assert pod["spec"]["nodeName"] == node.node_name
    records = [r for r in node.created_containers() if r["pod"] == name and r["namespace"] == ns]
    assert len(records) == 1, node.created_containers()
    record = records[0]
    assert record["container"] == "main"
    assert record["pod_uid"] == pod["metadata"]["uid"]
    assert record["envs"]["HARNESS_GREETING"] == "hello-kubelet"
    assert record["image"] == "registry.invalid/sleeper:1"


def test_restart_kubelet_wipes_plugin_sockets_and_comes_back(cluster, node, ns):
    stale = node.device_plugin_dir / "stale-plugin.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))
    try:
        before = node.kubelet_socket.stat().st_ctime_ns
        # From a thread that then ends (as asyncio.to_thread may): the kubelet must outlive it.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
            worker.submit(node.restart_kubelet).result()
        time.sleep(0.5)
        assert node.kubelet_alive(), node.kubelet_log.read_text()[-3000:]
        assert not stale.exists(), "the kubelet leaves other sockets in its device-plugin directory"
        # restart_kubelet() returns once the new kubelet serves its Registration socket.
        assert node.kubelet_socket.is_socket() and node.kubelet_socket.stat().st_ctime_ns > before
        ready = next(c for c in node.node()["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True"
    finally:
        listener.close()
    # The pod placed before is still running, and no container was created twice.
    pod = _pod(cluster, ns, "sleeper")
    if pod is not None:
        assert pod["status"]["phase"] == "Running"


def test_a_deleted_pod_is_cleaned_up_by_the_kubelet_and_the_workdir_stays(cluster, node, ns):
    pod = _pod(cluster, ns, "sleeper")
    assert pod is not None
    log_dir = node.var_dir / "log" / "pods" / f"{ns}_sleeper_{pod['metadata']['uid']}"
    # The runtime reports a log path (and makes the file) like a real one does.
    assert list(log_dir.glob("main/*.log")), list(log_dir.rglob("*"))
    cluster.kubectl("-n", ns, "delete", "pod", "sleeper", "--timeout=60s")
    # The kubelet removed the container, deleting its log files, and nothing else.
    _wait(lambda: not list(log_dir.glob("main/*.log")), timeout=30, what="the container's removal")
    assert node.containers_file.is_file() and node.cri_socket.is_socket()
    assert any(r["pod"] == "sleeper" for r in node.created_containers())


def test_stop_leaves_nothing_behind(cluster, host_before, kubelet_nodes):
    extra = kubelet_nodes()
    kubelet_pid = extra._kubelet.popen.pid
    runtime_pid = extra._runtime.popen.pid
    workdir = extra.workdir
    extra.stop()
    kubelet_nodes.started.remove(extra)
    for pid in (kubelet_pid, runtime_pid):
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} left behind"
    leftover = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    assert leftover == [], leftover
    assert not workdir.exists()
    assert extra.node() is None
    assert _host_mounts() == []
    assert _kernel_values() == host_before["kernel"]
    assert Path("/var/lib/kubelet").exists() == host_before["var_lib_kubelet"]
    assert not any(str(workdir) in line for line in Path("/proc/self/mounts").read_text().splitlines())
