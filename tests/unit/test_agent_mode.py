"""How a node's agent serves devices: the cluster's default, or the Node's passthrough.io/mode
label where nodes may choose; a label it does not follow says why and what to do."""

from __future__ import annotations

import pytest

from passthrough.agent.mode import chosen


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
