"""The command server that runs in the guest: one JSON request a connection, one JSON answer.

Started once per boot by stage 2 (so Python's start, about 12x slower under TCG, is paid
once), reached from the host through QEMU's hostfwd on 127.0.0.1. Standard library only.
Operations: `ping`, `run` (a command to completion), `python` (code exec'd in this process,
modules imported once stay imported, `state` is kept between requests; it sets `result`), `spawn` / `poll` / `signal` /
`wait` (background processes, output to a log file), and `qmp` (a command to a QEMU
monitor socket in the guest). The host side is e2e/guest/machine.py's Guest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

_children: dict[int, subprocess.Popen] = {}
_lock = threading.Lock()


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(extra or {})}


def op_ping(request: dict[str, Any]) -> dict[str, Any]:
    return {"uname": os.uname().release, "uptime": float(open("/proc/uptime").read().split()[0]), "pid": os.getpid()}


def op_run(request: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    proc = subprocess.Popen(
        request["argv"],
        stdin=subprocess.PIPE if request.get("input") is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="backslashreplace",
        env=_env(request.get("env")),
        cwd=request.get("cwd"),
    )
    try:
        stdout, stderr = proc.communicate(request.get("input"), timeout=request.get("timeout"))
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            stdout, stderr = proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            # Killed but still there: blocked in the kernel (an unbind whose device is held
            # waits uninterruptibly). Waiting for it would hang this request too.
            stdout, stderr = "", ""
        return {"timeout": True, "stuck": proc.poll() is None, "pid": proc.pid, "stdout": stdout, "stderr": stderr,
                "seconds": time.monotonic() - started}  # fmt: skip
    return {"rc": proc.returncode, "stdout": stdout, "stderr": stderr, "seconds": time.monotonic() - started}


STATE: dict[str, Any] = {}  # what `python` code keeps between requests (a kubelet harness, say)


def op_python(request: dict[str, Any]) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__guest__", "args": request.get("args", {}), "state": STATE}
    started = time.monotonic()
    exec(compile(request["code"], "<guest>", "exec"), namespace)
    return {"result": namespace.get("result"), "seconds": time.monotonic() - started}


def op_spawn(request: dict[str, Any]) -> dict[str, Any]:
    with open(request["log"], "ab", buffering=0) as log:
        proc = subprocess.Popen(
            request["argv"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(request.get("env")),
            cwd=request.get("cwd"),
            start_new_session=True,  # a signal to the group reaches the helpers it starts
        )
    with _lock:
        _children[proc.pid] = proc
    return {"pid": proc.pid}


def _child(request: dict[str, Any]) -> subprocess.Popen:
    with _lock:
        return _children[request["pid"]]


def op_poll(request: dict[str, Any]) -> dict[str, Any]:
    return {"rc": _child(request).poll()}


def op_signal(request: dict[str, Any]) -> dict[str, Any]:
    proc = _child(request)
    if proc.poll() is None:
        os.killpg(proc.pid, request.get("signum", signal.SIGTERM))
    return {"rc": proc.poll()}


def op_wait(request: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"rc": _child(request).wait(request.get("timeout"))}
    except subprocess.TimeoutExpired:
        return {"rc": None}


def op_qmp(request: dict[str, Any]) -> dict[str, Any]:
    from e2e.guest.qmp import QMP

    with QMP(request["path"], timeout=request.get("timeout", 30.0)) as monitor:
        return {"result": monitor.execute(request["command"], **request.get("arguments", {}))}


OPS = {name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline()
        if not line:
            return
        try:
            request = json.loads(line)
            answer = OPS[request["op"]](request)
        except Exception:  # the host gets the traceback: it is the only place anyone reads it
            answer = {"error": traceback.format_exc()}
        self.wfile.write(json.dumps(answer, default=str).encode() + b"\n")


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with Server(("0.0.0.0", args.port), Handler) as server:
        print(f"listening on {args.port} ({time.monotonic():.1f}s after the clock's start)", flush=True)
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
