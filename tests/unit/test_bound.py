"""What the agent bound is kept across restarts, also when a bind's answer is lost: each bind is
recorded as intended before it runs, and settled from the driver links afterwards."""

from __future__ import annotations

import json

from e2e.fakesysfs import gpu_node
from passthrough.agent.bound import Bound

GPU, AUDIO = "0000:3b:00.0", "0000:3b:00.1"
OTHER_GPU = "0000:af:00.0"


def test_a_bind_whose_answer_was_lost_is_settled_from_the_driver_links_after_a_restart(tmp_path):
    host = gpu_node(tmp_path / "host")
    state = tmp_path / "state"
    Bound(state).intend(host.sysfs, [GPU, AUDIO])  # then the agent restarts, its write blocked
    # The display reached vfio-pci; the audio function's unbind is blocked: no driver yet.
    host.bind(GPU, "vfio-pci")
    host.bind(AUDIO, None)
    restarted = Bound(state)
    restarted.settle(host.sysfs)
    assert restarted.devices == {GPU: ""} and restarted.intended == {AUDIO: ""}
    # The write returns and the job goes on without anyone to answer: the audio function lands too.
    host.bind(AUDIO, "vfio-pci")
    again = Bound(state)
    again.settle(host.sysfs)
    assert again.devices == {GPU: "", AUDIO: ""} and again.intended == {}
    assert json.loads((state / "bound.json").read_text()) == {GPU: "", AUDIO: ""}
    assert json.loads((state / "binding.json").read_text()) == {}


def test_a_bind_that_moved_nothing_leaves_nothing_to_give_back(tmp_path):
    host = gpu_node(tmp_path / "host")
    bound = Bound(tmp_path / "state")
    host.bind(OTHER_GPU, "vfio-pci")  # an admin's pin: never the agent's to give back
    bound.intend(host.sysfs, [GPU, AUDIO, OTHER_GPU])
    assert bound.intended == {GPU: "", AUDIO: ""}
    # Rolled back (or refused): both on their own drivers again.
    bound.settle(host.sysfs)
    assert bound.devices == {} and bound.intended == {}


def test_the_answer_wins_over_the_intent(tmp_path):
    host = gpu_node(tmp_path / "host")
    bound = Bound(tmp_path / "state")
    bound.intend(host.sysfs, [GPU])
    host.bind(GPU, "vfio-pci")
    bound.add({GPU: "nvidia"})  # the binder's answer: the override it had before
    bound.settle(host.sysfs)
    assert bound.devices == {GPU: "nvidia"} and bound.intended == {}


def test_an_override_the_agents_own_bind_left_is_not_what_it_gives_back(tmp_path):
    """A bind cut short left vfio-pci in driver_override; the next bind's answer finds it there.
    Giving back that would send the device to vfio-pci again on the re-probe."""
    host = gpu_node(tmp_path / "host")
    bound = Bound(tmp_path / "state")
    bound.intend(host.sysfs, [GPU, AUDIO])
    bound.add({GPU: "", AUDIO: "vfio-pci"})
    assert bound.devices == {GPU: "", AUDIO: ""}
    bound.add({OTHER_GPU: "vfio-pci"})  # not intended: an admin's pin, as found
    assert bound.devices[OTHER_GPU] == "vfio-pci"
