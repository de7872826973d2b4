"""The simulation tells the truth: e2e/guest/compare.py's scenario (bind, open twice, half a group,
the unbind of a held device, an override naming a missing driver) on the real kernel in the guest
and on e2e/fakekernel.py over a FakeHost of the same shape, with the same system calls; the
observations must be equal. Where they are not, the kernel is right and the simulation is fixed.

The one thing done differently is holding: on the kernel a nested QEMU opens the device with
`-device vfio-pci` (what vfio-pci's remove then waits for); the simulation has FakeHost.hold.
"""

from __future__ import annotations

import os

import pytest

from e2e.fakekernel import FakeKernel
from e2e.fakesysfs import FakeHost
from e2e.guest.compare import observe
from e2e.guest.machine import E1000E, TESTDEV, address

SINGLE = address("testdev")
PAIR = (address("dualnic", 0), address("dualnic", 1))

_ON_THE_KERNEL = """
import subprocess, time
from e2e.guest.compare import observe
from e2e.guest.qmp import QMP
vmm = {}
def hold():
    sock = '/run/compare-vmm.qmp'
    argv = ['qemu-system-x86_64', '-accel', 'tcg', '-S', '-machine', 'q35', '-m', '128', '-nodefaults',
            '-display', 'none', '-serial', 'none', '-qmp', f'unix:{sock},server=on,wait=off',
            '-device', f"vfio-pci,host={args['single']},id=hostdev0"]
    vmm['qemu'] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:  # up once its monitor answers: the device is open then
        if vmm['qemu'].poll() is not None:
            raise RuntimeError(f"the nested QEMU exited ({vmm['qemu'].returncode})")
        try:
            with QMP(sock, timeout=5) as monitor:
                monitor.execute('query-status')
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
def let_go():
    qemu = vmm.pop('qemu', None)
    if qemu is not None:
        qemu.terminate()
        qemu.wait(60)
try:
    result = observe('/sys', '/dev', args['single'], tuple(args['pair']), hold, let_go)
finally:
    let_go()
"""


def fake_host(root) -> FakeHost:
    """The guest's testdev and dual NIC, as a FakeHost: a function with no driver in a group of
    its own, and two e1000e functions sharing one."""
    host = FakeHost(root)
    host.add_device(SINGLE, TESTDEV.vendor_id, TESTDEV.device_id, TESTDEV.class_code, iommu_group=4)
    for function in PAIR:
        host.add_device(function, E1000E.vendor_id, E1000E.device_id, E1000E.class_code, driver=E1000E.driver,
                        iommu_group=6)  # fmt: skip
    return host


def test_the_simulation_answers_the_scenario_as_the_kernel_does(guest, tmp_path):
    problem = FakeKernel.unavailable(tmp_path)
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)
    kernel = guest.python(_ON_THE_KERNEL, single=SINGLE, pair=list(PAIR), timeout=400)
    host = fake_host(tmp_path)
    with FakeKernel(host) as fake:
        simulated = observe(host.sysfs, host.dev, SINGLE, PAIR, lambda: host.hold_device(SINGLE),
                            lambda: host.release(SINGLE))  # fmt: skip
    assert not fake.errors
    # JSON from the guest: tuples came back as lists.
    simulated["seen"] = {k: list(v) if isinstance(v, tuple) else v for k, v in simulated["seen"].items()}
    print(f"\nkernel {guest.kernel.package}: {kernel['timings']}\nsimulation: {simulated['timings']}")
    for key in kernel["seen"]:
        print(f"  {key:40} kernel {kernel['seen'][key]!r:32} simulation {simulated['seen'].get(key)!r}")
    differ = {k: (kernel["seen"][k], simulated["seen"].get(k)) for k in kernel["seen"] if kernel["seen"][k] != simulated["seen"].get(k)}
    assert not differ, f"the simulation disagrees with the kernel (kernel, simulation): {differ}"
    assert kernel["seen"]["4 held unbind: blocked"] and kernel["seen"]["4 driver after"] == ""
