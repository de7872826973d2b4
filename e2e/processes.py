"""The operator as its own process, started and stopped the way a cluster would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from e2e.cluster import free_ports


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
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.log.close()

    def output(self) -> str:
        return self.log_path.read_text()
