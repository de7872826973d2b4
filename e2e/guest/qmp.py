"""A small synchronous QMP client (QEMU's JSON monitor over a unix socket), standard library only.

The host talks to the rig's QEMU with it (device_del, pcie_aer_inject_error), and the
command server imports it in the guest to ask a nested QEMU (the virt-launcher stand-in)
`query-pci`.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any


class QMPError(RuntimeError):
    """QEMU answered a command with an error (its class and description are in the message)."""


class QMP:
    def __init__(self, path: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:  # the socket appears once QEMU has parsed its command line
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.settimeout(timeout)
                self._sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self._sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self._file = self._sock.makefile("rwb")
        self.events: list[dict[str, Any]] = []
        self.greeting = self._read()
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        line = self._file.readline()
        if not line:
            raise ConnectionError("QEMU closed its monitor")
        return json.loads(line)

    def execute(self, command: str, **arguments: Any) -> Any:
        """Run one command and return its `return` value; events that arrive meanwhile are kept."""
        message: dict[str, Any] = {"execute": command}
        if arguments:
            message["arguments"] = {key.replace("_", "-"): value for key, value in arguments.items()}
        self._file.write(json.dumps(message).encode() + b"\n")
        self._file.flush()
        while True:
            reply = self._read()
            if "event" in reply:
                self.events.append(reply)
            elif "error" in reply:
                raise QMPError(f"{command}: {reply['error'].get('class')}: {reply['error'].get('desc')}")
            elif "return" in reply:
                return reply["return"]

    def hmp(self, command_line: str) -> str:
        """A human-monitor command (pcie_aer_inject_error has no QMP form)."""
        return self.execute("human-monitor-command", command_line=command_line)

    def close(self) -> None:
        for closer in (self._file.close, self._sock.close):
            try:
                closer()
            except OSError:
                pass

    def __enter__(self) -> QMP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pci_functions(query_pci: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every function of a `query-pci` answer, bridges' buses included, flattened."""
    found: list[dict[str, Any]] = []

    def walk(devices: list[dict[str, Any]]) -> None:
        for device in devices:
            found.append(device)
            walk(device.get("pci_bridge", {}).get("devices", []))

    for bus in query_pci:
        walk(bus.get("devices", []))
    return found
