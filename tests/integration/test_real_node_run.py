"""`make run REALNODE=1`: the real node comes up with the chart helm-installed, `kubectl get pods -A`
shows its pods Running, and Ctrl-C stops everything, leaving nothing on the host."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e import image, support
from e2e.realnode.node import CGROUP_FS, CGROUP_PREFIX, why_unavailable

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]


def test_make_run_with_a_real_node_shows_the_chart_pods_running_and_stops_clean(request, tmp_path):
    if reason := why_unavailable() or image.why_unavailable():
        support.cannot_run(request, "real-node", reason, once_key="realnode")
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        # What `make run REALNODE=1` runs (the Makefile's $(TESTNS) is this test's own namespace).
        proc = subprocess.Popen(
            [sys.executable, "-m", "e2e.devcluster", "--real-node"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    try:
        deadline = time.monotonic() + 600
        while "Ctrl-C stops everything" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-5000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-5000:]
            time.sleep(1)
        text = log.read_text()
        listing = text[text.index("$ kubectl get pods -A") :]
        rows = [line.split() for line in listing.splitlines()[2:] if line.startswith("passthrough-system ")]
        components = sorted(re.match(r"passthrough-(agent|operator)-", row[1]).group(1) for row in rows)
        assert components == ["agent", "operator", "operator"], listing
        # The agent pod's containers: agent, binder, binder-standby; each ready.
        ready = {"agent": "3/3", "operator": "1/1"}
        assert all(row[3] == "Running" and row[2] == ready[row[1].split("-")[1]] for row in rows), listing
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert text.rstrip().endswith("stopped"), text[-3000:]  # "stopped; the host still has: ..." otherwise
    assert not list(CGROUP_FS.glob(f"*/{CGROUP_PREFIX}*"))
