"""KubeVirt's own turning of a launcher's compute-container environment into the domain's host
devices (device-plugin mode): builds `e2e/kubevirt_hostdevice/`, a small Go program around
virt-launcher's address pools and its generic and GPU host-device builders (kubevirt.io/kubevirt
at the release its go.mod pins, unmodified, from the Go module proxy), and runs it with the
environment the kubelet gave a container and the VMI it runs. Which address each of the VM's
devices gets is KubeVirt's answer: the tests compare it with the device the agent allocated.

Those packages import libvirt's Go bindings, so the program is built with cgo against libvirt's
C library (Debian's libvirt-dev, installed first where missing, `gobuild.libvirt_dev`); it is
built and cached as every Go program of the suite's own is (`e2e/goprogram.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from e2e import gobuild
from e2e.goprogram import GoProgram

LABEL = "kubevirt-hostdevice"
LIBVIRT = gobuild.libvirt_dev(LABEL)
PROGRAM = GoProgram(module=Path(__file__).resolve().parent / "kubevirt_hostdevice", binary="kubevirthostdevice",
                    label=LABEL, what="KubeVirt's device-plugin host-device code", pinned="kubevirt.io/kubevirt",
                    cgo=True, prepare=LIBVIRT)  # fmt: skip


def ensure_binary() -> Path:
    """The program, built first when the cache lacks it (e2e.goprogram). Raises gobuild.BuildError."""
    LIBVIRT()  # it loads libvirt's shared library when it runs, even where the cache held it already
    return PROGRAM.ensure_binary()


def hostdev(xml: str) -> dict[str, str]:
    """A <hostdev> element's parts a test compares: alias (as libvirt sees it, KubeVirt's `ua-`
    prefix included), type, managed, and a PCI source's address as domain:bus:slot.function."""
    element = ElementTree.fromstring(xml)
    alias = element.find("alias")
    source = element.find("source/address")
    address = ""
    if source is not None and source.get("bus"):
        parts = [source.get(key, "").removeprefix("0x") for key in ("domain", "bus", "slot", "function")]
        address = "{}:{}:{}.{}".format(*parts)
    return {"alias": "" if alias is None else alias.get("name", ""), "type": element.get("type", ""),
            "managed": element.get("managed", ""), "address": address, "xml": xml}  # fmt: skip


def host_devices(binary: Path, env: dict[str, str], vmi: dict[str, Any]) -> dict[str, Any]:
    """What virt-launcher, its environment exactly `env`, makes of `vmi`'s host devices and of its
    GPUs: {"hostDevices": made, "gpus": made}, each {"devices": [hostdev(...)], "error"?} (an
    error: the domain would not be made)."""
    proc = subprocess.run([str(binary)], input=json.dumps(vmi), env=env, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    answer: dict[str, Any] = {}
    for kind, made in json.loads(proc.stdout).items():
        answer[kind] = {"devices": [hostdev(text) for text in made["xml"]]}
        if "error" in made:
            answer[kind]["error"] = made["error"]
    return answer


if __name__ == "__main__":
    sys.exit(PROGRAM.main())
