"""How this node's agent serves devices: through device plugins or as a DRA driver. The cluster's
default (`--dra`), or, where nodes may choose (`--per-node-mode`), the Node's own label
passthrough.io/mode, read once at start-up: a change takes effect at the agent's next start, since
moving a running node from one mode to the other would hand devices that pods hold to another server.
For the same reason a node whose devices are still held in the mode it served in (its Node's
passthrough.io/serving label: prepared claims, or pods holding its device plugins' resources) stays
in that mode until they let go."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from passthrough.api.labels import DEVICE_PLUGIN_MODE, DRA_MODE, MODE_LABEL

MODES = (DRA_MODE, DEVICE_PLUGIN_MODE)


@dataclass(frozen=True)
class Mode:
    dra: bool
    problem: str = ""  # why the label was not followed, for the log and a Warning Event on the Node
    reason: str = ""  # the Event's: ModeLabelNotFollowed (no mode named, or nodes do not choose), ModeChangeWaiting

    @property
    def name(self) -> str:
        return DRA_MODE if self.dra else DEVICE_PLUGIN_MODE


def chosen(labels: Mapping[str, str] | None, default_dra: bool, per_node: bool, node: str = "") -> Mode:
    """The mode this agent serves in: the Node's label where nodes may choose and it names one,
    the default otherwise; a label that is not followed says why and what to do."""
    default = Mode(default_dra)
    value = (labels or {}).get(MODE_LABEL)
    if value is None:
        return default
    where = f"Node {node}'s label {MODE_LABEL}={value}" if node else f"label {MODE_LABEL}={value}"
    if value not in MODES:
        return Mode(default_dra, f"{where} is neither {DRA_MODE} nor {DEVICE_PLUGIN_MODE}; serving in the cluster's default "
                                 f"mode, {default.name}. Set it to {DRA_MODE} or {DEVICE_PLUGIN_MODE}, or remove it, "
                                 "then restart the node's agent.", "ModeLabelNotFollowed")  # fmt: skip
    if not per_node and value != default.name:
        return Mode(default_dra, f"{where} is not followed: nodes do not choose their mode in this installation "
                                 f"(the chart's agent.devicePlugin.perNode is false); serving in the cluster's mode, "
                                 f"{default.name}. Set agent.devicePlugin.perNode=true to let them, or remove the label.",
                    "ModeLabelNotFollowed")  # fmt: skip
    return Mode(value == DRA_MODE)


def kept(mode: Mode, serving: str, holders: Sequence[str], node: str = "") -> Mode:
    """`mode`, unless the node served in the other mode (`serving`, its agent's last word) and
    `holders` (what still holds devices served that way) is not empty: then that mode, saying why.
    Each server keeps its own users apart, neither knows the other's: a device served both ways
    could go to two users at once."""
    if serving not in MODES or serving == mode.name or not holders:
        return mode
    listed = ", ".join(holders[:5]) + (f" and {len(holders) - 5} more" if len(holders) > 5 else "")
    where = f"Node {node}" if node else "This node"
    return Mode(serving == DRA_MODE, f"{where} is to serve in {mode.name} mode, but {listed} still "
                                     f"{'holds' if len(holders) == 1 else 'hold'} devices it served in {serving} mode: it "
                                     f"stays in {serving} mode until they let go (their pods end), so that no device goes to "
                                     "two users; restart the node's agent then.", "ModeChangeWaiting")  # fmt: skip
