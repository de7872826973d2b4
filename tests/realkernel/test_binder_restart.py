"""An agent restarted while one of its writes is blocked in the kernel, on a real kernel (`node`:
the real agent and kubelet in the guest, --write-deadline=3s).

The write: binding the display + audio slot while a process holds the audio function's sound
device open (snd_hda_intel's remove waits for it, as the NVIDIA driver's does for its users).
The agent is stopped (SIGTERM) and started again with the write still blocked: its binder child
is left in the kernel, and the new agent knows nothing of it. The new agent must not read what
waits behind that write (the audio function's driver_override): it reports and serves another
device meanwhile. Once the holder lets go, the old child finishes the bind for nobody; what it
moved is the agent's all the same (recorded before the job), and is given back when unassigned.
"""

from __future__ import annotations

import time

import pytest

from e2e.guest.machine import EDU
from e2e.guest.node import assign, ready, wait, wait_drivers
from tests.realkernel.conftest import WRITE_DEADLINE
from tests.realkernel.test_busy import AUDIO_FN, DISPLAY_FN, EDU_FN, GPU_ORIGINAL, binder_states, hold_sound_device, on, served


@pytest.mark.rk_last(1)
def test_an_agent_restarted_behind_a_blocked_write_goes_on_and_gives_back_what_the_write_moved(guest, node, tenant):
    holder = hold_sound_device(guest, AUDIO_FN)
    try:
        assign(node, DISPLAY_FN, tenant)
        wait(lambda: ready(node, DISPLAY_FN, "WriteBlocked"), 180, "Ready=False/WriteBlocked", node)
        stopping = time.monotonic()
        node.agent.signal(15)
        rc = guest.call("wait", pid=node.agent.pid, timeout=30, wait=60)["rc"]
        took = time.monotonic() - stopping
        assert rc == 0 and took < 10, f"the agent exited ({rc}) {took:.1f}s after SIGTERM\n{node.agent.output()}"
        assert "D" in binder_states(guest).values(), "the old binder child is no longer blocked in the kernel"

        node.start_agent(f"--write-deadline={WRITE_DEADLINE:g}s")
        restarted = time.monotonic()
        # The restarted agent goes on: another device is handed out, bound and served.
        assign(node, EDU_FN, tenant)
        wait_drivers(guest, {EDU_FN: "vfio-pci"}, timeout=240)
        wait(lambda: served(node, EDU_FN), 240, "edu handed out and Ready after the restart", node)
        print(f"\nSIGTERM with a write blocked: exited in {took:.1f}s; restarted, another device bound and Ready "
              f"{time.monotonic() - restarted:.1f}s later")  # fmt: skip
        wait(lambda: ready(node, DISPLAY_FN, "WriteBlocked"), 120, "the display still WriteBlocked", node)
    finally:
        let_go = time.monotonic()
        holder.stop()
    wait_drivers(guest, on([DISPLAY_FN, AUDIO_FN], "vfio-pci"), timeout=120)
    wait(lambda: served(node, DISPLAY_FN), 180, "the display Ready once the write returned", node)
    print(f"holder let go: the group bound and Ready {time.monotonic() - let_go:.1f}s later")
    # What the write moved for the agent before it restarted is the agent's: given back.
    assign(node, DISPLAY_FN, "")
    assign(node, EDU_FN, "")
    wait_drivers(guest, {**GPU_ORIGINAL, EDU_FN: EDU.driver}, timeout=180)
