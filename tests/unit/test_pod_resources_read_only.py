"""The chart mounts the kubelet's PodResources directory read-only into the agent container: the
agent is a client of that socket, and connecting to a Unix socket writes nothing on the mount
(the kernel asks for write permission on the socket's inode, which a read-only mount does not
take away; a read-only mount refuses only writes to files, directories and links). Shown here on
this machine's kernel: the agent's own PodResources client through a read-only bind mount, made
in the private mount namespace the suite runs in (`unshare --mount`) and removed after."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from passthrough.deviceplugin.holder import Holder
from passthrough.deviceplugin.kubeletapi.podresources_v1 import api_pb2 as pr
from passthrough.deviceplugin.podresources import view
from tests.unit.test_deviceplugin_server import FakePodResources, container, serve_pod_resources

A10 = "nvidia.com/GA102GL_A10"


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"mount {' '.join(args)}: {done.stderr.strip()} (the suite runs as root under unshare --mount)"


async def test_the_agent_asks_podresources_through_a_read_only_mount() -> None:
    short = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))  # a socket's path takes 107 bytes at most
    kubelets = short / "kubelet"  # the kubelet's directory, as the host has it
    kubelets.mkdir()
    answer = pr.ListPodResourcesResponse(pod_resources=[
        pr.PodResources(name="virt-launcher-a", namespace="team-a", containers=[container("compute", (A10, ["0000:3b:00.0"]))])])  # fmt: skip
    server = await serve_pod_resources(kubelets / "kubelet.sock", FakePodResources(answer))
    mounted = short / "agent"  # the agent container's view of it
    mounted.mkdir()
    _mount("--bind", str(kubelets), str(mounted))
    try:
        _mount("-o", "remount,bind,ro", str(mounted))
        # Read-only it is: nothing can be created there.
        try:
            (mounted / "probe").touch()
        except OSError as exc:
            assert exc.errno == 30, exc  # EROFS
        else:
            raise AssertionError(f"{mounted} is writable: the remount did not take")
        seen = await view(mounted / "kubelet.sock")
        assert seen.holders == {"0000:3b:00.0": (Holder("team-a", "virt-launcher-a", A10),)}
    finally:
        subprocess.run(["umount", str(mounted)], check=False)
        await server.stop(0)
    assert not os.path.ismount(mounted)
    shutil.rmtree(short)
