"""How a node's agent serves devices: the cluster's default, or the Node's passthrough.io/mode
label where nodes may choose; a label it does not follow says why and what to do."""

from __future__ import annotations

import pytest

from passthrough.agent.mode import Mode, chosen, kept


@pytest.mark.parametrize(("labels", "default_dra", "dra"), [
    (None, False, False), ({}, True, True),
    ({"passthrough.io/mode": "dra"}, False, True), ({"passthrough.io/mode": "device-plugin"}, True, False),
    ({"passthrough.io/mode": "dra"}, True, True), ({"other": "dra"}, False, False),
])  # fmt: skip
def test_where_nodes_choose_the_label_wins_over_the_default(labels, default_dra, dra):
    mode = chosen(labels, default_dra, per_node=True, node="gpu-1")
    assert (mode.dra, mode.problem) == (dra, "")
    assert mode.name == ("dra" if dra else "device-plugin")


@pytest.mark.parametrize("value", ["DRA", "deviceplugin", "", "true"])
def test_a_label_that_names_no_mode_gets_the_default_and_says_what_to_do(value):
    mode = chosen({"passthrough.io/mode": value}, True, per_node=True, node="gpu-1")
    assert mode.dra
    assert mode.problem == (f"Node gpu-1's label passthrough.io/mode={value} is neither dra nor device-plugin; serving in the "
                            "cluster's default mode, dra. Set it to dra or device-plugin, or remove it, then restart the "
                            "node's agent.")  # fmt: skip


def test_where_nodes_do_not_choose_a_label_that_differs_is_not_followed_and_says_how_to_let_them():
    mode = chosen({"passthrough.io/mode": "dra"}, False, per_node=False, node="gpu-1")
    assert not mode.dra
    assert "agent.devicePlugin.perNode is false" in mode.problem and "serving in the cluster's mode, device-plugin" in mode.problem
    # One that agrees with the cluster's mode is followed, with nothing to say.
    assert chosen({"passthrough.io/mode": "device-plugin"}, False, per_node=False) == chosen(None, False, per_node=False)


def test_a_node_whose_devices_are_held_in_the_mode_it_served_in_stays_in_it_until_they_let_go():
    to_plugins = chosen({"passthrough.io/mode": "device-plugin"}, True, per_node=True)
    stays = kept(to_plugins, "dra", ["claim team-a/vm-gpu"], node="gpu-1")
    assert stays.dra and stays.reason == "ModeChangeWaiting"
    assert stays.problem == ("Node gpu-1 is to serve in device-plugin mode, but claim team-a/vm-gpu still holds devices it "
                             "served in dra mode: it stays in dra mode until they let go (their pods end), so that no device "
                             "goes to two users; restart the node's agent then.")  # fmt: skip
    pods = [f"pod team-a/vm-{i} (passthrough.io/pci-{i})" for i in range(7)]
    assert "pod team-a/vm-4 (passthrough.io/pci-4) and 2 more still hold" in kept(Mode(True), "device-plugin", pods).problem
    # Nothing held, the same mode, or a node no agent has served yet: the mode chosen.
    assert kept(to_plugins, "dra", []) is to_plugins
    assert kept(to_plugins, "device-plugin", ["claim team-a/vm-gpu"]) is to_plugins
    assert kept(to_plugins, "", ["claim team-a/vm-gpu"]) is to_plugins
