"""Busy devices on a real kernel, through the real agent in the guest (`node`, --write-deadline=3s).

- A group a VMM holds (a nested QEMU with it open) is never unbound: the agent says
  HeldByProcess and gives the group back once the VMM exits.
- A write that blocks anyway: binding the display + audio slot while a process holds the audio
  function's sound device open. snd_hda_intel's remove waits for every open file of its card
  (snd_card_free), as the NVIDIA driver's does for nvidia-persistenced and CUDA processes, and
  no look before the write can see that holder. The agent reports WriteBlocked after its
  deadline, goes on with other devices, finishes the bind once the holder lets go, and still
  gives the group back later (what the late write moved is the agent's). Run again at the end
  of the session (`rk_last`), SIGTERM stops the agent while the write is blocked.
- vfio-pci not loaded: VfioNotLoaded with what to do, the node labelled passthrough.io/vfio=false,
  and the bind done once it is loaded.
"""

from __future__ import annotations

import json
import time

import pytest

from e2e.guest.machine import AUDIO, DISPLAY, E1000E, EDU, address
from e2e.guest.node import assign, condition, drivers, events, ready, wait, wait_drivers
from e2e.guest.vmm import NestedVmm
from tests.realkernel.conftest import WRITE_DEADLINE

DUAL = [address("dualnic", 0), address("dualnic", 1)]
DISPLAY_FN, AUDIO_FN = address("gpu", 0), address("gpu", 1)
GPU_ORIGINAL = {DISPLAY_FN: DISPLAY.driver, AUDIO_FN: AUDIO.driver}
EDU_FN = address("edu")
MODPROBE = ("/run/rk/busybox", "modprobe")  # the guest's root is the host's, which has no kmod
RMMOD = ("/run/rk/busybox", "rmmod")


def on(addresses, driver: str) -> dict[str, str]:
    return dict.fromkeys(addresses, driver)


def served(node, address_: str):
    """The device handed out (Assigned=True), bound and Ready=True."""
    device = node.devices()[address_]
    return condition(device, "Assigned").get("status") == "True" and condition(device, "Ready").get("status") == "True"


def hold_sound_device(guest, address_: str):
    """A process with the card of `address_` (an HDA controller) open; returns it once it holds it."""
    card = guest.sh(f"ls /sys/bus/pci/devices/{address_}/sound").stdout.split()[0]  # card0
    control = f"/dev/snd/controlC{card[len('card'):]}"
    holder = guest.spawn("snd-holder", ["/bin/sh", "-c", f"exec sleep 100000 <{control}"])
    wait(lambda: guest.run("readlink", f"/proc/{holder.pid}/fd/0", check=False).stdout.strip() == control,
         30, f"a process to hold {control}")  # fmt: skip
    return holder


_BINDERS = """
import os
result = {}
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        cmdline = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')
        stat = open(f'/proc/{pid}/stat').read()
    except OSError:
        continue
    if b'passthrough.pci.binder' in cmdline or (b'binder' in cmdline and any(a.startswith(b'--listen=') for a in cmdline)):
        result[pid] = stat.rsplit(')', 1)[1].split()[0]
"""


def binder_states(guest) -> dict[str, str]:
    """The binder's processes in the guest, the agent's children (`python -m passthrough.pci.binder`)
    or the binder container's (`passthrough binder --listen`): pid -> state (D: blocked in the kernel)."""
    return guest.python(_BINDERS)


def test_a_group_a_vmm_holds_stays_on_vfio_pci_until_the_vmm_exits(guest, node, tenant):
    assign(node, DUAL[0], tenant)
    wait_drivers(guest, on(DUAL, "vfio-pci"), timeout=240)
    wait(lambda: served(node, DUAL[0]), 120, "the dual NIC handed out and Ready", node)
    with NestedVmm(guest, [DUAL[0]]):
        unassigned = time.monotonic()
        assign(node, DUAL[0], "")
        held = wait(lambda: ready(node, DUAL[0], "HeldByProcess"), 120, "Ready=False/HeldByProcess", node)
        said = time.monotonic() - unassigned
        assert held["status"] == "False" and "/dev/vfio/" in held["message"], held
        assert ready(node, DUAL[1], "HeldByProcess"), "the whole group waits"
        time.sleep(2 * WRITE_DEADLINE)  # long enough for a blocked write to have shown
        assert drivers(guest, DUAL) == on(DUAL, "vfio-pci"), "nothing of a held group is unbound"
        assert not ready(node, DUAL[0], "WriteBlocked")
        kinds = {(e["type"], e["reason"]) for e in events(node, DUAL[0])}
        assert ("Normal", "HeldByProcess") in kinds, kinds
        exited = time.monotonic()
    back = wait_drivers(guest, on(DUAL, E1000E.driver), timeout=120)
    given = time.monotonic() - exited
    wait(lambda: condition(node.devices()[DUAL[0]], "Ready").get("status") == "True", 60, "Ready=True again", node)
    print(f"\nheld by a VMM: HeldByProcess {said:.1f}s after the unassignment; given back {given:.1f}s after the VMM "
          f"exited (drivers changed in the guest {back:.1f}s into the last poll)")  # fmt: skip


def test_a_write_that_blocks_is_write_blocked_and_the_agent_goes_on(guest, node, tenant):
    holder = hold_sound_device(guest, AUDIO_FN)
    try:
        started = time.monotonic()
        assign(node, DISPLAY_FN, tenant)
        blocked = wait(lambda: ready(node, DISPLAY_FN, "WriteBlocked"), 180, "Ready=False/WriteBlocked", node)
        said = time.monotonic() - started
        assert f"has not returned after {WRITE_DEADLINE:g} s" in blocked["message"], blocked
        assert ready(node, AUDIO_FN, "WriteBlocked"), "the whole group is left alone"
        kinds = {(e["type"], e["reason"]) for e in events(node, DISPLAY_FN)}
        assert ("Warning", "WriteBlocked") in kinds, kinds
        # The kernel's side: the display moved, the audio function's unbind waits in D state.
        assert drivers(guest, [DISPLAY_FN]) == {DISPLAY_FN: "vfio-pci"}
        assert "D" in binder_states(guest).values(), f"no binder child blocked in the kernel: {binder_states(guest)}"

        # The agent goes on: another device is handed out, bound and served meanwhile.
        other = time.monotonic()
        assign(node, EDU_FN, tenant)
        wait_drivers(guest, {EDU_FN: "vfio-pci"}, timeout=120)
        wait(lambda: served(node, EDU_FN), 120, "edu handed out and Ready while the write is blocked", node)
        print(f"\nWriteBlocked {said:.1f}s after the assignment; another device bound and Ready "
              f"{time.monotonic() - other:.1f}s after its assignment meanwhile")
        assert ready(node, DISPLAY_FN, "WriteBlocked"), "still blocked while the holder holds on"
    finally:
        let_go = time.monotonic()
        holder.stop()
    # The write returns, the bind completes, the agent serves the group.
    wait_drivers(guest, on([DISPLAY_FN, AUDIO_FN], "vfio-pci"), timeout=120)
    wait(lambda: served(node, DISPLAY_FN), 120, "the display Ready once the write returned", node)
    print(f"holder let go: the group bound and Ready {time.monotonic() - let_go:.1f}s later")

    # What the late write moved is the agent's: it gives the group back.
    assign(node, DISPLAY_FN, "")
    assign(node, EDU_FN, "")
    wait_drivers(guest, {**GPU_ORIGINAL, EDU_FN: EDU.driver}, timeout=120)


def test_vfio_pci_not_loaded_is_said_with_what_to_do(guest, node, tenant):
    try:
        # vfio_pci alone: `modprobe -r` also tries vfio, which vfio_iommu_type1 holds, and fails.
        guest.run(*RMMOD, "vfio_pci", check=False)
        assert "vfio_pci " not in guest.read("/proc/modules"), "vfio_pci could not be unloaded"
        assign(node, EDU_FN, tenant)
        found = wait(lambda: ready(node, EDU_FN, "VfioNotLoaded"), 120, "Ready=False/VfioNotLoaded", node)
        assert "modprobe vfio-pci" in found["message"], found
        label = lambda: json.loads(node.cluster.kubectl("get", "node", node.name, "-o", "json").stdout)[
            "metadata"]["labels"].get("passthrough.io/vfio")  # fmt: skip
        wait(lambda: label() == "false", 60, "the node labelled passthrough.io/vfio=false", node)
        assert drivers(guest, [EDU_FN]) == {EDU_FN: ""}, "nothing written"
    finally:
        guest.run(*MODPROBE, "vfio-pci")
    loaded = time.monotonic()
    wait_drivers(guest, {EDU_FN: "vfio-pci"}, timeout=120)
    wait(lambda: served(node, EDU_FN), 120, "edu bound and Ready once vfio-pci is loaded", node)
    print(f"\nvfio-pci loaded: edu bound and Ready {time.monotonic() - loaded:.1f}s later (the agent retries)")
    assign(node, EDU_FN, "")
    wait_drivers(guest, {EDU_FN: ""}, timeout=120)


@pytest.mark.rk_last(2)
def test_sigterm_stops_the_agent_while_a_write_is_blocked(guest, node, tenant):
    holder = hold_sound_device(guest, AUDIO_FN)
    try:
        assign(node, DISPLAY_FN, tenant)
        wait(lambda: ready(node, DISPLAY_FN, "WriteBlocked"), 180, "Ready=False/WriteBlocked", node)
        agent = node.agent
        stopping = time.monotonic()
        agent.signal(15)
        rc = guest.call("wait", pid=agent.pid, timeout=30, wait=60)["rc"]
        took = time.monotonic() - stopping
        print(f"\nSIGTERM with a write blocked: the agent exited ({rc}) in {took:.1f}s")
        assert rc == 0, agent.output()
        assert took < 15, f"the agent took {took:.1f}s to exit"
    finally:
        holder.stop()
    # The binder child that was blocked dies once its write returns: no process is left behind.
    wait(lambda: not binder_states(guest), 60, "the binder child to exit")
