"""The operator and the node agent as their own processes, started and stopped the way a cluster would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from e2e.cluster import _die_with_parent, free_ports


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    """Signal a child and wait for it; SIGKILL what has not exited in `timeout`. Its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class OperatorProcess:
    """`passthrough operator` as its own process, the way it runs in a cluster."""

    def __init__(self, cluster, log: Path, *args: str) -> None:
        self.cluster, self.log_path, self.args = cluster, log, args
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> None:
        port = free_ports(1)[0]
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "passthrough", "operator", f"--kubeconfig={self.cluster.kubeconfig}",
             f"--liveness=http://127.0.0.1:{port}/healthz", *self.args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"operator not live after {timeout}s:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc:
            stop(self.proc, sig)
            self.log.close()

    def output(self) -> str:
        return self.log_path.read_text()


class AgentProcess:
    """`passthrough agent` as its own process over a fixture host, the way a DaemonSet pod runs it.

    With `kubelet` (an `e2e.kubelet.KubeletNode`), its device plugins register with that
    kubelet and it asks that kubelet's PodResources API; without, both point into the
    fixture tree, where no kubelet ever answers.
    """

    def __init__(self, cluster, log: Path, node_name: str, host, pci_ids: Path, *args: str, kubelet=None) -> None:
        plugin_dir = kubelet.device_plugin_dir if kubelet else host.root / "device-plugins"
        pod_resources = kubelet.pod_resources_socket if kubelet else host.root / "pod-resources.sock"
        self.log_path = log
        self.args = [
            sys.executable, "-m", "passthrough", "agent", f"--node-name={node_name}",
            f"--kubeconfig={cluster.kubeconfig}", f"--sysfs-root={host.sysfs}", f"--proc-root={host.proc}",
            f"--dev-root={host.root / 'dev'}", f"--pci-ids={pci_ids}", f"--device-plugin-dir={plugin_dir}",
            f"--pod-resources-socket={pod_resources}", "--no-hotplug", *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return stop(self.proc, sig) if self.proc else None

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""
