"""`make run`'s main job: the local cluster comes up, `kubectl get npci` answers, Ctrl-C stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster


def test_the_dev_cluster_comes_up_answers_and_stops_without_leftovers(cluster, tmp_path):
    workdir = tmp_path / "devcluster"
    proc = subprocess.Popen(
        [sys.executable, "-m", "e2e.devcluster"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PASSTHROUGH_DEVCLUSTER_DIR": str(workdir), "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # a process group of its own, as a shell's foreground job
    )
    lines = []
    try:
        deadline = time.monotonic() + 120
        while not any("Ctrl-C stops everything" in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        output = "".join(lines)
        assert "NAME" in output and "gpu-node-1" in output and "storage-node-1" in output
        # The printed instructions work from another shell.
        got = subprocess.run([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={workdir / 'kubeconfig'}", "get", "npci"],
                             capture_output=True, text=True, timeout=30)
        assert got.returncode == 0 and len(got.stdout.strip().splitlines()) == 1 + 7, got.stdout + got.stderr
        kubevirt = subprocess.run([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={workdir / 'kubeconfig'}", "get", "kubevirt",
                                   "-n", "kubevirt", "kubevirt", "-o", "jsonpath={.spec.configuration.developerConfiguration.featureGates}"],
                                  capture_output=True, text=True, timeout=30)
        assert "HostDevices" in kubevirt.stdout
        # The admission webhook is live: a pod naming a device not assigned to its namespace is refused.
        gpu = next(line.split()[0] for line in got.stdout.splitlines() if "gpu-node-1" in line)
        pod = ('{"apiVersion":"v1","kind":"Pod","metadata":{"name":"thief"},"spec":{"containers":[{"name":"c","image":"x",'
               f'"resources":{{"limits":{{"passthrough.io/{gpu}":"1"}}}}}}]}}}}')
        deadline = time.monotonic() + 30
        while True:
            refused = subprocess.run([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={workdir / 'kubeconfig'}", "create",
                                      "-n", "default", "-f", "-"], input=pod, capture_output=True, text=True, timeout=30)
            if "denied the request" in refused.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # the operator's webhook may not listen yet
        assert refused.returncode != 0 and "denied the request" in refused.stderr, refused.stderr
        assert f"passthrough.io/{gpu}" in refused.stderr
        pids = [int(p) for p in subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()]
        assert pids  # etcd, the API server, the controller-manager, the operator and the agents
    finally:
        # Ctrl-C: the terminal sends SIGINT to the whole foreground process group.
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
