"""The agent as the chart's DaemonSet pod under containerd, runc and the kubelet, on a real kernel.

One guest for the module (its own boot, with room for containerd and the pods): the node is
`e2e/guest/realnode.py`'s (containerd 2.x, runc, the CNI bridge, kube-proxy and the real kubelet
in the guest, cgroup v2), joined to the session's control plane; the operator runs on the host.
The agent's pod is the chart's: `helm template`'s DaemonSet pod template (with a short
`--write-deadline` through `agent.extraArgs`), made into a pod on this node as the DaemonSet
controller makes one, from the image `make image` builds, imported into the guest's containerd;
its service account, roles and admission policies are the release's. A launcher-shaped pod asks
for the device by its resource, and the runtime creates `/dev/vfio/<group>` in its container
from what the agent's `Allocate` returned.
"""

from __future__ import annotations

import copy
import json
import time
import uuid

import pytest

from e2e import chart, image, oci
from e2e.guest.kernel import DEFAULT_SERIES, RigUnavailable, kernel
from e2e.guest.machine import AUDIO, DISPLAY, E1000E, EDU, address, boot
from e2e.guest.node import assign, condition, drivers, ready, wait, wait_drivers
from e2e.guest.realnode import GuestRealNode
from e2e.guest.vmm import NestedVmm
from e2e.realnode import build as nodebuild
from e2e.realnode import images
from tests.realkernel.conftest import WRITE_DEADLINE, _absent
from tests.realkernel.test_busy import binder_states, hold_sound_device, served

# The module's first test also boots the guest and starts the node (about 4 min here).
pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(1200)]

DUAL = [address("dualnic", 0), address("dualnic", 1)]
DISPLAY_FN, AUDIO_FN, EDU_FN = address("gpu", 0), address("gpu", 1), address("edu")
GUEST_MEMORY_MIB = 3072  # containerd's copy of the image and its unpacked layers are in the guest's RAM
TIMINGS: dict[str, float] = {}
# The standby binder container's processes (its command names its own socket; its children share
# it): pid -> state and resident memory.
_STANDBY = """
import os
result = {}
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        cmdline = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')
        status = dict(line.split(':', 1) for line in open(f'/proc/{pid}/status').read().splitlines() if ':' in line)
    except OSError:
        continue
    if b'--listen=/run/passthrough-binder/standby.sock' in cmdline:
        result[pid] = {'state': status['State'].split()[0], 'rss_kib': int(status.get('VmRSS', '0 kB').split()[0])}
"""
# The launcher's process: opens the group node the runtime made and asks VFIO about it.
_LAUNCHER = """
import fcntl, glob, os, struct, time
nodes = sorted(p for p in glob.glob('/dev/vfio/*') if os.path.basename(p).isdigit())
fd = os.open(nodes[0], os.O_RDWR)
status = bytearray(struct.pack('II', 8, 0))
fcntl.ioctl(fd, (ord(';') << 8) | 103, status)  # VFIO_GROUP_GET_STATUS
print('opened', nodes[0], 'viable' if struct.unpack('II', status)[1] & 1 else 'not viable', flush=True)
time.sleep(10**9)
"""


@pytest.fixture(scope="module")
def parts(request):
    """What the node needs from the host: runc, the node's programs, the project's image."""
    try:
        if reason := image.why_unavailable():
            raise RuntimeError(reason)
        return oci.ensure_runc(), nodebuild.ensure_binaries()
    except (RuntimeError, OSError) as exc:
        _absent(request, f"the guest's real node cannot be built: {exc}")


@pytest.fixture(scope="module")
def podnode(request, tmp_path_factory, cluster, operator, parts):
    runc, node_bin = parts
    started = time.monotonic()
    try:
        guest = boot(kernel(DEFAULT_SERIES), tmp_path_factory.mktemp("guest-podnode"), memory_mib=GUEST_MEMORY_MIB)
    except RigUnavailable as exc:
        _absent(request, str(exc))
    node = None
    try:
        TIMINGS["guest boot"] = guest.boot_seconds
        archives = [
            images.pause_archive(node_bin / "pause", guest.share / "images" / "pause.tar"),
            images.project_archive(guest.share / "images" / "project.tar"),
        ]
        node = GuestRealNode(guest, cluster, f"rk-pod-{uuid.uuid4().hex[:6]}", node_bin, runc)
        node.start(archives)
        TIMINGS.update(node.timings)
        TIMINGS["boot to node Ready"] = time.monotonic() - started
        yield node
    finally:
        try:
            if node is not None:
                node.stop()
        finally:
            guest.stop()
        print("\nguest real node: " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMINGS.items()))


class Agent:
    """The chart's agent pods on the node: `create()` makes one from the DaemonSet's template."""

    def __init__(self, node: GuestRealNode, namespace: str, template: dict) -> None:
        self.node, self.namespace, self.template = node, namespace, template
        self.name = ""

    def create(self) -> str:
        self.name = f"agent-{uuid.uuid4().hex[:5]}"
        spec = copy.deepcopy(self.template["spec"])
        spec["nodeName"] = self.node.name  # as the DaemonSet controller places its pods
        pod = {"apiVersion": "v1", "kind": "Pod", "spec": spec,
               "metadata": {"name": self.name, "namespace": self.namespace, "labels": self.template["metadata"]["labels"]}}  # fmt: skip
        self.node.cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
        return self.name

    def running(self) -> bool:
        statuses = self.node.pod(self.namespace, self.name).get("status", {}).get("containerStatuses") or []
        return len(statuses) == len(self.template["spec"]["containers"]) and all(
            s.get("ready") or "running" in s.get("state", {}) for s in statuses)  # fmt: skip

    def logs(self) -> str:
        return "".join(f"--- {c}:\n{self.node.pod_logs(self.namespace, self.name, c)[-4000:]}" for c in ("agent", "binder", "binder-standby"))

    def delete(self) -> None:
        self.node.cluster.kubectl("delete", "pod", "-n", self.namespace, self.name, "--wait=true", timeout=180)


@pytest.fixture(scope="module")
def agent(podnode, cluster, tmp_path_factory):
    namespace = f"rk-pod-system-{uuid.uuid4().hex[:6]}"
    release = "rkpod"
    objects = chart.template(chart.helm(tmp_path_factory.mktemp("helm-home")), release, namespace,
                             f"--set=agent.extraArgs={{--write-deadline={WRITE_DEADLINE:g}s}}")  # fmt: skip
    template = oci.pod_template(objects, "DaemonSet", "-agent")
    [fullname] = [o["metadata"]["name"].removesuffix("-agent") for o in objects if o["kind"] == "DaemonSet"]
    cluster.kubectl("create", "namespace", namespace)
    podnode.publish_root_ca(namespace)
    try:
        with chart.installed(cluster, chart.access(objects)):
            chart.wait_for_agent_policies(cluster, namespace, fullname, podnode.name)
            pods = Agent(podnode, namespace, template)
            started = time.monotonic()
            pods.create()
            wait(pods.running, 600, "the agent pod Running")
            TIMINGS["agent pod Running"] = time.monotonic() - started
            wait(lambda: set(DUAL) | {EDU_FN, DISPLAY_FN} <= set(podnode.devices()), 300, "the agent pod's first report")
            TIMINGS["agent pod first report"] = time.monotonic() - started
            yield pods
            logs = pods.logs()
            assert "Traceback" not in logs, logs
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def launcher(agent: Agent, namespace: str, resource: str) -> str:
    """A launcher-shaped pod (uid 0, the project's image) asking for one device of `resource`."""
    agent.node.publish_root_ca(namespace)
    name = f"launcher-{uuid.uuid4().hex[:5]}"
    image_ = oci.container(agent.template, "agent")["image"]
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        "spec": {"nodeName": agent.node.name, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "compute", "image": image_, "imagePullPolicy": "IfNotPresent",
            "command": ["python3", "-c", _LAUNCHER], "securityContext": {"runAsUser": 0},
            "resources": {"limits": {resource: "1"}, "requests": {resource: "1"}},
        }]},
    }  # fmt: skip
    agent.node.cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
    return name


def opened(agent: Agent, namespace: str, pod: str) -> str:
    """The launcher's line once its process has opened the group node ('' before)."""
    phase = agent.node.pod(namespace, pod).get("status", {}).get("phase")
    if phase in ("Failed", "Succeeded"):
        raise AssertionError(f"the launcher pod {phase}: {agent.node.pod_logs(namespace, pod, 'compute')}\n{agent.node.pod(namespace, pod)['status']}")
    lines = agent.node.pod_logs(namespace, pod, "compute").splitlines()  # CRI's: time, stream, tag, text
    return next((line.split(" ", 3)[3] for line in lines if line.count(" ") >= 3 and " opened " in f" {line} "), "")


def resource_of(node: GuestRealNode, address_: str) -> str:
    """The device's own resource, once the kubelet counts it in the node's allocatable."""

    def offered() -> str:
        resource = node.devices()[address_]["status"].get("resourceName")
        found = node.cluster.kubectl("get", "node", node.name, "-o", "json")
        allocatable = json.loads(found.stdout).get("status", {}).get("allocatable", {})
        return resource if resource and allocatable.get(resource) == "1" else ""

    return wait(offered, 180, f"{address_}'s resource in the node's allocatable")


def test_the_agent_pod_binds_a_group_and_a_launcher_pod_opens_it(podnode, agent, tenant):
    assigned = time.monotonic()
    assign(podnode, DUAL[0], tenant)
    wait_drivers(podnode.guest, dict.fromkeys(DUAL, "vfio-pci"), timeout=240)
    wait(lambda: served(podnode, DUAL[0]), 240, "the dual NIC handed out and Ready")
    TIMINGS["bind to Ready"] = time.monotonic() - assigned
    started = time.monotonic()
    pod = launcher(agent, tenant, resource_of(podnode, DUAL[0]))
    line = wait(lambda: opened(agent, tenant, pod), 300, "the launcher's process to open the group")
    TIMINGS["launcher pod opened its group"] = time.monotonic() - started
    group = podnode.guest.sh(f"basename $(readlink /sys/bus/pci/devices/{DUAL[0]}/iommu_group)").stdout.strip()
    assert line.split()[1:] == [f"/dev/vfio/{group}", "viable"], line
    podnode.cluster.kubectl("delete", "pod", "-n", tenant, pod, "--wait=true", timeout=120)
    assign(podnode, DUAL[0], "")
    wait_drivers(podnode.guest, dict.fromkeys(DUAL, E1000E.driver), timeout=240)


def test_a_group_held_by_a_process_the_kubelet_does_not_list_stays_bound(podnode, agent, tenant):
    guest = podnode.guest
    assign(podnode, DUAL[0], tenant)
    wait_drivers(guest, dict.fromkeys(DUAL, "vfio-pci"), timeout=240)
    wait(lambda: served(podnode, DUAL[0]), 240, "the dual NIC handed out and Ready")
    with NestedVmm(guest, [DUAL[0]], name="vmm-podnode") as vmm:
        unassigned = time.monotonic()
        assign(podnode, DUAL[0], "")
        found = wait(lambda: ready(podnode, DUAL[0], "HeldByProcess"), 180, "Ready=False/HeldByProcess")
        TIMINGS["held: HeldByProcess"] = time.monotonic() - unassigned
        assert drivers(guest, DUAL) == dict.fromkeys(DUAL, "vfio-pci"), f"a held group was unbound: {found}"
        assert DUAL[0] in vmm.host_devices(), "the nested VM lost its device"
        exited = time.monotonic()
    wait_drivers(guest, dict.fromkeys(DUAL, E1000E.driver), timeout=180)
    TIMINGS["held: given back after the holder exited"] = time.monotonic() - exited


def test_the_agent_pod_serves_other_devices_while_a_write_is_blocked(podnode, agent, tenant):
    guest = podnode.guest
    holder = hold_sound_device(guest, AUDIO_FN)
    try:
        started = time.monotonic()
        assign(podnode, DISPLAY_FN, tenant)
        blocked = wait(lambda: ready(podnode, DISPLAY_FN, "WriteBlocked"), 240, "Ready=False/WriteBlocked")
        assert f"has not returned after {WRITE_DEADLINE:g} s" in blocked["message"], blocked
        TIMINGS["blocked: WriteBlocked"] = time.monotonic() - started
        other = time.monotonic()
        assign(podnode, EDU_FN, tenant)
        wait_drivers(guest, {EDU_FN: "vfio-pci"}, timeout=240)
        wait(lambda: served(podnode, EDU_FN), 240, "edu handed out and Ready while the write is blocked")
        TIMINGS["blocked: another device Ready"] = time.monotonic() - other
        assert ready(podnode, DISPLAY_FN, "WriteBlocked"), "still blocked while the holder holds on"
    finally:
        holder.stop()
    wait_drivers(guest, {DISPLAY_FN: "vfio-pci", AUDIO_FN: "vfio-pci"}, timeout=180)
    wait(lambda: served(podnode, DISPLAY_FN), 240, "the display Ready once the write returned")
    assign(podnode, DISPLAY_FN, "")
    assign(podnode, EDU_FN, "")
    wait_drivers(guest, {DISPLAY_FN: DISPLAY.driver, AUDIO_FN: AUDIO.driver, EDU_FN: EDU.driver}, timeout=240)


def container(agent: Agent, name: str) -> dict:
    """A container's status in the agent's pod."""
    statuses = agent.node.pod(agent.namespace, agent.name).get("status", {}).get("containerStatuses") or []
    return next((s for s in statuses if s["name"] == name), {})


def _stopping(node: GuestRealNode, agent: Agent, before: dict) -> str:
    """Where a container's stop stands: its status, the runtime's tasks, the processes, the logs."""
    cid = before["containerID"].split("://", 1)[1]
    logs = "\n".join(f"--- {name}:\n" + "\n".join(line for line in process.output(4000).splitlines() if cid[:12] in line or "binder" in line)[-3000:]
                     for name, process in node.processes.items() if name in ("kubelet", "containerd"))  # fmt: skip
    tasks = node.ctr("tasks", "ls", check=False).stdout
    processes = node.guest.sh("ps -eo pid,ppid,stat,wchan:32,args | grep -v ' \\['", check=False).stdout[-3000:]
    return f"--- status: {json.dumps(container(agent, 'binder'))}\n--- tasks:\n{tasks}\n--- processes:\n{processes}\n{logs}"


def standby(guest) -> dict[str, dict]:
    """The standby binder container's processes: its listener, and a child per agent connection."""
    return guest.python(_STANDBY)


def test_a_binder_container_killed_behind_a_blocked_write_leaves_the_binds_to_the_standby_until_it_is_back(
    podnode, agent, tenant
):
    """The kernel does not end a process blocked in this write (snd_hda_intel's remove waits, not
    killably, for the sound device's users), and the runtime keeps a container until every process
    of it has ended. So the binder's container, killed (a crash, an OOM kill) while a child of it
    is blocked, stays until the holder lets go, and then comes back by itself: no node reboot. A
    shared process namespace does not change that (its cgroup still holds the child). Meanwhile
    the pod's standby binder container binds a new assignment, and the agent serves what is bound."""
    guest = podnode.guest
    idle = standby(guest)
    assert len(idle) == 1, f"the standby binder is more than its listener before anyone asked it: {idle}"
    [rss] = [p["rss_kib"] for p in idle.values()]
    print(f"\nthe standby binder container, idle: its one process's RSS {rss / 1024:.1f} MiB")
    assign(podnode, EDU_FN, tenant)
    wait_drivers(guest, {EDU_FN: "vfio-pci"}, timeout=240)
    wait(lambda: served(podnode, EDU_FN), 240, "edu handed out and Ready")
    holder = hold_sound_device(guest, AUDIO_FN)
    try:
        assign(podnode, DISPLAY_FN, tenant)
        wait(lambda: ready(podnode, DISPLAY_FN, "WriteBlocked"), 240, "Ready=False/WriteBlocked")
        before = container(agent, "binder")
        assert "D" in binder_states(guest).values(), "no binder process blocked in the kernel"
        assert len(standby(guest)) == 1, "the agent asked the standby while the first binder container answered"
        podnode.ctr("tasks", "kill", "--signal", "SIGKILL", before["containerID"].split("://", 1)[1])
        # The first binder is gone (a new job finds nobody listening there): the standby binds.
        waiting = time.monotonic()
        assign(podnode, DUAL[0], tenant)
        try:
            wait_drivers(guest, dict.fromkeys(DUAL, "vfio-pci"), timeout=240)
            wait(lambda: served(podnode, DUAL[0]), 240, "the new assignment handed out and Ready through the standby")
        except AssertionError as exc:
            found = {a: condition(podnode.devices()[a], "Ready") for a in (DUAL[0], DISPLAY_FN)}
            raise AssertionError(f"{exc}: {found}\n{_stopping(podnode, agent, before)}\n{agent.logs()}") from None
        TIMINGS["binder killed behind a blocked write: a new assignment Ready through the standby"] = time.monotonic() - waiting
        assert len(standby(guest)) >= 2, "the standby has no child for the agent's connection: who bound it?"
        edu = podnode.devices()[EDU_FN]
        assert served(podnode, EDU_FN), f"the bound device stopped being served: {edu['status']}\n{agent.logs()}"
        assert ready(podnode, DISPLAY_FN, "WriteBlocked"), "still blocked while the holder holds on"
        assert container(agent, "binder").get("restartCount", 0) == before.get("restartCount", 0), \
            "the binder container came back while its child is blocked: this test's account of the runtime is wrong"
        assert "D" in binder_states(guest).values(), "the write returned: the test proves nothing"
    finally:
        holder.stop()
    let_go = time.monotonic()
    try:
        wait(lambda: container(agent, "binder").get("restartCount", 0) > before.get("restartCount", 0)
             and "running" in container(agent, "binder").get("state", {}), 240,
             "the binder container running again once the write returned")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_stopping(podnode, agent, before)}") from None
    TIMINGS["binder killed behind a blocked write: running again after the holder let go"] = time.monotonic() - let_go
    wait_drivers(guest, {DISPLAY_FN: "vfio-pci", AUDIO_FN: "vfio-pci"}, timeout=240)
    wait(lambda: served(podnode, DISPLAY_FN), 240, "the display Ready")
    TIMINGS["binder killed behind a blocked write: the blocked group Ready after the holder let go"] = time.monotonic() - let_go
    assert container(agent, "binder-standby").get("restartCount", 0) == 0
    for address_ in (DISPLAY_FN, DUAL[0], EDU_FN):
        assign(podnode, address_, "")
    wait_drivers(guest, {DISPLAY_FN: DISPLAY.driver, AUDIO_FN: AUDIO.driver, EDU_FN: EDU.driver,
                         **dict.fromkeys(DUAL, E1000E.driver)}, timeout=240)  # fmt: skip


def test_the_agent_pod_deleted_as_a_rollout_does_loses_nothing(podnode, agent, tenant):
    guest = podnode.guest
    assign(podnode, EDU_FN, tenant)
    wait_drivers(guest, {EDU_FN: "vfio-pci"}, timeout=240)
    wait(lambda: served(podnode, EDU_FN), 240, "edu handed out and Ready")
    pod = launcher(agent, tenant, resource_of(podnode, EDU_FN))
    wait(lambda: opened(agent, tenant, pod), 300, "the launcher's process to open the group")
    old = agent.name
    deleted = time.monotonic()
    agent.delete()  # SIGTERM to both containers, as a DaemonSet rollout deletes its pods
    TIMINGS["rollout: old pod gone"] = time.monotonic() - deleted
    assert drivers(guest, [EDU_FN]) == {EDU_FN: "vfio-pci"}, "the held device was given back when the agent stopped"
    agent.create()
    wait(agent.running, 300, "the new agent pod Running")
    wait(lambda: served(podnode, EDU_FN), 240, "edu Ready again, served by the new pod")
    TIMINGS["rollout: new pod serving"] = time.monotonic() - deleted
    assert agent.name != old
    assert drivers(guest, [EDU_FN]) == {EDU_FN: "vfio-pci"}
    assert opened(agent, tenant, pod), "the launcher lost its device"
    podnode.cluster.kubectl("delete", "pod", "-n", tenant, pod, "--wait=true", timeout=120)
    assign(podnode, EDU_FN, "")
    wait_drivers(guest, {EDU_FN: EDU.driver}, timeout=240)
