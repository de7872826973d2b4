"""KubeVirt's own reading of our DRA device-metadata files: builds `e2e/kubevirt_metadata/`, a
small Go program around virt-launcher's DRA host-device code (kubevirt.io/kubevirt at the release
its go.mod pins, unmodified, from the Go module proxy), and runs it on a directory of metadata
files and a VMI. What it prints is what virt-launcher would put in the domain: the tests compare
that with the addresses our driver meant, so KubeVirt, not our own reader, judges the files.

Built and cached as every Go program of the suite's own is (`e2e/goprogram.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from e2e.goprogram import GoProgram

MODULE = Path(__file__).resolve().parent / "kubevirt_metadata"
BINARY = "kubevirtmetadata"
CONTAINER_BASE = "/var/run/kubernetes.io/dra-device-attributes"  # what the program's base dir stands for


PROGRAM = GoProgram(module=MODULE, binary=BINARY, label="kubevirt-metadata",
                    what="KubeVirt's DRA metadata reader", pinned="kubevirt.io/kubevirt")  # fmt: skip


def kubevirt_version() -> str:
    return PROGRAM.version()


def ensure_binary() -> Path:
    """The program, built first when the cache lacks it (e2e.goprogram). Raises build.BuildError."""
    return PROGRAM.ensure_binary()


def local_path(base: Path, container_path: str) -> Path:
    """Where a file the launcher sees at `container_path` (under CONTAINER_BASE) lies under `base`."""
    relative = Path(container_path).relative_to(CONTAINER_BASE)
    return Path(base) / relative


def read_as_kubevirt(binary: Path, base: Path, vmi: dict[str, Any]) -> dict[str, Any]:
    """What virt-launcher makes of the metadata files under `base` for `vmi`: for its GPUs and its
    host devices, {"hostDevices": [{"alias", "type", "managed", "address", "xml"}], "error"?}."""
    vmi_file = Path(base) / "vmi.json"
    vmi_file.write_text(json.dumps(vmi))
    proc = subprocess.run([str(binary), str(base), str(vmi_file)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    sys.exit(PROGRAM.main())
