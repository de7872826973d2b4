"""The owners' readers of what our DRA driver leaves on a node: builds `e2e/dra_formats/`, a small
Go program around the CDI library (`tags.cncf.io/container-device-interface`, the release the
project's containerd pins: its cache loads a spec directory, resolves device names and applies
their edits to an OCI spec, as containerd and CRI-O do) and Kubernetes' device-metadata decoder
(`k8s.io/dynamic-resource-allocation/devicemetadata`, the control plane's release: each object
of a metadata stream decoded and validated, and the stream read as a consumer reads it). The
tests compare its answer with what the driver meant, so the formats' owners judge the files.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from e2e.goprogram import GoProgram

PROGRAM = GoProgram(module=Path(__file__).resolve().parent / "dra_formats", binary="draformats", label="dra-formats",
                    what="the CDI library's and Kubernetes' device-metadata readers",
                    pinned="k8s.io/dynamic-resource-allocation")  # fmt: skip


def read(binary: Path, cdi_dir: Path, cdi_devices: list[str], metadata_files: list[Path] = (),
         dev_nodes: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """{"cdi": {"devices", "specErrors", "unresolved", "error"?, "linux", "mounts", "env"},
    "metadata": [{"path", "objects": [{"apiVersion", "error"?, "invalid"?, "decoded"}], "readAs", "read", "error"?}]}.

    The CDI library takes a device node's type and numbers from the node itself, as a runtime
    does on the node: `dev_nodes` (path under /dev -> (major, minor)) are the nodes the program
    finds, made as character devices in a /dev of its own (a tmpfs in a mount namespace that
    ends with it; the host's /dev is never written). Without it the program sees the host's /dev."""
    command = [str(binary), str(cdi_dir), ",".join(cdi_devices), *map(str, metadata_files)]
    if dev_nodes is not None:
        script = ["mount -t tmpfs -o mode=0755 dra-formats-dev /dev"]
        for path, (major, minor) in sorted(dev_nodes.items()):
            if not path.startswith("/dev/"):
                raise ValueError(f"{path} is not under /dev")
            script += [f"mkdir -p {shlex.quote(str(Path(path).parent))}", f"mknod -m 0666 {shlex.quote(path)} c {major} {minor}"]
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-ec", " && ".join([*script, 'exec "$@"']), "sh", *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    sys.exit(PROGRAM.main())
