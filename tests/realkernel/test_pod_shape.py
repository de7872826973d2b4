"""The node's guarantees with the agent's binder as the chart shapes it, on a real kernel.

The chart runs the bind sequence in the agent pod's `binder` container and its identical
`binder-standby`: uid 0, no capability, no new privileges, RuntimeDefault seccomp, a read-only
root, the runtime's default device rules (no /dev/vfio/<group> among them) and the mounts of the
rendered DaemonSet. Here those containers are runc (built by e2e/oci.py) in the guest, their
configs made from `helm template`'s DaemonSet; the agent beside them is the real agent process
with a `--binder-socket` for each, in the chart's order, on a node of its own (the
real kubelet in the guest, `rk-shape-<id>`). The bare-root agent of the other real-kernel tests
opens the group node and sees a VMM's EBUSY; this container gets EPERM instead, and must still
never unbind a group a VMM holds.
"""

from __future__ import annotations

import json
import shlex
import time
import uuid

import pytest

from e2e import chart, oci
from e2e.guest.kernel import SERIES
from e2e.guest.machine import AUDIO, DISPLAY, E1000E, EDU, address
from e2e.guest.node import GuestNode, assign, condition, drivers, events, ready, wait, wait_drivers
from e2e.guest.vmm import NestedVmm
from tests.realkernel.conftest import WRITE_DEADLINE, _absent

pytestmark = pytest.mark.realkernel

DUAL = [address("dualnic", 0), address("dualnic", 1)]
DISPLAY_FN, AUDIO_FN, EDU_FN = address("gpu", 0), address("gpu", 1), address("edu")
_ENABLE = """
result = {a: int(open(f'/sys/bus/pci/devices/{a}/enable').read()) for a in args['addresses']}
"""
_BIND = """
import os
from pathlib import Path
from passthrough.pci import vfio
group = int(os.path.basename(os.readlink(f"/sys/bus/pci/devices/{args['addresses'][0]}/iommu_group")))
if args['bind']:
    vfio.bind_group(Path('/sys'), Path('/dev'), group, args['addresses'])
else:
    vfio.release_group(Path('/sys'), Path('/dev'), group, args['addresses'])
result = group
"""
_BUNDLE = """
from pathlib import Path
from e2e import oci
oci.bundle(args['template'], args['container'], Path(args['dir']), args['argv'], cgroup=args['cgroup'])
"""
# What the binder's container meets: the group node (EPERM from its device cgroup) and the counts.
_PROBE = """
import errno, json, os, sys
group, addresses = int(sys.argv[1]), sys.argv[2:]
try:
    os.close(os.open(f'/host/dev/vfio/{group}', os.O_RDWR))
    opened = 'opened'
except OSError as e:
    opened = errno.errorcode[e.errno]
counts = {a: int(open(f'/host/sys/bus/pci/devices/{a}/enable').read()) for a in addresses}
print(json.dumps({'open': opened, 'enable': counts, 'uid': os.getuid(),
                  'caps': open('/proc/self/status').read().split('CapEff:')[1].split()[0]}))
"""


@pytest.fixture(scope="module")
def runc(request):
    try:
        return oci.ensure_runc()
    except oci.RuncUnavailable as exc:
        _absent(request, str(exc))


@pytest.fixture(scope="module")
def daemonset(tmp_path_factory):
    """The agent's pod template as `helm install` with the chart's defaults would make it."""
    objects = chart.template(chart.helm(tmp_path_factory.mktemp("helm-home")), "passthrough", "passthrough-system")
    return oci.pod_template(objects, "DaemonSet", "-agent")


class Binder:
    """One of the chart's binder containers (`binder`, `binder-standby`), run by runc in the guest."""

    def __init__(self, guest, runc, template, name: str, container: str = "binder") -> None:
        self.guest, self.runc, self.name = guest, str(runc), name
        self.bundle = f"/run/{name}"
        command = oci.container(template, container)["command"]
        assert command[0] == "passthrough", command  # the image's entry point: here the checkout's
        argv = [str(guest.python_path), "-m", "passthrough.cli", *command[1:]]
        guest.python(_BUNDLE, template=template, container=container, dir=self.bundle, argv=argv, cgroup=f"/{name}")
        listen = next(a.split("=", 1)[1] for a in command if a.startswith("--listen="))
        mount = next(m for m in oci.container(template, container)["volumeMounts"] if listen.startswith(m["mountPath"] + "/"))
        self.socket = f"{self.bundle}/volumes/{mount['name']}{listen[len(mount['mountPath']):]}"
        self.process = guest.spawn(name, [self.runc, "--root", "/run/runc", "run", "--bundle", self.bundle, name])
        wait(lambda: self._listening() or self._exited(), 120, f"the binder container to listen on {self.socket}")
        assert self._listening(), f"the binder container exited:\n{self.process.output()}"

    def _listening(self) -> bool:
        return self.guest.run("test", "-S", self.socket, check=False).rc == 0

    def _exited(self) -> bool:
        return self.process.poll() is not None

    def exec(self, *argv: str) -> str:
        """`argv` in the running container (its user, capabilities, seccomp, cgroup, mounts)."""
        return self.guest.run(self.runc, "--root", "/run/runc", "exec", self.name, *argv, timeout=120).stdout

    def stop(self) -> str:
        self.guest.run(self.runc, "--root", "/run/runc", "kill", self.name, "KILL", check=False)
        self.process.stop()
        self.guest.run(self.runc, "--root", "/run/runc", "delete", "--force", self.name, check=False)
        self.guest.run("rm", "-rf", self.bundle, check=False)
        return self.process.output(60)


@pytest.fixture(scope="module")
def shaped(guest, cluster, operator, runc, daemonset):
    """Node rk-shape-<id>: the real kubelet, the binder containers, the agent that uses them."""
    name = f"rk-shape-{uuid.uuid4().hex[:6]}"
    node = GuestNode(guest, cluster, name)
    binders: list[Binder] = []
    try:
        started = time.monotonic()
        for container in ("binder", "binder-standby"):
            binders.append(Binder(guest, runc, daemonset, f"{container}-{name}", container))
        node.timings["binder containers start"] = time.monotonic() - started
        node.start_kubelet()
        node.start_agent(f"--write-deadline={WRITE_DEADLINE:g}s", *(f"--binder-socket={b.socket}" for b in binders))
        started = time.monotonic()
        wait(lambda: set(DUAL) <= set(node.devices()), 300, f"the agent on {name} to report", node)
        node.timings["agent first report"] = time.monotonic() - started
        print(f"\nnode {name} with the chart's binder containers: " + ", ".join(f"{k} {v:.1f}s" for k, v in node.timings.items()))
        yield node, binders
    finally:
        try:
            log = node.stop()
        finally:
            binder_logs = [binder.stop() for binder in binders]
    assert "Traceback" not in log, log
    for binder_log in binder_logs:
        assert "Traceback" not in binder_log, binder_log


def test_a_group_a_vmm_holds_stays_bound_when_the_binder_runs_as_the_chart_shapes_it(guest, shaped, tenant):
    node, binders = shaped
    binder = binders[0]
    assign(node, DUAL[0], tenant)
    wait_drivers(guest, dict.fromkeys(DUAL, "vfio-pci"), timeout=240)
    wait(lambda: condition(node.devices()[DUAL[0]], "Ready").get("status") == "True", 120, "the dual NIC Ready", node)
    group = int(guest.sh(f"basename $(readlink /sys/bus/pci/devices/{DUAL[0]}/iommu_group)").stdout)
    probe = [str(guest.python_path), "-c", _PROBE, str(group), *DUAL]
    # Each container as the chart makes it, the standby as the first: root without a capability,
    # the group node refused.
    for each in binders:
        alone = json.loads(each.exec(*probe))
        assert alone["uid"] == 0 and int(alone["caps"], 16) == 0, (each.name, alone)
        assert alone["open"] == "EPERM" and alone["enable"] == dict.fromkeys(DUAL, 0), (each.name, alone)
    with NestedVmm(guest, [DUAL[0]]) as vmm:
        held = json.loads(binder.exec(*probe))
        assert held["open"] == "EPERM" and held["enable"][DUAL[0]] >= 1, f"what the binder sees while held: {held}"
        unassigned = time.monotonic()
        assign(node, DUAL[0], "")
        found = wait(lambda: ready(node, DUAL[0], "HeldByProcess"), 120, "Ready=False/HeldByProcess", node)
        said = time.monotonic() - unassigned
        assert f"{DUAL[0]} is in use (its enable count is" in found["message"], found
        assert ready(node, DUAL[1], "HeldByProcess"), "the whole group waits"
        # The binder answered HeldByProcess before any write: the group is as it was, the VM keeps it.
        assert drivers(guest, DUAL) == dict.fromkeys(DUAL, "vfio-pci"), "nothing of a held group is unbound"
        assert DUAL[0] in vmm.host_devices(), "the nested VM lost its device"
        kinds = {(e["type"], e["reason"]) for e in events(node, DUAL[0])}
        assert ("Normal", "HeldByProcess") in kinds and ("Normal", "GivenBack") not in kinds, kinds
        exited = time.monotonic()
    wait_drivers(guest, dict.fromkeys(DUAL, E1000E.driver), timeout=120)
    print(f"\nbinder in the chart's shape: HeldByProcess {said:.1f}s after the unassignment; given back "
          f"{time.monotonic() - exited:.1f}s after the VMM exited")  # fmt: skip


def test_a_write_that_blocks_in_the_binder_container_leaves_the_agent_serving(guest, shaped, tenant):
    """The binder container's child blocks in the kernel (snd_hda_intel's remove waits for an open
    sound device): the agent reports WriteBlocked, binds and serves another device meanwhile, and
    finishes once the holder lets go; the late child's answer finds the agent gone from it."""
    node, _ = shaped
    card = guest.sh(f"ls /sys/bus/pci/devices/{AUDIO_FN}/sound").stdout.split()[0]
    control = f"/dev/snd/controlC{card[len('card'):]}"
    holder = guest.spawn("shape-snd-holder", ["/bin/sh", "-c", f"exec sleep 100000 <{control}"])
    try:
        wait(lambda: guest.run("readlink", f"/proc/{holder.pid}/fd/0", check=False).stdout.strip() == control,
             30, f"a process to hold {control}")  # fmt: skip
        assign(node, DISPLAY_FN, tenant)
        blocked = wait(lambda: ready(node, DISPLAY_FN, "WriteBlocked"), 180, "Ready=False/WriteBlocked", node)
        assert f"has not returned after {WRITE_DEADLINE:g} s" in blocked["message"], blocked
        other = time.monotonic()
        assign(node, EDU_FN, tenant)
        wait_drivers(guest, {EDU_FN: "vfio-pci"}, timeout=120)
        wait(lambda: condition(node.devices()[EDU_FN], "Ready").get("status") == "True", 120, "edu Ready meanwhile", node)
        print(f"\nbinder container blocked in a write: another device bound and Ready {time.monotonic() - other:.1f}s "
              "after its assignment")  # fmt: skip
        assert ready(node, DISPLAY_FN, "WriteBlocked"), "still blocked while the holder holds on"
    finally:
        holder.stop()
    wait_drivers(guest, {DISPLAY_FN: "vfio-pci", AUDIO_FN: "vfio-pci"}, timeout=120)
    wait(lambda: condition(node.devices()[DISPLAY_FN], "Ready").get("status") == "True", 120, "the display Ready", node)
    assign(node, DISPLAY_FN, "")
    assign(node, EDU_FN, "")
    wait_drivers(guest, {DISPLAY_FN: DISPLAY.driver, AUDIO_FN: AUDIO.driver, EDU_FN: EDU.driver}, timeout=120)


@pytest.mark.parametrize("series", list(SERIES))
def test_vfio_pci_counts_a_vmm_in_the_enable_count(request, guests, series):
    """The signal a container without the group node reads, on each kernel: vfio-pci's
    pci_enable_device at open, pci_disable_device at the last close."""
    guest = guests.get(request, series)
    group = guest.python(_BIND, addresses=DUAL, bind=True, timeout=240)
    try:
        bound = guest.python(_ENABLE, addresses=DUAL)
        with NestedVmm(guest, [DUAL[0]], name=f"vmm-count-{series}"):
            held = guest.python(_ENABLE, addresses=DUAL)
        after = guest.python(_ENABLE, addresses=DUAL)
    finally:
        guest.python(_BIND, addresses=DUAL, bind=False, timeout=240)
    print(f"\n{guest.kernel.package}: group {group} enable counts bound {bound}, a VMM holding {DUAL[0]} {held}, after {after}")
    assert bound == dict.fromkeys(DUAL, 0) and after == bound
    assert held[DUAL[0]] >= 1 and held[DUAL[1]] == 0, held  # the member the VMM did not open is not counted


def test_the_agent_container_sees_what_iommufd_needs(daemonset):
    """What `vfio.iommufd_device` reads, through the rendered agent container's mounts."""
    agent = oci.container(daemonset, "agent")
    flags = dict(a.split("=", 1) for a in agent["command"] if a.startswith("--") and "=" in a)
    sysfs, dev = flags["--sysfs-root"], flags["--dev-root"]
    seen = {path: oci.host_path(daemonset, "agent", path) for path in (
        f"{sysfs}/class/misc/iommu",  # /dev/iommu, as the kernel records it
        f"{sysfs}/bus/pci/devices/0000:01:00.0/vfio-dev",
        f"{dev}/vfio/devices/vfio0",
    )}  # fmt: skip
    assert seen == {
        f"{sysfs}/class/misc/iommu": "/sys/class/misc/iommu",
        f"{sysfs}/bus/pci/devices/0000:01:00.0/vfio-dev": "/sys/bus/pci/devices/0000:01:00.0/vfio-dev",
        f"{dev}/vfio/devices/vfio0": "/dev/vfio/devices/vfio0",
    }, shlex.join(agent["command"])
